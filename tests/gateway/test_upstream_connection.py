"""`gateway.upstream.connection`: the gateway's HTTP/1.1 client for upstream pools, against raw servers
that frame answers each way HTTP allows, drop connections and go silent."""

from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import subprocess
import time

import pytest
from yarl import URL

from gateway.upstream.connection import (UpstreamClient, UpstreamDisconnected, UpstreamUnreachable,
                                         _request_bytes)


async def _raw_server(answer, tls: ssl.SSLContext | None = None):
    """A server on 127.0.0.1 that reads each request on a connection and calls `answer(writer, request,
    number)`; returns (server, url, the requests it read, connections accepted)."""
    seen: list[bytes] = []
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                request = head + await reader.readexactly(length)
                seen.append(request)
                if await answer(writer, request, len(seen)) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    scheme = "https" if tls else "http"
    return server, URL(f"{scheme}://127.0.0.1:{port}/v1/chat/completions"), seen, connections


def _answer(body: bytes, *headers: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + "".join(h + "\r\n" for h in headers).encode() + b"\r\n" + body


async def test_each_framing_reads_whole_and_a_kept_connection_is_reused():
    async def answer(writer, request, n):
        if n == 1:
            writer.write(_answer(b'{"a": 1}', "Content-Length: 8"))
        elif n == 2:
            writer.write(_answer(b"3\r\n{\"a\r\n6\r\n\": 22}\r\n0\r\nX-Trailer: t\r\n\r\n", "Transfer-Encoding: chunked"))
        else:
            writer.write(_answer(b'{"end": true}', "Connection: close"))
            await writer.drain()
            return "close"
        await writer.drain()

    server, url, seen, connections = await _raw_server(answer)
    client = UpstreamClient()
    bodies = []
    for _ in range(3):
        async with await client.post(url, b'{"q": 1}', {"Content-Type": "application/json"}) as r:
            assert r.status == 200
            bodies.append(await r.read())
    assert bodies == [b'{"a": 1}', b'{"a": 22}', b'{"end": true}']
    assert connections[0] == 1, "three answers on one kept-alive connection"
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 8\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"q": 1}')
    async with await client.post(url, b"{}", {}) as r:   # the last answer closed its connection: a new one
        await r.read()
    assert connections[0] == 2
    await client.close()
    server.close()


@pytest.mark.parametrize("status_line, connection, kept", [
    (b"HTTP/1.0 200 OK", b"", False), (b"HTTP/1.0 200 OK", b"Connection: Keep-Alive\r\n", True),
    (b"HTTP/1.1 200 OK", b"", True), (b"HTTP/1.1 200 OK", b"Connection: keep-alive, close\r\n", False)],
    ids=["http1.0", "http1.0_keep_alive", "http1.1", "close_among_options"])
async def test_a_connection_is_kept_only_when_its_answer_keeps_it_alive(status_line, connection, kept):
    """RFC 9112 section 9.3: an HTTP/1.0 server (Python's http.server by default) closes the connection
    after its answer unless it says `keep-alive`; a request written on it would be lost. A `close` option
    closes it whatever the version."""
    async def answer(writer, request, n):   # answers, leaves the connection open: only the client decides
        writer.write(status_line + b"\r\nContent-Length: 2\r\n" + connection + b"\r\n{}")
        await writer.drain()

    server, url, _, connections = await _raw_server(answer)
    client = UpstreamClient()
    for _ in range(3):
        async with await client.post(url, b"{}", {}) as r:
            assert await r.read() == b"{}"
    assert connections[0] == (1 if kept else 3)
    await client.close()
    server.close()


async def test_a_stream_arrives_piece_by_piece():
    release = asyncio.Event()

    async def answer(writer, request, n):
        writer.write(_answer(b"7\r\ndata: 1\r\n", "Transfer-Encoding: chunked"))
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()

    server, url, _, _ = await _raw_server(answer)
    client = UpstreamClient()
    async with await client.post(url, b"{}", {}) as r:
        pieces = r.chunks()
        assert await pieces.__anext__() == b"data: 1"   # before the rest was even written
        release.set()
        assert [p async for p in pieces] == [b"data: 2"]
    await client.close()
    server.close()


