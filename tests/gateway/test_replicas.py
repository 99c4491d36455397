"""A replicated device (`replicas: 2`): both replicas serve every pool, placed by token load and prefix
affinity (each engine's report of its prefix-cache hit reaching the placement); each shows in /metrics,
/ready and /v1/models; a replica killed under load loses no request that had sent no token, the other
serves meanwhile, and the killed one rejoins."""

from __future__ import annotations

import asyncio
import os
import signal

from gateway.workers.supervisor import Backoff
from tests.gateway.conftest import pools_yaml
from tests.gateway.test_app import _client, _metrics, _model, _stream_text

FAST = Backoff(initial_seconds=0.2, max_seconds=1.0)


def _replicated(tiny_model) -> str:
    return pools_yaml(tiny_model, device_keys="replicas: 2, cpu_threads: 1")


async def _all_ready(client, timeout: float = 60.0) -> dict:
    for _ in range(int(timeout / 0.05)):
        r = await client.get("/ready")
        body = await r.json()
        if body["status"] == "ready":
            return body
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not every replica became ready: {body}")


async def _complete(client, model: str, prompt, max_tokens: int = 8, **extra) -> tuple[str, dict]:
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True, **extra})
    body = await r.json()
    assert r.status == 200, body
    return r.headers["x-cliffguard-replica"], body


async def test_both_replicas_serve_a_pool_and_a_repeated_prefix_goes_back_to_its_replica(aiohttp_client, tmp_path,
                                                                                          tiny_model):
    client, gateway = await _client(aiohttp_client, _replicated(tiny_model), tmp_path)
    ready = await _all_ready(client)
    assert ready["replicas"] == {"cpu": ["ready", "ready"]} and ready["devices"] == {"cpu": "ready"}
    model = _model(tiny_model)
    # ten short requests at once: their token load splits them over both replicas
    answers = await asyncio.gather(*(_complete(client, model, f"Story number {i}:", 24) for i in range(10)))
    replicas = [replica for replica, _ in answers]
    assert sorted(set(replicas)) == ["0", "1"] and min(replicas.count("0"), replicas.count("1")) >= 4
    # a long document (rag), then questions on it one after the other: each goes where it is cached, and
    # each engine's report of what it found cached reaches the placement (which keeps its record then)
    rag = gateway.pools["rag"].admission
    reports, report = [], rag.engine_cached
    rag.engine_cached = lambda key, prompt, num: (reports.append((prompt, num)), report(key, prompt, num))
    document = [100 + i % 900 for i in range(320)]
    first, _ = await _complete(client, model, document + [5, 6, 7])
    again = [await _complete(client, model, document + [8 + i, 9]) for i in range(4)]
    assert [replica for replica, _ in again] == [first] * 4
    assert reports == [(0, 0)] + [(0, 320)] * 4           # the document's 20 blocks, found by each question
    work = rag.placement.work([document + [10, 11]], 8, 1, 512, gateway.pools["rag"].cache_salt("default"))
    assert rag.placement.matched_tokens(work, int(first)) == 320
    m = _metrics(await (await client.get("/metrics")).text())
    cached = m["cliffguard_replica_cached_prompt_tokens_total"]
    assert cached[(("pool", "rag"), ("replica", first))] >= 4 * 320 - 4 * 16
    for replica in ("0", "1"):
        labels = (("pool", "chat"), ("replica", replica))
        assert m["cliffguard_kv_credits"][labels] == m["cliffguard_kv_credits_free"][labels] > 0
        assert m["cliffguard_replica_requests_total"][labels] >= 4
        assert labels in m["cliffguard_num_requests_running"]
        assert (("device", "cpu"), ("replica", replica)) in m["cliffguard_engine_steps_total"]
    entry = next(p for p in (await (await client.get("/v1/models")).json())["data"][0]["pools"] if p["name"] == "rag")
    assert entry["replicas"] == entry["replicas_ready"] == 2
    for worker in gateway.clients["cpu"]:
        stats = await worker.stats(check=True)        # runs check_integrity in each worker
        assert stats.num_requests == 0


async def test_a_killed_replica_loses_no_request_that_sent_no_token_and_rejoins(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, _replicated(tiny_model), tmp_path)
    await _all_ready(client)
    for supervisor in gateway.supervisors["cpu"]:
        supervisor.backoff = FAST
    model = _model(tiny_model)
    victim = gateway.clients["cpu"][0]
    # whole (non-streamed) answers: no token reaches their client before the end, so each is retryable
    whole = [asyncio.create_task(_complete(client, model, f"Tell me about cliff number {i}.", 200)) for i in range(6)]
    stream = await client.post("/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                        "max_tokens": 400, "ignore_eos": True, "stream": True})
    while victim.num_in_flight < 2 or gateway.clients["cpu"][1].num_in_flight < 2:
        await asyncio.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    while (await (await client.get("/ready")).json())["replicas"]["cpu"][0] == "ready":
        await asyncio.sleep(0.02)
    during = await client.get("/ready")
    body = await during.json()
    assert during.status == 200 and body["status"] == "degraded" and body["replicas"]["cpu"][1] == "ready"
    assert body["replicas"]["cpu"][0].startswith("restarting: ")
    served_meanwhile, _ = await _complete(client, model, "A new request while replica 0 restarts.")
    assert served_meanwhile == "1"
    results = await asyncio.gather(*whole)
    assert all(b["usage"]["completion_tokens"] == 200 for _, b in results)   # every one answered, once
    _, chunks = await _stream_text(stream)
    if stream.headers["x-cliffguard-replica"] == "0":   # tokens had gone out: a clear error ends it
        assert chunks[-1]["error"]["code"] == "engine_dead"
        assert gateway.metrics.errors.labels(status="503")._value.get() == 1   # a failed request, its 200 aside
    else:
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    await _all_ready(client)                            # the killed replica rejoins
    assert gateway.clients["cpu"][0] is not victim and gateway.supervisors["cpu"][0].num_restarts == 1
    m = _metrics(await (await client.get("/metrics")).text())
    assert m["cliffguard_worker_restarts_total"][(("device", "cpu"), ("replica", "0"))] == 1
    assert m["cliffguard_worker_restarts_total"][(("device", "cpu"), ("replica", "1"))] == 0
    for pool in gateway.pools.values():
        ledger = pool.admission.ledger
        ledger.check_integrity()
        for _ in range(100):   # what a worker reported mid-request comes back with its next report
            if ledger.free == ledger.total:
                break
            await asyncio.sleep(0.05)
        assert ledger.free == ledger.total and pool.admission.placement.load == [0, 0]
