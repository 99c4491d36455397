"""Xiaomi's MiMo-V2-Flash config.json (`MiMoV2FlashForCausalLM`) as transformers' `MiMoV2FlashConfig` reads it, as
`ModelConfig` fields.

- `layer_types`: full layers (the first and every 6th by default) and sliding ones, a window of `sliding_window`
  positions the query's included (129 by default; the release's `sliding_window_size`, which counts the keys before
  the query, read plus one as transformers reads it);
- the sliding layers keep twice the full layers' KV heads and a learned sink logit per query head
  (`MimoShape.sliding_kv_heads`); the two shapes lie in the paged cache each as its own tensor (`engine.kv_cache`);
- a q/k head of `head_dim` (192), a value head of `v_head_dim` (128) scaled by `attention_value_scale` (0.707): the
  cache holds each V in a head of `head_dim`, its last dimensions zero (a third of V's bytes, as the capacity plan
  counts them), and attention's output past `v_head_dim` is dropped;
- each type its rope (`rope_parameters.full_attention`: 5,000,000; `.sliding_attention`: 10,000), both turning the
  first `partial_rotary_factor` (0.334) of each head with rotate-half pairs;
- the first layer's MLP dense (`mlp_layer_types`), the rest `n_routed_experts` (256) of `moe_intermediate_size`
  (2048), `num_experts_per_tok` (8) a token picked as DeepSeek V3's (sigmoid scores, correction bias, `n_group`
  groups of which `topk_group` are kept), no shared expert.
A rope other than the default, or two rotary shares, is refused naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object, rope_type
from engine.deepseek_config import check_silu, dense_layers
from engine.gemma4_config import rank_kv_heads

__all__ = ["MIMO_DEFAULTS", "MimoShape", "mimo_fields", "mimo_params"]

# MiMoV2FlashConfig's, for a config.json without them
MIMO_DEFAULTS = {"vocab_size": 152_576, "hidden_size": 4096, "intermediate_size": 16_384, "num_hidden_layers": 48,
                 "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 131_072}


@dataclass(frozen=True)
class MimoShape:
    """What MiMo-V2-Flash's attention has past the Llama layer's: its sliding layers' KV heads (twice the full layers'),
    each value head's size (`v_head_dim`, under the q/k head's) and the values' factor."""

    sliding_kv_heads: int
    v_head_dim: int
    value_scale: float = 1.0


def mimo_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a MiMo-V2-Flash config.json (the module docstring)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    dense = dense_layers(cfg, num_layers, 1)
    check_silu(cfg, "MiMo-V2-Flash")
    window = read_int(cfg, "sliding_window", 129)
    if cfg.get("sliding_window_size") is not None:
        window = read_int(cfg, "sliding_window_size") + 1
    head_dim = read_int(cfg, "head_dim", 192)
    v_head_dim = read_int(cfg, "v_head_dim", 128)
    if v_head_dim > head_dim:
        raise ConfigError(f"v_head_dim: served up to head_dim ({head_dim}), got {v_head_dim}")
    sliding_kv = 2 * read_int(cfg, "num_key_value_heads")
    if read_int(cfg, "num_attention_heads") % sliding_kv:
        raise ConfigError(f"num_key_value_heads: the sliding layers' {sliding_kv} KV heads (twice it) do not divide "
                          f"num_attention_heads {cfg['num_attention_heads']}")
    scale = cfg.get("attention_value_scale", 0.707)
    shape = MimoShape(sliding_kv, v_head_dim,
                      1.0 if scale is None else read_float(cfg, "attention_value_scale", 0.707))
    full, local, rotary = _ropes(cfg)
    return {"layer_types": tuple(kinds), "sliding_window": window, "head_dim": head_dim, "mimo": shape,
            "full_rope": ({"rope_parameters": full},), "rope_local_theta": local, "partial_rotary_factor": rotary,
            "attention_out_bias": False, "num_experts": read_int(cfg, "n_routed_experts", 256),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 2048),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True), "moe_router": "deepseek_v3",
            "moe_groups": (read_int(cfg, "n_group", 1), read_int(cfg, "topk_group", 1)),
            "routed_scaling_factor": 1.0 if cfg.get("routed_scaling_factor") is None
            else read_float(cfg, "routed_scaling_factor", 1.0),
            "mlp_only_layers": dense}


def _ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """(the full layers' rope parameters, the sliding layers' base, the share of each head both turn) from
    `rope_parameters.full_attention` and `.sliding_attention`, each the default rope; transformers' defaults where
    `rope_parameters` is absent."""
    params = read_object(cfg, "rope_parameters") or {
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
    if set(params) != {"full_attention", "sliding_attention"}:
        raise ConfigError(f"rope_parameters: MiMo-V2-Flash takes one entry per layer type (full_attention, "
                          f"sliding_attention), got {sorted(params)}")
    ropes = {kind: read_object(params, kind, name=f"rope_parameters.{kind}") or {} for kind in params}
    shares = set()
    for kind, rope in ropes.items():
        path = f"rope_parameters.{kind}."
        if rope_type(rope) != "default":
            raise ConfigError(f"{path}rope_type: only 'default' is served for MiMo-V2-Flash, got {rope_type(rope)!r}")
        shares.add(read_float(rope, "partial_rotary_factor", 0.334, path=path))
    if len(shares) > 1:
        raise ConfigError(f"rope_parameters: the full and sliding layers are served turning one share of each head, "
                          f"got partial_rotary_factor {sorted(shares)}")
    local = read_float(ropes["sliding_attention"], "rope_theta", 10_000.0, path="rope_parameters.sliding_attention.")
    full = {"rope_type": "default",
            "rope_theta": read_float(ropes["full_attention"], "rope_theta", 5_000_000.0,
                                     path="rope_parameters.full_attention.")}
    return full, local, shares.pop()


def mimo_params(config: Any, heads: int, kv_heads: int, inter: int, moe_inter: int, vocab_rows: int) -> int:
    """Parameters of a MiMo-V2-Flash model (or one rank's) with `heads` query heads and `kv_heads` KV heads a full
    layer (a sliding layer's: twice as many, and a sink per query head): each layer's q/k/v/o (q/k/v biased with
    `attention_bias`), two norms, its dense MLP or its experts with their router and correction bias; the
    embedding, the final norm, an untied head."""
    h, d, m = config.hidden_size, config.head_dim, config.mimo
    sliding_kv = rank_kv_heads(m.sliding_kv_heads, config.num_heads // heads)
    total = vocab_rows * h * (1 if config.tie_word_embeddings else 2) + h
    for layer in range(config.num_layers):
        sliding = config.layer_window(layer) is not None
        kv = sliding_kv if sliding else kv_heads
        qkv = heads * d + kv * d + kv * m.v_head_dim
        total += h * qkv + heads * m.v_head_dim * h + (qkv if config.attention_bias else 0) + 2 * h
        total += heads if sliding else 0
        if config.is_sparse_layer(layer):
            total += config.num_experts * (3 * h * moe_inter + h + 1)
        else:
            total += 3 * h * inter
    return total
