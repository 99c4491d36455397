"""Autoscaling (`replicas: {min, max}`): a burst that waits for KV credits on one replica starts a second,
whose credits take the queue; an idle minute (here two seconds) stops it again; nothing is lost."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.gateway.conftest import chat_pool_yaml
from tests.gateway.test_app import _client, _metrics, _model

AUTOSCALED = "cpu_threads: 1, replicas: {min: 1, max: 2, scale_up_wait_seconds: 0.3, scale_down_idle_seconds: 2}"


def _autoscaled(tiny_model) -> str:
    return chat_pool_yaml(tiny_model, max_model_len=256, device_keys=AUTOSCALED)


def _replicas(m: dict) -> dict[str, int]:
    return {dict(labels)["state"]: int(v) for labels, v in m["cliffguard_replicas"].items()}


async def _wait_for(client, want: dict[str, int], timeout: float) -> dict[str, int]:
    got = {}
    for _ in range(int(timeout / 0.1)):
        got = _replicas(_metrics(await (await client.get("/metrics")).text()))
        if all(got.get(k) == v for k, v in want.items()):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"replicas never reached {want}: {got}")


async def test_a_burst_adds_a_replica_and_a_quiet_spell_removes_it(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, _autoscaled(tiny_model), tmp_path)
    await burst_then_quiet(client, gateway, _model(tiny_model))


async def burst_then_quiet(client, gateway, model: str) -> None:
    """One replica of two started; a burst that waits for credits starts the second, which serves part of
    it; two quiet seconds stop it again; nothing is lost, and the parked slot serves the next request."""
    await _wait_for(client, {"ready": 1, "stopped": 1}, timeout=60)
    assert _replicas(_metrics(await (await client.get("/metrics")).text())) == {
        "ready": 1, "stopped": 1, "loading": 0, "draining": 0, "restarting": 0, "failed": 0}
    ready = await (await client.get("/ready")).json()
    assert (ready["status"], ready["replicas"]) == ("ready", {"cpu": ["ready", "stopped"]})   # a parked slot: at rest

    async def one(i: int) -> tuple[int, str]:
        r = await client.post("/v1/completions", json={"model": model, "prompt": f"Story {i}:", "max_tokens": 200,
                                                       "temperature": 0, "ignore_eos": True})
        await r.read()
        return r.status, r.headers.get("x-cliffguard-replica", "")

    # 24 requests of ~208 credits each against one replica's 512 (two at a time): most wait for credits
    burst = asyncio.gather(*(one(i) for i in range(24)))
    await _wait_for(client, {"ready": 2, "stopped": 0}, timeout=60)
    answers = await burst
    assert [status for status, _ in answers] == [200] * 24
    assert {replica for _, replica in answers} == {"0", "1"}   # the new replica took part of the queue
    assert gateway.autoscaler.credit_wait("cpu") == 0.0
    # quiet: replica 1 idles past scale_down_idle_seconds, is drained and stopped; replica 0 stays
    await _wait_for(client, {"ready": 1, "stopped": 1, "draining": 0}, timeout=30)
    assert (await (await client.get("/ready")).json())["status"] == "ready"
    m = _metrics(await (await client.get("/metrics")).text())
    scalings = {dict(labels)["direction"]: v for labels, v in m["cliffguard_replica_scalings_total"].items()}
    assert scalings == {"up": 1.0, "down": 1.0}
    # the parked slot serves again when the next burst comes
    status, _ = await one(99)
    assert status == 200
    for supervisor in gateway.supervisors["cpu"]:
        if supervisor.is_ready:
            assert (await supervisor.client.stats(check=True)).num_requests == 0


def test_without_ray_local_devices_serve_and_a_ray_device_is_a_clear_error(tmp_path, tiny_model):
    """Ray is an optional extra: a gateway of local devices never imports it, and a device placed on Ray
    where it is not installed is refused at start with the key and the install command."""
    import subprocess
    import sys

    local = tmp_path / "local.yaml"
    local.write_text(_autoscaled(tiny_model))
    on_ray = tmp_path / "ray.yaml"
    on_ray.write_text(_autoscaled(tiny_model).replace("cpu_threads: 1,", "cpu_threads: 1, placement: ray, "
                                                                          "ray_address: '127.0.0.1:9',"))
    script = f"""
