"""Config validation: every bad value is named in the error."""

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig, parse_dtype
from engine.model_config import ModelConfig
from engine.parallel import check_tensor_parallel
from engine.llm_engine import LLMEngine

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["XGLMForCausalLM"]},
     "unsupported architecture 'XGLMForCausalLM'.*Gemma3ForConditionalGeneration"),
    ({"architectures": []}, "architectures"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 4.0}},
     "rope_scaling.rope_type: unsupported 'ntk'; supported: default, dynamic, linear, llama3, yarn, longrope"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     r"rope_scaling.short_factor: longrope needs a list of positive numbers, got None"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}},
     r"rope_scaling.long_factor: longrope needs one factor a rotary frequency \(8\), got 7"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1}}, "rope_scaling.attention_factor"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "layer_types": ["sliding_attention"]},
     "layer_types: one of full_attention, sliding_attention, chunked_attention for each of the"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "layer_types": "sliding"}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": None}, "vocab_size"),
    # a quantized checkpoint's weights are no float model's: refused before they are read as one (FP8 weights with
    # block or per-tensor scales are dequantized as read)
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     r"quantization_config.weight_block_size: two positive integers"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, r"quantization_config: .*compressed-tensors"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8},
                              "config_groups": {"group_0": {"weights": {"num_bits": 8}}}}},
     r"quantization_config.format: compressed-tensors checkpoints are served as FP8 weights"),   # not float ones
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
     r"quantization_config: .*modelopt"),
    ({"quantization_config": {"quant_method": "compressed-tensors",   # a KV cache of 8-bit integers: not e4m3
                              "kv_cache_scheme": {"num_bits": 8, "type": "int"}}}, r"quantization_config: "),
    ({"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}}, r"quantization_config: "),
    ({"quantization_config": {"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24"},
                              "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}, r"quantization_config: "),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {},
      "quantization_config": {"quant_method": "bitsandbytes"}}, r"quantization_config: .*\(bitsandbytes\)"),
    ({"compression_config": {"quant_method": "compressed-tensors"}}, r"compression_config: .*compressed-tensors"),
    ({"quantization_config": None, "compression_config": {"config_groups": {"group_0": {"weights": {"num_bits": 4}}}}},
     r"compression_config: quantized checkpoints \(unnamed\)"),
])
def test_bad_model_configs_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config({**LLAMA, **change})


@pytest.mark.parametrize("compression", [{}, {"sparsity_config": {"format": "dense"}}])
def test_a_compression_config_that_quantizes_nothing_is_served(compression):
    """An old llm-compressor save of a pruned model, dense: floats as any (transformers never reads the key)."""
    assert ModelConfig.from_hf_config({**LLAMA, "compression_config": compression}).num_layers == LLAMA["num_hidden_layers"]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change,match", [
    # sizes: read before any arithmetic, an integer (not a string, a bool or a float), positive
    ({"num_attention_heads": 0}, "num_attention_heads: must be a positive integer, got 0"),
    ({"num_attention_heads": "4"}, "num_attention_heads: must be a positive integer, got '4'"),
    ({"hidden_size": "64"}, "hidden_size: must be a positive integer, got '64'"),
    ({"num_hidden_layers": True}, "num_hidden_layers: must be a positive integer, got True"),
    ({"num_key_value_heads": -2}, "num_key_value_heads: must be a positive integer, got -2"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": "4096"},
     "sliding_window: must be a positive integer, got '4096'"),
    ({"rope_scaling": {k: v for k, v in YARN.items() if k != "factor"}, "max_position_embeddings": "128"},
     "max_position_embeddings: must be a positive integer, got '128'"),
    ({"architectures": [{"name": "LlamaForCausalLM"}]}, "architectures: unsupported architecture"),
    ({"bos_token_id": "1"}, "bos_token_id: must be an integer >= 0, got '1'"),
    ({"eos_token_id": ["2"]}, r"eos_token_id: must be a token id or a list of token ids, got \['2'\]"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings: must be true or false, got 'false'"),
    # floats: a number, finite, positive where 0 means nothing
    ({"rms_norm_eps": "abc"}, "rms_norm_eps: expected a number, got 'abc'"),
    ({"rms_norm_eps": 0}, "rms_norm_eps: must be a positive finite number, got 0"),
    ({"rope_theta": float("inf")}, "rope_theta: must be a positive finite number, got inf"),
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": "abc"}}, "rope_scaling.factor: expected a number, got 'abc'"),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": "8k"}},
     "rope_scaling.original_max_position_embeddings: must be a positive integer, got '8k'"),
    ({"rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": float("nan")}}, "rope_scaling.low_freq_factor: must be"),
    ({"rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 0.5}}, "rope_scaling.high_freq_factor: llama3 needs"),
    ({"rope_scaling": {**YARN, "beta_fast": -1}}, "rope_scaling.beta_fast: must be a positive finite number"),
    ({"rope_scaling": {**YARN, "mscale": "x"}}, "rope_scaling.mscale: expected a number, got 'x'"),
    ({"rope_scaling": {**YARN, "truncate": "no"}}, "rope_scaling.truncate: must be true or false, got 'no'"),
    ({"rope_parameters": {**YARN, "factor": -2}}, "rope_parameters.factor: must be a positive finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}},
     "rope_parameters.rope_theta: expected a number, got '1e6'"),
    ({"rope_parameters": "yarn"}, "rope_parameters: expected an object, got 'yarn'"),
    # a linear or llama3 rope without its factor (transformers: a KeyError; it was served unscaled, or at the
    # context's growth); YaRN's is the context's growth, as transformers reads it
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor: missing"),
    ({"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}}, "rope_scaling.factor: missing"),
    ({"rope_parameters": {"rope_type": "linear", "factor": None}}, "rope_parameters.factor: missing"),
])
def test_bad_values_and_types_are_named_before_any_arithmetic(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config({**LLAMA, **change})


@pytest.mark.parametrize("key", ["num_key_value_heads", "head_dim"])
def test_zero_heads_or_head_dim_are_refused_not_defaulted(key):
    """`num_key_value_heads: 0` once became num_attention_heads (S_KV 8x on Llama 3 70B) and `head_dim: 0` the
    derived one, silently; absent or null still take the default."""
    with pytest.raises(ConfigError, match=f"{key}: must be a positive integer, got 0"):
        ModelConfig.from_hf_config({**LLAMA, key: 0})
    cfg = ModelConfig.from_hf_config({**LLAMA, key: None})
    assert (cfg.num_kv_heads, cfg.head_dim) == ((4, 16) if key == "num_key_value_heads" else (2, 16))
    assert ModelConfig.from_hf_config({k: v for k, v in LLAMA.items() if k != key}) == cfg


@pytest.mark.parametrize("arch,config_class", [("Qwen2ForCausalLM", "Qwen2Config"), ("Qwen3ForCausalLM", "Qwen3Config"),
                                               ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
                                               ("MistralForCausalLM", "MistralConfig"), ("LlamaForCausalLM", "LlamaConfig")])
def test_a_config_without_its_kv_head_count_takes_its_config_classs(arch, config_class):
    """A config.json that leaves out num_key_value_heads has as many as transformers' config class gives it
    (Qwen3's 32, Mistral's 8; Llama's: one per query head), not one per query head whatever the class."""
    transformers = pytest.importorskip("transformers")
    base = {**LLAMA, "architectures": [arch], "num_attention_heads": 64, "hidden_size": 4096}
    if arch == "Qwen3MoeForCausalLM":
        base |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    base.pop("num_key_value_heads", None)
    theirs = getattr(transformers, config_class)(**{k: v for k, v in base.items() if k != "architectures"})
    assert ModelConfig.from_hf_config(base).num_kv_heads == theirs.num_key_value_heads
    if config_class in ("Qwen3MoeConfig", "MistralConfig"):   # typed int there: transformers refuses a null
        return
    none = getattr(transformers, config_class)(**{k: v for k, v in base.items() if k != "architectures"},
                                               num_key_value_heads=None)   # null: one per query head
    assert ModelConfig.from_hf_config({**base, "num_key_value_heads": None}).num_kv_heads == \
        none.num_key_value_heads == 64


def test_a_scaled_rope_over_part_of_each_head_is_refused_and_a_plain_one_reads_as_transformers_does():
    """transformers' linear, llama3 and yarn ropes rotate `partial_rotary_factor` of each head; Llama's layers turn
    whole heads (a scaled rope over part of each is refused, by its key; the families that turn part serve it:
    GLM-4's test below); its default rope ignores the key, and so do we."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match=r"^rope_scaling\.partial_rotary_factor: this architecture turns whole"):
        ModelConfig.from_hf_config({**LLAMA, "rope_scaling": {**yarn, "partial_rotary_factor": 0.5}})
    with pytest.raises(ConfigError, match=r"^partial_rotary_factor: "):   # the key the file has
        ModelConfig.from_hf_config({**LLAMA, "partial_rotary_factor": 0.25, "rope_scaling": yarn})
    default = {"rope_type": "default"}
    assert ModelConfig.from_hf_config({**LLAMA, "partial_rotary_factor": 0.5, "rope_scaling": default}) == \
        ModelConfig.from_hf_config({**LLAMA, "rope_scaling": default})
    assert ModelConfig.from_hf_config({**LLAMA, "partial_rotary_factor": 1.0, "rope_scaling": yarn}).rope_scaling.factor == 4
    assert ModelConfig.from_hf_config({**LLAMA, "partial_rotary_factor": 0.5}) == ModelConfig.from_hf_config(LLAMA)


def test_a_composite_gemma3_config_takes_transformers_defaults_for_what_its_text_config_leaves_out():
    """transformers saves a composite checkpoint's text_config as its difference from Gemma3TextConfig's
    defaults: gemma-3-4b-it's (this one) names no head count, head_dim, vocabulary, context or rope base. It
    reads as transformers reads it (its own config class fills the rest), not with Llama's defaults."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    diff = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    ours = ModelConfig.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                                       "model_type": "gemma3", "text_config": diff})
    full = transformers.Gemma3Config(text_config=diff).text_config.to_dict()
    theirs = ModelConfig.from_hf_config({**full, "architectures": ["Gemma3ForCausalLM"], "eos_token_id": [1, 106]})
    assert dataclasses.replace(ours, text_weights_prefix=theirs.text_weights_prefix) == theirs
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (8, 4, 256, 262_208)
    assert (ours.rope_theta, ours.rope_local_theta, ours.max_position_embeddings) == (1e6, 1e4, 131_072)
    assert ours.tie_word_embeddings and ours.sliding_window == 1024 and ours.layer_types[5] == "full_attention"


@pytest.mark.parametrize("config,match", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": "x"}, "text_config: expected an object"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text_config: missing from config.json"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {**LLAMA, "num_attention_heads": 0}},
     "text_config.num_attention_heads: must be a positive integer, got 0"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": LLAMA, "tie_word_embeddings": "yes"},
     "^tie_word_embeddings: must be true or false, got 'yes'"),   # the top-level key, named as the file has it
])
def test_a_multimodal_config_names_its_text_config(config, match):
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig.from_hf_config(config)
    assert "unsupported architecture" not in str(err.value)


def test_missing_and_malformed_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"config.json: must be a JSON object, got \[1\]"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))   # AutoGPTQ's checkpoints say it beside config.json
    (tmp_path / "quantize_config.json").write_text('{"bits": 3, "group_size": 128}')
    with pytest.raises(ConfigError,
                       match=r"^quantize_config.json: bits: GPTQ checkpoints of 4 or 8 bits are served, got 3$"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "quantize_config.json").write_text('{"bits": 4, "group_size": 128')
    with pytest.raises(ConfigError, match=r"^quantize_config.json: not valid JSON"):
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
    # the Python API as strict as the YAML: a bool is no count, a wrong type a named error, not a TypeError
    (lambda: SchedulerConfig(max_num_seqs=True), r"^max_num_seqs: must be an integer >= 1, got True"),
    (lambda: SchedulerConfig(swap_space_bytes=False), r"^swap_space_bytes: must be an integer >= 0, got False"),
    (lambda: SchedulerConfig(max_model_len="x"), r"^max_model_len: must be an integer >= 0, got 'x'"),
    (lambda: SchedulerConfig(max_model_len=None), r"^max_model_len: must be an integer >= 0, got None"),
    (lambda: EngineConfig(memory_utilization="0.9"), r"^memory_utilization: must be a number in \(0, 1\], got '0.9'"),
    (lambda: EngineConfig(cpu_threads=None), r"^cpu_threads: must be an integer >= 0, got None"),
    (lambda: EngineConfig(cpu_threads=True), r"^cpu_threads: must be an integer >= 0, got True"),
    (lambda: SchedulerConfig(preemption_mode="swap"), "preemption_mode"),
    (lambda: SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096),
     "max_num_batched_tokens"),
])
def test_bad_engine_configs_are_named(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def _cuda_machine(monkeypatch, capability=(9, 0)):
    """A CPU machine that says it has two GPUs of `capability`: what a one-rank engine does on CUDA before
    it touches a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_a_one_rank_engine_on_a_second_gpu_makes_it_the_current_device_first(monkeypatch):
    # Triton launches on the current device, and events and graph captures use its stream: an engine on
    # cuda:1 that left cuda:0 current would die at its first kernel (or read tokens before they are written)
    _cuda_machine(monkeypatch)
    selected = []

    class Selected(Exception):
        pass

    def set_device(device):
        selected.append(torch.device(device))
        raise Selected

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for device, gpu_ids in (("cuda:1", ()), ("cuda", (1,))):
        with pytest.raises(Selected):
            LLMEngine(EngineConfig(model="builtin", device=device, gpu_ids=gpu_ids), progress=False)
    assert selected == [torch.device("cuda", 1)] * 2


def test_an_fp8_cache_on_a_gpu_without_fp8_conversions_is_refused_by_name(monkeypatch):
    config = EngineConfig(kv_cache_dtype="fp8", device="cuda:1")
    _cuda_machine(monkeypatch, (8, 0))   # an A100
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: fp8 needs a GPU of compute capability 8.9 .*cuda:1 is "
                                          r"8.0: use kv_cache_dtype: auto"):
        config.resolved_kv_dtype(torch.device("cuda", 1))
    _cuda_machine(monkeypatch, (8, 9))   # an L4
    assert config.resolved_kv_dtype(torch.device("cuda", 1)) == torch.float8_e4m3fn
    assert EngineConfig(device="cuda:1").resolved_kv_dtype(torch.device("cuda", 1)) == torch.bfloat16
    assert config.resolved_kv_dtype(torch.device("cpu")) == torch.float8_e4m3fn


def test_a_sampling_seed_that_is_no_integer_is_refused_by_name():
    for bad in (7.0, True, "7", -1, 2**64):
        with pytest.raises(ConfigError, match=r"^sampling_seed: must be an integer in 0..2\^63-1 or unset"):
            EngineConfig(sampling_seed=bad)
    assert EngineConfig(sampling_seed=7).draw_sampling_seed() == 7
    assert EngineConfig().draw_sampling_seed() != EngineConfig().draw_sampling_seed()


def test_dtype_auto_is_float16_on_a_gpu_without_bfloat16_and_bfloat16_there_is_refused_by_name(monkeypatch):
    """A T4 or a V100 (compute capability 7.x) has no bfloat16 tensor cores: `auto` took bfloat16 on every GPU,
    and the engine failed there; it takes float16 now, and an explicit bfloat16 is refused naming the key."""
    gpu = torch.device("cuda", 1)
    _cuda_machine(monkeypatch, (7, 5))   # a T4
    assert EngineConfig(device="cuda:1").resolved_dtype(gpu) == torch.float16
    assert EngineConfig(device="cuda:1").resolved_kv_dtype(gpu) == torch.float16
    assert EngineConfig(device="cuda:1", dtype="float32").resolved_dtype(gpu) == torch.float32
    with pytest.raises(ConfigError, match=r"^dtype: bfloat16 needs a GPU of compute capability 8.0 or newer; "
                                          r"cuda:1 is 7.5: use dtype: float16"):
        EngineConfig(device="cuda:1", dtype="bf16").resolved_dtype(gpu)
    _cuda_machine(monkeypatch, (8, 0))   # an A100
    assert EngineConfig(device="cuda:1").resolved_dtype(gpu) == torch.bfloat16
    assert EngineConfig(device="cuda:1", dtype="bf16").resolved_dtype(gpu) == torch.bfloat16


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                        (False, False, torch.float32)])
def test_dtype_auto_on_a_cpu_is_bfloat16_where_it_computes_bfloat16_natively(monkeypatch, builtin_path, amx,
                                                                            avx512_bf16, expected):
    """`auto` on a CPU: bfloat16 where torch reports AMX tiles or AVX-512 BF16 (oneDNN's bfloat16 matmuls run
    there natively), float32 elsewhere; the capacity plan resolves it alike; an explicit dtype is kept."""
    from pools.capacity_plan import plan_single_pool

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cpu = torch.device("cpu")
    assert EngineConfig().resolved_dtype(cpu) == expected
    assert EngineConfig().resolved_kv_dtype(cpu) == expected
    assert EngineConfig(dtype="float32").resolved_dtype(cpu) == torch.float32
    assert EngineConfig(dtype="bfloat16").resolved_dtype(cpu) == torch.bfloat16
    plan, config = plan_single_pool(str(builtin_path), device="cpu", kv_cache_bytes=64 << 20, max_model_len=1024)
    assert plan.devices["default"].dtype == config.dtype == str(expected).removeprefix("torch.")
    assert plan.devices["default"].kv_bytes_per_token == 30 * 2 * 3 * 64 * expected.itemsize   # SmolLM2's S_KV


def test_unsupported_architecture_in_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["XGLMForCausalLM"]}))
    with pytest.raises(ConfigError, match="XGLMForCausalLM"):
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
    # the model card's way: YaRN added to config.json, max_position_embeddings left at 40,960 (vLLM serves 131,072)
    card = ModelConfig.from_hf_config({**qwen3, "max_position_embeddings": 40960})
    assert (cfg.context_length, card.context_length, card.max_position_embeddings) == (131072, 131072, 40960)


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
    with pytest.raises(ConfigError, match="num_experts_per_tok: 9 is over num_experts 8"):
        ModelConfig.from_hf_config({**moe, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_hf_config({**moe, "mlp_only_layers": "all"})
    for change, named in [({"num_experts": 0}, "num_experts: must be a positive integer, got 0"),
                          ({"num_experts": None, "num_local_experts": "8"}, "num_local_experts: must be a positive"),
                          ({"decoder_sparse_step": 0}, "decoder_sparse_step: must be a positive integer, got 0"),
                          ({"norm_topk_prob": "yes"}, "norm_topk_prob: must be true or false"),
                          ({"mlp_only_layers": [True]}, "mlp_only_layers: must be a list of layer indices")]:
        with pytest.raises(ConfigError, match=named):
            ModelConfig.from_hf_config({**moe, **change})
    local = {k: v for k, v in moe.items() if k != "num_experts"}
    assert ModelConfig.from_hf_config({**local, "num_experts": None, "num_local_experts": 128}) == cfg


@pytest.mark.parametrize("change,named", [
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping: expected a number, got '30'"),
    ({"attn_logit_softcapping": -50.0}, "attn_logit_softcapping: must be a positive finite number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_type"),
    ({"layer_types": ["sliding_attention"]}, "layer_types: one of"),
    ({"layer_types": 2}, "layer_types: must be a list"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern: must be a positive integer, got 0"),
    ({"sliding_window_pattern": "6"}, "sliding_window_pattern: must be a positive integer, got '6'"),
    ({"sliding_window": "8"}, "sliding_window: must be a positive integer, got '8'"),
    ({"query_pre_attn_scalar": "x"}, "query_pre_attn_scalar: expected a number, got 'x'"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar: must be a positive finite number, got 0"),
    ({"rope_local_base_freq": "x"}, "rope_local_base_freq: expected a number"),
    ({"rope_parameters": {"full_attention": "x", "sliding_attention": {}}},
     "rope_parameters.full_attention: expected an object, got 'x'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": "x"}, "sliding_attention": {}}},
     "rope_parameters.full_attention.factor: expected a number, got 'x'"),
    ({"rope_parameters": {"full_attention": {}, "sliding_attention": {"rope_theta": "x"}}},
     "rope_parameters.sliding_attention.rope_theta: expected a number"),
])
def test_what_we_do_not_serve_of_gemma3_is_refused_by_name(change, named):
    gemma = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "head_dim": 16}
    assert ModelConfig.from_hf_config(gemma).layer_types == ("sliding_attention", "sliding_attention")
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**gemma, **change})


def test_the_keys_a_default_layer_type_rule_reads_are_read_only_without_layer_types():
    """transformers reads Gemma 3's `sliding_window_pattern` and Qwen's `max_window_layers` only where the config
    has no `layer_types`: a stale value beside them is no error."""
    kinds = ["full_attention", "sliding_attention"]
    gemma = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "head_dim": 16,
             "layer_types": kinds, "sliding_window_pattern": 0}
    qwen = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
            "layer_types": kinds, "max_window_layers": -1}
    for cfg in (gemma, qwen):
        assert ModelConfig.from_hf_config(cfg).layer_types == tuple(kinds)
    with pytest.raises(ConfigError, match="max_window_layers: must be an integer >= 0, got -1"):
        ModelConfig.from_hf_config({**qwen, "layer_types": None})


def test_a_scaled_ropes_context_is_read_as_vllm_reads_it_and_dynamic_ntk_stays_within_its_own():
    """linear: max_position_embeddings x factor (Gemma 3's count has it already); dynamic NTK: its base moves only
    past max_position_embeddings, so it serves that many positions with the default rope (it was refused)."""
    linear = ModelConfig.from_hf_config({**LLAMA, "max_position_embeddings": 4096,
                                        "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert linear.context_length == 16384
    gemma = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
                                       "head_dim": 16, "max_position_embeddings": 4096,
                                       "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma.context_length == 4096
    dynamic = ModelConfig.from_hf_config({**LLAMA, "max_position_embeddings": 4096,
                                         "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert dynamic.context_length == 4096 and dynamic.rope_scaling.rope_type == "dynamic"
    with pytest.raises(ConfigError, match="rope_scaling.factor: missing"):
        ModelConfig.from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "dynamic"}})


def test_gemma3_in_float16_is_refused_naming_dtype():
    """Its activations overflow float16 (vLLM refuses it too); it was served as inf and NaN logits."""
    from engine.models import build_model

    gemma = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
                                        "head_dim": 16})
    with pytest.raises(ConfigError, match="dtype: Gemma 3's activations overflow float16"):
        build_model(gemma, torch.float16, "cpu")
    assert build_model(gemma, torch.bfloat16, "cpu") is not None
    assert build_model(ModelConfig.from_hf_config(LLAMA), torch.float16, "cpu") is not None


def test_rope_and_multimodal_errors_name_the_key_the_value_came_from():
    """transformers 5 writes `rope_parameters`: RopeScaling's own checks name it, not `rope_scaling`; a
    multimodal checkpoint's top-level eos_token_id is read (and named) only where its text model has none."""
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    with pytest.raises(ConfigError, match=r"^rope_parameters\.rope_type: unsupported 'ntk'"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "ntk"}})
    with pytest.raises(ConfigError, match=r"^rope_parameters\.long_factor: longrope needs a list"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}})
    with pytest.raises(ConfigError, match=r"^rope_parameters\.factor: must be a positive finite number"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": -1}})
    with pytest.raises(ConfigError, match=r"^rope_scaling\.high_freq_factor: llama3 needs"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 4.0, "high_freq_factor": 1.0}})
    text = {k: v for k, v in base.items() if k != "architectures"} | {"sliding_window": 8, "eos_token_id": [1, 106]}
    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": "x", "text_config": text}
    assert ModelConfig.from_hf_config(multimodal).eos_token_ids == (1, 106)
    with pytest.raises(ConfigError, match=r"^eos_token_id: must be a token id"):
        ModelConfig.from_hf_config({**multimodal, "text_config": {**text, "eos_token_id": None}})


