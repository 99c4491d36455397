"""KV pressure: preemption by recompute, swap and auto under every victim policy; prefix caching; n > 1
sharing. Outputs must not change (greedy parity) and every block, device and CPU, ends free."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.config import (PREEMPTION_MODES, VICTIM_POLICIES, CacheConfig, EngineConfig, PoolConfig,
                           ConfigError, SchedulerConfig)
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from tests.conftest import assert_all_free, make_tiny_model, price_preemption

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-preempt"), "llama", builtin_path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 60))] for _ in range(6)]


def _engine(path, num_blocks=4096, block_size=16, **sched) -> LLMEngine:
    """One pool; by default 4,096 blocks of 16 tokens (16 MiB of the tiny model's float32 K/V): no pressure. In
    float32 (a CPU's `auto` may be bfloat16, whose greedy tokens can move with the batch around a preemption)."""
    sched.setdefault("max_num_batched_tokens", 64)
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(block_size=block_size),
                                  pools=(pool,)), progress=False)


def _run(engine, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def unconstrained(tiny, prompts):
    engine = _engine(tiny)
    outs = _run(engine, prompts)
    assert engine.schedulers["default"].stats.num_preemptions == 0
    return outs


@pytest.mark.parametrize("policy", VICTIM_POLICIES)
@pytest.mark.parametrize("mode", PREEMPTION_MODES)
def test_outputs_survive_preemption_in_every_mode_and_policy(tiny, prompts, unconstrained, mode, policy):
    # 12 blocks of 16 tokens: one request (< 100 tokens) fits, the six together (~450 tokens) do not.
    engine = _engine(tiny, num_blocks=12, preemption_mode=mode, victim_policy=policy,
                     swap_space_bytes=(1 << 20) if mode != "recompute" else 0)
    if mode == "auto":  # costs under which short victims recompute and long ones swap
        price_preemption(engine.schedulers["default"].cost_model, break_even=60)
    assert _run(engine, prompts) == unconstrained
    stats = engine.schedulers["default"].stats
    assert stats.num_preemptions > 0
    if mode == "recompute":
        assert stats.num_swap_preemptions == 0 and stats.num_recomputed_tokens > 0
    elif mode == "auto":   # per victim: short ones recompute, long ones swap
        assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0, stats
    elif mode == "swap":
        assert stats.num_swap_preemptions == stats.num_preemptions > 0
        # copied back: what the prefix cache no longer held (the rest is shared again at the swap-in)
        assert stats.num_swapped_out_blocks >= stats.num_swapped_in_blocks > 0
    assert_all_free(engine)


def test_auto_follows_the_measured_costs(tiny, prompts, unconstrained):
    for swap_fast, want in ((True, "swap"), (False, "recompute")):
        engine = _engine(tiny, num_blocks=12, preemption_mode="auto", swap_space_bytes=1 << 20)
        model = engine.schedulers["default"].cost_model
        assert model.swap_bytes_per_second > 0 and model.swap_latency_seconds >= 0  # measured at start-up
        assert model.step_model is engine.composer.cost_model    # re-prefill priced by the device's own steps
        price_preemption(model, break_even=60)
        model.swap_bytes_per_second = 1e15 if swap_fast else 1.0
        assert _run(engine, prompts) == unconstrained
        stats = engine.schedulers["default"].stats
        by_mode = {"swap": stats.num_swap_preemptions, "recompute": stats.num_recompute_preemptions}
        assert by_mode[want] == stats.num_preemptions > 0
        assert_all_free(engine)


def test_auto_weighs_each_victim_by_its_length():
    """A re-prefill attends to its whole context chunk after chunk, so it grows faster than its length, where a
    swap's copies grow as it: short victims recompute, long ones swap (per-token figures through zero chose the
    same for every victim). Unmeasured, it recomputes; a copy's latency sends the shortest victims to recompute
    even where a swap's bytes are cheaper than a prefill's tokens."""
    from engine.preemption_cost import PreemptionCostModel
    from engine.step_cost import LinearStepTime, StepCostModel, StepFeatures

    model = PreemptionCostModel(kv_bytes_per_token=1000, chunk_tokens=64)
    assert model.choose(10_000) == "recompute"                        # nothing measured
    model.swap_bytes_per_second = 1e6
    model.step_model = StepCostModel()
    assert model.choose(10_000) == "recompute"                        # the step model not fitted yet
    price_preemption(model, break_even=60)
    assert [model.choose(n) for n in (1, 30, 59, 61, 100, 4000)] == ["recompute"] * 3 + ["swap"] * 3
    model.step_model = LinearStepTime(a=0.01, b=1e-3, c=0.0, d=0.0)   # no attention term: linear too
    model.swap_bytes_per_second = 4000 * model.kv_bytes_per_token     # 0.5 ms a token, round trip
    model.swap_latency_seconds = 5e-3
    assert [model.choose(n) for n in (5, 19, 21, 1000)] == ["recompute"] * 2 + ["swap"] * 2

    # the closed form of the chunks is their sum, past a knee and with the keys each chunk reads
    model.step_model = LinearStepTime(a=0.01, b=1e-3, c=2e-3, d=3e-4, e=5e-4, knee=16)
    for n in (1, 63, 64, 65, 1000, 4096):
        chunks, empty = 0.0, model.step_model.predict(StepFeatures())
        for cached in range(0, n, 64):
            features = StepFeatures()
            features.add(cached, min(64, n - cached), is_decode=False)
            chunks += model.step_model.predict(features) - empty
        assert model.recompute_seconds(n) == pytest.approx(chunks, rel=1e-9)


def test_a_swap_space_measures_its_copies_bandwidth_and_latency(tiny):
    engine = _engine(tiny, num_blocks=64, preemption_mode="swap", swap_space_bytes=1 << 20)
    bandwidth, latency = engine.swap_spaces["default"].measure()
    assert bandwidth > 0 and 0 <= latency < 1
    assert engine.schedulers["default"].cost_model.swap_bytes_per_second > 0


def test_a_swap_space_without_one_whole_block_is_refused_at_start(tiny):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="swap_space_bytes"):
        _engine(tiny, num_blocks=12, preemption_mode="swap", swap_space_bytes=1)


