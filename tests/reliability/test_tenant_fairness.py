"""Fairness inside one tenant (black box, live server): with no API keys every client is one tenant, and a
burst of large requests must not hold a small request behind it (`pools.credits.flows`)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.reliability.conftest import MODEL, Probe

SMALL_WITHIN_S = 5.0


async def _burst_then_small(url: str) -> tuple[float, int, int]:
    """16 chats of n=8 x 128 tokens at once, a 4-token chat a second later; (its seconds, its status, how
    many burst requests were still running when it was answered). The burst is abandoned afterwards."""
    def body(text: str, n: int, max_tokens: int) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], "n": n, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 1.0}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def post(payload: dict) -> int:
            async with session.post(url + "/v1/chat/completions", json=payload) as r:
                await r.read()
                return r.status

        burst = [asyncio.create_task(post(body(f"Tell me a story about the number {i}.", 8, 128))) for i in range(16)]
        await asyncio.sleep(1.0)
        started = time.monotonic()
        status = await post(body("Say yes.", 1, 4))
        seconds = time.monotonic() - started
        running = sum(not t.done() for t in burst)
        for task in burst:
            task.cancel()                       # the clients leave: the gateway aborts their requests
        await asyncio.gather(*burst, return_exceptions=True)
    return seconds, status, running


def test_a_small_request_is_not_held_behind_one_tenants_burst(live):
    with Probe(live.url) as probe:
        seconds, status, running = asyncio.run(_burst_then_small(live.url))
    probe.assert_healthy()
    assert status == 200
    assert running > 8, running          # the burst was still going: the small one did not wait for it
    assert seconds < SMALL_WITHIN_S, f"the small request took {seconds:.1f} s behind the burst"
