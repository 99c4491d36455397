"""`cliffguard bench admission`: the credit queue vs reject-when-full, on the same overload.

Starts `cliffguard serve` twice on the same pool (the builtin model, a KV cache small enough that a
handful of requests fill it) and drives each from outside over HTTP with the same open-loop load:
chat requests arriving as a Poisson process faster than the pool can serve them, each with a fixed
output length (`ignore_eos`), same seed, same prompts.

- `queue` (cliffguard's default): a request that does not fit the free KV credits waits at the
  gateway and is admitted the moment it fits.
- `reject`: the same pool with `max_queue_seconds: 0`: a request that does not fit now gets 429, and
  its client retries with capped exponential back-off and full jitter (what OpenAI's and most HTTP
  clients do), giving up after `--max-retries`.

Per mode: requests answered / rejected for good, goodput (answered requests and output tokens per
second from the first arrival to the last answer or give-up), e2e latency p50/p99 as the user sees
it (first send to final answer, back-offs included), wasted attempts (429s), and how idle the pool
sat over the run, scraped every 0.25 s and averaged over the makespan: KV idle (1 -
`cliffguard_kv_cache_usage_perc`, blocks really in use) and credits idle (credits no admitted
request holds: what reject-when-full leaves unused while its clients back off).
`--quick` runs a short load (about a minute per mode on a 2-core CPU) for a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.live import LiveServer
from bench.serve import latency_stats

MODEL = "builtin:smollm2-135m-instruct"
WORDS = ("cliff", "river", "stone", "lamp", "orbit", "maple", "copper", "harbor", "signal", "window", "garden",
         "thunder", "violet", "engine", "summit", "canyon")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=4.0, help="request arrivals per second (default 4: an overload)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default 30)")
    p.add_argument("--output-tokens", type=int, default=48, help="tokens each request generates (default 48)")
    p.add_argument("--kv-cache", default="32MiB", help="the pool's KV cache (default 32MiB: a few requests "
                   "fill it)")
    p.add_argument("--max-retries", type=int, default=8, help="reject mode: retries before a client gives up "
                   "(default 8)")
    p.add_argument("--backoff", type=float, default=0.5, help="reject mode: first back-off in seconds, doubled "
                   "per retry, capped at 8 s, full jitter (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and back-off jitter (default 0)")
    p.add_argument("--modes", default="queue,reject", help="comma-separated: queue, reject (default both)")
    p.add_argument("--quick", action="store_true", help="short load for a test (10 s of arrivals)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def pools_yaml(mode: str, args: argparse.Namespace) -> str:
    queue = "    max_queue_seconds: 0\n" if mode == "reject" else ""
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


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(n)]


async def _one(session, url: str, prompt: str, out: Outcome, args: argparse.Namespace, rng: random.Random,
               start: float) -> None:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0}
    for attempt in range(args.max_retries + 1):
        out.attempts += 1
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            payload = await r.json(content_type=None)
            out.status = r.status
        if out.status == 200:
            out.tokens = payload["usage"]["completion_tokens"]
            break
        out.error = str(payload.get("error", {}).get("code"))
        if out.status != 429 or attempt == args.max_retries:
            break
        await asyncio.sleep(rng.uniform(0, min(8.0, args.backoff * 2 ** attempt)))
    out.done = time.perf_counter() - start


async def _scrape(session, url: str, scrapes: Scrapes, start: float) -> None:
    """Every 0.25 s: the fraction of the pool's blocks in use and of its credits held."""
    from prometheus_client.parser import text_string_to_metric_families

    while True:
        try:
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                      if s.labels.get("pool") == "chat"}
            held = 1 - values["cliffguard_kv_credits_free"] / values["cliffguard_kv_credits_total"]
            scrapes.samples.append((time.perf_counter() - start, values["cliffguard_kv_cache_usage_perc"], held))
        except (OSError, KeyError):
            pass
        await asyncio.sleep(0.25)


