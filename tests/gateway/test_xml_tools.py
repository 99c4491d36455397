"""The XML tool-call format (`qwen3_xml`: Qwen3-Coder's, Qwen3.5's): found from the template, its calls read with
each argument as its schema's type (what the template writes for a history's call reads back as that call), the
text before them content, a stream that sends the text as it comes and the calls whole at the end, a reply
max_tokens cut inside a call, and the grammars of forced and strict calls, checked with llguidance itself token by
token on the builtin tokenizer. A chat over a pool whose template writes this form answers with these calls."""

from __future__ import annotations

import json
import re

import jinja2
import pytest

from engine.structured import check
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tool_formats import tool_format
from gateway.openai.tools import HermesFormat, ToolCallStream
from gateway.openai.xml_tools import XmlFormat
from gateway.openai.xml_values import typed_value
from tests.gateway.conftest import accepts
from tests.gateway.test_tools import prose_markers_stream

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
    assert isinstance(tool_format("<tool_call>\n<function=", tools), XmlFormat)
    # Functionary's and Llama 3.1's custom tools write <function=name>{json}</function>, no <tool_call>: not this
    assert not isinstance(tool_format("<function={{ name }}>{{ args | tojson }}</function>", tools), XmlFormat)


def test_the_calls_a_template_writes_read_back_as_those_calls_each_argument_its_type(fmt):
    args = {"city": "Paris\nand around", "days": 3, "unit": "c", "where": {"lat": 48.8, "tags": ["a", None]}}
    text = "Let me look.\n" + _xml(("get_weather", args), ("search", {"query": "x < y </para", "limit": 2.5}))
    content, calls = fmt.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args), ("search", {"query": "x < y </para", "limit": 2.5})]
    # a call's place is its function's tag, whether read from its <tool_call> or (a stream) from the tag alone
    assert [c.start for c in calls] == [text.index("<function=get_weather>"), text.index("<function=search>")]
    # the closing tag left out at the reply's end (a model stopped by its end-of-call token) still closes it
    assert fmt.parse(_xml(("search", {"query": "q"}))[:-len("</tool_call>")])[1][0].arguments == '{"query": "q"}'


def test_a_value_ends_where_the_grammar_ends_it_and_what_a_model_leaves_out_is_read_as_vllm_reads_it(fmt):
    """Tags inside a value (code a model writes) stay in it: a value ends at the closing tag on a line of its own;
    a closing tag without its newline ends it only before the next tag; one left out is closed by the next tag.
    Several functions in one <tool_call> are several calls, and text after a function whose </tool_call> is
    left out is content."""
    code = "if a </function> b:\n    print('</parameter>x <parameter=k>')\n</tool_call>"
    content, calls = fmt.parse(_xml(("search", {"query": code, "limit": 3})))
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"query": code, "limit": 3}]
    text = ("<tool_call>\n<function=search>\n<parameter=query>q</parameter>\n<parameter=limit>\n2\n"
            "</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n1"
            "\n</parameter>\n</function>\n</tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse(text)[1]] == [
        ("search", {"query": "q", "limit": 2}), ("get_weather", {"city": "Rome", "days": 1})]
    after = "<tool_call>\n<function=search>\n</function>\ntext after"
    content, calls = fmt.parse(after)
    assert content == "\ntext after" and [(c.name, c.arguments) for c in calls] == [("search", "{}")]


