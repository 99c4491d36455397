"""The Responses API's request and answer: its body read as a chat request (`parse_responses`), its answer
written as a Response object or as the typed stream events (`ResponsesAnswer`). Keeping responses
(`store`, `previous_response_id`, `background`, GET / DELETE / cancel) is `gateway.openai.stored_responses`.

Read (the body checked against its model, `ResponsesBody`, then built into a chat body for `parse_chat`,
whose refusals are renamed to the Responses fields): `input` as text or items (messages with text parts,
`function_call` and `function_call_output`), `instructions` (a system message first), function `tools`,
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema: the chat's
response_format), `max_output_tokens`, `temperature`, `top_p`, `stream`, `top_logprobs`, `metadata`,
`store`, `background`, `chat_template_kwargs` (as chat's), `reasoning` (checked; whether a model thinks is its
template's: `effort` is chat's `reasoning_effort`, the template variable, and "none" also sets `enable_thinking:
false` unless the request's own `chat_template_kwargs` say otherwise; a summary is never written), `truncation`
(`gateway.openai.truncation`), and the items of the earlier turns a `previous_response_id` names (looked up by the
caller, passed as `prior`). Routing, credits and the engine treat it as the chat it is.

A thinking model's reasoning (`gateway.openai.reasoning`) is a `reasoning` item before the message, its
text one `reasoning_text` content part, its tokens `usage.output_tokens_details.reasoning_tokens`; a
reasoning item sent back as input goes to the next assistant turn as its `reasoning_content`.

Streamed: `response.created`, `response.in_progress`, then per output item `response.output_item.added`,
for the reasoning and the message `response.content_part.added` / `response.reasoning_text.delta` or
`response.output_text.delta`... / their `.done` / `response.content_part.done`, for a function call
`response.function_call_arguments.delta` / `.done`, then `response.output_item.done`; last
`response.completed` (or `response.incomplete` when `max_output_tokens` cut it) with the whole response.
Each event carries `sequence_number`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from engine.sampling import SamplingParams
from gateway.local_answer import LocalResponse
from gateway.openai import objects
from gateway.openai.chat import ChatRequest, parse_chat
from gateway.openai.errors import ApiError, bad_request, convert_body
from gateway.openai.reasoning import reasoning_item
from gateway.openai.responses_body import (InputItem, InputPart, ResponsesBody, TextOptions, chat_tool_choice,
                                           check_calls, response_tool_choice)
from gateway.openai.tools import ToolCall
from pools.config.gateway_spec import RequestLimits


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses API request: the chat it is, and what the Response keeps beside it."""

    chat: ChatRequest
    items: list[dict[str, Any]]         # the conversation's input items: the earlier turns' first, then its own
    store: bool = True                  # keep the Response (OpenAI's default), where the gateway has a store
    background: bool = False            # answer at once (queued), run it, keep the result
    previous_response_id: str | None = None
    truncation: str = "disabled"        # "auto": the earliest turns dropped while the prompt does not fit
    instructions: str | None = None     # the request's own (the Response echoes them; never an input item's)
    text_format: dict[str, Any] | None = None   # the request's own text.format (the Response echoes it)
    tool_choice: str = "auto"           # without tools, the mode the Response echoes ("auto" unless "none" was said)


