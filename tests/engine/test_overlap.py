"""Overlapped steps (`engine.overlap`): step N+1 is scheduled and launched before step N's tokens are read.

On a CPU the launch computes the step, so overlap hides nothing there; `async_scheduling=True` still runs
the whole path (placeholders filled on the device, stops a step late, the prefix cache waiting for known
tokens), and every scenario must give exactly what the engine gives without it.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.overlap import fill_pending, overlap_applies
from engine.sampler import Sampler, SampledTokens
from engine.sampling import SamplingParams
from engine.sequence import pending_token
from tests.conftest import assert_all_free, launches_never_sync, make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", builtin_path, initializer_range=0.05)


def _engine(path, overlap: bool | None, num_blocks: int = 256, block_size: int = 8, device: str = "cpu",
            **sched) -> LLMEngine:
    """One pool of `num_blocks`; `sched`: its SchedulerConfig fields."""
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=str(path), device=device, cache=CacheConfig(block_size=block_size),
                                  pools=(pool,), async_scheduling=overlap), progress=False)


def _result(out, reference: bool = False) -> list[tuple]:
    """Each sample's tokens, text and ending, to compare exactly; its logprobs to float32 rounding in the
    `reference` (a step that computes a stopped sequence's extra token is a larger batch, which the
    matmuls round differently)."""
    def near(value: float):
        return pytest.approx(value, abs=1e-5) if reference else value

    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [near(v) for v in c.logprobs],
             None if c.top_logprobs is None else [[(t, near(v)) for t, v in top] for top in c.top_logprobs])
            for c in sorted(out.outputs, key=lambda c: c.index)]


def _generate_streamed(engine: LLMEngine, prompts, params) -> list:
    """`engine.generate`, asserting that each sample's streamed deltas (what a client gets: ids, logprobs,
    text, `num_tokens`) add up to its final output."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    streamed: dict[tuple[str, int], list] = {}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                ids, logprobs, text = streamed.setdefault((out.request_id, c.index), [[], [], ""])
                ids += c.delta_token_ids
                logprobs += c.delta_logprobs or []
                streamed[out.request_id, c.index][2] = text + c.delta_text
                assert c.num_tokens == len(ids) and all(t >= 0 for t in ids), (out.request_id, ids)
            if out.finished:
                final[out.request_id] = out
    for (request_id, index), (ids, logprobs, text) in streamed.items():
        c = next(c for c in final[request_id].outputs if c.index == index)
        assert (ids, logprobs, text) == (c.token_ids, c.logprobs or [], c.text), (request_id, index)
    return [final[f"r{i}"] for i in range(len(prompts))]


def _run_both(path, prompts, params, **kwargs) -> tuple[list, LLMEngine]:
    """Outputs without and with overlap (which must match, streamed and whole), and the overlapped engine."""
    results = []
    for overlap in (False, True):
        engine = _engine(path, overlap, **kwargs)
        assert engine.overlap is overlap
        results.append([_result(o, reference=not overlap) for o in _generate_streamed(engine, prompts, params)])
        assert_all_free(engine)
    assert results[0] == results[1]
    return results[1], engine


PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 20, 22], [30 + i for i in range(30)],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def _mixed_params(tok_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, stop=[tok_text], repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=25, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.4, logprobs=1),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=30, min_tokens=5, stop_token_ids=[40, 41]),
    ]


def _stop_text(path) -> str:
    """A string the greedy output of PROMPTS[1] contains early (so a stop string fires mid-run)."""
    engine = _engine(path, False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    text = engine.generate([PROMPTS[1]], params)[0]
    return text.outputs[0].text[4:7] or text.outputs[0].text[:2]


def test_overlap_gives_the_same_outputs(tiny_path):
    outs, engine = _run_both(tiny_path, PROMPTS, _mixed_params(_stop_text(tiny_path)))
    assert outs[1][0][3] == "stop" and outs[3][0][3] == "length" and len(outs[2]) == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overlap_through_preemption(tiny_path, mode):
    # 24 blocks of 8 tokens for five sequences growing to ~60 tokens: the pool must preempt
    params = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True, repetition_penalty=1.2, logprobs=2)
    swap = {"swap_space_bytes": 64 << 20} if mode == "swap" else {}
    _, engine = _run_both(tiny_path, PROMPTS, params, num_blocks=24, preemption_mode=mode, **swap)
    stats = engine.schedulers["default"].stats
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0) == (mode == "swap")


