"""pools.capacity_plan: the capacity formula checked against hand arithmetic, its errors and the engine
configs it yields (the `cliffguard capacity` command is tested in tests/gateway/test_cli.py)."""

from __future__ import annotations

import json
from fractions import Fraction
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from engine.model_config import ModelConfig
from engine.parallel import ShardShape
from pools.capacity_plan import engine_configs, plan_capacity, plan_single_pool, replica_engine_configs
from pools.model_configs import resolve_model_configs
from pools.config.yaml_file import parse_config
from pools.config.spec import DEFAULT_CPU_MEMORY, SpecError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "examples" / "llama3-70b-8xh100.yaml"
LLAMA70B_JSON = REPO / "config" / "examples" / "llama-3-70b" / "config.json"
GiB = 1 << 30


def _llama70b(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_config({**json.loads(LLAMA70B_JSON.read_text()), **overrides})


def _example_data() -> dict:
    """The example's YAML, its device planned for 80 GiB GPUs (the file's `memory` is auto: measured where served)."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["devices"]["h100x8"]["memory"] = "80GiB"
    return data


def _plan_example(data: dict | None = None, model: ModelConfig | None = None, **kwargs):
    config = parse_config(data or _example_data(), env={}, base_dir=EXAMPLE.parent)
    model = model or _llama70b()
    return config, plan_capacity(config, {p.model: model for p in config.local_pools}, **kwargs)


def _small_config(**pool_overrides) -> dict:
    """SmolLM2 in float32 on a CPU device with 2 GiB: chat + rag, max_model_len 1024."""
    chat = {"name": "chat", "model": "builtin:smollm2-135m-instruct", "route": {"max_prompt_tokens": 512},
            "kv_share": 0.4, "avg_len": 256, "max_model_len": 1024}
    rag = {"name": "rag", "model": "builtin:smollm2-135m-instruct", "route": {"min_prompt_tokens": 513},
           "kv_share": 0.6, "avg_len": 900, "max_model_len": 1024}
    chat.update(pool_overrides)
    return {"devices": {"default": {"device": "cpu", "memory": "2GiB", "dtype": "float32"}}, "pools": [chat, rag]}


def test_llama3_70b_on_8xh100_matches_hand_arithmetic():
    _, plan = _plan_example()
    h, i, v, layers, kv = 8192, 28672, 128256, 80, 8 * 128
    params = 2 * v * h + layers * (h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h) + h   # embed + head untied
    weights = params * 2                                      # bfloat16
    s_kv = 2 * 80 * 8 * 128 * 2
    assert s_kv == 327_680 and s_kv / 2**20 == 0.3125
    assert weights == 141_107_412_992                         # the seed's "140 GB for 70B FP16"
    # each rank's decode graphs (engine.cuda_graphs.graph_memory_bytes): its shard's activations at batch
    # 512 (8 of 64 heads, 1 of 8 KV heads, 3584 MLP rows; flash-decoding partials of 8 heads x 16 splits)
    # doubled, plus 64 MiB
    per_token = 2 * (5 * h + 1024 + 2 * 128 + 1024 + 3 * (i // 8) + 128) + 4 * 8 * 16 * (128 + 2)
    graphs = 2 * 512 * per_token + (64 << 20)
    assert graphs == 246_153_216                              # 234.75 MiB per GPU
    # each rank's weights: an eighth of every matrix (V = 128256 splits evenly), the norms whole on every rank
    norms = layers * 2 * h + h
    weights_per_gpu = ((params - norms) // 8 + norms) * 2
    assert weights_per_gpu - weights // 8 == 2_308_096       # 2.2 MiB above weights / TP
    rope = 8192 * 128 * 2                                     # each rank's rotary cos/sin cache: loaded beside them
    kv_per_gpu = int(0.9 * 80 * GiB) - weights_per_gpu - rope - graphs
    d = plan.devices["h100x8"]
    assert d.graph_bytes_per_device == graphs
    assert (d.weights_bytes, d.weights_bytes_per_device, d.kv_bytes_per_token) == (weights, weights_per_gpu, s_kv)
    assert d.kv_bytes_per_token_per_device == s_kv // 8 == 40_960
    assert d.kv_space_bytes_per_device == kv_per_gpu and d.kv_space_bytes == 8 * kv_per_gpu
    for name, share, avg_len, expected_seqs in (("chat", 0.4, 1024, 566), ("rag", 0.6, 6144, 141)):
        p = plan.pools[name]
        pool_kv = int(Fraction(share) * kv_per_gpu)
        assert p.kv_cache_bytes_per_device == pool_kv
        assert p.num_blocks == pool_kv // (40_960 * 16)
        assert p.max_num_seqs == pool_kv // (40_960 * avg_len) == expected_seqs
        # the same formula on the whole TP group: (0.9 x 8 x VRAM - weights - graphs) x share / (S_KV x avg_len)
        assert abs(p.max_num_seqs - share * (0.9 * 8 * 80 * GiB - weights - 8 * (rope + graphs)) / (s_kv * avg_len)) < 1
        assert p.max_concurrent_at_max_len == p.num_blocks // 512
        assert p.fragmentation_bytes == 15 * 40_960 * p.max_num_seqs // 2
        assert p.fragmentation_fraction == pytest.approx(7.5 / avg_len, rel=0.01)
    assert plan.warnings == ()


def test_vram_override_gives_the_same_plan_as_memory_80gib():
    data = _example_data()
    data["devices"]["h100x8"]["memory"] = "auto"
    data["devices"]["h100x8"]["device"] = "auto"
    _, by_vram = _plan_example(data, vram_bytes=80 * GiB)     # auto + --vram: planned as CUDA, bfloat16
    _, by_config = _plan_example()
    assert by_vram.pools == by_config.pools
    assert by_vram.devices["h100x8"].memory_source == "--vram"
    assert (by_vram.devices["h100x8"].device_type, by_vram.devices["h100x8"].dtype) == ("cuda", "bfloat16")


def test_memory_auto_on_cuda_asks_the_device():
    data = _example_data()
    data["devices"]["h100x8"]["memory"] = "auto"
    asked = []
    _, plan = _plan_example(data, cuda_memory=lambda dev: asked.append(dev) or 80 * GiB)
    assert asked == [f"cuda:{g}" for g in range(8)] and plan.devices["h100x8"].memory_bytes == 80 * GiB


def test_memory_auto_is_the_smallest_of_the_gpus_the_device_runs_on():
    """`gpus: [2, 3]` on a node whose GPU 0 is larger: the plan is the listed GPUs' (the smaller of them), not
    GPU 0's (the engine then refused to start on them, after loading the weights)."""
    data = _example_data()
    data["devices"]["h100x8"] |= {"memory": "auto", "tensor_parallel_size": 2, "gpus": [2, 3]}
    sizes = {"cuda:0": 141 * GiB, "cuda:1": 141 * GiB, "cuda:2": 80 * GiB, "cuda:3": 79 * GiB}
    _, plan = _plan_example(data, cuda_memory=sizes.__getitem__)
    assert plan.devices["h100x8"].memory_bytes == 79 * GiB


def test_a_max_num_seqs_above_the_pools_blocks_is_refused_naming_it():
    """More sequences than blocks can never run (each holds one at least); a typo of that size sized the
    engine's per-row tensors and took the worker down once loaded. At the block count it plans (warned)."""
    data = _example_data()
    data["pools"][1]["max_num_seqs"] = 10**8
    with pytest.raises(SpecError, match=r"^pools\[1\]\.max_num_seqs: 100000000 is above the pool's (\d+) KV blocks"):
        _plan_example(data)
    data["pools"][1]["max_num_seqs"] = _plan_example()[1].pools["rag"].num_blocks
    assert _plan_example(data)[1].pools["rag"].max_num_seqs == data["pools"][1]["max_num_seqs"]


def test_without_gqa_s_kv_is_the_seeds_2_5_mb():
    _, plan = _plan_example(model=_llama70b(num_key_value_heads=64))
    d = plan.devices["h100x8"]
    assert d.kv_bytes_per_token == 2 * 80 * 64 * 128 * 2 == 2_621_440 == int(2.5 * 2**20)
    assert d.kv_bytes_per_token_per_device == 327_680         # the seed's "≈0.3 MB with TP=8"


@pytest.mark.parametrize("native_bfloat16", [True, False])
def test_cpu_device_plans_its_auto_dtype_with_default_memory(monkeypatch, native_bfloat16):
    """`dtype: auto` on a CPU: bfloat16 where it computes bfloat16 natively, float32 elsewhere; S_KV in it."""
    monkeypatch.setattr("engine.config.cpu_computes_bfloat16", lambda: native_bfloat16)
    data = _small_config()
    data["devices"]["default"] = {"device": "cpu"}
    config = parse_config(data, env={})
    model = _llama70b(num_hidden_layers=1, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1000)
    d = plan_capacity(config, {"builtin:smollm2-135m-instruct": model}).devices["default"]
    dtype, itemsize = ("bfloat16", 2) if native_bfloat16 else ("float32", 4)
    assert (d.device_type, d.dtype, d.memory_bytes, d.memory_source) == ("cpu", dtype, DEFAULT_CPU_MEMORY,
                                                                         "cpu default")
    assert d.kv_bytes_per_token == 2 * 1 * 8 * 64 * itemsize


@pytest.mark.parametrize("tp,match", [
    (1, r"^devices\.h100x8\.memory: 0\.9 x 80\.00 GiB .*131\.42 GiB"),    # the weights do not fit one GPU
    (3, r"^devices\.h100x8\.tensor_parallel_size: 3 .*64 attention heads"),
])
def test_device_errors_name_the_key(tp, match):
    data = _example_data()
    data["devices"]["h100x8"]["tensor_parallel_size"] = tp
    with pytest.raises(SpecError, match=match):
        _plan_example(data)


def test_a_model_that_cannot_run_in_the_devices_dtype_is_refused_at_plan_time_naming_it():
    """Gemma 3 in float16 (its activations overflow it): `cliffguard capacity` and the gateway's start refuse it
    naming devices.<name>.dtype; it failed only as a worker's start."""
    gemma = _llama70b(architectures=["Gemma3ForCausalLM"], sliding_window=1024)
    data = _example_data()
    data["devices"]["h100x8"]["dtype"] = "float16"
    with pytest.raises(SpecError, match=r"^devices\.h100x8\.dtype: Gemma 3's activations overflow float16"):
        _plan_example(data, gemma)
    data["devices"]["h100x8"]["dtype"] = "bfloat16"
    assert _plan_example(data, gemma)[1].devices["h100x8"].dtype == "bfloat16"


def test_tp_above_the_kv_heads_replicates_one_per_gpu():
    data = _example_data()
    data["devices"]["h100x8"]["tensor_parallel_size"] = 16
    _, plan = _plan_example(data)
    assert plan.devices["h100x8"].kv_bytes_per_token_per_device == 2 * 80 * 1 * 128 * 2


def test_pool_that_cannot_hold_one_max_length_request():
    data = _example_data()
    data["pools"][0]["kv_share"] = 0.001
    with pytest.raises(SpecError, match=r"^pools\[0\]\.kv_share: 0\.001 .* needs 512"):
        _plan_example(data)
    data["pools"][0]["kv_share"] = 0.4
    data["pools"][1]["kv_share"] = None
    data["pools"][1]["kv_cache_bytes"] = "100MiB"
    with pytest.raises(SpecError, match=r"^pools\[1\]\.kv_cache_bytes: 100\.00 MiB .*max_model_len 8192"):
        _plan_example(data)


@pytest.mark.parametrize("index,pool_edit,match", [
    (0, {"max_model_len": 16384}, r"^pools\[0\]\.max_model_len: 16384 .*8192"),
    (1, {"route": {"min_prompt_tokens": 4097, "max_prompt_tokens": 8192}},
     r"^pools\[1\]\.route\.max_prompt_tokens: 8192 .*max_model_len 8192"),
    (1, {"route": {"min_prompt_tokens": 9000}}, r"^pools\[1\]\.route\.min_prompt_tokens: 9000 .*8192"),
    (0, {"avg_len": 10**7}, r"^pools\[0\]\.kv_share: 0\.4 gives max_num_seqs = .* = 0"),
])
def test_pool_errors_name_the_key(index, pool_edit, match):
    data = _example_data()
    data["pools"][index].update(pool_edit)
    with pytest.raises(SpecError, match=match):
        _plan_example(data)


def test_explicit_budgets_above_the_device():
    data = _example_data()
    for pool in data["pools"]:
        pool.pop("kv_share")
        pool["kv_cache_bytes"] = "30GiB"
    with pytest.raises(SpecError, match=r"^pools\[0\]\.kv_cache_bytes: 30\.00 GiB.* 60\.00 GiB .*55\.34 GiB"):
        _plan_example(data)


def test_max_num_seqs_override_above_the_formula_is_reported():
    data = _example_data()
    data["pools"][1]["max_num_seqs"] = 1000
    _, plan = _plan_example(data)
    rag = plan.pools["rag"]
    assert (rag.max_num_seqs, rag.formula_max_num_seqs, rag.max_num_seqs_overridden) == (1000, 141, True)
    assert len(plan.warnings) == 1 and "pools[1].max_num_seqs: 1000" in plan.warnings[0]


def test_upstream_pools_are_not_planned():
    data = _example_data()
    data["pools"].append({"name": "remote", "upstream": "https://example.com/v1", "model": "other",
                          "route": {"min_prompt_tokens": 0}})
    config, plan = _plan_example(data)
    assert plan.upstream_pools == ("remote",) and list(plan.pools) == ["chat", "rag"]


def test_engine_configs_carry_the_planned_numbers(builtin_path):
    config = parse_config(_small_config(slo={"ttft_ms": 800, "itl_ms": 60}), env={})
    assert config.pools[0].slo is not None and config.pools[1].slo is None
    model = ModelConfig.from_folder(builtin_path)
    plan = plan_capacity(config, {"builtin:smollm2-135m-instruct": model})
    engine = engine_configs(config, plan)["default"]
    assert (engine.model, engine.device, engine.dtype) == ("builtin:smollm2-135m-instruct", "cpu", "float32")
    assert engine.cache.block_size == 16
    assert engine.num_blocks == sum(p.num_blocks for p in plan.pools.values())
    for pool_config, pool_plan in zip(engine.pools, plan.pools.values(), strict=True):
        assert pool_config.name == pool_plan.name and pool_config.num_blocks == pool_plan.num_blocks
        assert pool_config.scheduler.max_num_seqs == pool_plan.max_num_seqs
        assert pool_config.scheduler.max_model_len == pool_plan.max_model_len == 1024
        assert pool_config.scheduler.max_num_batched_tokens == 2048
    assert [pc.slo for pc in engine.pools] == [p.slo for p in config.pools]   # service classes pass through
    # hand arithmetic for SmolLM2 (30 layers, 3 KV heads of 64, float32) on 2 GiB
    s_kv = 2 * 30 * 3 * 64 * 4
    kv = int(0.9 * 2 * GiB) - model.num_params() * 4 - 1024 * 64 * 4   # weights, the rotary cache of 1,024 positions
    assert plan.pools["chat"].num_blocks == int(0.4 * kv) // (s_kv * 16)
    assert plan.pools["rag"].formula_max_num_seqs == int(0.6 * kv) // (s_kv * 900) == 20
    # 900 tokens hold 57 blocks of 16 (912 slots): the pool's blocks hold 19 such requests, not the formula's 20
    assert plan.pools["rag"].max_num_seqs == (int(0.6 * kv) // (s_kv * 16)) // 57 == 19


def test_engine_configs_place_every_rank_on_a_gpu_of_its_own(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)   # plan and check an H100 node on any machine
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    config, plan = _plan_example()
    engine = engine_configs(config, plan)["h100x8"]
    assert (engine.tensor_parallel_size, engine.device, engine.gpu_ids) == (8, "cuda:0", tuple(range(8)))
    assert engine.dtype == "bfloat16"
    auto = _example_data()   # dtype auto, planned as bfloat16 (of float16's size), is each GPU's own: the
    auto["devices"]["h100x8"]["dtype"] = "auto"   # serving replica's, float16 on one without bfloat16
    config_auto, plan_auto = _plan_example(auto)
    engine = engine_configs(config_auto, plan_auto)["h100x8"]
    assert (plan_auto.devices["h100x8"].dtype, engine.dtype) == ("bfloat16", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert engine.resolved_dtype(torch.device("cuda", 0)) == torch.float16
    data = _example_data()
    data["devices"]["h100x8"].update(tensor_parallel_size=4, replicas=2, gpus=[7, 6, 5, 4, 3, 2, 1, 0])
    replicas = replica_engine_configs(*_plan_example(data))["h100x8"]
    assert [(e.device, e.gpu_ids) for e in replicas] == [("cuda:7", (7, 6, 5, 4)), ("cuda:3", (3, 2, 1, 0))]
    assert replicas[0].pools == replicas[1].pools   # the same pools and block ranges on each
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    with pytest.raises(SpecError, match=r"^devices\.h100x8\.device: replica 0 needs GPU 7 and this machine has 4"):
        engine_configs(config, plan)


def test_serve_refuses_a_written_gpu_size_past_this_machines_gpus(monkeypatch):
    """A `memory:` (or `--vram`) larger than a GPU the device runs on here: its plan's blocks would not fit, and
    its worker refused them only once the gateway listened, naming `pools`; now `serve` says so first, naming the
    key. The GPUs' own size, or a machine whose GPUs cannot be asked, passes."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    data, gib = _example_data(), 1 << 30
    data["devices"]["h100x8"]["memory"] = "80GiB"   # an H100 80GB is 79.2 GiB to torch
    size = 80 * gib
    for real, vram, error in ((size - gib // 2, None, r"^devices\.h100x8\.memory: .* but GPU 0 of this machine"),
                              (size, size + gib, r"^--vram: "), (size, None, None)):
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda g, real=real: SimpleNamespace(total_memory=real))
        if error is None:
            assert replica_engine_configs(*_plan_example(data, vram_bytes=vram))["h100x8"]
            continue
        with pytest.raises(SpecError, match=error):
            replica_engine_configs(*_plan_example(data, vram_bytes=vram))


def test_an_auto_device_on_a_cuda_machine_takes_the_first_gpus(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)   # `device: auto` where CUDA is present
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    data = _example_data()
    data["devices"]["h100x8"].update(device="auto", tensor_parallel_size=2, replicas=2)
    replicas = replica_engine_configs(*_plan_example(data))["h100x8"]
    assert [(e.device, e.gpu_ids) for e in replicas] == [("cuda:0", (0, 1)), ("cuda:2", (2, 3))]


def test_engine_configs_refuse_what_the_engine_cannot_run(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)   # plan and check an H100 on any machine
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    data = _example_data()
    data["devices"]["h100x8"]["tensor_parallel_size"] = 1
    data["devices"]["h100x8"]["memory"] = "400GiB"
    data["pools"][0]["preemption_mode"] = "auto"
    with pytest.raises(SpecError, match=r"^pools\[0\]\.swap_space: preemption_mode 'auto' needs"):
        _plan_example(data)   # the YAML is checked by the engine's own rule: auto may swap
    data["pools"][0]["swap_space"] = "4GiB"
    data["pools"][0]["victim_policy"] = "longest_first"
    data["pools"][0]["enable_prefix_caching"] = True
    scheduler = engine_configs(*_plan_example(data))["h100x8"].pools[0].scheduler
    assert (scheduler.preemption_mode, scheduler.victim_policy, scheduler.swap_space_bytes,
            scheduler.enable_prefix_caching) == ("auto", "longest_first", 4 << 30, True)


def test_the_engine_runs_with_exactly_the_planned_numbers(builtin_path):
    """A real LLMEngine (small explicit budgets so the KV tensor stays small) gets the planned blocks/limits."""
    from engine.llm_engine import LLMEngine

    # chat opted out of isolation by default (slo: null): no SLO probe at start, which the plan's numbers do not
    # depend on
    data = _small_config(kv_share=None, kv_cache_bytes="48MiB", slo=None)
    data["pools"][1].pop("kv_share")
    data["pools"][1]["kv_cache_bytes"] = "64MiB"
    config = parse_config(data, env={})
    plan = plan_capacity(config, {"builtin:smollm2-135m-instruct": ModelConfig.from_folder(builtin_path)})
    engine = LLMEngine(engine_configs(config, plan)["default"], progress=False)
    assert engine.num_blocks == sum(p.num_blocks for p in plan.pools.values())
    for p in plan.pools.values():
        scheduler = engine.schedulers[p.name]
        assert scheduler.block_manager.num_blocks == p.num_blocks == (p.kv_cache_bytes // (46_080 * 16))
        assert (scheduler.config.max_num_seqs, scheduler.max_model_len) == (p.max_num_seqs, p.max_model_len)


def test_engine_configs_refuse_a_cuda_device_on_a_machine_without_one(monkeypatch):
    """`serve` fails at start-up (exit 2) instead of answering 503 forever; planning it stays possible."""
    data = _example_data()
    data["devices"]["h100x8"].update(tensor_parallel_size=1, memory="400GiB")
    config, plan = _plan_example(data)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SpecError, match=r"^devices\.h100x8\.device: 'cuda' needs a CUDA device"):
        engine_configs(config, plan)


def test_plan_single_pool_is_the_yaml_planner(builtin_path):
    """`generate` and the benchmarks plan one pool with the same formula as a YAML pool."""
    plan, engine = plan_single_pool(str(builtin_path), device="cpu", dtype="float32", kv_cache_bytes=64 << 20,
                                    max_model_len=1024, block_size=8)
    pool = plan.pools["default"]
    assert pool.num_blocks == (64 << 20) // (46_080 * 8) and pool.max_num_seqs == (64 << 20) // (46_080 * 1024)
    assert [(p.name, p.num_blocks, p.scheduler.max_num_seqs) for p in engine.pools] == [
        ("default", pool.num_blocks, pool.max_num_seqs)]
    assert (engine.device, engine.dtype, engine.cache.block_size) == ("cpu", "float32", 8)
    with pytest.raises(SpecError, match=r"kv_cache_bytes: .* one request of max_model_len 8192 needs 512"):
        plan_single_pool(str(builtin_path), device="cpu", kv_cache_bytes=64 << 20)
    with pytest.raises(SpecError, match=r"block_size: must be one of 8, 16, 32, got 12"):
        plan_single_pool(str(builtin_path), device="cpu", kv_cache_bytes=64 << 20, block_size=12)


def test_sparse_attention_sets_aside_the_graphs_of_both_regimes():
    """DeepSeek V3.2's sparse attention picks its path on the host each step, so its decode graphs are captured for
    its dense regime (sequences of up to `index_topk` tokens, `engine.models.deepseek_v32`), as for V3's latent
    attention with cache rows wider by the indexer's key, and where a pool serves longer ones, for its sparse regime:
    those hold the indexer's float32 score of every position of the longest sequence served, and its top-k, for each
    of the largest batch's tokens (doubled, as the rest of the graphs' activations). (DeepSeek V4's, never captured,
    sets nothing aside: test_the_example_files_plan.) MiniMax M3's graphs hold each KV head's score of every block;
    Qwen4-Exp's QSA, whose sparse regime runs eagerly, holds nothing more."""
    from engine.cuda_graphs import MAX_GRAPH_BATCH
    from engine.minimax_m3_config import BlockIndexer
    from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
    from engine.qwen4_exp_config import QsaIndexer

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 1000, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
             "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
             "moe_intermediate_size": 64, "first_k_dense_replace": 1, "max_position_embeddings": 8192}
    reserves = {}
    for longest in (1024, 8192):
        data = _small_config(max_model_len=longest)
        data["devices"]["default"] = {"device": "cuda", "memory": "8GiB"}
        for arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
            model = ModelConfig.from_hf_config({"architectures": [arch], **shape})
            plan = plan_capacity(parse_config(data, env={}), {"builtin:smollm2-135m-instruct": model})
            reserves[arch, longest] = plan.devices["default"].graph_bytes_per_device
    assert reserves["DeepseekV32ForCausalLM", 1024] > reserves["DeepseekV3ForCausalLM", 1024] > 0
    assert reserves["DeepseekV3ForCausalLM", 8192] == reserves["DeepseekV3ForCausalLM", 1024]
    sparse = 2 * MAX_GRAPH_BATCH * (4 * 8192 + 2048 * (4 + 8 + 1 + 1))   # scores; top-k values, positions, masks
    assert reserves["DeepseekV32ForCausalLM", 8192] - reserves["DeepseekV32ForCausalLM", 1024] == sparse
    assert DeepseekV32ForCausalLM.graph_max_len.fget(SimpleNamespace(config=model)) == model.mla.index_topk == 2048
    blocks = dict(layers=(1,), num_heads=2, head_dim=16, block_size=64, topk_blocks=16, local_blocks=1)
    assert BlockIndexer(**blocks).graph_scores_bytes(1024, 2) == 0   # 16 blocks of 64: the dense regime
    assert BlockIndexer(**blocks).graph_scores_bytes(8192, 2) == 2 * (4 * 128 + 16 * (4 + 8 + 1 + 1))
    assert QsaIndexer(**blocks).graph_scores_bytes(8192, 2) == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_each_gpu_sets_aside_its_decode_graphs_memory_unless_enforce_eager(tp):
    """Each rank captures its own shard's graphs: with two, a GPU sets aside the activations of half the
    heads, KV heads and MLP rows."""
    from engine.cuda_graphs import MAX_GRAPH_BATCH, graph_memory_bytes

    model = _llama70b(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=1000)
    plans = {}
    for eager in (False, True):
        data = _small_config()
        data["devices"]["default"] = {"device": "cuda", "memory": "8GiB", "enforce_eager": eager,
                                      "tensor_parallel_size": tp}
        config = parse_config(data, env={})
        plans[eager] = plan_capacity(config, {"builtin:smollm2-135m-instruct": model}).devices["default"]
    reserve = graph_memory_bytes(1024, 1024 // tp, 256 // tp, 2816 // tp, 16 // tp, 64, MAX_GRAPH_BATCH, 2)
    assert plans[False].graph_bytes_per_device == reserve and plans[True].graph_bytes_per_device == 0
    assert plans[True].kv_space_bytes_per_device - plans[False].kv_space_bytes_per_device == reserve
    assert plans[False].kv_space_bytes_per_device == \
        int(0.9 * 8 * GiB) - ShardShape.of(model, 0, tp).num_params(model) * 2 - 1024 * 64 * 2 - reserve   # 1,024: rope
    data["devices"]["default"]["enforce_eager"] = "yes"
    with pytest.raises(SpecError, match="enforce_eager"):
        parse_config(data, env={})


def test_async_scheduling_reaches_the_engine_with_or_without_tensor_parallelism(builtin_path):
    for setting in (True, False, None):
        data = _small_config()
        if setting is not None:
            data["devices"]["default"]["async_scheduling"] = setting
        config = parse_config(data, env={})
        plan = plan_capacity(config, {"builtin:smollm2-135m-instruct": ModelConfig.from_folder(builtin_path)})
        assert engine_configs(config, plan)["default"].async_scheduling is setting
    data["devices"]["default"].update(async_scheduling=True, device="cuda", memory="80GiB", tensor_parallel_size=2)
    parse_config(data, env={})
    data["devices"]["default"]["async_scheduling"] = "on"
    with pytest.raises(SpecError, match="async_scheduling"):
        parse_config(data, env={})


def test_an_fp8_kv_cache_gives_each_pool_about_twice_the_blocks(builtin_path):
    """kv_cache_dtype: fp8 stores one byte an element: S_KV halves against bfloat16 (a quarter of float32's
    on a CPU), so each pool gets twice the blocks (four times) from the same bytes."""
    model = {"builtin:smollm2-135m-instruct": ModelConfig.from_folder(builtin_path)}
    for device, factor in (({"device": "cuda", "memory": "8GiB"}, 2), ({"device": "cpu", "memory": "2GiB",
                                                                         "dtype": "float32"}, 4)):
        plans = {}
        for kv in ("auto", "fp8"):
            data = _small_config()
            data["devices"]["default"] = {**device, "kv_cache_dtype": kv}
            config = parse_config(data, env={})
            plans[kv] = plan_capacity(config, model)
        auto, fp8 = plans["auto"], plans["fp8"]
        assert fp8.devices["default"].kv_bytes_per_token * factor == auto.devices["default"].kv_bytes_per_token
        assert fp8.devices["default"].kv_cache_dtype == "float8_e4m3fn"
        for name in ("chat", "rag"):
            assert fp8.pools[name].num_blocks >= 1.9 * auto.pools[name].num_blocks
    assert engine_configs(config, fp8)["default"].kv_cache_dtype == "fp8"   # the CPU device's: the engine gets it
    data["devices"]["default"]["kv_cache_dtype"] = "int4"
    with pytest.raises(SpecError, match="kv_cache_dtype"):
        parse_config(data, env={})


def test_the_examples_measure_their_gpus_where_they_are_served():
    """A GPU's size as sold is more than torch measures (an H100 80GB: ~79.6 GiB): an example pinning `memory`
    to it plans blocks the engine refuses at start on that very GPU. They leave it auto (--vram plans elsewhere)."""
    for path in sorted((REPO / "config" / "examples").glob("*.yaml")):
        devices = yaml.safe_load(path.read_text())["devices"]
        assert [name for name, d in devices.items() if d.get("device") == "cuda" and "memory" in d] == [], path.name


@pytest.mark.parametrize("name,vram,dense_bytes,kv", [
    ("qwen3-32b-2xh100-fp8.yaml", 80 * GiB, 65_524_246_528, "float8_e4m3fn"),
    ("qwen3-30b-a3b-h200.yaml", 141 * GiB, 61_064_245_248, "bfloat16"),
    ("gpt-oss-20b-h100.yaml", 80 * GiB, 13_761_264_768, "bfloat16"),
    ("gpt-oss-120b-h100.yaml", 80 * GiB, 65_248_815_744, "float8_e4m3fn"),
    ("deepseek-v2-lite-h100.yaml", 80 * GiB, 31_419_784_192, "bfloat16"),
    ("glm-4.5-air-2xh200-fp8.yaml", 141 * GiB, 213_751_699_968, "float8_e4m3fn"),
    ("llama-4-scout-2xh200-fp8.yaml", 141 * GiB, 215_539_722_240, "float8_e4m3fn"),
    ("qwen3-next-80b-2xh200.yaml", 141 * GiB, 159_348_782_592, "bfloat16"),
    ("mistral-small-4-2xh200-fp8.yaml", 141 * GiB, 237_945_653_248, "float8_e4m3fn"),
    ("qwen3-32b-fp8-h100.yaml", 80 * GiB, 34_326_243_328, "float8_e4m3fn"),
    ("deepseek-v3.2-8xh200.yaml", 141 * GiB, 681_924_704_256, "bfloat16"),
    ("kimi-k2-thinking-8xh200.yaml", 141 * GiB, 594_535_653_376, "bfloat16"),
    ("qwen3-32b-w4a16-l40s.yaml", 48 * GiB, 19_203_401_728, "float8_e4m3fn"),
    ("qwen3-32b-awq-l40s.yaml", 48 * GiB, 19_447_195_648, "float8_e4m3fn"),   # + a zero point a group: 243,793,920 B
    ("qwen2.5-72b-gptq-int8-2xh100.yaml", 80 * GiB, 76_552_421_376, "float16"),
    ("mimo-v2-flash-8xh200.yaml", 141 * GiB, 617_656_151_936, "float8_e4m3fn"),
    ("jamba-1.5-mini-h200.yaml", 141 * GiB, 103_140_646_656, "bfloat16"),
    ("mamba-codestral-7b-h100.yaml", 80 * GiB, 14_570_807_296, "bfloat16"),
    ("longcat-flash-chat-8xh200-fp8.yaml", 141 * GiB, 565_433_583_616, "float8_e4m3fn"),
    ("deepseek-v4-flash-8xh200.yaml", 141 * GiB, 568_732_969_436, "bfloat16"),
    ("minimax-text-01-8xh200-fp8.yaml", 141 * GiB, 476_433_723_392, "float8_e4m3fn"),
    ("dory-1.0-4b-h100.yaml", 80 * GiB, 7_950_458_880, "bfloat16"),
    ("zaya1-8b-h100.yaml", 80 * GiB, 17_680_978_928, "bfloat16"),
    ("kimi-linear-48b-h200.yaml", 141 * GiB, 98_297_018_432, "bfloat16"),
])
def test_the_example_files_plan(name, vram, dense_bytes, kv):
    """The example files plan from the config.json beside them: Qwen3-32B's weights (YaRN to 131,072
    positions) with an FP8 cache, Qwen3-30B-A3B's every expert, gpt-oss-20b's and gpt-oss-120b's MXFP4 experts as
    stored, DeepSeek-V2-Lite's (its routers in float32) with its latent cache: 31,104 B a token, GLM-4.5-Air's on two
    H200s (its routers in float32 too) with an FP8 cache, Llama 4 Scout's text model on two H200s (a multimodal
    config.json; its rotary table the rag pool's 131,072 positions, not 10,485,760), and Qwen3-Next on two H200s (its
    12 attention layers' K/V alone, and each sequence's state of its 36 linear layers beside them: S_state), and
    Mistral Small 4 on two H200s with an FP8 cache (its latent cache whole on each GPU: 36 layers x 320 B a token),
    and the FP8 releases of Qwen3-32B on one H100 and DeepSeek V3.2 on eight H200s, held in FP8, and Kimi K2
    Thinking's INT4 experts held as stored on eight H200s, and Qwen3-32B's INT4 projections on one 48 GB card (and
    AWQ's, a zero point a group beside them), and Qwen2.5-72B's GPTQ INT8 on two H100s (70,464,307,200 projection
    weights a byte each, a float16 scale a 128 of them, the rest in float16), and
    MiMo-V2-Flash on eight H200s with an FP8 cache (its two attention shapes, each GPU one KV head a layer), and Jamba
    1.5 Mini on one H200 (its 4 attention layers' K/V alone, each sequence's state of its 28 Mamba-1 layers beside),
    and Mamba-Codestral-7B on one H100 (no K/V at all: its pools' sequences by their 64 Mamba-2 layers' states), and
    LongCat-Flash-Chat on eight H200s, its experts and projections quantized to FP8 as read, with an FP8 cache (56
    sublayers' latent rows whole on each GPU), and DeepSeek-V4-Flash on eight H200s in bfloat16 (a row a token a
    layer, each its kind's width, whole on each GPU; no decode graphs set aside), and MiniMax-Text-01 on eight H200s,
    its projections quantized to FP8 as read (its lightning layers' in bfloat16), with an FP8 cache (its 10 attention
    layers' K/V alone, each sequence's state of its 70 lightning layers beside them), and Dory 1.0 4B on one H100 (its
    36 layers' weights once, the K/V of the 56 its loops run), and ZAYA1-8B on one H100 (every layer's K/V, and each
    sequence's CCA state beside it), and Kimi Linear 48B-A3B on one H200 (transformers' parameter count of
    KimiLinearConfig's defaults, 49,133,074,464, with the 26 routers' expert biases it keeps as buffers; its routers
    and KDA dt_bias in float32; its 6 latent layers' rows alone, each sequence's state of its 21 KDA layers beside)."""
    data = yaml.safe_load((REPO / "config" / "examples" / name).read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    plan = plan_capacity(config, resolve_model_configs(config), vram_bytes=vram)
    (device,) = plan.devices.values()
    assert device.weights_bytes == dense_bytes and device.kv_cache_dtype == kv
    if name.startswith("deepseek-v2"):
        assert device.kv_bytes_per_token == 27 * 576 * 2
    if name.startswith("qwen2.5-72b"):   # every rank holds its share of every decoder projection
        assert (device.int4_projections, device.int_bits) == (4 * 80, 8)
    if name.startswith("deepseek-v3.2"):   # the latent, its rotated key and the indexer's key: 704 a layer
        assert device.kv_bytes_per_token == 61 * 704 * 2 and device.fp8_weights
    if name.startswith("mimo"):   # the full layers' 4 KV heads, the sliding layers' 8, each V padded to 192
        assert device.kv_bytes_per_token == (9 * 4 + 39 * 8) * 192 * 2 * 1
        assert device.kv_bytes_per_token_per_device == 48 * 1 * 192 * 2 * 1
    if name.startswith("mistral-small-4"):
        assert device.kv_bytes_per_token == 36 * 320 * 1
    if name.startswith("qwen3-next"):   # per GPU: 36 layers' 8 key heads' conv inputs, 16 value heads' 128 x 128
        assert device.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {36 * (4096 * 3 * 2 + 16 * 128 * 128 * 4)}
    if name.startswith("jamba"):   # a float32 state of 16 for each of 8,192 channels, 3 conv inputs
        assert device.kv_bytes_per_token == 4 * 8 * 128 * 2 * 2
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {28 * (8192 * 3 * 2 + 8192 * 16 * 4)}
    if name.startswith("kimi-linear"):   # 512 latent + 64 rope a latent layer; 32 heads of 128 x 128, 3 x 4,096 conv
        assert device.kv_bytes_per_token == 6 * 576 * 2
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {21 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)}
    if name.startswith("zaya"):   # 40 layers' 2 KV heads of 128; their q/k convolutions' 2 inputs, a delayed value
        assert device.kv_bytes_per_token == 40 * 2 * 128 * 2 * 2
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {40 * ((8 + 2) * 128 * 2 * 2 + 128 * 4)}
    if name.startswith("dory"):   # 8 + 2 x 20 + 8 virtual layers' 4 KV heads of 256
        assert device.kv_bytes_per_token == 56 * 4 * 256 * 2 * 2
    if name.startswith("minimax"):   # a GPU's 1 KV head of 128 in 10 layers; 8 lightning heads' 128 x 128 float32s
        assert device.kv_bytes_per_token_per_device == 10 * 2 * 128 * 1 and device.fp8_weights
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {70 * 8 * 128 * 128 * 4}
    if name.startswith("longcat"):   # 56 sublayers' latent and rotated key, a byte each, whole on every GPU
        assert device.kv_bytes_per_token == device.kv_bytes_per_token_per_device == 56 * 576 * 1 and device.fp8_weights
    if name.startswith("deepseek-v4"):   # 23 HCA rows of 4 x 512, 20 CSA rows of 6 x 512 + 5 x 128, whole on each GPU
        width = 2 * 4 * 512 + 21 * 4 * 512 + 20 * (6 * 512 + 5 * 128)
        assert device.kv_bytes_per_token == device.kv_bytes_per_token_per_device == width * 2
        assert device.graph_bytes_per_device == 0   # its decode steps are not captured
    if name.startswith("mamba-codestral"):   # 128 heads' 64 x 128 float32 states, 3 inputs of 10,240 channels
        state = 64 * (10240 * 3 * 2 + 128 * 64 * 128 * 4)
        assert device.kv_bytes_per_token == 0
        assert {p.state_bytes_per_seq for p in plan.pools.values()} == {state}
        assert [p.max_num_seqs for p in plan.pools.values()] == [
            p.kv_cache_bytes_per_device // (2 * state) for p in plan.pools.values()] == [45, 68]
    assert all(p.max_num_seqs >= 1 for p in plan.pools.values())
    if kv == "float8_e4m3fn":   # the same file with a bfloat16 cache: twice the bytes a token, half the blocks
        data["devices"][next(iter(data["devices"]))]["kv_cache_dtype"] = "auto"   # (where no state takes its share)
        bf16 = plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                             resolve_model_configs(config), vram_bytes=vram)
        assert next(iter(bf16.devices.values())).kv_bytes_per_token == 2 * device.kv_bytes_per_token
        if not any(p.state_bytes_per_seq for p in plan.pools.values()):
            assert all(p.num_blocks >= 1.9 * bf16.pools[n].num_blocks for n, p in plan.pools.items())


def test_mxfp4_experts_held_as_stored_put_gpt_oss_120b_on_one_h100():
    """gpt-oss-120b on one H100 (`quantization: auto`, a CUDA device): its 36 layers' 128 experts of 3 x 2,880 x 2,880
    weights held at half a byte plus a byte a 32 (MXFP4 as stored), the rest in bfloat16: the bfloat16 bytes less
    exactly that. In bfloat16 (`none`) the weights do not fit (refused naming the device's memory); `mxfp4` under
    tensor parallelism 4 (720 inputs a rank, not whole groups of 32) and on a model without MXFP4 experts is refused
    naming the key."""
    data = yaml.safe_load((REPO / "config" / "examples" / "gpt-oss-120b-h100.yaml").read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    (model,) = resolve_model_configs(config).values()
    (device,) = plan_capacity(config, resolve_model_configs(config), vram_bytes=80 * GiB).devices.values()
    experts = 36 * 128 * 3 * 2880 * 2880
    bf16 = ShardShape.of(model).num_params(model) * 2
    assert device.packed_experts == "MXFP4" and not device.fp8_weights
    assert device.weights_bytes == bf16 - experts * 2 + experts // 2 + experts // 32
    assert 60 * GiB < device.weights_bytes < 61 * GiB < 217 * GiB < bf16 < 218 * GiB
    for key, value, match in (("quantization", "none", r"devices.h100.memory: .* 217.61 GiB per GPU in bfloat16 .*; "
                                                       r"quantization: auto holds the checkpoint's quantized weights "
                                                       r"as stored, 60.77 GiB per GPU"),
                              ("tensor_parallel_size", 4, r"devices.h100.quantization: mxfp4 under tensor parallelism "
                                                          r"4 cuts each expert's 2880 inputs into shares of 720")):
        changed = {**data["devices"]["h100"], key: value} | ({"quantization": "mxfp4"} if key != "quantization" else {})
        with pytest.raises(SpecError, match=match):
            plan_capacity(parse_config({**data, "devices": {"h100": changed}}, env={},
                                       base_dir=REPO / "config" / "examples"), resolve_model_configs(config),
                          vram_bytes=80 * GiB)
    data = yaml.safe_load((REPO / "config" / "examples" / "qwen3-32b-fp8-h100.yaml").read_text())
    data["devices"]["h100"]["quantization"] = "mxfp4"
    with pytest.raises(SpecError, match=r"devices.h100.quantization: mxfp4 holds a checkpoint's MXFP4 experts"):
        config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
        plan_capacity(config, resolve_model_configs(config), vram_bytes=80 * GiB)


def test_int4_experts_held_as_stored_put_kimi_k2_thinking_on_one_node():
    """Kimi K2 Thinking on eight H200s (TP 8, `quantization: auto` on CUDA): its 60 sparse layers' 384 experts of
    3 x 2,048 x 7,168 weights held at half a byte plus a bfloat16 scale a 32 (INT4 as stored), the rest in bfloat16:
    the bfloat16 bytes less exactly that, about what the checkpoint takes on disk (594 GB); in bfloat16 (`none`) the
    weights do not fit (refused naming the device's memory)."""
    data = yaml.safe_load((REPO / "config" / "examples" / "kimi-k2-thinking-8xh200.yaml").read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    (model,) = resolve_model_configs(config).values()
    (device,) = plan_capacity(config, resolve_model_configs(config), vram_bytes=141 * GiB).devices.values()
    experts = 60 * 384 * 3 * 2048 * 7168
    bf16 = ShardShape.of(model).num_params(model) * 2 + model.num_float32_params * 2
    assert model.int4_group == 32 and device.packed_experts == "INT4" and not device.fp8_weights
    assert device.weights_bytes == bf16 - experts * 2 + experts // 2 + experts // 32 * 2
    assert 594e9 < device.weights_bytes < 595e9 and device.weights_bytes_per_device < 72 * GiB
    data["devices"]["h200x8"]["quantization"] = "none"
    with pytest.raises(SpecError, match=r"devices.h200x8.memory: .* 241.06 GiB per GPU in bfloat16 .* as stored, "
                                        r"71.26 GiB per GPU"):
        plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                      resolve_model_configs(config), vram_bytes=141 * GiB)


def test_int4_projections_held_as_stored_put_qwen3_32b_on_one_48_gb_card():
    """Qwen3-32B in W4A16 on a 48 GB GPU (`quantization: auto` on CUDA): its 64 layers' four projections held at half
    a byte a weight plus a bfloat16 scale a 128 inputs (INT4 as stored), the embedding and the head in bfloat16: the
    bfloat16 bytes less exactly that. In bfloat16 (`none`) the weights do not fit (refused naming the device's
    memory); `int4` under tensor parallelism 16 (down_proj's 25,600 inputs in shares of 1,600, not whole groups of
    128) is refused naming the key."""
    data = yaml.safe_load((REPO / "config" / "examples" / "qwen3-32b-w4a16-l40s.yaml").read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    (model,) = resolve_model_configs(config).values()
    (device,) = plan_capacity(config, resolve_model_configs(config), vram_bytes=48 * GiB).devices.values()
    hidden, inter, d = model.hidden_size, model.intermediate_size, model.head_dim
    per_layer = hidden * (model.num_heads + 2 * model.num_kv_heads) * d + model.num_heads * d * hidden \
        + 3 * hidden * inter
    projections = model.num_layers * per_layer
    bf16 = ShardShape.of(model).num_params(model) * 2
    assert model.int4_group == 128 and device.int4_projections == 4 * 64 and not device.packed_experts
    assert device.weights_bytes == bf16 - projections * 2 + projections // 2 + projections // 128 * 2
    for key, value, match in (("quantization", "none", r"devices.l40s.memory: .* 61.02 GiB per GPU in bfloat16 .*; "
                                                       r"quantization: auto holds the checkpoint's quantized weights "
                                                       r"as stored, 17.88 GiB per GPU"),
                              ("tensor_parallel_size", 16, r"devices.l40s.quantization: int4 cannot hold "
                                                           r"layers.0.mlp.down_proj as stored under tensor parallelism "
                                                           r"16: a rank's 1600 inputs")):
        changed = {**data["devices"]["l40s"], key: value} | ({"quantization": "int4"} if key != "quantization" else {})
        with pytest.raises(SpecError, match=match):
            plan_capacity(parse_config({**data, "devices": {"l40s": changed}}, env={},
                                       base_dir=REPO / "config" / "examples"), resolve_model_configs(config),
                          vram_bytes=48 * GiB)


def test_an_fp8_checkpoint_held_in_fp8_gives_one_h100_room_for_its_pools():
    """Qwen3-32B-FP8 on one H100 (`quantization: auto`, a CUDA device): each layer's four projections held at one
    byte a weight plus a float32 scale a 128 x 128 block, the rest (embedding, head, norms) in bfloat16: Qwen3-32B's
    bfloat16 bytes less exactly that, as the rank's model built on the meta device counts it; `none` holds the
    dequantized weights, which leave the rag pool too little room for one request (refused naming its share)."""
    data = yaml.safe_load((REPO / "config" / "examples" / "qwen3-32b-fp8-h100.yaml").read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    (model,) = resolve_model_configs(config).values()
    (device,) = plan_capacity(config, resolve_model_configs(config), vram_bytes=80 * GiB).devices.values()
    d, hidden, inter = model.head_dim, model.hidden_size, model.intermediate_size
    shapes = [((model.num_heads + 2 * model.num_kv_heads) * d, hidden), (hidden, model.num_heads * d),
              (2 * inter, hidden), (hidden, inter)]
    saved = model.num_layers * sum(n * k - -(-n // 128) * -(-k // 128) * 4 for n, k in shapes)
    assert device.fp8_weights and device.weights_bytes == 65_524_246_528 - saved
    data["devices"]["h100"]["quantization"] = "none"
    with pytest.raises(SpecError, match=r"pools\[1\].kv_share"):
        plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                      resolve_model_configs(config), vram_bytes=80 * GiB)
    data["devices"]["h100"]["quantization"] = "int8"
    with pytest.raises(SpecError, match=r"^devices.h100.quantization: int8 holds a checkpoint's INT8 experts as "
                                        r"stored; this checkpoint has none"):
        plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                      resolve_model_configs(config), vram_bytes=80 * GiB)
    data["devices"]["h100"]["quantization"] = "nf4"
    with pytest.raises(SpecError, match="quantization"):
        parse_config(data, env={}, base_dir=REPO / "config" / "examples")


def test_deepseek_v32_fits_one_node_of_h200s_only_with_its_fp8_weights_held_in_fp8():
    """DeepSeek V3.2's FP8 release on eight H200s: held in FP8 (`quantization: auto`) 82.7 GiB a GPU leave room for
    both pools; dequantized (`none`) its 159.8 GiB a GPU are refused, naming the device and the weights."""
    data = yaml.safe_load((REPO / "config" / "examples" / "deepseek-v3.2-8xh200.yaml").read_text())
    config = parse_config(data, env={}, base_dir=REPO / "config" / "examples")
    (device,) = plan_capacity(config, resolve_model_configs(config), vram_bytes=141 * GiB).devices.values()
    assert device.fp8_weights and device.weights_bytes_per_device < 83 * GiB < device.usable_bytes
    data["devices"]["h200x8"]["quantization"] = "none"
    with pytest.raises(SpecError, match="devices.h200x8.*cannot hold the weights.*; quantization: auto holds the "
                                        "checkpoint's quantized weights as stored, 82.67 GiB per GPU"):
        plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                      resolve_model_configs(config), vram_bytes=141 * GiB)
    data["devices"]["h200x8"]["quantization"] = "auto"   # what does not fit as stored either: no such hint
    with pytest.raises(SpecError, match=r"cannot hold the weights of .*: 82.67 GiB per GPU in bfloat16, its "
                                        r"projections in FP8 \(TP=8\) and 1.64 GiB for decode graphs "
                                        r"\(enforce_eager: true frees it\), leaving .* for KV$") as refused:
        plan_capacity(parse_config(data, env={}, base_dir=REPO / "config" / "examples"),
                      resolve_model_configs(config), vram_bytes=60 * GiB)
    assert "quantization: auto holds" not in str(refused.value)


def test_a_tied_model_plans_from_its_config_json_alone(tmp_path):
    """A published config.json of a tied model (Qwen3-4B's, Llama-3.2's, Gemma 3's) in a folder of no weights
    plans: no head of its own to count (it was 'no weights in model folder'), one table fewer than untied."""
    data = yaml.safe_load((REPO / "config" / "examples" / "qwen3-32b-2xh100-fp8.yaml").read_text())
    hf = json.loads((REPO / "config" / "examples" / "qwen3-32b" / "config.json").read_text())
    planned = {}
    for tied in (True, False):
        (folder := tmp_path / f"tied-{tied}").mkdir()
        (folder / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": tied}))
        for pool in data["pools"]:
            pool["model"] = str(folder)
        config = parse_config(data, env={}, base_dir=tmp_path)
        (model,) = resolve_model_configs(config).values()
        assert model.tie_word_embeddings is tied
        (planned[tied],) = plan_capacity(config, {str(folder): model}, vram_bytes=80 * GiB).devices.values()
    assert planned[False].weights_bytes - planned[True].weights_bytes == hf["vocab_size"] * hf["hidden_size"] * 2
    # its JSON files alone, the index too (a download of *.json): it refused, naming a shard not downloaded; a head
    # the index lists is counted (its shards are not there to tell it from the embedding), one it does not is not
    folder = tmp_path / "tied-True"
    for pool in data["pools"]:
        pool["model"] = str(folder)
    for head in (False, True):
        names = ["model.embed_tokens.weight", "model.norm.weight", *(["lm_head.weight"] if head else [])]
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {name: f"model-0000{k + 1}-of-00003.safetensors" for k, name in enumerate(names)}}))
        config = parse_config(data, env={}, base_dir=tmp_path)
        (model,) = resolve_model_configs(config).values()
        (plan,) = plan_capacity(config, {str(folder): model}, vram_bytes=80 * GiB).devices.values()
        assert plan.weights_bytes == planned[not head].weights_bytes, head   # a head of its own: as untied


def test_the_collective_timeout_reaches_the_engine_and_must_be_positive(builtin_path):
    model = {"builtin:smollm2-135m-instruct": ModelConfig.from_folder(builtin_path)}
    data = _small_config()
    config = parse_config(data, env={})
    assert engine_configs(config, plan_capacity(config, model))["default"].collective_timeout_seconds == 120
    data["devices"]["default"]["collective_timeout_seconds"] = 30
    config = parse_config(data, env={})
    assert engine_configs(config, plan_capacity(config, model))["default"].collective_timeout_seconds == 30
    for bad in (0, -5, "soon", 1e-9, 0.5):   # under a second: every healthy step of a loaded host would fail
        data["devices"]["default"]["collective_timeout_seconds"] = bad
        with pytest.raises(SpecError, match="collective_timeout_seconds"):
            parse_config(data, env={})


def test_calculate_kv_scales_reaches_the_engine(builtin_path):
    for setting in (True, False, None):
        data = _small_config()
        data["devices"]["default"]["kv_cache_dtype"] = "fp8"
        if setting is not None:
            data["devices"]["default"]["calculate_kv_scales"] = setting
        config = parse_config(data, env={})
        plan = plan_capacity(config, {"builtin:smollm2-135m-instruct": ModelConfig.from_folder(builtin_path)})
        assert engine_configs(config, plan)["default"].calculate_kv_scales is (setting is not False)
    data["devices"]["default"]["calculate_kv_scales"] = "yes"
    with pytest.raises(SpecError, match="calculate_kv_scales"):
        parse_config(data, env={})


def test_an_avg_len_over_max_model_len_is_said_and_a_zero_formula_names_avg_len():
    """No request is longer than max_model_len, so an avg_len above it plans fewer requests than fit:
    a warning naming the key; an avg_len so large that the formula gives 0 is refused naming avg_len."""
    data = _example_data()
    data["pools"][0]["avg_len"] = 10000   # max_model_len 8192
    _, plan = _plan_example(data)
    assert any(w.startswith("pools[0].avg_len: 10000 is above max_model_len 8192") for w in plan.warnings)
    data["pools"][0]["avg_len"] = 10**9
    with pytest.raises(SpecError, match=r"gives max_num_seqs = floor\(.*\) = 0 .*lower pools\[0\]\.avg_len"):
        _plan_example(data)
    # one request of 8,200 tokens by the formula, but it holds 513 blocks of 16 and the pool has 512: none
    data = _example_data()
    s_kv = _plan_example(data)[1].devices[data["pools"][0]["device"]].kv_bytes_per_token_per_device
    data["pools"][0].update(avg_len=8200, max_model_len=8192, kv_cache_bytes=s_kv * 8200)
    data["pools"][0].pop("kv_share", None)
    with pytest.raises(SpecError, match=r"in whole blocks\) = 0 for pool"):
        _plan_example(data)


def test_an_avg_len_below_the_block_size_plans_no_more_sequences_than_blocks():
    """Each running request holds whole blocks: with avg_len below block_size the formula would run more
    requests than the pool has blocks (the override is refused past them); the plan caps it there, and says so."""
    data = _example_data()
    data["pools"][0]["avg_len"] = 4   # block_size 16
    _, plan = _plan_example(data)
    pool = plan.pools[data["pools"][0]["name"]]
    assert pool.formula_max_num_seqs >= 4 * pool.num_blocks and pool.max_num_seqs == pool.num_blocks
    assert any(w.startswith("pools[0].avg_len: 4 tokens hold 1 whole blocks of 16") for w in plan.warnings), \
        plan.warnings
    # past one block as well: 24 tokens hold two (32 slots), so a third fewer requests fit than 24 tokens each
    data["pools"][0]["avg_len"] = 24
    _, plan = _plan_example(data)
    pool = plan.pools[data["pools"][0]["name"]]
    assert pool.max_num_seqs == pool.num_blocks // 2 < pool.formula_max_num_seqs and not pool.max_num_seqs_overridden
    assert any(w.startswith("pools[0].avg_len: 24 tokens hold 2 whole blocks of 16: max_num_seqs is the pool's")
               for w in plan.warnings), plan.warnings


def test_a_step_budget_below_max_num_seqs_is_said():
    """A step holds one token of each sequence it runs at most: a pool whose max_num_batched_tokens is below its
    max_num_seqs steps no more sequences than that at once (vLLM refuses the pair): a warning naming the key."""
    data = _example_data()
    data["pools"][0]["max_num_batched_tokens"] = 8
    _, plan = _plan_example(data)
    seqs = plan.pools[data["pools"][0]["name"]].max_num_seqs
    assert seqs > 8 and any(w.startswith(f"pools[0].max_num_batched_tokens: 8 is below max_num_seqs {seqs}")
                            for w in plan.warnings), plan.warnings
    assert not any("max_num_batched_tokens" in w for w in _plan_example()[1].warnings)


def test_a_swap_space_below_one_block_is_refused_by_the_plan():
    """Caught when the plan knows S_KV (before a worker loads the weights), naming the YAML key."""
    data = _example_data()
    data["pools"][0].update(preemption_mode="swap", swap_space="1KiB")
    with pytest.raises(SpecError, match=r"^pools\[0\]\.swap_space: 1\.00 KiB holds no KV block of"):
        _plan_example(data)
    data["pools"][0]["swap_space"] = "1GiB"
    _plan_example(data)


def test_an_auto_device_may_not_land_on_a_gpu_another_device_names(monkeypatch):
    """`device: auto` resolves to CUDA GPU 0 at start; a second device on `cuda` (GPU 0) would plan 0.9 of the
    same GPU: refused once `auto` is resolved, naming both devices."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    data = _example_data()
    device = data["devices"].pop("h100x8")
    data["devices"] = {"a": {**device, "device": "auto", "tensor_parallel_size": 1, "memory": "400GiB"},
                       "b": {**device, "device": "cuda", "tensor_parallel_size": 1, "memory": "400GiB"}}
    data["pools"][0]["device"], data["pools"][1]["device"] = "a", "b"
    with pytest.raises(SpecError, match=r"^devices\.a\.device: 'auto' runs on GPU 0, which device 'b' runs on too"):
        engine_configs(*_plan_example(data))
    data["devices"]["b"]["device"] = "cuda:1"
    assert {e.gpu_ids for e in engine_configs(*_plan_example(data)).values()} == {(0,), (1,)}


def test_an_auto_device_on_ray_planned_as_cpu_is_said():
    """`device: auto` resolves on the gateway's machine: on one without a GPU a Ray device's replicas would
    ask the cluster for no GPU. The plan says so naming the key; cpu, cuda and a --vram plan say nothing."""
    data = _small_config()
    data["devices"]["default"] |= {"device": "auto", "placement": "ray", "ray_address": "127.0.0.1:6379",
                                   "memory": "80GiB"}
    config = parse_config(data, env={})
    models = resolve_model_configs(config)
    plan = plan_capacity(config, models)
    said = [w for w in plan.warnings if w.startswith("devices.default.device: auto on a Ray device")]
    assert len(said) == (plan.devices["default"].device_type == "cpu")
    assert not any("Ray device" in w for w in plan_capacity(config, models, vram_bytes=8 * GiB).warnings)
    data["devices"]["default"]["device"] = "cpu"
    config = parse_config(data, env={})
    assert not any("Ray device" in w for w in plan_capacity(config, models).warnings)


def test_cpu_threads_of_an_auto_device_planned_on_a_gpu_is_said_to_be_unused():
    """`device: cuda` with cpu_threads is refused by the file's own check; `auto` resolves only at the plan."""
    data = _small_config()
    data["devices"]["default"] |= {"device": "auto", "cpu_threads": 2}
    config = parse_config(data, env={})
    models = resolve_model_configs(config)
    said = [w for w in plan_capacity(config, models, vram_bytes=8 * GiB).warnings
            if w.startswith("devices.default.cpu_threads: 2 is ignored")]
    assert len(said) == 1, said
    on_this_machine = plan_capacity(config, models)
    assert any("cpu_threads" in w for w in on_this_machine.warnings) == (
        on_this_machine.devices["default"].device_type == "cuda")


def test_the_shares_of_a_huge_device_are_taken_in_integers_and_fit_it():
    """0.4 and 0.6 of `memory: 9223372036854775807` in floats rounded past the device's KV bytes, and the plan
    blamed `pools[0].kv_cache_bytes`, which nobody set. Shares are exact now: together they fit."""
    data = _small_config()
    data["devices"]["default"]["memory"] = 2**63 - 1
    config = parse_config(data, env={})
    plan = plan_capacity(config, resolve_model_configs(config))
    kv_dev = plan.devices["default"].kv_space_bytes_per_device
    chat, rag = plan.pools["chat"].kv_cache_bytes_per_device, plan.pools["rag"].kv_cache_bytes_per_device
    assert chat + rag <= kv_dev and kv_dev - (chat + rag) <= 2
    assert abs(chat - 0.4 * kv_dev) < kv_dev * 1e-12


def test_an_explicit_budget_past_the_device_is_named_where_it_is_set():
    """Beside a share, the pool that set `kv_cache_bytes` is named, with the bytes it asked for."""
    data = _small_config()
    data["pools"][1].pop("kv_share")
    data["pools"][1]["kv_cache_bytes"] = "1800MiB"
    config = parse_config(data, env={})
    with pytest.raises(SpecError, match=r"^pools\[1\]\.kv_cache_bytes: 1\.76 GiB; the pools of device 'default'"):
        plan_capacity(config, resolve_model_configs(config))


def test_swap_spaces_past_this_machines_memory_are_said_by_the_plan_and_refused_at_start(monkeypatch):
    """`swap_space: 8EiB` passed `capacity`, then the worker built a swap block list of 10^13 blocks and died of
    memory. Each rank of each replica of a local device holds its swapping pools' swap_space: past this
    machine's memory the plan warns and the start-up check refuses it, naming the key."""
    data = _small_config(preemption_mode="swap", swap_space="3GiB")
    data["devices"]["default"]["replicas"] = 2
    config = parse_config(data, env={})
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 4 * GiB)
    plan = plan_capacity(config, resolve_model_configs(config))
    said = (r"^pools\[0\]\.swap_space: 3\.00 GiB for each of the 2 ranks of device 'default' .* to 6\.00 GiB, "
            r"past its 4\.00 GiB of memory")
    assert any(re.match(said, w) and "`cliffguard serve` refuses it" in w for w in plan.warnings), plan.warnings
    with pytest.raises(SpecError, match=said + ".*lower swap_space"):
        engine_configs(config, plan)
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 16 * GiB)   # swap, weights and KV
    plan = plan_capacity(config, resolve_model_configs(config))
    assert not any("swap_space" in w for w in plan.warnings)
    assert engine_configs(config, plan)["default"].pools[0].scheduler.swap_space_bytes == 3 * GiB
    data["devices"]["default"] |= {"placement": "ray", "ray_address": "127.0.0.1:6379"}   # on the cluster's nodes
    config = parse_config(data, env={})
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 4 * GiB)
    assert not any("swap_space" in w for w in plan_capacity(config, resolve_model_configs(config)).warnings)


