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

Per scenario: chat TTFT and ITL p50/p99 (TTFT over every chat request sent: one that never got its first
token counts as the time it waited until the run ended, a lower bound, so a pool that leaves chat unanswered
shows it as its tail instead of dropping it; ITL over every gap streamed to every chat request sent, one per
token, finished or not: a stream cut off at the drain, timed out or failed keeps the slow gaps it saw), chat's
ratio to chat alone, preemptions in chat's pool, rag tokens/s (the rag pool's `cliffguard_computed_tokens_total`
per second between the first and the last successful scrape: prefill and decode tokens the engine computed for
rag; in the shared pool, less the tokens of chat requests in that same window) and its ratio to rag alone, and
the send lag (max, p99: how late the client sent the run's requests). `--out DIR` writes `isolation.json` and
`isolation.png` (chat TTFT/ITL CDFs per scenario, and chat p99 vs rag tokens/s). `--quick` runs the four main
scenarios with short loads (under 3 minutes on a 2-core CPU), for a test.

Every pool file turns prefix caching off: the bench measures compute isolation, not caching (the
prompts are random words, so a cache would find nothing anyway). The chunk-only row's chat pool says
`slo: null`, so no default SLO makes it interactive.

`--sweep` (bench.isolation) runs these scenarios over a grid of chat rate x rag rate x rag
prompt length instead of at one point, on one server per layout, and judges per cell whether chat
keeps its SLO; see that module for the runs, the bars and the files it writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.live import LiveServer
from bench.load.plan import LoadConfig, load_tokenizer, plan_requests
from bench.load.report import LoadReport, counter_rate, counter_window, latencies, send_lags, tokens_done
from bench.load.run import run_load
from engine.config import DEFAULT_MIN_SHARE
from pools.cli_types import output_folder, positive_float, positive_floats
from pools.workload import LengthDist, WorkloadClass, latency_stats

MODEL = "builtin:smollm2-135m-instruct"
CHAT = WorkloadClass(name="chat", endpoint="chat", prompt_len=LengthDist("normal", mean=60, std=15, min=20, max=120),
                     output_len=LengthDist("fixed", value=32))
RAG = WorkloadClass(name="rag", endpoint="completion", prompt_len=LengthDist("uniform", min=1200, max=1800),
                    output_len=LengthDist("fixed", value=128))
ROUTE_THRESHOLD = 512        # prompt tokens: chat below, rag above
MIN_CHAT_REQUESTS = 100      # a chat load runs long enough for this many requests (p99 over at least 100)
CHAT_REQUESTS_MARGIN = 1.3   # ... times this many expected: Poisson arrivals fall short of their mean (3 sigma)
SPLIT_SLACK = 1.25           # split chat p99 TTFT may exceed chat alone's (+ itl_ms) by 25%, never the SLO
BARS = ("split_ttft_ok", "split_itl_ok", "split_no_preemption", "rag_share_ok")
MAX_SEND_LAG = 0.1           # a judged run's requests left at most this fraction of ttft_ms late (`send_lag_ok`)
# The scenarios' loads (`--sweep` has its grid's; these flags default to None so that the sweep refuses them).
CHAT_RATE, RAG_RATE, ITL_MS_CURVE = 0.5, 0.3, (100.0, 200.0, 400.0)


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
    p.add_argument("--chat-rate", type=positive_float, default=None,
                   help=f"chat requests/s (default {CHAT_RATE:g}; not with --sweep: --chat-rates)")
    p.add_argument("--rag-rate", type=positive_float, default=None, help=f"rag requests/s (default {RAG_RATE:g}: "
                   "above what the rag pool holds and serves, a flood; not with --sweep: --rag-rates)")
    p.add_argument("--duration", type=positive_float, default=None, help="seconds of arrivals per scenario "
                   "(default 60; 20 with --quick; with --sweep 30 per run, 8 with --quick); without --quick at "
                   f"least long enough for {MIN_CHAT_REQUESTS} chat requests (x{CHAT_REQUESTS_MARGIN}) at the chat "
                   "rate: 260 s at 0.5 req/s")
    p.add_argument("--drain-timeout", type=positive_float, default=None, help="seconds to finish in-flight requests "
                   "after arrivals end; the rest are cancelled and counted unfinished (default 20; 10 with --quick; "
                   "with --sweep 15, 4 with --quick)")
    p.add_argument("--ttft-ms", type=positive_float, default=1000.0, help="chat's slo.ttft_ms, and the TTFT bar of the "
                   "sweep's verdict (default 1000)")
    p.add_argument("--itl-ms", type=positive_float, default=100.0, help="chat's slo.itl_ms in the split scenario, "
                   "and the ITL bar of the sweep's verdict (default 100, the default config's)")
    p.add_argument("--itl-ms-sweep", type=positive_floats, default=None, help="itl_ms values of the trade-off curve "
                   f"(comma-separated, default {','.join(f'{v:g}' for v in ITL_MS_CURVE)}; the chunk-only row is "
                   "added; not with --sweep)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every pool's token budget per step")
    p.add_argument("--model", default=MODEL, help=f"every pool's model: a model folder or builtin name "
                   f"(default {MODEL}); the load's prompts are made with its tokenizer")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the pools' device (default cpu)")
    p.add_argument("--dtype", default=None, help="the device's dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--quick", action="store_true", help="the four main scenarios with short loads (< 3 min), "
                   "no trade-off curve; with --sweep: a 2 x 1 x 1 grid with short loads (about 2 min)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--out", type=output_folder, default=None,
                   help="write isolation.json and isolation.png here (with --sweep: sweep.json and sweep.png)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run_times(args: argparse.Namespace) -> tuple[float, float]:
    """(seconds of arrivals, drain timeout) of every run: the flags, else the mode's defaults."""
    duration = {(False, False): 60.0, (False, True): 20.0, (True, False): 30.0, (True, True): 8.0}
    drain = {(False, False): 20.0, (False, True): 10.0, (True, False): 15.0, (True, True): 4.0}
    mode = (bool(getattr(args, "sweep", False)), bool(args.quick))
    return (duration[mode] if args.duration is None else args.duration,
            drain[mode] if args.drain_timeout is None else args.drain_timeout)


def chat_duration(duration: float, chat_rate: float, args: argparse.Namespace) -> float:
    """Seconds of arrivals of a run with chat at `chat_rate`: `duration`, or long enough for
    `MIN_CHAT_REQUESTS` chat requests (a p99 over fewer is its largest one or two; not with --quick,
    whose runs are a smoke test and judged as too few)."""
    return duration if args.quick else max(duration, CHAT_REQUESTS_MARGIN * MIN_CHAT_REQUESTS / chat_rate)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    main = [Scenario("chat alone", "split", True, False, args.itl_ms),
            Scenario("rag alone", "split", False, True, args.itl_ms),
            Scenario("split", "split", True, True, args.itl_ms),
            Scenario("shared", "shared", True, True)]
    if args.quick:
        return main
    values = ITL_MS_CURVE if args.itl_ms_sweep is None else args.itl_ms_sweep
    curve = [Scenario(f"split itl {v:g} ms", "split", True, True, v) for v in values if v != args.itl_ms]
    return main + curve + [Scenario("chunk-only", "split", True, True, None)]


def pools_yaml(scenario: Scenario, args: argparse.Namespace) -> str:
    """The pool file of one scenario (see `pool_file`)."""
    slo = (args.ttft_ms, scenario.itl_ms) if scenario.layout == "split" and scenario.itl_ms else None
    return pool_file(scenario.layout, memory=args.memory, max_num_batched_tokens=args.max_num_batched_tokens,
                     chat_slo=slo, **device_of(args))


def device_of(args: argparse.Namespace) -> dict[str, str]:
    """`pool_file`'s model, device and dtype from the flags (dtype by device where unset)."""
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return {"model": args.model, "device": args.device, "dtype": dtype}


def pool_file(layout: str, *, memory: str, max_num_batched_tokens: int, chat_slo: tuple[float, float] | None,
              names_slo: bool = True, max_model_len: int = 4096, chat_kv_share: float = 0.4, model: str = MODEL,
              device: str = "cpu", dtype: str = "float32") -> str:
    """The pool file of a layout: same device and model; split = chat (prompts up to ROUTE_THRESHOLD
    tokens) + rag (longer prompts, `max_model_len`), shared = one pool (`max_model_len`). Chat's
    `slo: {ttft_ms, itl_ms}` is `chat_slo`; None writes `slo: null` (a throughput pool: plain chunked
    prefill), or, with `names_slo` False, no `slo` key at all (what the loader does for a device
    without one applies). Chat holds `chat_kv_share` of the KV cache, rag the rest. Prefix caching is
    off on every pool: the bench measures compute isolation, and runs that reuse one server must not
    warm each other. Every pool runs `model` on one `device` of `memory` in `dtype`."""
    if not 0 < chat_kv_share < 1:
        raise ValueError(f"--chat-kv-share: must be in (0, 1), got {chat_kv_share}")
    common = (f"model: {model}\n    device: dev\n    block_size: 16\n"
              f"    max_num_batched_tokens: {max_num_batched_tokens}\n    enable_prefix_caching: false\n")
    head = f"devices:\n  dev: {{device: {device}, memory: {memory}, dtype: {dtype}}}\npools:\n"
    if layout == "shared":
        return head + (f"  - name: shared\n    {common}    kv_share: 1.0\n    avg_len: 512\n"
                       f"    max_model_len: {max_model_len}\n")
    slo = (f"    slo: {{ttft_ms: {chat_slo[0]:g}, itl_ms: {chat_slo[1]:g}}}\n" if chat_slo
           else "    slo: null\n" if names_slo else "")
    return (head
            + f"  - name: chat\n    {common}    route: {{max_prompt_tokens: {ROUTE_THRESHOLD}}}\n"
              f"    kv_share: {chat_kv_share:g}\n    avg_len: 128\n    max_model_len: 2048\n{slo}"
            + f"  - name: rag\n    {common}    route: {{min_prompt_tokens: {ROUTE_THRESHOLD + 1}}}\n"
              f"    kv_share: {1 - chat_kv_share:g}\n    avg_len: 1700\n    max_model_len: {max_model_len}\n")


def load_config(url: str, cls: WorkloadClass, rate: float, *, seed: int, scrape: bool, duration: float,
                drain_timeout: float, model: str = MODEL) -> LoadConfig:
    """One open-loop load of the bench: `cls` at `rate` req/s for `duration` s of arrivals, with the usage so
    far in every chunk (ITL per token: see `LoadConfig.continuous_usage`); prompts in `model`'s tokens."""
    return LoadConfig(url=url, classes=(cls,), request_rate=rate, duration=duration, seed=seed, timeout=600.0,
                      drain_timeout=drain_timeout, scrape=scrape, scrape_interval=0.5, tokenizer=model,
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
    chat_rate = CHAT_RATE if args.chat_rate is None else args.chat_rate
    rag_rate = RAG_RATE if args.rag_rate is None else args.rag_rate
    duration = chat_duration(duration, chat_rate, args)     # every scenario: the same arrivals
    times = {"duration": duration, "drain_timeout": drain_timeout}
    with LiveServer(path) as server:
        configs = []
        if scenario.chat:
            configs.append(load_config(server.url, CHAT, chat_rate, seed=args.seed, scrape=True, model=args.model,
                                       **times))
        if scenario.rag:
            configs.append(load_config(server.url, RAG, rag_rate, seed=args.seed + 1, scrape=not scenario.chat,
                                       model=args.model, **times))
        reports = await run_loads(configs, tokenizer)
        slo = await server_slo(server.url)
    chat = reports[0] if scenario.chat else None
    rag = reports[-1] if scenario.rag else None
    return {**summarize(scenario, chat, rag, arrivals_s=duration), "slo_ms": slo}


async def server_slo(url: str, pool: str = "chat") -> list[float] | None:
    """[ttft_ms, itl_ms] the server's engine runs `pool` with (`cliffguard_pool_slo_seconds`: the YAML's,
    or the one isolation by default derived from the device's step); None for a throughput pool."""
    import aiohttp

    from bench.load.scrape import samples_of

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    targets = {labels.get("target"): value for labels, value in samples_of(text, "cliffguard_pool_slo_seconds")
               if labels.get("pool") == pool}
    return [1000 * targets["ttft"], 1000 * targets["itl"]] if {"ttft", "itl"} <= set(targets) else None


def summarize(scenario: Scenario, chat: LoadReport | None, rag: LoadReport | None,
              arrivals_s: float | None = None) -> dict[str, Any]:
    """One run's numbers: chat's p50/p99s (TTFT: `chat_ttfts`; ITL: every gap of every chat request sent)
    and counts, rag's tokens/s and answers, each pool's share of the device's time during the arrivals
    (`arrivals_s`; the engine's step time divided among pools, `cliffguard_pool_device_seconds_total`),
    what `cliffguard_device_overloaded` said, and the send lag (max, p99) of every request of the run."""
    result: dict[str, Any] = {"scenario": scenario.name, "layout": scenario.layout, "itl_ms": scenario.itl_ms}
    scrapes = (chat or rag).scrapes
    scraped = (chat or rag).totals["scrape"]["pools"]
    chat_pool = "shared" if scenario.layout == "shared" else "chat"
    result["chat_preemptions"] = scraped.get(chat_pool, {}).get("num_preemptions")
    result["max_scrape_s"] = (chat or rag).totals["scrape"]["max_s"]
    if scenario.layout == "split":
        for pool in ("chat", "rag"):
            result[f"{pool}_device_share"] = device_share(scrapes, pool, arrivals_s)
    result.update(overload_timeline(scrapes))
    lag = latency_stats(send_lags(r for report in (chat, rag) if report is not None for r in report.records))
    result.update(send_lag_max_s=lag["max"], send_lag_p99_s=lag["p99"])
    if chat is not None:
        s = chat.summary["chat"]
        ttfts = chat_ttfts(chat.records, chat.totals["duration_s"])
        ttft, itls = latency_stats(ttfts), latencies(chat.records, "itl", completed_only=False)
        itl = latency_stats(itls)
        result.update(chat_completed=s["completed"], chat_count=s["count"],
                      chat_unanswered=sum(r.sent_s is not None and r.ttft is None for r in chat.records),
                      ttft_p50=ttft["p50"], ttft_p99=ttft["p99"],
                      itl_p50=itl["p50"], itl_p99=itl["p99"], ttft_samples=ttfts, itl_samples=itls)
    if rag is not None:
        rag_pool = "shared" if scenario.layout == "shared" else "rag"
        computed, seconds = counter_rate(scrapes, rag_pool, "computed_tokens_total")
        window = counter_window(scrapes, rag_pool, "computed_tokens_total")
        if scenario.layout == "shared" and chat is not None and window:   # less chat's tokens, same window; a
            computed = max(0, computed - sum(   # prompt counts at its first token, which can come after its step
                tokens_done(r, window[0].t_s, window[1].t_s) for r in chat.records))
        result["rag_tokens_per_s"] = computed / seconds if seconds > 0 else None
        result["rag_completed"] = rag.summary["rag"]["completed"]
        result["rag_count"] = rag.summary["rag"]["count"]
        result["rag_errors"] = dict(Counter(r.status for r in rag.records if r.status != "ok"))
    return result


def device_share(scrapes, pool: str, until: float | None = None) -> float | None:
    """`pool`'s part of the device's time between the first scrape and the last one at most `until`
    seconds into the run (None: the last): its device seconds' increase over the wall time."""
    ok = [s for s in scrapes if s.error is None and "device_seconds_total" in s.pools.get(pool, {})
          and (until is None or s.t_s <= until)]
    if len(ok) < 2 or ok[-1].t_s <= ok[0].t_s:
        return None
    return (ok[-1].pools[pool]["device_seconds_total"] - ok[0].pools[pool]["device_seconds_total"]) / (
        ok[-1].t_s - ok[0].t_s)


def overload_timeline(scrapes) -> dict[str, Any]:
    """What `cliffguard_device_overloaded` said over the run: the first scrape (s into the run) that read 1,
    the fraction of scrapes that did, and the last scrape's value (None where no scrape had it)."""
    values = [(s.t_s, s.pools.get("", {}).get("device_overloaded")) for s in scrapes if s.error is None]
    values = [(t, v) for t, v in values if v is not None]
    if not values:
        return {"overloaded_first_s": None, "overloaded_fraction": None, "overloaded_last": None}
    on = [t for t, v in values if v >= 1]
    return {"overloaded_first_s": on[0] if on else None, "overloaded_fraction": len(on) / len(values),
            "overloaded_last": values[-1][1]}


def chat_ttfts(records, run_seconds: float) -> list[float]:
    """TTFT of every request sent, from its scheduled arrival: measured when its first token came (finished or
    not), else the seconds from its arrival to the end of the run (`run_seconds` from the run's start, the
    drain included): it waited at least that long."""
    return [r.ttft if r.ttft is not None else run_seconds - r.scheduled_s for r in records if r.sent_s is not None]


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
             f"{'/alone':>7} {'chat preempt':>12} {'rag tok/s':>9} {'/alone':>7} {'send lag':>8}",
             f"{'':<18} {'(ms)':>13} {'(ms)':>8} {'':>7} {'(ms)':>8} {'(ms)':>8} {'':>7} {'':>12} {'':>9} {'':>7} "
             f"{'max (ms)':>8}"]
    for r in results:
        rag = r.get("rag_tokens_per_s")
        lines.append(f"{r['scenario']:<18} {ms(r.get('ttft_p50')):>13} {ms(r.get('ttft_p99')):>8} "
                     f"{x(r.get('ttft_p99_ratio')):>7} {ms(r.get('itl_p50')):>8} {ms(r.get('itl_p99')):>8} "
                     f"{x(r.get('itl_p99_ratio')):>7} {str(r.get('chat_preemptions')):>12} "
                     f"{'-' if rag is None else f'{rag:9.1f}':>9} {x(r.get('rag_ratio')):>7} "
                     f"{ms(r.get('send_lag_max_s')):>8}")
    return "\n".join(lines)


def send_lag_bound(ttft_ms: float) -> float:
    """The most a judged run's requests may leave late against their drawn arrivals (s): `MAX_SEND_LAG` (a
    tenth) of the TTFT bar `ttft_ms`. Latency is timed from a request's drawn arrival, so a late send is in
    the figures; but a client starved of the CPU (the 2-core machine also runs the CPU server) also reads the
    server's stream late, and a run where it fell behind by whole tenths of a second measured its own client
    as much as the server: not judged."""
    return MAX_SEND_LAG * ttft_ms / 1e3


def judge(alone: dict[str, Any], split: dict[str, Any], rag_alone: dict[str, Any], *, ttft_ms: float,
          itl_ms: float, min_share: float = DEFAULT_MIN_SHARE) -> dict[str, Any]:
    """The verdict on one load (a point of `bench isolation`, a cell of `--sweep`: the one definition), from
    its chat-alone, split and rag-alone runs:

    - in scope by load: chat alone used at most 1 - min_share of the device's time (its device share,
      from the engine's step time), so rag's guaranteed share fits beside it;
    - `send_lag_ok`: each of the three runs sent every request at most `send_lag_bound(ttft_ms)` after its
      arrival (`send_lag_max_s`: each run's largest lag); else the load is invalid, not judged;
    - `split_ttft_ok`: split chat p99 TTFT <= min(ttft_ms, 1.25 x (chat alone p99 TTFT + itl_ms));
    - `split_itl_ok`: split chat p99 ITL (every gap of every chat request sent) <= itl_ms (the SLO itself);
    - `split_no_preemption`: no preemption in chat's pool during the split run;
    - `rag_share_ok`: rag's device share during the split run's arrivals >= min(min_share, rag alone's),
      or rag computed at least the tokens/s it does alone (it had all the device time it could use: on
      a GPU whose steps are host-bound a decode beside chat's costs little, yet the step's time is
      divided among the pools by tokens, so a rag served in full can read a small share);
    - `enough_samples`: both chat runs sent at least `MIN_CHAT_REQUESTS` requests (else not met);
    - `overloaded`: `cliffguard_device_overloaded` read 1 during the split run (marked, still judged).
    `cell_ok`: every bar met; None when out of scope or invalid."""
    ttft_s, itl_s = ttft_ms / 1e3, itl_ms / 1e3

    def at_most(value: float | None, bound: float | None) -> bool:
        return value is not None and bound is not None and value <= bound

    alone_share, alone_ttft, split_ttft = alone.get("chat_device_share"), alone.get("ttft_p99"), split.get("ttft_p99")
    ttft_bound = None if alone_ttft is None else min(ttft_s, SPLIT_SLACK * (alone_ttft + itl_s))
    rag_base = rag_alone.get("rag_device_share")
    owed = None if rag_base is None else min(min_share, rag_base)
    rag_split, rag_tokens = split.get("rag_tokens_per_s"), rag_alone.get("rag_tokens_per_s")
    bars = {"split_ttft_ok": at_most(split_ttft, ttft_bound), "split_itl_ok": at_most(split.get("itl_p99"), itl_s),
            "split_no_preemption": split.get("chat_preemptions") == 0,
            "rag_share_ok": owed is not None and ((split.get("rag_device_share") or 0.0) >= owed
                                                  or at_most(rag_tokens, rag_split))}
    enough = min(alone.get("chat_count") or 0, split.get("chat_count") or 0) >= MIN_CHAT_REQUESTS
    in_scope = alone_share is not None and alone_share <= 1 - min_share
    lags = {name: run.get("send_lag_max_s") for name, run in (("chat alone", alone), ("split", split),
                                                              ("rag alone", rag_alone))}
    lag_ok = all((lag or 0.0) <= send_lag_bound(ttft_ms) for lag in lags.values())   # none sent: none late
    judged = in_scope and lag_ok
    failed = [b for b in BARS if not bars[b]] + ([] if enough else ["enough_samples"])
    return {**bars, "enough_samples": enough, "in_scope": in_scope, "chat_alone_device_share": alone_share,
            "send_lag_ok": lag_ok, "send_lag_max_s": lags, "send_lag_bound_s": send_lag_bound(ttft_ms),
            "rag_device_share_owed": owed, "split_ttft_bound_s": ttft_bound, "failed_bars": failed if judged else [],
            "cell_ok": (not failed) if judged else None, "overloaded": split.get("overloaded_first_s") is not None,
            "split_ttft_slo_ratio": None if split_ttft is None else split_ttft / ttft_s,
            "rag_ratio": rag_split / rag_tokens if rag_split is not None and rag_tokens else None,
            "ttft_ms": ttft_ms, "itl_ms": itl_ms}


def verdict_text(cell: dict[str, Any]) -> str:
    """`met`, `NOT met: ttft, rag share`, `out of scope (...)` or `invalid: send lag ...` (the client fell
    behind its arrivals: its latencies are not judged); `[overloaded]` where the gauge said so."""
    mark = " [overloaded]" if cell.get("overloaded") else ""
    if not cell["in_scope"]:
        share = cell.get("chat_alone_device_share")
        return ("out of scope (chat alone uses " + ("?" if share is None else f"{share:.0%}")
                + " of the device)" + mark)
    if not cell.get("send_lag_ok", True):
        late = ", ".join(f"{name} {1000 * lag:.0f} ms" for name, lag in cell["send_lag_max_s"].items()
                         if (lag or 0.0) > cell["send_lag_bound_s"])
        return f"invalid: send lag over {1000 * cell['send_lag_bound_s']:.0f} ms ({late}), not judged" + mark
    if cell["cell_ok"]:
        return "met" + mark
    short = {"split_ttft_ok": "ttft", "split_itl_ok": "itl", "split_no_preemption": "preempt",
             "rag_share_ok": "rag share", "enough_samples": "< 100 chat requests"}
    return "NOT met: " + ", ".join(short[b] for b in cell["failed_bars"]) + mark


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """The point's verdict (`judge`, against the SLO the split server ran with), and the shared pool's cliff;
    a run whose requests left too late (`send_lag_bound`) leaves its bars `not judged`."""
    by = {r["scenario"]: r for r in results}
    split, shared = by["split"], by["shared"]
    ttft_ms, itl_ms = split.get("slo_ms") or [1000.0, split.get("itl_ms") or 100.0]
    cell = judge(by["chat alone"], split, by["rag alone"], ttft_ms=ttft_ms, itl_ms=itl_ms)
    lines = [f"verdict: {verdict_text(cell)} (slo ttft {ttft_ms:g} ms, itl {itl_ms:g} ms; chat alone used "
             + ("?" if cell["chat_alone_device_share"] is None else f"{cell['chat_alone_device_share']:.0%}")
             + " of the device)"]
    lags = ", ".join(f"{name} {'-' if lag is None else f'{1000 * lag:.0f}'}"
                     for name, lag in cell["send_lag_max_s"].items())
    lines.append(f"{'met' if cell['send_lag_ok'] else 'NOT met'}: every request sent within "
                 f"{1000 * cell['send_lag_bound_s']:g} ms of its arrival (send lag max ms: {lags})")
    names = {"split_ttft_ok": "split chat p99 TTFT <= min(ttft_ms, 1.25 x (alone + itl_ms))",
             "split_itl_ok": "split chat p99 ITL <= itl_ms", "split_no_preemption": "split: 0 chat preemptions",
             "rag_share_ok": "split rag device share >= min(min_share, rag alone's)",
             "enough_samples": f"at least {MIN_CHAT_REQUESTS} chat requests per run"}
    lines += [f"{('met' if cell[b] else 'NOT met') if cell['send_lag_ok'] else 'not judged'}: {text}"
              for b, text in names.items()]
    cliff = shared.get("ttft_p99_ratio", 0) >= 5 or (shared.get("chat_preemptions") or 0) > 0
    shared_late = (shared.get("send_lag_max_s") or 0.0) > cell["send_lag_bound_s"]
    lines.append(f"{'not judged' if shared_late else 'met' if cliff else 'NOT met'}: shared shows the cliff "
                 "(chat p99 TTFT >= 5x alone, or preemptions)")
    return lines


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
        ax.set(xscale="log", xlabel="seconds", title=title + " (CDF)",
               ylabel="fraction of requests" if ax is axes[0] else "fraction of tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    curve = [r for r in results if r.get("rag_tokens_per_s") is not None and r.get("itl_p99") is not None]
    for r in curve:
        axes[2].scatter(r["rag_tokens_per_s"], 1000 * r["itl_p99"], label=r["scenario"])
        axes[2].annotate(r["scenario"], (r["rag_tokens_per_s"], 1000 * r["itl_p99"]), fontsize=7)
    axes[2].set(xlabel="rag tokens/s", ylabel="chat ITL p99 (ms)", yscale="log",
                title="trade-off: chat p99 ITL vs rag throughput")
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    tokenizer = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory(prefix="cliffguard-isolation-") as folder:
        for scenario in scenarios(args):
            print(f"bench isolation: {scenario.name} ...", file=sys.stderr, flush=True)
            results.append(await run_scenario(scenario, args, Path(folder), tokenizer))
    add_ratios(results)
    return results


def run(args: argparse.Namespace) -> int:   # (rates, times and SLO bars > 0: the options' types)
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
