"""Forwarding to an `upstream:` pool: any OpenAI-compatible server (another cliffguard, vLLM, ...).

The request body goes on unchanged except `model`, which becomes the upstream's model name; the
answer comes back with the client's model name restored. Streams are relayed event by event as they
arrive. Upstream errors (4xx and 5xx) keep their status and OpenAI error body; a body that is not one
(`{"error": "text"}`, not JSON) is put in that format, quoting it, with code `upstream_error`; only its
first `MAX_ERROR_BYTES` are read. Our own 502s say whether the upstream may have received the request:
`upstream_unreachable` when no connection could be made (nothing was sent: safe to send again, and the
batch runner does), `upstream_disconnected` when the connection failed after the request may have gone
out (the upstream may be running it: never sent again, so a batch line never runs twice),
`upstream_error` for an answer we cannot relay: not valid JSON, over `MAX_ANSWER_BYTES`, a status that
is neither a success (2xx) nor an error (4xx, 5xx), or not a stream (text/event-stream) when one was
asked for. A stream that fails once it started (dropped, a broken chunk, one event over
`MAX_EVENT_BYTES`) ends as a local one that fails does: an error event with that 502's error object
(`upstream_disconnected`, `upstream_error`), then `data: [DONE]`. Token counts for metrics come from
the upstream's `usage` where its counts are non-negative integers; a malformed usage is relayed as it is.

A batch line is forwarded with an `Idempotency-Key: <batch id>:<custom_id>` header (`IDEMPOTENCY_KEY`,
set by the batch runner around the line): an upstream that honours it answers a repeat from its first
run. cliffguard does not rely on it: it never sends a line again once it may have been received.

The upstream's URL is shown to clients (errors, `/v1/models`) only through `redact`, without any user
or password in it. A relayed stream's writes to the client are bounded by `write_timeout` like a
local one's, so a client that never reads cannot hold an upstream connection (the session has a
pool of them) for longer than that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

import msgspec
from aiohttp import web
from yarl import URL

from gateway.monitoring.metrics import GatewayMetrics
from gateway.openai.errors import ApiError
from gateway.client_writes import start_sse, write_within
from gateway.upstream.connection import (UpstreamClient, UpstreamDisconnected, UpstreamResponse,
                                         UpstreamTooLarge, UpstreamUnreachable)
from pools.pool import Pool

log = logging.getLogger("cliffguard.gateway")

# What is held of one upstream answer: a whole non-streamed body, one event of a stream (a `response.completed`
# event holds a whole response), the start of an error body (its message is quoted from the first 500 bytes).
MAX_ANSWER_BYTES = 64 << 20
MAX_EVENT_BYTES = 16 << 20
MAX_ERROR_BYTES = 16 << 10

# The forwarded request's Idempotency-Key: a batch line's `<batch id>:<custom_id>` (gateway.batch.execution), else None.
IDEMPOTENCY_KEY: ContextVar[str | None] = ContextVar("cliffguard_idempotency_key", default=None)


def _headers(pool: Pool, stream: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json",
               "Accept": "text/event-stream" if stream else "application/json"}
    env = pool.spec.upstream_api_key_env
    if env and os.environ.get(env):
        headers["Authorization"] = f"Bearer {os.environ[env]}"
    if (key := IDEMPOTENCY_KEY.get()) is not None:
        headers["Idempotency-Key"] = key
    return headers


def _upstream_failed(pool: Pool, what: str, exc: BaseException, code: str) -> ApiError:
    """Our 502 for an upstream that failed (`code`: see the module docstring), its URL redacted."""
    where = redact(pool.spec.upstream)
    detail = str(exc).replace(pool.spec.upstream, where) or type(exc).__name__
    return ApiError(502, f"upstream pool {pool.name!r} at {where} {what}: {detail}", type="server_error", code=code)


def redact(url: str) -> str:
    """`url` without the user and password of its authority (`http://u:secret@host/v1` -> `http://host/v1`)."""
    try:
        return str(URL(url).with_user(None))
    except (ValueError, TypeError):
        return "<upstream>"


def _rename(obj: Any, model: str) -> Any:
    """The client's model name put back: at the top (a completion, a chunk, a Response) and in a Responses
    stream event's `response`."""
    if isinstance(obj, dict):
        for holder in (obj, obj.get("response")):
            if isinstance(holder, dict) and "model" in holder:
                holder["model"] = model
    return obj


