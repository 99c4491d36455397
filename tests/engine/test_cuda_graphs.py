"""Decode steps replayed from captured graphs (`engine.cuda_graphs`) give the tokens eager steps give.

No GPU here: `tests.engine.graph_recorder.RecordingGraphBackend` captures what a CUDA graph captures
(every launch with its arguments frozen) and replays only that, on the Triton kernels through the
interpreter. The engine's greedy output with graphs equals its output without, on one rank and on two
(the follower capturing and replaying in lockstep, an FP8 cache's scales measured first); a replay equals the
eager forward and writes only the step's slots; the torch reference, which is not graph-safe, is caught
by the same recorder; the sizes and what the plan sets aside.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig  # noqa: E402
from engine.cuda_graphs import DecodeGraphs, capture_lengths, capture_sizes, graph_memory_bytes  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from kernels import AttentionMetadata  # noqa: E402
from tests.conftest import assert_all_free, make_tiny_model  # noqa: E402
from tests.engine.graph_recorder import GraphUnsafeError, RecordingGraphBackend  # noqa: E402

MAX_SEQS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-graphs"), "llama", builtin_path)


def _engine(path, monkeypatch, backend: str = "triton", num_blocks: int = 24) -> LLMEngine:
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    config = EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(block_size=8),   # float32 tokens
                          pools=(PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(
                              max_num_seqs=MAX_SEQS, max_num_batched_tokens=32, max_model_len=128)),))
    return LLMEngine(config, progress=False)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35


@pytest.mark.slow   # ~9-22 s through the interpreter (by the VM's hour); each replay equals the eager forward below
# (replays between eager steps under preemption: only here)
def test_greedy_tokens_are_the_same_with_graphs_and_without(tiny, monkeypatch):
    """Four requests of different lengths decode together, finish at different steps (batches of 4,
    3, 2 and 1 replay the graphs of 4, 4, 2 and 1, padded rows included); one pool of 24 blocks of 8
    forces preemption and recompute (eager prefill between replays). The eager run is the torch reference's."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 30, 41)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 14, 8, 22)]
    results = {}
    for graphs in (False, True):
        engine = _engine(tiny, monkeypatch, "triton" if graphs else "torch", num_blocks=14)
        if graphs:
            recorder = RecordingGraphBackend()
            engine.runner.capture_graphs(MAX_SEQS, 128, recorder)
            assert recorder.captures == 3 and engine.runner.graphs.sizes == [1, 2, 4]
        outs = engine.generate(prompts, params)
        results[graphs] = [out.outputs[0].token_ids for out in outs]
        assert_all_free(engine)
        if graphs:
            assert recorder.replays > 10    # most steps were decode-only replays
            assert engine.schedulers["default"].stats.num_preemptions > 0
    assert results[True] == results[False]


