"""The replicas' own counters through a `cliffguard bench chaos` run on a local Ray cluster.

Every `COUNTERS_INTERVAL_S` each replica's actor is asked for its counters
(`engine.remote.ReplicaActor.sessions`, through `bench.ray_local.LocalRayCluster.replica_counters`): the
gateways it serves now, and per pool its capacity (blocks x block size, in KV credits), the credits every
gateway's running requests reserve and every gateway holds (the sum of max(lease, reserved)), their
high-water marks since the actor started (`peak_reserved`, `peak_held`) and each gateway's lease. The
run's summary says, per replica and pool, the most it was seen to reserve and hold, its own peaks and the
looks that found either over the capacity: the goal is none, ever. `lease_back_s` says when, after a
gateway was killed, every replica served one gateway again, with the whole of each pool leased to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COUNTERS_INTERVAL_S = 0.25


@dataclass(frozen=True)
class CountersLook:
    """One look at the replicas `t_s` s after the run's start (when the answers came): actor name -> its
    counters (`ReplicaActor.sessions`), of the replicas that answered."""

    t_s: float
    replicas: dict[str, dict[str, Any]]


@dataclass
class ReplicaCounters:
    """Looks at every replica of `cluster` (a `bench.ray_local.LocalRayCluster`) every `interval` s until
    told to stop. Each look runs on a thread (Ray's calls block); a look that fails is counted in
    `num_failed` (its last error in `error`), not raised. Event-loop only."""

    cluster: Any
    start: float                          # a `perf_counter` value: the run's start
    interval: float = COUNTERS_INTERVAL_S
    looks: list[CountersLook] = field(default_factory=list)
    num_failed: int = 0
    error: str | None = None

    async def look_once(self) -> CountersLook | None:
        try:
            replicas = await asyncio.to_thread(self.cluster.replica_counters)
        except Exception as exc:  # noqa: BLE001 - Ray's own errors: counted, the run goes on
            self.num_failed, self.error = self.num_failed + 1, f"{type(exc).__name__}: {exc}"[:300]
            return None
        look = CountersLook(time.perf_counter() - self.start, replicas)
        self.looks.append(look)
        return look

    async def run(self, stop: asyncio.Event) -> None:
        """Look on a fixed schedule until `stop` is set (a slow look delays only the next)."""
        next_at = time.perf_counter()
        while not stop.is_set():
            await self.look_once()
            next_at = max(next_at + self.interval, time.perf_counter())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.perf_counter())
            except TimeoutError:
                pass

    def latest(self) -> CountersLook | None:
        return self.looks[-1] if self.looks else None


def whole_to_one(look: CountersLook) -> bool:
    """Every replica in `look` (at least one) serves one gateway, leased the whole of each of its pools."""
    return bool(look.replicas) and all(
        c["num_sessions"] == 1 and all(p["leases"] == [p["capacity"]] for p in c["pools"].values())
        for c in look.replicas.values())


def lease_back_s(looks: Sequence[CountersLook], since_s: float) -> float | None:
    """Seconds from `since_s` to the first look at or after it that is `whole_to_one`; None: none was."""
    return next((look.t_s - since_s for look in looks if look.t_s >= since_s and whole_to_one(look)), None)


def counters_summary(looks: Sequence[CountersLook]) -> dict[str, dict[str, Any]]:
    """Actor name -> its looks (`num_looks`), the most gateways it served at once (`max_sessions`) and per
    pool: `capacity`, the most credits seen reserved and held (`max_reserved`, `max_held`), the replica's
    own high-water marks (`peak_reserved`, `peak_held`: the largest it reported; an actor that Ray
    restarted counts from 0 again) and the looks that found either count over the capacity."""
    summary: dict[str, dict[str, Any]] = {}
    for look in looks:
        for name, counters in look.replicas.items():
            replica = summary.setdefault(name, {"num_looks": 0, "max_sessions": 0, "pools": {}})
            replica["num_looks"] += 1
            replica["max_sessions"] = max(replica["max_sessions"], counters["num_sessions"])
            for pool, c in counters["pools"].items():
                s = replica["pools"].setdefault(pool, dict.fromkeys(
                    ("max_reserved", "max_held", "peak_reserved", "peak_held", "looks_over_capacity"), 0))
                s["capacity"] = c["capacity"]
                for key, value in (("max_reserved", c["reserved_credits"]), ("max_held", c["held_credits"]),
                                   ("peak_reserved", c["peak_reserved"]), ("peak_held", c["peak_held"])):
                    s[key] = max(s[key], value)
                s["looks_over_capacity"] += max(c["reserved_credits"], c["held_credits"]) > c["capacity"]
    return summary


def within_capacity(summary: dict[str, dict[str, Any]]) -> bool:
    """No replica was seen, nor says it ever was, reserving or holding more credits than its pool has."""
    return all(p["looks_over_capacity"] == 0 and max(p["max_reserved"], p["max_held"], p["peak_reserved"],
                                                     p["peak_held"]) <= p["capacity"]
               for replica in summary.values() for p in replica["pools"].values())


def format_counters(summary: dict[str, dict[str, Any]], num_failed: int = 0) -> list[str]:
    """Lines of the report: per replica and pool, what it reserved and held against its capacity."""
    if not summary:
        return [f"replicas' own counters: no answer ({num_failed} looks failed)"]
    lines = [f"replicas' own counters (every {COUNTERS_INTERVAL_S:g} s; {num_failed} looks failed):"]
    for name, replica in summary.items():
        lines.append(f"  {name}: {replica['num_looks']} looks, up to {replica['max_sessions']} gateways at once")
        for pool, p in replica["pools"].items():
            lines.append(f"    pool {pool}: capacity {p['capacity']} credits; reserved max {p['max_reserved']} "
                         f"(own peak {p['peak_reserved']}), held max {p['max_held']} (own peak {p['peak_held']}); "
                         f"{p['looks_over_capacity']} looks over capacity")
    return lines
