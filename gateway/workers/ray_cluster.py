"""Replicas on a Ray cluster: placement groups, named actors, and their deaths as the gateway sees them.

A device with `placement: ray` runs each replica as a Ray actor (`engine.remote.ReplicaActor`) in a placement group
of its own: one bundle per tensor-parallel rank (`{"CPU": threads}`, plus `{"GPU": 1}` on CUDA), `STRICT_PACK` so a
replica's ranks share a node. Ray places the group (on the node that holds the fewest of the device's replicas, when
it has room: a soft target), starts the actor, and restarts it (`max_restarts=-1`) when it dies, in a rescheduled
group on another node when its own node is gone. A group Ray cannot place stays pending (so Ray's cluster autoscaler
learns a node is needed) for as long as the replica may take to start; then it is removed, and the next start places
it anew. The actor learns its GPUs from Ray at every start.

The actor is named `cliffguard:<device>:<replica>:<digest>` in the `cliffguard` namespace and detached: it outlives
the gateway, and a gateway that starts again with the same engine config (same digest) finds it and connects without
reloading it; so do other gateways of the same config. A gateway whose config for the device differs (another digest)
while replicas (actors or placement groups) of the old digest are on the cluster does not start the device
(`ConfigConflict`, its state in `/ready`), unless it takes over (`RayCluster.take_over`:
`cliffguard serve --take-over`, YAML `gateway.take_over`): then the old digest's actors and groups are removed first. Two gateways of
different configs that start at once see no replicas yet: a gateway first claims the device for its digest
(`gateway.workers.config_claim`), then lists; the claim is one digest's at a time, so one of the two starts and the
other tries again (refused once the first one's replicas are listed).

Several gateways of one config share the device's replicas; one of them at a time places and removes them
(`gateway.workers.scaler_lease`): a replica whose `may_place` says no only looks for its live actor, and waits for
the leader gateway to place it. Everything that blocks (Ray's client calls) runs on a thread; awaiting an `ObjectRef`
does not. Ray is imported here only, and only when a device asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from gateway.workers.config_claim import SCALER, DeviceClaims, actor_name, config_digest, parse_name

log = logging.getLogger("cliffguard.gateway")

__all__ = ["ClusterError", "ClusterUnreachable", "ConfigConflict", "RayCluster", "RayReplica", "NAMESPACE", "SCALER"]

NAMESPACE = "cliffguard"
CONNECT_SECONDS = 30.0      # how long `ray.init` may take before the address is called unreachable
ACTOR_CONCURRENCY = 8       # endpoint / state / the other calls answer while the engine loads
WATCH_GROUP = "watch"       # the actor's concurrency group of its `wait_stopped` calls (`replica_actor_class`)
WATCH_CONCURRENCY = 64      # pending death notices: one per connected gateway, and each dropped one's for <30 s
RESTART_POLL_SECONDS = 0.25   # between asks while Ray restarts an actor
WATCH_SECONDS = 30.0        # each pending death-notice call returns after this long, and is made again
RESPONSIVE_SECONDS = 5.0    # a silent connection's actor that does not answer Ray this long is restarted
FIND_POLL_SECONDS = 0.5     # between looks for an actor that the leader gateway is to place
RECHECK_SECONDS = 2.0       # a device's config check that could not decide is not made again sooner


class ClusterError(RuntimeError):
    """The Ray cluster cannot be used: not installed, unreachable, or it refused a request."""


class ClusterUnreachable(ClusterError):
    """The cluster did not answer (its head not up yet, a partition): tried again, not the end of the device."""


class ConfigConflict(ClusterError):
    """Replicas of the device under another engine config (digest) are on the cluster; this one does not take over."""


def _ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("placement ray needs Ray: pip install -e '.[ray]'") from None
    return ray


@functools.cache
def replica_actor_class():
    """`engine.remote.ReplicaActor` as a Ray actor class whose `wait_stopped` calls run in a concurrency group of
    their own (`WATCH_GROUP`, `WATCH_CONCURRENCY` threads) beside the default group's `ACTOR_CONCURRENCY`: each
    connected gateway keeps one pending (a dropped connection's stays up to `WATCH_SECONDS`: Ray does not end
    it). On shared threads, enough gateways (or one whose connection flaps) would queue `state` and `endpoint`
    behind them, and `restart_unless_responsive` would restart a healthy replica. The actor routes each call to
    its group itself: callers name no group, and an actor placed before (one group for all) is asked as before.
    Still named `ReplicaActor`: its process is titled `ray::ReplicaActor`."""
    ray = _ray()
    from engine.remote import ReplicaActor

    @ray.method(concurrency_group=WATCH_GROUP)
    def wait_stopped(self, timeout: float) -> bool:
        return ReplicaActor.wait_stopped(self, timeout)

    wait_stopped.__doc__ = ReplicaActor.wait_stopped.__doc__
    cls = type("ReplicaActor", (ReplicaActor,), {"wait_stopped": wait_stopped, "__doc__": ReplicaActor.__doc__})
    return ray.remote(concurrency_groups={WATCH_GROUP: WATCH_CONCURRENCY})(cls)


def _undecided(check: asyncio.Task) -> bool:
    """A finished config check that neither passed nor found another config's replicas."""
    return check.exception() is not None and not isinstance(check.exception(), ConfigConflict)


