"""Mistral's tool-call forms (`mistral`: the array of call objects after `[TOOL_CALLS]`, tokenizers before v11;
`mistral_args`: `[TOOL_CALLS]NAME[ARGS]{...}` a call, from v11): found from the template, a history's calls written
by the template itself and read back as those calls, the text before them content, a stream that sends the text as
it comes and each call's arguments as the model writes them, a reply max_tokens cut inside a call, the grammars of
forced and strict calls (checked with llguidance token by token on the builtin tokenizer), and call ids of 9 letters
and digits, which these templates insist on. Over HTTP, an agent's loop on a pool whose template is Mistral's: a
forced call, then the history with the call and its result rendered by the template."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render
from engine.structured import check
from gateway.openai.chat_prompt import native_messages
from gateway.openai.mistral_tools import MARKER, MistralArgsFormat, MistralFormat, history_id
from gateway.openai.tool_formats import tool_format
from gateway.openai.tool_specs import parse_tools
from gateway.openai.tools import ToolCallStream
from tests.gateway.conftest import accepts
from tests.gateway.test_deepseek_tools import json_calls_stream
from tests.gateway.test_tagged_tools import check_form_grammars
from tests.gateway.test_tools import prose_markers_stream
from tests.gateway.test_xml_tools import SEARCH, WEATHER, forced_call_over_http, streamed_arguments

# Mistral-7B-Instruct-v0.3's shape: the tools before the last user message, a turn's calls as one array of the
# functions' JSON with each id (9 letters and digits, or the template raises), each result with its call's id
V3_TEMPLATE = (
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}{{- bos_token }}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and m == user_messages[-1] %}"
    "[AVAILABLE_TOOLS] [{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "[/AVAILABLE_TOOLS]{%- endif %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS] [{%- for c in m.tool_calls %}{%- set out = c.function | tojson %}"
    "{{- out[:-1] }}{%- if c.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + c.id + '\"}' }}{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{%- if m.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[TOOL_RESULTS] {\"content\": {{ m.content }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}")
# Mistral-Small-3.2's shape (v11 and later): each call its marker, name, `[ARGS]` and arguments; results bare
V11_TEMPLATE = (
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}{{- bos_token }}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and m == user_messages[-1] %}"
    "{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{- m.content or '' }}{%- for tool in m.tool_calls or [] %}"
    "{%- set arguments = tool.function.arguments %}{%- if arguments is not string %}"
    "{%- set arguments = arguments | tojson | safe %}{%- elif arguments == '' %}{%- set arguments = '{}' %}"
    "{%- endif %}{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}{%- endfor %}{{- eos_token }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content | string + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}")
# the same with each call's id after its name (mistral_common's v11 way, in templates converted from it)
V11_IDS_TEMPLATE = V11_TEMPLATE.replace("tool.function.name + '[ARGS]'", "tool.function.name + '[CALL_ID]' + tool.id "
                                                                         "+ '[ARGS]'")
TEMPLATES = {"mistral": V3_TEMPLATE, "mistral_args": V11_TEMPLATE, "mistral_args_ids": V11_IDS_TEMPLATE}


def _calls(template: str, *calls: tuple[str, dict]) -> str:
    """A history's assistant turn of `calls` (their arguments as OpenAI sends them: JSON text) as `template` writes
    it (no text before the marker)."""
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": history_id(f"call_{i}"), "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(calls)]}]
    text = render(template, native_messages(history), False, False, {"bos_token": "", "eos_token": ""})
    return text[text.index(MARKER):]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def form(request):
    found = tool_format(TEMPLATES[request.param], parse_tools([WEATHER, SEARCH]))
    assert request.param.startswith(found.name) and isinstance(found, (MistralFormat, MistralArgsFormat))
    return found, TEMPLATES[request.param]


def _is_mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


def test_the_templates_write_their_forms_and_a_historys_ids_as_9_of_their_own():
    assert _calls(V3_TEMPLATE, ("search", {"query": "q"}), ("get_weather", {"city": "Oslo"})) == (
        f'[TOOL_CALLS] [{{"name": "search", "arguments": {{"query": "q"}}, "id": "{history_id("call_0")}"}}, '
        f'{{"name": "get_weather", "arguments": {{"city": "Oslo"}}, "id": "{history_id("call_1")}"}}]')
    assert _calls(V11_TEMPLATE, ("search", {"query": "q"}), ("get_weather", {"city": "Oslo"})) == \
        '[TOOL_CALLS]search[ARGS]{"query": "q"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    ids = [history_id(f"call_{i}") for i in range(1000)]
    assert all(map(_is_mistral_id, ids)) and len(set(ids)) == 1000 and ids == [history_id(f"call_{i}")
                                                                               for i in range(1000)]
    assert history_id("aB3dE6gH9") == "aB3dE6gH9" and history_id("aB3dE6gH") != "aB3dE6gH"


def test_the_calls_a_template_writes_read_back_as_those_calls_under_9_character_ids(form):
    fmt, template = form
    args = {"city": "Paris [TOOL_CALLS] ] }", "days": 3, "where": {"lat": 48.8, "t": [None, "[ARGS]"]}}
    text = "Let me look." + _calls(template, ("get_weather", args), ("search", {"query": "x"}))
    content, calls = fmt.parse_reply(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", args), ("search", {"query": "x"})]
    assert all(_is_mistral_id(c.id) for c in calls) and calls[0].id != calls[1].id
    if "[CALL_ID]" in template:   # answered under the ids the model wrote
        assert [c.id for c in calls] == [history_id("call_0"), history_id("call_1")]
    loose = text.replace("[TOOL_CALLS] [{", "[TOOL_CALLS]\n [ \n{").replace("}, {", "} ,\n {")
    assert [(c.name, c.arguments) for c in fmt.parse(loose)[1]] == [(c.name, c.arguments) for c in calls]


NOT_CALLS = {
    "mistral": ['[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', "Wrap calls in [TOOL_CALLS] markers.",
                '[TOOL_CALLS] [{"name": "search", "arguments": [1]}]', "[TOOL_CALLS] []",
                '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "q"}}',   # never closed
                '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "q"}} {"name": "search"}]',
                '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "q"}}, {"name": "nope", "arguments": {}}]'],
    "mistral_args": ["[TOOL_CALLS]nope[ARGS]{}", "Wrap calls in [TOOL_CALLS] markers.", "[TOOL_CALLS]search[ARGS][1]",
                     '[TOOL_CALLS]search[ARGS]{"query": "q"', "[TOOL_CALLS]two words[ARGS]{}"]}


def test_what_is_not_a_call_of_an_offered_function_stays_content(form):
    fmt, _ = form
    for text in NOT_CALLS[fmt.name]:
        assert fmt.parse(text) == (text, []), text


@pytest.mark.parametrize("cut", [False, True])
def test_a_stream_sends_the_text_then_each_calls_arguments_as_written_adding_up_to_the_whole_answer(form, cut):
    """Character by character: the text before the calls as it comes; a call once its arguments' `{` is written,
    under an id of 9 letters and digits, then their text in pieces; `cut`: max_tokens ends the reply inside the
    second call's arguments."""
    fmt, template = form
    text = json_calls_stream(fmt, lambda *calls: _calls(template, *calls), cut)
    ids = [entry["id"] for entry in ToolCallStream(fmt, forced=True).call_deltas(text) if "id" in entry]
    assert all(map(_is_mistral_id, ids)) and len(ids) == 2
    assert "[CALL_ID]" not in template or ids == [history_id("call_0"), history_id("call_1")]


