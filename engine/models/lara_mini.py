"""Translated's Lara Mini (`LaraMiniForCausalLM`; its config: `engine.lara_mini_config`): Qwen3.5-MoE's hybrid model
(`Qwen3_5MoeForCausalLM`: Gated DeltaNet layers over a per-sequence state, experts on every layer) whose attention
layers are Qwen3's, plain: no output gate, q and k normed per head, the rotary on the sliding layers alone (the full
layers NoPE: `layer_rotary`); every norm a plain float32 RMSNorm (not Qwen3.5's 1 + weight); the experts under a
float32 softmax router (`LaraMiniMoeBlock`) beside an ungated shared expert. Its checkpoints store a linear layer's
four input projections fused (`linear_attn.in_proj`: q, k, v, z, b, a one after the other, split as read) and its
gated norm as `out_norm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import FloatRMSNorm
from engine.model import Attention, WeightLoadError
from engine.models.kolibri import KolibriRouter
from engine.models.qwen3_5 import HybridLayer, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from engine.models.qwen3_moe import SparseMoeBlock, with_experts
from engine.models.smollm3 import layer_rotary

__all__ = ["LaraMiniForCausalLM"]


class LaraMiniMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts under Lara Mini's router: float32 logits of the float32-widened weight, the top k of their
    softmax, renormalised where `norm_topk_prob`, rounded to the model's dtype (transformers' `LaraMiniTopKRouter`);
    its shared expert ungated."""

    def __init__(self, config, shard, comm, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.gate = KolibriRouter(config.num_experts, config.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return self.renormalised(weights).to(x.dtype), experts


class LaraMiniForCausalLM(Qwen3_5MoeForCausalLM):
    """Lara Mini (see the module docstring)."""

    moe_block = LaraMiniMoeBlock
    norm_init = 1.0

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = HybridLayer(self.config, self.shard, self.comm, layer_rotary(self, index), ops, index,
                            self.state_index.get(index, -1), FloatRMSNorm, Attention)
        return with_experts(self, layer, index, ops)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A linear layer's fused `in_proj` as Qwen3.5's four projections, its `out_norm` as `norm`; the attention's
        q_proj whole (no gates in it); the rest as Qwen3-MoE reads it."""
        name = name.replace(".linear_attn.out_norm.", ".linear_attn.norm.")
        if ".linear_attn.in_proj." in name:
            s = self.config.gated_delta
            sizes = [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]
            if tensor.shape[0] != sum(sizes):
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not q, k, v, z, b and a's "
                                      f"{sum(sizes)} rows")
            return [(name.replace(".in_proj.", f".{part}."), piece) for part, piece in
                    zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), tensor.split(sizes))]
        return super(Qwen3_5ForCausalLM, self).read_tensor(hf_name, name, tensor)
