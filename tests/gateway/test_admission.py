"""Admission by KV credits, in-process over a tiny model: floods are held at the gateway, never refused,
tenants are served fairly, and a body's priority cannot buy more than its tenant may use."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.admission import AdmissionMetrics
from gateway.app import create_app
from gateway.monitoring.metrics import GatewayMetrics
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from tests.gateway.conftest import start_gateway


def _yaml(model, *, tenants: str = "", chat_kv: str = "64KiB", max_queue: str = "") -> str:
    # the tiny model stores 512 bytes of K/V per token: 64 KiB = 8 blocks of 16 tokens = 128 credits,
    # max_num_seqs 8 (avg_len 16); a short prompt with max_tokens 4 reserves one block
    return f"""
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - name: chat
    model: {model}
    device: cpu
    kv_cache_bytes: {chat_kv}
    avg_len: 16
    max_model_len: 128
    {max_queue}
{tenants}"""




async def _idle_stats(pool):
    for _ in range(100):
        stats = await pool.client.stats(check=True)
        if stats.num_requests == 0:
            return stats
        await asyncio.sleep(0.05)
    raise TimeoutError("requests left in the engine")


def _record_admissions(pool) -> list[str]:
    """The ledger's admissions in order, as tenant names."""
    order: list[str] = []
    admit = pool.admission.ledger.admit

    def recording(place=None):
        tickets = admit(place)
        order.extend(t.tenant for t in tickets)
        return tickets

    pool.admission.ledger.admit = recording
    return order


async def test_500_concurrent_requests_on_8_sequences_are_all_answered(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model))
    pool = gateway.pools["chat"]
    plan = gateway.plan.pools["chat"]
    assert (plan.num_blocks, plan.max_num_seqs, pool.admission.total) == (8, 8, 128)
    url = str(client.make_url("/v1/completions"))
    deepest = 0

    async def watch():
        nonlocal deepest
        while True:
            deepest = max(deepest, pool.admission.ledger.num_queued)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i):
            async with session.post(url, json={"model": tiny_model.name, "prompt": f"hello {i}", "max_tokens": 2,
                                               "ignore_eos": True}) as r:
                return r.status, await r.json()

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(500))), 240)
    watcher.cancel()
    statuses = [status for status, _ in results]
    assert statuses.count(200) == 500, {s: statuses.count(s) for s in set(statuses)}
    assert all(body["usage"]["completion_tokens"] == 2 for _, body in results)
    assert deepest > 100                       # they did wait at the gateway (8 run at a time) ...
    assert pool.admission.num_admitted == 500  # ... and every one was admitted
    for _ in range(200):                       # a hold ends in its request's task, just after the reply
        if pool.admission.free == pool.admission.total:
            break
        await asyncio.sleep(0.01)
    assert pool.admission.free == pool.admission.total and pool.admission.ledger.num_queued == 0
    pool.admission.ledger.check_integrity()
    stats = await _idle_stats(pool)            # the worker's integrity check ran too
    assert stats.pools["chat"].num_free_blocks == stats.pools["chat"].num_blocks
    assert stats.pools["chat"].num_recompute_preemptions == 0


TENANTS = """
tenants:
  a: {api_keys: [key-a]}
  b: {api_keys: [key-b]}
  trusted: {api_keys: [key-t], min_priority: -10}
"""


async def _queued(pool, tenant: str, count: int) -> None:
    for _ in range(3000):
        if pool.admission.ledger.queued_by_tenant().get(tenant, 0) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never queued {count} of {tenant}: {pool.admission.ledger.queued_by_tenant()}")


