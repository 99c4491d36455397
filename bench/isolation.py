"""`cliffguard bench isolation`: does chat stay fast while a rag flood runs on the same device?

Starts `cliffguard serve` once per scenario, always with the same device memory (small enough that KV
is scarce) and the same model, and drives it from outside over HTTP with `bench serve`'s open-loop
load generator: chat at a steady rate (short prompts, streamed) and a rag flood (long completion
prompts arriving faster than the rag pool can hold and serve them). Arrival times are the same in
every scenario (same seeds). Scenarios:

- `chat alone`: the split layout, chat load only (the baseline every ratio divides by);
- `rag alone`: the split layout, rag load only (rag's baseline tokens/s);
- `split`: chat pool with `slo: {ttft_ms, itl_ms}` (interactive) + rag pool (throughput), both loads;
- `shared`: one pool for everything (what a single server does), both loads;
- the trade-off curve (not with `--quick`): `split` at each of `--itl-ms-sweep`, and `chunk-only`,
  the split layout without an SLO (each pool fills its own `max_num_batched_tokens`: plain chunked
  prefill, the behaviour before the step composer).

Per scenario: chat TTFT and ITL p50/p99 (TTFT over every chat request sent: one that never got its
first token counts as the time it waited until the run ended, a lower bound, so a pool that leaves
chat unanswered shows it as its tail instead of dropping it), chat's ratio to chat alone,
preemptions in chat's pool, rag tokens/s (the rag pool's `cliffguard_computed_tokens_total` per
second between the first and the last scrape: prefill and decode tokens the engine computed for
rag; in the shared pool, less the tokens of chat requests) and its ratio to rag alone. `--out DIR`
writes `isolation.json` and `isolation.png` (chat TTFT/ITL CDFs per scenario, and chat p99 vs rag
tokens/s). `--quick` runs the four main scenarios with short loads (under 3 minutes on a 2-core
CPU), for a test.

Every pool file turns prefix caching off: the bench measures compute isolation, not caching (the
prompts are random words, so a cache would find nothing anyway). The chunk-only row's chat pool says
`slo: null`, so no default SLO makes it interactive.

`--sweep` (bench.isolation_sweep) runs these scenarios over a grid of chat rate x rag rate x rag
prompt length instead of at one point, on one server per layout, and judges per cell whether chat
keeps its SLO; see that module for the runs, the bars and the files it writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.live import LiveServer
from bench.load.plan import LoadConfig, load_tokenizer, plan_requests
from bench.load.report import LoadReport, counter_rate, latencies, tokens_done
from bench.load.run import run_load
from pools.workload import LengthDist, WorkloadClass, latency_stats

MODEL = "builtin:smollm2-135m-instruct"
CHAT = WorkloadClass(name="chat", endpoint="chat", prompt_len=LengthDist("normal", mean=60, std=15, min=20, max=120),
                     output_len=LengthDist("fixed", value=32))
RAG = WorkloadClass(name="rag", endpoint="completion", prompt_len=LengthDist("uniform", min=1200, max=1800),
                    output_len=LengthDist("fixed", value=128))
ROUTE_THRESHOLD = 512        # prompt tokens: chat below, rag above


@dataclass(frozen=True)
class Scenario:
    name: str
    layout: str                  # split | shared
    chat: bool                   # chat load on
    rag: bool                    # rag load on
    itl_ms: float | None = None  # chat's SLO itl target (split layout); None: chunk-only


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", default="1GiB", help="device memory every scenario plans with (default 1GiB: "
                   "weights + a scarce KV cache)")
    p.add_argument("--chat-rate", type=float, default=0.5, help="chat requests/s (default 0.5)")
    p.add_argument("--rag-rate", type=float, default=0.3, help="rag requests/s (default 0.3: above what the rag "
                   "pool holds and serves, a flood)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per scenario (default 60; "
                   "20 with --quick; with --sweep 30 per run, 8 with --quick)")
    p.add_argument("--drain-timeout", type=float, default=None, help="seconds to finish in-flight requests after "
                   "arrivals end; the rest are cancelled and counted unfinished (default 20; 10 with --quick; "
                   "with --sweep 15, 4 with --quick)")
    p.add_argument("--ttft-ms", type=float, default=1000.0, help="chat's slo.ttft_ms, and the TTFT bar of the "
                   "sweep's verdict (default 1000)")
    p.add_argument("--itl-ms", type=float, default=100.0, help="chat's slo.itl_ms in the split scenario, and the "
                   "ITL bar of the sweep's verdict (default 100, the default config's)")
    p.add_argument("--itl-ms-sweep", default="100,200,400", help="itl_ms values of the trade-off curve "
                   "(comma-separated; the chunk-only row is added; not used by --sweep)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every pool's token budget per step")
    p.add_argument("--quick", action="store_true", help="the four main scenarios with short loads (< 3 min), "
                   "no trade-off curve; with --sweep: a 2 x 1 x 1 grid with short loads (about 2 min)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--out", default=None, help="write isolation.json and isolation.png here (with --sweep: "
                   "sweep.json and sweep.png)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run_times(args: argparse.Namespace) -> tuple[float, float]:
    """(seconds of arrivals, drain timeout) of every run: the flags, else the mode's defaults."""
    duration = {(False, False): 60.0, (False, True): 20.0, (True, False): 30.0, (True, True): 8.0}
    drain = {(False, False): 20.0, (False, True): 10.0, (True, False): 15.0, (True, True): 4.0}
    mode = (bool(getattr(args, "sweep", False)), bool(args.quick))
    return (duration[mode] if args.duration is None else args.duration,
            drain[mode] if args.drain_timeout is None else args.drain_timeout)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    main = [Scenario("chat alone", "split", True, False, args.itl_ms),
            Scenario("rag alone", "split", False, True, args.itl_ms),
            Scenario("split", "split", True, True, args.itl_ms),
            Scenario("shared", "shared", True, True)]
    if args.quick:
        return main
    sweep = [float(v) for v in args.itl_ms_sweep.split(",") if v.strip()]
    curve = [Scenario(f"split itl {v:g} ms", "split", True, True, v) for v in sweep if v != args.itl_ms]
    return main + curve + [Scenario("chunk-only", "split", True, True, None)]


