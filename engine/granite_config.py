"""IBM Granite's config.json fields as `ModelConfig` fields: Granite 3's four scalars (`GraniteConfig`), and Granite 4's
(`GraniteMoeHybridConfig`) where it is a transformer: every layer attention, no experts (Granite-4.0-Micro, -1B,
-350M); its Mamba layers and experts (the -H models) are refused by name."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int

# transformers' old names of Granite 4's layer types (`remap_legacy_layer_types`)
_LEGACY_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}


def granite_fields(cfg: dict[str, Any], arch: str = "GraniteForCausalLM", num_layers: int = 0) -> dict[str, Any]:
    """Granite's four scalars (transformers' `GraniteConfig` names, 1 by default): the embeddings times
    `embedding_multiplier`, q.k times `attention_multiplier` (in place of head_dim ** -0.5), each sublayer's output
    times `residual_multiplier` before it joins the residual stream, the logits over `logits_scaling`; Granite 4's
    layers too (`granite4_fields`)."""
    fields = {"embedding_multiplier": read_float(cfg, "embedding_multiplier", 1.0),
              "attention_multiplier": read_float(cfg, "attention_multiplier", 1.0),
              "residual_multiplier": read_float(cfg, "residual_multiplier", 1.0),
              "logits_scaling": read_float(cfg, "logits_scaling", 1.0)}
    return fields if arch == "GraniteForCausalLM" else {**fields, **granite4_fields(cfg, num_layers)}


def granite4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite 4 as a transformer: `layer_types` (or `layers_block_type`) all attention, `num_local_experts` 0, the
    MLP its shared one of `shared_intermediate_size`; the rotary only where `position_embedding_type` is rope (NoPE
    on every layer otherwise, transformers' default)."""
    key = "layer_types" if cfg.get("layer_types") is not None else "layers_block_type"
    kinds = cfg.get(key)
    if kinds is None:
        raise ConfigError("layer_types: a Granite 4 config without it has Mamba layers on every layer "
                          "(transformers' default), which are not served")
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ConfigError(f"{key}: one type for each of the {num_layers} layers, got {kinds!r:.80}")
    if any(_LEGACY_TYPES.get(k, k) != "full_attention" for k in kinds):
        raise ConfigError(f"{key}: Granite 4's Mamba layers (the -H models') are not served, only attention ones; "
                          f"got {sorted(set(kinds))}")
    if read_int(cfg, "num_local_experts", 8, minimum=0):
        raise ConfigError(f"num_local_experts: Granite 4's experts are not served (0: its dense models), "
                          f"got {cfg.get('num_local_experts', 8)}")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope", "nope"):
        raise ConfigError(f"position_embedding_type: rope or none (NoPE), got {rope!r}")
    return {"intermediate_size": read_int(cfg, "shared_intermediate_size", 1024),
            "no_rope_layers": () if rope == "rope" else (0,) * num_layers}
