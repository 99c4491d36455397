"""Kimi K2's tool-call form (`kimi_k2`: a section of calls, each `functions.NAME:INDEX` then its JSON arguments):
found from the template, a history's calls written by the template itself under ids of Kimi's shape (a client's ids
mapped to them, each result under its call's) and read back as those calls, the function's name read from the id and
the call answered under the model's own id, a stream adding up to the whole answer, a reply max_tokens cut inside a
call, and the grammars of forced and strict calls (llguidance, token by token on the builtin tokenizer). Over HTTP, a
forced call on a pool whose template is Kimi's, then the next turn with its result."""

from __future__ import annotations

import json
import re

import pytest

from engine.chat_template import render
from gateway.openai.chat_prompt import native_messages
from gateway.openai.kimi_tools import SECTION, SECTION_END, KimiFormat, history_id
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tools import ToolCallStream
from tests.gateway.test_deepseek_tools import V31_TEMPLATE, json_calls_stream
from tests.gateway.test_tagged_tools import check_form_grammars
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import SEARCH, WEATHER, forced_call_over_http, streamed_arguments

# Kimi-K2-Thinking's shape: each call's id where the name goes, its arguments as given (text) or their JSON
TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{%- for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}"
    "<|tool_call_argument_begin|>{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}"
    "{{ tc.function.arguments | tojson }}{% endif %}<|tool_call_end|>{%- endfor %}<|tool_calls_section_end|>"
    "{%- endif %}<|im_end|>{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}"
    "\n{{ m.content }}<|im_end|>{%- else %}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}")


def _calls(*calls: tuple[str, dict]) -> str:
    """A history's assistant turn of `calls` as the template writes it (its section alone)."""
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]}]
    text = render(TEMPLATE, native_messages(history, history_id), False, False, {})
    return text[text.index(SECTION):text.rindex(SECTION_END) + len(SECTION_END)]


@pytest.fixture(scope="module")
def fmt() -> KimiFormat:
    found = tool_format(TEMPLATE, parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, KimiFormat) and found.name == "kimi_k2"
    return found


def test_a_historys_ids_reach_the_template_in_kimis_shape_each_result_under_its_calls():
    """A client's ids become `functions.NAME:INDEX`, the index the call's place among the conversation's calls; one
    of that shape stays; each result names its call's id."""
    calls = [{"id": "call_a", "type": "function", "function": {"name": "search", "arguments": "{}"}},
             {"id": "functions.get_weather:7", "type": "function", "function": {"name": "get_weather",
                                                                                "arguments": '{"city": "Oslo"}'}}]
    later = {"id": "call_b", "type": "function", "function": {"name": "search", "arguments": '{"query": "q"}'}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_a", "content": "none"},
                {"role": "tool", "tool_call_id": "functions.get_weather:7", "content": "3 C"},
                {"role": "assistant", "content": "", "tool_calls": [later]},
                {"role": "tool", "tool_call_id": "call_b", "content": "found"}]
    text = render(TEMPLATE, native_messages(messages, history_id), False, False, {})
    assert re.findall(r"<\|tool_call_begin\|>(.*?)<", text) == ["functions.search:0", "functions.get_weather:7",
                                                                 "functions.search:2"]
    assert re.findall(r"## Return of (\S+)", text) == ["functions.search:0", "functions.get_weather:7",
                                                      "functions.search:2"]


def test_the_calls_a_template_writes_read_back_as_those_calls_under_the_models_own_ids(fmt):
    args = {"city": "Paris <|tool_call_end|> }", "days": 3, "where": {"lat": 48.8, "t": [None, "<|im_end|>"]}}
    text = "Let me look." + _calls(("get_weather", args), ("search", {"query": "x"}))
    content, calls = fmt.parse_reply(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args), ("search", {"query": "x"})]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    bare = text.replace("functions.search:1", "search")   # an id of another shape: the name, an OpenAI id
    assert [(c.name, c.id[:5]) for c in fmt.parse_reply(bare)[1]] == [("get_weather", "funct"), ("search", "call_")]


NOT_CALLS = ["<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}"
             "<|tool_call_end|><|tool_calls_section_end|>", "Calls go in <|tool_calls_section_begin|> sections.",
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>[1]"
             "<|tool_call_end|><|tool_calls_section_end|>",
             '<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"a": 1}'
             "<|tool_call_end|>"]   # never closed


def test_what_is_not_a_call_of_an_offered_function_stays_content(fmt):
    for text in NOT_CALLS:
        assert fmt.parse(text) == (text, []), text


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_call_under_the_models_id_adding_up_to_the_whole_answer(fmt, cut):
    text = json_calls_stream(fmt, _calls, cut)
    ids = [entry["id"] for entry in ToolCallStream(fmt, forced=True).call_deltas(text) if "id" in entry]
    assert ids == ["functions.get_weather:0", "functions.search:1"]


def test_a_reply_cut_before_a_calls_arguments_drops_it_and_a_marker_in_prose_holds_back_nothing(fmt):
    text = "Ok." + _calls(("search", {"query": "q"}))
    assert fmt.parse_reply(text[:text.index("{")], cut=True) == ("Ok.", [])
    prose_markers_stream(fmt, f"Put calls in {SECTION} sections, then go on.\n", f"{SECTION} ok.\n")


def test_the_grammars_write_the_form_leaving_the_index_to_the_model(fmt, lltokenizer):
    deepseek = render(V31_TEMPLATE, native_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P", "days": 0}'}}]}]),
        False, False, {})
    check_form_grammars(fmt, _calls, lltokenizer, deepseek)


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(fmt):
    code = ("def f(x):\n    return '}<|tool_call_end|>' if x else None\n" * 4000)[:200_000]
    text = "Writing." + _calls(("search", {"query": code}), ("search", {"limit": 1, "query": code[:1000]}))
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": code[:1000]}]
    assert took < 5.0, took


async def test_a_pool_whose_template_is_kimis_answers_a_forced_call_and_takes_its_result(
        aiohttp_client, tmp_path, tiny_model):
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}

    async def next_turn(client, body: dict, call: dict) -> None:
        messages = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
        r = await client.post("/v1/chat/completions", json={**body, "messages": messages, "tool_choice": "auto",
                                                             "max_tokens": 8})
        assert r.status == 200, await r.text()

    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, TEMPLATE, unit, 120,
                                       call_id=r"functions\.set_unit:[0-9]+", after=next_turn)
    assert args["unit"] in ("celsius", "fahrenheit")
