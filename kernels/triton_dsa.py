"""DeepSeek Sparse Attention in Triton (CUDA; the interpreter in tests): the two halves of `kernels.dsa`, whose torch
reference they are tested against.

`choose_tokens`: `_index_scores_kernel` scores every (query token, cached position) pair of the step, a program a
query token and `BLOCK_N` positions: the positions' indexer keys are read straight out of the paged cache rows (their
last `index_head_dim` values, through the block table), each of the token's indexer heads dotted with them at once
([heads, d] x [d, BLOCK_N]), scaled, ReLU'd and summed under the heads' weights; a position past the token's own is
-inf (a program wholly past it writes -inf and reads nothing: a short sequence beside a long one, or a decode graph's
step, whose width is the graph's length). torch's top-k over the [T, longest context] scores then gives each token's
best `topk` positions (those still -inf, a short context's padding, are not attended); a long prefill chunk's tokens
are scored a group at a time, so the scores never hold more than `SCORES_BYTES`.

`attend_chosen`: `_sparse_attention_kernel`, a program a query token and `BLOCK_H` of its heads, walks the token's
chosen positions `BLOCK_N` at a time: each position's cache row is gathered through the block table (its latent and
its rotated key, read once for all of the program's heads), q.k is the latent part's dot plus the rotated part's
(two dots, each of its own power-of-two width: 512 and 64 for DeepSeek, no padding to 1,024), and an online softmax
accumulates the weighted latents ([BLOCK_H, kv_lora_rank] in float32; on `ATTEND_WARPS` warps, where it spills
nothing). Nothing is read back to the host, so a step's launches never wait for the device. An FP8 cache is read as
`triton_kv_store.dequantize_e4m3` reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import FP8_KV_DTYPE
from kernels.triton_kv_store import dequantize_e4m3
from kernels.triton_prefill import LOG2_E, aligned_int32, dot_config, padded_head_dim

__all__ = ["aligned_group", "attend_chosen", "choose_tokens", "token_layout"]

BLOCK_N = 32   # positions a program scores or attends at a time
BLOCK_H = 16   # query heads of a sparse-attention program (a dot's smallest M)
SCORES_BYTES = 256 << 20   # the indexer's scores held at once (`choose_tokens` scores the tokens a group at a time)
# the sparse attention's warps: its [BLOCK_H, 512] float32 accumulator and a [BLOCK_N, 512] tile of latents spill on
# four (24 bytes of stack at V3.2's shape built for sm_90), not on eight (tests/kernels/test_triton_dsa.py)
ATTEND_WARPS = 8


# What changes from step to step (the context's width, the chosen count, the block tables' and the scores' and the
# choice's row widths) is not specialized on: one variant serves every step (`ModelRunner.warm_sparse_kernels`
# compiles it)
@triton.jit(do_not_specialize=["num_heads", "width", "stride_st", "stride_bt"])
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scores_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr,
    index_scale, k_scale, num_heads, width,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_cb, stride_cs, stride_cd, stride_st, stride_bt,
    KEY_START: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # grid: (num_tokens, cdiv(width, BLOCK_N)); a program wholly past its token's position (a short sequence in a
    # step, or a decode graph's, whose width is the graph's length) writes -inf and reads nothing
    token = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    q_pos = tl.load(token_pos_ptr + token)
    if tl.program_id(1) * BLOCK_N <= q_pos:
        seq = tl.load(token_seq_ptr + token).to(tl.int64)
        causal = pos <= q_pos
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_h = tl.arange(0, HEADS_PAD)
        mask_d = offs_d < HEAD_DIM
        mask_h = offs_h < num_heads
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=causal, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        k = tl.load(cache_ptr + row[None, :] + (KEY_START + offs_d[:, None]) * stride_cd,
                    mask=causal[None, :] & mask_d[:, None], other=0.0)                 # [HEAD_DIM_PAD, BLOCK_N]
        if KV_FP8:
            k = dequantize_e4m3(k, k_scale, q_ptr.dtype.element_ty)
        q = tl.load(q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)                 # [HEADS_PAD, HEAD_DIM_PAD]
        s = tl.dot(q.to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * index_scale
        w = tl.load(w_ptr + token * stride_wt + offs_h * stride_wh, mask=mask_h, other=0.0)
        score = tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0)                        # [BLOCK_N]
        tl.store(scores_ptr + token * stride_st + pos, tl.where(causal, score, float("-inf")), mask=pos < width)
    else:
        tl.store(scores_ptr + token * stride_st + pos, tl.full([BLOCK_N], float("-inf"), tl.float32),
                 mask=pos < width)


@triton.jit(do_not_specialize=["num_heads", "num_chosen", "stride_ct", "stride_kt", "stride_bt"])
def _sparse_attention_kernel(
    q_ptr, cache_ptr, out_ptr, chosen_ptr, keep_ptr, block_tables_ptr, token_seq_ptr, sinks_ptr,
    qk_scale, k_scale, num_heads, num_chosen,
    stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_cd, stride_ot, stride_oh, stride_od,
    stride_ct, stride_kt, stride_bt,
    KV_LORA: tl.constexpr, KV_LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):
    # grid: (num_tokens, cdiv(num_heads, BLOCK_H))
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    offs_l = tl.arange(0, KV_LORA_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    mask_l = offs_l < KV_LORA
    mask_r = offs_r < ROPE
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :] * stride_qd, mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_row + (KV_LORA + offs_r[None, :]) * stride_qd, mask=mask_h[:, None] & mask_r[None, :],
                   other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, num_chosen, BLOCK_N):
        n = n0 + offs_n
        ok = tl.load(keep_ptr + token * stride_kt + n, mask=n < num_chosen, other=0) != 0
        pos = tl.load(chosen_ptr + token * stride_ct + n, mask=ok, other=0)
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        k_lat = tl.load(row[:, None] + offs_l[None, :] * stride_cd, mask=ok[:, None] & mask_l[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + (KV_LORA + offs_r[None, :]) * stride_cd, mask=ok[:, None] & mask_r[None, :],
                       other=0.0)
        if KV_FP8:
            k_lat = dequantize_e4m3(k_lat, k_scale, q_ptr.dtype.element_ty)
            k_pe = dequantize_e4m3(k_pe, k_scale, q_ptr.dtype.element_ty)
        s = tl.dot(q_lat.to(DOT_DTYPE), tl.trans(k_lat.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe.to(DOT_DTYPE), tl.trans(k_pe.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))                         # [BLOCK_H, BLOCK_N], log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, k_lat.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    if SINKS:   # each head's sink logit joins its denominator (log2 units, as the scores)
        sink = tl.load(sinks_ptr + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_l[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])


def token_layout(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] int32 each token's sequence, [T] int32 its position; the block-sparse kernels share it). A decode step's
    comes from its device lengths at every call (token i of sequence i, at its length - 1), so a captured decode graph
    recomputes it from the lengths each replay copies in (`engine.cuda_graphs`: built once, it would keep the warm-up
    run's); another step's is built from its lists once a step (`meta.backend_cache`)."""
    if meta.query_lens_list and all(q == 1 for q in meta.query_lens_list):
        tokens = len(meta.query_lens_list)
        return (torch.arange(tokens, dtype=torch.int32, device=device),
                meta.seq_lens[:tokens].to(device=device, dtype=torch.int32) - 1)
    cached = meta.backend_cache.get("triton_dsa")
    if cached is None:
        seqs, positions = [], []
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            seqs += [i] * q_len
            positions += range(s_len - q_len, s_len)
        cached = tuple(aligned_int32([seqs, list(positions)], device))   # pinned, aligned: the step never waits
        meta.backend_cache["triton_dsa"] = cached
    return cached


