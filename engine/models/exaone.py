"""EXAONE 3.0, 3.5 and EXAONE Deep (`ExaoneForCausalLM`): the Llama model under EXAONE's own tensor names, which
transformers renames as it loads them (and back as it saves): `transformer.wte`, `transformer.h.N` with `ln_1`,
`attn.attention.{q,k,v,out}_proj`, `ln_2`, `mlp.c_fc_0` (gate), `mlp.c_fc_1` (up), `mlp.c_proj` (down), and
`transformer.ln_f`. Its config.json's own key names are read in `engine.model_defaults.exaone_config`."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from engine.model import LlamaForCausalLM

__all__ = ["ExaoneForCausalLM"]

# (EXAONE's name, the Llama model's), in the order they apply
_RENAMES = tuple((re.compile(theirs), ours) for theirs, ours in (
    (r"^transformer\.wte\.", "embed_tokens."), (r"^transformer\.h\.", "layers."), (r"^transformer\.ln_f\.", "norm."),
    (r"\.attn\.attention\.", ".self_attn."), (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."), (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
    (r"\.mlp\.c_proj\.", ".mlp.down_proj.")))


def exaone_name(name: str) -> str:
    """A checkpoint tensor's EXAONE name as the Llama model's (a name already the Llama model's: itself)."""
    for theirs, ours in _RENAMES:
        name = theirs.sub(ours, name)
    return name


class ExaoneForCausalLM(LlamaForCausalLM):
    """The Llama model reading EXAONE 3's tensor names (see the module docstring)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().read_tensor(hf_name, exaone_name(name), tensor)
