"""The gateway app in-process (aiohttp test client) over a tiny random model on two CPU pools."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats
from gateway.app import create_app
from gateway.monitoring.metrics import TTFT_BUCKETS
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from tests.gateway.conftest import pools_yaml


async def _client(aiohttp_client, text: str, tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway), server_kwargs={"handler_cancellation": True})
    for _ in range(600):
        r = await client.get("/ready")
        if r.status == 200:
            return client, gateway
        await asyncio.sleep(0.1)
    raise TimeoutError("pools never became ready")


def _model(tiny_model) -> str:
    return tiny_model.name


async def _stream_text(resp) -> tuple[str, list[dict]]:
    text, chunks = "", []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        chunks.append(chunk)
        for c in chunk.get("choices", []):
            text += c.get("text") or c.get("delta", {}).get("content") or ""
    return text, chunks


def _metrics(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def _wait_idle(gateway: Gateway) -> EngineStats:
    """The device worker's stats once no request is left in it (or after 5 s)."""
    for _ in range(100):
        stats = await gateway.clients["cpu"][0].stats(check=True)
        if stats.num_requests == 0:
            break
        await asyncio.sleep(0.05)
    return stats


def _count(gateway: Gateway, pool: str, messages) -> int:
    runtime = gateway.pools[pool]
    return len(runtime.counter.encode(runtime.tokenizer.apply_chat_template(messages)))


async def test_routing_at_the_threshold_by_exact_count(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model, chat_max=64), tmp_path)
    base = _count(gateway, "chat", [{"role": "user", "content": ""}])
    # " a" is one token in this vocabulary: grow the message to exactly 64 and 65 prompt tokens
    k = 64 - base
    below = [{"role": "user", "content": " a" * k}]
    above = [{"role": "user", "content": " a" * (k + 1)}]
    assert _count(gateway, "chat", below) == 64 and _count(gateway, "chat", above) == 65
    for messages, pool in ((below, "chat"), (above, "rag")):
        r = await client.post("/v1/chat/completions", json={"model": _model(tiny_model), "messages": messages,
                                                             "max_tokens": 4, "temperature": 0})
        body = await r.json()
        assert r.status == 200, body
        assert r.headers["x-cliffguard-pool"] == pool
        assert body["usage"]["prompt_tokens"] == (64 if pool == "chat" else 65)
    # completions count the raw text (no template): 64 vs 65 tokens of " a"
    for n, pool in ((64, "chat"), (65, "rag")):
        r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": " a" * n,
                                                       "max_tokens": 2})
        assert r.status == 200 and r.headers["x-cliffguard-pool"] == pool
    m = _metrics(await (await client.get("/metrics")).text())
    assert m["cliffguard_routed_requests_total"][(("pool", "chat"),)] == 2
    assert m["cliffguard_routed_requests_total"][(("pool", "rag"),)] == 2
    await _a_replica_down_at_dispatch_is_left_for_another_placement(client, gateway, tiny_model)
    await _an_empty_prompt_is_the_start_of_a_document(client, gateway, tiny_model)


async def _a_replica_down_at_dispatch_is_left_for_another_placement(client, gateway: Gateway, tiny_model) -> None:
    """A request of two pools holds the first one's credits on a replica while it waits for the second's; a
    replica down by the time both are held (its worker dead, or the new one still connecting: the slot's client
    is another) is not sent to: the request is placed again, with no worker death its own."""
    import contextlib

    chat, real_admitted, entered = gateway.pools["chat"].admission, gateway.admission.admitted, []
    up = chat.is_up

    @contextlib.asynccontextmanager
    async def admitted(*args, **kwargs):
        async with real_admitted(*args, **kwargs) as placed:
            entered.append(sorted(placed))
            chat.is_up = (lambda replica: False) if len(entered) == 1 else up   # chat's replica went down meanwhile
            try:
                yield placed
            finally:
                chat.is_up = up

    gateway.admission.admitted = admitted
    r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": [" a" * 10, " a" * 80],
                                                   "max_tokens": 2, "temperature": 0})
    body = await r.json()
    assert r.status == 200 and len(body["choices"]) == 2, body
    assert entered == [["chat", "rag"], ["chat", "rag"]]   # placed again, not sent to the replica down


