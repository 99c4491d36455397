"""The gate activation times up over the fused gate/up projection's output: SiLU (Llama), GELU-tanh (Gemma), GPT-OSS's
clamped SwiGLU and HY V4's clamped SiLU."""

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


class ClampedSwiGLU(nn.Module):
    """x: [num_tokens, 2 * size] (gate, then up) -> (up + 1) x gate x sigmoid(alpha x gate): [num_tokens, size], the
    gate clamped at `limit` from above and up at +-limit first (GPT-OSS's experts, transformers' `_apply_gate` with
    its interleaved gate/up columns taken apart when the weights are read), in x's dtype throughout."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class SiluClampedAndMul(nn.Module):
    """x: [num_tokens, 2 * size] (gate, then up) -> min(silu(gate), limit) x clamp(up, +-limit): [num_tokens, size]
    (Step 3.7's, transformers' `Step3p7Experts._apply_gate`: the clamp after the SiLU)."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}"


class ClampedSiluAndMul(nn.Module):
    """x: [num_tokens, 2 * size] (gate, then up) -> silu(gate) x up: [num_tokens, size], the gate clamped at `limit`
    from above and up at +-limit first (HY V4's routed experts, transformers' `HYV4Experts._apply_gate`)."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}"
