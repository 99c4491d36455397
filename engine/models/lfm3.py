"""Liquid AI's LFM3 (`Lfm3ForCausalLM`; its config: `engine.lfm3_config`): LFM2's stack (`engine.models.lfm2`: gated
short convolutions beside grouped-query attention, SwiGLU MLPs) whose attention layers are sliding or full, each type
turning by its own rope (the sliding layers' default rope, the full layers' proportional one over part of each head),
with q and k normed per head, each head's output scaled by a sigmoid of its own row of `g_proj` over the layer's input
(`GatedAttention(per_head=True)`: the gates' rows after q, k and v in qkv_proj; stored as `self_attn.gate_proj`, which
transformers renames `g_proj` as it loads, either read), and a norm on each sublayer's output
before the residual add (`post_operator_norm`, `post_ffn_norm`: the sandwich norms). Under tensor parallelism each
rank holds its heads' gate rows, as their q rows.

The checkpoint names its parts as LFM2's (`feed_forward.w1` / `w3` / `w2`, `operator_norm`, `ffn_norm`, `conv.`,
`embedding_norm`), its attention as Qwen3's (`q_norm`, `k_norm`, `o_proj`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers.norm import HeadRMSNorm, RMSNorm
from engine.models.gemma4 import proportional_rotary
from engine.models.lfm2 import Lfm2ForCausalLM, Lfm2Layer
from engine.models.qwen3_5 import GatedAttention

__all__ = ["Lfm3ForCausalLM"]

GATES = ".self_attn.gate_proj."   # a row a head


class Lfm3Layer(Lfm2Layer):
    """LFM2's layer with LFM3's head-gated attention (where `ModelConfig.head_gates`) and sandwich norms (where
    `ModelConfig.peri_norms`)."""

    def __init__(self, config, shard, comm, rotary_emb, ops: ModuleType, layer: int, state_index: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops, layer, state_index)
        if config.head_gates and hasattr(self, "self_attn"):
            self.self_attn = GatedAttention(config, shard, comm, rotary_emb, layer, HeadRMSNorm, per_head=True)
        if config.peri_norms:
            self.post_operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.post_ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def output_norm(self, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        if "post_operator_norm" not in self._modules:
            return out
        return (self.post_operator_norm if sublayer == 1 else self.post_ffn_norm)(out)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM3 (see the module docstring): `Lfm3Layer`s, the sliding layers turning by their own rope."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Lfm3Layer(self.config, self.shard, self.comm, proportional_rotary(self, index, ops), ops, index,
                         self.state_index.get(index, -1))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The gates under their stored name (`gate_proj`), whichever they come under; the rest as LFM2's."""
        return super().read_tensor(hf_name, name.replace(".self_attn.g_proj.", GATES), tensor)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The gates into the rows of qkv_proj after q, k and v (a row each of this rank's heads); the rest as
        LFM2's."""
        if GATES not in name:
            return super()._destination(name, hf_name)
        shard = self.shard
        start = (shard.num_heads + 2 * shard.num_kv_heads) * self.config.head_dim
        return name.replace(GATES, ".self_attn.qkv_proj."), lambda data: data.narrow(0, start, shard.num_heads)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The gates' rows of this rank's heads; the rest as LFM2's."""
        if self.shard.size == 1 or GATES not in name:
            return super()._shard_of(hf_name, name, tensor)
        return self.shard.heads_of(tensor)
