"""`AsyncEngineClient`: the gateway's side of a device worker (`engine.worker`).

The client starts the worker process, sends commands over a socket pair (`engine.ipc.Channel`: a non-blocking outbox
on both sides; the messages are `engine.messages`) and reads outputs with `loop.add_reader`: no thread, no blocking
call. Each request's deltas go to its own queue, which `generate` yields from; the counters that come with them are
kept as `latest_stats`.

Workers are forked from multiprocessing's fork server (`engine.fork_server`), started off the event loop: the first
start waits for the server's import of torch. The worker gets the gateway's environment as it is when the worker
starts (`worker_main`'s `environ`).

Death: the client watches both the socket (EOF) and the process sentinel, so a worker that exits for any reason
(`kill -9`, the OOM killer, a crash in a kernel, a `Fatal` step error) is noticed at once. In-flight streams and
stats calls then fail with `EngineDeadError` naming the exit (`device worker process exited (signal 9, SIGKILL)`),
the process is reaped in the background (joined, killed if it lingers, its socket and sentinel closed; one SIGKILL
cannot end, stuck in the kernel, is given up on after KILLED_WAIT_S), and `client.died` resolves with the reason. A
client is one process's life: to restart, make a new client (`gateway.workers.supervisor` does, with back-off). A
worker outlives the fork server it came from (`engine.worker_process`): it is not taken for dead then.

Liveness: the worker sends a `Heartbeat` every half second from a thread of its own, with how long its loop has been
inside the current step. `silent_seconds()` (time since the worker last said anything) and `step_seconds()` (how
long its current step has lasted) are what the supervisor's watchdog judges, whether or not requests are in flight.

A request whose handling failed in the worker (not its input: a bug, an injected fault) fails alone with
`RequestFailedError`; the worker goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.fork_server import forget_at_exit, kill_at_exit, launch, start_fork_server
from engine.ipc import Channel, FrameError
from engine.messages import (AbortRequest, AddRequest, Fatal, Heartbeat, Lease, LeaseAck, Outputs, PauseRequest, Ready,
                             Rejected, ReportWaiting, Shutdown, StartupError, StatsQuery, StatsReply)
from engine.outputs import RequestDelta
from engine.rendezvous import describe_exit
from engine.sampling import SamplingParams
from engine.stats import EngineStats, WorkerInfo
from engine.worker import worker_main
from engine.worker_process import WorkerProcess


log = logging.getLogger("cliffguard.engine")

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestFailedError", "describe_exit", "start_fork_server"]


class EngineDeadError(RuntimeError):
    """The device worker process exited or failed; in-flight requests get this error."""


class RequestFailedError(RuntimeError):
    """The worker failed to handle one request (not its input, and not the worker as a whole: the
    others go on); that request alone gets this error. `reason` is the worker's `Type: message`."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: the device worker failed to handle it: {reason}")
        self.request_id, self.reason = request_id, reason


SEND_HIGH_WATER = 8 << 20   # bytes of commands queued for the worker: new requests wait above this
SEND_LOW_WATER = 1 << 20    # ... until the outbox is back under this
KILLED_WAIT_S = 5.0         # a process SIGKILL has not ended by then is stuck in the kernel (a GPU driver's hang)


@dataclass
class _Stream:
    queue: asyncio.Queue
    finished: bool = False
    sent: bool = False     # its AddRequest went out; before, a pause is kept here and sent after it
    paused: bool = False


