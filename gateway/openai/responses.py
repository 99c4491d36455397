"""The Responses API's request and answer: its body read as a chat request (`parse_responses`), its answer
written as a Response object or as the typed stream events (`ResponsesAnswer`). Keeping responses
(`store`, `previous_response_id`, `background`, GET / DELETE / cancel) is `gateway.openai.stored_responses`.

Read: `input` as text or items (messages with text parts, `function_call` and `function_call_output`),
`instructions` (a system message first), function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema: the chat's response_format), `max_output_tokens`,
`temperature`, `top_p`, `stream`, `top_logprobs`, `metadata`, `store`, `background`, and the items of
the earlier turns a `previous_response_id` names (looked up by the caller, passed as `prior`). Routing,
credits and the engine treat it as the chat it is.

Streamed: `response.created`, `response.in_progress`, then per output item `response.output_item.added`,
for the message `response.content_part.added` / `response.output_text.delta`... / `response.output_text.done`
/ `response.content_part.done`, for a function call `response.function_call_arguments.delta` / `.done`,
then `response.output_item.done`; last `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it) with the whole response. Each event carries `sequence_number`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.openai import protocol as api
from gateway.openai import objects
from gateway.openai.protocol import ApiError, ChatRequest, bad_request
from gateway.local_answer import LocalResponse
from gateway.openai.tools import ToolCall
from pools.config.gateway_spec import RequestLimits

_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
           "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "metadata",
           "user", "truncation", "include", "stream_options", "top_logprobs", "seed", "service_tier",
           "priority", "background"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses API request: the chat it is, and what the Response keeps beside it."""

    chat: ChatRequest
    items: list[dict[str, Any]]         # the conversation's input items: the earlier turns' first, then its own
    store: bool = True                  # keep the Response (OpenAI's default), where the gateway has a store
    background: bool = False            # answer at once (queued), run it, keep the result
    previous_response_id: str | None = None


