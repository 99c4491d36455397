"""A request's wait for a ready replica of its pool's device (`Gateway.wait_device`), holding nothing.

It waits on every started slot's `DeviceSupervisor.wait_ready` and looks at the slots again every
`RESCAN_SECONDS`: an autoscaled device's parked slots ("stopped") count while started (the autoscaler starts
one for those who wait, and may stop it again; a slot that failed may be started again), so the request takes
whichever replica is ready first. It ends with a 503 when no started slot is left that has not failed (its
failure's message), or past its deadline (each replica's state named).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from gateway.openai.errors import ApiError

RESCAN_SECONDS = 0.25   # how often a waiting request looks at its device's slots again


async def wait_for_replica(replicas: Sequence[Any], pool: str, device: str, limit: float | None,
                           spent: float = 0.0) -> None:
    """Until one of `replicas` (a device's supervisors) is ready; `limit` seconds at most, `spent` of them gone
    already (None: however long). ApiError 503 `pool_unavailable` (module docstring)."""
    if any(s.is_ready for s in replicas):
        return
    if all(s.state == "stopped" for s in replicas):
        raise ApiError(503, f"pool {pool!r}: no replica of device {device!r} is started; retry later",
                       type="server_error", code="pool_unavailable", headers={"Retry-After": "1"})
    deadline = None if limit is None else time.monotonic() + limit - spent
    waits: dict[Any, asyncio.Future] = {}
    failed: BaseException | None = None
    try:
        while True:
            for s in replicas:   # started since (or again, after a failure or a stop)
                if s.state != "stopped" and (s not in waits or waits[s].done() and not s.state.startswith("failed")):
                    waits[s] = asyncio.ensure_future(s.wait_ready())
            if not (live := [w for w in waits.values() if not w.done()]):
                raise ApiError(503, str(failed), type="server_error", code="pool_unavailable")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(live, timeout=RESCAN_SECONDS if left is None else min(left, RESCAN_SECONDS),
                                         return_when=asyncio.FIRST_COMPLETED)
            if any(not w.exception() for w in done):
                return
            for s, w in waits.items():   # a failure of its own before a stop's ("the gateway is shutting down")
                failed = w.exception() if w in done and (failed is None or s.state != "stopped") else failed
            if not done and left is not None and left <= RESCAN_SECONDS:
                states = "; ".join(f"{s.name}: {s.state}" for s in replicas)
                raise ApiError(503, f"pool {pool!r}: no replica of device {device!r} became ready in {limit:g} s "
                                    f"({states}); retry later", type="server_error", code="pool_unavailable",
                               headers={"Retry-After": str(max(1, round(limit)))})
    finally:
        for w in waits.values():
            w.cancel()
