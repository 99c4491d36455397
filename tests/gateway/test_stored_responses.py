"""Kept responses through the unchanged `openai` SDK against a live `cliffguard serve` (builtin SmolLM2):
a conversation continued by `previous_response_id` (its second turn served from the prefix cache),
retrieve and delete, another key's view, background runs polled and cancelled, and what survives a
gateway restart. In process: a background request refused before it is kept, a turn that never ran not
continued, a kept response's stream refused, and responses an upstream pool answers (a background one kept
as it was asked, the earlier turns relayed in the input shape vLLM reads)."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
import urllib.request
from typing import Union

import openai
import pytest
from aiohttp import web
from openai.types.responses import ResponseInputItemParam, ResponseOutputItem
from pydantic import TypeAdapter, ValidationError

from gateway.app import create_app
from gateway.openai.errors import ApiError
from gateway.openai.stored_responses import RESPONSES
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer, chat_pool_yaml, pools_yaml

MODEL = "smollm2-135m-instruct"
FRONT = "front-model"
# what vLLM's ResponsesRequest reads as `input` items (ResponseInputOutputItem)
INPUT_ITEMS = TypeAdapter(list[Union[ResponseInputItemParam, ResponseOutputItem]])


def _client(server, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


async def _settled(client, response_id: str, timeout: float = 60):
    """The response once it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout
    while (response := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        await asyncio.sleep(0.1)
    return response


def _aborted(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r'^cliffguard_num_aborted_requests_total\{[^}]*\} (\S+)', text, re.M))


async def test_a_conversation_continues_from_its_kept_turns_and_hits_the_prefix_cache(live_builtin_server) -> None:
    client, other = _client(live_builtin_server), _client(live_builtin_server, "key-b")
    kwargs = dict(model=MODEL, instructions="You are terse.", temperature=0)
    first = await client.responses.create(input="My name is Ada and I like green. Say hello.", max_output_tokens=6,
                                          **kwargs)
    assert first.store and first.previous_response_id is None
    second = await client.responses.create(input="What is my name?", previous_response_id=first.id,
                                           max_output_tokens=4, **kwargs)
    assert second.previous_response_id == first.id
    # the first turn (its input and its answer) is in the second's prompt, and its blocks were cached
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    events = [e async for e in await client.responses.create(input="And my colour?", previous_response_id=second.id,
                                                             max_output_tokens=4, stream=True, **kwargs)]
    third = events[-1].response   # response.completed, or .incomplete when 4 tokens cut it
    kept = await client.responses.retrieve(third.id)   # a streamed answer is kept before its last event
    assert (kept.output_text, kept.previous_response_id, kept.usage.input_tokens) == (
        third.output_text, second.id, third.usage.input_tokens)
    assert third.usage.input_tokens > second.usage.input_tokens
    # its input items as the SDK reads them (ResponseItem): the earlier turns' first, the last one first by default
    items = [item async for item in client.responses.input_items.list(third.id, limit=2)]   # pages of 2
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
        ("message", "user")]
    assert [item.content[0].text for item in items[::2]] == [
        "And my colour?", "What is my name?", "My name is Ada and I like green. Say hello."]
    assert [item.content[0].text for item in items[1::2]] == [second.output_text, first.output_text]
    ascending = await client.responses.input_items.list(third.id, order="asc", after=items[-1].id)
    assert [item.id for item in ascending.data] == [item.id for item in items[-2::-1]] and not ascending.has_more
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.input_items.list(third.id, after="msg_nothing")
    assert info.value.body["param"] == "after"
    # another key sees nothing of it, and cannot continue it
    with pytest.raises(openai.NotFoundError):
        await other.responses.input_items.list(third.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        await other.responses.create(input="hi", previous_response_id=first.id, max_output_tokens=2, **kwargs)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(first.id)
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    unkept = await client.responses.create(input="hi", store=False, max_output_tokens=2, **kwargs)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unkept.id)


