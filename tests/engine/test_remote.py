"""engine.remote: a replica served over TCP (no Ray here): only a peer holding the key is served, the
engine outlives a gateway that leaves mid-request (its requests aborted, its blocks freed), and the next
gateway is served by the loaded engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.config import CacheConfig, EngineConfig, PoolConfig
from engine.remote import ReplicaServer, connect
from engine.remote_client import RemoteEngineClient
from engine.sampling import SamplingParams
from engine.wire import KEY_BYTES, WireError
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_path):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-remote"), "llama", builtin_path)
    config = EngineConfig(model=str(folder), cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=128),))
    server = ReplicaServer(config, "127.0.0.1")
    server.start()
    for _ in range(600):
        if server.state != "loading":
            break
        time.sleep(0.05)
    assert server.state == "ready"
    return server


class _Link:
    """A `ReplicaLink` that knows the server's address and key (what Ray's control plane hands out)."""

    name = "test/0"
    status = "fixed address"

    def __init__(self, server: ReplicaServer, key: bytes | None = None) -> None:
        self.server, self.key = server, key or server.key
        self.restarts = []

    async def endpoint(self, timeout: float):
        return (*self.server.address, self.key)

    def restart(self, reason: str) -> None:
        self.restarts.append(reason)


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
        stream = client.generate([9, 10, 11], params)
        await stream.__anext__()                 # one long request in flight, then the gateway goes
        client.lost("the gateway went away")     # drops the connection as a crashed gateway would
        assert "went away" in await client.died
        with pytest.raises(Exception, match="went away"):
            await stream.__anext__()
        return tokens

    async def second_gateway() -> list[int]:
        client = RemoteEngineClient(server.config, _Link(server))
        await client.start(timeout=30)
        stats = await client.stats()            # after the allocators' integrity check
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
