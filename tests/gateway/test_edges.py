"""HTTP edge cases, checked with the `openai` SDK where it can send them.

Most run against an upstream-only gateway (no device worker, nothing listening upstream): every case
here is answered before a request would be forwarded. The max_tokens default needs a real engine and
uses the tiny model on two CPU pools; the HTTP parser errors use the real server (`start_server`, as
`cliffguard serve` runs it) over a raw socket, since aiohttp's test client never sends such bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging

import openai
import pytest

from gateway.app import create_app, start_server
from gateway.handlers import answer
from gateway.runtime import GATEWAY, Gateway
from pools.config.yaml_file import load_config
from tests.gateway.conftest import pools_yaml

FRONT = "front-model"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _make_front_gateway(tmp_path) -> Gateway:
    """One upstream pool (max_model_len 512) whose upstream nobody listens on."""
    path = tmp_path / "front.yaml"
    path.write_text(f"""
pools:
  - name: remote
    upstream: http://127.0.0.1:9/v1
    model: upstream-model
    served_model_name: {FRONT}
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
""")
    return Gateway.from_config(load_config(path))


@pytest.fixture
async def front(aiohttp_client, tmp_path):
    """(aiohttp test client, AsyncOpenAI on the same server) of the upstream-only gateway."""
    client = await aiohttp_client(create_app(_make_front_gateway(tmp_path)))
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    yield client, sdk
    await sdk.close()


def _assert_openai_error(body: dict, param: str | None, code: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


async def test_deeply_nested_json_is_a_400_and_the_server_keeps_serving(front):
    client, sdk = front
    nested = b'{"foo": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = await client.post(path, data=nested, headers={"Content-Type": "application/json"})
        body = await r.json()
        assert r.status == 400, body
        _assert_openai_error(body, "body")
        assert "nested too deeply" in body["error"]["message"]
    assert (await client.get("/health")).status == 200
    assert [m.id for m in (await sdk.models.list()).data] == [FRONT]


async def test_json_that_decodes_but_later_readers_would_choke_on_is_a_400_naming_the_body(front):
    """Nesting the decoders take but the schema compiler, json.dumps or a template would recurse out on
    (900 deep: under the decoders' limit), and an integer over Python's 4,300-digit limit."""
    client, _ = front
    schema = '{"type": "object", "properties": {"a": ' * 450 + "{}" + "}}" * 450
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}"
    deep = f'{{"model": "{FRONT}", "messages": [], "tools": [{tool}]}}'.encode()
    digits = f'{{"model": "{FRONT}", "messages": [], "seed": {"1" * 5000}}}'.encode()
    for data, said in ((deep, "nested too deeply (arrays and objects over 64 deep)"), (digits, "invalid JSON")):
        r = await client.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
        body = await r.json()
        assert r.status == 400, body
        _assert_openai_error(body, "body")
        assert said in body["error"]["message"], body
    assert (await client.get("/health")).status == 200
    gateway = client.server.app[GATEWAY]                      # a batch line is held to the same depth
    status, body = await answer(gateway, "/v1/chat/completions", json.loads(deep), batch=True)
    assert status == 400 and body["error"]["param"] == "body" and "over 64 deep" in body["error"]["message"]


async def test_retrieve_model_is_the_list_entry_and_unknown_ids_are_404(front):
    client, sdk = front
    model = await sdk.models.retrieve(FRONT)
    assert model.id == FRONT and model.object == "model"
    (listed,) = (await (await client.get("/v1/models")).json())["data"]
    assert await (await client.get(f"/v1/models/{FRONT}")).json() == listed
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "gpt-9" in info.value.message
    r = await client.get("/v1/models/org/with-a-slash")  # a served_model_name may hold '/'
    _assert_openai_error(await r.json(), "model", "model_not_found")


async def test_max_tokens_past_the_context_names_max_tokens(front):
    _, sdk = front
    cases = [  # (kwargs, param, code)
        (dict(max_tokens=1_000_000_000), "max_tokens", "invalid_value"),
        (dict(max_tokens=512), "max_tokens", "invalid_value"),
        (dict(max_tokens=505), "max_tokens", "context_length_exceeded"),
        (dict(max_tokens=505, extra_body={"min_tokens": 505}), "max_tokens", "context_length_exceeded"),
        (dict(max_completion_tokens=1_000_000_000), "max_completion_tokens", "invalid_value"),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model=FRONT, messages=MESSAGES, **kwargs)
        assert (info.value.param, info.value.code) == (param, code), (kwargs, info.value.body)
        message = info.value.body["message"]
        assert message.startswith(f"{param}: ") and "512" in message, message
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.completions.create(model=FRONT, prompt="Hello", max_tokens=1_000_000_000)
    assert (info.value.param, info.value.code) == ("max_tokens", "invalid_value")


async def test_empty_stop_strings_are_refused_in_either_form(front):
    _, sdk = front
    for stop in ("", [""], ["x", ""]):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model=FRONT, messages=MESSAGES, stop=stop)
        assert info.value.param == "stop", stop
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model=FRONT, prompt="Hello", stop=stop)
        assert info.value.param == "stop", stop


async def test_unset_max_tokens_is_16_for_a_completion_within_what_the_context_leaves(aiohttp_client, tmp_path,
                                                                                     tiny_model):
    # rag admits up to max_model_len - 1 = 511 prompt tokens; without max_tokens such a prompt must be
    # served (one token), not refused for a default output length that does not fit
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model))
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway), server_kwargs={"handler_cancellation": True})
    rag = gateway.pools["rag"]
    prompt = " a" * (511 - len(rag.prefix_ids))
    assert len(rag.prefix_ids + rag.counter.encode(prompt)) == 511
    messages = [{"role": "user", "content": " a" * 400}]
    chat_len = len(rag.counter.encode(rag.tokenizer.apply_chat_template(messages)))
    for path, body, prompt_tokens, details in (
            ("/v1/completions", {"prompt": prompt}, 511, {}),
            ("/v1/chat/completions", {"messages": messages}, chat_len,
             {"prompt_tokens_details": {"cached_tokens": 0}})):   # chat's usage has the prefix-cache hit
        r = await client.post(path, json=dict(body, model=tiny_model.name, ignore_eos=True))
        whole = await r.json()
        assert r.status == 200, whole
        assert r.headers["x-cliffguard-pool"] == "rag"
        assert whole["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 512 - prompt_tokens,
                                  "total_tokens": 512, **details}
        assert whole["choices"][0]["finish_reason"] == "length"
    # a short completion prompt without max_tokens gets 16 tokens, OpenAI's and vLLM's default (the rule
    # above only keeps it within the context); a chat's runs to the context's end
    r = await client.post("/v1/completions", json={"model": tiny_model.name, "prompt": "hi", "ignore_eos": True})
    assert (await r.json())["usage"]["completion_tokens"] == 16
    # an explicit max_tokens that does not fit is the gateway's 400 naming it, not the engine's
    r = await client.post("/v1/completions", json={"model": tiny_model.name, "prompt": prompt, "max_tokens": 2})
    body = await r.json()
    assert r.status == 400
    _assert_openai_error(body, "max_tokens", "context_length_exceeded")
    assert "at most 1 fit" in body["error"]["message"]
    # min_tokens past what the context leaves an unset max_tokens is a 400 naming it (vLLM's too): a completion's
    # was a 500 (its max_tokens cut below min_tokens), a chat's ran and stopped short of it
    for path, body in (("/v1/completions", {"prompt": prompt, "min_tokens": 10}),      # 1 token left
                       ("/v1/chat/completions", {"messages": messages, "min_tokens": 513 - chat_len})):
        r = await client.post(path, json=dict(body, model=tiny_model.name))
        error = await r.json()
        assert r.status == 400, error
        _assert_openai_error(error, "min_tokens", "context_length_exceeded")


async def _send_raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read the whole answer (the server closes the connection after an error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def test_http_parser_errors_are_openai_json_on_the_real_server(tmp_path, caplog):
    runner = await start_server(create_app(_make_front_gateway(tmp_path)), "127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        cases = [  # (what, bytes)
            ("header over 8 KiB", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"),
            ("bad request line", b"NOT HTTP AT ALL\r\n\r\n"),
            ("bad method", b"G@T /health HTTP/1.1\r\nHost: localhost\r\n\r\n"),
        ]
        for what, data in cases:
            status, headers, body = await _send_raw(port, data)
            assert status in (400, 431), (what, status, body)
            assert headers["content-type"].startswith("application/json"), (what, headers)
            error = json.loads(body)
            _assert_openai_error(error, None)
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"], what
        status, _, body = await _send_raw(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        # a header the parser refuses is quoted in its error: an API key one stray byte from valid never reaches
        # the log (aiohttp logged the parser's message at ERROR)
        with caplog.at_level(logging.DEBUG):
            status, _, _ = await _send_raw(port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                                                 b"Authorization: Bearer sk-live-abc\x00\r\n\r\n")
        assert status == 400 and "sk-live-abc" not in caplog.text and "400" in caplog.text
    finally:
        await runner.cleanup()


async def test_a_long_token_id_prompt_is_checked_off_the_event_loop(tmp_path):
    """A few MB of token ids are walked off the event loop, as a long text prompt is tokenized: other
    requests are served meanwhile; one out of the vocabulary is still named by its index."""
    import threading

    gateway = _make_front_gateway(tmp_path)
    threads, route = [], gateway.router.route

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return route(*args, **kwargs)

    gateway.router.route = recorded
    with pytest.raises(Exception, match="no pool"):
        await gateway.route_prompt(FRONT, [0] * 3000)
    await gateway.route_prompt(FRONT, [1, 2, 3])
    assert threads == [False, True]                       # the long one on the tokenizer thread, the short inline
    with pytest.raises(Exception, match=r"prompt\[2\]: token id 999999 is not in the vocabulary"):
        await gateway.route_prompt(FRONT, [1, 2, 999999, 5])


async def test_a_token_id_the_model_has_no_row_for_is_refused_before_any_credit(tmp_path, builtin_path):
    """A model whose embedding has fewer rows than its tokenizer has ids (an added token past them): an id
    between the two is refused at routing, naming its index, not taken in and failed by the engine."""
    from tests.conftest import make_tiny_model
    from tests.gateway.conftest import chat_pool_yaml

    model = make_tiny_model(tmp_path / "small-vocab", "llama", builtin_path, vocab_size=1000)
    path = tmp_path / "pools.yaml"
    path.write_text(chat_pool_yaml(model))
    gateway = Gateway.from_config(load_config(path))
    assert (await gateway.route_prompt(model.name, [1, 999]))[1] == [1, 999]
    with pytest.raises(Exception, match=r"prompt\[1\]: token id 5000 is not in the vocabulary \(0\.\.999\)"):
        await gateway.route_prompt(model.name, [1, 5000])


def test_a_body_of_empty_containers_counts_toward_the_inline_bound():
    """`num_chars` bounds what runs on the loop: a schema of empty containers (`{"anyOf": [{}, {}, ...]}`) counted
    nothing, and its compile ran inline for seconds."""
    from gateway.runtime import num_chars

    assert num_chars({"anyOf": [{}] * 5000}, 2048) > 2048 and num_chars([[]] * 10, 2048) == 22
    assert num_chars({"a": "xyz", "b": 1}, 2048) == 2 + 1 + 3 + 1 + 8


async def test_tool_schemas_are_compiled_off_the_event_loop(front, monkeypatch):
    """Each tool's schema is compiled to be checked (seconds for a body of large ones): chat, a batch line and
    the Responses API read a body with large tools on the tokenizer thread, never the loop's; small ones (a
    few milliseconds at most) stay inline."""
    import threading

    from gateway.openai import tool_specs

    client, _ = front
    threads: list[str] = []

    def recording(schema_text: str, lenient: bool) -> str | None:
        threads.append(threading.current_thread().name)
        return None
    monkeypatch.setattr(tool_specs, "_schema_error", recording)

    def tool(i: int, responses: bool = False, large: bool = True) -> dict:
        function = {"name": "f", "description": "d" * (20_000 if large else 10),
                    "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"}}}}
        return {"type": "function", **function} if responses else {"type": "function", "function": function}
    chat = {"model": FRONT, "messages": [{"role": "user", "content": "hi"}]}   # large tools: past the 512 tokens
    assert (await client.post("/v1/chat/completions", json={**chat, "tools": [tool(1)]})).status == 400
    status, _ = await answer(client.app[GATEWAY], "/v1/chat/completions", {**chat, "tools": [tool(2)]})
    assert status == 400
    assert (await client.post("/v1/responses", json={"model": FRONT, "input": "hi", "store": False,
                                                     "tools": [tool(3, responses=True)]})).status == 400
    assert len(threads) == 3 and all(name.startswith("cliffguard-tok") for name in threads), threads
    assert (await client.post("/v1/chat/completions", json={**chat, "tools": [tool(4, large=False)]})).status == 502
    assert threads[3:] == [threading.current_thread().name], threads


async def test_a_grammar_checks_reason_too_long_to_remember_is_not_kept(tmp_path):
    """`Gateway.check_grammar` remembers each schema's answer, but not a reason that quotes a long schema
    (1,024 distinct ones of 1 MB would hold 1 GiB): that one is checked again, with the same 400."""
    from engine.structured import StructuredOutput
    from gateway.openai.errors import ApiError

    gateway = _make_front_gateway(tmp_path)
    short = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}})
    long = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string",
                                                                                "format": "x" * 5000}}})
    for _ in range(2):
        for constraint, reason in ((short, "Invalid type: strin"), (long, "Unknown format: " + "x" * 5000)):
            with pytest.raises(ApiError) as err:
                await gateway.check_grammar(constraint, "response_format")
            assert err.value.param == "response_format" and err.value.message.endswith(reason)
    assert list(gateway.grammar_checks.items()) == [(short.key, "Invalid type: strin")]
    gateway.executor.shutdown()


async def test_without_a_data_dir_every_response_id_is_unknown(front):
    """A gateway without a data dir keeps no responses: an id names none, as OpenAI answers an unknown id (the
    SDK's NotFoundError, not a BadRequestError; `previous_response_not_found`), and asking to keep one is a 400
    naming the field."""
    client, sdk = front
    for call in (sdk.responses.retrieve("resp_x"), sdk.responses.delete("resp_x"),
                 sdk.responses.input_items.list("resp_x"), sdk.responses.cancel("resp_x")):
        with pytest.raises(openai.NotFoundError) as info:
            await call
        _assert_openai_error({"error": info.value.body}, "response_id", "not_found")
        assert "keeps no responses" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(model=FRONT, input="hi", previous_response_id="resp_x")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(model=FRONT, input="hi", background=True)
    assert info.value.param == "background"
    with pytest.raises(openai.BadRequestError) as info:   # no kept item to refer to
        await sdk.responses.create(model=FRONT, input=[{"type": "item_reference", "id": "msg_x"}])
    assert info.value.param == "input" and "keeps no responses" in info.value.message
