"""MiniMax M3's text model config (`MiniMaxM3VLForCausalLM`, the `text_config` of
`MiniMaxM3SparseForConditionalGeneration`) as transformers' `MiniMaxM3VLTextConfig` reads it: grouped-query attention
with Gemma's per-head q/k norms, some layers block-sparse (`layer_types` minimax_m3_sparse: each query attends to the
key blocks an indexer picks, `BlockIndexer`), Gemma's norms, and MLPs dense (`mlp_layer_types`,
`dense_intermediate_size` wide) or experts under DeepSeek V3's sigmoid router without groups beside one shared expert,
every SwiGLU GPT-OSS's clamped one.

`minimax_m3_config` reads config.json under the Llama reading's names: the dense MLP's width as `intermediate_size`
(transformers' `intermediate_size` is an expert's), the release's `sparse_attention_config` (`sparse_*` keys,
`sparse_attention_freq`) and `moe_layer_freq` as transformers maps them. What we do not serve is refused naming the
key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from engine.config import ConfigError
from engine.config_values import read_float, read_int
from engine.deepseek_config import grouped_experts
from engine.mla_config import TOPK_ENTRY_BYTES
from engine.rope_config import partial_rotary_factor

__all__ = ["BlockIndexer", "index_key_bytes", "index_key_dtype", "minimax_m3_config", "minimax_m3_fields"]

# MiniMaxM3VLTextConfig's where config.json names none (MiniMax M3's shape)
DEFAULTS = {"vocab_size": 200_064, "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12_288,
            "shared_intermediate_size": 3072, "num_hidden_layers": 60, "num_attention_heads": 64,
            "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 524_288, "rms_norm_eps": 1e-6,
            "num_local_experts": 128, "num_experts_per_tok": 4, "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0, "index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128,
            "index_topk_blocks": 16, "index_local_blocks": 1, "rope_theta": 5_000_000.0, "tie_word_embeddings": False,
            "bos_token_id": 200_034, "eos_token_id": 200_020}
# the release's `sparse_attention_config` keys -> transformers'
SPARSE_KEYS = {"sparse_num_index_heads": "index_n_heads", "sparse_index_dim": "index_head_dim",
               "sparse_block_size": "index_block_size", "sparse_topk_blocks": "index_topk_blocks",
               "sparse_local_block": "index_local_blocks"}
SPARSE = "minimax_m3_sparse"


@dataclass(frozen=True)
class BlockIndexer:
    """MiniMax M3's block-sparse attention: on `layers`, each query's indexer (`num_heads` heads of `head_dim`, one
    per KV head, against one key a token) scores every earlier key, each block of `block_size` keys scores its best
    key's, and the query attends (through its KV head's indexer head) to the keys of the `topk_blocks` best blocks
    and of its own and the `local_blocks` - 1 before it, whatever they score. The cache keeps each token's indexer
    key beside its K/V on those layers."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int

    def index_bytes_per_token(self, itemsize: int) -> int:
        """The indexer keys a token adds to the cache (whole on every rank)."""
        return len(self.layers) * self.head_dim * itemsize

    def graph_scores_bytes(self, max_len: int, kv_heads: int) -> int:
        """A decode token's bytes in a sparse regime's CUDA graphs (`engine.cuda_graphs.capture_lengths`, graphs of
        sequences of up to `max_len`) on a rank of `kv_heads` KV heads: each head's float32 score of every block, the
        top-k's values and block ids and two masks; 0 where `max_len` is within the dense regime."""
        if max_len <= self.topk_blocks * self.block_size:
            return 0
        return kv_heads * (4 * -(-max_len // self.block_size) + self.topk_blocks * TOPK_ENTRY_BYTES)

    def num_params(self, hidden_size: int, kv_heads: int) -> int:
        """Each sparse layer's indexer on a rank of `kv_heads` KV heads (a head each: their q rows; k whole), its q
        and k norms."""
        d = self.head_dim
        return len(self.layers) * (hidden_size * (kv_heads + 1) * d + 2 * d)


def index_key_bytes(config: Any, itemsize: int) -> int:
    """The indexer keys a token adds to `config`'s cache of `itemsize`-byte K/V on every rank (0 without block-sparse
    layers; in bfloat16 beside an FP8 cache: `index_key_dtype`)."""
    return config.block_indexer.index_bytes_per_token(max(itemsize, 2)) if config.block_indexer is not None else 0


def index_key_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """What the indexer keys are kept in beside K/V of `cache_dtype`: the same, or bfloat16 beside an FP8 cache (the
    keys pick blocks by their scores' order, which a per-layer FP8 scale would blur; at MiniMax M3's shape they add a
    quarter to a sparse layer's FP8 K/V bytes)."""
    return torch.bfloat16 if cache_dtype.itemsize == 1 else cache_dtype


def minimax_m3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names, `MiniMaxM3VLTextConfig`'s defaults where it names none."""
    cfg = DEFAULTS | {k: v for k, v in cfg.items() if v is not None}
    sparse = cfg.get("sparse_attention_config") or {}
    if not isinstance(sparse, dict):
        raise ConfigError(f"sparse_attention_config: must be an object, got {sparse!r:.80}")
    cfg |= {ours: sparse[theirs] for theirs, ours in SPARSE_KEYS.items() if theirs in sparse}
    if cfg.get("layer_types") is None and "sparse_attention_freq" in sparse:
        freq = sparse["sparse_attention_freq"]
        if not isinstance(freq, list):
            raise ConfigError(f"sparse_attention_config.sparse_attention_freq: a 0 or 1 a layer, got {freq!r:.80}")
        cfg["layer_types"] = [SPARSE if f else "full_attention" for f in freq]
    if cfg.get("mlp_layer_types") is None and isinstance(cfg.get("moe_layer_freq"), list):
        cfg["mlp_layer_types"] = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    # transformers serves its swigluoai as the clamped SwiGLU whatever `hidden_act` says
    return {**cfg, "intermediate_size": cfg["dense_intermediate_size"],
            "moe_intermediate_size": cfg["intermediate_size"], "hidden_act": "silu"}


def minimax_m3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Per-head q/k norms, the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`), the dense layers (`mlp_layer_types`
    dense), the experts (`num_local_experts` of `moe_intermediate_size`, `num_experts_per_tok` a token, renormalised,
    times `routed_scaling_factor`; the router's logits in the model's dtype, as MiniMax-M2's) beside a shared expert of
    `shared_intermediate_size`, and the block indexer (its head size the attention's)."""
    kinds = _kinds(cfg, "layer_types", ("full_attention", SPARSE), num_layers, "full_attention")
    mlps = _kinds(cfg, "mlp_layer_types", ("dense", "sparse"), num_layers, "sparse")
    keys = {"n_routed_experts": "num_local_experts"}
    fixed = {"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0, "n_shared_experts": 0}
    experts = grouped_experts({**cfg, **fixed}, {**fixed, "n_routed_experts": 128, "moe_intermediate_size": 3072,
                                                 "num_experts_per_tok": 4, "routed_scaling_factor": 2.0},
                              "minimax_m2", grouped=False, keys=keys)
    heads, kv_heads = read_int(cfg, "index_n_heads"), read_int(cfg, "num_key_value_heads")
    if heads != kv_heads:
        raise ConfigError(f"index_n_heads: MiniMax M3's indexer picks blocks for each KV head (transformers' contract),"
                          f" so it needs num_key_value_heads ({kv_heads}) heads, got {heads}")
    if read_int(cfg, "index_head_dim") != read_int(cfg, "head_dim"):
        raise ConfigError(f"index_head_dim: MiniMax M3's indexer is served with the attention's head size "
                          f"({cfg['head_dim']}: its rotary turns both alike), got {cfg['index_head_dim']!r}")
    indexer = BlockIndexer(layers=tuple(i for i, kind in enumerate(kinds) if kind == SPARSE), num_heads=heads,
                           head_dim=read_int(cfg, "index_head_dim"), block_size=read_int(cfg, "index_block_size"),
                           topk_blocks=read_int(cfg, "index_topk_blocks"),
                           local_blocks=read_int(cfg, "index_local_blocks", minimum=0))
    return {**experts, "mlp_only_layers": tuple(i for i, kind in enumerate(mlps) if kind == "dense"),
            "shared_expert_intermediate_size": read_int(cfg, "shared_intermediate_size", minimum=0),
            "qk_norm": True, "stacked_experts": True, "partial_rotary_factor": partial_rotary_factor(cfg, 1.0),
            "swiglu_limit": read_float(cfg, "swiglu_limit", 7.0),
            "swiglu_alpha": read_float(cfg, "swiglu_alpha", 1.702),
            "block_indexer": indexer if indexer.layers else None}


def _kinds(cfg: dict[str, Any], key: str, allowed: tuple[str, ...], num_layers: int, default: str) -> list[str]:
    kinds = cfg.get(key)
    if kinds is None:
        return [default] * num_layers
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in allowed for k in kinds):
        raise ConfigError(f"{key}: one of {', '.join(allowed)} for each of the {num_layers} layers, got {kinds!r:.120}")
    return kinds
