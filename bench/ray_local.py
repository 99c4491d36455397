"""`LocalRayCluster`: a Ray cluster of a few nodes on this machine, every node, GCS and actor on 127.0.0.1,
for benchmarks that place replicas with `placement: ray` and take nodes away under load.

Ray resolves 127.0.0.1 to the machine's outward address unless multi-node clusters are "unsupported"
here: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps everything on the loopback. Ray reads it when it is
imported, so this module sets it in `os.environ` before its (lazy) import of Ray; a gateway started
afterwards (`bench.live.LiveServer`) inherits it. Ray is imported only when a cluster is started.

`replica_counters` asks every replica's actor for its own counters (`engine.remote.ReplicaActor.sessions`):
the first call makes this process a Ray driver of the cluster, which `stop` ends before the nodes go.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

__all__ = ["LocalRayCluster", "NODE_CPUS", "ray_installed"]

NODE_CPUS = 2        # each node: one replica (`cpu_threads: 1`) and room for a lost node's replica
NAMESPACE = "cliffguard"   # the replicas' Ray namespace (gateway.workers.ray_cluster.NAMESPACE: bench may not
                           # import the gateway)
COUNTERS_TIMEOUT_S = 2.0   # a replica's actor that does not answer `sessions` this long (restarting) is left out
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
INSTALL_HINT = "pip install -e '.[ray]'"


def ray_installed() -> bool:
    """Whether Ray can be imported (without importing it)."""
    from importlib.util import find_spec

    return find_spec("ray") is not None


def _import_ray() -> Any:
    """Ray, imported after the loopback settings; RuntimeError when it is missing, or when it was imported
    before them (its nodes would then announce the outward address)."""
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("a local Ray cluster: Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was "
                           "set; set it in the environment (it keeps every node on 127.0.0.1)")
    os.environ.update(LOOPBACK_ENV)
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"a local Ray cluster needs Ray: {INSTALL_HINT}") from None
    return ray


class LocalRayCluster:
    """A head node and `num_nodes - 1` worker nodes, raylets on this machine with `num_cpus` CPUs each
    (`ray.cluster_utils.Cluster`). This process starts and stops them but is not a Ray driver: it never
    calls `ray.init`. `nodes` is the head first, then the workers in the order they were added.

    `start()` once; `stop()` (idempotent) removes every node, killing their actors. As a context
    manager, a SIGTERM received meanwhile (on the main thread) becomes `SystemExit`, so the nodes are
    stopped on that way out too. Not thread-safe: one thread drives it."""

    def __init__(self, num_nodes: int, num_cpus: int = NODE_CPUS) -> None:
        if num_nodes < 1 or num_cpus < 1:
            raise ValueError(f"a local Ray cluster needs >= 1 node and >= 1 CPU each, got {num_nodes}, {num_cpus}")
        self.num_nodes, self.num_cpus = num_nodes, num_cpus
        self._cluster: Any = None
        self._driver = False               # this process called `ray.init` (`replica_counters`)
        self.nodes: list[Any] = []
        self._previous_sigterm: Any = None

    @property
    def address(self) -> str:
        """`host:port` of the head's GCS (what a device's `ray_address` names)."""
        if self._cluster is None:
            raise RuntimeError("the local Ray cluster is not started")
        return self._cluster.address

    @property
    def head(self) -> Any:
        return self.nodes[0]

    @property
    def workers(self) -> list[Any]:
        """The nodes that are not the head, still in the cluster, in the order they were added."""
        return self.nodes[1:]

    def start(self) -> LocalRayCluster:
        """Start the head and the workers and wait until all are registered (stops what it started if
        one fails)."""
        _import_ray()
        from ray.cluster_utils import Cluster

        args = {"num_cpus": self.num_cpus, "node_ip_address": "127.0.0.1"}
        self._cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
        self.nodes = [self._cluster.head_node]
        try:
            for _ in range(self.num_nodes - 1):
                self.nodes.append(self._cluster.add_node(**args))
            self._cluster.wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def raylet_pids(self) -> dict[str, int]:
        """Node id (hex) -> its raylet's pid, of the nodes in the cluster (a node's actors are its children)."""
        return {node.node_id: node.all_processes["raylet"][0].process.pid for node in self.nodes}

    def remove_node(self, node: Any) -> None:
        """Take a worker node away: its raylet and every actor on it are killed (Ray restarts the actors
        that may restart on the nodes left)."""
        if node is self.head:
            raise ValueError("the head node holds the cluster's GCS: remove a worker node")
        self._cluster.remove_node(node)
        self.nodes.remove(node)

    def replica_counters(self, timeout: float = COUNTERS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """Actor name -> the replica's own counters (`engine.remote.ReplicaActor.sessions`: its gateway
        sessions, each pool's capacity, reserved and held credits and their high-water marks) of every
        replica actor on the cluster that answers within `timeout` s and has loaded its engine. The first
        call connects this process to the cluster as a driver (blocking: call it on a thread)."""
        import ray
        from ray.exceptions import RayError

        if not self._driver:
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING",
                     configure_logging=False)
            self._driver = True
        refs = {}
        for name in ray.util.list_named_actors(all_namespaces=False):
            try:
                refs[name] = ray.get_actor(name, namespace=NAMESPACE).sessions.remote()
            except (ValueError, AttributeError):   # removed meanwhile, or not a replica (a scaling lease)
                continue
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        counters = {}
        for name, ref in refs.items():
            try:
                answer = ray.get(ref) if ref in ready else None
            except RayError:                 # the actor died meanwhile
                continue
            if answer:
                counters[name] = answer
        return counters

    def stop(self) -> None:
        """Remove every node (idempotent); first, this process's driver connection, if it made one."""
        if self._driver:
            import ray

            ray.shutdown()
            self._driver = False
        cluster, self._cluster, self.nodes = self._cluster, None, []
        if cluster is not None:
            cluster.shutdown()

    def __enter__(self) -> LocalRayCluster:
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