async def forward(request: web.Request, client: UpstreamClient, pool: Pool, path: str,
                  body: dict[str, Any], stream: bool, metrics: GatewayMetrics,
                  write_timeout: float = 30.0) -> web.StreamResponse:
    """Send `body` (with the upstream's model name) to `<pool.spec.upstream><path>` and relay the answer."""
    client_model = body["model"]
    received = time.perf_counter()
    try:
        upstream = await client.post(_url(pool.spec.upstream, path), _JSON.encode(dict(body, model=pool.spec.model)),
                                     _headers(pool, stream))
    except UpstreamUnreachable as exc:   # no connection: nothing sent
        raise _upstream_failed(pool, "is unreachable", exc, "upstream_unreachable") from None
    except (UpstreamDisconnected, OSError) as exc:   # after the request may have gone out
        raise _upstream_failed(pool, "dropped the request", exc, "upstream_disconnected") from None
    async with upstream:
        if not 200 <= upstream.status < 300:
            return await _relay_error(pool, upstream)
        if not stream:
            return await _relay_answer(pool, upstream, client_model, metrics, received)
        content_type = upstream.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != "text/event-stream":
            raise _upstream_failed(pool, "did not stream", ValueError(
                f"it answered a stream request with Content-Type {content_type[:80]!r}, not text/event-stream"),
                "upstream_error")
        return await _relay_stream(request, pool, upstream, client_model, metrics, received, write_timeout)


async def _relay_answer(pool: Pool, upstream: UpstreamResponse, client_model: str, metrics: GatewayMetrics,
                        received: float) -> web.Response:
    """A non-streamed answer (at most MAX_ANSWER_BYTES) with the client's model name put back."""
    try:
        payload = _rename(msgspec.json.decode(await upstream.read(MAX_ANSWER_BYTES)), client_model)
    except (UpstreamDisconnected, OSError) as exc:
        raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
    except UpstreamTooLarge as exc:
        raise _upstream_failed(pool, "sent an answer too large to relay", exc, "upstream_error") from None
    except (ValueError, RecursionError) as exc:   # not JSON, or nested past the decoder's depth
        raise _upstream_failed(pool, "sent an invalid response", exc, "upstream_error") from None
    usage = payload.get("usage") if isinstance(payload, dict) else None
    series = metrics.pool_series(pool.name)
    series.prompt_tokens.inc(_count(usage, "prompt_tokens"))
    series.generation_tokens.inc(_count(usage, "completion_tokens"))
    series.e2e.observe(time.perf_counter() - received)
    return web.Response(body=_JSON.encode(payload), content_type="application/json",
                        headers={"x-cliffguard-pool": pool.name})


def _count(usage: Any, key: str) -> int:
    """`usage[key]` where it is a count (a non-negative int), else 0: a malformed usage is relayed, not counted."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if type(value) is int and value >= 0 else 0


_JSON = msgspec.json.Encoder()


@functools.lru_cache(maxsize=256)
def _url(upstream: str, path: str) -> URL:
    """`<upstream><path>` parsed once (a pool's few endpoints)."""
    return URL(upstream.rstrip("/") + path)


async def _relay_error(pool: Pool, upstream: UpstreamResponse) -> web.Response:
    """The upstream's error (4xx, 5xx) with its status, in the OpenAI format: its body when it is one, else
    one quoting it (its message text, or the body's start). Any other status that is not a success is our
    502 `upstream_error`."""
    status = upstream.status
    if not 400 <= status <= 599:
        raise _upstream_failed(pool, "sent an invalid response", ValueError(
            f"status {status}, neither a success (2xx) nor an error (4xx, 5xx)"), "upstream_error")
    try:
        raw = await upstream.read_start(MAX_ERROR_BYTES)
    except (UpstreamDisconnected, OSError) as exc:
        raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
    return web.json_response({"error": openai_error(raw, f"upstream pool {pool.name!r} answered {status}")},
                             status=status, headers={"x-cliffguard-pool": pool.name})


def openai_error(raw: bytes, context: str) -> dict[str, Any]:
    """An upstream's error body as an OpenAI error object, every field there: its own `error` object (the
    message as text, `param` and `code` as text or null), else one quoting its text (its `error` string or
    the body's start) after `context`, with code `upstream_error`. The one rule for relayed HTTP errors
    and for the batch and background runs that read them (`gateway.completion`)."""
    try:
        payload = msgspec.json.decode(raw)
    except (ValueError, RecursionError):   # not JSON (or cut at MAX_ERROR_BYTES), or nested too deep
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        text = error if isinstance(error, str) and error else raw[:500].decode(errors="replace")
        return {"message": f"{context}: {text}", "type": "server_error", "param": None, "code": "upstream_error"}
    def text_or_none(value: Any) -> str | None:
        return None if value is None else str(value)
    return {"message": str(error.get("message") or ""), "type": str(error.get("type") or "server_error"),
            "param": text_or_none(error.get("param")), "code": text_or_none(error.get("code"))}


async def _relay_stream(request: web.Request, pool: Pool, upstream: UpstreamResponse, client_model: str,
                        metrics: GatewayMetrics, received: float, write_timeout: float) -> web.StreamResponse:
    """The upstream's SSE events, each relayed as it arrives with the client's model name put back; a
    client that takes nothing for `write_timeout` seconds is cut off (ClientGone). An upstream that fails
    before its stream ended (`[DONE]`; a Responses stream: its `response.completed` / `incomplete` /
    `failed` event) ends it with our error: a chat or completions stream `data: {"error": ...}` then
    `[DONE]`, a Responses stream an `error` event (OpenAI's `ResponseErrorEvent`)."""
    response = await start_sse(request, {"x-cliffguard-pool": pool.name})
    responses = request.path.endswith("/responses")

    async def write(data: bytes) -> None:
        await write_within(request, response.write(data), write_timeout, metrics, pool.name,
                           f"{request.path}: its relayed stream")

    first, done, failed = True, False, False
    async with contextlib.aclosing(_events(pool, upstream)) as events:
        async for event in events:
            if isinstance(event, ApiError):
                log.warning("%s: %s", request.path, event.message)
                failed = True
                if not done:
                    await write(_error_tail(event, responses))
                break
            await write(_relay_event(event, client_model) + b"\n\n")
            done = done or _ends_stream(event)
            if first and b"data: {" in event:
                metrics.pool_series(pool.name).ttft.observe(time.perf_counter() - received)
                first = False
    if not failed:
        metrics.pool_series(pool.name).e2e.observe(time.perf_counter() - received)
    await response.write_eof()
    return response


_FINAL_RESPONSE_EVENTS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")


def _ends_stream(event: bytes) -> bool:
    """The event is a stream's last: `[DONE]`, or a Responses stream's final Response."""
    return event == b"data: [DONE]" or event.startswith(_FINAL_RESPONSE_EVENTS)


def _error_tail(error: ApiError, responses: bool) -> bytes:
    body = error.body()["error"]
    if responses:
        event = {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]}
        return b"event: error\ndata: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": body}, ensure_ascii=False).encode() + b"\n\ndata: [DONE]\n\n"


