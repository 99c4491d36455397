"""Gemma 4's text model as its config.json gives it (transformers' `Gemma4TextConfig` names and defaults), as
`ModelConfig` fields.

- `layer_types`: sliding layers (a window of `sliding_window`, 512) and full ones (by default every 6th), the last
  layer full whatever the list says (transformers forces it);
- the full layers' own attention shape (`Gemma4Shape`): a head of `global_head_dim` (512) and
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
- the E2B's and E4B's per-layer inputs (`hidden_size_per_layer_input`: each token's own slice of a table of
  `vocab_size_per_layer_input` rows, mixed with a projection of its embedding, gated into each layer's output) and
  their last `num_kv_shared_layers` layers, which attend to the K/V of the last layer of their type before them
  (keeping none of their own; with `use_double_wide_mlp`, their MLPs twice as wide).
Refused by key, before a weight is read: bidirectional attention, shared K/V layers without a layer of each type
before them, a rope type or a scaling factor past these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int, read_object, rope_type

# RMS-normed input (no weight) x scale / sqrt(hidden) -> softmax -> top k, renormed, each x its expert's scale
MOE_ROUTER = "gemma4"


@dataclass(frozen=True)
class Gemma4Shape:
    """What a Gemma 4 text model has past Gemma 3's layer: its full layers' `num_kv_heads` KV heads of `head_dim` (the
    sliding layers keep the model's own) and whether their values are their keys' projection (`k_eq_v`); per-layer
    inputs of `per_layer_input_size` (0: none) from a table of `per_layer_vocab_size` rows; the last
    `kv_shared_layers` layers attending to the K/V of the last layer of their type before them (`kv_producer`), with
    MLPs twice as wide where `double_wide_mlp`."""

    num_kv_heads: int
    head_dim: int
    k_eq_v: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False

    def kv_producer(self, config: Any, layer: int) -> int:
        """The layer whose K/V layer `layer` attends to: itself, or for one of the last `kv_shared_layers` the last
        layer of its type before them (transformers' `kv_sharing_modes`)."""
        first = config.num_layers - self.kv_shared_layers
        if layer < first:
            return layer
        return max(i for i in range(first) if config.layer_types[i] == config.layer_types[layer])

    def mlp_width(self, config: Any, layer: int) -> int:
        """Layer `layer`'s MLP intermediate size: twice the model's on a shared-K/V layer with `double_wide_mlp`."""
        wide = self.double_wide_mlp and self.kv_producer(config, layer) != layer
        return config.intermediate_size * (2 if wide else 1)


def gemma4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Gemma 4 text config (see the module docstring)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: must be a list of sliding_attention / full_attention, got {kinds!r:.80}")
    kinds = [*kinds[:-1], "full_attention"] if kinds else kinds   # transformers forces the last layer full
    _refuse_unserved(cfg, kinds)
    full_theta, rotary, local_theta = proportional_ropes(cfg, "Gemma 4", 0.25)
    head_dim = read_int(cfg, "head_dim", 256)
    k_eq_v = read_bool(cfg, "attention_k_eq_v", False)
    full = replace(_full_attention(cfg, kinds, head_dim, k_eq_v), **_per_layer_fields(cfg))
    fields = {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 512), "qk_norm": True,
              "query_pre_attn_scalar": 1.0, "rope_local_theta": local_theta, "partial_rotary_factor": rotary,
              "rope_proportional": True, "full_rope": ({"rope_theta": full_theta},), "gemma4": full,
              "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh", "head_dim": head_dim,
              "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
              "final_logit_softcapping": read_float(cfg, "final_logit_softcapping", None)}
    if read_bool(cfg, "enable_moe_block", False):
        fields |= {"num_experts": read_int(cfg, "num_experts"), "num_experts_per_tok": read_int(cfg, "top_k_experts"),
                   "moe_intermediate_size": read_int(cfg, "moe_intermediate_size"), "norm_topk_prob": True,
                   "moe_router": MOE_ROUTER, "moe_float_weights": True}
    return fields


def _refuse_unserved(cfg: dict[str, Any], kinds: list[Any]) -> None:
    """A ConfigError naming the key of what Gemma 4 asks that is not served."""
    shared = read_int(cfg, "num_kv_shared_layers", 0, minimum=0)
    kept = set(kinds[:len(kinds) - shared])
    if shared and (shared >= len(kinds) or kept != set(kinds)):
        raise ConfigError(f"num_kv_shared_layers: {shared} leaves no layer of each type before them to share the K/V "
                          f"of ({len(kinds)} layers)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served, got "
                          f"{cfg['use_bidirectional_attention']!r:.40}")


def _per_layer_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The per-layer inputs' size (`hidden_size_per_layer_input`: transformers' default 256 where absent; null or 0:
    none) and table (`vocab_size_per_layer_input`), the shared K/V layers and their MLPs' width."""
    size = cfg.get("hidden_size_per_layer_input", 256)
    size = 0 if size is None else read_int(cfg, "hidden_size_per_layer_input", 0, minimum=0)
    return {"per_layer_input_size": size,
            "per_layer_vocab_size": read_int(cfg, "vocab_size_per_layer_input", 262_144) if size else 0,
            "kv_shared_layers": read_int(cfg, "num_kv_shared_layers", 0, minimum=0),
            "double_wide_mlp": read_bool(cfg, "use_double_wide_mlp", False)}


