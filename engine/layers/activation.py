"""The gate activation times up over the fused gate/up projection's output: SiLU (Llama), GELU-tanh (Gemma)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * size] (gate, then up) -> silu(gate) * up: [num_tokens, size], silu rounded to
    x's dtype before the product (transformers' MLP). `ops`: as `RMSNorm`'s."""

    def __init__(self, ops: ModuleType = fused) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)

    def extra_repr(self) -> str:
        return f"ops={self.ops.__name__}"


class GeluTanhAndMul(nn.Module):
    """x: [num_tokens, 2 * size] (gate, then up) -> gelu_tanh(gate) * up: [num_tokens, size] (Gemma's MLP,
    transformers' `gelu_pytorch_tanh` rounded to x's dtype before the product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
