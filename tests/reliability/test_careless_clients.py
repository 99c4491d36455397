"""Clients that ask and never read (black box, live server): whatever the gateway sends is bounded in
time by `gateway.write_timeout` and, for a stream, in memory by `gateway.max_response_buffer_bytes`
(its engine requests pause meanwhile, keeping their KV); `/health` stays fast and every credit comes
back. The `live` fixture checks the credits before and after each test."""

from __future__ import annotations

import select
import socket
import time

import psutil

from bench.live import LiveServer
from tests.reliability.conftest import (MAX_RESPONSE_BUFFER_BYTES, MODEL, WRITE_TIMEOUT, Probe, credits, metric,
                                        silent_client, wait_until)

TIMEOUTS = "cliffguard_client_write_timeouts_total"
# One step's chunk of the stream below: 28 choices of one token with 20 top logprobs (~2 KiB each).
STEP_CHUNK_BYTES = 28 * 2048


def _open_ports(live: LiveServer, ports: set[int]) -> set[int]:
    """The client ports among `ports` that the server still holds an established connection from."""
    server_port = int(live.url.rsplit(":", 1)[1])
    return {c.raddr.port for c in psutil.Process(live.proc.pid).net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server_port and c.raddr
            and c.raddr.port in ports}


def _watch_unread(live: LiveServer, socks: list[socket.socket], timeout: float) -> dict[int, float]:
    """Until the server closed every socket's connection (or `timeout`): per socket, the seconds from the
    first byte of its answer (seen without reading it) to the server closing the connection."""
    ports = {s.getsockname()[1]: s for s in socks}
    first: dict[int, float] = {}
    held: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(held) < len(ports) and time.monotonic() < deadline:
        readable, _, _ = select.select([s for p, s in ports.items() if p not in first], [], [], 0.25)
        now = time.monotonic()
        first.update({s.getsockname()[1]: now for s in readable})
        still_open = _open_ports(live, set(ports))   # a /proc scan: four a second at most
        held.update({p: now - first.get(p, now) for p in ports if p not in still_open and p not in held})
        time.sleep(max(0.0, now + 0.25 - time.monotonic()))
    assert len(held) == len(ports), (f"{len(ports) - len(held)} of {len(ports)} unread answers still held open "
                                     f"after {timeout:g} s")
    return held


def test_json_responses_nobody_reads_are_cut_after_write_timeout(live):
    # 3 non-streamed chats whose ~260 KB answers (4 samples of 36 tokens with 20 top logprobs) exceed
    # the socket's send buffer, on raw sockets that never read: aiohttp used to wait on each for ever.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "n": 4,
            "max_tokens": 36, "logprobs": True, "top_logprobs": 20, "temperature": 1.0, "ignore_eos": True}
    before = metric(live.url, TIMEOUTS, pool="chat")
    socks = []
    try:
        with Probe(live.url) as probe:
            socks = [silent_client(live.url, "/v1/chat/completions", body) for _ in range(3)]
            held = _watch_unread(live, socks, timeout=120)
        probe.assert_healthy()
    finally:
        for sock in socks:
            sock.close()
    assert max(held.values()) < WRITE_TIMEOUT + 2, sorted(held.values())
    assert metric(live.url, TIMEOUTS, pool="chat") - before == 3
    assert "gateway.write_timeout" in "".join(live.log)
    free, total = credits(live.url)["chat"]
    assert free == total


def test_a_small_answer_nobody_reads_does_not_keep_its_connection(live):
    # A 4-token answer fits the kernel's buffers whole, so its write never waits; the connection then
    # idles in keep-alive, which aiohttp keeps 75 s by default: closed after max(5 s, write_timeout).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}
    socks = [silent_client(live.url, "/v1/chat/completions", body) for _ in range(8)]
    try:
        held = _watch_unread(live, socks, timeout=30)
    finally:
        for sock in socks:
            sock.close()
    assert max(held.values()) < max(5.0, WRITE_TIMEOUT) + 2, sorted(held.values())


def test_a_stream_nobody_reads_pauses_its_engine_requests_within_its_buffer_then_is_cut(live):
    # 28 samples of up to 1,000 tokens with 20 top logprobs: ~55 KB a step. Once the socket and the
    # transport are full, the gateway queues up to max_response_buffer_bytes, pauses the engine
    # requests (KV and credits kept) and, write_timeout after its write blocked, aborts the stream.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "n": 28,
            "max_tokens": 1000, "logprobs": True, "top_logprobs": 20, "stream": True, "temperature": 1.0}
    paused_before = metric(live.url, "cliffguard_paused_responses_total", pool="chat")
    sock = silent_client(live.url, "/v1/chat/completions", body)
    port = sock.getsockname()[1]
    buffered = []
    try:
        with Probe(live.url) as probe:
            try:   # ~3 s on an idle 2-core machine; CI's slowest hours have taken over 30
                wait_until(lambda: metric(live.url, "cliffguard_paused_responses_total", pool="chat") > paused_before,
                           120, "the stream pausing its engine requests")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {metric(live.url, 'cliffguard_buffered_response_bytes'):g} bytes "
                                     f"buffered, {metric(live.url, 'cliffguard_generation_tokens_total', pool='chat'):g}"
                                     " chat tokens generated") from None
            free, total = credits(live.url)["chat"]
            assert free < 0.05 * total, (free, total)   # paused, it keeps its credits
            tokens_paused = metric(live.url, "cliffguard_generation_tokens_total", pool="chat")
            while _open_ports(live, {port}):   # under write_timeout: a slow machine reads only a few samples
                buffered.append(metric(live.url, "cliffguard_buffered_response_bytes"))
                time.sleep(0.05)
        probe.assert_healthy()
    finally:
        sock.close()
    tokens_cut = metric(live.url, "cliffguard_generation_tokens_total", pool="chat")
    assert buffered, "the stream was cut before its buffered bytes could be read"
    assert MAX_RESPONSE_BUFFER_BYTES < max(buffered) <= MAX_RESPONSE_BUFFER_BYTES + 2 * STEP_CHUNK_BYTES, buffered
    # Paused: at most the steps already in flight; unpaused, the seconds to the cut would add 10-30 steps.
    assert tokens_cut - tokens_paused <= 28 * 2, (tokens_paused, tokens_cut)
    assert "gateway.write_timeout" in "".join(live.log)
    wait_until(lambda: metric(live.url, "cliffguard_buffered_response_bytes") == 0, 30, "the buffer emptying")
    wait_until(lambda: (lambda c: c[0] == c[1])(credits(live.url)["chat"]), 30, "the credits coming back")
