"""`cliffguard bench chaos`: does the gateway lose, duplicate or stall requests while things go wrong?

Starts `cliffguard serve` (`LiveServer`) on `--config` (default: config/pools.yaml, in a temporary copy
with the gateway's fault timers shortened: `write_timeout` 3 s, `stall_seconds` 6 s, restart back-off
from 0.2 s) and drives it over HTTP with a steady open-loop load: short streamed chat requests as a
Poisson process (`--rate`, 16 output tokens) and a few longer rag-ish completion prompts (`--rag-rate`,
~256 prompt tokens). Every steady request carries a unique id (in `user` and in its prompt); each
stream is read to its end and its answers counted: `[DONE]`s, error events, finish reasons per choice,
usage chunks and distinct completion ids. Meanwhile a fault script runs the faults one after another,
each in its own window (`--fault-seconds`), then a quiet window (`--quiet-seconds`, extended by at most
`max_settle_s` until the gateway has recovered):

1. `slow_readers`: streams with large outputs (n = 28, 8, 4; 20 top logprobs) on raw sockets with a
   4 KiB receive buffer whose client never reads; closed at the end of the window.
2. `disconnects`: streamed chat requests whose client goes away: before the answer, right after the
   headers, or after 1-3 content chunks.
3. `oversized`: a 3000-entry prompt list, 980k `stop_token_ids`, 200k empty chat messages, n = 64;
   each must be a 400 within `OVERSIZED_LIMIT_S`.
4. `kill_worker`: `kill -9` of the device worker (a child of the gateway's fork server).
5. `stop_worker`: `kill -STOP` of the worker; the watchdog should kill it after `stall_seconds` and
   restart it. SIGCONT is sent at the end of the window (or on any way out).
6. `burst`: `--burst` (500; 150 with `--quick`) small completions at once, each on its own connection.
7. `silent_bodies`: `--silent-bodies` (24; 8 with `--quick`) non-streamed chats whose answers (~260 KB: n = 4, 20 top logprobs) outgrow the
   socket buffers, on raw sockets that never read; goal: each connection closed by the gateway within
   `write_timeout` + 2 s of its answer's first byte (peeked at, not read).
8. `stop_idle_worker`: the steady load pauses, the worker falls idle and gets `kill -STOP`; goal:
   `/ready` is 503 naming the stall within `stall_seconds` + 1.5 s.
9. `poison`: a chat carrying the marker the server was started with (`CLIFFGUARD_FAULT_POISON`: its
   step raises in the worker); goal: 500 `poison_request` after exactly two worker restarts, the
   steady requests in flight retried, none lost or duplicated.
10. `tenant_burst`: one tenant (no API keys) sends `--tenant-burst` (16; 6 with `--quick`) chats of
   n = 8 x 24 tokens, then a 4-token chat a second later; goal: the small one answered within 5 s,
   before the burst's last answer.
11. `lose_node` (only with `--ray-nodes` >= 2, and then in the default list): removes the worker node
   of the local Ray cluster that hosts a replica; Ray restarts its actor on a node left.
12. `kill_gateway` (only with `--gateways 2`, and then last in the default list): `kill -9` of the second
   gateway; goal: the survivor leased the whole of every pool again (the replicas' own counters) within
   `LEASE_BACK_GOAL_S`.

`--ray-nodes N` starts a local Ray cluster (`bench.ray_local`: a head and N - 1 workers, 127.0.0.1
only, `--ray-node-cpus` each) and serves the config's copy with every device at `placement: ray`,
`replicas: N` (one per node) and `cpu_threads: 1`; the kill faults then aim at a replica's actor.
The cluster is stopped at the end, on any way out. On a cluster the replicas' own counters are looked at
every 0.25 s (`bench.chaos.replicas`: reserved and held KV credits against each pool's capacity, and the
replica's own high-water marks); goal: never over the capacity. `--gateways 2` starts a second gateway on
the same config and cluster (it follows the first, which places the replicas) and spreads the steady load
over both in turn; a request that one gateway failed before any token is sent to the other, as a load
balancer would (`retried` in the raw records).

A sampler reads, every 0.25 s, `/ready` (and each replica's state in it), each pool's KV credits
(`cliffguard_kv_credits_free` / `cliffguard_kv_credits` from /metrics) and the gateway process's RSS (VmRSS). A
fault's quiet window also waits for every replica to be up again. Steady requests are counted by the
window they were sent in: `answered` = an HTTP answer (200 with a complete stream, or an error status
or error event), `lost` = none (no response, or the client's `--timeout`), `cut` = a 200 whose stream
ended with no `[DONE]`, error or finish, `duplicated` = more than one answer for one id. A fault's
recovery time runs from its start to the first sample, after the fault was injected, at which
`/ready` is 200, every pool's credits are full and a steady chat request sent after the injection has
completed. Goal: 0 lost, 0 duplicated, every fault recovered within 15 s, each fault's own goal (7-10
and 12, `goal_met` in its notes) and, on a cluster, no replica ever over its capacity. The gateway's RSS
at idle and at its peak is reported. Each fault's row also has the chat TTFT p99 in 5-s bins of send
time from its start and `ttft_recovered_s`: the start of the first bin with >= 5 chat requests whose
p99 is within 1.5x the warm-up window's p99; and when /ready
first listed a replica down and then every replica up again (`replica_down_s`, `replica_back_s`).

`--quick` shortens every window (the run takes 2-3 minutes on a 2-core CPU), for a test, and sizes the
load faults to a few seconds of a 2-core CPU's work (20 disconnects, a burst of 150 connections, 8
silent bodies, a tenant burst of 6): a fault's recovery counts until every credit is back, so at full
size on such a CPU it would measure the device's speed (500 two-token completions are 19 s of its
work, 24 silent bodies 18 s), not the gateway's recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bench.chaos.fault_script import FaultRun, Shot, chaos_run, recovery_time, replica_outage
from bench.chaos.replicas import counters_summary, format_counters, within_capacity
from bench.chaos.arguments import ALL_FAULTS, QUICK, _fault_names, add_arguments, check_args  # noqa: F401 - the CLI's
from bench.chaos.careless import POISON_MARKER
from bench.chaos.steady import CHAT_TOKENS, CHAT_WORDS, PROBE_TIMEOUT_S, RAG_TOKENS, RAG_WORDS, SteadyRecord
from bench.live import REPO, LiveServer
from bench.ray_local import LocalRayCluster
from bench.options import out_dir
from pools.workload import MIN_P99_SAMPLES, latency_stats

DEFAULT_CONFIG = REPO / "config" / "pools.yaml"
FAULT_TIMERS = {"write_timeout": 3.0, "stall_seconds": 6.0,
                "restart_backoff": {"initial_seconds": 0.2, "factor": 2, "max_seconds": 2, "reset_after_seconds": 60}}
GOAL_RECOVERY_S = 15.0
OUTCOMES = ("ok", "error", "cut", "lost")
TTFT_BIN_S = 5.0            # a fault's chat TTFT p99 per bin of this many seconds of send time from its start
TTFT_BIN_MIN_CHAT = 5       # a bin with fewer chat requests (with a first token) does not say TTFT is back
TTFT_BACK_FACTOR = 1.5      # back: a bin's p99 within this factor of the warm-up window's p99




# --- the report ------------------------------------------------------------------------------------------

def account(records: Sequence[SteadyRecord], start_s: float, end_s: float) -> dict[str, int]:
    """Counts of the steady requests sent in [start_s, end_s): sent, answered (ok + error), each outcome,
    and duplicated (answered more than once)."""
    sent = [r for r in records if r.sent_s is not None and start_s <= r.sent_s < end_s]
    counts = Counter(r.outcome for r in sent)
    return {"sent": len(sent), "answered": counts["ok"] + counts["error"], **{o: counts[o] for o in OUTCOMES},
            "duplicated": sum(r.answers > 1 for r in sent)}


def _chat_ttfts(records: Sequence[SteadyRecord], start_s: float, end_s: float) -> list[float]:
    return [r.ttft_s for r in records if r.kind == "chat" and r.ttft_s is not None
            and r.sent_s is not None and start_s <= r.sent_s < end_s]


def window_ttft_p99(records: Sequence[SteadyRecord], start_s: float, end_s: float) -> float | None:
    """p99 TTFT (s) of the steady chat requests sent in [start_s, end_s) that got a first token."""
    return latency_stats(_chat_ttfts(records, start_s, end_s))["p99"]


def ttft_bins(records: Sequence[SteadyRecord], start_s: float, end_s: float,
              bin_s: float = TTFT_BIN_S) -> list[dict[str, Any]]:
    """The chat TTFT p99 in bins of `bin_s` s of send time from `start_s` until `end_s` (the last bin may
    be shorter): each bin's start (`from_s`, s after `start_s`), its chat requests with a first token
    (`num_chat`) and their p99 (`ttft_p99_s`, None with none), and those sent in it that got none
    (`num_unanswered`: lost, cut before a token, refused)."""
    bins = []
    for i in range(max(0, math.ceil((end_s - start_s) / bin_s))):
        low, high = start_s + i * bin_s, min(start_s + (i + 1) * bin_s, end_s)
        ttfts = _chat_ttfts(records, low, high)
        sent = sum(r.kind == "chat" and r.sent_s is not None and low <= r.sent_s < high for r in records)
        bins.append({"from_s": i * bin_s, "num_chat": len(ttfts), "ttft_p99_s": latency_stats(ttfts)["p99"],
                     "num_unanswered": sent - len(ttfts)})
    return bins


def ttft_recovered(bins: Sequence[dict[str, Any]], warmup_p99: float | None, factor: float = TTFT_BACK_FACTOR,
                   min_chat: int = TTFT_BIN_MIN_CHAT) -> float | None:
    """Seconds from a fault's start to the first bin (`ttft_bins`; its start) with >= `min_chat` chat
    requests whose p99 TTFT is within `factor` x the warm-up window's p99, and none sent in it left without a
    first token (a bin where most were lost and a few answered fast is not back). None: no such bin, or no
    warm-up p99."""
    if warmup_p99 is None:
        return None
    return next((b["from_s"] for b in bins if b["num_chat"] >= min_chat and not b.get("num_unanswered")
                 and b["ttft_p99_s"] <= factor * warmup_p99), None)


def shot_summary(shots: Sequence[Shot]) -> dict[str, Any]:
    """Counts of a fault's own requests: sent, answered, lost, statuses, slowest answer (s)."""
    answered = [s for s in shots if s.status is not None]
    return {"sent": len(shots), "answered": len(answered), "lost": len(shots) - len(answered),
            "statuses": dict(Counter(str(s.status) for s in answered)),
            "max_s": max((s.seconds for s in answered), default=None),
            "errors": dict(Counter(s.error for s in shots if s.status is None and s.error).most_common(3))}


