"""Meta's Muse Glimmer text model config (`text_config` of `MuseGlimmerForConditionalGeneration`, model_type
muse_glimmer_text; served as `MuseGlimmerForCausalLM`, `engine.models.muse`) as transformers'
`MuseGlimmerTextConfig` reads it.

Gemma 2's four-norm layer (Gemma's norms, 1 + weight; the norms on the sublayers' outputs with their own
`post_norm_eps`) whose attention is AFMoE's: its output gated per channel by a sigmoid of `gate_proj`, q and k normed
per head by one RMSNorm without a weight, q then times `qk_scale_factor`; sliding layers (a window of
`sliding_window`) beside full ones, every 4th counted back from the last by default; `layer_rope_theta` a base a
layer, 0 a NoPE layer (by default the full ones). The embeddings normed without a weight, the final norm Gemma 4's
(x times its weight); the logits times `output_multiplier`, then soft-capped by `final_logit_softcapping`.

transformers turns every rotating layer by the config's one rope (`rope_parameters`), whatever its entry in
`layer_rope_theta`: a layer's base other than `rope_theta` is refused naming the key, as is what else we do not
serve."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int
from engine.rope_config import RopeScaling

__all__ = ["muse_glimmer_config", "muse_glimmer_fields"]

# MuseGlimmerTextConfig's where config.json names none (Muse Glimmer 30B's shape)
DEFAULTS = {"vocab_size": 202_048, "hidden_size": 6656, "intermediate_size": 19_968, "num_hidden_layers": 52,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 200_000, "eos_token_id": 200_001,
            "sliding_window": 2048, "final_logit_softcapping": 20.0}


def muse_glimmer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with `MuseGlimmerTextConfig`'s defaults where it names none (null, or no EOS: a multimodal
    checkpoint's text model is read with the checkpoint's EOS where its text_config names none)."""
    return DEFAULTS | {k: v for k, v in cfg.items() if v is not None and v != []}


def muse_glimmer_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The module docstring's fields: layer types, NoPE layers, the gate, the MLP's activation, the logits' factor
    (`logit_scale`, applied before the cap here) and soft cap, and `muse`: (q's factor after its norm, the output
    norms' epsilon)."""
    for key in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if cfg.get(key) is not None:
            raise ConfigError(f"{key}: Muse Glimmer has none (transformers' MuseGlimmerTextConfig drops it)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (num_layers - 1 - i) % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: must be a list, a layer type for each layer, got {kinds!r:.80}")
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window"),
            "no_rope_layers": _rotating_layers(cfg, num_layers), "attn_output_gate": True,
            "hidden_act": cfg.get("hidden_activation") or "silu",
            "logit_scale": read_float(cfg, "output_multiplier", 0.19611613513818404),
            "final_logit_softcapping": read_float(cfg, "final_logit_softcapping", None),
            "muse": (read_float(cfg, "qk_scale_factor", 3.87), read_float(cfg, "post_norm_eps", 1e-8))}


def _rotating_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """1 where a layer turns q and k by the model's rope, 0 where `layer_rope_theta` says NoPE (0)."""
    theta = RopeScaling.from_hf_config(cfg)[0] or 10000.0
    bases = cfg.get("layer_rope_theta")
    if bases is None:
        return tuple(int((num_layers - 1 - i) % 4 != 0) for i in range(num_layers))
    if not isinstance(bases, list) or len(bases) != num_layers or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in bases):
        raise ConfigError(f"layer_rope_theta: must be a list of {num_layers} numbers (0: NoPE), got {bases!r:.80}")
    if any(b and b != theta for b in bases):
        raise ConfigError(f"layer_rope_theta: a rotating layer's base is the model's ({theta}) in transformers' "
                          f"Muse Glimmer, got {sorted({b for b in bases if b and b != theta})}")
    return tuple(int(b != 0) for b in bases)