async def test_an_item_reference_brings_a_kept_item_into_a_new_conversation(live_builtin_server) -> None:
    """`{"type": "item_reference", "id"}` inputs: an input item by the id the input_items list gave it and an
    output item by its own id, in their places, make the prompt that `previous_response_id` makes; another
    key's item, an unknown id, and a deleted response's item are 400s naming `input[i].id`."""
    client, other = _client(live_builtin_server), _client(live_builtin_server, "key-b")
    kwargs = dict(model=MODEL, temperature=0)
    first = await client.responses.create(input="My name is Ada. Say hello.", max_output_tokens=6, **kwargs)
    (asked,) = [item async for item in client.responses.input_items.list(first.id)]
    answer = first.output[-1]
    second = await client.responses.create(input=[{"type": "item_reference", "id": asked.id},
                                                  {"type": "item_reference", "id": answer.id},
                                                  {"role": "user", "content": "What is my name?"}],
                                           max_output_tokens=4, **kwargs)
    items = [item async for item in client.responses.input_items.list(second.id, order="asc")]
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert [item.content[0].text for item in items[:2]] == ["My name is Ada. Say hello.", first.output_text]
    continued = await client.responses.create(input="What is my name?", previous_response_id=first.id,
                                              max_output_tokens=4, **kwargs)
    assert second.usage.input_tokens == continued.usage.input_tokens   # the same prompt
    for who, ref in ((other, answer.id), (other, asked.id), (client, "msg_nothing")):
        with pytest.raises(openai.BadRequestError) as info:
            await who.responses.create(input=[{"role": "user", "content": "hi"}, {"type": "item_reference",
                                                                                  "id": ref}],
                                       max_output_tokens=2, **kwargs)
        assert info.value.body["param"] == "input[1].id", info.value.body
    await client.responses.delete(first.id)
    for ref in (answer.id, asked.id):
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(input=[{"type": "item_reference", "id": ref}], max_output_tokens=2,
                                          **kwargs)
        assert info.value.body["param"] == "input[0].id", info.value.body


def test_every_kind_of_kept_input_item_lists_as_the_sdk_reads_it() -> None:
    """A call, its result, a reasoning item, a message of parts, a developer message: each a `ResponseItem`
    with the id of its place (the same on every call)."""
    from openai.types.responses import ResponseItem

    from gateway.openai.input_items import item_view

    kept = [{"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    views = [TypeAdapter(ResponseItem).validate_python(item_view(item, "resp_x1", i)) for i, item in enumerate(kept)]
    assert [(v.type, v.id) for v in views] == [
        ("message", "msg_x1_0"), ("message", "msg_x1_1"), ("reasoning", "rs_x1_2"), ("function_call", "fc_x1_3"),
        ("function_call_output", "fco_x1_4"), ("message", "msg_x1_5")]
    assert views[0].role == "developer" and views[0].content[0].text == "Be brief."
    assert views[2].content[0].text == "Call the tool." and views[4].output == "sunny"
    assert views[5].content[0].text == "Sunny." and views[5].content[0].annotations == []

    # the other shapes a request may send them in: each listed in its role's own (strictly validated)
    sent = [{"type": "reasoning", "content": "Think.", "summary": "Thought."},
            {"role": "assistant", "content": [{"type": "input_text", "text": "Earlier."}]},
            {"role": "user", "content": [{"type": "output_text", "text": "Quoted."}, {"type": "text", "text": "Hi"}]},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "output_text", "text": "ok"}]}]
    views = [TypeAdapter(ResponseItem).validate_python(item_view(item, "resp_x2", i), strict=True)
             for i, item in enumerate(sent)]
    assert [p.text for p in views[0].content] == ["Think."] and [p.text for p in views[0].summary] == ["Thought."]
    assert views[1].content[0].type == "output_text" and views[1].content[0].annotations == []
    assert [(p.type, p.text) for p in views[2].content] == [("input_text", "Quoted."), ("input_text", "Hi")]
    assert [(p.type, p.text) for p in views[3].output] == [("input_text", "ok")]


