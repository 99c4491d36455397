"""Kept responses through the unchanged `openai` SDK against a live `cliffguard serve` (builtin SmolLM2):
a conversation continued by `previous_response_id` (its second turn served from the prefix cache),
retrieve and delete, another key's view, background runs polled and cancelled, and what survives a
gateway restart."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
import urllib.request

import openai
import pytest

from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer

MODEL = "smollm2-135m-instruct"


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
    first = await client.responses.create(input="My name is Ada and I like green. Say hello.", max_output_tokens=12,
                                          **kwargs)
    assert first.store and first.previous_response_id is None
    second = await client.responses.create(input="What is my name?", previous_response_id=first.id,
                                           max_output_tokens=8, **kwargs)
    assert second.previous_response_id == first.id
    # the first turn (its input and its answer) is in the second's prompt, and its blocks were cached
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    events = [e async for e in await client.responses.create(input="And my colour?", previous_response_id=second.id,
                                                             max_output_tokens=8, stream=True, **kwargs)]
    third = events[-1].response   # response.completed, or .incomplete when 8 tokens cut it
    kept = await client.responses.retrieve(third.id)   # a streamed answer is kept before its last event
    assert (kept.output_text, kept.previous_response_id, kept.usage.input_tokens) == (
        third.output_text, second.id, third.usage.input_tokens)
    assert third.usage.input_tokens > second.usage.input_tokens
    # another key sees nothing of it, and cannot continue it
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
