"""engine.ipc.Channel: frames over a socket pair that never block a send, whatever the peer does."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from engine.ipc import Channel
from engine.messages import AddRequest, Fatal, Outputs, Rejected
from engine.outputs import RequestDelta, SampleDelta
from engine.sampling import SamplingParams
from engine.wire import encode


def _add(request_id: str, prompt) -> AddRequest:
    return AddRequest(request_id, prompt, SamplingParams(max_tokens=4))


def _outputs(text: str) -> Outputs:
    return Outputs([RequestDelta("r", [SampleDelta(0, text, [1], 1)], False)])


def _make_pair(buffer_bytes: int | None = None) -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    if buffer_bytes is not None:
        for sock in (a, b):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    return Channel(a), Channel(b)


def _pump(x: Channel, y: Channel, want_x: int, want_y: int, deadline_s: float = 10.0) -> tuple[list, list]:
    """Alternate flush and receive on both ends until each has `want_*` messages."""
    got_x, got_y = [], []
    deadline = time.monotonic() + deadline_s
    while len(got_x) < want_x or len(got_y) < want_y:
        assert time.monotonic() < deadline, f"stuck: {len(got_x)}/{want_x}, {len(got_y)}/{want_y}"
        x.flush()
        y.flush()
        got_x += x.receive()
        got_y += y.receive()
    return got_x, got_y


def test_both_sides_send_far_more_than_the_socket_holds_and_nobody_blocks():
    # The deadlock of blocking pipes: each side sends megabytes while the other is not reading.
    x, y = _make_pair(buffer_bytes=16 << 10)
    started = time.monotonic()
    big = list(range(2000))               # an add with a long prompt
    for i in range(500):
        x.send(_add(f"req-{i}", big))
        y.send(_outputs(f"delta-{i}" * 500))
    assert time.monotonic() - started < 5, "send blocked"
    assert x.num_pending_bytes > 1 << 20 and y.num_pending_bytes > 1 << 20   # queued, not written
    got_x, got_y = _pump(x, y, 500, 500)
    assert [m.request_id for m in got_y] == [f"req-{i}" for i in range(500)]
    assert got_y[0].prompt == big
    assert [m.deltas[0].outputs[0].delta_text for m in got_x] == [f"delta-{i}" * 500 for i in range(500)]
    assert x.num_pending_bytes == 0 and y.num_pending_bytes == 0


def test_one_message_larger_than_the_socket_buffer_arrives_whole():
    x, y = _make_pair(buffer_bytes=8 << 10)
    payload = "0123456789abcdef" * (1 << 17)     # 2 MiB in one frame
    x.send(Fatal(payload))
    assert not x.flush()
    _, got = _pump(x, y, 0, 1)
    assert got == [Fatal(payload)]


def test_receive_returns_nothing_until_a_frame_is_whole_and_eof_after_the_last():
    a, b = socket.socketpair()
    y = Channel(b)
    x = Channel(a)
    x.send(Rejected("one", "a"))
    x.send(Rejected("two", "b"))
    x.close()
    assert y.receive() == [Rejected("one", "a"), Rejected("two", "b")]
    assert y.eof
    assert y.receive() == []


def test_partial_frame_is_kept_until_the_rest_arrives():
    a, b = socket.socketpair()
    y = Channel(b)
    payload = encode(Rejected("hello", "1"))
    frame = struct.pack("!Q", len(payload)) + payload
    a.sendall(frame[:5])
    assert y.receive() == []
    a.sendall(frame[5:12])
    assert y.receive() == []
    a.sendall(frame[12:] + frame)
    assert y.receive() == [Rejected("hello", "1"), Rejected("hello", "1")]
    a.close()
    y.close()


def test_send_to_a_closed_peer_raises_oserror():
    x, y = _make_pair()
    y.close()
    with pytest.raises(OSError):
        for _ in range(100):
            x.send(_add("x", "x" * 100_000))
            x.flush()


def test_drain_gives_up_after_its_timeout_when_nobody_reads():
    x, y = _make_pair(buffer_bytes=8 << 10)
    x.send(Fatal("x" * (4 << 20)))
    started = time.monotonic()
    assert x.drain(0.3) is False
    assert 0.25 < time.monotonic() - started < 3
    _pump(x, y, 0, 1)
    assert x.drain(0.1) is True


def test_a_channel_past_descriptor_1024_waits_and_drains():
    """A replica holding many connections has sockets past descriptor 1024, which select() cannot watch (a
    ValueError): a session's last words there, and its waits, use poll."""
    import fcntl
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1500:
        if hard != resource.RLIM_INFINITY and hard <= 1500:
            pytest.skip(f"this process may open {hard} files at most: no descriptor past 1024 to test with")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048 if hard == resource.RLIM_INFINITY else min(2048, hard), hard))
    x, y = _make_pair(buffer_bytes=8 << 10)
    high = socket.socket(fileno=fcntl.fcntl(x.sock.fileno(), fcntl.F_DUPFD, 1500))   # the first free one past 1500
    x.sock.close()
    x.sock = high
    try:
        x.send(Fatal("x" * (4 << 20)))
        started = time.monotonic()
        assert x.drain(0.3) is False and 0.25 < time.monotonic() - started < 3
        started = time.monotonic()
        x.wait(0.3)   # the outbox is full, the peer silent
        assert time.monotonic() - started < 3
        _pump(x, y, 0, 1)
        assert x.drain(0.1) is True
    finally:
        high.close()
        y.sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