def test_a_reply_of_markers_never_closed_is_read_in_linear_time(fmt):
    """A reply that opens call after call and never closes one (a model looping): each call was matched to the
    end of the reply and back, seconds of the event loop for a long reply."""
    import time

    nested = "<parameter=q>\n<tool_call><function=nope><parameter=q>\n</parameter>\n"   # markers in values
    for piece in ("<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n", "<tool_call><function=",
                  "<tool_call>\n<function=search>\n<parameter=query>\n" + "x" * 50, nested):
        text = ("<tool_call>\n<function=nope>\n" if piece is nested else "") + piece * (200_000 // len(piece)) + \
            ("done" if piece is nested else "")   # text after it: no read runs out
        started = time.process_time()   # CPU time: a loaded machine adds less
        assert fmt.parse_reply(text, cut=True)[0] is not None or True
        assert fmt.parse(text) == (text, [])
        assert time.process_time() - started < 2.0, piece


@pytest.mark.parametrize("raw, prop, value", [
    ("3", {"type": "integer"}, 3), ("3.5", {"type": "integer"}, "3.5"), ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7), ("True", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": ["integer", "null"]}, None), ("null", {"type": "string"}, "null"),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("{'a': None}", {"type": "object"}, {"a": None}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"), ("{(1, 2): 3}", {"type": "object"}, "{(1, 2): 3}"),
    ("NaN", {"type": "number"}, "NaN"), ("1e999", {"type": "number"}, "1e999"), ("08", {"type": "integer"}, 8),
    ("[1e999]", {"type": "array"}, "[1e999]"), ("null", {"type": ["string", "null"]}, None),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None), ("[" * 300 + "]" * 300, {"type": "array"}, "[" * 300 + "]" * 300),
    (" 12 ", None, " 12 "), ("x", {"enum": ["x"]}, "x")])
def test_an_arguments_text_is_read_as_its_schemas_type_or_kept_as_text(raw, prop, value):
    assert typed_value(raw, prop) == value


def test_a_value_ends_in_its_own_newlines_and_a_cycle_of_refs_is_no_error(fmt):
    """The form's newline before the closing tag is not the value's: a value ending in newlines keeps them (a
    file's last line lost its newline); a schema whose refs cycle through `anyOf` reads and builds a grammar."""
    for value in ("x\n", "x\n\n", "\n", ""):
        assert json.loads(fmt.parse(_xml(("search", {"query": value})))[1][0].arguments) == {"query": value}
    cyclic = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/A"}}, "additionalProperties": False}
    assert typed_value("3", {"$ref": "#/$defs/A"}, cyclic) in (3, "3")
    XmlFormat(parse_tools([{"type": "function", "function": {"name": "f", "parameters": cyclic}}])).body(
        [("f", cyclic)])


def test_a_value_is_read_through_any_of_and_a_local_ref():
    optional_int = {"anyOf": [{"type": "integer"}, {"type": "null"}]}        # pydantic's Optional[int]
    assert [typed_value(raw, optional_int) for raw in ("5", "null", "None", "x")] == [5, None, None, "x"]
    assert typed_value("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "5"   # may be a string
    root = {"$defs": {"Guest": {"type": "object"}, "Name": {"type": "string"}}}
    assert typed_value('{"n": 1}', {"$ref": "#/$defs/Guest"}, root) == {"n": 1}
    assert typed_value('{"n": 1}', {"$ref": "#/$defs/Name"}, root) == '{"n": 1}'


def test_what_is_not_a_call_of_an_offered_function_stays_content(fmt):
    for text in ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "a <tool_call> b",
                 "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n"):   # never closed
        assert fmt.parse(text) == (text, []), text


