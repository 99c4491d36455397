"""`cliffguard bench preemption`: recompute vs swap vs auto across the pool-pressure regimes, in one run.

The three pool-pressure regimes: the pool far above the workload's working set
(no preemption: the mode should not matter), about equal to it, and below it. Each runs two offline
mixes, all requests submitted at t=0, greedy with ignore_eos:

- long: few requests, prompts 4x their outputs (RAG-like): a preempted sequence is costly to recompute;
- short: more requests, prompts half their outputs (chat-like): preemptions are cheap either way.

The working set is the blocks of prompt + output of every request, summed over the largest
`max_num_seqs` of them (the most that can run at once). Each regime's pool holds `factor x` that, never
less than the largest single request. At 1x nothing can be preempted (everything fits), so "about equal"
is 0.85x by default. Swap and auto pools get a CPU swap space of `--swap-factor x min(pool, working set)`
blocks (a larger one could never fill).

Admission waits until a prompt's blocks are free, so only output growth (and, with chunked prefill,
later prompt chunks) can run a pool dry: a long-prompt mix preempts rarely, but each preemption of it
throws away hundreds of tokens.

One engine per mode, all loaded at the start (weights once per mode: 1-4 s and 0.5 GiB each for the
builtin model; about 7 GiB peak for the default run with its KV pools and swap spaces). An engine's
pools are the (mix, regime) cells plus a small warm-up pool, each with its own block range and counters.
The cells run one after the other, the modes taking turns within each so that drift in the machine's
speed lands on all modes alike. Greedy outputs of every cell must equal those of the largest pool (of the
first mode) for the same mix: preemption must not change the output.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass

from bench.engine import cfg_name, device_name
from pools.workload import MIN_P99_SAMPLES, latency_stats

MODES = ("recompute", "swap", "auto")
WARMUP_POOL = "warmup"
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 32, 4


@dataclass(frozen=True)
class Mix:
    """An offline workload shape: per-request lengths are jittered +-25% around these."""

    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    note: str


DEFAULT_MIXES = (Mix("long", 8, 256, 64, "RAG-like"), Mix("short", 16, 32, 64, "chat-like"))
QUICK_MIXES = (Mix("long", 8, 64, 16, "RAG-like"), Mix("short", 8, 8, 32, "chat-like"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights for a model folder that has only config.json (+ tokenizer)")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--modes", default=",".join(MODES), help="preemption modes to compare, comma-separated")
    p.add_argument("--pool-factors", default="4,0.85,0.5",
                   help="pool size / working set of each regime, comma-separated (largest is the reference)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length")
    p.add_argument("--quick", action="store_true", help="small mixes (seconds with a tiny model): for tests")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block: 8, 16 (default) or 32")
    p.add_argument("--max-num-seqs", type=int, default=64, help="each pool's max_num_seqs (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="each pool's token budget per step (default 2048)")
    p.add_argument("--swap-factor", type=float, default=2.0,
                   help="CPU swap space of swap and auto pools, in units of min(pool, working set)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each cell (modes taking turns); the table shows the run with the median time")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


# --- the workload ---------------------------------------------------------------------------------
def make_requests(mix: Mix, scale: float, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, deterministic for (mix, seed); ids avoid the low
    (special) ids when the vocabulary is large enough."""
    rng = random.Random(f"{seed}-{mix.name}")
    low = 32 if vocab_size > 256 else 3
    work = []
    for _ in range(mix.num_requests):
        prompt_len = max(1, round(mix.prompt_len * scale * rng.uniform(0.75, 1.25)))
        output_len = max(1, round(mix.output_len * scale * rng.uniform(0.75, 1.25)))
        work.append(([rng.randrange(low, vocab_size) for _ in range(prompt_len)], output_len))
    return work


def working_set_blocks(work: list[tuple[list[int], int]], block_size: int, max_num_seqs: int) -> int:
    """Blocks of prompt + output of the `max_num_seqs` largest requests: the most that can be live at once."""
    needs = sorted((math.ceil((len(ids) + n) / block_size) for ids, n in work), reverse=True)
    return sum(needs[:max_num_seqs])


def pool_blocks(factor: float, working_set: int, work, block_size: int) -> int:
    """`factor x working_set`, but never less than the largest request (which must fit on its own)."""
    largest = max(math.ceil((len(ids) + n) / block_size) for ids, n in work)
    return max(math.ceil(factor * working_set), largest)