async def test_no_listener_is_unreachable_and_a_drop_after_sending_is_a_disconnection():
    server, url, _, _ = await _raw_server(None)
    port = url.port
    server.close()
    await server.wait_closed()
    client = UpstreamClient(connect_timeout=2)
    with pytest.raises(UpstreamUnreachable, match=f"127.0.0.1:{port}"):
        await client.post(url, b"{}", {})

    async def half(writer, request, n):   # the head and part of the body, then the connection drops
        writer.write(_answer(b'{"id": ', "Content-Length: 100"))
        await writer.drain()
        writer.transport.abort()
        return "close"

    server, url, seen, _ = await _raw_server(half)
    async with await client.post(url, b"{}", {}) as r:
        with pytest.raises(UpstreamDisconnected):
            await r.read()

    async def nothing(writer, request, n):   # read the request, answer nothing, close
        return "close"

    server2, url2, _, _ = await _raw_server(nothing)
    with pytest.raises(UpstreamDisconnected):
        await client.post(url2, b"{}", {})
    await client.close()
    server.close()
    server2.close()


async def test_silence_past_the_read_timeout_is_a_disconnection_and_frees_the_slot():
    async def silent(writer, request, n):
        await asyncio.sleep(5)

    server, url, _, _ = await _raw_server(silent)
    client = UpstreamClient(read_timeout=0.2, max_connections=1)
    for _ in range(2):   # with one slot, the second request proves the first gave its slot back
        with pytest.raises(UpstreamDisconnected, match="no data for 0.2 s"):
            await asyncio.wait_for(client.post(url, b"{}", {}), 3)
    await client.close()
    server.close()


async def test_an_unread_body_closes_its_connection_and_an_idle_one_expires():
    async def answer(writer, request, n):
        writer.write(_answer(b"x" * 10, "Content-Length: 10"))
        await writer.drain()

    server, url, _, connections = await _raw_server(answer)
    client = UpstreamClient(keepalive_seconds=0.1)
    async with await client.post(url, b"{}", {}):
        pass   # body left unread: the connection cannot be reused
    async with await client.post(url, b"{}", {}) as r:
        await r.read()
    assert connections[0] == 2
    await asyncio.sleep(0.2)   # idle past keepalive_seconds: closed, not reused
    async with await client.post(url, b"{}", {}) as r:
        await r.read()
    assert connections[0] == 3
    await client.close()
    server.close()


async def test_kept_connections_idle_past_the_keepalive_are_closed_not_left_behind_the_newest():
    """After a burst, each request takes the newest kept connection: the older ones, idle past the keep-alive,
    are closed then, not left open for as long as traffic keeps the newest in use."""
    async def answer(writer, request, n):
        writer.write(_answer(b"{}", "Content-Length: 2"))
        await writer.drain()

    server, url, _, connections = await _raw_server(answer)
    client = UpstreamClient(keepalive_seconds=1.0)

    async def one() -> None:
        async with await client.post(url, b"{}", {}) as r:
            await r.read()
    await asyncio.gather(one(), one())          # two connections kept: the older, the newer
    assert connections[0] == 2 and sum(map(len, client._idle.values())) == 2
    await asyncio.sleep(0.6)
    await one()                                 # the newer, reused; the older still young
    await asyncio.sleep(0.6)                    # the older idle 1.2 s, the newer 0.6 s
    await one()
    assert connections[0] == 2 and sum(map(len, client._idle.values())) == 1   # the older closed on the way
    await client.close()
    server.close()


async def test_a_connection_is_idle_from_its_answers_last_bytes_not_from_when_the_relay_read_them():
    """The upstream's keep-alive clock (uvicorn's 5 s) starts when it sent its answer's last bytes: a relay that
    read them late (a slow client's stream) must not hand the connection on as fresh, or the upstream's close
    can meet the next request (a 502 for a request it never had). One whose reading paused (a big answer read
    slowly: when its last bytes were sent is unknown) is not kept at all."""
    from gateway.upstream import connection

    async def answer(writer, request, n):
        writer.write(_answer(b"x" * (3 * connection.PAUSE_BYTES if n == 3 else 2), "Content-Length: %d"
                             % (3 * connection.PAUSE_BYTES if n == 3 else 2)))
        await writer.drain()

    server, url, _, connections = await _raw_server(answer)
    client = UpstreamClient(keepalive_seconds=0.4)
    async with await client.post(url, b"{}", {}) as r:
        await asyncio.sleep(0.5)                # its body came at once: read 0.5 s later
        assert await r.read() == b"xx"
    async with await client.post(url, b"{}", {}) as r:
        await r.read()
    assert connections[0] == 2                  # the first was idle 0.5 s when it was released: not reused
    async with await client.post(url, b"{}", {}) as r:   # on the second, kept: reused
        await asyncio.sleep(0.1)                # the socket's reading paused
        assert len(await r.read(4 * connection.PAUSE_BYTES)) == 3 * connection.PAUSE_BYTES
    assert connections[0] == 2 and not client._idle.get(r._key)   # closed, not kept
    await client.close()
    server.close()


