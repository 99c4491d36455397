"""Hybrid models whose linear-attention layers keep a state per sequence (Qwen3.5): that state through the engine's
life of a sequence. A preempted sequence recomputes it, n > 1 samples prefill apart, a cached prefix resumes only
from a state kept with it (prefix caching's snapshots); swap, and more ranks than linear-attention key heads, are
refused by key; the capacity plan counts each running sequence's state and snapshot slot. Greedy parity on tiny
models (Qwen3.5, Qwen3-Next, Granite 4-H, Nemotron-H) is in test_engine_vs_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.parallel import check_tensor_parallel
from engine.sampling import SamplingParams
from engine.step_commit import check_pools
from engine.messages import StatsReply
from engine.wire import decode, encode
from engine.worker import engine_stats
from gateway.monitoring.metrics import GatewayMetrics
from prometheus_client.parser import text_string_to_metric_families
from pools.capacity_plan import plan_capacity
from pools.config.spec import SpecError
from pools.config.yaml_file import parse_config
from tests.conftest import assert_all_free, make_tiny_model
from tests.engine.test_engine_vs_hf import QWEN3_5   # three Gated DeltaNet layers, then a full-attention one
from tests.engine.test_engine_vs_hf import _hf_greedy as hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    folder = make_tiny_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", builtin_path, **QWEN3_5)
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:   # all n tokens, as the engine's ignore_eos
    return hf_greedy(hf, prompt, n, eos_ids=None)


def _prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def _engine(folder, num_blocks: int = 64, **scheduler) -> LLMEngine:
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(max_num_batched_tokens=64, **scheduler))
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=8), pools=(pool,)),
                     progress=False)


def test_preempted_sequences_recompute_their_state(tiny):
    """A pool of 12 blocks (96 tokens) for six requests of 20-30 + 16 tokens: sequences are preempted and come back
    by recompute, their state rebuilt from position 0 in a row another sequence held meanwhile."""
    folder, hf = tiny
    engine = _engine(folder, num_blocks=12)
    prompts = _prompts(3, (20, 27, 22, 30, 25, 21))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert engine.schedulers["default"].stats.num_recompute_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16) for p in prompts]
    assert_all_free(engine)


def _greedy(engine, prompt: list[int], n: int = 10) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return engine.generate([prompt], params)[0].outputs[0].token_ids


def test_the_prefix_cache_resumes_sequences_from_the_states_it_kept(tiny):
    """Prefix caching with the states kept beside the blocks (`engine.state_cache`), pieces of 64 tokens, blocks of 8:
    every answer equals transformers' (which computes every prompt whole), and each cached prefix resumes where a
    snapshot was taken. A system prompt of 43 tokens: the first user's prompt keeps the state at its own end, the
    second finds 5 cached blocks without a snapshot at their end, gives them back and keeps the state there (the
    branch point), and the third resumes from it. A prompt served again resumes from its last block boundary, the
    conversation's next turn from the last turn's prompt; a 150-token document read in three pieces keeps a state at
    each piece's end, and a prompt sharing its first 100 tokens resumes from the first piece's."""
    folder, hf = tiny
    engine = _engine(folder)
    snapshots, bm = engine.schedulers["default"].state_snapshots, engine.schedulers["default"].block_manager
    assert snapshots.num_slots == 64 and engine.model.states.snap_ssm[0].shape[0] == 64

    def served(prompt: list[int], loaded: int, given_back: int, cached: int) -> list[int]:
        before, hits = (snapshots.num_loaded, snapshots.num_given_back), bm.num_prefix_hits
        out = _greedy(engine, prompt)
        assert out == _hf_greedy(hf, prompt, 10)
        assert (snapshots.num_loaded - before[0], snapshots.num_given_back - before[1]) == (loaded, given_back)
        assert bm.num_prefix_hits - hits == cached
        check_pools(engine.schedulers, engine.runner.input_batch.num_rows)
        return out

    system = _prompts(1, (43,))[0]
    first, second, third = _prompts(2, (13, 20, 9))
    served(system + first, loaded=0, given_back=0, cached=0)
    served(system + second, loaded=0, given_back=5, cached=0)
    served(system + third, loaded=1, given_back=0, cached=40)
    prompt = _prompts(5, (37,))[0]
    answer = served(prompt, loaded=0, given_back=0, cached=0)
    served(prompt, loaded=1, given_back=0, cached=32)
    served(prompt + answer + first, loaded=1, given_back=1, cached=32)   # block 5 (40..47) was never a snapshot
    document = _prompts(7, (150,))[0]
    served(document, loaded=0, given_back=0, cached=0)
    served(document[:100] + second, loaded=1, given_back=4, cached=64)
    assert_all_free(engine)
    # what /metrics exports: the worker's stats through the wire, the gateway's Prometheus text
    stats = decode(encode(StatsReply(engine_stats(engine)))).stats.pools["default"]
    assert (stats.num_state_loads, stats.num_state_saves) == (snapshots.num_loaded, snapshots.num_saved) == (4, 12)
    metrics = GatewayMetrics()
    metrics.update_pool("default", 0, stats, engine.kv_cache.bytes_per_block)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    loads = families["cliffguard_prefix_cache_state_loads"].samples
    assert [(s.labels, s.value) for s in loads if s.name.endswith("_total")] == [
        ({"pool": "default", "replica": "0"}, 4.0)]


def test_samples_wait_for_the_first_ones_prefill_and_resume_from_its_kept_state(tiny):
    """Three greedy samples of a 150-token prompt (never forked from a sibling's blocks): the first prefills it and
    keeps the state at its last resumable boundary (144); the other two wait while it reads the prompt, then resume
    from that state and compute 6 tokens each. All equal transformers' answer."""
    folder, hf = tiny
    engine = _engine(folder)
    prompt = _prompts(4, (150,))[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in out.outputs] == [_hf_greedy(hf, prompt, 4)] * 3
    scheduler = engine.schedulers["default"]
    assert scheduler.state_snapshots.num_loaded == 2 and scheduler.stats.num_prefix_waits >= 2
    assert scheduler.stats.num_computed_tokens == 150 + 2 * 6 + 3 * 3   # the prompt, two resumes, 3 decodes each
    assert_all_free(engine)


@pytest.mark.parametrize("off", [dict(enable_prefix_caching=False), dict(state_snapshots=0)],
                         ids=["no-prefix-caching", "no-snapshots"])
def test_without_prefix_caching_or_snapshots_nothing_is_kept(tiny, off):
    folder, hf = tiny
    engine = _engine(folder, **off)
    scheduler = engine.schedulers["default"]
    assert scheduler.state_snapshots is None and not scheduler.block_manager.enable_prefix_caching
    assert engine.model.states.snap_ssm[0].shape[0] == 0
    prompt = _prompts(4, (33,))[0]
    assert _greedy(engine, prompt) == _greedy(engine, prompt) == _hf_greedy(hf, prompt, 10)


def test_a_pool_keeps_its_state_snapshots_number_of_states(tiny):
    """`state_snapshots: 2`: two slots, the least recently used overwritten; answers stay transformers'."""
    folder, hf = tiny
    engine = _engine(folder, state_snapshots=2)
    snapshots = engine.schedulers["default"].state_snapshots
    assert snapshots.num_slots == 2 and engine.model.states.snap_conv[0].shape[0] == 2
    for prompt in _prompts(6, (20, 27, 22)) * 2:
        assert _greedy(engine, prompt) == _hf_greedy(hf, prompt, 10)
    assert snapshots.num_bound == 2 and snapshots.num_saved >= 3


def test_swap_and_ranks_past_the_key_heads_are_refused_by_key(tiny):
    folder, _ = tiny
    with pytest.raises(ConfigError, match=r"^pools\.default\.preemption_mode: 'swap' swaps K/V blocks.*recompute"):
        _engine(folder, preemption_mode="swap", swap_space_bytes=1 << 20)
    model = ModelConfig.from_folder(folder)
    check_tensor_parallel(model, 2)   # 2 key heads: one a rank (tests/engine/test_tensor_parallel.py)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 4 does not divide the model's 2 linear-attention"):
        check_tensor_parallel(model, 4)


def test_capacity_plan_counts_each_sequence_state(tiny):
    """S_KV counts the full-attention layer alone; each running sequence also holds its three linear layers' state
    (conv: 3 taps of q, k, v in float32; the recurrent matrices: 4 heads of 16 x 8, float32), set aside before the
    pool's blocks, twice with prefix caching (its snapshot slots); a swapping pool is refused before anything loads."""
    folder, _ = tiny
    model = ModelConfig.from_folder(folder)
    state = 3 * ((2 * 2 * 16 + 4 * 8) * 3 * 4 + 4 * 16 * 8 * 4)
    assert model.state_bytes_per_seq(torch.float32) == state
    assert model.state_bytes_per_seq(torch.float32, tensor_parallel_size=2) == state // 2   # a rank's key heads'
    assert model.kv_bytes_per_token(torch.float32) == 2 * 1 * 2 * 16 * 4
    pool = {"name": "chat", "model": "tiny", "kv_cache_bytes": "1MiB", "avg_len": 192, "max_model_len": 512}
    data = {"devices": {"default": {"device": "cpu", "memory": "2GiB", "dtype": "float32"}}, "pools": [pool]}
    plan = plan_capacity(parse_config(data, env={}), {"tiny": model}).pools["chat"]
    s_kv, budget = 256, 1 << 20   # with prefix caching (the default) a snapshot slot beside each sequence's state
    assert plan.max_num_seqs == budget // (s_kv * 192 + 2 * state) == 15 and plan.state_bytes_per_seq == state
    assert plan.num_blocks == (budget - 15 * 2 * state) // (s_kv * 16)   # blocks of 16 tokens (the spec's default)
    for off in ({"enable_prefix_caching": False}, {"state_snapshots": 0}):
        plan = plan_capacity(parse_config({**data, "pools": [{**pool, **off}]}, env={}), {"tiny": model}).pools["chat"]
        assert plan.max_num_seqs == budget // (s_kv * 192 + state) == 17
        assert plan.num_blocks == (budget - 17 * state) // (s_kv * 16)
    kept = {**data, "pools": [{**pool, "state_snapshots": 40}]}   # 40 snapshots set aside first
    plan = plan_capacity(parse_config(kept, env={}), {"tiny": model}).pools["chat"]
    assert plan.max_num_seqs == (budget - 40 * state) // (s_kv * 192 + state) == 11
    assert plan.num_blocks == (budget - 40 * state - 11 * state) // (s_kv * 16)
    with pytest.raises(SpecError, match=r"^pools\[0\]\.state_snapshots: "):
        parse_config({**data, "pools": [{**pool, "state_snapshots": -1}]}, env={})
    swapping = {**pool, "preemption_mode": "swap", "swap_space": "1MiB"}
    with pytest.raises(SpecError, match=r"^pools\[0\]\.preemption_mode: 'swap' swaps K/V blocks"):
        plan_capacity(parse_config({**data, "pools": [swapping]}, env={}), {"tiny": model})


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_multimodal_qwen3_5_checkpoint_serves_its_text_model(tmp_path, builtin_path, moe):
    """Qwen3.5's checkpoints are `Qwen3_5ForConditionalGeneration` and `Qwen3_5MoeForConditionalGeneration` (a
    vision tower beside the text model under `language_model.`): served as the text model, greedy text token-identical
    to transformers' text model holding the same weights."""
    import shutil

    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    text = getattr(transformers, f"{family}TextConfig")(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        **QWEN3_5, **(experts if moe else {}))
    vision = getattr(transformers, f"{family}VisionConfig")(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                            out_hidden_size=64)
    config = getattr(transformers, f"{family}Config")(text_config=text.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    folder = tmp_path / "qwen3_5-mm"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    engine = _engine(folder)
    assert (engine.model_config.architecture, engine.model_config.text_weights_prefix) == \
        (f"{family}ForCausalLM", "language_model.")
    text_model = getattr(transformers, f"{family}ForCausalLM")(text).eval()
    text_model.model.load_state_dict(hf.model.language_model.state_dict())
    text_model.lm_head.load_state_dict(hf.lm_head.state_dict())
    prompts = _prompts(5, (5, 17, 40))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(text_model, p, 16) for p in prompts]


def test_an_fp8_cache_holds_the_attention_layers_and_measures_their_scales(tiny):
    """`kv_cache_dtype: fp8` on a hybrid model: the cache holds the one attention layer's K/V in a byte an element,
    its scales measured at start (the linear layers have none); three tokens of three greedy answers are those of the
    float32 cache (e4m3's rounding moves answers as they grow: docs/PERF.md, "FP8 KV cache")."""
    folder, _ = tiny
    pool = PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    engines = {kv: LLMEngine(EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(block_size=8),
                                          pools=(pool,), kv_cache_dtype=kv), progress=False) for kv in ("auto", "fp8")}
    fp8 = engines["fp8"]
    assert fp8.kv_cache.data.dtype == torch.float8_e4m3fn and fp8.kv_cache.data.shape[0] == 1
    attn = fp8.model.layers[3].self_attn
    assert attn.k_scale != 1.0 and attn.v_scale != 1.0   # measured on the calibration text
    prompts = _prompts(6, (12, 30, 7))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {kv: [o.outputs[0].token_ids for o in e.generate(prompts, params)] for kv, e in engines.items()}
    assert outs["fp8"] == outs["auto"]


