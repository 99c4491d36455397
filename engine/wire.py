"""The worker protocol's bytes: typed MessagePack frames, and the keys that authenticate them.

**Encoding.** A message (one of `engine.messages`) is the MessagePack array `[tag, fields]`, where
`tag` names its class and `fields` are its dataclass fields (msgspec encodes them). Decoding looks the
tag up in a fixed table and decodes the fields into that class only: a frame can never name a type the
table lacks, never run code, and a field of the wrong type or out of range is refused (msgspec checks
the annotations and runs each dataclass's `__post_init__`). Nothing here ever unpickles.

**Authentication** (connections over a network: `engine.remote`). Both ends hold a 32-byte key that
only the cluster's control plane hands out. On connect the server sends `MAGIC + server nonce`; the
client answers with its nonce and HMAC-SHA256(key, "client" | both nonces); the server proves itself
with HMAC-SHA256(key, "server" | both nonces). Each direction then has its own session key,
HMAC(key, direction | both nonces), and every frame carries HMAC(session key, frame number | body)
truncated to `MAC_BYTES`: a peer without the key cannot connect, and nobody on the path can forge,
change, reorder, replay or splice frames of a session into another. Frames are not encrypted: one who
can read the network can read prompts and outputs (docs/SCALE.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import msgspec

from engine import messages as m

__all__ = ["FrameKeys", "WireError", "decode", "encode", "Handshake", "MAGIC", "MAC_BYTES", "KEY_BYTES"]

MAGIC = b"cliffgd3"          # a listener that is not a replica (or another version) is told apart at once
NONCE_BYTES = 32
KEY_BYTES = 32
MAC_BYTES = 16
SILENCE_SECONDS = 20.0     # a connection that brought nothing this long is dropped, by either end (`engine.remote`)
_COUNTER = struct.Struct("!Q")

_MESSAGES: tuple[type, ...] = (m.AddRequest, m.AbortRequest, m.PauseRequest, m.ReportWaiting, m.StatsQuery,
                               m.Shutdown, m.Keepalive, m.LeaseAck, m.Ready, m.StartupError, m.Outputs, m.Rejected,
                               m.StatsReply, m.Heartbeat, m.Fatal, m.Lease)
_TAGS = {cls: cls.__name__ for cls in _MESSAGES}
_DECODERS = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in _MESSAGES}
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_ENCODER = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A frame that is not a valid message (unknown tag, wrong field types, failed validation), or one
    whose authentication failed."""


def encode(msg: object) -> bytes:
    """One message's frame body."""
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"not a worker message: {type(msg).__name__}")
    return _ENCODER.encode((tag, msg))


def decode(body: bytes | memoryview) -> object:
    """The message in a frame body; WireError if it is not one."""
    try:
        tag, raw = _ENVELOPE.decode(body)
        decoder = _DECODERS.get(tag)
        if decoder is None:
            raise WireError(f"wire: unknown message {tag[:40]!r}")
        return decoder.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        if isinstance(exc, WireError):
            raise
        # RecursionError: an array nested ~1,000 deep (2 KB) in a body msgspec skips; not a message either
        raise WireError(f"wire: not a valid message: {type(exc).__name__}: {exc}") from None


@dataclass
class FrameKeys:
    """One end's session keys: `send` signs the frames it writes, `receive` checks the frames it reads;
    each direction counts its frames, so a frame's MAC binds its place in the stream."""

    send_key: bytes
    receive_key: bytes
    num_sent: int = 0
    num_received: int = 0

    def sign(self, body: bytes) -> bytes:
        mac = _mac(self.send_key, self.num_sent, body)
        self.num_sent += 1
        return mac

    def check(self, body: bytes | memoryview, mac: bytes | memoryview) -> None:
        expected = _mac(self.receive_key, self.num_received, body)
        if not hmac.compare_digest(expected, bytes(mac)):
            raise WireError(f"wire: frame {self.num_received} failed authentication")
        self.num_received += 1


def _mac(key: bytes, counter: int, body: bytes | memoryview) -> bytes:
    h = hmac.new(key, _COUNTER.pack(counter), hashlib.sha256)
    h.update(body)
    return h.digest()[:MAC_BYTES]


class Handshake:
    """The mutual proof of the shared key, as byte strings each side sends and checks (the socket I/O is
    the caller's: blocking in a replica, asyncio in the gateway).

    Server: `hello()` -> send; read `CLIENT_BYTES`, `server_proof(them)` -> send (WireError if the client
    does not hold the key); `keys(server=True)`. Client: read `HELLO_BYTES`, `client_answer(hello)` ->
    send; read `PROOF_BYTES`, `check_server(proof)`; `keys(server=False)`."""

    HELLO_BYTES = len(MAGIC) + NONCE_BYTES
    CLIENT_BYTES = NONCE_BYTES + 32
    PROOF_BYTES = 32

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key: must be {KEY_BYTES} bytes, got {len(key)}")
        self.key = key
        self.server_nonce = b""
        self.client_nonce = b""

    def hello(self) -> bytes:
        self.server_nonce = os.urandom(NONCE_BYTES)
        return MAGIC + self.server_nonce

    def client_answer(self, hello: bytes) -> bytes:
        if len(hello) != self.HELLO_BYTES or not hello.startswith(MAGIC):
            raise WireError("wire: the peer is not a cliffguard replica (or speaks another version)")
        self.server_nonce = hello[len(MAGIC):]
        self.client_nonce = os.urandom(NONCE_BYTES)
        return self.client_nonce + self._digest(b"client")

    def server_proof(self, answer: bytes) -> bytes:
        if len(answer) != self.CLIENT_BYTES:
            raise WireError("wire: short handshake")
        self.client_nonce = answer[:NONCE_BYTES]
        if not hmac.compare_digest(answer[NONCE_BYTES:], self._digest(b"client")):
            raise WireError("wire: the client does not hold the replica's key")
        return self._digest(b"server")

    def check_server(self, proof: bytes) -> None:
        if not hmac.compare_digest(proof, self._digest(b"server")):
            raise WireError("wire: the replica did not prove the key (a wrong or stale key, or an impostor)")

    def keys(self, *, server: bool) -> FrameKeys:
        to_client, to_server = self._digest(b"to-client"), self._digest(b"to-server")
        return FrameKeys(to_client, to_server) if server else FrameKeys(to_server, to_client)

    def _digest(self, label: bytes) -> bytes:
        return hmac.new(self.key, label + self.server_nonce + self.client_nonce, hashlib.sha256).digest()
