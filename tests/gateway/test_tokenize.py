"""`POST /tokenize` and `POST /detokenize` over HTTP on two pools of the tiny model (chat up to 24 prompt tokens,
rag past them): a prompt's ids as transformers' own tokenizer makes them (with and without what it adds around the
text), a chat's as transformers' `apply_chat_template` renders them and as many as a chat completion's
`usage.prompt_tokens` for the same body, the pool each would go to, each token's text, ids back to text, and every
bad field named in the OpenAI error format."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import start_gateway

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Tell me about the history of the city of Paris in a few words. " * 3}]


@pytest.fixture
async def client(aiohttp_client, tmp_path, tiny_model):
    yaml = f"""
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - {{name: chat, model: {tiny_model}, served_model_name: tiny, device: cpu, kv_cache_bytes: 128KiB, avg_len: 32,
     max_model_len: 256, route: {{max_prompt_tokens: 24}}}}
  - {{name: rag, model: {tiny_model}, served_model_name: tiny, device: cpu, kv_cache_bytes: 128KiB, avg_len: 64,
     max_model_len: 256, route: {{min_prompt_tokens: 25}}}}
"""
    client, _ = await start_gateway(aiohttp_client, tmp_path, yaml)
    return client


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


async def _post(client, path: str, body: dict) -> tuple[int, dict]:
    r = await client.post(path, json=body)
    return r.status, await r.json()


async def test_a_prompts_ids_are_transformers_and_go_to_the_pool_they_would_route_to(client, hf_tokenizer):
    status, answer = await _post(client, "/tokenize", {"model": "tiny", "prompt": "The capital of France is"})
    assert status == 200, answer
    assert answer["tokens"] == hf_tokenizer("The capital of France is").input_ids and answer["token_strs"] is None
    assert (answer["count"], answer["max_model_len"], answer["pool"]) == (len(answer["tokens"]), 256, "chat")
    text = "A long one. " * 20
    status, answer = await _post(client, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False,
                                                       "return_token_strs": True})
    assert answer["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids and answer["pool"] == "rag"
    assert "".join(answer["token_strs"]) == text


async def test_a_chats_ids_are_transformers_rendering_and_its_completions_prompt_tokens(client, hf_tokenizer):
    for messages, pool in ((MESSAGES, "chat"), (LONG, "rag")):
        status, answer = await _post(client, "/tokenize", {"model": "tiny", "messages": messages})
        assert status == 200, answer
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert answer["tokens"] == list(getattr(expected, "input_ids", expected)) and answer["pool"] == pool
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})
        assert (await r.json())["usage"]["prompt_tokens"] == answer["count"]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    status, with_tools = await _post(client, "/tokenize", {"model": "tiny", "messages": MESSAGES, "tools": tools})
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": tools,
                                                        "max_tokens": 1})
    assert status == 200 and with_tools["count"] == (await r.json())["usage"]["prompt_tokens"]
    status, bare = await _post(client, "/tokenize", {"model": "tiny", "messages": MESSAGES, "tools": tools,
                                                     "add_generation_prompt": False})
    assert bare["count"] < with_tools["count"] and with_tools["tokens"][:bare["count"]] == bare["tokens"]


async def test_ids_come_back_as_their_text_special_tokens_written_out(client, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(getattr(ids, "input_ids", ids))
    status, answer = await _post(client, "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and answer == {"prompt": hf_tokenizer.decode(ids)}
    assert "<|im_start|>system\nBe brief.<|im_end|>" in answer["prompt"]


BAD = [
    ("/tokenize", {"model": "nope", "prompt": "x"}, "model", 404),
    ("/tokenize", {"prompt": "x"}, "model", 400),
    ("/tokenize", {"model": "tiny"}, "messages", 400),
    ("/tokenize", {"model": "tiny", "prompt": 3}, "prompt", 400),
    ("/tokenize", {"model": "tiny", "prompt": "x", "messages": MESSAGES}, "prompt", 400),
    ("/tokenize", {"model": "tiny", "prompt": "x", "return_token_strs": "yes"}, "return_token_strs", 400),
    ("/tokenize", {"model": "tiny", "messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens", 400),
    ("/tokenize", {"model": "tiny", "prompt": "x", "max_tokens": 3}, "max_tokens", 400),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
    ("/tokenize", {"model": "tiny", "prompt": "word " * 400}, "prompt", 400),
    ("/tokenize", [1, 2], "body", 400),
    ("/detokenize", {"model": "tiny", "tokens": [1, "a"]}, "tokens", 400),
    ("/detokenize", {"model": "tiny", "tokens": [1, 10 ** 9]}, "tokens[1]", 400),
    ("/detokenize", {"model": "tiny", "tokens": [1], "prompt": "x"}, "prompt", 400),
    ("/detokenize", {"model": "nope", "tokens": [1]}, "model", 404)]


async def test_a_bad_field_is_named_in_the_openai_error_format(client):
    for path, body, param, status in BAD:
        got, answer = await _post(client, path, body)
        assert got == status and answer["error"]["param"] == param, (body, answer)
