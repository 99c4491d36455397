"""The whole engine on the Triton kernels (through Triton's interpreter on the CPU) gives the same greedy
tokens as on the torch reference: prefill, chunked prefill mixed with decode, preemption, n > 1, a
head_dim that is not a power of two (padded inside the kernels), and an FP8 KV cache."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random

import pytest

pytest.importorskip("triton")

from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    # head_dim 16 (4 heads over 64), GQA 2: small enough for the interpreter
    return make_tiny_model(tmp_path_factory.mktemp("tiny-triton"), "llama", builtin_path)


@pytest.fixture(scope="module")
def tiny_head_dim_40(tmp_path_factory, builtin_path):
    # head_dim 40 (2 heads over 80, GQA 2): padded to 64 inside the kernels
    return make_tiny_model(tmp_path_factory.mktemp("tiny-triton-40"), "llama", builtin_path, hidden_size=80,
                           num_attention_heads=2, num_key_value_heads=1)


def _engine(path, backend: str, monkeypatch, num_blocks: int = 12, kv_cache_dtype: str = "auto",
            calculate_kv_scales: bool = True, **sched) -> LLMEngine:
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    sched.setdefault("max_num_batched_tokens", 24)  # chunked prefill: chunks start mid-block
    config = EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(block_size=8),
                          kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
                          pools=(PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched)),))
    engine = LLMEngine(config, progress=False)
    assert ("triton" in engine.runner.backend.paged_attention.__module__) == (backend == "triton")
    return engine


@pytest.mark.slow   # ~27 s through the interpreter; the engine on the Triton kernels is shown below (head_dim 40,
# chunked prefill; preemption and n > 1 on them only here)
def test_engine_on_triton_kernels_matches_the_reference(tiny, monkeypatch):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33, 47)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
             [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny, backend, monkeypatch)
        outs = engine.generate(prompts, params)
        results[backend] = [[o.token_ids for o in out.outputs] for out in outs]
        assert engine.schedulers["default"].stats.num_preemptions > 0  # 12 blocks of 8: under pressure
        assert_all_free(engine)
    assert results["triton"] == results["torch"]


def test_engine_on_triton_kernels_with_head_dim_40_matches_the_reference(tiny_head_dim_40, monkeypatch):
    """A 70-token prompt whose first chunk (64 tokens or more) goes through the prefill kernel, beside
    short chunks and decodes through the paged kernel, all at head_dim 40."""
    from kernels import triton_attention

    prefill_tiles = []
    real = triton_attention.prefill_attention
    monkeypatch.setattr(triton_attention, "prefill_attention",
                        lambda *args, **kwargs: prefill_tiles.append(real(*args, **kwargs)) or prefill_tiles[-1])
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 5, 19)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny_head_dim_40, backend, monkeypatch, num_blocks=24, max_num_batched_tokens=96)
        assert engine.runner.model.layers[0].self_attn.config.head_dim == 40
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert sum(prefill_tiles) > 0, "no chunk went through the prefill kernel"
    assert results["triton"] == results["torch"]


@pytest.mark.slow   # ~13 s; the FP8 store and kernels are exact against the reference in tests/kernels/test_triton*.py
def test_engine_on_triton_kernels_with_an_fp8_cache_matches_the_reference(tiny, monkeypatch):
    """kv_cache_dtype fp8: the Triton store writes the reference's bytes and the kernels read them as the
    reference does (times each layer's scales), so greedy tokens are the torch backend's over its FP8 cache;
    chunked prefill mixed with decode, under preemption, and a 70-token prompt whose first chunk goes
    through the prefill kernel."""
    import torch

    from kernels import triton_attention

    prefill_tiles = []
    real = triton_attention.prefill_attention
    monkeypatch.setattr(triton_attention, "prefill_attention",
                        lambda *args, **kwargs: prefill_tiles.append(real(*args, **kwargs)) or prefill_tiles[-1])
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 5, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny, backend, monkeypatch, num_blocks=11, kv_cache_dtype="fp8", max_num_batched_tokens=80)
        assert engine.kv_cache.data.dtype == torch.float8_e4m3fn
        for i, layer in enumerate(engine.runner.model.layers):   # scales of each layer's own, not 1
            layer.self_attn.k_scale, layer.self_attn.v_scale = 0.011 * (i + 1), 0.007 * (i + 2)
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert engine.schedulers["default"].stats.num_preemptions > 0  # 11 blocks of 8: under pressure
        assert_all_free(engine)
    assert sum(prefill_tiles) > 0, "no chunk went through the prefill kernel"
    assert results["triton"] == results["torch"]


def test_engine_on_triton_kernels_with_fp8_weights_matches_the_reference(tmp_path, builtin_path, monkeypatch):
    """quantization fp8 over an FP8 checkpoint in blocks of 16 x 32: on the Triton backend every projection runs
    the Triton FP8 GEMM (each weight tile dequantized as loaded), on the torch backend the reference (the weight
    dequantized whole): the same greedy tokens, chunked prefill mixed with decode."""
    from engine.layers.fp8_linear import Fp8Linear
    from tests.engine.test_engine_vs_hf import _fp8_checkpoint

    folder = make_tiny_model(tmp_path / "fp8", "llama", builtin_path, head_dim=16, intermediate_size=128)
    _fp8_checkpoint(folder, (16, 32))
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
        config = EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=8), quantization="fp8",
                              pools=(PoolConfig(num_blocks=32, scheduler=SchedulerConfig(max_num_batched_tokens=24)),))
        engine = LLMEngine(config, progress=False)
        layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 4 * engine.model_config.num_layers and engine.model.fp8_exact
        assert all(m.triton == (backend == "triton") for m in layers)
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
    assert results["triton"] == results["torch"]


# DeepSeek's latent attention at a tiny size: a latent of 32 and a rotated key of 8 under 4 heads, 4 experts
LATENT = dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_group=1, topk_group=1)


@pytest.mark.slow   # ~6 s through the interpreter; the Triton store and kernels on a latent cache (K and V the same
# plane) are checked against the reference by tests/bench/test_kernels_bench.py, the whole model in test_triton_moe.py
def test_engine_on_triton_kernels_serves_deepseeks_latent_cache_as_the_reference(tmp_path, builtin_path, monkeypatch):
    """DeepSeek's latent attention: one cache plane, read as both K and V, of one 'KV head' of 40 (a latent of 32 and
    a rotated key of 8) under 4 query heads of that size; the Triton store writes it (twice, the same rows) and the
    decode and prefill kernels read it, giving the torch backend's greedy tokens."""
    path = make_tiny_model(tmp_path / "ds", "deepseek_v3", builtin_path, **LATENT)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 5)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(path, backend, monkeypatch, num_blocks=16, max_num_batched_tokens=96)
        assert tuple(engine.kv_cache.data.shape[1:]) == (1, 16, 8, 1, 40)
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize("arch,indexers", [("deepseek_v32", {}),
                                            ("glm_moe_dsa", {"indexer_types": ["full", "shared"]})])
