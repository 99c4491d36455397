"""Batch lines forwarded to an upstream pool are sent again only when nothing was sent: a connection
that could not be made (502 `upstream_unreachable`) is retried; an upstream that read the request and
then dropped the connection (502 `upstream_disconnected`) may be running it, and the line fails
instead of running twice. In-process gateway (upstream pools only, no device worker) and a real
upstream on 127.0.0.1 that counts what it received."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections import Counter

import pytest
from aiohttp import web

from gateway.upstream import relay as upstream
from gateway.upstream.connection import UpstreamClient
from gateway.app import create_app
from gateway.batch.endpoints import BATCHES
from gateway.monitoring.metrics import GatewayMetrics
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from tests.gateway.test_batches import _create, _jsonl, _jsonl_file, _wait

FRONT = "front-model"


class _DroppingUpstream:
    """An OpenAI-compatible upstream that reads each request whole, counts it by its prompt (and keeps
    its Idempotency-Key), then drops the connection without answering."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        self.keys: dict[str, str | None] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][0]["content"]
        self.received[prompt] += 1
        self.keys[prompt] = request.headers.get("Idempotency-Key")
        request.transport.abort()
        return web.Response()

    async def __aenter__(self) -> _DroppingUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _free_port() -> int:
    """A loopback port nobody listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gateway(tmp_path, upstream_url: str, *pool_lines: str, drain_seconds: float | None = None,
             max_connections: int = 256) -> Gateway:
    """An upstream-only gateway: the pool `remote` at `upstream_url`, with `pool_lines` (`key: value`) added."""
    path = tmp_path / "pools.yaml"
    drain = (f"gateway: {{drain_seconds: {drain_seconds}, upstream: {{max_connections: {max_connections}}}}}\n"
             if drain_seconds is not None else "")
    path.write_text(drain + f"""
