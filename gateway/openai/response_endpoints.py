"""The Responses API's HTTP endpoints: `POST /v1/responses` (answered by `gateway.openai.responses`; kept,
continued or run in the background by `gateway.openai.stored_responses.KeptResponses`), and, for the responses
the gateway keeps, `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`POST /v1/responses/{id}/cancel`. What is kept, for whom and how long: `gateway.openai.stored_responses`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.sampling import SamplingParams
from gateway.admission import bearer_key
from gateway.completion import Completion, constrained, with_model_defaults
from gateway.handlers import parsed, read_json
from gateway.openai import objects
from gateway.openai.errors import ApiError, bad_request
from gateway.openai.input_items import input_item_place, input_items_page, item_view
from gateway.openai.responses import (ResponsesAnswer, ResponsesRequest, parse_responses, response_error,
                                      response_object)
from gateway.openai.sampling_fields import check_context
from gateway.openai.stored_responses import (RESPONSES, KeptResponses, finished_response, own_fields, relayed_body,
                                             routed_chat)
from gateway.runtime import GATEWAY, Gateway
from gateway.upstream.stream_seen import ResponseEdit
from pools.store.response_store import FINISHED, ResponseStore
from pools.store.schema import opened

log = logging.getLogger("cliffguard.responses")

__all__ = ["setup"]


def setup(app: web.Application, data_dir: Path | str | None) -> None:
    """The Responses API's routes; with `data_dir`, its store (the Batch API's file: call after
    `gateway.batch.endpoints.setup`, which made its tables) and background runs, started after the gateway
    and stopped before it."""
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    if data_dir is None:
        return
    from gateway.batch.endpoints import STORE_FILE
    gateway = app[GATEWAY]
    path = Path(data_dir) / STORE_FILE
    store = opened(functools.partial(ResponseStore, path, gateway.config.gateway.stored_responses), path)
    app[RESPONSES] = KeptResponses(store, gateway)
    app.cleanup_ctx.append(_kept_ctx)


async def _kept_ctx(app: web.Application) -> AsyncIterator[None]:
    kept = app[RESPONSES]
    await kept.start()
    yield
    await kept.stop()


def _owner(request: web.Request) -> str:
    return request.app[GATEWAY].admission.tenants.owner(bearer_key(request))


_NO_DATA_DIR = "this gateway runs without a data dir and keeps no responses (cliffguard serve --data-dir keeps them)"


def _kept(request: web.Request, param: str) -> KeptResponses:
    """The app's kept responses. Without a data dir: asked to keep one, a 400 naming `param`; a response id
    (`response_id` in the path, a `previous_response_id`) names none kept, as OpenAI answers an unknown id
    (404 not_found; 400 previous_response_not_found)."""
    kept = request.app.get(RESPONSES)
    if kept is None:
        if param == "response_id":
            raise ApiError(404, f"response_id: no response {request.match_info['response_id']!r}: {_NO_DATA_DIR}",
                           param=param, code="not_found")
        raise ApiError(400, f"{param}: {_NO_DATA_DIR}", param=param,
                       code="previous_response_not_found" if param == "previous_response_id" else None)
    return kept


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: answered as the chat it is (`gateway.openai.responses`); kept, continued or run in
    the background as the module docstring says."""
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    owner, tenant = _owner(request), gateway.admission.tenant_of(request)
    body = await _referenced(request, body, owner)
    prior = await _prior(request, body, owner)
    asked = await parsed(gateway, parse_responses, body, gateway.config.gateway.limits, prior)
    kept = request.app.get(RESPONSES)
    if kept is None:
        for key in ("store", "background"):
            if body.get(key):
                _kept(request, key)
        asked = dataclasses.replace(asked, store=False)
    if asked.background:
        sampled = await _checked(gateway, asked)   # refused now as a foreground request is, not kept `failed`
        return web.json_response(await kept.queue(asked, body, owner=owner, tenant=tenant, sampled=sampled))
    keep = None
    if asked.store:
        keep = functools.partial(kept.keep, owner=owner, tenant=tenant, request=body, items=asked.items,
                                 parent=asked.previous_response_id)
    req = asked.chat
    routed = [await routed_chat(gateway, req, asked.truncation)]
    completion = functools.partial(Completion, gateway, req, routed, relayed_body(body, asked), "/responses", received,
                                   tenant, http=request)
    if keep is not None and routed[0][0].is_upstream:
        # the upstream keeps nothing (`store: false` goes to it): its Response is kept here under an id of ours, so
        # that a later turn continues it; a stream's events are relayed with the Response's fields ours
        ours = response_object(asked, objects.new_id("resp", "_"), int(time.time()), "in_progress", [])
        if req.stream:
            return await completion(response_edit=_kept_stream(ours, keep)).answer()
        answer = await completion(answer_json=True).answer()
        if isinstance(answer, web.StreamResponse):   # the upstream's error as it answered, or a client gone
            return answer
        final = own_fields(finished_response(answer), ours)
        final["store"] = await keep(final)   # false where the store failed (logged)
        return web.json_response(final, headers={"x-cliffguard-pool": routed[0][0].name})
    return await completion(answer_type=functools.partial(ResponsesAnswer, asked=asked, keep=keep)).answer()


