"""What a load measured: per class latency percentiles, throughput and goodput, what `/metrics`
said (each device's replicas over time too), the `LoadReport` with its JSON, files and plots, and the
table `bench serve` prints."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.load.sender import RequestRecord
from bench.load.plan import PROBE_CLASS, Goodput, LoadConfig
from bench.load.scrape import COUNTERS, SCRAPED, ScrapeSample, Scraper
from pools.workload import MIN_P99_SAMPLES, latency_stats, p99_lower_bound

LATENCIES = ("ttft", "itl", "tpot", "e2e")


# --- summaries ---------------------------------------------------------------------------------------------

def latencies(records: Iterable[RequestRecord], metric: str, *, completed_only: bool = True) -> list[float]:
    """The values of one of `LATENCIES` (ITL: every gap of every request, one per token) over the completed
    requests, or with `completed_only` False over every request that measured one: the gaps a cancelled,
    timed-out or failed stream did stream count too (its slow tail), and its TTFT once its first token came
    (e2e and TPOT exist only for completed requests)."""
    out: list[float] = []
    for r in records:
        if completed_only and r.status != "ok":
            continue
        if metric == "itl":
            out += r.itl
        elif (value := getattr(r, metric)) is not None:
            out.append(value)
    return out


def class_summary(records: Sequence[RequestRecord], duration_s: float, goodput: Goodput | None) -> dict[str, Any]:
    """Counts, latency stats of the completed requests (s, `latency_stats` of each of LATENCIES: a request
    cut off, timed out or failed counts in `unfinished` or `errors`, not in the percentiles), tokens,
    throughput over the run (completed requests and their output tokens per second of `duration_s`), the
    pools that answered, the most common errors, and goodput: good requests per second and `fraction` =
    good / all requests."""
    done = [r for r in records if r.status == "ok"]
    output_tokens = sum(r.num_output_tokens for r in done)
    summary: dict[str, Any] = {
        "count": len(records), "completed": len(done),
        "errors": sum(r.status == "error" for r in records),
        "unfinished": sum(r.status == "unfinished" for r in records),
        **{metric: latency_stats(latencies(done, metric)) for metric in LATENCIES},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done), "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": output_tokens / duration_s,
        "goodput": None,
        "pools": dict(Counter(r.pool for r in records if r.pool is not None)),
        "error_messages": dict(Counter(r.error for r in records if r.status != "ok").most_common(5)),
    }
    if goodput is not None:
        good = sum(goodput.is_good(r) for r in records)
        summary["goodput"] = {"num_good": good, "requests_per_s": good / duration_s,
                              "fraction": good / len(records) if records else None}
    summary["replicas"] = replica_split(records)
    summary["prefix_affinity"] = prefix_affinity(records)
    return summary


def replica_split(records: Iterable[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Per pool, what each replica (the `x-cliffguard-replica` header) answered: completed requests and
    their tokens (prompt + output: the token load), each replica's share of the pool's tokens and the
    largest relative deviation from an even split (|share - 1/R| x R); empty without the header."""
    by_pool: dict[str, dict[str, dict[str, int]]] = {}
    for r in records:
        if r.status != "ok" or r.replica is None:
            continue
        entry = by_pool.setdefault(r.pool or "", {}).setdefault(r.replica, {"requests": 0, "tokens": 0})
        entry["requests"] += 1
        entry["tokens"] += (r.prompt_tokens or r.prompt_len) + r.num_output_tokens
    out: dict[str, dict[str, Any]] = {}
    for pool, replicas in sorted(by_pool.items()):
        total = sum(e["tokens"] for e in replicas.values())
        shares = {name: e["tokens"] / total if total else None for name, e in replicas.items()}
        out[pool] = {"replicas": dict(sorted(replicas.items())), "token_shares": shares}
    return out


def even_split_deviation(split: dict[str, Any], num_replicas: int) -> float | None:
    """The largest relative deviation of a pool's token shares from 1/num_replicas (a replica that answered
    nothing counts as share 0); None without traffic."""
    shares = [share for share in split["token_shares"].values() if share is not None]
    if not shares:
        return None
    shares += [0.0] * (num_replicas - len(shares))
    return max(abs(share * num_replicas - 1) for share in shares)