def fault_summary(run: FaultRun, before_s: float, raw: dict[str, Any],
                  warmup_p99: float | None = None) -> dict[str, Any]:
    """One fault's row: steady accounting over its whole window, chat TTFT p99 before / during / after
    and per 5-s bin (and from when within 1.5x `warmup_p99`), recovery time, when a replica went down
    and came back, the slowest /ready answer, its own traffic and notes."""
    records, samples = raw["records"], raw["samples"]
    recovery = recovery_time(samples, [(r.sent_s, r.end_s) for r in records if r.kind == "chat" and r.outcome == "ok"],
                             run.start_s, run.injected_s, run.window_end_s)
    in_window = [s for s in samples if run.start_s <= s.t_s < run.window_end_s]
    bins = ttft_bins(records, run.start_s, run.window_end_s)
    down, back = replica_outage(samples, run.start_s, run.window_end_s)
    return {"name": run.name, "title": ALL_FAULTS[run.name][1], "start_s": run.start_s, "injected_s": run.injected_s,
            "end_s": run.end_s, "window_end_s": run.window_end_s, "recovery_s": recovery,
            "recovered": recovery is not None and recovery <= GOAL_RECOVERY_S,
            "steady": account(records, run.start_s, run.window_end_s),
            "max_send_lag_s": max((r.lag_s for r in records if run.start_s <= (r.sent_s or -1) < run.window_end_s),
                                  default=0.0),   # counted in TTFT (from the planned arrival)
            "ttft_p99_s": {"before": window_ttft_p99(records, before_s, run.start_s),
                           "during": window_ttft_p99(records, run.start_s, run.end_s),
                           "after": window_ttft_p99(records, run.end_s, run.window_end_s)},
            "ttft_n": {"before": len(_chat_ttfts(records, before_s, run.start_s)),   # the p99s' samples (a few
                       "during": len(_chat_ttfts(records, run.start_s, run.end_s)),   # dozen at 1 req/s: marked)
                       "after": len(_chat_ttfts(records, run.end_s, run.window_end_s))},
            "ttft_bins": bins, "ttft_recovered_s": ttft_recovered(bins, warmup_p99),
            "replica_down_s": down, "replica_back_s": back,
            "ready_max_s": max((s.ready_s if s.ready_s is not None else PROBE_TIMEOUT_S for s in in_window),
                               default=None),
            "not_ready_samples": sum(not s.ready for s in in_window),
            "traffic": shot_summary(run.shots) if run.shots else None, "notes": run.notes}