@pytest.mark.slow   # two ranks through the Triton interpreter: 17 s on 2 cores (make test-slow)
@pytest.mark.usefixtures("one_thread")   # a core per rank
def test_two_ranks_capture_and_replay_their_graphs_in_lockstep(tiny, monkeypatch, tmp_path):
    """Tensor parallelism 2 (gloo, two processes) with an FP8 cache, started as on CUDA: rank 0 measures
    the scales with its follower (`engine.kv_scales`) before anything is captured, since a capture freezes
    each launch's scalars, k_scale / v_scale among them; then tells it to capture
    (`engine.parallel.CaptureGraphs`, the recorder pickled to it). Each rank records the same sizes, and
    every decode step replays on both, the all-reduces inside the recordings pairing up at each replay.
    Greedy tokens equal those of the eager torch reference on one rank, which measures the same scales; the
    follower's own recorder counts its captures and replays (in `tally`)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 19, 33)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 8, 3)]
    scales = {}

    def measured(engine: LLMEngine, graphs: bool) -> None:
        scales[graphs] = [scale for layer in engine.model.layers
                          for scale in (layer.self_attn.k_scale, layer.self_attn.v_scale)]
        assert set(scales[graphs]) != {1.0}

    results, recorder, follower = _eager_then_two_ranks(tiny, monkeypatch, tmp_path, prompts, params, measured,
                                                        kv_cache_dtype="fp8")
    assert results[True] == results[False]
    assert scales[True] == pytest.approx(scales[False], rel=1e-6)
    assert follower.count("capture") == 3 and recorder.captures == 3
    assert follower.count("replay") == recorder.replays > 5   # every replay here was one there


def _eager_then_two_ranks(path, monkeypatch, tmp_path, prompts, params, check, max_len: int | None = None, **config
                          ) -> tuple[dict, RecordingGraphBackend, list[str]]:
    """The model on the eager torch reference on one rank, then on the Triton kernels under tensor parallelism 2
    (gloo, two processes), started as on CUDA: its decode graphs captured (at `max_len` where given) by a recorder
    pickled to the follower, which counts there in a tally. `check(engine, graphs)` runs on each engine first.
    Returns each run's greedy tokens, the recorder and the follower's tally ("capture" / "replay" a line)."""
    import engine.model_runner as model_runner

    tally = tmp_path / "tally"
    recorder = RecordingGraphBackend(str(tally))
    capture = model_runner.ModelRunner.capture_graphs
    results = {}
    for graphs in (False, True):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton" if graphs else "torch")   # followers inherit it
        if graphs:   # as on CUDA: the engine captures at start, here with the recorder
            monkeypatch.setattr(model_runner._Forward, "graphs_apply", lambda self, enforce_eager: True)
            monkeypatch.setattr(model_runner.ModelRunner, "capture_graphs", lambda self, max_batch, longest: capture(
                self, max_batch, max_len or longest, recorder))
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", tensor_parallel_size=1 + graphs,
                                        cpu_threads=1, cache=CacheConfig(block_size=8), **config,
                                        pools=(PoolConfig(num_blocks=24, scheduler=SchedulerConfig(
                                            max_num_seqs=MAX_SEQS, max_num_batched_tokens=32, max_model_len=128)),)),
                           progress=False)
        try:
            assert (engine.runner.graphs is not None) is graphs
            check(engine, graphs)
            results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
            assert_all_free(engine)
        finally:
            engine.close()
    follower = [line.split()[1] for line in tally.read_text().splitlines() if int(line.split()[0]) != os.getpid()]
    return results, recorder, follower


def _direct(tiny, monkeypatch, backend: str):
    """A DecodeGraphs over the engine's model, fed by hand: (graphs, engine)."""
    engine = _engine(tiny, monkeypatch, backend)
    graphs = DecodeGraphs(engine.model, engine.kv_cache.layers, engine.runner.backend, engine.device, MAX_SEQS,
                          128, 8, RecordingGraphBackend())
    with torch.inference_mode():
        graphs.capture()
    return graphs, engine