def prefix_affinity(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """For a class whose prompts start with shared documents: of the requests after each document's first,
    how many went to the replica that answered the first (which cached it). None without documents or
    the replica header."""
    groups: dict[int, list[RequestRecord]] = {}
    for r in sorted(records, key=lambda r: r.sent_s if r.sent_s is not None else math.inf):
        if r.prefix is not None and r.replica is not None and r.status == "ok":
            groups.setdefault(r.prefix, []).append(r)
    if not groups:
        return None
    repeats = same = 0
    for group in groups.values():
        first = group[0].replica
        repeats += len(group) - 1
        same += sum(r.replica == first for r in group[1:])
    return {"documents": len(groups), "repeats": repeats, "on_first_replica": same,
            "fraction": same / repeats if repeats else None}


def scrape_summary(scraper: Scraper | None, url: str) -> dict[str, Any]:
    """How scraping went (count, failures, max/p99 scrape time) and, per pool, the peaks of the series."""
    if scraper is None:
        return {"url": url, "skipped": "disabled", "count": 0, "failed": 0, "max_s": None, "p99_s": None,
                "mean_s": None, "pools": {}, "replicas": {}, "errors": {}}
    ok = [s for s in scraper.samples if s.error is None]
    times = latency_stats([s.scrape_s for s in ok])
    pools: dict[str, dict[str, float | None]] = {}
    for name in sorted({p for s in ok for p in s.pools}):
        series = {key: [s.pools[name][key] for s in ok if key in s.pools.get(name, {})] for key in SCRAPED.values()}
        pools[name] = {f"max_{key}": max(v) if v else None for key, v in series.items() if key not in COUNTERS}
        pre = series["num_preemptions_total"]
        pools[name]["num_preemptions"] = pre[-1] - pre[0] if pre else None
        computed = series["computed_tokens_total"]
        pools[name]["computed_tokens"] = computed[-1] - computed[0] if computed else None
    errors = Counter(s.error for s in scraper.samples if s.error is not None)
    return {"url": url, "skipped": scraper.skipped, "count": len(ok), "failed": len(scraper.samples) - len(ok),
            "max_s": times["max"], "p99_s": times["p99"], "mean_s": times["mean"], "pools": pools,
            "replicas": replica_summary(ok), "errors": dict(errors.most_common(3))}


def replicas_timeline(scrapes: Iterable[ScrapeSample]) -> list[dict[str, Any]]:
    """One entry per successful scrape and device of `cliffguard_replicas`: {t_s, device, ready, loading,
    ... every state any scrape named} (replicas; 0 for a state the scrape did not name); [] when no
    scrape had the series (a server other than cliffguard)."""
    seen = [s for s in scrapes if s.error is None and s.replicas]
    states = dict.fromkeys(("ready", "loading"))
    for s in seen:
        for counts in s.replicas.values():
            states.update(dict.fromkeys(counts))
    return [{"t_s": s.t_s, "device": device, **{state: counts.get(state, 0.0) for state in states}}
            for s in seen for device, counts in sorted(s.replicas.items())]


def replica_summary(scrapes: Iterable[ScrapeSample]) -> dict[str, dict[str, float]]:
    """Per device, the most replicas seen in each state over the run (`max_ready`, `max_loading`, ...);
    {} without the series."""
    out: dict[str, dict[str, float]] = {}
    for entry in replicas_timeline(scrapes):
        peaks = out.setdefault(entry["device"], {})
        for state, count in entry.items():
            if state not in ("t_s", "device"):
                peaks[f"max_{state}"] = max(peaks.get(f"max_{state}", count), count)
    return out


@dataclass(frozen=True)
class LoadReport:
    """The outcome of `run_load`: plain data, times in seconds.

    `summary[class]`: `class_summary` (its latency percentiles over the completed requests; the probe
    class too, under `probe`); `totals`: the run as a whole (every class) plus `scrape` (`scrape_summary`)
    and `send_lag_s` (stats of `send_lags`, how late requests left against their drawn arrival: the
    client's own overload shows here, hidden from the latencies); `records`/`scrapes`: the raw measurements;
    `rate_phases`: (rate req/s, seconds) of each phase when the arrival rate followed phases
    (`bench.load.run.RatePhase`), else empty.
    """

    config: LoadConfig
    model: str
    summary: dict[str, dict[str, Any]]
    totals: dict[str, Any]
    records: tuple[RequestRecord, ...]
    scrapes: tuple[ScrapeSample, ...]
    rate_phases: tuple[tuple[float, float], ...] = ()

    def to_json(self, *, raw: bool = True) -> dict[str, Any]:
        """JSON-ready dict: config (API key hidden; `rate_phases` [{rate, duration_s}] or None), model, summary,
        totals and, with `raw`, records, scrapes and, when the server counted replicas, `replicas_timeline`."""
        config = asdict(self.config)
        config["classes"] = msgspec.to_builtins(self.config.classes)   # models, not dataclasses
        config["api_key"] = "***" if self.config.api_key else None
        if math.isinf(self.config.request_rate):
            config["request_rate"] = "inf"
        config["rate_phases"] = [{"rate": rate, "duration_s": seconds} for rate, seconds in self.rate_phases] or None
        data = {"config": config, "model": self.model, "summary": self.summary, "totals": self.totals}
        if raw:
            data["requests"] = [r.to_json() for r in self.records]
            data["scrapes"] = [asdict(s) for s in self.scrapes]
            if timeline := replicas_timeline(self.scrapes):
                data["replicas_timeline"] = timeline
        return data


def build_report(config: LoadConfig, model: str, records: Sequence[RequestRecord], scraper: Scraper | None,
                 duration_s: float, rate_phases: tuple[tuple[float, float], ...] = ()) -> LoadReport:
    """Summaries per class and for the whole run from the raw records."""
    names = [c.name for c in config.classes] + ([PROBE_CLASS] if config.probe_rate > 0 else [])
    summary = {name: class_summary([r for r in records if r.class_name == name], duration_s, config.goodput)
               for name in names}
    workload = [r for r in records if r.class_name != PROBE_CLASS]   # the run's figures: the probes apart
    whole = class_summary(workload, duration_s, None)
    totals = {key: whole[key] for key in ("count", "completed", "errors", "unfinished", "output_tokens",
                                          "prompt_tokens", "request_throughput", "output_throughput", "replicas")}
    totals["token_throughput"] = (whole["prompt_tokens"] + whole["output_tokens"]) / duration_s
    totals.update(probes=len(records) - len(workload), duration_s=duration_s,
                  last_arrival_s=max((r.scheduled_s for r in records), default=0.0),
                  send_lag_s=latency_stats(send_lags(records)),
                  scrape=scrape_summary(scraper, config.scrape_url))
    return LoadReport(config, model, summary, totals, tuple(records), tuple(scraper.samples if scraper else ()),
                      tuple((float(rate), float(seconds)) for rate, seconds in rate_phases))


def send_lags(records: Iterable[RequestRecord]) -> list[float]:
    """How late each sent request left against its drawn arrival (s): the client's own delay, which the
    latency figures count in (they are timed from the arrival), kept as a diagnostic of the client."""
    return [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]


def counter_window(scrapes, pool: str, key: str) -> tuple[ScrapeSample, ScrapeSample] | None:
    """The first and the last successful scrape that read a pool's counter; None with fewer than two.
    `counter_rate`'s window: what is compared with its increase must be counted between the same two."""
    ok = [s for s in scrapes if s.error is None and key in s.pools.get(pool, {})]
    return (ok[0], ok[-1]) if len(ok) >= 2 else None


def counter_rate(scrapes, pool: str, key: str) -> tuple[float, float]:
    """(increase of a pool's counter, seconds) over its `counter_window`; (0, 0) without one."""
    window = counter_window(scrapes, pool, key)
    if window is None:
        return 0.0, 0.0
    first, last = window
    return last.pools[pool][key] - first.pools[pool][key], last.t_s - first.t_s


def tokens_done(record, first: float, last: float) -> int:
    """Tokens a request had done between two times of the run (s from its start): its prompt when its
    first token came inside the window, and each streamed token inside it."""
    if record.sent_s is None:
        return 0
    times = [record.sent_s + t for t in record.chunk_s]
    prompt = record.prompt_tokens or record.prompt_len
    return (prompt if times and first <= times[0] <= last else 0) + sum(
        n for t, n in zip(times, record.chunk_tokens) if first <= t <= last)


# --- files and plots -----------------------------------------------------------------------------------------

def write_report(report: LoadReport, out_dir: str | Path) -> list[Path]:
    """Write results.json, latency_cdf.png, server_timeline.png and, when the server counted replicas
    (`cliffguard_replicas`), replicas_timeline.png into `out_dir` (created); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    paths = [results, out / "latency_cdf.png", out / "server_timeline.png"]
    plot_latency_cdf(report, paths[1])
    plot_server_timeline(report, paths[2])
    if replicas_timeline(report.scrapes):
        paths.append(out / "replicas_timeline.png")
        plot_replicas_timeline(report, paths[-1])
    return paths


def plot_latency_cdf(report: LoadReport, path: Path) -> None:
    """TTFT, ITL and e2e CDFs, one line per class, log x axis."""
    from matplotlib.figure import Figure  # lazily: only runs that write plots pay for matplotlib

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    for ax, metric in zip(fig.subplots(1, 3), ("ttft", "itl", "e2e")):
        for name in report.summary:
            values = np.sort([v for v in latencies((r for r in report.records if r.class_name == name), metric)
                              if v > 0])
            if len(values):  # from 0 at the first value, so that a single value still draws a step
                ax.step(np.r_[values[0], values], np.r_[0.0, np.arange(1, len(values) + 1) / len(values)],
                        where="post", marker="." if len(values) < 20 else None, label=f"{name} (n={len(values)})")
        if ax.lines:
            ax.set_xscale("log")
            ax.legend(loc="lower right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{metric.upper()} (s)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"bench serve: {report.model}, {report.totals['count']} requests")
    fig.savefig(path, dpi=100)


_TIMELINE_LABELS = ("KV cache usage (%)", "running (solid) / waiting (dashed)", "preemptions since start",
                    "GET /metrics time (ms)")


def plot_server_timeline(report: LoadReport, path: Path) -> None:
    """KV usage, running/waiting, preemptions per pool and scrape time over the run; a note if no scrape."""
    from matplotlib.figure import Figure

    ok = [s for s in report.scrapes if s.error is None]
    if not ok:
        fig = Figure(figsize=(8, 3), layout="constrained")
        ax = fig.subplots()
        ax.axis("off")
        reason = report.totals["scrape"].get("skipped") or "no successful scrape"
        ax.text(0.5, 0.5, f"no /metrics data ({reason})", ha="center", va="center", transform=ax.transAxes)
        fig.savefig(path, dpi=100)
        return
    fig = Figure(figsize=(11, 11), layout="constrained")
    axes = fig.subplots(len(_TIMELINE_LABELS), 1, sharex=True)
    pools = sorted({p for s in ok for p in s.pools})
    for pool in pools:
        def series(key: str) -> tuple[list[float], list[float]]:
            pts = [(s.t_s, s.pools[pool][key]) for s in ok if key in s.pools.get(pool, {})]
            return [t for t, _ in pts], [v for _, v in pts]

        t, kv = series("kv_cache_usage_perc")
        axes[0].plot(t, [100 * v for v in kv], label=pool)
        line = axes[1].plot(*series("num_requests_running"), label=f"{pool} running")[0]
        axes[1].plot(*series("num_requests_waiting"), linestyle="--", color=line.get_color(), label=f"{pool} waiting")
        t, pre = series("num_preemptions_total")
        axes[2].plot(t, [v - pre[0] for v in pre], label=pool)
    axes[3].plot([s.t_s for s in ok], [1e3 * s.scrape_s for s in ok], marker=".", label="scrape")
    for ax, label in zip(axes, _TIMELINE_LABELS):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(f"server timeline: {report.totals['scrape']['url']}")
    fig.savefig(path, dpi=100)


def plot_replicas_timeline(report: LoadReport, path: Path) -> None:
    """Two panels on one time axis: requests sent per second (1 s bins; the `rate_phases` as planned,
    dashed) with each completed request's TTFT at its send time (right axis); each device's ready
    replicas (steps) and loading ones (dashed) with, on the right axis, each pool's requests waiting for
    KV credits (dotted). What an autoscaler did to a load, in one picture."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    _plot_arrivals_and_ttft(top, report)
    _plot_replicas(bottom, report.scrapes)
    bottom.set_xlabel("time since start (s)")
    fig.suptitle(f"replicas under load: {report.model}, {report.totals['count']} requests")
    fig.savefig(path, dpi=100)


def _plot_arrivals_and_ttft(ax: Any, report: LoadReport) -> None:
    sent = [r.sent_s for r in report.records if r.sent_s is not None]
    edges = np.arange(0.0, math.floor(max(sent, default=0.0)) + 2)
    ax.stairs(np.histogram(sent, bins=edges)[0], edges, color="C0", label="sent per second")
    if report.rate_phases:
        ends = np.cumsum([0.0] + [seconds for _, seconds in report.rate_phases])
        ax.stairs([rate for rate, _ in report.rate_phases], ends, color="0.35", linestyle="--", label="rate phases")
    ax.set_ylabel("requests sent per second")
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    done = [(r.sent_s, r.ttft) for r in report.records if r.status == "ok" and (r.ttft or 0) > 0
            and r.sent_s is not None]  # > 0: a log axis
    if done:
        twin.scatter(*zip(*done), s=8, color="C3", alpha=0.5, label="TTFT (at send time)")
        twin.set_yscale("log")
    twin.set_ylabel("TTFT of completed requests (s)")
    _legend(ax, twin)


def _plot_replicas(ax: Any, scrapes: Sequence[ScrapeSample]) -> None:
    from matplotlib.ticker import MaxNLocator

    timeline = replicas_timeline(scrapes)
    for i, device in enumerate(sorted({e["device"] for e in timeline})):
        entries = [e for e in timeline if e["device"] == device]
        t = [e["t_s"] for e in entries]
        ax.step(t, [e["ready"] for e in entries], where="post", color=f"C{i}", label=f"{device} ready")
        ax.step(t, [e["loading"] for e in entries], where="post", color=f"C{i}", linestyle="--",
                label=f"{device} loading")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("replicas")
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    ok = [s for s in scrapes if s.error is None]
    pools = sorted({p for s in ok for p, values in s.pools.items() if "admission_queue_depth" in values})
    for i, pool in enumerate(pools):   # grey, olive, cyan: apart from the devices' colours
        points = [(s.t_s, s.pools[pool]["admission_queue_depth"]) for s in ok
                  if "admission_queue_depth" in s.pools.get(pool, {})]
        twin.plot(*zip(*points), linestyle=":", color=f"C{7 + i % 3}", label=f"{pool} waiting for credits")
    twin.set_ylabel("requests waiting for KV credits")
    _legend(ax, twin)


def _legend(ax: Any, twin: Any) -> None:
    """One legend for an axis and its twin."""
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    if handles or more_handles:
        ax.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize="small")