def parse_responses(body: Any, limits: RequestLimits = RequestLimits(),
                    prior: list[dict[str, Any]] | None = None) -> ResponsesRequest:
    """A Responses API body as the equivalent chat request and what its Response keeps; `prior`: the
    input and output items of the conversation `previous_response_id` names (found by the caller).
    ApiError 400 naming the Responses field."""
    req = convert_body(body, ResponsesBody)
    store, background = req.store is not False, bool(req.background)
    if background and not store:
        raise bad_request("background", "a background response is kept until it is fetched; it needs store: true")
    if background and req.stream:
        raise bad_request("background", "a background response cannot stream here; create it, then poll "
                          "GET /v1/responses/{id}")
    metadata = _metadata(req.metadata)
    prior = prior or []
    earlier = convert_body(prior, list[InputItem], root="previous_response_id")
    chat: dict[str, Any] = {"model": req.model, "messages": _messages(req, earlier), **_chat_tools(req)}
    for key in ("temperature", "top_p", "parallel_tool_calls", "seed", "priority", "stream", "chat_template_kwargs"):
        if (value := getattr(req, key)) is not None:
            chat[key] = value
    if req.reasoning is not None and req.reasoning.effort is not None:   # what it does is chat's
        chat["reasoning_effort"] = req.reasoning.effort
    if "message.output_text.logprobs" in (req.include or ()):   # as OpenAI: `top_logprobs` alone adds none
        chat.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if (fmt := _response_format(req.text)) is not None:
        chat["response_format"] = fmt
    try:
        parsed = parse_chat(chat, limits)
    except ApiError as err:
        raise renamed(err) from None
    own = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else \
        [_kept(item) for item in req.input]
    # the checks after parsing (the context, the grammar) name the Responses fields too
    parsed = dataclasses.replace(parsed, metadata=metadata, max_tokens_param="max_output_tokens",
                                 structured_param="text.format", prompt_param="input")
    return ResponsesRequest(parsed, prior + own, store=store, background=background,
                            previous_response_id=req.previous_response_id, instructions=req.instructions,
                            truncation=req.truncation or "disabled",
                            text_format=None if req.text is None else req.text.format,
                            tool_choice=req.tool_choice if req.tool_choice == "none" else "auto")


_ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ("content",)}


def _kept(item: InputItem) -> dict[str, Any]:
    """An input item as the conversation keeps it: its type's fields, nothing the client added beside
    them (an output item's `id` and `status`, any other key), so that what a chain of
    `previous_response_id` carries is what its prompts read."""
    fields = msgspec.to_builtins(item)
    return {"type": item.type} | {key: fields[key] for key in _ITEM_FIELDS[item.type] if fields[key] is not None}


