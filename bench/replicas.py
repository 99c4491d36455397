"""`cliffguard bench replicas`: what a second replica of a device buys, measured from outside.

Starts `cliffguard serve` twice on the same pool file (`--config`, default config/pools.yaml): once with
its devices at `replicas: 1`, once at `--replicas` (2), every worker pinned to `--cpu-threads` torch
threads (1: so on a 2-core machine two replicas compare fairly with one), and drives each with the
same open-loop load from `bench serve`'s generator (same seed: the same arrivals and prompts). The
default load is chat beside rag: short chat requests (more than two replicas serve), long unique rag
prompts, and `docs`, questions on a few shared long documents (`shared_prefix`), whose placement
shows prefix affinity.

Per layout: tokens/s, the prompt and output tokens of requests done while arrivals ran (a prompt
counts when its first token came inside the window, an output token when it streamed inside it:
`bench.load.report.tokens_done`, so what a drain adds after the arrivals never flatters a layout),
and the engine's computed tokens/s (`cliffguard_computed_tokens_total`, every pool and replica);
per class p50/p99 TTFT; per pool the split of token load over the replicas: each replica's share of
the tokens its engine computed for the pool over the run (`cliffguard_computed_tokens_total{pool,
replica}`: prefill not found in the prefix cache, and decodes), with its largest deviation from even,
and beside it what the answers say (each answer's `x-cliffguard-replica` header: requests and their
prompt + output tokens); prefix affinity (of the requests after each document's first, the fraction
that went to the replica that served it first).
Then the ratio of the replicated layout's tokens/s to one replica's. `--out DIR` writes
`replicas.json` and each run's `bench serve` files; `--quick` runs a short load, for a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.live import LiveServer
from bench.load.plan import LoadConfig, plan_requests
from bench.load.report import LoadReport, counter_rate, even_split_deviation, latencies, tokens_done, write_report
from bench.load.run import run_load
from pools.cli_types import check_pool_file, non_negative_float, output_folder, positive_float, positive_int, seed, slots
from pools.workload import MIN_P99_SAMPLES, LengthDist, SharedPrefix, WorkloadClass, latency_stats, p99_lower_bound

TOKENIZER = "builtin:smollm2-135m-instruct"   # makes completion prompts exactly their length (the builtin model's)
# The load's options left unset on the command line: their defaults, and --quick's (an option given wins over both).
LOAD_DEFAULTS = {"request_rate": 4.5, "docs_rate": 0.15, "rag_rate": 0.03, "duration": 90.0, "warmup": 10.0,
                 "drain_timeout": 300.0}
QUICK_LOAD = {"request_rate": 1.5, "docs_rate": 0.5, "rag_rate": 0.2, "duration": 12.0, "warmup": 2.0,
              "drain_timeout": 30.0}


def workload(args: argparse.Namespace) -> tuple[WorkloadClass, ...]:
    """Chat at `--request-rate`; questions on `--documents` shared documents of `--long-tokens` tokens at
    `--docs-rate`; unique rag prompts of about `--long-tokens` tokens at `--rag-rate`."""
    long = args.long_tokens
    return (
        WorkloadClass(name="chat", endpoint="chat", output_len=LengthDist("fixed", value=48),
                      prompt_len=LengthDist("normal", mean=96, std=32, min=16, max=256)),
        WorkloadClass(name="docs", endpoint="completion", rate=args.docs_rate, output_len=LengthDist("fixed", value=24),
                      shared_prefix=SharedPrefix(tokens=long, count=args.documents),
                      prompt_len=LengthDist("uniform", min=16, max=48)),
        WorkloadClass(name="rag", endpoint="completion", rate=args.rag_rate, output_len=LengthDist("fixed", value=32),
                      prompt_len=LengthDist("uniform", min=long, max=long + long // 10)),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="config/pools.yaml", help="pool file to serve (default config/pools.yaml); "
                   "its devices are run on the CPU unless they name CUDA")
    p.add_argument("--replicas", type=slots, default=2, help="replicas of the second layout (default 2)")
    p.add_argument("--cpu-threads", type=slots, default=1, help="torch threads of each worker (default 1)")
    p.add_argument("--request-rate", type=positive_float, default=None,
                   help="chat requests per second (default 4.5, 1.5 with --quick: more "
                   "than two one-thread replicas of config/pools.yaml serve, so both layouts run saturated and "
                   "tokens/s is what each can do)")
    p.add_argument("--docs-rate", type=positive_float, default=None,
                   help="questions on the shared documents per second (default 0.15, 0.5 with --quick)")
    p.add_argument("--rag-rate", type=positive_float, default=None,
                   help="unique long rag prompts per second (default 0.03, 0.2 with --quick)")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="seconds of arrivals (default 90, 12 with --quick)")
    p.add_argument("--warmup", type=non_negative_float, default=None, help="seconds of arrivals left out of tokens/s "
                   "(default 10, 2 with --quick: the queues fill)")
    p.add_argument("--drain-timeout", type=positive_float, default=None,
                   help="after the last arrival (default 300 s, 30 with --quick: the "
                   "long prompts, which chat's SLO holds back while chat is pressed, finish then, so their placement "
                   "is seen)")
    p.add_argument("--timeout", type=positive_float, default=400.0, help="per-request limit in s (default 400)")
    p.add_argument("--long-tokens", type=positive_int, default=4200,
                   help="tokens of a rag prompt and of a shared document "
                   "(default 4200: above config/pools.yaml's chat route, so they go to rag)")
    p.add_argument("--documents", type=positive_int, default=3,
                   help="shared documents the docs class asks about (default 3)")
    p.add_argument("--seed", type=seed, default=0, help="seed of arrivals, lengths and prompts (default 0)")
    p.add_argument("--out", type=output_folder, default=None,
                   help="write replicas.json and each run's bench serve files here")
    p.add_argument("--quick", action="store_true", help="a short load (a test); the load options given still hold")


def pool_file(source: Path, replicas: int, cpu_threads: int) -> str:
    """The pool file with every device at `replicas` replicas, its ranks at `cpu_threads` threads, on the
    CPU unless it names CUDA."""
    data = yaml.safe_load(source.read_text())
    for device in (data.get("devices") or {"default": {}}).values():
        if not str(device.get("device", "auto")).startswith("cuda"):
            device.update(device="cpu", cpu_threads=cpu_threads)   # a CUDA device's ranks run on GPUs
        device["replicas"] = replicas
    if "devices" not in data:
        data["devices"] = {"default": {"device": "cpu", "replicas": replicas, "cpu_threads": cpu_threads}}
    return yaml.safe_dump(data, sort_keys=False)


def load_config(url: str, args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(url=url, model=None, classes=workload(args), request_rate=args.request_rate,
                      duration=args.duration, seed=args.seed, timeout=args.timeout, drain_timeout=args.drain_timeout,
                      tokenizer=TOKENIZER, continuous_usage=True)


def summarize(report: LoadReport, replicas: int, warmup: float, duration: float) -> dict[str, Any]:
    """One layout's figures (module docstring)."""
    first, last = warmup, duration
    done = sum(tokens_done(r, first, last) for r in report.records)
    computed, seconds = 0.0, 0.0
    for pool in {p for s in report.scrapes for p in s.pools if p}:
        window = [s for s in report.scrapes if first <= s.t_s <= last]
        increase, span = counter_rate(window, pool, "computed_tokens_total")
        computed, seconds = computed + increase, max(seconds, span)
    split = report.totals["replicas"]
    work = computed_split(report.scrapes)
    return {
        "replicas": replicas, "completed": report.totals["completed"], "count": report.totals["count"],
        "errors": report.totals["errors"], "unfinished": report.totals["unfinished"],
        "tokens_per_s": done / (last - first), "window_s": [first, last],
        "computed_tokens_per_s": computed / seconds if seconds else None,
        "ttft": {name: latency_stats(latencies((r for r in report.records if r.class_name == name), "ttft"))
                 for name in report.summary},
        "answered": split,
        "split": work,
        "split_deviation": {pool: even_split_deviation(s, replicas) for pool, s in work.items()},
        "prefix_affinity": report.summary["docs"]["prefix_affinity"],
    }


