"""DeepSeek V4's config.json (`DeepseekV4ForCausalLM`: DeepSeek-V4-Flash, -Pro) as transformers' `DeepseekV4Config`
reads it (its legacy keys too: `compress_ratios`, `compress_rate_csa` / `_hca`, `num_hash_layers`,
`qk_rope_head_dim`), into `DeepseekV4Shape`: what `engine.models.deepseek_v4` builds and the capacity plan counts.

Every layer attends, one KV "head" of `head_dim` (512) shared by its query heads as key and value alike, to its last
`sliding_window` positions; a `compressed_sparse_attention` layer (CSA) also to the `index_topk` best of the entries
its compressor makes of every `compress_rates` (4) positions, as its indexer scores them, and a
`heavily_compressed_attention` layer (HCA) to every entry of each 128 positions. How the cache holds them: a row a
token a layer (`DeepseekV4Shape.row_width`, the layer's KV width in `ModelConfig.layer_kv_shape`), [the token's K=V |
what its compressors take of it (each series' value and gate) | the entry of the window the token closes, where it
closes one (and the indexer's key, for CSA)]. Every piece of a sequence's attention is thus in its paged blocks:
prefix caching, swap, preemption and copy-on-write keep working unchanged, at the price of bytes a token the
reference's rolling buffers do not pay (a row of 6 x 512 + 5 x 128 values for a CSA layer, 4 x 512 for an HCA
layer, against DeepSeek's 512 and a compressed share); the capacity plan counts them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int, read_object
from engine.deepseek_config import check_silu
from engine.rope_config import RopeScaling

__all__ = ["DEEPSEEK_V4_DEFAULTS", "DeepseekV4Shape", "deepseek_v4_fields", "deepseek_v4_float32_params",
           "deepseek_v4_params", "refuse_fp8_cache"]

ARCH = "DeepseekV4ForCausalLM"
KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
# DeepseekV4Config's where config.json names none (DeepSeek-V4-Flash's shape)
DEEPSEEK_V4_DEFAULTS = {"vocab_size": 129_280, "hidden_size": 4096, "intermediate_size": 2048, "num_hidden_layers": 43,
                        "num_attention_heads": 64, "max_position_embeddings": 1_048_576, "rms_norm_eps": 1e-6,
                        "bos_token_id": 0, "eos_token_id": 1}


@dataclass(frozen=True)
class DeepseekV4Shape:
    """DeepSeek V4's attention, streams and routing (the module docstring): `kinds` each layer's attention (sliding,
    csa, hca), `rates` its compression (0: none); the query through a `q_lora_rank` bottleneck into `heads` of
    `head_dim`, the last `rope_dim` of each rotated (pairs (2i, 2i + 1)); the heads' outputs projected in `o_groups`
    groups to `o_lora_rank` each, then to the hidden size. The indexer: `index_heads` of `index_head_dim`. The
    residual stream: `streams` copies, mixed through `sinkhorn_iters` Sinkhorn steps (`hc_eps`). Experts picked by
    `scoring`'s scores (plus a correction bias), the first layers' (`hash_layers`) by a table of the token's id. The
    sliding layers rotate at base `main_theta`, the others (and their entries) at `compress_theta` with
    `compress_rope`."""

    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    kinds: tuple[str, ...]
    rates: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    index_topk: int
    streams: int
    sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    scoring: str
    swiglu_limit: float | None
    main_theta: float
    compress_theta: float
    compress_rope: RopeScaling

    def row_width(self, layer: int) -> int:
        """A token's cache row in layer `layer` (the module docstring): K=V; and for HCA its compressor's value and
        gate, the entry; for CSA two series of each, the entry, and the indexer's two series of each and its key."""
        d, di = self.head_dim, self.index_head_dim
        return {"sliding": d, "hca": 4 * d, "csa": 6 * d + 5 * di}[self.kinds[layer]]

    def num_params(self, hidden: int, heads: int, num_layers: int, total_heads: int | None = None) -> int:
        """The attention of every layer (with its compressors and indexer) and the streams' mixes, the head's too, on a
        rank of `heads` query heads of the model's `total_heads` (default: all of them)."""
        d, di, r, n = self.head_dim, self.index_head_dim, self.q_lora_rank, self.streams
        total_heads = heads if total_heads is None else total_heads
        groups = self.o_groups * heads // total_heads   # this rank's
        attn = hidden * r + r + r * heads * d + hidden * d + d + heads * d * self.o_lora_rank \
            + groups * self.o_lora_rank * hidden + heads
        series = {"sliding": 0, "hca": 1, "csa": 2}
        total = 0
        for kind, rate in zip(self.kinds, self.rates):
            s = series[kind]
            total += attn + s * (2 * hidden * d + rate * d) + (d if s else 0)
            if kind == "csa":   # the indexer: its compressor, its query from q's bottleneck, its heads' weights
                total += 2 * (2 * hidden * di + rate * di) + di + r * self.index_heads * di + hidden * self.index_heads
        mixes = 2 * ((2 + n) * n * n * hidden + (2 + n) * n + 3)
        return total + num_layers * mixes + n * n * hidden + n + 1


