"""Zyphra's ZAYA1 (`ZayaForCausalLM`) as transformers' `ZayaConfig` reads its config.json: attention layers whose q/k/v
come from CCA (compressed convolutional attention: q and k through two short causal convolutions over the tokens,
`cca_time0` and `cca_time1` taps, plus residual paths; half of each value from the previous token), each keeping a
state per sequence beside its K/V (`CcaShape`: the convolutions' last inputs and the previous token's delayed value);
experts (`num_experts`, one a token, or none: a skip class) picked by a small MLP router whose hidden state passes
from layer to layer; a float32 residual stream scaled and biased around every sublayer. Layers are `hybrid` (full)
or `hybrid_sliding` (a window of `sliding_window` where one is set), each type its own rope (a base, half of each
head turned). What we do not serve is refused naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object
from engine.mamba_config import state_bytes

__all__ = ["CcaShape", "zaya_config", "zaya_fields"]

ZAYA_ROPES = {"hybrid": 5_000_000.0, "hybrid_sliding": 10_000.0}   # ZayaConfig's bases, each turning half a head


@dataclass(frozen=True)
class CcaShape:
    """A ZAYA layer's CCA and router: `heads` query heads and `kv_heads` key/value heads of `head_dim` (this rank's),
    the convolutions' taps (`time0` depthwise, `time1` within each head), the router's width and the experts (a skip
    class past them), and each layer's window (None: full)."""

    heads: int
    kv_heads: int
    head_dim: int
    time0: int
    time1: int
    router: int
    experts: int
    windows: tuple[int | None, ...]

    def split_error(self, size: int) -> str | None:
        """ZAYA is served on one rank: its value heads mix a current and a delayed half across heads (transformers
        serves it without tensor parallelism too)."""
        return None if size == 1 else "ZAYA's CCA value heads are not split across ranks"

    def per_rank(self, size: int) -> CcaShape:
        return self if size == 1 else replace(self, heads=self.heads // size, kv_heads=self.kv_heads // size)

    @property
    def channels(self) -> int:
        """The convolutions' channels: every q head's and k head's."""
        return (self.heads + self.kv_heads) * self.head_dim

    @property
    def taps(self) -> int:
        """The inputs a sequence's convolution state keeps: (time0 - 1) + (time1 - 1)."""
        return self.time0 + self.time1 - 2

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.channels, self.taps

    @property
    def ssm_state_shape(self) -> tuple[int]:
        """The previous token's delayed value projection (half of the value heads' channels)."""
        return (self.kv_heads * self.head_dim // 2,)

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)

    def num_params(self, hidden: int) -> int:
        """A layer's q/k/v (current and delayed halves)/o projections, both convolutions (biased), the key norm's
        temperatures, the router (its biased projection, norm, two biased layers, output and balancing biases; not
        the state scale, which the first layer lacks) and two residual scalings (a scale and a bias for each side)."""
        q, kv, c, r = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.channels, self.router
        attn = hidden * (q + 2 * kv) + q * hidden + c * self.time0 + c * self.head_dim * self.time1 + 2 * c
        router = hidden * r + r + r + 2 * (r * r + r) + (r + 1) * (self.experts + 1)
        return attn + self.kv_heads + router + 8 * hidden


def zaya_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's keys: its ropes by layer type set aside (`zaya_fields` reads them), the
    experts' width as the (unused) MLP width."""
    return {**cfg, "zaya_ropes": read_object(cfg, "rope_parameters") or {}, "rope_parameters": None,
            "rope_theta": None, "intermediate_size": read_int(cfg, "moe_intermediate_size", 2048)}


def zaya_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a ZAYA config (the module docstring)."""
    kinds = cfg.get("layer_types") or ["hybrid"] * num_layers
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ZAYA_ROPES for k in kinds):
        raise ConfigError(f"layer_types: hybrid or hybrid_sliding for each of the {num_layers} layers, got "
                          f"{kinds!r:.120}")
    if read_int(cfg, "num_experts_per_tok", 1) != 1:
        raise ConfigError(f"num_experts_per_tok: ZAYA routes a token to one expert, got {cfg['num_experts_per_tok']}")
    if read_bool(cfg, "attention_bias", False):
        raise ConfigError("attention_bias: ZAYA's CCA is served without projection biases (its checkpoints have none)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: ZAYA's experts are served with silu only, got {cfg['hidden_act']!r}")
    ropes = {kind: _rope(cfg, kind) for kind in set(kinds)}
    if len({factor for _, factor in ropes.values()}) > 1:
        raise ConfigError("rope_parameters: ZAYA's layer types are served with one partial_rotary_factor")
    window = read_int(cfg, "sliding_window", None)
    shape = CcaShape(heads=read_int(cfg, "num_attention_heads"), kv_heads=read_int(cfg, "num_key_value_heads"),
                     head_dim=read_int(cfg, "head_dim"), time0=read_int(cfg, "cca_time0", 2),
                     time1=read_int(cfg, "cca_time1", 2), router=read_int(cfg, "router_hidden_size", 256),
                     experts=read_int(cfg, "num_experts", 16),
                     windows=tuple(window if kind == "hybrid_sliding" else None for kind in kinds))
    if shape.taps < 1 or (shape.kv_heads * shape.head_dim) % 2:
        raise ConfigError(f"cca_time0: the convolutions need more than one tap between them, and the value heads an "
                          f"even width; got {shape.time0}, {shape.time1}")
    return {"layer_types": ("hybrid",) * num_layers, "state_layers": shape, "num_experts": shape.experts,
            "num_experts_per_tok": 1, "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 2048),
            "rope_theta": ropes["hybrid" if "hybrid" in ropes else "hybrid_sliding"][0],
            "layer_rope_thetas": tuple(ropes[kind][0] for kind in kinds),
            "partial_rotary_factor": next(iter(ropes.values()))[1],
            "lm_head_bias": read_bool(cfg, "lm_head_bias", False),
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def _rope(cfg: dict[str, Any], kind: str) -> tuple[float, float]:
    """A layer type's (rope base, partial rotary factor): `rope_parameters[kind]` (default scaling alone), else
    ZayaConfig's."""
    rope = (cfg.get("zaya_ropes") or {}).get(kind)
    if not isinstance(rope, dict):
        return ZAYA_ROPES[kind], 0.5
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.{kind}.rope_type: default is served for ZAYA, got {rope['rope_type']!r}")
    return (read_float(rope, "rope_theta", ZAYA_ROPES[kind], path=f"rope_parameters.{kind}."),
            read_float(rope, "partial_rotary_factor", 0.5, path=f"rope_parameters.{kind}."))
