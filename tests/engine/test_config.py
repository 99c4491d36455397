"""Config validation: every bad value is named in the error."""

import json

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, PoolConfig, SchedulerConfig, parse_dtype
from engine.llm_engine import LLMEngine

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": []}, "architectures"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: unsupported 'yarn'"),
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