def refuse_fp8_cache(model: Any, kv_dtype: Any, key: str = "kv_cache_dtype") -> None:
    """A ConfigError naming `key` for DeepSeek V4 over a one-byte (FP8) cache: its rows hold the compressors' values
    and gates, which no per-layer scale fits; the model's dtype (auto) is served. (MiniMax M3's FP8 cache keeps its
    indexer keys in bfloat16: `engine.minimax_m3_config.index_key_dtype`.)"""
    if getattr(model, "deepseek_v4", None) is not None and kv_dtype.itemsize == 1:
        raise ConfigError(f"{key}: DeepSeek V4 is served with a cache of the model's dtype (auto), not fp8")


def deepseek_v4_params(config: Any, heads: int, kv_heads: int, i: int, moe_i: int, v: int, shared_i: int) -> int:
    """The parameters of a DeepSeek V4 rank of `heads` query heads, `moe_i` and `shared_i` rows of each expert and of
    the shared one, `v` vocabulary rows: its embedding and head, every layer's attention and mixes
    (`DeepseekV4Shape.num_params`), two norms, the router (its correction bias, or a hash layer's table of experts by
    token id), the experts and the shared one; the final norm."""
    s, h, layers = config.deepseek_v4, config.hidden_size, config.num_layers
    experts = config.num_experts * (3 * h * moe_i + h) + 3 * h * shared_i + 2 * h
    routing = _routing(config)
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + head + layers * experts + routing + h + s.num_params(h, heads, layers, config.num_heads)


def _routing(config: Any) -> int:
    """The routers' own tables: each learned router's correction bias, each hash layer's experts by token id."""
    s = config.deepseek_v4
    return (config.num_layers - len(s.hash_layers)) * config.num_experts \
        + len(s.hash_layers) * config.vocab_size * config.num_experts_per_tok


def deepseek_v4_float32_params(config: Any) -> int:
    """Those held in float32 (4 bytes) whatever the model's dtype, as transformers holds them: the streams' mixes,
    every norm's weight (q's bottleneck's, K/V's and the entries', the layers', the final one), the compressors'
    position biases, the correction biases; and the hash tables (int32: 4 bytes too)."""
    s, h, layers = config.deepseek_v4, config.hidden_size, config.num_layers
    n, d, di = s.streams, s.head_dim, s.index_head_dim
    mixes = layers * 2 * ((2 + n) * n * n * h + (2 + n) * n + 3) + n * n * h + n + 1
    norms = layers * (2 * h + s.q_lora_rank + d) + h
    for kind, rate in zip(s.kinds, s.rates):
        norms += {"sliding": 0, "hca": d + rate * d, "csa": d + 2 * rate * d + di + 2 * rate * di}[kind]
    routing = _routing(config)
    return mixes + norms + routing


def deepseek_v4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek V4's `ModelConfig` fields: `DeepseekV4Shape`, the experts (`n_routed_experts` of
    `moe_intermediate_size`, `num_experts_per_tok` a token, one shared expert of that size), a KV head of 512."""
    check_silu(cfg, "DeepSeek V4")
    head_dim = read_int(cfg, "head_dim", 512)
    rope = _rope_dim(cfg, head_dim)
    rates = read_object(cfg, "compress_rates", name="compress_rates") or {}
    csa = read_int(rates, "compressed_sparse_attention", read_int(cfg, "compress_rate_csa", 4), path="compress_rates.")
    hca = read_int(rates, "heavily_compressed_attention", read_int(cfg, "compress_rate_hca", 128),
                   path="compress_rates.")
    kinds = _layer_kinds(cfg, num_layers)
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise ConfigError(f"scoring_func: one of {', '.join(SCORING)}, got {scoring!r}")
    limit = read_float(cfg, "swiglu_limit", 10.0, positive=False)
    main_theta, compress_theta, compress_rope = _ropes(cfg)
    shape = DeepseekV4Shape(
        head_dim=head_dim, rope_dim=rope, q_lora_rank=read_int(cfg, "q_lora_rank", 1024),
        o_groups=read_int(cfg, "o_groups", 8), o_lora_rank=read_int(cfg, "o_lora_rank", 1024),
        window=read_int(cfg, "sliding_window", 128), kinds=tuple(KINDS[k] for k in kinds),
        rates=tuple({"sliding": 0, "csa": csa, "hca": hca}[KINDS[k]] for k in kinds),
        index_heads=read_int(cfg, "index_n_heads", 64), index_head_dim=read_int(cfg, "index_head_dim", 128),
        index_topk=read_int(cfg, "index_topk", 512), streams=read_int(cfg, "hc_mult", 4),
        sinkhorn_iters=read_int(cfg, "hc_sinkhorn_iters", 20), hc_eps=read_float(cfg, "hc_eps", 1e-6),
        hash_layers=_hash_layers(cfg, num_layers), scoring=scoring, swiglu_limit=limit if limit > 0 else None,
        main_theta=main_theta, compress_theta=compress_theta, compress_rope=compress_rope)
    heads = read_int(cfg, "num_attention_heads", DEEPSEEK_V4_DEFAULTS["num_attention_heads"])
    if heads % shape.o_groups:
        raise ConfigError(f"o_groups: must divide num_attention_heads {heads}, got {shape.o_groups}")
    experts = read_int(cfg, "n_routed_experts", 256)
    top_k = read_int(cfg, "num_experts_per_tok", 6)
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is over n_routed_experts {experts}")
    moe_i = read_int(cfg, "moe_intermediate_size", 2048)
    return {"deepseek_v4": shape, "head_dim": head_dim, "num_kv_heads": 1, "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": moe_i, "intermediate_size": moe_i,
            "shared_expert_intermediate_size": moe_i, "shared_expert_gated": False, "norm_topk_prob": True,
            "routed_scaling_factor": read_float(cfg, "routed_scaling_factor", 1.5), "moe_float_weights": True,
            "attention_sinks": True, "swiglu_limit": shape.swiglu_limit, "stacked_experts": True}


def _rope_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The rotated tail of each head: `partial_rotary_factor` x head_dim (the legacy `qk_rope_head_dim`, 64)."""
    legacy = read_int(cfg, "qk_rope_head_dim", None)
    factor = read_float(cfg, "partial_rotary_factor", (legacy or 64) / head_dim)
    rope = int(head_dim * factor)
    if rope <= 0 or rope % 2 or rope > head_dim:
        raise ConfigError(f"partial_rotary_factor: {factor} of head_dim {head_dim} must turn an even count of its "
                          "dimensions")
    return rope


