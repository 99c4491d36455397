"""The device worker process: one per device, it owns the weights, the KV tensor and an `LLMEngine`
(one scheduler per pool), so the gateway's event loop never waits on a model step.

`engine.client.AsyncEngineClient` spawns it (`worker_main`) with one end of a socket pair. The loop
(`_serve`) drains the gateway's commands (`engine.messages`), steps the engine and sends each step's
deltas (`RequestDelta`) back as one `Outputs`; every `STATS_INTERVAL` seconds of stepping (and
whenever the engine falls idle, then every `IDLE_STATS_INTERVAL` while it stays so) `Outputs` carries
the engine's counters too, stamped with the time they were taken: the gateway answers `/metrics` from the latest of these without waiting for the
worker. `StatsQuery` asks for a fresh copy, after the allocators' integrity check where it says so (tests).

**Liveness.** A daemon thread beside the loop (`HeartbeatThread`) sends `Heartbeat(step_seconds)` every
`HEARTBEAT_INTERVAL` seconds, whatever the loop is doing: `step_seconds` is how long the loop has been
inside its current turn (its commands, the step, its outputs; 0 while it sleeps between turns). The
gateway's watchdog (`gateway.workers.supervisor`) takes a silent heartbeat for a stopped or hung process, and
a beating one whose step has run past `gateway.step_timeout_seconds` for a hang inside the step. The
two threads share the channel's sending side (`WorkerChannel`: one lock around send and flush);
receiving and waiting stay the loop's. A heartbeat that cannot be sent means the gateway is gone: the
worker ends `LAST_WORDS_SECONDS` later, mid-step too (`_orphaned`), and frees the device. While the model
loads, before there is a loop, `LoadWatch` ends the worker once the gateway's end of the socket closes.

**Failures.** Whatever one request's command raises (add, abort, pause) fails that request alone: a
ValueError is its input's fault (`Rejected`, 400 at the gateway), anything else the worker's handling
of it (`Rejected(server_error=True)`, 500, logged here with its traceback). A failed step is reported
as `Fatal` (its traceback) before the process exits; a failed load as `StartupError`. A follower rank of
its tensor-parallel group that ends (`kill -9`, a crash) ends the worker too, idle or mid-step, with a
`Fatal` naming the rank (`engine.parallel`: the group watches its ranks).

**Fault injection** (tests, `cliffguard bench chaos`): `CLIFFGUARD_FAULT_POISON=<marker>` makes a step
with a request whose prompt holds the marker raise (the worker dies: a poison request);
`CLIFFGUARD_FAULT_REJECT=<marker>` makes adding such a request raise RuntimeError (that request fails
alone). See `engine.faults`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import threading
import time
import traceback

from engine.calibration import ITL_STEPS, TTFT_ITLS
from engine.config import EngineConfig, dtype_name
from engine.faults import Faults, slow_load
from engine.ipc import Channel
from engine.messages import (AbortRequest, AddRequest, Fatal, Heartbeat, Outputs, PauseRequest, Ready, Rejected,
                             ReportWaiting, Shutdown, StartupError, StatsQuery, StatsReply)
from engine.outputs import RequestDelta
from engine.rendezvous import describe_exit
from engine.scheduler import Scheduler
from engine.stats import IDLE_STATS_INTERVAL, STATS_INTERVAL, EngineStats, PoolInfo, PoolStats, StepCounters, WorkerInfo

log = logging.getLogger("cliffguard.engine")


def worker_main(config: EngineConfig, sock: socket.socket, environ: dict[str, str] | None = None) -> None:
    """Entry point of the device worker process: load, then loop (drain commands, step, send).

    `environ`: the gateway's environment when it started this worker (the fork server it is forked from
    holds the one it started with). Ctrl-C in a terminal reaches the whole process group, and so does
    SIGTERM from systemd (its default `KillMode=control-group`) or `kill -TERM -PGID`; the worker ignores
    both and leaves when the gateway says so (or its socket closes), so a shutdown drains, and is never
    mistaken for a crash."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)   # a spawned process starts with none
    from engine.llm_engine import LLMEngine

    channel = WorkerChannel(sock)
    if config.cpu_threads:
        import torch

        torch.set_num_threads(config.cpu_threads)
    try:
        with LoadWatch(sock):
            slow_load()
            engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        channel.send(StartupError(f"{type(exc).__name__}: {exc}"))
        channel.drain(LAST_WORDS_SECONDS)
        return
    engine.group.on_rank_exit = lambda reason: _rank_lost(channel, reason)
    if engine.device.type == "cpu":
        # The model computes on the cores the gateway serves from: let the gateway's event loop (and
        # on a one-box setup its clients) win the CPU whenever they need it, a few ms at a time.
        os.nice(CPU_WORKER_NICE)
    try:
        channel.send(Ready(worker_info(engine)))
        _serve(engine, channel, on_peer_gone=_orphaned)
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return  # the parent is gone
    except UnreadableCommands as exc:   # the link's fault, not the requests': they may run elsewhere
        try:
            channel.send(Fatal(f"device worker: the gateway's commands cannot be read: {exc}", unreadable=True))
            channel.drain(LAST_WORDS_SECONDS)
        except OSError:
            pass
    except Exception:  # noqa: BLE001 - a failed step: tell the parent, which fails the in-flight requests
        _step_failed(channel, engine.group)
    finally:
        engine.close()   # the other ranks of a tensor-parallel group


