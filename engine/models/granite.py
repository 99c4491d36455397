"""Granite (`GraniteForCausalLM`, IBM's Granite 3): the Llama layer and four scalars (`engine.model_families.
granite_fields`): the embeddings times `embedding_multiplier`, q.k times `attention_multiplier` (the config's
`attention_scale`), each sublayer's output times `residual_multiplier` before it joins the residual stream
(`GraniteDecoderLayer`: the product first, then the add the next norm fuses, transformers' order), and the logits
over `logits_scaling` (`LlamaForCausalLM.compute_logits`). On the CPU backend the flat loop (`engine.cpu_forward`)
runs it, the residual multiplier applied there the same way.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.layers import RopeRows
from engine.model import DecoderLayer, LlamaForCausalLM
from kernels import AttentionMetadata

__all__ = ["GraniteForCausalLM"]


class GraniteDecoderLayer(DecoderLayer):
    """The Llama block, each sublayer's output scaled by `residual_multiplier` before the residual add."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.self_attn.config.residual_multiplier
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope_rows, kv_cache, meta, backend) * scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * scale, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """The Llama model with Granite's layers and scaled embeddings (see the module docstring)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return GraniteDecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier
