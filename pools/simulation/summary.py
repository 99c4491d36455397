"""What a simulation shows: per class latency percentiles and throughput, per pool preemptions,
swap, KV usage and queues, as a dict and as a table."""

from __future__ import annotations

from typing import Any

import numpy as np

from pools.simulation.runner import SimulationResult
from pools.workload import latency_stats


def _time_weighted(times: list[float], values: list[float]) -> float | None:
    """Mean of a step-sampled series, each sample weighted by the time to the next one."""
    if len(times) < 2:
        return values[0] if values else None
    weights = np.diff(times)
    return float(np.average(values[:-1], weights=weights)) if weights.sum() > 0 else float(np.mean(values))


def summarize(result: SimulationResult) -> dict[str, Any]:
    """Per class: counts, TTFT / ITL / e2e percentiles (seconds), output tokens/s and requests/s over
    the simulated run; per pool: preemptions, swap, KV usage (time-weighted mean and max), queues."""
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
    pools = {}
    for name, stats in result.pools.items():
        trace = result.traces[name]
        pools[name] = dict(stats, kv_usage_mean=_time_weighted(trace.times, trace.kv_usage),
                           kv_usage_max=max(trace.kv_usage, default=None),
                           max_running=max(trace.running, default=0), max_waiting=max(trace.waiting, default=0),
                           max_queued=max(trace.queued, default=0),
                           preemptions_per_s=stats["preemptions"] / span)
    errors = sorted({r.error for r in result.requests if r.error})
    return {"classes": classes, "pools": pools, "errors": errors[:5],
            "simulated_seconds": result.simulated_seconds, "steps": result.num_steps,
            "wall_seconds": result.wall_seconds}


def ms(value: float | None) -> str:
    """Seconds as whole milliseconds for a table cell; "-" for none."""
    return "-" if value is None else f"{value * 1000:.0f}"


def _spiral(trips: list[dict[str, Any]]) -> str:
    return f"{trips[0]['at_s']:.0f} s" if trips else "-"


def format_summary(summary: dict[str, Any]) -> str:
    rows = [f"{'class':<10}{'done':>7}{'err':>5}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
            f"{'e2e p50':>9}{'p99':>8}{'tok/s':>9}{'preempted':>11}   (ms)"]
    for name, c in summary["classes"].items():
        rows.append(f"{name:<10}{c['finished']:>7}{c['errors']:>5}{ms(c['ttft']['p50']):>10}"
                    f"{ms(c['ttft']['p99']):>8}{ms(c['itl']['p50']):>9}{ms(c['itl']['p99']):>8}"
                    f"{ms(c['e2e']['p50']):>9}{ms(c['e2e']['p99']):>8}{c['output_tokens_per_s']:>9.0f}"
                    f"{c['preempted_requests']:>11}")
    rows.append("")
    rows.append(f"{'pool':<10}{'blocks':>8}{'seqs':>6}{'mode':>11}{'preempt':>9}{'/s':>7}{'KV mean':>9}"
                f"{'KV max':>8}{'run max':>9}{'wait max':>10}{'queued max':>12}{'spiral':>9}")
    for name, p in summary["pools"].items():
        mean = "-" if p["kv_usage_mean"] is None else f"{p['kv_usage_mean']:.0%}"
        peak = "-" if p["kv_usage_max"] is None else f"{p['kv_usage_max']:.0%}"
        rows.append(f"{name:<10}{p['num_blocks']:>8}{p['max_num_seqs']:>6}{p['preemption_mode']:>11}"
                    f"{p['preemptions']:>9}{p['preemptions_per_s']:>7.2f}{mean:>9}{peak:>8}{p['max_running']:>9}"
                    f"{p['max_waiting']:>10}{p['max_queued']:>12}{_spiral(p['death_spirals']):>9}")
    rows.append(f"\nsimulated {summary['simulated_seconds']:.1f} s in {summary['steps']} steps; "
                f"{summary['wall_seconds']:.1f} s of wall time")
    rows.extend(f"pool {name}: at {t['at_s']:.1f} s: {t['reason']}" for name, p in summary["pools"].items()
                for t in p["death_spirals"][:1])
    rows.extend(f"error: {e}" for e in summary["errors"])
    return "\n".join(rows)
