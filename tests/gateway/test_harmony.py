"""Replies in the harmony format (GPT-OSS; `gateway/openai/harmony.py`): the splitter alone (markers cut anywhere,
several messages, a preamble, a reply cut inside the analysis, a reply that is not harmony), then through the
unchanged `openai` SDK against an in-process gateway whose model's chat template writes harmony messages, on a
scripted engine: chat completions and the Responses API, whole and streamed, with a function call too; a grammar
on the reply (a response format, a forced or strict tool) refused by name."""

from __future__ import annotations

import openai
import pytest

from engine.tokenizer import Tokenizer
from gateway.openai.harmony import HarmonySplitter, header_channel, header_recipient, template_speaks_harmony
from tests.gateway.test_reasoning import _chat_stream, _gateway, _ScriptedEngine, assert_split_whole_and_streamed

# harmony turns as GPT-OSS's template writes them (a system message first; the generation prompt opens the
# assistant's message, whose header the model writes)
HARMONY = ("{{ '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + '<|end|>' }}"
           "{% if tools %}{{ '<|start|>developer<|message|># Tools: ' + tools | map(attribute='function') "
           "| map(attribute='name') | join(', ') + '<|end|>' }}{% endif %}"
           "{% for m in messages %}{% if m.role == 'assistant' %}"
           "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
           "{% else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# the markers cut across deltas; the reasoning: the five deltas up to the analysis message's end
REPLY = ["<|channel|>", "analysis<|mess", "age|>I should", " add.", "<|end|><|start|>", "assistant<|channel|>final",
         "<|message|>It is", " 4."]


def _split(text: str, cuts: list[int]) -> tuple[list[tuple[str, str]], HarmonySplitter]:
    splitter, bounds = HarmonySplitter(), [0, *cuts, len(text)]
    parts = [splitter.feed(text[a:b], 1) for a, b in zip(bounds, bounds[1:])]
    return parts + [splitter.finish()], splitter


@pytest.mark.parametrize("text,reasoning,content", [
    ("<|channel|>analysis<|message|>I add.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.", "I add.",
     "It is 4."),
    ("<|channel|>final<|message|>It is 4.", "", "It is 4."),                            # no analysis
    # two analysis messages, then a preamble on the commentary channel (the user sees it) and the answer
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|> B.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Let me see. <|end|><|start|>assistant<|channel|>final"
     "<|message|>4", "A. B.", "Let me see. 4"),
    ("<|channel|>analysis<|message|>I add 2 and <|e", "I add 2 and <|e", ""),           # cut by max_tokens
    ("It is 4.", "", "It is 4."),                                                      # no harmony: as written
    ("<|channel|>final<|message|>x < y <| z", "", "x < y <| z"),                       # a marker's start is text
])
def test_every_cut_of_a_reply_splits_as_the_whole_does(text, reasoning, content) -> None:
    whole, splitter = _split(text, [])
    assert (splitter.reasoning, splitter.content) == (reasoning, content)
    assert ("".join(r for r, _ in whole), "".join(c for _, c in whole)) == (reasoning, content)
    for cut in range(1, len(text)):
        for cuts in ([cut], [cut, min(cut + 7, len(text))]):
            parts, _ = _split(text, cuts)
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), cuts
            assert not any("<|message|>" in r + c or "<|channel|>" in r + c for r, c in parts)


def test_reasoning_tokens_and_the_tokens_before_the_content() -> None:
    splitter = HarmonySplitter()
    got = [splitter.feed(piece, 1) for piece in REPLY]
    assert "".join(r for r, _ in got) == "I should add." and "".join(c for _, c in got) == "It is 4."
    assert splitter.reasoning_tokens == 5 and splitter.num_tokens_before_content == 6 and splitter.phase == "content"
    open_ended = HarmonySplitter()
    for piece in REPLY[:4]:
        open_ended.feed(piece, 1)
    assert open_ended.phase == "thinking" and open_ended.reasoning_tokens == 4
    assert header_channel(" to=functions.get<|channel|>commentary <|constrain|>json") == "commentary"
    assert header_channel("assistant<|channel|>final") == "final" and header_channel("assistant") is None
    assert template_speaks_harmony(HARMONY) and not template_speaks_harmony("{{ '<think>' }}")