async def _an_empty_prompt_is_the_start_of_a_document(client, gateway, tiny_model):
    """OpenAI answers `prompt: ""` as from the start of a new document: the model sees the tokenizer's BOS
    (here its EOS, the tokenizer having no BOS), one prompt token, never an empty sequence."""
    tokenizer = gateway.pools["chat"].tokenizer
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else min(tokenizer.eos_token_ids)
    assert gateway.pools["chat"].prompt_ids("") == [start]
    r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": ["", " a"],
                                                   "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    body = await r.json()
    assert r.status == 200 and [c["index"] for c in body["choices"]] == [0, 1], body
    assert body["usage"]["prompt_tokens"] == 1 + len(gateway.pools["chat"].prompt_ids(" a"))
    assert body["usage"]["completion_tokens"] == 6 and all(c["finish_reason"] == "length" for c in body["choices"])


async def test_streamed_equals_non_streamed_and_usage_and_logprobs(aiohttp_client, tmp_path, tiny_model):
    client, _ = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    body = {"model": _model(tiny_model), "messages": [{"role": "user", "content": "Tell me about cliffs."}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = await (await client.post("/v1/chat/completions", json=body)).json()
    r = await client.post("/v1/chat/completions",
                          json=dict(body, stream=True, stream_options={"include_usage": True}))
    assert r.headers["Content-Type"].startswith("text/event-stream")
    text, chunks = await _stream_text(r)
    assert text == whole["choices"][0]["message"]["content"] and text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # the same prompt again: its two full blocks come from the prefix cache this time
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == dict(
        whole["usage"], prompt_tokens_details={"cached_tokens": (whole["usage"]["prompt_tokens"] - 1) // 16 * 16})
    assert whole["usage"]["completion_tokens"] == 24

    # vLLM's continuous usage stats: the usage so far in every chunk, so a client can tell how many
    # tokens each chunk carries; plain include_usage keeps OpenAI's null until the usage chunk
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    for path, req in (("/v1/chat/completions", dict(body, stream=True, stream_options=continuous)),
                      ("/v1/completions", {**{k: v for k, v in body.items() if k != "messages"},
                                           "prompt": "Tell me about cliffs.", "stream": True,
                                           "stream_options": continuous})):
        _, chunks = await _stream_text(await client.post(path, json=req))
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 24
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    _, chunks = await _stream_text(await client.post("/v1/chat/completions", json=dict(
        body, stream=True, stream_options={"include_usage": True})))
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 24

    lp = await (await client.post("/v1/completions", json={
        "model": _model(tiny_model), "prompt": ["one", "two"], "max_tokens": 5, "n": 2, "temperature": 1.0,
        "seed": 3, "logprobs": 2})).json()
    assert [c["index"] for c in lp["choices"]] == [0, 1, 2, 3]
    for c in lp["choices"]:
        assert len(c["logprobs"]["tokens"]) == 5 and len(c["logprobs"]["top_logprobs"][0]) >= 2
        assert "".join(c["logprobs"]["tokens"]) == c["text"]
    # a stop string no text completes holds the last characters back: the streamed text_offsets count the
    # tokens' text, as the whole answer's do, not the text sent so far
    held = {"model": _model(tiny_model), "prompt": "Tell me about cliffs.", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stop": ["NEVER-SEEN-STOP"]}
    whole = (await (await client.post("/v1/completions", json=held)).json())["choices"][0]["logprobs"]
    _, chunks = await _stream_text(await client.post("/v1/completions", json=dict(held, stream=True)))
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and len(offsets) == 12


async def test_bad_requests_get_clear_errors_while_a_stream_keeps_going(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(
        aiohttp_client, pools_yaml(tiny_model, api_keys="[k1, k2]", max_body="64KiB"), tmp_path)
    auth = {"Authorization": "Bearer k2"}
    model = _model(tiny_model)
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}]}

    async def long_stream():
        r = await client.post("/v1/completions", headers=auth, json={
            "model": model, "prompt": "Once", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
            "stream": True})
        return r.status, await _stream_text(r)

    survivor = asyncio.create_task(long_stream())
    await asyncio.sleep(0.3)
    chat, comp = "/v1/chat/completions", "/v1/completions"
    cases = [
        # (what, path, kwargs, status, text the message must contain)
        ("no key", chat, dict(json=ok), 401, "API key"),
        ("wrong key", chat, dict(json=ok, headers={"Authorization": "Bearer nope"}), 401, "invalid API key"),
        ("malformed JSON", chat, dict(data=b"{not json", headers=auth), 400, "body: invalid JSON"),
        ("empty body", chat, dict(data=b"", headers=auth), 400, "body"),
        ("array body", chat, dict(json=[1], headers=auth), 400, "body"),
        ("unknown model", chat, dict(json=dict(ok, model="gpt-9"), headers=auth), 404, "gpt-9"),
        ("oversized body", chat, dict(json=dict(ok, messages=[{"role": "user", "content": "x" * 100_000}]),
                                      headers=auth), 413, "too large"),
        ("prompt longer than every pool", comp, dict(json={"model": model, "prompt": " a" * 600}, headers=auth),
         400, "no pool"),
        ("max_tokens past max_model_len", chat, dict(json=dict(ok, max_tokens=5000), headers=auth), 400,
         "max_model_len"),
        ("token id outside the vocabulary", comp, dict(json={"model": model, "prompt": [1, 99999]},
                                                       headers=auth), 400, "prompt[1]: token id 99999"),
        ("token id outside the vocabulary in the second prompt", comp, dict(   # its path, not prompt[1] or [3]
            json={"model": model, "prompt": ["hello", [5, 6, 7, 99999]]}, headers=auth), 400, "prompt[1][3]: token"),
        ("stop token id outside the vocabulary", comp, dict(json={"model": model, "prompt": "x",
                                                              "stop_token_ids": [3, 99999]}, headers=auth),
         400, "stop_token_ids: token ids [99999] are outside the vocabulary"),
        ("a bias past the largest float", chat, dict(json=dict(ok, logit_bias={"5": 10**400}), headers=auth), 400,
         "logit_bias[5]: must be finite"),
        ("min_tokens past max_completion_tokens, named as sent", chat, dict(
            json=dict(ok, max_completion_tokens=5, min_tokens=10), headers=auth), 400,
         "min_tokens: must be <= max_completion_tokens (5)"),
        ("top_p past the largest float", chat, dict(json=dict(ok, top_p=10**400), headers=auth), 400, "top_p"),
        ("temperature out of range", chat, dict(json=dict(ok, temperature=9), headers=auth), 400, "temperature"),
        ("n is a string", chat, dict(json=dict(ok, n="2"), headers=auth), 400, "n:"),
        ("unknown field", chat, dict(json=dict(ok, max_token=3), headers=auth), 400, "max_token"),
        ("bad role", chat, dict(json=dict(ok, messages=[{"role": "x", "content": "y"}]), headers=auth), 400,
         "messages[0].role"),
        ("missing messages", chat, dict(json={"model": model}, headers=auth), 400, "messages"),
        ("stop of wrong type", chat, dict(json=dict(ok, stop=3), headers=auth), 400, "stop"),
        ("top_p negative", comp, dict(json={"model": model, "prompt": "x", "top_p": -0.1}, headers=auth), 400, "top_p"),
        ("max_tokens 0 without echo", comp, dict(json={"model": model, "prompt": "x", "max_tokens": 0},
                                                  headers=auth), 400, "max_tokens"),
        ("negative max_tokens", comp, dict(json={"model": model, "prompt": "x", "max_tokens": -2}, headers=auth),
         400, "max_tokens"),
        ("logprobs too large", comp, dict(json={"model": model, "prompt": "x", "logprobs": 99}, headers=auth),
         400, "logprobs"),
        ("unknown path", "/v1/embeddings", dict(json=ok, headers=auth), 404, "/v1/embeddings"),
        ("lone surrogate in a prompt", comp, dict(data=b'{"model": "%s", "prompt": "a\\ud800b"}' % model.encode(),
                                                  headers=auth), 400, "valid Unicode"),
        ("lone surrogate in a message", chat, dict(data=b'{"model": "%s", "messages": [{"role": "user", '
                                                   b'"content": "a\\ud800b"}]}' % model.encode(), headers=auth),
         400, "valid Unicode"),
        # refused as it is read, naming the field (it was a 400 naming the codec's error, after the credits' wait)
        ("lone surrogate in a stop string", chat, dict(data=b'{"model": "%s", "messages": [{"role": "user", '
                                                       b'"content": "a"}], "stop": ["x", "\\ud800"]}'
                                                       % model.encode(), headers=auth), 400, "stop: each stop string "
                                                                                              "must be valid Unicode"),
        ("null content of a user message", chat, dict(json={"model": model, "messages": [
            {"role": "user", "content": None}]}, headers=auth), 400, "messages[0].content: must be a string or an "
                                                                     "array of parts in a user message, got null"),
    ]
    for what, path, kwargs, status, needle in cases:
        r = await client.post(path, **kwargs)
        body = await r.json()
        assert r.status == status, (what, body)
        assert needle in body["error"]["message"], (what, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, what
    r = await client.get("/v1/chat/completions", headers=auth)
    assert r.status == 405 and "error" in await r.json() and r.headers["Allow"] == "POST"   # RFC 9110's Allow

    status, (text, chunks) = await survivor
    assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (await client.post(chat, json=dict(ok, max_tokens=3), headers=auth)).status == 200
    stats = await gateway.clients["cpu"][0].stats(check=True)  # runs check_integrity in the worker
    assert stats.num_requests == 0
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools.values())


async def test_client_disconnect_aborts_and_frees_blocks(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    r = await client.post("/v1/completions", json={
        "model": _model(tiny_model), "prompt": "Go", "max_tokens": 400, "ignore_eos": True, "stream": True})
    await r.content.readline()
    r.close()  # the client goes away mid-stream
    stats = await _wait_idle(gateway)
    assert stats.num_requests == 0 and stats.pools["chat"].num_aborted == 1
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools.values())


async def test_a_request_of_both_pools_waiting_for_rag_holds_none_of_chat(aiohttp_client, tmp_path, tiny_model):
    """A completions request whose prompts go to chat and to rag takes the longer prompts' pool's credits first:
    while rag is full it waits holding nothing (it held its chat credits, idle, for the whole wait)."""
    client, gateway = await _client(
        aiohttp_client, pools_yaml(tiny_model, rag_kv="kv_cache_bytes: 512KiB"), tmp_path)
    model, rag, chat = _model(tiny_model), (("pool", "rag"), ("replica", "0")), (("pool", "chat"), ("replica", "0"))

    async def complete(prompt, max_tokens):
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                       "ignore_eos": True, "temperature": 0})
        assert r.status == 200, await r.text()
        return await r.json()

    blockers = [asyncio.create_task(complete(f"{i}" + " b" * 400, 70)) for i in range(2)]   # 2 x 30 of 64 blocks
    both = asyncio.create_task(complete(["hello", "2" + " b" * 400], 70))                # 30 more: it waits
    queued = None
    while not both.done():
        m = _metrics(await (await client.get("/metrics")).text())
        if m["cliffguard_admission_queue_depth"].get((("pool", "rag"), ("tenant", "default")), 0) > 0:
            queued = m
            break
        await asyncio.sleep(0.01)
    assert queued is not None, "the request of both pools never waited for rag"
    assert queued["cliffguard_kv_credits_free"][chat] == queued["cliffguard_kv_credits"][chat]
    assert queued["cliffguard_kv_credits_free"][rag] == queued["cliffguard_kv_credits"][rag] - 2 * 480
    assert len((await both)["choices"]) == 2 and all(await asyncio.gather(*blockers))


async def test_a_rag_flood_waits_for_credits_and_chat_keeps_its_blocks(aiohttp_client, tmp_path, tiny_model):
    # rag: 64 blocks of 16 = 1024 KV credits. Four 300-token prompts growing to 370 tokens would need
    # 4 x 24 blocks and preempt each other; each reserves 24 blocks (384 credits), so two run at a time
    # and the rest wait at the gateway: no preemption anywhere, chat untouched, every credit back after.
    client, gateway = await _client(
        aiohttp_client, pools_yaml(tiny_model, rag_kv="kv_cache_bytes: 512KiB"), tmp_path)
    model = _model(tiny_model)
    assert gateway.plan.pools["rag"].num_blocks == 64

    async def complete(prompt, max_tokens):
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                       "ignore_eos": True, "temperature": 0})
        assert r.status == 200, await r.text()
        return r.headers["x-cliffguard-pool"], await r.json()

    async def watch():  # sample the ledger while the flood runs: how fast it drains depends on the machine
        samples = []
        while not all(task.done() for task in flood):
            samples.append(_metrics(await (await client.get("/metrics")).text()))
            await asyncio.sleep(0.02)
        return samples

    # each prompt starts with its own token: no prompt block is shared (a shared one is held once, and more
    # would run at once: tests/pools/test_placement.py)
    flood = [asyncio.create_task(complete(f"{i}" + " b" * 300, 70)) for i in range(4)]
    watcher = asyncio.create_task(watch())
    chats = await asyncio.gather(*(complete(f"hello {i}", 30) for i in range(6)))
    assert {pool for pool, _ in chats} == {"chat"}
    results = await asyncio.gather(*flood)
    samples = await watcher
    assert {pool for pool, _ in results} == {"rag"}
    assert all(r["usage"]["completion_tokens"] == 70 for _, r in results)
    for _ in range(100):   # the last request gives its credits back as its handler ends, just after its answer
        after = _metrics(await (await client.get("/metrics")).text())
        if after["cliffguard_kv_credits_free"][(("pool", "rag"), ("replica", "0"))] == 1024:
            break
        await asyncio.sleep(0.05)
    preempt = after["cliffguard_num_preemptions_total"]
    assert preempt[(("mode", "recompute"), ("pool", "rag"), ("replica", "0"))] == 0
    assert preempt[(("mode", "recompute"), ("pool", "chat"), ("replica", "0"))] == 0
    rag_free = [m["cliffguard_kv_credits_free"][(("pool", "rag"), ("replica", "0"))] for m in samples]
    rag_queued = [m["cliffguard_admission_queue_depth"].get((("pool", "rag"), ("tenant", "default")), 0)
                  for m in samples]
    assert min(rag_free) == 1024 - 2 * 384  # two at a time, never a third
    assert any(free == 1024 - 2 * 384 and queued > 0 for free, queued in zip(rag_free, rag_queued))
    assert after["cliffguard_admission_admitted_total"][(("pool", "rag"), ("tenant", "default"))] == 4
    assert after["cliffguard_kv_credits_free"][(("pool", "rag"), ("replica", "0"))] == after[
        "cliffguard_kv_credits"][(("pool", "rag"), ("replica", "0"))] == 1024
    assert all(m["cliffguard_pool_num_blocks"][(("pool", "chat"), ("replica", "0"))] == gateway.plan.pools["chat"].num_blocks
               for m in samples)
    assert after["cliffguard_kv_cache_usage_perc"][(("pool", "chat"), ("replica", "0"))] == 0


