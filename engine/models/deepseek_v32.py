"""DeepSeek V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek V3's model whose every
attention is sparse (DeepSeek Sparse Attention): an indexer scores each earlier token for each query, and the query
attends only to its `index_topk` best.

The indexer (`DsaIndexer`, transformers' `DeepseekV32Indexer`): `index_heads` query heads of `index_head_dim` from q's
normed bottleneck (`wq_b`), one key a token from the hidden state (`wk`, then a LayerNorm), the first
`qk_rope_head_dim` of each rotated by the model's rotary (halves, as transformers turns them: its rows are not
reordered), and a float32 weight a head and token (`weights_proj`, times 1 / sqrt(heads)). Its key is kept in the
cache beside the token's latent: a layer's cache row is [latent, rotated key, indexer key] (`MlaShape.cache_dim`,
704 for V3.2), so block tables, prefix caching, swap, copy-on-write and an FP8 cache (one scale for the row) hold it
unchanged. transformers' scores are computed without the FP8 and Hadamard steps of DeepSeek's own kernels (equal up
to rounding); so are ours. GLM-5's indexers turn interleaved pairs (their q and k rows, and the LayerNorm's entries,
reordered as read: q.k and the norm unchanged), and its `index_shared` layers have none: they attend to the last
earlier indexer's choice of the same step (kept in the step's `AttentionMetadata.backend_cache`), their rows' indexer
part zeros.

Attention (`DsaAttention`): while no sequence of the step has more than `index_topk` tokens, every query's best
`index_topk` are all its earlier tokens and the attention is V3's (the paged kernels over the rows, the query padded
with zeros over the indexer's part: q.k unchanged); past that the indexer picks and the query attends to its choice
alone, by the backend's kernels where it has them (`kernels.triton_dsa` on CUDA), else by `kernels.dsa`'s torch
reference. Which path runs is decided by the step's lengths on the host, so the decode graphs of sequences of up to
`index_topk` tokens (`graph_max_len`: a chat pool's decodes) hold V3's paged kernels, and those of longer ones (doubling
lengths up to the longest served, `graph_sparse_regime`) the Triton indexer and sparse kernels, told that length: the
indexer scores that many positions for every query (-inf past its own), the top-k of a fixed width follows, and each
token's sequence and position come from the step's device lengths (`kernels.triton_dsa.token_layout`).

Tensor parallelism: the indexer is whole on every rank (the cache's rows are), each rank attends its own heads over
the rows the same choice picks.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm, RopeRows, RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekForCausalLM, DeepseekMoeBlock, MlaAttention, rope_rows_to_halves
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata
from kernels.dsa import attend_chosen, choose_tokens

__all__ = ["AXK2ForCausalLM", "DeepseekV32ForCausalLM", "DsaAttention", "DsaIndexer"]

CHOICE = "dsa_choice"   # the step's last indexer's choice, in `AttentionMetadata.backend_cache`

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
        self.indexer: DsaIndexer | None = DsaIndexer(config, rotary_emb)   # None: a GLM-5 `shared` layer

    def attend(self, hidden: torch.Tensor, bottleneck: torch.Tensor | None, rope_rows: RopeRows, query: torch.Tensor,
               entry: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        mla, indexer = self.mla, self.indexer
        if indexer is not None:
            index_q, index_k = indexer.keys(hidden, bottleneck, rope_rows)
            entry = torch.cat([entry, index_k[:, None].to(entry.dtype)], dim=-1)   # [T, 1, cache_dim]
        else:
            entry = F.pad(entry, (0, mla.index_head_dim))
        if max(meta.seq_lens_list, default=0) <= mla.index_topk:   # every earlier token is among the best
            return super().attend(hidden, bottleneck, rope_rows, F.pad(query, (0, mla.index_head_dim)), entry,
                                  cache, meta, backend)
        if self.kv_observer is not None:
            self.kv_observer(entry, entry)
        backend.store_kv(entry, entry, cache, cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        if indexer is not None:   # the backend's own (Triton's), else the torch reference
            choose = getattr(backend, "dsa_choose_tokens", choose_tokens)
            meta.backend_cache[CHOICE] = choose(index_q, indexer.head_weights(hidden), cache, meta, mla.index_topk,
                                                mla.latent_dim, index_scale=indexer.softmax_scale, k_scale=self.k_scale)
        attend = getattr(backend, "dsa_attend_chosen", attend_chosen)
        return attend(query, meta.backend_cache[CHOICE], cache, meta, self.scale, mla.kv_lora_rank, mla.latent_dim,
                      k_scale=self.k_scale, sinks=self.sinks)

    def warm_kernels(self, backend, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     dtype: torch.dtype) -> bool:
        """The backend's indexer and sparse kernels run once over this layer's cache (`meta`: one made-up decode, its
        rows read, not written), so Triton compiles their one variant before serving, not at the first step past
        `index_topk` (`ModelRunner.warm_sparse_kernels`; `dtype`: the model's); False where the backend has none or
        this layer reuses another's choice."""
        indexer, mla, cache = self.indexer, self.mla, kv_cache[0]
        if indexer is None or not hasattr(backend, "dsa_choose_tokens"):
            return False
        device = cache.device
        index_q = torch.zeros(1, indexer.heads, indexer.head_dim, dtype=dtype, device=device)
        choice = backend.dsa_choose_tokens(index_q, torch.zeros(1, indexer.heads, device=device), cache, meta,
                                           mla.index_topk, mla.latent_dim, index_scale=indexer.softmax_scale,
                                           k_scale=self.k_scale)
        query = torch.zeros(1, self.num_heads, mla.latent_dim, dtype=dtype, device=device)
        backend.dsa_attend_chosen(query, choice, cache, meta, self.scale, mla.kv_lora_rank, mla.latent_dim,
                                  k_scale=self.k_scale, sinks=self.sinks)
        return True


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    """DeepSeek V3's model with `DsaAttention` layers (GLM-5's `shared` ones without an indexer)."""

    attention = DsaAttention
    graph_sparse_regime = True   # the Triton indexer and sparse kernels launch alike for any length they are given

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        if index in self.config.mla.index_shared:
            layer.self_attn.indexer = None
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """V3's reading; GLM-5's indexers' rotary rows (the first `qk_rope_head_dim` of each of wq_b's heads, of wk
        and of its LayerNorm) from interleaved pairs to halves."""
        mla = self.config.mla
        if mla.index_rope_interleave and name.endswith(("indexer.wq_b.weight", "indexer.wk.weight",
                                                        "indexer.k_norm.weight", "indexer.k_norm.bias")):
            tensor = rope_rows_to_halves(tensor, mla.index_head_dim, mla.qk_rope_head_dim, first=True)
        return super().read_tensor(hf_name, name, tensor)

    @property
    def graph_max_len(self) -> int:
        """`index_topk`: the dense regime's longest sequence (the step's lengths pick the dense or the sparse attention
        on the host: decode graphs are captured for each regime, the module docstring)."""
        return self.config.mla.index_topk


class AXK2Attention(DsaAttention):
    """A.X-K2's attention: V3.2's, each head's query and a gate on its output from one projection (`q_gate_proj`) of
    q's bottleneck normed and raw side by side; the indexer reads the normed one, as V3.2's."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops)
        mla = config.mla
        del self.q_b_proj
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.q_gate_proj = nn.Linear(2 * mla.q_lora_rank, self.num_heads * (qk + mla.v_head_dim), bias=False)

    def queries(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mla = self.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        raw = self.q_a_proj(hidden)
        bottleneck = self.q_a_layernorm(raw)
        q_gate = self.q_gate_proj(torch.cat([bottleneck, raw], dim=-1)).view(-1, self.num_heads, qk + mla.v_head_dim)
        return bottleneck, q_gate[..., :qk], q_gate[..., qk:]


class GatedRMSNorm(nn.Module):
    """A.X-K2's norm: an RMSNorm whose output is multiplied by sigmoid(fc2(silu(fc1(output)))) (`mlp`: a bottleneck
    of `gated_norm_rank`), the gate in float32; with a residual, the fused add-and-norm's (output, residual)."""

    def __init__(self, config: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(config.hidden_size, config.mla.gated_norm_rank, bias=False)
        self.mlp.fc2 = nn.Linear(config.mla.gated_norm_rank, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._gated(self.norm(x))
        normed, residual = self.norm(x, residual)
        return self._gated(normed), residual

    def _gated(self, y: torch.Tensor) -> torch.Tensor:
        return (y * torch.sigmoid(self.mlp.fc2(F.silu(self.mlp.fc1(y))).float())).to(y.dtype)


class AXK2MoeBlock(DeepseekMoeBlock):
    """A.X-K2's experts: V3's, an expert outside the picked groups chosen at 0 (transformers' reference), not -inf."""

    masked_choice = 0.0


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    """SK Telecom's A.X-K2 (`AXK2ForCausalLM`: A.X-K2-Light and the larger releases): DeepSeek V3.2's model with
    `AXK2Attention`, each layer's input norm and each sparse layer's norm before its experts gated (`GatedRMSNorm`),
    experts in groups where `n_group` is named (`AXK2MoeBlock`). Its fused q and gate rows (each head's q, then its
    gate) have their rotary rows reordered as read, as V3's q_b_proj's."""

    attention = AXK2Attention
    moe_block = AXK2MoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.input_layernorm = GatedRMSNorm(self.config, ops)
        if self.config.is_sparse_layer(index):
            layer.post_attention_layernorm = GatedRMSNorm(self.config, ops)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's names (transformers saves them so too): its fused q and gate as `self_attn.q_b_proj`, its
        norms' gates as `W_down` / `W_up`."""
        mla = self.config.mla
        name = name.replace("self_attn.q_b_proj.", "self_attn.q_gate_proj.").replace(
            "layernorm.W_down.", "layernorm.mlp.fc1.").replace("layernorm.W_up.", "layernorm.mlp.fc2.")
        if name.endswith("self_attn.q_gate_proj.weight") and tensor.dim() == 2:
            qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            heads = tensor.reshape(-1, qk + mla.v_head_dim, tensor.shape[-1])
            q = rope_rows_to_halves(heads[:, :qk].reshape(-1, tensor.shape[-1]), qk, mla.qk_rope_head_dim)
            tensor = torch.cat([q.reshape(heads.shape[0], qk, -1), heads[:, qk:]], dim=1).reshape(tensor.shape)
        return super().read_tensor(hf_name, name, tensor)
