"""Several gateways on one Ray cluster (a local one-node cluster on 127.0.0.1): two gateways' scaling
leases on the one lease actor (one leads, the other takes over when the lease expires or is handed
back, a restarted lease actor grants nothing at first); a replica of a follower gateway never places,
and connects to the actor the leader placed; a device whose replicas of another config run on the
cluster is refused, in `/ready` and in each request's 503, unless the gateway takes over; of two configs
started at once, before either has a replica, one starts and the other waits for the device's claim,
then is refused for the first one's replicas. Skipped where Ray is not installed."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # keep every node on the loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")

from engine.config import EngineConfig  # noqa: E402
from gateway.workers.config_claim import ClaimPending, claim_name, config_digest  # noqa: E402
from gateway.workers import ray_cluster  # noqa: E402
from gateway.workers.ray_cluster import ConfigConflict, RayCluster, RayReplica  # noqa: E402
from gateway.workers.scaler_lease import ScalerLease  # noqa: E402

LEASE = 2.0   # seconds: short, so that an expiry is waited for here
NEVER_LOADED = EngineConfig(model="/nonexistent/never-loaded", device="cpu", cpu_threads=1)


@pytest.fixture(scope="module")
def head():
    """One node of 2 CPUs (`ray.cluster_utils.Cluster`); the test process is a driver of it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _make_stand_in(name: str):
    """A detached actor named `name` holding nothing: what the cluster lists for a replica of that name."""
    @ray.remote(num_cpus=0)
    class StandIn:
        def ping(self) -> bool:
            return True

    return StandIn.options(name=name, namespace="cliffguard", lifetime="detached").remote()


def _count_checks(cluster: RayCluster, checks: list) -> None:
    """Each `check_config` that `cluster` makes, appended to `checks`."""
    check = cluster.check_config

    async def counted(device: str, digest: str) -> None:
        checks.append((device, digest))
        await check(device, digest)

    cluster.check_config = counted


async def _lead_at_once(lease: ScalerLease, timeout: float) -> float:
    """Renew every 0.1 s until `lease` leads; the seconds it took."""
    started = time.monotonic()
    while not lease.is_leader():
        assert time.monotonic() - started < timeout, f"no lease within {timeout} s: {lease.view}"
        await lease.renew()
        await asyncio.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.slow   # ~15 s on a real cluster; the lease's rules without one are in test_ray_leader.py
async def test_one_gateway_leads_the_other_takes_over_when_the_lease_expires_or_is_handed_back(head):
    first, second = RayCluster(head.address), RayCluster(head.address)   # two gateways: two ids
    assert first.gateway_id != second.gateway_id
    a = ScalerLease(first, "lead", "0123abcd", 2, lease_seconds=LEASE)
    b = ScalerLease(second, "lead", "0123abcd", 2, lease_seconds=LEASE)
    try:
        await a.renew()
        await b.renew(pressure="a request waited 2.5 s for KV credits")
        assert not b.is_leader() and b.view.holder == first.gateway_id   # a's lease held when b asked
        await a.renew()   # (a's own count of its lead is checked after its renewal: b's first one may take LEASE)
        assert a.is_leader() and a.view.pressure == "a request waited 2.5 s for KV credits"   # the follower's queue

        # the leader stops renewing (a crash, a partition): the other leads within the lease time, and
        # never while the first still counts itself the leader
        last = time.monotonic()
        while not b.is_leader():
            await b.renew()
            assert not (b.is_leader() and a.is_leader())
            await asyncio.sleep(0.05)
        assert time.monotonic() - last <= LEASE + 1.0
        await a.renew()
        assert not a.is_leader() and a.view.holder == second.gateway_id

        await b.release()                                   # a gateway that stops hands it back: at once
        assert await _lead_at_once(a, timeout=1.0) < 0.5

        # Ray restarts the lease actor (it forgot a's lease): it grants b nothing until a's may be over
        ray.kill(ray.get_actor(a.name, namespace="cliffguard"), no_restart=False)
        killed = time.monotonic()
        while not b.is_leader():
            await b.renew()
            assert not (b.is_leader() and a.is_leader())
            await asyncio.sleep(0.05)
        assert time.monotonic() - killed >= LEASE - 0.1
    finally:
        await first.remove(a.name)


