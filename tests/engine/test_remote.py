"""engine.remote: a replica served over TCP (no Ray here): only a peer holding the key is served, the
engine outlives a gateway that leaves mid-request (its requests aborted, its blocks freed), the next
gateway is served by the loaded engine, two gateways are served at once, each within its lease on the
pool's KV credits (a shrinking lease counts once acknowledged), one that connects during the load is proved at once, a peer that trickles its handshake is
dropped at the deadline, and a link that stops carrying frames (a relay that stops forwarding, closing
nothing) is dropped by both ends within `engine.remote.SILENCE_SECONDS`."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import pytest

from engine import remote
from engine.client import EngineDeadError
from engine.config import CacheConfig, EngineConfig, PoolConfig
from engine.remote import ReplicaServer, connect
from engine.remote_client import RemoteEngineClient
from engine.sampling import SamplingParams
from engine.wire import KEY_BYTES, WireError
from tests.conftest import make_tiny_model, started_replica


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_path):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-remote"), "llama", builtin_path)
    config = EngineConfig(model=str(folder), cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=128),))
    server = started_replica(config, timeout=30)
    assert server.state == "ready"
    return server


class _Link:
    """A `ReplicaLink` that knows the server's address and key (what Ray's control plane hands out)."""

    name = "test/0"
    status = "fixed address"

    def __init__(self, server: ReplicaServer, key: bytes | None = None, address: tuple | None = None) -> None:
        self.server, self.key = server, key or server.key
        self.address = address or server.address
        self.restarts = []
        self.checks = []               # silences the cluster manager was asked about (a partition: it answers)
        self.death = asyncio.Event()   # set: the cluster manager's death notice comes

    async def endpoint(self, timeout: float):
        return (*self.address, self.key)

    async def watch(self) -> str:
        await self.death.wait()
        return f"replica {self.name}: Ray reports the actor dead (ActorDiedError: its node is gone)"

    def restart(self, reason: str) -> None:
        self.restarts.append(reason)

    async def restart_unless_responsive(self, reason: str, loading_hangs: bool = False) -> None:
        self.checks.append(reason)


def test_a_kill_whose_restart_fails_still_drops_the_connection(server):
    """`kill` asked the cluster manager to restart the replica before it dropped the connection: a restart that
    raised (Ray's call failing) left the connection up, and the watchdog judged it hung again every tick."""
    async def main():
        link = _Link(server)

        def failing(reason: str) -> None:
            raise RuntimeError("the cluster head did not answer")

        link.restart = failing
        client = RemoteEngineClient(server.config, link)
        await client.start(timeout=30)
        with pytest.raises(RuntimeError, match="did not answer"):
            client.kill("hung: one step has run for 300 s")
        assert not client.is_alive
        assert "hung" in await asyncio.wait_for(client.died, 10)

    asyncio.run(main())


def test_a_peer_without_the_key_is_refused_before_any_message(server):
    async def main():
        with pytest.raises((WireError, OSError)):
            await connect(*server.address, b"x" * KEY_BYTES, timeout=5)
        client = RemoteEngineClient(server.config, _Link(server, b"y" * KEY_BYTES))
        with pytest.raises((WireError, OSError)):
            await client.start(timeout=5)

    asyncio.run(main())


def test_the_engine_outlives_a_gateway_that_leaves_mid_request_and_serves_the_next(server):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def first_gateway() -> list[int]:
        client = RemoteEngineClient(server.config, _Link(server))
        info = await client.start(timeout=30)
        assert info.pid == client.pid and client.address == server.address
        tokens = []
        async for delta in client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8)):
            tokens += delta.outputs[0].delta_token_ids
        stream = client.generate([9, 10, 11], params, request_id="long")
        await stream.__anext__()                 # one long request in flight, then the gateway goes
        client.pause("long", True)               # (it cannot finish first)
        client.lost("the gateway went away")     # drops the connection as a crashed gateway would
        assert "went away" in await client.died
        with pytest.raises(Exception, match="went away"):
            async for _ in stream:               # the deltas that came before the loss, then its error
                pass
        return tokens

    async def second_gateway() -> list[int]:
        client = RemoteEngineClient(server.config, _Link(server))
        await client.start(timeout=30)
        stats = await client.stats(check=True)            # after the allocators' integrity check
        assert stats.num_requests == 0           # the abandoned request was aborted, its blocks freed
        tokens = []
        async for delta in client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8)):
            tokens += delta.outputs[0].delta_token_ids
        await client.shutdown()
        return tokens

    sessions = server.num_sessions
    first = asyncio.run(first_gateway())
    for _ in range(100):                           # the server notices the closed connection
        if not server._engine.requests:
            break
        time.sleep(0.05)
    assert asyncio.run(second_gateway()) == first and len(first) == 8
    assert server.num_sessions == sessions + 2


