"""Translated's Lara Mini (`LaraMiniForCausalLM`: Lara-4-Mini) as its config.json gives it (transformers'
`LaraMiniConfig` names and defaults): Qwen3.5's Gated DeltaNet layers (`GatedDeltaShape`) between Qwen3 attention
layers, plain (no output gate), q/k normed, sliding over `sliding_window` (512) positions and rotating, or full and
NoPE, as `layer_types` says (by default the period `linear, sliding, linear, full, sliding`); experts on every layer
(`num_experts` of `moe_intermediate_size`, `num_experts_per_tok` a token by the top k of a float32 softmax,
renormalised where `norm_topk_prob`) beside an ungated shared expert; plain float32 norms, a tied head. It has no
dense MLP (config.json names no `intermediate_size`). What we do not serve is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_int
from engine.gated_delta_config import GatedDeltaShape

__all__ = ["LARA_MINI_PATTERN", "lara_mini_config", "lara_mini_fields"]

LARA_MINI_PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")


def lara_mini_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Lara Mini's config.json under the Llama reading's keys: its experts' width as the (unused) MLP width."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Lara Mini's experts are served with silu only, got {cfg['hidden_act']!r}")
    return {**cfg, "intermediate_size": read_int(cfg, "moe_intermediate_size", 512)}


def lara_mini_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Lara Mini config (see the module docstring)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = [LARA_MINI_PATTERN[i % len(LARA_MINI_PATTERN)] for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in LARA_MINI_PATTERN for k in kinds) \
            or all(k == "linear_attention" for k in kinds):
        raise ConfigError(f"layer_types: linear_attention, sliding_attention or full_attention for each of the "
                          f"{num_layers} layers, one attention layer at least, got {kinds!r:.80}")
    shape = GatedDeltaShape(num_k_heads=read_int(cfg, "linear_num_key_heads", 8),
                            num_v_heads=read_int(cfg, "linear_num_value_heads", 16),
                            k_head_dim=read_int(cfg, "linear_key_head_dim", 128),
                            v_head_dim=read_int(cfg, "linear_value_head_dim", 128),
                            conv_kernel=read_int(cfg, "linear_conv_kernel_dim", 4))
    return {"layer_types": tuple(kinds), "gated_delta": shape, "qk_norm": True,
            "sliding_window": read_int(cfg, "sliding_window", 512),
            "no_rope_layers": tuple(int(kind == "sliding_attention") for kind in kinds),
            "num_experts": read_int(cfg, "num_experts", 128), "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 4),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 512),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 512),
            "shared_expert_gated": False, "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True), "stacked_experts": True,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