def test_a_reply_cut_before_a_calls_arguments_drops_it_and_a_marker_in_prose_holds_back_nothing(form):
    fmt, template = form
    text = "Ok." + _calls(template, ("search", {"query": "q"}))
    assert fmt.parse_reply(text[:text.index('{"query"')], cut=True) == ("Ok.", [])
    prose_markers_stream(fmt, f"Put calls after {MARKER} markers, then go on.\n", f"{MARKER} ok.\n")


@pytest.mark.parametrize("template", [V11_TEMPLATE, V11_IDS_TEMPLATE])
def test_the_args_forms_grammars_write_it_a_strict_functions_arguments_under_its_schema(lltokenizer, template):
    fmt = tool_format(template, parse_tools([WEATHER, SEARCH]))
    other = V11_TEMPLATE if template == V11_IDS_TEMPLATE else V3_TEMPLATE   # the ids' form asks for an id
    check_form_grammars(fmt, lambda *calls: _calls(template, *calls), lltokenizer,
                        _calls(other, ("get_weather", {"city": "Paris", "days": 0})))


def test_the_array_forms_grammars_write_one_array_of_calls_a_strict_functions_arguments_under_its_schema(lltokenizer):
    """The array's grammars: one marker and one array of calls (one call where parallel calls are off), a strict
    function's arguments under its schema; `auto` also takes text, and text before the array."""
    fmt = tool_format(V3_TEMPLATE, parse_tools([WEATHER, SEARCH]))
    tools = parse_tools([WEATHER, SEARCH])
    forced, auto, single = fmt.grammar(tools, True), fmt.auto_grammar(tools, True), fmt.grammar(tools, False)
    for grammar in (forced, auto, single):
        check(grammar)
    weather = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    search = '{"name": "search", "arguments": {"query": "anything", "other": "any name"}}'
    for text in (f"[TOOL_CALLS] [{weather}]", f"[TOOL_CALLS] [{weather}, {search}]"):
        assert accepts(lltokenizer, forced, text) and accepts(lltokenizer, auto, text), text
        assert len(fmt.parse(text)[1]) == text.count('"name"'), text
    assert accepts(lltokenizer, single, f"[TOOL_CALLS] [{weather}]")
    assert not accepts(lltokenizer, single, f"[TOOL_CALLS] [{weather}, {search}]")
    bad = '{"name": "get_weather", "arguments": {"city": "Paris", "days": "two"}}'
    assert not accepts(lltokenizer, forced, f"[TOOL_CALLS] [{bad}]")
    for text in ("", "Sunny.", f"Let me check.\n[TOOL_CALLS] [{weather}]"):   # text, or text and then calls: auto
        assert accepts(lltokenizer, auto, text) and not accepts(lltokenizer, forced, text), text
    assert not accepts(lltokenizer, auto, f"a {MARKER} b")
    assert not accepts(lltokenizer, forced, f"[TOOL_CALLS] [{weather}][TOOL_CALLS] [{search}]")
    assert not accepts(lltokenizer, forced, _calls(V11_TEMPLATE, ("get_weather", {"city": "Paris", "days": 0})))