def regime_label(factor: float) -> str:
    sign = "≫" if factor >= 2 else "≈" if factor >= 0.8 else "<"
    return f"pool {sign} ws ({factor:g}x)"


def pool_name(mix: Mix, factor: float) -> str:
    return f"{mix.name}-x{factor:g}"


# --- one engine per mode --------------------------------------------------------------------------
def build_engine(args, mode: str, cells: list[tuple[Mix, float, int, int]], bytes_per_block: int):
    """An engine whose pools are the warm-up pool and one pool per (mix, factor, blocks, working set) cell;
    swap and auto pools get `--swap-factor x min(pool, working set)` blocks of CPU swap space."""
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    def scheduler(num_blocks: int, working_set: int) -> SchedulerConfig:
        swap_blocks = math.ceil(args.swap_factor * min(num_blocks, working_set))
        swap_bytes = 0 if mode == "recompute" else swap_blocks * bytes_per_block
        return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               preemption_mode=mode, swap_space_bytes=swap_bytes)

    warmup_blocks = math.ceil((WARMUP_PROMPT_LEN + WARMUP_OUTPUT_LEN) / args.block_size)
    pools = [PoolConfig(name=WARMUP_POOL, num_blocks=warmup_blocks, scheduler=scheduler(warmup_blocks, warmup_blocks))]
    pools += [PoolConfig(name=pool_name(mix, factor), num_blocks=n, scheduler=scheduler(n, ws))
              for mix, factor, n, ws in cells]
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, random_weights=args.random_weights,
                          seed=args.seed, cache=CacheConfig(block_size=args.block_size),
                          pools=tuple(pools))
    return LLMEngine(config, progress=False)


def warm_up(engine, vocab_size: int) -> None:
    """One short request through the warm-up pool (the engine's first): first-call costs stay out of cells."""
    from engine.sampling import SamplingParams

    ids = [3 + i % (vocab_size - 3) for i in range(WARMUP_PROMPT_LEN)]
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True))


def pool_counters(engine, pool: str) -> dict:
    """The pool's cumulative preemption counters; checks the integrity of every pool and that `pool`
    holds no block."""
    from engine.worker import engine_stats

    stats = engine_stats(engine, check=True).pools[pool]
    if stats.num_free_blocks != stats.num_blocks:
        raise AssertionError(f"pool {pool}: {stats.num_blocks - stats.num_free_blocks} blocks held "
                             "with no request in flight")
    return {key: getattr(stats, key) for key in (
        "num_preemptions", "num_recompute_preemptions", "num_swap_preemptions", "num_recomputed_tokens",
        "num_swapped_out_blocks", "num_swapped_in_blocks", "preempt_seconds")}


def run_cell(engine, pool: str, work: list[tuple[list[int], int]]) -> dict:
    """Submit every request at t=0 to `pool`, step until all finish; latencies, counters, outputs."""
    from engine.sampling import SamplingParams

    before = pool_counters(engine, pool)
    ids = [f"{pool}-{i}" for i in range(len(work))]
    started = time.perf_counter()
    for request_id, (prompt, n) in zip(ids, work):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           pool=pool)
    latency, outputs = {}, {}
    num_steps = num_prefill_tokens = peak_used_blocks = 0
    block_manager = engine.schedulers[pool].block_manager
    while engine.has_unfinished_requests():
        outs = engine.step()
        peak_used_blocks = max(peak_used_blocks, block_manager.num_used_blocks)
        now = time.perf_counter() - started
        for out in outs:
            if out.finished:
                latency[out.request_id] = now
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        num_steps += 1
        num_prefill_tokens += engine.last_step.num_prefill_tokens
    wall = time.perf_counter() - started
    counters = {key: value - before[key] for key, value in pool_counters(engine, pool).items()}
    output_tokens = sum(len(outputs[r]) for r in ids)
    lat = [latency[r] for r in ids]
    return {
        "wall_s": wall, "output_tokens": output_tokens, "tok_per_s": output_tokens / wall,
        "mean_latency_s": statistics.mean(lat), "p99_latency_s": latency_stats(lat)["p99"], "num_requests": len(lat),
        "num_steps": num_steps, "num_prefill_tokens": num_prefill_tokens, "peak_used_blocks": peak_used_blocks,
        "preemptions_per_100_requests": 100 * counters["num_preemptions"] / len(work),
        "preemptions_per_step": counters["num_preemptions"] / num_steps,
        **counters,
        "output_token_ids": [outputs[r] for r in ids],
    }


