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
from engine.gpt2_config import TANH_GELUS, gpt2_keys

__all__ = ["gptj_config", "gptj_fields"]

def gptj_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-J's config.json under the Llama reading's names (`gpt2_keys`), a KV head a query head."""
    cfg = gpt2_keys(cfg)
    return {**cfg, "num_key_value_heads": read_int(cfg, "num_attention_heads")}


def gptj_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-J's `ModelConfig` fields (see the module docstring)."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise ConfigError(f"activation_function: GPT-J is served with gelu_new (GELU's tanh form), got {act!r}")
    head_dim = read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads")
    rotary = None if cfg.get("rotary_dim", 64) is None else read_int(cfg, "rotary_dim", 64)   # null: the whole head
    if rotary is not None and (rotary > head_dim or rotary % 2):
        raise ConfigError(f"rotary_dim: an even count of a head's {head_dim} dimensions, got {rotary}")
    return {"rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5), "head_dim": head_dim,
            "hidden_act": "gelu_pytorch_tanh", "mlp_bias": True, "lm_head_bias": True, "parallel_residual": True,
            "partial_rotary_factor": 1.0 if rotary is None else rotary / head_dim, "rope_theta": 10000.0}
