"""`cliffguard bench engine`: our engine vs transformers `generate` on one offline workload, in one run.

Both systems get the same prompts, the same requested output lengths, the same dtype, on the same
machine. Ours runs them as one continuous batch; transformers runs static batches (left-padded,
each batch decoding until its longest request is done). Throughput counts only the tokens each
request asked for. Then the engine's decode step time is set beside a roofline floor measured in
the same run: max((weight bytes + KV bytes the step's sequences read) / measured copy bandwidth,
FLOPs per step / measured matmul rate).

Model shapes we cannot download run on random weights: `--model` names a folder holding only a
config.json (the folder is copied to a temporary one, with the builtin SmolLM2 tokenizer added
when it has none), and both systems build that model with random weights. On a GPU:

    cliffguard bench engine --model bench/models/llama-3-8b --random-weights --dtype bfloat16

`--config-override KEY=VALUE` changes the copied config.json (e.g. fewer layers for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from bench.options import int_list
from engine.roofline import expert_params, experts_read, step_flops
from pools.cli_types import positive_int
from kernels.cpu_linear import PackedLinear, use_packed_linears

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_SOURCE = "builtin:smollm2-135m-instruct"   # lends its tokenizer to config-only folders
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TOPICS = ["the ocean", "prime numbers", "a rainy city", "compilers", "coffee", "the moon landing",
          "bread baking", "graph theory", "jazz", "mountain hiking", "databases", "volcanoes",
          "chess openings", "photosynthesis", "the printing press", "electric cars"]
ASKS = ["Write a short poem about {t}.", "Explain {t} to a ten-year-old.", "Give three facts about {t}.",
        "What is the most surprising thing about {t}? Answer in detail, with an example or two.",
        "Summarise the history of {t} in a paragraph.", "Tell me a joke about {t}."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--num-prompts", type=positive_int, default=64, help="prompts in the workload (default 64)")
    p.add_argument("--min-output", type=positive_int, default=16,
                   help="shortest requested output in tokens (default 16)")
    p.add_argument("--max-output", type=positive_int, default=256,
                   help="longest requested output in tokens (default 256)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="our engine's concurrency limit")
    p.add_argument("--hf-batch-sizes", default="16,64",
                   help="transformers' static batch sizes, comma-separated: one run and one ratio each")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights for a model folder that has only config.json (the builtin SmolLM2 "
                   "tokenizer is added when it has none), e.g. --model bench/models/llama-3-8b")
    p.add_argument("--config-override", action="append", default=[], metavar="KEY=VALUE",
                   help="with --random-weights: change a key of the model's config.json (VALUE read as JSON), "
                   "e.g. num_hidden_layers=4; repeatable")
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="our engine's KV cache budget in MiB (default 2048 on CPU, 8192 on CUDA); it must "
                   "fit the device's 0.9 x memory - weights")
    p.add_argument("--skip-hf", action="store_true", help="measure our engine only")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no decode graphs (the device key enforce_eager), to compare with them")
    p.add_argument("--quantization", choices=("auto", "fp8", "none"), default="auto",
                   help="the device key quantization: fp8 holds the layers' projections in FP8 (a float model "
                   "quantized a row at a time; random weights drawn so), auto keeps an FP8 checkpoint's on CUDA")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="overlapped steps (the device key async_scheduling): auto (on for CUDA), on, off")
    p.add_argument("--also-torch-linear", action="store_true",
                   help="on a CPU, also run our engine with CLIFFGUARD_CPU_LINEAR=torch (torch's sgemm instead "
                   "of packed oneDNN linears), in the same run")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def make_workload(tokenizer, num_prompts: int, min_out: int, max_out: int, seed: int
                  ) -> list[tuple[list[int], int]]:
    """(chat prompt token ids, requested output length) pairs, deterministic for a seed."""
    rng = random.Random(seed)
    work = []
    for i in range(num_prompts):
        text = rng.choice(ASKS).format(t=rng.choice(TOPICS))
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        work.append((ids, rng.randint(min_out, max_out)))
    return work


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU. Timing helpers call it around a measurement."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, *, warmup: int = 1, iters: int = 5,
              before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of `iters` calls of `fn()`, after `warmup` untimed ones.

    CUDA: one pair of CUDA events around each call, read after a single synchronize at the end.
    CPU: perf_counter around each call. `before()` runs untimed ahead of each call (an L2 flush, say).
    """
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)]
            for start, end in events:
                if before is not None:
                    before()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second of a large device-to-device `dst.copy_(src)` (read + write counted), best of `repeats`.

    Default size: 1 GiB on CUDA (far past the L2 cache), 256 MiB on CPU.
    """
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = min(time_call(lambda: dst.copy_(src), device, warmup=1, iters=repeats))
    return 2 * (nbytes // 4) * 4 / best


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul in `dtype`, best of `repeats` (n: 8192 on CUDA, 2048 on CPU).

    The ceiling is the faster of torch's `a @ b` and, where the engine packs its linear layers
    (`kernels.cpu_linear`), the packed oneDNN product: a floor must not be slower than what we run.
    """
    if n is None:
        n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    calls = [lambda: a @ b]
    if use_packed_linears(device, dtype):
        packed = PackedLinear(b, None)
        calls.append(lambda: packed(a))
    best = min(min(time_call(call, device, warmup=1, iters=repeats)) for call in calls)
    return 2 * n**3 / best