async def test_a_follower_replica_never_places_and_connects_to_the_actor_the_leader_placed(head):
    leader_cluster, follower_cluster = RayCluster(head.address), RayCluster(head.address)
    follower = RayReplica(follower_cluster, "follow", 0, NEVER_LOADED)
    follower.may_place = lambda: False
    try:
        with pytest.raises(TimeoutError, match="no gateway placed it"):
            await follower.endpoint(timeout=1.5)
        assert follower.status == "waiting for the leader gateway to place it"
        assert await follower_cluster.device_names("follow") == {}          # neither a group nor an actor

        waiting = asyncio.ensure_future(follower.endpoint(timeout=120))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        leader = RayReplica(leader_cluster, "follow", 0, NEVER_LOADED)    # the leader places it (its load
        placed = await leader.endpoint(timeout=120)                        # fails here; the actor answers)
        assert await asyncio.wait_for(waiting, 30) == placed                # the same actor, port and key
        groups = [g for g in (await asyncio.to_thread(ray.util.placement_group_table)).values()
                  if g["name"] == leader.name and g["state"] != "REMOVED"]
        assert len(groups) == 1 and sorted(await leader_cluster.device_names("follow")) == [leader.name]
        assert await leader_cluster.live_slots("follow", leader.digest) == {0}
    finally:
        await leader_cluster.remove(follower.name)


async def test_replicas_of_another_config_refuse_the_device_unless_it_takes_over(head):
    from ray.util.placement_group import placement_group

    await RayCluster(head.address).connect()
    digest = config_digest(NEVER_LOADED)
    group = placement_group([{"CPU": 0.1}], name="cliffguard:conf:0:deadbeef", lifetime="detached")
    await group.ready()
    others = [_make_stand_in("cliffguard:conf:1:deadbeef"), _make_stand_in("cliffguard:conf:scaler:deadbeef")]
    await asyncio.gather(*(o.ping.remote() for o in others))
    same = _make_stand_in(f"cliffguard:conf:0:{digest}")
    past = _make_stand_in(f"cliffguard:conf:5:{digest}")
    await asyncio.gather(same.ping.remote(), past.ping.remote())

    refused = RayCluster(head.address)
    replica = RayReplica(refused, "conf", 0, NEVER_LOADED)
    for _ in range(2):                                     # said at the device's start, and at every later one
        with pytest.raises(ConfigConflict) as caught:
            await replica.endpoint(timeout=5)
        message = str(caught.value)
        assert "device 'conf'" in message and "digest deadbeef" in message and "--take-over" in message
    assert len(await refused.device_names("conf")) == 5     # nothing removed

    taking = RayCluster(head.address, take_over=True)
    await taking.claim("conf", digest)
    left = await taking.device_names("conf")
    assert sorted(left) == [f"cliffguard:conf:0:{digest}", f"cliffguard:conf:5:{digest}"]   # its own stay
    await taking.remove_slots_past("conf", digest, 2)     # what the leader does on taking the lease
    assert sorted(await taking.device_names("conf")) == [f"cliffguard:conf:0:{digest}"]
    await taking.remove(f"cliffguard:conf:0:{digest}")