def pools_yaml(scenario: Scenario, args: argparse.Namespace) -> str:
    """The pool file of one scenario (see `pool_file`)."""
    slo = (args.ttft_ms, scenario.itl_ms) if scenario.layout == "split" and scenario.itl_ms else None
    return pool_file(scenario.layout, memory=args.memory, max_num_batched_tokens=args.max_num_batched_tokens,
                     chat_slo=slo)


def pool_file(layout: str, *, memory: str, max_num_batched_tokens: int, chat_slo: tuple[float, float] | None,
              names_slo: bool = True, max_model_len: int = 4096) -> str:
    """The pool file of a layout: same device and model; split = chat (prompts up to ROUTE_THRESHOLD
    tokens) + rag (longer prompts, `max_model_len`), shared = one pool (`max_model_len`). Chat's
    `slo: {ttft_ms, itl_ms}` is `chat_slo`; None writes `slo: null` (a throughput pool: plain chunked
    prefill), or, with `names_slo` False, no `slo` key at all (what the loader does for a device
    without one applies). Prefix caching is off on every pool: the bench measures compute isolation,
    and runs that reuse one server must not warm each other."""
    common = (f"model: {MODEL}\n    device: dev\n    block_size: 16\n"
              f"    max_num_batched_tokens: {max_num_batched_tokens}\n    enable_prefix_caching: false\n")
    head = f"devices:\n  dev: {{device: cpu, memory: {memory}, dtype: float32}}\npools:\n"
    if layout == "shared":
        return head + (f"  - name: shared\n    {common}    kv_share: 1.0\n    avg_len: 512\n"
                       f"    max_model_len: {max_model_len}\n")
    slo = (f"    slo: {{ttft_ms: {chat_slo[0]:g}, itl_ms: {chat_slo[1]:g}}}\n" if chat_slo
           else "    slo: null\n" if names_slo else "")
    return (head
            + f"  - name: chat\n    {common}    route: {{max_prompt_tokens: {ROUTE_THRESHOLD}}}\n"
              f"    kv_share: 0.4\n    avg_len: 128\n    max_model_len: 2048\n{slo}"
            + f"  - name: rag\n    {common}    route: {{min_prompt_tokens: {ROUTE_THRESHOLD + 1}}}\n"
              f"    kv_share: 0.6\n    avg_len: 1700\n    max_model_len: {max_model_len}\n")


