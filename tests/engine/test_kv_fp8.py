"""An FP8 KV cache (`kv_cache_dtype: fp8`): one byte an element, per-layer K and V scales (the checkpoint's,
or measured at start by `engine.kv_scales`), stored and read by the reference and CPU backends; swap, prefix
caching and copy-on-write move its bytes."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.kvcache import CHAT_QUESTIONS
from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model import WeightLoadError
from engine.sampling import SamplingParams
from kernels.reference import FP8_KV_DTYPE, FP8_MAX, quantize_kv, store_kv
from kernels.metadata import AttentionMetadata
from tests.conftest import assert_all_free, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(path, kv: str = "fp8", num_blocks: int = 256, calculate_kv_scales: bool = True, tp: int = 1,
            **sched) -> LLMEngine:
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", cache=CacheConfig(block_size=8),
                                  pools=(pool,), kv_cache_dtype=kv, calculate_kv_scales=calculate_kv_scales,
                                  tensor_parallel_size=tp, cpu_threads=1), progress=False)


def _scales(engine: LLMEngine) -> list[tuple[float, float]]:
    return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in engine.model.layers]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", builtin_path, initializer_range=0.05)


def test_quantize_saturates_and_rounds_as_torch():
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e6, 0.0123, 447.0])
    q = quantize_kv(x, FP8_KV_DTYPE, 2.0)
    assert q.dtype == FP8_KV_DTYPE and q.float()[3] == FP8_MAX and q.float()[4] == -FP8_MAX
    assert torch.equal(q.view(torch.uint8), (x / 2.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE).view(torch.uint8))
    assert quantize_kv(x, torch.bfloat16, 2.0).equal(x.to(torch.bfloat16))   # the scale is an FP8 cache's only


def test_the_reference_stores_fp8_bytes_and_skips_negative_slots():
    key, value = torch.randn(3, 2, 8) * 40, torch.randn(3, 2, 8)
    k_cache = torch.zeros(4, 2, 2, 8, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    meta = replace(AttentionMetadata.build([[0], [1], [2]], [1, 1, 1], [1, 1, 1], block_size=2),
                   slot_mapping=torch.tensor([5, -1, 2]), has_invalid_slots=True)
    store_kv(key, value, k_cache, v_cache, meta, k_scale=0.5, v_scale=0.01)
    flat_k, flat_v = k_cache.view(-1, 2, 8).view(torch.uint8), v_cache.view(-1, 2, 8).view(torch.uint8)
    assert torch.equal(flat_k[5], quantize_kv(key[0], FP8_KV_DTYPE, 0.5).view(torch.uint8))
    assert torch.equal(flat_v[2], quantize_kv(value[2], FP8_KV_DTYPE, 0.01).view(torch.uint8))
    assert int(flat_k[[0, 1, 3, 4, 6, 7]].count_nonzero()) == 0


@pytest.mark.slow   # model-size, ~11 s; the FP8 cache on tiny models is checked below and in tests/kernels
def test_the_builtin_model_with_an_fp8_cache(builtin_path):
    """A quarter of float32's bytes a token; scales measured at start (none in the checkpoint); greedy chat
    answers of 8 tokens the same as the float32 cache's on at least 13 of 20 questions (15 measured on
    2026-11-28; agreement falls with length: docs/PERF.md, "FP8 KV cache")."""
    answers = {}
    for kv in ("auto", "fp8"):
        engine = _engine(builtin_path, kv, num_blocks=512)
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
        answers[kv] = [o.outputs[0].token_ids for o in
                       engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
        assert_all_free(engine)
    assert engine.kv_cache.data.dtype == FP8_KV_DTYPE and engine.kv_bytes_per_token * 4 == 46_080
    assert all(0 < k != 1.0 and 0 < v != 1.0 for k, v in _scales(engine))
    assert sum(a == b for a, b in zip(answers["auto"], answers["fp8"])) >= 13


def test_calculate_kv_scales_false_keeps_every_scale_at_one(tiny_path):
    """`calculate_kv_scales: false` (vLLM's default): no scales measured, every layer's stays 1.0; the
    default measures them."""
    assert all(k != 1.0 and v != 1.0 for k, v in _scales(_engine(tiny_path, num_blocks=32)))
    engine = _engine(tiny_path, num_blocks=32, calculate_kv_scales=False)
    assert _scales(engine) == [(1.0, 1.0)] * len(engine.model.layers)


def test_scales_do_not_depend_on_another_pools_length_and_a_pool_too_small_to_measure_says_so(tiny_path, caplog):
    """The calibration text was cut to the shortest pool's max_model_len (a second pool changed every pool's
    numerics) and a pool too small to hold it kept every scale at 1.0 without a word."""
    def engine(*pools):
        return LLMEngine(EngineConfig(model=str(tiny_path), device="cpu", cache=CacheConfig(block_size=8),
                                      pools=pools, kv_cache_dtype="fp8"), progress=False)

    alone = _scales(engine(PoolConfig(name="rag", num_blocks=256)))
    beside = _scales(engine(PoolConfig(name="rag", num_blocks=256),
                            PoolConfig(name="chat", num_blocks=64, scheduler=SchedulerConfig(max_model_len=32))))
    assert beside == alone
    with caplog.at_level(logging.WARNING, logger="cliffguard.engine"):
        small = engine(PoolConfig(num_blocks=4))
    assert _scales(small) == [(1.0, 1.0)] * len(small.model.layers)
    assert "the scales were not measured" in caplog.text


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_a_tensor_parallel_group_measures_the_scales_one_rank_would(tiny_path):
    """Each rank observes its own KV head; one MAX all-reduce gives every rank the layer's scale, so two
    ranks set the scales one rank does and their answers (each rank storing and reading its half of the
    cache with them) agree with one rank's to float rounding."""
    prompts = [[5 + (7 * i + j) % 400 for j in range(12 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = {}
    for tp in (1, 2):
        engine = _engine(tiny_path, num_blocks=64, tp=tp)
        try:
            outs[tp] = [o.outputs[0] for o in engine.generate(prompts, params)]
            scales = _scales(engine)
            if tp == 1:
                reference = scales
            assert all(s != (1.0, 1.0) for s in scales)
            assert [x for pair in scales for x in pair] == pytest.approx([x for pair in reference for x in pair],
                                                                        rel=1e-5)
        finally:
            engine.close()
    for one, two in zip(outs[1], outs[2]):
        assert one.token_ids == two.token_ids
        assert two.logprobs == pytest.approx(one.logprobs, abs=1e-4)


def test_checkpoint_scales_are_loaded_and_checked(tiny_path, tmp_path, caplog):
    folder = tmp_path / "scaled"
    folder.mkdir()
    for item in tiny_path.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            (folder / item.name).write_bytes(item.read_bytes())
    tensors = {}
    for shard in sorted(tiny_path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
                    "model.layers.1.self_attn.v_scale": torch.tensor([0.5])})
    save_file(tensors, folder / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="cliffguard.engine"):
        engine = _engine(folder)
    attns = [layer.self_attn for layer in engine.model.layers]
    assert (attns[0].k_scale, attns[0].v_scale, attns[1].k_scale, attns[1].v_scale) == (0.25, 1.0, 1.0, 0.5)
    assert "FP8 KV scales leave 2 of 4 at 1.0 (layers 0.v_scale, 1.k_scale)" in caplog.text   # said, not silent
    engine.generate([[5, 6, 7]], GREEDY)   # served with them
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(1.0),   # the checkpoint's 1.0s: its own,
                    "model.layers.1.self_attn.v_scale": torch.tensor(1.0)})  # kept, not measured over
    save_file(tensors, folder / "model.safetensors")
    attns = [layer.self_attn for layer in _engine(folder).model.layers]
    assert {a.k_scale for a in attns} == {a.v_scale for a in attns} == {1.0}
    for bad in (-1.0, float("inf"), float("nan")):
        tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(bad)
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(WeightLoadError, match="v_scale: a KV scale must be positive and finite"):
            _engine(folder)


