"""GPT-OSS's MXFP4 experts held as stored (`quantization`, `engine.models.held_packed`, `SparseMoeBlock.hold_packed`):
each expert's rows keep the checkpoint's bytes and scales (4.25 bits a weight), the model decodes greedily as
transformers' does over the dequantized checkpoint, two ranks hold their halves and decode as one, the capacity plan
counts what is held, and the device key chooses and refuses by name."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models import held_expert_bytes, held_packed, held_weight_bytes
from engine.models.qwen3_moe import SparseMoeBlock
from engine.parallel import ShardShape
from engine.sampling import SamplingParams
from kernels.mxfp4 import dequantize_packed
from tests.engine.test_engine_vs_hf import _hf_greedy, mxfp4_gpt_oss

PROMPTS = [[1, *range(40, 70)], [5, 9, 200, 3]]


def _config(folder, quantization: str, tp: int = 1) -> EngineConfig:
    from engine.config import CacheConfig, PoolConfig, SchedulerConfig

    pool = PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    return EngineConfig(model=str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp,
                        cpu_threads=1, cache=CacheConfig(block_size=8), pools=(pool,), quantization=quantization)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _sparse(engine: LLMEngine) -> list[SparseMoeBlock]:
    return [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]


def test_mxfp4_experts_are_held_as_stored_and_decode_as_transformers(tmp_path, builtin_path, caplog):
    """`quantization: mxfp4` on a CPU: every layer's w13 holds each expert's stored gate rows, then its up rows (the
    checkpoint interleaves them), byte for byte, with their e8m0 scales, w2 the stored down rows; the model holds
    4.25 bits an expert weight (what the capacity plan counts, to the byte) and decodes greedily as transformers'
    model over the dequantized checkpoint. `none` holds the dequantized weights: the same tokens."""
    folder, hf, state = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path)
    with caplog.at_level("INFO", logger="cliffguard.engine"):
        held = LLMEngine(_config(folder, "mxfp4"), progress=False)
    assert "weights: the experts of 3 layers held in MXFP4 as stored" in caplog.text
    blocks = state["model.layers.1.mlp.experts.gate_up_proj_blocks"]           # [experts, 2 x inter, groups, 16]
    layer = _sparse(held)[1]
    assert layer.packed == "mxfp4" and layer.w13.dtype == layer.w13_scales.dtype == torch.uint8
    assert torch.equal(layer.w13[2, :64], blocks[2, 0::2].flatten(-2))
    assert torch.equal(layer.w13[2, 64:], blocks[2, 1::2].flatten(-2))
    assert torch.equal(layer.w13_scales[2, 64:], state["model.layers.1.mlp.experts.gate_up_proj_scales"][2, 1::2])
    assert torch.equal(layer.w2, state["model.layers.1.mlp.experts.down_proj_blocks"].flatten(-2))
    assert torch.equal(dequantize_packed(layer.w2[3], layer.w2_scales[3], torch.float32),
                       hf.get_parameter("model.layers.1.mlp.experts.down_proj")[3].T)
    config = held.model_config
    plain = held_weight_bytes(config, ShardShape.of(config), torch.float32, "none", "cpu")
    experts = sum(m.w13.numel() + m.w2.numel() for m in _sparse(held)) * 2            # their weights
    assert held.weights_bytes == held_weight_bytes(config, ShardShape.of(config), torch.float32, "mxfp4", "cpu")
    assert held.weights_bytes == plain - experts * 4 + experts // 2 + experts // 32
    assert held_expert_bytes(config, torch.float32, "mxfp4", "cpu") == experts // 2 + experts // 32
    tokens = _greedy(held)
    assert tokens == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    dequantized = LLMEngine(_config(folder, "none"), progress=False)
    assert not any(m.packed for m in _sparse(dequantized)) and dequantized.weights_bytes == plain
    assert _greedy(dequantized) == tokens


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_hold_their_halves_of_each_expert_and_decode_as_one(tmp_path, builtin_path):
    """Tensor parallelism 2: each rank holds its 32 of each expert's 64 gate and up rows and the packed bytes and
    scales of its 32 down inputs, as stored, and the two decode what one does."""
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder, _, state = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path)
    one = LLMEngine(_config(folder, "mxfp4"), progress=False)
    reference = _generate(one, PROMPTS)
    two = LLMEngine(_config(folder, "mxfp4", tp=2), progress=False)
    assert two.weights_bytes == held_weight_bytes(two.model_config, two.shard, torch.float32, "mxfp4", "cpu")
    layer, whole = _sparse(two)[0], _sparse(one)[0]                       # rank 0's half
    assert layer.w13.shape == (4, 64, 32) and torch.equal(layer.w13[:, :32], whole.w13[:, :32])
    assert torch.equal(layer.w13[:, 32:], whole.w13[:, 64:96])
    down = state["model.layers.0.mlp.experts.down_proj_blocks"].flatten(-2)   # [experts, hidden, inter / 2]
    assert torch.equal(layer.w2, down[:, :, :16]) and torch.equal(layer.w2_scales, whole.w2_scales[:, :, :1])
    _assert_same_or_near_tie(reference, _generate(two, PROMPTS))


def test_the_device_key_holds_mxfp4_experts_where_it_says_and_refuses_by_name(tmp_path, builtin_path):
    """auto holds MXFP4 experts as stored on a GPU and dequantizes them on a CPU; fp8 and mxfp4 hold them on any
    device (fp8 beside its FP8 attention); none dequantizes. mxfp4 is refused, naming the key, for a checkpoint
    without MXFP4 experts and for a rank's share of the experts that is not whole groups of 32 inputs (auto then
    dequantizes)."""
    folder, _, _ = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path, intermediate_size=96)
    config = ModelConfig.from_folder(folder)
    one, two = ShardShape.of(config), ShardShape.of(config, 0, 2)
    assert config.mxfp4_experts
    assert [held_packed(config, one, q, "cuda") for q in ("auto", "fp8", "mxfp4", "none")] == ["mxfp4"] * 3 + [None]
    assert [held_packed(config, one, q, "cpu") for q in ("auto", "fp8", "mxfp4", "none")] == [None, "mxfp4", "mxfp4",
                                                                                               None]
    assert held_packed(config, two, "auto", "cuda") is None   # 48 inputs a rank
    with pytest.raises(ConfigError, match=r"^quantization: mxfp4 under tensor parallelism 2 cuts each expert's 96 "
                                          r"inputs into shares of 48, not whole groups of 32"):
        held_packed(config, two, "mxfp4", "cuda")
    plain = ModelConfig.from_folder(make_plain(tmp_path, builtin_path))
    assert held_packed(plain, ShardShape.of(plain), "auto", "cuda") is None
    with pytest.raises(ConfigError, match=r"^quantization: mxfp4 holds a checkpoint's MXFP4 experts as stored"):
        held_packed(plain, ShardShape.of(plain), "mxfp4", "cpu")
    with pytest.raises(ConfigError, match=r"^quantization: int4 holds a checkpoint's INT4 experts as stored; this "
                                          r"checkpoint has MXFP4 ones"):
        held_packed(config, one, "int4", "cpu")
    fp8 = LLMEngine(_config(folder, "fp8"), progress=False)
    assert all(m.packed == "mxfp4" and m.fp8_block is None for m in _sparse(fp8)) and fp8.model.fp8_layers
    assert fp8.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match="quantization: must be one of auto, fp8, mxfp4, int4, int8, none, got 'nf4'"):
        EngineConfig(quantization="nf4")


def make_plain(tmp_path, builtin_path):
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import GPT_OSS

    return make_tiny_model(tmp_path / "plain", "gpt_oss", builtin_path, **GPT_OSS)


def test_the_roofline_reads_the_bytes_held_in_mxfp4():
    """The simulator's roofline reads gpt-oss-120b's experts as held: 4.25 bits a weight on a GPU (`auto`), the
    model's dtype where they are dequantized (`auto` on a CPU, `none`)."""
    from pathlib import Path

    from engine.roofline import expert_params

    config = ModelConfig.from_folder(Path(__file__).resolve().parents[2] / "config" / "examples" / "gpt-oss-120b")
    weights = 36 * 128 * 3 * 2880 * 2880
    assert held_expert_bytes(config, torch.bfloat16, "auto", "cuda") == weights // 2 + weights // 32
    for quantization, device in (("auto", "cpu"), ("none", "cuda")):
        assert held_expert_bytes(config, torch.bfloat16, quantization, device) == 2 * expert_params(config)
    assert 2 * weights <= 2 * expert_params(config) < 2.01 * weights
