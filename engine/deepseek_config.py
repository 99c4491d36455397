"""The config.json fields of DeepSeek's family (`deepseek_fields`: DeepSeek V2, V3, GLM-4.7-Flash; `mistral4_fields`:
Mistral Small 4; `youtu_fields`: Youtu-LLM): the latent attention (`engine.mla_config`) and the grouped experts
(`grouped_experts`, GLM-4.5's too), each family's defaults its transformers config class's. What we do not serve is
refused naming the key."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mla_config import DSA_DEFAULTS, MLA_DEFAULTS, read_mla

DEEPSEEK_TOPK_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"),
                         "DeepseekV3ForCausalLM": ("noaux_tc",), "Glm4MoeLiteForCausalLM": ("noaux_tc",),
                         "DeepseekV32ForCausalLM": ("noaux_tc",), "GlmMoeDsaForCausalLM": ("noaux_tc",),
                         "AXK1ForCausalLM": ("noaux_tc",), "AXK2ForCausalLM": ("noaux_tc",)}


def deepseek_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek V2's and V3's fields (transformers' `DeepseekV2Config` / `DeepseekV3Config` names and defaults): the
    latent attention (`MlaShape`; the cache holds one 'KV head' of its latent and rotated key) and the experts
    (`grouped_experts`), V3's router the sigmoid with its correction bias (`topk_method: noaux_tc`), V2's the softmax,
    in groups where `topk_method: group_limited_greedy`. Unlike transformers, V2 renormalises its top k where
    `norm_topk_prob` says so (DeepSeek's and vLLM's reading; DeepSeek's V2 configs say not). DeepSeek V3.2
    (`DeepseekV32Config`) and GLM-5 (`GlmMoeDsaConfig`): V3's, every layer's attention sparse through an indexer
    (`_sparse_attention`). A.X-K1 (`AXK1Config`): V3's, its dense layers as `mlp_layer_types` says (else the first
    one), a norm on each sparse layer's output (`engine.models.deepseek.AXK1ForCausalLM`)."""
    v3 = arch != "DeepseekV2ForCausalLM"   # V3's router and keys: GLM-4.7-Flash's too (`Glm4MoeLiteForCausalLM`)
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in DEEPSEEK_TOPK_METHODS[arch]:
        raise ConfigError(f"topk_method: {arch} is served with {' or '.join(DEEPSEEK_TOPK_METHODS[arch])}, "
                          f"got {method!r}")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"scoring_func: {arch}'s router is served with {'sigmoid' if v3 else 'softmax'}, "
                          f"got {scoring!r}")
    if read_int(cfg, "moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq: {arch} is served with every layer past first_k_dense_replace sparse (1), "
                          f"got {cfg['moe_layer_freq']!r}")
    check_silu(cfg, "DeepSeek")
    cfg, indexer = _sparse_attention(cfg, arch) if arch in DSA_DEFAULTS else (cfg, {})
    if arch == "AXK2ForCausalLM":   # its q and output gate from one projection, its norms gated
        indexer |= {"q_gate": True, "gated_norm_rank": read_int(cfg, "gated_norm_rank", 16)}
    mla = read_mla(cfg, MLA_DEFAULTS[arch], interleave_key=v3 and arch not in DSA_DEFAULTS,
                   dsa=DSA_DEFAULTS.get(arch), **indexer)
    defaults = dict(n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, n_group=8, topk_group=4,
                    norm_topk_prob=True, first_k_dense_replace=3, routed_scaling_factor=2.5, n_shared_experts=1) if v3 \
        else dict(n_routed_experts=64, moe_intermediate_size=1407, num_experts_per_tok=6, n_group=1, topk_group=1,
                  norm_topk_prob=False, first_k_dense_replace=0, routed_scaling_factor=1.0, n_shared_experts=2)
    if arch == "Glm4MoeLiteForCausalLM":
        defaults, cfg = GLM4_MOE_LITE_EXPERTS, {**cfg, "first_k_dense_replace": dense_first(cfg, 1)}
    if arch == "GlmMoeDsaForCausalLM":
        defaults = GLM5_EXPERTS
    if arch == "AXK2ForCausalLM":
        defaults = AXK2_EXPERTS
    if arch == "AXK1ForCausalLM":   # A.X-K1: V3's, one dense layer first by default
        defaults = {**defaults, "n_routed_experts": 192, "first_k_dense_replace": 1}
        cfg = {**cfg, "first_k_dense_replace": dense_first(cfg, read_int(cfg, "first_k_dense_replace", 1, minimum=0))}
    experts = grouped_experts(cfg, defaults, "deepseek_v3" if v3 else "deepseek_v2",
                               grouped=v3 or method == "group_limited_greedy")
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1, **experts}


