"""Tool calls: parsing requests, the formats (hermes, llama3_json), streaming hold-back, and the unchanged
`openai` SDK against a live `cliffguard serve` (builtin SmolLM2, whose template knows no tools: the gateway
shows them in a system message and enforces `required` / named choices with a grammar)."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai
import pytest

from engine.structured import StructuredOutput, check
from engine import chat_template
from gateway.openai.chat_prompt import fallback_messages, render, template_inputs
from gateway.openai.chat import parse_chat
from gateway.openai.errors import ApiError
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tool_formats import tool_format
from gateway.openai.tools import HermesFormat, Llama3JsonFormat, LongcatFormat, ToolCallStream

MODEL = "smollm2-135m-instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Put an event in the calendar.",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "reminder": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0}},
                     "required": ["minutes"], "additionalProperties": False}},
        "required": ["title", "day", "attendees", "reminder"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "limit"], "additionalProperties": False}}}
TOOLS = [WEATHER, EVENT, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


# --- requests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (dict(CHAT, tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(CHAT, tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
    (dict(CHAT, tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(CHAT, tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(CHAT, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(CHAT, tool_choice="required"), "tool_choice"),
    (dict(CHAT, tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]),
     "tools[0].function.parameters"),
    (dict(CHAT, tools=[WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": 5}}}]), "tools[1].function.parameters"),
    # a name's end is the string's: "\n" after it is not one of OpenAI's characters
    (dict(CHAT, tools=[{"type": "function", "function": {"name": "get_weather\n"}}]), "tools[0].function.name"),
    (dict(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "w\n", "schema": {}}}),
     "response_format.json_schema.name"),
    # the arguments are an object: a schema of another type would force calls no parser reads as one
    (dict(CHAT, tools=[{"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (dict(CHAT, functions=[{"name": "f", "parameters": {"type": "array", "items": {}}}]), "functions[0].parameters"),
    # a choice in the other API's style was dropped, the model left free where the client had chosen
    (dict(CHAT, tools=[WEATHER], function_call={"name": "get_weather"}), "function_call"),
    (dict(CHAT, function_call={"name": "get_weather"}), "function_call"),
    (dict(CHAT, functions=[WEATHER["function"]], tool_choice="required"), "tool_choice"),
    (dict(CHAT, messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "21 C"}]),
     "messages[1].tool_call_id"),
    (dict(CHAT, messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (dict(CHAT, messages=[{"role": "user", "content": "x", "tool_calls": []},
                          {"role": "user", "content": "y", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages[1].tool_calls"),
])
def test_bad_tool_requests_name_the_field(body, param) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_a_request_with_tools_and_a_tool_history_parses() -> None:
    req = parse_chat(dict(CHAT, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
                          messages=[{"role": "user", "content": "weather?"},
                                    {"role": "assistant", "content": None, "tool_calls": [
                                        {"id": "c1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]))
    assert [t.name for t in req.tools] == ["get_weather", "create_event", "search"]
    assert req.tool_choice.mode == "function" and req.tool_choice.name == "search"
    assert req.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert req.messages[2]["tool_call_id"] == "c1"
    legacy = parse_chat(dict(CHAT, functions=[WEATHER["function"]], function_call={"name": "get_weather"}))
    assert legacy.tool_choice.name == "get_weather"


# --- formats -------------------------------------------------------------------------------------------

def test_the_template_picks_the_format() -> None:
    tools = parse_tools(TOOLS)
    assert isinstance(tool_format("{% if tools %}<tool_call>{% endif %}", tools), HermesFormat)
    assert isinstance(tool_format('{% if tools %}{"name": ..., "parameters": ...}{% endif %}', tools),
                      Llama3JsonFormat)
    assert isinstance(tool_format("{{ message['content'] }}", tools), HermesFormat)   # ours, via the system prompt


def test_hermes_parses_calls_between_text_and_leaves_lookalikes_as_content() -> None:
    fmt = HermesFormat(parse_tools(TOOLS))
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>')
    content, calls = fmt.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("search", {"query": "x", "limit": 2})]
    assert len({c.id for c in calls}) == 2
    for lookalike in ('<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', "<tool_call>{oops",
                      "no calls here", '<tool_call>{"name": "search", "arguments": {}} and more'):
        assert fmt.parse(lookalike) == (lookalike, [])
    tricky = '<tool_call>\n{"name": "search", "arguments": {"query": "</tool_call> x", "limit": 1}}\n</tool_call>'
    assert [json.loads(c.arguments)["query"] for c in fmt.parse(tricky)[1]] == ["</tool_call> x"]


def test_longcat_writes_hermes_calls_between_its_own_tags() -> None:
    """LongCat-Flash's template writes `<longcat_tool_call>`: hermes' calls between those tags, read whole (a closing
    tag inside a string argument is the argument's) and as a stream, char by char; hermes' own tags in its reply are
    text; its grammars build."""
    tools = parse_tools(TOOLS)
    fmt = tool_format("{% if tools %}<longcat_tool_call>{{ tool | tojson }}{% endif %}", tools)
    assert isinstance(fmt, LongcatFormat) and fmt.name == "longcat"
    call = {"name": "search", "arguments": {"query": "</longcat_tool_call> x", "limit": 2}}
    reply = f"Let me look.\n<longcat_tool_call>\n{json.dumps(call)}\n</longcat_tool_call>"
    content, calls = fmt.parse(reply)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", call["arguments"])]
    hermes = '<tool_call>\n{"name": "search", "arguments": {"query": "q", "limit": 1}}\n</tool_call>'
    assert fmt.parse(hermes) == (hermes, [])
    stream, sent, streamed = ToolCallStream(fmt, forced=False), "", {}
    for end in range(1, len(reply) + 1):
        sent += stream.content_delta(reply[:end])
        assert "<longcat" not in sent and reply.startswith(sent)
        for entry in stream.call_deltas(reply[:end]):
            _merge(streamed, entry)
    rest, entries, num_calls = stream.finish(reply)
    for entry in entries:
        _merge(streamed, entry)
    assert sent + rest == "Let me look." and num_calls == 1 and streamed[0]["arguments"] == calls[0].arguments
    for parallel in (False, True):
        check(fmt.grammar(tools, parallel))


def test_llama3_json_parses_one_or_several_calls() -> None:
    fmt = Llama3JsonFormat(parse_tools(TOOLS))
    content, calls = fmt.parse('{"name": "search", "parameters": {"query": "q", "limit": 1}}; '
                               '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}')
    assert content is None and [c.name for c in calls] == ["search", "get_weather"]
    assert fmt.parse("The answer is 4.") == ("The answer is 4.", [])


@pytest.mark.parametrize("fmt_class", [HermesFormat, Llama3JsonFormat])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammars_are_valid_for_the_library(fmt_class, parallel) -> None:
    tools = parse_tools(TOOLS)
    check(fmt_class(tools).grammar(tools, parallel))
    check(fmt_class(tools).grammar(tools[:1], parallel))


def test_what_the_library_cannot_enforce_is_refused_for_a_strict_schema_only() -> None:
    """A schema with keywords the grammar library cannot enforce (a pydantic `set[str]`'s `uniqueItems`, `not`, a
    `format` it lacks): OpenAI takes it where it is not strict, and so do we, leaving them unenforced (it was a
    400 naming the tool); strict, it is a 400 naming the field. A client's `x-guidance` never reaches the library."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True},
                                               "site": {"type": "string", "format": "uri-reference"},
                                               "other": {"not": {"type": "null"}}}, "required": ["tags"]}
    for strict in (False, True):
        tool = {"type": "function", "function": {"name": "tag", "parameters": schema, "strict": strict}}
        body = dict(CHAT, tools=[tool], tool_choice="required")
        if strict:
            with pytest.raises(ApiError) as info:
                parse_chat(body)
            assert info.value.param == "tools[0].function.parameters" and "Unimplemented keys" in info.value.message
        else:
            tools = parse_chat(body).tools
            for fmt_class in (HermesFormat, Llama3JsonFormat):   # the forced call's grammar builds
                check(fmt_class(tools).grammar(tools, True))
        response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}
        if strict:
            with pytest.raises(ValueError, match="Unimplemented keys"):
                check(parse_chat(dict(CHAT, response_format=response_format)).params.structured)
        else:
            check(parse_chat(dict(CHAT, response_format=response_format)).params.structured)
    loose = {**schema, "x-guidance": {"whitespace_flexible": True}}
    assert "x-guidance" not in StructuredOutput.json_schema(loose).spec
    assert json.loads(StructuredOutput.json_schema(loose, lenient=True).spec)["x-guidance"] == {"lenient": True}


