"""The GLM tool-call format (`glm45`: GLM-4.5's, GLM-4.6's, GLM-4.7's): found from the template, its calls read
with each argument as its schema's type (what the template writes for a history's call reads back as that call),
the text before them content, a stream that sends the text as it comes and each call as its arguments close, a
reply max_tokens cut inside a call, and the grammars of forced and strict calls, checked with llguidance itself
token by token on the builtin tokenizer. A chat over a pool whose template writes this form answers with these
calls."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render
from engine.structured import check
from gateway.openai.glm_tools import GlmFormat
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tools import HermesFormat, ToolCallStream
from gateway.openai.xml_tools import XmlFormat
from tests.gateway.conftest import accepts
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import SEARCH, WEATHER, forced_call_over_http, streamed_arguments

# how GLM-4.5's template writes a history's calls (GLM-4.7's: the same without the newlines around the tags); HF's
# template options (trim_blocks, lstrip_blocks) drop the newline after each block tag
CALLS_TEMPLATE = (
    "{%- for m in messages %}{% for tc in m.tool_calls %}\n"
    "{%- if tc.function %}\n    {%- set tc = tc.function %}\n{%- endif %}\n"
    "{{ '\\n<tool_call>' + tc.name }}\n"
    "{% set _args = tc.arguments %}\n"
    "{% for k, v in _args.items() %}\n"
    "<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n"
    "{% endfor %}\n"
    "</tool_call>{% endfor %}{% endfor %}")
COMPACT_TEMPLATE = (
    "{%- for m in messages %}{% for tc in m.tool_calls %}"
    "{{- '<tool_call>' + tc.function.name -}}"
    "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}"
    "</tool_call>{% endfor %}{% endfor %}")


def _glm(*calls: tuple[str, dict], template: str = CALLS_TEMPLATE) -> str:
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    return render(template, history, False, False, {}).lstrip("\n")


@pytest.fixture(scope="module", params=[CALLS_TEMPLATE, COMPACT_TEMPLATE], ids=["glm45", "glm47"])
def form(request) -> tuple[GlmFormat, str]:
    found = tool_format(request.param, parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, GlmFormat) and found.name == "glm45"
    assert found.compact is (request.param == COMPACT_TEMPLATE)
    return found, request.param


def test_a_template_that_writes_arg_keys_takes_the_glm_form_and_others_keep_theirs():
    tools = parse_tools([WEATHER])
    assert isinstance(tool_format("{{ '<tool_call>' }}{{ tool_call | tojson }}", tools), HermesFormat)
    assert isinstance(tool_format("<tool_call>\n<function=", tools), XmlFormat)
    assert isinstance(tool_format(CALLS_TEMPLATE, tools), GlmFormat)
    assert _glm(("search", {"query": "q", "limit": 2})) == \
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>q</arg_value>\n<arg_key>limit</arg_key>\n" \
        "<arg_value>2</arg_value>\n</tool_call>"
    assert _glm(("search", {"query": "q"}), template=COMPACT_TEMPLATE) == \
        "<tool_call>search<arg_key>query</arg_key><arg_value>q</arg_value></tool_call>"


def test_the_calls_a_template_writes_read_back_as_those_calls_each_argument_its_type(form):
    fmt, template = form
    args = {"city": "Paris\nand <around> </arg_key>", "days": 3, "unit": "c", "where": {"lat": 48.8, "t": [None]}}
    search = {"query": "3", "limit": 2.5, "flag": True, "extra": {"a": "é"}, "word": "plain text"}
    text = "Let me look.\n" + _glm(("get_weather", args), ("search", search), template=template)
    content, calls = fmt.parse(text)
    assert content == "Let me look."
    # `query` is declared a string: "3" stays text; undeclared arguments come back as the JSON tojson wrote
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("search", search)]
    assert [c.start for c in calls] == [text.index("<tool_call>get_weather"), text.index("<tool_call>search")]
    # blanks around the tags as models write them at times (vLLM's parsers read them too); a key stripped
    loose = "<tool_call> search \n\n<arg_key> query </arg_key>  <arg_value>q</arg_value>\n\n</tool_call>"
    assert [(c.name, c.arguments) for c in fmt.parse(loose)[1]] == [("search", '{"query": "q"}')]


@pytest.mark.parametrize("text", [
    "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",   # a function not offered
    "Wrap a call in <tool_call> tags.", "a <tool_call> b\nc",
    "<tool_call>search\nlike this</tool_call>",                                        # text between the tags
    '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',                  # hermes' JSON
    "<tool_call>search\n<arg_key>query</arg_key> <arg_value>q</arg_value>",            # never closed
    "<tool_call>search\n<arg_key>query</arg_key> q</arg_value>\n</tool_call>",         # a value without its tag
])
def test_what_is_not_a_call_of_an_offered_function_stays_content(form, text):
    fmt, _ = form
    assert fmt.parse(text) == (text, [])


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_call_as_its_arguments_close_adding_up_to_the_whole_answer(form, cut):
    """Character by character: the text before the calls as it comes; a call's name once a tag follows it, then
    each argument's JSON once its `</arg_value>` is written; the pieces add up to the whole answer's arguments, a
    duplicate key's first value kept by both; `cut`: max_tokens ends the reply inside the second call's value."""
    fmt, template = form
    text = "Checking.\n" + _glm(("get_weather", {"city": "Rome </arg_key> <arg_value>", "days": 1}),
                                ("search", {"query": "a", "limit": 2}), template=template)
    text = text.replace("<arg_value>a</arg_value>", "<arg_value>a</arg_value><arg_key>query</arg_key><arg_value>"
                                                    "b</arg_value>")
    text = text[:text.rindex("2</arg_value>") + 1] if cut else text
    stream, sent, args, names = ToolCallStream(fmt, forced=False), "", {}, {}
    for end in range(1, len(text) + 1):
        sent += stream.content_delta(text[:end])
        for entry in stream.call_deltas(text[:end]):
            if "id" in entry:
                names[entry["index"]] = entry["function"]["name"]
            args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
        if end == text.index("<arg_key>days"):
            assert args == {0: '{"city": "Rome </arg_key> <arg_value>"'}           # the first argument, whole
    rest, entries, count = stream.finish(text, cut=cut)
    for entry in entries:
        args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
    content, calls = fmt.parse_reply(text, cut=cut)
    assert sent + rest == content == "Checking." and count == len(calls) == 2
    assert names == {0: "get_weather", 1: "search"} and [args[0], args[1]] == [c.arguments for c in calls]
    assert [c.cut for c in calls] == [False, cut]
    assert json.loads(args[1] + ("}" if cut else "")) == ({"query": "a"} if cut else {"query": "a", "limit": 2})


def test_a_reply_cut_inside_a_call_ends_in_that_call_as_far_as_its_arguments_are_whole(form):
    fmt, template = form
    text = "Ok.\n" + _glm(("get_weather", {"city": "Oslo", "days": 2}), template=template)
    cut = text[:text.index("<arg_key>days") + len("<arg_key>days</arg_key>")]
    content, calls = fmt.parse_reply(cut, cut=True)
    assert content == "Ok." and [(c.name, c.arguments, c.cut) for c in calls] == [
        ("get_weather", '{"city": "Oslo"', True)]
    assert fmt.parse_reply("Ok.\n<tool_call>get_w", cut=True) == ("Ok.\n", [])   # its name never whole
    assert fmt.parse_reply(text, cut=True)[1][0].cut is False
    prose = "Wrap calls in <tool_call> tags, then explain at length"
    assert fmt.parse_reply(prose, cut=True) == (prose, [])
    refused = "<tool_call>nope\n</tool_call>\nSorry, I"
    assert fmt.parse_reply(refused, cut=True) == (refused, [])
    content, calls = fmt.parse_reply(refused + "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>fo", True)
    assert content == refused and [(c.name, c.arguments, c.cut) for c in calls] == [("search", "{", True)]


def test_a_marker_in_prose_holds_back_no_text_after_it_in_a_stream(form):
    prose_markers_stream(form[0], "Put a call in a <tool_call> tag, then go on.\n", "<tool_call> ok.\n")


def test_the_grammars_write_the_form_a_strict_functions_arguments_under_its_schema(form, lltokenizer):
    fmt, template = form
    tools = parse_tools([WEATHER, SEARCH])
    forced, auto = fmt.grammar(tools, True), fmt.auto_grammar(tools, True)
    for grammar in (forced, auto):
        check(grammar)
    good = _glm(("get_weather", {"city": "New\nYork </arg_key>", "days": 2, "unit": "f", "where": {"a": [1]}}),
                template=template)
    search = _glm(("search", {"query": "anything", "other": "any name"}), template=template)
    joined = good + ("\n" if template == CALLS_TEMPLATE else "") + search
    for text in (good, _glm(("get_weather", {"city": "Paris", "days": 0}), template=template), search, joined):
        assert accepts(lltokenizer, forced, text) and accepts(lltokenizer, auto, text), text
        assert fmt.parse(text)[1], text
    for bad in ({"city": "Paris"}, {"city": "Paris", "days": "two"}, {"city": "Paris", "days": 1, "unit": "k"},
                {"days": 1, "city": "Paris"}, {"city": "Paris", "days": 1, "extra": 1}):
        assert not accepts(lltokenizer, forced, _glm(("get_weather", bad), template=template)), bad
    for text in ("", "Sunny.", "Let me check.\n" + good):        # text, or text and then calls, under auto only
        assert accepts(lltokenizer, auto, text) and not accepts(lltokenizer, forced, text), text
    assert not accepts(lltokenizer, fmt.grammar(tools, False), joined)
    assert not accepts(lltokenizer, auto, "a <tool_call> b")
    other = _glm(("get_weather", {"city": "Paris", "days": 0}), template=COMPACT_TEMPLATE if not fmt.compact
                 else CALLS_TEMPLATE)
    assert not accepts(lltokenizer, forced, other)   # the grammar writes its own template's form


# A template of the form: it lists the tools, and its history's calls are `CALLS_TEMPLATE`'s
POOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as <tool_call>NAME\n<arg_key>KEY</arg_key>\n"
    "<arg_value>VALUE</arg_value>\n</tool_call> of these: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_a_pool_whose_template_writes_the_form_answers_forced_calls_whole_and_streamed(aiohttp_client, tmp_path,
                                                                                            tiny_model):
    """Over HTTP, a pool of the tiny model whose template writes the GLM form: tool_choice "required" writes a
    call the grammar keeps in the form, read back as the call OpenAI's answer holds (and the same streamed), a
    JSON value read as its type."""
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}
    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, POOL_TEMPLATE, unit, 120)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["metric"], bool)


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(form):
    """Two calls of 200 KB arguments (a file a coding agent writes) streamed 40 characters at a time: each value's
    closing tag is searched for once, from where the last look stopped."""
    fmt, template = form
    code = ("def f(x):\n    return '<arg_key>' if x else None\n" * 4000)[:200_000]
    plain = ("def g(y):\n    return y * 2\n" * 8000)[:200_000]
    text = "Writing.\n" + _glm(("search", {"query": code}), ("search", {"limit": 1, "query": plain}),
                               template=template)
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": plain}]
    assert took < 5.0, took