def test_kv_scales_as_exporters_name_them_in_a_kv_cache_only_checkpoint(tiny_path, tmp_path):
    """llm-compressor's KV-cache-only checkpoints (compressed-tensors with a kv_cache_scheme, float weights) load
    with their scales; AutoFP8's one `kv_scale` sets K's and V's, ModelOpt's `k_proj.output_scale` /
    `v_proj.output_scale` are K's and V's (as vLLM reads them)."""
    folder = tmp_path / "kv-only"
    folder.mkdir()
    for item in tiny_path.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("model.safetensors.index.json", "config.json"):
            (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((tiny_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for shard in sorted(tiny_path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    tensors.update({"model.layers.0.self_attn.kv_scale": torch.tensor(0.25),
                    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.5),
                    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(0.125)})
    save_file(tensors, folder / "model.safetensors")
    engine = _engine(folder)
    assert _scales(engine) == [(0.25, 0.25), (0.5, 0.125)] and engine.model.kv_scales_from_checkpoint
    engine.generate([[5, 6, 7]], GREEDY)


def test_block_copies_and_swaps_move_fp8_bytes(tiny_path):
    """Copy-on-write and swap move an FP8 cache's bytes exactly (torch has no index_copy for FP8 on a CPU:
    they go through the bytes)."""
    engine = _engine(tiny_path, num_blocks=16, preemption_mode="swap", swap_space_bytes=4 << 20)
    cache, swap = engine.kv_cache, engine.swap_spaces["default"]
    cache.data.view(torch.uint8).copy_(torch.randint(0, 120, cache.data.shape, dtype=torch.uint8))
    before = cache.raw.clone()
    cache.copy_blocks([(3, 9)])
    assert torch.equal(cache.raw[:, :, 9], before[:, :, 3])
    swap.swap_out([(3, 0), (5, 1)])
    cache.raw[:, :, [3, 5]] = 0
    swap.swap_in([(0, 3), (1, 5)])
    assert torch.equal(cache.raw[:, :, [3, 5]], before[:, :, [3, 5]])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_prefix_caching_and_forks_with_an_fp8_cache(tiny_path, mode):
    """Under pressure (preemption by recompute or swap, prefix hits, n > 1 forks copying on write) every
    request ends and every block comes back. (Tokens are not compared with a roomier run: a step of
    another batch shape rounds float32 differently, and FP8's coarse grid turns such an ulp into a
    different stored value now and then.)"""
    shared = list(range(40, 72))
    prompts = [shared + [90 + i] for i in range(3)] + [[5, 6, 7, 8]]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True), GREEDY]
    swap = {"swap_space_bytes": 8 << 20} if mode == "swap" else {}
    engine = _engine(tiny_path, num_blocks=14, preemption_mode=mode, **swap)
    outs = engine.generate(prompts, params)
    stats, bm = engine.schedulers["default"].stats, engine.schedulers["default"].block_manager
    assert stats.num_preemptions > 0 and bm.num_prefix_hits > 0
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [24] * 5
    if mode == "swap":
        assert stats.num_swap_preemptions > 0
    assert_all_free(engine)


def test_shared_attention_blocks_measure_one_scale_over_every_use(tmp_path, builtin_path):
    """Zamba2's shared blocks: each block's attention stores K/V for every hybrid layer using it, so its FP8 scales
    are measured once over all of them (each block its own: `Zamba2ForCausalLM.kv_attentions`), and greedy answers
    with the FP8 cache mostly agree with the model's dtype's."""
    from tests.engine.test_engine_vs_hf import ZAMBA2

    path = make_tiny_model(tmp_path / "zamba2", "zamba2", builtin_path, **{**ZAMBA2, "num_mem_blocks": 2,
                                                                            "initializer_range": 0.05})
    engines = {kv: _engine(path, kv=kv, num_blocks=64) for kv in ("auto", "fp8")}
    scales = [(b.self_attn.k_scale, b.self_attn.v_scale) for b in engines["fp8"].model.blocks]
    assert len(scales) == 2 and all(k != 1.0 and v != 1.0 for k, v in scales) and scales[0] != scales[1]
    prompts = [[5 + (7 * i + j) % 400 for j in range(12 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {kv: [o.outputs[0].token_ids for o in engine.generate(prompts, params)] for kv, engine in engines.items()}
    assert sum(a == b for a, b in zip(outs["auto"], outs["fp8"])) >= 2
