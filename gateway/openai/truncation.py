"""The Responses API's `truncation: "auto"`: a conversation whose prompt no pool's context holds (with room for
`max_output_tokens`, or for one token where it is unset) drops its earliest turns until it fits, as OpenAI's
drops items from the conversation's beginning. A turn is a user message and everything after it up to the next
user message (the assistant's reply, its calls and their outputs), so what is left still alternates as chat
templates require and every call keeps its output; the system messages first (`instructions`) stay, and so does
the last turn. The fewest turns are dropped (a binary search: each try renders and counts the conversation once
more). The kept conversation and the Response's items are the whole one; only the prompt is cut. Where even the
last turn alone does not fit, the 400 is the one `disabled` gives."""

from __future__ import annotations

from typing import Any

from gateway.openai.chat import ChatRequest
from gateway.openai.errors import ApiError
from gateway.runtime import Gateway
from pools.pool import Pool

__all__ = ["routed_truncated", "turn_starts"]


def turn_starts(messages: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """(How many system messages lead, the index of each user message after them): where each turn begins."""
    lead = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    return lead, [i for i in range(lead, len(messages)) if messages[i].get("role") == "user"]


async def routed_truncated(gateway: Gateway, req: ChatRequest, error: ApiError | None,
                           routed: tuple[Pool, list[int]] | None) -> tuple[Pool, list[int]]:
    """`req` routed with the fewest leading turns dropped that lets it fit (`routed`: the whole conversation's
    route, None where it was refused with `error`); `error` where no cut fits."""
    lead, starts = turn_starts(req.messages)
    if routed is not None and _fits(req, routed):
        return routed
    low, high, best = 1, len(starts) - 1, None   # turns dropped: at least one, the last one never
    while low <= high:
        mid = (low + high) // 2
        tried = await _route(gateway, req, req.messages[:lead] + req.messages[starts[mid]:])
        if tried is not None:
            best, high = tried, mid - 1
        else:
            low = mid + 1
    if best is None:
        raise error or ApiError(400, f"messages: the last turn alone leaves no room for {req.max_tokens_param} in "
                                f"the context of pool {routed[0].name!r} ({routed[0].max_model_len} tokens)",
                                param="messages", code="context_length_exceeded")
    return best


async def _route(gateway: Gateway, req: ChatRequest, messages: list[dict[str, Any]]) -> tuple[Pool, list[int]] | None:
    """`messages` routed as `req`'s, if they fit (None where no pool's context holds them)."""
    try:
        routed = await gateway.route_chat(req.model, messages, req.tools, req.chat_template_kwargs, req.offers_calls)
    except ApiError as err:
        if err.code == "context_length_exceeded":
            return None
        raise
    return routed if _fits(req, routed) else None


def _fits(req: ChatRequest, routed: tuple[Pool, list[int]]) -> bool:
    """Whether the prompt leaves room in its pool's context for `max_output_tokens` (one token where unset)."""
    pool, ids = routed
    return len(ids) + (req.params.max_tokens or 1) <= pool.max_model_len
