"""Reflection's Beam (`BeamForCausalLM`; its config: `engine.beam_config`): Qwen3's attention (per-head q/k norms) with
each output channel times sigmoid(`gate_proj` of the layer's input plus a bias a head) before o_proj; sliding layers
that rotate, full ones NoPE with each query scaled by (1 + (p + 1) / 2048)^0.1 at its position p (`QueryScale`, in
the rotary's place); four norms a layer (each sublayer's input and output); each sublayer's output joined to the
residual stream by depth, the k-th join (k = 2 (layer + 1) for attention, one more for the MLP) out x 1/sqrt(k) +
residual x sqrt((k - 1) / k) (`BeamLayer`); DeepSeek V3's grouped sigmoid experts past the dense first layers, no
shared expert. Tensor parallelism: each rank its heads' gate rows and biases, the rest as Qwen3-MoE's."""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from engine.layers import HeadRMSNorm, RMSNorm, RopeRows, RotaryEmbedding
from engine.model import MLP, Attention
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["BeamForCausalLM"]


class QueryScale(nn.Module):
    """The rotary's place on Beam's NoPE layers: nothing turned, each of this rank's `num_heads` query heads scaled by
    exp(0.1 log1p((p + 1) / 2048)) at its position p (float32, rounded once to the query's dtype), the keys left."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.exp(0.1 * torch.log1p((positions.float() + 1.0) / 2048.0))[:, None, None]

    def forward(self, query_key: torch.Tensor, rows: torch.Tensor) -> None:
        query_key[:, :self.num_heads] = (query_key[:, :self.num_heads].float() * rows).to(query_key.dtype)


class BeamAttention(Attention):
    """Qwen3's attention with each head's output gated per channel (the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: nn.Module,
                 layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer, HeadRMSNorm)
        self.gate_proj = nn.Linear(config.hidden_size, self.q_size, bias=False)
        self.gate_bias = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        qkv = self.qkv_proj(hidden).view(-1, heads + 2 * kv_heads, d)
        self.position_qk(qkv, rope_rows)
        out = self.attend(*qkv.split([heads, kv_heads, kv_heads], dim=1), kv_cache, meta, backend)
        gate = self.gate_proj(hidden).view(-1, heads, d) + self.gate_bias[None, :, None]
        return self.comm.all_reduce(self.o_proj((out * torch.sigmoid(gate)).reshape(-1, self.q_size)))


class BeamLayer(nn.Module):
    """Attention, then the MLP (or the experts), each between its two norms and joined to the stream by depth."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: nn.Module,
                 ops: ModuleType, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps, ops), RMSNorm(h, eps, ops)
        self.self_attn = BeamAttention(config, shard, comm, rotary_emb, layer)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps, ops), RMSNorm(h, eps, ops)
        self.mlp = MLP(config, shard, comm, ops)
        k = 2 * (layer + 1)
        self.joins = [(1 / math.sqrt(j), math.sqrt((j - 1) / j)) for j in (k, k + 1)]

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        (a, b), (c, e) = self.joins
        out = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope_rows, kv_cache, meta,
                                                           backend))
        hidden = out * a + hidden * b
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))) * c + hidden * e


class BeamForCausalLM(Qwen3MoeForCausalLM):
    """Beam (the module docstring): `BeamLayer`s, DeepSeek V3's experts past the dense first layers."""

    moe_block = DeepseekMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        rotates = not self.config.no_rope_layers or self.config.no_rope_layers[index]
        if not rotates and not hasattr(self, "query_scale"):
            self.query_scale = QueryScale(self.shard.num_heads)
        rotary: RotaryEmbedding | QueryScale = self.rotary_emb if rotates else self.query_scale
        return with_experts(self, BeamLayer(self.config, self.shard, self.comm, rotary, ops, index), index, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        hidden, rows = self.embed(input_ids), {}
        for layer, kv_cache in zip(self.layers, kv_caches):
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in rows:
                rows[id(rotary)] = rotary.rows(positions)
            hidden = layer(hidden, rows[id(rotary)], kv_cache, meta, backend)
        return self.norm(hidden)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads' rows of the attention's gate and their biases; the rest as Qwen3-MoE's."""
        shard, d = self.shard, self.config.head_dim
        if shard.size > 1 and name.endswith(("self_attn.gate_proj.weight", "self_attn.gate_bias")):
            return shard.heads_of(tensor, 1 if name.endswith("gate_bias") else d)
        return super()._shard_of(hf_name, name, tensor)
