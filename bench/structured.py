"""`cliffguard bench structured`: what a JSON schema costs decode throughput, at each batch size.

For max(B, 20) chat prompts (the twenty schemas of `bench.schemas`, cycled), B at a time, the engine generates:
- **schema**: each row constrained by its schema (greedy), grammars already built (the cache is warm: the
  figure is the per-token cost, not the first request's build);
- **plain**: the same prompts unconstrained, each row told to generate exactly as many tokens as it did
  under its schema (`ignore_eos`), so both runs do the same forward passes over the same batch shapes.
The two alternate `--repeats` times in one process; the best time of each counts. tokens/s = generated
tokens / wall time of `generate` (prefill included, the same in both). The grammar's cost is
1 - schema tokens/s / plain tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.options import int_list
from bench.schemas import SCHEMAS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes (default 1,32)")
    p.add_argument("--max-tokens", type=int, default=160, help="output limit of the constrained rows")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per batch size; the best counts")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _timed_generate(engine, prompts, params, batch: int) -> tuple[list, float]:
    """`generate` over the prompts, `batch` at a time; (outputs, seconds)."""
    started, outs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i:i + batch], params[i:i + batch])
    return outs, time.perf_counter() - started


def measure(engine, batch: int, max_tokens: int, repeats: int) -> dict:
    from engine.sampling import SamplingParams
    from engine.structured import StructuredOutput

    rows = [SCHEMAS[i % len(SCHEMAS)] for i in range(max(batch, len(SCHEMAS)))]
    prompts = [engine.tokenizer.encode_chat([{"role": "system", "content": "Answer in JSON."},
                                             {"role": "user", "content": f"Give an example of {name.replace('_', ' ')}."}])
               for name, _, _ in rows]
    constrained = [SamplingParams(temperature=0, max_tokens=max_tokens, structured=StructuredOutput.json_schema(s))
                   for _, s, _ in rows]
    outs, _ = _timed_generate(engine, prompts, constrained, batch)   # builds every grammar once (then cached)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    best = {"schema": float("inf"), "plain": float("inf")}
    for _ in range(repeats):
        for side, params in (("schema", constrained), ("plain", plain)):
            outs, seconds = _timed_generate(engine, prompts, params, batch)
            assert [len(o.outputs[0].token_ids) for o in outs] == lengths, "the two sides must match token for token"
            best[side] = min(best[side], seconds)
    num_tokens = sum(lengths)
    schema_tps, plain_tps = num_tokens / best["schema"], num_tokens / best["plain"]
    return {"batch": batch, "num_tokens": num_tokens, "plain_tokens_per_s": plain_tps,
            "schema_tokens_per_s": schema_tps, "grammar_cost": 1 - schema_tps / plain_tps}


def run(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.weights import resolve_model

    batches = int_list(args.batch_sizes, "--batch-sizes", 1, "batch sizes must be >= 1")
    for name in ("repeats", "max_tokens"):   # before the model loads
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    folder = resolve_model(args.model)
    block_size = 16
    per_seq_blocks = (256 + args.max_tokens) // block_size + 1
    engine = LLMEngine.from_args(str(folder), progress=False, block_size=block_size,
                                 num_blocks=per_seq_blocks * max(batches) + 8, max_num_seqs=max(batches),
                                 max_num_batched_tokens=4096, device=args.device)
    results = [measure(engine, b, args.max_tokens, args.repeats) for b in batches]
    if args.json:
        print(json.dumps({"device": str(engine.device), "results": results}, indent=2))
        return 0
    print(f"device {engine.device}; greedy, {args.max_tokens} tokens at most per row, best of {args.repeats}")
    print(f"{'batch':>6} {'tokens':>7} {'plain tok/s':>12} {'schema tok/s':>13} {'grammar cost':>13}")
    for r in results:
        print(f"{r['batch']:>6} {r['num_tokens']:>7} {r['plain_tokens_per_s']:>12.1f} {r['schema_tokens_per_s']:>13.1f} "
              f"{100 * r['grammar_cost']:>12.1f}%")
    return 0
