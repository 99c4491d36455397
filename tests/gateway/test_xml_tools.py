"""The XML tool-call format (`qwen3_xml`: Qwen3-Coder's, Qwen3.5's): found from the template, its calls read with
each argument as its schema's type (what the template writes for a history's call reads back as that call), the
text before them content, a stream that sends the text as it comes and the calls whole at the end, a reply
max_tokens cut inside a call, and the grammars of forced and strict calls, checked with llguidance itself token by
token on the builtin tokenizer. A chat over a pool whose template writes this form answers with these calls."""

from __future__ import annotations

import json

import jinja2
import llguidance
import pytest

from engine.structured import StructuredOutput, check
from engine.tokenizer import Tokenizer
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tool_formats import tool_format
from gateway.openai.tools import HermesFormat, ToolCallStream
from gateway.openai.xml_tools import XmlFormat, typed_value

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "where": {"type": "object"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}}}}
# the form as Qwen3-Coder's template writes a history's calls (its arguments' values: `| string`)
CALLS_TEMPLATE = (
    "{%- for message in messages %}{%- for tool_call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.function.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.function.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value if args_value is string else args_value | string %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{%- endfor %}")


def _xml(*calls: tuple[str, dict]) -> str:
    return jinja2.Environment().from_string(CALLS_TEMPLATE).render(messages=[{"tool_calls": [
        {"function": {"name": name, "arguments": args}} for name, args in calls]}]).lstrip("\n")


@pytest.fixture(scope="module")
def fmt() -> XmlFormat:
    found = tool_format(CALLS_TEMPLATE, parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, XmlFormat) and found.name == "qwen3_xml"
    return found


def test_a_template_that_writes_function_tags_takes_the_xml_form_and_others_keep_theirs():
    tools = parse_tools([WEATHER])
    assert isinstance(tool_format("{{ '<tool_call>' }}{{ tool_call | tojson }}", tools), HermesFormat)
    assert isinstance(tool_format("<function=", tools), XmlFormat)


def test_the_calls_a_template_writes_read_back_as_those_calls_each_argument_its_type(fmt):
    args = {"city": "Paris\nand around", "days": 3, "unit": "c", "where": {"lat": 48.8, "tags": ["a", None]}}
    text = "Let me look.\n" + _xml(("get_weather", args), ("search", {"query": "x < y </para", "limit": 2.5}))
    content, calls = fmt.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args), ("search", {"query": "x < y </para", "limit": 2.5})]
    assert calls[0].start == text.index("<tool_call>")
    # the closing tag left out at the reply's end (a model stopped by its end-of-call token) still closes it
    assert fmt.parse(_xml(("search", {"query": "q"}))[:-len("</tool_call>")])[1][0].arguments == '{"query": "q"}'


@pytest.mark.parametrize("raw, prop, value", [
    ("3", {"type": "integer"}, 3), ("3.5", {"type": "integer"}, "3.5"), ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7), ("True", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": ["integer", "null"]}, None), ("null", {"type": "string"}, "null"),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("{'a': None}", {"type": "object"}, {"a": None}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"), ("{(1, 2): 3}", {"type": "object"}, "{(1, 2): 3}"),
    ("NaN", {"type": "number"}, "NaN"), ("[" * 300 + "]" * 300, {"type": "array"}, "[" * 300 + "]" * 300),
    (" 12 ", None, " 12 "), ("x", {"enum": ["x"]}, "x")])
def test_an_arguments_text_is_read_as_its_schemas_type_or_kept_as_text(raw, prop, value):
    assert typed_value(raw, prop) == value


def test_what_is_not_a_call_of_an_offered_function_stays_content(fmt):
    for text in ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "a <tool_call> b",
                 "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n",   # never closed
                 "<tool_call>\n<function=search>\n</function>\ntext after"):
        assert fmt.parse(text) == (text, []), text


def test_a_stream_sends_the_text_before_the_calls_as_it_comes_and_the_calls_whole_at_the_end(fmt):
    text = "Checking.\n" + _xml(("get_weather", {"city": "Rome", "days": 1}))
    stream, sent = ToolCallStream(fmt, forced=False), ""
    for end in range(1, len(text) + 1):
        sent += stream.content_delta(text[:end])
        assert not stream.call_deltas(text[:end])
    rest, entries, count = stream.finish(text)
    assert sent + rest == "Checking." and count == 1
    assert [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries] == [
        ("get_weather", {"city": "Rome", "days": 1})]


