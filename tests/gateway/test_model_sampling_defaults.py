"""A model's generation_config.json advises how to sample it (Qwen3's temperature 0.6, top_p 0.95, top_k 20): a
request that leaves those fields unset samples so on a local pool, as vLLM's default `--generation-config auto`
does; one that sets them keeps its own, an upstream pool's server applies its own, and a pool's
`generation_config: none` serves OpenAI's defaults."""

from __future__ import annotations

import json
import logging
import shutil

from gateway.completion import with_model_defaults
from gateway.openai.chat import parse_chat
from gateway.openai.completions import parse_completion
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from pools.pool import generation_defaults
from tests.gateway.conftest import chat_pool_yaml, start_gateway


def test_the_defaults_are_what_differs_from_transformers_own(tmp_path, caplog):
    config = tmp_path / "generation_config.json"
    assert generation_defaults(tmp_path) == {}   # none written
    config.write_text(json.dumps({"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                  "top_k": 20, "repetition_penalty": 1.0, "min_p": True}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    config.write_text(json.dumps({"top_k": 20.0}))
    assert generation_defaults(tmp_path) == {"top_k": 20}
    config.write_text(json.dumps({"top_p": 1.5, "top_k": 50, "temperature": "hot", "min_p": 0.05}))
    with caplog.at_level(logging.WARNING):
        assert generation_defaults(tmp_path) == {"min_p": 0.05}   # top_k 50 is transformers' own
    assert "top_p" in caplog.text
    config.write_text("{not json")
    assert generation_defaults(tmp_path) == {}


def _advised(tiny_model, tmp_path, **advice):
    model = tmp_path / "advised"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **advice}))
    return model


def test_a_request_takes_the_advice_for_the_fields_it_left_unset_only(tiny_model, tmp_path):
    model = _advised(tiny_model, tmp_path, temperature=0.6, top_k=20, repetition_penalty=1.1)
    (tmp_path / "on.yaml").write_text(chat_pool_yaml(model))
    (tmp_path / "off.yaml").write_text(chat_pool_yaml(model, extra="    generation_config: none"))
    pool = Gateway.from_config(load_config(tmp_path / "on.yaml")).pools["chat"]
    chat = {"model": "advised", "messages": [{"role": "user", "content": "hi"}]}
    params = with_model_defaults(parse_chat({**chat, "top_k": 5, "temperature": None}), [pool]).params
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (0.6, 5, 1.1, 1.0)
    completion = parse_completion({"model": "advised", "prompt": ["hi", "there"], "temperature": 0})
    params = with_model_defaults(completion, [pool]).params
    assert (params.temperature, params.top_k) == (0, 20)
    off = Gateway.from_config(load_config(tmp_path / "off.yaml")).pools["chat"]
    assert off.sampling_defaults == {} and with_model_defaults(parse_chat(chat), [off]).params.temperature == 1.0
    assert with_model_defaults(completion, [pool, off]).params.top_k == 0   # prompts on both: what they agree on


async def test_an_answer_is_sampled_as_the_model_advises(aiohttp_client, tiny_model, tmp_path):
    """The model advises top_k 1: a request sampling at temperature 1 that leaves top_k unset answers as greedy
    does; with its own top_k (-1: none) the same seed samples another answer. A Response says what it sampled
    with (its top_p the model's)."""
    model = _advised(tiny_model, tmp_path, top_k=1, top_p=0.9)
    client, _ = await start_gateway(aiohttp_client, tmp_path, chat_pool_yaml(model), data_dir=tmp_path)
    chat = {"model": "advised", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24}

    async def answer(**fields) -> list[str]:
        r = await client.post("/v1/chat/completions", json={**chat, **fields, "logprobs": True})
        assert r.status == 200, await r.text()
        return [t["token"] for t in (await r.json())["choices"][0]["logprobs"]["content"]]

    greedy = await answer(temperature=0)
    assert await answer(temperature=1.0, seed=3) == greedy
    assert await answer(temperature=1.0, seed=3, top_k=-1) != greedy
    for background in (False, True):   # a background one says so from the start, queued
        r = await client.post("/v1/responses", json={"model": "advised", "input": "hi", "max_output_tokens": 4,
                                                     "background": background})
        assert r.status == 200 and ((body := await r.json())["top_p"], body["temperature"]) == (0.9, 1.0), body
