"""Triton paged attention for a whole step: decode tokens and short chunks here, long chunks in
`kernels.triton_prefill`.

Dispatch: a chunk of at least `PREFILL_MIN_QUERY_LEN` (64) new tokens goes to the prefill kernel
(`kernels.triton_prefill`: 128-query tiles of one query head, tensor-core dots, the tiles past the
causal diagonal skipped); the decode rows and shorter chunks come here, in one launch. One launch
per kind per layer. Why 64: below it a 128-row tile of one head would be mostly padding, and this
kernel, whose rows are (token, query head of a GQA group) pairs, fills its tiles and loads each K/V
tile once for the whole group, which is what a bandwidth-bound short query needs. From 64 tokens
the prefill tile is at least half full and reads no more K/V per query head than this kernel's
tiles (at most 64 rows each) do, and from 128 it does fewer, larger dots. Keeping the long chunks
out also keeps this launch's `BLOCK_M`, which the step's longest query here sets, small for decodes.

The step's tokens are cut into query tiles, each `BLOCK_Q` consecutive tokens of one sequence (a
sequence's tokens never share a tile with another's, and no token is padded). A program takes one
tile and one KV head, and works on the `BLOCK_M = BLOCK_Q * GROUP_PAD` rows made of every (token,
query head of the KV head's group) pair, so each K/V tile is loaded once for the whole GQA group.
It walks the sequence's K/V `BLOCK_N` positions at a time straight out of the cache blocks, through
the block table, with an online softmax (causal among the new tokens, the cached prefix fully
visible, optionally a sliding window, or chunked attention: `USE_CHUNK`, a query at p sees p - p % chunk
to p, and a tile starts at its first query's chunk).

Flash-decoding: when the tiles x KV heads are too few to fill the device (a few long decodes), each
tile's KV range is also split into `num_splits` segments (grid axis 2). Each program then writes
its segment's running max, sum and unnormalised output, and `_reduce_splits_kernel` combines them
for this kernel's rows.

An FP8 cache (float8_e4m3fn, `KV_FP8`): each K/V tile is loaded as FP8 and read as
`reference.dequantize_kv` gives it, times k_scale / v_scale in float32 and rounded once to the query's
type (`triton_kv_store.dequantize_e4m3`), before the dots; the split partials and their reduce do not
change. Other caches compile as before (the scales are passed and not used).

Capped scores (`softcap` > 0, Gemma 2; `SOFTCAP`): the launch passes qk_scale = scale / softcap and
softcap x log2 e, and each score becomes tanh(q.k x qk_scale) x that (tanh as 2 sigmoid(2x) - 1), in the
log2 units the online softmax works in; `capped_scales` gives the pair for both kernels. Uncapped
launches compile as before.

Attention sinks (`sinks`, GPT-OSS; `SINKS`): one logit per query head that joins the softmax's denominator and
weighs no value. The running max and sum are left as they are over the keys; at the end each row's sum gains
exp2(sink x log2 e - max) (in the split reduce, against the combined max), so a row's weights sum to less than 1.
Launches without sinks compile as before. ALiBi (`alibi`, `ALIBI`): each score gains its head's slope x (key
position - query position), as in `kernels.triton_prefill`.

Any head_dim: both kernels here, like the prefill kernel, work on `HEAD_DIM_PAD =
padded_head_dim(head_dim)` lanes (the next power of two, at least 16) and mask the lanes past the
real `HEAD_DIM`: loaded as 0, so they add nothing to the dots and sums, and never stored (the split
partials keep the real head_dim). A power-of-two head_dim pads nothing and compiles as before.

What is the same for every layer of a step (the tiles, the split count) is built once, into
`meta.backend_cache["triton"]` (and `["triton_prefill"]`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import FP8_KV_DTYPE
from kernels.triton_block_sparse import block_sparse_attention
from kernels.triton_dsa import attend_chosen as dsa_attend_chosen, choose_tokens as dsa_choose_tokens
from kernels.triton_kv_store import _store_kv_kernel, dequantize_e4m3, store_kv
from kernels.triton_prefill import (_prefill_attention_kernel, aligned_int32, capped_scales,
                                    check_attention_args, dot_dtype, is_interpreted, padded_head_dim,
                                    prefill_attention)

# This module is the Triton backend (`kernels.get_backend`): store_kv comes along with it, DeepSeek's sparse
# attention (`kernels.dsa`'s halves on the device) and MiniMax M3's block-sparse attention
__all__ = ["paged_attention", "store_kv", "choose_num_splits", "compile_kernels", "compiled_variants",
           "launch_variants", "dsa_choose_tokens", "dsa_attend_chosen", "block_sparse_attention"]

# Chunks of at least this many new tokens run through `kernels.triton_prefill` (see above).
PREFILL_MIN_QUERY_LEN = 64
# A split segment covers at least this many KV positions: shorter ones cost more in the reduce
# (and in re-reading Q) than they win in parallelism.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64
# The paged kernel's warps where set (at import), else by its tile: bench/gpu_session.sh's kernels_warps (at head_dim
# 128 a decode tile builds for sm_90 with ~500 bytes of stack on 4 warps, none on 8: which is faster is measured there)
PAGED_WARPS = int(os.environ.get("CLIFFGUARD_PAGED_WARPS") or 0)


# Triton compiles a kernel per constexpr set and per specialization of its int arguments (== 1,
# divisible by 16). The split count and the block tables' row width change from step to step, so
# they are not specialized on: every variant a step can need is then one of `launch_variants`.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_attention_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, alibi_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_seq_ptr, tile_q_start_ptr, tile_row_ptr,
    qk_scale, softcap, k_scale, v_scale, window, chunk, num_heads, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, USE_CHUNK: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    # grid: (num_tiles, num_kv_heads, num_splits)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(tile_seq_ptr + tile)
    tile_q = tl.load(tile_q_start_ptr + tile)          # first query of the tile, within its sequence
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len                       # cached prefix before this step's tokens

    # rows: (query token of the tile, query head of the group), head fastest
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM                          # all true when HEAD_DIM_PAD == HEAD_DIM
    q_local = tile_q + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_local < q_len) & (head_in_group < GROUP)
    q_pos = context_len + q_local                       # [BLOCK_M] position of each row's token
    token = (q_begin + q_local).to(tl.int64)

    # q: [BLOCK_M, HEAD_DIM_PAD]; the padded lanes are 0 in q, k and v, so add nothing to the dots
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

    # KV positions this tile needs: [kv_start, kv_end), kv_start aligned to BLOCK_N
    kv_end = context_len + tl.minimum(tile_q + BLOCK_Q, q_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + tile_q - window + 1, 0)
    if USE_CHUNK:   # the tile's first query's chunk (the later queries' start no earlier)
        kv_start = tl.maximum(kv_start, (context_len + tile_q) // chunk * chunk)
    kv_start = (kv_start // BLOCK_N) * BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end - kv_start, BLOCK_N)
    if SPLIT:
        per_split = tl.cdiv(num_kv_tiles, num_splits)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, num_kv_tiles)
    else:
        t_lo = 0
        t_hi = num_kv_tiles

    if ALIBI:   # each row's head's slope, in the log2 units of the scores
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        kv_pos = kv_start + t * BLOCK_N + offs_n        # [BLOCK_N]
        kv_mask = kv_pos < kv_end
        block = tl.load(table_ptr + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        # k: [HEAD_DIM_PAD, BLOCK_N]
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + in_block[None, :] * stride_ks
                    + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                    mask=kv_mask[None, :] & mask_d[:, None], other=0.0)
        if KV_FP8:
            k = dequantize_e4m3(k, k_scale, query_ptr.dtype.element_ty)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale   # [BLOCK_M, BLOCK_N], log2 units
        if SOFTCAP:
            s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * softcap
        if ALIBI:
            s += slope[:, None] * (kv_pos[None, :] - q_pos[:, None]).to(tl.float32)
        allowed = kv_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:
            allowed = allowed & (kv_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing allowed yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # v: [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:
            v = dequantize_e4m3(v, v_scale, query_ptr.dtype.element_ty)
        # P rounded to the query's dtype, as the tensor cores take it
        p = p.to(query_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # partials: m, l [num_rows, num_heads, num_splits]; acc [..., HEAD_DIM], float32, contiguous
        row = (tl.load(tile_row_ptr + tile) + offs_m // GROUP_PAD).to(tl.int64)
        part = (row * num_heads + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_valid[:, None] & mask_d[None, :])
    else:
        if SINKS:   # each head's sink logit joins the sum (in log2 units, against the row's max)
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i += tl.where(row_valid, tl.exp2(sink - m_i), 0.0)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]   # l_i = 0 only on padding rows
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, row_token_ptr, sinks_ptr,
    num_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    # grid: (num_rows, num_heads); combines the split partials of one of the paged kernel's rows into
    # the output of its token (`row_token_ptr`).
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(row_token_ptr + row).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_s = offs_s < num_splits
    part = (row * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)                              # empty segments (m = -inf) weigh 0
    l_sum = tl.sum(l * w, axis=0)
    if SINKS:   # the head's sink logit joins the sum, against the combined max (log2 units)
        l_sum += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :],
                  other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / l_sum
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=mask_d)


# Whether these kernels run through Triton's interpreter (TRITON_INTERPRET=1 when triton was imported).
INTERPRETED = is_interpreted(_paged_attention_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """How many segments to split each tile's KV range into (flash-decoding), from Python ints only;
    `max_seq_len`: the most KV positions a tile reads (a sliding layer's window, not its sequence's length).

    Split only when the unsplit grid (`num_programs` = tiles x KV heads) is smaller than the device's
    SM count, and keep segments at least `MIN_SPLIT_LEN` positions long; aim at two programs per SM.
    On the CPU (the interpreter) there is nothing to fill: 1.
    """
    if device.type != "cuda" or num_programs == 0:
        return 1
    num_sms = _num_sms(device)
    max_by_len = max_seq_len // MIN_SPLIT_LEN
    if num_programs >= num_sms or max_by_len < 2:
        return 1
    return max(1, min(triton.cdiv(2 * num_sms, num_programs), max_by_len, MAX_SPLITS))


def _launch_config(group: int, max_query_len: int, head_dim: int, element_size: int
                   ) -> tuple[int, int, int, int, int]:
    """(GROUP_PAD, BLOCK_M, BLOCK_Q, BLOCK_N, num_warps) for a launch; BLOCK_M, BLOCK_N >= 16 for tl.dot.
    The tiles are `padded_head_dim(head_dim)` wide: head_dim below means that.

    BLOCK_M = BLOCK_Q tokens x GROUP_PAD heads: the fewest rows that fit the longest query (at least 16,
    the smallest dot; a decode tile holds its one token, the other rows are masked), at most 64 unless
    the group alone is larger. BLOCK_N: 64 positions, 32 for float32 or head_dim > 128, so the pipelined
    K/V tiles fit the shared memory of sm_80/sm_86 parts too and the float32 build does not spill.
    8 warps once the Q tile reaches 8 KiB: with 4, the sm_90 build of those tiles spills registers.
    """
    group_pad = triton.next_power_of_2(group)
    rows = triton.next_power_of_2(max(max_query_len, 1)) * group_pad
    block_m = max(min(max(rows, 16), 64), group_pad)
    head_dim_pad = padded_head_dim(head_dim)
    block_n = 64 if element_size <= 2 and head_dim_pad <= 128 else 32
    num_warps = PAGED_WARPS or (8 if block_m * head_dim_pad * element_size >= 8192 else 4)
    return group_pad, block_m, block_m // group_pad, block_n, num_warps


def _step_plan(meta: AttentionMetadata, block_q: int | None = None) -> dict:
    """This kernel's share of the step and its query tiles for `block_q`, built once and shared by every
    layer. Its rows are the tokens of the sequences with 1 to PREFILL_MIN_QUERY_LEN - 1 new tokens, in
    step order; the longer chunks are `kernels.triton_prefill`'s.

    backend_cache["triton"]: {"num_query_tokens" (the whole step), "seqs", "num_rows", "max_query_len",
    "max_seq_len" (over this kernel's sequences), ("tiles", block_q): (tile_seq, tile_q_start, tile_row),
    "row_tokens", ("num_splits", block_q, num_kv_heads, sliding_window, chunk): int}
    tile_seq, tile_q_start, tile_row: [num_tiles] int32 — the sequence of each tile, its first query within
    the sequence and that query's row; row_tokens: [num_rows] int32, each row's token.
    """
    plan = meta.backend_cache.get("triton")
    if plan is None:
        q_lens, s_lens = meta.query_lens_list, meta.seq_lens_list
        seqs = [i for i, q_len in enumerate(q_lens) if 0 < q_len < PREFILL_MIN_QUERY_LEN]
        plan = {"num_query_tokens": sum(q_lens),
                "seqs": seqs,
                "num_rows": sum(q_lens[i] for i in seqs),
                "max_query_len": max((q_lens[i] for i in seqs), default=0),
                "max_seq_len": max((s_lens[i] for i in seqs), default=0)}
        meta.backend_cache["triton"] = plan
    if block_q is None:
        return plan
    key = ("tiles", block_q)
    if key not in plan:
        seqs, starts, rows = [], [], []
        row = 0
        for i in plan["seqs"]:
            for start in range(0, meta.query_lens_list[i], block_q):
                seqs.append(i)
                starts.append(start)
                rows.append(row + start)
            row += meta.query_lens_list[i]
        plan[key] = tuple(aligned_int32([seqs, starts, rows], meta.query_start_loc.device))
    return plan


def _row_tokens(meta: AttentionMetadata, plan: dict) -> torch.Tensor:
    """[num_rows] int32: the token of each of this kernel's rows (the split reduce's grid), built once."""
    if "row_tokens" not in plan:
        token_start = [0]
        for q_len in meta.query_lens_list:
            token_start.append(token_start[-1] + q_len)
        tokens = [t for i in plan["seqs"] for t in range(token_start[i], token_start[i + 1])]
        plan["row_tokens"] = aligned_int32([tokens], meta.query_start_loc.device)[0]
    return plan["row_tokens"]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None, *,
                    k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None,
                    out: torch.Tensor | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, chunk: int | None = None,
                    alibi: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached K/V (new tokens included); an FP8
    cache (float8_e4m3fn) is read as `reference.dequantize_kv` gives it (times k_scale / v_scale, rounded to
    the query's dtype), other caches ignore the scales; `softcap` > 0 caps each score at
    softcap x tanh(score / softcap); `sinks` ([num_heads], contiguous) adds exp(sinks[head]) to each
    softmax's denominator; `chunk` keeps each query's own chunk of positions (p - p % chunk to p); `alibi`
    ([num_heads] float32 slopes, contiguous) adds slope x (key position - query position) to each score.

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    (strided views allowed, head_dim contiguous and of any size: the kernels pad it to a power of two
    inside, masked). Returns [num_tokens, num_heads, head_dim] in query's dtype, written into `out` when
    given. Chunks of at least PREFILL_MIN_QUERY_LEN tokens run through `kernels.triton_prefill`, the other
    rows through this module's kernel. `num_splits` forces the flash-decoding split count of the latter
    (default: `choose_num_splits`).
    """
    if out is None:
        out = torch.empty_like(query)
    check_attention_args(query, k_cache, v_cache, meta, out, sliding_window, k_scale, v_scale, sinks, chunk, alibi)
    num_tokens, num_heads, head_dim = query.shape
    head_dim_pad = padded_head_dim(head_dim)
    num_kv_heads = k_cache.shape[2]
    plan = _step_plan(meta)
    assert num_tokens == plan["num_query_tokens"], \
        f"{num_tokens} query rows for metadata of {plan['num_query_tokens']} tokens"
    if num_tokens == 0:
        return out
    prefill_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, k_scale=k_scale, v_scale=v_scale,
                      min_query_len=PREFILL_MIN_QUERY_LEN, softcap=softcap, sinks=sinks, chunk=chunk, alibi=alibi)
    if plan["num_rows"] == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad, block_m, block_q, block_n, num_warps = _launch_config(
        group, plan["max_query_len"], head_dim, query.element_size())
    tile_seq, tile_q_start, tile_row = _step_plan(meta, block_q)[("tiles", block_q)]
    num_tiles = tile_seq.shape[0]
    if num_splits is None:   # a sliding (chunked) layer's split count from the positions its window (chunk) reads
        splits_key = ("num_splits", block_q, num_kv_heads, sliding_window, chunk)
        if splits_key not in plan:
            span = plan["max_seq_len"]
            if sliding_window is not None:
                span = min(span, sliding_window + plan["max_query_len"] - 1)
            if chunk is not None:
                span = min(span, chunk + plan["max_query_len"] - 1)
            plan[splits_key] = choose_num_splits(num_tiles * num_kv_heads, span, query.device)
        num_splits = plan[splits_key]
    assert num_splits >= 1, f"num_splits {num_splits}"

    split = num_splits > 1
    dtype = dot_dtype(query.dtype)
    if split:
        num_rows = plan["num_rows"]
        part_m = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out    # unused
    grid = (num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out,
        part_m, part_l, part_acc, query if sinks is None else sinks, query if alibi is None else alibi,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, tile_seq, tile_q_start, tile_row,
        *capped_scales(scale, softcap), float(k_scale), float(v_scale), sliding_window or 0, chunk or 1, num_heads,
        num_splits,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        USE_WINDOW=sliding_window is not None, SPLIT=split,
        DOT_DTYPE=dtype, DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32",
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE, SOFTCAP=softcap > 0, SINKS=sinks is not None,
        USE_CHUNK=chunk is not None, ALIBI=alibi is not None, num_warps=num_warps,
    )
    if split:
        row_tokens = _row_tokens(meta, plan)
        _reduce_splits_kernel[(row_tokens.shape[0], num_heads)](
            part_m, part_l, part_acc, out, row_tokens, query if sinks is None else sinks, num_heads, num_splits,
            *out.stride(), NUM_SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, SINKS=sinks is not None, num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out


def launch_variants(num_heads: int, num_kv_heads: int, head_dim: int, element_size: int) -> list[tuple[int, int]]:
    """(query length, num_splits) of one launch per compiled variant a step of this attention shape can
    need: each distinct `_launch_config` over the query lengths this kernel takes (1 to
    PREFILL_MIN_QUERY_LEN - 1), unsplit and split in two; the reduce kernel at every power-of-two pad up
    to MAX_SPLITS (`NUM_SPLITS_PAD` is its constexpr); then one chunk of PREFILL_MIN_QUERY_LEN, the prefill
    kernel's one variant (its configuration depends on the attention shape only)."""
    group = num_heads // num_kv_heads
    variants, configs = [], set()
    # the config changes only past a power of two; the longest query here shares its power's
    longest = PREFILL_MIN_QUERY_LEN - 1
    for query_len in sorted({min(1 << k, longest) for k in range(longest.bit_length() + 1)}):
        config = _launch_config(group, query_len, head_dim, element_size)
        if config not in configs:
            configs.add(config)
            variants += [(query_len, 1), (query_len, 2)]
    pad = 4
    while pad <= triton.next_power_of_2(MAX_SPLITS):
        variants.append((1, pad))
        pad *= 2
    variants.append((PREFILL_MIN_QUERY_LEN, 1))
    return variants


def compile_kernels(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, sliding_window: int | None = None, kv_dtype: torch.dtype | None = None,
                    softcap: float = 0.0, sinks: bool = False, chunk: int | None = None, alibi: bool = False) -> int:
    """Launch store_kv and paged attention once per `launch_variants` entry on made-up tokens, so Triton
    compiles every variant (or loads it from its cache) before the engine serves, not at the first step
    that needs it: on a fresh GPU machine each compile stalled a step for 0.15-1.4 s, 16 times in the
    first 48 s of serving (docs/PERF.md). The tensors are scratch ones laid out as the model's (query
    and key contiguous in `dtype`, the model's; value a view of the fused projection; a cache of [blocks,
    block_size, heads, head_dim] in `kv_dtype`, default `dtype`: an FP8 cache's kernels are variants of their
    own; so are capped scores', `softcap` > 0, attention sinks', `sinks`, chunked attention's, `chunk`, and
    ALiBi's, `alibi`). The scales, the sink logits, the slopes and the chunk's size are runtime arguments: one
    variant serves any. Returns the number of launches."""
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"dtype {dtype}: the model's (the query's); an FP8 cache's goes in kv_dtype"
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    variants = launch_variants(num_heads, num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())
    seq_len = max(max(q for q, _ in variants), max(s for _, s in variants) * 64)   # 64 positions a segment
    num_blocks = triton.cdiv(seq_len, block_size)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device).to(kv_dtype)
    table = list(range(num_blocks))
    sink_logits = torch.randn(num_heads, dtype=dtype, device=device) if sinks else None
    slopes = torch.rand(num_heads, dtype=torch.float32, device=device) if alibi else None
    for query_len, num_splits in variants:
        meta = AttentionMetadata.build([table], [query_len], [seq_len], block_size, device)
        qkv = torch.randn(query_len, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        value = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(query_len, num_kv_heads, head_dim)
        key = torch.randn(query_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        query = torch.randn(query_len, num_heads, head_dim, dtype=dtype, device=device)
        store_kv(key, value, cache[0], cache[1], meta)
        paged_attention(query, cache[0], cache[1], meta, head_dim ** -0.5, sliding_window, num_splits=num_splits,
                        softcap=softcap, sinks=sink_logits, chunk=chunk, alibi=slopes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants)


def compiled_variants() -> frozenset[str] | None:
    """Every compiled variant the attention and KV-store kernels hold, as "kernel: Triton's cache key"
    (the key spells out each argument's specialization and the constexprs); None where kernels are not
    compiled (the interpreter) or this Triton keeps them elsewhere. A step trace compares it before and
    after each step, so a compile mid-serving shows up with what it specialized on."""
    keys = set()
    for fn in (_paged_attention_kernel, _reduce_splits_kernel, _prefill_attention_kernel,
               _store_kv_kernel):
        caches = getattr(fn, "device_caches", None)
        if not isinstance(caches, dict):
            return None
        try:
            keys.update(f"{getattr(fn, '__name__', fn)}: {key}" for entry in caches.values() for key in entry[0])
        except (TypeError, IndexError, KeyError):
            return None
    return frozenset(keys)