def _transformers_rope(cfg: dict) -> tuple[dict, torch.Tensor, float]:
    """What transformers' Qwen3 rotary embedding makes of `cfg` (a config.json dict): the rope parameters
    it standardized, its inverse frequencies and attention scaling."""
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = Qwen3RotaryEmbedding(transformers.Qwen3Config.from_dict(copy.deepcopy(cfg)))   # it fills in cfg's dicts
    return dict(rotary.config.rope_parameters), rotary.inv_freq, rotary.attention_scaling


def test_rope_keys_are_read_as_transformers_reads_them():
    """The rope entries transformers fills in or renames are read alike: `type` for `rope_type` inside
    rope_parameters too (a yarn config ran as default rope), original_max_position_embeddings from the top
    level first, else the scaling's, else max_position_embeddings (it was 8192); and both rope keys, where
    they disagree, are refused (transformers reads rope_scaling alone, losing rope_parameters' rope_theta)."""
    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    base = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "max_position_embeddings": 512}
    cases = [{"rope_parameters": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "rope_theta": 1e6}},
             {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}},
             {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
             {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
              "original_max_position_embeddings": 128},
             {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}]   # its own rope_theta
    for case in cases:
        want, inv_freq, attention_scaling = _transformers_rope({**base, **case})
        cfg = ModelConfig.from_hf_config({**base, **case})
        got = cfg.rope_scaling
        assert (got.rope_type, got.factor, got.original_max_position_embeddings, cfg.rope_theta) == \
            (want["rope_type"], want["factor"], want["original_max_position_embeddings"], want["rope_theta"]), case
        assert torch.allclose(rope_inv_freq(cfg), inv_freq) and rope_attention_factor(cfg) == attention_scaling
    default = {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "default", "rope_theta": 1e6}}
    want, inv_freq, _ = _transformers_rope(default)
    cfg = ModelConfig.from_hf_config(default)   # rope_scaling's rope_theta before the top level's, as transformers'
    assert cfg.rope_theta == want["rope_theta"] == 1e6 and torch.allclose(rope_inv_freq(cfg), inv_freq)
    both = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    with pytest.raises(ConfigError, match="^rope_scaling: config.json also has rope_parameters"):
        ModelConfig.from_hf_config({**base, **both})
    same = {"rope_theta": 1e6, "rope_parameters": {"type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert ModelConfig.from_hf_config({**base, **same}).rope_scaling.factor == 4.0   # one says what the other does
    # rope_scaling a part of rope_parameters: read alone (transformers' way) it has the top level's rope_theta (or
    # 10,000) and max_position_embeddings as its original context, not rope_parameters' 1e6 and 64
    part = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "rope_theta": 1e6}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match="^rope_scaling: config.json also has rope_parameters"):
        ModelConfig.from_hf_config({**base, **part})
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    with pytest.raises(ConfigError, match="^rope_scaling: config.json also has rope_parameters.full_attention"):
        ModelConfig.from_hf_config(gemma)


def test_gemma3_full_layers_yarn_is_read_as_transformers_reads_it():
    """Gemma 3's rope per layer type: a full layers' yarn takes its own original context, else
    max_position_embeddings, never the top level's (as transformers' Gemma3RotaryEmbedding), in the layer types'
    keys or the legacy rope_scaling; a flat rope_parameters
    (transformers drops it) and a layer type's truncate false (transformers reads none) are refused by name."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    cfg = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 512,
           "original_max_position_embeddings": 128,
           "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    theirs = Gemma3RotaryEmbedding(transformers.Gemma3TextConfig.from_dict(copy.deepcopy(cfg)))
    ours = ModelConfig.from_hf_config(copy.deepcopy(cfg))
    assert ours.rope_scaling.original_max_position_embeddings == 512
    assert torch.allclose(rope_inv_freq(ours), theirs.full_attention_inv_freq)
    assert rope_attention_factor(ours) == theirs.full_attention_attention_scaling
    with pytest.raises(ConfigError, match="^rope_parameters: Gemma 3 takes one entry per layer type"):
        ModelConfig.from_hf_config({**cfg, "rope_parameters": {"rope_type": "linear", "factor": 8.0}})
    truncated = copy.deepcopy(cfg)
    truncated["rope_parameters"]["full_attention"]["truncate"] = False
    with pytest.raises(ConfigError, match="^rope_parameters.full_attention.truncate: "):
        ModelConfig.from_hf_config(truncated)
    # the legacy keys (rope_theta, rope_scaling), which transformers moves into rope_parameters.full_attention
    legacy = {**{k: v for k, v in cfg.items() if k != "rope_parameters"}, "rope_theta": 1e6,
              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    theirs = Gemma3RotaryEmbedding(transformers.Gemma3TextConfig.from_dict(copy.deepcopy(legacy)))
    ours = ModelConfig.from_hf_config(copy.deepcopy(legacy))
    assert ours.rope_scaling.original_max_position_embeddings == 512 and ours.context_length == 2048
    assert torch.allclose(rope_inv_freq(ours), theirs.full_attention_inv_freq)
    with pytest.raises(ConfigError, match="^rope_scaling.truncate: "):
        ModelConfig.from_hf_config({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}})


def test_defaults_are_transformers_config_classes():
    """A Mistral config.json without sliding_window has MistralConfig's 4096 (null: none), Gemma 3 reads
    hidden_activation alone (Gemma3TextConfig ignores hidden_act) and a rope_parameters of its sliding layers
    alone (the full layers' default), a Qwen3 config.json without head_dim has 128, and Qwen3-MoE experts other than SiLU are
    refused by name (the dense layers followed hidden_act, the experts stayed SiLU)."""
    import transformers

    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_hf_config(mistral).sliding_window == 4096 == transformers.MistralConfig().sliding_window
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    gemma = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "hidden_act": "silu"}
    assert ModelConfig.from_hf_config(gemma).hidden_act == "gelu_pytorch_tanh" == \
        transformers.Gemma3TextConfig(hidden_act="silu").hidden_activation
    qwen3 = {key: value for key, value in LLAMA.items() if key != "head_dim"}   # Qwen3Config's head_dim: 128
    assert ModelConfig.from_hf_config({**qwen3, "architectures": ["Qwen3ForCausalLM"]}).head_dim == 128 == \
        transformers.Qwen3Config(**qwen3).head_dim
    sliding_only = {**gemma, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}
    ours = ModelConfig.from_hf_config(sliding_only)   # the full layers' rope: Gemma3TextConfig's default
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in sliding_only.items() if k != "architectures"})
    assert (ours.rope_local_theta, ours.rope_theta) == (100.0, 1e6) == \
        (theirs.rope_parameters["sliding_attention"]["rope_theta"], theirs.rope_parameters["full_attention"]["rope_theta"])
    for arch, config_class in (("LlamaForCausalLM", transformers.LlamaConfig),
                               ("Qwen3ForCausalLM", transformers.Qwen3Config),
                               ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig)):
        # without max_position_embeddings: the class's, the context served and YaRN's original context alike
        cfg = {**LLAMA, "architectures": [arch], "head_dim": 16, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        ours = ModelConfig.from_hf_config(cfg)
        theirs = config_class(**{k: v for k, v in cfg.items() if k != "architectures"})
        assert ours.max_position_embeddings == theirs.max_position_embeddings, arch
        assert ours.rope_scaling.original_max_position_embeddings == theirs.max_position_embeddings, arch
    moe = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match="^hidden_act: Qwen3-MoE's experts are served with silu only"):
        ModelConfig.from_hf_config({**moe, "hidden_act": "gelu_pytorch_tanh"})


def test_mixtral_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """Mixtral-8x7B's config: 8 experts of 14,336 on every layer, 2 a token, renormalised, their weights kept in
    float32; 46.7 B parameters. Keys a config.json leaves out read as transformers' MixtralConfig reads them
    (rope_theta 1e6, 8 KV heads, 8 experts, 2 a token, a context of 131,072, no sliding window)."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "max_position_embeddings": 32768,
            "sliding_window": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf_config(card)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 14336)
    assert cfg.norm_topk_prob and cfg.moe_float_weights and not cfg.qk_norm and cfg.sliding_window is None
    assert all(cfg.is_sparse_layer(i) for i in range(32))
    assert cfg.num_params() == 46_702_792_704
    bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.MixtralConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.rope_theta, ours.num_kv_heads, ours.num_experts, ours.num_experts_per_tok,
            ours.max_position_embeddings, ours.sliding_window) == \
        (theirs.rope_parameters["rope_theta"], theirs.num_key_value_heads, theirs.num_local_experts,
         theirs.num_experts_per_tok, theirs.max_position_embeddings, theirs.sliding_window)
    assert ModelConfig.from_hf_config({**bare, "sliding_window": 4096}).layer_window(31) == 4096
    assert ModelConfig.from_hf_config({**bare, "num_experts": 4}).num_experts == 4   # the attribute map's name
    with pytest.raises(ConfigError, match="^hidden_act: Mixtral's experts are served with silu only"):
        ModelConfig.from_hf_config({**bare, "hidden_act": "gelu_pytorch_tanh"})
    with pytest.raises(ConfigError, match="num_experts_per_tok: 3 is over num_experts 2"):
        ModelConfig.from_hf_config({**bare, "num_local_experts": 2, "num_experts_per_tok": 3})


def test_phi3_as_its_model_cards_write_it_phi4_minis_longrope_over_part_of_each_head_too():
    """Phi-3-mini-4k's config (3.82 B parameters, a window of 2,047 over every layer), Phi-4's (14.7 B) and
    Phi-4-mini's (3.84 B: a longrope over 0.75 of each head, from 4,096 positions to 131,072); keys left out read as
    transformers' Phi3Config reads them. Phi3Config reads the rope types `su` and `yarn` as its longrope: those
    spellings refused by key."""
    transformers = pytest.importorskip("transformers")
    mini = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
            "sliding_window": 2047, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf_config(mini)
    assert cfg.num_params() == 3_821_079_552 and cfg.layer_window(0) == cfg.layer_window(31) == 2047
    phi4 = {**mini, "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
            "num_attention_heads": 40, "num_key_value_heads": 10, "max_position_embeddings": 16384,
            "rope_theta": 250000.0, "sliding_window": None}
    cfg = ModelConfig.from_hf_config(phi4)
    assert cfg.num_params() == 14_659_507_200 and cfg.sliding_window is None and cfg.rope_theta == 250000.0
    bare = {k: mini[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.Phi3Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.rope_theta, ours.num_kv_heads, ours.max_position_embeddings, ours.sliding_window) == \
        (theirs.rope_parameters["rope_theta"], theirs.num_key_value_heads, theirs.max_position_embeddings,
         theirs.sliding_window)
    longrope = {"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                "long_factor": [1.0 + i for i in range(48)]}
    mini4 = {**mini, "vocab_size": 200064, "num_attention_heads": 24, "num_key_value_heads": 8,
             "max_position_embeddings": 131072, "partial_rotary_factor": 0.75, "rope_scaling": longrope,
             "sliding_window": 262144, "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf_config(mini4)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
            **{k: v for k, v in mini4.items() if k != "architectures"}))
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 3_836_021_760
    assert (cfg.rotary_dim, cfg.context_length, cfg.rope_scaling.factor) == (96, 131072, 32.0)
    assert cfg.serving([0]).rope_scaling.long and cfg.serving([4096, 2048]).rope_scaling.long is False
    assert cfg.serving([4096, 8192]).rope_scaling.long   # one pool past the original context: every sequence long
    for change, named in [({"rope_scaling": {"type": "su"}}, r"^rope_scaling\.rope_type: Phi-3 reads 'su' as"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"^rope_scaling\.rope_type: .*'yarn'"),
                          ({"rope_scaling": {**longrope, "short_factor": [1.0] * 64}},
                           r"^rope_scaling\.short_factor: longrope needs one factor a rotary frequency \(48\)")]:
        with pytest.raises(ConfigError, match=named):
            ModelConfig.from_hf_config({**mini4, **change})


# Phi-3.5-MoE-instruct's config.json (Microsoft, 2024), its LongRoPE's factors shortened to a pattern of its length
PHI35_MOE_CARD = {
    "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "bos_token_id": 1, "eos_token_id": 32000,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "input_jitter_noise": 0.01,
    "intermediate_size": 6400, "lm_head_bias": True, "max_position_embeddings": 131072, "model_type": "phimoe",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 16, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.0 + i / 2 for i in range(64)], "long_mscale": 1.243163121016122,
                     "original_max_position_embeddings": 4096, "short_factor": [1.0 + i / 64 for i in range(64)],
                     "short_mscale": 1.243163121016122, "type": "longrope"},
    "rope_theta": 10000.0, "router_jitter_noise": 0.01, "sliding_window": 131072, "tie_word_embeddings": False,
    "vocab_size": 32064}


def test_phi35_moe_as_its_model_card_writes_it_reads_as_transformers_does():
    """Phi-3.5-MoE-instruct's config (`PhiMoEForCausalLM`, the release's name for transformers' `PhimoeForCausalLM`):
    41.9 B parameters as transformers' model holds them (LayerNorms, biased attention and head, 16 experts a layer);
    SparseMixer's two picks and jitter; the LongRoPE's cos and sin those of transformers' own LongRoPE frequencies
    for the set the engine turns by (the long one where a pool serves past 4,096 positions) times that set's mscale.
    Another expert count a token, or a LongRoPE without its mscales, is refused by key."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_cos_sin_cache

    cfg = _card_as_transformers_counts(PHI35_MOE_CARD, "PhimoeConfig")
    assert round(cfg.num_params() / 1e9, 1) == 41.9
    assert (cfg.architecture, cfg.moe_router, cfg.num_experts, cfg.num_experts_per_tok, cfg.router_jitter_noise) == \
        ("PhimoeForCausalLM", "sparsemixer", 16, 2, 0.01)
    small = {**PHI35_MOE_CARD, "max_position_embeddings": 8192, "original_max_position_embeddings": 4096}
    small_theirs = transformers.PhimoeConfig(**{k: v for k, v in small.items() if k != "architectures"})
    for max_model_len, seq_len, mscale in ((4096, None, "short_mscale"), (8192, 8192, "long_mscale")):
        served = ModelConfig.from_hf_config(small).serving([max_model_len])
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](small_theirs, "cpu", seq_len=seq_len)
        freqs = torch.arange(max_model_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        factor = small_theirs.rope_parameters[mscale]
        torch.testing.assert_close(rope_cos_sin_cache(served), torch.cat((freqs.cos(), freqs.sin()), -1) * factor)
    rope = {k: v for k, v in PHI35_MOE_CARD["rope_scaling"].items() if k != "long_mscale"}
    for change, key in (({"num_experts_per_tok": 4}, "num_experts_per_tok"),
                        ({"rope_scaling": rope}, r"rope_scaling\.long_mscale")):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**PHI35_MOE_CARD, **change})


def test_gemma2_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """gemma-2-9b's config: 9.24 B parameters, every other layer sliding over 4,096 positions, scores capped at 50
    and logits at 30. A config.json that leaves keys out reads them as transformers' Gemma2Config does; a scaled
    rope is refused (the sliding layers' rope takes none)."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 3584,
            "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.num_params() == 9_241_705_984 and cfg.tie_word_embeddings and not cfg.qk_norm
    assert [cfg.layer_window(i) for i in range(3)] == [4096, None, 4096]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.attention_scale) == (50.0, 30.0, 1 / 16)
    bare = {"architectures": ["Gemma2ForCausalLM"]}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.Gemma2Config()
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers, ours.num_kv_heads, ours.head_dim,
            ours.max_position_embeddings, ours.rope_theta, ours.sliding_window, ours.attn_logit_softcapping,
            ours.final_logit_softcapping, ours.hidden_act, ours.layer_types, ours.eos_token_ids) == \
        (theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_key_value_heads,
         theirs.head_dim, theirs.max_position_embeddings, theirs.rope_parameters["rope_theta"],
         theirs.sliding_window, theirs.attn_logit_softcapping, theirs.final_logit_softcapping,
         theirs.hidden_activation, tuple(theirs.layer_types), (theirs.eos_token_id,))
    uncapped = ModelConfig.from_hf_config({**card, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert uncapped.attn_logit_softcapping is uncapped.final_logit_softcapping is None
    with pytest.raises(ConfigError, match=r"^rope_scaling\.rope_type: Gemma 2 is served with its default rope"):
        ModelConfig.from_hf_config({**card, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    from engine.models import check_dtype

    with pytest.raises(ConfigError, match=r"^dtype: Gemma 2's activations overflow float16"):
        check_dtype(cfg, torch.float16)


def test_granite_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """granite-3.3-8b's config: 8.17 B parameters (a tied head) and its four scalars; a config.json without them
    reads each as 1 (transformers' GraniteConfig), the attention scale then its own, not head_dim ** -0.5."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["GraniteForCausalLM"], "vocab_size": 49159, "hidden_size": 4096,
            "intermediate_size": 12800, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "rope_theta": 10000000.0, "tie_word_embeddings": True,
            "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
            "logits_scaling": 16.0, "rms_norm_eps": 1e-5}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.num_params() == 8_170_864_640
    assert (cfg.embedding_multiplier, cfg.attention_scale, cfg.residual_multiplier, cfg.logits_scaling) == \
        (12.0, 0.0078125, 0.22, 16.0)
    bare = {k: v for k, v in card.items() if not k.endswith(("multiplier", "scaling"))}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.GraniteConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.embedding_multiplier, ours.attention_scale, ours.residual_multiplier, ours.logits_scaling) == \
        (theirs.embedding_multiplier, theirs.attention_multiplier, theirs.residual_multiplier, theirs.logits_scaling)
    with pytest.raises(ConfigError, match="^residual_multiplier: must be a positive finite number, got 0"):
        ModelConfig.from_hf_config({**card, "residual_multiplier": 0})


def test_olmo2_as_its_model_card_writes_it_and_the_eps_each_class_defaults_to():
    """OLMo-2-1124-7B's config: 7.30 B parameters, its q/k norms a weight per channel of the whole projection. A
    config.json without rms_norm_eps takes its class's (transformers': 1e-5 for OLMo 2, Mixtral and Phi-3)."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["Olmo2ForCausalLM"], "vocab_size": 100352, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-6}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.num_params() == 7_298_617_344 and not cfg.qk_norm
    for arch, config_class in (("Olmo2ForCausalLM", transformers.Olmo2Config),
                               ("MixtralForCausalLM", transformers.MixtralConfig),
                               ("Phi3ForCausalLM", transformers.Phi3Config),
                               ("LlamaForCausalLM", transformers.LlamaConfig)):
        bare = {**LLAMA, "architectures": [arch]}
        theirs = config_class(**{k: v for k, v in bare.items() if k != "architectures"})
        assert ModelConfig.from_hf_config(bare).rms_norm_eps == theirs.rms_norm_eps, arch


def test_smollm3_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """SmolLM3-3B's config: 3.08 B parameters (a tied head), every fourth layer without rope. A config.json that
    leaves keys out reads them as transformers' SmolLM3Config does; a NoPE list of the wrong length or values is
    refused by name."""
    transformers = pytest.importorskip("transformers")
    nope = [int((i + 1) % 4 != 0) for i in range(36)]
    card = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
            "max_position_embeddings": 65536, "rope_theta": 5000000.0, "no_rope_layers": nope,
            "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.num_params() == 3_075_098_624 and cfg.no_rope_layers == tuple(nope) and cfg.sliding_window is None
    bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.SmolLM3Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.rope_theta, ours.num_kv_heads, ours.max_position_embeddings, ours.tie_word_embeddings,
            ours.no_rope_layers) == (theirs.rope_parameters["rope_theta"], theirs.num_key_value_heads,
                                     theirs.max_position_embeddings, theirs.tie_word_embeddings,
                                     tuple(theirs.no_rope_layers))
    windowed = ModelConfig.from_hf_config({**bare, "use_sliding_window": True, "sliding_window": 4096})
    assert [windowed.layer_window(i) for i in range(4)] == [None, None, None, 4096]   # on the NoPE layers
    for bad in (nope[:-1], [*nope[:-1], 2], [*nope[:-1], True]):
        with pytest.raises(ConfigError, match="^no_rope_layers: a 0 or 1 for each of the 36 layers"):
            ModelConfig.from_hf_config({**card, "no_rope_layers": bad})


def test_a_namesake_kernels_first_on_the_path_is_refused_by_name(tmp_path):
    """A module named `kernels` found before ours (Hugging Face's distribution of that name): importing the
    engine fails at once, naming it and the fix, not on a name missing deep in one of its modules."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    root = Path(engine.__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", "import engine.llm_engine"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert run.returncode == 1
    assert str(tmp_path / "kernels" / "__init__.py") in run.stderr and "pip uninstall kernels" in run.stderr


GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
               "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
               "initial_context_length": 4096, "intermediate_size": 2880,
               "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
               "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
               "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
               "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                  "model.layers.*.mlp.router", "model.embed_tokens",
                                                                  "lm_head"],
                                       "quant_method": "mxfp4"},
               "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
               "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
               "vocab_size": 201088}


def test_gpt_oss_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """gpt-oss-20b's config (MXFP4 experts, dequantized as they are read): 32 experts of 2,880 on every layer, 4 a
    token, biases and sinks, sliding and full layers alternating, YaRN over 4,096 x 32 positions; its parameter count
    is transformers' model's, built on the meta device from the same config. A config.json that leaves keys out reads
    them as GptOssConfig does; another quantization method is still refused by name."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_hf_config(GPT_OSS_20B)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.attention_sinks and cfg.moe_bias and cfg.attention_bias and cfg.swiglu_limit == 7.0
    assert [cfg.layer_window(i) for i in range(3)] == [128, None, 128] and cfg.context_length == 131072
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.truncate, cfg.rope_theta) == ("yarn", False, 150000.0)
    hf_config = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items()
                                             if k not in ("architectures", "quantization_config", "rope_scaling")},
                                          rope_parameters={**GPT_OSS_20B["rope_scaling"], "rope_theta": 150000.0})
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(hf_config)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 20_914_757_184   # "21 B"
    bare = {k: GPT_OSS_20B[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.GptOssConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    rope = theirs.rope_parameters
    assert (ours.num_kv_heads, ours.head_dim, ours.num_experts, ours.num_experts_per_tok, ours.sliding_window,
            ours.layer_types, ours.rope_theta, ours.rope_scaling.factor, ours.rope_scaling.truncate,
            ours.rope_scaling.original_max_position_embeddings, ours.max_position_embeddings, ours.rms_norm_eps,
            ours.swiglu_alpha, ours.swiglu_limit, ours.attention_bias) == \
        (theirs.num_key_value_heads, theirs.head_dim, theirs.num_local_experts, theirs.num_experts_per_tok,
         theirs.sliding_window, tuple(theirs.layer_types), rope["rope_theta"], rope["factor"], rope["truncate"],
         rope["original_max_position_embeddings"], theirs.max_position_embeddings, theirs.rms_norm_eps,
         theirs.swiglu_alpha, theirs.swiglu_limit, theirs.attention_bias)
    with pytest.raises(ConfigError, match=r"^quantization_config: quantized checkpoints \(hqq\) are not supported"):
        ModelConfig.from_hf_config({**GPT_OSS_20B, "quantization_config": {"quant_method": "hqq"}})
    with pytest.raises(ConfigError, match=r"^quantization_config: quantized checkpoints \(mxfp4\) are not supported"):
        ModelConfig.from_hf_config({**LLAMA, "quantization_config": {"quant_method": "mxfp4"}})


def test_qwen2_moe_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """Qwen1.5-MoE-A2.7B's config: 60 experts of 1,408, 4 a token, a shared expert of 5,632 on every layer, q/k/v
    biases; its parameter count is transformers' model's, built on the meta device from the same config. Keys left
    out read as Qwen2MoeConfig reads them, its sliding rule too; a tensor-parallel size that does not divide the
    shared expert is refused by name."""
    transformers = pytest.importorskip("transformers")
    from engine.parallel import ShardShape

    card = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
            "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
            "max_position_embeddings": 8192, "rope_theta": 1000000.0, "use_sliding_window": False,
            "sliding_window": 32768, "max_window_layers": 21, "tie_word_embeddings": False, "rms_norm_eps": 1e-06}
    cfg = ModelConfig.from_hf_config(card)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (60, 4, 1408, 5632)
    assert cfg.attention_bias and not cfg.qk_norm and not cfg.norm_topk_prob and cfg.sliding_window is None
    with torch.device("meta"):
        hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **{k: v for k, v in card.items() if k != "architectures"}))
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 14_315_784_192   # "14.3 B"
    bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours, theirs = ModelConfig.from_hf_config(bare), transformers.Qwen2MoeConfig(
        **{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.num_kv_heads, ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size,
            ours.shared_expert_intermediate_size, ours.norm_topk_prob, ours.max_position_embeddings,
            ours.attention_bias) == (theirs.num_key_value_heads, theirs.num_experts, theirs.num_experts_per_tok,
                                     theirs.moe_intermediate_size, theirs.shared_expert_intermediate_size,
                                     theirs.norm_topk_prob, theirs.max_position_embeddings, theirs.qkv_bias)
    sliding = {**bare, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 3}
    kinds = transformers.Qwen2MoeConfig(**{k: v for k, v in sliding.items() if k != "architectures"}).layer_types
    assert ModelConfig.from_hf_config(sliding).layer_types == tuple(kinds)
    assert ModelConfig.from_hf_config({**bare, "qkv_bias": False}).attention_bias is False
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 3 does not divide the model's "
                                          "shared_expert_intermediate_size 5632"):
        ShardShape.of(ModelConfig.from_hf_config({**card, "num_attention_heads": 24, "num_key_value_heads": 24,
                                                  "head_dim": 64, "intermediate_size": 5631,
                                                  "moe_intermediate_size": 1407}), 0, 3)