def _decode_step(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    tables = [list(range(3 * i, 3 * i + 3)) for i in range(len(seq_lens))]
    meta = AttentionMetadata.build(tables, [1] * len(seq_lens), seq_lens, 8)
    ids = torch.tensor([11 + i for i in range(len(seq_lens))])
    return ids, torch.tensor([s - 1 for s in seq_lens]), meta


def test_a_replay_equals_the_eager_forward_and_padded_rows_store_nothing(tiny, monkeypatch):
    graphs, engine = _direct(tiny, monkeypatch, "triton")
    caches = engine.kv_cache.layers
    gen = torch.Generator().manual_seed(0)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    with torch.inference_mode():
        for seq_lens in ([20, 9, 17, 23], [5, 6, 7], [5], [24, 2]):   # sizes 4, 4 (padded), 1, 2
            ids, positions, meta = _decode_step(seq_lens)
            before = [(k.clone(), v.clone()) for k, v in caches]
            replayed = graphs.run(ids, positions, meta).clone()
            n, size = len(seq_lens), next(s for s in graphs.sizes if s >= len(seq_lens))
            # a padded row reads one key of block 0, not the context a longer step left in its row
            assert graphs.seq_lens[n:size].tolist() == [1] * (size - n)
            assert graphs.block_tables[n:size, 0].tolist() == [0] * (size - n)
            after = [(k.clone(), v.clone()) for k, v in caches]
            for (k, v), (k0, v0) in zip(caches, before):          # the eager forward writes the same K/V again
                k.copy_(k0)
                v.copy_(v0)
            eager = engine.model(ids, positions, caches, _decode_step(seq_lens)[2], engine.runner.backend)
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
            written = meta.slot_mapping          # the step's own slots; a padded row's -1 stores nothing
            for (k, v), (k0, v0), (k1, v1) in zip(caches, before, after):
                for eager_cache, old, replay_cache in ((k, k0, k1), (v, v0, v1)):
                    flat_old, flat_replay = old.flatten(0, 1).clone(), replay_cache.flatten(0, 1).clone()
                    torch.testing.assert_close(flat_replay[written], eager_cache.flatten(0, 1)[written],
                                               rtol=1e-5, atol=1e-5)
                    flat_old[written] = flat_replay[written] = 0
                    assert torch.equal(flat_replay, flat_old), "the replay wrote slots outside the step's"


def test_the_recorder_catches_what_a_graph_cannot_replay(tiny, monkeypatch):
    """The torch reference is not graph-safe: its K/V store drops the padded rows by a boolean mask (an
    output whose shape depends on the slots) and its decode gathers K/V by indices built from
    `seq_lens_list`. The recorder refuses the replay, as a CUDA capture would refuse the mask's sync."""
    graphs, engine = _direct(tiny, monkeypatch, "torch")
    with torch.inference_mode(), pytest.raises(GraphUnsafeError, match="depends on the data"):
        graphs.run(*_decode_step([20, 9, 17, 23]))


def test_prefill_and_mixed_steps_stay_eager():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._graphs, graphs.max_batch, graphs.max_model_len = {1: None}, 8, 128
    assert graphs.can_run([1, 1, 1]) and graphs.can_run([1, 1], [128, 7])
    assert not graphs.can_run([1, 5])            # a chunk in the step
    assert not graphs.can_run([1] * 9)           # more than the largest graph
    assert not graphs.can_run([])
    assert not graphs.can_run([1, 1], [129, 7])  # longer than the graphs' block tables hold


def test_graphs_hold_the_longest_context_of_any_pool(tiny, monkeypatch):
    """A pool whose max_model_len is 0 (the model's context) beside one of 128: the decode graphs are captured
    for the model's context, not for 128 (the first decode past 128 tokens in the other pool broke the step)."""
    import engine.model_runner as model_runner

    captured = []
    monkeypatch.setattr(model_runner._Forward, "graphs_apply", lambda self, enforce_eager: True)
    monkeypatch.setattr(model_runner.ModelRunner, "capture_graphs",
                        lambda self, max_batch, max_model_len, graphs=None: captured.append(max_model_len))
    pools = tuple(PoolConfig(name=name, num_blocks=16, scheduler=SchedulerConfig(max_model_len=length))
                  for name, length in (("chat", 128), ("rag", 0)))
    engine = LLMEngine(EngineConfig(model=str(tiny), cache=CacheConfig(block_size=8), pools=pools), progress=False)
    assert captured == [engine.model_config.max_position_embeddings] == [engine.schedulers["rag"].max_model_len]


def test_graph_memory_is_the_largest_batch_activations_and_a_workspace():
    small = graph_memory_bytes(4096, 4096, 1024, 14336, 32, 128, 1, 2)
    large = graph_memory_bytes(4096, 4096, 1024, 14336, 32, 128, 256, 2)
    assert small > 64 << 20 and large - (64 << 20) == 256 * (small - (64 << 20))
    assert large < 1 << 30   # an 8B at 256 sequences: ~120 MiB, a rounding error of a GPU's memory
    # Qwen3-30B-A3B's experts (128, 8 a token, 768 wide) add their pairs' rows: 2 x (512 + 8 x (3 x 2 x 768 + 4 x
    # 2048 + 24)) bytes a token
    dense = graph_memory_bytes(2048, 4096, 512, 6144, 32, 128, 512, 2)
    moe = graph_memory_bytes(2048, 4096, 512, 6144, 32, 128, 512, 2, num_experts=128, top_k=8,
                             moe_intermediate_size=768)
    assert moe - dense == 2 * 512 * (4 * 128 + 8 * (3 * 2 * 768 + 4 * 2048 + 24))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_greedy_tokens_are_the_same_with_graphs_and_without(tiny, dtype):
    """The real thing: CUDA graphs captured by the engine at start (and `enforce_eager` without them),
    eight requests decoding together and finishing at different steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 30, 41, 8, 64, 3, 25)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20, 11, 30, 40, 9, 33, 17)]
    results = {}
    for eager in (True, False):
        config = EngineConfig(model=str(tiny), device="cuda", dtype=dtype, cache=CacheConfig(block_size=16),
                              enforce_eager=eager,
                              pools=(PoolConfig(num_blocks=64, scheduler=SchedulerConfig(
                                  max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)),))
        engine = LLMEngine(config, progress=False)
        assert (engine.runner.graphs is None) == eager
        if not eager:
            assert engine.runner.graphs.sizes == [1, 2, 4, 8]
            assert "graphs" in engine.load_phases
        results[eager] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert results[False] == results[True]


def test_graphs_apply_only_to_a_model_whose_forward_is_graph_safe(tmp_path, builtin_path, monkeypatch):
    """Qwen3-MoE's expert loop and grouped matmuls read which experts a step hit (a device sync): CUDA graphs
    cannot capture them, so those steps run eagerly; with the Triton ops its experts run the Triton
    kernels, which read nothing back, and it is captured like every other model (on CUDA with the
    Triton backend, on one rank or several)."""
    from types import SimpleNamespace

    from engine.model import LlamaForCausalLM
    from engine.model_config import ModelConfig
    from engine.model_runner import _Forward
    from engine.models import build_model
    from engine.parallel import Collectives, ShardShape
    from kernels import triton_attention

    path = make_tiny_model(tmp_path / "moe", "qwen3_moe", builtin_path, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32)
    config = ModelConfig.from_folder(path)
    models = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
        models[backend] = build_model(config, torch.float32, torch.device("cpu"), ShardShape.of(config), Collectives())
    for model, expected in ((SimpleNamespace(graph_safe=LlamaForCausalLM.graph_safe), True),
                            (models["torch"], False), (models["triton"], True)):
        for tensor_parallel in (False, True):
            runner = SimpleNamespace(device=torch.device("cuda"), tensor_parallel=tensor_parallel,
                                     backend=triton_attention, model=model)
            assert _Forward.graphs_apply(runner, enforce_eager=False) is expected
            assert _Forward.graphs_apply(runner, enforce_eager=True) is False


def _three_decoders(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Three prompts of 3, 20 and 9 tokens decoding 7, 3 and 4 greedy tokens: decode batches of 3, 2 and 1 (six
    decode steps: each replay under the Triton interpreter costs what a test here is worth, no more)."""
    rng = random.Random(seed)
    return ([[rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 9)],
            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 3, 4)])