def test_the_roofline_reads_the_attention_layers_kv_alone(tiny):
    """The step-cost model's roofline (planning, `simulate`) reads K/V of the attention layers alone and counts their
    query-key products alone: a hybrid's state layers attend to no keys."""
    from engine.roofline import PRESETS, RooflineStepTime, step_flops

    folder, _ = tiny
    model = ModelConfig.from_folder(folder)
    roofline = RooflineStepTime(PRESETS["h100"], model, dtype_bytes=2)
    assert roofline.kv_bytes_per_token == model.kv_bytes_per_token(torch.bfloat16) == 2 * 1 * 2 * 16 * 2
    assert step_flops(model, 1, 1000, 0) - step_flops(model, 1, 0, 0) == 4 * 1 * 4 * 16 * 1000


def test_the_roofline_moves_each_running_sequences_state_every_step():
    """A decode step of Mamba-Codestral-7B (no K/V; 259.75 MiB of state a sequence) is memory-bound: each sequence in
    the step adds its state read and written back to the weights' bytes, 64 sequences 33 GiB beside the weights'
    13.6 GiB, where a transformer's decode adds only its K/V."""
    from engine.roofline import PRESETS, RooflineStepTime
    from engine.step_cost import StepFeatures

    model = ModelConfig.from_folder(Path(__file__).parents[2] / "config" / "examples" / "mamba-codestral-7b")
    roofline, preset = RooflineStepTime(PRESETS["h100"], model, dtype_bytes=2), PRESETS["h100"]
    state = 64 * (10240 * 3 * 2 + 128 * 64 * 128 * 4)
    assert roofline.state_bytes_per_seq == state == model.state_bytes_per_seq(torch.bfloat16)

    def decode(batch: int) -> float:
        features = StepFeatures()
        for _ in range(batch):
            features.add(1000, 1, is_decode=True)
        return roofline.seconds([], features, batch)

    per_byte = 1 / (preset.memory_bandwidth * preset.bandwidth_efficiency)
    assert decode(64) - decode(1) == pytest.approx(63 * 2 * state * per_byte, rel=1e-6)


