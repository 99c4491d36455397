"""`cliffguard bench admission`: the credit queue vs reject-when-full, on the same overload.

Starts `cliffguard serve` twice on the same pool (the builtin model, a KV cache small enough that a
handful of requests fill it) and drives each from outside over HTTP with the same open-loop load:
chat requests arriving as a Poisson process faster than the pool can serve them, each with a fixed
output length (`ignore_eos`), same seed, same prompts.

- `queue` (cliffguard's default): a request that does not fit the free KV credits waits at the
  gateway and is admitted the moment it fits.
- `reject`: the same pool with `max_queue_seconds: 0`: a request that does not fit now gets 429 (with
  `Retry-After: 1`), and its client retries. `--client sdk` (the default) retries as openai-python does
  by default: at most 2 retries, the server's `Retry-After` honoured (up to 60 s), else 0.5 s doubling
  per retry, capped at 8 s, shortened by up to 25% at random. `--client jitter` ignores `Retry-After`
  and sleeps a uniform draw in [0, min(8 s, backoff * 2^k)] ("full jitter"), 8 retries by default.

`--rate` takes a comma-separated list to sweep the load from below the pool's capacity to far above
it: the queue's advantage in goodput is largest near the knee, where clients in back-off leave freed
KV idle, and shrinks under a heavy overload, where so many retries arrive that a freed slot is
refilled almost at once (the queue then differs in what it does not lose, not in how busy it keeps
the device).

Per mode: requests answered / rejected for good, goodput (answered requests and output tokens per
second from the first arrival to the last answer or give-up), e2e latency p50/p99 as the user sees
it (first send to final answer, back-offs included), wasted attempts (429s), and how idle the pool
sat over the run, scraped every 0.25 s and averaged over the makespan: KV idle (1 -
`cliffguard_kv_cache_usage_perc`, blocks really in use) and credits idle (credits no admitted
request holds: what reject-when-full leaves unused while its clients back off).
`--quick` runs a short load (about a minute per mode on a 2-core CPU) for a test.

`--ideal SLOTS,SECONDS` runs no server: the same arrivals and clients against an idealised pool that
serves SLOTS identical requests at once, each in exactly SECONDS, and admits the next one the instant
a slot frees (queue) or when a fresh arrival or retry finds a slot free (reject). It bounds what any
admission policy can gain in goodput, with no engine overhead and no partly used KV: the gain comes
only from slots left idle while clients wait out a back-off, so it peaks near the pool's capacity
and shrinks both below it (slots idle for lack of work in either mode) and far above it (retries
arrive so often that a freed slot is refilled almost at once), and with more slots.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.live import LiveServer
from bench.load.scrape import pool_samples
from pools.cli_types import non_negative_int, positive_float, seed as seed_arg
from pools.workload import MIN_P99_SAMPLES, gamma_arrivals, latency_stats, p99_lower_bound, parse_rates

MODEL = "builtin:smollm2-135m-instruct"
CLIENTS = ("sdk", "jitter")
MAX_BACKOFF = 8.0          # seconds: openai-python's MAX_RETRY_DELAY, and the jitter client's cap
MAX_RETRY_AFTER = 60.0     # a longer Retry-After is not honoured (openai-python: not retried at all)
MAX_OUTPUT_TOKENS = 128    # the pool's max_model_len (256) less the longest prompt (40 words, the template)
WORDS = ("cliff", "river", "stone", "lamp", "orbit", "maple", "copper", "harbor", "signal", "window", "garden",
         "thunder", "violet", "engine", "summit", "canyon")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="4", help="request arrivals per second; a comma-separated list sweeps "
                   "(default 4: an overload)")
    p.add_argument("--duration", type=positive_float, default=30.0, help="seconds of arrivals (default 30)")
    p.add_argument("--output-tokens", type=int, default=48, help="tokens each request generates, 1 to "
                   f"{MAX_OUTPUT_TOKENS} (default 48)")
    p.add_argument("--kv-cache", default="32MiB", help="the pool's KV cache (default 32MiB: a few requests "
                   "fill it)")
    p.add_argument("--client", choices=CLIENTS, default="sdk", help="reject mode: how clients retry a 429: "
                   "sdk (openai-python's defaults, Retry-After honoured) or jitter (full-jitter back-off) "
                   "(default sdk)")
    p.add_argument("--max-retries", type=non_negative_int, default=None, help="reject mode: retries before a "
                   "client gives up (default 2 with --client sdk, as openai-python; 8 with jitter)")
    p.add_argument("--backoff", type=positive_float, default=0.5, help="reject mode: first back-off in seconds, "
                   "doubled per retry, capped at 8 s (default 0.5)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of arrivals, prompts and back-off jitter (default 0)")
    p.add_argument("--modes", default="queue,reject", help="comma-separated: queue, reject (default both)")
    p.add_argument("--quick", action="store_true", help="short load for a test (10 s of arrivals)")
    p.add_argument("--ideal", default=None, metavar="SLOTS,SECONDS", help="no server: an idealised pool of "
                   "SLOTS requests at once, SECONDS each (the bound on what admission can gain)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def pools_yaml(mode: str, args: argparse.Namespace) -> str:
    queue = f"    max_queue_seconds: {0 if mode == 'reject' else 'null'}\n"   # null: wait as long as the client
    return (f"devices:\n  dev: {{device: cpu, memory: 1GiB, dtype: float32}}\npools:\n"
            f"  - name: chat\n    model: {MODEL}\n    device: dev\n    kv_cache_bytes: {args.kv_cache}\n"
            f"    avg_len: 128\n    max_model_len: 256\n{queue}")


@dataclass
class Outcome:
    arrival: float                 # seconds after the start
    done: float = 0.0
    status: int = 0
    attempts: int = 0
    tokens: int = 0
    error: str = ""


@dataclass
class Scrapes:
    samples: list[tuple[float, float, float]] = field(default_factory=list)   # (time, KV used, credits held)


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` per second, up to `duration`: the load
    generator's arrivals (`pools.workload.gamma_arrivals`, burstiness 1)."""
    return [float(t) for t in gamma_arrivals(rate, 1.0, np.random.default_rng(seed), duration=duration)]


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(n)]


