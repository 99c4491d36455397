"""Config validation: every bad value is named in the error."""

import json

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig, parse_dtype
from engine.model_config import ModelConfig
from engine.llm_engine import LLMEngine

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'.*Gemma3ForConditionalGeneration"),
    ({"architectures": []}, "architectures"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "rope_scaling.rope_type: unsupported 'dynamic'; supported: default, linear, llama3, yarn"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1}}, "rope_scaling.attention_factor"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "use_sliding_window: Qwen3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_bad_model_configs_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config({**LLAMA, **change})


def test_missing_and_malformed_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_folder(tmp_path)


def test_s_kv_and_llama3_70b_shape():
    cfg = ModelConfig.from_hf_config({**LLAMA, "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
                                      "num_hidden_layers": 80, "num_attention_heads": 64,
                                      "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256})
    assert cfg.kv_bytes_per_token(torch.float16) == 2 * 80 * 8 * 128 * 2 == 327680


@pytest.mark.parametrize("make,match", [
    (lambda: parse_dtype("float8"), "dtype: unsupported dtype 'float8'"),
    (lambda: EngineConfig(dtype="int4"), "dtype"),
    (lambda: EngineConfig(device="tpu"), "device"),
    (lambda: EngineConfig(calculate_kv_scales="no"), "calculate_kv_scales: must be true or false"),
    (lambda: EngineConfig(pools=()), "pools"),
    (lambda: EngineConfig(pools=(PoolConfig("a"), PoolConfig("a", 5))), "duplicate"),
    (lambda: PoolConfig("x", num_blocks=0), "pools.x.num_blocks: must be a positive integer"),
    (lambda: CacheConfig(block_size=12), "block_size: must be one of 8, 16, 32"),
    (lambda: CacheConfig(block_size=64), "block_size"),
    (lambda: SchedulerConfig(preemption_mode="auto"), "swap_space_bytes: preemption_mode 'auto' needs"),
    (lambda: SchedulerConfig(victim_policy="oldest"), "victim_policy: must be one of reverse_fifo"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: SchedulerConfig(preemption_mode="swap"), "preemption_mode"),
    (lambda: SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096),
     "max_num_batched_tokens"),
])
def test_bad_engine_configs_are_named(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_unsupported_architecture_in_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ConfigError, match="FalconForCausalLM"):
        LLMEngine.from_args(str(tmp_path), progress=False)


def test_qwen3_with_yarn_as_its_model_card_writes_it():
    """Qwen3's published configs: head_dim apart from hidden / heads, no biases, the legacy `rope_scaling`
    key for YaRN past 32k (and transformers 5's `rope_parameters`, read alike)."""
    qwen3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64, "intermediate_size": 25600,
             "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    cfg = ModelConfig.from_hf_config(qwen3)
    assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 128 and cfg.rope_theta == 1e6
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) \
        == ("yarn", 4.0, 32768)
    as_v5 = {k: v for k, v in qwen3.items() if k not in ("rope_scaling", "rope_theta")}
    as_v5["rope_parameters"] = {**qwen3["rope_scaling"], "rope_theta": 1000000.0}
    assert ModelConfig.from_hf_config(as_v5) == cfg
    # 32.8 B parameters, the q/k norms counted
    assert cfg.num_params() == 32_762_123_264
    no_factor = {**qwen3, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32768}}
    assert ModelConfig.from_hf_config(no_factor).rope_scaling.factor == 4.0   # 131072 / 32768


def test_qwen3_moe_as_its_model_card_writes_it():
    """Qwen3-30B-A3B's config: 128 experts of 768, 8 a token; every expert counted in the parameters."""
    moe = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "intermediate_size": 6144,
           "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    cfg = ModelConfig.from_hf_config(moe)
    assert cfg.qk_norm and cfg.num_experts == 128 and all(cfg.is_sparse_layer(i) for i in range(48))
    assert cfg.num_params() == 30_532_122_624   # 30.5 B, as the model card says
    dense_one = ModelConfig.from_hf_config({**moe, "mlp_only_layers": [0], "decoder_sparse_step": 2})
    assert [dense_one.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ConfigError, match="num_experts_per_tok: 9 is more than num_experts 8"):
        ModelConfig.from_hf_config({**moe, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_hf_config({**moe, "mlp_only_layers": "all"})


@pytest.mark.parametrize("change,named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping: logit soft-capping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: logit soft-capping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_type"),
    ({"layer_types": ["sliding_attention"]}, "layer_types: one of"),
])
def test_what_we_do_not_serve_of_gemma3_is_refused_by_name(change, named):
    gemma = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "head_dim": 16}
    assert ModelConfig.from_hf_config(gemma).layer_types == ("sliding_attention", "sliding_attention")
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**gemma, **change})