import sys
sys.modules["ray"] = None   # as if not installed: `import ray` raises ImportError
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from pools.config.spec import SpecError
Gateway.from_config(load_config({str(local)!r}))
assert sys.modules["ray"] is None
try:
    Gateway.from_config(load_config({str(on_ray)!r}))
except SpecError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "devices.cpu.placement: ray, and Ray is not installed: pip install -e '.[ray]'"


class _Slot:
    """A replica slot as the autoscaler sees a `DeviceSupervisor`."""

    def __init__(self, replica: int, state: str) -> None:
        self.replica, self.state, self.name = replica, state, f"d/{replica}"
        self.draining, self.client, self.link = False, None, None

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        self.state = "loading"


def test_an_overloaded_device_scales_up_with_no_credit_wait_and_never_down_while_overloaded():
    """A compute-bound device's KV never fills: the overload verdict (offered load over what the step-cost
    model says its replicas do, requests waiting) starts a replica too, and keeps an idle one from going."""
    from gateway.workers.autoscaler import Autoscaler
    from gateway.monitoring.metrics import GatewayMetrics
    from pools.config.spec import DeviceSpec

    spec = DeviceSpec(name="d", replicas=3, min_replicas=1, scale_down_idle_seconds=5.0)
    slots = [_Slot(0, "ready"), _Slot(1, "stopped"), _Slot(2, "stopped")]
    verdict: dict[str, str] = {}
    scaler = Autoscaler({"d": spec}, {"d": slots}, {}, GatewayMetrics(), overloaded=lambda: verdict)
    scaler.tick(now=0.0)
    assert [s.state for s in slots] == ["ready", "stopped", "stopped"]      # calm: nothing to do
    verdict["d"] = "overloaded: offered load 1.8 of 1 replica(s)' time"
    scaler.tick(now=1.0)
    assert [s.state for s in slots] == ["ready", "loading", "stopped"]
    scaler.tick(now=2.0)
    assert slots[2].state == "stopped"                                      # one at a time: one is loading
    slots[1].state = "ready"
    scaler.tick(now=3.0)
    assert slots[2].state == "loading"                                      # still overloaded with two
    slots[2].state = "ready"
    for t in range(4, 30):                                                  # overloaded, idle or not: none goes
        scaler.tick(now=float(t))
    assert [s.state for s in slots] == ["ready"] * 3 and not any(s.draining for s in slots)
    ups = [s.value for s in scaler.metrics.replica_scalings.collect()[0].samples
           if s.name.endswith("_total") and s.labels["direction"] == "up"]
    assert ups == [2.0]


def test_once_the_gateway_drains_no_replica_is_started_or_drained():
    """SIGTERM's drain runs before the gateway stops its autoscaler: a queue still pressing meanwhile started a
    model load only for the stop to kill it (on Ray, a detached actor the stop caught in its creation was left
    holding GPUs). The app's shutdown freezes it first (`Gateway.begin_drain`)."""
    from gateway.workers.autoscaler import Autoscaler
    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.runtime import Gateway
    from pools.config.spec import DeviceSpec

    spec = DeviceSpec(name="d", replicas=3, min_replicas=1, scale_down_idle_seconds=1.0)
    slots = [_Slot(0, "ready"), _Slot(1, "ready"), _Slot(2, "stopped")]
    verdict: dict[str, str] = {}
    scaler = Autoscaler({"d": spec}, {"d": slots}, {}, GatewayMetrics(), overloaded=lambda: verdict)
    gateway = SimpleNamespace(autoscaler=scaler)

    async def drain() -> None:
        scaler.start()
        await Gateway.begin_drain(gateway)

    asyncio.run(drain())
    verdict["d"] = "overloaded: offered load 2.8 of 2 replica(s)' time"
    scaler.tick(now=100.0)                      # overloaded: it would start slot 2
    verdict.clear()
    for t in range(101, 120):                   # idle: it would drain slot 1
        scaler.tick(now=float(t))
    assert [s.state for s in slots] == ["ready", "ready", "stopped"] and not any(s.draining for s in slots)


