"""The aiohttp application: OpenAI-compatible endpoints in front of the pools.

`create_app` builds the app from a `gateway.runtime.Gateway` (everything planned and loaded that can fail before a
socket opens): the routes (`gateway.handlers`, `gateway.tokenize_endpoints`, `gateway.openai.response_endpoints`;
with a data dir the Batch API, `gateway.batch.endpoints`, and kept responses), the error, browser and auth
middlewares, the `cleanup_ctx` that owns the device workers and the `UpstreamClient`. Workers load in the
background: `/health` answers at once, `/ready` once every device is loaded; requests that arrive earlier wait.

Every error is answered in the OpenAI format `{"error": {message, type, param, code}}`: the
middleware does it for the handlers, `GatewayRunner` for aiohttp's own HTTP parser errors (a bad
request line, a header over 8 KiB), which never reach a handler.

Every response a handler returns unsent (JSON answers and errors, file contents, relayed upstream
bodies) is written by the outermost middleware within `gateway.write_timeout`: a client that takes
nothing for that long has its connection aborted (a WARNING, `cliffguard_client_write_timeouts_total`).
Streams write themselves under the same limit (`gateway.local_answer`).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gateway import handlers, tokenize_endpoints
from gateway.batch import endpoints as batches
from gateway.monitoring import dashboard
from gateway.openai import response_endpoints
from gateway.admission import bearer_key
from gateway.browser_guard import browser_guard
from gateway.openai.errors import ApiError
from gateway.client_writes import (BODY_SNDBUF_BYTES, RESPONSE_BUFFERS, ResponseBuffers, limit_send_buffer,
                                   write_within)
from gateway.runtime import GATEWAY, Gateway
from gateway.signals import serve_until_stopped
from gateway.upstream.connection import UpstreamClient
from pools.config.spec import CliffguardConfig

log = logging.getLogger("cliffguard.gateway")

__all__ = ["GatewayRunner", "create_app", "run", "start_server"]


def create_app(gateway: Gateway, *, data_dir: Path | str | None = None,
               batch_executor: batches.LineExecutor | None = None) -> web.Application:
    """The app over `gateway`. With `data_dir`, the Batch API too (`gateway.batch.endpoints`: its state in
    `data_dir`, its runner started after the gateway and stopped before it) and kept responses
    (`gateway.openai.stored_responses`); without one (in-process tests), no batch routes and no response is
    kept: there is nowhere durable to keep them. `batch_executor` replaces the line executor (tests)."""
    spec = gateway.config.gateway
    app = web.Application(client_max_size=spec.max_body_bytes,
                          middlewares=[_write_middleware, _error_middleware, browser_guard, _auth_middleware])
    app[GATEWAY] = gateway
    app[RESPONSE_BUFFERS] = ResponseBuffers(spec.max_response_buffer_bytes, spec.max_buffered_bytes,
                                            gateway.metrics.buffered_response_bytes)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(lambda app: app[GATEWAY].begin_drain())   # no replica started or drained meanwhile
    if data_dir is not None:
        batches.setup(app, data_dir, batch_executor)
    response_endpoints.setup(app, data_dir)   # after the batch store: its file holds the responses' table
    tokenize_endpoints.setup(app)   # /tokenize, /detokenize
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.retrieve_model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/metrics", handlers.metrics)
    app[dashboard.DASHBOARD] = dashboard.DashboardHistory()
    app.router.add_get("/dashboard", dashboard.page)
    app.router.add_get("/dashboard/data", dashboard.data)
    for route in app.router.routes():   # those added above and by the batch and responses modules
        route._expect_handler = _expectation(route._expect_handler)
    return app


def _expectation(default: Callable[[web.Request], Awaitable[Any]]) -> Callable[[web.Request], Awaitable[Any]]:
    """A route's answer to an `Expect` header: `100-continue` as aiohttp's (`default`: the interim 100, then
    the body), any other a 417 in the OpenAI error format naming the header. aiohttp answers an expectation
    before any middleware runs, its refusal in plain text; a route takes its handler only when it is made."""
    async def expect(request: web.Request) -> Any:
        value = request.headers.get("Expect", "")
        if value.lower() == "100-continue":
            return await default(request)
        request.app[GATEWAY].metrics.errors.labels(status="417").inc()
        return _error_json(ApiError(417, f"Expect: {value[:80]!r} is not an expectation this server meets (only "
                                         "100-continue)", param="Expect", headers={"Connection": "close"}))
    return expect


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The device workers (started in the background) and the upstream client (`gateway.upstream`'s limits),
    for the app's life."""
    gateway = app[GATEWAY]
    limits = gateway.config.gateway.upstream
    gateway.upstream = UpstreamClient(read_timeout=limits.read_timeout_seconds, max_connections=limits.max_connections)
    await gateway.start()
    # What is alive now (modules, the config, tokenizers, the model's tables) lives as long as the
    # gateway: out of the collector's sight, a full collection walks only what requests make (a full
    # walk of everything took ~100 ms, a pause of every request in flight).
    gc.freeze()
    yield
    await gateway.upstream.close()
    await gateway.stop()


