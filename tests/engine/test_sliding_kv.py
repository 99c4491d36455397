"""Window-bounded K/V (`engine.sliding_kv`): sliding layers keep a ring of their window a sequence, and greedy output
is still transformers' own, token for token, on prompts and outputs that wrap each ring several times."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from engine.sliding_kv import PoolLimits, paged_bytes_per_token, plan_ring, ring_layers
from tests.conftest import assert_all_free, make_tiny_model
from tests.engine.test_engine_vs_hf import TINY_MODELS, _hf_greedy

BLOCK, STEP = 8, 16   # a window of 8 and steps of 16 tokens: rings of ceil((16 + 8 - 1) / 8) + 1 = 4 blocks


def _case(arch: str, index: int = 0) -> dict:
    return [overrides for name, overrides in TINY_MODELS if name == arch][index]


def _window_engine(folder, **scheduler) -> LLMEngine:
    pool = PoolConfig(num_blocks=96, scheduler=SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=STEP, enable_prefix_caching=False, **scheduler))
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=BLOCK),
                                  pools=(pool,), sliding_kv="window"), progress=False)


# Gemma 3 (the module path, each layer type its rope), Qwen2 (the Llama layer: the CPU's flat loop), GPT-OSS (sinks,
# experts), Gemma 4 (full layers of their own shape, the last layers reading earlier layers' K/V), MiMo-V2-Flash (the
# sliding layers' own KV heads, in a ring tensor of their shape), Command R7B (sliding layers beside NoPE full ones),
# StarCoder2 and Phi-3 (every layer slides: the paged blocks hold no layer at all)
WINDOWED = [("gemma3", 0), ("qwen2", 2), ("gpt_oss", 0), ("gemma4", 1), ("mimo_v2_flash", 0), ("cohere2", 0),
            ("starcoder2", 0), ("phi3", 1)]


@pytest.mark.parametrize("arch,index", WINDOWED, ids=[f"{a}-{i}" for a, i in WINDOWED])
def test_window_bounded_sliding_layers_match_transformers(tmp_path, builtin_path, arch, index):
    import transformers

    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **_case(arch, index))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = _window_engine(folder)
    ring, model = engine.kv_cache.ring, engine.model_config
    assert ring is not None and ring.tokens(0) == 4 * BLOCK and ring.window == 8 and ring.rows == (3,)
    assert 0 < len(ring.layers) <= model.num_kv_layers
    full = [i for i in range(model.num_kv_layers) if i not in ring.layers]
    # the paged blocks hold the full layers alone; each ring layer's K/V lies in its rows' ring blocks
    assert sum(t.shape[0] for t in engine.kv_cache.tensors) == len(full)
    assert engine.kv_bytes_per_token == model.kv_planes * 4 * sum(
        h * d for h, d in (model.layer_kv_shape(model.kv_layers[i]) for i in full))
    assert all(t.shape[2] == 4 * 3 for t in engine.kv_cache.ring_tensors)   # a ring for each of 3 rows
    gen = torch.Generator().manual_seed(3)
    # five prompts over three rows: rows are taken again, their rings holding an earlier sequence's K/V
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 40, 17, 100, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 24, eos_ids=None)
    assert_all_free(engine)


def test_each_pool_keeps_rings_of_its_own_step_in_rows_of_its_own(tmp_path, builtin_path):
    """A chat pool of 8-token steps beside a RAG pool of 32: rings of 3 and 6 blocks, each pool's sequences in the
    rows of its range, and both pools' answers transformers' while they run side by side."""
    import transformers

    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", builtin_path, **_case("gemma3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pools = tuple(PoolConfig(name=name, num_blocks=48, scheduler=SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=step, enable_prefix_caching=False))
        for name, seqs, step in (("chat", 2, 8), ("rag", 3, 32)))
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=BLOCK),
                                    pools=pools, sliding_kv="window"), progress=False)
    ring = engine.kv_cache.ring
    assert (ring.pools, ring.blocks, ring.rows) == (("chat", "rag"), (3, 6), (2, 3))   # ceil((8 + 7) / 8) + 1
    assert ring.row_layout() == ([0, 3, 6, 12, 18], [3, 3, 6, 6, 6])
    assert all(t.shape[2] == 2 * 3 + 3 * 6 for t in engine.kv_cache.ring_tensors)
    gen = torch.Generator().manual_seed(5)
    requests = [(f"r{i}", pool, torch.randint(3, 512, (n,), generator=gen).tolist())
                for i, (pool, n) in enumerate([("chat", 12), ("rag", 90), ("chat", 30), ("rag", 45), ("chat", 5),
                                               ("rag", 70), ("chat", 21)])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for request_id, pool, prompt in requests:
        engine.add_request(request_id, prompt, params, pool=pool)
    outputs, rows = {}, {"chat": set(), "rag": set()}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
        batch = engine.runner.input_batch
        for request_id, pool, _ in requests:
            state = engine.requests.get(request_id)
            row = batch._row_of.get(state.seqs[0].seq_id) if state is not None else None
            if row is not None:
                rows[pool].add(row)
    assert rows["chat"] <= {0, 1} and rows["rag"] <= {2, 3, 4} and len(rows["rag"]) == 3
    for request_id, _, prompt in requests:
        assert outputs[request_id].outputs[0].token_ids == _hf_greedy(hf, prompt, 20, eos_ids=None), request_id
    assert_all_free(engine)


def test_a_ring_shorter_than_a_step_and_its_window_changes_the_answer(tmp_path, builtin_path, monkeypatch):
    """The ring's size is what correctness needs, not slack: a ring of 2 blocks (16 positions) under steps of 16
    tokens lets a prefill chunk overwrite positions its own queries still read, and greedy output leaves
    transformers'."""
    import transformers

    import engine.sliding_kv as sliding_kv

    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", builtin_path, **_case("gemma3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    planned = sliding_kv.plan_ring
    monkeypatch.setattr(sliding_kv, "plan_ring", lambda *a, **k: dataclasses.replace(planned(*a, **k), blocks=(2,)))
    engine = _window_engine(folder)
    assert engine.kv_cache.ring.blocks == (2,)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 100, 33)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert any(out.outputs[0].token_ids != _hf_greedy(hf, prompt, 24, eos_ids=None)
               for prompt, out in zip(prompts, outs))


