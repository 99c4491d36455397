"""The config.json fields of the families whose layer is Llama's but for its biases and norms (StarCoder2, Nemotron,
StableLM, Phi, GPT-NeoX, OLMo, nanochat, Jais 2, Seed-OSS, ERNIE 4.5's dense models), their transformers config classes'
names and defaults. What we do not serve is refused naming the key."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.rope_config import partial_rotary_factor


def bias_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields of the Llama-layer families that differ from Llama's by their biases and norms (none for Llama)."""
    if arch == "Starcoder2ForCausalLM":   # Starcoder2Config: LayerNorms, every projection biased (`use_bias`), tied
        if cfg.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_act: StarCoder2 is served with gelu_pytorch_tanh, got {cfg['hidden_act']!r}")
        bias = read_bool(cfg, "use_bias", True)
        return {"rms_norm_eps": read_float(cfg, "norm_epsilon", 1e-5), "mlp_bias": bias, "attention_bias": bias,
                "sliding_window": read_int(cfg, "sliding_window", None), "hidden_act": "gelu_pytorch_tanh",
                "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
    if arch == "NemotronForCausalLM":   # NemotronConfig: LayerNorms of weight + 1, squared ReLU, half a head turned
        if cfg.get("hidden_act", "relu2") != "relu2":
            raise ConfigError(f"hidden_act: Nemotron is served with relu2, got {cfg['hidden_act']!r}")
        return {"rms_norm_eps": read_float(cfg, "norm_eps", 1e-5), "hidden_act": "relu2",
                "partial_rotary_factor": partial_rotary_factor(cfg, 0.5)}
    if arch == "StableLmForCausalLM":   # StableLmConfig: LayerNorms, q/k/v biases, a quarter of a head turned
        return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5),   # heads of hidden / heads, whatever
                "head_dim": read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads"),   # head_dim says
                "attention_bias": read_bool(cfg, "use_qkv_bias", False),
                "qk_norm": read_bool(cfg, "qk_layernorm", False),
                "parallel_residual": read_bool(cfg, "use_parallel_residual", False),
                "partial_rotary_factor": partial_rotary_factor(cfg, 0.25)}
    if arch == "PhiForCausalLM":   # PhiConfig: parallel layers, LayerNorms, every projection and the head biased
        if read_bool(cfg, "qk_layernorm", False):
            raise ConfigError("qk_layernorm: Phi is served without q/k LayerNorms (no released Phi has them)")
        if read_bool(cfg, "tie_word_embeddings", False):   # its head's bias stays its own: no released Phi ties
            raise ConfigError("tie_word_embeddings: Phi is served with a head of its own (a weight and a bias)")
        if cfg.get("hidden_act", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"hidden_act: Phi is served with gelu_new (GELU-tanh), got {cfg['hidden_act']!r}")
        return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5), "hidden_act": "gelu_pytorch_tanh",
                "head_dim": read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads"),
                "attention_bias": True, "mlp_bias": True, "lm_head_bias": True, "parallel_residual": True,
                "partial_rotary_factor": partial_rotary_factor(cfg, 0.5)}
    if arch == "GPTNeoXForCausalLM":   # GPTNeoXConfig: multi-head, LayerNorms, two norms a parallel layer
        return gpt_neox_fields(cfg)
    if arch == "PersimmonForCausalLM":   # PersimmonConfig: GPT-NeoX's sequential layer, squared ReLU, q/k LayerNorms
        return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5), "attention_bias": True, "mlp_bias": True,
                "hidden_act": "relu2", "qk_norm": read_bool(cfg, "qk_layernorm", True),
                "num_kv_heads": read_int(cfg, "num_attention_heads"),   # multi-head whatever else config.json says
                "partial_rotary_factor": partial_rotary_factor(cfg, 0.5)}
    if arch == "NanoChatForCausalLM":   # NanoChatConfig: weightless RMSNorms, logits capped at 15, squared ReLU
        if cfg.get("hidden_act", "relu2") != "relu2":
            raise ConfigError(f"hidden_act: nanochat is served with relu2, got {cfg['hidden_act']!r}")
        return {"hidden_act": "relu2", "attention_bias": read_bool(cfg, "attention_bias", False),
                "final_logit_softcapping": read_float(cfg, "final_logit_softcapping", 15.0)}
    if arch == "OlmoForCausalLM":   # OlmoConfig: LayerNorms without parameters (their epsilon 1e-5), q/k/v clipped
        return {"rms_norm_eps": 1e-5, "clip_qkv": read_float(cfg, "clip_qkv", None)}
    if arch == "Jais2ForCausalLM":   # Jais2Config: LayerNorms (weight and bias), every projection biased by default
        return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5), "mlp_bias": read_bool(cfg, "mlp_bias", True),
                "attention_bias": read_bool(cfg, "attention_bias", True)}
    if arch == "SeedOssForCausalLM":   # SeedOssConfig: q/k/v biased by default, o_proj by its own switch
        return {"attention_bias": read_bool(cfg, "attention_bias", True),
                "attention_out_bias": read_bool(cfg, "attention_out_bias", False)}
    if arch == "Ernie4_5ForCausalLM":   # Ernie4_5Config: one switch for every projection's bias, a tied head
        bias = read_bool(cfg, "use_bias", False)
        return {"attention_bias": bias, "mlp_bias": bias,
                "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
    return {}


# BloomConfig's where config.json names none
BLOOM_DEFAULTS = {"vocab_size": 250_880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
                  "bos_token_id": 1, "eos_token_id": 2}


def bloom_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """BLOOM's config.json under the Llama reading's names, BloomConfig's defaults where it names none: `n_layer`,
    `n_head` (as many KV heads), `n_embed` (its older name of hidden_size), `layer_norm_epsilon`; the MLP 4 x hidden
    wide; the pretraining length (`seq_length`, else 2,048) as the context, ALiBi having no table of positions. A
    layer whose residual is its normed input (`apply_residual_connection_post_layernorm`) is refused: no release has
    one."""
    cfg = BLOOM_DEFAULTS | {k: v for k, v in cfg.items() if v is not None}
    if read_bool(cfg, "apply_residual_connection_post_layernorm", False):
        raise ConfigError("apply_residual_connection_post_layernorm: BLOOM is served with the residual before the "
                          "norm (false), as every release has it")
    hidden = read_int(cfg, "n_embed") if "n_embed" in cfg else read_int(cfg, "hidden_size")
    heads = read_int(cfg, "n_head")
    return {**cfg, "hidden_size": hidden, "num_hidden_layers": read_int(cfg, "n_layer"), "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": 4 * hidden,
            "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5),
            "max_position_embeddings": read_int(cfg, "seq_length", 2048)}


# MptConfig's where config.json names none
MPT_DEFAULTS = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "expansion_ratio": 4, "max_seq_len": 2048,
                "vocab_size": 50_368, "layer_norm_epsilon": 1e-5}