def compare_outputs(got: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """Requests whose greedy output differs from the reference, with the first differing position."""
    diffs = []
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"request": i, "position": at, "got": a[at:at + 4], "expected": b[at:at + 4]})
    return diffs


# --- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.model_config import ModelConfig
    from engine.weights import resolve_model

    modes, factors = _parse_args(args)
    # Bad values fail here, before any work; later a ConfigError can only be a mode the engine refuses.
    probe = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                         cache=CacheConfig(block_size=args.block_size),
                         pools=(PoolConfig(scheduler=SchedulerConfig(
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)),))
    device = probe.resolved_device()
    dtype = probe.resolved_dtype(device)
    model_config = ModelConfig.from_folder(resolve_model(args.model))
    bytes_per_block = model_config.kv_bytes_per_token(dtype) * args.block_size
    mixes = QUICK_MIXES if args.quick else DEFAULT_MIXES
    # the longest a request can be drawn (lengths x 1.25 at most), checked before any is drawn (in floats: a
    # scale of 1e306 is finite, its lengths are not)
    longest = max((m.prompt_len + m.output_len) * args.scale * 1.25 for m in mixes)
    if not longest <= model_config.max_position_embeddings:
        raise ValueError(f"--scale: the longest request it may draw ({longest:.6g} tokens) exceeds the model's "
                         f"max_position_embeddings ({model_config.max_position_embeddings})")
    workloads = {m.name: make_requests(m, args.scale, model_config.vocab_size, args.seed) for m in mixes}
    mix_info, cells = _plan_cells(mixes, workloads, factors, args)
    result = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "device": device_name(device),
              "block_size": args.block_size, "bytes_per_block": bytes_per_block,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "swap_factor": args.swap_factor, "scale": args.scale, "quick": args.quick, "repeat": args.repeat,
              "pool_factors": factors, "modes": modes, "mixes": mix_info, "engines": {}, "cells": []}
    print(f"preemption bench: {len(mixes)} mixes x {len(factors)} regimes x {len(modes)} modes; one engine "
          f"per mode, all loaded at once", file=sys.stderr)

    engines, unsupported = _load_engines(args, modes, cells, bytes_per_block, model_config.vocab_size, result)
    runs = _run_cells(args, cells, modes, engines, workloads)
    engines.clear()
    # Each mix's reference: the first run of its largest pool under the first mode that ran.
    reference = {mix.name: next((runs[(m, mix.name, factors[0])][0] for m in modes
                                 if (m, mix.name, factors[0]) in runs), None) for mix in mixes}
    for mix, factor, n, _ in cells:
        for mode in modes:
            cell = _cell_head(mode, mix, factor, n)
            if mode in unsupported:
                cell["unsupported"] = unsupported[mode]
            else:
                cell |= _summarize(runs[(mode, mix.name, factor)], reference[mix.name])
            result["cells"].append(cell)
    result["rows"] = _rows(result["cells"], mixes, factors)
    result["timing_noise"] = _timing_noise(result["cells"], mixes, factors[0])

    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        _print_table(result, mixes, factors, modes)
    return 1 if any(c.get("outputs_match") is False for c in result["cells"]) else 0   # preemption changed an output


def _plan_cells(mixes, workloads, factors: list[float], args: argparse.Namespace) -> tuple[list[dict], list[tuple]]:
    """Each mix's description, and the (mix, pool factor, pool blocks, working set) cells to run."""
    mix_info, cells = [], []
    for mix in mixes:
        work = workloads[mix.name]
        ws = working_set_blocks(work, args.block_size, args.max_num_seqs)
        mix_info.append({
            "name": mix.name, "note": mix.note, "num_requests": len(work),
            "prompt_len": [min(len(i) for i, _ in work), max(len(i) for i, _ in work)],
            "output_len": [min(n for _, n in work), max(n for _, n in work)],
            "prompt_tokens": sum(len(i) for i, _ in work), "output_tokens": sum(n for _, n in work),
            "working_set_blocks": ws})
        cells += [(mix, f, pool_blocks(f, ws, work, args.block_size), ws) for f in factors]
    return mix_info, cells


