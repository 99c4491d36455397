"""`cliffguard bench chaos --ray-nodes N`: the config copy placed on a local Ray cluster, the options that
go with it, the chat TTFT p99 per 5-s bin and when it is back within 1.5x the warm-up's, when /ready
saw a replica down and back, the processes the faults aim at on a cluster, a second gateway (`--gateways
2`: which failures the steady load sends to the other gateway, the kill_gateway fault's options) and the
replicas' own counters in the report (over capacity, the lease back to one gateway), and (slow) one `--quick`
run of `lose_node` on a two-node cluster of this machine: nothing lost, nothing answered twice, the
lost replica back; and (slow) the only node of a cluster lost under load, in-process: each waiting
request answered 503 with Retry-After, none as a poison request, then the node back and served.
Skipped where Ray is not installed (`pip install -e '.[ray]'`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

# keeps every node on 127.0.0.1: read when Ray is imported (here, and by the gateway that inherits it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray")

from bench.chaos import (DEFAULT_CONFIG, FAULT_TIMERS, _fault_names, build_report, chaos_config,  # noqa: E402
                         format_report, ttft_bins, ttft_recovered)
from bench.chaos.fault_script import FaultRun, replica_outage  # noqa: E402
from bench.chaos.replicas import (CountersLook, ReplicaCounters, counters_summary, lease_back_s,  # noqa: E402
                                  within_capacity)
from bench.chaos.arguments import FAULTS  # noqa: E402
from bench.chaos.steady import (Chaos, Sample, SteadyRecord, StreamTally, gateway_failed, parse_replicas,  # noqa: E402
                                replica_pids)
from bench.ray_local import INSTALL_HINT, LocalRayCluster, _import_ray  # noqa: E402
from gateway.cli import main  # noqa: E402
from pools.config.yaml_file import load_config  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.gateway.conftest import pools_yaml  # noqa: E402


def _chat(rid: str, sent: float, ttft: float | None, kind: str = "chat") -> SteadyRecord:
    return SteadyRecord(rid, kind, sent_s=sent, end_s=sent + 1.0, http_status=200, ttft_s=ttft, answers=1,
                        outcome="ok" if ttft is not None else "error")


def _sample(t: float, *states: str) -> Sample:
    return Sample(t, True, 0.01, {"chat": (10.0, 10.0)}, 1 << 20, {"cpu": list(states)} if states else {})


def test_the_config_copy_places_one_replica_per_node_on_the_cluster(tmp_path):
    path = chaos_config(DEFAULT_CONFIG, tmp_path, 3, ray_address="127.0.0.1:6379")
    config, default = load_config(path, env={}), load_config(DEFAULT_CONFIG, env={})
    for device in config.devices.values():
        assert (device.placement, device.ray_address, device.replicas, device.cpu_threads) == \
            ("ray", "127.0.0.1:6379", 3, 1)
    assert config.gateway.stall_seconds == FAULT_TIMERS["stall_seconds"] and config.pools == default.pools
    own = tmp_path / "own"
    own.mkdir()
    kept = load_config(chaos_config(DEFAULT_CONFIG, own, 2, timers=False, ray_address="127.0.0.1:1"), env={})
    assert kept.gateway == default.gateway and kept.devices["default"].placement == "ray"
    local = load_config(chaos_config(DEFAULT_CONFIG, tmp_path, 2), env={})   # --replicas alone: no Ray
    assert local.devices["default"].placement == "local" and local.devices["default"].replicas == 2


def test_ttft_bins_from_the_fault_and_when_they_are_back_within_1_5x_the_warm_up():
    warm = [_chat(f"w{i}", 1.0 + 0.5 * i, 0.10) for i in range(10)]
    # the fault at 10 s: 0-5 s slow (2 s), 5-10 s too few requests, 10-15 s at 1.4x, 15-17 s (the last, short)
    fault = [_chat(f"a{i}", 10.0 + 0.8 * i, 2.0) for i in range(6)] + [_chat(f"b{i}", 15.5 + i, 0.11) for i in range(3)]
    fault += [_chat(f"c{i}", 20.0 + 0.8 * i, 0.14) for i in range(6)] + [_chat(f"d{i}", 25.0 + 0.3 * i, 0.1)
                                                                       for i in range(5)]
    fault += [_chat("rag", 21.0, 9.0, kind="rag"), _chat("failed", 21.0, None)]
    bins = ttft_bins(warm + fault, 10.0, 27.0)
    assert [(b["from_s"], b["num_chat"]) for b in bins] == [(0.0, 6), (5.0, 3), (10.0, 6), (15.0, 5)]
    assert bins[0]["ttft_p99_s"] == pytest.approx(2.0) and bins[2]["ttft_p99_s"] == pytest.approx(0.14)
    assert [b["num_unanswered"] for b in bins] == [0, 0, 1, 0]
    assert ttft_recovered(bins, 0.10) == 15.0                      # 10-15 s: its failed request got no token
    answered = ttft_bins([r for r in warm + fault if r.rid != "failed"], 10.0, 27.0)
    assert ttft_recovered(answered, 0.10) == 10.0
    assert ttft_recovered(bins, 0.10, factor=1.2) == 15.0
    assert ttft_recovered(bins, 0.10, min_chat=7) is None and ttft_recovered(bins, None) is None
    assert ttft_recovered(bins, 0.10, min_chat=3) == 5.0          # the 3-request bin at 0.11 s counts then
    assert ttft_bins(warm, 10.0, 10.0) == [] and ttft_bins(warm, 0.0, 3.0)[0]["num_chat"] == 4


def test_replica_outage_from_ready_states():
    samples = [_sample(9.0, "ready", "ready"), _sample(10.5, "ready", "ready"), _sample(11.0),   # no answer
               _sample(11.5, "ready", "restarting: replica cpu/1: Ray reports the actor dead"),
               _sample(12.0, "ready", "loading: waiting for the actor to start"), _sample(14.0),
               _sample(16.0, "ready", "ready"), _sample(17.0, "ready", "stopped")]
    assert replica_outage(samples, 10.0, 20.0) == (pytest.approx(1.5), pytest.approx(6.0))
    assert replica_outage(samples, 10.0, 15.0) == (pytest.approx(1.5), None)
    assert replica_outage(samples, 16.0, 20.0) == (None, None)
    body = json.dumps({"status": "degraded", "replicas": {"cpu": ["ready", "restarting: x"]}})
    assert parse_replicas(body) == {"cpu": ["ready", "restarting: x"]}
    assert parse_replicas("") == {} and parse_replicas("[1]") == {}


def test_the_report_has_bins_ttft_back_and_the_replica_outage_per_fault():
    records = [_chat(f"w{i}", 2.0 + 0.5 * i, 0.1) for i in range(12)]
    records += [_chat(f"f{i}", 10.0 + 0.5 * i, 3.0 if i < 20 else 0.12) for i in range(30)]
    run = FaultRun("lose_node", 10.0, injected_s=10.2, end_s=18.0, window_end_s=25.0,
                   notes={"node": "771768e38a67", "node_index": 1, "replica_pids": [42]})
    samples = [_sample(t / 4, "ready", "ready" if not 42 <= t < 80 else "restarting: gone") for t in range(0, 100)]
    raw = {"model": "m", "records": records, "runs": [run], "samples": samples, "load_start_s": 2.0,
           "load_end_s": 25.0, "duration_s": 26.0}
    report = build_report(raw, {"config": "c", "timers": "t", "date": "d", "commit": "x", "load": "l"})
    json.dumps(report)
    fault = report["faults"][0]
    assert fault["title"] == "lose a Ray node" and report["warmup"]["ttft_p99_s"] == pytest.approx(0.1)
    assert [b["num_chat"] for b in fault["ttft_bins"]] == [10, 10, 10]
    assert fault["ttft_recovered_s"] == 10.0
    assert (fault["replica_down_s"], fault["replica_back_s"]) == (pytest.approx(0.5), pytest.approx(10.0))
    table = format_report(report)
    assert "1 lose a Ray node" in table and "TTFT back" in table and "node=771768e38a67" in table
    assert "0s 3000/10, 5s 3000/10, 10s 120/10" in table and "from 10 s" in table
    assert "a replica down at 0.5 s, all up at 10.0 s" in table


def test_fault_selection_and_the_ray_options():
    assert _fault_names(None, 0) == list(FAULTS) and _fault_names(None, 2) == [*FAULTS, "lose_node"]
    assert _fault_names("lose_node, kill_worker", 2) == ["lose_node", "kill_worker"]
    assert _fault_names("lose_node,lose_node", 3) == ["lose_node", "lose_node"]
    for faults, nodes, said in (("lose_node", 0, "--ray-nodes >= 2"), ("lose_node", 1, "--ray-nodes >= 2"),
                                ("lose_node,lose_node", 2, "2 worker nodes"), ("nap", 2, "unknown")):
        with pytest.raises(ValueError, match="--faults") as err:
            _fault_names(faults, nodes)
        assert said in str(err.value)


def test_kill_gateway_needs_a_second_gateway_which_needs_a_cluster():
    assert _fault_names(None, 1, 2) == [*FAULTS, "kill_gateway"]
    assert _fault_names(None, 2, 2) == [*FAULTS, "lose_node", "kill_gateway"]
    assert "kill_gateway" not in _fault_names(None, 2)
    assert _fault_names("kill_gateway", 1, 2) == ["kill_gateway"]
    for faults, gateways, said in (("kill_gateway", 1, "--gateways 2"), ("kill_gateway,kill_gateway", 2, "2 gateways")):
        with pytest.raises(ValueError, match="--faults") as err:
            _fault_names(faults, 1, gateways)
        assert said in str(err.value)


def test_a_request_goes_to_the_other_gateway_only_when_its_gateway_failed_before_a_token():
    def record(status: int | None) -> SteadyRecord:
        return SteadyRecord("r", "chat", http_status=status)

    def tally(lines: list) -> StreamTally:
        t = StreamTally()
        for i, event in enumerate(lines):
            t.add(event, 0.1 * i)
        return t

    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    token = {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    assert gateway_failed(record(None), None, False)                        # refused, or dropped before headers
    assert gateway_failed(record(200), tally([role]), False)                # headers, then gone before a token
    assert not gateway_failed(record(200), tally([role, token]), False)     # tokens sent: cut, not retried
    assert not gateway_failed(record(503), None, False)                     # an answer
    assert not gateway_failed(record(None), None, True)                     # the client's timeout


def _look(t: float, leases: list[int], reserved: int = 0, held: int | None = None, peak: int = 0) -> CountersLook:
    pool = {"capacity": 512, "reserved_credits": reserved, "held_credits": sum(leases) if held is None else held,
            "peak_reserved": peak, "peak_held": 512, "leases": leases}
    return CountersLook(t, {"cliffguard:cpu:0:abcd": {"num_sessions": len(leases), "num_sessions_served": 2,
                                                      "pools": {"chat": pool}}})


def test_the_replicas_counters_over_capacity_and_the_lease_back_to_one_gateway():
    looks = [_look(1.0, [512]), _look(2.0, [256, 256], 192, peak=240), _look(3.1, [256]), _look(3.3, [512], 48)]
    assert lease_back_s(looks, 3.0) == pytest.approx(0.3) and lease_back_s(looks[:3], 3.0) is None
    summary = counters_summary(looks)
    pool = summary["cliffguard:cpu:0:abcd"]["pools"]["chat"]
    assert summary["cliffguard:cpu:0:abcd"]["max_sessions"] == 2 and summary["cliffguard:cpu:0:abcd"]["num_looks"] == 4
    assert (pool["max_reserved"], pool["max_held"], pool["peak_reserved"], pool["looks_over_capacity"]) == \
        (192, 512, 240, 0)
    assert within_capacity(summary)
    assert not within_capacity(counters_summary([*looks, _look(4.0, [512], held=520)]))
    assert not within_capacity(counters_summary([*looks, _look(4.0, [512], peak=600)]))   # its own mark says so
    raw = {"model": "m", "records": [_chat(f"w{i}", 2.0 + 0.5 * i, 0.1) for i in range(4)], "runs": [],
           "samples": [_sample(1.0)], "load_start_s": 2.0, "load_end_s": 5.0, "duration_s": 6.0,
           "counters": ReplicaCounters(None, 0.0, looks=looks)}
    report = build_report(raw, {"config": "c", "timers": "t", "date": "d", "commit": "x", "load": "l"})
    assert report["verdict"]["within_capacity"] and report["verdict"]["met"]
    table = format_report(report)
    assert "up to 2 gateways at once" in table and "reserved max 192 (own peak 240)" in table
    assert "replicas within capacity (ok)" in table


@pytest.mark.parametrize("argv, option", [
    (["--faults", "lose_node"], "--faults"), (["--ray-nodes", "-1"], "--ray-nodes"),
    (["--gateways", "2"], "--gateways"), (["--faults", "kill_gateway", "--ray-nodes", "1"], "--faults"),
    (["--ray-nodes", "2", "--ray-node-cpus", "0"], "--ray-node-cpus"),
    (["--ray-nodes", "2", "--replicas", "2"], "--replicas")])
def test_bad_ray_options_exit_2_naming_the_option(argv, option, capsys):
    assert main(["bench", "chaos", *argv]) == 2
    assert option in capsys.readouterr().err


def test_without_ray_the_cluster_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # `import ray` raises ImportError
    with pytest.raises(RuntimeError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        _import_ray()
    with pytest.raises(ValueError):
        LocalRayCluster(0)
    with pytest.raises(RuntimeError, match="not started"):
        _ = LocalRayCluster(2).address


class _FakeCluster:
    def __init__(self, raylets: dict[str, int]) -> None:
        self.raylets = raylets

    def raylet_pids(self) -> dict[str, int]:
        return self.raylets


def test_replica_actors_are_the_raylets_children_titled_as_the_actor():
    actor = subprocess.Popen(["bash", "-c", "exec -a ray::ReplicaActor sleep 30"])
    idle = subprocess.Popen(["bash", "-c", "exec -a ray::IDLE sleep 30"])
    try:
        for _ in range(100):                               # until bash has exec'd
            found = replica_pids(_FakeCluster({"node-a": os.getpid(), "node-b": idle.pid}))
            if found["node-a"]:
                break
            time.sleep(0.02)
        assert found == {"node-a": [actor.pid], "node-b": []}
        ctx = Chaos("http://x", "m", os.getpid(), 0.0, 0.0, None, 1.0, None, None, None,
                    cluster=_FakeCluster({"n": os.getpid()}))
        assert ctx.worker_pids() == [actor.pid]
    finally:
        for proc in (actor, idle):
            proc.kill()
            proc.wait()


# --- one run on a local two-node cluster --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("chaos-ray") / "llama", "llama", builtin_path,
                           vocab_size=49152, max_position_embeddings=1024)


@pytest.mark.slow
def test_quick_lose_node_on_two_nodes_loses_nothing_and_the_replica_comes_back(tiny_model, tmp_path, capsys):
    config = yaml.safe_load(pools_yaml(tiny_model, chat_max=128))
    config["gateway"].update(FAULT_TIMERS)
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(config))
    rc = main(["bench", "chaos", "--config", str(path), "--quick", "--ray-nodes", "2", "--faults", "lose_node",
               "--rate", "2", "--json", "--out", str(tmp_path / "out")])
    report = json.loads(capsys.readouterr().out)
    assert rc == (0 if report["verdict"]["met"] else 1)
    assert report["ray"]["nodes"] == 2 and report["ray"]["address"].startswith("127.0.0.1:")
    (fault,) = report["faults"]
    assert fault["name"] == "lose_node" and fault["notes"]["node_index"] == 1 and fault["notes"]["replica_pids"]
    assert report["overall"]["lost"] == 0, report["overall"]
    assert report["overall"]["duplicated"] == 0, report["overall"]
    assert fault["replica_down_s"] is not None and fault["replica_back_s"] is not None, fault
    assert fault["ttft_bins"] and report["warmup"]["ttft_p99_s"] is not None
    print(json.dumps({k: fault[k] for k in ("recovery_s", "ttft_p99_s", "ttft_bins", "ttft_recovered_s",
                                            "replica_down_s", "replica_back_s", "notes", "steady")}), file=sys.stderr)


# --- the only node lost under load ---------------------------------------------------------------------------

@pytest.fixture
def one_node_cluster():
    """A Ray cluster whose one node for replicas is a worker node (2 CPUs): the head holds the GCS and no
    CPU, so removing the worker loses every replica, and adding a node brings them back (bench chaos's
    `lose_node` removes a worker node the same way)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        cluster.worker = cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()           # the in-process gateway's driver
        cluster.shutdown()