def _sparse_attention(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSeek V3.2's and GLM-5's: every layer `indexed_attention` (`layer_types`), the dense layers first as
    `mlp_layer_types` (else `first_k_dense_replace`, 3) says; GLM-5's indexers turn interleaved pairs, and the
    layers `indexer_types` calls `shared` (or `index_topk_pattern`'s S, or those `index_topk_freq` and
    `index_skip_topk_offset` skip, as transformers' `GlmMoeDsaConfig` derives them) reuse the last earlier layer's
    choice. Returns config.json with the dense layers counted, and the indexer's `MlaShape` fields past its size."""
    layers = read_int(cfg, "num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is not None and kinds != ["indexed_attention"] * layers:
        raise ConfigError(f"layer_types: {arch} is served with indexed_attention on every layer, got {kinds!r:.80}")
    first = read_int(cfg, "first_k_dense_replace", 1 if arch == "AXK2ForCausalLM" else 3, minimum=0)
    cfg = {**cfg, "first_k_dense_replace": dense_first(cfg, first)}
    if arch != "GlmMoeDsaForCausalLM":
        return cfg, {}
    key, kinds = "indexer_types", cfg.get("indexer_types")
    if kinds is None and cfg.get("index_topk_pattern") is not None:
        key, kinds = "index_topk_pattern", cfg["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in kinds] if isinstance(kinds, str) else kinds
    if kinds is None:
        freq = max(read_int(cfg, "index_topk_freq", 1), 1)
        offset = read_int(cfg, "index_skip_topk_offset", 2, minimum=0)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    return cfg, {"index_shared": shared_indexers(kinds, layers, key), "index_rope_interleave": True}


def shared_indexers(kinds: Any, num_layers: int, key: str = "indexer_types") -> tuple[int, ...]:
    """The layers whose indexer reuses the last earlier layer's choice: those `kinds` (config.json's `key`) calls
    `shared` (GLM-5's, HY V4's); a ConfigError naming the key unless it is full or shared for each layer, the first
    full."""
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("full", "shared") for k in kinds) \
            or kinds[0] != "full":
        raise ConfigError(f"{key}: full or shared for each of the {num_layers} layers, the first full, "
                          f"got {kinds!r:.80}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "shared")


# GlmMoeDsaConfig's experts where config.json names none: 256 of 2,048, 8 a token from one group, one shared
GLM5_EXPERTS = dict(n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, n_group=1, topk_group=1,
                    norm_topk_prob=True, first_k_dense_replace=3, routed_scaling_factor=2.5, n_shared_experts=1)
# AXK2Config's experts where config.json names none (A.X-K2-Light's): 128 of 512, 8 a token, no groups, one shared
AXK2_EXPERTS = dict(n_routed_experts=128, moe_intermediate_size=512, num_experts_per_tok=8, n_group=1, topk_group=1,
                    norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=2.5, n_shared_experts=1)
# Glm4MoeLiteConfig's experts where config.json names none: 64 of 1,536, 4 a token, one shared, the first layer dense
GLM4_MOE_LITE_EXPERTS = dict(n_routed_experts=64, moe_intermediate_size=1536, num_experts_per_tok=4, n_group=1,
                             topk_group=1, norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=1.8,
                             n_shared_experts=1)


def dense_layers(cfg: dict[str, Any], num_layers: int, first: int) -> tuple[int, ...]:
    """The layers whose MLP is dense, as `mlp_layer_types` says them in any order (MiMo-V2-Flash's, Command A
    Plus's), else the first `first`; a ConfigError naming the key for a list of anything else."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return tuple(range(min(first, num_layers)))
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types: one of dense, sparse for each of the {num_layers} layers, "
                          f"got {kinds!r:.80}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def dense_first(cfg: dict[str, Any], default: int) -> int:
    """GLM-4.7-Flash's and DeepSeek V3.2's dense layers as `mlp_layer_types` says them (else the first `default`), as
    how many come first: the sparse layers after them (what the engine serves; another order is refused by name)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return default
    dense = kinds.count("dense") if isinstance(kinds, list) else -1
    if dense < 0 or kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense) \
            or len(kinds) != read_int(cfg, "num_hidden_layers"):
        raise ConfigError(f"mlp_layer_types: dense layers first, then sparse ones, one for each layer, "
                          f"got {kinds!r:.80}")
    return dense


def grouped_experts(cfg: dict[str, Any], defaults: dict[str, Any], router: str, grouped: bool,
                    keys: dict[str, str] | None = None) -> dict[str, Any]:
    """DeepSeek's experts as their config keys say (`defaults`: the family's config class's): `n_routed_experts` of
    `moe_intermediate_size`, `num_experts_per_tok` a token from the `topk_group` best of `n_group` groups (one group
    where not `grouped`), weighted in float32 times `routed_scaling_factor` (renormalised where `norm_topk_prob`);
    `n_shared_experts` of them every token takes, ungated; the first `first_k_dense_replace` layers dense. `keys`: a
    family's own names of DeepSeek's keys (K-EXAONE's `num_experts`), read and named in errors in their place."""
    keys = keys or {}

    def read(key: str, minimum: int = 1) -> int:
        return read_int(cfg, keys.get(key, key), defaults[key], minimum=minimum)

    experts, moe_i, top_k = read("n_routed_experts"), read("moe_intermediate_size"), read("num_experts_per_tok")
    groups, topk_group = (read("n_group"), read("topk_group")) if grouped else (1, 1)
    if experts % groups or topk_group > groups or top_k > topk_group * (experts // groups):
        raise ConfigError(f"n_group: {groups} groups of {experts} experts, {topk_group} chosen a token, cannot hold "
                          f"num_experts_per_tok {top_k}")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_i,
            "norm_topk_prob": read_bool(cfg, keys.get("norm_topk_prob", "norm_topk_prob"), defaults["norm_topk_prob"]),
            "mlp_only_layers": tuple(range(read("first_k_dense_replace", minimum=0))),
            "moe_router": router, "moe_groups": (groups, topk_group),
            "routed_scaling_factor": read_float(cfg, keys.get("routed_scaling_factor", "routed_scaling_factor"),
                                                defaults["routed_scaling_factor"]),
            "shared_expert_intermediate_size": moe_i * read("n_shared_experts", minimum=0),
            "shared_expert_gated": False, "moe_float_weights": True}


def check_silu(cfg: dict[str, Any], family: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {family}'s experts are served with silu only (the fused MoE kernel's), "
                          f"got {cfg['hidden_act']!r}")


# transformers' ExaoneMoeConfig's where config.json names none (K-EXAONE-236B-A23B's), and its names of DeepSeek's keys
EXAONE_MOE_EXPERTS = dict(n_routed_experts=64, moe_intermediate_size=1024, num_experts_per_tok=8, n_group=1,
                          topk_group=1, norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=2.5,
                          n_shared_experts=1)
EXAONE_MOE_KEYS = {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts"}


def exaone_moe_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """K-EXAONE's experts (`ExaoneMoeForCausalLM`): DeepSeek V3's grouped sigmoid router and ungated shared experts
    under EXAONE's keys (`num_experts`, `num_shared_experts`), the dense layers first as `mlp_layer_types` says (else
    `first_k_dense_replace`)."""
    check_silu(cfg, "K-EXAONE")
    dense = dense_first(cfg, read_int(cfg, "first_k_dense_replace", 1, minimum=0))
    return grouped_experts({**cfg, "first_k_dense_replace": dense}, EXAONE_MOE_EXPERTS, "deepseek_v3", grouped=True,
                           keys=EXAONE_MOE_KEYS)


# transformers' HYV3Config's where config.json names none (Hy3-preview's), and its names of DeepSeek's keys
HY_V3_EXPERTS = dict(n_routed_experts=192, moe_intermediate_size=1536, num_experts_per_tok=8, n_group=1, topk_group=1,
                     norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=2.826, n_shared_experts=1)
HY_V3_KEYS = {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
              "routed_scaling_factor": "router_scaling_factor"}


def hy_v3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Tencent's HY V3 (`HYV3ForCausalLM`: Hy3-preview): the Llama layer with per-head q/k norms before the rotary
    (Apertus's attention), past the dense first layers (`mlp_layer_types`) DeepSeek V3's sigmoid router without groups
    over `num_experts` (192), its top `num_experts_per_tok` (8) always renormalised, times `router_scaling_factor`
    (2.826), beside `num_shared_experts` (1) shared ones."""
    check_silu(cfg, "HY V3")
    dense = dense_first(cfg, 1)
    fixed = {"first_k_dense_replace": dense, "norm_topk_prob": True, "n_group": 1, "topk_group": 1}
    return {"qk_norm": True, **grouped_experts({**cfg, **fixed}, HY_V3_EXPERTS, "deepseek_v3", grouped=False,
                                               keys=HY_V3_KEYS)}


# transformers' Mistral4Config's where config.json names none: 128 experts of 2,048, 4 a token, one shared, every layer
# sparse; its rope YaRN x 128 from 8,192 positions with DeepSeek's mscales, and the queries' scaling
MISTRAL4_EXPERTS = dict(n_routed_experts=128, moe_intermediate_size=2048, num_experts_per_tok=4, n_group=1,
                        topk_group=1, norm_topk_prob=True, first_k_dense_replace=0, routed_scaling_factor=1.0,
                        n_shared_experts=1)
MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def mistral4_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """Mistral Small 4's fields (transformers' `Mistral4Config` names and defaults): DeepSeek V3's latent attention
    (Mistral 4's shape by default) with Ministral 3's query scaling after the rotary (the rope's
    `llama_4_scaling_beta`); the rope's `partial_rotary_factor` the share of a head `qk_rope_head_dim` is (the only
    one transformers' model turns, the one the engine's latent attention turns); experts picked from the best groups
    (their best two's sum) by the softmax, no correction bias (`moe_router: mistral4`)."""
    check_silu(cfg, "Mistral 4")
    mla = read_mla(cfg, MLA_DEFAULTS["Mistral4ForCausalLM"], interleave_key=True)
    key = "rope_scaling" if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is not None \
        else "rope_parameters"
    rope = cfg.get(key) or MISTRAL4_ROPE
    if not isinstance(rope, dict):
        raise ConfigError(f"{key}: must be an object, got {rope!r:.80}")
    share = mla.qk_rope_head_dim / (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    partial = read_float(rope, "partial_rotary_factor", share, path=f"{key}.")
    if abs(partial - share) > 1e-9:
        raise ConfigError(f"{key}.partial_rotary_factor: Mistral 4 turns qk_rope_head_dim of each head ({share:g}), "
                          f"got {partial!r}")
    beta = read_float(rope, "llama_4_scaling_beta", None, positive=False, path=f"{key}.")
    rope = {name: value for name, value in rope.items() if name != "partial_rotary_factor"}
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1, "llama4_scaling_beta": beta or None,
            "full_rope": ({**cfg, key: rope},), **grouped_experts(cfg, MISTRAL4_EXPERTS, "mistral4", grouped=True),
            "stacked_experts": True}   # read per expert, or stacked as transformers saves Mistral 4's


def youtu_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """Youtu-LLM's (`YoutuForCausalLM`, transformers' `YoutuConfig`): DeepSeek V3's latent attention (its defaults,
    the rotary's pairs interleaved unless `rope_interleave` says not) with a dense MLP on every layer, the head tied to
    the embedding unless `tie_word_embeddings` says not."""
    mla = read_mla(cfg, MLA_DEFAULTS["DeepseekV3ForCausalLM"], interleave_key=True)
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def minicpm3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """OpenBMB's MiniCPM3 (`MiniCPM3ForCausalLM`; transformers' `MiniCPM3Config` names and defaults, MiniCPM3-4B's):
    DeepSeek V2's latent attention with its rotary over halves (`rope_interleave` false) and a dense MLP on every
    layer, with muP's scalars as Granite's fields: the embeddings times `scale_emb` (12), each sublayer's output times
    `scale_depth` / sqrt(layers) (1.4; null: 1), the logits over hidden / `dim_model_base` (256; null: 1); the head
    tied."""
    check_silu(cfg, "MiniCPM3")
    mla = replace(read_mla(cfg, (768, 256, 64, 32, 64), interleave_key=False), rope_interleave=False)
    depth = None if cfg.get("scale_depth", 1.4) is None else read_float(cfg, "scale_depth", 1.4)
    base = None if cfg.get("dim_model_base", 256) is None else read_int(cfg, "dim_model_base", 256)
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1,
            "embedding_multiplier": read_float(cfg, "scale_emb", 12.0),
            "residual_multiplier": 1.0 if depth is None else depth / math.sqrt(num_layers),
            "logits_scaling": 1.0 if base is None else read_int(cfg, "hidden_size") / base,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