# what transformers' MPT serves of its attn_config (a config saying otherwise is refused by key)
MPT_ATTENTION = {"alibi": True, "qk_ln": False, "prefix_lm": False, "attn_type": "multihead_attention",
                 "alibi_bias_max": 8}   # transformers' slopes are spread over 8 whatever it says


def mpt_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """MPT's config.json under the Llama reading's names, MptConfig's defaults where it names none: `d_model`,
    `n_heads` (as many KV heads), `n_layers`, the MLP 4 x hidden (`expansion_ratio` 4), `max_seq_len`; `attn_config` as
    transformers serves it (ALiBi spread over 8, no q/k LayerNorm, no prefix LM, multi-head) and no biases
    (`no_bias`), else refused naming the key."""
    cfg = MPT_DEFAULTS | {k: v for k, v in cfg.items() if v is not None}
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise ConfigError(f"attn_config: must be an object, got {attn!r:.80}")
    for key, served in MPT_ATTENTION.items():
        if attn.get(key, served) != served:
            raise ConfigError(f"attn_config.{key}: MPT is served with {served!r} (as transformers runs it), got "
                              f"{attn[key]!r}")
    if not read_bool(cfg, "no_bias", True):
        raise ConfigError("no_bias: MPT is served without biases (true), as transformers runs it")
    if read_int(cfg, "expansion_ratio") != 4:   # transformers' MptMLP is 4 x hidden whatever it says
        raise ConfigError(f"expansion_ratio: MPT is served with an MLP 4 x d_model wide, as every release and "
                          f"transformers' model have it, got {cfg['expansion_ratio']!r}")
    hidden, heads = read_int(cfg, "d_model"), read_int(cfg, "n_heads")
    return {**cfg, "hidden_size": hidden, "num_hidden_layers": read_int(cfg, "n_layers"), "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": 4 * hidden,
            "rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5),
            "max_position_embeddings": read_int(cfg, "max_seq_len")}


def bloom_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """BloomConfig's: GPT-NeoX's sequential layer, every projection biased, GELU's tanh form, no rotary (ALiBi)."""
    return {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_pytorch_tanh",
            "no_rope_layers": (0,) * num_layers, "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def mpt_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """MptConfig's: no biases, exact GELU, no rotary (ALiBi of MPT's slopes), q/k/v clamped at `attn_config.clip_qkv`
    and q.k scaled by its `softmax_scale` where set, a tied head."""
    attn = cfg.get("attn_config") or {}
    return {"attention_bias": False, "mlp_bias": False, "hidden_act": "gelu", "no_rope_layers": (0,) * num_layers,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True),
            "clip_qkv": read_float(attn, "clip_qkv", None, path="attn_config."),
            "attention_multiplier": read_float(attn, "softmax_scale", None, path="attn_config."),
            "alibi_bias_max": read_float(attn, "alibi_bias_max", 8.0, path="attn_config.")}


def gpt_neox_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX's fields, its older keys read as GPTNeoXConfig reads them (`rotary_emb_base` the rope's base,
    `rotary_pct` the share of a head turned, where the rope's parameters name neither)."""
    act = cfg.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_fast", "gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"hidden_act: GPT-NeoX is served with gelu or its tanh form (gelu_fast, gelu_new), "
                          f"got {act!r}")
    base = read_float(cfg, "rotary_emb_base", None)
    rope = {**cfg, "rope_theta": base} if base is not None and "rope_theta" not in cfg else cfg
    heads = read_int(cfg, "num_attention_heads")
    return {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5), "num_kv_heads": heads,
            "head_dim": read_int(cfg, "hidden_size") // heads, "hidden_act": "gelu" if act == "gelu" else
            "gelu_pytorch_tanh", "attention_bias": read_bool(cfg, "attention_bias", True), "mlp_bias": True,
            "parallel_residual": read_bool(cfg, "use_parallel_residual", True), "parallel_norms": 2,
            "full_rope": (rope,),
            "partial_rotary_factor": partial_rotary_factor(cfg, read_float(cfg, "rotary_pct", 0.25))}