def test_a_stream_sends_the_text_before_a_call_then_the_call_as_it_is_written() -> None:
    fmt = HermesFormat(parse_tools(TOOLS))
    call = {"name": "search", "arguments": {"query": 'x "}', "limit": 3}}   # a brace inside a string
    reply = f"Sure.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    stream, sent, calls = ToolCallStream(fmt, forced=False), "", {}
    for end in range(1, len(reply) + 1):
        sent += stream.content_delta(reply[:end])
        assert "<tool" not in sent and reply.startswith(sent)
        for entry in stream.call_deltas(reply[:end]):
            _merge(calls, entry)
            if "id" in entry:           # id and name first, once the arguments' object has begun
                assert entry["function"] == {"name": "search", "arguments": "{"} and end < reply.index('"limit"')
    rest, entries, num_calls = stream.finish(reply)
    for entry in entries:
        _merge(calls, entry)
    _, parsed = fmt.parse(reply)
    assert sent + rest == "Sure." and num_calls == 1   # the whitespace before the call held, then dropped
    assert calls[0]["name"] == "search" and calls[0]["arguments"] == parsed[0].arguments
    assert json.loads(calls[0]["arguments"]) == call["arguments"]
    plain = ToolCallStream(fmt, forced=False)
    assert plain.content_delta("a < b") == "a < b" and plain.content_delta("a < b <tool") == ""
    assert plain.finish("a < b <tool") == (" <tool", [], 0)   # the held space, sent once text follows it


