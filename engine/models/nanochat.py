"""Karpathy's nanochat (`NanoChatForCausalLM`): the Llama layer whose norms hold no weight (`ParameterlessRMSNorm`,
transformers' `NanoChatRMSNorm`: an RMSNorm in float32, one rounding), the embeddings normed before the first layer,
q and k normed per head after the rotary (`NanoChatAttention`), an ungated MLP of `fc1`, squared ReLU and `fc2` (AFM's)
and the logits soft-capped at `final_logit_softcapping` (15). Its rotary turns each pair the other way (transformers'
`rotate_half` for nanochat: (x2, -x1)): turning the halves of every q and k head swapped is the same rotation with its
halves swapped, so each q and k head's rows are read with their halves swapped (a q.k, and an RMS over a head, do not
see an order applied to both). The module path runs it."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RopeRows
from engine.layers.norm import rms_normed
from engine.model import Attention
from engine.models.apertus import ArceeForCausalLM

__all__ = ["NanoChatAttention", "NanoChatForCausalLM", "ParameterlessRMSNorm"]


class ParameterlessRMSNorm(nn.Module):
    """An RMSNorm without weight, in float32 and rounded once, with the residual add fused as
    `engine.layers.RMSNorm`'s: `forward(x)` -> normed; `forward(x, residual)` -> `(normed, residual)`, the stream
    `x + residual` (in place)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_normed(x, self.eps)
        residual.add_(x)
        return rms_normed(residual, self.eps), residual


class NanoChatAttention(Attention):
    """Llama's attention, q and k turned by the rotary and then each head RMS-normed without a weight."""

    def position_qk(self, qkv: torch.Tensor, rope_rows: RopeRows) -> None:
        qk = qkv[:, :self.num_heads + self.num_kv_heads]
        self.rotary_emb(qk, rope_rows)
        qk.copy_(rms_normed(qk, self.config.rms_norm_eps))


class NanoChatForCausalLM(ArceeForCausalLM):
    """nanochat (see the module docstring): AFM's model (its squared-ReLU MLP) with weightless norms."""

    norm_class = ParameterlessRMSNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = NanoChatAttention(self.config, self.shard, self.comm, self.rotary_emb, index)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return rms_normed(super().embed(input_ids), self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`fc1` / `fc2` as AFM's up_proj / down_proj; q and k rows with each head's halves swapped."""
        name = name.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.", ".mlp.down_proj.")
        d = self.config.head_dim
        if any(f".self_attn.{part}." in name for part in ("q_proj", "k_proj")) and tensor.shape[0] % d == 0:
            heads = tensor.reshape(-1, 2, d // 2, *tensor.shape[1:])
            tensor = heads.flip(1).reshape(tensor.shape)
        return super().read_tensor(hf_name, name, tensor)
