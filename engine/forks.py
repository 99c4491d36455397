"""Samples of one request (n > 1) that share its prompt's prefill and fork when it ends."""

from __future__ import annotations

import torch

from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus

from kernels.transfer import to_device


class SampleForks:
    """n > 1, in one place. A request's first sample prefills the prompt alone; its siblings wait
    here, in no scheduler, until that prefill ends. Then they fork its blocks (shared, copied on
    write) and sample their first token from its logits row, each with its own generator. Until then
    the first sample's `num_pending_forks` keeps room for them under its pool's `max_num_seqs`.

    Without `share_prefill` (a model whose linear-attention layers keep a state per sequence, which shared blocks
    do not carry) every sample is queued to the scheduler at once as a sequence of its own; with prefix caching the
    others wait while the first reads the prompt and then resume from the state it kept (`engine.state_cache`).
    """

    def __init__(self, schedulers: dict[str, Scheduler], share_prefill: bool = True) -> None:
        self._schedulers = schedulers
        self._share_prefill = share_prefill
        self._pending: dict[str, list[Sequence]] = {}   # request id -> samples 1.. not forked yet

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue a new request's samples: the first to its pool's scheduler, the others here (or all to the
        scheduler, without `share_prefill`)."""
        if not self._share_prefill:
            for seq in seqs:
                self._schedulers[seq.pool].add(seq)
            return
        first = seqs[0]
        first.num_pending_forks = len(seqs) - 1
        if first.num_pending_forks:
            self._pending[first.request_id] = seqs[1:]
        self._schedulers[first.pool].add(first)

    def has_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def fork(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """After a forward pass: each first sample that finished its prefill (it is sampled) forks its
        siblings, which get a copy of its logits row. logits: [num_sampled, vocab]."""
        extra_rows: list[int] = []
        extra: list[Sequence] = []
        for row, seq in enumerate(sampled):
            if not seq.num_pending_forks:
                continue
            scheduler = self._schedulers[seq.pool]
            for child in self._pending.pop(seq.request_id):
                child.block_table = scheduler.block_manager.fork(seq.block_table)
                child.num_computed_tokens = seq.num_computed_tokens
                scheduler.add_forked(child, seq)
                extra_rows.append(row)
                extra.append(child)
            seq.num_pending_forks = 0
        if not extra:
            return logits, sampled
        rows = to_device(extra_rows, torch.int64, logits.device)
        return torch.cat([logits, logits.index_select(0, rows)]), sampled + extra

    def end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """The siblings that never forked end with their request (an abort)."""
        for seq in self._pending.pop(request_id, ()):
            seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, reason, error

    def end_with_first(self, ended: list[Sequence]) -> None:
        """First samples that their scheduler ended before their prefill did take their siblings along."""
        for seq in ended:
            if seq.num_pending_forks:
                self.end(seq.request_id, seq.finish_reason, seq.error)
                seq.num_pending_forks = 0
