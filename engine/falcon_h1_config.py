"""Falcon-H1's config.json fields (transformers' `FalconH1Config` names and defaults) as `ModelConfig` fields.

Every Falcon-H1 layer is a parallel hybrid (`layer_types` hybrid): one pre-norm feeds both a Mamba-2 mixer
(`engine.mamba_config.Mamba2Shape`, `mamba_d_ssm` wide where set, its gate joining without a norm unless
`mamba_rms_norm`) and Llama's attention, their outputs summed into the residual stream, then a SwiGLU MLP. The model
was trained with muP multipliers (`FalconH1Scales`): the embeddings times `embedding_multiplier` and the logits
times `lm_head_multiplier` (`ModelConfig.embedding_multiplier`, `logit_scale`); the rest scale a projection's input
or output, and are folded into its weights as they are read (`engine.models.falcon_h1`). What we do not serve is
refused naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.granite_config import mamba2_shape
from engine.mamba_config import Mamba2Shape


@dataclass(frozen=True)
class FalconH1Scales:
    """Falcon-H1's muP multipliers past the embeddings' and the head's: attention's input (q, k and v's weights),
    its keys (k's weight and bias) and its output (o_proj's); the Mamba mixer's input (in_proj's weight) and output
    (out_proj's); in_proj's output rows, a factor each for the gate, x, B, C and dt (`ssm`: weight and bias rows);
    the MLP's gate projection and down projection (`mlp`)."""

    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)

    def in_proj_rows(self, shape: Mamba2Shape) -> torch.Tensor:
        """in_proj's factor a row (the whole model's shape: the gate, x, B, C, dt), transformers' `mup_vector`."""
        inter, groups = shape.intermediate_size, shape.n_groups * shape.d_state
        sizes = (inter, inter, groups, groups, shape.num_heads)
        return torch.cat([torch.full((n,), factor, dtype=torch.float32) for n, factor in zip(sizes, self.ssm)])


def _factors(cfg: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    values = cfg.get(key)
    if values is None:
        return (1.0,) * count
    if not isinstance(values, list) or len(values) != count or \
            any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ConfigError(f"{key}: {count} numbers, got {values!r:.80}")
    return tuple(float(v) for v in values)


def falcon_h1_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Falcon-H1's fields (see the module docstring): every layer hybrid, the Mamba shape (`mamba_n_heads` 128 of
    `mamba_d_head`, `mamba_d_ssm` wide (1,024; null: `mamba_expand` x hidden_size), a state of `mamba_d_state` 256,
    `mamba_n_groups` 1; in_proj biased where `mamba_proj_bias`, out_proj where `projectors_bias`), the multipliers."""
    d_ssm = read_int(cfg, "mamba_d_ssm", 1024) if cfg.get("mamba_d_ssm", 1024) is not None else None
    shape = mamba2_shape(cfg, d_ssm, "mamba_d_ssm") if d_ssm is not None else mamba2_shape(cfg)
    norm = "none" if not read_bool(cfg, "mamba_rms_norm", False) else \
        "norm_first" if read_bool(cfg, "mamba_norm_before_gate", True) else "gate_first"
    shape = replace(shape, gated_norm=norm, out_bias=read_bool(cfg, "projectors_bias", False))
    scales = FalconH1Scales(
        attention_in=read_float(cfg, "attention_in_multiplier", 1.0, positive=False),
        key=read_float(cfg, "key_multiplier", 1.0, positive=False),
        attention_out=read_float(cfg, "attention_out_multiplier", 1.0, positive=False),
        ssm_in=read_float(cfg, "ssm_in_multiplier", 1.0, positive=False),
        ssm_out=read_float(cfg, "ssm_out_multiplier", 1.0, positive=False),
        ssm=_factors(cfg, "ssm_multipliers", 5), mlp=_factors(cfg, "mlp_multipliers", 2))
    return {"layer_types": ("hybrid",) * num_layers, "mamba": shape, "falcon_h1": scales,
            "embedding_multiplier": read_float(cfg, "embedding_multiplier", 1.0, positive=False),
            "logit_scale": read_float(cfg, "lm_head_multiplier", 1.0, positive=False)}