async def test_a_flooding_tenant_does_not_hold_back_a_later_one(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model, tenants=TENANTS))
    pool = gateway.pools["chat"]
    order = _record_admissions(pool)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))   # the test client caps at 100
    url = str(client.make_url("/v1/completions"))

    async def one(key, i):
        async with session.post(url, headers={"Authorization": f"Bearer {key}"},
                                json={"model": tiny_model.name, "prompt": f"hi {i}", "max_tokens": 4,
                                      "ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
            return pool.admission.ledger.queued_by_tenant().get("a", 0)

    # every credit held while the requests arrive: A's 100 are all queued before B sends anything
    async with pool.admission.hold("occupier", pool.admission.total, tenant="test"):
        flood = [asyncio.create_task(one("key-a", i)) for i in range(100)]
        await _queued(pool, "a", 100)
        late = [asyncio.create_task(one("key-b", i)) for i in range(10)]
        await _queued(pool, "b", 10)
        order.clear()
    a_left_when_b_done = await asyncio.wait_for(asyncio.gather(*late), 120)
    await asyncio.wait_for(asyncio.gather(*flood), 120)
    await session.close()
    assert min(a_left_when_b_done) > 50           # B was answered while most of A's flood still waited
    last_b = max(i for i, tenant in enumerate(order) if tenant == "b")
    # equal weights and equal sizes: A and B alternate, so B's 10 pass within about 10 of A's requests
    assert order[:last_b].count("a") <= 12, order[:last_b + 1]
    assert order.count("a") == 100 and order.count("b") == 10


async def test_a_body_priority_is_honoured_only_within_the_tenants_allowance(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model, tenants=TENANTS))
    pool = gateway.pools["chat"]
    admitted: list[tuple[str, int]] = []     # (ledger request id, priority) in admission order
    admit = pool.admission.ledger.admit

    def recording(place=None):
        tickets = admit(place)
        admitted.extend((t.request_id, t.priority) for t in tickets)
        return tickets

    pool.admission.ledger.admit = recording
    tags: dict[str, str] = {}               # ledger request id -> the test's name for the request

    async def send(key, tag, priority=None):
        body = {"model": tiny_model.name, "prompt": f"hi {tag}", "max_tokens": 4, "ignore_eos": True}
        if priority is not None:
            body["priority"] = priority
        before = set(pool.admission.ledger._tickets)
        task = asyncio.create_task(client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                               json=body))
        while not set(pool.admission.ledger._tickets) - before:
            await asyncio.sleep(0.005)
        (rid,) = set(pool.admission.ledger._tickets) - before
        tags[rid] = tag
        return task

    async with pool.admission.hold("occupier", pool.admission.total, tenant="test"):
        tasks = [await send("key-a", f"a{i}") for i in range(5)]
        tasks.append(await send("key-a", "a-jumper", priority=-100))     # clamped to a's min_priority 0
        tasks += [await send("key-t", f"t{i}") for i in range(5)]
        tasks.append(await send("key-t", "t-jumper", priority=-10))      # within trusted's allowance
    for task in tasks:
        assert (await task).status == 200
    sequence = [tags[rid] for rid, _ in admitted if rid in tags]
    priorities = {tags[rid]: p for rid, p in admitted if rid in tags}
    assert priorities["a-jumper"] == 0 and priorities["t-jumper"] == -10
    assert [tag for tag in sequence if tag.startswith("a")][-1] == "a-jumper"   # behind its tenant's earlier ones
    assert [tag for tag in sequence if tag.startswith("t")][0] == "t-jumper"    # first of its tenant


