"""SiLU x mul over the fused gate/up projection's output."""

from __future__ import annotations

from types import ModuleType

import torch
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
