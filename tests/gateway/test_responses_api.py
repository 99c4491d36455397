"""The Responses API (`POST /v1/responses`) through the unchanged `openai` SDK against a live `cliffguard serve`
(builtin SmolLM2): text, JSON schema and a tool call, each whole and streamed, a tool result sent back as
input, and the 400s naming the field for what it refuses (kept responses: test_stored_responses.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


class Pet(BaseModel):
    name: str
    species: str
    age: int


@pytest.fixture
def client(live_builtin_server):
    """A fresh client per test: each test runs on its own event loop."""
    return openai.AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


async def _events(client, **kwargs) -> list:
    return [event async for event in await client.responses.create(stream=True, **kwargs)]


async def test_text_whole_and_streamed(client) -> None:
    kwargs = dict(model=MODEL, instructions="You are terse.", input="Name three colours.", max_output_tokens=24,
                  temperature=0)
    whole = await client.responses.create(**kwargs, safety_identifier="user-1", prompt_cache_key="colours")
    assert whole.object == "response" and whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens <= 24 and whole.usage.input_tokens > 0
    openai.types.responses.Response.model_validate(whole.model_dump())   # every field the SDK requires is there
    assert whole.id.startswith("resp_") and whole.output[-1].id.startswith("msg_") and whole.created_at.is_integer()
    assert whole.usage.input_tokens_details.cache_write_tokens == 0
    events = await _events(client, **kwargs)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    async with client.responses.stream(**kwargs) as stream:
        final = await stream.get_final_response()
    assert final.output_text == whole.output_text


async def test_json_schema_whole_and_streamed(client) -> None:
    parsed = await client.responses.parse(model=MODEL, input="Describe a pet as JSON.", text_format=Pet,
                                          max_output_tokens=120, temperature=0)
    assert isinstance(parsed.output_parsed, Pet)
    # The same request streamed, with the format written out as parse() sends it.
    fmt = {"type": "json_schema", "name": "Pet", "schema": to_strict_json_schema(Pet), "strict": True}
    events = await _events(client, model=MODEL, input="Describe a pet as JSON.", text={"format": fmt},
                           max_output_tokens=120, temperature=0)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert Pet.model_validate_json(streamed) == parsed.output_parsed


async def test_a_tool_call_whole_and_streamed_then_its_result_as_input(client, builtin_path) -> None:
    """... and the follow-up under tool_choice "none" is read from a prompt listing the tools with no way to
    call them (`gateway.openai.chat_prompt`)."""
    from engine.tokenizer import Tokenizer
    from gateway.openai.chat_prompt import prompt_ids
    from gateway.openai.responses import parse_responses
    from pools.tokencount import TokenCounter

    kwargs = dict(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required",
                  max_output_tokens=120, temperature=0)
    whole = await client.responses.create(**kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = await _events(client, **kwargs)
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [c.arguments for c in calls]
    pieces: dict[str, list[str]] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            pieces.setdefault(e.item_id, []).append(e.delta)
    # each call's arguments streamed in pieces as written, joining to the whole answer's
    assert [("".join(p), len(p) > 3) for p in pieces.values()] == [(c.arguments, True) for c in calls]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.name == "get_weather" and events.index(added) < next(
        i for i, e in enumerate(events) if e.type == "response.function_call_arguments.delta")
    body = dict(model=MODEL, tools=[WEATHER], max_output_tokens=12, temperature=0, tool_choice="none",
                input=[{"role": "user", "content": "What's the weather in Paris?"},
                       {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                        "arguments": calls[0].arguments},
                       {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 18}'}])
    followup = await client.responses.create(**body)
    assert followup.output_text
    chat, tokenizer = parse_responses(body).chat, Tokenizer.from_folder(builtin_path)
    ids = {may: prompt_ids(tokenizer, TokenCounter(tokenizer), chat.messages, chat.tools, calls=may)
           for may in (True, False)}
    assert followup.usage.input_tokens == len(ids[False]) != len(ids[True])


async def test_tool_choice_auto_or_none_without_tools_is_served_and_echoed(client) -> None:
    """No tools and tool_choice "auto" (the default an agent framework may send) or "none": no calls to make,
    so the reply is text, and the Response echoes the mode (OpenAI's default "auto"): it was a 400, the echo
    "none". "required" without tools is still a 400 naming tool_choice."""
    kwargs = dict(model=MODEL, input="Say hi.", max_output_tokens=2, temperature=0)
    for asked, echoed in ((None, "auto"), ("auto", "auto"), ("none", "none")):
        extra = {} if asked is None else {"tool_choice": asked}
        r = await client.responses.create(**kwargs, **extra)
        assert r.tool_choice == echoed and r.tools == [] and r.output_text, asked
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**kwargs, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


async def test_allowed_tools_calls_only_the_listed_function_and_is_echoed(client) -> None:
    """The Responses API's flat `allowed_tools`: both tools are shown, only the listed one may be called."""
    other = {**WEATHER, "name": "get_time", "description": "The time in a city."}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    r = await client.responses.create(model=MODEL, input="What time is it in Paris?", tools=[other, WEATHER],
                                      tool_choice=choice, max_output_tokens=60, temperature=0)
    assert r.output and {(i.type, i.name) for i in r.output} == {("function_call", "get_weather")}
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    assert [t["name"] for t in r.tool_choice.tools] == ["get_weather"]


async def test_a_call_cut_by_max_output_tokens_is_an_incomplete_call_whole_and_streamed(client) -> None:
    kwargs = dict(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required",
                  max_output_tokens=14, temperature=0)
    whole = await client.responses.create(**kwargs)
    assert whole.status == "incomplete" and [(i.type, i.status) for i in whole.output] == [
        ("function_call", "incomplete")]
    events = await _events(client, **kwargs)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and not any("output_text" in e.type for e in events)
    assert [(i.type, i.status, i.arguments) for i in done] == [
        ("function_call", "incomplete", whole.output[0].arguments)]


@pytest.mark.parametrize("extra, param", [
    ({"store": "yes"}, "store"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "banana"}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "pet"}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "21 C"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1"}]}, "input[1].output"),
    ({"truncation": "middle"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"app": 5}}, "metadata.app"),
    # refused after parsing (the pool's context, the prompt's routing), named as the Responses API names them
    ({"max_output_tokens": 99_999_999}, "max_output_tokens"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                          "tools": [{"type": "function", "name": "nope"}]}}, "tool_choice.tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.tools"),
    ({"input": "hi " * 60_000}, "input"),
])
async def test_what_the_server_cannot_do_is_a_400_naming_the_field(client, extra, param) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**body)
    assert info.value.body["param"] == param, info.value.body
    ok = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)   # the next one is served
    assert ok.status == "incomplete" and ok.incomplete_details.reason == "max_output_tokens"
    assert ok.usage.output_tokens == 2 and ok.output_text