async def test_a_kept_connection_that_closed_or_aged_during_a_slow_on_send_is_not_written_to():
    """A batch line's `on_send` (a store write, retried for seconds when SQLite is locked) may outlast the kept
    connection taken before it: one the upstream closed meanwhile (idle past its keep-alive, uvicorn's 5 s), or
    idle past the client's own keep-alive, was written to, and the line ended `upstream_disconnected`, never to
    be sent again, though the upstream never had it. Another connection takes it."""
    async def answer(writer, request, n):
        writer.write(_answer(b"{}", "Content-Length: 2"))
        await writer.drain()
        asyncio.get_running_loop().call_later(0.2, writer.transport.close)   # its idle connections live 0.2 s

    server, url, seen, connections = await _raw_server(answer)
    client = UpstreamClient()
    async with await client.post(url, b"{}", {}) as r:
        await r.read()
    async with await client.post(url, b"{}", {}, on_send=lambda: asyncio.sleep(0.5)) as r:
        assert r.status == 200 and await r.read() == b"{}"
    assert len(seen) == 2 and connections[0] == 2
    await client.close()
    server.close()

    async def keeps_open(writer, request, n):   # its close would come once the client's keep-alive is past
        writer.write(_answer(b"{}", "Content-Length: 2"))
        await writer.drain()

    server, url, seen, connections = await _raw_server(keeps_open)
    client = UpstreamClient(keepalive_seconds=0.6)
    async with await client.post(url, b"{}", {}) as r:
        await r.read()
    async with await client.post(url, b"{}", {}, on_send=lambda: asyncio.sleep(0.9)) as r:
        assert await r.read() == b"{}"
    assert connections[0] == 2   # idle past keepalive_seconds by then: not written to
    await client.close()
    server.close()


def test_a_line_break_in_a_header_is_refused():
    with pytest.raises(ValueError, match="Idempotency-Key"):
        _request_bytes(URL("http://127.0.0.1:8000/v1"), b"{}", {"Idempotency-Key": "b:1\r\nX-Evil: 1"})
    assert _request_bytes(URL("https://example.com/v1/x?a=1"), b"", {}).startswith(
        b"POST /v1/x?a=1 HTTP/1.1\r\nHost: example.com\r\n")


def test_a_urls_user_and_password_go_as_basic_credentials_unless_a_key_is_sent():
    """`http://user:pass@host/v1` (percent-encoded, as URLs write them) authenticates with HTTP Basic, as curl
    does; the pool's own key (an Authorization header) takes its place; the Host never shows them."""
    url = URL("http://ad%40min:p%C3%A4ss:w@127.0.0.1:8000/v1")
    sent = _request_bytes(url, b"", {})
    assert b"\r\nHost: 127.0.0.1:8000\r\n" in sent and b"p%C3" not in sent
    assert f"\r\nAuthorization: Basic {base64.b64encode('ad@min:päss:w'.encode()).decode()}\r\n".encode() in sent
    keyed = _request_bytes(url, b"", {"Authorization": "Bearer sk-pool"})
    assert keyed.count(b"Authorization") == 1 and b"Bearer sk-pool" in keyed
    assert b"Authorization" not in _request_bytes(URL("http://127.0.0.1:8000/v1"), b"", {})
    assert b"Basic " + base64.b64encode(b"u:") in _request_bytes(URL("http://u@127.0.0.1/v1"), b"", {})


