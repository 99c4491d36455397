"""`strict` function tools under tool_choice "auto": the grammar that lets a reply be plain text or calls
whose arguments match a strict tool's schema (checked with llguidance itself, token by token, on the
builtin tokenizer), `strict` read and checked in the request, the grammar attached per request, and a
live `cliffguard serve` (builtin SmolLM2) whose calls under auto validate with the jsonschema package."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import jsonschema
import openai
import pytest

from engine.structured import StructuredOutput, check
from engine.tokenizer import Tokenizer
from gateway.completion import constrained, with_grammar
from gateway.openai.chat import parse_chat
from gateway.openai.errors import ApiError
from gateway.openai.tool_grammar import thinking_first
from gateway.openai.tool_specs import ToolError, parse_tools
from gateway.openai.tools import HermesFormat, Llama3JsonFormat, LongcatFormat
from tests.gateway.conftest import DEFAULT_CONFIG, accepts

MODEL = "smollm2-135m-instruct"
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": WEATHER_SCHEMA, "strict": True}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
    "additionalProperties": False}}}   # not strict: any JSON object as its arguments
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
PLAIN_TEXTS = ["", "It is sunny in Paris: 21 C.", "Line one.\nA <tool> and a <tool_ that are not calls.\n\n"]
PARIS = {"city": "Paris", "unit": "celsius"}


def _hermes(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def _llama3(*calls: tuple[str, dict]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def _longcat(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<longcat_tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</longcat_tool_call>"
                     for n, a in calls)


FORMATS = [(HermesFormat, _hermes), (Llama3JsonFormat, _llama3), (LongcatFormat, _longcat)]
IDS = ["hermes", "llama3_json", "longcat"]


def _auto(fmt_class, parallel: bool = True, reply: StructuredOutput | None = None) -> StructuredOutput:
    tools = parse_tools([WEATHER, SEARCH])
    grammar = fmt_class(tools).auto_grammar(tools, parallel, reply)
    check(grammar)
    return grammar


# --- the grammar -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt_class, write", FORMATS, ids=IDS)
def test_auto_with_a_strict_tool_admits_plain_text_or_calls_that_match_its_schema(lltokenizer, fmt_class, write):
    grammar = _auto(fmt_class)
    for text in PLAIN_TEXTS:
        assert accepts(lltokenizer, grammar, text), text
    assert accepts(lltokenizer, grammar, write(("get_weather", PARIS)))
    # the strict tool's schema holds: a value outside the enum, a missing or an extra property are refused
    for bad in ({"city": "Paris", "unit": "kelvin"}, {"city": "Paris"}, {**PARIS, "days": 3},
                {"city": 5, "unit": "celsius"}):
        assert not accepts(lltokenizer, grammar, write(("get_weather", bad))), bad
    # the tool that is not strict takes any JSON object (so its call always parses), not a non-object
    assert accepts(lltokenizer, grammar, write(("search", {"anything": [1, {"x": None}]})))
    assert not accepts(lltokenizer, grammar, write(("search", [1])))
    assert not accepts(lltokenizer, grammar, write(("not_offered", {})))


def test_plain_text_never_starts_a_call_and_may_lead_to_calls(lltokenizer):
    """hermes: plain text holds no call marker, and may come before the calls (what Qwen's models write:
    "I'll check." then a call; the grammar forced text or calls before, so a reply begun as text never
    called), whose arguments still follow the schema; nothing follows the calls. llama3_json: text that
    begins as a call is refused (a JSON object, or the python tag, first)."""
    call, two = _hermes(("get_weather", PARIS)), _hermes(("get_weather", PARIS), ("search", {"query": "x"}))
    hermes, one = _auto(HermesFormat), _auto(HermesFormat, parallel=False)
    for text in (f"Let me check.\n{call}", f"Checking <tool_ and then:\n\n{two}", f"x{call}"):
        assert accepts(lltokenizer, hermes, text), text
    assert accepts(lltokenizer, one, f"Let me check.\n{call}")
    bad = _hermes(("get_weather", {"city": "Paris", "unit": "kelvin"}))
    for text in (f"{call}\nDone.", "a <tool_call> b", f"Let me check.\n{bad}", f"Sure. {call} and {call}"):
        assert not accepts(lltokenizer, hermes, text), text
    assert not accepts(lltokenizer, one, f"Let me check.\n{two}")
    llama3 = _auto(Llama3JsonFormat)
    texts = ('{"answer": 4}', '  {"name": "get_weather"}', "<|python_tag|>hello",
             f"Sure. {_llama3(('get_weather', PARIS))}")
    for text in texts:   # a call after text is content to `parse`, so it is plain text
        assert accepts(lltokenizer, llama3, text) == text.startswith("Sure."), text


@pytest.mark.parametrize("fmt_class, write", FORMATS, ids=IDS)
def test_parallel_tool_calls_false_allows_one_call(lltokenizer, fmt_class, write):
    two = write(("get_weather", PARIS), ("search", {"query": "x"}))
    assert accepts(lltokenizer, _auto(fmt_class, parallel=True), two) == fmt_class.parallel_calls   # llama3: one
    assert not accepts(lltokenizer, _auto(fmt_class, parallel=False), two)
    assert accepts(lltokenizer, _auto(fmt_class, parallel=False), write(("search", {"query": "x"})))


def test_a_response_format_is_what_a_reply_that_is_not_a_call_must_be(lltokenizer):
    reply = StructuredOutput.json_schema({"type": "object", "properties": {"answer": {"type": "integer"}},
                                          "required": ["answer"], "additionalProperties": False})
    grammar = _auto(HermesFormat, reply=reply)
    assert accepts(lltokenizer, grammar, '{"answer": 4}')
    assert accepts(lltokenizer, grammar, _hermes(("get_weather", PARIS)))
    for text in ("It is 4.", '{"answer": "four"}', _hermes(("get_weather", {"city": "Paris"}))):
        assert not accepts(lltokenizer, grammar, text), text
    assert accepts(lltokenizer, _auto(HermesFormat, reply=StructuredOutput("json_object")), '{"a": [1]}')


@pytest.mark.parametrize("fmt_class, write", FORMATS, ids=IDS)
def test_a_thinking_models_reply_thinks_before_the_constrained_part(lltokenizer, fmt_class, write):
    """`think` "optional": a `<think>` block may come first (whitespace after it), then what the grammar
    asks; plain text never begins with `<think>` (the block is read as one) and a block after text is
    text. "opened" (the prompt opened the block): the reply's thought must close it before the rest."""
    tools = parse_tools([WEATHER, SEARCH])
    call, thought = write(("get_weather", PARIS)), "Paris, so a call.\n</think>\n\n"
    reply = StructuredOutput.json_schema({"type": "object"})
    grammars = {"optional": [fmt_class(tools).auto_grammar(tools, True, think="optional"),
                             fmt_class(tools).grammar(tools, True, "optional")],
                "opened": [fmt_class(tools).auto_grammar(tools, True, think="opened"),
                           fmt_class(tools).grammar(tools, True, "opened")]}
    for grammar in grammars["optional"] + grammars["opened"]:
        check(grammar)
    for grammar in grammars["optional"]:
        assert accepts(lltokenizer, grammar, "<think>\n" + thought + call)
        assert accepts(lltokenizer, grammar, call)
        assert not accepts(lltokenizer, grammar, "<think>\nno end " + call)
    assert not accepts(lltokenizer, grammars["optional"][1], "<think>\n" + thought + "</think>" + call)   # one
    for grammar in grammars["opened"]:
        assert accepts(lltokenizer, grammar, thought + call)
        assert not accepts(lltokenizer, grammar, call)                  # the block must be closed first
    assert accepts(lltokenizer, grammars["optional"][1], "\n<think>\n" + thought + call)   # whitespace first
    assert not accepts(lltokenizer, grammars["opened"][0], thought + "<think>b</think>Sunny.")   # one block
    auto = grammars["optional"][0]
    assert accepts(lltokenizer, auto, "<think>\n" + thought + "It is sunny.")
    assert accepts(lltokenizer, auto, "It is sunny. <think>x</think>")
    assert accepts(lltokenizer, grammars["opened"][0], thought + "It is sunny.")
    assert not accepts(lltokenizer, auto, write(("get_weather", {"city": "Paris"})))   # the schema still holds
    led = "I'll check.\n" + call   # after the block too (hermes: text and a call; llama3_json: text)
    assert accepts(lltokenizer, auto, "<think>\n" + thought + led)
    assert accepts(lltokenizer, grammars["opened"][0], thought + led)
    for think, pre in (("optional", "<think>\n" + thought), ("opened", thought)):
        grammar = thinking_first(reply, think)
        assert accepts(lltokenizer, grammar, pre + '{"a": 1}') and not accepts(lltokenizer, grammar, pre + "no")
    assert accepts(lltokenizer, thinking_first(reply, "optional"), '{"a": 1}')


