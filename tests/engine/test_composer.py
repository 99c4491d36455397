"""The step composer and its step-cost model, on schedulers without a model (milliseconds), and one
engine-level check that squeezing a throughput pool keeps greedy outputs unchanged."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.composer import (COLD_START_TOKENS, MIN_PREFILL_CHUNK, STARVATION_SECONDS, StepComposer,
                             _next_prefill_remaining)
from engine.slo_feedback import HOLD_SECONDS, ITL_AIM, ITL_WINDOW_SECONDS, MIN_SCALE, UPDATE_SECONDS, SLOTracker
from engine.config import ConfigError, LatencySLO
from engine.sampling import SamplingParams as Params
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_cost import StepCostModel, StepFeatures, nonnegative_lstsq
from tests.conftest import assert_all_free, make_tiny_model

# a made-up device: 5 ms per step, 0.2 ms per prefill token, 1 ms per decode, 0.01 ms per 1024 pairs,
# 0.1 ms per 1024 keys read
TRUE_COEF = np.array([5e-3, 2e-4, 1e-3, 1e-5, 1e-4])


def _true_seconds(f: StepFeatures) -> float:
    return float(f.vector() @ TRUE_COEF)


def _make_seq(seq_id: int, num_tokens: int, max_tokens: int = 64) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(range(num_tokens)),
                    num_prompt_tokens=num_tokens, params=Params(), max_tokens=max_tokens, priority=0,
                    arrival_order=seq_id, generator=None)


def _make_composer(slo: LatencySLO | None = LatencySLO(ttft_ms=1000, itl_ms=50), *, trained: bool = True,
                   rag_budget: int = 2048, chat_seqs: int = 256, min_share: float = 0.0) -> StepComposer:
    """A chat pool (interactive with `slo`) and a rag pool on a made-up device; rag's `min_share` is 0
    unless a test is about it (the other tests see the target and pressure mechanics alone)."""
    chat = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=chat_seqs), BlockManager(256, 16),
                     4096, name="chat")
    rag = Scheduler(SchedulerConfig(max_num_batched_tokens=rag_budget), BlockManager(1024, 16, first_block=256),
                    16384, name="rag")
    composer = StepComposer({"chat": chat, "rag": rag}, {"chat": slo, "rag": None}, min_shares={"rag": min_share})
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


def _advance(composer: StepComposer, step, *, finish: bool = False) -> None:
    """Pretend the step's forward pass ran: tokens computed, a sequence at its end gets one more
    token (and, with `finish`, ends at its `max_tokens`)."""
    for name, out in step.outputs.items():
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if finish and seq.num_output_tokens >= seq.max_tokens:
                    composer.schedulers[name].finish(seq, FinishReason.LENGTH)


def _finish_step(composer: StepComposer, step) -> None:
    """`_advance` the step and let the composer observe the made-up device's time for it."""
    _advance(composer, step)
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
    np.testing.assert_allclose(list(model.linear.coefficients().values()), [*TRUE_COEF, 0],   # no knee
                               rtol=1e-6, atol=1e-9)
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
        assert step.target_seconds == pytest.approx(ITL_AIM * 0.050)      # planned at the aim, not the SLO
        assert step.predicted_seconds <= ITL_AIM * 0.050 * composer.cost_model.margin + 1e-9
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
    # chat's fifteen decodes alone fill the 20 ms target: rag may still add a tenth of it to each step
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=20))
    chat, rag = composer.schedulers["chat"], composer.schedulers["rag"]
    for i in range(3):
        rag.add(_make_seq(10 + i, 2, max_tokens=10_000))
    _run_step(composer)
    for i in range(15):
        chat.add(_make_seq(i, 20, max_tokens=10_000))
    _run_step(composer)
    for _ in range(5):
        chat_only = StepFeatures()
        for seq in chat.running:
            chat_only.add(seq.num_computed_tokens, 1, True)
        step = composer.schedule()
        rag_tokens = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        assert rag_tokens >= 1 and step.pressed == ()
        added = step.predicted_seconds - composer.cost_model.predict(chat_only)
        assert added <= 0.1 * 0.020 + 1e-12
        _finish_step(composer, step)

    # a target below any step: rag gets nothing while chat runs, not even the starvation block (it
    # would break the SLO); it runs once chat is done
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=1))
    composer.cost_model.observe = lambda *args: None   # hundreds of decode-only steps would refit prefill to free
    composer.schedulers["chat"].add(_make_seq(0, 20, max_tokens=10_000))
    composer.schedulers["rag"].add(_make_seq(1, 5000))
    rag_steps, elapsed = [], 0.0
    while elapsed < 3 * STARVATION_SECONDS:
        step = composer.schedule()
        rag_steps.append(sum(i.num_new_tokens for i in step.outputs["rag"].scheduled))
        elapsed += _true_seconds(step.features)
        _finish_step(composer, step)
    assert rag_steps == [0] * len(rag_steps) and composer.schedulers["chat"].running
    chat = composer.schedulers["chat"]
    chat.finish(chat.running[0], FinishReason.LENGTH)
    assert sum(_run_step(composer)["rag"]) > 16


def test_a_throughput_only_step_may_spend_its_fixed_cost_again_on_work():
    composer = _make_composer(LatencySLO(ttft_ms=4, itl_ms=2))        # idle target 2 ms < the 5 ms fixed cost
    composer.schedulers["rag"].add(_make_seq(0, 16000))
    step = composer.schedule()
    assert step.target_seconds == pytest.approx(0.002)
    assert step.features.num_prefill_tokens > 10                         # ~5 ms of work at 0.2 ms a token
    assert step.predicted_seconds <= 2 * 0.005 + 1e-9


def _rag_seconds(composer: StepComposer, step) -> float:
    """What the throughput pool added to the step's predicted time."""
    interactive = StepFeatures()
    interactive.add_scheduled(step.outputs["chat"].scheduled)
    return composer.cost_model.predict(step.features) - composer.cost_model.predict(interactive)


