"""Cohere's Command R family: `CohereForCausalLM` (Command R, Aya) and `Cohere2ForCausalLM` (Command R7B, Command A).

The layer is parallel: one LayerNorm (`CohereLayerNorm`: float32, mean-centred, a weight and no bias) feeds both
the attention and the MLP, and both outputs join the stream, x + attention + mlp (transformers' order: the
attention's output added first; the layer hands `(mlp, x + attention)` on, so the next layer's fused add makes
the same sum). The logits are multiplied by `logit_scale` (`LlamaForCausalLM.compute_logits`); the head is tied by
default.

Cohere's rotary pairs each even dimension of a head with the next odd one (GPT-J's interleaved form), where the
engine's rotary embedding pairs dimension i with i + head_dim / 2. A dot product does not see an order applied to
both of its vectors: `read_tensor` reorders each q and k head's rows (and biases) evens first, then odds, as the
weights are read, so the engine's rotary is Cohere's and q.k, hence every score, is unchanged (V and o_proj keep
their order). Cohere 2 rotates on its sliding layers only: its full layers are NoPE (`ModelConfig.no_rope_layers`,
SmolLM3's `NoRope`). Command R+'s q/k LayerNorms (`use_qk_norm`) have a weight per head (`CohereHeadLayerNorm`,
this rank's heads), reordered as the rows are. Command A Plus (`Cohere2MoeForCausalLM`, its config
`engine.cohere_moe_config`) is Cohere 2's model with experts past its dense first layers (`CohereMoeBlock`) and,
where its config says, an RMSNorm in place of the LayerNorm. North (`CohereCompassForCausalLM`) is Cohere 2's model
with a rope per layer type turning rotate-half pairs (no reordering: the engine's pairs), the sliding layers' by their
own base (`sliding_rotary`), a NoPE type's none.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import FloatRMSNorm, RMSNorm, RopeRows
from engine.model import MLP, Attention, LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.gemma3 import sliding_rotary
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, with_experts
from engine.models.smollm3 import layer_rotary
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["Cohere2MoeForCausalLM", "CohereCompassForCausalLM", "CohereForCausalLM", "CohereLayerNorm",
           "CohereMoeBlock", "HeliumForCausalLM", "InterleavedRotaryWeights", "cut_head_norm", "interleaved_to_halves"]


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `CohereLayerNorm`: in float32, mean-centred, times the weight, one rounding to x's dtype."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    return (weight.float() * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class CohereLayerNorm(FloatRMSNorm):
    """Cohere's LayerNorm (no bias), the residual add fused as `FloatRMSNorm`'s."""

    norm = staticmethod(_layer_norm)


def interleaved_to_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int | None = None,
                          interleaved: bool = True) -> torch.Tensor:
    """A q or k projection's rows (or bias) [heads x head_dim, ...] reordered in each head for a rotary that turns its
    first `rotary_dim` dimensions (all by default) in pairs (2i, 2i + 1) and passes the rest: the pairs' first members
    (0, 2, .. rotary_dim - 2), the first half of the passed dimensions, the pairs' second members, the passed ones'
    second half. Rotating halves (i with i + head_dim / 2, the passed ones at frequency 0: GLM-4's partial rotary)
    then rotates the pairs the model's rotary pairs. The same order on q and k leaves every q.k as it was.
    `interleaved` False: the model pairs i with i + rotary_dim / 2 in its first `rotary_dim` (GLM-4.5's partial
    rotary); the pairs' members keep their order and the passed dimensions move between them."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    passed, rest, half = torch.arange(rotary_dim, head_dim), (head_dim - rotary_dim) // 2, rotary_dim // 2
    first, second = (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)) if interleaved else \
        (torch.arange(half), torch.arange(half, rotary_dim))
    order = torch.cat([first, passed[:rest], second, passed[rest:]])
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