def prepare_model_folder(model: str, tmp_dir: Path, overrides: dict[str, object] | None = None) -> str:
    """The model name to load: `model` itself, or a copy of its folder under `tmp_dir`.

    A folder is copied (config.json written, other files linked) when it has no tokenizer.json, which
    then comes from the builtin SmolLM2 (vocab 49,152: its ids fit any larger vocab), or when
    `overrides` change keys of its config.json. A relative folder not found from the working
    directory is looked up from the repository root (`bench/models/llama-3-8b` works from anywhere).
    """
    overrides = overrides or {}
    path = Path(model)
    if not path.is_dir() and not path.is_absolute() and (REPO_ROOT / path).is_dir():
        path = REPO_ROOT / path
    if not path.is_dir():
        if overrides:
            raise ValueError(f"--config-override: needs --model to be a folder with a config.json, got {model!r}")
        return model
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json: not found in model folder {path}")
    has_tokenizer = (path / "tokenizer.json").is_file()
    if has_tokenizer and not overrides:
        return str(path)
    config = json.loads(config_path.read_text())
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"--config-override: {', '.join(unknown)} not in {config_path}")
    config.update(overrides)
    copy = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=tmp_dir))
    for item in path.iterdir():
        if item.name != "config.json" and item.is_file():
            os.symlink(item.resolve(), copy / item.name)
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    if not has_tokenizer:
        from engine.weights import resolve_model

        source = resolve_model(TOKENIZER_SOURCE)
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (copy / name).exists():
                shutil.copy(source / name, copy / name)
    return str(copy)


def parse_overrides(items: list[str]) -> dict[str, object]:
    """['num_hidden_layers=4', 'rope_scaling=null'] -> {'num_hidden_layers': 4, 'rope_scaling': None}."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config-override: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def run_ours(engine, work) -> dict:
    """Run the workload as one continuous batch. steps: (decode tokens, prefill tokens, seconds,
    context tokens the step's sampled sequences attended over) per step."""
    from engine.sampling import SamplingParams

    # warm-up outside the timing (on CUDA a few prompts, so that batched shapes are compiled too)
    warm = work[:1] if engine.device.type == "cpu" else work[:8]
    engine.generate([ids for ids, _ in warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"bench-{i}", ids, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps = []
    produced = 0
    sync(engine.device)
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        context = 0
        for out in outs:
            for o in out.outputs:
                if o.delta_token_ids:
                    produced += len(o.delta_token_ids)
                    # a decode step attends over the prompt and every output token but the one it produced
                    context += len(out.prompt_token_ids) + len(o.token_ids) - len(o.delta_token_ids)
        s = engine.last_step
        steps.append((s.num_decode_tokens, s.num_prefill_tokens, s.seconds, context))
    sync(engine.device)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": produced, "steps": steps}


def run_transformers(folder, work, batch_size: int, dtype: torch.dtype, device: torch.device,
                     random_weights: bool = False) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:  # the same shape, its own random weights: throughput is compared, not tokens
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # run each batch to its requested length

    def batch_generate(items):
        width = max(len(ids) for ids, _ in items)
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in items], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in items], device=device)
        new = max(n for _, n in items)
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    batch_generate(work[:2] if len(work) > 1 else work)  # warm-up
    useful = 0
    computed = 0
    sync(device)
    t = time.perf_counter()
    for start in range(0, len(work), batch_size):
        items = work[start:start + batch_size]
        out = batch_generate(items)
        useful += sum(n for _, n in items)
        computed += (out.shape[1] - max(len(ids) for ids, _ in items)) * len(items)
    sync(device)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": useful, "computed_tokens": computed}


def decode_roofline(engine, steps, device, dtype) -> dict:
    """Median decode-only step vs max(memory floor, compute floor) at that batch size.

    Memory floor: (matmul weight bytes + K/V bytes of the contexts the step attends over) / copy bandwidth.
    Compute floor: (2 x matmul params x batch + 4 x layers x heads x head_dim x context tokens) / matmul rate.
    A mixture of experts counts the experts a step of that batch reads (`experts_read`) and the ones each token
    computes with (`step_flops`), not all of them.
    """
    decode = [(n, sec, ctx) for n, p, sec, ctx in steps if n and not p]
    if not decode:
        return {}
    batch = int(statistics.median(n for n, _, _ in decode))
    near = [(sec, ctx) for n, sec, ctx in decode if abs(n - batch) <= max(1, batch // 8)]
    step_s = statistics.median(sec for sec, _ in near)
    kv_tokens = int(statistics.median(ctx for _, ctx in near))
    cfg = engine.model_config
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    unread = round(expert_params(cfg) * (1.0 - experts_read(cfg, batch)))   # the experts no token of the step hit
    weight_bytes = (matmul_params - unread) * dtype.itemsize
    kv_bytes = kv_tokens * cfg.kv_bytes_per_token(engine.kv_cache.dtype)
    copy_bw = measure_copy_bandwidth(device)
    rate = measure_matmul_rate(device, dtype)
    flops = step_flops(cfg, batch, kv_tokens, batch)
    mem_floor = (weight_bytes + kv_bytes) / copy_bw
    compute_floor = flops / rate
    return {"batch": batch, "step_ms": step_s * 1e3, "weight_bytes": weight_bytes, "kv_tokens": kv_tokens,
            "kv_bytes": kv_bytes, "copy_gbps": copy_bw / 1e9, "matmul_gflops": rate / 1e9,
            "gflop_per_step": flops / 1e9, "memory_floor_ms": mem_floor * 1e3,
            "compute_floor_ms": compute_floor * 1e3, "floor_ms": max(mem_floor, compute_floor) * 1e3}


def run(args: argparse.Namespace) -> int:
    # bad input fails before any work
    hf_batch_sizes = ([] if args.skip_hf else
                      int_list(args.hf_batch_sizes, "--hf-batch-sizes", 1, "batch sizes must be >= 1"))
    if args.min_output > args.max_output:
        raise ValueError(f"--min-output {args.min_output} is above --max-output {args.max_output}")
    overrides = parse_overrides(args.config_override)
    if overrides and not args.random_weights:
        raise ValueError("--config-override: only with --random-weights (the checkpoint's shape is fixed)")
    if args.kv_cache_mib is not None and args.kv_cache_mib <= 0:
        raise ValueError(f"--kv-cache-mib: must be > 0, got {args.kv_cache_mib}")
    with tempfile.TemporaryDirectory(prefix="cliffguard-bench-") as tmp:
        model = prepare_model_folder(args.model, Path(tmp), overrides)
        return _run(args, model, hf_batch_sizes)


def build_engine(args: argparse.Namespace, model: str):
    """Our engine as the benchmark configures it: one pool planned by the capacity formula with a
    `--kv-cache-mib` budget, max_num_seqs from the options."""
    from dataclasses import replace

    import torch

    from engine.llm_engine import LLMEngine
    from pools.capacity_plan import plan_single_pool

    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    kv_mib = args.kv_cache_mib or (8192 if on_cuda else 2048)
    _, config = plan_single_pool(model, device=args.device, dtype=args.dtype, kv_cache_bytes=kv_mib << 20,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
    overlap = {"auto": None, "on": True, "off": False}[getattr(args, "async_scheduling", "auto")]
    return LLMEngine(replace(config, random_weights=args.random_weights,
                             enforce_eager=getattr(args, "enforce_eager", False), async_scheduling=overlap,
                             quantization=getattr(args, "quantization", "auto")))


def _run(args: argparse.Namespace, model: str, hf_batch_sizes: list[int]) -> int:
    torch.manual_seed(args.seed)
    engine = build_engine(args, model)
    device, dtype = engine.device, engine.dtype
    work = make_workload(engine.tokenizer, args.num_prompts, args.min_output, args.max_output, args.seed)
    requested = sum(n for _, n in work)
    print(f"workload: {len(work)} chat prompts ({min(len(i) for i, _ in work)}-{max(len(i) for i, _ in work)} "
          f"prompt tokens), outputs {args.min_output}-{args.max_output} tokens ({requested} in all); "
          f"{cfg_name(engine)} {dtype} on {device_name(device)}"
          f"{', random weights' if args.random_weights else ''}", file=sys.stderr)

    ours = run_ours(engine, work)
    assert ours["output_tokens"] == requested, (ours["output_tokens"], requested)
    result = {"model": args.model, "device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
              "num_prompts": len(work), "requested_output_tokens": requested,
              "ours": {"wall_s": ours["wall_s"], "tok_per_s": requested / ours["wall_s"],
                       "max_num_seqs": args.max_num_seqs, "steps": len(ours["steps"])}}
    if args.also_torch_linear and use_packed_linears(device, dtype):
        # the same engine with torch's own linears: what packing the weights buys, in this run
        with mock.patch.dict(os.environ, {"CLIFFGUARD_CPU_LINEAR": "torch"}):
            plain = run_ours(build_engine(args, model), work)
        result["ours_torch_linear"] = {"wall_s": plain["wall_s"], "tok_per_s": requested / plain["wall_s"],
                                       "ratio": result["ours"]["tok_per_s"] * plain["wall_s"] / requested}
    result["transformers"] = []
    for batch_size in hf_batch_sizes:
        hf = run_transformers(engine.model_path, work, batch_size, dtype, device, args.random_weights)
        tok_s = requested / hf["wall_s"]
        result["transformers"].append({
            "batch_size": batch_size, "wall_s": hf["wall_s"], "tok_per_s": tok_s,
            "computed_tokens": hf["computed_tokens"], "ratio": result["ours"]["tok_per_s"] / tok_s})
    result["decode"] = decode_roofline(engine, ours["steps"], device, dtype)

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'system':<44} {'wall s':>8} {'output tok/s':>13} {'ours / this':>12}")
    o = result["ours"]
    print(f"{'cliffguard engine, max_num_seqs ' + str(o['max_num_seqs']):<44} {o['wall_s']:8.1f} "
          f"{o['tok_per_s']:13.1f} {'':>12}")
    if "ours_torch_linear" in result:
        t = result["ours_torch_linear"]
        print(f"{'cliffguard engine, torch sgemm linears':<44} {t['wall_s']:8.1f} {t['tok_per_s']:13.1f} "
              f"{t['ratio']:11.2f}x")
    for t in result["transformers"]:
        print(f"{'transformers generate, static batch ' + str(t['batch_size']):<44} {t['wall_s']:8.1f} "
              f"{t['tok_per_s']:13.1f} {t['ratio']:11.2f}x")
    d = result["decode"]
    if d:
        print(f"decode step at batch {d['batch']}: {d['step_ms']:.1f} ms measured; floor {d['floor_ms']:.1f} ms = "
              f"max(memory {d['memory_floor_ms']:.1f} ms: ({d['weight_bytes'] / 1e6:.0f} MB weights + "
              f"{d['kv_bytes'] / 1e6:.0f} MB KV of {d['kv_tokens']} context tokens) / "
              f"{d['copy_gbps']:.1f} GB/s copy, compute {d['compute_floor_ms']:.1f} ms: {d['gflop_per_step']:.1f} "
              f"GFLOP / {d['matmul_gflops']:.0f} GFLOP/s matmul); measured / floor = "
              f"{d['step_ms'] / d['floor_ms']:.2f}")
    return 0


def cfg_name(engine) -> str:
    return f"{engine.model_config.architecture} ({engine.model_config.num_params() / 1e6:.0f}M params)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
