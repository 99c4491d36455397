"""IBM Granite's config.json fields as `ModelConfig` fields: Granite 3's four scalars (`GraniteConfig`), Granite SWA's
sliding layers, sinks and per-layer rope bases (`GraniteSWAConfig`), and Granite 4's
(`GraniteMoeHybridConfig`) without experts: attention layers (Granite-4.0-Micro, -1B, -350M) and Mamba-2 ones beside
them (Granite-4.0-H-Micro, -H-1B, -H-350M), and experts beside the shared MLP (-H-Tiny, -H-Small); Bamba's
(`BambaConfig`), attention and Mamba-2 layers as Granite 4's -H models without the scalars; HyperCLOVA X's
(`HyperCLOVAXConfig`), Granite 3's scalars with a norm on each sublayer's output."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import Mamba2Shape, read_dt_limit

GRANITE3_MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")   # Granite 3's MoE models
# the architectures `granite_fields` reads
GRANITE_ARCHITECTURES = ("GraniteForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteSWAForCausalLM",
                         "GraniteMoeSWAForCausalLM", *GRANITE3_MOE)
# transformers' old names of Granite 4's layer types (`remap_legacy_layer_types`)
_LEGACY_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}


def granite_fields(cfg: dict[str, Any], arch: str = "GraniteForCausalLM", num_layers: int = 0) -> dict[str, Any]:
    """Granite's four scalars (transformers' `GraniteConfig` names, 1 by default): the embeddings times
    `embedding_multiplier`, q.k times `attention_multiplier` (in place of head_dim ** -0.5), each sublayer's output
    times `residual_multiplier` before it joins the residual stream, the logits over `logits_scaling`; Granite 4's
    layers too (`granite4_fields`)."""
    fields = {"embedding_multiplier": read_float(cfg, "embedding_multiplier", 1.0),
              "attention_multiplier": read_float(cfg, "attention_multiplier", 1.0),
              "residual_multiplier": read_float(cfg, "residual_multiplier", 1.0),
              "logits_scaling": read_float(cfg, "logits_scaling", 1.0)}
    if arch == "GraniteSWAForCausalLM":
        return {**fields, **granite_swa_fields(cfg, num_layers)}
    if arch in GRANITE3_MOE:
        return {**fields, **granite3_moe_fields(cfg, arch)}
    if arch == "GraniteMoeSWAForCausalLM":
        return {**fields, **granite3_moe_fields(cfg, "GraniteMoeSharedForCausalLM"),
                **granite_swa_fields(cfg, num_layers)}
    return fields if arch == "GraniteForCausalLM" else {**fields, **granite4_fields(cfg, num_layers)}


def granite3_moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite 3's MoE models (`GraniteMoeForCausalLM`: granite-3.x-1b-a400m, -3b-a800m; `GraniteMoeSharedForCausalLM`
    with a shared MLP): Granite 3's layer and scalars, a rotary on every layer, each MLP `num_local_experts` (8) of
    `intermediate_size` (11,008), `num_experts_per_tok` (2) a token picked as Granite 4's, beside GraniteMoeShared's
    `shared_intermediate_size` (0: none)."""
    shared = read_int(cfg, "shared_intermediate_size", 0, minimum=0) if arch == "GraniteMoeSharedForCausalLM" else 0
    return {"num_experts": read_int(cfg, "num_local_experts", 8),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 2),
            "moe_intermediate_size": read_int(cfg, "intermediate_size", 11_008), "norm_topk_prob": True,
            "shared_expert_intermediate_size": shared, "shared_expert_gated": False}


def granite_swa_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite SWA's layers (transformers' `GraniteSWAConfig`): sliding ones (`sliding_window`, 128) but every 4th
    from the first (`layer_types`), a learned sink logit per query head on every layer, each layer's rope base
    `layer_rope_theta` (0: NoPE; absent: the model's on every layer)."""
    kinds = cfg.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention"
                                       for i in range(num_layers)]
    thetas = cfg.get("layer_rope_theta")
    if thetas is not None and (not isinstance(thetas, list) or len(thetas) != num_layers or any(
            isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in thetas)):
        raise ConfigError(f"layer_rope_theta: a rope base >= 0 (0: NoPE) for each of the {num_layers} layers, "
                          f"got {thetas!r:.80}")
    return {"layer_types": tuple(kinds), "attention_sinks": True,
            "sliding_window": read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 128,
            "layer_rope_thetas": tuple(float(t) for t in thetas) if thetas is not None else ()}


