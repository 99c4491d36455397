"""Qwen3.5's text model (`Qwen3_5ForCausalLM`, and `Qwen3_5ForConditionalGeneration`'s language model): a hybrid of
Gated DeltaNet layers (`engine.layers.gated_delta_net`: linear attention over a per-sequence state) and, every
few layers (`layer_types`), gated full attention over the paged KV cache:
- the full layers' q_proj makes each head's query and a gate side by side; the attention's output is multiplied
  by the gate's sigmoid before o_proj (`GatedAttention`: the gates read into the fused qkv_proj's last rows);
- q and k heads normed (1 + weight) before a rotary over a quarter of each head (`partial_rotary_factor`), pairing
  i with i + rotary_dim / 2 (q and k rows and norm weights reordered as read, `partial_rotary_rows`);
- every norm is Gemma's (1 + weight) but the linear layers' gated output norm;
- the KV cache holds the full layers alone (`ModelConfig.kv_layers`), the states the linear ones.
The module path runs it (no CPU flat loop); a decode step gathers and scatters the states by the rows in its metadata,
on the device, so decode graphs capture it (their padded rows use a padding row of the states).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import GemmaHeadRMSNorm, GemmaRMSNorm, RopeRows, RotaryEmbedding
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.model import MLP, Attention
from engine.model_config import ModelConfig
from engine.models.hybrid import MixerLayerForward, StatefulForCausalLM, cut_pieces
from engine.models.phi3 import partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["GatedAttention", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


class GatedAttention(Attention):
    """Attention whose output is gated per channel: qkv_proj's rows are q, k, v, then the gates (where `per_head`, one
    a head, its channels' gate: LFM3's); each head's output first through `out_norm` where set (Muse Spark's)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 layer: int, head_norm: type[nn.Module] = GemmaHeadRMSNorm, per_head: bool = False) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer, head_norm)
        self.per_head = per_head
        self.out_norm: nn.Module | None = None
        gates = self.num_heads if per_head else self.q_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size + gates,
                                  bias=config.attention_bias)

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        projected = self.qkv_proj(hidden)
        qkv = projected[:, :self.q_size + 2 * self.kv_size].unflatten(-1, (heads + 2 * kv_heads, d))
        self.position_qk(qkv, rope_rows)
        out = self.attend(*qkv.split([heads, kv_heads, kv_heads], dim=1), kv_cache, meta, backend)
        if self.out_norm is not None:
            out = self.out_norm(out.reshape(-1, heads, d))
        gate = torch.sigmoid(projected[:, self.q_size + 2 * self.kv_size:])
        if self.per_head:
            gate = gate.repeat_interleave(d, dim=-1)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size) * gate))


