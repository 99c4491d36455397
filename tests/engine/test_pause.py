"""Pausing a request (its client reads too slowly): it keeps its blocks and place, makes no progress
while others do, is never a preemption victim, and finishes after resume with the output it would
have had (greedy). An engine with only paused requests steps nothing."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.structured import StructuredOutput
from tests.conftest import assert_all_free, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5 + i for i in range(30)], [100 + i for i in range(20)], [300 + 2 * i for i in range(40)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-pause"), "llama", builtin_path)


def _make_engine(path, num_blocks: int = 256, **sched) -> LLMEngine:
    sched.setdefault("max_num_batched_tokens", 64)
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=16), pools=(pool,)), progress=False)


@pytest.fixture(scope="module")
def engine(tiny):
    return _make_engine(tiny)


def _run_until_done(engine: LLMEngine, ids: list[str]) -> dict[str, list[list[int]]]:
    final = {}
    while any(r in engine.requests for r in ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [o.token_ids for o in out.outputs]
    return final


def _num_tokens(engine: LLMEngine, request_id: str) -> list[int]:
    return [s.num_tokens for s in engine.requests[request_id].seqs]


def test_a_paused_request_keeps_its_blocks_and_makes_no_progress_then_finishes_the_same(engine):
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=3), GREEDY]
    expected = _run_all(engine, PROMPTS, params, prefix="ref")   # the same requests, never paused
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r-{i}", prompt, p)
    for _ in range(4):   # prefills done, a few tokens out
        engine.step()
    scheduler = engine.schedulers["default"]
    assert engine.pause("r-1", True) and scheduler.paused == {"r-1"}
    tables = [list(s.block_table) for s in engine.requests["r-1"].seqs]
    before, others = _num_tokens(engine, "r-1"), {r: _num_tokens(engine, r) for r in ("r-0", "r-2")}
    for _ in range(6):
        outputs = engine.step()
        assert "r-1" not in {o.request_id for o in outputs}
        engine.check_integrity()
    assert _num_tokens(engine, "r-1") == before                              # no progress
    assert [list(s.block_table) for s in engine.requests["r-1"].seqs] == tables   # same blocks, still owned
    assert all(s in scheduler.running for s in engine.requests["r-1"].seqs)
    assert all(_num_tokens(engine, r) > others[r] for r in others)           # the others ran
    assert engine.pause("r-1", False) and not scheduler.paused
    final = _run_until_done(engine, ["r-0", "r-1", "r-2"])
    assert [final[f"r-{i}"] for i in range(3)] == expected
    assert scheduler.stats.num_preemptions == 0
    assert_all_free(engine)


def _run_all(engine, prompts, params, prefix: str) -> list[list[list[int]]]:
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    final = _run_until_done(engine, ids)
    return [final[r] for r in ids]


def test_only_paused_requests_step_nothing_and_an_abort_frees_them(engine):
    engine.add_request("p", PROMPTS[0], GREEDY)
    engine.step()
    assert engine.has_work()
    assert engine.pause("p", True)
    assert not engine.has_work() and engine.has_unfinished_requests()   # the worker may sleep
    assert engine.step() == [] and engine.step() == []
    held = engine.schedulers["default"].block_manager.num_free_blocks
    assert held < engine.schedulers["default"].block_manager.num_blocks
    out = engine.abort("p")
    assert out.finished and not engine.schedulers["default"].paused
    assert_all_free(engine)


def test_pause_of_an_unknown_or_finished_request_is_false(engine):
    assert engine.pause("nobody", True) is False
    _run_all(engine, PROMPTS[:1], [GREEDY], prefix="done")
    assert engine.pause("done-0", True) is False and not engine.schedulers["default"].paused
    assert_all_free(engine)


def test_a_request_paused_before_admission_is_passed_by_and_admitted_once_resumed(engine):
    engine.add_request("first", PROMPTS[0], GREEDY)
    engine.pause("first", True)
    engine.add_request("second", PROMPTS[1], GREEDY)
    engine.step()
    scheduler = engine.schedulers["default"]
    assert [s.request_id for s in scheduler.running] == ["second"]
    assert [s.request_id for s in scheduler.waiting] == ["first"] and not scheduler.waiting[0].block_table
    engine.pause("first", False)
    final = _run_until_done(engine, ["first", "second"])
    assert len(final["first"][0]) == GREEDY.max_tokens
    assert_all_free(engine)


NO_PREFIX_CACHE = dict(enable_prefix_caching=False, max_num_batched_tokens=16, swap_space_bytes=1 << 20)


@pytest.mark.parametrize("sched, warm_steps", [({}, 3), ({**NO_PREFIX_CACHE, "preemption_mode": "recompute"}, 6),
                                               ({**NO_PREFIX_CACHE, "preemption_mode": "swap"}, 6)],
                         ids=["prefix-cache", "no-prefix-cache-recompute", "no-prefix-cache-swap"])
def test_a_paused_request_is_never_a_preemption_victim(tiny, sched, warm_steps):
    """8 blocks of 16 tokens: the paused request (the last admitted, reverse_fifo's victim) holds its blocks
    while the other, short of blocks, waits for them, keeping its own, and the worker sleeps. Preempting itself
    gains nothing: without the prefix cache it was admitted again at once (its blocks free), re-prefilled its
    context and preempted itself again, step after step."""
    engine = _make_engine(tiny, num_blocks=8, **sched)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], long)
    engine.add_request("b", PROMPTS[2], long)
    for _ in range(warm_steps):
        engine.step()
    engine.pause("b", True)
    tables = [list(s.block_table) for s in engine.requests["b"].seqs]
    for _ in range(150):   # "a" runs out of blocks after about 50 tokens
        engine.step()
        engine.check_integrity()
        if engine.last_step.stalled:
            break
    assert [list(s.block_table) for s in engine.requests["b"].seqs] == tables
    assert engine.schedulers["default"].stats.num_preemptions == 0   # not the paused "b", nor "a" itself
    assert engine.step() == [] and engine.last_step.stalled   # a waits for b's blocks: the worker sleeps
    engine.pause("b", False)
    assert engine.step() and not engine.last_step.stalled
    final = _run_until_done(engine, ["a", "b"])
    assert all(len(out[0]) == 60 for out in final.values())
    assert_all_free(engine)


def test_a_request_paused_while_its_grammar_is_built_leaves_no_pause_when_the_build_fails(engine):
    """A slow reader's pause can come before the request reaches its scheduler; if its grammar then fails to
    build, the request ends there and its pause must end with it (it stayed for the worker's life)."""
    vocab_size = engine.model_config.vocab_size
    engine.add_request("g", PROMPTS[0], SamplingParams(max_tokens=5, structured=StructuredOutput(
        "grammar", f'start: "a" <[{vocab_size + 9}]>')))
    assert engine.pause("g", True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.finished, "grammar cannot be built" in (o.error or "")) for o in outs] == [(True, True)]
    assert not engine.schedulers["default"].paused
    assert_all_free(engine)


def test_a_request_paused_while_it_reads_a_document_holds_back_no_other_reader_of_it(tiny):
    """A request with the same prefix waits for a running one that is prefilling it (to take it from the
    prefix cache), but not for a paused one: that one reads nothing, and it was waited for until resumed
    while the worker stepped empty batches."""
    engine = _make_engine(tiny, max_num_batched_tokens=16)
    doc, params = list(range(10, 74)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("A", doc + [200], params)
    engine.step()                                    # A has prefilled 16 of its 65 tokens
    assert engine.pause("A", True)
    engine.add_request("B", doc + [300], params)
    finished = set()
    for _ in range(30):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"B"} and not engine.has_work()
    assert engine.schedulers["default"].stats.num_prefix_waits == 0
    engine.abort("A")
    assert_all_free(engine)


def test_samples_to_be_forked_count_against_max_num_seqs(tiny):
    """n = 4 requests each fit max_num_seqs 8 alone; admitted together, the forks of the ones admitted first
    were not counted and 20 sequences ran at once (past the decode graphs and the plan's concurrency)."""
    engine = _make_engine(tiny, max_num_seqs=8)
    for i in range(5):
        engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True))
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
        peak = max(peak, len(engine.schedulers["default"].running))
    assert peak == 8 and len(outputs) == 5
    assert all(len(samples) == 4 and all(s == samples[0] for s in samples) for samples in outputs.values())
    assert_all_free(engine)


