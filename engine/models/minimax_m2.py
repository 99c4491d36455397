"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): Mixtral's model and checkpoint names, every layer a mixture of experts, with

- q and k each normed over the whole projection before rotary (OLMo 2's `Olmo2Attention`, its norms in
  transformers' Llama order: `RoundedWideRMSNorm`; under tensor parallelism their sums of squares over the ranks);
- the first `rotary_dim` dimensions of each head rotated with rotate-half pairs (i with i + rotary_dim / 2), served
  as GLM-4.5's: the passed dimensions moved between the rotated halves as the q/k rows and norm weights are read
  (`partial_rotary_rows`);
- DeepSeek V3's picks without groups: sigmoid scores plus the block's `e_score_correction_bias` choose the top k,
  their scores renormalised weigh them (in float32), the router in the model's dtype as transformers runs it
  (`DeepseekMoeBlock` with the `minimax_m2` router).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.models.deepseek import DeepseekMoeBlock
from engine.models.phi3 import partial_rotary_rows
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import Olmo2Attention, RoundedWideRMSNorm, wide_norm_shard

__all__ = ["MiniMaxM2ForCausalLM"]


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """Mixtral's model with MiniMax-M2's attention and router (see the module docstring)."""

    moe_block = DeepseekMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = Olmo2Attention(self.config, self.shard, self.comm, self.rotary_emb, index,
                                         RoundedWideRMSNorm)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Mixtral's names, the block's correction bias as its router's, q/k rows reordered for the partial rotary."""
        for read, piece in super().read_tensor(hf_name, name, tensor):
            if read.endswith(".mlp.e_score_correction_bias"):
                read = read.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            yield read, partial_rotary_rows(self.config, read, piece)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.shard.size > 1 and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return wide_norm_shard(self.config, self.shard, hf_name, name, tensor)
        return super()._shard_of(hf_name, name, tensor)
