"""A partition between a gateway and a replica on a local two-node Ray cluster (127.0.0.1 only): a relay
between them stops forwarding without closing anything; the gateway's client and the replica's actor each
drop the connection within `engine.remote.SILENCE_SECONDS` (20 s) of the last frame that passed, the
replica aborts what that gateway had in flight, and a second gateway then connects and is served. Slow
(~50 s: the bound itself is 20 s); skipped where Ray is not installed."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # keep every node on the loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")

from engine import remote  # noqa: E402
from engine.client import EngineDeadError  # noqa: E402
from engine.config import CacheConfig, EngineConfig, PoolConfig  # noqa: E402
from engine.remote_client import RemoteEngineClient  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from gateway.workers.ray_cluster import RayCluster, RayReplica  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.engine.test_remote import _Link, _Relay  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


async def _sessions(replica: RayReplica) -> int:
    return (await replica._actor.sessions.remote()).get("num_sessions", 0)


async def _ready(replica: RayReplica, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := await replica._actor.state.remote()) == "loading":
        assert time.monotonic() < deadline, "the replica did not load"
        await asyncio.sleep(0.25)
    assert state == "ready", state


async def test_a_partition_is_noticed_by_both_ends_within_the_bound_then_another_gateway_is_served(
        two_nodes, tmp_path, builtin_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama", builtin_path)
    config = EngineConfig(model=str(folder), device="cpu", cpu_threads=1, cache=CacheConfig(block_size=8),
                          pools=(PoolConfig(num_blocks=64),))
    cluster = RayCluster(two_nodes.address)
    replica = RayReplica(cluster, "part", 0, config, [])
    relay = None
    try:
        host, port, key = await replica.endpoint(timeout=120)
        await _ready(replica)
        relay = _Relay((host, port))
        link = _Link(None, key, relay.address)   # the gateway's path to the actor goes through the relay
        link.restart_unless_responsive = replica.restart_unless_responsive   # Ray's own answer decides
        first = RemoteEngineClient(config, link)
        served_by = (await first.start(timeout=60)).pid
        stream = first.generate([9, 10, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                request_id="partitioned")
        await stream.__anext__()
        first.pause("partitioned", True)
        assert await _sessions(replica) == 1
        await asyncio.sleep(0.5)
        relay.freeze()
        frozen = time.monotonic()
        reason = await asyncio.wait_for(first.died, remote.SILENCE_SECONDS + remote.KEEPALIVE_SECONDS + 5)
        gateway_seconds = time.monotonic() - frozen
        while await _sessions(replica):
            assert time.monotonic() - frozen < remote.SILENCE_SECONDS + 5, "the replica kept the session"
            await asyncio.sleep(0.2)
        replica_seconds = time.monotonic() - frozen
        assert "nothing received" in reason, reason
        assert gateway_seconds <= remote.SILENCE_SECONDS + remote.KEEPALIVE_SECONDS + 1, gateway_seconds
        assert replica_seconds <= remote.SILENCE_SECONDS + 2, replica_seconds
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

        await first._checking   # the silence was put to Ray: the actor answered, so it was not restarted
        second = RemoteEngineClient(config, _Link(None, key, (host, port)))   # another gateway, on a good path
        assert (await second.start(timeout=60)).pid == served_by
        assert (await second.stats(check=True)).num_requests == 0   # the partitioned gateway's request was aborted
        tokens = [t async for d in second.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
                  for t in d.outputs[0].delta_token_ids]
        assert len(tokens) == 4
        await second.shutdown()
        assert link.restarts == []
        print(f"\ngateway noticed in {gateway_seconds:.1f} s, replica in {replica_seconds:.1f} s "
              f"(bound {remote.SILENCE_SECONDS:g} s)")
    finally:
        if relay is not None:
            relay.close()
        await cluster.remove(replica.name)