# --- the table ---------------------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _replica_lines(s: dict[str, Any]) -> list[str]:
    """A class's split over replicas per pool, and its prefix affinity, when the server named replicas."""
    lines = []
    for pool, split in s.get("replicas", {}).items():
        parts = ", ".join(f"replica {name}: {e['requests']} requests, {e['tokens']} tokens "
                          f"({100 * (split['token_shares'][name] or 0):.1f}%)" for name, e in split["replicas"].items())
        lines.append(f"  pool {pool} by replica: {parts}")
    affinity = s.get("prefix_affinity")
    if affinity and affinity["repeats"]:
        lines.append(f"  prefix affinity: {affinity['on_first_replica']} of {affinity['repeats']} repeats of "
                     f"{affinity['documents']} documents on the replica that served the document first "
                     f"({100 * affinity['fraction']:.1f}%)")
    return lines


def format_report(report: LoadReport) -> str:
    """A readable table per class, then the run's totals and what /metrics said."""
    c, t = report.config, report.totals
    rate = "all at once" if math.isinf(c.request_rate) else f"{c.request_rate:g} req/s, burstiness {c.burstiness:g}"
    if report.rate_phases:
        phases = ", ".join(f"{phase_rate:g} req/s for {seconds:g} s" for phase_rate, seconds in report.rate_phases)
        rate = f"rate phases {phases}, burstiness {c.burstiness:g}"
    lines = [f"bench serve: {c.base_url}, model {report.model}, {rate}, seed {c.seed}",
             f"ran {t['duration_s']:.1f} s: {t['count']} requests"
             + (f" ({t['probes']} probes apart)" if t.get("probes") else "") +
             f", {t['completed']} completed, {t['errors']} errors, "
             f"{t['unfinished']} unfinished; {t['request_throughput']:.2f} req/s, "
             f"{t['output_throughput']:.1f} output tok/s; send lag max {_ms(t['send_lag_s']['max'])} ms"]
    for name, s in report.summary.items():
        pools = ", ".join(f"{pool} {n}" for pool, n in s["pools"].items()) or "-"
        lines += ["", f"{name}: {s['count']} requests, {s['completed']} completed, {s['errors']} errors, "
                  f"{s['unfinished']} unfinished; pools: {pools}",
                  f"  {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
                  + ("" if s["goodput"] is None else f"; goodput {s['goodput']['requests_per_s']:.2f} req/s "
                     f"({100 * (s['goodput']['fraction'] or 0):.1f}% of requests good)"),
                  f"  {'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99", "max"))
                  + "   (completed requests)"]
        for metric in LATENCIES:
            stats = s[metric]
            few = p99_lower_bound(stats)   # marked
            lines.append(f"  {metric.upper():<6}" + "".join(f"{_ms(stats[k]) + ('*' if k == 'p99' and few else ''):>10}"
                                                           for k in ("mean", "p50", "p90", "p99", "max")))
        if any(p99_lower_bound(s[m]) for m in LATENCIES):
            lines.append(f"  * p99 of fewer than {MIN_P99_SAMPLES} samples: a lower bound on the tail")
        lines += [f"  {n}x {message}" for message, n in s["error_messages"].items()]
        lines += _replica_lines(s)
    sc = t["scrape"]
    lines.append("")
    if sc["skipped"]:
        lines.append(f"metrics: not scraped ({sc['skipped']})")
    else:
        lines.append(f"metrics: {sc['count']} scrapes of {sc['url']} ({sc['failed']} failed); scrape time max "
                     f"{_ms(sc['max_s'])} ms, p99 {_ms(sc['p99_s'])} ms")
        lines += [f"  {n}x {message}" for message, n in sc["errors"].items()]
    for pool, p in sc["pools"].items():
        if not pool:   # the device's series (no pool label): not a pool's line
            continue
        kv = "-" if p["max_kv_cache_usage_perc"] is None else f"{100 * p['max_kv_cache_usage_perc']:.1f}%"
        lines.append(f"  pool {pool}: KV usage max {kv}, running max {_count(p['max_num_requests_running'])}, "
                     f"waiting max {_count(p['max_num_requests_waiting'])}, "
                     f"preemptions {_count(p['num_preemptions'])}"
                     + ("" if p["max_admission_queue_depth"] is None else
                        f", waiting for credits max {_count(p['max_admission_queue_depth'])}"))
    for device, peaks in sc.get("replicas", {}).items():
        lines.append(f"  device {device}: replicas " + ", ".join(f"{key} {_count(value)}" for key, value in
                                                                 peaks.items()))
    return "\n".join(lines)