def prose_markers_stream(fmt, reply: str, loop: str) -> None:
    """A marker in prose (`reply`) holds back no text after it; a reply of thousands of them (`loop`, a model
    repeating itself), or of a marker and then thousands of newlines, costs a stream each delta what it adds,
    and its whole answer is read in one pass."""
    stream, sent = ToolCallStream(fmt, forced=False), ""
    for end in range(1, len(reply) + 1):
        sent += stream.content_delta(reply[:end])
        assert stream.call_deltas(reply[:end]) == []
    assert sent == reply.rstrip() and stream.finish(reply) == (reply[len(sent):], [], 0)
    loop *= 4000
    stream, started = ToolCallStream(fmt, forced=False), time.process_time()   # CPU time: a loaded machine adds less
    for end in range(20, len(loop) + 1, 20):
        stream.content_delta(loop[:end])
        stream.call_deltas(loop[:end])
    assert stream.finish(loop)[1:] == ([], 0) and fmt.parse(loop * 4) == (loop * 4, [])
    assert time.process_time() - started < 2.0   # each look walked every marker: ~10 s (0.4 s now, 2026-12-02)
    run = "Hi <tool_call>" + "\n" * 80_000 + "ok."
    stream, started = ToolCallStream(fmt, forced=False), time.process_time()
    for end in range(4, len(run) + 1, 4):
        stream.content_delta(run[:end])
        stream.call_deltas(run[:end])
    assert stream.finish(run)[1:] == ([], 0)
    assert time.process_time() - started < 2.0   # each look walked every blank: ~4 s (0.5-0.9 s now)


def test_a_marker_in_prose_holds_back_nothing_after_it_in_a_stream() -> None:
    prose_markers_stream(HermesFormat(parse_tools(TOOLS)), "Put a call in a <tool_call> tag, then go on. ",
                         "<tool_call> ok, ")   # each a marker in prose


@pytest.mark.parametrize("fmt, reply", [
    (Llama3JsonFormat(parse_tools(TOOLS)), '{"name": "search", "parameters": {"query": "a"}} I hope this helps.'),
    (HermesFormat(parse_tools(TOOLS)), '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\nI hope.'),
])
def test_the_last_delta_begins_no_call_the_whole_answer_has_not(fmt, reply) -> None:
    """A call seen first in the reply's last delta (several tokens a delta) was begun by `finish` before the whole
    answer was read: the client had the text as content and a call, and finish_reason tool_calls."""
    for head in (0, 10):   # the last delta the whole reply, or all of it but its first 10 characters
        stream = ToolCallStream(fmt, forced=False)
        sent = stream.content_delta(reply[:head])
        assert stream.call_deltas(reply[:head]) == []
        sent += stream.content_delta(reply)   # the last delta: as gateway.local_answer sends it, then finish
        rest, entries, num_calls = stream.finish(reply)
        assert (sent + rest, entries, num_calls) == (reply, [], 0) and _whole(fmt, reply) == (reply, [])


def test_a_closed_object_that_is_no_call_holds_back_no_text_after_it_in_a_stream() -> None:
    """A call of a tool not offered (or a quoted example) froze the stream's content until the reply's end: its
    marker was held as a possible call for good. Closed and no call, it is prose; a call after it streams."""
    fmt = HermesFormat(parse_tools(TOOLS))
    refused = '<tool_call>\n{"name": "browse", "arguments": {}}\n</tool_call>'
    reply = f"I tried {refused} but it is not offered, so: 42. " + CALL % "q"
    stream, sent, calls = ToolCallStream(fmt, forced=False), "", {}
    for end in range(1, len(reply) + 1):
        sent += stream.content_delta(reply[:end])
        for entry in stream.call_deltas(reply[:end]):
            _merge(calls, entry)
        if end == reply.index(" but"):
            assert sent == f"I tried {refused}"   # sent as soon as the object closed with its tag
    content, whole = fmt.parse_reply(reply)
    assert sent == content == reply[:reply.index(CALL % "q")].rstrip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in whole] == [("search", {"query": "q", "limit": 2})]


def test_a_call_marker_inside_an_argument_does_not_stop_the_next_call_streaming() -> None:
    fmt = HermesFormat(parse_tools(TOOLS))
    first = json.dumps({"name": "search", "arguments": {"query": "write <tool_call>{ here"}})
    second = json.dumps({"name": "search", "arguments": {"query": "b"}})
    reply = f"<tool_call>\n{first}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>"
    stream, calls = ToolCallStream(fmt, forced=False), {}
    for end in range(1, len(reply) + 1):
        for entry in stream.call_deltas(reply[:end]):
            _merge(calls, entry)
    # both calls streamed whole before the reply ended (the marker inside the first is not a call)
    assert [json.loads(calls[k]["arguments"])["query"] for k in (0, 1)] == ["write <tool_call>{ here", "b"]


def test_llama3_json_takes_one_call_a_reply_streamed_or_whole_and_its_grammars_write_one() -> None:
    """Meta's Llama 3.1-3.3 template refuses an assistant turn of several calls: a reply that writes two (joined
    by "; ") answers its first, streamed or whole, and the grammars of tool_choice "required" and "auto" (with
    a strict tool) let the model write one only, whatever `parallel_tool_calls` says."""
    fmt = Llama3JsonFormat(parse_tools(TOOLS))
    reply = '{"name": "search", "parameters": {"query": "a"}}; {"name": "search", "parameters": {"query": "b"}}'
    stream, calls = ToolCallStream(fmt, forced=False), {}
    for end in range(1, len(reply) + 1):
        assert stream.content_delta(reply[:end]) == ""
        for entry in stream.call_deltas(reply[:end]):
            _merge(calls, entry)
    rest, entries, num_calls = stream.finish(reply)
    for entry in entries:
        _merge(calls, entry)
    assert rest == "" and num_calls == 1 and json.loads(calls[0]["arguments"]) == {"query": "a"}
    assert [json.loads(c.arguments) for c in fmt.kept_calls(fmt.parse_reply(reply, False)[1], True)] == \
        [{"query": "a"}]
    tools = parse_tools(TOOLS)
    assert fmt.grammar(tools, True) == fmt.grammar(tools, False) != HermesFormat(tools).grammar(tools, False)
    assert fmt.auto_grammar(tools, True) == fmt.auto_grammar(tools, False)