def _text(content: str | list[InputPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _messages(req: ResponsesBody, earlier: list[InputItem]) -> list[dict[str, Any]]:
    """`instructions`, the earlier turns' items and `input` as chat messages (an assistant message and the
    function calls after it are one assistant turn, as the model wrote them). A bad item is named by its
    place in `input`; calls and their outputs must pair (`check_calls`)."""
    messages = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    own = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    reasoning = None   # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(earlier + own):
        where = f"input[{i - len(earlier)}]" if i >= len(earlier) else f"previous_response_id[{i}]"
        required = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                    "function_call_output": ("call_id", "output"), "reasoning": ()}[item.type]
        if (missing := next((key for key in required if getattr(item, key) is None), None)) is not None:
            raise bad_request(f"{where}.{missing}", f"is required in a {item.type} item")
        if item.type == "reasoning":
            reasoning = _text(item.content or "") or None
            continue
        if item.type == "message":
            messages.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":   # the turn's text, then its calls: one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("reasoning_content", reasoning)
        reasoning = None
    check_calls(earlier + own, own_from=len(earlier))
    return messages


def _chat_tools(req: ResponsesBody) -> dict[str, Any]:
    """The flat function tools and tool_choice in the chat's shape."""
    out: dict[str, Any] = {}
    if req.tools:
        functions = [{k: v for k, v in msgspec.structs.asdict(tool).items() if k != "type" and v is not None}
                     for tool in req.tools]
        out["tools"] = [{"type": "function", "function": {"strict": True, **function}} for function in functions]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        out["tool_choice"] = chat_tool_choice(req.tool_choice)   # "auto" or "none" with no tools: no calls, as asked
    return out


def _response_format(text: TextOptions | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (its json_schema's fields under `json_schema`)."""
    fmt = None if text is None else text.format
    if fmt is not None and fmt.get("type") == "json_schema":
        if "schema" not in fmt:
            raise bad_request("text.format.schema", "is required")
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _metadata(value: dict[str, Any] | None) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
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
            "response_format.json_schema": "text.format", "logprobs": "top_logprobs",
            "tool_choice.function": "tool_choice", "tool_choice.allowed_tools": "tool_choice"}


def renamed(err: ApiError) -> ApiError:
    """A chat request's refusal with the field named as the Responses API names it (`messages` is `input`)."""
    param = err.param or ""
    # a chat tool's function.X is a flat tool's X, and so is an allowed tool's
    new = _ALLOWED_FIELD.sub(r"tool_choice.tools[\1].", _FUNCTION_FIELD.sub(r"tools[\1].", param))
    for chat, responses in sorted(_RENAMES.items(), key=lambda kv: -len(kv[0])):
        if new == param and (param == chat or param.startswith(chat + ".") or param.startswith(chat + "[")):
            new = responses + param[len(chat):]
            break
    if new == param:
        return err
    return ApiError(err.status, err.message.replace(param, new, 1), param=new, type=err.type, code=err.code,
                    headers=err.headers)


_FUNCTION_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")
_ALLOWED_FIELD = re.compile(r"^tool_choice\.allowed_tools\.tools\[(\d+)\]\.function\.")


def response_object(asked: ResponsesRequest, response_id: str, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, sampled: SamplingParams | None = None) -> dict[str, Any]:
    """OpenAI's Response object of `asked` as it stands (`status`, the `output` items so far, `sampled` its run's)."""
    req = asked.chat
    sampled = sampled or req.params   # a field left unset may take the model's advice (`Pool.sampling_defaults`)
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": asked.background, "model": req.model, "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": asked.instructions,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": sampled.temperature, "top_p": sampled.top_p,
        "max_output_tokens": req.params.max_tokens, "previous_response_id": asked.previous_response_id,
        "store": asked.store, "tool_choice": response_tool_choice(req.tool_choice) if req.tools else asked.tool_choice,
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": t.strict} for t in req.tools or []],
        "text": {"format": asked.text_format or {"type": "text"}}, "truncation": asked.truncation, "usage": usage,
    }


# the codes of OpenAI's ResponseError that ours map to; every other code is server_error
_RESPONSE_ERROR_CODES = {"rate_limit_exceeded": "rate_limit_exceeded", "server_error": "server_error", **dict.fromkeys(
    ("context_length_exceeded", "poison_request", "invalid_prompt"), "invalid_prompt")}


def response_error(err: ApiError) -> dict[str, Any]:
    """A failed Response's `error` as OpenAI's `ResponseError` has it: `code` one of its own (which the SDK's
    type lists), ours at the start of the message where it is not one of them."""
    code, message = err.code, err.body()["error"]["message"]
    own = _RESPONSE_ERROR_CODES.get(code or "", "server_error")
    return {"code": own, "message": message if code in (None, own) else f"{code}: {message}"}


Keep = Callable[[dict[str, Any]], Awaitable[bool]]   # stores a finished Response; False if it could not


class ResponsesAnswer(LocalResponse):
    """A Responses API answer from the local pools: the chat's deltas written as Response events, or as
    one Response object. One choice (the Responses API has no `n`). `asked` is the request; the Response
    has the id `response_id` (a background run's, made when it was queued) or a new one; `keep`, if
    given, stores the finished Response before its last bytes go out, so a client that has read it can
    fetch it at once."""

    def __init__(self, *args: Any, asked: ResponsesRequest, response_id: str | None = None,
                 created_at: int | None = None, keep: Keep | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked, self.keep = asked, keep
        self.response_id = response_id or objects.new_id("resp", "_")
        self.created_at = int(time.time()) if created_at is None else created_at   # whole seconds, as OpenAI's
        self._sequence = 0
        self._output: list[dict[str, Any]] = []        # the items streamed so far (completed ones whole)
        self._message: dict[str, Any] | None = None    # the message item being streamed
        self._reasoning: dict[str, Any] | None = None  # the reasoning item, once streamed
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}   # call index -> (output index, its item)
        self._logprobs_from, self._started = 0, False   # the first token whose logprob no delta carried yet
        self._final: dict[str, Any] | None = None     # the finished Response, once `finish` built it

    # --- the Response object ---------------------------------------------------------------------
    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        usage = None
        if status not in ("in_progress", "queued"):
            prompt_tokens, completion_tokens = self._usage()
            usage = objects.response_usage(prompt_tokens, completion_tokens, self.cached_tokens(),
                                   self.reasoning_tokens() or 0)
        error = response_error(self.error) if status == "failed" and self.error is not None else None
        return response_object(self.asked, self.response_id, self.created_at, status, output, usage, error,
                               self.req.params)

    @staticmethod
    def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _reasoning_status(self) -> str:
        """A reasoning item's status once it ends: completed if its block closed, else the Response's."""
        return "completed" if self.choices[0].reasoning.phase == "content" else self._status()

    @staticmethod
    def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": status}

    def _status(self) -> str:
        """How the reply ended: cut by max_tokens or by a failure, incomplete."""
        return "incomplete" if self.choices[0].finish_reason == "length" or self.error is not None else "completed"

    def _body(self) -> dict[str, Any]:
        choice = self.choices[0]
        content, calls = self._reply(choice)
        reasoning = choice.reasoning.reasoning if choice.reasoning is not None else ""
        output = [reasoning_item(objects.new_id("rs", "_"), reasoning, self._reasoning_status())] if reasoning else []
        before, after = self._around_calls(choice.content_text, content or "", calls)
        if before:
            # a message before calls was written whole (a stream closes it at the first call)
            status = "completed" if calls else self._status()
            output.append(self._message_item(objects.new_id("msg", "_"), before, status))
            if self.want_logprobs and not calls:   # the text's tokens: none of the think block's
                k = choice.reasoning.num_tokens_before_content if choice.reasoning is not None else 0
                output[-1]["content"][0]["logprobs"] = objects.chat_logprobs(
                    choice.token_ids[k:], choice.logprobs[k:], choice.top_logprobs[k:],
                    choice.pool.token_text, choice.pool.token_bytes)["content"]
        output += [self._call_item(call, "incomplete" if call.cut else "completed") for call in calls]
        if after.strip():
            output.append(self._message_item(objects.new_id("msg", "_"), after.lstrip(), self._status()))
        return self._response(self._status(), output)

    def _around_calls(self, text: str, content: str, calls: list[ToolCall]) -> tuple[str, str]:
        """A reply's content as the message before its calls and the one after them, as a stream sends them:
        the text before the first possible call (`ToolFormat.hold_from`), then the rest (a message of its own
        from its first word on)."""
        if not calls:
            return content, ""
        before = text[:self.tool_format.hold_from(text)].rstrip()
        return (before, content[len(before):]) if content.startswith(before) else (content, "")

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
        """A chat chunk as Response events. The last chunk of a reply with calls may carry text that comes after
        them (`ToolCallStream.rest`): it goes out after the calls, in a message of its own, as `_body` has it
        (without calls, the held text is the message's own). A text delta carries the logprobs of the tokens
        received since the last one (a token may hold part of a character, or text held as a possible call's
        start), but for the think block's and a call's, as `_body` counts them."""
        self._start()
        stream = self.choices[0].tool_stream
        for chunk in chunk_choices:
            delta = chunk["delta"]
            if delta.get("reasoning_content"):
                self._reasoning_delta(delta["reasoning_content"])
            content, calls = delta.get("content") or "", delta.get("tool_calls") or []
            last = stream is not None and chunk["finish_reason"] is not None and bool(self._calls or calls)
            after = stream.rest if last and content.endswith(stream.rest) else ""
            if content[:len(content) - len(after)]:
                self._close_reasoning()
                self._text_delta(content[:len(content) - len(after)], self._new_logprobs())
            for entry in calls:
                self._close_reasoning()
                self._logprobs_from = len(self.choices[0].token_ids)   # the call's tokens
                self._close_message("completed")
                self._call_delta(entry)
            if after.strip():
                self._close_reasoning()
                self._close_calls(stream.cut_call)   # the last chunk: the stream knows which call was cut
                self._logprobs_from = len(self.choices[0].token_ids)   # none of the calls' markup: as `_body`
                self._text_delta(after.lstrip(), [])

    def _new_logprobs(self) -> list[dict[str, Any]]:
        """The logprobs of the reply's tokens since the last text delta's, none of the think block's."""
        choice = self.choices[0]
        start = max(self._logprobs_from, choice.reasoning.num_tokens_before_content if choice.reasoning else 0)
        self._logprobs_from = len(choice.token_ids)
        if not self.want_logprobs or start >= len(choice.token_ids):
            return []
        return objects.chat_logprobs(choice.token_ids[start:], choice.logprobs[start:], choice.top_logprobs[start:],
                                     choice.pool.token_text, choice.pool.token_bytes)["content"]

    def _reasoning_delta(self, text: str) -> None:
        if self._reasoning is None:
            self._reasoning = reasoning_item(objects.new_id("rs", "_"), "", "in_progress")
            self._output.append(self._reasoning)
            index = len(self._output) - 1
            self._event("response.output_item.added", output_index=index, item=dict(self._reasoning, content=[]))
            self._event("response.content_part.added", item_id=self._reasoning["id"], output_index=index,
                        content_index=0, part=dict(self._reasoning["content"][0]))
        self._reasoning["content"][0]["text"] += text
        self._event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                    output_index=self._output.index(self._reasoning), content_index=0, delta=text)

    def _close_reasoning(self) -> None:
        item = self._reasoning
        if item is None or item["status"] != "in_progress":
            return
        index, part = self._output.index(item), item["content"][0]
        self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=part["text"])
        self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                    part=dict(part))
        item["status"] = self._reasoning_status()
        self._event("response.output_item.done", output_index=index, item=dict(item))

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        if self._message is None:
            self._message = self._message_item(objects.new_id("msg", "_"), "", "in_progress")
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

    def _close_message(self, status: str | None = None) -> None:
        """The open message ends: `status` (completed where a call follows it), else the Response's once it has
        finished."""
        message = self._message
        if message is None:
            return
        index = self._output.index(message)
        part = message["content"][0]
        part["logprobs"] += self._new_logprobs()   # tokens whose text never came (a character cut by max_tokens)
        self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                    text=part["text"], logprobs=part["logprobs"])
        self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                    part=dict(part))
        ended = self.choices[0].finish_reason is not None or self.error is not None
        message["status"] = status or (self._status() if ended else "completed")
        self._event("response.output_item.done", output_index=index, item=dict(message))
        self._message = None

    def _call_delta(self, entry: dict[str, Any]) -> None:
        """One chat `tool_calls` delta entry as Response events: a new call's item (id and name first), then
        `response.function_call_arguments.delta` for each piece of its arguments as the model writes them. A
        call's items are done when the next begins: its arguments are whole then."""
        if "id" in entry:
            self._close_calls()
            item = self._call_item(ToolCall(entry["function"]["name"], "", entry["id"]), "in_progress")
            self._calls[entry["index"]] = (len(self._output), item)
            self._output.append(item)
            self._event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))
        index, item = self._calls[entry["index"]]
        piece = entry["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=piece)

    def _close_calls(self, cut: int | None = None, status: str = "completed") -> None:
        """The open call ends: `status`, incomplete if it is call `cut` (max_tokens ended it)."""
        for k, (index, item) in self._calls.items():
            if item["status"] == "in_progress":
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
                item["status"] = "incomplete" if k == cut else status
                self._event("response.output_item.done", output_index=index, item=dict(item))

    # --- the end ---------------------------------------------------------------------------------
    async def finish(self) -> web.StreamResponse:
        """The finished Response, kept (`keep`) before it is sent: as the JSON body, or the stream's last event."""
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
        self._close_reasoning()
        self._close_message()
        if self.error is not None:   # the engine failed it: the Response fails, with the error object
            self._close_calls(status="incomplete")
            return self._response("failed", self._output)
        stream = self.choices[0].tool_stream
        self._close_calls(stream.cut_call if stream is not None else None)
        return self._response(self._status(), self._output)

    def _json(self) -> web.Response:
        return web.json_response(self._final, headers=self.headers)

    def _queue_tail(self) -> None:
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(self._final["status"],
                                                                                     "response.completed")
        self._event(kind, response=self._final)
