"""Ministral 3 (`Ministral3ForCausalLM`; the text model of Mistral 3's multimodal checkpoints from December 2025 on,
`Mistral3ForConditionalGeneration` with a `ministral3` text_config): Mistral's layer, YaRN by default, and after the
rotary every query times 1 + beta x log(1 + floor(p / original_max_position_embeddings)) at its position p, beta the
rope's `llama_4_scaling_beta` (Llama 4's attention scaling, on every layer here): `Ministral3Rotary`, the scale
computed once a step beside the rotary's rows and rounded to the query's dtype before the product, as transformers'
`get_llama_4_attn_scale`. The module path runs it (the CPU's flat loop turns q and k without the scale).
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.layers import RopeRows, RotaryEmbedding
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig

__all__ = ["Ministral3ForCausalLM", "Ministral3Rotary"]


class Ministral3Rotary(RotaryEmbedding):
    """The rotary of every layer, then each of this rank's `num_heads` query heads scaled by its position's
    1 + beta x log(1 + floor(p / original)); the keys only turned."""

    def __init__(self, config: ModelConfig, ops: ModuleType, num_heads: int) -> None:
        super().__init__(config, ops)
        self.num_heads, self.beta = num_heads, config.llama4_scaling_beta
        self.original = config.rope_scaling.original_max_position_embeddings

    def rows(self, positions: torch.Tensor) -> tuple[RopeRows, torch.Tensor]:
        """The rotary's rows and each token's query scale ([num_tokens, 1, 1], float32)."""
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original))
        return super().rows(positions), scale[:, None, None]

    def forward(self, query_key: torch.Tensor, rows: tuple[RopeRows, torch.Tensor]) -> None:
        rope_rows, scale = rows
        super().forward(query_key, rope_rows)
        query = query_key[:, :self.num_heads]
        query.mul_(scale.to(query.dtype))


class Ministral3ForCausalLM(LlamaForCausalLM):
    """The Llama model with Ministral 3's query scaling (see the module docstring)."""

    supports_flat_forward = False

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        if self.config.llama4_scaling_beta is None:
            return super().make_rotary(ops)
        return Ministral3Rotary(self.config, ops, self.shard.num_heads)
