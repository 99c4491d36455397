"""The OpenAI protocol's requests: parse and validate request bodies.

No HTTP here: `parse_chat` / `parse_completion` turn a decoded JSON body into a request object or
raise `ApiError` (status, message naming the field, `param`); `gateway.openai.objects` builds the JSON
objects the OpenAI API returns. Extra fields are accepted as vLLM accepts them:
`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`, `skip_special_tokens`,
`include_stop_str_in_output`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.sampling import MAX_LOGPROBS, SamplingParams
from engine.structured import StructuredOutput
from gateway.openai.tools import Tool, ToolChoice, ToolError, parse_tool_calls, parse_tool_choice, parse_tools
from pools.config.gateway_spec import RequestLimits


class ApiError(Exception):
    """An error answered in the OpenAI error format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}   # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# Fields we accept and ignore (they change nothing we do); anything else unknown is an error, so a
# misspelt parameter is not silently dropped.
_IGNORED = {"user", "store", "metadata", "service_tier", "stream_options"}
_SAMPLING_EXTRA = {"top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "priority",
                   "skip_special_tokens", "include_stop_str_in_output", "seed", "stop", "n", "temperature",
                   "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "stream", "model"}
_CHAT_FIELDS = _SAMPLING_EXTRA | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                                  "response_format", "tools", "tool_choice", "functions", "function_call",
                                  "parallel_tool_calls"}
