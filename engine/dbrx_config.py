"""Databricks' DBRX config.json (`DbrxForCausalLM`: DBRX Base and Instruct, 132B) as transformers' `DbrxConfig` reads
it: its own key names (`d_model`, `n_heads`, `n_layers`, `max_seq_len`) and two nested configs, `attn_config`
(`kv_n_heads`, `clip_qkv`, `rope_theta`) and `ffn_config` (`ffn_hidden_size`, `moe_num_experts`, `moe_top_k`,
`moe_normalize_expert_weights`, `ffn_act_fn`). Every layer's MLP is experts, picked by the top k of a softmax (in the
model's dtype) and weighed by it divided by the picks' p-norm: p = 1 (DBRX's) is the sum, a renormalisation; none,
not divided; another p is refused. The rope's base is `attn_config.rope_theta` (500,000 in the release), as the
release's modeling code and vLLM read it, where the config names no `rope_parameters` (transformers 5 reads only
those: 10,000 unless given). What we do not serve is refused naming the key."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int, read_object

__all__ = ["dbrx_config", "dbrx_fields"]


# DbrxConfig's attribute map: its own keys for the Llama reading's
_KEYS = (("d_model", "hidden_size"), ("n_heads", "num_attention_heads"), ("n_layers", "num_hidden_layers"),
         ("max_seq_len", "max_position_embeddings"))


def _nested(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested config (`attn_config`, `ffn_config`), {} where absent."""
    return read_object(cfg, key) or {}


def dbrx_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's names (theirs first, as DbrxConfig's attribute map reads them)."""
    attn, ffn = _nested(cfg, "attn_config"), _nested(cfg, "ffn_config")
    theta = read_float(attn, "rope_theta", None, path="attn_config.")
    cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in _KEYS if theirs in cfg}}
    return {**cfg, "num_key_value_heads": read_int(attn, "kv_n_heads", 1, path="attn_config."),
            "intermediate_size": read_int(ffn, "ffn_hidden_size", 3584, path="ffn_config."),
            **({"rope_theta": theta} if theta is not None and "rope_parameters" not in cfg else {})}


def dbrx_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DBRX's `ModelConfig` fields (see the module docstring)."""
    attn, ffn = _nested(cfg, "attn_config"), _nested(cfg, "ffn_config")
    act = (read_object(ffn, "ffn_act_fn", name="ffn_config.ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        raise ConfigError(f"ffn_config.ffn_act_fn.name: DBRX's experts are served with silu only, got {act!r}")
    p = read_float(ffn, "moe_normalize_expert_weights", 1.0, path="ffn_config.")
    if "moe_normalize_expert_weights" in ffn and ffn["moe_normalize_expert_weights"] is None:
        p = None
    if p not in (None, 1.0):
        raise ConfigError(f"ffn_config.moe_normalize_expert_weights: served as 1 (the sum) or null, got {p}")
    return {"num_experts": read_int(ffn, "moe_num_experts", 4, path="ffn_config."),
            "num_experts_per_tok": read_int(ffn, "moe_top_k", 1, path="ffn_config."),
            "moe_intermediate_size": read_int(cfg, "intermediate_size"), "norm_topk_prob": p is not None,
            "clip_qkv": read_float(attn, "clip_qkv", None, path="attn_config."), "rms_norm_eps": 1e-5}