def retry_after_seconds(value: str | None) -> float | None:
    """A `Retry-After` header given in seconds, or None (absent, an HTTP date, or garbage)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def retry_delay(client: str, retry: int, retry_after: float | None, backoff: float, rng: random.Random) -> float:
    """Seconds a client sleeps before retry number `retry` (0 for the first) after a 429."""
    if client == "sdk":
        if retry_after is not None and 0 < retry_after <= MAX_RETRY_AFTER:
            return retry_after
        return min(backoff * 2 ** retry, MAX_BACKOFF) * (1 - 0.25 * rng.random())
    return rng.uniform(0, min(MAX_BACKOFF, backoff * 2 ** retry))


async def _one(session, url: str, prompt: str, out: Outcome, args: argparse.Namespace, rng: random.Random,
               start: float) -> None:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0}
    for retry in range(args.max_retries + 1):
        out.attempts += 1
        try:   # a broken answer or connection is this request's outcome, never the run's end
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                payload = await r.json(content_type=None)
                out.status = r.status
                retry_after = retry_after_seconds(r.headers.get("Retry-After"))
            if out.status == 200:
                out.tokens = payload["usage"]["completion_tokens"]
                break
            error = payload.get("error") if isinstance(payload, dict) else None
            out.error = str(error.get("code") if isinstance(error, dict) else f"HTTP {out.status}")
        except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            out.status, out.error = 0, f"client: {type(exc).__name__}"
            break
        if out.status != 429 or retry == args.max_retries:
            break
        await asyncio.sleep(retry_delay(args.client, retry, retry_after, args.backoff, rng))
    out.done = time.perf_counter() - start


async def _scrape(session, url: str, scrapes: Scrapes, start: float) -> None:
    """Every 0.25 s: the fraction of the pool's blocks in use and of its credits held."""
    while True:
        try:
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            values = pool_samples(text).get("chat", {})
            held = 1 - values["cliffguard_kv_credits_free"] / values["cliffguard_kv_credits"]
            scrapes.samples.append((time.perf_counter() - start, values["cliffguard_kv_cache_usage_perc"], held))
        except (OSError, KeyError):
            pass
        await asyncio.sleep(0.25)