@pytest.mark.parametrize("fmt_class, write", FORMATS, ids=IDS)
def test_a_schemas_own_refs_mean_in_the_call_grammar_what_they_mean_alone(lltokenizer, fmt_class, write):
    """`$ref`s resolve against the schema's root: inside the grammar of calls, where each arguments schema sits
    in a schema of its own, they are rebased onto it (a `$defs` ref was refused, "#" meant the call)."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    person = {"$defs": {"Addr": address}, "type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}},
              "required": ["home"], "additionalProperties": False}
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "children": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["label", "children"], "additionalProperties": False}
    tools = parse_tools([{"type": "function", "function": {"name": "person", "parameters": person, "strict": True}},
                         {"type": "function", "function": {"name": "tree", "parameters": tree, "strict": True}}])
    leaf = {"label": "b", "children": []}
    for offered in (tools[:1], tools):
        for grammar in (fmt_class(tools).grammar(offered, True), fmt_class(tools).auto_grammar(offered, True)):
            check(grammar)
            assert accepts(lltokenizer, grammar, write(("person", {"home": {"city": "Oslo"}})))
            assert not accepts(lltokenizer, grammar, write(("person", {"home": {"town": "Oslo"}})))
            if len(offered) == 2:
                assert accepts(lltokenizer, grammar, write(("tree", {"label": "a", "children": [leaf]})))
                assert not accepts(lltokenizer, grammar, write(("tree", {"label": "a", "children": [
                    {"name": "tree", "arguments": leaf}]})))


def test_a_grammar_of_tools_past_the_librarys_bound_together_is_a_400_naming_tools(pool):
    """Each schema is under the bound alone; the grammar of calls holds them all."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "strict": True, "parameters": {
        "type": "object", "description": "d" * 140_000, "properties": {}}}} for i in range(2)]
    for choice in ("required", "auto"):
        with pytest.raises(ApiError) as info:
            with_grammar(parse_chat(dict(CHAT, tools=tools, tool_choice=choice)), pool)
        assert info.value.status == 400 and info.value.param == "tools", info.value.message
        assert "too large: at most 262144 characters" in info.value.message