def test_cpu_devices_past_this_machines_memory_are_said_by_the_plan_and_refused_at_start(monkeypatch):
    """A CPU device's ranks hold their weights and KV caches in this machine's memory, beside the swap spaces:
    4 replicas of 2 GiB started on a 4 GiB machine (the KV tensor fills lazily) and ran out of memory under
    load. The plan warns and the start-up check refuses, naming the device's memory; a Ray device's replicas
    run on the cluster's nodes."""
    data = _small_config()
    data["devices"]["default"]["replicas"] = 4
    config = parse_config(data, env={})
    models = resolve_model_configs(config)
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 4 * GiB)
    plan = plan_capacity(config, models)
    each = plan.devices["default"].weights_bytes_per_device + sum(
        plan.pools[p].kv_cache_bytes_per_device for p in ("chat", "rag"))
    assert 1.7 * GiB < each <= 0.9 * 2 * GiB
    said = (rf"^devices\.default\.memory: the CPU devices of this machine hold {4 * each / GiB:.2f} GiB of weights and "
            rf"KV cache \(default 4 x {each / GiB:.2f} GiB: replicas x tensor_parallel_size ranks\), past its 4\.00 "
            rf"GiB of memory; .* lower memory \(or replicas\)")
    assert any(re.match(said, w) and "`cliffguard serve` refuses it" in w for w in plan.warnings), plan.warnings
    with pytest.raises(SpecError, match=said + "$"):
        engine_configs(config, plan)
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 8 * GiB)
    plan = plan_capacity(config, models)
    assert not any("memory" in w for w in plan.warnings) and len(replica_engine_configs(config, plan)["default"]) == 4
    data["devices"]["default"] |= {"placement": "ray", "ray_address": "127.0.0.1:6379"}
    monkeypatch.setattr("pools.capacity_plan.host_memory_bytes", lambda: 1 * GiB)
    config = parse_config(data, env={})
    assert not any("memory" in w for w in plan_capacity(config, models).warnings)


