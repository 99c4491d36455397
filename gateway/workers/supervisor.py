"""`DeviceSupervisor`: one device worker's life as the gateway sees it — start, death, restart.

There is one supervisor per replica of a device (a replicated device has several, each with its own worker
process, or its own tensor-parallel group, of which the worker is rank 0). The supervisor owns its replica's
`engine.client.AsyncEngineClient`, a new one per worker process, and points the device's pools at the live
one (`Pool.clients[replica]`); when a new worker is ready it tells each pool's admission
(`CreditQueue.replica_ready`), which places requests on it again. A replica that is not ready takes no new
request: the pools' placement sees it at once (`is_ready`), so while it restarts the other replicas serve.
The client notices a worker's death at once (its pipe's EOF or its process sentinel; `kill -9`, the OOM
killer, a crashed kernel, a failed step) and fails the requests in flight with `EngineDeadError`: 503
`engine_dead`, or an error event then `[DONE]` on a stream. The supervisor then

- logs an ERROR naming the device and the reason (`device worker process exited (signal 9, SIGKILL)`),
- shows the device as `restarting: <reason>` (so `/ready` answers 503) until a new worker has loaded,
- starts the new worker after a back-off (`Backoff`: 1 s, 2 s, 4 s … 30 s; back to 1 s once a worker
  stayed up for `reset_after` seconds), counted in `cliffguard_worker_restarts_total{device,replica}`.

A worker that ends while its replica drains and is then gone for good (a follower sees the replica the leader
drained and removed end so) is logged at INFO, not counted as a restart; a draining replica that crashed (Ray
restarts it) counts as any other. A Ray replica waiting for another config's gateway to give the config claim
back (`config_claim.ClaimPending`) logs each try at INFO.

A worker that is alive but silent is as dead to its clients. The worker sends a heartbeat every half second
from a thread beside its step loop (`engine.worker.HeartbeatThread`), busy or idle, saying how long its
current step has lasted. The watchdog (every `WATCHDOG_INTERVAL` s) kills a loaded worker

- whose heartbeat has been silent for `gateway.stall_seconds`, with or without requests in flight (a `kill
  -STOP`, a process frozen whole): `restarting: stalled: …`, counted in `cliffguard_worker_stalls_total`
  (a Ray replica's connection is dropped and the actor asked through Ray first: restarted only if it does
  not answer there either, a silent connection being maybe a partition from a replica others still use);
- that still beats but whose current step has lasted over `gateway.step_timeout_seconds` (a kernel or a
  collective that never returns): `restarting: hung: …`, counted in `cliffguard_worker_step_timeouts_total`.

A long healthy step (a throughput pool's full prefill chunk on a CPU, a first Triton compile) beats throughout,
so it is never killed before `step_timeout_seconds`. Either way the in-flight requests fail with 503
`engine_dead` naming the reason (or run again: `gateway.completion`), `/ready` answers 503 within
`stall_seconds` plus one watchdog tick, and the worker is restarted as if it had died.

Each death is recorded in the device's `gateway.workers.deaths.DeviceDeaths` (shared by its replicas) with
its cause: a step's failure (`Fatal`), a hang or a stall (the watchdog's verdicts), or a loss (the process
or the connection gone); a request in flight at it reads the record to tell its own deaths from a fault
that took several replicas at once (`gateway.completion`).

Requests that arrive meanwhile wait for a replica (`Gateway.wait_device`), holding nothing, and are served by
the first replica ready: queued, not lost, for up to `gateway.device_wait_seconds` (then 503 with
Retry-After). A local worker that fails its first start (a bad config, a missing model) stays `failed:
<reason>`, and once every replica of a device has, its pools answer 503 `pool_unavailable`; starting it
again would fail the same way. So does a remote replica that reports its load failed (`StartupError`), or
whose cluster the gateway cannot use (`ClusterError`: Ray missing, another config's replicas there). A
remote replica whose first connection failed otherwise (refused, timed out, reset: a partition, an actor
being restarted, a cluster whose head is not up yet: `ClusterUnreachable`) is tried again with the back-off,
as `loading: … (the last try failed: …)`, like a replica that was ready once. One whose loop never takes
the connection in within `start_timeout_seconds`, its heartbeats saying a step has run past
`step_timeout_seconds`, is hung though Ray hears it `ready`: restarted.

A ready worker's pools hear whether it is a new process (`CreditQueue.replica_ready(restarted=True)`: an empty
prefix cache) or a remote one reached again (its cache intact), told by its address, pid and load time.

A fault of the supervisor's own (an admission raising when told a worker is ready, a metric, the death record)
is logged at ERROR with its traceback, and supervision goes on after the back-off: a worker still up is dropped
and replaced (the pools may not have heard it is ready); a supervision task that ends otherwise than by a stop
or a failed first start is logged, the replica shown `failed`.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.stats import WorkerInfo
from engine.client import AsyncEngineClient, EngineDeadError
from engine.remote_client import RemoteEngineClient, ReplicaLink
from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers.config_claim import ClaimPending
from gateway.workers.deaths import HANG, STALL, STOPPED, DeviceDeaths
from gateway.workers.ray_cluster import RECHECK_SECONDS, ClusterError, ClusterUnreachable
from gateway.ticker import Ticker
from pools.pool import Pool
from pools.config.gateway_spec import Backoff

log = logging.getLogger("cliffguard.gateway")

__all__ = ["Backoff", "DeviceSupervisor"]

WATCHDOG_INTERVAL = 0.5   # seconds between the watchdog's looks at the worker
REMOVED_SECONDS = 5.0     # how long the cluster may take to say whether a drained replica was removed
STARTUP_FAILED = "device worker failed to start:"   # how engine.client words a worker's `StartupError`


class DeviceSupervisor:
    """Starts one device's worker, and starts it again with back-off whenever it dies after having loaded
    (a remote replica: also when its first connection failed; the module docstring).

    `client` is the current worker's client (a new one per process); the device's pools always point
    at it. `state` is what `/ready` shows: `loading`, `ready`, `restarting: <reason>` or
    `failed: <reason>`. `wait_ready()` is what requests await before they reach the worker. `deaths`
    is the device's record of its replicas' deaths (one shared by the device's supervisors).
    Event-loop only; `start` once, `stop` once.
    """

    def __init__(self, device: str, config: EngineConfig, pools: Sequence[Pool], metrics: GatewayMetrics,
                 backoff: Backoff = Backoff(), stall_seconds: float = 10.0, replica: int = 0,
                 link: ReplicaLink | None = None, start_seconds: float = 900.0,
                 step_timeout_seconds: float = 600.0, deaths: DeviceDeaths | None = None) -> None:
        self.device = device
        self.replica = replica
        self.name = device if replica == 0 and all(p.num_replicas == 1 for p in pools) else f"{device}/{replica}"
        self.labels = {"device": device, "replica": str(replica)}
        self.config = config
        self.pools = list(pools)
        self.metrics = metrics
        self.backoff = backoff
        self.stall_seconds = stall_seconds              # heartbeat silence that is a stall
        self.step_timeout_seconds = step_timeout_seconds   # one step longer than this is a hang
        self.link = link                  # a replica placed by a cluster manager (Ray), reached over TCP
        self.start_seconds = start_seconds   # a worker not ready by then failed to start
        self.num_stalls = 0                # workers killed for a silent heartbeat
        self.num_step_timeouts = 0         # workers killed for a step over step_timeout_seconds
        self.deaths = deaths if deaths is not None else DeviceDeaths(device)   # the device's, shared by its replicas
        self._watchdog = Ticker(f"cliffguard-watchdog-{self.name}", WATCHDOG_INTERVAL, self.check_stall, log,
                                f"device {self.name}: watchdog check failed")
        self.client: AsyncEngineClient | None = None
        self.num_restarts = 0
        self._was_ready = False                    # some worker of this device loaded once
        self._restart_reason: str | None = None    # why the worker now loading replaces a dead one
        self._failure: str | None = None           # set when the device will not come back
        self._first_failure: str | None = None     # why the last try of a first connection failed
        self._started_at = float("inf")            # when `start` last ran (time.monotonic())
        self._reloaded = False
        self._process: tuple | None = None         # (address, pid, load time) of the last worker ready
        self._changed = asyncio.Condition()        # notified when a worker is ready, or the device failed
        self._task: asyncio.Task | None = None
        self._woken: asyncio.Task | None = None    # `_ended`'s wake-up of the requests waiting for the replica
        self.draining = False                      # the autoscaler is removing it: no new requests
        self._stopping = False                     # `stop` runs: its worker's end is the plan, not a death

    @property
    def started_at(self) -> float:
        """When `start` last ran (time.monotonic(); inf before the first)."""
        return self._started_at

    @property
    def has_loaded(self) -> bool:
        """A worker of this slot was ready since `start` last ran."""
        return self._was_ready

    @property
    def connect_failed(self) -> bool:
        """The last try of this start's first connection failed, and the try now under way has not connected."""
        return self._first_failure is not None and getattr(self.client, "address", "") is None

    @property
    def is_active(self) -> bool:
        """Started and not stopped: a replica the device counts (an autoscaled device parks the rest)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Spawn the first worker; it loads in the background (`wait_ready`). A stopped supervisor may
        be started again (the autoscaler's parked slots)."""
        self._failure, self._was_ready, self._restart_reason, self.draining = None, False, None, False
        self._stopping, self._first_failure, self._started_at = False, None, time.monotonic()
        self._reloaded = False   # `_reload_adopted`: once a start
        self.metrics.worker_restarts.labels(**self.labels)   # exported from the start, at 0
        self.metrics.worker_stalls.labels(**self.labels)
        self.metrics.worker_step_timeouts.labels(**self.labels)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cliffguard-device-{self.name}")
        self._task.add_done_callback(self._ended)
        self._watchdog.start()

    async def stop(self) -> None:
        """Stop supervising and shut the worker down; requests still waiting get EngineDeadError. The state
        says `stopped` from the start (the worker's exit is no `restarting` on /ready and the replicas gauge)."""
        self._stopping = True
        await self._watchdog.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.client is not None:   # recorded first: its requests in flight look for it at once
            self.deaths.record(self.client, self.replica, "the gateway stopped the replica", STOPPED)
            await self.client.shutdown()
        self._failure = self._failure or "the gateway is shutting down"
        self._task = None
        await self._notify()

    # --- what the gateway reads ------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        """A worker is loaded and alive."""
        client = self.client
        return (self._failure is None and client is not None and client.is_alive
                and client.info is not None)

    @property
    def info(self) -> WorkerInfo | None:
        """What the live worker loaded; None while it loads or restarts, or if the device failed."""
        return self.client.info if self.is_ready else None

    @property
    def state(self) -> str:
        """`loading`, `ready`, `draining`, `restarting: <reason>`, `failed: <reason>` or `stopped` (not
        started, or stopped by the autoscaler)."""
        if self._task is None or self._stopping:
            return "stopped"
        if self._failure is not None:
            return f"failed: {self._failure}"
        if self.is_ready:
            return "draining" if self.draining else "ready"
        if self._was_ready:   # the worker died; the reason is known once it is reaped, a moment later
            return f"restarting: {self._restart_reason or 'device worker process exited'}"
        if self.link is None:
            return "loading"
        tried = f" (the last try failed: {self._first_failure})" if self._first_failure else ""
        return f"loading: {self.link.status}{tried}"

    async def wait_ready(self) -> WorkerInfo:
        """What the worker loaded, once a worker is ready: at once, or after it loads or restarts.
        EngineDeadError if the device failed to start (or the gateway is stopping, or the slot was stopped)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.is_ready or self._failure is not None)
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        return self.client.info

    def check_stall(self, now: float | None = None) -> bool:
        """Kill the loaded worker if its heartbeat has been silent for `stall_seconds`, or if its current
        step has lasted over `step_timeout_seconds` (`now`: time.monotonic()); True if it did. The
        supervisor's loop then restarts it."""
        client = self.client
        if client is None or not self.is_ready:
            return False
        silent, step = client.silent_seconds(now), client.step_seconds(now)
        if silent >= self.stall_seconds:
            cause = STALL
            reason = (f"stalled: no word from the device worker for {silent:.1f} s, not even its heartbeat, with "
                      f"{client.num_in_flight} requests in flight (gateway.stall_seconds {self.stall_seconds:g})")
            self.num_stalls += 1
            self.metrics.worker_stalls.labels(**self.labels).inc()
        elif step > self.step_timeout_seconds:
            cause = HANG
            reason = (f"hung: one step of the device worker has run for {step:.1f} s with {client.num_in_flight} "
                      f"requests in flight; its heartbeat still beats (gateway.step_timeout_seconds "
                      f"{self.step_timeout_seconds:g})")
            self.num_step_timeouts += 1
            self.metrics.worker_step_timeouts.labels(**self.labels).inc()
        else:
            return False
        self._restart_reason = reason
        log.error("device %s: %s; killing it", self.name, reason)
        self.deaths.record(client, self.replica, reason, cause)   # before its requests hear of it
        if isinstance(client, RemoteEngineClient):   # silent: restarted only if Ray gets no answer either
            client.kill(reason, unless_responsive=cause == STALL)
        else:
            client.kill(reason)
        return True

    # --- the worker's life -----------------------------------------------------------------------
    async def _run(self) -> None:
        """Supervise worker after worker until stopped (cancelled) or a first start failed for good. A fault
        of the supervisor's own in a round (a pool's admission raising when told a worker is ready, a metric,
        the death record) is logged with its traceback and supervision goes on after the back-off, as a
        `Ticker` goes on after a failed tick: a replica is never left unwatched (`_after_fault`)."""
        attempt = 0   # restarts since a worker last stayed up `reset_after_seconds`
        while self._failure is None:
            try:
                attempt = await self._round(attempt)
            except Exception as exc:  # noqa: BLE001 - a fault of ours must not leave the replica unwatched
                attempt = await self._after_fault(exc, attempt)

    async def _round(self, attempt: int) -> int:
        """One worker's life: start it, wait for its death (or a failed start), back off; the next `attempt`.
        A first start that failed for good sets `_failure` instead."""
        client = self._new_client()
        spawned, planned = time.monotonic(), False
        try:
            info = await client.start(self.start_seconds)
        except Exception as exc:  # noqa: BLE001 - the reason goes to the state, the log and the requests
            if isinstance(exc, TimeoutError) and not str(exc):   # asyncio's says nothing
                exc = TimeoutError("timed out" if self.link is not None else   # a remote connection's own limit
                                   f"not ready within gateway.start_timeout_seconds ({self.start_seconds:g} s)")
            if not self._was_ready and not self._tries_again(exc) and not self._reload_adopted(exc):
                log.error("device %s failed to start: %s", self.name, exc)
                self._failure = f"device {self.name!r} failed to start: {exc}"
                await self._notify()
                await self._release_failed(exc, self._started_at)
                return attempt
            what, reason = "restart failed" if self._was_ready else "first connection failed", str(exc)
            waiting = isinstance(exc, ClaimPending)
            if self._was_ready and self.link is not None and _startup_error(exc):
                # A remote replica's process stays up with its failed load, refusing every connection: only a
                # new process loads again (an out-of-memory while the dead one's ranks held the GPU, say).
                self.link.restart(f"its load failed after a restart: {exc}")
            await self._past_start_limit(client, exc)
        else:
            up_since = time.monotonic()
            attempt = attempt if self._was_ready else 0   # a first start's tries (a cluster starting) are no restarts
            await self._ready(client, info, up_since - spawned)
            what, reason, waiting = "worker died", await self._until_died(client), False
            died_at = time.monotonic()   # the death's time, not the cluster's answer's: losses together stay so
            # A draining replica that is gone for good was removed (a Ray device's leader gateway ended its
            # drain): the plan, not a fault, and no request's death (STOPPED). The watchdog's verdict stays,
            # if it killed it. A wait for another config's gateway (`ClaimPending`) is logged at INFO, and
            # otherwise is a failed try like any other.
            planned = self.draining and await self.removed()
            self.deaths.record(client, self.replica, reason, STOPPED if planned else None, at=died_at)
            if time.monotonic() - up_since >= self.backoff.reset_after_seconds:
                attempt = 0
        delay = max(self.backoff.delay(0 if planned else attempt), RECHECK_SECONDS if waiting else 0.0)   # no spin
        attempt += 0 if planned else 1
        self._note_reason(reason)
        if planned:
            log.info("device %s: the drained replica was removed (%s); connecting again in %.1f s unless the "
                     "autoscaler stops it first", self.name, reason, delay)
        else:
            log.log(logging.INFO if waiting else logging.ERROR, "device %s: %s: %s; %s in %.1f s", self.name,
                    what, reason, "restarting" if self._was_ready else "trying again", delay)
        await asyncio.sleep(delay)
        if self._was_ready and not planned:
            self._count_restart()
        return attempt

    async def _after_fault(self, exc: Exception, attempt: int) -> int:
        """A round raised on a fault of the supervisor's own (the worker's faults are its death): logged once,
        with the traceback. A worker still up is dropped as the gateway's doing (`STOPPED`: no request's
        fault), since the pools may not have heard it is ready (their placement may trust a cache a new
        process lacks): a local one is killed, a remote one's connection dropped (the replica, perhaps
        shared, keeps running and is reached again). Then the back-off, and the next round; returns the
        next `attempt`. A fault in here too ends the task, which `_ended` reports."""
        delay, client = self.backoff.delay(attempt), self.client
        alive = client is not None and client.is_alive
        log.error("device %s: supervising the replica failed (a fault in the gateway, not in its worker)%s; going "
                  "on in %.1f s", self.name, ": its worker is dropped" if alive else "", delay, exc_info=exc)
        if alive:
            reason = f"the gateway's supervision of the replica failed: {type(exc).__name__}: {exc}"
            if isinstance(client, RemoteEngineClient):
                client.lost(reason)
            else:
                client.kill(reason)
            self.deaths.record(client, self.replica, reason, STOPPED)   # before its requests look (they await)
            self._note_reason(reason)
            await asyncio.shield(client.died)   # reaped before the next is spawned, as after any death
        await self._notify()   # `_ready` may have failed before it woke the requests waiting for the worker
        await asyncio.sleep(delay)
        if self._was_ready:
            self._count_restart()
        return attempt + 1

    def _ended(self, task: asyncio.Task) -> None:
        """The supervision task's done-callback. It ends by a stop (cancelled) or once a first start failed
        for good (logged then); any other end (an exception that escaped `_run`, its fault handler's too)
        is logged with its traceback, and the replica is shown failed (`/ready`, the placement) rather
        than left unwatched and seemingly fine."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("device %s: the supervision of the replica ended; its worker will not be restarted", self.name,
                  exc_info=task.exception())
        if self._failure is None:
            self._failure = f"the gateway's supervision of the replica ended: {task.exception()!r}"
        self._woken = asyncio.get_running_loop().create_task(self._notify())

    def _note_reason(self, reason: str) -> None:
        """Why the next worker replaces this one (shown in `state`)."""
        if self._was_ready:
            self._restart_reason = _summary(reason)
        else:
            self._first_failure = _summary(reason)

    def _count_restart(self) -> None:
        self.num_restarts += 1
        self.metrics.worker_restarts.labels(**self.labels).inc()

    async def removed(self) -> bool:
        """Whether this remote replica is gone for good (`ReplicaLink.removed`; False when it cannot say)."""
        removed = getattr(self.link, "removed", None)
        if removed is None:
            return False
        try:
            return await asyncio.wait_for(removed(), REMOVED_SECONDS)
        except Exception:  # noqa: BLE001 - the cluster did not answer: taken for a fault
            return False

    def _reload_adopted(self, exc: Exception) -> bool:
        """A remote replica found with its load failed that this gateway did not place since it started (Ray
        restarted it, another gateway placed it: a passing fault, memory a dead process held) has its process
        restarted to load again, once a start; True then (tried again). Failed for good, it held its GPUs."""
        if self.link is None or not _startup_error(exc) or self._reloaded or \
                getattr(self.link, "placed_at", -math.inf) >= self._started_at:
            return False
        self._reloaded = True
        self.link.restart(f"its load had failed before this gateway reached it: {exc}")
        return True

    async def _release_failed(self, exc: Exception, since: float) -> None:
        """A remote replica whose first load failed: its actor stays up refusing connections, holding its
        placement group's GPUs and CPUs, and its config's claim on the device (a gateway started again on a
        fixed config was refused, `ConfigConflict`). Removed when this gateway placed it since this start (at
        `since`, time.monotonic(); a first start may take several tries), or, leading, restarted it to no avail
        (`_reload_adopted`): no other actor, which may serve other gateways; a next start places it anew."""
        remove = getattr(self.link, "remove", None)
        mine = getattr(self.link, "placed_at", -math.inf) >= since or self._reloaded and self.link.may_place()
        if remove is None or not _startup_error(exc) or not mine:
            return
        try:
            await remove()
            log.info("device %s: removed its replica from the cluster (its load failed)", self.name)
        except Exception:  # noqa: BLE001 - the replica stays failed either way
            log.exception("device %s: removing its failed replica from the cluster failed", self.name)

    async def _past_start_limit(self, client: AsyncEngineClient, exc: Exception) -> None:
        """A remote replica reached but not loaded within `start_seconds`: restarted if its load or its loop hangs
        (module docstring; reconnecting alone waited on it forever), kept if it loaded (the wait was this path's)."""
        check = getattr(self.link, "restart_unless_responsive", None)
        if isinstance(exc, TimeoutError) and check is not None and getattr(client, "address", None) is not None:
            if (step := client.last_step_seconds) > self.step_timeout_seconds:   # its heartbeats, not its Ready
                self.num_step_timeouts += 1   # a hang, as the watchdog's
                self.metrics.worker_step_timeouts.labels(**self.labels).inc()
                return self.link.restart(f"hung: one step has run for {step:.0f} s (gateway.step_timeout_seconds"
                                         f" {self.step_timeout_seconds:g}); it never took this connection in")
            await check(f"not loaded within gateway.start_timeout_seconds ({self.start_seconds:g} s)",
                        loading_hangs=True)

    def _tries_again(self, exc: Exception) -> bool:
        """Whether a first start that failed with `exc` is tried again: only a remote replica's, and not
        when the replica said its load failed (`StartupError`) or the cluster cannot be used at all (a
        cluster that does not answer yet, its head still starting, is tried again)."""
        return self.link is not None and not _startup_error(exc) and (
            not isinstance(exc, ClusterError) or isinstance(exc, ClusterUnreachable))

    async def _ready(self, client: AsyncEngineClient, info: WorkerInfo, took: float) -> None:
        """A worker is ready: log it, export its SLOs, tell the pools' admission (a new process, or the
        same one reached again) and wake the requests waiting for it."""
        log.info("device %s ready%s, %.1f s after its worker was spawned (%.1f s of it loading): %s",
                 self.name, f" again (restart {self.num_restarts})" if self._was_ready else "", took,
                 info.load_seconds, info)
        for pool, slo in info.slos.items():
            self.metrics.pool_slo.labels(pool=pool, target="ttft").set(slo.ttft_ms / 1000)
            self.metrics.pool_slo.labels(pool=pool, target="itl").set(slo.itl_ms / 1000)
        for pool, how in info.slo_derivations.items():
            slo = info.slos[pool]
            log.info("device %s pool %s: isolation by default, slo ttft %g ms, itl %g ms (%s)", self.name, pool,
                     slo.ttft_ms, slo.itl_ms, how)
        self._was_ready, self._restart_reason, self._first_failure = True, None, None
        process = (getattr(client, "address", None), info.pid, info.load_seconds)
        restarted = process != self._process
        for pool in self.pools:
            if pool.admission is not None:
                pool.admission.replica_ready(self.replica, restarted=restarted)
        self._process = process   # once every pool heard: a pool that raised hears `restarted` again next time
        await self._notify()

    async def _until_died(self, client: AsyncEngineClient) -> str:
        """The reason the client's worker died. A remote replica's death is noticed by whichever comes
        first: its connection's loss or the cluster manager's notice (`RemoteEngineClient`)."""
        return await asyncio.shield(client.died)   # a stop cancels this wait, not the client's future

    def _new_client(self) -> AsyncEngineClient:
        """A client for a new worker process, with the device's pools pointed at it. The worker it replaces
        has its last counts taken into the metrics first: one that lived between two scrapes was never counted."""
        if self.client is not None:
            self.metrics.update_replica(self.device, self.replica, self.client, ready=False)
        self.client = RemoteEngineClient(self.config, self.link) if self.link is not None \
            else AsyncEngineClient(self.config)
        for pool in self.pools:
            pool.clients[self.replica] = self.client
        client = self.client
        client.on_lease = lambda pool, tokens: self._lease(client, pool, tokens)
        return client

    def _lease(self, client: AsyncEngineClient, pool_name: str, tokens: int) -> bool:
        """A replica shared by several gateways (`engine.sessions`) leases this gateway `tokens` credits of
        `pool_name`: its admission admits within them from now on, and the client acknowledges the lease
        once what is held there is within it (at once, or as requests there finish)."""
        pool = next((p for p in self.pools if p.name == pool_name and p.admission is not None), None)
        if pool is None:
            return True
        pool.admission.lease(self.replica, tokens, lambda: client.ack_leases([pool_name]))
        return False   # acknowledged by the admission's call, perhaps already

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def _summary(reason: str) -> str:
    """A reason on one line: a traceback's first and last lines (`device worker failed: RuntimeError: …`)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return reason.strip()
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def _startup_error(exc: Exception) -> bool:
    """The worker (or the remote replica) said its load failed (`StartupError`)."""
    return type(exc) is RuntimeError and str(exc).startswith(STARTUP_FAILED)