# --- the request -------------------------------------------------------------------------------------

def test_strict_is_kept_and_a_non_boolean_names_the_field():
    weather, search = parse_tools([WEATHER, SEARCH])
    assert weather.strict is True and search.strict is False
    assert parse_tools([{"type": "function", "function": {"name": "f", "strict": None}}])[0].strict is False
    with pytest.raises(ToolError, match=r"^tools\[1\]\.function\.strict: "):
        parse_tools([SEARCH, {"type": "function", "function": {"name": "f", "strict": 1}}])
    with pytest.raises(ApiError) as info:
        parse_chat(dict(CHAT, tools=[{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]))
    assert info.value.status == 400 and info.value.param == "tools[0].function.strict", info.value.message


@pytest.fixture(scope="module")
def gateway():
    """The default config's gateway, its device workers never started."""
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config

    gateway = Gateway.from_config(load_config(DEFAULT_CONFIG))
    yield gateway
    gateway.executor.shutdown(wait=False)


@pytest.fixture(scope="module")
def pool(gateway):
    """The default config's chat pool (the builtin SmolLM2: a template without tools, so hermes)."""
    return gateway.pools["chat"]


def test_the_grammar_is_attached_under_auto_only_with_a_strict_tool(pool, lltokenizer):
    req = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER, SEARCH], parallel_tool_calls=False)), pool)
    tools = parse_tools([WEATHER, SEARCH])
    assert req.structured_param == "tools" and req.params.structured == HermesFormat(tools).auto_grammar(tools, False)
    assert with_grammar(parse_chat(dict(CHAT, tools=[SEARCH])), pool).params.structured is None
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    req = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER], response_format=fmt)), pool)
    assert accepts(lltokenizer, req.params.structured, '{"answer": 4}')
    assert not accepts(lltokenizer, req.params.structured, "It is 4.")
    # Non-strict tools beside a response_format: the format binds the reply, and the tools stay callable (as
    # OpenAI; the grammar was the response_format alone, no call could be written)
    req = with_grammar(parse_chat(dict(CHAT, tools=[SEARCH], response_format=fmt)), pool)
    assert req.structured_param == "tools"
    for text in ('{"answer": 4}', _hermes(("search", {"query": "Paris", "any": [1]}))):
        assert accepts(lltokenizer, req.params.structured, text), text
    assert not accepts(lltokenizer, req.params.structured, "It is 4.")


