"""What this machine's memory holds of the devices it runs, checked before anything loads.

Each rank of each replica of a local device keeps its swapping pools' `swap_space` in the machine's memory
(`CliffguardConfig.swap_past_memory`); a CPU device's ranks keep their weights and KV caches there too. The
KV tensor of a CPU device fills lazily (`engine.kv_cache`), so a plan past the machine's memory starts and
serves, until its blocks fill under load and the kernel's OOM killer ends a worker (both of its pools'
requests with it). `cliffguard capacity` warns of either; `serve` refuses them (`past_host_memory`). A Ray
device's replicas run on the cluster's nodes: not counted. `serve` also refuses a local CUDA device planned with
a written size larger than its GPUs here (`check_gpu_memory`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pools.config.checks import fmt_bytes
from pools.config.spec import CliffguardConfig, SpecError


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return total if total > 0 else None


def past_host_memory(config: CliffguardConfig, cpu_ranks: Sequence[tuple[str, int, int]],
                     host_bytes: int | None) -> str | None:
    """Why the devices this machine runs cannot fit its memory (`host_bytes`; None: unknown, nothing said):
    their swap spaces alone (naming the `pools[i].swap_space` past it), or with its CPU devices' weights and
    KV caches (`cpu_ranks`: each local CPU device's name, ranks, and bytes one rank holds: `CapacityPlan.
    cpu_ranks`; naming the `devices.<name>.memory` past it); None when they fit."""
    if host_bytes is None:
        return None
    if (over := config.swap_past_memory(host_bytes)) is not None:
        return over
    total = swap = sum(ranks * pool.swap_space_bytes for _, pool, ranks in config.host_swaps())
    held = []
    for name, ranks, each in cpu_ranks:
        total += ranks * each
        held.append(f"{name} {ranks} x {fmt_bytes(each)}")
        if total > host_bytes:
            swapped = f" and {fmt_bytes(swap)} of swap spaces" if swap else ""
            return (f"devices.{name}.memory: the CPU devices of this machine hold {fmt_bytes(total - swap)} of "
                    f"weights and KV cache ({', '.join(held)}: replicas x tensor_parallel_size ranks){swapped}, past "
                    f"its {fmt_bytes(host_bytes)} of memory; a KV cache fills as it serves, so the workers would run "
                    f"out of memory under load: lower memory (or replicas)")
    return None


def check_gpu_memory(config: CliffguardConfig, plans: Mapping[str, Any], engines: Mapping[str, Sequence[Any]],
                     gpu_memory: Callable[[int], int] | None = None) -> None:
    """SpecError naming `devices.<name>.memory` (or `--vram`) where a local CUDA device was planned with a size
    written down (`DevicePlan.memory_source` config or --vram) larger than one of its GPUs on this machine
    (`engines`: each device's replica EngineConfigs, their `gpu_ids`; `gpu_memory(gpu)`: its bytes, torch's by
    default): the plan's KV blocks would not fit, and its worker would refuse them only once the gateway listens.
    Nothing is said where the GPUs cannot be asked (a plan checked on a machine without them)."""
    for name, plan in plans.items():
        if config.devices[name].placement == "ray" or plan.memory_source not in ("config", "--vram"):
            continue
        for gpu in sorted({g for engine in engines.get(name, ()) for g in engine.gpu_ids or ()}):
            try:
                real = gpu_memory(gpu) if gpu_memory is not None else _torch_gpu_memory(gpu)
            except Exception:  # noqa: BLE001 - no such GPU here (CUDA not built, a plan for another machine)
                return
            if plan.memory_bytes > real:
                key = "--vram" if plan.memory_source == "--vram" else f"devices.{name}.memory"
                raise SpecError(f"{key}: {fmt_bytes(plan.memory_bytes)} a GPU, but GPU {gpu} of this machine has "
                                f"{fmt_bytes(real)}: the plan's KV blocks would not fit it (its worker would refuse "
                                "them once the gateway listens); write its size, or memory: auto")


def _torch_gpu_memory(gpu: int) -> int:
    import torch

    return torch.cuda.get_device_properties(gpu).total_memory
