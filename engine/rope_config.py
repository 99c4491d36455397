"""Rotary scaling as an HF config asks for it (`rope_scaling`, or transformers 5's `rope_parameters`): `RopeScaling`,
read and checked by key. What the rotary does with it is `engine.layers.rotary`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import REQUIRED, read_bool, read_float, read_int, read_object, rope_type

# dynamic NTK: its base moves only past max_position_embeddings, which caps its context here: the default rope's
SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in the HF config's `rope_scaling` (or `rope_parameters`). `llama3` reads the freq
    factors; `yarn` the betas and the attention factor (None: from `factor`, `mscale`, `mscale_all_dim`);
    `longrope` (Phi-3's 128k models, Phi-3.5, Phi-4-mini) a factor per rotary frequency for sequences within the
    original context and one for longer ones, and the attention factor (None: from `factor`). transformers picks
    the set by each forward's length, so a sequence that grows past the original context has keys cached under
    the other; an engine turns every sequence by one set, `long` (`ModelConfig.serving`: the long one where a
    pool serves sequences past the original context, as vLLM decides by its max_model_len)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long: bool = False
    short_mscale: float | None = None   # Phi-3.5-MoE's LongRoPE: the attention factor of each set (None: one for both)
    long_mscale: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type: unsupported {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings: must be > 0, "
                              f"got {self.original_max_position_embeddings}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ConfigError(f"rope_scaling.attention_factor: must be > 0, got {self.attention_factor}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor <= self.high_freq_factor:   # Llama 4: equal
            raise ConfigError(f"rope_scaling.high_freq_factor: llama3 needs 0 < low_freq_factor <= high_freq_factor, "
                              f"got {self.low_freq_factor} and {self.high_freq_factor}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], params_name: str = "rope_parameters", *, turns_part: bool = False,
                       ) -> tuple[float | None, "RopeScaling"]:
        """(rope_theta or None, scaling) from an HF config dict: `rope_theta` + `rope_scaling`, or the `rope_parameters`
        entry transformers >= 5 writes instead (`params_name`: its key path in errors). Both given are refused unless
        `rope_scaling` read alone says what `rope_parameters` does: transformers then reads `rope_scaling` alone (with
        the top level's `rope_theta`), rarely what a config edited by hand means. The type may be spelled `type`;
        `partial_rotary_factor` with a scaled rope is refused unless the family reads it (`turns_part`: the scaling's
        frequencies are then over the dimensions it turns, as transformers computes them; a family that turns whole
        heads would turn the scaled rope over all of each head). A bad value is a ConfigError naming its key."""
        rope_theta = read_float(cfg, "rope_theta", None)
        raw, name = cfg.get("rope_scaling"), "rope_scaling"
        params = read_object(cfg, "rope_parameters", name=params_name)
        if params is None and isinstance(raw, dict):   # transformers reads rope_scaling as rope_parameters: its own
            rope_theta = read_float(raw, "rope_theta", rope_theta, path="rope_scaling.")   # rope_theta first
        if params is not None and isinstance(raw, dict) and raw:   # each read alone: the same, or refused
            alone, ours = (cls.from_hf_config({k: v for k, v in cfg.items() if k != drop}, params_name,
                                              turns_part=turns_part)
                           for drop in ("rope_parameters", "rope_scaling"))
            if alone != ours:
                raise ConfigError(f"rope_scaling: config.json also has {params_name}, which says otherwise (transformers "
                                  f"reads rope_scaling alone, or Gemma 3's over it); keep one: the scaling's keys "
                                  f"belong in {params_name}")
            return ours
        if params is not None:
            rope_theta = read_float(params, "rope_theta", rope_theta, path=f"{params_name}.")
            if rope_type(params) != "default":
                raw, name = params, params_name
        if not raw:
            return rope_theta, cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: must be a mapping, got {raw!r}")
        try:
            return rope_theta, cls._from_mapping(cfg, raw, f"{name}.", turns_part)
        except ConfigError as exc:   # RopeScaling's own checks say rope_scaling.: name the key it came from
            message = str(exc)
            if name == "rope_scaling" or not message.startswith("rope_scaling."):
                raise
            raise ConfigError(f"{name}.{message.removeprefix('rope_scaling.')}") from None

    @classmethod
    def _from_mapping(cls, cfg: dict[str, Any], raw: dict[str, Any], path: str, turns_part: bool = False
                      ) -> "RopeScaling":
        # transformers' order: a top-level original_max_position_embeddings (Phi-3's habit), the scaling's
        # own, else max_position_embeddings
        original = read_int(cfg, "original_max_position_embeddings", None)
        if original is None:
            original = read_int(raw, "original_max_position_embeddings",
                                read_int(cfg, "max_position_embeddings", 8192), path=path)
        where, part = (path, raw) if raw.get("partial_rotary_factor") is not None else ("", cfg)   # the key it has
        if rope_type(raw) not in ("default", "longrope") and not turns_part and \
                read_float(part, "partial_rotary_factor", 1.0, path=where) != 1.0:
            raise ConfigError(f"{where}partial_rotary_factor: this architecture turns whole heads; a scaled rope over "
                              "part of each head is served for the families that turn part (GLM-4, Qwen3.5, Phi, ...)")
        kind = rope_type(raw)   # yarn without a factor: the context's growth (transformers'); linear, llama3 need one
        growth = REQUIRED if kind in ("dynamic", "linear", "llama3") else \
            read_int(cfg, "max_position_embeddings", original) / original
        factor = read_float(raw, "factor", growth, path=path)
        return cls(
            rope_type=rope_type(raw),
            factor=factor,
            low_freq_factor=read_float(raw, "low_freq_factor", 1.0, path=path),
            high_freq_factor=read_float(raw, "high_freq_factor", 4.0, path=path),
            original_max_position_embeddings=original,
            beta_fast=read_float(raw, "beta_fast", 32.0, path=path),
            beta_slow=read_float(raw, "beta_slow", 1.0, path=path),
            attention_factor=read_float(raw, "attention_factor", None, path=path),
            mscale=read_float(raw, "mscale", None, positive=False, path=path),
            mscale_all_dim=read_float(raw, "mscale_all_dim", None, positive=False, path=path),
            truncate=read_bool(raw, "truncate", True, path=path),
            short_factor=_factors(raw, "short_factor", path) if kind == "longrope" else (),
            long_factor=_factors(raw, "long_factor", path) if kind == "longrope" else (),
        )


def _factors(raw: dict[str, Any], key: str, path: str) -> tuple[float, ...]:
    """LongRoPE's list of positive factors under `key` (one a rotary frequency: `ModelConfig` checks how many)."""
    value = raw.get(key)
    if not isinstance(value, list) or not value or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
        raise ConfigError(f"{path}{key}: longrope needs a list of positive numbers, got {value!r:.80}")
    return tuple(float(v) for v in value)


def per_type_rope(cfg: dict[str, Any], family: str) -> tuple[tuple[Any, ...], float | None]:
    """Gemma 3's, OLMo 3's and Mellum's rope per layer type, as transformers 5 writes it or as earlier ones did: (the
    arguments of RopeScaling.from_hf_config for the full layers' rope, with its scaling:
    `rope_parameters.full_attention`, or `rope_theta` + `rope_scaling`; the sliding layers' base where
    `rope_parameters.sliding_attention` names one). The sliding layers' rope is the default one, else refused."""
    params, local = read_object(cfg, "rope_parameters"), {}
    # the full layers' yarn takes its own original context, else max_position_embeddings (never the top level's:
    # transformers moves a legacy rope_scaling into rope_parameters.full_attention too)
    top = {key: value for key, value in cfg.items() if key != "original_max_position_embeddings"}
    full_rope: tuple[dict[str, Any], str] = (top, "rope_parameters")
    full, full_name = cfg.get("rope_scaling"), "rope_scaling"
    if params is not None and ("full_attention" in params or "sliding_attention" in params):   # per layer type
        local = read_object(params, "sliding_attention", name="rope_parameters.sliding_attention") or {}
        full = read_object(params, "full_attention", name=(full_name := "rope_parameters.full_attention"))
        full_rope = ({**top, "rope_parameters": full}, full_name)
    elif params:   # transformers reads only the layer types' entries: the rest would be dropped
        raise ConfigError(f"rope_parameters: {family} takes one entry per layer type (full_attention, "
                          f"sliding_attention), got {sorted(params)}")
    if isinstance(full, dict) and full.get("truncate", True) is not True:   # transformers reads it beside the types
        raise ConfigError(f"{full_name}.truncate: {family}'s yarn is served with truncate true "
                          f"(transformers reads no layer type's own), got {full['truncate']!r}")
    if rope_type(local) != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type: only 'default' is supported for the "
                          f"sliding layers, got {rope_type(local)!r}")
    return full_rope, read_float(local, "rope_theta", None, path="rope_parameters.sliding_attention.")


def partial_rotary_factor(cfg: dict[str, Any], default: float) -> float:
    """The share of each head the rotary turns, as Phi-3's, GLM's and Nemotron's config classes read it: the rope's
    parameters' `partial_rotary_factor` (`rope_parameters`, else `rope_scaling`), else the top level's, else
    `default`."""
    rope = read_object(cfg, "rope_parameters") or read_object(cfg, "rope_scaling") or {}
    return read_float(rope, "partial_rotary_factor", read_float(cfg, "partial_rotary_factor", default))
