"""Request parsing: every bad field is refused with a message and `param` that name it."""

from __future__ import annotations

import pytest

from engine.chat_template import content_text
from gateway.openai.chat import parse_chat
from gateway.openai.completions import parse_completion
from gateway.openai.errors import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def test_a_minimal_chat_request_gets_openai_defaults():
    req = parse_chat(dict(CHAT))
    assert req.params.temperature == 1.0 and req.params.top_p == 1.0 and req.params.n == 1
    assert req.params.max_tokens is None  # up to the context, as OpenAI does
    assert not req.stream and req.top_logprobs is None


def test_vllm_extra_fields_reach_the_sampling_params():
    req = parse_chat(dict(CHAT, top_k=5, min_p=0.1, min_tokens=2, ignore_eos=True, stop_token_ids=[7],
                          priority=3, seed=11, n=2, stop=["x"], max_completion_tokens=9,
                          logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True}))
    p = req.params
    assert (p.top_k, p.min_p, p.min_tokens, p.ignore_eos, p.stop_token_ids, p.seed, p.n, p.stop, p.max_tokens,
            p.logprobs) == (5, 0.1, 2, True, (7,), 11, 2, ("x",), 9, 3)
    assert req.priority == 3 and req.include_usage and req.top_logprobs == 3


def test_a_completions_max_tokens_unset_or_null_is_16_and_a_chats_the_context():
    """OpenAI's legacy completions and vLLM's /v1/completions default max_tokens to 16 (it ran to the context's
    end); a chat's unset max_tokens is whatever the context leaves, as vLLM's chat."""
    body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
    assert parse_completion(body).params.max_tokens == parse_completion(dict(body, max_tokens=None)).params.max_tokens \
        == 16
    assert parse_completion(dict(body, max_tokens=40)).params.max_tokens == 40
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).params.max_tokens is None


def test_vllms_spaces_between_special_tokens_is_accepted_as_vllm_reads_it_with_a_fast_tokenizer():
    """Sent by clients written for vLLM: accepted (a bool), and it changes nothing, as with vLLM's fast tokenizers."""
    plain = parse_chat(CHAT)
    assert parse_chat(dict(CHAT, spaces_between_special_tokens=False)).params == plain.params
    assert parse_completion(dict(COMPLETION, spaces_between_special_tokens=True)).params == \
        parse_completion(COMPLETION).params


def test_content_parts_are_kept_and_completion_prompts_take_every_openai_shape():
    req = parse_chat(dict(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]))
    assert req.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert content_text(req.messages[0]["content"]) == "a\nb"   # what a template of strings gets
    assert parse_completion(dict(COMPLETION, prompt=[1, 2, 3])).prompts == [[1, 2, 3]]
    assert parse_completion(dict(COMPLETION, prompt=["a", [4, 5]])).prompts == ["a", [4, 5]]


