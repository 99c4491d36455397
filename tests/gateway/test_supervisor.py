"""gateway.workers.supervisor: a device worker killed under load is noticed, reported and restarted; requests
that arrive meanwhile wait for it; a worker that never loaded stays failed; a remote replica whose first
connection failed is tried again with the back-off (and a reconnection to the same process keeps its
prefix-cache record), while one that reports its load failed stays failed."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from engine.client import EngineDeadError
from engine.config import CacheConfig, EngineConfig, PoolConfig
from engine.remote import ReplicaServer
from gateway.app import create_app
from gateway.monitoring.metrics import GatewayMetrics
from gateway.openai.errors import ApiError
from gateway.runtime import Gateway
from gateway.workers.deaths import LOSS
from gateway.workers.supervisor import Backoff, DeviceSupervisor
from pools.config.yaml_file import load_config
from tests.conftest import started_replica
from tests.gateway.conftest import pools_yaml
from tests.gateway.test_app import _client, _metrics, _model, _stream_text

FAST = Backoff(initial_seconds=0.2, max_seconds=1.0)
KILLED = "device worker process exited (signal 9, SIGKILL)"


async def _wait_ready_status(client, status: int, timeout: float = 60.0) -> dict:
    for _ in range(int(timeout / 0.05)):
        r = await client.get("/ready")
        if r.status == status:
            return await r.json()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"/ready never answered {status}")


async def test_a_killed_worker_is_reported_restarted_and_requests_wait_for_it(aiohttp_client, tmp_path, tiny_model,
                                                                             caplog):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    gateway.supervisors["cpu"][0].backoff = FAST
    old = gateway.clients["cpu"][0]
    chat = "/v1/chat/completions"
    body = {"model": _model(tiny_model), "messages": [{"role": "user", "content": "Tell me about cliffs."}],
            "max_tokens": 160, "ignore_eos": True, "temperature": 0}

    # one streaming and one non-streaming request in flight
    stream = await client.post(chat, json=dict(body, stream=True))
    assert stream.status == 200 and (await stream.content.readline()).startswith(b"data: ")
    whole = asyncio.create_task(client.post(chat, json=body))
    while old.num_in_flight < 2:
        await asyncio.sleep(0.01)

    caplog.set_level(logging.ERROR, logger="cliffguard.gateway")
    os.kill(old.pid, signal.SIGKILL)

    _, chunks = await _stream_text(stream)     # the stream ends with an error event, then [DONE]
    assert chunks[-1]["error"]["code"] == "engine_dead" and KILLED in chunks[-1]["error"]["message"]
    ready = await _wait_ready_status(client, 503)
    assert ready["devices"] == {"cpu": f"restarting: {KILLED}"}
    assert any(rec.levelno == logging.ERROR and "device cpu" in rec.getMessage() and KILLED in rec.getMessage()
               for rec in caplog.records)

    # a request sent while the worker restarts waits for it instead of failing
    waiting = asyncio.create_task(client.post(chat, json=dict(body, max_tokens=4)))
    await asyncio.sleep(0.3)
    assert not waiting.done() and (await client.get("/ready")).status == 503
    r = await waiting
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
    r = await whole   # its client had seen nothing: it ran again on the restarted worker, answered once
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 160
    assert (await _wait_ready_status(client, 200))["devices"] == {"cpu": "ready"}

    new = gateway.clients["cpu"][0]
    assert new is not old and new.pid != old.pid and not old.is_alive and old.exitcode == -9
    assert all(pool.client is new for pool in gateway.pools.values())
    m = _metrics(await (await client.get("/metrics")).text())
    assert m["cliffguard_worker_restarts_total"][(("device", "cpu"), ("replica", "0"))] == 1
    stats = await new.stats(check=True)   # runs check_integrity in the worker
    assert stats.num_requests == 0
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools.values())


async def test_a_patient_request_waits_for_its_device_however_long():
    """A background Response's run waits for a replica of its device past device_wait_seconds (it was kept
    failed, 503 pool_unavailable, when a restart took longer); any other request gets that 503, counted from
    its arrival (`spent`: the waits for its other pools' devices; each wait had a limit of its own)."""
    ready = asyncio.Event()

    class Restarting:
        name, state, is_ready = "cpu", "restarting", False

        async def wait_ready(self) -> None:
            await ready.wait()

    gateway = SimpleNamespace(supervisors={"cpu": [Restarting()]}, device_waits={},
                              config=SimpleNamespace(gateway=SimpleNamespace(device_wait_seconds=0.05)))
    pool = SimpleNamespace(name="chat", device="cpu", spec=SimpleNamespace(max_queue_seconds=50))
    with pytest.raises(ApiError) as info:
        await Gateway.wait_device(gateway, pool)
    assert info.value.code == "pool_unavailable" and "cpu: restarting" in info.value.message
    waiting = asyncio.ensure_future(Gateway.wait_device(gateway, pool, patient=True))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    # a request of two pools on two devices restarting: the second wait ends at the one deadline, not its own
    gateway.config.gateway.device_wait_seconds = 2.0
    started = time.monotonic()
    with pytest.raises(ApiError):
        await Gateway.wait_device(gateway, pool, spent=1.9)
    assert time.monotonic() - started < 1.0
    ready.set()
    await asyncio.wait_for(waiting, 5)


async def test_a_request_waiting_for_its_device_takes_a_parked_slot_started_after_it_came(monkeypatch):
    """Slot 0 restarting for ever, slot 1 parked (scaled down before: its stop's failure still set): the
    autoscaler starts slot 1 for those who wait, stops it, starts it again, and they take it once it is ready
    (they waited on slot 0 alone, then on slot 1's first start: a 503 at the deadline, a patient one for ever).
    With every started slot failed and the parked one still parked, the wait ends with the started one's
    failure, not the stop's."""
    from gateway.workers import device_wait

    monkeypatch.setattr(device_wait, "RESCAN_SECONDS", 0.05)   # each phase below lasts three rescans

    class Slot:   # as DeviceSupervisor.wait_ready: ready, or its failure (a stop's too)
        def __init__(self, state: str, failure: str | None = None) -> None:
            self.name, self.state, self.is_ready, self.failure = "cpu", state, False, failure

        async def wait_ready(self) -> None:
            while not self.is_ready:
                if self.failure:
                    raise RuntimeError(self.failure)
                await asyncio.sleep(0.01)

    for patient in (False, True):
        slots = [Slot("restarting"), Slot("stopped", "the gateway is shutting down")]
        gateway = SimpleNamespace(supervisors={"cpu": slots}, device_waits={},
                                  config=SimpleNamespace(gateway=SimpleNamespace(device_wait_seconds=5.0)))
        pool = SimpleNamespace(name="chat", device="cpu", spec=SimpleNamespace(max_queue_seconds=50))
        waiting = asyncio.ensure_future(Gateway.wait_device(gateway, pool, patient=patient))
        await asyncio.sleep(0.05)
        slots[1].state, slots[1].failure = "loading", None    # the autoscaler starts the parked slot
        await asyncio.sleep(0.15)
        slots[1].state, slots[1].failure = "stopped", "the gateway is shutting down"   # and stops it
        await asyncio.sleep(0.15)
        slots[1].state, slots[1].failure = "loading", None    # starts it again
        await asyncio.sleep(0.15)
        slots[1].state, slots[1].is_ready = "ready", True
        await asyncio.wait_for(waiting, 2)
    slots = [Slot("restarting"), Slot("stopped", "the gateway is shutting down")]
    gateway.supervisors = {"cpu": slots}
    waiting = asyncio.ensure_future(Gateway.wait_device(gateway, pool, patient=True))
    await asyncio.sleep(0.05)
    slots[0].failure = "device 'cpu' failed to start: out of memory"
    slots[0].state = f"failed: {slots[0].failure}"
    with pytest.raises(ApiError, match="failed to start: out of memory"):
        await asyncio.wait_for(waiting, 2)


async def test_a_remote_replica_whose_first_load_failed_is_removed_only_where_this_gateway_placed_it():
    """Its actor holds its group's resources and the cluster's record of its config: removed when this gateway
    placed it since `since` (the supervisor's start), or, leading the device, restarted it in vain (an adopted
    one: it held its GPUs failed for good), never one placed before otherwise (another gateway's, which may
    serve it), nor for a failure that is not its load's."""
    class Link:
        placed_at, removed, leads = 0.0, 0, False

        async def remove(self) -> None:
            self.removed += 1

        def may_place(self) -> bool:
            return self.leads

    link = Link()
    supervisor = DeviceSupervisor("cpu", None, [], GatewayMetrics(), link=link)
    load_failed = RuntimeError("device worker failed to start: FileNotFoundError: no weights")
    for placed_at, exc, removed in ((5.0, load_failed, 1), (3.0, load_failed, 0),
                                    (5.0, TimeoutError("timed out"), 0)):
        link.placed_at, link.removed = placed_at, 0
        await supervisor._release_failed(exc, since=4.0)
        assert link.removed == removed, (placed_at, exc)
    supervisor._reloaded = True                  # `_reload_adopted` restarted the adopted one; it failed again
    for leads, removed in ((False, 0), (True, 1)):
        link.placed_at, link.leads, link.removed = 3.0, leads, 0
        await supervisor._release_failed(load_failed, since=4.0)
        assert link.removed == removed, leads


async def test_an_autoscaled_device_whose_started_replicas_failed_answers_at_once():
    """Its parked slot, never started, is not waited for: the request (and a patient one, which waited for
    ever) gets the failed start's 503 at once, not a retry-later one after device_wait_seconds."""
    metrics = GatewayMetrics()
    failed, parked = (DeviceSupervisor("cpu", None, [], metrics, replica=i) for i in range(2))
    failed._failure = "device 'cpu/0' failed to start: RuntimeError: no such model"
    failed._task = asyncio.get_running_loop().create_future()   # started, ended
    failed._task.set_result(None)
    assert (failed.state.split(":")[0], parked.state) == ("failed", "stopped")
    gateway = SimpleNamespace(supervisors={"cpu": [failed, parked]}, device_waits={},
                              config=SimpleNamespace(gateway=SimpleNamespace(device_wait_seconds=30)))
    pool = SimpleNamespace(name="chat", device="cpu", spec=SimpleNamespace(max_queue_seconds=0))
    for patient in (False, True):
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(Gateway.wait_device(gateway, pool, patient=patient), 2)
        assert info.value.code == "pool_unavailable" and "no such model" in info.value.message
        assert "Retry-After" not in info.value.headers


async def test_a_worker_that_fails_its_first_start_stays_failed(aiohttp_client, tmp_path, tiny_model):
    copy = tmp_path / "broken"
    shutil.copytree(tiny_model, copy)
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(copy))
    gateway = Gateway.from_config(load_config(path))
    gateway.backoff = FAST
    for f in copy.glob("*.safetensors*"):
        f.unlink()
    client = await aiohttp_client(create_app(gateway))
    r = await client.post("/v1/chat/completions", json={"model": "broken", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 503 and (await r.json())["error"]["code"] == "pool_unavailable"
    await asyncio.sleep(2 * FAST.initial_seconds)
    state = (await _wait_ready_status(client, 503))["devices"]["cpu"]
    assert state.startswith("failed: device 'cpu' failed to start:"), state
    supervisor = gateway.supervisors["cpu"][0]
    assert supervisor.num_restarts == 0 and not supervisor.client.is_alive
    for pool in gateway.pools.values():   # a request queued for credits there turns to the same wait: its 503
        with pytest.raises(ApiError, match="failed to start") as raised:
            await pool.admission.on_down(False)
        assert raised.value.code == "pool_unavailable"


async def test_a_worker_not_loaded_within_start_timeout_seconds_failed_to_start_saying_so(aiohttp_client, tmp_path,
                                                                                       tiny_model, monkeypatch):
    """`gateway.start_timeout_seconds` bounds a first load (here 1 s against a 60-s one): the device fails saying
    what it waited for (asyncio's TimeoutError said nothing: 'failed to start: ' and no reason)."""
    from engine.faults import SLOW_LOAD_ENV

    monkeypatch.setenv(SLOW_LOAD_ENV, "60")
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model).replace("gateway: {", "gateway: {start_timeout_seconds: 1, ", 1))
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway))
    state = (await _wait_ready_status(client, 503, timeout=20))["devices"]["cpu"]
    while state == "loading":
        await asyncio.sleep(0.1)
        state = (await (await client.get("/ready")).json())["devices"]["cpu"]
    assert state == ("failed: device 'cpu' failed to start: not ready within gateway.start_timeout_seconds (1 s)")
    assert not gateway.supervisors["cpu"][0].client.is_alive
    with pytest.raises(ValueError, match=r"gateway\.start_timeout_seconds: must be > 0"):
        load_config(pools_yaml(tiny_model).replace("gateway: {", "gateway: {start_timeout_seconds: 0, ", 1), env={})


