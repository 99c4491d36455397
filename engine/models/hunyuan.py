"""Tencent Hunyuan's dense models (`HunYuanDenseV1ForCausalLM`: Hunyuan-7B, -4B, -1.8B and -0.5B-Instruct,
Hunyuan-MT-7B): the Llama layer with each q and k head RMS-normed after the rotary, not before (`HunyuanAttention`;
the checkpoints' `query_layernorm` and `key_layernorm`, read as the attention's q_norm and k_norm), and a rotary of a
stretched base (`engine.hunyuan_config`). The module path runs it (the CPU's flat loop norms before the rotary).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RopeRows
from engine.model import Attention, LlamaForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["HunyuanAttention", "HunyuanDenseForCausalLM", "HunyuanMoeForCausalLM"]


class HunyuanAttention(Attention):
    """Llama's attention, q and k turned by the rotary, then normed per head."""

    def position_qk(self, qkv: torch.Tensor, rope_rows: RopeRows) -> None:
        self.rotary_emb(qkv[:, :self.num_heads + self.num_kv_heads], rope_rows)
        self.norm_qk(qkv)


class HunyuanDenseForCausalLM(LlamaForCausalLM):
    """The Llama model with `HunyuanAttention` and its checkpoints' names of the q/k norms."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = HunyuanAttention(self.config, self.shard, self.comm, self.rotary_emb, index)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm."), tensor),)


class HunyuanMoeForCausalLM(HunyuanDenseForCausalLM, Qwen3MoeForCausalLM):
    """Hunyuan's MoE (Hunyuan-A13B): the dense model's layer with every MLP Qwen2-MoE's sparse block (softmax top k
    beside an ungated shared MLP), its router `mlp.gate.wg` and shared MLP `mlp.shared_mlp` read under the block's
    names."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(".mlp.shared_mlp.", ".mlp.shared_expert.")
        return super().read_tensor(hf_name, name, tensor)
