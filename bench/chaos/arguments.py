"""The options of `cliffguard bench chaos`, checked, and the faults it can run by name."""

from __future__ import annotations

import argparse

from bench.chaos.fault_script import CLUSTER_FAULTS, GATEWAY_FAULTS
from bench.chaos.fault_script import FAULTS as CLIENT_AND_WORKER_FAULTS
from bench.chaos.careless import REQUEST_FAULTS
from bench.chaos.steady import Phases
from bench.ray_local import INSTALL_HINT, NODE_CPUS, ray_installed
from pools.cli_types import (check_pool_file, non_negative_float, non_negative_int, output_folder, positive_float,
                             positive_int, seed)

FAULTS = {**CLIENT_AND_WORKER_FAULTS, **REQUEST_FAULTS}    # the default run, in this order
ALL_FAULTS = {**FAULTS, **CLUSTER_FAULTS, **GATEWAY_FAULTS}
QUICK = Phases(warmup_s=8.0, fault_s=8.0, quiet_s=10.0, max_settle_s=25.0)
# --quick sizes the load faults to a few seconds of a 2-core CPU's work, so their recovery (every credit
# back) measures the gateway, not the device: 500 burst completions, 24 silent bodies or 16 x n=8 chats
# are each 17-20 s of its work.
QUICK_BURST, QUICK_SILENT_BODIES, QUICK_TENANT_BURST = 150, 8, 6


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `cliffguard bench chaos`."""
    p.add_argument("--config", default=None, help="pools YAML to serve, with its own fault timers (default: "
                   "config/pools.yaml with the gateway's fault timers shortened: write_timeout 3 s, stall_seconds "
                   "6 s, restart back-off from 0.2 s)")
    p.add_argument("--replicas", type=positive_int, default=None, help="serve every device as this many replicas, "
                   "each worker on one thread (the kill faults then kill one replica; default: as in the file)")
    p.add_argument("--ray-nodes", type=non_negative_int, default=0, help="start a local Ray cluster of this many nodes "
                   "on 127.0.0.1 (a head and N-1 workers) and place every device's replicas on it: placement: ray, "
                   "replicas: N (one per node), cpu_threads: 1; >= 2 adds the lose_node fault (default 0: off; "
                   f"needs Ray: {INSTALL_HINT})")
    p.add_argument("--gateways", type=int, default=1, choices=(1, 2), help="2: start a second gateway on the "
                   "same config, sharing the replicas on the Ray cluster (needs --ray-nodes >= 1); the steady load "
                   "goes to both in turn, a request one failed before any token is sent to the other (as a load "
                   "balancer would); adds the kill_gateway fault (default 1)")
    p.add_argument("--ray-node-cpus", type=positive_int, default=NODE_CPUS, help="CPUs of each local Ray node "
                   f"(default {NODE_CPUS}: its replica and a lost node's)")
    p.add_argument("--rate", type=positive_float, default=1.0, help="steady chat requests per second (default 1)")
    p.add_argument("--rag-rate", type=non_negative_float, default=0.05,
                   help="steady rag-ish requests per second (default 0.05)")
    p.add_argument("--warmup", type=positive_float, default=None,
                   help="seconds of load before the first fault (default 30)")
    p.add_argument("--fault-seconds", type=positive_float, default=None,
                   help="seconds of each fault's window (default 20)")
    p.add_argument("--quiet-seconds", type=positive_float, default=None, help="seconds of quiet after each fault, "
                   "extended until it recovered (default 25)")
    p.add_argument("--faults", default=None, help=f"comma-separated, in order (default all: {','.join(FAULTS)}, "
                   f"{','.join(CLUSTER_FAULTS)} with --ray-nodes >= 2, {','.join(GATEWAY_FAULTS)} with "
                   "--gateways 2)")
    p.add_argument("--burst", type=positive_int, default=None, help="connections of the burst fault (default 500; "
                   "150 with --quick: 500 two-token completions are ~19 s of a 2-core CPU's work)")
    p.add_argument("--disconnects", type=positive_int, default=40,
                   help="requests of the disconnect fault (default 40; 20 with --quick)")
    p.add_argument("--silent-bodies", type=positive_int, default=None, help="non-streamed requests of the "
                   "silent_bodies fault (default 24; 8 with --quick: 1,152 tokens with 20 top logprobs each, ~6 s "
                   "of a 2-core CPU)")
    p.add_argument("--tenant-burst", type=positive_int, default=None, help="chats of n = 8 x 24 tokens in the "
                   "tenant_burst fault (default 16; 6 with --quick: ~6 s of a 2-core CPU)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="client timeout per request in s: later is "
                   "lost (default 120)")
    p.add_argument("--seed", type=seed, default=0, help="seed of arrivals and prompts (default 0)")
    p.add_argument("--quick", action="store_true", help="short windows (the run takes 2-3 minutes), for a test")
    p.add_argument("--out", type=output_folder, default=None,
                   help="write results.json (with every request and sample) and "
                   "timeline.png here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def check_args(args: argparse.Namespace) -> Phases:
    """Validate what the options' types cannot (ValueError naming the option) and return the run's phases.
    Every number is checked where argparse reads it: a rate or a window of `inf` or `nan` is refused
    there, not found out when the run never ends."""
    base = QUICK if args.quick else Phases()
    phases = Phases(warmup_s=base.warmup_s if args.warmup is None else args.warmup,
                    fault_s=base.fault_s if args.fault_seconds is None else args.fault_seconds,
                    quiet_s=base.quiet_s if args.quiet_seconds is None else args.quiet_seconds,
                    max_settle_s=base.max_settle_s)
    if args.burst is None:
        args.burst = QUICK_BURST if args.quick else 500
    if args.silent_bodies is None:
        args.silent_bodies = QUICK_SILENT_BODIES if args.quick else 24
    if args.tenant_burst is None:
        args.tenant_burst = QUICK_TENANT_BURST if args.quick else 16
    if args.config is not None:
        check_pool_file(args.config)
    _check_ray(args)
    args.fault_names = _fault_names(args.faults, args.ray_nodes, args.gateways)
    if args.quick and args.disconnects == 40:
        args.disconnects = 20
    return phases


def _check_ray(args: argparse.Namespace) -> None:
    """--ray-nodes and --ray-node-cpus (ValueError naming the option)."""
    if args.ray_nodes and args.replicas is not None:
        raise ValueError("--replicas: not with --ray-nodes, which places one replica per node")
    if args.ray_nodes and not ray_installed():
        raise ValueError(f"--ray-nodes: needs Ray: {INSTALL_HINT}")
    if args.gateways > 1 and args.ray_nodes < 1:
        raise ValueError("--gateways: a second gateway shares the replicas on a Ray cluster: needs --ray-nodes >= 1")


def _fault_names(faults: str | None, ray_nodes: int, gateways: int = 1) -> list[str]:
    """The faults to run, in order: `--faults`, or all those this run can inject (ValueError naming --faults)."""
    if faults is None:
        return [*FAULTS, *(CLUSTER_FAULTS if ray_nodes >= 2 else ()), *(GATEWAY_FAULTS if gateways >= 2 else ())]
    names = [name.strip() for name in faults.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALL_FAULTS]
    if unknown or not names:
        raise ValueError(f"--faults: unknown {unknown or 'none given'}; choose from {', '.join(ALL_FAULTS)}")
    lost = names.count("lose_node")
    if lost and ray_nodes < 2:
        raise ValueError("--faults: lose_node needs --ray-nodes >= 2 (a local Ray cluster with a worker node that "
                         f"hosts a replica), got --ray-nodes {ray_nodes}")
    if lost and lost > ray_nodes - 1:
        raise ValueError(f"--faults: lose_node {lost} times removes {lost} worker nodes; --ray-nodes {ray_nodes} "
                         f"starts {ray_nodes - 1}")
    killed = names.count("kill_gateway")
    if killed and gateways < 2:
        raise ValueError(f"--faults: kill_gateway needs --gateways 2 (a second gateway on a Ray cluster: --ray-nodes "
                         f">= 1), got --gateways {gateways}")
    if killed > 1:
        raise ValueError(f"--faults: kill_gateway {killed} times kills {killed} gateways; --gateways 2 starts one more")
    return names

