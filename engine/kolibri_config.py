"""Aleph Alpha's Kolibri-1 config.json (`Kolibri1ForCausalLM`) as transformers' `Kolibri1Config` (Qwen3-MoE's keys)
reads it: GLM-4's four-norm layer (each sublayer's input and output normed) over EXAONE 4's attention (q/k normed per
head; sliding layers, a window of `sliding_window` (513), that rotate, and full layers, every 5th by default, that do
not), and on every layer `num_experts` (`num_local_experts`, 384) experts of `moe_intermediate_size` (512) beside an
ungated shared expert of `shared_expert_intermediate_size` (512). Its router (`moe_router` kolibri) picks the top
`num_experts_per_tok` (6) of float32 logits plus a float32 expert bias and weighs them by their logits' sigmoid,
renormalised where `norm_topk_prob` (false). What we do not serve is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_int
from engine.deepseek_config import check_silu

__all__ = ["kolibri_config", "kolibri_fields"]


def kolibri_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names: Kolibri1Config has no dense MLP (every layer's is experts), so
    `intermediate_size`, which no layer reads, is the experts' width."""
    return {"intermediate_size": cfg.get("moe_intermediate_size", 512), **cfg}


def kolibri_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Kolibri-1's `ModelConfig` fields (see the module docstring)."""
    check_silu(cfg, "Kolibri-1")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: a list of sliding_attention / full_attention, got {kinds!r:.80}")
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 513
    if window is None and "sliding_attention" in kinds:
        raise ConfigError("sliding_window: sliding-attention layers need a positive window, got null")
    experts = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    rotates = tuple(1 if window is None else int(kind == "sliding_attention") for kind in kinds)
    return {"layer_types": tuple(kinds), "sliding_window": window, "no_rope_layers": rotates, "qk_norm": True,
            "num_experts": read_int(cfg, experts, 384), "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 6),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 512),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 512),
            "shared_expert_gated": False, "norm_topk_prob": read_bool(cfg, "norm_topk_prob", False),
            "moe_router": "kolibri", "moe_float_weights": True, "mlp_only_layers": ()}
