"""Two gateways on one Ray cluster and one config, sharing one replica under a steady load, and one of
them killed with `kill -9` mid-run (docs/SCALE.md, "Leases on a replica's KV credits"):

- nothing is lost that had not sent a token: a request the killed gateway failed before its first token
  is sent to the survivor, as a load balancer would, and answered; only streams that had sent tokens
  through the killed gateway end cut (reported);
- the replica never reserves nor holds more KV credits than its pool has: its own counters
  (`engine.remote.ReplicaActor.sessions`), asked through Ray every 0.2 s, and its high-water marks;
- the survivor leases the whole pool again at once (within `LEASE_BACK_S`), as the replica's counters
  and the survivor's own `/metrics` say (its credits; and the replica's counters it exports,
  `cliffguard_replica_held_credits`).

Each gateway is `cliffguard serve` (`bench.live.LiveServer`) on the same YAML (`placement: ray`, one
replica of one thread, a 256 KiB pool); the first places the replica, the second follows and connects
to it. The local one-node Ray cluster on 127.0.0.1 is started here and stopped after (with what it
started: the replica's actor and the scaling lease). Skipped where Ray is not installed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # keep every node on the loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray")

from bench.chaos.replicas import ReplicaCounters, counters_summary, lease_back_s, within_capacity  # noqa: E402
from bench.chaos.steady import Chaos, plan_steady, run_steady  # noqa: E402
from bench.load.scrape import pool_samples  # noqa: E402
from bench.live import LiveServer  # noqa: E402
from bench.ray_local import LocalRayCluster  # noqa: E402

RATE = 4.0            # steady chat requests a second (16 streamed tokens each), to the two gateways in turn
LOAD_S = 20.0         # seconds of arrivals
KILL_AT_S = 8.0       # the second gateway is killed this long into the load
LOOK_EVERY_S = 0.2    # between looks at the replica's counters
LEASE_BACK_S = 2.0    # SCALE.md: a killed gateway's share is offered to the others at once


@pytest.fixture(scope="module")
def cluster():
    """One node of 2 CPUs: the replica (one thread) and room to spare."""
    with LocalRayCluster(1, 2) as local:
        yield local


def _scraped(server: LiveServer) -> dict[str, float]:
    """The pool's samples on the gateway's /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
        return pool_samples(r.read().decode())["chat"]


async def _load_with_a_kill(cluster, survivor: LiveServer, doomed: LiveServer):
    """The steady load to both gateways, `doomed` killed at `KILL_AT_S`; the replica's counters looked at
    throughout. Returns (the load's records, the looks, the kill's time, the survivor's /metrics before and
    after the kill)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(survivor.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        start = time.perf_counter()
        counters = ReplicaCounters(cluster, start, interval=LOOK_EVERY_S)
        assert await counters.look_once() is not None, counters.error     # connected to the cluster
        ctx = Chaos(survivor.url, model, survivor.proc.pid, start, counters.latest().t_s, None, 60.0, session,
                    None, None, steady_urls=[survivor.url, doomed.url])
        stop = asyncio.Event()
        looking = asyncio.create_task(counters.run(stop))
        load = asyncio.create_task(run_steady(ctx, plan_steady(model, RATE, 0.0, LOAD_S, seed=7), asyncio.Event()))
        await asyncio.sleep(KILL_AT_S)
        shared = await asyncio.to_thread(_scraped, survivor)
        os.kill(doomed.proc.pid, signal.SIGKILL)
        killed_s = ctx.now()
        await load
        whole = await asyncio.to_thread(_scraped, survivor)
        stop.set()
        await looking
    return ctx.records, counters.looks, killed_s, (shared, whole)


@pytest.mark.slow   # ~45 s of a local Ray cluster and two gateways: `pytest -m slow tests/gateway/test_two_gateways.py`
def test_a_gateway_killed_mid_run_loses_nothing_unstarted_and_its_share_returns_to_the_survivor(
        cluster, tiny_model, tmp_path):
    from tests.gateway.test_ray_placement import _on_ray

    path = tmp_path / "pools.yaml"
    path.write_text(_on_ray(tiny_model, cluster.address, replicas=1))
    began = time.monotonic()
    with LiveServer(path) as survivor, LiveServer(path) as doomed:     # the first places, the second follows
        records, looks, killed_s, (shared, whole) = asyncio.run(_load_with_a_kill(cluster, survivor, doomed))
    (name, replica), = counters_summary(looks).items()
    pool = replica["pools"]["chat"]
    capacity = pool["capacity"]
    cut = [r for r in records if r.outcome != "ok"]
    retried = [r for r in records if r.retried]
    print(f"\n{len(records)} requests, {len(retried)} sent again to the survivor, cut after tokens: "
          f"{[(r.rid, r.error) for r in cut]}; replica {name}: {replica}; {time.monotonic() - began:.0f} s",
          file=sys.stderr)

    # nothing lost that had not sent a token: only streams with tokens through the killed gateway are cut
    assert len(records) >= RATE * LOAD_S / 2
    assert all(r.outcome == "cut" and r.gateway == 1 and r.ttft_s is not None and r.sent_s < killed_s
               for r in cut), [(r.rid, r.outcome, r.gateway, r.ttft_s, r.error) for r in cut]
    assert retried and all(r.gateway == 0 and r.outcome == "ok" for r in retried)
    assert all(r.answers == 1 for r in records if r.outcome == "ok")

    # the replica never promised nor reserved more than it has (each look, and its own high-water marks)
    assert within_capacity({name: replica}), replica
    assert all(p["reserved_credits"] <= p["capacity"] and p["held_credits"] <= p["capacity"]
               for look in looks for c in look.replicas.values() for p in c["pools"].values())
    assert 0 < pool["peak_reserved"] <= capacity and pool["peak_held"] == capacity

    # both gateways shared the pool (by demand: each at least its floor of a quarter; half and half while
    # neither asks more, as under this light load); the survivor leases the whole of it again at once
    before = [look.replicas[name]["pools"]["chat"]["leases"] for look in looks if look.t_s < killed_s]
    assert sum(before[-1]) == capacity and min(before[-1]) >= capacity // 4, before[-1]
    assert capacity // 4 <= shared["cliffguard_kv_credits"] <= capacity - capacity // 4   # the survivor's lease
    assert whole["cliffguard_kv_credits"] == capacity
    assert shared["cliffguard_replica_held_credits"] == whole["cliffguard_replica_held_credits"] == capacity
    back = lease_back_s(looks, killed_s)
    assert back is not None and back <= LEASE_BACK_S, back
    assert looks[-1].replicas[name]["num_sessions"] == 1