def _decoding_chat(composer: StepComposer, count: int) -> None:
    """`count` chat sequences past their prefill, and a long rag prompt under way."""
    for i in range(count):
        composer.schedulers["chat"].add(_make_seq(i, 40, max_tokens=10_000))
    composer.schedulers["rag"].add(_make_seq(100, 16000))
    _run_step(composer)


def test_beside_interactive_decodes_a_throughput_chunk_rides_when_it_fits_and_is_never_a_crumb():
    """Chat's two decodes take ~7 ms of the made-up device. With itl_ms 20 (an 18 ms target: the
    aim) rag's prompt rides in the same step; with 10 (9 ms) what is left fits under
    `MIN_PREFILL_CHUNK` tokens, and a chunk that small is dropped (it would pay for its whole cached
    context for a few tokens)."""
    for itl_ms, rides in ((20, True), (10, False)):
        composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=itl_ms))
        _decoding_chat(composer, 2)
        step = composer.schedule()
        assert step.pressed == () and len(step.outputs["chat"].scheduled) == 2
        rag = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        fitting = composer._fitting_tokens(composer.schedulers["rag"], _chat_features(step), step.target_seconds, 2048)
        if rides:
            assert rag == fitting >= MIN_PREFILL_CHUNK
        else:
            assert rag == 0 and 0 < fitting < MIN_PREFILL_CHUNK


def _chat_features(step) -> StepFeatures:
    f = StepFeatures()
    f.add_scheduled(step.outputs["chat"].scheduled)
    return f


def test_a_queued_interactive_request_puts_the_throughput_pool_at_its_floor():
    composer = _make_composer(chat_seqs=4)
    _decoding_chat(composer, 2)
    calm = composer.schedule()                   # two decodes, nothing waiting: rag fills the 50 ms target
    assert calm.pressed == () and _rag_seconds(composer, calm) > 0.02
    _finish_step(composer, calm)
    for i in range(3):                           # four slots: two more run, one waits for a slot
        composer.schedulers["chat"].add(_make_seq(10 + i, 40, max_tokens=10_000))
    rag_tokens, elapsed = [], 0.0
    while elapsed < 2 * STARVATION_SECONDS:
        step = composer.schedule()
        assert step.pressed == ("chat",)
        rag_tokens.append(sum(i.num_new_tokens for i in step.outputs["rag"].scheduled))
        elapsed += _true_seconds(step.features)
        _finish_step(composer, step)
    assert composer.stats.num_pressed_steps == 1 + len(rag_tokens)    # the first chat prefills, then the queue
    assert rag_tokens == [0] * len(rag_tokens)            # not even the starvation block


def test_the_step_that_carries_an_interactive_prefill_is_pressed_and_the_next_is_not():
    composer = _make_composer()
    _decoding_chat(composer, 2)
    composer.schedulers["chat"].add(_make_seq(50, 60))
    prefill = composer.schedule()
    assert prefill.pressed == ("chat",) and [i.num_new_tokens for i in prefill.outputs["chat"].scheduled][-1] == 60
    assert not prefill.outputs["rag"].scheduled           # the prefill step costs what it costs with chat alone
    _finish_step(composer, prefill)
    after = composer.schedule()
    assert after.pressed == () and _rag_seconds(composer, after) > 0.02


def test_a_pool_near_its_max_num_seqs_or_with_a_gateway_queue_is_pressed():
    composer = _make_composer(chat_seqs=4)
    _decoding_chat(composer, 3)                  # 3 of 4 slots: one burst from queueing
    assert composer.schedule().pressed == ("chat",)
    composer = _make_composer(chat_seqs=8)
    _decoding_chat(composer, 3)
    step = composer.schedule()
    assert step.pressed == ()
    _finish_step(composer, step)
    composer.set_external_waiting("chat", 2)     # two requests wait for KV credits at the gateway
    composer.set_external_waiting("rag", 5)      # a throughput pool's queue presses nothing
    assert composer.schedule().pressed == ("chat",)


def test_a_paused_request_presses_nothing_but_holds_its_slot():
    # A request whose client reads too slowly is paused: waiting (or mid-prefill) it waits for its
    # client, not for the device, so rag keeps its step; its running sequences still fill chat's slots.
    composer = _make_composer(chat_seqs=8)
    _decoding_chat(composer, 2)
    chat = composer.schedulers["chat"]
    chat.add(_make_seq(50, 60))
    chat.pause("r50", True)
    step = composer.schedule()
    assert step.pressed == () and _rag_seconds(composer, step) > 0.02
    _finish_step(composer, step)
    chat.pause("r50", False)
    assert composer.schedule().pressed == ("chat",)          # resumed: its prefill is due
    composer = _make_composer(chat_seqs=4)
    _decoding_chat(composer, 3)
    composer.schedulers["chat"].pause("r0", True)
    assert composer.schedule().pressed == ("chat",)          # 3 of 4 slots held, one of them paused


def test_a_pool_pressed_only_by_paused_requests_leaves_the_throughput_pools_their_step():
    """Chat's 3 of 4 slots are held by paused requests and it runs nothing: it is pressed (one burst from
    queueing), but it waits for its clients, not for the device; rag keeps its step (it was cut to one block of
    16 tokens a step for as long as the clients read). One request resumed: rag drops to its floor again."""
    composer = _make_composer(chat_seqs=4)
    _decoding_chat(composer, 3)
    for i in range(3):
        composer.schedulers["chat"].pause(f"r{i}", True)
    step = composer.schedule()
    assert step.pressed == ("chat",) and not step.outputs["chat"].scheduled
    assert step.outputs["rag"].num_batched_tokens > 16 and _rag_seconds(composer, step) > 0.02
    _finish_step(composer, step)
    composer.schedulers["chat"].pause("r1", False)
    step = composer.schedule()
    assert step.pressed == ("chat",) and len(step.outputs["chat"].scheduled) == 1
    assert not step.outputs["rag"].scheduled


