"""engine.wire: typed frames that never unpickle, and the keys that authenticate them."""

from __future__ import annotations

import pickle
import socket

import msgspec
import pytest

from engine.config import LatencySLO
from engine.ipc import Channel
from engine.messages import AddRequest, Outputs, Ready, Shutdown, StatsReply
from engine.outputs import RequestDelta, SampleDelta
from engine.sampling import SamplingParams
from engine.stats import EngineStats, PoolInfo, PoolStats, StepCounters, WorkerInfo
from engine.step_cost import LinearStepTime
from engine.structured import StructuredOutput
from engine.wire import KEY_BYTES, FrameKeys, Handshake, WireError, decode, encode


def _make_messages() -> list[object]:
    params = SamplingParams(n=2, temperature=0.5, max_tokens=7, stop=("\n",), logit_bias=((3, -1.5),), logprobs=2,
                            structured=StructuredOutput.json_schema({"type": "object"}))
    stats = EngineStats(2, {"chat": PoolStats(1, 1, 0, 64, 30, 2, 0.5, 8, 0.0, num_generated_tokens=9)},
                        StepCounters(num_steps=3, step_model=LinearStepTime(0.01, 1e-4, 2e-4, 1e-6),
                                     target_scales={"chat": 0.9}), taken_at=12.5)
    info = WorkerInfo("/m", "cpu", "float32", 128, 16, 1024, {"chat": PoolInfo(64, 0, 2048, 8)}, 3.0,
                      slos={"chat": LatencySLO(1000.0, 100.0)}, slo_derivations={"chat": "measured"})
    delta = RequestDelta("r-1", [SampleDelta(0, "hi", [5, 6], 2, "stop", "\n", [-0.1, -0.2], [[(5, -0.1)], [(6, -0.2)]])],
                         True, None, {"ttft": 0.25})
    return [AddRequest("r-1", [1, 2, 3], params, priority=1, pool="chat", cache_salt="tenant"),
            AddRequest("r-2", "text prompt", SamplingParams()), Outputs([delta], stats), Ready(info),
            StatsReply(stats), Shutdown()]


@pytest.mark.parametrize("msg", _make_messages(), ids=lambda m: type(m).__name__)
def test_every_message_comes_back_equal(msg):
    assert decode(encode(msg)) == msg


def test_a_pickle_or_an_unknown_tag_or_a_wrong_type_is_refused():
    with pytest.raises(WireError):
        decode(pickle.dumps(Shutdown()))
    with pytest.raises(WireError, match="unknown message"):
        decode(msgspec.msgpack.encode(("os.system", {})))
    bad = msgspec.msgpack.encode(("AddRequest", {"request_id": 5, "prompt": "x", "params": {}}))
    with pytest.raises(WireError, match="request_id"):
        decode(bad)
    # the dataclass's own validation runs on the receiving side too
    out_of_range = msgspec.msgpack.encode(("AddRequest", {"request_id": "r", "prompt": "x",
                                                         "params": {"temperature": -1.0}}))
    with pytest.raises(WireError, match="temperature"):
        decode(out_of_range)
    with pytest.raises(TypeError):
        encode(("add", "r"))


def test_a_frame_nested_past_the_decoders_depth_is_refused_as_any_other_bad_frame():
    """2 KB of nested arrays raised RecursionError, which no frame-error path caught: the worker counted it a
    failed step (poison to every request in flight), a shared replica exited, a client's streams hung."""
    import socket

    from engine.ipc import Channel, FrameError

    deep = b"\x92\xaaAddRequest" + b"\x91" * 2000 + b"\xc0"
    with pytest.raises(WireError, match="RecursionError"):
        decode(deep)
    a, b = socket.socketpair()
    try:
        sender, receiver = Channel(a), Channel(b)
        sender.sock.sendall(len(deep).to_bytes(8, "big") + deep)
        with pytest.raises(FrameError, match="not a valid message"):
            for _ in range(50):
                receiver.wait(0.1)
                receiver.receive()
    finally:
        a.close()
        b.close()


def _make_keys(key: bytes = b"k" * KEY_BYTES) -> tuple[FrameKeys, FrameKeys]:
    server, client = Handshake(key), Handshake(key)
    answer = client.client_answer(server.hello())
    client.check_server(server.server_proof(answer))
    return server.keys(server=True), client.keys(server=False)


def test_the_handshake_refuses_a_wrong_key_both_ways_and_a_stranger():
    server, client = Handshake(b"a" * KEY_BYTES), Handshake(b"b" * KEY_BYTES)
    answer = client.client_answer(server.hello())
    with pytest.raises(WireError, match="does not hold"):
        server.server_proof(answer)
    # an impostor server that does not know the key cannot produce the proof
    honest, impostor = Handshake(b"a" * KEY_BYTES), Handshake(b"c" * KEY_BYTES)
    hello = impostor.hello()
    honest.client_answer(hello)
    with pytest.raises(WireError, match="did not prove"):
        honest.check_server(b"\0" * Handshake.PROOF_BYTES)
    with pytest.raises(WireError, match="not a cliffguard replica"):
        Handshake(b"a" * KEY_BYTES).client_answer(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 12)


def test_signed_frames_pass_and_a_changed_replayed_or_dropped_frame_is_a_broken_connection():
    server_keys, client_keys = _make_keys()
    a, b = socket.socketpair()
    server, client = Channel(a, server_keys), Channel(b, client_keys)
    client.send(Shutdown())
    assert server.receive() == [Shutdown()]
    server.send(StatsReply(EngineStats(0, {})))
    assert client.receive() == [StatsReply(EngineStats(0, {}))]
    # a frame replayed by someone on the path (the same bytes again) fails: its number is past
    raw_a, raw_b = socket.socketpair()
    replayer = Channel(raw_b, _make_keys()[1])
    frame_keys = FrameKeys(client_keys.send_key, client_keys.receive_key)
    body = encode(Shutdown())
    frame = len(body).to_bytes(8, "big") + body + frame_keys.sign(body)
    reader = Channel(raw_a, FrameKeys(server_keys.send_key, server_keys.receive_key))
    raw_b.sendall(frame + frame)
    with pytest.raises(OSError, match="frame 1 failed authentication"):
        reader.receive()
    # a flipped byte fails at once
    c, d = socket.socketpair()
    keys_s, keys_c = _make_keys()
    reader = Channel(c, keys_s)
    body = bytearray(encode(Shutdown()))
    mac = keys_c.sign(bytes(body))
    body[-1] ^= 1
    d.sendall(len(body).to_bytes(8, "big") + bytes(body) + mac)
    with pytest.raises(OSError, match="failed authentication"):
        reader.receive()
    for s in (a, b, raw_a, raw_b, c, d, replayer.sock):
        s.close()
