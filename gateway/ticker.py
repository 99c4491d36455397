"""`Ticker`: a callback run every few tenths of a second on the gateway's event loop.

The gateway's periodic work reads what the device workers last pushed (`AsyncEngineClient.latest_stats`)
and never waits on a model step: admission reconciles its credit ledgers with the reported block use,
the death-spiral watch feeds its detectors. Both run on a `Ticker`; a failing call is logged and the
ticking goes on, so one bad report cannot stop admission or the watch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable


class Ticker:
    """Calls `fn()` every `interval` seconds once started, until stopped. Event-loop only."""

    def __init__(self, name: str, interval: float, fn: Callable[[], None], log: logging.Logger,
                 failure: str) -> None:
        self.name, self.interval, self.fn = name, interval, fn
        self._log, self._failure = log, failure    # logger and message for a call that raised
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start ticking (idempotent; needs a running loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.fn()
            except Exception:  # noqa: BLE001 - a bad report must not stop the ticking
                self._log.exception(self._failure)