def proportional_ropes(cfg: dict[str, Any], family: str, rotary: float) -> tuple[float, float, float]:
    """(the full layers' rope base, the share of their pairs that turn, the sliding layers' base) from
    `rope_parameters.full_attention` (`proportional`, or `default` turning every pair) and `.sliding_attention`
    (`default`): Gemma 4's and LFM3's (`family`); transformers' defaults (1,000,000, `rotary`, 10,000) where
    `rope_parameters` is absent."""
    params = read_object(cfg, "rope_parameters")
    if params is None:
        return 1_000_000.0, rotary, 10_000.0
    if set(params) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"rope_parameters: {family} takes one entry per layer type (full_attention, "
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


def _full_attention(cfg: dict[str, Any], kinds: list[Any], head_dim: int, k_eq_v: bool) -> Gemma4Shape:
    """The full layers' shape: from `per_layer_config` where config.json has one (an entry per full layer, all
    alike, of `head_dim` and `num_key_value_heads`), else from `global_head_dim` and `num_global_key_value_heads`
    (the latter read only with `attention_k_eq_v`, as transformers does)."""
    kv_heads = read_int(cfg, "num_key_value_heads", 4)
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        heads = read_int(cfg, "num_global_key_value_heads", None) if k_eq_v else None
        return Gemma4Shape(heads or kv_heads, read_int(cfg, "global_head_dim", 512), k_eq_v)
    full = [str(i) for i, kind in enumerate(kinds) if kind == "full_attention"]
    if not isinstance(per_layer, dict) or sorted(per_layer) != sorted(full) or any(
            not isinstance(entry, dict) or set(entry) - {"head_dim", "num_key_value_heads"}
            or entry != per_layer[full[0]]
            for entry in per_layer.values()):
        raise ConfigError(f"per_layer_config: served as one entry alike for each full layer ({', '.join(full)}) of "
                          f"head_dim and num_key_value_heads, got {per_layer!r:.120}")
    entry = per_layer[full[0]] if full else {}
    return Gemma4Shape(read_int(entry, "num_key_value_heads", kv_heads, path="per_layer_config."),
                              read_int(entry, "head_dim", head_dim, path="per_layer_config."), k_eq_v)


def rank_kv_heads(kv_heads: int, size: int) -> int:
    """The KV heads each of `size` tensor-parallel ranks holds of `kv_heads`: its share, or one (replicated) where the
    ranks outnumber them (`engine.parallel.ShardShape`'s rule)."""
    return kv_heads // size if kv_heads % size == 0 else 1


def gemma4_params(config: Any, heads: int, kv_heads: int, inter: int, moe_inter: int, vocab_rows: int) -> int:
    """Parameters of a Gemma 4 text model (or one rank's) with `heads` query heads and `kv_heads` KV heads a sliding
    layer (the full layers' own: `Gemma4Shape`, this rank's share): each layer's q/k/v/o (no v with `k_eq_v`, q and
    o alone on a shared-K/V layer), q/k norms, four norms, its MLP (`mlp_width`) and output scalar, with per-layer
    inputs their gate, projection and norm, with experts their router (projection, scale, a scale per expert),
    experts and three more norms; the embedding (and the per-layer inputs' table, projection and norm, whole on every
    rank), the final norm, an untied head."""
    h, g, size = config.hidden_size, config.gemma4, config.num_heads // heads
    p = g.per_layer_input_size
    total = vocab_rows * h * (1 if config.tie_word_embeddings else 2) + h
    total += (g.per_layer_vocab_size + h) * config.num_layers * p + p if p else 0
    for layer in range(config.num_layers):
        d, kv, shared_v = config.head_dim, kv_heads, False
        if config.layer_window(layer) is None:
            d, kv, shared_v = g.head_dim, rank_kv_heads(g.num_kv_heads, size), g.k_eq_v
        if g.kv_producer(config, layer) != layer:   # q and o alone
            kv, d_kv = 0, 0
        else:
            d_kv = d
        total += h * heads * d * 2 + h * kv * d * (1 if shared_v else 2) + d + d_kv + 4 * h + 1
        total += 3 * h * inter * (g.mlp_width(config, layer) // config.intermediate_size) + (2 * h * p + h if p else 0)
        if config.num_experts:
            total += config.num_experts * (h + 1 + 3 * h * moe_inter) + h + 3 * h
    return total