def _kept_stream(ours: dict[str, Any], keep: Callable[[dict[str, Any]], Awaitable[bool]]) -> ResponseEdit:
    """How an upstream's Responses stream is kept: each event's Response with the gateway's own fields (`ours`:
    its id, created_at, store, previous_response_id, metadata), the final one kept (one that is no finished
    Response with its output items is not: its `store` says false); a stream that ends without one (dropped,
    an `error` event) is kept `failed` with the error, as a local run that fails."""
    latest = [ours]   # the last Response the stream showed

    def own(response: dict[str, Any]) -> None:
        response.update(own_fields(response, ours))
        latest[0] = response

    async def kept(response: dict[str, Any]) -> bool:
        try:
            return await keep(finished_response(response))
        except Exception as exc:   # noqa: BLE001 - relayed all the same, said unkept
            log.warning("POST /v1/responses: the upstream's Response %s is not kept: %s", ours["id"], exc)
            return False

    async def failed(error: ApiError | None) -> None:
        error = error or ApiError(502, "the upstream pool's stream ended with an error event", type="server_error",
                                  code="upstream_error")
        await kept({**latest[0], "status": "failed", "error": response_error(error), "incomplete_details": None})
    return ResponseEdit(own, kept, failed)


async def _checked(gateway: Gateway, asked: ResponsesRequest) -> SamplingParams:
    """A background request refused before it is kept, as `Completion` refuses a foreground one before it
    runs: routing (an unknown model is a 404, a prompt no pool's context holds a 400), the room left for
    `max_output_tokens` in the pool's context, and on a local pool the grammar on the reply. Its run routes
    again (a restart runs it from the kept request). What its run will sample with, which its Response says."""
    req = asked.chat
    pool, ids = await routed_chat(gateway, req, asked.truncation)
    check_context(req, len(ids), pool.max_model_len, pool.name)
    if not pool.is_upstream:
        await constrained(gateway, req, pool, ids)
    return with_model_defaults(req, [pool]).params


async def _prior(request: web.Request, body: Any, owner: str) -> list[dict[str, Any]]:
    """The input and output items of the conversation `previous_response_id` names (none without one)."""
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if not isinstance(previous, str):
        return []   # absent, or a wrong type parse_responses names
    kept = _kept(request, "previous_response_id")
    stored = await kept.db(kept.store.get, previous, owner=owner) if previous.isprintable() \
        else None   # no id of ours has a control character or a lone surrogate (which SQLite cannot take)
    if stored is None:
        raise ApiError(400, f"previous_response_id: no response {previous!r}", param="previous_response_id",
                       code="previous_response_not_found")
    if stored.status not in FINISHED:
        raise bad_request("previous_response_id", f"response {previous!r} is {stored.status}; continue from a "
                          "finished one")
    if stored.status in ("failed", "cancelled") and not stored.response["output"]:
        raise bad_request("previous_response_id", f"response {previous!r} was {stored.status} before it had any "
                          "output, so it has no turn to continue; send its input again instead")
    return stored.items + [_as_input(item) for item in stored.response["output"]]


