"""Window-bounded K/V for sliding-window layers: a ring of blocks per running sequence instead of every position.

A sliding layer (Gemma 3's five of six, GPT-OSS's every other, MiMo-V2-Flash's 39 of 48) reads only its last
`window` positions, yet a paged cache keeps all of them: for a long RAG prompt most of S_KV x length is K/V that no
query will read again. With `sliding_kv: window` a device keeps those layers' K/V in **rings**: each row of the
persistent batch (`engine.input_batch`; a pool's running sequences take the rows of its range) owns its pool's
`blocks` blocks in the sliding layers' tensors (`engine.kv_cache.KVCache.ring_tensors`), and position p of the
sequence in row r lies in ring block `base[r] + (p // block_size) % blocks[r]`. Only the full layers keep K/V in the
pools' paged blocks, so S_KV counts them alone, and each running sequence holds its ring once, as a linear-attention
layer's state: the capacity plan counts the ring as the sequence's S_state.

A ring is large enough when no step overwrites a position a query of that step still reads: a step writes a sequence's
next C tokens (C <= its pool's `max_num_batched_tokens`, or `long_prefill_token_threshold`) and their queries read back
`window - 1` positions before them, C + window - 1 positions, which span at most ceil((C + window - 1) / block_size) + 1
blocks; nor does a ring need more blocks than the pool's longest sequence. A pool's step size is thus its ring's size: a
RAG pool that prefills 8,192 tokens a step keeps rings of 8,192 + window positions, a chat pool of 512, 512 + window; a
pool's `long_prefill_token_threshold` bounds a sequence's chunk below the step's budget, and its ring with it. The
kernels are unchanged: they read a ring through a block table (`kernels.metadata.AttentionMetadata.ring`) whose entry j
is the ring block of logical block j; entries before the window name blocks that hold later positions now, and the
window's mask never reads them.

A cached prefix's full layers are its paged blocks, but its sliding layers' K/V are gone from a ring once it moves
on, and a sliding layer's K/V at a position depend on every earlier position through the layers below (recomputing
the window alone does not rebuild them). So prefix caching keeps a **snapshot** of the window before a block boundary
(`SlidingRing.snapshot_blocks` blocks of every ring layer) in the slots `engine.state_cache` keeps a state model's
states in, tied to the prefix-cache entry of the block it ends with: saved after the step that computed it, copied
back into a resuming sequence's ring before its step (`KVCache.copy_ring_windows`). Rings are not swapped: `window`
is refused beside a pool that swaps, and `auto` (the default) chooses rings where no pool of the device does; `full`
keeps every position as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from engine.config import SLIDING_KV, ConfigError, EngineConfig, PoolConfig
from engine.gemma4_config import rank_kv_heads
from engine.minimax_m3_config import index_key_bytes
from engine.model_config import ModelConfig

__all__ = ["SLIDING_KV", "PoolLimits", "SlidingRing", "device_ring", "engine_pool_limits", "paged_bytes_per_token",
           "plan_ring", "ring_layers", "ring_outgrows", "ring_snapshots_bytes", "rings_bytes"]


@dataclass(frozen=True)
class SlidingRing:
    """The ring layout of one device: `layers`, the cache layers (indices into `ModelConfig.kv_layers`) whose K/V
    rings hold, for `window` (the widest of those layers'); each pool's (`pools`, their names in the device's order)
    ring blocks of `block_size` positions (`blocks`) and, as the engine runs them, rows (`rows`: its max_num_seqs;
    empty in a capacity plan, which derives them from the rings' bytes)."""

    layers: tuple[int, ...]
    window: int
    block_size: int
    blocks: tuple[int, ...]
    pools: tuple[str, ...]
    rows: tuple[int, ...] = ()

    @property
    def snapshot_blocks(self) -> int:
        """Blocks a prefix-cache snapshot of a ring keeps: those of the `window - 1` positions before a block boundary,
        which the first query resuming there reads."""
        return -(-(self.window - 1) // self.block_size)

    def tokens(self, pool: int) -> int:
        """Positions a ring of the device's pool `pool` (its index) holds."""
        return self.blocks[pool] * self.block_size

    @property
    def num_blocks(self) -> int:
        """Ring blocks of every row together (each pool's rows x its ring's blocks)."""
        return sum(rows * blocks for rows, blocks in zip(self.rows, self.blocks))

    def first_rows(self) -> list[int]:
        """The first row of each pool's range of rows, in order."""
        return [sum(self.rows[:i]) for i in range(len(self.rows))]

    def row_layout(self) -> tuple[list[int], list[int]]:
        """(Each row's first ring block, each row's ring blocks), row by row."""
        base, sizes, first = [], [], 0
        for rows, blocks in zip(self.rows, self.blocks):
            for _ in range(rows):
                base.append(first)
                sizes.append(blocks)
                first += blocks
        return base, sizes

    def bytes_per_token(self, model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """What a position of the ring layers takes on one rank (their K and V, each layer's own shape)."""
        return _layers_bytes(model, dtype, tensor_parallel_size, self.layers)

    def bytes_per_seq(self, pool: int, model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """A running sequence's ring in pool `pool` (its index) on one rank."""
        return self.tokens(pool) * self.bytes_per_token(model, dtype, tensor_parallel_size)


def paged_bytes_per_token(model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int,
                          ring: SlidingRing | None) -> int:
    """S_KV of the paged blocks on one rank: every KV layer's K/V but those a ring holds (and MiniMax M3's indexer
    keys, whole on every rank)."""
    skip = set(ring.layers) if ring is not None else set()
    return _layers_bytes(model, dtype, tensor_parallel_size, [i for i in range(model.num_kv_layers) if i not in skip]) \
        + index_key_bytes(model, dtype.itemsize)


def rings_bytes(ring: SlidingRing | None, model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int) -> int:
    """Every row's ring on one rank (0 without rings)."""
    return ring.num_blocks * ring.block_size * ring.bytes_per_token(model, dtype, tensor_parallel_size) \
        if ring is not None else 0


def ring_snapshots_bytes(ring: SlidingRing | None, model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int,
                         num_slots: int) -> int:
    """Prefix caching's `num_slots` snapshots of the rings on one rank (`SlidingRing.snapshot_blocks` each)."""
    if ring is None:
        return 0
    return num_slots * ring.snapshot_blocks * ring.block_size * ring.bytes_per_token(model, dtype, tensor_parallel_size)


def _layers_bytes(model: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int, layers: Iterable[int]) -> int:
    """A position's K/V in cache layers `layers` (indices into `kv_layers`) on one rank, each layer's own shape."""
    return model.kv_planes * dtype.itemsize * sum(
        rank_kv_heads(heads, tensor_parallel_size) * dim
        for heads, dim in (model.layer_kv_shape(model.kv_layers[i]) for i in layers))


def ring_layers(model: ModelConfig) -> tuple[int, ...]:
    """The cache layers a ring can hold: those with a sliding window (Llama 4's chunked layers are not windows)."""
    return tuple(i for i, layer in enumerate(model.kv_layers) if model.layer_window(layer) is not None)


@dataclass(frozen=True)
class PoolLimits:
    """What of a pool decides the ring: its longest step for one sequence and its longest sequence, and whether it
    swaps (which rules the ring out; prefix caching keeps snapshots of the window beside it)."""

    name: str
    key: str                      # the pool's path in the user's configuration, for an error
    max_step_tokens: int          # the most tokens one sequence computes in a step (`SchedulerConfig.max_step_tokens`)
    max_model_len: int
    enable_prefix_caching: bool
    uses_swap: bool
    avg_len: int = 0              # the plan's `avg_len` (0: not known, an EngineConfig built in code)


def plan_ring(model: ModelConfig, setting: str, block_size: int, pools: Iterable[PoolLimits],
              key: str = "sliding_kv") -> SlidingRing | None:
    """The device's ring for `setting` (auto | window | full), or None where its sliding layers keep every position.

    `window` is refused, naming `key` or the pool's key, where the model has no sliding layer or a pool swaps (a
    model whose every KV layer slides keeps all of them in rings, its paged blocks holding none); `auto` chooses the
    rings where neither holds, some pool's ring is shorter than its longest sequence (else they would bound nothing)
    and no pool's ring and snapshot outgrow its `avg_len` where the plan knows it (`ring_outgrows`: that pool would
    run fewer sequences). Each pool's ring: its step and the window before it, at most its `max_model_len`.
    """
    if setting not in SLIDING_KV:
        raise ConfigError(f"{key}: must be one of {', '.join(SLIDING_KV)}, got {setting!r}")
    if setting == "full":
        return None
    pools = list(pools)
    layers = ring_layers(model)
    why = _ruled_out(model, layers, pools)
    if why is not None:
        if setting == "window":
            where, reason = why
            raise ConfigError(f"{where or key}: {reason}; {key}: window needs it ({key}: full or auto keep every "
                              "position of the sliding layers)")
        return None
    window = max(model.layer_window(model.kv_layers[i]) for i in layers)
    blocks = tuple(min(-(-(p.max_step_tokens + window - 1) // block_size) + 1,
                       -(-p.max_model_len // block_size)) for p in pools)
    ring = SlidingRing(layers=layers, window=window, block_size=block_size, blocks=blocks,
                       pools=tuple(p.name for p in pools))
    if setting == "auto" and (all(b * block_size >= p.max_model_len for b, p in zip(blocks, pools))
                              or ring_outgrows(ring, pools) is not None):
        return None   # no pool's ring bounds anything, or a pool would run fewer sequences with its ring
    return ring


def ring_outgrows(ring: SlidingRing, pools: list[PoolLimits]) -> PoolLimits | None:
    """The first pool whose ring, with its window's prefix-cache snapshot where it caches prefixes, holds more
    positions than its `avg_len` (so the capacity formula gives it fewer sequences with the ring than with every
    position kept); None where no pool's does (or none's avg_len is known)."""
    snapshot = ring.snapshot_blocks * ring.block_size
    return next((p for k, p in enumerate(pools) if p.avg_len and ring.tokens(k) + snapshot * p.enable_prefix_caching
                 > p.avg_len), None)


def _ruled_out(model: ModelConfig, layers: tuple[int, ...], pools: list[PoolLimits]) -> tuple[str, str] | None:
    """(The key to name, why) where a ring cannot serve this model and these pools; None where it can."""
    if not layers:
        return "", f"{model.architecture} has no sliding-window layer"
    for p in pools:
        if p.uses_swap:
            return f"{p.key}.preemption_mode", (f"pool {p.name!r} may swap, and a ring's K/V are not swapped "
                                                "(preemption_mode: recompute)")
    return None


def engine_pool_limits(config: EngineConfig, model: ModelConfig) -> list[PoolLimits]:
    """`PoolLimits` of an EngineConfig's pools (a `max_model_len` of 0: the model's context)."""
    return [_limits(f"pools[{i}]", p, model) for i, p in enumerate(config.pools)]


def _limits(key: str, pool: PoolConfig, model: ModelConfig) -> PoolLimits:
    sc = pool.scheduler
    return PoolLimits(name=pool.name, key=key, max_step_tokens=sc.max_step_tokens,
                      max_model_len=sc.max_model_len or model.context_length,
                      enable_prefix_caching=sc.enable_prefix_caching, uses_swap=sc.uses_swap)


def device_ring(config: EngineConfig, model: ModelConfig) -> SlidingRing | None:
    """The rings of an EngineConfig's device (`sliding_kv`), for its model as served: each pool's, for each of its
    max_num_seqs rows."""
    ring = plan_ring(model, config.sliding_kv, config.cache.block_size, engine_pool_limits(config, model))
    return None if ring is None else replace(ring, rows=tuple(p.scheduler.max_num_seqs for p in config.pools))
