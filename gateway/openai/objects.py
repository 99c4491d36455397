"""The JSON objects the OpenAI API returns: chat and text completions, their stream chunks, usage and
logprobs, and the list of a paged endpoint (with its query's `limit` and `order`). Plain dicts, built from what
the engine produced; no HTTP here."""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.openai.errors import bad_request


def new_id(prefix: str, sep: str = "-") -> str:
    """A fresh id: `chatcmpl-…`, `cmpl-…` as chat and text completions have them; the Responses API's
    objects take `sep` "_" (`resp_…`, `msg_…`, `rs_…`, as OpenAI's, which clients may tell apart by it)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens` (chat completions) its `prompt_tokens_details`: the
    prompt tokens whose K/V came from the prefix cache; with `reasoning_tokens` (a thinking model's chat)
    its `completion_tokens_details`."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]],
                  token_text: TokenText, token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """Chat's (and the Responses API's) logprobs: each token's text and its own bytes (`token_bytes`, by
    default its text's UTF-8): joined, a character split over tokens is whole again, as OpenAI's are."""
    def entry(tok: int) -> dict[str, Any]:
        return {"token": token_text(tok), "bytes": list(token_bytes(tok) if token_bytes else token_text(tok).encode())}

    return {"content": [entry(tok) | {"logprob": lp, "top_logprobs": [
        entry(t) | {"logprob": v} for t, v in (top[i] if i < len(top) else [])]}
        for i, (tok, lp) in enumerate(zip(token_ids, logprobs))]}


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[int, float]]], token_text: TokenText,
                        token_bytes: TokenBytes | None = None, text_offset: int = 0,
                        before: Sequence[int] = ()) -> dict[str, Any]:
    """The completions API's logprobs of these tokens (`completion_logprobs_from`)."""
    return completion_logprobs_from(token_ids, logprobs, top, token_text, token_bytes, text_offset, before)[0]


def completion_logprobs_from(token_ids: Sequence[int], logprobs: Sequence[float],
                             top: Sequence[Sequence[tuple[int, float]]], token_text: TokenText,
                             token_bytes: TokenBytes | None = None, text_offset: int = 0,
                             before: Sequence[int] = ()) -> tuple[dict[str, Any], int]:
    """(The completions API's logprobs (`token_bytes`: each token's own bytes): a token by its text, or, where
    its bytes are part of a character, as `bytes:\\xNN...` (OpenAI's name: the pieces of different characters
    no longer share the text U+FFFD, and a top_logprobs entry no longer takes another's place); top_logprobs
    with the sampled token among them (up to logprobs + 1, as OpenAI); each token's text_offset where the
    text stood before it, counting whole characters (`before`: the output's tokens before these, at least its
    last three, whose unfinished character one of these may finish; `text_offset`: their text's length);
    and where the last token's text ends, the next offset (`completion_logprobs`: the logprobs alone)."""
    def name(tok: int) -> str:
        text = token_text(tok)
        if token_bytes is None or "\ufffd" not in text:
            return text
        raw = token_bytes(tok)
        try:
            return raw.decode("utf-8")   # a token whose text is U+FFFD itself
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    offsets = token_offsets(token_ids, token_text, token_bytes, text_offset, before)
    tokens, tops = [], []
    for i, tok in enumerate(token_ids):
        tokens.append(name(tok))
        entries: dict[str, float] = {}
        for t, v in [*(top[i] if i < len(top) else []), (tok, logprobs[i])]:
            entries.setdefault(name(t), v)   # the best of any that share a name
        tops.append(entries)
    return {"tokens": tokens, "token_logprobs": list(logprobs[:len(tokens)]), "top_logprobs": tops,
            "text_offset": offsets[:-1]}, offsets[-1]


def token_offsets(token_ids: Sequence[int], token_text: TokenText, token_bytes: TokenBytes | None = None,
                  text_offset: int = 0, before: Sequence[int] = ()) -> list[int]:
    """Where each token's text begins, counting whole characters from `text_offset` (`before`: as
    `completion_logprobs`), then where the last one's ends: one more offset than tokens."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for tok in before if token_bytes is not None else ():
        decoder.decode(token_bytes(tok))   # only its state: the bytes of a character begun there
    offsets = [text_offset]
    for tok in token_ids:
        offsets.append(offsets[-1] + len(decoder.decode(token_bytes(tok)) if token_bytes is not None
                                          else token_text(tok)))
    return offsets


def chat_response(request_id: str, model: str, created: int, choices: list[dict[str, Any]], prompt_tokens: int,
                  completion_tokens: int, cached_tokens: int = 0,
                  reasoning_tokens: int | None = None) -> dict[str, Any]:
    """A chat completion; `created` when the request came (as its stream's chunks say, and vLLM)."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}


def chat_choice(index: int, text: str | None, logprobs: dict[str, Any] | None, finish_reason: str | None,
                tool_calls: list[dict[str, Any]] | None = None, *, thinks: bool = False,
                reasoning_content: str | None = None, legacy: bool = False) -> dict[str, Any]:
    """A chat choice; a thinking model's message has `reasoning_content` (None when it did not think);
    `legacy`: the request offered the deprecated `functions` (`calls_field`)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinks:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message.update(calls_field(tool_calls, legacy))
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def calls_field(calls: list[dict[str, Any]], legacy: bool) -> dict[str, Any]:
    """A message's (or a stream delta's) calls: `tool_calls`; for a request that offered the deprecated
    `functions`, its one call as OpenAI's `function_call` ({name, arguments}: a delta's name in its first
    piece only), what clients of that API read."""
    return {"function_call": calls[0]["function"]} if legacy else {"tool_calls": calls}


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict[str, Any]],
               include_usage: bool, usage_so_far: dict[str, int] | None = None) -> dict[str, Any]:
    """With `include_usage` the chunk has a `usage` key: None (OpenAI's), or `usage_so_far` (vLLM's
    continuous usage stats)."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_so_far
    return chunk


def completion_response(request_id: str, model: str, created: int, choices: list[dict[str, Any]],
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict[str, Any]],
                     include_usage: bool, usage_so_far: dict[str, int] | None = None) -> dict[str, Any]:
    """As `chat_chunk`, for completions."""
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_so_far
    return chunk


def usage_chunk(request_id: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int | None = None,
                reasoning_tokens: int | None = None) -> dict[str, Any]:
    """A stream's last chunk (`stream_options.include_usage`); `cached_tokens`, `reasoning_tokens` as in `usage`."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                   reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage object."""
    # cache_write_tokens: the openai SDK's type requires it (an int); a prefix cache writes as it computes: 0 billed
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens,
                                                                     "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def list_object(data: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a list endpoint (files, batches, a response's input items), as OpenAI's cursor pages are."""
    return {"object": "list", "data": list(data), "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def page_limit(query: Mapping[str, str], default: int, most: int) -> int:
    """A list query's `limit`: decimal digits, 1..`most` (`default` when absent); else a 400 naming it."""
    raw = query.get("limit", str(default))
    limit = int(raw) if raw.isdecimal() and len(raw) < 6 else 0
    if not 1 <= limit <= most:
        raise bad_request("limit", f"must be an integer in 1..{most}, got {raw[:40]!r}")
    return limit


def page_ascending(query: Mapping[str, str]) -> bool:
    """A list query's `order`: "asc" (True) or "desc", the default; else a 400 naming it."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order", f"must be 'asc' or 'desc', got {order[:40]!r}")
    return order == "asc"
