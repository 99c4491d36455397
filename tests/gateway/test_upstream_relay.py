"""What a relayed upstream answer tells the gateway and its client: the token counts of each API's usage
(counted once an answer), SSE fields read as the spec says (`data:x` is `data: x`), and the Responses
`error` event numbered after the stream's last. A raw upstream on 127.0.0.1 answers each request."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import ResponseErrorEvent

from tests.gateway.test_upstream_faults import (CHAT, CHUNKED, RESPONSE_CREATED, _assert_no_slot_held,
                                                _gateway_client, _reply, _serve)
from tests.gateway.test_upstream_connection import _raw_server
from tests.gateway.test_upstream_retry import FRONT

RESPONSES = {"model": FRONT, "input": "hi"}


def _chunk(usage: dict | None, content: str = "x") -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "upstream-model",
             "choices": [{"index": 0, "delta": {"content": content}}], "usage": usage}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _response_event(kind: str, sequence_number: int, usage: dict | None = None) -> bytes:
    event = {"type": kind, "sequence_number": sequence_number,
             "response": {"id": "resp_1", "model": "upstream-model", "usage": usage}}
    return f"event: {kind}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"


def _num_observed(histogram) -> float:
    return next(s.value for s in histogram._child_samples() if s.name == "_count")


def _assert_counted(gateway, prompt_tokens: int, generation_tokens: int) -> None:
    series = gateway.metrics.pool_series("remote")
    assert (series.prompt_tokens._value.get(), series.generation_tokens._value.get()) == (
        prompt_tokens, generation_tokens)


async def test_a_responses_answer_counts_its_input_and_output_tokens(aiohttp_client, tmp_path):
    answer = {"id": "resp_1", "object": "response", "status": "completed", "model": "upstream-model", "output": [],
              "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
    server, url = await _serve(lambda request: _reply(200, json.dumps(answer).encode()))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/responses", json=RESPONSES)
    assert r.status == 200 and (await r.json())["model"] == FRONT
    _assert_counted(gateway, 3, 1)
    server.close()


@pytest.mark.parametrize("usages", [[None, None, {"prompt_tokens": 7, "completion_tokens": 5}],
                                    [{"prompt_tokens": 7, "completion_tokens": n} for n in (1, 3, 5)]],
                         ids=["usage_chunk_last", "running_totals_in_every_chunk"])
async def test_a_chat_stream_counts_its_last_usage_once(aiohttp_client, tmp_path, usages):
    """OpenAI's `include_usage` sends the usage in a last chunk (null before it); vLLM's continuous usage
    stats send running totals in every chunk: either way the answer's tokens are counted once."""
    body = b"".join(_chunk(usage) for usage in usages) + b"data: [DONE]\n\n"
    server, url = await _serve(lambda request: _reply(200, body, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
    _assert_counted(gateway, 7, 5)
    server.close()


async def test_a_responses_stream_counts_its_final_responses_usage(aiohttp_client, tmp_path):
    body = (_response_event("response.created", 0) + _response_event("response.in_progress", 1)
            + _response_event("response.completed", 2, {"input_tokens": 3, "output_tokens": 2}))
    server, url = await _serve(lambda request: _reply(200, body, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert r.status == 200 and len(events) == 3 and events[-1].startswith("event: response.completed"), events
    _assert_counted(gateway, 3, 2)
    server.close()


async def test_time_to_first_token_of_a_relayed_responses_stream_is_its_first_output(aiohttp_client, tmp_path):
    """A Responses stream announces its Response (created, in_progress) before it generates: time to first
    token counts to its first output event, 0.4 s later here (it counted to response.created)."""
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"

    async def answer(writer, request, n):
        announced = _response_event("response.created", 0) + _response_event("response.in_progress", 1)
        writer.write(CHUNKED + chunk(announced))
        await writer.drain()
        await asyncio.sleep(0.4)
        delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", ' \
                b'"sequence_number": 2, "delta": "hi"}\n\n'
        writer.write(chunk(delta + _response_event("response.completed", 3)) + b"0\r\n\r\n")
        await writer.drain()

    server, url, _, _ = await _raw_server(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, str(url.with_path("/v1")))
    r = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    assert r.status == 200 and "response.output_text.delta" in await r.text()
    ttft = gateway.metrics.pool_series("remote").ttft
    assert _num_observed(ttft) == 1
    assert next(s.value for s in ttft._child_samples() if s.name == "_sum") >= 0.4
    server.close()


async def test_fields_without_the_space_after_their_colon_are_read(aiohttp_client, tmp_path):
    """`data:{...}` and `event:response.completed` are what `data: {...}` and `event: response.completed`
    are (the SSE spec makes the one space optional): renamed, timed, and the stream's end."""
    chat = _chunk({"prompt_tokens": 2, "completion_tokens": 1}).replace(b"data: ", b"data:") + b"data:[DONE]\n\n"
    completed = (_response_event("response.completed", 0, {"input_tokens": 3, "output_tokens": 2})
                 .replace(b"event: ", b"event:").replace(b"data: ", b"data:"))
    server, url = await _serve(lambda request: _reply(200, chat if b"messages" in request else completed,
                                                      "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 2, events
    assert json.loads(events[0].removeprefix("data: "))["model"] == FRONT
    r = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert len(events) == 1 and events[0].startswith("event:response.completed\ndata: "), events
    assert json.loads(events[0].split("data: ", 1)[1])["response"]["model"] == FRONT
    assert _num_observed(gateway.metrics.pool_series("remote").ttft) == 2
    _assert_counted(gateway, 2 + 3, 1 + 2)
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_responses_error_event_follows_the_streams_last_sequence_number(aiohttp_client, tmp_path):
    """openai-python's ResponseErrorEvent needs a `sequence_number`: ours is the one after the last relayed."""
    body = RESPONSE_CREATED + _response_event("response.in_progress", 1)
    server, url = await _serve(lambda request: (CHUNKED + b"%x\r\n" % len(body) + body + b"\r\n",))   # then drops
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert len(events) == 3 and events[-1].startswith("event: error\ndata: "), events
    error = ResponseErrorEvent.model_validate_json(events[-1].split("data: ", 1)[1])
    assert (error.sequence_number, error.code) == (2, "upstream_disconnected")
    _assert_no_slot_held(gateway)
    server.close()


async def test_a_responses_stream_ended_by_the_upstreams_own_error_event_gets_no_second_one(aiohttp_client, tmp_path):
    error = b'event: error\ndata: {"type": "error", "sequence_number": 1, "code": "x", "message": "m", "param": null}'
    body = RESPONSE_CREATED + error + b"\n\n"
    server, url = await _serve(lambda request: _reply(200, body, "text/event-stream"))
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert len(events) == 2 and json.loads(events[1].split("data: ", 1)[1])["code"] == "x", events
    _assert_no_slot_held(gateway)
    server.close()


def test_an_upstream_route_past_the_context_its_tokenizer_model_declares_is_refused_at_start(tmp_path, builtin_path):
    """An upstream pool without max_model_len is held to its tokenizer model's context (SmolLM2's 8192): a
    route starting there could never be taken, so the gateway does not start, naming the key; with the
    upstream's own max_model_len set, it routes such prompts."""
    from gateway.runtime import Gateway
    from pools.config.spec import SpecError
    from pools.config.yaml_file import load_config

    def gateway(*lines: str) -> Gateway:
        path = tmp_path / "pools.yaml"
        path.write_text("pools:\n  - name: remote\n    upstream: http://127.0.0.1:9/v1\n    model: m\n"
                        "    tokenizer: builtin:smollm2-135m-instruct\n" + "".join(f"    {x}\n" for x in lines))
        return Gateway.from_config(load_config(path))

    assert gateway().pools["remote"].max_model_len == 8192
    with pytest.raises(SpecError, match=r"pools\[0\]\.route\.min_prompt_tokens: 8192 .* pools\[0\]\.max_model_len"):
        gateway("route: {min_prompt_tokens: 8192}")
    assert gateway("route: {min_prompt_tokens: 8192}", "max_model_len: 32768").pools["remote"].admits(20_000)
    # a route's tail past the context (a 400 contradicting the YAML, a gap to the next pool's route): refused,
    # as a local pool's is
    with pytest.raises(SpecError, match=r"pools\[0\]\.route\.max_prompt_tokens: 9000 .*tail could never be taken"):
        gateway("route: {max_prompt_tokens: 9000}")
    with pytest.raises(SpecError, match=r"pools\[0\]\.route\.max_prompt_tokens: 4096 must be below max_model_len "
                                        r"4096: .* the route's tail is unreachable"):
        gateway("route: {max_prompt_tokens: 4096}", "max_model_len: 4096")
    assert gateway("route: {max_prompt_tokens: 4095}", "max_model_len: 4096").pools["remote"].admits(4095)
    # the upstream serves a quantized checkpoint (the engine would refuse it): its config still says the context
    import shutil

    quantized = tmp_path / "gptq"   # config and tokenizer files: an upstream pool's tokenizer reads no weights
    shutil.copytree(builtin_path, quantized, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    (quantized / "quantize_config.json").write_text('{"bits": 4}')
    path = tmp_path / "pools.yaml"
    path.write_text(f"pools:\n  - {{name: remote, upstream: 'http://127.0.0.1:9/v1', model: m, tokenizer: {quantized},"
                    " route: {max_prompt_tokens: 9000}}\n")
    with pytest.raises(SpecError, match=r"pools\[0\]\.route\.max_prompt_tokens: 9000 .*tail could never be taken"):
        Gateway.from_config(load_config(path))


async def test_a_tenants_priority_floor_holds_on_an_upstream_pool(aiohttp_client, tmp_path):
    """A tenant's `min_priority` clamps the `priority` an upstream pool gets, as a local pool's (the body went as
    sent: any key could jump a vLLM upstream's priority queue with -100), and is sent where the body has none;
    a tenant of the default floor (0) sends a worse priority as sent, a better one as 0, none as none."""
    from gateway.app import create_app
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config
    from tests.gateway.test_upstream_faults import _chat_answer

    sent = []

    def answer(request: bytes) -> bytes:
        sent.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
        return _reply(200, _chat_answer({"prompt_tokens": 3, "completion_tokens": 1}))

    server, url = await _serve(answer)
    path = tmp_path / "pools.yaml"
    path.write_text(f"""
pools:
  - name: remote
    upstream: {url}
    model: upstream-model
    served_model_name: {FRONT}
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
tenants:
  nightly: {{api_keys: [sk-n], min_priority: 10}}
  team: {{api_keys: [sk-t]}}
""")
    client = await aiohttp_client(create_app(Gateway.from_config(load_config(path))))
    chat = {"model": FRONT, "messages": [{"role": "user", "content": "hi"}]}
    for key, extra in (("sk-n", {"priority": -100}), ("sk-n", {}), ("sk-t", {"priority": -3}), ("sk-t", {}),
                       ("sk-t", {"priority": 5})):
        r = await client.post("/v1/chat/completions", json={**chat, **extra}, headers={"Authorization": f"Bearer {key}"})
        assert r.status == 200, await r.text()
    assert [body.get("priority") for body in sent] == [10, 10, 0, None, 5]
    server.close()


async def test_a_stream_asking_no_usage_gets_none_and_one_dropped_after_its_end_is_no_failure(aiohttp_client,
                                                                                              tmp_path):
    """The gateway asks the upstream for the usage it counts, not for running totals the client asked for
    without `include_usage` (a local pool sends none then); and a connection reset after `[DONE]` (its body's
    last chunk lost) ends an answer the client got whole: no 502 counted."""
    from tests.gateway.test_upstream_faults import CHUNKED

    asked: list[dict] = []
    usage = {"id": "c1", "object": "chat.completion.chunk", "model": "upstream-model", "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 1}}   # include_usage's last chunk
    events = _chunk(None, "x") + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"

    def answer(request: bytes):
        asked.append(json.loads(request.partition(b"\r\n\r\n")[2]))
        return (CHUNKED + b"%x\r\n" % len(events) + events + b"\r\n",)   # no last chunk: the connection is reset

    server, url = await _serve(answer)
    gateway, client = await _gateway_client(aiohttp_client, tmp_path, url)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                        "stream_options": {"continuous_usage_stats": True}})
    text = await r.text()
    assert r.status == 200 and text.endswith("data: [DONE]\n\n") and '"usage"' not in text.replace('"usage": null', "")
    assert asked[0]["stream_options"] == {"include_usage": True}
    assert gateway.metrics.errors.labels(status="502")._value.get() == 0
    _assert_counted(gateway, 7, 1)
    server.close()