def _step_failed(channel: "WorkerChannel", group) -> None:
    """A step raised (called in the `except` block): its traceback as a `Fatal`, a failed step that counts
    against the requests in it; unless a follower rank was killed, whose collective failed first: then the
    group broke (`_rank_lost`, as the watch thread says it, which never comes first for certain)."""
    lost = _killed_follower(group)
    if lost is not None:
        _rank_lost(channel, lost)
    group.quiet()   # this failed step is what the worker says, not a follower's end that follows from it
    try:
        channel.send(Fatal(traceback.format_exc()))
        channel.drain(LAST_WORDS_SECONDS)
    except OSError:
        pass


def _killed_follower(group, wait: float = 1.0) -> str | None:
    """Why `group` (a `TensorParallelGroup`) broke, if a follower was killed (a signal: the OOM killer,
    `kill -9`) within `wait` seconds (a collective fails as its peer's sockets close, a moment before the
    process is gone); None while every follower runs, or once one ended by itself (its own step failed)."""
    deadline = time.monotonic() + wait
    while group.processes:
        ended = [(rank, p) for rank, p in enumerate(group.processes, start=1) if p.poll() is not None]
        killed = [(rank, p) for rank, p in ended if p.returncode < 0]   # its end may end others' steps: first
        if killed:
            rank, process = killed[0]
            return f"tensor-parallel rank {rank} of {group.size} (pid {process.pid}) exited " \
                   f"({describe_exit(process.returncode)})"
        if ended:
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return None


def _rank_lost(channel: "WorkerChannel", reason: str) -> None:
    """A follower rank of this worker's tensor-parallel group ended (from the group's watch thread, idle
    or mid-step): the group cannot step again. Say why as a `Fatal`, then end the process at once, as a
    failed step does; the gateway restarts the worker, and its other ranks die with it."""
    log.error("%s; the device worker ends so that it is restarted whole", reason)
    try:
        channel.send(Fatal(f"device worker's group broke: {reason}", group_broke=True))
        channel.drain(LAST_WORDS_SECONDS)
    except OSError:
        pass
    finally:
        logging.shutdown()
        os._exit(1)


