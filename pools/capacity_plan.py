"""The capacity formula and plan: how many blocks and sequences each pool gets, before anything loads.

Per device (with tensor parallelism T the weights and the KV heads are split over T GPUs):

    S_KV        = 2 x num_kv_layers x num_kv_heads x head_dim x dtype_bytes          (per token, whole model;
                  DeepSeek's latent attention: 1 x num_layers x 1 x its latent and rotated key; sliding layers
                  that keep rings instead, `pools.ring_plan`: not counted)
    S_state     = a running sequence's linear-attention state, or its ring of sliding-layer K/V (per GPU; 0: none)
    weights     = num_params x dtype_bytes                                          (not file sizes; DeepSeek's
                  float32 routers at 4; FP8 projections at 1, MXFP4 experts at 1/2, plus scales)
    graphs      = one rank's decode CUDA graphs (`graph_memory_bytes`; 0 off CUDA or enforce_eager)
    weights / T = one rank's parameters x dtype_bytes: its share of every matrix, K/V projections
                  replicated with their heads, norms and row-parallel biases whole (`ShardShape.num_params`)
    KV space    = memory_utilization x memory - weights / T - graphs                (per GPU)
    pool KV     = kv_share x KV space   |   kv_cache_bytes                          (per GPU)
    blocks      = floor((pool KV - max_num_seqs x S_state) / (S_KV / T x block_size))
    max_num_seqs = floor(pool KV / (S_KV / T x avg_len + S_state))  (unless overridden; <= blocks / ceil(avg_len / bs))

The formulas are `engine.capacity`'s (the engine checks its plan with them once loaded): `plan_capacity` computes a
`CapacityPlan` from a `CliffguardConfig` and each model's `ModelConfig`; `engine_configs` turns it into each device's
`EngineConfig`, the planned numbers exactly; `plan_single_pool` does both for one pool on one device (benchmarks).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch

import engine.capacity as formula
from engine.gated_delta_config import NOT_SWAPPED
from engine.deepseek_v4_config import refuse_fp8_cache
from engine.config import (CacheConfig, ConfigError, EngineConfig, PoolConfig, auto_dtype, ceil_div, dtype_name,
                           kv_cache_dtype, parse_dtype)
from engine.model_config import ModelConfig
from engine.models import check_dtype, held_fp8_block, held_int4_projections, held_packed, held_weight_bytes
from engine.parallel import ShardShape
from pools.config.spec import CliffguardConfig, DeviceSpec, GatewaySpec, PoolSpec, SpecError
from pools.config.checks import fmt_bytes, within
from pools.device_memory import device_memory, graph_reserve, headroom_warning, no_room_for_kv, resolve_device_type
from pools.host_memory import check_gpu_memory, host_memory_bytes, past_host_memory
from pools.model_configs import resolve_model_configs
from pools.ring_plan import device_ring_plan, ring_only_blocks


@dataclass(frozen=True)
class DevicePlan:
    """One device (a TP group of `tensor_parallel_size` GPUs): memory, weights and KV bytes. Each of its
    `replicas` slots is planned alike: every number here is one replica's. An autoscaled device runs
    `min_replicas` to `replicas` of them (`DeviceSpec.autoscaled`)."""

    name: str
    device_type: str                 # cuda | cpu (what the plan assumed)
    dtype: str                       # float32 | bfloat16 | float16
    model: str
    kv_cache_dtype: str              # the KV cache's elements: the model dtype, or float8_e4m3fn
    memory_bytes: int                # per GPU
    memory_source: str               # config | --vram | cuda (measured) | cpu default
    memory_utilization: float
    tensor_parallel_size: int
    weights_bytes: int               # num_params x dtype bytes, whole model (FP8 projections: 1 byte + scales)
    weights_bytes_per_device: int    # one rank's shard (ShardShape.num_params): about weights / T
    kv_bytes_per_token: int          # S_KV, whole model
    kv_bytes_per_token_per_device: int  # S_KV / T (KV heads split; replicated when T > num_kv_heads)
    kv_space_bytes_per_device: int   # memory_utilization x memory - weights / T - graphs: what its pools share
    block_size: int
    pools: tuple[str, ...]
    replicas: int = 1                # replica slots: the max of an autoscaled device
    min_replicas: int | None = None  # autoscaled: the fewest up (None: fixed, all `replicas` up)
    placement: str = "local"         # local | ray (DeviceSpec.placement)
    graph_bytes_per_device: int = 0  # set aside for the decode CUDA graphs (engine.cuda_graphs); 0: none
    fp8_weights: bool = False        # the layers' projections held in FP8 (the device's `quantization`)
    packed_experts: str = ""         # the experts held as a checkpoint packs them: MXFP4 (GPT-OSS's), INT4, or not
    int4_projections: int = 0        # a rank's projections held in INT4 as stored (a W4A16 checkpoint's) ...
    int_bits: int = 4                # ... or INT8 (a W8A16 checkpoint's)
    sliding_window: int = 0          # sliding layers in rings of this window (engine.sliding_kv); 0: all kept

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None and self.min_replicas < self.replicas

    @property
    def initial_replicas(self) -> int:
        """The replicas up at start: the min, or all."""
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def usable_bytes(self) -> int:
        return formula.usable_bytes(self.memory_bytes, self.memory_utilization)

    @property
    def kv_space_bytes(self) -> int:
        """KV space of the whole TP group."""
        return self.tensor_parallel_size * self.kv_space_bytes_per_device


@dataclass(frozen=True)
class PoolPlan:
    """One local pool: what the plan derived for it (its own settings stay in `spec`, the one place they are written).
    S_state counts a linear-attention state with its snapshots (one a sequence, or state_snapshots), and a ring."""

    spec: PoolSpec
    max_model_len: int               # the spec's, or the model's context
    kv_bytes_per_token: int          # S_KV, whole model
    kv_bytes_per_token_per_device: int
    kv_cache_bytes_per_device: int   # this pool's budget on each GPU
    tensor_parallel_size: int
    num_blocks: int
    formula_max_num_seqs: int        # floor(pool KV / (S_KV x avg_len + S_state))
    max_num_seqs: int                # the formula's, or the config's override (per replica)
    replicas: int = 1                # the device's: each holds this pool's blocks and runs max_num_seqs
    state_bytes_per_seq: int = 0     # S_state: a sequence's linear-attention state and snapshots, or its ring
    sliding_ring_tokens: int = 0     # positions of that ring (engine.sliding_kv); 0: the sliding layers keep every one
    snapshot_bytes_per_seq: int = 0  # a prefix-cache snapshot of S_state (a state, a ring's window); 0: none kept

    @property
    def pool_max_num_seqs(self) -> int:
        """Sequences the whole pool runs at once: max_num_seqs on each of its replicas."""
        return self.replicas * self.max_num_seqs

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """This pool's KV bytes over the whole TP group."""
        return self.tensor_parallel_size * self.kv_cache_bytes_per_device

    @property
    def max_num_seqs_overridden(self) -> bool:
        return self.spec.max_num_seqs is not None

    @property
    def blocks_per_max_len_request(self) -> int:
        return ceil_div(self.max_model_len, self.block_size)

    @property
    def max_concurrent_at_max_len(self) -> int:
        """Requests of max_model_len tokens that fit at once."""
        return self.num_blocks // self.blocks_per_max_len_request

    @property
    def fragmentation_bytes(self) -> int:
        """Internal fragmentation per GPU: (block_size - 1) / 2 empty slots a sequence x S_KV x max_num_seqs."""
        return (self.block_size - 1) * self.kv_bytes_per_token_per_device * self.max_num_seqs // 2

    @property
    def fragmentation_fraction(self) -> float:
        return self.fragmentation_bytes / self.kv_cache_bytes_per_device


