"""Requests that used to end in a 500, a hung connection or a response that never ends: an Authorization
header that is not UTF-8, a body whose Content-Encoding lies, a body that never finishes, an error after a
stream began, a previous_response_id no store can hold, a background run whose pool answers no Response;
and the admission metrics' tenants staying few while no API key is checked."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway import handlers
from gateway.admission import UNLISTED_TENANT, AdmissionControl
from gateway.app import create_app, start_server
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from pools.credits.queue import CreditQueue
from pools.tenants import DEFAULT_TENANT, Tenants

FRONT = "front-model"


def _gateway(tmp_path, upstream: str = "http://127.0.0.1:9/v1", api_keys: str = "[]") -> Gateway:
    """One upstream pool (nobody listens at the default address)."""
    path = tmp_path / "front.yaml"
    path.write_text(f"""
gateway: {{api_keys: {api_keys}}}
pools:
  - name: remote
    upstream: {upstream}
    model: upstream-model
    served_model_name: {FRONT}
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
""")
    return Gateway.from_config(load_config(path))


async def _raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_an_authorization_header_that_is_not_utf8_is_a_401_or_no_key(tmp_path):
    """Latin-1 bytes in the key were a 500 (hmac over a str that cannot be encoded); with keys they are an
    invalid key, without keys the request goes on as one without a key."""
    for api_keys, expected in (("[k1]", 401), ("[]", 200)):
        runner = await start_server(create_app(_gateway(tmp_path, api_keys=api_keys)), "127.0.0.1", 0)
        try:
            raw = await _raw(runner.addresses[0][1], b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                                                     b"Connection: close\r\nAuthorization: Bearer k\xe9y\r\n\r\n")
            status, body = _status_and_body(raw)
            assert status == expected, raw
            if expected == 401:
                assert body["error"]["code"] == "invalid_api_key"
        finally:
            await runner.cleanup()


async def test_an_expectation_other_than_100_continue_is_a_417_naming_the_header(tmp_path):
    """`Expect: 200-ok` got aiohttp's plain-text 417 (it answers an expectation before any middleware); now
    the OpenAI error format, on the routes of every module. `100-continue` still gets its interim 100."""
    runner = await start_server(create_app(_gateway(tmp_path)), "127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        for path in (b"/v1/chat/completions", b"/v1/responses"):
            raw = await _raw(port, b"POST " + path + b" HTTP/1.1\r\nHost: localhost\r\nExpect: 200-ok\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            status, body = _status_and_body(raw)
            assert status == 417 and body["error"]["param"] == "Expect" and "200-ok" in body["error"]["message"], raw
        raw = await _raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
                               b"Connection: close\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400"), raw[:80]
    finally:
        await runner.cleanup()


async def test_a_body_whose_content_encoding_lies_is_a_400_naming_the_body(aiohttp_client, tmp_path):
    client = await aiohttp_client(create_app(_gateway(tmp_path)))
    r = await client.post("/v1/chat/completions", data=b"", headers={"Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "body"   # an empty one, as before
    for encoding in ("gzip", "deflate"):
        r = await client.post("/v1/chat/completions", data=b'{"model": "x", "messages": []}',
                              headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "body", body
    assert (await client.get("/health")).status == 200


async def test_a_body_that_never_finishes_is_a_408(tmp_path, monkeypatch):
    """It held its connection and handler for good; now the answer comes after BODY_READ_SECONDS (aiohttp
    then reads what still comes for its lingering time, 10 s, and closes)."""
    monkeypatch.setattr(handlers, "BODY_READ_SECONDS", 0.5)
    runner = await start_server(create_app(_gateway(tmp_path)), "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"mo")   # the client never sends the rest
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        status, body = _status_and_body(head + await reader.readexactly(length))
        writer.close()
        assert status == 408 and body["error"]["param"] == "body" and body["error"]["code"] == "request_timeout"
        assert b"connection: close" in head.lower()
    finally:
        await runner.cleanup()


async def test_a_slow_body_that_keeps_coming_is_read_whole_and_a_trickle_is_a_408(tmp_path, monkeypatch):
    """A body coming in over four times BODY_READ_SECONDS, never silent that long and above the minimum
    rate, is read (and answered: the upstream is down, a 502); below the rate it is a 408."""
    monkeypatch.setattr(handlers, "BODY_READ_SECONDS", 0.3)
    monkeypatch.setattr(handlers, "MIN_BODY_BYTES_PER_SECOND", 1)
    body = json.dumps({"model": FRONT, "messages": [{"role": "user", "content": "hi"}]}).encode()
    runner = await start_server(create_app(_gateway(tmp_path)), "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        pieces = [body[i:i + len(body) // 8 + 1] for i in range(0, len(body), len(body) // 8 + 1)]
        for piece in pieces:   # ~1.4 s in all, never 0.3 s without a byte
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.15)
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        status, answer = _status_and_body(raw)
        assert status == 502 and answer["error"]["code"] != "request_timeout", raw
        monkeypatch.setattr(handlers, "MIN_BODY_BYTES_PER_SECOND", 1000)   # ~70 B/s now trickles
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        reply = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        for piece in pieces:   # until the answer comes: a 408 while the body is not whole (whole, it is a 502)
            if reply.done():
                break
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.15)
        head = await asyncio.wait_for(reply, 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
    finally:
        await runner.cleanup()


async def test_an_error_after_a_stream_began_cuts_it_short_without_a_second_head(tmp_path):
    """The handler fails after its first bytes: the client reads the one head it got and then the end of the
    connection, never an error response written into the body."""
    async def half_a_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        raise RuntimeError("the upstream went away")

    app = create_app(_gateway(tmp_path))
    app.router.add_get("/half", half_a_stream)
    runner = await start_server(app, "127.0.0.1", 0)
    try:
        raw = await _raw(runner.addresses[0][1], b"GET /half HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1") == 1, raw
        assert b"data: {}" in raw and b"internal error" not in raw
        raw = await _raw(runner.addresses[0][1],
                         b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 200")
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake_upstream(aiohttp_server):
    """An OpenAI-compatible server whose /v1/responses answers what `answers` holds next."""
    answers: list = []

    async def responses(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(answers.pop(0) if answers else {"id": "chatcmpl-1", "object": "chat.completion"})

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    server = await aiohttp_server(app, host="127.0.0.1")
    return server, answers


async def test_a_background_run_whose_pool_answers_no_response_fails_instead_of_running_for_ever(
        aiohttp_client, tmp_path, fake_upstream):
    server, answers = fake_upstream
    gateway = _gateway(tmp_path, upstream=f"http://127.0.0.1:{server.port}/v1")
    client = await aiohttp_client(create_app(gateway, data_dir=tmp_path))
    answers += [{"id": "chatcmpl-1", "object": "chat.completion"}, [1, 2],   # no status; not an object
                {"id": "resp_1", "status": "completed"}]                     # no output items
    for _ in range(3):
        r = await client.post("/v1/responses", json={"model": FRONT, "input": "hi", "background": True})
        queued = await r.json()
        assert r.status == 200 and queued["status"] == "queued", queued
        for _ in range(100):
            kept = await (await client.get(f"/v1/responses/{queued['id']}")).json()
            if kept["status"] not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.05)
        assert kept["status"] == "failed" and kept["error"]["code"] == "server_error", kept   # OpenAI's codes only
        assert kept["error"]["message"].startswith("upstream_error: "), kept


async def test_a_previous_response_id_no_store_can_hold_is_a_400(aiohttp_client, tmp_path):
    """A lone surrogate (or a control character) is no response's id: the same 400 as an unknown one, not
    SQLite's UnicodeEncodeError."""
    client = await aiohttp_client(create_app(_gateway(tmp_path), data_dir=tmp_path))
    for previous in ("\ud800", "resp_\x00", "resp_unknown"):
        r = await client.post("/v1/responses", data=json.dumps({"model": FRONT, "input": "hi",
                                                                "previous_response_id": previous}),
                              headers={"Content-Type": "application/json"})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "previous_response_id", body
        assert body["error"]["code"] == "previous_response_not_found"


