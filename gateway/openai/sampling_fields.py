"""The request fields chat completions and completions share, and the checks both answer to.

`RequestFields` is the base model of both bodies: `model`, `stream` / `stream_options`, `max_tokens`,
`response_format`, the sampling knobs (vLLM's extras too: `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `priority`, `skip_special_tokens`, `include_stop_str_in_output`) and the fields accepted
and ignored (OpenAI's `user`, `store`, `metadata`...; vLLM's `spaces_between_special_tokens`). Any other field is refused, so a misspelt parameter is not silently dropped; a field sent as
JSON null is unset, as OpenAI's SDKs send it. The model checks types and the protocol's own bounds
(temperature in [0, 2], max_tokens >= 1); the engine's bounds (n, top_p, penalties, stop strings,
logit_bias) are `SamplingParams`' own, checked there once and reported naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Protocol

import msgspec

from engine.sampling import SamplingParams
from engine.structured import StructuredOutput
from gateway.openai.errors import ApiError, bad_request
from pools.config.gateway_spec import RequestLimits
from pools.pool import ADVISED_FIELDS

# Integers the engine's wire (MessagePack) carries: a client's 10**23 is a 400 naming its field, not a 500.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]      # the vocabulary's range is the pool's check
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]   # unset: whatever the context leaves, as vLLM does


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM's: with include_usage, the usage so far in every chunk
    include_obfuscation: bool | None = None      # accepted: no stream of ours is padded against side channels


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    """`response_format.json_schema`: the schema is enforced, strict or not; not strict, what the grammar
    library cannot enforce (`uniqueItems`, `not`) is left unenforced, as OpenAI leaves it, not refused."""

    name: str
    schema: dict[str, Any] | bool = msgspec.field(default_factory=dict)
    strict: bool | None = None
    description: str | None = None
    type: Any = None   # accepted and ignored


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class RequestFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of a chat completion or completion body but its input (messages, prompt)."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    response_format: ResponseFormat | None = None
    priority: Int64 | None = None
    n: Int64 | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None   # {token id: bias}: ids, range and count are SamplingParams'
    user: str | None = None    # accepted and ignored (typed as OpenAI and vLLM type them): they change nothing we do
    safety_identifier: str | None = None       # `user`'s successor in OpenAI's API
    prompt_cache_key: str | None = None        # a cache hint: our prefix cache and placement find prefixes unasked
    prompt_cache_retention: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    spaces_between_special_tokens: bool | None = None   # vLLM's: only a slow tokenizer's decode reads it; ours,
    # as HF's fast ones (and vLLM's streaming detokenizer with them), write special tokens as they are


# RequestFields' names that are SamplingParams' too, passed on where set
_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
             "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias")


def unset_fields(body: RequestFields) -> frozenset[str]:
    """The fields a model's generation_config.json may advise (`pools.pool.ADVISED_FIELDS`) that the request left
    unset (absent or null)."""
    return frozenset(name for name in ADVISED_FIELDS if getattr(body, name) is None)


def sampling_params(body: RequestFields, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutput | None = None, max_tokens_param: str = "max_tokens") -> SamplingParams:
    """The engine's parameters of `body`; its refusal ("top_p: ...", "logit_bias[5]: ...") a 400 naming
    the field (`max_tokens_param`: the field `max_tokens` came from, as the client named it)."""
    kwargs: dict[str, Any] = {name: value for name in _SAMPLING if (value := getattr(body, name)) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured=structured, **kwargs)
    except ValueError as exc:
        message = re.sub(r"\bmax_tokens\b", max_tokens_param, str(exc))
        field = message.split(":", 1)[0].split("[", 1)[0]
        raise ApiError(400, message, param=field if field in kwargs or field == max_tokens_param else None) from None


def stream_flags(body: RequestFields) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): `stream_options.continuous_usage_stats` (vLLM's) with
    `include_usage` puts the usage so far in every chunk, so a client can tell how many tokens a chunk
    carries (two, when the detokenizer held back a token that ended inside a character)."""
    stream, options = bool(body.stream), body.stream_options
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options", "is only allowed with stream: true")
    include = bool(options.include_usage)
    return stream, include, include and bool(options.continuous_usage_stats)


