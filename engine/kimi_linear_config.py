"""Moonshot's Kimi Linear config.json (`KimiLinearForCausalLM`: Kimi-Linear-48B-A3B) as transformers'
`KimiLinearConfig` reads it: Kimi Delta Attention layers (`layer_types` linear_attention, or `linear_attn_config`'s
1-based `kda_layers` / `full_attn_layers`; by default every 4th layer from the 5th full) between DeepSeek V3's
latent attention without a rotary (NoPE), each MLP dense or DeepSeek V3's experts (`mlp_layer_types`, else
`first_k_dense_replace`) under its grouped sigmoid router beside shared experts.

Its checkpoints name several keys otherwise (`attribute_map`: `num_experts`, `num_experts_per_token`,
`moe_renormalize`, `num_expert_group`, `num_shared_experts`, `model_max_length`); `kimi_linear_config` reads them
under DeepSeek's names, with `KimiLinearConfig`'s defaults. A KDA layer keeps no K/V: each running sequence carries
the causal convolution's last inputs over q, k and v and a float32 state of [heads, head_dim, head_dim]
(`KdaShape`), counted by the capacity plan beside the attention layers' latent cache. What we do not serve is
refused naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.deepseek_config import deepseek_fields, dense_first
from engine.lfm2_config import check_layer_kinds
from engine.mamba_config import state_bytes

__all__ = ["KdaShape", "bailing_hybrid_config", "bailing_hybrid_fields", "kimi_linear_config", "kimi_linear_fields"]

# KimiLinearConfig's defaults under DeepSeek's keys (where config.json names none)
DEFAULTS = {"n_routed_experts": 256, "moe_intermediate_size": 1024, "num_experts_per_tok": 8, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
            "n_shared_experts": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 1_048_576,
            "vocab_size": 163_840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
            "num_attention_heads": 32, "rms_norm_eps": 1e-5, "rope_interleave": False}
# BailingHybridConfig's (Ling 3's), likewise
BAILING_DEFAULTS = {**DEFAULTS, "n_routed_experts": 512, "moe_intermediate_size": 768, "n_group": 8, "topk_group": 4,
                    "first_k_dense_replace": 2, "routed_scaling_factor": 2.5, "max_position_embeddings": 262_144,
                    "vocab_size": 157_184, "hidden_size": 2560, "intermediate_size": 6144, "num_hidden_layers": 42,
                    "rms_norm_eps": 1e-6, "rope_interleave": True, "rope_theta": 6_000_000.0}
# its keys as `KimiLinearConfig.attribute_map` (and BailingHybridConfig's) names them -> DeepSeek's
KEYS = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
        "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
        "model_max_length": "max_position_embeddings"}


@dataclass(frozen=True)
class KdaShape:
    """One Kimi Delta Attention layer's shape: `num_heads` heads of `head_dim` for q, k and v alike, a causal
    convolution of `conv_kernel` taps over each. Tensor parallelism splits its heads (`per_rank`). Ling 3's
    (`full_rank`): the forget and output gates each one projection (`f_proj`, `g_proj`) where Kimi's go through
    head_dim, the forget gate rounded to the model's dtype, and where `gate_bound` (its `kda_safe_gate`) the gate is
    bound x sigmoid(exp(A_log) x (f + dt_bias)) in place of -exp(A_log) x softplus(f + dt_bias)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    full_rank: bool = False
    gate_bound: float | None = None

    def __post_init__(self) -> None:
        if self.conv_kernel < 2:
            raise ConfigError(f"linear_conv_kernel_dim: must be >= 2, got {self.conv_kernel}")

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def split_error(self, size: int) -> str | None:
        return None if self.num_heads % size == 0 else \
            f"{size} does not divide the model's {self.num_heads} Kimi Delta Attention heads"

    def per_rank(self, size: int) -> KdaShape:
        return self if size == 1 else replace(self, num_heads=self.num_heads // size)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return 3 * self.qkv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def num_params(self, hidden_size: int) -> int:
        """q, k, v and o projections, the convolutions, the forget gate's two projections (through head_dim, whose
        first a rank holds whole), its dt_bias and A_log, beta's projection, the output gate's two projections (the
        first whole), the output norm (whole)."""
        h, d, n = hidden_size, self.head_dim, self.qkv_dim
        gates = 2 * h * n if self.full_rank else 2 * (h * d + d * n)
        return 4 * h * n + 3 * n * self.conv_kernel + gates + n + self.num_heads + h * self.num_heads + d

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


def kimi_linear_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under DeepSeek V3's keys (`KEYS`), `KimiLinearConfig`'s defaults where it names none, its layer
    kinds as `layer_types` and its dense layers as `first_k_dense_replace`."""
    cfg = DEFAULTS | {KEYS.get(key, key): value for key, value in cfg.items()}
    layers = read_int(cfg, "num_hidden_layers")
    linear = cfg.get("linear_attn_config") or {}
    if cfg.get("layer_types") is None:
        if "full_attn_layers" in linear and "kda_layers" in linear:
            full = set(linear["full_attn_layers"])
            cfg["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
        else:
            cfg["layer_types"] = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size")):
        if theirs in linear:
            cfg[ours] = linear[theirs]
    return {**cfg, "first_k_dense_replace": dense_first(cfg, read_int(cfg, "first_k_dense_replace", 1, minimum=0))}


def kimi_linear_fields(cfg: dict[str, Any], num_layers: int, family: str = "Kimi Linear") -> dict[str, Any]:
    """The layer kinds (linear_attention or full_attention, at least one full) and the KDA shape, over DeepSeek V3's
    fields (its latent attention, whose rope part turns nothing, and its experts)."""
    deepseek = deepseek_fields(cfg, "DeepseekV3ForCausalLM")
    kinds = cfg["layer_types"]
    check_layer_kinds(kinds, num_layers, "linear_attention", family)
    shape = KdaShape(num_heads=read_int(cfg, "linear_num_heads", 32), head_dim=read_int(cfg, "linear_head_dim", 128),
                     conv_kernel=read_int(cfg, "linear_conv_kernel_dim", 4))
    return {**deepseek, "layer_types": tuple(kinds), "state_layers": shape}


def bailing_hybrid_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ling 3's config.json (`BailingHybridForCausalLM`) under DeepSeek V3's keys (`KEYS`), BailingHybridConfig's
    defaults where it names none: a full layer each `layer_group_size` (6), the rest KDA of `linear_num_heads`
    (`num_attention_heads`) heads of `linear_head_dim` (`head_dim`, 128) with `short_conv_kernel_size` (4) taps, the
    dense layers first as `mlp_layer_types` (else `first_k_dense_replace`, 2) says."""
    cfg = BAILING_DEFAULTS | {KEYS.get(key, key): value for key, value in cfg.items() if value is not None}
    layers = read_int(cfg, "num_hidden_layers")
    group = read_int(cfg, "layer_group_size", 6)
    cfg.setdefault("layer_types", ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                                   for i in range(layers)])
    cfg["linear_head_dim"] = cfg.get("linear_head_dim", cfg.get("head_dim", 128))
    cfg["linear_num_heads"] = cfg.get("linear_num_heads", cfg.get("num_attention_heads"))
    cfg["linear_conv_kernel_dim"] = cfg.get("linear_conv_kernel_dim", cfg.get("short_conv_kernel_size", 4))
    return {**cfg, "first_k_dense_replace": dense_first(cfg, read_int(cfg, "first_k_dense_replace", 2, minimum=0))}


def bailing_hybrid_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Kimi Linear's fields with Ling 3's KDA (`KdaShape.full_rank`, its safe gate where `kda_safe_gate`, bound
    `kda_lower_bound`), a turning rope on its latent attention (interleaved pairs) and a sigmoid gate a head there
    (`ModelConfig.head_gates`)."""
    fields = kimi_linear_fields(cfg, num_layers, "Ling 3")
    bound = read_float(cfg, "kda_lower_bound", -5.0, positive=False) if read_bool(cfg, "kda_safe_gate", True) else None
    return {**fields, "state_layers": replace(fields["state_layers"], full_rank=True, gate_bound=bound),
            "head_gates": True}
