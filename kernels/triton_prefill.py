"""Triton prefill attention over the paged KV cache: tensor-core tiles in the FlashAttention-2 style.

A program takes `BLOCK_M` consecutive query tokens of one sequence's chunk and ONE query head, and
walks that sequence's keys `BLOCK_N` positions at a time, loading each K/V tile straight from the
cache blocks through the block table. QK^T and PV are `tl.dot`s on [BLOCK_M, HEAD_DIM] x
[HEAD_DIM, BLOCK_N] and [BLOCK_M, BLOCK_N] x [BLOCK_N, HEAD_DIM] tiles, with an online softmax in
float32 (exp2, the scale folded with log2 e). The walk has two parts:

- the tiles wholly before the tile's first query: the cached prefix and the chunk's earlier tokens,
  visible to every row, so no mask is computed (but a sliding window's lower edge, when there is one,
  or chunked attention's, `USE_CHUNK`: a query at p sees p - p % chunk to p; the tiles wholly outside
  every row's window or chunk are not visited);
- the tiles the causal diagonal crosses, up to the tile's last query: masked. The tiles past the
  diagonal are not visited, so a chunk costs about half its square plus its prefix.

Any head_dim: the tiles' head dimension is `HEAD_DIM_PAD` (`padded_head_dim`: the next power of two,
which `tl.arange` and `tl.dot` need, at least 16), and the lanes past the real `HEAD_DIM` are masked,
loaded as 0 (nothing added to the dots) and never stored. A power-of-two head_dim has no padded lane:
the mask is all true and the compiler drops it.

An FP8 cache (float8_e4m3fn, `KV_FP8`): K/V tiles are loaded as FP8 and read as `reference.dequantize_kv`
gives them, times k_scale / v_scale in float32 and rounded once to the query's type
(`triton_kv_store.dequantize_e4m3`), then the dots run as for a cache in the query's type. Other caches
compile as before (the scales are passed and not used).

ALiBi (`alibi`, BLOOM's and MPT's slopes; `ALIBI`): each score gains the head's slope x (key position - query
position), in log2 units like the rest, after any cap; launches without it compile as before.

Tiles are listed heaviest first (the most keys to walk) and the grid is (query heads, tiles), heads
fastest: the heads of one tile, which share that tile's K/V per GQA group, are scheduled together,
and the long tiles start first instead of trailing at the end of the launch.

The list of tiles is the same for every layer of a step: it is built once, into
`meta.backend_cache["triton_prefill"]`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import FP8_KV_DTYPE, check_sinks
from kernels.transfer import to_device_tensor
from kernels.triton_kv_store import check_kv_dtype, dequantize_e4m3

__all__ = ["INTERPRETED", "LOG2_E", "aligned_int32", "check_attention_args", "dot_config", "dot_dtype",
           "is_interpreted", "padded_head_dim", "prefill_attention", "prefill_config"]

LOG2_E = 1.4426950408889634
# Shared memory per block assumed where no CUDA device says otherwise (the interpreter): an H100's.
DEFAULT_SHARED_MEMORY = 227 * 1024
# Left free of the pipelined K/V stages for the compiler's own buffers (layout conversions).
SHARED_MEMORY_MARGIN = 8 * 1024


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q, q_pos,
    table_ptr, k_head_ptr, v_head_ptr,
    kv_from, kv_to, kv_end, qk_scale, softcap, window, chunk,
    stride_kb, stride_ks, stride_vb, stride_vs, k_scale, v_scale, slope,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    P_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr = False,
):
    """Online softmax over the keys [kv_from, kv_to), BLOCK_N at a time (kv_from aligned to BLOCK_N).
    MASKED: the causal diagonal (and kv_end, the tile's last key + 1) cuts into these tiles; else
    every key is visible to every row and below kv_end, and only a window or a chunk masks. The head_dim lanes
    past HEAD_DIM (up to HEAD_DIM_PAD) load as 0 and add nothing to the dots. P_DTYPE: the query's type,
    which P and an FP8 cache's dequantized K/V (KV_FP8: times k_scale / v_scale) are rounded to. ALIBI: each score
    gains slope x (key position - query position), `slope` the head's in log2 units."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM                                              # all true unless padded
    for start in range(kv_from, kv_to, BLOCK_N):
        kv_pos = start + offs_n                                             # [BLOCK_N]
        if MASKED:
            kv_valid = kv_pos < kv_end
            block = tl.load(table_ptr + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        else:
            block = tl.load(table_ptr + kv_pos // BLOCK_SIZE).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        # k, v: [BLOCK_N, HEAD_DIM_PAD]
        k_ptrs = k_head_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_head_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=kv_valid[:, None] & mask_d[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        if KV_FP8:
            k = dequantize_e4m3(k, k_scale, P_DTYPE)
        # s: [BLOCK_M, BLOCK_N], log2 units
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:   # qk_scale = scale / softcap; softcap: softcap x log2 e (`capped_scales`)
            s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * softcap
        if ALIBI:
            s += slope * (kv_pos[None, :] - q_pos[:, None]).to(tl.float32)
        if MASKED:
            allowed = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - window)
            if USE_CHUNK:
                allowed = allowed & (kv_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk)
            s = tl.where(allowed, s, float("-inf"))
        else:
            if USE_WINDOW:
                s = tl.where(kv_pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
            if USE_CHUNK:
                s = tl.where(kv_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED or USE_WINDOW or USE_CHUNK:
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row with nothing visible yet
        else:
            m_new_safe = m_new
        p = tl.exp2(s - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_valid[:, None] & mask_d[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        if KV_FP8:
            v = dequantize_e4m3(v, v_scale, P_DTYPE)
        # P rounded to the query's dtype, as the tensor cores take it
        p = p.to(P_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(p, v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# The block tables' row width changes from step to step: not specialized on, so one compiled variant
# serves every step of a model (`kernels.triton_attention.compile_kernels` compiles it before serving).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_attention_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, alibi_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_seq_ptr, tile_q_start_ptr,
    qk_scale, softcap, k_scale, v_scale, window, chunk,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, USE_CHUNK: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    # grid: (num_heads, num_tiles); head_dim is contiguous everywhere (the launcher asserts it)
    head = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = head // GROUP

    seq = tl.load(tile_seq_ptr + tile)
    tile_q = tl.load(tile_q_start_ptr + tile)          # first query of the tile, within its chunk
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len                       # cached prefix before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM                          # all true when HEAD_DIM_PAD == HEAD_DIM
    q_local = tile_q + offs_m
    row_valid = q_local < q_len
    q_pos = context_len + q_local                       # [BLOCK_M] position of each row's token
    token = (q_begin + q_local).to(tl.int64)

    # q: [BLOCK_M, HEAD_DIM_PAD]
    q = tl.load(query_ptr + token[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

    # keys [kv_lo, kv_diag) are visible to every row (the window aside); [kv_diag, kv_end) are cut by
    # the diagonal; kv_lo and kv_diag are aligned to BLOCK_N
    diag = context_len + tile_q
    kv_end = context_len + tl.minimum(tile_q + BLOCK_M, q_len)
    kv_diag = (diag // BLOCK_N) * BLOCK_N
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(diag - window + 1, 0)
    if USE_CHUNK:   # the tile's first query's chunk
        kv_lo = tl.maximum(kv_lo, diag // chunk * chunk)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    slope = 0.0
    if ALIBI:   # the head's ALiBi slope, in the log2 units of the scores
        slope = tl.load(alibi_ptr + head).to(tl.float32) * 1.4426950408889634
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, q_pos, table_ptr, k_head_ptr, v_head_ptr, kv_lo, kv_diag, kv_end, qk_scale, softcap, window,
        chunk, stride_kb, stride_ks, stride_vb, stride_vs, k_scale, v_scale, slope,
        MASKED=False, USE_WINDOW=USE_WINDOW, USE_CHUNK=USE_CHUNK, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, P_DTYPE=query_ptr.dtype.element_ty, DOT_DTYPE=DOT_DTYPE,
        DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, q_pos, table_ptr, k_head_ptr, v_head_ptr, kv_diag, kv_end, kv_end, qk_scale, softcap, window,
        chunk, stride_kb, stride_ks, stride_vb, stride_vs, k_scale, v_scale, slope,
        MASKED=True, USE_WINDOW=USE_WINDOW, USE_CHUNK=USE_CHUNK, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, P_DTYPE=query_ptr.dtype.element_ty, DOT_DTYPE=DOT_DTYPE,
        DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8, SOFTCAP=SOFTCAP, ALIBI=ALIBI)

    if SINKS:   # the head's sink logit joins each row's sum (log2 units, against the row's max)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i += tl.where(row_valid, tl.exp2(sink - m_i), 0.0)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]   # l_i = 0 only on padding rows
    tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])


@functools.cache
def capped_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, softcap) arguments: (scale x log2 e, unused) for plain scores; for capped ones
    (scale / softcap, softcap x log2 e), each score then tanh(q.k x qk_scale) x that, in log2 units."""
    if softcap < 0:
        raise ValueError(f"softcap: must be 0 (none) or positive, got {softcap}")
    return (scale * LOG2_E, 0.0) if not softcap else (scale / softcap, softcap * LOG2_E)


def _shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one block may use on `device` (opt-in maximum); DEFAULT_SHARED_MEMORY off CUDA."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SHARED_MEMORY)


def padded_head_dim(head_dim: int) -> int:
    """HEAD_DIM_PAD of the attention kernels for a head_dim: the next power of two (the shapes of
    `tl.arange` and `tl.dot`), at least 16 (a dot's smallest K). head_dim itself when it is one of them."""
    return max(16, triton.next_power_of_2(head_dim))


def prefill_config(head_dim: int, element_size: int, shared_bytes: int = DEFAULT_SHARED_MEMORY
                   ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel for a head_dim and element size.

    The tiles are `padded_head_dim(head_dim)` wide, so that is the size everything below goes by (head_dim
    80 or 96 is configured as 128, 160 or 192 as 256).

    16-bit types up to head_dim 128: 128 x 64 tiles, the shape of the FA2-style Triton kernels on
    sm_80/sm_90 (the tensor cores' M per warp group is 64; 128 rows amortise each K/V tile over twice
    as many queries). head_dim 256: 64 x 32, so the float32 accumulator stays in registers. float32
    (no tensor-core path: the dots are FMAs, and spill some registers at head_dim 128 at any tile
    size tried; a CPU dtype, not a serving one on a GPU): 64 x 32. 8 warps once the Q tile reaches 32 KiB (head_dim
    128 at 16 bits), else 4. Pipeline stages: up to 3 K/V stages that fit the device's shared memory
    (H100, H200, A100: 3; 99 KiB sm_86/sm_89 parts at head_dim 128: 2). Built ahead of time for sm_90
    with Triton 3.9 (no GPU needed), bf16 at head_dim 128 is wgmma dots fed by 16-byte cp.async loads,
    3 stages, 96 KiB of shared memory (three K/V stages; Q stays in registers), 183 registers, no spills.
    """
    head_dim_pad = padded_head_dim(head_dim)
    if element_size <= 2 and head_dim_pad <= 128:
        block_m, block_n = 128, 64
    else:
        block_m, block_n = 64, 32
    num_warps = 8 if block_m * head_dim_pad * element_size >= 32 * 1024 else 4
    stage_bytes = 2 * block_n * head_dim_pad * element_size
    num_stages = max(1, min(3, (shared_bytes - SHARED_MEMORY_MARGIN) // stage_bytes))
    return block_m, block_n, num_warps, num_stages


def _prefill_tiles(meta: AttentionMetadata, min_query_len: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_seq, tile_q_start), both [num_tiles] int32: the BLOCK_M-query tiles of every chunk of at
    least `min_query_len` tokens, heaviest first (most keys to walk), built once per step.

    backend_cache["triton_prefill"]: {(min_query_len, block_m): (tile_seq, tile_q_start)}
    """
    plan = meta.backend_cache.setdefault("triton_prefill", {})
    key = (min_query_len, block_m)
    if key not in plan:
        tiles = []
        for seq, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if q_len >= min_query_len:
                context_len = seq_len - q_len
                for start in range(0, q_len, block_m):
                    tiles.append((context_len + min(start + block_m, q_len), seq, start))
        tiles.sort(key=lambda t: -t[0])
        plan[key] = tuple(aligned_int32([[seq for _, seq, _ in tiles], [start for _, _, start in tiles]],
                                        meta.query_start_loc.device))
    return plan[key]


def aligned_int32(rows: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Equal-length int lists as [len] int32 tensors on `device`, one copy for all, each starting 16-byte
    aligned: Triton specializes a pointer argument on its 16-byte alignment, and an unaligned per-step
    array (an odd tile count once left the second row 4 bytes off) is a variant of its own, compiled
    mid-serving on a GPU."""
    length = len(rows[0])
    pad = -length % 4
    table = torch.tensor([row + [0] * pad for row in rows], dtype=torch.int32).reshape(len(rows), length + pad)
    table = to_device_tensor(table, device)
    return [table[i, :length] for i in range(len(rows))]


def check_attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, out: torch.Tensor, sliding_window: int | None,
                         k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None,
                         chunk: int | None = None, alibi: torch.Tensor | None = None) -> None:
    """Assert what the paged-attention kernels assume of their arguments: shapes that fit each other and
    the metadata, a float16/bfloat16/float32 query and out, a float cache or an FP8 (float8_e4m3fn) one with
    positive finite scales (`triton_kv_store.check_kv_dtype`), head_dim contiguous (of any size: the kernels
    pad it to `padded_head_dim`), int32 metadata arrays with contiguous rows, one device; sinks, where given,
    one contiguous logit per query head (a ValueError otherwise, `reference.check_sinks`); ALiBi's slopes, where
    given, one contiguous float32 a query head."""
    check_sinks(sinks, query)
    assert sinks is None or sinks.is_contiguous(), "sinks: contiguous"
    assert alibi is None or (alibi.shape == (query.shape[1],) and alibi.dtype == torch.float32
                             and alibi.is_contiguous() and alibi.device == query.device), \
        f"alibi: one float32 slope a query head ({query.shape[1]}) on {query.device}, contiguous"
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim), \
        f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit query {tuple(query.shape)}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} KV heads"
    assert head_dim >= 1, f"head_dim {head_dim}"
    assert block_size == meta.block_size, f"cache block_size {block_size} != metadata's {meta.block_size}"
    assert num_tokens == meta.num_tokens, f"{num_tokens} query rows for metadata of {meta.num_tokens} tokens"
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"query dtype {query.dtype}"
    assert k_cache.dtype == v_cache.dtype, f"cache dtypes {k_cache.dtype}, {v_cache.dtype} differ"
    check_kv_dtype(k_cache.dtype, k_scale, v_scale)
    assert out.shape == query.shape and out.dtype == query.dtype and out.device == query.device, \
        f"out {tuple(out.shape)} {out.dtype} does not match query {tuple(query.shape)} {query.dtype}"
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.dim() == 2
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.query_start_loc.is_contiguous() and meta.seq_lens.is_contiguous()
    assert meta.block_tables.stride(1) == 1 or meta.block_tables.shape[1] <= 1, "block_tables rows contiguous"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", meta.block_tables),
                    ("query_start_loc", meta.query_start_loc), ("seq_lens", meta.seq_lens)):
        assert t.device == query.device, f"{name} on {t.device}, query on {query.device}"
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous, strides {t.stride()}"
    assert sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window}"
    assert chunk is None or chunk > 0, f"chunk {chunk}"


def is_interpreted(kernel) -> bool:
    """Whether `kernel` runs through Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


INTERPRETED = is_interpreted(_prefill_attention_kernel)


def dot_dtype(dtype: torch.dtype):
    """The dots' operand type for a query dtype: the query's own, except under the interpreter, whose dot
    multiplies bf16 as raw uint16 bits: there bf16 operands are widened (exactly) to float32."""
    if INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def dot_config(dtype: torch.dtype) -> tuple:
    """(DOT_DTYPE, DOT_PRECISION) of a launch for a query dtype: `dot_dtype`'s type, IEEE float32 dots for float32
    operands, else the tensor cores'."""
    kind = dot_dtype(dtype)
    return kind, "ieee" if kind == tl.float32 else "tf32"


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None, out: torch.Tensor, *,
                      k_scale: float = 1.0, v_scale: float = 1.0, min_query_len: int = 2,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk: int | None = None,
                      alibi: torch.Tensor | None = None) -> int:
    """Causal attention of the chunks of at least `min_query_len` new tokens, written into their rows of
    `out` (the other rows are left as they are). Returns the number of tiles launched (0: no launch). An FP8
    cache (float8_e4m3fn) is read as `reference.dequantize_kv` gives it (times k_scale / v_scale, rounded to
    the query's dtype); other caches ignore the scales. `softcap` and `sinks`: as `reference.paged_attention`'s;
    `alibi` ([num_heads] float32 slopes, BLOOM's and MPT's) adds slope x (key position - query position) to each
    score, after any cap.

    query, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] (strided views allowed, head_dim contiguous and of any size: padded to a power of two inside
    the kernel, masked). Each chunk's keys are its sequence's cached prefix (all visible) and its own tokens
    (causal); `sliding_window` keeps the last that many positions, `chunk` each query's own chunk (p - p % chunk
    to p).
    """
    check_attention_args(query, k_cache, v_cache, meta, out, sliding_window, k_scale, v_scale, sinks, chunk, alibi)
    assert min_query_len >= 1, f"min_query_len {min_query_len}"
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_m, block_n, num_warps, num_stages = prefill_config(head_dim, query.element_size(),
                                                             _shared_memory_bytes(query.device))
    tile_seq, tile_q_start = _prefill_tiles(meta, min_query_len, block_m)
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return 0
    dtype = dot_dtype(query.dtype)
    _prefill_attention_kernel[(num_heads, num_tiles)](
        query, k_cache, v_cache, out, query if sinks is None else sinks, query if alibi is None else alibi,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, tile_seq, tile_q_start,
        *capped_scales(scale, softcap), float(k_scale), float(v_scale), sliding_window or 0, chunk or 1,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), USE_WINDOW=sliding_window is not None,
        DOT_DTYPE=dtype, DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32",
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE, SOFTCAP=softcap > 0, SINKS=sinks is not None,
        USE_CHUNK=chunk is not None, ALIBI=alibi is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return num_tiles