def test_a_prompt_short_of_the_blocks_paused_requests_hold_leaves_the_throughput_pools_their_step():
    """Chat's 256 blocks: a paused request holds 200, H (a 1,200-token prompt, 896 computed) the other 56. H is
    not paused but waits for the paused one's blocks: chat runs nothing, pressed by H's prefill; rag keeps its
    step (no rag step brings H's blocks sooner)."""
    composer = _make_composer(chat_seqs=8)
    chat = composer.schedulers["chat"]
    paused, held = _make_seq(0, 3201), _make_seq(1, 1200)
    for seq, computed in ((paused, 3200), (held, 896)):
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, computed
        chat.block_manager.allocate(seq.block_table, computed)
        chat.running.append(seq)
    chat.pause("r0", True)
    composer.schedulers["rag"].add(_make_seq(100, 16000))
    step = composer.schedule()
    assert step.pressed == ("chat",) and not step.outputs["chat"].scheduled
    assert step.outputs["rag"].num_batched_tokens > 16 and _rag_seconds(composer, step) > 0.02


def test_the_cost_estimate_reads_the_prefill_the_next_step_would_run():
    """A paused request at the head of the queue is passed by: the prefill the composer prices (its context
    and what is left of it) is the next unpaused one's, as the scheduler would run it; a running sequence whose
    last token is in flight (it takes no step) is no decode of the next step."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=2048), BlockManager(256, 16), 4096)
    scheduler.add(_make_seq(1, 3000))
    scheduler.add(_make_seq(2, 40))
    scheduler.pause("r1", True)
    assert _next_prefill_remaining(scheduler) == 40 and scheduler.next_prefill().seq_id == 2
    out = scheduler.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [2]          # what the estimate priced
    ending = scheduler.running[0]
    ending.num_computed_tokens, ending.max_tokens = 40, 1
    ending.add_pending(0)                                        # its one output token in flight
    scheduler.pause("r1", False)
    assert scheduler.pending_work() == ([], 0) and _next_prefill_remaining(scheduler) == 3000


def test_an_interactive_pool_chunks_its_own_long_prompt_so_its_decodes_keep_the_itl_target():
    composer = _make_composer()
    _decoding_chat(composer, 4)
    composer.schedulers["chat"].add(_make_seq(60, 3000))
    chunks = []
    for _ in range(4):
        step = composer.schedule()
        chat = [i.num_new_tokens for i in step.outputs["chat"].scheduled]
        assert chat[:4] == [1, 1, 1, 1]          # every running decode still gets its token
        assert step.predicted_seconds <= 0.050 * composer.cost_model.margin + 1e-9 + 0.1 * 0.05
        chunks.append(chat[4])
        _finish_step(composer, step)
    assert 16 <= min(chunks) and max(chunks) < 300
    # with nothing decoding, a lone prompt is prefilled in one piece (its TTFT is what matters)
    alone = _make_composer()
    alone.schedulers["chat"].add(_make_seq(0, 1500))
    assert [i.num_new_tokens for i in alone.schedule().outputs["chat"].scheduled] == [1500]


@pytest.mark.parametrize("voice_first", [True, False])
def test_one_interactive_pools_prompt_keeps_anothers_tighter_itl_target(voice_first):
    """Two pools with an `slo` on one device: voice (itl 30 ms) decodes, chat (itl 100 ms) gets a long prompt.
    Chat's prefill is sized to voice's target beside voice's decodes, whichever pool is scheduled first: it
    took its whole max_num_batched_tokens (about 0.42 s on this device) while nothing of its own decoded."""
    def pool(name: str) -> Scheduler:
        first = 0 if name == "voice" else 256
        return Scheduler(SchedulerConfig(max_num_batched_tokens=2048), BlockManager(256, 16, first_block=first),
                         4096, name=name)
    slos = {"voice": LatencySLO(ttft_ms=1000, itl_ms=30), "chat": LatencySLO(ttft_ms=1000, itl_ms=100)}
    names = ["voice", "chat"] if voice_first else ["chat", "voice"]
    composer = StepComposer({n: pool(n) for n in names}, {n: slos[n] for n in names})
    _train(composer.cost_model)
    idle = StepComposer({n: pool(n) for n in names}, {n: slos[n] for n in names})
    _train(idle.cost_model)
    idle.schedulers["chat"].add(_make_seq(20, 3000))
    idle.schedulers["voice"].add(_make_seq(21, 3000))
    step = idle.schedule()   # nothing decodes: each lone prefill in one piece, beside the other's
    assert [sum(i.num_new_tokens for i in step.outputs[n].scheduled) for n in ("chat", "voice")] == [2048, 2048]
    for i in range(4):
        composer.schedulers["voice"].add(_make_seq(i, 40, max_tokens=10_000))
    _run_step(composer)
    composer.schedulers["chat"].add(_make_seq(10, 3000))
    for _ in range(3):
        step = composer.schedule()
        assert [i.num_new_tokens for i in step.outputs["voice"].scheduled] == [1, 1, 1, 1]
        chunk = sum(i.num_new_tokens for i in step.outputs["chat"].scheduled)
        assert 16 <= chunk < 300
        assert step.predicted_seconds <= 0.030 * composer.cost_model.margin + 1e-9 + 0.1 * 0.03
        _finish_step(composer, step)


def test_the_itl_feedback_squeezes_throughput_work_but_not_the_interactive_pools_own_prompts():
    """Misses of the ITL aim (in a split layout mostly the throughput chunks' doing) shrink the step
    target, hence the rag chunks; the chat pool's own prompt is still chunked against `ITL_AIM` of its
    `itl_ms`, as with chat alone, so its time to first token does not grow with the feedback."""
    chunks, rag = {}, {}
    for squeezed in (False, True):
        composer = _make_composer()
        _decoding_chat(composer, 4)
        if squeezed:
            composer.trackers["chat"].itl.scale = MIN_SCALE
        composer.schedulers["chat"].add(_make_seq(60, 3000))
        step = composer.schedule()
        chunks[squeezed] = step.outputs["chat"].scheduled[4].num_new_tokens
        calm = _make_composer()
        _decoding_chat(calm, 4)
        if squeezed:
            calm.trackers["chat"].itl.scale = MIN_SCALE
        rag[squeezed] = _rag_seconds(calm, calm.schedule())
    assert chunks[True] == chunks[False] > 16
    assert step.predicted_seconds <= ITL_AIM * 0.050 * composer.cost_model.margin + 1e-9
    assert rag[True] < rag[False]


def test_keys_read_count_each_sequences_context_once_per_step():
    f = StepFeatures()
    f.add(3000, 13, False)                       # a 13-token chunk after 3,000 cached tokens
    f.add(150, 1, True)                          # a decode after 150
    assert f.num_keys_read == 3013 + 151
    assert f.num_attended == 13 * 3000 + 13 * 14 // 2 + 151
    assert f.plus(f).num_keys_read == 2 * (3013 + 151)


# the CPU of the 2026-11-25 step trace, roughly: 32 ms a step, 1.3 ms a prefill token, 2.6 ms a decode,
# 0.16 ms per 1024 query-key pairs, and 15 ms per 1024 keys read (each sequence's context, every step)
CPU_COEF = np.array([32e-3, 1.3e-3, 2.6e-3, 0.16e-3, 15e-3])


def test_a_long_context_throughput_history_does_not_cut_the_interactive_pools_prompt_into_crumbs():
    """Beside a rag prompt with 3,000 cached tokens the composer's model sees mostly rag steps: small
    chunks and decodes that each read the long context. Without a keys-read term a fit charges that
    context to the decode and prefill tokens, predicts a chat step of one decode and 16 prompt tokens
    at about twice its time, and chat's own ~60-token prompts go through in 16-token pieces (the chat
    TTFT misses of that trace). With it, chat's chunk is what truly fits its `ITL_AIM`."""
    def seconds(f: StepFeatures) -> float:
        work = [1, f.num_prefill_tokens, f.num_decode_tokens, f.num_attended / 1024, f.num_keys_read / 1024]
        return float(np.dot(work, CPU_COEF))

    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=100))
    composer.cost_model = StepCostModel()
    rng = random.Random(3)
    for i in range(256):                         # the recorded regime: rag chunks and decodes, a few chat steps
        f = StepFeatures()
        kind = i % 8
        if kind < 5:
            f.add(rng.randrange(2000, 3200), rng.randrange(12, 66), False)
        elif kind < 7:
            f.add(rng.randrange(2900, 3200), 1, True)
            if kind == 6:
                f.add(rng.randrange(60, 200), 1, True)
        else:
            f.add(0, rng.randrange(60, 150), False)
        composer.cost_model.observe(f, seconds(f))
    chat = composer.schedulers["chat"]
    decoding = _make_seq(0, 60, max_tokens=10_000)
    chat.add(decoding)
    _run_step(composer)                          # its prefill; from now on it decodes
    chat.add(_make_seq(1, 64))
    step = composer.schedule()
    chunk = step.outputs["chat"].scheduled[1].num_new_tokens
    fits = [n for n in range(1, 65) if seconds(_with_chunk(decoding, n)) <= ITL_AIM * 0.100]
    assert chunk >= 0.9 * max(fits) > 2 * chat.block_manager.block_size


def _with_chunk(decoding: Sequence, num_new: int) -> StepFeatures:
    f = StepFeatures()
    f.add(decoding.num_computed_tokens, 1, True)
    f.add(0, num_new, False)
    return f


def _drive(tracker: SLOTracker, t: float, seconds: float, gap: float, *, shared: bool = True) -> float:
    """Steps of `gap` seconds, each with one of the pool's decodes, for `seconds`; returns the clock."""
    end = t + seconds - 1e-9
    while t < end:
        t += gap
        tracker.observe_step(True, True, t, shared)
    return t


def test_the_slo_tracker_shrinks_the_target_on_a_miss_and_grows_it_back():
    tracker = SLOTracker(LatencySLO(ttft_ms=1000, itl_ms=100))
    # inter-token gaps of 150 ms (p99 1.67x its 90 ms aim): one update, at most MAX_DECREASE
    t = _drive(tracker, 0.0, UPDATE_SECONDS + 0.3, 0.150)
    assert tracker.scale == tracker.itl.scale == pytest.approx(0.7)
    assert tracker.ttft.scale == 1.0             # no first token seen: TTFT says nothing
    t = _drive(tracker, t, HOLD_SECONDS - UPDATE_SECONDS, 0.150)   # held while the window catches up
    assert tracker.scale == pytest.approx(0.7) and tracker.num_decreases == 1
    t = _drive(tracker, t, 4 * HOLD_SECONDS, 0.150)
    assert tracker.scale == MIN_SCALE
    # the gaps fall to 30 ms: the window forgets, the scale recovers (15 steps of 0.05 after it has)
    t = _drive(tracker, t, 1.5 * ITL_WINDOW_SECONDS + 16 * UPDATE_SECONDS, 0.030)
    assert tracker.scale == 1.0
    slow_first_tokens = SLOTracker(LatencySLO(ttft_ms=400, itl_ms=100))
    for _ in range(4):
        slow_first_tokens.observe_first_token(0.5)   # over TTFT_AIM of ttft_ms
    for i in range(3):
        slow_first_tokens.observe_step(False, True, i * UPDATE_SECONDS)
    assert slow_first_tokens.scale < 1 and not slow_first_tokens.itls
    assert slow_first_tokens.itl.scale == 1.0    # the pool's own chunks are not squeezed for TTFT


def test_the_slo_feedback_and_its_holds_behave_the_same_when_every_step_is_ten_times_faster():
    """Updates, holds and the ITL window are in seconds: a device whose steps (and SLO) are 10x shorter
    moves the scale at the same times, through a miss, holds, a squeeze to the floor and a recovery,
    in ten times the steps."""
    def trajectory(speed: float) -> list[float]:
        tracker = SLOTracker(LatencySLO(ttft_ms=1000 / speed, itl_ms=100 / speed))
        t, scales = 0.0, []
        for seconds, gap in ((30.0, 0.150), (40.0, 0.027)):   # 1.67x the 90 ms aim, then 0.3x (over 10 if fast)
            for _ in range(int(seconds / 0.5)):
                t = _drive(tracker, t, 0.5, gap / speed)
                scales.append(round(tracker.scale, 6))
        return scales

    slow, fast = trajectory(1), trajectory(10)
    assert min(slow) == MIN_SCALE and slow[-1] == fast[-1] == 1.0   # squeezed to the floor, then recovered
    # the same path in time: each sample (every 0.5 s) is one the other passes within a second (150 ms
    # steps land their updates every 0.9 s, 15 ms ones every 0.81 s)
    for a, b in ((slow, fast), (fast, slow)):
        assert all(x in b[max(0, i - 2):i + 3] for i, x in enumerate(a))