def test_cohere_as_its_model_cards_write_it_and_its_defaults_as_transformers_reads_them():
    """Command R's config (35 B parameters, one LayerNorm a layer, a tied head, logits times 0.0625) and Command
    R7B's (sliding layers with rope, every 4th full without); each parameter count is transformers' model's, built
    on the meta device from the same config, Command R+'s per-head q/k norms too. Keys left out read as CohereConfig
    / Cohere2Config read them."""
    transformers = pytest.importorskip("transformers")
    command_r = {"architectures": ["CohereForCausalLM"], "vocab_size": 256000, "hidden_size": 8192,
                 "intermediate_size": 22528, "num_hidden_layers": 40, "num_attention_heads": 64,
                 "num_key_value_heads": 64, "max_position_embeddings": 131072, "rope_theta": 8000000.0,
                 "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "use_qk_norm": False}
    r7b = {"architectures": ["Cohere2ForCausalLM"], "vocab_size": 256000, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 8192, "rope_theta": 50000.0, "layer_norm_eps": 1e-05, "logit_scale": 0.25,
           "sliding_window": 4096, "sliding_window_pattern": 4}
    for card, config_class, model_class in ((command_r, "CohereConfig", "CohereForCausalLM"),
                                            (r7b, "Cohere2Config", "Cohere2ForCausalLM")):
        cfg = ModelConfig.from_hf_config(card)
        with torch.device("meta"):
            hf = getattr(transformers, model_class)(getattr(transformers, config_class)(
                **{k: v for k, v in card.items() if k != "architectures"}))
        assert cfg.num_params() == sum(p.numel() for p in hf.parameters()), model_class
        assert cfg.tie_word_embeddings and cfg.logit_scale == card["logit_scale"]
        bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads")}
        ours, theirs = ModelConfig.from_hf_config(bare), getattr(transformers, config_class)(
            **{k: v for k, v in bare.items() if k != "architectures"})
        assert (ours.logit_scale, ours.rms_norm_eps, ours.max_position_embeddings, ours.num_kv_heads,
                ours.tie_word_embeddings) == (theirs.logit_scale, theirs.layer_norm_eps, theirs.max_position_embeddings,
                                              theirs.num_key_value_heads or theirs.num_attention_heads,
                                              theirs.tie_word_embeddings), model_class
        if model_class == "Cohere2ForCausalLM":
            assert ours.layer_types == tuple(theirs.layer_types) and ours.sliding_window == theirs.sliding_window
            assert ours.no_rope_layers == tuple(int(t == "sliding_attention") for t in theirs.layer_types)
    assert ModelConfig.from_hf_config(command_r).num_params() == 34_980_831_232   # "35 B"
    plus = {**command_r, "use_qk_norm": True, "num_key_value_heads": 8, "num_hidden_layers": 2}
    with torch.device("meta"):
        hf = transformers.CohereForCausalLM(transformers.CohereConfig(
            **{k: v for k, v in plus.items() if k != "architectures"}))
    assert ModelConfig.from_hf_config(plus).num_params() == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_hf_config(plus).qk_norm
    assert not ModelConfig.from_hf_config({**r7b, "use_qk_norm": True}).qk_norm   # Cohere2Config reads no such key


def test_ernie45_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """ERNIE-4.5-0.3B's config: its parameter count is transformers' model's, built on the meta device from the same
    config (every projection biased where `use_bias`, a tied head). Keys left out read as Ernie4_5Config reads them."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["Ernie4_5ForCausalLM"], "vocab_size": 103424, "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 18, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": True, "use_bias": False}
    for use_bias in (False, True):
        cfg = ModelConfig.from_hf_config({**card, "use_bias": use_bias})
        with torch.device("meta"):
            hf = transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(
                **{k: v for k, v in card.items() if k not in ("architectures", "use_bias")}, use_bias=use_bias))
        assert cfg.num_params() == sum(p.numel() for p in hf.parameters()), use_bias
        assert cfg.attention_bias == cfg.mlp_bias == use_bias
    assert ModelConfig.from_hf_config(card).num_params() == 360_748_032   # "0.36 B"
    bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    theirs = transformers.Ernie4_5Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.num_kv_heads, ours.head_dim, ours.rope_theta, ours.rms_norm_eps, ours.max_position_embeddings,
            ours.tie_word_embeddings) == (theirs.num_key_value_heads, theirs.head_dim,
                                          theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps,
                                          theirs.max_position_embeddings, theirs.tie_word_embeddings)


def test_glm4_as_its_model_card_writes_it_and_its_defaults_as_transformers_reads_them():
    """GLM-4-9B-0414's config: its parameter count is transformers' model's, built on the meta device from the same
    config (four norms a layer, q/k/v biases); half of each head rotated: the engine's frequencies are GLM's for
    the rotated half and zero after. Keys left out read as Glm4Config reads them; beside a scaled rope (linear,
    dynamic, YaRN, Llama 3's) the frequencies and attention factor are transformers' over the rotated half."""
    transformers = pytest.importorskip("transformers")
    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    card = {"architectures": ["Glm4ForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
            "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
            "head_dim": 128, "partial_rotary_factor": 0.5, "max_position_embeddings": 32768, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-05, "attention_bias": True, "tie_word_embeddings": False, "pad_token_id": 151329}
    cfg = ModelConfig.from_hf_config(card)
    hf_config = transformers.Glm4Config(**{k: v for k, v in card.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.Glm4ForCausalLM(hf_config)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 9_400_279_040   # "9.4 B"
    assert cfg.rotary_dim == 64 and cfg.attention_bias
    theirs = transformers.models.glm4.modeling_glm4.Glm4RotaryEmbedding(hf_config).inv_freq
    torch.testing.assert_close(rope_inv_freq(cfg), torch.cat([theirs, torch.zeros(32)]))
    bare = {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads")}
    ours = ModelConfig.from_hf_config(bare)
    default = transformers.Glm4Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert (ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps, ours.attention_bias, ours.partial_rotary_factor,
            ours.max_position_embeddings) == (default.num_key_value_heads, default.head_dim, default.rms_norm_eps,
                                              default.attention_bias, default.rope_parameters["partial_rotary_factor"],
                                              default.max_position_embeddings)
    # a scaled rope over the turned half: each type's frequencies and attention factor transformers' own
    for scaling in ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
                    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0}):
        cfg = ModelConfig.from_hf_config({**card, "rope_scaling": scaling})
        params = {**scaling, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        hf_config = transformers.Glm4Config(**{**{k: v for k, v in card.items() if k != "architectures"},
                                               "rope_parameters": params})
        theirs = transformers.models.glm4.modeling_glm4.Glm4RotaryEmbedding(hf_config)
        assert cfg.rotary_dim == 64, scaling
        torch.testing.assert_close(rope_inv_freq(cfg), torch.cat([theirs.inv_freq, torch.zeros(32)]), msg=str(scaling))
        assert rope_attention_factor(cfg) == pytest.approx(theirs.attention_scaling), scaling


DEEPSEEK_V3_CARD = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-06, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "hidden_act": "silu", "attention_bias": False}
DEEPSEEK_V2_LITE_CARD = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "routed_scaling_factor": 1.0, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "hidden_act": "silu", "attention_bias": False}


def _meta_model(config_class, card: dict):
    """(transformers' config of `card`, its model built on the meta device: shapes without memory)."""
    import transformers

    hf_config = config_class(**{k: v for k, v in card.items() if k != "architectures"})
    with torch.device("meta"):
        return hf_config, transformers.AutoModelForCausalLM.from_config(hf_config)


def _card_as_transformers_counts(card: dict, config_class: str, theirs: dict | None = None) -> ModelConfig:
    """Our reading of a model card's config.json, its parameter count checked against transformers' model of it
    (`config_class`, built on the meta device from `theirs` where its strict types want another spelling)."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(getattr(transformers, config_class), theirs or card)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    return cfg


def _params_and_router_biases(hf) -> int:
    """transformers' parameter count, plus its routers' correction biases (buffers there, parameters here)."""
    buffers = sum(b.numel() for name, b in hf.named_buffers() if name.endswith(("e_score_correction_bias", "tid2eid")))
    return sum(p.numel() for p in hf.parameters()) + buffers


def _at_class_defaults(config_class: str, bare: dict):
    """(transformers' config class `config_class` at its defaults, our reading of `bare` with its sizes), the parameter
    count checked against transformers' model (built on the meta device)."""
    transformers = pytest.importorskip("transformers")

    hf_config, hf = _meta_model(getattr(transformers, config_class), bare)
    cfg = ModelConfig.from_hf_config(bare | {k: getattr(hf_config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")})
    assert cfg.num_params() == _params_and_router_biases(hf)
    return hf_config, cfg


@pytest.mark.parametrize("card,billions", [(DEEPSEEK_V3_CARD, 671.0), (DEEPSEEK_V2_LITE_CARD, 15.7)],
                         ids=["v3", "v2-lite"])
def test_deepseek_as_its_model_cards_write_it_reads_as_transformers_does(card, billions):
    """DeepSeek-V3's and DeepSeek-V2-Lite's configs: the parameter count is transformers' model's (built on the meta
    device from the same config; plus V3's correction biases, buffers there), 671 B and 15.7 B as DeepSeek states
    them; the cache holds one latent and rotated key a token (576 values a layer, not 2 x 128 heads x 192); the
    attention scale is transformers' (YaRN's mscale_all_dim squared), the rotary's frequencies and factor too."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    cfg = ModelConfig.from_hf_config(card)
    v3 = card["architectures"][0] == "DeepseekV3ForCausalLM"
    hf_config, hf = _meta_model(transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config, card)
    assert cfg.num_params() == _params_and_router_biases(hf)
    assert round(cfg.num_params() / 1e9, 1) == billions
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_planes) == (1, 576, 1)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == card["num_hidden_layers"] * 576 * 2
    assert cfg.mlp_only_layers == tuple(range(card["first_k_dense_replace"]))
    attention = hf.model.layers[0].self_attn
    assert cfg.attention_scale == pytest.approx(attention.scaling, rel=1e-12)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    rope = dataclasses.replace(cfg, head_dim=64)   # the rotary's: engine.models.deepseek's make_rotary
    torch.testing.assert_close(rope_inv_freq(rope), inv_freq)
    assert rope_attention_factor(rope) == pytest.approx(factor)
    assert cfg.context_length == 163840 and cfg.rotary_cache_bytes(torch.bfloat16) == 163840 * 64 * 2


@pytest.mark.parametrize("change,named", [
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 1, "num_experts_per_tok": 40}, "n_group"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
])
def test_what_we_do_not_serve_of_deepseek_is_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**DEEPSEEK_V3_CARD, **change})


def test_glm4_5_air_as_its_model_card_writes_it_reads_as_transformers_does():
    """GLM-4.5-Air's config: the parameter count is transformers' model's on the meta device (plus the routers'
    correction biases, buffers there), 106.9 B (Z.ai states 106 B); half of each head rotated, q/k/v biases; DeepSeek
    V3's router and shared expert; its MTP layer is not counted (transformers builds none)."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "head_dim": 128, "hidden_size": 4096,
            "partial_rotary_factor": 0.5, "intermediate_size": 10944, "max_position_embeddings": 131072,
            "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
            "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
            "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
            "use_qk_norm": False, "vocab_size": 151552, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.num_params() == _params_and_router_biases(_meta_model(transformers.Glm4MoeConfig, card)[1])
    assert round(cfg.num_params() / 1e9, 1) == 106.9
    assert (cfg.rotary_dim, cfg.moe_router, cfg.mlp_only_layers, cfg.shared_expert_intermediate_size) == \
        (64, "deepseek_v3", (0,), 1408)
    with pytest.raises(ConfigError, match="n_group"):
        ModelConfig.from_hf_config({**card, "n_group": 3})


MINIMAX_M2_CARD = {
    "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "max_position_embeddings": 196608, "num_attention_heads": 48,
    "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
    "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


def test_minimax_m2_as_its_model_card_writes_it_reads_as_transformers_does():
    """MiniMax-M2's config (its FP8 quantization_config left out: the engine serves a bfloat16 copy): the parameter
    count is transformers' model's on the meta device (plus the routers' correction biases, buffers there), 229 B
    (MiniMax states 230 B); half of each head rotated (`rotary_dim` 64); the keys transformers reads otherwise are
    refused by name."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_hf_config(MINIMAX_M2_CARD)
    assert cfg.num_params() == _params_and_router_biases(_meta_model(transformers.MiniMaxM2Config, MINIMAX_M2_CARD)[1])
    assert round(cfg.num_params() / 1e9) == 229
    assert (cfg.rotary_dim, cfg.moe_router, cfg.num_experts, cfg.moe_intermediate_size, cfg.rope_theta) == \
        (64, "minimax_m2", 256, 1536, 5e6)
    for change in ({"qk_norm_type": "per_head"}, {"use_qk_norm": False}, {"scoring_func": "softmax"},
                   {"shared_intermediate_size": 1024}):
        with pytest.raises(ConfigError, match="qk_norm_type" if "qk" in str(change) else "scoring_func"):
            ModelConfig.from_hf_config({**MINIMAX_M2_CARD, **change})


def test_olmo3_reads_each_layer_types_rope_as_transformers_does():
    """OLMo 3's config as its long-context releases write it (a legacy `rope_scaling` with `rope_theta`): the full
    layers take the YaRN, the sliding ones the default rope at the same base, every 4th layer full; the per-type
    form reads the same; the parameter count is transformers' model's."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_inv_freq

    card = {"architectures": ["Olmo3ForCausalLM"], "vocab_size": 100278, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-06, "rope_theta": 500000, "sliding_window": 4096,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1},
            "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf_config(card)
    hf_config, hf = _meta_model(transformers.Olmo3Config, card)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    assert cfg.layer_types == tuple(hf_config.layer_types) and cfg.layer_types[3] == "full_attention"
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.rope_scaling.rope_type) == (4096, 500000.0, "yarn")
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu", layer_type="full_attention")
    torch.testing.assert_close(rope_inv_freq(cfg), theirs)
    assert cfg.rope_scaling.attention_factor == factor
    per_type = {k: v for k, v in card.items() if k not in ("rope_scaling", "rope_theta")}
    per_type["rope_parameters"] = {"full_attention": {**card["rope_scaling"], "rope_theta": 500000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
    assert ModelConfig.from_hf_config(per_type) == cfg


def test_ernie4_5_moe_as_its_model_card_writes_it_and_its_sparse_layers_as_transformers_reads_them():
    """ERNIE-4.5-21B-A3B's config: 21.8 B parameters (transformers' own model's count, the routers' correction biases
    with them), 64 experts of 1536, 6 a token, two shared, every layer past the first sparse; the sparse layers as
    transformers' decoder layers pick them (an interval and an end); biases refused by key."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 103424, "hidden_size": 2560,
            "intermediate_size": 12288, "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "use_bias": False,
            "tie_word_embeddings": True, "moe_num_experts": 64, "moe_k": 6, "moe_intermediate_size": 1536,
            "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_interval": 1}
    for change in ({}, {"moe_layer_interval": 2, "moe_layer_end_index": 20, "num_hidden_layers": 24}):
        config = {**card, **change}
        ours = ModelConfig.from_hf_config(config)
        theirs = transformers.Ernie4_5_MoeConfig(**{k: v for k, v in config.items() if k != "architectures"})
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(theirs)
        assert ours.num_params() == sum(p.numel() for p in hf.parameters())
        assert [ours.is_sparse_layer(i) for i in range(ours.num_layers)] == [
            type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert ModelConfig.from_hf_config(card).num_params() == 21_825_437_888
    with pytest.raises(ConfigError, match=r"^use_bias: ERNIE 4.5's MoE models are served without biases"):
        ModelConfig.from_hf_config({**card, "use_bias": True})


def test_seed_oss_as_its_model_card_writes_it_and_its_biases_as_transformers_reads_them():
    """Seed-OSS-36B's config: 36.2 B parameters (transformers' own model's count), 80 heads of 128 over a hidden size
    of 5120, q/k/v biased and o_proj not; keys left out read as SeedOssConfig reads them."""
    transformers = pytest.importorskip("transformers")
    card = {"architectures": ["SeedOssForCausalLM"], "vocab_size": 155136, "hidden_size": 5120,
            "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 80, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 524288, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
            "attention_bias": True, "attention_out_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    for config in (card, {k: card[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                               "num_hidden_layers", "num_attention_heads")}):
        ours = ModelConfig.from_hf_config(config)
        theirs = transformers.SeedOssConfig(**{k: v for k, v in config.items() if k != "architectures"})
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(theirs)
        assert ours.num_params() == sum(p.numel() for p in hf.parameters())
        assert (ours.head_dim, ours.num_kv_heads, ours.attention_bias, ours.o_proj_bias) == (
            theirs.head_dim, theirs.num_key_value_heads, theirs.attention_bias, theirs.attention_out_bias)
    assert ModelConfig.from_hf_config(card).num_params() == 36_151_104_512


# Llama 4 Scout's text_config as its model card writes it (the keys the engine reads; its no_rope_layers empty: the
# default rule, and attn_temperature_tuning 4: on)
LLAMA4_SCOUT_TEXT = {
    "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "moe_layers": list(range(48)), "no_rope_layers": [], "attention_chunk_size": 8192, "attn_temperature_tuning": 4,
    "floor_scale": 8192, "attn_scale": 0.1, "use_qk_norm": True, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 10485760, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False}


def test_llama4_scout_as_its_model_card_writes_it_reads_as_transformers_does():
    """Llama 4 Scout's multimodal config served as its text model: 107.8 B parameters (transformers' own text model's
    count: 16 experts and a shared one on every layer), chunks of 8,192 on three layers of four, every fourth NoPE
    with its queries' temperature; the llama3 rope with equal frequency factors is transformers'. Maverick's rule
    (dense and sparse layers alternating) and the defaults read as Llama4TextConfig reads them."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_inv_freq

    card = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": LLAMA4_SCOUT_TEXT,
            "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408}}
    cfg = ModelConfig.from_hf_config(card)
    assert (cfg.architecture, cfg.text_weights_prefix, cfg.stacked_experts) == ("Llama4ForCausalLM", "language_model.",
                                                                                 True)
    text = {**LLAMA4_SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"], "attn_temperature_tuning": True}
    del text["model_type"]   # (transformers 5's strict class takes true alone)
    hf_config, hf = _meta_model(transformers.Llama4TextConfig, text)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) == 107_769_861_120
    assert cfg.layer_types == tuple(hf_config.layer_types) and cfg.no_rope_layers == tuple(hf_config.no_rope_layers)
    assert [cfg.layer_chunk(i) for i in range(4)] == [8192, 8192, 8192, None]
    assert [cfg.layer_window(i) for i in range(4)] == [None] * 4
    assert (cfg.attn_temperature, cfg.qk_l2_norm, cfg.eos_token_ids) == ((8192.0, 0.1), True, (200001, 200007, 200008))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), inv_freq)
    bare = {k: text[k] for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads")} | {"interleave_moe_layer_step": 2}
    ours, (theirs, hf) = ModelConfig.from_hf_config(bare), _meta_model(transformers.Llama4TextConfig, bare)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert [ours.is_sparse_layer(i) for i in range(ours.num_layers)] == [
        i in theirs.moe_layers for i in range(theirs.num_hidden_layers)]
    assert (ours.intermediate_size, ours.moe_intermediate_size, ours.num_experts, ours.attention_chunk_size,
            ours.head_dim, ours.rope_theta) == (theirs.intermediate_size_mlp, theirs.intermediate_size,
                                                theirs.num_local_experts, theirs.attention_chunk_size,
                                                theirs.head_dim, theirs.rope_parameters["rope_theta"])


@pytest.mark.parametrize("change,named", [
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 48}, "attention_chunk_size"),
    ({"attention_chunk_size": 0}, "attention_chunk_size"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"moe_layers": [48]}, "moe_layers"),
    ({"layer_types": "chunked_attention"}, "layer_types"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"attn_temperature_tuning": "yes"}, "attn_temperature_tuning"),
])
def test_what_we_do_not_serve_of_llama4_is_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=f"^text_config.{named}"):
        ModelConfig.from_hf_config({"architectures": ["Llama4ForConditionalGeneration"],
                                    "text_config": {**LLAMA4_SCOUT_TEXT, **change}})


def test_the_rotary_cache_holds_the_positions_the_pools_serve():
    """An engine's rotary table holds its longest pool's positions, not the model's whole context (Scout's 10,485,760
    rows would be 2.7 GB in bfloat16); the rows it holds are the whole table's, and the capacity plan counts them."""
    from engine.layers.rotary import rope_cos_sin_cache

    scout = ModelConfig.from_hf_config({"architectures": ["Llama4ForConditionalGeneration"],
                                        "text_config": LLAMA4_SCOUT_TEXT})
    assert scout.context_length == 10_485_760
    assert scout.serving([8192, 131072]).rotary_cache_bytes(torch.bfloat16) == 131072 * 128 * 2
    for whole in ([0], [8192, None], []):   # a pool of the model's context: every row
        assert scout.serving(whole).rotary_positions == 0
        assert scout.serving(whole).rotary_cache_bytes(torch.bfloat16) == 10_485_760 * 128 * 2
    small = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
                                        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                                        "max_position_embeddings": 4096})
    table = rope_cos_sin_cache(small.serving([100]))
    assert table.shape == (100, 16)
    torch.testing.assert_close(table, rope_cos_sin_cache(small)[:100], rtol=0, atol=0)