def test_a_paused_request_at_the_head_of_the_queue_is_passed_by_whatever_it_needs(tiny):
    """A paused waiting request of n = 4 that does not fit max_num_seqs now stopped admission (the limit was
    checked before the pause), so an unpaused one behind it that fits never ran and the worker spun."""
    engine = _make_engine(tiny, max_num_seqs=4)
    params = lambda n: SamplingParams(n=n, temperature=0, max_tokens=6, ignore_eos=True)  # noqa: E731
    engine.add_request("A", [5, 6, 7], params(1))
    engine.step()
    engine.pause("A", True)
    engine.add_request("W", [8, 9, 10], params(4))
    engine.pause("W", True)
    engine.add_request("U", [11, 12, 13], params(1))
    finished = set()
    for _ in range(40):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"U"} and not engine.has_work()
    for request_id in ("A", "W"):
        engine.abort(request_id)
    assert_all_free(engine)


def test_a_prefill_short_of_blocks_paused_ones_hold_takes_the_free_ones_and_promises_nothing():
    """Twelve blocks of 8 tokens: P (40 tokens, paused) holds five, H (a 60-token prompt, 48 computed) six, one
    is free. H's next chunk (12 tokens) needs two: it computes the 8 the free block holds, then waits for P's
    blocks without holding the pool (it promised the blocks it lacked, so nothing ran while a block was free).
    Once P ends, H finishes its prompt and W, a later arrival, is admitted."""
    bm = BlockManager(num_blocks=12, block_size=8, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, enable_prefix_caching=False), bm,
                          max_model_len=200)
    paused, held, waiter = _seq(41, 0), _seq(60, 1), _seq(4, 2)
    for seq, computed in ((paused, 40), (held, 48)):
        seq.max_tokens, seq.status, seq.num_computed_tokens = 50, SequenceStatus.RUNNING, computed
        bm.allocate(seq.block_table, computed)
        scheduler.running.append(seq)
    scheduler.pause(paused.request_id, True)
    scheduler.add(waiter)
    out = scheduler.schedule()
    assert [(item.seq, item.num_new_tokens) for item in out.scheduled] == [(held, 8)] and not out.preempted
    assert bm.num_free_blocks == 0
    held.num_computed_tokens += 8
    out = scheduler.schedule()
    assert not out.scheduled and not out.preempted and scheduler.waiting == [waiter]
    scheduler.finish(paused, FinishReason.ABORT)
    out = scheduler.schedule()
    assert [(item.seq, item.num_new_tokens) for item in out.scheduled] == [(held, 4), (waiter, 4)]
    scheduler.check_integrity()


def _seq(num_tokens: int, seq_id: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(range(num_tokens)),
                    num_prompt_tokens=num_tokens, params=SamplingParams(), max_tokens=4, priority=0,
                    arrival_order=seq_id, generator=None)
