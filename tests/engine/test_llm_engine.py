"""Engine scenarios: block and chunk sizes, preemption, aborts, refusals, sampling features.

Every scenario ends with all blocks free and `check_integrity()` passing: no block leaks.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.model_config import ModelConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def chat_prompts(builtin_path):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(builtin_path)
    texts = ["Name a colour.", "Why do cats purr? Answer briefly.", "2+2=?",
             "Write one sentence about rivers, mountains and the long road between them."]
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]


def _engine(path, kv_cache_bytes: int = 64 << 20, **kwargs) -> LLMEngine:
    """One pool of `num_blocks`, by default as many as `kv_cache_bytes` of the model's float32 K/V hold; float32
    unless `dtype` says otherwise (the outputs these tests compare are float32's: a CPU's `auto` may be bfloat16)."""
    kwargs.setdefault("dtype", "float32")
    block_size = kwargs.setdefault("block_size", 16)
    block_bytes = ModelConfig.from_folder(path).kv_bytes_per_token(torch.float32) * block_size
    kwargs.setdefault("num_blocks", kv_cache_bytes // block_bytes)
    return LLMEngine.from_args(str(path), progress=False, **kwargs)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(builtin_path, chat_prompts):
    """Greedy outputs with block size 16 and no chunking: what every variant must reproduce."""
    engine = _engine(builtin_path, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    outs = _tokens(engine.generate(chat_prompts, GREEDY))
    assert_all_free(engine)
    return outs


@pytest.mark.parametrize("block_size", [8, pytest.param(32, marks=pytest.mark.slow)])   # 16: the baseline's own
def test_block_sizes_give_same_outputs(builtin_path, chat_prompts, baseline, block_size):
    engine = _engine(builtin_path, block_size=block_size)
    assert _tokens(engine.generate(chat_prompts, GREEDY)) == baseline
    assert_all_free(engine)


@pytest.mark.parametrize("chunk", [7, pytest.param(64, marks=pytest.mark.slow)])
def test_chunked_prefill_gives_same_outputs(builtin_path, chat_prompts, baseline, chunk):
    engine = _engine(builtin_path, max_num_batched_tokens=chunk)
    steps_with_mixed = 0
    for i, prompt in enumerate(chat_prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    results = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        stats = engine.last_step
        assert stats.num_prefill_tokens + stats.num_decode_tokens <= chunk
        steps_with_mixed += bool(stats.num_prefill_tokens and stats.num_decode_tokens)
        results.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    assert [results[f"r{i}"] for i in range(len(chat_prompts))] == baseline
    assert steps_with_mixed > 0  # prefill chunks and decode tokens shared steps
    assert_all_free(engine)


def test_preemption_by_recompute_keeps_outputs(builtin_path, chat_prompts, baseline):
    # 10 blocks of 8 tokens: one ~70-token sequence fits, two do not.
    engine = _engine(builtin_path, block_size=8, num_blocks=10, max_num_batched_tokens=64)
    outs = engine.generate(chat_prompts, GREEDY)
    scheduler = engine.schedulers["default"]
    assert scheduler.stats.num_preemptions > 0 and scheduler.stats.num_recomputed_tokens > 0
    assert _tokens(outs) == baseline
    # each output token is generated once: a recomputed one is computed again, not generated again
    assert scheduler.stats.num_generated_tokens == sum(len(t) for t in baseline)
    assert_all_free(engine)


def test_abort_mid_generation_frees_blocks(builtin_path, chat_prompts):
    engine = _engine(builtin_path)
    for i, prompt in enumerate(chat_prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12))   # past the 5 steps below
    for _ in range(5):
        engine.step()
    assert engine.num_free_blocks() < engine.num_blocks
    final = engine.abort("r1")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.abort("no-such-request") is None
    engine.add_request("late", chat_prompts[0], GREEDY)
    engine.abort("late")  # aborted while still waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_requests_that_can_never_fit_are_refused(builtin_path):
    engine = _engine(builtin_path, num_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(RequestError, match="max_model_len 128"):
        engine.add_request("a", list(range(100)), SamplingParams(max_tokens=40))
    with pytest.raises(RequestError, match="needs 5 blocks"):
        engine.add_request("b", list(range(60)), SamplingParams(max_tokens=20))
    # 50 + 15 = 65 tokens in 64 slots: the last token is sampled, never stored (it was refused for 5 blocks)
    (out,) = engine.generate([list(range(3, 53))], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 15 and out.outputs[0].finish_reason == "length" and not out.error
    assert engine.schedulers["default"].stats.num_preemptions == 0
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request("c", "", SamplingParams())
    with pytest.raises(RequestError, match=r"prompt\[1\]"):
        engine.add_request("d", [1, 10**9], SamplingParams())
    with pytest.raises(RequestError, match="pool"):
        engine.add_request("e", [1, 2], SamplingParams(), pool="nope")
    with pytest.raises(RequestError, match=r"^min_tokens: 40 is over the 28 tokens the prompt leaves"):
        engine.add_request("m", list(range(100)), SamplingParams(max_tokens=None, min_tokens=40))   # 28 left
    vocab = engine.model_config.vocab_size   # a bias the sampler could not apply is refused, not ignored
    with pytest.raises(RequestError, match=rf"^logit_bias: token ids \[{vocab}\] are outside the vocabulary"):
        engine.add_request("e", [1, 2], SamplingParams(logit_bias={vocab: 5.0, 3: 1.0}))
    engine.add_request("f", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request("f", [1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)
    with pytest.raises(RequestError, match="max_model_len 128"):   # offline: the ones before it are not left behind
        engine.generate([[1, 2], list(range(100))], SamplingParams(max_tokens=40))
    assert not engine.has_unfinished_requests()
    assert_all_free(engine)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", builtin_path, initializer_range=0.05)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_path):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _engine(tiny_path).generate([[5, 6, 7]], seeded)[0].outputs[0].token_ids
    again = _engine(tiny_path).generate([[5, 6, 7]], seeded)[0].outputs[0].token_ids
    assert alone == again
    engine = _engine(tiny_path)
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    outs = engine.generate([[9] * 30, [5, 6, 7], [11, 12], [5, 6, 7]],
                           [others, seeded, SamplingParams(temperature=0.7, seed=99, max_tokens=5), others])
    assert outs[1].outputs[0].token_ids == alone
    unseeded = engine.generate([[5, 6, 7]] * 2, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    assert _tokens(unseeded)[0] != alone or _tokens(unseeded)[1] != alone
    assert_all_free(engine)


def test_requests_without_a_seed_draw_differently_on_every_engine(tiny_path):
    """Every engine's generator for requests without a seed started at 0: two replicas (or a worker and its
    restart) sent the same prompt answered the same "random" text. Each draws its own now; a
    `sampling_seed` keeps one stream for whoever needs it repeated."""
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    first, second = (_engine(tiny_path).generate([[5, 6, 7]], free)[0].outputs[0].token_ids for _ in range(2))
    assert first != second
    pinned = [_engine(tiny_path, sampling_seed=7).generate([[5, 6, 7]], free)[0].outputs[0].token_ids
              for _ in range(2)]
    assert pinned[0] == pinned[1]


def test_n_samples_stop_strings_logprobs_and_min_tokens(builtin_path, chat_prompts):
    engine = _engine(builtin_path)
    out = engine.generate([chat_prompts[1]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12,
                                                           logprobs=2))[0]
    assert sorted(o.index for o in out.outputs) == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) and all(lp <= 0 for lp in o.logprobs)
        assert all(len(top) == 2 for top in o.top_logprobs)

    greedy = engine.generate([chat_prompts[3]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    word = greedy.text.split()[2]
    stopped = engine.generate([chat_prompts[3]], SamplingParams(temperature=0, max_tokens=30,
                                                                stop=[word]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and greedy.text.startswith(stopped.text)

    # min_tokens masks EOS; a stop token id ends generation (and is reported)
    short = engine.generate([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop"
    longer = engine.generate([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=40,
                                                               min_tokens=len(short.token_ids) + 3))[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    stop_tok = greedy.token_ids[4]
    by_id = engine.generate([chat_prompts[3]], SamplingParams(temperature=0, max_tokens=30,
                                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert by_id.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_tok) + 1]
    assert by_id.stop_reason == stop_tok
    assert_all_free(engine)


def _stream(engine, prompt, params, deltas=None):
    """Run one request step by step; return the joined deltas, the joined token deltas, the last output
    (`deltas`: a list each step's text delta is added to)."""
    engine.add_request("s", prompt, params)
    text, tokens, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            text += o.delta_text
            tokens += o.delta_token_ids
            assert o.text == text  # the cumulative text is always the sum of the deltas
            last = o
            if deltas is not None:
                deltas.append(o.delta_text)
    return text, tokens, last


def test_streamed_deltas_add_up_and_never_leak_a_stop_string(builtin_path, chat_prompts):
    engine = _engine(builtin_path)
    plain = SamplingParams(temperature=0, max_tokens=16)
    text, tokens, last = _stream(engine, chat_prompts[3], plain)
    assert last.finished and tokens == last.token_ids and text == engine.tokenizer.decode(tokens)
    # A stop string spanning several tokens in the middle of the output: streaming must hold back its
    # first characters until it is complete, then drop it.
    stop = text[len(text) // 2 - 3: len(text) // 2 + 4]
    stopped, _, last = _stream(engine, chat_prompts[3], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert stopped == text[: text.index(stop)] and stop not in stopped
    # Kept in the output (include_stop_str_in_output), a stop string cuts after itself: nothing streamed can
    # be taken back, so nothing is held back (as vLLM): the deltas are those of the plain stream until it.
    plain_deltas, kept_deltas = [], []
    _stream(engine, chat_prompts[3], plain, plain_deltas)
    kept, _, last = _stream(engine, chat_prompts[3], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                                    include_stop_str_in_output=True), kept_deltas)
    assert last.stop_reason == stop and kept == text[: text.index(stop) + len(stop)]
    assert kept_deltas[:-1] == plain_deltas[:len(kept_deltas) - 1]
    assert_all_free(engine)


def test_a_stop_tokens_text_is_not_the_answers_and_the_first_min_tokens_stop_no_string(builtin_path, chat_prompts):
    """vLLM's rules: the token that stops a sequence (a stop token id, or EOS shown with skip_special_tokens
    off) keeps its id but not its text, unless include_stop_str_in_output; a stop string ending in the text
    of the first min_tokens tokens stops nothing. Streamed deltas add up to the same text."""
    engine = _engine(builtin_path)
    greedy = engine.generate([chat_prompts[3]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    decode = engine.tokenizer.decode
    stop_tok = greedy.token_ids[4]
    upto = greedy.token_ids[:greedy.token_ids.index(stop_tok) + 1]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok],
                                include_stop_str_in_output=include)
        text, tokens, last = _stream(engine, chat_prompts[3], params)
        assert tokens == last.token_ids == upto and last.stop_reason == stop_tok
        assert text == last.text == decode(upto if include else upto[:-1])
    said = decode([stop_tok])   # included, the stop token's text is read for stop strings too (vLLM's): one wins
    assert said.strip() and said not in decode(upto[:-1])
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok], stop=[said],
                            include_stop_str_in_output=True)
    text, tokens, last = _stream(engine, chat_prompts[3], params)
    assert text == last.text == decode(upto) and last.stop_reason == said
    short = engine.generate([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    eos = short.token_ids[-1]
    assert short.finish_reason == "stop" and eos in engine.eos_token_ids
    for include in (False, True):
        shown = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False,
                               include_stop_str_in_output=include)
        text, tokens, last = _stream(engine, chat_prompts[2], shown)
        assert tokens == short.token_ids
        assert text == decode(tokens if include else tokens[:-1], skip_special_tokens=False)
    opening = decode(greedy.token_ids[:3])   # what the first three tokens say, found nowhere after them
    assert greedy.text.count(opening) == 1
    for min_tokens, want in ((2, ""), (3, greedy.text)):
        params = SamplingParams(temperature=0, max_tokens=12, stop=[opening], min_tokens=min_tokens)
        out = engine.generate([chat_prompts[3]], params)[0].outputs[0]
        assert out.text == want and out.stop_reason == (opening if want == "" else greedy.stop_reason), min_tokens
    assert_all_free(engine)


def test_siblings_end_with_a_first_sample_that_ends_before_its_prefill(tiny_path, monkeypatch):
    engine = _engine(tiny_path, block_size=8, num_blocks=4)
    monkeypatch.setattr(engine.schedulers["default"], "check_fits", lambda *args: None)  # let a too-large one in
    engine.add_request("big", list(range(3, 60)), SamplingParams(n=3, max_tokens=4))
    (out,) = engine.step()          # the scheduler ends the first sample: its pool can never hold it
    assert out.finished and "cannot hold" in out.error
    assert sorted(o.index for o in out.outputs) == [0, 1, 2]
    assert all(o.finish_reason == "length" and not o.token_ids for o in out.outputs)
    assert_all_free(engine)


class _HoldingDetokenizer:
    """A detokenizer that holds back all its text until the end, as an open byte-fallback run is held."""

    def __init__(self, stop_in_text: bool) -> None:
        self.text = "ab" + ("STOP" if stop_in_text else "") + "cd"

    def step(self, ids) -> str:
        return ""

    def held_text(self, max_chars: int) -> str:
        return ""

    def flush(self) -> str:
        return self.text


@pytest.mark.parametrize("stop_in_text", [False, True])
def test_a_sequence_its_pool_cannot_hold_once_it_grew_ends_with_the_text_its_detokenizer_held(
        tiny_path, monkeypatch, stop_in_text):
    """The scheduler ends a running sequence that grew past what its pool can hold (alone in it): its answer is the
    text it wrote, the text its detokenizer still held back included (it was dropped), cut at a stop string in it."""
    engine = _engine(tiny_path, block_size=8, num_blocks=4)   # 32 tokens
    monkeypatch.setattr(engine.schedulers["default"], "check_fits", lambda *args: None)  # let a too-large one in
    engine.add_request("grows", list(range(3, 23)), SamplingParams(temperature=0, max_tokens=30, stop=["STOP"],
                                                                  ignore_eos=True))
    engine.requests["grows"].detokenizers = [_HoldingDetokenizer(stop_in_text)]
    final = [out for _ in range(40) for out in engine.step() if out.finished]
    (out,) = final
    sample = out.outputs[0]
    assert "cannot hold" in out.error and 0 < len(sample.token_ids) < 30
    assert (sample.text, sample.finish_reason) == (("ab", "stop") if stop_in_text else ("abcd", "length"))
    assert_all_free(engine)


def test_aborting_before_the_siblings_fork_aborts_every_sample(tiny_path):
    engine = _engine(tiny_path, max_num_batched_tokens=16)
    engine.add_request("n3", list(range(3, 60)), SamplingParams(n=3, max_tokens=4))
    engine.step()                   # a first chunk of the prompt: the siblings have not forked yet
    out = engine.abort("n3")
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 3
    assert engine.schedulers["default"].stats.num_aborted == 1   # only the first sample was in the pool
    assert_all_free(engine)


def test_priority_and_max_num_seqs(tiny_path):
    engine = _engine(tiny_path, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("low", [1, 2, 3], p, priority=5)
    engine.add_request("high", [1, 2, 3], p, priority=-1)
    engine.add_request("normal", [1, 2, 3], p)
    order = []
    while engine.has_unfinished_requests():
        assert len(engine.schedulers["default"].running) <= 1
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "normal", "low"]
    assert_all_free(engine)


def test_pools_are_disjoint_block_ranges_of_one_kv_tensor(tiny_path):
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig

    config = EngineConfig(model=str(tiny_path), dtype="float32", cache=CacheConfig(block_size=8), pools=(
        PoolConfig("chat", num_blocks=20, scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128)),
        PoolConfig("rag", num_blocks=20, scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=160))))
    engine = LLMEngine(config, progress=False)
    chat, rag = engine.schedulers["chat"], engine.schedulers["rag"]
    assert (chat.block_manager.first_block, chat.block_manager.num_blocks) == (0, 20)
    assert (rag.block_manager.first_block, rag.block_manager.num_blocks) == (20, 20)
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # flood rag past its blocks: admitted together, the sequences outgrow the pool and it must preempt;
    # chat stays within its own range, unpreempted
    for i in range(4):
        engine.add_request(f"rag{i}", list(range(3, 43)), p, pool="rag")
    engine.add_request("chat0", [5, 6, 7], p, pool="chat")
    while engine.has_unfinished_requests():
        engine.step()
        for scheduler in (chat, rag):
            for seq in scheduler.running:
                assert all(scheduler.block_manager.owns(b) for b in seq.block_table)
    assert rag.stats.num_preemptions > 0 and chat.stats.num_preemptions == 0
    assert_all_free(engine)


