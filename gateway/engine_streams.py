"""Each prompt's engine request of a response, on the replica its pool's part was placed on, their deltas merged
as they arrive (`merged`): what `gateway.local_answer.LocalResponse` assembles into choices."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from gateway.admission import Placed, credit_shares
from pools.pool import Pool

Routed = Sequence[tuple[Pool, list[int]]]   # each prompt's pool and token ids


async def merged(routed: Routed, params: SamplingParams, priority: int, request_id: str,
                 placed: dict[str, Placed], tenant: str = "default") -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from every prompt's engine request, as they arrive, each on the replica its
    pool's part was placed on (`placed`)."""
    shares = credit_shares([pool.name for pool, _ in routed], placed)   # what each prompt's replica counts

    def generate(i: int, pool: Pool, ids: list[int]):
        where, credits = placed[pool.name], shares[i]
        return where.client.generate(ids, params, request_id=engine_request_id(request_id, i, len(routed)),
                                     priority=priority, pool=pool.name, cache_salt=pool.cache_salt(tenant),
                                     credits=credits, background=where.background)

    if len(routed) == 1:
        pool, ids = routed[0]
        async with contextlib.aclosing(generate(0, pool, ids)) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, pool: Pool, ids: list[int]) -> None:
        try:
            async with contextlib.aclosing(generate(i, pool, ids)) as stream:
                async for out in stream:
                    queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, pool, ids)) for i, (pool, ids) in enumerate(routed)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= bool(item.finished)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_request_id(request_id: str, i: int, num_prompts: int) -> str:
    """The engine request id of prompt i of a response (`merged`)."""
    return request_id if num_prompts == 1 else f"{request_id}-{i}"