def test_tool_choice_none_lets_the_reply_write_no_call(pool, lltokenizer):
    """tool_choice "none" beside tools: plain text that starts no call (the model shown the tools would write
    calls the gateway passes on as text: Qwen's template teaches them), thinking first where the model thinks;
    a response_format binds the reply as before, and no tools means no grammar."""
    for tools in ([WEATHER], [SEARCH]):
        req = with_grammar(parse_chat(dict(CHAT, tools=tools, tool_choice="none")), pool)
        assert req.structured_param == "tool_choice"
        for text in PLAIN_TEXTS:
            assert accepts(lltokenizer, req.params.structured, text), text
        for text in (_hermes(("get_weather", PARIS)), "Let me check.\n" + _hermes(("search", {"query": "x"}))):
            assert not accepts(lltokenizer, req.params.structured, text), text
    thinking = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER], tool_choice="none")), pool, think="optional")
    assert accepts(lltokenizer, thinking.params.structured, "<think>\nno call.\n</think>\n\nSunny.")
    assert not accepts(lltokenizer, thinking.params.structured, "<think>x</think>" + _hermes(("get_weather", PARIS)))
    fmt = {"type": "json_object"}
    req = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER], tool_choice="none", response_format=fmt)), pool)
    assert req.params.structured == StructuredOutput("json_object") and req.structured_param == "response_format"
    assert with_grammar(parse_chat(dict(CHAT, tool_choice="none")), pool).params.structured is None


async def test_a_reply_that_may_call_keeps_call_markers_its_tokenizer_made_special(gateway, pool, builtin_path,
                                                                                   tmp_path):
    """A tokenizer whose `<tool_call>` and `</tool_call>` are special tokens (Hermes 2 Pro's): decoded skipping
    them, as a request does by default, a call's text loses its tags and no call is read; a reply that may
    call keeps special tokens (`constrained`), one under tool_choice "none" or without tools does not, nor
    a reply on a tokenizer whose tags are text."""
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(builtin_path / name, tmp_path / name)
    spec = json.loads((builtin_path / "tokenizer.json").read_text())
    first = 1 + max(max(spec["model"]["vocab"].values()), *(t["id"] for t in spec["added_tokens"]))
    spec["added_tokens"] += [{"id": first + i, "content": tag, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for i, tag in enumerate(("<tool_call>", "</tool_call>"))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    special = dataclasses.replace(pool, tokenizer=Tokenizer.from_folder(tmp_path))
    ids = special.tokenizer.encode(_hermes(("get_weather", PARIS)), add_special_tokens=False)
    fmt = HermesFormat(parse_tools([WEATHER]))
    assert fmt.parse(special.tokenizer.decode(ids))[1] == []
    assert [c.name for c in fmt.parse(special.tokenizer.decode(ids, skip_special_tokens=False))[1]] == ["get_weather"]

    async def skips(on, **body) -> bool:
        req, _ = await constrained(gateway, parse_chat(dict(CHAT, **body)), on, [1, 2, 3])
        return req.params.skip_special_tokens
    assert not await skips(special, tools=[SEARCH]) and not await skips(special, tools=[WEATHER], tool_choice="required")
    assert await skips(special, tools=[SEARCH], tool_choice="none") and await skips(special)
    assert await skips(pool, tools=[SEARCH])


def test_a_response_format_a_format_cannot_tell_from_a_call_is_a_400(pool, builtin_path, tmp_path):
    """llama3_json writes a call as a bare JSON object: a JSON reply beside strict tools would read as one."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(builtin_path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        '{%- if tools %}Reply {"name": ..., "parameters": ...}{% endif %}'
        "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    llama3 = dataclasses.replace(pool, tokenizer=Tokenizer.from_folder(tmp_path))
    # allowed_tools of tools not strict beside it: the JSON reply alone, as under plain "auto" (it was this 400)
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "search"}}]}}
    req = with_grammar(parse_chat(dict(CHAT, tools=[SEARCH], tool_choice=allowed,
                                       response_format={"type": "json_object"})), llama3)
    assert req.params.structured == StructuredOutput("json_object")
    body = dict(CHAT, tools=[WEATHER], response_format={"type": "json_object"})
    with pytest.raises(ApiError) as info:
        with_grammar(parse_chat(body), llama3)
    assert info.value.status == 400 and info.value.param == "response_format", info.value.message
    assert with_grammar(parse_chat(body), pool).params.structured.kind == "grammar"   # hermes can
    req = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER])), llama3)
    assert req.params.structured == Llama3JsonFormat(req.tools).auto_grammar(req.tools, True)
    req = with_grammar(parse_chat(dict(body, tools=[SEARCH])), llama3)   # non-strict: the JSON reply alone
    assert req.params.structured == StructuredOutput("json_object") and req.structured_param == "response_format"


# --- a live server -----------------------------------------------------------------------------------

@pytest.fixture
def client(live_builtin_server):
    """A fresh client per test (each runs on its own event loop) of the session's `cliffguard serve`."""
    return openai.AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


async def test_a_non_boolean_strict_is_a_400_naming_it_and_the_next_request_is_served(client):
    bad = {"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], tools=[bad], max_tokens=2)
    assert info.value.body["param"] == "tools[0].function.strict", info.value.body
    ok = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def _call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}]}


