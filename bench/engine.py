"""`cliffguard bench engine`: our engine vs transformers `generate` on one offline workload, in one run.

Both systems get the same prompts, the same requested output lengths, the same dtype, on the same
machine. Ours runs them as one continuous batch; transformers runs static batches (left-padded,
each batch decoding until its longest request is done). Throughput counts only the tokens each
request asked for. Then the engine's decode step time is set beside a roofline floor measured in
the same run: max(bytes read per step / measured copy bandwidth, FLOPs per step / measured matmul rate).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

TOPICS = ["the ocean", "prime numbers", "a rainy city", "compilers", "coffee", "the moon landing",
          "bread baking", "graph theory", "jazz", "mountain hiking", "databases", "volcanoes",
          "chess openings", "photosynthesis", "the printing press", "electric cars"]
ASKS = ["Write a short poem about {t}.", "Explain {t} to a ten-year-old.", "Give three facts about {t}.",
        "What is the most surprising thing about {t}? Answer in detail, with an example or two.",
        "Summarise the history of {t} in a paragraph.", "Tell me a joke about {t}."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64, help="our engine's concurrency limit")
    p.add_argument("--hf-batch-sizes", default="16,64",
                   help="transformers' static batch sizes, comma-separated: one run and one ratio each")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights for a model folder that has only config.json (+ tokenizer)")
    p.add_argument("--skip-hf", action="store_true", help="measure our engine only")
    p.add_argument("--seed", type=int, default=0)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_ours(engine, work) -> dict:
    from engine import SamplingParams

    # warm-up outside the timing
    engine.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"bench-{i}", ids, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps = []
    produced = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        produced += sum(len(o.delta_token_ids) for out in outs for o in out.outputs)
        s = engine.last_step
        steps.append((s.num_decode_tokens, s.num_prefill_tokens, s.seconds))
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": produced, "steps": steps}


def run_transformers(folder, work, batch_size: int, dtype: torch.dtype, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

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
    t = time.perf_counter()
    for start in range(0, len(work), batch_size):
        items = work[start:start + batch_size]
        out = batch_generate(items)
        useful += sum(n for _, n in items)
        computed += (out.shape[1] - max(len(ids) for ids, _ in items)) * len(items)
    _sync(device)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": useful, "computed_tokens": computed}


def decode_roofline(engine, steps, device, dtype) -> dict:
    """Median decode-only step vs max(memory floor, compute floor) at that batch size."""
    decode = [(n, sec) for n, p, sec in steps if n and not p]
    if not decode:
        return {}
    batch = int(statistics.median(n for n, _ in decode))
    near = [sec for n, sec in decode if abs(n - batch) <= max(1, batch // 8)]
    step_s = statistics.median(near)
    cfg = engine.model_config
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    weight_bytes = matmul_params * dtype.itemsize
    copy_bw = measure_copy_bandwidth(device)
    rate = measure_matmul_rate(device, dtype)
    flops = 2 * matmul_params * batch
    mem_floor = weight_bytes / copy_bw
    compute_floor = flops / rate
    return {"batch": batch, "step_ms": step_s * 1e3, "weight_bytes": weight_bytes, "copy_gbps": copy_bw / 1e9,
            "matmul_gflops": rate / 1e9, "gflop_per_step": flops / 1e9, "memory_floor_ms": mem_floor * 1e3,
            "compute_floor_ms": compute_floor * 1e3, "floor_ms": max(mem_floor, compute_floor) * 1e3}


def run(args: argparse.Namespace) -> int:
    from engine import CacheConfig, EngineConfig, LLMEngine, PoolConfig, SchedulerConfig

    hf_batch_sizes = [] if args.skip_hf else _batch_sizes(args.hf_batch_sizes)  # bad input fails before any work
    torch.manual_seed(args.seed)
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, random_weights=args.random_weights,
        cache=CacheConfig(kv_cache_bytes=2 << 30),
        pools=(PoolConfig(scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                    max_num_batched_tokens=2048)),))
    engine = LLMEngine(config)
    device, dtype = engine.device, engine.dtype
    work = make_workload(engine.tokenizer, args.num_prompts, args.min_output, args.max_output, args.seed)
    requested = sum(n for _, n in work)
    print(f"workload: {len(work)} chat prompts ({min(len(i) for i, _ in work)}-{max(len(i) for i, _ in work)} "
          f"prompt tokens), outputs {args.min_output}-{args.max_output} tokens ({requested} in all); "
          f"{cfg_name(engine)} {dtype} on {device_name(device)}", file=sys.stderr)

    ours = run_ours(engine, work)
    assert ours["output_tokens"] == requested, (ours["output_tokens"], requested)
    result = {"model": args.model, "device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
              "num_prompts": len(work), "requested_output_tokens": requested,
              "ours": {"wall_s": ours["wall_s"], "tok_per_s": requested / ours["wall_s"],
                       "max_num_seqs": args.max_num_seqs, "steps": len(ours["steps"])}}
    result["transformers"] = []
    for batch_size in hf_batch_sizes:
        hf = run_transformers(engine.model_path, work, batch_size, dtype, device)
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
    for t in result["transformers"]:
        print(f"{'transformers generate, static batch ' + str(t['batch_size']):<44} {t['wall_s']:8.1f} "
              f"{t['tok_per_s']:13.1f} {t['ratio']:11.2f}x")
    d = result["decode"]
    if d:
        print(f"decode step at batch {d['batch']}: {d['step_ms']:.1f} ms measured; floor {d['floor_ms']:.1f} ms = "
              f"max(memory {d['memory_floor_ms']:.1f} ms: {d['weight_bytes'] / 1e6:.0f} MB weights / "
              f"{d['copy_gbps']:.1f} GB/s copy, compute {d['compute_floor_ms']:.1f} ms: {d['gflop_per_step']:.1f} "
              f"GFLOP / {d['matmul_gflops']:.0f} GFLOP/s matmul); measured / floor = "
              f"{d['step_ms'] / d['floor_ms']:.2f}")
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--hf-batch-sizes: expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hf-batch-sizes: batch sizes must be >= 1, got {text!r}")
    return sizes


def cfg_name(engine) -> str:
    return f"{engine.model_config.architecture} ({engine.model_config.num_params() / 1e6:.0f}M params)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
