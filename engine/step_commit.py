"""The bookkeeping after a step's forward pass: `commit_step`, one copy for the engine, its warm-up, its KV-scale
calibration and the simulator (the sequences' computed tokens, the blocks they filled into the prefix cache), and
`check_pools` (the invariants that bookkeeping keeps, checked by the tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from engine.scheduler import ScheduledSeq, Scheduler

__all__ = ["check_pools", "commit_step"]


def commit_step(schedulers: Mapping[str, Scheduler], batch: Iterable[ScheduledSeq]) -> None:
    """The bookkeeping after a step's forward pass, one copy for the engine, its warm-up and the
    simulator: every scheduled sequence's computed tokens; for a sequence of a pool in `schedulers`,
    the pool's counter and the blocks it filled, registered in the prefix cache. (Its time goes to
    `StepComposer.observe` once the device has finished.) A step that
    filled no block (most decodes) registers nothing; blocks holding a placeholder wait until its
    value is known."""
    for item in batch:
        seq, num_new = item.seq, item.num_new_tokens
        seq.num_computed_tokens += num_new
        scheduler = schedulers.get(seq.pool)
        if scheduler is None:
            continue
        scheduler.stats.num_computed_tokens += num_new
        bm = scheduler.block_manager
        if seq.num_pending or seq.num_computed_tokens % bm.block_size < num_new:
            bm.register_computed(seq.block_table, seq.token_ids, min(
                seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending), seq.cache_salt)
        if item.state_saves:   # a state model's snapshots, tied to the blocks just registered
            scheduler.state_snapshots.bind(item)


def check_pools(schedulers: Mapping[str, Scheduler], num_rows: int) -> None:
    """AssertionError unless every pool's allocator agrees with its live sequences (each block free, cached-free
    or owned), a pool's sequences hold only that pool's blocks, and the persistent batch's `num_rows` rows are
    no more than the sequences running."""
    for scheduler in schedulers.values():
        scheduler.check_integrity()
        if scheduler.state_snapshots is not None:
            scheduler.state_snapshots.check_integrity()
        for seq in scheduler.running:
            if not all(scheduler.block_manager.owns(b) for b in seq.block_table):
                raise AssertionError(f"sequence {seq.seq_id} holds blocks outside pool {scheduler.name}")
    running = sum(len(s.running) for s in schedulers.values())
    if num_rows > running:
        raise AssertionError(f"{num_rows} rows of the persistent batch held, {running} sequences running")