class CohereHeadLayerNorm(nn.Module):
    """Cohere's LayerNorm over each head of a [num_tokens, num_heads, head_dim] view, a weight of its own for each
    head ([num_heads, head_dim]: this rank's), written back in place (Command R+'s q_norm and k_norm, before rotary)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, heads: torch.Tensor) -> None:
        heads.copy_(_layer_norm(heads, self.weight, self.eps))


class CohereDecoderLayer(nn.Module):
    """One parallel block (see the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: nn.Module,
                 ops: ModuleType, layer: int) -> None:
        super().__init__()
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, comm, rotary_emb, layer)
        if config.qk_norm:   # Command R+: a weight per head
            self.self_attn.q_norm = CohereHeadLayerNorm(shard.num_heads, config.head_dim, config.rms_norm_eps)
            self.self_attn.k_norm = CohereHeadLayerNorm(shard.num_kv_heads, config.head_dim, config.rms_norm_eps)
        self.mlp = MLP(config, shard, comm, ops)
        self.post_attention_layernorm: nn.Module | None = None   # GPT-NeoX's: the MLP's own norm of the stream

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size], the previous layer's MLP output (the embeddings, with residual None,
        for the first) -> (this layer's MLP output, the stream with its attention output added)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mlp_input = hidden if self.post_attention_layernorm is None else self.post_attention_layernorm(residual)
        residual = residual + self.self_attn(hidden, rope_rows, kv_cache, meta, backend)
        return self.mlp(mlp_input), residual


class InterleavedRotaryWeights(LlamaForCausalLM):
    """A model whose rotary pairs dimensions 2i and 2i + 1 (Cohere's, ERNIE 4.5's, GLM-4's on its `rotary_dim`): its
    q and k rows (and biases, and per-head q/k norm weights) reordered as they are read (see the module docstring)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors as the next class reads them (GLM-4's: Phi-3's split of a fused one), each q or k projection's
        weight or bias with each head's rows reordered (`interleaved_to_halves`), where its rows are whole heads (a
        wrong shape is named by the loading, as for any model), and a q/k norm's weight [heads, head_dim] alike."""
        d, r = self.config.head_dim, self.config.rotary_dim
        for read, piece in super().read_tensor(hf_name, name, tensor):
            if any(f".self_attn.{part}." in read for part in ("q_proj", "k_proj")) and piece.dim() >= 1 \
                    and piece.shape[0] % d == 0:
                piece = interleaved_to_halves(piece, d, r)
            elif any(f".self_attn.{part}." in read for part in ("q_norm", "k_norm")) and piece.dim() == 2 \
                    and piece.shape[-1] == d:
                piece = interleaved_to_halves(piece.reshape(-1), d, r).reshape(piece.shape)
            yield read, piece


class CohereForCausalLM(InterleavedRotaryWeights):
    """Command R and Command R7B (see the module docstring): the Llama model's loading, cuts and head, with
    Cohere's parallel layers, LayerNorms and q/k rows reordered as they are read."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:   # Cohere 2's full layers: NoPE
        return CohereDecoderLayer(self.config, self.shard, self.comm, layer_rotary(self, index), ops, index)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return CohereLayerNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Command R+'s q/k norms cut to this rank's heads (`cut_head_norm`); the rest as the Llama model's."""
        cut = cut_head_norm(self.shard, self.config, hf_name, name, tensor)
        return super()._shard_of(hf_name, name, tensor) if cut is None else cut


class CohereCompassForCausalLM(CohereForCausalLM):
    """North (see the module docstring): Cohere 2's layers, each type its rope (or none), rotate-half pairs read as
    stored."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        rotary = layer_rotary(self, index)
        rotary = rotary if rotary is not self.rotary_emb else sliding_rotary(self, index, ops)
        return CohereDecoderLayer(self.config, self.shard, self.comm, rotary, ops, index)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return LlamaForCausalLM.read_tensor(self, hf_name, name, tensor)   # its q/k rows in the engine's pairs


def cut_head_norm(shard: ShardShape, c: ModelConfig, hf_name: str, name: str, tensor: torch.Tensor
                  ) -> torch.Tensor | None:
    """A per-head q/k norm's weight [heads, head_dim] cut to this rank's heads (its KV heads: replicated where the
    ranks outnumber them); None for any other tensor, or on one rank."""
    if shard.size == 1 or not name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return None
    heads, start, count = (c.num_heads, shard.head_start, shard.num_heads) if ".q_norm." in name else \
        (c.num_kv_heads, shard.kv_head_start, shard.num_kv_heads)
    if tuple(tensor.shape) != (heads, c.head_dim):
        raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config's "
                              f"{(heads, c.head_dim)}")
    return tensor.narrow(0, start, count)


class CohereMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts with Command A Plus's router (transformers' `Cohere2MoeTopKRouter`): the top k of the
    logits, weighed by their softmax (float32) or their sigmoids (renormalised where `norm_topk_prob`), rounded to x's
    dtype; its shared experts' output averaged with the routed one's where `CohereMoeShape.shared_average`, else
    added."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.sigmoid, self.shared_average = config.cohere_moe.sigmoid, config.cohere_moe.shared_average

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        if not self.sigmoid:
            return F.softmax(top, dim=-1, dtype=torch.float).to(x.dtype), experts
        weights = torch.sigmoid(top)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None or not self.shared_average:
            return super().forward(x)
        return self.comm.all_reduce((self._experts(x, *self.route(x)) + self.shared_expert(x)) / 2)


class Cohere2MoeForCausalLM(CohereForCausalLM, Qwen3MoeForCausalLM):
    """Command A Plus (see the module docstring): Cohere 2's layers with `CohereMoeBlock`s on the sparse ones, read
    and cut as Qwen3-MoE's experts (the shared experts under Qwen2-MoE's name), an RMSNorm where the config says."""

    moe_block = CohereMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = with_experts(self, super().make_layer(index, ops), index, ops)
        if self.config.cohere_moe.rms_norm:
            layer.input_layernorm = RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, ops)
        return layer

    def make_norm(self, ops: ModuleType) -> nn.Module:
        if self.config.cohere_moe.rms_norm:
            return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, ops)
        return super().make_norm(ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().read_tensor(hf_name, name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor)


class HeliumForCausalLM(InterleavedRotaryWeights):
    """Kyutai's Helium (`HeliumForCausalLM`: Helium-1 2B): the Llama model whose rotary pairs dimensions 2i and 2i + 1
    (its q and k rows reordered as read) and whose norms are float32's (`FloatRMSNorm`, transformers'
    `HeliumRMSNorm`); o_proj without a bias whatever `attention_bias` says of q, k and v."""

    supports_flat_forward = False
    norm_class = FloatRMSNorm