def test_the_slo_feedback_counts_only_the_latencies_throughput_work_shares_in():
    """Gaps and first tokens with no throughput work in them are the pool's own doing: they move no
    scale. A miss that throughput work shares in shrinks the scale once; when no shared sample comes
    for `HOLD_SECONDS` the scale grows back though the old miss is still in the window."""
    tracker = SLOTracker(LatencySLO(ttft_ms=1000, itl_ms=100))
    t = 0.0
    for _ in range(160):                         # the pool's own 150 ms steps, its own 2 s queue
        t += 0.150
        tracker.observe_step(True, True, t, shared=False)
        tracker.observe_first_token(2.0, shared=False)
    assert tracker.scale == 1.0 and not tracker.itls and not tracker.ttfts
    t = _drive(tracker, t, UPDATE_SECONDS + 0.3, 0.150)   # the same gaps with a throughput chunk in each
    assert tracker.scale == pytest.approx(0.7) and tracker.num_decreases == 1
    t = _drive(tracker, t, HOLD_SECONDS + 4 * UPDATE_SECONDS, 0.150, shared=False)   # no throughput work now
    assert tracker.ratios()[1] > 1              # the window still shows the miss
    assert tracker.scale > 0.7 and tracker.num_decreases == 1


def test_an_old_miss_still_in_the_window_does_not_shrink_the_scale_again():
    """One 3 s gap among 100 ms ones keeps the window's p99 over the aim for a while; the scale shrinks
    once for it, not again each time the hold runs out."""
    tracker = SLOTracker(LatencySLO(ttft_ms=1000, itl_ms=200))
    tracker.observe_step(True, True, 0.1)
    tracker.observe_step(True, True, 3.1)
    _drive(tracker, 3.1, HOLD_SECONDS + 3 * UPDATE_SECONDS, 0.100)
    assert tracker.ratios()[1] > 1 and tracker.num_decreases == 1


def test_a_first_token_counts_for_ttft_only_if_throughput_work_ran_while_it_waited():
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=100))
    composer.schedulers["rag"].add(_make_seq(0, 4000))
    step = composer.schedule()
    assert step.throughput_tokens == sum(i.num_new_tokens for i in step.outputs["rag"].scheduled) > 0
    composer.observe(step, 0.1, ended_at=10.0)
    composer.schedulers["chat"].add(_make_seq(1, 40))
    chat_only = composer.schedule()              # chat's prefill presses rag to its floor
    assert chat_only.throughput_tokens == 0
    composer.observe(chat_only, 0.1, ended_at=10.3)
    composer.observe_first_token("chat", 0.2, ended_at=10.3)    # arrived at 10.1, after the rag step
    assert not composer.trackers["chat"].ttfts
    composer.observe_first_token("chat", 0.5, ended_at=10.3)    # arrived at 9.8: the rag step delayed it
    assert list(composer.trackers["chat"].ttfts) == [0.5]


def test_misses_the_interactive_pool_makes_alone_do_not_starve_the_throughput_pool():
    """A device where chat's own steps (its prefills between its decodes) run 150 ms, over `ITL_AIM`
    of its 100 ms: counted, those gaps would ratchet the target to `MIN_SCALE` and leave rag crumbs
    beside chat. Only gaps with rag in them count, so the target stays where mixed steps keep the aim.
    (The stalls stay out of the cost model: the test is about the feedback, not the fit.)"""
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=100))
    composer.cost_model.observe = lambda *args: None
    rag = composer.schedulers["rag"]
    t, rag_tokens = 0.0, 0
    for i in range(600):
        if i % 8 == 0:
            composer.schedulers["chat"].add(_make_seq(1 + i, 60, max_tokens=12))
        if not rag.num_unfinished:
            rag.add(_make_seq(10_000 + i, 8000, max_tokens=4))
        step = composer.schedule()
        seconds = _true_seconds(step.features) if step.throughput_tokens else 0.150
        _advance(composer, step, finish=True)
        t += seconds
        composer.observe(step, seconds, ended_at=t)
        rag_tokens += step.throughput_tokens if i >= 300 else 0
    tracker = composer.trackers["chat"]
    assert not any(gap > 0.149 for gap in tracker.itls)
    assert tracker.scale > 0.5                   # counting chat's own gaps took it to MIN_SCALE
    assert rag_tokens > 150 * 300                # ~240 a step; at MIN_SCALE rag got ~60


def test_the_composer_target_follows_the_trackers_scale():
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=80))
    composer.schedulers["rag"].add(_make_seq(0, 16000))
    assert composer.schedule().target_seconds == pytest.approx(0.08)
    composer.trackers["chat"].ttft.scale = 0.5
    assert composer.schedule().target_seconds == pytest.approx(0.04)
    composer.trackers["chat"].itl.scale = 0.25
    assert composer.schedule().target_seconds == pytest.approx(0.02)