def _engine_graphs(path, monkeypatch, graphs: bool) -> tuple[LLMEngine, RecordingGraphBackend | None]:
    """An engine on the torch reference, or on the Triton backend with its decode graphs captured by a recorder."""
    engine = _engine(path, monkeypatch, "triton" if graphs else "torch")
    recorder = None
    if graphs:
        recorder = RecordingGraphBackend()
        engine.runner.capture_graphs(MAX_SEQS, 128, recorder)
    return engine, recorder


HYBRIDS = {"qwen3_5": {}, "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32),
           "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3,
                                    num_local_experts=0, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2),
           "nemotron_h": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
                              head_dim=16, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2),
           "jamba": dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=1, num_experts=1,
                         mamba_d_state=8, mamba_dt_rank=8),
           "mamba": dict(num_hidden_layers=2, state_size=8, time_step_rank=8),
           "zamba2": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                          mamba_d_state=16, n_mamba_heads=4, num_mem_blocks=2, use_shared_attention_adapter=True,
                          adapter_rank=8, num_key_value_heads=4, use_mem_rope=True),
           "minimax": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                           head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)}
OWN_SHAPES = ("granitemoehybrid", "nemotron_h", "jamba", "mamba", "zamba2", "minimax")   # the rest: Qwen3.5's layers


