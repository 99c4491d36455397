"""A whole configuration simulated: route the requests, run every planned device (a device with
`replicas: R` as R replicas behind one credit queue per pool, `pools.simulation.devicesim`), and the
shared layout (every device's pools merged into one) to compare a split against."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.calibration import slo_from_step, slo_probe, slo_share
from engine.config import LatencySLO, PoolConfig, parse_dtype
from engine.model_config import ModelConfig
from engine.models import held_expert_bytes
from engine.roofline import PRESETS, RooflineStepTime
from engine.step_cost import StepFeatures, StepTime, read_step_model
from pools.capacity_plan import CapacityPlan, DevicePlan
from pools.simulation.devicesim import DeviceSim, PoolTrace, SimRequest
from pools.simulation.devicesim import ReplicaGroup
from pools.config.spec import CliffguardConfig, PoolSpec, RouteSpec, SpecError
from pools.workload import WorkloadClass, class_arrivals, class_rates, load_workload


@dataclass
class SimulationResult:
    """What `simulate` saw. `pools[name]`: the plan's per-replica `num_blocks` and `max_num_seqs`, the
    counters summed over the pool's replicas, and each replica's own under `replicas`; `traces[name]`:
    one trace per replica; `replicas[device]`: how many replicas the device has (an autoscaled one its max,
    from the start: `autoscaled[device]` is its min, scaling up not modelled)."""

    requests: list[SimRequest]
    pools: dict[str, dict[str, Any]]
    traces: dict[str, list[PoolTrace]]
    simulated_seconds: float
    wall_seconds: float
    num_steps: int
    replicas: dict[str, int] = field(default_factory=dict)
    autoscaled: dict[str, int] = field(default_factory=dict)


def served_model(config: CliffguardConfig) -> str | None:
    """The one model name (`PoolSpec.model_name`) the local pools serve (a file of upstream pools only: the one
    they serve). A workload names no model, so `simulate` and `capacity --rate` take one model's pools at a time:
    SpecError naming each model's pools when they serve several."""
    models: dict[str, list[str]] = {}
    for spec in config.local_pools or config.pools:
        models.setdefault(spec.model_name, []).append(spec.name)
    if len(models) > 1:
        listed = "; ".join(f"{model!r}: {', '.join(names)}" for model, names in models.items())
        which = "local pools" if config.local_pools else "pools"
        raise SpecError(f"pools: the {which} serve {len(models)} models ({listed}); a workload names no "
                        "model, so simulate and capacity --rate take one model at a time: keep one model's pools "
                        "(and their devices) in a copy of the file")
    return next(iter(models), None)


def model_pools(config: CliffguardConfig) -> tuple[PoolSpec, ...]:
    """The pools, local and upstream, that serve the local pools' one model (`served_model`), in
    configuration order: the gateway's candidates for the workload's requests."""
    model = served_model(config)
    return tuple(spec for spec in config.pools if spec.model_name == model)


def route(pools: tuple[PoolSpec, ...], plan: CapacityPlan, prompt_len: int) -> str | None:
    """The pool the gateway would route a prompt of `prompt_len` tokens to: the first of `pools`
    (`model_pools`) whose route admits it, an upstream pool included (then its name: no local pool
    takes that prompt); None if none."""
    for spec in pools:   # an upstream pool's max_model_len where given (else its tokenizer's context: unknown here)
        max_model_len = plan.pools[spec.name].max_model_len if spec.name in plan.pools else spec.max_model_len
        if spec.route.admits(prompt_len, max_model_len):
            return spec.name
    return None


