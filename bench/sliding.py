"""`cliffguard bench sliding`: one KV budget, a model with sliding-window layers, every position kept against rings.

Two engines of the same model and weights, one pool each with the same `--kv-cache-mib`, both planned by the capacity
formula (`plan_single_pool`, prefix caching off, `avg_len` the workload's prompt plus answer): `sliding_kv: full`,
whose sliding layers keep every position in the paged blocks, and `sliding_kv: window`, whose sliding layers keep a
ring a sequence (`engine.sliding_kv`). Each serves the same `--requests` long prompts of `--prompt-tokens` random ids
(deterministic for `--seed`), submitted together, greedy answers of `--max-tokens`. Reported per engine: the plan's
max_num_seqs and blocks, the most sequences that ran at once, preemptions, the wall time and output tokens/s; and
whether the two engines' answers are the same (in float32 they must be: exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.engine import cfg_name, device_name, prepare_model_folder
from pools.cli_types import positive_int

DEFAULT_MODEL = "bench/models/gemma3-small"
LAYOUTS = ("full", "window")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF model folder with sliding layers (default {DEFAULT_MODEL}, a Gemma-3-shaped folder "
                        "without weights: give --random-weights; bench/models/mistral-small: every layer slides)")
    p.add_argument("--random-weights", action="store_true", help="the folder's shape with random weights")
    p.add_argument("--requests", type=positive_int, default=12, help="long prompts submitted together (default 12)")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, help="each prompt's tokens (default 1024)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="each answer's tokens (default 64)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256,
                   help="a step's token budget, the prefill chunk, and so a ring's length with the window (default 256)")
    p.add_argument("--kv-cache-mib", type=positive_int, default=48, help="each engine's KV budget (default 48)")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the random weights (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _engine(args: argparse.Namespace, model: str, layout: str):
    from dataclasses import replace

    from engine.llm_engine import LLMEngine
    from pools.capacity_plan import plan_single_pool

    plan, config = plan_single_pool(model, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20,
                                    sliding_kv=layout, enable_prefix_caching=False,
                                    avg_len=args.prompt_tokens + args.max_tokens,
                                    max_num_batched_tokens=args.max_num_batched_tokens)
    return plan.pools["default"], LLMEngine(replace(config, random_weights=args.random_weights, seed=args.seed),
                                            progress=False)


def _serve(engine, prompts: list[list[int]], params) -> dict[str, object]:
    """Every prompt submitted at once, served to the end: the answers, the wall time, the most sequences running."""
    scheduler = engine.schedulers[engine.default_pool]
    ids = [f"r{i}" for i in range(len(prompts))]
    started, peak, answers = time.perf_counter(), 0, {}
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers[out.request_id] = list(out.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
    seconds = time.perf_counter() - started
    return {"answers": [answers[r] for r in ids], "seconds": seconds, "peak_running": peak,
            "preemptions": scheduler.stats.num_preemptions,
            "output_tokens_per_s": sum(map(len, answers.values())) / seconds}


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.sampling import SamplingParams

    torch.manual_seed(args.seed)
    rng = random.Random(f"sliding-{args.seed}")
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="cliffguard-bench-") as tmp:
        model = prepare_model_folder(args.model, Path(tmp))
        engines = {layout: _engine(args, model, layout) for layout in LAYOUTS}
    first = engines["full"][1]
    vocab = min(first.model_config.vocab_size, 49_152)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{args.requests} prompts of {args.prompt_tokens} tokens, answers {args.max_tokens}, "
          f"{args.kv_cache_mib} MiB of KV each; {cfg_name(first)} {first.dtype} on {device_name(first.device)}"
          f"{', random weights' if args.random_weights else ''}", file=sys.stderr)
    for layout, (pool, engine) in engines.items():
        served = _serve(engine, prompts, params)
        ring = engine.kv_cache.ring
        results[layout] = {"max_num_seqs": pool.max_num_seqs, "num_blocks": pool.num_blocks,
                           "s_kv": pool.kv_bytes_per_token, "ring_tokens": ring.tokens(0) if ring else 0, **served}
    same = sum(a == b for a, b in zip(results["full"]["answers"], results["window"]["answers"]))
    summary = {"model": args.model, "device": device_name(first.device), "requests": args.requests,
               "answers_same": same, **{k: {n: v for n, v in r.items() if n != "answers"} for k, r in results.items()}}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        f, w = summary["full"], summary["window"]
        print(f"window / full: max_num_seqs {w['max_num_seqs'] / f['max_num_seqs']:.2f}x, output tokens/s "
              f"{w['output_tokens_per_s'] / f['output_tokens_per_s']:.2f}x; answers the same: {same} of {args.requests}")
        for layout in LAYOUTS:
            r = summary[layout]
            print(f"{layout:>6}: S_KV {r['s_kv']} B, ring {r['ring_tokens']} positions; plan max_num_seqs "
                  f"{r['max_num_seqs']}, {r['num_blocks']} blocks; ran {r['peak_running']} at once, "
                  f"{r['preemptions']} preemptions; {r['seconds']:.1f} s, {r['output_tokens_per_s']:.1f} output "
                  "tokens/s")
    exact = first.dtype == torch.float32
    return 0 if same == args.requests or not exact else 1