@pytest.mark.parametrize("cut", [0, 9])
def test_a_stream_sends_the_text_then_each_call_as_its_arguments_close_adding_up_to_the_whole_answer(fmt, cut):
    """Character by character: the text before the calls as it comes; a call's name once whole, then each
    argument's JSON once its closing tag is written (none before: a value may hold a closing tag without its
    newline); the pieces add up to the whole answer's arguments, a duplicate key's first value kept by both;
    `cut`: max_tokens ends the reply inside the second call's last argument."""
    text = "Checking.\n" + _xml(("get_weather", {"city": "Rome</parameter> x", "days": 1}),
                                ("search", {"query": "a</parameter>", "limit": 2}))
    text = text.replace("a</parameter>\n</parameter>\n", "a</parameter><parameter=query>\nb\n</parameter>\n")
    text = text[:text.rindex("\n</parameter>") - 1] if cut else text
    def each(end: int, args: dict[int, str]) -> None:
        assert all("Rome</parameter> x" in a or "city" not in a for a in args.values())
        if end == text.index('<parameter=days>'):
            assert args == {0: '{"city": "Rome</parameter> x"'}                    # the first argument, whole

    sent, args, names, count = streamed_by_character(fmt, text, bool(cut), each)
    content, calls = fmt.parse_reply(text, cut=bool(cut))
    assert sent == content == "Checking." and count == len(calls) == 2 and names == {0: "get_weather", 1: "search"}
    assert [args[0], args[1]] == [c.arguments for c in calls]
    # the second call's query closed by a closing tag without its newline, a tag after it (split across deltas)
    assert json.loads(args[1]) == ({"query": "a"} if cut else {"query": "a", "limit": 2})


def streamed_by_character(fmt, text: str, cut: bool, each=None) -> tuple[str, dict[int, str], dict[int, str], int]:
    """`text` streamed one character at a time through a `ToolCallStream`, then finished (`cut`: by max_tokens):
    (the content it sent, each call's arguments as sent and its name, by index, the calls it counted); `each(end,
    args)` sees the arguments so far after each delta."""
    stream, sent, args, names = ToolCallStream(fmt, forced=False), "", {}, {}
    for end in range(1, len(text) + 1):
        sent += stream.content_delta(text[:end])
        for entry in stream.call_deltas(text[:end]):
            if "id" in entry:
                names[entry["index"]] = entry["function"]["name"]
            args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
        if each is not None:
            each(end, args)
    rest, entries, count = stream.finish(text, cut=cut)
    for entry in entries:
        args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
    return sent + rest, args, names, count


def test_a_reply_cut_inside_a_call_ends_in_that_call_as_far_as_its_arguments_are_whole(fmt):
    text = "Ok.\n" + _xml(("get_weather", {"city": "Oslo", "days": 2}))
    cut = text[:text.index("<parameter=days>") + len("<parameter=days>\n2")]
    content, calls = fmt.parse_reply(cut, cut=True)
    assert content == "Ok." and [(c.name, c.arguments, c.cut) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}', True)]
    assert fmt.parse_reply("Ok.\n<tool_call>\n<function=get_w", cut=True) == ("Ok.\n", [])
    assert fmt.parse_reply(text, cut=True)[1][0].cut is False
    # the marker in prose stays content, cut or not; an unreadable block before the cut call stays content too
    prose = "Wrap calls in <tool_call> tags, then explain at length"
    assert fmt.parse_reply(prose, cut=True) == (prose, [])
    inner = "<tool_call>\n<function=search>\n<parameter=query>\nfind <tool_call> usages"   # a marker in its value
    assert [(c.name, c.arguments, c.cut) for c in fmt.parse_reply(inner, cut=True)[1]] == [("search", "{}", True)]
    refused = "<tool_call>\n<function=nope>\n</function>\n</tool_call>\nSorry, I"
    assert fmt.parse_reply(refused, cut=True) == (refused, [])
    bad = "<tool_call>\n<function=nope>\n</function>\n</tool_call>\n"
    content, calls = fmt.parse_reply(bad + "<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</parameter>\n",
                                     cut=True)
    assert content == bad.rstrip() and [(c.name, c.arguments, c.cut) for c in calls] == [
        ("search", '{"query": "foo"}', True)]