def _limits(**overrides) -> PoolLimits:
    values = dict(name="rag", key="pools[1]", max_step_tokens=2048, max_model_len=32768,
                  enable_prefix_caching=False, uses_swap=False)
    return PoolLimits(**{**values, **overrides})


@pytest.fixture(scope="module")
def gemma3_config(tmp_path_factory, builtin_path) -> ModelConfig:
    folder = make_tiny_model(tmp_path_factory.mktemp("g3"), "gemma3", builtin_path,
                             **{**_case("gemma3"), "sliding_window": 1024})
    return ModelConfig.from_folder(folder)


def test_the_ring_holds_a_step_and_the_window_before_it(gemma3_config):
    ring = plan_ring(gemma3_config, "auto", 16, [_limits(max_step_tokens=512), _limits()])
    assert ring.layers == ring_layers(gemma3_config) == (0, 2)   # the sliding ones of sliding, full, sliding
    assert ring.window == 1024 and ring.blocks == (-(-(512 + 1023) // 16) + 1, -(-(2048 + 1023) // 16) + 1) == (97, 193)
    assert ring.pools == ("rag", "rag") and ring.rows == ()
    assert plan_ring(gemma3_config, "full", 16, [_limits()]) is None


def test_auto_keeps_every_position_where_a_pool_swaps_the_ring_bounds_nothing_or_outgrows_avg_len(gemma3_config):
    assert plan_ring(gemma3_config, "auto", 16, [_limits(enable_prefix_caching=True), _limits()]) is not None
    # a ring of 3,088 positions (and 1,024 of snapshot where prefixes are cached) against the pool's avg_len
    assert plan_ring(gemma3_config, "auto", 16, [_limits(avg_len=3088)]) is not None
    assert plan_ring(gemma3_config, "auto", 16, [_limits(avg_len=3087)]) is None
    assert plan_ring(gemma3_config, "auto", 16, [_limits(avg_len=4111, enable_prefix_caching=True)]) is None
    assert plan_ring(gemma3_config, "auto", 16, [_limits(avg_len=4112, enable_prefix_caching=True)]) is not None
    assert plan_ring(gemma3_config, "window", 16, [_limits(avg_len=100)]) is not None
    assert plan_ring(gemma3_config, "auto", 16, [_limits(uses_swap=True), _limits()]) is None
    assert plan_ring(gemma3_config, "auto", 16, [_limits(max_model_len=3072)]) is None   # 3,088 ring positions
    # a ring is at most the pool's longest sequence
    assert plan_ring(gemma3_config, "window", 16, [_limits(max_model_len=3072)]).tokens(0) == 3072


def test_window_is_refused_naming_the_pool_key_that_rules_it_out(gemma3_config):
    with pytest.raises(ConfigError, match=r"^pools\[1\]\.preemption_mode: pool 'rag' may swap.*sliding_kv: window "
                                          "needs it"):
        plan_ring(gemma3_config, "window", 16, [_limits(uses_swap=True)])
    with pytest.raises(ConfigError, match=r"^sliding_kv: must be one of auto, window, full, got 'ring'"):
        plan_ring(gemma3_config, "ring", 16, [_limits()])


def test_window_is_refused_for_a_model_without_sliding_layers_and_takes_every_layer_of_one_whose_layers_all_slide(
        tmp_path, builtin_path):
    llama = ModelConfig.from_folder(make_tiny_model(tmp_path / "llama", "llama", builtin_path))
    with pytest.raises(ConfigError, match=r"^sliding_kv: LlamaForCausalLM has no sliding-window layer"):
        plan_ring(llama, "window", 16, [_limits()])
    assert plan_ring(llama, "auto", 16, [_limits()]) is None
    mistral = ModelConfig.from_folder(make_tiny_model(tmp_path / "mistral", "mistral", builtin_path,
                                                      sliding_window=64))
    ring = plan_ring(mistral, "window", 16, [_limits()])
    assert ring.layers == tuple(range(mistral.num_kv_layers)) and ring.tokens(0) == 2048 + 64 + 16
    assert plan_ring(mistral, "auto", 16, [_limits()]) == ring
    assert paged_bytes_per_token(mistral, torch.float32, 1, ring) == 0


def test_an_engine_config_refuses_an_unknown_setting():
    with pytest.raises(ConfigError, match=r"^sliding_kv: must be one of auto, window, full, got 'on'"):
        EngineConfig(sliding_kv="on")


@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_keep_their_heads_rings_and_generate_what_one_rank_does(tmp_path, builtin_path):
    """MiMo-V2-Flash's sliding layers (two KV heads: one a rank) keep rings on each rank, of that rank's heads;
    the full layers' one KV head is on both. Greedy output over two ranks is one rank's with every position kept."""
    case = _case("mimo_v2_flash")
    folder = make_tiny_model(tmp_path / "mimo", "mimo_v2_flash", builtin_path, **case)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (70, 9, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(tp: int, sliding_kv: str) -> list[list[int]]:
        pool = PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=STEP,
                                                                   enable_prefix_caching=False))
        engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp,
                                        cpu_threads=1, cache=CacheConfig(block_size=BLOCK), pools=(pool,),
                                        sliding_kv=sliding_kv),
                           progress=False)
        try:
            assert (engine.kv_cache.ring is not None) == (sliding_kv == "window")
            if tp == 2:   # this rank's one sliding KV head of two
                assert {t.shape[-2] for t in engine.kv_cache.ring_tensors} == {1}
            outs = engine.generate(prompts, params)
            assert_all_free(engine)
            return [o.outputs[0].token_ids for o in outs]
        finally:
            engine.close()

    assert run(2, "window") == run(1, "full")