@pytest.mark.parametrize("url, host", [("http://[::1]:8000/v1", b"[::1]:8000"), ("http://[::1]/v1", b"[::1]"),
                                       ("http://b\u00fccher.example:81/v1", b"xn--bcher-kva.example:81")])
def test_the_host_header_brackets_an_ipv6_address_and_writes_a_name_in_ascii(url, host):
    """RFC 9110's Host: `[::1]:8000`, never `::1:8000`; an internationalized name as its IDNA form."""
    assert b"\r\nHost: " + host + b"\r\n" in _request_bytes(URL(url), b"", {})


async def test_an_https_upstream_is_verified_and_reached_over_tls(tmp_path, monkeypatch):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def answer(writer, request, n):
        writer.write(_answer(b'{"tls": true}', "Content-Length: 13"))
        await writer.drain()

    server, url, seen, _ = await _raw_server(answer, tls)
    with pytest.raises(UpstreamUnreachable, match="certificate"):   # not trusted: nothing is sent
        await UpstreamClient().post(url, b"{}", {})
    assert seen == []
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))   # now it is (the system's trust store, as in production)
    client = UpstreamClient()
    async with await client.post(url, b"{}", {}) as r:
        assert (r.status, await r.read()) == (200, b'{"tls": true}')
    await client.close()
    server.close()


async def test_a_hosts_connections_all_in_use_hold_up_no_other_host_and_a_wait_for_one_is_bounded():
    """At most `max_connections` to each host: one upstream whose answers stall holds up neither another
    upstream nor, past `connect_timeout`, the request waiting for its slot (UpstreamUnreachable: nothing
    was sent), and its slot comes back once the stalled answer is closed."""
    async def stall(writer, request, n):
        await asyncio.sleep(60)

    async def answer(writer, request, n):
        writer.write(_answer(b'{"a": 1}', "Content-Length: 8"))
        await writer.drain()

    slow, slow_url, _, _ = await _raw_server(stall)
    fast, fast_url, _, _ = await _raw_server(answer)
    client = UpstreamClient(connect_timeout=0.3, read_timeout=30, max_connections=1)
    held = asyncio.ensure_future(client.post(slow_url, b"{}", {}))
    await asyncio.sleep(0.1)
    async with await asyncio.wait_for(client.post(fast_url, b"{}", {}), 2) as response:   # another host: at once
        assert await response.read() == b'{"a": 1}'
    started = time.monotonic()
    with pytest.raises(UpstreamUnreachable, match="all 1 connections to 127.0.0.1"):
        await client.post(slow_url, b"{}", {})
    assert 0.25 < time.monotonic() - started < 2
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    assert client.num_in_use == 0
    await client.close()
    slow.close()
    fast.close()


async def test_batch_lines_hold_at_most_half_a_hosts_connections_and_wait_for_theirs_however_long():
    """max_connections 4: two background requests (batch lines) stall their answers; a third waits for a
    background slot past `connect_timeout` (no UpstreamUnreachable: a batch line waits), while a request a
    client waits on gets one of the other two at once; the third goes out once a background answer is closed."""
    release = asyncio.Event()

    async def answer(writer, request, n):
        if b"batch" in request:
            await release.wait()
        writer.write(_answer(b'{"a": 1}', "Content-Length: 8"))
        await writer.drain()

    server, url, seen, _ = await _raw_server(answer)
    client = UpstreamClient(connect_timeout=0.2, read_timeout=30, max_connections=4)
    lines = [asyncio.ensure_future(client.post(url, b'"batch"', {}, background=True)) for _ in range(3)]
    await asyncio.sleep(0.5)                                 # past connect_timeout
    assert sum(b"batch" in request for request in seen) == 2 and not any(line.done() for line in lines)
    async with await asyncio.wait_for(client.post(url, b'"chat"', {}), 2) as response:   # at once
        assert await response.read() == b'{"a": 1}'
    release.set()
    for line in lines:
        async with await asyncio.wait_for(line, 5) as response:
            assert await response.read() == b'{"a": 1}'
    assert sum(b"batch" in request for request in seen) == 3 and client.num_in_use == 0
    (await asyncio.wait_for(client.post(url, b'"chat"', {}, background=True), 2)).close()
    assert client._background[next(iter(client._background))]._value == 2   # every background slot back
    await client.close()
    server.close()