def computed_split(scrapes) -> dict[str, dict[str, Any]]:
    """Per pool, the tokens each replica's engine computed between the first and the last scrape, and each
    replica's share of them (`even_split_deviation` reads `token_shares`)."""
    ok = [s for s in scrapes if s.error is None and s.computed]
    if len(ok) < 2:
        return {}
    out = {}
    for pool, last in ok[-1].computed.items():
        first = ok[0].computed.get(pool, {})
        tokens = {r: value - first.get(r, 0.0) for r, value in sorted(last.items())}
        total = sum(tokens.values())
        out[pool] = {"computed_tokens": tokens,
                     "token_shares": {r: t / total if total else None for r, t in tokens.items()}}
    return out


async def run_layout(source: Path, replicas: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    path = folder / f"replicas-{replicas}.yaml"
    path.write_text(pool_file(source, replicas, args.cpu_threads))
    with LiveServer(path) as server:
        config = load_config(server.url, args)
        plan = await asyncio.to_thread(plan_requests, config)
        report = await run_load(config, plan)
    if args.out:
        write_report(report, Path(args.out) / f"replicas-{replicas}")
    return summarize(report, replicas, args.warmup, args.duration)


def format_result(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"replicas {r['replicas']}: {r['completed']} of {r['count']} completed ({r['errors']} errors, "
                     f"{r['unfinished']} unfinished); {r['tokens_per_s']:.1f} tokens/s done while arrivals ran "
                     f"({r['window_s'][0]:g}-{r['window_s'][1]:g} s), "
                     f"engine computed {r['computed_tokens_per_s'] or 0:.1f} tokens/s")
        for name, ttft in r["ttft"].items():
            if ttft["p50"] is not None:
                few = "*" if p99_lower_bound(ttft) else ""
                lines.append(f"  {name}: TTFT p50 {ttft['p50']:.2f} s, p99 {ttft['p99']:.2f} s{few} "
                             f"({ttft['n']} requests)")
        for pool, split in r["split"].items():
            shares = ", ".join(f"{name} {100 * (share or 0):.1f}%" for name, share in split["token_shares"].items())
            deviation = r["split_deviation"][pool]
            answered = r["answered"].get(pool, {}).get("replicas", {})
            requests = ", ".join(f"{name} {e['requests']}" for name, e in answered.items())
            lines.append(f"  pool {pool}: tokens computed by replica {shares}"
                         + (f" (largest deviation from even {100 * (deviation or 0):.1f}%)" if r["replicas"] > 1 else "")
                         + (f"; requests answered {requests}" if requests else ""))
        affinity = r["prefix_affinity"]
        if affinity and affinity["repeats"] and r["replicas"] > 1:
            lines.append(f"  prefix affinity: {affinity['on_first_replica']} of {affinity['repeats']} repeated "
                         f"documents on the replica that served them first ({100 * affinity['fraction']:.1f}%)")
    if any(p99_lower_bound(t) for r in results for t in r["ttft"].values()):
        lines.append(f"  * p99 of fewer than {MIN_P99_SAMPLES} requests: a lower bound on the tail")
    one, many = results[0], results[-1]
    lines.append(f"tokens/s, {many['replicas']} replicas over 1: {many['tokens_per_s'] / one['tokens_per_s']:.2f}x"
                 if one["tokens_per_s"] else "tokens/s: the one-replica run did nothing")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.replicas < 2:
        raise ValueError(f"--replicas: must be >= 2 (the layout compared with one replica), got {args.replicas}")
    for name, value in (QUICK_LOAD if args.quick else LOAD_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup >= args.duration:
        raise ValueError(f"--warmup: must be below --duration {args.duration:g} (the tokens/s are counted after it), "
                         f"got {args.warmup:g}")
    check_pool_file(args.config)
    source = Path(args.config)
    with tempfile.TemporaryDirectory(prefix="cliffguard-replicas-") as tmp:
        results = [asyncio.run(run_layout(source, n, args, Path(tmp))) for n in (1, args.replicas)]
    result = {"config": str(source), "cpu_threads": args.cpu_threads, "request_rate": args.request_rate,
              "docs_rate": args.docs_rate, "rag_rate": args.rag_rate, "long_tokens": args.long_tokens,
              "duration": args.duration, "seed": args.seed, "layouts": results,
              "ratio": results[1]["tokens_per_s"] / results[0]["tokens_per_s"] if results[0]["tokens_per_s"] else None}
    print(format_result(results))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replicas.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out / 'replicas.json'}")
    return 0 if all(r["completed"] for r in results) else 1
