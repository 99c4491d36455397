"""The tool-call formats of arguments in tags (`glm45`: GLM-4.5's to GLM-4.7's; `minimax_m2`: MiniMax-M2's; `seed_oss`):
found from the template, their calls read with each argument as its schema's type (what the template writes for a
history's call reads back as that call), the text before them content, a stream that sends the text as it comes and
each call as its arguments close, a reply max_tokens cut inside a call, and the grammars of forced and strict calls,
checked with llguidance itself token by token on the builtin tokenizer. A chat over a pool whose template writes
one of these forms answers with these calls."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render
from engine.structured import check
from gateway.openai.tagged_tools import TaggedFormat
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tools import HermesFormat
from gateway.openai.xml_tools import XmlFormat
from tests.gateway.conftest import accepts
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import (SEARCH, WEATHER, forced_call_over_http, streamed_arguments,
                                          streamed_by_character)

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
# how MiniMax-M2's template writes them: a turn's calls in one block
MINIMAX_TEMPLATE = (
    "{%- for m in messages %}{%- if m.tool_calls %}{{- '<minimax:tool_call>\\n' }}"
    "{%- for tc in m.tool_calls %}{%- set tc = tc.function %}{{- '<invoke name=\"' + tc.name + '\">\\n' }}"
    "{%- for k, v in tc.arguments.items() %}{{- '<parameter name=\"' + k + '\">' }}"
    "{{- v | tojson(ensure_ascii=False) if v is not string else v }}{{- '</parameter>\\n' }}{%- endfor %}"
    "{{- '</invoke>\\n' }}{%- endfor %}{{- '</minimax:tool_call>' }}{%- endif %}{%- endfor %}")
# how Seed-OSS's template writes them: each call a block of Qwen3-Coder's tags, each value up to its closing tag
SEED_TEMPLATE = (
    "{%- for m in messages %}{%- for tc in m.tool_calls %}"
    "{{- '<seed:tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in tc.function.arguments.items() %}{{- '<parameter=' + k + '>' }}"
    "{{- v | tojson(ensure_ascii=False) if v is not string else v }}{{- '</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</seed:tool_call>' }}{%- endfor %}{%- endfor %}")
TEMPLATES = {"glm45": CALLS_TEMPLATE, "glm47": COMPACT_TEMPLATE, "minimax_m2": MINIMAX_TEMPLATE,
             "seed_oss": SEED_TEMPLATE}


def _calls(template: str, *calls: tuple[str, dict]) -> str:
    """A history's assistant turn of `calls` as `template` writes it."""
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    return render(template, history, False, False, {}).lstrip("\n")


@pytest.fixture(scope="module", params=list(TEMPLATES))
def form(request) -> tuple[TaggedFormat, str]:
    found = tool_format(TEMPLATES[request.param], parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, TaggedFormat) and found.name == request.param.replace("glm47", "glm45")
    assert found.form.line == ("" if request.param == "glm47" else "\n")
    return found, TEMPLATES[request.param]


def _argument(fmt: TaggedFormat, key: str, value: str) -> str:
    """One argument in the form, as the grammars write it."""
    form = fmt.form
    return f"{form.key}{key}{form.key_close}{form.line + form.value if form.value else ''}{value}{form.value_end}"


def test_a_template_that_writes_tagged_arguments_takes_its_form_and_others_keep_theirs():
    tools = parse_tools([WEATHER])
    assert isinstance(tool_format("{{ '<tool_call>' }}{{ tool_call | tojson }}", tools), HermesFormat)
    assert isinstance(tool_format("<tool_call>\n<function=", tools), XmlFormat)
    assert _calls(CALLS_TEMPLATE, ("search", {"query": "q", "limit": 2})) == \
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>q</arg_value>\n<arg_key>limit</arg_key>\n" \
        "<arg_value>2</arg_value>\n</tool_call>"
    assert _calls(COMPACT_TEMPLATE, ("search", {"query": "q"})) == \
        "<tool_call>search<arg_key>query</arg_key><arg_value>q</arg_value></tool_call>"
    assert _calls(MINIMAX_TEMPLATE, ("search", {"query": "q"}), ("search", {"limit": 2})) == \
        '<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">q</parameter>\n</invoke>\n' \
        '<invoke name="search">\n<parameter name="limit">2</parameter>\n</invoke>\n</minimax:tool_call>'
    assert _calls(SEED_TEMPLATE, ("search", {"query": "q"})) == \
        "<seed:tool_call>\n<function=search>\n<parameter=query>q</parameter>\n</function>\n</seed:tool_call>"
    assert isinstance(tool_format(SEED_TEMPLATE, tools), TaggedFormat)   # not Qwen3-Coder's, whose tags it has


LOOSE = {   # blanks around the tags, as models write them at times (vLLM's parsers read them too); a key stripped
    "<tool_call>": "<tool_call> search \n\n<arg_key> query </arg_key>  <arg_value>q</arg_value>\n\n</tool_call>",
    "<minimax:tool_call>": '<minimax:tool_call>  <invoke name="search">\n\n<parameter name=" query ">q</parameter>'
                           '</invoke>\n\n</minimax:tool_call>',
    "<seed:tool_call>": "<seed:tool_call>  <function=search>\n\n<parameter= query >q</parameter></function>\n\n"
                        "</seed:tool_call>"}


def test_the_calls_a_template_writes_read_back_as_those_calls_each_argument_its_type(form):
    fmt, template = form
    args = {"city": "Paris\nand <around> </arg_key> \">", "days": 3, "unit": "c", "where": {"lat": 48.8, "t": [None]}}
    search = {"query": "3", "limit": 2.5, "flag": True, "extra": {"a": "é"}, "word": "plain text"}
    text = "Let me look.\n" + _calls(template, ("get_weather", args), ("search", search))
    content, calls = fmt.parse(text)
    assert content == "Let me look."
    # `query` is declared a string: "3" stays text; undeclared arguments come back as the JSON tojson wrote
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("search", search)]
    function = fmt.form.function
    assert [c.start for c in calls] == [text.index(f"{function}get_weather"), text.index(f"{function}search")]
    assert [(c.name, c.arguments) for c in fmt.parse(LOOSE[fmt.start])[1]] == [("search", '{"query": "q"}')]


NOT_CALLS = {
    "<tool_call>": [
        "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",   # a function not offered
        "Wrap a call in <tool_call> tags.", "a <tool_call> b\nc",
        "<tool_call>search\nlike this</tool_call>",                                        # text between the tags
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',                  # hermes' JSON
        "<tool_call>search\n<arg_key>query</arg_key> <arg_value>q</arg_value>",            # never closed
        "<tool_call>search\n<arg_key>query</arg_key> q</arg_value>\n</tool_call>"],       # a value without its tag
    "<minimax:tool_call>": [
        '<minimax:tool_call><invoke name="nope"></invoke></minimax:tool_call>',
        '<minimax:tool_call><invoke name="search"></invoke><invoke name="nope"></invoke></minimax:tool_call>',
        "Wrap calls in <minimax:tool_call> tags.", '<minimax:tool_call>\n<invoke name="a b"></invoke>',
        '<minimax:tool_call></minimax:tool_call>', '<invoke name="search"></invoke>',   # no call, no block
        '<minimax:tool_call><invoke name="search">\nlike this</invoke></minimax:tool_call>',
        '<minimax:tool_call><invoke name="search"><parameter name="query">q</parameter></invoke>'],
    "<seed:tool_call>": [
        "<seed:tool_call>\n<function=nope>\n</function>\n</seed:tool_call>", "Wrap calls in <seed:tool_call> tags.",
        "<seed:tool_call>\n<function=search>\nlike this</function>\n</seed:tool_call>",
        "<seed:tool_call>\n<function=search>\n<parameter=query>q</parameter>\n</function>\n",   # never closed
        "<function=search>\n</function>"]}                                                 # no block


