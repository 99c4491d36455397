"""MiniMax M3's text model (`MiniMaxM3VLForCausalLM`; served from `MiniMaxM3SparseForConditionalGeneration` too; its
config: `engine.minimax_m3_config`): GLM-4.5's model (the Llama layer, DeepSeek V3's experts beside a shared one) with
Gemma's norms (1 + weight, in float32) everywhere, Gemma's per-head q/k norms, GPT-OSS's clamped SwiGLU in every MLP
(dense, shared and routed: (up + 1) x gate x sigmoid(alpha x gate), gate and up in halves), the router's logits in the
model's dtype (MiniMax-M2's), and on the layers `BlockIndexer.layers` names, block-sparse attention
(`BlockSparseAttention`, `kernels.block_sparse`): an indexer of one head a KV head (q from its own projection, one key a
token, each Gemma-normed and turned by the attention's rotary) picks the key blocks each query attends to. A sparse
layer's cache keeps each token's indexer key beside its K/V (`engine.kv_cache.KVCache`: the layer's third tensor).
While no sequence of a step is longer than the blocks a query may choose (`topk_blocks` x `block_size`), every block is
chosen and the sparse layers attend densely (the backend's paged kernels); past that the indexer picks, through the
backend's kernels where it has them (`kernels.triton_block_sparse` on CUDA), else `kernels.block_sparse`'s torch
attention. The step's lengths pick the path on the host, so the decode graphs are captured for each regime, as
DeepSeek V3.2's: up to `graph_max_len` the paged kernels, past it the Triton block-sparse ones told the graph's length
(`graph_sparse_regime`; blocks past a query's position score -inf).

Checkpoints are read under the release's names (`language_model.model.`: `block_sparse_moe` with each expert's
`w1` / `w3` / `w2`, its `e_score_correction_bias` and `shared_experts`, the indexer as `self_attn.index_q_proj` ...;
the dense MLP's `gate_proj` / `up_proj`) or transformers' (stacked experts, fused `gate_up_proj`, `self_attn.indexer.`);
the multi-token-prediction weights (`mtp.`) are skipped. Under tensor parallelism each rank holds its KV heads'
indexer heads (their rows of the indexer's q projection); its key projection and norms are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import GemmaHeadRMSNorm, GemmaRMSNorm, RopeRows
from engine.layers.activation import ClampedSwiGLU
from engine.model import Attention, DecoderLayer, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock, moe_checkpoint_name
from engine.models.glm4 import Glm4MoeForCausalLM
from engine.models.phi3 import partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata
from kernels.block_sparse import block_sparse_attention

__all__ = ["BlockSparseAttention", "MiniMaxM3ForCausalLM", "MiniMaxM3MoeBlock"]

# the release's names -> ours, in order
_RELEASE = ((".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            (".block_sparse_moe.", ".mlp."), (".self_attn.index_", ".self_attn.indexer."))
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class BlockSparseAttention(Attention):
    """A sparse layer's attention (the module docstring): Llama's projections and Gemma's q/k norms, its indexer's
    (`indexer.q_proj`: this rank's KV heads' rows; `indexer.k_proj`, `q_norm`, `k_norm` whole), and attention over
    the key blocks the indexer picks."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer, GemmaHeadRMSNorm)
        self.index = config.block_indexer
        d = self.index.head_dim
        self.indexer = nn.Module()
        self.indexer.q_proj = nn.Linear(config.hidden_size, shard.num_kv_heads * d, bias=False)
        self.indexer.k_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.indexer.q_norm = GemmaHeadRMSNorm(d, config.rms_norm_eps)
        self.indexer.k_norm = GemmaHeadRMSNorm(d, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        qkv = self.qkv_proj(hidden).view(-1, heads + 2 * kv_heads, d)
        self.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        index = torch.cat([self.indexer.q_proj(hidden), self.indexer.k_proj(hidden)], dim=-1).view(-1, kv_heads + 1, d)
        self.indexer.q_norm(index[:, :kv_heads])
        self.indexer.k_norm(index[:, kv_heads:])
        self.rotary_emb(index, rope_rows)
        k_cache, v_cache, index_cache = kv_cache
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        backend.store_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        keys = index[:, kv_heads:]   # into their slots by the backend's store, as K and V in one (a padded row's: none)
        backend.store_kv(keys, keys, index_cache, index_cache, meta)
        if max(meta.seq_lens_list, default=0) <= self.index.topk_blocks * self.index.block_size:   # every block
            out = backend.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale=self.k_scale,
                                          v_scale=self.v_scale)
        else:   # the backend's own (Triton's), else the torch attention
            attend = getattr(backend, "block_sparse_attention", block_sparse_attention)
            out = attend(q, k_cache, v_cache, index[:, :kv_heads], index_cache, meta, self.scale,
                         block_size=self.index.block_size, topk_blocks=self.index.topk_blocks,
                         local_blocks=self.index.local_blocks, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def warm_kernels(self, backend, kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                     dtype: torch.dtype) -> bool:
        """The backend's block-sparse kernels run once over this layer's cache (`meta`: one made-up decode, its rows
        read, not written; q and the indexer's q views of fused rows, as `forward` makes them), so Triton compiles their
        one variant before serving, not at the first step past the dense regime (`ModelRunner.warm_sparse_kernels`;
        `dtype`: the model's); False where the backend has none."""
        if not hasattr(backend, "block_sparse_attention"):
            return False
        k_cache, v_cache, index_cache = kv_cache
        heads, kv_heads, device = self.num_heads, self.num_kv_heads, k_cache.device
        qkv = torch.zeros(1, heads + 2 * kv_heads, self.config.head_dim, dtype=dtype, device=device)
        index = torch.zeros(1, kv_heads + 1, self.index.head_dim, dtype=dtype, device=device)
        backend.block_sparse_attention(qkv[:, :heads], k_cache, v_cache, index[:, :kv_heads], index_cache, meta,
                                       self.scale, block_size=self.index.block_size, topk_blocks=self.index.topk_blocks,
                                       local_blocks=self.index.local_blocks, k_scale=self.k_scale, v_scale=self.v_scale)
        return True


class MiniMaxM3MoeBlock(DeepseekMoeBlock):
    """DeepSeek V3's experts and shared expert, each SwiGLU GPT-OSS's clamped one."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        if self.shared_expert is not None:
            self.shared_expert.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)


class MiniMaxM3ForCausalLM(Glm4MoeForCausalLM):
    """MiniMax M3 (the module docstring): GLM-4.5's model with Gemma's norms, the clamped SwiGLU, block-sparse layers
    and the release's names."""

    moe_block = MiniMaxM3MoeBlock
    norm_class = GemmaRMSNorm
    norm_init = 0.0
    graph_sparse_regime = True   # the Triton block-sparse kernels launch alike for any length they are given

    @property
    def graph_max_len(self) -> int | None:
        """The blocks a query may choose, `topk_blocks` x `block_size`: the sparse layers' dense regime's longest
        sequence (the module docstring); None without a block-sparse layer."""
        index = self.config.block_indexer
        return None if index is None else index.topk_blocks * index.block_size

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        config = self.config
        layer = self.with_own_norms(DecoderLayer(config, self.shard, self.comm, self.rotary_emb, ops, index))
        if config.block_indexer is not None and index in config.block_indexer.layers:
            layer.self_attn = BlockSparseAttention(config, self.shard, self.comm, self.rotary_emb, index)
        else:
            layer.self_attn = Attention(config, self.shard, self.comm, self.rotary_emb, index, GemmaHeadRMSNorm)
        if config.is_sparse_layer(index):
            layer.mlp = self.moe_block(config, self.shard, self.comm, ops)
        else:
            layer.mlp.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's names as ours (`_RELEASE`, each expert's w1 / w3 / w2), fused gate/up tensors (the dense MLP's,
        the shared expert's) as their halves, stacked experts as each expert's; q/k rows (the indexer's too)
        reordered for a partial rotary; the multi-token-prediction weights skipped."""
        for theirs, ours in _RELEASE:
            name = name.replace(theirs, ours)
        name = moe_checkpoint_name(self.config, name)
        if name is None:
            return
        head, sep, rest = name.partition(".mlp.experts.")
        expert, _, part = rest.partition(".")
        if sep and part.split(".")[0] in _EXPERT_PARTS:
            name = f"{head}.mlp.experts.{expert}.{_EXPERT_PARTS[part.split('.')[0]]}.{part.split('.', 1)[1]}"
        if name.endswith(".gate_up_proj.weight"):   # transformers' fused dense or shared MLP: gate, then up
            if tensor.shape[0] % 2:
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not a gate and an up projection")
            base = name.removesuffix("gate_up_proj.weight")
            yield from ((f"{base}{part}.weight", piece) for part, piece in zip(("gate_proj", "up_proj"),
                                                                               tensor.chunk(2)))
            return
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)   # transformers' [experts, out, in] (square ones ambiguous to Qwen3-MoE)
        turned = name.replace(".self_attn.indexer.", ".self_attn.")   # the indexer's heads turn as the attention's
        tensor = partial_rotary_rows(self.config, turned, tensor)
        yield from Qwen3MoeForCausalLM.read_tensor(self, hf_name, name, tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The indexer's q rows of this rank's KV heads, the rest of it whole; anything else as GLM-4.5's."""
        if self.shard.size == 1 or ".self_attn.indexer." not in name:
            return super()._shard_of(hf_name, name, tensor)
        if ".indexer.q_proj." not in name:
            return tensor
        d, shard = self.config.block_indexer.head_dim, self.shard
        if tensor.dim() != 2 or tensor.shape[0] != self.config.num_kv_heads * d:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({self.config.num_kv_heads * d} rows)")
        return tensor.narrow(0, shard.kv_head_start * d, shard.num_kv_heads * d)
