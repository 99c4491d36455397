"""`Autoscaler`: replicas added when a device's pools wait for KV credits, removed when one idles.

The capacity formula gives each replica its pools' KV credits; requests past them queue at the
gateway (`pools.credits.queue`), never refused. A device with `replicas: {min, max}` has `max` replica
slots, `min` of them started. Every `INTERVAL` seconds, for each such device:

- **Up.** When some request of the device's pools has waited for credits longer than
  `scale_up_wait_seconds` (the formula's concurrency is exceeded: what is admitted fills every
  replica's KV; batch lines and patient requests wait by design and are not counted, nor a request that fits
  now and waits for the replica caching its prompt), or for any replica to be ready (none serves: one
  crash-loops), or one was refused for credits (`max_queue_seconds` 0 or past it) in the last
  `REFUSED_SECONDS` and no replica came up since, or the device is overloaded and short of replicas
  (`gateway.monitoring.overload`: its pools' arrivals ask more of its ready replicas than the step-cost
  model says they can do, with requests waiting for their first token: a compute-bound device whose KV
  never fills; `short_of_replicas`: the load needs more replicas than are ready), and no replica of the
  device is still loading (but an adopted one this gateway cannot connect to), the lowest
  parked slot is started (on Ray, a placement group is created; one Ray cannot place stays pending,
  which is how Ray's cluster autoscaler learns that a node is needed). A replica being drained is taken
  back first instead. The wait bound, 2 s by default, is long enough that a burst one replica absorbs
  within a decode or two does not start a replica (loading one takes seconds to minutes), short enough
  that a queue that keeps growing is answered well inside a client's timeout.
- **Down.** A serving replica (ready, not draining) that has held no credits and had no request in
  flight for `scale_down_idle_seconds` (60 s by default), while nothing waits for credits, is drained: it
  takes no new request (`DeviceSupervisor.draining`), and once what it holds is released (a request admitted
  just before is waited for) its worker is shut down and, on Ray, its actor and placement group removed. So is
  one whose load the other serving replicas would carry at most half full (`SPARE_FRACTION`: the credits held,
  the sequences running and the offered load's replicas' worth of time) for that long, busy or not: each request
  goes to the least loaded replica, so a light steady load keeps every replica busy, and a device scaled up in
  a morning's burst stayed at its most all day; its requests in flight finish before it stops (not on a device
  shared by several gateways, which judges idle time only). Only the highest serving slot is drained, and only
  while `min` replicas serve without it: a loading, restarting or failed replica serves nothing, so it
  never stands in for one. Its idle time counts from when it last became ready (a replica that restarts
  starts anew). A replica still loading in a slot past `min` (a placement group Ray cannot place, a long
  load) that no request waited for during `scale_down_idle_seconds`, while `min` replicas serve, is not
  needed: it is removed the same way, before any serving one.

A device on Ray may be shared by several gateways of one config: one of them decides, the holder of
the device's scaling lease (`gateway.workers.scaler_lease`, renewed every tick, each renewal carrying
this gateway's reason to scale up). The leader decides as above, taking the other gateways' reasons
as its own, and only it places replicas (`RayReplica.may_place`). A replica it drains is removed only
if it is idle in its own counts (`AsyncEngineClient.stats().num_requests`: every gateway's requests):
once this gateway's requests have left it, a replica that still counts some is kept (its idle time
counts anew); else the drain is announced through the lease (every gateway sends it nothing new), and
`ANNOUNCE_SECONDS` later, once its count is 0, it is removed. A follower places and removes nothing:
each tick it starts the parked slots whose actor is alive (the supervisor connects to it), stops the
started ones whose actor the leader removed, and drains the ones the leader drains; its `min` slots
stay started, waiting for the leader to place them. The leader also connects to a live actor of a slot
it has parked (one a previous leader placed as it lost the lease).

`cliffguard_replicas{device,state}` counts every device's replicas by state, autoscaled or not, and
`cliffguard_replica_scalings_total{device,direction}` the changes this gateway decided (a follower's
counts stay at 0). Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

from engine.client import EngineDeadError
from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers.scaler_lease import ScalerLease, device_lease
from gateway.workers.supervisor import DeviceSupervisor
from gateway.ticker import Ticker
from pools.pool import Pool
from pools.config.spec import DeviceSpec

log = logging.getLogger("cliffguard.gateway")

__all__ = ["Autoscaler", "INTERVAL", "REPLICA_STATES"]

INTERVAL = 0.5   # seconds between looks
REPLICA_STATES = ("ready", "loading", "draining", "restarting", "failed", "stopped")
DRAIN_POLL = 0.1   # seconds between looks at a draining replica's credits
REPLICA_POLL = 0.5   # seconds between asks of a shared replica's own request count, while it drains
ANNOUNCE_SECONDS = 2.0   # a word through the lease reaches every gateway (a tick and renewals) within this
STATS_SECONDS = 10.0   # a replica that does not say its request count by then is in a long step: it has work
REFUSED_SECONDS = 1.0   # a refusal for capacity asks for a replica during this long (two looks)
RETRY_FAILED_SECONDS = 60.0   # a replica it added whose load failed may be started again after this long
SPARE_FRACTION = 0.5   # a load the serving replicas but one carry at most this full spares the last (`_spare`)


class Autoscaler:
    """Adds and removes the replicas of autoscaled devices; exports every device's replica states."""

    def __init__(self, devices: Mapping[str, DeviceSpec], supervisors: Mapping[str, list[DeviceSupervisor]],
                 pools: Mapping[str, Pool], metrics: GatewayMetrics,
                 overloaded: Callable[[], Mapping[str, str]] = dict,
                 leases: Mapping[str, ScalerLease] | None = None,
                 device_wait: Callable[[str, float], float] = lambda device, now: 0.0,
                 offered: Callable[[str], float | None] = lambda device: None) -> None:
        self.devices = devices
        self.overloaded = overloaded   # device -> reason, for the devices overloaded now (gateway.monitoring.overload)
        self.offered = offered   # device -> the replicas' worth of time its offered load asks (None: not known)
        self.device_wait = device_wait   # (device, now) -> the longest a request waits for any replica to be ready
        self.supervisors = supervisors
        self.pools = {device: [p for p in pools.values() if p.device == device] for device in supervisors}
        self.metrics = metrics
        self.leases = dict(leases or {})   # device on Ray -> its scaling lease (made at `start` when not given)
        self._idle_since: dict[tuple[str, int], float] = {}   # serving slots only: idle since then
        self._num_ready: dict[str, int] = {}   # device -> its ready replicas at the last look
        self._grown_at: dict[str, float] = {}   # device -> when a replica last came up
        self._unneeded_since: dict[tuple[str, int], float] = {}   # loading slots past `min`: nothing pressed since
        self._removals: dict[tuple[str, int], asyncio.Task] = {}   # until the removal has ended, however it ends
        self._finishing: set[tuple[str, int]] = set()   # removals past taking back: stopping or removing it
        self._stopped_at: dict[tuple[str, int], float] = {}   # monotonic: when this gateway last stopped a slot
        self._announced: set[tuple[str, int]] = set()   # drains of shared replicas the followers are told of
        self._added: set[tuple[str, int]] = set()   # slots this autoscaler started
        self._failed_since: dict[tuple[str, int], float] = {}   # those of them whose load failed: seen since
        self._ticker = Ticker("cliffguard-autoscaler", INTERVAL, self.tick, log, "autoscaler: tick failed")
        self._frozen = False   # the gateway is stopping: nothing is started or drained any more
        self._releasing: asyncio.Future | None = None   # the leases handed back as it froze

    def start(self) -> None:
        """Export the counters, make each Ray device's scaling lease (its replicas place only while this
        gateway leads), tick once and keep ticking."""
        for device, slots in self.supervisors.items():
            for direction in ("up", "down"):
                self.metrics.replica_scalings.labels(device=device, direction=direction)
            lease = self.leases.get(device) or device_lease(device, [s.link for s in slots])
            if lease is not None:
                self.leases[device] = lease
                for s in slots:
                    s.link.may_place, s.link.lease_failure = lease.is_leader, lambda lease=lease: lease.failure
        self.tick()
        self._ticker.start()

    async def freeze(self) -> None:
        """The gateway's drain has begun (SIGTERM): no replica is started or drained from now on. A queue still
        pressing then started a model load only for the stop to kill it, or on Ray a detached actor that the stop
        caught in its creation and left holding GPUs after the gateway had gone. Its scaling leases go back at
        once: another gateway leads at its next renewal, not once the renewals stopped here have let it lapse
        (`LEASE_SECONDS` in which no gateway decided anything, while this one drained). Handed back in the
        background: a cluster that does not answer (`CALL_SECONDS`) holds up no drain; `stop` waits for it."""
        self._frozen = True
        await self._ticker.stop()
        for lease in self.leases.values():
            lease.resign()   # no slot places from now on, whenever the actor hears of it
        self._releasing = self._hand_back()

    async def stop(self) -> None:
        await self._ticker.stop()
        for task in self._removals.values():
            task.cancel()
        await asyncio.gather(*self._removals.values(), return_exceptions=True)
        await (self._releasing or self._hand_back())   # (frozen: handed back already, or on their way)

    def _hand_back(self) -> asyncio.Future:
        """Release every scaling lease (another gateway leads at its next renewal); a failure lets it expire."""
        return asyncio.gather(*(lease.release() for lease in self.leases.values()), return_exceptions=True)

    def tick(self, now: float | None = None) -> None:
        if self._frozen:
            return
        now = time.monotonic() if now is None else now
        for device, slots in self.supervisors.items():
            spec, lease = self.devices[device], self.leases.get(device)
            why, wait = self._pressure(device, spec, slots, now) if spec.autoscaled else (None, 0.0)
            if lease is not None:
                lease.poke(why, sorted(r for (d, r) in self._announced if d == device))
                if not lease.is_leader():
                    self._forget_clocks(device)   # a follower decides nothing: leading again, it counts anew
                    if spec.autoscaled:
                        self._follow(device, spec, slots, lease)
                    continue
                why = why or self._remote_pressure(device, lease, now)   # another gateway's queue counts too
                for s in slots:   # drains the previous leader asked for end with its lead
                    if s.draining and (device, s.replica) not in self._removals:
                        self._undrain(device, s)
                if spec.autoscaled:
                    self._start_placed(device, slots, lease)   # one a previous leader placed late
            self._note_failed(device, slots, now)
            if spec.autoscaled and (why is None or not self._scale_up(device, slots, why, now)):
                self._scale_down(device, spec, slots, pressed=why is not None or wait > 0, now=now)
        self.export()

    def _pressure(self, device: str, spec: DeviceSpec, slots: list[DeviceSupervisor],
                  now: float) -> tuple[str | None, float]:
        """(why the device needs another replica now, or None; the longest credit wait in seconds). A
        refusal for capacity counts until `REFUSED_SECONDS` after it, unless a replica came up since."""
        ready = sum(s.is_ready for s in slots)
        if ready > self._num_ready.get(device, ready):
            self._grown_at[device] = now
        self._num_ready[device] = ready
        wait = self.credit_wait(device, now)
        if wait > spec.scale_up_wait_seconds:
            return f"a request waited {wait:.1f} s for KV credits (over {spec.scale_up_wait_seconds:g} s)", wait
        if (ready_wait := self.device_wait(device, now)) > spec.scale_up_wait_seconds:   # none serves (a crash loop)
            return (f"a request waited {ready_wait:.1f} s for a replica to be ready (over "
                    f"{spec.scale_up_wait_seconds:g} s)"), wait
        refused = max((p.admission.refused_at for p in self.pools[device]
                       if p.admission is not None and p.admission.refused_at is not None), default=None)
        if refused is not None and now - refused <= REFUSED_SECONDS and refused > self._grown_at.get(device, -1e300):
            return (f"a request was refused for KV credits {max(0.0, now - refused):.1f} s ago (its pool's "
                    "max_queue_seconds)"), wait
        return self.overloaded().get(device), wait

    def _remote_pressure(self, device: str, lease: ScalerLease, now: float) -> str | None:
        """Another gateway's reason for a replica (the lease's view of it), unless the device grew less than
        ANNOUNCE_SECONDS ago: the word, said before the new replica served that gateway, takes a tick and two
        renewals to clear (it started one more replica each time a follower's queue had asked for one)."""
        return lease.view.pressure if now - self._grown_at.get(device, -math.inf) >= ANNOUNCE_SECONDS else None

    def credit_wait(self, device: str, now: float | None = None) -> float:
        """The longest a request of the device's pools has now waited for credits (seconds)."""
        return max((p.admission.oldest_credit_wait(now) for p in self.pools[device] if p.admission is not None),
                   default=0.0)

    def _note_failed(self, device: str, slots: list[DeviceSupervisor], now: float) -> None:
        """When each slot past `min` failed (one it added, or adopted from the cluster: `_start_placed`), for
        `_scale_up`'s retry; a `min` slot that failed stays so (the gateway's own start: a config none loads)."""
        for s in slots:
            key = (device, s.replica)
            if (key in self._added or s.replica >= self.devices[device].initial_replicas) and \
                    s.state.startswith("failed"):
                self._failed_since.setdefault(key, now)
            else:
                self._failed_since.pop(key, None)

    def _scale_up(self, device: str, slots: list[DeviceSupervisor], why: str, now: float) -> bool:
        """Take back a drain, else start a parked slot: a stopped one, or one past `min` whose load failed
        `RETRY_FAILED_SECONDS` ago (memory a dead process held, a node's passing fault; one it adopted from the
        cluster too: it held its GPUs, failed, for good; the replicas of the gateway's own start that failed stay
        so: a config no start would load)."""
        if self._take_back(device, slots, why):
            return True
        if any(s.state.startswith("loading") and not self._unreachable_adopted(device, s) for s in slots):
            return False   # one is on its way: give it time before asking for another
        failed = self._failed_since   # a failed one once its supervisor is done (removing what it placed)
        parked = [s for s in slots if (s.state == "stopped" or now - failed.get((device, s.replica), now)
                                       >= RETRY_FAILED_SECONDS and not s.is_active)
                  and (device, s.replica) not in self._removals]
        if not parked:
            return False
        supervisor = parked[0]
        log.info("autoscaler: device %s: %s; starting replica %s", device, why, supervisor.name)
        supervisor.start()
        self._added.add((device, supervisor.replica))
        failed.pop((device, supervisor.replica), None)   # a start that fails again waits its own while
        self.metrics.replica_scalings.labels(device=device, direction="up").inc()
        return True

    def _unreachable_adopted(self, device: str, supervisor: DeviceSupervisor) -> bool:
        """A shared slot this gateway connected to without starting it (not a `min` slot, nor one its scale-up
        started: `_start_placed`'s adoption of an actor another gateway placed) whose connection fails: it may
        never load here, so it is no replica on its way (one this gateway started is, failing or not)."""
        return device in self.leases and supervisor.connect_failed and not _placed_here(supervisor) and \
            (device, supervisor.replica) not in self._added and \
            supervisor.replica >= self.devices[device].initial_replicas

    def _take_back(self, device: str, slots: list[DeviceSupervisor], why: str, *, ready_only: bool = False) -> bool:
        """Take back the first drain not past taking back (`ready_only`: of a replica that serves once taken back);
        False if there is none."""
        back = [s for s in slots if s.draining and (s.is_ready or not ready_only)
                and (device, s.replica) in self._removals and (device, s.replica) not in self._finishing]
        if not back:
            return False
        self._removals.pop((device, back[0].replica)).cancel()
        self._undrain(device, back[0])
        log.info("autoscaler: device %s: %s; keeping replica %s", device, why, back[0].name)
        return True

    def _undrain(self, device: str, supervisor: DeviceSupervisor) -> None:
        """A drained replica serves again: whoever waits for credits may go there now, not at the next event."""
        supervisor.draining = False
        for pool in self.pools[device]:
            if pool.admission is not None:
                pool.admission.replica_ready(supervisor.replica, restarted=False)

    def _scale_down(self, device: str, spec: DeviceSpec, slots: list[DeviceSupervisor], *, pressed: bool,
                    now: float) -> None:
        """Drain at most one replica: a loading one past `min` (or restarting, unshared: a crash loop, a group no
        node has room for) that is not needed, else the highest serving one once idle (or spare: `_spare`) for
        `scale_down_idle_seconds`; either only while `min` replicas serve without it.
        `pressed`: something waits for credits, or the device is overloaded: no replica is idle."""
        serving = [s for s in slots if s.is_ready and not s.draining]
        if len(serving) < spec.initial_replicas and self._take_back(device, slots, "fewer than min replicas serve",
                                                                     ready_only=True):
            return   # one crashed: a drain not past taking back serves again
        lease = self.leases.get(device)   # a shared slot loading for this gateway only is its own placement's
        starting = ("loading", "restarting") if lease is None else ("loading",)   # a shared one restarting: Ray's
        loading = [s for s in slots if s.state.startswith(starting) and not s.draining
                   and s.replica >= spec.initial_replicas and (lease is None or _placed_here(s))]
        self._count_idle(device, slots, serving, loading, pressed=pressed, now=now)
        limit = spec.scale_down_idle_seconds
        unneeded = [s for s in loading if now - self._unneeded_since[(device, s.replica)] >= limit]
        if unneeded and len(serving) >= spec.initial_replicas:
            victim = max(unneeded, key=lambda s: s.replica)
            log.info("autoscaler: device %s: replica %s does not serve yet (%s) and no request waited for %.0f s; "
                     "removing it", device, victim.name, victim.state.split(":")[0], limit)
        elif len(serving) > spec.initial_replicas:   # `min` still serve without the victim
            victim = max(serving, key=lambda s: s.replica)
            idle = now - self._idle_since[(device, victim.replica)]
            if idle < limit:
                return
            log.info("autoscaler: device %s: replica %s idle for %.0f s (or its load fits the others at most "
                     "%.0f%% full); draining it", device, victim.name, idle, 100 * SPARE_FRACTION)
        else:
            return
        victim.draining = True
        self._idle_since.pop((device, victim.replica), None)
        self._unneeded_since.pop((device, victim.replica), None)
        self._removals[(device, victim.replica)] = asyncio.ensure_future(self._remove(device, victim))

    def _count_idle(self, device: str, slots: list[DeviceSupervisor], serving: list[DeviceSupervisor],
                    loading: list[DeviceSupervisor], *, pressed: bool, now: float) -> None:
        """Each serving slot's idle clock, each loading slot's (past `min`) unneeded clock: restarted when
        `pressed` (or the replica is busy), dropped for every other slot, so that a replica that stops
        serving (restarts, reloads) counts anew once it serves again."""
        top = max(serving, key=lambda s: s.replica, default=None)   # the one a drain would take
        spare = top is not None and not pressed and self._spare(device, serving)
        for s in slots:
            key = (device, s.replica)
            if s in serving and (pressed or self._busy(device, s) and not (s is top and spare)):
                self._idle_since[key] = now
            elif s in serving:
                self._idle_since.setdefault(key, now)
            else:
                self._idle_since.pop(key, None)
            if s in loading:
                self._unneeded_since[key] = now if pressed else self._unneeded_since.get(key, now)
            else:
                self._unneeded_since.pop(key, None)

    def _spare(self, device: str, serving: list[DeviceSupervisor]) -> bool:
        """Whether the serving replicas but one would carry the device's load at most SPARE_FRACTION full: the
        credits held and the sequences running there (its pools' ledgers) and, where known, the offered load's
        replicas' worth of time. A light steady load keeps every replica busy (each request goes to the least
        loaded one), so that, counted as idle time alone, a device scaled up in a burst never scaled down. Not on
        a device shared by several gateways (a lease): each sees its own requests only, and its idle rule asks the
        replica for every gateway's."""
        fewer = len(serving) - 1
        ledgers = [p.admission.ledger for p in self.pools[device] if p.admission is not None]
        if fewer < 1 or not ledgers or device in self.leases:   # (shared: this gateway sees its own load only)
            return False
        top = max(serving, key=lambda s: s.replica)
        for ledger in ledgers:
            accounts = [ledger.accounts[s.replica] for s in serving]
            others = [ledger.accounts[s.replica] for s in serving if s is not top]   # what stays (leases differ)
            if sum(a.held + a.outside for a in accounts) > SPARE_FRACTION * sum(a.total for a in others):
                return False
            seqs = accounts[0].max_seqs
            if seqs is not None and sum(a.num_seqs for a in accounts) > SPARE_FRACTION * fewer * seqs:
                return False
        offered = self.offered(device)
        return offered is None or offered <= SPARE_FRACTION * fewer

    def _forget_clocks(self, device: str) -> None:
        for clocks in (self._idle_since, self._unneeded_since):
            for key in [k for k in clocks if k[0] == device]:
                del clocks[key]

    def _follow(self, device: str, spec: DeviceSpec, slots: list[DeviceSupervisor], lease: ScalerLease) -> None:
        """A follower's tick: start the parked slots whose actor is alive (placed by the leader), stop the
        started ones whose actor is gone (removed by it), drain the ones it drains. The `min` slots stay
        started (the leader keeps them placed)."""
        if lease.live is None:
            return   # not listed yet
        self._start_placed(device, slots, lease)
        for s in slots:
            if (device, s.replica) in self._removals or s.state == "stopped":
                continue
            gone = s.replica not in lease.live and s.replica >= spec.initial_replicas
            if gone and (getattr(s.link, "placing", False) or getattr(s.link, "placed_at", -math.inf) >= lease.live_at):
                continue   # this gateway, leader until just now, is placing it: its actor is not listed yet
            if gone:
                log.info("autoscaler: device %s: the leader gateway removed replica %s; stopping it", device, s.name)
                s.draining = True
                self._removals[(device, s.replica)] = asyncio.ensure_future(self._remove(device, s, decided=False))
            elif s.draining and s.replica not in lease.view.draining:
                self._undrain(device, s)   # the leader kept it
            else:
                s.draining = s.replica in lease.view.draining

    def _start_placed(self, device: str, slots: list[DeviceSupervisor], lease: ScalerLease) -> None:
        """Start (connect to) each parked slot whose actor was listed alive after this gateway last stopped it."""
        for s in slots:
            key = (device, s.replica)
            if s.state == "stopped" and key not in self._removals and s.replica in (lease.live or ()) \
                    and lease.live_at > self._stopped_at.get(key, float("-inf")):
                log.info("autoscaler: device %s: replica %s is on the cluster; connecting to it", device, s.name)
                s.start()

    def _busy(self, device: str, supervisor: DeviceSupervisor) -> bool:
        """The replica holds credits or has a request in flight (of this gateway)."""
        client = supervisor.client
        if client is not None and client.num_in_flight:
            return True
        return any(p.admission is not None and p.admission.ledger.accounts[supervisor.replica].held
                   for p in self.pools[device])

    async def _remove(self, device: str, supervisor: DeviceSupervisor, *, decided: bool = True) -> None:
        """Wait until the drained replica holds nothing, then stop it and, when this gateway `decided` so,
        remove it from the cluster. A shared replica (a lease) is removed only if it is idle for every
        gateway (`_drain_shared`); else it is kept, and its idle time counts again from now."""
        key = (device, supervisor.replica)
        lease = self.leases.get(device) if decided else None
        try:
            while self._busy(device, supervisor):
                await asyncio.sleep(DRAIN_POLL)
            if lease is not None and not await self._drain_shared(supervisor, lease):
                self._undrain(device, supervisor)
                log.info("autoscaler: device %s: replica %s serves other gateways' requests, or this gateway "
                         "no longer leads; keeping it", device, supervisor.name)
                return
            others = sum(s.is_ready and not s.draining for s in self.supervisors[device] if s is not supervisor)
            if decided and supervisor.is_ready and others < self.devices[device].initial_replicas:
                self._undrain(device, supervisor)   # another crashed while it drained: `min` must still serve
                log.info("autoscaler: device %s: fewer than min replicas serve without replica %s now; keeping it",
                         device, supervisor.name)
                return
            # past taking back: the slot stays in `_removals` (not started again, nor connected to) until the
            # worker is stopped and the actor and group are gone, or the removal failed
            self._finishing.add(key)
            self._stopped_at[key] = float("inf")   # no listing asked for before the actor is gone counts
            if decided:   # counted as the slot starts to read "stopped": a scrape never shows one without the other
                self.metrics.replica_scalings.labels(device=device, direction="down").inc()
            try:
                await supervisor.stop()
                if decided and supervisor.link is not None:
                    await supervisor.link.remove()
            finally:
                supervisor.draining = False
                self._stopped_at[key] = time.monotonic()
            log.info("autoscaler: device %s: replica %s stopped", device, supervisor.name)
        except Exception:
            log.exception("autoscaler: device %s: removing replica %s failed", device, supervisor.name)
        finally:
            self._announced.discard(key)
            if self._removals.get(key) is asyncio.current_task():
                self._removals.pop(key)
                self._finishing.discard(key)

    async def _drain_shared(self, supervisor: DeviceSupervisor, lease: ScalerLease) -> bool:
        """The leader's drain of a shared replica, once this gateway's requests left it: True when it may
        be removed. False at once if the replica still counts requests (other gateways'); else the drain
        is announced (the followers send it nothing new), and `ANNOUNCE_SECONDS` after the lease actor has it
        (its answer to this gateway lists the drain: a renewal in flight could hold the word back for seconds)
        it is removable once its count is 0 — False if this gateway stops leading first."""
        key = (supervisor.device, supervisor.replica)
        if await self._num_requests(supervisor) != 0:   # some, or it cannot be asked: kept, and serves again
            return False
        self._announced.add(key)
        while lease.is_leader() and supervisor.replica not in lease.view.draining:
            await asyncio.sleep(REPLICA_POLL)
        await asyncio.sleep(ANNOUNCE_SECONDS)
        while lease.is_leader():
            if (count := await self._num_requests(supervisor)) is None:
                return False
            if not count:
                return lease.is_leader()
            await asyncio.sleep(REPLICA_POLL)
        return False

    @staticmethod
    async def _num_requests(supervisor: DeviceSupervisor) -> int | None:
        """The requests in flight on the replica as it counts them (every gateway's); 0 for one this gateway
        placed that is still loading (it serves no gateway yet, and answers nothing till loaded) or whose
        actor is gone from the cluster; None for one this gateway cannot reach otherwise (other gateways may
        be served by it: an adopted actor, one that served before the connection broke, or one whose
        connection died under the question, a partition the watchdog cut: never removed on a guess); at least 1
        for one that does not answer within `STATS_SECONDS` (it answers between steps: one that long has work,
        other gateways' perhaps; a hang is the watchdog's to judge)."""
        client = supervisor.client
        if client is None or not client.is_alive or client.info is None:
            return 0 if _placed_here(supervisor) and not supervisor.has_loaded else None
        try:
            return (await asyncio.wait_for(client.stats(), STATS_SECONDS)).num_requests
        except EngineDeadError:   # this gateway's connection died: its actor may live on for the others
            return 0 if await supervisor.removed() else None
        except TimeoutError:
            return max(1, client.latest_stats.num_requests if client.latest_stats is not None else 1)

    def export(self) -> None:
        """`cliffguard_replicas{device,state}` as the supervisors say now (each tick, and each scrape)."""
        for device, slots in self.supervisors.items():
            counts = dict.fromkeys(REPLICA_STATES, 0)
            for s in slots:
                state = s.state.partition(":")[0]
                counts[state if state in counts else "loading"] += 1
            for state, count in counts.items():
                self.metrics.replicas.labels(device=device, state=state).set(count)


def _placed_here(supervisor: DeviceSupervisor) -> bool:
    """Whether this gateway placed the slot's actor since it last started the slot (`RayLink.placing`,
    `placed_at`): not one it adopted from the cluster, which may serve other gateways while this one cannot
    reach it."""
    link = supervisor.link
    return bool(getattr(link, "placing", False)) or getattr(link, "placed_at", -math.inf) >= supervisor.started_at
