"""Laguna's config.json fields (transformers' `LagunaConfig` names and defaults) as `ModelConfig` fields.

A Laguna layer is the Llama layer whose attention has its own count of query heads (`num_attention_heads_per_layer`,
the KV heads every layer's), q and k RMS-normed per head, and its output gated by softplus of its own projection
(`g_proj`: a gate per head, or per channel where `gating` says per-element); sliding and full layers (`layer_types`,
a window of `sliding_window`), each type its rope (the full layers' turning the first half of each head by default,
the sliding layers' whole heads); past the dense layers `mlp_layer_types` names, experts picked by a sigmoid of
soft-capped router logits plus a correction bias, renormalised, times `moe_routed_scaling_factor`, beside a shared
expert (`engine.models.laguna`). What we do not serve is refused naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object
from engine.deepseek_config import check_silu, dense_layers
from engine.rope_config import per_type_rope

# LagunaConfig's ropes where config.json names none
LAGUNA_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 500_000.0, "partial_rotary_factor": 0.5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0}}


@dataclass(frozen=True)
class LagunaShape:
    """Laguna's own: each layer's query heads, a gate per head (else per channel), the sliding layers' share of a
    head the rotary turns (the full layers': `ModelConfig.partial_rotary_factor`), the router logits' soft cap (0:
    none). Step 3.7's (`engine.step3p7_config`): the gate a sigmoid (Laguna's: softplus), each layer's clamp after the
    SiLU of its routed experts and of its shared expert or dense MLP (0: none)."""

    heads: tuple[int, ...]
    gate_per_head: bool = True
    local_rotary_factor: float = 1.0
    router_softcap: float = 0.0
    sigmoid_gate: bool = False
    expert_limits: tuple[float, ...] = ()
    mlp_limits: tuple[float, ...] = ()


def _rotary_factor(ropes: dict[str, Any], kind: str) -> float:
    rope = read_object(ropes, kind, name=f"rope_parameters.{kind}") or {}
    factor = read_float(rope, "partial_rotary_factor", 1.0, path=f"rope_parameters.{kind}.")
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"rope_parameters.{kind}.partial_rotary_factor: must be in (0, 1], got {factor!r}")
    return factor


def laguna_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Laguna's fields (see the module docstring)."""
    check_silu(cfg, "Laguna")
    if read_bool(cfg, "moe_apply_router_weight_on_input", False):
        raise ConfigError("moe_apply_router_weight_on_input: Laguna is served weighing the experts' outputs (false)")
    heads = cfg.get("num_attention_heads_per_layer") or [read_int(cfg, "num_attention_heads")] * num_layers
    if not isinstance(heads, list) or len(heads) != num_layers or any(
            not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in heads):
        raise ConfigError(f"num_attention_heads_per_layer: a positive count for each of the {num_layers} layers, "
                          f"got {heads!r:.80}")
    gating = cfg.get("gating", True)
    if gating not in (True, False, "per-head", "per-element"):
        raise ConfigError(f"gating: true, 'per-head' or 'per-element', got {gating!r}")
    ropes = read_object(cfg, "rope_parameters") or LAGUNA_ROPE
    full_rope, local_theta = per_type_rope({**cfg, "rope_parameters": {
        kind: {k: v for k, v in rope.items() if k != "partial_rotary_factor"} if isinstance(rope, dict) else rope
        for kind, rope in ropes.items()}}, "Laguna")
    kinds = cfg.get("layer_types") or ["full_attention"] * num_layers
    shape = LagunaShape(heads=tuple(heads), gate_per_head=gating in (True, "per-head"),
                        local_rotary_factor=_rotary_factor(ropes, "sliding_attention") if "sliding_attention" in ropes
                        else 1.0, router_softcap=read_float(cfg, "moe_router_logit_softcapping", 0.0, positive=False))
    experts = read_int(cfg, "num_experts", 256)
    return {"laguna": shape, "layer_types": tuple(kinds), "qk_norm": True, "full_rope": full_rope,
            "rope_local_theta": local_theta, "partial_rotary_factor": _rotary_factor(ropes, "full_attention"),
            "sliding_window": read_int(cfg, "sliding_window", 512), "num_experts": experts,
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 512), "norm_topk_prob": True,
            "mlp_only_layers": dense_layers(cfg, num_layers, 1), "moe_router": "minimax_m2",
            "routed_scaling_factor": read_float(cfg, "moe_routed_scaling_factor", 1.0),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 512, minimum=0),
            "shared_expert_gated": False, "moe_float_weights": True}


def laguna_params(config: Any, heads: int, kv_heads: int, inter: int, moe_inter: int, vocab_rows: int,
                  shared_inter: int) -> int:
    """Parameters of a Laguna model (or one rank's: `heads` of the model's `num_heads` a layer, scaled so for each
    layer's own count) with `kv_heads` KV heads: each layer's q/k/v/o (biased with `attention_bias`), q/k norms,
    g_proj, two norms, its dense MLP or its experts with their router, correction bias and shared expert; the
    embedding, the final norm, an untied head."""
    h, d, shape = config.hidden_size, config.head_dim, config.laguna
    ranks = config.num_heads // heads
    total = vocab_rows * h * (1 if config.tie_word_embeddings else 2) + h
    for layer in range(config.num_layers):
        q, kv = shape.heads[layer] // ranks * d, kv_heads * d
        total += h * (q + 2 * kv) + q * h + (q + 2 * kv + h if config.attention_bias else 0) + 2 * d + 2 * h
        total += h * (q // d if shape.gate_per_head else q)
        if config.is_sparse_layer(layer):
            total += config.num_experts * (3 * h * moe_inter + h + 1) + 3 * h * shared_inter
        else:
            total += 3 * h * inter
    return total
