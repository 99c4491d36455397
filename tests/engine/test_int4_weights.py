"""Pack-quantized INT4 checkpoints (`engine.int4_weights`: Kimi K2 Thinking's routed experts, llm-compressor's W4A16
releases), written by compressed-tensors' own packing: the routed experts and the decoder layers' projections held as
stored (`quantization: int4`, and `auto` on a GPU), the layers the config's ignore list names in float, and all of
them dequantized as read otherwise; greedy decoding against transformers' model holding the weights compressed-tensors'
unpacking defines, tensor parallelism against one rank, what the model holds against what the capacity plan counts,
and the config's refusals by key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import ConfigError
from engine.int4_weights import dequantize_int4, int4_quantizes, pack_quantized_weights
from engine.layers.int4_linear import Int4Linear
from engine.llm_engine import LLMEngine
from engine.model import WeightLoadError
from engine.model_config import ModelConfig
from engine.models import build_model, held_expert_bytes, held_packed, held_weight_bytes
from engine.models.qwen3_moe import SparseMoeBlock
from engine.parallel import ShardShape
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import DEEPSEEK, QWEN3_MOE, _hf_greedy, _taken_weights
from tests.engine.test_mxfp4_weights import PROMPTS, _config, _greedy, _sparse


# Kimi K2's kind: DeepSeek V3's layers, the routed experts alone in INT4; a W4A16 release's: every projection
MODELS = {"deepseek_v3": (DEEPSEEK, True), "qwen3_moe": ({**QWEN3_MOE, "moe_intermediate_size": 64}, False)}


def int4_checkpoint(folder, experts_only: bool, group: int = 32):
    """The tiny checkpoint in `folder` rewritten as a pack-quantized one (each quantized projection's values
    round(w / scale) in -8..7 packed by compressed-tensors' `pack_to_int32`, bfloat16 scales of a group's largest
    value over 7.5, its shape), and beside it a float checkpoint (`<folder>-float`) of the weights compressed-tensors'
    `unpack_from_int32` and the scales define, for transformers. Returns that folder."""
    from safetensors.torch import save_file

    # compressed-tensors' packing (imported here, not at collection: it imports triton, which the kernels' tests must
    # import first, under their interpreter)
    pack_quantized = pytest.importorskip("compressed_tensors.compressors")   # pack_to_int32, unpack_from_int32
    reference = folder.parent / f"{folder.name}-float"
    shutil.copytree(folder, reference)
    stored, floats = {}, {}
    for name, w in _taken_weights(folder).items():
        if not (name.endswith("proj.weight") and ".layers." in name and (".mlp.experts." in name or not experts_only)):
            stored[name] = floats[name] = w
            continue
        rows, cols = w.shape
        grouped = w.float().view(rows, cols // group, group)
        scale = (grouped.abs().amax(dim=-1) / 7.5).clamp(min=1e-6).to(torch.bfloat16)
        values = torch.round(grouped / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).view(rows, cols)
        key = name.removesuffix("weight")
        packed = pack_quantized.pack_to_int32(values, 4)
        stored |= {key + "weight_packed": packed, key + "weight_scale": scale,
                   key + "weight_shape": torch.tensor([rows, cols])}
        unpacked = pack_quantized.unpack_from_int32(packed, 4, torch.Size([rows, cols]))
        floats[name] = (unpacked.float() * scale.float().repeat_interleave(group, dim=1)).to(w.dtype)
    for (target, tensors) in ((folder, stored), (reference, floats)):
        for path in target.glob("*.safetensors*"):
            path.unlink()
        save_file(tensors, str(target / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": group, "dynamic": False, "actorder": None}}},
        "ignore": ["lm_head", "re:.*mlp.gate$",
                   *(["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
                     if experts_only else [])]}   # Kimi K2 Thinking's own list
    (folder / "config.json").write_text(json.dumps(cfg))
    return reference


@pytest.mark.parametrize("arch", list(MODELS))
def test_int4_experts_are_held_as_stored_and_decode_as_transformers(tmp_path, builtin_path, arch, caplog):
    """`quantization: int4` on a CPU: each sparse layer's w13 holds each expert's packed gate rows, then its up rows,
    as compressed-tensors packed them, with their scales, and the W4A16 kind's attention projections are held so too;
    the model holds half a byte an INT4 weight plus a scale a group (what the capacity plan counts, to the byte), and
    decodes greedily as transformers' model over the weights the format defines. `none`: the same tokens."""
    import transformers

    overrides, experts_only = MODELS[arch]
    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    reference = int4_checkpoint(folder, experts_only)
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with caplog.at_level("INFO", logger="cliffguard.engine"):
        held = LLMEngine(_config(folder, "int4"), progress=False)
    sparse = _sparse(held)
    assert f"weights: the experts of {len(sparse)} layers held in INT4 as stored" in caplog.text
    index, layer = next((i, l.mlp) for i, l in enumerate(held.model.layers) if isinstance(l.mlp, SparseMoeBlock))
    stored = {n: t for n, t in _taken_weights_copy(folder).items() if f"layers.{index}.mlp.experts.3." in n}
    inter = overrides["moe_intermediate_size"]
    assert layer.packed == "int4" and layer.w13.dtype == torch.uint8
    assert torch.equal(layer.w13[3, :inter], stored[f"model.layers.{index}.mlp.experts.3.gate_proj.weight_packed"]
                       .view(torch.uint8))
    assert torch.equal(layer.w2_scales[3], stored[f"model.layers.{index}.mlp.experts.3.down_proj.weight_scale"].float())
    config, shard = held.model_config, ShardShape.of(held.model_config)
    plain = held_weight_bytes(config, shard, torch.float32, "none", "cpu")
    experts = sum(m.w13.numel() + m.w2.numel() for m in sparse) * 2
    projections = [m for m in held.model.modules() if isinstance(m, Int4Linear)]   # the W4A16 kind's attention
    assert len(projections) == (0 if experts_only else 2 * len(held.model.layers))
    weights = experts + sum(m.blocks.numel() * 2 for m in projections)
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int4", "cpu")
    assert held.weights_bytes == plain - weights * 4 + weights // 2 + weights // 32 * 4
    assert held_expert_bytes(config, torch.float32, "int4", "cpu") == experts // 2 + experts // 32 * 4
    tokens = _greedy(held)
    assert tokens == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    dequantized = LLMEngine(_config(folder, "none"), progress=False)
    assert not any(m.packed for m in _sparse(dequantized)) and dequantized.weights_bytes == plain
    assert _greedy(dequantized) == tokens


