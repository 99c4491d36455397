"""`placement: ray`: replicas as Ray actors on a local two-node cluster (127.0.0.1 only), driven by the
gateway like local workers: the openai SDK through them, a gateway restart that finds them loaded, a
node lost under load with nothing lost that had sent no token, and the errors a misconfigured cluster
gives. Skipped where Ray is not installed (`pip install -e '.[ray]'`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import urllib.error
import urllib.request

import pytest

# Ray resolves 127.0.0.1 to the machine's outward address unless clusters are "unsupported" here: keep
# every node, GCS and actor on the loopback (read when Ray is imported, so before the import below).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from gateway.workers.config_claim import claim_name  # noqa: E402
from tests.gateway.conftest import chat_pool_yaml  # noqa: E402
from tests.gateway.test_app import _client, _model  # noqa: E402
from tests.gateway.test_replicas import _all_ready  # noqa: E402

NODE_CPUS = 2   # each node holds both replicas (one CPU each): the survivor of a node loss takes the other


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a second node, as two raylets on this machine (`ray.cluster_utils.Cluster`)."""
    cluster = start_local_cluster(NODE_CPUS)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
async def _no_replicas_left(ray_cluster):
    """Each test starts without an earlier test's replicas of device `cpu`: one of another config would
    refuse the device (tests/gateway/test_ray_leader_cluster.py)."""
    await remove_device(ray_cluster.address, "cpu")


async def remove_device(address: str, device: str) -> None:
    """Remove every actor and placement group of `device` (replicas and scaling lease, any config)."""
    from gateway.workers.ray_cluster import RayCluster

    cluster = RayCluster(address)
    await cluster.connect()
    for name in await cluster.device_names(device):
        await cluster.remove(name)