def test_unlisted_keys_share_one_metrics_tenant_while_no_key_is_checked():
    """Without api_keys any bearer string is a per-key tenant: each would be a series of its own. The
    credits stay each key's; only the label is shared."""
    for checked, expected in ((False, UNLISTED_TENANT), (True, "key-0123abcd")):
        control = AdmissionControl.build(Tenants(), [], CollectorRegistry(), {}, keys_checked=checked)
        assert control.metrics.tenant_label("key-0123abcd") == expected
        assert control.metrics.tenant_label(DEFAULT_TENANT) == DEFAULT_TENANT


def test_the_queue_depth_of_a_tenant_whose_last_request_ended_reads_zero():
    """The ledger forgets a tenant with its last request; its series must not keep the last depth it had."""
    registry = CollectorRegistry()
    control = AdmissionControl.build(Tenants(), [], registry, {}, keys_checked=True)
    admission = CreditQueue("chat", 100)
    ledger = admission.ledger
    pool = SimpleNamespace(name="chat", admission=admission)
    ledger.submit("r0", 100, tenant="key-0123abcd")
    ledger.submit("r1", 100, tenant="key-0123abcd")
    ledger.admit()
    depth = lambda: registry.get_sample_value("cliffguard_admission_queue_depth",  # noqa: E731
                                              {"pool": "chat", "tenant": "key-0123abcd"})
    control.metrics.refresh([pool])
    assert depth() == 1
    ledger.cancel("r1")
    ledger.release("r0")
    control.metrics.refresh([pool])
    assert ledger.queued_by_tenant() == {} and depth() == 0
