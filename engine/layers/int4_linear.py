"""A linear layer whose weight is held as an integer checkpoint packs it (`engine.int4_weights`): half a byte a weight
(INT4) or a byte (INT8) plus a scale a group, a quarter or half of a bfloat16 weight's bytes in memory and in every
decode step's reads.

`Int4Linear` takes an `nn.Linear`'s place (`swap_int4_linears`, while the model is still on the meta device, before its
parameters are allocated) and holds `blocks` [N, K x bits / 8] uint8 (4 bits: two codes a byte, the low nibble first;
8 bits: a code a byte), `scales` [N, K / group] and the bias, if any, in the model's dtype, and where the checkpoint
stores zero points (AWQ's, an asymmetric scheme's) `zeros` [N, K / group] uint8 (a code's zero; 2^(bits - 1) where
none is held). Loading fills them as it fills a float
weight: a fused projection's parts (q, k and v in qkv_proj) take their rows of both, a row-parallel layer's rank its
columns (whole groups: `engine.models.held_int4`). Where the model runs the Triton kernels (CUDA; the interpreter in the
tests) it runs `kernels.triton_int4_gemm`, which decodes each tile as it loads it; elsewhere the weight is
dequantized on each call and multiplied by `F.linear` (a CPU holds INT4 weights to save memory, not time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.int4_weights import WEIGHT_BITS, dequantize_int4
from engine.layers.fp8_linear import replace_linears

__all__ = ["Int4Linear", "swap_int4_linears"]


class Int4Linear(nn.Module):
    """`y = x W^T + b` over W held as integer codes of `bits` (4 or 8) and a scale for each `group` inputs of a row
    (0: the row's)."""

    # `build_model` allocates them; the scales in the model's dtype
    parameter_dtypes = {"blocks": torch.uint8, "zeros": torch.uint8, "perm": torch.int32}

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int, triton: bool = False,
                 zeros: bool = False, act_order: bool = False, bits: int = 4) -> None:
        super().__init__()
        group = group or in_features
        if in_features % group or bits not in WEIGHT_BITS or in_features * bits % 8:
            raise ValueError(f"an INT{bits} layer of {in_features} inputs in groups of {group}: not whole groups "
                             f"(or bytes), or not 4 or 8 bits")
        self.in_features, self.out_features, self.group, self.bits = in_features, out_features, group, bits
        self.blocks = nn.Parameter(torch.empty(out_features, in_features * bits // 8), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, in_features // group), requires_grad=False)
        self.zeros = nn.Parameter(torch.empty(out_features, in_features // group), requires_grad=False) if zeros \
            else None
        # GPTQ's activation order: the weight's columns sorted by group, x gathered in that order
        self.perm = nn.Parameter(torch.empty(in_features), requires_grad=False) if act_order else None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.triton = triton   # the Triton GEMM (where the model runs the Triton kernels), else dequantized per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.triton:
            from kernels.triton_int4_gemm import int4_linear

            return int4_linear(x, self.blocks, self.scales, self.bias, self.zeros, self.bits)
        return F.linear(x, dequantize_int4(self.blocks, self.scales, x.dtype, self.zeros, bits=self.bits), self.bias)

    def held_bytes(self, scale_dtype: torch.dtype | None = None) -> int:
        """The bytes of its codes (two a byte, or one), scales (in `scale_dtype`, else as held: the meta model a plan
        counts holds them in float32), zero points (a byte each) and input order (the bias not counted: a float layer
        has it too)."""
        extra = (self.zeros.numel() if self.zeros is not None else 0) + (4 * self.perm.numel() if self.act_order else 0)
        return self.blocks.numel() + self.scales.numel() * (scale_dtype or self.scales.dtype).itemsize + extra

    @property
    def act_order(self) -> bool:
        return self.perm is not None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={self.group}, bits={self.bits}, zeros={self.zeros is not None}, act_order={self.act_order}")


def swap_int4_linears(model: nn.Module, names: set[str], group: int, triton: bool = False, zeros: bool = False,
                      act_order: bool = False, bits: int = 4) -> None:
    """Each `nn.Linear` of `model` (on the meta device) whose name is in `names` replaced by an `Int4Linear` of
    `bits` in groups of `group` (0: a row; with zero points where `zeros`, an input order where `act_order`), on the
    Triton GEMM where `triton`."""
    replace_linears(model, names.__contains__, lambda linear: Int4Linear(
        linear.in_features, linear.out_features, linear.bias is not None, group, triton, zeros, act_order, bits))
