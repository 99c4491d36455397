"""DeepSeek V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; DeepSeek-R1 and Kimi K2 are V3's shape;
Mistral Small 4, `Mistral4ForCausalLM`, too): multi-head latent attention over a cache of one latent a token, and
mixtures of experts beside shared experts, their router grouped.

Attention (`MlaAttention`, the config's `MlaShape`). A token's keys and values are all made from one latent `c` of
`kv_lora_rank` (normed) and one rotated key `k_pe` of `qk_rope_head_dim` shared by the heads: head h's key is
[W_UK[h] c, k_pe], its value W_UV[h] c, with `kv_b_proj` = [W_UK; W_UV] per head. The cache holds [c, k_pe] alone, a
single 'KV head' of `cache_dim` (576 for V3, against 128 heads x (192 + 128) expanded), in one plane
(`ModelConfig.kv_planes`: the layer's K cache is its V cache). Attention is computed in the latent space ("absorbed",
as vLLM's and SGLang's MLA backends decode): each head's query becomes [W_UK[h]^T q_nope, q_pe], so that q.k is the
model's, over `cache_dim` dimensions; the paged kernels attend it as grouped-query attention with one KV head whose
values are the cache rows themselves, and each head's output, the weighted sum of latents (its first
`kv_lora_rank` dimensions), goes through W_UV[h]. The same kernels, any backend, an FP8 cache alike; q.k and the
softmax are the model's, the products' order not transformers' (equal to it in float32 up to rounding: the greedy
tokens of the tiny-model tests; in bfloat16 as vLLM's). The scale is DeepSeek's: (qk_nope + qk_rope)^-1/2, times
YaRN's mscale_all_dim factor squared. Mistral 4 scales each whole query (latent and rotated parts) by Ministral 3's
1 + beta x log(1 + floor(p / original_max_position_embeddings)) at its position p (`llama4_scaling_beta`): the
rotary's rows carry the scale (`Ministral3Rotary`, which scales no heads itself here), the attention multiplies the
absorbed query by it (transformers multiplies the query before the absorption: equal up to rounding).

The rotary turns q_pe and k_pe only (`make_rotary`: head_dim `qk_rope_head_dim`). DeepSeek's checkpoints rotate
interleaved pairs (2i, 2i + 1) (V2 always, V3 where `rope_interleave`): the rows that make q_pe and k_pe are
reordered as they are read, so rotating halves turns the same pairs and q.k is unchanged.

Experts (`DeepseekMoeBlock`): Qwen3-MoE's experts and kernels, the shared experts one ungated MLP of their rows
together, and the router in float32 (`DeepseekRouter`, kept float32 as transformers keeps it): V2's softmax, V3's
sigmoid plus a correction bias that only picks, Mistral 4's the softmax unbiased; the experts picked from the
`topk_group` of `n_group` groups with the best scores (V2: a group's best expert; V3, Mistral 4: its best two's sum),
the top k of them weighted by their scores
(renormalised where `norm_topk_prob`), times `routed_scaling_factor`, in float32 (Mixtral's `moe_float_weights`).

Tensor parallelism: each rank holds its query heads' rows of q and of `kv_b_proj` and their o_proj columns; the latent
projection (and its norm) is whole on every rank, so is the cache (one KV head, replicated); the experts split as
Qwen3-MoE's. Checkpoints' multi-token-prediction layers (past `num_hidden_layers`) are skipped, as transformers skips
them.

LongCat-Flash (`LongcatFlashForCausalLM`, `engine.longcat_config`) is built of the same latent attention: each of its
layers two sublayers of attention and a dense MLP (the engine's layers), its experts, beside zero experts that pass a
token through, running from the first sublayer's MLP input into the second's output (`LongcatSublayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm, RopeRows, RotaryEmbedding
from engine.model import MLP, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.cohere import interleaved_to_halves
from engine.models.ministral3 import Ministral3Rotary
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["AXK1ForCausalLM", "DeepseekForCausalLM", "DeepseekMoeBlock", "LongcatFlashForCausalLM", "MlaAttention",
           "moe_checkpoint_name", "past_the_layers"]

LATENT_NORM_EPS = 1e-6   # transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm take no config eps


class LatentUpProjection(nn.Module):
    """`kv_b_proj` as [heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]: per head W_UK (its first rows) and W_UV.
    Not an `nn.Linear`: nothing multiplies the latents by it whole (`kernels.cpu_linear` packs no copy of it)."""

    def __init__(self, heads: int, rows: int, latent: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, rows, latent))


class MlaAttention(nn.Module):
    """One layer's latent attention (the module docstring), this rank's heads; `rotary_emb` the model's over
    `qk_rope_head_dim`. The attributes the engine reads of every attention: num_heads, num_kv_heads (1),
    sliding_window, chunk, softcap, sinks, k_scale / v_scale (an FP8 cache's, equal: K and V are the same rows)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType) -> None:
        super().__init__()
        mla, hidden, bias = config.mla, config.hidden_size, config.attention_bias
        self.config, self.comm, self.mla, self.rotary_emb = config, comm, mla, rotary_emb
        self.num_heads, self.num_kv_heads = shard.num_heads, 1
        self.sliding_window, self.chunk, self.softcap, self.sinks = None, None, 0.0, None
        self.scale = config.attention_scale
        self.scales_queries = config.llama4_scaling_beta is not None   # Mistral 4: the rows carry each query's scale
        self.k_scale = self.v_scale = 1.0
        self.kv_observer = None
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps or LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps or LATENT_NORM_EPS, ops)
        self.kv_b_proj = LatentUpProjection(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, hidden, bias=bias)
        # Ling 3: each head's output x sigmoid(its row of g_proj over the layer's input)
        self.g_proj = nn.Linear(hidden, self.num_heads, bias=False) if config.head_gates else None

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        mla, heads = self.mla, self.num_heads
        bottleneck, q, gate = self.queries(hidden)
        query, entry = self.latent_query_and_entry(hidden, q, rope_rows)
        out = self.attend(hidden, bottleneck, rope_rows, query, entry, kv_cache[0], meta, backend)
        w = self.kv_b_proj.weight                                                # [heads, nope + v, latent]
        out = torch.bmm(out[..., :mla.kv_lora_rank].transpose(0, 1),
                        w[:, mla.qk_nope_head_dim:].transpose(1, 2)).transpose(0, 1)
        if gate is not None:   # A.X-K2: each head's output x sigmoid(its gate), in float32 as transformers does
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        if self.g_proj is not None:   # the gate in float32, rounded to the model's dtype, as transformers does
            out = out * torch.sigmoid(self.g_proj(hidden).float()).to(out.dtype)[..., None]
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, heads * mla.v_head_dim)))

    def queries(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(q's bottleneck, normed (None: one q projection); each head's query [T, heads, nope + rope]; a gate on
        each head's output [T, heads, v_head_dim] or None)."""
        mla = self.mla
        bottleneck = self.q_a_layernorm(self.q_a_proj(hidden)) if mla.q_lora_rank else None
        q = self.q_b_proj(bottleneck) if mla.q_lora_rank else self.q_proj(hidden)
        return bottleneck, q.view(-1, self.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim), None

    def latent_query_and_entry(self, hidden: torch.Tensor, q: torch.Tensor, rope_rows: RopeRows
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query in the latent space [T, heads, latent_dim] and each token's cache row [T, 1, latent_dim]
        (its normed latent and rotated key); `q`: each head's query, [T, heads, nope + rope]."""
        mla, heads = self.mla, self.num_heads
        nope, latent = mla.qk_nope_head_dim, mla.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(hidden)                                     # [T, latent + rope]
        pe = torch.cat([q[..., nope:], kv[:, None, latent:]], dim=1)            # q_pe and k_pe: [T, heads + 1, rope]
        self.rotary_emb(pe, rope_rows)                                           # (Mistral 4's: turns, scales none)
        w = self.kv_b_proj.weight                                                # [heads, nope + v, latent]
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)   # [T, heads, latent]
        query = torch.cat([q_latent, pe[:, :heads]], dim=-1)                    # [T, heads, latent_dim]
        if self.scales_queries:
            query = query * rope_rows[1].to(query.dtype)                         # [T, 1, 1]: each token's scale
        return query, torch.cat([self.kv_a_layernorm(kv[:, :latent].contiguous()), pe[:, heads]], dim=-1)[:, None]

    def attend(self, hidden: torch.Tensor, bottleneck: torch.Tensor | None, rope_rows: RopeRows, query: torch.Tensor,
               entry: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        """Store each token's row in the layer's cache (its K and V: one plane) and attend every earlier one:
        [T, heads, latent_dim], each head's weighted sum of rows (its first kv_lora_rank values the latent's)."""
        if self.kv_observer is not None:
            self.kv_observer(entry, entry)
        backend.store_kv(entry, entry, cache, cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        return backend.paged_attention(query, cache, cache, meta, self.scale, None, k_scale=self.k_scale,
                                       v_scale=self.v_scale, sinks=self.sinks)


class DeepseekRouter(nn.Module):
    """The router's weight [num_experts, hidden] and V3's `e_score_correction_bias` (MiniMax-M2's too), in float32
    whatever the model's dtype (`engine.models.build_model` reads `float32_parameters`), as transformers holds
    DeepSeek's; MiniMax-M2's and Mistral 4's in the model's dtype, as transformers holds them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.float32_parameters = config.moe_router not in ("minimax_m2", "mistral4")
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts)) \
            if config.moe_router in ("deepseek_v3", "minimax_m2", "ernie4_5") else None


class DeepseekMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts with DeepSeek's router (the module docstring) and ungated shared experts; `softcap` (0:
    none) caps the router's logits, cap x tanh(logit / cap), before their scores (Laguna's)."""

    softcap = 0.0
    masked_choice: float | None = None   # the choice score of an expert outside the picked groups (None: V3's -inf
    # for a sigmoid router, 0 for a softmax one; A.X-K2's 0 for its sigmoid one)

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.gate = DeepseekRouter(config)
        self.sigmoid = config.moe_router in ("deepseek_v3", "minimax_m2")
        self.biased = self.sigmoid or config.moe_router == "ernie4_5"   # ERNIE 4.5's: on the softmax's scores
        self.best_two = self.sigmoid or config.moe_router == "mistral4"   # a group's score: its best two's sum
        self.num_groups, self.topk_group = config.moe_groups
        self.routed_scaling_factor = config.routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (weights [num_tokens, top_k] float32, experts [num_tokens, top_k]), as
        transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter (MiniMaxM2TopKRouter: its logits in the model's
        dtype; Ernie4_5_MoeTopKRouter: the softmax's, picked after the correction bias; Mistral4TopkRouter: the
        softmax's in V3's groups) pick and weigh them."""
        weight = self.gate.weight                                               # [num_experts, hidden]
        logits = F.linear(x.float(), weight) if self.gate.float32_parameters else F.linear(x, weight).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias if self.biased else scores
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.best_two else grouped.max(dim=-1).values
            groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
            keep = keep.repeat_interleave(self.num_experts // self.num_groups, dim=-1)
            fill = self.masked_choice if self.masked_choice is not None else float("-inf") if self.sigmoid else 0.0
            choice = choice.masked_fill(~keep, fill)
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class DeepseekForCausalLM(Qwen3MoeForCausalLM):
    """DeepSeek V2 / V3: Qwen3-MoE's model with `MlaAttention` layers and `DeepseekMoeBlock`s past the first
    `first_k_dense_replace` (dense) layers; the loading reorders the rotary rows and cuts the latent attention."""

    moe_block = DeepseekMoeBlock
    attention = MlaAttention   # DeepSeek V3.2's: engine.models.deepseek_v32.DsaAttention

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        config = replace(self.config, head_dim=self.config.mla.qk_rope_head_dim)
        if config.llama4_scaling_beta is None:
            return RotaryEmbedding(config, ops)
        return Ministral3Rotary(config, ops, num_heads=0)   # Mistral 4: rows with each query's scale, for MlaAttention

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = self.attention(self.config, self.shard, self.comm, self.rotary_emb, ops)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The shared experts under Qwen2-MoE's name (one MLP); q's and the latent projection's rotary rows from
        interleaved pairs to halves; the multi-token-prediction layers (past the model's) skipped; experts stacked
        as transformers saves Mistral 4's ([experts, out, in], read whatever the shapes: a square stack is
        ambiguous to Qwen3-MoE's reading) as each expert's."""
        name = moe_checkpoint_name(self.config, name)
        if name is None:
            return ()
        mla = self.config.mla
        if mla.rope_interleave:
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                tensor = rope_rows_to_halves(tensor, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_rope_head_dim)
            elif ".self_attn.kv_a_proj_with_mqa." in name:
                tensor = rope_rows_to_halves(tensor, mla.latent_dim, mla.qk_rope_head_dim)
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)   # transformers' [experts, out, in] (Mistral 4's), as the hub's stack
        return super().read_tensor(hf_name, name, tensor)   # stacked experts (`stacked_experts`) as each expert's

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        if ".self_attn." not in name:
            return super()._destination(name, hf_name)
        if name.endswith("kv_b_proj.weight"):   # [heads x (nope + v), latent] into [heads, nope + v, latent]
            return name, lambda data: data.view(-1, data.shape[-1])
        return name, lambda data: data

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads' rows of q_proj / q_b_proj, kv_b_proj and g_proj (Ling 3's), their o_proj columns (its
        bias on rank 0); the latent projections and norms whole; the rest as Qwen3-MoE's."""
        shard, mla = self.shard, self.config.mla
        if shard.size == 1 or ".self_attn." not in name:
            return super()._shard_of(hf_name, name, tensor)
        qk, heads = mla.qk_nope_head_dim + mla.qk_rope_head_dim, self.config.num_heads
        per_head = {"q_proj.weight": (0, qk), "q_b_proj.weight": (0, qk), "o_proj.weight": (1, mla.v_head_dim),
                    "q_gate_proj.weight": (0, qk + mla.v_head_dim),   # A.X-K2's: each head's q, then its gate
                    "kv_b_proj.weight": (0, mla.qk_nope_head_dim + mla.v_head_dim), "g_proj.weight": (0, 1)}
        kind = ".".join(name.split(".")[-2:])
        if kind == "o_proj.bias":
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        if kind not in per_head:
            return tensor
        dim, rows = per_head[kind]
        if tensor.dim() != 2 or tensor.shape[dim] != heads * rows:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({heads * rows} along dimension {dim})")
        return shard.heads_of(tensor, rows, dim)


def past_the_layers(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor `name` (without "model.") lies in a layer past the model's `num_layers` (a
    multi-token-prediction layer: DeepSeek's, GLM-OCR's)."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= num_layers


def moe_checkpoint_name(config: ModelConfig, name: str) -> str | None:
    """A DeepSeek or GLM-4.5 checkpoint tensor's name as Qwen3-MoE's loading reads it: the shared experts under
    Qwen2-MoE's name (one MLP), a correction bias stored beside the router (K-EXAONE's, HY V3's) as the router's;
    None for multi-token-prediction weights (a layer past the model's, or `mtp.`: K-EXAONE's), which are skipped.
    Layers saved as `blocks.N` (transformers 5's save of Kimi K2.5 turns its vision tower's rename of blocks to layers
    back on the text model's too) are read as `layers.N`."""
    if name.startswith("blocks.") and config.text_weights_prefix:
        name = "layers." + name.removeprefix("blocks.")
    if name.startswith("mtp.") or past_the_layers(name, config.num_layers):
        return None
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.").replace(
        ".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")


def rope_rows_to_halves(rows: torch.Tensor, group: int, rope: int, first: bool = False) -> torch.Tensor:
    """rows [n x group, ...] (a projection's rows, or its bias): in each group the last `rope` rows (the `first`
    ones where asked: GLM-5's indexer), rotary pairs (2i, 2i + 1), reordered as `interleaved_to_halves` orders a head
    (evens, then odds), whose halves the engine's rotary turns."""
    groups = rows.reshape(rows.shape[0] // group, group, *rows.shape[1:]).clone()
    part = slice(0, rope) if first else slice(group - rope, group)
    turned = groups[:, part]
    groups[:, part] = interleaved_to_halves(turned.reshape(-1, *rows.shape[1:]), rope).reshape(turned.shape)
    return groups.reshape(rows.shape)


class AXK1MoeBlock(DeepseekMoeBlock):
    """A.X-K1's sparse layer: DeepSeek V3's, its output (the routed experts' sum plus the shared expert's, summed
    over the ranks) normed (`post_mlp_layernorm`), as transformers' `AXK1MoE`."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(super().forward(x))


class AXK1ForCausalLM(DeepseekForCausalLM):
    """SK Telecom's A.X-K1: DeepSeek V3 whose sparse layers norm their output (`AXK1MoeBlock`). The release stores
    that norm on every layer (`layers.N.post_mlp_layernorm`, transformers' `mlp.post_mlp_layernorm`); a dense
    layer's is not used, as transformers' model does not use it, and is skipped."""

    moe_block = AXK1MoeBlock

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and "post_mlp_layernorm" in parts:
            if not self.config.is_sparse_layer(int(parts[1])):
                return ()
            name = name.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.").replace(
                ".post_mlp_layernorm.", ".mlp.post_mlp_layernorm.")
        return super().read_tensor(hf_name, name, tensor)


class LongcatMoeBlock(DeepseekMoeBlock):
    """LongCat-Flash's experts (`engine.longcat_config`): ERNIE 4.5's router (the softmax's scores plus the correction
    bias choose, the scores weigh, not renormalised) over the routed experts and the zero experts past them; a token
    routed to a zero expert takes back itself times that expert's weight, added after the ranks' sum (the routed
    experts run as Qwen3-MoE's, a zero expert's pick among them as expert 0 weighted 0, held in FP8 or packed alike)."""

    forward_runs_experts = True

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.gate = DeepseekRouter(replace(config, num_experts=config.num_experts + config.zero_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)                                         # float32 weights [tokens, top_k]
        zero = experts >= self.num_experts
        routed = self._experts(x, weights.masked_fill(zero, 0.0), experts.masked_fill(zero, 0))
        passed = (weights * zero).sum(dim=-1, keepdim=True)                      # the zero experts' weights' sum
        return self.comm.all_reduce(routed) + (passed * x.float()).to(x.dtype)


class LongcatSublayer(nn.Module):
    """One of the two sublayers of a LongCat-Flash layer: latent attention, then a dense MLP, each pre-norm with its
    residual. The first also runs the layer's experts (`moe`) over its MLP's input and keeps their output in
    `shortcut` (the pair's); the second adds it to its MLP's output, so the residual stream takes it there, as
    transformers' layer adds it after its second MLP."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, shortcut: list[torch.Tensor], first: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = MlaAttention(config, shard, comm, rotary_emb, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, shard, comm, ops)
        self.moe = LongcatMoeBlock(config, shard, comm, ops) if first else None
        self.shortcut = shortcut   # a plain list the pair shares, not a module

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope_rows, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.moe is not None:
            self.shortcut[:] = [self.moe(hidden)]
            return self.mlp(hidden), residual
        return self.mlp(hidden) + self.shortcut.pop(), residual


class LongcatFlashForCausalLM(DeepseekForCausalLM):
    """Meituan's LongCat-Flash (`engine.longcat_config`): each checkpoint layer J is the engine's layers 2J and 2J + 1
    (`LongcatSublayer`), its `self_attn.K`, `mlps.K` and norms `.K` read as layer 2J + K's, its experts and router
    (`mlp.router.classifier`) as layer 2J's `moe` (read, cut and placed as Qwen3-MoE's `mlp`); its latent attention
    scales q's bottleneck projection by sqrt(hidden / q_lora_rank) and the normed latent by sqrt(hidden /
    kv_lora_rank), folded into `q_b_proj` and `kv_a_layernorm` as read (equal up to rounding). Experts per expert, or
    stacked as transformers saves them (with gate/up rows for the zero experts too, not read)."""

    @property
    def graph_safe(self) -> bool:
        return all(layer.moe is None or layer.moe.fused_moe is not None for layer in self.layers)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        pairs = self.__dict__.setdefault("_shortcuts", {})
        return LongcatSublayer(self.config, self.shard, self.comm, self.rotary_emb, ops,
                               pairs.setdefault(index // 2, []), index % 2 == 0)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts, config, mla = name.split("."), self.config, self.config.mla
        moe = len(parts) > 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] == "mlp"
        if moe:
            rest = ".".join(parts[3:]).replace("router.classifier.", "gate.").replace("router.", "gate.")
            if rest == "experts.gate_up_proj" and tensor.dim() == 3:
                tensor = tensor[:config.num_experts]   # the zero experts' rows: nothing reads them
            expert = rest.split(".")[1] if rest.startswith("experts.") else ""
            if expert.isdigit() and config.num_experts <= int(expert) < config.num_experts + config.zero_experts:
                return ()   # a zero expert's (transformers saves gate/up rows for them too)
            name = f"layers.{2 * int(parts[1])}.mlp.{rest}"
        elif len(parts) > 3 and parts[0] == "layers" and parts[1].isdigit() and parts[3] in ("0", "1") \
                and parts[2] in ("self_attn", "mlps", "input_layernorm", "post_attention_layernorm"):
            kind = "mlp" if parts[2] == "mlps" else parts[2]
            name = ".".join(("layers", str(2 * int(parts[1]) + int(parts[3])), kind, *parts[4:]))
        if name.endswith(".self_attn.q_b_proj.weight"):
            tensor = tensor * (config.hidden_size / mla.q_lora_rank) ** 0.5
        elif name.endswith(".self_attn.kv_a_layernorm.weight"):
            tensor = tensor * (config.hidden_size / mla.kv_lora_rank) ** 0.5
        read = super().read_tensor(hf_name, name, tensor)   # the experts as Qwen3-MoE's `mlp`'s, then our `moe`'s
        return ((n.replace(".mlp.", ".moe.", 1) if moe else n, t) for n, t in read)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The experts and router (`moe`) as Qwen3-MoE's `mlp`: each expert's gate, up and down into w13 and w2."""
        if ".moe." not in name:
            return super()._destination(name, hf_name)
        target, part = super()._destination(name.replace(".moe.", ".mlp."), hf_name)
        return target.replace(".mlp.", ".moe."), part

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return super()._shard_of(hf_name, name.replace(".moe.", ".mlp."), tensor)