@pytest.mark.parametrize("cut", [False, True])
def test_a_function_without_its_tool_call_tag_is_a_call_streamed_or_whole(fmt, cut):
    """Qwen3-Coder leaves `<tool_call>` out at times (vLLM reads the function all the same); a mention of the tag
    in prose stays content."""
    bare = "Sure.\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>"
    text = bare[:-len("\n</function>")] if cut else bare
    content, calls = fmt.parse_reply(text, cut=cut)
    assert content == "Sure." and [(c.name, c.arguments, c.cut) for c in calls] == [("search", '{"query": "q"}', cut)]
    stream, sent, args = ToolCallStream(fmt, forced=False), "", ""
    for end in range(1, len(text) + 1):
        sent += stream.content_delta(text[:end])
        args += "".join(e["function"]["arguments"] for e in stream.call_deltas(text[:end]))
    rest, entries, count = stream.finish(text, cut=cut)
    assert sent + rest == "Sure." and count == 1 and args + "".join(e["function"]["arguments"] for e in entries) == \
        '{"query": "q"}'
    prose = "Write <function=name> then its parameters."
    assert fmt.parse_reply(prose, cut=cut) == (prose, [])


def test_a_marker_in_prose_holds_back_no_text_after_it_in_a_stream(fmt):
    prose_markers_stream(fmt, "Put a call in a <tool_call> tag, then go on. ", "<tool_call> ok. ")


@pytest.mark.parametrize("text", [
    '<tool_call>\n<function=get_weather>\n{"city": "Paris"}\n</function>\n</tool_call>',   # JSON in the tags
    "Write <function=get_weather>\nlike that.",
    '<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n<function=search>\n'
    '{"query": 1}\n</tool_call> and on',
])
def test_a_function_that_can_never_close_is_no_call_streamed_as_whole(fmt, text):
    """A function whose name is followed by text that is no tag (JSON, prose) can never close: the whole answer
    has it as content. A stream began a call of it with arguments "{" as soon as its name was whole (an agent's
    json.loads of them failed), and held every later character of the reply back until its end."""
    whole = fmt.parse_reply(text)
    stream, sent, calls = ToolCallStream(fmt, forced=False), "", []
    for end in range(1, len(text)):
        sent += stream.content_delta(text[:end])
        calls += stream.call_deltas(text[:end])
    sent += stream.content_delta(text)
    rest, entries, count = stream.finish(text)
    assert (sent + rest, count) == (whole[0], len(whole[1]))
    assert [e["function"]["name"] for e in calls + entries if "id" in e] == [c.name for c in whole[1]]
    if not whole[1]:
        assert sent == text                 # and nothing was held back past the point it could not be a call


def test_a_closed_call_of_a_function_not_offered_holds_back_no_text_after_it_in_a_stream(fmt):
    text = "<tool_call>\n<function=browse>\n<parameter=url>\nx\n</parameter>\n</function>\n</tool_call>\nI cannot."
    stream, sent = ToolCallStream(fmt, forced=False), ""
    for end in range(1, len(text) + 1):
        sent += stream.content_delta(text[:end])
        assert stream.call_deltas(text[:end]) == []
    assert fmt.parse_reply(text) == (text, []) and sent == text


def test_a_marker_in_prose_does_not_hold_back_the_calls_after_it_in_a_stream(fmt):
    text = "Use the <tool_call> tag.\n" + _xml(("search", {"query": "q"}))
    stream, streamed = ToolCallStream(fmt, forced=False), []
    for end in range(1, len(text) + 1):
        streamed += stream.call_deltas(text[:end])
    assert [e["function"]["name"] for e in streamed if "id" in e] == ["search"]
    assert "".join(e["function"]["arguments"] for e in streamed) == '{"query": "q"}'