def test_a_ray_cluster_that_did_not_answer_is_asked_again_and_its_replicas_tried_again():
    """A gateway started before its Ray head listens: the failed connection is not every later call's answer (the
    device stayed failed after the head came up, /ready 503 for good), and its replicas are tried again with the
    back-off; a cluster the gateway cannot use at all (Ray missing) still fails the device."""
    from gateway.workers.ray_cluster import ClusterError, ClusterUnreachable, RayCluster

    cluster, calls = RayCluster("127.0.0.1:9"), []

    async def connect(timeout):
        calls.append(timeout)
        if len(calls) == 1:
            raise ClusterUnreachable("cannot reach the Ray cluster at '127.0.0.1:9': Connection refused")

    cluster._connect = connect

    async def main():
        with pytest.raises(ClusterUnreachable):
            await cluster.connect()
        await cluster.connect()
        await cluster.connect()   # connected: not asked again

    asyncio.run(main())
    assert len(calls) == 2
    remote = DeviceSupervisor("cpu", None, [], GatewayMetrics(), link=SimpleNamespace())
    assert remote._tries_again(ClusterUnreachable("no answer"))
    assert not remote._tries_again(ClusterError("placement ray needs Ray: pip install -e '.[ray]'"))


async def test_a_replica_being_stopped_says_stopped_not_restarting():
    """While `stop` waits for its worker to exit (a scale-down, the gateway stopping), the replica is `stopped`: its
    worker gone and no failure set, it read `restarting: device worker process exited` on /ready and in the
    replicas gauge at every scale-down."""
    supervisor = DeviceSupervisor("cpu", None, [], GatewayMetrics())
    gate = asyncio.Event()
    client = SimpleNamespace(is_alive=True, info=object())

    async def shutdown():
        client.is_alive = False   # the worker has exited; its reaping takes a moment
        await gate.wait()

    client.shutdown = shutdown
    supervisor.client, supervisor._was_ready = client, True
    supervisor._task = asyncio.ensure_future(asyncio.sleep(3600))
    assert supervisor.state == "ready"
    stopping = asyncio.ensure_future(supervisor.stop())
    await asyncio.sleep(0.05)
    assert not client.is_alive and supervisor.state == "stopped"
    gate.set()
    await stopping
    assert supervisor.state == "stopped"