def test_parallel_tool_calls_false_streams_and_returns_the_first_call_only() -> None:
    fmt = HermesFormat(parse_tools(TOOLS))
    one = '<tool_call>\n{"name": "search", "arguments": {"query": "%s"}}\n</tool_call>'
    reply = "\n".join([one % "a", one % "b"])
    stream, calls = ToolCallStream(fmt, forced=False, parallel=False), {}
    for end in range(1, len(reply) + 1):
        for entry in stream.call_deltas(reply[:end]):
            _merge(calls, entry)
    rest, entries, num_calls = stream.finish(reply)
    for entry in entries:
        _merge(calls, entry)
    assert num_calls == 1 and list(calls) == [0] and json.loads(calls[0]["arguments"]) == {"query": "a"}


def _streamed(fmt, pieces: list[str], cut: bool = False, parallel: bool = True) -> tuple[str | None, list[tuple]]:
    """What a client of the stream reads when the reply arrives in `pieces`: (content, [(name, arguments)])."""
    stream, sent, calls, text = ToolCallStream(fmt, forced=False, parallel=parallel), "", {}, ""
    for piece in pieces:
        text += piece
        sent += stream.content_delta(text)
        for entry in stream.call_deltas(text):
            _merge(calls, entry)
    rest, entries, num_calls = stream.finish(text, cut)
    for entry in entries:
        _merge(calls, entry)
    assert num_calls == len(calls) and sorted(calls) == list(range(len(calls)))
    return sent + rest or None, [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]


def _whole(fmt, text: str, cut: bool = False, parallel: bool = True) -> tuple[str | None, list[tuple]]:
    content, calls = fmt.parse_reply(text, cut)
    return content or None, [(c.name, c.arguments) for c in fmt.kept_calls(calls, parallel)]


CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "%s", "limit": 2}}\n</tool_call>'
REPLIES = [
    ("hermes", "Sure.\n" + CALL % "a"),
    ("hermes", "\n" + CALL % "a"),                               # whitespace only before the call: no content
    ("hermes", "  Sure. " + CALL % "a" + " ok " + CALL % "b" + " bye\n"),   # text around and between calls
    ("hermes", CALL % "a" + CALL.replace('"search"', '"nope"') % "b" + CALL % "c"),   # a tool not offered
    ("hermes", '<tool_call>\n{"name": "search", "name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>'),   # arguments a string
    ("hermes", '<tool_call>\n{"name": "search"}\n</tool_call> then text'),                     # no arguments
    ("hermes", "use <tool_call> tags to call; " + CALL % "a"),    # the marker in prose first
    ("llama3", '{"name": "search", "arguments": {"query": "a"}}; {"name": "search", "parameters": {"query": "b"}}'),
    ("llama3", ' <|python_tag|>{"name": "search", "parameters": {"query": "a"}}\n'),
    ("llama3", 'Plain text, no call.\n'),
]


@pytest.mark.parametrize("kind, reply", REPLIES)
def test_what_a_stream_sends_adds_up_to_the_whole_answer_however_the_reply_is_split(kind, reply) -> None:
    """Split at every one and every pair of characters, with parallel calls or not, and cut by max_tokens
    at every character: the stream's content and calls are the whole answer's, to the character (the
    whitespace before a call was sent, and dropped from the whole answer; a later call's arguments went
    to the call before it that was not one; a call was streamed whose arguments were not an object)."""
    fmt = (HermesFormat if kind == "hermes" else Llama3JsonFormat)(parse_tools(TOOLS))
    splits = [[reply[:a], reply[a:]] for a in range(len(reply))] + [list(reply)]
    splits += [[reply[:a], reply[a:b], reply[b:]] for a in range(0, len(reply), 7) for b in range(a, len(reply), 5)]
    for parallel in (True, False):
        whole = _whole(fmt, reply, parallel=parallel)
        for pieces in splits:
            assert _streamed(fmt, pieces, parallel=parallel) == whole, (pieces, parallel)
    for end in range(len(reply) + 1):
        assert _streamed(fmt, [reply[:end]], cut=True) == _whole(fmt, reply[:end], cut=True), reply[:end]
        assert _streamed(fmt, list(reply[:end]), cut=True) == _whole(fmt, reply[:end], cut=True), reply[:end]