async def run_mode(mode: str, rate: float, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    path = folder / f"{mode}-{rate:g}.yaml"
    path.write_text(pools_yaml(mode, args))
    arrivals = poisson_arrivals(rate, args.duration, args.seed)
    if not arrivals:   # before a server starts: a run of nothing has no figure to report
        raise ValueError(f"--rate: {rate:g} requests/s over --duration {args.duration:g} s drew no request; "
                         "raise either")
    prompts = _prompts(len(arrivals), args.seed)
    outcomes = [Outcome(a) for a in arrivals]
    scrapes = Scrapes()
    with LiveServer(path, args=["--data-dir", str(folder / f"{mode}-{rate:g}-data")]) as server:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            start = time.perf_counter()
            scraper = asyncio.create_task(_scrape(session, server.url, scrapes, start))

            async def later(out: Outcome, prompt: str, i: int) -> None:
                await asyncio.sleep(max(0.0, out.arrival - (time.perf_counter() - start)))
                await _one(session, server.url, prompt, out, args, random.Random(args.seed * 1000 + i), start)

            await asyncio.gather(*(later(o, p, i) for i, (o, p) in enumerate(zip(outcomes, prompts))))
            scraper.cancel()
    return summarize(mode, rate, outcomes, scrapes)


def summarize(mode: str, rate: float, outcomes: list[Outcome], scrapes: Scrapes) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200]
    makespan = max(o.done for o in outcomes) - min(o.arrival for o in outcomes)
    window = [(u, h) for t, u, h in scrapes.samples if t <= makespan + outcomes[0].arrival]
    e2e = latency_stats([o.done - o.arrival for o in ok])
    return {"mode": mode, "rate": rate, "requests": len(outcomes), "answered": len(ok),
            "rejected": sum(1 for o in outcomes if o.status != 200),
            "wasted_attempts": sum(o.attempts for o in outcomes) - len(ok),
            "makespan_s": makespan, "goodput_rps": len(ok) / makespan,
            "goodput_tokens_s": sum(o.tokens for o in ok) / makespan,
            "e2e_p50_s": e2e["p50"], "e2e_p99_s": e2e["p99"], "e2e_n": e2e["n"],
            "kv_idle_fraction": 1 - sum(u for u, _ in window) / len(window) if window else None,
            "credits_idle_fraction": 1 - sum(h for _, h in window) / len(window) if window else None,
            "errors": sorted({o.error for o in outcomes if o.status != 200})}


def ideal_run(mode: str, rate: float, args: argparse.Namespace, slots: int, service_s: float,
              seed: int) -> dict[str, Any]:
    """One run of the idealised pool (see `--ideal`): an event simulation, no engine, no server.
    The reject mode's server answers `Retry-After: 1`, as cliffguard's does."""
    arrivals = poisson_arrivals(rate, args.duration, seed)
    if not arrivals:
        raise ValueError(f"--ideal: no request arrives in {args.duration:g} s at rate {rate:g}")
    client_rng = random.Random(seed * 1000 + 1)
    events = [(a, 0, i, 0) for i, a in enumerate(arrivals)]   # (time, kind 0 attempt / 1 done, request, retry)
    heapq.heapify(events)
    outcomes = [Outcome(a) for a in arrivals]
    free, queue, busy, last = slots, [], 0.0, 0.0

    def admit(now: float, i: int) -> None:
        nonlocal free
        free -= 1
        heapq.heappush(events, (now + service_s, 1, i, 0))

    while events:
        now, kind, i, retry = heapq.heappop(events)
        busy, last = busy + (slots - free) * (now - last), now
        out = outcomes[i]
        if kind == 1:
            free += 1
            out.done, out.status = now, 200
            if queue:
                admit(now, queue.pop(0))
            continue
        out.attempts += 1
        if free:
            admit(now, i)
        elif mode == "queue":
            queue.append(i)
        elif retry == args.max_retries:
            out.done, out.status = now, 429
        else:
            heapq.heappush(events, (now + retry_delay(args.client, retry, 1.0, args.backoff, client_rng), 0, i,
                                    retry + 1))
    answered = sum(o.status == 200 for o in outcomes)
    makespan = max(o.done for o in outcomes) - arrivals[0]
    return {"mode": mode, "rate": rate, "requests": len(outcomes), "answered": answered,
            "rejected": len(outcomes) - answered, "wasted_attempts": sum(o.attempts for o in outcomes) - answered,
            "goodput_rps": answered / makespan, "slots_idle_fraction": 1 - busy / (slots * (last - arrivals[0]))}


