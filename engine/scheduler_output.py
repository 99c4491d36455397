"""What a pool's scheduler decides and counts: the step's batch and block moves (`SchedulerOutput`), its
running totals (`SchedulerStats`), and the refusal of a request the pool can never hold. Records only, so
the modules that read a step's batch (the model runner, the step-cost model, the simulator) need not import
the scheduler itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


class RequestTooLargeError(ValueError):
    """The request can never run in this pool: refused at submission rather than left waiting."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int              # tokens computed this step, from seq.num_computed_tokens on
    state_load: int | None = None    # a state model's snapshot slot it resumes from (`engine.state_cache`)
    state_saves: list[tuple[int, int]] = field(default_factory=list)   # snapshots it takes: (offset, slot)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (CPU block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst) device blocks
    finished: list[Sequence] = field(default_factory=list)          # ended by the scheduler (pool too small)
    # the three kinds of moves above in the order they were decided, consecutive ones of a kind together: run
    # in that order, each finds the blocks as the decisions before it left them (a sample given a copy-on-write
    # block, then preempted and swapped out, is swapped out with the copy in it)
    moves: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    _written: set[int] = field(default_factory=set, repr=False)     # the destinations of the last run

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def move(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        """Record block moves of `kind` ("swap_out", "swap_in" or "copy") after those decided before. A run of
        one kind is one batched copy, whose writes to one block twice land in no set order: a pair that reads or
        writes a block the run already writes starts a new run (a recompute frees a copy's destination, which
        the next copy-on-write may take)."""
        {"swap_out": self.swap_out, "swap_in": self.swap_in, "copy": self.copies}[kind].extend(pairs)
        for src, dst in pairs:   # a swap's source and destination are blocks of different pools (device, CPU)
            if not self.moves or self.moves[-1][0] != kind or dst in self._written or \
                    (kind == "copy" and src in self._written):
                self.moves.append((kind, []))
                self._written = set()
            self.moves[-1][1].append((src, dst))
            self._written.add(dst)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recomputed_tokens: int = 0   # tokens whose K/V a recompute preemption threw away
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    preempt_seconds: float = 0.0     # scheduling time spent preempting (the engine adds copy time)
    num_admitted: int = 0
    num_prefix_waits: int = 0        # admissions put off a step because a running sequence was prefilling the prefix
    num_aborted: int = 0             # sequences finished by abort (client gone, or asked)
    num_too_large: int = 0           # sequences ended because the pool could not hold them
    num_computed_tokens: int = 0     # tokens whose K/V the pool's steps computed (prefill, decode, recompute)
    num_generated_tokens: int = 0    # tokens sampled: new output only, never a recomputed one
