"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the ones before it, the
transformers model's own log-softmax the yardstick, however the prompt is computed (in chunks, beside other
requests, after a preemption, with its prefix in the cache, n > 1)."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-prompt-lp"), "llama", builtin_path, initializer_range=0.05)


@pytest.fixture(scope="module")
def hf_logprobs(tiny):
    """transformers' log-softmax of its logits at every position of a prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _engine(path, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 256)
    return LLMEngine.from_args(str(path), progress=False, dtype="float32", block_size=16, **kwargs)


def _assert_like_hf(out, prompt: list[int], k: int, hf_logprobs) -> None:
    want = hf_logprobs(prompt)
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    chosen = want[:-1].gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), chosen, atol=2e-4, rtol=0)
    top = want[:-1].topk(k, dim=-1)
    for i, entries in enumerate(out.prompt_top_logprobs):
        assert [t for t, _ in entries] == top.indices[i].tolist(), i
        torch.testing.assert_close(torch.tensor([v for _, v in entries]), top.values[i], atol=2e-4, rtol=0)


PROMPTS = [[1, *range(40, 40 + 70)], [1, 7, 9, 11], [1, *range(300, 300 + 37)]]


def test_prompt_logprobs_match_transformers_in_chunks_beside_other_requests(tiny, hf_logprobs):
    engine = _engine(tiny, max_num_batched_tokens=32)   # the 70-token prompt in three chunks, shared steps
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k) for k in (5, 0, 2)]
    plain = SamplingParams(max_tokens=3, temperature=0)
    outs = engine.generate([*PROMPTS, PROMPTS[0]], [*params, plain])
    for out, prompt, p in zip(outs, PROMPTS, params):
        _assert_like_hf(out, prompt, p.prompt_logprobs, hf_logprobs)
    assert outs[3].prompt_logprobs is None
    assert outs[3].outputs[0].token_ids == outs[0].outputs[0].token_ids   # the answers are unchanged
    assert_all_free(engine)


def test_a_cached_prefix_is_computed_again_and_n_samples_report_once(tiny, hf_logprobs):
    engine = _engine(tiny)   # prefix caching on (the default)
    prompt = PROMPTS[0]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))   # its blocks now in the cache
    engine.add_request("r", prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3, prompt_logprobs=1))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(RequestDelta.from_output(out))
            final = out
    assert final.num_cached_tokens == 0   # nothing taken from the cache
    _assert_like_hf(final, prompt, 1, hf_logprobs)
    carried = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0].prompt_logprobs == final.prompt_logprobs
    assert len(final.outputs) == 3
    again = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert again.num_cached_tokens > 0   # (where a request without them takes its prefix from the cache)
    assert_all_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_preempted_prompt_keeps_its_logprobs_once(tiny, hf_logprobs, overlap):
    """A pool of a few blocks: the long prompts preempt each other and are computed again (with overlapped
    steps, some while the step that computed them is still in flight); each position's logprob is kept once,
    and equal to transformers'."""
    engine = _engine(tiny, num_blocks=12, max_num_batched_tokens=32, async_scheduling=overlap)
    assert engine.overlap is overlap
    prompts = [[1, *range(60 + i, 60 + i + 90)] for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2))
    assert sum(s.stats.num_preemptions for s in engine.schedulers.values()) > 0
    for out, prompt in zip(outs, prompts):
        _assert_like_hf(out, prompt, 2, hf_logprobs)
    assert_all_free(engine)


def test_prompt_logprobs_out_of_range_are_refused_by_name():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