def test_the_gateway_credits_a_state_models_requests_their_whole_prompts(tiny, tmp_path):
    """KV credits count a block several requests name once, as a prefix cache that shares it; a state model's engine
    shares a cached prefix only up to a kept state and computes the blocks past it again, so the gateway credits
    each of its requests its whole prompt (the transformer's pool beside it still shares)."""
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config

    folder, _ = tiny
    path = tmp_path / "pools.yaml"
    path.write_text("devices:\n  a: {device: cpu, memory: 2GiB, dtype: float32}\n"
                    "  b: {device: cpu, memory: 2GiB, dtype: float32}\npools:\n"
                    f"  - {{name: hybrid, model: {folder}, device: a, kv_cache_bytes: 1MiB, avg_len: 192, "
                    "max_model_len: 512, route: {max_prompt_tokens: 100}}\n"
                    "  - {name: plain, model: builtin:smollm2-135m-instruct, device: b, kv_cache_bytes: 64MiB, "
                    "max_model_len: 1024, avg_len: 512, route: {min_prompt_tokens: 101}}\n")
    gateway = Gateway.from_config(load_config(path))
    assert not gateway.pools["hybrid"].admission.placement.share_blocks
    assert gateway.pools["plain"].admission.placement.share_blocks


# A step of a chunk resuming from a state (a snapshot inside it), a decode, a prompt's one-token piece ending on a
# snapshot's boundary after them, a one-token prompt, a new prompt (snapshots before its first token and after its
# last) and a chunk resuming past one chunk of the torch scan (two snapshots inside it): rows, query and sequence
# lengths; (sequence, offset, slot)
SPLIT_ROWS, SPLIT_QUERY_LENS, SPLIT_SEQ_LENS = [2, 0, 3, 1, 5, 4], [5, 1, 1, 1, 7, 70], [9, 12, 8, 1, 7, 80]
SPLIT_SAVES = [(0, 3, 0), (2, 1, 1), (4, 0, 2), (4, 7, 3), (5, 16, 4), (5, 64, 5)]
SPLIT_ROWS_HELD = SPLIT_SLOTS = 6