# Qwen3-Next on the recorder would be Qwen3.5's layers (qwen3_5) and experts under graphs (Mistral 4's, LongCat-Flash's
# below), MiniMax's lightning layers state layers of no convolution beside experts: their own cases run on CUDA
@pytest.mark.parametrize("arch", [arch for arch in HYBRIDS if arch not in ("qwen3_next", "minimax")])
def test_a_hybrid_models_decode_graphs_keep_each_sequences_state(tmp_path, builtin_path, monkeypatch, arch):
    """Qwen3.5's linear-attention layers (and Granite 4-H's Mamba-2 ones, Zamba2's beside its shared blocks, Jamba's and
    Mamba's Mamba-1, Mamba's beside a KV cache of no layer) gather each sequence's state by its row of the persistent
    batch and scatter it back, on the device: decode steps replay (batches of 3, 2 and 1: padded rows, whose writes
    land in the states' padding row), prefills run eagerly between them, and greedy tokens equal the eager run's, a
    sequence resumed from a kept prefix state too (copied into its row before the replay); the states stay where the
    graphs read them (a row past them is refused, not reallocated)."""
    from tests.engine.test_engine_vs_hf import QWEN3_5

    overrides = HYBRIDS[arch] if arch in OWN_SHAPES else {**QWEN3_5, **HYBRIDS[arch]}
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    prompts, params = _three_decoders(11)
    results = {}
    for graphs in (False, True):
        engine, recorder = _engine_graphs(path, monkeypatch, graphs)
        results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        # the second prompt's first 16 tokens kept a state (prefix caching): one token left, its step decode-sized
        replays = recorder.replays if graphs else 0
        results[graphs].append(engine.generate([prompts[1][:16] + [7]], params[0])[0].outputs[0].token_ids)
        assert engine.schedulers["default"].state_snapshots.num_loaded == 1
        assert not graphs or recorder.replays - replays == params[0].max_tokens   # every step, the resuming one's too
        assert_all_free(engine)
    assert recorder.replays > 5 and engine.model.states.frozen
    assert results[True] == results[False]
    with pytest.raises(RuntimeError, match="past the 4 rows of linear-attention state"):
        engine.model.states.reserve(5)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_on_cuda_a_hybrid_models_greedy_tokens_are_the_same_with_graphs_and_without(tmp_path, builtin_path, arch):
    """The real thing for the models with state layers (Qwen3.5's Gated DeltaNet, Qwen3-Next's experts beside them,
    Granite 4-H's Mamba-2, Nemotron-H's blocks, Jamba's Mamba-1 and its Triton scan, MiniMax's lightning attention
    beside experts): CUDA graphs captured at start
    against `enforce_eager`, in bfloat16, six requests decoding together (padded batches) and finishing at different
    steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tests.engine.test_engine_vs_hf import QWEN3_5

    overrides = HYBRIDS[arch] if arch in OWN_SHAPES else {**QWEN3_5, **HYBRIDS[arch]}
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 70, 30, 3, 41, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20, 11, 30, 9, 17)]
    results = {}
    for eager in (True, False):
        config = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", cache=CacheConfig(block_size=16),
                              enforce_eager=eager, pools=(PoolConfig(num_blocks=64, scheduler=SchedulerConfig(
                                  max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)),))
        engine = LLMEngine(config, progress=False)
        assert (engine.runner.graphs is None) == (eager or not engine.model.graph_safe)
        results[eager] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert results[False] == results[True]


@pytest.mark.parametrize("shape", ["GEMMA4", "GEMMA4_E"])
def test_gemma4_decode_graphs_replay_two_cache_shapes_and_shared_kv_layers(tmp_path, builtin_path, monkeypatch,
                                                                          shape):
    """Gemma 4's layers attend in two shapes, each over a cache tensor of its own (and the E models' last layers over
    their producer's, with per-layer inputs), its sliding layers in rings (`sliding_kv` auto: a replay copies the
    step's ring slots and tables beside the paged ones; dropping either copy fails this test): decode steps replay the
    captured graphs (batches of 3, 2 and 1, padded rows), prefills run eagerly between them, and greedy tokens equal
    the eager torch reference's."""
    import tests.engine.test_engine_vs_hf as parity

    path = make_tiny_model(tmp_path / shape, "gemma4", builtin_path, **getattr(parity, shape))
    prompts, params = _three_decoders(13)
    results = {}
    for graphs in (False, True):
        engine, recorder = _engine_graphs(path, monkeypatch, graphs)
        assert engine.model.graph_safe and engine.kv_cache.ring is not None
        results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert recorder.replays > 5
    assert results[True] == results[False]


