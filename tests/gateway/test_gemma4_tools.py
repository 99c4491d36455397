"""Gemma 4's tool-call form (`gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`): found from the
template, its notation read into OpenAI's JSON arguments (strings holding its own punctuation, numbers, literals,
nested objects and lists), what is not a call of an offered function left as content, a reply cut by max_tokens
inside a call, a stream adding up to the whole answer at a cost of what each delta adds, and the grammars of forced
and strict calls written in the notation under each schema (llguidance, token by token on the builtin tokenizer).
Over the openai SDK, a reply that thinks in Gemma 4's channel and then calls, whole and streamed, and a forced call."""

from __future__ import annotations

import json
import time

import openai
import pytest

from gateway.openai.gemma4_tools import END, QUOTE, START, Gemma4Format, _written
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from tests.gateway.conftest import accepts, chat_pool_yaml, start_gateway
from tests.gateway.test_reasoning import MESSAGES, _ScriptedEngine, _special_tags, _thinking_model
from tests.gateway.test_tagged_tools import check_form_grammars
from tests.gateway.test_xml_tools import SEARCH, WEATHER, streamed_by_character

# Gemma 4's shape: turns of `<|turn>`, a history's calls in its own notation (as the template writes them: here the
# arguments' JSON), the history's thoughts dropped
TEMPLATE = ("{% for m in messages %}<|turn>{{ m.role }}\n{{ (m.content or '').split('<channel|>')[-1] }}"
            "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ c.function.arguments }}"
            "<tool_call|>{% endfor %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def _q(text: str) -> str:
    return f"{QUOTE}{text}{QUOTE}"


CALL = f"{START}call:get_weather{{city:{_q('Paris, {France}: [x]')},days:3}}{END}"
NESTED = (f"{START}call:search{{query:{_q('q')},limit:-2.5e1,exact:true,lang:null,filters:{{tags:[{_q('a')},1,"
          f"[false]],{_q('quoted key')}:word}}}}{END}")


@pytest.fixture(scope="module")
def fmt() -> Gemma4Format:
    found = tool_format(TEMPLATE, parse_tools([WEATHER, SEARCH]))
    assert isinstance(found, Gemma4Format) and found.name == "gemma4"
    return found


def test_the_notation_reads_into_openais_json_arguments(fmt):
    content, calls = fmt.parse("Let me look." + CALL + "\n" + NESTED)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris, {France}: [x]", "days": 3}),
        ("search", {"query": "q", "limit": -25.0, "exact": True, "lang": None,
                    "filters": {"tags": ["a", 1, [False]], "quoted key": "word"}})]
    assert [c.start for c in calls] == [len("Let me look."), len("Let me look." + CALL + "\n")]


@pytest.mark.parametrize("text", [
    f"{START}call:unknown{{a:1}}{END}",                       # a function not offered
    f"{START}call:get_weather{{city {_q('P')}}}{END}",          # no colon after the key
    f"{START}call:get_weather{{city:{_q('P')} days:3}}{END}",   # no comma between items
    f"{START}call:get_weather{{city:{_q('P')}}} then {END}",    # text before the closing marker
    f"Use {START} to call, then stop.",                       # the marker in prose
    f"{START}call:get_weather{{city:{_q('P')}",                 # never closed (the reply ended: EOS)
])
def test_what_is_not_a_call_of_an_offered_function_stays_content(fmt, text):
    assert fmt.parse(text) == (text, [])


def test_a_reply_cut_inside_a_call_ends_in_that_call_as_far_as_its_items_are_whole(fmt):
    content, calls = fmt.parse_reply("Ok." + CALL[:CALL.index(",days") + len(",da")], cut=True)
    assert content == "Ok." and [(c.name, json.loads(c.arguments), c.cut) for c in calls] == [
        ("get_weather", {"city": "Paris, {France}: [x]"}, True)]
    assert fmt.parse_reply(f"Ok.{START}call:get_wea", cut=True) == ("Ok.", [])


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_adds_up_to_the_whole_answer(fmt, cut):
    text = "Checking.\n" + CALL + NESTED + ("" if not cut else f"{START}call:search{{query:{_q('more')},li")
    sent, args, names, count = streamed_by_character(fmt, text, cut)
    content, calls = fmt.parse_reply(text, cut)
    assert sent == content == "Checking." and count == len(calls) == (3 if cut else 2)
    assert [names[k] for k in range(count)] == [c.name for c in calls]
    assert [args[k] for k in range(count)] == [c.arguments for c in calls]


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(fmt):
    from gateway.openai.tools import ToolCallStream

    code = ("def f(x):\n    return '},<tool_call|>' if x else None\n" * 4000)[:200_000].replace(QUOTE, "")
    text = "Writing." + f"{START}call:search{{query:{_q(code)}}}{END}"
    stream, args, took = ToolCallStream(fmt, forced=False), "", 0.0
    for end in range(40, len(text) + 40, 40):
        started = time.process_time()
        stream.content_delta(text[:end])
        args += "".join(e["function"]["arguments"] for e in stream.call_deltas(text[:end]))
        took += time.process_time() - started
    assert json.loads(args) == {"query": code} and took < 5.0