def test_mixed_steps_that_run_slower_than_predicted_shrink_the_room_of_the_next_chunks():
    composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=100))
    _decoding_chat(composer, 2)
    first = composer.schedule()
    assert first.mixed and composer.mixed_margin == 1.0
    before = sum(i.num_new_tokens for i in first.outputs["rag"].scheduled)
    for _ in range(10):                          # the device takes 1.5x the prediction for such steps
        step = composer.schedule()
        for out in step.outputs.values():
            for item in out.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
                if item.seq.num_computed_tokens == item.seq.num_tokens:
                    item.seq.token_ids.append(7)
        composer.observe(step, 1.5 * step.predicted_seconds)
    assert composer.mixed_margin == pytest.approx(1.5)
    after = composer.schedule()
    assert 0 < sum(i.num_new_tokens for i in after.outputs["rag"].scheduled) < 0.8 * before


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

    alone = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8),
                                   pools=(PoolConfig(num_blocks=400),)), progress=False)
    expected = [o.outputs[0].token_ids for o in alone.generate(chat_prompts + rag_prompts, params)]

    # chat's 1 ms ITL target is below any step: rag gets nothing, then one block after each starvation run
    pools = (PoolConfig(name="chat", num_blocks=150, slo=LatencySLO(ttft_ms=1000, itl_ms=1)),
             PoolConfig(name="rag", num_blocks=250))
    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8), pools=pools),
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


def _serve_queued_chat(tiny, chat_prompts, rag_prompts, params) -> tuple[list[list[int]], list[tuple[bool, list, int]]]:
    """Rag prompts under way, then six chat requests into a chat pool that runs two at a time; per
    step: whether chat had requests waiting, the pressed pools and rag's tokens. Rag has no min_share
    (the pressure mechanics alone)."""
    pools = (PoolConfig(name="chat", num_blocks=150, slo=LatencySLO(ttft_ms=1000, itl_ms=20),
                        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2048)),
             PoolConfig(name="rag", num_blocks=400, min_share=0.0))
    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8), pools=pools),
                       progress=False)
    model = engine.composer.cost_model = StepCostModel()   # the made-up device's costs, frozen: the
    _train(model)                                           # decisions do not depend on this machine's timing
    model.observe = lambda features, seconds: None
    for i, prompt in enumerate(rag_prompts):
        engine.add_request(f"r{i}", prompt, params, pool="rag")
    engine.step()
    for i, prompt in enumerate(chat_prompts):
        engine.add_request(f"c{i}", prompt, params, pool="chat")
    final, steps = {}, []
    while engine.has_unfinished_requests():
        queued = bool(engine.schedulers["chat"].waiting)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps.append((queued, engine.last_step.pressed, engine.last_step.pool_tokens.get("rag", 0)))
    assert_all_free(engine)
    return [final[f"c{i}"] for i in range(len(chat_prompts))] + [final[f"r{i}"] for i in range(len(rag_prompts))], steps


def test_an_engine_whose_chat_pool_queues_squeezes_rag_and_keeps_greedy_outputs(tiny, monkeypatch):
    rng = random.Random(5)
    chat_prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    rag_prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(300, 400))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8),
                                   pools=(PoolConfig(num_blocks=800),)), progress=False)
    expected = [o.outputs[0].token_ids for o in alone.generate(chat_prompts + rag_prompts, params)]

    outputs, steps = _serve_queued_chat(tiny, chat_prompts, rag_prompts, params)
    assert outputs == expected
    queued = [(pressed, tokens) for waiting, pressed, tokens in steps if waiting]
    assert len(queued) >= 2 * 24 - 8                      # two rounds of chat wait for a slot
    assert all(pressed == ["chat"] for pressed, _ in queued)

    # the control: the same load with pressure switched off (the composer before TTFT protection)
    monkeypatch.setattr(StepComposer, "_is_pressed", lambda self, name: False)
    control_outputs, control = _serve_queued_chat(tiny, chat_prompts, rag_prompts, params)
    assert control_outputs == expected
    squeezed = sum(tokens for _, tokens in queued[:40])
    unsqueezed = sum([tokens for waiting, _, tokens in control if waiting][:40])
    assert squeezed < 0.5 * unsqueezed, (squeezed, unsqueezed)


# --- min_share: a throughput pool's guaranteed part of the device ------------------------------------


def _rag_part(step) -> tuple[float, float]:
    """(the step's time on the made-up device, rag's part of it): the step's time divided among the pools
    in proportion to what each adds to it (chat's work first, then rag's), measured on the true costs."""
    chat = _chat_features(step)
    total = _true_seconds(step.features)
    chat_work = _true_seconds(chat) - _true_seconds(StepFeatures())
    rag_work = total - _true_seconds(chat)
    return total, total * rag_work / (chat_work + rag_work) if chat_work + rag_work else 0.0


def _pressed_trace(min_share: float, steps: int = 400) -> list[tuple[float, float, int]]:
    """Chat pressed throughout (8 long decodes for 4 slots: some always wait) beside a long rag prompt
    and, once read, its decode: per step (seconds, rag's part, rag's tokens)."""
    composer = _make_composer(chat_seqs=4, min_share=min_share)
    for i in range(8):
        composer.schedulers["chat"].add(_make_seq(i, 40, max_tokens=10_000))
    composer.schedulers["rag"].add(_make_seq(100, 6000, max_tokens=10_000))
    trace = []
    for _ in range(steps):
        step = composer.schedule()
        assert step.pressed == ("chat",)
        seconds, part = _rag_part(step)
        trace.append((seconds, part, sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)))
        _finish_step(composer, step)
    return trace


