"""DeepSeek Sparse Attention over the paged latent cache (`kernels.dsa`): with `topk` at least every context it is the
paged attention of the rows' latent part (the reference), FP8 rows too; with a small `topk` each query attends to
exactly the causal tokens its indexer scores best, as a brute-force dense computation says."""

import random

import pytest
import torch

from kernels import AttentionMetadata, reference
from kernels import dsa
from kernels.dsa import sparse_latent_attention

LORA, LATENT, INDEX, HEADS, INDEX_HEADS, BLOCK = 16, 24, 8, 4, 3, 4   # latent 16 + rotated key 8, indexer key 8


def _step(seed: int, dtype: torch.dtype = torch.float32):
    """Two sequences: a prefill chunk of 6 over a cached prefix of 5, and a decode at 13; their rows stored in
    shuffled blocks of a cache of `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, s_lens = [6, 1], [11, 13]
    blocks = list(range(1, 9))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[:3], blocks[3:7]]
    meta = AttentionMetadata.build(tables, [s for s in s_lens], s_lens, BLOCK)   # every row stored first
    cache = torch.zeros(10, BLOCK, 1, LATENT + INDEX, dtype=dtype)
    rows = torch.randn(sum(s_lens), 1, LATENT + INDEX, generator=gen)
    reference.store_kv(rows, rows, cache, cache, meta, k_scale=0.5, v_scale=0.5)
    step = AttentionMetadata.build(tables, q_lens, s_lens, BLOCK)
    tokens = sum(q_lens)
    query = torch.randn(tokens, HEADS, LATENT, generator=gen)
    index_q = torch.randn(tokens, INDEX_HEADS, INDEX, generator=gen)
    weights = torch.randn(tokens, INDEX_HEADS, generator=gen)
    return step, cache, query, index_q, weights


@pytest.mark.parametrize("dtype", [torch.float32, reference.FP8_KV_DTYPE])
def test_with_every_token_chosen_it_is_the_paged_attention_of_the_latent_rows(dtype):
    meta, cache, query, index_q, weights = _step(0, dtype)
    ours = sparse_latent_attention(query, index_q, weights, cache, meta, 0.3, topk=64, kv_lora_rank=LORA,
                                   latent_dim=LATENT, index_scale=INDEX ** -0.5, k_scale=0.5, chunk=4)
    padded = torch.nn.functional.pad(query, (0, INDEX))   # zeros over the indexer's part: q.k unchanged
    dense = reference.paged_attention(padded, cache, cache, meta, 0.3, None, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(ours, dense[..., :LORA], rtol=1e-5, atol=1e-5)


def test_each_query_attends_to_the_causal_tokens_its_indexer_scores_best():
    meta, cache, query, index_q, weights = _step(1)
    topk = 3
    ours = sparse_latent_attention(query, index_q, weights, cache, meta, 0.3, topk, LORA, LATENT, index_scale=0.25,
                                   k_scale=0.5, chunk=4)
    flat = cache.view(-1, LATENT + INDEX)   # float32: stored and read without the scale
    row = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        table = meta.block_tables[i].tolist()
        rows = torch.stack([flat[table[t // BLOCK] * BLOCK + t % BLOCK] for t in range(s_len)])
        for j in range(q_len):
            pos = s_len - q_len + j
            score = [sum(weights[row, h] * torch.relu(0.25 * index_q[row, h] @ rows[t, LATENT:])
                         for h in range(INDEX_HEADS)) for t in range(pos + 1)]
            best = sorted(range(pos + 1), key=lambda t: -float(score[t]))[:topk]
            keys = rows[best, :LATENT]                                       # [k, latent]
            probs = (query[row] @ keys.T * 0.3).softmax(dim=-1)             # [heads, k]
            torch.testing.assert_close(ours[row], probs @ keys[:, :LORA], rtol=1e-5, atol=1e-5)
            row += 1


def test_sinks_join_each_heads_denominator_as_the_paged_attentions_do():
    """HY V4's sinks: with every token chosen, the sparse attention with a sink logit a head is the paged attention's
    with the same sinks (the dense path a short context takes); a large sink takes weight from every row."""
    meta, cache, query, index_q, weights = _step(5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 8.0])
    ours = sparse_latent_attention(query, index_q, weights, cache, meta, 0.3, topk=64, kv_lora_rank=LORA,
                                   latent_dim=LATENT, index_scale=0.25, k_scale=0.5, chunk=4)
    choice = dsa.choose_tokens(index_q, weights, cache, meta, 64, LATENT, index_scale=0.25, k_scale=0.5)
    sunk = dsa.attend_chosen(query, choice, cache, meta, 0.3, LORA, LATENT, k_scale=0.5, sinks=sinks, chunk=4)
    padded = torch.nn.functional.pad(query, (0, INDEX))
    dense = reference.paged_attention(padded, cache, cache, meta, 0.3, None, k_scale=0.5, v_scale=0.5, sinks=sinks)
    torch.testing.assert_close(sunk, dense[..., :LORA], rtol=1e-5, atol=1e-5)
    assert sunk[:, 3].norm() < 0.2 * ours[:, 3].norm()   # the head with a sink of 8: most weight on the sink
