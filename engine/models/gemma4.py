"""Gemma 4's text model (`Gemma4ForCausalLM`, and `Gemma4ForConditionalGeneration`'s language model): Gemma 3's
layer, changed (config: `engine.gemma4_config`).

- attention of two shapes: the sliding layers' heads, and the full layers' own KV heads and head size
  (`ModelConfig.layer_config`), their K/V in a cache tensor of their own (`engine.kv_cache`); with `k_eq_v` a full
  layer's V is its K projection (one projection makes both), normed apart;
- q and k normed per head, and V too without a weight, by a plain RMSNorm (float32, x times its weight: not Gemma 3's
  1 + weight, and so every norm of the model); q.k unscaled;
- two rotaries: the sliding layers' default one, the full layers' proportional one (a quarter of each 512-wide head
  turns, its frequencies over the whole head);
- with experts (`enable_moe_block`), the dense MLP's output and the experts' (routed on the un-normed residual stream
  by `Gemma4Experts.route`, their input normed by a norm of their own) are each normed and summed before the
  post-feed-forward norm;
- each layer's output (its residual sum) is multiplied by its `layer_scalar`, so the residual add is the layer's own
  (not fused into the next layer's input norm as in the Llama layer);
- the E2B's and E4B's per-layer inputs (`per_layer_inputs`) are gated into each layer's output before that scalar,
  and their last layers project q alone and attend to their producer's cache (`Gemma4Shape.kv_producer`: the model
  hands each layer its producer's K/V, `kv_cache_of`), with double-wide MLPs where the config says.
It runs on the module path on every backend; the experts as Qwen3-MoE's (`SparseMoeBlock`: Triton on CUDA, grouped
matmuls elsewhere). Under tensor parallelism each layer's attention is cut in its own shape (`cut_shape`: a full
layer's few KV heads replicated where the ranks outnumber them), the experts along their intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import FloatRMSNorm, GeluTanhAndMul, HeadRMSNorm, RopeRows, RotaryEmbedding
from engine.model import MLP, Attention, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.qwen3_moe import SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from engine.rope_config import RopeScaling
from kernels import AttentionMetadata, fused

__all__ = ["Gemma4ForCausalLM", "pow_rms"]

_RENAMES = {"router.proj.weight": "moe.gate.weight", "router.scale": "moe.scale",
            "router.per_expert_scale": "moe.per_expert_scale", "experts.gate_up_proj": "moe.w13",
            "experts.down_proj": "moe.w2"}


def pow_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Gemma4RMSNorm` without a weight: float32 statistics, rounded to x's dtype."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class Gemma4HeadRMSNorm(HeadRMSNorm):
    """Each head normed by Gemma 4's RMSNorm (float32 throughout, x times the weight), in place."""

    def forward(self, heads: torch.Tensor) -> None:
        heads.copy_((pow_rms(heads.float(), self.eps) * self.weight.float()).type_as(heads))