@pytest.mark.parametrize("arch", ["mistral4", "longcat_flash"])
def test_latent_attention_decode_graphs_replay_scaled_queries_and_a_shortcut(tmp_path, builtin_path, monkeypatch,
                                                                              arch):
    """Mistral Small 4's latent attention scales each query by its position (rows computed in the captured step,
    the positions of each replay's); LongCat-Flash's experts run in one sublayer and their output joins the next's
    (a tensor the pair hands on within the captured forward). Decode steps replay the captured graphs (batches of 3,
    2 and 1, padded rows), prefills run eagerly between them, and greedy tokens equal the eager torch reference's."""
    from tests.engine.test_engine_vs_hf import LONGCAT, MISTRAL4

    longcat = {**LONGCAT, "num_layers": 1, "num_hidden_layers": 2}   # one layer: its two sublayers and the shortcut
    shape = {"mistral4": MISTRAL4, "longcat_flash": longcat}[arch]
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **shape)
    prompts, params = _three_decoders(17)
    results = {}
    for graphs in (False, True):
        engine, recorder = _engine_graphs(path, monkeypatch, graphs)
        assert engine.model.graph_safe or not graphs   # its experts' Triton kernels under the graphs
        results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert recorder.replays > 5
    assert results[True] == results[False]



@pytest.mark.parametrize("arch,shape", [("bloom", {"n_layer": 2, "n_head": 4}),
                                        ("mpt", {"n_layers": 2, "n_heads": 4, "d_model": 64})])
def test_alibi_decode_graphs_replay_the_slopes(tmp_path, builtin_path, monkeypatch, arch, shape):
    """BLOOM's and MPT's ALiBi on the Triton kernels (the slopes a device tensor the kernels read, moved there by the
    eager warm-up before the capture): decode steps replay the captured graphs and greedy tokens equal the eager
    torch reference's (`kernels.alibi`)."""
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **shape)
    prompts, params = _three_decoders(23)
    results = {}
    for graphs in (False, True):
        engine, recorder = _engine_graphs(path, monkeypatch, graphs)
        results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert recorder.replays > 5
    assert results[True] == results[False]


def _sparse_shapes() -> dict:
    """Tiny shapes of the models whose sparse attention picks its path by the step's lengths, each choosing 24 keys:
    DeepSeek V3.2's, GLM-5's, HY V4's and A.X-K2's tokens (`index_topk`), MiniMax M3's 6 blocks of 4, Qwen4-Exp's 4
    blocks of 5 and the last incomplete one."""
    from tests.engine.test_engine_vs_hf import AXK2, HYV4, MINIMAX_M3, QWEN4_EXP
    from tests.kernels.test_engine_triton import LATENT

    dsa = {**LATENT, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 24}
    return {"deepseek_v32": dsa, "glm_moe_dsa": {**dsa, "indexer_types": ["full", "shared"]},
            "hy_v4": {**HYV4, "index_topk": 24, "num_hidden_layers": 2},
            "axk2": {**AXK2, "index_topk": 24, "num_hidden_layers": 2},
            "minimax_m3_vl_text": {**MINIMAX_M3, "index_topk_blocks": 6},
            "qwen4_exp_text": {**QWEN4_EXP, "indexer_budget": 20, "indexer_compress_ratio": 5}}


def test_capture_lengths():
    """A sparse regime's graphs double in length from the dense regime's to the longest served; without one (or a
    dense regime as long) one length."""
    assert capture_lengths(131072, 2048, True) == [2048 << k for k in range(7)]
    assert capture_lengths(100, 24, True) == [24, 48, 96, 100]
    assert capture_lengths(100, 24, False) == [24]
    assert capture_lengths(100, None, True) == capture_lengths(100, 128, True) == [100]


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "minimax_m3_vl_text",
                                  "qwen4_exp_text"])