def test_what_is_not_a_call_of_an_offered_function_stays_content(form):
    fmt, _ = form
    for text in NOT_CALLS[fmt.start]:
        assert fmt.parse(text) == (text, []), text


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_call_as_its_arguments_close_adding_up_to_the_whole_answer(form, cut):
    """Character by character: the text before the calls as it comes; a call's name once a tag follows it, then
    each argument's JSON once its value's closing tag is written; the pieces add up to the whole answer's arguments, a
    duplicate key's first value kept by both; `cut`: max_tokens ends the reply inside the second call's value."""
    fmt, template = form
    text = "Checking.\n" + _calls(template, ("get_weather", {"city": "Rome </arg_key> <arg_value>", "days": 1}),
                                  ("search", {"query": "a", "limit": 2}))
    value = f"{fmt.form.value}a{fmt.form.value_end}"
    text = text.replace(value, value + _argument(fmt, "query", "b"))
    text = text[:text.rindex("2" + fmt.form.value_end) + 1] if cut else text
    def each(end: int, args: dict[int, str]) -> None:
        if end == text.index(f"{fmt.form.key}days"):
            assert args == {0: '{"city": "Rome </arg_key> <arg_value>"'}           # the first argument, whole

    sent, args, names, count = streamed_by_character(fmt, text, cut, each)
    content, calls = fmt.parse_reply(text, cut=cut)
    assert sent == content == "Checking." and count == len(calls) == 2
    assert names == {0: "get_weather", 1: "search"} and [args[0], args[1]] == [c.arguments for c in calls]
    assert [c.cut for c in calls] == [False, cut]
    assert json.loads(args[1] + ("}" if cut else "")) == ({"query": "a"} if cut else {"query": "a", "limit": 2})


def test_a_reply_cut_inside_a_call_ends_in_that_call_as_far_as_its_arguments_are_whole(form):
    fmt, template = form
    text = "Ok.\n" + _calls(template, ("get_weather", {"city": "Oslo", "days": 2}))
    key = f"{fmt.form.key}days{fmt.form.key_close}"
    content, calls = fmt.parse_reply(text[:text.index(key) + len(key)], cut=True)
    assert content == "Ok." and [(c.name, c.arguments, c.cut) for c in calls] == [
        ("get_weather", '{"city": "Oslo"', True)]
    assert fmt.parse_reply(f"Ok.\n{fmt.syntax.open}get_w", cut=True) == ("Ok.\n", [])   # its name never whole
    assert fmt.parse_reply(text, cut=True)[1][0].cut is False
    prose = f"Wrap calls in {fmt.start} tags, then explain at length"
    assert fmt.parse_reply(prose, cut=True) == (prose, [])
    refused = _calls(template, ("nope", {})) + "\nSorry, I"
    assert fmt.parse_reply(refused, cut=True) == (refused, [])
    begun = f"{fmt.syntax.open}search{fmt.form.name_close or ''}{fmt.form.line}{_argument(fmt, 'query', 'fo')}"
    content, calls = fmt.parse_reply(refused + begun[:-len(fmt.form.value_end)], True)
    assert content == refused and [(c.name, c.arguments, c.cut) for c in calls] == [("search", "{", True)]
    two = _calls(template, ("search", {"query": "x"}), ("get_weather", {"city": "Oslo", "days": 2}))
    content, calls = fmt.parse_reply(two[:two.index(key) + len(key)], cut=True)   # the second call cut
    assert [(c.name, c.arguments, c.cut) for c in calls] == [("search", '{"query": "x"}', False),
                                                             ("get_weather", '{"city": "Oslo"', True)]


def test_a_marker_in_prose_holds_back_no_text_after_it_in_a_stream(form):
    fmt = form[0]
    prose_markers_stream(fmt, f"Put a call in a {fmt.start} tag, then go on.\n", f"{fmt.start} ok.\n")


