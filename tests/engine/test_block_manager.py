"""BlockManager: unit cases, and hypothesis state machines of allocate/append/fork/free/abort, and of
prefix caching with copy-on-write."""

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

import engine.block_manager as block_manager
from engine.block_manager import BlockIntegrityError, BlockManager, NoFreeBlocksError


def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(num_blocks=4, block_size=16, first_block=10)
    table: list[int] = []
    assert bm.allocate(table, 17) == table == [10, 11]
    assert bm.allocate(table, 32) == []          # still covered
    assert bm.num_free_blocks == 2
    bm.check_integrity([table])
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 4
    bm.check_integrity([])


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=8)
    table: list[int] = []
    bm.allocate(table, 8)
    with pytest.raises(NoFreeBlocksError, match="need 3 blocks"):
        bm.allocate(table, 8 * 4)
    assert table == [0] and bm.num_free_blocks == 2
    assert not bm.can_allocate(table, 8 * 4) and bm.can_allocate(table, 8 * 3)


def test_writes_in_place_only_inside_held_blocks_that_are_not_shared():
    """The scheduler's decode fast path: no block to take and none to copy on write."""
    bm = BlockManager(num_blocks=4, block_size=4, first_block=7)
    table: list[int] = []
    bm.allocate(table, 6)                                     # slots 0..7 held
    assert bm.writes_in_place(table, 5, 1) and bm.writes_in_place(table, 6, 2)
    assert not bm.writes_in_place(table, 8, 1)                # the next block is not held yet
    assert not bm.writes_in_place(table, 7, 2)                # runs past the held blocks
    assert not bm.writes_in_place(table, 5, 0)
    fork = bm.fork(table)
    assert not bm.writes_in_place(table, 5, 1) and not bm.writes_in_place(fork, 6, 1)   # copy on write
    bm.free(fork)
    assert bm.writes_in_place(table, 5, 1)


def test_fork_shares_blocks_until_last_free():
    bm = BlockManager(num_blocks=2, block_size=4)
    a: list[int] = []
    bm.allocate(a, 5)
    b = bm.fork(a)
    assert bm.ref_count(a[0]) == 2 and bm.num_free_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 0
    bm.check_integrity([b])
    bm.free(b)
    assert bm.num_free_blocks == 2


def test_double_free_and_foreign_ids_are_caught():
    bm = BlockManager(num_blocks=2, block_size=4, first_block=2)
    table: list[int] = []
    bm.allocate(table, 4)
    stale = list(table)
    bm.free(table)
    with pytest.raises(BlockIntegrityError, match="double free"):
        bm.free(stale)
    with pytest.raises(BlockIntegrityError, match="outside this pool"):
        bm.free([0])
    with pytest.raises(BlockIntegrityError, match="ref count 1 but 0 table entries"):
        t: list[int] = []
        bm.allocate(t, 1)
        bm.check_integrity([])


