"""`OverloadWatch`: each device's offered load against what it can serve, said out loud.

Every `OVERLOAD_INTERVAL` seconds, per device with local pools, the watch builds a `pools.demand.DeviceLoad`
from what the gateway and the device's workers know, and feeds the device's `OverloadDetector`:

- offered load: each pool's `CreditQueue.offered` (the interactive requests that arrived in the window:
  their prompt tokens and estimated output tokens);
- what the device can do for each pool (`pools.demand.pool_rates`): from the step-cost model a
  ready replica's worker fitted to the steps it measured (`StepCounters.step_model`), with the pool's
  `max_num_seqs` (the plan's), its KV credits per replica and its `max_num_batched_tokens`;
- the oldest waiting request of each pool (`CreditQueue.oldest_wait`) against its wait bound (half its
  `max_queue_seconds`);
- the replicas up (the device's ready supervisors).

What it says: `cliffguard_device_overloaded{device}` (1 / 0), beside it `cliffguard_device_offered_load`
(offered load over capacity: the fraction of the ready replicas' time asked for, +Inf for a load offered while
none is ready) and
`cliffguard_device_replicas_needed` (the replicas that would carry it at most 90% busy), per pool
`cliffguard_pool_offered_tokens_per_second{pool,phase}`, `cliffguard_pool_capacity_tokens_per_second{pool,phase}`
(over its ready replicas) and `cliffguard_pool_oldest_waiting_seconds{pool}`, per replica
`cliffguard_device_busy_ratio` (the worker's measured step time over wall time; 0 while the replica is not
ready: a dead worker computes nothing); a WARNING when a
device turns overloaded and an INFO line when it clears, each with the numbers; `/ready` lists it
under `overloaded` (still 200: the device serves, slowly) and the dashboard shows it on its pools.
Event-loop only; nothing here waits on a model step.
"""

from __future__ import annotations

import logging
import math
import time

from gateway.monitoring.metrics import GatewayMetrics
from gateway.workers.supervisor import DeviceSupervisor
from gateway.ticker import Ticker
from pools.demand import DeviceLoad, OverloadDetector, PoolLoad, pool_rates, replicas_needed, wait_bound
from pools.pool import Pool

log = logging.getLogger("cliffguard.overload")

OVERLOAD_INTERVAL = 1.0    # seconds between judgements (the detector's holds are seconds long)


