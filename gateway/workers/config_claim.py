"""A Ray device's config claim: of gateways of different configs that start a device at once, one places.

A gateway refuses to start a device whose replicas of another config (digest) run on the cluster
(`gateway.workers.ray_cluster.RayCluster.check_config`). Two gateways that start at the same moment see no
replicas yet, so before it lists the device's replicas, and before each placement, a gateway claims the
device for its digest from the device's claim: a detached actor `cliffguard:<device>:config` (namespace
`cliffguard`, no CPU of its own, on the head node, restarted by Ray) whose calls Ray runs one at a time.

The claim is one digest's while a gateway of that digest holds it: a gateway holds it from its claim
until it releases it (it stops, or its listing showed another config's replicas) or `CLAIM_SECONDS`
pass without another claim (a gateway killed mid-start). A gateway of another digest meanwhile gets
`ClaimPending` and tries again later (its supervisor's back-off; `RayCluster.claim` checks again no
sooner than `RECHECK_SECONDS` after its last check); once nobody holds the claim, the next digest to
ask gets it. A taker-over (`gateway.take_over`) takes it whoever holds it. A claim actor that
Ray restarted knows no holders, so it grants nothing for `CLAIM_SECONDS`, until every hold it gave may
have lapsed.

`ConfigClaim` is the rule, with the clock given (tested without Ray); `ConfigClaimActor` is it on Ray;
`DeviceClaims` is one gateway's side, on its event loop. The names claims and replicas go by are made and read
here: `config_digest`, `actor_name` (`cliffguard:<device>:<slot>:<digest>`), `parse_name`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # (an annotation only: the claim actor's process imports no torch)
    from engine.config import EngineConfig

log = logging.getLogger("cliffguard.gateway")

__all__ = ["CLAIM_SECONDS", "SCALER", "ClaimPending", "ConfigClaim", "ConfigClaimActor", "DeviceClaims", "actor_name",
           "claim_name", "config_digest", "parse_name"]

CLAIM_SECONDS = 30.0     # a hold outlasts a gateway's claim to its placed group, or lapses
CALL_SECONDS = 30.0      # a claim not answered in this long is tried again later
RELEASE_SECONDS = 5.0    # a release not answered in this long is left to lapse
SCALER = "scaler"   # the slot word of a device's scaling lease: `cliffguard:<device>:scaler:<digest>`
HEAD_NODE = "node:__internal_head__"   # Ray's resource of the head node: the claim lives as long as the cluster


class ClaimPending(RuntimeError):
    """The device's claim is another config's for now (or did not answer): this gateway tries again."""


@dataclass
class ConfigClaim:
    """Which config (digest) of a device places its replicas. `claim` grants (and refreshes a hold)
    when the claim is the asker's digest's, held by nobody, or taken over, and returns the digest that
    holds it: None while a restarted claim grants nothing. `now` is the claim's own clock."""

    claim_seconds: float
    digest: str | None = None
    holders: dict[str, float] = field(default_factory=dict)   # gateway -> when it last claimed
    grants_from: float = float("-inf")                         # a restarted claim grants nothing before

    @classmethod
    def started(cls, claim_seconds: float, now: float, *, restarted: bool = False) -> ConfigClaim:
        return cls(claim_seconds, grants_from=now + claim_seconds if restarted else float("-inf"))

    def claim(self, digest: str, gateway: str, now: float, take_over: bool = False) -> str | None:
        if now < self.grants_from:
            return None
        self.holders = {g: t for g, t in self.holders.items() if now - t < self.claim_seconds}
        if self.digest != digest and (take_over or not self.holders):
            self.digest, self.holders = digest, {}
        if self.digest == digest:
            self.holders[gateway] = now
        return self.digest

    def release(self, gateway: str) -> None:
        self.holders.pop(gateway, None)


class ConfigClaimActor:
    """`ConfigClaim` as a detached Ray actor, on the actor's monotonic clock."""

    def __init__(self, claim_seconds: float) -> None:
        import ray

        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.rule = ConfigClaim.started(claim_seconds, time.monotonic(), restarted=restarted)

    def claim(self, digest: str, gateway: str, take_over: bool) -> str | None:
        return self.rule.claim(digest, gateway, time.monotonic(), take_over)

    def release(self, gateway: str) -> None:
        self.rule.release(gateway)