def build_report(raw: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The report (plain JSON data) of a run's raw measurements (`chaos_run`) and what was run (`meta`)."""
    records, runs, samples = raw["records"], raw["runs"], raw["samples"]
    load_start, first = raw["load_start_s"], runs[0].start_s if runs else raw["load_end_s"]
    warmup_p99 = window_ttft_p99(records, load_start, first)
    faults, before = [], load_start
    for run in runs:
        faults.append(fault_summary(run, before, raw, warmup_p99))
        before = run.end_s
    steady = account(records, 0.0, float("inf"))
    traffic = shot_summary([s for run in runs for s in run.shots])
    rss = [s.rss_bytes for s in samples if s.rss_bytes is not None]
    idle = [s.rss_bytes for s in samples if s.rss_bytes is not None and s.t_s < load_start]
    verdict = {"lost": steady["lost"] + traffic["lost"] == 0, "duplicated": steady["duplicated"] == 0,
               "recovery": all(f["recovered"] for f in faults),
               "fault_goals": all(f["notes"].get("goal_met", True) for f in faults)}
    counters = raw.get("counters")
    replicas = counters_summary(counters.looks) if counters is not None else None
    if replicas is not None:
        verdict["within_capacity"] = bool(replicas) and within_capacity(replicas)
    return {**meta, "model": raw["model"], "duration_s": raw["duration_s"],
            "goal": {"lost": 0, "duplicated": 0, "recovery_s": GOAL_RECOVERY_S},
            "overall": {"steady": steady, "fault_traffic": traffic,
                        "lost": steady["lost"] + traffic["lost"], "duplicated": steady["duplicated"]},
            "warmup": {"steady": account(records, load_start, first),
                       "ttft_p99_s": warmup_p99, "ttft_n": len(_chat_ttfts(records, load_start, first))},
            "faults": faults,
            "rss": {"idle_bytes": max(idle, default=None), "peak_bytes": max(rss, default=None),
                    "end_bytes": rss[-1] if rss else None},
            "replica_counters": None if replicas is None else {"replicas": replicas,
                                                               "num_failed_looks": counters.num_failed},
            "verdict": {**verdict, "met": all(verdict.values())}}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _p99(value: float | None, n: int | None) -> str:
    """A window's p99 in ms, marked `*` over fewer than MIN_P99_SAMPLES requests."""
    return _ms(value) + ("*" if value is not None and n is not None and n < MIN_P99_SAMPLES else "")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def _fault_notes(fault: dict[str, Any]) -> str:
    """One line on what a fault's own traffic and notes say."""
    t, notes = fault["traffic"], fault["notes"]
    parts = [f"{k}={v}" for k, v in notes.items()]
    if t:
        own = f"own requests {t['sent']} sent, {t['answered']} answered, {t['lost']} lost, statuses {t['statuses']}"
        parts.insert(0, own + ("" if t["max_s"] is None else f", slowest {t['max_s']:.2f} s"))
    return "; ".join(parts)


def _ttft_line(fault: dict[str, Any]) -> str:
    """One line of a fault's chat TTFT p99 per bin (ms / chat requests) and when it was back."""
    bins = ", ".join(f"{b['from_s']:g}s {_ms(b['ttft_p99_s'])}/{b['num_chat']}" for b in fault["ttft_bins"])
    back = fault["ttft_recovered_s"]
    return (f"TTFT p99 per {TTFT_BIN_S:g} s from the start (ms/chat requests): {bins}; within "
            f"{TTFT_BACK_FACTOR:g}x warm-up p99 (bins of >= {TTFT_BIN_MIN_CHAT}) "
            + ("never" if back is None else f"from {back:g} s"))


def _replica_words(fault: dict[str, Any]) -> str:
    down, back = fault["replica_down_s"], fault["replica_back_s"]
    if down is None:
        return "no replica down"
    return f"a replica down at {down:.1f} s, " + ("never all up again" if back is None else f"all up at {back:.1f} s")


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table: per window steady accounting, chat TTFT p99, recovery, TTFT back; then
    per fault its notes and TTFT bins, and totals."""
    head = (f"{'window':<22}{'sent':>6}{'answered':>9}{'lost':>6}{'cut':>5}{'dup':>5}{'errors':>7}"
            f"{'TTFT p99 ms before/during/after':>32}{'recovery':>10}{'TTFT back':>11}")
    w = report["warmup"]
    lines = [f"bench chaos: {report['config']} ({report['timers']}); {report['date']}, commit {report['commit']}",
             f"steady load: {report['load']}; ran {report['duration_s']:.0f} s",
             f"goal: 0 lost, 0 duplicated, every fault recovered within {GOAL_RECOVERY_S:g} s", "", head,
             _row("warm-up", w["steady"], _p99(w["ttft_p99_s"], w.get("ttft_n")), "")]
    for i, f in enumerate(report["faults"], 1):
        p99 = "/".join(_p99(f["ttft_p99_s"][k], f.get("ttft_n", {}).get(k)) for k in ("before", "during", "after"))
        rec = "never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s"
        back = "never" if f["ttft_recovered_s"] is None else f"{f['ttft_recovered_s']:g} s"
        lines.append(_row(f"{i} {f['title']}", f["steady"], p99, rec + ("" if f["recovered"] else " !"), back))
    o = report["overall"]
    lines += [_row("all steady", o["steady"], "", ""), "", "per fault:"]
    for i, f in enumerate(report["faults"], 1):
        lines += [f"  {i} {f['title']}: {_fault_notes(f)}; /ready slowest {f['ready_max_s']:.2f} s, "
                  f"{f['not_ready_samples']} samples not ready; {_replica_words(f)}", f"    {_ttft_line(f)}"]
    t, rss, v = o["fault_traffic"], report["rss"], report["verdict"]
    windows = [(w["ttft_p99_s"], w.get("ttft_n"))] + [(f["ttft_p99_s"][k], f.get("ttft_n", {}).get(k))
                                                      for f in report["faults"] for k in f["ttft_p99_s"]]
    if any(_p99(value, n).endswith("*") for value, n in windows):
        lines.append(f"* p99 of fewer than {MIN_P99_SAMPLES} chat requests: about their slowest, a lower bound on "
                     f"the tail (the per-bin p99s below hold a few each: their largest)")
    lines += [f"fault traffic: {t['sent']} sent, {t['answered']} answered, {t['lost']} lost",
              f"gateway RSS: idle {_mib(rss['idle_bytes'])}, peak {_mib(rss['peak_bytes'])}, "
              f"at the end {_mib(rss['end_bytes'])}",
              f"server log: {report.get('server_log_counts', {})}"]
    counters = report.get("replica_counters")
    if counters is not None:
        lines += format_counters(counters["replicas"], counters["num_failed_looks"])
    capacity = "" if "within_capacity" not in v else f", replicas within capacity ({_ok(v['within_capacity'])})"
    lines += ["", f"goal: lost {o['lost']} ({_ok(v['lost'])}), duplicated {o['duplicated']} ({_ok(v['duplicated'])}), "
              f"recovered within {GOAL_RECOVERY_S:g} s: {sum(f['recovered'] for f in report['faults'])} of "
              f"{len(report['faults'])} ({_ok(v['recovery'])}), each fault's own goal ({_ok(v['fault_goals'])})"
              f"{capacity} -> {'MET' if v['met'] else 'NOT MET'}"]
    return "\n".join(lines)


def _row(name: str, c: dict[str, int], p99: str, recovery: str, ttft_back: str = "") -> str:
    return (f"{name:<22}{c['sent']:>6}{c['answered']:>9}{c['lost']:>6}{c['cut']:>5}{c['duplicated']:>5}"
            f"{c['error']:>7}{p99:>32}{recovery:>10}{ttft_back:>11}")


def _ok(flag: bool) -> str:
    return "ok" if flag else "MISSED"


def write_timeline(report: dict[str, Any], raw: dict[str, Any], path: Path) -> None:
    """PNG: chat TTFT per request over time with the fault windows shaded and recoveries marked, and the
    gateway's RSS with the moments /ready was not 200."""
    from matplotlib.figure import Figure   # lazily: only --out pays for matplotlib

    fig = Figure(figsize=(13, 7), layout="constrained")
    ttft_ax, rss_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    chat = [r for r in raw["records"] if r.kind == "chat"]
    ok = [r for r in chat if r.ttft_s is not None]
    ttft_ax.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=8, label="chat TTFT")
    failed = [r for r in chat if r.ttft_s is None]
    top = max([r.ttft_s for r in ok] + [1.0])
    ttft_ax.scatter([r.sent_s for r in failed], [top] * len(failed), marker="x", color="red", s=18,
                    label="chat without a first token")
    for f in report["faults"]:
        for ax in (ttft_ax, rss_ax):
            ax.axvspan(f["start_s"], f["end_s"], color="orange", alpha=0.2)
            if f["recovery_s"] is not None:
                ax.axvline(f["start_s"] + f["recovery_s"], color="green", linestyle="--", linewidth=1)
        ttft_ax.text(f["start_s"], top, f["title"], fontsize=8, va="bottom")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylim(top=top * 2)          # the titles and the failed marks at `top` stay inside
    ttft_ax.set_ylabel("TTFT (s), by send time")
    ttft_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    samples = raw["samples"]
    rss_ax.plot([s.t_s for s in samples], [(s.rss_bytes or 0) / 2**20 for s in samples], label="gateway RSS (MiB)")
    down = [s.t_s for s in samples if not s.ready]
    rss_ax.scatter(down, [0] * len(down), marker="|", color="red", label="/ready not 200")
    rss_ax.set_ylabel("MiB")
    rss_ax.set_xlabel("seconds since start (shaded: fault windows; dashed: recovered)")
    rss_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.suptitle(f"bench chaos: {report['date']}, commit {report['commit']}")
    fig.savefig(path, dpi=100)


