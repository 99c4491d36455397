"""Chat completion requests: the body's model (`ChatBody`), read into a `ChatRequest` by `parse_chat`.

The model checks each field's type and bounds, and a message's role and content parts (text only); the
code here checks what spans fields: a tool message's `tool_call_id`, tool calls on assistant messages
only, `top_logprobs` with `logprobs`, `tools` or the deprecated `functions` (read as tools), the counts
in `gateway.limits`, `chat_template_kwargs` (vLLM's: more variables for the chat template, such as Qwen3's
`enable_thinking`; not those the gateway sets; they win over the pool's own `chat_template_kwargs`, key by
key). A message's keys beyond those read are ignored: a client may send back the whole message a reply gave
it (`refusal`, `annotations`); an assistant's `reasoning_content` is passed to the template, which may
render it (Qwen3's does, after the last user turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from engine.sampling import MAX_LOGPROBS, SamplingParams
from gateway.openai.errors import bad_request, convert_body, named_error
from gateway.openai.sampling_fields import (RequestFields, check_choices, response_format, sampling_params,
                                            stream_flags)
from gateway.openai.tool_specs import (FunctionName, FunctionSpec, NamedToolChoice, Tool, ToolCallSpec, ToolChoice,
                                       ToolError, ToolMode, ToolSpec, history_calls, parse_tool_choice, tools_from)
from pools.config.gateway_spec import RequestLimits
from pools.config.spec import template_variable_error


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None | msgspec.UnsetType = msgspec.UNSET   # required but for assistant
    tool_calls: list[ToolCallSpec] | None = None     # assistant messages
    tool_call_id: str | None = None                  # tool messages: the call answered
    name: str | None = None
    reasoning_content: str | None = None             # assistant messages: their reasoning, for the template


class ChatBody(RequestFields, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None   # max_tokens' newer name
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolSpec], msgspec.Meta(min_length=1)] | None = None
    tool_choice: ToolMode | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[FunctionSpec], msgspec.Meta(min_length=1)] | None = None   # deprecated tools
    function_call: Literal["none", "auto"] | FunctionName | None = None               # and tool_choice
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: more variables for the chat template


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]   # role, content (text); tool_calls / tool_call_id / name where given
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    top_logprobs: int | None        # None: no logprobs; k: the chosen token's plus the top k
    continuous_usage: bool = False  # the usage so far in every stream chunk
    max_tokens_param: str = "max_tokens"   # the field that set params.max_tokens, for errors
    structured_param: str = "response_format"   # the field that set params.structured, for errors
    prompt_param: str = "messages"              # the field of the prompt, for errors
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None   # the Responses API's, echoed in its Response object
    chat_template_kwargs: dict[str, Any] | None = None   # more variables for the chat template


def parse_chat(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """A chat completion body (decoded JSON) as a `ChatRequest`; ApiError 400 naming the field (a count
    over `limits` too)."""
    chat = convert_body(body, ChatBody)
    if len(chat.messages) > limits.max_messages:
        raise bad_request("messages", f"at most {limits.max_messages} messages (gateway.limits.max_messages), "
                          f"got {len(chat.messages)}")
    messages = [_message(i, m) for i, m in enumerate(chat.messages)]
    try:
        tools, tool_choice = _tools(chat)
    except ToolError as exc:   # its message starts with the field's path
        raise named_error(str(exc)) from None
    if chat.top_logprobs is not None and not chat.logprobs:
        raise bad_request("top_logprobs", "requires logprobs: true")
    top_logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
    max_tokens_param = "max_tokens" if chat.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = chat.max_tokens if chat.max_completion_tokens is None else chat.max_completion_tokens
    stream, include_usage, continuous_usage = stream_flags(chat)
    params = sampling_params(chat, max_tokens, top_logprobs, response_format(chat.response_format))
    check_choices(params.n, 1, limits)
    return ChatRequest(model=chat.model, messages=messages, params=params, stream=stream,
                       include_usage=include_usage, continuous_usage=continuous_usage, priority=chat.priority or 0,
                       top_logprobs=top_logprobs, max_tokens_param=max_tokens_param, tools=tools,
                       tool_choice=tool_choice, parallel_tool_calls=chat.parallel_tool_calls is not False,
                       chat_template_kwargs=_template_kwargs(chat.chat_template_kwargs))


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` (an object, checked by the model), refusing the variables the gateway sets."""
    if not value:
        return None
    for key, item in value.items():
        if (reason := template_variable_error(key, item)) is not None:
            raise bad_request(f"chat_template_kwargs.{key}", reason)
    return dict(value)


def _message(i: int, m: Message) -> dict[str, Any]:
    """One chat message as the templates take it: role and text content, plus an assistant's tool_calls
    and a tool result's tool_call_id (and a name) where given."""
    if m.content is msgspec.UNSET and m.role != "assistant":
        raise bad_request(f"messages[{i}].content", "is required")
    content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or ())
    message: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
        message["tool_calls"] = history_calls(m.tool_calls)
    if m.role == "tool" and m.tool_call_id is None:
        raise bad_request(f"messages[{i}].tool_call_id",
                          "is required in a tool message (the id of the call it answers)")
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    if m.reasoning_content is not None and m.role == "assistant":
        message["reasoning_content"] = m.reasoning_content
    return message


def _tools(chat: ChatBody) -> tuple[list[Tool] | None, ToolChoice]:
    """`tools` and `tool_choice` (or the deprecated `functions` and `function_call`, read as them)."""
    if chat.functions is not None:
        if chat.tools is not None:
            raise bad_request("functions", "send tools or functions, not both")
        tools = tools_from(chat.functions, "functions", inner="")
        call = chat.function_call
        choice = NamedToolChoice("function", call) if isinstance(call, FunctionName) else call
        return tools, parse_tool_choice(choice, tools, name_at="function_call.name")
    if chat.tools is None:
        if chat.tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "is only allowed when tools are given")
        return None, ToolChoice("none")
    tools = tools_from([tool.function for tool in chat.tools])
    return tools, parse_tool_choice(chat.tool_choice, tools)