def test_swap_space_too_small_for_a_victim_recomputes(tiny, prompts, unconstrained):
    bytes_per_block = _engine(tiny, num_blocks=12).kv_cache.bytes_per_block
    engine = _engine(tiny, num_blocks=12, preemption_mode="swap", swap_space_bytes=2 * bytes_per_block)
    assert _run(engine, prompts) == unconstrained
    stats = engine.schedulers["default"].stats
    assert stats.num_recompute_preemptions > 0  # victims over 2 blocks found the CPU pool too small
    assert_all_free(engine)


def test_stability_floor_spares_fresh_sequences(tiny, prompts):
    engine = _engine(tiny, num_blocks=12, stability_floor_tokens=8, victim_policy="reverse_fifo")
    scheduler = engine.schedulers["default"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.has_unfinished_requests():
        running_before = {s.seq_id: s.num_output_tokens - s.admitted_at_output for s in scheduler.running}
        engine.step()
        victims = [s for s in scheduler.waiting + scheduler.swapped if s.seq_id in running_before]
        for v in victims:
            others_ok = any(n >= 8 for sid, n in running_before.items() if sid != v.seq_id)
            if others_ok:
                assert running_before[v.seq_id] >= 8, "a fresh sequence was preempted while others were eligible"
    assert scheduler.stats.num_preemptions > 0
    assert_all_free(engine)


def _seq(num_tokens: int, seq_id: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(range(num_tokens)),
                    num_prompt_tokens=num_tokens, params=SamplingParams(), max_tokens=4, priority=0,
                    arrival_order=seq_id, generator=None)


def test_a_sequence_alone_that_cannot_grow_ends_with_an_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), bm, max_model_len=100)
    seq = _seq(12)
    scheduler.add(seq)  # bypasses check_fits, as a request for a pool smaller than it
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [8]  # the first chunk fits
    seq.num_computed_tokens = 8
    out = scheduler.schedule()
    assert out.finished == [seq] and seq.finish_reason.value == "length" and "cannot hold" in seq.error
    assert bm.num_free_blocks == 2 and not scheduler.running
    scheduler.check_integrity()

    # the same at admission: an unchunkable head of the queue that the empty pool can never take
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, max_model_len=100)
    big, small = _seq(12, 1), _seq(4, 2)
    scheduler.add(big)
    scheduler.add(small)
    out = scheduler.schedule()
    assert out.finished == [big] and [s.seq for s in out.scheduled] == [small]
    scheduler.check_integrity()