def _one_node_config(model, address: str) -> str:
    from tests.gateway.conftest import chat_pool_yaml

    gateway = ("{stall_seconds: 30, device_wait_seconds: 3, "
               "restart_backoff: {initial_seconds: 0.2, factor: 2, max_seconds: 1}}")
    return chat_pool_yaml(model, max_model_len=256, gateway=gateway, extra="    max_queue_seconds: 6\n",
                          device_keys=f"replicas: 2, cpu_threads: 1, placement: ray, ray_address: '{address}'")


@pytest.mark.slow   # ~25 s; a node lost under two replicas is in the default suite (test_ray_placement.py)
async def test_losing_the_only_node_answers_each_waiting_request_503_with_retry_after_never_poison(
        one_node_cluster, aiohttp_client, tmp_path, tiny_model):
    import asyncio

    from tests.gateway.test_app import _client
    from tests.gateway.test_replicas import _all_ready

    client, gateway = await _client(aiohttp_client, _one_node_config(tiny_model, one_node_cluster.address), tmp_path)
    await _all_ready(client, timeout=180)
    supervisors = gateway.supervisors["cpu"]
    assert {s.link.node_id for s in supervisors} == {one_node_cluster.worker.node_id}   # both on the one node
    body = {"model": tiny_model.name, "prompt": "Tell me a long story about the sea.", "max_tokens": 120,
            "temperature": 0, "ignore_eos": True}
    load = [asyncio.ensure_future(client.post("/v1/completions", json=dict(body, user=f"r{i}"))) for i in range(8)]
    for _ in range(600):
        if all(s.client.num_in_flight >= 2 for s in supervisors):
            break
        await asyncio.sleep(0.01)
    assert all(s.client.num_in_flight for s in supervisors), "the load never reached both replicas"
    await asyncio.to_thread(one_node_cluster.remove_node, one_node_cluster.worker)
    meanwhile = await client.post("/v1/completions", json=dict(body, max_tokens=4))
    answers = [(r.status, r.headers.get("Retry-After"), (await r.json())["error"]) for r in await asyncio.gather(*load)]
    answers.append((meanwhile.status, meanwhile.headers.get("Retry-After"), (await meanwhile.json())["error"]))
    assert all(status == 503 and retry_after for status, retry_after, _ in answers), answers
    assert not any(error["code"] == "poison_request" for _, _, error in answers), answers
    lost = [d for d in supervisors[0].deaths.deaths if d.cause == "loss"]
    assert {d.replica for d in lost} == {0, 1} and not any(supervisors[0].deaths.counts(d) for d in lost)

    one_node_cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")   # it comes back (Ray: on the main thread)
    await _all_ready(client, timeout=240)
    r = await client.post("/v1/completions", json=dict(body, max_tokens=4))
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
