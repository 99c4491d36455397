"""The scaling leader of a device shared by several gateways, without Ray: the lease's rules on a given
clock (one holder, renewal, expiry and takeover, release, a restarted lease granting nothing at first,
the gateways' reasons to scale up), the config claim's (one digest while a gateway of it holds it, a
hold lapsing or released, taken over), and the autoscaler as leader and as follower with fake slots
and a fake lease (a follower places and removes nothing; the leader removes only a replica idle for
every gateway). The same on a Ray cluster: tests/gateway/test_ray_leader_cluster.py."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers import autoscaler as autoscaler_module
from gateway.workers.autoscaler import Autoscaler
from gateway.workers.config_claim import ConfigClaim, claim_name, parse_name
from gateway.workers.scaler_lease import Lease, LeaseView
from pools.config.spec import DeviceSpec


def test_one_holder_renews_and_another_takes_over_only_when_its_lease_expired():
    lease = Lease.started(10.0, now=0.0)
    assert lease.renew("A", 0.0) == LeaseView("A", 10.0)
    assert lease.renew("B", 1.0).holder == "A"                  # taken: B follows
    assert lease.renew("A", 5.0).seconds_left == 10.0          # renewed
    assert lease.renew("B", 14.9) == LeaseView("A", pytest.approx(0.1))
    assert lease.renew("B", 15.0) == LeaseView("B", 10.0)      # A stopped renewing: B leads at its expiry
    assert lease.renew("A", 16.0).holder == "B"                # A, back, follows
    lease.release("B", 17.0)                                    # B stops: the lease is free at once
    assert lease.renew("A", 17.0).holder == "A"
    lease.release("B", 18.0)                                    # a follower's release changes nothing
    assert lease.renew("B", 18.0).holder == "A"


def test_a_restarted_lease_grants_nothing_until_any_lease_it_gave_is_over():
    lease = Lease.started(10.0, now=100.0, restarted=True)
    assert lease.renew("A", 105.0) == LeaseView(None, 5.0)
    assert lease.renew("A", 110.0).holder == "A"


def test_the_gateways_reasons_reach_the_others_and_the_holders_drains_reach_the_followers():
    lease = Lease.started(10.0, now=0.0)
    lease.renew("A", 0.0)
    assert lease.renew("B", 1.0, pressure="a request waited 3.0 s for KV credits").pressure is None  # not its own
    assert lease.renew("A", 2.0).pressure == "a request waited 3.0 s for KV credits"
    assert lease.renew("A", 11.5).pressure is None              # B said it over 10 s ago: forgotten
    lease.renew("B", 12.0, pressure="overloaded")
    lease.renew("B", 12.5)                                       # no reason now
    assert lease.renew("A", 13.0).pressure is None
    lease.renew("A", 14.0, draining=[2])
    assert lease.renew("B", 14.5, draining=[1]).draining == (2,)  # only the holder's drains count
    assert lease.renew("A", 15.0, draining=[2]).draining == (2,)
    assert lease.renew("A", 15.5, draining=()).draining == ()
    lease.renew("A", 16.0, draining=[1])
    assert lease.renew("B", 26.0).draining == ()                 # a new holder starts with none


class _LeaseActor:
    """A `ScalerLeaseActor` on a given clock whose renewal grants the lease, then fails to answer."""

    def __init__(self, lease: Lease) -> None:
        actor = self

        class _Call:
            def __init__(self, fn) -> None:
                self.fn = fn

            def remote(self, *args):
                async def answer():
                    return self.fn(*args)
                return answer()

        def renew(gateway, pressure, draining):
            actor.lease.renew(gateway, 0.0, pressure, draining)
            raise TimeoutError("the renewal's answer was lost")

        self.lease = lease
        self.renew, self.release = _Call(renew), _Call(lambda gateway: lease.release(gateway, 1.0))


async def test_a_gateway_whose_last_renewal_failed_still_hands_the_lease_back_when_it_stops(monkeypatch):
    from gateway.workers import scaler_lease

    actor = _LeaseActor(Lease.started(10.0, now=0.0))

    async def nothing(*_):
        return None

    cluster = SimpleNamespace(gateway_id="A", connect=nothing, claim=nothing)
    lease = scaler_lease.ScalerLease(cluster, "d", "digest", num_slots=1)
    monkeypatch.setattr(lease, "_get_or_create", lambda: actor)
    await lease.renew()                                  # granted on the actor, the answer lost here
    assert actor.lease.holder == "A" and not lease.is_leader()
    await lease.release()                                # stops: another gateway leads at once, not 10 s later
    assert actor.lease.renew("B", 2.0).holder == "B"


def test_a_config_claim_is_one_digests_while_a_gateway_of_it_holds_it_unless_taken_over():
    claim = ConfigClaim(30.0)
    assert claim.claim("aaaa", "A", now=0.0) == "aaaa"           # free: granted
    assert claim.claim("bbbb", "B", now=1.0) == "aaaa"           # another config, moments later: refused
    assert claim.claim("aaaa", "A2", now=20.0) == "aaaa"         # another gateway of the config holds it too
    assert claim.claim("bbbb", "B", now=49.9) == "aaaa"          # A2's hold is 29.9 s old
    assert claim.claim("bbbb", "B", now=50.0) == "bbbb"          # every hold lapsed: B's
    assert claim.claim("aaaa", "A", now=51.0) == "bbbb"
    claim.release("A")                                            # a gateway that holds nothing: no change
    assert claim.claim("aaaa", "A", now=52.0) == "bbbb"
    claim.release("B")                                            # B stops: free at once
    assert claim.claim("aaaa", "A", now=53.0) == "aaaa"
    assert claim.claim("cccc", "C", now=54.0, take_over=True) == "cccc"
    assert claim.claim("aaaa", "A", now=55.0) == "cccc" and claim.holders == {"C": 54.0}


def test_a_restarted_config_claim_grants_nothing_until_every_hold_it_gave_lapsed():
    claim = ConfigClaim.started(30.0, now=100.0, restarted=True)
    assert claim.claim("aaaa", "A", now=129.9) is None
    assert claim.claim("bbbb", "B", now=130.0) == "bbbb"
    assert ConfigClaim.started(30.0, now=100.0).claim("aaaa", "A", now=100.0) == "aaaa"


def test_names_of_a_device_are_told_from_other_devices_and_other_names():
    assert parse_name("cliffguard:gpu:3:1a2b3c4d", "gpu") == ("3", "1a2b3c4d")
    assert parse_name("cliffguard:gpu:scaler:1a2b3c4d", "gpu") == ("scaler", "1a2b3c4d")
    assert parse_name("cliffguard:gpu:b:3:1a2b3c4d", "gpu") is None      # device `gpu:b`'s
    assert parse_name("cliffguard:gpu2:3:1a2b3c4d", "gpu") is None
    assert parse_name("cliffguard:gpu:x:1a2b3c4d", "gpu") is None
    assert parse_name("cliffguard:gpu:3", "gpu") is None
    assert parse_name(claim_name("gpu"), "gpu") is None                # the config claim is no replica


# --- the autoscaler as leader and as follower, with fakes ---------------------------------------------
class _Client:
    def __init__(self, num_requests: int = 0) -> None:
        self.num_requests, self.num_in_flight, self.is_alive = num_requests, 0, True
        self.info = object()   # loaded: what the replica reported

    async def stats(self):
        return SimpleNamespace(num_requests=self.num_requests)


class _Link:
    def __init__(self) -> None:
        self.removed = 0
        self.placing, self.placed_at = False, -math.inf   # `RayLink`'s: when this gateway last placed the actor

    async def remove(self) -> None:
        self.removed += 1


class _Slot:
    """A replica slot as the autoscaler sees a `DeviceSupervisor` of a Ray device."""

    def __init__(self, replica: int, state: str, num_requests: int = 0, adopted: bool = False) -> None:
        self.device, self.replica, self.state, self.name = "d", replica, state, f"d/{replica}"
        self.draining, self.link = False, _Link()
        self.client = _Client(num_requests) if state == "ready" else None
        self.started_at, self.has_loaded, self.connect_failed = -math.inf, state == "ready", False
        self.adopted = adopted   # `start` connects to an actor another gateway placed, not one of its own

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    @property
    def is_active(self) -> bool:   # its supervisor task runs: not once it stopped or failed
        return self.state != "stopped" and not self.state.startswith("failed")

    def start(self) -> None:
        self.state, self.started_at, self.has_loaded = "loading", time.monotonic(), False
        # a start connects first (Ray's round trips); a slot it places reads `placing` only once placement begins
        self.connect_failed = self.adopted   # an adopted actor this gateway cannot reach

    def ready(self, num_requests: int = 0) -> None:
        self.state, self.client, self.has_loaded = "ready", _Client(num_requests), True

    async def stop(self) -> None:
        self.state, self.client = "stopped", None


class _Lease:
    """What the autoscaler reads of a `ScalerLease`; `pokes` records each renewal asked for."""

    def __init__(self, leader: bool, live: set[int] | None = None) -> None:
        self.leader, self.live, self.live_at = leader, live, time.monotonic()
        self.echo = True   # False: the renewals do not reach the actor (its answers list no new drain)
        self.view = LeaseView("me" if leader else "other", 10.0)
        self.pokes: list[tuple[str | None, tuple[int, ...]]] = []
        self.releases = 0

    def resign(self) -> None:
        self.leader = False

    async def release(self) -> None:
        self.releases += 1
        self.leader, self.view = False, LeaseView(None, 0.0)

    def is_leader(self) -> bool:
        return self.leader

    def poke(self, pressure, draining=()) -> None:
        self.pokes.append((pressure, tuple(draining)))
        if self.leader and self.echo:   # the actor's answer lists the holder's drains
            self.view = LeaseView("me", 10.0, draining=tuple(draining), pressure=self.view.pressure)

    def listed(self, live: set[int]) -> None:
        self.live, self.live_at = live, time.monotonic()


def _make_scaler(slots, lease, verdict=None) -> Autoscaler:
    spec = DeviceSpec(name="d", replicas=len(slots), min_replicas=1, scale_down_idle_seconds=5.0)
    verdict = {} if verdict is None else verdict
    return Autoscaler({"d": spec}, {"d": slots}, {}, GatewayMetrics(), overloaded=lambda: verdict,
                      leases={"d": lease})


def _scalings(scaler: Autoscaler) -> dict[str, float]:
    counted = {s.labels["direction"]: s.value for s in scaler.metrics.replica_scalings.collect()[0].samples
               if s.name.endswith("_total")}
    return {"up": 0.0, "down": 0.0} | counted


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(autoscaler_module, "ANNOUNCE_SECONDS", 0.05)
    monkeypatch.setattr(autoscaler_module, "REPLICA_POLL", 0.01)
    monkeypatch.setattr(autoscaler_module, "DRAIN_POLL", 0.01)


async def _settle() -> None:
    """Let the drains started by a tick run to their end (the fakes answer at once)."""
    for _ in range(20):
        await asyncio.sleep(0.005)


async def test_a_draining_gateway_hands_its_scaling_lease_back_at_once(quick):
    """SIGTERM's drain freezes the autoscaler; the leader's lease went on until its renewals lapsed
    (`LEASE_SECONDS`), no gateway deciding anything meanwhile. It is handed back at the freeze."""
    slots = [_Slot(0, "ready"), _Slot(1, "stopped")]
    lease = _Lease(leader=True, live={0})
    scaler = _make_scaler(slots, lease)
    scaler.start()
    pokes = len(lease.pokes)
    await scaler.freeze()
    assert not lease.is_leader()                  # no slot places from here on
    await asyncio.sleep(0)
    assert lease.releases == 1
    scaler.tick(now=100.0)
    assert len(lease.pokes) == pokes              # a frozen gateway asks for the lease no more
    await scaler.stop()


async def test_a_follower_follows_the_cluster_and_never_places_or_removes(quick):
    slots = [_Slot(0, "ready"), _Slot(1, "stopped"), _Slot(2, "ready"), _Slot(3, "stopped")]
    lease = _Lease(leader=False, live={0, 1})              # the leader placed 1 and removed 2; 3 is parked
    verdict = {"d": "overloaded: offered load 1.8 of 2 replica(s)' time"}
    scaler = _make_scaler(slots, lease, verdict)
    for t in range(8):                                    # past the idle time: a follower drains nothing itself
        scaler.tick(now=float(t))
        await _settle()
    assert [s.state for s in slots] == ["ready", "loading", "stopped", "stopped"]  # 1 connects, 2 stopped, 3 parked
    assert [s.link.removed for s in slots] == [0, 0, 0, 0]                        # nothing removed from the cluster
    assert lease.pokes[-1] == (verdict["d"], ())                 # its reason goes to the leader with each renewal
    assert _scalings(scaler) == {"up": 0.0, "down": 0.0}         # the leader counts what it decides

    slots[1].ready()
    lease.view = LeaseView("other", 10.0, draining=(1,))         # the leader drains 1: this gateway too
    scaler.tick(now=30.0)
    assert slots[1].draining and slots[1].state == "ready"
    lease.view = LeaseView("other", 10.0)                        # and takes it back
    scaler.tick(now=31.0)
    assert not slots[1].draining

    lease.listed(set())                                          # every actor gone: the min slot stays started
    scaler.tick(now=32.0)
    await _settle()
    assert [s.state for s in slots] == ["ready", "stopped", "stopped", "stopped"]
    lease.live = {0, 1}                                          # a listing older than the stop: stale
    scaler.tick(now=33.0)
    assert slots[1].state == "stopped"
    lease.listed({0, 1})
    scaler.tick(now=34.0)
    assert slots[1].state == "loading"


async def test_a_gateway_that_lost_the_lease_while_placing_a_replica_leaves_the_placement_be(quick):
    """Its actor is not listed yet (Ray has not placed its group): stopping it cancelled the wait and removed the
    group, which the new leader, placing the same slot, had adopted."""
    slots = [_Slot(0, "ready"), _Slot(1, "loading")]
    slots[1].link.placing = True
    lease = _Lease(leader=False, live={0})
    scaler = _make_scaler(slots, lease)
    scaler.tick(now=0.0)
    await _settle()
    assert [s.state for s in slots] == ["ready", "loading"] and not slots[1].draining
    slots[1].link.placing, slots[1].link.placed_at = False, time.monotonic()   # placed since the last listing
    scaler.tick(now=1.0)
    await _settle()
    assert slots[1].state == "loading"
    lease.listed({0})                                            # listed since, and not there: removed
    scaler.tick(now=2.0)
    await _settle()
    assert slots[1].state == "stopped"


async def test_the_leader_removes_only_a_replica_idle_for_every_gateway(quick, monkeypatch):
    monkeypatch.setattr(autoscaler_module, "ANNOUNCE_SECONDS", 0.3)
    slots = [_Slot(0, "ready"), _Slot(1, "ready", num_requests=2)]   # 1: another gateway's requests run on it
    lease = _Lease(leader=True, live={0, 1})
    scaler = _make_scaler(slots, lease)
    for t in range(7):                                               # idle here for 6 s: drained, then kept
        scaler.tick(now=float(t))
    await _settle()
    assert slots[1].state == "ready" and not slots[1].draining and slots[1].link.removed == 0
    assert all(draining == () for _, draining in lease.pokes)        # never announced

    slots[1].client.num_requests = 0                                 # idle for everyone now
    for t in range(7, 14):
        scaler.tick(now=float(t))
    assert slots[1].draining
    await asyncio.sleep(0.02)
    scaler.tick(now=14.0)
    assert lease.pokes[-1] == (None, (1,))                           # the drain is announced to the followers
    await asyncio.sleep(0.5)
    assert slots[1].state == "stopped" and slots[1].link.removed == 1 and slots[0].state == "ready"
    assert _scalings(scaler) == {"up": 0.0, "down": 1.0}
    scaler.tick(now=15.0)
    assert lease.pokes[-1] == (None, ())


async def test_a_request_that_comes_during_the_announcement_keeps_the_replica(quick, monkeypatch):
    monkeypatch.setattr(autoscaler_module, "ANNOUNCE_SECONDS", 0.2)
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    lease = _Lease(leader=True, live={0, 1})
    scaler = _make_scaler(slots, lease)
    for t in range(7):
        scaler.tick(now=float(t))
    await asyncio.sleep(0.05)
    slots[1].client.num_requests = 1                               # a follower's request, sent before it heard
    lease.leader = False                                           # and this gateway loses the lease meanwhile
    await asyncio.sleep(0.4)
    assert slots[1].state == "ready" and not slots[1].draining and slots[1].link.removed == 0


async def test_the_leader_scales_up_for_another_gateways_queue_and_adopts_a_live_parked_slot(quick):
    slots = [_Slot(0, "ready"), _Slot(1, "stopped"), _Slot(2, "stopped")]
    lease = _Lease(leader=True, live={0})
    scaler = _make_scaler(slots, lease)
    scaler.tick(now=0.0)
    assert [s.state for s in slots] == ["ready", "stopped", "stopped"]
    lease.view = LeaseView("me", 10.0, pressure="a request waited 2.5 s for KV credits (over 2 s)")
    scaler.tick(now=1.0)
    assert [s.state for s in slots] == ["ready", "loading", "stopped"]
    assert _scalings(scaler) == {"up": 1.0, "down": 0.0}
    lease.view = LeaseView("me", 10.0)
    lease.listed({0, 2})                                           # a previous leader placed 2 as it lost the lease
    scaler.tick(now=2.0)
    assert slots[2].state == "loading"
    assert _scalings(scaler) == {"up": 1.0, "down": 0.0}


async def test_a_followers_word_said_before_the_new_replica_served_it_starts_no_second_one():
    """The lease still carries a follower's reason for a replica when the one it asked for becomes ready (the
    follower clears it at its next tick and renewal): for ANNOUNCE_SECONDS after the device grew the leader does
    not act on it (it started one replica too many each time); a word that lasts past that still counts."""
    from gateway.workers.autoscaler import ANNOUNCE_SECONDS

    slots = [_Slot(0, "ready"), _Slot(1, "stopped"), _Slot(2, "stopped")]
    lease = _Lease(leader=True, live={0})
    scaler = _make_scaler(slots, lease)
    lease.view = LeaseView("me", 10.0, pressure="a request waited 2.5 s for KV credits (over 2 s)")
    scaler.tick(now=0.0)
    assert [s.state for s in slots] == ["ready", "loading", "stopped"]
    slots[1].ready()
    for t in (5.0, 5.0 + ANNOUNCE_SECONDS / 2, 5.0 + ANNOUNCE_SECONDS - 0.1):   # the word is the one said before replica 1 served
        scaler.tick(now=t)
    assert [s.state for s in slots] == ["ready", "ready", "stopped"]
    scaler.tick(now=5.0 + ANNOUNCE_SECONDS)              # still said, after the follower had time to clear it
    assert [s.state for s in slots] == ["ready", "ready", "loading"]


async def test_an_adopted_replica_past_min_whose_load_failed_is_tried_again_under_pressure():
    """A slot past `min` the leader adopted from the cluster (another gateway placed it) whose load failed for good
    (its restart too: the supervisor removes the actor it restarted in vain) is parked like one it added: pressure
    starts it again `RETRY_FAILED_SECONDS` after its failure (it stayed failed for ever, a slot of the device lost)."""
    from gateway.workers.autoscaler import RETRY_FAILED_SECONDS

    slots = [_Slot(0, "ready"), _Slot(1, "stopped", adopted=True)]
    lease = _Lease(leader=True, live={0, 1})
    scaler = _make_scaler(slots, lease)
    scaler.tick(now=0.0)
    assert slots[1].state == "loading"                          # adopted
    slots[1].state = "failed: device 'd/1' failed to start: CUDA out of memory"
    lease.listed({0})                                           # its actor removed
    lease.view = LeaseView("me", 10.0, pressure="a request waited 2.5 s for KV credits (over 2 s)")
    scaler.tick(now=1.0)
    scaler.tick(now=RETRY_FAILED_SECONDS)
    assert slots[1].state.startswith("failed")
    scaler.tick(now=1.0 + RETRY_FAILED_SECONDS)
    assert slots[1].state == "loading"


async def test_the_leader_never_removes_a_shared_replica_it_cannot_reach_that_may_serve_other_gateways(quick):
    """An actor the leader adopted from the cluster (another gateway placed it) that it cannot connect to reads
    "loading" here but may serve the others: it is no unneeded loading slot (it was removed, and the followers'
    streams on it died); nor is a replica that served and whose connection broke during the drain's poll."""
    slots = [_Slot(0, "ready"), _Slot(1, "stopped", adopted=True)]
    lease = _Lease(leader=True, live={0, 1})
    scaler = _make_scaler(slots, lease)
    for t in range(12):                                   # past the 5 s the autoscaler gives an unneeded slot
        scaler.tick(now=float(t))
        await _settle()
    assert slots[1].state == "loading" and slots[1].link.removed == 0
    slots[1].ready()                                      # it serves; then it is idle and drained ...
    broke = False
    for t in range(12, 30):
        scaler.tick(now=float(t))
        if ("d", 1) in scaler._announced and not broke:   # ... and once announced, the leader's connection breaks
            slots[1].client.is_alive, broke = False, True
        await _settle()
    assert broke and slots[1].link.removed == 0
    # kept, it serves the others again: not left drained (the followers sent it nothing) while unreachable
    assert not slots[1].draining and ("d", 1) not in scaler._removals and lease.pokes[-1][1] == ()


