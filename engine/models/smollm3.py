"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama layer, some layers without rotary embeddings (NoPE).

`ModelConfig.no_rope_layers` (`engine.model_families.smollm3_fields`) says which layers rotate q and k: by
default every fourth layer does not (SmolLM3-3B's 3 of 4 with rope). A NoPE layer's attention gets `NoRope`
in place of the model's rotary embedding: no cos/sin rows, q and k left as projected. On the CPU backend
the flat loop (`engine.cpu_forward`) runs it, skipping those layers' rotary call.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.model import LlamaForCausalLM

__all__ = ["NoRope", "SmolLM3ForCausalLM", "layer_rotary"]


class NoRope(nn.Module):
    """A rotary embedding that rotates nothing: the attention of a NoPE layer."""

    def rows(self, positions: torch.Tensor) -> None:
        return None

    def forward(self, query_key: torch.Tensor, rows: None) -> None:
        return None


def layer_rotary(model: LlamaForCausalLM, index: int) -> nn.Module:
    """The rotary embedding of `model`'s layer `index`: the model's, or on a NoPE layer (`no_rope_layers`: SmolLM3's,
    Cohere 2's full layers) the model's one `NoRope`, made with the first NoPE layer."""
    if not model.config.no_rope_layers or model.config.no_rope_layers[index]:
        return model.rotary_emb
    if not hasattr(model, "no_rope"):
        model.no_rope = NoRope()
    return model.no_rope


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """The Llama model with NoPE layers (see the module docstring)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn.rotary_emb = layer_rotary(self, index)
        return layer
