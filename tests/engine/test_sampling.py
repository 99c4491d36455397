"""Sampling parameters and the sampler: validation, greedy, allowed sets, distributions, seeds, min_tokens, logprobs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine.sampler import Sampler, SamplerOutput, _apply_top_p, argmax
from engine.sampling import SamplingParams, SamplingRow, make_generator

EOS = 3
STOP_ID = 7


def _make_row(params: SamplingParams, *, index: int = 0, num_output_tokens: int = 0,
              eos_token_ids: frozenset[int] = frozenset({EOS}), token_ids: list[int] = ()) -> SamplingRow:
    generator = None if params.seed is None else make_generator(params.seed, index, "cpu")
    return SamplingRow(params, generator, num_output_tokens, eos_token_ids, token_ids)


def _make_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def _make_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(probs: list[float], params: SamplingParams, num_draws: int) -> torch.Tensor:
    """Token counts over num_draws rows of the same logits log(probs): [vocab]."""
    logits = torch.tensor(probs).log().expand(num_draws, -1).contiguous()  # [num_draws, vocab]
    out = _make_sampler()(logits, [_make_row(params)] * num_draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(probs))

# chi-square's 99.9th percentile by degrees of freedom (0: one token, nothing to test)
CHI2_999 = {0: 1e-9, 1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _assert_matches_distribution(counts: torch.Tensor, expected: list[float]) -> None:
    """Pearson chi-square over the tokens with non-zero probability; zero-probability tokens never drawn."""
    total = int(counts.sum())
    chi2 = 0.0
    for count, p in zip(counts.tolist(), expected):
        if p == 0:
            assert count == 0, f"drew a token of probability 0: counts {counts.tolist()}"
        else:
            chi2 += (count - total * p) ** 2 / (total * p)
    dof = sum(p > 0 for p in expected) - 1
    # the 99.9th percentile of chi-square with `dof` degrees of freedom; a fixed seed makes this deterministic
    assert chi2 < CHI2_999[dof], f"chi2={chi2:.1f} (dof {dof}); counts {counts.tolist()} vs {expected}"


def _seeded_tokens(batch: list[SamplingRow], logits: torch.Tensor, position: int, num_steps: int,
                   sampler: Sampler) -> list[int]:
    """The token of row `position` over num_steps calls on the same logits."""
    return [sampler(logits, batch).token_ids[position] for _ in range(num_steps)]


# --- SamplingParams -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1e29}, "temperature"),   # a grammar's masked tokens came in reach
    ({"stop": ["ok", "\ud800"]}, "stop"),    # no text holds a lone surrogate (the wire refused it, late)
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"seed": "42"}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),   # 0 in float32: a seen token's logit / 0 = inf
    ({"repetition_penalty": 1e7}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5]"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_params_reject_bad_value_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(f"{field}:"), str(exc.value)


def test_params_normalise_and_accept_edges() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[5, 6], temperature=1, top_k=-1, max_tokens=None,
                            min_tokens=100, logprobs=0, top_p=1.0, min_p=1.0, seed=-3)
    assert params.stop == ("END",)
    assert params.stop_token_ids == (5, 6)
    assert isinstance(params.temperature, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(params) == hash(SamplingParams(**{f: getattr(params, f) for f in params.__dataclass_fields__}))
    with pytest.raises(AttributeError):
        params.n = 2  # type: ignore[misc]


def test_logit_bias_takes_json_keys_and_pairs_alike() -> None:
    assert SamplingParams(logit_bias={"7": 1, "2": -100}).logit_bias == ((2, -100.0), (7, 1.0))
    assert SamplingParams(logit_bias=[(7, 1), (2, -100)]) == SamplingParams(logit_bias={"2": -100, "7": 1.0})
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(repetition_penalty=1.1).adjusts_logits


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True),
    ({"top_k": 1}, True),
    ({"temperature": 0.7}, False),
    ({"temperature": 0.7, "top_k": 2}, False),
])
def test_params_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


# --- greedy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_greedy_equals_argmax(dtype: torch.dtype, logprobs: int | None) -> None:
    logits = _make_logits(8, 1000).to(dtype)
    rows = [_make_row(SamplingParams(temperature=0.0, logprobs=logprobs))] * 8
    out = _make_sampler()(logits, rows)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert all(type(t) is int for t in out.token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torchs_on_ties_nans_infinities_and_masked_rows(dtype: torch.dtype) -> None:
    """The sampler's `argmax` (`max`'s indices on a CPU) picks the index torch's argmax does: the first of
    tied values, the first NaN, +inf over the rest, index 0 of a row of -inf; on a strided view and a vector."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        x = torch.randint(-3, 4, (37, 2000), generator=gen).to(dtype)   # every row has many ties
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=gen) < 1e-3] = math.nan
        if trial % 4 == 0:
            x[torch.rand(x.shape, generator=gen) < 1e-2] = math.inf
        x[trial % 37] = -math.inf                                        # a row every token of is masked
        assert torch.equal(argmax(x), x.argmax(dim=-1)), trial
        assert torch.equal(argmax(x[:, ::3]), x[:, ::3].argmax(dim=-1)), trial
    vector = torch.randn(5000, generator=gen).to(dtype)
    assert argmax(vector).item() == vector.argmax().item()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, temperature=1.5),
                                    SamplingParams(temperature=1e-3)])
def test_top_k_one_and_tiny_temperature_are_greedy(params: SamplingParams) -> None:
    logits = _make_logits(64, 500)
    best = logits.argmax(dim=-1)
    logits[torch.arange(64), best] += 0.5  # a clear winner: at temperature 1e-3 the runner-up gets e^-500
    out = _make_sampler()(logits, [_make_row(params)] * 64)
    assert out.token_ids == best.tolist()


# --- allowed sets -------------------------------------------------------------------------------

def test_top_k_samples_only_the_top_k() -> None:
    logits = _make_logits(1, 50).expand(4000, -1).contiguous()  # [4000, 50]
    allowed = set(logits[0].topk(5).indices.tolist())
    out = _make_sampler()(logits, [_make_row(SamplingParams(top_k=5, temperature=2.0))] * 4000)
    assert set(out.token_ids) == allowed


@pytest.mark.parametrize("top_p, allowed", [(0.8, {0, 1, 2}), (0.7, {0, 1}), (0.01, {0}), (0.0, {0}),
                                            (1.0, {0, 1, 2, 3, 4})])
def test_top_p_samples_only_the_nucleus(top_p: float, allowed: set[int]) -> None:
    probs = [0.4, 0.3, 0.2, 0.05, 0.05]  # cumulative 0.4, 0.7, 0.9, 0.95, 1.0
    counts = _draw(probs, SamplingParams(top_p=top_p), 4000)
    assert {t for t, c in enumerate(counts.tolist()) if c} == allowed


def test_top_p_one_keeps_tail_in_a_top_p_batch() -> None:
    # In float32 the top token's probability rounds to 1.0, so a bound of exactly 1.0 would drop the tail.
    logits = torch.tensor([[0.0, -30.0, -30.0], [0.0, -30.0, -30.0]])  # [2, 3]
    _apply_top_p(logits, [1.0, 0.5])
    assert logits[0].tolist() == [0.0, -30.0, -30.0]
    assert logits[1].tolist() == [0.0, -math.inf, -math.inf]


def test_a_row_of_non_finite_logits_does_not_fail_the_step() -> None:
    """A model's overflow gives one request NaN (or inf) logits: its top-p keeps nothing. The step must still
    sample every row (it failed with an index of -1, ending the worker and every request in it)."""
    logits = _make_logits(3, 64)
    logits[1] = math.nan
    logits[2, :5] = math.inf
    rows = [_make_row(SamplingParams(temperature=0.7, top_p=0.9, seed=1))] * 3
    good = _make_sampler()(logits[:1].clone(), rows[:1]).token_ids[0]
    tokens = _make_sampler()(logits, rows).token_ids
    assert tokens[0] == good and all(0 <= t < 64 for t in tokens)


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]  # min_p 0.25 -> threshold 0.125
    counts = _draw(probs, SamplingParams(min_p=0.25), 4000)
    assert {t for t, c in enumerate(counts.tolist()) if c} == {0, 1, 2}


def test_per_row_params_in_one_batch() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    cases = [  # (params, allowed)
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.6), {0, 1}),
        (SamplingParams(), {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=0.0), {0}),
        (SamplingParams(top_k=4, top_p=0.75, seed=1), {0, 1, 2}),
    ]
    num_repeats = 1000
    rows = [_make_row(p) for p, _ in cases] * num_repeats
    logits = probs.log().expand(len(rows), -1).contiguous()  # [rows, 5]
    tokens = torch.tensor(_make_sampler()(logits, rows).token_ids).view(num_repeats, len(cases))
    for j, (_, allowed) in enumerate(cases):
        assert set(tokens[:, j].tolist()) == allowed, cases[j][0]


# --- distributions ------------------------------------------------------------------------------

PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), PROBS),
    (SamplingParams(temperature=2.0), [p ** 0.5 / sum(q ** 0.5 for q in PROBS) for p in PROBS]),
    (SamplingParams(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0, 0.0]),
    (SamplingParams(top_k=2), [2 / 3, 1 / 3, 0.0, 0.0, 0.0]),
    (SamplingParams(min_p=0.2), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0, 0.0]),
    # vLLM v1's order: min-p (0.4 x 0.5 leaves 0.5 and 0.25), then top-p of what is left (2/3 >= 0.6: one
    # token); top-p first would keep two (0.5 + 0.25 of the whole mass)
    (SamplingParams(min_p=0.4, top_p=0.6), [1.0, 0.0, 0.0, 0.0, 0.0]),
])
def test_empirical_distribution_matches(params: SamplingParams, expected: list[float]) -> None:
    _assert_matches_distribution(_draw(PROBS, params, 20_000), expected)


def test_seeded_rows_follow_the_distribution() -> None:
    logits = torch.tensor(PROBS).log().expand(2000, -1).contiguous()  # [2000, 5]
    rows = [_make_row(SamplingParams(seed=s)) for s in range(2000)]
    counts = torch.bincount(torch.tensor(_make_sampler()(logits, rows).token_ids), minlength=5)
    _assert_matches_distribution(counts, PROBS)


# --- seeds --------------------------------------------------------------------------------------

def test_same_seed_same_tokens_across_samplers() -> None:
    logits = _make_logits(1, 1000) / 3  # flat enough that tokens vary
    runs = []
    for sampler_seed in (0, 1):
        row = _make_row(SamplingParams(seed=1234))
        runs.append(_seeded_tokens([row], logits, 0, 20, _make_sampler(sampler_seed)))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5


@pytest.mark.parametrize("params", [
    SamplingParams(seed=7),
    SamplingParams(seed=7, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, logprobs=3),
])
@pytest.mark.parametrize("position", [0, 5])
def test_seeded_row_independent_of_batch(params: SamplingParams, position: int) -> None:
    vocab_size = 1000
    logits = _make_logits(1, vocab_size) / 3                      # [1, vocab]
    alone = _seeded_tokens([_make_row(params)], logits, 0, 10, _make_sampler(0))

    others = [
        SamplingParams(), SamplingParams(seed=8), SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, temperature=1.3), SamplingParams(seed=9, top_k=3),
        SamplingParams(min_p=0.3, min_tokens=2), SamplingParams(logprobs=5),
    ]
    batch = [_make_row(p) for p in others]
    batch.insert(position, _make_row(params))
    batch_logits = _make_logits(len(batch), vocab_size, seed=1) / 3  # [8, vocab]
    batch_logits[position] = logits[0]
    in_batch = _seeded_tokens(batch, batch_logits, position, 10, _make_sampler(1))
    assert in_batch == alone


def test_distinct_seed_index_pairs_give_distinct_streams() -> None:
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]  # (0, 1) and (1, 0) collide under seed + index
    draws = [torch.rand(8, generator=make_generator(s, i, "cpu")) for s, i in pairs]
    for a in range(len(pairs)):
        for b in range(a + 1, len(pairs)):
            assert not torch.equal(draws[a], draws[b]), (pairs[a], pairs[b])
    assert torch.equal(draws[1], torch.rand(8, generator=make_generator(0, 1, torch.device("cpu"))))


def test_samples_of_one_seeded_request_differ() -> None:
    params = SamplingParams(n=2, seed=5)
    rows = [_make_row(params, index=0), _make_row(params, index=1)]
    logits = torch.zeros(2, 1000)  # uniform
    sampler = _make_sampler()
    tokens = [sampler(logits, rows).token_ids for _ in range(10)]
    assert [t[0] for t in tokens] != [t[1] for t in tokens]


def test_unseeded_rows_reproducible_with_shared_generator() -> None:
    logits = _make_logits(16, 1000) / 3
    rows = [_make_row(SamplingParams())] * 16
    assert _make_sampler(3)(logits, rows).token_ids == _make_sampler(3)(logits, rows).token_ids


# --- min_tokens ---------------------------------------------------------------------------------

def _min_tokens_logits(num_rows: int) -> torch.Tensor:
    """EOS far ahead, then STOP_ID, then token 1; everything else far behind: [num_rows, 10]."""
    logits = torch.full((num_rows, 10), -10.0)
    logits[:, EOS], logits[:, STOP_ID], logits[:, 1] = 10.0, 9.0, 8.0
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=[STOP_ID])
    sampler = _make_sampler()
    for num_output_tokens in (0, 1):
        out = sampler(_min_tokens_logits(500), [_make_row(params, num_output_tokens=num_output_tokens)] * 500)
        assert EOS not in out.token_ids and STOP_ID not in out.token_ids
    out = sampler(_min_tokens_logits(500), [_make_row(params, num_output_tokens=2)] * 500)
    assert EOS in out.token_ids


def test_min_tokens_masks_every_eos_id() -> None:
    logits = _min_tokens_logits(1)
    logits[0, 4] = 9.5
    row = _make_row(SamplingParams(temperature=0.0, min_tokens=1), eos_token_ids=frozenset({EOS, 4}))
    assert _make_sampler()(logits, [row]).token_ids == [STOP_ID]


def test_min_tokens_with_ignore_eos_leaves_eos_but_masks_stop_ids() -> None:
    # Our choice: with ignore_eos, EOS does not end the sequence, so min_tokens does not mask it.
    params = SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True, stop_token_ids=[EOS + 1, STOP_ID])
    logits = _min_tokens_logits(1)
    assert _make_sampler()(logits, [_make_row(params)]).token_ids == [EOS]
    logits[0, EOS] = -10.0
    assert _make_sampler()(logits, [_make_row(params)]).token_ids == [1]


# --- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_raw_logits(dtype: torch.dtype) -> None:
    logits = _make_logits(6, 300).to(dtype)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_p=0.3, min_p=0.1, logprobs=20, seed=3),
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, min_tokens=3, stop_token_ids=[0]),
        SamplingParams(temperature=1.7, logprobs=1),
    ]
    out = _make_sampler()(logits, [_make_row(p) for p in params])
    expected = torch.log_softmax(logits.float(), dim=-1)  # [6, 300]
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        assert out.logprobs[i] == pytest.approx(expected[i, out.token_ids[i]].item(), abs=1e-5)
        top = out.top_logprobs[i]
        assert len(top) == p.logprobs
        values, ids = expected[i].topk(p.logprobs)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert all(type(t) is int and type(v) is float for t, v in top)
    assert out.top_logprobs[4] == []


def test_logprobs_capped_at_vocab_size() -> None:
    out = _make_sampler()(torch.tensor([[0.0, 1.0, 2.0]]), [_make_row(SamplingParams(logprobs=5))])
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1, 0]


# --- contract -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("all_greedy", [True, False])
def test_callers_logits_unchanged(dtype: torch.dtype, all_greedy: bool) -> None:
    logits = _make_logits(5, 200).to(dtype)
    before = logits.clone()
    if all_greedy:
        params = [SamplingParams(temperature=0.0)] * 5
    else:
        params = [SamplingParams(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05),
                  SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[1]),
                  SamplingParams(logprobs=3, seed=2), SamplingParams(top_p=0.5), SamplingParams()]
    out = _make_sampler()(logits, [_make_row(p) for p in params])
    assert isinstance(out, SamplerOutput) and len(out.token_ids) == 5
    assert torch.equal(logits, before)


# --- logit_bias and penalties ---------------------------------------------------------------------

PROMPT = [1, 4]          # the prompt's tokens
OUTPUT = [2, 2, 5]       # tokens generated so far: 2 twice, 5 once


def _adjusted_row(**kwargs) -> SamplingRow:
    return _make_row(SamplingParams(temperature=0.0, **kwargs), num_output_tokens=len(OUTPUT),
                     token_ids=PROMPT + OUTPUT)


def _expected(logits: list[float], **kwargs) -> list[float]:
    """One sampler step's adjusted logits, written out token by token from the formulas (OpenAI's for the
    presence and frequency penalties, HF transformers' for the repetition penalty)."""
    bias = dict(kwargs.get("logit_bias", {}))
    rep = kwargs.get("repetition_penalty", 1.0)
    out = []
    for token, logit in enumerate(logits):
        logit += bias.get(token, 0.0)
        if token in PROMPT or token in OUTPUT:
            logit = logit / rep if logit > 0 else logit * rep
        count = OUTPUT.count(token)
        logit -= count * kwargs.get("frequency_penalty", 0.0) + (count > 0) * kwargs.get("presence_penalty", 0.0)
        out.append(logit)
    return out


@pytest.mark.parametrize("kwargs", [
    {"logit_bias": {0: 5.0, 6: -100.0}},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"frequency_penalty": -0.5, "presence_penalty": 0.25},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8},
    {"logit_bias": {2: 3.0}, "repetition_penalty": 1.2, "frequency_penalty": 0.4, "presence_penalty": -1.0},
])
def test_bias_and_penalties_match_a_hand_computed_step(kwargs: dict) -> None:
    logits = [2.0, -1.0, 3.0, 0.5, -2.0, 2.9, 1.0, -0.3]
    expected = _expected(logits, **kwargs)
    # The greedy pick is the hand-computed argmax; top_logprobs of a logprobs row stay the raw ones.
    out = _make_sampler()(torch.tensor([logits]), [_adjusted_row(**kwargs)])
    assert out.token_ids == [max(range(len(expected)), key=expected.__getitem__)]
    # The adjusted logits themselves: sample at temperature 1 from each and compare the distributions.
    # One key: the draws share one sequence's penalty counts, filled once (keyless rows are filled one by one;
    # the greedy row above is keyless).
    row = replace(_make_row(SamplingParams(**kwargs), num_output_tokens=len(OUTPUT), token_ids=PROMPT + OUTPUT),
                  key=0)
    num_draws = 8000
    got = _make_sampler()(torch.tensor([logits]).expand(num_draws, -1).contiguous(), [row] * num_draws)
    counts = torch.bincount(torch.tensor(got.token_ids), minlength=len(logits))
    probs = torch.tensor(expected).softmax(dim=0).tolist()
    _assert_matches_distribution(counts, [p if p > 1e-4 else 0.0 for p in probs])


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.2, 0.0, 3.0, 0.0, 0.0, 2.5, 0.0, 0.0]])
    assert _make_sampler()(logits, [_adjusted_row()]).token_ids == [2]
    assert _make_sampler()(logits, [_adjusted_row(frequency_penalty=0.6)]).token_ids == [5]  # 3 - 1.2 < 2.5 - 0.6
    assert _make_sampler()(logits, [_adjusted_row(logit_bias={7: 10})]).token_ids == [7]
    assert _make_sampler()(logits, [_adjusted_row(repetition_penalty=3.0)]).token_ids == [0]  # 1.0, 0.83 < 1.2


def test_a_penalized_row_is_filled_without_a_data_dependent_op_on_the_device() -> None:
    """On the meta device, an op whose result's shape depends on values (a boolean mask: on CUDA it waits
    for the device to count) raises: the row is filled from ids filtered on the host (placeholders and
    ids past the logits dropped), as the CPU fills it with the right counts."""
    from types import SimpleNamespace

    from engine.penalties import PenaltyCounts

    row = SimpleNamespace(key=1, token_ids=[3, 5, 200, 7, 7, -1], num_output_tokens=3)   # output 7, 7, pending
    meta = PenaltyCounts(100, "meta")
    assert meta.rows([row])[0].shape == (1,)
    cpu = PenaltyCounts(100, "cpu")
    index = int(cpu.rows([row])[0][0])
    assert cpu.in_prompt[index].nonzero().flatten().tolist() == [3, 5]
    assert cpu.counts[index].nonzero().flatten().tolist() == [7] and int(cpu.counts[index, 7]) == 2


