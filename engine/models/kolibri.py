"""Aleph Alpha's Kolibri-1 (`Kolibri1ForCausalLM`; its config: `engine.kolibri_config`): GLM-4's four-norm layer
(`Glm4DecoderLayer`: each sublayer's input and output normed) whose attention is EXAONE 4's (q and k RMS-normed per
head; the rotary on the sliding layers only, the full ones NoPE), and on every layer Qwen3-MoE's experts beside an
ungated shared expert, picked by `KolibriMoeBlock`'s router.

The checkpoint's names: the router `mlp.gate` with its float32 bias `mlp.gate.e_score_correction_bias` (as
transformers holds it; `moe.router.expert_bias` as the release stores it), the shared expert `mlp.shared_experts`,
the norms GLM-4's (`post_self_attn_layernorm` or the release's `post_attn_norm` on the attention's output,
`post_attention_layernorm` before the MLP, `post_mlp_layernorm` or `post_ffn_norm` after it).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.glm4 import NORM_NAMES, Glm4DecoderLayer
from engine.models.lfm2 import Lfm2MoeBlock
from engine.layers import FloatRMSNorm
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, with_experts
from engine.models.smollm3 import layer_rotary

__all__ = ["FlintForCausalLM", "FlintMoeBlock", "KolibriForCausalLM", "KolibriMoeBlock"]

_RENAMES = ((".mlp.gate.e_score_correction_bias", ".mlp.expert_bias.weight"),
            (".moe.router.expert_bias", ".mlp.expert_bias.weight"), (".mlp.shared_experts.", ".mlp.shared_expert."),
            (".post_attn_norm.", ".post_self_attn_layernorm."), (".post_ffn_norm.", ".post_mlp_layernorm."))


class KolibriRouter(nn.Module):
    """The router's weight [num_experts, hidden] in the model's dtype (in float32 where `float32_parameters`: Flint's,
    as transformers keeps it), a plain parameter (no linear layer a backend would swap: its product is float32's)."""

    def __init__(self, num_experts: int, hidden_size: int, float32: bool = False) -> None:
        super().__init__()
        self.float32_parameters = float32   # `engine.models.build_model` allocates it so
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class KolibriMoeBlock(Lfm2MoeBlock):
    """Qwen3-MoE's experts with Kolibri-1's router: float32 logits (of the weight as held, both sides widened), the top
    k of the logits plus the float32 expert bias, weighed by the sigmoid of their logits, renormalised where
    `norm_topk_prob` (no epsilon), in float32, as transformers' `Kolibri1TopKRouter`."""

    def __init__(self, config, shard, comm, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.gate = KolibriRouter(config.num_experts, config.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())                   # [num_tokens, num_experts]
        experts = torch.topk(logits + self.expert_bias.weight, k=self.top_k, dim=-1)[1]
        return self.renormalised(logits.gather(1, experts).sigmoid()), experts


class KolibriForCausalLM(Qwen3MoeForCausalLM):
    """Kolibri-1 (see the module docstring)."""

    supports_flat_forward = False
    moe_block = KolibriMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = Glm4DecoderLayer(self.config, self.shard, self.comm, layer_rotary(self, index), ops, index)
        return with_experts(self, layer, index, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (the module docstring), then Qwen3-MoE's reading."""
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        name = ".".join(NORM_NAMES.get(part, part) for part in name.split("."))
        return super().read_tensor(hf_name, name, tensor)


class FlintMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts with Flint's router: float32 logits of a float32 weight, the top k of their sigmoid (no
    bias), renormalised where `norm_topk_prob` (no epsilon), in float32, as transformers' `FlintTopKRouter`; its shared
    expert ungated."""

    def __init__(self, config, shard, comm, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.gate = KolibriRouter(config.num_experts, config.hidden_size, float32=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = torch.topk(F.linear(x.float(), self.gate.weight.float()).sigmoid(), self.top_k, dim=-1)
        return self.renormalised(weights), experts


class FlintForCausalLM(Qwen3MoeForCausalLM):
    """RecursiveSI's Flint (`engine.flint_config`): Qwen3-MoE's model with GPT-OSS's float32 norms and attention
    sinks (held in float32, as transformers keeps them; read from the release's `self_attn.softmax_offset` too), the
    rotary on the sliding layers alone, and `FlintMoeBlock`s."""

    supports_flat_forward = False
    moe_block = FlintMoeBlock
    norm_class = FloatRMSNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn.rotary_emb = layer_rotary(self, index)
        layer.self_attn.parameter_dtypes = {"sinks": torch.float32}   # as transformers keeps them
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().read_tensor(hf_name, name.replace(".self_attn.softmax_offset", ".self_attn.sinks"), tensor)