def test_a_ray_device_on_cuda_is_planned_on_the_clusters_gpu_size_never_this_machines():
    """Its replicas run on the cluster's GPUs: without `memory` (or --vram) the plan refuses naming the key,
    whatever GPU the gateway's own machine has (or lacks)."""
    data = _small_config()
    data["devices"]["default"] |= {"device": "cuda", "placement": "ray", "ray_address": "127.0.0.1:6379"}
    del data["devices"]["default"]["memory"]
    config = parse_config(data, env={})
    models = resolve_model_configs(config)
    with pytest.raises(SpecError, match=r"^devices\.default\.memory: a Ray device on CUDA needs the size of one"):
        plan_capacity(config, models, cuda_memory=lambda _: 80 * GiB)
    assert plan_capacity(config, models, vram_bytes=24 * GiB).devices["default"].memory_bytes == 24 * GiB
    data["devices"]["default"]["memory"] = "24GiB"
    plan = plan_capacity(parse_config(data, env={}), models)
    assert (plan.devices["default"].memory_bytes, plan.devices["default"].memory_source) == (24 * GiB, "config")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_an_eager_plan_fits_what_the_engine_finds_loaded(monkeypatch, arch):
    """Without decode graphs nothing is set aside past the weights: the plan must subtract all the engine
    holds once loaded (`torch.cuda.memory_allocated`: the parameters and the rotary caches, Gemma 3's two), or
    `check_fits_device` refuses the plan at every start. The CUDA queries are stood in for by the model as
    `build_model` allocates it."""
    from types import SimpleNamespace

    import torch

    from engine.kv_cache import check_fits_device
    from engine.models import build_model

    model = ModelConfig.from_hf_config({
        "architectures": [arch], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 2048, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8})
    net = build_model(model.serving([1024]), torch.bfloat16, "cpu")   # as an engine of the pools' 1,024 positions
    loaded = sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))
    data = _small_config()
    data["devices"]["default"] = {"device": "cuda", "memory": "64MiB", "enforce_eager": True}
    plan = plan_capacity(parse_config(data, env={}), {"builtin:smollm2-135m-instruct": model})
    device = plan.devices["default"]
    assert device.graph_bytes_per_device == 0
    assert device.kv_space_bytes_per_device == int(0.9 * (64 << 20)) - loaded
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=64 << 20))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: loaded)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: loaded)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: ((64 << 20) - loaded, 64 << 20))
    block_bytes = device.kv_bytes_per_token_per_device * device.block_size
    check_fits_device(torch.device("cuda:0"), sum(p.num_blocks for p in plan.pools.values()), block_bytes, 0.9)


