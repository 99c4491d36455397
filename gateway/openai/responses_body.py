"""The Responses API's request body as `msgspec` structs (`ResponsesBody` and its items), read by
`gateway.openai.responses.parse_responses`: a field of the wrong type, out of range or unknown is a 400
naming it (`gateway.openai.errors.convert_body`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.openai.reasoning import ReasoningOptions
from gateway.openai.sampling_fields import Int64
from gateway.openai.tool_specs import ToolMode

__all__ = ["FunctionChoice", "FunctionTool", "InputItem", "InputPart", "ResponsesBody", "TextOptions"]


class InputPart(msgspec.Struct):
    type: Literal["input_text", "output_text", "text", "reasoning_text"]
    text: str


class InputItem(msgspec.Struct):
    """An input item: a message (the type when none is given), a function call the model made, the
    call's output, or the model's reasoning. Other keys (an output item's `id` and `status`, a reasoning
    item's `summary`) are ignored: the earlier turns' output items come back as input."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None   # a message's
    content: str | list[InputPart] = ""
    call_id: str | None = None                                                # a call's and its output's
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] = ""


class FunctionTool(msgspec.Struct):
    """A function tool, flat (chat's has its fields under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None     # unset: true, the Responses API's default (chat's is false)


class FunctionChoice(msgspec.Struct):
    type: Literal["function"]
    name: str


class TextOptions(msgspec.Struct):
    format: dict[str, Any] | None = None   # chat's response_format, a json_schema's fields beside its type


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A Responses API body. What this server cannot honour is refused, never a silent default:
    `truncation` but disabled (an input over the context is a 400, context_length_exceeded), a
    `service_tier` it does not serve, an `include` but the text's logprobs."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolMode | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    seed: Int64 | None = None
    priority: Int64 | None = None
    stream: bool | None = None
    store: bool | None = None                 # unset: true
    background: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None    # `_metadata`
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # as chat's (vLLM's)
    reasoning: ReasoningOptions | None = None  # checked; effort "none" turns thinking off
    user: Any = None                          # accepted and ignored, as the three after it (chat's reasons)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: Any = None
