"""What a simulation shows: per class latency percentiles and throughput, per pool preemptions,
swap, KV usage, queues and throughput, per replica of a pool the requests and tokens it got, as a
dict and as a table; and each device's overload verdict for the arrivals it was given
(`overload_verdicts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.step_cost import StepTime
from pools.capacity_plan import CapacityPlan
from pools.plan_report import format_verdicts, plan_verdicts
from pools.simulation.devicesim import PoolTrace
from pools.simulation.runner import SimulationResult
from pools.workload import MIN_P99_SAMPLES, latency_stats, p99_lower_bound


def _time_weighted(times: list[float], values: list[float]) -> float | None:
    """Mean of a step-sampled series, each sample weighted by the time to the next one."""
    if len(times) < 2:
        return values[0] if values else None
    weights = np.diff(times)
    return float(np.average(values[:-1], weights=weights)) if weights.sum() > 0 else float(np.mean(values))


def _replica_split(replicas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """Each replica's figures with its share of the pool's token load (prompt + output tokens of the
    requests admitted there), and the split's deviation from even: the largest |share x R - 1|."""
    total = sum(r["tokens"] for r in replicas)
    shares = [r["tokens"] / total if total else 1 / len(replicas) for r in replicas]
    deviation = max(abs(share * len(replicas) - 1) for share in shares)
    return [dict(r, token_share=share) for r, share in zip(replicas, shares)], deviation


def _pool_summary(stats: dict[str, Any], traces: list[PoolTrace], span: float) -> dict[str, Any]:
    """KV usage: the replicas' mean of the time-weighted mean, and the peak of any; the largest
    running batch and engine waiting list of any replica; the pool's credit queue (one for all)."""
    means = [m for m in (_time_weighted(t.times, t.kv_usage) for t in traces) if m is not None]
    replicas, deviation = _replica_split(stats["replicas"])
    return dict(stats, replicas=replicas, replica_deviation=deviation,
                kv_usage_mean=float(np.mean(means)) if means else None,
                kv_usage_max=max((u for t in traces for u in t.kv_usage), default=None),
                max_running=max((n for t in traces for n in t.running), default=0),
                max_waiting=max((n for t in traces for n in t.waiting), default=0),
                max_queued=max((n for t in traces for n in t.queued), default=0),
                preemptions_per_s=stats["preemptions"] / span,
                output_tokens_per_s=stats["generated_tokens"] / span)


def summarize(result: SimulationResult) -> dict[str, Any]:
    """Per class: counts, TTFT / ITL / e2e percentiles (seconds), output tokens/s and requests/s over
    the simulated run; per pool: preemptions, swap, KV usage (time-weighted mean and max), queues,
    output tokens/s and each replica's requests and share of the tokens; per device: its replicas."""
    span = result.simulated_seconds or 1.0
    classes: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.cls for r in result.requests):
        reqs = [r for r in result.requests if r.cls == name]
        done = [r for r in reqs if r.finished]
        classes[name] = {
            "requests": len(reqs), "finished": len(done), "errors": sum(r.error is not None for r in reqs),
            "ttft": latency_stats([r.ttft for r in done]),
            "itl": latency_stats([gap for r in done for gap in r.itls]),
            "e2e": latency_stats([r.e2e for r in done]),
            "preempted_requests": sum(r.num_preemptions > 0 for r in reqs),
            "output_tokens_per_s": sum(r.output_len for r in done) / span,
            "requests_per_s": len(done) / span,
        }
    pools = {name: _pool_summary(stats, result.traces[name], span) for name, stats in result.pools.items()}
    errors = sorted({r.error for r in result.requests if r.error})
    return {"classes": classes, "pools": pools, "errors": errors[:5],
            "simulated_seconds": result.simulated_seconds, "steps": result.num_steps,
            "wall_seconds": result.wall_seconds, "replicas": dict(result.replicas),
            "autoscaled": dict(result.autoscaled)}


def overload_verdicts(result: SimulationResult, plan: CapacityPlan, step_times: Mapping[str, StepTime], *,
                      duration: float, step_model: str) -> dict[str, dict[str, Any]]:
    """Each device's planned overload verdict (`pools.plan_report.plan_verdicts`) for the requests each
    of its pools received in the run: their count over the `duration` of the arrivals, and their mean
    prompt and output lengths."""
    mix = {}
    for name, pool in plan.pools.items():   # a request past the pool's context was refused: no load of it
        mine = [r for r in result.requests if r.pool == name and r.prompt_len + r.output_len <= pool.max_model_len]
        if mine:
            mix[name] = (len(mine) / duration, float(np.mean([r.prompt_len for r in mine])),
                         float(np.mean([r.output_len for r in mine])))
    return plan_verdicts(plan, step_times, mix, step_model=step_model)


def ms(value: float | None) -> str:
    """Seconds as whole milliseconds for a table cell; "-" for none."""
    return "-" if value is None else f"{value * 1000:.0f}"