def test_a_reply_cut_inside_a_call_ends_in_that_call_as_far_as_its_arguments_are_whole(fmt):
    text = "Ok.\n" + _xml(("get_weather", {"city": "Oslo", "days": 2}))
    cut = text[:text.index("<parameter=days>") + len("<parameter=days>\n2")]
    content, calls = fmt.parse_reply(cut, cut=True)
    assert content == "Ok." and [(c.name, c.arguments, c.cut) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}', True)]
    assert fmt.parse_reply("Ok.\n<tool_call>\n<function=get_w", cut=True) == ("Ok.\n", [])
    assert fmt.parse_reply(text, cut=True)[1][0].cut is False


@pytest.fixture(scope="module")
def lltokenizer(builtin_path):
    return llguidance.LLTokenizer(Tokenizer.from_folder(builtin_path).to_json())


def _accepts(lltokenizer, constraint: StructuredOutput, text: str) -> bool:
    matcher = llguidance.LLMatcher(lltokenizer, constraint.grammar_text(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltokenizer.tokenize_str(text)
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    matcher.consume_tokens(tokens)
    return matcher.is_accepting()


def test_the_grammars_write_the_form_a_strict_functions_arguments_under_its_schema(fmt, lltokenizer):
    tools = parse_tools([WEATHER, SEARCH])
    forced, auto = fmt.grammar(tools, True), fmt.auto_grammar(tools, True)
    for grammar in (forced, auto):
        check(grammar)
    good = _xml(("get_weather", {"city": "New\nYork </para", "days": 2, "unit": "f"}))
    good = good.replace("</function>", '<parameter=where>\n{"a": [1]}\n</parameter>\n</function>')   # JSON
    search = _xml(("search", {"query": "anything", "other": "any name"}))
    for text in (good, _xml(("get_weather", {"city": "Paris", "days": 0})), search, good + "\n" + search):
        assert _accepts(lltokenizer, forced, text) and _accepts(lltokenizer, auto, text), text
        assert fmt.parse(text)[1], text
    for bad in ({"city": "Paris"}, {"city": "Paris", "days": "two"}, {"city": "Paris", "days": 1, "unit": "k"},
                {"days": 1, "city": "Paris"}, {"city": "Paris", "days": 1, "extra": 1}):
        assert not _accepts(lltokenizer, forced, _xml(("get_weather", bad))), bad
    for text in ("", "Sunny.", "Let me check.\n" + good):        # text, or text and then calls, under auto only
        assert _accepts(lltokenizer, auto, text) and not _accepts(lltokenizer, forced, text), text
    assert not _accepts(lltokenizer, fmt.grammar(tools, False), good + "\n" + search)
    assert not _accepts(lltokenizer, auto, "a <tool_call> b")


# A template of the form: it lists the tools, and its history's calls are `CALLS_TEMPLATE`'s
POOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call> of these: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_a_pool_whose_template_writes_the_form_answers_forced_calls_whole_and_streamed(aiohttp_client, tmp_path,
                                                                                            tiny_model):
    """Over HTTP, a pool of the tiny model whose template writes the XML form: tool_choice "required" writes a
    call the grammar keeps in the form, read back as the call OpenAI's answer holds (and the same streamed)."""
    import shutil

    from tests.gateway.conftest import chat_pool_yaml, start_gateway

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(POOL_TEMPLATE)
    client, _ = await start_gateway(aiohttp_client, tmp_path, chat_pool_yaml(model, max_model_len=512))
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit"], "additionalProperties": False,
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
    body = {"model": "model", "messages": [{"role": "user", "content": "Use celsius."}], "tools": [unit],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    choice = (await r.json())["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["set_unit"]
    assert json.loads(calls[0]["function"]["arguments"])["unit"] in ("celsius", "fahrenheit")
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    streamed = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
    deltas = [d for chunk in streamed for c in chunk["choices"] for d in c["delta"].get("tool_calls") or ()]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        ("set_unit", calls[0]["function"]["arguments"])]