def _orphaned(doing: str = "a step runs", level: int = logging.ERROR) -> None:
    """The gateway is gone (a heartbeat could not be sent: it was killed, or its machine's OOM killer took it)
    while the loop may be inside a step, which notices only once the step ends, or never if it hangs: the
    loop did not leave within LAST_WORDS_SECONDS (`HeartbeatThread`), so the process ends, and holds no device
    memory from the gateway that replaces it (its tensor-parallel followers end with it). `LoadWatch` ends it
    so while the model loads, where a gateway that stops it closes the socket too (a warning then)."""
    log.log(level, "the gateway is gone (its socket closed) while %s; the device worker ends", doing)
    logging.shutdown()
    os._exit(1)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"   # the gateway's (gateway.cli) and the worker's
CPU_WORKER_NICE = 10    # niceness of a worker that computes on the CPU (the gateway shares those cores)
MAX_OUTBOX_BYTES = 64 << 20   # outputs the gateway has not read yet: past this the worker stops stepping
LAST_WORDS_SECONDS = 5.0      # how long a failing worker tries to deliver its reason
STALLED_WAIT_SECONDS = 0.01   # a worker whose step ran nothing waits this long (or for a command) to try again
HEARTBEAT_INTERVAL = 0.5      # seconds between heartbeats (the gateway's stall_seconds is many of these)


class WorkerChannel(Channel):
    """A `Channel` whose sending side two threads share: the loop and the heartbeat. `send` and `flush`
    (so `drain` too) hold one lock, so frames (and on a TCP connection their MAC counter) stay whole
    and in order; `receive` and `wait` remain the loop's alone."""

    def __init__(self, sock: socket.socket, keys=None) -> None:
        super().__init__(sock, keys)
        self._send_lock = threading.RLock()   # re-entered: `send` flushes

    def send(self, msg: object) -> None:
        with self._send_lock:
            super().send(msg)

    def flush(self) -> bool:
        with self._send_lock:
            return super().flush()


class HeartbeatThread:
    """Sends `Heartbeat(step_seconds)` on `channel` every `interval` seconds from a daemon thread, until
    the `with` block ends (or the peer is gone). The loop sets `turn_started` (time.monotonic()) when a
    turn begins and 0 when it ends; `step_seconds` is then how long the current turn has lasted."""

    def __init__(self, channel: WorkerChannel, interval: float = HEARTBEAT_INTERVAL, on_peer_gone=None) -> None:
        self.channel, self.interval = channel, interval
        self.on_peer_gone = on_peer_gone   # called on this thread when a heartbeat cannot be sent and the loop
        # has not left within LAST_WORDS_SECONDS
        self.turn_started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cliffguard-heartbeat", daemon=True)

    def __enter__(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.interval * 4)

    def step_seconds(self, now: float | None = None) -> float:
        started = self.turn_started
        if not started:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - started)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.channel.send(Heartbeat(self.step_seconds()))
            except OSError:   # the peer is gone: the loop notices too, between turns
                if self.on_peer_gone is not None and not self._stop.wait(LAST_WORDS_SECONDS):
                    self.on_peer_gone()
                return


class LoadWatch:
    """While the model loads (minutes for a large one), a thread watches the gateway's end of the socket: if it
    closes (the gateway was killed, or it stops the worker), the worker ends at once instead of loading on, holding the device's memory
    from the gateway that replaces it. It polls for the peer's hang-up alone (`POLLRDHUP`, `POLLHUP`, `POLLERR`),
    which the kernel reports whatever unread commands the socket holds (a restarted worker gets some as it loads)."""

    HANG_UP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR

    def __init__(self, sock: socket.socket, interval: float = 0.2) -> None:
        self.sock, self.interval = sock, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cliffguard-load-watch", daemon=True)

    def __enter__(self) -> "LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()   # not joined: it leaves at its next wake-up, and does nothing once stopped

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.sock, self.HANG_UP)
        while not self._stop.is_set():
            if poller.poll(self.interval * 1000) and not self._stop.is_set():
                _orphaned("the model loads (or it stopped this worker then)", logging.WARNING)