def _spiral(trips: list[dict[str, Any]]) -> str:
    return f"{trips[0]['at_s']:.0f} s" if trips else "-"


def format_summary(summary: dict[str, Any]) -> str:
    rows = _class_rows(summary) + [""] + _pool_rows(summary)
    for name, p in summary["pools"].items():
        if len(p["replicas"]) > 1:
            rows += [""] + _replica_rows(name, p)
    devices = ", ".join(f"{name} x{n}" for name, n in summary.get("replicas", {}).items())
    rows.append(f"\nsimulated {summary['simulated_seconds']:.1f} s in {summary['steps']} steps; "
                f"{summary['wall_seconds']:.1f} s of wall time" + (f"; replicas: {devices}" if devices else ""))
    rows.extend(f"pool {name}: at {t['at_s']:.1f} s: {t['reason']}" for name, p in summary["pools"].items()
                for t in p["death_spirals"][:1])
    rows.extend(f"device {name}: autoscaled (min {low}): simulated at its {summary['replicas'][name]} replicas from "
                "the start; scaling up is not modelled" for name, low in summary.get("autoscaled", {}).items())
    rows.extend(f"error: {e}" for e in summary["errors"])
    if summary.get("overload"):
        rows += ["", "overload of these arrivals (pools.demand; docs/SIMULATE.md \"Overloaded or not\"):",
                 *format_verdicts(summary["overload"])]
    return "\n".join(rows)


def _p99(stats: dict[str, Any]) -> str:
    """A p99 cell, marked `*` when it rests on fewer than MIN_P99_SAMPLES values (a lower bound of the tail)."""
    return ms(stats["p99"]) + ("*" if p99_lower_bound(stats) else "")


def _class_rows(summary: dict[str, Any]) -> list[str]:
    rows = [(f"{'class':<10}{'done':>7}{'err':>5}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
             f"{'e2e p50':>9}{'p99':>8}{'tok/s':>9}{'preempted':>11}   (ms)")]
    for name, c in summary["classes"].items():
        rows.append(f"{name:<10}{c['finished']:>7}{c['errors']:>5}{ms(c['ttft']['p50']):>10}"
                    f"{_p99(c['ttft']):>8}{ms(c['itl']['p50']):>9}{_p99(c['itl']):>8}"
                    f"{ms(c['e2e']['p50']):>9}{_p99(c['e2e']):>8}{c['output_tokens_per_s']:>9.0f}"
                    f"{c['preempted_requests']:>11}")
    if any(p99_lower_bound(c[k]) for c in summary["classes"].values() for k in ("ttft", "itl", "e2e")):
        rows.append(f"* a p99 over fewer than {MIN_P99_SAMPLES} samples: a lower bound of the tail")
    return rows


def _pool_rows(summary: dict[str, Any]) -> list[str]:
    """One row per pool: `blocks` and `seqs` are one replica's (`repl` of them), the rest the pool's."""
    rows = [(f"{'pool':<10}{'repl':>5}{'blocks':>8}{'seqs':>6}{'mode':>11}{'preempt':>9}{'/s':>7}{'KV mean':>9}"
             f"{'KV max':>8}{'run max':>9}{'wait max':>10}{'queued max':>12}{'tok/s':>9}{'spiral':>9}")]
    for name, p in summary["pools"].items():
        mean = "-" if p["kv_usage_mean"] is None else f"{p['kv_usage_mean']:.0%}"
        peak = "-" if p["kv_usage_max"] is None else f"{p['kv_usage_max']:.0%}"
        rows.append(f"{name:<10}{len(p['replicas']):>5}{p['num_blocks']:>8}{p['max_num_seqs']:>6}"
                    f"{p['preemption_mode']:>11}{p['preemptions']:>9}{p['preemptions_per_s']:>7.2f}{mean:>9}"
                    f"{peak:>8}{p['max_running']:>9}{p['max_waiting']:>10}{p['max_queued']:>12}"
                    f"{p['output_tokens_per_s']:>9.0f}{_spiral(p['death_spirals']):>9}")
    return rows


def _replica_rows(name: str, pool: dict[str, Any]) -> list[str]:
    """What each replica of the pool got: requests, their tokens (prompt + output) and its share."""
    rows = [(f"pool {name}: {len(pool['replicas'])} replicas, {pool['output_tokens_per_s']:.0f} output tokens/s; "
             f"token split {pool['replica_deviation']:.0%} off even"),
            f"{'replica':>9}{'requests':>10}{'tokens':>11}{'share':>7}{'computed':>11}{'generated':>11}{'preempt':>9}"]
    for i, r in enumerate(pool["replicas"]):
        rows.append(f"{i:>9}{r['requests']:>10}{r['tokens']:>11}{r['token_share']:>7.0%}{r['computed_tokens']:>11}"
                    f"{r['generated_tokens']:>11}{r['preemptions']:>9}")
    return rows