def _layer_kinds(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention: `layer_types`, else the legacy `compress_ratios` (0, 4, 128), else transformers'
    default (two HCA layers, then CSA and HCA by turns)."""
    kinds = cfg.get("layer_types")
    key = "layer_types"
    if kinds is None and cfg.get("compress_ratios") is not None:
        key, ratios = "compress_ratios", cfg["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in RATIO_KINDS for r in ratios):
            raise ConfigError(f"compress_ratios: 0, 4 or 128 for each layer, got {ratios!r:.80}")
        kinds = [RATIO_KINDS[r] for r in ratios]
    if kinds is None:
        kinds = ["heavily_compressed_attention"] * min(num_layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(num_layers - 2, 0))]
    if not isinstance(kinds, list) or len(kinds) < num_layers or any(k not in KINDS for k in kinds[:num_layers]):
        raise ConfigError(f"{key}: one of {', '.join(KINDS)} for each of the {num_layers} layers, got {kinds!r:.80}")
    return kinds[:num_layers]


def _hash_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers whose experts a table of the token's id picks: `mlp_layer_types`' hash_moe (else the first
    `num_hash_layers`, 3)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return tuple(range(min(num_layers, read_int(cfg, "num_hash_layers", 3, minimum=0))))
    if not isinstance(kinds, list) or len(kinds) < num_layers or any(k not in ("hash_moe", "moe")
                                                                     for k in kinds[:num_layers]):
        raise ConfigError(f"mlp_layer_types: hash_moe or moe for each of the {num_layers} layers, got {kinds!r:.80}")
    return tuple(i for i, kind in enumerate(kinds[:num_layers]) if kind == "hash_moe")


def _ropes(cfg: dict[str, Any]) -> tuple[float, float, RopeScaling]:
    """(the sliding layers' base, the compressed layers' base, their scaling): `rope_parameters.main` and `.compress`
    as transformers writes them, or `rope_theta`, `compress_rope_theta` (160,000) and the scaling the top level's
    `rope_parameters` / `rope_scaling` names for the compressed ones (YaRN's attention factor 1 unless named)."""
    params = read_object(cfg, "rope_parameters", name="rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        main_theta = read_float(main, "rope_theta", 10000.0, path="rope_parameters.main.")
    else:
        flat = params if isinstance(params, dict) else cfg.get("rope_scaling") or {}
        main_theta = read_float(cfg, "rope_theta", 10000.0)
        compress = {**{k: v for k, v in flat.items() if k not in ("main", "compress")},
                    "rope_theta": read_float(cfg, "compress_rope_theta", 160000.0)}
    compress = {k: v for k, v in compress.items() if k != "partial_rotary_factor"}
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    theta, scaling = RopeScaling.from_hf_config({"rope_parameters": compress}, "rope_parameters.compress")
    if scaling.rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters.compress.rope_type: DeepSeek V4's compressed layers are served with "
                          f"default or yarn, got {scaling.rope_type!r}")
    return main_theta, theta or 160000.0, scaling
