"""A linear layer whose weight is held in FP8 (float8_e4m3fn) with block scales: half a bfloat16 weight's bytes, in
memory and in every decode step's reads (`kernels.fp8_gemm` says what it computes).

`Fp8Linear` takes an `nn.Linear`'s place (`swap_fp8_linears`, while the model is still on the meta device, before
its parameters are allocated) and holds `weight` [N, K] float8_e4m3fn, `weight_scale` [ceil(N / rows), ceil(K /
columns)] float32 and the bias, if any, in the model's dtype. Loading fills the weight and its scales part by part
(`fill`): a fused projection (q, k and v in qkv_proj) takes each part's rows with their own scales, so a part must
start on a block's first row. `Fp8Experts` fills a mixture-of-experts block's stacked FP8 weights the same way
(`engine.models.qwen3_moe.SparseMoeBlock.hold_fp8`). Where the model runs the Triton kernels (CUDA; the interpreter
in the tests) it runs `kernels.triton_fp8_gemm`; elsewhere the reference, which dequantizes the whole weight on each call (a CPU serves
FP8 weights to save memory, not time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.fp8_gemm import FP8_WEIGHT_DTYPE, fp8_linear, scale_grid

__all__ = ["Fp8Experts", "Fp8Linear", "fill_rows", "replace_linears", "swap_fp8_linears"]


class Fp8Linear(nn.Module):
    """`y = x W^T + b` over W in FP8 with scales in blocks of `block` = (rows, columns), each side at most its
    axis (a scale an output row: (1, in_features))."""

    parameter_dtypes = {"weight": FP8_WEIGHT_DTYPE, "weight_scale": torch.float32}   # `build_model` allocates them

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int],
                 triton: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = (min(block[0], out_features), min(block[1], in_features))
        shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=FP8_WEIGHT_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale_grid(shape, self.block)), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.triton = triton   # the Triton GEMM (where the model runs the Triton kernels), else the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from kernels.triton_fp8_gemm import fp8_linear as triton_fp8_gemm

            return triton_fp8_gemm(x, self.weight, self.weight_scale, self.block, self.bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)

    def fill(self, row: int, values: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows row .. row + len(values) of the weight: FP8 `values` [rows, K] and their scales [rows in blocks,
        K in blocks]. ValueError where the part does not start on a block's first row or its scales do not fit."""
        fill_rows(self.weight, self.weight_scale, self.block, row, values, scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}")


def fill_rows(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int], row: int,
              values: torch.Tensor, scale: torch.Tensor) -> None:
    """Rows row .. row + len(values) of an FP8 `weight` [N, K] and their scales in `weight_scale` (blocks of `block`,
    each side at most its axis): `Fp8Linear.fill`, and `Fp8Experts.fill` over experts' stacked weights."""
    (rows, cols), bn = weight.shape, block[0]
    size = values.shape[0]
    end = row + size
    if row % bn or (end % bn and end != rows) or tuple(values.shape[1:]) != (cols,):
        raise ValueError(f"rows {row}..{end} of a [{rows}, {cols}] FP8 weight in blocks of {bn} rows: a part must "
                         f"cover whole blocks, got {tuple(values.shape)}")
    grid = slice(row // bn, -(-end // bn))
    if tuple(scale.shape) != tuple(weight_scale[grid].shape):
        raise ValueError(f"rows {row}..{end}: scales of shape {tuple(weight_scale[grid].shape)}, got "
                         f"{tuple(scale.shape)}")
    with torch.no_grad():
        weight[row:end].view(torch.uint8).copy_(values.view(torch.uint8))   # CPU: no FP8 copy kernels
        weight_scale[grid].copy_(scale)


class Fp8Experts:
    """A mixture-of-experts block's stacked FP8 weight (`w13` [E, N, K] or `w2`, and its scales `<name>_scale` [E,
    N in blocks, K in blocks]) as loading fills it: the experts' rows one after another, [E x N, K], so an expert's
    part goes at row e x N + its offset (each expert's N a multiple of the block's rows: `fp8_cuts_aligned`). Its
    tensors are looked up on each use: the block's parameters are allocated after this is made."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name

    @property
    def weight(self) -> torch.Tensor:
        stacked = getattr(self.module, self.name)
        return stacked.view(-1, stacked.shape[-1])

    @property
    def weight_scale(self) -> torch.Tensor:
        scale = getattr(self.module, f"{self.name}_scale")
        return scale.view(-1, scale.shape[-1])

    @property
    def in_features(self) -> int:
        return getattr(self.module, self.name).shape[-1]

    @property
    def block(self) -> tuple[int, int]:
        block = self.module.fp8_block
        return min(block[0], getattr(self.module, self.name).shape[1]), min(block[1], self.in_features)

    def fill(self, row: int, values: torch.Tensor, scale: torch.Tensor) -> None:
        fill_rows(self.weight, self.weight_scale, self.block, row, values, scale)


def replace_linears(model: nn.Module, picked: Callable[[str], bool], make: Callable[[nn.Linear], nn.Module]) -> None:
    """Each `nn.Linear` of `model` (on the meta device) whose full name `picked` accepts replaced by `make(it)`."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and picked(f"{name}.{child_name}" if name else child_name):
                setattr(module, child_name, make(child))


def swap_fp8_linears(model: nn.Module, suffixes: tuple[str, ...], block: tuple[int, int],
                     triton: bool = False) -> None:
    """Every `nn.Linear` of `model` (on the meta device) named with one of `suffixes` replaced by an `Fp8Linear`
    in blocks of `block`, on the Triton GEMM where `triton`."""
    replace_linears(model, lambda name: name.endswith(suffixes), lambda linear: Fp8Linear(
        linear.in_features, linear.out_features, linear.bias is not None, block, triton))
