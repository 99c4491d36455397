"""DeepSeek V3.2's tool calls (`deepseek_v32`, `gateway.openai.dsml_tools`): found from a template that writes DSML
tags, its calls read with each value as its mark says (`string="true"`: the text; `string="false"`: its JSON), the
text before them content, a stream that sends the text as it comes and each call as its arguments close, a reply
max_tokens cut inside a call, and the grammars of forced and strict calls (checked with llguidance token by token on
the builtin tokenizer); over HTTP, a pool whose template writes them answers a forced call with one."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render
from gateway.openai.dsml_tools import DSML, DsmlFormat
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from tests.gateway.test_tagged_tools import MINIMAX_TEMPLATE, POOL_TEMPLATE, check_form_grammars
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import SEARCH, WEATHER, forced_call_over_http, streamed_by_character

# how DeepSeek V3.2's encoder writes a history's calls: a turn's calls in one block, each value marked as a string
# (written as it is) or not (its JSON)
DSML_TEMPLATE = (
    "{%- set dsml = '｜DSML｜' %}{%- for m in messages %}{%- if m.tool_calls %}"
    "{{- '<' + dsml + 'function_calls>\\n' }}{%- for tc in m.tool_calls %}{%- set tc = tc.function %}"
    "{{- '<' + dsml + 'invoke name=\"' + tc.name + '\">\\n' }}{%- for k, v in tc.arguments.items() %}"
    "{{- '<' + dsml + 'parameter name=\"' + k + '\" string=\"' + ('true' if v is string else 'false') + '\">' }}"
    "{{- v if v is string else v | tojson(ensure_ascii=False) }}{{- '</' + dsml + 'parameter>\\n' }}{%- endfor %}"
    "{{- '</' + dsml + 'invoke>\\n' }}{%- endfor %}{{- '</' + dsml + 'function_calls>' }}{%- endif %}{%- endfor %}")


def _calls(*calls: tuple[str, dict]) -> str:
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    return render(DSML_TEMPLATE, history, False, False, {}).lstrip("\n")


@pytest.fixture(scope="module")
def fmt() -> DsmlFormat:
    found = tool_format(DSML_TEMPLATE, parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, DsmlFormat) and found.name == "deepseek_v32"
    return found


def test_the_calls_the_template_writes_read_back_as_those_calls_each_value_as_its_mark_says(fmt):
    assert _calls(("search", {"query": "q", "limit": 2})) == (
        f'<{DSML}function_calls>\n<{DSML}invoke name="search">\n<{DSML}parameter name="query" string="true">q'
        f'</{DSML}parameter>\n<{DSML}parameter name="limit" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n'
        f'</{DSML}function_calls>')
    args = {"city": "Paris\nand <around> \" string=\"false\">", "days": 3, "unit": "c", "where": {"lat": 48.8}}
    search = {"query": "3", "limit": 2.5, "flag": True, "extra": {"a": "é"}, "word": "plain text", "none": None}
    text = "Let me look.\n" + _calls(("get_weather", args), ("search", search))
    content, calls = fmt.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("search", search)]
    assert [c.start for c in calls] == [text.index(f'invoke name="{name}"') - len(f"<{DSML}")
                                        for name in ("get_weather", "search")]
    # the mark decides, not the schema: an integer marked a string stays text, a string marked JSON is its JSON
    marked = _calls(("get_weather", {"city": "x", "days": 1})).replace('"false">1<', '"true">1<') \
        .replace('"true">x<', '"false">"x"<')
    assert json.loads(fmt.parse(marked)[1][0].arguments) == {"city": "x", "days": "1"}
    assert json.loads(fmt.parse(marked.replace('"false">"x"<', '"false">not json<'))[1][0].arguments)["city"] == \
        "not json"


@pytest.mark.parametrize("text", [
    f'<{DSML}function_calls><{DSML}invoke name="nope"></{DSML}invoke></{DSML}function_calls>',   # not offered
    f"Wrap calls in <{DSML}function_calls> tags.", f"<{DSML}function_calls></{DSML}function_calls>",
    f'<{DSML}function_calls><{DSML}invoke name="search">\nlike this</{DSML}invoke></{DSML}function_calls>',
    f'<{DSML}function_calls><{DSML}invoke name="search"><{DSML}parameter name="query" string="maybe">q'
    f'</{DSML}parameter></{DSML}invoke></{DSML}function_calls>',                                   # an unknown mark
    f'<{DSML}function_calls><{DSML}invoke name="search"><{DSML}parameter name="query" string="true">q'
    f'</{DSML}parameter></{DSML}invoke>',                                                          # never closed
    MINIMAX_TEMPLATE])
def test_what_is_not_a_call_of_an_offered_function_stays_content(fmt, text):
    assert fmt.parse(text) == (text, [])


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_call_as_its_arguments_close(fmt, cut):
    text = "Checking.\n" + _calls(("get_weather", {"city": "Rome </｜DSML｜invoke>", "days": 1}),
                                  ("search", {"query": "a", "limit": 2}))
    text = text[:text.rindex(f"2</{DSML}parameter>") + 1] if cut else text
    sent, args, names, count = streamed_by_character(fmt, text, cut)
    content, calls = fmt.parse_reply(text, cut=cut)
    assert sent == content == "Checking." and count == len(calls) == 2
    assert names == {0: "get_weather", 1: "search"} and [args[0], args[1]] == [c.arguments for c in calls]
    assert json.loads(args[0]) == {"city": "Rome </｜DSML｜invoke>", "days": 1}
    assert [c.cut for c in calls] == [False, cut]
    assert json.loads(args[1] + ("}" if cut else "")) == ({"query": "a"} if cut else {"query": "a", "limit": 2})


def test_a_marker_in_prose_holds_back_no_text_after_it_in_a_stream(fmt):
    prose_markers_stream(fmt, f"Put a call in a {fmt.start} tag, then go on.\n", f"{fmt.start} ok.\n")


def test_the_grammars_write_each_argument_marked_as_its_schemas_type(fmt, lltokenizer):
    check_form_grammars(fmt, _calls, lltokenizer, render(MINIMAX_TEMPLATE, [{
        "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 0}}}]}], False, False, {}))


async def test_a_pool_whose_template_writes_dsml_answers_a_forced_call(aiohttp_client, tmp_path, tiny_model):
    """Over HTTP, a pool of the tiny model whose template writes DSML calls: tool_choice "required" writes a call
    the grammar keeps in the form, each value marked as its type, read back as the call (whole and streamed)."""
    template = POOL_TEMPLATE.replace("{}", f'<{DSML}function_calls>\n<{DSML}invoke name="NAME">\n'
                                           f'<{DSML}parameter name="KEY" string="true">VALUE</{DSML}parameter>\n'
                                           f'</{DSML}invoke>\n</{DSML}function_calls>')
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}
    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, template, unit, 160)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["metric"], bool)