def assert_split_step_is_each_sequence_alone(run_layer, make_states, held_by, run_alone=None) -> None:
    """`run_layer(tokens, meta, states)` (the step's token indices of the sequences in `meta`) over the step above,
    its states from `make_states()` (the same each call): its outputs, and the states and snapshots `held_by(states)`
    gives ((conv, ssm, snap_conv, snap_ssm) of the layer), equal each sequence's run alone (through `run_alone`,
    where given)."""
    from kernels import AttentionMetadata

    def run(seqs, layer=run_layer):
        states = make_states()
        meta = AttentionMetadata.build([list(range(10))] * len(seqs), [SPLIT_QUERY_LENS[i] for i in seqs],
                                       [SPLIT_SEQ_LENS[i] for i in seqs], 8)
        meta.rows_list = [SPLIT_ROWS[i] for i in seqs]
        meta.rows = torch.tensor(meta.rows_list)
        states.prepare([], [(seqs.index(seq), offset, slot) for seq, offset, slot in SPLIT_SAVES if seq in seqs])
        states.for_step(meta)
        ends = [sum(SPLIT_QUERY_LENS[:i]) for i in range(len(SPLIT_QUERY_LENS) + 1)]
        return layer(torch.cat([torch.arange(ends[i], ends[i + 1]) for i in seqs]), meta, states), states

    together, states = run(list(range(len(SPLIT_ROWS))))
    assert states.split is not None and states.split.seqs == [1, 2, 3]
    # the longer pieces in parts ending at their snapshots (a scan at once of them where the mixer takes it)
    assert states.pieces.pieces.seq_parts == [2, 1, 3] and states.pieces.pieces.part_lens == [3, 2, 7, 16, 48, 6]
    for i, row in enumerate(SPLIT_ROWS):
        alone, kept = run([i], run_alone or run_layer)
        at = slice(sum(SPLIT_QUERY_LENS[:i]), sum(SPLIT_QUERY_LENS[:i + 1]))
        assert torch.allclose(together[at], alone, atol=1e-5)
        (conv, ssm, snap_conv, snap_ssm), (conv_1, ssm_1, snap_conv_1, snap_ssm_1) = held_by(states), held_by(kept)
        assert torch.allclose(conv[row], conv_1[row], atol=1e-5) and torch.allclose(ssm[row], ssm_1[row], atol=1e-5)
        for seq, _, slot in SPLIT_SAVES:
            if seq == i:
                assert torch.allclose(snap_conv[slot], snap_conv_1[slot], atol=1e-5)
                assert torch.allclose(snap_ssm[slot], snap_ssm_1[slot], atol=1e-5)