OTHER = {CALLS_TEMPLATE: COMPACT_TEMPLATE, COMPACT_TEMPLATE: CALLS_TEMPLATE, MINIMAX_TEMPLATE: CALLS_TEMPLATE,
         SEED_TEMPLATE: MINIMAX_TEMPLATE}


def test_the_grammars_write_the_form_a_strict_functions_arguments_under_its_schema(form, lltokenizer):
    fmt, template = form
    check_form_grammars(fmt, lambda *calls: _calls(template, *calls), lltokenizer,
                        _calls(OTHER[template], ("get_weather", {"city": "Paris", "days": 0})))


def check_form_grammars(fmt, render, lltokenizer, other: str) -> None:
    """The grammars of forced and strict calls on a format (`render`: a turn of calls as its template writes it)
    take the calls of offered functions, a strict one's arguments under its schema and any name beside the others';
    `auto` takes text, or text and then calls, forced neither; `other`, a call in another form, is refused."""
    tools = parse_tools([WEATHER, SEARCH])
    forced, auto = fmt.grammar(tools, True), fmt.auto_grammar(tools, True)
    for grammar in (forced, auto):
        check(grammar)
    good = render(("get_weather", {"city": "New\nYork </arg_key>", "days": 2, "unit": "f", "where": {"a": [1]}}))
    search = render(("search", {"query": "anything", "other": "any name"}))
    joined = good + fmt.syntax.separator + search
    for text in (good, render(("get_weather", {"city": "Paris", "days": 0})), search, joined):
        assert accepts(lltokenizer, forced, text) and accepts(lltokenizer, auto, text), text
        assert fmt.parse(text)[1], text
    for bad in ({"city": "Paris"}, {"city": "Paris", "days": "two"}, {"city": "Paris", "days": 1, "unit": "k"},
                {"days": 1, "city": "Paris"}, {"city": "Paris", "days": 1, "extra": 1}):
        assert not accepts(lltokenizer, forced, render(("get_weather", bad))), bad
    for text in ("", "Sunny.", "Let me check.\n" + good):        # text, or text and then calls, under auto only
        assert accepts(lltokenizer, auto, text) and not accepts(lltokenizer, forced, text), text
    assert not accepts(lltokenizer, fmt.grammar(tools, False), joined)
    assert not accepts(lltokenizer, auto, f"a {fmt.start} b")
    assert not accepts(lltokenizer, forced, other)   # the grammar writes its own template's form


# Templates of the forms: they list the tools, and their history's calls are written as above
POOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as {} of these: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
POOL_TEMPLATES = {
    "glm45": POOL_TEMPLATE.replace("{}", "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n"
                                         "</tool_call>"),
    "minimax_m2": POOL_TEMPLATE.replace("{}", '<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">'
                                              'VALUE</parameter>\n</invoke>\n</minimax:tool_call>')}


@pytest.mark.parametrize("name", list(POOL_TEMPLATES))
async def test_a_pool_whose_template_writes_the_form_answers_forced_calls_whole_and_streamed(aiohttp_client, tmp_path,
                                                                                            tiny_model, name):
    """Over HTTP, a pool of the tiny model whose template writes the form: tool_choice "required" writes a call
    the grammar keeps in the form, read back as the call OpenAI's answer holds (and the same streamed), a JSON
    value read as its type."""
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}
    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, POOL_TEMPLATES[name], unit, 120)
    assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["metric"], bool)


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(form):
    """Two calls of 200 KB arguments (a file a coding agent writes) streamed 40 characters at a time: each value's
    closing tag is searched for once, from where the last look stopped."""
    fmt, template = form
    code = ("def f(x):\n    return '<arg_key>' if x else None\n" * 4000)[:200_000]
    plain = ("def g(y):\n    return y * 2\n" * 8000)[:200_000]
    text = "Writing.\n" + _calls(template, ("search", {"query": code}), ("search", {"limit": 1, "query": plain}))
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": plain}]
    assert took < 5.0, took