_COMPLETION_FIELDS = _SAMPLING_EXTRA | {"prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of",
                                        "response_format"}


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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None   # the Responses API's, echoed in its Response object


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # one engine request per prompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    max_tokens_param: str = "max_tokens"
    structured_param: str = "response_format"
    continuous_usage: bool = False  # the usage so far in every stream chunk


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}", param="body")
    return body


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed and key not in _IGNORED:
            raise bad_request(key, "unrecognized request field")


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind in (float, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        names = {int: "an integer", float: "a number", (int, float): "a number", str: "a string",
                 bool: "a boolean", list: "an array", dict: "an object"}
        raise bad_request(name, f"expected {names.get(kind, kind)}, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("model", "is required")
    if not isinstance(model, str) or not model:
        raise bad_request("model", f"expected a non-empty string, got {_json_type(model)}")
    return model


def _stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): `stream_options.continuous_usage_stats` (vLLM's) with
    `include_usage` puts the usage so far in every chunk, so a client can tell how many tokens a chunk
    carries (two, when the detokenizer held back a token that ended inside a character)."""
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad_request("stream_options", f"expected an object, got {_json_type(options)}")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise bad_request(f"stream_options.{key}", "unrecognized field")
    include, continuous = options.get("include_usage", False), options.get("continuous_usage_stats", False)
    for key, value in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if not isinstance(value, bool):
            raise bad_request(f"stream_options.{key}", f"expected a boolean, got {_json_type(value)}")
    return stream, include, include and continuous


def response_format(value: Any, param: str = "response_format") -> StructuredOutput | None:
    """OpenAI's `response_format` (chat, and completions as vLLM takes it) as the constraint it asks for:
    {"type": "text"} none, {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} the schema (strict or not, it is enforced)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(param, f"expected an object, got {_json_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad_request(f"{param}.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"{param}.json_schema", f"expected an object with the schema, got {_json_type(spec)}")
    return json_schema_constraint(spec, f"{param}.json_schema")


_FORMAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")   # OpenAI's rule for a response format's name


def json_schema_constraint(spec: dict[str, Any], param: str) -> StructuredOutput:
    """{name, schema, strict, description} (chat's json_schema; the Responses API's text.format carries the
    same fields beside its type) as a constraint."""
    for key in spec:
        if key not in ("name", "schema", "strict", "description", "type"):
            raise bad_request(f"{param}.{key}", "unrecognized field")
    if "name" not in spec:
        raise bad_request(f"{param}.name", "is required")
    if not isinstance(spec["name"], str) or not _FORMAT_NAME.match(spec["name"]):
        raise bad_request(f"{param}.name", f"must be 1-64 letters, digits, '_' or '-', got {spec['name']!r}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request(f"{param}.strict", f"expected a boolean, got {_json_type(spec['strict'])}")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}.schema", f"expected a JSON schema object, got {_json_type(schema)}")
    try:
        return StructuredOutput.json_schema(schema)
    except ValueError as exc:
        raise bad_request(f"{param}.schema", str(exc).removeprefix("structured output: ")) from None


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
              structured: StructuredOutput | None = None) -> SamplingParams:
    temperature = _get(body, "temperature", (int, float), 1.0)
    if not 0 <= temperature <= 2:
        raise bad_request("temperature", f"must be in [0, 2], got {temperature}")
    top_k = _get(body, "top_k", int, 0)
    kwargs = dict(
        n=_get(body, "n", int, 1), temperature=temperature, top_p=_get(body, "top_p", (int, float), 1.0),
        top_k=top_k, min_p=_get(body, "min_p", (int, float), 0.0), seed=_get(body, "seed", int, None),
        max_tokens=max_tokens, min_tokens=_get(body, "min_tokens", int, 0),
        stop=() if body.get("stop") is None else body["stop"], stop_token_ids=_get(body, "stop_token_ids", list, ()),
        ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=logprobs,
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        presence_penalty=_get(body, "presence_penalty", (int, float), 0.0),
        frequency_penalty=_get(body, "frequency_penalty", (int, float), 0.0),
        repetition_penalty=_get(body, "repetition_penalty", (int, float), 1.0),
        logit_bias=_get(body, "logit_bias", dict, {}), structured=structured)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams names the field: "top_p: ...", "logit_bias[5]: ..."
        message = str(exc)
        field = message.split(":", 1)[0].split("[", 1)[0]
        raise ApiError(400, message, param=field if field in kwargs else None) from None


def _priority(body: dict[str, Any]) -> int:
    return _get(body, "priority", int, 0)


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    """The output limit; None (unset) means whatever the context leaves, as vLLM does."""
    value = _get(body, name, int, None)
    if value is not None and value < 1:
        raise bad_request(name, f"must be >= 1, got {value}")
    return value


def _message_content(index: int, content: Any) -> str:
    """A message's content: a string, or a list of text parts joined (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if not isinstance(part, dict):
                raise bad_request(where, f"expected an object, got {_json_type(part)}")
            if part.get("type") != "text":
                raise bad_request(f"{where}.type", f"only 'text' parts are supported, got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.text", f"expected a string, got {_json_type(part.get('text'))}")
            texts.append(part["text"])
        return "\n".join(texts)
    if content is None:
        return ""
    raise bad_request(f"messages[{index}].content", f"expected a string or an array of parts, "
                      f"got {_json_type(content)}")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """A chat completion body as a `ChatRequest`; ApiError 400 naming the field (a count over `limits` too)."""
    body = _require_object(body)
    _check_fields(body, _CHAT_FIELDS)
    model = _model(body)
    raw = body.get("messages")
    if raw is None:
        raise bad_request("messages", "is required")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "expected a non-empty array of messages")
    if len(raw) > limits.max_messages:
        raise bad_request("messages", f"at most {limits.max_messages} messages (gateway.limits.max_messages), "
                          f"got {len(raw)}")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    tools, tool_choice = _tools(body)
    logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None:
        if not logprobs:
            raise bad_request("top_logprobs", "requires logprobs: true")
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request("top_logprobs", f"must be in 0..{MAX_LOGPROBS}, got {top}")
    top_logprobs = (top or 0) if logprobs else None
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, max_tokens_param)
    stream, include_usage, continuous_usage = _stream(body)
    params = _sampling(body, max_tokens, top_logprobs, response_format(body.get("response_format")))
    _check_choices(params.n, 1, limits)
    return ChatRequest(model=model, messages=messages, params=params, stream=stream, include_usage=include_usage,
                       continuous_usage=continuous_usage, priority=_priority(body),
                       top_logprobs=top_logprobs, max_tokens_param=max_tokens_param, tools=tools,
                       tool_choice=tool_choice, parallel_tool_calls=_get(body, "parallel_tool_calls", bool, True))


def _message(i: int, m: Any) -> dict[str, Any]:
    """One chat message, checked: role and text content, plus an assistant's tool_calls and a tool
    result's tool_call_id (and name) where given."""
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}]", f"expected an object, got {_json_type(m)}")
    role = m.get("role")
    if role not in _ROLES:
        raise bad_request(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    if "content" not in m and role != "assistant":
        raise bad_request(f"messages[{i}].content", "is required")
    message: dict[str, Any] = {"role": role, "content": _message_content(i, m.get("content"))}
    if m.get("tool_calls"):
        if role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
        message["tool_calls"] = _tool_error(lambda: parse_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls"))
    if role == "tool" and m.get("tool_call_id") is None:
        raise bad_request(f"messages[{i}].tool_call_id", "is required in a tool message (the id of the call it answers)")
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise bad_request(f"messages[{i}].{key}", f"expected a string, got {_json_type(m[key])}")
            message[key] = m[key]
    return message


def _tools(body: dict[str, Any]) -> tuple[list[Tool] | None, ToolChoice]:
    """`tools` and `tool_choice` (or the deprecated `functions` and `function_call`, read as them)."""
    if body.get("functions") is not None:
        if body.get("tools") is not None:
            raise bad_request("functions", "send tools or functions, not both")
        raw = body["functions"]
        if not isinstance(raw, list):
            raise bad_request("functions", f"expected an array, got {_json_type(raw)}")
        tools = _tool_error(lambda: parse_tools([{"type": "function", "function": f} for f in raw], "functions"))
        call = body.get("function_call")
        choice = {"type": "function", "function": call} if isinstance(call, dict) else call
        return tools, _tool_error(lambda: parse_tool_choice(choice, tools, "function_call"))
    if body.get("tools") is None:
        choice = body.get("tool_choice")
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "is only allowed when tools are given")
        return None, ToolChoice("none")
    tools = _tool_error(lambda: parse_tools(body["tools"]))
    return tools, _tool_error(lambda: parse_tool_choice(body.get("tool_choice"), tools))


def _tool_error(parse):
    """`parse()`, its ToolError (message "<field path>: why") as a 400 naming that field."""
    try:
        return parse()
    except ToolError as exc:
        message = str(exc)
        raise ApiError(400, message, param=message.split(":", 1)[0]) from None


def _check_choices(n: int, num_prompts: int, limits: RequestLimits) -> None:
    """n x prompts engine requests at most `limits.max_choices`."""
    if n * num_prompts > limits.max_choices:
        raise bad_request("n", f"n={n} for {num_prompts} prompt(s) asks for {n * num_prompts} completions; at most "
                          f"{limits.max_choices} per request (gateway.limits.max_choices)")


def parse_completion(body: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    """A completion body as a `CompletionRequest`; ApiError 400 naming the field (a count over `limits` too)."""
    body = _require_object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    model = _model(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt", "is required")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            and len(prompt) > limits.max_prompts:
        raise bad_request("prompt", f"at most {limits.max_prompts} prompts per request "
                          f"(gateway.limits.max_prompts), got {len(prompt)}")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                      for p in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                prompts.append(p)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                prompts.append(list(p))
            else:
                raise bad_request(f"prompt[{i}]", "expected a string or a non-empty array of token ids")
    else:
        raise bad_request("prompt", "expected a string, an array of strings, or an array of token ids")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise bad_request("prompt" if len(prompts) == 1 else f"prompt[{i}]", "must not be empty")
    if _get(body, "echo", bool, False):
        raise bad_request("echo", "is not supported by this server")
    if body.get("suffix") is not None:
        raise bad_request("suffix", "is not supported by this server")
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of != _get(body, "n", int, 1):
        raise bad_request("best_of", "only best_of == n is supported")
    logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request("logprobs", f"must be in 0..{MAX_LOGPROBS}, got {logprobs}")
    stream, include_usage, continuous_usage = _stream(body)
    params = _sampling(body, _max_tokens(body, "max_tokens"), logprobs,
                       response_format(body.get("response_format")))
    _check_choices(params.n, len(prompts), limits)
    return CompletionRequest(model=model, prompts=prompts, params=params, stream=stream,
                             include_usage=include_usage, continuous_usage=continuous_usage,
                             priority=_priority(body))


def check_logit_bias(req: ChatRequest | CompletionRequest, vocab_size: int, pool: str) -> None:
    """Refuse logit_bias token ids outside the pool's vocabulary (a bias on a token that cannot be sampled
    would silently do nothing)."""
    outside = [t for t, _ in req.params.logit_bias if t >= vocab_size]
    if outside:
        raise bad_request("logit_bias", f"token ids {outside[:8]} are outside the vocabulary of pool {pool!r} "
                          f"(ids 0..{vocab_size - 1})")


def check_context(req: ChatRequest | CompletionRequest, num_prompt_tokens: int, max_model_len: int,
                  pool: str) -> None:
    """Refuse a request whose prompt + max_tokens exceed its pool's context, naming the output limit's
    field: code `invalid_value` when max_tokens alone leaves no room for a prompt (OpenAI's code for a
    max_tokens over the model's limit), else `context_length_exceeded` (OpenAI's code when prompt and
    completion together exceed the context). Unset max_tokens always fits: it becomes what is left."""
    max_tokens, param = req.params.max_tokens, req.max_tokens_param
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    if max_tokens >= max_model_len:
        raise ApiError(400, f"{param}: {max_tokens} is too large: pool {pool!r} has a context of "
                       f"max_model_len {max_model_len} tokens, prompt included", param=param, code="invalid_value")
    raise ApiError(400, f"{param}: {max_tokens} tokens after a {num_prompt_tokens}-token prompt exceed "
                   f"max_model_len {max_model_len} of pool {pool!r}; at most {max_model_len - num_prompt_tokens} "
                   "fit (or leave max_tokens unset)", param=param, code="context_length_exceeded")