@pytest.mark.parametrize(("limit", "status", "code"), [("0.2", 503, "queue_timeout"), ("0", 429, "pool_full")])
async def test_max_queue_seconds_refuses_with_retry_after_and_leaves_nothing_held(aiohttp_client, tmp_path,
                                                                                  tiny_model, limit, status, code):
    # 0.2: the request waits 0.2 s, then 503; 0 (reject-when-full): 429 at once. The pool is held full by the
    # test itself, not by a running request, which on a fast machine could finish inside the 0.2 s.
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model, max_queue=f"max_queue_seconds: {limit}"))
    pool = gateway.pools["chat"]
    body = {"model": tiny_model.name, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    async with pool.admission.hold("occupier", pool.admission.total, tenant="test"):
        started = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        waited = time.monotonic() - started
    assert r.status == status and r.headers["Retry-After"] == "1"
    assert waited >= 0.2 if status == 503 else waited < 0.15         # 503 only after max_queue_seconds, 429 at once
    error = (await r.json())["error"]
    assert error["code"] == code and ("max_queue_seconds" in error["message"] or "is full" in error["message"])
    assert (await client.post("/v1/completions", json=body)).status == 200      # refused, not broken
    assert pool.admission.free == pool.admission.total and pool.admission.num_expired == 1
    assert pool.admission.ledger.num_queued == 0
    text = await (await client.get("/metrics")).text()
    assert 'cliffguard_admission_expired_total{pool="chat",tenant="default"} 1.0' in text


async def test_a_client_that_leaves_while_queued_holds_nothing(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model))
    pool = gateway.pools["chat"]
    long = {"model": tiny_model.name, "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
    async with pool.admission.hold("occupier", pool.admission.total, tenant="test"):   # full until the test says
        waiting = asyncio.create_task(client.post("/v1/completions", json=long))
        while pool.admission.ledger.num_queued == 0:
            await asyncio.sleep(0.005)
        waiting.cancel()                       # the client goes away while queued
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for _ in range(200):
            if pool.admission.ledger.num_queued == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.admission.ledger.num_queued == 0 and pool.admission.num_cancelled == 1
    assert pool.admission.free == pool.admission.total
    assert (await client.post("/v1/completions", json=long)).status == 200
    pool.admission.ledger.check_integrity()


async def test_a_request_that_can_never_fit_its_pool_is_refused_naming_max_tokens(aiohttp_client, tmp_path,
                                                                                  tiny_model):
    client, _ = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model))
    r = await client.post("/v1/completions", json={"model": tiny_model.name, "prompt": "hello", "max_tokens": 100,
                                                   "n": 2})
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["param"] == "max_tokens" and "KV token slots" in error["message"]