def test_a_long_call_streamed_a_few_characters_at_a_time_costs_what_each_delta_adds(form):
    fmt, template = form
    code = ("def f(x):\n    return '}][TOOL_CALLS]' if x else None\n" * 4000)[:200_000]
    text = "Writing." + _calls(template, ("search", {"query": code}), ("search", {"limit": 1, "query": code[:1000]}))
    args, took = streamed_arguments(fmt, text, 40)
    assert [json.loads(args[0]), json.loads(args[1])] == [{"query": code}, {"limit": 1, "query": code[:1000]}]
    assert took < 5.0, took


# the templates with a turn for the tiny model's reply (Mistral's end the prompt at `[/INST]`)
POOL_TEMPLATES = {name: template + "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                  for name, template in TEMPLATES.items()}
UNIT = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
    "type": "object", "required": ["unit", "metric"], "additionalProperties": False, "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}}}}}


@pytest.mark.parametrize("name", list(POOL_TEMPLATES))
async def test_an_agents_loop_on_a_pool_whose_template_is_mistrals_calls_and_sends_the_result_back(
        aiohttp_client, tmp_path, tiny_model, name):
    """Over HTTP: tool_choice "required" writes a call in the template's form, answered under an id of 9 letters and
    digits (whole and streamed); the next turn's history holds that call and its result, which the template (v0.3's
    raises on any other id) renders, and an OpenAI id from another model's turn is made one it takes."""
    async def next_turn(client, body: dict, call: dict) -> None:
        earlier = {"id": "call_0123456789abcdef01234567", "type": "function", "function": call["function"]}
        messages = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [call, earlier]},
                    {"role": "tool", "tool_call_id": call["id"], "content": '"done"'},
                    {"role": "tool", "tool_call_id": earlier["id"], "content": '"done too"'}]
        r = await client.post("/v1/chat/completions", json={**body, "messages": messages, "tool_choice": "auto",
                                                             "max_tokens": 8})
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")

    args = await forced_call_over_http(aiohttp_client, tmp_path, tiny_model, POOL_TEMPLATES[name], UNIT, 120,
                                       call_id=r"[A-Za-z0-9]{9}", after=next_turn)
    assert args["unit"] in ("celsius", "fahrenheit")
