"""A sweep over request rates, the same arrivals for every layout at one rate: where p99 TTFT
bends (the knee), as a table and a plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig
from engine.step_cost import StepTime
from pools.capacity_plan import CapacityPlan
from pools.simulation.runner import make_requests, simulate
from pools.simulation.summary import ms, summarize
from pools.config.spec import CliffguardConfig
from pools.workload import WorkloadClass


def sweep(layouts: Mapping[str, tuple[CliffguardConfig, CapacityPlan]], model_configs: Mapping[str, ModelConfig],
          classes: tuple[WorkloadClass, ...], rates: Sequence[float], step_times: Mapping[str, StepTime], *,
          duration: float, burstiness: float = 1.0, credits: bool = True, seed: int = 0) -> list[dict[str, Any]]:
    """`summarize` of every (layout, rate), same arrivals for every layout at one rate. Step-time models
    are per device name; a layout's devices are the config's."""
    rows = []
    for rate in rates:
        for name, (config, plan) in layouts.items():
            requests = make_requests(classes, rate, duration=duration, burstiness=burstiness, seed=seed)
            result = simulate(config, plan, model_configs, requests, step_times, credits=credits, seed=seed)
            rows.append({"layout": name, "rate": rate, **summarize(result)})
    return rows


def plot_knee(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """p99 TTFT (log scale) against the request rate, one line per (layout, class); a point of a run in which
    requests of the class failed (refused for `max_queue_seconds`, too large, unrouted: the p99 leaves them
    out) drawn as an x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = ["-", "--", ":", "-."]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    for li, layout in enumerate(layouts):
        mine = [r for r in rows if r["layout"] == layout]
        for cls in dict.fromkeys(c for r in mine for c in r["classes"]):
            points = [(r["rate"], r["classes"][cls]["ttft"]["p99"]) for r in mine
                      if cls in r["classes"] and r["classes"][cls]["ttft"]["p99"] is not None]
            if points:
                line, = ax.plot(*zip(*points), styles[li % len(styles)], marker="o", label=f"{layout}: {cls}")
                failed = [(r["rate"], r["classes"][cls]["ttft"]["p99"]) for r in mine if cls in r["classes"]
                          and r["classes"][cls]["errors"] and r["classes"][cls]["ttft"]["p99"] is not None]
                if failed:
                    ax.plot(*zip(*failed), "x", color=line.get_color(), markersize=11)
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title(title or "simulated knee: p99 TTFT vs request rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_sweep(rows: Sequence[dict[str, Any]]) -> str:
    classes = list(dict.fromkeys(c for r in rows for c in r["classes"]))
    head = f"{'rate':>6}  {'layout':<8}" + "".join(f"{c + ' TTFT p50/p99 (ms)':>28}" for c in classes)
    lines = [head + f"{'preempt/s':>11}{'failed':>8}"]
    for r in rows:
        cells = []
        for c in classes:
            t = r["classes"].get(c, {}).get("ttft", {})
            cells.append(f"{ms(t.get('p50')) + ' / ' + ms(t.get('p99')):>28}")
        preempt = sum(p["preemptions_per_s"] for p in r["pools"].values())
        failed = sum(c["errors"] for c in r["classes"].values())   # refused, too large, unroutable: not in the p99s
        lines.append(f"{r['rate']:>6g}  {r['layout']:<8}" + "".join(cells) + f"{preempt:>11.2f}{failed:>8}")
    return "\n".join(lines)