def _plan_example(name: str, devices: dict | None = None, **pools):
    """The example file `name` (config/examples) planned on 80 GiB GPUs, each device's keys updated by
    `devices[device]`, each pool's by `pools[name]`."""
    import yaml

    from pools.capacity_plan import plan_capacity
    from pools.config.yaml_file import parse_config
    from pools.model_configs import resolve_model_configs

    examples = Path(__file__).resolve().parents[2] / "config" / "examples"
    data = yaml.safe_load((examples / name).read_text())
    for device, keys in (devices or {}).items():
        data["devices"][device].update(keys)
    for pool in data["pools"]:
        pool.update(pools.get(pool["name"], {}))
    config = parse_config(data, env={}, base_dir=examples)
    return plan_capacity(config, resolve_model_configs(config), vram_bytes=80 << 30)


def _plan_gpt_oss(device: dict | None = None, **pools):
    """gpt-oss-20b on one H100 (config/examples), its device's keys updated by `device`, each pool's by
    `pools[name]`."""
    return _plan_example("gpt-oss-20b-h100.yaml", {"h100": device or {}}, **pools)


def test_the_plan_counts_the_full_layers_in_s_kv_and_each_pools_ring_and_window_snapshot_as_its_state():
    """gpt-oss-20b's 12 sliding layers of 24 (a window of 128) leave S_KV; a chat pool's ring holds its step of 2,048
    and the window (2,192 positions), a RAG pool's its step of 8,192 (8,336), or the 512 of a
    long_prefill_token_threshold (656); each is S_state, beside a prefix-cache snapshot of the window's 8 blocks (128
    positions) a sequence where the pool caches prefixes. `auto` takes rings only where no pool would run fewer
    sequences with them: not as the file is (chat's ring and snapshot outgrow its avg_len of 2,048: a warning says
    so), but with chat's threshold at 512, and then both pools run more sequences than with every position kept."""
    as_is, full = _plan_gpt_oss(), _plan_gpt_oss({"sliding_kv": "full"})
    assert as_is.devices["h100"].sliding_window == 0 and not any("sliding_kv" in w for w in full.warnings)
    assert any("pool 'chat' would run fewer sequences with rings: its ring of 2,192 positions" in w
               and "outgrows its avg_len 2,048" in w for w in as_is.warnings)
    rings = _plan_gpt_oss({"sliding_kv": "window"})
    position = 12 * 8 * 64 * 2 * 2   # 12 layers' 8 KV heads of 64, K and V, bfloat16
    (device,) = rings.devices.values()
    assert device.kv_bytes_per_token == position == full.devices[device.name].kv_bytes_per_token // 2
    assert device.sliding_window == 128
    chat, rag = rings.pools["chat"], rings.pools["rag"]
    assert (chat.sliding_ring_tokens, rag.sliding_ring_tokens) == (2192, 8336)
    assert (chat.state_bytes_per_seq, rag.state_bytes_per_seq) == (2192 * position, 8336 * position)
    assert chat.snapshot_bytes_per_seq == 128 * position
    assert rag.max_num_seqs == rag.formula_max_num_seqs == rag.kv_cache_bytes_per_device // (
        position * 16384 + (8336 + 128) * position) > full.pools["rag"].max_num_seqs
    assert chat.max_num_seqs < full.pools["chat"].max_num_seqs   # what auto declined
    off = {"enable_prefix_caching": False}   # no snapshot a sequence
    assert _plan_gpt_oss({"sliding_kv": "window"}, rag=off).pools["rag"].max_num_seqs == \
        rag.kv_cache_bytes_per_device // (position * 16384 + 8336 * position)
    short = _plan_gpt_oss(chat={"long_prefill_token_threshold": 512})   # auto: rings now
    assert short.devices["h100"].sliding_window == 128 and not any("sliding_kv" in w for w in short.warnings)
    assert short.pools["chat"].sliding_ring_tokens == 656
    assert all(short.pools[n].max_num_seqs > full.pools[n].max_num_seqs for n in ("chat", "rag"))
    swaps = _plan_gpt_oss(chat={"long_prefill_token_threshold": 512},
                          rag={"preemption_mode": "swap", "swap_space": "1GiB"})
    assert swaps.devices["h100"].sliding_window == 0
    assert any("sliding_kv: auto keeps every position" in w and "pool 'rag' may swap" in w for w in swaps.warnings)