async def test_an_adopted_replica_that_never_loads_here_does_not_hold_back_a_scale_up(quick):
    """An actor another gateway placed, which this leader cannot connect to, reads "loading" here for good: it
    is no replica on its way (a scale-up waited for it for ever), so pressure starts a parked slot."""
    slots = [_Slot(0, "ready"), _Slot(1, "stopped", adopted=True), _Slot(2, "stopped")]
    lease = _Lease(leader=True, live={0, 1})
    scaler = _make_scaler(slots, lease)
    scaler.tick(now=0.0)
    assert [s.state for s in slots] == ["ready", "loading", "stopped"]
    lease.view = LeaseView("me", 10.0, pressure="a request waited 2.5 s for KV credits (over 2 s)")
    lease.echo = False
    scaler.tick(now=1.0)
    assert slots[2].state == "loading"
    # the slot it started reads "loading" before its placement begins (no `placing` yet): it is on its way, and
    # holds back the next start while the pressure lasts
    slots.append(_Slot(3, "stopped"))
    slots[2].connect_failed = True   # its start failed before placing (a claim pending): still this gateway's
    scaler = _make_scaler(slots, lease)
    scaler._added.add(("d", 2))      # the scale-up above started it
    for t in range(2, 6):
        scaler.tick(now=float(t))
    assert slots[3].state == "stopped"