def _load_engines(args: argparse.Namespace, modes: list[str], cells: list[tuple], bytes_per_block: int,
                  vocab_size: int, result: dict) -> tuple[dict, dict[str, str]]:
    """One warmed-up engine per mode the engine supports; (engines, mode -> why unsupported)."""
    from engine.config import ConfigError

    engines, unsupported = {}, {}
    for mode in modes:
        started = time.perf_counter()
        try:
            engines[mode] = build_engine(args, mode, cells, bytes_per_block)
        except ConfigError as exc:
            unsupported[mode] = str(exc)
            result["engines"][mode] = {"unsupported": str(exc)}
            print(f"  {mode}: unsupported ({exc})", file=sys.stderr)
            continue
        result["engines"][mode] = {"load_s": time.perf_counter() - started, "model": cfg_name(engines[mode])}
        warm_up(engines[mode], vocab_size)
    return engines, unsupported


def _run_cells(args: argparse.Namespace, cells: list[tuple], modes: list[str], engines: dict,
               workloads: dict) -> dict[tuple[str, str, float], list[dict]]:
    """Every cell `args.repeat` times under every mode. The modes take turns, each round starting
    with the next one: drift in the machine's speed over the run lands on all of them alike."""
    runs: dict[tuple[str, str, float], list[dict]] = {}
    for i, (mix, factor, _, _) in enumerate(cells):
        for repeat in range(args.repeat):
            turn = (i + repeat) % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                if mode in engines:
                    cell = run_cell(engines[mode], pool_name(mix, factor), workloads[mix.name])
                    runs.setdefault((mode, mix.name, factor), []).append(cell)
                    print(f"  {mode:<9} {mix.name:<5} {regime_label(factor):<22} {cell['wall_s']:6.1f} s "
                          f"{cell['num_preemptions']:4d} preemptions", file=sys.stderr)
    return runs


