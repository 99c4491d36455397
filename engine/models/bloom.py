"""BigScience's BLOOM (`BloomForCausalLM`: BLOOM and BLOOMZ, 560M to 176B): GPT-NeoX's sequential layer (LayerNorms
of a weight and a bias, multi-head attention from a fused q/k/v a head, an ungated MLP through GELU's tanh form, every
projection biased) without a rotary: attention by ALiBi (`AlibiAttention`, `kernels.alibi`: each head adds its slope
x the key's position to the scores), and a LayerNorm on the embeddings (`embed_norm`); the head tied to the table.

The checkpoint names the model `transformer.` (`word_embeddings`, `word_embeddings_layernorm`, a layer `h.N.` with
`self_attention.query_key_value` holding each head's q, k and v rows one after the other, split as read, and
`self_attention.dense`; `mlp.dense_h_to_4h` / `dense_4h_to_h`; `ln_f`). Under tensor parallelism each rank holds its
heads and their slopes. Its decode steps are not captured as CUDA graphs (the attention loops over the step's
sequences on the host)."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import BiasLayerNorm
from engine.model import Attention
from engine.model_config import ModelConfig
from engine.models.gpt_neox import GPTNeoXForCausalLM, checkpoint_name, split_grouped_qkv
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused
from kernels.alibi import alibi_attention, alibi_slopes

__all__ = ["AlibiAttention", "BloomForCausalLM"]

_RENAMES = ((".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
            (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_TOP_NAMES = {"word_embeddings.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias",
              "word_embeddings_layernorm.weight": "embed_norm.weight",
              "word_embeddings_layernorm.bias": "embed_norm.bias"}


class AlibiAttention(Attention):
    """Llama's attention (q/k/v stored as the cache holds them, no rotary) over the cache by ALiBi: this rank's heads'
    slopes, a float32 tensor on the model's device once the first forward runs there."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer)
        self.slope_values = alibi_slopes(config.num_heads)[shard.head_start:shard.head_start + shard.num_heads]
        self._slopes: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, backend) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        backend.store_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        if self._slopes is None or self._slopes.device != q.device:
            self._slopes = self.slope_values.to(q.device)
        return alibi_attention(q, k_cache, v_cache, meta, self.scale, self._slopes, k_scale=self.k_scale,
                               v_scale=self.v_scale)


class BloomForCausalLM(GPTNeoXForCausalLM):
    """BLOOM (the module docstring): GPT-NeoX's sequential layers with ALiBi attention and a normed embedding."""

    graph_safe = False

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        self.embed_norm = BiasLayerNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = AlibiAttention(self.config, self.shard, self.comm, layer.self_attn.rotary_emb, index)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().embed(input_ids))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`transformer.` names as the model's; a fused query_key_value as its q_proj, k_proj and v_proj rows."""
        name = checkpoint_name(name, "transformer.", _TOP_NAMES, _RENAMES)
        head, fused, suffix = name.partition(".self_attention.query_key_value.")
        if not fused:
            return super(GPTNeoXForCausalLM, self).read_tensor(hf_name, name, tensor)
        return split_grouped_qkv(self.config, hf_name, head, suffix, tensor)