async def _assert_ends_with(stream, error: type[BaseException]) -> None:
    """The deltas that arrived before the connection's end, then `error`."""
    with pytest.raises(error):
        async for _ in stream:
            pass


def _wait_until(condition, timeout: float) -> float:
    """Seconds until `condition()` held; AssertionError past `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


def _capacity(server: ReplicaServer) -> int:
    pool = server.config.pools[0]
    return pool.num_blocks * server.config.cache.block_size


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


def test_two_gateways_are_served_at_once_each_on_its_lease_and_one_leaving_returns_its_share(server):
    """Both clients number their requests alike (one process: `req-<pid>-0` ...): the replica keeps them
    apart. The first alone leases the whole pool; when the second connects the first's lease shrinks to
    half (acknowledged at once: nothing held) and the second is granted the other half; held credits
    never pass the pool's capacity (the replica's own counters); when the first leaves, its requests
    are aborted and the second's lease grows back to the whole pool."""
    capacity = _capacity(server)
    params = SamplingParams(temperature=0, max_tokens=8)

    async def generate(client, prompt, credits):
        return [t async for d in client.generate(prompt, params, credits=credits) for t in d.outputs[0].delta_token_ids]

    async def main():
        first = RemoteEngineClient(server.config, _Link(server))
        await first.start(timeout=30)
        assert first.leases == {"default": capacity}
        alone = await generate(first, [5, 6, 7], 64)
        stream = first.generate([9, 10, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                request_id="held", credits=300)
        await stream.__anext__()
        first.pause("held", True)                   # in flight for as long as the first's session lives
        with pytest.raises((WireError, OSError)):   # a peer without the key ends nothing
            await connect(*server.address, b"z" * KEY_BYTES, timeout=5)
        second = RemoteEngineClient(server.config, _Link(server))
        await second.start(timeout=30)
        await _until(lambda: first.leases["default"] == capacity // 2 and second.leases.get("default") == capacity // 2)
        both = await asyncio.gather(generate(first, [5, 6, 7], 64), generate(second, [5, 6, 7], 64))
        assert both == [alone, alone]
        pools = (await second.stats(check=True)).pools["default"]
        assert pools.reserved_credits == 300 and pools.held_credits <= capacity
        assert pools.num_session_blocks == 0           # the second's own requests hold nothing now
        assert first.is_alive and len(server.gateways) == 2
        await first.shutdown()
        await _until(lambda: second.leases["default"] == capacity)
        stats = await second.stats(check=True)
        assert stats.num_requests == 0 and stats.pools["default"].reserved_credits == 0   # the held one aborted
        assert await generate(second, [5, 6, 7], 64) == alone
        await second.shutdown()

    sessions = server.num_sessions
    asyncio.run(main())
    assert server.num_sessions == sessions + 2


def test_a_shrinking_lease_counts_only_once_the_gateway_acknowledges_it(server):
    """A gateway whose ledger still holds more than its new share does not acknowledge it: the newcomer
    is granted only what nobody holds until it does."""
    capacity = _capacity(server)

    async def main():
        first = RemoteEngineClient(server.config, _Link(server))
        first.on_lease = lambda pool, tokens: tokens >= capacity   # holding all of it: a smaller one waits
        await first.start(timeout=30)
        second = RemoteEngineClient(server.config, _Link(server))
        await second.start(timeout=30)
        await _until(lambda: first.leases["default"] == capacity // 2)
        await asyncio.sleep(0.3)
        assert second.leases == {"default": 0}
        first.ack_leases()
        await _until(lambda: second.leases["default"] == capacity // 2)
        await first.shutdown()
        await _until(lambda: second.leases["default"] == capacity)
        await second.shutdown()

    asyncio.run(main())


class _Relay:
    """A TCP forwarder on 127.0.0.1 between one gateway and `upstream`; `freeze()` stops it forwarding
    (and reading) without closing anything, as a partitioned path does."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        inward, _ = self.listener.accept()
        outward = socket.create_connection(self.upstream)
        self.sockets += [inward, outward]
        peer = {inward: outward, outward: inward}
        while not self.closed.is_set():
            if self.frozen.is_set():
                time.sleep(0.05)
                continue
            readable, _, _ = select.select(list(peer), [], [], 0.05)
            for sock in readable:
                data = sock.recv(1 << 16)
                if not data:
                    return
                peer[sock].sendall(data)

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.closed.set()
        for sock in self.sockets:
            sock.close()


def test_a_link_that_stops_carrying_frames_is_dropped_by_both_ends_within_the_bound(server, monkeypatch):
    silence = 1.5
    monkeypatch.setattr(remote, "SILENCE_SECONDS", silence)
    monkeypatch.setattr(remote, "KEEPALIVE_SECONDS", 0.25)
    relay = _Relay(server.address)

    async def main():
        link = _Link(server, address=relay.address)
        client = RemoteEngineClient(server.config, link)
        await client.start(timeout=30)
        tokens = [t async for d in client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
                  for t in d.outputs[0].delta_token_ids]
        assert len(tokens) == 4
        await asyncio.sleep(2.5 * silence)         # idle but healthy: the keepalives and heartbeats keep it
        assert client.is_alive and len(server.gateways) == 1
        stream = client.generate([9, 10, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                 request_id="partitioned")
        await stream.__anext__()
        client.pause("partitioned", True)
        await asyncio.sleep(0.2)
        relay.freeze()
        frozen = time.monotonic()
        replica_side = asyncio.to_thread(_wait_until, lambda: not server.gateways, silence + 3)
        reason = await asyncio.wait_for(client.died, silence + 3)
        gateway_seconds = time.monotonic() - frozen
        replica_seconds = await replica_side
        assert "nothing received" in reason, reason
        # judged as the watchdog judges a stall (a `stall_seconds` past the bound never fires first): the cluster
        # manager is asked, which restarts a frozen replica and keeps one that answers (this partition)
        assert link.checks == [reason] and link.restarts == [], (link.checks, link.restarts)
        assert gateway_seconds <= silence + 0.25 + 1.5, gateway_seconds   # from the last frame that passed
        assert replica_seconds <= silence + 1.5, replica_seconds
        await _assert_ends_with(stream, EngineDeadError)
        second = RemoteEngineClient(server.config, _Link(server))   # another gateway, on a good path
        await second.start(timeout=30)
        assert len([t async for d in second.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
                    for t in d.outputs[0].delta_token_ids]) == 4
        await second.shutdown()

    try:
        asyncio.run(main())
    finally:
        relay.close()
    _wait_until(lambda: not server._engine.requests, 5)   # the partitioned gateway's request was aborted


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_a_message_slower_than_the_silence_bound_is_heard_and_a_frame_that_never_ends_is_not_for_long():
    """A message whose bytes take longer than the silence bound to arrive keeps the connection open; a frame
    whose length header was changed in transit leaves the replica waiting for a body that never ends while
    the gateway's keepalives pile up behind it: its bytes count as heard only up to `message_seconds` after
    the last whole message, then the connection reads as closed (it stayed open for good)."""
    from engine.messages import Keepalive, StatsQuery
    from engine.wire import FrameKeys, encode

    def pair(silence: float, message: float):
        gateway_end, replica_end = socket.socketpair()
        keys = FrameKeys(send_key=b"a" * KEY_BYTES, receive_key=b"b" * KEY_BYTES)
        replica = remote.ReplicaChannel(replica_end, FrameKeys(send_key=b"b" * KEY_BYTES,
                                                               receive_key=b"a" * KEY_BYTES), "peer", silence, message)

        def frame(msg) -> bytes:   # as the gateway's channel writes one
            payload = encode(msg)
            return len(payload).to_bytes(8, "big") + payload + keys.sign(payload)
        return gateway_end, replica, frame

    gateway_end, replica, frame = pair(silence=0.3, message=5.0)
    try:
        slow = frame(StatsQuery())
        for i in range(len(slow)):   # 1.2 s or more for one message, four times the silence bound
            gateway_end.sendall(slow[i:i + 1])
            time.sleep(1.2 / len(slow))
            got = replica.receive()
            assert not replica.eof, i
        assert [type(m) for m in got] == [StatsQuery]
    finally:
        gateway_end.close()
        replica.close()

    gateway_end, replica, frame = pair(silence=0.5, message=1.0)
    try:
        for _ in range(4):   # a healthy idle link: keepalives, consumed, keep it open past the bound
            gateway_end.sendall(frame(Keepalive()))
            time.sleep(0.2)
            assert replica.receive() == [] and not replica.eof
        last_whole = time.monotonic()
        gateway_end.sendall((1 << 30).to_bytes(8, "big") + b"x" * 16)   # a 1 GiB frame announced
        deadline = time.monotonic() + 5
        while not replica.eof and time.monotonic() < deadline:
            gateway_end.sendall(frame(Keepalive()))   # bytes keep coming, behind the frame that never ends
            time.sleep(0.1)
            replica.receive()
        assert replica.eof and replica.end_reason.startswith("no whole message from the gateway for")
        assert time.monotonic() - last_whole >= 1.0 + 0.5 - 0.3   # heard for message_seconds, then silent
    finally:
        gateway_end.close()
        replica.close()

    gateway_end, replica, frame = pair(silence=0.5, message=1.0)
    try:   # a step longer than both bounds (a first compile) while a large message arrives: not the gateway's silence
        big = frame(StatsQuery())
        gateway_end.sendall(big[:len(big) // 2])
        time.sleep(1.6)                          # the replica steps, reading nothing
        assert replica.receive() == [] and not replica.eof
        gateway_end.sendall(big[len(big) // 2:])
        assert [type(m) for m in replica.receive()] == [StatsQuery] and not replica.eof
        time.sleep(0.3)
        replica.wait(0.5)                        # listening: a silent gateway's time counts again
        replica.wait(0.5)
        replica.receive()
        assert replica.eof and replica.end_reason.startswith("nothing from the gateway for")
    finally:
        gateway_end.close()
        replica.close()

    gateway_end, replica, frame = pair(silence=0.5, message=1.0)
    try:   # a long turn after which nothing came: the gateway was silent all along, whatever the replica did
        time.sleep(1.2)
        assert replica.receive() == [] and replica.eof
    finally:
        gateway_end.close()
        replica.close()


def test_each_end_bounds_what_its_peer_leaves_unacknowledged(server, monkeypatch):
    monkeypatch.setattr(remote, "SILENCE_SECONDS", 7.5)

    async def main():
        client = RemoteEngineClient(server.config, _Link(server))
        await client.start(timeout=30)
        theirs = server._hub.sessions[0].channel.sock   # the replica's end: the gateway reads whenever data comes
        assert theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7500
        ours = client._channel.sock     # the gateway's end: a replica reads between steps only
        assert ours.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == remote.UNREAD_SECONDS * 1000
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) for s in (theirs, ours))
        await client.shutdown()

    asyncio.run(main())


def test_a_peer_that_trickles_its_handshake_is_dropped_at_the_deadline_and_the_next_is_served(server, monkeypatch):
    monkeypatch.setattr(remote, "HANDSHAKE_SECONDS", 1.0)
    with socket.create_connection(server.address) as peer:
        peer.settimeout(5)
        peer.recv(64)                               # the replica's hello
        assert _seconds_until_closed(peer) < 3.0    # a byte every 0.2 s: each read is quick, the whole is not

    async def main():
        client = RemoteEngineClient(server.config, _Link(server))
        await client.start(timeout=30)
        await client.shutdown()

    asyncio.run(main())


def _seconds_until_closed(peer: socket.socket, limit: float = 10.0) -> float:
    """Send a byte every 0.2 s until the other end closes; how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            peer.sendall(b"x")
            time.sleep(0.2)
            if not peer.recv(1, socket.MSG_DONTWAIT):
                return time.monotonic() - started
        except BlockingIOError:
            continue
        except OSError:
            return time.monotonic() - started
    raise AssertionError(f"still open after {limit} s")


def test_a_gateway_that_connects_while_the_engine_loads_is_proved_at_once_and_served_when_it_is_loaded(
        server, monkeypatch):
    import engine.llm_engine

    loaded = threading.Event()
    real = engine.llm_engine.LLMEngine

    def held_engine(config):
        loaded.wait(30)                              # the load lasts until the test lets it end
        return real(config)

    monkeypatch.setattr(engine.llm_engine, "LLMEngine", held_engine)
    loading = ReplicaServer(server.config, "127.0.0.1")
    loading.start()

    async def main():
        sock, _ = await connect(*loading.address, loading.key, timeout=5)   # no wait for the load
        sock.close()
        client = RemoteEngineClient(server.config, _Link(loading))
        starting = asyncio.ensure_future(client.start(timeout=60))
        await asyncio.sleep(0.3)
        assert loading.state == "loading" and not starting.done()
        lost_link = _Link(loading)
        lost = asyncio.ensure_future(RemoteEngineClient(server.config, lost_link).start(timeout=60))
        await asyncio.sleep(0.3)
        lost_link.death.set()                        # its node lost while it loads: it says nothing meanwhile
        with pytest.raises(EngineDeadError, match="Ray reports the actor dead"):
            await asyncio.wait_for(lost, 5)          # noticed at once, not at the start's limit
        loaded.set()
        info = await starting                        # Ready once the load ends
        assert loading.state == "ready" and info.num_blocks == 128
        await client.shutdown()

    asyncio.run(main())


def test_peers_that_connect_and_say_nothing_hold_up_no_gateway(server, monkeypatch):
    """Each handshake runs on its own thread: two silent peers (a port scanner, a stuck client) made every
    gateway wait out their HANDSHAKE_SECONDS one after the other. Past MAX_HANDSHAKES at once the oldest is
    dropped, not the newcomer: a flood of silent connections (anyone who reaches the port, without the key)
    locked every reconnecting gateway out for as long as it lasted."""
    monkeypatch.setattr(remote, "MAX_HANDSHAKES", 3)
    silent = [socket.create_connection(server.address) for _ in range(2)]

    async def main():
        started = time.monotonic()
        sock, _ = await connect(*server.address, server.key, timeout=5)
        sock.close()
        return time.monotonic() - started

    try:
        time.sleep(0.1)
        assert asyncio.run(main()) < 2.0    # was HANDSHAKE_SECONDS (10 s) per silent peer ahead of it
        silent += [socket.create_connection(server.address) for _ in range(3)]   # a flood past the cap
        time.sleep(0.3)
        assert asyncio.run(main()) < 2.0    # the gateway still gets in
        silent[0].settimeout(5)
        while silent[0].recv(4096):         # the replica's hello, then the end: the oldest silent peer was
            pass                            # dropped for the newer ones (a timeout here: it was not)
    finally:
        for peer in silent:
            peer.close()
