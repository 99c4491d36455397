"""`cliffguard bench isolation`: its scenarios at one load (chat alone, rag alone, split, shared:
`bench.isolation.scenarios`), or with `--sweep`: does chat keep its SLO over a region of loads, not one point?

A grid of chat rate x rag rate x rag prompt length (`--chat-rates`, `--rag-rates`, `--rag-lens`; rag
prompts uniform within +-20% of each length, `--rag-output-tokens` out). Per cell two runs: `split`
(chat and rag loads on the split layout: chat pool + rag pool) and `shared` (both loads on one pool).
Baselines, run once each and shared by every cell that needs them: `chat alone` per chat rate and `rag
alone` per (rag rate, rag length), both on the split layout. Chat arrivals of a chat rate have one
seed, the same in its chat-alone run and in every split and shared run at that rate; rag arrivals of
a (rag rate, rag length) pair have one seed of their own, the same in its rag-alone run and in its
cells' runs, so every ratio compares the same arrival process. A run with chat lasts long enough for
`MIN_CHAT_REQUESTS` chat requests (`chat_duration`), and a rag-alone run as long as the longest run of the
whole grid (a 30-s baseline, three rag requests at 0.1/s, was compared with cells sending rag for 260 s).

Server reuse: one `cliffguard serve` per layout (one split server for every chat-alone, rag-alone and
split run, then one shared server for the shared runs), not one per run: a server start costs seconds
of a 2-core CPU, and a default sweep has 45 runs (about two hours on one: each chat run lasts long
enough for 100 chat requests, 260 s at 0.5/s, and each rag-alone run as long). Each server first gets
an unmeasured warm-up (two chat requests, one long rag prompt), so its first steps do not land in the
first run; before each run the bench polls `/metrics` until the server is idle (no request running,
waiting or swapped in any pool, none queued for KV credits, every credit back), so runs never overlap.
Prefix caching is off on every pool of the bench's pool files: the bench measures compute isolation,
not caching, and a cache warmed by one run would flatter the next on a reused server.

Per cell, the verdict of `bench.isolation.scenarios.judge` (the one definition, the same for a point of `bench
isolation`), against the SLO the split server's chat pool runs with: `--ttft-ms` / `--itl-ms` as its pool
file names them, or with `--no-slo` the one isolation by default derived from the device's measured step
at start (read from `cliffguard_pool_slo_seconds`):

- in scope by load: chat alone used at most 1 - min_share of the device's time (`--min-share`, the rag
  pool's, default 0.2), measured as the chat pool's part of the engine's step time
  (`cliffguard_pool_device_seconds_total`) over the run's arrivals: rag's guaranteed share fits beside it;
- `send_lag_ok`: the chat-alone, split and rag-alone runs each sent every request at most a tenth of
  ttft_ms after its drawn arrival (a client starved of the CPU measures itself as much as the server:
  `bench.isolation.scenarios.send_lag_bound`); else the cell is `invalid`, not judged;
- `split_ttft_ok`: split chat p99 TTFT <= min(ttft_ms, 1.25 x (chat alone p99 TTFT + itl_ms));
- `split_itl_ok`: split chat p99 ITL <= itl_ms, over every gap of every chat request sent (finished or
  not, one per token);
- `split_no_preemption`: no preemption in the split layout's chat pool during the split run;
- `rag_share_ok`: rag's part of the device's time during the split run's arrivals >= min(min_share, rag
  alone's part during its own run);
- `enough_samples`: every chat run sent at least 100 requests (each chat load runs at least 100 / rate
  seconds of arrivals; not with --quick, whose cells are judged as too few);
- `overloaded`: `cliffguard_device_overloaded` read 1 during the split run: marked in the table and the
  heat map, still judged;
- `cell_ok`: every bar of an in-scope cell (None for out-of-scope and invalid cells).

Between runs the bench waits until the server is idle and no longer says it is overloaded (the gauge
clears after 10 s of calm once the arrivals have left its 20 s window), so one run's overload is not
read in the next.

`--out DIR` writes `sweep.json` (args, commit, date, the grid, every baseline and cell with its runs,
the summary) and `sweep.png` (per rag length a heat map, rows chat rate, columns rag rate, colour split
chat p99 TTFT / ttft_ms around 1.0, a tick or cross for cell_ok, out-of-scope cells hatched grey, invalid
ones marked and left uncoloured).
`--cells "C,R,N;..."`: only those cells of the grid (with the baselines they need), each with the arrivals
it has in the whole grid, so a cell that missed in a sweep can be run again by itself (with
`CLIFFGUARD_STEP_TRACE` set, its steps traced).
`--quick`: the same path on a 2 x 1 x 1 grid with 8 s of arrivals per run (about 2 minutes), for a test.
The grid, the verdict, the table and the heat map are `bench.isolation.grid`; this module runs the
servers and the loads.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.isolation.scenarios import (CHAT, Scenario, add_arguments as isolation_arguments, chat_duration, load_config,
                             run as isolation_run, run_loads, run_times, server_slo, summarize)
from bench.isolation.grid import (DEFAULT_GRID, QUICK_GRID, Grid, Run, assemble, format_sweep_table, plan_runs,
                                  summary_line, sweep_grid, sweep_pool_files, write_heatmap)
from bench.live import REPO, LiveServer
from bench.load.scrape import pool_samples
from bench.load.plan import LoadConfig, load_tokenizer
from engine.config import DEFAULT_MIN_SHARE
from pools.workload import LengthDist, WorkloadClass

IDLE_TIMEOUT_S = 60.0
# /metrics gauges that say a server still has work, and what they mean.
PENDING_GAUGES = {"cliffguard_num_requests_running": "running", "cliffguard_num_requests_waiting": "waiting",
                  "cliffguard_num_requests_swapped": "swapped",
                  "cliffguard_admission_queue_depth": "queued for KV credits"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `cliffguard bench isolation`: the scenario benchmark's (bench.isolation.scenarios) and the
    sweep's. This module is the command's entry point, so bench.isolation.scenarios never imports it."""
    isolation_arguments(p)
    add_sweep_arguments(p)