BAD_CHAT = [
    ("not an object", [1, 2], "body"),
    ("missing model", {"messages": CHAT["messages"]}, "model"),
    ("model not a string", dict(CHAT, model=5), "model"),
    ("user not a string", dict(CHAT, user={"id": 5}), "user"),   # typed as OpenAI and vLLM type it
    ("store not a boolean", dict(CHAT, store="yes"), "store"),
    ("spaces_between_special_tokens not a boolean", dict(CHAT, spaces_between_special_tokens=1),
     "spaces_between_special_tokens"),
    ("missing messages", {"model": "m"}, "messages"),
    ("empty messages", dict(CHAT, messages=[]), "messages"),
    ("message not an object", dict(CHAT, messages=["hi"]), "messages[0]"),
    ("bad role", dict(CHAT, messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("content wrong type", dict(CHAT, messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("image part", dict(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0].type"),
    ("temperature string", dict(CHAT, temperature="hot"), "temperature"),
    ("temperature out of range", dict(CHAT, temperature=3.5), "temperature"),
    ("top_p out of range", dict(CHAT, top_p=1.5), "top_p"),
    ("n zero", dict(CHAT, n=0), "n"),
    ("n bool", dict(CHAT, n=True), "n"),
    ("max_tokens negative", dict(CHAT, max_tokens=-1), "max_tokens"),
    ("max_tokens float", dict(CHAT, max_tokens=1.5), "max_tokens"),
    ("stop wrong type", dict(CHAT, stop=5), "stop"),
    ("stop empty string", dict(CHAT, stop=""), "stop"),
    ("stop list with an empty string", dict(CHAT, stop=["x", ""]), "stop"),
    ("top_logprobs without logprobs", dict(CHAT, top_logprobs=2), "top_logprobs"),
    ("top_logprobs too many", dict(CHAT, logprobs=True, top_logprobs=50), "top_logprobs"),
    ("stream_options without stream", dict(CHAT, stream_options={"include_usage": True}), "stream_options"),
    ("continuous_usage_stats not bool", dict(CHAT, stream=True, stream_options={"continuous_usage_stats": 1}),
     "stream_options.continuous_usage_stats"),
    ("stream not bool", dict(CHAT, stream="yes"), "stream"),
    ("unknown field", dict(CHAT, max_token=5), "max_token"),
    ("presence_penalty out of range", dict(CHAT, presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty string", dict(CHAT, frequency_penalty="x"), "frequency_penalty"),
    ("repetition_penalty zero", dict(CHAT, repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty 0 in float32", dict(CHAT, repetition_penalty=1e-300), "repetition_penalty"),
    ("logit_bias not an object", dict(CHAT, logit_bias=[5, 1]), "logit_bias"),
    ("logit_bias key not a token id", dict(CHAT, logit_bias={"a": 1}), "logit_bias"),
    ("logit_bias bias out of range", dict(CHAT, logit_bias={"5": 101}), "logit_bias"),
    ("logit_bias bias not a number", dict(CHAT, logit_bias={"5": "up"}), "logit_bias"),
    ("tool without a function", dict(CHAT, tools=[{"type": "function"}]), "tools[0].function"),
    ("response_format of an unknown type", dict(CHAT, response_format={"type": "xml"}), "response_format.type"),
    ("json_schema without its object", dict(CHAT, response_format={"type": "json_schema"}),
     "response_format.json_schema"),
    ("json_schema whose schema is not an object",
     dict(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
     "response_format.json_schema.schema"),
    ("json_schema without a name", dict(CHAT, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), "response_format.json_schema.name"),
    ("json_schema with a name OpenAI refuses", dict(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "a pet", "schema": {"type": "object"}}}), "response_format.json_schema.name"),
    ("min_tokens over max_tokens", dict(CHAT, min_tokens=5, max_tokens=2), "min_tokens"),
    ("top_k below -1", dict(CHAT, top_k=-5), "top_k"),
    ("seed string", dict(CHAT, seed="x"), "seed"),
    ("priority float", dict(CHAT, priority=1.5), "priority"),
    ("stop_token_ids negative", dict(CHAT, stop_token_ids=[-3]), "stop_token_ids[0]"),
    # integers past 64 bits, which the engine's wire cannot carry
    ("seed past 64 bits", dict(CHAT, seed=10**23), "seed"),
    ("top_k past 64 bits", dict(CHAT, top_k=10**23), "top_k"),
    ("min_tokens past 64 bits", dict(CHAT, min_tokens=10**23), "min_tokens"),
    ("priority past 64 bits", dict(CHAT, priority=-(10**23)), "priority"),
    ("max_tokens past 64 bits", dict(CHAT, max_tokens=10**23), "max_tokens"),
    ("stop_token_ids past a token id", dict(CHAT, stop_token_ids=[1, 2**40]), "stop_token_ids[1]"),
    ("logit_bias key a digit only to isdigit", dict(CHAT, logit_bias={"\u00b2": 1}), "logit_bias"),
    ("logit_bias key of 5,000 digits", dict(CHAT, logit_bias={"1" * 5000: 1}), "logit_bias"),
    ("chat_template_kwargs replacing a template function", dict(CHAT, chat_template_kwargs={"namespace": 0}),
     "chat_template_kwargs.namespace"),
    # numbers past the largest float (JSON bounds no integer), a stop string past its length, audio asked for
    ("logit_bias bias past a float", dict(CHAT, logit_bias={"5": 10**400}), "logit_bias"),
    ("presence_penalty past a float", dict(CHAT, presence_penalty=-(10**400)), "presence_penalty"),
    ("stop string past 1,024 characters", dict(CHAT, stop=["x", "y" * 1025]), "stop"),
    ("audio output asked for", dict(CHAT, modalities=["text", "audio"]), "modalities"),
    ("audio settings", dict(CHAT, audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("verbosity not a level", dict(CHAT, verbosity="terse"), "verbosity"),
]


def test_the_hints_the_sdk_sends_are_accepted_and_change_nothing():
    """`verbosity`, `prediction`, `prompt_cache_options`, text `modalities`, a null `audio`: what the openai SDK
    may send a chat model; none changes a text answer, so none is refused (vLLM ignores them too)."""
    plain = parse_chat(CHAT)
    hinted = parse_chat(dict(CHAT, verbosity="low", modalities=["text"], audio=None,
                             prediction={"type": "content", "content": "Paris"},
                             prompt_cache_options={"mode": "implicit", "ttl": "30m"}))
    assert (hinted.params, hinted.messages, hinted.chat_template_kwargs) == (
        plain.params, plain.messages, plain.chat_template_kwargs)
    assert parse_chat(dict(CHAT, stop=["y" * 1024])).params.stop == ("y" * 1024,)


@pytest.mark.parametrize("case,body,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests_name_the_field(case, body, param):
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    err = info.value
    assert err.status == 400 and err.param == param
    assert err.message.startswith(param), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


BAD_COMPLETION = [
    ("missing prompt", {"model": "m"}, "prompt"),
    ("prompt wrong type", dict(COMPLETION, prompt=5), "prompt"),
    ("prompt list with bad item", dict(COMPLETION, prompt=["a", 5]), "prompt[1]"),
    ("max_tokens 0 without echo", dict(COMPLETION, max_tokens=0, logprobs=1), "max_tokens"),
    ("echo not a bool", dict(COMPLETION, echo="yes", max_tokens=0), "echo"),
    ("suffix unsupported", dict(COMPLETION, suffix="x"), "suffix"),
    ("best_of differs from n", dict(COMPLETION, best_of=3), "best_of"),
    ("logprobs too many", dict(COMPLETION, logprobs=30), "logprobs"),
    ("stop empty string", dict(COMPLETION, stop=""), "stop"),
    ("stop list with an empty string", dict(COMPLETION, stop=[""]), "stop"),
    ("token id past 64 bits", dict(COMPLETION, prompt=[1, 10**23]), "prompt[1]"),
    ("negative token id", dict(COMPLETION, prompt=[[1, 2], [3, -1]]), "prompt[1][1]"),
]


@pytest.mark.parametrize("case,body,param", BAD_COMPLETION, ids=[c[0] for c in BAD_COMPLETION])
def test_bad_completion_requests_name_the_field(case, body, param):
    with pytest.raises(ApiError) as info:
        parse_completion(body)
    assert info.value.status == 400 and info.value.param == param


def test_echo_asks_for_the_prompts_logprobs_and_max_tokens_0_scores_the_prompt_alone():
    scored = parse_completion(dict(COMPLETION, prompt=[5, 6, 7], echo=True, max_tokens=0, logprobs=1))
    assert scored.echo and scored.echo_only
    assert scored.params.max_tokens == 1 and scored.params.prompt_logprobs == 1 and scored.params.logprobs == 1
    echoed = parse_completion(dict(COMPLETION, echo=True, max_tokens=4))
    assert echoed.echo and not echoed.echo_only and echoed.params.max_tokens == 4
    assert echoed.params.prompt_logprobs is None   # no logprobs: the prompt may come from the prefix cache
    plain = parse_completion(dict(COMPLETION, logprobs=2))
    assert not plain.echo and plain.params.prompt_logprobs is None
