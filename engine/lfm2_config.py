"""Liquid AI's LFM2 config.json (`Lfm2ForCausalLM`: LFM2-350M, -700M, -1.2B, -2.6B, LFM2.5) as transformers'
`Lfm2Config` reads it: a stack of layers each of which mixes tokens by grouped-query attention (q/k normed per head,
a rotary) or by a gated short convolution (`layer_types` "conv", or every layer not in `full_attn_idxs`), then a
SwiGLU MLP whose width `block_auto_adjust_ff_dim` derives from `block_ff_dim`.

A convolution layer keeps no K/V: each running sequence carries its last `conv_L_cache` - 1 inputs a channel
(`ShortConvShape`, read as the `linear_attention` layers of the hybrid models: `engine.gated_delta_config`), which
the capacity plan counts per sequence beside the attention layers' KV. What we do not serve is refused naming the
key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import state_bytes

__all__ = ["ShortConvShape", "lfm2_config", "lfm2_fields"]


@dataclass(frozen=True)
class ShortConvShape:
    """One gated short convolution layer's shape: `channels` (the hidden size, this rank's share under tensor
    parallelism) in each of its three projections' parts (B, C, x), a depthwise causal convolution of `kernel` taps
    over B x x, biased where `bias`. Its state per sequence is the convolution's last kernel - 1 inputs; it has no
    recurrent state (`ssm_state_shape` empty)."""

    channels: int
    kernel: int
    bias: bool = False

    def __post_init__(self) -> None:
        if self.kernel < 2:
            raise ConfigError(f"conv_L_cache: must be >= 2, got {self.kernel}")

    def split_error(self, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot split these layers (None: each takes its share of the channels)."""
        return None if self.channels % size == 0 else f"{size} does not divide the {self.channels} conv channels"

    def per_rank(self, size: int) -> ShortConvShape:
        return self if size == 1 else replace(self, channels=self.channels // size)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.channels, self.kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def num_params(self, hidden_size: int) -> int:
        """in_proj (B, C, x), the convolution, out_proj (its bias whole on each rank)."""
        c, h = self.channels, hidden_size
        return 4 * c * h + c * self.kernel + (4 * c + h if self.bias else 0)

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


def lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the names the Llama reading takes, as `Lfm2Config` resolves its own: `norm_eps` the norms'
    epsilon, `tie_embedding` (else `tie_word_embeddings`, true) the tie, and the MLP's width: `block_ff_dim` (else
    `intermediate_size`), where `block_auto_adjust_ff_dim` (true) two thirds of it, times `block_ffn_dim_multiplier`
    (1.0; null: not) rounded up to a multiple of `block_multiple_of` (256)."""
    width = read_int(cfg, "block_ff_dim") if "block_ff_dim" in cfg else read_int(cfg, "intermediate_size", 12288)
    if read_bool(cfg, "block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier", 1.0) is not None:
            width = int(read_float(cfg, "block_ffn_dim_multiplier", 1.0) * width)
            multiple = read_int(cfg, "block_multiple_of", 256)
            width = multiple * ((width + multiple - 1) // multiple)
    tied = read_bool(cfg, "tie_embedding", True) if "tie_embedding" in cfg else \
        read_bool(cfg, "tie_word_embeddings", True)
    return {**cfg, "intermediate_size": width, "rms_norm_eps": read_float(cfg, "norm_eps", 1e-5),
            "tie_word_embeddings": tied}


def lfm2_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Each layer's kind (`layer_types`: conv or full_attention; else `full_attn_idxs`, by default every layer
    attention), at least one attention layer; the convolutions' shape; q/k normed per head. The MLP is SwiGLU."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        attention = cfg.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else attention
        if not isinstance(attention, (list, range)) or not all(isinstance(i, int) for i in attention):
            raise ConfigError(f"full_attn_idxs: a list of layer indices, got {attention!r:.80}")
        kinds = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("conv", "full_attention")
                                                                      for k in kinds):
        raise ConfigError(f"layer_types: conv or full_attention for each of the {num_layers} layers, got "
                          f"{kinds!r:.80}")
    if "full_attention" not in kinds:
        raise ConfigError("layer_types: LFM2 with no attention layer is not served")
    shape = ShortConvShape(channels=read_int(cfg, "hidden_size"), kernel=read_int(cfg, "conv_L_cache", 3),
                           bias=read_bool(cfg, "conv_bias", False))
    return {"layer_types": tuple("linear_attention" if k == "conv" else k for k in kinds), "short_conv": shape,
            "qk_norm": True}
