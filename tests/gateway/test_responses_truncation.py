"""The Responses API's `truncation: "auto"` (`gateway.openai.truncation`): a conversation longer than the pool's
context drops its earliest whole turns, the fewest that let it fit with room for `max_output_tokens`; the
default `disabled` answers it with OpenAI's 400."""

from __future__ import annotations

import openai
import pytest

from gateway.openai.truncation import turn_starts
from tests.gateway.conftest import chat_pool_yaml, start_gateway

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _conversation(turns: int) -> list[dict]:
    """`turns` user questions, each answered, then one more question: ~20 tokens a message."""
    items = []
    for t in range(turns):
        items.append({"role": "user", "content": f"Question {t}: " + " ".join(WORDS[(t + k) % 10] for k in range(12))})
        items.append({"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"Answer {t}: " + " ".join(WORDS[(t * 3 + k) % 10] for k in range(12))}]})
    return items + [{"role": "user", "content": "And the last question?"}]


@pytest.fixture
async def served(aiohttp_client, tmp_path, tiny_model):
    client, _ = await start_gateway(aiohttp_client, tmp_path, chat_pool_yaml(tiny_model, max_model_len=192))
    return client


async def _create(client, **body):
    r = await client.post("/v1/responses", json={"max_output_tokens": 8, "temperature": 0,
                                                 "store": False, **body})
    return r.status, await r.json()


async def test_auto_drops_the_fewest_earliest_turns_and_disabled_refuses(served, tiny_model):
    model = tiny_model.name
    items = _conversation(8)
    status, body = await _create(served, model=model, input=items)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "input"
    status, body = await _create(served, model=model, input=items, truncation="auto")
    assert status == 200, body
    response = openai.types.responses.Response.model_validate(body)
    assert response.truncation == "auto" and response.status in ("completed", "incomplete")
    assert response.usage.input_tokens + 8 <= 192
    fits = None   # the fewest leading turns (two items each) whose dropping lets the rest fit, found from outside
    for dropped in range(1, 9):
        status, alone = await _create(served, model=model, input=items[2 * dropped:])
        if status == 200:
            fits = alone
            break
    assert fits is not None and fits["truncation"] == "disabled"
    assert response.usage.input_tokens == fits["usage"]["input_tokens"]   # that many dropped, not more
    status, body = await _create(served, model=model, input=items[-1]["content"] + " word" * 300, truncation="auto")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"   # the last turn alone is too long


def test_a_turn_is_a_user_message_and_what_answers_it_calls_and_outputs_included():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                {"role": "user", "content": "q3"}]
    assert turn_starts(messages) == (1, [1, 5, 7])
    assert turn_starts([{"role": "user", "content": "q"}]) == (0, [0])


async def test_a_kept_conversation_that_outgrew_the_context_goes_on_under_auto(aiohttp_client, tmp_path, tiny_model):
    """An agent's loop continues a kept response turn after turn (`previous_response_id`): once the conversation
    outgrows the context, `auto` drops its earliest turns from the prompt; the conversation kept stays whole."""
    (tmp_path / "data").mkdir()
    client, _ = await start_gateway(aiohttp_client, tmp_path, chat_pool_yaml(tiny_model, max_model_len=192),
                                    data_dir=tmp_path / "data")
    previous, sizes = None, []
    for turn in range(6):
        status, body = await _create(client, model=tiny_model.name, store=True, previous_response_id=previous,
                                     truncation="auto", input=_conversation(1)[0]["content"] + f" ({turn})")
        assert status == 200, body
        previous = body["id"]
        sizes.append(body["usage"]["input_tokens"])
    assert sizes[:4] == sorted(set(sizes[:4])) and max(sizes) + 8 <= 192   # it grew, then was cut to fit
    items = await (await client.get(f"/v1/responses/{previous}/input_items", params={"limit": 100})).json()
    assert len(items["data"]) == 2 * 6 - 1   # each turn's question and answer, but the last answer: all kept
    status, body = await _create(client, model=tiny_model.name, store=True, previous_response_id=previous,
                                 input="one more")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"   # disabled: the whole conversation