def test_sparse_attention_decode_graphs_hold_both_regimes_where_the_kernels_allow(
        tmp_path, builtin_path, monkeypatch, arch):
    """DeepSeek V3.2's, GLM-5's, HY V4's and A.X-K2's sparse attention, MiniMax M3's block-sparse layers and
    Qwen4-Exp's QSA pick their path by the step's lengths on the host. Up to the keys a query may choose (24 here)
    every earlier key is chosen and the paged kernels attend; past it the Triton indexer and sparse kernels run,
    told the graph's length (40 here, the longest captured), which the decode graphs of V3.2, GLM-5, HY V4, A.X-K2
    and M3 hold; Qwen4-Exp's torch selection runs eagerly. Greedy tokens equal the eager torch reference's
    throughout, replays on both sides of the crossing, each step replaying the graphs of the shortest length that
    holds it."""
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **_sparse_shapes()[arch])
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 9, 4)]   # 20 + 9 > 24
    sparse = arch != "qwen4_exp_text"
    results, decided, replayed = {}, [], []
    for graphs in (False, True):
        engine = _engine(path, monkeypatch, "triton" if graphs else "torch")
        if graphs:
            recorder = RecordingGraphBackend()
            engine.runner.capture_graphs(MAX_SEQS, 40, recorder)
            graphs_ = engine.runner.graphs
            assert graphs_.lengths == ([24, 40] if sparse else [24]) and engine.model.graph_safe
            assert recorder.captures == 3 * len(graphs_.lengths)
            can_run, replay = graphs_.can_run, recorder.replay
            keys = {id(graph): key for key, (graph, _, _) in graphs_._graphs.items()}
            monkeypatch.setattr(graphs_, "can_run", lambda q, s=None: decided.append(
                (max(s or [0]), all(n == 1 for n in q), can_run(q, s))) or decided[-1][2])
            monkeypatch.setattr(recorder, "replay", lambda graph: replayed.append(
                (decided[-1][0], keys[id(graph)][0])) or replay(graph))
        results[graphs] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    decodes = [(longest, ok) for longest, decode, ok in decided if decode]
    assert any(ok and longest > 8 for longest, ok in decodes), decided              # replays past the first steps
    assert any(longest > 24 for longest, _ in decodes), decided                     # decodes crossed index_topk
    assert all(ok == (longest <= 24 or sparse) for longest, ok in decodes), decided
    assert all(length == (24 if longest <= 24 else 40) for longest, length in replayed), replayed
    assert {length for _, length in replayed} == ({24, 40} if sparse else {24}), replayed
    assert results[True] == results[False]


@pytest.mark.slow   # ~15 s: two ranks through the interpreter
def test_two_ranks_replay_the_sparse_regimes_graphs_in_lockstep(tmp_path, builtin_path, monkeypatch):
    """DeepSeek V3.2 under tensor parallelism 2 (gloo, two processes; the indexer whole on every rank, each rank its
    heads): the follower captures the same lengths and sizes as rank 0 (24 and 40 here), and the decode steps past
    `index_topk` replay on both, the all-reduces inside the recordings pairing up; greedy tokens equal the eager
    torch reference's on one rank."""
    path = make_tiny_model(tmp_path / "v32", "deepseek_v32", builtin_path, **_sparse_shapes()["deepseek_v32"])
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 9, 4)]

    def both_regimes(engine: LLMEngine, graphs: bool) -> None:
        assert not graphs or engine.runner.graphs.lengths == [24, 40]

    results, recorder, follower = _eager_then_two_ranks(path, monkeypatch, tmp_path, prompts, params, both_regimes,
                                                        max_len=40)
    assert results[True] == results[False]
    assert follower.count("capture") == recorder.captures == 6
    assert follower.count("replay") == recorder.replays > 5


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v32", "minimax_m3_vl_text"])
def test_on_cuda_sparse_attention_replays_graphs_past_its_dense_regime(tmp_path, builtin_path, arch):
    """The real thing for the sparse attentions: CUDA graphs of both regimes (24 keys a query, lengths 24 to 256)
    against `enforce_eager`, in bfloat16, six requests decoding together past the dense regime (the longest to 90
    tokens) and finishing at different steps; the graphs replay decode steps of sequences past 24."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = make_tiny_model(tmp_path / arch, arch, builtin_path, **_sparse_shapes()[arch])
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 70, 30, 3, 41, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20, 11, 30, 9, 17)]
    results, replayed = {}, []
    for eager in (True, False):
        config = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", cache=CacheConfig(block_size=16),
                              enforce_eager=eager, pools=(PoolConfig(num_blocks=64, scheduler=SchedulerConfig(
                                  max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)),))
        engine = LLMEngine(config, progress=False)
        if not eager:
            graphs = engine.runner.graphs
            assert graphs.lengths == [24, 48, 96, 192, 256]
            run = graphs.run
            graphs.run = lambda ids, positions, meta: replayed.append(max(meta.seq_lens_list)) or run(ids, positions,
                                                                                                       meta)
        results[eager] = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert_all_free(engine)
    assert max(replayed) > 48
    assert results[False] == results[True]

