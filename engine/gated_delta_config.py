"""Hybrid models whose layers are mostly linear attention (Gated DeltaNet) with a full-attention layer every few:
Qwen3.5's text models (dense and MoE) and Qwen3-Next, as transformers' `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig` and
`Qwen3NextConfig` read their config.json; the readers of every family with state layers (`HYBRID_FIELDS`, Nemotron-H's
in `engine.nemotron_h_config`, LFM2's in `engine.lfm2_config`, Kimi Linear's in `engine.kimi_linear_config`;
Granite 4-H's in `engine.granite_config`), and what a pool of such a model serves without (`serving_pool`: swap).

A linear-attention layer (`layer_types` "linear_attention") holds no K/V per token: each running sequence carries
a fixed-size state for it (`GatedDeltaShape.state_bytes`; Mamba-2's: `engine.mamba_config`), which the capacity plan
counts per sequence beside the KV of the attention layers (`ModelConfig.kv_layers`). What we do not serve is refused
with a `ConfigError` naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError, PoolConfig
from engine.config_values import read_bool, read_float, read_int, read_object
from engine.kimi_linear_config import KdaShape, bailing_hybrid_fields, kimi_linear_fields
from engine.lfm2_config import ShortConvShape, lfm2_fields, lfm2_moe_fields
from engine.lfm3_config import lfm3_fields
from engine.mamba1_config import Mamba1Shape
from engine.mamba_config import Mamba2Shape, state_bytes
from engine.nemotron_h_config import nemotron_h_fields


# why a pool of such a model cannot swap (the engine's and the capacity plan's refusal)
NOT_SWAPPED = ("swaps K/V blocks, but this model's linear-attention layers keep a state per sequence that is not "
               "swapped: use recompute")


@dataclass(frozen=True)
class GatedDeltaShape:
    """One linear-attention layer's shape: `num_k_heads` query/key heads of `k_head_dim`, `num_v_heads` value heads
    of `v_head_dim` (a multiple of the key heads: each key head serves that many consecutive value heads), the
    causal convolution's `conv_kernel` taps over q, k and v. OLMo Hybrid's: the write strength beta in (0, 2)
    (`beta_scale` 2: `linear_allow_neg_eigval`), the gated norm's own eps (`norm_eps`; None: the model's). Qwen4-Exp's
    output gate may be a sigmoid (`gate_act`; SiLU by default)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    beta_scale: float = 1.0
    norm_eps: float | None = None
    gate_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"linear_num_value_heads: {self.num_v_heads} is not a multiple of linear_num_key_heads "
                              f"{self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ConfigError(f"linear_conv_kernel_dim: must be >= 2, got {self.conv_kernel}")

    def split_error(self, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot split these layers (None: they can, by key head)."""
        if self.num_k_heads % size:
            return f"{size} does not divide the model's {self.num_k_heads} linear-attention key heads"
        return None

    def per_rank(self, size: int) -> GatedDeltaShape:
        """The shape one of `size` tensor-parallel ranks holds: its share of the key heads and of their value heads
        (`engine.parallel.check_tensor_parallel` has checked that they divide)."""
        return replace(self, num_k_heads=self.num_k_heads // size, num_v_heads=self.num_v_heads // size)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def num_params(self, hidden_size: int) -> int:
        """in_proj_qkv, in_proj_z, in_proj_b and in_proj_a; the convolution; dt_bias and A_log; the gated norm;
        out_proj."""
        h = hidden_size
        projections = h * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + self.value_dim * h
        return projections + self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.v_head_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """The recurrent matrix of every value head."""
        return self.num_v_heads, self.k_head_dim, self.v_head_dim

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


StateShape = GatedDeltaShape | Mamba2Shape | ShortConvShape | KdaShape | Mamba1Shape


def qwen3_5_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3.5's text model: `layer_types` (by default every `full_attention_interval`-th layer (4) full, the rest
    linear), the linear layers' shape, gated full-attention layers with q/k norms and a rotary over
    `partial_rotary_factor` (0.25) of each head."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = read_int(cfg, "full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    elif not isinstance(kinds, list) or any(k not in ("full_attention", "linear_attention") for k in kinds):
        raise ConfigError(f"layer_types: full_attention or linear_attention for each layer, got {kinds!r:.120}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Qwen3.5's layers are served with silu only, got {cfg['hidden_act']!r}")
    shape = GatedDeltaShape(num_k_heads=read_int(cfg, "linear_num_key_heads", 16),
                            num_v_heads=read_int(cfg, "linear_num_value_heads", 32),
                            k_head_dim=read_int(cfg, "linear_key_head_dim", 128),
                            v_head_dim=read_int(cfg, "linear_value_head_dim", 128),
                            conv_kernel=read_int(cfg, "linear_conv_kernel_dim", 4))
    rope = read_object(cfg, "rope_parameters") or read_object(cfg, "rope_scaling") or {}
    factor = read_float(rope, "partial_rotary_factor", read_float(cfg, "partial_rotary_factor", 0.25))
    return {"layer_types": tuple(kinds), "gated_delta": shape, "attn_output_gate": True, "qk_norm": True,
            "partial_rotary_factor": factor, "full_rope": (hybrid_rope(cfg),)}


def qwen3_5_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3.5-MoE's text model: Qwen3.5's layers with experts on every layer (`num_experts` of
    `moe_intermediate_size`, `num_experts_per_tok` a token by the softmax's top k, renormalised) beside a shared
    expert its sigmoid gate scales (Qwen2-MoE's block); experts stored per expert or stacked."""
    return {**qwen3_5_fields(cfg, num_layers), "num_experts": read_int(cfg, "num_experts", 256),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 512),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 512),
            "norm_topk_prob": True, "stacked_experts": True}


