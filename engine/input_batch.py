"""The persistent batch: the running sequences' block tables, kept between steps as rows of one tensor.

Rebuilding a step's attention inputs from Python lists costs O(blocks) of host work per sequence per step
(the block tables) and O(tokens) (the slot of every new token). Here each running sequence owns a row of
`block_tables` [max_rows, max_blocks] int32 on the device for as long as it runs; a step sends only what
changed in the rows it schedules (a decode appends a block once every `block_size` tokens) and computes
the slots on the device from the rows and the positions.

Rank 0's `InputBatch` assigns the rows (`assign`) and says which entries changed (`RowUpdate`); every rank
(followers of a tensor-parallel group included) applies the same updates (`apply`) and builds the same
metadata from the same `StepPlan` (`prepare`). A row is released when its sequence stops running
(finished, preempted or swapped out: `release`), so a sequence that comes back gets a fresh row.

The step's ints (token ids, positions, rows, query and sequence lengths) travel to the device as one
tensor in one copy, non-blocking from pinned memory on CUDA, as do the changed rows. Owned by one
model runner; not thread-safe.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from engine.sliding_kv import SlidingRing
from kernels import AttentionMetadata
from kernels.transfer import to_device, to_device_tensor


@dataclass(frozen=True)
class RowUpdate:
    """Block ids written into a row from block index `start` on (the entries past them are stale, unread)."""

    row: int
    start: int
    block_ids: tuple[int, ...]


class InputBatch:
    """Rows of block tables that persist across steps, and the step's inputs made from them."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 ring: SlidingRing | None = None) -> None:
        self.block_size, self.device = block_size, device
        # a window-bounded cache's rings (engine.sliding_kv): each pool's sequences take the rows of its range, each
        # row its pool's ring; ring_base / ring_size: [rows] int64, each row's first ring block and its count
        self.ring = ring
        if ring is not None:
            base, sizes = ring.row_layout()
            self.ring_base, self.ring_size = (to_device(values, torch.int64, device) for values in (base, sizes))
        self.on_host = device.type == "cpu"
        # block_tables: [max_rows, max_blocks] int32 on the device; `_host` is its copy in (pinned) host
        # memory where the updates are written first (the same tensor on a CPU device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self._host = self.block_tables if self.on_host else torch.zeros_like(self.block_tables, device="cpu").pin_memory()
        # rank 0's bookkeeping: which sequence holds which row, and what the row holds
        self._row_of: dict[int, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        if ring is not None:   # each pool's own rows (its index in the device's pools: `_pool_free`)
            self._first_rows = ring.first_rows()
            self._pool_free = [list(range(first + rows - 1, first - 1, -1))
                               for first, rows in zip(self._first_rows, ring.rows)]
        self._known: dict[int, tuple[int, int]] = {}     # row -> (its holder's blocks written, the last one)
        self._extent: dict[int, int] = {}                 # row -> entries written since they were last zeroed

    @property
    def num_rows(self) -> int:
        """Rows held by running sequences."""
        return len(self._row_of)

    # --- rank 0: rows for the step's sequences ---------------------------------------------------
    def assign(self, seqs: Iterable[tuple[int, Sequence[int]] | tuple[int, Sequence[int], str]]
               ) -> tuple[list[int], list[RowUpdate]]:
        """(seq_id, block table[, pool]) of each scheduled sequence, in step order -> each one's row (with rings, of
        the pool's range: the pool is needed then), and the
        updates that bring the rows up to date: the blocks appended since the last step, or the whole
        table when its last known block changed (copy on write) or the row is new."""
        rows, updates = [], []
        for seq_id, table, *pool in seqs:
            row = self._row_of.get(seq_id)
            if row is None:
                row = self._take_row(*pool)
                self._row_of[seq_id] = row
                known = (0, -1)
            else:
                known = self._known[row]
            count, last = known
            if count and (len(table) < count or table[count - 1] != last):
                count = 0                              # not an append: write the row again
            if len(table) > count or (count == 0 and table):
                stale = self._extent.get(row, 0) - len(table) if count == 0 else 0
                # past a rewritten table, what an earlier holder left is zeroed (rows are padded with 0)
                updates.append(RowUpdate(row, count, (*table[count:], *(0,) * max(stale, 0))))
                self._known[row] = (len(table), table[-1])
                self._extent[row] = len(table)
            rows.append(row)
        return rows, updates

    def release(self, seq_id: int) -> None:
        """The sequence stopped running: its row is free (nothing if it holds none)."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._known.pop(row, None)
            if self.ring is None:
                self._free.append(row)
            else:
                self._pool_free[bisect.bisect_right(self._first_rows, row) - 1].append(row)   # its pool's

    def _take_row(self, pool: str = "default") -> int:
        if self.ring is not None:   # a row of the pool's range, its ring the pool's size
            index = self.ring.pools.index(pool)
            if not self._pool_free[index]:
                raise RuntimeError(f"pool {pool!r} runs more sequences than the {self.ring.rows[index]} rings the KV "
                                   "cache was made with (its max_num_seqs)")
            return self._pool_free[index].pop()
        if not self._free:
            old = self.block_tables.shape[0]
            self._grow(rows=2 * old)
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    # --- every rank: apply the updates, build the step's inputs -------------------------------------
    def apply(self, updates: Sequence[RowUpdate]) -> None:
        """Write the updates into the rows: on the host copy, then one copy of the changed rows to the device."""
        if not updates:
            return
        num_rows, num_blocks = self.block_tables.shape
        width = max(u.start + len(u.block_ids) for u in updates)
        top = max(u.row for u in updates)
        if width > num_blocks or top >= num_rows:   # a follower learns of new rows here
            self._grow(rows=max(top + 1, num_rows), blocks=max(width, 2 * num_blocks) if width > num_blocks else None)
        for u in updates:
            self._host[u.row, u.start:u.start + len(u.block_ids)] = torch.tensor(u.block_ids, dtype=torch.int32)
        if not self.on_host:
            rows = sorted({u.row for u in updates})
            changed = self._host.index_select(0, torch.tensor(rows))
            self.block_tables.index_copy_(0, to_device(rows, torch.int64, self.device),
                                          to_device_tensor(changed, self.device))

    def prepare(self, input_ids: Sequence[int], positions: Sequence[int], rows: Sequence[int],
                query_lens: Sequence[int], seq_lens: Sequence[int]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids and positions ([num_tokens] int64) and its attention metadata, from the
        rows (after `apply`): one copy of the step's ints, the slots computed on the device."""
        num_tokens, num_seqs = len(input_ids), len(rows)
        packed = torch.tensor([*input_ids, *positions, *rows, *query_lens, *seq_lens], dtype=torch.int64)
        if not self.on_host:
            packed = to_device_tensor(packed, self.device)
        ids, pos, row_t, q_lens, s_lens = packed.split([num_tokens, num_tokens, num_seqs, num_seqs, num_seqs])
        width = -(-max(seq_lens) // self.block_size) if seq_lens else 0
        tables = self.block_tables[:, :width].index_select(0, row_t)                   # [num_seqs, width]
        if all(q == 1 for q in query_lens):   # decodes only: token i is sequence i's (not counts: 0 + 2 rows tie)
            blocks = tables.gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
            starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=self.device)
            seq_of_token = None
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=self.device), q_lens,
                                                   output_size=num_tokens)          # [num_tokens]
            blocks = tables[seq_of_token, pos // self.block_size].to(torch.int64)
            starts = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=blocks * self.block_size + pos % self.block_size,
            block_tables=tables,
            query_start_loc=starts,
            seq_lens=s_lens.to(torch.int32),
            block_size=self.block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            rows=row_t,
            rows_list=list(rows))
        if self.ring is not None:
            token_rows = row_t if seq_of_token is None else row_t[seq_of_token]
            meta.ring = ring_metadata(meta, token_rows, pos, width, self.ring_base, self.ring_size)
        return ids, pos, meta

    def _grow(self, rows: int | None = None, blocks: int | None = None) -> None:
        """Make room for more rows or longer tables (the device's tensor and its host copy)."""
        old = self._host
        grown = torch.zeros(rows or old.shape[0], blocks or old.shape[1], dtype=torch.int32)
        grown[:old.shape[0], :old.shape[1]] = old
        if self.on_host:
            self.block_tables = self._host = grown
        else:
            self._host = grown.pin_memory()
            self.block_tables = to_device_tensor(grown, self.device)   # its own pinned copy: _host changes next


def ring_metadata(meta: AttentionMetadata, token_rows: torch.Tensor, positions: torch.Tensor, width: int,
                  ring_base: torch.Tensor, ring_size: torch.Tensor) -> AttentionMetadata:
    """`meta` over the sliding layers' rings (`engine.sliding_kv`): row r's logical block j is its ring block
    ring_base[r] + j % ring_size[r]. token_rows, positions: [num_tokens], each token's row and position; width:
    the block tables' entries. A slot `meta` does not store (-1, a padded row's) is not stored here either."""
    size = meta.block_size
    blocks = ring_base[token_rows] + (positions // size) % ring_size[token_rows]
    slots = torch.where(meta.slot_mapping < 0, -1, blocks * size + positions % size)
    offsets = torch.arange(width, dtype=torch.int64, device=token_rows.device)
    tables = (ring_base[meta.rows].unsqueeze(1) + offsets % ring_size[meta.rows].unsqueeze(1)).to(torch.int32)
    return replace(meta, slot_mapping=slots, block_tables=tables, backend_cache={}, ring=None)
