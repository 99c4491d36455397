"""`ScalerLease`: one gateway at a time decides a Ray device's replicas; the other gateways follow.

Several gateways of one config may share a device's replicas on a Ray cluster. What the autoscaler
decides (start a replica, drain one, remove it) is decided once per device, by the gateway that holds
the device's scaling lease: a small detached actor per device and config digest
(`cliffguard:<device>:scaler:<digest>` in namespace `cliffguard`, no CPU of its own, restarted by Ray)
grants it to one gateway at a time for `LEASE_SECONDS`; its holder renews it every autoscaler tick,
and a gateway that stops hands it back. When the holder dies or is cut off, its lease expires and the
next gateway to ask gets it, within `LEASE_SECONDS`.

A gateway counts itself the leader until the time it asked plus what the actor said was left: never
past the actor's own expiry, so two gateways never both lead (clocks are not compared). A lease actor
that Ray restarted grants nothing for `LEASE_SECONDS`, so any lease it gave before is over first.

Each renewal carries what the gateway's autoscaler wants and does: its reason to scale up (a request
waited for credits, the device is overloaded) and, from the leader, the slots it is draining. The
answer gives the leader the other gateways' reasons (their queues count), and the followers the
slots the leader drains (they send those no new request). `ScalerLease.live` lists the slots whose
actor is alive, for a follower to follow (`gateway.workers.autoscaler`).

`Lease` is the rule, with the clock given (tested without Ray); `ScalerLeaseActor` is it on Ray;
`ScalerLease` is a gateway's side, event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.workers.config_claim import SCALER, ClaimPending, actor_name
from gateway.workers.ray_cluster import NAMESPACE, ClusterError, RayCluster, RayReplica, _ray

log = logging.getLogger("cliffguard.gateway")

__all__ = ["LEASE_SECONDS", "Lease", "LeaseView", "ScalerLease", "ScalerLeaseActor", "device_lease"]

LEASE_SECONDS = 10.0   # a lease not renewed this long is free
CALL_SECONDS = 5.0     # a renewal not answered by then is given up (the next tick asks again)


@dataclass(frozen=True)
class LeaseView:
    """The lease actor's answer to one gateway: who holds the lease and for how long yet, the slots the
    holder drains, and another gateway's reason to scale up (the first reported within the lease time)."""

    holder: str | None
    seconds_left: float
    draining: tuple[int, ...] = ()
    pressure: str | None = None


@dataclass
class Lease:
    """The lease of one device's scaling: one holder at a time. `now` is the lease's own clock."""

    lease_seconds: float
    holder: str | None = None
    expires: float = 0.0                    # the holder's lease ends then; before it, nobody else gets it
    draining: tuple[int, ...] = ()          # the slots the holder drains
    pressures: dict[str, tuple[str, float]] = field(default_factory=dict)   # gateway -> (reason, when)

    @classmethod
    def started(cls, lease_seconds: float, now: float, *, restarted: bool = False) -> Lease:
        """A new lease; one whose actor restarted grants nothing until any lease it gave may be over."""
        return cls(lease_seconds, expires=now + lease_seconds if restarted else now)

    def renew(self, gateway: str, now: float, pressure: str | None = None,
              draining: Sequence[int] = ()) -> LeaseView:
        """Grant or renew the lease to `gateway` when it is free, expired or already its own; record the
        gateway's reason to scale up (None: it has none) and, from the holder, the slots it drains."""
        if self.holder != gateway and now >= self.expires:
            self.holder, self.draining = gateway, ()
        if self.holder == gateway:
            self.expires, self.draining = now + self.lease_seconds, tuple(draining)
        if pressure:
            self.pressures[gateway] = (pressure, now)
        else:
            self.pressures.pop(gateway, None)
        self.pressures = {g: (r, t) for g, (r, t) in self.pressures.items() if now - t < self.lease_seconds}
        other = next((r for g, (r, _) in self.pressures.items() if g != gateway), None)
        return LeaseView(self.holder, max(0.0, self.expires - now), self.draining, other)

    def release(self, gateway: str, now: float) -> None:
        """`gateway` stops: its lease (if it holds it) is free at once, its reason forgotten."""
        self.pressures.pop(gateway, None)
        if self.holder == gateway:
            self.holder, self.expires, self.draining = None, now, ()


class ScalerLeaseActor:
    """`Lease` as a detached Ray actor, on the actor's monotonic clock."""

    def __init__(self, lease_seconds: float) -> None:
        restarted = _ray().get_runtime_context().was_current_actor_reconstructed
        self.lease = Lease.started(lease_seconds, time.monotonic(), restarted=restarted)

    def renew(self, gateway: str, pressure: str | None, draining: tuple[int, ...]) -> LeaseView:
        return self.lease.renew(gateway, time.monotonic(), pressure, draining)

    def release(self, gateway: str) -> None:
        self.lease.release(gateway, time.monotonic())


class ScalerLease:
    """This gateway's side of one device's scaling lease. `is_leader()` while the lease is its own;
    `view` the last answer; `live` the slots whose actor was alive at the last look (None before the
    first; `live_at` when it was asked for). `poke` renews in the background each autoscaler tick; `release`
    hands the lease back."""

    def __init__(self, cluster: RayCluster, device: str, digest: str, num_slots: int,
                 lease_seconds: float = LEASE_SECONDS) -> None:
        self.cluster = cluster
        self.device = device
        self.digest = digest
        self.num_slots = num_slots
        self.lease_seconds = lease_seconds
        self.name = actor_name(device, SCALER, digest)
        self.view = LeaseView(None, 0.0)
        self.live: set[int] | None = None
        self.live_at = float("-inf")         # monotonic: when the listing of `live` was asked for
        self._until = 0.0                    # monotonic: this gateway leads until then
        self._led = False                    # it led at the last renewal
        self.failure: str | None = None      # why the last renewal failed (logged once; shown where a slot waits)
        self._actor = None
        self._known = None                   # the last actor handle got: `release` reaches it after a failed renewal
        self._task: asyncio.Task | None = None

    def is_leader(self) -> bool:
        return time.monotonic() < self._until

    def poke(self, pressure: str | None, draining: Sequence[int] = ()) -> None:
        """Renew (or ask for) the lease and list the live slots, in the background: one call at a time."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.renew(pressure, tuple(draining)))

    async def renew(self, pressure: str | None = None, draining: tuple[int, ...] = ()) -> None:
        """One renewal: the lease, then the live slots; on becoming the leader, the slots past this
        gateway's `replicas` are removed. A failure is logged once and leaves the gateway a follower
        when its lease runs out."""
        try:
            await self.cluster.connect()
            await self.cluster.claim(self.device, self.digest)   # a device refused for its config leads nothing
            asked = time.monotonic()
            if self._actor is None:
                self._actor = self._known = await asyncio.to_thread(self._get_or_create)
            view = await asyncio.wait_for(self._actor.renew.remote(self.cluster.gateway_id, pressure, draining),
                                          CALL_SECONDS)
            self.view, self._until = view, asked + view.seconds_left if view.holder == self.cluster.gateway_id else 0.0
            if self.is_leader() and not self._led:
                log.info("device %s: gateway %s leads its scaling", self.device, self.cluster.gateway_id)
                await self.cluster.remove_slots_past(self.device, self.digest, self.num_slots)
            self._led = self.is_leader()
            listed = time.monotonic()
            self.live, self.live_at = await self.cluster.live_slots(self.device, self.digest), listed
        except (ClusterError, ClaimPending):
            return   # the device's own state says why (unreachable, another config)
        except Exception as exc:  # noqa: BLE001 - Ray's errors: the lease lapses, the next tick asks again
            self._actor = None
            failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if self.failure is None:
                log.warning("device %s: the scaling lease %s did not answer: %s", self.device, self.name, failure)
            self.failure = f"the scaling lease {self.name} did not answer: {failure}"
            return
        self.failure = None

    def _get_or_create(self):
        ray = _ray()
        return ray.remote(ScalerLeaseActor).options(
            name=self.name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, max_task_retries=-1,
            num_cpus=0, get_if_exists=True).remote(self.lease_seconds)

    def resign(self) -> None:
        """Lead no more from now (the gateway drains): a renewal under way is cancelled; `release` hands the
        lease itself back."""
        if self._task is not None:
            self._task.cancel()
        self._until = 0.0

    async def release(self) -> None:
        """Hand the lease back (the gateway stops): another gateway leads at its next renewal."""
        self.resign()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        actor = self._actor or self._known   # a renewal that timed out may still have granted it
        if actor is not None:
            try:
                await asyncio.wait_for(actor.release.remote(self.cluster.gateway_id), CALL_SECONDS)
            except Exception:  # noqa: BLE001 - then it expires
                pass


def device_lease(device: str, links: Sequence[object]) -> ScalerLease | None:
    """The scaling lease of a device whose replicas are on Ray (`links`: its slots' links); None otherwise."""
    if not links or not all(isinstance(link, RayReplica) for link in links):
        return None
    first = links[0]
    return ScalerLease(first.cluster, device, first.digest, len(links))