def test_a_pressed_interactive_pool_leaves_a_throughput_pool_its_min_share_of_step_time():
    trace = _pressed_trace(0.2)
    seconds = sum(s for s, _, _ in trace)
    assert sum(p for _, p, _ in trace) / seconds >= 0.2 * 0.97
    # over any 2 s of steps after the first window, the share holds too (not one burst then nothing)
    window, parts, lowest = [], 0.0, 1.0
    for s, p, _ in trace:
        window.append((s, p))
        parts += p
        while sum(w for w, _ in window[1:]) >= 2.0:
            parts -= window.pop(0)[1]
        if sum(w for w, _ in window) >= 2.0:
            lowest = min(lowest, parts / sum(w for w, _ in window))
    assert lowest >= 0.2 * 0.9
    # held at its floor, rag never stops for long: at most a few ~10 ms steps in a row
    longest, run = 0.0, 0.0
    for s, _, tokens in trace[len(trace) // 2:]:
        run = run + s if not tokens else 0.0
        longest = max(longest, run)
    assert longest <= 0.1
    # without the guarantee the same trace starves rag entirely
    assert sum(t for _, _, t in _pressed_trace(0.0, steps=100)) == 0


def test_a_throughput_pool_above_its_share_yields_to_a_pressed_pool_until_its_share_falls_to_the_floor():
    composer = _make_composer(chat_seqs=4, min_share=0.2)
    composer.schedulers["rag"].add(_make_seq(100, 6000, max_tokens=10_000))
    for _ in range(20):                        # rag alone: its share of the window is 1
        _run_step(composer)
    assert composer.share("rag") == pytest.approx(1.0)
    for i in range(8):                         # chat floods in: pressed from now on
        composer.schedulers["chat"].add(_make_seq(i, 40, max_tokens=10_000))
    stopped, elapsed = 0.0, 0.0
    while True:
        step = composer.schedule()
        rag = sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)
        seconds = _true_seconds(step.features)
        _finish_step(composer, step)
        elapsed += seconds
        if rag:
            break
        stopped += seconds
    # rag stopped while its share fell from 1 to 0.2: at most (1 - 0.2) x the 2 s window of step time
    assert 0 < stopped <= (1 - 0.2) * 2.0 + 0.1 and composer.share("rag") < 0.2 + 0.05
    assert composer.stats.num_owed_steps >= 1


def test_an_owed_throughput_pool_skips_a_lone_prefill_step_and_rides_lasting_pressure():
    """A chat prefill step alone (the next step is calm) costs what it costs with chat alone even
    while rag is owed its share: the share is kept over the window, by the steps around it. Pressure
    that lasts a second step is chat's steady state: rag rides then."""
    composer = _make_composer(chat_seqs=4, min_share=0.2)
    _decoding_chat(composer, 2)                  # chat's prefill: rag got nothing, it is owed
    _run_step(composer)                          # a calm step, after which rag is still under its share
    composer._share_seconds["rag"] = 0.0
    assert composer._is_owed("rag")
    composer.schedulers["chat"].add(_make_seq(50, 60))
    prefill = composer.schedule()
    assert prefill.pressed == ("chat",) and prefill.owed == () and not prefill.outputs["rag"].scheduled
    _finish_step(composer, prefill)
    for i in range(2):                           # four slots, three running: one waits, pressure lasts
        composer.schedulers["chat"].add(_make_seq(60 + i, 60, max_tokens=10_000))
    first = composer.schedule()
    _finish_step(composer, first)
    lasting = composer.schedule()
    assert first.pressed == lasting.pressed == ("chat",)
    assert lasting.owed == ("rag",) and lasting.outputs["rag"].scheduled


def test_owed_tokens_are_no_feedback_sample_for_the_interactive_pools_scales():
    """Tokens a throughput pool gets because it is owed its share are the guarantee's: no cut of the
    target removes them, so a step carrying only those is not a shared latency sample. Counted, the
    misses they cause shrank the target, rag got less by the target, fell under its share, was owed
    more: a spiral that left it its min_share and nothing more."""
    composer = _make_composer(min_share=0.2)
    _decoding_chat(composer, 2)                  # chat's prefill: rag got nothing, it is owed
    owed = composer.schedule()
    assert owed.owed == ("rag",) and owed.throughput_tokens > 0 and owed.targeted_tokens == 0
    _advance(composer, owed)
    tracker = composer.trackers["chat"]
    composer.observe(owed, 0.5, ended_at=1.0)    # a slow step: 0.5 s against a 45 ms aim
    composer.observe(owed, 0.5, ended_at=1.5)
    assert not tracker.itls                      # not sampled
    composer._share_seconds["rag"] = composer._window_seconds   # rag above its share: no longer owed
    calm = composer.schedule()
    assert calm.owed == () and calm.targeted_tokens == calm.throughput_tokens > 0
    _advance(composer, calm)
    composer.observe(calm, 0.5, ended_at=2.0)
    assert list(tracker.itls) == [0.5]           # the target let these in: a sample


def test_an_idle_interactive_pools_squeezed_scale_grows_back_while_the_throughput_pool_runs_alone():
    """A flood squeezed chat's target; chat then has nothing to send. Its scale grows back by SCALE_STEP
    per UPDATE_SECONDS after HOLD_SECONDS without samples, counting steps without chat's work and the
    time the device sat idle, so rag alone is not composed to the squeezed target for ever."""
    tracker = SLOTracker(LatencySLO(ttft_ms=1000, itl_ms=100))
    t = _drive(tracker, 0.0, 4 * HOLD_SECONDS, 0.150)          # squeezed to the floor
    assert tracker.scale == MIN_SCALE
    for _ in range(int((HOLD_SECONDS + 20 * UPDATE_SECONDS) / 0.1)):   # rag's steps, no chat work
        t += 0.1
        tracker.observe_step(False, False, t)
    assert tracker.scale == 1.0
    squeezed = SLOTracker(LatencySLO(ttft_ms=1000, itl_ms=100))
    t = _drive(squeezed, 0.0, 4 * HOLD_SECONDS, 0.150)
    squeezed.observe_step(False, False, t + 60.0)              # the device sat idle for a minute
    squeezed.observe_step(False, False, t + 60.1)
    assert squeezed.scale == 1.0