async def test_metadata_is_echoed_and_logprobs_come_with_the_text_whole_and_streamed(client) -> None:
    kwargs = dict(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"], metadata={"app": "tests", "turn": "1"})
    whole = await client.responses.create(**kwargs)
    assert whole.metadata == {"app": "tests", "turn": "1"}
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens == 4
    assert "".join(lp.token for lp in part.logprobs) == part.text and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = await _events(client, **kwargs)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-3)
    assert events[-1].response.metadata == {"app": "tests", "turn": "1"}


async def test_metadata_with_a_lone_surrogate_streams_as_it_answers_whole(client) -> None:
    """JSON's escape of half an emoji (which no SDK encodes, but a raw client may send) in echoed metadata: a
    stream writes it escaped, as the whole answer does, rather than failing at its first event."""
    import aiohttp

    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 2, "metadata": {"k": "a\ud800"}}
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            async with http.post(f"{client.base_url}responses", data=json.dumps({**body, "stream": stream})) as r:
                assert r.status == 200, await r.text()
                text = await r.text()
            last = json.loads(text if not stream else text.rstrip().split("data: ")[-1])
            last = last if not stream else last["response"]
            assert last["object"] == "response" and last["metadata"] == {"k": "a\ud800"}, last


async def test_include_turns_the_logprobs_on_and_top_logprobs_alone_does_not(client) -> None:
    """As OpenAI's: `include: ["message.output_text.logprobs"]` asks for them (with no alternatives unless
    `top_logprobs` says how many); `top_logprobs` alone returns none."""
    kwargs = dict(model=MODEL, input="Name a colour.", max_output_tokens=3, temperature=0)
    included = await client.responses.create(**kwargs, include=["message.output_text.logprobs"])
    part = included.output[0].content[0]
    assert len(part.logprobs) == included.usage.output_tokens == 3 and all(not lp.top_logprobs for lp in part.logprobs)
    alone = await client.responses.create(**kwargs, top_logprobs=3)
    assert alone.output[0].content[0].logprobs == [] and alone.output_text == included.output_text
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**kwargs, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"


