"""Microsoft's Phi (`PhiForCausalLM`: phi-1, phi-1.5, phi-2): a parallel layer (Cohere's: one norm feeds both the
attention and the MLP, x + attention + MLP) whose norm is a LayerNorm (a weight and a bias: `BiasLayerNorm`, the final
`final_layernorm` too), every projection biased (q/k/v and `dense`, o_proj's place), an MLP without a gate (`fc1`,
GELU-tanh: transformers' `gelu_new`, `fc2`: `ApertusMLP`), the first `partial_rotary_factor` of each head turned with
rotate-half pairs (q/k rows reordered as read: `partial_rotary_rows`) and a biased head (`ModelConfig.lm_head_bias`,
cut with the head's rows under tensor parallelism). The module path runs it."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.models.apertus import GeluTanh, Starcoder2ForCausalLM
from engine.models.gpt_neox import ungated_layer
from engine.models.phi3 import partial_rotary_rows

__all__ = ["PhiForCausalLM"]

# the checkpoint's names -> the model's (before Starcoder2's reading: fc1 as its up_proj)
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
            (".mlp.fc2.", ".mlp.down_proj."), ("final_layernorm.", "norm."))


class PhiForCausalLM(Starcoder2ForCausalLM):
    """Phi (see the module docstring): StarCoder2's norms, MLP and reading on Cohere's parallel layer
    (`ungated_layer`: the config's layer is parallel with one norm)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return ungated_layer(self, index, ops, GeluTanh())

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours) if theirs.startswith(".") or name.startswith(theirs) else name
        return super().read_tensor(hf_name, name, partial_rotary_rows(self.config, name, tensor))
