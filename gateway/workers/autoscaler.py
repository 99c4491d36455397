"""`Autoscaler`: replicas added when a device's pools wait for KV credits, removed when one idles.

The capacity formula gives each replica its pools' KV credits; requests past them queue at the
gateway (`pools.credits.queue`), never refused. A device with `replicas: {min, max}` has `max` replica
slots, `min` of them started. Every `INTERVAL` seconds, for each such device:

- **Up.** When some request of the device's pools has waited for credits longer than
  `scale_up_wait_seconds` (the formula's concurrency is exceeded: what is admitted fills every
  replica's KV), or the device is overloaded (`gateway.monitoring.overload`: its pools' arrivals ask more of its
  ready replicas than the step-cost model says they can do, with requests waiting for their first
  token: a compute-bound device whose KV never fills), and no replica of the device is still loading,
  the lowest parked slot is started (on
  Ray, a placement group is created; one Ray cannot place stays pending, which is how Ray's cluster
  autoscaler learns that a node is needed). A replica being drained is taken back first instead. The
  wait bound, 2 s by default, is long enough that a burst one replica absorbs within a decode or two
  does not start a replica (loading one takes seconds to minutes), short enough that a queue that
  keeps growing is answered well inside a client's timeout.
- **Down.** A started replica that has held no credits and had no request in flight for
  `scale_down_idle_seconds` (60 s by default), while nothing waits for credits, is drained: it takes no
  new request (`DeviceSupervisor.draining`), and once what it holds is released (it holds nothing at
  that point, and a request admitted just before is waited for) its worker is shut down and, on Ray,
  its actor and placement group removed. The highest started slot goes first; never below `min`.

`cliffguard_replicas{device,state}` counts every device's replicas by state, autoscaled or not, and
`cliffguard_replica_scalings_total{device,direction}` the changes. Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers.supervisor import DeviceSupervisor
from gateway.ticker import Ticker
from pools.pool import Pool
from pools.config.spec import DeviceSpec

log = logging.getLogger("cliffguard.gateway")

__all__ = ["Autoscaler", "INTERVAL", "REPLICA_STATES"]

INTERVAL = 0.5   # seconds between looks
REPLICA_STATES = ("ready", "loading", "draining", "restarting", "failed", "stopped")
DRAIN_POLL = 0.1   # seconds between looks at a draining replica's credits


class Autoscaler:
    """Adds and removes the replicas of autoscaled devices; exports every device's replica states."""

    def __init__(self, devices: Mapping[str, DeviceSpec], supervisors: Mapping[str, list[DeviceSupervisor]],
                 pools: Mapping[str, Pool], metrics: GatewayMetrics,
                 overloaded: Callable[[], Mapping[str, str]] = dict) -> None:
        self.devices = devices
        self.overloaded = overloaded   # device -> reason, for the devices overloaded now (gateway.monitoring.overload)
        self.supervisors = supervisors
        self.pools = {device: [p for p in pools.values() if p.device == device] for device in supervisors}
        self.metrics = metrics
        self._idle_since: dict[tuple[str, int], float] = {}
        self._removals: dict[tuple[str, int], asyncio.Task] = {}
        self._ticker = Ticker("cliffguard-autoscaler", INTERVAL, self.tick, log, "autoscaler: tick failed")

    def start(self) -> None:
        for device in self.supervisors:
            for direction in ("up", "down"):
                self.metrics.replica_scalings.labels(device=device, direction=direction)
        self.tick()
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
        for task in self._removals.values():
            task.cancel()
        await asyncio.gather(*self._removals.values(), return_exceptions=True)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for device, slots in self.supervisors.items():
            spec = self.devices[device]
            if spec.autoscaled:
                wait = self.credit_wait(device, now)
                why = self.overloaded().get(device)
                if wait > spec.scale_up_wait_seconds:
                    why = (f"a request waited {wait:.1f} s for KV credits (over {spec.scale_up_wait_seconds:g} s)")
                if why is None or not self._scale_up(device, slots, why):
                    self._scale_down(device, spec, slots, pressed=why is not None or wait > 0, now=now)
        self.export()

    def credit_wait(self, device: str, now: float | None = None) -> float:
        """The longest a request of the device's pools has now waited for credits (seconds)."""
        return max((p.admission.oldest_credit_wait(now) for p in self.pools[device] if p.admission is not None),
                   default=0.0)

    def _scale_up(self, device: str, slots: list[DeviceSupervisor], why: str) -> bool:
        draining = [s for s in slots if s.state == "draining" and (device, s.replica) in self._removals]
        if draining:
            supervisor = draining[0]
            self._removals.pop((device, supervisor.replica)).cancel()
            supervisor.draining = False
            log.info("autoscaler: device %s: %s; keeping replica %s", device, why, supervisor.name)
            return True
        if any(s.state.startswith("loading") for s in slots):
            return False   # one is on its way: give it time before asking for another
        parked = [s for s in slots if s.state == "stopped" and (device, s.replica) not in self._removals]
        if not parked:
            return False
        supervisor = parked[0]
        log.info("autoscaler: device %s: %s; starting replica %s", device, why, supervisor.name)
        supervisor.start()
        self.metrics.replica_scalings.labels(device=device, direction="up").inc()
        return True

    def _scale_down(self, device: str, spec: DeviceSpec, slots: list[DeviceSupervisor], *, pressed: bool,
                    now: float) -> None:
        """`pressed`: something waits for credits, or the device is overloaded: no replica is idle."""
        serving = [s for s in slots if s.is_ready and not s.draining]
        for s in serving:
            if pressed or self._busy(device, s):
                self._idle_since[(device, s.replica)] = now
            else:
                self._idle_since.setdefault((device, s.replica), now)
        started = [s for s in slots if s.state != "stopped" and not s.draining]
        if len(started) <= spec.initial_replicas or not serving:
            return
        victim = max(serving, key=lambda s: s.replica)
        idle = now - self._idle_since[(device, victim.replica)]
        if idle < spec.scale_down_idle_seconds:
            return
        log.info("autoscaler: device %s: replica %s idle for %.0f s; draining it", device, victim.name, idle)
        victim.draining = True
        self._idle_since.pop((device, victim.replica), None)
        self._removals[(device, victim.replica)] = asyncio.ensure_future(self._remove(device, victim))

    def _busy(self, device: str, supervisor: DeviceSupervisor) -> bool:
        """The replica holds credits or has a request in flight."""
        client = supervisor.client
        if client is not None and client.num_in_flight:
            return True
        return any(p.admission is not None and p.admission.ledger.accounts[supervisor.replica].held
                   for p in self.pools[device])

    async def _remove(self, device: str, supervisor: DeviceSupervisor) -> None:
        """Wait until the drained replica holds nothing, then stop it (and remove it from the cluster)."""
        while self._busy(device, supervisor):
            await asyncio.sleep(DRAIN_POLL)
        self._removals.pop((device, supervisor.replica), None)
        await supervisor.stop()
        supervisor.draining = False
        if supervisor.link is not None:
            await supervisor.link.remove()
        self.metrics.replica_scalings.labels(device=device, direction="down").inc()
        log.info("autoscaler: device %s: replica %s stopped", device, supervisor.name)

    def export(self) -> None:
        """`cliffguard_replicas{device,state}` as the supervisors say now (each tick, and each scrape)."""
        for device, slots in self.supervisors.items():
            counts = dict.fromkeys(REPLICA_STATES, 0)
            for s in slots:
                state = s.state.partition(":")[0]
                counts[state if state in counts else "loading"] += 1
            for state, count in counts.items():
                self.metrics.replicas.labels(device=device, state=state).set(count)
