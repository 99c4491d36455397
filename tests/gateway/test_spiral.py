"""Death-spiral detection in a live gateway: an undersized shared pool under mixed chat + long
load trips `cliffguard_death_spiral` and `/ready` reports it degraded; the split layout under the same
load does not trip.

The load reaches the device worker the way the gateway's own requests do (routed by the gateway, then
`pool.client.generate`), but without holding KV credits. Through HTTP a spiral cannot happen: every
admitted request holds credits for its prompt plus its whole max_tokens (docs/ADMISSION.md), so
admitted requests never preempt each other. The detector watches the engine's counters, whatever let
the load in; this is the path on which the pool can outgrow its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from engine.sampling import SamplingParams
from engine.stats import EngineStats, PoolStats
from gateway.monitoring.metrics import GatewayMetrics
from gateway.runtime import Gateway, SpiralWatch
from pools.spiral import SpiralConfig
from tests.gateway.test_app import _client, _metrics

# A 4 s window keeps the test short; tokens/s on a shared 2-core CI machine are noisy, hence a 25%
# tolerance. The tiny model stores 512 bytes of K/V per token, so 8 KiB is one block of 16 tokens.
SPIRAL = "death_spiral: {window_seconds: 4, min_preemptions_per_s: 0.5, tokens_tolerance: 0.25, clear_seconds: 1}"
NUM_CHATS, CHAT_TOKENS = 8, 48                      # 8 x ~56 tokens: 32 blocks at most
NUM_LONGS, LONG_PROMPT, LONG_TOKENS = 2, 100, 100   # 2 x ~205 tokens: 26 blocks at most


def _layout_yaml(model, pools: list[tuple[str, str, str, int]]) -> str:
    """A pool file for one CPU device: each pool as (name, route, kv_cache_bytes, max_num_seqs)."""
    text = "devices:\n  cpu: {device: cpu, memory: 256MiB, dtype: float32}\npools:\n"
    for name, route, kv, max_num_seqs in pools:
        text += (f"  - {{name: {name}, model: {model}, device: cpu, route: {route}, kv_cache_bytes: {kv}, "
                 f"max_num_seqs: {max_num_seqs}, max_model_len: 256, {SPIRAL}}}\n")
    return text


# One pool for both classes with 32 blocks (256 KiB) where they need 58: deliberately undersized.
SHARED = [("shared", "{}", "256KiB", 16)]
# Chat 48 blocks for its 32, rag 32 blocks for its 26: each class within its own partition.
SPLIT = [("chat", "{max_prompt_tokens: 64}", "384KiB", 16), ("rag", "{min_prompt_tokens: 65}", "256KiB", 4)]


class _MixedLoad:
    """Closed loops of chat (short prompt, short answer) and long (long prompt, long answer) requests,
    routed by the gateway and sent to the pool's device worker until `stop`."""

    def __init__(self, gateway: Gateway, model: str) -> None:
        self.gateway, self.model = gateway, model
        self.tasks: list[asyncio.Task] = []
        self.num_finished = 0

    def start(self) -> None:
        for i in range(NUM_CHATS):
            self.tasks.append(asyncio.create_task(self._loop(lambda n, i=i: f"hello {i} {n}", CHAT_TOKENS)))
        for i in range(NUM_LONGS):
            # distinct from the first token on, so the prefix cache shares no block between them
            self.tasks.append(asyncio.create_task(self._loop(lambda n, i=i: f"{i} {n}" + " b" * LONG_PROMPT,
                                                             LONG_TOKENS)))

    async def _loop(self, prompt, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        n = 0
        while True:
            pool, ids = await self.gateway.route_prompt(self.model, prompt(n))
            async for out in pool.client.generate(ids, params, pool=pool.name):
                if out.finished:
                    assert out.error is None, out.error
                    self.num_finished += 1
            n += 1

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        errors = [r for r in results if not isinstance(r, asyncio.CancelledError)]
        assert not errors, errors


async def _scrape(client) -> dict[str, dict[tuple, float]]:
    return _metrics(await (await client.get("/metrics")).text())


def _spiral_gauge(metrics, pool: str) -> float:
    return metrics["cliffguard_death_spiral"][(("pool", pool), ("replica", "0"))]


def _preemptions(metrics, pool: str) -> float:
    return sum(v for k, v in metrics["cliffguard_num_preemptions_total"].items() if ("pool", pool) in k)


async def test_an_undersized_shared_pool_under_mixed_load_trips_the_death_spiral_gauge(
        aiohttp_client, tmp_path, tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="cliffguard.gateway")
    client, gateway = await _client(aiohttp_client, _layout_yaml(tiny_model, SHARED), tmp_path)
    before = await _scrape(client)
    assert _spiral_gauge(before, "shared") == 0
    assert (await (await client.get("/ready")).json())["pools"] == {"shared": "ok"}

    load = _MixedLoad(gateway, tiny_model.name)
    load.start()
    try:
        for _ in range(150):                 # the window is 4 s; it trips in about 6 s, give it up to 30 s
            await asyncio.sleep(0.2)
            during = await _scrape(client)
            if _spiral_gauge(during, "shared") == 1:
                break
        else:
            raise AssertionError(f"never tripped: {gateway.spiral.detectors['shared', 0].state}")
        r = await client.get("/ready")
        body = await r.json()
    finally:
        await load.stop()
    assert _preemptions(during, "shared") > 0
    # degraded, still serving: 200, the pool named with its reason and numbers
    assert r.status == 200 and body["status"] == "degraded" and body["devices"] == {"cpu": "ready"}
    assert body["pools"]["shared"].startswith("degraded: death spiral: ")
    assert "preemptions/s over 4 s" in body["pools"]["shared"] and "generated tokens/s" in body["pools"]["shared"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("pool shared: death spiral: ") for m in warnings), warnings

    # the load has stopped: the idle pool's detector keeps judging, and clears (INFO line, gauge 0)
    for _ in range(100):
        await asyncio.sleep(0.2)
        if not gateway.spiral.degraded():
            break
    after = await _scrape(client)
    assert _spiral_gauge(after, "shared") == 0
    body = await (await client.get("/ready")).json()
    assert body["status"] == "ready" and body["pools"] == {"shared": "ok"}
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("pool shared: death spiral cleared: ") for m in infos), infos


