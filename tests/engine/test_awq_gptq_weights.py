"""AWQ and GPTQ checkpoints, and pack-quantized ones with zero points (`engine.int4_formats`), against unpacking
nobody here wrote: AutoAWQ's `packing_utils` (its AWQ dequantization, and its conversion of AWQ tensors to GPTQ's
layout with the zeros stored less one) and compressed-tensors' own packing and dequantization. Each layer decodes to
the weights they define; whole models decode greedily as transformers' model over those weights, held as stored (an
`Int4Linear` with zero points) or dequantized as read, under tensor parallelism too; what the config says that is
not served is refused by key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.int4_formats import Int4Scheme, int4_scheme, int4_tensors
from engine.int4_weights import dequantize_int4
from engine.layers.int4_linear import Int4Linear
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models import held_packed, held_weight_bytes
from engine.parallel import ShardShape
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import QWEN3_MOE, _hf_greedy, _taken_weights
from tests.engine.test_mxfp4_weights import PROMPTS, _config, _greedy, _sparse

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's packing: a word's nibble i holds output AWQ_ORDER[i] of its eight
GROUP = 32


@pytest.fixture(scope="module")
def awq():
    return awq_packing()


def awq_packing():
    """AutoAWQ's packing_utils, read alone (its package's __init__ loads models through transformers)."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed (make test installs it)")
    path = Path(spec.submodule_search_locations[0]) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Values 0 .. 15 [rows, 8 n] packed eight a word along the columns, nibble i holding column `order[i]` of its
    eight (int32, as the checkpoints store them)."""
    v = values.long().unflatten(-1, (-1, 8))[..., list(order)]
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32).contiguous()


def _awq_layer(gen, inputs: int, outputs: int, low: int = 0):
    """A random AWQ layer: every code, zeros of `low` .. 15, float16 scales."""
    codes = torch.randint(0, 16, (inputs, outputs), generator=gen)
    zeros = torch.randint(low, 16, (inputs // GROUP, outputs), generator=gen)
    scales = ((torch.rand(inputs // GROUP, outputs, generator=gen) - 0.3) * 0.05).half()
    return _words(codes, AWQ_ORDER), _words(zeros, AWQ_ORDER), scales


def _read(scheme: Int4Scheme, tensors: dict, dtype=torch.float16, keep=False) -> dict:
    return dict(int4_tensors(((f"m.{n}", t) for n, t in tensors.items()), scheme, lambda *_: keep, dtype))


def _scheme(form: str, zero_points=True, act_order=False) -> Int4Scheme:
    return Int4Scheme(form, GROUP, zero_points, act_order, ((), ()))


def test_awq_and_gptq_layers_decode_to_the_weights_autoawq_unpacks(awq):
    """AWQ's words (eight outputs each, in AWQ's order) decode to what AutoAWQ's `dequantize_gemm` gives, to the
    float16 bit, dequantized as read or held (codes, scales, zero points) and dequantized per call; the same layer in
    GPTQ's layout as AutoAWQ converts it (eight inputs a word, zeros stored less one: v1) and with its zeros as they
    are (v2) decodes alike; a symmetric GPTQ layer holds no zero points (every one 8); activation order gathers each
    input's group, dequantized as read or held with its inputs sorted by group and the order to gather them in; a
    symmetric layer whose zeros are not 8, or groups out of order without desc_act, is named."""
    gen = torch.Generator().manual_seed(0)
    qweight, qzeros, scales = _awq_layer(gen, 128, 48, low=1)
    want = awq.dequantize_gemm(qweight, qzeros, scales, 4, GROUP).T   # [out, in] float16
    read = _read(_scheme("awq"), {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert torch.equal(read["m.weight"], want)
    held = _read(_scheme("awq"), {"qweight": qweight, "qzeros": qzeros, "scales": scales}, keep=True)
    assert held["m.blocks"].shape == (48, 64) and held["m.zeros"].dtype == torch.uint8
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.float16, held["m.zeros"]), want)

    g_weight, g_zeros = awq.unpack_reorder_pack(qweight, qzeros, 4)   # GPTQ v1
    g_idx = torch.arange(128, dtype=torch.int32) // GROUP
    gptq = {"qweight": g_weight, "qzeros": g_zeros, "scales": scales, "g_idx": g_idx}
    assert torch.equal(_read(_scheme("gptq"), gptq)["m.weight"], want)
    codes, zeros = awq.reverse_awq_order(*awq.unpack_awq(qweight, qzeros, 4), 4)
    v2_weight, v2_zeros = awq.pack_exllama(codes & 15, zeros & 15, 4)   # the zeros as they are
    assert torch.equal(_read(_scheme("gptq_v2"), {**gptq, "qweight": v2_weight, "qzeros": v2_zeros})["m.weight"], want)

    order = torch.randperm(128, generator=gen)   # activation order: input order[j] is the j-th of the sorted groups
    act = torch.empty_like(g_idx)
    act[order] = g_idx
    permuted = torch.empty_like(codes)
    permuted[order] = codes & 15
    act_weight, _ = awq.pack_exllama(permuted, zeros & 15, 4)
    got = _read(_scheme("gptq_v2", act_order=True), {**gptq, "qweight": act_weight, "qzeros": v2_zeros, "g_idx": act})
    assert torch.equal(got["m.weight"][:, order], want)
    with pytest.raises(ValueError, match=r"^m.g_idx: inputs out of their groups' order where desc_act is false"):
        _read(_scheme("gptq_v2"), {**gptq, "qweight": act_weight, "qzeros": v2_zeros, "g_idx": act})
    held = _read(_scheme("gptq_v2", act_order=True), {**gptq, "qweight": act_weight, "qzeros": v2_zeros, "g_idx": act},
                 keep=True)
    sorted_weight = dequantize_int4(held["m.blocks"], held["m.scales"], torch.float16, held["m.zeros"])
    perm = held["m.perm"].long()   # x[perm] times the held weight is x times the layer's
    assert torch.equal(act[perm].long(), torch.arange(128) // GROUP) and torch.equal(sorted_weight,
                                                                                     got["m.weight"][:, perm])
    uneven = act.clone()
    uneven[(act == 3).nonzero()[0]] = 2   # a group of 33 inputs, one of 31
    with pytest.raises(ValueError, match=r"^m.g_idx: groups of other than 32 inputs cannot be held"):
        _read(_scheme("gptq_v2", act_order=True), {**gptq, "g_idx": uneven}, keep=True)

    eights = _words(torch.full((4, 48), 7))   # v1 stores 8 less one
    symmetric = _read(_scheme("gptq", zero_points=False), {**gptq, "qzeros": eights}, keep=True)
    assert set(symmetric) == {"m.blocks", "m.scales"}
    want = awq.dequantize_gemm(qweight, _words(torch.full((4, 48), 8), AWQ_ORDER), scales, 4, GROUP).T
    assert torch.equal(dequantize_int4(symmetric["m.blocks"], symmetric["m.scales"], torch.float16), want)
    with pytest.raises(ValueError, match=r"^m.qzeros: a symmetric \(sym: true\) checkpoint's zero points are 8"):
        _read(_scheme("gptq", zero_points=False), gptq)
    with pytest.raises(ValueError, match=r"^m.qweight: missing beside m.qzeros"):
        _read(_scheme("awq"), {"qzeros": qzeros})


def test_an_asymmetric_pack_quantized_layer_decodes_as_compressed_tensors_dequantizes_it():
    """llm-compressor's W4A16_ASYM: values and zero points packed by compressed-tensors (the zeros along the rows)
    decode to what its `dequantize` gives over its own unpacking, odd row counts included."""
    packing = pytest.importorskip("compressed_tensors.compressors")
    from compressed_tensors.quantization import QuantizationArgs, dequantize

    gen = torch.Generator().manual_seed(1)
    rows, cols = 37, 96
    values = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    zero = torch.randint(-8, 8, (rows, cols // GROUP), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows, cols // GROUP, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP)
    stored = {"weight_packed": packing.pack_to_int32(values, 4), "weight_scale": scale,
              "weight_shape": torch.tensor([rows, cols]), "weight_zero_point": packing.pack_to_int32(zero, 4, 0)}
    unpacked = packing.unpack_from_int32(stored["weight_packed"], 4, torch.Size([rows, cols]))
    zeros = packing.unpack_from_int32(stored["weight_zero_point"], 4, torch.Size([rows, cols // GROUP]), 0)
    want = dequantize(unpacked, scale, zeros, args, dtype=torch.bfloat16)
    scheme = _scheme("pack-quantized")
    assert torch.equal(_read(scheme, stored, torch.bfloat16)["m.weight"], want)
    held = _read(scheme, stored, keep=True)
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.bfloat16, held["m.zeros"]), want)


def test_8_bit_gptq_layers_decode_to_the_codes_autoawq_packs(awq):
    """GPTQ's 8-bit layout (`-GPTQ-Int8`: four inputs a word, four outputs a word of zeros), packed by AutoAWQ's
    `pack_exllama`: each weight is (code - zero) x scale, the zeros stored less one (v1) or as they are (v2),
    dequantized as read or held a code a byte; symmetric (every zero 128) holds none; a scale a row (group_size -1,
    group 0) covers every input."""
    gen = torch.Generator().manual_seed(2)
    inputs, outputs = 128, 48
    codes = torch.randint(0, 256, (inputs, outputs), generator=gen)
    zeros = torch.randint(1, 256, (inputs // GROUP, outputs), generator=gen)
    scales = ((torch.rand(inputs // GROUP, outputs, generator=gen) - 0.3) * 0.002).half()
    want = ((codes - zeros.repeat_interleave(GROUP, 0)).float() * scales.float().repeat_interleave(GROUP, 0)).T.half()
    g_idx = torch.arange(inputs, dtype=torch.int32) // GROUP
    scheme = Int4Scheme("gptq", GROUP, True, False, ((), ()), 8)
    qweight, qzeros = awq.pack_exllama(codes, zeros - 1, 8)   # v1
    stored = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    assert qweight.shape == (inputs // 4, outputs) and qzeros.shape == (inputs // GROUP, outputs // 4)
    assert torch.equal(_read(scheme, stored)["m.weight"], want)
    held = _read(scheme, stored, keep=True)
    assert held["m.blocks"].shape == (outputs, inputs) and torch.equal(held["m.blocks"], codes.T.to(torch.uint8))
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.float16, held["m.zeros"], bits=8),
                       want)
    v2 = Int4Scheme("gptq_v2", GROUP, True, False, ((), ()), 8)
    assert torch.equal(_read(v2, {**stored, "qzeros": awq.pack_exllama(codes, zeros, 8)[1]})["m.weight"], want)

    middle = torch.full_like(zeros, 128)
    symmetric = Int4Scheme("gptq", GROUP, False, False, ((), ()), 8)
    held = _read(symmetric, {**stored, "qzeros": awq.pack_exllama(codes, middle - 1, 8)[1]}, keep=True)
    assert set(held) == {"m.blocks", "m.scales"}
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.float32, bits=8),
                       ((codes - 128).float() * scales.float().repeat_interleave(GROUP, 0)).T)
    with pytest.raises(ValueError, match=r"^m.qzeros: a symmetric \(sym: true\) checkpoint's zero points are 128"):
        _read(symmetric, stored)

    row = Int4Scheme("gptq", 0, False, False, ((), ()), 8)   # group_size -1
    one = {"qweight": qweight, "qzeros": awq.pack_exllama(codes, middle[:1] - 1, 8)[1], "scales": scales[:1],
           "g_idx": torch.zeros(inputs, dtype=torch.int32)}
    assert torch.equal(_read(row, one, torch.float32)["m.weight"],
                       ((codes - 128).float() * scales[:1].float()).T)


def test_an_8_bit_pack_quantized_layer_decodes_as_compressed_tensors_dequantizes_it():
    """llm-compressor's W8A16 (`strategy: channel`, a scale a row, symmetric) and an asymmetric 8-bit scheme in
    groups: values (and zero points) packed by compressed-tensors, four a word, decode to what its `dequantize`
    gives over its own unpacking, held or dequantized as read."""
    packing = pytest.importorskip("compressed_tensors.compressors")
    from compressed_tensors.quantization import QuantizationArgs, dequantize

    gen = torch.Generator().manual_seed(4)
    rows, cols = 37, 96
    values = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    unpacked = packing.unpack_from_int32(packing.pack_to_int32(values, 8), 8, torch.Size([rows, cols]))
    row_scale = (torch.rand(rows, 1, generator=gen) * 2e-4 + 1e-5).to(torch.bfloat16)
    channel = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    stored = {"weight_packed": packing.pack_to_int32(values, 8), "weight_scale": row_scale,
              "weight_shape": torch.tensor([rows, cols])}
    assert stored["weight_packed"].shape == (rows, cols // 4)
    want = dequantize(unpacked, row_scale, None, channel, dtype=torch.bfloat16)
    scheme = Int4Scheme("pack-quantized", 0, False, False, ((), ()), 8)
    assert torch.equal(_read(scheme, stored, torch.bfloat16)["m.weight"], want)
    held = _read(scheme, stored, keep=True)
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.bfloat16, bits=8), want)

    zero = torch.randint(-128, 128, (rows, cols // GROUP), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows, cols // GROUP, generator=gen) * 2e-4 + 1e-5).to(torch.bfloat16)
    groups = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="group", group_size=GROUP)
    stored = {**stored, "weight_scale": scale, "weight_zero_point": packing.pack_to_int32(zero, 8, 0)}
    zeros = packing.unpack_from_int32(stored["weight_zero_point"], 8, torch.Size([rows, cols // GROUP]), 0)
    want = dequantize(unpacked, scale, zeros, groups, dtype=torch.bfloat16)
    asymmetric = Int4Scheme("pack-quantized", GROUP, True, False, ((), ()), 8)
    assert torch.equal(_read(asymmetric, stored, torch.bfloat16)["m.weight"], want)
    held = _read(asymmetric, stored, keep=True)
    assert torch.equal(dequantize_int4(held["m.blocks"], held["m.scales"], torch.bfloat16, held["m.zeros"], bits=8),
                       want)


def _quantized(w: torch.Tensor):
    """Weight [out, in] as AWQ quantizes a group: codes round(w / scale) + zero in 0 .. 15, float16 scale (max - min)
    / 15 of the group, zero in 1 .. 15 (so GPTQ's v1 can store it less one). Returns codes, zeros, scales, each
    [in (or groups), out] as AWQ lays them out."""
    rows, cols = w.shape
    grouped = w.float().view(rows, cols // GROUP, GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-5).half()
    zero = torch.round(-low / scale.float()).clamp(1, 15)
    codes = (torch.round(grouped / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).view(rows, cols)
    return codes.T.long(), zero.T.long(), scale.T.contiguous()


def awq_checkpoint(folder: Path, awq, gptq: bool = False) -> Path:
    """The tiny checkpoint in `folder` rewritten as an AWQ one (every decoder projection), or GPTQ's (AutoAWQ's
    conversion, beside a quantize_config.json as AutoGPTQ writes it), and a float one (`<folder>-float`) of the
    weights AutoAWQ's `dequantize_gemm` gives, for transformers. Returns that folder."""
    import shutil

    from safetensors.torch import save_file

    reference = folder.parent / f"{folder.name}-float"
    shutil.copytree(folder, reference)
    stored, floats = {}, {}
    for name, w in _taken_weights(folder).items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            stored[name] = floats[name] = w
            continue
        codes, zeros, scales = _quantized(w)
        qweight, qzeros = _words(codes, AWQ_ORDER), _words(zeros, AWQ_ORDER)
        floats[name] = awq.dequantize_gemm(qweight, qzeros, scales.float(), 4, GROUP).T.to(w.dtype).contiguous()
        key = name.removesuffix("weight")
        if gptq:
            qweight, qzeros = awq.unpack_reorder_pack(qweight, qzeros, 4)
            stored[key + "g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
        stored |= {key + "qweight": qweight, key + "qzeros": qzeros, key + "scales": scales}
    for target, tensors in ((folder, stored), (reference, floats)):
        for path in target.glob("*.safetensors*"):
            path.unlink()
        save_file(tensors, str(target / "model.safetensors"))
    if gptq:
        (folder / "quantize_config.json").write_text(json.dumps(
            {"bits": 4, "group_size": GROUP, "desc_act": False, "sym": False, "checkpoint_format": "gptq"}))
    else:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": None}
        (folder / "config.json").write_text(json.dumps(cfg))
    return reference


def test_an_awq_checkpoint_is_held_with_its_zero_points_or_dequantized_and_decodes_as_transformers(tmp_path,
                                                                                                    builtin_path, awq):
    """A Qwen2 model (biased q, k and v, as Qwen2.5's AWQ releases) in AWQ: `quantization: int4` holds every decoder
    projection as stored with its zero points (q, k and v's rows one after another in qkv_proj), what the capacity
    plan counts to the byte (half a byte a weight, a scale and a zero point a group); `auto` on a CPU dequantizes as
    read. Both decode greedily as transformers' model over the weights AutoAWQ's unpacking defines."""
    import transformers

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", builtin_path, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(awq_checkpoint(folder, awq), dtype=torch.float32).eval()
    want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    held = LLMEngine(_config(folder, "int4"), progress=False)
    qkv = held.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.zeros is not None and qkv.bias is not None
    config, shard = held.model_config, ShardShape.of(held.model_config)
    assert (config.int4_format, config.int4_group, config.int4_zero_points) == ("awq", GROUP, True)
    plain = held_weight_bytes(config, shard, torch.float32, "none", "cpu")
    weights = sum(m.blocks.numel() * 2 for m in held.model.modules() if isinstance(m, Int4Linear))
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int4", "cpu") \
        == plain - weights * 4 + weights // 2 + weights // GROUP * 5
    assert _greedy(held) == want
    engine = LLMEngine(_config(folder, "auto"), progress=False)
    assert engine.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32 and engine.weights_bytes == plain
    assert _greedy(engine) == want


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_a_gptq_checkpoint_decodes_as_transformers_and_two_ranks_as_one(tmp_path, builtin_path, awq):
    """The same model in GPTQ's layout (v1, asymmetric), its config in quantize_config.json beside a silent
    config.json (AutoGPTQ's way): held as stored it decodes as transformers over AutoAWQ's weights; under tensor
    parallelism 2 each rank holds its columns of down_proj (codes, scales and zero points of whole groups) and the
    two decode what one does."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", builtin_path, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(awq_checkpoint(folder, awq, gptq=True),
                                                           dtype=torch.float32).eval()
    one = LLMEngine(_config(folder, "int4"), progress=False)
    assert one.model_config.int4_format == "gptq" and one.model_config.int4_zero_points
    reference = _greedy(one)
    assert reference == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    two = LLMEngine(_config(folder, "int4", tp=2), progress=False)
    whole, half = one.model.layers[0].mlp.down_proj, two.model.layers[0].mlp.down_proj
    assert torch.equal(half.zeros, whole.zeros[:, :half.zeros.shape[1]]) and half.zeros.shape[1] == 2
    assert torch.equal(half.blocks, whole.blocks[:, :32])
    _assert_same_or_near_tie(_generate(one, PROMPTS), _generate(two, PROMPTS))


def act_order_checkpoint(folder: Path, awq) -> Path:
    """The tiny checkpoint in `folder` rewritten as GPTQ's in activation order (v1, asymmetric: AutoGPTQ's
    `desc_act: true`): each decoder projection's inputs taken in a random order (one order for q, k and v, one for
    gate and up, which share their input, as GPTQ's Hessian gives them), quantized in groups of 32 in that order
    (`g_idx`), packed in GPTQ's layout by AutoAWQ's `pack_exllama`; beside it the float checkpoint of the weights
    AutoAWQ's `dequantize_gemm` gives, each column back in its place. Returns that folder."""
    import shutil

    from safetensors.torch import save_file

    reference = folder.parent / f"{folder.name}-float"
    shutil.copytree(folder, reference)
    gen, orders, stored, floats = torch.Generator().manual_seed(3), {}, {}, {}
    for name, w in _taken_weights(folder).items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            stored[name] = floats[name] = w
            continue
        proj = name.split(".")[-2]
        shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
        order = orders.setdefault((name.split(".")[2], shared.get(proj, proj)),
                                  torch.randperm(w.shape[1], generator=gen))
        codes, zeros, scales = _quantized(w[:, order])   # [in, out], its inputs in the order's groups
        floats[name] = torch.empty_like(w)
        floats[name][:, order] = awq.dequantize_gemm(_words(codes, AWQ_ORDER), _words(zeros, AWQ_ORDER),
                                                     scales.float(), 4, GROUP).T
        in_place, g_idx = torch.empty_like(codes), torch.empty(w.shape[1], dtype=torch.int32)
        in_place[order], g_idx[order] = codes, (torch.arange(w.shape[1]) // GROUP).to(torch.int32)
        key = name.removesuffix("weight")
        stored[key + "qweight"], stored[key + "qzeros"] = awq.pack_exllama(in_place, zeros - 1, 4)   # v1
        stored |= {key + "scales": scales, key + "g_idx": g_idx}
    for target, tensors in ((folder, stored), (reference, floats)):
        for path in target.glob("*.safetensors*"):
            path.unlink()
        save_file(tensors, str(target / "model.safetensors"))
    (folder / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": GROUP, "desc_act": True,
                                                             "sym": False}))
    return reference


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_a_gptq_checkpoint_in_activation_order_is_held_with_its_input_order(tmp_path, builtin_path, awq):
    """GPTQ's activation order (`desc_act: true`), a Qwen2 model: `int4` holds every projection as stored with its
    inputs sorted by group (`Int4Linear.perm`, one for the fused q/k/v and gate/up), `auto` on a CPU dequantizes
    each input with its group's scale; both decode greedily as transformers over the weights AutoAWQ defines. Under
    tensor parallelism 2 the column-parallel layers are held so and the row-parallel ones dequantized, decoding as one
    rank does. Parts of a fused layer stored in different orders are refused naming the tensor."""
    import transformers

    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", builtin_path, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(act_order_checkpoint(folder, awq),
                                                           dtype=torch.float32).eval()
    want = [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    held = LLMEngine(_config(folder, "int4"), progress=False)
    layer = held.model.layers[1]
    assert all(m.act_order for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert held.weights_bytes == held_weight_bytes(held.model_config, held.shard, torch.float32, "int4", "cpu")
    assert _greedy(held) == want
    assert _greedy(LLMEngine(_config(folder, "auto"), progress=False)) == want
    two = LLMEngine(_config(folder, "int4", tp=2), progress=False)
    assert two.model.layers[0].mlp.gate_up_proj.act_order and not isinstance(two.model.layers[0].mlp.down_proj,
                                                                              Int4Linear)
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))
    from safetensors.torch import load_file, save_file

    from engine.model import WeightLoadError

    stored = load_file(folder / "model.safetensors")
    stored["model.layers.0.self_attn.k_proj.g_idx"] = stored["model.layers.0.self_attn.k_proj.g_idx"].sort()[0]
    save_file(stored, str(folder / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"^model.layers.0.self_attn.(q|k)_proj.g_idx: its inputs' groups are "
                                              r"not in the order of model.layers.0.self_attn.(k|q)_proj.g_idx's, whose "
                                              r"layer it is fused with in layers.0.self_attn.qkv_proj$"):
        LLMEngine(_config(folder, "int4"), progress=False)


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_moe_experts_are_held_as_stored_with_or_without_zero_points(tmp_path, builtin_path, awq):
    """Qwen3-MoE in GPTQ, symmetric (the `-GPTQ-Int4` releases' kind: zeros all 8): `int4` holds each expert packed
    as stored, no zero points, and decodes as transformers; in AWQ each expert is held with its zero points (`w13_zeros`
    beside `w13_scales`: the gate's then the up's rows, as stored), what the capacity plan counts to the byte, and
    decodes as transformers, and two ranks (each its half of every expert's rows and zero points) as one. In
    activation order the experts are dequantized as read."""
    import transformers
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "moe_intermediate_size": 64})
    reference = awq_checkpoint(folder, awq, gptq=True)
    stored, floats = load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors")
    for key in [n.removesuffix("qweight") for n in stored if n.endswith("qweight")]:   # the zeros made 8
        g_weight, g_zeros = awq.unpack_reorder_pack(*_awq_from_gptq(awq, stored, key), 4)
        stored[f"{key}qweight"], stored[f"{key}qzeros"] = g_weight, g_zeros
        awq_weight, awq_zeros = _awq_from_gptq(awq, stored, key)
        floats[f"{key}weight"] = awq.dequantize_gemm(awq_weight, awq_zeros, stored[f"{key}scales"].float(), 4,
                                                     GROUP).T.contiguous()
    save_file(stored, str(folder / "model.safetensors"))
    save_file(floats, str(reference / "model.safetensors"))
    (folder / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": GROUP, "sym": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    held = LLMEngine(_config(folder, "int4"), progress=False)
    assert all(m.packed == "int4" for m in _sparse(held))
    assert not any(m.zeros is not None for m in held.model.modules() if isinstance(m, Int4Linear))
    assert _greedy(held) == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    config = ModelConfig.from_folder(folder)
    assert held_packed(config, ShardShape.of(config), "auto", "cuda") == "int4"
    (folder / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": GROUP, "desc_act": True}))
    act = ModelConfig.from_folder(folder)
    assert held_packed(act, ShardShape.of(act), "int4", "cpu") is None

    folder = make_tiny_model(tmp_path / "awq", "qwen3_moe", builtin_path, **{**QWEN3_MOE, "moe_intermediate_size": 64})
    hf = transformers.AutoModelForCausalLM.from_pretrained(awq_checkpoint(folder, awq), dtype=torch.float32).eval()
    held = LLMEngine(_config(folder, "int4"), progress=False)
    sparse, stored = _sparse(held), load_file(folder / "model.safetensors")
    index = next(i for i, layer in enumerate(held.model.layers) if layer.mlp is sparse[0])
    zeros = stored[f"model.layers.{index}.mlp.experts.5.up_proj.qzeros"]
    want = torch.stack([(zeros >> (4 * i)) & 15 for i in range(8)], -1)[..., [0, 4, 1, 5, 2, 6, 3, 7]].flatten(-2).T
    assert torch.equal(sparse[0].w13_zeros[5, 64:], want.to(torch.uint8)) and sparse[0].w2_zeros.dtype == torch.uint8
    config, shard = held.model_config, ShardShape.of(held.model_config)
    experts = sum(m.w13.numel() + m.w2.numel() for m in sparse) * 2
    projections = sum(m.blocks.numel() * 2 for m in held.model.modules() if isinstance(m, Int4Linear))
    assert held.weights_bytes == held_weight_bytes(config, shard, torch.float32, "int4", "cpu") == \
        held_weight_bytes(config, shard, torch.float32, "none", "cpu") - (experts + projections) * 7 // 2 \
        + (experts + projections) // GROUP * 5
    assert _greedy(held) == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    from tests.engine.test_tensor_parallel import _assert_same_or_near_tie, _generate

    two = LLMEngine(_config(folder, "int4", tp=2), progress=False)
    half = _sparse(two)[0]
    assert torch.equal(half.w2_zeros, sparse[0].w2_zeros[:, :, :1]) and torch.equal(half.w13_zeros[:, 32:],
                                                                                      sparse[0].w13_zeros[:, 64:96])
    _assert_same_or_near_tie(_generate(held, PROMPTS), _generate(two, PROMPTS))


def _awq_from_gptq(awq, stored: dict, key: str):
    """A GPTQ v1 layer's codes back in AWQ's words, its zeros made 8 (AWQ's words of 8s)."""
    words = stored[f"{key}qweight"]
    codes = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=1).flatten(0, 1)   # [in, out]
    groups, outputs = stored[f"{key}scales"].shape
    return _words(codes, AWQ_ORDER), _words(torch.full((groups, outputs), 8), AWQ_ORDER)


def test_the_config_says_what_is_served_and_refuses_the_rest_by_key(tmp_path):
    """AWQ's and GPTQ's configs read into their scheme (the layers quantized: the decoder layers' linears, less
    `modules_to_not_convert`, or those `modules_in_block_to_quantize` lists); what is not served is refused naming
    the key, in quantize_config.json by that file's name. Layers in activation order are held with their input order,
    but for a row-parallel rank's (its columns are no whole groups: dequantized as read)."""
    from engine.int4_weights import int4_quantizes

    awq_cfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
               "modules_to_not_convert": ["mlp.gate"]}
    scheme = int4_scheme(awq_cfg, "quantization_config")
    assert (scheme.format, scheme.group, scheme.zero_points, scheme.act_order) == ("awq", 128, True, False)
    assert int4_quantizes(scheme.modules, "model.layers.3.self_attn.q_proj")
    assert not int4_quantizes(scheme.modules, "model.layers.3.mlp.gate") and not int4_quantizes(scheme.modules,
                                                                                                  "lm_head")
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True,
            "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]]}
    scheme = int4_scheme(gptq, "quantization_config")
    assert (scheme.format, scheme.zero_points, scheme.act_order) == ("gptq", False, True)
    assert int4_quantizes(scheme.modules, "model.layers.0.mlp.down_proj")
    assert not int4_quantizes(scheme.modules, "model.layers.0.self_attn.o_proj")
    assert int4_scheme({"quant_method": "fp8"}, "q") is None
    for bad, named in (({**awq_cfg, "bits": 8}, "bits: AWQ checkpoints of 4 bits"),
                       ({**awq_cfg, "group_size": -1}, "group_size: an even number"),
                       ({**awq_cfg, "version": "gemv_fast"}, "version: AWQ's gemm layout"),
                       ({**awq_cfg, "zero_point": False}, "zero_point: AWQ checkpoints with zero points"),
                       ({**awq_cfg, "modules_to_not_convert": "gate"}, "modules_to_not_convert: a list"),
                       ({**gptq, "checkpoint_format": "marlin"}, "checkpoint_format: gptq or gptq_v2"),
                       ({**gptq, "desc_act": "yes"}, "desc_act: true or false"),
                       ({**gptq, "dynamic": {"-:.*": {}}}, "dynamic: per-module GPTQ settings"),
                       ({**gptq, "lm_head": True}, "lm_head: a quantized lm_head"),
                       ({**gptq, "modules_in_block_to_quantize": ["q_proj"]}, "modules_in_block_to_quantize: lists"),
                       ({**gptq, "modules_in_block_to_quantize": [["q_proj", 3]]},
                        "modules_in_block_to_quantize: a list of module names")):
        with pytest.raises(ConfigError, match=rf"^quantization_config.{named}"):
            int4_scheme(bad, "quantization_config")

    from tests.engine.test_config import LLAMA

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "quantize_config.json").write_text('[4]')
    with pytest.raises(ConfigError, match=r"^quantize_config.json: must be a JSON object"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "quantize_config.json").write_text('{"bits": 4, "group_size": 32, "desc_act": true}')
    config = ModelConfig.from_folder(tmp_path)
    assert (config.int4_format, config.int4_group, config.int4_act_order) == ("gptq", 32, True)
    from engine.models import build_model

    one = build_model(config, torch.float32, "cpu", quantization="int4").layers[0]
    assert one.self_attn.o_proj.act_order and one.mlp.gate_up_proj.act_order and one.mlp.down_proj.perm.shape == (128,)
    two = build_model(config, torch.float32, "cpu", ShardShape.of(config, 0, 2), quantization="int4").layers[0]
    assert two.mlp.gate_up_proj.act_order and not isinstance(two.mlp.down_proj, Int4Linear)   # a rank's columns