def load_config(url: str, cls: WorkloadClass, rate: float, *, seed: int, scrape: bool, duration: float,
                drain_timeout: float) -> LoadConfig:
    """One open-loop load of the bench: `cls` at `rate` req/s for `duration` s of arrivals, with the usage so
    far in every chunk (ITL per token: see `LoadConfig.continuous_usage`)."""
    return LoadConfig(url=url, classes=(cls,), request_rate=rate, duration=duration, seed=seed, timeout=600.0,
                      drain_timeout=drain_timeout, scrape=scrape, scrape_interval=0.5, tokenizer=MODEL,
                      continuous_usage=True)


async def run_loads(configs: list[LoadConfig], tokenizer) -> list[LoadReport]:
    """Run loads against one server at once; every prompt is made before any load starts."""
    plans = [plan_requests(c, tokenizer) for c in configs]
    return list(await asyncio.gather(*(run_load(c, plan) for c, plan in zip(configs, plans))))


async def run_scenario(scenario: Scenario, args: argparse.Namespace, folder: Path, tokenizer) -> dict[str, Any]:
    """Start the server of `scenario`, run its loads at once, stop it; the scenario's numbers."""
    path = folder / f"{scenario.name.replace(' ', '-')}.yaml"
    path.write_text(pools_yaml(scenario, args))
    duration, drain_timeout = run_times(args)
    times = {"duration": duration, "drain_timeout": drain_timeout}
    with LiveServer(path) as server:
        configs = []
        if scenario.chat:
            configs.append(load_config(server.url, CHAT, args.chat_rate, seed=args.seed, scrape=True, **times))
        if scenario.rag:
            configs.append(load_config(server.url, RAG, args.rag_rate, seed=args.seed + 1, scrape=not scenario.chat,
                                       **times))
        reports = await run_loads(configs, tokenizer)
    chat = reports[0] if scenario.chat else None
    rag = reports[-1] if scenario.rag else None
    return summarize(scenario, chat, rag)


def summarize(scenario: Scenario, chat: LoadReport | None, rag: LoadReport | None) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": scenario.name, "layout": scenario.layout, "itl_ms": scenario.itl_ms}
    scraped = (chat or rag).totals["scrape"]["pools"]
    chat_pool = "shared" if scenario.layout == "shared" else "chat"
    result["chat_preemptions"] = scraped.get(chat_pool, {}).get("num_preemptions")
    result["max_scrape_s"] = (chat or rag).totals["scrape"]["max_s"]
    if chat is not None:
        s = chat.summary["chat"]
        ttfts = chat_ttfts(chat.records, chat.totals["duration_s"])
        ttft = latency_stats(ttfts)
        result.update(chat_completed=s["completed"], chat_count=s["count"],
                      chat_unanswered=sum(r.sent_s is not None and r.ttft is None for r in chat.records),
                      ttft_p50=ttft["p50"], ttft_p99=ttft["p99"],
                      itl_p50=s["itl"]["p50"], itl_p99=s["itl"]["p99"], ttft_samples=ttfts,
                      itl_samples=latencies([r for r in chat.records if r.status == "ok"], "itl"))
    if rag is not None:
        rag_pool = "shared" if scenario.layout == "shared" else "rag"
        computed, seconds = counter_rate((chat or rag).scrapes, rag_pool, "computed_tokens_total")
        if scenario.layout == "shared" and chat is not None:   # the shared pool's tokens less chat's
            first, last = (chat.scrapes[0].t_s, chat.scrapes[-1].t_s) if chat.scrapes else (0.0, 0.0)
            computed -= sum(tokens_done(r, first, last) for r in chat.records)
        result["rag_tokens_per_s"] = computed / seconds if seconds > 0 else None
        result["rag_completed"] = rag.summary["rag"]["completed"]
    return result


def chat_ttfts(records, run_seconds: float) -> list[float]:
    """TTFT of every request sent: measured when its first token came (finished or not), else the
    seconds from its send to the end of the run (`run_seconds` from the run's start, the drain
    included): it waited at least that long."""
    return [r.ttft if r.ttft is not None else run_seconds - r.sent_s for r in records if r.sent_s is not None]


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each scenario's chat p99s over chat alone's, and rag tokens/s over rag alone's."""
    base = next(r for r in results if r["scenario"] == "chat alone")
    rag_base = next(r for r in results if r["scenario"] == "rag alone")
    for r in results:
        for key in ("ttft_p99", "itl_p99"):
            if r.get(key) is not None and base.get(key):
                r[key + "_ratio"] = r[key] / base[key]
        if r.get("rag_tokens_per_s") is not None and rag_base.get("rag_tokens_per_s"):
            r["rag_ratio"] = r["rag_tokens_per_s"] / rag_base["rag_tokens_per_s"]


