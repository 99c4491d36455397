"""Llama 4's config.json fields (transformers' `Llama4TextConfig` names and defaults) as `ModelConfig` fields, and
Ministral 3's (`Ministral3Config`), whose queries take Llama 4's attention scaling on every layer, Ministral's and
CWM's (Llama's and Mistral's layers, sliding where `layer_types` says), and Llama 3.2 Vision's text model's
(`MllamaTextConfig`: its self-attention layers alone).

A Llama 4 text model (Scout, Maverick) has three kinds of layer at once:
- attention: most layers rotate q and k (`no_rope_layers[i]` 1) and attend within chunks of
  `attention_chunk_size` positions (`chunked_attention`: a query at p sees p - p % chunk .. p), their q and k
  heads L2-normed after the rotary (`use_qk_norm`, no weight); every `no_rope_layer_interval`-th (4) is NoPE,
  attends to everything, and scales its queries by log1p(floor((p + 1) / floor_scale)) x attn_scale + 1
  (`attn_temperature_tuning`);
- MLP: the `moe_layers` (by default every `interleave_moe_layer_step`-th: Scout all, Maverick every other) are
  `num_local_experts` experts of `intermediate_size` beside a shared expert of the same size, the rest dense
  MLPs of `intermediate_size_mlp`;
- the router: the top `num_experts_per_tok` of its logits, each through a sigmoid, scales the token going into its
  expert (not the expert's output).
What we do not serve is refused with a `ConfigError` naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int


def llama4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Llama 4 text config (see the module docstring)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Llama 4's experts are served with silu only, got {cfg['hidden_act']!r}")
    rope = _layer_flags(cfg, "no_rope_layers", num_layers, lambda i: int(
        (i + 1) % read_int(cfg, "no_rope_layer_interval", 4) != 0))
    step = read_int(cfg, "interleave_moe_layer_step", 1)
    moe = cfg.get("moe_layers")
    moe = list(range(step - 1, num_layers, step)) if moe is None else moe
    if not isinstance(moe, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers
                                        for i in moe):
        raise ConfigError(f"moe_layers: a list of layer indices below {num_layers}, got {moe!r:.80}")
    chunk = read_int(cfg, "attention_chunk_size", None) if "attention_chunk_size" in cfg else 8192   # null: none
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: a list, full_attention or chunked_attention for each layer, got {kinds!r:.80}")
    experts = read_int(cfg, "num_local_experts", 16)
    expert_size = read_int(cfg, "intermediate_size", 8192)
    tuned = cfg.get("attn_temperature_tuning", True)   # Scout's card writes 4: transformers tests its truth
    if tuned is not None and not isinstance(tuned, (bool, int)):
        raise ConfigError(f"attn_temperature_tuning: must be true or false, got {tuned!r:.40}")
    return {"intermediate_size": read_int(cfg, "intermediate_size_mlp", 16384),
            "num_experts": experts, "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 1),
            "moe_intermediate_size": expert_size, "decoder_sparse_step": 1,
            "mlp_only_layers": tuple(i for i in range(num_layers) if i not in moe),
            "shared_expert_intermediate_size": expert_size, "shared_expert_gated": False, "moe_router": "llama4",
            "stacked_experts": True, "no_rope_layers": tuple(rope), "layer_types": tuple(kinds),
            "attention_chunk_size": chunk, "qk_l2_norm": read_bool(cfg, "use_qk_norm", True),
            "attn_temperature": (read_float(cfg, "floor_scale", 8192.0), read_float(cfg, "attn_scale", 0.1))
            if tuned or tuned is None else None}


def _layer_flags(cfg: dict[str, Any], key: str, num_layers: int, default) -> list[int]:
    """config.json's list of a 0 or 1 per layer under `key`, else `default(i)` for each layer."""
    flags = cfg.get(key) or [default(i) for i in range(num_layers)]   # transformers: an empty list is the default
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, bool)
                                                                       for f in flags):
        raise ConfigError(f"{key}: a 0 or 1 for each of the {num_layers} layers, got {flags!r:.80}")
    return flags


