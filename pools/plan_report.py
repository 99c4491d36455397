"""`cliffguard capacity`: a `pools.capacity_plan.CapacityPlan` as the tables it prints (`format_plan`):
each device's memory, weights and KV bytes, then each pool's route, class, budget, blocks and
concurrency (per replica, and for the whole pool when a device is replicated).
"""

from __future__ import annotations

from pools.capacity_plan import CapacityPlan, DevicePlan, PoolPlan, fmt_bytes
from pools.spec import PoolSpec


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
    copies = f", replicas={d.replicas} (each planned alike)" if d.replicas > 1 else ""
    rows = [
        ("memory", f"{fmt_bytes(d.memory_bytes)}{per} ({d.memory_source})"),
        ("utilization", f"{d.memory_utilization} -> {fmt_bytes(d.usable_bytes)}{per}"),
        ("weights", f"{fmt_bytes(d.weights_bytes)} ({d.weights_bytes:,} B)"
                    + (f", {fmt_bytes(d.weights_bytes_per_device)} per GPU" if tp > 1 else "")),
        ("KV bytes", f"{fmt_bytes(d.kv_space_bytes_per_device)}{per}"
                     + (f", {fmt_bytes(d.kv_space_bytes)} per replica" if tp > 1 and d.replicas > 1 else "")
                     + (f", {fmt_bytes(d.kv_space_bytes * d.replicas)} total" if tp > 1 or d.replicas > 1 else "")),
        ("S_KV", f"{d.kv_bytes_per_token:,} B/token ({fmt_bytes(d.kv_bytes_per_token)})"
                 + (f", {d.kv_bytes_per_token_per_device:,} B per GPU" if tp > 1 else "")),
    ]
    return ([f"device {d.name}: {d.device_type}, {d.dtype}, TP={tp}{copies}, model {d.model}"]
            + [f"  {k:<13} {v}" for k, v in rows] + [""])


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
            ("slo", ["-" if p.spec.slo is None else f"ttft {p.spec.slo.ttft_ms:g} ms, itl {p.spec.slo.itl_ms:g} ms"
                     for p in pools]),
            ("max_model_len", [str(p.max_model_len) for p in pools]),
            ("S_KV", [f"{p.kv_bytes_per_token:,} B" + (f" ({p.kv_bytes_per_token_per_device:,}/GPU)"
                                                       if p.tensor_parallel_size > 1 else "")
                      for p in pools]),
            ("KV budget", [_budget(p, plan.devices[p.device]) for p in pools]),
            ("blocks", [f"{p.num_blocks:,} x {p.block_size}" for p in pools]),
            ("avg_len", [str(p.spec.avg_len) for p in pools]),
            ("max_num_seqs", [f"{p.max_num_seqs}" + (f" (formula {p.formula_max_num_seqs})"
                                                     if p.max_num_seqs_overridden else "")
                              + (" per replica" if p.replicas > 1 else "") for p in pools]),
            ("max-len concurrent", [f"{p.max_concurrent_at_max_len} ({p.blocks_per_max_len_request} blocks each)"
                                    for p in pools]),
            ("fragmentation", [f"{fmt_bytes(p.fragmentation_bytes)} ({100 * p.fragmentation_fraction:.2f}%)"
                               for p in pools]),
        ]
        if any(p.replicas > 1 for p in pools):
            table.insert(table.index(next(row for row in table if row[0] == "max_num_seqs")) + 1,
                         ("whole pool", [f"{p.pool_max_num_seqs} sequences ({p.replicas} x {p.max_num_seqs})"
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
                         "`slo: null` opts a pool out (config/README.md)")
    if plan.upstream_pools:
        lines.append(f"upstream pools (not planned here): {', '.join(plan.upstream_pools)}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
