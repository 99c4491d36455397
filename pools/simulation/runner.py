"""A whole configuration simulated: route the requests, run every planned device, and the shared
layout (every device's pools merged into one) to compare a split against."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig, PoolConfig
from engine.step_cost import StepTime
from pools.capacity_plan import CapacityPlan, DevicePlan
from pools.simulation.devicesim import DeviceSim, PoolTrace, SimRequest
from pools.spec import CliffguardConfig, PoolSpec, RouteSpec, SpecError
from pools.workload import WorkloadClass, class_arrivals


@dataclass
class SimulationResult:
    requests: list[SimRequest]
    pools: dict[str, dict[str, Any]]
    traces: dict[str, PoolTrace]
    simulated_seconds: float
    wall_seconds: float
    num_steps: int


def route(config: CliffguardConfig, plan: CapacityPlan, prompt_len: int) -> str | None:
    """The pool the gateway would route a prompt of `prompt_len` tokens to (first local pool in config
    order whose route admits it; one model per configuration here), or None."""
    for spec in config.pools:
        if spec.name in plan.pools and spec.route.admits(prompt_len, plan.pools[spec.name].max_model_len):
            return spec.name
    return None


def make_requests(classes: tuple[WorkloadClass, ...], request_rate: float, *, duration: float,
                  burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """The workload's requests with their lengths drawn as `bench serve` draws them."""
    requests = []
    rng = random.Random(seed)
    for n, (t, _, cls) in enumerate(class_arrivals(classes, request_rate, burstiness=burstiness,
                                                   duration=duration, seed=seed)):
        requests.append(SimRequest(f"r{n}", cls.name, t, cls.prompt_len.sample(rng), cls.output_len.sample(rng)))
    return requests


def simulate(config: CliffguardConfig, plan: CapacityPlan, model_configs: Mapping[str, ModelConfig],
             requests: list[SimRequest], step_times: Mapping[str, StepTime], *, credits: bool = True,
             seed: int = 0) -> SimulationResult:
    """Route `requests` and run every planned device on its step-time model (`step_times[device]`)."""
    started = time.perf_counter()
    if plan.upstream_pools:
        raise SpecError(f"pools: {', '.join(plan.upstream_pools)} are remote upstreams; simulate plans local "
                        "pools only")
    for request in requests:
        request.pool = route(config, plan, request.prompt_len)
        if request.pool is None:
            request.error = f"no pool takes a prompt of {request.prompt_len} tokens"
    sims: dict[str, DeviceSim] = {}
    for dplan in plan.devices.values():
        sims[dplan.name] = _device_sim(config, plan, dplan, model_configs, step_times[dplan.name], credits, seed)
        sims[dplan.name].run([r for r in requests if r.pool in dplan.pools])
    pools, traces = {}, {}
    for sim in sims.values():
        for name, scheduler in sim.schedulers.items():
            stats = scheduler.stats
            pools[name] = {"num_blocks": scheduler.block_manager.num_blocks,
                           "max_num_seqs": scheduler.config.max_num_seqs,
                           "preemption_mode": scheduler.config.preemption_mode,
                           "preemptions": stats.num_preemptions,
                           "recompute_preemptions": stats.num_recompute_preemptions,
                           "swap_preemptions": stats.num_swap_preemptions,
                           "recomputed_tokens": stats.num_recomputed_tokens,
                           "swapped_blocks": stats.num_swapped_out_blocks + stats.num_swapped_in_blocks,
                           "computed_tokens": stats.num_computed_tokens,
                           "generated_tokens": stats.num_generated_tokens,
                           "death_spirals": [{"at_s": t, "reason": why} for t, why in sim.spiral_trips[name]]}
            traces[name] = sim.traces[name]
    return SimulationResult(requests, pools, traces,
                            simulated_seconds=max((s.clock for s in sims.values()), default=0.0),
                            wall_seconds=time.perf_counter() - started,
                            num_steps=sum(s.num_steps for s in sims.values()))


def _device_sim(config: CliffguardConfig, plan: CapacityPlan, dplan: DevicePlan,
                model_configs: Mapping[str, ModelConfig], step_time: StepTime, credits: bool,
                seed: int) -> DeviceSim:
    pools, lens, spirals = [], {}, {}
    for name in dplan.pools:
        pplan = plan.pools[name]
        spirals[name] = pplan.spec.death_spiral
        scheduler = pplan.spec.scheduler_config(pplan.max_num_seqs, pplan.max_model_len)
        pools.append(PoolConfig(name=name, num_blocks=pplan.num_blocks, scheduler=scheduler, slo=pplan.spec.slo))
        lens[name] = pplan.max_model_len
    return DeviceSim(pools, block_size=dplan.block_size, max_model_lens=lens, step_time=step_time,
                     kv_bytes_per_token=dplan.kv_bytes_per_token_per_device, credits=credits, seed=seed,
                     spirals=spirals)


def shared_layout(config: CliffguardConfig, plan: CapacityPlan) -> CliffguardConfig:
    """The same devices with each device's local pools merged into one pool named `shared` that takes
    every prompt: the sum of their KV, the sum of their planned `max_num_seqs` (so the shared pool
    runs as many sequences as the split ones together), the largest `max_model_len` and
    `max_num_batched_tokens`, the first pool's other settings (preemption, block size, prefix cache)
    and no SLO. What one server without pools would be, planned with the same numbers."""
    pools: list[PoolSpec] = []
    for dplan in plan.devices.values():
        members = [plan.pools[name] for name in dplan.pools]
        first = members[0].spec
        share = sum(p.kv_cache_bytes_per_device for p in members) / dplan.kv_space_bytes_per_device
        pools.append(dataclasses.replace(
            first, name="shared" if len(plan.devices) == 1 else f"shared-{dplan.name}", route=RouteSpec(),
            kv_share=min(1.0, share), kv_cache_bytes=None, max_num_seqs=sum(p.max_num_seqs for p in members),
            max_model_len=max(p.max_model_len for p in members),
            max_num_batched_tokens=max(p.spec.max_num_batched_tokens for p in members), slo=None,
            slo_source=None, avg_len=first.avg_len))
    return dataclasses.replace(config, pools=tuple(pools))
