"""The config.json of GPT-2 and the models built like it, with a learned position embedding in place of a rotary, as
transformers' config classes read them: GPT-2 (`GPT2LMHeadModel`: GPT2Config), BigCode's GPT-BigCode
(`GPTBigCodeForCausalLM`: StarCoder, SantaCoder, WizardCoder; GPTBigCodeConfig), Meta's OPT (`OPTForCausalLM`:
OPTConfig) and EleutherAI's GPT-Neo (`GPTNeoForCausalLM`: GPTNeoConfig; `num_layers`, `num_heads`, its local layers
sliding over `window_size` positions as `attention_types` lays them out, q.k unscaled, q/k/v unbiased). GPT-2 and
GPT-BigCode keep GPT-2's key names (`n_embd`, `n_head`, `n_layer`, `n_positions`, `n_inner`: `gpt2_keys`, GPT-J's too);
GPT-BigCode has one KV head where `multi_query` (the default). Each has sequential pre-norm layers of LayerNorms, every
projection biased (OPT's where `enable_bias`), an ungated MLP (GELU's tanh form; OPT's ReLU) and a tied head; the
position table has `n_positions` rows (OPT's `max_position_embeddings` + 2: it looks a position up two rows on). What we
do not serve is refused naming the key."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int

__all__ = ["gpt2_config", "gpt2_fields", "gpt2_keys", "gpt_bigcode_config", "gpt_bigcode_fields", "gpt_neo_config",
           "gpt_neo_fields", "opt_config", "opt_fields"]

# GPT-2's keys for the Llama reading's (its config classes' attribute maps)
_KEYS = (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
         ("n_positions", "max_position_embeddings"))
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")   # GELU's tanh form, under transformers' names


def gpt2_keys(cfg: dict[str, Any], keys: tuple[tuple[str, str], ...] = _KEYS,
              inner_key: str = "n_inner") -> dict[str, Any]:
    """config.json of a model that keeps GPT-2's key names (`keys`: theirs, ours) under the Llama reading's names
    (theirs first, as the attribute maps read them); the MLP's width `inner_key`, else 4 x n_embd."""
    cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in keys if theirs in cfg}}
    inner = read_int(cfg, inner_key, None)
    return {**cfg, "intermediate_size": 4 * read_int(cfg, "hidden_size") if inner is None else inner}


def gpt2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config.json under the Llama reading's names: a KV head a query head."""
    cfg = gpt2_keys(cfg)
    return {**cfg, "num_key_value_heads": read_int(cfg, "num_attention_heads")}


def gpt_bigcode_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-BigCode's config.json under the Llama reading's names, its KV heads by `multi_query`."""
    cfg = gpt2_keys(cfg)
    heads = read_int(cfg, "num_attention_heads")
    return {**cfg, "num_key_value_heads": 1 if read_bool(cfg, "multi_query", True) else heads}


def opt_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """OPT's config.json under the Llama reading's names: the MLP's width `ffn_dim`, a KV head a query head."""
    return {**cfg, "intermediate_size": read_int(cfg, "ffn_dim", 3072),
            "num_key_value_heads": read_int(cfg, "num_attention_heads")}


def _check(cfg: dict[str, Any], family: str, act_key: str, acts: tuple[str, ...], served: dict[str, bool]) -> None:
    """`act_key` one of `acts` (its default the first), each key of `served` its value there."""
    if cfg.get(act_key, acts[0]) not in acts:
        raise ConfigError(f"{act_key}: {family} is served with {' or '.join(acts)}, got {cfg[act_key]!r}")
    for key, value in served.items():
        if read_bool(cfg, key, value) != value:
            raise ConfigError(f"{key}: {family} is served with {key} {str(value).lower()}")


def _fields(cfg: dict[str, Any], num_layers: int, positions: int, eps: float, **more: Any) -> dict[str, Any]:
    """The fields these families share: LayerNorms of `eps`, every projection biased, a tied head by default,
    `positions` learned positions and no rotary on any layer."""
    return {"rms_norm_eps": eps, "head_dim": read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads"),
            "hidden_act": "gelu_pytorch_tanh", "attention_bias": True, "mlp_bias": True,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True), "learned_positions": positions,
            "no_rope_layers": (0,) * num_layers, **more}


def gpt2_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-2's `ModelConfig` fields (see the module docstring)."""
    _check(cfg, "GPT-2", "activation_function", TANH_GELUS,
           {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False})
    return _fields(cfg, num_layers, read_int(cfg, "max_position_embeddings"),
                   read_float(cfg, "layer_norm_epsilon", 1e-5))


def gpt_bigcode_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-BigCode's `ModelConfig` fields (see the module docstring)."""
    _check(cfg, "GPT-BigCode", "activation_function", ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"),
           {"scale_attn_weights": True, "add_cross_attention": False})
    return _fields(cfg, num_layers, read_int(cfg, "max_position_embeddings"),
                   read_float(cfg, "layer_norm_epsilon", 1e-5))


def opt_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """OPT's `ModelConfig` fields (see the module docstring): OPT-350M's post-norm layers and projected embeddings
    are refused by key."""
    _check(cfg, "OPT", "activation_function", ("relu",), {"do_layer_norm_before": True,
                                                          "layer_norm_elementwise_affine": True,
                                                          "_remove_final_layer_norm": False})
    hidden = read_int(cfg, "hidden_size")
    if read_int(cfg, "word_embed_proj_dim", hidden) != hidden:
        raise ConfigError(f"word_embed_proj_dim: OPT is served with embeddings of hidden_size ({hidden}) "
                          f"(OPT-350M's projected ones are not), got {cfg['word_embed_proj_dim']}")
    bias = read_bool(cfg, "enable_bias", True)
    return _fields(cfg, num_layers, read_int(cfg, "max_position_embeddings") + 2, 1e-5, hidden_act="relu",
                   attention_bias=bias, mlp_bias=bias)


def gpt_neo_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-Neo's config.json under the Llama reading's names (GPTNeoConfig's attribute map): a KV head a query head,
    the MLP's width `intermediate_size`, else 4 x hidden."""
    cfg = gpt2_keys(cfg, (("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads")),
                    "intermediate_size")
    return {**cfg, "num_key_value_heads": read_int(cfg, "num_attention_heads")}


def gpt_neo_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-Neo's `ModelConfig` fields (see the module docstring): `attention_types` ([[kinds, repeats], ...],
    GPTNeoConfig's default a global then a local layer, 12 times) laid out over the layers, each `local` one sliding."""
    _check(cfg, "GPT-Neo", "activation_function", TANH_GELUS, {})
    types = cfg.get("attention_types", [[["global", "local"], 12]])
    try:
        kinds = [kind for pattern, repeats in types for _ in range(repeats) for kind in pattern]
    except (TypeError, ValueError):
        kinds = None
    if kinds is None or len(kinds) != num_layers or any(k not in ("global", "local") for k in kinds):
        raise ConfigError(f"attention_types: [[global / local, ...], repeats] pairs laying out the {num_layers} "
                          f"layers, got {types!r:.80}")
    return _fields(cfg, num_layers, read_int(cfg, "max_position_embeddings"),
                   read_float(cfg, "layer_norm_epsilon", 1e-5), attention_bias=False, attention_out_bias=True,
                   query_pre_attn_scalar=1.0, sliding_window=read_int(cfg, "window_size", 256),
                   layer_types=tuple("sliding_attention" if k == "local" else "full_attention" for k in kinds))