def ideal_table(args: argparse.Namespace, rates: list[float], modes: list[str], seeds: int = 8) -> str:
    """The idealised pool at each rate, averaged over `seeds` arrival sequences (`--seed` the first)."""
    slots_text, _, seconds_text = args.ideal.partition(",")
    try:
        slots, service_s = int(slots_text), float(seconds_text)
    except ValueError:
        raise ValueError(f"--ideal: expected SLOTS,SECONDS (e.g. 2,4), got {args.ideal!r}") from None
    if slots < 1 or not service_s > 0:
        raise ValueError(f"--ideal: SLOTS must be >= 1 and SECONDS > 0, got {args.ideal!r}")
    rows = [f"idealised pool: {slots} slots, {service_s:g} s per request (capacity {slots / service_s:.2f} "
            f"req/s), {args.client} clients, {args.max_retries} retries, {seeds} seeds from {args.seed}",
            f"{'rate':>6}  {'mode':<8}{'answered':>9}{'rejected':>9}{'429s':>7}{'req/s':>8}{'slots idle':>12}"]
    for rate in rates:
        goodput = {}
        for mode in modes:
            runs = [ideal_run(mode, rate, args, slots, service_s, seed) for seed in range(args.seed, args.seed + seeds)]
            mean = {k: sum(r[k] for r in runs) / seeds for k in ("answered", "rejected", "wasted_attempts",
                                                                 "goodput_rps", "slots_idle_fraction")}
            goodput[mode] = mean["goodput_rps"]
            rows.append(f"{rate:>6g}  {mode:<8}{mean['answered']:>9.1f}{mean['rejected']:>9.1f}"
                        f"{mean['wasted_attempts']:>7.0f}{mean['goodput_rps']:>8.2f}"
                        f"{mean['slots_idle_fraction']:>12.0%}")
        if "queue" in goodput and "reject" in goodput:
            rows.append(f"rate {rate:g}: goodput queue / reject {_ratio(goodput['queue'], goodput['reject'])}")
    return "\n".join(rows)


def _few(result: dict[str, Any]) -> bool:
    """An e2e p99 of fewer than MIN_P99_SAMPLES answered requests: a lower bound on the tail, marked."""
    return p99_lower_bound({"p99": result["e2e_p99_s"], "n": result["e2e_n"]})


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'rate':>6}  {'mode':<8}{'answered':>9}{'rejected':>9}{'429s':>7}{'req/s':>8}{'tok/s':>8}"
            f"{'e2e p50':>9}{'e2e p99':>9}{'KV idle':>9}{'credits idle':>14}")
    rows = [head]
    for r in results:
        idle = "-" if r["kv_idle_fraction"] is None else f"{r['kv_idle_fraction']:.0%}"
        credits = "-" if r["credits_idle_fraction"] is None else f"{r['credits_idle_fraction']:.0%}"
        rows.append(f"{r['rate']:>6g}  {r['mode']:<8}{r['answered']:>9}{r['rejected']:>9}{r['wasted_attempts']:>7}"
                    f"{r['goodput_rps']:>8.2f}{r['goodput_tokens_s']:>8.1f}{_seconds(r['e2e_p50_s']):>9}"
                    f"{_seconds(r['e2e_p99_s']) + ('*' if _few(r) else ''):>9}{idle:>9}{credits:>14}")
    for rate in dict.fromkeys(r["rate"] for r in results):
        by_mode = {r["mode"]: r for r in results if r["rate"] == rate}
        if "queue" in by_mode and "reject" in by_mode:
            q, j = by_mode["queue"], by_mode["reject"]
            # a p99 over the answered only: the requests a mode gave up on are no tail of it, so the two compare
            # only where both answered every request
            p99 = _ratio(q["e2e_p99_s"], j["e2e_p99_s"]) if not q["rejected"] and not j["rejected"] else \
                f"- (over answered requests only: {j['rejected'] + q['rejected']} given up)"
            rows.append(f"rate {rate:g}: goodput queue / reject {_ratio(q['goodput_rps'], j['goodput_rps'])} "
                        f"requests/s, {_ratio(q['goodput_tokens_s'], j['goodput_tokens_s'])} tokens/s; "
                        f"e2e p99 {p99}")
    if any(_few(r) for r in results):
        rows.append(f"* p99 of fewer than {MIN_P99_SAMPLES} answered requests: a lower bound on the tail")
    return "\n".join(rows)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _seconds(value: float | None) -> str:   # a latency, "-" where no request was answered
    return "-" if value is None else f"{value:.1f}s"


def run(args: argparse.Namespace) -> int:   # (--duration, --backoff and --max-retries: the options' types)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= {"queue", "reject"}:
        raise ValueError(f"--modes: expected queue, reject or both, each once, got {args.modes!r}")
    rates = parse_rates(args.rate)
    if not 1 <= args.output_tokens <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"--output-tokens: must be 1 to {MAX_OUTPUT_TOKENS} (the bench pool's max_model_len is 256), "
                         f"got {args.output_tokens}")
    if args.max_retries is None:
        args.max_retries = 2 if args.client == "sdk" else 8
    if args.ideal is not None:
        print(ideal_table(args, rates, modes))
        return 0
    if args.quick:
        args.duration = min(args.duration, 10.0)
    with tempfile.TemporaryDirectory() as tmp:
        results = [asyncio.run(run_mode(mode, rate, args, Path(tmp))) for rate in rates for mode in modes]
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    sys.stdout.flush()
    return 0
