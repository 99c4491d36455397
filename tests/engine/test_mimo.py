"""MiMo-V2-Flash beyond greedy parity (tests/engine/test_engine_vs_hf.py, tests/engine/test_tensor_parallel.py): its
config.json as transformers reads the release's, what is refused by key, and its KV cache of two shapes (V padded to
a q/k head) under pressure, with the model's cache and an FP8 one."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.model_config import ModelConfig
from engine.parallel import ShardShape, check_tensor_parallel
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import assert_serves_under_pressure, pressure_engine

# transformers' MiMoV2FlashConfig defaults are the release's shape (XiaomiMiMo/MiMo-V2-Flash); the hub's config.json
# names its window by `sliding_window_size`, the keys before the query
RELEASE = {"architectures": ["MiMoV2FlashForCausalLM"], "sliding_window_size": 128}
TINY = {"num_hidden_layers": 3, "head_dim": 32, "v_head_dim": 16, "num_key_value_heads": 1, "sliding_window": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "pad_token_id": 0}


def test_the_release_config_gives_two_attention_shapes_and_its_309b_parameters():
    """The first and every 6th layer full (9 of 48, 4 KV heads), the other 39 sliding with 8, every head of 192 in the
    cache (V's 128 padded): S_KV counts each layer in its own shape; 309B parameters (256 experts on 47 layers); the
    window is 129 positions, the query's included, as transformers reads the release's 128."""
    config = ModelConfig.from_hf_config(RELEASE)
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [0, 5, 11, 17, 23, 29, 35, 41, 47] and config.sliding_window == 129
    assert (config.layer_kv_shape(0), config.layer_kv_shape(1)) == ((4, 192), (8, 192))
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * (9 * 4 * 192 + 39 * 8 * 192) * 2
    assert 308e9 < config.num_params() < 310e9 and config.mlp_only_layers == (0,)
    assert (config.rope_theta, config.rope_local_theta, config.rotary_dim) == (5e6, 1e4, 64)
    assert (config.mimo.v_head_dim, config.mimo.value_scale, config.moe_router) == (128, 0.707, "deepseek_v3")
    assert ModelConfig.from_hf_config({**RELEASE, "sliding_window_size": None}).sliding_window == 129   # the class's
    eight = ShardShape.of(config, 0, 8)   # the full layers' 4 KV heads replicated past 4 ranks, the sliding ones' split
    assert eight.kv_bytes_per_token(config, torch.bfloat16) == 2 * (9 * 1 * 192 + 39 * 1 * 192) * 2


@pytest.mark.parametrize("change,key", [
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                          "sliding_attention": {"rope_type": "default"}}}, "rope_parameters.full_attention.rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5},
                          "sliding_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types"),
    ({"v_head_dim": 256}, "v_head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 64}, "num_key_value_heads"),   # its sliding layers' 128 do not divide 64 heads
    ({"layer_types": ["full_attention", "chunked"]}, "layer_types"),
])
def test_what_mimo_asks_beyond_what_is_served_is_refused_by_key(change, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        ModelConfig.from_hf_config({**RELEASE, **change})


def test_ranks_that_cannot_split_both_shapes_are_refused():
    """3 ranks divide neither the full layers' 4 KV heads nor the sliding layers' 8 (nor 64 heads): refused by key."""
    with pytest.raises(ConfigError, match="^tensor_parallel_size:"):
        check_tensor_parallel(ModelConfig.from_hf_config(RELEASE), 3)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_mimo_serves_preemption_prefix_hits_and_forks(tmp_path, builtin_path, kv):
    """A cache tensor a shape (the sliding layers' two KV heads, the full layer's one, each head of 32 holding V's 16
    padded); under pressure (swap preemption, prefix hits, n = 2 forks copying on write) every request ends and every
    block comes back, and with the model's cache the greedy outputs are transformers'; an FP8 cache serves alike."""
    folder = make_tiny_model(tmp_path / "mimo", "mimo_v2_flash", builtin_path, **TINY)
    engine = pressure_engine(folder, kv)
    assert [tuple(t.shape[:2]) + tuple(t.shape[-2:]) for t in engine.kv_cache.tensors] == [(1, 2, 1, 32),
                                                                                          (2, 2, 2, 32)]
    assert engine.kv_bytes_per_token == 2 * (1 * 32 + 2 * 2 * 32) * (1 if kv == "fp8" else 4)
    assert_serves_under_pressure(engine, folder, kv)