def test_the_plan_refuses_window_naming_the_key_that_rules_it_out():
    from pools.config.spec import SpecError

    with pytest.raises(SpecError, match=r"^pools\[1\]\.preemption_mode: pool 'rag' may swap"):
        _plan_gpt_oss({"sliding_kv": "window"}, rag={"preemption_mode": "swap", "swap_space": "1GiB"})
    with pytest.raises(SpecError, match=r"^devices\.h100\.sliding_kv: must be one of auto, full, window, got 'ring'"):
        _plan_gpt_oss({"sliding_kv": "ring"})


def test_an_engine_of_named_pools_starts_with_rings_its_made_up_sequences_in_a_pools_rows(tmp_path, builtin_path):
    """Pools named chat (interactive, its SLO derived from a measured decode step) and rag, an FP8 cache whose scales
    are measured at start: the warm-up, the SLO probe and the scale measurement each run made-up sequences, which take
    rows of the pool that lends them blocks (a ring is its pool's; they took a pool named 'default' and failed), the
    measurement on one step its rings hold. Then both pools serve."""
    from engine.config import LatencySLO

    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", builtin_path, **_case("gemma3"))
    pools = (PoolConfig(name="chat", num_blocks=40, slo=LatencySLO(ttft_ms=60_000, itl_ms=10_000), derive_slo=True,
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                  enable_prefix_caching=False)),
             PoolConfig(name="rag", num_blocks=80, scheduler=SchedulerConfig(
                 max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)))
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=BLOCK),
                                    pools=pools, sliding_kv="window", kv_cache_dtype="fp8"), progress=False)
    assert engine.kv_cache.ring.pools == ("chat", "rag") and engine.composer.needs_cost_model
    assert "chat" in engine.derived_slos   # the probe's step ran in chat's rows
    assert all(layer.self_attn.k_scale != 1.0 for layer in engine.model.layers)   # measured, in rag's rows
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", list(range(5, 45)), params, pool="chat")
    engine.add_request("b", list(range(7, 107)), params, pool="rag")
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert [len(done[r].outputs[0].token_ids) for r in "ab"] == [6, 6]
    assert_all_free(engine)


