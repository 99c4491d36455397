"""ZAYA1 beyond the tiny-model parity of `test_engine_vs_hf` (its CCA layers, their states, its router there): what
it is not served with is refused by key, before any weight is read."""

from __future__ import annotations

import re

import pytest

from engine.config import ConfigError
from engine.model_config import ModelConfig
from engine.parallel import check_tensor_parallel

BASE = {"architectures": ["ZayaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "moe_intermediate_size": 32, "router_hidden_size": 16, "max_position_embeddings": 256}


def test_its_layers_keep_k_v_and_a_state_each_counted_by_the_plan():
    """Every layer is attention beside a CCA state (the convolutions' last (3 - 1) + (2 - 1) inputs of q and k, and
    half a value row float32): S_KV counts three layers, S_state three states."""
    config = ModelConfig.from_hf_config({**BASE, "cca_time0": 3})
    assert config.num_kv_layers == 3 and config.stateful_layers == (0, 1, 2)
    import torch

    assert config.state_bytes_per_seq(torch.bfloat16) == 3 * ((4 + 2) * 16 * 3 * 2 + 16 * 4)


def test_what_zaya_does_not_serve_is_refused_by_key():
    for change, key in (({"num_experts_per_tok": 2}, "num_experts_per_tok"), ({"attention_bias": True},
                                                                                  "attention_bias"),
                        ({"layer_types": ["hybrid", "full_attention", "hybrid"]}, "layer_types"),
                        ({"hidden_act": "gelu"}, "hidden_act"), ({"cca_time0": 1, "cca_time1": 1}, "cca_time0"),
                        ({"rope_parameters": {"hybrid": {"rope_type": "yarn", "factor": 2.0}}},
                         "rope_parameters.hybrid.rope_type"),
                        ({"rope_parameters": {"hybrid": {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
                                              "hybrid_sliding": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}},
                          "layer_types": ["hybrid", "hybrid_sliding", "hybrid"]}, "rope_parameters")):
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}:"):
            ModelConfig.from_hf_config({**BASE, **change})
    with pytest.raises(ConfigError, match="^tensor_parallel_size: ZAYA's CCA value heads"):
        check_tensor_parallel(ModelConfig.from_hf_config(BASE), 2)
