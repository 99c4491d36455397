"""The torch paged-attention reference against dense attention on contiguous K/V."""

import random

import pytest
import torch

from kernels import AttentionMetadata, reference


def _make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, rng):
    """Random per-sequence K/V, scattered into shuffled blocks of a cache with spare blocks."""
    num_blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    total = sum(num_blocks_per_seq) + 3
    ids = list(range(total))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in num_blocks_per_seq:
        tables.append(ids[pos:pos + n])
        pos += n
    k_cache = torch.full((total, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = [torch.randn(s, num_kv_heads, head_dim, dtype=dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, dtype=dtype) for s in seq_lens]
    return tables, k_cache, v_cache, keys, values


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_paged_attention_matches_dense(num_heads, num_kv_heads, block_size, sliding_window):
    rng = random.Random()
    head_dim, dtype = 16, torch.float32
    # decode rows, a prefill chunk starting mid-block, a whole prompt, a length-1 prompt
    seq_lens = [1, 37, 20, 5, block_size * 2, 1]
    query_lens = [1, 1, 9, 5, 3, 1]
    tables, k_cache, v_cache, keys, values = _make_paged(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, rng)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size)
    # the cached prefix was stored by earlier steps; this step stores the new tokens itself
    for table, k, v, q_len in zip(tables, keys, values, query_lens):
        prefix = AttentionMetadata.build([table], [len(k) - q_len], [len(k) - q_len], block_size)
        reference.store_kv(k[: len(k) - q_len], v[: len(k) - q_len], k_cache, v_cache, prefix)
    new_k = torch.cat([k[len(k) - q:] for k, q in zip(keys, query_lens)])
    new_v = torch.cat([v[len(v) - q:] for v, q in zip(values, query_lens)])
    reference.store_kv(new_k, new_v, k_cache, v_cache, meta)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    out = reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    assert not out.isnan().any()
    start = 0
    for k, v, q_len in zip(keys, values, query_lens):
        want = reference.dense_causal_attention(query[start:start + q_len], k, v, scale, sliding_window)
        torch.testing.assert_close(out[start:start + q_len], want, atol=1e-5, rtol=1e-5)
        start += q_len


def test_store_kv_skips_invalid_slots_and_writes_the_rest():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    meta = AttentionMetadata.build([[1]], [2], [2], 4)
    meta.slot_mapping = torch.tensor([5, -1])
    meta.has_invalid_slots = True
    reference.store_kv(torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0), k_cache, v_cache, meta)
    assert k_cache.view(-1, 1, 2)[5].eq(1).all() and v_cache.view(-1, 1, 2)[5].eq(2).all()
    assert k_cache.sum() == 2 and v_cache.sum() == 4


def test_metadata_rejects_tables_too_short():
    with pytest.raises(ValueError, match="inconsistent"):
        AttentionMetadata.build([[0]], [1], [17], 16)