def test_a_budget_short_of_the_running_decodes_serves_them_in_turn():
    """Four decodes, a step composer's budget of 2 tokens a step: each decodes every other step (the ones scheduled
    longest ago first), never the first two every step while the last two wait for them to finish."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, enable_prefix_caching=False), bm, max_model_len=100)
    seqs = [_seq(5, i) for i in range(4)]
    for seq in seqs:
        seq.num_prompt_tokens, seq.max_tokens, seq.status = 4, 50, SequenceStatus.RUNNING
        bm.allocate(seq.block_table, 5)
        seq.num_computed_tokens = 4
        scheduler.running.append(seq)
    served = []
    for _ in range(6):
        out = scheduler.schedule(token_budget=2)
        served.append(sorted(item.seq.seq_id for item in out.scheduled))
        for item in out.scheduled:   # the step's bookkeeping: its token computed, the next one sampled
            item.seq.num_computed_tokens += 1
            item.seq.token_ids.append(7)
    assert served == [[0, 1], [2, 3]] * 3
    assert scheduler.running == seqs   # the running order (its victims' tie-break) is kept
    scheduler.check_integrity()
    assert [s.seq_id for s in scheduler.running if s.num_uncomputed_tokens == 1] == [0, 1, 2, 3]
    out = scheduler.schedule(token_budget=64)   # a budget that covers them all serves them all
    assert sorted(item.seq.seq_id for item in out.scheduled) == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["longest_first", "lru"])
def test_a_decode_the_short_budget_passed_over_may_be_the_victim_and_the_next_one_still_runs(policy):
    """Budget 2, no block free: A (16 tokens, decoded last step) is passed over, B and C are served; B needs a
    block. longest_first preempts A, which had been passed over (it left the prefix of `running` the loop walks:
    C was skipped); lru preempts A too (B and C run this step: the decodes passed over are the least recent)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, victim_policy=policy, stability_floor_tokens=0,
                                          enable_prefix_caching=False), bm, max_model_len=100)
    a, b, c = _seq(17, 0), _seq(9, 1), _seq(5, 2)
    for seq, last in ((a, 1), (b, 0), (c, 0)):
        seq.num_prompt_tokens, seq.max_tokens, seq.status = len(seq.token_ids) - 1, 50, SequenceStatus.RUNNING
        bm.allocate(seq.block_table, len(seq.token_ids) - 1)
        seq.num_computed_tokens, seq.last_scheduled_step = len(seq.token_ids) - 1, last
        scheduler.running.append(seq)
    bm.allocate(c.block_table, 5)
    assert bm.num_free_blocks == 0
    out = scheduler.schedule(token_budget=2)
    assert out.preempted == [a] and [item.seq for item in out.scheduled] == [b, c]
    scheduler.check_integrity()


