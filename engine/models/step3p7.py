"""StepFun's Step 3.7 text model (`Step3p7ForConditionalGeneration`'s, served as `Step3p7ForCausalLM`; its config:
`engine.step3p7_config`): Laguna's model (`engine.models.laguna`: the layer type's own query heads and rope, a gate a
head on the attention's output, DeepSeek's experts under a sigmoid router with a correction bias beside a shared
expert) with the gate a sigmoid, Gemma's norms (1 + weight, in float32) on the layers, the output and each q/k head,
and each layer's SwiGLUs clamped after the SiLU where its limits say (`SiluClampedAndMul`: the routed experts by
`swiglu_limits`, the shared expert and a dense MLP by `swiglu_limits_shared`).

The release stores the text model at `model.` beside `vision_model.`, each layer's experts stacked under `moe.`
(`moe.gate_proj.weight` [experts, inter, hidden], `up_proj`, `down_proj`; the router `moe.gate`, its bias
`moe.router_bias`) and the shared expert as `share_expert.`; they are read under Laguna's names, each expert's own.
Its multi-token-prediction layers (past the model's) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import GemmaHeadRMSNorm, GemmaRMSNorm
from engine.layers.activation import SiluClampedAndMul
from engine.model import WeightLoadError
from engine.models.laguna import LagunaForCausalLM

__all__ = ["Step3p7ForCausalLM"]

# the release's names -> Laguna's
_RELEASE = ((".moe.gate.weight", ".mlp.gate.weight"), (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
            (".share_expert.", ".mlp.shared_expert."))
_STACKED = (".moe.gate_proj.weight", ".moe.up_proj.weight", ".moe.down_proj.weight")


class Step3p7ForCausalLM(LagunaForCausalLM):
    """Step 3.7 (the module docstring): Laguna's model with Gemma's norms, a sigmoid gate and clamped SwiGLUs."""

    norm_class = GemmaRMSNorm
    norm_init = 0.0
    head_norm = GemmaHeadRMSNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        shape = self.config.laguna
        experts, mlp = shape.expert_limits[index], shape.mlp_limits[index]
        if self.config.is_sparse_layer(index):
            if experts:
                layer.mlp.act_fn = SiluClampedAndMul(experts)
            if mlp and layer.mlp.shared_expert is not None:
                layer.mlp.shared_expert.act_fn = SiluClampedAndMul(mlp)
        elif mlp:
            layer.mlp.act_fn = SiluClampedAndMul(mlp)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's names as Laguna's (`_RELEASE`), its stacked experts ([experts, out, in]) as each expert's;
        then Laguna's reading."""
        for theirs, ours in _RELEASE:
            name = name.replace(theirs, ours)
        stacked = next((suffix for suffix in _STACKED if name.endswith(suffix)), None)
        if stacked is None:
            return super().read_tensor(hf_name, name, tensor)
        if tensor.dim() != 3 or tensor.shape[0] != self.config.num_experts:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not {self.config.num_experts} experts' "
                                  "weights")
        head, proj = name.removesuffix(stacked), stacked.split(".")[2]
        pieces = []
        for e in range(tensor.shape[0]):   # a loop: super() without arguments fails in a comprehension
            pieces += super().read_tensor(hf_name, f"{head}.mlp.experts.{e}.{proj}.weight", tensor[e])
        return pieces
