"""The `openai` SDK against a live `cliffguard serve` (builtin SmolLM2), and an upstream pool in front of it."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from gateway.app import create_app
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def sdk(live_builtin_server):
    return openai.OpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


def test_sync_chat_streamed_equals_non_streamed(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert 0 < whole.usage.completion_tokens <= 12
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True,
                                                                           "include_obfuscation": False},
                                              safety_identifier="user-1", prompt_cache_key="greeting"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_sync_completions_streamed_equals_non_streamed_with_raw_response_header(sdk):
    raw = sdk.completions.with_raw_response.create(model=MODEL, prompt="The three primary colours are",
                                                   max_tokens=8, temperature=0)
    assert raw.headers["x-cliffguard-pool"] == "chat"
    whole = raw.parse()
    stream = sdk.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=8,
                                    temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"


def test_sdk_sees_errors_as_typed_exceptions(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=7)
    assert "temperature" in str(info.value)
    models = sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


async def test_async_client_concurrent_streams_and_seeded_sampling(live_builtin_server):
    client = openai.AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)

    async def streamed(seed):
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                      temperature=0.8, seed=seed, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole(seed):
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                 temperature=0.8, seed=seed)
        return r.choices[0].message.content

    results = await asyncio.gather(*(streamed(s) for s in (1, 2, 3)), *(whole(s) for s in (1, 2, 3)))
    assert results[:3] == results[3:]  # same seed: same sample, streamed or not, whatever else runs
    comp = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=3, temperature=1.0,
                                           seed=5)
    assert sorted(c.index for c in comp.choices) == [0, 1, 2]
    await client.close()


async def test_upstream_pool_forwards_to_a_second_server(aiohttp_client, tmp_path, live_builtin_server):
    path = tmp_path / "front.yaml"
    path.write_text(f"""
pools:
  - name: remote
    upstream: {live_builtin_server.url}/v1
    model: {MODEL}
    served_model_name: front-model
    tokenizer: builtin:smollm2-135m-instruct
""")
    gateway = Gateway.from_config(load_config(path))
    assert not gateway.clients  # no device worker for an upstream-only gateway
    client = await aiohttp_client(create_app(gateway))
    body = {"model": "front-model", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    whole = await r.json()
    assert r.status == 200, whole
    assert r.headers["x-cliffguard-pool"] == "remote" and whole["model"] == "front-model"
    direct = openai.OpenAI(base_url=live_builtin_server.url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert whole["choices"][0]["message"]["content"] == direct.choices[0].message.content

    r = await client.post("/v1/chat/completions", json=dict(body, stream=True))
    text, models = "", set()
    async for line in r.content:
        line = line.decode().strip()
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            models.add(chunk["model"])
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert text == direct.choices[0].message.content and models == {"front-model"}

    r = await client.post("/v1/completions", json={"model": "front-model", "prompt": "Hi", "max_tokens": 3,
                                                   "temperature": 9})
    assert r.status == 400 and "temperature" in (await r.json())["error"]["message"]  # parsed here first
    m = (await (await client.get("/metrics")).text())
    assert 'cliffguard_routed_requests_total{pool="remote"} 2.0' in m


def test_capacity_plan_of_the_default_file_is_what_the_server_allocated(live_builtin_server, capsys):
    import urllib.request

    from gateway.cli import main

    # `cliffguard capacity` in this process: a child of its own spent its time importing torch
    assert main(["capacity", "--config", str(live_builtin_server.config_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    planned = {"pools": {p["name"]: p for p in out["pools"]}}
    with urllib.request.urlopen(live_builtin_server.url + "/v1/models") as r:
        (model,) = json.loads(r.read())["data"]
    served = {p["name"]: p for p in model["pools"]}
    assert set(served) == {"chat", "rag"}
    for name, pool in served.items():
        plan = planned["pools"][name]
        assert pool["num_blocks"] == plan["num_blocks"], name
        assert pool["max_num_seqs"] == plan["max_num_seqs"], name
        assert pool["kv_cache_bytes"] == plan["num_blocks"] * plan["block_size"] * plan["kv_bytes_per_token"]
    with urllib.request.urlopen(live_builtin_server.url + "/metrics") as r:
        metrics = r.read().decode()
    for name, plan in planned["pools"].items():
        assert f'cliffguard_pool_num_blocks{{pool="{name}",replica="0"}} {float(plan["num_blocks"])}' in metrics
        assert f'cliffguard_pool_max_num_seqs{{pool="{name}",replica="0"}} {float(plan["max_num_seqs"])}' in metrics


def test_each_streamed_choice_finishes_once_when_samples_end_in_different_steps(sdk):
    """n = 3 with a stop string: samples end in different steps, and the request's last report repeats every
    sample's ending; a choice that had finished was streamed a second chunk with its finish_reason."""
    for seed in range(3):
        finishes: dict[int, int] = {}
        for chunk in sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.7,
                                                 seed=seed, n=3, stop=["e"], stream=True):
            for choice in chunk.choices:
                if choice.finish_reason:
                    finishes[choice.index] = finishes.get(choice.index, 0) + 1
        assert finishes == {0: 1, 1: 1, 2: 1}, (seed, finishes)


def test_echo_scores_a_prompt_as_transformers_does(sdk, builtin_path):
    """lm-evaluation-harness's loglikelihood request (token ids, `echo`, `max_tokens: 0`, `logprobs: 1`): the prompt
    as the text, each token's logprob as transformers' log-softmax gives it (the first null), nothing generated.
    Then the same prompt as a string, echoed before a generated answer, streamed and whole alike. transformers runs
    the checkpoint the gateway serves (the builtin's conversion: a second's load, where its GGUF's takes 20 s; the
    conversion equals transformers' GGUF loading in tests/engine/test_weights.py, slow)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import Tokenizer

    hf_smollm2 = AutoModelForCausalLM.from_pretrained(builtin_path, dtype=torch.float32).eval()
    ids = Tokenizer.from_folder(builtin_path).encode("The capital of France is Paris. The capital of Italy is")
    scored = sdk.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length" and choice.text == "".join(lp.tokens)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(ids))]
    with torch.no_grad():
        want = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    chosen = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), chosen, atol=2e-3, rtol=0)
    for k, top in enumerate(lp.top_logprobs[1:]):   # the best token's logprob there, and the prompt's own
        assert abs(max(top.values()) - want[k].max().item()) < 2e-3 and lp.tokens[k + 1] in top

    prompt = choice.text
    whole = sdk.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=4, logprobs=2, temperature=0)
    streamed = list(sdk.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=4, logprobs=2,
                                           temperature=0, stream=True))
    got = whole.choices[0]
    assert got.text.startswith(prompt) and len(got.text) > len(prompt) and whole.usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in streamed) == got.text
    assert len(got.logprobs.tokens) == len(ids) + 4 and got.logprobs.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(got.logprobs.token_logprobs[1:len(ids)]),
                               torch.tensor(lp.token_logprobs[1:]), atol=1e-4, rtol=0)
    assert got.logprobs.text_offset[len(ids)] == len(prompt)   # the answer's first token, after the echo
    chunks = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == got.logprobs.tokens
    assert sum((c.text_offset for c in chunks), []) == got.logprobs.text_offset
