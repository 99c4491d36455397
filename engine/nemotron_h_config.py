"""NVIDIA's Nemotron-H config.json (`NemotronHForCausalLM`: Nemotron-H 8B, 47B, 56B, Nemotron Nano 2 9B and 12B) as
transformers' `NemotronHConfig` reads it: a stack of single-mixer blocks, each Mamba-2 (`M`), attention without a
rotary (`*`) or a squared-ReLU MLP (`-`), given as `layers_block_type` (or `layer_types`) or the hub checkpoints'
`hybrid_override_pattern` string; its MoE blocks (`E`, Nemotron 3's) are refused by name."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import Mamba2Shape

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
KINDS = ("linear_attention", "full_attention", "mlp")   # served; a block of `mlp` keeps no cache and no state


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
    if not isinstance(kinds, list) or not kinds or any(k not in (*KINDS, "moe") for k in kinds):
        raise ConfigError(f"layers_block_type: one of {', '.join(KINDS)} or moe a block, got {kinds!r:.80}")
    if "moe" in kinds:
        raise ConfigError("layers_block_type: Nemotron-H's MoE blocks (Nemotron 3's) are not served")
    if "full_attention" not in kinds:
        raise ConfigError("layers_block_type: Nemotron-H with no attention block is not served")
    return kinds


def nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with `num_hidden_layers` the count of its blocks (`block_kinds`)."""
    return {**cfg, "num_hidden_layers": len(block_kinds(cfg))}


def nemotron_h_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The blocks' kinds and their Mamba-2 shape (`mamba_num_heads` of `mamba_head_dim`, `ssm_state_size`,
    `n_groups`, `conv_kernel` taps with a bias where `use_conv_bias`, projections biased where `use_bias`, dt
    clamped to `time_step_limit`; older configs' `mamba_*` names too); attention without a rotary or biases; the
    norms' `layer_norm_epsilon`. The MLP is squared ReLU (`mlp_hidden_act` relu2), the Mamba activation SiLU."""
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ConfigError(f"{key}: Nemotron-H is served with {want} there, got {cfg[key]!r}")

    def either(new: str, old: str, default: Any, read=read_int) -> Any:
        return read(cfg, new, default) if new in cfg else read(cfg, old, default)

    limit = cfg.get("time_step_limit", cfg.get("mamba_dt_limit")) or (0.0, float("inf"))
    if isinstance(limit, (list, tuple)):   # transformers 5 writes infinity as {"__float__": "Infinity"}
        limit = [float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v for v in limit]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not all(isinstance(v, (int, float)) for v in limit):
        raise ConfigError(f"time_step_limit: two numbers (the least and the most dt), got {limit!r:.40}")
    shape = Mamba2Shape(num_heads=read_int(cfg, "mamba_num_heads", 128), head_dim=read_int(cfg, "mamba_head_dim", 64),
                        d_state=read_int(cfg, "ssm_state_size", 128), n_groups=either("n_groups", "mamba_n_groups", 8),
                        conv_kernel=either("conv_kernel", "mamba_d_conv", 4),
                        conv_bias=either("use_conv_bias", "mamba_conv_bias", True, read_bool),
                        proj_bias=read_bool(cfg, "use_bias", False), dt_limit=(float(limit[0]), float(limit[1])))
    return {"layer_types": tuple(block_kinds(cfg)), "mamba": shape, "no_rope_layers": (0,) * num_layers,
            "attention_bias": False, "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5)}


def nemotron_h_params(config: Any, heads: int, kv_heads: int, vocab_rows: int) -> int:
    """Parameters of a Nemotron-H model with `heads` query and `kv_heads` KV heads: each block its norm and its mixer
    (attention's q, k, v, o; Mamba-2's, `Mamba2Shape.num_params`; the MLP's up and down), the embedding, the final
    norm and an untied head."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    mixer = {"full_attention": h * (heads + 2 * kv_heads) * d + heads * d * h,
             "linear_attention": config.mamba.num_params(h), "mlp": 2 * h * inter}
    blocks = sum(h + mixer[kind] for kind in config.layer_types)
    return vocab_rows * h * (1 if config.tie_word_embeddings else 2) + blocks + h
