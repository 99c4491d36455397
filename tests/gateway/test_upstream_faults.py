"""Upstream answers that break the rules (bad framing, bad statuses, bad error bodies, bad usage, answers
too large, a stream that fails midway or does not stream) against a raw upstream on 127.0.0.1: the
client gets a 502 (or, once its stream started, an SSE error event and `[DONE]`), the answer the
upstream did give where it is usable, and every connection slot comes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.client_writes import ClientGone
from gateway.completion import _relayed_error
from gateway.runtime import Gateway
from gateway.upstream import relay
from gateway.upstream.connection import UpstreamClient, UpstreamDisconnected
from gateway.upstream.sse import split_events
from pools.config.yaml_file import load_config
from tests.gateway.test_upstream_connection import _answer, _raw_server
from tests.gateway.test_upstream_retry import FRONT, _gateway, _run_batch

CHAT = {"model": FRONT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EVENT = b'data: {"id": "c1", "model": "upstream-model", "choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


def _reply(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)


def _chat_answer(usage) -> bytes:
    return json.dumps({"id": "c1", "object": "chat.completion", "model": "upstream-model", "choices": [],
                       "usage": usage}).encode()


async def _serve(answer):
    """(server, the pool's upstream URL) of a raw upstream answering each request with `answer(request)`'s bytes
    (then closing the connection when they are a tuple)."""
    async def write(writer, request, n):
        data = answer(request)
        writer.write(data[0] if isinstance(data, tuple) else data)
        await writer.drain()
        if isinstance(data, tuple):
            writer.transport.abort()
            return "close"

    server, url, _, _ = await _raw_server(write)
    return server, str(url.with_path("/v1"))


async def _gateway_client(aiohttp_client, tmp_path, url: str):
    gateway = _gateway(tmp_path, url)
    return gateway, await aiohttp_client(create_app(gateway, data_dir=tmp_path))


def _assert_no_slot_held(gateway) -> None:
    assert gateway.upstream.num_in_use == 0


def _assert_error_event_then_done(text: str, code: str) -> None:
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == code and error["type"] == "server_error", error
    assert "HTTP/1.1" not in text


# --- the connection -----------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [b"-1", "\N{SUPERSCRIPT TWO}".encode("latin-1"), b"1_0"],
                         ids=["negative", "superscript", "underscore"])
async def test_an_invalid_content_length_gives_its_slot_back(length):
    async def answer(writer, request, n):
        body = b"{}"
        writer.write(_answer(body, f"Content-Length: {len(body)}") if n > 3 else
                     b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n{}")
        await writer.drain()

    server, url, _, _ = await _raw_server(answer)
    client = UpstreamClient(max_connections=2)
    for _ in range(3):   # more bad answers than slots
        with pytest.raises(UpstreamDisconnected, match="Content-Length"):
            await asyncio.wait_for(client.post(url, b"{}", {}), 3)
    assert client.num_in_use == 0
    async with await asyncio.wait_for(client.post(url, b"{}", {}), 3) as r:
        assert await r.read() == b"{}"
    assert client.num_in_use == 0
    await client.close()
    server.close()


@pytest.mark.parametrize("size", [b"-5", b"+5", b"0x5", b"ZZ"], ids=["minus", "plus", "0x", "ZZ"])
async def test_an_invalid_chunk_size_is_a_disconnection(size):
    async def answer(writer, request, n):
        writer.write(_answer(size + b"\r\nhello\r\n0\r\n\r\n", "Transfer-Encoding: chunked"))
        await writer.drain()

    server, url, _, _ = await _raw_server(answer)
    client = UpstreamClient(read_timeout=2)
    async with await client.post(url, b"{}", {}) as r:
        with pytest.raises(UpstreamDisconnected, match="invalid chunk size"):
            await asyncio.wait_for(r.read(), 3)
    assert client.num_in_use == 0
    await client.close()
    server.close()


async def test_read_stops_at_its_limit_and_read_start_takes_the_first_bytes():
    async def answer(writer, request, n):
        if n == 1:   # announces more than it sends: refused from the head, nothing waited for
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n" + b"x" * 100)
        elif n == 2:
            writer.write(_answer(b"3e8\r\n" + b"x" * 1000 + b"\r\n0\r\n\r\n", "Transfer-Encoding: chunked"))
        else:
            writer.write(_answer(b"y" * 100, "Content-Length: 100"))
        await writer.drain()

    server, url, _, connections = await _raw_server(answer)
    client = UpstreamClient(read_timeout=2)
    for _ in range(2):
        async with await client.post(url, b"{}", {}) as r:
            with pytest.raises(relay.UpstreamTooLarge, match="over 500 bytes"):
                await asyncio.wait_for(r.read(500), 3)
        assert client.num_in_use == 0
    async with await client.post(url, b"{}", {}) as r:
        assert await r.read_start(10) == b"y" * 10
    async with await client.post(url, b"{}", {}) as r:   # all of a short body: the connection is kept
        assert await r.read_start(1000) == b"y" * 100
    assert client.num_in_use == 0 and connections[0] == 4
    await client.close()
    server.close()


def test_events_are_split_from_the_new_bytes_only():
    tail = bytearray()
    pieces = [b"data: 1\n", b"\ndata: 2\n\n\n", b"\ndata: 3", b"\n\ndata: 4"]
    assert [split_events(tail, p) for p in pieces] == [[], [b"data: 1", b"data: 2"], [b""], [b"data: 3"]]
    assert tail == b"data: 4"   # as the whole stream split at once
    assert b"".join(pieces).split(b"\n\n") == [b"data: 1", b"data: 2", b"", b"data: 3", b"data: 4"]


# --- relayed through the gateway ---------------------------------------------------------------------
@pytest.mark.parametrize("after", [b"", b"ZZ\r\n"], ids=["dropped", "invalid_chunk"])
async def test_a_stream_that_fails_midway_ends_with_an_error_event(aiohttp_client, tmp_path, after):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, url = await _serve(lambda request: (head + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n" + after,))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    text = await r.text()
    assert r.status == 200 and r.content_type == "text/event-stream"
    assert text.startswith('data: {"id": "c1", "model": "front-model"'), text
    _assert_error_event_then_done(text, "upstream_disconnected")
    _assert_no_slot_held(gateway)
    server.close()


RESPONSE_CREATED = (b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, '
                    b'"response": {"model": "upstream-model", "usage": null}}\n\n')
CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("path, answer", [
    ("/v1/chat/completions", b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + EVENT),
    ("/v1/chat/completions", CHUNKED + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n0\r\n\r\n"),
    ("/v1/responses", CHUNKED + b"%x\r\n" % len(RESPONSE_CREATED) + RESPONSE_CREATED + b"\r\n0\r\n\r\n")],
    ids=["ended_by_the_connection", "chunked_without_done", "responses_without_its_final_event"])
async def test_a_stream_whose_body_ends_before_its_last_event_ends_with_an_error_event(aiohttp_client, tmp_path,
                                                                                     path, answer):
    """A body that ends cleanly (the connection's FIN for one framed by it, the last chunk) before `[DONE]`
    or a Responses stream's final event was cut short all the same: the client must not take it as whole."""
    server, url = await _serve(lambda request: (answer,))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    body = {"model": FRONT, "input": "hi"} if path == "/v1/responses" else CHAT
    r = await client.post(path, json={**body, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert r.status == 200 and FRONT in events[0], events
    if path == "/v1/responses":
        assert len(events) == 2 and events[1].startswith("event: error\ndata: "), events
        error = json.loads(events[1].split("data: ", 1)[1])
        assert error["code"] == "upstream_disconnected" and "before its last event" in error["message"], error
    else:
        _assert_error_event_then_done("\n\n".join(events), "upstream_disconnected")
    series = gateway.metrics.pool_series("remote")
    assert series.e2e._sum.get() == 0   # not a request that completed: a failed one, though its status was 200
    assert gateway.metrics.errors.labels(status="502")._value.get() == 1
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_stream_ends_soon_after_its_last_event_whatever_the_upstreams_body_does(aiohttp_client, tmp_path):
    """An upstream that holds its body open after `data: [DONE]` held the client's stream (and its latency) until
    it closed, up to the read timeout: its body gets `TAIL_SECONDS` to end, then it is closed."""
    async def answer(writer, request, n):
        done = b"data: [DONE]\n\n"
        writer.write(CHUNKED + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n" + b"%x\r\n" % len(done) + done + b"\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        writer.write(b"0\r\n\r\n")
        return "close"

    server, url, _, _ = await _raw_server(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    started = time.monotonic()
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert time.monotonic() - started < relay.TAIL_SECONDS + 2.5, "the client waited for the upstream's body"
    assert r.status == 200 and events[-1] == "data: [DONE]" and FRONT in events[0], events
    assert gateway.metrics.errors.labels(status="502")._value.get() == 0   # a whole answer, not a failure
    _assert_no_slot_held(gateway)
    server.close()


async def test_an_event_over_its_limit_ends_the_stream_with_an_error_event(aiohttp_client, tmp_path, monkeypatch):
    monkeypatch.setattr(relay, "MAX_EVENT_BYTES", 1000)
    body = EVENT + b"data: " + b"x" * 5000
    server, url = await _serve(lambda request: _reply(200, body, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    text = await r.text()
    assert r.status == 200 and text.startswith('data: {"id": "c1", "model": "front-model"'), text
    _assert_error_event_then_done(text, "upstream_error")
    assert "over 1000 bytes" in text
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n",
                                  b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"],
                         ids=["content_length", "chunked", "close_delimited"])
async def test_an_answer_over_its_limit_is_a_502(aiohttp_client, tmp_path, monkeypatch, head):
    monkeypatch.setattr(relay, "MAX_ANSWER_BYTES", 1000)
    server, url = await _serve(lambda request: (head + b" " * 5000,))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    error = (await r.json())["error"]
    assert r.status == 502 and error["code"] == "upstream_error" and "over 1000 bytes" in error["message"], error
    _assert_no_slot_held(gateway)
    server.close()


async def test_only_the_start_of_an_error_body_is_read(aiohttp_client, tmp_path):
    async def answer(writer, request, n):   # announces 100 MB, sends 100 kB, then waits
        writer.write(b"HTTP/1.1 500 Oops\r\nContent-Length: 100000000\r\n\r\n" + b"e" * 100_000)
        await writer.drain()
        await asyncio.sleep(30)

    server, url, _, _ = await _raw_server(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    r = await asyncio.wait_for(client.post("/v1/chat/completions", json=CHAT), 5)
    error = (await r.json())["error"]
    assert r.status == 500 and error["code"] == "upstream_error" and "e" * 400 in error["message"], error
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("status", [600, 1000, 302])
async def test_a_status_neither_success_nor_error_is_a_502(aiohttp_client, tmp_path, status):
    server, url = await _serve(lambda request: _reply(status, b'{"error": {"message": "odd"}}'))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = (await r.json())["error"]
        assert r.status == 502 and error["code"] == "upstream_error" and f"status {status}" in error["message"]
    _assert_no_slot_held(gateway)
    server.close()


async def test_an_interim_answer_is_skipped_for_the_one_that_follows(aiohttp_client, tmp_path):
    """100 Continue and 103 Early Hints come before the real answer (RFC 9110: a client skips them)."""
    answer = _reply(200, _chat_answer({"prompt_tokens": 1, "completion_tokens": 1}))
    server, url = await _serve(lambda request: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
                                               b"Link: </x>\r\n\r\n" + answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200 and (await r.json())["model"] == FRONT
    _assert_no_slot_held(gateway)
    server.close()


async def test_crlf_separated_events_are_relayed_one_by_one(aiohttp_client, tmp_path):
    """sse-starlette (llama-cpp-python's server) ends lines with CRLF: each event is its own, renamed."""
    events = EVENT.replace(b"\n", b"\r\n") * 2 + b"data: [DONE]\r\n\r\n"
    server, url = await _serve(lambda request: _reply(200, events, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    relayed = [e for e in (await r.text()).split("\n\n") if e]
    assert len(relayed) == 3 and relayed[-1] == "data: [DONE]", relayed
    assert all(json.loads(e.removeprefix("data: "))["model"] == FRONT for e in relayed[:2])
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("ended", [False, True])
async def test_a_responses_stream_that_fails_ends_with_an_error_event_unless_it_had_ended(aiohttp_client, tmp_path,
                                                                                       ended):
    """A Responses stream has no [DONE]: a failure after `response.completed` adds nothing; before it, an
    `error` event (OpenAI's ResponseErrorEvent), with the model names put back in the events relayed."""
    created = (b'event: response.created\ndata: {"type": "response.created", '
               b'"response": {"model": "upstream-model"}}\n\n')
    completed = created.replace(b"response.created", b"response.completed")
    body = created + (completed if ended else b"")
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, url = await _serve(lambda request: (head + b"%x\r\n" % len(body) + body + b"\r\n",))   # then drops
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/responses", json={"model": FRONT, "input": "hi", "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert json.loads(events[0].split("data: ", 1)[1])["response"]["model"] == FRONT
    if ended:
        assert len(events) == 2 and events[1].startswith("event: response.completed"), events
    else:
        assert len(events) == 2 and events[1].startswith("event: error\ndata: "), events
        error = json.loads(events[1].split("data: ", 1)[1])
        assert error["type"] == "error" and error["code"] == "upstream_disconnected"
    assert "[DONE]" not in "".join(events)
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("body, message", [(b'{"error": "bad thing"}', "bad thing"),
                                           (b'{"error": null}', '{"error": null}'),
                                           (b'{"error": 7}', '{"error": 7}'),
                                           (b"[1, 2]", "[1, 2]")], ids=["string", "null", "number", "list"])
async def test_an_error_body_not_in_the_openai_format_is_put_in_it(aiohttp_client, tmp_path, body, message):
    server, url = await _serve(lambda request: _reply(400, body))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    error = (await r.json())["error"]
    assert r.status == 400, error
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "upstream_error"
    assert error["message"] == f"upstream pool 'remote' answered 400: {message}"
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_completion_without_max_tokens_goes_upstream_with_what_the_context_leaves(aiohttp_client, tmp_path):
    """A 505-token prompt in a 512-token context: 7 tokens, as from a local pool (the upstream got no max_tokens,
    took its default 16, and refused the request)."""
    requests: list[bytes] = []
    answer = json.dumps({"id": "c1", "object": "text_completion", "model": "upstream-model", "choices": []}).encode()
    server, url = await _serve(lambda request: requests.append(request) or _reply(200, answer))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    for prompt, max_tokens in (([5] * 505, 7), ([5] * 8, 16)):
        r = await client.post("/v1/completions", json={"model": FRONT, "prompt": prompt})
        assert r.status == 200, await r.text()
        assert json.loads(requests[-1].split(b"\r\n\r\n", 1)[1])["max_tokens"] == max_tokens
    server.close()


async def test_the_upstream_limits_come_from_the_gateway_section(aiohttp_client, tmp_path):
    """`gateway.upstream`: connections to one upstream host (256 by default; a request past them waits 10 s,
    then 502 naming the key), and the read timeout (600 s)."""
    gateway = _gateway(tmp_path, "http://127.0.0.1:9/v1")
    await aiohttp_client(create_app(gateway))
    assert (gateway.upstream.max_connections, gateway.upstream.read_timeout) == (256, 600.0)
    path = tmp_path / "pools.yaml"
    path.write_text("gateway: {upstream: {max_connections: 3, read_timeout_seconds: 45}}\n" + path.read_text())
    gateway = Gateway.from_config(load_config(path))
    await aiohttp_client(create_app(gateway))
    assert (gateway.upstream.max_connections, gateway.upstream.read_timeout) == (3, 45.0)


async def test_a_chat_stream_that_drops_after_an_error_event_still_ends_with_our_error_and_done(aiohttp_client,
                                                                                              tmp_path):
    """An `event: error` line (or a chunk of type error) ends a Responses stream, not a chat one: a chat stream
    that then dropped got neither our error event nor `[DONE]`."""
    events = EVENT + b'event: error\ndata: {"type": "error", "message": "overloaded"}\n\n'
    dropped = (CHUNKED + b"%x\r\n" % len(events) + events + b"\r\n",)   # then the connection drops
    server, url = await _serve(lambda request: dropped)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    _assert_error_event_then_done(await r.text(), "upstream_disconnected")
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_chat_stream_that_drops_after_its_own_error_ends_with_done_and_counts_its_status(aiohttp_client,
                                                                                                tmp_path):
    """The upstream said why it failed (`data: {"error": ...}`), then dropped: the client gets that error once,
    then `[DONE]`, and request_errors counts the upstream's status."""
    events = EVENT + b'data: {"error": {"message": "overloaded", "type": "server_error", "code": 503}}\n\n'
    server, url = await _serve(lambda request: (CHUNKED + b"%x\r\n" % len(events) + events + b"\r\n",))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    text = await r.text()
    assert text.count('"error"') == 1 and text.endswith("data: [DONE]\n\n"), text
    assert gateway.metrics.errors.labels(status="503")._value.get() == 1
    assert gateway.metrics.errors.labels(status="502")._value.get() == 0
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_failed_relayed_stream_counts_though_its_client_is_gone_before_the_error_is_written(
        aiohttp_client, tmp_path, monkeypatch):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, url = await _serve(lambda request: (head + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n",))   # drops
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    writes = []

    async def write_within(request, write, *args):
        writes.append(1)
        if len(writes) > 1:   # the error's tail: the client is gone
            write.close()
            raise ClientGone("gone")
        await write

    monkeypatch.setattr(relay, "write_within", write_within)
    with contextlib.suppress(Exception):
        await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).read()
    for _ in range(100):
        if gateway.metrics.errors.labels(status="502")._value.get():
            break
        await asyncio.sleep(0.02)
    assert gateway.metrics.errors.labels(status="502")._value.get() == 1
    server.close()


async def test_sglangs_flat_error_body_is_read_as_the_openai_one(aiohttp_client, tmp_path):
    flat = (b'{"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "param": null, '
            b'"code": 400}')
    server, url = await _serve(lambda request: _reply(400, flat))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 400 and (await r.json())["error"] == {"message": "max_tokens is too large",
                                                             "type": "BadRequestError", "param": None, "code": None}
    server.close()


async def test_the_upstream_is_asked_for_no_encoding_with_the_pools_key_less_its_newline(aiohttp_client, tmp_path,
                                                                                        monkeypatch):
    """A gzip answer would be unreadable (it was a 502): none is asked for. A key read from a secret's file
    keeps its newline (every request was a 500, the header refused)."""
    monkeypatch.setenv("POOL_KEY", "sk-pool\n")
    requests: list[bytes] = []
    answer = json.dumps({"id": "c1", "object": "chat.completion", "model": "upstream-model", "choices": []}).encode()
    server, url = await _serve(lambda request: requests.append(request) or _reply(200, answer))
    client = await aiohttp_client(create_app(_gateway(tmp_path, url, "upstream_api_key_env: POOL_KEY")))
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200, await r.text()
    assert b"\r\nAccept-Encoding: identity\r\n" in requests[0]
    assert b"\r\nAuthorization: Bearer sk-pool\r\n" in requests[0]
    server.close()


async def test_a_lone_surrogate_in_a_field_we_do_not_read_goes_upstream_escaped(aiohttp_client, tmp_path):
    """`user` (or metadata, a schema's description) holding half an emoji: valid JSON, no UTF-8; the relay's
    encoder refused it, a 500 on every such request to an upstream pool."""
    requests: list[bytes] = []
    answer = json.dumps({"id": "c1", "object": "chat.completion", "model": "upstream-model", "choices": []}).encode()
    server, url = await _serve(lambda request: requests.append(request) or _reply(200, answer))
    client = await aiohttp_client(create_app(_gateway(tmp_path, url)))
    r = await client.post("/v1/chat/completions", json={**CHAT, "user": "a\ud800b"})
    assert r.status == 200, await r.text()
    assert b'"user":"a\\ud800b"' in requests[0].replace(b" ", b"")
    server.close()


async def test_half_an_emoji_in_a_stream_goes_on_as_the_upstream_wrote_it(aiohttp_client, tmp_path):
    """A lone surrogate (an emoji cut at a UTF-16 boundary, as JavaScript servers write it) is valid JSON but
    no UTF-8: the relay wrote nothing of it and cut the stream with no error event."""
    half = (b'data: {"id": "c1", "model": "upstream-model", "choices": [{"index": 0, "delta": {"content": '
            b'"\\ud83d"}}]}\n\n')
    server, url = await _serve(lambda request: _reply(200, half + b"data: [DONE]\n\n", "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert r.status == 200 and events[-1] == "data: [DONE]", events
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["model"] == FRONT and chunk["choices"][0]["delta"]["content"] == "\ud83d"
    _assert_no_slot_held(gateway)
    server.close()
    # a whole answer too (msgspec refuses the surrogate: it was a 502 "invalid response", a batch line's failure)
    whole = (b'{"id": "c1", "object": "chat.completion", "model": "upstream-model", "choices": [{"index": 0, '
             b'"message": {"role": "assistant", "content": "\\ud83d"}, "finish_reason": "length"}]}')
    server, url = await _serve(lambda request: _reply(200, whole))
    client = await aiohttp_client(create_app(_gateway(tmp_path, url)))
    r = await client.post("/v1/chat/completions", json=CHAT)
    answer = json.loads(await r.text())
    assert r.status == 200 and answer["model"] == FRONT and answer["choices"][0]["message"]["content"] == "\ud83d"
    server.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [401, 403])
async def test_an_upstream_refusing_the_gateways_key_is_a_502_without_its_message(aiohttp_client, tmp_path,
                                                                                   monkeypatch, caplog, status,
                                                                                   stream):
    """The client's key never goes upstream: a 401 or 403 refuses the gateway's own, which the client can do
    nothing about (relayed, the SDKs would raise AuthenticationError for the client's key), and the
    upstream's message (which quotes the end of that key) is for the operator's log only."""
    monkeypatch.setenv("POOL_KEY", "sk-pool-secret-ABCD")
    refusal = (b'{"error": {"message": "Incorrect API key provided: sk-pool-****ABCD.", '
               b'"type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}')
    server, url = await _serve(lambda request: _reply(status, refusal))
    gateway = _gateway(tmp_path, url, "upstream_api_key_env: POOL_KEY")
    client = await aiohttp_client(create_app(gateway, data_dir=tmp_path))
    with caplog.at_level("WARNING", logger="cliffguard.gateway"):
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = (await r.json())["error"]
    assert r.status == 502 and error["code"] == "upstream_error" and error["type"] == "server_error", error
    assert "refused the gateway's credentials" in error["message"] and f"answered {status}" in error["message"]
    assert "ABCD" not in error["message"] and "Incorrect API key" not in error["message"]
    assert any("Incorrect API key provided" in rec.getMessage() and "$POOL_KEY" in rec.getMessage()
               and rec.levelname == "WARNING" for rec in caplog.records), caplog.records
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_without_the_pools_model_is_a_502_not_the_clients_404(aiohttp_client, tmp_path, caplog,
                                                                                stream):
    """The model the client asked for is listed (the gateway's); the upstream's 404 is for the pool's own `model:`
    or path, a configuration the client can do nothing about: relayed, the SDKs raised NotFoundError for the
    client's model, naming the upstream's."""
    missing = (b'{"object": "error", "message": "The model `upstream-model` does not exist.", '
               b'"type": "NotFoundError", "param": null, "code": 404}')
    server, url = await _serve(lambda request: _reply(404, missing))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    with caplog.at_level("WARNING", logger="cliffguard.gateway"):
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = (await r.json())["error"]
    assert r.status == 502 and error["code"] == "upstream_error" and "answered 404" in error["message"], error
    assert r.headers["x-should-retry"] == "false"   # a configuration to fix: the SDKs sent it twice more
    assert "does not exist" not in error["message"] and "upstream-model" not in error["message"]
    assert any("does not exist" in rec.getMessage() and rec.levelname == "WARNING" for rec in caplog.records)
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("status, code", [(200, "upstream_error"), (400, "upstream_error")])
async def test_json_nested_past_the_decoders_depth_is_not_a_500(aiohttp_client, tmp_path, status, code):
    server, url = await _serve(lambda request: _reply(status, b"[" * 5000 + b"]" * 5000))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    error = (await r.json())["error"]
    assert r.status == (502 if status == 200 else status) and error["code"] == code, error
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("body", [{"error": "bad thing"}, {"error": None}, {"error": 3}, [1], "x"])
def test_a_relayed_error_of_any_shape_is_an_api_error(body):
    error = _relayed_error(web.json_response(body, status=400))
    assert error.status == 400 and isinstance(error.message, str)


@pytest.mark.parametrize("usage", ["lots", {"prompt_tokens": -1}, "3", None, 3,
                                   {"prompt_tokens": "3", "completion_tokens": "4"},
                                   {"prompt_tokens": True, "completion_tokens": 2.5}])
async def test_a_malformed_usage_is_relayed_and_not_counted(aiohttp_client, tmp_path, usage):
    """Relayed as it is; the prompt's tokens are the gateway's own count, the output's none."""
    server, url = await _serve(lambda request: _reply(200, _chat_answer(usage)))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    answer = await r.json()
    assert r.status == 200 and answer["usage"] == usage and answer["model"] == FRONT, answer
    series = gateway.metrics.pool_series("remote")
    _, ids = await gateway.route_chat(FRONT, CHAT["messages"])
    assert (series.prompt_tokens._value.get(), series.generation_tokens._value.get()) == (len(ids), 0)
    server.close()


async def test_the_valid_counts_of_a_usage_are_counted(aiohttp_client, tmp_path):
    server, url = await _serve(lambda request: _reply(200, _chat_answer({"prompt_tokens": 5,
                                                                           "completion_tokens": -2})))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    series = gateway.metrics.pool_series("remote")
    assert (series.prompt_tokens._value.get(), series.generation_tokens._value.get()) == (5, 0)
    server.close()


async def test_a_stream_answered_without_streaming(aiohttp_client, tmp_path):
    answers = iter([_reply(200, _chat_answer(None)), _reply(429, b'{"error": {"message": "slow down", "type": "x", '
                                                                 b'"param": null, "code": "rate_limited"}}')])
    server, url = await _serve(lambda request: next(answers))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    error = (await r.json())["error"]
    assert r.status == 502 and error["code"] == "upstream_error" and "did not stream" in error["message"], error
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status == 429 and (await r.json())["error"]["code"] == "rate_limited"
    _assert_no_slot_held(gateway)
    server.close()


async def test_batch_lines_keep_what_the_upstream_answered(aiohttp_client, tmp_path):
    def answer(request: bytes) -> bytes:
        prompt = json.loads(request.split(b"\r\n\r\n", 1)[1])["messages"][0]["content"]
        return {"usage": _reply(200, _chat_answer("lots")), "plain": _reply(400, b'{"error": "bad thing"}'),
                "null": _reply(400, b'{"error": null}'), "odd": _reply(600, b"{}")}[prompt]

    server, url = await _serve(answer)
    done, errors = await _run_batch(aiohttp_client, tmp_path, url, "usage", "plain", "null", "odd")
    assert done["request_counts"] == {"total": 4, "completed": 1, "failed": 3}, done
    statuses = {e["custom_id"]: (e["response"]["status_code"], e["response"]["body"]["error"]) for e in errors}
    assert statuses["plain"][0] == statuses["null"][0] == 400
    assert "bad thing" in statuses["plain"][1]["message"]
    assert statuses["odd"][0] == 502 and statuses["odd"][1]["code"] == "upstream_error"
    server.close()


# --- what the client is told: when to try again, an event cut short, the drain's end ------------------------------
async def test_an_upstream_429_keeps_its_retry_headers_and_a_batch_line_is_tried_again(aiohttp_client, tmp_path):
    """A rate limit's Retry-After (and OpenAI's x-ratelimit-* headers) reach the client, whose SDK waits what
    it says; a batch line answered 429 was refused, never run, so it is tried again like a line whose
    upstream could not be reached. The operator's account ids in its message (OpenAI's names the organization)
    are masked: the client is not the account's holder."""
    refusal = (b'{"error": {"message": "Rate limit reached for gpt-4o in organization org-AbCdEf123456GhIjKl78MnOp '
               b'on requests per min (RPM): Limit 3, Used 3; project proj_AbCdEfGhIjKlMnOpQrStUvWx; see '
               b'user_location and user-provided keys.", '
               b'"code": "rate_limit_exceeded"}}')
    limited = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 7\r\n"
               b"x-ratelimit-remaining-requests: 0\r\nContent-Length: %d\r\n\r\n%s" % (len(refusal), refusal))
    tries: dict[str, int] = {}

    def answer(request: bytes) -> bytes:
        prompt = json.loads(request.split(b"\r\n\r\n", 1)[1])["messages"][0]["content"]
        tries[prompt] = tries.get(prompt, 0) + 1
        if prompt == "bad":
            return _reply(400, b'{"error": "bad thing"}')
        if prompt == "poison":   # another gateway's poison request: its SDK must not send it again
            return (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nx-should-retry: false"
                    b"\r\nContent-Length: 42\r\n\r\n" + b'{"error": {"message": "poison request!!"}}')
        return limited if tries[prompt] == 1 or prompt == "hi" else _reply(200, _chat_answer(None))

    server, url = await _serve(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json=CHAT)
    error = (await r.json())["error"]
    assert r.status == 429 and error["code"] == "rate_limit_exceeded"
    assert "org-AbCdEf" not in error["message"] and "in organization org-… on requests" in error["message"]
    assert "project proj_…;" in error["message"]                         # an id of letters alone too
    assert "user_location and user-provided keys" in error["message"]   # words, not ids: as they came
    assert (r.headers["Retry-After"], r.headers["x-ratelimit-remaining-requests"]) == ("7", "0")
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "poison"}]})
    assert r.status == 500 and r.headers["x-should-retry"] == "false", await r.text()
    (tmp_path / "batch").mkdir()
    done, errors = await _run_batch(aiohttp_client, tmp_path / "batch", url, "later", "bad")
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, done
    assert tries["later"] == 2 and tries["bad"] == 1 and [e["custom_id"] for e in errors] == ["bad"]
    server.close()


def test_account_ids_are_masked_in_one_pass_over_an_upstream_message():
    """The mask reads a message once: an upstream echoing a client's long word after `org-` in its error (a
    16 KiB body) took its pattern 1.2 s of the event loop, every stream stalled meanwhile."""
    def message(text: str) -> str:
        return relay.openai_error(json.dumps({"error": {"message": text}}).encode(), "ctx")["message"]

    assert message("org-AbCdEf123456GhIjKl78 and user_AAAAAAAAAAAAAAAAAAAAb.") == "org-… and user_….", "ids"
    assert message("proj_abcdefghijklmnopqrst, org-ABCDEFGHIJKLMNOPQRS, user-provided") == \
        "proj_abcdefghijklmnopqrst, org-ABCDEFGHIJKLMNOPQRS, user-provided"   # one case, no digit: words
    assert message("org-abc123") == "org-abc123"   # too short for an id
    word = "org-" + "a" * 16_000
    started = time.process_time()   # CPU time: a loaded machine adds less
    assert message(word + " org-" + "B" * 16_000) == word + " org-" + "B" * 16_000
    assert time.process_time() - started < 0.2


async def test_an_event_the_body_ends_inside_is_never_relayed_as_whole(aiohttp_client, tmp_path):
    """A body framed by its connection that ends (a FIN, no error) inside an event: that tail is not an event
    (the SSE spec drops it) and the client gets the stream's error and `[DONE]`, every data line JSON."""
    async def write(writer, request, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + EVENT
                     + b'data: {"id": "c1", "choi')
        await writer.drain()
        return "close"

    server, url, _, _ = await _raw_server(write)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    text = await r.text()
    datas = [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and all(isinstance(json.loads(d), dict) for d in datas[:-1]), text
    _assert_error_event_then_done(text, "upstream_disconnected")
    server.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_relayed_request_in_flight_when_the_drain_ends_is_answered_503(aiohttp_client, tmp_path, stream):
    """Cut at the drain's end as a local one is: a relayed stream ends with the `server_shutting_down`
    error event and `[DONE]`, a request not yet answered gets that 503; the upstream's connection is closed
    (it stops), and the slot comes back."""
    stalled = asyncio.Event()

    async def write(writer, request, n):
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + EVENT)
            await writer.drain()
        stalled.set()
        await asyncio.sleep(60)

    server, url, _, _ = await _raw_server(write)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    post = asyncio.ensure_future(client.post("/v1/chat/completions", json={**CHAT, "stream": stream}))
    await asyncio.wait_for(stalled.wait(), 5)
    await asyncio.sleep(0.1)
    assert gateway.cut_in_flight() == 1
    r = await asyncio.wait_for(post, 5)
    if stream:
        text = await asyncio.wait_for(r.text(), 5)
        assert r.status == 200 and text.startswith(EVENT.decode().replace("upstream-model", FRONT)[:20]), text
        _assert_error_event_then_done(text, "server_shutting_down")
    else:
        assert r.status == 503 and (await r.json())["error"]["code"] == "server_shutting_down"
    _assert_no_slot_held(gateway)
    server.close()


@pytest.mark.parametrize("asks_usage", [False, True])
async def test_a_relayed_stream_is_counted_whether_or_not_its_client_asked_for_usage(aiohttp_client, tmp_path,
                                                                                    asks_usage):
    """The gateway asks the upstream for the stream's usage (`stream_options.include_usage`) to count its
    tokens; a client that did not ask gets no usage chunk and no `usage: null`, as from the upstream alone.
    Its end counts in request_success; an upstream's error in request_errors."""
    forwarded = []

    def answer(request: bytes) -> bytes:
        body = json.loads(request.split(b"\r\n\r\n", 1)[1])
        forwarded.append(body)
        if body["messages"][0]["content"] == "fail":
            return _reply(500, b'{"error": {"message": "boom", "type": "server_error", "code": null}}')
        usage = body.get("stream_options", {}).get("include_usage")
        chunk = {"id": "c1", "model": "upstream-model", "choices": [
            {"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
        last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        events = [dict(c, usage=None) if usage else c for c in (chunk, last)]
        if usage:
            events.append({"id": "c1", "model": "upstream-model", "choices": [],
                           "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}})
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return _reply(200, sse, "text/event-stream")

    server, url = await _serve(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    extra = {"stream_options": {"include_usage": True}} if asks_usage else {}
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, **extra})
    chunks = [json.loads(line[6:]) for line in (await r.text()).split("\n") if line.startswith("data: {")]
    assert forwarded[0]["stream_options"] == {"include_usage": True}
    assert [c["choices"] for c in chunks][-1] == ([] if asks_usage else [
        {"index": 0, "delta": {}, "finish_reason": "stop"}])
    assert all(("usage" in c) == asks_usage for c in chunks), chunks
    series = gateway.metrics.pool_series("remote")
    assert (series.prompt_tokens._value.get(), series.generation_tokens._value.get()) == (9, 2)
    success = gateway.metrics.request_success.labels(pool="remote", finished_reason="stop")._value.get()
    assert success == 1
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "fail"}]})
    assert r.status == 500 and gateway.metrics.errors.labels(status="500")._value.get() == 1
    server.close()


async def test_a_relayed_answers_latency_counts_from_the_requests_arrival_and_only_a_clients():
    """Parsing, counting and routing are in a relayed request's latency, as in a local one's: `forward`
    times it from the arrival it is given. What no client waits on (a batch line, a background Response:
    forwarded with no request) is kept out of the latency, as a local one is."""
    from aiohttp.test_utils import make_mocked_request

    from gateway.monitoring.metrics import GatewayMetrics
    from tests.gateway.test_upstream_retry import _gateway

    server, url = await _serve(lambda request: _reply(200, _chat_answer({"prompt_tokens": 3, "completion_tokens": 1})))
    pool, metrics, client = _gateway(Path(tempfile.mkdtemp()), url).pools["remote"], GatewayMetrics(), UpstreamClient()
    e2e = metrics.pool_series("remote").e2e
    await relay.forward(None, client, pool, "/chat/completions", CHAT, False, metrics,
                        received=time.perf_counter() - 5.0)
    assert e2e._sum.get() == 0 and metrics.pool_series("remote").prompt_tokens._value.get() == 3   # counted, untimed
    await relay.forward(make_mocked_request("POST", "/v1/chat/completions"), client, pool, "/chat/completions",
                        CHAT, False, metrics, received=time.perf_counter() - 5.0)
    assert e2e._sum.get() >= 5.0
    await client.close()
    server.close()


@pytest.mark.parametrize("path, events, status", [
    ("/v1/chat/completions", EVENT + b'data: {"error": {"message": "boom", "type": "server_error", "code": 503}}\n\n'
     b"data: [DONE]\n\n", "503"),
    ("/v1/chat/completions", EVENT + b'data: {"error": {"message": "its worker died", "code": "engine_dead"}}\n\n'
     b"data: [DONE]\n\n", "502"),
    ("/v1/responses", RESPONSE_CREATED + b'event: response.failed\ndata: {"type": "response.failed", '
     b'"response": {"model": "upstream-model", "status": "failed", "error": {"code": "server_error"}}}\n\n', "502")],
    ids=["chat_numeric_code", "chat_a_chained_gateways_error", "responses_failed"])
async def test_an_upstreams_own_error_event_counts_as_a_failed_request(aiohttp_client, tmp_path, path, events,
                                                                        status):
    """A stream the upstream itself ended with its error (vLLM's and cliffguard's `data: {"error": ...}` then
    `[DONE]`; a Responses stream's `response.failed`) is relayed as it came and counted as the failure it is:
    in request_errors, not in the latency of requests that completed nor in request_success."""
    server, url = await _serve(lambda request: _reply(200, events, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    body = {"model": FRONT, "input": "hi"} if path == "/v1/responses" else CHAT
    r = await client.post(path, json={**body, "stream": True})
    text = await r.text()
    assert r.status == 200 and "upstream_" not in text, text   # relayed as it came, no error of ours after it
    assert gateway.metrics.errors.labels(status=status)._value.get() == 1
    assert gateway.metrics.pool_series("remote").e2e._sum.get() == 0
    assert not [s for s in gateway.metrics.request_success.collect()[0].samples if s.value]
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_relayed_stream_whose_client_left_still_counts_its_prompt(aiohttp_client, tmp_path):
    """A client that closes its connection mid-stream (the handler is cancelled): the upstream ran its prompt."""
    async def answer(writer, request, n):   # one event, then the stream stays open, silent
        writer.write(CHUNKED + b"%x\r\n" % len(EVENT) + EVENT + b"\r\n")
        await writer.drain()

    server, url, _, _ = await _raw_server(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
    response.close()   # the client leaves
    _, ids = await gateway.route_chat(FRONT, CHAT["messages"])
    prompt = gateway.metrics.pool_series("remote").prompt_tokens
    for _ in range(200):
        if prompt._value.get():
            break
        await asyncio.sleep(0.02)
    assert prompt._value.get() == len(ids) > 0
    server.close()


async def test_a_relayed_streams_end_is_bounded_by_write_timeout(aiohttp_client, tmp_path, monkeypatch):
    """The stream's last write (its end: aiohttp waits there for the socket to drain) is bounded as every
    other: a client that stopped reading cannot hold the handler past `gateway.write_timeout`."""
    from tests.gateway.test_upstream_retry import _gateway

    async def never(self):
        await asyncio.Event().wait()

    monkeypatch.setattr(web.StreamResponse, "write_eof", never)
    server, url = await _serve(lambda request: _reply(200, EVENT + b"data: [DONE]\n\n", "text/event-stream"))
    _gateway(tmp_path, url)   # writes its YAML
    path = tmp_path / "pools.yaml"
    path.write_text("gateway: {write_timeout: 0.5}\n" + path.read_text())
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway, data_dir=tmp_path))
    with contextlib.suppress(Exception):   # the connection is aborted
        await asyncio.wait_for((await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).read(), 10)
    assert gateway.metrics.client_write_timeouts.labels(pool="remote")._value.get() == 1
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_relayed_stream_whose_client_stops_reading_still_counts_its_prompt(aiohttp_client, tmp_path,
                                                                                  monkeypatch):
    """A client cut off for not reading (ClientGone): the upstream ran its prompt all the same."""
    body = EVENT * 3 + b"data: [DONE]\n\n"
    server, url = await _serve(lambda request: _reply(200, body, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    writes = []

    async def write_within(request, write, *args):
        writes.append(1)
        if len(writes) > 1:
            write.close()
            raise ClientGone("not reading")
        await write

    monkeypatch.setattr(relay, "write_within", write_within)
    with contextlib.suppress(Exception):   # the gateway drops such a client (here: its stream cut short)
        await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).read()
    _, ids = await gateway.route_chat(FRONT, CHAT["messages"])
    assert gateway.metrics.pool_series("remote").prompt_tokens._value.get() == len(ids) > 0
    server.close()
