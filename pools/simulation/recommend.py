"""A recommendation for a target SLO: the split of one device's KV between its two pools and the
token budget of the second that meet it with the most headroom, found by simulating each."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from engine.model_config import ModelConfig
from engine.step_cost import StepTime
from pools.simulation.runner import make_requests, simulate
from pools.simulation.summary import ms, summarize
from pools.config.spec import CliffguardConfig, SpecError
from pools.workload import WorkloadClass

SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
BUDGETS = (512, 1024, 2048, 4096, 8192)


def recommend(config: CliffguardConfig, model_configs: Mapping[str, ModelConfig], classes: tuple[WorkloadClass, ...],
              rate: float, step_times: Mapping[str, StepTime], *, ttft_p99: float, itl_p99: float | None = None,
              duration: float, vram_bytes: int | None = None, shares: Sequence[float] = SHARES,
              budgets: Sequence[int] = BUDGETS, credits: bool = True, burstiness: float = 1.0,
              seed: int = 0) -> dict[str, Any]:
    """Try each split of one device's KV between its two pools (`kv_share` of the first, the rest to
    the second) and each `max_num_batched_tokens` of the second, at `rate`; a candidate meets the SLO
    when every class's p99 TTFT (and p99 ITL, if given) is within it and nothing failed. The
    recommendation is the one that meets it with the most headroom (`_headroom`). Returns every candidate's
    figures (a worst p99 of None: some class finished nothing) and the choice (None when none meets it)."""
    from pools.capacity_plan import plan_capacity

    local = [p for p in config.pools if not p.is_upstream]
    if len(local) != 2 or local[0].device != local[1].device:
        raise SpecError("pools: --recommend splits one device between exactly two local pools; this config has "
                        f"{len(local)} local pool(s)" + ("" if len(local) != 2 else " on different devices"))
    first, second = local
    if not make_requests(classes, rate, duration=duration, burstiness=burstiness, seed=seed):
        raise SpecError("--request-rate", f"no request arrives in {duration:g} s at {rate:g} requests/s: a "
                                          "recommendation judges requests; raise --request-rate or --duration")
    candidates = []
    for share in shares:
        for budget in budgets:
            split = {first.name: first.replace(kv_share=share, kv_cache_bytes=None),
                     second.name: second.replace(kv_share=round(1 - share, 6), kv_cache_bytes=None,
                                                 max_num_batched_tokens=budget)}
            candidate = dataclasses.replace(config, pools=tuple(split.get(p.name, p) for p in config.pools))
            try:
                plan = plan_capacity(candidate, model_configs, vram_bytes=vram_bytes)
            except SpecError as exc:                     # e.g. too few blocks for max_model_len
                candidates.append({"kv_share": share, "max_num_batched_tokens": budget, "error": str(exc)})
                continue
            requests = make_requests(classes, rate, duration=duration, burstiness=burstiness, seed=seed)
            summary = summarize(simulate(candidate, plan, model_configs, requests, step_times, credits=credits,
                                         seed=seed))
            ttfts = [c["ttft"]["p99"] for c in summary["classes"].values()]
            worst_ttft = None if None in ttfts else max(ttfts, default=None)   # None: a class finished nothing
            worst_itl = max((c["itl"]["p99"] or 0.0) for c in summary["classes"].values())
            failed = sum(c["errors"] for c in summary["classes"].values())
            meets = not failed and worst_ttft is not None and worst_ttft <= ttft_p99 and (
                itl_p99 is None or worst_itl <= itl_p99)
            candidates.append({"kv_share": share, "max_num_batched_tokens": budget, "meets": meets,
                               "worst_ttft_p99": worst_ttft, "worst_itl_p99": worst_itl, "errors": failed,
                               "output_tokens_per_s": sum(c["output_tokens_per_s"]
                                                          for c in summary["classes"].values())})
    good = [c for c in candidates if c.get("meets")]
    current = first.kv_share if first.kv_share is not None else 0.5

    def _headroom(c: dict[str, Any]) -> tuple[float, float, float]:
        """The lowest worst p99 TTFT (to 10 ms), then the lowest worst p99 ITL (to 1 ms), then the split
        nearest the config's own. Not tokens/s: every candidate that meets the SLO served the same requests
        and failed none, so its tokens/s differ only by when its last request happened to end."""
        return (-round(c["worst_ttft_p99"], 2), -round(c["worst_itl_p99"], 3), -abs(c["kv_share"] - current))

    best = max(good, key=_headroom, default=None)
    return {"pools": [first.name, second.name], "rate": rate, "ttft_p99": ttft_p99, "itl_p99": itl_p99,
            "candidates": candidates, "recommended": best}


def format_recommendation(result: dict[str, Any]) -> str:
    first, second = result["pools"]
    lines = [f"{first + ' kv_share':>16}{second + ' budget':>16}{'worst TTFT p99':>16}{'worst ITL p99':>15}"
             f"{'tok/s':>9}  SLO"]
    for c in result["candidates"]:
        if "error" in c:
            lines.append(f"{c['kv_share']:>16.2f}{c['max_num_batched_tokens']:>16}  {c['error'][:80]}")
            continue
        lines.append(f"{c['kv_share']:>16.2f}{c['max_num_batched_tokens']:>16}{ms(c['worst_ttft_p99']):>13} ms"
                     f"{ms(c['worst_itl_p99']):>12} ms{c['output_tokens_per_s']:>9.0f}  "
                     f"{'meets' if c['meets'] else '-'}")
    best = result["recommended"]
    slo = f"p99 TTFT <= {result['ttft_p99']:g} s" + (f", p99 ITL <= {result['itl_p99']:g} s"
                                                      if result["itl_p99"] is not None else "")
    if best is None:
        lines.append(f"\nno candidate meets {slo} at {result['rate']:g} requests/s: add capacity or lower the rate")
    else:
        lines.append(f"\nrecommended at {result['rate']:g} requests/s ({slo}): {first} kv_share "
                     f"{best['kv_share']:.2f}, {second} kv_share {1 - best['kv_share']:.2f} and "
                     f"max_num_batched_tokens {best['max_num_batched_tokens']}")
    return "\n".join(lines)
