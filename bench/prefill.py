"""`cliffguard bench prefill`: one long prompt's prefill through our engine vs transformers' forward.

For each length, a prompt of exactly that many tokens (random words, deterministic for `--seed`) is
prefilled by our engine (one request, `max_tokens` 1, greedy; timed from `add_request` until the
request has finished, so chunking, the LM head row and sampling are inside) and by transformers'
forward on the same ids (`logits_to_keep=1`, as its `generate` does for a prefill; KV cache on, as a
generation needs it). Both models are loaded once, in one process, with the same weights, dtype and
thread count, and the two systems alternate (which goes first swaps every repeat). Each repeat uses a
new prompt, so the prefix cache never holds a block of it (the bench checks `num_cached_tokens` == 0).

Our engine prefills in chunks of at most `--max-num-batched-tokens` (the pool's default 2048), each
over the cached prefix before it: a 5,000-token prompt is 2048 + 2048 + 904. The bench also checks
greedy parity itself: our sampled token must equal the argmax of transformers' last logits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from bench.engine import sync
from bench.options import int_list

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education river mountain bridge garden window letter engine signal cache "
         "token block kernel memory paper table chair glass light music color orange yellow quiet rapid gentle "
         "ancient modern strange simple careful brave bright heavy narrow silver golden frozen hollow").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--lengths", default="512,2048,5000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length and system (a new prompt each)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="our engine's per-step token budget, i.e. its prefill chunk size")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="our engine's KV cache budget in MiB")
    p.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def make_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Exactly `num_tokens` token ids of random words, deterministic for (`num_tokens`, `seed`)."""
    rng = random.Random(f"prefill-{seed}-{num_tokens}")
    ids: list[int] = []
    while len(ids) < num_tokens:
        text = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return ids[:num_tokens]


def run_ours(engine, ids: list[int], request_id: str) -> dict:
    """Prefill `ids` and sample one greedy token; seconds from add_request to finished, and the chunks."""
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    chunks: list[int] = []
    final = None
    sync(engine.device)
    started = time.perf_counter()
    engine.add_request(request_id, ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        if engine.last_step.num_prefill_tokens:
            chunks.append(engine.last_step.num_prefill_tokens)
    sync(engine.device)
    seconds = time.perf_counter() - started
    if final is None or final.error:
        raise RuntimeError(f"engine: request {request_id} failed: {final.error if final else 'no output'}")
    return {"seconds": seconds, "token": final.outputs[0].token_ids[0], "chunks": chunks,
            "num_cached_tokens": final.num_cached_tokens}


def run_transformers(model, ids: list[int], device: torch.device) -> dict:
    """transformers' forward over `ids` (last row's logits only); seconds, argmax and its top-2 margin."""
    input_ids = torch.tensor([ids], device=device)
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=input_ids, logits_to_keep=1).logits[0, -1].float()
    sync(device)
    seconds = time.perf_counter() - started
    top = logits.topk(2).values
    return {"seconds": seconds, "token": int(logits.argmax()), "margin": float(top[0] - top[1])}


def run(args: argparse.Namespace) -> int:
    # bad input fails before any work
    lengths = int_list(args.lengths, "--lengths", 2, "every length must be >= 2 tokens")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}")
    if args.kv_cache_mib <= 0:
        raise ValueError(f"--kv-cache-mib: must be > 0, got {args.kv_cache_mib}")
    from transformers import AutoModelForCausalLM

    from engine.llm_engine import LLMEngine
    from pools.capacity_plan import plan_single_pool

    _, config = plan_single_pool(args.model, device=args.device, dtype=args.dtype,
                                 kv_cache_bytes=args.kv_cache_mib << 20,
                                 max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(config, progress=False)
    device, dtype = engine.device, engine.dtype
    max_len = max(s.max_model_len for s in engine.schedulers.values())
    if max(lengths) >= max_len:
        raise ValueError(f"--lengths: {max(lengths)} tokens leave no room for one generated token within "
                         f"the model's max_model_len {max_len}")
    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=dtype).to(device).eval()
    threads = torch.get_num_threads()
    print(f"prefill: lengths {lengths}, {args.repeats} repeats each, chunks of {args.max_num_batched_tokens}; "
          f"{engine.model_config.architecture} {str(dtype).removeprefix('torch.')} on {device}"
          f"{f' ({threads} threads)' if device.type == 'cpu' else ''}", file=sys.stderr)

    warm = make_prompt(engine.tokenizer, 64, args.seed + 10_000)       # first-call costs, untimed
    run_ours(engine, warm, "prefill-warmup")
    run_transformers(hf, warm, device)

    rows = [measure_length(engine, hf, length, args.repeats, args.seed) for length in lengths]
    result = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
              "threads": threads, "max_num_batched_tokens": args.max_num_batched_tokens,
              "repeats": args.repeats, "rows": rows, "greedy_match": all(r["greedy_match"] for r in rows)}
    return _print(result, args)


def measure_length(engine, hf, length: int, repeats: int, seed: int) -> dict:
    """One row: `repeats` fresh prompts of `length` tokens through both, alternating which goes first."""
    ours, theirs, matches = [], [], []
    for r in range(repeats):
        ids = make_prompt(engine.tokenizer, length, seed * 1_000 + r)
        if r % 2 == 0:
            o = run_ours(engine, ids, f"prefill-{length}-{r}")
            t = run_transformers(hf, ids, engine.device)
        else:
            t = run_transformers(hf, ids, engine.device)
            o = run_ours(engine, ids, f"prefill-{length}-{r}")
        if o["num_cached_tokens"]:
            raise RuntimeError(f"prefix cache served {o['num_cached_tokens']} tokens of a fresh prompt")
        ours.append(o)
        theirs.append(t)
        matches.append({"repeat": r, "ours": o["token"], "transformers": t["token"],
                        "match": o["token"] == t["token"], "transformers_margin": t["margin"]})
    ours_s = [o["seconds"] for o in ours]
    hf_s = [t["seconds"] for t in theirs]
    return {"length": length, "chunks": ours[0]["chunks"],
            "ours_s": statistics.median(ours_s), "ours_best_s": min(ours_s), "ours_runs_s": ours_s,
            "transformers_s": statistics.median(hf_s), "transformers_best_s": min(hf_s),
            "transformers_runs_s": hf_s,
            "ratio": statistics.median(ours_s) / statistics.median(hf_s), "ratio_best": min(ours_s) / min(hf_s),
            "greedy_match": all(m["match"] for m in matches), "greedy": matches}


def _print(result: dict, args: argparse.Namespace) -> int:
    rows = result["rows"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'length':>7} {'ours s':>8} {'transformers s':>15} {'ours/transformers':>18} "
              f"{'(best-of)':>10}  {'greedy':>6}  our chunks")
        for row in rows:
            print(f"{row['length']:>7} {row['ours_s']:8.2f} {row['transformers_s']:15.2f} {row['ratio']:17.2f}x "
                  f"{row['ratio_best']:9.2f}x  {'same' if row['greedy_match'] else 'DIFF':>6}  "
                  f"{'+'.join(map(str, row['chunks']))}")
        print(f"median of {args.repeats} runs each (ratio of the best runs beside it), alternating in one process",
              file=sys.stderr)
    if not result["greedy_match"]:
        print("prefill: our greedy token differs from transformers' argmax (see 'greedy' in --json)",
              file=sys.stderr)
        return 1
    return 0
