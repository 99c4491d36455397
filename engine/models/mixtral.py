"""Mixtral (`MixtralForCausalLM`): Mistral's attention, and on every layer a mixture of experts.

The experts are Qwen3-MoE's `SparseMoeBlock` (router, grouped matmuls or the Triton kernels, tensor-parallel
cuts), read with Mixtral's config (`engine.model_families.mixtral_fields`: the top k always renormalised and
kept in float32, as transformers' `MixtralTopKRouter` leaves them) and its checkpoints' names: a layer's
`block_sparse_moe.gate` is the router, `block_sparse_moe.experts.{e}.w1 / w3 / w2` an expert's gate, up and
down projections. A checkpoint in transformers 5's own fused layout (`mlp.experts.gate_up_proj`, written with
`save_original_format=False`) is refused by name, as Qwen3-MoE's is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["MixtralForCausalLM"]

_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Mixtral as Qwen3-MoE's model without q/k norms (the config says so), its tensors renamed."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`layers.3.block_sparse_moe.experts.5.w1.weight` read as `layers.3.mlp.experts.5.gate_proj.weight` (and
        the router `...block_sparse_moe.gate.weight` as `...mlp.gate.weight`); any other name as it is."""
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.", 1)
            head, sep, rest = name.partition(".mlp.experts.")
            expert, _, proj = rest.partition(".")
            weight, _, suffix = proj.partition(".")
            if sep and weight in _PROJECTIONS:
                name = f"{head}.mlp.experts.{expert}.{_PROJECTIONS[weight]}.{suffix}"
        return ((name, tensor),)
