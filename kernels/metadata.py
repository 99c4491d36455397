"""Per-step attention metadata: where each token's K/V goes and which blocks each sequence reads.

Built once per engine step by the model runner and handed down to every layer.
Tokens are laid out flat, sequence after sequence, with no padding: sequence `i` owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are its last `query_len` positions out of `seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The block sizes the attention kernels are tested and tuned for (the seed's CUDA paged attention
# stops at 32). The engine's CacheConfig and the YAML pool spec both import this tuple.
BLOCK_SIZES = (8, 16, 32)


@dataclass
class AttentionMetadata:
    # slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset (-1: do not store)
    slot_mapping: torch.Tensor
    # block_tables: [num_seqs, max_num_blocks] int32, rows padded with 0 past the sequence's blocks
    block_tables: torch.Tensor
    # query_start_loc: [num_seqs + 1] int32, prefix sums of the query lengths
    query_start_loc: torch.Tensor
    # seq_lens: [num_seqs] int32, tokens in the cache after this step (cached prefix + new tokens)
    seq_lens: torch.Tensor
    block_size: int
    # The same lengths as Python ints, for launch decisions without a device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    has_invalid_slots: bool = False
    # rows: [num_seqs] int64, each sequence's row of the persistent batch (engine.input_batch), where a model with
    # linear-attention layers keeps its state; None where the metadata was built without one. rows_list: as ints.
    rows: torch.Tensor | None = None
    rows_list: list[int] = field(default_factory=list)
    # ring: the same step's metadata over the rings of sliding layers whose K/V are window-bounded (engine.sliding_kv:
    # each row's own blocks, reused as the window moves on); None where every layer's K/V lie in the paged blocks.
    ring: AttentionMetadata | None = None
    # Scratch space a backend may fill once per step and reuse across layers (e.g. gather indices).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    def for_layer(self, sliding_window: int | None) -> AttentionMetadata:
        """The metadata a layer of this `sliding_window` reads its cache with: a sliding layer's ring where the
        step has one, this step's paged blocks otherwise."""
        return self.ring if sliding_window is not None and self.ring is not None else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(cls, block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for sequences whose new tokens are their last `query_lens[i]` of `seq_lens[i]`."""
        if not (len(block_tables) == len(query_lens) == len(seq_lens)):
            raise ValueError("block_tables, query_lens and seq_lens must have one entry per sequence")
        slots: list[int] = []
        for table, q_len, s_len in zip(block_tables, query_lens, seq_lens):
            if not 0 <= q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(
                    f"sequence with query_len {q_len}, seq_len {s_len} and {len(table)} blocks is inconsistent")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )
