"""Gemma 4's text model as its config.json gives it (transformers' `Gemma4TextConfig` names and defaults), as
`ModelConfig` fields.

- `layer_types`: sliding layers (a window of `sliding_window`, 512) and full ones (by default every 6th), the last
  layer full whatever the list says (transformers forces it);
- the full layers' own attention shape (`FullAttentionShape`): a head of `global_head_dim` (512) and
  `num_global_key_value_heads` KV heads (the sliding layers' count where absent), as the release's config.json
  names them, or the `per_layer_config` transformers 5 saves in their place; with `attention_k_eq_v` a full
  layer's values are its keys' projection (no v_proj). Each layer's K/V lie in the paged cache in its own shape
  (`engine.kv_cache`: one tensor a shape);
- each type its rope: the sliding layers' default rope (10,000), the full layers' `proportional` one (1,000,000, a
  quarter of the pairs turning; transformers' frequencies over the whole head, `ModelConfig.rope_proportional`);
- q and k normed per head (a plain RMSNorm: x times its weight, not Gemma 3's 1 + weight), v normed without a
  weight, and q.k not scaled (`query_pre_attn_scalar` 1);
- `enable_moe_block`: every layer's dense MLP runs beside `num_experts` experts of `moe_intermediate_size`,
  `top_k_experts` a token, picked by a router of its own (`MOE_ROUTER`).
Refused by key, before a weight is read: per-layer embeddings (`hidden_size_per_layer_input` > 0: Gemma 4's E2B and
E4B), layers that share another layer's K/V (`num_kv_shared_layers`), bidirectional attention, a rope type or a
scaling factor past these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import is_int, read_bool, read_float, read_int, read_object, rope_type

MOE_ROUTER = "gemma4"   # RMS-normed input (no weight) x scale / sqrt(hidden) -> softmax -> top k, renormed, x per expert


@dataclass(frozen=True)
class FullAttentionShape:
    """Gemma 4's full layers' attention: `num_kv_heads` KV heads of `head_dim` (the sliding layers keep the model's
    own), and whether their values are their keys' projection (`k_eq_v`)."""

    num_kv_heads: int
    head_dim: int
    k_eq_v: bool = False


def gemma4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Gemma 4 text config (see the module docstring)."""
    _refuse_unserved(cfg)
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: must be a list of sliding_attention / full_attention, got {kinds!r:.80}")
    kinds = [*kinds[:-1], "full_attention"] if kinds else kinds   # transformers forces the last layer full
    full_theta, rotary, local_theta = _ropes(cfg)
    head_dim = read_int(cfg, "head_dim", 256)
    k_eq_v = read_bool(cfg, "attention_k_eq_v", False)
    full = _full_attention(cfg, kinds, head_dim, k_eq_v)
    fields = {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 512), "qk_norm": True,
              "query_pre_attn_scalar": 1.0, "rope_local_theta": local_theta, "partial_rotary_factor": rotary,
              "rope_proportional": True, "full_rope": ({"rope_theta": full_theta},), "full_attention": full,
              "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh", "head_dim": head_dim,
              "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
              "final_logit_softcapping": read_float(cfg, "final_logit_softcapping", None)}
    if read_bool(cfg, "enable_moe_block", False):
        fields |= {"num_experts": read_int(cfg, "num_experts"), "num_experts_per_tok": read_int(cfg, "top_k_experts"),
                   "moe_intermediate_size": read_int(cfg, "moe_intermediate_size"), "norm_topk_prob": True,
                   "moe_router": MOE_ROUTER, "moe_float_weights": True}
    return fields


def _refuse_unserved(cfg: dict[str, Any]) -> None:
    """A ConfigError naming the key of what Gemma 4 asks that is not served."""
    per_layer_input = cfg.get("hidden_size_per_layer_input", 256)   # transformers' default; null or 0: none
    if per_layer_input is not None and (not is_int(per_layer_input) or per_layer_input != 0):
        raise ConfigError(f"hidden_size_per_layer_input: per-layer embeddings (Gemma 4 E2B, E4B) are not served; "
                          f"0 or null is, got {per_layer_input!r:.40}")
    if read_int(cfg, "num_kv_shared_layers", 0, minimum=0):
        raise ConfigError("num_kv_shared_layers: layers that reuse another layer's K/V are not served; 0 is, got "
                          f"{cfg['num_kv_shared_layers']!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served, got "
                          f"{cfg['use_bidirectional_attention']!r:.40}")


def _ropes(cfg: dict[str, Any]) -> tuple[float, float, float]:
    """(the full layers' rope base, the share of their pairs that turn, the sliding layers' base) from
    `rope_parameters.full_attention` (`proportional`, or `default` turning every pair) and `.sliding_attention`
    (`default`); transformers' defaults where `rope_parameters` is absent."""
    params = read_object(cfg, "rope_parameters")
    if params is None:
        return 1_000_000.0, 0.25, 10_000.0
    if set(params) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"rope_parameters: Gemma 4 takes one entry per layer type (full_attention, "
                          f"sliding_attention), got {sorted(params)}")
    full = read_object(params, "full_attention", name="rope_parameters.full_attention") or {}
    local = read_object(params, "sliding_attention", name="rope_parameters.sliding_attention") or {}
    path = "rope_parameters.full_attention."
    if rope_type(full) not in ("default", "proportional"):
        raise ConfigError(f"{path}rope_type: 'proportional' or 'default' is served for the full layers, got "
                          f"{rope_type(full)!r}")
    if read_float(full, "factor", 1.0, path=path) != 1.0:
        raise ConfigError(f"{path}factor: a scaled proportional rope is not served; 1.0 is, got {full['factor']!r}")
    if rope_type(local) != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type: only 'default' is served for the sliding "
                          f"layers, got {rope_type(local)!r}")
    rotary = read_float(full, "partial_rotary_factor", 1.0, path=path) if rope_type(full) == "proportional" else 1.0
    if not 0 < rotary <= 1:
        raise ConfigError(f"{path}partial_rotary_factor: must be in (0, 1], got {rotary!r}")
    return (read_float(full, "rope_theta", 1_000_000.0, path=path), rotary,
            read_float(local, "rope_theta", 10_000.0, path="rope_parameters.sliding_attention."))


def _full_attention(cfg: dict[str, Any], kinds: list[Any], head_dim: int, k_eq_v: bool) -> FullAttentionShape:
    """The full layers' shape: from `per_layer_config` where config.json has one (an entry per full layer, all
    alike, of `head_dim` and `num_key_value_heads`), else from `global_head_dim` and `num_global_key_value_heads`
    (the latter read only with `attention_k_eq_v`, as transformers does)."""
    kv_heads = read_int(cfg, "num_key_value_heads", 4)
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        heads = read_int(cfg, "num_global_key_value_heads", None) if k_eq_v else None
        return FullAttentionShape(heads or kv_heads, read_int(cfg, "global_head_dim", 512), k_eq_v)
    full = [str(i) for i, kind in enumerate(kinds) if kind == "full_attention"]
    if not isinstance(per_layer, dict) or sorted(per_layer) != sorted(full) or any(
            not isinstance(entry, dict) or set(entry) - {"head_dim", "num_key_value_heads"} or entry != per_layer[full[0]]
            for entry in per_layer.values()):
        raise ConfigError(f"per_layer_config: served as one entry alike for each full layer ({', '.join(full)}) of "
                          f"head_dim and num_key_value_heads, got {per_layer!r:.120}")
    entry = per_layer[full[0]] if full else {}
    return FullAttentionShape(read_int(entry, "num_key_value_heads", kv_heads, path="per_layer_config."),
                              read_int(entry, "head_dim", head_dim, path="per_layer_config."), k_eq_v)


def rank_kv_heads(kv_heads: int, size: int) -> int:
    """The KV heads each of `size` tensor-parallel ranks holds of `kv_heads`: its share, or one (replicated) where the
    ranks outnumber them (`engine.parallel.ShardShape`'s rule)."""
    return kv_heads // size if kv_heads % size == 0 else 1


def gemma4_params(config: Any, heads: int, kv_heads: int, inter: int, moe_inter: int, vocab_rows: int) -> int:
    """Parameters of a Gemma 4 text model (or one rank's) with `heads` query heads and `kv_heads` KV heads a sliding
    layer (the full layers' own: `FullAttentionShape`, this rank's share): each layer's q/k/v/o (no v with `k_eq_v`),
    q/k norms, four norms, its MLP and output scalar, and with experts their router (projection, scale, a scale per
    expert), experts and three more norms; the embedding, the final norm, an untied head."""
    h, full, size = config.hidden_size, config.full_attention, config.num_heads // heads
    total = vocab_rows * h * (1 if config.tie_word_embeddings else 2) + h
    for layer in range(config.num_layers):
        d, kv, shared_v = config.head_dim, kv_heads, False
        if config.layer_window(layer) is None:
            d, kv, shared_v = full.head_dim, rank_kv_heads(full.num_kv_heads, size), full.k_eq_v
        total += h * heads * d * 2 + h * kv * d * (1 if shared_v else 2) + 2 * d + 4 * h + 3 * h * inter + 1
        if config.num_experts:
            total += config.num_experts * (h + 1 + 3 * h * moe_inter) + h + 3 * h
    return total
