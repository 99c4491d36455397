"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the ones before it, the
transformers model's own log-softmax the yardstick, however the prompt is computed (in chunks, beside other
requests, after a preemption, with its prefix in the cache, n > 1)."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, launches_never_sync, make_tiny_model


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


def _assert_like_hf(out, prompt: list[int], k: int, hf_logprobs, atol: float = 2e-4) -> None:
    """`out`'s prompt logprobs are transformers' within `atol`, its top ids too but where two are closer than
    that (a CUDA run's TF32 tiles may order a near tie either way)."""
    want = hf_logprobs(prompt)
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    chosen = want[:-1].gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), chosen, atol=atol, rtol=0)
    top = want[:-1].topk(k + 1, dim=-1)
    for i, entries in enumerate(out.prompt_top_logprobs):
        values = top.values[i]
        torch.testing.assert_close(torch.tensor([v for _, v in entries]), values[:k], atol=atol, rtol=0)
        for j, (token, _) in enumerate(entries):
            apart = (j == 0 or values[j - 1] - values[j] > 2 * atol) and values[j] - values[j + 1] > 2 * atol
            assert token == top.indices[i][j] or not apart, (i, j)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_prompt_logprobs_keep_the_overlap_and_match_transformers(tiny, hf_logprobs, monkeypatch):
    """Overlapped steps on CUDA: launching a step that computes prompt logprobs never synchronizes the stream
    (their rows go up and their results come down queued, an event marks them), and they match transformers'."""
    engine = _engine(tiny, num_blocks=12, max_num_batched_tokens=32, device="cuda")
    assert engine.overlap
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))   # compiled
    launches_never_sync(monkeypatch, engine)
    prompts = [[1, *range(60 + i, 60 + i + 90)] for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2))
    for out, prompt in zip(outs, prompts):
        _assert_like_hf(out, prompt, 2, hf_logprobs, atol=1e-2)
    assert_all_free(engine)


def test_prompt_logprobs_out_of_range_are_refused_by_name():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
