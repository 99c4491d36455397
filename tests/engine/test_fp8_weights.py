"""FP8 weights held as FP8 (`quantization`, `engine.fp8_weights`, `engine.layers.fp8_linear.Fp8Linear`): an FP8
checkpoint's projections keep their stored values and scales, a float checkpoint's are quantized a row at a time as
read; greedy decoding against transformers, tensor parallelism against one rank, what the model holds against what
the capacity plan counts (`engine.models.held_weight_bytes`), and the choices and refusals of the device key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import ConfigError, EngineConfig
from engine.fp8_weights import ROW_SCALES, WHOLE, fp8_cuts_aligned, fp8_part, served_fp8_block
from engine.layers.fp8_linear import Fp8Linear
from engine.llm_engine import LLMEngine
from engine.model import WeightLoadError
from engine.models import held_weight_bytes
from engine.sampling import SamplingParams
from kernels.fp8_gemm import dequantize_blocks, quantize_rows
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import (LONGCAT, QWEN3_MOE, _compressed_fp8_checkpoint, _fp8_checkpoint,
                                           _hf_greedy)

PROMPTS = [[5, 9, 200, 31, 7], list(range(40, 77))]
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _engine(folder, quantization: str, **kwargs) -> LLMEngine:
    return LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False,
                               quantization=quantization, **kwargs)


def _greedy(engine: LLMEngine, max_tokens: int = 12) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _fp8_layers(engine: LLMEngine) -> dict[str, Fp8Linear]:
    return {name: m for name, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}


def _round_rows(hf) -> None:
    """transformers' model with each layer's projection quantized a row at a time and dequantized back."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(dequantize_blocks(*quantize_rows(module.weight), ROW_SCALES))


