"""The capacity plan's side of window-bounded K/V (`engine.sliding_kv`): which layout a device's sliding layers get,
and what it does to S_KV and to each running sequence's bytes.

With a ring the sliding layers leave S_KV (the paged blocks hold the full layers alone) and each running sequence
holds its pool's ring instead, counted as a state a sequence (`_plan_pool`'s S_state), so the capacity formula reads
`max_num_seqs = KV bytes / (S_KV_full x avg_len + S_ring)`, S_ring the ring's positions (the pool's step and the
window before it) x the sliding layers' bytes a position. Where every KV layer slides (Mistral 7B v0.1, StarCoder2,
Phi-3-mini) S_KV_full is 0: a sequence's bytes are its ring whatever its length, and a block holds no bytes, only a
place in a sequence's table (`ring_only_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig
from engine.sliding_kv import (PoolLimits, SlidingRing, paged_bytes_per_token, plan_ring, ring_layers,
                               ring_outgrows, ring_snapshots_bytes)
from pools.config.checks import SpecError, engine_rules
from pools.config.device_spec import DeviceSpec
from pools.config.spec import PoolSpec

__all__ = ["DeviceRing", "device_ring_plan", "ring_only_blocks"]


@dataclass(frozen=True)
class DeviceRing:
    """A device's sliding-layer layout as planned: `ring` (None: every position kept), S_KV of the paged blocks
    (whole model and per GPU) and a sequence's ring per GPU in each of its pools (`ring_bytes`, 0 without rings);
    `note` says why `auto` kept every position where rings would serve the model, for the plan's warnings."""

    ring: SlidingRing | None
    kv_bytes_per_token: int
    kv_bytes_per_token_per_device: int
    ring_bytes_per_device: tuple[int, ...]
    snapshot_bytes: int = 0           # a prefix-cache snapshot of a ring per GPU (`SlidingRing.snapshot_blocks`)
    note: str = ""

    def ring_bytes(self, pool: int) -> int:
        """A running sequence's ring per GPU in the device's pool `pool` (its index among the device's pools)."""
        return self.ring_bytes_per_device[pool] if self.ring is not None else 0

    @property
    def window(self) -> int:
        """The rings' window (0: no rings)."""
        return self.ring.window if self.ring is not None else 0

    def ring_tokens(self, pool: int) -> int:
        return self.ring.tokens(pool) if self.ring is not None else 0

    def pool_state(self, pool: int, model_state: int) -> tuple[int, int, int]:
        """(S_state, ring positions, a prefix-cache snapshot's bytes) of a sequence in the device's pool `pool` (its
        index among them), for a model whose own state layers keep `model_state` bytes a sequence."""
        return model_state + self.ring_bytes(pool), self.ring_tokens(pool), model_state + self.snapshot_bytes


def device_ring_plan(dev_name: str, dev: DeviceSpec, model: ModelConfig, members: list[tuple[int, PoolSpec]],
                     kv_dtype: torch.dtype, tp: int, warnings: list[str]) -> DeviceRing:
    """The ring `dev.sliding_kv` gives device `dev_name`'s pools `members` ((index, spec) of each), a SpecError
    naming the key where `window` cannot serve them; `warnings` gains the note where `auto` keeps every position."""
    limits = [PoolLimits(name=p.name, key=f"pools[{i}]", max_step_tokens=min(
        p.max_num_batched_tokens, p.long_prefill_token_threshold or p.max_num_batched_tokens),
                         max_model_len=p.max_model_len or model.context_length,
                         enable_prefix_caching=p.enable_prefix_caching, uses_swap=p.uses_swap, avg_len=p.avg_len)
              for i, p in members]
    block_size = members[0][1].block_size
    with engine_rules():
        ring = plan_ring(model, dev.sliding_kv, block_size, limits, key=f"devices.{dev_name}.sliding_kv")
    note = ""
    if ring is None and dev.sliding_kv == "auto" and ring_layers(model):
        note = _kept_note(f"devices.{dev_name}.sliding_kv", model, block_size, limits)
    warnings.extend([note] if note else [])
    per_seq = tuple(ring.bytes_per_seq(k, model, kv_dtype, tp) for k in range(len(members))) if ring else ()
    snapshot = ring_snapshots_bytes(ring, model, kv_dtype, tp, 1)
    return DeviceRing(ring=ring, kv_bytes_per_token=paged_bytes_per_token(model, kv_dtype, 1, ring),
                      kv_bytes_per_token_per_device=paged_bytes_per_token(model, kv_dtype, tp, ring),
                      ring_bytes_per_device=per_seq, snapshot_bytes=snapshot, note=note)


def _kept_note(key: str, model: ModelConfig, block_size: int, limits: list[PoolLimits]) -> str:
    """Why `auto` kept every position of a model whose sliding layers rings could hold (empty: the rings would bound
    nothing), for the plan's warnings."""
    if (swaps := next((p for p in limits if p.uses_swap), None)) is not None:
        return (f"{key}: auto keeps every position of the sliding layers' K/V because pool {swaps.name!r} may swap; "
                "with every pool of the device at preemption_mode: recompute they would keep a ring a sequence "
                "(sliding_kv: full keeps this layout without this note)")
    rings = plan_ring(model, "window", block_size, limits)
    if (pool := ring_outgrows(rings, limits)) is None:
        return ""
    k = limits.index(pool)
    snapshot = rings.snapshot_blocks * block_size if pool.enable_prefix_caching else 0
    return (f"{key}: auto keeps every position of the sliding layers' K/V because pool {pool.name!r} would run fewer "
            f"sequences with rings: its ring of {rings.tokens(k):,} positions (its step and the window"
            + (f", and a {snapshot}-position snapshot for the prefix cache" if snapshot else "")
            + f") outgrows its avg_len {pool.avg_len:,}; a smaller long_prefill_token_threshold shortens it, "
            "sliding_kv: window takes rings anyway, sliding_kv: full keeps this layout without this note")


def ring_only_blocks(key: str, p: PoolSpec, seq_kv: int, s_held: int, max_model_len: int, budget: str,
                     ring: bool = True) -> int:
    """The blocks of a pool whose every KV layer is in a ring, or whose model has no KV layer (Mamba's: S_KV 0): a
    block holds no bytes, only a place in a sequence's table, so the pool gets its max_num_seqs (the config's, or the
    formula's `seq_kv // s_held`, `s_held` a sequence's ring or state and its snapshot) sequences of max_model_len.
    SpecError, naming `key` or `budget` (the pool's budget key and value), where not one sequence's fits or the
    config's max_num_seqs outgrow the pool's bytes; `ring`: what a sequence holds is a ring (else a state, whose size
    no step's length changes)."""
    seqs = p.max_num_seqs if p.max_num_seqs is not None else seq_kv // s_held
    if seqs == 0:
        held = "ring of every layer" if ring else "state"
        advice = f", or lower {key}.max_num_batched_tokens or long_prefill_token_threshold" if ring else ""
        raise SpecError(f"{budget} gives pool {p.name!r} {seq_kv:,} B per GPU for its sequences, less than one "
                        f"sequence's {held} ({s_held:,} B): raise the budget{advice}")
    if seqs * s_held > seq_kv:
        raise SpecError(f"{key}.max_num_seqs: {seqs} sequences hold {seqs * s_held:,} B of rings or states per GPU, "
                        f"above the {seq_kv:,} B pool {p.name!r} has for them ({budget}): at most {seq_kv // s_held}")
    return seqs * -(-max_model_len // p.block_size)