async def test_chat_and_responses_split_a_harmony_reply(aiohttp_client, tmp_path, tiny_model, monkeypatch) -> None:
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, HARMONY)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = REPLY
    await assert_split_whole_and_streamed(sdk, "I should add.", "It is 4.", 8, 5)
    response = await sdk.responses.create(model="thinker", input="What is 2 + 2?")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "I should add." and response.output_text == "It is 4."
    assert response.output[0].status == "completed"
    events = [e async for e in await sdk.responses.create(model="thinker", input="What is 2 + 2?", stream=True)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I should add."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."


async def test_a_harmony_reply_is_decoded_with_its_markers_and_tools_or_a_format_are_refused(
        aiohttp_client, tmp_path, tiny_model, monkeypatch) -> None:
    from engine.client import AsyncEngineClient

    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, HARMONY)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = REPLY
    scripted, params_seen = AsyncEngineClient.generate, []

    def generate(client, prompt, params=None, **kwargs):
        params_seen.append(params)
        return scripted(client, prompt, params, **kwargs)

    monkeypatch.setattr(AsyncEngineClient, "generate", generate)
    monkeypatch.setattr("gateway.completion.harmony_stop_ids", lambda tokenizer: (49150, 49151))   # (this vocabulary's)
    await sdk.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=16,
                                      extra_body={"stop_token_ids": [5, 49150]})
    assert params_seen[-1].skip_special_tokens is False   # the channel markers reach the splitter
    assert params_seen[-1].stop_token_ids == (5, 49150, 49151)   # <|return|> and <|call|> stop it, the request's too
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    strict = [{"type": "function", "function": {**tools[0]["function"], "strict": True}}]
    for kwargs, param in (({"tools": tools, "tool_choice": "required"}, "tool_choice"), ({"tools": strict}, "tools"),
                          ({"response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model="thinker", messages=MESSAGES, **kwargs)
        assert info.value.body["param"] == param and "harmony" in info.value.body["message"]


# a call after the analysis: the header names its recipient and the JSON constraint, the arguments come in pieces,
# `<|call|>` (a stop token) is not in the text
CALL = ["<|channel|>analysis<|message|>", "I need the weather.", "<|end|>", "<|start|>assistant to=functions.get_",
        "weather<|channel|>commentary <|constrain|>json", "<|message|>", '{"city": ', '"Oslo"}']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_harmony_reply_stops_at_return_and_call_where_each_is_one_token() -> None:
    from gateway.openai.harmony import stop_ids

    class Vocabulary:   # <|return|> one token, <|call|> not one in this vocabulary
        def encode(self, text, add_special_tokens=True):
            return {"<|return|>": [200002], "<|call|>": [27, 91, 6460, 91, 29]}[text]

    assert stop_ids(Vocabulary()) == (200002,)


def test_a_call_is_written_as_the_hermes_format_reads_it() -> None:
    for cuts in ([], [40], [61, 62]):
        text = "".join(CALL)
        parts, splitter = _split(text, cuts)
        assert splitter.reasoning == "I need the weather."
        assert splitter.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    splitter = HarmonySplitter()   # a call whose message ended before the reply did (a call on the final channel)
    splitter.feed("<|channel|>final to=functions.f <|constrain|>json<|message|>{}<|end|>")
    assert splitter.content == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert header_recipient(" to=functions.get<|channel|>commentary") == "functions.get"
    assert header_recipient("assistant<|channel|>final") is None


async def test_a_harmony_call_is_a_tool_call_whole_and_streamed(aiohttp_client, tmp_path, tiny_model,
                                                                monkeypatch) -> None:
    sdk, folder = await _gateway(aiohttp_client, tmp_path, tiny_model, HARMONY)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = CALL
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=TOOLS)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == "I need the weather."
    assert whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    prompt = Tokenizer.from_folder(folder).decode(engine.prompts[-1], skip_special_tokens=False)
    assert "# Tools: get_weather<|end|>" in prompt and "<tool_call>" not in prompt   # the template's own tools
    deltas = [c.choices[0].delta for c in await _chat_stream(sdk, messages=MESSAGES, tools=TOOLS) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather."
    assert not "".join(d.content or "" for d in deltas)
    assert "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or []) == '{"city": "Oslo"}'
    response = await sdk.responses.create(model="thinker", input="Weather in Oslo?", tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"], "strict": False}])
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert (response.output[1].name, response.output[1].arguments) == ("get_weather", '{"city": "Oslo"}')