class UnreadableCommands(Exception):
    """The gateway's side of the socket sent a frame the worker cannot decode."""


def _serve(engine, channel: WorkerChannel, on_peer_gone=None) -> None:
    """The loop: drain commands, step, send deltas (and stats now and then) until told to stop, with a
    `HeartbeatThread` beside it for as long as it runs (`on_peer_gone`: what it does when the peer is gone).

    Nothing here blocks on the gateway: outputs go to the channel's outbox. While the outbox holds
    over `MAX_OUTBOX_BYTES` (the gateway is not reading) the worker stops stepping, keeps reading
    commands, and sleeps until the socket drains; so a stalled reader bounds the worker's memory.
    An engine whose requests are all paused (`LLMEngine.has_work` False) sleeps too; one whose last step ran
    nothing (`StepStats.stalled`: its requests wait for blocks paused ones hold, or the composer held a pool
    back) sleeps `STALLED_WAIT_SECONDS` at a time, or until a command (it stepped again at once, a core at 100%).

    With `CLIFFGUARD_STEP_TRACE=<file>` in the environment, every step appends one JSON line to the
    file: its time, measured and predicted seconds, the composer's target, each pool's tokens, and
    `cycle_seconds`: the wall time of the loop's turn (commands drained, the step, its outputs sent),
    which is what a step costs the device while serving (`engine.step_cost.read_step_trace` reads it),
    and `new_variants`: the kernel variants Triton compiled during the step (none once serving is warm).
    """
    loop = _Loop(engine, channel, _StepTrace.from_env(engine), Faults.from_env())
    loop.send_stats()   # the gateway's metrics have numbers from the start
    with HeartbeatThread(channel, on_peer_gone=on_peer_gone) as beat:
        while True:
            if not loop.can_step():
                # idle, or the gateway is behind: sleep until a command comes, the socket drains, or stats are due
                channel.wait(IDLE_STATS_INTERVAL)
            elif loop.stalled:   # a step ran nothing: a command, or time (the composer's shares), changes that
                channel.wait(STALLED_WAIT_SECONDS)
            beat.turn_started = time.monotonic()
            if loop.turn():
                return
            beat.turn_started = 0.0


class _Loop:
    """One turn of `_serve`'s loop at a time, and what the turns share."""

    def __init__(self, engine, channel: WorkerChannel, trace: "_StepTrace | None", faults: Faults | None) -> None:
        self.engine, self.channel, self.trace, self.faults = engine, channel, trace, faults
        self.has_work = getattr(engine, "has_work", engine.has_unfinished_requests)   # False: all paused
        self.last_stats = 0.0
        self.stalled = False   # the last step ran nothing (`StepStats.stalled`)

    def can_step(self) -> bool:
        return self.has_work() and self.channel.num_pending_bytes <= MAX_OUTBOX_BYTES

    def send_stats(self) -> None:
        self.channel.send(Outputs([], engine_stats(self.engine)))
        self.last_stats = time.monotonic()

    def turn(self) -> bool:
        """Commands, then a step if there is work; True when the loop should end."""
        engine, channel = self.engine, self.channel
        turn_started = time.perf_counter()
        channel.flush()
        try:
            messages = channel.receive()
        except OSError as exc:   # a frame that does not decode: a gateway of other code, or a corrupt stream
            raise UnreadableCommands(str(exc)) from exc
        for msg in messages:
            if _handle(engine, channel, msg, self.faults):
                return True
        if channel.eof:
            return True   # the gateway is gone
        if self.can_step():
            if self.faults is not None:
                self.faults.before_step(engine)
            deltas = [RequestDelta.from_output(out) for out in engine.step()]
            self.stalled = not deltas and getattr(engine.last_step, "stalled", False)
            now = time.monotonic()
            stats = None
            if now - self.last_stats >= STATS_INTERVAL or not self.has_work():
                stats, self.last_stats = engine_stats(engine), now
            if deltas or stats is not None:
                channel.send(Outputs(deltas, stats))
            if self.trace is not None and engine.last_step.seconds > 0:
                self.trace.write(engine, turn_started)
        elif not self.has_work() and (messages or time.monotonic() - self.last_stats >= IDLE_STATS_INTERVAL):
            self.send_stats()   # commands left it idle (its last state counts), or it has idled a while
        return False


