"""Turns a step's scheduled sequences into one flat forward pass over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model import LlamaForCausalLM
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from kernels import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [num_tokens]
    positions: torch.Tensor          # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor        # [num_sampled] row of each sampled sequence's last token
    sampled: list[Sequence]          # sequences that produce a token this step


class ModelRunner:
    """Owns the model and the KV cache of one device worker and runs the forward passes."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, backend) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.backend = backend

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        tables, query_lens, seq_lens = [], [], []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for item in batch:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            tables.append(seq.block_table)
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:  # reached the end: sample the next token
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        device = self.device
        meta = AttentionMetadata.build(tables, query_lens, seq_lens, self.kv_cache.block_size, device)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step; return logits [num_sampled, vocab] (float32) and the sequences they belong to."""
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta,
                            self.backend)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return logits, inputs.sampled