async def _events(pool: Pool, upstream: UpstreamResponse) -> AsyncIterator[bytes | ApiError]:
    """The upstream stream's SSE events as they arrive; if it fails (dropped, a broken chunk, an event over
    MAX_EVENT_BYTES), last our 502 for it."""
    tail = bytearray()
    try:
        async with contextlib.aclosing(upstream.chunks()) as body:
            async for data in body:
                for event in _split_events(tail, data):
                    yield event
                if len(tail) > MAX_EVENT_BYTES:
                    yield _upstream_failed(pool, "sent an event too large to relay", UpstreamTooLarge(
                        f"an event over {MAX_EVENT_BYTES} bytes"), "upstream_error")
                    return
    except (UpstreamDisconnected, OSError) as exc:
        yield _upstream_failed(pool, "dropped the stream", exc, "upstream_disconnected")
        return
    if tail.strip():
        yield bytes(tail.rstrip(b"\r"))


def _split_events(tail: bytearray, data: bytes) -> list[bytes]:
    """Add `data` to `tail` (a stream's bytes not yet split) and take out the events it completed; only
    the new bytes are searched, so a long event costs its length once. Line ends are `\n`, `\r\n` or `\r`
    (the SSE grammar; sse-starlette sends `\r\n`), made `\n` as they come: a `\r` last in `data` is kept
    as it is until the next bytes tell whether a `\n` follows it."""
    if tail.endswith(b"\r"):
        del tail[-1:]
        data = data if data.startswith(b"\n") else b"\n" + data
    pending = data.endswith(b"\r")
    data = (data[:-1] if pending else data).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    start = max(len(tail) - 1, 0)   # a "\n\n" may straddle the old bytes and the new
    tail += data
    events, begin = [], 0
    while (end := tail.find(b"\n\n", start)) >= 0:
        events.append(bytes(tail[begin:end]))
        begin = start = end + 2
    del tail[:begin]
    if pending:
        tail += b"\r"
    return events


def _relay_event(event: bytes, model: str) -> bytes:
    """One SSE event with the client's model name put back into the JSON of its `data:` line (an event may
    open with an `event:` line, as the Responses API's do)."""
    head, sep, data = event.rpartition(b"data: ")
    if not data.startswith(b"{") or (sep and head and not head.endswith(b"\n")):
        return event
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return event
    return head + b"data: " + json.dumps(_rename(obj, model), ensure_ascii=False).encode()