def format_table(results: list[dict[str, Any]]) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:8.0f}"

    def x(v):
        return "-" if v is None else f"{v:6.2f}x"

    lines = [f"{'scenario':<18} {'chat TTFT p50':>13} {'p99':>8} {'/alone':>7} {'ITL p50':>8} {'p99':>8} "
             f"{'/alone':>7} {'chat preempt':>12} {'rag tok/s':>9} {'/alone':>7}",
             f"{'':<18} {'(ms)':>13} {'(ms)':>8} {'':>7} {'(ms)':>8} {'(ms)':>8}"]
    for r in results:
        rag = r.get("rag_tokens_per_s")
        lines.append(f"{r['scenario']:<18} {ms(r.get('ttft_p50')):>13} {ms(r.get('ttft_p99')):>8} "
                     f"{x(r.get('ttft_p99_ratio')):>7} {ms(r.get('itl_p50')):>8} {ms(r.get('itl_p99')):>8} "
                     f"{x(r.get('itl_p99_ratio')):>7} {str(r.get('chat_preemptions')):>12} "
                     f"{'-' if rag is None else f'{rag:9.1f}':>9} {x(r.get('rag_ratio')):>7}")
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """The issue's bars, each marked met or not."""
    by = {r["scenario"]: r for r in results}
    split, shared = by["split"], by["shared"]
    checks = [
        ("split chat p99 TTFT <= 1.25x chat alone", split.get("ttft_p99_ratio", 99) <= 1.25),
        ("split chat p99 ITL <= 1.25x chat alone", split.get("itl_p99_ratio", 99) <= 1.25),
        ("split: 0 chat preemptions", split.get("chat_preemptions") == 0),
        ("shared shows the cliff (chat p99 TTFT >= 5x alone, or preemptions)",
         shared.get("ttft_p99_ratio", 0) >= 5 or (shared.get("chat_preemptions") or 0) > 0),
        ("split rag keeps >= 25% of rag-alone tokens/s", split.get("rag_ratio", 0) >= 0.25),
    ]
    return [f"{'met' if ok else 'NOT met'}: {text}" for text, ok in checks]


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        for ax, key in ((axes[0], "ttft_samples"), (axes[1], "itl_samples")):
            samples = sorted(r.get(key) or [])
            if samples:
                ax.plot(samples, np.arange(1, len(samples) + 1) / len(samples), label=r["scenario"])
    for ax, title in ((axes[0], "chat TTFT"), (axes[1], "chat ITL")):
        ax.set_xscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests" if ax is axes[0] else "fraction of tokens")
        ax.set_title(title + " (CDF)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    curve = [r for r in results if r.get("rag_tokens_per_s") is not None and r.get("itl_p99") is not None]
    for r in curve:
        axes[2].scatter(r["rag_tokens_per_s"], 1000 * r["itl_p99"], label=r["scenario"])
        axes[2].annotate(r["scenario"], (r["rag_tokens_per_s"], 1000 * r["itl_p99"]), fontsize=7)
    axes[2].set_xlabel("rag tokens/s")
    axes[2].set_ylabel("chat ITL p99 (ms)")
    axes[2].set_yscale("log")
    axes[2].set_title("trade-off: chat p99 ITL vs rag throughput")
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    tokenizer = load_tokenizer(MODEL)
    with tempfile.TemporaryDirectory(prefix="cliffguard-isolation-") as folder:
        for scenario in scenarios(args):
            print(f"bench isolation: {scenario.name} ...", file=sys.stderr, flush=True)
            results.append(await run_scenario(scenario, args, Path(folder), tokenizer))
    add_ratios(results)
    return results


def run(args: argparse.Namespace) -> int:
    for name in ("chat_rate", "rag_rate", "duration", "drain_timeout", "ttft_ms", "itl_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    results = asyncio.run(_main(args))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "isolation.json").write_text(json.dumps(results, indent=2))
        write_plot(results, out / "isolation.png")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if not k.endswith("_samples")} for r in results], indent=2))
    else:
        print(format_table(results))
        print("\n".join(verdict(results)))
    return 0