def test_a_model_of_state_layers_alone_plans_its_sequences_by_their_state():
    """FalconMamba 7B's shape (64 Mamba-1 layers of 8,192 channels, a state of 16 each; no attention) on an 80 GiB
    GPU: S_KV is 0, each sequence holds its state and a prefix-cache snapshot of it (64 x (8,192 x 3 x 2 + 8,192 x
    16 x 4) B each), max_num_seqs is a pool's budget over them, and each sequence gets the blocks of max_model_len
    (they hold no bytes). A budget below one sequence's state is refused naming it."""
    model = ModelConfig.from_hf_config({"architectures": ["FalconMambaForCausalLM"], "hidden_size": 4096,
                                        "num_hidden_layers": 64, "vocab_size": 65024, "time_step_rank": 256,
                                        "tie_word_embeddings": False})
    assert model.kv_layers == () and model.context_length == 131_072
    chat = {"name": "chat", "model": "falcon-mamba", "route": {"max_prompt_tokens": 4096}, "kv_share": 0.3,
            "avg_len": 2048, "max_model_len": 8192}
    rag = {"name": "rag", "model": "falcon-mamba", "route": {"min_prompt_tokens": 4097}, "kv_share": 0.7,
           "avg_len": 32768}
    data = {"devices": {"default": {"device": "cuda", "dtype": "bfloat16"}}, "pools": [chat, rag]}
    plan = plan_capacity(parse_config(data, env={}), {"falcon-mamba": model}, vram_bytes=80 * GiB)
    device = plan.devices["default"]
    state = 64 * (8192 * 3 * 2 + 8192 * 16 * 4)
    assert device.kv_bytes_per_token == 0 and device.weights_bytes == model.num_params() * 2
    for pool in plan.pools.values():
        assert pool.state_bytes_per_seq == pool.snapshot_bytes_per_seq == state
        assert pool.max_num_seqs == pool.kv_cache_bytes_per_device // (2 * state) > 0
        assert pool.num_blocks == pool.max_num_seqs * -(-pool.max_model_len // 16)
    assert plan.pools["rag"].max_model_len == 131_072
    data["pools"][0]["kv_share"], data["pools"][1]["kv_share"] = 0.0001, 0.9999
    with pytest.raises(SpecError, match=r"^pools\[0\].kv_share: 0.0001 gives pool 'chat' .* less than one sequence's "
                                        r"state \(\d[\d,]* B\): raise the budget$"):
        plan_capacity(parse_config(data, env={}), {"falcon-mamba": model}, vram_bytes=80 * GiB)
