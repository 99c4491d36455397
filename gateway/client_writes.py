"""Writing to clients, bounded in time and in bytes.

Every write the gateway makes to a client — a JSON body (`gateway.app`'s write middleware), a stream's
SSE chunks (`gateway.local_answer`), a relayed upstream stream (`gateway.upstream.relay`), a file's content
(`gateway.batch.endpoints`) — goes through `write_within`: a client that takes nothing for
`gateway.write_timeout` seconds has its connection aborted, a WARNING logged,
`cliffguard_client_write_timeouts_total{pool}` counted, and the writer gets `ClientGone`.

What the gateway holds unsent is bounded (`ResponseBuffers`): a stream whose queued chunks exceed
`gateway.max_response_buffer_bytes`, or that adds one while all responses' unsent bytes exceed
`gateway.max_buffered_bytes`, is paused (its engine requests are not stepped) until both are under
half (`gateway.local_answer` says what a pause keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from aiohttp import web
from prometheus_client import Gauge

from gateway.monitoring.metrics import GatewayMetrics

log = logging.getLogger("cliffguard.gateway")
T = TypeVar("T")


def escaped_json(obj: object) -> bytes:
    """`obj` as JSON in UTF-8 for a client, as a stream's event carries it; a lone surrogate (`"\ud83d"`: half an
    emoji, only ever inside a JSON string) escaped as JSON writes it, not an encoding error."""
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")


class ClientGone(ConnectionResetError):
    """The client went away or read nothing for `write_timeout`: its connection is closed and there is
    nothing left to answer (the handler returns quietly; the engine requests were aborted)."""


async def write_within(request: web.Request | None, write: Awaitable[T], timeout: float, metrics: GatewayMetrics,
                       pool: str, what: str) -> T:
    """Await `write` (one write to the client) for at most `timeout` seconds (`gateway.write_timeout`) and
    return its result; past it the connection is aborted, a WARNING says `what` was being written, the
    pool's `cliffguard_client_write_timeouts_total` is counted, and ClientGone is raised."""
    try:
        async with asyncio.timeout(timeout):   # a timer, no task: this runs for every write
            return await write
    except TimeoutError:
        log.warning("%s (pool %s): the client read nothing for %g s (gateway.write_timeout); closing the "
                    "connection", what, pool, timeout)
        metrics.client_write_timeouts.labels(pool=pool).inc()
        if request is not None and request.transport is not None:
            request.transport.abort()
        raise ClientGone(f"the client read nothing for {timeout:g} s (gateway.write_timeout)") from None


class Pausable(Protocol):
    def set_paused(self, paused: bool) -> None: ...


# Socket send buffers. Loopback autotuning grows them to megabytes, which a client that never reads fills
# before any write blocks: with these, `write_timeout` starts counting once about that much is unread.
STREAM_SNDBUF_BYTES = 256 << 10   # a stream
BODY_SNDBUF_BYTES = 64 << 10      # a whole body larger than this (a JSON answer with logprobs: gateway.app)


class ResponseBuffers:
    """The bytes the gateway holds unsent for its clients, per stream and in total, and their bound (the
    module docstring): pauses and resumes streams (`gateway.local_answer.LocalResponse.set_paused`). One per app
    (`RESPONSE_BUFFERS`, from `gateway.max_response_buffer_bytes` and `max_buffered_bytes`); event loop only."""

    def __init__(self, max_response_bytes: int, max_total_bytes: int, gauge: Gauge | None = None) -> None:
        self.max_response_bytes, self.max_total_bytes = max_response_bytes, max_total_bytes
        self.num_bytes = 0                              # unsent, all responses together
        self._gauge = gauge                             # cliffguard_buffered_response_bytes
        self._unsent: dict[Pausable, int] = {}     # each stream's unsent bytes
        self._paused: set[Pausable] = set()

    def add(self, response: Pausable, num_bytes: int) -> None:
        """`response` queued `num_bytes` more; it pauses if that takes it, or the total, over the bound."""
        self._unsent[response] = self._unsent.get(response, 0) + num_bytes
        self.count(num_bytes)
        if response not in self._paused and (self._unsent[response] > self.max_response_bytes
                                             or self.num_bytes > self.max_total_bytes):
            self._paused.add(response)
            response.set_paused(True)

    def sent(self, response: Pausable, num_bytes: int) -> None:
        """`num_bytes` of `response` were written; paused streams that are under both halves resume."""
        left = self._unsent.pop(response, 0) - num_bytes
        if left > 0:
            self._unsent[response] = left
        self.count(-num_bytes)

    def forget(self, response: Pausable) -> None:
        """The stream ended (written, or its client gone): nothing of it is held any more."""
        self._paused.discard(response)
        self.sent(response, self._unsent.get(response, 0))

    def count(self, num_bytes: int) -> None:
        """More (+) or fewer (-) unsent bytes in the total; also a whole body being written (nothing to pause)."""
        self.num_bytes += num_bytes
        if self._gauge is not None:
            self._gauge.set(self.num_bytes)
        if num_bytes < 0:
            self._resume()

    def _resume(self) -> None:
        if not self._paused or self.num_bytes >= self.max_total_bytes / 2:
            return
        for response in [r for r in self._paused if self._unsent.get(r, 0) < self.max_response_bytes / 2]:
            self._paused.discard(response)
            response.set_paused(False)


RESPONSE_BUFFERS = web.AppKey("response_buffers", ResponseBuffers)


async def start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """A prepared `text/event-stream` response with `headers` (the pools and replicas that answer)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
    limit_send_buffer(request)
    await response.prepare(request)
    return response


def limit_send_buffer(request: web.Request, num_bytes: int = STREAM_SNDBUF_BYTES) -> None:
    """Give the request's socket a send buffer of `num_bytes` (see `STREAM_SNDBUF_BYTES`)."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)