def _stored(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("kind", ["tensor", "blocks", "channel"])
def test_an_fp8_checkpoint_is_held_as_stored_and_decodes_as_transformers_dequantizes_it(tmp_path, builtin_path,
                                                                                      kind, caplog):
    """`quantization: fp8` over an FP8 checkpoint (one scale a tensor, Mistral's kind; blocks of 16 x 32, DeepSeek's
    and Qwen's kind; llm-compressor's one a row): every projection of every layer is an Fp8Linear whose values are
    the stored bytes (q, k and v at their rows of the fused qkv_proj) and whose scales are the stored ones, the
    model holds about half the float weights' bytes of those projections, and it decodes greedily as transformers'
    own FP8 loading (which dequantizes the checkpoint) does."""
    import transformers

    folder = make_tiny_model(tmp_path / "fp8", "qwen3" if kind == "blocks" else "llama", builtin_path,
                             head_dim=16, intermediate_size=128)
    if kind == "channel":   # transformers' model given the weights the format defines (its loading needs a package)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, weight in _compressed_fp8_checkpoint(folder, "channel").items():
                hf.get_parameter(name).copy_(weight)
    else:
        _fp8_checkpoint(folder, (16, 32) if kind == "blocks" else None)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with caplog.at_level("INFO", logger="cliffguard.engine"):
        held, dequantized = _engine(folder, "fp8"), _engine(folder, "none")
    layers_held = 4 * held.model_config.num_layers
    assert [r.getMessage() for r in caplog.records if "held in FP8" in r.getMessage()] == [
        f"weights: {layers_held} projections held in FP8 (as stored), the rest in float32"]   # the FP8 engine's alone
    layers = _fp8_layers(held)
    assert sorted(layers) == sorted(f"layers.{i}.{p}" for i in range(held.model_config.num_layers)
                                    for p in PROJECTIONS)
    assert held.model.fp8_exact and not _fp8_layers(dequantized)
    stored = _stored(folder)
    q = stored["model.layers.1.self_attn.k_proj.weight"]
    qkv = layers["layers.1.self_attn.qkv_proj"]
    rows = held.model_config.num_heads * 16
    assert torch.equal(qkv.weight[rows:rows + q.shape[0]].view(torch.uint8), q.view(torch.uint8))
    scale_name = "model.layers.1.mlp.down_proj." + ("weight_scale" if kind == "channel" else "weight_scale_inv")
    down = layers["layers.1.mlp.down_proj"]
    assert torch.equal(dequantize_blocks(down.weight, down.weight_scale, down.block),
                       dequantize_blocks(stored["model.layers.1.mlp.down_proj.weight"], stored[scale_name],
                                         held.model_config.fp8_weight_block))
    float_bytes = sum(m.weight.numel() * 4 for m in layers.values())
    saved = dequantized.weights_bytes - held.weights_bytes
    assert 0.7 * float_bytes < saved < 0.75 * float_bytes   # 3 of 4 bytes a weight, less the scales
    for engine, quantization in ((held, "fp8"), (dequantized, "none")):   # what the capacity plan counts
        assert engine.weights_bytes == held_weight_bytes(engine.model_config, engine.shard, torch.float32,
                                                         quantization, "cpu")
    want = [_hf_greedy(hf, p, 12, eos_ids=None) for p in PROMPTS]
    assert _greedy(held) == want == _greedy(dequantized)


def test_a_qwen3_moe_fp8_checkpoint_holds_its_experts_as_stored_and_decodes_as_transformers(tmp_path, builtin_path):
    """Qwen3-MoE's FP8 release kind (every projection and every expert's in blocks, here 16 x 32): each sparse
    layer's stacked w13 / w2 hold the stored expert bytes and their scales (gate then up rows of each expert), the
    dense layer's MLP and the attention are Fp8Linears; greedy decoding is transformers' (which dequantizes), and
    the bytes held are what the capacity plan counts."""
    import transformers

    folder = make_tiny_model(tmp_path / "fp8", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "mlp_only_layers": [1]})
    _fp8_checkpoint(folder, (16, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = _engine(folder, "fp8")
    held = engine.model.fp8_layers
    assert engine.model.fp8_exact and {"layers.0.mlp.w13", "layers.0.mlp.w2", "layers.1.mlp.gate_up_proj.weight",
                                       "layers.1.self_attn.qkv_proj.weight"} <= set(held)
    block = engine.model.layers[0].mlp
    assert block.w13.dtype == torch.float8_e4m3fn and block.w13_scale.shape == (8, 4, 2)
    stored = _stored(folder)
    up = stored["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert torch.equal(block.w13[5, 32:].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(block.w13_scale[5, 2:], stored["model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"])
    assert engine.weights_bytes == held_weight_bytes(engine.model_config, engine.shard, torch.float32, "fp8", "cpu")
    assert _greedy(engine) == [_hf_greedy(hf, p, 12, eos_ids=None) for p in PROMPTS] == _greedy(_engine(folder,
                                                                                                       "none"))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_a_deepseek_fp8_checkpoint_holds_its_experts_and_projections_as_stored(tmp_path, builtin_path, arch):
    """DeepSeek V3's and V3.2's FP8 releases (blocks, here 16 x 16): the experts, the dense layer's MLP and each
    layer's o_proj held as stored (their loading reorders only the latent attention's and the indexer's rotary rows,
    which stay dequantized, as the shared experts do), greedy decoding as the dequantized model's."""
    from tests.engine.test_engine_vs_hf import DEEPSEEK, DEEPSEEK_V32

    folder = make_tiny_model(tmp_path / "fp8", arch, builtin_path, **(DEEPSEEK if arch == "deepseek_v3" else
                                                                       DEEPSEEK_V32))
    _fp8_checkpoint(folder, (16, 16))
    engine = _engine(folder, "fp8")
    assert engine.model.fp8_exact
    sparse = [i for i, layer in enumerate(engine.model.layers) if hasattr(layer.mlp, "w13")]
    assert sparse and {f"layers.{sparse[0]}.mlp.w13", "layers.0.self_attn.o_proj.weight",
                       "layers.0.mlp.gate_up_proj.weight"} <= set(engine.model.fp8_layers)
    assert engine.weights_bytes == held_weight_bytes(engine.model_config, engine.shard, torch.float32, "fp8", "cpu")
    assert _greedy(engine) == _greedy(_engine(folder, "none"))


@pytest.mark.parametrize("arch,unheld", [("mixtral", False), ("glm4_moe", True), ("minimax_m2", True),
                                         ("mimo_v2_flash", True)])
def test_renamed_and_reordered_fp8_checkpoints_hold_what_they_read_unchanged(tmp_path, builtin_path, arch, unheld):
    """Mixtral's FP8 checkpoints (its experts' w1/w2/w3 renamed as read) hold every projection and expert as stored;
    GLM-4.5's, MiniMax-M2's and MiMo-V2-Flash's (q/k rows reordered for their partial rotary as read) hold their
    experts and o_proj as stored and qkv_proj dequantized; each decodes greedily as the dequantized model."""
    from tests.engine.test_engine_vs_hf import GLM4_MOE, MIXTRAL

    overrides = {"mixtral": MIXTRAL, "glm4_moe": {**GLM4_MOE, "use_qk_norm": True},
                 "minimax_m2": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                    rotary_dim=4, num_hidden_layers=3),
                 "mimo_v2_flash": dict(num_hidden_layers=3, head_dim=32, v_head_dim=16, num_key_value_heads=1,
                                       sliding_window=8, n_routed_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, pad_token_id=0)}[arch]
    folder = make_tiny_model(tmp_path / "fp8", arch, builtin_path, **overrides)
    _fp8_checkpoint(folder, (16, 16))
    engine = _engine(folder, "fp8")
    held = set(engine.model.fp8_layers)
    assert engine.model.fp8_exact and "layers.1.mlp.w13" in held and "layers.1.self_attn.o_proj.weight" in held
    assert ("layers.1.self_attn.qkv_proj.weight" in held) != unheld
    block = engine.model.layers[1].mlp
    stored = _stored(folder)
    name = next(n for n in stored if ".layers.1." in n and ".experts.2." in n and n.endswith(("w3.weight",
                                                                                                "up_proj.weight")))
    inter = block.w13.shape[1] // 2
    assert torch.equal(block.w13[2, inter:].view(torch.uint8), stored[name].view(torch.uint8))
    assert engine.weights_bytes == held_weight_bytes(engine.model_config, engine.shard, torch.float32, "fp8", "cpu")
    assert _greedy(engine) == _greedy(_engine(folder, "none"))


def test_a_float_checkpoint_is_quantized_a_row_at_a_time_and_decodes_as_its_quantized_weights_do(tmp_path,
                                                                                              builtin_path):
    """`quantization: fp8` over a float checkpoint: each projection's rows quantized over their own largest
    magnitude (`quantize_rows`), q/k/v each their own rows; the model decodes greedily as transformers does with
    those weights put back (each stored projection quantized and dequantized a row at a time); `auto` on a CPU holds
    the float weights."""
    import transformers

    folder = make_tiny_model(tmp_path / "float", "llama", builtin_path, head_dim=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _round_rows(hf)
    engine = _engine(folder, "fp8")
    layers = _fp8_layers(engine)
    assert len(layers) == 4 * engine.model_config.num_layers and not engine.model.fp8_exact
    assert all(m.block == (1, m.in_features) for m in layers.values())
    assert not _fp8_layers(_engine(folder, "auto"))
    assert _greedy(engine) == [_hf_greedy(hf, p, 12, eos_ids=None) for p in PROMPTS]


def test_longcat_flash_quantized_as_read_holds_its_experts_and_dense_mlps_in_fp8(tmp_path, builtin_path):
    """LongCat-Flash under `quantization: fp8`: its experts (run by its own forward, beside the zero experts), its
    sublayers' dense MLPs and o_proj held in FP8 a row at a time; it decodes greedily as transformers does with those
    weights rounded so (each expert's rows too; the router and the latent projections left float, as ours are)."""
    import transformers

    folder = make_tiny_model(tmp_path / "longcat", "longcat_flash", builtin_path, **LONGCAT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(("o_proj", "gate_proj", "up_proj", "down_proj")):
                module.weight.copy_(dequantize_blocks(*quantize_rows(module.weight), ROW_SCALES))
            if hasattr(module, "zero_expert_num"):   # the stacked experts: each expert's rows
                for stack in (module.gate_up_proj, module.down_proj):
                    for expert in stack:
                        expert.copy_(dequantize_blocks(*quantize_rows(expert), ROW_SCALES))
    engine = _engine(folder, "fp8")
    held = _fp8_layers(engine)
    assert sorted({name.split(".", 2)[2] for name in held}) == ["mlp.down_proj", "mlp.gate_up_proj",
                                                                 "self_attn.o_proj"]
    assert len(held) == 3 * engine.model_config.num_layers
    assert all(layer.moe.fp8_block == ROW_SCALES for layer in engine.model.layers[::2])
    assert _greedy(engine) == [_hf_greedy(hf, p, 12, eos_ids=None) for p in PROMPTS]


def test_a_checkpoint_whose_cuts_split_its_blocks_is_requantized_by_rows(tmp_path, builtin_path):
    """Blocks of 32 rows over k_proj's 16 rows: its rows of qkv_proj start inside a block, so the checkpoint's
    blocks cannot be kept (`fp8_cuts_aligned`); `fp8` requantizes its dequantized weights a row at a time (a second
    rounding of each value) and decodes greedily as transformers does with its dequantized weights so requantized;
    `auto` holds it dequantized."""
    import transformers

    folder = make_tiny_model(tmp_path / "fp8", "llama", builtin_path, head_dim=16, num_key_value_heads=1)
    _fp8_checkpoint(folder, (32, 32))
    engine = _engine(folder, "fp8")
    assert _fp8_layers(engine) and not engine.model.fp8_exact
    assert all(m.block[0] == 1 for m in _fp8_layers(engine).values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _round_rows(hf)
    assert _greedy(engine) == [_hf_greedy(hf, p, 12, eos_ids=None) for p in PROMPTS]
    assert not _fp8_layers(_engine(folder, "auto"))


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_hold_their_cuts_of_the_stored_blocks_and_decode_as_one(tmp_path, builtin_path):
    """Tensor parallelism 2 over a Qwen3-MoE FP8 checkpoint in blocks of 16 x 16: each rank holds its rows of the
    column-parallel projections, its columns of o_proj and down_proj, and its half of each expert's intermediate
    rows (gate/up) and columns (down), each with the stored scales of those blocks; the two ranks decode what one
    does."""
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "fp8", "qwen3_moe", builtin_path,
                             **{**QWEN3_MOE, "intermediate_size": 128, "mlp_only_layers": [1]})
    _fp8_checkpoint(folder, (16, 16))
    one = LLMEngine(_tp_config(folder, 1), progress=False)
    whole = _fp8_layers(one)["layers.0.self_attn.qkv_proj"]
    reference = _generate(one, PROMPTS)
    two = LLMEngine(_tp_config(folder, 2), progress=False)
    assert two.model.fp8_exact and len(_fp8_layers(two)) == 2 * two.model_config.num_layers + 2
    qkv, down = _fp8_layers(two)["layers.0.self_attn.qkv_proj"], _fp8_layers(two)["layers.1.mlp.down_proj"]
    heads = two.shard.num_heads * 16
    assert qkv.out_features * 2 == whole.out_features and down.in_features * 2 == 128
    experts, all_experts = two.model.layers[0].mlp, one.model.layers[0].mlp   # each rank's half of each expert
    assert experts.w13.shape == (8, 32, 64) and torch.equal(experts.w13[3, :16].view(torch.uint8),
                                                            all_experts.w13[3, :16].view(torch.uint8))
    assert torch.equal(experts.w2_scale, all_experts.w2_scale[:, :, :1])
    assert torch.equal(qkv.weight[:heads].view(torch.uint8), whole.weight[:heads].view(torch.uint8))
    assert torch.equal(qkv.weight_scale[:heads // 16], whole.weight_scale[:heads // 16])
    assert two.weights_bytes == held_weight_bytes(two.model_config, two.shard, torch.float32, "fp8", "cpu")
    _assert_same_or_near_tie(reference, _generate(two, PROMPTS))


def _tp_config(folder, tp: int) -> EngineConfig:
    from engine.config import CacheConfig, PoolConfig, SchedulerConfig

    pool = PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    return EngineConfig(model=str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp,
                        cpu_threads=1, cache=CacheConfig(block_size=8), pools=(pool,), quantization="fp8")


def test_the_device_key_chooses_and_refuses_by_name():
    """auto keeps an FP8 checkpoint's blocks on a GPU that converts FP8 (8.9 and up) where they can be kept, else
    holds the model's dtype; fp8 holds FP8 everywhere (rows for a float checkpoint or blocks that cannot be kept)
    and is refused, naming the key, on an older GPU; a value we do not know is refused naming the key."""
    blocks = (128, 128)
    assert served_fp8_block(blocks, "auto", "cuda", (9, 0), True) == blocks
    assert served_fp8_block(blocks, "auto", "cuda", None, True) == blocks   # the plan's GPU it has not seen
    assert served_fp8_block(blocks, "auto", "cuda", (8, 0), True) is None
    assert served_fp8_block(blocks, "auto", "cpu", None, True) is None
    assert served_fp8_block(blocks, "auto", "cuda", (9, 0), False) is None
    assert served_fp8_block(None, "auto", "cuda", (9, 0), True) is None
    assert served_fp8_block((WHOLE, WHOLE), "fp8", "cpu", None, True) == (1, WHOLE)
    assert served_fp8_block(blocks, "fp8", "cpu", None, False) == ROW_SCALES
    assert served_fp8_block(None, "fp8", "cpu", None, True) == ROW_SCALES
    assert served_fp8_block(blocks, "none", "cuda", (9, 0), True) is None
    with pytest.raises(ConfigError, match="quantization: fp8 needs a GPU of compute capability 8.9"):
        served_fp8_block(None, "fp8", "cuda", (8, 0), True)
    with pytest.raises(ConfigError, match="quantization: must be one of auto, fp8, mxfp4, int4, int8, none, got .nf4."):
        EngineConfig(quantization="nf4")
    assert fp8_cuts_aligned((16, 32), {"qkv_proj": ([64, 96], []), "o_proj": ([], [64])})
    assert not fp8_cuts_aligned((16, 32), {"o_proj": ([], [48])})
    assert fp8_cuts_aligned((WHOLE, WHOLE), {"qkv_proj": ([8], []), "o_proj": ([], [8])})


def test_a_part_takes_the_scales_of_the_blocks_it_keeps_and_refuses_a_split_block():
    """fp8_part: a rank's rows 32..63 of a [64, 48] weight in blocks of 16 x 16, at row 16 of its layer, take scale
    rows 2..3; a per-tensor scale is spread over the layer's rows; a cut through a block is refused by name; a float
    weight (a projection the checkpoint left unquantized) is quantized in the layer's blocks."""
    values = torch.randn(64, 48).to(torch.float8_e4m3fn)
    scale = torch.arange(12.0).view(4, 3)
    cut = lambda t: t.narrow(0, 32, 32)   # noqa: E731
    kept, got = fp8_part(values[32:], scale, (16, 16), (64, 48), cut, (16, 16), 16)
    assert kept is values[32:] or torch.equal(kept.view(torch.uint8), values[32:].view(torch.uint8))
    assert torch.equal(got, scale[2:4])
    _, spread = fp8_part(values, torch.tensor(0.5), (WHOLE, WHOLE), (64, 48), lambda t: t, (1, 48), 0)
    assert spread.shape == (64, 1) and (spread == 0.5).all()
    with pytest.raises(ValueError, match="a cut at row 8 splits a scale block of 16"):
        fp8_part(values[8:24], scale, (16, 16), (64, 48), lambda t: t.narrow(0, 8, 16), (16, 16), 0)
    weight = torch.randn(20, 48)   # a projection an FP8 checkpoint left in float: quantized in the layer's blocks
    values, scales = fp8_part(weight, None, (16, 16), (20, 48), lambda t: t, (16, 16), 0)
    assert scales.shape == (2, 3) and torch.allclose(dequantize_blocks(values, scales, (16, 16)), weight,
                                                     rtol=2 ** -4, atol=1e-6)


def test_a_missing_scale_is_refused_by_name(tmp_path, builtin_path):
    """A held FP8 weight whose scales the checkpoint lacks is refused naming the tensor, as the dequantizing
    loading refuses it."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path / "fp8", "llama", builtin_path, head_dim=16)
    _fp8_checkpoint(folder, (16, 32))
    shard = folder / "model-00002-of-00002.safetensors"
    scales = load_file(shard)
    save_file({k: v for k, v in scales.items() if "layers.0.mlp.up_proj" not in k}, str(shard))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    weight_map["weight_map"] = {n: f for n, f in weight_map["weight_map"].items() if "layers.0.mlp.up_proj.weight_"
                                not in n}
    index.write_text(json.dumps(weight_map))
    with pytest.raises(WeightLoadError, match="up_proj.weight_scale_inv: missing"):
        _engine(folder, "fp8")


def test_the_roofline_reads_the_bytes_held_in_fp8():
    """The simulator's roofline over a device holding FP8 weights reads their bytes: Qwen3-32B-FP8's decode step on
    an H100 preset reads about half of bfloat16's weights; Qwen3-30B-A3B's experts held in FP8 (`fp8`) count one
    byte a weight plus their scales (`held_expert_bytes`)."""
    from engine.model_config import ModelConfig
    from engine.models import held_expert_bytes
    from engine.parallel import ShardShape
    from engine.roofline import PRESETS, RooflineStepTime, expert_params

    examples = Path(__file__).resolve().parents[2] / "config" / "examples"
    dense = ModelConfig.from_folder(examples / "qwen3-32b-fp8")
    held = held_weight_bytes(dense, ShardShape.of(dense), torch.bfloat16, "auto", "cuda")
    bf16 = RooflineStepTime(PRESETS["h100"], dense, 2)
    fp8 = RooflineStepTime(PRESETS["h100"], dense, 2, held_bytes=(held, 0))
    assert fp8.weights_bytes == held and 0.5 < fp8.weights_bytes / bf16.weights_bytes < 0.53
    moe = ModelConfig.from_folder(examples / "qwen3-30b-a3b")
    experts = expert_params(moe)
    assert held_expert_bytes(moe, torch.bfloat16, "none", "cuda") == 2 * experts
    assert experts < held_expert_bytes(moe, torch.bfloat16, "fp8", "cuda") < 1.01 * experts


def test_a_llama_3_2_vision_fp8_checkpoint_holds_its_renumbered_layers_as_stored(tmp_path, builtin_path):
    """Llama 3.2 Vision's FP8 checkpoints (its 90B on two H100s): the text model's self-attention layers, renumbered
    past the cross-attention layer as read, hold their projections as stored (the cross layer's and the vision tower's
    FP8 weights dequantized and dropped), and decode greedily as the dequantized model."""
    import shutil

    import transformers

    text = transformers.MllamaTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, cross_attention_layers=[1])
    vision = transformers.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_global_layers=1, attention_heads=2, image_size=28, patch_size=14,
                                             intermediate_layers_indices=[0], vision_output_dim=64)
    torch.manual_seed(0)
    hf = transformers.MllamaForConditionalGeneration(transformers.MllamaConfig(text_config=text.to_dict(),
                                                                              vision_config=vision.to_dict()))
    folder = tmp_path / "mllama"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    _fp8_checkpoint(folder, (16, 16))
    engine = _engine(folder, "fp8")
    assert engine.model.fp8_exact and engine.model_config.skipped_layers == (1,)
    assert set(_fp8_layers(engine)) == {f"layers.{i}.{p}" for i in range(3) for p in PROJECTIONS}
    stored = _stored(folder)["language_model.model.layers.3.self_attn.o_proj.weight"]   # the engine's layer 2
    assert torch.equal(engine.model.layers[2].self_attn.o_proj.weight.view(torch.uint8), stored.view(torch.uint8))
    assert _greedy(engine) == _greedy(_engine(folder, "none"))
