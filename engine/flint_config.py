"""RecursiveSI's Flint config.json (`FlintForCausalLM`) as transformers' `FlintConfig` (Qwen2-MoE's keys) reads it:
Qwen3-MoE's layers (q/k normed per head) with a learned sink a query head in every attention (GPT-OSS's), sliding
layers (a window of `sliding_window`, 513) that rotate and full ones (the first two, every fourth from the second and
the last, by default) that do not, float32 RMSNorms (GPT-OSS's); past `mlp_only_layers` ([0, 1]) each MLP is
`num_experts` (256) experts of `moe_intermediate_size` (512), the top `num_experts_per_tok` (6) of the sigmoid of
float32 logits (`moe_router` flint: no bias), renormalised where `norm_topk_prob` (true), beside an ungated shared
expert of `shared_expert_intermediate_size` (1,024). What we do not serve is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import is_int, read_bool, read_int
from engine.deepseek_config import check_silu

__all__ = ["flint_fields"]


def flint_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Flint's `ModelConfig` fields (see the module docstring)."""
    check_silu(cfg, "Flint")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i < 2 or i % 4 == 1 or i == num_layers - 1 else "sliding_attention"
                 for i in range(num_layers)]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: a list of sliding_attention / full_attention, got {kinds!r:.80}")
    only = cfg.get("mlp_only_layers")
    only = [0, 1] if only is None else only
    if not isinstance(only, list) or not all(is_int(i) and i >= 0 for i in only):
        raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {only!r:.80}")
    if read_int(cfg, "decoder_sparse_step", 1) != 1:
        raise ConfigError(f"decoder_sparse_step: Flint is served with every layer but mlp_only_layers sparse (1), "
                          f"got {cfg['decoder_sparse_step']!r}")
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 513),
            "no_rope_layers": tuple(int(kind == "sliding_attention") for kind in kinds), "qk_norm": True,
            "attention_sinks": True, "num_experts": read_int(cfg, "num_experts", 256),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 6),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 512),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 1024),
            "shared_expert_gated": False, "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True),
            "moe_router": "flint", "moe_float_weights": True, "mlp_only_layers": tuple(only)}