@pytest.mark.parametrize("fmt_class", [HermesFormat, Llama3JsonFormat])
@pytest.mark.parametrize("forced", [False, True])
def test_a_long_call_streamed_a_few_characters_at_a_time_is_read_once(monkeypatch, fmt_class, forced) -> None:
    """Each delta reads only what is new of a call (its `CallScanner` goes on where it stopped): a call of 60,000
    characters arriving 4 at a time is read about once, not again from its start at every delta (15,000 deltas
    times its length so far: 450 million characters in Python on the event loop); the arguments sent add up."""
    from gateway.openai import tools

    read = []
    original = tools.CallScanner.read
    monkeypatch.setattr(tools.CallScanner, "read", lambda self, text: read.append(
        len(text) - self.pos if self.scan.end is None else 0) or original(self, text))   # a closed call: read
    fmt = fmt_class(parse_tools(TOOLS))
    args = json.dumps({"query": "x" * 30_000 + '\\"}{' + "y" * 30_000, "limit": 2})
    body = '{"name": "search", "%s": %s}' % (fmt.args_keys[0], args)
    reply = (CALL.replace("%s", "a") + "\n" if fmt_class is HermesFormat else "") + (
        f"<tool_call>\n{body}\n</tool_call>" if fmt_class is HermesFormat else body)
    stream, calls, text = ToolCallStream(fmt, forced=forced), {}, ""
    for k in range(0, len(reply), 4):
        text += reply[k:k + 4]
        stream.content_delta(text)
        for entry in stream.call_deltas(text):
            _merge(calls, entry)
    assert sum(read) < 2 * len(reply)
    for entry in stream.finish(text)[1]:
        _merge(calls, entry)
    assert calls[len(calls) - 1]["arguments"] == args and fmt.parse_reply(text, False)[1][-1].arguments == args


def test_a_malformed_call_streamed_before_a_good_one_keeps_each_calls_arguments_its_own() -> None:
    """A call object that turns out malformed after its arguments was streamed and cannot be taken back,
    but the next call's arguments go to that call, not onto the end of the first (they did: the whole
    answer's calls were matched to the stream's by count, not by where they begin)."""
    fmt = HermesFormat(parse_tools(TOOLS))
    bad = '<tool_call>\n{"name": "search", "arguments": {"query": "a"},}\n</tool_call>\n'
    reply = bad + CALL % "b"
    content, calls = _streamed(fmt, [reply[:60], reply[60:]])
    assert calls == [("search", '{"query": "a"}'), ("search", '{"query": "b", "limit": 2}')]
    assert _whole(fmt, reply) == (bad.rstrip(), [("search", '{"query": "b", "limit": 2}')]) and content == bad.rstrip()


@pytest.mark.parametrize("fmt_class", [HermesFormat, Llama3JsonFormat])
@pytest.mark.parametrize("body", ["9" * 5000, "[" * 5000, '{"a": ' * 3000])
def test_a_call_too_long_or_too_deep_to_decode_is_text_not_a_server_error(fmt_class, body) -> None:
    """An integer over Python's 4300 digits, or JSON nested past the recursion limit, where a call's object
    would be: content, as any text that is not a call (`raw_decode` raised ValueError or RecursionError:
    a 500 whole, a broken stream)."""
    fmt = fmt_class(parse_tools(TOOLS))
    reply = (f"<tool_call>\n{body}" if fmt_class is HermesFormat else body) + "\n"
    assert fmt.parse_reply(reply) == (reply, []) and _streamed(fmt, [reply[:9], reply[9:]]) == (reply, [])


def _merge(calls: dict[int, dict], entry: dict) -> None:
    """A `tool_calls` delta entry into the calls so far, as the openai SDK accumulates them."""
    call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
    if "id" in entry:
        assert call["id"] is None, "a call's id is sent once"
        call["id"], call["name"] = entry["id"], entry["function"]["name"]
    call["arguments"] += entry["function"].get("arguments", "")


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    out = fallback_messages(messages, parse_tools(TOOLS))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "get_weather" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n3 C\n</tool_response>"}
    listed = fallback_messages(messages, parse_tools(TOOLS), calls=False)   # tool_choice "none"
    assert listed[1:] == out[1:] and "get_weather" in listed[0]["content"] and "<tool_call>" in out[0]["content"]
    assert "<tool_call>" not in listed[0]["content"] and "answer in text" in listed[0]["content"]


