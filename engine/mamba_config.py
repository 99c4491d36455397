"""Mamba-2 layers' shape (Granite 4's -H models, `engine.granite_config`; Nemotron-H, `engine.nemotron_h_config`;
Falcon-H1, `engine.falcon_h1_config`; Mamba2, a model of Mamba-2 layers alone: `mamba2_config`, `mamba2_fields`), and
the bytes of a state layer's per-sequence state (Mamba-2's, Gated
DeltaNet's: `engine.gated_delta_config`; Mamba-1's: `engine.mamba1_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int

SSM_STATE_BYTES = 4   # the recurrent state is float32 whatever the model's dtype: it sums every token of a sequence
# how the gate z joins the scan's output y: RMSNorm(y x SiLU(z)) per group (Granite's, Nemotron-H's, Bamba's),
# RMSNorm(y) x SiLU(z) (Falcon-H1's `mamba_norm_before_gate`), y x SiLU(z) without a norm (Falcon-H1's default)
GATED_NORMS = ("gate_first", "norm_first", "none")


@dataclass(frozen=True)
class Mamba2Shape:
    """One Mamba-2 layer's shape (Granite 4's -H models): `num_heads` heads of `head_dim` (their product the mixer's
    intermediate size), a state of `d_state` per head channel, B and C shared by the heads of each of `n_groups`
    groups, the causal convolution's `conv_kernel` taps over x, B and C (with a bias where `conv_bias`), biased
    projections where `proj_bias` (out_proj's where `out_bias`, when that is not None: Falcon-H1's), a prefill's dt
    clamped to `dt_limit` (a decode step's is not: `engine.layers.mamba2`); the gate joins the scan's output as
    `gated_norm` says (`GATED_NORMS`)."""

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    norm_ranks: int = 1      # the ranks one group of the gated norm spans (a rank's shape with its groups replicated)
    gated_norm: str = "gate_first"
    out_bias: bool | None = None

    def __post_init__(self) -> None:
        if self.gated_norm not in GATED_NORMS:
            raise ConfigError(f"mamba_rms_norm: the gate joins as one of {', '.join(GATED_NORMS)}, "
                              f"got {self.gated_norm!r}")
        if self.num_heads % self.n_groups:
            raise ConfigError(f"mamba_n_groups: {self.n_groups} does not divide mamba_n_heads {self.num_heads}")
        if self.conv_kernel < 2:
            raise ConfigError(f"mamba_d_conv: must be >= 2, got {self.conv_kernel}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    def split_error(self, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot split these layers (None: each takes its share of the heads, and of
        the groups, or all of one group, replicated)."""
        if size == 1:
            return None
        if self.num_heads % size:
            return f"{size} does not divide the model's {self.num_heads} Mamba heads"
        if self.n_groups % size and self.n_groups != 1:
            return f"{size} neither divides the model's {self.n_groups} Mamba groups nor do they make one"
        return None

    def per_rank(self, size: int) -> Mamba2Shape:
        """The shape one of `size` ranks holds: its heads, its groups (all of one group where there is one, its
        gated norm's statistics then summed over the ranks: `norm_ranks`)."""
        if size == 1:
            return self
        split = self.n_groups % size == 0
        return replace(self, num_heads=self.num_heads // size, n_groups=self.n_groups // size if split else 1,
                       norm_ranks=1 if split else size)

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.d_state

    def num_params(self, hidden_size: int) -> int:
        """in_proj (gate, x, B, C, dt), the convolution, dt_bias, A_log, D, the gated norm (where there is one),
        out_proj."""
        h, inter = hidden_size, self.intermediate_size
        projections = h * (inter + self.conv_dim + self.num_heads) + inter * h
        biases = (inter + self.conv_dim + self.num_heads if self.proj_bias else 0) + (h if self.has_out_bias else 0)
        conv = self.conv_dim * self.conv_kernel + (self.conv_dim if self.conv_bias else 0)
        return projections + biases + conv + 3 * self.num_heads + (inter if self.gated_norm != "none" else 0)

    @property
    def has_out_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


def state_bytes(shape: Any, itemsize: int) -> int:
    """One sequence's state in one layer: the convolution's last kernel - 1 inputs (in the model's dtype, `itemsize`
    bytes) and the float32 recurrent state."""
    conv, ssm = shape.conv_state_shape, shape.ssm_state_shape
    return math.prod(conv) * itemsize + math.prod(ssm) * SSM_STATE_BYTES


def read_dt_limit(cfg: dict[str, Any]) -> tuple[float, float]:
    """`time_step_limit`: the least and the most dt of a prefill's scan ((0, inf) where absent or null)."""
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    if isinstance(limit, (list, tuple)):   # transformers 5 writes infinity as {"__float__": "Infinity"}
        limit = [float(v["__float__"]) if isinstance(v, dict) and v.get("__float__") in ("Infinity", "-Infinity")
                 else v for v in limit]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or \
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit):
        raise ConfigError(f"time_step_limit: two numbers (the least and the most dt), got {limit!r:.40}")
    return float(limit[0]), float(limit[1])


def mamba2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba2's config.json (transformers' `Mamba2Config`: Mamba-Codestral-7B, mamba2-130m to -2.7b) under the Llama
    reading's names: its Mamba heads (`num_heads`, 128, of `head_dim`, 64) named as the heads (no attention is built
    from them: the tensor-parallel checks check them), `expand` (2) x hidden_size its MLP width, `layer_norm_epsilon`
    its norms' eps; an untied head by default."""
    heads, hidden = read_int(cfg, "num_heads", 128), read_int(cfg, "hidden_size")
    return {**cfg, "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": read_int(cfg, "head_dim", 64), "intermediate_size": read_int(cfg, "expand", 2) * hidden,
            "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5)}


def mamba2_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Every layer Mamba-2 (`num_heads` x `head_dim` = `expand` x hidden_size, a state of `state_size` (128) per head
    channel, B and C in `n_groups` (8), `conv_kernel` (4) taps, biases where `use_conv_bias` / `use_bias`, dt clamped
    to `time_step_limit` in a prefill), its gate joining through the grouped norm, gate first."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Mamba2's layers are served with silu only, got {cfg['hidden_act']!r}")
    heads, head_dim = read_int(cfg, "num_heads", 128), read_int(cfg, "head_dim", 64)
    if heads * head_dim != cfg["intermediate_size"]:
        raise ConfigError(f"head_dim: {head_dim} x num_heads {heads} is not expand x hidden_size "
                          f"{cfg['intermediate_size']}")
    shape = Mamba2Shape(num_heads=heads, head_dim=head_dim, d_state=read_int(cfg, "state_size", 128),
                        n_groups=read_int(cfg, "n_groups", 8), conv_kernel=read_int(cfg, "conv_kernel", 4, minimum=2),
                        conv_bias=read_bool(cfg, "use_conv_bias", True), proj_bias=read_bool(cfg, "use_bias", False),
                        dt_limit=read_dt_limit(cfg))
    return {"layer_types": ("linear_attention",) * num_layers, "mamba": shape}