def test_a_requests_samples_each_keep_a_ring_and_draw_what_they_draw_with_every_position_kept(tmp_path, builtin_path):
    """n = 3 seeded samples of a 50-token prompt: with rings each sample is a sequence of its own (a row and a ring
    each, its prompt computed for it: no shared blocks carry the sliding layers), and draws exactly the tokens it
    draws where every position is kept and the samples share the prompt's blocks."""
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", builtin_path, **_case("gemma3"))
    prompt = torch.randint(3, 512, (50,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=20, ignore_eos=True)
    answers = {}
    for layout in ("window", "full"):
        pool = PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=STEP,
                                                                   enable_prefix_caching=False))
        engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=BLOCK),
                                        pools=(pool,), sliding_kv=layout), progress=False)
        answers[layout] = [o.token_ids for o in engine.generate([prompt], params)[0].outputs]
        assert_all_free(engine)
    assert len(set(map(tuple, answers["window"]))) == 3 and answers["window"] == answers["full"]


def test_the_mistral_example_keeps_rings_of_every_layer_on_its_rag_gpu_alone():
    """Mistral 7B v0.1 on two H100s (config/examples): the rag device's 32 layers, each a window of 4,096, keep rings
    of 6,160 positions (2,048-token chunks and the window) and S_KV is 0, so its 58 GiB hold 46 sequences of avg_len
    16,384 with their prefix-cache snapshots (29 with every position kept; 77 without snapshots), each free to grow
    to max_model_len; chat's device keeps every position."""
    from pools.plan_report import format_plan

    def plan(device: dict | None = None, **rag):
        return _plan_example("mistral-7b-v0.1-2xh100.yaml", {"rag": device or {}}, rag=rag)

    rings = plan()
    assert (rings.devices["rag"].kv_bytes_per_token, rings.devices["rag"].sliding_window) == (0, 4096)
    assert "S_KV          0 B/token (0 B, bfloat16), no layer's (every one slides, a window of 4,096" \
        in format_plan(rings)
    assert rings.devices["chat"].sliding_window == 0 and rings.warnings == ()
    rag = rings.pools["rag"]
    position = 32 * 8 * 128 * 2 * 2   # every layer's 8 KV heads of 128, K and V, bfloat16
    assert (rag.sliding_ring_tokens, rag.state_bytes_per_seq, rag.snapshot_bytes_per_seq) == (
        6160, 6160 * position, 4096 * position)
    assert rag.max_num_seqs == rag.kv_cache_bytes_per_device // ((6160 + 4096) * position) == 46
    assert rag.num_blocks == 46 * 32768 // 16
    assert plan(enable_prefix_caching=False).pools["rag"].max_num_seqs == 77
    full = plan({"sliding_kv": "full"}).pools["rag"]
    assert full.max_num_seqs == full.kv_cache_bytes_per_device // (16384 * position) == 29