def granite4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite 4: `layer_types` (or `layers_block_type`) attention and Mamba-2 layers (`linear_attention`, the -H
    models', `mamba2_shape`), at least one attention layer; the MLP its shared one of `shared_intermediate_size`,
    beside `num_local_experts` experts of `intermediate_size` on every layer (`num_experts_per_tok` a token, their
    weights the softmax of the top k's logits: the top k of the softmax, renormalised); the rotary only where
    `position_embedding_type` is rope (NoPE on every layer otherwise, transformers' default)."""
    key = "layer_types" if cfg.get("layer_types") is not None else "layers_block_type"
    kinds = cfg.get(key)
    if kinds is None:
        raise ConfigError("layer_types: a Granite 4 config without it has Mamba layers on every layer "
                          "(transformers' default) and no attention, which is not served")
    if not isinstance(kinds, list) or len(kinds) != num_layers or \
            any(_LEGACY_TYPES.get(k, k) not in ("full_attention", "linear_attention") for k in kinds):
        raise ConfigError(f"{key}: attention or mamba for each of the {num_layers} layers, got {kinds!r:.80}")
    kinds = [_LEGACY_TYPES.get(k, k) for k in kinds]
    if "full_attention" not in kinds:
        raise ConfigError(f"{key}: Granite 4 with Mamba layers alone (no attention layer) is not served")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope", "nope"):
        raise ConfigError(f"position_embedding_type: rope or none (NoPE), got {rope!r}")
    shared = read_int(cfg, "shared_intermediate_size", 1024)
    fields = {"intermediate_size": shared, "no_rope_layers": () if rope == "rope" else (0,) * num_layers}
    if "linear_attention" in kinds:
        fields |= {"layer_types": tuple(kinds), "mamba": mamba2_shape(cfg)}
    if experts := read_int(cfg, "num_local_experts", 8, minimum=0):   # every layer's: beside the shared MLP
        fields |= {"num_experts": experts, "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 2),
                   "moe_intermediate_size": read_int(cfg, "intermediate_size", 11008), "norm_topk_prob": True,
                   "shared_expert_intermediate_size": shared, "shared_expert_gated": False}
    return fields


def mamba2_shape(cfg: dict[str, Any], inter: int | None = None, inter_key: str = "mamba_expand x hidden_size"
                 ) -> Mamba2Shape:
    """The Mamba-2 layers' shape as `GraniteMoeHybridConfig` reads it: `mamba_n_heads` (128) heads of `mamba_d_head`
    ("auto": `mamba_expand` (2) x hidden_size over the heads, which it must make), `mamba_d_state` (256),
    `mamba_n_groups` (1), `mamba_d_conv` (4) taps with a bias (`mamba_conv_bias`), `mamba_proj_bias` (false),
    dt clamped to `time_step_limit`; the convolution's activation SiLU (`hidden_act`). `inter`: the mixer's width where
    the family names it otherwise (`inter_key`: Falcon-H1's `mamba_d_ssm`)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Granite 4's Mamba layers are served with silu only, got {cfg['hidden_act']!r}")
    heads, hidden = read_int(cfg, "mamba_n_heads", 128), read_int(cfg, "hidden_size")
    inter = read_int(cfg, "mamba_expand", 2) * hidden if inter is None else inter
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inter // heads if head_dim == "auto" else read_int(cfg, "mamba_d_head")
    if head_dim * heads != inter:
        raise ConfigError(f"mamba_d_head: {head_dim} x mamba_n_heads {heads} is not {inter_key} {inter}")
    limit = read_dt_limit(cfg)
    return Mamba2Shape(num_heads=heads, head_dim=head_dim, d_state=read_int(cfg, "mamba_d_state", 256),
                       n_groups=read_int(cfg, "mamba_n_groups", 1), conv_kernel=read_int(cfg, "mamba_d_conv", 4),
                       conv_bias=read_bool(cfg, "mamba_conv_bias", True),
                       proj_bias=read_bool(cfg, "mamba_proj_bias", False),
                       dt_limit=limit)


def bamba_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Bamba (`BambaForCausalLM`, IBM's Bamba-9B; transformers' `BambaConfig`): Llama's attention on the layers
    `attn_layer_indices` names (at least one), Mamba-2 on the rest (`mamba2_shape`: Granite 4's keys and defaults),
    each turning the first half of its heads (transformers sets `partial_rotary_factor` 0.5 whatever config.json
    says), a dense MLP on every layer."""
    attn = cfg.get("attn_layer_indices")
    if not isinstance(attn, list) or not attn or any(not isinstance(i, int) or isinstance(i, bool)
                                                     or not 0 <= i < num_layers for i in attn):
        raise ConfigError(f"attn_layer_indices: the attention layers (at least one, each < num_hidden_layers "
                          f"{num_layers}), got {attn!r:.80}")
    kinds = tuple("full_attention" if i in attn else "linear_attention" for i in range(num_layers))
    fields = {"partial_rotary_factor": 0.5}
    return fields | ({"layer_types": kinds, "mamba": mamba2_shape(cfg)} if "linear_attention" in kinds else {})


def hyperclovax_fields(cfg: dict[str, Any], num_layers: int = 0) -> dict[str, Any]:
    """HyperCLOVA X SEED (`HyperCLOVAXForCausalLM`, transformers' `HyperCLOVAXConfig`): Granite 3's scalars but the
    logits times `logits_scaling` (not over it: `ModelConfig.logit_scale`) and q.k times `attention_multiplier` only
    where set (head_dim ** -0.5 otherwise), and a norm on each sublayer's output (`use_post_norm`, on by default)."""
    fields = granite_fields(cfg)
    return {**fields, "attention_multiplier": read_float(cfg, "attention_multiplier", None),
            "logits_scaling": 1.0, "logit_scale": fields["logits_scaling"],
            "peri_norms": read_bool(cfg, "use_post_norm", True)}
