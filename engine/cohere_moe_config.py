"""Cohere's MoE config.json (`Cohere2MoeForCausalLM`: Command A Plus) as transformers' `Cohere2MoeConfig` reads it, as
`ModelConfig` fields.

- Cohere 2's parallel layer (one norm before attention and MLP, both outputs added) with its norm an RMSNorm where
  `rms_norm_eps` is set, else Cohere's LayerNorm (`layer_norm_eps`); the logits times `logit_scale` (0.0625), a tied
  head by default;
- `layer_types`: the first `first_k_dense_replace` layers (dense MLPs of `prefix_dense_intermediate_size`) full but
  every `prefix_dense_sliding_window_pattern`-th, the rest full every `sliding_window_pattern`-th (4), sliding
  (`sliding_window`, 4096) otherwise; a sliding layer rotates, a full one is NoPE but a dense one where the prefix
  pattern is 1 (transformers' `force_rope`);
- the other layers' MLPs `num_experts` (8) of `intermediate_size`, `num_experts_per_tok` (2) a token by the top k of
  the router's logits, weighed by their softmax or (`expert_selection_fn: sigmoid`) their sigmoids, renormalised where
  `norm_topk_prob`; beside `num_shared_experts` (0) shared ones, one MLP of their rows, joined by the average of the
  two outputs or (`shared_expert_combination_strategy: sum`) their sum (`CohereMoeShape`).
What transformers does not define is refused naming the key.

Cohere's North (`CohereCompassForCausalLM`, and `CohereCompassForConditionalGeneration`'s text model) is Cohere 2's
model (`cohere_compass_fields`) with a rope per layer type (`rope_parameters.{full,sliding}_attention`, as transformers'
`CohereCompassTextConfig` reads it: an entry of null is a NoPE type, a type without an entry is refused), the rope
turning rotate-half pairs (Qwen3-VL's MRoPE, whose three position ids are one on text: `mrope_section` dropped), the
layers all full by default, the logits unscaled by default (`logit_scale` null).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object
from engine.deepseek_config import check_silu, dense_layers
from engine.rope_config import per_type_rope

__all__ = ["COHERE2_MOE_DEFAULTS", "CohereMoeShape", "cohere2_moe_fields", "cohere_compass_fields"]

# Cohere2MoeConfig's, for a config.json without them
COHERE2_MOE_DEFAULTS = {"vocab_size": 256_000, "hidden_size": 8192, "intermediate_size": 22_528,
                        "num_hidden_layers": 40, "num_attention_heads": 64, "head_dim": 128,
                        "max_position_embeddings": 8192, "bos_token_id": 5, "eos_token_id": 255_001}


@dataclass(frozen=True)
class CohereMoeShape:
    """What Command A Plus's layer has past Cohere 2's: an RMSNorm in place of Cohere's LayerNorm (`rms_norm`), the
    router's sigmoid scores in place of its softmax (`sigmoid`), the shared experts' output averaged with the routed
    one's (`shared_average`) or summed."""

    rms_norm: bool = False
    sigmoid: bool = False
    shared_average: bool = True


def cohere2_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Command A Plus config.json (the module docstring)."""
    check_silu(cfg, "Command A Plus")
    selection = cfg.get("expert_selection_fn", "softmax")
    if selection not in ("softmax", "sigmoid"):
        raise ConfigError(f"expert_selection_fn: softmax or sigmoid, got {selection!r:.40}")
    combination = cfg.get("shared_expert_combination_strategy", "average")
    if combination not in ("average", "sum"):
        raise ConfigError(f"shared_expert_combination_strategy: average or sum, got {combination!r:.40}")
    dense = read_int(cfg, "first_k_dense_replace", 0, minimum=0)
    dense_mlps = dense_layers(cfg, num_layers, dense)
    prefix = read_int(cfg, "prefix_dense_sliding_window_pattern", 1)
    pattern = read_int(cfg, "sliding_window_pattern", 4)
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % prefix else "full_attention" for i in range(dense)] + [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers - dense)]
    rotates = [kind == "sliding_attention" or (i in dense_mlps and prefix == 1) for i, kind in enumerate(kinds)]
    rms = cfg.get("rms_norm_eps") is not None
    inter = read_int(cfg, "intermediate_size")
    return {"rms_norm_eps": read_float(cfg, "rms_norm_eps" if rms else "layer_norm_eps", 1e-5),
            "logit_scale": read_float(cfg, "logit_scale", 0.0625),
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
            "sliding_window": read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096,
            "layer_types": tuple(kinds), "no_rope_layers": tuple(int(r) for r in rotates),
            "intermediate_size": read_int(cfg, "prefix_dense_intermediate_size", None) or inter,
            "num_experts": read_int(cfg, "num_experts", 8),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 2),
            "moe_intermediate_size": inter, "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True),
            "mlp_only_layers": dense_mlps,
            "shared_expert_intermediate_size": inter * read_int(cfg, "num_shared_experts", 0, minimum=0),
            "shared_expert_gated": False, "moe_router": "cohere2_moe",
            "cohere_moe": CohereMoeShape(rms, selection == "sigmoid", combination == "average")}


def cohere_compass_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a North config.json (the module docstring): the full layers' rope (`full_rope`) and
    the sliding layers' base (`rope_local_theta`), NoPE where a type's entry is null."""
    kinds = cfg.get("layer_types") or ["full_attention"] * num_layers
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: must be a list, a layer type for each layer, got {kinds!r:.80}")
    ropes = read_object(cfg, "rope_parameters") or {}
    for kind in sorted(set(kinds)):
        if kind not in ropes:
            raise ConfigError(f"rope_parameters.{kind}: North reads a rope (or null: NoPE) for each layer type, "
                              f"got {sorted(ropes)}")
    turned = {kind: {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
              for kind, rope in ropes.items() if isinstance(rope, dict)}
    full_rope, local_theta = per_type_rope({**cfg, "rope_parameters": turned}, "North")
    return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5),
            "logit_scale": read_float(cfg, "logit_scale", None) or 1.0,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
            "sliding_window": read_int(cfg, "sliding_window", 4096), "layer_types": tuple(kinds),
            "no_rope_layers": tuple(int(ropes[kind] is not None) for kind in kinds), "full_rope": full_rope,
            "rope_local_theta": local_theta}
