"""`engine.cpu_forward.CpuForward`, the CPU backend's flat loop over the decoder layers, against the
module path it replaces: the same C kernels and the same BLAS calls, so the same numbers, bit for bit,
and the same K/V written to the cache. Decode-only and mixed steps, float32 and bfloat16, the Llama
family's variants (q/k/v bias, o_proj bias, a sliding window, Granite's multipliers, SmolLM3's NoPE layers),
packed linears; and where it stands aside.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.model_config import ModelConfig  # noqa: E402
from engine.cpu_forward import CpuForward  # noqa: E402
from engine.models import build_model  # noqa: E402
from kernels import AttentionMetadata, cpu_attention, cpu_fused, reference  # noqa: E402
from kernels.cpu_linear import pack_linears  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_fused.load_library() is None or cpu_attention.load_library() is None,
                                reason="no C compiler: the flat forward does not apply")

BLOCK_SIZE, NUM_BLOCKS = 8, 24
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def _config(variant: str) -> ModelConfig:
    if variant == "qwen2":     # q/k/v biases only
        hf = transformers.Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"])
    elif variant == "mistral":  # a sliding window shorter than the contexts
        hf = transformers.MistralConfig(**COMMON, sliding_window=10, architectures=["MistralForCausalLM"])
    elif variant == "granite":  # each sublayer's output scaled before the residual add
        hf = transformers.GraniteConfig(**COMMON, embedding_multiplier=3.0, attention_multiplier=0.05,
                                        residual_multiplier=0.5, logits_scaling=2.0, architectures=["GraniteForCausalLM"])
    elif variant == "smollm3":  # its middle layer without rope (NoPE)
        hf = transformers.SmolLM3Config(**COMMON, no_rope_layers=[1, 0, 1], pad_token_id=0,
                                        architectures=["SmolLM3ForCausalLM"])
    else:
        hf = transformers.LlamaConfig(**COMMON, attention_bias=variant == "llama-bias",
                                      architectures=["LlamaForCausalLM"])
    return ModelConfig.from_hf_config(hf.to_dict())


def _step(decode_only: bool) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Three sequences with cached contexts of 19, 11 and 30 tokens: each decodes one token, or the
    second prefills a chunk of 5 instead. Returns (meta, input ids, positions)."""
    tables = [[3, 7, 1], [12, 0], [5, 9, 20, 2]]
    query_lens = [1, 1 if decode_only else 5, 1]
    seq_lens = [20, 12, 31]
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, BLOCK_SIZE)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    ids = torch.randint(0, 96, (len(positions),), generator=torch.Generator().manual_seed(3))
    return meta, ids, positions


def _caches(model, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, model.config.num_kv_heads, model.config.head_dim)
    return [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for _ in model.layers]


def _both_paths(model, dtype: torch.dtype, decode_only: bool):
    """(flat output, flat caches), (module output, module caches) of one step from the same caches."""
    meta, ids, positions = _step(decode_only)
    caches = _caches(model, dtype)
    flat_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        flat = model(ids, positions, flat_caches, meta, cpu_attention)
        assert isinstance(model._flat[1], CpuForward)
        model._flat = (cpu_attention, None)          # the module path, same backend
        modules = model(ids, positions, caches, AttentionMetadata.build(*_meta_args(meta)), cpu_attention)
        model._flat = None
    return (flat, flat_caches), (modules, caches)


def _meta_args(meta: AttentionMetadata):
    """The same step's metadata again (a fresh backend cache)."""
    tables = [[b for b in row.tolist()] for row in meta.block_tables]
    tables = [row[:-(-s // BLOCK_SIZE)] for row, s in zip(tables, meta.seq_lens_list)]
    return tables, meta.query_lens_list, meta.seq_lens_list, BLOCK_SIZE


def _assert_same(got, want) -> None:
    (flat, flat_caches), (modules, caches) = got, want
    assert torch.equal(flat, modules), (flat - modules).abs().max()
    for layer, ((fk, fv), (k, v)) in enumerate(zip(flat_caches, caches)):
        assert torch.equal(fk, k) and torch.equal(fv, v), f"layer {layer}: the caches differ"


@pytest.mark.parametrize("variant", ["llama", "llama-bias", "qwen2", "mistral", "granite", "smollm3"])
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_the_flat_loop_is_the_module_path_bit_for_bit(variant, decode_only):
    model = build_model(_config(variant), torch.float32, "cpu")
    model.init_random(std=0.2)
    flat, modules = _both_paths(model, torch.float32, decode_only)
    _assert_same(flat, modules)


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_bfloat16(decode_only):
    model = build_model(_config("llama"), torch.bfloat16, "cpu")
    model.init_random(std=0.2)
    flat, modules = _both_paths(model, torch.bfloat16, decode_only)
    _assert_same(flat, modules)


def test_packed_linears_are_called_packed_and_swapping_rebuilds_the_loop():
    model = build_model(_config("llama-bias"), torch.float32, "cpu")
    model.init_random(std=0.2)
    meta, ids, positions = _step(True)
    with torch.inference_mode():
        model(ids, positions, _caches(model, torch.float32), meta, cpu_attention)
        before = model._flat[1]
        assert pack_linears(model, min_elements=0) > 0
        assert model._flat is None                     # pack_linears told the model
        flat, modules = _both_paths(model, torch.float32, decode_only=False)
    assert model._flat is None or model._flat[1] is not before
    _assert_same(flat, modules)


def test_it_stands_aside_for_other_backends_and_dtypes(monkeypatch):
    model = build_model(_config("llama"), torch.float32, "cpu")
    assert CpuForward.build(model, reference) is None
    assert CpuForward.build(model, cpu_attention) is not None
    half = build_model(_config("llama"), torch.float16, "cpu")   # no C code for float16: torch ops
    assert CpuForward.build(half, cpu_attention) is None


def test_a_slot_past_the_cache_is_refused():
    model = build_model(_config("llama"), torch.float32, "cpu")
    model.init_random()
    meta, ids, positions = _step(True)
    meta.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE
    with torch.inference_mode(), pytest.raises(IndexError, match="slot"):
        model(ids, positions, _caches(model, torch.float32), meta, cpu_attention)


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_decode_rows_split_over_threads_change_no_bit(decode_only):
    """Each layer's decode rows split over two threads (forced: these contexts read far less than the kernel's
    `split_min_bytes`), in the flat loop and the module path: the outputs and caches of one call, bit for bit."""
    if cpu_attention.decode_threads() == 0:
        pytest.skip("the kernel is built without OpenMP here")
    model = build_model(_config("mistral"), torch.float32, "cpu")
    model.init_random(std=0.2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_attention.split_min_bytes(1 << 62):
            whole = _both_paths(model, torch.float32, decode_only)
        with cpu_attention.split_min_bytes(0):
            split = _both_paths(model, torch.float32, decode_only)
    finally:
        torch.set_num_threads(before)
    _assert_same(split[0], whole[0])
    _assert_same(split[1], whole[1])
