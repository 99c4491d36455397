"""HTTP/1.1 keep-alive connections to the upstream pools: the one client the gateway forwards with.

A general client spends most of a forwarded request's CPU on what forwarding never needs (a cookie
jar, redirects, decompression, per-request timers and tasks: about 75 µs a request against 25 µs here,
measured on the bench's chat answer). `UpstreamClient.post` writes the request on an idle kept-alive
connection (or a new one: TLS for `https`) and reads the answer's head; `UpstreamResponse.read` takes
a whole body (at most the bytes the caller allows: `UpstreamTooLarge` past them), `read_start` its first
bytes only, `chunks` relays it piece by piece as it arrives (a stream). Bodies are framed by
`Content-Length`, `Transfer-Encoding: chunked`, or the connection's end; a head or chunk size that breaks
HTTP's rules (a Content-Length or status that is not plain ASCII digits, a chunk size that is not plain
hex digits) is a disconnection. A body framed by the connection's end cannot tell a connection that
dropped from its end: its reader checks it is whole (the relay: a stream's last event). However an
answer ends, its connection slot is given back. A connection is kept for the next request only after an
HTTP/1.1 answer without `Connection: close` or an HTTP/1.0 one with `Connection: keep-alive`.

What failed decides what the caller may do: `UpstreamUnreachable` when no connection could be made
(nothing was sent: safe to send again), `UpstreamDisconnected` when the connection failed once the
request may have gone out (never sent again). A connection idle for `keepalive_seconds` is closed
rather than reused, below the 5 s after which common servers (uvicorn, so vLLM) close idle ones: a
request is never written on a connection the server is closing. The server's silence for
`read_timeout` seconds, waiting for the head or any piece of the body, is a disconnection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from yarl import URL

MAX_HEAD_BYTES = 64 << 10        # an answer's status line and headers
PAUSE_BYTES = 1 << 20            # unread bytes past which the socket is not read (a slow relay)


class UpstreamError(Exception):
    """A forwarded request that failed; the subclass says whether it may have reached the upstream."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be made: nothing was sent."""


class UpstreamDisconnected(UpstreamError):
    """The connection failed after the request may have gone out (or the answer was not HTTP)."""


class UpstreamTooLarge(UpstreamError):
    """An answer larger than its reader takes (`UpstreamResponse.read`'s `max_bytes`): its connection is closed."""


class _Connection(asyncio.Protocol):
    """One socket's bytes as they arrive; the reader waits on `wait()` for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self.received_at = 0.0   # when the last bytes arrived: the upstream's idle clock runs from its last send
        self.paused_once = False   # its reading was paused: when the upstream sent its last bytes is not known
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received_at = time.monotonic()
        if len(self.buffer) > PAUSE_BYTES and not self._paused:
            self._paused = self.paused_once = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until more bytes (or the end) arrive; UpstreamDisconnected after `timeout` s of silence."""
        if self.eof:
            raise UpstreamDisconnected(f"the connection closed ({self.error or 'end of stream'})")
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _time_out, waiter, timeout)   # lighter than asyncio.timeout
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def take(self, n: int) -> bytes:
        """The first `n` buffered bytes, removed; reading resumes once the buffer is drained."""
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self._paused and len(self.buffer) < PAUSE_BYTES // 2:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()


def _time_out(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamDisconnected(f"no data for {timeout:g} s (gateway.upstream.read_timeout_seconds)"))


