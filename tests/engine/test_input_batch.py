"""The persistent batch against building every step from scratch: over random steps (tables that grow a
block at a time, a last block replaced by copy on write, sequences that stop and come back with new
tables, more sequences and longer tables than it was sized for) the metadata it prepares equals
`AttentionMetadata.build`'s, what it sends per step is only what changed, and a second batch that only
applies the updates (a tensor-parallel follower) holds the same rows."""

from __future__ import annotations

import random

import torch

from engine.input_batch import InputBatch
from kernels import AttentionMetadata

BLOCK_SIZE = 4


def _assert_same_metadata(got: AttentionMetadata, want: AttentionMetadata) -> None:
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert torch.equal(got.block_tables, want.block_tables)
    assert torch.equal(got.query_start_loc, want.query_start_loc)
    assert torch.equal(got.seq_lens, want.seq_lens)
    assert got.query_lens_list == want.query_lens_list and got.seq_lens_list == want.seq_lens_list


def _step(batch: InputBatch, follower: InputBatch, seqs: dict[int, dict], chosen: list[int]):
    """One step over `chosen` sequences: prepare on both batches, check against a build from scratch;
    returns the updates sent."""
    rows, updates = batch.assign((sid, seqs[sid]["table"]) for sid in chosen)
    ids, positions, query_lens, seq_lens = [], [], [], []
    for sid in chosen:
        s = seqs[sid]
        ids += [7] * s["new"]
        positions += list(range(s["len"] - s["new"], s["len"]))
        query_lens.append(s["new"])
        seq_lens.append(s["len"])
    want = AttentionMetadata.build([seqs[sid]["table"] for sid in chosen], query_lens, seq_lens, BLOCK_SIZE)
    for b in (batch, follower):
        b.apply(updates)
        got_ids, got_pos, meta = b.prepare(ids, positions, rows, query_lens, seq_lens)
        assert got_ids.tolist() == ids and got_pos.tolist() == positions
        _assert_same_metadata(meta, want)
    return updates


def test_prepared_steps_equal_metadata_built_from_scratch():
    rng = random.Random(0)
    batch = InputBatch(2, 2, BLOCK_SIZE, torch.device("cpu"))        # far too small: it grows
    follower = InputBatch(1, 1, BLOCK_SIZE, torch.device("cpu"))
    next_block = iter(range(10_000))
    seqs: dict[int, dict] = {}
    for step in range(300):
        if len(seqs) < 12 and rng.random() < 0.3:                    # a new sequence: a prefill chunk
            sid = step
            length = rng.randint(1, 30)
            seqs[sid] = {"len": length, "new": length, "table": [next(next_block) for _ in range(-(-length // 4))]}
        if seqs and rng.random() < 0.05:                             # one stops (finished or preempted)
            sid = rng.choice(list(seqs))
            batch.release(sid)
            del seqs[sid]
        for s in seqs.values():
            if rng.random() < 0.05:                                  # copy on write of its last block
                s["table"][-1] = next(next_block)
        chosen = [sid for sid in seqs if rng.random() < 0.8]
        rng.shuffle(chosen)
        if not chosen:
            continue
        updates = _step(batch, follower, seqs, chosen)
        assert all(u.row < batch.block_tables.shape[0] for u in updates)
        for sid in chosen:                                           # then each grows by one token
            s = seqs[sid]
            s["len"] += 1
            s["new"] = 1
            if len(s["table"]) * BLOCK_SIZE < s["len"]:
                s["table"].append(next(next_block))
    assert batch.num_rows == len(seqs)


def test_a_decode_step_sends_only_the_blocks_it_appended():
    batch = InputBatch(4, 8, BLOCK_SIZE, torch.device("cpu"))
    follower = InputBatch(4, 8, BLOCK_SIZE, torch.device("cpu"))
    seqs = {1: {"len": 8, "new": 8, "table": [3, 4]}, 2: {"len": 3, "new": 3, "table": [9]}}
    first = _step(batch, follower, seqs, [1, 2])
    assert sorted(len(u.block_ids) for u in first) == [1, 2]          # new rows: whole tables
    seqs[1].update(len=9, new=1, table=[3, 4, 5])
    seqs[2].update(len=4, new=1)
    (update,) = _step(batch, follower, seqs, [1, 2])                  # only sequence 1 grew a block
    assert (update.start, update.block_ids) == (2, (5,))
    seqs[2].update(len=5, new=1, table=[11, 12])                      # not an append (its block 0 changed)
    seqs[1].update(len=10, new=1)
    (update,) = _step(batch, follower, seqs, [2, 1])
    assert (update.start, update.block_ids) == (0, (11, 12))
    assert _step(batch, follower, {**seqs, 1: {**seqs[1], "len": 11}}, [1]) == []


def test_a_row_of_no_new_tokens_beside_a_chunk_of_two_is_no_decode_step():
    """Two rows and two tokens are not two decodes when one row brings none and the other two (a row of 0
    tokens beside a 2-token chunk): each token's slot is its own sequence's."""
    batch, follower = (InputBatch(4, 4, BLOCK_SIZE, torch.device("cpu")) for _ in range(2))
    seqs = {1: {"len": 5, "new": 0, "table": [10, 11]}, 2: {"len": 6, "new": 2, "table": [20, 21]}}
    _step(batch, follower, seqs, [1, 2])