def test_step_time_is_read_after_the_device_finished(tiny_path, monkeypatch):
    """A device that finishes its work later than the launch returns (CUDA): the step's measured time,
    which the composer's cost model and SLO feedback learn from, includes that work."""
    engine = _engine(tiny_path, enable_chunked_prefill=True, max_num_batched_tokens=16)
    runner, done_at = engine.runner, [0.0]
    launch = runner.execute

    def execute(batch):
        out = launch(batch)
        done_at[0] = time.perf_counter() + 0.05      # the kernels finish 50 ms after they were queued
        return out

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "synchronize", lambda: time.sleep(max(0.0, done_at[0] - time.perf_counter())))
    engine.add_request("r", list(range(3, 67)), SamplingParams(temperature=0, max_tokens=2))
    engine.step()                                      # a 16-token chunk of the 64-token prompt: nothing sampled
    assert engine.last_step.num_prefill_tokens == 16 and not engine.requests["r"].seqs[0].num_output_tokens
    assert engine.composer.stats.last_step_seconds >= 0.05 and engine.last_step.seconds >= 0.05
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_penalty_counts_kept_across_steps_equal_counting_afresh(tiny_path, monkeypatch):
    """The penalties read token counts the sampler keeps on the device from step to step (one scatter of
    the sampled tokens per step); counting every row afresh from its tokens each step must give the same
    tokens, through preemption (a recompute keeps the counts) and n > 1 forks. Only running sequences hold a
    row: one preempted (or finished before its siblings) gives it back at once and is counted again from its
    tokens if it runs again (they held theirs until their request ended: more rows than the capacity plan's
    headroom warning counts, in a preemption storm); none is left at the end."""
    from engine.penalties import PenaltyCounts

    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=0.7, logit_bias={9: 3.0}),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, ignore_eos=True, frequency_penalty=-0.5,
                             repetition_penalty=0.8, logprobs=2)]
    prompts = [[5, 6, 7, 5, 5], [11, 12, 13, 14], [20, 21, 20, 22]]

    def run(kept: bool) -> list[list[list[int]]]:
        engine = _engine(tiny_path, block_size=8, num_blocks=16)   # too few for all four: some are preempted
        if not kept:
            real_rows = PenaltyCounts.rows
            monkeypatch.setattr(PenaltyCounts, "rows", lambda self, rows: real_rows(
                self, [type(r)(**{**r.__dict__, "key": None}) for r in rows]))
        step = engine.step

        def checked_step():
            outputs = step()
            running = {seq.seq_id for scheduler in engine.schedulers.values() for seq in scheduler.running}
            held = set(engine.sampler.penalties._rows) if engine.sampler.penalties is not None else set()
            assert held <= running, (held, running)
            return outputs

        engine.step = checked_step
        outs = engine.generate(prompts, params)
        monkeypatch.undo()
        assert engine.schedulers["default"].stats.num_preemptions > 0
        assert len(engine.sampler.penalties) == 0   # every sequence's row released
        assert_all_free(engine)
        return [[o.token_ids for o in out.outputs] for out in outs]

    kept = run(True)
    assert kept == run(False)
    plain = _engine(tiny_path).generate([prompts[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert kept[0][0] != plain[0].outputs[0].token_ids   # the penalty changed the output


def test_a_plan_the_gpu_cannot_hold_now_is_refused_with_its_numbers(monkeypatch):
    """On CUDA, before the KV tensor is allocated: a plan beyond memory_utilization of the GPU less the loaded
    weights, or beyond what the driver has free now (another process holds it: a worker of this device still
    ending), is a ConfigError with the numbers, not an out-of-memory error in the middle of the allocation.
    The CUDA queries are stood in for (no GPU here)."""
    from types import SimpleNamespace

    from engine.config import ConfigError
    from engine.kv_cache import check_fits_device

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 16 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 16 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (64 * gib, 80 * gib))
    cuda = torch.device("cuda:0")
    check_fits_device(torch.device("cpu"), 10**9, 1 << 20, 0.9)   # the CPU: nothing to check
    check_fits_device(cuda, 50 * 1024, 1 << 20, 0.9)               # 50 GiB of 0.9 x 80 - 16 = 56
    with pytest.raises(ConfigError, match="leaves 56.00 GiB on cuda:0"):
        check_fits_device(cuda, 60 * 1024, 1 << 20, 0.9)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30 * gib, 80 * gib))   # 34 GiB held elsewhere
    with pytest.raises(ConfigError, match="30.00 GiB free now: 34.00 GiB are held outside this worker"):
        check_fits_device(cuda, 50 * 1024, 1 << 20, 0.9)
    with pytest.raises(ConfigError, match="30.00 GiB free now"):
        check_fits_device(cuda, 33 * 1024, 1 << 20, 0.9)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 20 * gib)   # 4 GiB torch holds free: ours
    check_fits_device(cuda, 33 * 1024, 1 << 20, 0.9)
