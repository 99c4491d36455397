"""Zyphra's Zamba2 config.json (transformers' `Zamba2Config` names and defaults) as `ModelConfig` fields.

Every Zamba2 layer is Mamba-2 (`engine.mamba_config.Mamba2Shape`); the `hybrid` ones (`layers_block_type`)
run a shared transformer block first, whose output, through the layer's own linear, joins the Mamba layer's input.
The shared blocks are `num_mem_blocks` (`Zamba2Blocks`), the hybrid layers cycling through them; each use of a block
has its own low-rank adapters (`adapter_rank`) on the MLP's gate/up and, where `use_shared_attention_adapter`, on q,
k and v. A block's attention reads the layer's input beside the embeddings (2 x hidden_size wide), its heads
`2 x hidden_size / num_attention_heads` wide, its scores scaled by (head_dim / 2) ** -0.5, turned by a rotary only
where `use_mem_rope`; its MLP is gated by exact GELU. What we do not serve is refused naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.mamba_config import Mamba2Shape

__all__ = ["Zamba2Blocks", "zamba2_config", "zamba2_fields", "zamba2_params"]


@dataclass(frozen=True)
class Zamba2Blocks:
    """The shared transformer blocks: `count` of them, the hybrid layers using them in turn; adapters of rank
    `adapter_rank` on each use's MLP gate/up, and on its q, k and v where `attention_adapters`; their attention turned
    by a rotary where `rope`."""

    count: int
    adapter_rank: int
    attention_adapters: bool
    rope: bool = False   # `use_mem_rope`: the blocks' attention turned by a rotary (else NoPE)


def zamba2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names: the attention heads `2 x hidden_size / num_attention_heads` wide
    (`head_dim`), the MLP `intermediate_size` (4 x hidden_size where null), GELU, a tied head by default, the norms'
    eps `rms_norm_eps` (1e-5); a rotary only where `use_mem_rope`."""
    hidden, heads = read_int(cfg, "hidden_size"), read_int(cfg, "num_attention_heads", 32)
    if read_bool(cfg, "use_long_context", False):
        raise ConfigError("use_long_context: Zamba2's rescaled long-context rope is not served")
    rope = {} if read_bool(cfg, "use_mem_rope", False) else {"rope_parameters": None, "rope_scaling": None}
    return {**cfg, **rope, "num_attention_heads": heads, "head_dim": 2 * hidden // heads,
            "intermediate_size": read_int(cfg, "intermediate_size", None) or 4 * hidden,
            "hidden_act": cfg.get("hidden_act", "gelu"), "rms_norm_eps": read_float(cfg, "rms_norm_eps", 1e-5),
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def zamba2_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The layers' kinds (`layers_block_type`: linear_attention, the legacy mamba, or hybrid; at least one hybrid),
    the Mamba-2 shape (`n_mamba_heads` 8 of `mamba_expand` (2) x hidden / heads, `mamba_d_state` 64, `mamba_ngroups`
    1, `mamba_d_conv` 4, its convolution always biased, in_proj and out_proj where `add_bias_linear`, a prefill's dt
    at least `time_step_min`), the shared blocks."""
    kinds = cfg.get("layers_block_type")
    if not isinstance(kinds, list) or len(kinds) != num_layers or \
            any(k not in ("linear_attention", "mamba", "hybrid") for k in kinds) or "hybrid" not in kinds:
        raise ConfigError(f"layers_block_type: linear_attention (mamba) or hybrid for each of the {num_layers} layers, "
                          f"at least one hybrid, got {kinds!r:.80}")
    hidden, heads = read_int(cfg, "hidden_size"), read_int(cfg, "n_mamba_heads", 8)
    inter = read_int(cfg, "mamba_expand", 2) * hidden
    if inter % heads:
        raise ConfigError(f"n_mamba_heads: {heads} does not divide mamba_expand x hidden_size {inter}")
    bias = read_bool(cfg, "add_bias_linear", False)
    shape = Mamba2Shape(num_heads=heads, head_dim=inter // heads, d_state=read_int(cfg, "mamba_d_state", 64),
                        n_groups=read_int(cfg, "mamba_ngroups", 1),
                        conv_kernel=read_int(cfg, "mamba_d_conv", 4, minimum=2), conv_bias=True, proj_bias=bias,
                        dt_limit=(read_float(cfg, "time_step_min", 0.001, positive=False), float("inf")))
    blocks = Zamba2Blocks(count=read_int(cfg, "num_mem_blocks", 1), adapter_rank=read_int(cfg, "adapter_rank", 128),
                          attention_adapters=read_bool(cfg, "use_shared_attention_adapter", False),
                          rope=read_bool(cfg, "use_mem_rope", False))
    if blocks.attention_adapters and cfg.get("num_key_value_heads") not in (None, cfg["num_attention_heads"]):
        raise ConfigError("num_key_value_heads: Zamba2's k and v adapters are as wide as q: one KV head a query head")
    return {"layer_types": tuple("hybrid" if k == "hybrid" else "linear_attention" for k in kinds), "mamba": shape,
            "zamba2": blocks, "mlp_bias": bias, "query_pre_attn_scalar": cfg["head_dim"] / 2}


def zamba2_params(config: Any, heads: int, kv_heads: int, i: int, vocab_rows: int) -> int:
    """Parameters of a Zamba2 model's rank holding `heads` query and `kv_heads` KV heads, `i` MLP rows (its share of
    the Mamba heads too): each layer's norm and Mamba mixer, each hybrid layer's linear and its adapters, the shared
    blocks (two norms, attention from 2 x hidden, the gated MLP), the embedding, the final norm and an untied head."""
    h, d, b = config.hidden_size, config.head_dim, config.zamba2
    q, kv = heads * d, kv_heads * d
    hybrids = config.layer_types.count("hybrid")
    mamba = config.mamba.per_rank(config.num_heads // heads)
    layers = config.num_layers * (h + mamba.num_params(h)) + hybrids * h * h
    adapters = hybrids * b.adapter_rank * (h + 2 * i + (3 * 2 * h + q + 2 * kv if b.attention_adapters else 0))
    mlp = 3 * h * i + (2 * i + h if config.mlp_bias else 0)   # gate_up, down
    block = 2 * h + (2 * h) * (q + 2 * kv) + q * h + h + mlp
    return vocab_rows * h * (1 if config.tie_word_embeddings else 2) + layers + adapters + b.count * block + h
