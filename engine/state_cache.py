"""Prefix caching for a model whose layers keep a state per sequence (Qwen3.5's Gated DeltaNet, Mamba-2), or whose
sliding layers keep a ring of their window (`engine.sliding_kv`): which cached prefixes also have their state (the
window's K/V) kept, on the host side. The device side is `engine.layers.gated_delta_net.RecurrentStates`' snapshot
slots, and `engine.kv_cache.KVCache.ring_snapshots` (the same slot numbers).

A cached prefix's K/V alone cannot resume such a sequence: the state layers need their state after exactly those
tokens. So a pool keeps **snapshots**, copies of every state layer's state taken after a prefix that ends on a
block boundary, each tied to the prefix-cache entry of the block it ends with (`BlockManager.chain_serial`: serial
numbers are never reused, so an evicted or re-registered block can never answer for a snapshot taken of another
prefix). A sequence admitted with a cached prefix resumes from the longest one that has a snapshot: the blocks
past it are given back and computed again (`StateSnapshots.admit`).

Where snapshots are taken (`StateSnapshots.plan`), at most two per sequence and step, during prefill (a recompute's
too) and never in a decode step:
- the last block boundary of each prefill chunk, and of the prompt the last one a later identical prompt can
  resume from (`(len - 1) // block_size` blocks: the last token is always computed). Long documents read in
  chunks keep a snapshot per chunk, and the next turn of a conversation (the prompt, the answer, a new message)
  resumes where the last turn's prompt ended;
- the **branch point**: where the K/V the sequence found cached ends when no snapshot was there. A system prompt
  shared by many users is computed once more by the second user, who keeps the state at its end, and from the
  third user on it is a hit.

A pool has as many snapshot slots as it runs sequences (`max_num_seqs`), or its `state_snapshots` (0: the pool
serves without prefix caching); the capacity plan counts them, one state a slot. A snapshot is bound when its step
commits (`bind`, after the blocks are registered), and the least recently used one is overwritten when none is free.
Host ints only, no torch: the device copies are the model runner's (`StepPlan.state_loads`, `state_saves`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.block_manager import BlockManager
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence

__all__ = ["StateSnapshots", "attach_snapshots", "give_snapshots", "num_snapshot_slots", "states_bytes"]


class StateSnapshots:
    """One pool's snapshot slots `first_slot .. first_slot + num_slots - 1` and the prefixes they hold.

    Every slot is exactly one of: free, bound (to a prefix-cache entry's serial, least recently used first) or
    reserved (a save planned in the step being run, bound or freed by `bind` when the step commits)."""

    def __init__(self, num_slots: int, first_slot: int, block_manager: BlockManager) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots: must be > 0, got {num_slots}")
        self.num_slots, self.first_slot, self.block_manager = num_slots, first_slot, block_manager
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))   # popped from the end
        self._bound: OrderedDict[int, int] = OrderedDict()   # entry serial -> slot, least recently used first
        self._reserved: set[int] = set()
        self.num_saved = 0      # snapshots bound (a prefix's state kept)
        self.num_loaded = 0     # admissions that resumed from a snapshot (counted by the scheduler)
        self.num_given_back = 0  # cached blocks an admission gave back for want of a snapshot at their end

    @property
    def num_bound(self) -> int:
        return len(self._bound)

    def admit(self, seq: Sequence) -> int | None:
        """After `BlockManager.acquire_cached` filled `seq`'s table with its cached prefix: keep the longest part
        of it that ends where a snapshot was taken, give the rest back, and return the slot to resume from (None:
        from the first token). Where the cached K/V went past that, its end is the sequence's branch point."""
        bm, table = self.block_manager, seq.block_table
        hit, slot = len(table), None
        keep = hit
        while keep > 0:
            slot = self._bound.get(bm.chain_serial(table[keep - 1]))
            if slot is not None:
                break
            keep -= 1
        if keep < hit:
            tail = table[keep:]
            del table[keep:]
            bm.free(tail)   # (empties `tail`)
            bm.num_prefix_hits -= (hit - keep) * bm.block_size
            self.num_given_back += hit - keep
        seq.num_computed_tokens = keep * bm.block_size
        seq.state_branch = hit * bm.block_size if keep < hit else 0
        if slot is not None:
            self._bound.move_to_end(bm.chain_serial(table[keep - 1]))
        return slot

    def plan(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Reserve a slot for each snapshot the step's prefill pieces take (`ScheduledSeq.state_saves`: the
        offset into the piece, the slot), least recently used ones overwritten when none is free; a save
        with no slot left is skipped."""
        bs = self.block_manager.block_size
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            known = len(seq.token_ids) - seq.num_pending
            if n == 1 and start + 1 >= known:   # a decode (or a prompt's last token): no snapshot
                continue
            ends = {min((start + n) // bs, (known - 1) // bs) * bs, seq.state_branch}
            for end in sorted(e for e in ends if start < e <= start + n):
                slot = self._take()
                if slot is None:
                    break
                item.state_saves.append((end - start, slot))

    def _take(self) -> int | None:
        if self._free:
            slot = self._free.pop()
        elif self._bound:
            slot = self._bound.popitem(last=False)[1]
        else:
            return None
        self._reserved.add(slot)
        return slot

    def bind(self, item: ScheduledSeq) -> None:
        """After the step's commit registered its blocks: tie each of `item`'s saves to the entry of the block it
        ends with; a save whose block is not an entry (the chain broke), or whose entry has a snapshot already,
        gives its slot back."""
        bm, seq = self.block_manager, item.seq
        for offset, slot in item.state_saves:
            self._reserved.discard(slot)
            index = (seq.num_computed_tokens - item.num_new_tokens + offset) // bm.block_size - 1
            serial = bm.chain_serial(seq.block_table[index]) if index < len(seq.block_table) else None
            if serial is None or serial in self._bound:   # (a table emptied meanwhile: nothing to tie it to)
                self._free.append(slot)
                continue
            self._bound[serial] = slot
            self.num_saved += 1
        if seq.state_branch and seq.num_computed_tokens >= seq.state_branch:
            seq.state_branch = 0

    def check_integrity(self) -> None:
        """Every slot is free, bound or reserved, and only one of them."""
        slots = [*self._free, *self._bound.values(), *self._reserved]
        if sorted(slots) != list(range(self.first_slot, self.first_slot + self.num_slots)):
            raise AssertionError(f"state snapshot slots inconsistent: free {sorted(self._free)}, bound "
                                 f"{sorted(self._bound.values())}, reserved {sorted(self._reserved)}")


def num_snapshot_slots(pools: Iterable) -> int:
    """The snapshot slots a state model's pools hold on a device: each pool's `SchedulerConfig.snapshot_slots` (one
    per sequence it runs by default, `state_snapshots` where set; `PoolConfig`s: rank 0's and every rank's alike)."""
    return sum(p.scheduler.snapshot_slots for p in pools)


def give_snapshots(schedulers: Iterable) -> int:
    """Give each prefix-caching pool (`Scheduler`s) of a state model (or one with rings) its snapshot slots, side by
    side from 0; the slots in all (the engine's, and the simulator's for such a model, which then schedules as the
    engine does)."""
    first = 0
    for scheduler in schedulers:
        count = scheduler.config.snapshot_slots   # (0 without prefix caching)
        if count:
            scheduler.state_snapshots = StateSnapshots(count, first, scheduler.block_manager)
            first += count
    return first


def attach_snapshots(schedulers: Iterable, model, kv_cache=None) -> None:
    """`give_snapshots`, and the device tensors of them all: the model's states' (`model.states`) and the sliding
    layers' rings' (`kv_cache.reserve_ring_snapshots`, `engine.sliding_kv`); nothing for a model without either."""
    states, rings = getattr(model, "states", None), getattr(kv_cache, "ring", None)
    if states is None and rings is None:
        return
    slots = give_snapshots(schedulers)
    if states is not None:
        states.reserve_snapshots(slots)
    if rings is not None:
        kv_cache.reserve_ring_snapshots(slots)


def states_bytes(config, model_config, dtype) -> int:
    """What a state model's per-sequence states take on one rank of an `EngineConfig`'s device: a state for each
    sequence its pools run and for each snapshot slot (`num_snapshot_slots`); 0 for a model without state layers."""
    if model_config.state_shape is None:
        return 0
    slots = sum(p.scheduler.max_num_seqs for p in config.pools) + num_snapshot_slots(config.pools)
    return slots * model_config.state_bytes_per_seq(dtype, config.tensor_parallel_size)
