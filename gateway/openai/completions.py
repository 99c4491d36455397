"""Completion requests: the body's model (`CompletionBody`), read into a `CompletionRequest` by `parse_completion`.

`prompt` takes every OpenAI shape: a string, an array of token ids, or an array of strings and token-id
arrays (one engine request per prompt); an empty string is the start of a document (`Pool.prompt_ids`).
`echo` puts each prompt before its choices' text, and with `logprobs` its tokens' logprobs before theirs
(`gateway.openai.echo`); `max_tokens: 0` is taken with it alone (the prompt scored, nothing generated). `suffix`
is refused (not supported), `best_of` taken only equal to `n`. `max_tokens` unset or null is 16, OpenAI's
default and vLLM's for this API (chat's runs to the context's end).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from engine.sampling import MAX_LOGPROBS, SamplingParams
from gateway.openai.errors import bad_request, convert_body
from gateway.openai.sampling_fields import (RequestFields, TokenId, check_choices, response_format,
                                            sampling_params, stream_flags, unset_fields)
from pools.config.gateway_spec import RequestLimits

TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
DEFAULT_MAX_TOKENS = 16   # OpenAI's legacy completions, and vLLM's /v1/completions


class CompletionBody(RequestFields, kw_only=True):
    prompt: str | Annotated[list[Any], msgspec.Meta(min_length=1)]   # the items: `_prompts`
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


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
    prompt_param: str = "prompt"
    continuous_usage: bool = False  # the usage so far in every stream chunk
    max_tokens_unset: bool = False  # params.max_tokens is the default: at most what the context leaves
    echo: bool = False              # each choice's text (and logprobs) begins with its prompt's
    echo_only: bool = False         # echo with max_tokens 0: the one token generated is not the answer's
    sampling_unset: frozenset[str] = frozenset()   # sampling fields left unset: the pool's model's defaults apply


def parse_completion(body: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    """A completion body (decoded JSON) as a `CompletionRequest`; ApiError 400 naming the field (a count
    over `limits` too)."""
    echo_only = isinstance(body, dict) and body.get("echo") is True and type(body.get("max_tokens")) is int \
        and body["max_tokens"] == 0   # the prompt scored alone: the engine makes one token, left out
    req = convert_body({**body, "max_tokens": 1} if echo_only else body, CompletionBody)
    prompts = _prompts(req.prompt, limits)
    if req.suffix is not None:
        raise bad_request("suffix", "is not supported by this server")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of", "only best_of == n is supported")
    stream, include_usage, continuous_usage = stream_flags(req)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, max_tokens, req.logprobs, response_format(req.response_format))
    if req.echo and req.logprobs is not None:   # the prompt's own: computed whole (never from the prefix cache)
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    check_choices(params.n, len(prompts), limits)
    return CompletionRequest(model=req.model, prompts=prompts, params=params, stream=stream,
                             include_usage=include_usage, continuous_usage=continuous_usage,
                             priority=req.priority or 0, max_tokens_unset=req.max_tokens is None,
                             sampling_unset=unset_fields(req), echo=bool(req.echo), echo_only=echo_only)


def _prompts(prompt: str | list[Any], limits: RequestLimits) -> list[str | list[int]]:
    """The prompts `prompt` holds: itself (a string, or an array of token ids), or each of its items."""
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all(type(t) is int for t in prompt):
        prompts = [convert_body(prompt, TokenIds, root="prompt")]   # each id in range
    else:
        if len(prompt) > limits.max_prompts:
            raise bad_request("prompt", f"at most {limits.max_prompts} prompts per request "
                              f"(gateway.limits.max_prompts), got {len(prompt)}")
        prompts = convert_body(prompt, list[str | TokenIds], root="prompt")
    return prompts
