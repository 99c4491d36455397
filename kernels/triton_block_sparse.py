"""MiniMax M3's block-sparse attention in Triton (CUDA; the interpreter in tests): `kernels.block_sparse`'s torch
reference, which it is tested against, as two kernels and torch's top-k between them.

`_block_scores_kernel`, a program a query token and a block of `INDEX_BLOCK` key positions: the block's indexer keys
are read straight out of the paged index cache (through the block table), every KV head's indexer query of the token
dotted with them at once ([heads, d] x [d, positions]); the block scores its best causal key's score, per KV head
(-inf where it holds none). torch then forces the query's own block and the `local_blocks` - 1 before it (+inf) and
takes the `topk_blocks` best of each (token, KV head); a block still -inf (a short context's padding) is not
attended. A long prefill chunk's tokens are scored a group at a time, so the scores never hold more than
`SCORES_BYTES` (the indexer's budget of `kernels.triton_dsa`).

`_chosen_blocks_kernel`, a program a query token and a KV head, its GQA group's query heads as the rows of one tile:
walks the chosen blocks `BLOCK_N` positions at a time, each K/V tile gathered through the block table and read once for
the group (an FP8 cache's dequantized as the paged kernels do, `KV_FP8`), the causal cut on the query's own block, an
online softmax in float32 (exp2, the scale folded with log2 e), P rounded to the query's type before the PV dot, as the
paged kernels do. The blocks come in the top-k's order, which the online softmax does not care about.

Nothing is read back to the host: a step's launches never wait for the device. The block count of the scores is the
step's longest sequence's, a number on the host, so these launches are not captured in CUDA graphs; the model
attends densely (the paged kernels) while no sequence of the step is longer than the blocks it may choose
(`engine.models.minimax_m3`), and that regime is what its decode graphs hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import FP8_KV_DTYPE
from kernels.triton_dsa import SCORES_BYTES, aligned_group, token_layout
from kernels.triton_kv_store import dequantize_e4m3
from kernels.triton_prefill import LOG2_E, dot_config, padded_head_dim

__all__ = ["attend_blocks", "block_sparse_attention", "choose_blocks"]


# What changes from step to step (the block count, the chosen count, the block tables', the scores' and the choice's
# row widths) is not specialized on: one variant serves every step (`ModelRunner.warm_sparse_kernels` compiles it)
@triton.jit(do_not_specialize=["num_kv_heads", "num_index_blocks", "stride_st", "stride_sh", "stride_bt"])
def _block_scores_kernel(
    q_ptr, index_ptr, scores_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr,
    num_kv_heads, num_index_blocks,
    stride_qt, stride_qh, stride_ib, stride_is, stride_st, stride_sh, stride_bt,
    INDEX_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (num_tokens, num_index_blocks); index_ptr: [blocks, BLOCK_SIZE, 1, HEAD_DIM], head_dim contiguous. A block
    # wholly past its token's position (a short sequence in a step, or a decode graph's, as wide as its length) scores
    # -inf without a read
    token = tl.program_id(0).to(tl.int64)
    index_block = tl.program_id(1)
    q_pos = tl.load(token_pos_ptr + token)
    offs_h = tl.arange(0, HEADS_PAD)
    mask_h = offs_h < num_kv_heads
    best = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    if index_block * INDEX_BLOCK <= q_pos:
        seq = tl.load(token_seq_ptr + token).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)                   # [HEADS_PAD, HEAD_DIM_PAD]
        for n0 in range(0, INDEX_BLOCK, BLOCK_N):
            pos = index_block * INDEX_BLOCK + n0 + offs_n
            causal = (n0 + offs_n < INDEX_BLOCK) & (pos <= q_pos)
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=causal,
                            other=0).to(tl.int64)
            row = block * stride_ib + (pos % BLOCK_SIZE) * stride_is
            k = tl.load(index_ptr + row[None, :] + offs_d[:, None], mask=causal[None, :] & mask_d[:, None],
                        other=0.0)                                                       # [HEAD_DIM_PAD, BLOCK_N]
            s = tl.dot(q.to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [HEADS_PAD, BLOCK_N]
            best = tl.maximum(best, tl.max(tl.where(causal[None, :], s, float("-inf")), axis=1))
    tl.store(scores_ptr + token * stride_st + offs_h * stride_sh + index_block, best, mask=mask_h)


@triton.jit(do_not_specialize=["num_chosen", "stride_ct", "stride_ch", "stride_bt"])
def _chosen_blocks_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, chosen_ptr, keep_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr,
    qk_scale, k_scale, v_scale, num_chosen,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, INDEX_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    # grid: (num_tokens, num_kv_heads); chosen, keep: [tokens, kv_heads, num_chosen] (keep as int8)
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    q_pos = tl.load(token_pos_ptr + token)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)          # [GROUP_PAD, HEAD_DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    choice = token * stride_ct + kv_head * stride_ch
    for j in range(0, num_chosen):
        index_block = tl.load(chosen_ptr + choice + j)
        last = tl.where(tl.load(keep_ptr + choice + j) != 0, q_pos, -1)   # a block not attended: no position
        for n0 in range(0, INDEX_BLOCK, BLOCK_N):
            pos = (index_block * INDEX_BLOCK + n0 + offs_n).to(tl.int32)
            valid = (n0 + offs_n < INDEX_BLOCK) & (pos <= last)
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            in_block = pos % BLOCK_SIZE
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                        + kv_head * stride_kh + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
            if KV_FP8:
                k = dequantize_e4m3(k, k_scale, q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale   # log2 units
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
            if KV_FP8:
                v = dequantize_e4m3(v, v_scale, q_ptr.dtype.element_ty)
            p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)   # P in the query's type, as the tensor cores take it
            acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def choose_blocks(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, *, block_size: int,
                  topk_blocks: int, local_blocks: int, scores_bytes: int = SCORES_BYTES
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, kv_heads, k] int64 block ids, the same shape int8: attended) for index_q [T, kv_heads, d]: each query's
    own block and the `local_blocks` - 1 before it, and the best of the rest, `topk_blocks` in all (the module
    docstring)."""
    tokens, kv_heads, head_dim = index_q.shape
    device = index_cache.device
    num_blocks = triton.cdiv(max(meta.seq_lens_list, default=0), block_size)
    token_seq, token_pos = token_layout(meta, device)
    k = min(topk_blocks, num_blocks)
    chosen = torch.empty(tokens, kv_heads, k, dtype=torch.int64, device=device)
    keep = torch.empty(tokens, kv_heads, k, dtype=torch.int8, device=device)
    own = token_pos.to(torch.int64) // block_size
    group = aligned_group(scores_bytes // max(4 * kv_heads * num_blocks, 1))
    kind, precision = dot_config(index_q.dtype)
    for a in range(0, tokens, group):
        b = min(a + group, tokens)
        scores = torch.empty(b - a, kv_heads, num_blocks, dtype=torch.float32, device=device)
        _block_scores_kernel[(b - a, num_blocks)](
            index_q[a:b], index_cache, scores, meta.block_tables, token_seq[a:b], token_pos[a:b], kv_heads,
            num_blocks, index_q.stride(0), index_q.stride(1), index_cache.stride(0), index_cache.stride(1),
            scores.stride(0), scores.stride(1), meta.block_tables.stride(0),
            INDEX_BLOCK=block_size, BLOCK_N=max(16, min(64, triton.next_power_of_2(block_size))),
            BLOCK_SIZE=meta.block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim),
            HEADS_PAD=padded_head_dim(kv_heads), DOT_DTYPE=kind, DOT_PRECISION=precision)
        for back in range(local_blocks):   # the query's own block and those just before it, whatever they score
            scores.scatter_(-1, (own[a:b] - back).clamp(min=0)[:, None, None].expand(-1, kv_heads, 1), float("inf"))
        best, chosen[a:b] = scores.topk(k, dim=-1)
        keep[a:b] = best > float("-inf")
    return chosen, keep