@web.middleware
async def _write_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Write the handler's response here, within `write_timeout`, unless it is already under way (a
    stream) or its client is gone; aiohttp then finds it written. A client that takes nothing for that
    long has its connection aborted. A body over `BODY_SNDBUF_BYTES` goes through a send buffer of that
    size, so the limit starts counting once that much is unread (not megabytes later)."""
    response = await handler(request)
    if response.prepared or request.transport is None or request.transport.is_closing():
        return response
    gateway = request.app[GATEWAY]
    body = response.body if isinstance(response, web.Response) else None
    size = len(body) if isinstance(body, (bytes, bytearray)) else 0
    if size > BODY_SNDBUF_BYTES:
        limit_send_buffer(request, BODY_SNDBUF_BYTES)
    buffers = request.app[RESPONSE_BUFFERS]
    buffers.count(size)
    pool = response.headers.get("x-cliffguard-pool", "none").split(",")[0]
    try:
        await write_within(request, _send(request, response), gateway.config.gateway.write_timeout, gateway.metrics,
                           pool, f"{request.method} {request.path}: its {size}-byte answer")
    except ConnectionError:
        pass   # ClientGone: aborted and said; or the client went away meanwhile (aiohttp notes it)
    finally:
        buffers.count(-size)
    return response


async def _send(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


def _error_json(err: ApiError) -> web.Response:
    response = web.json_response(err.body(), status=err.status, headers=err.headers)
    if (err.headers or {}).get("Connection") == "close":   # the rest of the body is not read: close at once
        response.force_close()
    return response


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Errors as OpenAI error bodies; one raised after a response began (a stream) cannot be one: aiohttp
    then closes the connection, which the client reads as the stream cut short (never a second head)."""
    metrics = request.app[GATEWAY].metrics
    try:
        return await handler(request)
    except ApiError as err:
        metrics.errors.labels(status=str(err.status)).inc()
        if request.writer is not None and request.writer.output_size:
            raise ConnectionResetError(f"{err.status} after the response began: {err.message}") from None
        return _error_json(err)
    except web.RequestPayloadError as exc:   # a body cut short, or its Content-Encoding not what it holds
        metrics.errors.labels(status="400").inc()
        return _error_json(ApiError(400, f"body: cannot be read ({' '.join(str(exc).split())})", param="body",
                                    headers={"Connection": "close"}))
    except web.HTTPRequestEntityTooLarge as exc:
        metrics.errors.labels(status="413").inc()
        return _error_json(ApiError(413, f"body: request body is too large ({exc.text.strip()})",
                                    param="body", code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        metrics.errors.labels(status=str(exc.status)).inc()
        return _error_json(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                    type="invalid_request_error" if exc.status < 500 else "server_error",
                                    headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
        log.exception("unhandled error on %s %s", request.method, request.path)
        metrics.errors.labels(status="500").inc()
        if request.writer is not None and request.writer.output_size:
            raise ConnectionResetError("500 after the response began") from None
        return _error_json(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


# The dashboard's page holds no data; its data (/dashboard/data) needs the key like the API (gateway.dashboard).
# /metrics names pools and tenants: open unless `gateway.metrics_auth` asks for a key there too.
_OPEN_PATHS = {"/health", "/ready", "/metrics", "/dashboard"}


@web.middleware
async def _auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    spec = request.app[GATEWAY].config.gateway
    keys = spec.api_keys
    open_path = request.path in _OPEN_PATHS and not (spec.metrics_auth and request.path == "/metrics")
    if keys and not open_path:
        if not request.headers.get("Authorization"):
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        token = bearer_key(request)
        if token is None or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise ApiError(401, "invalid API key", code="invalid_api_key")
    return await handler(request)


# --- serving ---------------------------------------------------------------------------------------
class _JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection protocol, answering its own errors (parser errors, handler timeouts) in the OpenAI
    format, not text/plain, and closing the connection; a parser's refusal is logged by status and kind only
    (its message quotes the bytes it refused: a header's value, an API key one stray byte from valid)."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):   # not HTTP at all (TLS to this port: a scanner) is no news
            (log.debug if isinstance(exc, BadHttpMethod) else log.warning)(
                "HTTP request from %s refused by the parser: %d (%s)", request.remote, status, type(exc).__name__)
            if request.writer.output_size > 0:   # as aiohttp: a response under way cannot carry another
                raise ConnectionError("Response is sent already, cannot send another response with the error")
        else:
            super().handle_error(request, status, exc, message)  # logs; raises if a response was under way
        phrase = {s.value: s.phrase for s in HTTPStatus}.get(status, "Error")
        detail = getattr(exc, "message", None) if status < 500 else None
        err = ApiError(status, f"request: {phrase}" + (f": {str(detail).strip()}" if detail else ""),
                       type="invalid_request_error" if status < 500 else "server_error")
        response = _error_json(err)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    """A `web.Server` whose connections are `_JsonErrorRequestHandler`s."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _JsonErrorRequestHandler   # same slots: only handle_error differs
        return handler


class GatewayRunner(web.AppRunner):
    """An `AppRunner` whose server answers aiohttp's own HTTP errors in the OpenAI error format: aiohttp has no
    setting for the protocol class, so the server the app builds (with the app's `handler_args` and the runner's
    options) gets `_JsonErrorServer`'s class; `tests/gateway/test_edges.py` checks it on a real socket."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()   # starts the app (its cleanup_ctx) and freezes it
        server.__class__ = _JsonErrorServer
        return server


MIN_KEEPALIVE_S = 5.0   # an idle keep-alive connection is closed after max(this, gateway.write_timeout)


async def start_server(app: web.Application, host: str, port: int, drain_seconds: float = 60.0) -> GatewayRunner:
    """Serve `app` on host:port (0: a free port, see `runner.addresses`); `runner.cleanup()` stops it, giving
    the requests in flight `drain_seconds` to finish. A connection idle between requests is closed after
    `gateway.write_timeout` (at least `MIN_KEEPALIVE_S`; aiohttp's default is 75 s): a client that never reads
    its small answer (the kernel's buffers took it whole) holds the socket no longer than one reading nothing."""
    keepalive = max(MIN_KEEPALIVE_S, app[GATEWAY].config.gateway.write_timeout) if GATEWAY in app else 75.0
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=keepalive,
                           shutdown_timeout=drain_seconds)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def run(config: CliffguardConfig, *, host: str | None = None, port: int | None = None,
        vram_bytes: int | None = None, data_dir: Path | str | None = None) -> int:
    """`cliffguard serve`: validate and plan everything, then serve until SIGTERM or Ctrl-C
    (`gateway.signals`); the exit status. The Batch API keeps its state in `data_dir` (an existing folder)."""
    gateway = Gateway.from_config(config, vram_bytes=vram_bytes)
    for warning in gateway.plan.warnings:   # what `cliffguard capacity` prints under its plan
        log.warning("capacity plan: %s", warning)
    host = host or config.gateway.host
    port = config.gateway.port if port is None else port
    app = create_app(gateway, data_dir=data_dir)

    async def main() -> int:
        drain = config.gateway.drain_seconds
        runner = await start_server(app, host, port, drain_seconds=drain)
        log.info("serving on http://%s:%s (pools: %s)", host, runner.addresses[0][1], ", ".join(gateway.pools))
        for line in config.describe_service_classes():   # interactive or throughput, and why
            log.info("%s", line)
        return await serve_until_stopped(runner, drain, gateway.cut_in_flight)

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:   # Ctrl-C before the server listened
        return 130