async def test_a_replica_waiting_for_another_configs_claim_asks_again_no_sooner_than_the_recheck(caplog):
    """A Ray slot held back by another config's claim (`ClaimPending`, the cluster's answer until its recheck)
    waits RECHECK_SECONDS between tries even with a zero back-off: it spun, a new client and a log line each
    pass, thousands a second."""
    from gateway.workers.config_claim import ClaimPending
    from gateway.workers.ray_cluster import RECHECK_SECONDS

    calls = []

    class Claimed(_Link):
        async def endpoint(self, timeout: float):
            calls.append(time.monotonic())
            raise ClaimPending("device 'cpu' is claimed by another config's gateway (digest cccc0000)")

    pool = SimpleNamespace(name="chat", num_replicas=1, clients=[None], admission=_Admission())
    supervisor = DeviceSupervisor("cpu", EngineConfig(model="m", device="cpu"), [pool], GatewayMetrics(),
                                  backoff=Backoff(initial_seconds=0, max_seconds=0), link=Claimed(None))
    supervisor.start()
    await asyncio.sleep(0.3)
    state = supervisor.state
    await supervisor.stop()
    assert len(calls) == 1 and "claimed by another config" in state, (len(calls), state)
    assert RECHECK_SECONDS >= 1


def test_backoff_doubles_up_to_its_cap_and_checks_its_fields():
    backoff = Backoff()
    assert [backoff.delay(i) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay(10_000) == 30
    with pytest.raises(ValueError, match="max_seconds"):
        Backoff(initial_seconds=5, max_seconds=1)
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)