def _parse_args(args) -> tuple[list[str], list[float]]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--modes: expected distinct modes among {', '.join(MODES)}, got {args.modes!r}")
    try:
        factors = [float(x) for x in args.pool_factors.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--pool-factors: expected comma-separated numbers, got {args.pool_factors!r}") from None
    if not factors or not all(0 < x < math.inf for x in factors) or len(set(factors)) != len(factors):
        raise ValueError(f"--pool-factors: expected distinct finite numbers > 0, got {args.pool_factors!r}")
    for name in ("scale", "swap_factor", "repeat"):
        if not 0 < getattr(args, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')}: must be finite and > 0, got {getattr(args, name)}")
    return modes, sorted(factors, reverse=True)


def _summarize(runs: list[dict], reference: dict) -> dict:
    """One cell from its repeats: the run with the median wall time, every run's wall time, and whether
    every run's greedy outputs equal the reference run's."""
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    mismatches = next((d for d in (compare_outputs(r["output_token_ids"], reference["output_token_ids"])
                                   for r in runs) if d), [])
    cell = {k: v for k, v in median.items() if k != "output_token_ids"}
    return cell | {"wall_s_runs": [r["wall_s"] for r in runs], "mismatches": mismatches,
                   "outputs_match": not mismatches}


def _cell_head(mode: str, mix: Mix, factor: float, num_blocks: int) -> dict:
    return {"mode": mode, "mix": mix.name, "pool_factor": factor, "regime": regime_label(factor),
            "num_blocks": num_blocks}


def _rows(cells: list[dict], mixes, factors) -> list[dict]:
    """Per (regime, mix): auto's throughput against the better of recompute and swap (goal: within 5%)."""
    rows = []
    for factor in factors:
        for mix in mixes:
            tps = {c["mode"]: c["tok_per_s"] for c in cells
                   if c["mix"] == mix.name and c["pool_factor"] == factor and "tok_per_s" in c}
            row = {"regime": regime_label(factor), "pool_factor": factor, "mix": mix.name,
                   "auto_vs_best": None, "auto_within_5pct": None}
            if {"recompute", "swap", "auto"} <= tps.keys():
                ratio = tps["auto"] / max(tps["recompute"], tps["swap"])
                row |= {"auto_vs_best": ratio, "auto_within_5pct": ratio >= 0.95}
            rows.append(row)
    return rows


def _timing_noise(cells: list[dict], mixes, factor: float) -> float | None:
    """max/min - 1 of tok/s across the modes in the largest pool where none preempted: the modes did the
    same work there, so this is the run's timing noise, the yardstick for the 5% goal."""
    spreads = []
    for mix in mixes:
        tps = [c["tok_per_s"] for c in cells if c["mix"] == mix.name and c["pool_factor"] == factor
               and c.get("num_preemptions") == 0]
        if len(tps) >= 2:
            spreads.append(max(tps) / min(tps) - 1)
    return max(spreads) if spreads else None


def _print_table(result: dict, mixes, factors, modes) -> None:
    print(f"{result['model']} {result['dtype']} on {result['device']}; block {result['block_size']} tokens = "
          f"{result['bytes_per_block'] / 1024:.0f} KiB; max_num_seqs {result['max_num_seqs']}, "
          f"max_num_batched_tokens {result['max_num_batched_tokens']}; swap space {result['swap_factor']:g}x "
          "min(pool, working set)" + (f"; each cell: the median-time run of {result['repeat']}"
                                       if result["repeat"] > 1 else ""))
    for m in result["mixes"]:
        print(f"  {m['name']} ({m['note']}): {m['num_requests']} requests, prompts {m['prompt_len'][0]}-"
              f"{m['prompt_len'][1]} tokens, outputs {m['output_len'][0]}-{m['output_len'][1]}; working set "
              f"{m['working_set_blocks']} blocks")
    for mode, e in result["engines"].items():
        if "load_s" in e:
            print(f"  {mode} engine: {e['model']}, built in {e['load_s']:.1f} s (weights loaded once per mode)")
    group = f"{'tok/s':>7} {'p99 s':>6} {'pre/100':>7} {'recomp':>6} {'swap o/i':>9} {'ok':>2}"
    print()
    print(f"{'':<22} {'':<5} {'blocks':>6} |" + "|".join(f" {m:^{len(group)}} " for m in modes) + "| auto vs best")
    print(f"{'regime':<22} {'mix':<5} {'':>6} |" + "|".join(f" {group} " for _ in modes) + "|")
    by_key = {(c["mode"], c["mix"], c["pool_factor"]): c for c in result["cells"]}
    rows = {(r["mix"], r["pool_factor"]): r for r in result["rows"]}
    for factor in factors:
        for mix in mixes:
            blocks = by_key[(modes[0], mix.name, factor)]["num_blocks"]
            parts = []
            for mode in modes:
                c = by_key[(mode, mix.name, factor)]
                if "unsupported" in c:
                    parts.append(f" {'unsupported':^{len(group)}} ")
                    continue
                swap = f"{c['num_swapped_out_blocks']}/{c['num_swapped_in_blocks']}"
                parts.append(f" {c['tok_per_s']:7.1f} {c['p99_latency_s']:6.2f} "
                             f"{c['preemptions_per_100_requests']:7.0f} {c['num_recomputed_tokens']:6d} "
                             f"{swap:>9} {'✓' if c['outputs_match'] else '✗':>2} ")
            row = rows[(mix.name, factor)]
            verdict = "-" if row["auto_vs_best"] is None else (
                f"{row['auto_vs_best']:.3f} {'yes' if row['auto_within_5pct'] else 'NO'}")
            print(f"{regime_label(factor):<22} {mix.name:<5} {blocks:>6} |" + "|".join(parts) + f"| {verdict}")
    print("\npre/100: preemptions per 100 requests; recomp: tokens recomputed after recompute preemptions; swap o/i: "
          "blocks swapped out/in; ok: greedy outputs equal those of the largest pool; auto vs best: auto tok/s / "
          "max(recompute, swap) tok/s, goal >= 0.95")
    counts = sorted({c["num_requests"] for c in result["cells"] if "num_requests" in c})
    if counts and counts[0] < MIN_P99_SAMPLES:   # the p99 of a cell's few requests is a lower bound on the tail
        print(f"p99 s: over each cell's {'-'.join(str(n) for n in dict.fromkeys([counts[0], counts[-1]]))} "
              f"requests, fewer than {MIN_P99_SAMPLES}: a lower bound on the tail")
    if result["timing_noise"] is not None:
        print(f"timing noise: in the {regime_label(factors[0])} rows no mode preempted, so all did the same work; "
              f"their tok/s differ by up to {100 * result['timing_noise']:.0f}%")
    bad = [c for c in result["cells"] if c.get("outputs_match") is False]
    for c in bad:
        d = c["mismatches"][0]
        print(f"✗ {c['mode']} {c['mix']} {c['regime']}: {len(c['mismatches'])} requests differ; request "
              f"{d['request']} first at output position {d['position']}: {d['got']} vs {d['expected']}")
