"""A mixture-of-experts layer's experts as two Triton grouped GEMMs over the (token, expert) pairs.

A step routes each of its T tokens to k experts: P = T x k pairs. `moe_align` sorts the pairs by expert
on the device and lays each expert's pairs out in blocks of BLOCK_M rows (the last block of an expert
padded with a sentinel), so one program of `_moe_gemm_kernel` multiplies BLOCK_M pairs of one expert
by a BLOCK_N-column tile of that expert's weight, `tl.dot` tiles over K, the weight tile loaded once for
the block's pairs (FlashInfer's and vLLM's fused MoE lay their work out the same way). Nothing is read
back to the host: every shape follows from T, k and the expert count, so a decode step's launches can be
captured in a CUDA graph.

    h   = x[pair // k] @ w13[e]^T (+ b13[e])            [P, 2 x inter]   (gate rows, then up rows)
    a   = act(h): silu(gate) * up by default            [P, inter]        (`kernels.triton_fused.silu_and_mul`)
    y   = (a[pair] @ w2[e]^T (+ b2[e])) x weight[pair]  [P, hidden]       float32
    out = sum over a token's k pairs of y               [T, hidden]       rounded once to x's dtype

The biases (GPT-OSS's experts; `HAS_BIAS`) are added to the float32 products before their one rounding, and
the activation is any elementwise torch function of h (GPT-OSS's clamped SwiGLU), launched between the GEMMs.

FP8 experts (float8_e4m3fn w13 / w2 with float32 scales in blocks: DeepSeek's and Qwen3-MoE's FP8 releases, held
as stored) are dequantized tile by tile as they are loaded, as `kernels.triton_fp8_gemm` does a dense layer's: each
value times its block's scale in float32, rounded once to x's dtype, one byte a weight read.
MXFP4 experts (GPT-OSS's, held as stored: `kernels.mxfp4`) are decoded the same way: each input's byte loaded (a
byte serves two neighbouring inputs, so the second load is a cache hit), its nibble's e2m1 value times its group's
power of two built from the e8m0 bits, exact in float32 and in x's dtype: half a byte a weight read. INT4 experts
(INT4 checkpoints' 4-bit integers, `engine.int4_formats`) alike: the nibble less 8, or less its group's zero point
where the checkpoint stores them (`ZEROS`: AWQ's), times its group's scale in float32, rounded once to x's dtype;
INT8 experts (8-bit GPTQ's and pack-quantized ones) a byte a code, less 128 or their zero point, alike.

`y` stays in float32 and each pair writes its own row (at its place in the unsorted order), so the sum
over a token's experts has no atomics and is the same from run to run. Products accumulate in float32
(`tl.dot`, exact IEEE for float32 inputs); the intermediate `h` and `a` are rounded to x's dtype, as the
unfused layer rounds them. Weight layouts are the model's (`engine.models.qwen3_moe.SparseMoeBlock`):
w13 [E, 2 x inter, hidden], w2 [E, hidden, inter]; any sizes (tiles masked at the edges).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.mxfp4 import MXFP4_GROUP
from kernels.triton_fp8_gemm import dequantize_tile
from kernels.triton_fused import silu_and_mul
from kernels.triton_prefill import INTERPRETED, dot_dtype

__all__ = ["PACKINGS", "fused_moe", "moe_align", "moe_block_m", "moe_warps"]

PACKINGS = (None, "mxfp4", "int4", "int8")   # how packed experts are held: the kernel's PACKED
CODES_A_BYTE = {"mxfp4": 2, "int4": 2, "int8": 1}


@triton.jit(do_not_specialize=["num_pairs"])   # one compiled variant whatever a step's pair count
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weight_ptr, bias_ptr, sorted_pairs_ptr, block_expert_ptr, s_ptr, z_ptr,
    num_pairs, N, K, row_div, scale_rows, scale_cols,
    stride_am, stride_we, stride_wn, stride_wk, stride_om, stride_be, stride_se, stride_sn,
    MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, W_FP8: tl.constexpr, PACKED: tl.constexpr,
    ZEROS: tl.constexpr, BF16_BY_BITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (blocks of BLOCK_M pairs, cdiv(N, BLOCK_N)); a block's pairs all go to one expert.
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:   # past the blocks this step uses
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs                                   # the padding holds num_pairs
    rows = tl.where(valid, pairs // row_div, 0).to(tl.int64)    # the input row of each pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    s_off = expert * stride_se + (offs_n // scale_rows)[None, :].to(tl.int64) * stride_sn   # INT4's zeros alike
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        if PACKED != 0:   # the input's nibble of its byte (INT8: its byte), and its group's scale
            s_at = s_off + (ks // scale_cols)[:, None]
            s = tl.load(s_ptr + s_at, mask=mask_w, other=0)
            if PACKED == 3:
                code = tl.load(w_base + ks[:, None] * stride_wk, mask=mask_w, other=0).to(tl.int32)
            else:
                byte = tl.load(w_base + (ks // 2)[:, None] * stride_wk, mask=mask_w, other=0)
                code = (byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 15
            if PACKED == 1:   # MXFP4: e2m1 times an e8m0 power of two, exact
                w = (_e2m1(code) * _e8m0(s)).to(a_ptr.dtype.element_ty)
            else:             # INT4 / INT8: the value less 8 / 128 (or its group's zero point), times the scale
                if ZEROS:
                    zero = tl.load(z_ptr + s_at, mask=mask_w, other=0).to(tl.float32)
                else:
                    zero = 128.0 if PACKED == 3 else 8.0
                w = dequantize_tile(code.to(tl.float32) - zero, s.to(tl.float32), a_ptr.dtype.element_ty,
                                    BF16_BY_BITS)
        else:
            w = tl.load(w_base + ks[:, None] * stride_wk, mask=mask_w, other=0.0)
        if W_FP8:   # each element times its block's scale, rounded to the activations' dtype
            s = tl.load(s_ptr + s_off + (ks // scale_cols)[:, None], mask=mask_w, other=0.0)
            w = dequantize_tile(w.to(tl.float32), s, a_ptr.dtype.element_ty, BF16_BY_BITS)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)   # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:   # the expert's bias row, contiguous: [E, N]
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _e2m1(code):
    """The e2m1 value of the low nibble of each int32 `code`, in float32."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5,
                         (1.0 + mantissa * 0.5) * (1 << tl.maximum(exponent - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e8m0(scale):
    """2 ** (scale - 127) of each uint8 `scale`, in float32, from its bits (0: the subnormal 2 ** -127)."""
    bits = tl.where(scale == 0, 0x400000, scale.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of a block: 16 (a dot's least) while the experts get few pairs each (decode), 64 for prefill."""
    return 16 if num_pairs < 16 * num_experts else 64


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts: [T, k] the experts of each token's pairs (pair i = token i // k, slot i % k) ->
    (sorted_pairs [num_blocks x block_m] int32: the pairs by expert, each expert's run padded with P to a
    multiple of block_m; block_expert [num_blocks] int32: each block's expert, -1 past the last used).
    num_blocks is a bound from T, k and the expert count alone (no read of the data): cdiv(P, block_m)
    plus one block a hit expert may leave partly empty."""
    flat = experts.flatten().long()
    num_pairs, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded                             # each expert's first row
    order = flat.argsort(stable=True)                              # pairs by expert, in pair order within one
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    dest = starts[by_expert] + rank
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_expert = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    block_expert[dest // block_m] = by_expert.to(torch.int32)
    return sorted_pairs, block_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, block_m: int, row_div: int, weights: torch.Tensor | None,
          bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
          block: tuple[int, int] = (1, 1), packed: str | None = None, zeros: torch.Tensor | None = None) -> None:
    """out[pair] = a[pair // row_div] @ w[expert of pair]^T (plus bias[expert] when given; times weights[pair]
    when given); FP8 weights (`scale` given: [E, rows in blocks, columns in blocks], blocks of `block`)
    dequantized tile by tile; packed 4-bit ones (`packed`: w [E, rows, columns / 2] uint8 and scale [E, rows,
    columns / group]: MXFP4's e8m0, group 32; INT4's in a float dtype, group `block[1]`, less `zeros` laid out as
    the scales where given) decoded so."""
    num_pairs, n, k = out.shape[0], w.shape[1], w.shape[2] * CODES_A_BYTE.get(packed, 1)
    block = (1, MXFP4_GROUP) if packed == "mxfp4" else block
    dtype = dot_dtype(a.dtype)
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    fp8 = scale is not None and not packed
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, bias if bias is not None else out, sorted_pairs,
        block_expert, scale if scale is not None else out, zeros if zeros is not None else out,
        num_pairs, n, k, row_div, min(block[0], n), min(block[1] or k, k),
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), bias.stride(0) if bias is not None else 0,
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        MUL_WEIGHT=weights is not None, HAS_BIAS=bias is not None, W_FP8=fp8, PACKED=PACKINGS.index(packed),
        ZEROS=zeros is not None,
        BF16_BY_BITS=(fp8 or packed in ("int4", "int8")) and INTERPRETED and a.dtype == torch.bfloat16,
        DOT_DTYPE=dtype,
        DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=moe_warps(block_m, block_n, fp8 or packed is not None),
    )


def moe_warps(block_m: int, block_n: int, quantized: bool) -> int:
    """A launch's warps: 8 for a tile of 64 x 128 or more, and for any tile of quantized weights (FP8, MXFP4, INT4,
    INT8), whose dequantized [BLOCK_K, BLOCK_N] tile, scales and codes a decode launch (16 x 128) also holds: built
    for sm_90 on 4 warps that spills (FP8: 96 bytes of stack; INT8 with zero points 224), on 8 it does not
    (tests/kernels/test_triton_moe.py); 4 for a smaller tile of bfloat16 weights, which spills on neither."""
    return 8 if quantized or block_m * block_n >= 64 * 128 else 4


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1), packed: str | None = None,
              w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden]; w13: [E, 2 x inter, hidden]; w2: [E, hidden, inter]; weights, experts: [T, k] (the
    router's) -> [T, hidden] in x's dtype: each token's experts' gated MLPs, weighted and summed. b13 [E, 2 x
    inter] and b2 [E, hidden]: the experts' biases (GPT-OSS's), where they have them; act: the gate's activation
    times up, [P, 2 x inter] -> [P, inter] (SiLU x up by default). FP8 experts (float8_e4m3fn w13 and w2): their
    scales w13_scale [E, ceil(2 x inter / rows), ceil(hidden / columns)] and w2_scale alike, in blocks of `block`
    (`kernels.fp8_gemm`), each weight tile dequantized as it is loaded. Packed 4-bit experts (`packed`: "mxfp4",
    `kernels.mxfp4`; "int4", `engine.int4_weights`): w13 [E, 2 x inter, hidden / 2] and w2 [E, hidden, inter / 2]
    uint8, two codes a byte ("int8": [E, 2 x inter, hidden] and [E, hidden, inter], a code a byte), w13_scale [E, 2
    x inter, hidden / group] and w2_scale alike (MXFP4's e8m0, group 32; INT4's and INT8's in a float dtype, group
    `block[1]`, 0 for one a row), each tile decoded as it is loaded; the integers' zero points w13_zeros and
    w2_zeros (uint8, laid out as their scales; none: 8, or 128) where the checkpoint stores them."""
    num_tokens, top_k = experts.shape
    num_experts, two_inter, hidden = w13.shape
    per_byte = CODES_A_BYTE.get(packed, 1)
    if packed:
        hidden *= per_byte
        group = MXFP4_GROUP if packed == "mxfp4" else block[1] or hidden   # 0: a scale a row
        assert w13_scale.shape == (num_experts, two_inter, hidden // group), f"w13_scale {w13_scale.shape}"
        for zeros, scale in ((w13_zeros, w13_scale), (w2_zeros, w2_scale)):
            assert zeros is None or packed != "mxfp4" and zeros.dtype == torch.uint8 and zeros.shape == scale.shape \
                and zeros.stride() == scale.stride(), "integer zero points: uint8, laid out as their scales"
    assert x.dim() == 2 and x.shape[1] == hidden and x.stride(1) == 1, f"x {tuple(x.shape)}, hidden {hidden}"
    assert w2.shape == (num_experts, hidden, two_inter // (2 * per_byte)), \
        f"w2 {tuple(w2.shape)} against w13 {tuple(w13.shape)}"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need contiguous rows"
    for name, bias, size in (("b13", b13, two_inter), ("b2", b2, hidden)):
        assert bias is None or (bias.shape == (num_experts, size) and bias.stride(1) == 1), \
            f"{name} {tuple(bias.shape)}: [{num_experts}, {size}] with contiguous rows"
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    block_m = moe_block_m(num_pairs, num_experts)
    sorted_pairs, block_expert = moe_align(experts, num_experts, block_m)
    h = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, h, sorted_pairs, block_expert, block_m, top_k, None, b13, w13_scale, block, packed, w13_zeros)
    gated = act(h).contiguous()                                                # [P, inter]
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(gated, w2, y, sorted_pairs, block_expert, block_m, 1, weights.flatten().contiguous(), b2, w2_scale, block,
          packed, w2_zeros)
    return out.copy_(y.view(num_tokens, top_k, hidden).sum(dim=1))