class HybridLayer(MixerLayerForward, nn.Module):
    """A pre-norm block whose token mixer is Gated DeltaNet (`linear_attn`) or `attention` (`self_attn`: Qwen3.5's
    gated attention), its norms `norm`'s (Gemma's 1 + weight)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, layer: int, state_index: int, norm: type[nn.Module] = GemmaRMSNorm,
                 attention: Callable[..., nn.Module] = GatedAttention) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(h, eps)
        if config.is_linear_layer(layer):
            self.linear_attn = GatedDeltaNet(config.gated_delta.per_rank(shard.size), h, eps, state_index, comm)
        else:
            self.self_attn = attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = norm(h, eps)
        self.mlp = MLP(config, shard, comm, ops)


class Qwen3_5ForCausalLM(StatefulForCausalLM):
    """Qwen3.5's text model (see the module docstring): Llama's loading and head, hybrid layers over the states of
    `StatefulForCausalLM`."""

    norm_init = 0.0

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return HybridLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                           self.state_index.get(index, -1))

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return GemmaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """q_proj's rows interleave each head's query and gate: the queries read as q_proj, the gates as `q_gate`
        (qkv_proj's last rows); q and k rows (and their norms' weights) reordered for the partial rotary
        (`partial_rotary_rows`)."""
        if ".self_attn.q_proj." in name:
            parts = tensor.unflatten(0, (-1, 2, self.config.head_dim))
            return ((name, partial_rotary_rows(self.config, name, parts[:, 0].flatten(0, 1))),
                    (name.replace(".q_proj.", ".q_gate."), parts[:, 1].flatten(0, 1)))
        return ((read, partial_rotary_rows(self.config, read, piece))
                for read, piece in super().read_tensor(hf_name, name, tensor))

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The gates into qkv_proj's last rows, the linear layers' four projections into in_proj (this rank's)."""
        c, shard = self.config, self.shard
        q, kv = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim
        if ".self_attn.q_gate." in name:
            return name.replace(".q_gate.", ".qkv_proj."), lambda data: data.narrow(0, q + 2 * kv, q)
        s = c.gated_delta.per_rank(shard.size)
        rows = {"in_proj_qkv": (0, s.conv_dim), "in_proj_z": (s.conv_dim, s.value_dim),
                "in_proj_b": (s.conv_dim + s.value_dim, s.num_v_heads),
                "in_proj_a": (s.conv_dim + s.value_dim + s.num_v_heads, s.num_v_heads)}
        for part, (offset, size) in rows.items():
            if f".linear_attn.{part}." in name:
                return name.replace(part, "in_proj"), lambda data, o=offset, n=size: data.narrow(0, o, n)
        return super()._destination(name, hf_name)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part: the gates as q_proj's rows (its heads); of a linear layer its key heads' q and k and its
        value heads' v, z, b, a, decay parameters and out_proj columns (the gated norm whole)."""
        if self.shard.size == 1:
            return tensor
        if ".self_attn.q_gate." in name:
            return super()._shard_of(hf_name, name.replace(".q_gate.", ".q_proj."), tensor)
        if ".linear_attn." not in name or name.endswith("norm.weight"):
            return super()._shard_of(hf_name, name, tensor)
        s = self.config.gated_delta
        qkv = [(s.key_dim, 0, True), (s.key_dim, s.key_dim, True), (s.value_dim, 2 * s.key_dim, True)]
        heads, values = [(s.num_v_heads, 0, True)], [(s.value_dim, 0, True)]   # (full, offset, split) of each part
        parts = {"in_proj_qkv": (0, qkv), "conv1d": (0, qkv), "in_proj_z": (0, values), "in_proj_b": (0, heads),
                 "in_proj_a": (0, heads), "dt_bias": (0, heads), "A_log": (0, heads), "out_proj": (1, values)}
        dim, pieces = parts[name.split(".linear_attn.")[1].split(".")[0]]
        return cut_pieces(hf_name, tensor, dim, pieces, self.shard.rank, self.shard.size)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights, the norms at the identity: Gemma's (1 + weight) at 0, the gated norms' at 1."""
        super().init_random(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.norm.weight.fill_(1.0)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, Qwen3MoeForCausalLM):
    """Qwen3.5-MoE's text model: Qwen3.5's layers, each MLP Qwen2-MoE's sparse block (`SparseMoeBlock`: routed
    experts beside a gated shared expert), its experts read per expert or stacked (`Qwen3MoeForCausalLM`)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_experts(self, super().make_layer(index, ops), index, ops)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's model (dense MLPs on `mlp_only_layers`), its linear layers' input projections stored
    fused per key head (`in_proj_qkvz`: each key head's q, k, then its value heads' v and z; `in_proj_ba`: its value
    heads' b, then a), read as Qwen3.5's four."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        s = self.config.gated_delta
        per_key = s.num_v_heads // s.num_k_heads
        if ".linear_attn.in_proj_qkvz." in name:
            groups = tensor.unflatten(0, (s.num_k_heads, -1))
            parts = groups.split([s.k_head_dim, s.k_head_dim, per_key * s.v_head_dim, per_key * s.v_head_dim], dim=1)
            return ((name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat([p.flatten(0, 1) for p in parts[:3]])),
                    (name.replace("in_proj_qkvz", "in_proj_z"), parts[3].flatten(0, 1)))
        if ".linear_attn.in_proj_ba." in name:
            b, a = tensor.unflatten(0, (s.num_k_heads, -1)).split([per_key, per_key], dim=1)
            return ((name.replace("in_proj_ba", "in_proj_b"), b.flatten(0, 1)),
                    (name.replace("in_proj_ba", "in_proj_a"), a.flatten(0, 1)))
        return super().read_tensor(hf_name, name, tensor)