# Flags of one mode, refused in the other rather than ignored: `--sweep --chat-rate 2` ran the grid's default
# chat rates and said nothing.
SCENARIO_FLAGS = {"chat_rate": "its grid's chat rates: --chat-rates", "rag_rate": "its grid's rag rates: --rag-rates",
                  "itl_ms_sweep": "its one ITL bar: --itl-ms"}
SWEEP_FLAGS = ("chat_rates", "rag_rates", "rag_lens", "cells", "no_slo", "no_shared")


def check_mode_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first flag given that the mode (`--sweep` or the scenarios) does not use."""
    if args.sweep:
        for dest, instead in SCENARIO_FLAGS.items():
            if getattr(args, dest) is not None:
                raise ValueError(f"--{dest.replace('_', '-')}: not used by --sweep ({instead})")
        return
    for dest in SWEEP_FLAGS:
        if getattr(args, dest) not in (None, False):
            raise ValueError(f"--{dest.replace('_', '-')}: only with --sweep")


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench isolation`: the sweep with --sweep, else the scenarios of bench.isolation.scenarios."""
    check_mode_flags(args)
    if args.sweep:
        return run_sweep(args)
    return isolation_run(args)


def chat_class(args: argparse.Namespace) -> WorkloadClass:
    """The chat load: `bench isolation`'s (chat completions of ~60-token conversations), or with
    `--chat-endpoint completion` streamed `/v1/completions` of `--chat-prompt-tokens` (±25%) tokens."""
    if args.chat_endpoint == "chat":
        return CHAT
    mean = args.chat_prompt_tokens
    return CHAT.replace(endpoint="completion", prompt_len=LengthDist("normal", mean=mean, std=mean / 4,
                                                                   min=max(1, mean // 2), max=2 * mean))


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
    p.add_argument("--cells", default=None, help="--sweep: run only these cells of the grid, each with the "
                   "arrivals it has in the whole grid (to run a cell of a sweep again), as CHAT_RATE,RAG_RATE,RAG_LEN "
                   "separated by ';'")
    p.add_argument("--chat-endpoint", choices=("chat", "completion"), default="chat", help="--sweep: chat load "
                   "as chat completions of ~60-token conversations (default) or as /v1/completions prompts")
    p.add_argument("--chat-prompt-tokens", type=int, default=40, help="--sweep, with --chat-endpoint completion: "
                   "mean chat prompt tokens (default 40, about 30 words)")
    p.add_argument("--rag-output-tokens", type=int, default=128, help="--sweep: output tokens of every rag "
                   "request (default 128)")
    p.add_argument("--no-slo", action="store_true", help="--sweep: the split layout's chat pool names no slo "
                   "(isolation by default applies, its SLO derived from the device's step); the verdict uses the "
                   "SLO the server reports")
    p.add_argument("--no-shared", action="store_true", help="--sweep: skip the shared layout (split runs and "
                   "baselines only: a second run of a sweep's verdict, e.g. with --no-slo, in less time)")
    p.add_argument("--chat-kv-share", type=float, default=0.4, help="--sweep: the split layout's chat pool's "
                   "kv_share (rag gets the rest; default 0.4)")
    p.add_argument("--min-share", type=float, default=DEFAULT_MIN_SHARE, help="--sweep: the rag pool's min_share "
                   "(its pool file's: the default); a cell is in scope where chat alone uses at most 1 - this of "
                   f"the device, and rag is owed this share of it (default {DEFAULT_MIN_SHARE:g})")


# --- the server between runs ----------------------------------------------------------------------------------

def pending_work(metrics_text: str) -> list[str]:
    """What a server's /metrics say it still has to do: per pool, requests running, waiting, swapped or
    queued for KV credits, and credits still held. Empty when the server is idle."""
    pending: list[str] = []
    pools = pool_samples(metrics_text)
    if pools.get("", {}).get("cliffguard_device_overloaded"):
        pending.append("the device still says it is overloaded")
    for pool, samples in pools.items():
        pending += [f"{pool}: {samples[name]:g} {what}" for name, what in PENDING_GAUGES.items() if samples.get(name)]
    for pool, samples in sorted(pools.items()):
        held = samples.get("cliffguard_kv_credits", 0.0) - samples.get("cliffguard_kv_credits_free", 0.0)
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


async def warm_up(url: str, grid: Grid, tokenizer, args: argparse.Namespace) -> float:
    """Two chat requests at once, then one rag prompt of the longest length, unmeasured: a fresh
    server's first steps (allocations, first calls) must not land in the first run. Seconds taken."""
    began = time.perf_counter()
    rag = grid.rag_class(max(grid.rag_lens)).replace(output_len=LengthDist("fixed", value=2))
    for cls, n in ((chat_class(args), 2), (rag, 1)):
        config = LoadConfig(url=url, classes=(cls,), request_rate=math.inf, num_requests=n, seed=grid.seed,
                            timeout=120.0, drain_timeout=120.0, scrape=False, tokenizer=args.model)
        await run_loads([config], tokenizer)
    return time.perf_counter() - began


async def execute(run: Run, grid: Grid, url: str, args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """Run the loads of `run` against the (idle) server at `url`; the run's numbers, with chat's TTFT
    samples (ms) but no ITL samples."""
    duration, drain_timeout = run_times(args)
    if run.chat_rate:
        duration = chat_duration(duration, run.chat_rate, args)
    else:   # rag alone: as long as the longest run it is a baseline of in the whole grid (every chat rate meets
        duration = chat_duration(duration, min(grid.chat_rates), args)   # every rag pair; `--cells` alike)
    times = {"duration": duration, "drain_timeout": drain_timeout}
    configs = []
    if run.chat_rate:
        configs.append(load_config(url, chat_class(args), run.chat_rate, seed=grid.chat_seed(run.chat_rate),
                                   scrape=True, model=args.model, **times))
    if run.rag_rate:
        configs.append(load_config(url, grid.rag_class(run.rag_len), run.rag_rate, scrape=not run.chat_rate,
                                   seed=grid.rag_seed(run.rag_rate, run.rag_len), model=args.model, **times))
    reports = await run_loads(configs, tokenizer)
    chat = reports[0] if run.chat_rate else None
    rag = reports[-1] if run.rag_rate else None
    itl_ms = None if args.no_slo or run.layout == "shared" else args.itl_ms
    result = summarize(Scenario(run.kind, run.layout, bool(chat), bool(rag), itl_ms), chat, rag, arrivals_s=duration)
    ttfts = result.get("ttft_samples")
    result = {k: v for k, v in result.items() if not k.endswith("_samples")}
    if ttfts:   # every chat TTFT (ms, in arrival order): a p99 of a few dozen requests is its largest few
        result["ttft_ms_samples"] = [round(1000 * t) for t in ttfts]
    result.update(kind=run.kind, chat_rate=run.chat_rate, rag_rate=run.rag_rate, rag_len=run.rag_len,
                  chat_seed=configs[0].seed if chat else None, rag_seed=configs[-1].seed if rag else None,
                  duration_s=duration)
    return result


async def run_all(args: argparse.Namespace, grid: Grid) -> tuple[list[tuple[Run, dict[str, Any]]], dict[str, Any]]:
    """Every run of `plan_runs`, one warmed-up server per layout, each run on an idle server: (the runs
    with their results, per layout the server's url, start and warm-up seconds)."""
    runs = plan_runs(grid)
    files = sweep_pool_files(args, grid)
    tokenizer = load_tokenizer(args.model)
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
                                   "warm_up_s": await warm_up(server.url, grid, tokenizer, args),
                                   "chat_slo_ms": await server_slo(server.url) if layout == "split" else None}
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
    if not 0 <= args.min_share < 1:
        raise ValueError(f"--min-share: must be in [0, 1), got {args.min_share}")
    grid = sweep_grid(args)
    duration, drain_timeout = run_times(args)
    began = time.perf_counter()
    runs, servers = asyncio.run(run_all(args, grid))
    slo = servers.get("split", {}).get("chat_slo_ms")
    data = assemble(grid, runs, args, tuple(slo) if slo else None)
    data["servers"] = servers
    data["summary"]["elapsed_s"] = time.perf_counter() - began
    data = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
            "duration_s": duration, "drain_timeout_s": drain_timeout, "ttft_ms": data["slo_ms"][0],
            "itl_ms": data["slo_ms"][1], "slo_in_pool_file": not args.no_slo, "commit": _commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **data}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(data, indent=1) + "\n")
        write_heatmap(data, out / "sweep.png", data["slo_ms"][0])
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(format_sweep_table(data))
        print(summary_line(data))
    return 0