async def test_a_drain_counts_its_announcement_from_when_the_lease_actor_has_it(quick):
    """The followers hear of a drain from the lease actor: while the leader's renewals do not reach it (one in
    flight for seconds), the replica is not removed however long it waits; once the actor lists it, the
    announcement's time runs and the idle replica goes."""
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    lease = _Lease(leader=True, live={0, 1})
    lease.echo = False
    scaler = _make_scaler(slots, lease)
    for t in range(20):
        scaler.tick(now=float(t))
        await _settle()
    assert slots[1].draining and slots[1].link.removed == 0 and lease.pokes[-1][1] == (1,)
    lease.echo = True
    for t in range(20, 40):
        scaler.tick(now=float(t))
        await _settle()
        if slots[1].link.removed:
            break
    assert slots[1].link.removed == 1


async def test_drains_a_previous_leader_asked_for_end_when_this_gateway_leads(quick):
    slots = [_Slot(0, "ready"), _Slot(1, "ready")]
    lease = _Lease(leader=False, live={0, 1})
    lease.view = LeaseView("other", 10.0, draining=(1,))
    scaler = _make_scaler(slots, lease)
    scaler.tick(now=0.0)
    assert slots[1].draining
    lease.leader, lease.view = True, LeaseView("me", 10.0)
    scaler.tick(now=1.0)
    assert not slots[1].draining


