"""A linear layer over INT4 or INT8 weights held as a checkpoint packs them (weight-only, W4A16 and W8A16), as one
Triton GEMM that decodes each weight tile as it loads it:

    out[m, n] = sum over k of x[m, k] x W[n, k]  (+ bias[n]),   W[n, k] = round_dtype((code[n, k] - Z) x S[n, k // G])

W is held as bytes [N, K / 2], two 4-bit codes a byte (input 2j in the low nibble, 2j + 1 in the high one; each code
the signed value plus 8), or [N, K], an 8-bit code a byte (the signed value plus 128), and scales S [N, K / G] in the
model's dtype, one per group of G inputs of a row, Z 8 (128) or,
where the checkpoint stores zero points (AWQ's), Z[n, k // G] uint8 [N, K / G] beside the scales: what
`engine.int4_weights.dequantize_int4` computes, value for value (the product in float32, rounded once to x's dtype),
so the layer computes what the same layer over the dequantized weight computes, up to the order of its sums. A tile
reads half a byte (a byte) a weight plus its group's scale: a quarter (half) of a bfloat16 weight's traffic, which is
what a decode step's time goes by.

It is the FP8 GEMM's kernel (`kernels.triton_fp8_gemm`: its tiles, their order, and each tile dequantized as it
is loaded) reading codes instead of FP8 values, the scales in blocks of one row and a group. Any N, K even and a
whole number of groups (a row's scale: one group of K); x [M, K] with unit stride along K. Runs on a GPU, or on the
CPU under the interpreter (TRITON_INTERPRET=1), where the tests run it.
"""

from __future__ import annotations

import torch

from kernels.triton_fp8_gemm import dequantizing_linear

__all__ = ["int4_linear"]


def int4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                zeros: torch.Tensor | None = None, bits: int = 4) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ W^T (+ bias [N]) -> [..., N] in x's dtype, W the integer weight
    of `bits` (4 or 8) held as `blocks` [N, K x bits / 8] uint8, `scales` [N, K / G] (G, the group, from their
    shapes) and `zeros` (uint8, as the scales; None: 2^(bits - 1))."""
    assert bits in (4, 8), f"{bits}-bit codes"
    n, width = blocks.shape
    k = width * 8 // bits
    assert blocks.dtype == torch.uint8 and blocks.stride(1) == 1, f"blocks {blocks.dtype} {tuple(blocks.shape)}"
    assert scales.dim() == 2 and scales.shape[0] == n and scales.shape[1] and k % scales.shape[1] == 0 \
        and scales.stride(1) == 1, f"scales {tuple(scales.shape)} for a weight of {(n, k)}"
    assert zeros is None or zeros.dtype == torch.uint8 and zeros.shape == scales.shape \
        and zeros.stride() == scales.stride(), f"zeros {zeros.dtype} {tuple(zeros.shape)} beside the scales"
    return dequantizing_linear(x, blocks, scales, 1, k // scales.shape[1], k, bias, zeros, bits)
