"""DeepSeek V3.2 (`DeepseekV32ForCausalLM`): DeepSeek V3's model whose every attention is sparse (DeepSeek Sparse
Attention): an indexer scores each earlier token for each query, and the query attends only to its `index_topk` best.

The indexer (`DsaIndexer`, transformers' `DeepseekV32Indexer`): `index_heads` query heads of `index_head_dim` from q's
normed bottleneck (`wq_b`), one key a token from the hidden state (`wk`, then a LayerNorm), the first
`qk_rope_head_dim` of each rotated by the model's rotary (halves, as transformers turns them: its rows are not
reordered), and a float32 weight a head and token (`weights_proj`, times 1 / sqrt(heads)). Its key is kept in the
cache beside the token's latent: a layer's cache row is [latent, rotated key, indexer key] (`MlaShape.cache_dim`,
704 for V3.2), so block tables, prefix caching, swap, copy-on-write and an FP8 cache (one scale for the row) hold it
unchanged. transformers' scores are computed without the FP8 and Hadamard steps of DeepSeek's own kernels (equal up
to rounding); so are ours.

Attention (`DsaAttention`): while no sequence of the step has more than `index_topk` tokens, every query's best
`index_topk` are all its earlier tokens and the attention is V3's (the paged kernels over the rows, the query padded
with zeros over the indexer's part: q.k unchanged); past that, `kernels.dsa.sparse_latent_attention` picks and
attends (torch ops on any device). Which path runs is decided by the step's lengths on the host, so the decode steps
of this model are not captured in CUDA graphs (`graph_safe` is false).

Tensor parallelism: the indexer is whole on every rank (the cache's rows are), each rank attends its own heads over
the rows the same choice picks.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RopeRows, RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekForCausalLM, MlaAttention
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata
from kernels.dsa import sparse_latent_attention

__all__ = ["DeepseekV32ForCausalLM", "DsaAttention", "DsaIndexer"]

INDEXER_NORM_EPS = 1e-6   # transformers' DeepseekV32Indexer: its k_norm's eps, no config key


class IndexerHeadWeights(nn.Module):
    """`weights_proj` [index_heads, hidden], held in float32 whatever the model's dtype (transformers keeps it so):
    `engine.models.build_model` reads `float32_parameters`."""

    float32_parameters = True

    def __init__(self, heads: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DsaIndexer(nn.Module):
    """The indexer of one layer (the module docstring), whole on every rank."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        mla = config.mla
        self.heads, self.head_dim, self.rope = mla.index_heads, mla.index_head_dim, mla.qk_rope_head_dim
        self.rotary_emb = rotary_emb
        self.wq_b = nn.Linear(mla.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = IndexerHeadWeights(self.heads, config.hidden_size)
        self.softmax_scale = self.head_dim ** -0.5

    def keys(self, hidden: torch.Tensor, bottleneck: torch.Tensor, rope_rows: RopeRows
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, heads, head_dim], keys [T, head_dim]), their first `qk_rope_head_dim` rotated."""
        q = self.wq_b(bottleneck).view(-1, self.heads, self.head_dim)
        k = self.k_norm(self.wk(hidden))
        pe = torch.cat([q[..., :self.rope], k[:, None, :self.rope]], dim=1)     # [T, heads + 1, rope]
        self.rotary_emb(pe, rope_rows)
        q = torch.cat([pe[:, :self.heads], q[..., self.rope:]], dim=-1)
        return q, torch.cat([pe[:, self.heads], k[:, self.rope:]], dim=-1)

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, heads] float32: each head's weight for each token, times 1 / sqrt(heads)."""
        return self.weights_proj(hidden) * self.heads ** -0.5


class DsaAttention(MlaAttention):
    """V3's latent attention with the indexer's choice (the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops)
        self.indexer = DsaIndexer(config, rotary_emb)

    def attend(self, hidden: torch.Tensor, bottleneck: torch.Tensor | None, rope_rows: RopeRows, query: torch.Tensor,
               entry: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        mla = self.mla
        index_q, index_k = self.indexer.keys(hidden, bottleneck, rope_rows)
        entry = torch.cat([entry, index_k[:, None].to(entry.dtype)], dim=-1)   # [T, 1, cache_dim]
        if max(meta.seq_lens_list, default=0) <= mla.index_topk:   # every earlier token is among the best
            return super().attend(hidden, bottleneck, rope_rows, F.pad(query, (0, mla.index_head_dim)), entry,
                                  cache, meta, backend)
        if self.kv_observer is not None:
            self.kv_observer(entry, entry)
        backend.store_kv(entry, entry, cache, cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        return sparse_latent_attention(query, index_q, self.indexer.head_weights(hidden), cache, meta, self.scale,
                                       mla.index_topk, mla.latent_dim, index_scale=self.indexer.softmax_scale,
                                       k_scale=self.k_scale)


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    """DeepSeek V3's model with `DsaAttention` layers."""

    attention = DsaAttention

    @property
    def graph_safe(self) -> bool:
        """Never: the step's lengths pick the dense or the sparse attention on the host (the module docstring)."""
        return False