def config_digest(config: EngineConfig) -> str:
    """Eight hex digits naming what a replica runs: a restarted gateway reuses actors of the same digest."""
    return hashlib.sha256(pickle.dumps(config)).hexdigest()[:8]


def actor_name(device: str, slot: int | str, digest: str) -> str:
    """`cliffguard:<device>:<slot>:<digest>`: a replica's actor and group, or the scaling lease (slot `SCALER`)."""
    return f"cliffguard:{device}:{slot}:{digest}"


def parse_name(name: str, device: str) -> tuple[str, str] | None:
    """(slot, digest) of an `actor_name` of `device`; None for another device's name or any other name."""
    prefix = f"cliffguard:{device}:"
    if not isinstance(name, str) or not name.startswith(prefix):
        return None
    slot, sep, digest = name[len(prefix):].partition(":")
    return (slot, digest) if sep and digest and ":" not in digest and (slot.isdigit() or slot == SCALER) else None


def claim_name(device: str) -> str:
    """The name of a device's claim actor (not a replica's name: `parse_name` does not read it)."""
    return f"cliffguard:{device}:config"


class DeviceClaims:
    """One gateway's claims on the devices of one Ray cluster (`ray.init` done), as `gateway_id`."""

    def __init__(self, gateway_id: str, namespace: str, address: str, take_over: bool = False) -> None:
        self.gateway_id, self.namespace, self.address, self.take_over = gateway_id, namespace, address, take_over
        self._actors: dict[str, object] = {}   # device -> its claim actor, once asked
        self._failing: set[str] = set()         # devices whose claim failed to answer (said once)

    async def claim(self, device: str, digest: str) -> None:
        """Hold `device`'s claim for `digest`; ClaimPending naming the holder's digest when another
        config's gateway holds it, or the claim did not answer."""
        try:
            actor = self._actors.get(device) or await asyncio.to_thread(self._get_or_create, device)
            self._actors[device] = actor
            holder = await asyncio.wait_for(actor.claim.remote(digest, self.gateway_id, self.take_over),
                                            CALL_SECONDS)
        except Exception as exc:  # noqa: BLE001 - Ray's errors and the timeout: asked again at the next try
            if not isinstance(exc, TimeoutError):
                self._actors.pop(device, None)   # made again next time (a call that timed out may still hold)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            message = (f"the config claim {claim_name(device)!r} on the Ray cluster at {self.address!r} did not "
                       f"answer ({type(exc).__name__}{': ' + first if first else ''}); trying again")
            if device not in self._failing:
                log.warning("device %s: %s", device, message)
                self._failing.add(device)
            raise ClaimPending(message) from None
        self._failing.discard(device)
        if holder is None:
            raise ClaimPending(f"the config claim {claim_name(device)!r} on the Ray cluster at {self.address!r} was "
                               f"restarted: it grants nothing for {CLAIM_SECONDS:g} s; trying again")
        if holder != digest:
            raise ClaimPending(f"another gateway is starting replicas of device {device!r} with another config "
                               f"(digest {holder}) on the Ray cluster at {self.address!r}; trying again until it "
                               "stops (or start this gateway with --take-over to replace its replicas)")

    async def release(self, device: str) -> None:
        """Give `device`'s claim back, if this gateway holds it (a release that fails lapses)."""
        actor = self._actors.get(device)
        if actor is not None:
            await asyncio.gather(asyncio.wait_for(actor.release.remote(self.gateway_id), RELEASE_SECONDS),
                                 return_exceptions=True)

    async def release_all(self) -> None:
        await asyncio.gather(*(self.release(device) for device in list(self._actors)))

    def _get_or_create(self, device: str):
        import ray

        return ray.remote(ConfigClaimActor).options(
            name=claim_name(device), namespace=self.namespace, lifetime="detached", max_restarts=-1,
            max_task_retries=-1, num_cpus=0, resources={HEAD_NODE: 0.001}, get_if_exists=True).remote(CLAIM_SECONDS)
