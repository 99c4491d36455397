"""TII's Falcon config.json (`FalconForCausalLM`: Falcon-7B, -40B, -180B and their instruct models, Falcon-11B) as
transformers' `FalconConfig` reads it. The layer is parallel where `parallel_attn` (the default): one LayerNorm before
both sublayers (Falcon-7B's `input_layernorm`), or with `new_decoder_architecture` (Falcon-40B and -180B) one before
each (`ln_attn`, `ln_mlp`; one only where `num_ln_in_parallel_attn` is 1); else sequential. q/k/v come fused, grouped
by KV head (each group its query heads, then its key head, then its value head): one group where `multi_query`
(Falcon-7B's, the default), `num_kv_heads` groups in the new architecture, a group a head otherwise. The MLP is
ungated (`ffn_hidden_size`, else 4 x hidden, through `activation`: exact GELU by default), every projection biased
where `bias`, the head tied by default. ALiBi (`alibi`: the falcon-rw models) is not served. What we do not serve is
refused naming the key."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int

__all__ = ["falcon_config", "falcon_fields"]


def falcon_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names: the older releases' `n_head` / `n_layer`, the MLP's width, and
    the KV heads the fused q/k/v holds (one where `multi_query`, outside the new architecture)."""
    cfg = {**{new: cfg[old] for old, new in (("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"))
              if old in cfg}, **cfg}
    heads = read_int(cfg, "num_attention_heads")
    new = read_bool(cfg, "new_decoder_architecture", False)
    kv = 1 if read_bool(cfg, "multi_query", True) and not new else \
        read_int(cfg, "num_kv_heads", heads) if new else heads   # a group a head: whatever num_kv_heads says
    width = read_int(cfg, "ffn_hidden_size", None)
    return {**cfg, "num_key_value_heads": kv,
            "intermediate_size": 4 * read_int(cfg, "hidden_size") if width is None else width}


def falcon_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Falcon's `ModelConfig` fields (see the module docstring)."""
    if read_bool(cfg, "alibi", False):
        raise ConfigError("alibi: Falcon is served with its rotary; ALiBi (the falcon-rw models) is not supported")
    act = cfg.get("activation", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation: Falcon is served with gelu or its tanh form, got {act!r}")
    new = read_bool(cfg, "new_decoder_architecture", False)
    parallel = read_bool(cfg, "parallel_attn", True)
    if new and not parallel:
        raise ConfigError("parallel_attn: Falcon's new decoder architecture runs its sublayers side by side "
                          "(transformers' layer has no other form)")
    norms = read_int(cfg, "num_ln_in_parallel_attn", 2) if new else 1
    if norms not in (1, 2):
        raise ConfigError(f"num_ln_in_parallel_attn: 1 or 2, got {norms}")
    bias = read_bool(cfg, "bias", False)
    return {"rms_norm_eps": read_float(cfg, "layer_norm_epsilon", 1e-5),
            "head_dim": read_int(cfg, "hidden_size") // read_int(cfg, "num_attention_heads"),
            "hidden_act": "gelu" if act == "gelu" else "gelu_pytorch_tanh", "attention_bias": bias, "mlp_bias": bias,
            "parallel_residual": parallel, "parallel_norms": norms,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