def test_adjusted_rows_leave_their_neighbours_and_the_raw_logprobs_alone() -> None:
    logits = _make_logits(3, 16, seed=4)
    plain = [_make_row(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(3)]
    before = _make_sampler()(logits, plain)
    rows = [plain[0], _make_row(SamplingParams(temperature=0.0, logprobs=3, logit_bias={9: 100}),
                                token_ids=[9], num_output_tokens=1), plain[2]]
    after = _make_sampler()(logits, rows)
    assert after.token_ids[0] == before.token_ids[0] and after.token_ids[2] == before.token_ids[2]
    assert after.token_ids[1] == 9
    assert after.top_logprobs[1] == before.top_logprobs[1]     # logprobs are of the raw logits


def _mixed_rows(num_rows: int, vocab_size: int) -> list[SamplingRow]:
    """Rows of every kind the sampler treats apart: seeded draws with each filter, greedy with logprobs of
    different widths, penalties, a logit bias and min_tokens masks, interleaved."""
    kinds = [dict(seed=5, temperature=0.7, top_p=0.9, logprobs=3), dict(temperature=0.0),
             dict(seed=6, top_k=4, min_p=0.05), dict(temperature=0.0, logprobs=0, repetition_penalty=1.4),
             dict(seed=7, presence_penalty=1.0, frequency_penalty=0.5, logprobs=5),
             dict(temperature=0.0, logit_bias={3: 8.0}, min_tokens=4, stop_token_ids=[1, 2])]
    rows = []
    for i in range(num_rows):
        params = SamplingParams(**kinds[i % len(kinds)])
        tokens = [(7 * i + j) % vocab_size for j in range(6)]
        rows.append(_make_row(params, index=i, num_output_tokens=2, token_ids=tokens))
    return rows


def test_a_large_step_samples_in_chunks_as_it_would_at_once(monkeypatch) -> None:
    """Past SAMPLE_CHUNK_ELEMENTS logits a step is sampled a chunk of rows at a time, each chunk's float32
    working set no larger than the chunk: the tokens and logprobs are those of one batch."""
    from engine import sampler as sampler_module

    vocab_size, num_rows = 40, 23
    logits = _make_logits(num_rows, vocab_size, seed=9).to(torch.bfloat16)   # the model's dtype
    whole = Sampler()(logits, _mixed_rows(num_rows, vocab_size))
    chunk_rows = []
    real_sample = Sampler._sample
    monkeypatch.setattr(Sampler, "_sample", lambda self, x, rows, kinds, max_top: (
        chunk_rows.append(x.shape[0]) or real_sample(self, x, rows, kinds, max_top)))
    monkeypatch.setattr(sampler_module, "SAMPLE_CHUNK_ELEMENTS", 5 * vocab_size + 3)   # 5 rows a chunk
    chunked = Sampler()(logits, _mixed_rows(num_rows, vocab_size))
    assert chunk_rows == [5, 5, 5, 5, 3]
    assert chunked == whole
    assert {len(top) for top in chunked.top_logprobs if top is not None} == {0, 3, 5}
    monkeypatch.setattr(sampler_module, "SAMPLE_CHUNK_ELEMENTS", 1)   # below one row: a row a chunk
    assert Sampler()(logits, _mixed_rows(num_rows, vocab_size)) == whole
    chunk_rows.clear()
    greedy = [_make_row(SamplingParams(temperature=0.0))] * num_rows
    assert Sampler()(logits, greedy).token_ids == logits.float().argmax(-1).tolist()
    assert chunk_rows == []          # an argmax holds no working set: one, over every row


def test_rejects_logits_not_matching_rows() -> None:
    with pytest.raises(ValueError, match="logits"):
        _make_sampler()(torch.zeros(3, 10), [_make_row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match="logits"):
        _make_sampler()(torch.zeros(10), [_make_row(SamplingParams())])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_contract() -> None:
    vocab_size = 32_000
    logits = _make_logits(8, vocab_size).cuda().to(torch.bfloat16)  # [8, vocab]
    params = SamplingParams(seed=11, temperature=0.8, top_p=0.9, top_k=100, logprobs=2)
    sampler = Sampler(torch.Generator(device="cuda").manual_seed(0))

    alone_row = SamplingRow(params, make_generator(11, 0, "cuda"), 0, frozenset({EOS}))
    alone = [sampler(logits[3:4], [alone_row]).token_ids[0] for _ in range(5)]
    rows = [SamplingRow(SamplingParams(top_p=0.5), None, 0, frozenset({EOS})) for _ in range(8)]
    rows[3] = SamplingRow(params, make_generator(11, 0, "cuda"), 0, frozenset({EOS}))
    before = logits.clone()
    assert [sampler(logits, rows).token_ids[3] for _ in range(5)] == alone
    assert torch.equal(logits, before)
    greedy = sampler(logits, [SamplingRow(SamplingParams(temperature=0.0), None, 0, frozenset())] * 8)
    assert greedy.token_ids == logits.argmax(dim=-1).tolist()