def start_local_cluster(node_cpus: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": node_cpus, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    cluster.worker = cluster.add_node(num_cpus=node_cpus, node_ip_address="127.0.0.1")
    return cluster


def _on_ray(tiny_model, address: str, *, replicas: int | str = 2, extra: str = "", model=None) -> str:
    return chat_pool_yaml(model or tiny_model, max_model_len=256, gateway="{stall_seconds: 30}",
                          extra="    max_queue_seconds: 20\n" + extra,
                          device_keys=f"replicas: {replicas}, cpu_threads: 1, placement: ray, ray_address: '{address}'")


def _nodes_of(gateway) -> list[str]:
    return [s.link.node_id for s in gateway.supervisors["cpu"]]


async def test_two_replicas_on_two_nodes_serve_the_sdk_survive_a_gateway_restart_and_a_node_loss(
        aiohttp_client, tmp_path, tiny_model, ray_cluster):
    client, gateway = await _client(aiohttp_client, _on_ray(tiny_model, ray_cluster.address), tmp_path)
    ready = await _all_ready(client, timeout=120)
    assert ready["replicas"] == {"cpu": ["ready", "ready"]}
    nodes = _nodes_of(gateway)
    assert len(set(nodes)) == 2, nodes                      # one replica on each node
    pids = [s.client.info.pid for s in gateway.supervisors["cpu"]]

    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    model = _model(tiny_model)
    whole = await sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    stream = await sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                          stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == whole.choices[0].text
    chat = await sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await sdk.completions.create(model=model, prompt="x", temperature=9)
    assert [m.id for m in (await sdk.models.list()).data] == [model]
    answers = await asyncio.gather(*(sdk.completions.with_raw_response.create(
        model=model, prompt=f"Story {i}:", max_tokens=16, temperature=0) for i in range(8)))
    assert {a.headers["x-cliffguard-replica"] for a in answers} == {"0", "1"}

    # a gateway restart finds both actors loaded: same processes, no reload
    await client.close()
    await sdk.close()
    client, gateway = await _client(aiohttp_client, _on_ray(tiny_model, ray_cluster.address), tmp_path)
    await _all_ready(client, timeout=60)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    assert [s.client.info.pid for s in gateway.supervisors["cpu"]] == pids
    assert _nodes_of(gateway) == nodes

    # the second node goes away under load: whole answers (no token sent yet) are retried on the survivor
    for supervisor in gateway.supervisors["cpu"]:
        supervisor.backoff = type(supervisor.backoff)(initial_seconds=0.2, max_seconds=1.0)
    worker_node = ray_cluster.worker.node_id
    assert worker_node in nodes
    load = [asyncio.ensure_future(sdk.completions.create(model=model, prompt=f"Tale {i}:", max_tokens=48,
                                                         temperature=0, extra_body={"ignore_eos": True}))
            for i in range(12)]
    await asyncio.sleep(0.3)
    await asyncio.to_thread(ray_cluster.remove_node, ray_cluster.worker)
    done = await asyncio.gather(*load)
    assert all(r.usage.completion_tokens == 48 for r in done)
    head = ray_cluster.head_node.node_id
    for _ in range(1200):                                      # Ray restarts the lost actor on the head node
        if set(_nodes_of(gateway)) == {head} and all(s.is_ready for s in gateway.supervisors["cpu"]):
            break
        await asyncio.sleep(0.1)
    assert set(_nodes_of(gateway)) == {head}
    await _all_ready(client, timeout=10)
    restarted = await sdk.completions.create(model=model, prompt="Again", max_tokens=4, temperature=0)
    assert restarted.usage.completion_tokens == 4
    await sdk.close()


@pytest.mark.slow   # ~14 s on a real cluster; a cluster that does not answer is said in tests/gateway/test_supervisor.py
async def test_a_wrong_address_a_node_without_the_model_and_a_replica_never_placed_are_said(
        aiohttp_client, tmp_path, tiny_model, ray_cluster):
    from gateway.app import create_app
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config

    async def _serving(text: str, name: str):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        return await aiohttp_client(create_app(Gateway.from_config(load_config(path))))

    # nothing listens there: the gateway says so at once, naming the address, and tries again (a head not up yet)
    wrong = _on_ray(tiny_model, "127.0.0.1:9", replicas=1).replace("{stall_seconds: 30}",
                                                                   "{stall_seconds: 30, device_wait_seconds: 1}")
    client = await _serving(wrong, "wrong")
    body = await _ready_body(client, lambda b: "failed" in b["devices"]["cpu"])
    assert "(the last try failed: cannot reach the Ray cluster at '127.0.0.1:9'" in body["devices"]["cpu"]
    r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": "x", "max_tokens": 2})
    assert r.status == 503 and "127.0.0.1:9" in (await r.json())["error"]["message"]

    # the node has the tokenizer and config but not the weights: the replica's own error, named
    bare = tmp_path / "no-weights"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    client = await _serving(_on_ray(tiny_model, ray_cluster.address, replicas=1, model=bare), "bare")
    body = await _ready_body(client, lambda b: "failed" in b["devices"]["cpu"], timeout=120)
    assert "cpu" in body["devices"]["cpu"] and "safetensors" in body["devices"]["cpu"]
    import ray

    # its actor is removed: it held its group's resources, and refused the next config (ConfigConflict)
    deadline = time.monotonic() + 30
    while any(n.startswith("cliffguard:cpu:0:") for n in await asyncio.to_thread(ray.util.list_named_actors)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    await client.close()                              # the gateway stops: its claim on the device ends

    # a bundle no node can hold: /ready says what it waits for, a request gets a 503 naming the replica
    text = _on_ray(tiny_model, ray_cluster.address, replicas=1, extra="").replace("cpu_threads: 1", "cpu_threads: 64")
    client = await _serving(text.replace("max_queue_seconds: 20", "max_queue_seconds: 2"), "huge")
    body = await _ready_body(client, lambda b: "Ray to place" in b["devices"]["cpu"])   # once it leads (at once)
    assert "'CPU': 64.0" in body["devices"]["cpu"]
    r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": "x", "max_tokens": 2})
    error = (await r.json())["error"]
    assert r.status == 503 and error["code"] == "pool_unavailable" and "cpu: loading" in error["message"]
    await client.close()


async def test_a_placement_group_left_without_its_actor_is_placed_in_not_refused(tiny_model, ray_cluster):
    """A gateway killed between placing a replica's (detached, named) group and starting its actor leaves the
    group behind: Ray refuses a second group of that name, so every later start of the slot failed. The slot
    is placed in the group it left, and serves."""
    from ray.util.placement_group import placement_group, placement_group_table

    from engine.config import CacheConfig, EngineConfig, PoolConfig
    from gateway.workers.ray_cluster import RayCluster, RayReplica

    config = EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", cpu_threads=1,
                          cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=64),))
    cluster = RayCluster(ray_cluster.address)
    replica = RayReplica(cluster, "cpu", 0, config)
    await cluster.connect()
    left = await asyncio.to_thread(placement_group, replica.bundles.as_list(), strategy="STRICT_PACK",
                                   name=replica.name, lifetime="detached")
    try:
        host, port, _ = await replica.endpoint(120)
        assert host and port
        groups = [g for g in placement_group_table().values() if g["name"] == replica.name and g["state"] != "REMOVED"]
        assert [g["placement_group_id"] for g in groups] == [left.id.hex()]
    finally:
        await replica.remove()
        await cluster.release_claims()