class _StepTrace:
    """The `CLIFFGUARD_STEP_TRACE` file: one JSON line a step (see `_serve`)."""

    def __init__(self, path: str, engine) -> None:
        self.file = open(path, "a", buffering=1)   # noqa: SIM115 - lives with the loop
        self.variants = getattr(engine.runner.backend, "compiled_variants", lambda: None)
        self.known = self.variants() or frozenset()

    @classmethod
    def from_env(cls, engine) -> "_StepTrace | None":
        path = os.environ.get("CLIFFGUARD_STEP_TRACE")
        return cls(path, engine) if path else None

    def write(self, engine, turn_started: float) -> None:
        line = {"t": time.time(), "cycle_seconds": time.perf_counter() - turn_started,
                **dataclasses.asdict(engine.last_step), "new_variants": []}
        variants = self.variants()
        if variants is not None and len(variants) != len(self.known):
            line["new_variants"] = sorted(variants - self.known)
            self.known = variants
        self.file.write(json.dumps(line) + "\n")


def _handle(engine, channel: Channel, msg: object, faults: Faults | None = None) -> bool:
    """Carry out one command; True for `Shutdown`."""
    match msg:
        case AddRequest() | AbortRequest() | PauseRequest():
            _handle_request(engine, channel, msg, faults)
        case ReportWaiting():
            engine.composer.set_external_waiting(msg.pool, msg.count)
        case StatsQuery():
            channel.send(StatsReply(engine_stats(engine, check=msg.check)))
        case Shutdown():
            return True
    return False


