"""StepFun's Step 3.7 text model config (`text_config` of `Step3p7ForConditionalGeneration`, model_type step3p5; served
as `Step3p7ForCausalLM`) as transformers' `Step3p7TextConfig` reads it: Laguna's layers (`engine.laguna_config`: a
count of query heads a layer type, a gate a head, each layer type its rope) with a sigmoid gate, Gemma's norms, and
SwiGLUs clamped after the SiLU on the layers `swiglu_limits` (the routed experts) and `swiglu_limits_shared` (the
shared expert and the dense MLPs) name (0 or none: unclamped).

`step3p7_config` reads the release's keys as transformers maps them: `moe_num_experts`, `moe_top_k`,
`num_attention_groups`, `share_expert_dim`, `moe_router_scaling_factor`; the per-layer lists padded for its
multi-token-prediction layers (`num_nextn_predict_layers`) cut to the model's; `moe_layers_enum` (its sparse layers;
by default every layer from the 4th), `attention_other_setting` (the sliding layers' query heads) and the per-layer
`rope_theta` and `partial_rotary_factors` as a rope a layer type. What we do not serve is refused naming the key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int
from engine.laguna_config import laguna_fields

__all__ = ["step3p7_config", "step3p7_fields"]

# Step3p7TextConfig's where config.json names none (Step-3.7-Flash's shape), under Laguna's keys
DEFAULTS = {"vocab_size": 128_815, "hidden_size": 4096, "intermediate_size": 11_264, "num_hidden_layers": 45,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 128_000,
            "rms_norm_eps": 1e-5, "moe_intermediate_size": 1280, "num_experts": 288, "num_experts_per_tok": 8,
            "shared_expert_intermediate_size": 1280, "moe_routed_scaling_factor": 1.0, "rope_theta": 10_000.0,
            "gating": True, "pad_token_id": 1}
# its keys (the attribute map's and the release's) -> Laguna's
KEYS = {"n_routed_experts": "num_experts", "moe_num_experts": "num_experts", "num_local_experts": "num_experts",
        "moe_top_k": "num_experts_per_tok", "num_attention_groups": "num_key_value_heads",
        "share_expert_dim": "shared_expert_intermediate_size", "share_expert_dims": "shared_expert_intermediate_size",
        "moe_router_scaling_factor": "moe_routed_scaling_factor", "num_mtp_layers": "num_nextn_predict_layers"}
PER_LAYER = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
             "partial_rotary_factors")


def step3p7_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under Laguna's keys (the module docstring), `Step3p7TextConfig`'s defaults where it names none."""
    cfg = DEFAULTS | {KEYS.get(k, k): v for k, v in cfg.items() if v is not None}
    n = read_int(cfg, "num_hidden_layers")
    extra = read_int(cfg, "num_nextn_predict_layers", 0, minimum=0)
    for key in PER_LAYER:   # the trailing multi-token-prediction layers' entries
        if isinstance(cfg.get(key), list) and len(cfg[key]) == n + extra:
            cfg[key] = cfg[key][:n]
    kinds = cfg.setdefault("layer_types", ["full_attention"] * n)
    if cfg.get("mlp_layer_types") is None:
        cfg["mlp_layer_types"] = ["sparse" if i in _sparse_layers(cfg.get("moe_layers_enum"), n) else "dense"
                                  for i in range(n)]
    heads = read_int(cfg, "num_attention_heads")
    other = cfg.get("attention_other_setting") or {}
    if not isinstance(other, dict):
        raise ConfigError(f"attention_other_setting: must be an object, got {other!r:.80}")
    local = cfg.get("num_sliding_attention_heads") or other.get("num_attention_heads", heads)
    if isinstance(kinds, list) and cfg.get("num_attention_heads_per_layer") is None:
        cfg["num_attention_heads_per_layer"] = [local if kind == "sliding_attention" else heads for kind in kinds]
    ropes = cfg.get("rope_parameters")
    if not (isinstance(ropes, dict) and isinstance(kinds, list) and all(isinstance(ropes.get(k), dict) for k in kinds)):
        cfg["rope_parameters"] = _ropes(cfg, kinds)
    return {k: v for k, v in cfg.items() if not (k == "rope_theta" and isinstance(v, list))}   # read per type


def _sparse_layers(enum: Any, num_layers: int) -> set[int]:
    """The layers `moe_layers_enum` names sparse (comma-separated indices, or a list of them; by default from the
    4th on); a ConfigError naming it otherwise."""
    if enum is None:
        return set(range(3, num_layers))
    items = enum.split(",") if isinstance(enum, str) else enum
    try:
        return {int(i) for i in items if str(i).strip()}
    except (TypeError, ValueError):
        raise ConfigError(f"moe_layers_enum: layer indices, comma-separated or a list, got {enum!r:.80}") from None


def _ropes(cfg: dict[str, Any], kinds: Any) -> dict[str, Any]:
    """A rope a layer type from the per-layer (or one) `rope_theta` and `partial_rotary_factors`, each type's from its
    first layer; `rope_scaling` on the full layers' (`Step3p7TextConfig`'s reading)."""
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: a list of full_attention or sliding_attention, got {kinds!r:.80}")
    thetas, factors = cfg.get("rope_theta"), cfg.get("partial_rotary_factors")
    thetas = thetas if isinstance(thetas, list) else [thetas] * len(kinds)
    for key, values in (("rope_theta", thetas), ("partial_rotary_factors", factors)):
        if isinstance(values, list) and len(values) != len(kinds):
            raise ConfigError(f"{key}: one a layer ({len(kinds)}), got {len(values)}")
    ropes = {}
    for kind in dict.fromkeys(kinds):
        i = kinds.index(kind)
        ropes[kind] = {"rope_type": "default", "rope_theta": thetas[i],
                       **({"partial_rotary_factor": factors[i]} if isinstance(factors, list) else {})}
    if isinstance(cfg.get("rope_scaling"), dict) and "full_attention" in ropes:
        ropes["full_attention"].update(cfg["rope_scaling"])
    return ropes


def step3p7_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Laguna's fields with Step 3.7's: a sigmoid gate a head (per-element gates are not served: transformers' model
    broadcasts them a head), and each layer's clamps of its routed experts and of its shared expert or dense MLP."""
    if cfg.get("gating", True) not in (True, "per-head"):
        raise ConfigError(f"gating: Step 3.7 is served with a gate a head (true), got {cfg['gating']!r}")
    fields = laguna_fields(cfg, num_layers)
    limits = {key: _limits(cfg, key, num_layers) for key in ("swiglu_limits", "swiglu_limits_shared")}
    return {**fields, "laguna": replace(fields["laguna"], sigmoid_gate=True, expert_limits=limits["swiglu_limits"],
                                        mlp_limits=limits["swiglu_limits_shared"]),
            "query_pre_attn_scalar": read_float(cfg, "query_pre_attn_scalar", None)}


def _limits(cfg: dict[str, Any], key: str, num_layers: int) -> tuple[float, ...]:
    limits = cfg.get(key)
    if limits is None:
        return (0.0,) * num_layers
    if not isinstance(limits, list) or len(limits) != num_layers or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0) for v in limits):
        raise ConfigError(f"{key}: a clamp >= 0 (0 or null: none) for each of the {num_layers} layers, got "
                          f"{limits!r:.80}")
    return tuple(float(v or 0.0) for v in limits)