async def _referenced(request: web.Request, body: Any, owner: str) -> Any:
    """`body` with each `item_reference` of its `input` replaced by the kept item it names (`_kept_item`): an
    input item by the id its response's input_items list gives it, an output item by its own id, as the next
    turn takes it back. One that names none of the key's kept items is a 400 naming `input[i].id`."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list) or not any(isinstance(item, dict) and item.get("type") == "item_reference"
                                              for item in items):
        return body
    kept, resolved = _kept(request, "input"), []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type") != "item_reference":
            resolved.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str) or not item_id:
            raise bad_request(f"input[{i}].id", "an item_reference names a kept item by its id (a string)")
        found = await kept.db(_kept_item, kept.store, item_id, owner) if item_id.isprintable() else None
        if found is None:
            raise bad_request(f"input[{i}].id", f"no item {item_id[:80]!r} in this key's kept responses")
        resolved.append(found)
    return {**body, "input": resolved}


def _kept_item(store: ResponseStore, item_id: str, owner: str) -> dict[str, Any] | None:
    """The kept item `item_id` names, as an input item (on the store's thread); None if there is none."""
    if (place := input_item_place(item_id)) is not None:
        stored = store.get(place[0], owner=owner)
        index = place[1]
        if stored is None or index >= len(stored.items) or item_view(stored.items[index], stored.id, index)["id"] != \
                item_id:
            return None
        return stored.items[index]
    output = store.output_item(item_id, owner=owner)
    return None if output is None else _as_input(output)


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item of the next turn (what the Responses API takes back): a message's
    parts their type and text only (the next turn's prompt reads no logprobs, and each later turn of a
    chain keeps these items again)."""
    if item.get("type") == "message":
        return {"type": "message", "role": "assistant",
                "content": [{"type": part["type"], "text": part.get("text", "")} for part in item["content"]]}
    keys = ("type", "content") if item.get("type") == "reasoning" else ("type", "call_id", "name", "arguments")
    return {k: item[k] for k in keys if k in item}   # a reasoning item's text goes to the next assistant turn


async def retrieve_response(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`: the Response as it stands. Its stream (`stream=true`, resumed after
    `starting_after`) is not served: a 400 naming the parameter, which the openai SDK raises, rather than a
    JSON body its stream reader would read as no events at all."""
    for param in ("stream", "starting_after"):
        value = request.query.get(param)
        if value is not None and (param == "starting_after" or value.lower() != "false"):
            raise bad_request(param, "streaming a kept response (or resuming its stream) is not served here; "
                              "GET it without stream and poll until its status is final")
    kept = _kept(request, "response_id")
    return web.json_response((await kept.found(request.match_info["response_id"], _owner(request))).response)


async def list_input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items?limit=&after=&order=`: the items its prompt was made of
    (`gateway.openai.input_items`); `include` asks for nothing these items lack."""
    kept = _kept(request, "response_id")
    stored = await kept.found(request.match_info["response_id"], _owner(request))
    return web.json_response(input_items_page(stored.items, stored.id, request.query))


async def delete_response(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`: a background one still running is cancelled first."""
    kept, response_id, owner = _kept(request, "response_id"), request.match_info["response_id"], _owner(request)
    stored = await kept.found(response_id, owner)
    if stored.background and stored.status not in FINISHED:
        await kept.cancel(response_id, owner=owner)
    if not await kept.db(kept.store.delete, response_id, owner=owner):
        raise ApiError(404, f"response_id: no response {response_id!r}", param="response_id", code="not_found")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    kept = _kept(request, "response_id")
    return web.json_response(await kept.cancel(request.match_info["response_id"], owner=_owner(request)))
