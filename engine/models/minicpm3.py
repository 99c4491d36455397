"""OpenBMB's MiniCPM3 (`MiniCPM3ForCausalLM`: MiniCPM3-4B; its fields `engine.deepseek_config.minicpm3_fields`):
DeepSeek V2's model (its latent attention, `MlaAttention`, with the rotary over halves, no experts) under Granite's
layer (`GraniteDecoderLayer`: each sublayer's output times `residual_multiplier`, muP's scale_depth / sqrt(layers)),
the embeddings times `embedding_multiplier` (`scale_emb`) and the logits over `logits_scaling` (hidden /
`dim_model_base`)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.models.deepseek import DeepseekForCausalLM
from engine.models.granite import GraniteDecoderLayer

__all__ = ["MiniCPM3ForCausalLM"]


class MiniCPM3ForCausalLM(DeepseekForCausalLM):
    """MiniCPM3 (see the module docstring)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = GraniteDecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)
        layer.self_attn = self.attention(self.config, self.shard, self.comm, self.rotary_emb, ops)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier
