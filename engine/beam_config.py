"""Reflection's Beam config.json (`BeamForCausalLM`: Beam-1.0-501B-A23B) as transformers' `BeamConfig` reads it: the
Llama attention with per-head q/k norms and a sigmoid gate on each output channel (`gate_proj`, a bias a head), its
sliding layers (a window of `sliding_window`, 512) rotating at `rope_parameters.sliding_attention`'s base, its full
layers (every 6th and the last) NoPE with each query scaled by (1 + (p + 1) / 2048)^0.1 at its position p; four norms a
layer and each sublayer's output joined to the residual stream by depth (`engine.models.beam`); past the dense first
layers (`mlp_layer_types`, 3) DeepSeek V3's grouped sigmoid router with its correction bias over `num_experts`, no
shared expert. Its `final_logit_softcapping` is not applied: transformers' model does not apply it."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int, read_object
from engine.deepseek_config import check_silu, dense_first, grouped_experts

__all__ = ["BEAM_DEFAULTS", "beam_fields"]

# BeamConfig's where config.json names none (Beam-1.0-501B-A23B's shape)
BEAM_DEFAULTS = {"vocab_size": 151_936, "hidden_size": 5120, "intermediate_size": 20_480, "num_hidden_layers": 52,
                 "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-6}
BEAM_EXPERTS = dict(n_routed_experts=256, moe_intermediate_size=2560, num_experts_per_tok=8, n_group=8, topk_group=4,
                    norm_topk_prob=True, first_k_dense_replace=3, routed_scaling_factor=2.5, n_shared_experts=0)


def beam_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Beam's `ModelConfig` fields (the module docstring): the layer types (by default every 6th and the last full),
    the sliding layers' rope, NoPE full layers, the experts."""
    check_silu(cfg, "Beam")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
        kinds[-1] = "full_attention"
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types: sliding_attention or full_attention for each of the {num_layers} layers, "
                          f"got {kinds!r:.80}")
    ropes = read_object(cfg, "rope_parameters", name="rope_parameters") or {}
    if ropes.get("full_attention") is not None:
        raise ConfigError("rope_parameters.full_attention: Beam's full layers are served NoPE (null), got "
                          f"{ropes['full_attention']!r:.80}")
    sliding = ropes.get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type: Beam's sliding layers are served with the "
                          f"default rope, got {sliding.get('rope_type')!r}")
    theta = read_float(sliding, "rope_theta", 10000.0, path="rope_parameters.sliding_attention.")
    experts = grouped_experts({**cfg, "n_routed_experts": read_int(cfg, "num_experts", 256),
                               "first_k_dense_replace": dense_first(cfg, 3)}, BEAM_EXPERTS, "deepseek_v3", grouped=True)
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 512),
            "full_rope": ({"rope_theta": theta},),   # the sliding layers': the only rope the model turns
            "no_rope_layers": tuple(int(kind == "sliding_attention") for kind in kinds), "qk_norm": True, **experts}
