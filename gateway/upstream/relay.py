"""Forwarding to an `upstream:` pool: any OpenAI-compatible server (another cliffguard, vLLM, ...).

The request body goes on unchanged except `model`, which becomes the upstream's model name; the answer comes back with
the client's model name restored. Streams are relayed event by event as they arrive, their fields read as the SSE spec
says (`data:x` is `data: x`; an event the body ends inside, with no blank line after it, only where it is whole:
`[DONE]` or a JSON object). Upstream errors (4xx and 5xx) keep their status, OpenAI error body and the headers that
say when to try again (`Retry-After`, `retry-after-ms`, `x-ratelimit-*`); a body that is not one (`{"error": "text"}`,
not JSON) is put in that format, quoting it, with code `upstream_error` (SGLang's and older vLLM's flat `{"message",
"type", "code": <status>}` is read as one); only its first `MAX_ERROR_BYTES` are read. A 401 or 403 is not relayed:
the client's key is never forwarded, so it refused the gateway's own credentials, and the client gets our 502
`upstream_error` saying so (the upstream's message is logged); nor is a 404: the model name and the path are the
pool's (`model:`, `upstream:`), so the client's model exists and the configuration is wrong. Our own 502s say whether
the upstream may have received the request: `upstream_unreachable` when no connection could be made (nothing was sent:
safe to send again, and the batch runner does), `upstream_disconnected` when the connection failed after the request
may have gone out (the upstream may be running it: never sent again, so a batch line never runs twice),
`upstream_error` for an answer we cannot relay: not valid JSON, over `MAX_ANSWER_BYTES`, a status that is neither a
success (2xx) nor an error (4xx, 5xx), or not a stream (text/event-stream) when one was asked for. A stream that fails
once it started (dropped, a broken chunk, one event over `MAX_EVENT_BYTES`), or whose body ends before its last event
(`data: [DONE]`; a Responses stream's `response.completed` / `incomplete` / `failed`, or an `error` of its own), ends
as a local one that fails does: an error event with that 502's error object (`upstream_disconnected`,
`upstream_error`), then `data: [DONE]` (a Responses stream: an `error` event numbered after its last; after the
upstream's own error event, only the `[DONE]`); so does one cut at the end of the gateway's drain, with 503
`server_shutting_down`. Once its last event is out, an upstream's body gets `TAIL_SECONDS` to end (the client's stream
ends when it does; an upstream that holds it open is closed then). Token counts for metrics come from the upstream's
`usage` (`prompt_tokens` / `completion_tokens`; the Responses API's `input_tokens` / `output_tokens`; a stream's last
usage, once) where its counts are non-negative integers, the prompt's from the gateway's own count where they are not;
a malformed usage is relayed as it is. A chat or completions stream whose client did not ask for its usage is sent
with `stream_options.include_usage` all the same, and its usage chunk (and the `usage: null` of the others) is not
relayed. Each choice's end counts in `request_success`, an upstream's error in `request_errors` (a stream's own error
event too: vLLM's `data: {"error": ...}`, a Responses `response.failed`); only what a client waits on (a request, not
a batch line nor a background Response) in the latency histograms.

A batch line is forwarded with an `Idempotency-Key: <batch id>:<custom_id>` header (`IDEMPOTENCY_KEY`, set by the
batch runner around the line; `idempotency_key`: a custom_id past 128 characters quoted is sent as its SHA-256, as
a header line past 8 KiB is a 400 at proxies and servers): an upstream that honours it answers a repeat from its first run. cliffguard does not
rely on it: it never sends a line again once it may have run there (a 429 did not), not even after a stop that cut
it (the runner keeps that it was sent as it goes out: `UPSTREAM_SEND`).

The upstream's URL is shown to clients (errors, `/v1/models`) only through `redact`, without any user or password in
it. A relayed stream's writes to the client are bounded by `write_timeout` like a local one's, so a client that
never reads cannot hold an upstream connection (the session has a pool of them) for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import msgspec
from aiohttp import web
from yarl import URL

from gateway.monitoring.metrics import GatewayMetrics, PoolSeries
from gateway.openai.errors import ApiError, drain_cut
from gateway.client_writes import ClientGone, escaped_json, start_sse, write_within
from gateway.upstream.connection import (UpstreamClient, UpstreamDisconnected, UpstreamResponse,
                                         UpstreamTooLarge, UpstreamUnreachable)
from gateway.upstream.sse import split_events, whole
from gateway.upstream.stream_seen import ResponseEdit, StreamSeen, finish_reasons, rename_model
from pools.pool import Pool

log = logging.getLogger("cliffguard.gateway")

# What is held of one upstream answer: a whole non-streamed body, one event of a stream (a `response.completed`
# event holds a whole response), the start of an error body (its message is quoted from the first 500 bytes).
MAX_ANSWER_BYTES = 64 << 20
MAX_EVENT_BYTES = 16 << 20
MAX_ERROR_BYTES = 16 << 10
TAIL_SECONDS = 1.0   # after a stream's last event (`[DONE]`), the most its body may take to end

# The forwarded request's Idempotency-Key: a batch line's `idempotency_key` (gateway.batch.execution), else None.
IDEMPOTENCY_KEY: ContextVar[str | None] = ContextVar("cliffguard_idempotency_key", default=None)
MAX_QUOTED_ID = 128   # characters of a custom_id quoted in its Idempotency-Key; past them, its SHA-256


def idempotency_key(batch_id: str, custom_id: str) -> str:
    """`<batch id>:<custom_id>` (quoted: a header's ASCII), or `<batch id>:sha256:<hex>` for a custom_id whose
    quoted form is past MAX_QUOTED_ID characters (quoted, `sha256:` has its colon as `%3A`: no other id's key)."""
    quoted = quote(custom_id, safe="")
    if len(quoted) > MAX_QUOTED_ID:
        quoted = "sha256:" + hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{batch_id}:{quoted}"
# Awaited once a connection to the upstream is made, just before the request goes out (the upstream may run
# it from then on): a batch line's runner keeps that (gateway.batch.execution), else None.
UPSTREAM_SEND: ContextVar[Callable[[], Awaitable[None]] | None] = ContextVar("cliffguard_upstream_send",
                                                                            default=None)


def _headers(pool: Pool, stream: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",   # no body we would not read
               "Accept": "text/event-stream" if stream else "application/json"}
    env = pool.spec.upstream_api_key_env
    if env and (key := os.environ.get(env, "").strip()):   # a secret's file often ends in a newline
        headers["Authorization"] = f"Bearer {key}"
    if (key := IDEMPOTENCY_KEY.get()) is not None:
        headers["Idempotency-Key"] = key
    return headers


def _upstream_failed(pool: Pool, what: str, exc: BaseException, code: str) -> ApiError:
    """Our 502 for an upstream that failed (`code`: see the module docstring), its URL redacted."""
    where = redact(pool.spec.upstream)
    detail = str(exc).replace(pool.spec.upstream, where) or type(exc).__name__
    return ApiError(502, f"upstream pool {pool.name!r} at {where} {what}: {detail}", type="server_error", code=code)


def redact(url: str) -> str:
    """`url` without the user and password of its authority (`http://u:secret@host/v1` -> `http://host/v1`)."""
    try:
        return str(URL(url).with_user(None))
    except (ValueError, TypeError):
        return "<upstream>"


async def forward(request: web.Request, client: UpstreamClient, pool: Pool, path: str, body: dict[str, Any],
                  stream: bool, metrics: GatewayMetrics, write_timeout: float = 30.0, prompt_tokens: int = 0,
                  received: float | None = None, edit: ResponseEdit | None = None) -> web.StreamResponse:
    """Send `body` (with the upstream's model name) to `<pool.spec.upstream><path>` and relay the answer;
    `prompt_tokens`: the gateway's own count of the prompt (`_Relayed`); `received`: when the request
    arrived (perf_counter; default now), which its time to first token and latency count from; `edit`: a
    Responses stream kept here."""
    responses = path.endswith("/responses")   # its usage and its stream's events are the Responses API's
    relayed = _Relayed(pool, metrics, body["model"], responses, time.perf_counter() if received is None else received,
                       prompt_tokens, hide_usage=stream and not responses and not _asks_usage(body),
                       timed=request is not None)
    sent = dict(body, model=pool.spec.model)
    if relayed.hide_usage:   # the stream's usage chunk, for the counters; the client did not ask for it (nor, as a
        options = {k: v for k, v in (body.get("stream_options") or {}).items() if k != "continuous_usage_stats"}
        sent["stream_options"] = {**options, "include_usage": True}   # local pool, for usage in every chunk)
    try:
        upstream = await client.post(_url(pool.spec.upstream, path), _encoded(sent), _headers(pool, stream),
                                     on_send=UPSTREAM_SEND.get(), background=IDEMPOTENCY_KEY.get() is not None)
    except UpstreamUnreachable as exc:   # no connection: nothing sent
        raise _upstream_failed(pool, "is unreachable", exc, "upstream_unreachable") from None
    except (UpstreamDisconnected, OSError) as exc:   # after the request may have gone out
        raise _upstream_failed(pool, "dropped the request", exc, "upstream_disconnected") from None
    async with upstream:
        if not 200 <= upstream.status < 300:
            return await _relay_error(pool, upstream)
        if not stream:
            return await _relay_answer(relayed, upstream)
        content_type = upstream.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != "text/event-stream":
            raise _upstream_failed(pool, "did not stream", ValueError(
                f"it answered a stream request with Content-Type {content_type[:80]!r}, not text/event-stream"),
                "upstream_error")
        return await _relay_stream(request, relayed, upstream, write_timeout, edit)


def _asks_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


# A usage's (prompt, output) token counts: chat and completions, then the Responses API.
_USAGE_KEYS = {False: ("prompt_tokens", "completion_tokens"), True: ("input_tokens", "output_tokens")}


@dataclass
class _Relayed:
    """One relayed answer's request: what its counters need. `prompt_tokens` is the gateway's own count,
    counted where the upstream's usage has none; `hide_usage`: a stream the gateway asked for its usage
    (`stream_options.include_usage`) where the client did not, so that its tokens are counted: the usage
    chunk is not relayed, nor the `usage: null` of the others. `timed`: a client waits on it (its latency is
    observed; a batch line's or a background Response's, forwarded with no client request, is not)."""

    pool: Pool
    metrics: GatewayMetrics
    client_model: str
    responses: bool
    received: float
    prompt_tokens: int
    hide_usage: bool = False
    timed: bool = True

    @property
    def series(self) -> PoolSeries:
        return self.metrics.pool_series(self.pool.name)

    def count(self, usage: Any, finish_reasons: list[str]) -> None:
        """The answer's `usage` added to its pool's token counters (once an answer: a stream's last usage,
        never each chunk's), by the keys of its API; each choice's end in request_success."""
        prompt_key, output_key = _USAGE_KEYS[self.responses]
        series, prompt = self.series, _count(usage, prompt_key)
        series.prompt_tokens.inc(self.prompt_tokens if prompt is None else prompt)
        series.generation_tokens.inc(_count(usage, output_key) or 0)
        for reason in finish_reasons:
            self.metrics.finished(self.pool.name, reason)


def _count(usage: Any, key: str) -> int | None:
    """`usage[key]` where it is a count (a non-negative int), else None: a malformed usage is relayed, not
    counted."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if type(value) is int and value >= 0 else None


async def _relay_answer(relayed: _Relayed, upstream: UpstreamResponse) -> web.Response:
    """A non-streamed answer (at most MAX_ANSWER_BYTES) with the client's model name put back."""
    pool = relayed.pool
    try:
        payload = rename_model(_decoded(await upstream.read(MAX_ANSWER_BYTES)), relayed.client_model)
    except (UpstreamDisconnected, OSError) as exc:
        raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
    except UpstreamTooLarge as exc:
        raise _upstream_failed(pool, "sent an answer too large to relay", exc, "upstream_error") from None
    except (ValueError, RecursionError) as exc:   # not JSON, or nested past the decoder's depth
        raise _upstream_failed(pool, "sent an invalid response", exc, "upstream_error") from None
    relayed.count(payload.get("usage") if isinstance(payload, dict) else None,
                  finish_reasons(payload, relayed.responses))
    if relayed.timed:
        relayed.series.e2e.observe(time.perf_counter() - relayed.received)
    return web.Response(body=_encoded(payload), content_type="application/json",
                        headers={"x-cliffguard-pool": pool.name})


_JSON = msgspec.json.Encoder()


def _decoded(raw: bytes) -> Any:
    """JSON; a lone surrogate (`"\\ud83d"`: half an emoji, as JavaScript servers write it), which msgspec
    refuses, read by the standard library (ValueError for what is not JSON), and `_encoded` escaped again."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw, parse_constant=lambda name: None)   # NaN, Infinity: null, as msgspec reads them


def _encoded(payload: Any) -> bytes:
    try:
        return _JSON.encode(payload)
    except UnicodeEncodeError:   # a lone surrogate
        return escaped_json(payload)


@functools.lru_cache(maxsize=256)
def _url(upstream: str, path: str) -> URL:
    """`<upstream><path>` parsed once (a pool's few endpoints)."""
    return URL(upstream.rstrip("/") + path)


async def _relay_error(pool: Pool, upstream: UpstreamResponse) -> web.Response:
    """The upstream's error (4xx, 5xx) with its status, in the OpenAI format: its body when it is one, else
    one quoting it (its message text, or the body's start). Any other status that is not a success is our
    502 `upstream_error`, and so is a 401, 403 or 404 (`_configuration_refused`)."""
    status = upstream.status
    if not 400 <= status <= 599:
        raise _upstream_failed(pool, "sent an invalid response", ValueError(
            f"status {status}, neither a success (2xx) nor an error (4xx, 5xx)"), "upstream_error")
    try:
        raw = await upstream.read_start(MAX_ERROR_BYTES)
    except (UpstreamDisconnected, OSError) as exc:
        raise _upstream_failed(pool, "dropped the answer", exc, "upstream_disconnected") from None
    error = openai_error(raw, f"upstream pool {pool.name!r} answered {status}")
    if status in (401, 403, 404):
        raise _configuration_refused(pool, status, error)
    return web.json_response({"error": error}, status=status,
                             headers={"x-cliffguard-pool": pool.name, **retry_headers(upstream.headers)})


_RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
_ACCOUNT_IDS = re.compile(r"\b((?:org|proj|user)[-_])([A-Za-z0-9]{16,})")   # linear: no nested lazy runs


def _masked(message: str) -> str:
    """`message` with the operator's account ids cut to their prefix (`org-…`): 16+ letters and digits after
    `org-`, `proj_`, `user-`, with a digit or both cases in them (not a word, as `user-provided` is)."""
    def mask(match: re.Match) -> str:
        run = match.group(2)
        is_id = any(c.isdigit() for c in run) or not (run.islower() or run.isupper())
        return match.group(1) + "…" if is_id else match.group(0)

    return _ACCOUNT_IDS.sub(mask, message)


def retry_headers(headers: Any) -> dict[str, str]:
    """The upstream's word on when to try again (`Retry-After`, `retry-after-ms`, the `x-ratelimit-*`
    headers OpenAI sends with a 429) and whether to (`x-should-retry`: false on another gateway's poison
    request), relayed with its error: the SDKs wait, or give up, as it says."""
    return {name: value for name, value in headers.items()
            if (low := name.lower()) in _RETRY_HEADERS or low.startswith("x-ratelimit-")}


_NO_RETRY = {"x-should-retry": "false"}   # a configuration to fix: the openai SDKs would send it twice more


def _configuration_refused(pool: Pool, status: int, error: dict[str, Any]) -> ApiError:
    """Our 502 `upstream_error` for what the pool's configuration got wrong, which the client can do nothing
    about; the upstream's message goes to the log, for the operator, and not to the client.
    - A 401 or 403: the client's key is never forwarded, so the upstream refused the gateway's own (the pool's
      `upstream_api_key_env`, or none sent). Relayed, it would tell the client that its key is wrong (the SDKs
      raise AuthenticationError), and its message may quote the gateway's key (OpenAI's shows its last
      characters).
    - A 404 (vLLM's "The model `m` does not exist"): the pool's `model:` or `upstream:` path, not the client's
      model, which the gateway lists (relayed, the SDKs raised NotFoundError naming the upstream's)."""
    where, env = redact(pool.spec.upstream), pool.spec.upstream_api_key_env
    if status == 404:
        to, what, fix = "", "does not serve the pool's model at that path", "the pool's model or upstream"
    else:
        sent = f"the key in ${env}" if env and os.environ.get(env) else "no key (upstream_api_key_env unset or empty)"
        to, what, fix = f" to {sent}", "refused the gateway's credentials", "them"
    log.warning("upstream pool %r at %s answered %d%s: %s", pool.name, where, status, to, error["message"])
    return ApiError(502, f"upstream pool {pool.name!r} at {where} {what} (it answered {status}); the gateway's "
                         f"operator must fix {fix}", type="server_error", code="upstream_error", headers=_NO_RETRY)


def openai_error(raw: bytes, context: str) -> dict[str, Any]:
    """An upstream's error body as an OpenAI error object (its own `error`, else one quoting its text after
    `context`, code `upstream_error`), account ids masked: relayed HTTP errors and batch and background runs alike."""
    try:
        payload = msgspec.json.decode(raw)
    except (ValueError, RecursionError):   # not JSON (or cut at MAX_ERROR_BYTES), or nested too deep
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if error is None and isinstance(payload, dict) and isinstance(payload.get("message"), str):
        error = {**payload, "code": code if isinstance(code := payload.get("code"), str) else None}   # SGLang's
    if not isinstance(error, dict):
        text = error if isinstance(error, str) and error else raw[:500].decode(errors="replace")
        error = {"message": f"{context}: {text}", "type": "server_error", "code": "upstream_error"}
    param, code = error.get("param"), error.get("code")
    return {"message": _masked(str(error.get("message") or "")),
            "type": str(error.get("type") or "server_error"),
            "param": None if param is None else str(param), "code": None if code is None else str(code)}


async def _relay_stream(request: web.Request, relayed: _Relayed, upstream: UpstreamResponse,
                        write_timeout: float, edit: ResponseEdit | None = None) -> web.StreamResponse:
    """The upstream's SSE events, each relayed as it arrives with the client's model name put back; a
    client that takes nothing for `write_timeout` seconds is cut off (ClientGone). A stream that fails
    or ends before its last event (`[DONE]`; a Responses stream: its `response.completed` / `incomplete`
    / `failed` event, or an `error` event of its own) ends with our error: a chat or completions stream
    `data: {"error": ...}` then `[DONE]`, a Responses stream an `error` event (OpenAI's
    `ResponseErrorEvent`). The last usage the stream reported is counted once, at its end."""
    pool, metrics, responses = relayed.pool, relayed.metrics, relayed.responses
    response = await start_sse(request, {"x-cliffguard-pool": pool.name})

    async def write(data: bytes | None) -> None:   # None: the stream's end
        try:
            await write_within(request, response.write_eof() if data is None else response.write(data), write_timeout,
                               metrics, pool.name, f"{request.path}: its relayed stream")
        except (ConnectionError, RuntimeError) as exc:   # RuntimeError: aiohttp's "transport is closing"
            raise exc if isinstance(exc, ClientGone) else ClientGone(f"client went away: {exc}") from None

    seen, failure, ended = StreamSeen(responses, relayed.hide_usage, edit), None, False   # ended: its last event out
    tail: asyncio.Timeout | None = None
    try:
        async with contextlib.aclosing(_events(pool, upstream)) as events, asyncio.timeout(None) as tail:
            async for event in events:
                if isinstance(event, ApiError):
                    failure = event
                    break
                num_outputs, out = seen.num_outputs, seen.relay(event, relayed.client_model)
                out = out if edit is None else await edit.settle(event, out)   # a final Response kept first
                if out is not None:
                    await write(out + b"\n\n")
                ended = seen.ended   # not before its last event went out (a cut while it is kept: the error's)
                if ended and tail.when() is None:   # the body's end follows at once, or it is not waited for
                    tail.reschedule(asyncio.get_running_loop().time() + TAIL_SECONDS)
                if num_outputs == 0 and seen.num_outputs:   # its first event of output
                    relayed.series.ttft.observe(time.perf_counter() - relayed.received)
    except TimeoutError:   # the body outlived its last event: closed (its connection not kept), the client's ends
        if tail is None or not tail.expired():
            raise
    except asyncio.CancelledError as exc:   # cut at the drain's end: its error event ends the stream
        if (failure := drain_cut(exc)) is None:   # the client left (the handler cancelled)
            relayed.count(seen.usage, [])
            raise
    except ClientGone:   # what it cost the upstream so far counts all the same
        relayed.count(seen.usage, [])
        raise
    if failure is None and not ended:   # a clean end of the body (a connection's FIN, a last chunk) too early
        last = "a response.completed, .incomplete or .failed event" if responses else "data: [DONE]"
        failure = _upstream_failed(pool, "dropped the stream", UpstreamDisconnected(
            f"it ended before its last event ({last})"), "upstream_disconnected")
    await _counted(relayed, seen, failure, ended, edit)
    if failure is not None:
        log.warning("%s: %s", request.path, failure.message)
        if not ended:   # after the upstream's own error event, only the end it did not send
            await write(b"data: [DONE]\n\n" if seen.error_status else
                        _error_tail(failure, responses, seen.sequence_number + 1))
    await write(None)
    return response


async def _counted(relayed: _Relayed, seen: StreamSeen, failure: ApiError | None, ended: bool,
                   edit: ResponseEdit | None) -> None:
    """A relayed stream's end in the counters (and in its kept Response, `edit`): failed, or whole."""
    failed = (failure is not None and not ended) or seen.error_status is not None   # a drop after its end: none
    if edit is not None:
        await edit.ended(failure)
    relayed.count(seen.usage, [] if failed else seen.finish_reasons)
    if failed:   # a failed request all the same, though its status was 200 (counted before a write may fail)
        relayed.metrics.errors.labels(status=str(seen.error_status or failure.status)).inc()   # the upstream's first
    else:
        relayed.series.e2e.observe(time.perf_counter() - relayed.received)


def _error_tail(error: ApiError, responses: bool, sequence_number: int) -> bytes:
    """Our error as a stream's last event(s); a Responses `error` event numbered after the stream's last."""
    body = error.body()["error"]
    if responses:
        event = {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"],
                 "sequence_number": sequence_number}
        return b"event: error\ndata: " + escaped_json(event) + b"\n\n"
    return b"data: " + escaped_json({"error": body}) + b"\n\ndata: [DONE]\n\n"


async def _events(pool: Pool, upstream: UpstreamResponse) -> AsyncIterator[bytes | ApiError]:
    """The upstream stream's SSE events as they arrive; if it fails (dropped, a broken chunk, an event over
    MAX_EVENT_BYTES), last our 502 for it."""
    tail = bytearray()
    try:
        async with contextlib.aclosing(upstream.chunks()) as body:
            async for data in body:
                for event in split_events(tail, data):
                    yield event
                if len(tail) > MAX_EVENT_BYTES:
                    yield _upstream_failed(pool, "sent an event too large to relay", UpstreamTooLarge(
                        f"an event over {MAX_EVENT_BYTES} bytes"), "upstream_error")
                    return
    except (UpstreamDisconnected, OSError) as exc:
        yield _upstream_failed(pool, "dropped the stream", exc, "upstream_disconnected")
        return
    if tail.strip() and whole(bytes(tail.rstrip(b"\r"))):
        yield bytes(tail.rstrip(b"\r"))
