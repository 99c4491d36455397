"""Credits follow the engine, not the socket: a client that reads nothing holds no KV once the engine is
done, and is aborted after `gateway.write_timeout` (in-process, tiny model; the client's socket is
simulated by a response write that never completes)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from tests.gateway.conftest import chat_pool_yaml, start_gateway


def _yaml(model, write_timeout: float) -> str:
    return chat_pool_yaml(model, gateway=f"{{write_timeout: {write_timeout}}}")


@pytest.fixture
def unread_writes(monkeypatch):
    """Every SSE event write waits forever, as on a socket whose client never reads."""
    async def never(self, data):
        await asyncio.Event().wait()
    monkeypatch.setattr(web.StreamResponse, "write", never)


async def _stream(client, model: str, n: int = 4):
    body = {"model": model, "prompt": "hello there", "max_tokens": 24, "n": n, "stream": True,
            "ignore_eos": True, "logprobs": 5}
    async with client.post("/v1/completions", json=body) as response:
        return response.status, await response.read()


async def _until(predicate, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("condition never held")


async def test_credits_come_back_when_the_engine_finishes_not_when_the_client_reads(
        aiohttp_client, tmp_path, tiny_model, unread_writes):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model, write_timeout=600))
    admission = gateway.pools["chat"].admission
    pending = asyncio.ensure_future(_stream(client, gateway.pools["chat"].model_name))
    await _until(lambda: admission.free < admission.total)          # admitted: credits held
    generated = gateway.metrics.generation_tokens.labels(pool="chat")
    await _until(lambda: generated._value.get() >= 4 * 24)          # the engine produced every token
    await _until(lambda: admission.free == admission.total)         # ... and the credits are back
    assert not pending.done()                                       # while the client still read nothing
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)


async def test_a_client_that_reads_nothing_for_write_timeout_is_aborted_and_logged(
        aiohttp_client, tmp_path, tiny_model, unread_writes, caplog):
    client, gateway = await start_gateway(aiohttp_client, tmp_path, _yaml(tiny_model, write_timeout=0.5))
    admission = gateway.pools["chat"].admission
    with caplog.at_level(logging.WARNING, logger="cliffguard.gateway"):
        outcome = await asyncio.wait_for(asyncio.gather(_stream(client, gateway.pools["chat"].model_name),
                                                        return_exceptions=True), 20)
    assert isinstance(outcome[0], Exception) or outcome[0][1] == b"", outcome   # the connection was cut
    assert any("gateway.write_timeout" in r.getMessage() for r in caplog.records)
    assert gateway.metrics.client_write_timeouts.labels(pool="chat")._value.get() == 1
    await _until(lambda: admission.free == admission.total)
    stats = await gateway.pools["chat"].client.stats(check=True)
    assert stats.num_requests == 0