class RayCluster:
    """The gateway's connection to one Ray cluster (`ray.init` once per process).

    `gateway_id` names this gateway to the devices' scaling leases (host, pid and a random tag: two
    gateways in one process are two). `take_over`: a device whose replicas of another config are on the
    cluster has them removed at start, instead of being refused (`claim`)."""

    def __init__(self, address: str, *, take_over: bool = False) -> None:
        self.address, self.take_over = address, take_over
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._connecting: asyncio.Task | None = None
        self._init: asyncio.Future | None = None      # `ray.init` in a thread, which a timeout does not end
        self._claimed: dict[str, asyncio.Task] = {}   # device -> its config's check at start
        self._recheck_at: dict[str, float] = {}       # device -> when a check that did not decide may run again
        self.claims = DeviceClaims(self.gateway_id, NAMESPACE, address, take_over)

    async def connect(self, timeout: float = CONNECT_SECONDS) -> None:
        """ClusterUnreachable naming the address when the cluster does not answer within `timeout` seconds.
        The replicas of every device on the cluster share one attempt; one that failed is made again."""
        task = self._connecting
        if task is None or task.done() and (task.cancelled() or task.exception() is not None):
            task = self._connecting = asyncio.ensure_future(self._connect(timeout))
        await asyncio.shield(task)

    async def _connect(self, timeout: float) -> None:
        ray = _ray()
        await self._probe(timeout)

        def init() -> None:
            if not ray.is_initialized():
                ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)

        where = f"cannot reach the Ray cluster at {self.address!r}"
        if self._init is None or self._init.done():   # one that timed out may run on: never two at once
            self._init = asyncio.get_running_loop().run_in_executor(None, init)
        try:
            await asyncio.wait_for(asyncio.shield(self._init), timeout)
        except TimeoutError:
            raise ClusterUnreachable(f"{where}: no answer in {timeout:g} s") from None
        except Exception as exc:  # noqa: BLE001 - Ray's own errors, said with the address; a refused connection
            kind = ClusterUnreachable if isinstance(exc, OSError) else ClusterError   # is tried again, not the rest
            raise kind(f"{where}: {type(exc).__name__}: {str(exc).strip().split(chr(10))[0]}") from None

    async def _probe(self, timeout: float) -> None:
        """A `host:port` (or `ray://host:port`) address that refuses TCP is said at once (`ray.init` would
        retry for minutes)."""
        host, sep, port = self.address.removeprefix("ray://").rpartition(":")
        if not sep or not port.isdigit():
            return   # `auto`, or a form Ray resolves itself
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)),
                                               min(timeout, 10.0))
        except TimeoutError:
            raise ClusterUnreachable(f"cannot reach the Ray cluster at {self.address!r}: no answer") from None
        except OSError as exc:
            raise ClusterUnreachable(f"cannot reach the Ray cluster at {self.address!r}: "
                                     f"{exc.strerror or type(exc).__name__}") from None
        writer.close()

    async def claim(self, device: str, digest: str) -> None:
        """Once per device, at its start: `check_config`. Its pass, or its refusal for another config's
        replicas, is every later call's answer; a check that could not decide yet (`ClaimPending`, or an
        error of Ray's) is made again by a call `RECHECK_SECONDS` after it ended, and until then each
        call has its answer (the scaling lease asks every tick); a cancelled one is made again at once."""
        task = self._claimed.get(device)
        if task is None or task.cancelled() or (task.done() and _undecided(task)
                                                and time.monotonic() >= self._recheck_at.get(device, 0.0)):
            task = self._claimed[device] = asyncio.ensure_future(self.check_config(device, digest))
            task.add_done_callback(lambda _: self._recheck_at.__setitem__(device, time.monotonic() + RECHECK_SECONDS))
        await asyncio.shield(task)

    async def check_config(self, device: str, digest: str) -> None:
        """Claim `device` for `digest` (`ClaimPending` while another config's gateway holds its claim),
        then ConfigConflict naming the device, the other digests and how to take over when actors or
        placement groups of `device` under another digest are on the cluster (the claim given back);
        with `take_over` they are removed instead (and that config's scaling lease with them)."""
        await self.claims.claim(device, digest)
        found = await self.device_names(device)
        others = {name: d for name, (slot, d) in found.items() if d != digest}
        running = sorted({d for name, d in others.items() if found[name][0] != SCALER})
        if running and not self.take_over:
            await self.claims.release(device)
            raise ConfigConflict(
                f"replicas of device {device!r} with another config (digest {', '.join(running)}) run on the Ray "
                f"cluster at {self.address!r} (another gateway's, or left by one that stopped: replicas outlive "
                "their gateway); start this gateway with --take-over (or gateway.take_over: true in its YAML) to "
                "replace them")
        for name in sorted(others) if self.take_over else ():
            log.warning("device %s: taking over: removing %s (config digest %s; this gateway's is %s)",
                        device, name, others[name], digest)
            await self.remove(name)

    async def release_claims(self) -> None:
        """This gateway stops: the start checks still running end, then its holds on its devices' config
        claims are given back, so that a gateway of another config may start those devices at once."""
        for task in self._claimed.values():
            task.cancel()
        await asyncio.gather(*self._claimed.values(), return_exceptions=True)
        await self.claims.release_all()

    async def device_names(self, device: str) -> dict[str, tuple[str, str]]:
        """Each live actor (in the namespace) and placement group (not removed) named for `device`:
        name -> (slot, digest) (`parse_name`)."""
        ray = _ray()

        def names() -> list[str]:
            groups = ray.util.placement_group_table().values()
            live = [g["name"] for g in groups if g.get("state") != "REMOVED"]
            return list(ray.util.list_named_actors(all_namespaces=False)) + live

        return {name: parsed for name in await asyncio.to_thread(names)
                if (parsed := parse_name(name, device)) is not None}

    async def live_slots(self, device: str, digest: str) -> set[int]:
        """The slots of `device` whose actor of `digest` is alive (or being restarted by Ray)."""
        names = await asyncio.to_thread(_ray().util.list_named_actors, all_namespaces=False)
        parsed = [parse_name(name, device) for name in names]
        return {int(p[0]) for p in parsed if p is not None and p[1] == digest and p[0].isdigit()}

    async def remove_slots_past(self, device: str, digest: str, num_slots: int) -> None:
        """Remove the actors and groups of `device` and `digest` whose slot is `num_slots` or past it (left
        by a configuration with more `replicas`)."""
        for name, (slot, d) in sorted((await self.device_names(device)).items()):
            if d == digest and slot.isdigit() and int(slot) >= num_slots:
                log.info("device %s: removing the Ray actor %s (past its %d replicas)", device, name, num_slots)
                await self.remove(name)

    async def remove(self, name: str) -> None:
        """Stop an actor and remove its placement groups, by name (nothing if they are gone)."""
        ray = _ray()

        def remove() -> None:
            with contextlib.suppress(ValueError):   # no such actor
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            for group in placement_groups_named(name):
                with contextlib.suppress(Exception):   # removed meanwhile
                    ray.util.remove_placement_group(group)

        await asyncio.to_thread(remove)

    async def alive_nodes(self) -> list[str]:
        nodes = await asyncio.to_thread(_ray().nodes)
        return [n["NodeID"] for n in nodes if n.get("Alive")]


