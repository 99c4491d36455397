"""DeepSeek's tool-call forms (`deepseek_v31`: V3.1's; `deepseek_v3`: V3-0324's and R1-0528's, the arguments in a
JSON fence): found from the template, a history's calls rendered by the template's own `+` of their arguments and
read back as those calls, the text before them content, a stream that sends the text as it comes and each call's
arguments as the model writes them, a reply max_tokens cut inside a call, and the grammars of forced and strict
calls, checked with llguidance itself token by token on the builtin tokenizer. A chat over a pool whose template
writes the form answers with these calls."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render
from gateway.openai.chat_prompt import native_messages
from gateway.openai.deepseek_tools import CALLS, DeepseekFormat
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tools import HermesFormat
from tests.gateway.test_tagged_tools import check_form_grammars
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import (SEARCH, WEATHER, forced_call_over_http, streamed_arguments,
                                          streamed_by_character)

# how DeepSeek's templates write a history's calls: the arguments joined to the text with `+`, as the JSON text
# OpenAI sends (V3.1's; V3-0324's and R1-0528's with the type, the name on its line and a JSON fence)
_TURN = ("{%- for m in messages %}{%- if m.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}"
         "{%- for tool in m.tool_calls %}{{- CALL }}{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}"
         "{%- endfor %}")
V31_TEMPLATE = _TURN.replace("CALL", "'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
                                     "tool['function']['arguments'] + '<｜tool▁call▁end｜>'")
V3_TEMPLATE = _TURN.replace("CALL", "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
                                    "tool['function']['name'] + '\\n' + '```json' + '\\n' + "
                                    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'")
TEMPLATES = {"deepseek_v31": V31_TEMPLATE, "deepseek_v3": V3_TEMPLATE}


def _calls(template: str, *calls: tuple[str, dict]) -> str:
    """A history's assistant turn of `calls` (their arguments as OpenAI sends them: JSON text) as `template`
    writes it."""
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]}]
    return render(template, native_messages(history), False, False, {})


@pytest.fixture(scope="module", params=list(TEMPLATES))
def form(request) -> tuple[DeepseekFormat, str]:
    found = tool_format(TEMPLATES[request.param], parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, DeepseekFormat) and found.name == request.param
    return found, TEMPLATES[request.param]


def test_a_template_that_writes_deepseeks_markers_takes_its_form_and_its_history_renders():
    """The history's arguments reach the template as a dict that `+` joins as its JSON (a dict failed the render:
    the templates were written for OpenAI's text); `| tojson` and `.items()` see the dict."""
    assert isinstance(tool_format("{{ '<tool_call>' }}{{ tool_call | tojson }}", parse_tools([WEATHER])), HermesFormat)
    assert _calls(V31_TEMPLATE, ("search", {"query": "q"})) == \
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "q"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert _calls(V3_TEMPLATE, ("search", {"query": "q"})) == (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"query": "q"}\n```'
        '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    both = "{% for t in messages[0].tool_calls %}{{ t.function.arguments | tojson }}{% for k, v in " \
           "t.function.arguments.items() %}[{{ k }}]{% endfor %}{{ t.function.arguments + '!' }}{% endfor %}"
    assert _calls(both, ("search", {"query": "é", "limit": 2})) == \
        '{"query": "é", "limit": 2}[query][limit]{"query": "é", "limit": 2}!'


def test_the_calls_a_template_writes_read_back_as_those_calls(form):
    fmt, template = form
    args = {"city": "Paris <｜tool▁call▁end｜> }", "days": 3, "where": {"lat": 48.8, "t": [None, "```"]}}
    text = "Let me look." + _calls(template, ("get_weather", args), ("search", {"query": "x"}))
    content, calls = fmt.parse(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args), ("search", {"query": "x"})]
    assert [c.start for c in calls] == [i for i in range(len(text)) if text.startswith("<｜tool▁call▁begin｜>", i)]
    loose = text.replace("}<｜tool▁call▁end｜>", "} \n<｜tool▁call▁end｜>").replace("```json\n", "```json \n\n")
    loose = loose.replace("```<｜tool▁call▁end｜>", "``` \n<｜tool▁call▁end｜>")
    loose = loose.replace("<｜tool▁sep｜>{", "<｜tool▁sep｜>\n {")   # blanks between the markers and the object
    assert [(c.name, c.arguments) for c in fmt.parse(loose)[1]] == [(c.name, c.arguments) for c in calls]


