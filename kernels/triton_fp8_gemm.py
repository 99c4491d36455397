"""A linear layer over FP8 weights with block scales, as one Triton GEMM that dequantizes each weight tile as it
loads it (weight-only FP8: the activations stay in the model's dtype; `kernels.fp8_gemm` says what is computed).

    out[m, n] = sum over k of x[m, k] x W[n, k]  (+ bias[n]),   W = round_dtype(float32(Q) x S[block])

One program computes a BLOCK_M x BLOCK_N tile of out, stepping over K in BLOCK_K tiles: the FP8 tile of Q is loaded
(one byte an element: half a bfloat16 weight's traffic, which is what a decode step's time goes by), widened to
float32, multiplied by its scales, rounded to x's dtype and handed to `tl.dot` with float32 accumulation, as the
unquantized layer's product takes a bfloat16 weight. When BLOCK_K divides the scale block's columns
(`SCALE_COLUMN_TILE`: DeepSeek's and Qwen's 128-column blocks, a scale an output row) a tile's scales are one per
output row, loaded as one [BLOCK_N] vector; otherwise each element's scale is gathered.

Any N and K (tiles masked at the edges); x [M, K] with unit stride along K; Q [N, K] and S [ceil(N / rows),
ceil(K / columns)] as the layer holds them. The output is rounded once to x's dtype. FP8 loads need Triton's e4m3
type: a GPU of compute capability 8.9 or newer, or the interpreter (TRITON_INTERPRET=1), where the tests run it.
The same kernel reads integer weights (`CODE_BITS`: two 4-bit codes a byte or an 8-bit code a byte, scales in blocks
of one row and a group of inputs: `kernels.triton_int4_gemm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import FP8_WEIGHT_DTYPE, scale_grid
from kernels.triton_prefill import INTERPRETED, dot_dtype

__all__ = ["dequantize_tile", "dequantizing_linear", "fp8_linear", "fp8_linear_tiles"]


@triton.jit
def dequantize_tile(w, s, DTYPE: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """An FP8 weight tile (loaded, widened to float32) times its scales, rounded to DTYPE (the activations') to
    nearest even, as the model's dtype holds the dequantized weight. BF16_BY_BITS: rounded by its bits first (the
    interpreter's own conversion to bfloat16 truncates); a GPU's conversion rounds to nearest even itself."""
    w = w * s
    if BF16_BY_BITS:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        w = bits.to(tl.float32, bitcast=True)
    return w.to(DTYPE)


@triton.jit(do_not_specialize=["M"])   # one compiled variant whatever a step's row count
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, scale_rows, scale_cols,
    stride_xm, stride_wn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, SCALE_COLUMN_TILE: tl.constexpr, CODE_BITS: tl.constexpr, ZEROS: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): neighbouring programs share x's rows, each reads its own weights.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn            # [1, BLOCK_N]: Q read as [BLOCK_K, BLOCK_N]
    s_off = (offs_n // scale_rows)[None, :].to(tl.int64) * stride_sn   # INT4 zero points lie as the scales do
    x_base = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        if SCALE_COLUMN_TILE:   # the tile lies in one column of scale blocks
            s_at, s_mask = s_off + k0 // scale_cols, mask_n[None, :]
        else:
            s_at, s_mask = s_off + (ks // scale_cols)[:, None], mask_k[:, None] & mask_n[None, :]
        s = tl.load(s_ptr + s_at, mask=s_mask, other=0.0)
        if CODE_BITS:   # the input's code: its byte, or its nibble (the low one first); less its zero point
            if CODE_BITS == 8:
                w = tl.load(w_base + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0).to(tl.float32)
            else:
                byte = tl.load(w_base + (ks // 2)[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
                w = ((byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 15).to(tl.float32)
            if ZEROS:
                w = w - tl.load(z_ptr + s_at, mask=s_mask, other=0).to(tl.float32)
            else:
                w = w - (1 << (CODE_BITS - 1))
        else:
            w = tl.load(w_base + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        w = dequantize_tile(w, s.to(tl.float32), x_ptr.dtype.element_ty, BF16_BY_BITS)
        x = tl.load(x_base + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_linear_tiles(num_rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for x [num_rows, k] times a weight [n, k]: 16 rows (a dot's least)
    while a step decodes a few tokens, where the weight's bytes are the time and narrow N tiles spread them over
    many programs; 64 x 128 tiles for prefill's many rows."""
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    if num_rows <= 16:
        return 16, min(64, max(16, triton.next_power_of_2(n))), block_k, 4
    block_m = 32 if num_rows <= 32 else 64
    return block_m, min(128, max(16, triton.next_power_of_2(n))), min(64, block_k), 4 if block_m < 64 else 8


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ W^T (+ bias [N]) -> [..., N] in x's dtype, W the dequantized
    weight [N, K] float8_e4m3fn times `scale` in blocks of `block` (`kernels.fp8_gemm`)."""
    n, k = weight.shape
    assert weight.dtype == FP8_WEIGHT_DTYPE and weight.stride(1) == 1, f"weight {weight.dtype} {tuple(weight.shape)}"
    assert tuple(scale.shape) == scale_grid((n, k), block) and scale.dtype == torch.float32 and scale.stride(1) == 1, \
        f"scale {scale.dtype} {tuple(scale.shape)} for weight {(n, k)} in blocks of {block}"
    return dequantizing_linear(x, weight, scale, min(block[0], n), min(block[1], k), k, bias)


def dequantizing_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int, scale_cols: int,
                        k: int, bias: torch.Tensor | None = None, zeros: torch.Tensor | None = None,
                        bits: int = 4) -> torch.Tensor:
    """x [..., k] @ W^T (+ bias) in x's dtype, W [N, k] held as `weight` (FP8 values, or integer codes of `bits`:
    uint8 [N, k x bits / 8], two 4-bit codes a byte or one of 8, less `zeros` where given, laid out as `scale`, else
    2^(bits - 1)) times `scale`, one a block of `scale_rows` x `scale_cols` (each at most its axis)."""
    n = weight.shape[0]
    assert x.shape[-1] == k, f"x {tuple(x.shape)} against weight {(n, k)}"
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1), f"bias {tuple(bias.shape)}"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], n)
    block_m, block_n, block_k, num_warps = fp8_linear_tiles(rows.shape[0], n, k)
    dtype = dot_dtype(x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows.shape[0], block_m))
    _fp8_linear_kernel[grid](
        rows, weight, scale, zeros if zeros is not None else scale, bias if bias is not None else out, out,
        rows.shape[0], n, k, scale_rows, scale_cols,
        rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SCALE_COLUMN_TILE=scale_cols % block_k == 0 or scale_cols >= k,
        CODE_BITS=bits if weight.dtype == torch.uint8 else 0, ZEROS=zeros is not None,
        BF16_BY_BITS=INTERPRETED and x.dtype == torch.bfloat16,
        DOT_DTYPE=dtype, DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out.view(*x.shape[:-1], n)
