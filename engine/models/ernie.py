"""ERNIE 4.5's dense models (`Ernie4_5ForCausalLM`): the Llama layer, with biases on every projection where
`use_bias` (q/k/v/o and the MLP's) and a rotary that pairs dimensions 2i and 2i + 1 (GPT-J's interleaved form),
served as Cohere's is: each q and k head's rows reordered evens first as the weights are read
(`engine.models.cohere.InterleavedRotaryWeights`), so the engine's rotary rotates the same pairs and q.k is
unchanged. The layer being Llama's, the CPU's flat loop runs it.

Its MoE models (`Ernie4_5_MoeForCausalLM`, ERNIE-4.5-21B-A3B and 300B-A47B): the same attention, and Qwen3-MoE's
experts under DeepSeek's block (`engine.models.deepseek.DeepseekMoeBlock`, router "ernie4_5": the softmax's top k
picked after each expert's correction bias, weighed without it, renormalised) beside ungated shared experts; the
checkpoints' `mlp.moe_statics.e_score_correction_bias` [1, experts] is the router's bias, `mlp.shared_experts` the
shared expert (`engine.model_families.ernie4_5_moe_fields` says which layers are sparse).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.cohere import InterleavedRotaryWeights
from engine.models.deepseek import DeepseekMoeBlock, moe_checkpoint_name
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["Ernie45ForCausalLM", "Ernie45MoeForCausalLM"]


class Ernie45ForCausalLM(InterleavedRotaryWeights):
    """The Llama model with ERNIE 4.5's q/k rows reordered as read (see the module docstring)."""


class Ernie45MoeForCausalLM(InterleavedRotaryWeights, Qwen3MoeForCausalLM):
    """ERNIE 4.5's MoE models (see the module docstring): Qwen3-MoE's model with DeepSeek's block and ERNIE's
    attention, its router's correction bias and shared experts read under our names."""

    moe_block = DeepseekMoeBlock

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The router's correction bias under our name ([1, experts]: one group's; ERNIE 4.5 VL's [2, experts]: the
        text experts' first); ERNIE 4.5 VL's (its text model's tensors: `text_weights_prefix`) text experts alone,
        the first `num_experts` (the vision experts past them, the vision router `gate.weight_1`, skipped), its
        router stored [hidden, experts]."""
        vl = bool(self.config.text_weights_prefix)
        if name.endswith(".mlp.moe_statics.e_score_correction_bias"):
            name, tensor = name.replace(".mlp.moe_statics.", ".mlp.gate.", 1), tensor[0] if vl else tensor.reshape(-1)
        if vl and name.endswith(".mlp.gate.weight_1"):
            return ()
        if vl and name.endswith(".mlp.gate.weight"):
            tensor = tensor.t()
        expert = name.split(".mlp.experts.")[1].split(".")[0] if ".mlp.experts." in name else ""
        if vl and expert.isdigit() and int(expert) >= self.config.num_experts:
            return ()
        return super().read_tensor(hf_name, moe_checkpoint_name(self.config, name) or name, tensor)
