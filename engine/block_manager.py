"""The block allocator of one pool: integer block ids, a free list, reference counts, block tables.

No torch here: the tensor that backs the blocks lives in `engine.kv_cache`; this module only decides
which block ids a sequence owns. A pool owns the contiguous id range
`[first_block, first_block + num_blocks)` of its device's KV tensor, so pools on one device never
share a block (DESIGN.md invariant 3).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool has too few free blocks; nothing was changed."""


class BlockIntegrityError(AssertionError):
    """`check_integrity` found the free list, the reference counts or the tables inconsistent."""


class BlockManager:
    """Allocates blocks of `block_size` token slots from one pool's id range.

    A block table is a plain `list[int]` owned by its sequence; `allocate` grows it in place and
    `free` empties it. Reference counts make a block shareable (`fork`, the seam for n > 1 sampling
    and prefix caching); a block returns to the free list when its count drops to zero.
    Single-threaded: the device worker's scheduler is the only caller.
    """

    def __init__(self, num_blocks: int, block_size: int, first_block: int = 0) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        if first_block < 0:
            raise ValueError(f"first_block: must be >= 0, got {first_block}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.first_block = first_block
        self._free: deque[int] = deque(range(first_block, first_block + num_blocks))
        self._ref_counts = [0] * num_blocks  # index: block id - first_block

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def owns(self, block_id: int) -> bool:
        return self.first_block <= block_id < self.first_block + self.num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id - self.first_block]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `allocate(block_table, num_tokens)` would take from the free list."""
        return max(0, self.num_blocks_for(num_tokens) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= len(self._free)

    # --- mutations -----------------------------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> list[int]:
        """Grow `block_table` in place until it covers `num_tokens` slots; return the new block ids.

        All or nothing: raises NoFreeBlocksError, changing nothing, when too few blocks are free.
        """
        need = self.num_new_blocks(block_table, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(
                f"need {need} blocks for {num_tokens} tokens, {len(self._free)} free of {self.num_blocks}")
        new_blocks = [self._free.popleft() for _ in range(need)]
        for block_id in new_blocks:
            self._ref_counts[block_id - self.first_block] = 1
        block_table.extend(new_blocks)
        return new_blocks

    def fork(self, block_table: list[int]) -> list[int]:
        """A new table sharing every block of `block_table` (reference counts + 1)."""
        for block_id in block_table:
            self._check_id(block_id)
            if self._ref_counts[block_id - self.first_block] == 0:
                raise BlockIntegrityError(f"fork of free block {block_id}")
        for block_id in block_table:
            self._ref_counts[block_id - self.first_block] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of the table and empty it; blocks at zero become free.

        Blocks are returned in reverse order so the most recently used tail is reused last.
        """
        for block_id in block_table:
            self._check_id(block_id)
            if self._ref_counts[block_id - self.first_block] <= 0:
                raise BlockIntegrityError(f"double free of block {block_id}")
        for block_id in reversed(block_table):
            index = block_id - self.first_block
            self._ref_counts[index] -= 1
            if self._ref_counts[index] == 0:
                self._free.append(block_id)
        block_table.clear()

    # --- invariants ----------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[list[int]] | None = None) -> None:
        """Raise BlockIntegrityError unless the allocator is consistent.

        Always: free ids are unique, in range and have count 0; every other block has count > 0;
        free + used == total. With `block_tables` (every live table of the pool): each block's
        reference count equals the number of table entries naming it.
        """
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            dupes = [b for b, c in Counter(free).items() if c > 1]
            raise BlockIntegrityError(f"free list holds duplicates: {dupes[:10]}")
        bad = [b for b in free if not self.owns(b)]
        if bad:
            raise BlockIntegrityError(f"free list holds ids outside the pool: {bad[:10]}")
        used = 0
        for index, count in enumerate(self._ref_counts):
            block_id = index + self.first_block
            if block_id in free_set:
                if count != 0:
                    raise BlockIntegrityError(f"free block {block_id} has ref count {count}")
            elif count <= 0:
                raise BlockIntegrityError(f"block {block_id} is neither free nor referenced (count {count})")
            else:
                used += 1
        if used + len(free) != self.num_blocks:
            raise BlockIntegrityError(
                f"free {len(free)} + used {used} != total {self.num_blocks}")
        if block_tables is not None:
            counts: Counter[int] = Counter()
            for table in block_tables:
                counts.update(table)
            foreign = [b for b in counts if not self.owns(b)]
            if foreign:
                raise BlockIntegrityError(f"tables hold blocks outside the pool: {foreign[:10]}")
            for index, count in enumerate(self._ref_counts):
                block_id = index + self.first_block
                if counts.get(block_id, 0) != count:
                    raise BlockIntegrityError(
                        f"block {block_id}: ref count {count} but {counts.get(block_id, 0)} table entries")

    def _check_id(self, block_id: int) -> None:
        if not self.owns(block_id):
            raise BlockIntegrityError(
                f"block {block_id} is outside this pool's range "
                f"[{self.first_block}, {self.first_block + self.num_blocks})")