def test_engine_on_triton_kernels_serves_sparse_attention_as_the_reference(tmp_path, builtin_path, monkeypatch, arch,
                                                                           indexers):
    """DeepSeek V3.2's and GLM-5's sparse attention past its index_topk of 8: the Triton indexer scores and picks
    (`kernels.triton_dsa`), the Triton sparse kernel attends (GLM-5's second layer to the first one's choice), and
    the greedy tokens are the torch backend's, which equal transformers' (tests/engine/test_engine_vs_hf.py)."""
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **LATENT, index_n_heads=16, index_head_dim=16,
                           index_topk=8, **indexers)
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(path, backend, monkeypatch, num_blocks=16, max_num_batched_tokens=96)
        assert hasattr(engine.runner.backend, "dsa_choose_tokens") == (backend == "triton")
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize("arch,shape", [("bloom", {"n_layer": 2, "n_head": 4}),
                                        ("mpt", {"n_layers": 2, "n_heads": 4, "d_model": 64,
                                                 "attn_config": {"clip_qkv": 0.8}})])
def test_engine_on_triton_kernels_serves_alibi_as_the_reference(tmp_path, builtin_path, monkeypatch, arch, shape):
    """BLOOM's and MPT's ALiBi: on the Triton backend the paged and prefill kernels add each head's slope x (key -
    query position) themselves (a 70-token prompt's first chunk through the prefill kernel, short chunks and decodes
    through the paged one), giving the greedy tokens of the torch backend's `kernels.alibi`, which equal
    transformers' (tests/engine/test_engine_vs_hf.py); the model is graph-safe, its forward asking the device
    nothing."""
    from kernels import alibi, triton_attention

    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **shape)
    calls = {"triton": 0, "torch": 0}
    real_triton, real_torch = triton_attention.paged_attention, alibi.alibi_attention

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += name == "torch" or kwargs.get("alibi") is not None
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(triton_attention, "paged_attention", counted("triton", real_triton))
    monkeypatch.setattr("engine.models.bloom.alibi_attention", counted("torch", real_torch))
    rng = random.Random(19)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 5, 19)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(path, backend, monkeypatch, num_blocks=24, max_num_batched_tokens=96)
        assert engine.model.graph_safe
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert calls[backend] > 0 and calls["torch" if backend == "triton" else "triton"] == 0
        calls[backend] = 0
        assert_all_free(engine)
    assert results["triton"] == results["torch"]


