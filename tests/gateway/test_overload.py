"""Overload said out loud, in a live gateway: a pool offered far more than its KV lets it run turns
`cliffguard_device_overloaded` on, with a WARNING and `/ready` detail, and off again once the load is
gone; an idle device exports 0 with its capacity beside it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pools import demand
from tests.gateway.test_app import _client, _metrics

# The tiny model stores 512 bytes of K/V per token: 48 KiB is 96 tokens, room for one request of
# ~10 prompt tokens and 64 out at a time, so 120 of them at once queue for seconds: about 10 s of steps on the
# 2-core VM (48 took 4 s by 2026-12-01, shorter than a backlog held ON_SECONDS, and the test never saw overload).
YAML = """devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - {{name: solo, model: {model}, device: cpu, kv_cache_bytes: 48KiB, max_model_len: 96, avg_len: 80, max_queue_seconds: 10}}
"""
NUM_REQUESTS, MAX_TOKENS = 120, 64


async def _gauge(client, name: str, **labels: str) -> float:
    metrics = _metrics(await (await client.get("/metrics")).text())
    return metrics[name][tuple(sorted(labels.items()))]


@pytest.mark.slow   # ~20 s of load; the verdict's arithmetic: tests/pools/test_demand.py; its watch: test_metrics_outages.py
async def test_a_pool_offered_more_than_it_can_run_is_said_overloaded_and_clears(
        aiohttp_client, tmp_path, tiny_model, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="cliffguard.overload")
    monkeypatch.setattr(demand, "OFF_SECONDS", 0.5)
    client, gateway = await _client(aiohttp_client, YAML.format(model=tiny_model), tmp_path)
    gateway.pools["solo"].admission.offered.window = 6.0      # the arrivals leave the window soon after
    assert await _gauge(client, "cliffguard_device_overloaded", device="cpu") == 0
    body = {"model": tiny_model.name, "prompt": "count with me", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    requests = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(NUM_REQUESTS)]
    try:
        for _ in range(100):      # the queue is ~120 requests long; the wait bound is 5 s
            await asyncio.sleep(0.2)
            if gateway.overload.overloaded():
                break
        else:
            raise AssertionError(f"never overloaded: {gateway.overload.last['cpu'].describe()}")
        assert await _gauge(client, "cliffguard_device_overloaded", device="cpu") == 1
        assert await _gauge(client, "cliffguard_pool_oldest_waiting_seconds", pool="solo") > 2
        assert await _gauge(client, "cliffguard_device_replicas_needed", device="cpu") >= 1
        ready = await client.get("/ready")
        detail = await ready.json()
        assert ready.status == 200 and detail["status"] == "degraded"
        assert detail["overloaded"]["cpu"].startswith("overloaded: ") and "solo" in detail["overloaded"]["cpu"]
    finally:
        answers = await asyncio.gather(*requests)
    assert {r.status for r in answers} <= {200, 503}           # past max_queue_seconds: 503, never lost
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("device cpu overloaded: ") for m in warnings), warnings

    for _ in range(100):          # nothing offered, nobody waiting: it clears
        await asyncio.sleep(0.2)
        if not gateway.overload.overloaded():
            break
    assert await _gauge(client, "cliffguard_device_overloaded", device="cpu") == 0
    assert (await (await client.get("/ready")).json())["overloaded"] == {}
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("device cpu no longer overloaded: ") for m in infos), infos
    # the capacity beside the gauge comes from the worker's measured steps
    assert await _gauge(client, "cliffguard_pool_capacity_tokens_per_second", pool="solo", phase="decode") > 0
