"""A kept response's input items as OpenAI lists them (`GET /v1/responses/{id}/input_items`): the items its
prompt was made of, the earlier turns' (their input and output) first, each as a `ResponseItem` of the openai
SDK. The store keeps them as the next turn reads them (no ids, a message's text alone: `stored_responses`),
so each gets its id here, from the response's id and its place (the same on every call, for `after`), and a
message its parts in the shape of its role (`input_text`, an assistant's `output_text` with its annotations)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.openai.errors import bad_request
from gateway.openai.objects import list_object, page_ascending, page_limit

MAX_LIMIT = 100   # OpenAI's range for `limit`: 1..100, 20 by default
_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_ITEM_ID = re.compile(r"(?:msg|fc|fco|rs|item)_([0-9a-f]+)_(\d+)")   # `item_view`'s ids


def input_item_place(item_id: str) -> tuple[str, int] | None:
    """(the response id, the item's index in its conversation) an input item's id (`item_view`'s) names; None
    for an id of another shape (an output item's)."""
    found = _ITEM_ID.fullmatch(item_id)
    return None if found is None else (f"resp_{found[1]}", int(found[2]))


def input_items_page(items: Sequence[dict[str, Any]], response_id: str,
                     query: Mapping[str, str]) -> dict[str, Any]:
    """The list object of `items` as `query` asks (`order` desc by default: the last item first; `limit`;
    `after`, an item id of the previous page); a 400 naming the parameter it cannot take."""
    ascending, limit = page_ascending(query), page_limit(query, 20, MAX_LIMIT)
    views = [item_view(item, response_id, i) for i, item in enumerate(items)]
    if not ascending:
        views.reverse()
    start = 0
    if (after := query.get("after")) is not None:
        start = next((i + 1 for i, view in enumerate(views) if view["id"] == after), None)
        if start is None:
            raise bad_request("after", f"response {response_id!r} has no input item {after[:80]!r}")
    return list_object(views[start:start + limit], start + limit < len(views))


def item_view(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """A kept input item (the `index`-th of response `response_id`'s) as the list shows it."""
    kind = item.get("type", "message")
    view = {**item, "type": kind, "id": f"{_PREFIXES.get(kind, 'item')}_{response_id.removeprefix('resp_')}_{index}"}
    if kind == "message":
        role = item.get("role", "user")
        view.update(role=role, content=_parts(item.get("content"), role == "assistant"), status="completed")
    elif kind == "reasoning":   # its text as the SDK's parts (a string was listed as one, read a character a part)
        for key, part in (("summary", "summary_text"), ("content", "reasoning_text")):
            if isinstance(value := item.get(key), str):
                view[key] = [{"type": part, "text": value}]
            elif isinstance(value, list):
                view[key] = [{"type": part, "text": p["text"]} if p.get("type") in _TEXT else dict(p) for p in value]
        view.setdefault("summary", [])
    elif kind in ("function_call", "function_call_output"):
        view.setdefault("status", "completed")
        if kind == "function_call_output" and isinstance(output := item.get("output"), list):
            view["output"] = _parts(output, assistant=False)
    return view


_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text")   # a text part, whatever its name


def _parts(content: Any, assistant: bool) -> list[dict[str, Any]]:
    """A message's content as the parts of its role's item: an assistant's text as `output_text` (with its
    annotations), anyone else's as `input_text`, whichever of the text part types the request sent; images,
    files and refusals as sent."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(p) for p in content or ()]
    shaped = []
    for part in parts:
        if part.get("type") in _TEXT:
            part = {"type": "output_text", "text": part.get("text", ""), "annotations": part.get("annotations") or [],
                    **({"logprobs": part["logprobs"]} if "logprobs" in part else {})} if assistant \
                else {"type": "input_text", "text": part.get("text", "")}
        shaped.append(part)
    return shaped
