"""Tencent's HY V4 (`HYV4ForCausalLM`, Hy4-preview; its config: `engine.hy_v4_config`): DeepSeek V3.2's layers (latent
attention made sparse by an indexer, `engine.models.deepseek_v32`; the experts of DeepSeek V3) under independent
hyper-connections.

The residual stream is `streams` copies of the hidden state a token ([T, streams, hidden], the embedding's copies to
begin with). Each sublayer (attention, then the MLP) reads one mix of them and writes its output into every one
(`engine.models.hyper_connections.HyperConnection`): from the streams flattened, in float32, a projection `fn` (times
the reciprocal RMS of the flattened streams) gives each stream a pre logit and a post logit; the sublayer's input is
the streams' sum, stream s times sigmoid(pre_s x scale_0 + base_s) + eps, normed as usual; stream s then takes the
output times magnitude x sigmoid(post_s x scale_1 + base_s') + eps, in float32, rounded to the model's dtype. The head
reads a last mix (`HyperHead`: pre weights alone), then the final norm. The mixes are whole on every rank (the streams
are: every sublayer's output is summed over the ranks first) and held in float32, as transformers holds them.

Past V3.2: each head's output (its value-space sum) is multiplied by sigmoid(`gate_proj` of the layer's input), per
channel, before o_proj; each head has a learned sink logit in its softmax's denominator (`MlaAttention.sinks`, read by
the paged kernels and the sparse ones); the indexer rotates the last `qk_rope_head_dim` of its heads (their rows
moved first as read, q.k unchanged: V3.2's indexer turns the first ones), its LayerNorm's epsilon the model's; the
latent attention's rotary turns halves (no rows reordered); the routed experts' SwiGLU is clamped
(`ClampedSiluAndMul`), the shared expert's and the dense MLPs' not. Decode steps replay CUDA graphs of both of V3.2's
regimes (`engine.models.deepseek_v32`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RMSNorm, RopeRows, RotaryEmbedding
from engine.layers.activation import ClampedSiluAndMul
from engine.model import MLP
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM, DsaAttention
from engine.models.hyper_connections import HyperConnection, HyperHead, written
from engine.models.qwen3_moe import with_experts
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused

__all__ = ["HYV4ForCausalLM"]

# the release's names (as transformers' conversion mapping reads them, and saves them back), in order: the streams'
# mixes under `hc_pre.`, the sinks, every `linear_gate` a gate_proj (the attention's output gate, the MLPs' gates)
RELEASE_NAMES = ((".hc_pre.hc_", ".hc_"), (".learnable_sink_param", ".sinks"), (".linear_gate.", ".gate_proj."),
                 (".hc_attn_layer.hc_", ".attn_hc."), (".hc_mlp_layer.hc_", ".ffn_hc."), (".hc_head_", ".hc_"))


class HYV4Attention(DsaAttention):
    """V3.2's sparse latent attention with a sink a head and each head's output gated per channel by `gate_proj` of
    the layer's input (this rank's heads' rows); the indexer's LayerNorm at the model's epsilon."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops)
        mla = config.mla
        self.gate_proj = nn.Linear(config.hidden_size, self.num_heads * mla.v_head_dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.indexer.k_norm = nn.LayerNorm(mla.index_head_dim, eps=config.rms_norm_eps)

    def queries(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        bottleneck, q, _ = super().queries(hidden)
        return bottleneck, q, self.gate_proj(hidden).view(-1, self.num_heads, self.mla.v_head_dim)


class HYV4MoeBlock(DeepseekMoeBlock):
    """DeepSeek V3's experts (grouped sigmoid router, ungated shared expert), the routed ones' SwiGLU clamped at
    `swiglu_limit` where set."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        if config.swiglu_limit is not None:
            self.act_fn = ClampedSiluAndMul(config.swiglu_limit)


class HYV4Layer(nn.Module):
    """One layer over the streams: attention, then the MLP (or the experts), each through its `HyperConnection`."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType) -> None:
        super().__init__()
        h, eps, hyper = config.hidden_size, config.rms_norm_eps, config.hyper_connections
        self.attn_hc = HyperConnection(hyper, h, eps)
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.self_attn = HYV4Attention(config, shard, comm, rotary_emb, ops)
        self.ffn_hc = HyperConnection(hyper, h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = MLP(config, shard, comm, ops)

    def forward(self, streams: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        post, x = self.attn_hc(streams)
        streams = written(streams, post, self.self_attn(self.input_layernorm(x), rope_rows, kv_cache, meta, backend))
        post, x = self.ffn_hc(streams)
        return written(streams, post, self.mlp(self.post_attention_layernorm(x)))


class HYV4ForCausalLM(DeepseekV32ForCausalLM):
    """HY V4 (the module docstring): `HYV4Layer`s over the streams, the experts past the dense first layers
    (`HYV4MoeBlock`), the layers `indexer_types` calls shared without an indexer, the streams mixed into one by
    `hc_head` before the final norm."""

    moe_block = HYV4MoeBlock

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        self.hc_head = HyperHead(config.hyper_connections, config.hidden_size, config.rms_norm_eps)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = with_experts(self, HYV4Layer(self.config, self.shard, self.comm, self.rotary_emb, ops), index, ops)
        if index in self.config.mla.index_shared:
            layer.self_attn.indexer = None
        return layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        hidden = self.embed(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.config.hyper_connections.streams, -1).contiguous()
        rope_rows = self.rotary_emb.rows(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            streams = layer(streams, rope_rows, kv_cache, meta, backend)
        return self.norm(self.hc_head(streams))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's names as ours (`RELEASE_NAMES`); the multi-token-prediction layers (`mtp_layers.`) skipped, as
        transformers skips them; each indexer head's last `qk_rope_head_dim` rows (of wq_b, wk and its LayerNorm)
        moved first, where V3.2's indexer turns them."""
        if name.startswith("mtp_layers."):
            return ()
        for release, ours in RELEASE_NAMES:
            name = f".{name}".replace(release, ours)[1:]
        mla = self.config.mla
        if name.endswith(("indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight",
                          "indexer.k_norm.bias")):
            heads = tensor.unflatten(0, (-1, mla.index_head_dim))
            tensor = heads.roll(mla.qk_rope_head_dim, dims=1).flatten(0, 1)
        return super().read_tensor(hf_name, name, tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads' sinks and their rows of `gate_proj`; the rest as V3.2's."""
        shard = self.shard
        if shard.size > 1 and name.endswith(("self_attn.sinks", "self_attn.gate_proj.weight")):
            return shard.heads_of(tensor, 1 if name.endswith("sinks") else self.config.mla.v_head_dim)
        return super()._shard_of(hf_name, name, tensor)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        if ".attn_hc." in name or ".ffn_hc." in name or name.startswith("hc_head."):
            return name, lambda data: data
        return super()._destination(name, hf_name)
