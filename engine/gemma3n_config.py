"""Gemma 3n's text model as its config.json gives it (transformers' `Gemma3nTextConfig` names and defaults), as
`ModelConfig` fields: Gemma 4's E models' per-layer inputs and shared K/V layers (`Gemma4Shape`, whose attention
Gemma 3n's is: q, k and v normed, q.k unscaled), one attention shape on every layer, Gemma 3's two default ropes
(full layers at `rope_theta`, 1,000,000; sliding ones at `rope_local_base_freq`, 10,000, over a window of 512), and
what is its own (`Gemma3nShape`):

- AltUp: the residual stream is `altup_num_inputs` (4) streams; a layer predicts every stream from all of them by
  coefficients a router reads off the active one (`altup_active_idx`), runs on the active prediction, and corrects
  every stream by its output's innovation;
- LAuReL: a low-rank (`laurel_rank`) branch beside each layer's attention;
- activation sparsity: the first layers' MLP gates (`activation_sparsity_pattern`, 0.95 on the first 10) keep only
  what lies above their mean plus the normal quantile of that share times their standard deviation.
Refused by key, before a weight is read: MLPs of different widths, AltUp's active stream past the first, shared K/V
layers without a layer of each type before them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object
from engine.gemma4_config import Gemma4Shape, gemma4_params

__all__ = ["Gemma3nShape", "gemma3n_config", "gemma3n_fields", "gemma3n_params"]


@dataclass(frozen=True)
class Gemma3nShape:
    """Gemma 3n's own parts (module docstring): `streams` AltUp streams, the active one first; the active stream's
    correction scaled where `correct_scale`; LAuReL's `laurel_rank`; each layer's MLP gate cut at its mean plus the
    normal quantile of `gate_sparsity[layer]` standard deviations (0: not sparse)."""

    streams: int
    correct_scale: bool
    laurel_rank: int
    gate_sparsity: tuple[float, ...]


def gemma3n_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3n's config.json under the Llama reading's keys: one MLP width (a list of equal widths, as transformers
    saves it, read as one)."""
    width = cfg.get("intermediate_size")
    if isinstance(width, list):
        if not width or any(w != width[0] for w in width):
            raise ConfigError(f"intermediate_size: Gemma 3n is served with one MLP width on every layer, got "
                              f"{width!r:.80}")
        cfg = {**cfg, "intermediate_size": width[0]}
    return cfg


def gemma3n_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Gemma 3n text config (see the module docstring)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or \
            any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise ConfigError(f"layer_types: sliding_attention or full_attention for each of the {num_layers} layers, "
                          f"got {kinds!r:.80}")
    shared = read_int(cfg, "num_kv_shared_layers", 15, minimum=0)
    if shared and (shared >= num_layers or set(kinds[:num_layers - shared]) != set(kinds)):
        raise ConfigError(f"num_kv_shared_layers: {shared} leaves no layer of each type before them to share the K/V "
                          f"of ({num_layers} layers)")
    if read_int(cfg, "altup_active_idx", 0, minimum=0) != 0:
        raise ConfigError(f"altup_active_idx: Gemma 3n is served with the first stream active, got "
                          f"{cfg['altup_active_idx']!r}")
    head_dim = read_int(cfg, "head_dim", 256)
    size = read_int(cfg, "hidden_size_per_layer_input", 256, minimum=1)
    per_layer = Gemma4Shape(num_kv_heads=read_int(cfg, "num_key_value_heads", 2), head_dim=head_dim,
                            per_layer_input_size=size,
                            per_layer_vocab_size=read_int(cfg, "vocab_size_per_layer_input", 262_144),
                            kv_shared_layers=shared)
    full, local = _ropes(cfg)
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 512), "qk_norm": True,
            "query_pre_attn_scalar": 1.0, "rope_local_theta": local, "full_rope": ({"rope_theta": full},),
            "gemma4": per_layer, "head_dim": head_dim,
            "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
            "final_logit_softcapping": read_float(cfg, "final_logit_softcapping", 30.0),
            "gemma3n": Gemma3nShape(streams=read_int(cfg, "altup_num_inputs", 4, minimum=2),
                                    correct_scale=read_bool(cfg, "altup_correct_scale", True),
                                    laurel_rank=read_int(cfg, "laurel_rank", 64, minimum=1),
                                    gate_sparsity=_gate_sparsity(cfg, num_layers))}


def _ropes(cfg: dict[str, Any]) -> tuple[float, float]:
    """(the full layers' rope base, the sliding layers'): `rope_parameters.full_attention` / `.sliding_attention`
    (both `default`), else `rope_theta` / `rope_local_base_freq`, else transformers' 1,000,000 and 10,000."""
    ropes = read_object(cfg, "rope_parameters") or {}
    bases = []
    for kind, key, default in (("full_attention", "rope_theta", 1_000_000.0),
                               ("sliding_attention", "rope_local_base_freq", 10_000.0)):
        rope = ropes.get(kind) or {}
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.{kind}: Gemma 3n is served with the default rope, got {rope!r:.80}")
        bases.append(float(rope.get("rope_theta") or read_float(cfg, key, default)))
    return bases[0], bases[1]


def _gate_sparsity(cfg: dict[str, Any], num_layers: int) -> tuple[float, ...]:
    """Each layer's `activation_sparsity_pattern` share (a list, or one for every layer; transformers' default: 0.95 on
    the first 10 layers of a model past 10; 0: dense)."""
    pattern = cfg.get("activation_sparsity_pattern")
    if pattern is None:
        sparse = 10 if num_layers > 10 else 0
        pattern = [0.95] * sparse + [0.0] * (num_layers - sparse)
    elif isinstance(pattern, (int, float)) and not isinstance(pattern, bool):   # one share for every layer
        pattern = [pattern] * num_layers
    if not isinstance(pattern, list) or len(pattern) != num_layers or \
            any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1 for p in pattern):
        raise ConfigError(f"activation_sparsity_pattern: a share in [0, 1) for each of the {num_layers} layers, got "
                          f"{pattern!r:.80}")
    return tuple(float(p) for p in pattern)


def gemma3n_params(config: Any, heads: int, kv_heads: int, inter: int, moe_inter: int, vocab_rows: int) -> int:
    """Parameters of a Gemma 3n text model: Gemma 4's count of its layers (no output scalar a layer), each layer's
    AltUp (a scale, two coefficient maps, a router and its norm) and LAuReL (two projections, a norm), the streams'
    projections in and out of the model."""
    h, g, n = config.hidden_size, config.gemma3n, config.gemma3n.streams
    total = gemma4_params(config, heads, kv_heads, inter, moe_inter, vocab_rows) - config.num_layers
    per_layer = h + n * n + n * n * n + h * n + h + 2 * h * g.laurel_rank + h
    return total + config.num_layers * per_layer + 2 * (n - 1) * h * h