async def test_a_json_reply_beside_a_strict_tool_is_checked_with_its_own_strictness(client):
    """Under "auto" with a strict tool, a response_format binds the reply that is no call: one not strict whose
    keywords the library cannot enforce (`uniqueItems`) is served (it was a 400, checked as if strict); a strict
    one is a 400 naming response_format."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}, "strict": True}}
    for strict in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tags?"}], max_tokens=4, tools=[tool],
                      tool_choice="auto", response_format={"type": "json_schema", "json_schema": {
                          "name": "t", "schema": schema, "strict": strict}})
        if strict:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(**kwargs)
            assert info.value.body["param"] == "response_format" and "Unimplemented keys" in info.value.body["message"]
        else:
            assert (await client.chat.completions.create(**kwargs)).choices[0].finish_reason in ("length", "stop",
                                                                                                 "tool_calls")


async def test_a_strict_tool_under_auto_is_called_with_arguments_that_match_its_schema(client):
    """The history shows calls without `unit` (the tool's schema changed since): the model, left free,
    copies them (calls its schema refuses); strict, each call it makes has a `unit`, and a reply that is
    not a call holds no call marker."""
    history = [{"role": "user", "content": "What's the weather in Rome?"}, _call(1, "Rome"),
               {"role": "user", "content": "And in Madrid?"}, _call(2, "Madrid")]

    async def ask(question: str):
        messages = [*history, {"role": "user", "content": question}]
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40,
                                                 temperature=0)
        return r.choices[0]

    choices = await asyncio.gather(*(ask(q) for q in ("What's the weather in Paris?", "Is it cold in Oslo?")))
    calls = [call for choice in choices for call in choice.message.tool_calls or []]
    assert calls, [choice.message for choice in choices]     # the builtin model calls it at temperature 0
    for choice in choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls", choice.message
        else:
            assert "<tool_call>" not in (choice.message.content or ""), choice.message
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_allowed_tools_shows_every_tool_and_lets_a_reply_call_only_those(pool, lltokenizer):
    """tool_choice {"type": "allowed_tools"} (OpenAI's): the tools all rendered (the prompt's cached prefix stays
    the whole list's), and a grammar lets the reply call only the allowed ones, under "auto" (text too) and
    "required"; names that are not offered, an empty list, a mode OpenAI does not have are 400s naming the field."""
    def allowed(mode: str, *names: str) -> dict:
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "function", "function": {"name": name}} for name in names]}}
    weather, search = _hermes(("get_weather", PARIS)), _hermes(("search", {"query": "x"}))
    req = parse_chat(dict(CHAT, tools=[WEATHER, SEARCH], tool_choice=allowed("auto", "search")))
    assert (req.tool_choice.mode, req.tool_choice.allowed) == ("auto", ("search",)) and len(req.tools) == 2
    assert [t.name for t in req.callable_tools] == ["search"] and req.offers_calls
    auto = with_grammar(req, pool).params.structured
    for text, ok in (("It is sunny.", True), (search, True), (weather, False)):
        assert accepts(lltokenizer, auto, text) == ok, text
    required = with_grammar(parse_chat(dict(CHAT, tools=[WEATHER, SEARCH],
                                            tool_choice=allowed("required", "get_weather"))), pool).params.structured
    for text, ok in (("It is sunny.", False), (search, False), (weather, True)):
        assert accepts(lltokenizer, required, text) == ok, text
    for choice, param in ((allowed("auto", "nope"), "tool_choice.allowed_tools.tools[0].function.name"),
                          (allowed("auto"), "tool_choice.allowed_tools.tools"),
                          (allowed("sometimes", "search"), "tool_choice.allowed_tools.mode"),
                          ({"type": "banana"}, "tool_choice.type")):
        with pytest.raises(ApiError) as info:
            parse_chat(dict(CHAT, tools=[WEATHER, SEARCH], tool_choice=choice))
        assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)
