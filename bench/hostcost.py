"""`cliffguard bench hostcost`: what a decode step costs the host, on a model with almost no arithmetic.

The model is a Llama with an 8B's depth and op count (32 layers by default) and a tiny hidden size (64),
random weights saved once and loaded by both systems. On a CPU its step is nearly all host work: Python,
op dispatch, the engine's per-sequence bookkeeping. Four measurements, each printed with its goal:

1. **The step against transformers.** At `--batch` sequences (64) that each prefilled `--prompt-len`
   tokens, the median of `--steps` decode steps of our engine (one `LLMEngine.step()`: schedule, inputs,
   forward, sampling, outputs) against the median of transformers' forward + argmax of the same model
   with its KV cache at the same batch and context, alternating one after the other on the same thread
   count. Goal: ours <= 0.5x.
2. **Ops per layer**: aten ops one decode forward dispatches, divided by the layers (a
   `TorchDispatchMode` counter; views and in-place ops count), ours and transformers'.
3. **Step against batch size**: our step and its phases (`StepStats.phases`) at each of `--batch-sizes`.
4. **Step against output length**: with `logprobs: 5`, `repetition_penalty`, `presence_penalty` and a stop
   string that never matches, the median step around output length 100 against around 1,000 (of the
   lengths in `--lengths`; an engine per length, their steps alternating). Goal: within 10%: nothing the
   host does per step may grow with the output.
   The attention kernel reads every cached token's K and V, so its time grows with the context on any
   device (the HBM floor counts those bytes); on a CPU it is timed apart (`attention`), and there its
   stream of K/V (270 MB a step at 1,000 tokens and batch 64 on the default model) also evicts what the
   other ops keep in the CPU's caches. The verdict is given three times: for the engine's host phases
   outside the forward pass (schedule, inputs, sample, outputs: the per-sequence work), for the step
   less the attention kernel, and for the whole step.

`--device cuda` measures the same on a GPU (the step's host phases then include waiting for the device; each
of our steps is timed until the device finished it, as transformers' is, so that neither waits in the other's
time; the ops are counted on an eager step, a decode step otherwise replaying a CUDA graph).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.options import int_list

TOKENIZER_SOURCE = "builtin:smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
HOST_GOAL = 0.5        # our step / transformers' forward + argmax
LENGTH_GOAL = 1.10     # step at the longest output length / at the shortest
PHASES = ("schedule", "inputs", "forward", "sample", "outputs")
LENGTH_PARAMS = dict(logprobs=5, repetition_penalty=1.1, presence_penalty=0.5, stop=["\x00never"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, an 8B's)")
    p.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64); 4 heads, 2 KV heads")
    p.add_argument("--vocab-size", type=int, default=512, help="vocabulary (default 512: the tokenizer's first ids)")
    p.add_argument("--batch", type=int, default=64, help="sequences in the step compared with transformers (64)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each sequence (default 32)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per measurement (default 30)")
    p.add_argument("--batch-sizes", default="1,8,16,32,64", help="batch sizes of the scaling table")
    p.add_argument("--lengths", default="100,1000", help="output lengths of the length table (default 100,1000)")
    p.add_argument("--length-batch", type=int, default=64, help="sequences in the length table (default 64)")
    p.add_argument("--length-model", default=None,
                   help="run the output-length table on this model (a folder or builtin:NAME) instead of the "
                        "deep, narrow one: where the weights, not the K/V, dominate a step's bytes")
    p.add_argument("--skip-lengths", action="store_true", help="leave out the output-length table (the longest part)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="float32 (default) | bfloat16 | float16")
    p.add_argument("--tokenizer", default=TOKENIZER_SOURCE,
                   help="where the model's tokenizer files come from: a model folder, or builtin:NAME (default; a "
                        "machine without the builtin's package, such as a GPU machine, gives a folder)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def make_model(folder: Path, layers: int, hidden: int, vocab: int, tokenizer: str = TOKENIZER_SOURCE) -> Path:
    """A random-weight Llama of the given depth and width saved with transformers, the tokenizer files of
    `tokenizer` (a folder or builtin:NAME) beside it."""
    import transformers

    from engine.weights import resolve_model

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 5 // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    source = resolve_model(tokenizer)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()


class Ours:
    """Our engine with `batch` sequences decoding, one step at a time."""

    def __init__(self, folder: Path, args: argparse.Namespace, batch: int, max_tokens: int, **params) -> None:
        from engine.llm_engine import LLMEngine
        from engine.sampling import SamplingParams

        total = args.prompt_len + max_tokens + 16
        block_size = 16
        self.engine = LLMEngine.from_args(
            str(folder), block_size=block_size, num_blocks=batch * (-(-total // block_size)) + 8,
            max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.prompt_len), max_model_len=total,
            device=args.device, dtype=args.dtype, progress=False)
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        for i, ids in enumerate(_prompts(batch, args.prompt_len, args.vocab_size, seed=prompt_seed(batch))):
            self.engine.add_request(f"r{i}", ids, sampling)
        while self.engine.last_step.num_decode_tokens < batch:   # every prompt prefilled, all decoding
            self.engine.step()

    def step(self) -> tuple[float, dict[str, float]]:
        self.attention_seconds = 0.0
        started = time.perf_counter()
        self.engine.step()
        if self.engine.device.type == "cuda":   # the step left in flight settles in our time, not in the next
            torch.cuda.synchronize(self.engine.device)   # system's (transformers' synchronize would wait for it)
        seconds = time.perf_counter() - started
        assert not self.engine.last_step.num_prefill_tokens
        return seconds, {**self.engine.last_step.phases, "attention": self.attention_seconds}

    def time_attention(self) -> None:
        """From now on each step's seconds inside the attention kernel go to its phases' `attention` (a
        CPU's kernels finish before they return, so the clock reads their work)."""
        def timed(kernel):
            def call(*args, **kwargs):
                started = time.perf_counter()
                out = kernel(*args, **kwargs)
                self.attention_seconds += time.perf_counter() - started
                return out
            return call

        flat = self.engine.model.flat_forward
        if flat is not None:   # the CPU backend's flat loop calls the C kernel itself
            flat.decode = timed(flat.decode)
            return
        runner = self.engine.runner
        backend = runner.backend
        paged_attention = timed(backend.paged_attention)
        runner.backend = SimpleNamespace(store_kv=backend.store_kv, paged_attention=paged_attention)

    def ops_per_layer(self) -> float:
        """The eager forward's ops (a decode step replaying a CUDA graph calls no forward: this one runs eager)."""
        model, runner = self.engine.model, self.engine.runner
        forward, graphs = model.forward, runner.graphs
        counter = OpCounter()

        def counted(*a, **k):
            with counter:
                return forward(*a, **k)

        model.forward, runner.graphs = counted, None
        try:
            self.engine.step()
        finally:
            del model.forward
            runner.graphs = graphs
        return counter.count / len(model.layers)


class Transformers:
    """transformers' model with its KV cache: `batch` sequences prefilled, then forward + argmax per step."""

    def __init__(self, folder: Path, args: argparse.Namespace, batch: int) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).to(self.device)
        self.model.eval()
        ids = torch.tensor(_prompts(batch, args.prompt_len, args.vocab_size, seed=prompt_seed(batch)), device=self.device)
        with torch.inference_mode():
            out = self.model(ids, use_cache=True)
        self.cache, self.next = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)

    def forward(self) -> None:
        with torch.inference_mode():
            out = self.model(self.next, cache=self.cache, use_cache=True)
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> float:
        started = time.perf_counter()
        self.forward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def ops_per_layer(self) -> float:
        counter = OpCounter()
        with counter:
            self.forward()
        return counter.count / self.model.config.num_hidden_layers


