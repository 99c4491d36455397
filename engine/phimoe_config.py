"""Microsoft's Phi-3.5-MoE config.json (`PhimoeForCausalLM`) as transformers' `PhimoeConfig` reads it: Mixtral's
experts (`num_local_experts`, 16, of `intermediate_size`, 6400) on every layer under LayerNorms (a weight and a bias,
of `rms_norm_eps`), q/k/v and o_proj biased where `attention_bias`, the head where `lm_head_bias`; the router is
SparseMixer's (`moe_router` sparsemixer: its two experts picked one after the other, each weighed by a softmax over
the experts whose logits lie within `router_jitter_noise` of its own, relatively), which picks two whatever
`num_experts_per_tok` says, so another count is refused.

Its LongRoPE carries its own attention factors, `short_mscale` and `long_mscale` (`RopeScaling.short_mscale`), that
scale cos and sin with the factor set they go with. transformers' `PhimoeRotaryEmbedding` turns by the short factors
at every length (only its mscale follows the sequence past `original_max_position_embeddings`); the engine turns a
pool that serves past the original context by the long factors and `long_mscale`, as the release's own modeling code
and vLLM do. What we do not serve is refused naming the key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import REQUIRED, read_bool, read_float, read_int, read_object
from engine.deepseek_config import check_silu
from engine.rope_config import RopeScaling

__all__ = ["phimoe_fields"]


def phimoe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Phi-3.5-MoE's `ModelConfig` fields (see the module docstring); the rope read here, its mscales with it."""
    check_silu(cfg, "Phi-3.5-MoE")
    if read_int(cfg, "num_experts_per_tok", 2) != 2:
        raise ConfigError(f"num_experts_per_tok: Phi-3.5-MoE's router picks 2 experts, got "
                          f"{cfg['num_experts_per_tok']}")
    _, scaling = RopeScaling.from_hf_config(cfg)
    if scaling.rope_type == "longrope":
        key = "rope_parameters" if read_object(cfg, "rope_parameters") else "rope_scaling"
        rope = read_object(cfg, key) or {}
        scaling = replace(scaling, short_mscale=read_float(rope, "short_mscale", REQUIRED, path=f"{key}."),
                          long_mscale=read_float(rope, "long_mscale", REQUIRED, path=f"{key}."))
    return {"num_experts": read_int(cfg, "num_local_experts", 16), "num_experts_per_tok": 2,
            "moe_intermediate_size": read_int(cfg, "intermediate_size"), "moe_router": "sparsemixer",
            "router_jitter_noise": read_float(cfg, "router_jitter_noise", 0.01, positive=False),
            "attention_bias": read_bool(cfg, "attention_bias", False),
            "lm_head_bias": read_bool(cfg, "lm_head_bias", False),
            "sliding_window": read_int(cfg, "sliding_window", None),
            "rope_scaling": scaling}