def _handle_request(engine, channel: Channel, msg: AddRequest | AbortRequest | PauseRequest,
                    faults: Faults | None) -> None:
    """One request's command. Whatever the engine raises fails that request alone: a ValueError is the
    request's fault (`Rejected`: 400), anything else the handling's (`Rejected(server_error=True)`: 500,
    logged with its traceback, and the request dropped from the engine)."""
    out = None
    try:
        match msg:
            case AddRequest():
                if faults is not None:
                    faults.on_add(engine, msg.request_id, msg.prompt)
                engine.add_request(msg.request_id, msg.prompt, msg.params, priority=msg.priority, pool=msg.pool,
                                   cache_salt=msg.cache_salt, background=msg.background)
            case AbortRequest():
                out = engine.abort(msg.request_id)
            case PauseRequest():
                pause = getattr(engine, "pause", None)   # engines without pausing step the request on
                if pause is not None:
                    pause(msg.request_id, msg.paused)
    except ValueError as exc:
        channel.send(Rejected(msg.request_id, str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - one request's failure, not the worker's
        log.exception("request %s: %s failed; failing the request alone", msg.request_id, type(msg).__name__)
        _drop(engine, msg.request_id)
        channel.send(Rejected(msg.request_id, f"{type(exc).__name__}: {exc}", server_error=True))
        return
    if out is not None:
        channel.send(Outputs([RequestDelta.from_output(out)]))


def _drop(engine, request_id: str) -> None:
    """Abort a request whose command failed halfway, if the engine holds it; a failure is logged."""
    if request_id not in engine.requests:
        return
    try:
        engine.abort(request_id)
    except Exception:  # noqa: BLE001 - best effort: the request's own failure was already reported
        log.exception("request %s: aborting it after its failure failed too", request_id)


def worker_info(engine) -> WorkerInfo:
    """What a loaded engine holds: its model, device, KV tensor and each pool's block range."""
    pools = {name: PoolInfo(num_blocks=s.block_manager.num_blocks, first_block=s.block_manager.first_block,
                            max_model_len=s.max_model_len, max_num_seqs=s.config.max_num_seqs)
             for name, s in engine.schedulers.items()}
    tp = engine.shard.size
    return WorkerInfo(model_path=str(engine.model_path), device=str(engine.device), dtype=dtype_name(engine.dtype),
                      num_blocks=engine.num_blocks, block_size=engine.kv_cache.block_size,
                      kv_bytes_per_token=engine.kv_bytes_per_token * tp, pools=pools,
                      load_seconds=engine.load_seconds, load_phases=dict(engine.load_phases),
                      tensor_parallel_size=tp, pid=os.getpid(),
                      slos={name: slo for name, slo in engine.composer.slos.items() if slo is not None},
                      slo_derivations={name: f"itl {ITL_STEPS:g} x the measured decode step of {batch} sequences at "
                                             f"{context} tokens, {step * 1e3:.1f} ms, over 1 - the throughput pools' "
                                             f"min_share {engine.slo_share:g}; ttft {TTFT_ITLS:g} x itl"
                                       for name, (_, step, batch, context) in engine.derived_slos.items()})


def engine_stats(engine, *, check: bool = False) -> EngineStats:
    """Every pool's counters of a live engine (what the metrics endpoint exports), stamped with
    `time.time()` when taken; `check` also runs the allocators' integrity check."""
    block_bytes = engine.kv_cache.bytes_per_block
    seconds = engine.composer.stats.pool_seconds
    pools = {name: _pool_stats(s, block_bytes, seconds.get(name, 0.0)) for name, s in engine.schedulers.items()}
    if check:
        engine.check_integrity()
    composer = engine.composer.stats
    step = StepCounters(num_steps=composer.num_steps, num_targeted_steps=composer.num_targeted_steps,
                        num_over_target=composer.num_over_target, num_pressed_steps=composer.num_pressed_steps,
                        last_step_seconds=composer.last_step_seconds,
                        last_target_seconds=composer.last_target_seconds,
                        target_scales={name: t.scale for name, t in engine.composer.trackers.items()},
                        busy_seconds=composer.busy_seconds, step_model=engine.composer.cost_model.linear)
    return EngineStats(num_requests=len(engine.requests), pools=pools, step=step, taken_at=time.time())


def _pool_stats(scheduler: Scheduler, block_bytes: int, device_seconds: float) -> PoolStats:
    bm, st = scheduler.block_manager, scheduler.stats
    return PoolStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped), num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
        num_cached_free_blocks=bm.num_cached_free_blocks, kv_cache_usage=bm.usage,
        max_num_seqs=scheduler.config.max_num_seqs,
        cpu_swap_usage=scheduler.swap_manager.usage if scheduler.swap_manager else 0.0,
        num_recompute_preemptions=st.num_recompute_preemptions, num_swap_preemptions=st.num_swap_preemptions,
        num_recomputed_tokens=st.num_recomputed_tokens, num_swapped_out_blocks=st.num_swapped_out_blocks,
        num_swapped_in_blocks=st.num_swapped_in_blocks,
        swapped_out_bytes=st.num_swapped_out_blocks * block_bytes,
        swapped_in_bytes=st.num_swapped_in_blocks * block_bytes, preempt_seconds=st.preempt_seconds,
        num_prefix_queries=bm.num_prefix_queries, num_prefix_hits=bm.num_prefix_hits,
        num_state_loads=getattr(scheduler.state_snapshots, "num_loaded", 0),
        num_state_saves=getattr(scheduler.state_snapshots, "num_saved", 0),
        num_aborted=st.num_aborted, num_too_large=st.num_too_large,
        num_computed_tokens=st.num_computed_tokens, num_generated_tokens=st.num_generated_tokens,
        device_seconds=device_seconds)