def test_a_swapped_sequence_holds_back_only_arrivals_no_more_urgent_than_it():
    """victim_policy priority, swap: H (priority 0) grows, L (priority 9) is swapped out and cannot come back (it
    needs 5 blocks, 3 are free). An urgent arrival U (priority 0, 1 block) is admitted beside it; a lax one (9)
    waits behind L. Any swapped sequence held every arrival back: the least urgent, preempted for the most
    urgent, then shut out the next urgent one."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap", swap_space_bytes=1 << 20,
                                          victim_policy="priority", stability_floor_tokens=0,
                                          enable_prefix_caching=False),
                          bm, max_model_len=100, swap_manager=BlockManager(num_blocks=16, block_size=4))
    h, low = _seq(17, 0), _seq(17, 1)
    low.priority = 9
    for seq in (h, low):
        seq.num_prompt_tokens, seq.max_tokens, seq.status = 16, 50, SequenceStatus.RUNNING
        bm.allocate(seq.block_table, 16)
        seq.num_computed_tokens = 16
        scheduler.running.append(seq)
    out = scheduler.schedule()
    assert out.preempted == [low] and scheduler.swapped == [low] and bm.num_free_blocks == 3
    h.num_computed_tokens += 1
    h.token_ids.append(7)
    urgent, lax = _seq(4, 2), _seq(4, 3)
    lax.priority = 9
    scheduler.add(lax)
    scheduler.add(urgent)
    out = scheduler.schedule()
    assert [item.seq for item in out.scheduled] == [h, urgent]
    assert scheduler.swapped == [low] and scheduler.waiting == [lax]
    scheduler.check_integrity()


def test_a_batch_line_waits_behind_an_interactive_request_of_any_priority_and_is_the_first_victim(tiny):
    """A tenant's interactive request clamped to priority 10, a batch line at 0: one prefill chunk a step, the
    interactive one goes first (the engine sorted by priority alone, so the batch line passed it); under
    victim_policy priority the batch line is preempted before it. (EOS ignored: a first token sampled as EOS would end
    the interactive request within the first step, and it would not be running after it.)"""
    engine = _engine(tiny, max_num_batched_tokens=64, victim_policy="priority")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("line", list(range(3, 53)), params, priority=0, background=True)
    engine.add_request("chat", list(range(3, 53)), params, priority=10)
    scheduler = engine.schedulers["default"]
    assert [s.request_id for s in scheduler.waiting] == ["chat", "line"]
    engine.step()
    assert [s.request_id for s in scheduler.running][:1] == ["chat"]
    from engine.preemption_cost import victim_by_policy
    chat, line = engine.requests["chat"].seqs[0], engine.requests["line"].seqs[0]
    assert victim_by_policy("priority", [line, chat], [line, chat]) is line
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_a_swapped_in_sequence_shares_the_cached_blocks_it_left_instead_of_copying_them_back():
    """B shares A's three prompt blocks (two samples of one prompt) and is swapped out; its blocks stay in use by
    A and in the prefix cache. Swapped in, B shares them again and copies back nothing: it took three fresh
    blocks, copied its CPU blocks into them, and held its prompt twice (blocks that could never be registered). Five
    blocks: A's decode takes the fourth, B needs only the last (it waited for four, which it never needed)."""
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap", swap_space_bytes=1 << 20),
                          bm, max_model_len=100, swap_manager=BlockManager(num_blocks=16, block_size=4))
    a, b = _seq(13, 0), _seq(13, 1)
    a.num_prompt_tokens = b.num_prompt_tokens = 12
    bm.allocate(a.block_table, 12)
    bm.register_computed(a.block_table, a.token_ids, 12)
    b.block_table = bm.fork(a.block_table)
    for seq in (a, b):
        seq.num_computed_tokens, seq.max_tokens, seq.status = 12, 50, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    scheduler._preempt(b, SchedulerOutput())
    assert scheduler.swapped == [b] and not b.block_table and len(b.cpu_block_table) == 3
    queries = (bm.num_prefix_queries, bm.num_prefix_hits)
    out = scheduler.schedule()
    assert [item.seq for item in out.scheduled] == [a, b] and b.block_table[:3] == a.block_table[:3]
    assert [kind for kind, _ in out.moves] == [] and scheduler.stats.num_swapped_in_blocks == 0
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == queries and not b.cpu_block_table
    assert bm.num_free_blocks == 0
    scheduler.check_integrity()