class AsyncEngineClient:
    """Starts a device worker process and streams each request's outputs as they are produced.

    Use from one event loop:
        client = AsyncEngineClient(config); info = await client.start()
        async for out in client.generate("Hello", SamplingParams(max_tokens=8)): ...
        await client.shutdown()
    Leaving a `generate` loop early (break, cancellation, client disconnect) aborts the request and frees its blocks.

    One client is one worker process's life: once the process is gone (it exited, sent `fatal`, or `shutdown` was
    called) `is_alive` is False, every call raises `EngineDeadError`, and `died` resolves with the reason after the
    process was reaped. A restart is a new client.
    """

    def __init__(self, config: EngineConfig, start_method: str = "forkserver") -> None:
        self.config = config
        self.start_method = start_method              # forkserver; spawn (a fresh interpreter) for comparison
        self.info: WorkerInfo | None = None           # what the worker reported once loaded
        self.died: asyncio.Future[str] | None = None   # (after `start`) the reason, once the process is reaped
        self.pid: int | None = None                   # the worker process's, once started
        self.exitcode: int | None = None              # the process's, once reaped (negative: killed by a signal)
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._process: WorkerProcess | None = None
        self._channel: Channel | None = None
        self._writing = False                         # a writer callback is registered (the outbox is not empty)
        self._room = asyncio.Event()                  # set while the outbox is under SEND_HIGH_WATER
        self._room.set()
        self.last_heard = 0.0                         # time.monotonic() of the worker's last message
        self.last_step_seconds = 0.0                  # the last heartbeat's: how long the current step has run
        self._last_beat = 0.0                         # time.monotonic() of the last heartbeat
        self._sentinel: int | None = None
        self._ready: asyncio.Future | None = None
        self._dead: str | None = None
        self._reaper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats_waiters: list[asyncio.Future] = []
        self.latest_stats: EngineStats | None = None   # pushed by the worker with step outputs
        self.stats_received = 0.0   # time.time() here when they came: their age on this machine's clock
        self.step_failed = False   # the worker ended saying a step failed (its `Fatal`), not a loss
        self.commands_unreadable = False   # ... saying it could not read a command of ours (its `Fatal`), or we its
        self.kill_unreadable = True   # a worker whose frames do not decode is killed (a remote one's link dropped)
        # A replica shared by several gateways (`engine.sessions`): this gateway's lease on each pool, in
        # KV credits (absent: a local worker, all of it). `on_lease(pool, tokens)` applies a new lease to
        # the gateway's ledger and returns True once what it holds there is within it (then the client
        # acknowledges it); False means later: whoever applied it calls `ack_leases` when it is.
        self.leases: dict[str, int] = {}
        self.on_lease = None
        self._unacked: dict[str, tuple[int, int]] = {}   # pool -> (tokens, epoch) not acknowledged yet

    async def start(self, timeout: float = 900.0) -> WorkerInfo:
        """Spawn the worker and wait until the model is loaded; returns what it reported.

        Raises RuntimeError if the engine failed to build (the worker's message), EngineDeadError if the process died
        while loading; either way the process is reaped before this returns."""
        if self._process is not None:
            raise RuntimeError("AsyncEngineClient.start() may be called once; a restart is a new client")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.died = self._loop.create_future()
        self._channel = channel = await self._launch(timeout)
        self.last_heard = time.monotonic()
        self._loop.add_reader(channel.fileno(), self._on_readable)
        if self._sentinel is not None:
            self._loop.add_reader(self._sentinel, self._on_sentinel)
        try:
            async with asyncio.timeout(timeout):   # (`wait_for` may swallow a cancellation on 3.11)
                self.info = await self._ready
        except BaseException:
            await self.shutdown(1.0)   # a worker that has not loaded has nothing to finish: 1 s, not 10, to go
            raise
        return self.info

    async def _launch(self, timeout: float) -> Channel:
        """Start the worker off the loop (a first fork-server start imports torch), in `timeout` s; its channel."""
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            start_fork_server()   # if it has not started
        parent, child = socket.socketpair()
        process = ctx.Process(target=worker_main, args=(self.config, child, dict(os.environ)), daemon=True,
                              name="cliffguard-device-worker")
        started = launch(self._loop, process)
        try:
            async with asyncio.timeout(timeout):   # a fork server alive but not answering (stopped, swapping)
                await asyncio.shield(started)
        except BaseException:   # cancelled or failed: once the start is over, a worker started reads EOF and ends
            started.add_done_callback(lambda f: (child.close(), parent.close(), f.cancelled() or f.exception()))
            raise
        child.close()
        self._process = watched = WorkerProcess(process, fork_served=self.start_method == "forkserver")
        self._sentinel, self.pid = watched.fd, watched.pid
        kill_at_exit(watched)
        return Channel(parent)

    @property
    def model_path(self) -> str:
        """The model folder the worker loaded (after `start`)."""
        if self.info is None:
            raise RuntimeError("AsyncEngineClient.start() has not been awaited")
        return self.info.model_path

    @property
    def is_alive(self) -> bool:
        """Whether the worker was started and has not died or been shut down (it may still be loading)."""
        return self._process is not None and self._reaper is None

    def _on_readable(self) -> None:
        try:
            messages = self._channel.receive()
        except OSError as exc:   # a frame that is no message is the link's fault, not the requests'; a broken
            unreadable = self.commands_unreadable = isinstance(exc, FrameError)   # connection: the exit says why
            reason = f"device worker: unreadable frame ({exc})" if unreadable else None
            (self.kill if unreadable and self.kill_unreadable else self._on_exit)(reason)
            return
        if messages:
            self.last_heard = time.monotonic()
        for msg in messages:
            self._dispatch(msg)
            if self._reaper is not None:
                return   # `fatal`: the rest is not read
        if self._channel.eof:
            self._on_exit()

    def _on_writable(self) -> None:
        """The socket takes more: write the outbox; stop watching once it is empty."""
        try:
            done = self._channel.flush()
        except OSError:
            self._broken()
            return
        if done:
            self._loop.remove_writer(self._channel.fileno())
            self._writing = False
        if self._channel.num_pending_bytes <= SEND_LOW_WATER:
            self._room.set()

    def _broken(self) -> None:
        """A send found the socket broken (the worker is gone): what it sent before (its last outputs, its
        `Fatal`) is read first, as its EOF would be; never from inside `_on_readable`'s loop."""
        if self._reaper is None:
            self._on_readable()
            self._on_exit()

    def silent_seconds(self, now: float | None = None) -> float:
        """How long the loaded worker has said nothing (not even a heartbeat), busy or idle; 0 while it
        loads or once it is gone. The supervisor's watchdog reads it. A silence of a second or more reads
        what is waiting on the socket first: an event loop that stalled may run this check before the
        reader's callback, and what the worker sent meanwhile is its word all the same."""
        if not self.is_alive or self.info is None:
            return 0.0
        now = time.monotonic() if now is None else now
        if now - self.last_heard >= 1.0 and self._channel is not None:
            self._on_readable()
            if not self.is_alive:
                return 0.0
        return max(0.0, now - self.last_heard)

    def step_seconds(self, now: float | None = None) -> float:
        """How long the worker's current step has lasted, by its last heartbeat (and the time since);
        0 between steps, while it loads or once it is gone. The supervisor's watchdog reads it."""
        if not self.is_alive or self.info is None or not self.last_step_seconds:
            return 0.0
        now = time.monotonic() if now is None else now
        return self.last_step_seconds + max(0.0, now - self._last_beat)

    def _on_sentinel(self) -> None:
        """The process has exited: read what it sent before (its pipe may even stay open, held by a
        child of the worker), then stop. Unless it runs on, its fork server ended: then watch its pidfd."""
        if not self._process.fired():
            log.warning("device worker %s: the fork server it came from ended; the worker runs on", self.pid)
            self._loop.remove_reader(self._sentinel)
            self._sentinel = self._process.fd
            self._loop.add_reader(self._sentinel, self._on_sentinel)
            return
        self._on_readable()
        self._on_exit()

    def _dispatch(self, msg: object) -> None:
        match msg:
            case Outputs():
                for out in msg.deltas:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(out)
                if msg.stats is not None:
                    self.latest_stats, self.stats_received = msg.stats, time.time()
            case Heartbeat():
                self.last_step_seconds, self._last_beat = msg.step_seconds, self.last_heard   # read just now
            case Rejected():
                stream = self._streams.get(msg.request_id)
                if stream is not None:
                    stream.queue.put_nowait(RequestFailedError(msg.request_id, msg.reason) if msg.server_error
                                            else ValueError(msg.reason))
            case StatsReply():
                self.latest_stats, self.stats_received = msg.stats, time.time()
                if self._stats_waiters:
                    waiter = self._stats_waiters.pop(0)
                    if not waiter.done():
                        waiter.set_result(msg.stats)
            case Ready():
                if not self._ready.done():
                    self._ready.set_result(msg.info)
            case StartupError():
                if not self._ready.done():
                    self._ready.set_exception(RuntimeError(f"device worker failed to start: {msg.reason}"))
            case Fatal():
                self.step_failed = not (msg.group_broke or msg.unreadable)
                self.commands_unreadable = msg.unreadable
                self._on_exit(f"device worker failed:\n{msg.traceback}")
            case Lease():
                self.leases[msg.pool] = msg.tokens
                self._unacked[msg.pool] = (msg.tokens, msg.epoch)
                try:
                    applied = self.on_lease is None or self.on_lease(msg.pool, msg.tokens)
                except Exception:   # noqa: BLE001 - what came with it (outputs, Ready) is dispatched still
                    log.exception("device worker %s: applying the lease of pool %s failed", self.pid, msg.pool)
                    return   # not acknowledged: what this gateway holds there is unknown
                if applied:
                    self.ack_leases([msg.pool])

    def ack_leases(self, pools: Sequence[str] | None = None) -> None:
        """Acknowledge the leases of `pools` (all pending ones: None) not acknowledged yet: the gateway admits within
        them from now on and holds no more than them (`engine.sessions`). Nothing for a worker that is gone or going,
        as for `report_waiting`: a credit queue admitting (which calls this) must never fail for it."""
        for pool in list(self._unacked if pools is None else pools):
            entry = self._unacked.pop(pool, None)
            if entry is not None and self.is_alive:
                with contextlib.suppress(EngineDeadError):   # the worker is going: its death says so
                    self._send(LeaseAck(pool, *entry))

    def _on_exit(self, reason: str | None = None, grace: float = 10.0) -> None:
        """The worker is gone or going (pipe EOF, its sentinel, `fatal`, `shutdown`): stop reading and reap the
        process in the background. With a `reason` what is in flight fails now; without one (it exited) once the
        process is reaped, a moment later, so that the reason has the exit code (EOF may come before the status)."""
        if self._reaper is not None:
            return
        self._loop.remove_reader(self._channel.fileno())
        self._loop.remove_writer(self._channel.fileno())
        if self._sentinel is not None:
            self._loop.remove_reader(self._sentinel)
        self._room.set()   # senders waiting for room wake up and find the worker gone
        if reason is not None:
            self._die(reason)
        self._reaper = self._loop.create_task(self._reap(grace))

    async def _reap(self, grace: float) -> None:
        """Join the process (killed past `grace` seconds), fail what is in flight, close its pipe, resolve `died`."""
        process, loop = self._process, self._loop
        await loop.run_in_executor(None, process.join, grace)
        if process.is_alive():
            process.kill()
            await loop.run_in_executor(None, process.join, KILLED_WAIT_S)
        self.exitcode = process.exitcode
        if process.is_alive():   # never reaped: its sentinel stays open, the rest goes on
            log.error("device worker %s: SIGKILL has not ended it in %g s (in the kernel)", self.pid, KILLED_WAIT_S)
            self._die(f"device worker process did not end, even killed (pid {self.pid}, stuck in the kernel)")
        else:
            self._die(self._exit_reason())   # a no-op after `fatal` or `shutdown`, which named the reason
            forget_at_exit(process)
            process.close()
        self._channel.close()
        if not self.died.done():
            self.died.set_result(self._dead)

    def _exit_reason(self) -> str:
        if self._process.status_lost:
            return "device worker process exited (its exit code is unknown: its fork server ended first)"
        code = self._process.exitcode   # non-blocking; None while the process is not reaped yet
        return "device worker process exited" + (f" ({describe_exit(code)})" if code is not None else "")

    def _die(self, reason: str) -> None:
        """Fail the load, every stream and every stats call with EngineDeadError(reason); once."""
        if self._dead is not None:
            return
        self._dead = reason
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self._stats_waiters.clear()

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0, pool: str | None = None,
                       cache_salt: str | None = None, credits: int = 0, background: bool = False
                       ) -> AsyncIterator[RequestDelta]:
        """Submit a request and yield what each step added to it (`RequestDelta`) until it finishes.
        `cache_salt`: the prefix-cache partition (`LLMEngine.add_request`); `credits`: the KV credits the
        gateway holds for it (a shared replica counts them against this gateway's lease), `background` if
        they are a batch line's.

        Raises ValueError if the engine refused the request, RequestFailedError if the worker failed to handle it,
        EngineDeadError if the worker died."""
        self._check_alive()
        request_id = request_id or f"req-{os.getpid()}-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        stream = self._streams[request_id] = _Stream(asyncio.Queue())
        try:
            while not self._room.is_set():
                await self._room.wait()   # the worker is behind on reading: wait for room, never block the loop
                self._check_alive()
            self._send(AddRequest(request_id, prompt if isinstance(prompt, str) else list(prompt),
                                  params or SamplingParams(), priority, pool, cache_salt, credits, background))
            stream.sent = True
            if stream.paused:   # paused while it waited for room, when the worker knew no such request
                self._send(PauseRequest(request_id, True))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            del self._streams[request_id]
            if stream.sent and not stream.finished and self.is_alive:   # one never sent has nothing to abort
                self._send_abort(request_id)

    def _check_alive(self) -> None:
        if self._process is None:
            raise RuntimeError("AsyncEngineClient.start() has not been awaited")
        if not self.is_alive:
            raise EngineDeadError(self._dead or self._exit_reason())

    def _send(self, msg: object) -> None:
        """Queue a command (never blocks); a broken socket means the worker is gone (noticed here
        before the EOF is read: `_broken`, once the caller's callback is done)."""
        try:
            self._channel.send(msg)
        except OSError:
            self._loop.call_soon(self._broken)
            raise EngineDeadError(self._dead or self._exit_reason()) from None
        if self._channel.num_pending_bytes and not self._writing:
            self._loop.add_writer(self._channel.fileno(), self._on_writable)
            self._writing = True
        if self._channel.num_pending_bytes > SEND_HIGH_WATER:
            self._room.clear()

    def _send_abort(self, request_id: str) -> None:
        """Queue an abort whatever the outbox holds (it frees blocks); nothing if the worker is gone."""
        if self._reaper is not None:
            return
        with contextlib.suppress(EngineDeadError):   # the worker is gone; nothing holds the blocks any more
            self._send(AbortRequest(request_id))

    def kill(self, reason: str) -> None:
        """Kill the worker at once (SIGKILL: it also ends a stopped or hung process); what is in flight
        fails with EngineDeadError(reason), and `died` resolves with it once the process is reaped."""
        if self._process is None or self._reaper is not None:
            return
        self._process.kill()
        self._on_exit(reason)

    def report_waiting(self, pool: str, count: int, *, queued: int = 0, queued_batch: int = 0, head: int = 0,
                       head_waited: float = 0.0, head_background: bool = False) -> None:
        """Tell the step composer how many requests of `pool` wait outside the engine (for KV credits
        at the gateway): an interactive pool with a queue there is pressed like one with a queue inside
        (`engine.composer`); and a replica shared by several gateways this gateway's demand on its credits
        (`messages.ReportWaiting`, `engine.sessions`). Nothing if the worker is gone."""
        if self.is_alive:
            with contextlib.suppress(EngineDeadError):
                self._send(ReportWaiting(pool, int(count), int(queued), int(queued_batch), int(head),
                                         float(head_waited), bool(head_background)))

    def pause(self, request_id: str, paused: bool) -> None:
        """Stop stepping a request (`paused`; it keeps its blocks and place) or step it again (the
        worker's `LLMEngine.pause`); one not sent yet (`generate` waits for room) is paused once it is. Never
        blocks; nothing if the worker is gone."""
        if (stream := self._streams.get(request_id)) is not None and not stream.sent:
            stream.paused = paused
        elif self.is_alive:
            with contextlib.suppress(EngineDeadError):
                self._send(PauseRequest(request_id, bool(paused)))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason 'abort'."""
        if self.is_alive:
            self._send_abort(request_id)

    async def stats(self, check: bool = False) -> EngineStats:
        """Fresh per-pool counters (running, waiting, free blocks, preemptions), taken between two steps;
        `check` (tests): after the allocators' integrity check. `/metrics` reads `latest_stats`, never waiting."""
        self._check_alive()
        self._send(StatsQuery(check))
        waiter = self._loop.create_future()
        self._stats_waiters.append(waiter)
        return await waiter

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker (politely, then by force after `timeout` seconds), fail anything still in
        flight, and wait until the process is reaped. Safe to call again, or after the worker died."""
        if self._process is None:
            return
        if self._reaper is None:
            with contextlib.suppress(OSError):   # then EOF: a loaded worker ends on it too, even where Shutdown
                self._channel.send(Shutdown())   # waits in the outbox behind aborts the socket has not taken;
                self._channel.sock.shutdown(socket.SHUT_WR)   # one loading ends on it at once (`LoadWatch`)
            self._on_exit("engine shut down", grace=timeout)
        await asyncio.shield(self._reaper)

    async def __aenter__(self) -> "AsyncEngineClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