async def test_two_configs_started_at_once_one_starts_the_other_waits_for_the_claim_then_is_refused(
        head, monkeypatch):
    monkeypatch.setattr(ray_cluster, "RECHECK_SECONDS", 0.5)
    await RayCluster(head.address).connect()
    clusters = {digest: RayCluster(head.address) for digest in ("aaaa0000", "bbbb0000")}
    checks = []
    for cluster in clusters.values():
        _count_checks(cluster, checks)
    results = await asyncio.gather(*(c.claim("race", d) for d, c in clusters.items()), return_exceptions=True)
    waiting = [r for r in results if isinstance(r, ClaimPending)]
    assert len(waiting) == 1 and results.count(None) == 1, results    # neither has placed anything yet
    started, other = ("aaaa0000", "bbbb0000") if results[0] is None else ("bbbb0000", "aaaa0000")
    assert f"(digest {started})" in str(waiting[0]) and "trying again" in str(waiting[0])
    with pytest.raises(ClaimPending):                                  # asked again at once: the same answer,
        await clusters[other].claim("race", other)
    assert len(checks) == 2                                            # not a new check
    placed = _make_stand_in(f"cliffguard:race:0:{started}")            # the winner places its replica
    await placed.ping.remote()
    joining = RayCluster(head.address)
    await joining.claim("race", started)                               # a gateway of the same config joins
    await clusters[started].release_claims()                           # the first one stops
    await asyncio.sleep(0.5)
    with pytest.raises(ClaimPending):                                  # the one that joined holds it still
        await clusters[other].claim("race", other)
    await joining.release_claims()
    await asyncio.sleep(0.5)
    for _ in range(2):                                                 # now the replica is listed: refused for good
        with pytest.raises(ConfigConflict, match=f"digest {started}"):
            await clusters[other].claim("race", other)
    await RayCluster(head.address, take_over=True).claim("race", "cccc0000")   # removes the replica
    with pytest.raises(ClaimPending, match="digest cccc0000"):        # the claim is the taker's
        await clusters[started].check_config("race", started)
    assert await RayCluster(head.address).device_names("race") == {}    # the claim actor is no replica


async def test_a_gateway_whose_device_has_replicas_of_another_config_says_so_in_ready_and_503s(
        aiohttp_client, tmp_path, tiny_model, head):
    from gateway.app import create_app
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config
    from tests.gateway.test_app import _model
    from tests.gateway.test_ray_placement import _on_ray, _ready_body

    await RayCluster(head.address).connect()
    other = _make_stand_in("cliffguard:cpu:0:deadbeef")
    await other.ping.remote()
    try:
        path = tmp_path / "pools.yaml"
        path.write_text(_on_ray(tiny_model, head.address, replicas=1))
        client = await aiohttp_client(create_app(Gateway.from_config(load_config(path))))
        body = await _ready_body(client, lambda b: "failed" in b["devices"]["cpu"])
        state = body["devices"]["cpu"]
        assert "device 'cpu'" in state and "another config (digest deadbeef)" in state and "--take-over" in state
        r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": "x", "max_tokens": 2})
        assert r.status == 503 and "digest deadbeef" in (await r.json())["error"]["message"]
        await client.close()
        assert "cliffguard:cpu:0:deadbeef" in await asyncio.to_thread(ray.util.list_named_actors)   # left alone
    finally:
        ray.kill(other, no_restart=True)


@pytest.mark.slow
async def test_two_gateways_share_an_autoscaled_device_one_decides_and_the_other_follows(
        aiohttp_client, tmp_path, tiny_model, head):
    """Gateways A and B of one config: A leads (places slot 0), B connects to it. A burst on B alone makes
    A place slot 1 (B's queue reaches A through the lease) and B connects to it; when quiet, A removes
    it and B stops its slot; when A stops, B leads."""
    from tests.gateway.test_app import _client, _model
    from tests.gateway.test_autoscaler import _replicas, _wait_for
    from tests.gateway.test_ray_placement import _on_ray

    text = _on_ray(tiny_model, head.address, replicas="{min: 1, max: 2, scale_up_wait_seconds: 0.3, "
                                                       "scale_down_idle_seconds: 2}")
    client_a, gateway_a = await _client(aiohttp_client, text, tmp_path)
    client_b, gateway_b = await _client(aiohttp_client, text, tmp_path)
    lease_a, lease_b = gateway_a.autoscaler.leases["cpu"], gateway_b.autoscaler.leases["cpu"]
    assert lease_a.is_leader() and not lease_b.is_leader()
    pids = [[s.client.info.pid for s in g.supervisors["cpu"] if s.is_ready] for g in (gateway_a, gateway_b)]
    assert pids[0] == pids[1] and len(pids[0]) == 1                  # B connected to A's replica

    async def one(i: int) -> str:
        r = await client_b.post("/v1/completions", json={"model": _model(tiny_model), "prompt": f"Story {i}:",
                                                         "max_tokens": 200, "temperature": 0, "ignore_eos": True})
        await r.read()
        assert r.status == 200
        return r.headers["x-cliffguard-replica"]

    burst = asyncio.gather(*(one(i) for i in range(24)))
    await _wait_for(client_b, {"ready": 2, "stopped": 0}, timeout=90)   # A placed slot 1, B connected to it
    assert set(await burst) == {"0", "1"}
    names = sorted(n for n in await asyncio.to_thread(ray.util.list_named_actors) if n.startswith("cliffguard:cpu:"))
    assert names == sorted([lease_a.name, claim_name("cpu")] + [s.link.name for s in gateway_a.supervisors["cpu"]])
    # quiet: A removes slot 1 once no gateway's request runs on it; B stops its slot 1
    for client in (client_a, client_b):
        await _wait_for(client, {"ready": 1, "stopped": 1, "draining": 0}, timeout=60)
    scalings = [{dict(labels)["direction"]: v for labels, v in (await _scraped(c))["cliffguard_replica_scalings_total"]
                 .items()} for c in (client_a, client_b)]
    assert scalings == [{"up": 1.0, "down": 1.0}, {"up": 0.0, "down": 0.0}]   # A decided both
    # A stops (its lease handed back): B leads at its next renewal
    await client_a.close()
    for _ in range(50):
        if lease_b.is_leader():
            break
        await asyncio.sleep(0.1)
    assert lease_b.is_leader()
    assert _replicas(await _scraped(client_b)) == {"ready": 1, "stopped": 1, "loading": 0, "draining": 0,
                                                   "restarting": 0, "failed": 0}
    await client_b.close()
    for name in names:
        await RayCluster(head.address).remove(name)


async def _scraped(client) -> dict:
    from tests.gateway.test_app import _metrics

    return _metrics(await (await client.get("/metrics")).text())


async def test_pending_death_notices_never_hold_up_a_replicas_state(head):
    """Each gateway keeps one `wait_stopped` pending per replica (and a dropped connection's stays up to
    30 s): more of them than the actor's threads must not queue `state`, or `restart_unless_responsive`
    restarts a healthy replica (`ray_cluster.replica_actor_class`: their own concurrency group)."""
    from gateway.workers.ray_cluster import ACTOR_CONCURRENCY, RESPONSIVE_SECONDS, WATCH_SECONDS

    gateway = RayCluster(head.address)
    await gateway.connect()
    replica = RayReplica(gateway, "notices", 0, NEVER_LOADED)
    actor = await replica._place(60.0)
    assert isinstance(await asyncio.wait_for(actor.state.remote(), 60.0), str)   # started
    waits = [actor.wait_stopped.remote(WATCH_SECONDS) for _ in range(ACTOR_CONCURRENCY + 4)]
    await asyncio.sleep(1.0)
    await asyncio.wait_for(actor.state.remote(), RESPONSIVE_SECONDS)     # answered beside them
    await asyncio.wait_for(actor.endpoint.remote(), RESPONSIVE_SECONDS)
    assert not any(ray.wait(waits, timeout=0)[0])                        # still pending: they were running
    await gateway.remove(replica.name)