async def test_kill_9_of_the_worker_loses_no_batch_line_and_no_queued_request(aiohttp_client, tmp_path, tiny_model):
    """Acceptance 3, the device worker alone: a 60-line batch half done and interactive requests
    queued behind credits when the worker is SIGKILLed; after the restart the batch completes with
    60 distinct results and the queued requests are answered."""
    import json
    import os
    import signal

    from gateway.workers.supervisor import Backoff

    path = tmp_path / "pools.yaml"
    path.write_text(_yaml(tiny_model))
    gateway = Gateway.from_config(load_config(path))
    gateway.backoff = Backoff(initial_seconds=0.2, max_seconds=1.0)
    (tmp_path / "data").mkdir()
    client = await aiohttp_client(create_app(gateway, data_dir=tmp_path / "data"),
                                  server_kwargs={"handler_cancellation": True})
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.1)
    pool = gateway.pools["chat"]
    lines = [{"custom_id": f"k{i:03d}", "method": "POST", "url": "/v1/completions",
              "body": {"model": tiny_model.name, "prompt": f"story {i}", "max_tokens": 16, "ignore_eos": True}}
             for i in range(60)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "".join(json.dumps(x) + "\n" for x in lines).encode(), filename="in.jsonl")
    file = await (await client.post("/v1/files", data=form)).json()
    batch = await (await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                                          "completion_window": "24h"})).json()

    async def counts():
        return (await (await client.get(f"/v1/batches/{batch['id']}")).json())

    while (await counts())["request_counts"]["completed"] < 30:
        await asyncio.sleep(0.05)
    # three interactive requests that reserve 7 of the 8 blocks each: one runs, two wait for credits
    body = {"model": tiny_model.name, "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
    interactive = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)]
    while pool.admission.ledger.num_queued - pool.admission.ledger.num_background_queued < 2:
        await asyncio.sleep(0.005)
    old = gateway.clients["cpu"][0]
    os.kill(old.pid, signal.SIGKILL)
    statuses = sorted(r.status for r in await asyncio.wait_for(asyncio.gather(*interactive), 120))
    assert statuses[-2:] == [200, 200]            # the queued two: answered by the new worker
    assert statuses[0] in (200, 503)              # the running one: engine_dead if the kill caught it
    for _ in range(1200):
        done = await counts()
        if done["status"] == "completed":
            break
        await asyncio.sleep(0.1)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
    output = [json.loads(x) for x in (await (await client.get(f"/v1/files/{done['output_file_id']}/content"))
                                      .text()).splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"k{i:03d}" for i in range(60)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    assert gateway.supervisors["cpu"][0].num_restarts == 1
    for _ in range(100):       # blocks the worker last reported in use are held back until it reports them free
        if pool.admission.free == pool.admission.total:
            break
        await asyncio.sleep(0.05)
    assert pool.admission.free == pool.admission.total, (pool.admission.free, pool.admission.ledger.num_held)
    pool.admission.ledger.check_integrity()



def test_a_pool_without_a_prefix_cache_shares_no_prompt_block_in_its_credits(tmp_path, tiny_model):
    """Its engine gives every request its whole prompt: the credits hold each request's whole prompt too."""
    from pools.credits.placement import Work

    work = Work((tuple(range(100)),), 16)
    for line, shared in (("", 6), ("enable_prefix_caching: false", 0)):
        path = tmp_path / f"pools{len(line)}.yaml"
        path.write_text(_yaml(tiny_model, max_queue=line))
        placement = Gateway.from_config(load_config(path)).pools["chat"].admission.placement
        assert len(placement.prompt_blocks(work)) == shared, line


def test_no_gauge_is_named_like_a_counter():
    """Prometheus keeps the `_total` suffix for counters (a scraper may take the series for one): the credits
    gauge was `cliffguard_kv_credits_total`, and is `cliffguard_kv_credits`."""
    metrics = GatewayMetrics()
    AdmissionMetrics(metrics.registry)
    gauges = [family.name for family in metrics.registry.collect() if family.type == "gauge"]
    assert "cliffguard_kv_credits" in gauges and [name for name in gauges if name.endswith("_total")] == []


async def test_a_batch_line_of_two_pools_waits_for_the_later_one_among_its_requests(tiny_model):
    """A batch line whose prompts span rag and chat holds rag's credits first (the longest prompts' pool): behind
    chat's interactive requests as a batch line it would hold them idle for as long as chat's queue is never
    empty, so in chat it waits among them, in its turn (it waited behind every later one)."""
    from tests.gateway.conftest import pools_yaml

    gateway = Gateway.from_config(load_config(pools_yaml(tiny_model)))
    chat, rag = gateway.pools["chat"], gateway.pools["rag"]
    half = chat.admission.max_request // 2            # a request of more than half: one at a time in chat
    order, release = [], {name: asyncio.Event() for name in ("H", "I1", "L", "I2")}

    async def run(name: str, routed, background: bool = False) -> None:
        async with gateway.admission.admitted(routed, max_tokens=half, n=1, request_id=name, tenant="default",
                                              priority=0, background=background):
            order.append(name)
            await release[name].wait()

    short, long = [1] * 10, [1] * 70
    tasks = [asyncio.ensure_future(run("H", [(chat, short)]))]
    for name, routed, background in (("I1", [(chat, short)], False), ("L", [(rag, long), (chat, short)], True),
                                     ("I2", [(chat, short)], False)):
        await asyncio.sleep(0.05)
        tasks.append(asyncio.ensure_future(run(name, routed, background)))
    await asyncio.sleep(0.05)
    assert order == ["H"] and rag.admission.ledger.free < rag.admission.total   # L holds rag's credits
    for name in ("H", "I1", "L", "I2"):
        release[name].set()
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    assert order == ["H", "I1", "L", "I2"]
    assert chat.admission.free == chat.admission.total and rag.admission.free == rag.admission.total
    # in chat it was a batch line for the rest: no offered load (three interactive arrivals), tenant `batch`
    assert chat.admission.offered.totals(time.monotonic())[0] == 3
    admitted = {s.labels["tenant"]: s.value for s in gateway.admission.metrics.admitted.collect()[0].samples
                if s.name.endswith("_total") and s.labels["pool"] == "chat"}
    assert admitted["batch"] == 1.0 and sum(admitted.values()) == 4.0
    gateway.executor.shutdown(wait=False)


async def test_a_request_admitted_in_one_pool_waits_for_another_as_that_ones_wait(tiny_model):
    """A request of rag and chat admitted in rag at once and waiting for chat's credits: its wait is chat's
    (`oldest_wait`, which the overload verdict and the autoscaler read), not rag's too (rag read overloaded
    for chat's queue, and could be given a replica it did not need); once admitted, rag counts it again."""
    from tests.gateway.conftest import pools_yaml

    gateway = Gateway.from_config(load_config(pools_yaml(tiny_model)))
    chat, rag = gateway.pools["chat"], gateway.pools["rag"]
    hold, go, admitted = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def run(name: str, routed, max_tokens: int, release: asyncio.Event,
                  entered: asyncio.Event | None = None) -> None:
        async with gateway.admission.admitted(routed, max_tokens=max_tokens, n=1, request_id=name, tenant="default",
                                              priority=0):
            if entered is not None:
                entered.set()
            await release.wait()

    holder = asyncio.ensure_future(run("h", [(chat, [1] * 10)], chat.admission.max_request - 16, hold))
    await asyncio.sleep(0.05)
    both = asyncio.ensure_future(run("r", [(rag, [1] * 70), (chat, [1] * 10)], 32, go, admitted))
    await asyncio.sleep(0.3)
    assert rag.admission.ledger.free < rag.admission.total and not admitted.is_set()   # rag's held, chat's awaited
    assert rag.admission.oldest_wait() < 0.1 and chat.admission.oldest_wait() >= 0.25
    hold.set()
    await admitted.wait()
    assert rag.admission.oldest_wait() < 0.1 and rag.admission.pause_wait("r@rag") is not None
    go.set()
    await asyncio.gather(holder, both)
    gateway.executor.shutdown(wait=False)


async def test_the_prompts_of_a_request_share_their_pools_credits_on_its_replica():
    """A completion's prompts in one pool hold its part's credits together; each engine request says its
    share, which a shared replica counts until that prompt ends (all of them said by the first prompt were
    released when it ended, while the others still held their blocks: the replica undercounted the gateway's
    demand and could cut its lease below what it held)."""
    from types import SimpleNamespace

    from engine.outputs import RequestDelta
    from engine.sampling import SamplingParams
    from gateway.admission import Placed
    from gateway.local_answer import merged

    said: dict[str, int] = {}

    class _Client:
        async def generate(self, ids, params, *, request_id, credits, **kwargs):
            said[request_id] = credits
            yield RequestDelta(request_id, [], finished=True)

    chat, rag = (SimpleNamespace(name=name, clients=[_Client()], cache_salt=lambda tenant: None)
                 for name in ("chat", "rag"))
    placed = {"chat": Placed(chat, 0, "a", credits=301), "rag": Placed(rag, 0, "b", credits=100)}
    routed = [(chat, [1]), (rag, [2]), (chat, [3]), (chat, [4])]
    seen = [i async for i, _ in merged(routed, SamplingParams(), 0, "cmpl-1", placed)]
    assert sorted(seen) == [0, 1, 2, 3]
    shares = [credits for _, credits in sorted(said.items())]
    assert shares == [101, 100, 100, 100], said   # chat's 301 over its three prompts, rag's 100 on its one
