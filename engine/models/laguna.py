"""Laguna (`LagunaForCausalLM`): Qwen3-MoE's model whose attention is its own a layer and whose experts take a
soft-capped sigmoid router (`engine.laguna_config`).

- `LagunaAttention`: the layer's own count of query heads (`LagunaShape.heads`; the KV heads every layer's, so the
  cache holds one shape), q and k RMS-normed per head before the rotary, and the output gated before o_proj by
  softplus(g_proj(x)), a gate per head (or per channel); under tensor parallelism each rank takes its share of the
  layer's heads and of g_proj's rows.
- The rotary: the full layers' turns the first `partial_rotary_factor` of each head (rotate-half pairs within it,
  q/k rows reordered as read: `partial_rotary_rows`, with the layer's own share), the sliding layers' its own base
  and share (`rope_local_theta`, `LagunaShape.local_rotary_factor`), made once.
- `LagunaMoeBlock`: DeepSeek's experts without groups, the router's logits (in the model's dtype, then float32)
  soft-capped (cap x tanh(logit / cap)) where `moe_router_logit_softcapping` is set, their sigmoid plus the
  correction bias picking the top k, the picked sigmoids renormalised times the routed scaling, beside the shared
  expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import HeadRMSNorm, RopeRows, RotaryEmbedding
from engine.model import Attention
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock, moe_checkpoint_name
from engine.models.phi3 import partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.parallel import Collectives, ShardShape
from engine.rope_config import RopeScaling
from kernels import AttentionMetadata

__all__ = ["LagunaAttention", "LagunaForCausalLM", "LagunaMoeBlock"]


def layer_config(config: ModelConfig, layer: int) -> ModelConfig:
    """`config` as layer `layer`'s attention sees it: its query heads, its share of a head the rotary turns."""
    sliding = config.layer_window(layer) is not None
    return replace(config, num_heads=config.laguna.heads[layer], partial_rotary_factor=(
        config.laguna.local_rotary_factor if sliding else config.partial_rotary_factor))


class LagunaAttention(Attention):
    """The layer's attention in its own shape, its output gated by softplus(g_proj(x)) (the module docstring; Step
    3.7's: the sigmoid, its q/k norms `head_norm`'s)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 layer: int, head_norm: type[HeadRMSNorm] = HeadRMSNorm) -> None:
        own = layer_config(config, layer)
        own_shard = ShardShape.of(own, shard.rank, shard.size)   # this rank's share of the layer's heads
        super().__init__(own, own_shard, comm, rotary_emb, layer, head_norm)
        self.shard = own_shard
        self.per_head = config.laguna.gate_per_head
        self.g_proj = nn.Linear(config.hidden_size, own_shard.num_heads * (1 if self.per_head else own.head_dim),
                                bias=False)

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        qkv = self.qkv_proj(hidden).unflatten(-1, (heads + 2 * kv_heads, d))
        self.position_qk(qkv, rope_rows)
        out = self.attend(*qkv.split([heads, kv_heads, kv_heads], dim=1), kv_cache, meta, backend)
        gate = self.g_proj(hidden)
        gate = gate.sigmoid() if self.config.laguna.sigmoid_gate else F.softplus(gate.float()).to(out.dtype)
        out = out.reshape(-1, heads, d) * gate[..., None] if self.per_head else out.reshape(-1, self.q_size) * gate
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class LagunaMoeBlock(DeepseekMoeBlock):
    """DeepSeek's block with Laguna's router (the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.softcap = config.laguna.router_softcap   # DeepSeek's route caps the logits with it


class LagunaForCausalLM(Qwen3MoeForCausalLM):
    """Laguna (the module docstring): Qwen3-MoE's model and loading with its attention, rotaries and router."""

    supports_flat_forward = False
    moe_block = LagunaMoeBlock
    head_norm: type[HeadRMSNorm] = HeadRMSNorm   # its q/k norms' (Step 3.7's: Gemma's)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = LagunaAttention(self.config, self.shard, self.comm, self._rotary(index, ops), index,
                                          self.head_norm)
        return layer

    def _rotary(self, index: int, ops: ModuleType) -> RotaryEmbedding:
        """The full layers' rotary (the model's), or the sliding layers' own (made with the first of them)."""
        if self.config.layer_window(index) is None:
            return self.rotary_emb
        if "rotary_local" not in self._modules:
            c = self.config
            self.rotary_local = RotaryEmbedding(replace(
                c, rope_theta=c.rope_local_theta or c.rope_theta, rope_scaling=RopeScaling(),
                partial_rotary_factor=c.laguna.local_rotary_factor, max_position_embeddings=c.context_length), ops)
        return self.rotary_local

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The router's bias as the checkpoints store it (`mlp.experts.e_score_correction_bias`, transformers' reading)
        or under DeepSeek's names, the shared expert under Qwen2-MoE's or DeepSeek's; q/k rows reordered for the
        layer's partial rotary; the experts as Qwen3-MoE's."""
        name = moe_checkpoint_name(self.config, name.replace(".mlp.experts.e_score_correction_bias",
                                                             ".mlp.gate.e_score_correction_bias"))
        if name is None:
            return ()
        layer = self.layer_of(name)
        if layer is not None:
            tensor = partial_rotary_rows(layer.self_attn.config, name, tensor)
        return super().read_tensor(hf_name, name, tensor)

    def cut_shape(self, name: str) -> tuple[ShardShape, ModelConfig]:
        """A layer's attention tensors are cut in its own shape (its query heads)."""
        layer = self.layer_of(name)
        if layer is not None and ".self_attn." in name:
            return layer.self_attn.shard, layer.self_attn.config
        return self.shard, self.config

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """g_proj's rows cut by heads (a row or head_dim rows a head); the rest as Qwen3-MoE's."""
        if ".self_attn.g_proj." not in name or self.shard.size == 1:
            return super()._shard_of(hf_name, name, tensor)
        rows = tensor.shape[0] // self.shard.size
        return tensor.narrow(0, self.shard.rank * rows, rows)