def test_a_model_whose_every_layer_slides_plans_its_rings_alone_and_the_engine_serves_them(tmp_path, builtin_path):
    """Mistral 7B v0.1's kind, every layer a window of 8: with rings S_KV is 0 and a sequence holds its ring (its step
    of 16 and the window: 4 blocks of 8) and the prefix cache's snapshot of the window (1 block) whatever its length,
    so max_num_seqs is the pool's bytes over those 40 positions, and its blocks are only places in tables (max_num_seqs
    sequences of max_model_len). `auto` takes the rings where the 40 positions are below avg_len (3x the sequences of
    every position kept at avg_len 128), not at avg_len 32 (a warning says why); the engine built from the plan
    answers as transformers; a budget below one ring, or more sequences than its rings, is refused by key."""
    import transformers

    from pools.capacity_plan import plan_single_pool
    from pools.config.spec import SpecError

    folder = make_tiny_model(tmp_path / "mistral", "mistral", builtin_path, sliding_window=8)
    model = ModelConfig.from_folder(folder)
    position = model.kv_bytes_per_token(torch.float32)

    def plan(sliding_kv="auto", avg_len=128, kv=1 << 20, **pool):
        return plan_single_pool(str(folder), device="cpu", dtype="float32", kv_cache_bytes=kv, sliding_kv=sliding_kv,
                                avg_len=avg_len, max_model_len=512, max_num_batched_tokens=16, block_size=8, **pool)

    (rings, config), (full, _) = plan(), plan("full")
    pool = rings.pools["default"]
    assert config.sliding_kv == "window" and pool.kv_bytes_per_token == 0 and pool.sliding_ring_tokens == 32
    assert (pool.state_bytes_per_seq, pool.snapshot_bytes_per_seq) == (32 * position, 8 * position)
    assert pool.max_num_seqs == pool.formula_max_num_seqs == (1 << 20) // (40 * position)
    assert pool.num_blocks == pool.max_num_seqs * 512 // 8
    assert pool.max_num_seqs >= 3 * full.pools["default"].max_num_seqs
    short, _ = plan(avg_len=32)
    assert short.devices["default"].sliding_window == 0 and any(
        "would run fewer sequences with rings: its ring of 32 positions" in w for w in short.warnings)

    engine = LLMEngine(config, progress=False)
    assert engine.kv_cache.tensors == [] and engine.kv_bytes_per_token == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (70, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    assert_all_free(engine)

    with pytest.raises(SpecError, match=r"^pools\[0\]\.kv_cache_bytes: .* less than one sequence's ring of every"):
        plan("window", kv=30 * position)
    most = rf"at most {pool.max_num_seqs}$"
    with pytest.raises(SpecError, match=rf"^pools\[0\]\.max_num_seqs: 100 sequences hold .* \(pools\[0\].*: {most}"):
        plan("window", max_num_seqs=100)


@pytest.mark.parametrize("arch,index", [("gemma3", 0), ("qwen2", 2), ("mimo_v2_flash", 0), ("starcoder2", 0)])
def test_a_cached_prefix_resumes_with_its_rings_window_kept(tmp_path, builtin_path, arch, index):
    """Prefix caching with rings: a prompt's chunks keep the window before each chunk's last block boundary (a
    snapshot of the ring's blocks, `engine.state_cache`'s slots), so the same prompt again, and its first 85 tokens
    before another's, resume from the cached blocks and the kept window (once other prompts have written over every
    row's ring): transformers' answers, snapshots loaded. The two resume in one step at 96 and at 80, positions
    two ring blocks apart: a window loaded at the other piece's position lands in the wrong blocks of the ring."""
    import transformers

    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **_case(arch, index))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pool = PoolConfig(num_blocks=96, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=STEP,
                                                               state_snapshots=24))   # every chunk's kept
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=BLOCK),
                                    pools=(pool,), sliding_kv="window"), progress=False)
    assert engine.kv_cache.ring is not None and engine.kv_cache.ring_snapshots
    gen = torch.Generator().manual_seed(9)
    first, other, *scribble = (torch.randint(3, 512, (n,), generator=gen).tolist() for n in (100, 17, 60, 61, 62))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # between the two rounds three other prompts write every row's ring over
    for prompts in ([first], scribble, [first, first[:85] + other]):
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    scheduler = engine.schedulers["default"]
    assert scheduler.state_snapshots.num_loaded >= 2 and scheduler.block_manager.num_prefix_hits >= 64 + 64
    assert_all_free(engine)


