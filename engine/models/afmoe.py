"""Arcee's AFMoE (`AfmoeForCausalLM`: Trinity Nano, Mini, Large): GLM-4's four-norm layer (each sublayer's input
and output normed) whose attention is gated per channel by a sigmoid of its own projection (`gate_proj`, read as
the rows after q, k and v of Qwen3.5's `GatedAttention`), q and k RMS-normed per head, the rotary on sliding layers
only (full layers NoPE); past the first `num_dense_layers` each MLP is Qwen3-MoE's experts beside ungated shared
ones, picked by sigmoid scores of float32 logits plus a float32 expert bias, weighed by their scores renormalised
(past 1e-20) times `route_scale` (`AfmoeMoeBlock`); where `mup_enabled` the embeddings are scaled by
sqrt(hidden_size).

Its checkpoint's names: `post_attention_layernorm` is the attention's output norm, `pre_mlp_layernorm` /
`post_mlp_layernorm` the MLP's (Gemma's `pre_feedforward_layernorm` / `post_feedforward_layernorm`), the router
`mlp.router.gate`, the bias `mlp.expert_bias`, the shared experts `mlp.shared_experts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import HeadRMSNorm
from engine.models.glm4 import Glm4DecoderLayer
from engine.models.lfm2 import Lfm2MoeBlock
from engine.models.qwen3_5 import GatedAttention
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.models.smollm3 import layer_rotary

__all__ = ["AfmoeForCausalLM", "AfmoeMoeBlock", "GateProjRows"]

_RENAMES = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.expert_bias.weight"),
            (".mlp.shared_experts.", ".mlp.shared_expert."), (".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
            (".post_mlp_layernorm.", ".post_feedforward_layernorm."))


class AfmoeMoeBlock(Lfm2MoeBlock):
    """LFM2-MoE's block with AFMoE's router: the logits in float32, the weights renormalised past 1e-20 (always:
    `afmoe_fields` sets `norm_topk_prob`)."""

    float_logits, eps = True, 1e-20


class GateProjRows:
    """A model mixin: attention's `gate_proj` (a sigmoid gate a channel, AFMoE's and Muse Glimmer's) read into the rows
    of `GatedAttention`'s qkv_proj after q, k and v, this rank's heads' rows, cut by heads as q_proj is."""

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        if ".self_attn.gate_proj." not in name:
            return super()._destination(name, hf_name)
        shard, d = self.shard, self.config.head_dim
        start, rows = (shard.num_heads + 2 * shard.num_kv_heads) * d, shard.num_heads * d
        return name.replace(".gate_proj.", ".qkv_proj."), lambda data: data.narrow(0, start, rows)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return super()._shard_of(hf_name, name.replace(".self_attn.gate_proj.", ".self_attn.q_proj."), tensor)


class AfmoeForCausalLM(GateProjRows, Qwen3MoeForCausalLM):
    """AFMoE (see the module docstring)."""

    supports_flat_forward = False
    moe_block = AfmoeMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        rotary = layer_rotary(self, index)   # NoPE on the full layers
        layer = Glm4DecoderLayer(self.config, self.shard, self.comm, rotary, ops, index)
        layer.self_attn = GatedAttention(self.config, self.shard, self.comm, rotary, index, HeadRMSNorm)
        return with_experts(self, layer, index, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (the module docstring), then Qwen3-MoE's reading."""
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().read_tensor(hf_name, name, tensor)