async def test_the_split_layout_under_the_same_load_does_not_trip(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, _layout_yaml(tiny_model, SPLIT), tmp_path)
    load = _MixedLoad(gateway, tiny_model.name)
    load.start()
    seen = []
    try:
        for _ in range(28):                  # 7 s: past a window and a half, longer than the shared pool takes to trip
            await asyncio.sleep(0.25)
            metrics = await _scrape(client)
            seen.append((_spiral_gauge(metrics, "chat"), _spiral_gauge(metrics, "rag")))
        body = await (await client.get("/ready")).json()
    finally:
        await load.stop()
    assert load.num_finished > NUM_CHATS     # the load ran
    assert set(seen) == {(0, 0)}
    assert _preemptions(metrics, "chat") == _preemptions(metrics, "rag") == 0
    assert body["status"] == "ready" and body["pools"] == {"chat": "ok", "rag": "ok"}
    detectors = gateway.spiral.detectors
    assert detectors["chat", 0].state.window is not None and detectors["rag", 0].state.window is not None   # judged


def _report(taken_at: float, preemptions: int, tokens: int, running: int = 1) -> EngineStats:
    pool = PoolStats(num_running=running, num_waiting=0, num_swapped=0, num_blocks=8, num_free_blocks=0,
                     num_cached_free_blocks=0, kv_cache_usage=1.0, max_num_seqs=8, cpu_swap_usage=0.0,
                     num_recompute_preemptions=preemptions, num_generated_tokens=tokens)
    return EngineStats(num_requests=running, pools={"p": pool}, taken_at=taken_at)


