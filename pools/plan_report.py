"""`cliffguard capacity`: a `pools.capacity_plan.CapacityPlan` as the tables it prints (`format_plan`):
each device's memory, weights and KV bytes, then each pool's route, class, budget, blocks and
concurrency (per replica, and for the whole pool when a device is replicated).

With an arrival mix (`capacity --rate`, `simulate`), each device's overload verdict for it
(`plan_verdicts`, `format_verdicts`): `pools.demand.planned_load` over the plan's pools, the live
gateway's definitions (docs/GATEWAY.md "Overload"). An autoscaled device (`replicas: {min, max}`) is
planned and judged at its max, the replicas it can grow to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model_config import ModelConfig
from engine.step_cost import StepTime
from pools.capacity_plan import CapacityPlan, DevicePlan, PoolPlan
from pools.config.checks import fmt_bytes
from pools.demand import OFF_LOAD, PlannedPool, planned_load, replicas_needed
from pools.config.spec import CliffguardConfig, PoolSpec, SpecError
from pools.workload import load_workload

DEFAULT_PRESET = "h100"     # capacity --rate's roofline for GPUs when neither --device nor --step-model is given


def _budget(p: PoolPlan, d: DevicePlan) -> str:
    per = "/GPU" if p.tensor_parallel_size > 1 else ""
    if p.spec.kv_share is None:
        return f"{fmt_bytes(p.kv_cache_bytes_per_device)}{per} (kv_cache_bytes)"
    return f"{p.spec.kv_share} x {fmt_bytes(d.kv_space_bytes_per_device)} = {fmt_bytes(p.kv_cache_bytes_per_device)}{per}"


def _service_class(spec: PoolSpec) -> str:
    """`interactive`, `interactive (default)`, `throughput`, `throughput (slo: null)`."""
    note = {"default": " (default)", "opted_out": " (slo: null)"}.get(spec.slo_source or "", "")
    return spec.service_class + note


def _device_lines(d: DevicePlan) -> list[str]:
    """A device's header line and its memory rows, then a blank line."""
    tp = d.tensor_parallel_size
    per = " per GPU" if tp > 1 else ""
    copies = (f", replicas {d.min_replicas}..{d.replicas} (autoscaled), each planned alike" if d.autoscaled
              else f", replicas={d.replicas} (each planned alike)" if d.replicas > 1 else "")
    copies += ", placement: ray" if d.placement == "ray" else ""
    rows = [
        ("memory", f"{fmt_bytes(d.memory_bytes)}{per} ({d.memory_source})"),
        ("utilization", f"{d.memory_utilization} -> {fmt_bytes(d.usable_bytes)}{per}"),
        ("weights", f"{fmt_bytes(d.weights_bytes)} ({d.weights_bytes:,} B)"
                    + (", its layers' projections in FP8" if d.fp8_weights else "")
                    + (f", its experts in {d.packed_experts} as stored" if d.packed_experts else "")
                    + (f", {d.int4_projections} projections in INT{d.int_bits} as stored" if d.int4_projections
                       else "")
                    + (f", {fmt_bytes(d.weights_bytes_per_device)} per GPU" if tp > 1 else "")),
        *([("graphs", f"{fmt_bytes(d.graph_bytes_per_device)}{per} for the decode CUDA graphs "
                      "(enforce_eager: true frees it)")] if d.graph_bytes_per_device else []),
        ("KV bytes", f"{fmt_bytes(d.kv_space_bytes_per_device)}{per}"
                     + (f", {fmt_bytes(d.kv_space_bytes)} per replica" if tp > 1 and d.replicas > 1 else "")
                     + (f", {fmt_bytes(d.kv_space_bytes * d.replicas)} total" if tp > 1 or d.replicas > 1 else "")),
        ("S_KV", f"{d.kv_bytes_per_token:,} B/token ({fmt_bytes(d.kv_bytes_per_token)}, {d.kv_cache_dtype})"
                 + (f", {d.kv_bytes_per_token_per_device:,} B per GPU" if tp > 1 else "")
                 + (f"{_ring_layers(d)}, a window of {d.sliding_window:,}: a ring a sequence, in S_state)"
                    if d.sliding_window else "")),
    ]
    return ([f"device {d.name}: {d.device_type}, {d.dtype}, TP={tp}{copies}, model {d.model}"]
            + [f"  {k:<13} {v}" for k, v in rows] + [""])


def _ring_layers(d: DevicePlan) -> str:
    """What S_KV counts where a device keeps rings: the full layers, or none where every layer slides."""
    return ", the full layers' (the sliding ones" if d.kv_bytes_per_token else ", no layer's (every one slides"