def prompt_seed(batch: int) -> int:
    """The prompts' seed: the same prompts for both systems at one batch size."""
    return 1000 + batch


def _median_phases(samples: list[dict[str, float]], names=PHASES) -> dict[str, float]:
    return {name: statistics.median(s.get(name, 0.0) for s in samples) * 1e3 for name in names}


def warm_up_steps() -> int:
    """Steps run before timing: a fresh engine's step composer refits its cost model after each of its
    first 2 x `refit_every` steps (then every `refit_every`; ~1 ms a fit on the development VM), so the
    steps timed are the steady state a serving engine runs in."""
    from engine.step_cost import StepCostModel

    return 2 * StepCostModel().refit_every + 1


def compare(folder: Path, args: argparse.Namespace) -> dict:
    """Measurement 1 and 2: ours against transformers at `--batch`, steps alternating."""
    warm = warm_up_steps()
    ours = Ours(folder, args, args.batch, max_tokens=args.steps + warm + 64)
    hf = Transformers(folder, args, args.batch)
    for _ in range(warm):
        ours.step()
        hf.step()
    our_times, hf_times, phases = [], [], []
    for _ in range(args.steps):
        seconds, step_phases = ours.step()
        our_times.append(seconds)
        phases.append(step_phases)
        hf_times.append(hf.step())
    ours_ms, hf_ms = statistics.median(our_times) * 1e3, statistics.median(hf_times) * 1e3
    return {"batch": args.batch, "ours_ms": ours_ms, "transformers_ms": hf_ms, "ratio": ours_ms / hf_ms,
            "goal": HOST_GOAL, "met": ours_ms / hf_ms <= HOST_GOAL, "phases_ms": _median_phases(phases),
            "ops_per_layer": {"ours": ours.ops_per_layer(), "transformers": hf.ops_per_layer()}}