class Gemma4Attention(Attention):
    """The layer's attention in its own shape (`ModelConfig.layer_config`); `k_eq_v`: no v_proj, V is the K
    projection normed without a weight (as every layer's V is), not rotated. A shared-K/V layer (`shares_kv`) projects
    q alone and attends to its producer's cache (`producer`, set by the model), stored there under its scales."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 layer: int) -> None:
        own = config.layer_config(layer)
        self_shard = ShardShape.of(own, shard.rank, shard.size)   # this rank's heads of the layer's own shape
        super().__init__(own, self_shard, comm, rotary_emb, layer, Gemma4HeadRMSNorm)
        self.shard = self_shard
        self.k_eq_v = config.gemma4.k_eq_v and config.layer_window(layer) is None
        self.shares_kv = config.gemma4.kv_producer(config, layer) != layer
        self.producer: Gemma4Attention | None = None
        if self.k_eq_v or self.shares_kv:
            rows = self.q_size + (0 if self.shares_kv else self.kv_size)
            self.qkv_proj = nn.Linear(config.hidden_size, rows, bias=config.attention_bias)
        if self.shares_kv:
            self.k_norm = None

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.shares_kv:   # the producer stored this step's K/V already (an earlier layer)
            q = self.qkv_proj(hidden).view(-1, heads, self.config.head_dim)
            self.q_norm(q)
            self.rotary_emb(q, rope_rows)
            out = backend.paged_attention(q, *kv_cache, meta.for_layer(self.sliding_window), self.scale,
                                          self.sliding_window,
                                          k_scale=self.producer.k_scale, v_scale=self.producer.v_scale)
            return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))
        qkv = self.qkv_proj(hidden)
        if self.k_eq_v:
            qkv = torch.cat([qkv, qkv[:, self.q_size:]], dim=1)
        qkv = qkv.view(-1, heads + 2 * kv_heads, self.config.head_dim)   # [T, heads, d]
        v = qkv[:, heads + kv_heads:]
        v.copy_(pow_rms(v, self.config.rms_norm_eps))
        self.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        out = self.attend(q, k, v, kv_cache, meta, backend)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class Gemma4Experts(SparseMoeBlock):
    """Gemma 4's experts (GELU-tanh gated, `SparseMoeBlock`'s kernels) and their router: the residual stream RMS-normed
    without a weight, times `scale` and 1 / sqrt(hidden), projected (`gate`), its softmax's top k renormalised to sum
    to 1 and each multiplied by its expert's `per_expert_scale` (float32 weights)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.act_fn = GeluTanhAndMul()
        self.scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts))
        self.eps, self.root = config.rms_norm_eps, config.hidden_size ** -0.5

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden], the residual stream -> (weights [num_tokens, top_k] float32, experts)."""
        logits = self.gate(pow_rms(x, self.eps) * self.scale * self.root)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: the experts' input (normed), routed by `residual` (the stream before the norm)."""
        return self.comm.all_reduce(self._experts(x, *self.route(x if residual is None else residual)))


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 block (module docstring): its input is the previous layer's whole output, and so is its output."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = FloatRMSNorm(h, eps)
        self.self_attn = Gemma4Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = FloatRMSNorm(h, eps)
        self.pre_feedforward_layernorm = FloatRMSNorm(h, eps)
        wide = config.gemma4.mlp_width(config, layer) // config.intermediate_size   # 2: a double-wide MLP
        self.mlp = MLP(config, replace(shard, intermediate_size=wide * shard.intermediate_size), comm, ops)
        self.post_feedforward_layernorm = FloatRMSNorm(h, eps)
        if (per_layer := config.gemma4.per_layer_input_size):   # whole on every rank
            self.per_layer_input_gate = nn.Linear(h, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, h, bias=False)
            self.post_per_layer_input_norm = FloatRMSNorm(h, eps)
        self.moe = Gemma4Experts(config, shard, comm, ops) if config.is_sparse_layer(layer) else None
        if self.moe is not None:
            self.pre_feedforward_layernorm_2 = FloatRMSNorm(h, eps)
            self.post_feedforward_layernorm_1 = FloatRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = FloatRMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend,
                per_layer_input: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """hidden: [num_tokens, hidden_size], the previous layer's output (the scaled embeddings for the first);
        `residual` unused (None); `per_layer_input` [num_tokens, per_layer_input_size], this layer's slice of the
        per-layer inputs where the model has them -> (this layer's output, None)."""
        attn = self.self_attn(self.input_layernorm(hidden), rope_rows, kv_cache, meta, backend)
        normed, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), hidden)
        out = self.mlp(normed)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(residual), residual)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = residual + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:   # gated in, projected back, normed, added
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar, None


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4's text model (module docstring): Gemma 3's scaled embeddings, loading and head (soft-capped logits
    where `final_logit_softcapping`), with its own layers, norms and rotaries."""

    norm_init = 1.0

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        g, h, layers = config.gemma4, config.hidden_size, config.num_layers
        if (size := g.per_layer_input_size):   # the per-layer inputs' table, projection and norm: whole on every rank
            self.embed_tokens_per_layer = nn.Embedding(g.per_layer_vocab_size, layers * size,
                                                       _weight=torch.empty(g.per_layer_vocab_size, layers * size))
            self.per_layer_model_projection = nn.Linear(h, layers * size, bias=False)
            self.per_layer_projection_norm = FloatRMSNorm(size, config.rms_norm_eps)
        cache_of = {layer: i for i, layer in enumerate(config.kv_layers)}
        self.kv_cache_of = [cache_of[g.kv_producer(config, i)] for i in range(layers)]   # each layer's cache
        for i, layer in enumerate(self.layers):   # a shared-K/V layer reads its producer's scales (not a submodule)
            if layer.self_attn.shares_kv:
                object.__setattr__(layer.self_attn, "producer", self.layers[g.kv_producer(config, i)].self_attn)

    @property
    def graph_safe(self) -> bool:
        """As Qwen3-MoE's: captured where every layer's experts run the Triton kernels (or there are none)."""
        return all(layer.moe is None or layer.moe.fused_moe is not None for layer in self.layers)

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        """The full layers' rotary, in their head size (the last layer is always full)."""
        return RotaryEmbedding(self.config.layer_config(self.config.num_layers - 1), ops)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Gemma4DecoderLayer(self.config, self.shard, self.comm, proportional_rotary(self, index, ops), ops, index)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden) if "embed_tokens_per_layer" in self._modules else None
        rows: dict[int, RopeRows] = {}   # the step's cos/sin, once per rotary
        for i, layer in enumerate(self.layers):
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in rows:
                rows[id(rotary)] = rotary.rows(positions)
            hidden, _ = layer(hidden, None, rows[id(rotary)], kv_caches[self.kv_cache_of[i]], meta, backend,
                              None if per_layer is None else per_layer[:, i])
        return self.norm(hidden)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_layers, per_layer_input_size]: each token's rows of the per-layer table (scaled by the
        square root of their size, rounded to the weights' dtype) and a projection of its scaled embedding (times
        1 / sqrt(hidden), normed), summed and times 1 / sqrt(2) (transformers' `project_per_layer_inputs`)."""
        size, layers = self.config.gemma4.per_layer_input_size, self.config.num_layers
        table = self.embed_tokens_per_layer(input_ids)
        table = table * float(torch.tensor(size ** 0.5).to(table.dtype))
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(-1, layers, size))
        return (projected + table.view(-1, layers, size)) * 2.0 ** -0.5

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """`LlamaForCausalLM.init_random`, each layer's output scalar and the routers' scales 1."""
        super().init_random(seed, std)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith(("layer_scalar", "moe.scale", "per_expert_scale")):
                    param.fill_(1.0)

    def cut_shape(self, name: str) -> tuple[ShardShape, ModelConfig]:
        """A layer's attention tensors are cut in its own shape (a full layer's KV heads and head size), a double-wide
        MLP's in its width."""
        layer = self.layer_of(name)
        if layer is not None and ".self_attn." in name:
            return layer.self_attn.shard, layer.self_attn.config
        if layer is not None and ".mlp." in name and layer.mlp.intermediate_size != self.shard.intermediate_size:
            inter = layer.mlp.intermediate_size
            return replace(self.shard, intermediate_size=inter), replace(
                self.config, intermediate_size=inter * self.shard.size)
        return self.shard, self.config

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The experts' stacked tensors cut along each expert's intermediate size (w13's gate rows and up rows, w2's
        columns); the rest as the Llama model's."""
        size, rank = self.shard.size, self.shard.rank
        if size == 1 or not name.endswith(("moe.w13", "moe.w2")):
            return super()._shard_of(hf_name, name, tensor)
        inter, mine = self.config.moe_intermediate_size, self.shard.moe_intermediate_size
        dim = 1 if name.endswith("w13") else 2
        if tensor.dim() != 3 or tensor.shape[dim] != inter * (2 if dim == 1 else 1):
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({inter} experts' rows along dimension {dim})")
        if dim == 2:
            return tensor.narrow(2, rank * mine, mine)
        return torch.cat([tensor.narrow(1, rank * mine, mine), tensor.narrow(1, inter + rank * mine, mine)], dim=1)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The router's and the experts' tensors under our names (`layers.N.moe.`); a shared-K/V layer's K and V
        projections and norms skipped (some checkpoints keep them; transformers skips them too); the rest as stored."""
        layer = self.layer_of(name)
        if layer is not None and layer.self_attn.shares_kv and any(
                f".self_attn.{kind}." in name for kind in ("k_proj", "v_proj", "k_norm", "v_norm")):
            return ()
        head, sep, rest = name.partition(".router.") if ".router." in name else name.partition(".experts.")
        if sep and f"{sep[1:]}{rest}" in _RENAMES:
            return ((f"{head}.{_RENAMES[sep[1:] + rest]}", tensor),)
        return ((name, tensor),)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The Llama model's, in each layer's own shape (`cut_shape`); a v_proj where V is the K projection
        (`k_eq_v`) is refused."""
        layer = self.layer_of(name)
        if layer is not None and ".self_attn.v_proj." in name and layer.self_attn.k_eq_v:
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        return super()._destination(name, hf_name)


def proportional_rotary(model: nn.Module, index: int, ops: ModuleType) -> RotaryEmbedding:
    """The rotary of `model`'s layer `index` where full layers turn by a proportional rope (Gemma 4's, LFM3's): the
    model's, or on a sliding layer the sliding layers' default rope over their whole heads (`rope_local_theta`, no
    scaling), made with the first sliding layer."""
    c = model.config
    if c.layer_window(index) is None:
        return model.rotary_emb
    if "rotary_local" not in model._modules:
        model.rotary_local = RotaryEmbedding(replace(
            c, rope_theta=c.rope_local_theta, rope_scaling=RopeScaling(), partial_rotary_factor=1.0,
            rope_proportional=False, max_position_embeddings=c.context_length), ops)
    return model.rotary_local