_FORMAT_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # OpenAI's rule for a response format's name


def response_format(value: ResponseFormat | None, param: str = "response_format") -> StructuredOutput | None:
    """OpenAI's `response_format` (chat, and completions as vLLM takes it) as the constraint it asks for:
    type text none, json_object any JSON object, json_schema the schema of its `json_schema`."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return StructuredOutput("json_object")
    spec, where = value.json_schema, f"{param}.json_schema"
    if spec is None:
        raise bad_request(where, "is required with type json_schema")
    if not _FORMAT_NAME.fullmatch(spec.name):
        raise bad_request(f"{where}.name", f"must be 1-64 letters, digits, '_' or '-', got {spec.name!r}")
    try:
        return StructuredOutput.json_schema(spec.schema, lenient=spec.strict is not True)
    except ValueError as exc:
        raise bad_request(f"{where}.schema", str(exc).removeprefix("structured output: ")) from None


def check_choices(n: int, num_prompts: int, limits: RequestLimits) -> None:
    """n x prompts engine requests at most `limits.max_choices`."""
    if n * num_prompts > limits.max_choices:
        raise bad_request("n", f"n={n} for {num_prompts} prompt(s) asks for {n * num_prompts} completions; at most "
                          f"{limits.max_choices} per request (gateway.limits.max_choices)")


class PoolRequest(Protocol):
    """What the checks against a pool read of a chat or completion request."""

    params: SamplingParams
    max_tokens_param: str   # the field that set params.max_tokens


def check_vocabulary(req: PoolRequest, vocab_size: int, pool: str) -> None:
    """Refuse logit_bias and stop_token_ids token ids outside the pool's vocabulary (a bias on a token that
    cannot be sampled, or a stop on one, would silently do nothing)."""
    for param, ids in (("logit_bias", [t for t, _ in req.params.logit_bias]),
                       ("stop_token_ids", req.params.stop_token_ids)):
        if outside := [t for t in ids if t >= vocab_size]:
            raise bad_request(param, f"token ids {outside[:8]} are outside the vocabulary of pool {pool!r} "
                              f"(ids 0..{vocab_size - 1})")


def check_context(req: PoolRequest, num_prompt_tokens: int, max_model_len: int, pool: str) -> None:
    """Refuse a request whose prompt + max_tokens exceed its pool's context, naming the output limit's
    field: code `invalid_value` when max_tokens alone leaves no room for a prompt (OpenAI's code for a
    max_tokens over the model's limit), else `context_length_exceeded` (OpenAI's code when prompt and
    completion together exceed the context). Unset max_tokens always fits: it becomes what is left, which must
    hold min_tokens (named; vLLM's 400 too)."""
    max_tokens, param, min_tokens = req.params.max_tokens, req.max_tokens_param, req.params.min_tokens
    unset = max_tokens is None or getattr(req, "max_tokens_unset", False)   # a completion's default 16
    if unset and num_prompt_tokens + min_tokens > max_model_len:
        raise ApiError(400, f"min_tokens: {min_tokens} tokens after a {num_prompt_tokens}-token prompt exceed "
                       f"max_model_len {max_model_len} of pool {pool!r}; at most {max_model_len - num_prompt_tokens} "
                       "fit", param="min_tokens", code="context_length_exceeded")
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    if max_tokens >= max_model_len:
        raise ApiError(400, f"{param}: {max_tokens} is too large: pool {pool!r} has a context of "
                       f"max_model_len {max_model_len} tokens, prompt included", param=param, code="invalid_value")
    raise ApiError(400, f"{param}: {max_tokens} tokens after a {num_prompt_tokens}-token prompt exceed "
                   f"max_model_len {max_model_len} of pool {pool!r}; at most {max_model_len - num_prompt_tokens} "
                   f"fit (or leave {param} unset)", param=param, code="context_length_exceeded")
