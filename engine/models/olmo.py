"""AI2's first OLMo (`OlmoForCausalLM`: OLMo-1B, OLMo-7B and its 0424 / 0724 releases): the Llama layer whose norms
have no weight and no bias (`ParameterlessLayerNorm`: transformers' `OlmoLayerNorm`, mean-centred in float32 with an
epsilon of 1e-5, one rounding), q, k and v clamped to +-`clip_qkv` after their projection where the config sets it
(`OlmoAttention`, before the rotary). The module path runs it."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import Attention, DecoderLayer, LlamaForCausalLM

__all__ = ["OlmoAttention", "OlmoForCausalLM", "ParameterlessLayerNorm"]


class ParameterlessLayerNorm(nn.Module):
    """A LayerNorm without weight or bias, in float32 and rounded once (epsilon 1e-5, whatever the config's), with the
    residual add fused as `engine.layers.RMSNorm`'s: `forward(x)` -> normed; `forward(x, residual)` -> `(normed,
    residual)`, the stream `x + residual` (in place)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.layer_norm(x.float(), (self.hidden_size,), eps=1e-5).to(x.dtype)
        residual.add_(x)
        return F.layer_norm(residual.float(), (self.hidden_size,), eps=1e-5).to(x.dtype), residual


class OlmoAttention(Attention):
    """Llama's attention with q, k and v clamped to +-`clip_qkv` where the config sets it, before the rotary."""

    def norm_qk(self, qkv: torch.Tensor) -> None:
        if self.config.clip_qkv is not None:
            qkv.clamp_(-self.config.clip_qkv, self.config.clip_qkv)


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo (see the module docstring)."""

    supports_flat_forward = False
    norm_class = ParameterlessLayerNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = self.with_own_norms(DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index))
        layer.self_attn = OlmoAttention(self.config, self.shard, self.comm, self.rotary_emb, index)
        return layer