def _actor_id(actor) -> object:
    """An actor handle's id: the same across Ray's restarts of the actor, another for a new actor of the name."""
    return actor._actor_id


def placement_groups_named(name: str) -> list:
    """The placement groups of this name that are not removed (a blocking call of Ray's)."""
    ray = _ray()
    from ray.util.placement_group import PlacementGroup

    return [PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group["placement_group_id"])))
            for group in ray.util.placement_group_table().values()
            if group.get("name") == name and group.get("state") != "REMOVED"]


@dataclass(frozen=True)
class Bundles:
    """What one replica asks of a node: `cpus` and `gpus` per rank, `ranks` of them."""

    ranks: int
    cpus: float
    gpus: int

    @classmethod
    def of(cls, config: EngineConfig) -> Bundles:
        cuda = config.device.startswith("cuda")
        return cls(config.tensor_parallel_size, float(max(1, config.cpu_threads)), 1 if cuda else 0)

    def as_list(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus} | ({"GPU": float(self.gpus)} if self.gpus else {})
        return [dict(bundle) for _ in range(self.ranks)]


class RayReplica:
    """One replica slot of a device on a Ray cluster: its placement group and actor, found or made.

    `endpoint` waits until Ray has placed and started the actor; `watch` fails when the actor dies
    (Ray's death notice); `restart` has Ray kill it and start it again; `remove` ends it for good.
    `status` says what it is waiting for (shown in `/ready` while the replica loads). `may_place` says
    whether this gateway may place the replica now (the device's scaling leader does: the autoscaler sets
    it to its `gateway.workers.scaler_lease.ScalerLease.is_leader`); while it may not, `endpoint` only
    finds the live actor, and waits for it."""

    def __init__(self, cluster: RayCluster, device: str, replica: int, config: EngineConfig,
                 peers: list[RayReplica] | None = None) -> None:
        self.cluster = cluster
        self.device = device
        self.replica = replica
        self.config = config
        self.digest = config_digest(config)
        self.name = actor_name(device, replica, self.digest)
        self.bundles = Bundles.of(config)
        self.peers = peers if peers is not None else []   # the device's other slots (placement spreads them)
        self.node_id: str | None = None
        self.status = "connecting to the Ray cluster"
        self.may_place: Callable[[], bool] = lambda: True
        self.lease_failure: Callable[[], str | None] = lambda: None   # why this gateway cannot lead (the lease's)
        self.placing = False   # waiting for Ray to place the group this gateway asked for
        self.placed_at = float("-inf")   # when this gateway's last placement ended (time.monotonic())
        self._actor = None
        self._restarting: asyncio.Task | None = None   # Ray's kill of the actor for its restart, on a thread

    async def endpoint(self, timeout: float) -> tuple[str, int, bytes]:
        """(host, port, key): finds the live actor of this name, or places the replica if it may (else
        waits for the leader gateway to place it), then asks the actor. ConfigConflict when replicas of
        another config of the device are on the cluster, ClaimPending while another config's gateway
        holds the device's claim (`RayCluster.check_config`). After a `restart`, once Ray has killed the actor (a
        connection made before would reach the hung one)."""
        if self._restarting is not None and not self._restarting.done():
            self.status = "waiting for Ray to kill the actor for its restart"
            await asyncio.wait([self._restarting], timeout=timeout)
        await self.cluster.connect()
        self.status = "claiming the device for its config"
        await self.cluster.claim(self.device, self.digest)
        if self._actor is None:
            self._actor = await self._find_or_place(timeout)
        self.status = "waiting for the actor to start"
        from ray.exceptions import ActorDiedError

        try:
            host, port, key, node_id = await asyncio.wait_for(self._ask_endpoint(), timeout)
        except ActorDiedError:
            # gone for good (removed, or its constructor failed): placed anew on the next start, in a new group.
            # A handle kept from before may be of an actor removed since and placed again under the name (by
            # the leader then): that one lives, serving, and is not this gateway's to remove.
            dead, self._actor = self._actor, None
            if self.may_place() and ((live := await self._find()) is None or _actor_id(live) == _actor_id(dead)):
                await self.cluster.remove(self.name)
            raise
        self.node_id = node_id
        self.status = f"on node {node_id[:12]} at {host}:{port}"
        return host, port, key

    async def _ask_endpoint(self) -> tuple[str, int, bytes, str]:
        """The actor's endpoint; while Ray restarts it (a lost node, a killed process) ask again."""
        from ray.exceptions import ActorUnavailableError

        while True:
            try:
                return await self._actor.endpoint.remote()
            except ActorUnavailableError:
                self.status = "waiting for Ray to restart the actor"
                await asyncio.sleep(RESTART_POLL_SECONDS)

    async def _find_or_place(self, timeout: float):
        """The live actor; else, when this gateway may place it, a new one (after checking once more that
        no other config's replicas of the device are there); else wait for one. TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while (actor := await self._find()) is None and not self.may_place():
            failure = self.lease_failure()
            self.status = "waiting for the leader gateway to place it" + (f" ({failure})" if failure else "")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"replica {self.label}: no gateway placed it within {timeout:g} s" +
                                   (f" ({failure})" if failure else ""))
            await asyncio.sleep(FIND_POLL_SECONDS)
        if actor is not None:
            log.info("replica %s: found the live actor %s", self.label, self.name)
            return actor
        await self.cluster.check_config(self.device, self.digest)   # another config may have come meanwhile
        return await self._place(timeout)

    async def removed(self) -> bool:
        """Whether the replica's actor is gone for good (removed from the cluster; Ray is not restarting it)."""
        return await self._find() is None

    async def _find(self):
        """The live actor of this name, or None."""
        try:
            return await asyncio.to_thread(_ray().get_actor, self.name, NAMESPACE)
        except ValueError:
            return None

    async def _place(self, timeout: float):
        """A new actor (`get_if_exists`: gateways placing the name at once get one actor) in the slot's placement
        group: one left without its actor if any (Ray refuses a second group of the name), else a new one."""
        _ray()   # ClusterError where Ray is not installed
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = next(iter(await asyncio.to_thread(placement_groups_named, self.name)), None)
        if group is not None:
            log.warning("replica %s: placing it in the placement group %s, left without its actor", self.label,
                        self.name)
        else:
            target = await self._target_node()
            group = await asyncio.to_thread(placement_group, self.bundles.as_list(), strategy="STRICT_PACK",
                                            name=self.name, lifetime="detached", _soft_target_node_id=target)
        self.status = f"waiting for Ray to place {self.bundles.as_list()} on one node"
        options = dict(name=self.name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1,
                       max_concurrency=ACTOR_CONCURRENCY, num_cpus=self.bundles.cpus, num_gpus=self.bundles.gpus,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                       get_if_exists=True)
        if self.bundles.gpus:   # rank 0 starts the other ranks: it sees every GPU of its node, and uses its group's
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        self.placing = True   # its group is listed, its actor not yet: a follower's tick leaves it be
        try:
            await self._wait_placed(group, timeout)
            # A named actor's creation waits on the GCS: on a thread; cancelled, waited for (a removal then finds it)
            creating = asyncio.ensure_future(asyncio.to_thread(replica_actor_class().options(**options).remote,
                                                               self.config))
            try:
                return await asyncio.shield(creating)
            except asyncio.CancelledError:
                await asyncio.wait([creating])
                raise
        finally:
            self.placing = False
            self.placed_at = time.monotonic()   # nor does a tick whose listing was asked for before (`live_at`)

    async def _wait_placed(self, group, timeout: float) -> None:
        """Wait until Ray has placed `group`. One not placed within `timeout` seconds (or a wait cancelled) is
        removed: no pending group is left asking the cluster autoscaler for a node; the next `endpoint` places
        anew. TimeoutError saying what could not be placed."""
        ray = _ray()
        try:
            await asyncio.wait_for(group.ready(), timeout)
        except BaseException as exc:
            await asyncio.to_thread(ray.util.remove_placement_group, group)
            if not isinstance(exc, TimeoutError):
                raise
            self.status = f"Ray placed {self.bundles.as_list()} on no node within {timeout:g} s"
            raise TimeoutError(f"replica {self.label}: {self.status} (its placement group was removed)") from None

    async def _target_node(self) -> str | None:
        """The alive node holding the fewest of the device's replicas (a soft target: Ray may go elsewhere)."""
        nodes = await self.cluster.alive_nodes()
        if not nodes:
            return None
        held = {n: 0 for n in nodes}
        for peer in self.peers:
            if peer is not self and peer.node_id in held:
                held[peer.node_id] += 1
        # ties (replicas placed at once know no peer's node yet) go round-robin by slot
        return min(nodes, key=lambda n: (held[n], (nodes.index(n) - self.replica) % len(nodes)))

    @property
    def label(self) -> str:
        return f"{self.device}/{self.replica}"

    async def watch(self) -> str:
        """Returns the reason once the actor is dead or restarting (Ray's notice)."""
        try:
            while not await self._actor.wait_stopped.remote(WATCH_SECONDS):
                pass
            return f"replica {self.label}: the Ray actor stopped"
        except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, ActorUnavailableError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"replica {self.label}: Ray reports the actor dead ({type(exc).__name__}: {first[:200]})"

    async def restart_unless_responsive(self, reason: str, loading_hangs: bool = False) -> None:
        """A connection that went silent: ask the actor through Ray (`state`, answered from a thread of its
        own); restart it only if it does not answer within `RESPONSIVE_SECONDS` (or, `loading_hangs`: a
        start past its limit, says it still loads). An actor that answers is alive and serving (other
        gateways, perhaps): the silence was this gateway's path to it, and the supervisor connects again."""
        actor = self._actor
        if actor is None:
            return
        try:
            state = await asyncio.wait_for(actor.state.remote(), RESPONSIVE_SECONDS)
        except Exception as exc:  # noqa: BLE001 - timed out, or Ray reports it dead: restart it
            log.error("replica %s: the actor does not answer Ray either (%s)", self.label, type(exc).__name__)
            state = None
        if state is None or loading_hangs and state == "loading":
            self.restart(reason)
            return
        log.warning("replica %s: %s, but the actor answers Ray (%s): connecting again, not restarting it",
                    self.label, reason, state)

    def restart(self, reason: str) -> None:
        """Have Ray kill the actor, which it restarts, off the event loop: `ray.kill` waits for the cluster head's
        answer, and a hung replica's cluster is often slow or cut off (every stream of the gateway froze)."""
        if self._actor is not None:
            log.error("replica %s: asking Ray to restart the actor: %s", self.label, reason)
            self._restarting = asyncio.ensure_future(self._kill(self._actor))

    async def _kill(self, actor: object) -> None:
        try:
            await asyncio.to_thread(_ray().kill, actor, no_restart=False)
        except Exception:  # noqa: BLE001 - the watchdog or the next start finds it again
            log.exception("replica %s: Ray could not restart the actor", self.label)

    async def remove(self) -> None:
        await self.cluster.remove(self.name)
        self._actor = None