async def test_models_and_metrics_report_what_was_planned_and_allocated(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    await client.post("/v1/chat/completions", json={"model": _model(tiny_model), "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    models = await (await client.get("/v1/models")).json()
    (entry,) = models["data"]
    assert entry["id"] == _model(tiny_model)
    for pool in entry["pools"]:
        plan = gateway.plan.pools[pool["name"]]
        assert pool["num_blocks"] == pool["planned_num_blocks"] == plan.num_blocks
        assert pool["max_num_seqs"] == plan.max_num_seqs
    r = await client.get("/metrics")
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"   # the format it is in
    text = await r.text()
    m = _metrics(text)
    for name in ("cliffguard_num_requests_running", "cliffguard_num_requests_waiting",
                 "cliffguard_num_requests_swapped", "cliffguard_kv_cache_usage_perc",
                 "cliffguard_prompt_tokens_total", "cliffguard_generation_tokens_total",
                 "cliffguard_prefix_cache_hits_total", "cliffguard_time_to_first_token_seconds_bucket",
                 "cliffguard_e2e_request_latency_seconds_count", "cliffguard_request_queue_time_seconds_count",
                 "cliffguard_tokenizer_seconds_count", "cliffguard_pool_max_num_seqs"):
        assert name in m, name
    buckets = sorted(float(dict(k)["le"]) for k in m["cliffguard_time_to_first_token_seconds_bucket"]
                     if dict(k)["pool"] == "chat")
    assert buckets[:-1] == list(TTFT_BUCKETS)  # plus +Inf
    assert m["cliffguard_e2e_request_latency_seconds_count"][(("pool", "chat"),)] == 1
    assert (await (await client.get("/health")).json())["status"] == "ok"


@pytest.mark.parametrize("missing", ["model"])
async def test_a_pool_that_fails_to_start_answers_503_not_a_hang(aiohttp_client, tmp_path, tiny_model, missing):
    # A worker that cannot load (weights removed after planning) fails its pool's requests clearly.
    import shutil

    copy = tmp_path / "broken"
    shutil.copytree(tiny_model, copy)
    text = pools_yaml(copy)
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    gateway = Gateway.from_config(load_config(path))
    for f in copy.glob("*.safetensors*"):
        f.unlink()
    client = await aiohttp_client(create_app(gateway))
    r = await client.post("/v1/chat/completions", json={"model": "broken", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    body = await r.json()
    assert r.status == 503 and "failed to start" in body["error"]["message"]
    assert (await client.get("/ready")).status == 503
    assert (await client.get("/health")).status == 200


async def test_long_tokenization_leaves_the_event_loop_free(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model, max_body="8MiB"), tmp_path)
    text = "The quick brown fox jumps over the lazy dog. " * 60_000  # 2.7 MB, ~600k tokens
    big = asyncio.create_task(client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": text}))
    answered = 0
    while not big.done():
        r = await client.get("/health")  # served while the prompt is counted in a worker thread
        assert r.status == 200
        answered += 1
        await asyncio.sleep(0)
    r = big.result()
    assert r.status == 400 and "no pool" in (await r.json())["error"]["message"]
    assert answered >= 3


async def test_non_streaming_client_disconnect_aborts_too(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    body = {"model": _model(tiny_model), "prompt": "Go", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=0.5)
    stats = await _wait_idle(gateway)
    assert stats.num_requests == 0 and stats.pools["chat"].num_aborted == 1
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools.values())


async def test_questions_on_one_document_share_its_blocks_and_run_together_without_preemption(aiohttp_client, tmp_path,
                                                                                              tiny_model):
    # rag: 1024 credits. A 384-token document (24 blocks) and six questions on it, each reserving 24 + 5
    # blocks (464 credits): alone, two at a time. Once one has read the document its blocks are held once, a
    # question takes 80 credits, and the engine's prefix cache shares them the same way: more run at once,
    # and no preemption.
    client, gateway = await _client(
        aiohttp_client, pools_yaml(tiny_model, rag_kv="kv_cache_bytes: 512KiB"), tmp_path)
    model = _model(tiny_model)
    document = [100 + i for i in range(384)]

    async def ask(i: int):
        r = await client.post("/v1/completions", json={"model": model, "prompt": document + [900 + i, 7],
                                                       "max_tokens": 64, "ignore_eos": True, "temperature": 0})
        assert r.status == 200, await r.text()
        return await r.json()

    await ask(99)                                  # the document is read (and cached) once
    ledger, worker = gateway.pools["rag"].admission.ledger, gateway.clients["cpu"][0]
    questions = [asyncio.create_task(ask(i)) for i in range(6)]
    admitted, running = [], []     # each question runs for 64 steps: both are seen at every step count
    while not all(q.done() for q in questions):
        admitted.append(ledger.num_admitted)
        running.append((await worker.stats(check=True)).pools["rag"].num_running)   # asked of the worker between steps
        await asyncio.sleep(0.005)
    assert all(q.result()["usage"]["completion_tokens"] == 64 for q in questions)
    assert max(admitted) > 2 and max(running) > 2, (admitted, running)
    labels = (("pool", "rag"), ("replica", "0"))
    after = _metrics(await (await client.get("/metrics")).text())
    assert after["cliffguard_num_preemptions_total"][(("mode", "recompute"), *labels)] == 0
    assert after["cliffguard_prefix_cache_hits_total"][labels] >= 6 * 384
    ledger.check_integrity()
    for _ in range(100):   # what the worker reported mid-request comes back with its next report
        if ledger.free == ledger.total:
            break
        await asyncio.sleep(0.05)
    assert ledger.free == ledger.total == 1024


async def test_a_stream_of_several_choices_opens_them_all_in_order_first(aiohttp_client, tmp_path, tiny_model,
                                                                         monkeypatch):
    """Sample 1's first text comes before sample 0's (a stop string's possible start, a character's first byte
    held back): the first chunk still opens choices 0 and 1 in that order, each its role once, so the openai
    SDK's stream helper (which takes the first chunk's choices for the list) reassembles each choice whole."""
    import openai

    from engine.client import AsyncEngineClient
    from engine.outputs import RequestDelta, SampleDelta

    script = [(1, "Hello", None), (0, "Hi", None), (0, " there", "stop"), (1, " world", "stop")]

    async def generate(client, prompt, params=None, *, request_id=None, **kwargs):
        for k, (index, text, finish) in enumerate(script):
            sample = SampleDelta(index, text, [300 + k], k + 1, finish)
            yield RequestDelta(request_id, [sample], k == len(script) - 1)
            await asyncio.sleep(0)

    client, _ = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    monkeypatch.setattr(AsyncEngineClient, "generate", generate)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    body = dict(model=_model(tiny_model), messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8)
    async with sdk.chat.completions.stream(**body) as stream:
        final = await stream.get_final_completion()
    assert [(c.index, c.message.role, c.message.content) for c in final.choices] == [
        (0, "assistant", "Hi there"), (1, "assistant", "Hello world")]
    chunks = [c async for c in await sdk.chat.completions.create(stream=True, **body)]
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [(0, "assistant"), (1, "assistant")]
    assert sum(1 for chunk in chunks for c in chunk.choices if c.delta.role) == 2