def block_sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           *, block_size: int, topk_blocks: int, local_blocks: int, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """`kernels.block_sparse.block_sparse_attention` on the device: query [T, heads, head_dim]; index_q [T, kv_heads,
    index_head_dim]; caches [num_blocks, cache_block_size, kv_heads, head_dim] (head_dim contiguous) and index_cache
    [num_blocks, cache_block_size, 1, index_head_dim], this step's rows stored -> [T, heads, head_dim] in query's
    dtype. An FP8 cache's K/V are read as the paged kernels read them (times k_scale / v_scale, rounded to the
    query's type); the indexer keys are never FP8 (`engine.minimax_m3_config.index_key_dtype`)."""
    assert index_cache.dtype != FP8_KV_DTYPE, "indexer keys of a float type"
    for t in (index_q, index_cache):
        assert t.stride(-1) == 1, f"index_dim contiguous, strides {t.stride()}"
    if not query.shape[0]:
        return torch.empty_like(query)
    chosen, keep = choose_blocks(index_q, index_cache, meta, block_size=block_size, topk_blocks=topk_blocks,
                                 local_blocks=local_blocks)
    return attend_blocks(query, key_cache, value_cache, chosen, keep, meta, scale, block_size=block_size,
                         k_scale=k_scale, v_scale=v_scale)


def attend_blocks(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, chosen: torch.Tensor,
                  keep: torch.Tensor, meta: AttentionMetadata, scale: float, *, block_size: int,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Each query's heads over the causal keys of its chosen blocks of `block_size` positions alone
    (`_chosen_blocks_kernel`): chosen [T, kv_heads, k] block ids (or [T, k]: one choice for every KV head), keep the
    same shape, nonzero where a block is attended; query and caches as `block_sparse_attention`'s."""
    for t in (query, key_cache, value_cache):
        assert t.stride(-1) == 1, f"head_dim contiguous, strides {t.stride()}"
    tokens, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if not tokens:
        return out
    keep = keep.to(torch.int8)
    if chosen.dim() == 2:   # one choice for all KV heads
        chosen, keep = (t[:, None].expand(-1, kv_heads, -1) for t in (chosen, keep))
    assert keep.stride() == chosen.stride(), "chosen and keep laid out alike"
    token_seq, token_pos = token_layout(meta, query.device)
    kind, precision = dot_config(query.dtype)
    group = heads // kv_heads
    _chosen_blocks_kernel[(tokens, kv_heads)](
        query, key_cache, value_cache, out, chosen, keep, meta.block_tables, token_seq, token_pos,
        scale * LOG2_E, float(k_scale), float(v_scale), chosen.shape[2],
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), out.stride(0), out.stride(1),
        chosen.stride(0), chosen.stride(1), meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), INDEX_BLOCK=block_size,
        BLOCK_N=max(16, min(64, triton.next_power_of_2(block_size))), BLOCK_SIZE=meta.block_size, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded_head_dim(head_dim), DOT_DTYPE=kind, DOT_PRECISION=precision,
        KV_FP8=key_cache.dtype == FP8_KV_DTYPE)
    return out