@dataclass(frozen=True)
class CapacityPlan:
    """Devices with local pools and their pools, by name, in configuration order."""

    devices: dict[str, DevicePlan]
    pools: dict[str, PoolPlan]
    upstream_pools: tuple[str, ...] = ()    # not planned: they hold no local KV
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready: every field and derived value. A device's `min_replicas` is its `initial_replicas`
        (`replicas` when fixed), `max_replicas` its `replicas`."""
        def with_props(obj, props):
            return {**asdict(obj), **{name: getattr(obj, name) for name in props}}

        def pool_dict(p: PoolPlan) -> dict:
            spec = p.spec
            settings = {"name": p.name, "device": p.device, "route": spec.route.describe(),
                        "block_size": spec.block_size, "avg_len": spec.avg_len, "kv_share": spec.kv_share,
                        "max_num_batched_tokens": spec.max_num_batched_tokens, "preemption_mode": spec.preemption_mode,
                        "victim_policy": spec.victim_policy, "service_class": spec.service_class,
                        "slo": None if spec.slo is None else asdict(spec.slo), "slo_source": spec.slo_source}
            derived = {k: v for k, v in asdict(p).items() if k != "spec"}
            return {**settings, **derived, **{name: getattr(p, name) for name in (
                "kv_cache_bytes", "max_num_seqs_overridden", "pool_max_num_seqs", "blocks_per_max_len_request",
                "max_concurrent_at_max_len", "fragmentation_bytes", "fragmentation_fraction")}}

        return {
            "devices": [with_props(d, ("usable_bytes", "kv_space_bytes", "autoscaled")) | {
                "min_replicas": d.initial_replicas, "max_replicas": d.replicas} for d in self.devices.values()],
            "pools": [pool_dict(p) for p in self.pools.values()], "upstream_pools": list(self.upstream_pools),
            "warnings": list(self.warnings)}

    def cpu_ranks(self) -> list[tuple[str, int, int]]:
        """Each CPU device this machine runs (not a Ray one's): its name, ranks (replicas x tensor_parallel_size)
        and the bytes one rank holds in the machine's memory (its weights and its pools' KV caches)."""
        return [(d.name, d.replicas * d.tensor_parallel_size, d.weights_bytes_per_device + sum(
            self.pools[p].kv_cache_bytes_per_device for p in d.pools))
            for d in self.devices.values() if d.device_type == "cpu" and d.placement != "ray"]


def _device_shard(model: ModelConfig, dev: DeviceSpec, dtype: torch.dtype, dkey: str, device_type: str
                  ) -> tuple[ShardShape, str, int, bool]:
    """A rank's shard: its KV heads split over TP ranks (T > num_kv_heads: each holds a replica of one, as vLLM
    does), its share of the rest; what packs the experts it holds as stored (MXFP4, INT4 or ""), how many integer
    projections it holds so, whether it holds projections in FP8. The engine's rules (`check_tensor_parallel`,
    `check_dtype`, `held_packed`, `held_int4`, `held_fp8_block`) named `dkey`.*."""
    try:
        check_dtype(model, dtype)
        shard = ShardShape.of(model, 0, dev.tensor_parallel_size)
        return shard, (held_packed(model, shard, dev.quantization, device_type) or "").upper(), \
            held_int4_projections(model, shard, dev.quantization, device_type), \
            held_fp8_block(model, shard, dev.quantization, device_type) is not None
    except ConfigError as exc:
        raise SpecError(f"{dkey}.{exc}") from None


def plan_capacity(config: CliffguardConfig, model_configs: Mapping[str, ModelConfig], *,
                  vram_bytes: int | None = None, cuda_memory: Callable[[str], int] | None = None) -> CapacityPlan:
    """The capacity plan of every device that has local pools.

    `model_configs`: each local pool's `model` string -> its ModelConfig (the caller resolves them). `vram_bytes`:
    overrides every device's memory (`--vram`); a device `auto` is then planned as CUDA (bfloat16) even on a CPU-only
    machine. `memory: auto` is the GPU's total memory (`cuda_memory(device)`, default torch's) on CUDA and
    DEFAULT_CPU_MEMORY on CPU. `dtype: auto`: `engine.config.auto_dtype`. Errors: SpecError naming the key path."""
    devices: dict[str, DevicePlan] = {}
    pools: dict[str, PoolPlan] = {}
    warnings: list[str] = []
    for dev_name, dev in config.devices.items():
        members = [(i, p) for i, p in enumerate(config.pools) if not p.is_upstream and p.device == dev_name]
        if not members:
            continue
        i0, p0 = members[0]
        model = model_configs.get(p0.model)
        if model is None:
            raise SpecError(f"pools[{i0}].model: no model config for {p0.model!r}")
        dkey, tp = f"devices.{dev_name}", dev.tensor_parallel_size
        device_type = resolve_device_type(dev, vram_bytes, warnings)
        dtype = parse_dtype(dev.dtype) if dev.dtype != "auto" else auto_dtype(device_type)
        memory, source = device_memory(dev, device_type, vram_bytes, cuda_memory)
        shard, packed, int4, fp8 = _device_shard(model, dev, dtype, dkey, device_type)   # MXFP4 / INT4 / FP8 held
        kv_dtype = kv_cache_dtype(dev.kv_cache_dtype, dtype)   # fp8: one byte an element
        refuse_fp8_cache(model, kv_dtype, f"{dkey}.kv_cache_dtype")
        rings = device_ring_plan(dev_name, dev, model, members, kv_dtype, tp, warnings)   # engine.sliding_kv
        s_kv, s_kv_dev = rings.kv_bytes_per_token, rings.kv_bytes_per_token_per_device
        weights = held_weight_bytes(model, ShardShape.of(model), dtype, dev.quantization, device_type)
        weights_dev = held_weight_bytes(model, shard, dtype, dev.quantization, device_type)   # each rank alike
        graphs_dev = graph_reserve(model, dev, device_type, tp, dtype, (p.max_model_len for _, p in members))
        # what the engine finds loaded: the rope's too, over the positions its pools serve
        loaded_dev = weights_dev + model.serving(p.max_model_len for _, p in members).rotary_cache_bytes(dtype)
        kv_dev = formula.kv_cache_bytes(memory, loaded_dev, dev.memory_utilization) - graphs_dev
        if kv_dev <= 0:
            stored = held_weight_bytes(model, shard, dtype, "auto", device_type) if dev.quantization == "none" else 0
            raise no_room_for_kv(dkey, dev, memory, source, p0.model, weights_dev,
                                 (dtype_name(dtype), fp8, packed, int4, model.int4_bits), graphs_dev, kv_dev, stored)
        device_pools = [_plan_pool(i, p, model, s_kv, s_kv_dev, _pool_bytes(p, kv_dev, members), tp, warnings,
                                   dev.replicas, *rings.pool_state(k, model.state_bytes_per_seq(dtype, tp)))
                        for k, (i, p) in enumerate(members)]
        _check_device_budget(dev_name, members, device_pools, kv_dev)
        if device_type == "cuda" and (short := headroom_warning(dev, memory, model.vocab_size, dtype.itemsize, [
                (pp.max_num_seqs, pp.spec.max_num_batched_tokens) for pp in device_pools])) is not None:
            warnings.append(short)
        pools.update((pp.name, pp) for pp in device_pools)
        devices[dev_name] = DevicePlan(
            name=dev_name, device_type=device_type, dtype=dtype_name(dtype), model=p0.model, memory_bytes=memory,
            kv_cache_dtype=dtype_name(kv_dtype), fp8_weights=fp8, packed_experts=packed, int4_projections=int4,
            int_bits=model.int4_bits, memory_source=source, memory_utilization=dev.memory_utilization,
            tensor_parallel_size=tp, weights_bytes=weights, weights_bytes_per_device=weights_dev,
            kv_bytes_per_token=s_kv, kv_bytes_per_token_per_device=s_kv_dev, kv_space_bytes_per_device=kv_dev,
            sliding_window=rings.window, block_size=p0.block_size, pools=tuple(p.name for _, p in members),
            replicas=dev.replicas, min_replicas=dev.min_replicas, placement=dev.placement,
            graph_bytes_per_device=graphs_dev)
    upstream = tuple(p.name for p in config.pools if p.is_upstream)
    plan = CapacityPlan(devices=devices, pools=pools, upstream_pools=upstream, warnings=tuple(warnings))
    if (over := past_host_memory(config, plan.cpu_ranks(), host_memory_bytes())) is not None:
        plan = dataclasses.replace(plan, warnings=(*warnings, f"{over}; `cliffguard serve` refuses it on this machine"))
    return plan


def _pool_bytes(p: PoolSpec, kv_dev: int, members: list[tuple[int, PoolSpec]]) -> int:
    """A pool's KV bytes per GPU: kv_cache_bytes, or kv_share of `kv_dev` in integers (a float product rounds
    past a large device); the shares of the device's pools `members` (exact) a hair over 1 are scaled down to fit
    `kv_dev`."""
    if p.kv_share is None:
        return p.kv_cache_bytes
    shares = sum((Fraction(q.kv_share) for _, q in members if q.kv_share is not None), Fraction(0))
    return int(Fraction(p.kv_share) * kv_dev / max(shares, Fraction(1)))


def _check_device_budget(dev_name: str, members: list[tuple[int, PoolSpec]], device_pools: list[PoolPlan],
                         kv_dev: int) -> None:
    """The pools of a device ask for no more than its KV bytes per GPU; else a SpecError naming the first
    explicit `kv_cache_bytes` (shares alone always fit: `_pool_bytes`)."""
    asked = sum(pp.kv_cache_bytes_per_device for pp in device_pools)
    if asked <= kv_dev:
        return
    parts = ", ".join(f"{pp.name} {fmt_bytes(pp.kv_cache_bytes_per_device)}" for pp in device_pools)
    i, p = next((i, p) for i, p in members if p.kv_cache_bytes is not None)
    raise SpecError(f"pools[{i}].kv_cache_bytes: {fmt_bytes(p.kv_cache_bytes)}; the pools of device {dev_name!r} "
                    f"ask for {fmt_bytes(asked)} per GPU ({parts}) but it has {fmt_bytes(kv_dev)}")


def _plan_pool(i: int, p: PoolSpec, model: ModelConfig, s_kv: int, s_kv_dev: int, pool_kv: int, tp: int,
               warnings: list[str], replicas: int = 1, s_state: int = 0, ring_tokens: int = 0,
               s_snapshot: int | None = None) -> PoolPlan:
    key = f"pools[{i}]"
    context = model.context_length
    if p.max_model_len is not None and p.max_model_len > context:
        raise SpecError(f"{key}.max_model_len: {p.max_model_len} is above the model's context "
                        f"({context}: max_position_embeddings, scaled by a YaRN or linear rope)")
    max_model_len = p.max_model_len or context
    route = p.route
    if route.max_prompt_tokens is not None and route.max_prompt_tokens >= max_model_len:
        raise SpecError(f"{key}.route.max_prompt_tokens: {route.max_prompt_tokens} must be below max_model_len "
                        f"{max_model_len}: a prompt needs room for one generated token, so the route's tail is "
                        "unreachable")
    if route.min_prompt_tokens >= max_model_len:
        raise SpecError(f"{key}.route.min_prompt_tokens: {route.min_prompt_tokens} must be below max_model_len "
                        f"{max_model_len}; no prompt can reach this pool")
    if p.kv_share is not None:
        budget_key, budget = f"{key}.kv_share", f"{p.kv_share}"
    else:
        budget_key, budget = f"{key}.kv_cache_bytes", fmt_bytes(p.kv_cache_bytes)
    seq_kv, s_held = _snapshot_budget(p, pool_kv, s_state, s_state if s_snapshot is None else s_snapshot)
    num_blocks = formula.num_blocks(seq_kv - _states_bytes(p, seq_kv, s_kv_dev, s_held), s_kv_dev, p.block_size) \
        if s_kv_dev else ring_only_blocks(key, p, seq_kv, s_held, max_model_len, f"{budget_key}: {budget}",
                                          ring_tokens > 0)
    per_request = ceil_div(max_model_len, p.block_size)
    if num_blocks < per_request:
        raise SpecError(f"{budget_key}: {budget} gives pool {p.name!r} {fmt_bytes(pool_kv)} per GPU = {num_blocks} "
                        f"blocks of {p.block_size} tokens; one request of max_model_len {max_model_len} needs "
                        f"{per_request}: raise the budget or lower {key}.max_model_len")
    _check_swap_space(key, p, s_kv_dev, s_state)
    if p.avg_len > max_model_len:
        warnings.append(f"{key}.avg_len: {p.avg_len} is above max_model_len {max_model_len}, which no request "
                        f"exceeds: max_num_seqs is planned for fewer requests than fit (set avg_len <= max_model_len)")
    by_formula = formula.max_num_seqs(seq_kv, s_kv_dev, p.avg_len, s_held)
    held = ceil_div(p.avg_len, p.block_size)     # a request holds whole blocks: avg_len 17 holds 32 tokens
    if p.max_num_seqs is None:
        if (max_num_seqs := min(by_formula, num_blocks // held)) == 0:
            raise SpecError(f"{budget_key}: {budget} gives max_num_seqs = floor({fmt_bytes(pool_kv)} / "
                            f"({s_kv_dev} B x avg_len {p.avg_len}), in whole blocks) = 0 for pool {p.name!r}: raise "
                            f"the budget or lower {key}.avg_len")
        if by_formula > max_num_seqs * 1.05:   # said where it matters
            warnings.append(f"{key}.avg_len: {p.avg_len} tokens hold {held} whole blocks of {p.block_size}: max_num_seqs "
                            f"is the pool's {num_blocks} blocks / {held} = {max_num_seqs}, not the formula's {by_formula}")
    else:
        max_num_seqs = p.max_num_seqs
        if max_num_seqs > num_blocks:   # a running request holds a block of its own at least: more never run
            raise SpecError(f"{key}.max_num_seqs: {max_num_seqs} is above the pool's {num_blocks} KV blocks, more "
                            f"requests than could ever run at once (the capacity formula gives {by_formula})")
        if max_num_seqs > by_formula:
            warnings.append(f"{key}.max_num_seqs: {max_num_seqs} is above the capacity formula's {by_formula} "
                            f"(avg_len {p.avg_len}): expect preemptions when that many requests run")
    if max_num_seqs > p.max_num_batched_tokens:   # a step holds a token of each sequence it runs, at most
        warnings.append(f"{key}.max_num_batched_tokens: {p.max_num_batched_tokens} is below max_num_seqs "
                        f"{max_num_seqs}: no more sequences than that step at once, the rest hold blocks and wait")
    return PoolPlan(
        spec=p, max_model_len=max_model_len, kv_bytes_per_token=s_kv, kv_bytes_per_token_per_device=s_kv_dev,
        kv_cache_bytes_per_device=pool_kv, tensor_parallel_size=tp, num_blocks=num_blocks,
        formula_max_num_seqs=by_formula, max_num_seqs=max_num_seqs, replicas=replicas, state_bytes_per_seq=s_state,
        sliding_ring_tokens=ring_tokens, snapshot_bytes_per_seq=s_snapshot if s_snapshot is not None else s_state)


def _snapshot_budget(p: PoolSpec, pool_kv: int, s_state: int, s_snapshot: int) -> tuple[int, int]:
    """(The bytes the pool's running sequences share, each one's state bytes) where its prefix cache keeps snapshots
    of `s_snapshot` bytes (`engine.state_cache`: a state model's state, a sliding layer ring's window): one a sequence
    by default (counted beside its state), or `state_snapshots` set aside first; the pool's bytes and S_state
    otherwise."""
    if not (s_snapshot and p.enable_prefix_caching):
        return pool_kv, s_state
    if p.state_snapshots is None:
        return pool_kv, s_state + s_snapshot
    return max(0, pool_kv - p.state_snapshots * s_snapshot), s_state


def _states_bytes(p: PoolSpec, pool_kv: int, s_kv_dev: int, s_state: int) -> int:
    """What the states of the pool's running sequences take of its bytes (a model with linear-attention layers:
    `s_state` for each of max_num_seqs, the config's or the formula's: S_state, twice with a snapshot slot each,
    `_snapshot_budget`; 0 otherwise); its blocks get the rest."""
    if not s_state:
        return 0
    seqs = p.max_num_seqs if p.max_num_seqs is not None else formula.max_num_seqs(pool_kv, s_kv_dev, p.avg_len, s_state)
    return min(seqs * s_state, pool_kv)


def _check_swap_space(key: str, p: PoolSpec, s_kv_dev: int, s_state: int = 0) -> None:
    """A pool that may swap needs room for one KV block (S_KV of a GPU x block_size) in its swap space; a model with
    a state per sequence (linear-attention layers) is not swapped (`engine.gated_delta_config.serving_pool`)."""
    if s_state and p.uses_swap:
        raise SpecError(f"{key}.preemption_mode: {p.preemption_mode!r} {NOT_SWAPPED}")
    block = s_kv_dev * p.block_size
    if p.uses_swap and 0 < p.swap_space_bytes < block:
        raise SpecError(f"{key}.swap_space: {fmt_bytes(p.swap_space_bytes)} holds no KV block of {fmt_bytes(block)} "
                        f"(block_size {p.block_size} x S_KV {s_kv_dev} B); preemption_mode {p.preemption_mode!r} "
                        "swaps whole blocks: give it room for many")


def engine_configs(config: CliffguardConfig, plan: CapacityPlan) -> dict[str, EngineConfig]:
    """One EngineConfig per planned device (its first replica's; `replica_engine_configs` gives each replica's):
    the planned dtype (`auto` kept), blocks and limits, nothing re-derived. The start-up check of `serve` and
    `generate`: a device `auto` becomes the plan's device type; a CUDA device on a machine without CUDA (a plan
    made with `--vram`), GPUs it does not have, or swap spaces past its memory are refused, naming the key path."""
    return {name: configs[0] for name, configs in replica_engine_configs(config, plan).items()}


def replica_engine_configs(config: CliffguardConfig, plan: CapacityPlan) -> dict[str, list[EngineConfig]]:
    """Each planned device's EngineConfig per replica: the same pools and block ranges, each replica on
    its own GPUs (`DeviceSpec.replica_gpus`), or on the CPU with its share of the cores."""
    if (over := past_host_memory(config, plan.cpu_ranks(), host_memory_bytes())) is not None:
        raise SpecError(over if over.startswith("devices.") else f"{over}: its workers would run out of memory; "
                                                                 "lower swap_space")
    result = {}
    for dplan in plan.devices.values():
        dev = config.devices[dplan.name]
        key = f"devices.{dplan.name}"
        device = dplan.device_type if dev.device == "auto" else dev.device
        on_ray = dev.placement == "ray"   # Ray assigns each replica its GPUs, on nodes other than this one
        if device.startswith("cuda") and not on_ray and not torch.cuda.is_available():
            raise SpecError(f"{key}.device: {dev.device!r} needs a CUDA device and this machine has none (torch "
                            f"{torch.__version__}, CUDA {torch.version.cuda or 'not built'}); " + (
                                "--vram plans it as a GPU: serve without --vram" if dev.device == "auto" else
                                "use device: cpu or auto") + ", or plan it with `cliffguard capacity --vram`")
        pool_configs = []
        for pplan in (plan.pools[name] for name in dplan.pools):
            with within(f"pools[{config.pools.index(pplan.spec)}]"):
                scheduler = pplan.spec.scheduler_config(pplan.max_num_seqs, pplan.max_model_len)
            pool_configs.append(PoolConfig(name=pplan.spec.name, num_blocks=pplan.num_blocks, scheduler=scheduler,
                                           slo=pplan.spec.slo, min_share=pplan.spec.engine_min_share,
                                           derive_slo=pplan.spec.slo_source == "default"))
        dtype = "auto" if dev.dtype == "auto" and device.startswith("cuda") else dplan.dtype   # each GPU's own
        template = EngineConfig(model=dplan.model, device=device, dtype=dtype,
                                cache=CacheConfig(block_size=dplan.block_size), pools=tuple(pool_configs),
                                memory_utilization=dplan.memory_utilization,
                                tensor_parallel_size=dplan.tensor_parallel_size, enforce_eager=dev.enforce_eager,
                                async_scheduling=dev.async_scheduling, kv_cache_dtype=dev.kv_cache_dtype,
                                sliding_kv=("window" if dplan.sliding_window else "full") if dev.sliding_kv == "auto"
                                else dev.sliding_kv,   # the plan's choice: the engine has no avg_len to make it
                                calculate_kv_scales=dev.calculate_kv_scales, quantization=dev.quantization,
                                collective_timeout_seconds=dev.collective_timeout_seconds)
        result[dplan.name] = [_replica_config(template, dev, r, key) for r in range(dev.replicas)]
    _check_shared_gpus(config, result)
    check_gpu_memory(config, plan.devices, result)
    return result


def _check_shared_gpus(config: CliffguardConfig, result: dict[str, list[EngineConfig]]) -> None:
    """No GPU runs two devices once `auto` is resolved (the file's own check cannot see an `auto` device
    that lands on a GPU another device names): each plans 0.9 of the whole GPU."""
    owner: dict[int, str] = {}
    for name, configs in result.items():
        if config.devices[name].placement == "ray":
            continue
        for gpu in {g for engine in configs for g in engine.gpu_ids or ()}:
            if gpu in owner:   # name the `auto` one where one is: the file's own check saw the other
                this, other = (owner[gpu], name) if config.devices[owner[gpu]].device == "auto" else (name, owner[gpu])
                dev = config.devices[this]
                key = f"devices.{this}.gpus" if dev.gpus is not None else f"devices.{this}.device"
                shown = list(dev.gpus) if dev.gpus is not None else repr(dev.device)
                raise SpecError(f"{key}: {shown} runs on GPU {gpu}, which device {other!r} runs on too; a GPU runs "
                                "one device (give each its own `device: cuda:N` or `gpus`)")
            owner[gpu] = name


def _replica_config(template: EngineConfig, dev: DeviceSpec, replica: int, key: str) -> EngineConfig:
    ranks = dev.replicas * dev.tensor_parallel_size
    if dev.placement == "ray":   # a bundle per rank on some node: its CPUs, and its GPU as Ray assigns it
        cuda = template.device.startswith("cuda")
        return dataclasses.replace(template, device="cuda" if cuda else template.device,
                                   cpu_threads=0 if cuda else dev.cpu_threads or 1)
    if not template.device.startswith("cuda"):
        threads = dev.cpu_threads or (max(1, (os.cpu_count() or 1) // ranks) if ranks > 1 else 0)
        return dataclasses.replace(template, cpu_threads=threads)
    gpus = dev.replica_gpus(replica, template.device)   # `auto` places on the GPUs it resolved to
    count = torch.cuda.device_count()
    if max(gpus) >= count:
        where = "gpus" if dev.gpus is not None else "device"
        raise SpecError(f"{key}.{where}: replica {replica} needs GPU {max(gpus)} and this machine has {count} "
                        f"(replicas {dev.replicas} x tensor_parallel_size {dev.tensor_parallel_size} GPUs)")
    return dataclasses.replace(template, device=f"cuda:{gpus[0]}", gpu_ids=gpus)


def plan_single_pool(model: str, *, device: str = "auto", dtype: str = "auto", kv_cache_bytes: int,
                     vram_bytes: int | None = None, sliding_kv: str = "auto", **pool: object
                     ) -> tuple[CapacityPlan, EngineConfig]:
    """One pool named `default` on one device, planned like any YAML pool (its `kv_cache_bytes` must fit the
    device's KV space; `max_num_seqs`, unless in `pool`, from the formula). `pool`: other PoolSpec fields
    (block_size, max_num_seqs, max_model_len, preemption_mode, ...). For `cliffguard generate`, the benchmarks."""
    pool_spec = PoolSpec(name="default", model=model, kv_cache_bytes=kv_cache_bytes, **pool)
    device_spec = DeviceSpec(device=device, dtype=dtype, sliding_kv=sliding_kv)
    config = CliffguardConfig(gateway=GatewaySpec(), devices={"default": device_spec}, pools=(pool_spec,))
    plan = plan_capacity(config, resolve_model_configs(config), vram_bytes=vram_bytes)
    return plan, engine_configs(config, plan)["default"]
