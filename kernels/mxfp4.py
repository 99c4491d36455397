"""MXFP4 weights (the OCP microscaling 4-bit float, as OpenAI's GPT-OSS checkpoints store their experts): e2m1 codes
(a sign, two exponent bits, one mantissa bit) two to a byte, the low nibble the even input, and one e8m0 scale (a
power of two, 2 ** (byte - 127)) per 32 consecutive inputs of a row.

    weight[r, c] = E2M1_VALUES[code[r, c]] x 2 ** (scale[r, c // 32] - 127)

Every such value has at most two significant bits and (but for 4 and 6 times 2 ** 127, infinite) float32's range,
so it is a bfloat16: dequantizing is exact in bfloat16 and float32 alike. Held as stored, a weight costs 4.25 bits
(half a byte and a 32nd of a scale): `packed` [..., rows, columns / 2] and `scales` [..., rows, columns / 32], both
uint8. `dequantize_mxfp4` is the reference the loop over experts and the tests use; `kernels.triton_moe` decodes
each tile in registers the same way.
"""

from __future__ import annotations

import math

import torch

__all__ = ["E2M1_VALUES", "MXFP4_GROUP", "check_mxfp4", "dequantize_mxfp4", "dequantize_packed", "mxfp4_scale"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_RMS = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5   # of uniformly drawn codes: 2.93
MXFP4_GROUP = 32   # inputs a scale covers


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks [..., rows, groups, 16] and scales [..., rows, groups] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., groups, 16] and scales [..., groups], both uint8: got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 weights as `dtype` (bfloat16, float16 or float32): blocks [..., rows, groups, 16] uint8 (two e2m1 codes
    a byte, the low nibble the even column), scales [..., rows, groups] uint8 (e8m0) -> [..., rows, groups x 32].
    Each byte's two values come from a table of 256 pairs (a pair read as one integer of twice its size), times
    their group's power of two, in bfloat16 or float32 (float16's narrower range: in float32, then rounded): exact."""
    check_mxfp4(blocks, scales)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = torch.tensor(E2M1_VALUES, dtype=work, device=blocks.device)
    pairs = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)   # byte -> (low, high) nibble's
    table = pairs.view({2: torch.int32, 4: torch.int64}[work.itemsize]).flatten()      # [256] pairs as integers
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    rows, groups = scales.shape[-2:] if scales.dim() > 1 else (1, scales.shape[-1])
    for part, part_scales, dest in zip(blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups),
                                       out.view(-1, rows, groups, 32)):
        codes = table.index_select(0, part.flatten().int()).view(work).view(rows, groups, 32)
        bits = torch.where(part_scales == 0, 0x400000, part_scales.to(torch.int32) << 23)   # 0: 2 ** -127, subnormal
        product = torch.mul(codes, bits.view(torch.float32).to(work)[..., None],           # times 2 ** (s - 127)
                            out=dest if work == dtype else None)
        if work != dtype:
            dest.copy_(product)
    return out


def dequantize_packed(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A held MXFP4 matrix as `dtype`: packed [..., rows, columns / 2], scales [..., rows, columns / 32]."""
    return dequantize_mxfp4(packed.unflatten(-1, (-1, 16)), scales, dtype)


def mxfp4_scale(std: float) -> int:
    """The e8m0 scale that gives uniformly drawn codes a standard deviation of about `std` (random weights for
    benchmarks of model shapes)."""
    return 127 + round(math.log2(std / E2M1_RMS))