def test_tool_choice_none_lists_no_tools_to_a_template_whose_calls_are_bare_json() -> None:
    """Llama 3.1's template asks a reply to "respond with a JSON for a function call" when given tools: under
    tool_choice "none" no grammar can keep such a call out (a JSON reply is text too), and the gateway would pass
    it on as the answer's content; such a template gets no tools then. Marker formats keep them listed (a
    grammar keeps their calls out) and the history's calls render either way."""
    llama = ('{%- if tools %}Given the following functions, please respond with a JSON for a function call with '
             'its proper arguments that best answers the given prompt. Respond in the format {"name": function '
             'name, "parameters": dictionary of argument name and its value}.{{ tools | tojson }}{%- endif %}')
    hermes = "{%- if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{%- endif %}"
    messages = [{"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    tools = parse_tools(TOOLS)
    for source, listed_under_none in ((llama, False), (hermes, True)):
        tokenizer = _TemplateTokenizer(source)
        assert template_inputs(tokenizer, messages, tools)[1] == [t.as_template_dict() for t in tools]
        rendered, listed = template_inputs(tokenizer, messages, tools, calls=False)
        assert (listed is not None) == listed_under_none and rendered[1]["tool_calls"], source


class _TemplateTokenizer:
    """A tokenizer of one chat template, rendered as the engine's tokenizer renders it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def chat_template_source(self, use_tools: bool = False) -> str:
        return self.source

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, **kwargs):
        return chat_template.render(self.source, messages, add_generation_prompt, continue_final_message,
                                    {"tools": None, **kwargs})


def test_a_template_that_refuses_a_system_message_gets_the_tools_in_the_first_user_turn() -> None:
    """Gemma 2's template raises on a system message: the listing of tools (a template that knows none gets
    it in a system message of ours) goes before the first user message's text there, or every chat with tools
    was a 400 its client could not avoid."""
    gemma2 = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
              "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
              "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}")
    tools, chat = parse_tools(TOOLS), [{"role": "user", "content": "weather in Oslo?"}]
    prompt = render(_TemplateTokenizer(gemma2), chat, tools)
    assert prompt.startswith("<start_of_turn>user\n") and prompt.count("<start_of_turn>user") == 1
    assert prompt.index("get_weather") < prompt.index("weather in Oslo?") and "<tool_call>" in prompt
    dropping = "{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}" \
               "{% endfor %}"   # Phi-3's first template: a system message dropped, its tools never seen
    assert render(_TemplateTokenizer(dropping), chat, tools).startswith("<|user|>") and "get_weather" in \
        render(_TemplateTokenizer(dropping), chat, tools)
    plain = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    assert render(_TemplateTokenizer(plain), chat, tools).startswith("<|system|>")   # one that takes it: as before


# A template with tool support, written the way Qwen2.5's is (tools listed in the system turn, calls as
# <tool_call> JSON with the arguments as an object, results as tool turns).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{%- continue %}{%- endif %}
{%- if message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_with_tools_renders_them_itself(tmp_path, builtin_path) -> None:
    import shutil

    from engine.tokenizer import Tokenizer
    from gateway.openai.chat_prompt import render
    from gateway.openai.tool_formats import format_for

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(builtin_path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = Tokenizer.from_folder(tmp_path)
    tools = parse_tools(TOOLS)
    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    text = render(tokenizer, messages, tools)
    assert '"name": "create_event"' in text and "# Tools" in text               # the template listed the tools
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text     # arguments as an object, once
    assert "<tool_response>\n3 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert isinstance(format_for(tokenizer, tools), HermesFormat)


def test_tools_reach_a_template_as_the_client_sent_them(tmp_path, builtin_path) -> None:
    """A template that writes `tool | tojson` (Qwen's) writes the tools as transformers does with the client's
    own dicts: OpenAI's key order (name, description, parameters), the prompt character for character; and a
    call in the history whose arguments are not JSON as the text it is."""
    import shutil

    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer
    from gateway.openai.chat_prompt import render

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(builtin_path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_folder(tmp_path)
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    assert render(ours, messages, parse_tools(TOOLS)) == hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # a model's broken call sent back: its text reaches the template as text (it was replaced by {})
    messages += [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "error: bad arguments"}]
    text = render(ours, messages, parse_tools(TOOLS))
    assert text == hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"arguments": "{\\"city\\": \\"Oslo\\""' in text
    for none in ("", " ", "null"):   # no arguments: {} (vLLM's), not a text a template writes raw
        messages[1]["tool_calls"][0]["function"]["arguments"] = none
        assert '{"name": "get_weather", "arguments": {}}' in render(ours, messages, parse_tools(TOOLS))


# --- the SDK against a live server --------------------------------------------------------------------

PROMPTS = ["What's the weather in Paris?", "Book lunch with Sam on the 12th.", "Search for llama recipes.",
           "Is it cold in Oslo?", "Remind me about the dentist on day 3.", "Find news about Mars.",
           "Weather in Tokyo in fahrenheit.", "Plan a party on the 30th with Ana and Bo.", "Look up the Rust book.",
           "How warm is Lima?", "Schedule a review on the 7th.", "Search: best hiking in Norway",
           "Weather for Cairo please.", "Team sync on the 15th with Li.", "Search python asyncio tutorial",
           "Do I need a coat in Berlin?", "Add 'pay rent' on the 1st.", "Who won the 2022 world cup? Search it.",
           "Temperature in Nairobi?", "Create an event 'launch' on day 20."]


# The grammar keeps every token of a forced call valid; only the model decides to close its strings and
# arrays, and a 135M model left to itself repeats. A frequency penalty, as an app on a small model would send,
# lets it finish.
SAMPLING = {"frequency_penalty": 0.5, "max_tokens": 300}


@pytest.fixture
def client(live_builtin_server):
    """A fresh client per test: each test runs on its own event loop."""
    return openai.AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


async def test_what_openai_refuses_is_a_400_naming_the_field_and_the_next_request_is_served(client) -> None:
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}
    cases = [(dict(messages=[{"role": "user", "content": "hi"}], tools=[bad_tool]), "tools[0].function.parameters"),
             (dict(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "21 C"}]),
              "messages[1].tool_call_id"),
             (dict(messages=[{"role": "user", "content": "hi"}],
                   response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
              "response_format.json_schema.name")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert info.value.body["param"] == param, info.value.body
        ok = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert ok.choices[0].finish_reason == "length"


def _assert_valid(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow   # ~25 s of sampling; the grammar's guarantee is shown token by token in test_strict_tools.py
async def test_required_and_a_named_function_give_valid_calls_twenty_of_twenty_each(client) -> None:
    """tool_choice "required" (any function, sampled at 0.8) and a named function (at 0.5), twenty prompts
    each, sent together: every reply is a call, of the named function where one was named, with arguments
    valid against its schema."""
    names = [t["function"]["name"] for t in TOOLS]

    async def ask(i: int, prompt: str, named: bool):
        choice = ({"type": "function", "function": {"name": names[i % 3]}} if named else "required")
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 tools=TOOLS, tool_choice=choice, **SAMPLING,
                                                 temperature=0.5 if named else 0.8, seed=100 + i if named else i)
        return named, names[i % 3], r.choices[0]

    answers = await asyncio.gather(*(ask(i, p, named) for named in (False, True) for i, p in enumerate(PROMPTS)))
    assert len(answers) == 40
    for named, name, choice in answers:
        assert choice.message.tool_calls, choice.message
        # OpenAI's finish_reason: "stop" for a forced named call, "tool_calls" for calls the model chose to make
        assert choice.finish_reason == ("stop" if named else "tool_calls"), choice.message
        if named:
            assert [c.function.name for c in choice.message.tool_calls] == [name]
        for call in choice.message.tool_calls:
            _assert_valid(call)


async def test_streamed_tool_calls_reassemble_to_the_same_calls(client) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], tools=TOOLS,
                  tool_choice="required", max_tokens=200, temperature=0)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "pieces": 0, "id": delta.id})
                assert entry["id"] == delta.id or delta.id is None    # the id comes once, with the name, first
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                entry["pieces"] += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    # the arguments came in pieces as the model wrote them, and they join to the whole answer's, character for character
    assert all(c["id"] and c["pieces"] > 3 for c in calls.values()), calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


async def test_a_call_cut_by_max_tokens_is_the_same_partial_call_streamed_or_whole_and_no_markup(client) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], tools=TOOLS,
                  tool_choice="required", max_tokens=14, temperature=0)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None, whole
    calls, content = {}, ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.delta.content is None      # OpenAI's null beside calls, not "" in every chunk
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert content == "" and len(whole.message.tool_calls) == 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


async def test_the_deprecated_functions_are_answered_as_one_function_call_whole_and_streamed(client) -> None:
    """A request offering `functions` gets OpenAI's answer of that API: `message.function_call` (no `tool_calls`),
    a stream's `delta.function_call` pieces (the name in the first), one call; finish_reason "stop" where
    `function_call` named the function (OpenAI's for a forced call, "function_call" where the model chose it)."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=120, temperature=0,
                  functions=[t["function"] for t in TOOLS], function_call={"name": "get_weather"})
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None, whole
    assert whole.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(whole.message.function_call.arguments), SCHEMAS["get_weather"])
    pieces, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.delta.tool_calls is None
            if choice.delta.function_call is not None:
                pieces.append(choice.delta.function_call)
            finish = choice.finish_reason or finish
    assert finish == "stop" and len(pieces) > 2
    assert [p.name for p in pieces] == ["get_weather"] + [None] * (len(pieces) - 1)
    assert "".join(p.arguments for p in pieces) == whole.message.function_call.arguments
    auto = (await client.chat.completions.create(**{**kwargs, "function_call": "auto", "max_tokens": 48})).choices[0]
    assert auto.message.tool_calls is None   # one call at most, or none


async def test_a_two_turn_exchange_with_a_tool_result(client, builtin_path) -> None:
    """The second turn, under tool_choice "none", is answered in text from a prompt that lists the tools with no
    way to call them (SmolLM2's template knows no tools: the system message is ours)."""
    from engine.tokenizer import Tokenizer
    from gateway.openai.chat_prompt import prompt_ids
    from pools.tokencount import TokenCounter

    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = (await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=120,
                                                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                  temperature=0)).choices[0]
    assert first.finish_reason == "stop"    # OpenAI's for a call tool_choice forced by name
    first = first.message
    call = first.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12,
                                                 tool_choice="none", temperature=0)
    second = reply.choices[0]
    assert second.message.content and not second.message.tool_calls
    assert second.finish_reason in ("stop", "length")
    tokenizer = Tokenizer.from_folder(builtin_path)
    req = parse_chat({"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none"})
    ids = {may: prompt_ids(tokenizer, TokenCounter(tokenizer), req.messages, req.tools, calls=may)
           for may in (True, False)}
    assert reply.usage.prompt_tokens == len(ids[False]) != len(ids[True])