pools:
  - name: remote
    upstream: {upstream_url}
    model: upstream-model
    served_model_name: {FRONT}
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
""" + "".join(f"    {line}\n" for line in pool_lines))
    return Gateway.from_config(load_config(path))


LONG = "\u6f22" * 1000


def _line(custom_id: str) -> dict:   # its prompt is its custom_id (LONG's: "long")
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": FRONT, "messages": [{"role": "user", "content": "long" if custom_id == LONG else custom_id}],
                     "max_tokens": 4}}


async def _run_batch(aiohttp_client, tmp_path, upstream_url: str, *custom_ids: str, attempts: int = 4):
    client = await aiohttp_client(create_app(_gateway(tmp_path, upstream_url), data_dir=tmp_path))
    runner = client.app[BATCHES]
    runner.retry_first_s = runner.retry_max_s = 0.01
    runner.max_line_attempts = attempts
    done = await _wait(client, (await _create(client, _jsonl(*map(_line, custom_ids))))["id"])
    return done, await _jsonl_file(client, done["error_file_id"])


async def test_a_line_the_upstream_received_then_dropped_runs_once_and_fails(aiohttp_client, tmp_path, monkeypatch):
    posted, real_post = [], UpstreamClient.post

    async def post(self, *args, background=False, **kwargs):
        posted.append(background)
        return await real_post(self, *args, background=background, **kwargs)

    monkeypatch.setattr(UpstreamClient, "post", post)
    async with _DroppingUpstream() as dropping:
        done, errors = await _run_batch(aiohttp_client, tmp_path, dropping.url, "one", "two", "three", LONG)
    assert posted == [True] * 4   # batch lines: at most half the host's connections
    assert dropping.received == {"one": 1, "two": 1, "three": 1, "long": 1}        # each exactly once
    assert done["status"] == "completed" and done["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    assert sorted(e["custom_id"] for e in errors) == sorted(["one", "three", "two", LONG])
    for e in errors:
        assert e["response"]["status_code"] == 502
        assert e["response"]["body"]["error"]["code"] == "upstream_disconnected", e
    # a long custom_id (here 1,000 CJK characters, 9 KB quoted: past a proxy's 8 KiB header line) is keyed by its hash
    digest = hashlib.sha256(LONG.encode()).hexdigest()
    assert dropping.keys == {**{cid: f"{done['id']}:{cid}" for cid in ("one", "two", "three")},
                             "long": f"{done['id']}:sha256:{digest}"}


async def test_a_line_whose_upstream_cannot_be_reached_is_tried_again(aiohttp_client, tmp_path):
    done, errors = await _run_batch(aiohttp_client, tmp_path, f"http://127.0.0.1:{_free_port()}/v1", "lost",
                                    attempts=3)
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    (error,) = errors
    assert error["error"]["code"] == "retries_exhausted" and "gave up after 3 attempts" in error["error"]["message"]
    assert error["response"]["body"]["error"]["code"] == "upstream_unreachable"


@pytest.mark.parametrize("answer, code", [(b"not json", "upstream_error"), (None, "upstream_disconnected")])
async def test_forward_names_an_invalid_answer_and_a_dropped_one(aiohttp_client, tmp_path, answer, code):
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        if answer is None:   # headers, then the connection dropped in the middle of the body
            response = web.StreamResponse(headers={"Content-Length": "1000", "Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"id": ')
            request.transport.abort()
            return response
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_client(app)
    pool = _gateway(tmp_path, str(server.make_url("/v1"))).pools["remote"]
    client = UpstreamClient()
    with pytest.raises(upstream.ApiError) as info:
        await upstream.forward(None, client, pool, "/chat/completions", {"model": FRONT, "messages": []},
                               False, GatewayMetrics())
    await client.close()
    assert info.value.status == 502 and info.value.code == code, info.value.message
    assert "upstream pool 'remote'" in info.value.message


async def _holding_upstream(aiohttp_client, held: str, seconds: float) -> tuple[str, Counter[str], asyncio.Event]:
    """An upstream answering every chat at once but the one whose prompt is `held`, which it holds `seconds`
    first: (its /v1 URL, the prompts it received, an event set when it has the held one)."""
    received: Counter[str] = Counter()
    holding = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        prompt = (await request.json())["messages"][0]["content"]
        received[prompt] += 1
        if prompt == held:
            holding.set()
            await asyncio.sleep(seconds)
        return web.json_response({"id": "c", "object": "chat.completion", "model": "upstream-model",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return str((await aiohttp_client(app)).make_url("/v1")), received, holding


async def test_a_line_the_upstream_held_when_the_gateway_stopped_is_not_sent_again(aiohttp_client, tmp_path):
    """The upstream has the line (it may run it) when the gateway stops: at the next start the line is not
    sent again but answered 502 `upstream_disconnected`, and the line that never went out runs as ever."""
    url, received, holding = await _holding_upstream(aiohttp_client, "held", 60)
    first = await aiohttp_client(create_app(_gateway(tmp_path, url, drain_seconds=0.5), data_dir=tmp_path))
    first.app[BATCHES].max_in_flight = 1   # "held" first; "later" waits behind it and never goes out
    batch_id = (await _create(first, _jsonl(_line("held"), _line("later"))))["id"]
    await asyncio.wait_for(holding.wait(), 10)
    started = time.monotonic()
    await first.close()   # the stop drains 0.5 s, then its cleanup stops the runner: "held" cut while the upstream has it
    assert 0.4 < time.monotonic() - started < 5
    again = await aiohttp_client(create_app(_gateway(tmp_path, url), data_dir=tmp_path))
    done = await _wait(again, batch_id)
    assert received == {"held": 1, "later": 1}, received
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, done
    (error,) = await _jsonl_file(again, done["error_file_id"])
    assert error["custom_id"] == "held" and error["response"]["status_code"] == 502
    assert error["response"]["body"]["error"]["code"] == "upstream_disconnected", error


async def test_a_stop_drains_the_lines_an_upstream_has_and_starts_none(aiohttp_client, tmp_path):
    """The upstream answers "slow" 1 s after the stop begins, within the 10 s drain: it is kept answered (not cut
    into a 502 at the next start), the stop ends then, and "later", which no line started during the drain, runs
    at the next start."""
    url, received, holding = await _holding_upstream(aiohttp_client, "slow", 1.0)
    # two connections: the batch lines' one is "slow"'s, "queued" waits for it; "later" is not started
    first = await aiohttp_client(create_app(_gateway(tmp_path, url, drain_seconds=10, max_connections=2),
                                            data_dir=tmp_path))
    first.app[BATCHES].max_in_flight = 2
    batch_id = (await _create(first, _jsonl(_line("slow"), _line("queued"), _line("later"))))["id"]
    await asyncio.wait_for(holding.wait(), 10)
    await asyncio.sleep(0.2)   # "queued" waits for the background slot
    started = time.monotonic()
    await first.close()   # "slow" answered and kept; "queued", which got the slot then, is not sent: cut unsent
    assert 0.5 < time.monotonic() - started < 5 and received == {"slow": 1}, received
    again = await aiohttp_client(create_app(_gateway(tmp_path, url), data_dir=tmp_path))
    done = await _wait(again, batch_id)
    assert received == {"slow": 1, "queued": 1, "later": 1}, received
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


async def test_a_line_the_upstream_refused_with_429_is_sent_again_after_a_stop(aiohttp_client, tmp_path):
    """A 429 means the upstream did not run the line: a stop during the back-off after it leaves the line to
    be sent again at the next start, not answered `upstream_disconnected`."""
    received: Counter[str] = Counter()

    async def chat(request: web.Request) -> web.Response:
        received[(await request.json())["messages"][0]["content"]] += 1
        return web.json_response({"error": {"message": "slow down", "code": "rate_limit_exceeded"}}, status=429)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = str((await aiohttp_client(app)).make_url("/v1"))
    first = await aiohttp_client(create_app(_gateway(tmp_path, url), data_dir=tmp_path))
    first.app[BATCHES].retry_first_s = 60   # the back-off the stop cuts
    batch_id = (await _create(first, _jsonl(_line("refused"))))["id"]
    for _ in range(200):
        if received["refused"]:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)   # past its answer, into the back-off
    await first.close()
    second = create_app(_gateway(tmp_path, url), data_dir=tmp_path)
    second[BATCHES].max_line_attempts = 1   # before its runner starts: it resumes the batch at once (set after, the
    again = await aiohttp_client(second)    # runner had begun its 40 tries, and a loaded machine saw them all)
    done = await _wait(again, batch_id)
    (error,) = await _jsonl_file(again, done["error_file_id"])
    assert received["refused"] == 2 and error["response"]["status_code"] == 429, (received, error)
