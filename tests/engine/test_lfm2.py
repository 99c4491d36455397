"""LFM2's config as `ModelConfig` reads it (`engine.lfm2_config`): the MLP width against transformers' own `Lfm2MLP`,
the layer kinds, the per-sequence state the capacity plan counts, and what is refused by key. (Greedy parity with
transformers, under tensor parallelism too: tests/engine/test_engine_vs_hf.py, tests/engine/test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.model_config import ModelConfig

BASE = {"architectures": ["Lfm2ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"]}


@pytest.mark.parametrize("keys", [{"block_ff_dim": 12288}, {"block_ff_dim": 10240, "block_ffn_dim_multiplier": 1.5},
                                  {"intermediate_size": 1000, "block_multiple_of": 64},
                                  {"block_ff_dim": 777, "block_ffn_dim_multiplier": 0.75, "block_multiple_of": 1},
                                  {"block_ff_dim": 500, "block_auto_adjust_ff_dim": False}])
def test_the_mlp_is_as_wide_as_transformers_makes_it(keys):
    """`block_ff_dim` (else `intermediate_size`), two thirds of it times the multiplier, rounded up to the multiple
    (or as given where not adjusted): transformers' `Lfm2MLP` built from the same config."""
    import transformers

    config = ModelConfig.from_hf_config({**BASE, **keys})
    hf = transformers.Lfm2Config(**{k: v for k, v in {**BASE, **keys}.items() if k != "architectures"})
    assert config.intermediate_size == transformers.models.lfm2.modeling_lfm2.Lfm2MLP(hf).w1.out_features


def test_conv_layers_keep_a_state_of_their_last_inputs_and_no_kv():
    """The conv layers are state layers: no K/V in the cache, a state per sequence of kernel - 1 inputs a channel
    (in the model's dtype), per rank its share of the channels; `full_attn_idxs` picks the attention layers where
    `layer_types` is absent; `tie_embedding` and `norm_eps` are LFM2's names."""
    config = ModelConfig.from_hf_config({**BASE, "conv_L_cache": 4, "tie_embedding": False, "norm_eps": 1e-4})
    assert config.kv_layers == (1, 3) and config.state_layers.conv_state_shape == (64, 3)
    assert not config.tie_word_embeddings and config.rms_norm_eps == 1e-4 and config.qk_norm
    assert config.state_bytes_per_seq(torch.bfloat16) == 2 * 64 * 3 * 2
    assert config.state_bytes_per_seq(torch.bfloat16, tensor_parallel_size=2) == 2 * 32 * 3 * 2
    picked = {k: v for k, v in BASE.items() if k != "layer_types"} | {"full_attn_idxs": [0, 2]}
    assert ModelConfig.from_hf_config(picked).kv_layers == (0, 2)


@pytest.mark.parametrize("change,named", [
    ({"layer_types": ["conv"] * 4}, r"^layer_types: LFM2 with no full attention layer"),
    ({"layer_types": ["conv", "mamba", "conv", "full_attention"]}, r"^layer_types: conv or full_attention"),
    ({"layer_types": ["full_attention"] * 3}, r"^layer_types: conv or full_attention for each of the 4"),
    ({"conv_L_cache": 1}, r"^conv_L_cache: must be >= 2"),
    ({"architectures": ["Lfm2MoeForCausalLM"], "use_expert_bias": False}, r"^use_expert_bias: LFM2-MoE is served"),
])
def test_what_is_not_served_is_refused_naming_the_key(change, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**BASE, **change})
