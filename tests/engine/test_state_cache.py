"""`engine.state_cache.StateSnapshots` on a real block manager, without a model: which cached prefix an admission
resumes from, the blocks it gives back, where snapshots are planned, their binding to prefix-cache entries, and
the slots' reuse (least recently used first) when none is free."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler_output import ScheduledSeq
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.state_cache import StateSnapshots

BS = 4


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams(temperature=0, max_tokens=4), max_tokens=4,
                    priority=0, arrival_order=seq_id, generator=None)


def _run(snapshots: StateSnapshots, bm: BlockManager, seq: Sequence, num_new: int) -> ScheduledSeq:
    """One step of `seq`: blocks, the planned snapshots, the commit (registration, then binding)."""
    bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
    item = ScheduledSeq(seq, num_new)
    snapshots.plan([item])
    seq.num_computed_tokens += num_new
    bm.register_computed(seq.block_table, seq.token_ids, seq.num_computed_tokens)
    snapshots.bind(item)
    snapshots.check_integrity()
    return item


def _admit(snapshots: StateSnapshots, bm: BlockManager, seq: Sequence) -> int | None:
    seq.num_computed_tokens = bm.acquire_cached(seq.block_table, seq.token_ids)
    return snapshots.admit(seq)


def test_snapshots_at_chunk_ends_the_prompts_last_boundary_and_the_branch_point():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    snapshots = StateSnapshots(8, 0, bm)
    system = list(range(100, 110))                  # 10 tokens: 2 whole blocks
    first = _seq(system + [1, 2, 3, 4, 5])          # 15 tokens, in chunks of 6 and 9
    assert _admit(snapshots, bm, first) is None and first.num_computed_tokens == 0
    assert _run(snapshots, bm, first, 6).state_saves == [(4, 0)]          # the chunk's last boundary: 4
    assert _run(snapshots, bm, first, 9).state_saves == [(6, 1)]          # the prompt's last resumable one: 12
    assert snapshots.num_bound == 2
    bm.free(first.block_table)

    second = _seq(system + [7, 8, 9])               # 13 tokens: finds blocks 0-1 (8 tokens), a snapshot after 4
    assert _admit(snapshots, bm, second) == 0   # (the scheduler counts a load once it schedules it)
    assert (second.num_computed_tokens, len(second.block_table), second.state_branch) == (4, 1, 8)
    assert snapshots.num_given_back == 1 and bm.num_prefix_hits == 4
    item = _run(snapshots, bm, second, 9)           # 4 .. 13: the branch point 8, the prompt's last boundary 12
    assert [4 + offset for offset, _ in item.state_saves] == [8, 12] and second.state_branch == 0
    bm.free(second.block_table)

    third = _seq(system + [0, 0])                   # resumes from the branch point's snapshot
    slot = _admit(snapshots, bm, third)
    assert slot == item.state_saves[0][1] and third.num_computed_tokens == 8 and snapshots.num_bound == 4
    bm.free(third.block_table)


def test_a_decode_takes_no_snapshot_and_a_broken_chain_gives_its_slot_back():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    snapshots = StateSnapshots(4, 10, bm)
    seq = _seq(list(range(1, 8)))                  # 7 tokens
    _admit(snapshots, bm, seq)
    assert _run(snapshots, bm, seq, 7).state_saves == [(4, 10)]   # slots numbered from the pool's first, 10
    seq.token_ids.append(50)
    assert _run(snapshots, bm, seq, 1).state_saves == []          # a decode, even one that fills a block
    bm.free(seq.block_table)
    # an unregistered block (prefix caching off for the manager): the planned slot comes back free
    plain = BlockManager(16, BS)
    loose = StateSnapshots(2, 0, plain)
    other = _seq(list(range(1, 8)), seq_id=1)
    plain.allocate(other.block_table, 7)
    item = ScheduledSeq(other, 7)
    loose.plan([item])
    other.num_computed_tokens = 7
    loose.bind(item)
    assert item.state_saves and loose.num_bound == 0
    loose.check_integrity()


def test_full_slots_reuse_the_least_recently_used_and_an_evicted_block_never_answers():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    snapshots = StateSnapshots(2, 0, bm)
    prompts = [[p] * 5 for p in (1, 2, 3)]          # 5 tokens: one snapshot each, after block 0
    for i, prompt in enumerate(prompts[:2]):
        seq = _seq(prompt, seq_id=i)
        _admit(snapshots, bm, seq)
        _run(snapshots, bm, seq, 5)
        bm.free(seq.block_table)
    again = _seq(prompts[0], seq_id=5)
    assert _admit(snapshots, bm, again) == 0        # used again: now the most recent
    bm.free(again.block_table)
    seq = _seq(prompts[2], seq_id=6)
    _admit(snapshots, bm, seq)
    assert _run(snapshots, bm, seq, 5).state_saves == [(4, 1)]   # prompt 2's slot, the least recently used
    bm.free(seq.block_table)
    lost = _seq(prompts[1], seq_id=7)
    assert _admit(snapshots, bm, lost) is None and lost.num_computed_tokens == 0
    bm.free(lost.block_table)
    # the pool's 6 blocks taken by another prompt evict prompt 0's cached block; prompt 0 again finds nothing
    hog = _seq(list(range(20, 44)), seq_id=8)
    bm.allocate(hog.block_table, 24)
    bm.free(hog.block_table)
    again = _seq(prompts[0], seq_id=9)
    assert _admit(snapshots, bm, again) is None and not again.block_table
    snapshots.check_integrity()