@pytest.mark.parametrize("arch, pass_bytes", [("qwen3_5", None), ("granitemoehybrid", None), ("minimax", None),
                                              ("jamba", None), ("lfm2", None), ("kimi_linear", None), ("zaya", None),
                                              ("qwen3_5", 1)],
                         ids=["qwen3_5", "granite4_h", "minimax", "jamba", "lfm2", "kimi_linear", "zaya",
                              "qwen3_5-a-row-a-pass"])
def test_a_steps_one_token_pieces_run_batched_beside_its_prefills_as_each_sequence_alone(
        tmp_path, builtin_path, monkeypatch, arch, pass_bytes):
    """The one-token pieces of a step (`SPLIT_*`) run as one batched step beside its chunks
    (`RecurrentStates.split`), whatever their places in the batch, and its chunks as one scan
    (`RecurrentStates.pieces`); outputs, states and snapshots equal each sequence's run alone, a chunk in parts one
    by one (Gated DeltaNet's, Mamba-2's, lightning attention's, Mamba-1's, LFM2's, KDA's and CCA's layers, KDA's two
    sequences a scan; a CPU's batched step a row a pass, and its chunks a sequence a group, where a row's state fills
    its `CPU_PASS_BYTES`)."""
    from engine.layers.gated_delta_net import RecurrentStates, StateMixer
    from tests.engine.test_engine_vs_hf import GRANITE4_H, JAMBA, MINIMAX, TINY_MODELS

    if pass_bytes is not None:
        monkeypatch.setattr("engine.layers.gated_delta_net.CPU_PASS_BYTES", pass_bytes)
    sizes = {"qwen3_5": QWEN3_5, "minimax": MINIMAX, "granitemoehybrid": GRANITE4_H, "jamba": JAMBA,
             "lfm2": {"num_hidden_layers": 3, "full_attn_idxs": [2], "conv_bias": True, "conv_L_cache": 4},
             "kimi_linear": next(o for a, o in TINY_MODELS if a == "kimi_linear"),
             "zaya": next(o for a, o in TINY_MODELS if a == "zaya")}[arch]
    folder = make_tiny_model(tmp_path, arch, builtin_path, **sizes)
    model = _engine(folder).model.requires_grad_(False)   # as served: no autograd (Mamba-1's scan writes in place)
    mixer = next(m for m in model.modules() if isinstance(m, StateMixer))
    if mixer.pieces_at_once is not None:   # Kimi Delta Attention's cap: the step's three chunks in two scans
        monkeypatch.setattr(type(mixer), "pieces_at_once", 2)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(SPLIT_QUERY_LENS), model.config.hidden_size, generator=gen)
    shape = RecurrentStates(model.state_shape(), len(model.state_index), torch.float32, torch.device("cpu"),
                            SPLIT_ROWS_HELD)
    shape.reserve_snapshots(SPLIT_SLOTS)
    start = [torch.randn(t.shape, generator=gen) for t in (*shape.conv, *shape.ssm, *shape.snap_conv, *shape.snap_ssm)]

    def make_states():
        states = RecurrentStates(model.state_shape(), len(model.state_index), torch.float32, torch.device("cpu"),
                                 SPLIT_ROWS_HELD)
        states.reserve_snapshots(SPLIT_SLOTS)
        for held, value in zip((*states.conv, *states.ssm, *states.snap_conv, *states.snap_ssm), start):
            held.copy_(value)
        for held in (*states.conv, *states.ssm):   # nothing writes the zero row
            held[states.zero_row] = 0
        return states

    def run(tokens, meta, states):   # a layer; ZAYA1's CCA state (no forward of its own) through its scan
        if type(mixer).forward is not torch.nn.Module.forward:
            return mixer(hidden[tokens], meta, states)
        return mixer.scan(inputs[0][tokens], (inputs[1][tokens],), meta, states)

    if arch == "zaya":   # the q and k projections' channels, and the delayed value beside them
        ssm_width = shape.ssm[0].shape[-1]
        inputs = [torch.randn(len(hidden), shape.conv[0].shape[1], generator=gen),
                  torch.randn(len(hidden), ssm_width, generator=gen)]

    def each_part_alone(tokens, meta, states):   # the chunks' parts one by one (`StateMixer._scan_each`)
        mixer.scans_pieces = False
        try:
            return run(tokens, meta, states)
        finally:
            del mixer.scans_pieces

    layer = mixer.layer
    assert_split_step_is_each_sequence_alone(
        run, make_states, lambda st: (st.conv[layer], st.ssm[layer], st.snap_conv[layer], st.snap_ssm[layer]),
        each_part_alone)
