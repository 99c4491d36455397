"""Linear layers over FP8 weights with block scales, activations in the model's dtype (weight-only FP8, W8A16).

A weight W [N, K] is held as Q, float8_e4m3fn values, and S, float32 scales, one a block of `block` = (rows,
columns) of W: S has shape [ceil(N / rows), ceil(K / columns)], the last blocks may be partial, and a side of
`WHOLE` spans its axis (one scale an output row: block (1, WHOLE); one for the tensor: (WHOLE, WHOLE)). The weight
the layer multiplies by is

    W[n, k] = round_dtype(float32(Q[n, k]) x S[n // rows, k // columns])

(the product in float32, rounded once to the activations' dtype): what dequantizing the checkpoint as it is read
gives, value for value, so a layer over Q and S computes what the same layer over the dequantized weight computes,
up to the order of its sums. The GPU kernel (`kernels.triton_fp8_gemm`) dequantizes each weight tile as it loads
it; the reference here dequantizes the whole weight and calls `F.linear` (what a CPU runs).

`quantize_rows` makes Q and S from a float weight, one scale an output row (each row's largest magnitude maps to
e4m3's largest finite value, 448): how a float checkpoint is served in FP8 (the engine's `quantization: fp8`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import FP8_MAX

__all__ = ["FP8_WEIGHT_DTYPE", "WHOLE", "Fp8Block", "block_scales", "dequantize_blocks", "fp8_linear",
           "quantize_blocks", "quantize_rows", "scale_grid"]

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
WHOLE = 2 ** 31 - 1   # a block side spanning its whole axis (a per-channel or per-tensor scale)
Fp8Block = tuple[int, int]   # (rows, columns) of a weight that share one scale


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a weight of `shape` in blocks of `block`: one a block, partial blocks too."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def block_scales(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """The scales [ceil(N / rows), ceil(K / columns)] spread over the weight's elements: [N, K] float32."""
    rows, cols = shape
    full = scale.float().repeat_interleave(min(block[0], rows), dim=0)[:rows]
    return full.repeat_interleave(min(block[1], cols), dim=1)[:, :cols]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale [ceil(N / rows), ceil(K / columns)] -> the float32 weight: each value
    times its block's scale. A per-channel scale may come as [N], a per-tensor one as [] or [1]. ValueError for
    shapes that do not pair."""
    if weight.dtype != FP8_WEIGHT_DTYPE or weight.dim() != 2:
        raise ValueError(f"an FP8 weight is a float8_e4m3fn matrix, got {weight.dtype} {tuple(weight.shape)}")
    want = scale_grid(tuple(weight.shape), block)
    if scale.dim() < 2 and scale.numel() == want[0] * want[1] and want[1] == 1:
        scale = scale.reshape(want)   # llm-compressor's per-channel [rows] or per-tensor [] / [1]
    if tuple(scale.shape) != want:
        raise ValueError(f"weight {tuple(weight.shape)} in blocks of {_blocks(block)} takes scales of shape {want}, "
                         f"got {tuple(scale.shape)}")
    rows, cols = weight.shape
    bn, bk = min(block[0], rows), min(block[1], cols)
    if rows % bn == 0 and cols % bk == 0:   # whole blocks: each scale broadcast over its block, nothing expanded
        blocks = weight.float().view(rows // bn, bn, cols // bk, bk) * scale.float()[:, None, :, None]
        return blocks.view(rows, cols)
    return weight.float() * block_scales(scale, block, (rows, cols))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as FP8 values and one float32 scale a row ([N, 1]): each row over its largest
    magnitude / 448, rounded to nearest even (a row of zeros: scale 1). Non-finite weights are refused."""
    return quantize_blocks(weight, (1, WHOLE))


def quantize_blocks(weight: torch.Tensor, block: Fp8Block) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as FP8 values and float32 scales in blocks of `block` ([ceil(N / rows), ceil(K /
    columns)], partial blocks too): each block over its largest magnitude / 448, rounded to nearest even (a block
    of zeros: scale 1). Non-finite weights are refused."""
    w = weight.float()
    if not torch.isfinite(w).all():
        raise ValueError("a weight with inf or NaN values cannot be quantized")
    (rows, cols), (bn, bk) = w.shape, (min(block[0], w.shape[0]), min(block[1], w.shape[1]))
    grid = scale_grid((rows, cols), (bn, bk))
    padded = w.new_zeros(grid[0] * bn, grid[1] * bk)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(grid[0], bn, grid[1], bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / block_scales(scale, (bn, bk), (rows, cols))).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized(weight [N, K], scale)^T (+ bias) in x's dtype: the layer as the GPU kernel computes
    it, through `F.linear` over the whole dequantized weight."""
    return F.linear(x, dequantize_blocks(weight, scale, block).to(x.dtype), bias)


def _blocks(block: tuple[int, int]) -> str:
    """A scale block as errors name it: [rows, columns], a side spanning its axis as `all`."""
    return "[" + ", ".join("all" if side == WHOLE else str(side) for side in block) + "]"