def test_take_over_is_a_serve_flag_and_a_gateway_key(tmp_path, tiny_model):
    from gateway.cli import build_parser
    from pools.config.yaml_file import load_config
    from tests.gateway.conftest import chat_pool_yaml

    assert build_parser().parse_args(["serve", "--take-over"]).take_over
    assert not build_parser().parse_args(["serve"]).take_over
    assert not load_config(chat_pool_yaml(tiny_model)).gateway.take_over
    assert load_config(chat_pool_yaml(tiny_model, gateway="{take_over: true}")).gateway.take_over


def test_a_stale_actor_handle_removes_only_its_own_actor_never_one_placed_since_under_the_name():
    """A follower keeps the handle of an actor the leader removed; the leader places the slot again (a new actor
    of the same name, serving other gateways); this gateway, now leading, finds its handle dead: it removes the
    name only when no actor holds it or the one there is its own (restarted by Ray), never the new one."""
    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError

    from engine.config import EngineConfig
    from gateway.workers.ray_cluster import RayReplica

    removed = []

    async def nothing(*args) -> None:
        return None

    async def remove(name: str) -> None:
        removed.append(name)

    cluster = SimpleNamespace(connect=nothing, claim=nothing, remove=remove)
    replica = RayReplica(cluster, "gpu", 0, EngineConfig())
    old, new = SimpleNamespace(_actor_id="a1"), SimpleNamespace(_actor_id="a2")

    async def died():
        raise ActorDiedError()

    replica._ask_endpoint = died

    async def endpoint_with(live) -> None:
        async def find():
            return live
        replica._actor, replica._find = old, find
        with pytest.raises(ActorDiedError):
            await replica.endpoint(1.0)
        assert replica._actor is None   # found again on the next start

    for live, removes in ((new, []), (None, [replica.name]), (old, [replica.name] * 2)):
        asyncio.run(endpoint_with(live))
        assert removed == removes, (live, removed)
    replica.may_place = lambda: False   # a follower removes nothing
    asyncio.run(endpoint_with(None))
    assert removed == [replica.name] * 2