def test_ministral3_reads_as_transformers_does_and_its_mistral3_checkpoint_serves_it():
    """Ministral3Config's defaults (Ministral-3-8B's shape: 34 layers, YaRN x 16 from 16,384 positions, the queries'
    llama_4_scaling_beta 0.1) read as transformers reads them: the parameter count of its model, the rotary's
    frequencies and factor; a Mistral3ForConditionalGeneration whose text_config is ministral3 serves it (its text
    keys under text_config.), a mistral one Mistral's."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    bare = {"architectures": ["Ministral3ForCausalLM"]}
    ours = ModelConfig.from_hf_config(bare | {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
                                              "num_hidden_layers": 34, "num_attention_heads": 32})
    theirs, hf = _meta_model(transformers.Ministral3Config, bare)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.num_kv_heads, ours.head_dim, ours.context_length, ours.sliding_window, ours.llama4_scaling_beta) == (
        theirs.num_key_value_heads, theirs.head_dim, 262144, None, 0.1)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    torch.testing.assert_close(rope_inv_freq(ours), inv_freq)
    assert rope_attention_factor(ours) == pytest.approx(factor)
    text = {"model_type": "ministral3", "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 34, "num_attention_heads": 32}
    for model_type, arch in (("ministral3", "Ministral3ForCausalLM"), ("mistral", "MistralForCausalLM")):
        served = ModelConfig.from_hf_config({"architectures": ["Mistral3ForConditionalGeneration"],
                                             "text_config": {**text, "model_type": model_type}})
        assert (served.architecture, served.text_weights_prefix) == (arch, "language_model.")
    with pytest.raises(ConfigError, match=r"^text_config\.rope_parameters\.llama_4_scaling_beta"):
        ModelConfig.from_hf_config({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {
            **text, "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "llama_4_scaling_beta": "0.1"}}})


def test_deepseek_v3_2_reads_as_transformers_does():
    """DeepseekV32Config's defaults (DeepSeek-V3.2's shape: V3's 61 layers and experts, each attention sparse through
    an indexer of 64 heads of 128 picking 2,048 tokens): the parameter count is transformers' model's (plus its
    routers' correction biases), the indexers' head weights float32 beside the routers; a cache row is the latent,
    the rotated key and the indexer's key (704 values a layer); the attention scale is transformers'. Another
    layer type, one q projection, or an indexer narrower than the rotary are refused by name."""
    transformers = pytest.importorskip("transformers")

    bare = {"architectures": ["DeepseekV32ForCausalLM"]}
    cfg = ModelConfig.from_hf_config(bare)
    hf_config, hf = _meta_model(transformers.DeepseekV32Config, bare)
    assert cfg.num_params() == _params_and_router_biases(hf)
    assert round(cfg.num_params() / 1e9) == 672
    float32 = sum(p.numel() for name, p in hf.named_parameters()
                  if name.endswith(("gate.weight", "weights_proj.weight")))
    assert cfg.num_float32_params == float32 + sum(b.numel() for name, b in hf.named_buffers()
                                                   if name.endswith("e_score_correction_bias"))
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_planes, cfg.mla.index_topk) == (1, 704, 1, 2048)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 61 * 704 * 2
    assert cfg.mlp_only_layers == (0, 1, 2)
    assert cfg.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    for change, named in (({"layer_types": ["full_attention"] * 61}, "layer_types"), ({"q_lora_rank": None},
                          "q_lora_rank"), ({"index_head_dim": 32}, "index_head_dim")):
        with pytest.raises(ConfigError, match=f"^{named}: "):
            ModelConfig.from_hf_config(bare | change)


@pytest.mark.parametrize("pattern", [None, {"index_topk_pattern": "FFS" * 26}, {"index_topk_freq": 4}])
def test_glm_5_reads_as_transformers_does(pattern):
    """GlmMoeDsaConfig's defaults (GLM-5's shape: 78 layers of latent attention with heads of 192 + 64, values of 256,
    an indexer of 32 heads of 128; 256 experts, 8 a token, 3 dense layers first; 744 B parameters) and its indexer
    schedules (each layer's own by default; `index_topk_pattern`'s S and the layers `index_topk_freq` skips reuse an
    earlier one's choice: no indexer of their own): the parameter count is transformers' model's, the shared layers
    are transformers'. A first layer without an indexer is refused by name."""
    transformers = pytest.importorskip("transformers")

    bare = {"architectures": ["GlmMoeDsaForCausalLM"], **(pattern or {})}
    cfg = ModelConfig.from_hf_config(bare)
    hf_config, hf = _meta_model(transformers.GlmMoeDsaConfig, bare)
    assert cfg.num_params() == _params_and_router_biases(hf)
    assert cfg.mla.index_shared == tuple(i for i, kind in enumerate(hf_config.indexer_types) if kind == "shared")
    assert (pattern is None) == (cfg.mla.index_shared == ())
    if pattern is None:
        assert round(cfg.num_params() / 1e9) == 744
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.mla.index_heads, cfg.mla.index_rope_interleave) == (704, 1e-5, 32, True)
    with pytest.raises(ConfigError, match=r"^indexer_types: full or shared for each of the 78 layers, the first full"):
        ModelConfig.from_hf_config(bare | {"indexer_types": ["shared"] + ["full"] * 77})


def test_mistral_small_4_reads_as_transformers_does_and_its_mistral3_checkpoint_serves_it():
    """Mistral4Config's defaults (Mistral Small 4's shape: 36 layers of DeepSeek V3's latent attention, a latent of 256
    and a rotated key of 64 (320 values a layer in the cache), 128 experts of 2,048, 4 a token beside a shared one;
    YaRN x 128 from 8,192 positions and the queries' llama_4_scaling_beta 0.1) read as transformers reads them: the
    parameter count of its model (119 B, as the name says), the attention scale, the rotary's frequencies and factor;
    a Mistral3ForConditionalGeneration whose text_config is mistral4 serves it. A rope turning another share of each
    head than qk_rope_head_dim is refused by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import rope_attention_factor, rope_inv_freq

    ours = ModelConfig.from_hf_config({"architectures": ["Mistral4ForCausalLM"]})
    theirs = transformers.Mistral4Config()
    with torch.device("meta"):   # transformers' auto class maps no causal LM to Mistral4Config: the class itself
        hf = transformers.Mistral4ForCausalLM(theirs)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(ours.num_params() / 1e9) == 119
    assert (ours.num_kv_heads, ours.head_dim, ours.kv_bytes_per_token(torch.bfloat16)) == (1, 320, 36 * 320 * 2)
    assert (ours.moe_router, ours.num_experts, ours.num_experts_per_tok, ours.llama4_scaling_beta) == (
        "mistral4", 128, 4, 0.1)
    assert ours.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    rope = dataclasses.replace(ours, head_dim=64)   # the rotary's: engine.models.deepseek's make_rotary
    torch.testing.assert_close(rope_inv_freq(rope), inv_freq)
    assert rope_attention_factor(rope) == pytest.approx(factor)
    served = ModelConfig.from_hf_config({"architectures": ["Mistral3ForConditionalGeneration"],
                                         "text_config": {"model_type": "mistral4"}})
    assert (served.architecture, served.text_weights_prefix, served.num_params()) == (
        "Mistral4ForCausalLM", "language_model.", ours.num_params())
    rope_parameters = {**theirs.rope_parameters, "partial_rotary_factor": 1.0}
    with pytest.raises(ConfigError, match=r"^rope_parameters\.partial_rotary_factor: Mistral 4 turns qk_rope_head_dim"):
        ModelConfig.from_hf_config({"architectures": ["Mistral4ForCausalLM"], "rope_parameters": rope_parameters})
    with pytest.raises(ConfigError, match=r"^hidden_act: Mistral 4"):
        ModelConfig.from_hf_config({"architectures": ["Mistral4ForCausalLM"], "hidden_act": "gelu"})


def test_glm4_7_flash_reads_as_transformers_does():
    """GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, Glm4MoeLiteConfig's defaults: its shape): DeepSeek V3's latent attention
    (a latent of 512 and a rotated key of 64: 576 values a layer in the cache) and router, 64 experts of 1,536, 4 a
    token beside a shared one, the first layer dense; the parameter count is transformers' model's. Dense layers
    after a sparse one are refused by name."""
    bare = {"architectures": ["Glm4MoeLiteForCausalLM"]}
    hf_config, cfg = _at_class_defaults("Glm4MoeLiteConfig", bare)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.mlp_only_layers,
            cfg.routed_scaling_factor, cfg.kv_planes, cfg.head_dim) == (64, 4, 1536, (0,), 1.8, 1, 576)
    assert cfg.mla.q_lora_rank == 768 and cfg.mla.v_head_dim == 256 and cfg.mla.qk_nope_head_dim == 192
    layers = hf_config.num_hidden_layers
    assert ModelConfig.from_hf_config({**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 3, "num_attention_heads": 4,
                                       "mlp_layer_types": ["dense", "dense", "sparse"]}).mlp_only_layers == (0, 1)
    with pytest.raises(ConfigError, match="^mlp_layer_types: dense layers first"):
        ModelConfig.from_hf_config({**bare, "num_hidden_layers": layers, "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 128, "num_attention_heads": 4,
                                    "mlp_layer_types": ["sparse", "dense"] + ["sparse"] * (layers - 2)})


def test_k_exaone_reads_as_transformers_does():
    """K-EXAONE (`ExaoneMoeForCausalLM`, ExaoneMoeConfig's defaults): EXAONE 4's attention (every 4th layer full and
    NoPE, the others sliding over 4,096 with a rotary; q/k normed per head), DeepSeek V3's router over `num_experts`
    (64 of 1,024, 8 a token, times 2.5) beside `num_shared_experts` (1), the first layer dense; the parameter count is
    transformers' model's. Dense layers after a sparse one, too many experts a token for the groups, and another
    activation are refused by name."""
    bare = {"architectures": ["ExaoneMoeForCausalLM"]}
    _, cfg = _at_class_defaults("ExaoneMoeConfig", bare)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.mlp_only_layers,
            cfg.routed_scaling_factor, cfg.shared_expert_intermediate_size, cfg.moe_router) == (
        64, 8, 1024, (0,), 2.5, 1024, "deepseek_v3")
    assert cfg.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",) and cfg.sliding_window == 4096
    assert cfg.no_rope_layers[:4] == (1, 1, 1, 0) and cfg.qk_norm and cfg.num_kv_heads == 32
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "num_attention_heads": 4}
    for change, key in (({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
                        ({"num_experts": 8, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "n_group"),
                        ({"num_experts": 0}, "num_experts"), ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, **change})


def test_command_a_plus_reads_as_transformers_does():
    """Command A Plus (`Cohere2MoeForCausalLM`, Cohere2MoeConfig's defaults): Cohere 2's layers (every 4th full and
    NoPE, the others sliding over 4,096 with a rotary; Cohere's LayerNorm, a tied head, logits x 0.0625), every MLP 8
    experts of 22,528, 2 a token; the parameter count is transformers' model's. Dense first layers (full, rotating,
    `prefix_dense_intermediate_size` wide) and shared experts where the config names them; a router or a combination
    transformers does not define, and another activation, are refused by name."""
    bare = {"architectures": ["Cohere2MoeForCausalLM"]}
    _, cfg = _at_class_defaults("Cohere2MoeConfig", bare)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.mlp_only_layers,
            cfg.tie_word_embeddings, cfg.logit_scale, cfg.moe_router) == (8, 2, 22_528, (), True, 0.0625, "cohere2_moe")
    assert cfg.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",) and cfg.no_rope_layers[:4] == (
        1, 1, 1, 0) and not cfg.cohere_moe.rms_norm and cfg.cohere_moe.shared_average
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 5,
             "num_attention_heads": 4, "head_dim": 16}
    cfg = ModelConfig.from_hf_config({**small, "first_k_dense_replace": 1, "prefix_dense_intermediate_size": 96,
                                      "num_shared_experts": 2, "rms_norm_eps": 1e-6})
    assert (cfg.mlp_only_layers, cfg.intermediate_size, cfg.shared_expert_intermediate_size, cfg.rms_norm_eps) == (
        (0,), 96, 64, 1e-6) and cfg.cohere_moe.rms_norm
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                               "full_attention") and cfg.no_rope_layers == (1, 1, 1, 1, 0)
    for change, key in (({"expert_selection_fn": "sparsemax"}, "expert_selection_fn"),
                        ({"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy"),
                        ({"hidden_act": "gelu"}, "hidden_act"), ({"mlp_layer_types": ["dense"]}, "mlp_layer_types")):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, **change})


def test_jais2_reads_as_transformers_does():
    """Jais 2 (`Jais2ForCausalLM`, Jais2Config's defaults: the 8B's shape): LayerNorms of a weight and a bias, an
    ungated squared-ReLU MLP, every projection biased; the parameter count is transformers' model's."""
    _, cfg = _at_class_defaults("Jais2Config", {"architectures": ["Jais2ForCausalLM"]})
    assert (cfg.hidden_act, cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.rms_norm_eps) == (
        "relu2", True, True, True, 1e-5)
    assert 8.0e9 < cfg.num_params() < 8.2e9


def test_granite_swa_reads_as_transformers_does():
    """Granite SWA (`GraniteSWAForCausalLM`, GraniteSWAConfig's defaults: granite-swash-2b's shape): every 4th layer
    full from the first, the others sliding over 128, a sink per query head on every layer, the model's rope base on
    every layer; the parameter count is transformers' model's. A `layer_rope_theta` not one base a layer is refused
    by name."""
    bare = {"architectures": ["GraniteSWAForCausalLM"]}
    _, cfg = _at_class_defaults("GraniteSWAConfig", bare)
    assert cfg.layer_types[:4] == ("full_attention",) + ("sliding_attention",) * 3 and cfg.sliding_window == 128
    assert cfg.attention_sinks and cfg.layer_rope_thetas == () and cfg.tie_word_embeddings
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    assert ModelConfig.from_hf_config({**small, "layer_rope_theta": [0, 5e5]}).layer_rope_thetas == (0.0, 5e5)
    for thetas in ([1e4], [1e4, -1.0], "1e4"):
        with pytest.raises(ConfigError, match="^layer_rope_theta:"):
            ModelConfig.from_hf_config({**small, "layer_rope_theta": thetas})


@pytest.mark.parametrize("config_class,arch", [("GraniteMoeConfig", "GraniteMoeForCausalLM"),
                                               ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM")])
def test_granite3_moe_reads_as_transformers_does(config_class, arch):
    """Granite 3's MoE models at their config classes' defaults: every MLP 8 experts of 11,008, 2 a token (the shared
    MLP none by default); the parameter count is transformers' model's."""
    _, cfg = _at_class_defaults(config_class, {"architectures": [arch]})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
            cfg.no_rope_layers) == (8, 2, 11_008, 0, ())


def test_hy_v3_reads_as_transformers_does():
    """HY V3 (`HYV3ForCausalLM`, HYV3Config's defaults: Hy3-preview's shape): per-head q/k norms, a rope base of
    11,158,840, the first layer dense, then 192 experts of 1,536 (8 a token, times 2.826) beside one shared; the
    parameter count is transformers' model's. Dense layers after a sparse one are refused by name."""
    bare = {"architectures": ["HYV3ForCausalLM"]}
    _, cfg = _at_class_defaults("HYV3Config", bare)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.mlp_only_layers,
            cfg.routed_scaling_factor, cfg.shared_expert_intermediate_size, cfg.rope_theta, cfg.qk_norm) == (
        192, 8, 1536, (0,), 2.826, 1536, 11_158_840.0, True)
    with pytest.raises(ConfigError, match="^mlp_layer_types:"):
        ModelConfig.from_hf_config({**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "mlp_layer_types": ["sparse", "dense", "sparse"]})


def test_granite4_and_its_hybrids_read_as_transformers_does():
    """Granite 4's transformers (GraniteMoeHybridConfig with attention on every layer, no experts: Granite-4.0-Micro's
    kind) read as transformers reads them: the parameter count of its model, its MLP the shared one; its -H form
    (Mamba-2 layers beside an attention one) too, the KV cache holding that one, and with experts beside the shared
    MLP; Mamba alone, or a config without layer_types (all Mamba, transformers' default), is refused by name."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100352, "hidden_size": 2560,
            "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
            "shared_intermediate_size": 8192, "num_local_experts": 0, "position_embedding_type": "rope",
            "layer_types": ["attention"] * 40, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
            "residual_multiplier": 0.22, "logits_scaling": 10.0, "tie_word_embeddings": True}
    ours = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(transformers.GraniteMoeHybridConfig, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.intermediate_size, ours.no_rope_layers, ours.embedding_multiplier, ours.attention_scale) == (
        8192, (), 12.0, 0.0078125)
    assert ModelConfig.from_hf_config({**card, "position_embedding_type": None}).no_rope_layers == (0,) * 40
    hybrid = {**card, "layer_types": ["mamba"] * 9 + ["attention"] + ["mamba"] * 30, "num_hidden_layers": 40,
              "mamba_n_heads": 128, "mamba_d_state": 128, "mamba_n_groups": 1}
    ours, (_, hf) = ModelConfig.from_hf_config(hybrid), _meta_model(transformers.GraniteMoeHybridConfig, hybrid)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.num_kv_layers, ours.kv_layers, ours.mamba.head_dim, ours.mamba.conv_dim) == (1, (9,), 40, 5376)
    # a sequence's state: 39 Mamba layers' 3 convolution inputs (bfloat16) and 128 heads' 40 x 128 (float32)
    assert ours.state_bytes_per_seq(torch.bfloat16) == 39 * (5376 * 3 * 2 + 128 * 40 * 128 * 4)
    check_tensor_parallel(ours, 2)   # 64 Mamba heads a rank, its one group whole on each
    assert ours.state_bytes_per_seq(torch.bfloat16, 2) == 39 * ((2560 + 2 * 128) * 3 * 2 + 64 * 40 * 128 * 4)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 8 does not divide the model's 20 Mamba heads"):
        check_tensor_parallel(ModelConfig.from_hf_config({**hybrid, "mamba_n_heads": 20}), 8)
    # -H-Small's kind: 32 experts of 512, 4 a token, on every layer beside the shared MLP
    moe = {**hybrid, "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 512}
    ours, (_, hf) = ModelConfig.from_hf_config(moe), _meta_model(transformers.GraniteMoeHybridConfig, moe)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size,
            ours.shared_expert_intermediate_size, ours.shared_expert_gated) == (32, 4, 512, 8192, False)
    for change, named in (({"layer_types": ["mamba"] * 40}, "layer_types: Granite 4 with Mamba layers alone"),
                          ({"layer_types": ["mamba", "moe"] * 20}, "layer_types: attention or mamba"),
                          ({"layer_types": None}, "layer_types"),
                          ({"position_embedding_type": "alibi"}, "position_embedding_type")):
        with pytest.raises(ConfigError, match=f"^{named}"):
            ModelConfig.from_hf_config({**card, **change})


def test_exaone4_reads_as_transformers_does():
    """EXAONE 4's config (EXAONE-4.0-32B's shape: 64 layers, every 4th full and NoPE beside sliding ones of 4,096):
    the parameter count of transformers' model, its layer types; without a window every layer full and rotating; a
    pattern given as letters without layer_types is refused by name."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 102400, "hidden_size": 5120,
            "intermediate_size": 27392, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "sliding_window": 4096, "sliding_window_pattern": 4, "max_position_embeddings": 131072}
    ours = ModelConfig.from_hf_config(card)
    theirs, hf = _meta_model(transformers.Exaone4Config, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert ours.layer_types == tuple(theirs.layer_types) and ours.qk_norm
    assert ours.no_rope_layers == tuple(int(kind == "sliding_attention") for kind in theirs.layer_types)
    full = ModelConfig.from_hf_config({**card, "sliding_window": None})
    assert (full.layer_types, full.no_rope_layers, full.sliding_window) == ((), (), None)
    with pytest.raises(ConfigError, match="^sliding_window_pattern: a count of layers"):
        ModelConfig.from_hf_config({**card, "sliding_window_pattern": "LLLG"})


def test_hunyuan_dense_reads_as_transformers_does():
    """Hunyuan-7B-Instruct's kind of config: the rotary its checkpoints label dynamic with an alpha is transformers'
    fixed stretch of the base (its frequencies equal), the parameter count of its model (q/k norms per head)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    from engine.layers.rotary import rope_inv_freq

    card = {"architectures": ["HunYuanDenseV1ForCausalLM"], "vocab_size": 128167, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 32768, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}}
    ours = ModelConfig.from_hf_config(card)
    theirs, hf = _meta_model(transformers.HunYuanDenseV1Config, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) and ours.qk_norm
    inv_freq, _ = HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(theirs)
    torch.testing.assert_close(rope_inv_freq(ours), inv_freq)
    assert ours.rope_scaling.rope_type == "default"
    plain = ModelConfig.from_hf_config({k: v for k, v in card.items() if k != "rope_parameters"})
    assert (plain.rope_theta, plain.rope_scaling.rope_type) == (10000.0, "default")


