"""One pool's scheduler: continuous batching with chunked prefill, FCFS or priority order, and
preemption by recompute (most recently admitted first) when the pool runs out of blocks.

Each `schedule()` fills a token budget of `max_num_batched_tokens`: first the running sequences (a
decode token each, or the next chunk of an unfinished prefill), then waiting sequences in order while
`max_num_seqs`, the budget and the free blocks allow. Prefill chunks and decode tokens share the step.
Finished sequences leave and waiting ones join at every step (iteration-level scheduling).

Seams for what comes next: `_pick_victim` (victim policies) and `_preempt` (swap as well as recompute).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus


class RequestTooLargeError(ValueError):
    """The request can never run in this pool: refused at submission rather than left waiting."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int              # tokens computed this step, from seq.num_computed_tokens on


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0   # tokens whose K/V a recompute preemption threw away
    num_admitted: int = 0
    num_aborted: int = 0             # sequences finished by abort (client gone, or asked)


class Scheduler:
    """Owns one pool's waiting and running sequences and decides each step's batch.

    Single-threaded: called only from the device worker's engine loop.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 name: str = "default") -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.name = name
        self.waiting: list[Sequence] = []   # sorted by Sequence.sort_key
        self.running: list[Sequence] = []   # in admission order
        self.stats = SchedulerStats()

    # --- admission ---------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError unless prompt + max_tokens can ever run in this pool."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLargeError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len} of pool {self.name!r}")
        bm = self.block_manager
        if bm.num_blocks_for(total) > bm.num_blocks:
            raise RequestTooLargeError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens needs "
                f"{bm.num_blocks_for(total)} blocks; pool {self.name!r} has {bm.num_blocks} "
                f"({bm.capacity_tokens} tokens)")
        if not self.config.enable_chunked_prefill and total > self.config.max_num_batched_tokens:
            raise RequestTooLargeError(
                f"{total} tokens exceed max_num_batched_tokens {self.config.max_num_batched_tokens} "
                f"of pool {self.name!r}, which has chunked prefill off")

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # --- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq.block_table, seq.num_computed_tokens + num_new):
                victim = self._pick_victim()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1

        # No admissions in a step that had to preempt: the pool is full.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq.block_table, seq.num_computed_tokens + num_new):
                break  # strict order: later arrivals do not overtake the head of the queue
            self.waiting.pop(0)
            bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.stats.num_admitted += 1
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _pick_victim(self) -> Sequence:
        """reverse_fifo: the most recently admitted running sequence."""
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        """Recompute: drop the blocks; the sequence re-prefills prompt + output when readmitted."""
        self.running.remove(seq)
        self.stats.num_preemptions += 1
        self.stats.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_preemptions += 1
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        self.add(seq)

    # --- leaving -----------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take the sequence out of the pool and free its blocks (finished, stopped or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason is FinishReason.ABORT:
            self.stats.num_aborted += 1

    def check_integrity(self) -> None:
        """The block manager agrees with the running sequences' tables, and waiting ones hold no blocks
        (admission allocates, preemption frees everything)."""
        for seq in self.waiting:
            if seq.block_table:
                raise AssertionError(f"waiting sequence {seq.seq_id} holds blocks {seq.block_table}")
        self.block_manager.check_integrity([s.block_table for s in self.running])
