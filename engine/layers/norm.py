"""RMSNorm with the residual add fused into it, vLLM's way of carrying the residual stream."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normed over its last dimension without a weight, in float32 and rounded once to x's dtype (nanochat's
    norms, FalconMamba's norms of dt, B and C)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the statistics in float32, the normalised row rounded to the input's dtype, then
    multiplied by `weight` (transformers' `LlamaRMSNorm`, in its order).

    `forward(x)` -> normed, a new tensor. `forward(x, residual)` -> `(normed, residual)`, where the
    residual stream has become `x + residual`: the decoder layer's add and the next norm in one op. It
    consumes its inputs: `residual` is updated in place, `x` may be overwritten by `normed`.
    `ops`: `kernels.fused` (torch) or `kernels.triton_fused`, from `kernels.fused.get_fused_ops`.
    """

    def __init__(self, hidden_size: int, eps: float, ops: ModuleType = fused) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden_size]
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, ops={self.ops.__name__}"


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head of a [num_tokens, num_heads, head_dim] view, one weight [head_dim] for every
    head, written back in place (Qwen3's q_norm and k_norm, applied before rotary; transformers'
    `Qwen3RMSNorm` order: float32 statistics, rounded to the input's dtype, then the weight)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, heads: torch.Tensor) -> None:
        # heads: [num_tokens, num_heads, head_dim], head_dim contiguous (a slice of the fused qkv)
        heads.copy_(F.rms_norm(heads, (heads.shape[-1],), None, self.eps).mul_(self.weight))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, transformers' `Gemma3RMSNorm` operator for operator: everything in float32, the
    weight as (1 + weight), one rounding to x's dtype at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


class FloatRMSNorm(nn.Module):
    """An RMSNorm in torch ops, its statistics and its weight in float32 and one rounding to x's dtype at the
    end (`norm`: OLMo 2's, transformers' `Olmo2RMSNorm`), with the residual add fused as `RMSNorm`'s:
    `forward(x)` -> normed; `forward(x, residual)` -> `(normed, residual)`, the residual stream `x + residual`
    (added in x's dtype, in place). A subclass changes `norm` and the weight's start (`init`)."""

    init = 1.0

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), self.init))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden_size]
        if residual is None:
            return self.norm(x, self.weight, self.eps)
        residual.add_(x)
        return self.norm(residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(FloatRMSNorm):
    """Gemma's RMSNorm (`_gemma_norm`: scale 1 + weight, so a zero weight is the identity), the residual add
    fused as `FloatRMSNorm`'s."""

    init = 0.0
    norm = staticmethod(_gemma_norm)


class GemmaHeadRMSNorm(HeadRMSNorm):
    """`HeadRMSNorm` with Gemma's norm (Gemma 3's q_norm and k_norm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__(head_dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, heads: torch.Tensor) -> None:
        # heads: [num_tokens, num_heads, head_dim]
        heads.copy_(_gemma_norm(heads, self.weight, self.eps))


class HeadLayerNorm(nn.Module):
    """torch's LayerNorm over each head of a [num_tokens, num_heads, head_dim] view, one weight and one bias
    [head_dim] for every head, written back in place (Persimmon's q_layernorm and k_layernorm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))
        self.eps = eps

    def forward(self, heads: torch.Tensor) -> None:
        heads.copy_(F.layer_norm(heads, (heads.shape[-1],), self.weight, self.bias, self.eps))


class BiasLayerNorm(nn.Module):
    """torch's LayerNorm (mean-centred, a weight and a bias; transformers' `nn.LayerNorm` norms, Jais 2's), with the
    residual add fused as `RMSNorm`'s: `forward(x)` -> normed; `forward(x, residual)` -> `(normed, residual)`, the
    stream `x + residual` (in place)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        residual.add_(x)
        return F.layer_norm(residual, (x.shape[-1],), self.weight, self.bias, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