def test_backoff_delay_never_overflows_and_its_factor_is_bounded():
    """`factor ** attempt` overflowed a float (factor 1e5, some restarts in): the OverflowError ended the
    replica's supervisor, which then never restarted its worker. The factor is at most 100, and the delay is
    found in log space whatever the attempt."""
    assert Backoff(factor=100, max_seconds=1e300).delay(10_000) == 1e300
    assert Backoff(initial_seconds=1e-300, factor=100, max_seconds=1e300).delay(200) == pytest.approx(1e100)
    assert Backoff(initial_seconds=0, max_seconds=0).delay(10**9) == 0
    # "restart at once" is the first restart: the next ones grow (they were all at once: a tight loop)
    assert [Backoff(initial_seconds=0).delay(a) for a in range(4)] == [0.0, 0.1, 0.2, 0.4]
    with pytest.raises(ValueError, match=r"^factor: must be <= 100"):
        Backoff(factor=1e5)


def test_restart_backoff_comes_from_yaml_and_bad_values_name_the_key():
    base = "pools: [{name: p, model: builtin:smollm2-135m-instruct, kv_share: 1.0}]\n"
    config = load_config("gateway: {restart_backoff: {initial_seconds: 0.5, max_seconds: 4}}\n" + base, env={})
    assert config.gateway.restart_backoff == Backoff(initial_seconds=0.5, max_seconds=4)
    assert [config.gateway.restart_backoff.delay(i) for i in range(5)] == [0.5, 1, 2, 4, 4]
    assert load_config(base, env={}).gateway.restart_backoff == Backoff()
    for bad, message in (("{factor: 0.5}", "gateway.restart_backoff.factor: must be >= 1"),
                         ("{factor: 100000}", "gateway.restart_backoff.factor: must be <= 100"),
                         ("{initial_seconds: x}", "gateway.restart_backoff.initial_seconds: expected a number"),
                         ("{max_seconds: .inf}", "gateway.restart_backoff.max_seconds: must be a finite number"),
                         ("{initial_seconds: 40}", "gateway.restart_backoff.max_seconds: must be >= initial_seconds"),
                         ("{jitter: 1}", "gateway.restart_backoff.jitter"),
                         ("5", "gateway.restart_backoff: expected an object")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(f"gateway: {{restart_backoff: {bad}}}\n" + base, env={})


def test_engine_counters_of_a_restarted_worker_keep_counting():
    from engine.stats import PoolStats
    from gateway.monitoring.metrics import GatewayMetrics

    metrics = GatewayMetrics()

    def computed(total):
        stats = PoolStats(num_running=0, num_waiting=0, num_swapped=0, num_blocks=8, num_free_blocks=8,
                          num_cached_free_blocks=0, kv_cache_usage=0.0, max_num_seqs=1, cpu_swap_usage=0.0,
                          num_computed_tokens=total)
        metrics.update_pool("chat", 0, stats, 1024)
        return metrics.computed_tokens.labels(pool="chat", replica="0")._value.get()

    assert computed(100) == 100
    assert computed(30) == 130      # the new worker started from 0: its 30 are new
    assert computed(50) == 150


# --- a remote replica's first connection ----------------------------------------------------------------

class _Admission:
    """What a pool's admission hears from the supervisor: each `replica_ready(replica, restarted)`."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, bool]] = []

    def replica_ready(self, replica: int, restarted: bool = True) -> None:
        self.ready.append((replica, restarted))


class _Link:
    """A `ReplicaLink` to an in-process `ReplicaServer`; its first `refusals` endpoints name a port nobody
    listens on (the first connections fail, as across a partition)."""

    name = "cpu/0"

    def __init__(self, server, refusals: int = 0) -> None:
        self.server, self.refusals = server, refusals
        self.status = "fixed address"
        self.calls = 0
        self.restarts: list[str] = []

    async def endpoint(self, timeout: float):
        self.calls += 1
        if self.calls <= self.refusals:
            with socket.socket() as probe:        # a free port, closed again: the connection is refused
                probe.bind(("127.0.0.1", 0))
                return "127.0.0.1", probe.getsockname()[1], self.server.key
        return (*self.server.address, self.server.key)

    async def watch(self) -> str:                 # no cluster manager here: its death notice never comes
        await asyncio.Event().wait()

    def restart(self, reason: str) -> None:
        self.restarts.append(reason)


def _replica_server(model) -> ReplicaServer:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", cache=CacheConfig(block_size=16),
                          pools=(PoolConfig(num_blocks=32),))
    return started_replica(config)


def _remote_supervisor(server, link: _Link) -> tuple[DeviceSupervisor, SimpleNamespace]:
    pool = SimpleNamespace(name="chat", num_replicas=1, clients=[None], admission=_Admission())
    supervisor = DeviceSupervisor("cpu", server.config, [pool], GatewayMetrics(), backoff=FAST, link=link,
                                  start_seconds=30)
    return supervisor, pool


def test_a_remote_replica_whose_first_connection_failed_is_tried_again_and_keeps_its_cache_on_reconnection(
        tiny_model, caplog):
    """... and its first death waits the first back-off, not the one its failed first tries grew to."""
    server = _replica_server(tiny_model)
    assert server.state == "ready"

    async def scenario():
        link = _Link(server, refusals=2)
        supervisor, pool = _remote_supervisor(server, link)
        states = []
        supervisor.start()
        try:
            ready = asyncio.ensure_future(supervisor.wait_ready())
            while not ready.done():
                states.append(supervisor.state)
                await asyncio.sleep(0.02)
            await ready
            assert link.calls == 3 and supervisor.is_ready and supervisor.num_restarts == 0
            assert any("the last try failed" in s and "Connect call failed" in s for s in states), states[-5:]
            assert pool.admission.ready == [(0, True)]            # the first worker ready: a new process
            first = supervisor.client
            first.lost("the connection dropped (a partition)")   # the same replica process, reached again
            while len(pool.admission.ready) < 2:
                await asyncio.sleep(0.02)
            assert supervisor.client is not first and supervisor.client.pid == first.pid
            assert pool.admission.ready[1] == (0, False)         # its cache is intact: the record stays
            assert supervisor.num_restarts == 1 and supervisor.deaths.of(first).cause == LOSS
            waits = [r.getMessage() for r in caplog.records if "worker died" in r.getMessage()]
            assert waits and waits[0].endswith(f"restarting in {FAST.delay(0):.1f} s"), waits
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


class _RemovableLink(_Link):
    """A `_Link` whose cluster manager says whether the replica was removed for good."""

    gone = False

    async def removed(self) -> bool:
        return self.gone


def test_a_drained_replica_that_was_removed_is_no_restart_but_a_crash_while_draining_is(tiny_model, caplog):
    """A follower gateway sees the replica the leader gateway drained and removed end: INFO, not an ERROR,
    and no restart counted. A draining replica that crashed (the cluster restarts it) counts as any other."""
    server = _replica_server(tiny_model)
    link = _RemovableLink(server)

    async def lose(supervisor, pool, reason: str) -> None:
        ready = len(pool.admission.ready)
        supervisor.client.lost(reason)
        while len(pool.admission.ready) == ready:                 # the stand-in link reaches the replica again
            await asyncio.sleep(0.02)

    async def scenario():
        supervisor, pool = _remote_supervisor(server, link)
        supervisor.start()
        try:
            await supervisor.wait_ready()
            supervisor.draining, link.gone = True, True
            await lose(supervisor, pool, "Ray reports the actor dead (ActorDiedError: removed)")
            restarts = supervisor.metrics.registry.get_sample_value(
                "cliffguard_worker_restarts_total", {"device": "cpu", "replica": "0"})
            assert supervisor.num_restarts == 0 and restarts == 0
            # the gateway's own removal: no death of a request in flight there (a loss counted against it)
            assert [d.cause for d in supervisor.deaths.deaths] == ["stopped"]
            link.gone = False
            await lose(supervisor, pool, "the connection dropped (a crash)")
            assert supervisor.num_restarts == 1 and [d.cause for d in supervisor.deaths.deaths] == ["stopped", "loss"]
        finally:
            await supervisor.stop()

    with caplog.at_level(logging.INFO, logger="cliffguard.gateway"):
        asyncio.run(scenario())
    said = {r.levelname for r in caplog.records if "ActorDiedError: removed" in r.getMessage()}
    assert said == {"INFO"} and any("drained replica was removed" in r.getMessage() for r in caplog.records)
    assert any(r.levelname == "ERROR" and "(a crash)" in r.getMessage() for r in caplog.records)


def test_a_remote_replica_whose_load_failed_stays_failed(tiny_model, tmp_path):
    """Found failed (this gateway did not place it): its process is restarted once to load again; failing again,
    the slot is failed for good, not restarted on and on."""
    bare = tmp_path / "no-weights"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    server = _replica_server(bare)
    assert server.state.startswith("failed")

    async def scenario():
        link = _Link(server)
        supervisor, _ = _remote_supervisor(server, link)
        supervisor.start()
        try:
            with pytest.raises(EngineDeadError, match="failed to start"):
                await asyncio.wait_for(supervisor.wait_ready(), 60)
            await asyncio.sleep(3 * FAST.initial_seconds)
            assert supervisor.state.startswith("failed: device 'cpu' failed to start: device worker failed to start")
            assert link.calls == 2 and len(link.restarts) == 1  # its own error: starting again would fail alike
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_a_remote_replica_whose_loop_hangs_is_restarted_by_a_gateway_it_never_took_in(tiny_model, monkeypatch):
    """A replica whose step hangs takes no new connection in (its loop adopts them between steps): a gateway
    that connects meanwhile waited for its `Ready` until the start limit, then Ray said `ready` and it connected
    again, for ever. The replica's heartbeats reach that connection too, saying how long the step has run: past
    `step_timeout_seconds`, the gateway restarts it."""
    from engine.faults import SLOW_STEP_ENV
    from engine.remote_client import RemoteEngineClient
    from engine.sampling import SamplingParams

    monkeypatch.setenv(SLOW_STEP_ENV, "SLOW:6")
    server = _replica_server(tiny_model)
    link = _Link(server)

    async def restart_unless_responsive(reason: str, loading_hangs: bool = False) -> None:
        link.restarts.append(f"asked Ray: {reason}")   # it answers `ready`: reconnecting, not restarting

    link.restart_unless_responsive = restart_unless_responsive

    async def scenario():
        first = RemoteEngineClient(server.config, _Link(server))
        await first.start()
        stuck = first.generate("be SLOW", SamplingParams(max_tokens=2))
        pending = asyncio.ensure_future(anext(stuck))
        while first.last_step_seconds < 0.5:   # the replica's loop is inside the slowed step
            await asyncio.sleep(0.05)
        supervisor, _ = _remote_supervisor(server, link)
        supervisor.start_seconds, supervisor.step_timeout_seconds = 1.5, 1.0
        supervisor.start()
        try:
            async with asyncio.timeout(4):
                while not link.restarts:
                    await asyncio.sleep(0.05)
            assert supervisor.num_step_timeouts == 1   # counted as the watchdog counts a hang
        finally:
            await supervisor.stop()
            pending.cancel()
            await first.shutdown(1.0)
        return link.restarts

    restarts = asyncio.run(scenario())
    assert restarts[0].startswith("hung: one step has run for ") and "it never took this connection in" in \
        restarts[0], restarts


@pytest.mark.parametrize("served_first", [True, False])
def test_a_ray_replica_whose_load_fails_after_a_restart_has_its_actor_restarted_and_comes_back(
        tiny_model, tmp_path, served_first):
    """A replica that served, died, and whose new process failed to load (out of memory while the dead one's
    ranks held the GPU, say) stays up refusing every connection: retrying the connection alone never ended.
    The supervisor asks Ray to restart the actor; the next process loads, and the replica serves again. So does
    a gateway that finds it so at its start (Ray restarted it, or another gateway placed it): it was failed for
    good, its GPUs held."""
    bare = tmp_path / "no-weights"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    good, failed = _replica_server(tiny_model), _replica_server(bare)
    link = _Link(good if served_first else failed)

    def restart(reason: str) -> None:   # what Ray does: a new process, whose load works this time
        link.restarts.append(reason)
        link.server = good

    link.restart = restart

    async def scenario():
        supervisor, pool = _remote_supervisor(good, link)
        supervisor.start()
        try:
            await supervisor.wait_ready()
            if served_first:
                link.server = failed                   # the restarted process's load fails
                supervisor.client.lost("the actor's process died")
                while not link.restarts:
                    await asyncio.sleep(0.02)
                while len(pool.admission.ready) < 2:   # ready again, restarted
                    await asyncio.sleep(0.02)
            assert supervisor.state == "ready"
        finally:
            await supervisor.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    said = "its load failed after a restart" if served_first else "its load had failed before this gateway reached"
    assert len(link.restarts) == 1 and said in link.restarts[0], link.restarts


def test_a_silent_ray_replica_is_restarted_only_if_it_does_not_answer_ray_either(monkeypatch):
    """A connection that went silent may be this gateway's path to a healthy replica (a partition) that
    other gateways still use: the actor is asked through Ray first, and restarted only without an answer."""
    from engine.config import EngineConfig
    from gateway.workers import ray_cluster

    monkeypatch.setattr(ray_cluster, "RESPONSIVE_SECONDS", 0.1)

    class Actor:
        def __init__(self, answer: str | None) -> None:
            self.answer, self.state = answer, self

        def remote(self):
            future = asyncio.get_running_loop().create_future()
            if self.answer is not None:
                future.set_result(self.answer)
            return future   # an actor that does not answer: never resolved

    restarted = []

    async def main():
        for answer in ("ready", None, "loading"):
            for loading_hangs in (False, True):   # a start past its limit: still loading is a hung load
                replica = ray_cluster.RayReplica(None, "d", 0, EngineConfig())
                replica._actor = Actor(answer)
                replica.restart = restarted.append
                await replica.restart_unless_responsive(f"{answer}, {loading_hangs}", loading_hangs=loading_hangs)

    asyncio.run(main())
    assert restarted == ["None, False", "None, True", "loading, True"]


def test_a_remote_replica_still_loading_past_the_start_limit_is_restarted_and_then_serves(tiny_model, monkeypatch):
    """A replica reached whose load never ends (a stuck read, a hung driver call) is restarted once its start
    passes `start_timeout_seconds` (reconnecting alone waited on it forever); the new process loads and serves."""
    good, release = _replica_server(tiny_model), threading.Event()

    def hang(config):
        release.wait()
        raise RuntimeError("released at the test's end")

    monkeypatch.setattr("engine.llm_engine.LLMEngine", hang)
    hung = ReplicaServer(good.config, "127.0.0.1")
    hung.start()
    link = _Link(hung)

    async def restart_unless_responsive(reason: str, loading_hangs: bool = False) -> None:
        link.restarts.append((reason, loading_hangs))
        if loading_hangs and link.server.state == "loading":   # what RayReplica asks the actor (above)
            link.server = good

    link.restart_unless_responsive = restart_unless_responsive

    async def scenario():
        supervisor, pool = _remote_supervisor(good, link)
        supervisor.start_seconds = 1.0
        supervisor.start()
        try:
            await asyncio.wait_for(supervisor.wait_ready(), 30)
            assert supervisor.state == "ready" and link.calls == 2 and pool.admission.ready == [(0, True)]
        finally:
            await supervisor.stop()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert link.restarts == [("not loaded within gateway.start_timeout_seconds (1 s)", True)]
