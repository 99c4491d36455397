"""`cliffguard serve` of a device with `tensor_parallel_size: 3` (the builtin SmolLM2: 9 heads, 3 KV
heads, one per rank; three processes over gloo on the CPU) passes the openai SDK's chat, stream and
tool-call smoke tests."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer
from tests.gateway.test_tools import MODEL, PROMPTS, SCHEMAS, TOOLS

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def tp3_server(tmp_path_factory):
    text = DEFAULT_CONFIG.read_text()
    text = text.replace("    device: auto ", "    device: cpu ", 1)
    text = text.replace("    tensor_parallel_size: 1 ", "    tensor_parallel_size: 3 ", 1)
    assert "tensor_parallel_size: 3" in text and "device: cpu" in text
    path = tmp_path_factory.mktemp("tp3") / "pools.yaml"
    path.write_text(text)
    server = LiveServer(path)
    yield server
    server.stop()


@pytest.fixture
def sdk(tp3_server):
    return openai.OpenAI(base_url=tp3_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_streamed_equals_non_streamed_on_three_ranks(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content and 0 < whole.usage.completion_tokens <= 24
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pools = sdk.models.retrieve(MODEL).model_extra["pools"]
    assert {p["tensor_parallel_size"] for p in pools} == {3}


def test_tool_calls_whole_and_streamed_on_three_ranks(sdk):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS,
                  tool_choice="required", max_tokens=200, temperature=0, frequency_penalty=0.5)
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls: dict[int, dict] = {}
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
