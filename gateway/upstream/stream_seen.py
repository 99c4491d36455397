"""What the relay reads in an upstream's answer (`gateway.upstream.relay`): the client's model name put back
(`rename_model`), how its choices ended (`finish_reasons`), and, event by event, what a stream said so far
(`StreamSeen`: its end, usage, errors, outputs), with the edit a Responses stream the gateway keeps gets
(`ResponseEdit`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.client_writes import escaped_json
from gateway.openai.errors import ApiError
from gateway.upstream.sse import event_fields, json_object, with_data

__all__ = ["ResponseEdit", "StreamSeen", "finish_reasons", "rename_model"]


class ResponseEdit:
    """What the gateway does to a relayed Responses stream that it keeps (`gateway.openai.response_endpoints`):
    `own` rewrites each event's Response in place (its id, store, previous_response_id: the gateway's); `keep`
    keeps the first final one (`response.completed`, `.incomplete`, `.failed`) before that event goes out, and
    says whether it was kept (its `store`); `fail` keeps a failed Response for a stream that ended without one
    (dropped, an `error` event; the error: ours, or None for the upstream's own)."""

    def __init__(self, own: Callable[[dict[str, Any]], None], keep: Callable[[dict[str, Any]], Awaitable[bool]],
                 fail: Callable[[ApiError | None], Awaitable[None]]) -> None:
        self.own, self.keep, self.fail = own, keep, fail
        self.kept = False
        self._last: dict[str, Any] | None = None   # the final event, until `settle` keeps its Response
        self.upstream_error: ApiError | None = None   # what the upstream's own `error` event said

    def edit(self, obj: dict[str, Any]) -> None:
        """An event with a Response (`StreamSeen.relay`): made the gateway's; a final one held for `settle`."""
        self.own(obj["response"])
        if obj.get("type") in _FINAL_RESPONSE_EVENTS and not self.kept:
            self._last, self.kept = obj, True

    async def settle(self, event: bytes, out: bytes | None) -> bytes | None:
        """The event to relay: `out`, or for the final one its Response kept first (shielded: a drain's cut
        meanwhile leaves it kept), with the `store` that says whether it was."""
        if self._last is None:
            return out
        last, self._last = self._last, None
        last["response"]["store"] = await asyncio.shield(self.keep(last["response"]))
        return with_data(event, escaped_json(last))

    def errored(self, obj: dict[str, Any]) -> None:
        """The upstream's `error` event: what a failed Response kept for the stream says, as the client saw it."""
        if self.upstream_error is None:
            code = obj.get("code")
            self.upstream_error = ApiError(502, str(obj.get("message") or "the upstream pool's error event"),
                                           type="server_error", code=code if isinstance(code, str) else None)

    async def ended(self, error: ApiError | None) -> None:
        """The stream is over: a failed Response kept if it ended without its final one (the upstream's own
        error first, then ours)."""
        if not self.kept:
            self.kept = True
            await self.fail(self.upstream_error or error)


def rename_model(obj: Any, model: str) -> Any:
    """The client's model name put back: at the top (a completion, a chunk, a Response) and in a Responses
    stream event's `response`."""
    if isinstance(obj, dict):
        for holder in (obj, obj.get("response")):
            if isinstance(holder, dict) and "model" in holder:
                holder["model"] = model
    return obj


# a Response's status as a finish reason, for request_success
_RESPONSE_FINISH = {"completed": "stop", "incomplete": "length"}


def finish_reasons(obj: Any, responses: bool) -> list[str]:
    """How an answer (or a stream's chunk, or a Responses event's `response`) says its choices ended."""
    if not isinstance(obj, dict):
        return []
    if responses:
        holder = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        reason = _RESPONSE_FINISH.get(holder.get("status")) if holder.get("object") == "response" else None
        return [reason] if reason else []
    choices = obj.get("choices")
    return [c["finish_reason"] for c in choices if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)] \
        if isinstance(choices, list) else []


# A Responses stream's last events; after the upstream's own `error` event too, ours would only repeat it.
# A tuple: `in` compares, hashing nothing (an event's `type` may be a list).
_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error")
# events that carry no output: the Response announced before it runs, and failures
_NOT_OUTPUT = ("response.created", "response.in_progress", "response.queued", "response.failed", "error")


class StreamSeen:
    """What one relayed stream's events said so far: whether its last event came (`ended`), the last
    `usage` it reported (a chat stream's usage chunk, a Responses stream's final Response; vLLM's
    continuous usage stats repeat running totals in every chunk, so only the last is counted), its last
    `sequence_number` (a Responses stream: our error event follows it), how many events held output (a
    chunk, or a Responses event past the ones that announce the Response before it runs: time to first token
    counts to the first of them), the status its first error event says (`error_status`: an `error` object's
    numeric code, vLLM's, else 502; a Responses `error` or `response.failed` event: 502). Events are read as the
    SSE spec says (`gateway.upstream.sse`). With an `edit`, each event's Response is made the gateway's
    (`ResponseEdit`)."""

    def __init__(self, responses: bool = False, hide_usage: bool = False, edit: ResponseEdit | None = None) -> None:
        self.responses, self.hide_usage, self.edit = responses, hide_usage, edit
        self.ended = False
        self.usage: Any = None
        self.sequence_number = -1
        self.num_outputs = 0
        self.finish_reasons: list[str] = []
        self.error_status: int | None = None

    def relay(self, event: bytes, model: str) -> bytes | None:
        """`event` to relay, the client's model name put back into the JSON object of its data, noted;
        None for the usage chunk the client did not ask for (`_Relayed.hide_usage`)."""
        kind, data = event_fields(event)
        self.ended = self.ended or data == b"[DONE]" or (self.responses and kind in _FINAL_RESPONSE_EVENTS)
        obj = json_object(data)
        if obj is None:   # `data:[DONE]` goes on as `data: [DONE]`, for clients that look for that line
            return with_data(event, data) if data == b"[DONE]" else event
        self.num_outputs += obj.get("type") not in _NOT_OUTPUT and "error" not in obj and obj.get("choices") != []
        self.ended = self.ended or (self.responses and obj.get("type") in _FINAL_RESPONSE_EVENTS)
        if self.error_status is None:
            self.error_status = _error_status(obj, kind, self.responses)
        self.finish_reasons += finish_reasons(obj, self.responses)
        holder = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        if holder.get("usage") is not None:
            self.usage = holder["usage"]
        if type(obj.get("sequence_number")) is int:
            self.sequence_number = obj["sequence_number"]
        if self.hide_usage and "usage" in obj:
            if obj["usage"] is not None and obj.get("choices") == []:
                return None
            if obj["usage"] is None:
                del obj["usage"]
        if self.edit is not None and isinstance(obj.get("response"), dict):
            self.edit.edit(obj)
        elif self.edit is not None and obj.get("type") == "error":
            self.edit.errored(obj)
        return with_data(event, escaped_json(rename_model(obj, model)))   # half an emoji ("\ud83d") as it came


def _error_status(obj: dict[str, Any], kind: str, responses: bool) -> int | None:
    """The HTTP status an upstream's stream event says its request failed with; None: not an error event."""
    if responses:
        return 502 if kind in ("error", "response.failed") or obj.get("type") in ("error", "response.failed") \
            else None
    error = obj.get("error")
    if error is None:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if type(code) is int and 400 <= code <= 599 else 502
