"""NVIDIA's Nemotron-H config.json (`NemotronHForCausalLM`: Nemotron-H 8B, 47B, 56B, Nemotron Nano 2 9B and 12B,
Nemotron 3) as transformers' `NemotronHConfig` reads it: a stack of single-mixer blocks, each Mamba-2 (`M`),
attention without a rotary (`*`) or a squared-ReLU MLP (`-`), given as `layers_block_type` (or `layer_types`) or the
hub checkpoints' `hybrid_override_pattern` string; Nemotron 3's MoE blocks (`E`: DeepSeek V3's grouped sigmoid router
over squared-ReLU experts without a gate, beside a shared one) too, and Nemotron 3 Super's over a latent projection."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import Mamba2Shape

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
KINDS = ("linear_attention", "full_attention", "mlp", "moe")   # an `mlp` or `moe` block keeps no cache, no state


def block_kinds(cfg: dict[str, Any]) -> list[str]:
    """Each block's kind: `layers_block_type` (or `layer_types`) as transformers 5 saves it, else the
    `hybrid_override_pattern` a character a block; the count of blocks is theirs (transformers ignores a
    `num_hidden_layers` that says otherwise)."""
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None:
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or any(c not in PATTERN for c in pattern):
            raise ConfigError(f"hybrid_override_pattern: one of M, *, - or E a block, got {pattern!r:.80}")
        kinds = [PATTERN[c] for c in pattern]
    if not isinstance(kinds, list) or not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError(f"layers_block_type: one of {', '.join(KINDS)} a block, got {kinds!r:.80}")
    if "full_attention" not in kinds:
        raise ConfigError("layers_block_type: Nemotron-H with no attention block is not served")
    return kinds


def nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with `num_hidden_layers` the count of its blocks (`block_kinds`)."""
    return {**cfg, "num_hidden_layers": len(block_kinds(cfg))}


def nemotron_h_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The blocks' kinds and their Mamba-2 shape (`mamba_num_heads` of `mamba_head_dim`, `ssm_state_size`,
    `n_groups`, `conv_kernel` taps with a bias where `use_conv_bias`, projections biased where `use_bias`, a prefill's
    dt at least `time_step_min` (transformers' Nemotron-H mixer: its `time_step_limit` unread); older configs'
    `mamba_*` names too); attention without a rotary or biases; the
    norms' `layer_norm_epsilon`. The MLP is squared ReLU (`mlp_hidden_act` relu2), the Mamba activation SiLU."""
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ConfigError(f"{key}: Nemotron-H is served with {want} there, got {cfg[key]!r}")
    if read_bool(cfg, "mlp_bias", False):
        raise ConfigError("mlp_bias: Nemotron-H's MLPs and latent projections are served without biases, got true")

    def either(new: str, old: str, default: Any, read=read_int) -> Any:
        return read(cfg, new, default) if new in cfg else read(cfg, old, default)

    least = either("time_step_min", "mamba_dt_min", 0.001, read_float)   # the mixer's dt floor (not time_step_limit)
    shape = Mamba2Shape(num_heads=read_int(cfg, "mamba_num_heads", 128), head_dim=read_int(cfg, "mamba_head_dim", 64),
                        d_state=read_int(cfg, "ssm_state_size", 128), n_groups=either("n_groups", "mamba_n_groups", 8),
                        conv_kernel=either("conv_kernel", "mamba_d_conv", 4),
                        conv_bias=either("use_conv_bias", "mamba_conv_bias", True, read_bool),
                        proj_bias=read_bool(cfg, "use_bias", False), dt_limit=(least, float("inf")))
    kinds = block_kinds(cfg)
    fields = {"layer_types": tuple(kinds), "mamba": shape, "no_rope_layers": (0,) * num_layers,
              "attention_bias": False, "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5)}
    return fields | (_experts(cfg, kinds) if "moe" in kinds else {})


def _experts(cfg: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """Nemotron 3's MoE blocks: `n_routed_experts` of `moe_intermediate_size`, `num_experts_per_tok` a token from the
    `topk_group` best of `n_group` groups by DeepSeek V3's sigmoid router (its correction bias, renormalised where
    `norm_topk_prob`, times `routed_scaling_factor`), beside `n_shared_experts` of `moe_shared_expert_intermediate_size`
    (one MLP of their rows); the other blocks have none. Nemotron 3 Super's experts work in a latent space of
    `moe_latent_size` (null: none), the hidden state projected into it and their sum back out."""
    experts, groups = read_int(cfg, "n_routed_experts", 8), read_int(cfg, "n_group", 1)
    top_k, topk_group = read_int(cfg, "num_experts_per_tok", 2), read_int(cfg, "topk_group", 1)
    if experts % groups or topk_group > groups or top_k > topk_group * (experts // groups):
        raise ConfigError(f"n_group: {groups} groups of {experts} experts, {topk_group} chosen a token, cannot hold "
                          f"num_experts_per_tok {top_k}")
    shared = read_int(cfg, "moe_shared_expert_intermediate_size", 7688) * \
        read_int(cfg, "n_shared_experts", 1, minimum=0)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 7688),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True), "moe_router": "deepseek_v3",
            "moe_groups": (groups, topk_group), "routed_scaling_factor": read_float(cfg, "routed_scaling_factor", 1.0),
            "shared_expert_intermediate_size": shared, "shared_expert_gated": False, "moe_float_weights": True,
            "moe_latent_size": read_int(cfg, "moe_latent_size", None) or 0,
            "mlp_only_layers": tuple(i for i, kind in enumerate(kinds) if kind != "moe")}


def nemotron_h_params(config: Any, heads: int, kv_heads: int, i: int, moe_i: int, shared_i: int,
                      vocab_rows: int) -> int:
    """Parameters of a Nemotron-H rank holding `heads` query and `kv_heads` KV heads (its share of the Mamba heads
    too), `i` MLP rows, `moe_i` rows of each expert and `shared_i` of the shared one: each block its norm and its
    mixer (attention's q, k, v, o; Mamba-2's, `Mamba2Shape.num_params`; the MLP's up and down; the MoE's experts,
    router, shared expert and latent projections, whole on every rank), the embedding, the final norm and an untied
    head."""
    h, d, latent = config.hidden_size, config.head_dim, config.moe_latent_size
    experts = config.num_experts * (2 * (latent or h) * moe_i + h + 1)   # up, down; the router and its bias
    experts += 2 * h * latent   # into the latent space and back
    mixer = {"full_attention": h * (heads + 2 * kv_heads) * d + heads * d * h,
             "linear_attention": config.mamba.per_rank(config.num_heads // heads).num_params(h), "mlp": 2 * h * i,
             "moe": experts + 2 * h * shared_i}
    blocks = sum(h + mixer[kind] for kind in config.layer_types)
    return vocab_rows * h * (1 if config.tie_word_embeddings else 2) + blocks + h