def test_the_slo_probe_reads_the_calmest_stretch_of_a_busy_start():
    """The derived SLO's probe step (engine.calibration.measure_decode_step) is measured while the server
    starts: slow first steps (kernels loading, a GPU at its idle clock) and a busy stretch later only add
    time, so untimed steps run for DERIVE_WARM_SECONDS and the step is the smallest round median."""
    from types import SimpleNamespace

    from engine import calibration

    assert (calibration.DERIVE_WARM_SECONDS, calibration.DERIVE_WARM_STEPS, calibration.DERIVE_ROUNDS,
            calibration.DERIVE_STEPS) == (0.5, 20, 5, 3)
    # 0.2 s steps (a cold start) for the three untimed steps and the first round, a busy second round,
    # a spike in the third, then the device's own 10 ms
    costs = [0.2] * 6 + [0.04, 0.04, 0.01] + [0.09, 0.01, 0.01] + [0.01] * 6
    now, calls = [0.0], []

    def execute(items):
        calls.append(len(items))
        now[0] += costs[len(calls) - 1]

    bm = BlockManager(64, 16)
    engine = SimpleNamespace(schedulers={"chat": SimpleNamespace(block_manager=bm)},
                             runner=SimpleNamespace(execute=execute, synchronize=lambda: None, release=lambda seq: None))
    assert calibration.measure_decode_step(engine, "chat", 4, 100, clock=lambda: now[0]) == pytest.approx(0.010)
    assert calls == [4] * len(costs)               # three untimed steps (0.6 s >= 0.5 s), five rounds of three
    assert bm.num_free_blocks == 64                 # the borrowed blocks are back
    costs[:] = [0.001] * 35                         # quick steps: 20 untimed ones, not half a second of them
    calls.clear()
    assert calibration.measure_decode_step(engine, "chat", 4, 100, clock=lambda: now[0]) == pytest.approx(0.001)
    assert len(calls) == 20 + 15
    assert calibration.measure_decode_step(engine, "chat", 20, 100) is None   # 20 x 7 blocks: more than the pool


def test_isolation_by_default_takes_its_slo_from_the_devices_measured_step(tiny):
    """A pool marked derive_slo runs with the SLO its device's own decode step gives (engine.calibration.derive_slo),
    reported in WorkerInfo; a pool with an explicit SLO keeps it."""
    from engine import calibration
    from engine.worker import worker_info

    chat = PoolConfig(name="chat", num_blocks=200, slo=LatencySLO(), derive_slo=True,
                      scheduler=SchedulerConfig(max_num_seqs=8))
    rag = PoolConfig(name="rag", num_blocks=200)
    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8),
                                    pools=(chat, rag)),
                       progress=False)
    slo, step, batch, context = engine.derived_slos["chat"]
    assert (batch, context) == (2, 200 // 8 * 8 - 1)              # a quarter of max_num_seqs at the formula's length
    # rag is a throughput pool owed the default min_share 0.2: the SLO keeps room for it
    assert slo.itl_ms == max(calibration.MIN_ITL_MS, math.ceil(calibration.ITL_STEPS * step / 0.8 * 1000))
    assert slo.ttft_ms == calibration.TTFT_ITLS * slo.itl_ms and engine.composer.slos["chat"] == slo
    assert engine.composer.trackers["chat"].slo == slo
    info = worker_info(engine)
    assert info.slos == {"chat": slo} and "decode step of 2 sequences at 199 tokens" in info.slo_derivations["chat"]
    assert all(s.block_manager.num_free_blocks == 200 for s in engine.schedulers.values())   # borrowed blocks back

    explicit = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", cache=CacheConfig(block_size=8),
                                      pools=(PoolConfig(name="chat", num_blocks=200, slo=LatencySLO(800, 60)), rag)),
                         progress=False)
    assert explicit.derived_slos == {} and explicit.composer.slos["chat"] == LatencySLO(800, 60)


def test_an_owed_pool_keeps_to_the_interactive_slo_until_it_has_waited_or_the_slo_is_lost_anyway():
    """Owed tokens stop where the step would break the running interactive pools' itl_ms: a chunk
    smaller than a block rides then (on the CPU a block after 2,900 cached tokens cost 90-120 ms beside
    chat's decodes, forced into every step). After `OWED_WAIT_SECONDS` of steps with nothing, or where
    chat's own work is already over its itl_ms, the owed pool gets its floor (a block) regardless."""
    from engine.composer import OWED_WAIT_SECONDS

    def owed_step(itl_ms: float, starved: float = 0.0, min_share: float = 0.2):
        composer = _make_composer(LatencySLO(ttft_ms=1000, itl_ms=itl_ms), chat_seqs=4, min_share=min_share)
        _decoding_chat(composer, 2)              # two chat decodes (~7 ms) beside a long rag prompt
        composer._share_seconds["rag"] = 0.0     # rag under its share: owed
        composer._starved["rag"] = starved
        step = composer.schedule()
        assert step.owed == ("rag",)
        return step, sum(i.num_new_tokens for i in step.outputs["rag"].scheduled)

    chat_alone = _true_seconds(_chat_features(owed_step(1000)[0]))
    assert 0.006 < chat_alone < 0.008
    kept, crumb = owed_step(9.0)                  # a block would be ~10 ms: a crumb keeps the 9 ms
    assert 0 < crumb < 16 and kept.predicted_seconds <= 0.009 and _true_seconds(kept.features) <= 0.009
    waited, block = owed_step(9.0, starved=OWED_WAIT_SECONDS)
    assert block == 16 and _true_seconds(waited.features) > 0.009
    _, big_share = owed_step(1000, min_share=0.6)   # a share of 0.6 beside chat's decodes: several blocks
    waited, block = owed_step(9.0, starved=OWED_WAIT_SECONDS, min_share=0.6)
    assert big_share > 32 and block == 16          # waited: its floor (a block), not its whole share
    lost, share = owed_step(6.0)                  # chat alone is over its 6 ms: the share rides
    assert share >= 16


def test_a_pressed_step_with_nothing_interactive_to_run_still_steps_the_throughput_pool():
    """Chat pressed by its gateway queue but running nothing (its waiting request needs credits that a
    request waiting on rag holds): a pressed floor of 0 gave rag nothing, the owed and starved clocks count
    step time and an empty step adds none, so the device stepped empty batches for good (a deadlock across
    pools, found by an HTTP fuzzer). A step of nothing else gives rag its block."""
    composer = _make_composer()
    composer.schedulers["rag"].add(_make_seq(70, 40, max_tokens=10_000))
    _finish_step(composer, composer.schedule())            # rag's prefill ran; it decodes from now on
    composer.set_external_waiting("chat", 3)
    for _ in range(5):
        step = composer.schedule()
        assert step.pressed == ("chat",) and [i.num_new_tokens for i in step.outputs["rag"].scheduled] == [1]
        _finish_step(composer, step)