async def test_restarting_a_ray_replica_never_blocks_the_event_loop(monkeypatch):
    """`ray.kill` waits for the cluster head's answer, and was called on the event loop: a hung replica's
    cluster, often slow or cut off then, froze every stream of the gateway for as long. It runs on a thread;
    a kill that fails is logged, not raised."""
    from engine.config import EngineConfig
    from gateway.workers import ray_cluster

    killed = []

    def slow_kill(actor, no_restart):
        time.sleep(0.5)
        if actor == "gone":
            raise RuntimeError("the cluster head did not answer")
        killed.append((actor, no_restart))

    monkeypatch.setattr(ray_cluster, "_ray", lambda: SimpleNamespace(kill=slow_kill))
    replica = ray_cluster.RayReplica(None, "gpu", 0, EngineConfig())
    replica._actor = "actor"
    began = time.perf_counter()
    replica.restart("hung: one step has run for 300 s")
    assert time.perf_counter() - began < 0.1
    await replica._restarting
    assert killed == [("actor", False)]
    replica._actor = "gone"
    replica.restart("hung again")
    await replica._restarting   # logged

    order = []   # the next connection waits for the kill: made before it lands, it reached the hung actor
    replica._actor = "actor"
    monkeypatch.setattr(ray_cluster, "_ray", lambda: SimpleNamespace(kill=lambda actor, no_restart: (
        time.sleep(0.3), order.append("killed"))))

    async def connect():
        order.append("connect")
        raise ConnectionError("stop here")

    replica.cluster = SimpleNamespace(connect=connect)
    replica.restart("hung a third time")
    with pytest.raises(ConnectionError):
        await replica.endpoint(timeout=5)
    assert order == ["killed", "connect"]


