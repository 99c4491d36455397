"""`cliffguard bench restart`: what a device worker's restart costs, forked from the fork server against a
freshly spawned interpreter.

A dead or stalled worker is replaced by a new process (`gateway.workers.supervisor`), so the device is down
for as long as a worker takes from start to ready. For one device of `--config` (its first, or
`--device`), `--runs` times each, alternating: an `AsyncEngineClient` starts the worker, waits for
`Ready`, then shuts it down; once with the gateway's way (`forkserver`: forked from a process that
imported the worker's modules once) and once spawned (`spawn`: a new interpreter imports torch and
the engine first, as every start did before 2026-11-27). The fork server is started (and its
imports paid) before the timed runs: what a restart costs. Reported: start-to-ready seconds of each
(median, worst), the ratio spawn / forkserver, and the worker's load in phases (`LLMEngine.load_phases`:
weights, KV tensor, kernels, schedulers, warm-up, SLO measurement), the part no start method removes.

`--gateway` times a gateway's cold start instead: `cliffguard serve --config` in a new process, from its
start to the line saying it serves (the port open: imports, config, plan, tokenizers; the workers' fork
server starts meanwhile) and to `/ready` answering 200 (every local device's worker loaded), `--runs`
times; `/ready` is asked every 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(ROOT / "config" / "pools.yaml"), help="pools YAML (default "
                   "config/pools.yaml)")
    p.add_argument("--device", default=None, help="which device of the file (default: its first)")
    p.add_argument("--runs", type=int, default=3, help="restarts to time (default 3)")
    p.add_argument("--gateway", action="store_true", help="time `cliffguard serve`'s cold start (to serving, to "
                   "/ready 200) instead of a worker's restart")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def engine_config(path: str, device: str | None):
    """The EngineConfig of one device of a pools file, as `cliffguard serve` plans it (replica 0)."""
    from pools.capacity_plan import plan_capacity, replica_engine_configs
    from pools.model_configs import resolve_model_configs
    from pools.config.yaml_file import load_config

    config = load_config(path)
    configs = replica_engine_configs(config, plan_capacity(config, resolve_model_configs(config)))
    if not configs:
        raise ValueError(f"--config: {path} has no local device to restart (its pools are all upstream)")
    name = device or next(iter(configs))
    if name not in configs:
        raise ValueError(f"--device: {name!r} is not a local device of {path}; it has {', '.join(configs)}")
    return name, configs[name][0]


async def _start(config, method: str) -> dict:
    from engine.client import AsyncEngineClient

    started = time.perf_counter()
    client = AsyncEngineClient(config, start_method=method)
    info = await client.start()
    ready = time.perf_counter() - started
    await client.shutdown()
    return {"ready_s": ready, "load_s": info.load_seconds, "phases": info.load_phases}


async def _restarts(config, runs: int) -> dict[str, list[dict]]:
    await _start(config, "forkserver")     # starts the fork server: the gateway's first worker pays this
    results: dict[str, list[dict]] = {"forkserver": [], "spawn": []}
    for _ in range(runs):
        for method in results:
            results[method].append(await _start(config, method))
    return results


def _cold_starts(config_path: str, runs: int) -> dict:
    """`runs` cold starts of `cliffguard serve --config config_path`: seconds to serving and to ready."""
    from bench.live import LiveServer

    listening, ready = [], []
    for _ in range(runs):
        server = LiveServer(config_path, poll_seconds=0.02)
        server.stop()
        listening.append(server.listening - server.started)
        ready.append(server.ready - server.started)
    return {"config": config_path, "runs": runs, "serving_s": statistics.median(listening),
            "ready_s": statistics.median(ready), "max_s": max(ready), "all_s": ready}


def _report_cold_starts(args: argparse.Namespace) -> int:
    report = _cold_starts(args.config, args.runs)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"bench restart --gateway: cliffguard serve --config {args.config}, {args.runs} cold starts")
    print(f"  start to serving (port open) median {report['serving_s']:.2f} s; to /ready 200 median "
          f"{report['ready_s']:.2f} s, worst {report['max_s']:.2f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError(f"--runs: must be >= 1, got {args.runs}")
    if args.gateway:
        if args.device is not None:
            raise ValueError("--device: a gateway's cold start starts every device of --config; leave it out")
        return _report_cold_starts(args)
    name, config = engine_config(args.config, args.device)
    results = asyncio.run(_restarts(config, args.runs))
    report = {"config": args.config, "device": name, "on": config.device, "model": config.model, "runs": args.runs}
    for method, runs in results.items():
        ready = [r["ready_s"] for r in runs]
        report[method] = {"ready_s": statistics.median(ready), "max_s": max(ready), "all_s": ready,
                          "load_s": statistics.median(r["load_s"] for r in runs),
                          "load_phases_s": {k: statistics.median(r["phases"].get(k, 0.0) for r in runs)
                                            for k in runs[0]["phases"]}}
    report["spawn_over_forkserver"] = report["spawn"]["ready_s"] / report["forkserver"]["ready_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"bench restart: device {name} of {args.config} ({config.model} on {config.device}), {args.runs} runs each")
    for method in results:
        r = report[method]
        print(f"{method:>10}: start to ready median {r['ready_s']:.2f} s, worst {r['max_s']:.2f} s; the worker's "
              f"load {r['load_s']:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in r["load_phases_s"].items()) + ")")
    print(f"spawn / forkserver: {report['spawn_over_forkserver']:.2f}x")
    return 0
