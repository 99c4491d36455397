"""BigScience's BLOOM (`BloomForCausalLM`: BLOOM and BLOOMZ, 560M to 176B): GPT-NeoX's sequential layer (LayerNorms
of a weight and a bias, multi-head attention from a fused q/k/v a head, an ungated MLP through GELU's tanh form, every
projection biased) without a rotary: attention by ALiBi (`AlibiAttention`, `kernels.alibi`: each head adds its slope
x the key's position to the scores), and a LayerNorm on the embeddings (`embed_norm`); the head tied to the table.

The checkpoint names the model `transformer.` (`word_embeddings`, `word_embeddings_layernorm`, a layer `h.N.` with
`self_attention.query_key_value` holding each head's q, k and v rows one after the other, split as read, and
`self_attention.dense`; `mlp.dense_h_to_4h` / `dense_4h_to_h`; `ln_f`). Under tensor parallelism each rank holds its
heads and their slopes. On the Triton backend the paged kernels add the bias themselves (their `alibi` slopes), so
decode steps are captured as CUDA graphs as any model's; elsewhere `kernels.alibi` attends in torch."""

from __future__ import annotations

import sys
from types import ModuleType

import torch
from torch import nn

from engine.layers import BiasLayerNorm
from engine.model import Attention
from engine.model_config import ModelConfig
from engine.models.cohere import CohereLayerNorm
from engine.models.gpt_neox import GPTNeoXForCausalLM, split_qkv_rows
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused
from kernels.alibi import alibi_attention, alibi_slopes, mpt_alibi_slopes

__all__ = ["AlibiAttention", "BloomForCausalLM", "MptForCausalLM"]

_RENAMES = ((".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
            (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_TOP_NAMES = {"word_embeddings.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias",
              "word_embeddings_layernorm.weight": "embed_norm.weight",
              "word_embeddings_layernorm.bias": "embed_norm.bias"}


class AlibiAttention(Attention):
    """Llama's attention (q/k/v stored as the cache holds them, no rotary) over the cache by ALiBi: this rank's heads'
    slopes (BLOOM's, or MPT's where `ModelConfig.alibi_bias_max` is set, their bias relative to the last key), a
    float32 tensor on the model's device once the first forward runs there (the eager warm-up before a CUDA graph's
    capture); q, k and v clamped to +-`clip_qkv` after their projection where the config sets it (MPT's). The Triton
    kernels take the slopes (`alibi`; their bias is relative to the query: the same softmax); the other backends'
    attention is `kernels.alibi`'s."""

    alibi = True   # `ModelRunner.compile_kernels`: the Triton kernels' ALiBi variants

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer)
        mpt = config.alibi_bias_max is not None
        slopes = mpt_alibi_slopes(config.num_heads, config.alibi_bias_max) if mpt else alibi_slopes(config.num_heads)
        self.slope_values, self.relative = slopes[shard.head_start:shard.head_start + shard.num_heads], mpt
        self._slopes: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, rope_rows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(-self.config.clip_qkv, self.config.clip_qkv)
        q, k, v = qkv.view(-1, heads + 2 * kv_heads, self.config.head_dim).split([heads, kv_heads, kv_heads], dim=1)
        out = self.attend(q, k, v, kv_cache, meta, backend)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, backend) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        backend.store_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        if self._slopes is None or self._slopes.device != q.device:
            self._slopes = self.slope_values.to(q.device)
        if backend is sys.modules.get("kernels.triton_attention"):
            return backend.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale=self.k_scale,
                                           v_scale=self.v_scale, alibi=self._slopes)
        return alibi_attention(q, k_cache, v_cache, meta, self.scale, self._slopes, relative=self.relative,
                               k_scale=self.k_scale, v_scale=self.v_scale)


class BloomForCausalLM(GPTNeoXForCausalLM):
    """BLOOM (the module docstring): GPT-NeoX's sequential layers with ALiBi attention and a normed embedding."""

    checkpoint_prefix, top_names, renames = "transformer.", _TOP_NAMES, _RENAMES   # GPT-NeoX's reading, BLOOM's names
    fused_qkv, skipped = ".self_attention.query_key_value.", ()

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



# MPT's names (past `transformer.`) -> the model's
_MPT_RENAMES = ((".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
                (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.up_proj.", ".mlp.up_proj."),
                (".ffn.down_proj.", ".mlp.down_proj."))
_MPT_TOP_NAMES = {"wte.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}


class MptForCausalLM(GPTNeoXForCausalLM):
    """MosaicML's MPT (`MptForCausalLM`: MPT-7B, -30B and their Instruct, Chat and StoryWriter releases): GPT-NeoX's
    sequential layer without biases, its LayerNorms a weight alone (Cohere's), an ungated MLP through exact GELU,
    ALiBi attention with MPT's slopes (`mpt_alibi_slopes`, their bias relative to the last key) from one fused `Wqkv`
    (q, k and v rows one after the other) clamped to +-`clip_qkv` where set; the head tied to the table. Names:
    `transformer.wte`, `transformer.blocks.N` (`norm_1`, `attn.Wqkv`, `attn.out_proj`, `norm_2`, `ffn.up_proj`,
    `ffn.down_proj`), `transformer.norm_f`."""

    norm_class = CohereLayerNorm
    checkpoint_prefix, blocks, top_names, renames = "transformer.", "blocks.", _MPT_TOP_NAMES, _MPT_RENAMES
    fused_qkv, skipped, split_qkv = ".attn.Wqkv.", (), staticmethod(split_qkv_rows)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        c = self.config
        layer.input_layernorm = CohereLayerNorm(c.hidden_size, c.rms_norm_eps)
        layer.post_attention_layernorm = CohereLayerNorm(c.hidden_size, c.rms_norm_eps)
        layer.self_attn = AlibiAttention(c, self.shard, self.comm, layer.self_attn.rotary_emb, index)
        return layer