def qwen3_next_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's: Qwen3.5-MoE's layers, the experts on every `decoder_sparse_step`-th layer (1) but
    `mlp_only_layers` (whose MLP is dense, of `intermediate_size`), renormalised where `norm_topk_prob` (true);
    transformers' `Qwen3NextConfig` defaults (512 experts, 10 a token)."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in only):
        raise ConfigError(f"mlp_only_layers: a list of layer indices, got {only!r:.80}")
    return {**qwen3_5_moe_fields({"num_experts": 512, "num_experts_per_tok": 10, **cfg}, num_layers),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True), "stacked_experts": False,
            "decoder_sparse_step": read_int(cfg, "decoder_sparse_step", 1), "mlp_only_layers": tuple(only)}


def hybrid_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with its rope's multimodal keys dropped: Qwen3.5's MRoPE (`mrope_section`, `mrope_interleaved`)
    turns text as the plain rope does (its three position ids are one on text)."""
    out = dict(cfg)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(rope := out.get(key), dict):
            out[key] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    return out




def olmo_hybrid_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """OLMo Hybrid's (`OlmoHybridConfig`): OLMo 3's post-norm attention layers (q/k normed over the whole
    projection; NoPE where config.json names no rope base) and pre-norm Gated DeltaNet layers (`layer_types`, by
    default every 4th full) of `linear_*` heads (by default the attention's heads, key heads of 0.75 x hidden over
    them, value heads twice as wide), beta in (0, 2) where `linear_allow_neg_eigval` (true)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        kinds[-1] = kinds[-1] if "full_attention" in kinds else "full_attention"
    if not isinstance(kinds, list) or any(k not in ("full_attention", "linear_attention") for k in kinds):
        raise ConfigError(f"layer_types: full_attention or linear_attention for each layer, got {kinds!r:.120}")
    heads = read_int(cfg, "num_attention_heads")
    k_heads = read_int(cfg, "linear_num_key_heads", heads)
    k_dim = read_int(cfg, "linear_key_head_dim", int(0.75 * read_int(cfg, "hidden_size") / k_heads))
    shape = GatedDeltaShape(num_k_heads=k_heads, num_v_heads=read_int(cfg, "linear_num_value_heads", heads),
                            k_head_dim=k_dim, v_head_dim=read_int(cfg, "linear_value_head_dim", 2 * k_dim),
                            conv_kernel=read_int(cfg, "linear_conv_kernel_dim", 4),
                            beta_scale=2.0 if read_bool(cfg, "linear_allow_neg_eigval", True) else 1.0,
                            norm_eps=1e-5)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    nope = not (isinstance(rope, dict) and rope.get("rope_theta") is not None) and cfg.get("rope_theta") is None
    return {"layer_types": tuple(kinds), "gated_delta": shape,
            "no_rope_layers": (0,) * num_layers if nope else ()}


# the architectures these readers serve, each taking (config.json, its layer count)
HYBRID_FIELDS = {"Qwen3_5ForCausalLM": qwen3_5_fields, "Qwen3_5MoeForCausalLM": qwen3_5_moe_fields,
                 "Qwen3NextForCausalLM": qwen3_next_fields, "NemotronHForCausalLM": nemotron_h_fields,
                 "OlmoHybridForCausalLM": olmo_hybrid_fields, "Lfm2ForCausalLM": lfm2_fields,
                 "Lfm2MoeForCausalLM": lfm2_moe_fields, "Lfm3ForCausalLM": lfm3_fields,
                 "KimiLinearForCausalLM": kimi_linear_fields, "BailingHybridForCausalLM": bailing_hybrid_fields}

def serving_pool(pool: PoolConfig, stateful: bool) -> PoolConfig:
    """A pool as a model serves it: itself, with a swapping preemption mode refused (naming the pool's key) for a
    model whose linear-attention layers keep a state per running sequence (`stateful`: `engine.layers.
    gated_delta_net`): that state is not swapped, a victim is recomputed. Its prefix cache keeps the states of the
    prefixes it holds beside their blocks (`engine.state_cache`), and with `state_snapshots: 0` it has none."""
    sc = pool.scheduler
    if stateful and sc.uses_swap:
        raise ConfigError(f"pools.{pool.name}.preemption_mode: {sc.preemption_mode!r} {NOT_SWAPPED}")
    if stateful and sc.enable_prefix_caching and not sc.snapshot_slots:   # blocks without states resume nothing
        return replace(pool, scheduler=replace(sc, enable_prefix_caching=False))
    return pool