def raw_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The raw measurements as JSON data: every steady request and every sample."""
    counters = raw.get("counters")
    return {"requests": [asdict(r) for r in raw["records"]],
            "samples": [{**asdict(s), "credits_full": s.credits_full} for s in raw["samples"]],
            "fault_requests": {run.name: [asdict(s) for s in run.shots] for run in raw["runs"]},
            "replica_counter_looks": [asdict(look) for look in counters.looks] if counters is not None else []}


# --- the command ----------------------------------------------------------------------------------------

def chaos_config(source: Path, folder: Path, replicas: int | None = None, *, timers: bool = True,
                 ray_address: str | None = None) -> Path:
    """A copy of `source` in `folder`: with `timers`, the gateway's fault timers shortened (`FAULT_TIMERS`);
    with `replicas`, every device replicated that many times, each worker on one thread; with
    `ray_address` too, each replica a Ray actor on that cluster (`placement: ray`)."""
    config = yaml.safe_load(source.read_text(encoding="utf-8"))
    if timers:
        config.setdefault("gateway", {}).update(FAULT_TIMERS)
    if replicas is not None:
        for device in (config.get("devices") or {}).values():
            device["replicas"] = replicas
            if not str(device.get("device", "auto")).startswith("cuda"):
                device["cpu_threads"] = 1   # a CUDA device's ranks run on GPUs
            if ray_address is not None:
                device.update(placement="ray", ray_address=ray_address)
    path = folder / "pools.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _commit() -> str:
    """The checkout's commit, `+changes` when the working tree differs from it."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _log_summary(log: Sequence[str], max_lines: int = 400) -> tuple[dict[str, int], list[str]]:
    """Counts of the server's WARNING, ERROR and CRITICAL lines and tracebacks, and those lines with each
    traceback's body (up to the next timestamped line; `max_lines` in all)."""
    counts: Counter = Counter()
    kept: list[str] = []
    in_traceback = False
    for line in log:
        level = re.search(r" (WARNING|ERROR|CRITICAL) ", line)
        in_body = in_traceback and not re.match(r"\d{4}-\d\d-\d\d |cliffguard: |loading ", line)
        if level or line.startswith("Traceback"):
            counts[level.group(1) if level else "Traceback"] += 1
            in_traceback = line.startswith("Traceback")
        elif not in_body:
            in_traceback = False
            continue
        kept.append(line.rstrip())
    return dict(counts), kept[:max_lines]


