"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, config: `engine.mimo_config`): Qwen3-MoE's model with DeepSeek V3's router
and no shared expert, its first layer's MLP dense, and attention of two shapes.

- sliding layers (a window of 129 positions, the query's included) and full ones, each type its rotary (the sliding
  layers' base apart) turning the first third of each head with rotate-half pairs, served as GLM-4.5's (the q/k rows
  reordered as they are read: `partial_rotary_rows`);
- a sliding layer has twice a full layer's KV heads and a learned sink logit per query head in its softmax's
  denominator (GPT-OSS's `Attention.sinks`); its K/V lie in a cache tensor of their own shape (`engine.kv_cache`);
- q/k heads of `head_dim` (192), value heads of `v_head_dim` (128) times `value_scale`: each V is stored zero-padded to
  a q/k head (the kernels take one head size) and attention's output past `v_head_dim` is dropped before o_proj;
- q/k/v biased where `attention_bias`, o_proj never.
Under tensor parallelism each layer's attention is cut in its own shape (`cut_shape`), V's rows and o_proj's columns
in value heads, the sinks by query head, the experts along their intermediate size. The multi-token-prediction
layers its checkpoints keep (`model.mtp.`) are skipped, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RopeRows, RotaryEmbedding
from engine.model import Attention, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock
from engine.models.gemma3 import sliding_rotary
from engine.models.phi3 import partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["MimoAttention", "MimoV2FlashForCausalLM"]


class MimoAttention(Attention):
    """The layer's attention in its own shape (`ModelConfig.layer_config`: a sliding layer's KV heads), sinks on a
    sliding layer, value heads narrower than q/k's (the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 layer: int) -> None:
        own = replace(config.layer_config(layer), attention_sinks=config.layer_window(layer) is not None)
        own_shard = ShardShape.of(own, shard.rank, shard.size)   # this rank's heads of the layer's own shape
        super().__init__(own, own_shard, comm, rotary_emb, layer)
        self.shard = own_shard
        self.v_head_dim, self.value_scale = config.mimo.v_head_dim, config.mimo.value_scale
        self.v_size = own_shard.num_kv_heads * self.v_head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + self.kv_size + self.v_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(own_shard.num_heads * self.v_head_dim, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, :self.q_size + self.kv_size].reshape(-1, heads + kv_heads, d)   # a copy: q and k whole
        self.rotary_emb(qk, rope_rows)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, self.v_head_dim) * self.value_scale
        v = F.pad(v, (0, d - self.v_head_dim))   # a q/k head's size, as the cache holds it
        out = self.attend(q, k, v, kv_cache, meta, backend)[..., :self.v_head_dim]
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, heads * self.v_head_dim)))


class MimoV2FlashForCausalLM(Qwen3MoeForCausalLM):
    """MiMo-V2-Flash (the module docstring): Qwen3-MoE's model and loading with its attention, rotaries and router."""

    moe_block = DeepseekMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = MimoAttention(self.config, self.shard, self.comm, sliding_rotary(self, index, ops), index)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The multi-token-prediction layers skipped; the sinks under transformers' name; q/k rows reordered for the
        partial rotary; the experts as Qwen3-MoE's."""
        if name.startswith("mtp."):
            return ()
        name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
        return ((read, partial_rotary_rows(self.config, read, piece))
                for read, piece in super().read_tensor(hf_name, name, tensor))

    def cut_shape(self, name: str) -> tuple[ShardShape, ModelConfig]:
        """A layer's attention tensors are cut in its own shape (a sliding layer's KV heads)."""
        layer = self.layer_of(name)
        if layer is not None and ".self_attn." in name:
            return layer.self_attn.shard, layer.self_attn.config
        return self.shard, self.config

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """v_proj's rows after q's and k's in the fused qkv_proj, in value heads; the rest as Qwen3-MoE's."""
        layer = self.layer_of(name)
        if layer is None or ".self_attn.v_proj." not in name:
            return super()._destination(name, hf_name)
        attn = layer.self_attn
        offset = attn.q_size + attn.kv_size
        return name.replace("v_proj", "qkv_proj"), lambda data: data.narrow(0, offset, attn.v_size)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's value heads of v_proj (rows) and o_proj (columns); the rest (the sinks too) as Qwen3-MoE's, in
        the layer's own shape."""
        shard, c = self.cut_shape(name)
        kind = next((k for k in ("v_proj", "o_proj") if f".self_attn.{k}." in name), None)
        if shard.size == 1 or kind is None:
            return super()._shard_of(hf_name, name, tensor)
        vd = c.mimo.v_head_dim
        dim, heads, start, count, per = {
            "v_proj": (0, c.num_kv_heads, shard.kv_head_start, shard.num_kv_heads, vd),
            "o_proj": (1, c.num_heads, shard.head_start, shard.num_heads, vd)}[kind]
        dim = 0 if name.endswith(".bias") else dim
        if tensor.dim() <= dim or tensor.shape[dim] != heads * per:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({heads * per} along dimension {dim})")
        return tensor.narrow(dim, start * per, count * per)