NOT_CALLS = [
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "Wrap calls in <｜tool▁calls▁begin｜> markers.",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"a": 1} and<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "q"}<｜tool▁call▁end｜>',   # never closed
    "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"]


def test_what_is_not_a_call_of_an_offered_function_stays_content(form):
    fmt, _ = form
    for text in NOT_CALLS if fmt.name == "deepseek_v31" else [t.replace("<｜tool▁call▁begin｜>search<｜tool▁sep｜>",
                                                                         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                                                                         "search\n```json\n") for t in NOT_CALLS]:
        assert fmt.parse(text) == (text, []), text


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_calls_arguments_as_written_adding_up_to_the_whole_answer(form, cut):
    """Character by character: the text before the calls as it comes; a call once its arguments' `{` is written,
    then their text in pieces; `cut`: max_tokens ends the reply inside the second call's arguments."""
    fmt, template = form
    json_calls_stream(fmt, lambda *calls: _calls(template, *calls), cut)


def json_calls_stream(fmt, render, cut: bool) -> str:
    """A reply of text and two calls (`render`: a turn of calls as the template writes it) streamed character by
    character adds up to the whole answer: the text as content, each call's arguments the model's own JSON text
    (`cut`: max_tokens ends the reply inside the second's); the reply."""
    text = "Checking." + render(("get_weather", {"city": "Rome }]\\\"", "days": 1}),
                                ("search", {"query": "a", "limit": 2}))
    text = text[:text.rindex('"limit"') + 4] if cut else text
    sent, args, names, count = streamed_by_character(fmt, text, cut)
    content, calls = fmt.parse_reply(text, cut=cut)
    assert sent == content == "Checking." and count == len(calls) == 2
    assert names == {0: "get_weather", 1: "search"} and [args[0], args[1]] == [c.arguments for c in calls]
    assert [c.cut for c in calls] == [False, cut] and args[1] == ('{"query": "a", "lim' if cut else
                                                                   '{"query": "a", "limit": 2}')
    return text


def test_a_reply_cut_before_a_calls_arguments_drops_it_and_a_marker_in_prose_holds_back_nothing(form):
    fmt, template = form
    text = "Ok." + _calls(template, ("search", {"query": "q"}))
    assert fmt.parse_reply(text[:text.index("{")], cut=True) == ("Ok.", [])
    prose_markers_stream(fmt, f"Put calls in {CALLS} markers, then go on.\n", f"{CALLS} ok.\n")


def test_the_grammars_write_the_form_a_strict_functions_arguments_under_its_schema(form, lltokenizer):
    fmt, template = form
    other = TEMPLATES["deepseek_v3" if fmt.name == "deepseek_v31" else "deepseek_v31"]
    check_form_grammars(fmt, lambda *calls: _calls(template, *calls), lltokenizer,
                        _calls(other, ("get_weather", {"city": "Paris", "days": 0})))


POOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME"
    "<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜><｜tool▁calls▁end｜> of these: {% for t in tools %}"
    "{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_a_pool_whose_template_writes_the_form_answers_forced_calls_whole_and_streamed(aiohttp_client, tmp_path,
                                                                                            tiny_model):
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}
    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, POOL_TEMPLATE, unit, 200)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["metric"], bool)


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(form):
    fmt, template = form
    code = ("def f(x):\n    return '}<｜tool▁call▁end｜>' if x else None\n" * 4000)[:200_000]
    text = "Writing." + _calls(template, ("search", {"query": code}), ("search", {"limit": 1, "query": code[:1000]}))
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": code[:1000]}]
    assert took < 5.0, took