def test_overlap_with_prefix_caching_and_chunks(tiny_path):
    shared = list(range(40, 80))
    prompts = [shared + [90 + i] for i in range(4)] + [shared[:20]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    _, engine = _run_both(tiny_path, prompts, params, max_num_batched_tokens=24)
    bm = engine.schedulers["default"].block_manager
    assert bm.num_prefix_hits > 0


def test_overlap_reads_each_step_after_launching_the_next(tiny_path, monkeypatch):
    """The order that hides the host work: launch N+1, then read N's tokens; placeholders are filled
    from N's ids on the device, never from the host."""
    engine = _engine(tiny_path, True)
    events, fills = [], []
    execute, output = engine.runner.execute, SampledTokens.output

    def launch(batch):
        events.append("launch")
        return execute(batch)

    def read(self):
        events.append("read")
        return output(self)

    def fill(ids, sampled):
        fills.append(int((ids < 0).sum()))
        return fill_pending(ids, sampled)

    monkeypatch.setattr(engine.runner, "execute", launch)
    monkeypatch.setattr(SampledTokens, "output", read)
    monkeypatch.setattr("engine.model_runner.fill_pending", fill)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # prefill (launch), then each decode launched before the step before it is read; the last read alone
    assert events[:4] == ["launch", "launch", "read", "launch"] and events[-1] == "read"
    assert events.count("launch") == 6 and events.count("read") == 6   # max_tokens: no token past the limit
    assert fills == [2] * 5


def test_overlapped_steps_seconds_add_up_to_the_time_they_took(tiny_path):
    """A step read a call after its launch ran beside the step before: its seconds count from that one's
    end, so a benchmark's or a calibration's step times add up to the time they took, not twice it."""
    import time

    engine = _engine(tiny_path, True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen, total, started = engine.last_step, 0.0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not seen:
            seen = engine.last_step
            total += seen.seconds
    wall = time.perf_counter() - started
    assert 0.5 * wall <= total <= 1.05 * wall, (total, wall)
    assert_all_free(engine)


def test_a_stop_a_step_late_drops_the_extra_token(tiny_path):
    """A sequence that stops on EOS-like stop ids was already scheduled once more: that token is computed,
    dropped, and its blocks freed; the output ends at the stop."""
    engine = _engine(tiny_path, False)
    first = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_id = first.outputs[0].token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id])
    outs, engine = _run_both(tiny_path, [PROMPTS[0]], params)
    assert outs[0][0][1][-1] == stop_id and len(outs[0][0][1]) == 4 and outs[0][0][4] == stop_id
    assert engine.schedulers["default"].stats.num_computed_tokens == len(PROMPTS[0]) + 4   # one token dropped


def test_abort_while_a_step_is_in_flight(tiny_path):
    engine = _engine(tiny_path, True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9, 10], params)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    final = engine.abort("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert all(t >= 0 for t in final.outputs[0].token_ids)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"b"} and outputs[-1].finished
    while engine.has_work():   # the step in flight when "b" ended settles
        engine.step()
    assert_all_free(engine)


def test_fill_pending_and_placeholders():
    sampled = torch.tensor([70, 71, 72])
    ids = torch.tensor([5, pending_token(2), 6, pending_token(0)])
    assert fill_pending(ids, sampled).tolist() == [5, 72, 6, 70]


def test_sampled_tokens_read_later_equal_the_call():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    from engine.sampling import SamplingRow

    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2), None, 0, frozenset({2})) for _ in range(4)]
    launched = Sampler().launch(logits, rows)
    assert launched.token_ids.tolist() == logits.argmax(-1).tolist()
    assert launched.output() == Sampler()(logits, rows)


def test_where_overlap_applies():
    assert overlap_applies(None, torch.device("cuda")) and not overlap_applies(None, torch.device("cpu"))
    assert overlap_applies(True, torch.device("cpu")) and not overlap_applies(False, torch.device("cuda"))
    EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_is_launched_without_waiting_for_the_device(tiny_path, monkeypatch):
    """On by default on CUDA; launching a step (its inputs, the forward pass, the sampling, the copies of
    its tokens) never synchronizes the stream, so the host prepares step N+1 while the device runs step N;
    greedy output as without overlap, penalties and logprobs included."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2, logprobs=2)
    plain = _engine(tiny_path, False, device="cuda")
    reference = [_result(o, reference=True) for o in plain.generate(PROMPTS, params)]
    engine = _engine(tiny_path, None, device="cuda")
    assert engine.overlap
    engine.generate(PROMPTS[:1], params)   # the first penalized rows, kernels compiled
    launches_never_sync(monkeypatch, engine)
    assert [_result(o) for o in engine.generate(PROMPTS, params)] == reference
    assert_all_free(engine)


def test_a_sequence_short_of_blocks_waits_for_those_an_ending_one_gives_back_a_step_later(tiny_path):
    """4 blocks of 16: e (30 + 2 tokens) and s (31 + 10) fill them; at s's 33rd token e's last is in flight.
    s needs a block that e frees when that token lands: it waits a step for it, and nobody is preempted (s was
    its own victim: its KV recomputed, or swapped out and in)."""
    prompts = [list(range(5, 35)), list(range(40, 71))]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    outputs, engine = _run_both(tiny_path, prompts, params, num_blocks=4, block_size=16, max_num_batched_tokens=64)
    assert engine.schedulers["default"].stats.num_preemptions == 0
    assert [len(o[0][1]) for o in outputs] == [2, 10]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_block_filled_by_a_requests_last_step_stays_in_the_prefix_cache(tiny_path, overlap):
    """A prompt of 5 and 4 tokens out, blocks of 8: the step computing position 7 closes block 0 while (with
    overlap) the token it read was still in flight, so its commit left the block; the request then ended
    without another step and the block was freed uncached. It is cached at the end, as without overlap: the
    conversation's next turn finds it."""
    engine = _engine(tiny_path, overlap)
    prompt = [5, 6, 7, 8, 9]
    first = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    bm = engine.schedulers["default"].block_manager
    assert bm.num_cached_free_blocks == 1
    turn = prompt + list(first.outputs[0].token_ids)[:3] + [11]
    again = engine.generate([turn], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    assert again.num_cached_tokens == 8
