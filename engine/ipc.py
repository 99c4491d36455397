"""Messages between the gateway and a device worker: typed frames over a socket, never a blocking send.

`multiprocessing.Connection.send` blocks until the peer has read enough of what was sent. With both
sides sending (commands one way, token deltas the other), each can block in `send` waiting for the
other to read: a deadlock that no timeout ends. A `Channel` instead keeps an **outbox**: `send`
appends a frame and writes what the socket takes now; the rest goes out as the socket drains
(`flush`, called when the socket is writable). Neither side's loop ever waits on its peer to
send; each side bounds what it queues (`num_pending_bytes`) and slows its own producers instead:
the gateway's request coroutines await room, the worker stops stepping until its outputs are read.

A frame is an 8-byte big-endian length and the message's MessagePack body (`engine.wire`: typed,
never unpickled), followed, on an authenticated connection (`keys`), by the body's MAC. Large messages
(an add with a long prompt) go out in as many partial writes as the socket needs; the reader
reassembles them. `receive` returns every whole message that has arrived, and `eof` turns True once
the peer closed its end and everything it sent was read.

One `Channel` is used from one thread. The socket is set non-blocking; `wait` (the worker's idle
sleep) selects on it.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time
from collections import deque
from typing import Any

from engine.wire import MAC_BYTES, FrameKeys, WireError, decode, encode

__all__ = ["Channel", "FrameError", "MAX_FRAME_BYTES"]

_HEADER = struct.Struct("!Q")
MAX_FRAME_BYTES = 1 << 31      # a larger frame is a protocol error (a corrupt stream), not a message
_RECV_BYTES = 1 << 20


def _poll(sock: socket.socket, events: int, timeout: float | None) -> None:
    """Sleep until `sock` has one of `events` or `timeout` seconds pass. poll, not select: a process of many
    connections (a replica) has descriptors past select's 1024."""
    poller = select.poll()
    poller.register(sock, events)
    poller.poll(None if timeout is None else max(0.0, timeout) * 1000)


class FrameError(OSError):
    """A frame that is no message (its length past MAX_FRAME_BYTES, its body undecodable, its MAC wrong): the
    stream is corrupt or another program's. An OSError, as a broken connection is; told apart by its type."""


class Channel:
    """One end of a connection carrying `engine.messages`, with a non-blocking outbox.

    `send(msg)` never blocks; `flush()` writes more of the outbox (True once it is empty);
    `receive()` returns the whole messages that arrived (possibly none); `eof` is True once the peer
    is gone (or the connection failed: `end_reason`) and its last message was returned. `close()` closes
    the socket (idempotent). With `keys` (a TCP connection after `engine.wire.Handshake`) every frame is
    signed and checked; a frame that fails its check or is not a message raises OSError, as a broken
    connection does."""

    def __init__(self, sock: socket.socket, keys: FrameKeys | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.keys = keys
        self._mac_bytes = MAC_BYTES if keys is not None else 0
        self.eof = False
        self.end_reason: str | None = None         # why it ended where the peer did not close it (a reset, a timeout)
        self.num_pending_bytes = 0                 # queued in the outbox, not yet taken by the socket
        self.num_received_bytes = 0                # read from the socket so far, whole frames or not
        self._outbox: deque[memoryview] = deque()
        self._inbox = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    # --- sending ---------------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        """Queue `msg` and write what the socket takes now. OSError (BrokenPipeError,
        ConnectionResetError) if the peer is gone."""
        payload = encode(msg)
        mac = self.keys.sign(payload) if self.keys is not None else b""
        frame = memoryview(_HEADER.pack(len(payload)) + payload + mac)
        self._outbox.append(frame)
        self.num_pending_bytes += len(frame)
        self.flush()

    def flush(self) -> bool:
        """Write as much of the outbox as the socket takes now; True when nothing is left."""
        while self._outbox:
            head = self._outbox[0]
            try:
                written = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return False
            self.num_pending_bytes -= written
            if written == len(head):
                self._outbox.popleft()
            else:
                self._outbox[0] = head[written:]
        return True

    # --- receiving -------------------------------------------------------------------------------
    def receive(self) -> list[Any]:
        """Every whole message that has arrived, in order (an empty list when none has). Sets `eof`
        once the peer closed its end or the connection failed (after what arrived before it); FrameError
        (an OSError) for bytes that are no message."""
        while not self.eof:
            try:
                chunk = self.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:   # reset, timed out, unreachable: the link is gone; what came before it is read
                if exc.errno == errno.EBADF:   # a closed socket read: our mistake, not the link's
                    raise
                self.end_reason = self.end_reason or f"connection lost: {exc}"
                chunk = b""
            if not chunk:
                self.eof = True
                break
            self.num_received_bytes += len(chunk)
            self._inbox += chunk
        return self._parse()

    def _parse(self) -> list[Any]:
        messages, start, inbox = [], 0, self._inbox
        while len(inbox) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(inbox, start)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"ipc: a frame of {size} bytes: the stream is corrupt")
            body_end = start + _HEADER.size + size
            end = body_end + self._mac_bytes
            if len(inbox) < end:
                break
            body = bytes(inbox[start + _HEADER.size:body_end])
            try:
                if self.keys is not None:
                    self.keys.check(body, inbox[body_end:end])
                messages.append(decode(body))
            except WireError as exc:
                raise FrameError(str(exc)) from None
            start = end
        if start:
            del inbox[:start]
        return messages

    # --- waiting (the worker) --------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Sleep until a message may be read, or (while the outbox holds something) more may be
        written, or `timeout` seconds pass."""
        _poll(self.sock, select.POLLIN | (select.POLLOUT if self._outbox else 0), timeout)

    def drain(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until the outbox is written (a worker's last words before it
        exits); True if it was."""
        deadline = time.monotonic() + timeout
        while not self.flush():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _poll(self.sock, select.POLLOUT, left)
        return True

    def close(self) -> None:
        self.sock.close()