def aligned_group(tokens: int) -> int:
    """How many tokens to score at once, given that at most `tokens` fit: at least 1, a multiple of 16 from 16 on, so
    every group's slices of the per-token arrays start as 16-byte aligned as the first (Triton compiles a variant of
    its own for a pointer that is not)."""
    return tokens // 16 * 16 if tokens >= 16 else max(1, tokens)


def choose_tokens(index_q: torch.Tensor, index_weights: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  topk: int, latent_dim: int, *, index_scale: float, k_scale: float = 1.0,
                  scores_bytes: int = SCORES_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.dsa.choose_tokens` on the device: ([T, k] int64 positions, [T, k] bool attended). The tokens are
    scored a group at a time, each group's [tokens, longest context] float32 scores at most `scores_bytes` (a prefill
    chunk of 8,192 tokens over 128k positions would hold 4 GiB at once)."""
    tokens, width = index_q.shape[0], max(meta.seq_lens_list, default=0)
    token_seq, token_pos = token_layout(meta, cache.device)
    group = aligned_group(scores_bytes // max(4 * width, 1))
    chosen = torch.empty(tokens, min(topk, width), dtype=torch.int64, device=cache.device)
    keep = torch.empty(tokens, min(topk, width), dtype=torch.bool, device=cache.device)
    for a in range(0, tokens, group):
        b = min(a + group, tokens)
        scores = _scores(index_q[a:b], index_weights[a:b], cache, meta, token_seq[a:b], token_pos[a:b], width,
                         latent_dim, index_scale, k_scale)
        values, chosen[a:b] = scores.topk(min(topk, width), dim=-1)
        keep[a:b] = values > float("-inf")
    return chosen, keep


def _scores(index_q: torch.Tensor, index_weights: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
            token_seq: torch.Tensor, token_pos: torch.Tensor, width: int, latent_dim: int, index_scale: float,
            k_scale: float) -> torch.Tensor:
    """[tokens, width] float32: the indexer's score of each position for each of these tokens (-inf past its own)."""
    tokens, heads, head_dim = index_q.shape
    scores = torch.empty(tokens, width, dtype=torch.float32, device=cache.device)   # the kernel writes every one
    kind, precision = dot_config(index_q.dtype)
    if tokens and width:
        _index_scores_kernel[(tokens, triton.cdiv(width, BLOCK_N))](
            index_q, index_weights, cache, scores, meta.block_tables, token_seq, token_pos,
            index_scale, k_scale, heads, width,
            *index_q.stride(), *index_weights.stride(), cache.stride(0), cache.stride(1), cache.stride(3),
            scores.stride(0), meta.block_tables.stride(0),
            KEY_START=latent_dim, HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim),
            HEADS_PAD=padded_head_dim(heads), BLOCK_N=BLOCK_N, BLOCK_SIZE=meta.block_size, DOT_DTYPE=kind,
            DOT_PRECISION=precision, KV_FP8=cache.dtype == FP8_KV_DTYPE)
    return scores


def attend_chosen(query: torch.Tensor, choice: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, kv_lora_rank: int, latent_dim: int, *, k_scale: float = 1.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.dsa.attend_chosen` on the device: [T, heads, kv_lora_rank], each head's weighted latents (`sinks`
    [heads]: each head's sink logit in its denominator)."""
    chosen, keep = choice
    tokens, heads, _ = query.shape
    lora, rope = kv_lora_rank, latent_dim - kv_lora_rank
    out = torch.empty(tokens, heads, lora, dtype=query.dtype, device=query.device)
    token_seq, _ = token_layout(meta, cache.device)
    keep = keep.to(torch.int8)
    kind, precision = dot_config(query.dtype)
    if tokens:
        _sparse_attention_kernel[(tokens, triton.cdiv(heads, BLOCK_H))](
            query, cache, out, chosen, keep, meta.block_tables, token_seq, out if sinks is None else sinks,
            scale * LOG2_E, k_scale, heads, chosen.shape[1],
            *query.stride(), cache.stride(0), cache.stride(1), cache.stride(3), *out.stride(),
            chosen.stride(0), keep.stride(0), meta.block_tables.stride(0),
            KV_LORA=lora, KV_LORA_PAD=padded_head_dim(lora), ROPE=rope, ROPE_PAD=padded_head_dim(rope),
            BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_SIZE=meta.block_size, DOT_DTYPE=kind, DOT_PRECISION=precision,
            KV_FP8=cache.dtype == FP8_KV_DTYPE, SINKS=sinks is not None, num_warps=ATTEND_WARPS)
    return out
