"""Gemma 3's text model (`Gemma3ForCausalLM`): the Llama layer with Gemma's changes.

- every norm is Gemma's (`GemmaRMSNorm`: float32 throughout, scale 1 + weight), and there are four a layer:
  around attention (input, post-attention) and around the MLP (pre- and post-feed-forward), the post
  norms applied to the sublayer's output before it joins the residual stream;
- each query and key head is normed before rotary (`GemmaHeadRMSNorm`); q.k is scaled by
  `query_pre_attn_scalar ** -0.5`;
- `layer_types` gives each layer sliding or full attention: a sliding layer attends to its last
  `sliding_window` positions (the paged kernels' window) with its own rope base
  (`rope_local_theta`, no scaling); a full layer sees everything, with the config's rope and its scaling;
- the embeddings are scaled by sqrt(hidden_size) (rounded to the weights' dtype, as transformers does);
  the MLP's gate activation is GELU-tanh; the head is tied by default.

It runs on the module path on every backend (the CPU flat loop is the Llama layer's). Every layer keeps
its whole context in the paged cache, sliding ones too: a sliding layer only reads its window.

Gemma 2 (`Gemma2ForCausalLM`) is this class too, with its config (`engine.model_families.gemma2_fields`): no
q/k norms (the config's `qk_norm` off), one rope base for every layer, and soft-capping of the attention
scores (`Attention.softcap`, applied by the kernels) and of the logits (`LlamaForCausalLM.compute_logits`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.rope_config import RopeScaling
from engine.layers import GemmaHeadRMSNorm, GemmaRMSNorm, RopeRows, RotaryEmbedding
from engine.model import MLP, Attention, DecoderLayer, LlamaForCausalLM
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["Gemma3ForCausalLM", "GemmaForCausalLM", "sliding_rotary"]


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 block; the residual stream travels beside the hidden states as in the Llama layer, so
    the residual adds are fused into the input and pre-feed-forward norms. A subclass changes the norms
    (`make_norm`, `head_norm`: GLM-4's layer is this one with Llama's RMSNorm, `engine.models.glm4`)."""

    head_norm: type[nn.Module] = GemmaHeadRMSNorm   # q/k's, where the config norms them

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = self.make_norm(h, eps, ops)
        self.self_attn = Attention(config, shard, comm, rotary_emb, layer, self.head_norm)
        self.post_attention_layernorm = self.make_norm(h, eps, ops)
        self.pre_feedforward_layernorm = self.make_norm(h, eps, ops)
        self.mlp = MLP(config, shard, comm, ops)
        self.post_feedforward_layernorm = self.make_norm(h, eps, ops)

    @staticmethod
    def make_norm(hidden_size: int, eps: float, ops: ModuleType) -> nn.Module:
        return GemmaRMSNorm(hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size], the previous layer's output (the scaled embeddings, with
        residual None, for the first) -> (this layer's output, the residual stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope_rows, kv_cache, meta, backend))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (see the module docstring): the Llama model's loading, tensor-parallel cuts and
    head, with Gemma's layers, two rotary caches (full and sliding layers) and scaled embeddings."""

    supports_flat_forward = False
    norm_init = 0.0

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Gemma3DecoderLayer(self.config, self.shard, self.comm, sliding_rotary(self, index, ops), ops, index)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return GemmaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings times sqrt(hidden_size), the factor rounded to their dtype first (a bfloat16
        model multiplies by 34.0 at hidden size 1152, not 33.94), as transformers does."""
        hidden = super().embed(input_ids)
        return hidden * float(torch.tensor(self.config.hidden_size ** 0.5).to(hidden.dtype))


class GemmaForCausalLM(Gemma3ForCausalLM):
    """Gemma (Gemma 1, CodeGemma; see the module docstring) and VaultGemma (Gemma 2's model, its config's soft caps
    and sliding layers): Gemma 3's model with the Llama layer's two norms, Gemma's (1 + weight); VaultGemma's second
    is stored as `pre_feedforward_layernorm`."""

    norm_class = GemmaRMSNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return self.with_own_norms(DecoderLayer(self.config, self.shard, self.comm, sliding_rotary(self, index, ops),
                                                ops, index))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().read_tensor(hf_name, name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."),
                                   tensor)


def sliding_rotary(model: LlamaForCausalLM, index: int, ops: ModuleType) -> RotaryEmbedding:
    """The rotary of `model`'s layer `index`: the model's (the full layers', with their scaling), or on a sliding
    layer the sliding layers' own (`rope_local_theta`, no scaling, over the model's whole context: Gemma 3's, OLMo
    3's), made with the first sliding layer."""
    if model.config.layer_window(index) is None:
        return model.rotary_emb
    if "rotary_local" not in model._modules:
        c = model.config
        model.rotary_local = RotaryEmbedding(replace(c, rope_theta=c.rope_local_theta or c.rope_theta,
                                                     rope_scaling=RopeScaling(),
                                                     max_position_embeddings=c.context_length), ops)
    return model.rotary_local
