"""Each request's prefix-cache hit: counted by the engine at its first admission
(`RequestOutput.num_cached_tokens`), carried by the final `RequestDelta` over the worker protocol, and
answered as OpenAI's `usage.prompt_tokens_details.cached_tokens` (`LocalResponse.cached_tokens`)."""

from __future__ import annotations

import random
import uuid

import msgspec
import openai
import pytest

from engine import wire
from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.messages import Outputs
from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from pools.config.yaml_file import load_config
from tests.conftest import assert_all_free, make_tiny_model
from tests.gateway.conftest import DEFAULT_CONFIG

BS = 16
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-cached"), "llama", builtin_path)


def _make_engine(path, num_blocks: int = 256, **sched) -> LLMEngine:
    """One pool of `num_blocks` blocks of BS tokens, prefix caching on (the default)."""
    sched.setdefault("max_num_batched_tokens", 256)
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=BS), pools=(pool,)), progress=False)


def _make_prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(num_tokens)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# --- the engine ------------------------------------------------------------------------------------------

def test_a_repeated_prompt_reports_its_cached_blocks_once_per_request(tiny):
    engine = _make_engine(tiny)
    prompt = _make_prompt(1, 70)   # 4 full blocks and 6 tokens
    first, second = (engine.generate([prompt], _greedy(3))[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    cached = second.num_cached_tokens
    assert 0 < cached <= len(prompt) and cached % BS == 0
    assert cached == (len(prompt) - 1) // BS * BS == 64   # every full block; the last token is always computed
    # n > 1: the samples fork from one prefill, so the request's hit counts once, not once per sample
    forked = engine.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3,
                                                      ignore_eos=True))[0]
    assert len(forked.outputs) == 3 and forked.num_cached_tokens == cached
    # another prompt sharing only the first two blocks gets those two
    other = engine.generate([prompt[:2 * BS] + _make_prompt(2, 30)], _greedy(2))[0]
    assert other.num_cached_tokens == 2 * BS
    assert_all_free(engine)


def test_a_recompute_after_preemption_keeps_the_first_admissions_figure(tiny):
    # 9 blocks: B (30 + 60 tokens) and A (40 + 40) cannot both finish; A, admitted last, is the victim
    engine = _make_engine(tiny, num_blocks=9)
    bm = engine.schedulers["default"].block_manager
    prompt_a, prompt_b = _make_prompt(3, 40), _make_prompt(4, 30)
    assert engine.generate([prompt_a], _greedy(1))[0].num_cached_tokens == 0   # A's prompt now cached
    engine.add_request("B", prompt_b, _greedy(60))
    engine.add_request("A", prompt_a, _greedy(40))
    seq_a = engine.requests["A"].seqs[0]
    hits_before = bm.num_prefix_hits
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert seq_a.num_preemptions >= 1
    # the readmission found more in the cache (its prompt and its own output's full blocks) ...
    assert bm.num_prefix_hits - hits_before > 2 * 2 * BS
    # ... but the request reports what the cache gave it when first admitted
    assert final["A"].num_cached_tokens == 2 * BS and final["B"].num_cached_tokens == 0
    assert len(final["A"].outputs[0].token_ids) == 40
    assert_all_free(engine)


def test_the_final_delta_carries_it_over_the_wire(tiny):
    engine = _make_engine(tiny)
    prompt = _make_prompt(6, 50)
    engine.generate([prompt], _greedy(1))
    engine.add_request("r", prompt, _greedy(4))
    deltas = []
    while engine.has_unfinished_requests():
        frame = wire.encode(Outputs([RequestDelta.from_output(out) for out in engine.step()]))
        deltas += wire.decode(frame).deltas
    assert [d.finished for d in deltas] == [False, False, False, True]
    assert [d.num_cached_tokens for d in deltas] == [0, 0, 0, 3 * BS]   # sent once, with the final delta
    # a frame from a worker without the field still decodes (0: nothing known)
    old = msgspec.msgpack.encode(("Outputs", {"deltas": [{"request_id": "r", "outputs": [], "finished": True}]}))
    assert wire.decode(old).deltas[0].num_cached_tokens == 0
    assert_all_free(engine)


# --- the gateway, with the openai SDK ---------------------------------------------------------------------

@pytest.fixture
def sdk(live_builtin_server):
    return openai.OpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(sdk):
    block_size = load_config(DEFAULT_CONFIG).pool("chat").block_size
    # a fresh first block (the id), so that nothing cached before this test matches
    notes = f"Survey {uuid.uuid4().hex}. " + " ".join(f"Cliff {i} retreats {i % 7} cm a year." for i in range(10))
    messages = [{"role": "system", "content": notes}, {"role": "user", "content": "Which cliff retreats fastest?"}]
    first, second = (sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
                     for _ in range(2))
    num_prompt = first.usage.prompt_tokens
    full_blocks = (num_prompt - 1) // block_size * block_size
    assert num_prompt > 2 * block_size and second.usage.prompt_tokens == num_prompt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == num_prompt
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks
    assert all(c.usage is None for c in chunks[:-1])