def test_bad_construction_names_the_field():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences of sequence admission, token appends, forks, finishes and aborts.

    The model: a dict of live sequences -> (table, num_tokens). After every rule the manager's
    counts must agree with the tables, and nothing may leak.
    """

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4, first_block=7)
        self.live: dict[int, tuple[list[int], int]] = {}
        self.next_id = 0

    @rule(target=seqs, num_tokens=st.integers(1, 40))
    def admit(self, num_tokens):
        table: list[int] = []
        free_before = self.bm.num_free_blocks
        try:
            self.bm.allocate(table, num_tokens)
        except NoFreeBlocksError:
            assert self.bm.num_blocks_for(num_tokens) > free_before
            assert table == [] and self.bm.num_free_blocks == free_before
            return -1
        self.next_id += 1
        self.live[self.next_id] = (table, num_tokens)
        return self.next_id

    @rule(seq=seqs, extra=st.integers(1, 9))
    def append(self, seq, extra):
        if seq not in self.live:
            return
        table, num_tokens = self.live[seq]
        before = list(table)
        try:
            self.bm.allocate(table, num_tokens + extra)
        except NoFreeBlocksError:
            assert table == before
            return
        assert table[: len(before)] == before
        self.live[seq] = (table, num_tokens + extra)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq not in self.live:
            return -1
        table, num_tokens = self.live[seq]
        self.next_id += 1
        self.live[self.next_id] = (self.bm.fork(table), num_tokens)
        return self.next_id

    @rule(seq=consumes(seqs))
    def finish_or_abort(self, seq):
        if seq in self.live:
            table, _ = self.live.pop(seq)
            self.bm.free(table)

    @invariant()
    def consistent(self):
        self.bm.check_integrity([t for t, _ in self.live.values()])
        for table, num_tokens in self.live.values():
            assert len(table) == self.bm.num_blocks_for(num_tokens)

    def teardown(self):
        for table, _ in self.live.values():
            self.bm.free(table)
        self.bm.check_integrity([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)


# --- prefix caching and copy-on-write ---------------------------------------------------------

def _make_cached_bm(num_blocks: int = 64, block_size: int = 16, first_block: int = 3) -> BlockManager:
    return BlockManager(num_blocks, block_size, first_block=first_block, enable_prefix_caching=True)


def _compute(bm: BlockManager, table: list[int], token_ids: list[int]) -> None:
    """Admit `token_ids`: take the cached prefix, allocate the rest, compute it all, register."""
    bm.acquire_cached(table, token_ids)
    bm.allocate(table, len(token_ids))
    bm.register_computed(table, token_ids, len(token_ids))


def test_prefix_hit_shares_revives_and_counts():
    bm = _make_cached_bm()
    prefix = list(range(1000, 1200))                       # 200 tokens: 12 full blocks + 8
    a, b, c = prefix + [1, 2, 3], prefix + [7, 8], prefix + [9]
    ta: list[int] = []
    assert bm.acquire_cached(ta, a) == 0 and ta == []
    bm.allocate(ta, len(a))
    bm.register_computed(ta, a, len(a))
    assert [bm.is_cached(x) for x in ta] == [True] * 12 + [False]

    tb: list[int] = []
    assert bm.acquire_cached(tb, b) == 192 and tb == ta[:12]
    assert all(bm.ref_count(x) == 2 for x in tb) and bm.num_shared_blocks(tb) == 12
    bm.allocate(tb, len(b))
    bm.register_computed(tb, b, len(b))                     # nothing new is full
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (len(a) + len(b), 192)
    bm.check_integrity([ta, tb])

    bm.free(ta)
    bm.free(tb)
    assert bm.num_cached_free_blocks == 12 and bm.num_free_blocks == 64 and bm.usage == 0
    bm.check_integrity([])

    tc: list[int] = []
    assert bm.acquire_cached(tc, c) == 192
    assert bm.num_cached_free_blocks == 0 and bm.num_used_blocks == 12
    assert all(bm.ref_count(x) == 1 for x in tc)
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (len(a) + len(b) + len(c), 384)
    bm.check_integrity([tc])
    bm.free(tc)
    assert bm.num_free_blocks == 64


def test_a_cache_salt_partitions_the_prefix_cache():
    # Two tenants send the same prompt: neither finds the other's blocks; the same tenant does.
    bm = _make_cached_bm()
    prompt = list(range(2000, 2100))                       # 6 full blocks + 4
    ta: list[int] = []
    assert bm.acquire_cached(ta, prompt, "tenant-a") == 0
    bm.allocate(ta, len(prompt))
    bm.register_computed(ta, prompt, len(prompt), "tenant-a")
    for salt, hit in [("tenant-b", 0), (None, 0), ("tenant-a", 96)]:
        t: list[int] = []
        assert bm.acquire_cached(t, prompt + [5], salt) == hit, salt
        bm.allocate(t, len(prompt) + 1)
        bm.register_computed(t, prompt + [5], len(prompt) + 1, salt)
        bm.check_integrity([ta, t])
        bm.free(t)
    bm.free(ta)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks


def test_acquire_leaves_the_last_token_to_compute():
    bm = _make_cached_bm(block_size=16)
    prompt = list(range(64))                                # exactly 4 full blocks
    t: list[int] = []
    _compute(bm, t, prompt)
    assert sum(bm.is_cached(x) for x in t) == 4
    for n, blocks in [(64, 3), (65, 4), (17, 1), (16, 0), (1, 0)]:
        u: list[int] = []
        assert bm.acquire_cached(u, (prompt + [99])[:n]) == blocks * 16 and len(u) == blocks
        bm.free(u)
    bm.free(t)
    bm.check_integrity([])


def test_register_keeps_the_first_holder_of_a_prefix():
    bm = _make_cached_bm(block_size=4)
    tokens = list(range(10))
    ta: list[int] = []
    tb: list[int] = []
    bm.allocate(ta, 10)
    bm.allocate(tb, 10)                                     # computed concurrently: no hit for b
    bm.register_computed(ta, tokens, 10)
    bm.register_computed(tb, tokens, 10)
    assert [bm.is_cached(x) for x in ta + tb] == [True, True, False] + [False] * 3
    bm.free(tb)                                             # duplicates go to the plain free list
    assert bm.num_cached_free_blocks == 0
    u: list[int] = []
    assert bm.acquire_cached(u, tokens) == 8 and u == ta[:2]
    bm.free(u)
    bm.free(ta)
    assert bm.num_cached_free_blocks == 2
    bm.check_integrity([])


def test_eviction_takes_free_blocks_first_then_least_recently_freed():
    bm = _make_cached_bm(num_blocks=4, block_size=2, first_block=0)
    t: list[int] = []
    _compute(bm, t, [1, 2, 3, 4, 5])                        # blocks 0, 1 cached; 2 partial
    bm.free(t)                                              # freed tail first: 2 (free), 1, 0 (cached)
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 4
    u: list[int] = []
    assert bm.allocate(u, 4) == [3, 2] and bm.num_evictions == 0
    assert bm.can_allocate(u, 8) and bm.num_new_blocks(u, 8) == 2   # cached-free blocks count as free
    assert bm.allocate(u, 6) == [1] and bm.num_evictions == 1   # the tail block goes first
    assert not bm.is_cached(1) and bm.is_cached(0)
    v: list[int] = []
    assert bm.acquire_cached(v, [1, 2, 3, 4, 5]) == 2 and v == [0]
    bm.check_integrity([u, v])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(v, 4)
    bm.free(u)
    bm.free(v)
    bm.check_integrity([])


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: hash((parent, len(tokens))))
    bm = _make_cached_bm(block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 0, 5, 6, 7, 8, 9, 9, 9, 9, 1]            # same hashes as a's, other tokens, longer
    ta: list[int] = []
    _compute(bm, ta, a)
    tb: list[int] = []
    assert bm.acquire_cached(tb, b) == 0 and tb == []
    bm.allocate(tb, len(b))
    bm.register_computed(tb, b, len(b))                     # slot taken by a's block: b stays out,
    assert not any(bm.is_cached(x) for x in tb)            # and so does everything after it
    bm.free(ta)
    bm.free(tb)
    u: list[int] = []
    assert bm.acquire_cached(u, b) == 0
    assert bm.acquire_cached(u, a[:8] + b[8:]) == 8         # b's third block is not chained to a's
    bm.free(u)
    bm.check_integrity([])


def test_entry_under_a_colliding_parent_is_not_a_hit(monkeypatch):
    # Every block at one depth has the same hash: only tokens and parent entries tell them apart.
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: hash((parent, len(tokens))))
    bm = _make_cached_bm(num_blocks=4, block_size=2, first_block=0)
    t1: list[int] = []
    _compute(bm, t1, [1, 2, 5, 6, 0])                       # [1,2] <- [5,6] cached
    t2 = bm.fork(t1)
    bm.copy_on_write(t2, 0)                                 # t2 = [copy of [1,2], [5,6], partial]
    bm.free(t1)                                             # [1,2] cached-free; [5,6] held by t2
    filler: list[int] = []
    bm.allocate(filler, 2)                                  # evicts [1,2]: [5,6] is an orphan
    assert bm.num_evictions == 1
    bm.free(filler)
    bm.free(t2)
    t3: list[int] = []
    _compute(bm, t3, [3, 4, 0])                             # [3,4] takes the depth-0 hash
    u: list[int] = []
    assert bm.acquire_cached(u, [3, 4, 5, 6, 0]) == 2       # [5,6] was computed after [1,2], not [3,4]
    bm.free(u)
    bm.free(t3)
    bm.check_integrity([])


def test_stale_duplicate_does_not_displace_a_live_entry():
    bm = _make_cached_bm(num_blocks=6, block_size=2, first_block=0)
    ta: list[int] = []
    tb: list[int] = []
    bm.allocate(ta, 2)
    bm.allocate(tb, 2)
    bm.register_computed(ta, [1, 2], 2)
    bm.register_computed(tb, [1, 2], 2)                     # tb[0] duplicates ta[0]
    bm.free(ta)
    filler: list[int] = []
    bm.allocate(filler, 10)                                 # the 4 free blocks, then evicts ta[0]
    assert bm.num_evictions == 1
    bm.free(filler)
    tc: list[int] = []
    _compute(bm, tc, [1, 2, 3, 4])                          # a fresh entry for [1,2], then [3,4]
    bm.allocate(tb, 4)
    bm.register_computed(tb, [1, 2, 3, 4], 4)               # tb's chain cannot be verified any more
    assert bm.is_cached(tc[1]) and not bm.is_cached(tb[1])
    u: list[int] = []
    assert bm.acquire_cached(u, [1, 2, 3, 4, 5]) == 4 and u == tc
    for t in (u, tb, tc):
        bm.free(t)
    bm.check_integrity([])


def test_entry_whose_parent_was_evicted_is_no_hit_and_is_replaced():
    bm = _make_cached_bm(num_blocks=7, block_size=2, first_block=0)
    prompt, longer = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]
    ta: list[int] = []
    tb: list[int] = []
    bm.allocate(ta, 5)
    bm.allocate(tb, 7)
    bm.register_computed(ta, prompt, 5)                     # a holds blocks [1,2] [3,4]
    bm.register_computed(tb, longer, 7)                     # b's [5,6] is cached, chained to a's
    child = tb[2]
    assert bm.is_cached(child) and not bm.is_cached(tb[0])
    bm.free(ta)
    filler: list[int] = []
    bm.allocate(filler, 6)                                  # a's free tail, then evicts its two cached blocks
    assert bm.num_evictions == 2
    bm.free(tb)
    bm.free(filler)
    assert bm.is_cached(child) and bm.num_cached_free_blocks == 1
    u: list[int] = []
    assert bm.acquire_cached(u, longer) == 0                # its parent is gone
    bm.allocate(u, 7)
    bm.register_computed(u, longer, 7)                      # the orphan gives way to u's block
    assert not bm.is_cached(child) and all(bm.is_cached(x) for x in u[:3])
    assert bm.num_cached_free_blocks == 0
    bm.check_integrity([u])
    v: list[int] = []
    assert bm.acquire_cached(v, longer + [8]) == 6 and v == u[:3]
    bm.free(u)
    bm.free(v)
    bm.check_integrity([])


def test_prefix_caching_off_changes_nothing():
    bm = BlockManager(4, 2)
    t: list[int] = []
    assert bm.acquire_cached(t, [1, 2, 3]) == 0
    bm.allocate(t, 3)
    bm.register_computed(t, [1, 2, 3], 3)
    assert not bm.is_cached(t[0])
    bm.free(t)
    assert bm.num_cached_free_blocks == 0 and bm.num_prefix_queries == 0
    with pytest.raises(ValueError, match="must be empty"):
        bm.acquire_cached([0], [1, 2, 3])


def test_copy_on_write_shared_and_private():
    bm = BlockManager(num_blocks=4, block_size=4, first_block=10)
    a: list[int] = []
    bm.allocate(a, 6)                                       # [10, 11]
    assert bm.copy_on_write(a, 1) is None                   # private: write in place
    b = bm.fork(a)
    assert bm.copy_on_write(b, 1) == (11, 12) and b == [10, 12]
    assert (bm.ref_count(11), bm.ref_count(12), bm.ref_count(10)) == (1, 1, 2)
    assert bm.copy_on_write(a, 1) is None                   # a's block is private again
    bm.check_integrity([a, b])
    c = bm.fork(b)
    bm.allocate(c, 9)                                       # takes the last free block
    with pytest.raises(NoFreeBlocksError):
        bm.copy_on_write(c, 0)
    assert c == [10, 12, 13] and bm.ref_count(10) == 3
    bm.check_integrity([a, b, c])
    for t in (a, b, c):
        bm.free(t)
    assert bm.num_free_blocks == 4
    bm.check_integrity([])


def test_check_integrity_catches_a_referenced_cached_free_block():
    bm = _make_cached_bm(num_blocks=4, block_size=2)
    t: list[int] = []
    _compute(bm, t, [1, 2, 3])
    bm.free(t)
    bm.check_integrity([])
    cached = next(iter(bm._evictable))
    bm._ref_counts[cached - bm.first_block] = 1
    with pytest.raises(BlockIntegrityError, match="cached-free block .* has ref count 1"):
        bm.check_integrity()


def test_reset_prefix_cache_frees_cached_blocks():
    bm = _make_cached_bm(num_blocks=8, block_size=2)
    t: list[int] = []
    _compute(bm, t, [1, 2, 3, 4, 5])
    u: list[int] = []
    _compute(bm, u, [7, 8, 9])
    bm.free(t)
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_free_blocks == 0
    assert not bm.is_cached(u[0])                           # in use, no longer registered
    bm.check_integrity([u])
    v: list[int] = []
    assert bm.acquire_cached(v, [1, 2, 3, 4, 5]) == 0 and bm.acquire_cached(v, [7, 8, 9]) == 0
    bm.register_computed(u, [7, 8, 9], 3)                   # registers again from scratch
    assert bm.is_cached(u[0])
    bm.free(u)
    bm.check_integrity([])


@dataclass
class _Seq:
    table: list[int]
    token_ids: list[int]
    num_computed: int


class PrefixCachingMachine(RuleBasedStateMachine):
    """Admission through `acquire_cached`, chunked compute with copy-on-write and `register_computed`,
    decode, forks, copy-on-write, preemption (free + re-admit), finishes and aborts; prefix caching on.

    `content` stands in for the K/V: each block maps to the token prefix its slots were computed
    from (None: never written). A hit that hands back the wrong K/V, a write into a shared or cached
    block, or a block handed out while referenced fails an assertion. Tokens come from {0, 1, 2} so
    prefixes repeat often.
    """

    seqs = Bundle("pc_seqs")
    weak_hash = None  # a colliding hash_block_tokens, or None for the real one

    def __init__(self) -> None:
        super().__init__()
        self._real_hash = block_manager.hash_block_tokens
        if self.weak_hash is not None:
            block_manager.hash_block_tokens = self.weak_hash
        self.bm = BlockManager(num_blocks=16, block_size=3, first_block=5, enable_prefix_caching=True)
        self.live: dict[int, _Seq] = {}
        self.content: dict[int, tuple[int, ...] | None] = {}
        self.next_id = 0
        self.num_queries = 0
        self.num_hits = 0

    # --- helpers --------------------------------------------------------------------------
    def _live_blocks(self) -> set[int]:
        return {b for s in self.live.values() for b in s.table}

    def _acquire(self, seq: _Seq) -> None:
        bs = self.bm.block_size
        cached = self.bm.acquire_cached(seq.table, seq.token_ids)
        assert cached % bs == 0 and len(seq.table) == cached // bs
        assert cached <= (len(seq.token_ids) - 1) // bs * bs
        for i, block in enumerate(seq.table):      # the hit's K/V is this sequence's prefix
            assert self.content[block] == tuple(seq.token_ids[:(i + 1) * bs])
        seq.num_computed = cached
        self.num_queries += len(seq.token_ids)
        self.num_hits += cached

    def _compute(self, seq: _Seq, num_new: int) -> bool:
        """Compute `num_new` more tokens of `seq` as the engine would; False (nothing changed) when
        the pool cannot hold them."""
        bm, bs = self.bm, self.bm.block_size
        start, end = seq.num_computed, seq.num_computed + num_new
        first = start // bs
        shared = [i for i in range(first, min(len(seq.table), -(-end // bs))) if bm.ref_count(seq.table[i]) > 1]
        if len(shared) + bm.num_new_blocks(seq.table, end) > bm.num_free_blocks:
            return False
        others = self._live_blocks() - set(seq.table)
        unreferenced = {b for b in range(bm.first_block, bm.first_block + bm.num_blocks) if bm.ref_count(b) == 0}
        for i in shared:
            old, new = bm.copy_on_write(seq.table, i)
            assert new in unreferenced and new not in others
            unreferenced.discard(new)
            self.content[new] = self.content[old]
        new_blocks = bm.allocate(seq.table, end)
        assert set(new_blocks) <= unreferenced and not set(new_blocks) & others
        for block in new_blocks:
            assert bm.ref_count(block) == 1
            self.content[block] = None
        for i in range(first, -(-end // bs)):
            block = seq.table[i]
            assert bm.ref_count(block) == 1 and not bm.is_cached(block), f"write into shared block {block}"
            self.content[block] = tuple(seq.token_ids[:min((i + 1) * bs, end)])
        seq.num_computed = end
        bm.register_computed(seq.table, seq.token_ids, end)
        return True

    # --- rules ----------------------------------------------------------------------------
    @rule(target=seqs, token_ids=st.lists(st.integers(0, 2), min_size=1, max_size=16), chunk=st.integers(1, 16))
    def admit(self, token_ids, chunk):
        seq = _Seq([], list(token_ids), 0)
        self._acquire(seq)
        if not self._compute(seq, min(chunk, len(token_ids) - seq.num_computed)):
            self.bm.free(seq.table)   # give the cached prefix back; try later
            return -1
        self.next_id += 1
        self.live[self.next_id] = seq
        return self.next_id

    @rule(seq=seqs, chunk=st.integers(1, 8), token=st.integers(0, 2))
    def step(self, seq, chunk, token):
        if seq not in self.live:
            return
        s = self.live[seq]
        if s.num_computed == len(s.token_ids):
            s.token_ids.append(token)   # decode: the sampled token is computed next step
        self._compute(s, min(chunk, len(s.token_ids) - s.num_computed))

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq not in self.live:
            return -1
        s = self.live[seq]
        self.next_id += 1
        self.live[self.next_id] = _Seq(self.bm.fork(s.table), list(s.token_ids), s.num_computed)
        return self.next_id

    @rule(seq=seqs, index=st.integers(0, 20))
    def copy_on_write(self, seq, index):
        if seq not in self.live or not self.live[seq].table:
            return
        table = self.live[seq].table
        index %= len(table)
        before, old = list(table), table[index]
        others = self._live_blocks() - set(table)
        try:
            copied = self.bm.copy_on_write(table, index)
        except NoFreeBlocksError:
            assert self.bm.ref_count(old) > 1 and self.bm.num_free_blocks == 0 and table == before
            return
        if copied is None:
            assert self.bm.ref_count(old) == 1 and table == before
            return
        assert copied[0] == old and table[index] == copied[1] and copied[1] not in others
        assert self.bm.ref_count(copied[1]) == 1 and not self.bm.is_cached(copied[1])
        self.content[copied[1]] = self.content[old]

    @rule(seq=seqs, chunk=st.integers(1, 16))
    def preempt_and_readmit(self, seq, chunk):
        if seq not in self.live:
            return
        s = self.live[seq]
        self.bm.free(s.table)
        s.num_computed = 0
        self._acquire(s)
        if not self._compute(s, min(chunk, len(s.token_ids) - s.num_computed)):
            self.bm.free(s.table)   # waits with no blocks
            s.num_computed = 0

    @rule(seq=consumes(seqs))
    def finish_or_abort(self, seq):
        if seq in self.live:
            self.bm.free(self.live.pop(seq).table)

    # --- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        bm, bs = self.bm, self.bm.block_size
        bm.check_integrity([s.table for s in self.live.values()])
        assert not self._live_blocks() & (set(bm._free) | set(bm._evictable))
        for s in self.live.values():
            assert len(s.table) == bm.num_blocks_for(s.num_computed)
            for i, block in enumerate(s.table):
                assert self.content[block] == tuple(s.token_ids[:min((i + 1) * bs, s.num_computed)])
        for block, entry in bm._full.items():   # what the cache records is what the block holds
            assert self.content[block] is not None and len(self.content[block]) % bs == 0
            assert self.content[block][-bs:] == entry.token_ids
        assert (bm.num_prefix_queries, bm.num_prefix_hits) == (self.num_queries, self.num_hits)

    def teardown(self):
        try:
            for s in self.live.values():
                self.bm.free(s.table)
            self.bm.check_integrity([])
            assert self.bm.num_free_blocks == self.bm.num_blocks
        finally:
            block_manager.hash_block_tokens = self._real_hash


class CollidingPrefixCachingMachine(PrefixCachingMachine):
    """The same, with a hash that sees only a block's depth: every two prefixes collide, so hits rest
    on the verification alone."""

    weak_hash = staticmethod(lambda parent, tokens: hash((parent, len(tokens))))


TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = settings(max_examples=75, stateful_step_count=50, deadline=None)
TestCollidingPrefixCachingMachine = CollidingPrefixCachingMachine.TestCase
TestCollidingPrefixCachingMachine.settings = settings(max_examples=75, stateful_step_count=50, deadline=None)
