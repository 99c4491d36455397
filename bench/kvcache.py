"""`cliffguard bench kvcache`: an FP8 KV cache against the model-dtype cache, on the same chat prompts.

Five engines over the same model, one after the other: the default cache (`kv_cache_dtype: auto`), an FP8
cache with the scales measured at start (`engine.kv_scales`), an FP8 cache with every scale 1.0, the default
cache beside FP8 weights (`quantization: fp8`: each projection quantized a row at a time, as a float checkpoint
is held in FP8), and, as a yardstick, the default cache with the model in the other common dtype (bfloat16 beside
a float32 model, float32 beside a half-precision one): how far greedy answers move under the rounding every GPU
deployment already accepts. Each answers `--prompts` fixed chat questions greedily (`--max-tokens`, logprobs on).
Reported for each variant against the default:

- **agreement**: prompts answered token for token the same, also over each answer's first 8, 16, 32, ...
  tokens (`identical_by_length`: a greedy answer cut short is the longer one's prefix), and the mean share
  of each answer before the first token that differs;
- **log-probability error**: over the positions where both answers still agree (so both saw the same
  context), the largest and the mean |difference| of the top-5 tokens' log-probabilities (log-softmax of
  the logits: a logit error less the shift of their log-sum-exp);
- **bytes**: S_KV per token of each cache, the ratio that the capacity formula turns into blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

CHAT_QUESTIONS = (
    "Name a colour.", "Why do cats purr? Answer briefly.", "2+2=?", "Write one sentence about rivers.",
    "What is the capital of France?", "List three fruits.", "Say hello in Spanish.", "What is 7 times 6?",
    "Give me a synonym for happy.", "Who wrote Hamlet?", "How many legs does a spider have?",
    "Describe the sea in five words.", "What does a baker do?", "Is ice heavier than water?",
    "Suggest a name for a small dog.", "What is the opposite of early?", "Explain what a verb is.",
    "Which planet is closest to the sun?", "Give one tip for sleeping well.", "What colour is grass?",
)
VARIANTS = ("fp8", "fp8, scales 1.0")   # then FP8 weights, then the yardstick, named by its dtype: "bfloat16 model"
WEIGHTS = "fp8 weights"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA and on a CPU that computes it natively, else float32) | float32 "
                        "| bfloat16")
    p.add_argument("--prompts", type=int, default=20, help=f"chat questions asked (at most {len(CHAT_QUESTIONS)})")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per answer (default 16)")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV cache budget in MiB")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _answers(model: str, args: argparse.Namespace, kv_cache_dtype: str, measure_scales: bool = True,
             dtype: str | None = None, quantization: str = "none"):
    """(outputs, S_KV bytes per token, the model's dtype) of one engine over the questions; `dtype` replaces
    `--dtype`; `quantization`: how it holds the weights."""
    from dataclasses import replace

    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from pools.capacity_plan import plan_single_pool

    _, config = plan_single_pool(model, device=args.device, dtype=dtype or args.dtype,
                                 kv_cache_bytes=args.kv_cache_mib << 20, max_model_len=512, max_num_seqs=args.prompts)
    engine = LLMEngine(replace(config, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=measure_scales,
                               quantization=quantization), progress=False)   # not measured: every scale stays 1.0
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in CHAT_QUESTIONS[:args.prompts]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=5))
    return [o.outputs[0] for o in outs], engine.kv_bytes_per_token, engine.model.embed_tokens.weight.dtype


def yardstick_dtype(dtype: torch.dtype) -> str:
    """The other common dtype beside a model's: bfloat16 beside float32, float32 beside a half-precision one."""
    return "bfloat16" if dtype == torch.float32 else "float32"


def prefix_lengths(max_tokens: int) -> list[int]:
    """8, 16, 32, ... below `max_tokens`, then `max_tokens`."""
    return [n for n in (8 << k for k in range(16)) if n < max_tokens] + [max_tokens]


def compare(reference: list, outputs: list) -> dict:
    """Agreement and log-probability error of `outputs` against `reference` (CompletionOutputs, in order)."""
    same, shares, errors = 0, [], []
    longest = max((len(ref.token_ids) for ref in reference), default=1)
    by_length = dict.fromkeys(prefix_lengths(max(longest, 1)), 0)
    for ref, out in zip(reference, outputs):
        a, b = list(ref.token_ids), list(out.token_ids)
        agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        for n in by_length:
            by_length[n] += a[:n] == b[:n]
        shares.append(agree / max(len(a), 1))
        for i in range(agree):
            mine = dict(out.top_logprobs[i])
            errors += [abs(v - mine[t]) for t, v in ref.top_logprobs[i] if t in mine]
    return {"identical": same, "prompts": len(reference), "identical_by_length": by_length,
            "agreed_share": statistics.mean(shares), "max_logprob_error": max(errors, default=0.0),
            "mean_logprob_error": statistics.mean(errors or [0.0])}


def run(args: argparse.Namespace) -> int:
    from engine.weights import resolve_model

    if not 1 <= args.prompts <= len(CHAT_QUESTIONS):
        raise ValueError(f"--prompts: must be 1..{len(CHAT_QUESTIONS)}, got {args.prompts}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    model = str(resolve_model(args.model))
    reference, ref_bytes, dtype = _answers(model, args, "auto")
    result = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "max_tokens": args.max_tokens,
              "kv_bytes_per_token": {"auto": ref_bytes}}
    for name, measure in zip(VARIANTS, (True, False)):
        outputs, kv_bytes, _ = _answers(model, args, "fp8", measure)
        result[name] = compare(reference, outputs)
        result["kv_bytes_per_token"][name] = kv_bytes
    outputs, _, _ = _answers(model, args, "auto", quantization="fp8")
    result[WEIGHTS] = compare(reference, outputs)
    other = yardstick_dtype(dtype)
    outputs, _, _ = _answers(model, args, "auto", dtype=other)
    result["yardstick"] = f"{other} model"
    result[result["yardstick"]] = compare(reference, outputs)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model} ({result['dtype']}): {args.prompts} chat questions, {args.max_tokens} greedy tokens each; "
          f"S_KV {ref_bytes:,} B/token, FP8 {result['kv_bytes_per_token']['fp8']:,} B/token "
          f"({ref_bytes / result['kv_bytes_per_token']['fp8']:.1f}x the blocks from the same bytes)")
    for name in (*VARIANTS, WEIGHTS, result["yardstick"]):
        r = result[name]
        lengths = ", ".join(f"{n}: {k}" for n, k in r["identical_by_length"].items())
        print(f"  {name:<16} identical {r['identical']}/{r['prompts']} (by length {lengths}), agreed share "
              f"{r['agreed_share']:.2f}, log-prob error max {r['max_logprob_error']:.3f} "
              f"mean {r['mean_logprob_error']:.4f}")
    print(f"  (the {result['yardstick']}: the same model in the other common dtype, the default cache: how far "
          "greedy answers move under rounding deployments already accept)")
    return 0