def test_the_grammars_write_the_form_a_strict_functions_arguments_under_its_schema(fmt, lltokenizer):
    tools = parse_tools([WEATHER, SEARCH])
    forced, auto = fmt.grammar(tools, True), fmt.auto_grammar(tools, True)
    for grammar in (forced, auto):
        check(grammar)
    good = _xml(("get_weather", {"city": "New\nYork </para", "days": 2, "unit": "f"}))
    good = good.replace("</function>", '<parameter=where>\n{"a": [1]}\n</parameter>\n</function>')   # JSON
    search = _xml(("search", {"query": "anything", "other": "any name"}))
    for text in (good, _xml(("get_weather", {"city": "Paris", "days": 0})), search, good + "\n" + search):
        assert accepts(lltokenizer, forced, text) and accepts(lltokenizer, auto, text), text
        assert fmt.parse(text)[1], text
    for bad in ({"city": "Paris"}, {"city": "Paris", "days": "two"}, {"city": "Paris", "days": 1, "unit": "k"},
                {"days": 1, "city": "Paris"}, {"city": "Paris", "days": 1, "extra": 1}):
        assert not accepts(lltokenizer, forced, _xml(("get_weather", bad))), bad
    for text in ("", "Sunny.", "Let me check.\n" + good):        # text, or text and then calls, under auto only
        assert accepts(lltokenizer, auto, text) and not accepts(lltokenizer, forced, text), text
    assert not accepts(lltokenizer, fmt.grammar(tools, False), good + "\n" + search)
    assert not accepts(lltokenizer, auto, "a <tool_call> b")
    # a function without its tag is read as a call: as the plain text of a strict reply, it would escape its schema
    assert not accepts(lltokenizer, auto, "Sure.\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
                                           "</function>")


def test_the_grammar_follows_any_of_refs_and_declared_arguments_and_is_lenient_where_the_json_formats_are(
        fmt, lltokenizer):
    """A strict schema as pydantic writes one (`anyOf` with null, a `$ref` into `$defs`, no `additionalProperties`):
    each value of its kind, the required arguments always; a tool not strict with what the library does not
    enforce (`uniqueItems`) is served, as on the JSON formats; an argument name the form cannot carry back
    leaves its function's arguments free."""
    guest = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
             "additionalProperties": False}
    book = {"type": "function", "function": {"name": "book", "strict": True, "parameters": {
        "type": "object", "$defs": {"Guest": guest}, "required": ["guest", "nights"], "properties": {
            "guest": {"$ref": "#/$defs/Guest"}, "nights": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "note": {"type": "string"}}}}}
    tags = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "additionalProperties": False}}}
    odd = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
        "type": "object", "properties": {"a>b": {"type": "integer"}}, "additionalProperties": False}}}
    tools = parse_tools([book, tags, odd])
    xml = XmlFormat(tools)
    grammar = xml.grammar(tools, True)
    check(grammar)

    def call(name: str, *args: tuple[str, str]) -> str:
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args)
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    for text in (call("book", ("guest", '{"name": "Ana"}'), ("nights", "null")),
                 call("book", ("guest", '{"name": "Ana"}'), ("nights", "2"), ("note", "late"), ("extra", "x")),
                 call("tag", ("tags", '["a", "b"]')), call("odd", ("anything", "1"))):
        assert accepts(lltokenizer, grammar, text), text
    args = json.loads(xml.parse(call("book", ("guest", '{"name": "Ana"}'), ("nights", "null")))[1][0].arguments)
    assert args == {"guest": {"name": "Ana"}, "nights": None}
    for bad in (call("book", ("guest", '{"name": 1}'), ("nights", "2")), call("book", ("guest", '{"name": "A"}')),
                call("book", ("guest", '{"name": "A"}'), ("nights", "two")),
                call("book", ("guest", '{"name": "A"}'), ("nights", "1"), ("nights", "ten"))):   # a declared name again
        assert not accepts(lltokenizer, grammar, bad), bad
    # refs into the arguments' own properties (zod's), an enum behind a ref (pydantic's), a value that would close
    # early where a closing tag without its newline is followed by another tag
    trip = {"type": "function", "function": {"name": "trip", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["from", "to", "unit", "note"],
        "$defs": {"Unit": {"type": "string", "enum": ["km", "mi"]}}, "properties": {
            "from": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                     "additionalProperties": False},
            "to": {"$ref": "#/properties/from"}, "unit": {"$ref": "#/$defs/Unit"}, "note": {"type": "string"}}}}}
    tools = parse_tools([trip])
    grammar = XmlFormat(tools).grammar(tools, False)
    check(grammar)
    assert accepts(lltokenizer, grammar, call("trip", ("from", '{"x": 1}'), ("to", '{"x": 2}'), ("unit", "km"),
                                               ("note", "a</parameter> b")))
    for bad in (call("trip", ("from", '{"x": 1}'), ("to", '{"y": 2}'), ("unit", "km"), ("note", "n")),
                call("trip", ("from", '{"x": 1}'), ("to", '{"x": 2}'), ("unit", "kelvin"), ("note", "n")),
                call("trip", ("from", '{"x": 1}'), ("to", '{"x": 2}'), ("unit", "km"),
                     ("note", "a</parameter> <parameter=b>c"))):
        assert not accepts(lltokenizer, grammar, bad), bad


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
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "required": ["unit"], "additionalProperties": False,
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, POOL_TEMPLATE, unit, 60)
    assert args["unit"] in ("celsius", "fahrenheit")