def test_the_finish_reason_of_a_reply_with_calls_is_openais_for_each_choice() -> None:
    """"tool_calls" where the model may choose its calls ("auto", "required"), "stop" where tool_choice named the
    function (OpenAI answers a forced call so, and vLLM does); the deprecated `functions`: "function_call", and
    "stop" where `function_call` named one."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Paris?"}]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in (("auto", "tool_calls"), ("required", "tool_calls"), (named, "stop")):
        assert parse_chat({**body, "tools": TOOLS, "tool_choice": choice}).calls_finish == finish, choice
    functions = [t["function"] for t in TOOLS]
    for choice, finish in (("auto", "function_call"), ({"name": "get_weather"}, "stop")):
        assert parse_chat({**body, "functions": functions, "function_call": choice}).calls_finish == finish, choice


def test_arguments_that_are_not_json_to_python_read_as_none() -> None:
    """A call's arguments nested past the recursion limit, or an integer past the digit limit, are not
    JSON to read (None), never an exception out of the prompt's rendering."""
    from gateway.openai.call_scan import loads as _loads

    assert _loads("[" * 5000 + "]" * 5000) is None and _loads("1" * 5000) is None and _loads("{") is None
    assert _loads("[" * 900 + "]" * 900) is None          # json.loads takes it; a template's tojson would not
    assert _loads('{"a": [1]}') == {"a": [1]}


