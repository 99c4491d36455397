"""Chat completion requests: the body's model (`ChatBody`), read into a `ChatRequest` by `parse_chat`.

The model checks each field's type and bounds, and a message's role and content parts (text, and an
assistant's refusal, rendered as its text); the code here checks what spans fields: a tool message's
`tool_call_id`, tool calls on assistant messages only, `top_logprobs` with `logprobs`, `tools` or the
deprecated `functions` (read as tools), the counts in `gateway.limits`, `chat_template_kwargs` (vLLM's: more
variables for the chat template, such as Qwen3's `enable_thinking`; not those the gateway sets; they win over
the pool's own `chat_template_kwargs`, key by key).

Read as vLLM reads them: `add_generation_prompt` (default true) and `continue_final_message` (the prompt ends
inside the last message, for the model to continue it; not with `add_generation_prompt: true`, which it turns
off when unset), rendered as transformers renders them; `reasoning_effort`, passed to the template as the
variable `reasoning_effort` (gpt-oss's reads it; a template that does not renders as without it), "none" also
setting `enable_thinking: false` unless `chat_template_kwargs` set it (as the Responses API's `reasoning.effort`).
The deprecated function messages are read as OpenAI reads them: an assistant's `function_call` is one tool
call, a message of role "function" (its `name` required) is the result of its function's last call.

A message's content parts reach a template that iterates them as parts, any other joined with "\n"
(`engine.chat_template`). A message's keys beyond those read are ignored: a client may send back the whole
message a reply gave it (`refusal`, `annotations`); an assistant's reasoning, as `reasoning_content` or
`reasoning` (vLLM's name), is passed to the template, also as `reasoning_content` and `thinking` (transformers'
aliases), which may render it (Qwen3's does, after the last user turn); a `thinking` key is ignored, as vLLM
ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from engine.chat_template import content_text
from engine.sampling import MAX_LOGPROBS, SamplingParams
from gateway.openai.errors import bad_request, convert_body, named_error
from gateway.openai.reasoning import ReasoningEffort
from gateway.openai.sampling_fields import (RequestFields, check_choices, response_format, sampling_params,
                                            stream_flags, unset_fields)
from gateway.openai.tool_specs import (AllowedToolsChoice, FunctionCall, FunctionName, FunctionSpec, NamedToolChoice,
                                       Tool, ToolCallSpec, ToolChoice, ToolError, ToolMode, ToolSpec, history_calls,
                                       parse_tool_choice, tools_from)
from pools.config.gateway_spec import RequestLimits
from pools.config.spec import template_variable_error


class ContentPart(msgspec.Struct):
    """A content part: text, or an assistant's refusal (rendered as its text, as vLLM renders it)."""

    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None | msgspec.UnsetType = msgspec.UNSET   # required but for assistant
    tool_calls: list[ToolCallSpec] | None = None     # assistant messages
    function_call: FunctionCall | None = None        # assistant messages: the deprecated form of one tool call
    tool_call_id: str | None = None                  # tool messages: the call answered
    name: str | None = None                          # function messages: the function answering (required)
    reasoning_content: str | None = None             # assistant messages: their reasoning, for the template
    reasoning: str | None = None                     # its name in vLLM's API


