"""Tencent Hunyuan's dense models' config.json fields (transformers' `HunYuanDenseV1Config`) as `ModelConfig` fields: q/k
norms per head (after the rotary: `engine.models.hunyuan`), and the rotary its checkpoints label `dynamic` with an
`alpha`, which transformers serves as a fixed stretch of the base (`ntk_alpha`): base x alpha^(d / (d - 2)), d the
head's size; read here as the default rope of that base."""

from __future__ import annotations

from typing import Any

from engine.config_values import read_float, read_int, rope_type


def hunyuan_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """The `ModelConfig` fields of a Hunyuan dense config (see the module docstring; every layer alike)."""
    fields: dict[str, Any] = {"qk_norm": True}
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    rope = cfg.get(key)
    if not (isinstance(rope, dict) and rope_type(rope) == "dynamic" and rope.get("alpha")):
        return fields
    alpha = read_float(rope, "alpha", None, path=f"{key}.")
    theta = read_float(rope, "rope_theta", read_float(cfg, "rope_theta", 10000.0), path=f"{key}.")
    heads = read_int(cfg, "num_attention_heads")
    dim = read_int(cfg, "head_dim", None) or read_int(cfg, "hidden_size") // heads
    stretched = {"rope_type": "default", "rope_theta": theta * alpha ** (dim / (dim - 2))}
    return {**fields, "full_rope": ({**{k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")},
                                     "rope_parameters": stretched},)}


def hunyuan_moe_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """Hunyuan's MoE (`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B): the dense model's attention and rope, every layer's
    MLP `num_experts` experts of `intermediate_size`, `moe_topk` a token (the softmax's top k, renormalised, in
    float32) beside an ungated shared MLP of the same size; a per-layer list of either must say one value."""
    def uniform(key: str, default: int) -> int:
        value = cfg.get(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]
        return read_int({key: value}, key)

    inter = read_int(cfg, "intermediate_size")
    return {**hunyuan_fields(cfg, num_layers), "num_experts": uniform("num_experts", 1),
            "num_experts_per_tok": uniform("moe_topk", 1), "moe_intermediate_size": inter, "norm_topk_prob": True,
            "moe_float_weights": True, "shared_expert_intermediate_size": inter, "shared_expert_gated": False}


# the readers of this module (`engine.family_readers.OWN_MODULE_FIELDS`)
HUNYUAN_FIELDS = {"HunYuanDenseV1ForCausalLM": hunyuan_fields, "HunYuanMoEV1ForCausalLM": hunyuan_moe_fields}
