"""The Responses API's request body as `msgspec` structs (`ResponsesBody` and its items), read by
`gateway.openai.responses.parse_responses`: a field of the wrong type, out of range or unknown is a 400
naming it (`gateway.openai.errors.convert_body`). Beside them, the rules on a conversation's items as a
whole: each function call answered by its output and each output answering a call (`check_calls`, OpenAI's
400s), and a kept item written back in a shape another Responses server takes as input (`relayed_item`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from engine.sampling import MAX_LOGPROBS
from gateway.openai import objects
from gateway.openai.errors import ApiError
from gateway.openai.reasoning import ReasoningOptions
from gateway.openai.sampling_fields import Int64
from gateway.openai.tool_specs import ToolChoice, ToolMode

__all__ = ["AllowedChoice", "FunctionChoice", "FunctionTool", "InputItem", "InputPart", "ResponsesBody", "TextOptions",
           "chat_tool_choice", "check_calls", "relayed_item", "response_tool_choice"]


class InputPart(msgspec.Struct):
    type: Literal["input_text", "output_text", "text", "reasoning_text"]
    text: str


class InputItem(msgspec.Struct):
    """An input item: a message (the type when none is given), a function call the model made, the
    call's output, or the model's reasoning. Other keys (an output item's `id` and `status`, a reasoning
    item's `summary`) are ignored: the earlier turns' output items come back as input."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None   # a message's
    content: str | list[InputPart] | None = None                              # a message's, a reasoning item's
    call_id: str | None = None                                                # a call's and its output's
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None                               # a call output's


class FunctionTool(msgspec.Struct):
    """A function tool, flat (chat's has its fields under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None     # unset: true, the Responses API's default (chat's is false)


class FunctionChoice(msgspec.Struct, tag_field="type", tag="function"):
    name: str


class FunctionRef(msgspec.Struct):
    type: Literal["function"]
    name: str


class AllowedChoice(msgspec.Struct, tag_field="type", tag="allowed_tools"):
    """`tool_choice` {"type": "allowed_tools", "mode", "tools"}: chat's `allowed_tools`, flat."""

    mode: Literal["auto", "required"]
    tools: list[FunctionRef]


def chat_tool_choice(choice: Any) -> Any:
    """A Responses request's `tool_choice` in chat's shape."""
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedChoice):
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": [
            {"type": "function", "function": {"name": tool.name}} for tool in choice.tools]}}
    return choice


def response_tool_choice(choice: ToolChoice) -> Any:
    """A Response object's `tool_choice`, as the request said it."""
    if choice.mode == "function":
        return {"type": "function", "name": choice.name}
    if choice.allowed is not None:
        return {"type": "allowed_tools", "mode": choice.mode,
                "tools": [{"type": "function", "name": name} for name in choice.allowed]}
    return choice.mode


class TextOptions(msgspec.Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None   # chat's response_format, a json_schema's fields beside its type
    verbosity: Literal["low", "medium", "high"] | None = None   # accepted: a hint to OpenAI's own models only


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A Responses API body. What this server cannot honour is refused, never a silent default:
    a `service_tier` it does not serve, an `include` but the text's logprobs. `truncation` `disabled` (the
    default: an input over the context is a 400, context_length_exceeded) or `auto` (`gateway.openai.truncation`)."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolMode | FunctionChoice | AllowedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None   # alternatives per token
    seed: Int64 | None = None
    priority: Int64 | None = None
    stream: bool | None = None
    store: bool | None = None                 # unset: true
    background: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None    # `_metadata`
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None   # the logprobs' only switch
    chat_template_kwargs: dict[str, Any] | None = None   # as chat's (vLLM's)
    reasoning: ReasoningOptions | None = None  # checked; effort "none" turns thinking off
    user: Any = None                          # accepted and ignored, as the three after it (chat's reasons)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: Any = None


def check_calls(items: Sequence[InputItem], own_from: int = 0) -> None:
    """OpenAI's rule on a conversation's function calls (the earlier turns' items and the request's own, in
    order, each with its `call_id`): every `function_call_output` answers a `function_call` before it, and
    every `function_call` is answered by an output after it; else a 400 naming `input` in OpenAI's words.
    Without it an output would become a tool turn that answers nothing, and a call the next turn ignores
    an assistant turn whose result never comes: prompts no template renders as the model was trained. A call
    id is one call's and one output's: an earlier turn's call sent again with `previous_response_id` (which
    holds it already) is OpenAI's duplicate item, not a second call in the prompt; only the request's own items
    (from `own_from` on) are refused so, a kept conversation that holds such a pair being continued as it is."""
    unanswered: dict[str, None] = {}   # call ids in order, until their output comes
    called: set[str] = set()
    answered: set[str] = set()
    for i, item in enumerate(items):
        key = item.call_id if item.type in ("function_call", "function_call_output") else None
        if i >= own_from and key in (called if item.type == "function_call" else answered):
            raise ApiError(400, f"Duplicate item found with call_id {key}: a {item.type} the conversation "
                           "holds already (with previous_response_id, send only what is new)", param="input")
        if item.type == "function_call":
            called.add(item.call_id)
            unanswered[item.call_id] = None
        elif item.type == "function_call_output":
            if item.call_id not in called:
                raise ApiError(400, f"No tool call found for function call output with call_id {item.call_id}.",
                               param="input")
            unanswered.pop(item.call_id, None)
            answered.add(item.call_id)
    if unanswered:
        raise ApiError(400, f"No tool output found for function call {next(iter(unanswered))}.", param="input")


def relayed_item(item: dict[str, Any]) -> dict[str, Any]:
    """A kept input item (the fields the API reads, no `id` nor `status`: `responses._kept`, an earlier
    output item taken back) as an upstream Responses server takes it in `input` (the openai package's
    `ResponseInputItemParam`, which vLLM's request model reads): an assistant message's text as one string
    (as this gateway's own prompt joins it), another message's parts as `input_text`, a call's output as
    text or `input_text` parts, a reasoning item with the `id` and `summary` its type requires."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        if item["role"] == "assistant":
            return {"type": "message", "role": "assistant", "content": _joined(content)}
        return {"type": "message", "role": item["role"], "content": _input_parts(content)}
    if kind == "function_call_output":
        return {**item, "output": _input_parts(item["output"])}
    if kind == "reasoning":
        content = item.get("content") or []
        texts = [content] if isinstance(content, str) else [part["text"] for part in content]
        return {"type": "reasoning", "id": item.get("id") or objects.new_id("rs", "_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text} for text in texts]}
    return item   # a function_call: its call_id, name and arguments are the input shape


def _joined(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def _input_parts(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    return content if isinstance(content, str) else [{"type": "input_text", "text": part["text"]} for part in content]