def batch_table(folder: Path, args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    """Measurement 3: our step and its phases at each batch size."""
    rows = []
    for batch in sizes:
        warm = warm_up_steps()
        ours = Ours(folder, args, batch, max_tokens=args.steps + warm + 8)
        times, phases = [], []
        for _ in range(args.steps + warm):
            seconds, step_phases = ours.step()
            times.append(seconds)
            phases.append(step_phases)
        rows.append({"batch": batch, "step_ms": statistics.median(times[warm:]) * 1e3,
                     "phases_ms": _median_phases(phases[warm:])})
    return rows


def length_table(folder: Path, args: argparse.Namespace, lengths: list[int]) -> dict:
    """Measurement 4: the step around each output length, logprobs, penalties and a stop string on. One
    engine per length, each brought to its length first; then their steps alternate, one of each in turn,
    so a machine whose speed drifts (this one's does, by 30% within minutes) slows every length alike."""
    on_cpu = torch.device(args.device).type == "cpu"
    window = max(5, min(10, min(lengths) // 4))
    engines = {}
    for n in lengths:
        engines[n] = Ours(folder, args, args.length_batch, max_tokens=n + window + 16, **LENGTH_PARAMS)
        for _ in range(n - window - 1):   # the prefill sampled the first token
            engines[n].step()
        if on_cpu:
            engines[n].time_attention()
    by_length: dict[int, list[tuple[float, dict]]] = {n: [] for n in lengths}
    for _ in range(2 * window + 1):
        for n, ours in engines.items():
            by_length[n].append(ours.step())
    rows = []
    for n, samples in by_length.items():
        row = {"output_len": n, "step_ms": statistics.median(s for s, _ in samples) * 1e3,
               "phases_ms": _median_phases([p for _, p in samples], (*PHASES, "attention"))}
        if on_cpu:
            row["step_less_attention_ms"] = statistics.median(s - p["attention"] for s, p in samples) * 1e3
        row["outside_forward_ms"] = statistics.median(
            sum(p[name] for name in PHASES if name != "forward") for _, p in samples) * 1e3
        rows.append(row)
    ratio = rows[-1]["step_ms"] / rows[0]["step_ms"]
    outside = rows[-1]["outside_forward_ms"] / rows[0]["outside_forward_ms"]
    result = {"batch": args.length_batch, "params": {k: v for k, v in LENGTH_PARAMS.items() if k != "stop"},
              "rows": rows, "ratio": ratio, "goal": LENGTH_GOAL, "met": ratio <= LENGTH_GOAL,
              "outside_forward_ratio": outside, "outside_forward_met": outside <= LENGTH_GOAL}
    if on_cpu:
        host = rows[-1]["step_less_attention_ms"] / rows[0]["step_less_attention_ms"]
        result.update(host_ratio=host, host_met=host <= LENGTH_GOAL)
    return result


def run(args: argparse.Namespace) -> int:
    from engine.weights import resolve_model

    sizes = int_list(args.batch_sizes, "--batch-sizes", 1, "batch sizes must be >= 1")
    lengths = sorted(int_list(args.lengths, "--lengths", 20, "output lengths must be >= 20"))
    for name in ("layers", "hidden_size", "batch", "prompt_len", "steps", "length_batch", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.hidden_size % 8:
        raise ValueError(f"--hidden-size: must be a multiple of 8 (4 heads of an even size), got {args.hidden_size}")
    if args.vocab_size < 64:
        raise ValueError(f"--vocab-size: must be >= 64, got {args.vocab_size}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device} but CUDA is not available")
    if args.length_model is not None and args.skip_lengths:
        raise ValueError("--length-model: the output-length table is skipped (--skip-lengths)")
    try:
        tokenizer = resolve_model(args.tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--tokenizer: {exc}") from None
    if not (tokenizer / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer: {tokenizer} has no tokenizer.json")
    args = argparse.Namespace(**{**vars(args), "tokenizer": str(tokenizer)})
    length_folder = None
    if args.length_model is not None:   # a bad model fails now, not after the first tables
        try:
            length_folder = resolve_model(args.length_model)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"--length-model: {exc}") from None
    threads = torch.get_num_threads()   # the caller's, given back: `run` may be called in a process that goes on
    with tempfile.TemporaryDirectory(prefix="cliffguard-hostcost-") as tmp:
        try:
            if args.device == "cpu":
                torch.set_num_threads(args.threads)
            result = _measure(Path(tmp), args, sizes, lengths, length_folder)
        finally:
            torch.set_num_threads(threads)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_report(result)
    return 0


def _measure(tmp: Path, args: argparse.Namespace, sizes: list[int], lengths: list[int],
             length_folder: Path | None) -> dict:
    """Every table of the report, on a model made in `tmp` (and the length table on `length_folder` if given)."""
    folder = make_model(tmp / "model", args.layers, args.hidden_size, args.vocab_size, args.tokenizer)
    result = {"model": {"layers": args.layers, "hidden_size": args.hidden_size, "vocab_size": args.vocab_size},
              "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "prompt_len": args.prompt_len, "compare": compare(folder, args),
              "batch_table": batch_table(folder, args, sizes)}
    if not args.skip_lengths:
        result["length_table"] = length_table(length_folder or folder, args, lengths)
        result["length_table"]["model"] = args.length_model or "the model above"
    return result


def _phases(p: dict[str, float]) -> str:
    return "  ".join(f"{name} {p[name]:6.2f}" for name in PHASES)


def _print_report(r: dict) -> None:
    c = r["compare"]
    m = r["model"]
    print(f"Llama, {m['layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}; {r['dtype']} on "
          f"{r['device']} ({r['threads']} threads); prompts of {r['prompt_len']} tokens", file=sys.stderr)
    print(f"decode step at batch {c['batch']}: ours {c['ours_ms']:.2f} ms, transformers forward + argmax "
          f"{c['transformers_ms']:.2f} ms: {c['ratio']:.2f}x (goal <= {c['goal']}x) "
          f"{'met' if c['met'] else 'NOT met'}")
    print(f"  our phases (ms, medians): {_phases(c['phases_ms'])}")
    ops = c["ops_per_layer"]
    print(f"ops per layer (aten, one decode forward): ours {ops['ours']:.1f}, transformers {ops['transformers']:.1f}")
    print("step against batch size (ms, medians):")
    for row in r["batch_table"]:
        print(f"  batch {row['batch']:4d}: step {row['step_ms']:7.2f}   {_phases(row['phases_ms'])}")
    if "length_table" in r:
        t = r["length_table"]
        print(f"step against output length, {t['model']}, batch {t['batch']}, logprobs 5, repetition and presence "
              f"penalties, a stop string (ms, medians):")
        for row in t["rows"]:
            less = (f"   step less attention {row['step_less_attention_ms']:7.2f}"
                    if "step_less_attention_ms" in row else "")
            print(f"  output {row['output_len']:5d}: step {row['step_ms']:7.2f}   {_phases(row['phases_ms'])}   "
                  f"attention {row['phases_ms']['attention']:6.2f}{less}")
        print(f"  longest / shortest, host phases outside the forward: {t['outside_forward_ratio']:.3f} "
              f"(goal <= {t['goal']}) {'met' if t['outside_forward_met'] else 'NOT met'}")
        if "host_ratio" in t:
            print(f"  longest / shortest, step less the attention kernel: {t['host_ratio']:.3f} (goal <= {t['goal']}) "
                  f"{'met' if t['host_met'] else 'NOT met'}")
        print(f"  longest / shortest, whole step: {t['ratio']:.3f} (goal <= {t['goal']}) "
              f"{'met' if t['met'] else 'NOT met'}")