def test_a_steady_overload_starts_the_replicas_it_needs_and_no_more():
    """Offered 1.5 replicas' worth, steadily: the overload verdict starts a second replica; once it is ready
    the two carry the load (`replicas_needed` 2), and the verdict, which holds for `OFF_SECONDS` after the
    load is carried, starts no third (`OverloadWatch.short_of_replicas`: what the autoscaler is given)."""
    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.monitoring.overload import OverloadWatch
    from gateway.workers.autoscaler import Autoscaler
    from pools.config.spec import DeviceSpec
    from pools.demand import DeviceLoad, OverloadDetector, PoolLoad, PoolRates

    slots = [_Slot(0, "ready")] + [_Slot(r, "stopped") for r in (1, 2, 3)]
    for s in slots:
        s.client = SimpleNamespace(num_in_flight=3)   # the steady load keeps each replica busy
    watch = OverloadWatch({}, {}, GatewayMetrics())
    watch.supervisors = {"d": slots}
    watch.detectors["d"] = OverloadDetector()
    scaler = Autoscaler({"d": DeviceSpec(name="d", replicas=4, min_replicas=1)}, {"d": slots}, {}, GatewayMetrics(),
                        overloaded=watch.short_of_replicas)
    rates, backlog_since, ready_at = PoolRates(prefill=1000.0, decode=100.0, batch=8), None, {}
    for step in range(120):   # a minute, the autoscaler's ticks; a replica loads in 5 s
        t = step * 0.5
        for s in slots:
            if s.state == "loading":
                ready_at.setdefault(s.replica, t + 5.0)
                s.state = "ready" if t >= ready_at[s.replica] else s.state
        ready = sum(s.is_ready for s in slots)
        short = 150.0 > 100.0 * ready   # the ready replicas fall behind: the oldest request waits longer
        backlog_since = (t if backlog_since is None else backlog_since) if short else None
        load = DeviceLoad((PoolLoad("chat", 0.0, 150.0, rates, t - backlog_since if short else 0.0, 25.0),), ready)
        if step % 2 == 0:   # the watch judges every second
            watch.last["d"] = load
            watch.detectors["d"].observe(t, load)
        scaler.tick(now=t)
    assert [s.state for s in slots] == ["ready", "ready", "stopped", "stopped"]
    assert watch.detectors["d"].overloaded is False   # it cleared, OFF_SECONDS after the second was ready



def test_refusals_for_capacity_start_a_replica_where_nothing_waits():
    """With `max_queue_seconds: 0` no request waits for credits: a refusal (429) is what asks for a replica,
    for a second after it; one refused while the new replica loaded starts no other once it is up."""
    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.workers.autoscaler import Autoscaler
    from pools.config.spec import DeviceSpec
    from pools.credits.queue import CreditQueue

    queue = CreditQueue("p", [100] * 3, max_queue_seconds=0)
    slots = [_Slot(0, "ready"), _Slot(1, "stopped"), _Slot(2, "stopped")]
    scaler = Autoscaler({"d": DeviceSpec(name="d", replicas=3, min_replicas=1)}, {"d": slots},
                        {"p": SimpleNamespace(device="d", admission=queue)}, GatewayMetrics())
    scaler.tick(now=10.0)
    assert [s.state for s in slots] == ["ready", "stopped", "stopped"]
    queue.refused_at = 10.2
    scaler.tick(now=10.5)
    assert [s.state for s in slots] == ["ready", "loading", "stopped"]
    queue.refused_at = 10.8                      # refused while the second loads ...
    slots[1].state = "ready"
    scaler.tick(now=11.0)
    assert slots[2].state == "stopped"           # ... asked for the replica that just came up
    queue.refused_at = 11.2                      # refused with two up: a third
    scaler.tick(now=11.5)
    assert slots[2].state == "loading"
    slots[2].state = "ready"
    queue.refused_at = 11.6
    scaler.tick(now=13.0)                        # a refusal counts for a second: none left to start anyway
    assert [s.state for s in slots] == ["ready"] * 3