def test_the_schema_check_remembers_digests_not_schemas_and_answers_the_same() -> None:
    """`schema_error` is keyed by a digest of the schema's text: many large distinct schemas (a client may send
    8 MiB ones) leave it holding next to nothing, where a cache keyed by the text kept each one for good; and
    its answers, the first time or remembered, are the library's."""
    import gc
    import tracemalloc

    from gateway.openai.tool_specs import schema_error

    def text(schema) -> str:
        return json.dumps(schema, sort_keys=True)

    long_format = text({"type": "object", "properties": {"a": {"type": "string", "format": "x" * 5000}}})
    cases = {text(WEATHER["function"]["parameters"]): None,
             text({"type": "object", "properties": {"a": {"type": "strin"}}}): "Invalid type: strin",
             long_format: "Unknown format: " + "x" * 5000}   # a reason too long to remember: checked again
    for _ in range(2):
        assert {t: schema_error(t) for t in cases} == cases
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):   # 40 distinct schemas of 300 kB: 12 MB, were they kept
            schema = {"type": "object", "description": f"{i} " + "d" * 300_000}
            compact = len(json.dumps(schema, separators=(",", ":")))   # what the library is given
            assert schema_error(text(schema)) == f"at most 262144 characters of schema or grammar, got {compact}"
        del schema
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, f"{kept} bytes kept for 40 schemas"


@pytest.mark.parametrize("fmt_class", [HermesFormat, Llama3JsonFormat])
def test_a_reply_cut_by_max_tokens_inside_a_call_is_that_call_as_far_as_it_got_streamed_or_whole(fmt_class) -> None:
    """Cut at every character of a reply of two calls: the whole answer (`parse_reply`) and the stream agree,
    the cut call is a call (`cut`, its arguments as far as written), never the format's markup as content (it
    leaked as content, and a stream sent the call and then the markup too)."""
    fmt = fmt_class(parse_tools(TOOLS))
    calls = [{"name": "search", "arguments": {"query": "a </tool_call> b", "limit": 3}},
             {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    if fmt_class is HermesFormat:
        reply = "Let me look.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    else:
        reply = "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    for cut in range(1, len(reply) + 1):
        text = reply[:cut]
        content, whole = fmt.parse_reply(text, cut=True)
        stream, sent, streamed = ToolCallStream(fmt, forced=False), "", {}
        for end in range(1, cut + 1):
            sent += stream.content_delta(text[:end])
            for entry in stream.call_deltas(text[:end]):
                _merge(streamed, entry)
        rest, entries, num_calls = stream.finish(text, cut=True)
        for entry in entries:
            _merge(streamed, entry)
        assert sent + rest == (content or ""), (cut, text)
        kept = fmt.kept_calls(whole, True)   # llama3_json: the first call only
        assert [(streamed[k]["name"], streamed[k]["arguments"]) for k in sorted(streamed)] == \
            [(c.name, c.arguments) for c in kept], (cut, text)
        assert "<tool_call>" not in (content or "") and '"name"' not in (content or ""), (cut, text)
        assert [c.cut for c in whole][:-1] == [False] * (len(whole) - 1)
        if kept and kept[-1].cut:
            assert stream.cut_call == len(kept) - 1 and reply.count(kept[-1].arguments) >= 1
    content, whole = fmt.parse_reply(reply, cut=True)         # the whole reply: two calls, none cut
    assert [c.cut for c in whole] == [False, False] and [json.loads(c.arguments) for c in whole] == \
        [c["arguments"] for c in calls]


def test_a_cut_reply_leaks_no_markup_after_a_marker_in_prose_nor_a_python_tag_nor_a_forced_choices_marker() -> None:
    hermes = HermesFormat(parse_tools(TOOLS))
    reply = 'Use <tool_call> tags. <tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    for cut in range(reply.index("<tool_call>\n") + 1, len(reply) + 1):
        content, calls = hermes.parse_reply(reply[:cut], cut=True)
        assert content is None or content.startswith("Use <tool_call> tags.") and "{" not in content, reply[:cut]
    assert hermes.parse(reply)[0] == "Use <tool_call> tags." and len(hermes.parse(reply)[1]) == 1
    llama = Llama3JsonFormat(parse_tools(TOOLS))
    assert llama.parse_reply('<|python_tag|>{"name": "search", "parameters": {"qu', cut=True)[0] is None
    forced = ToolCallStream(hermes, forced=True)
    assert forced.finish("<tool", cut=True) == ("", [], 0)     # calls only: a marker cut short is no content


async def test_a_reply_of_calls_counts_in_request_success_as_its_answer_says(client, live_builtin_server) -> None:
    """A call under tool_choice "required" answers finish_reason "tool_calls", and request_success counts it so
    (it counted the engine's "stop", so `tool_calls` never appeared for a local pool)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def count(reason: str) -> float:
        text = urllib.request.urlopen(live_builtin_server.url + "/metrics", timeout=30).read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "cliffguard_request_success_total" and s.labels.get("finished_reason") == reason)

    before = count("tool_calls")
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                             tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    assert count("tool_calls") == before + 1
