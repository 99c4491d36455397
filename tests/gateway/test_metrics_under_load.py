"""`/metrics` under load answers fast and fresh: it reads the stats the device worker pushes with its
step outputs, never waiting for a model step (live `cliffguard serve` on the default config)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"


def _samples(text: str, name: str) -> dict[str, float]:
    """{label string: value} of one metric family in a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for _ in resp.content:
            pass


async def _scrape_under_load(url: str) -> list[tuple[float, str]]:
    rng = random.Random(1)
    long_prompt = [rng.randrange(100, 40000) for _ in range(5000)]     # routed to rag (> 4096 tokens)
    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(_stream(session, url + "/v1/completions", {
            "model": MODEL, "prompt": long_prompt, "max_tokens": 64, "stream": True}))]
        for i in range(4):
            load.append(asyncio.create_task(_stream(session, url + "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to 200."}],
                "max_tokens": 200, "stream": True, "ignore_eos": True})))
        await asyncio.sleep(1.0)                                        # the load is running
        scrapes = []
        for _ in range(12):
            started = time.perf_counter()
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            scrapes.append((time.perf_counter() - started, text))
            await asyncio.sleep(0.25)
        for task in load:
            task.cancel()                                               # the server aborts them
        await asyncio.gather(*load, return_exceptions=True)
    return scrapes


def test_metrics_answer_within_100_ms_under_load_with_fresh_stats(live_builtin_server):
    scrapes = asyncio.run(_scrape_under_load(live_builtin_server.url))
    times = sorted(t for t, _ in scrapes)
    assert times[-1] < 0.1, f"slowest /metrics scrape took {times[-1] * 1000:.0f} ms"
    running = [_samples(text, "cliffguard_num_requests_running") for _, text in scrapes]
    assert any(r.get("pool=rag,replica=0", 0) >= 1 for r in running), "no scrape saw the rag request running"
    assert any(r.get("pool=chat,replica=0", 0) >= 1 for r in running), "no scrape saw a chat request running"
    ages = [_samples(text, "cliffguard_stats_age_seconds")["device=default,replica=0"] for _, text in scrapes]
    assert min(ages) < 1.0 and max(ages) < 5.0, f"stats ages {ages}"
    steps = [_samples(text, "cliffguard_engine_steps_total")["device=default,replica=0"] for _, text in scrapes]
    assert steps[-1] > steps[0], "the step counter did not move while the load ran"
