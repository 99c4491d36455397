"""Mamba-1 layers' shape (`Mamba1Shape`), Jamba's config.json fields (`jamba_fields`: transformers' `JambaConfig` names
and defaults), and those of Mamba and FalconMamba, models of Mamba-1 layers alone (`mamba_config`, `mamba_fields`).

A Mamba-1 layer (the selective state space of AI21's Jamba; `engine.layers.mamba1`) keeps, per sequence, the causal
convolution's last `conv_kernel - 1` inputs and a float32 state of `d_state` per channel of its `intermediate_size`
(`mamba_expand` x hidden_size): unlike Mamba-2's, its decay is a matrix (a rate per channel and state entry) and
dt is made per channel from a low-rank projection (`dt_rank`) of the convolution's output. Jamba's layers norm
dt's low-rank input, B and C (RMSNorms with weights) before the scan, FalconMamba's without weights. A model without
attention layers keeps no K/V: its pools plan blocks that hold no bytes and sequences by their state alone. What we
do not serve is refused naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import state_bytes

# how dt's low-rank input, B and C are normed before the scan: RMSNorms with weights (Jamba's), without (FalconMamba's),
# not at all (Mamba's)
BCDT_NORMS = ("weighted", "weightless", "none")


@dataclass(frozen=True)
class Mamba1Shape:
    """One Mamba-1 layer's shape: `intermediate_size` channels (this rank's share under tensor parallelism), a state of
    `d_state` per channel, the causal convolution's `conv_kernel` taps over x (with a bias where `conv_bias`), dt from
    a projection of rank `dt_rank`, in_proj and out_proj biased where `proj_bias`; dt's input, B and C RMS-normed (eps
    `norm_eps`) as `bcdt_norms` says (`BCDT_NORMS`)."""

    intermediate_size: int
    d_state: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_norms: str = "weighted"
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.conv_kernel < 2:   # the readers refuse it naming their key
            raise ValueError(f"conv_kernel: must be >= 2, got {self.conv_kernel}")
        if self.bcdt_norms not in BCDT_NORMS:
            raise ValueError(f"bcdt_norms: one of {', '.join(BCDT_NORMS)}, got {self.bcdt_norms!r}")

    def split_error(self, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot split these layers (None: each takes its share of the channels)."""
        if self.intermediate_size % size:
            return f"{size} does not divide the model's {self.intermediate_size} Mamba channels"
        return None

    def per_rank(self, size: int) -> Mamba1Shape:
        """The shape one of `size` ranks holds: its channels (x_proj's output summed over the ranks)."""
        return self if size == 1 else replace(self, intermediate_size=self.intermediate_size // size)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.intermediate_size, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        return self.intermediate_size, self.d_state

    def num_params(self, hidden_size: int) -> int:
        """in_proj (x, gate), the convolution, x_proj (dt's input, B, C), dt_proj (biased), A_log, D, out_proj, and
        Jamba's three norms."""
        i, h, n, r = self.intermediate_size, hidden_size, self.d_state, self.dt_rank
        projections = 2 * i * h + i * (r + 2 * n) + r * i + i + i * h
        biases = (2 * i + h) if self.proj_bias else 0
        conv = i * self.conv_kernel + (i if self.conv_bias else 0)
        return projections + biases + conv + i * n + i + ((r + 2 * n) if self.bcdt_norms == "weighted" else 0)

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


def jamba_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Jamba (`JambaForCausalLM`: AI21's Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning 3B): attention layers
    without a rotary (NoPE) where `layer % attn_layer_period == attn_layer_offset` (8, 4), at least one; Mamba-1 on
    the rest (`mamba_d_state` 16, `mamba_d_conv` 4, `mamba_expand` 2, `mamba_dt_rank` "auto": ceil(hidden / 16));
    `num_experts` (16) experts of `intermediate_size`, `num_experts_per_tok` (2) a token by the softmax's top k, not
    renormalised, on the layers where `layer % expert_layer_period == expert_layer_offset` (2, 1), a dense MLP on the
    others (everywhere with one expert)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Jamba's layers are served with silu only, got {cfg['hidden_act']!r}")
    attn = _period(cfg, "attn_layer", 8, 4)
    kinds = tuple("full_attention" if i % attn[0] == attn[1] else "linear_attention" for i in range(num_layers))
    if "full_attention" not in kinds:
        raise ConfigError(f"attn_layer_offset: {attn[1]} names no attention layer among the {num_layers} layers "
                          "(a model of Mamba layers alone is not served)")
    hidden = read_int(cfg, "hidden_size")
    rank = cfg.get("mamba_dt_rank", "auto")
    shape = Mamba1Shape(intermediate_size=read_int(cfg, "mamba_expand", 2) * hidden,
                        d_state=read_int(cfg, "mamba_d_state", 16),
                        conv_kernel=read_int(cfg, "mamba_d_conv", 4, minimum=2),
                        dt_rank=math.ceil(hidden / 16) if rank == "auto" else read_int(cfg, "mamba_dt_rank"),
                        conv_bias=read_bool(cfg, "mamba_conv_bias", True),
                        proj_bias=read_bool(cfg, "mamba_proj_bias", False),
                        norm_eps=read_float(cfg, "rms_norm_eps", 1e-6))
    fields: dict[str, Any] = {"layer_types": kinds, "state_layers": shape}
    experts = read_int(cfg, "num_experts", None) or read_int(cfg, "num_local_experts", 16)   # the attribute map's
    if experts == 1:
        return fields
    period, offset = _period(cfg, "expert_layer", 2, 1)
    return fields | {"num_experts": experts, "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 2),
                     "moe_intermediate_size": read_int(cfg, "intermediate_size"), "decoder_sparse_step": 1,
                     "mlp_only_layers": tuple(i for i in range(num_layers) if i % period != offset)}


def _period(cfg: dict[str, Any], key: str, period: int, offset: int) -> tuple[int, int]:
    """(`{key}_period`, `{key}_offset`): the offset below the period."""
    period = read_int(cfg, f"{key}_period", period)
    offset = read_int(cfg, f"{key}_offset", offset, minimum=0)
    if offset >= period:
        raise ConfigError(f"{key}_offset: {offset} must be below {key}_period {period}")
    return period, offset


# models of Mamba-1 layers alone, each a pre-norm residual step around its mixer: no attention, no MLP
MAMBA_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM")   # Mamba-2's: mamba_config


def mamba_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba's and FalconMamba's config.json (transformers' `MambaConfig` / `FalconMambaConfig` names: `state_size`,
    `conv_kernel`, `layer_norm_epsilon`; the channels `intermediate_size`, else `expand` x hidden_size; a tied head by
    default) under the Llama reading's names. A model
    without attention names its channels as heads of 2 (`num_attention_heads`, `intermediate_size`: no attention
    layer or MLP is built from them), so the checks that a tensor-parallel size divides the heads and the MLP check
    that it divides the Mamba channels."""
    channels = read_int(cfg, "intermediate_size") if cfg.get("intermediate_size") is not None else \
        read_int(cfg, "expand", 2) * read_int(cfg, "hidden_size")   # transformers: the key where given
    return {**cfg, "num_attention_heads": channels, "num_key_value_heads": channels, "head_dim": 2,
            "intermediate_size": channels, "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5),
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def mamba_fields(cfg: dict[str, Any], num_layers: int, norms: str = "none") -> dict[str, Any]:
    """Every layer Mamba-1 (`state_size` 16, `conv_kernel` 4, `expand` 2, `time_step_rank` "auto": ceil(hidden /
    16), in_proj and out_proj biased where `use_bias`, the convolution where `use_conv_bias`); dt's input, B and C
    normed as `norms` says (FalconMamba: without weights, eps `mixer_rms_eps`)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Mamba's layers are served with silu only, got {cfg['hidden_act']!r}")
    hidden = read_int(cfg, "hidden_size")
    rank = cfg.get("time_step_rank", "auto")
    shape = Mamba1Shape(intermediate_size=read_int(cfg, "intermediate_size"), d_state=read_int(cfg, "state_size", 16),
                        conv_kernel=read_int(cfg, "conv_kernel", 4, minimum=2),
                        dt_rank=math.ceil(hidden / 16) if rank == "auto" else read_int(cfg, "time_step_rank"),
                        conv_bias=read_bool(cfg, "use_conv_bias", True), proj_bias=read_bool(cfg, "use_bias", False),
                        bcdt_norms=norms, norm_eps=read_float(cfg, "mixer_rms_eps", 1e-6))
    return {"layer_types": ("linear_attention",) * num_layers, "state_layers": shape}


def falcon_mamba_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    return mamba_fields(cfg, num_layers, "weightless")


def mamba_params(config: Any, heads: int, vocab_rows: int) -> int:
    """Parameters of one rank of a model of Mamba layers alone holding `heads` of the config's (its channels, or its
    Mamba-2 heads: `mamba_config`, `engine.mamba_config.mamba2_config`): each layer's norm and mixer, the embedding,
    the final norm and an untied head."""
    shape = config.state_shape.per_rank(config.num_heads // heads)
    h = config.hidden_size
    return vocab_rows * h * (1 if config.tie_word_embeddings else 2) + config.num_layers * (
        h + shape.num_params(h)) + h
