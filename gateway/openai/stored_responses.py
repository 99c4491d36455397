"""The responses the Responses API keeps (`KeptResponses`), as its endpoints (`gateway.openai.response_endpoints`:
`POST /v1/responses`, answered by `gateway.openai.responses`, and `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`) serve them.

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
`store: false`, `store: true` and `background` are 400s naming them, and every response id is unknown.
Requests answered by an upstream pool are sent `store: false` (it keeps nothing), the earlier turns' items in
the input shape another server reads (`relayed_item`); a background one's Response, and a foreground stored one,
is kept here with the gateway's own `id`, `created_at`, `background`, `store`, `previous_response_id` and
`metadata` (a stream's events carry them, its last Response kept before that event goes out:
`gateway.upstream.stream_seen.ResponseEdit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from engine.sampling import SamplingParams
from gateway.openai import objects
from gateway.batch.execution import MAX_STORE_ATTEMPTS, RETRY_FIRST_S, RETRY_MAX_S
from gateway.completion import Completion
from gateway.handlers import parsed
from gateway.openai.chat import ChatRequest
from gateway.openai.errors import ApiError, bad_request, storage_unavailable
from gateway.openai.responses import (ResponsesAnswer, ResponsesRequest, parse_responses, renamed, response_error,
                                      response_object)
from gateway.openai.responses_body import relayed_item
from gateway.openai.truncation import routed_truncated
from gateway.runtime import Gateway
from pools.pool import Pool
from pools.store.batch_store import STORAGE_ERRORS
from pools.store.response_store import FINISHED, PURGE_EVERY_S, ResponseStore, StoredResponse
from pools.store.schema import unusable

log = logging.getLogger("cliffguard.responses")

__all__ = ["RESPONSES", "KeptResponses", "finished_response", "own_fields", "relayed_body", "routed_chat"]

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
        try:
            unfinished = await self.db(self.store.unfinished)
        except ApiError as exc:   # `serve` says so in one line, as for a store it cannot open
            raise unusable(self.store.path, exc.message) from None
        self._purging = asyncio.get_running_loop().create_task(self._purge(), name="response store purge")
        for stored in unfinished:
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
                   items: list[dict[str, Any]], parent: str | None = None) -> bool:
        """Store a finished Response (`ResponsesAnswer.keep`; `parent`: the response it continues), even if its
        client leaves meanwhile; False, logged, if the store failed."""
        try:
            await asyncio.shield(self.db(self.store.put, final, owner=owner, tenant=tenant, request=request,
                                         items=items, parent=parent))
            return True
        except ApiError as exc:
            log.error("%s: answered but not kept: %s", final["id"], exc.message)
            return False

    async def queue(self, asked: ResponsesRequest, body: dict[str, Any], *, owner: str, tenant: str,
                    sampled: SamplingParams | None = None) -> dict[str, Any]:
        """Keep a background request's Response as `queued` and start its run; the queued Response. A 429
        when its owner has `max_background_per_owner` queued or in progress already (counted from before the
        store's write, so requests at once cannot pass it together). Shielded: a client that leaves meanwhile
        cannot leave a kept response that nothing runs. `sampled`: what its run will sample with."""
        limit = self.gateway.config.gateway.stored_responses.max_background_per_owner
        if self._per_owner[owner] >= limit:
            raise ApiError(429, f"background: this API key has {self._per_owner[owner]} background responses queued "
                           f"or in progress, the most gateway.stored_responses.max_background_per_owner ({limit}) "
                           "allows; wait for one to end, or cancel one", param="background", type="requests",
                           code="rate_limit_exceeded", headers={"x-should-retry": "false"})   # not the SDK's retries
        self._per_owner[owner] += 1   # this one's place, until its run ends (or it is not kept)

        async def keep_and_launch() -> dict[str, Any]:
            try:
                queued = response_object(asked, objects.new_id("resp", "_"), int(time.time()), "queued", [],
                                         sampled=sampled)
                await self.db(self.store.put, queued, owner=owner, tenant=tenant, request=body, items=asked.items,
                              background=True, parent=asked.previous_response_id)
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
            final = finished_response(await self._answer(stored))
        except ApiError as exc:
            final = {**stored.response, "status": "failed", "error": response_error(exc)}
        except Exception as exc:   # noqa: BLE001 - kept as the response's failure, never lost
            log.exception("%s: its background run failed", stored.id)
            final = {**stored.response, "status": "failed",
                     "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}
        try:
            await self.durable(self.store.update, own_fields(final, stored.response), unless=("cancelled",))
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
        routed = [await routed_chat(gateway, req, asked.truncation)]
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
            return await Completion(gateway, req, routed, relayed_body(body, asked), "/responses", time.perf_counter(),
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


def finished_response(answer: Any) -> dict[str, Any]:
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


def own_fields(final: dict[str, Any], queued: dict[str, Any]) -> dict[str, Any]:
    """A background run's end as it is kept: the gateway's own values (`queued`, the Response made when it was
    queued) over those of the Response that answered. An upstream pool answers its own object, of the relayed
    body (no background, no previous_response_id, store false), made at its own time and with its own id."""
    return {**final, **{key: queued[key] for key in _OWN_FIELDS}}


RESPONSES = web.AppKey("responses", KeptResponses)


def relayed_body(body: dict[str, Any], asked: ResponsesRequest) -> dict[str, Any]:
    """The body an upstream pool gets: the whole conversation as input (the earlier turns' kept items in the
    input shape it reads, `relayed_item`), nothing for it to keep or look up."""
    relayed = {k: v for k, v in body.items() if k not in ("previous_response_id", "background")}
    own = body["input"] if isinstance(body.get("input"), list) else [asked.items[-1]]   # the client's own, as sent
    earlier = [relayed_item(item) for item in asked.items[:len(asked.items) - len(own)]]
    return {**relayed, "input": earlier + own, "store": False}


async def routed_chat(gateway: Gateway, req: ChatRequest, truncation: str = "disabled") -> tuple[Pool, list[int]]:
    """The request's chat counted and routed, its earliest turns dropped until it fits under `truncation: auto`
    (`gateway.openai.truncation`); a refusal names the Responses field (`input`, not `messages`)."""
    try:
        try:
            routed = await gateway.route_chat(req.model, req.messages, req.tools, req.chat_template_kwargs,
                                              req.offers_calls)
        except ApiError as err:
            if truncation != "auto" or err.code != "context_length_exceeded":
                raise
            return await routed_truncated(gateway, req, err, None)
        return routed if truncation != "auto" else await routed_truncated(gateway, req, None, routed)
    except ApiError as err:
        raise renamed(err) from None