def _turn(*calls: tuple[str, dict]) -> str:
    """A turn of `calls` in the notation, as Gemma 4's template writes a history's."""
    return "".join(f"{START}call:{name}{_written(args)}{END}" for name, args in calls)


def test_the_grammars_write_the_notation_under_each_schema(fmt, lltokenizer):
    check_form_grammars(fmt, _turn, lltokenizer, '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    tools = parse_tools([{"type": "function", "function": {"name": "plan", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["steps"], "properties": {
            "title": {"type": ["string", "null"]},
            "steps": {"type": "array", "items": {"type": "object", "properties": {
                "n": {"type": "integer"}, "ok": {"type": "boolean"}}}},
            "mode": {"anyOf": [{"const": "fast"}, {"type": "number"}]}}}}}])
    plan = Gemma4Format(tools)
    forced = plan.grammar(tools, True)
    for args in ({"steps": []}, {"title": None, "steps": [{"n": 1, "ok": True}, {}]}, {"steps": [], "mode": "fast"},
                 {"title": "T", "steps": [{"ok": False, "n": -3}], "mode": 2.5}):
        assert accepts(lltokenizer, forced, _turn(("plan", args))), args
        assert [json.loads(c.arguments) for c in plan.parse(_turn(("plan", args)))[1]] == [args]
    for args in ({"steps": [{"n": 1.5}]}, {"steps": [], "mode": "slow"}, {"title": 3, "steps": []}, {}):
        assert not accepts(lltokenizer, forced, _turn(("plan", args))), args


def test_the_grammars_follow_refs_and_join_all_of_as_pydantic_writes_schemas(lltokenizer):
    """A schema as Pydantic writes one (the Agents SDK's function tools): `$defs` named by `$ref`, a field wrapped in
    `allOf` with its description, a recursive model (a tree of nodes): the forced grammar holds each argument to
    what the ref names (an enum, a required field, no other field), nested as deep as the tree goes."""
    defs = {"Unit": {"type": "string", "enum": ["c", "f"]},
            "Node": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}
    tools = parse_tools([{"type": "function", "function": {"name": "file", "strict": True, "parameters": {
        "$defs": defs, "type": "object", "additionalProperties": False, "required": ["tree", "unit"], "properties": {
            "tree": {"$ref": "#/$defs/Node"},
            "unit": {"allOf": [{"$ref": "#/$defs/Unit"}], "description": "the unit"}}}}}])
    fmt = Gemma4Format(tools)
    forced = fmt.grammar(tools, True)
    deep = {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}, {"name": "d", "children": []}]}
    for args in ({"tree": {"name": "root"}, "unit": "c"}, {"tree": deep, "unit": "f"}):
        assert accepts(lltokenizer, forced, _turn(("file", args))), args
    for args in ({"tree": {"name": "root"}, "unit": "k"}, {"tree": {"children": []}, "unit": "c"},
                 {"tree": {"name": "a", "children": [{"name": "b", "size": 1}]}, "unit": "c"},
                 {"tree": {"name": 1}, "unit": "c"}):
        assert not accepts(lltokenizer, forced, _turn(("file", args))), args


async def test_a_reply_that_thinks_then_calls_over_the_sdk(aiohttp_client, tmp_path, tiny_model, monkeypatch,
                                                           lltokenizer):
    """The thought channel is `reasoning_content`, the call a tool call (whole and streamed); its markers and string
    marks are special tokens, so the reply is decoded with them; a forced call's grammar lets the model think first."""
    folder = _thinking_model(tmp_path / "thinker", tiny_model, TEMPLATE)
    _special_tags(folder, ["<|channel>", "<channel|>", START, END, QUOTE])
    yaml = chat_pool_yaml(folder, max_model_len=256, extra="    served_model_name: thinker\n")
    client, _ = await start_gateway(aiohttp_client, tmp_path, yaml)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["<|channel>", "thought\n", "I need the weather.", "<channel|>", START, "call:get_", "weather{",
                     "city:", QUOTE, "Oslo", QUOTE, "}", END]
    tools = [{"type": "function", "function": {**WEATHER["function"], "strict": False}}]
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=tools)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == "I need the weather."
    assert whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    chunks = [c async for c in await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=tools,
                                                                stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather."
    assert not "".join(d.content or "" for d in deltas)
    arguments = "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or [])
    assert json.loads(arguments) == {"city": "Oslo"}
    assert engine.skip_special == [False, False]
    # a forced call: its grammar lets the model think in its channel first, then writes the notation
    engine.pieces = [*engine.pieces[:4], START, "call:get_weather{city:", QUOTE, "Oslo", QUOTE, ",days:2}", END]
    forced = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=[WEATHER],
                                                tool_choice="required")).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    assert accepts(lltokenizer, engine.structured[-1], "".join(engine.pieces))