async def _ready_body(client, want, timeout: float = 30.0) -> dict:
    body = {}
    for _ in range(int(timeout / 0.1)):
        r = await client.get("/ready")
        body = await r.json()
        if r.status == 503 and want(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"/ready never said it: {body}")


@pytest.mark.slow
async def test_autoscaling_on_ray_adds_an_actor_for_a_burst_and_removes_it_when_quiet(aiohttp_client, tmp_path,
                                                                                     tiny_model, ray_cluster):
    """The autoscaler's test (tests/gateway/test_autoscaler.py) with replicas as Ray actors: the added replica is
    a new placement group and actor, the removed one's actor and group are gone from the cluster."""
    from tests.gateway.test_autoscaler import burst_then_quiet

    scaling = "{min: 1, max: 2, scale_up_wait_seconds: 0.3, scale_down_idle_seconds: 2}"
    client, gateway = await _client(aiohttp_client, _on_ray(tiny_model, ray_cluster.address, replicas=scaling),
                                    tmp_path)
    await burst_then_quiet(client, gateway, _model(tiny_model))
    names = await asyncio.to_thread(ray.util.list_named_actors)
    assert sorted(n for n in names if n.startswith("cliffguard:cpu:")) == sorted(
        [gateway.supervisors["cpu"][0].link.name, gateway.autoscaler.leases["cpu"].name,   # slot 0, the lease
         claim_name("cpu")])                                                                # and the config claim
    await client.close()


@pytest.fixture(scope="module")
def sdk(ray_cluster, tmp_path_factory):
    """`cliffguard serve` on config/pools.yaml (SmolLM2, chat and rag pools) with its device as two Ray replicas,
    for the openai SDK tests of tests/gateway/test_openai_sdk.py (imported below, run against it)."""
    from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer

    text = DEFAULT_CONFIG.read_text().replace(
        "replicas: 1                # identical copies of the device, each serving both pools (one GPU or TP group each)",
        f"replicas: 2\n    cpu_threads: 1\n    placement: ray\n    ray_address: '{ray_cluster.address}'")
    assert "placement: ray" in text
    path = tmp_path_factory.mktemp("ray-serve") / "pools.yaml"
    path.write_text(text)
    server = LiveServer(path, timeout=300)
    try:
        for _ in range(3000):
            try:
                with urllib.request.urlopen(server.url + "/ready", timeout=5) as r:
                    if b'"status": "ready"' in r.read():
                        break   # both replicas loaded
            except urllib.error.HTTPError:
                pass
            time.sleep(0.1)
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


from tests.gateway import test_openai_sdk as sdk_tests  # noqa: E402


@pytest.mark.slow
def test_sdk_chat_through_ray_replicas_of_the_default_config(sdk):
    sdk_tests.test_sync_chat_streamed_equals_non_streamed(sdk)


@pytest.mark.slow
def test_sdk_completions_through_ray_replicas_of_the_default_config(sdk):
    sdk_tests.test_sync_completions_streamed_equals_non_streamed_with_raw_response_header(sdk)


@pytest.mark.slow
def test_sdk_errors_through_ray_replicas_of_the_default_config(sdk):
    sdk_tests.test_sdk_sees_errors_as_typed_exceptions(sdk)