async def forced_call_over_http(aiohttp_client, tmp_path, tiny_model, template: str, tool: dict,
                                max_tokens: int, call_id: str = r"call_[0-9a-f]{24}", after=None) -> dict:
    """A pool of the tiny model under `template` asked for a forced call of `tool`, whole and streamed: the one
    call, in a choice without the markup as content, the streamed arguments the whole answer's, each id of the
    form `call_id` (a regular expression); its arguments. `after(client, body, call)`: more requests on the pool."""
    import shutil

    from tests.gateway.conftest import chat_pool_yaml, start_gateway

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(template)
    client, _ = await start_gateway(aiohttp_client, tmp_path, chat_pool_yaml(model, max_model_len=512))
    name = tool["function"]["name"]
    body = {"model": "model", "messages": [{"role": "user", "content": "Use celsius."}], "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    choice = (await r.json())["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == [name], choice
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    streamed = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
    deltas = [d for chunk in streamed for c in chunk["choices"] for d in c["delta"].get("tool_calls") or ()]
    assert [d["function"]["name"] for d in deltas if "id" in d] == [name] and {d["index"] for d in deltas} == {0}
    assert "".join(d["function"]["arguments"] for d in deltas) == calls[0]["function"]["arguments"]
    assert all(re.fullmatch(call_id, i) for i in [calls[0]["id"], *(d["id"] for d in deltas if "id" in d)]), calls
    if after is not None:
        await after(client, body, calls[0])
    return json.loads(calls[0]["function"]["arguments"])


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(fmt):
    """Two calls of 200 KB arguments (a file a coding agent writes) streamed 40 characters at a time: the reader
    goes on from where it stopped and each argument's JSON is built once (each delta read the whole reply again,
    and made every argument's JSON again)."""
    code = ("def f(x):\n    return '</parameter>' if x else None\n" * 4000)[:200_000]
    plain = ("def g(y):\n    return y * 2\n" * 8000)[:200_000]   # a long value after a short one (write_file's)
    text = "Writing.\n" + _xml(("search", {"query": code}), ("search", {"limit": 1, "query": plain}))
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": plain}]
    assert took < 5.0, took


def streamed_arguments(fmt, text: str, step: int) -> tuple[dict[int, str], float]:
    """`text` streamed `step` characters at a time through a `ToolCallStream`: each call's arguments as the
    stream sent them (by index), and the CPU seconds its looks took (the end's `finish` left out)."""
    import time

    stream, args = ToolCallStream(fmt, forced=False), {}
    started = time.process_time()   # CPU time: a loaded machine adds less
    for end in range(step, len(text) + step, step):
        stream.content_delta(text[:end])
        for entry in stream.call_deltas(text[:end]):
            args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
    took = time.process_time() - started
    for entry in stream.finish(text)[1]:
        args[entry["index"]] = args.get(entry["index"], "") + entry["function"]["arguments"]
    return args, took