def _three_in_flight(a_max_tokens: int) -> tuple[Scheduler, list[Sequence]]:
    """Overlapped steps, each running sequence's next token in flight, no block free: A (7 prompt tokens,
    `a_max_tokens`), B (4 + 4 generated, needs a new block), C (4 + 1 generated, decodes in place)."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, victim_policy="least_progress",
                                          stability_floor_tokens=0, enable_prefix_caching=False), bm, max_model_len=100)
    seqs = [_seq(7, 0), _seq(8, 1), _seq(5, 2)]
    for seq, prompt, max_tokens, computed, extra in zip(seqs, (7, 4, 4), (a_max_tokens, 50, 50), (7, 8, 5), (1, 0, 1)):
        seq.num_prompt_tokens, seq.max_tokens = prompt, max_tokens
        bm.allocate(seq.block_table, computed + extra)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
        seq.add_pending(seq.seq_id)
    assert bm.num_free_blocks == 0
    return scheduler, seqs


def test_a_sequence_ending_with_its_token_in_flight_is_no_victim():
    """A's last token is in flight (it ends when that lands, freeing its blocks) and B needs a block: A is no
    victim (its preemption would throw away a finished request's work), and as A's two blocks come back a step
    later, B waits for them and nobody is preempted (C was: its work lost for a block free a step later); C
    decodes in place. With A not ending, least_progress takes A and C runs."""
    scheduler, (a, b, c) = _three_in_flight(a_max_tokens=1)
    assert a.ends_when_known(100) and not b.ends_when_known(100)
    out = scheduler.schedule()
    assert out.preempted == [] and [s.seq for s in out.scheduled] == [c] and scheduler.running == [a, b, c]
    scheduler.check_integrity()
    scheduler, (a, b, c) = _three_in_flight(a_max_tokens=4)
    out = scheduler.schedule()
    assert out.preempted == [a] and [s.seq for s in out.scheduled] == [b, c]
    scheduler.check_integrity()


def test_prefix_cache_prefills_only_the_new_tokens(tiny):
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(200)]
    first = system + [rng.randrange(3, 512) for _ in range(15)]
    second = system + [rng.randrange(3, 512) for _ in range(25)]
    reference = _run(_engine(tiny), [first, second])

    engine = _engine(tiny, enable_prefix_caching=True)
    prefilled = []
    for i, prompt in enumerate((first, second)):
        engine.add_request(f"r{i}", prompt, GREEDY)
        done, tokens = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                done = out
            tokens += engine.last_step.num_prefill_tokens
        prefilled.append(tokens)
        assert done.outputs[0].token_ids == reference[i]
    assert prefilled[0] == len(first)
    assert prefilled[1] == len(second) - 192  # 12 full blocks of the shared 200 tokens came from the cache
    bm = engine.schedulers["default"].block_manager
    assert bm.num_prefix_hits == 192
    assert_all_free(engine)


def test_a_question_on_a_document_being_read_waits_for_its_blocks_instead_of_reading_it_too(tiny):
    rng = random.Random(5)
    document = [rng.randrange(3, 512) for _ in range(200)]
    questions = [document + [rng.randrange(3, 512) for _ in range(n)] for n in (15, 25, 9)]
    other = [rng.randrange(3, 512) for _ in range(30)]
    reference = _run(_engine(tiny), [*questions, other])
    # a step's budget holds every prompt: without the wait all three would read the document in step one
    engine = _engine(tiny, enable_prefix_caching=True, max_num_batched_tokens=1024)
    for i, prompt in enumerate([*questions, other]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs, prefilled = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        prefilled += engine.last_step.num_prefill_tokens
    assert [outputs[f"r{i}"] for i in range(4)] == reference
    # the document is read once: each later question prefills only what the cache lacks (its last
    # partial block of the document and its own tokens); the unrelated prompt was not held back
    bm = engine.schedulers["default"].block_manager
    assert bm.num_prefix_hits == 2 * 192
    assert prefilled == sum(map(len, questions)) + len(other) - 2 * 192
    assert engine.schedulers["default"].stats.num_prefix_waits > 0
    assert_all_free(engine)


def test_n_samples_share_the_prompt_blocks(tiny):
    prompt = list(range(10, 10 + 40))  # 2 full blocks + 8 tokens in a third
    engine = _engine(tiny, enable_prefix_caching=False)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    engine.add_request("r", prompt, params)
    bm = engine.schedulers["default"].block_manager
    engine.step()  # prefill of sample 0, then the fork: 4 samples, one copy of the prompt
    seqs = engine.requests["r"].seqs
    assert all(len(s.block_table) == 3 for s in seqs)
    assert len({b for s in seqs for b in s.block_table}) == 3 and bm.num_used_blocks == 3
    engine.step()  # each sample writes its first token: the shared partial block is copied on write
    assert len({tuple(s.block_table[:2]) for s in seqs}) == 1  # the full blocks stay shared
    assert len({s.block_table[2] for s in seqs}) == 4 and bm.num_used_blocks == 2 + 4
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    samples = [o.token_ids for o in final.outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) == 4
    again = _engine(tiny).generate([prompt], params)[0]
    assert [o.token_ids for o in again.outputs] == samples  # seeded: reproducible
    assert_all_free(engine)


def test_a_sample_preempted_after_its_copy_on_write_is_swapped_out_with_the_copy_in_it(tiny, monkeypatch):
    """n = 3 samples share their prompt's last block; one given a copy-on-write block and then preempted in the
    same step was swapped out before the copy ran (swap-outs ran before copies), taking another request's
    stale K/V to the CPU and back: wrong tokens. Moves now run in the order they were decided."""
    hazards = []
    schedule = Scheduler.schedule

    def watched(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        copied = {dst for _, dst in out.copies}
        if any(src in copied for src, _ in out.swap_out):
            hazards.append([kind for kind, _ in out.moves])
        return out

    monkeypatch.setattr(Scheduler, "schedule", watched)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(24)], [rng.randrange(3, 500) for _ in range(12)]]
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    squeezed = _engine(tiny, num_blocks=4, preemption_mode="swap", swap_space_bytes=1 << 20,
                       victim_policy="longest_first", stability_floor_tokens=0)
    got = [[c.token_ids for c in o.outputs] for o in squeezed.generate(prompts, params)]
    monkeypatch.undo()
    want = [[c.token_ids for c in o.outputs] for o in _engine(tiny).generate(prompts, params)]
    assert hazards and all(kinds.index("copy") < kinds.index("swap_out") for kinds in hazards)
    assert got == want
    assert_all_free(squeezed)


def test_a_run_of_moves_never_writes_one_block_twice():
    """Consecutive moves of a kind are one batched copy, whose writes to one block twice land in no set order
    (torch's index_copy_): a copy-on-write destination that a recompute freed and the next copy-on-write took
    starts a new run, as does a pair reading a block the run writes."""
    out = SchedulerOutput()
    out.move("copy", [(4, 9)])
    out.move("copy", [(6, 14)])
    out.move("copy", [(4, 14)])          # 14 again: freed by a recompute, taken by the next copy-on-write
    out.move("copy", [(14, 20)])         # reads 14, which this run writes
    out.move("copy", [(7, 21)])
    out.move("swap_out", [(3, 0)])
    out.move("swap_out", [(5, 1)])
    assert out.moves == [("copy", [(4, 9), (6, 14)]), ("copy", [(4, 14)]), ("copy", [(14, 20), (7, 21)]),
                         ("swap_out", [(3, 0), (5, 1)])]
    assert out.copies == [(4, 9), (6, 14), (4, 14), (14, 20), (7, 21)] and out.swap_out == [(3, 0), (5, 1)]


def test_a_sequence_waiting_for_an_ending_ones_blocks_is_no_victim_and_what_it_was_promised_counts():
    """E's last token is in flight (its 2 blocks back a step later). B needs 1 block: it waits for E's, and 1 is
    promised to it. C's chunk needs 3, more than is left to come: C preempted, and by lru B (scheduled longest ago)
    was the victim, and the step then skipped D: the sequences seen were no longer a prefix of `running`. After a
    waiter, C waits too (the free blocks are B's), nobody is preempted, and D decodes in place."""
    bm = BlockManager(num_blocks=7, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, victim_policy="lru", stability_floor_tokens=0,
                                          enable_prefix_caching=False), bm, max_model_len=100)
    e, b, c, d = _seq(7, 0), _seq(8, 1), _seq(16, 2), _seq(5, 3)
    for step, (seq, prompt, max_tokens, computed, extra, pending) in enumerate(zip(
            (e, b, c, d), (7, 4, 16, 4), (1, 50, 50, 50), (7, 8, 4, 5), (1, 0, 0, 1), (True, True, False, True))):
        seq.num_prompt_tokens, seq.max_tokens, seq.last_scheduled_step = prompt, max_tokens, step
        bm.allocate(seq.block_table, computed + extra)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
        if pending:
            seq.add_pending(seq.seq_id)
    assert bm.num_free_blocks == 0 and e.ends_when_known(100)
    out = scheduler.schedule()
    assert out.preempted == [] and [s.seq for s in out.scheduled] == [d] and scheduler.running == [e, b, c, d]
    scheduler.check_integrity()


@pytest.mark.parametrize("num_free", [1, 2])
def test_after_a_sequence_waiting_for_an_ending_ones_blocks_a_later_one_takes_only_the_free_blocks_it_leaves(
        num_free):
    """W's chunk needs 3 blocks, E's 2 come back a step later, so W waits for them. With 1 free, W counts on it:
    B, after W, needs 1 and waits too (it took it, and next step W was short again, the victim by lru). With 2
    free, W counts on one of them: B grows into the other."""
    bm = BlockManager(num_blocks=5 + num_free, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, victim_policy="lru", stability_floor_tokens=0,
                                          enable_prefix_caching=False), bm, max_model_len=100)
    e, w, b = _seq(7, 0), _seq(16, 1), _seq(8, 2)
    for seq, prompt, max_tokens, computed, extra, pending in zip(
            (e, w, b), (7, 16, 4), (1, 50, 50), (7, 4, 8), (1, 0, 0), (True, False, True)):
        seq.num_prompt_tokens, seq.max_tokens = prompt, max_tokens
        bm.allocate(seq.block_table, computed + extra)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
        if pending:
            seq.add_pending(seq.seq_id)
    assert bm.num_free_blocks == num_free
    out = scheduler.schedule()
    assert out.preempted == [] and [s.seq for s in out.scheduled] == ([] if num_free == 1 else [b])
    assert bm.num_free_blocks == 1 and scheduler.running == [e, w, b]
    scheduler.check_integrity()


def test_forked_samples_run_behind_their_sibling_not_behind_a_prompt_admitted_after_it(tiny):
    """n = 3 samples fork after their shared prefill; a long prompt admitted in the same step behind their
    sibling is still prefilling. The samples decode at once, each step: queued behind that prompt they got
    no token until it was all in."""
    engine = _engine(tiny, max_num_batched_tokens=64)
    engine.add_request("r", list(range(10, 30)), SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    engine.add_request("long", list(range(3, 503)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()   # r's prompt (20 tokens) and a first chunk of the long one; r forks into three
    running = engine.schedulers["default"].running
    assert [(s.request_id, s.index) for s in running] == [("r", 0), ("r", 1), ("r", 2), ("long", 0)]
    for step in (2, 3):
        engine.step()
        assert [s.num_output_tokens for s in engine.requests["r"].seqs] == [step] * 3, step
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_a_preempted_sequence_leaves_its_full_blocks_in_the_prefix_cache_and_ending_samples_their_shared_ones():
    """Overlapped steps: a block completed by the step before is registered at the next commit, which a
    preemption in between skipped: recomputing the sequence read it again. And n samples ending together (their
    last tokens in flight) give back the blocks they share a step later: a sequence short of those waits for
    them, nobody is preempted."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, max_model_len=100)
    seq = _seq(4)
    seq.num_prompt_tokens = 3                           # [0, 1, 2] and its first output token 3, computed
    bm.allocate(seq.block_table, 5)
    seq.num_computed_tokens, seq.status = 4, SequenceStatus.RUNNING
    seq.add_pending(0)                                  # the next token in flight
    scheduler.running.append(seq)
    scheduler._preempt(seq, SchedulerOutput())          # recompute: its blocks freed
    again = []
    assert bm.acquire_cached(again, [0, 1, 2, 3, 7]) == 4   # the full block came from the cache

    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, stability_floor_tokens=0,
                                          enable_prefix_caching=False), bm, max_model_len=100)
    a, a2, x = _seq(8, 0), _seq(8, 1), _seq(4, 2)
    bm.allocate(a.block_table, 8)
    a2.block_table = bm.fork(a.block_table)             # two samples of one prompt: its 2 blocks, shared
    bm.allocate(x.block_table, 4)                       # x's next token needs a block: none is free
    for s, max_tokens in ((a, 1), (a2, 1), (x, 50)):
        s.max_tokens, s.num_computed_tokens, s.status = max_tokens, len(s.token_ids), SequenceStatus.RUNNING
        s.add_pending(s.seq_id)
        scheduler.running.append(s)
    out = scheduler.schedule()
    assert out.preempted == [] and out.scheduled == [] and scheduler.running == [a, a2, x]


def test_a_prompt_resumed_mid_prefill_leaves_the_decoding_sequences_behind_it_their_tokens(tiny):
    """A request paused mid-prefill (its gateway reads slowly) keeps its place in `running`; sequences admitted
    behind it meanwhile decode. Resumed, its chunks leave them their token each step: it took the whole budget
    until its prompt was in, and they got nothing."""
    engine = _engine(tiny, max_num_batched_tokens=64)
    engine.add_request("long", list(range(3, 503)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()                                            # its first chunk
    assert engine.pause("long", True)
    for i in range(3):
        engine.add_request(f"d{i}", list(range(10 + i, 30 + i)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()                                            # their prompts; each samples its first token
    assert engine.pause("long", False)
    for step in (2, 3):
        engine.step()
        assert [engine.requests[f"d{i}"].seqs[0].num_output_tokens for i in range(3)] == [step] * 3, step
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_prefill_chunks_leave_the_decodes_after_them_their_token_or_go_behind_them():
    """A budget the decodes after a chunk would take whole (the composer's, sized to them) moves the chunk behind
    them, never one token of it ahead of the last decode's; of two chunks, the one the budget still holds runs."""
    def scheduled(budget: int, prefills: int) -> tuple[list[tuple[int, int]], list[int]]:
        bm = BlockManager(num_blocks=64, block_size=16, enable_prefix_caching=False)
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, enable_prefix_caching=False), bm,
                              max_model_len=1000)
        seqs = [_seq(40, i) for i in range(prefills)] + [_seq(20, 10 + i) for i in range(3)]
        for s in seqs:
            bm.allocate(s.block_table, len(s.token_ids))
            s.num_computed_tokens = 16 if s.seq_id < 10 else 19   # prompts part read; decodes' last token due
            s.status = SequenceStatus.RUNNING
            scheduler.running.append(s)
        out = scheduler.schedule()
        return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled], [s.seq_id for s in scheduler.running]

    assert scheduled(3, 1) == ([(10, 1), (11, 1), (12, 1)], [10, 11, 12, 0])
    assert scheduled(1, 1) == ([(10, 1)], [10, 11, 12, 0])   # one token left: a decode's, not the chunk's
    assert scheduled(10, 2) == ([(0, 7), (10, 1), (11, 1), (12, 1)], [0, 10, 11, 12, 1])
    assert scheduled(64, 1) == ([(0, 24), (10, 1), (11, 1), (12, 1)], [0, 10, 11, 12])


def test_a_long_prefill_token_threshold_cuts_each_prompts_chunks_and_leaves_the_budget_to_others():
    """`long_prefill_token_threshold: 16` in a step of 64: two running prompts and a waiting one each compute 16
    tokens (not the first one 64) beside a decode's token; the next step the chunks go on at 16, the last prompt
    computes its tail of 5."""
    bm = BlockManager(num_blocks=64, block_size=16, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=16, enable_prefix_caching=False)
    assert config.max_step_tokens == 16
    scheduler = Scheduler(config, bm, max_model_len=1000)
    running = [_seq(100, 0), _seq(40, 1), _seq(20, 2)]
    for s, computed in zip(running, (16, 0, 19)):
        bm.allocate(s.block_table, computed)
        s.num_computed_tokens, s.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(s)
    scheduler.add(_seq(21, 3))
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 16), (1, 16), (2, 1), (3, 16)]
    for item in out.scheduled:   # the step's bookkeeping: its tokens computed, a decode's next one sampled
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_uncomputed_tokens == 0:
            item.seq.token_ids.append(7)
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 16), (1, 16), (2, 1), (3, 5)]
    scheduler.check_integrity()
    assert SchedulerConfig(max_num_batched_tokens=8, long_prefill_token_threshold=16).max_step_tokens == 8
    assert SchedulerConfig().max_step_tokens == 2048


def test_a_long_prefill_token_threshold_needs_chunked_prefill_and_a_count():
    with pytest.raises(ConfigError, match="^long_prefill_token_threshold: cuts prompts into chunks, which needs "
                                          "chunked prefill"):
        SchedulerConfig(long_prefill_token_threshold=16, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match=r"^long_prefill_token_threshold: must be an integer >= 0, got -1"):
        SchedulerConfig(long_prefill_token_threshold=-1)
