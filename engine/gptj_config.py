"""EleutherAI's GPT-J config.json (`GPTJForCausalLM`: GPT-J-6B and its fine-tunes, GPT4All-J) as transformers'
`GPTJConfig` reads it: GPT-2's key names (`n_embd`, `n_head`, `n_layer`, `n_positions`, `n_inner`: else 4 x
`n_embd`), a parallel layer off one LayerNorm, q/k/v and `out_proj` unbiased, a biased ungated MLP through
`activation_function` (`gelu_new`, GELU's tanh form), a biased head, and the first `rotary_dim` (64) of each head
turned in interleaved pairs at the default base (10,000; all of a head where `rotary_dim` is null, as transformers 4
read it). What we do not serve is refused naming the key."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int

__all__ = ["gptj_config", "gptj_fields"]

# GPTJConfig's attribute map: its own keys for the Llama reading's
_KEYS = (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
         ("n_positions", "max_position_embeddings"))


def gptj_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names (theirs first, as GPTJConfig's attribute map reads them); the
    MLP's width `n_inner`, else 4 x n_embd."""
    cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in _KEYS if theirs in cfg}}
    inner = read_int(cfg, "n_inner", None)
    return {**cfg, "intermediate_size": 4 * read_int(cfg, "hidden_size") if inner is None else inner,
            "num_key_value_heads": read_int(cfg, "num_attention_heads")}


def gptj_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-J's `ModelConfig` fields (see the module docstring)."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation_function: GPT-J is served with gelu_new (GELU's tanh form), got {act!r}")
    head_dim = read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads")
    rotary = None if cfg.get("rotary_dim", 64) is None else read_int(cfg, "rotary_dim", 64)   # null: the whole head
    if rotary is not None and (rotary > head_dim or rotary % 2):
        raise ConfigError(f"rotary_dim: an even count of a head's {head_dim} dimensions, got {rotary}")
    return {"rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5), "head_dim": head_dim,
            "hidden_act": "gelu_pytorch_tanh", "mlp_bias": True, "lm_head_bias": True, "parallel_residual": True,
            "partial_rotary_factor": 1.0 if rotary is None else rotary / head_dim, "rope_theta": 10000.0}