def test_engine_on_triton_kernels_serves_block_sparse_attention_as_the_reference(tmp_path, builtin_path, monkeypatch):
    """MiniMax M3's block-sparse layers past the blocks a query may choose (2 of 4 keys): the Triton kernels score the
    blocks and attend to the choice (`kernels.triton_block_sparse`), before that the paged kernels attend densely; the
    greedy tokens are the torch backend's, which equal transformers' (tests/engine/test_engine_vs_hf.py)."""
    from kernels import triton_attention
    from tests.engine.test_engine_vs_hf import MINIMAX_M3

    path = make_tiny_model(tmp_path / "m3", "minimax_m3_vl_text", builtin_path, **MINIMAX_M3)
    sparse = []
    real = triton_attention.block_sparse_attention
    monkeypatch.setattr(triton_attention, "block_sparse_attention",
                        lambda *args, **kwargs: sparse.append(len(args[0])) or real(*args, **kwargs))
    rng = random.Random(23)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (24, 3, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(path, backend, monkeypatch, num_blocks=24, max_num_batched_tokens=32)
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert sparse, "no step went through the Triton block-sparse kernels"
    assert results["triton"] == results["torch"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the stand-ins leave outputs unwritten
@pytest.mark.parametrize("arch", ["deepseek_v32", "hy_v4", "minimax_m3_vl_text"])
def test_the_sparse_kernels_warmed_at_start_are_the_variants_every_sparse_step_launches(tmp_path, builtin_path,
                                                                                        monkeypatch, arch):
    """`ModelRunner.warm_sparse_kernels` (run with the paged kernels' compile, on CUDA) launches DeepSeek V3.2's
    indexer and sparse kernels (HY V4's with sinks) or MiniMax M3's block-sparse ones once over a layer's cache; every
    launch of the engine's later sparse steps (decodes and chunks, contexts of any length past the dense regime) has
    the compile key of one of those, so none compiles while serving. The keys are Triton's own (every argument's
    specialization, the constexprs); the kernels are stood in for, not run."""
    from types import SimpleNamespace

    jit = pytest.importorskip("triton.runtime.jit")
    compiler = pytest.importorskip("triton.backends.compiler")
    if not hasattr(jit, "native_specialize_impl"):
        pytest.skip("this Triton forms its compile keys elsewhere")
    from kernels import triton_block_sparse, triton_dsa
    from tests.engine.test_engine_vs_hf import HYV4, MINIMAX_M3
    from tests.kernels.test_triton import _KeyRecorder

    shapes = {"deepseek_v32": {**LATENT, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8},
              "hy_v4": HYV4, "minimax_m3_vl_text": MINIMAX_M3}
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **shapes[arch])
    engine = _engine(path, "triton", monkeypatch, num_blocks=40, max_num_batched_tokens=48)
    keys = SimpleNamespace(keys={}, phase="compile", launched={"compile": set(), "step": set()},
                           specialize=lambda arg, specialize: jit.native_specialize_impl(
                               compiler.BaseBackend, arg, False, specialize, True))
    for module, name in [(triton_dsa, "_index_scores_kernel"), (triton_dsa, "_sparse_attention_kernel"),
                         (triton_block_sparse, "_block_scores_kernel"), (triton_block_sparse, "_chosen_blocks_kernel")]:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _KeyRecorder(keys, name, kernel.fn,
                                                       kernel.kwargs.get("do_not_specialize") or ()))
    assert engine.runner.warm_sparse_kernels() == 1
    keys.phase = "step"
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 5, 19, 33)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert keys.launched["step"] == keys.launched["compile"] and len(keys.launched["step"]) == 2
    new = [key for key, phase in keys.keys.items() if phase == "step"]
    assert not new, f"{len(new)} launch keys the warm-up had not, e.g. {new[0]}"


@pytest.mark.parametrize("arch", ["minimax_m3_vl_text", "qwen4_exp_text"])
def test_engine_on_triton_kernels_serves_an_indexed_model_over_an_fp8_cache_as_the_reference(tmp_path, builtin_path,
                                                                                           monkeypatch, arch):
    """kv_cache_dtype fp8 for MiniMax M3 and Qwen4-Exp: K and V in FP8 at each layer's scales, the indexed layers'
    indexer keys in bfloat16 (`index_key_dtype`); the Triton kernels (paged within the dense regime; past it M3's
    block-sparse kernels, Qwen4-Exp's torch QSA reading the FP8 rows at their scales) read the cache as the torch
    backend does: the same greedy tokens."""
    import torch

    from tests.engine.test_engine_vs_hf import MINIMAX_M3, QWEN4_EXP

    path = make_tiny_model(tmp_path / arch, arch, builtin_path,
                           **{"minimax_m3_vl_text": MINIMAX_M3, "qwen4_exp_text": QWEN4_EXP}[arch])
    rng = random.Random(37)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (20, 3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(path, backend, monkeypatch, num_blocks=24, kv_cache_dtype="fp8", calculate_kv_scales=False,
                         max_num_batched_tokens=32)   # the scales set below
        assert [t.dtype for t in engine.kv_cache.tensors] == [torch.float8_e4m3fn, torch.bfloat16]
        attention = [layer.self_attn for layer in engine.runner.model.layers if hasattr(layer, "self_attn")]
        for i, attn in enumerate(attention):   # scales of each layer's own, not 1
            attn.k_scale, attn.v_scale = 0.011 * (i + 1), 0.007 * (i + 2)
        results[backend] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert results["triton"] == results["torch"]