def _json_type(value: Any) -> str:
    return api._json_type(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"expected a string or an array of content parts, got {_json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else _json_type(part)
            raise bad_request(f"{where}[{j}].type", f"only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text", f"expected a string, got {_json_type(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    items = body.get("input")
    if items is None:
        raise bad_request("input", "is required")
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input", "expected a string or a non-empty array of input items")
    return items


def _messages(body: dict[str, Any], prior: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions`, the earlier turns' items (`prior`) and `input` as chat messages (consecutive
    function calls are one assistant turn). A bad item is named by its place in `input`."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions", f"expected a string, got {_json_type(instructions)}")
        messages.append({"role": "system", "content": instructions})
    items = input_items(body)
    for i, item in enumerate(prior + items):
        where = f"input[{i - len(prior)}]" if i >= len(prior) else f"previous_response_id (its item {i})"
        if not isinstance(item, dict):
            raise bad_request(where, f"expected an object, got {_json_type(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key}", f"expected a string, got {_json_type(item.get(key))}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id", f"expected a string, got {_json_type(item.get('call_id'))}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output", ""), f"{where}.output")})
        else:
            raise bad_request(f"{where}.type", "must be message, function_call or function_call_output, "
                              f"got {kind!r}")
    return messages


def _chat_tools(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's flat function tools and tool_choice in the chat's shape."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", f"expected an array, got {_json_type(tools)}")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else _json_type(tool)
                raise bad_request(f"tools[{i}].type", f"only 'function' tools are supported, got {kind!r}")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            if function.get("strict") is None:
                function["strict"] = True   # the Responses API's default, unlike chat's
            chat_tools.append({"type": "function", "function": function})
        out["tools"] = chat_tools or None
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def parse_responses(body: Any, limits: RequestLimits = RequestLimits(),
                    prior: list[dict[str, Any]] | None = None) -> ResponsesRequest:
    """A Responses API body as the equivalent chat request and what its Response keeps; `prior`: the
    input and output items of the conversation `previous_response_id` names (found by the caller).
    ApiError 400 naming the Responses field."""
    body = api._require_object(body)
    for key in body:
        if key not in _FIELDS:
            raise bad_request(key, "unrecognized request field")
    flags = {key: default if body.get(key) is None else body[key]
             for key, default in (("store", True), ("background", False))}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise bad_request(key, f"expected a boolean, got {_json_type(value)}")
    if flags["background"] and not flags["store"]:
        raise bad_request("background", "a background response is kept until it is fetched; it needs store: true")
    if flags["background"] and body.get("stream"):
        raise bad_request("background", "a background response cannot stream here; create it, then poll "
                          "GET /v1/responses/{id}")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id", f"expected a string, got {_json_type(previous)}")
    _check_unsupported(body)
    metadata = _metadata(body.get("metadata"))
    prior = prior or []
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body, prior), **_chat_tools(body)}
    for key in ("temperature", "top_p", "parallel_tool_calls", "seed", "priority", "stream", "top_logprobs"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("top_logprobs") is not None:
        chat["logprobs"] = True
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad_request("text", f"expected an object, got {_json_type(text)}")
        fmt = text.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            if "schema" not in fmt:
                raise bad_request("text.format.schema", "is required")
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        if fmt is not None:
            chat["response_format"] = fmt
    try:
        req = api.parse_chat(chat, limits)
    except ApiError as err:
        raise _renamed(err) from None
    return ResponsesRequest(dataclasses.replace(req, metadata=metadata), prior + input_items(body), **flags,
                            previous_response_id=previous)


def _check_unsupported(body: dict[str, Any]) -> None:
    """Fields OpenAI takes that this server cannot honour: a 400 naming them, never a silent default."""
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation", f"only 'disabled' is supported (an input over the context is a 400, "
                          f"context_length_exceeded), got {body['truncation']!r}")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad_request("service_tier", f"only 'auto' and 'default' are served, got {body['service_tier']!r}")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise bad_request("include", f"expected an array, got {_json_type(include)}")
        for i, value in enumerate(include):
            if value != "message.output_text.logprobs":
                raise bad_request(f"include[{i}]", f"only 'message.output_text.logprobs' is supported, got {value!r}")


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("metadata", f"expected an object, got {_json_type(value)}")
    if len(value) > 16:
        raise bad_request("metadata", f"at most 16 pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64:
            raise bad_request("metadata", f"keys are at most 64 characters, got one of {len(key)}")
        if not isinstance(item, str) or len(item) > 512:
            raise bad_request(f"metadata.{key}", "expected a string of at most 512 characters")
    return dict(value)


# chat field -> the Responses field it came from, for errors
_RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "response_format.json_schema": "text.format", "logprobs": "top_logprobs"}


def _renamed(err: ApiError) -> ApiError:
    param = err.param or ""
    new = _FUNCTION_FIELD.sub(r"tools[\1].", param)   # a chat tool's function.X is a flat tool's X
    for chat, responses in sorted(_RENAMES.items(), key=lambda kv: -len(kv[0])):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            new = responses + param[len(chat):]
            break
    if new == param:
        return err
    return ApiError(err.status, err.message.replace(param, new, 1), param=new, type=err.type, code=err.code,
                    headers=err.headers)


_FUNCTION_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")


def response_object(asked: ResponsesRequest, response_id: str, created_at: float, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, *,
                    structured_format: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's Response object of `asked` as it stands (`status`, the `output` items so far)."""
    req = asked.chat
    choice = req.tool_choice.mode if req.tool_choice.mode != "function" else {
        "type": "function", "name": req.tool_choice.name}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": asked.background, "model": req.model, "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": next((m["content"] for m in req.messages[:1] if m["role"] == "system"), None),
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.params.temperature, "top_p": req.params.top_p,
        "max_output_tokens": req.params.max_tokens, "previous_response_id": asked.previous_response_id,
        "store": asked.store, "tool_choice": choice if req.tools else "none",
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": t.strict} for t in req.tools or []],
        "text": {"format": structured_format or {"type": "text"}}, "usage": usage,
    }


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


Keep = Callable[[dict[str, Any]], Awaitable[bool]]   # stores a finished Response; False if it could not


class ResponsesAnswer(LocalResponse):
    """A Responses API answer from the local pools: the chat's deltas written as Response events, or as
    one Response object. One choice (the Responses API has no `n`). `asked` is the request; the Response
    has the id `response_id` (a background run's, made when it was queued) or a new one; `keep`, if
    given, stores the finished Response before its last bytes go out, so a client that has read it can
    fetch it at once."""

    def __init__(self, *args: Any, asked: ResponsesRequest, response_id: str | None = None,
                 created_at: float | None = None, keep: Keep | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked, self.keep = asked, keep
        self.response_id = response_id or objects.new_id("resp")
        self.created_at = time.time() if created_at is None else created_at
        self._sequence = 0
        self._output: list[dict[str, Any]] = []        # the items streamed so far (completed ones whole)
        self._message: dict[str, Any] | None = None    # the message item being streamed
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}   # call index -> (output index, its item)
        self._started = False
        self._final: dict[str, Any] | None = None     # the finished Response, once `finish` built it

    # --- the Response object ---------------------------------------------------------------------
    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        usage = None
        if status not in ("in_progress", "queued"):
            prompt_tokens, completion_tokens = self._usage()
            usage = response_usage(prompt_tokens, completion_tokens, self.cached_tokens())
        error = self.error.body()["error"] if status == "failed" and self.error is not None else None
        return response_object(self.asked, self.response_id, self.created_at, status, output, usage, error,
                               structured_format=self._format())

    def _format(self) -> dict[str, Any]:
        structured = self.req.params.structured
        if structured is None or self.req.structured_param != "response_format":
            return {"type": "text"}
        if structured.kind == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "name": "response", "schema": json.loads(structured.spec), "strict": True}

    @staticmethod
    def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": status}

    def _status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def _body(self) -> dict[str, Any]:
        choice = self.choices[0]
        content, calls = choice.text, []
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(choice.text)
            calls = calls if self.req.parallel_tool_calls else calls[:1]
        output = []
        if content:
            output.append(self._message_item(objects.new_id("msg"), content, self._status()))
            if self.want_logprobs and not calls:   # each token's, when the reply is all text
                output[-1]["content"][0]["logprobs"] = objects.chat_logprobs(
                    choice.token_ids, choice.logprobs, choice.top_logprobs, choice.pool.token_text)["content"]
        output += [self._call_item(call) for call in calls]
        return self._response(self._status(), output)

    # --- the stream --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> None:
        self._queue({"type": kind, "sequence_number": self._sequence, **fields}, event=kind)
        self._sequence += 1

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._event("response.created", response=self._response("in_progress", []))
            self._event("response.in_progress", response=self._response("in_progress", []))

    def _queue_chunk(self, chunk_choices: list[dict[str, Any]]) -> None:
        self._start()
        for chunk in chunk_choices:
            delta = chunk["delta"]
            if delta.get("content"):
                logprobs = chunk.get("logprobs") if self.tool_format is None else None
                self._text_delta(delta["content"], (logprobs or {}).get("content") or [])
            for entry in delta.get("tool_calls") or []:
                self._close_message()
                self._call_delta(entry)

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        if self._message is None:
            self._message = self._message_item(objects.new_id("msg"), "", "in_progress")
            self._message["content"] = []
            self._output.append(self._message)
            index = len(self._output) - 1
            self._event("response.output_item.added", output_index=index, item=dict(self._message, content=[]))
            self._message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                        content_index=0, part=dict(self._message["content"][0]))
        part = self._message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        self._event("response.output_text.delta", item_id=self._message["id"], output_index=len(self._output) - 1,
                    content_index=0, delta=text, logprobs=logprobs)

    def _close_message(self) -> None:
        message = self._message
        if message is None:
            return
        index = self._output.index(message)
        part = message["content"][0]
        self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                    text=part["text"], logprobs=part["logprobs"])
        self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                    part=dict(part))
        message["status"] = self._status() if self.choices[0].finish_reason else "completed"
        self._event("response.output_item.done", output_index=index, item=dict(message))
        self._message = None

    def _call_delta(self, entry: dict[str, Any]) -> None:
        """One chat `tool_calls` delta entry as Response events: a new call's item (id and name first), then
        `response.function_call_arguments.delta` for each piece of its arguments as the model writes them."""
        if "id" in entry:
            item = self._call_item(ToolCall(entry["function"]["name"], "", entry["id"]), "in_progress")
            self._calls[entry["index"]] = (len(self._output), item)
            self._output.append(item)
            self._event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))
        index, item = self._calls[entry["index"]]
        piece = entry["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=piece)

    def _close_calls(self) -> None:
        for index, item in self._calls.values():
            if item["status"] == "in_progress":
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
                item["status"] = "completed"
                self._event("response.output_item.done", output_index=index, item=dict(item))

    # --- the end ---------------------------------------------------------------------------------
    async def finish(self) -> web.StreamResponse:
        """The finished Response, kept (`keep`) before it is sent: as the JSON body, or as the stream's
        last event."""
        if self.error is not None and not self._chunks and self._writer is None:
            raise self.error
        self._final = self._finished()
        if self.keep is not None and not await self.keep(self._final):
            self._final["store"] = False   # the store failed (said in the log): the answer says it was not kept
        return await super().finish()

    def _finished(self) -> dict[str, Any]:
        """The Response as it ends; a stream's open items are closed (their events queued)."""
        if not self.req.stream:
            return self._body()
        self._start()
        self._close_message()
        if self.error is not None:   # the engine failed it: the Response fails, with the error object
            for _, item in self._calls.values():
                item["status"] = "incomplete" if item["status"] == "in_progress" else item["status"]
            return self._response("failed", self._output)
        self._close_calls()
        return self._response(self._status(), self._output)

    def _json(self) -> web.Response:
        return web.json_response(self._final, headers=self.headers)

    def _queue_tail(self) -> None:
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(self._final["status"],
                                                                                     "response.completed")
        self._event(kind, response=self._final)
