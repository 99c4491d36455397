"""Liquid AI's LFM3 config.json (`Lfm3ForCausalLM`: LFM3-1.7B) as transformers' `Lfm3Config` reads it: LFM2's stack
(`engine.lfm2_config`: gated short convolutions beside attention, SwiGLU MLPs) whose attention layers are sliding
(`sliding_window`, 256) or full, each type with its own rope (`rope_parameters.sliding_attention`: the default rope,
10,000; `.full_attention`: the proportional rope of Gemma 4, 1,000,000, half the pairs turning), heads of `head_dim`
(128), each head's output scaled by a sigmoid gate of the layer's input where `use_attention_gate` (a projection of
one row a head, `g_proj`), and a norm on each sublayer's output before the residual add where `use_sandwich_norm`
(`ModelConfig.peri_norms`, as HyperCLOVA X's). The MLP is `intermediate_size` wide as given; `norm_eps` and
`tie_embedding` read as LFM2-MoE's (`engine.lfm2_config.lfm2_moe_config`).

By default (no `layer_types`) layer i is full attention where i % 4 == 2, sliding where i % 4 == 0 (but the first),
else a convolution, as Lfm3Config lays them out. What we do not serve is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_int
from engine.gemma4_config import proportional_ropes
from engine.lfm2_config import ShortConvShape

__all__ = ["lfm3_fields"]

_KINDS = ("conv", "sliding_attention", "full_attention")


def lfm3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Each layer's kind (`layer_types`: conv, sliding_attention or full_attention, at least one attention layer), the
    convolutions' shape, the window, the two ropes, the head size, the gates and the sandwich norms."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
                 for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in _KINDS for k in kinds):
        raise ConfigError(f"layer_types: {', '.join(_KINDS)} for each of the {num_layers} layers, got {kinds!r:.80}")
    if kinds.count("conv") == num_layers:
        raise ConfigError("layer_types: LFM3 with no attention layer is not served")
    full_theta, rotary, local_theta = proportional_ropes(cfg, "LFM3", 0.5)
    shape = ShortConvShape(channels=read_int(cfg, "hidden_size"), kernel=read_int(cfg, "conv_L_cache", 7),
                           bias=read_bool(cfg, "conv_bias", False))
    return {"layer_types": tuple("linear_attention" if k == "conv" else k for k in kinds), "state_layers": shape,
            "qk_norm": True, "sliding_window": read_int(cfg, "sliding_window", 256),
            "head_dim": read_int(cfg, "head_dim", 128), "rope_local_theta": local_theta,
            "partial_rotary_factor": rotary, "rope_proportional": True, "full_rope": ({"rope_theta": full_theta},),
            "peri_norms": read_bool(cfg, "use_sandwich_norm", True),
            "head_gates": read_bool(cfg, "use_attention_gate", True)}
