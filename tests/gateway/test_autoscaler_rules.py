"""The autoscaler's scale-down rules, with fake slots and a given clock (no worker, no Ray): never fewer
serving replicas than `min` (a loading, restarting or failed one serves nothing), a loading replica past
`min` that is not needed removed, idle time counted anew after a restart, and a slot being removed never
started again before its removal has ended."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers.autoscaler import Autoscaler
from pools.credits.queue import CreditQueue
from pools.config.spec import DeviceSpec

IDLE = 60.0   # scale_down_idle_seconds
RESTARTING = "restarting: device worker process exited (signal 9, SIGKILL)"
PENDING = "loading: waiting for Ray to place [{'CPU': 1.0}] on one node"


class _Link:
    """A slot's cluster link; `remove` waits for `release` when `gate` is set, and raises `error` if set."""

    def __init__(self) -> None:
        self.removed, self.gate, self.error = 0, None, None

    async def remove(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.removed += 1


class _Slot:
    """A replica slot as the autoscaler sees a `DeviceSupervisor`."""

    def __init__(self, replica: int, state: str) -> None:
        self.device, self.replica, self.state, self.name = "d", replica, state, f"d/{replica}"
        self.draining, self.client, self.link = False, None, _Link()
        self.num_starts, self.removing = 0, False

    @property
    def is_ready(self) -> bool:
        return self.state in ("ready", "draining")

    @property
    def is_active(self) -> bool:   # its supervisor task runs (a failed one's ends once it removed what it placed)
        return self.removing or self.state != "stopped" and not self.state.startswith("failed")

    def start(self) -> None:
        self.state, self.draining = "loading", False
        self.num_starts += 1

    async def stop(self) -> None:
        self.state = "stopped"


def _make_scaler(slots: list[_Slot], verdict: dict[str, str], min_replicas: int = 1) -> Autoscaler:
    spec = DeviceSpec(name="d", replicas=len(slots), min_replicas=min_replicas, scale_down_idle_seconds=IDLE)
    return Autoscaler({"d": spec}, {"d": slots}, {}, GatewayMetrics(), overloaded=lambda: verdict)


def _ticks(scaler: Autoscaler, start: int, stop: int) -> None:
    for t in range(start, stop):
        scaler.tick(now=float(t))


async def _settle() -> None:
    """Let the removals started by a tick run to their end (the fakes answer at once)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _assert_serving(slots: list[_Slot], want: list[int]) -> None:
    got = [s.replica for s in slots if s.is_ready and not s.draining]
    assert got == want, f"serving {got}, want {want}: {[(s.state, s.draining) for s in slots]}"


@pytest.mark.parametrize("later", [PENDING, RESTARTING])
async def test_the_only_serving_replica_stays_while_another_loads_and_the_unneeded_one_goes(later):
    """... or restarts (it served, then crash-loops: kept, it reloaded for good and read `degraded`)."""
    slots = [_Slot(0, "ready"), _Slot(1, "stopped")]
    verdict = {"d": "overloaded"}
    scaler = _make_scaler(slots, verdict)
    scaler.tick(now=0.0)
    assert [s.state for s in slots] == ["ready", "loading"]     # the burst starts slot 1
    verdict.clear()                                              # the burst ends; slot 1 still loads (pending)
    slots[1].state = later
    _ticks(scaler, 1, 60)
    await _settle()
    _assert_serving(slots, [0])
    assert not slots[1].draining                                 # not yet unneeded for IDLE seconds
    _ticks(scaler, 60, 70)
    await _settle()
    _assert_serving(slots, [0])                                  # slot 0, the only one serving, is never drained
    assert slots[1].state == "stopped" and slots[1].link.removed == 1   # the unneeded loading one is removed
    verdict["d"] = "a request waited 30 s for KV credits"
    scaler.tick(now=70.0)
    assert slots[1].state == "loading" and slots[1].num_starts == 2     # pressure starts it again


async def test_a_loading_replica_is_kept_while_pressed_or_while_fewer_than_min_serve():
    slots = [_Slot(0, "ready"), _Slot(1, PENDING)]
    verdict = {"d": "overloaded"}
    scaler = _make_scaler(slots, verdict)
    _ticks(scaler, 0, 100)                                       # pressed all along: it is needed
    await _settle()
    assert slots[1].state == PENDING and not slots[1].draining
    verdict.clear()
    slots[0].state = RESTARTING                                  # slot 0 crashes: slot 1 is needed for `min`
    _ticks(scaler, 100, 300)
    await _settle()
    assert slots[1].state == PENDING and not slots[1].draining and slots[0].state == RESTARTING


async def test_a_crashed_replica_never_leaves_the_other_one_to_be_drained():
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    scaler = _make_scaler(slots, {})
    _ticks(scaler, 0, 50)                                        # both idle for 49 s
    slots[0].state = RESTARTING
    _ticks(scaler, 50, 200)
    await _settle()
    _assert_serving(slots, [1])                                  # slot 1 is all that serves: kept
    slots[0].state = "failed: device 'd/0' failed to start"
    _ticks(scaler, 200, 300)
    await _settle()
    _assert_serving(slots, [1])
    slots[0].state = "ready"                                     # back: now the highest goes, after its idle time
    _ticks(scaler, 300, 370)
    await _settle()
    _assert_serving(slots, [0])
    assert slots[1].state == "stopped"


async def test_min_two_keeps_two_serving_even_with_a_higher_slot_idle():
    slots = [_Slot(0, RESTARTING), _Slot(1, "ready"), _Slot(2, "ready")]
    scaler = _make_scaler(slots, {}, min_replicas=2)
    _ticks(scaler, 0, 200)
    await _settle()
    _assert_serving(slots, [1, 2])


async def test_a_replica_ready_again_after_a_restart_counts_its_idle_time_anew():
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    verdict = {"d": "overloaded"}
    scaler = _make_scaler(slots, verdict)
    scaler.tick(now=0.0)
    verdict.clear()
    scaler.tick(now=10.0)                                        # idle from t=10
    slots[1].state = RESTARTING                                  # crashes at t=20
    scaler.tick(now=20.0)
    assert ("d", 1) not in scaler._idle_since
    slots[1].state = "ready"                                     # back after a 3-minute reload
    scaler.tick(now=200.0)
    assert not slots[1].draining                                 # idle since t=200, not t=10
    _ticks(scaler, 201, 260)
    assert not slots[1].draining
    scaler.tick(now=260.0)
    assert slots[1].draining
    await _settle()
    assert slots[1].state == "stopped"


async def test_a_slot_being_removed_is_not_started_again_until_its_removal_ended():
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    verdict: dict[str, str] = {}
    scaler = _make_scaler(slots, verdict)
    slots[1].link.gate = asyncio.Event()                         # the cluster's removal takes a while
    _ticks(scaler, 0, 61)
    await _settle()
    assert slots[1].state == "stopped" and slots[1].link.removed == 0    # stopped, its actor not yet removed
    verdict["d"] = "a request waited 30 s for KV credits"
    _ticks(scaler, 61, 70)                                       # pressure meanwhile: nothing taken back mid-way
    assert slots[1].state == "stopped" and slots[1].num_starts == 0 and ("d", 1) in scaler._removals
    slots[1].link.gate.set()
    await _settle()
    assert slots[1].link.removed == 1 and ("d", 1) not in scaler._removals
    scaler.tick(now=70.0)
    assert slots[1].state == "loading" and slots[1].num_starts == 1      # now a new start


async def test_a_failed_removal_frees_the_slot():
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    verdict: dict[str, str] = {}
    scaler = _make_scaler(slots, verdict)
    slots[1].link.error = RuntimeError("the Ray cluster refused")
    _ticks(scaler, 0, 61)
    await _settle()
    assert ("d", 1) not in scaler._removals and not scaler._finishing and not slots[1].draining
    verdict["d"] = "a request waited 30 s for KV credits"
    scaler.tick(now=61.0)
    assert slots[1].state == "loading"


async def test_a_slot_reads_stopped_only_with_its_scale_down_counted():
    """A supervisor reads "stopped" from the moment its `stop` begins; the scale-down is counted by then."""
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    scaler = _make_scaler(slots, {})
    gate = asyncio.Event()

    async def slow_stop() -> None:                               # stopped at once, the worker leaves later
        slots[1].state = "stopped"
        await gate.wait()

    slots[1].stop = slow_stop
    _ticks(scaler, 0, 61)
    await _settle()
    downs = scaler.metrics.replica_scalings.labels(device="d", direction="down")
    assert slots[1].state == "stopped" and downs._value.get() == 1.0
    gate.set()
    await _settle()
    assert downs._value.get() == 1.0 and slots[1].link.removed == 1 and not scaler._removals


async def test_a_drain_is_taken_back_before_the_worker_stops_but_not_after():
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    verdict: dict[str, str] = {}
    scaler = _make_scaler(slots, verdict)
    readied: list[tuple[int, bool]] = []   # the pools' admission passes: the replica taken back is up at once
    admission = CreditQueue("p", [100, 100])
    admission.replica_ready = lambda replica, restarted: readied.append((replica, restarted))
    scaler.pools["d"] = [SimpleNamespace(admission=admission)]
    _ticks(scaler, 0, 61)
    assert slots[1].draining                                     # its removal has not run yet
    verdict["d"] = "overloaded"
    scaler.tick(now=61.0)                                        # pressure comes back: taken back
    assert not slots[1].draining and ("d", 1) not in scaler._removals
    assert readied == [(1, False)]                               # its cache intact: a pass to admit who waits
    await _settle()
    assert slots[1].state == "ready"

    verdict.clear()
    gate = asyncio.Event()
    stopped = slots[1].stop

    async def slow_stop() -> None:                               # the worker takes a while to shut down
        await gate.wait()
        await stopped()

    slots[1].stop = slow_stop
    _ticks(scaler, 62, 123)
    await _settle()
    assert slots[1].draining and ("d", 1) in scaler._finishing   # stopping: past taking back
    verdict["d"] = "overloaded"
    scaler.tick(now=123.0)
    assert slots[1].draining and ("d", 1) in scaler._removals
    gate.set()
    await _settle()
    assert slots[1].state == "stopped" and slots[1].link.removed == 1 and not scaler._removals
    scaler.tick(now=124.0)
    assert slots[1].state == "loading"


async def test_a_shared_replica_in_a_long_step_is_not_taken_for_idle(monkeypatch):
    """A replica answers its count between steps: one in a step longer than the wait has work (other
    gateways' requests perhaps) and must not be drained as if it counted none; one whose connection died under
    the question counts none only once its actor is gone from the cluster (a partition that cut this gateway
    alone, the watchdog's kill, leaves it serving the others: it was removed under their streams)."""
    from gateway.workers import autoscaler
    from engine.client import EngineDeadError

    monkeypatch.setattr(autoscaler, "STATS_SECONDS", 0.05)

    async def never():
        await asyncio.sleep(10)

    async def dead():
        raise EngineDeadError("gone")

    loaded = object()   # the client's `info`: what the replica loaded
    busy = SimpleNamespace(client=SimpleNamespace(is_alive=True, stats=never, latest_stats=None, info=loaded))
    assert await Autoscaler._num_requests(busy) >= 1
    busy.client.latest_stats = SimpleNamespace(num_requests=3)
    assert await Autoscaler._num_requests(busy) == 3
    actor = {"removed": False}

    async def removed():
        if actor["removed"] is None:
            raise ConnectionError("the cluster does not answer")
        return actor["removed"]
    from gateway.workers.supervisor import DeviceSupervisor

    gone = DeviceSupervisor("d", None, [], GatewayMetrics(), link=SimpleNamespace(removed=removed))
    gone.client = SimpleNamespace(is_alive=True, stats=dead, latest_stats=None, info=loaded)
    assert await Autoscaler._num_requests(gone) is None
    actor["removed"] = None
    assert await Autoscaler._num_requests(gone) is None
    actor["removed"] = True
    assert await Autoscaler._num_requests(gone) == 0
    # still loading: connected, it answers nothing till loaded and serves no gateway yet. It counted 1 (kept a
    # minute at a time through a long load, holding its GPUs); it counts none, and an unneeded one goes
    # (the gateway placed it since it started the slot: an actor it adopted may serve others while it cannot
    # reach it, and so may one that served before the connection broke: those count 1)
    placed = SimpleNamespace(placing=False, placed_at=2.0)
    loading = SimpleNamespace(client=SimpleNamespace(is_alive=True, stats=never, latest_stats=None, info=None),
                              link=placed, started_at=1.0, has_loaded=False)
    assert await Autoscaler._num_requests(loading) == 0
    adopted = SimpleNamespace(client=None, link=SimpleNamespace(placing=False, placed_at=0.5), started_at=1.0,
                              has_loaded=False)
    served = SimpleNamespace(client=SimpleNamespace(is_alive=False, info=loaded), link=placed, started_at=1.0,
                             has_loaded=True)
    assert await Autoscaler._num_requests(adopted) is await Autoscaler._num_requests(served) is None



async def test_a_shared_replica_kept_for_other_gateways_requests_admits_who_waits_at_once():
    """The leader drains replica 1, but other gateways still have requests on it: it is kept, and a pass of the
    pools' admission runs then (requests waiting for credits went there only at the next event)."""
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    scaler = _make_scaler(slots, {})
    readied: list[tuple[int, bool]] = []
    admission = CreditQueue("p", [100, 100])
    admission.replica_ready = lambda replica, restarted: readied.append((replica, restarted))
    scaler.pools["d"] = [SimpleNamespace(admission=admission)]

    async def stats():
        return SimpleNamespace(num_requests=2)   # every gateway's, as the replica counts them

    slots[1].client = SimpleNamespace(is_alive=True, info=object(), stats=stats, num_in_flight=0, latest_stats=None)
    scaler.leases["d"] = SimpleNamespace(is_leader=lambda: True, poke=lambda *args: None, live=None, live_at=0.0,
                                         view=SimpleNamespace(pressure=None, draining=()))
    _ticks(scaler, 0, 61)
    assert slots[1].draining
    await _settle()
    assert not slots[1].draining and slots[1].state == "ready" and readied == [(1, False)]


async def test_a_replica_draining_when_the_other_crashes_is_kept_to_serve_min():
    """min 1: replica 1 drains (its last request still running) when replica 0 crashes. Once idle it is kept,
    not removed: the device would have had no serving replica until replica 0 reloaded."""
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    scaler = _make_scaler(slots, {})
    _ticks(scaler, 0, 61)
    assert slots[1].draining
    slots[1].client = SimpleNamespace(num_in_flight=1)   # its last request: the removal waits for it
    await _settle()
    slots[0].state = RESTARTING
    slots[1].client.num_in_flight = 0
    await asyncio.sleep(0.3)   # the removal polls for the end of its requests
    assert slots[1].state == "ready" and not slots[1].draining and slots[1].link.removed == 0
    assert not scaler._removals



async def test_a_replica_draining_with_requests_when_the_other_crashes_is_taken_back_at_the_next_tick():
    """min 1: replica 1 drains with a long request still running when replica 0 crashes: the next tick takes the
    drain back, and replica 1 serves new requests at once (it refused them until its request ended)."""
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    scaler = _make_scaler(slots, {})
    _ticks(scaler, 0, 61)
    slots[1].client = SimpleNamespace(num_in_flight=1)   # a long request: the removal waits for it
    await _settle()
    assert slots[1].draining
    slots[0].state = RESTARTING
    scaler.tick(now=61.0)
    assert not slots[1].draining and not scaler._removals
    _assert_serving(slots, [1])


async def test_a_replica_it_added_whose_load_failed_is_started_again_after_a_while_and_its_own_never():
    """A replica the autoscaler added whose load failed (memory a dead process still held, a node's passing
    fault) is parked, not failed for good: pressure starts it again `RETRY_FAILED_SECONDS` after its failure
    was seen (a device with `max: 2` could otherwise never grow again). A replica of the gateway's own start
    that failed stays so: no start would load its config."""
    first = "failed: device 'd' failed to start: no such model"
    slots = [_Slot(0, first), _Slot(1, "ready"), _Slot(2, "stopped")]
    scaler = _make_scaler(slots, {"d": "overloaded"})
    scaler.tick(now=0.0)
    assert [s.num_starts for s in slots] == [0, 0, 1]            # the stopped slot, not the failed one
    slots[2].state = "failed: device 'd' failed to start: CUDA out of memory"
    slots[2].removing = True                                     # its supervisor still removes what it placed
    _ticks(scaler, 1, 62)
    assert [s.num_starts for s in slots] == [0, 0, 1]            # not within RETRY_FAILED_SECONDS, nor then
    slots[2].removing = False
    scaler.tick(now=62.0)
    assert [s.state for s in slots] == [first, "ready", "loading"] and slots[2].num_starts == 2
    slots[2].state = "failed: device 'd' failed to start: CUDA out of memory"   # at once, again
    _ticks(scaler, 63, 123)
    assert slots[2].num_starts == 2                              # its own while again, not every tick
    scaler.tick(now=123.0)
    assert slots[2].num_starts == 3


async def test_requests_waiting_for_any_replica_to_be_ready_start_a_parked_slot():
    """The only started replica crash-loops (restarting, never ready): requests wait for a replica to be ready,
    holding no credits, so no credit wait nor refusal pressed; every one got a 503 after the device wait while
    the parked slots stayed parked. A wait past `scale_up_wait_seconds` starts one."""
    slots = [_Slot(0, "restarting: the worker died (exit code 1)"), _Slot(1, "stopped")]
    waits = {"d": 0.0}
    spec = DeviceSpec(name="d", replicas=2, min_replicas=1, scale_down_idle_seconds=IDLE)
    scaler = Autoscaler({"d": spec}, {"d": slots}, {}, GatewayMetrics(), overloaded=dict,
                        device_wait=lambda device, now: waits[device])
    scaler.tick(now=0.0)
    assert slots[1].state == "stopped"
    waits["d"] = spec.scale_up_wait_seconds + 0.5
    scaler.tick(now=1.0)
    assert slots[1].state == "loading" and slots[1].num_starts == 1


async def test_the_gateway_reports_how_long_requests_wait_for_a_replica(tmp_path, tiny_model):
    """`Gateway.device_wait`: the longest an impatient request waits in `wait_device`, 0 once it left."""
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config
    from tests.gateway.conftest import chat_pool_yaml

    gateway = Gateway.from_config(load_config(chat_pool_yaml(tiny_model)))
    device = next(iter(gateway.config.devices))
    pool = next(p for p in gateway.pools.values() if p.device == device)
    gateway.supervisors = {device: [_Slot(0, "loading")]}
    gateway.supervisors[device][0].wait_ready = lambda: asyncio.sleep(10)
    waiting = asyncio.ensure_future(gateway.wait_device(pool))
    await asyncio.sleep(0.05)
    assert 0.0 < gateway.device_wait(device, time.monotonic()) < 1.0
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert gateway.device_wait(device, time.monotonic()) == 0.0


@pytest.mark.parametrize("held", [150, 400])
async def test_a_light_steady_load_that_keeps_every_replica_busy_still_lets_the_last_go(held):
    """Each request goes to the least loaded replica, so a trickle one replica carries keeps all three busy: the
    highest slot's idle clock restarted at every request, and a device scaled up in a burst stayed at its most
    all day. A replica whose load the others carry at most half full (credits, sequences, offered time) is
    drained as an idle one is, its requests finishing first; a load that needs it keeps it."""
    slots = [_Slot(r, "ready") for r in range(3)]
    for s in slots:
        s.client = SimpleNamespace(num_in_flight=1)                # a request in flight on each, always
    scaler = _make_scaler(slots, {})
    scaler.offered = lambda device: 0.4                            # replicas' worth of time asked
    admission = CreditQueue("p", [1000] * 3, max_seqs=8)
    admission.replica_ready = lambda replica, restarted: None
    scaler.pools["d"] = [SimpleNamespace(admission=admission)]
    for r in range(3):
        admission.ledger.submit(f"r{r}", held)
    admission.ledger.admit()
    assert [a.held for a in admission.ledger.accounts] == [held] * 3
    _ticks(scaler, 0, int(IDLE) + 2)
    if held == 400:   # 1,200 held: over half of two replicas' 2,000
        assert not any(s.draining for s in slots)
        return
    assert slots[2].draining and not slots[1].draining             # the highest only, and nothing new goes there
    await _settle()
    assert slots[2].state == "ready"                               # its request in flight finishes first
    admission.ledger.release("r2")
    slots[2].client.num_in_flight = 0
    for _ in range(5):
        await asyncio.sleep(0.1)
    assert slots[2].state == "stopped"
    _ticks(scaler, int(IDLE) + 2, 2 * int(IDLE) + 4)
    # one at a time, down to what the load needs (300 held, 0.4 asked: one replica carries it half full)
    assert slots[1].draining and not slots[0].draining


def test_a_replica_is_spare_by_what_the_others_hold_and_never_on_a_shared_device():
    """The spare rule measured the load against the largest replica's credits, the one to go included: with
    leases of 100, 100 and 1,000 credits, 150 held read as spare, leaving 75% of what stays in use. A device shared
    by several gateways (a lease) is judged by its idle rule only: each gateway sees its own requests alone."""
    slots = [_Slot(r, "ready") for r in range(3)]
    scaler = _make_scaler(slots, {})
    admission = CreditQueue("p", [100, 100, 1000])
    scaler.pools["d"] = [SimpleNamespace(admission=admission)]
    admission.ledger.submit("a", 150)
    admission.ledger.admit()
    assert not scaler._spare("d", slots)                         # 150 of the 200 that would stay
    admission.ledger.release("a")
    admission.ledger.submit("b", 90)
    admission.ledger.admit()
    assert scaler._spare("d", slots)                             # 90 of 200: under half
    scaler.leases["d"] = SimpleNamespace()
    assert not scaler._spare("d", slots)