def test_a_stream_whose_engine_request_fails_ends_in_response_failed_with_the_error() -> None:
    from types import SimpleNamespace

    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.openai.errors import ApiError
    from gateway.openai.responses import ResponsesAnswer, parse_responses

    asked = parse_responses({"model": MODEL, "input": "hi", "stream": True, "metadata": {"a": "b"}})
    pool = SimpleNamespace(name="chat")
    answer = ResponsesAnswer(None, asked.chat, [(pool, [1, 2])], placed={"chat": SimpleNamespace(replica=0)},
                             received=0.0, metrics=GatewayMetrics(), asked=asked)
    events: list[dict] = []
    answer._queue = lambda obj, event=None: events.append(obj)
    answer._text_delta("Hel", [])
    answer.error = ApiError(500, "the device worker failed to handle it", type="server_error", code="request_failed")
    answer._final = answer._finished()
    answer._queue_tail()
    assert [e["type"] for e in events][-2:] == ["response.output_item.done", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error", "message": "request_failed: the device worker failed to handle it"}
    assert failed["output"][0]["content"][0]["text"] == "Hel" and failed["metadata"] == {"a": "b"}
    openai.types.responses.Response.model_validate(failed)   # the SDK's type: its error codes are OpenAI's own
    answer.error = ApiError(400, "input: too long", code="context_length_exceeded")
    assert answer._response("failed", [])["error"] == {
        "code": "invalid_prompt", "message": "context_length_exceeded: input: too long"}


def _items(pieces: list[str], stream: bool, finish: str, logprobs: bool = False) -> list[tuple]:
    """The output items of a Response whose reply arrives in `pieces` (a template without tools of its own:
    the hermes format), streamed (its events' items) or whole; `logprobs`: asked for (piece k is token k), a
    message's given as the token ids they are of, each streamed message's checked against its deltas'."""
    from types import SimpleNamespace

    from engine.outputs import RequestDelta, SampleDelta
    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.openai.responses import ResponsesAnswer, parse_responses

    include = {"include": ["message.output_text.logprobs"]} if logprobs else {}
    asked = parse_responses({"model": MODEL, "input": "hi", "stream": stream, "tools": [WEATHER], **include})
    pool = SimpleNamespace(name="chat", tokenizer=SimpleNamespace(chat_template_source=lambda use_tools: ""),
                           token_text=str, token_bytes=None)
    answer = ResponsesAnswer(None, asked.chat, [(pool, [1, 2])], placed={"chat": SimpleNamespace(replica=0)},
                             received=0.0, metrics=GatewayMetrics(), asked=asked)
    events: list[dict] = []
    answer._queue = lambda obj, event=None: events.append(obj)
    for k, piece in enumerate(pieces, 1):
        end = finish if k == len(pieces) else None
        chunks = answer._apply(0, RequestDelta("r", [SampleDelta(0, piece, [k], k, end, None, [-0.5], [[]])],
                                               end is not None))
        if chunks:
            answer._queue_chunk(chunks)
    final = answer._finished()
    if stream:
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert sorted(json.dumps(i, sort_keys=True) for i in done) == \
            sorted(json.dumps(i, sort_keys=True) for i in final["output"])
        for item in (i for i in done if i["type"] == "message"):
            deltas = [lp for e in events if e["type"] == "response.output_text.delta" and e["item_id"] == item["id"]
                      for lp in e["logprobs"]]
            assert item["content"][0]["logprobs"] == deltas, (item, deltas)
    return [(i["type"], i.get("name") or i["content"][0]["text"], i.get("arguments"), i["status"])
            + ((tuple(int(lp["token"]) for lp in i["content"][0]["logprobs"]),) if logprobs and "content" in i else ())
            for i in final["output"]]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_text_around_a_call_is_the_same_items_streamed_or_whole_however_the_reply_arrives(finish) -> None:
    """The text before a call is one message (completed: the call follows it), the text after it another
    after the call (the Response's status), streamed in any pieces or whole (the whole answer merged them
    into one message before the call; a stream that got them in one chunk did too, one that did not made
    two, and its first was `incomplete` when max_output_tokens ended the reply)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    reply = "Sure. " + call + " after that."
    whole = _items([reply], stream=False, finish=finish)
    status = "completed" if finish == "stop" else "incomplete"
    assert whole == [("message", "Sure.", None, "completed"),
                     ("function_call", "get_weather", '{"city": "Oslo", "unit": "celsius"}', "completed"),
                     ("message", "after that.", None, status)]
    for pieces in ([reply], list(reply), [reply[:3], reply[3:40], reply[40:]], [reply[:-5], reply[-5:]]):
        assert _items(pieces, stream=True, finish=finish) == whole, pieces
    assert _items(["\n" + call], stream=True, finish=finish) == _items(["\n" + call], stream=False, finish=finish) \
        == whole[1:2]
    # With logprobs: the message after the call has none (a token of it may hold the call's markup), as the whole
    # answer's; the one before it has its own tokens' when streamed, where each came as the text did.
    pieces = [reply[:6], reply[6:-12], reply[-12:]]
    streamed = _items(pieces, stream=True, finish=finish, logprobs=True)
    assert [item[-1] for item in streamed if item[0] == "message"] == [(1,), ()]


def test_a_call_cut_by_max_output_tokens_after_other_text_is_incomplete_streamed_as_whole() -> None:
    """A reply cut inside its second call, with text between the calls: the cut call is `incomplete` in the
    stream as in the whole answer (the stream closed it `completed` when text came after the first call)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    reply = call + ' and <tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    whole = _items([reply], stream=False, finish="length")
    assert [item[-1] for item in whole if item[0] == "function_call"] == ["completed", "incomplete"], whole
    for pieces in ([reply], [reply[:50], reply[50:]], [reply[:len(call) + 3], reply[len(call) + 3:]]):
        assert _items(pieces, stream=True, finish="length") == whole, pieces


def test_calls_and_their_outputs_pair_as_openai_requires() -> None:
    """An output answers a call before it, this turn's or a kept earlier turn's; a call is answered by an output
    after it. Else OpenAI's 400 naming `input` (an output answering nothing became a tool turn of its own, a
    call left unanswered an assistant turn whose result never came)."""
    from gateway.openai.errors import ApiError
    from gateway.openai.responses import parse_responses

    asked = {"type": "message", "role": "user", "content": "Weather in Paris?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}
    body = {"model": MODEL, "tools": [WEATHER]}
    for items, prior in (([asked, call, output], []), ([output], [asked, call])):
        roles = [m["role"] for m in parse_responses({**body, "input": items}, prior=prior).chat.messages]
        assert roles == ["user", "assistant", "tool"]
    no_call, no_output = "No tool call found for function call output with call_id {}.", \
        "No tool output found for function call {}."
    for items, prior, message in (
            ([asked, {**output, "call_id": "call_2"}], [], no_call.format("call_2")),
            ([asked, output, call], [], no_call.format("call_1")),                       # the output before its call
            ([{**output, "call_id": "call_9"}], [asked, call], no_call.format("call_9")),
            ([asked, call, {"role": "user", "content": "Never mind."}], [], no_output.format("call_1")),
            ("Never mind.", [asked, call], no_output.format("call_1"))):               # the kept turn's call
        with pytest.raises(ApiError) as info:
            parse_responses({**body, "input": items}, prior=prior)
        assert (info.value.status, info.value.param, info.value.message) == (400, "input", message), items
    for items, prior, kind in (([call, output], [asked, call], "function_call"),   # the kept call sent again
                               ([asked, call, call, output], [], "function_call"),
                               ([output], [asked, call, output], "function_call_output")):
        with pytest.raises(ApiError) as info:   # it was one call twice in the prompt, or one answer twice
            parse_responses({**body, "input": items}, prior=prior)
        assert (info.value.status, info.value.param) == (400, "input")
        assert info.value.message.startswith(f"Duplicate item found with call_id call_1: a {kind} "), items
    kept = [asked, call, call, output]   # a conversation kept with such a pair is continued as it is
    assert parse_responses({**body, "input": "Thanks."}, prior=kept).chat.messages[-1]["content"] == "Thanks."


def test_a_turn_that_says_something_then_calls_is_one_assistant_turn() -> None:
    """The output of a reply that thinks, writes and calls ([reasoning, message, function_call]), sent back as
    input, is the one assistant turn the model wrote, not a text turn and a call turn."""
    from gateway.openai.responses import parse_responses

    turn = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    messages = parse_responses({"model": MODEL, "tools": [WEATHER], "input": turn}).chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Let me check." and messages[1]["reasoning_content"] == "Need the weather."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1"]


def test_the_response_says_the_requests_own_instructions_never_a_system_message_of_its_input() -> None:
    from gateway.openai.responses import parse_responses, response_object

    system = {"role": "system", "content": "From the input."}
    first = parse_responses({"model": MODEL, "input": [system, {"role": "user", "content": "Hi."}]})
    later = parse_responses({"model": MODEL, "input": "Again."},
                            prior=first.items + [{"type": "message", "role": "assistant", "content": "Hello."}])
    own = parse_responses({"model": MODEL, "instructions": "Be terse.", "input": "Hi."},
                          prior=first.items + [{"type": "message", "role": "assistant", "content": "Hello."}])
    assert [response_object(asked, "resp_1", 0.0, "completed", [])["instructions"] for asked in (first, later, own)] \
        == [None, None, "Be terse."]
    assert own.chat.messages[:2] == [{"role": "system", "content": "Be terse."}, system]
