"""`cliffguard bench isolation --sweep`: does chat keep its SLO over a region of loads, not one point?

A grid of chat rate x rag rate x rag prompt length (`--chat-rates`, `--rag-rates`, `--rag-lens`; rag
prompts uniform within +-20% of each length, `--rag-output-tokens` out). Per cell two runs: `split`
(chat and rag loads on the split layout: chat pool + rag pool) and `shared` (both loads on one pool).
Baselines, run once each and shared by every cell that needs them: `chat alone` per chat rate and `rag
alone` per (rag rate, rag length), both on the split layout. Chat arrivals of a chat rate have one
seed, the same in its chat-alone run and in every split and shared run at that rate; rag arrivals of
a (rag rate, rag length) pair have one seed of their own, the same in its rag-alone run and in its
cells' runs, so every ratio compares the same requests.

Server reuse: one `cliffguard serve` per layout (one split server for every chat-alone, rag-alone and
split run, then one shared server for the shared runs), not one per run: a server start costs seconds
of a 2-core CPU, and a default sweep (45 runs) must fit in about half an hour. Each server first gets
an unmeasured warm-up (two chat requests, one long rag prompt), so its first steps do not land in the
first run; before each run the bench polls `/metrics` until the server is idle (no request running,
waiting or swapped in any pool, none queued for KV credits, every credit back), so runs never overlap.
Prefix caching is off on every pool of the bench's pool files: the bench measures compute isolation,
not caching, and a cache warmed by one run would flatter the next on a reused server.

Per cell, from p99s over the run (TTFT over every chat request sent, one never answered counting as its
wait, as in `bench isolation`), with ttft_ms / itl_ms from `--ttft-ms` / `--itl-ms` (the SLO the split
layout names; with `--no-slo` the split file names no `slo`, the loader's default for a device with
several pools applies, and the same flags are the bars it is judged by):

- `chat_alone_meets_slo`: chat alone p99 TTFT <= ttft_ms and p99 ITL <= itl_ms. A cell where it is false
  is out of scope (chat overloads the device by itself; no layout can help) and is not judged;
- `split_ttft_ok`: split chat p99 TTFT <= ttft_ms and <= 1.25 x (chat alone p99 TTFT + itl_ms);
- `split_itl_ok`: split chat p99 ITL <= 1.25 x itl_ms;
- `split_no_preemption`: no preemption in the split layout's chat pool during the split run;
- `rag_share_ok`: split rag tokens/s >= 0.3 x rag alone tokens/s (the rag pool's computed tokens per
  second). Required only where the device is not saturated by chat alone: `saturated_by_chat` is chat
  alone's busy fraction >= `--saturated-busy` (default 0.9), the busy fraction being the share of its
  `/metrics` scrapes (every 0.5 s) in which the chat pool had a request running or waiting. The device
  worker steps back to back whenever a pool has work, and no step-time series is exported, so this is
  the measured fraction of time the device computed for chat;
- `cell_ok`: every required bar of an in-scope cell (None for out-of-scope cells).

`--out DIR` writes `sweep.json` (args, commit, date, the grid, every baseline and cell with its runs,
the summary) and `sweep.png` (per rag length a heat map, rows chat rate, columns rag rate, colour split
chat p99 TTFT / ttft_ms around 1.0, a tick or cross for cell_ok, out-of-scope cells hatched grey).
`--quick`: the same path on a 2 x 1 x 1 grid with 8 s of arrivals per run (about 2 minutes), for a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.isolation import add_arguments as isolation_arguments
from bench.isolation import run as isolation_run
from bench.isolation import (CHAT, MODEL, ROUTE_THRESHOLD, Scenario, load_config, pool_file, run_loads, run_times,
                             summarize)
from bench.live import REPO, LiveServer
from bench.options import int_list
from bench.serve import LengthDist, LoadConfig, LoadReport, WorkloadClass, load_tokenizer
from pools.workload import parse_rates

QUICK_GRID = ("0.5,2", "0.3", "1500")       # --chat-rates, --rag-rates, --rag-lens of --quick
DEFAULT_GRID = ("0.5,1,2", "0.1,0.2,0.4", "1500,3000")
RAG_LEN_SPREAD = 0.2                        # rag prompts: uniform within +-20% of the length asked
SPLIT_SLACK = 1.25                          # split chat p99s may exceed their reference by 25%
MIN_RAG_SHARE = 0.3                         # split rag tokens/s over rag alone's, where required
IDLE_TIMEOUT_S = 60.0
BLOCK_SIZE = 16
BARS = ("chat_alone_meets_slo", "split_ttft_ok", "split_itl_ok", "split_no_preemption", "rag_share_ok")
# /metrics gauges that say a server still has work, and what they mean.
PENDING_GAUGES = {"cliffguard_num_requests_running": "running", "cliffguard_num_requests_waiting": "waiting",
                  "cliffguard_num_requests_swapped": "swapped",
                  "cliffguard_admission_queue_depth": "queued for KV credits"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `cliffguard bench isolation`: the scenario benchmark's (bench.isolation) and the
    sweep's. This module is the command's entry point, so bench.isolation never imports it."""
    isolation_arguments(p)
    add_sweep_arguments(p)


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench isolation`: the sweep with --sweep, else the scenarios of bench.isolation."""
    if args.sweep:
        return run_sweep(args)
    return isolation_run(args)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="store_true", help="run a grid of chat rate x rag rate x rag length "
                   "(split and shared per cell, chat-alone and rag-alone baselines) on one server per layout, "
                   "and judge per cell whether chat keeps its SLO")
    p.add_argument("--chat-rates", default=None, help=f"--sweep: chat requests/s, comma-separated (default "
                   f"{DEFAULT_GRID[0]}; {QUICK_GRID[0]} with --quick)")
    p.add_argument("--rag-rates", default=None, help=f"--sweep: rag requests/s, comma-separated (default "
                   f"{DEFAULT_GRID[1]}; {QUICK_GRID[1]} with --quick)")
    p.add_argument("--rag-lens", default=None, help=f"--sweep: mean rag prompt tokens, comma-separated; prompts "
                   f"are uniform within +-20%% of each (default {DEFAULT_GRID[2]}; {QUICK_GRID[2]} with --quick)")
    p.add_argument("--rag-output-tokens", type=int, default=128, help="--sweep: output tokens of every rag "
                   "request (default 128)")
    p.add_argument("--no-slo", action="store_true", help="--sweep: the split layout's chat pool names no slo "
                   "(the default for a device with several pools applies); the verdict still uses --ttft-ms "
                   "and --itl-ms")
    p.add_argument("--no-shared", action="store_true", help="--sweep: skip the shared layout (split runs and "
                   "baselines only: a second run of a sweep's verdict, e.g. with --no-slo, in less time)")
    p.add_argument("--saturated-busy", type=float, default=0.9, help="--sweep: chat alone saturates the device "
                   "when its chat pool had work in at least this fraction of the /metrics scrapes; rag's share "
                   "is then not required (default 0.9)")


# --- the grid and its runs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Grid:
    """The sweep's loads. Seeds: chat rate i -> 1000 x seed + i; rag pair j (rag rates outer, lengths
    inner) -> 1000 x seed + 500 + j."""

    chat_rates: tuple[float, ...]
    rag_rates: tuple[float, ...]
    rag_lens: tuple[int, ...]
    rag_output_tokens: int = 128
    seed: int = 0
    shared: bool = True          # run the shared layout per cell (--no-shared: split and baselines only)

    def __post_init__(self) -> None:
        if min(self.rag_lens) * (1 - RAG_LEN_SPREAD) <= ROUTE_THRESHOLD:
            raise ValueError(f"--rag-lens: the shortest rag prompt must be above the chat route's "
                             f"{ROUTE_THRESHOLD} tokens, so every rag length must be >= "
                             f"{math.floor(ROUTE_THRESHOLD / (1 - RAG_LEN_SPREAD)) + 1}, got {min(self.rag_lens)}")
        if self.rag_output_tokens < 1:
            raise ValueError(f"--rag-output-tokens: must be >= 1, got {self.rag_output_tokens}")

    @property
    def rag_pairs(self) -> list[tuple[float, int]]:
        return [(rate, n) for rate in self.rag_rates for n in self.rag_lens]

    @property
    def cells(self) -> list[tuple[float, float, int]]:
        """(chat rate, rag rate, rag length) of every cell."""
        return [(c, r, n) for c in self.chat_rates for r, n in self.rag_pairs]

    def chat_seed(self, chat_rate: float) -> int:
        return 1000 * self.seed + self.chat_rates.index(chat_rate)

    def rag_seed(self, rag_rate: float, rag_len: int) -> int:
        return 1000 * self.seed + 500 + self.rag_pairs.index((rag_rate, rag_len))

    def rag_class(self, rag_len: int) -> WorkloadClass:
        low, high = round(rag_len * (1 - RAG_LEN_SPREAD)), round(rag_len * (1 + RAG_LEN_SPREAD))
        return WorkloadClass(name="rag", endpoint="completion", prompt_len=LengthDist("uniform", min=low, max=high),
                             output_len=LengthDist("fixed", value=self.rag_output_tokens))

    @property
    def max_model_len(self) -> int:
        """The rag (and shared) pool's context: 4096 as `bench isolation`'s, or the longest rag prompt
        plus its output when that is more (in whole blocks)."""
        longest = round(max(self.rag_lens) * (1 + RAG_LEN_SPREAD)) + self.rag_output_tokens
        return max(4096, -(-longest // BLOCK_SIZE) * BLOCK_SIZE)


def sweep_grid(args: argparse.Namespace) -> Grid:
    """The grid of the command line: the flags, else the defaults (--quick's own)."""
    chat, rag, lens = QUICK_GRID if args.quick else DEFAULT_GRID
    return Grid(tuple(parse_rates(args.chat_rates or chat, "--chat-rates")),
                tuple(parse_rates(args.rag_rates or rag, "--rag-rates")),
                tuple(int_list(args.rag_lens or lens, "--rag-lens", 1, "lengths must be >= 1")),
                args.rag_output_tokens, args.seed, shared=not args.no_shared)


@dataclass(frozen=True)
class Run:
    """One run of the sweep: which loads go to which layout's server."""

    kind: str                    # chat alone | rag alone | split | shared
    layout: str                  # split | shared
    chat_rate: float | None = None
    rag_rate: float | None = None
    rag_len: int | None = None

    def describe(self) -> str:
        loads = ([f"chat {self.chat_rate:g}/s"] if self.chat_rate else []) + (
            [f"rag {self.rag_rate:g}/s x {self.rag_len} tok"] if self.rag_rate else [])
        return f"{self.kind}: {', '.join(loads)}"


def plan_runs(grid: Grid) -> list[Run]:
    """Every run, in order: the split server's (chat alone per chat rate, rag alone per rag pair, split
    per cell), then the shared server's (shared per cell)."""
    return ([Run("chat alone", "split", chat_rate=c) for c in grid.chat_rates]
            + [Run("rag alone", "split", rag_rate=r, rag_len=n) for r, n in grid.rag_pairs]
            + [Run("split", "split", c, r, n) for c, r, n in grid.cells]
            + [Run("shared", "shared", c, r, n) for c, r, n in grid.cells if grid.shared])


def sweep_pool_files(args: argparse.Namespace, grid: Grid) -> dict[str, str]:
    """layout -> pool file: `bench isolation`'s, chat's slo as the flags say (none with --no-slo)."""
    slo = None if args.no_slo else (args.ttft_ms, args.itl_ms)
    common = {"memory": args.memory, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": grid.max_model_len}
    return {"split": pool_file("split", chat_slo=slo, names_slo=not args.no_slo, **common),
            "shared": pool_file("shared", chat_slo=None, **common)}


# --- the server between runs ----------------------------------------------------------------------------------

def pending_work(metrics_text: str) -> list[str]:
    """What a server's /metrics say it still has to do: per pool, requests running, waiting, swapped or
    queued for KV credits, and credits still held. Empty when the server is idle."""
    from prometheus_client.parser import text_string_to_metric_families

    pending: list[str] = []
    credits: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            pool = sample.labels.get("pool", "")
            if sample.name in PENDING_GAUGES and sample.value:
                pending.append(f"{pool}: {sample.value:g} {PENDING_GAUGES[sample.name]}")
            elif sample.name in ("cliffguard_kv_credits_total", "cliffguard_kv_credits_free"):
                credits.setdefault(pool, {})[sample.name.rsplit("_", 1)[1]] = sample.value
    for pool, c in sorted(credits.items()):
        held = c.get("total", 0.0) - c.get("free", 0.0)
        if held > 0:
            pending.append(f"{pool}: {held:g} KV credits held")
    return pending


async def wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S, interval: float = 0.25) -> tuple[float, list[str]]:
    """Poll `url`/metrics until `pending_work` is empty or `timeout` s passed: (seconds waited, what was
    still pending at the end: empty when idle)."""
    import aiohttp

    start = time.perf_counter()
    pending = ["no answer from /metrics"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(url + "/metrics") as response:
                    text = await response.text()
                pending = pending_work(text) if response.status == 200 else [f"/metrics: HTTP {response.status}"]
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                pending = [f"/metrics: {type(exc).__name__}: {exc}"]
            waited = time.perf_counter() - start
            if not pending or waited >= timeout:
                return waited, pending
            await asyncio.sleep(interval)


async def warm_up(url: str, grid: Grid, tokenizer) -> float:
    """Two chat requests at once, then one rag prompt of the longest length, unmeasured: a fresh
    server's first steps (allocations, first calls) must not land in the first run. Seconds taken."""
    began = time.perf_counter()
    rag = replace(grid.rag_class(max(grid.rag_lens)), output_len=LengthDist("fixed", value=2))
    for cls, n in ((CHAT, 2), (rag, 1)):
        config = LoadConfig(url=url, classes=(cls,), request_rate=math.inf, num_requests=n, seed=grid.seed,
                            timeout=120.0, drain_timeout=120.0, scrape=False, tokenizer=MODEL)
        await run_loads([config], tokenizer)
    return time.perf_counter() - began


def busy_fraction(report: LoadReport, pool: str) -> float | None:
    """Share of a run's successful scrapes in which `pool` had a request running or waiting."""
    ok = [s.pools[pool] for s in report.scrapes if s.error is None and pool in s.pools]
    if not ok:
        return None
    return sum(p.get("num_requests_running", 0) + p.get("num_requests_waiting", 0) > 0 for p in ok) / len(ok)


async def execute(run: Run, grid: Grid, url: str, args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """Run the loads of `run` against the (idle) server at `url`; the run's numbers, with chat's TTFT
    samples (ms) but no ITL samples."""
    duration, drain_timeout = run_times(args)
    times = {"duration": duration, "drain_timeout": drain_timeout}
    configs = []
    if run.chat_rate:
        configs.append(load_config(url, CHAT, run.chat_rate, seed=grid.chat_seed(run.chat_rate), scrape=True,
                                   **times))
    if run.rag_rate:
        configs.append(load_config(url, grid.rag_class(run.rag_len), run.rag_rate, scrape=not run.chat_rate,
                                   seed=grid.rag_seed(run.rag_rate, run.rag_len), **times))
    reports = await run_loads(configs, tokenizer)
    chat = reports[0] if run.chat_rate else None
    rag = reports[-1] if run.rag_rate else None
    itl_ms = None if args.no_slo or run.layout == "shared" else args.itl_ms
    result = summarize(Scenario(run.kind, run.layout, bool(chat), bool(rag), itl_ms), chat, rag)
    ttfts = result.get("ttft_samples")
    result = {k: v for k, v in result.items() if not k.endswith("_samples")}
    if ttfts:   # every chat TTFT (ms, in arrival order): a p99 of a few dozen requests is its largest few
        result["ttft_ms_samples"] = [round(1000 * t) for t in ttfts]
    result.update(kind=run.kind, chat_rate=run.chat_rate, rag_rate=run.rag_rate, rag_len=run.rag_len,
                  chat_seed=configs[0].seed if chat else None, rag_seed=configs[-1].seed if rag else None)
    if chat is not None:
        result["busy_fraction"] = busy_fraction(chat, "shared" if run.layout == "shared" else "chat")
    return result


async def run_all(args: argparse.Namespace, grid: Grid) -> tuple[list[tuple[Run, dict[str, Any]]], dict[str, Any]]:
    """Every run of `plan_runs`, one warmed-up server per layout, each run on an idle server: (the runs
    with their results, per layout the server's url, start and warm-up seconds)."""
    runs = plan_runs(grid)
    files = sweep_pool_files(args, grid)
    tokenizer = load_tokenizer(MODEL)
    results: list[tuple[Run, dict[str, Any]]] = []
    servers: dict[str, Any] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cliffguard-isolation-sweep-") as folder:
        for layout in ("split", "shared"):
            if not any(r.layout == layout for r in runs):
                continue
            path = Path(folder) / f"{layout}.yaml"
            path.write_text(files[layout])
            print(f"bench isolation --sweep: starting and warming up the {layout} server", file=sys.stderr,
                  flush=True)
            t0 = time.perf_counter()
            with LiveServer(path) as server:
                servers[layout] = {"url": server.url, "start_s": time.perf_counter() - t0,
                                   "warm_up_s": await warm_up(server.url, grid, tokenizer)}
                for run in (r for r in runs if r.layout == layout):
                    print(f"bench isolation --sweep: [{len(results) + 1}/{len(runs)}] {run.describe()} "
                          f"({time.perf_counter() - began:.0f} s so far)", file=sys.stderr, flush=True)
                    waited, pending = await wait_idle(server.url)
                    if pending:
                        print(f"bench isolation --sweep: server not idle after {waited:.0f} s ({'; '.join(pending)}"
                              "); running anyway", file=sys.stderr, flush=True)
                    t0 = time.perf_counter()
                    result = await execute(run, grid, server.url, args, tokenizer)
                    result.update(server_url=server.url, idle_wait_s=waited, idle_before=not pending,
                                  wall_s=time.perf_counter() - t0)
                    results.append((run, result))
    return results, servers


# --- the verdict ---------------------------------------------------------------------------------------------

def judge(alone: dict[str, Any], split: dict[str, Any], rag_alone: dict[str, Any], *, ttft_ms: float,
          itl_ms: float, saturated_busy: float) -> dict[str, Any]:
    """The bars of one cell (see the module docstring) from its chat-alone, split and rag-alone runs
    (`ttft_p99`, `itl_p99` in s, `busy_fraction`, `chat_preemptions`, `rag_tokens_per_s`)."""
    ttft_s, itl_s = ttft_ms / 1e3, itl_ms / 1e3

    def at_most(value: float | None, bound: float | None) -> bool:
        return value is not None and bound is not None and value <= bound

    alone_ttft, split_ttft = alone.get("ttft_p99"), split.get("ttft_p99")
    ttft_bound = None if alone_ttft is None else SPLIT_SLACK * (alone_ttft + itl_s)
    rag_split, rag_base = split.get("rag_tokens_per_s"), rag_alone.get("rag_tokens_per_s")
    rag_ratio = rag_split / rag_base if rag_split is not None and rag_base else None
    busy = alone.get("busy_fraction")
    bars = {
        "chat_alone_meets_slo": at_most(alone_ttft, ttft_s) and at_most(alone.get("itl_p99"), itl_s),
        "split_ttft_ok": at_most(split_ttft, ttft_s) and at_most(split_ttft, ttft_bound),
        "split_itl_ok": at_most(split.get("itl_p99"), SPLIT_SLACK * itl_s),
        "split_no_preemption": split.get("chat_preemptions") == 0,
        "rag_share_ok": rag_ratio is not None and rag_ratio >= MIN_RAG_SHARE,
    }
    saturated = busy is not None and busy >= saturated_busy
    required = [b for b in BARS[1:] if b != "rag_share_ok" or not saturated]
    in_scope = bars["chat_alone_meets_slo"]
    failed = [b for b in required if not bars[b]]
    return {**bars, "in_scope": in_scope, "saturated_by_chat": saturated, "rag_share_required": not saturated,
            "required_bars": required, "failed_bars": failed if in_scope else [],
            "cell_ok": (not failed) if in_scope else None,
            "split_ttft_bound_s": None if ttft_bound is None else min(ttft_s, ttft_bound),
            "split_ttft_slo_ratio": None if split_ttft is None else split_ttft / ttft_s, "rag_ratio": rag_ratio}


def verdict_text(cell: dict[str, Any]) -> str:
    if not cell["in_scope"]:
        return "out of scope (chat alone misses the SLO)"
    if cell["cell_ok"]:
        return "met"
    short = {"split_ttft_ok": "ttft", "split_itl_ok": "itl", "split_no_preemption": "preempt",
             "rag_share_ok": "rag share"}
    return "NOT met: " + ", ".join(short[b] for b in cell["failed_bars"])


def assemble(grid: Grid, runs: list[tuple[Run, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Baselines, cells with their bars, and the summary, from the runs."""
    by = {run: result for run, result in runs}
    cells = []
    for c, r, n in grid.cells:
        alone = by[Run("chat alone", "split", chat_rate=c)]
        rag_alone = by[Run("rag alone", "split", rag_rate=r, rag_len=n)]
        split, shared = by[Run("split", "split", c, r, n)], by.get(Run("shared", "shared", c, r, n), {})
        cell: dict[str, Any] = {
            "chat_rate": c, "rag_rate": r, "rag_len": n,
            "chat_seed": grid.chat_seed(c), "rag_seed": grid.rag_seed(r, n),
            "ttft_p99_alone": alone.get("ttft_p99"), "ttft_p99_split": split.get("ttft_p99"),
            "ttft_p99_shared": shared.get("ttft_p99"), "itl_p99_alone": alone.get("itl_p99"),
            "itl_p99_split": split.get("itl_p99"), "itl_p99_shared": shared.get("itl_p99"),
            "split_chat_preemptions": split.get("chat_preemptions"),
            "shared_chat_preemptions": shared.get("chat_preemptions"),
            "rag_tokens_per_s_split": split.get("rag_tokens_per_s"),
            "rag_tokens_per_s_alone": rag_alone.get("rag_tokens_per_s"),
            "chat_alone_busy_fraction": alone.get("busy_fraction"),
            **judge(alone, split, rag_alone, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                    saturated_busy=args.saturated_busy),
            "runs": {"split": split, "shared": shared},
        }
        cell["verdict"] = verdict_text(cell)
        cells.append(cell)
    in_scope = [cell for cell in cells if cell["in_scope"]]
    return {
        "grid": {"chat_rates": list(grid.chat_rates), "rag_rates": list(grid.rag_rates),
                 "rag_lens": list(grid.rag_lens), "rag_output_tokens": grid.rag_output_tokens,
                 "rag_len_spread": RAG_LEN_SPREAD, "max_model_len": grid.max_model_len},
        "baselines": {"chat_alone": [result for run, result in runs if run.kind == "chat alone"],
                      "rag_alone": [result for run, result in runs if run.kind == "rag alone"]},
        "cells": cells,
        "summary": {"cells": len(cells), "in_scope": len(in_scope), "met": sum(c["cell_ok"] for c in in_scope),
                    "runs": len(runs), "servers": len({result["server_url"] for _, result in runs}),
                    "runs_s": sum(result["wall_s"] + result["idle_wait_s"] for _, result in runs)},
    }


def summary_line(data: dict[str, Any]) -> str:
    s = data["summary"]
    return (f"cells in scope: {s['in_scope']} of {s['cells']} (the rest: chat alone misses the SLO); "
            f"met: {s['met']} of {s['in_scope']}")


def format_sweep_table(data: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:.0f}"

    def x(v):
        return "-" if v is None else f"{v:.2f}"

    head = (f"{'chat/s':>6} {'rag/s':>5} {'rag len':>7}  {'TTFT p99 ms alone':>17} {'split':>6} {'shared':>7}  "
            f"{'ITL p99 ms alone':>16} {'split':>6} {'shared':>7}  {'split/SLO':>9} {'preempt':>7} "
            f"{'rag ratio':>9}  verdict")
    lines = [head]
    for c in data["cells"]:
        lines.append(f"{c['chat_rate']:>6g} {c['rag_rate']:>5g} {c['rag_len']:>7}  {ms(c['ttft_p99_alone']):>17} "
                     f"{ms(c['ttft_p99_split']):>6} {ms(c['ttft_p99_shared']):>7}  {ms(c['itl_p99_alone']):>16} "
                     f"{ms(c['itl_p99_split']):>6} {ms(c['itl_p99_shared']):>7}  {x(c['split_ttft_slo_ratio']):>9} "
                     f"{str(c['split_chat_preemptions']):>7} {x(c['rag_ratio']):>9}  {c['verdict']}")
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------------------------

def write_heatmap(data: dict[str, Any], path: Path, ttft_ms: float) -> None:
    """Per rag length a heat map (rows chat rate, columns rag rate) of split chat p99 TTFT / ttft_ms."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    grid = data["grid"]
    chat_rates, rag_rates, rag_lens = grid["chat_rates"], grid["rag_rates"], grid["rag_lens"]
    ratios = [c["split_ttft_slo_ratio"] for c in data["cells"] if c["split_ttft_slo_ratio"] is not None]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max([2.0] + ratios))
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="lightgrey")
    width = len(rag_lens) * (1.4 + 1.3 * len(rag_rates)) + 1.6
    fig = Figure(figsize=(max(7.0, width), max(4.0, 2.0 + len(chat_rates) * 9 / 10)), layout="constrained")
    axes = fig.subplots(1, len(rag_lens), squeeze=False)[0]
    image = None
    for ax, rag_len in zip(axes, rag_lens):
        values = np.full((len(chat_rates), len(rag_rates)), np.nan)
        for c in (c for c in data["cells"] if c["rag_len"] == rag_len):
            i, j = chat_rates.index(c["chat_rate"]), rag_rates.index(c["rag_rate"])
            ratio = c["split_ttft_slo_ratio"]
            if c["in_scope"] and ratio is not None:
                values[i, j] = ratio
            text = "-" if ratio is None else f"{ratio:.2f}"
            if c["in_scope"]:
                text += " \u2713" if c["cell_ok"] else " \u2717"
            else:
                text += "\nout of scope"
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey",
                                       linewidth=0))
            ax.text(j, i, text, ha="center", va="center", fontsize=9)
        image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(rag_rates)), [f"{r:g}" for r in rag_rates])
        ax.set_yticks(range(len(chat_rates)), [f"{r:g}" for r in chat_rates])
        ax.set_xlabel("rag requests/s")
        ax.set_ylabel("chat requests/s")
        ax.set_title(f"rag prompts ~{rag_len} tokens")
    fig.colorbar(image, ax=list(axes), label=f"split chat p99 TTFT / ttft_ms ({ttft_ms:g} ms); 1 = SLO")
    s = data["summary"]
    fig.suptitle(f"bench isolation --sweep: {s['met']} of {s['in_scope']} cells in scope met "
                 f"({s['cells']} cells)\n\u2713 cell_ok, \u2717 a bar missed; hatched grey: out of scope "
                 "(chat alone misses the SLO)", fontsize=9)
    fig.savefig(path, dpi=110)


# --- the command -----------------------------------------------------------------------------------------------

def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_sweep(args: argparse.Namespace) -> int:
    """`cliffguard bench isolation --sweep`: run the grid, print the table, write sweep.json / sweep.png."""
    if not 0 < args.saturated_busy <= 1:
        raise ValueError(f"--saturated-busy: must be in (0, 1], got {args.saturated_busy}")
    grid = sweep_grid(args)
    duration, drain_timeout = run_times(args)
    began = time.perf_counter()
    runs, servers = asyncio.run(run_all(args, grid))
    data = assemble(grid, runs, args)
    data["servers"] = servers
    data["summary"]["elapsed_s"] = time.perf_counter() - began
    data = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
            "duration_s": duration, "drain_timeout_s": drain_timeout, "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms, "slo_in_pool_file": not args.no_slo, "commit": _commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **data}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(data, indent=1) + "\n")
        write_heatmap(data, out / "sweep.png", args.ttft_ms)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(format_sweep_table(data))
        print(summary_line(data))
    return 0
