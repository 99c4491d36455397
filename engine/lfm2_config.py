"""Liquid AI's LFM2 config.json (`Lfm2ForCausalLM`: LFM2-350M, -700M, -1.2B, -2.6B; `Lfm2MoeForCausalLM`:
LFM2-8B-A1B, `lfm2_moe_fields`) as transformers' `Lfm2Config` (`Lfm2MoeConfig`) reads it: a stack of layers each
of which mixes tokens by grouped-query attention (q/k normed per head, a rotary) or by a gated short convolution
(`layer_types` "conv", or every layer not in `full_attn_idxs`), then a SwiGLU MLP whose width
`block_auto_adjust_ff_dim` derives from `block_ff_dim` (LFM2-MoE's: experts past its dense layers).

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

__all__ = ["ShortConvShape", "check_layer_kinds", "lfm2_config", "lfm2_fields", "lfm2_moe_config", "lfm2_moe_fields"]


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
    (1.0), rounded up to a multiple of `block_multiple_of` (256)."""
    width = read_int(cfg, "block_ff_dim") if "block_ff_dim" in cfg else read_int(cfg, "intermediate_size", 12288)
    if read_bool(cfg, "block_auto_adjust_ff_dim", True):
        width = int(read_float(cfg, "block_ffn_dim_multiplier", 1.0) * int(2 * width / 3))
        multiple = read_int(cfg, "block_multiple_of", 256)
        width = multiple * ((width + multiple - 1) // multiple)
    tied = read_bool(cfg, "tie_embedding", True) if "tie_embedding" in cfg else \
        read_bool(cfg, "tie_word_embeddings", True)
    return {**cfg, "intermediate_size": width, "rms_norm_eps": read_float(cfg, "norm_eps", 1e-5),
            "tie_word_embeddings": tied}


def check_layer_kinds(kinds: Any, num_layers: int, state_kind: str, family: str) -> None:
    """A hybrid's `layer_types`: `state_kind` (its state layers' name) or full_attention for each of `num_layers`,
    at least one full; a ConfigError naming the key otherwise."""
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in (state_kind, "full_attention")
                                                                      for k in kinds):
        raise ConfigError(f"layer_types: {state_kind} or full_attention for each of the {num_layers} layers, got "
                          f"{kinds!r:.80}")
    if "full_attention" not in kinds:
        raise ConfigError(f"layer_types: {family} with no full attention layer is not served")


def lfm2_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2-MoE's config.json under the Llama reading's names: `norm_eps`, `tie_embedding` as LFM2's; its dense
    layers' MLP is `intermediate_size` as given (`Lfm2MoeConfig` derives nothing)."""
    tied = read_bool(cfg, "tie_embedding", True) if "tie_embedding" in cfg else \
        read_bool(cfg, "tie_word_embeddings", True)
    return {**cfg, "rms_norm_eps": read_float(cfg, "norm_eps", 1e-5), "tie_word_embeddings": tied}


def lfm2_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """LFM2's layers (`lfm2_fields`) with experts past the first `num_dense_layers` (2): `num_experts` (32) of
    `moe_intermediate_size` (1,792), `num_experts_per_tok` (4) picked by the `lfm2` router (sigmoid scores plus a
    float32 expert bias, `use_expert_bias`, which is served only on), renormalised where `norm_topk_prob` (true),
    times `routed_scaling_factor` (1.0)."""
    if not read_bool(cfg, "use_expert_bias", True):
        raise ConfigError("use_expert_bias: LFM2-MoE is served with its router's expert bias (as LFM2-8B-A1B's), got "
                          "false")
    dense = read_int(cfg, "num_dense_layers", 2, minimum=0)
    return {**lfm2_fields(cfg, num_layers), "num_experts": read_int(cfg, "num_experts", 32),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 4),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 1792),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True), "mlp_only_layers": tuple(range(dense)),
            "moe_router": "lfm2", "routed_scaling_factor": read_float(cfg, "routed_scaling_factor", 1.0)}


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
    check_layer_kinds(kinds, num_layers, "conv", "LFM2")
    shape = ShortConvShape(channels=read_int(cfg, "hidden_size"), kernel=read_int(cfg, "conv_L_cache", 3),
                           bias=read_bool(cfg, "conv_bias", False))
    return {"layer_types": tuple("linear_attention" if k == "conv" else k for k in kinds), "state_layers": shape,
            "qk_norm": True}
