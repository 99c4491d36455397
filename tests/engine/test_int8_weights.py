"""8-bit integer checkpoints (W8A16): GPTQ's `-GPTQ-Int8` layout (packed by AutoAWQ's `pack_exllama`, its config in
quantize_config.json) and llm-compressor's pack-quantized W8A16 (`strategy: channel`, a scale a row, packed by
compressed-tensors), its asymmetric schemes of 4 and 8 bits, and its W8A8 (`int-quantized`: int8 values, the
activations' scheme not applied). Whole models held as stored (`quantization: int8`:
a code a byte, `Int4Linear` of 8 bits) or dequantized as read decode greedily as transformers' model over the
weights the codes define, two ranks as one (a row's scale whole on each rank), the capacity plan counting what the
engine holds to the byte; what cannot be held so is refused by key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.layers.int4_linear import Int4Linear
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models import held_int4_projections, held_weight_bytes
from engine.parallel import ShardShape
from tests.conftest import make_tiny_model
from tests.engine.test_awq_gptq_weights import awq_packing
from tests.engine.test_engine_vs_hf import _hf_greedy, _taken_weights
from tests.engine.test_mxfp4_weights import PROMPTS, _config, _greedy

GROUP = 32


def _rewrite(folder: Path, stored: dict, floats: dict) -> Path:
    """`stored` as the checkpoint in `folder`, `floats` as a float one beside it (`<folder>-float`), for
    transformers. Returns that folder."""
    from safetensors.torch import save_file

    reference = folder.parent / f"{folder.name}-float"
    shutil.copytree(folder, reference)
    for target, tensors in ((folder, stored), (reference, floats)):
        for path in target.glob("*.safetensors*"):
            path.unlink()
        save_file(tensors, str(target / "model.safetensors"))
    return reference


def _projections(folder: Path, stored: dict, floats: dict):
    """The checkpoint's decoder projections to quantize, as (name, weight); every other tensor put into `stored` and
    `floats` as it is."""
    for name, w in _taken_weights(folder).items():
        if name.endswith("proj.weight") and ".layers." in name:
            yield name, w
        else:
            stored[name] = floats[name] = w


def gptq_int8_checkpoint(folder: Path, awq) -> Path:
    """The tiny checkpoint in `folder` rewritten as a symmetric 8-bit GPTQ one (v1, groups of 32, float16 scales: a
    group's largest value over 127; zeros 128 stored less one), as AutoGPTQ writes the `-GPTQ-Int8` releases. Returns
    the float checkpoint of the weights the codes define."""
    stored, floats = {}, {}
    for name, w in _projections(folder, stored, floats):
        rows, cols = w.shape
        grouped = w.float().view(rows, cols // GROUP, GROUP)
        scale = (grouped.abs().amax(-1) / 127).clamp(min=1e-6).half()                    # [out, groups]
        codes = (torch.round(grouped / scale.float()[..., None]) + 128).clamp(0, 255).view(rows, cols).long()
        floats[name] = ((codes - 128).float() * scale.float().repeat_interleave(GROUP, 1)).to(w.dtype)
        key = name.removesuffix("weight")
        qweight, qzeros = awq.pack_exllama(codes.T.contiguous(), torch.full((cols // GROUP, rows), 127), 8)
        stored |= {key + "qweight": qweight, key + "qzeros": qzeros, key + "scales": scale.T.contiguous(),
                   key + "g_idx": torch.arange(cols, dtype=torch.int32) // GROUP}
    reference = _rewrite(folder, stored, floats)
    (folder / "quantize_config.json").write_text(json.dumps(
        {"bits": 8, "group_size": GROUP, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}))
    return reference


def pack_quantized_checkpoint(folder: Path, bits: int = 8, group: int = 0, symmetric: bool = True) -> Path:
    """The tiny checkpoint in `folder` rewritten as llm-compressor's pack-quantized one (`bits`-bit values, bfloat16
    scales a `group` of inputs or, group 0, a row: `strategy: channel`, W8A16's; asymmetric: a zero point beside each
    scale, W4A16_ASYM's), packed by compressed-tensors (`pack_to_int32`, the zero points along the rows), lm_head
    left in float. Returns the float checkpoint of the weights compressed-tensors' `dequantize` gives over its own
    unpacking."""
    packing = pytest.importorskip("compressed_tensors.compressors")
    from compressed_tensors.quantization import QuantizationArgs, dequantize

    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, **strategy)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    stored, floats = {}, {}
    for name, w in _projections(folder, stored, floats):
        rows, cols = w.shape
        grouped = w.float().view(rows, cols // (group or cols), group or cols)
        if symmetric:
            scale = (grouped.abs().amax(-1) / high).clamp(min=1e-6).to(torch.bfloat16)
            zero = torch.zeros_like(scale, dtype=torch.int8)
        else:
            lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
            scale = ((hi - lo) / (high - low)).clamp(min=1e-6).to(torch.bfloat16)
            zero = (low - torch.round(lo / scale.float())).clamp(low, high).to(torch.int8)
        values = (torch.round(grouped / scale.float()[..., None]) + zero[..., None]).clamp(low, high)
        packed = packing.pack_to_int32(values.view(rows, cols).to(torch.int8), bits)
        unpacked = packing.unpack_from_int32(packed, bits, torch.Size([rows, cols]))
        # its dequantization over float32 scales: the product exact, as the engine's (bfloat16's would round it)
        floats[name] = dequantize(unpacked, scale.float(), None if symmetric else zero, args,
                                  dtype=torch.float32).to(w.dtype)
        key = name.removesuffix("weight")
        stored |= {key + "weight_packed": packed, key + "weight_scale": scale,
                   key + "weight_shape": torch.tensor([rows, cols])}
        if not symmetric:
            stored[key + "weight_zero_point"] = packing.pack_to_int32(zero, bits, 0)
    reference = _rewrite(folder, stored, floats)
    cfg = json.loads((folder / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group or None, "dynamic": False,
               "actorder": None, **strategy}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": weights}},
        "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return reference


def int_quantized_checkpoint(folder: Path, static: bool = False) -> Path:
    """The tiny checkpoint in `folder` rewritten as llm-compressor's W8A8 (`format: int-quantized`: each projection's
    values quantized by compressed-tensors' `quantize` to int8, a bfloat16 scale a row, its activations' scheme 8-bit
    per token, dynamic; `static`: per tensor, with an `input_scale` beside each layer), lm_head left in float.
    Returns the float checkpoint of the weights compressed-tensors' `dequantize` gives."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, dequantize, quantize

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    stored, floats = {}, {}
    for name, w in _projections(folder, stored, floats):
        scale = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6).to(torch.bfloat16)
        values = quantize(w.float(), scale.float(), torch.zeros_like(scale, dtype=torch.int8), args, dtype=torch.int8)
        floats[name] = dequantize(values, scale.float(), None, args, dtype=torch.float32).to(w.dtype)
        key = name.removesuffix("weight")
        stored |= {key + "weight": values, key + "weight_scale": scale}
        if static:
            stored[key + "input_scale"] = torch.tensor([0.05])
    reference = _rewrite(folder, stored, floats)
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel", "dynamic": False}}},
        "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return reference


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_a_gptq_int8_checkpoint_is_held_a_code_a_byte_and_decodes_as_transformers(tmp_path, builtin_path, caplog):
    """A Qwen2 model in GPTQ's 8-bit layout: `int8` holds every decoder projection as stored (a code a byte, a float
    scale a group, no zero points: symmetric), what the capacity plan counts to the byte; `auto` on a CPU dequantizes
    as read. Both decode greedily as transformers' model over the weights the codes define; under tensor parallelism
    2 each rank holds its columns of down_proj and the two decode what one does. `int4` on it is refused by key."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", builtin_path, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gptq_int8_checkpoint(folder, awq_packing()),
                                                           dtype=torch.float32).eval()
    want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    with caplog.at_level("INFO", logger="cliffguard.engine"):
        held = LLMEngine(_config(folder, "int8"), progress=False)
    config, shard = held.model_config, ShardShape.of(held.model_config)
    assert (config.int4_format, config.int4_bits, config.int4_group, config.int4_zero_points) == ("gptq", 8, 32, False)
    layers = [m for m in held.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * len(held.model.layers) and all(m.bits == 8 and m.zeros is None for m in layers)
    assert f"weights: {len(layers)} projections held in INT8 as stored" in caplog.text
    down = held.model.layers[0].mlp.down_proj
    assert down.blocks.shape == (down.out_features, 128) and down.blocks.dtype == torch.uint8
    plain = held_weight_bytes(config, shard, torch.float32, "none", "cpu")
    weights = sum(m.blocks.numel() for m in layers)
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int8", "cpu") \
        == plain - weights * 4 + weights + weights // GROUP * 4
    assert held_int4_projections(config, shard, "int8", "cpu") == len(layers)
    tokens = _greedy(held)
    assert tokens == want
    dequantized = LLMEngine(_config(folder, "auto"), progress=False)
    assert not any(isinstance(m, Int4Linear) for m in dequantized.model.modules())
    assert dequantized.weights_bytes == plain and _greedy(dequantized) == want
    two = LLMEngine(_config(folder, "int8", tp=2), progress=False)
    half = two.model.layers[0].mlp.down_proj
    assert torch.equal(half.blocks, down.blocks[:, :64]) and torch.equal(half.scales, down.scales[:, :2])
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))
    with pytest.raises(ConfigError, match=r"^quantization: int4 holds a checkpoint's INT4 experts as stored; this "
                                          r"checkpoint has INT8 ones"):
        LLMEngine(_config(folder, "int4"), progress=False)


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_a_w8a16_checkpoint_with_a_scale_a_row_holds_under_any_cut(tmp_path, builtin_path):
    """llm-compressor's W8A16 on a Llama model (`strategy: channel`): `int8` holds every decoder projection a code a
    byte beside one scale a row and decodes greedily as transformers; under tensor parallelism 2 the row-parallel
    layers are held too (each rank its columns, every rank the row's whole scale), decoding as one rank does."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "llama", "llama", builtin_path, intermediate_size=96)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pack_quantized_checkpoint(folder),
                                                           dtype=torch.float32).eval()
    config = ModelConfig.from_folder(folder)
    assert (config.int4_format, config.int4_bits, config.int4_group) == ("pack-quantized", 8, 0)
    held = LLMEngine(_config(folder, "int8"), progress=False)
    down = held.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.group == 96 and down.scales.shape == (down.out_features, 1)
    assert _greedy(held) == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    two = LLMEngine(_config(folder, "int8", tp=2), progress=False)
    half = two.model.layers[0].mlp.down_proj
    assert isinstance(half, Int4Linear) and half.group == 48
    assert torch.equal(half.blocks, down.blocks[:, :48]) and torch.equal(half.scales, down.scales)
    assert two.weights_bytes == held_weight_bytes(two.model_config, two.shard, torch.float32, "int8", "cpu")
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_an_asymmetric_pack_quantized_checkpoint_is_held_with_its_zero_points(tmp_path, builtin_path):
    """llm-compressor's W4A16_ASYM (4 bits, a zero point beside each scale of 32 inputs) and an asymmetric 8-bit
    scheme in groups, on a Llama model: `auto` on a CPU dequantizes, `int4` / `int8` holds every projection with its
    zero points; both decode greedily as transformers over the weights compressed-tensors' `dequantize` gives, and
    two ranks as one."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    for bits in (4, 8):
        folder = make_tiny_model(tmp_path / f"llama{bits}", "llama", builtin_path, intermediate_size=128)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            pack_quantized_checkpoint(folder, bits, GROUP, symmetric=False), dtype=torch.float32).eval()
        want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
        held = LLMEngine(_config(folder, f"int{bits}"), progress=False)
        qkv = held.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, Int4Linear) and qkv.bits == bits and qkv.zeros is not None
        assert _greedy(held) == want, bits
        assert _greedy(LLMEngine(_config(folder, "auto"), progress=False)) == want, bits
        two = LLMEngine(_config(folder, f"int{bits}", tp=2), progress=False)
        assert two.model.layers[0].mlp.down_proj.zeros.shape[1] == 2
        _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_8_bit_experts_are_held_a_code_a_byte_beside_the_projections(tmp_path, builtin_path):
    """Qwen3-MoE in GPTQ's 8-bit layout, every projection its experts' too: `int8` holds the experts a code a byte
    (w13 [E, 2 x inter, hidden], w2 [E, hidden, inter] uint8 beside their scales) and the attention projections so;
    the model decodes greedily as transformers over the weights the codes define, holds what the plan counts (a byte
    a weight, a float32 scale a 32), and two ranks, each its half of every expert's intermediate size, decode as
    one. `auto` on a CPU dequantizes all of it: the same tokens."""
    import transformers

    from engine.models import held_expert_bytes
    from engine.models.qwen3_moe import SparseMoeBlock
    from tests.engine.test_engine_vs_hf import QWEN3_MOE
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "moe_intermediate_size": 64})
    hf = transformers.AutoModelForCausalLM.from_pretrained(gptq_int8_checkpoint(folder, awq_packing()),
                                                           dtype=torch.float32).eval()
    held = LLMEngine(_config(folder, "int8"), progress=False)
    sparse = [m for m in held.model.modules() if isinstance(m, SparseMoeBlock)]
    hidden = held.model_config.hidden_size
    assert sparse and all(m.packed == "int8" and m.w13_zeros is None for m in sparse)
    assert sparse[0].w13.shape == (8, 128, hidden) and sparse[0].w2.shape == (8, hidden, 64)
    assert sparse[0].w13.dtype == torch.uint8 and sparse[0].w13_scales.shape == (8, 128, hidden // GROUP)
    assert isinstance(held.model.layers[0].self_attn.o_proj, Int4Linear)
    config, shard = held.model_config, held.shard
    experts = sum(m.w13.numel() + m.w2.numel() for m in sparse)
    assert held_expert_bytes(config, torch.float32, "int8", "cpu") == experts + experts // GROUP * 4
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int8", "cpu")
    tokens = _greedy(held)
    assert tokens == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    assert _greedy(LLMEngine(_config(folder, "auto"), progress=False)) == tokens
    two = LLMEngine(_config(folder, "int8", tp=2), progress=False)
    layer = next(m for m in two.model.modules() if isinstance(m, SparseMoeBlock))
    assert torch.equal(layer.w13[:, 32:], sparse[0].w13[:, 64:96]) and torch.equal(layer.w2, sparse[0].w2[:, :, :32])
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_w8a16_experts_with_a_scale_a_row_are_held_under_any_cut(tmp_path, builtin_path):
    """Qwen3-MoE in llm-compressor's W8A16 (a scale a row of every projection, the experts' too): `int8` holds the
    experts a code a byte beside one scale a row (w13_scales [E, 2 x inter, 1]), decodes greedily as transformers, and
    under tensor parallelism 2 each rank holds its half of every expert's intermediate size with down's whole row
    scales, decoding as one rank does."""
    import transformers

    from engine.models.qwen3_moe import SparseMoeBlock
    from tests.engine.test_engine_vs_hf import QWEN3_MOE
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "moe_intermediate_size": 48})
    hf = transformers.AutoModelForCausalLM.from_pretrained(pack_quantized_checkpoint(folder),
                                                           dtype=torch.float32).eval()
    held = LLMEngine(_config(folder, "int8"), progress=False)
    layer = next(m for m in held.model.modules() if isinstance(m, SparseMoeBlock))
    assert layer.packed == "int8" and layer.w13_scales.shape == (8, 96, 1) and layer.w2_scales.shape[2] == 1
    assert held.weights_bytes == held_weight_bytes(held.model_config, held.shard, torch.float32, "int8", "cpu")
    assert _greedy(held) == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    two = LLMEngine(_config(folder, "int8", tp=2), progress=False)
    half = next(m for m in two.model.modules() if isinstance(m, SparseMoeBlock))
    assert torch.equal(half.w2, layer.w2[:, :, :24]) and torch.equal(half.w2_scales, layer.w2_scales)
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))


@pytest.mark.usefixtures("one_thread")   # a core per rank
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_a_w8a8_checkpoint_is_held_as_its_int8_weights(tmp_path, builtin_path, static):
    """llm-compressor's W8A8 (`int-quantized`: int8 values and a scale a row, its activations' scheme per token or,
    static, per tensor with an `input_scale` a layer, not read): `int8` holds every projection a code a byte (the
    value plus 128), `auto` on a CPU dequantizes; both decode greedily as transformers over the weights
    compressed-tensors' `dequantize` gives (the activations in the model's dtype), and two ranks as one."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "llama", "llama", builtin_path, intermediate_size=96)
    hf = transformers.AutoModelForCausalLM.from_pretrained(int_quantized_checkpoint(folder, static),
                                                           dtype=torch.float32).eval()
    config = ModelConfig.from_folder(folder)
    assert (config.int4_format, config.int4_bits, config.int4_group) == ("int-quantized", 8, 0)
    held = LLMEngine(_config(folder, "int8"), progress=False)
    down = held.model.layers[0].mlp.down_proj
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, Int4Linear) and torch.equal(down.blocks, (stored.to(torch.int16) + 128).to(torch.uint8))
    want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    assert _greedy(held) == want
    assert _greedy(LLMEngine(_config(folder, "auto"), progress=False)) == want
    if not static:
        _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(LLMEngine(_config(folder, "int8", tp=2),
                                                                               progress=False), PROMPTS))