def format_plan(plan: CapacityPlan) -> str:
    """The plan as the tables `cliffguard capacity` prints."""
    lines = []
    pools = list(plan.pools.values())
    for d in plan.devices.values():
        lines += _device_lines(d)
    if pools:
        header = ["pool"] + [p.name for p in pools]
        table = [
            ("device", [p.device for p in pools]),
            ("route (tokens)", [p.spec.route.describe() for p in pools]),
            ("class", [_service_class(p.spec) for p in pools]),
            ("slo", ["-" if p.spec.slo is None else "from the measured step" if p.spec.slo_source == "default"
                     else f"ttft {p.spec.slo.ttft_ms:g} ms, itl {p.spec.slo.itl_ms:g} ms"
                     for p in pools]),
            ("max_model_len", [str(p.max_model_len) for p in pools]),
            ("S_KV", [f"{p.kv_bytes_per_token:,} B" + (f" ({p.kv_bytes_per_token_per_device:,}/GPU)"
                                                       if p.tensor_parallel_size > 1 else "")
                      for p in pools]),
            ("KV budget", [_budget(p, plan.devices[p.device]) for p in pools]),
            ("blocks", [f"{p.num_blocks:,} x {p.block_size}" for p in pools]),
            ("avg_len", [str(p.spec.avg_len) for p in pools]),
            ("max_num_seqs", [f"{p.max_num_seqs}" + (f" (formula {p.formula_max_num_seqs})"
                                                     if p.max_num_seqs != p.formula_max_num_seqs else "")
                              + (" per replica" if p.replicas > 1 else "") for p in pools]),
            ("max-len concurrent", [f"{p.max_concurrent_at_max_len} ({p.blocks_per_max_len_request} blocks each)"
                                    for p in pools]),
            ("fragmentation", [f"{fmt_bytes(p.fragmentation_bytes)} ({100 * p.fragmentation_fraction:.2f}%)"
                               for p in pools]),
        ]
        if any(p.state_bytes_per_seq for p in pools):   # linear-attention layers' states, sliding layers' rings
            table.insert(table.index(next(row for row in table if row[0] == "S_KV")) + 1,
                         ("S_state", [f"{fmt_bytes(p.state_bytes_per_seq)} a sequence"
                                      + ("/GPU" if p.tensor_parallel_size > 1 else "")
                                      + (f" (a ring of {p.sliding_ring_tokens:,})" if p.sliding_ring_tokens else "")
                                      + _snapshots(p)
                                      for p in pools]))
        if any(p.replicas > 1 for p in pools):
            table.insert(table.index(next(row for row in table if row[0] == "max_num_seqs")) + 1,
                         ("whole pool", [f"{p.pool_max_num_seqs} sequences ({p.replicas} x {p.max_num_seqs}"
                                         + (" at max)" if plan.devices[p.device].autoscaled else ")")
                                         for p in pools]))
        widths = [max(len(header[0]), *(len(k) for k, _ in table))]
        for c in range(len(pools)):
            widths.append(max(len(header[c + 1]), *(len(vals[c]) for _, vals in table)))

        def row(cells):
            return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

        lines.append(row(header))
        lines += [row([k, *vals]) for k, vals in table]
        if any(p.spec.slo_source == "default" for p in pools):
            lines.append("interactive (default): the strictly shortest route on a device where no pool names an slo; "
                         "its slo comes from the device's measured decode step when the worker starts (`simulate`: "
                         "the modelled step); `slo: null` opts a pool out (config/README.md)")
    if plan.upstream_pools:
        lines.append(f"upstream pools (not planned here): {', '.join(plan.upstream_pools)}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


# --- the overload verdict of a planned mix ----------------------------------------------------------

def plan_verdicts(plan: CapacityPlan, step_times: Mapping[str, StepTime],
                  mix: Mapping[str, tuple[float, float, float]], *, step_model: str) -> dict[str, dict[str, Any]]:
    """Per device, `pools.demand.planned_load` of its pools under `mix` (pool -> requests/s, mean prompt
    and output tokens; a pool not in it is offered nothing) on `step_times[device]` (`step_model` names
    it): its offered load over its replicas (an autoscaled device's max; `min_replicas`, `max_replicas`,
    `autoscaled` and `placement` say its shape), overloaded (load > 1), the replicas that carry it at most
    `OFF_LOAD` busy, and each pool's inputs (the plan's `max_num_seqs`, KV credits per replica = blocks x
    block_size, `max_num_batched_tokens`), offered tokens/s, capacity and share of the load."""
    verdicts = {}
    for d in plan.devices.values():
        planned = [PlannedPool(p.name, *mix.get(p.name, (0.0, 0.0, 0.0)), max_num_seqs=p.max_num_seqs,
                               credits=p.num_blocks * p.block_size, chunk=p.spec.max_num_batched_tokens)
                   for p in (plan.pools[name] for name in d.pools)]
        device = planned_load(step_times[d.name], planned, d.replicas)
        pools = {}
        for inputs, load in zip(planned, device.pools):
            pools[inputs.name] = {
                "rate": inputs.rate, "prompt_tokens": inputs.prompt_tokens, "output_tokens": inputs.output_tokens,
                "max_num_seqs": inputs.max_num_seqs, "credits": inputs.credits, "max_num_batched_tokens": inputs.chunk,
                "offered_prefill": load.offered_prefill, "offered_decode": load.offered_decode,
                "prefill_capacity": load.rates.prefill, "decode_capacity": load.rates.decode,
                "decode_batch": load.rates.batch, "load": load.load / device.replicas}
        verdicts[d.name] = {"step_model": step_model, "offered_load": device.load, "replicas": device.replicas,
                            "min_replicas": d.initial_replicas, "max_replicas": d.replicas,
                            "autoscaled": d.autoscaled, "placement": d.placement,
                            "overloaded": device.load > 1.0, "replicas_needed": replicas_needed(device.pools),
                            "pools": pools}
    return verdicts


def rate_verdicts(config: CliffguardConfig, plan: CapacityPlan, model_configs: Mapping[str, ModelConfig],
                  workload: str, rate: float, *, preset: str | None = None,
                  step_model: str | None = None) -> tuple[dict[str, dict[str, Any]], float]:
    """`cliffguard capacity --rate`: `plan_verdicts` for the classes of `workload` (a file or a built-in
    name, `pools.workload.load_workload`) at `rate` requests/s (`pools.simulation.runner.workload_mix`)
    on the measured `step_model` file, on `preset`'s roofline,
    or with neither on `DEFAULT_PRESET`'s for a plan of GPUs (SpecError for a CPU: it has no preset);
    and the requests/s whose prompt no pool takes, left out of the verdicts."""
    from pools.simulation.runner import device_step_times, step_model_label, workload_mix

    cpu = [d.name for d in plan.devices.values() if d.device_type == "cpu"]
    if step_model is None and preset is None and cpu:
        raise SpecError(f"--rate: device {cpu[0]} is planned as a CPU, which has no roofline preset; give "
                        "--step-model FILE (measured with `cliffguard simulate --calibrate FILE`) or --device PRESET")
    preset = preset or DEFAULT_PRESET
    steps = device_step_times(plan, model_configs, preset=preset, step_model=step_model)
    mix, unrouted = workload_mix(config, plan, load_workload(workload), rate)
    return plan_verdicts(plan, steps, mix, step_model=step_model_label(preset, step_model)), unrouted


def _verdict_word(v: dict[str, Any]) -> str:
    """An autoscaled device is judged at its max (`replicas`: the replicas it can grow to)."""
    needed, top = v["replicas_needed"], v["replicas"]
    carry = f"{needed} replicas would carry it at most {OFF_LOAD:.0%} busy"
    if v.get("autoscaled") and needed > top:
        carry = f"needs {needed} replicas, max is {top} ({carry})"
    if v["overloaded"]:
        return f"overloaded; {carry}"
    if needed > top:
        return f"within capacity, over {OFF_LOAD:.0%} busy; {carry}"
    if v.get("autoscaled"):
        low = v["min_replicas"]
        return (f"within capacity; it needs {max(needed, low)} of its {low}..{top} replicas "
                f"(each at most {OFF_LOAD:.0%} busy)")
    return "within capacity"


def format_verdicts(verdicts: Mapping[str, dict[str, Any]], *, unrouted: float = 0.0) -> list[str]:
    """Per device: one verdict line, then a line per pool with what it was offered and what it can do;
    a warning when `unrouted` requests/s had a prompt no pool takes."""
    lines = []
    for name, v in verdicts.items():
        parts = ", ".join(f"{pool} {p['load']:.2f}" for pool, p in v["pools"].items())
        at_max = " (autoscaled: its max)" if v.get("autoscaled") else ""
        lines.append(f"device {name}: offered load {v['offered_load']:.2f} of {v['replicas']} replica(s)' time"
                     f"{at_max} ({parts}): {_verdict_word(v)}  [{v['step_model']}]")
        lines += [f"  {pool}: {p['rate']:.2f} req/s, prompt {p['prompt_tokens']:.0f} / output "
                  f"{p['output_tokens']:.0f} tokens; prefill {p['offered_prefill']:,.0f} tok/s of "
                  f"{p['prefill_capacity']:,.0f}, decode {p['offered_decode']:,.0f} tok/s of "
                  f"{p['decode_capacity']:,.0f} at batch {p['decode_batch']} (max_num_seqs {p['max_num_seqs']}, "
                  f"{p['credits']:,} credits, chunk {p['max_num_batched_tokens']})" if p["rate"] > 0
                  else f"  {pool}: offered nothing" for pool, p in v["pools"].items()]
    if unrouted > 0:
        lines.append(f"warning: {unrouted:.2f} requests/s of the workload have a prompt no pool takes, or a prompt "
                     "and output past its max_model_len (left out: refused)")
    return lines


def _snapshots(pool) -> str:
    """What a pool's prefix cache keeps beside its running sequences' states or rings (`engine.state_cache`)."""
    spec, size = pool.spec, fmt_bytes(pool.snapshot_bytes_per_seq)
    if not spec.enable_prefix_caching or spec.state_snapshots == 0 or not pool.snapshot_bytes_per_seq:
        return ""
    return f" (+ a prefix-cache snapshot of {size})" if spec.state_snapshots is None else \
        f" (+ {spec.state_snapshots} snapshots of {size})"