def test_a_kept_answer_comes_back_as_the_next_turns_input_with_its_text_only() -> None:
    """What a chain of responses keeps of an earlier answer is what the next prompt reads: no logprobs (up to
    20 alternatives a token, which every later turn would keep again), no annotations."""
    from gateway.openai.response_endpoints import _as_input

    logprob = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}
    item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [
        {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": [logprob]}]}
    back = _as_input(item)
    assert back == {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}


async def test_a_background_response_is_polled_to_its_end_or_cancelled(live_builtin_server) -> None:
    client = _client(live_builtin_server)
    queued = await client.responses.create(model=MODEL, input="Name a colour.", background=True, max_output_tokens=8,
                                           temperature=0, metadata={"job": "short"})
    assert queued.status == "queued" and queued.background and queued.output == []
    done = await _settled(client, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens <= 8
    assert done.id == queued.id and done.metadata == {"job": "short"}
    assert (await client.responses.cancel(done.id)).status == done.status   # finished: returned as it is

    aborted = _aborted(live_builtin_server)
    story = await client.responses.create(model=MODEL, input="Write a very long story about the sea.", background=True,
                                          max_output_tokens=4000, temperature=0)
    while (await client.responses.retrieve(story.id)).status == "queued":
        await asyncio.sleep(0.05)
    cancelled = await client.responses.cancel(story.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 10
    while _aborted(live_builtin_server) < aborted + 1:   # its engine request was aborted (KV freed)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    assert (await client.responses.retrieve(story.id)).status == "cancelled"   # a late end does not undo it

    plain = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.cancel(plain.id)
    assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_unknown")
    assert (await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)).status == "incomplete"


@pytest.mark.slow   # 16 s: two servers of the builtin model; in process, the restart tests below run by default
def test_kept_responses_and_a_background_run_survive_a_gateway_restart(tmp_path) -> None:
    args = ["--data-dir", str(tmp_path)]
    with LiveServer(DEFAULT_CONFIG, args=args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
        kept = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0)
        running = client.responses.create(model=MODEL, input="Write a long story about a fox.", background=True,
                                          max_output_tokens=120, temperature=0)
        while client.responses.retrieve(running.id).status == "queued":
            time.sleep(0.05)
    with sqlite3.connect(tmp_path / "batches.sqlite3") as db:   # the gateway stopped under it
        assert db.execute("SELECT status FROM responses WHERE id=?", (running.id,)).fetchone() == ("in_progress",)
    with LiveServer(DEFAULT_CONFIG, args=args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
        again = client.responses.retrieve(kept.id)
        assert (again.output_text, again.usage.input_tokens) == (kept.output_text, kept.usage.input_tokens)
        deadline = time.monotonic() + 120
        while (resumed := client.responses.retrieve(running.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert resumed.status in ("completed", "incomplete") and resumed.output_text   # run again after the restart
        other = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(kept.id)


def _sdk(client, key: str = "key-a") -> openai.AsyncOpenAI:
    """The openai SDK on an in-process app (`aiohttp_client`)."""
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


def _num_kept(data_dir) -> int:
    with sqlite3.connect(data_dir / "batches.sqlite3") as db:
        return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]


async def _no_worker(aiohttp_client, tmp_path, tiny_model, gateway_keys: str = "",
                     apps: list | None = None) -> tuple[openai.AsyncOpenAI, list[str]]:
    """(the SDK on an app with a data dir over local pools of the tiny model and no device worker, the ids of the
    background runs started): the first run fails (503) before any output, the next ones run until cancelled.
    `gateway_keys`: more keys of the YAML's `gateway` section ("key: value, "); `apps` gets the app."""
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model).replace("gateway: {", "gateway: {" + gateway_keys, 1))
    gateway = Gateway.from_config(load_config(path))
    gateway.engines = {}      # no device worker: a background run's answer is `answered`
    app = create_app(gateway, data_dir=tmp_path)
    runs: list[str] = []

    async def answered(stored):
        runs.append(stored.id)
        if len(runs) == 1:
            raise ApiError(503, "no replica is up", type="server_error", code="engine_dead")
        await asyncio.Event().wait()

    app[RESPONSES]._answer = answered
    if apps is not None:
        apps.append(app)
    return _sdk(await aiohttp_client(app)), runs


async def test_a_background_request_is_refused_as_a_foreground_one_before_it_is_kept(aiohttp_client, tmp_path,
                                                                                    tiny_model) -> None:
    """An unknown model, a prompt over every pool's context, max_output_tokens past it, a schema the grammar
    library cannot enforce: the same 4xx as in the foreground, not `queued` then `failed`; nothing kept or run."""
    sdk, runs = await _no_worker(aiohttp_client, tmp_path, tiny_model)
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}
    for extra, error, param in (({"model": "no-such-model"}, openai.NotFoundError, "model"),
                                ({"input": "hi " * 2000}, openai.BadRequestError, "input"),
                                ({"max_output_tokens": 100_000}, openai.BadRequestError, "max_output_tokens"),
                                ({"text": {"format": {"type": "json_schema", "name": "b", "schema": broken}}},
                                 openai.BadRequestError, "text.format")):
        with pytest.raises(error) as info:
            await sdk.responses.create(**{"model": tiny_model.name, "input": "hi", "background": True, **extra})
        assert info.value.body["param"] == param, info.value.body
    assert runs == [] and _num_kept(tmp_path) == 0


async def test_a_response_that_failed_or_was_cancelled_before_any_output_is_not_continued(aiohttp_client, tmp_path,
                                                                                         tiny_model) -> None:
    """Its input never ran: there is no turn to continue, and each new turn would carry that input on (a chain
    of them grew a row without bound)."""
    sdk, runs = await _no_worker(aiohttp_client, tmp_path, tiny_model)
    failed = await _settled(sdk, (await sdk.responses.create(model=tiny_model.name, input="hi", background=True)).id)
    assert failed.status == "failed" and failed.output == []
    running = await sdk.responses.create(model=tiny_model.name, input="hi", background=True)
    while len(runs) < 2:
        await asyncio.sleep(0.01)
    assert (await sdk.responses.cancel(running.id)).status == "cancelled"
    for previous in (failed.id, running.id):
        for background in (True, False):
            with pytest.raises(openai.BadRequestError) as info:
                await sdk.responses.create(model=tiny_model.name, input="again", previous_response_id=previous,
                                           background=background)
            assert info.value.body["param"] == "previous_response_id", info.value.body
    assert len(runs) == 2 and _num_kept(tmp_path) == 2


async def test_a_run_cancelled_by_a_forced_stop_stays_unfinished_for_the_next_start(aiohttp_client, tmp_path,
                                                                                    tiny_model) -> None:
    """A second Ctrl-C cancels every task before the kept responses are stopped: a run cancelled so was not
    cancelled by its client; it stays unfinished (here `queued`: the stand-in run is never admitted), and the next
    start runs it again (it was kept `cancelled`)."""
    apps: list = []
    sdk, runs = await _no_worker(aiohttp_client, tmp_path, tiny_model, apps=apps)
    await _settled(sdk, (await sdk.responses.create(model=tiny_model.name, input="hi", background=True)).id)
    running = await sdk.responses.create(model=tiny_model.name, input="hi", background=True)
    while len(runs) < 2:
        await asyncio.sleep(0.01)
    task = apps[0][RESPONSES]._runs[running.id]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (await sdk.responses.retrieve(running.id)).status == "queued"


async def test_a_run_in_progress_as_its_gateway_stopped_reads_queued_again_at_the_next_start(aiohttp_client, tmp_path,
                                                                                              tiny_model) -> None:
    """The next start runs it again: until admitted there, it waits for its device and credits, as `queued`."""
    sdk, runs = await _no_worker(aiohttp_client, tmp_path, tiny_model)
    await _settled(sdk, (await sdk.responses.create(model=tiny_model.name, input="hi", background=True)).id)
    running = await sdk.responses.create(model=tiny_model.name, input="hi", background=True)
    while len(runs) < 2:
        await asyncio.sleep(0.01)
    with sqlite3.connect(tmp_path / "batches.sqlite3") as db:   # admitted, as a replica's answer marks it
        db.execute("UPDATE responses SET status='in_progress', response=json_set(response, '$.status', "
                   "'in_progress') WHERE id=?", (running.id,))
    assert (await sdk.responses.retrieve(running.id)).status == "in_progress"
    gateway = Gateway.from_config(load_config(tmp_path / "pools.yaml"))   # the next gateway, on the same data dir
    gateway.engines = {}
    app = create_app(gateway, data_dir=tmp_path)
    resumed: list[str] = []

    async def waiting(stored):   # never admitted
        resumed.append(stored.id)
        await asyncio.Event().wait()

    app[RESPONSES]._answer = waiting
    again = _sdk(await aiohttp_client(app))
    while not resumed:
        await asyncio.sleep(0.01)
    assert resumed == [running.id] and (await again.responses.retrieve(running.id)).status == "queued"


async def test_an_api_key_may_have_so_many_background_responses_running_at_once(aiohttp_client, tmp_path,
                                                                                 tiny_model) -> None:
    """`gateway.stored_responses.max_background_per_owner` 2: a key's third queued or in progress is a 429
    naming `background`; another key's is not; one that ended (failed, cancelled) gives its place back."""
    sdk, runs = await _no_worker(aiohttp_client, tmp_path, tiny_model,
                                 "stored_responses: {max_background_per_owner: 2}, ")
    failed = await _settled(sdk, (await sdk.responses.create(model=tiny_model.name, input="hi", background=True)).id)
    assert failed.status == "failed"
    running = [await sdk.responses.create(model=tiny_model.name, input="hi", background=True) for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as info:
        await sdk.responses.create(model=tiny_model.name, input="hi", background=True)
    assert info.value.body["param"] == "background" and info.value.body["code"] == "rate_limit_exceeded"
    assert info.value.response.headers["x-should-retry"] == "false"   # the SDK does not retry it twice for nothing
    assert "max_background_per_owner (2)" in info.value.body["message"]
    other = await sdk.with_options(api_key="key-b").responses.create(model=tiny_model.name, input="hi",
                                                                      background=True)
    assert other.status == "queued"
    assert (await sdk.responses.cancel(running[0].id)).status == "cancelled"
    deadline = time.monotonic() + 10
    while True:   # its place is back once its run has ended
        try:
            again = await sdk.responses.create(model=tiny_model.name, input="hi", background=True)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    assert again.status == "queued" and _num_kept(tmp_path) == 5


async def test_a_background_response_waits_for_credits_past_its_pools_queue_limit(aiohttp_client, tmp_path,
                                                                                  tiny_model) -> None:
    """`max_queue_seconds: 0` (reject-when-full): with every credit held, a foreground request is a 429 at once;
    a background one stays queued (its client polls; it failed `pool_full` at once), then runs once they free."""
    path = tmp_path / "pools.yaml"
    path.write_text(chat_pool_yaml(tiny_model, extra="    max_queue_seconds: 0\n"))
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway, data_dir=tmp_path))
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.1)
    sdk, queue, release = _sdk(client), gateway.pools["chat"].admission, asyncio.Event()

    async def hold_every_credit() -> None:
        async with queue.hold("blocker", queue.free):
            await release.wait()

    blocker = asyncio.ensure_future(hold_every_credit())
    await asyncio.sleep(0.05)
    asked = {"model": tiny_model.name, "input": "hi", "max_output_tokens": 4}
    with pytest.raises(openai.RateLimitError):
        await sdk.responses.create(**asked)
    queued = await sdk.responses.create(**asked, background=True)
    await asyncio.sleep(0.5)
    assert (await sdk.responses.retrieve(queued.id)).status == "queued"   # waiting for credits: not in progress
    release.set()
    await blocker
    done = await _settled(sdk, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text, done


@pytest.fixture
async def upstream(aiohttp_server):
    """A vLLM-like upstream Responses server: it reads `input` as vLLM's request model does (`INPUT_ITEMS`; a
    400 otherwise) and answers a Response of its own (its id and time; the relayed body's `background`, `store`
    and `previous_response_id` echoed), a reasoning item and a message, whole or as a stream's events (one whose
    input says "Drop." ends before its last event, "Twice." sends that one twice, "Error." ends with an `error`
    event). The bodies it got, in order."""
    bodies: list[dict] = []

    async def responses(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        try:
            INPUT_ITEMS.validate_python(body["input"] if isinstance(body["input"], list) else [])
        except ValidationError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error",
                                                "param": "input", "code": None}}, status=400)
        reasoning = {"type": "reasoning", "id": "rs_up", "summary": [], "status": "completed",
                     "content": [{"type": "reasoning_text", "text": "Thinking."}]}
        message = {"type": "message", "id": "msg_up", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Answer.", "annotations": []}]}
        whole = {
            "id": "resp_upstream", "object": "response", "created_at": 1.0, "status": "completed",
            "model": body["model"], "output": [reasoning, message], "error": None, "incomplete_details": None,
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
            "background": body.get("background", False), "store": body.get("store", True),
            "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
            "instructions": body.get("instructions"), "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": True}
        if not body.get("stream"):
            return web.json_response(whole)
        running = {**whole, "status": "in_progress", "output": [], "usage": None}
        events = [("response.created", {"response": running}), ("response.in_progress", {"response": running}),
                  ("response.output_item.added", {"output_index": 0, "item": {**message, "status": "in_progress",
                                                                              "content": []}}),
                  ("response.output_text.delta", {"item_id": "msg_up", "output_index": 0, "content_index": 0,
                                                  "delta": "Answer.", "logprobs": []}),
                  ("response.output_item.done", {"output_index": 0, "item": message}),
                  ("response.completed", {"response": {**whole, "output": [message]}})]
        said = json.dumps(body["input"])
        events = events[:2] if "Drop." in said else events + events[-1:] if "Twice." in said else events
        if "Error." in said:
            events = events[:2] + [("error", {"code": "rate_limit_exceeded", "message": "Upstream busy.",
                                              "param": None})]
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for n, (kind, fields) in enumerate(events):
            data = json.dumps({"type": kind, "sequence_number": n, **fields})
            await stream.write(f"event: {kind}\ndata: {data}\n\n".encode())
        await stream.write_eof()
        return stream

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    return await aiohttp_server(app, host="127.0.0.1"), bodies


@pytest.fixture
async def relaying(aiohttp_client, tmp_path, upstream):
    """(the SDK on an app with a data dir whose one pool is `upstream`, the bodies the upstream got)."""
    server, bodies = upstream
    return _sdk(await _front(aiohttp_client, tmp_path, server.port)), bodies


async def _front(aiohttp_client, tmp_path, port: int):
    """A client of an app with a data dir whose one pool is the upstream on `port`, served as FRONT."""
    path = tmp_path / "front.yaml"
    path.write_text(f"""
pools:
  - name: remote
    upstream: http://127.0.0.1:{port}/v1
    model: upstream-model
    served_model_name: {FRONT}
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
""")
    return await aiohttp_client(create_app(Gateway.from_config(load_config(path)), data_dir=tmp_path))


async def test_a_background_response_an_upstream_pool_answered_is_kept_as_it_was_asked(relaying) -> None:
    sdk, _ = relaying
    queued = await sdk.responses.create(model=FRONT, input="First.", background=True, metadata={"job": "1"})
    first = await _settled(sdk, queued.id, timeout=10)
    assert first.status == "completed" and first.output_text == "Answer."
    assert (first.id, first.created_at, first.background, first.store, first.previous_response_id, first.metadata) \
        == (queued.id, queued.created_at, True, True, None, {"job": "1"})
    queued = await sdk.responses.create(model=FRONT, input="Second.", background=True, previous_response_id=first.id)
    second = await _settled(sdk, queued.id, timeout=10)
    assert (second.status, second.background, second.store, second.previous_response_id, second.created_at) == (
        "completed", True, True, first.id, queued.created_at), second.error


async def test_a_background_response_in_progress_at_its_upstream_when_the_gateway_stopped_is_not_sent_again(
        aiohttp_client, tmp_path, upstream) -> None:
    """The upstream had it (it went `in_progress` as it was sent): run again at the next start, it was sent a
    second time (paid twice, its tools run twice). It fails `upstream_disconnected`, as a batch line does."""
    server, bodies = upstream
    sdk = _sdk(await _front(aiohttp_client, tmp_path, server.port))
    done = await _settled(sdk, (await sdk.responses.create(model=FRONT, input="hi", background=True)).id)
    assert done.status == "completed" and len(bodies) == 1
    with sqlite3.connect(tmp_path / "batches.sqlite3") as db:   # as a stop left it: sent, not answered yet
        db.execute("UPDATE responses SET status='in_progress', response=json_set(response, '$.status', "
                   "'in_progress') WHERE id=?", (done.id,))
    again = _sdk(await _front(aiohttp_client, tmp_path, server.port))   # the next gateway, on the same data dir
    failed = await _settled(again, done.id)
    assert failed.status == "failed" and failed.error.code == "server_error", failed
    assert failed.error.message.startswith("upstream_disconnected: ") and "not sent again" in failed.error.message
    assert len(bodies) == 1


async def test_a_foreground_response_an_upstream_pool_answered_is_kept_and_continued(relaying) -> None:
    """The upstream is sent `store: false` and keeps nothing: its Response is kept here under an id of ours, so a
    later turn continues it (it came back under the upstream's id, unkept: the next turn's previous_response_id
    was a 400 `previous_response_not_found`, the chain broken wherever a conversation grew into an upstream pool)."""
    sdk, bodies = relaying
    first = await sdk.responses.create(model=FRONT, input="First.", metadata={"turn": "1"})
    assert first.id != "resp_upstream" and first.id.startswith("resp_") and first.store is True
    assert (first.output_text, first.metadata, first.background) == ("Answer.", {"turn": "1"}, False)
    assert bodies[-1]["store"] is False
    kept = await sdk.responses.retrieve(first.id)
    assert (kept.id, kept.output_text, kept.created_at) == (first.id, "Answer.", first.created_at)
    second = await sdk.responses.create(model=FRONT, input="Second.", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "Answer."
    assert [item.get("content") for item in bodies[-1]["input"] if item.get("role") == "user"][0] in (
        "First.", [{"type": "input_text", "text": "First."}])   # the first turn went along


async def test_a_streamed_response_an_upstream_pool_answered_is_kept_and_continued(relaying) -> None:
    """A stream an upstream answers is relayed event by event with the Response's fields the gateway's (its id,
    store, previous_response_id, metadata), and its last Response kept before that event goes out: it went by
    under the upstream's id, unkept, and the next turn's previous_response_id was a 400 (the Agents SDK's
    `run_streamed` broke on its second turn wherever the pool was an upstream)."""
    sdk, bodies = relaying
    events = [e async for e in await sdk.responses.create(model=FRONT, input="First.", stream=True,
                                                            metadata={"turn": "1"})]
    responses = [e.response for e in events if hasattr(e, "response")]
    first = responses[-1]
    assert [e.type for e in events][-1] == "response.completed" and len(responses) == 3
    assert {r.id for r in responses} == {first.id} and first.id.startswith("resp_") and first.id != "resp_upstream"
    assert all(r.store is True and r.metadata == {"turn": "1"} for r in responses) and first.output_text == "Answer."
    assert bodies[-1]["store"] is False and bodies[-1]["stream"] is True
    kept = await sdk.responses.retrieve(first.id)
    assert (kept.id, kept.status, kept.output_text, kept.created_at) == (first.id, "completed", "Answer.",
                                                                         first.created_at)
    events = [e async for e in await sdk.responses.create(model=FRONT, input="Second.", stream=True,
                                                            previous_response_id=first.id)]
    assert {e.response.previous_response_id for e in events if hasattr(e, "response")} == {first.id}
    assert [item.get("content") for item in bodies[-1]["input"] if item.get("role") == "user"][0] in (
        "First.", [{"type": "input_text", "text": "First."}])   # the first turn went along
    second = await sdk.responses.retrieve(events[-1].response.id)
    assert second.previous_response_id == first.id and second.output_text == "Answer."
    unkept = [e async for e in await sdk.responses.create(model=FRONT, input="Hi.", stream=True, store=False)]
    assert unkept[-1].response.store is False   # relayed as the upstream wrote it
    twice = [e async for e in await sdk.responses.create(model=FRONT, input="Twice.", stream=True)]
    assert [e.type for e in twice][-2:] == ["response.completed"] * 2   # the second not kept again (it cut the
    assert (await sdk.responses.retrieve(twice[-1].response.id)).status == "completed"   # stream, as a 2nd put)
    dropped = [e async for e in await sdk.responses.create(model=FRONT, input="Drop.", stream=True)]
    assert dropped[-1].type == "error" and dropped[-1].code == "upstream_disconnected"
    failed = await sdk.responses.retrieve(dropped[0].response.id)   # kept failed, as a local run that fails
    assert failed.status == "failed" and failed.error.message.startswith("upstream_disconnected"), failed.error
    errored = [e async for e in await sdk.responses.create(model=FRONT, input="Error.", stream=True)]
    assert errored[-1].type == "error" and errored[-1].message == "Upstream busy."
    failed = await sdk.responses.retrieve(errored[0].response.id)   # failed as the upstream said, not ours
    assert (failed.status, failed.error.code, failed.error.message) == ("failed", "rate_limit_exceeded",
                                                                        "Upstream busy."), failed.error


async def test_a_kept_stream_cut_by_the_drain_while_its_response_is_kept_ends_with_the_error_event(
        aiohttp_client, tmp_path, upstream, monkeypatch) -> None:
    """The drain's end cutting a relayed stream while its final Response is being kept (before that event went
    out): the client gets the `server_shutting_down` error event, where the stream ended with neither (the
    SDK's `get_final_response` raises on that); the Response stays kept, completed."""
    from gateway.app import GATEWAY
    from gateway.upstream.stream_seen import ResponseEdit

    keeping, real_init = asyncio.Event(), ResponseEdit.__init__

    def slow_init(self, own, keep, fail):
        async def slow_keep(response):
            keeping.set()
            await asyncio.sleep(0.5)
            return await keep(response)
        real_init(self, own, slow_keep, fail)

    monkeypatch.setattr(ResponseEdit, "__init__", slow_init)
    server, _ = upstream
    client = await _front(aiohttp_client, tmp_path, server.port)
    post = asyncio.ensure_future(client.post("/v1/responses", json={"model": FRONT, "input": "Hi.", "stream": True}))
    await asyncio.wait_for(keeping.wait(), 10)
    assert client.app[GATEWAY].cut_in_flight() == 1
    text = await asyncio.wait_for((await asyncio.wait_for(post, 5)).text(), 5)
    events = [json.loads(e.split("data: ", 1)[1]) for e in text.strip().split("\n\n")]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "server_shutting_down", events[-1]
    assert "response.completed" not in [e["type"] for e in events]
    await asyncio.sleep(0.6)   # the keeping, shielded from the cut, goes on
    kept = await client.get(f"/v1/responses/{events[0]['response']['id']}")   # its owner: no API key
    assert kept.status == 200 and (await kept.json())["status"] == "completed"


async def test_an_upstream_429_to_a_kept_foreground_response_is_relayed_with_its_retry_after(aiohttp_client,
                                                                                          aiohttp_server, tmp_path):
    """The kept path reads the upstream's answer itself: its 429 reaches the client with its status, error and
    Retry-After (which the openai SDK waits), not as a 500 or without the header."""
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Rate limit reached", "type": "requests", "param": None,
                                            "code": "rate_limit_exceeded"}}, status=429, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_post("/v1/responses", busy)
    client = await _front(aiohttp_client, tmp_path, (await aiohttp_server(app, host="127.0.0.1")).port)
    r = await client.post("/v1/responses", json={"model": FRONT, "input": "Hi."})
    assert r.status == 429 and r.headers["Retry-After"] == "7", await r.text()
    assert (await r.json())["error"]["code"] == "rate_limit_exceeded"