def _served_config(args: argparse.Namespace, folder: Path, ray_address: str | None) -> Path:
    """--config as is, or a copy (`chaos_config`): fault timers shortened without --config; --replicas, or
    with a local Ray cluster (`ray_address`) one replica per node placed on it."""
    if args.config and args.replicas is None and ray_address is None:
        return Path(args.config)
    return chaos_config(Path(args.config or DEFAULT_CONFIG), folder, args.ray_nodes if ray_address else args.replicas,
                        timers=args.config is None, ray_address=ray_address)


def _config_label(args: argparse.Namespace) -> str:
    label = str(args.config or DEFAULT_CONFIG.relative_to(REPO))
    if args.ray_nodes:
        return (f"{label} with placement: ray, replicas: {args.ray_nodes} (1 thread each) on a local Ray cluster of "
                f"{args.ray_nodes} nodes ({args.ray_node_cpus} CPUs each)"
                + (f", served by {args.gateways} gateways" if args.gateways > 1 else ""))
    return label + (f" with replicas: {args.replicas} (1 thread each)" if args.replicas else "")


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench chaos`: 0 when the goal was met, 1 when not (2 for bad options, from the CLI)."""
    phases = check_args(args)
    out = out_dir(args.out) if args.out else None
    date, commit = datetime.datetime.now().astimezone().isoformat(timespec="seconds"), _commit()   # what is served
    local = LocalRayCluster(args.ray_nodes, args.ray_node_cpus) if args.ray_nodes else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="cliffguard-chaos-") as folder, local as cluster:   # stopped on any exit
        if cluster is not None:
            print(f"bench chaos: a local Ray cluster of {args.ray_nodes} nodes at {cluster.address}", file=sys.stderr)
        address = cluster.address if cluster is not None else None
        served = _served_config(args, Path(folder), address)
        timers = yaml.safe_load(served.read_text(encoding="utf-8")).get("gateway") or {}
        args.write_timeout, args.stall_seconds = timers.get("write_timeout", 30.0), timers.get("stall_seconds", 10.0)
        env = dict(os.environ, CLIFFGUARD_FAULT_POISON=POISON_MARKER) if "poison" in args.fault_names else None
        second = (lambda: LiveServer(served, env=env)) if args.gateways > 1 else contextlib.nullcontext
        with LiveServer(served, env=env) as server, second() as other:   # the second follows the first's replicas
            raw = asyncio.run(chaos_run(server, args, phases, ALL_FAULTS, cluster, other))
            log = list(server.log) + (list(other.log) if other is not None else [])
    timers = "its own fault timers" if args.config else (
        f"write_timeout {FAULT_TIMERS['write_timeout']:g} s, stall_seconds {FAULT_TIMERS['stall_seconds']:g} s, "
        f"restart back-off from {FAULT_TIMERS['restart_backoff']['initial_seconds']:g} s")
    counts, bad_lines = _log_summary(log)
    meta = {"config": _config_label(args), "timers": timers, "date": date, "commit": commit,
            "ray": {"nodes": args.ray_nodes, "node_cpus": args.ray_node_cpus, "address": address} if address else None,
            "gateways": args.gateways,
            "load": f"chat {args.rate:g} req/s ({CHAT_WORDS}-word prompts, {CHAT_TOKENS} tokens, streamed), rag-ish "
                    f"{args.rag_rate:g} req/s ({RAG_WORDS}-word prompts, {RAG_TOKENS} tokens)",
            "phases": asdict(phases), "seed": args.seed, "server_log_counts": counts}
    report = build_report(raw, meta)
    if out is not None:
        (out / "results.json").write_text(json.dumps({**report, "server_log": bad_lines, **raw_json(raw)}, indent=1)
                                          + "\n", encoding="utf-8")
        write_timeline(report, raw, out / "timeline.png")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if out is not None and not args.json:
        print(f"wrote {out / 'results.json'} and {out / 'timeline.png'}")
    return 0 if report["verdict"]["met"] else 1
