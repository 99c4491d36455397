"""Answering from local pools: each prompt's engine request streamed back, its deltas assembled into choices (choice
index = prompt × n + sample) and written as SSE chunks or as one JSON body. On a pool whose chat template thinks, each
reply's reasoning is split from its content as its deltas arrive (`gateway.openai.reasoning`): `reasoning_content`
beside `content`, in the message and in the stream's deltas.

The engine's side and the client's side run apart. `LocalResponse.run` consumes the engine's deltas and returns as
soon as the engine is done with every request, so the caller gives the KV credits back then (credits follow the
engine, not the socket). A stream's chunks go to a writer task that writes them as fast as the client reads; a client
that takes nothing for `write_timeout` seconds (`gateway.write_timeout`) has its connection aborted, its engine requests
aborted if they still run, a WARNING logged and `cliffguard_client_write_timeouts_total` counted. A JSON body (and
every other response the gateway sends) is written by `gateway.app`'s write middleware under the same limit.

What the gateway holds unsent is bounded (`ResponseBuffers`): a stream whose queued chunks exceed
`gateway.max_response_buffer_bytes` (1 MiB), or that adds one while all responses' unsent bytes (JSON bodies being
written too; `cliffguard_buffered_response_bytes`) exceed `gateway.max_buffered_bytes` (256 MiB), **pauses** its
engine requests (`cliffguard_paused_responses_total`): they keep their KV blocks and the response its credits, but are
not stepped (no preemption, no recompute; deltas already computed still arrive). They resume once the stream is under
half its bound and the total under half its own. A paused client reading nothing for `write_timeout` is aborted too.

Leaving early for any reason — the client goes away mid-stream, the writer times out, the handler is cancelled, or
the gateway's drain ends (its 503 `server_shutting_down` then the answer: a stream's error event) — closes the engine
streams, which aborts their requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.outputs import RequestDelta, SampleDelta
from engine.client import EngineDeadError, RequestFailedError
from gateway.openai import echo, objects
from gateway.admission import Placed
from gateway.client_writes import RESPONSE_BUFFERS, ClientGone, ResponseBuffers, escaped_json, start_sse, write_within
from gateway.monitoring.metrics import GatewayMetrics, HeldLatencies
from gateway.openai.chat import ChatRequest
from gateway.openai.completions import CompletionRequest
from gateway.openai.errors import ApiError, drain_cut, engine_error, renamed_field
from gateway.openai.harmony import HarmonySplitter
from gateway.openai.reasoning import ReasoningSplitter, Think, think_end_id
from gateway.openai.tool_formats import format_for
from gateway.openai.tools import ToolCallStream, ToolFormat
from gateway.engine_streams import Routed, engine_request_id, merged
from pools.pool import Pool

__all__ = ["LocalResponse", "Routed", "engine_request_id", "merged"]

log = logging.getLogger("cliffguard.gateway")

@dataclass
class _Choice:
    """The running state of one choice (prompt i, sample j) of a response."""

    index: int
    pool: Pool
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    sent_role: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    tool_stream: ToolCallStream | None = None   # a streamed chat with tools: held text, calls at the end
    reasoning: ReasoningSplitter | None = None  # a thinking model's chat: its reasoning split from its content
    token_chars: int = 0   # a streamed completion's text_offset: characters of its tokens so far (sent or held)
    echoed: bool = False   # a streamed completion's echo (`gateway.openai.echo`) went out

    @property
    def content_text(self) -> str:
        """The reply so far but its reasoning (all of it for a model that does not think)."""
        return self.text if self.reasoning is None else self.reasoning.content


class LocalResponse:
    """One response to a chat or completion request served by local pools, built as its deltas arrive.

    Lives for one HTTP request, on the event loop: `await run()` while holding the request's credits (it returns when
    the engine is done), then `await finish()` (the stream's end or the JSON response) or `await result()` (a batch
    line's body); `abandon()` if the handler is cancelled between them. `received` is when the request arrived
    (time.perf_counter), so time to first token and end-to-end latency include parsing and counting. `buffers` bounds
    what a stream holds unsent (by default the app's `RESPONSE_BUFFERS`). `think` is a chat prompt's
    `gateway.openai.reasoning.think_mode`, as its grammar was built for (None: no reasoning is split from the replies).
    """

    def __init__(self, request: web.Request | None, req: ChatRequest | CompletionRequest, routed: Routed, *,
                 placed: dict[str, Placed], received: float, metrics: GatewayMetrics, write_timeout: float = 30.0,
                 tenant: str = "default", buffers: ResponseBuffers | None = None,
                 think: Think | str | None = None) -> None:
        self.request, self.req, self.routed, self.placed = request, req, routed, placed
        self.chat, self.received, self.metrics = isinstance(req, ChatRequest), received, metrics
        self.latencies = HeldLatencies()   # observed once no rerun can replace this run (`retryable`)
        self.request_id = objects.new_id("chatcmpl" if self.chat else "cmpl")
        self.created, n = int(time.time()), req.params.n
        self.choices = {i * n + j: _Choice(i * n + j, pool) for i, (pool, _) in enumerate(routed) for j in range(n)}
        pools = list(dict.fromkeys(pool.name for pool, _ in routed))
        self.headers = {"x-cliffguard-pool": ",".join(pools),
                        "x-cliffguard-replica": ",".join(str(placed[name].replica) for name in pools)}
        self.want_logprobs = req.params.logprobs is not None
        self.echo = not self.chat and req.echo            # each choice's text begins with its prompt
        self._prompt_logprobs: dict[int, tuple[list, list]] = {}   # prompt index -> the engine's (echo)
        self.tool_format: ToolFormat | None = None   # a chat offering tools (not tool_choice "none"): calls parsed
        self.calls_only = False   # tool_choice required or named: a reply is calls only
        if self.chat and req.offers_calls:
            self.tool_format = format_for(routed[0][0].tokenizer, req.callable_tools)
            self.calls_only = req.tool_choice.mode in ("required", "function")
            if req.stream:
                for choice in self.choices.values():
                    choice.tool_stream = ToolCallStream(self.tool_format, self.calls_only, req.parallel_tool_calls)
        self.response: web.StreamResponse | None = None   # the SSE response, once started
        self.error: ApiError | None = None               # the engine's failure, answered by `finish`
        self.write_timeout, self.tenant = write_timeout, tenant   # tenant: whose prefix-cache partition it uses
        self.think = think if self.chat else None        # `gateway.openai.reasoning.think_mode` of the prompt
        self.buffers = request.app.get(RESPONSE_BUFFERS) if buffers is None and request is not None else buffers
        self._cached: dict[int, int] = {}               # prompt index -> its tokens from the prefix cache
        self._first_at, self._last_at = {}, {}           # prompt index -> its first / last token's perf_counter
        self._chunks: deque[bytes] = deque()             # SSE events the writer has not written yet
        self._wake, self._closing = asyncio.Event(), False   # chunks added or the stream ends; the last chunk queued
        self._writer: asyncio.Task | None = None
        self._runner: asyncio.Task | None = None
        self._write_error: ClientGone | None = None   # the client stopped reading or went away

    def _split_reasoning(self) -> None:
        """On a pool whose chat template thinks (`think` given), each choice's reply split into reasoning and content;
        it starts inside the think block when the prompt opened one (a grammar on it lets it think first)."""
        if self.think == "harmony":   # a harmony reply: its channels say (gateway.openai.harmony)
            for choice in self.choices.values():
                choice.reasoning = HarmonySplitter()
        elif self.think is not None:
            for choice in self.choices.values():
                choice.reasoning = ReasoningSplitter(self.think.opened,
                                                     think_end_id(choice.pool.tokenizer, self.think.end),
                                                     continued=getattr(self.req, "continued", None) is not None,
                                                     tags=self.think.tags)

    def reasoning_tokens(self) -> int | None:
        """The output tokens of the choices' reasoning (None when the model does not think)."""
        splitters = [c.reasoning for c in self.choices.values() if c.reasoning is not None]
        return sum(s.reasoning_tokens for s in splitters) if splitters else None

    async def run(self) -> None:
        """Consume the engine's deltas until every engine request finished (a stream's chunks are queued
        for the writer as they come). An engine failure is kept in `error` for `finish`; a client that
        stopped reading ends it early with ClientGone (its requests aborted)."""
        self._runner = asyncio.ensure_future(self._consume())
        try:
            await self._runner
        except asyncio.CancelledError as exc:
            if self._write_error is not None:
                raise self._write_error from None
            if (cut := drain_cut(exc)) is not None:   # the drain ended: what was sent ends with this error
                self.error = cut
                return
            self.abandon()
            raise
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            self.error = engine_error(exc)
        finally:
            if not self.retryable:   # this run is the client's (one lost with its worker is not observed)
                self.latencies.release()

    def abandon(self) -> None:
        """The handler was cancelled: nobody will finish the stream, so its writer stops (else it waits for ever)."""
        if self._writer is not None:
            self._writer.cancel()

    async def finish(self) -> web.StreamResponse:
        """After `run`: the JSON response, or the stream's last events (the error event, or the usage
        chunk, then `[DONE]`) once the writer wrote everything. An error before any chunk is raised."""
        if self.error is not None and not self._chunks and self._writer is None:
            raise self.error
        if not self.req.stream:
            return self._json()
        if self.error is not None:   # the stream's error event: a request that failed all the same
            self.metrics.errors.labels(status=str(self.error.status)).inc()
        self._queue_tail()
        self._closing = True
        self._start_writer()
        await self._writer
        if self._write_error is not None:
            raise self._write_error
        return self.response

    def _queue_tail(self) -> None:
        """A stream's last events: the error, or the usage chunk if asked for; then `[DONE]`."""
        if self.error is not None:
            self._queue(self.error.body())
        elif self.req.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            cached, reasoning = (self.cached_tokens(), self.reasoning_tokens()) if self.chat else (None, None)
            self._queue(objects.usage_chunk(self.request_id, self.req.model, self.created, obj, *self._usage(),
                                            cached, reasoning))
        self._push(b"data: [DONE]\n\n")

    @property
    def retryable(self) -> bool:
        """The engine died before the client saw anything (no chunk streamed; a JSON answer is built at the end)."""
        return self.error is not None and self.error.code == "engine_dead" and self._writer is None

    async def result(self) -> dict[str, Any]:
        """After `run`, for a batch line (no HTTP request): the JSON body; an engine failure raises finish's ApiError."""
        if self.error is not None:
            raise self.error
        return self._body()

    async def _consume(self) -> None:
        if self.chat:
            self._split_reasoning()
        for pool, ids in self.routed:
            self.metrics.pool_series(pool.name).prompt_tokens.inc(len(ids))
        events = merged(self.routed, self.req.params, self.req.priority, self.request_id, self.placed, self.tenant)
        async with contextlib.aclosing(events):
            async for i, out in events:
                self._observe(i, out)
                chunk_choices = self._apply(i, out)
                if self.req.stream and chunk_choices:
                    self._queue_chunk(chunk_choices)

    def _queue_chunk(self, chunk_choices: list[dict[str, Any]]) -> None:
        """One stream chunk of the choices' deltas (OpenAI's chat or completion chunk). A chat of several choices
        opens them all first, in index order, their roles there (vLLM's; the SDK's stream helper needs it)."""
        make = objects.chat_chunk if self.chat else objects.completion_chunk
        so_far = objects.usage(*self._usage()) if self.req.continuous_usage else None
        if self.chat and len(self.choices) > 1 and not all(c.sent_role for c in self.choices.values()):
            opened = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in sorted(self.choices)]
            self._queue(make(self.request_id, self.req.model, self.created, opened, self.req.include_usage, so_far))
            for choice in self.choices.values():
                choice.sent_role = True
            for entry in chunk_choices:
                entry["delta"].pop("role", None)
        self._queue(make(self.request_id, self.req.model, self.created, chunk_choices, self.req.include_usage, so_far))

    def _observe(self, i: int, out: RequestDelta) -> None:
        """Latency and token metrics of prompt i's delta (no latency where no client waits: a batch line's, a
        background Response's); its pool's prompts are prefilled once each has streamed a token."""
        now, pool, timed = time.perf_counter(), self.routed[i][0].name, self.request is not None
        series, new_tokens = self.metrics.pool_series(pool), sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            first = i not in self._first_at
            self._first_at.setdefault(i, now)
            self.placed[pool].observe(new_tokens, prefilled=first and all(
                j in self._first_at for j, (p, _) in enumerate(self.routed) if p.name == pool))
            if timed and first:
                self.latencies.observe(series.ttft, now - self.received)
            elif timed:   # per sample, as vLLM's (each of n samples is a request of its own there)
                for c in (c for c in out.outputs if c.delta_token_ids):
                    self.latencies.observe(series.itl, (now - self._last_at[i]) / len(c.delta_token_ids))
            self._last_at[i] = now
            series.generation_tokens.inc(new_tokens)
        if out.finished and timed:
            self.latencies.observe(series.e2e, now - self.received)
            if "queue_time" in out.metrics:
                self.latencies.observe(series.queue_time, out.metrics["queue_time"])

    def _apply(self, i: int, out: RequestDelta) -> list[dict[str, Any]]:
        """Add prompt i's delta to its choices; the stream chunk's choices (empty when not streaming). A request
        that failed before any token raises its error (a ValueError naming the field, which `run` answers), as
        does one whose grammar failed midway (its output is not what the schema asks: never a 'stop')."""
        grammar_failed = out.error is not None and out.error.startswith("response_format:")
        if out.finished and out.error is not None and (grammar_failed or not any(c.num_tokens for c in out.outputs)):
            raise ValueError(renamed_field(out.error, {"response_format": self.req.structured_param,
                                                       "prompt": self.req.prompt_param}))
        if out.finished and "queue_time" in out.metrics:   # sent once, with the final delta of a request that ran
            self._cached[i] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self._prompt_logprobs[i] = (out.prompt_logprobs, out.prompt_top_logprobs)
        chunk_choices = []
        for c in out.outputs:
            choice = self.choices[i * self.req.params.n + c.index]
            if choice.finish_reason is not None:   # reported again with the request's last sample: nothing new
                continue
            if self.echo and self.req.echo_only:   # max_tokens 0: the prompt scored, the token made is no answer's
                c = SampleDelta(c.index, "", [], 0, c.finish_reason and "length", c.stop_reason)
            choice.text += c.delta_text
            parts = self._reasoning_parts(choice, c)
            choice.num_tokens = c.num_tokens
            if self.want_logprobs:
                choice.token_ids.extend(c.delta_token_ids)
                choice.logprobs.extend(c.delta_logprobs or [])
                choice.top_logprobs.extend(c.delta_top_logprobs or [])
            if c.finish_reason is not None and choice.finish_reason is None:
                choice.finish_reason = c.finish_reason   # counted as the answer says it (a reply of calls: calls_finish)
                calls = c.finish_reason == "stop" and self.tool_format is not None and bool(self._reply(choice)[1])
                reason = self.req.calls_finish if calls else c.finish_reason
                self.latencies.count(self.metrics.finished, choice.pool.name, reason)
            has_logprobs = self.want_logprobs and bool(c.delta_token_ids)
            if self.req.stream and (c.delta_text or c.finish_reason or has_logprobs or self.echo and not choice.echoed):
                chunk_choices.append(self._stream_choice(choice, c, has_logprobs, parts))
        return chunk_choices

    def _echo(self, choice: _Choice) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's echo: its prompt's text, and its prompt tokens' logprobs when asked for."""
        i = choice.index // self.req.params.n
        text, ids = echo.echo_text(self.req.prompts[i], choice.pool), self.routed[i][1]
        if not self.want_logprobs:
            return text, None
        logprobs, top = self._prompt_logprobs.get(i, ([], []))
        return text, echo.prompt_logprobs(ids, logprobs, top, choice.pool)

    @staticmethod
    def _reasoning_parts(choice: _Choice, c: SampleDelta) -> tuple[str, str] | None:
        """A thinking model's delta as (reasoning, content) that can go out now (what was held back too,
        at the reply's end); None for a model that does not think."""
        if choice.reasoning is None:
            return None
        reasoning, content = choice.reasoning.feed(c.delta_text, len(c.delta_token_ids), c.delta_token_ids)
        if c.finish_reason is not None and choice.finish_reason is None:
            rest_reasoning, rest_content = choice.reasoning.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        return reasoning, content

    def _stream_choice(self, choice: _Choice, c: SampleDelta, has_logprobs: bool,
                       parts: tuple[str, str] | None) -> dict[str, Any]:
        ids, pool, lps, tops = c.delta_token_ids, choice.pool, c.delta_logprobs or [], c.delta_top_logprobs or []
        if not self.chat:   # offsets count the tokens' characters, sent or held (the 4 before may begin one)
            head, head_lp = self._echo(choice) if self.echo and not choice.echoed else ("", None)
            choice.echoed, choice.token_chars = True, choice.token_chars + len(head)
            lp, choice.token_chars = objects.completion_logprobs_from(
                ids, lps, tops, pool.token_text, pool.token_bytes, choice.token_chars,
                choice.token_ids[-len(ids) - 4:-len(ids)]) if has_logprobs else (None, choice.token_chars)
            lp = echo.joined(head_lp, lp) if head_lp is not None else lp
            return {"index": choice.index, "text": head + c.delta_text, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        lp = objects.chat_logprobs(ids, lps, tops, pool.token_text, pool.token_bytes) if has_logprobs else None
        delta: dict[str, Any] = {} if choice.sent_role else {"role": "assistant"}   # the role in the first only
        choice.sent_role = True
        reasoning, content = parts or ("", c.delta_text)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or not reasoning:
            delta["content"] = content
        finish_reason = c.finish_reason
        if choice.tool_stream is not None:
            stream, text = choice.tool_stream, choice.content_text
            delta["content"] = stream.content_delta(text)
            if finish_reason is None:
                calls = stream.call_deltas(text)
            else:
                rest, calls, num_calls = stream.finish(text, cut=finish_reason == "length")
                delta["content"] += rest
                if num_calls:
                    finish_reason = self.req.calls_finish if finish_reason == "stop" else finish_reason
            delta["content"] = delta["content"] or None   # OpenAI's null, not "", beside calls or nothing
            if calls:
                delta.update(objects.calls_field(calls, self.req.legacy))
        return {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

    # --- the client's side of a stream ----------------------------------------------------------
    def _queue(self, obj: dict[str, Any], event: str | None = None) -> None:
        """One SSE event for the writer (started with the first); `event` names its type (the Responses API)."""
        head = f"event: {event}\n".encode() if event else b""
        self._push(head + b"data: " + escaped_json(obj) + b"\n\n")
        self._start_writer()

    def _push(self, chunk: bytes) -> None:
        """Queue a chunk for the writer, counted in `buffers` (which may pause the engine requests)."""
        if self._writer is not None and self._writer.done():
            return   # the writer stopped (the client is gone): nothing more is written
        self._chunks.append(chunk)
        if self.buffers is not None:
            self.buffers.add(self, len(chunk))

    def _drop_chunks(self) -> None:
        """Forget what was not written (the stream ended or its client is gone)."""
        self._chunks.clear()
        if self.buffers is not None:
            self.buffers.forget(self)

    def set_paused(self, paused: bool) -> None:
        """Pause (True) or resume this response's engine requests, which keep their KV blocks and the
        response its credits meanwhile (`ResponseBuffers` decides; `AsyncEngineClient.pause`)."""
        if self._runner is not None and self._runner.done():
            return   # they have ended (a stream's tail is written after them): nothing to pause, nor count
        if paused:
            self.metrics.paused_responses.labels(pool=self.routed[0][0].name).inc()
        for i, (pool, _) in enumerate(self.routed):
            self.placed[pool.name].client.pause(engine_request_id(self.request_id, i, len(self.routed)), paused)

    def _start_writer(self) -> None:
        if self._writer is None:   # the client sees this run: it will not run again
            self.latencies.release()
            self._writer = asyncio.ensure_future(self._write())
            self._writer.add_done_callback(lambda _: self._drop_chunks())
        self._wake.set()

    async def _write(self) -> None:
        """Start the SSE response, write the queued events as the client takes them, end the stream
        once `finish` queued the last. A client that takes nothing for `write_timeout` seconds
        (`write_within`), or that is gone, stops the engine side (`run` raises ClientGone)."""
        def within(write):
            return write_within(self.request, write, self.write_timeout, self.metrics, self.routed[0][0].name,
                                f"{self.request_id}: its stream (aborted with its engine requests)")

        try:
            if self.response is None:
                self.response = await within(start_sse(self.request, self.headers))
            while True:
                while self._chunks:
                    chunk = self._chunks[0]   # unsent (and counted) until written
                    await within(self.response.write(chunk))
                    self._chunks.popleft()
                    if self.buffers is not None:
                        self.buffers.sent(self, len(chunk))
                if self._closing:
                    await within(self.response.write_eof())
                    return
                self._wake.clear()
                await self._wake.wait()
        except (ConnectionError, RuntimeError) as exc:   # RuntimeError: aiohttp's "transport is closing"
            self._write_error = exc if isinstance(exc, ClientGone) else ClientGone(f"client went away: {exc}")
            self._drop_chunks()
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()

    def _json(self) -> web.Response:
        return web.json_response(self._body(), headers=self.headers)

    def _reply(self, choice: _Choice) -> tuple[str | None, list]:
        """A whole choice's content and tool calls (none without tools): a call max_tokens cut kept as far as it
        got, nothing but calls under tool_choice required or named (what is left is a marker cut short), the
        first call only under parallel_tool_calls false or in a format of one call (`ToolFormat.kept_calls`)."""
        if self.tool_format is None:
            return choice.content_text, []
        content, calls = self.tool_format.parse_reply(choice.content_text, cut=choice.finish_reason == "length")
        return None if self.calls_only else content, self.tool_format.kept_calls(calls, self.req.parallel_tool_calls)

    def _body(self) -> dict[str, Any]:
        body_choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            lp, (head, head_lp) = None, self._echo(choice) if self.echo else ("", None)
            if self.want_logprobs:
                lp = objects.chat_logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs,
                                           choice.pool.token_text, choice.pool.token_bytes) if self.chat else \
                    objects.completion_logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs,
                                                choice.pool.token_text, choice.pool.token_bytes, len(head))
            if not self.chat:
                lp = echo.joined(head_lp, lp) if head_lp is not None else lp
                body_choices.append(objects.completion_choice(index, head + choice.text, lp, choice.finish_reason))
                continue
            finish_reason = choice.finish_reason
            content, calls = self._reply(choice)
            if self.tool_format is not None and calls and finish_reason == "stop":
                finish_reason = self.req.calls_finish
            if (reasoning := choice.reasoning) is not None:   # a thinking model's: null where a part is empty
                content = content or None
            thought = (reasoning.reasoning or None) if reasoning is not None else None
            body_choices.append(objects.chat_choice(index, content, lp, finish_reason, [c.as_openai() for c in calls],
                                                    thinks=reasoning is not None, reasoning_content=thought,
                                                    legacy=self.req.legacy))
        if self.chat:
            return objects.chat_response(self.request_id, self.req.model, self.created, body_choices, *self._usage(),
                                         self.cached_tokens(), self.reasoning_tokens())
        return objects.completion_response(self.request_id, self.req.model, self.created, body_choices, *self._usage())

    def _usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens) of the whole response."""
        return (sum(len(ids) for _, ids in self.routed), sum(c.num_tokens for c in self.choices.values()))

    @property
    def engine_cache_hits(self) -> dict[int, int]:
        """Prompt index -> its `num_cached_tokens` as its engine request reported it (with its final delta;
        a prompt whose request never ran, or has not finished, is missing)."""
        return dict(self._cached)

    def cached_tokens(self) -> int:
        """The response's prompt tokens whose K/V came from the prefix cache, summed over its prompts:
        each engine request's `num_cached_tokens` (its first admission's hit, counted once for its n
        samples), which arrives with its final delta, so complete once `run` returned."""
        return sum(self._cached.values())