def test_olmoe_reads_as_transformers_does():
    """OLMoE-1B-7B's config: 64 experts of its intermediate_size (1,024), 8 a token, not renormalised, on every layer;
    q and k normed over the whole projection; 6.9 B parameters as transformers' model counts them."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
            "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096, "clip_qkv": None,
            "rope_theta": 10000.0, "norm_topk_prob": False}
    ours = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(transformers.OlmoeConfig, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(ours.num_params() / 1e9, 1) == 6.9
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.norm_topk_prob,
            ours.mlp_only_layers, ours.clip_qkv) == (64, 8, 1024, False, (), None)


def test_qwen3_5_reads_as_transformers_does():
    """Qwen3.5 as its checkpoints come (`Qwen3_5ForConditionalGeneration`, the text model's keys in `text_config`),
    here transformers' own defaults: three Gated DeltaNet layers to a full one, the full layers' q_proj twice as
    wide (the gates), a quarter of each head rotated; the parameter count is transformers' text model's, S_KV counts
    the 8 full layers alone, and each sequence's state the 24 linear ones'."""
    transformers = pytest.importorskip("transformers")

    ours = ModelConfig.from_hf_config({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                       "text_config": {"model_type": "qwen3_5_text"}})
    _, hf = _meta_model(transformers.Qwen3_5TextConfig, {})
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.architecture, ours.text_weights_prefix, ours.num_kv_layers, ours.rotary_dim) == \
        ("Qwen3_5ForCausalLM", "language_model.", 8, 64)
    assert ours.kv_layers == tuple(range(3, 32, 4))
    assert ours.kv_bytes_per_token(torch.bfloat16) == 2 * 8 * 4 * 256 * 2
    shape = ours.gated_delta   # conv: 3 taps of q, k (16 heads of 128) and v (32 of 128); the 32 heads' 128 x 128
    assert ours.state_bytes_per_seq(torch.bfloat16) == 24 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)
    assert (shape.num_k_heads, shape.num_v_heads, shape.conv_kernel) == (16, 32, 4)
    with pytest.raises(ConfigError, match=r"^text_config\.layer_types: full_attention or linear_attention"):
        ModelConfig.from_hf_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {
            "model_type": "qwen3_5_text", "num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2}})
    with pytest.raises(ConfigError, match=r"^layer_types: one of full_attention, sliding_attention, chunked_attention"):
        ModelConfig.from_hf_config({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,   # Qwen3.5's only
                                    "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match=r"^linear_num_value_heads: 6 is not a multiple of linear_num_key_heads 4"):
        ModelConfig.from_hf_config({"architectures": ["Qwen3_5ForCausalLM"], "linear_num_key_heads": 4,
                                    "linear_num_value_heads": 6})


def test_qwen3_5_moe_reads_as_transformers_does():
    """Qwen3.5-MoE as transformers' defaults write it (Qwen3.5-35B-A3B's shape): Qwen3.5's layers, each MLP 256
    experts of 512, 8 a token, beside a gated shared expert of 512; 35 B parameters as transformers' text model
    counts them, 10 full-attention layers in S_KV."""
    transformers = pytest.importorskip("transformers")

    ours = ModelConfig.from_hf_config({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                       "text_config": {"model_type": "qwen3_5_moe_text"}})
    _, hf = _meta_model(transformers.Qwen3_5MoeTextConfig, {})
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(ours.num_params() / 1e9) == 35
    assert (ours.architecture, ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size,
            ours.shared_expert_intermediate_size, ours.norm_topk_prob, ours.num_kv_layers) == \
        ("Qwen3_5MoeForCausalLM", 256, 8, 512, 512, True, 10)
    assert all(ours.is_sparse_layer(layer) for layer in range(ours.num_layers))


def test_qwen3_next_reads_as_transformers_does():
    """Qwen3-Next as transformers' defaults write it (Qwen3-Next-80B-A3B's shape): 512 experts of 512, 10 a token,
    beside a gated shared expert, on all 48 layers; 80 B parameters as transformers counts them; `mlp_only_layers`
    dense, and a list of anything else refused by key."""
    transformers = pytest.importorskip("transformers")

    ours = ModelConfig.from_hf_config({"architectures": ["Qwen3NextForCausalLM"]})
    _, hf = _meta_model(transformers.Qwen3NextConfig, {})
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(ours.num_params() / 1e9) == 80
    assert (ours.num_experts, ours.num_experts_per_tok, ours.norm_topk_prob, ours.num_kv_layers) == (512, 10, True, 12)
    dense = ModelConfig.from_hf_config({"architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [0, 5],
                                        "norm_topk_prob": False, "num_hidden_layers": 8})
    assert [dense.is_sparse_layer(i) for i in range(8)] == [False, True, True, True, True, False, True, True]
    with pytest.raises(ConfigError, match=r"^mlp_only_layers: a list of layer indices"):
        ModelConfig.from_hf_config({"architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": "0"})


def test_nemotron_h_reads_as_transformers_does():
    """Nemotron-H as its hub configs write it (`hybrid_override_pattern`, a character a block; `num_hidden_layers`
    beside it) and as transformers 5 saves it (`layers_block_type`): the blocks' kinds, the KV cache holding the
    attention blocks alone, the parameter count of transformers' model, ranks splitting the Mamba heads and groups
    (refused by key where they cannot); biased MLPs, a block of no known kind, or no attention block at all refused
    by key; Nemotron 3's MoE blocks counted as transformers counts them, Super's latent experts too."""
    transformers = pytest.importorskip("transformers")

    pattern = "M-M-M-M*-M-M-M-M*-M-M-M-"   # 24 blocks: 11 Mamba-2, 2 attention, 11 MLP
    card = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 1024, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 4096, "mamba_num_heads": 32,
            "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "vocab_size": 32000,
            "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    ours = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(transformers.NemotronHConfig, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.num_layers, ours.kv_layers, ours.mamba.conv_dim) == (24, (7, 16), 32 * 64 + 2 * 8 * 128)
    assert ours.layer_types[:4] == ("linear_attention", "mlp", "linear_attention", "mlp")
    check_tensor_parallel(ours, 8)   # a Mamba group a rank
    for size, named in ((3, "3 does not divide the model's 32 Mamba heads"),
                        (16, "16 neither divides the model's 8 Mamba groups")):
        with pytest.raises(ConfigError, match=f"^tensor_parallel_size: {named}"):
            check_tensor_parallel(ours, size)
    saved = {**{k: v for k, v in card.items() if k not in ("hybrid_override_pattern", "num_hidden_layers")},
             "layers_block_type": list(ours.layer_types)}
    assert ModelConfig.from_hf_config(saved).num_params() == ours.num_params()
    moe = {**card, "hybrid_override_pattern": "ME*E" * 6, "num_hidden_layers": 24, "n_routed_experts": 64,
           "num_experts_per_tok": 6, "moe_intermediate_size": 512, "moe_shared_expert_intermediate_size": 1024}
    ours, (_, hf) = ModelConfig.from_hf_config(moe), _meta_model(transformers.NemotronHConfig, moe)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) + 6 * 2 * 64   # + the correction biases
    assert [ours.is_sparse_layer(i) for i in range(4)] == [False, True, False, True] and ours.kv_layers[:2] == (2, 6)
    latent = {**moe, "moe_latent_size": 256}   # Nemotron 3 Super's kind: the experts in a latent space
    ours, (_, hf) = ModelConfig.from_hf_config(latent), _meta_model(transformers.NemotronHConfig, latent)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) + 6 * 2 * 64 and ours.moe_latent_size == 256
    for change, named in (({"mlp_bias": True}, "mlp_bias"),
                          ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern: one of M"),
                          ({"hybrid_override_pattern": "M-M-"}, "layers_block_type: Nemotron-H with no attention"),
                          ({"mlp_hidden_act": "silu"}, "mlp_hidden_act")):
        with pytest.raises(ConfigError, match=f"^{named}"):
            ModelConfig.from_hf_config({**card, **change})


def test_hunyuan_moe_reads_as_transformers_does():
    """Hunyuan's MoE (Hunyuan-A13B's kind: 64 experts, 8 a token, per-layer lists that say one value, beside a shared
    MLP): the parameter count of transformers' model; lists that differ by layer are refused by key."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["HunYuanMoEV1ForCausalLM"], "vocab_size": 128167, "hidden_size": 1024,
            "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 64, "num_experts": [64] * 4, "moe_topk": [8] * 4}
    ours = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(transformers.HunYuanMoEV1Config, {**card, "num_experts": 64, "moe_topk": 8})
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.num_experts, ours.num_experts_per_tok, ours.qk_norm) == (64, 8, True)
    with pytest.raises(ConfigError, match=r"^moe_topk: must be"):
        ModelConfig.from_hf_config({**card, "moe_topk": [8, 8, 4, 8]})


def test_apertus_reads_as_transformers_does():
    """Apertus-8B's kind of config: q/k norms, an ungated MLP through xIELU (two slopes a layer), transformers'
    llama3 rope where config.json names none; the parameter count of transformers' model. Another model's config
    naming xIELU is refused by key."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["ApertusForCausalLM"], "vocab_size": 131072, "hidden_size": 4096,
            "intermediate_size": 21504, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_act": "xielu"}
    ours = ModelConfig.from_hf_config(card)
    _, hf = _meta_model(transformers.ApertusConfig, card)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert (ours.qk_norm, ours.rope_scaling.rope_type, ours.rope_theta) == (True, "llama3", 12_000_000.0)
    with pytest.raises(ConfigError, match=r"^hidden_act: unsupported 'xielu'"):
        ModelConfig.from_hf_config({**card, "architectures": ["LlamaForCausalLM"]})


def test_olmo_hybrid_reads_as_transformers_does():
    """OLMo Hybrid as transformers' defaults write it (Olmo-Hybrid-7B's shape: 32 layers, every 4th OLMo 3 attention,
    the rest Gated DeltaNet with 30 key heads of 96 and value heads twice as wide): the parameter count of its model;
    ranks that do not divide its linear layers' key heads are refused by key."""
    transformers = pytest.importorskip("transformers")

    ours = ModelConfig.from_hf_config({"architectures": ["OlmoHybridForCausalLM"], "vocab_size": 100352,
                                       "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32,
                                       "num_attention_heads": 30, "rope_theta": 500000.0})
    _, hf = _meta_model(transformers.OlmoHybridConfig, {"rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 500000.0}})
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    shape = ours.gated_delta
    assert (shape.num_k_heads, shape.k_head_dim, shape.v_head_dim, shape.beta_scale, ours.num_kv_layers) == \
        (30, 96, 192, 2.0, 8)
    check_tensor_parallel(ours, 2)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 4 does not divide the model's 30 linear-attention"):
        check_tensor_parallel(ours, 4)


def test_longcat_flash_reads_as_transformers_does():
    """LongCat-Flash at LongcatFlashConfig's defaults (LongCat-Flash-Chat's shape: 28 layers of two sublayers, 512
    experts of 2,048 beside 256 zero experts, 12 a token): 56 engine layers, each holding its latent's K/V, the
    experts on the even ones; the parameter count of transformers' model less the gate/up rows its stack holds for
    the zero experts, plus the routers' correction biases (560B); the config class's other names of its keys read
    as its own; what we do not serve refused by key."""
    transformers = pytest.importorskip("transformers")

    bare = {"architectures": ["LongcatFlashForCausalLM"]}
    _, hf = _meta_model(transformers.LongcatFlashConfig, bare)
    ours = ModelConfig.from_hf_config(bare)
    unread = sum(m.gate_up_proj[m.num_routed_experts:].numel() for m in hf.modules() if hasattr(m, "zero_expert_num"))
    assert ours.num_params() == _params_and_router_biases(hf) - unread
    assert round(ours.num_params() / 1e9) == 561
    assert (ours.num_layers, ours.num_kv_layers, ours.head_dim, ours.num_kv_heads, ours.num_experts,
            ours.zero_experts, ours.num_experts_per_tok, ours.rope_theta) == (56, 56, 576, 1, 512, 256, 12, 1e7)
    assert [ours.is_sparse_layer(i) for i in range(4)] == [True, False, True, False]
    aliased = ModelConfig.from_hf_config({**bare, "num_local_experts": 64, "num_experts_per_tok": 4,
                                          "intermediate_size": 1024, "moe_intermediate_size": 256})
    assert (aliased.num_experts, aliased.num_experts_per_tok, aliased.intermediate_size,
            aliased.moe_intermediate_size) == (64, 4, 1024, 256)
    for change, named in (({"router_bias": True}, "router_bias"), ({"head_dim": 128}, "head_dim: LongCat-Flash's"),
                          ({"num_hidden_layers": 28}, "num_hidden_layers: two sublayers"),
                          ({"hidden_act": "gelu"}, "hidden_act"), ({"q_lora_rank": None}, "q_lora_rank"),
                          ({"qk_head_dim": 128}, "qk_head_dim"), ({"moe_topk": 1000}, "moe_topk"),
                          ({"zero_expert_type": "zero"}, "zero_expert_type")):
        with pytest.raises(ConfigError, match=f"^{named}"):
            ModelConfig.from_hf_config({**bare, **change})


def test_cwm_reads_as_transformers_does():
    """CWM (`CwmForCausalLM`, CwmConfig's defaults: CWM 32B's shape): Llama's layer with 8 KV heads of 128, each 4th
    layer from the first full and the rest sliding over 8,192, Llama 3.1's rope x 16 from 8,192 positions at base 1e6
    where config.json names no rope; the parameter count is transformers' model's. A null window makes every layer
    full; an unknown layer type is refused by name."""
    hf, cfg = _at_class_defaults("CwmConfig", {"architectures": ["CwmForCausalLM"]})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window == 8192
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == \
        (hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings, hf.rms_norm_eps) == (8, 128, 131_072, 1e-5)
    rope = hf.rope_parameters
    assert cfg.rope_theta == rope["rope_theta"] == 1e6
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings,
            cfg.rope_scaling.low_freq_factor, cfg.rope_scaling.high_freq_factor) == \
        (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["low_freq_factor"],
         rope["high_freq_factor"]) == ("llama3", 16.0, 8192, 1.0, 4.0)
    small = {"architectures": ["CwmForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    assert ModelConfig.from_hf_config({**small, "sliding_window": None}).layer_types == ("full_attention",) * 3
    with pytest.raises(ConfigError, match="^layer_types:"):
        ModelConfig.from_hf_config({**small, "layer_types": ["full_attention", "local", "full_attention"]})


# Llama-3.2-11B-Vision-Instruct's config.json, its vision_config left out (not read)
MLLAMA_11B_CARD = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "text_config": {
    "model_type": "mllama_text_model", "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "vocab_size": 128256, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "pad_token_id": 128004}}


def test_llama_3_2_vision_reads_as_its_text_model_alone():
    """Llama 3.2 Vision (`MllamaForConditionalGeneration`, the 11B's config.json): served as its text model's 32
    self-attention layers of 40 (the cross-attention ones, which text skips, not held: Llama 3.1 8B's shape), Llama
    3.1's rope, a table of 128,264 rows beside a head of the vocabulary's 128,256; the parameter count transformers'
    text model's less its cross layers'. Cross layers past the model's, or a tied head, are refused by key."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_hf_config(MLLAMA_11B_CARD)
    text = MLLAMA_11B_CARD["text_config"]
    assert (cfg.architecture, cfg.num_layers, cfg.skipped_layers, cfg.vocab_size, cfg.output_vocab_size) == \
        ("MllamaForCausalLM", 32, tuple(text["cross_attention_layers"]), 128_264, 128_256)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor, cfg.rope_theta, cfg.text_weights_prefix) == \
        ("llama3", 8.0, 500_000.0, "language_model.")
    hf_config = transformers.MllamaTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        hf = transformers.MllamaForCausalLM(hf_config)
    layer = re.compile(r"\.layers\.(\d+)\.")
    cross = sum(p.numel() for name, p in hf.named_parameters()
                if (m := layer.search(name)) and int(m[1]) in hf_config.cross_attention_layers)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters()) - cross
    for key, value in (("cross_attention_layers", [3, 40]), ("cross_attention_layers", [3, 3]),
                       ("tie_word_embeddings", True)):
        with pytest.raises(ConfigError, match=f"^text_config.{key}:"):
            ModelConfig.from_hf_config({**MLLAMA_11B_CARD, "text_config": {**text, key: value}})


def test_gemma_3n_reads_as_transformers_does():
    """Gemma 3n (`Gemma3nForCausalLM`, Gemma3nTextConfig's defaults: the E4B's text model): 35 layers, each 5th full,
    the last 15 sharing the K/V of the last layer of their type before them, per-layer inputs of 256, four AltUp
    streams, LAuReL of rank 64, the first 10 layers' gates sparse at 0.95; ropes 1,000,000 (full) and 10,000 (sliding,
    a window of 512); the parameter count transformers' model's, and as `Gemma3nForConditionalGeneration`'s text
    model (its audio and vision towers not read). Refused by key: MLPs of different widths, an active stream past the
    first, shared K/V layers without one of each type before them."""
    hf, cfg = _at_class_defaults("Gemma3nTextConfig", {"architectures": ["Gemma3nForCausalLM"]})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == 512 and cfg.num_layers == 35
    g, n = cfg.gemma4, cfg.gemma3n
    assert [g.kv_producer(cfg, i) for i in range(35)] == [
        i if mode != "reuse" else max(j for j in range(20) if hf.layer_types[j] == hf.layer_types[i])
        for i, mode in enumerate(hf.kv_sharing_modes)]
    assert (g.per_layer_input_size, g.per_layer_vocab_size, n.streams, n.laurel_rank, n.gate_sparsity) == \
        (256, 262_144, 4, 64, tuple(hf.activation_sparsity_pattern))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.final_logit_softcapping) == (1e6, 1e4, 30.0)
    text = {k: v for k, v in hf.to_dict().items() if k not in ("architectures", "transformers_version")}
    vlm = ModelConfig.from_hf_config({"architectures": ["Gemma3nForConditionalGeneration"], "text_config": text})
    assert (vlm.architecture, vlm.text_weights_prefix, vlm.num_params()) == \
        ("Gemma3nForCausalLM", "language_model.", cfg.num_params())
    bare = {"architectures": ["Gemma3nForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "intermediate_size": 128, "num_kv_shared_layers": 1}
    for key, value in (("intermediate_size", [128, 256, 128, 128, 128, 128]), ("altup_active_idx", 1),
                       ("num_kv_shared_layers", 6)):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**bare, key: value})


def test_lara_mini_reads_as_transformers_does():
    """Lara Mini (`LaraMiniForCausalLM`, LaraMiniConfig's defaults: Lara-4-Mini's shape): 34 layers in the period
    linear, sliding, linear, full, sliding; the sliding layers rotate, the full ones NoPE; Gated DeltaNet of 8 key
    heads and 16 value heads of 128; 128 experts, 4 a token, beside an ungated shared expert; no dense MLP; the
    parameter count transformers' model's."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LaraMiniConfig()
    card = {k: v for k, v in hf_config.to_dict().items() if k not in ("transformers_version",)}
    cfg = ModelConfig.from_hf_config({**card, "architectures": ["LaraMiniForCausalLM"]})
    assert cfg.layer_types == tuple(hf_config.layer_types) and cfg.num_layers == 34
    assert cfg.no_rope_layers == tuple(int(k == "sliding_attention") for k in hf_config.layer_types)
    g = cfg.gated_delta
    assert (g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim, cfg.sliding_window) == (8, 16, 128, 128, 512)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_gated, cfg.tie_word_embeddings) == \
        (128, 4, False, True)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    with pytest.raises(ConfigError, match="^layer_types:"):
        ModelConfig.from_hf_config({**card, "architectures": ["LaraMiniForCausalLM"],
                                    "layer_types": ["linear_attention"] * 34})


def test_youtu_reads_as_transformers_does():
    """Youtu-LLM (`YoutuForCausalLM`, YoutuConfig's defaults: Youtu-LLM-2B's shape): DeepSeek V3's latent attention
    (q through 1,536, a latent of 512 and a rotated key of 64 a token in the cache) with a dense MLP on every layer and
    the head tied; the parameter count is transformers' model's."""
    hf, cfg = _at_class_defaults("YoutuConfig", {"architectures": ["YoutuForCausalLM"]})
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.qk_nope_head_dim,
            cfg.mla.v_head_dim) == (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_rope_head_dim, hf.qk_nope_head_dim,
                                    hf.v_head_dim)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.num_experts) == (1, 576, 0) and cfg.mla.rope_interleave
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings is True
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 131_072


def test_bamba_reads_as_transformers_does():
    """Bamba (`BambaForCausalLM`, BambaConfig's defaults with Bamba-9B's attention layers): Mamba-2 layers of 128
    heads of 64 and a state of 256 (one group) beside the attention layers `attn_layer_indices` names, half of each
    head rotated; the parameter count is transformers' model's. A config without attention layers is refused by
    name."""
    bare = {"architectures": ["BambaForCausalLM"], "attn_layer_indices": [9, 18, 27]}
    hf, cfg = _at_class_defaults("BambaConfig", bare)
    assert cfg.layer_types == tuple(hf.layers_block_type) and cfg.layer_types[9] == "full_attention"
    m = cfg.mamba
    assert (m.num_heads, m.head_dim, m.d_state, m.n_groups, m.conv_kernel) == \
        (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv) == (128, 64, 256, 1, 4)
    assert cfg.rotary_dim == hf.hidden_size // hf.num_attention_heads // 2 == 64 and cfg.num_kv_heads == 8
    assert cfg.max_position_embeddings == hf.max_position_embeddings and cfg.rms_norm_eps == hf.rms_norm_eps
    small = {"architectures": ["BambaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4}
    for attn in (None, [], [2], "1"):
        with pytest.raises(ConfigError, match="^attn_layer_indices:"):
            ModelConfig.from_hf_config({**small, "attn_layer_indices": attn})


def test_jamba_reads_as_transformers_does():
    """Jamba (`JambaForCausalLM`, JambaConfig's defaults: Jamba 1.5 Mini's shape): an attention layer every 8 from
    the 5th, Mamba-1 on the rest (8,192 channels, a state of 16 each, dt of rank 256), 16 experts (2 a token) on every
    other layer from the 2nd; the parameter count is transformers' model's (51.6 B, as AI21 states 52 B), the state a
    sequence holds per Mamba layer its convolution's last 3 inputs and 8,192 x 16 float32s. A config whose offsets
    name no attention layer, or pass their period, is refused by name."""
    hf, cfg = _at_class_defaults("JambaConfig", {"architectures": ["JambaForCausalLM"]})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.kv_layers == (4, 12, 20, 28)
    m = cfg.state_layers
    assert (m.intermediate_size, m.d_state, m.conv_kernel, m.dt_rank) == \
        (hf.mamba_expand * hf.hidden_size, hf.mamba_d_state, hf.mamba_d_conv, hf.mamba_dt_rank) == (8192, 16, 4, 256)
    assert [cfg.is_sparse_layer(i) for i in range(hf.num_hidden_layers)] == [n > 1 for n in hf.layers_num_experts]
    assert round(cfg.num_params() / 1e9, 1) == 51.6
    assert cfg.state_bytes_per_seq(torch.bfloat16) == 28 * (8192 * 3 * 2 + 8192 * 16 * 4)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.num_kv_heads, cfg.tie_word_embeddings) == \
        (hf.max_position_embeddings, hf.rms_norm_eps, hf.num_key_value_heads, False) == (262_144, 1e-6, 8, False)
    _at_class_defaults("JambaConfig", {"architectures": ["JambaForCausalLM"], "num_experts": 1,
                                       "mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_dt_rank": 64})
    small = {"architectures": ["JambaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2,
             "attn_layer_offset": 1}
    ModelConfig.from_hf_config(small)
    for key, bad in (("attn_layer_offset", {"attn_layer_offset": 2}),
                     ("expert_layer_offset", {"expert_layer_offset": 2}),
                     ("attn_layer_offset", {"attn_layer_period": 8, "attn_layer_offset": 4}),   # no attention layer
                     ("hidden_act", {"hidden_act": "gelu"})):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, **bad})
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 3 does not divide the model's 128 Mamba channels"):
        check_tensor_parallel(ModelConfig.from_hf_config({**small, "num_attention_heads": 6, "num_key_value_heads": 3,
                                                          "head_dim": 16, "intermediate_size": 96}), 3)


# MiniMax-Text-01's config.json as its release writes it (its own code's names: `attn_type_list`, `layernorm_*`,
# `rotary_dim`, `postnorm`); DeepNorm's alpha is (2 x 80 layers) ** 0.25
MINIMAX_TEXT_01_CARD = {
    "architectures": ["MiniMaxText01ForCausalLM"], "model_type": "minimax_text_01", "vocab_size": 200_064,
    "hidden_size": 6144, "intermediate_size": 9216, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "attn_type_list": [int(i % 8 == 7) for i in range(80)],
    **{f"layernorm_{kind}_{part}": 160 ** 0.25 if part == "alpha" else 1.0
       for kind in ("full_attention", "linear_attention", "mlp") for part in ("alpha", "beta")},
    "postnorm": True, "rotary_dim": 64, "rope_theta": 10_000_000, "max_position_embeddings": 10_240_000,
    "num_local_experts": 32, "num_experts_per_tok": 2, "shared_intermediate_size": 0, "rms_norm_eps": 1e-5,
    "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False}


def test_minimax_reads_as_transformers_does():
    """MiniMax (`MiniMaxForCausalLM`, MiniMaxConfig's defaults): full attention and lightning layers in turn, 8
    experts (2 a token) on every layer; the parameter count is transformers' model's, the state a sequence holds a
    float32 [128, 128] a head of each lightning layer. MiniMax-Text-01's release, under its own names: one full layer
    in 8, (2 x 80) ** 0.25 on every residual, half of each head rotated; 456 B parameters (as MiniMax states them),
    counted as transformers counts the same config under its names, 280 MiB of state a sequence. A config served
    otherwise than transformers runs it is refused by name."""
    transformers = pytest.importorskip("transformers")
    hf, cfg = _at_class_defaults("MiniMaxConfig", {"architectures": ["MiniMaxForCausalLM"]})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.kv_layers == tuple(range(0, 32, 2))
    assert (cfg.state_layers.num_heads, cfg.state_layers.head_dim) == (32, 128)
    assert cfg.state_bytes_per_seq(torch.bfloat16) == 16 * 32 * 128 * 128 * 4
    assert (cfg.max_position_embeddings, cfg.rope_theta, cfg.rms_norm_eps, cfg.num_kv_heads, cfg.rotary_dim) == \
        (hf.max_position_embeddings, hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.num_key_value_heads,
         hf.head_dim or 128) == (131_072, 1e6, 1e-5, 8, 128)
    release = ModelConfig.from_hf_config(MINIMAX_TEXT_01_CARD)
    assert release.architecture == "MiniMaxForCausalLM" and release.kv_layers == tuple(range(7, 80, 8))
    assert release.state_layers.scales("linear_attention") == release.state_layers.scales("mlp") == (160 ** 0.25, 1.0)
    assert (release.rotary_dim, release.head_dim, release.rope_theta) == (64, 128, 1e7)
    theirs = {k: v for k, v in MINIMAX_TEXT_01_CARD.items() if not k.startswith(("layernorm", "attn_type", "rotary"))}
    hf_config = transformers.MiniMaxConfig(**{k: v for k, v in theirs.items() if k != "architectures"},
                                           layer_types=list(release.layer_types))
    with torch.device("meta"):
        counted = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
    assert release.num_params() == counted and round(counted / 1e9) == 456
    assert release.state_bytes_per_seq(torch.bfloat16) == 70 * 64 * 128 * 128 * 4 == 280 * 2 ** 20
    small = {**MINIMAX_TEXT_01_CARD, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "attn_type_list": [0, 1], "rotary_dim": 8}
    ModelConfig.from_hf_config(small)
    for key, bad in (("postnorm", {"postnorm": False}), ("attn_type_list", {"attn_type_list": [0, 2]}),
                     ("layer_types", {"attn_type_list": [0, 0]}),   # no full attention layer
                     ("shared_intermediate_size", {"shared_intermediate_size": 32}),
                     ("sliding_window", {"sliding_window": 8}), ("hidden_act", {"hidden_act": "gelu"}),
                     ("num_attention_heads", {"num_attention_heads": 6, "num_key_value_heads": 2})):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, **bad})
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 8 does not divide the model's 4 lightning"):
        check_tensor_parallel(ModelConfig.from_hf_config({**small, "num_key_value_heads": 4}), 8)


