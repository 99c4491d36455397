"""BlockManager: unit cases and a hypothesis state machine of allocate/append/fork/free/abort."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

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
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
