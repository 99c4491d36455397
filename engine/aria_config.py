"""Rhymes' Aria text model config (`AriaTextForCausalLM`, the `text_config` of `AriaForConditionalGeneration`) as
transformers' `AriaTextConfig` reads it: the Llama layer with experts on every layer, `moe_num_experts` (8) of
`intermediate_size`, `moe_topk` (2) a token by the softmax of their logits (the softmax's top k renormalised), beside
`moe_num_shared_experts` (2) shared experts as one ungated MLP of that many times the width; its experts stacked."""

from __future__ import annotations

from typing import Any

from engine.config_values import read_int

__all__ = ["aria_text_fields"]


def aria_text_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Aria's experts (the module docstring) on every layer."""
    width = read_int(cfg, "intermediate_size")
    return {"num_experts": read_int(cfg, "moe_num_experts", 8), "num_experts_per_tok": read_int(cfg, "moe_topk", 2),
            "moe_intermediate_size": width, "norm_topk_prob": True, "stacked_experts": True,
            "shared_expert_intermediate_size": width * read_int(cfg, "moe_num_shared_experts", 2, minimum=0),
            "shared_expert_gated": False}
