"""Forwarding to an `upstream:` pool: any OpenAI-compatible server (another cliffguard, vLLM, ...).

The request body goes on unchanged except `model`, which becomes the upstream's model name; the
answer comes back with the client's model name restored. Streams are relayed event by event as they
arrive. Upstream errors keep their status and OpenAI error body. Our own 502s say whether the upstream
may have received the request: `upstream_unreachable` when no connection could be made (nothing was
sent: safe to send again, and the batch runner does), `upstream_disconnected` when the connection
failed after the request may have gone out (the upstream may be running it: never sent again, so a
batch line never runs twice), `upstream_error` for an answer that is not valid JSON.
Token counts for metrics come from the upstream's `usage` when it reports one.

A batch line is forwarded with an `Idempotency-Key: <batch id>:<custom_id>` header (`IDEMPOTENCY_KEY`,
set by the batch runner around the line): an upstream that honours it answers a repeat from its first
run. cliffguard does not rely on it: it never sends a line again once it may have been received.

The upstream's URL is shown to clients (errors, `/v1/models`) only through `redact`, without any user
or password in it. A relayed stream's writes to the client are bounded by `write_timeout` like a
local one's, so a client that never reads cannot hold an upstream connection (the session has a
pool of them) for longer than that.
"""

from __future__ import annotations

import functools
import json
import os
import time
from contextvars import ContextVar
from typing import Any

import msgspec
from aiohttp import web
from yarl import URL

from gateway.monitoring.metrics import GatewayMetrics
from gateway.openai.errors import ApiError
from gateway.client_writes import start_sse, write_within
from gateway.upstream.connection import (UpstreamClient, UpstreamDisconnected, UpstreamResponse,
                                         UpstreamUnreachable)
from pools.pool import Pool

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
    if isinstance(obj, dict) and "model" in obj:
        obj["model"] = model
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
        if upstream.status >= 400:
            return await _relay_error(pool, upstream)
        if stream:
            return await _relay_stream(request, pool, upstream, client_model, metrics, received, write_timeout)
        try:
            payload = _rename(msgspec.json.decode(await upstream.read()), client_model)
        except (UpstreamDisconnected, OSError) as exc:
            raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
        except ValueError as exc:
            raise _upstream_failed(pool, "sent an invalid response", exc, "upstream_error") from None
        usage = (payload.get("usage") if isinstance(payload, dict) else None) or {}
        series = metrics.pool_series(pool.name)
        series.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        series.generation_tokens.inc(usage.get("completion_tokens", 0))
        series.e2e.observe(time.perf_counter() - received)
        return web.Response(body=_JSON.encode(payload), content_type="application/json",
                            headers={"x-cliffguard-pool": pool.name})


_JSON = msgspec.json.Encoder()


@functools.lru_cache(maxsize=256)
def _url(upstream: str, path: str) -> URL:
    """`<upstream><path>` parsed once (a pool's few endpoints)."""
    return URL(upstream.rstrip("/") + path)


async def _relay_error(pool: Pool, upstream: UpstreamResponse) -> web.Response:
    """The upstream's error with its status; its body when that is an OpenAI error, else one naming it."""
    try:
        raw = await upstream.read()
    except (UpstreamDisconnected, OSError) as exc:
        raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
    try:
        payload = json.loads(raw)
        if not isinstance(payload, dict) or "error" not in payload:
            raise ValueError
    except ValueError:
        payload = {"error": {"message": f"upstream pool {pool.name!r} answered {upstream.status}: "
                                        f"{raw[:500].decode(errors='replace')}",
                             "type": "server_error", "param": None, "code": "upstream_error"}}
    return web.json_response(payload, status=upstream.status, headers={"x-cliffguard-pool": pool.name})


async def _relay_stream(request: web.Request, pool: Pool, upstream: UpstreamResponse, client_model: str,
                        metrics: GatewayMetrics, received: float, write_timeout: float) -> web.StreamResponse:
    """The upstream's SSE events, each relayed as it arrives with the client's model name put back; a
    client that takes nothing for `write_timeout` seconds is cut off (ClientGone)."""
    response = await start_sse(request, {"x-cliffguard-pool": pool.name})

    async def write(data: bytes) -> None:
        await write_within(request, response.write(data), write_timeout, metrics, pool.name,
                           f"{request.path}: its relayed stream")

    first = True
    buffer = b""
    async for data in upstream.chunks():
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            await write(_relay_event(event, client_model) + b"\n\n")
            if first and event.startswith(b"data: {"):
                metrics.pool_series(pool.name).ttft.observe(time.perf_counter() - received)
                first = False
    if buffer.strip():
        await write(_relay_event(buffer, client_model) + b"\n\n")
    metrics.pool_series(pool.name).e2e.observe(time.perf_counter() - received)
    await response.write_eof()
    return response


def _relay_event(event: bytes, model: str) -> bytes:
    """One SSE event with the client's model name put back into its JSON data."""
    if not event.startswith(b"data: {"):
        return event
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return event
    return b"data: " + json.dumps(_rename(obj, model), ensure_ascii=False).encode()