def test_what_an_integer_config_says_that_is_not_served_is_refused_by_key(tmp_path, builtin_path):
    """AWQ of 8 bits, GPTQ of 3, GPTQ's activation order with a scale a row: refused naming the key before any
    weight is read."""
    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", builtin_path)
    gptq = {"bits": 8, "group_size": 32, "desc_act": False, "sym": True}
    for quant, named in (({**gptq, "bits": 3},
                          r"^quantize_config.json: bits: GPTQ checkpoints of 4 or 8 bits are served, got 3$"),
                         ({**gptq, "group_size": -1, "desc_act": True},
                          r"desc_act: activation order needs groups; group_size -1 has one a row")):
        (folder / "quantize_config.json").write_text(json.dumps(quant))
        with pytest.raises(ConfigError, match=named):
            ModelConfig.from_folder(folder)
    (folder / "quantize_config.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 8, "group_size": 32, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^quantization_config.bits: AWQ checkpoints of 4 bits are served, got 8"):
        ModelConfig.from_folder(folder)
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for form, group, named in (
            ("int-quantized", {"weights": {**weights, "num_bits": 4}}, r"group_0.weights: served are 4- or 8-bit"),
            ("pack-quantized", {"weights": weights, "input_activations": {"num_bits": 8, "type": "int"}},
             r"group_0.input_activations: quantized activations are served with int-quantized 8-bit weights"),
            ("int-quantized", {"weights": weights, "input_activations": {"num_bits": 8, "type": "float"}},
             r"group_0.input_activations: quantized activations"),
            ("int-quantized", {"weights": weights, "output_activations": {"num_bits": 8, "type": "int"}},
             r"group_0.output_activations: quantized outputs are not served")):
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": form,
                                      "config_groups": {"group_0": group}}
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=rf"^quantization_config.config_groups.{named}"):
            ModelConfig.from_folder(folder)