class OverloadWatch:
    """One `OverloadDetector` per device with local pools (module docstring)."""

    def __init__(self, pools: dict[str, Pool], max_num_seqs: dict[str, int], metrics: GatewayMetrics) -> None:
        self.pools: dict[str, list[Pool]] = {}
        for pool in pools.values():
            if not pool.is_upstream:
                self.pools.setdefault(pool.device, []).append(pool)
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self.supervisors: dict[str, list[DeviceSupervisor]] = {}   # the gateway's, once it started
        self.detectors = {device: OverloadDetector() for device in self.pools}
        self.last: dict[str, DeviceLoad] = {}
        self._typical: dict[str, tuple[float, float]] = {}   # pool -> (prompt, output) of its last arrivals
        self._models: dict[str, object] = {}   # device -> the last step-cost model a replica of it reported
        # (device, replica) -> (the worker's client, wall time, its busy seconds) at the last check
        self._busy: dict[tuple[str, int], tuple[object, float, float]] = {}
        self._ticker = Ticker("cliffguard-overload", OVERLOAD_INTERVAL, lambda: self.check(time.monotonic()), log,
                              "overload check failed")
        for device in self.pools:
            metrics.device_overloaded.labels(device=device).set(0)   # exported from the start

    def start(self, supervisors: dict[str, list[DeviceSupervisor]]) -> None:
        self.supervisors = supervisors
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    def overloaded(self) -> dict[str, str]:
        """The devices overloaded now, each with its reason (one line with the numbers)."""
        return {device: d.reason for device, d in self.detectors.items() if d.overloaded}

    def offered_replicas(self, device: str) -> float | None:
        """The replicas' worth of time the device's offered load asked at the last check (the step-cost model's
        figure: 0 without one), or None before any check."""
        load = self.last.get(device)
        return None if load is None else sum(p.load for p in load.pools)

    def short_of_replicas(self) -> dict[str, str]:
        """The overloaded devices that need another replica now (`DeviceLoad.short_of_replicas` at the last
        check, taken with the replicas ready now: one that became ready since is judged at the next check),
        each with its reason: what the autoscaler starts a replica for."""
        return {device: reason for device, reason in self.overloaded().items()
                if (load := self.last.get(device)) is not None and load.replicas == len(self._ready(device))
                and load.short_of_replicas}

    def _ready(self, device: str) -> list[tuple[int, DeviceSupervisor]]:
        return [(r, s) for r, s in enumerate(self.supervisors.get(device, [])) if s.is_ready and s.client is not None]

    def check(self, now: float) -> None:
        """Judge every device once (`now`: `time.monotonic()`, the clock of the admissions' records)."""
        for device, detector in self.detectors.items():
            load = self.device_load(device, now)
            self.last[device] = load
            state = detector.observe(now, load)
            self._export(device, load, detector.overloaded)
            if state.changed:
                (log.warning if state.overloaded else log.info)("device %s %s", device, state.reason)

    def device_load(self, device: str, now: float) -> DeviceLoad:
        """The device's pools as the detector sees them now."""
        ready = self._ready(device)
        self._forget_down(device, {r for r, _ in ready})
        model = None
        for replica, supervisor in ready:
            stats = supervisor.client.latest_stats
            if stats is not None:
                # over the time between the two stats (pushed every 0.25 s at most), not between two checks
                self._busy_ratio(device, replica, supervisor.client, stats.taken_at or time.time(),
                                 stats.step.busy_seconds)
                model = model or stats.step.step_model
        # with no replica ready the device's cost model still holds: its capacity reads 0 (its ready replicas'
        # rates), the load offered to it what it is (it read no rates: capacity frozen, offered load 0)
        model = self._models[device] = model or self._models.get(device)
        loads = []
        for pool in self.pools[device]:
            admission = pool.admission
            count, prompt, output = admission.offered.totals(now)
            if count:
                self._typical[pool.name] = (prompt / count, output / count)
            typical = self._typical.get(pool.name, (pool.spec.avg_len * 3 / 4, pool.spec.avg_len / 4))
            rates = None if model is None else pool_rates(
                model, prompt_tokens=typical[0], output_tokens=typical[1], max_num_seqs=self.max_num_seqs[pool.name],
                credits=admission.max_request, chunk=pool.spec.max_num_batched_tokens)
            span = admission.offered.span(now)
            loads.append(PoolLoad(pool.name, prompt / span, output / span, rates, admission.oldest_wait(now),
                                  wait_bound(pool.spec.max_queue_seconds)))
        return DeviceLoad(tuple(loads), len(ready))

    def _busy_ratio(self, device: str, replica: int, client: object, wall: float, busy: float) -> None:
        """The replica's step time since the last check over the wall time (its stats lag by at most the
        worker's push interval; a restarted worker, a new client, counts from 0 again and is measured from
        the next check)."""
        last = self._busy.get((device, replica))
        if last is not None and last[0] is client and wall > last[1] and busy >= last[2]:
            self.metrics.device_busy.labels(device=device, replica=str(replica)).set(
                min(1.0, (busy - last[2]) / (wall - last[1])))
        self._busy[(device, replica)] = (client, wall, busy)

    def _forget_down(self, device: str, up: set[int]) -> None:
        """The device's replicas measured before and not ready now (dead, restarting, parked): their busy
        ratio reads 0, a dead worker computes nothing, rather than the last ratio frozen (the metrics'
        gauges of such a replica read 0 too, `GatewayMetrics.update_replica`)."""
        for key in [key for key in self._busy if key[0] == device and key[1] not in up]:
            del self._busy[key]
            self.metrics.device_busy.labels(device=device, replica=str(key[1])).set(0)

    def _export(self, device: str, load: DeviceLoad, overloaded: bool) -> None:
        m = self.metrics
        m.device_overloaded.labels(device=device).set(1 if overloaded else 0)
        # over the ready replicas' time: with none ready, anything offered is more than they can do
        asked = any(p.offered_prefill or p.offered_decode for p in load.pools)   # with a step-cost model or not
        offered = load.load if load.replicas or not asked else math.inf
        m.device_offered_load.labels(device=device).set(offered)
        m.device_replicas_needed.labels(device=device).set(replicas_needed(load.pools))
        for p in load.pools:
            m.pool_oldest_wait.labels(pool=p.pool).set(p.oldest_wait)
            m.pool_offered.labels(pool=p.pool, phase="prefill").set(p.offered_prefill)
            m.pool_offered.labels(pool=p.pool, phase="decode").set(p.offered_decode)
            if p.rates is not None:
                m.pool_capacity.labels(pool=p.pool, phase="prefill").set(p.rates.prefill * load.replicas)
                m.pool_capacity.labels(pool=p.pool, phase="decode").set(p.rates.decode * load.replicas)