def test_the_watch_feeds_each_report_once_and_an_idle_pool_at_the_current_time(caplog):
    caplog.set_level(logging.INFO, logger="cliffguard.gateway")
    client = SimpleNamespace(latest_stats=None, is_alive=True)
    spec = SimpleNamespace(death_spiral=SpiralConfig(window_seconds=4, min_preemptions_per_s=1, clear_seconds=2))
    off = SimpleNamespace(death_spiral=SpiralConfig(enabled=False))
    pools = {"p": SimpleNamespace(is_upstream=False, spec=spec, clients=[client], num_replicas=1),
             "quiet": SimpleNamespace(is_upstream=False, spec=off, clients=[client], num_replicas=1)}
    metrics = GatewayMetrics()
    watch = SpiralWatch(pools, metrics)
    assert list(watch.detectors) == [("p", 0)] and list(watch.pools) == ["p", "quiet"]   # "quiet": detection off
    gauge = metrics.death_spiral.labels(pool="p", replica="0")
    watch.check(100.0)                                  # no report yet: nothing to feed
    for i in range(17):                                 # 4 s of reports: 2 preemptions/s, 50 tokens/s
        client.latest_stats = _report(100.0 + i / 4, i // 2, 12 * i)
        watch.check(100.0 + i / 4 + 0.1)
        watch.check(100.0 + i / 4 + 0.2)                # the same report again: not fed twice
    assert gauge._value.get() == 1 and watch.degraded()["p"].startswith("death spiral: ")
    assert "quiet" not in watch.degraded()
    busy = watch.detectors["p", 0].state
    watch.check(200.0)                                  # busy and no new report: not extrapolated
    assert watch.detectors["p", 0].state == busy
    client.latest_stats = _report(104.25, 8, 204, running=0)   # the pool fell idle ...
    for now in (105.0, 106.0, 107.0, 108.0, 109.0, 110.0, 111.0):
        watch.check(now)                                # ... its totals are fed at the current time
    assert gauge._value.get() == 0 and watch.degraded() == {}
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in messages] == ["WARNING", "INFO"]
    assert messages[0][1].startswith("pool p: death spiral: ") and "preemptions/s over 4 s" in messages[0][1]
    assert messages[1][1].startswith("pool p: death spiral cleared: ")


def test_a_spiralling_replica_whose_worker_died_clears_while_none_runs(caplog):
    """The busy pool's last report is never fed again once its worker dies: the alert (and `/ready`'s degraded)
    held for the whole restart, or for good where the worker never came back."""
    caplog.set_level(logging.INFO, logger="cliffguard.gateway")
    client = SimpleNamespace(latest_stats=None, is_alive=True)
    spec = SimpleNamespace(death_spiral=SpiralConfig(window_seconds=4, min_preemptions_per_s=1, clear_seconds=2))
    pool = SimpleNamespace(is_upstream=False, spec=spec, clients=[client], num_replicas=1)
    metrics = GatewayMetrics()
    watch = SpiralWatch({"p": pool}, metrics)
    for i in range(17):
        client.latest_stats = _report(100.0 + i / 4, i // 2, 12 * i)
        watch.check(100.0 + i / 4)
    assert watch.degraded() and metrics.death_spiral.labels(pool="p", replica="0")._value.get() == 1
    client.is_alive = False                                # SIGKILL: its last (busy) report stays, the restart waits
    watch.check(105.0)
    assert watch.degraded() == {} and metrics.death_spiral.labels(pool="p", replica="0")._value.get() == 0
    assert caplog.records[-1].getMessage() == "pool p: death spiral cleared: its worker is not running"
    pool.clients[0] = SimpleNamespace(latest_stats=None, is_alive=True)   # the restart: a new client, nothing heard yet
    watch.check(106.0)
    assert watch.degraded() == {}
    for i in range(17):                                   # the new worker spirals too: tripped again
        pool.clients[0].latest_stats = _report(200.0 + i / 4, i // 2, 12 * i)
        watch.check(200.0 + i / 4)
    assert watch.degraded()


def test_a_wall_clock_step_back_does_not_hold_the_watch_tripped():
    """Reports are timed by the gateway's monotonic clock when seen: after the worker's wall clock steps back
    an hour (an NTP step, a VM resumed), its reports still count and a recovered pool clears."""
    client = SimpleNamespace(latest_stats=None, is_alive=True)
    spec = SimpleNamespace(death_spiral=SpiralConfig(window_seconds=4, min_preemptions_per_s=1, clear_seconds=2))
    watch = SpiralWatch({"p": SimpleNamespace(is_upstream=False, spec=spec, clients=[client], num_replicas=1)},
                        GatewayMetrics())
    for i in range(17):                                 # 4 s of spiralling reports
        client.latest_stats = _report(1_000_000.0 + i / 4, i // 2, 12 * i)
        watch.check(50.0 + i / 4)
    assert watch.degraded()
    for i in range(1, 40):                              # the clock stepped back: calm, busy reports
        client.latest_stats = _report(1_000_000.0 - 3600 + i / 4, 8, 204 + 50 * i)
        watch.check(54.0 + i / 4)
    assert watch.degraded() == {}