async def test_a_continued_conversation_reaches_an_upstream_pool_in_the_input_shape_it_reads(relaying) -> None:
    """The earlier turns' kept items (assistant messages and reasoning items kept without their ids) are relayed
    as input items vLLM's request model takes, in the background and in the foreground alike."""
    sdk, bodies = relaying
    first = await _settled(sdk, (await sdk.responses.create(model=FRONT, input="First.", background=True)).id, 10)
    own = [{"role": "user", "content": [{"type": "input_text", "text": "Second."}]}]
    second = await _settled(sdk, (await sdk.responses.create(model=FRONT, input=own, background=True,
                                                             previous_response_id=first.id)).id, 10)
    assert second.status == "completed", second.error
    third = await sdk.responses.create(model=FRONT, input="Third.", previous_response_id=second.id)
    assert third.output_text == "Answer."
    relayed = bodies[-1]["input"]
    INPUT_ITEMS.validate_python(relayed)
    assert [(item["type"], item.get("role")) for item in relayed] == [
        ("message", "user"), ("reasoning", None), ("message", "assistant"), ("message", "user"),
        ("reasoning", None), ("message", "assistant"), ("message", "user")]
    assert relayed[1]["content"] == [{"type": "reasoning_text", "text": "Thinking."}] and relayed[2]["content"] == \
        "Answer." and relayed[3]["content"] == [{"type": "input_text", "text": "Second."}]
    assert all(body["store"] is False and "previous_response_id" not in body and "background" not in body
               for body in bodies)


async def test_streaming_a_kept_response_is_a_400_naming_the_parameter(relaying) -> None:
    """The openai SDK's retrieve(stream=True) read the JSON answer as a stream of no events."""
    sdk, _ = relaying
    done = await _settled(sdk, (await sdk.responses.create(model=FRONT, input="hi", background=True)).id, 10)
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.retrieve(done.id, stream=True)
    assert info.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.retrieve(done.id, starting_after=3)
    assert info.value.body["param"] == "starting_after"
    assert (await sdk.responses.retrieve(done.id, stream=False)).output_text == done.output_text
