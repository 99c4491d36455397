"""The block allocator of one pool: integer block ids, a free list, reference counts, block tables,
and the automatic prefix cache.

No torch here: the tensor that backs the blocks lives in `engine.kv_cache`; this module only decides
which block ids a sequence owns. A pool owns the contiguous id range
`[first_block, first_block + num_blocks)` of its device's KV tensor, so pools on one device never
share a block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_ROOT_SERIAL = 0  # the `parent_serial` of a sequence's first block


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` / `copy_on_write` when the pool has too few free blocks; nothing was changed."""


class BlockIntegrityError(AssertionError):
    """`check_integrity` found the free list, the reference counts or the tables inconsistent."""


def cache_root(cache_salt: str | None) -> int | None:
    """The parent key of a sequence's first block: None (shared by every sequence without a salt),
    or a key of `cache_salt`, so sequences of different salts (tenants) never find each other's blocks."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens chained to the key of the block before it
    (None for a sequence's first block). A key only finds a candidate; hits are verified by tokens."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class _FullBlock:
    """What the prefix cache knows about one full, computed block.

    `registered`: the block is the one `_hash_to_block[block_hash]` names, a cache entry. Otherwise it
    is a referenced block that duplicates an entry, or whose chain is broken (a collision, an evicted
    parent); it is kept only so `register_computed` need not rehash the prefix.
    `chain_serial` is what a child block must name as `parent_serial`: an entry's own serial number
    (never reused), a duplicate's entry's, or None when nothing after this block can be registered.
    """

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    parent_serial: int | None
    chain_serial: int | None
    registered: bool


class BlockManager:
    """Allocates blocks of `block_size` token slots from one pool's id range.

    A block table is a plain `list[int]` owned by its sequence; `allocate` grows it in place and
    `free` empties it. Reference counts make a block shareable (`fork` for n > 1 sampling,
    `acquire_cached` for prefix caching); `copy_on_write` gives a table a private copy of a shared
    block before it is written.

    Every block is exactly one of: free (count 0, on the free list), cached-free (count 0, registered
    in the prefix cache, on the evictable LRU) or used (count > 0). With `enable_prefix_caching`,
    `register_computed` registers each full computed block under a hash chain over its tokens; a
    registered block whose count drops to 0 keeps its K/V and becomes cached-free, so a later sequence
    with the same prefix can take it back (`acquire_cached`). `allocate` uses the free list first, then
    evicts the least recently freed cached block. A hit is verified, never trusted on the hash: the
    entry's tokens, its parent hash and its parent *entry* (a serial number, never reused) must all
    match, so the whole prefix behind a cached block equals the new sequence's.

    Counters (prefix caching on; vLLM's meanings): `num_prefix_queries` += len(token_ids) and
    `num_prefix_hits` += tokens covered per `acquire_cached` call, so hits / queries is the hit rate;
    `num_evictions` counts cached blocks whose registration `allocate` dropped.
    Single-threaded: the device worker's scheduler is the only caller.
    """

    def __init__(self, num_blocks: int, block_size: int, first_block: int = 0,
                 enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        if first_block < 0:
            raise ValueError(f"first_block: must be >= 0, got {first_block}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.first_block = first_block
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(first_block, first_block + num_blocks))
        self._ref_counts = [0] * num_blocks  # index: block id - first_block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free, least recently freed first
        self._full: dict[int, _FullBlock] = {}  # block id -> what the cache knows (count > 0 or cached-free)
        self._hash_to_block: dict[int, int] = {}  # registered blocks only
        self._next_serial = _ROOT_SERIAL + 1
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_evictions = 0

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: free + cached-free."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        """Unreferenced blocks that still hold a registered prefix (evicted last, LRU)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count > 0."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def owns(self, block_id: int) -> bool:
        return self.first_block <= block_id < self.first_block + self.num_blocks

    def writes_in_place(self, block_table: list[int], start: int, num_new: int) -> bool:
        """Whether writing slots start .. start + num_new - 1 of `block_table` needs nothing from the pool:
        they lie in blocks the table holds, and the one `start` falls in is held by this table alone (no
        copy on write). Most decode steps; the scheduler's fast path."""
        if not 0 < num_new or start + num_new > len(block_table) * self.block_size:
            return False
        index = block_table[start // self.block_size] - self.first_block
        return 0 <= index < self.num_blocks and self._ref_counts[index] == 1   # else the checked path says why

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id - self.first_block]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache (used or cached-free)."""
        self._check_id(block_id)
        entry = self._full.get(block_id)
        return entry is not None and entry.registered

    def chain_serial(self, block_id: int) -> int | None:
        """The serial of the prefix-cache entry that stands for the prefix `block_id` ends (its own, or the entry's
        it duplicates); None when the cache knows no verifiable prefix there. Serials are never reused."""
        entry = self._full.get(block_id)
        return None if entry is None else entry.chain_serial

    def num_shared_blocks(self, block_table: list[int]) -> int:
        """Blocks of the table that another table also references (count > 1)."""
        return sum(1 for b in block_table if self.ref_count(b) > 1)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `allocate(block_table, num_tokens)` would take from the free (or cached-free) blocks."""
        return max(0, self.num_blocks_for(num_tokens) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= self.num_free_blocks

    # --- mutations -----------------------------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> list[int]:
        """Grow `block_table` in place until it covers `num_tokens` slots; return the new block ids.

        Takes from the free list first, then evicts cached-free blocks, least recently freed first.
        All or nothing: raises NoFreeBlocksError, changing nothing, when too few blocks are free.
        """
        need = self.num_new_blocks(block_table, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {need} blocks for {num_tokens} tokens, {self.num_free_blocks} free "
                f"({len(self._evictable)} of them cached) of {self.num_blocks}")
        new_blocks = [self._take_free_block() for _ in range(need)]
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

    def copy_on_write(self, block_table: list[int], index: int) -> tuple[int, int] | None:
        """Give the table a private copy of `block_table[index]` before it is written.

        Shared (count > 1): a fresh block (count 1) replaces it in the table, the old one loses a
        reference, and `(old, new)` is returned: the caller copies the K/V from old to new. Private
        (count 1): None. Raises NoFreeBlocksError, changing nothing, when no block is free.
        """
        old = block_table[index]
        self._check_id(old)
        count = self._ref_counts[old - self.first_block]
        if count == 0:
            raise BlockIntegrityError(f"copy_on_write of free block {old}")
        if count == 1:
            return None
        if self.num_free_blocks == 0:
            raise NoFreeBlocksError(f"copy_on_write of block {old}: no free block of {self.num_blocks}")
        new = self._take_free_block()
        self._ref_counts[old - self.first_block] -= 1
        block_table[index] = new
        return old, new

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of the table and empty it.

        A block whose count reaches zero becomes cached-free when it is registered in the prefix
        cache, free otherwise. Blocks are returned in reverse order, so a sequence's tail is reused
        (or evicted) before its head, which other prompts are likelier to share.
        """
        for block_id in block_table:
            self._check_id(block_id)
            if self._ref_counts[block_id - self.first_block] <= 0:
                raise BlockIntegrityError(f"double free of block {block_id}")
        for block_id in reversed(block_table):
            index = block_id - self.first_block
            self._ref_counts[index] -= 1
            if self._ref_counts[index] == 0:
                entry = self._full.get(block_id)
                if entry is not None and entry.registered:
                    self._evictable[block_id] = None
                else:
                    self._full.pop(block_id, None)
                    self._free.append(block_id)
        block_table.clear()

    # --- prefix cache --------------------------------------------------------------------
    def acquire_cached(self, block_table: list[int], token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """At admission, fill an empty table with the longest verified cached prefix of `token_ids`
        among the blocks registered with the same `cache_salt`.

        Takes a reference to each block (reviving cached-free ones). At most
        `(len(token_ids) - 1) // block_size` blocks, so the last token is always computed and never
        lands in a shared block. Returns the tokens covered (blocks x block_size); 0 with caching off.
        """
        if block_table:
            raise ValueError(f"acquire_cached: the table must be empty, it holds {len(block_table)} blocks")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hits: list[int] = []
        parent_hash = cache_root(cache_salt)
        parent_serial = _ROOT_SERIAL
        for i in range(max(0, len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            entry = self._full[block_id]
            if (entry.token_ids != tokens or entry.parent_hash != parent_hash
                    or entry.parent_serial != parent_serial):
                break  # a hash collision, or an entry whose parent entry was evicted: not this prefix
            hits.append(block_id)
            parent_hash, parent_serial = block_hash, entry.chain_serial
        for block_id in hits:
            index = block_id - self.first_block
            if self._ref_counts[index] == 0:
                del self._evictable[block_id]
            self._ref_counts[index] += 1
        block_table.extend(hits)
        num_tokens = len(hits) * bs
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += num_tokens
        return num_tokens

    def register_computed(self, block_table: list[int], token_ids: Sequence[int],
                          num_computed_tokens: int, cache_salt: str | None = None) -> None:
        """After a step computed `token_ids[:num_computed_tokens]`, register the table's newly full blocks.

        A block already registered is left alone; when another block already holds the same prefix,
        that mapping is kept and this block stays unregistered. Incremental: only blocks after the
        last one the cache already knows are hashed. No-op with caching off.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} > {len(token_ids)} tokens")
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_table))
        start = num_full
        parent_hash = cache_root(cache_salt)
        parent_serial: int | None = _ROOT_SERIAL
        while start > 0:  # the last block the cache knows carries the chain state
            entry = self._full.get(block_table[start - 1])
            if entry is not None:
                if entry.token_ids != tuple(token_ids[(start - 1) * bs:start * bs]):
                    raise BlockIntegrityError(
                        f"block {block_table[start - 1]} at index {start - 1} holds other tokens "
                        f"than the sequence")
                parent_hash, parent_serial = entry.block_hash, entry.chain_serial
                break
            start -= 1
        if parent_serial not in (None, _ROOT_SERIAL):
            holder = self._hash_to_block.get(parent_hash)
            if holder is None or self._full[holder].chain_serial != parent_serial:
                parent_serial = None  # a duplicate of an entry since evicted: the chain cannot be verified
        for i in range(start, num_full):
            block_id = block_table[i]
            self._check_id(block_id)
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            holder = self._hash_to_block.get(block_hash)
            entry = _FullBlock(block_hash, parent_hash, tokens, parent_serial, None, registered=False)
            if parent_serial is None:
                pass  # the chain broke earlier: nothing after it can be registered
            elif holder is None:
                self._register(block_id, entry)
            else:
                held = self._full[holder]
                if held.parent_hash == parent_hash and held.parent_serial != parent_serial:
                    # An orphan: its parent entry was evicted, so no lookup can verify it again.
                    self._unregister(holder)
                    self._register(block_id, entry)
                elif held.token_ids == tokens and held.parent_hash == parent_hash:
                    entry.chain_serial = held.chain_serial  # a duplicate: children chain to the entry
            self._full[block_id] = entry
            parent_hash, parent_serial = block_hash, entry.chain_serial

    def _register(self, block_id: int, entry: _FullBlock) -> None:
        entry.registered = True
        entry.chain_serial = self._next_serial
        self._next_serial += 1
        self._hash_to_block[entry.block_hash] = block_id

    def _unregister(self, block_id: int) -> None:
        """Drop a registration without evicting: a cached-free block becomes free; a used one keeps
        no chain (nothing after it can be registered through it)."""
        entry = self._full[block_id]
        del self._hash_to_block[entry.block_hash]
        if block_id in self._evictable:
            del self._evictable[block_id]
            del self._full[block_id]
            self._free.append(block_id)
        else:
            entry.registered = False
            entry.chain_serial = None

    def reset_prefix_cache(self) -> int:
        """Forget every registration: cached-free blocks become free. Returns how many were."""
        num_cached = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._full.clear()
        self._hash_to_block.clear()
        return num_cached

    def _take_free_block(self) -> int:
        """One block with count 0 -> count 1: the free list first, else evict the LRU cached block."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            entry = self._full.pop(block_id)
            del self._hash_to_block[entry.block_hash]
            self.num_evictions += 1
        index = block_id - self.first_block
        if self._ref_counts[index] != 0:
            raise BlockIntegrityError(f"block {block_id} handed out with ref count {self._ref_counts[index]}")
        self._ref_counts[index] = 1
        return block_id

    # --- invariants ----------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[list[int]] | None = None) -> None:
        """Raise BlockIntegrityError unless the allocator is consistent.

        Always: every block is exactly one of free (count 0, on the free list), cached-free (count 0,
        registered, on the evictable list) or used (count > 0); free + cached-free + used == total;
        `_hash_to_block` and the blocks' registrations agree both ways; the cache knows nothing about
        free blocks. With `block_tables` (every live table of the pool): each block's reference count
        equals the number of table entries naming it.
        """
        free_set, cached_set = self._check_block_states()
        self._check_prefix_cache(free_set, cached_set)
        if block_tables is not None:
            self._check_ref_counts(block_tables)

    def _check_block_states(self) -> tuple[set[int], set[int]]:
        """Free, cached-free and used partition the pool; returns the free and cached-free ids."""
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            dupes = [b for b, c in Counter(free).items() if c > 1]
            raise BlockIntegrityError(f"free list holds duplicates: {dupes[:10]}")
        cached_set = set(self._evictable)
        bad = [b for b in free + list(cached_set) if not self.owns(b)]
        if bad:
            raise BlockIntegrityError(f"free or cached-free lists hold ids outside the pool: {bad[:10]}")
        both = free_set & cached_set
        if both:
            raise BlockIntegrityError(f"blocks both free and cached-free: {sorted(both)[:10]}")
        used = 0
        for index, count in enumerate(self._ref_counts):
            block_id = index + self.first_block
            if block_id in free_set or block_id in cached_set:
                if count != 0:
                    state = "free" if block_id in free_set else "cached-free"
                    raise BlockIntegrityError(f"{state} block {block_id} has ref count {count}")
            elif count <= 0:
                raise BlockIntegrityError(f"block {block_id} is neither free nor referenced (count {count})")
            else:
                used += 1
        if used + len(free) + len(cached_set) != self.num_blocks:
            raise BlockIntegrityError(
                f"free {len(free)} + cached-free {len(cached_set)} + used {used} != total {self.num_blocks}")
        return free_set, cached_set

    def _check_prefix_cache(self, free_set: set[int], cached_set: set[int]) -> None:
        """`_hash_to_block` and the blocks' registrations agree both ways; free blocks have no record."""
        for block_hash, block_id in self._hash_to_block.items():
            entry = self._full.get(block_id)
            if entry is None or not entry.registered or entry.block_hash != block_hash:
                raise BlockIntegrityError(
                    f"hash {block_hash} names block {block_id}, which is not registered under it")
        for block_id, entry in self._full.items():
            if block_id in free_set:
                raise BlockIntegrityError(f"free block {block_id} still has a prefix-cache record")
            if entry.registered:
                if self._hash_to_block.get(entry.block_hash) != block_id:
                    raise BlockIntegrityError(f"block {block_id} is registered but its hash names "
                                              f"{self._hash_to_block.get(entry.block_hash)}")
            elif block_id in cached_set:
                raise BlockIntegrityError(f"cached-free block {block_id} is not registered")
        unregistered = [b for b in cached_set if b not in self._full]
        if unregistered:
            raise BlockIntegrityError(f"cached-free blocks not registered: {unregistered[:10]}")

    def _check_ref_counts(self, block_tables: Iterable[list[int]]) -> None:
        """Each block's reference count equals the number of table entries naming it."""
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
