"""`placement: ray` on a local cluster with fake GPUs (127.0.0.1 only, no CUDA used): a replica learns its
GPUs from Ray inside its actor at every start, so a restart, and a restart in a group Ray moved to another
node, runs on the GPUs its group holds then; a placement group no node can hold is removed when the wait
for it ends. Skipped where Ray is not installed."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # keep every node on the loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")

from engine.config import EngineConfig  # noqa: E402
from gateway.workers.ray_cluster import RayCluster, RayReplica  # noqa: E402

HEAD_GPUS = 4   # two blockers of two GPUs each: the replica can only go to the other node, first


@pytest.fixture(scope="module")
def gpu_cluster():
    """A head with 4 fake GPUs (and 4 `slot`s, which only the blockers ask for) and a node with 2."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": HEAD_GPUS, "resources": {"slot": HEAD_GPUS}, "node_ip_address": "127.0.0.1",
        "include_dashboard": False})
    cluster.other = cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _make_replica(cluster: RayCluster, device: str, config: EngineConfig) -> RayReplica:
    peers: list[RayReplica] = []
    replica = RayReplica(cluster, device, 0, config, peers)
    peers.append(replica)
    return replica


async def _group_gpus(group) -> list[int]:
    """The GPU each bundle of `group` holds (its bundles are free: a one-GPU task runs in each)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu() -> int:
        return int(ray.get_runtime_context().get_accelerator_ids()["GPU"][0])

    return list(await asyncio.gather(*(gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i))
                                       .remote() for i in range(group.bundle_count))))


async def _settled(replica: RayReplica, timeout: float = 60.0) -> str:
    """The actor's state once it is no longer `loading`."""
    for _ in range(int(timeout / 0.25)):
        state = await replica._actor.state.remote()
        if state != "loading":
            return state
        await asyncio.sleep(0.25)
    raise AssertionError(f"still loading after {timeout} s")


async def _restarted(replica: RayReplica, old_pid: int, timeout: float = 120.0) -> int:
    for _ in range(int(timeout / 0.25)):
        try:
            pid = await asyncio.wait_for(replica._actor.pid.remote(), 5)
            if pid != old_pid:
                return pid
        except Exception:  # noqa: BLE001 - ActorUnavailableError, RayActorError while Ray restarts it
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"the actor was not restarted within {timeout} s")


@pytest.mark.slow   # ~23 s on a real cluster; placement on a cluster is shown in test_ray_placement.py
async def test_a_restarted_replica_runs_on_the_gpus_its_group_holds_now(gpu_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    cluster = RayCluster(gpu_cluster.address)
    await cluster.connect()
    blockers = [placement_group([{"GPU": 1, "slot": 1}] * 2, strategy="STRICT_PACK") for _ in range(2)]
    await asyncio.gather(*(b.ready() for b in blockers))   # the head's GPUs are all held
    # no CUDA here: the replica's engine fails to load (no CUDA device), its actor answers all the same
    config = EngineConfig(model="/nonexistent/never-loaded", device="cuda", tensor_parallel_size=2, cpu_threads=1)
    replica = _make_replica(cluster, "gpu", config)
    try:
        await replica.endpoint(timeout=120)
        assert replica.node_id == gpu_cluster.other.node_id
        first = await replica._actor.gpu_ids.remote()
        assert sorted(first) == [0, 1]                       # the other node's two GPUs, one per rank
        assert (await _settled(replica)).startswith("failed: ")   # it never loads here, and says why

        # free two of the head's GPUs, other than the ones the replica holds, then lose the replica's node:
        # Ray moves its group to the head and restarts the actor there, with the same arguments
        held = [await _group_gpus(b) for b in blockers]
        freed = next(i for i, gpus in enumerate(held) if set(gpus) != set(first))
        remove_placement_group(blockers[freed])
        pid = await replica._actor.pid.remote()
        await asyncio.to_thread(gpu_cluster.remove_node, gpu_cluster.other)
        await _restarted(replica, pid)
        assert await replica._actor.endpoint.remote() is not None
        moved = await replica._actor.gpu_ids.remote()
        assert sorted(moved) == sorted(held[freed]) and sorted(moved) != sorted(first), (moved, first, held)
    finally:
        await cluster.remove(replica.name)
        for blocker in blockers:
            remove_placement_group(blocker)


async def test_a_group_no_node_can_hold_is_removed_when_the_wait_ends_and_placed_anew_next_time(gpu_cluster):
    cluster = RayCluster(gpu_cluster.address)
    replica = _make_replica(cluster, "huge", EngineConfig(model="/nonexistent/never-loaded", device="cpu",
                                                          cpu_threads=64))
    for attempt in range(2):
        with pytest.raises(TimeoutError, match=r"'CPU': 64.0.*removed"):
            await replica.endpoint(timeout=1.5)
        groups = [g for g in (await asyncio.to_thread(ray.util.placement_group_table)).values()
                  if g["name"] == replica.name]
        assert groups and all(g["state"] == "REMOVED" for g in groups), groups
        assert len(groups) == attempt + 1                    # each start asked for a group of its own
