"""Gemma 4's text model beyond greedy parity (tests/engine/test_engine_vs_hf.py): its config.json as the releases
write it, what is refused by key, its KV cache of two layer shapes under pressure, and its multimodal checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import ConfigError
from engine.gemma4_config import Gemma4Shape
from engine.kv_cache import KVCache, SwapSpace
from engine.model_config import ModelConfig
from engine.parallel import ShardShape, check_tensor_parallel
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import (GEMMA4, GEMMA4_MOE, _assert_serves_its_text_model,
                                           assert_serves_under_pressure, pressure_engine)

# gemma-4-31B's text config as its release names it (its full layers' shape under the global_ keys)
GEMMA4_31B = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 262_144, "hidden_size": 5376,
              "intermediate_size": 21_504, "num_hidden_layers": 60, "num_attention_heads": 32,
              "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
              "attention_k_eq_v": True, "sliding_window": 1024, "hidden_size_per_layer_input": 0,
              "final_logit_softcapping": 30.0, "max_position_embeddings": 262_144, "tie_word_embeddings": True,
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1_000_000.0}}}


def test_the_release_config_gives_two_attention_shapes_and_their_bytes():
    """Every 6th layer full, with 4 KV heads of 512 beside the sliding layers' 16 of 256: S_KV counts each layer in its
    own shape, and the parameter count is the 31B's. The multimodal checkpoint's text_config reads the same."""
    config = ModelConfig.from_hf_config(GEMMA4_31B)
    assert config.layer_types.count("full_attention") == 10 and config.layer_types[5] == "full_attention"
    assert (config.layer_kv_shape(0), config.layer_kv_shape(5)) == ((16, 256), (4, 512))
    assert config.gemma4.k_eq_v and config.attention_scale == 1.0
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * (50 * 16 * 256 + 10 * 4 * 512) * 2
    assert 30.6e9 < config.num_params() < 31.3e9
    assert (config.rope_theta, config.rope_local_theta, config.rotary_dim) == (1e6, 1e4, 64)
    text = {k: v for k, v in GEMMA4_31B.items() if k != "architectures"}
    multimodal = ModelConfig.from_hf_config({"architectures": ["Gemma4ForConditionalGeneration"],
                                             "text_config": {**text, "model_type": "gemma4_text"}})
    assert multimodal.text_weights_prefix == "language_model."
    assert multimodal.kv_bytes_per_token(torch.bfloat16) == config.kv_bytes_per_token(torch.bfloat16)


def test_the_e_models_keep_no_kv_for_their_shared_layers():
    """An E2B-shaped config (35 layers, the last 20 reading the K/V of the last sliding and full layers before them,
    per-layer inputs of 256): the cache holds the first 15 layers alone, and S_KV counts those; the step's FLOPs count
    the attention of all 35."""
    from engine.roofline import step_flops

    e2b = {**GEMMA4_31B, "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
           "num_attention_heads": 8, "num_key_value_heads": 1, "attention_k_eq_v": False, "sliding_window": 512,
           "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
           "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7}
    config = ModelConfig.from_hf_config(e2b)
    g = config.gemma4
    assert config.kv_layers == tuple(range(15)) and (g.per_layer_input_size, g.per_layer_vocab_size) == (256, 262_144)
    assert [g.kv_producer(config, i) for i in (14, 15, 19, 34)] == [14, 13, 14, 14]
    assert (g.mlp_width(config, 14), g.mlp_width(config, 15)) == (6144, 12_288)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * (12 * 256 + 3 * 512) * 2
    assert step_flops(config, 1, 1000, 0) - step_flops(config, 1, 0, 0) == 4 * 8 * (28 * 256 + 7 * 512) * 1000


@pytest.mark.parametrize("change,key", [
    ({"hidden_size_per_layer_input": -1}, "hidden_size_per_layer_input"),
    ({"num_kv_shared_layers": 60}, "num_kv_shared_layers"),   # no layer left to keep the K/V they read
    ({"num_kv_shared_layers": 55}, "num_kv_shared_layers"),   # no full layer before them
    ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
     "rope_parameters.full_attention.rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "factor": 8.0}}},
     "rope_parameters.full_attention.factor"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type"),
    ({"per_layer_config": {"5": {"head_dim": 512}}}, "per_layer_config"),   # the other full layers left out
    ({"per_layer_config": {str(i): {"head_dim": 512, "sliding_window": 8} for i in range(5, 60, 6)}},
     "per_layer_config"),
])
def test_what_gemma4_asks_beyond_what_is_served_is_refused_by_key(change, key):
    cfg = {**GEMMA4_31B, **change}
    with pytest.raises(ConfigError, match=f"^{key}:"):
        ModelConfig.from_hf_config(cfg)


def test_per_layer_config_as_transformers_saves_it_and_each_shape_split_over_ranks():
    """transformers 5 saves the full layers' shape as `per_layer_config` (the global_ keys gone): read alike. Ranks
    split each shape's KV heads (the full layers' 4 replicated past 4 ranks), and a count they neither divide nor
    are a multiple of is refused naming the key."""
    per_layer = {str(i): {"head_dim": 512, "num_key_value_heads": 4} for i in range(5, 60, 6)}
    cfg = {k: v for k, v in GEMMA4_31B.items() if not k.startswith(("global_", "num_global_"))}
    config = ModelConfig.from_hf_config({**cfg, "per_layer_config": per_layer})
    assert config.gemma4 == ModelConfig.from_hf_config(GEMMA4_31B).gemma4
    one = config.kv_bytes_per_token(torch.bfloat16)
    assert ShardShape.of(config, 0, 2).kv_bytes_per_token(config, torch.bfloat16) == one // 2
    assert ShardShape.of(config, 3, 8).kv_bytes_per_token(config, torch.bfloat16) == 2 * (50 * 2 * 256 + 10 * 512) * 2
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 2 neither divides nor is a multiple of the .* 3 KV"):
        check_tensor_parallel(replace(config, gemma4=Gemma4Shape(3, 512, True)), 2)


def test_a_cache_of_two_shapes_copies_and_swaps_every_layer():
    """One tensor a shape, each layer's K/V a view of its own; a block copy and a swap round trip move a block's K/V
    in both tensors, and nothing else."""
    config = ModelConfig.from_hf_config({**GEMMA4_31B, "num_hidden_layers": 6, "hidden_size": 64,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                         "global_head_dim": 16, "num_global_key_value_heads": 1})
    cache = KVCache(config, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    assert [tuple(t.shape) for t in cache.tensors] == [(5, 2, 6, 4, 2, 8), (1, 2, 6, 4, 1, 16)]
    assert [tuple(k.shape) for k, _ in cache.layers] == [(6, 4, 2, 8)] * 5 + [(6, 4, 1, 16)]
    assert cache.num_bytes == 6 * 4 * config.kv_bytes_per_token(torch.float32)
    for tensor in cache.tensors:
        tensor.copy_(torch.randn(tensor.shape))
    before = [tensor.clone() for tensor in cache.tensors]
    cache.copy_blocks([(1, 4)])
    for tensor, old in zip(cache.tensors, before):
        assert torch.equal(tensor[:, :, 4], old[:, :, 1]) and torch.equal(tensor[:, :, :4], old[:, :, :4])
    swap = SwapSpace(cache, num_blocks=3)
    swap.swap_out([(2, 0)])
    for tensor in cache.tensors:
        tensor[:, :, 2] = 0
    swap.swap_in([(0, 2)])
    for tensor, old in zip(cache.tensors, before):
        assert torch.equal(tensor[:, :, 2], old[:, :, 2])
    with pytest.raises(ValueError, match="several shapes"):
        cache.data


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gemma4_serves_preemption_prefix_hits_and_forks(tmp_path, builtin_path, kv):
    """Under pressure (swap preemption, prefix hits, n = 2 forks copying on write) every request ends and every block
    comes back, and with the model's cache the greedy outputs are transformers'; an FP8 cache of both shapes (a
    scale a layer) serves alike."""
    folder = make_tiny_model(tmp_path / "g4", "gemma4", builtin_path, **GEMMA4_MOE)
    engine = pressure_engine(folder, kv)
    assert [tuple(t.shape[1:]) for t in engine.kv_cache.tensors] == [(2, 14, 8, 2, 16), (2, 14, 8, 2, 32)]
    assert engine.kv_bytes_per_token == 2 * (2 * 2 * 16 + 2 * 2 * 32) * (1 if kv == "fp8" else 4)
    assert_serves_under_pressure(engine, folder, kv)


@pytest.mark.parametrize("family", ["Gemma4", "Gemma4Unified"])
def test_a_multimodal_gemma4_checkpoint_serves_its_text_model(tmp_path, builtin_path, family):
    """Gemma 4's releases are `Gemma4ForConditionalGeneration` (vision and audio towers beside the text model under
    `language_model.`): served as the text model, greedy text token-identical to transformers' multimodal model.
    Gemma 4 Unified's (Gemma 4 12B's: its text model without per-layer inputs or experts, its image tokens attending
    both ways, its text causal) alike."""
    import transformers

    unified = family == "Gemma4Unified"
    gemma4 = {k: v for k, v in GEMMA4.items() if not unified or k != "hidden_size_per_layer_input"}
    text = getattr(transformers, f"{family}TextConfig")(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **gemma4)
    vision = getattr(transformers, f"{family}VisionConfig")(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                            num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = getattr(transformers, f"{family}Config")(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                      audio_config=None, initializer_range=0.2,
                                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    folder = tmp_path / "gemma4-mm"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "Gemma4ForCausalLM")