def test_minimax_m3_reads_as_transformers_does():
    """MiniMax M3's text model (`MiniMaxM3VLForCausalLM`, MiniMaxM3VLTextConfig's defaults: 60 layers, 128 experts of
    3,072, 4 a token, x2, beside a shared one; the dense MLP 12,288 wide): the parameter count is transformers' model's.
    The release's spelling (`sparse_attention_config`'s `sparse_*` keys and `sparse_attention_freq`, `moe_layer_freq`)
    reads as transformers maps it, counted alike; each sparse layer's indexer key adds 128 values a token to the
    cache, whole on every rank (in bfloat16 beside an FP8 cache). An indexer of other heads or head size than the
    attention's and bad layer kinds are refused by name."""
    transformers = pytest.importorskip("transformers")
    from engine.deepseek_v4_config import refuse_fp8_cache

    hf, cfg = _at_class_defaults("MiniMaxM3VLTextConfig", {"architectures": ["MiniMaxM3VLForCausalLM"]})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor) == (128, 4, 3072, 12_288, 3072, 2.0)
    assert cfg.block_indexer is None and not cfg.mlp_only_layers and cfg.qk_norm
    small = {"architectures": ["MiniMaxM3VLForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
             "intermediate_size": 32, "dense_intermediate_size": 96, "shared_intermediate_size": 48,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_local_experts": 4, "num_experts_per_tok": 2, "moe_layer_freq": [0, 1, 1, 1],
             "sparse_attention_config": {"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 8,
                                         "sparse_topk_blocks": 4, "sparse_local_block": 1,
                                         "sparse_attention_freq": [0, 1, 0, 1]}}
    cfg = ModelConfig.from_hf_config(small)
    hf_config = transformers.MiniMaxM3VLTextConfig(**{k: v for k, v in small.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert cfg.num_params() == _params_and_router_biases(model)
    assert (cfg.block_indexer.layers, cfg.mlp_only_layers) == ((1, 3), (0,)) and hf_config.layer_types == [
        "full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]
    ix = cfg.block_indexer
    assert (ix.num_heads, ix.head_dim, ix.block_size, ix.topk_blocks, ix.local_blocks) == (2, 16, 8, 4, 1)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == (4 * 2 * 2 * 16 + 2 * 16) * 2
    refuse_fp8_cache(cfg, torch.float8_e4m3fn, "pools.chat.kv_cache_dtype")   # served: its indexer keys in bfloat16
    assert cfg.kv_bytes_per_token(torch.float8_e4m3fn) == 4 * 2 * 2 * 16 + 2 * 16 * 2
    for key, bad in (("index_n_heads", {"index_n_heads": 4}), ("index_head_dim", {"index_head_dim": 32}),
                     ("layer_types", {"layer_types": ["full_attention", "sliding_attention"] * 2}),
                     ("mlp_layer_types", {"mlp_layer_types": ["dense"]}),
                     ("sparse_attention_config.sparse_attention_freq",
                      {"layer_types": None, "sparse_attention_config": {"sparse_attention_freq": 1}})):
        plain = {k: v for k, v in small.items() if k != "sparse_attention_config"}
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**plain, "layer_types": ["full_attention", "minimax_m3_sparse"] * 2,
                                        "index_n_heads": 2, "index_head_dim": 16, **bad})


# Step 3.7's text_config as its release spells it: the attribute map's keys, per-layer lists padded with its
# multi-token-prediction layer, `moe_layers_enum`, `attention_other_setting`, a rope base and share a layer
STEP3P7_RELEASE_TEXT = {
    "model_type": "step3p5", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_attention_groups": 2, "head_dim": 16, "moe_intermediate_size": 32,
    "moe_num_experts": 4, "moe_top_k": 2, "share_expert_dim": 48, "moe_layers_enum": "1,2,3,4",
    "num_nextn_predict_layers": 1, "layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention"],
    "attention_other_setting": {"num_attention_heads": 2}, "sliding_window": 8,
    "rope_theta": [10000.0, 500000.0] * 2 + [500000.0], "partial_rotary_factors": [1.0, 0.5] * 2 + [0.5],
    "swiglu_limits": [0, 0, 0, 7, 7], "swiglu_limits_shared": [0, 0, 0, 16, 16]}


def test_step3p7_reads_as_transformers_does():
    """Step 3.7's text model (`Step3p7ForConditionalGeneration`'s text_config, in its release's spelling): the layer
    kinds, dense layers, each kind's query heads, rope base and share, the clamps and the parameter count are what
    transformers' `Step3p7TextConfig` and its model (built on the meta device; its head beside it) make of it, its
    multi-token-prediction layer's entries cut. A per-element gate and bad clamps are refused by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.step3p7 import modeling_step3p7

    hf = transformers.Step3p7TextConfig(**{k: v for k, v in STEP3P7_RELEASE_TEXT.items() if k != "model_type"})
    card = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7",
            "text_config": STEP3P7_RELEASE_TEXT, "vision_config": {"model_type": "step3p5_vision"}}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.architecture == "Step3p7ForCausalLM" and cfg.layer_types == tuple(hf.layer_types)
    assert cfg.mlp_only_layers == tuple(i for i, kind in enumerate(hf.mlp_layer_types) if kind == "dense") == (0,)
    assert cfg.laguna.heads == (2, 4, 2, 4) and (cfg.num_kv_heads, cfg.sliding_window) == (2, 8)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (full["rope_theta"], full["partial_rotary_factor"])
    assert (cfg.rope_local_theta, cfg.laguna.local_rotary_factor) == (local["rope_theta"], 1.0)
    assert cfg.laguna.expert_limits == (0, 0, 0, 7.0) and cfg.laguna.mlp_limits == (0, 0, 0, 16.0)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (4, 2, 48)
    with torch.device("meta"):
        model = modeling_step3p7.Step3p7TextModel(hf)
    assert cfg.num_params() == _params_and_router_biases(model) + hf.vocab_size * hf.hidden_size
    text = {k: v for k, v in STEP3P7_RELEASE_TEXT.items() if k != "num_nextn_predict_layers"}
    for key, bad in (("gating", {"gating": "per-element"}), ("swiglu_limits", {"swiglu_limits": [0, -1, 0, 0]}),
                     ("moe_layers_enum", {"moe_layers_enum": "1,x"}), ("rope_theta", {"rope_theta": [1e4, 1e5]}),
                     ("attention_other_setting", {"attention_other_setting": 4})):
        trimmed = {k: v[:4] if isinstance(v, list) else v for k, v in {**text, **bad}.items()}
        with pytest.raises(ConfigError, match=f"^text_config.{key}:"):
            ModelConfig.from_hf_config({**card, "text_config": trimmed})


def test_bloom_reads_as_transformers_does():
    """BLOOM (`BloomForCausalLM`) at BloomConfig's defaults and as bloom-560m's config.json spells it (`n_embed`,
    `n_layer`, `n_head`): the parameter count is transformers' model's (its embedding's LayerNorm, the tied head), the
    MLP 4 x hidden, as many KV heads as query heads, no rotary. A layer whose residual is its normed input is refused
    by name."""
    transformers = pytest.importorskip("transformers")

    bare = {"architectures": ["BloomForCausalLM"]}
    cfg = ModelConfig.from_hf_config(bare)
    hf = transformers.BloomConfig()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == \
        (hf.hidden_size, hf.n_layer, hf.n_head, hf.n_head, 4 * hf.hidden_size)
    assert cfg.tie_word_embeddings and cfg.no_rope_layers == (0, 0) and cfg.rms_norm_eps == hf.layer_norm_epsilon
    card = {**bare, "n_embed": 1024, "n_layer": 24, "num_attention_heads": 16, "vocab_size": 250_880}
    cfg = ModelConfig.from_hf_config(card)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.BloomConfig(
            **{k: v for k, v in card.items() if k != "architectures"}))
    assert round(cfg.num_params() / 1e6) == round(sum(p.numel() for p in model.parameters()) / 1e6) == 559
    with pytest.raises(ConfigError, match="^apply_residual_connection_post_layernorm:"):
        ModelConfig.from_hf_config({**bare, "apply_residual_connection_post_layernorm": True})


def test_mpt_reads_as_transformers_does():
    """MPT (`MptForCausalLM`) at MptConfig's defaults and as MPT-7B's config.json spells it (`d_model`, `n_heads`,
    `n_layers`, `attn_config`): the parameter count is transformers' model's (no biases, weight-only LayerNorms, the
    tied head). What transformers does not serve as the config says (another MLP width or bias spread, q/k
    LayerNorms, a prefix LM, multi-query attention, biases) is refused by name."""
    transformers = pytest.importorskip("transformers")

    card = {"architectures": ["MptForCausalLM"], "d_model": 4096, "n_heads": 32, "n_layers": 32, "vocab_size": 50_432,
            "max_seq_len": 2048, "expansion_ratio": 4, "no_bias": True,
            "attn_config": {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None, "qk_ln": False}}
    for config in ({"architectures": ["MptForCausalLM"]}, card):
        cfg = ModelConfig.from_hf_config(config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.MptConfig(
                **{k: v for k, v in config.items() if k != "architectures"}))
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert round(cfg.num_params() / 1e9, 2) == 6.65 and cfg.max_position_embeddings == 2048
    for key, bad in (("expansion_ratio", {"expansion_ratio": 2}), ("no_bias", {"no_bias": False}),
                     ("attn_config.alibi_bias_max", {"attn_config": {"alibi_bias_max": 16}}),
                     ("attn_config.qk_ln", {"attn_config": {"qk_ln": True}}),
                     ("attn_config.prefix_lm", {"attn_config": {"prefix_lm": True}}),
                     ("attn_config.attn_type", {"attn_config": {"attn_type": "multiquery_attention"}})):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**card, **bad})


@pytest.mark.parametrize("config_class,arch", [("MambaConfig", "MambaForCausalLM"),
                                                ("FalconMambaConfig", "FalconMambaForCausalLM")])
def test_mamba_and_falcon_mamba_read_as_transformers_does(config_class, arch):
    """Mamba and FalconMamba (their config classes' defaults: mamba-130m's shape): every layer Mamba-1 (1,536
    channels, a state of 16, dt of rank 48), no attention (the KV cache holds no layer), a tied head; the parameter
    count is transformers' model's, FalconMamba's norms of dt, B and C without weights (its dummy ones buffers there).
    A tensor-parallel size that does not divide the channels is refused naming them; bad keys by name."""
    transformers = pytest.importorskip("transformers")
    hf, model = _meta_model(getattr(transformers, config_class), {"architectures": [arch]})
    cfg = ModelConfig.from_hf_config({"architectures": [arch], **{k: getattr(hf, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "time_step_rank")}})
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    m = cfg.state_layers
    assert (m.intermediate_size, m.d_state, m.conv_kernel, m.dt_rank, cfg.tie_word_embeddings) == \
        (hf.intermediate_size, hf.state_size, hf.conv_kernel, hf.time_step_rank, True) == (1536, 16, 4, 48, True)
    assert m.bcdt_norms == ("weightless" if arch.startswith("Falcon") else "none")
    assert cfg.kv_layers == () and cfg.stateful_layers == tuple(range(hf.num_hidden_layers))
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 0 and cfg.rms_norm_eps == hf.layer_norm_epsilon == 1e-5
    assert cfg.state_bytes_per_seq(torch.bfloat16) == 32 * (1536 * 3 * 2 + 1536 * 16 * 4)
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 5 does not divide the model's 1536 Mamba channels"):
        check_tensor_parallel(cfg, 5)
    small = {"architectures": [arch], "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2}
    for key, value in (("conv_kernel", 1), ("state_size", 0), ("hidden_act", "gelu"), ("expand", "2")):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, key: value})


def test_mamba2_reads_as_transformers_does():
    """Mamba2 (Mamba2Config's defaults: Mamba-Codestral-7B's shape): 64 Mamba-2 layers of 128 heads of 64, a state of
    128, B and C in 8 groups, no attention, an untied head; the parameter count is transformers' model's (7.3 B), the
    state a sequence holds per layer its convolution's last 3 inputs and 128 x 64 x 128 float32s. Heads that do not
    make expand x hidden_size are refused by name, a tensor-parallel size that does not divide the heads too."""
    transformers = pytest.importorskip("transformers")
    bare = {"architectures": ["Mamba2ForCausalLM"]}
    hf, model = _meta_model(transformers.Mamba2Config, bare)
    cfg = ModelConfig.from_hf_config({**bare, **{k: getattr(hf, k) for k in ("vocab_size", "hidden_size",
                                                                             "num_hidden_layers")}})
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert round(cfg.num_params() / 1e9, 1) == 7.3
    m = cfg.mamba
    assert (m.num_heads, m.head_dim, m.d_state, m.n_groups, m.conv_kernel, m.gated_norm) == \
        (hf.num_heads, hf.head_dim, hf.state_size, hf.n_groups, hf.conv_kernel, "gate_first") == \
        (128, 64, 128, 8, 4, "gate_first")
    assert cfg.kv_layers == () and not cfg.tie_word_embeddings and cfg.rms_norm_eps == hf.layer_norm_epsilon
    assert cfg.state_bytes_per_seq(torch.bfloat16) == 64 * ((8192 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)
    check_tensor_parallel(cfg, 8)
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 3 does not divide the model's 128 Mamba heads"):
        check_tensor_parallel(cfg, 3)
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32,
             "n_groups": 2}
    ModelConfig.from_hf_config(small)
    for key, value in (("head_dim", 16), ("time_step_limit", [0.0]), ("conv_kernel", 1)):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, key: value})


def test_zamba2_reads_as_transformers_does():
    """Zamba2 (Zamba2Config's defaults: 54 Mamba-2 layers of 8 heads of 640, 9 of them hybrid, one shared block of 32
    attention heads of 160 over 2 x 2,560; then two blocks with attention adapters): the parameter count is
    transformers' model's; only the hybrid layers keep K/V, every layer a state. Layer kinds without a hybrid one,
    YaRN's long-context switch, attention adapters beside fewer KV heads and ranks that do not divide the Mamba heads
    are refused by key."""
    transformers = pytest.importorskip("transformers")
    bare = {"architectures": ["Zamba2ForCausalLM"]}
    for extra in ({}, {"num_mem_blocks": 2, "use_shared_attention_adapter": True, "add_bias_linear": True}):
        hf, model = _meta_model(transformers.Zamba2Config, {**bare, **extra})
        cfg = ModelConfig.from_hf_config({**bare, **extra, **{k: getattr(hf, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "layers_block_type")}})
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert cfg.kv_layers == tuple(hf.hybrid_layer_ids) and len(cfg.kv_layers) == 9
    assert cfg.stateful_layers == tuple(range(54)) and (cfg.head_dim, cfg.mamba.head_dim) == (160, 640)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 9 * 2 * 32 * 160 * 2
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "n_mamba_heads": 4, "layers_block_type": ["linear_attention", "hybrid"]}
    check_tensor_parallel(ModelConfig.from_hf_config(small), 2)
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 8 does not divide the model's 4 Mamba heads"):
        check_tensor_parallel(ModelConfig.from_hf_config(small), 8)
    for key, value in (("layers_block_type", ["mamba", "mamba"]), ("use_long_context", True),
                       ("num_key_value_heads", 2), ("n_mamba_heads", 3)):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, "use_shared_attention_adapter": True, key: value})


def test_internlm3_reads_as_transformers_does():
    """InternLM3 (`InternLM3ForCausalLM`, as its hub config.json names it; InternLM3Config's defaults, InternLM3-8B's
    shape) is the Llama model transformers runs: the parameter count is transformers' model's (8.8 B), head_dim 128
    beside 32 heads of a 4,096 stream, 2 KV heads; its qkv_bias and bias biases q, k, v, o and the MLP alike, and
    a config that sets them apart is refused by key (transformers refuses it too)."""
    transformers = pytest.importorskip("transformers")
    bare = {"architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3"}
    hf, model = _meta_model(transformers.InternLM3Config, {**bare, "qkv_bias": True, "bias": True})
    cfg = ModelConfig.from_hf_config({**bare, "qkv_bias": True, "bias": True})
    assert cfg.num_params() == sum(p.numel() for p in model.parameters()) and round(cfg.num_params() / 1e9, 1) == 8.8
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size, cfg.max_position_embeddings) == \
        ("LlamaForCausalLM", hf.head_dim, hf.num_key_value_heads, hf.vocab_size, hf.max_position_embeddings) == \
        ("LlamaForCausalLM", 128, 2, 128_512, 32_768)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and cfg.rms_norm_eps == hf.rms_norm_eps == 1e-5
    with pytest.raises(ConfigError, match="^bias: InternLM3 is served with qkv_bias and bias alike"):
        ModelConfig.from_hf_config({**bare, "qkv_bias": True, "bias": False})


def test_falcon_h1_reads_as_transformers_does():
    """Falcon-H1 (`FalconH1ForCausalLM`, FalconH1Config's defaults): every layer a parallel hybrid of attention (K/V
    in the cache) and Mamba-2 (128 heads of 8 over mamba_d_ssm 1,024, a state of 256, one group; its state per
    sequence beside), the gate joining without a norm; the parameter count is transformers' model's, as it is with
    the gated norm and biased projections. Multipliers other than numbers are refused by name."""
    hf, cfg = _at_class_defaults("FalconH1Config", {"architectures": ["FalconH1ForCausalLM"]})
    m = cfg.mamba
    assert (m.num_heads, m.head_dim, m.d_state, m.n_groups, m.gated_norm) == \
        (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, "none") == (128, 8, 256, 1, "none")
    assert cfg.kv_layers == cfg.stateful_layers == tuple(range(hf.num_hidden_layers))
    assert cfg.state_bytes_per_seq(torch.bfloat16) == hf.num_hidden_layers * m.state_bytes(2)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.num_kv_heads) == \
        (hf.max_position_embeddings, hf.rms_norm_eps, hf.num_key_value_heads) == (8192, 1e-5, 8)
    _at_class_defaults("FalconH1Config", {"architectures": ["FalconH1ForCausalLM"], "mamba_rms_norm": True,
                                          "mamba_proj_bias": True, "projectors_bias": True, "mamba_d_ssm": None})
    small = {"architectures": ["FalconH1ForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4,
             "mamba_d_ssm": 64}
    for key, value in (("ssm_multipliers", [1.0] * 4), ("mlp_multipliers", ["1", 1]), ("key_multiplier", "2")):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, key: value})


def test_exaone3_reads_as_transformers_does():
    """EXAONE 3 (`ExaoneForCausalLM`, ExaoneConfig's defaults: EXAONE-3.0-7.8B's shape): the Llama layer with 8 KV
    heads and a rope base of 500,000; the parameter count is transformers' model's. Its hub configs' own key names
    (`num_layers`, `layer_norm_epsilon`, `activation_function`) are read as transformers' (an unsupported activation
    refused under transformers' name), and a config transformers 5 saved (LlamaForCausalLM, model_type exaone) is
    EXAONE's, its tensors under EXAONE's names."""
    hf, cfg = _at_class_defaults("ExaoneConfig", {"architectures": ["ExaoneForCausalLM"]})
    assert (cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == \
        (hf.num_key_value_heads, hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.max_position_embeddings) \
        == (8, 500_000.0, 1e-5, 4096)
    hub = {"architectures": ["ExaoneForCausalLM"], "model_type": "exaone", "vocab_size": 1000, "hidden_size": 64,
           "intermediate_size": 128, "num_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "layer_norm_epsilon": 1e-6, "activation_function": "silu"}
    ours = ModelConfig.from_hf_config(hub)
    assert (ours.architecture, ours.num_layers, ours.rms_norm_eps) == ("ExaoneForCausalLM", 3, 1e-6)
    resaved = {**{k: v for k, v in hub.items() if k != "num_layers"}, "num_hidden_layers": 3,
               "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_hf_config(resaved).architecture == "ExaoneForCausalLM"
    with pytest.raises(ConfigError, match="^hidden_act:"):
        ModelConfig.from_hf_config({**hub, "activation_function": "gelu_new"})


def test_hyperclovax_reads_as_transformers_does():
    """HyperCLOVA X SEED (`HyperCLOVAXForCausalLM`, HyperCLOVAXConfig's defaults): Granite 3's scalars with the
    logits multiplied by `logits_scaling` (Granite divides), q.k scaled by head_dim ** -0.5 unless
    `attention_multiplier` says otherwise, a norm on each sublayer's output unless `use_post_norm` is false; the
    parameter count is transformers' model's either way."""
    hf, cfg = _at_class_defaults("HyperCLOVAXConfig", {"architectures": ["HyperCLOVAXForCausalLM"]})
    assert cfg.peri_norms and cfg.attention_scale == hf.attention_multiplier == hf.head_dim ** -0.5
    scaled = {"architectures": ["HyperCLOVAXForCausalLM"], "logits_scaling": 0.25, "attention_multiplier": 0.5,
              "use_post_norm": False}
    _, plain = _at_class_defaults("HyperCLOVAXConfig", scaled)
    assert (plain.logit_scale, plain.logits_scaling, plain.attention_scale, plain.peri_norms) == (0.25, 1.0, 0.5, False)


def test_mellum_reads_as_transformers_does():
    """Mellum (`MellumForCausalLM`, MellumConfig's defaults): Qwen3-MoE's layers with q/k norms, 64 experts of 896 on
    every layer (8 a token, renormalised), every layer full, the full layers' rope base 500,000 and the sliding
    layers' 10,000; the parameter count is transformers' model's, with dense layers too. A partial rotary is refused
    by name."""
    hf, cfg = _at_class_defaults("MellumConfig", {"architectures": ["MellumForCausalLM"]})
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.qk_norm) == \
        (hf.num_experts, hf.moe_intermediate_size, hf.num_experts_per_tok, True, True) == (64, 896, 8, True, True)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window == 1024
    assert (cfg.rope_theta, cfg.rope_local_theta) == (hf.rope_parameters["full_attention"]["rope_theta"],
                                                      hf.rope_parameters["sliding_attention"]["rope_theta"])
    kinds = ["dense"] * 2 + ["sparse"] * (hf.num_hidden_layers - 2)
    _, mixed = _at_class_defaults("MellumConfig", {"architectures": ["MellumForCausalLM"], "mlp_layer_types": kinds})
    assert mixed.mlp_only_layers == (0, 1)
    with pytest.raises(ConfigError, match="^rope_parameters.full_attention.partial_rotary_factor:"):
        ModelConfig.from_hf_config({"architectures": ["MellumForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "rope_parameters": {"full_attention": {"rope_theta": 1e4,
                                                                           "partial_rotary_factor": 0.5}}})


def test_starcoder2_reads_as_transformers_does():
    """StarCoder2 (`Starcoder2ForCausalLM`, Starcoder2Config's defaults: starcoder2-7b's shape): LayerNorms of
    `norm_epsilon`, an ungated GELU-tanh MLP, every projection biased, 2 KV heads, the head tied; the parameter count
    is transformers' model's, unbiased too. Another activation is refused by name."""
    hf, cfg = _at_class_defaults("Starcoder2Config", {"architectures": ["Starcoder2ForCausalLM"]})
    assert (cfg.num_kv_heads, cfg.rms_norm_eps, cfg.hidden_act, cfg.attention_bias, cfg.mlp_bias) == \
        (hf.num_key_value_heads, hf.norm_epsilon, hf.hidden_act, True, True)
    assert cfg.tie_word_embeddings and cfg.sliding_window is None and cfg.rope_theta == hf.rope_parameters["rope_theta"]
    _at_class_defaults("Starcoder2Config", {"architectures": ["Starcoder2ForCausalLM"], "use_bias": False,
                                            "sliding_window": 4096})
    with pytest.raises(ConfigError, match="^hidden_act:"):
        ModelConfig.from_hf_config({"architectures": ["Starcoder2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "hidden_act": "gelu"})


def test_glm_reads_as_transformers_does():
    """GLM-4-9B of 2024 (`GlmForCausalLM`, GlmConfig's defaults): GLM-4's attention (2 KV heads of 128, q/k/v biased,
    half of each head rotated) under the Llama layer; the parameter count is transformers' model's."""
    hf, cfg = _at_class_defaults("GlmConfig", {"architectures": ["GlmForCausalLM"]})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.attention_bias, cfg.o_proj_bias, cfg.rms_norm_eps) == \
        (hf.num_key_value_heads, hf.head_dim, 64, True, False, hf.rms_norm_eps)


def test_laguna_reads_as_transformers_does():
    """Laguna (`LagunaForCausalLM`, LagunaConfig's defaults): 48 query heads a layer over 8 KV heads of 128, a gate
    per head, every layer full (its rotary on half of each head, base 500,000; the sliding layers' whole, 10,000),
    a dense first layer, then 256 experts of 512 (8 a token) beside a shared expert of 512; the parameter count is
    transformers' model's, with per-layer heads and gates per channel too. A router weighing the experts' inputs
    and an unknown gating are refused by name."""
    bare = {"architectures": ["LagunaForCausalLM"]}
    hf, cfg = _at_class_defaults("LagunaConfig", bare)
    assert cfg.laguna.heads == tuple(hf.num_attention_heads_per_layer) and cfg.laguna.gate_per_head
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.laguna.local_rotary_factor) == (8, 128, 64, 1.0)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (5e5, 1e4) and cfg.mlp_only_layers == (0,)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
            cfg.shared_expert_intermediate_size) == (256, 512, 8, 512)
    layers = hf.num_hidden_layers
    _at_class_defaults("LagunaConfig", {**bare, "gating": "per-element", "attention_bias": True,
                                        "num_attention_heads_per_layer": [48, 64] * (layers // 2)})
    small = {**bare, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    for key, value in (("moe_apply_router_weight_on_input", True), ("gating", "per-token"),
                       ("num_attention_heads_per_layer", [4])):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**small, key: value})


def test_laguna_layers_the_ranks_cannot_split_are_refused_naming_tensor_parallel_size():
    """A Laguna layer whose query heads the ranks do not divide is refused before any rank starts, naming the key."""
    from engine.parallel import check_tensor_parallel

    cfg = ModelConfig.from_hf_config({"architectures": ["LagunaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 32, "num_attention_heads_per_layer": [4, 6]})
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 4 does not divide the model's 6 attention heads"):
        check_tensor_parallel(cfg, 4)


def test_nemotron_reads_as_transformers_does():
    """Nemotron (`NemotronForCausalLM`, NemotronConfig's defaults: Nemotron-4 15B's shape): LayerNorms of
    `norm_eps`, an ungated squared-ReLU MLP, half of each head rotated, a KV head per query head by default; the
    parameter count is transformers' model's (with 8 KV heads: transformers builds none at its default of null),
    biased too. Another activation is refused by name."""
    bare = {"architectures": ["NemotronForCausalLM"], "num_key_value_heads": 8}
    hf, cfg = _at_class_defaults("NemotronConfig", bare)
    assert (cfg.hidden_act, cfg.rms_norm_eps, cfg.num_kv_heads, cfg.rotary_dim) == \
        ("relu2", hf.norm_eps, 8, hf.hidden_size // hf.num_attention_heads // 2)
    _at_class_defaults("NemotronConfig", {**bare, "attention_bias": True, "mlp_bias": True})
    with pytest.raises(ConfigError, match="^hidden_act:"):
        ModelConfig.from_hf_config({"architectures": ["NemotronForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "hidden_act": "silu"})
    assert ModelConfig.from_hf_config({"architectures": ["NemotronForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2,
                                       "num_attention_heads": 4}).num_kv_heads == 4


def test_stablelm_reads_as_transformers_does():
    """StableLM (`StableLmForCausalLM`, StableLmConfig's defaults: StableLM 3B's shape): LayerNorms of
    `layer_norm_eps`, a quarter of each head rotated, no biases; StableLM 2 12B's form (q/k/v biases, parallel
    layers, a LayerNorm a q/k head) too; the parameter count is transformers' model's either way."""
    hf, cfg = _at_class_defaults("StableLmConfig", {"architectures": ["StableLmForCausalLM"]})
    assert (cfg.rms_norm_eps, cfg.rotary_dim, cfg.attention_bias, cfg.qk_norm, cfg.parallel_residual) == \
        (hf.layer_norm_eps, hf.hidden_size // hf.num_attention_heads // 4, False, False, False)
    _, twelve = _at_class_defaults("StableLmConfig", {"architectures": ["StableLmForCausalLM"], "use_qkv_bias": True,
                                                      "use_parallel_residual": True, "qk_layernorm": True,
                                                      "num_key_value_heads": 8})
    assert twelve.parallel_residual and twelve.qk_norm and twelve.attention_bias and not twelve.o_proj_bias


def test_phi_reads_as_transformers_does():
    """Phi (`PhiForCausalLM`, PhiConfig's defaults: phi-1.5's shape): parallel layers off one LayerNorm of
    `layer_norm_eps`, half of each head rotated, every projection and the head biased, GELU-tanh; the parameter count
    is transformers' model's. q/k LayerNorms, another activation and a tied head are refused by key."""
    hf, cfg = _at_class_defaults("PhiConfig", {"architectures": ["PhiForCausalLM"]})
    assert (cfg.rms_norm_eps, cfg.rotary_dim, cfg.parallel_residual, cfg.hidden_act, cfg.max_position_embeddings) == \
        (hf.layer_norm_eps, hf.hidden_size // hf.num_attention_heads // 2, True, "gelu_pytorch_tanh", 2048)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and cfg.lm_head_bias and not cfg.tie_word_embeddings
    base = {"architectures": ["PhiForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    for key, value in (("qk_layernorm", True), ("hidden_act", "relu"), ("tie_word_embeddings", True)):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config(base | {key: value})


def test_flex_olmo_reads_as_transformers_does():
    """FlexOlmo (`FlexOlmoForCausalLM`, FlexOlmoConfig's defaults: FlexOlmo-7x7B-1T's shape): OLMo 2's layers with 7
    experts of intermediate_size on every layer, 5 a token, not renormalised; the parameter count is transformers'
    model's (whole-projection q/k norms, two norms a layer)."""
    hf, cfg = _at_class_defaults("FlexOlmoConfig", {"architectures": ["FlexOlmoForCausalLM"]})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.rope_theta,
            cfg.max_position_embeddings) == (7, 5, hf.intermediate_size, False, 500_000.0, 4096)
    assert all(cfg.is_sparse_layer(layer) for layer in range(cfg.num_layers))


def test_nanochat_reads_as_transformers_does():
    """nanochat (`NanoChatForCausalLM`, NanoChatConfig's defaults: nanochat d12's shape): weightless norms (the
    parameter count is transformers' model's), a squared-ReLU MLP without a gate, the logits capped at 15; another
    activation is refused by key."""
    hf, cfg = _at_class_defaults("NanoChatConfig", {"architectures": ["NanoChatForCausalLM"]})
    assert (cfg.hidden_act, cfg.final_logit_softcapping, cfg.num_kv_heads, cfg.tie_word_embeddings) == \
        ("relu2", hf.final_logit_softcapping, hf.num_key_value_heads, False)
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_config({"architectures": ["NanoChatForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "hidden_act": "silu"})


# dbrx-instruct's config.json (Databricks, 2024; its training-only keys left out)
DBRX_INSTRUCT = {"architectures": ["DbrxForCausalLM"], "attn_config": {"clip_qkv": 8, "kv_n_heads": 8,
                                                                       "rope_theta": 500000},
                 "d_model": 6144, "ffn_config": {"ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": 10752,
                                                 "moe_normalize_expert_weights": 1, "moe_num_experts": 16,
                                                 "moe_top_k": 4},
                 "max_seq_len": 32768, "model_type": "dbrx", "n_heads": 48, "n_layers": 40, "vocab_size": 100352}


def test_dbrx_as_its_model_card_writes_it_reads_as_transformers_does():
    """DBRX Instruct's config: 131.6 B parameters as transformers' model holds them (16 experts of 10,752 a layer,
    weight-only LayerNorms, no biases), 8 KV heads and the rope's base from `attn_config`, q/k/v clipped at 8, the
    top 4 renormalised. Another activation or p-norm of the weights is refused by key."""
    floats = {"attn_config": {**DBRX_INSTRUCT["attn_config"], "clip_qkv": 8.0, "rope_theta": 500000.0},
              "ffn_config": {**DBRX_INSTRUCT["ffn_config"], "moe_normalize_expert_weights": 1.0}}
    cfg = _card_as_transformers_counts(DBRX_INSTRUCT, "DbrxConfig", {**DBRX_INSTRUCT, **floats})
    assert round(cfg.num_params() / 1e9, 1) == 131.6
    assert (cfg.num_kv_heads, cfg.rope_theta, cfg.clip_qkv, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.context_length) == \
        (8, 500_000.0, 8.0, 16, 4, 10752, True, 32768)
    ffn = DBRX_INSTRUCT["ffn_config"]
    for change, key in (({**ffn, "ffn_act_fn": {"name": "gelu"}}, "ffn_act_fn"),
                        ({**ffn, "moe_normalize_expert_weights": 2}, "moe_normalize_expert_weights")):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**DBRX_INSTRUCT, "ffn_config": change})
    assert not ModelConfig.from_hf_config({**DBRX_INSTRUCT, "ffn_config": {
        **ffn, "moe_normalize_expert_weights": None}}).norm_topk_prob


def test_minicpm3_reads_as_transformers_does():
    """MiniCPM3 (`MiniCPM3ForCausalLM`, MiniCPM3Config's defaults: MiniCPM3-4B's shape): DeepSeek V2's latent
    attention (one cache row of latent and rotated key a token) with its rotary over halves, dense MLPs, muP's scalars
    as Granite's fields; the parameter count is transformers' model's. Null `scale_depth` / `dim_model_base` scale
    nothing, as transformers reads them; a LongRoPE has a factor a pair of the rotated part."""
    hf, cfg = _at_class_defaults("MiniCPM3Config", {"architectures": ["MiniCPM3ForCausalLM"]})
    assert (cfg.mla.qk_rope_head_dim, cfg.mla.rope_interleave, cfg.num_experts, cfg.head_dim) == \
        (hf.qk_rope_head_dim, False, 0, hf.kv_lora_rank + hf.qk_rope_head_dim)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling, cfg.tie_word_embeddings) == \
        (hf.scale_emb, hf.scale_depth / hf.num_hidden_layers ** 0.5, hf.hidden_size / hf.dim_model_base, True)
    bare = {"architectures": ["MiniCPM3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "scale_depth": None, "dim_model_base": None}
    assert (ModelConfig.from_hf_config(bare).residual_multiplier, ModelConfig.from_hf_config(bare).logits_scaling) == \
        (1.0, 1.0)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                "original_max_position_embeddings": 4096}
    assert ModelConfig.from_hf_config({**bare, "rope_scaling": longrope}).rope_scaling.rope_type == "longrope"


def test_olmo_reads_as_transformers_does():
    """OLMo (`OlmoForCausalLM`, OlmoConfig's defaults: OLMo-7B's shape): the Llama layer with LayerNorms that hold
    nothing (the parameter count is transformers' model's), multi-head, `clip_qkv` read where set."""
    hf, cfg = _at_class_defaults("OlmoConfig", {"architectures": ["OlmoForCausalLM"]})
    assert (cfg.num_kv_heads, cfg.clip_qkv, cfg.rms_norm_eps, cfg.max_position_embeddings) == \
        (hf.num_key_value_heads, None, 1e-5, hf.max_position_embeddings)
    _, clipped = _at_class_defaults("OlmoConfig", {"architectures": ["OlmoForCausalLM"], "clip_qkv": 8.0})
    assert clipped.clip_qkv == 8.0


# falcon-7b's config.json (TII, 2023, as first released: the older head and layer keys) and falcon-40b's
FALCON_7B = {"alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "bos_token_id": 11,
             "eos_token_id": 11, "hidden_size": 4544, "layer_norm_epsilon": 1e-05, "model_type": "falcon",
             "multi_query": True, "n_head": 71, "n_layer": 32, "parallel_attn": True, "vocab_size": 65024}
FALCON_40B = {"alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "bos_token_id": 11,
              "eos_token_id": 11, "hidden_size": 8192, "layer_norm_epsilon": 1e-05, "model_type": "falcon",
              "new_decoder_architecture": True, "num_attention_heads": 128, "num_hidden_layers": 60,
              "num_kv_heads": 8, "parallel_attn": True, "vocab_size": 65024}


@pytest.mark.parametrize("card,billions,kv,norms", [(FALCON_7B, 6.9, 1, 1), (FALCON_40B, 41.3, 8, 2)],
                         ids=["7b", "40b"])
def test_falcon_as_its_model_cards_write_it_reads_as_transformers_does(card, billions, kv, norms):
    """Falcon-7B's and -40B's configs: the parameter count is transformers' model's (6.9 B and 41.3 B), one KV head
    for 7B's multi-query attention and 8 for 40B's groups, one norm before 7B's parallel sublayers and one each for
    40B's, the head tied. ALiBi, another activation and the new architecture's sequential layer are refused by key."""
    cfg = _card_as_transformers_counts(card, "FalconConfig")
    assert round(cfg.num_params() / 1e9, 1) == billions
    assert (cfg.num_kv_heads, cfg.parallel_residual, cfg.parallel_norms, cfg.tie_word_embeddings, cfg.hidden_act,
            cfg.intermediate_size) == (kv, True, norms, True, "gelu", 4 * card["hidden_size"])
    for change, key in (({"alibi": True}, "alibi"), ({"activation": "relu"}, "activation"),
                        ({"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn")):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**card, **change})


# gpt-j-6b's config.json (EleutherAI, 2021; its task-specific keys left out)
GPTJ_6B = {"activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "bos_token_id": 50256,
           "embd_pdrop": 0.0, "eos_token_id": 50256, "gradient_checkpointing": False, "initializer_range": 0.02,
           "layer_norm_epsilon": 1e-05, "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_inner": None,
           "n_layer": 28, "n_positions": 2048, "resid_pdrop": 0.0, "rotary": True, "rotary_dim": 64,
           "scale_attn_weights": True, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 50400}


def test_gptj_as_its_model_card_writes_it_reads_as_transformers_does():
    """GPT-J-6B's config: GPT-2's key names read as GPTJConfig's attribute map reads them, 6.05 B parameters as
    transformers' model holds them (a biased head, unbiased attention), a parallel layer off one norm, 64 of each
    head's 256 dimensions rotated; null `rotary_dim` the whole head (transformers 4's reading). Another activation or
    an odd rotary is refused by key."""
    cfg = _card_as_transformers_counts(GPTJ_6B, "GPTJConfig")
    assert round(cfg.num_params() / 1e9, 2) == 6.05
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.intermediate_size, cfg.rotary_dim,
            cfg.parallel_residual, cfg.lm_head_bias, cfg.attention_bias) == (4096, 28, 16, 16384, 64, True, True, False)
    assert ModelConfig.from_hf_config({**GPTJ_6B, "rotary_dim": None}).rotary_dim == 256
    for change, key in (({"activation_function": "relu"}, "activation_function"), ({"rotary_dim": 63}, "rotary_dim")):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**GPTJ_6B, **change})


# starcoder's config.json (BigCode, 2023; its training-only keys left out)
STARCODER = {"activation_function": "gelu_pytorch_tanh", "architectures": ["GPTBigCodeForCausalLM"],
             "attention_softmax_in_fp32": True, "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.02,
             "layer_norm_epsilon": 1e-05, "model_type": "gpt_bigcode", "multi_query": True, "n_embd": 6144,
             "n_head": 48, "n_inner": 24576, "n_layer": 40, "n_positions": 8192,
             "scale_attention_softmax_in_fp32": True, "scale_attn_weights": True, "use_cache": True,
             "vocab_size": 49152}


def test_gpt_bigcode_as_starcoders_card_writes_it_reads_as_transformers_does():
    """StarCoder's config (`GPTBigCodeForCausalLM`): 15.5 B parameters as transformers' model holds them (a learned
    position embedding of 8,192 rows, one KV head, every projection biased, a tied head), no rotary on any layer; a
    KV head a query head where `multi_query` is false. Another activation, unscaled attention or cross-attention are
    refused by key."""
    cfg = _card_as_transformers_counts(STARCODER, "GPTBigCodeConfig")
    assert round(cfg.num_params() / 1e9, 1) == 15.5
    assert (cfg.num_kv_heads, cfg.learned_positions, cfg.context_length, cfg.tie_word_embeddings,
            set(cfg.no_rope_layers), cfg.intermediate_size) == (1, 8192, 8192, True, {0}, 24576)
    assert ModelConfig.from_hf_config({**STARCODER, "multi_query": False}).num_kv_heads == 48
    for change, key in (({"activation_function": "relu"}, "activation_function"),
                        ({"scale_attn_weights": False}, "scale_attn_weights"),
                        ({"add_cross_attention": True}, "add_cross_attention")):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**STARCODER, **change})


