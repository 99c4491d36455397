"""Meituan's LongCat-Flash config.json (`LongcatFlashForCausalLM`: LongCat-Flash-Chat, -Thinking) as transformers'
`LongcatFlashConfig` reads it. Each of its `num_layers` layers is two sublayers, each DeepSeek V3's latent attention
then a dense MLP of `ffn_hidden_size`, and one mixture of experts beside them (the shortcut: it takes the first
sublayer's MLP input and its output joins the second sublayer's). The engine serves the sublayers as its layers
(`num_hidden_layers` = 2 x `num_layers`, every one of them holding K/V), the experts on the even ones
(`engine.models.deepseek`'s `LongcatFlashForCausalLM`). The experts: `n_routed_experts` of `expert_ffn_hidden_size`
and `zero_expert_num` that compute nothing (a token routed there takes back itself times the weight), `moe_topk` a
token picked by ERNIE 4.5's router (the softmax's scores plus a correction bias choose, the scores weigh; not
renormalised) times `routed_scaling_factor`."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.deepseek_config import check_silu
from engine.mla_config import read_mla

# LongcatFlashConfig's where config.json names none (LongCat-Flash-Chat's shape)
LONGCAT_DEFAULTS = {"num_layers": 28, "ffn_hidden_size": 12288, "max_position_embeddings": 131072,
                    "rope_theta": 10000000.0, "rms_norm_eps": 1e-5, "vocab_size": 131072, "hidden_size": 6144,
                    "num_attention_heads": 64}
# LongcatFlashConfig's `attribute_map`: the names it also takes for its own keys
ALIASES = {"num_local_experts": "n_routed_experts", "num_experts_per_tok": "moe_topk",
           "intermediate_size": "ffn_hidden_size", "moe_intermediate_size": "expert_ffn_hidden_size"}


def longcat_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names: two engine layers a layer (`num_layers`), the dense MLPs'
    `ffn_hidden_size` as `intermediate_size`, a KV head a query head (its latent attention keeps one, `MlaShape`);
    the config class's other names of its keys (`ALIASES`) read as its own."""
    cfg = {**{ours: cfg[alias] for alias, ours in ALIASES.items() if alias in cfg and ours not in cfg}, **cfg}
    layers = read_int(cfg, "num_layers", LONGCAT_DEFAULTS["num_layers"])
    if "num_hidden_layers" in cfg and read_int(cfg, "num_hidden_layers") != 2 * layers:
        raise ConfigError(f"num_hidden_layers: two sublayers a layer, 2 x num_layers ({2 * layers}), "
                          f"got {cfg['num_hidden_layers']!r}")
    heads = read_int(cfg, "num_attention_heads", LONGCAT_DEFAULTS["num_attention_heads"])
    defaults = {key: value for key, value in LONGCAT_DEFAULTS.items() if key not in cfg}
    if cfg.get("rope_parameters") or cfg.get("rope_scaling"):
        defaults.pop("rope_theta", None)   # the rope object names its own base
    return {**defaults, **cfg, "num_hidden_layers": 2 * layers, "num_attention_heads": heads,
            "intermediate_size": read_int(cfg, "ffn_hidden_size", LONGCAT_DEFAULTS["ffn_hidden_size"]),
            "num_key_value_heads": heads}


def longcat_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The latent attention (DeepSeek V3's shape by default, its rotary pairs interleaved; `qk_head_dim` and `head_dim`,
    where named, their q.k size and the rotary's) and the experts of the even layers (the module docstring); the
    router's bias (`router_bias`) is not served."""
    check_silu(cfg, "LongCat-Flash")
    mla = read_mla(cfg, (1536, 512, 128, 64, 128), interleave_key=False)
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if cfg.get("qk_head_dim") is not None and read_int(cfg, "qk_head_dim") != qk:
        raise ConfigError(f"qk_head_dim: qk_nope_head_dim + qk_rope_head_dim ({qk}), got {cfg['qk_head_dim']!r}")
    if cfg.get("head_dim") is not None and read_int(cfg, "head_dim") != mla.qk_rope_head_dim:   # the rotary's width
        raise ConfigError(f"head_dim: LongCat-Flash's rotary turns qk_rope_head_dim ({mla.qk_rope_head_dim}) of each "
                          f"head, got {cfg['head_dim']!r}")
    if not mla.q_lora_rank:
        raise ConfigError("q_lora_rank: LongCat-Flash scales q's bottleneck by it, got null")
    if cfg.get("zero_expert_type", "identity") != "identity":
        raise ConfigError(f"zero_expert_type: zero experts that pass the token through (identity) are served, got "
                          f"{cfg['zero_expert_type']!r}")
    if read_bool(cfg, "router_bias", False):
        raise ConfigError("router_bias: a biased router is not served, got true")
    experts = read_int(cfg, "n_routed_experts", 512)
    top_k = read_int(cfg, "moe_topk", 12)
    zero = 0 if "zero_expert_num" in cfg and cfg["zero_expert_num"] is None else \
        read_int(cfg, "zero_expert_num", 256, minimum=0)
    if top_k > experts + zero:
        raise ConfigError(f"moe_topk: {top_k} a token of {experts} experts and {zero} zero experts")
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1, "num_experts": experts,
            "num_experts_per_tok": top_k, "zero_experts": zero,
            "moe_intermediate_size": read_int(cfg, "expert_ffn_hidden_size", 2048), "norm_topk_prob": False,
            "moe_router": "ernie4_5", "routed_scaling_factor": read_float(cfg, "routed_scaling_factor", 6.0),
            "moe_float_weights": True, "mlp_only_layers": tuple(range(1, num_layers, 2)),
            "stacked_experts": True}   # read per expert, or stacked as transformers saves them


def longcat_params(config: Any, heads: int, i: int, moe_i: int, vocab_rows: int) -> int:
    """Parameters of a LongCat-Flash rank holding `heads` query heads, `i` rows of each dense MLP and `moe_i` of each
    expert: every sublayer its two norms, its latent attention and its dense MLP; every even one the experts and
    their router (its weight and correction bias a row for each expert, zero experts too); the embedding, the final
    norm and an untied head."""
    h = config.hidden_size
    sublayer = 2 * h + config.mla.num_params(h, heads, config.attention_bias) + 3 * h * i
    routes = config.num_experts + config.zero_experts
    experts = config.num_experts * 3 * h * moe_i + routes * (h + 1)
    layers = config.num_layers * sublayer + (config.num_layers + 1) // 2 * experts
    return vocab_rows * h * (1 if config.tie_word_embeddings else 2) + layers + h