def test_ring_moves_take_each_piece_its_own_first_position():
    """`engine.model_runner.ring_moves`: a step of two pieces (row 2 resumes at 96 for 4 tokens, row 0 at 80 for 12)
    loads each row's kept window at its own piece's first position, and saves row 0's at its first position plus
    the offset of the block boundary it keeps."""
    from engine.model_runner import ring_moves
    from engine.parallel import StepPlan

    plan = StepPlan(input_ids=[7] * 16, positions=[*range(96, 100), *range(80, 92)], rows=[2, 0], query_lens=[4, 12],
                    seq_lens=[100, 92], state_loads=[(5, 0), (6, 2)], state_saves=[(1, 8, 7)])
    assert ring_moves(plan) == ([(0, 80, 5), (2, 96, 6)], [(0, 88, 7)])


@pytest.mark.gpu
@pytest.mark.parametrize("arch,index", [("gemma3", 0), ("gpt_oss", 0), ("starcoder2", 0)])
def test_on_cuda_rings_answer_what_every_position_kept_answers(tmp_path, builtin_path, arch, index):
    """The real thing: the Triton kernels reading the rings through their tables, decode steps replaying CUDA graphs
    captured at start, prefix caching on; six prompts over three rows (each row's ring taken again) decode the same
    greedy tokens in rings as with every position kept (float32), StarCoder2's every layer in rings."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **_case(arch, index))
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 40, 17, 100, 9, 64)]
    results = {}
    for layout in ("full", "window"):
        pool = PoolConfig(num_blocks=96, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=STEP))
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32",
                                        cache=CacheConfig(block_size=BLOCK), pools=(pool,), sliding_kv=layout),
                           progress=False)
        assert (engine.kv_cache.ring is not None) == (layout == "window")
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        results[layout] = [o.outputs[0].token_ids for o in outs]
        assert_all_free(engine)
    assert results["window"] == results["full"]