async def run_mode(mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import aiohttp

    path = folder / f"{mode}.yaml"
    path.write_text(pools_yaml(mode, args))
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t > args.duration:
            break
        arrivals.append(t)
    prompts = _prompts(len(arrivals), args.seed)
    outcomes = [Outcome(a) for a in arrivals]
    scrapes = Scrapes()
    with LiveServer(path, args=["--data-dir", str(folder / f"{mode}-data")]) as server:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            start = time.perf_counter()
            scraper = asyncio.create_task(_scrape(session, server.url, scrapes, start))

            async def later(out: Outcome, prompt: str, i: int) -> None:
                await asyncio.sleep(max(0.0, out.arrival - (time.perf_counter() - start)))
                await _one(session, server.url, prompt, out, args, random.Random(args.seed * 1000 + i), start)

            await asyncio.gather(*(later(o, p, i) for i, (o, p) in enumerate(zip(outcomes, prompts))))
            scraper.cancel()
    return summarize(mode, outcomes, scrapes)


def summarize(mode: str, outcomes: list[Outcome], scrapes: Scrapes) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200]
    makespan = max(o.done for o in outcomes) - min(o.arrival for o in outcomes)
    window = [(u, h) for t, u, h in scrapes.samples if t <= makespan + outcomes[0].arrival]
    e2e = latency_stats([o.done - o.arrival for o in ok])
    return {"mode": mode, "requests": len(outcomes), "answered": len(ok),
            "rejected": sum(1 for o in outcomes if o.status != 200),
            "wasted_attempts": sum(o.attempts for o in outcomes) - len(ok),
            "makespan_s": makespan, "goodput_rps": len(ok) / makespan,
            "goodput_tokens_s": sum(o.tokens for o in ok) / makespan,
            "e2e_p50_s": e2e["p50"], "e2e_p99_s": e2e["p99"],
            "kv_idle_fraction": 1 - sum(u for u, _ in window) / len(window) if window else None,
            "credits_idle_fraction": 1 - sum(h for _, h in window) / len(window) if window else None,
            "errors": sorted({o.error for o in outcomes if o.status != 200})}


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<8}{'answered':>9}{'rejected':>9}{'429s':>7}{'req/s':>8}{'tok/s':>8}{'e2e p50':>9}"
            f"{'e2e p99':>9}{'KV idle':>9}{'credits idle':>14}")
    rows = [head]
    for r in results:
        idle = "-" if r["kv_idle_fraction"] is None else f"{r['kv_idle_fraction']:.0%}"
        credits = "-" if r["credits_idle_fraction"] is None else f"{r['credits_idle_fraction']:.0%}"
        rows.append(f"{r['mode']:<8}{r['answered']:>9}{r['rejected']:>9}{r['wasted_attempts']:>7}"
                    f"{r['goodput_rps']:>8.2f}{r['goodput_tokens_s']:>8.1f}{r['e2e_p50_s']:>8.1f}s"
                    f"{r['e2e_p99_s']:>8.1f}s{idle:>9}{credits:>14}")
    by_mode = {r["mode"]: r for r in results}
    if "queue" in by_mode and "reject" in by_mode:
        q, j = by_mode["queue"], by_mode["reject"]
        rows.append(f"goodput queue / reject: {q['goodput_rps'] / j['goodput_rps']:.2f}x requests/s, "
                    f"{q['goodput_tokens_s'] / j['goodput_tokens_s']:.2f}x tokens/s; "
                    f"e2e p99 {q['e2e_p99_s'] / j['e2e_p99_s']:.2f}x")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("queue", "reject"):
            raise ValueError(f"--modes: unknown mode {mode!r}; use queue, reject")
    for name in ("rate", "duration", "backoff"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name}: must be > 0, got {getattr(args, name)}")
    if args.quick:
        args.duration = min(args.duration, 10.0)
    with tempfile.TemporaryDirectory() as tmp:
        results = [asyncio.run(run_mode(mode, args, Path(tmp))) for mode in modes]
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    sys.stdout.flush()
    return 0