async def test_a_slot_waiting_on_a_scaling_lease_that_fails_says_why(monkeypatch):
    """A lease actor that cannot start (or answer) leaves the gateway no leader: its slots wait for a leader
    gateway to place them, and said only that, even on a single gateway, then "no gateway placed it within
    900 s"; they name the lease's failure (logged once, at WARNING)."""
    from engine.config import EngineConfig
    from gateway.workers import ray_cluster, scaler_lease

    async def nothing(*_):
        return None

    def refused():
        raise RuntimeError("the lease actor could not be scheduled\nmore lines")

    cluster = SimpleNamespace(gateway_id="A", connect=nothing, claim=nothing)
    lease = scaler_lease.ScalerLease(cluster, "gpu", "digest", num_slots=1)
    monkeypatch.setattr(lease, "_get_or_create", refused)
    await lease.renew()
    assert lease.failure == (f"the scaling lease {lease.name} did not answer: RuntimeError: the lease actor could "
                             "not be scheduled")
    replica = ray_cluster.RayReplica(cluster, "gpu", 0, EngineConfig())
    replica.may_place, replica.lease_failure = lease.is_leader, lambda: lease.failure

    async def none():
        return None

    replica._find = none
    monkeypatch.setattr(ray_cluster, "FIND_POLL_SECONDS", 0.01)
    with pytest.raises(TimeoutError, match=r"within 0.05 s \(the scaling lease .* did not answer: RuntimeError"):
        await replica._find_or_place(0.05)
    assert replica.status.startswith("waiting for the leader gateway to place it (the scaling lease")