# gpt2's config.json (OpenAI, 2019; its task heads' keys left out) and opt-125m's (Meta, 2022)
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "bos_token_id": 50256,
        "eos_token_id": 50256, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768,
        "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}
OPT_125M = {"activation_function": "relu", "architectures": ["OPTForCausalLM"], "bos_token_id": 2,
            "do_layer_norm_before": True, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
            "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
            "pad_token_id": 1, "vocab_size": 50272, "word_embed_proj_dim": 768}


@pytest.mark.parametrize("card,config_class,millions,rows", [(GPT2, "GPT2Config", 124, 1024),
                                                             (OPT_125M, "OPTConfig", 125, 2050)], ids=["gpt2", "opt"])
def test_gpt2_and_opt_as_their_cards_write_them_read_as_transformers_does(card, config_class, millions, rows):
    """gpt2's and opt-125m's configs: 124 M and 125 M parameters as transformers' models hold them (a learned position
    table of 1,024 rows; OPT's 2,050: looked up two rows on), a KV head a query head, no rotary, the head tied. GPT-2's
    per-layer attention scaling and OPT-350M's post-norm layers and projected embeddings are refused by key."""
    cfg = _card_as_transformers_counts(card, config_class)
    assert round(cfg.num_params() / 1e6) == millions
    assert (cfg.num_kv_heads, cfg.learned_positions, cfg.tie_word_embeddings, set(cfg.no_rope_layers)) == \
        (12, rows, True, {0})
    changes = [({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx")] if card is GPT2 else [
        ({"do_layer_norm_before": False}, "do_layer_norm_before"),
        ({"word_embed_proj_dim": 512}, "word_embed_proj_dim")]
    for change, key in changes:
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf_config({**card, **change})


# pythia-70m's config.json (EleutherAI, 2023): the rope's base and share under their older keys
PYTHIA_70M = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
              "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
              "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
              "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
              "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}


def test_gpt_neox_reads_as_transformers_does():
    """GPT-NeoX (`GPTNeoXForCausalLM`, GPTNeoXConfig's defaults: GPT-NeoX-20B's shape; then pythia-70m's config.json,
    whose rope keys are the older `rotary_emb_base` / `rotary_pct`): multi-head, LayerNorms, two norms a parallel layer,
    exact GELU, the attention biased; the parameter count is transformers' model's either way, and so are the rope's
    base and turned share. Another activation is refused by key."""
    transformers = pytest.importorskip("transformers")
    hf, cfg = _at_class_defaults("GPTNeoXConfig", {"architectures": ["GPTNeoXForCausalLM"]})
    assert (cfg.num_kv_heads, cfg.hidden_act, cfg.parallel_residual, cfg.attention_bias, cfg.o_proj_bias) == \
        (hf.num_attention_heads, "gelu", True, True, True)
    pythia = ModelConfig.from_hf_config(PYTHIA_70M)
    theirs = transformers.GPTNeoXConfig(**PYTHIA_70M)
    assert pythia.num_params() == sum(p.numel() for p in _meta_model(transformers.GPTNeoXConfig, PYTHIA_70M)[1]
                                      .parameters())
    assert (pythia.rope_theta, pythia.rotary_dim) == (theirs.rope_parameters["rope_theta"], int(
        theirs.hidden_size // theirs.num_attention_heads * theirs.rope_parameters["partial_rotary_factor"]))
    sequential = ModelConfig.from_hf_config(PYTHIA_70M | {"use_parallel_residual": False, "hidden_act": "gelu_fast",
                                                          "rotary_emb_base": 500, "rotary_pct": 0.5})
    assert (sequential.parallel_residual, sequential.hidden_act, sequential.rope_theta, sequential.rotary_dim) == \
        (False, "gelu_pytorch_tanh", 500.0, 32)
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_config(PYTHIA_70M | {"hidden_act": "relu"})


@pytest.mark.parametrize("config_class,arch", [("GemmaConfig", "GemmaForCausalLM"),
                                               ("VaultGemmaConfig", "VaultGemmaForCausalLM")])
def test_gemma_and_vaultgemma_read_as_transformers_does(config_class, arch):
    """Gemma (GemmaConfig's defaults: gemma-7b's shape) and VaultGemma (Gemma 2's defaults): two Gemma norms a layer,
    GELU-tanh, heads of 256, the head tied, VaultGemma's soft caps and sliding layers as Gemma 2's; the parameter
    count is transformers' model's. Gemma's legacy `hidden_act: gelu` reads as GELU-tanh, as transformers reads it."""
    hf, cfg = _at_class_defaults(config_class, {"architectures": [arch]})
    assert (cfg.hidden_act, cfg.head_dim, cfg.tie_word_embeddings) == ("gelu_pytorch_tanh", hf.head_dim, True)
    assert cfg.final_logit_softcapping == getattr(hf, "final_logit_softcapping", None)
    if arch == "GemmaForCausalLM":
        legacy = ModelConfig.from_hf_config({"architectures": [arch], "vocab_size": 1000, "hidden_size": 64,
                                             "intermediate_size": 128, "num_hidden_layers": 2,
                                             "num_attention_heads": 4, "hidden_act": "gelu"})
        assert legacy.hidden_act == "gelu_pytorch_tanh"
    else:
        assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window


def test_lfm3_reads_as_transformers_does():
    """LFM3 (`Lfm3ForCausalLM`, Lfm3Config's defaults: LFM3-1.7B's shape): its layout of convolutions (7 taps),
    sliding (256) and full layers, heads of 128, the full layers' proportional rope turning half the pairs over
    1,000,000 and the sliding layers' default one over 10,000, head gates and sandwich norms, the MLP as wide as
    `intermediate_size`; the parameter count is transformers' model's, with gates and norms or without. A layout
    without attention, or a rope type it does not take, is refused naming the key."""
    hf, cfg = _at_class_defaults("Lfm3Config", {"architectures": ["Lfm3ForCausalLM"]})
    kinds = tuple("linear_attention" if k == "conv" else k for k in hf.layer_types)
    rope = hf.rope_parameters
    assert (cfg.layer_types, cfg.sliding_window, cfg.head_dim, cfg.state_layers.kernel, cfg.intermediate_size) == \
        (kinds, hf.sliding_window, hf.head_dim, hf.conv_L_cache, hf.intermediate_size)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rope_local_theta, cfg.rope_proportional) == \
        (rope["full_attention"]["rope_theta"], rope["full_attention"]["partial_rotary_factor"],
         rope["sliding_attention"]["rope_theta"], True)
    assert cfg.head_gates and cfg.peri_norms and cfg.tie_word_embeddings
    _, bare = _at_class_defaults("Lfm3Config", {"architectures": ["Lfm3ForCausalLM"], "use_sandwich_norm": False,
                                                "use_attention_gate": False})
    assert not bare.head_gates and not bare.peri_norms
    base = {"architectures": ["Lfm3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4}
    assert ModelConfig.from_hf_config(base).layer_types == ("linear_attention", "linear_attention", "full_attention")
    with pytest.raises(ConfigError, match=r"^layer_types: LFM3 with no attention layer"):
        ModelConfig.from_hf_config({**base, "layer_types": ["conv"] * 3})
    with pytest.raises(ConfigError, match=r"^layer_types: conv, sliding_attention, full_attention for each of the 3"):
        ModelConfig.from_hf_config({**base, "layer_types": ["conv", "linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match=r"^rope_parameters.full_attention.rope_type: 'proportional' or 'default'"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"full_attention": {"rope_type": "llama3"}}})


def test_kolibri_reads_as_transformers_does():
    """Kolibri-1 (`Kolibri1ForCausalLM`, Kolibri1Config's defaults: its release's shape): every 5th layer full and
    NoPE, the rest sliding (513) and rotating, q/k normed per head, four norms a layer, 384 experts of 512, 6 a token
    by the kolibri router (not renormalised) beside an ungated shared expert; the parameter count is transformers'
    model's. Sliding layers without a window are refused naming the key."""
    transformers = pytest.importorskip("transformers")
    hf, model = _meta_model(transformers.Kolibri1Config, {"architectures": ["Kolibri1ForCausalLM"]})
    cfg = ModelConfig.from_hf_config({"architectures": ["Kolibri1ForCausalLM"]})   # its defaults: Kolibri1Config's
    assert cfg.num_params() == _params_and_router_biases(model)
    assert (cfg.layer_types, cfg.sliding_window, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok) == \
        (tuple(hf.layer_types), hf.sliding_window, hf.head_dim, hf.num_local_experts, hf.num_experts_per_tok)
    assert cfg.no_rope_layers == tuple(int(k == "sliding_attention") for k in hf.layer_types)
    assert (cfg.moe_router, cfg.norm_topk_prob, cfg.shared_expert_gated, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.mlp_only_layers) == \
        ("kolibri", False, False, hf.moe_intermediate_size, hf.shared_expert_intermediate_size, ())
    with pytest.raises(ConfigError, match=r"^sliding_window: sliding-attention layers need a positive window"):
        ModelConfig.from_hf_config({"architectures": ["Kolibri1ForCausalLM"], "num_hidden_layers": 2,
                                    "sliding_window": None})


def test_axk1_reads_as_transformers_does(tmp_path, builtin_path):
    """A.X-K1 (`AXK1ForCausalLM`, AXK1Config's defaults: its release's shape): DeepSeek V3's latent attention and
    grouped sigmoid router, 192 experts, one dense layer first, a norm on each sparse layer's output; the parameter
    count is transformers' model's. The release stores that norm on the dense layer too, where neither transformers
    nor the engine uses it: a checkpoint with it decodes as transformers does."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from engine.llm_engine import LLMEngine
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import DEEPSEEK, _hf_greedy
    from tests.engine.test_mxfp4_weights import PROMPTS, _config, _greedy

    hf, cfg = _at_class_defaults("AXK1Config", {"architectures": ["AXK1ForCausalLM"]})
    assert (cfg.num_experts, cfg.mlp_only_layers, cfg.mla.q_lora_rank, cfg.moe_router) == \
        (hf.n_routed_experts, (0,), hf.q_lora_rank, "deepseek_v3")
    folder = make_tiny_model(tmp_path / "axk1", "axk1", builtin_path, **{**DEEPSEEK, "q_lora_rank": 24})
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tensors = {name: t for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 3.0)   # the release's dense-layer norm
    for path in folder.glob("*.safetensors*"):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    assert _greedy(LLMEngine(_config(folder, "none"), progress=False)) == \
        [_hf_greedy(model, prompt, 12, eos_ids=None) for prompt in PROMPTS]


def test_axk2_reads_as_transformers_does():
    """A.X-K2 (`AXK2ForCausalLM`, AXK2Config's defaults: A.X-K2-Light's shape): DeepSeek V3.2's sparse attention
    (an indexer of 16 heads of 128, 2,048 tokens a query) with each head's q and output gate from one projection, gated
    norms through a bottleneck of 16, 128 experts without groups past one dense layer; the parameter count is
    transformers' model's. A larger release's groups are read where `n_group` names them."""
    hf, cfg = _at_class_defaults("AXK2Config", {"architectures": ["AXK2ForCausalLM"]})
    mla = cfg.mla
    assert (mla.index_heads, mla.index_head_dim, mla.index_topk, mla.q_gate, mla.gated_norm_rank) == \
        (hf.index_n_heads, hf.index_head_dim, hf.index_topk, True, hf.gated_norm_rank)
    assert (cfg.num_experts, cfg.moe_groups, cfg.mlp_only_layers, cfg.moe_router) == (128, (1, 1), (0,), "deepseek_v3")
    grouped = ModelConfig.from_hf_config({"architectures": ["AXK2ForCausalLM"], "n_group": 8, "topk_group": 4})
    assert grouped.moe_groups == (8, 4)


def test_deepseek_v4_reads_as_transformers_does():
    """DeepSeek V4 (`DeepseekV4ForCausalLM`, DeepseekV4Config's defaults: V4-Flash's shape, 43 layers): two HCA layers
    then CSA and HCA by turns, heads of 512 (the last 64 rotated), 4 streams, three hash layers; the parameter count is
    transformers' model's (the hash tables too), the float32 ones those it keeps so but the sinks; the cache rows are
    the module docstring's. The legacy keys read as transformers reads them; what we do not serve is refused naming the
    key: ranks that would split a group of heads, an FP8 cache, an unknown layer type or scoring function."""
    import torch

    from engine.deepseek_v4_config import refuse_fp8_cache
    from engine.parallel import check_tensor_parallel

    hf, cfg = _at_class_defaults("DeepseekV4Config", {"architectures": ["DeepseekV4ForCausalLM"]})
    s = cfg.deepseek_v4
    kinds = {"heavily_compressed_attention": "hca", "compressed_sparse_attention": "csa"}
    assert s.kinds == tuple(kinds[k] for k in hf.layer_types) and s.rope_dim == hf.qk_rope_head_dim == 64
    assert (s.hash_layers, s.streams, s.index_topk, s.window) == ((0, 1, 2), hf.hc_mult, hf.index_topk, 128)
    assert [cfg.layer_kv_shape(i) for i in (0, 3)] == [(1, 4 * 512), (1, 6 * 512 + 5 * 128)] and cfg.kv_planes == 1
    _, model = _meta_model(type(hf), {"architectures": ["DeepseekV4ForCausalLM"]})
    kept = [t for name, t in [*model.named_parameters(), *model.named_buffers()] if "_hc." in name or any(
        part in name for part in ("hc_head.", "norm.weight", "position_bias", "e_score_correction_bias", "tid2eid"))]
    assert cfg.num_float32_params == sum(t.numel() for t in kept)
    legacy = ModelConfig.from_hf_config({"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 3,
                                         "compress_ratios": [128, 4, 0], "num_hash_layers": 1, "qk_rope_head_dim": 32,
                                         "compress_rate_csa": 8})
    assert (legacy.deepseek_v4.kinds, legacy.deepseek_v4.rates) == (("hca", "csa", "sliding"), (128, 8, 0))
    assert (legacy.deepseek_v4.hash_layers, legacy.deepseek_v4.rope_dim) == ((0,), 32)
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
            "beta_slow": 1.0}   # a release's flat scaling: the compressed layers', their attention factor 1
    flat = ModelConfig.from_hf_config({"architectures": ["DeepseekV4ForCausalLM"], "rope_scaling": yarn})
    theirs = getattr(pytest.importorskip("transformers"), "DeepseekV4Config")(rope_parameters=dict(yarn))
    rope, compress = flat.deepseek_v4.compress_rope, theirs.rope_parameters["compress"]
    assert (rope.rope_type, rope.factor, rope.attention_factor) == ("yarn", compress["factor"], 1.0) == \
        (compress["rope_type"], 16.0, compress["attention_factor"])
    check_tensor_parallel(cfg, 8)   # each rank one group of 8 heads
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 16 does not divide DeepSeek V4's o_groups 8"):
        check_tensor_parallel(cfg, 16)
    with pytest.raises(ConfigError, match="^kv_cache_dtype: DeepSeek V4 .* not fp8"):
        refuse_fp8_cache(cfg, torch.float8_e4m3fn)
    bare = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2}
    for key, value in (("layer_types", ["full_attention"] * 2), ("scoring_func", "relu"),
                       ("mlp_layer_types", ["dense", "moe"])):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            ModelConfig.from_hf_config({**bare, key: value})


def test_beam_reads_as_transformers_does():
    """Beam (`BeamForCausalLM`, BeamConfig's defaults: Beam-1.0-501B-A23B's shape): every 6th layer and the last full
    and NoPE, the others sliding (512) and rotating; 256 experts in 8 groups past three dense layers, no shared
    expert; the parameter count is transformers' model's (501 B), the full layers' query scale its function's; its
    `final_logit_softcapping` not applied (transformers' model does not). What we do not serve is refused by key."""
    import torch
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from engine.models.beam import QueryScale

    hf, cfg = _at_class_defaults("BeamConfig", {"architectures": ["BeamForCausalLM"]})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window == 512
    assert cfg.no_rope_layers == tuple(int(kind == "sliding_attention") for kind in hf.layer_types)
    assert (cfg.num_experts, cfg.moe_groups, cfg.mlp_only_layers, cfg.shared_expert_intermediate_size) == \
        (hf.num_experts, (8, 4), (0, 1, 2), 0) and cfg.final_logit_softcapping is None
    assert round(cfg.num_params() / 1e9) == 501
    positions = torch.tensor([0, 1, 2047, 100_000])
    torch.testing.assert_close(QueryScale(4).rows(positions).flatten(),
                               compute_attention_scaling(positions[None]).flatten(), rtol=0, atol=0)
    bare = {"architectures": ["BeamForCausalLM"], "num_hidden_layers": 2}
    for key, value in (("layer_types", ["chunked_attention"] * 2),
                       ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e4}})):
        with pytest.raises(ConfigError, match=f"^{key}"):
            ModelConfig.from_hf_config({**bare, key: value})


def test_hy_v4_reads_as_transformers_does():
    """HY V4 (`HYV4ForCausalLM`, HYV4Config's defaults: Hy4-preview's shape): V3.2's sparse attention (16 indexer heads
    of 128, 2,048 tokens a query; the layers past the first shared but every 4th from the second), a sink and an
    output gate a head, 4 streams, 256 experts past one dense layer, their SwiGLU clamped at 10; the parameter count
    is transformers' model's (the float32 ones: the mixes, the indexers' head weights, the routers). What we do not
    serve is refused naming the key."""
    hf, cfg = _at_class_defaults("HYV4Config", {"architectures": ["HYV4ForCausalLM"]})
    mla = cfg.mla
    assert (mla.index_heads, mla.index_head_dim, mla.index_topk, mla.rope_interleave) == \
        (hf.index_n_heads, hf.index_head_dim, hf.index_topk, False)
    assert mla.index_shared == tuple(i for i, kind in enumerate(hf.indexer_types) if kind == "shared")
    assert (cfg.num_experts, cfg.moe_groups, cfg.mlp_only_layers, cfg.swiglu_limit, cfg.attention_sinks) == \
        (hf.n_routed_experts, (1, 1), (0,), hf.swiglu_limit, True)
    hc = cfg.hyper_connections
    assert (hc.streams, hc.magnitude, hc.eps) == (hf.hc_mult, hf.hc_magnitude, hf.hc_eps)
    _, model = _meta_model(type(hf), {"architectures": ["HYV4ForCausalLM"]})
    kept = [p for name, p in [*model.named_parameters(), *model.named_buffers()]
            if any(part in name for part in ("_hc.", "hc_head.", "weights_proj.", "mlp.gate."))]
    assert cfg.num_float32_params == sum(p.numel() for p in kept)   # the mixes, indexers' head weights, routers
    bare = {"architectures": ["HYV4ForCausalLM"], "num_hidden_layers": 3}
    for key, value, named in (("indexer_types", ["shared", "full", "full"], "the first full"),
                              ("layer_types", ["full_attention"] * 3, "indexed_attention on every layer"),
                              ("mlp_layer_types", ["sparse", "dense", "sparse"], "dense layers first")):
        with pytest.raises(ConfigError, match=f"^{key}: .*{named}"):
            ModelConfig.from_hf_config({**bare, key: value})
    assert ModelConfig.from_hf_config({**bare, "swiglu_limit": 0}).swiglu_limit is None   # 0: not clamped


def test_ling3_reads_as_transformers_does():
    """Ling 3 (`BailingHybridForCausalLM`, BailingHybridConfig's defaults: Ling-3.0-Flash's shape, under its own keys:
    `num_experts`, `num_experts_per_token`, `num_expert_group`, `moe_renormalize`, `model_max_length`): a full layer
    every 6th, KDA of 32 heads of 128 (4 taps) with one-projection gates and the bounded forget gate, latent attention
    with an interleaved rope and head gates, two dense layers first, 512 experts in 8 groups; the parameter count is
    transformers' model's."""
    hf, cfg = _at_class_defaults("BailingHybridConfig", {"architectures": ["BailingHybridForCausalLM"]})
    kda = cfg.state_layers
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel, kda.full_rank, kda.gate_bound) == \
        (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim, True, hf.kda_lower_bound)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.mla.rope_interleave and cfg.head_gates
    assert (cfg.num_experts, cfg.moe_groups, cfg.mlp_only_layers, cfg.max_position_embeddings) == \
        (hf.num_experts, (hf.num_expert_group, hf.topk_group), (0, 1), hf.model_max_length)


def test_flint_reads_as_transformers_does():
    """Flint (`FlintForCausalLM`, FlintConfig's defaults): full layers first, every fourth from the second and last
    (NoPE), the rest sliding (513) and rotating, sinks, 256 experts of 512 past two dense layers, 6 a token by the flint
    router beside an ungated shared expert of 1,024; the parameter count is transformers' model's, and the float32
    ones are its router weights and sinks."""
    hf, cfg = _at_class_defaults("FlintConfig", {"architectures": ["FlintForCausalLM"]})
    assert (cfg.layer_types, cfg.sliding_window, cfg.mlp_only_layers, cfg.num_experts, cfg.moe_router) == \
        (tuple(hf.layer_types), hf.sliding_window, tuple(hf.mlp_only_layers), hf.num_experts, "flint")
    assert cfg.attention_sinks and not cfg.shared_expert_gated and cfg.no_rope_layers[:3] == (0, 0, 1)
    sparse = hf.num_hidden_layers - len(hf.mlp_only_layers)
    assert cfg.num_float32_params == sparse * hf.num_experts * hf.hidden_size + hf.num_hidden_layers * 32
    from engine.models import build_model

    small = ModelConfig.from_hf_config({"architectures": ["FlintForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                                        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 16})
    layer = build_model(small, torch.bfloat16, "cpu").layers[2]   # held as transformers holds them
    assert layer.self_attn.sinks.dtype == layer.mlp.gate.weight.dtype == torch.float32
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16


def test_every_architecture_knows_its_context_where_config_json_names_none():
    """Every architecture served reads a config.json naming no max_position_embeddings with its config class's
    default (`DEFAULT_MAX_POSITIONS` or its family's defaults): a small config is read, or refused for another key,
    never for that one (one without a known default is refused naming it, not a crash)."""
    from engine.model_config import SUPPORTED_ARCHITECTURES

    small = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4}
    for arch in SUPPORTED_ARCHITECTURES:
        try:
            ModelConfig.from_hf_config({**small, "architectures": [arch]})
        except ConfigError as exc:
            assert not str(exc).startswith("max_position_embeddings"), arch


def test_muse_glimmer_reads_as_transformers_does():
    """Muse Glimmer's text model (`MuseGlimmerForConditionalGeneration`'s text_config, transformers' defaults where it
    names none): its layer types (full every 4th counted back from the last), NoPE layers, window, scalars and the
    parameter count are what transformers' `MuseGlimmerTextConfig` and its model (built on the meta device; its head
    beside it) make of it. A rotating layer's own base, an attention soft cap and a bad `layer_rope_theta` are refused
    by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.muse_glimmer import modeling_muse_glimmer

    text = {"model_type": "muse_glimmer_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    hf = transformers.MuseGlimmerTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    card = {"architectures": ["MuseGlimmerForConditionalGeneration"], "model_type": "muse_glimmer", "text_config": text}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.architecture == "MuseGlimmerForCausalLM" and cfg.layer_types == tuple(hf.layer_types)
    assert cfg.no_rope_layers == tuple(int(theta != 0) for theta in hf.layer_rope_theta) == (1, 0, 1, 1, 1, 0)
    assert (cfg.sliding_window, cfg.final_logit_softcapping, cfg.logit_scale) == (
        hf.sliding_window, hf.final_logit_softcapping, hf.output_multiplier)
    assert cfg.muse == (hf.qk_scale_factor, hf.post_norm_eps, 0.0)
    assert (cfg.rms_norm_eps, cfg.hidden_act) == (1e-5, "silu")
    assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (False, 200_000, (200_001,))
    with torch.device("meta"):
        model = modeling_muse_glimmer.MuseGlimmerTextModel(hf)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters()) + hf.vocab_size * hf.hidden_size
    theta = hf.rope_parameters["rope_theta"]
    for key, bad in (("layer_rope_theta", {"layer_rope_theta": [theta, 5e5, theta, theta, 0, theta]}),
                     ("layer_rope_theta", {"layer_rope_theta": [theta, 0]}),
                     ("attn_logit_softcapping", {"attn_logit_softcapping": 50.0})):
        with pytest.raises(ConfigError, match=f"^text_config.{key}:"):
            ModelConfig.from_hf_config({**card, "text_config": {**text, **bad}})


def test_muse_spark_reads_as_transformers_does():
    """Muse Spark's text model (`MuseSparkForConditionalGeneration`'s text_config, transformers' defaults where it names
    none): its experts, their width and router, the dense layers `mlp_layer_types` names, the residual gates'
    temperature, and the parameter count (its correction biases buffers there) and float32 parameters are what
    transformers' `MuseSparkTextConfig` and its model (built on the meta device; its head beside it) make of it. A bad
    `mlp_layer_types` is refused by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.muse_spark import modeling_muse_spark

    text = {"model_type": "muse_spark_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 8, "moe_intermediate_size": 32, "moe_hidden_size": 48,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
    hf = transformers.MuseSparkTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    card = {"architectures": ["MuseSparkForConditionalGeneration"], "model_type": "muse_spark", "text_config": text}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.architecture == "MuseSparkForCausalLM" and cfg.mlp_only_layers == (0,)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_latent_size) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.moe_hidden_size) == (8, 8, 32, 48)
    assert cfg.muse == (hf.qk_scale_factor, hf.post_norm_eps, hf.residual_gate_temperature)
    assert (cfg.rope_theta, cfg.logit_scale, cfg.routed_scaling_factor) == (
        hf.rope_parameters["rope_theta"], hf.output_multiplier, hf.routed_scaling_factor)
    with torch.device("meta"):
        model = modeling_muse_spark.MuseSparkTextModel(hf)
    assert cfg.num_params() == _params_and_router_biases(model) + hf.vocab_size * hf.hidden_size
    held = [p for name, p in model.named_parameters() if name.endswith(("residual_gate.gate", "mlp.gate.weight"))]
    assert cfg.num_float32_params == sum(p.numel() for p in held) + 3 * hf.num_local_experts   # and the biases
    for bad in (["dense"] * 3, ["dense", "sparse", "moe", "sparse"]):
        with pytest.raises(ConfigError, match="^text_config.mlp_layer_types:"):
            ModelConfig.from_hf_config({**card, "text_config": {**text, "mlp_layer_types": bad}})


def test_north_reads_as_transformers_does():
    """North (`CohereCompassForCausalLM`, and its vision model's text_config): a rope per layer type (MRoPE's sections
    dropped: one position on text), a null type NoPE, the sliding layers' own base, the layers all full and the logits
    unscaled by default, and the parameter count transformers' model (on the meta device) has. A layer type without a
    rope entry (transformers' rotary would fail on it) and a scaled sliding rope are refused by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.cohere_compass import modeling_cohere_compass

    ropes = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
             "full_attention": {"rope_type": "default", "rope_theta": 5e5}}
    text = {"model_type": "cohere_compass_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "rope_parameters": ropes}
    hf = transformers.CohereCompassTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    card = {"architectures": ["CohereCompassForConditionalGeneration"], "model_type": "cohere_compass",
            "text_config": text}
    cfg = ModelConfig.from_hf_config(card)
    assert cfg.architecture == "CohereCompassForCausalLM" and cfg.layer_types == tuple(hf.layer_types)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.no_rope_layers) == (5e5, 10000.0, (1, 1, 1))
    assert (cfg.logit_scale, cfg.sliding_window, cfg.rms_norm_eps) == (1.0, hf.sliding_window, hf.layer_norm_eps)
    with torch.device("meta"):
        model = modeling_cohere_compass.CohereCompassTextModel(hf)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())   # the head tied
    alone = ModelConfig.from_hf_config({**text, "architectures": ["CohereCompassForCausalLM"],
                                        "layer_types": None, "rope_parameters": {"full_attention": None}})
    assert alone.layer_types == ("full_attention",) * 3 and alone.no_rope_layers == (0, 0, 0)
    for key, ropes_bad in (("rope_parameters.sliding_attention", {"full_attention": None}),
                           ("rope_parameters.sliding_attention.rope_type", {**ropes, "sliding_attention": {
                               "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})):
        with pytest.raises(ConfigError, match=f"^text_config.{key}:"):
            ModelConfig.from_hf_config({**card, "text_config": {**text, "rope_parameters": ropes_bad}})
