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
serve.

Muse Spark (`MuseSparkForConditionalGeneration`'s text model, model_type muse_spark_text; served as
`MuseSparkForCausalLM`) is that model with each head's attention output normed without a weight before the gate, the
norm on the attention's output weightless and the MLP's output scaled by 1 + weight before its norm
(`post_norm_eps`), each sublayer joined to the stream by a gate (`residual_gate_temperature`: the stream times
alpha plus the output times beta, float32), and past the dense layers `mlp_layer_types` names (none by default)
`num_local_experts` experts over `moe_hidden_size` (`ModelConfig.moe_latent_size`): the layer's input projected in and
normed, each expert's output normed (scaled first) before it is weighed, the sum projected out; picked by the
sigmoid of float32 router logits times `output_multiplier` plus a correction bias, renormalised past 1e-15, times
`routed_scaling_factor`."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int
from engine.rope_config import RopeScaling

__all__ = ["muse_glimmer_config", "muse_glimmer_fields", "muse_spark_config", "muse_spark_fields",
           "muse_spark_params"]

# MuseGlimmerTextConfig's where config.json names none (Muse Glimmer 30B's shape)
DEFAULTS = {"vocab_size": 202_048, "hidden_size": 6656, "intermediate_size": 19_968, "num_hidden_layers": 52,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 200_000, "eos_token_id": 200_001,
            "sliding_window": 2048, "final_logit_softcapping": 20.0}


# MuseSparkTextConfig's (Muse Spark Open 816B-A42B's shape), over Glimmer's
SPARK_DEFAULTS = {**DEFAULTS, "hidden_size": 8192, "intermediate_size": 16_384, "num_hidden_layers": 62,
                  "num_attention_heads": 128, "num_key_value_heads": 16, "head_dim": 64,
                  "max_position_embeddings": 1_048_576, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                  "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369,
                  "moe_intermediate_size": 4096, "num_local_experts": 256, "num_experts_per_tok": 8,
                  "moe_hidden_size": 4096}


def muse_glimmer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with `MuseGlimmerTextConfig`'s defaults where it names none (null, or no EOS: a multimodal
    checkpoint's text model is read with the checkpoint's EOS where its text_config names none)."""
    return DEFAULTS | {k: v for k, v in cfg.items() if v is not None and v != []}


def muse_spark_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with `MuseSparkTextConfig`'s defaults where it names none (as `muse_glimmer_config`)."""
    return SPARK_DEFAULTS | {k: v for k, v in cfg.items() if v is not None and v != []}


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
            "muse": (read_float(cfg, "qk_scale_factor", 3.87), read_float(cfg, "post_norm_eps", 1e-8), 0.0)}


def muse_spark_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Glimmer's fields (its MLP's activation `hidden_act`), the residual gates' temperature (`muse`'s third), the
    experts and their router (the module docstring)."""
    kinds = cfg.get("mlp_layer_types") or ["sparse"] * num_layers
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types: must be a list of {num_layers} of dense and sparse, got {kinds!r:.80}")
    fields = muse_glimmer_fields(cfg, num_layers)
    qk_scale, post_eps, _ = fields["muse"]
    return {**fields, "hidden_act": cfg.get("hidden_act") or "silu",
            "muse": (qk_scale, post_eps, read_float(cfg, "residual_gate_temperature", 0.3)),
            "num_experts": read_int(cfg, "num_local_experts"),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok"),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size"),
            "moe_latent_size": read_int(cfg, "moe_hidden_size"), "norm_topk_prob": True, "moe_router": "muse_spark",
            "moe_float_weights": True, "routed_scaling_factor": read_float(cfg, "routed_scaling_factor", 1.0),
            "mlp_only_layers": tuple(i for i, kind in enumerate(kinds) if kind == "dense")}


def muse_spark_params(config: Any, heads: int, kv_heads: int, i: int, moe_i: int, v: int) -> int:
    """Muse Spark's parameters (one rank's): Glimmer's layers (their dense MLPs, `i` rows) and two residual gates a
    layer, and on each sparse layer the experts (`moe_i` rows each, over the experts' width), its router and
    correction bias, the projections in and out, the norms before and after the experts; the table, the head, the
    final norm."""
    h, d, width, layers = config.hidden_size, config.head_dim, config.moe_latent_size, config.num_layers
    q, kv = heads * d, kv_heads * d
    attn = h * (q + 2 * kv) + q * h + h * q   # q/k/v, o_proj, the gate
    sparse = sum(config.is_sparse_layer(layer) for layer in range(layers))
    experts = config.num_experts * (3 * width * moe_i + h + 1) + 2 * h * width + 2 * width
    per_layer = attn + 3 * h + 2 * h   # input, pre-feed-forward and post-feed-forward norms; the two gates
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + head + h + layers * per_layer + sparse * experts + (layers - sparse) * 3 * h * i


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