# transformers' Ministral3Config's rope where config.json names none: YaRN, 16 x 16,384 positions, and the queries'
# scaling (`llama_4_scaling_beta`)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                   "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def ministral3_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """Ministral 3's fields: Mistral's layer (a sliding window only where `sliding_window` is set), each query times
    1 + beta x log(1 + floor(p / original_max_position_embeddings)) after the rotary, beta the rope's
    `llama_4_scaling_beta` (none where it names none), and transformers' rope where config.json names none."""
    rope_key = "rope_parameters" if cfg.get("rope_parameters") is not None or cfg.get("rope_scaling") is None \
        else "rope_scaling"
    if cfg.get(rope_key) is None:
        cfg = {**cfg, "rope_parameters": MINISTRAL3_ROPE}
    rope = cfg[rope_key]
    beta = read_float(rope, "llama_4_scaling_beta", None, positive=False, path=f"{rope_key}.") \
        if isinstance(rope, dict) else None
    return {"sliding_window": read_int(cfg, "sliding_window", None), "llama4_scaling_beta": beta or None,
            "full_rope": (cfg,)}


def ministral_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Ministral's (`MinistralForCausalLM`, Ministral-8B-2410): Mistral's layer with `layer_types`, by default every
    layer sliding where there is a `sliding_window` (4096 where config.json names none; null: none, every layer
    full), as transformers' `MinistralConfig` reads it."""
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    if not isinstance(kinds, list) or any(k not in ("sliding_attention", "full_attention") for k in kinds):
        raise ConfigError(f"layer_types: sliding_attention or full_attention for each layer, got {kinds!r:.80}")
    return {"sliding_window": window, "layer_types": tuple(kinds)}


# CwmConfig's rope where config.json names none: Llama 3.1's scaling x 16 from 8,192 positions, base 1e6
CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def cwm_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Meta's Code World Model (`CwmForCausalLM`, CWM 32B): Llama's layer, sliding over `sliding_window` (8,192
    where config.json names none; null: every layer full) where `layer_types` says, by default every layer but each
    4th from the first; Llama 3.1's rope scaling where config.json names no rope, as transformers' `CwmConfig`."""
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        cfg = {**cfg, "rope_parameters": {**CWM_ROPE, **({"rope_theta": cfg["rope_theta"]} if "rope_theta" in cfg
                                                          else {})}}
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 8192
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 0 or window is None else "sliding_attention" for i in range(num_layers)]
    return {**ministral_fields({**cfg, "sliding_window": window, "layer_types": kinds}, num_layers),
            "full_rope": (cfg,)}


# the Mistral family's readers of this module (`engine.family_readers.OWN_MODULE_FIELDS`), and CWM's
MISTRAL_FIELDS = {"Ministral3ForCausalLM": ministral3_fields, "MinistralForCausalLM": ministral_fields,
                  "CwmForCausalLM": cwm_fields}


# MllamaTextConfig's cross-attention layers where config.json names none (Llama-3.2-11B-Vision's), and its embedding
# table's rows past the vocabulary (the image token's and seven more)
MLLAMA_CROSS_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
MLLAMA_EXTRA_ROWS = 8


def mllama_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.2 Vision's text config (`MllamaTextConfig`) under the Llama reading's keys: its layers the
    self-attention ones (`engine.models.mllama`), its table's rows the vocabulary's and 8 more, its head the
    vocabulary's (`output_vocab_size`); the cross layers' indices kept for `mllama_fields`."""
    layers, vocab = read_int(cfg, "num_hidden_layers"), read_int(cfg, "vocab_size")
    cross = cfg.get("cross_attention_layers")
    cross = list(MLLAMA_CROSS_LAYERS) if cross is None else cross
    if not isinstance(cross, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                          for i in cross) or len(set(cross)) != len(cross) or len(cross) >= layers:
        raise ConfigError(f"cross_attention_layers: distinct layer indices below num_hidden_layers {layers}, "
                          f"fewer than all, got {cross!r:.80}")
    if read_bool(cfg, "tie_word_embeddings", False):
        raise ConfigError(f"tie_word_embeddings: Llama 3.2 Vision's head ({vocab} rows) is not its embedding table "
                          f"({vocab + MLLAMA_EXTRA_ROWS}); served untied only")
    return {**cfg, "num_hidden_layers": layers - len(cross), "vocab_size": vocab + MLLAMA_EXTRA_ROWS,
            "output_vocab_size": vocab, "cross_attention_layers": sorted(cross)}


def mllama_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Llama 3.2 Vision's text model: the head's rows and the layers not served, as `mllama_config` read them."""
    return {"output_vocab_size": cfg["output_vocab_size"], "skipped_layers": tuple(cfg["cross_attention_layers"])}
