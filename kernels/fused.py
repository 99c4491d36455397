"""The decoder layer's small fused ops in torch: the CPU path and the yardstick for `kernels.triton_fused`.

Both modules have the same functions with the same contracts, and `get_fused_ops(device)` picks one:
the Triton kernels wherever `kernels.get_backend` picks Triton attention (CUDA, or the interpreter
with `CLIFFGUARD_ATTENTION_BACKEND=triton`), this module elsewhere.

- `rms_norm`, `add_rms_norm`: RMSNorm in transformers' order: the statistics in float32, the
  normalised row rounded to the input's dtype, then multiplied by the weight in that dtype;
  `add_rms_norm` first adds the layer's output into the residual stream.
- `rotary_rows`, `rotary`: rotate-half rotary embedding from a `[max_positions, head_dim]` cache
  (each row: the cos of the `head_dim / 2` frequencies, then their sin). `rotary_rows` picks the
  step's rows once per forward, in the form this module's `rotary` takes (an opaque value to the
  caller); `rotary` turns q and k in place.
- `silu_and_mul`: `silu(gate) * up` over the fused gate/up projection's output.

Here each is as few torch operators as the numerics allow (the counts are in the docstrings); the
in-place ones are for inference (`no_grad` or `inference_mode`). `F.rms_norm` is one operator as
called, and on the CPU five kernels (pow, mean, add, rsqrt, mul): torch has no fused CPU kernel for it.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "get_fused_ops", "rms_norm", "rotary", "rotary_rows", "silu_and_mul"]


def get_fused_ops(device: torch.device | str, dtype: torch.dtype | None = None) -> ModuleType:
    """`kernels.triton_fused` where `kernels.get_backend(device)` is the Triton attention backend;
    `kernels.cpu_fused` (our C code) where it is the CPU backend and that code runs `dtype`; this module
    otherwise (`CLIFFGUARD_ATTENTION_BACKEND` decides alike: `torch` keeps every op in torch)."""
    from kernels import get_backend

    backend = get_backend(device)
    if backend is sys.modules.get("kernels.cpu_attention"):
        from kernels import cpu_fused

        return cpu_fused if dtype is not None and cpu_fused.supports(dtype) else sys.modules[__name__]
    if backend is not sys.modules.get("kernels.triton_attention"):
        return sys.modules[__name__]
    from kernels import triton_fused

    return triton_fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden_size], weight: [hidden_size] -> a new [num_tokens, hidden_size].

    Two operators: `F.rms_norm` without a weight (float32 statistics, rounded to x's dtype; torch's own
    weight multiply would run in float32, before the rounding), then the weight, in place."""
    return F.rms_norm(x, (x.shape[-1],), None, eps).mul_(weight)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual: [num_tokens, hidden_size].

    `residual` becomes `x + residual` in place (the sum in x's dtype, as the unfused layer adds) and is
    returned; `x` may be overwritten (the Triton version writes the normalised rows into it)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def rotary_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin_cache: [max_positions, head_dim], positions: [num_tokens] -> (cos [num_tokens, 1, 1, head_dim / 2],
    signed_sin [num_tokens, 1, 2, head_dim / 2], which is (-sin, sin)): shaped once per forward for every
    layer's `rotary` to broadcast (three operators)."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).view(-1, 1, 2, half)
    cos, sin = cos_sin[:, :, :1], cos_sin[:, :, 1:]
    return cos, torch.cat((-sin, sin), dim=2)


def rotary(query_key: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Rotate q and k in place: query_key [num_tokens, num_heads, head_dim] (head_dim contiguous; the
    q and k heads of the qkv projection's output), rows from `rotary_rows`.

    With x = (x1, x2) the two halves of a head: x * (cos, cos) + (x2, x1) * (-sin, sin), which is
    transformers' `x * cos + rotate_half(x) * sin` with the same roundings (a product, a product, their
    sum): four operators, the swapped copy, two multiplies and the add. An `addcmul` would save one and
    round once fewer, an ulp away from transformers, enough to change a bfloat16 greedy path."""
    num_tokens, num_heads, head_dim = query_key.shape
    cos, signed_sin = rows
    x = query_key.view(num_tokens, num_heads, 2, head_dim // 2)
    swapped = x.flip(2).mul_(signed_sin)
    x.mul_(cos).add_(swapped)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * size] (gate, then up) -> silu(gate) * up, a new [num_tokens, size]: two operators,
    silu rounded to x's dtype before the product, as transformers' MLP does."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