class UpstreamResponse:
    """An answer whose head was read: `status`, `headers` (lower-case names), then its body once."""

    def __init__(self, client: UpstreamClient, key: tuple[str, str, int], conn: _Connection, status: int,
                 headers: dict[str, str], read_timeout: float, version: str = "HTTP/1.1") -> None:
        self.status, self.headers = status, headers
        self._client, self._key, self._conn, self._timeout = client, key, conn, read_timeout
        self._done = False
        self.background = False   # a batch line's: it holds one of its host's background slots too (`post`)
        self._reusable = _keeps_alive(version, headers)
        if status in (204, 304) or 100 <= status < 200:
            self._left: int | None = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._left = None
        elif "content-length" in headers:
            self._left = _content_length(headers["content-length"])
        else:                                   # delimited by the connection's end
            self._left, self._reusable = -1, False
        self._chunked = self._left is None

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; UpstreamTooLarge (the connection closed) once it is over `max_bytes`."""
        conn, left = self._conn, self._left
        if max_bytes is not None and left is not None and left > max_bytes:   # said so in its head: nothing read
            self.close()
            raise UpstreamTooLarge(f"an answer of {left} bytes, over {max_bytes} bytes")
        if conn is not None and left is not None and 0 < left <= len(conn.buffer):   # all here: the common case
            body = conn.take(left)
            self._left, self._done = 0, True
            self.close()
            return body
        pieces, num_bytes = [], 0
        async with contextlib.aclosing(self.chunks()) as body:
            async for piece in body:
                num_bytes += len(piece)
                if max_bytes is not None and num_bytes > max_bytes:
                    raise UpstreamTooLarge(f"an answer over {max_bytes} bytes")
                pieces.append(piece)
        return b"".join(pieces)

    async def read_start(self, num_bytes: int) -> bytes:
        """The body's first `num_bytes` (all of a shorter one); the rest is not read, its connection closed."""
        pieces, size = [], 0
        async with contextlib.aclosing(self.chunks()) as body:
            async for piece in body:
                pieces.append(piece)
                size += len(piece)
                if size > num_bytes:
                    break   # more than asked: the rest is left, the connection closed
        return b"".join(pieces)[:num_bytes]

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed)."""
        conn = self._conn
        try:
            if self._chunked:
                async for piece in self._chunked_body():
                    yield piece
            elif self._left == -1:
                while not (conn.eof and not conn.buffer):
                    if not conn.buffer:
                        await _wait_or_end(conn, self._timeout)
                        continue
                    yield conn.take(len(conn.buffer))
            else:
                while self._left:
                    if not conn.buffer:
                        await conn.wait(self._timeout)
                    piece = conn.take(min(self._left, len(conn.buffer)))
                    self._left -= len(piece)
                    yield piece
            self._done = True
        finally:
            self.close()

    async def _chunked_body(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            line = await _line(conn, self._timeout)
            digits = line.split(b";", 1)[0].strip()
            if not digits or digits.strip(_HEX_DIGITS):   # int() also takes "-5", "+5", "0x5", "5_0"
                raise UpstreamDisconnected(f"invalid chunk size {line[:40]!r}")
            size = int(digits, 16)
            if size == 0:
                while await _line(conn, self._timeout):   # trailers, then the empty line
                    pass
                return
            while size:
                if not conn.buffer:
                    await conn.wait(self._timeout)
                piece = conn.take(min(size, len(conn.buffer)))
                size -= len(piece)
                yield piece
            if await _line(conn, self._timeout):
                raise UpstreamDisconnected("a chunk did not end with CRLF")

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read whole."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        self._client._release(self._key, conn, self._done and self._reusable and not conn.buffer, self.background)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


_HEX_DIGITS = b"0123456789abcdefABCDEF"


class UpstreamClient:
    """Kept-alive connections per upstream host, at most `max_connections` in use at once to each (one
    slow upstream's streams never hold up another's); a request that finds its host's all in use waits
    for one at most `connect_timeout`, then is UpstreamUnreachable (nothing was sent). A `background`
    request (a batch line) first waits, however long, for one of the host's `max_connections // 2`
    background slots (at least 1): batch lines never hold more than half the connections, the rest stay
    for the requests a client waits on."""

    def __init__(self, *, connect_timeout: float = 10.0, read_timeout: float = 600.0,
                 max_connections: int = 256, keepalive_seconds: float = 4.0) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.keepalive_seconds = keepalive_seconds
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.max_connections = max_connections
        self._slots: dict[tuple[str, str, int], asyncio.Semaphore] = {}   # per host
        self._background: dict[tuple[str, str, int], asyncio.Semaphore] = {}   # per host: its batch lines' share
        self.num_in_use = 0   # connection slots taken: requests being sent and answers not yet closed
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def post(self, url: URL, body: bytes, headers: dict[str, str],
                   on_send: Callable[[], Awaitable[None]] | None = None, background: bool = False) -> UpstreamResponse:
        """Send `body` to `url` and read the answer's head; close the response (or use it in `async with`).
        `on_send` is awaited once a connection is made, just before the request's bytes go out; `background`:
        a batch line's (the class docstring)."""
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        request = _request_bytes(url, body, headers)
        key = (url.scheme, url.host or "", url.explicit_port or (443 if url.scheme == "https" else 80))
        slots = self._slots.setdefault(key, asyncio.Semaphore(self.max_connections))
        if background:
            await self._background.setdefault(key, asyncio.Semaphore(max(1, self.max_connections // 2))).acquire()
        try:
            async with asyncio.timeout(self.connect_timeout):
                await slots.acquire()
        except BaseException as exc:
            if background:
                self._background[key].release()
            if isinstance(exc, TimeoutError):
                raise UpstreamUnreachable(f"all {self.max_connections} connections to {url.host}:{key[2]} (gateway."
                                          f"upstream.max_connections) stayed in use for {self.connect_timeout:g} s"
                                          ) from None
            raise
        self.num_in_use += 1
        try:
            conn = self._idle_connection(key) or await self._connect(key)
            try:
                if on_send is not None:
                    await on_send()   # seconds, where the store is retried: a kept connection may close meanwhile
                    # (a server's idle limit, uvicorn's 5 s), or be about to: another one, as nothing was sent yet
                    if not conn.usable or 0 < conn.idle_since <= time.monotonic() - self.keepalive_seconds:
                        conn.transport.abort()
                        conn = self._idle_connection(key) or await self._connect(key)
                conn.transport.write(request)
                version, status, head = await _read_head(conn, self.read_timeout)
                response = UpstreamResponse(self, key, conn, status, head, self.read_timeout, version)   # may refuse
                response.background = background
                return response
            except BaseException:
                conn.transport.abort()
                raise
        except BaseException:
            self._release_slot(key, background)
            raise

    def _idle_connection(self, key: tuple[str, str, int]) -> _Connection | None:
        """The newest connection to `key` idle for less than `keepalive_seconds`, or None; the older ones idle
        longer are closed on the way (after a burst, the newest alone is reused: the rest stayed open)."""
        idle, now = self._idle.get(key), time.monotonic()
        while idle and not (idle[0].usable and now - idle[0].idle_since < self.keepalive_seconds):
            idle.pop(0).transport.close()   # the oldest first: at most max_connections of them
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self.keepalive_seconds:
                return conn
            conn.transport.close()
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        tls = None
        if scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, host, port, ssl=tls,
                                                       server_hostname=host if tls else None)
        except TimeoutError:
            raise UpstreamUnreachable(f"cannot connect to {host}:{port}: no answer in {self.connect_timeout:g} s") \
                from None
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    def _release(self, key: tuple[str, str, int], conn: _Connection, reusable: bool, background: bool) -> None:
        self._release_slot(key, background)
        # Idle since its last bytes came, not since the relay read them (a slow client's stream is read late: the
        # upstream's keep-alive clock, uvicorn's 5 s, ran meanwhile); one whose reading paused, since who knows when.
        if reusable and conn.usable and not conn.paused_once and not self._closed:
            conn.idle_since = conn.received_at or time.monotonic()
            self._idle.setdefault(key, []).append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _release_slot(self, key: tuple[str, str, int], background: bool) -> None:
        self.num_in_use -= 1
        self._slots[key].release()
        if background:
            self._background[key].release()

    async def close(self) -> None:
        """Close every idle connection; those in use close as their responses end."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()


def _request_bytes(url: URL, body: bytes, headers: dict[str, str]) -> bytes:
    """The request's bytes; a header value with a line break is a ValueError (no header injection). The URL's
    `user:password@` goes as HTTP Basic credentials (RFC 7617, UTF-8), as curl and aiohttp send them, unless
    `headers` has its own Authorization (the pool's `upstream_api_key_env`)."""
    host = url.host_port_subcomponent or ""   # an IPv6 address in brackets, a name in its ASCII (IDNA) form
    lines = [f"POST {url.raw_path_qs or '/'} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    if url.user is not None and not any(name.lower() == "authorization" for name in headers):
        basic = base64.b64encode(f"{url.user}:{url.password or ''}".encode()).decode()
        lines.append(f"Authorization: Basic {basic}")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r}: a line break in a header")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_head(conn: _Connection, timeout: float) -> tuple[str, int, dict[str, str]]:
    """The HTTP version (`HTTP/1.1`), status and headers of the answer (the bytes after them stay buffered)."""
    while (end := conn.buffer.find(b"\r\n\r\n")) < 0:
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise UpstreamDisconnected(f"an answer's head over {MAX_HEAD_BYTES} bytes")
        await conn.wait(timeout)
    lines = conn.take(end + 4)[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isascii() and parts[1].isdigit()):
        raise UpstreamDisconnected(f"not an HTTP answer: {lines[0][:80]!r}")
    if 100 <= int(parts[1]) < 200 and int(parts[1]) != 101:   # an interim answer (100, 103): the real one follows
        return await _read_head(conn, timeout)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return parts[0], int(parts[1]), headers


def _keeps_alive(version: str, headers: dict[str, str]) -> bool:
    """Whether the connection stays open after this answer (RFC 9112 section 9.3): never with a `close`
    connection option; otherwise an HTTP/1.1 answer's does, an HTTP/1.0 one's only with `keep-alive`
    (an HTTP/1.0 server closes it after each answer: a request written on it would be lost)."""
    options = {option.strip().lower() for option in headers.get("connection", "").split(",")}
    return "close" not in options and (version != "HTTP/1.0" or "keep-alive" in options)


async def _line(conn: _Connection, timeout: float) -> bytes:
    """One CRLF-ended line of a chunked body, without its CRLF."""
    while (end := conn.buffer.find(b"\r\n")) < 0:
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise UpstreamDisconnected("a chunked body's line is too long")
        await conn.wait(timeout)
    return conn.take(end + 2)[:-2]


async def _wait_or_end(conn: _Connection, timeout: float) -> None:
    """More bytes of a body that ends with the connection; returns at the end too."""
    if not conn.eof:
        try:
            await conn.wait(timeout)
        except UpstreamDisconnected:
            if not conn.eof or conn.error is not None:
                raise


def _content_length(value: str) -> int:
    value = value.strip()
    if not (value.isascii() and value.isdigit()):   # int() also takes "1_0" and other scripts' digits
        raise UpstreamDisconnected(f"invalid Content-Length {value[:40]!r}")
    return int(value)
