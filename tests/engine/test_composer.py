"""The step composer and its step-cost model, on schedulers without a model (milliseconds), and one
engine-level check that squeezing a throughput pool keeps greedy outputs unchanged."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, PoolConfig, SamplingParams, SchedulerConfig
from engine.block_manager import BlockManager
from engine.composer import (COLD_START_TOKENS, STARVATION_STEPS, StepComposer, StepCostModel, StepFeatures,
                             nonnegative_lstsq)
from engine.config import ConfigError, LatencySLO
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.sampling import SamplingParams as Params
from tests.conftest import assert_all_free, make_tiny_model

# a made-up device: 5 ms per step, 0.2 ms per prefill token, 1 ms per decode, 0.01 ms per 1024 pairs
TRUE_COEF = np.array([5e-3, 2e-4, 1e-3, 1e-5])


def _true_seconds(f: StepFeatures) -> float:
    return float(f.vector() @ TRUE_COEF)


def _make_seq(seq_id: int, num_tokens: int, max_tokens: int = 64) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(range(num_tokens)),
                    num_prompt_tokens=num_tokens, params=Params(), max_tokens=max_tokens, priority=0,
                    arrival_order=seq_id, generator=None)


def _make_composer(slo: LatencySLO | None = LatencySLO(ttft_ms=1000, itl_ms=50), *, trained: bool = True,
                   rag_budget: int = 2048) -> StepComposer:
    chat = Scheduler(SchedulerConfig(max_num_batched_tokens=2048), BlockManager(256, 16), 4096, name="chat")
    rag = Scheduler(SchedulerConfig(max_num_batched_tokens=rag_budget), BlockManager(1024, 16, first_block=256),
                    16384, name="rag")
    composer = StepComposer({"chat": chat, "rag": rag}, {"chat": slo, "rag": None})
    if trained:
        _train(composer.cost_model)
    return composer


def _train(model: StepCostModel, steps: int = 64, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        f = StepFeatures()
        for _ in range(rng.randrange(0, 20)):
            f.add(rng.randrange(10, 2000), 1, True)
        if rng.random() < 0.7:
            f.add(rng.randrange(0, 8000), rng.randrange(1, 2048), False)
        model.observe(f, _true_seconds(f))


def _finish_step(composer: StepComposer, step) -> None:
    """Pretend the step's forward pass ran (tokens computed, a sequence at its end gets one more token)
    and let the composer observe the made-up device's time for it."""
    for out in step.outputs.values():
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
    composer.observe(step, _true_seconds(step.features))


def _run_step(composer: StepComposer) -> dict[str, list[int]]:
    """Schedule, finish (`_finish_step`) and report each pool's scheduled token counts."""
    step = composer.schedule()
    _finish_step(composer, step)
    return {name: [i.num_new_tokens for i in out.scheduled] for name, out in step.outputs.items()}


def test_cost_model_recovers_a_linear_cost_and_keeps_coefficients_nonnegative():
    model = StepCostModel()
    assert model.predict(StepFeatures()) is None and not model.ready
    _train(model)
    assert model.ready
    np.testing.assert_allclose(model.coef, TRUE_COEF, rtol=1e-6, atol=1e-9)
    assert model.margin == pytest.approx(1.0)
    f = StepFeatures()
    f.add(3000, 500, False)
    assert model.predict(f) == pytest.approx(_true_seconds(f), rel=1e-6)


def testnonnegative_lstsq_drops_a_feature_that_fits_negative():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(0, 100, 50), rng.uniform(0, 100, 50)])
    t = 2.0 + 0.5 * x[:, 1] - 0.01 * x[:, 2]          # the last feature "saves" time: not physical
    coef = nonnegative_lstsq(x, t)
    assert (coef >= 0).all() and coef[2] == 0
    assert coef[1] == pytest.approx(0.5, rel=0.05)
    assert nonnegative_lstsq(np.column_stack([np.ones(5), np.zeros(5)]), np.full(5, 3.0)).tolist() == [3.0, 0.0]


def test_margin_grows_when_steps_run_slower_than_predicted():
    model = StepCostModel()
    _train(model)
    f = StepFeatures()
    f.add(100, 256, False)
    for _ in range(20):
        model.observe(f, 1.5 * _true_seconds(f))
    assert model.margin > 1.1


def test_interactive_decodes_squeeze_the_throughput_chunk_to_the_itl_target():
    composer = _make_composer()
    chat, rag = composer.schedulers["chat"], composer.schedulers["rag"]
    for i in range(8):                       # eight chat sequences decoding
        seq = _make_seq(i, 40)
        chat.add(seq)
    rag.add(_make_seq(100, 6000))
    first = _run_step(composer)              # chat prefills (not squeezed); rag gets what is left
    for _ in range(5):
        step = composer.schedule()
        assert step.target_seconds == pytest.approx(0.050)
        assert step.predicted_seconds <= 0.050 * composer.cost_model.margin + 1e-9
        rag_tokens = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        assert 0 < rag_tokens < 2048
        _finish_step(composer, step)
    assert sum(first["chat"]) == 8 * 40