class ChatBody(RequestFields, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None   # max_tokens' newer name
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolSpec], msgspec.Meta(min_length=1)] | None = None
    tool_choice: ToolMode | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[FunctionSpec], msgspec.Meta(min_length=1)] | None = None   # deprecated tools
    function_call: Literal["none", "auto"] | FunctionName | None = None               # and tool_choice
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: more variables for the chat template
    add_generation_prompt: bool | None = None            # vLLM's: end the prompt with a new assistant turn
    continue_final_message: bool | None = None           # vLLM's: end the prompt inside the last message
    reasoning_effort: ReasoningEffort | None = None      # the template variable `reasoning_effort`, as vLLM's
    # hints the SDK sends, accepted and ignored: they change nothing a text answer says (Responses' text.verbosity)
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None             # predicted output: only a speed hint
    prompt_cache_options: dict[str, Any] | None = None   # our prefix cache keeps prefixes unasked
    modalities: list[Literal["text", "audio"]] | None = None   # text only: "audio" is a 400 naming it
    audio: dict[str, Any] | None = None                  # audio output's settings: only null


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]   # role, content (text or text parts); tool_calls / tool_call_id / name / reasoning
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
    legacy: bool = False   # the tools came as the deprecated `functions`: one call, answered as `function_call`
    metadata: dict[str, str] | None = None   # the Responses API's, echoed in its Response object
    sampling_unset: frozenset[str] = frozenset()   # sampling fields left unset: the pool's model's defaults apply
    # the renderer's: variables for the chat template, and its flags add_generation_prompt / continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def callable_tools(self) -> list[Tool]:
        """The tools a reply may call: those `allowed_tools` names, or all (`tools` are all shown either way)."""
        allowed = self.tool_choice.allowed
        return [t for t in self.tools or () if allowed is None or t.name in allowed]

    @property
    def offers_calls(self) -> bool:
        """Whether the model may call the tools it is shown (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def calls_finish(self) -> str:
        """The finish_reason of a reply that made calls, as OpenAI answers it: "stop" where tool_choice (or
        function_call) named the function, else "tool_calls" (for the deprecated `functions`, "function_call")."""
        if self.tool_choice.mode == "function":
            return "stop"
        return "function_call" if self.legacy else "tool_calls"

    @property
    def continued(self) -> str | None:
        """The text of the message the prompt ends inside (`continue_final_message`: the reply goes on from
        it), else None."""
        if not (self.chat_template_kwargs or {}).get("continue_final_message"):
            return None
        return content_text(self.messages[-1]["content"] or "")


def parse_chat(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """A chat completion body (decoded JSON) as a `ChatRequest`; ApiError 400 naming the field (a count
    over `limits` too)."""
    chat = convert_body(body, ChatBody)
    if "audio" in (chat.modalities or ()) or chat.audio is not None:
        raise bad_request("modalities" if chat.audio is None else "audio",
                          "audio output is not served: this gateway answers text (modalities [\"text\"])")
    if len(chat.messages) > limits.max_messages:
        raise bad_request("messages", f"at most {limits.max_messages} messages (gateway.limits.max_messages), "
                          f"got {len(chat.messages)}")
    calls: dict[str, str] = {}   # a function's name -> the id of its last deprecated `function_call`
    messages = [_message(i, m, calls) for i, m in enumerate(chat.messages)]
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
    params = sampling_params(chat, max_tokens, top_logprobs, response_format(chat.response_format), max_tokens_param)
    check_choices(params.n, 1, limits)
    return ChatRequest(model=chat.model, messages=messages, params=params, stream=stream,
                       include_usage=include_usage, continuous_usage=continuous_usage, priority=chat.priority or 0,
                       top_logprobs=top_logprobs, max_tokens_param=max_tokens_param, tools=tools,
                       tool_choice=tool_choice, legacy=chat.functions is not None,
                       parallel_tool_calls=chat.parallel_tool_calls is not False and chat.functions is None,
                       chat_template_kwargs=_template_kwargs(chat), sampling_unset=unset_fields(chat))


def _template_kwargs(chat: ChatBody) -> dict[str, Any] | None:
    """What the chat template renderer takes beside the messages: `chat_template_kwargs` (checked by the model),
    refusing the variables the gateway sets; `reasoning_effort` as the variable of that name (over the kwargs'),
    and for "none" `enable_thinking: false` unless the kwargs set it; then the flags, where not the default:
    `add_generation_prompt` false, or `continue_final_message` true (which implies it)."""
    value = dict(chat.chat_template_kwargs or {})
    for key, item in value.items():
        if (reason := template_variable_error(key, item)) is not None:
            raise bad_request(f"chat_template_kwargs.{key}", reason)
    if chat.reasoning_effort is not None:
        value["reasoning_effort"] = chat.reasoning_effort
        if chat.reasoning_effort == "none":   # no thinking: the templates' switch off, as the Responses API's
            value.setdefault("enable_thinking", False)
    if chat.continue_final_message:
        if chat.add_generation_prompt:
            raise bad_request("continue_final_message", "cannot be true with add_generation_prompt true (the prompt "
                              "would end in a new assistant turn, not inside the last message)")
        value.update(add_generation_prompt=False, continue_final_message=True)
    elif chat.add_generation_prompt is False:
        value["add_generation_prompt"] = False
    return value or None


def _message(i: int, m: Message, calls: dict[str, str]) -> dict[str, Any]:
    """One chat message as the templates take it: role and content (`_content`), plus an assistant's
    tool_calls (its deprecated `function_call` as one, whose id `calls` keeps by name), its reasoning, and a
    tool result's tool_call_id and name (a deprecated function message is a tool result answering the last
    call of its function)."""
    message: dict[str, Any] = {"role": m.role, "content": _content(i, m)}
    if (m.tool_calls or m.function_call is not None) and m.role != "assistant":
        raise bad_request(f"messages[{i}].{'tool_calls' if m.tool_calls else 'function_call'}",
                          "only assistant messages carry tool calls")
    if m.tool_calls and m.function_call is not None:
        raise bad_request(f"messages[{i}].function_call", "send tool_calls or function_call, not both")
    if m.function_call is not None:
        calls[m.function_call.name] = f"call_{i}"
        m = msgspec.structs.replace(m, tool_calls=[ToolCallSpec(m.function_call, f"call_{i}")])
    if m.tool_calls:
        message["tool_calls"] = history_calls(m.tool_calls)
    if m.role == "function":
        if m.name is None:
            raise bad_request(f"messages[{i}].name", "is required in a function message (the function answering)")
        message.update(role="tool", tool_call_id=calls.get(m.name, f"call_{i}"))
    if m.role == "tool" and m.tool_call_id is None:
        raise bad_request(f"messages[{i}].tool_call_id",
                          "is required in a tool message (the id of the call it answers)")
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    if m.role == "assistant":
        message.update({key: value for key, value in (("reasoning_content", m.reasoning_content),
                                                      ("reasoning", m.reasoning)) if value is not None})
    return message


def _content(i: int, m: Message) -> str | list[dict[str, str]]:
    """A message's content: its text, or its parts as text parts (a refusal's text as a text part's), which
    the template takes as parts or joined (`engine.chat_template`); a tool result's parts joined, as vLLM
    joins them (templates write a tool result as one string)."""
    if m.content is msgspec.UNSET and m.role != "assistant":
        raise bad_request(f"messages[{i}].content", "is required")
    if m.content is None and m.role not in ("assistant", "function"):   # null: an assistant's calls only, or a
        raise bad_request(f"messages[{i}].content",                     # function that returned nothing
                          f"must be a string or an array of parts in a {m.role} message, got null")
    if not isinstance(m.content, list):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        text = part.text if part.type == "text" else part.refusal
        if text is None:
            raise bad_request(f"messages[{i}].content[{j}].{part.type}", f"is required in a {part.type} part")
        if part.type == "refusal" and m.role != "assistant":
            raise bad_request(f"messages[{i}].content[{j}].type", "a refusal part is an assistant message's")
        parts.append({"type": "text", "text": text})
    return content_text(parts) if m.role in ("tool", "function") else parts


def _tools(chat: ChatBody) -> tuple[list[Tool] | None, ToolChoice]:
    """`tools` and `tool_choice` (or the deprecated `functions` and `function_call`, read as them)."""
    if chat.functions is not None:
        if chat.tools is not None:
            raise bad_request("functions", "send tools or functions, not both")
        if chat.tool_choice is not None:   # ignored, the choice the client made would be lost
            raise bad_request("tool_choice", "goes with tools; with functions, send function_call")
        tools = tools_from(chat.functions, "functions", inner="")
        call = chat.function_call
        choice = NamedToolChoice(call) if isinstance(call, FunctionName) else call
        return tools, parse_tool_choice(choice, tools, name_at="function_call.name")
    if chat.function_call not in (None, "none"):
        raise bad_request("function_call", "is only allowed when functions are given (with tools, send tool_choice)")
    if chat.tools is None:
        if chat.tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "is only allowed when tools are given")
        return None, ToolChoice("none")
    tools = tools_from([tool.function for tool in chat.tools])
    return tools, parse_tool_choice(chat.tool_choice, tools)
