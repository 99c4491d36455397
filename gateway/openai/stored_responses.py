"""The Responses API's endpoints: `POST /v1/responses` (answered by `gateway.openai.responses`), and, for the
responses the gateway keeps, `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`POST /v1/responses/{id}/cancel`.

Kept: a response whose request has `store: true` (OpenAI's default) when the gateway has a data dir
(`cliffguard serve --data-dir`), in the same SQLite file as the Batch API (`pools.store.response_store`),
owned by the API key that made it (`Tenants.owner`, as files and batches): another key's id answers
404 exactly as an unknown one. A finished response is written before its last bytes go out, so a
client that read it may fetch it or continue from it at once. Kept as long as
`gateway.stored_responses` says (30 days, 10000 per owner by default).

`previous_response_id` continues a kept conversation: its input items and its output items come
before the request's own input (the instructions are the request's own, as OpenAI's), so the prompt
starts as the last one did and the prefix cache reuses its blocks. An unknown (or another key's)
id, one still running, or one that failed or was cancelled before it had any output (its input never
ran: continuing it would carry that input on, turn after turn) is a 400 naming `previous_response_id`.

`background: true` is routed and checked as a foreground request is (an unknown model, a prompt over
the context, a grammar that cannot be enforced: the same 4xx, nothing kept), then answered at once with
the Response `queued`, run as any request of the key's tenant (credits, priority, routing) but for one
thing: it waits for its device and its credits however long (`gateway.device_wait_seconds` and the pool's
`max_queue_seconds` are for a client holding a connection; this one polls), and each change of status kept;
GET polls it (streaming it, `stream` or `starting_after`, is a 400). `cancel` stops one queued or in
progress (its engine request is aborted, its KV freed) and leaves it `cancelled`; a finished one is returned
as it is; one not run in the background is a 400. A background response queued or in progress when the
gateway stops is run again when it starts, but one an upstream pool had (in progress there) is not sent
again: it fails `upstream_disconnected`, since the upstream may have run it.

Without a data dir (an in-process app) nothing is kept: `store` left out is answered with
`store: false`, and `store: true`, `background` and `previous_response_id` are 400s naming them.
Requests answered by an upstream pool are sent `store: false` (it keeps nothing), the earlier turns' items in
the input shape another server reads (`relayed_item`); a background one's Response, and a foreground stored one
not streamed, is kept here with the gateway's own `id`, `created_at`, `background`, `store`,
`previous_response_id` and `metadata`; a streamed one is relayed as the upstream writes it, not kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from gateway.openai import objects
from gateway.admission import bearer_key
from gateway.batch.execution import MAX_STORE_ATTEMPTS, RETRY_FIRST_S, RETRY_MAX_S
from gateway.completion import Completion, constrained
from gateway.handlers import parsed, read_json
from gateway.openai.chat import ChatRequest
from gateway.openai.errors import ApiError, bad_request, storage_unavailable
from gateway.openai.input_items import input_items_page
from gateway.openai.responses import (ResponsesAnswer, ResponsesRequest, parse_responses, renamed, response_error,
                                      response_object)
from gateway.openai.responses_body import relayed_item
from gateway.openai.sampling_fields import check_context
from gateway.runtime import GATEWAY, Gateway
from pools.pool import Pool
from pools.store.batch_store import STORAGE_ERRORS
from pools.store.response_store import FINISHED, PURGE_EVERY_S, ResponseStore, StoredResponse
from pools.store.schema import opened

log = logging.getLogger("cliffguard.responses")

__all__ = ["RESPONSES", "KeptResponses", "setup"]

T = TypeVar("T")


class KeptResponses:
    """The gateway's kept responses: `store` (SQLite, used from one thread off the event loop) and the
    background runs. `start` resumes the runs a stopped gateway left; `stop` cancels the running ones
    (left unfinished in the store, for the next start) and closes the store. A run's store writes are
    tried again after a storage error (`durable`), with the batch runner's back-off and number of tries."""

    def __init__(self, store: ResponseStore, gateway: Gateway) -> None:
        self.store, self.gateway = store, gateway
        self.retry_first_s, self.retry_max_s, self.max_store_attempts = RETRY_FIRST_S, RETRY_MAX_S, MAX_STORE_ATTEMPTS
        self._runs: dict[str, asyncio.Task] = {}
        self._were_running: set[str] = set()   # in progress when the last gateway stopped (`start`)
        self._per_owner: Counter[str] = Counter()   # background runs queued or in progress (and being queued)
        self._purging: asyncio.Task | None = None

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the store's thread; a storage error is a 503 `storage_unavailable`."""
        try:
            return await self.store.on_thread(fn, *args, **kwargs)
        except STORAGE_ERRORS as exc:
            log.error("response store: %s", exc)
            raise storage_unavailable("response store", exc) from None

    async def durable(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the store's thread, for a background run: tried again after a storage error
        (disk full, locked past the busy timeout; each store call is one transaction, so a failed one changed
        nothing), as `gateway.batch.execution.BatchRunner.durable` does; after `max_store_attempts`, the 503
        `storage_unavailable` that `db` raises, which the run keeps as its failure."""
        try:
            return await self.store.retried("response store", fn, *args, tries=self.max_store_attempts,
                                            first_s=self.retry_first_s, max_s=self.retry_max_s, **kwargs)
        except STORAGE_ERRORS as exc:
            log.error("response store: %s (%s), %d times in a row", exc, fn.__name__, self.max_store_attempts)
            raise storage_unavailable("response store", exc) from None

    async def _purge(self) -> None:
        """Every PURGE_EVERY_S, the store's retention (`ResponseStore.purge`) on its thread, beside the
        responses' own writes; a storage error waits for the next turn."""
        while True:
            await asyncio.sleep(PURGE_EVERY_S)
            try:
                await self.store.on_thread(self.store.purge)
            except STORAGE_ERRORS as exc:
                log.warning("response store: purging failed: %s; trying again in %.0f s", exc, PURGE_EVERY_S)

    async def start(self) -> None:
        """Run again the background responses a stopped gateway left; each is `queued` again until admitted.
        Purge the store from time to time (`_purge`)."""
        self._purging = asyncio.get_running_loop().create_task(self._purge(), name="response store purge")
        for stored in await self.db(self.store.unfinished):
            log.info("%s: a background response the gateway stopped under; running it again", stored.id)
            if stored.status != "queued":   # it was in progress: it waits for its device and credits again
                self._were_running.add(stored.id)
                stored = dataclasses.replace(stored, response={**stored.response, "status": "queued"})
                try:
                    await self.db(self.store.update, stored.response, unless=FINISHED)
                except ApiError as exc:   # it still runs; it reads in_progress until admitted
                    log.error("%s: not set back to queued: %s", stored.id, exc.message)
            self._launch(stored)

    async def stop(self) -> None:
        runs = list(self._runs.values()) + ([self._purging] if self._purging is not None else [])
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await self.store.shutdown()

    async def keep(self, final: dict[str, Any], *, owner: str, tenant: str, request: dict[str, Any],
                   items: list[dict[str, Any]]) -> bool:
        """Store a finished Response (`ResponsesAnswer.keep`), even if its client leaves meanwhile; False,
        logged, if the store failed."""
        try:
            await asyncio.shield(self.db(self.store.put, final, owner=owner, tenant=tenant, request=request,
                                         items=items))
            return True
        except ApiError as exc:
            log.error("%s: answered but not kept: %s", final["id"], exc.message)
            return False

    async def queue(self, asked: ResponsesRequest, body: dict[str, Any], *, owner: str,
                    tenant: str) -> dict[str, Any]:
        """Keep a background request's Response as `queued` and start its run; the queued Response. A 429
        when its owner has `max_background_per_owner` queued or in progress already (counted from before the
        store's write, so requests at once cannot pass it together). Shielded: a client that leaves meanwhile
        cannot leave a kept response that nothing runs."""
        limit = self.gateway.config.gateway.stored_responses.max_background_per_owner
        if self._per_owner[owner] >= limit:
            raise ApiError(429, f"background: this API key has {self._per_owner[owner]} background responses queued "
                           f"or in progress, the most gateway.stored_responses.max_background_per_owner ({limit}) "
                           "allows; wait for one to end, or cancel one", param="background", type="requests",
                           code="rate_limit_exceeded", headers={"x-should-retry": "false"})   # not the SDK's retries
        self._per_owner[owner] += 1   # this one's place, until its run ends (or it is not kept)

        async def keep_and_launch() -> dict[str, Any]:
            try:
                queued = response_object(asked, objects.new_id("resp", "_"), int(time.time()), "queued", [])
                await self.db(self.store.put, queued, owner=owner, tenant=tenant, request=body, items=asked.items,
                              background=True)
            except BaseException:
                self._per_owner -= Counter([owner])
                raise
            self._launch(StoredResponse(queued["id"], owner, tenant, True, body, asked.items, queued), counted=True)
            return queued
        return await asyncio.shield(keep_and_launch())

    def _launch(self, stored: StoredResponse, counted: bool = False) -> None:
        """Run `stored` in the background; its owner's count of runs goes up (`counted`: already) until it ends."""
        if not counted:
            self._per_owner[stored.owner] += 1
        task = asyncio.get_running_loop().create_task(self._run(stored), name=f"response {stored.id}")
        self._runs[stored.id] = task
        task.add_done_callback(functools.partial(self._ended, stored.id, stored.owner))

    def _ended(self, response_id: str, owner: str, task: asyncio.Task) -> None:
        """A run's done-callback: forget it, and log an exception it ended with (`_run` keeps every failure it
        can as the response's; none may end as a task error nobody reads)."""
        self._runs.pop(response_id, None)
        self._per_owner -= Counter([owner])
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: its background run ended on an error", response_id, exc_info=task.exception())

    async def _run(self, stored: StoredResponse) -> None:
        """Run a background response (`in_progress` once admitted: `_answer`) and keep its end: the Response,
        `failed` with the error, or nothing when the run is cancelled: by `cancel`, which kept `cancelled` first
        (a late end does not overwrite it), or by the gateway stopping, however abruptly (a second Ctrl-C cancels
        every task before `stop` runs): the response stays unfinished, for the next start. Its writes are
        `durable`: a store that fails for good as the run starts leaves the response `failed` with the 503
        `storage_unavailable` naming the error, not `queued` with nothing running it (unless even that cannot be
        written: then it stays unfinished, logged, and the next start runs it again)."""
        try:
            final = _finished(await self._answer(stored))
        except ApiError as exc:
            final = {**stored.response, "status": "failed", "error": response_error(exc)}
        except Exception as exc:   # noqa: BLE001 - kept as the response's failure, never lost
            log.exception("%s: its background run failed", stored.id)
            final = {**stored.response, "status": "failed",
                     "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}
        try:
            await self.durable(self.store.update, _ours(final, stored.response), unless=("cancelled",))
        except ApiError as exc:
            log.error("%s: its end could not be kept: %s", stored.id, exc.message)
        except Exception:   # noqa: BLE001 - logged; the run must not end as a task error nobody reads
            log.exception("%s: its end could not be kept", stored.id)

    async def started(self, stored: StoredResponse) -> None:
        """A background run starts (admitted on a replica, or sent on upstream): `in_progress` from now (it was
        `queued` while it waited for its device and credits); a later end is never overwritten."""
        await self.durable(self.store.update, {**stored.response, "status": "in_progress"}, unless=FINISHED)

    async def _answer(self, stored: StoredResponse) -> dict[str, Any]:
        """Run a kept request (its conversation's items as the input) as its tenant; the Response."""
        gateway, body = self.gateway, stored.request
        asked = await parsed(gateway, parse_responses, {**body, "input": stored.items, "previous_response_id": None},
                             gateway.config.gateway.limits)
        asked = dataclasses.replace(asked, previous_response_id=body.get("previous_response_id"))
        req = asked.chat
        routed = [await _routed(gateway, req)]
        if routed[0][0].is_upstream:
            if stored.id in self._were_running:   # in progress there: it was sent
                raise ApiError(502, f"{stored.id}: sent to its upstream pool before the gateway stopped, which cut "
                               "it; the upstream may have run it, so it is not sent again", type="server_error",
                               code="upstream_disconnected")
            await self.started(stored)   # kept before it is sent: a stop from now on must not send it again
        marks: list[asyncio.Task] = []

        def marking() -> asyncio.Task:   # admitted on a replica (an answer is made)
            marks.append(asyncio.get_running_loop().create_task(self.started(stored), name=f"{stored.id} started"))
            return marks[-1]

        answer_type = functools.partial(_AdmittedAnswer, started=marking, asked=asked, response_id=stored.id,
                                        created_at=stored.response["created_at"])
        try:
            return await Completion(gateway, req, routed, _relayed(body, asked), "/responses", time.perf_counter(),
                                    stored.tenant, patient=True, answer_type=answer_type).answer()
        finally:   # a mark still trying when the run ended is moot: its end is kept next (and is never overwritten)
            for task in marks:
                task.cancel()
            await asyncio.gather(*marks, return_exceptions=True)

    async def cancel(self, response_id: str, *, owner: str) -> dict[str, Any]:
        stored = await self.found(response_id, owner)
        if not stored.background:
            raise bad_request("response_id", f"response {response_id!r} was not created with background: true; "
                              "only a background response can be cancelled")
        if stored.status in FINISHED:
            return stored.response
        cancelled = {**stored.response, "status": "cancelled"}
        if not await self.db(self.store.update, cancelled, unless=FINISHED):
            return (await self.found(response_id, owner)).response   # it finished meanwhile
        if (task := self._runs.get(response_id)) is not None:
            task.cancel()
        return cancelled

    async def found(self, response_id: str, owner: str) -> StoredResponse:
        stored = await self.db(self.store.get, response_id, owner=owner)
        if stored is None:
            raise ApiError(404, f"response_id: no response {response_id!r}", param="response_id", code="not_found")
        return stored


class _AdmittedAnswer(ResponsesAnswer):
    """A background Response's answer, made once the request is admitted on a replica: `started` (a task
    writing the store's `in_progress`; the response was `queued` while it waited for its device and credits)
    runs beside the engine request, so a store that is tried again (`KeptResponses.durable`, up to tens of
    seconds) never holds the credits idle; a store that fails for good first aborts the run with its error."""

    def __init__(self, *args: Any, started: Callable[[], asyncio.Task], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = started

    async def run(self) -> None:
        marked, running = self.started(), asyncio.ensure_future(super().run())
        try:
            await asyncio.wait((marked, running), return_when=asyncio.FIRST_COMPLETED)
            if not running.done() and not marked.cancelled() and (error := marked.exception()) is not None:
                raise error
            await running
        finally:
            if not running.done():   # cut (its engine request aborted) by the failed mark, or by a cancel
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)


def _finished(answer: Any) -> dict[str, Any]:
    """A background run's Response, which must have ended (an upstream pool answers what it answers): else
    an ApiError the run keeps as its failure."""
    if not isinstance(answer, dict) or answer.get("status") not in FINISHED or not isinstance(
            answer.get("output"), list) or not all(isinstance(item, dict) for item in answer["output"]):
        got = f"status {answer.get('status')!r}" if isinstance(answer, dict) else type(answer).__name__
        raise ApiError(502, f"the pool answered no finished Response with its output items ({got})",
                       type="server_error", code="upstream_error")
    return answer


# what a kept background Response says as the request asked it, whatever the pool that ran it answered
_OWN_FIELDS = ("id", "created_at", "background", "store", "previous_response_id", "metadata")


def _ours(final: dict[str, Any], queued: dict[str, Any]) -> dict[str, Any]:
    """A background run's end as it is kept: the gateway's own values (`queued`, the Response made when it was
    queued) over those of the Response that answered. An upstream pool answers its own object, of the relayed
    body (no background, no previous_response_id, store false), made at its own time and with its own id."""
    return {**final, **{key: queued[key] for key in _OWN_FIELDS}}


RESPONSES = web.AppKey("responses", KeptResponses)


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


def _relayed(body: dict[str, Any], asked: ResponsesRequest) -> dict[str, Any]:
    """The body an upstream pool gets: the whole conversation as input (the earlier turns' kept items in the
    input shape it reads, `relayed_item`), nothing for it to keep or look up."""
    relayed = {k: v for k, v in body.items() if k not in ("previous_response_id", "background")}
    own = body["input"] if isinstance(body.get("input"), list) else [asked.items[-1]]   # the client's own, as sent
    earlier = [relayed_item(item) for item in asked.items[:len(asked.items) - len(own)]]
    return {**relayed, "input": earlier + own, "store": False}


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: answered as the chat it is (`gateway.openai.responses`); kept, continued or run in
    the background as the module docstring says."""
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    owner, tenant = _owner(request), gateway.admission.tenant_of(request)
    prior = await _prior(request, body, owner)
    asked = await parsed(gateway, parse_responses, body, gateway.config.gateway.limits, prior)
    kept = request.app.get(RESPONSES)
    if kept is None:
        for key in ("store", "background"):
            if body.get(key):
                _kept(request, key)
        asked = dataclasses.replace(asked, store=False)
    if asked.background:
        await _checked(gateway, asked.chat)   # refused now as a foreground request is, not kept `failed`
        return web.json_response(await kept.queue(asked, body, owner=owner, tenant=tenant))
    keep = None
    if asked.store:
        keep = functools.partial(kept.keep, owner=owner, tenant=tenant, request=body, items=asked.items)
    req = asked.chat
    routed = [await _routed(gateway, req)]
    if keep is not None and routed[0][0].is_upstream and not req.stream:
        # the upstream keeps nothing (`store: false` goes to it): its Response is kept here under an id of ours, so
        # that a later turn continues it (a stream's is relayed as the upstream writes it, and not kept)
        answer = await Completion(gateway, req, routed, _relayed(body, asked), "/responses", received, tenant,
                                  http=request, answer_json=True).answer()
        if isinstance(answer, web.StreamResponse):   # the upstream's error as it answered, or a client gone
            return answer
        final = _ours(_finished(answer), response_object(asked, objects.new_id("resp", "_"), int(time.time()),
                                                          "completed", []))
        final["store"] = await keep(final)   # false where the store failed (logged)
        return web.json_response(final, headers={"x-cliffguard-pool": routed[0][0].name})
    return await Completion(gateway, req, routed, _relayed(body, asked), "/responses", received, tenant, http=request,
                            answer_type=functools.partial(ResponsesAnswer, asked=asked, keep=keep)).answer()


async def _routed(gateway: Gateway, req: ChatRequest) -> tuple[Pool, list[int]]:
    """The request's chat counted and routed; a refusal names the Responses field (`input`, not `messages`)."""
    try:
        return await gateway.route_chat(req.model, req.messages, req.tools, req.chat_template_kwargs, req.offers_calls)
    except ApiError as err:
        raise renamed(err) from None


async def _checked(gateway: Gateway, req: ChatRequest) -> None:
    """A background request refused before it is kept, as `Completion` refuses a foreground one before it
    runs: routing (an unknown model is a 404, a prompt no pool's context holds a 400), the room left for
    `max_output_tokens` in the pool's context, and on a local pool the grammar on the reply. Its run routes
    again (a restart runs it from the kept request)."""
    pool, ids = await _routed(gateway, req)
    check_context(req, len(ids), pool.max_model_len, pool.name)
    if not pool.is_upstream:
        await constrained(gateway, req, pool, ids)


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
