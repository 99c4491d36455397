"""How `cliffguard serve` stops: on SIGTERM (systemd, `docker stop`, Kubernetes) as on Ctrl-C (SIGINT).

The first signal closes the listener and the idle keep-alive connections at once and gives the requests in
flight `gateway.drain_seconds` to finish (aiohttp's `shutdown_timeout`, set on the runner: `start_server`);
the HTTP requests still waiting or running then are cut, answered 503 `server_shutting_down` (a stream that
has begun: that error event, then `[DONE]`; `Gateway.cut_in_flight`). Batch lines drain alike (none starts, those
an upstream pool has get the drain to finish: `BatchRunner.drain`, on the app's `on_shutdown`). The app's cleanup
runs: the background Responses and batch lines still running are kept unfinished, run again at the next start
(a batch line an upstream pool still had is answered `upstream_disconnected` then, not sent again), and
the device workers are shut down. A second signal cuts everything at once (the workers end on their own,
their gateway gone: `engine.worker`). The workers ignore both signals, so a signal sent to the whole process
group (Ctrl-C in a terminal; systemd's default `KillMode=control-group`) stops only the gateway, which then
stops them. The exit status: 130 after Ctrl-C (the shell's), 0 after SIGTERM (a
stop that was asked for), 143 when a second SIGTERM cut the drain short.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

log = logging.getLogger("cliffguard.gateway")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def serve_until_stopped(runner: web.AppRunner, drain_seconds: float,
                              at_drain_end: Callable[[], int] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then stop as the module says; the exit status. `at_drain_end`: what cuts
    the requests still in flight once the drain is over (`Gateway.cut_in_flight`), the number it cut."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    stop, received = asyncio.Event(), []

    def on_signal(signum: signal.Signals) -> None:
        if received:
            log.warning("%s again: stopping now; requests still in flight are cut", signum.name)
            task.cancel()
            return
        received.append(signum)
        stop.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await stop.wait()
    except asyncio.CancelledError:
        if not received:   # not by a signal of ours: stop all the same
            await runner.cleanup()
            raise
        _remove_handlers(loop)   # two signals in one turn of the loop: the second cuts, as below
        return 130 if received[0] == signal.SIGINT else 143
    log.info("%s: stopping; the listener is closed, requests in flight get up to %g s to finish "
             "(gateway.drain_seconds)", received[0].name, drain_seconds)
    cut = loop.call_later(drain_seconds, _cut, at_drain_end) if at_drain_end is not None else None
    try:
        await runner.cleanup()
    except asyncio.CancelledError:   # a second signal: what is left is cut by asyncio.run's end
        return 130 if received[0] == signal.SIGINT else 143
    finally:
        _remove_handlers(loop)
        if cut is not None:
            cut.cancel()
    log.info("stopped")
    return 130 if received[0] == signal.SIGINT else 0


def _cut(at_drain_end: Callable[[], int]) -> None:
    if (num_cut := at_drain_end()):
        log.warning("the drain is over: %d requests still in flight are cut (503 server_shutting_down)", num_cut)


def _remove_handlers(loop: asyncio.AbstractEventLoop) -> None:
    for signum in STOP_SIGNALS:
        loop.remove_signal_handler(signum)