def make_requests(classes: tuple[WorkloadClass, ...], request_rate: float, *, duration: float,
                  burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """The workload's requests with their lengths drawn as `bench serve` draws them. A class's
    `shared_prefix` adds its document's tokens to every prompt (the sharing itself is not modelled)."""
    requests = []
    rng = random.Random(seed)
    for n, (t, _, cls) in enumerate(class_arrivals(classes, request_rate, burstiness=burstiness,
                                                   duration=duration, seed=seed)):
        requests.append(SimRequest(f"r{n}", cls.name, t, *_draw_lengths(cls, rng)))
    return requests


def _draw_lengths(cls: WorkloadClass, rng: random.Random) -> tuple[int, int]:
    """(prompt_len, output_len) of one request of `cls`: its shared document's tokens, if any, plus its own."""
    prefix = cls.shared_prefix.tokens if cls.shared_prefix is not None else 0
    prompt_len = prefix + cls.prompt_len.sample(rng)
    return prompt_len, cls.output_len.sample(rng)


def workload_mix(config: CliffguardConfig, plan: CapacityPlan, classes: tuple[WorkloadClass, ...], request_rate: float,
                 *, num_draws: int = 4096, seed: int = 0) -> tuple[dict[str, tuple[float, float, float]], float]:
    """Each pool's (requests/s, mean prompt tokens, mean output tokens) when `classes` arrive at
    `request_rate`, and the requests/s whose prompt no pool takes (left out): each class at its rate
    (`class_rates`), its lengths drawn `num_draws` times as `make_requests` draws them and each draw
    routed as `simulate` routes it (a class whose lengths straddle a route splits between pools). A
    local pool offered nothing gets (0, 0, 0); an upstream pool is in the mix only when it is offered
    something, and no device carries it. One model's pools (`served_model`)."""
    rng = random.Random(seed)
    rates = class_rates(classes, request_rate)
    pools = model_pools(config)
    sums = {name: [0.0, 0.0, 0.0] for name in plan.pools}       # requests/s, prompt and output tokens/s
    unrouted = 0.0
    for cls in classes:
        share = rates[cls.name] / num_draws
        for _ in range(num_draws):
            prompt_len, output_len = _draw_lengths(cls, rng)
            pool = route(pools, plan, prompt_len)
            if pool is None or (pool in plan.pools and prompt_len + output_len > plan.pools[pool].max_model_len):
                unrouted += share   # no pool takes its prompt, or its context holds it with its output: refused
                continue
            for i, value in enumerate((share, share * prompt_len, share * output_len)):
                sums.setdefault(pool, [0.0, 0.0, 0.0])[i] += value
    mix = {name: (rate, prompt / rate, output / rate) if rate > 0 else (0.0, 0.0, 0.0)
           for name, (rate, prompt, output) in sums.items()}
    return mix, unrouted


def upstream_rates(config: CliffguardConfig, plan: CapacityPlan, workload: str,
                   request_rate: float) -> dict[str, float]:
    """The requests/s of `workload` (`load_workload`'s file or name) at `request_rate` that go to each
    upstream pool offered any (`workload_mix`): the gateway sends them on, so no device's load has them."""
    if not plan.upstream_pools:
        return {}
    mix, _ = workload_mix(config, plan, load_workload(workload), request_rate)
    return {name: mix[name][0] for name in plan.upstream_pools if name in mix}


def device_step_times(plan: CapacityPlan, model_configs: Mapping[str, ModelConfig], *, preset: str,
                      step_model: str | None = None) -> dict[str, StepTime]:
    """Each planned device's step-time model: the measured one in the `step_model` file (from
    `simulate --calibrate`) for every device (its swap copies at the bandwidth measured with it, else at
    the `preset`'s: never free), else the `preset` GPU's roofline for the device's model, dtype, KV cache
    dtype and tensor parallelism."""
    if step_model is not None:
        measured = read_step_model(step_model)
        if measured.swap_bandwidth is None:
            measured = dataclasses.replace(measured, swap_bandwidth=PRESETS[preset].swap_bandwidth)
        return {d.name: measured for d in plan.devices.values()}
    return {d.name: RooflineStepTime(PRESETS[preset], model_configs[d.model], parse_dtype(d.dtype).itemsize,
                                     d.tensor_parallel_size, getattr(torch, d.kv_cache_dtype).itemsize,
                                     _held_bytes(d, model_configs[d.model]))
            for d in plan.devices.values()}


def _held_bytes(d: DevicePlan, model: ModelConfig) -> tuple[int, int] | None:
    """(weights, routed experts) bytes a device holding FP8 projections, packed experts or INT4 projections reads (the
    plan's weights, the experts as held); None for weights in the model's dtype (the roofline counts them itself)."""
    if not (d.fp8_weights or d.packed_experts or d.int4_projections):
        return None
    return d.weights_bytes, held_expert_bytes(model, parse_dtype(d.dtype), "fp8", d.device_type)


def step_model_label(preset: str, step_model: str | None = None) -> str:
    """What `device_step_times(..., preset=preset, step_model=step_model)` uses, for a report line."""
    return f"step model {step_model}" if step_model is not None else f"roofline {preset}"


def simulate(config: CliffguardConfig, plan: CapacityPlan, model_configs: Mapping[str, ModelConfig],
             requests: list[SimRequest], step_times: Mapping[str, StepTime], *, credits: bool = True,
             max_queue: bool = True, seed: int = 0) -> SimulationResult:
    """Route `requests` and run every planned device on its step-time model (`step_times[device]`);
    `max_queue`: each pool's max_queue_seconds refuses requests as the gateway does (off: every request waits,
    as a replay of requests a real run served must)."""
    started = time.perf_counter()
    _check_local(plan)
    pools = model_pools(config)
    for request in requests:
        request.pool = route(pools, plan, request.prompt_len)
        if request.pool is None:
            request.error = f"no pool takes a prompt of {request.prompt_len} tokens"
    groups: dict[str, ReplicaGroup] = {}
    for dplan in plan.devices.values():
        groups[dplan.name] = _device_group(config, plan, dplan, model_configs, step_times[dplan.name], credits, seed,
                                           max_queue)
        groups[dplan.name].run([r for r in requests if r.pool in dplan.pools])
    pools, traces = {}, {}
    for group in groups.values():
        for name in group.pools:
            pools[name] = _pool_result(group, name, [r for r in requests if r.pool == name])
            traces[name] = [sim.traces[name] for sim in group.replicas]
    sims = [sim for group in groups.values() for sim in group.replicas]
    return SimulationResult(requests, pools, traces,
                            simulated_seconds=max((s.clock for s in sims), default=0.0),
                            wall_seconds=time.perf_counter() - started,
                            num_steps=sum(s.num_steps for s in sims),
                            replicas={name: group.num_replicas for name, group in groups.items()},
                            autoscaled={d.name: d.initial_replicas for d in plan.devices.values() if d.autoscaled})


def _check_local(plan: CapacityPlan) -> None:
    """SpecError when the plan has upstream pools: a simulation runs local pools only."""
    if plan.upstream_pools:
        raise SpecError(f"pools: {', '.join(plan.upstream_pools)} are remote upstreams; simulate plans local "
                        "pools only")


_COUNTERS = {"preemptions": "num_preemptions", "recompute_preemptions": "num_recompute_preemptions",
             "swap_preemptions": "num_swap_preemptions", "recomputed_tokens": "num_recomputed_tokens",
             "computed_tokens": "num_computed_tokens", "generated_tokens": "num_generated_tokens"}


def _pool_result(group: ReplicaGroup, name: str, requests: list[SimRequest]) -> dict[str, Any]:
    """One pool's figures: the plan's per-replica size, each counter summed over the replicas, and
    each replica's own (requests admitted there, their prompt + output tokens, its counters)."""
    replicas = []
    for sim in group.replicas:
        stats = sim.schedulers[name].stats
        mine = [r for r in requests if r.replica == sim.replica]
        replicas.append({"requests": len(mine), "tokens": sum(r.prompt_len + r.output_len for r in mine),
                         **{key: getattr(stats, attr) for key, attr in _COUNTERS.items()},
                         "swapped_blocks": stats.num_swapped_out_blocks + stats.num_swapped_in_blocks})
    scheduler = group.replicas[0].schedulers[name]
    total = {key: sum(r[key] for r in replicas) for key in (*_COUNTERS, "swapped_blocks")}
    trips = sorted((t, sim.replica, why) for sim in group.replicas for t, why in sim.spiral_trips[name])
    return {"num_blocks": scheduler.block_manager.num_blocks, "max_num_seqs": scheduler.config.max_num_seqs,
            "preemption_mode": scheduler.config.preemption_mode,
            "preemptions": total["preemptions"], "recompute_preemptions": total["recompute_preemptions"],
            "swap_preemptions": total["swap_preemptions"], "recomputed_tokens": total["recomputed_tokens"],
            "swapped_blocks": total["swapped_blocks"], "computed_tokens": total["computed_tokens"],
            "generated_tokens": total["generated_tokens"],
            "death_spirals": [{"at_s": t, "reason": why, "replica": r} for t, r, why in trips],
            "replicas": replicas}


def modelled_slo(step_time: StepTime, max_num_seqs: int, num_blocks: int, block_size: int,
                 max_model_len: int, min_share: float = 0.0) -> LatencySLO:
    """Isolation by default's SLO on a modelled device: `engine.calibration`'s rule, the probe decode
    step's time taken from `step_time` instead of measured."""
    batch, context = slo_probe(max_num_seqs, num_blocks, block_size, max_model_len)
    step = StepFeatures()
    for _ in range(batch):
        step.add(context, 1, is_decode=True)
    return slo_from_step(step_time.seconds((), step, batch), min_share)


def _device_group(config: CliffguardConfig, plan: CapacityPlan, dplan: DevicePlan,
                  model_configs: Mapping[str, ModelConfig], step_time: StepTime, credits: bool,
                  seed: int, max_queue: bool = True) -> ReplicaGroup:
    """The device's `replicas` DeviceSims, alike, behind one group (the gateway's queues)."""
    pools, lens, spirals, avg_lens = [], {}, {}, {}
    model = model_configs[dplan.model]   # a model with state layers: pools as the engine serves them
    owed = slo_share(plan.pools[n].spec.engine_min_share for n in dplan.pools if plan.pools[n].spec.slo is None)
    for name in dplan.pools:
        pplan = plan.pools[name]
        spirals[name] = pplan.spec.death_spiral
        scheduler = pplan.spec.scheduler_config(pplan.max_num_seqs, pplan.max_model_len)
        slo = pplan.spec.slo
        if pplan.spec.slo_source == "default":      # as a real worker derives it, on the modelled step
            slo = modelled_slo(step_time, pplan.max_num_seqs, pplan.num_blocks, dplan.block_size, pplan.max_model_len,
                               owed)
        pools.append(model.serving_pool(PoolConfig(name=name, num_blocks=pplan.num_blocks, scheduler=scheduler,
                                                   slo=slo, min_share=pplan.spec.engine_min_share)))
        lens[name] = pplan.max_model_len
        avg_lens[name] = pplan.spec.avg_len
    group = ReplicaGroup(pools, block_size=dplan.block_size, num_replicas=dplan.replicas, avg_lens=avg_lens,
                         credits=credits, seed=seed,
                         max_queue={name: plan.pools[name].spec.max_queue_seconds for name in dplan.pools}
                         if max_queue else None)
    for _ in range(dplan.replicas):
        DeviceSim(pools, block_size=dplan.block_size, max_model_lens=lens, step_time=step_time,
                  kv_bytes_per_token=dplan.kv_bytes_per_token_per_device, spirals=spirals, group=group,
                  state_model=model.state_bytes_per_seq(torch.float32) > 0 or dplan.sliding_window > 0)
    return group


def shared_layout(config: CliffguardConfig, plan: CapacityPlan) -> CliffguardConfig:
    """The same devices with each device's local pools merged into one pool that takes the prompts its
    pools took: `shared` taking every prompt for one device; for several, `shared-<device>` taking the
    lengths from its pools' shortest to their longest prompt, so each prompt goes to the device the
    split layout sends it to (SpecError when two devices' ranges interleave). Each has the sum of its
    pools' KV, the sum of their planned `max_num_seqs` (so it runs as many sequences as the split ones
    together), the largest `max_model_len` and `max_num_batched_tokens`, the first pool's other
    settings (preemption, block size, prefix cache) and no SLO: what one server without pools would
    be, planned with the same numbers. A replicated device stays replicated: each replica's pools are
    merged (the plan's numbers are one replica's). One model's local pools (`served_model`)."""
    served_model(config)
    _check_local(plan)
    pools: list[PoolSpec] = []
    for dplan in plan.devices.values():
        members = [plan.pools[name] for name in dplan.pools]
        first = members[0].spec
        share = sum(p.kv_cache_bytes_per_device for p in members) / dplan.kv_space_bytes_per_device
        pools.append(first.replace(
            name="shared" if len(plan.devices) == 1 else f"shared-{dplan.name}",
            route=RouteSpec() if len(plan.devices) == 1 else _device_route(plan, dplan),
            kv_share=min(1.0, share), kv_cache_bytes=None, max_num_seqs=sum(p.max_num_seqs for p in members),
            max_model_len=max(p.max_model_len for p in members),
            max_num_batched_tokens=max(p.spec.max_num_batched_tokens for p in members), slo=None,
            slo_source=None, avg_len=first.avg_len))
    for i, a in enumerate(pools):
        for b in pools[:i]:
            if a.route.overlaps(b.route):
                raise SpecError(f"--layout shared: {b.name} would take prompts {b.route.describe()} and {a.name} "
                                f"{a.route.describe()}: their devices' routes interleave, so one pool per device "
                                "cannot route as the split layout does; compare the split layout alone")
    return dataclasses.replace(config, pools=tuple(pools))


def _device_route(plan: CapacityPlan, dplan: DevicePlan) -> RouteSpec:
    """From the shortest to the longest prompt the device's pools take."""
    members = [plan.pools[name] for name in dplan.pools]
    return RouteSpec(min_prompt_tokens=min(p.spec.route.min_prompt_tokens for p in members),
                     max_prompt_tokens=max(p.spec.route.upper(p.max_model_len) for p in members))