def test_without_interactive_work_the_throughput_pool_gets_the_whole_idle_target():
    composer = _make_composer(LatencySLO(ttft_ms=2000, itl_ms=300))
    composer.schedulers["rag"].add(_make_seq(0, 16000))
    for _ in range(4):
        step = composer.schedule()
        assert step.target_seconds == pytest.approx(0.3)       # itl_ms, shorter than half of ttft_ms
        rag_tokens = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        assert rag_tokens == 2048 or step.predicted_seconds <= 0.3 + 1e-9
        assert _true_seconds(step.features) > 0.25              # most of the step is used (work-conserving)
        for item in step.outputs["rag"].scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        composer.observe(step, _true_seconds(step.features))
    # half of ttft_ms shorter than itl_ms: it bounds the idle step
    tight = _make_composer(LatencySLO(ttft_ms=100, itl_ms=80))
    tight.schedulers["rag"].add(_make_seq(0, 16000))
    step = tight.schedule()
    assert step.target_seconds == pytest.approx(0.05)
    assert 0 < step.features.num_prefill_tokens < 300 and step.predicted_seconds <= 0.05


def test_no_interactive_pool_means_plain_chunked_prefill():
    composer = _make_composer(slo=None)
    composer.schedulers["rag"].add(_make_seq(0, 6000))
    composer.schedulers["chat"].add(_make_seq(1, 3000))
    out = _run_step(composer)
    assert out == {"chat": [2048], "rag": [2048]}
    assert composer.stats.num_targeted_steps == 0


def test_cold_start_grows_the_chunk_from_measured_steps():
    composer = _make_composer(trained=False)
    composer.schedulers["rag"].add(_make_seq(0, 16000))
    chunks = [sum(_run_step(composer)["rag"]) for _ in range(5)]
    assert chunks[0] == COLD_START_TOKENS
    assert chunks[1] <= 2 * COLD_START_TOKENS           # never more than twice what it has measured
    assert all(b <= 2 * max(COLD_START_TOKENS, a) for a, b in zip(chunks, chunks[1:]))


def test_an_overloaded_interactive_pool_slows_the_throughput_pool_but_never_stops_it():
    # the target is below what a step costs at all: rag may still add a tenth of it to each step
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=4))
    chat, rag = composer.schedulers["chat"], composer.schedulers["rag"]
    chat.add(_make_seq(0, 20, max_tokens=10_000))
    rag.add(_make_seq(1, 5000))
    _run_step(composer)
    for _ in range(5):
        chat_only = StepFeatures()
        chat_only.add(chat.running[0].num_computed_tokens, 1, True)
        step = composer.schedule()
        rag_tokens = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        assert rag_tokens >= 1
        added = step.predicted_seconds - composer.cost_model.predict(chat_only)
        assert added <= 0.1 * 0.004 + 1e-12
        _finish_step(composer, step)

    # a target so small that not even one rag token fits its tenth: one block after every starvation run
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=1))
    composer.schedulers["chat"].add(_make_seq(0, 20, max_tokens=10_000))
    composer.schedulers["rag"].add(_make_seq(1, 5000))
    rag_steps = [sum(_run_step(composer)["rag"]) for _ in range(3 * STARVATION_STEPS)]
    assert rag_steps.count(0) >= 2 * STARVATION_STEPS
    assert sum(1 for n in rag_steps if n) >= 2 and max(rag_steps) == 16


def test_a_throughput_only_step_may_spend_its_fixed_cost_again_on_work():
    composer = _make_composer(LatencySLO(ttft_ms=4, itl_ms=2))        # idle target 2 ms < the 5 ms fixed cost
    composer.schedulers["rag"].add(_make_seq(0, 16000))
    step = composer.schedule()
    assert step.target_seconds == pytest.approx(0.002)
    assert step.features.num_prefill_tokens > 10                         # ~5 ms of work at 0.2 ms a token
    assert step.predicted_seconds <= 2 * 0.005 + 1e-9


def test_slo_validation_names_the_field():
    with pytest.raises(ConfigError, match="slo.itl_ms"):
        LatencySLO(ttft_ms=100, itl_ms=0)
    with pytest.raises(ConfigError, match="slo.ttft_ms"):
        LatencySLO(ttft_ms="fast", itl_ms=10)
    with pytest.raises(ConfigError, match="slo"):
        PoolConfig(name="chat", slo={"ttft_ms": 1})


# --- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-composer"), "llama", builtin_path)


def test_a_squeezed_throughput_pool_gives_the_same_greedy_outputs(tiny):
    rng = random.Random(3)
    chat_prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    rag_prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(150, 300))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    alone = LLMEngine(EngineConfig(model=str(tiny), cache=CacheConfig(block_size=8),
                                   pools=(PoolConfig(num_blocks=400),)), progress=False)
    expected = [o.outputs[0].token_ids for o in alone.generate(chat_prompts + rag_prompts, params)]

    # chat's 1 ms ITL target is below any step: rag gets nothing, then one block after each starvation run
    pools = (PoolConfig(name="chat", num_blocks=150, slo=LatencySLO(ttft_ms=1000, itl_ms=1)),
             PoolConfig(name="rag", num_blocks=250))
    engine = LLMEngine(EngineConfig(model=str(tiny), cache=CacheConfig(block_size=8), pools=pools),
                       progress=False)
    for i, prompt in enumerate(chat_prompts):
        engine.add_request(f"c{i}", prompt, params, pool="chat")
    for i, prompt in enumerate(rag_prompts):
        engine.add_request(f"r{i}", prompt, params, pool="rag")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    got = [final[f"c{i}"] for i in range(6)] + [final[f"r{i}"] for i in range(3)]
    assert got == expected
    assert engine.composer.stats.num_targeted_steps > 0
    assert_all_free(engine)