def _taken_weights_copy(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_hold_their_halves_of_each_int4_expert_and_decode_as_one(tmp_path, builtin_path):
    """Tensor parallelism 2 over the W4A16 kind: each rank holds its 32 of each expert's 64 gate and up rows and the
    packed bytes and scale of its 32 down inputs, and the two decode what one does."""
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **MODELS["qwen3_moe"][0])
    int4_checkpoint(folder, experts_only=False)
    one = LLMEngine(_config(folder, "int4"), progress=False)
    reference = _generate(one, PROMPTS)
    two = LLMEngine(_config(folder, "int4", tp=2), progress=False)
    assert two.weights_bytes == held_weight_bytes(two.model_config, two.shard, torch.float32, "int4", "cpu")
    layer, whole = _sparse(two)[0], _sparse(one)[0]
    assert layer.w13.shape == (8, 64, 32) and torch.equal(layer.w13[:, 32:], whole.w13[:, 64:96])
    assert torch.equal(layer.w2, whole.w2[:, :, :16]) and torch.equal(layer.w2_scales, whole.w2_scales[:, :, :1])
    _assert_same_or_near_tie(reference, _generate(two, PROMPTS))


def test_the_config_and_the_device_key_choose_and_refuse_by_name(tmp_path, builtin_path):
    """A pack-quantized config reads its width and group (8 bits, a scale a row too); what it says that is not served
    (2 bits, a symmetry that is not true or false, activation order, quantized activations, two group sizes) is
    refused naming the key. auto holds INT4 experts
    on a GPU and dequantizes them on a CPU; int4 and fp8 hold them anywhere; int4 on a checkpoint without them, or a
    rank's share that splits a group, is refused naming the key. A layer missing one of its three tensors is named."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"weights": weights}}}
    assert pack_quantized_weights(quant, "quantization_config") == (4, 32)
    assert pack_quantized_weights({**quant, "format": "float-quantized"}, "q") is None
    channel = {**weights, "num_bits": 8, "strategy": "channel", "group_size": None, "symmetric": False}
    assert pack_quantized_weights({**quant, "config_groups": {"g": {"weights": channel}}}, "q") == (8, 0)
    for change, named in (({"num_bits": 2}, "weights: served are 4- or 8-bit"),
                          ({"symmetric": "no"}, "weights: served"),
                          ({"actorder": "group"}, "weights: activation-ordered"),
                          ({"group_size": 0}, "weights.group_size")):
        bad = {**quant, "config_groups": {"group_0": {"weights": {**weights, **change}}}}
        with pytest.raises(ConfigError, match=rf"^quantization_config.config_groups.group_0.{named}"):
            pack_quantized_weights(bad, "quantization_config")
    with pytest.raises(ConfigError, match=r"group_0.input_activations: quantized activations are served with int-"):
        pack_quantized_weights({**quant, "config_groups": {"group_0": {"weights": weights,
                                                                        "input_activations": {"num_bits": 8}}}},
                               "quantization_config")
    two = {"a": {"weights": weights}, "b": {"weights": {**weights, "group_size": 64}}}
    with pytest.raises(ConfigError, match=r"one width and group size for every group, got \[\(4, 32\), \(4, 64\)\]"):
        pack_quantized_weights({**quant, "config_groups": two}, "quantization_config")

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "moe_intermediate_size": 96})
    int4_checkpoint(folder, experts_only=True)
    config = ModelConfig.from_folder(folder)
    one, halves = ShardShape.of(config), ShardShape.of(config, 0, 2)
    assert config.int4_group == 32 and not config.mxfp4_experts
    assert [held_packed(config, one, q, "cuda") for q in ("auto", "fp8", "int4", "none")] == ["int4"] * 3 + [None]
    assert [held_packed(config, one, q, "cpu") for q in ("auto", "int4")] == [None, "int4"]
    assert held_packed(config, halves, "auto", "cuda") is None   # 48 inputs a rank
    with pytest.raises(ConfigError, match=r"^quantization: int4 under tensor parallelism 2 cuts each expert's 96"):
        held_packed(config, halves, "int4", "cpu")
    with pytest.raises(ConfigError, match=r"^quantization: mxfp4 holds a checkpoint's MXFP4 experts as stored; this "
                                          r"checkpoint has INT4 ones"):
        held_packed(config, one, "mxfp4", "cpu")
    stored = _taken_weights_copy(folder)
    shape = "model.layers.0.mlp.experts.1.up_proj.weight_shape"
    with pytest.raises(WeightLoadError, match=rf"^{shape}: missing beside .*up_proj.weight_packed"):
        build_model(config, torch.float32, "cpu", quantization="int4").load_weights(
            (n, t) for n, t in stored.items() if n != shape)


def test_a_dense_w4a16_checkpoint_is_held_as_stored_or_dequantized_and_decodes_as_transformers(tmp_path,
                                                                                                builtin_path, caplog):
    """A dense model with every projection INT4 (the `-quantized.w4a16` releases' kind). `quantization: int4`: each
    decoder projection held as stored (`Int4Linear`: q, k and v's packed rows one after another in qkv_proj, as
    compressed-tensors packed them, with their scales), what the capacity plan counts to the byte (half a byte a
    weight plus a scale a group); `auto` on a CPU: dequantized as read. Both decode greedily as transformers' model
    over the weights the format defines."""
    import transformers

    folder = make_tiny_model(tmp_path / "qwen3", "qwen3", builtin_path, head_dim=16, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(int4_checkpoint(folder, experts_only=False),
                                                           dtype=torch.float32).eval()
    want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    with caplog.at_level("INFO", logger="cliffguard.engine"):
        held = LLMEngine(_config(folder, "int4"), progress=False)
    layers = held.model.layers
    assert f"weights: {4 * len(layers)} projections held in INT4 as stored" in caplog.text
    qkv, stored = layers[1].self_attn.qkv_proj, _taken_weights_copy(folder)
    assert isinstance(qkv, Int4Linear) and qkv.blocks.dtype == torch.uint8 and qkv.group == 32
    q_rows = stored["model.layers.1.self_attn.q_proj.weight_packed"].shape[0]
    assert torch.equal(qkv.blocks[q_rows:q_rows + 32], stored["model.layers.1.self_attn.k_proj.weight_packed"]
                       .view(torch.uint8)[:32])
    assert torch.equal(qkv.scales[:q_rows], stored["model.layers.1.self_attn.q_proj.weight_scale"].float())
    config, shard = held.model_config, ShardShape.of(held.model_config)
    plain = held_weight_bytes(config, shard, torch.float32, "none", "cpu")
    weights = sum(m.blocks.numel() * 2 for m in held.model.modules() if isinstance(m, Int4Linear))
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int4", "cpu") \
        == plain - weights * 4 + weights // 2 + weights // 32 * 4
    assert _greedy(held) == want
    engine = LLMEngine(_config(folder, "auto"), progress=False)
    assert engine.model_config.int4_group == 32 and engine.weights_bytes == plain
    assert engine.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32   # dequantized
    assert _greedy(engine) == want


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_hold_their_halves_of_each_int4_projection_and_decode_as_one(tmp_path, builtin_path):
    """Tensor parallelism 2 over a dense W4A16 checkpoint held as stored: each rank holds its heads' rows of qkv_proj
    and its columns of o_proj and down_proj (packed bytes and scales of whole groups), and the two decode what one
    does; dequantized as read (`auto` on a CPU), the same. A rank's share that would split a group is refused under
    `int4` naming the key, and dequantized under `auto`."""
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "qwen3", "qwen3", builtin_path, head_dim=16, intermediate_size=128)
    int4_checkpoint(folder, experts_only=False)
    one = LLMEngine(_config(folder, "int4"), progress=False)
    reference = _generate(one, PROMPTS)
    two = LLMEngine(_config(folder, "int4", tp=2), progress=False)
    assert two.weights_bytes == held_weight_bytes(two.model_config, two.shard, torch.float32, "int4", "cpu")
    whole, half = one.model.layers[0], two.model.layers[0]
    inter = one.model_config.intermediate_size // 2
    assert torch.equal(half.mlp.down_proj.blocks, whole.mlp.down_proj.blocks[:, :inter // 2])
    assert torch.equal(half.mlp.down_proj.scales, whole.mlp.down_proj.scales[:, :inter // 32])
    assert torch.equal(half.mlp.gate_up_proj.blocks[inter:], whole.mlp.gate_up_proj.blocks[2 * inter:3 * inter])
    _assert_same_or_near_tie(reference, _generate(two, PROMPTS))
    _assert_same_or_near_tie(reference, _generate(LLMEngine(_config(folder, "auto", tp=2), progress=False), PROMPTS))
    uneven = make_tiny_model(tmp_path / "uneven", "qwen3", builtin_path, head_dim=16, intermediate_size=96)
    int4_checkpoint(uneven, experts_only=False)
    with pytest.raises(ConfigError, match=r"^quantization: int4 cannot hold layers.0.mlp.down_proj as stored under "
                                          r"tensor parallelism 2: a rank's 48 inputs are not whole groups of 32"):
        LLMEngine(_config(uneven, "int4", tp=2), progress=False)
    config = ModelConfig.from_folder(uneven)
    model = build_model(config, torch.float32, "cpu", ShardShape.of(config, 0, 2), quantization="fp8")
    assert not isinstance(model.layers[0].mlp.down_proj, Int4Linear)   # quantized a row at a time instead
    assert isinstance(model.layers[0].self_attn.o_proj, Int4Linear)


def test_the_layers_a_checkpoint_leaves_in_float_stay_float(tmp_path, builtin_path):
    """A checkpoint whose ignore list keeps attention in float (Kimi K2's kind, on a dense model): its MLP
    projections held in INT4, its attention in the model's dtype, both read and decoding as transformers; a model
    whose every INT4 layer is read otherwise (none held) is refused under `int4` naming the key."""
    import transformers

    folder = make_tiny_model(tmp_path / "qwen3", "qwen3", builtin_path, head_dim=16, intermediate_size=128)
    reference = int4_checkpoint(folder, experts_only=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert int4_quantizes(ModelConfig.from_folder(folder).int4_modules, "model.layers.3.self_attn.q_proj")
    cfg["quantization_config"]["ignore"].append("re:.*self_attn.*")
    (folder / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if ".self_attn." not in n
               or not n.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    floats = load_file(reference / "model.safetensors")
    tensors |= {n: t for n, t in floats.items() if ".self_attn." in n and n.endswith("proj.weight")}
    save_file(tensors, str(folder / "model.safetensors"))
    engine = LLMEngine(_config(folder, "int4"), progress=False)
    layer = engine.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Int4Linear) and not isinstance(layer.self_attn.qkv_proj, Int4Linear)
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    assert _greedy(engine) == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    cfg["quantization_config"]["ignore"].append("re:.*mlp.*")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^quantization: int4 holds a checkpoint's INT4 experts and projections as "
                                          r"stored; this model holds none"):
        LLMEngine(_config(folder, "int4"), progress=False)


def test_dequantizing_is_the_value_less_its_middle_times_its_groups_scale_rounded_once():
    """Every byte, two 4-bit values each or one 8-bit value, under bfloat16 scales: (nibble - 8) or (byte - 128)
    times the scale in float32, then `dtype`."""
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    scales = torch.tensor([[0.013, 1.7, -0.25, 3e-3]] * 4, dtype=torch.bfloat16).repeat(1, 1)
    values = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float() - 8
    want = values * scales.float().repeat_interleave(32, dim=1)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_int4(codes, scales, dtype), want.to(dtype))
    with pytest.raises(ValueError, match=r"^4-bit codes \[\.\.\., rows, inputs x 4 / 8\] uint8"):
        dequantize_int4(codes, scales[:, :3], torch.float32)
    bytes_ = (codes.float() - 128) * scales.float().repeat_interleave(16, dim=1)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_int4(codes, scales, dtype, bits=8), bytes_.to(dtype))
    zeros = torch.full((4, 4), 100, dtype=torch.uint8)
    assert torch.equal(dequantize_int4(codes, scales, torch.float32, zeros, bits=8),
                       (codes.float() - 100) * scales.float().repeat_interleave(16, dim=1))


def test_random_weights_of_int4_experts_are_about_the_asked_deviation(tmp_path, builtin_path):
    """`init_random` (benchmarks of model shapes) over INT4 experts held as stored: random values with a scale in the
    model's dtype that makes the decoded weights about `std`, as for MXFP4's e8m0 scales and float weights."""
    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **MODELS["qwen3_moe"][0])
    int4_checkpoint(folder, experts_only=True)
    model = build_model(ModelConfig.from_folder(folder), torch.float32, "cpu", quantization="int4")
    model.init_random(std=0.02)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.packed == "int4" and block.w13_scales.dtype == torch.float32
    weights = torch.cat([dequantize_int4(block.w13[e], block.w13_scales[e], torch.float32).flatten() for e in range(8)])
    assert 0.015 < weights.std().item() < 0.027
