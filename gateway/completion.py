"""`Completion`: one completion request's path through the gateway, the same for an HTTP request and
for a batch line.

The stages, in order (`Completion.answer`):
1. **check**: each routed prompt leaves room for `max_tokens` in its pool's context;
2. **forward** to an upstream pool (`gateway.upstream.relay`), which answers it all (its `priority` clamped as
   in 3, and set to a tenant's floor above 0 where the body has none); otherwise, local pools:
3. **clamp** the priority to what the tenant may ask for (`AdmissionControl.clamp_priority`);
4. **wait for the device**: a pool none of whose replicas has loaded yet holds the request, holding
   nothing (`Gateway.wait_device`); 503 if every replica failed to start, or (with Retry-After) if none
   is ready within `gateway.device_wait_seconds`;
5. **hold credits**: the KV the request may need, in its tenant's channel of each pool's credit queue
   (`AdmissionControl.admitted`), on the replica that can start it soonest, until the engine is done;
6. **run** on that replica and assemble the answer (`gateway.local_answer.LocalResponse`); each prompt's
   prefix-cache hit, as its engine reports it, corrects what placement guessed was cached there. A
   request a worker died under before its client saw anything gives its credits back and runs again
   from stage 4: on another replica when the pool has one up, else on the restarted worker (below);
7. **answer**: the credits are back as soon as the engine is done; then the client gets its stream or
   body (an HTTP request), or the batch runner its JSON (a batch line, `http` None).

Deaths are counted by cause (`gateway.workers.deaths`, read from the device's record, which its
supervisors keep). A death counts against the request when it was its own: the worker's step failed
(`Fatal`) or hung past `gateway.step_timeout_seconds`, or the replica was lost (the process gone without
a word, the connection lost, the cluster's death notice, a stall) while no other replica of the device
was lost within `LOSS_WINDOW_SECONDS` (2 s) of it. Several replicas lost together (a node, a network)
are one fault that was not the request's: those deaths do not count. A request with two deaths that
count, the last one its own while no other suspect ran beside it (`Completion._suspect_gates`), is a poison
request: 500 `poison_request`, never run again; so a request that kills its worker kills it twice, or
three times where the second came with other suspects beside it. Before it is called one, a request whose
verdict hangs on a loss waits (holding nothing) until the window after that loss has passed. Deaths that do not count still
bound the retries: at the `MAX_DEATHS_PER_REQUEST`-th death of any cause the request is answered 503
`engine_dead` with Retry-After; and a request whose replicas are all down waits for one
(`Gateway.wait_device`), then gets 503 with Retry-After. A batch line is not retried here: the batch
runner retries it (`gateway.batch.execution`), told by the code which deaths were the line's own:
503 `engine_dead` for a death that counts, 503 `replica_lost` (with Retry-After) for one that does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.structured import SpecTooLarge, StructuredOutput
from gateway.openai import objects
from gateway.openai.chat import ChatRequest
from gateway.openai.completions import CompletionRequest
from gateway.openai.errors import ApiError, drain_cut, shutting_down
from gateway.openai.harmony import stop_ids as harmony_stop_ids, template_speaks_harmony
from gateway.openai.reasoning import Think, tags_skipped, think_mode
from gateway.openai.sampling_fields import check_context, check_vocabulary
from gateway.client_writes import ClientGone
from gateway.admission import Placed
from gateway.local_answer import LocalResponse
from gateway.runtime import Gateway, device_wait_limit
from gateway.workers.deaths import LOSS, Death, DeathsUnder, Hold
from gateway.openai.tool_grammar import text_grammar, thinking_first
from gateway.openai.tool_formats import format_for
from gateway.openai.tools import ToolFormat
from gateway.upstream.relay import forward, openai_error, retry_headers
from gateway.upstream.stream_seen import ResponseEdit
from pools.pool import Pool

log = logging.getLogger("cliffguard.gateway")

# A request the device worker died under before its client saw anything (nothing streamed yet, or not
# streamed at all) runs again, on another replica or the restarted worker (its client sees one answer);
# once a chunk was streamed, 503 engine_dead (or an error event). It survives this many deaths that count
# (the module docstring); the next makes it a poison request: 500 poison_request, not run again. Batch
# lines are retried by the batch runner instead, by the same count (`gateway.batch.execution.MAX_ENGINE_DEATHS`).
ENGINE_DEATH_RETRIES = 1
MAX_DEATHS_PER_REQUEST = 3    # deaths of any cause under one request: at the last, 503 with Retry-After
DEATH_NOTICE_SECONDS = 15.0   # a death its supervisor has not recorded by then is recorded by the request
LOST_RETRY_AFTER = 2          # seconds: Retry-After of a 503 after deaths that were not the request's own


@dataclass
class Completion:
    """A parsed and routed completion request of `tenant`, received at `received` (perf_counter)."""

    gateway: Gateway
    req: ChatRequest | CompletionRequest
    routed: Sequence[tuple[Pool, list[int]]]
    body: dict[str, Any]
    path: str                           # /chat/completions or /completions (an upstream pool gets the same)
    received: float
    tenant: str
    http: web.Request | None = None     # None: a batch line (JSON back, nothing streamed)
    background: bool = False            # a batch line: served behind interactive traffic
    patient: bool = False               # a background Response: waits for its device and credits however long
    answer_type: Callable[..., LocalResponse] = LocalResponse   # makes the answer (the Responses API's differs)
    answer_json: bool = False           # an HTTP request whose upstream answer comes back as JSON (its error as is)
    response_edit: ResponseEdit | None = None   # a Responses stream an upstream answers, kept here
    _local: LocalResponse | None = dataclasses.field(default=None, init=False, repr=False)   # its latest run's

    async def answer(self) -> web.StreamResponse | dict[str, Any]:
        """The stages of the module docstring. A client that went away (or stopped reading) gets
        nothing more: its closed connection is answered 499, which nobody reads."""
        try:
            return await self._answer()
        except asyncio.CancelledError:   # after a run (a Responses stream's store write, a death's record): its
            if self._local is not None:  # stream's writer goes with the handler, not left waiting for ever
                self._local.abandon()
            raise
        except ClientGone as exc:
            log.info("%s %s: %s", self.http.method if self.http is not None else "batch", self.path, exc)
            return web.Response(status=499)   # nginx's "client closed request"

    async def _answer(self) -> web.StreamResponse | dict[str, Any]:
        self.req = _within_context(self.req, self.routed)
        for pool, ids in self.routed:
            self.gateway.metrics.pool_series(pool.name).routed.inc()
            check_context(self.req, len(ids), pool.max_model_len, pool.name)
            if not pool.is_upstream:
                check_vocabulary(self.req, pool.tokenizer.vocab_size, pool.name)
        upstream = [pool for pool, _ in self.routed if pool.is_upstream]
        if upstream:
            return await self._forward_cuttable(upstream[0])
        self.req = with_model_defaults(self.req, [pool for pool, _ in self.routed])
        self.req, think = await constrained(self.gateway, self.req, *self.routed[0])
        admission = self.gateway.admission
        req = dataclasses.replace(self.req, priority=admission.clamp_priority(self.tenant, self.req.priority))
        local = await self._run_cuttable(req, think)
        # The engine is done with every request: its credits are back, however slowly the client reads.
        return await (local.finish() if self.http is not None else local.result())

    async def _forward(self, pool: Pool) -> web.StreamResponse | dict[str, Any]:
        if len(self.routed) > 1:
            raise ApiError(400, "prompt: a list of prompts cannot be sent to an upstream pool; send them one "
                           "by one", param="prompt")
        gateway, body = self.gateway, self.body
        if isinstance(self.req, CompletionRequest) and self.req.max_tokens_unset:   # as `_within_context` left it
            body = {**body, "max_tokens": self.req.params.max_tokens}
        floor = gateway.admission.clamp_priority(self.tenant, self.req.priority)   # the tenant's, as a local pool's
        if floor != self.req.priority or ("priority" in body and body["priority"] != floor):
            body = {**body, "priority": floor}
        response = await forward(self.http, gateway.upstream, pool, self.path, body, self.req.stream,
                                 gateway.metrics, write_timeout=gateway.config.gateway.write_timeout,
                                 prompt_tokens=len(self.routed[0][1]), received=self.received,
                                 edit=self.response_edit)
        if self.http is not None and (response.status >= 400 or not self.answer_json):
            if response.status >= 400:   # the upstream's error, relayed as it answered (not raised)
                gateway.metrics.errors.labels(status=str(response.status)).inc()
            return response
        if response.status >= 400:
            raise _relayed_error(response)
        return json.loads(response.body)

    async def _run_cuttable(self, req: ChatRequest | CompletionRequest, think: Think | str | None) -> LocalResponse:
        """`_run_local`, which the gateway cuts if it still runs when its drain ends (an HTTP request's: a
        background one or a batch line is kept unfinished for the next start): waiting for its device or its
        credits, a 503 `server_shutting_down`; running, that error as its answer (`LocalResponse.run`)."""
        if self.background or self.http is None:
            return await self._run_local(req, think)
        with self._cuttable():
            try:
                return await self._run_local(req, think)
            except asyncio.CancelledError as exc:
                if (error := drain_cut(exc)) is None:
                    raise
                if self._local is not None and self._local.response is not None:   # a stream begun: its error event
                    self._local.error = error
                    return self._local
                raise error from None

    async def _forward_cuttable(self, pool: Pool) -> web.StreamResponse | dict[str, Any]:
        """`_forward`, cut as `_run_cuttable` is: before the answer began, a 503 `server_shutting_down` (the
        upstream's connection closed, so it stops); a relayed stream ends with that error event itself."""
        if self.background or self.http is None:
            return await self._forward(pool)
        with self._cuttable():
            try:
                return await self._forward(pool)
            except asyncio.CancelledError as exc:
                if (error := drain_cut(exc)) is None:
                    raise
                raise error from None

    @contextlib.contextmanager
    def _cuttable(self) -> Iterator[None]:
        """The request's task in the gateway's `cuttable` while the block runs (`Gateway.cut_in_flight`); a
        503 `server_shutting_down` at once if the drain already ended."""
        if self.gateway.drain_over:
            raise shutting_down()
        task = asyncio.current_task()
        self.gateway.cuttable.add(task)
        try:
            yield
        finally:
            self.gateway.cuttable.discard(task)

    async def _run_local(self, req: ChatRequest | CompletionRequest, think: Think | str | None) -> LocalResponse:
        """Wait for each pool's device, hold the credits on the replicas placement picks, run the request
        there (`think`: where a thinking model's reply starts, `LocalResponse`); again (on another replica,
        or the restarted worker) if a worker died before the client saw anything (HTTP only), until two
        deaths that count make it a poison request (`poison_error`), the last with no other suspect beside it
        (`_suspect_gates`). A pool's `max_queue_seconds` counts the time it waited, never the time it ran."""
        gateway = self.gateway
        under, hold = DeathsUnder(), Hold()   # the worker deaths it was in flight at; its last run's hold
        waits_from, ran = self.received, 0.0   # waits_from: `received` moved on by the time its runs took
        while True:
            async with self._suspect_gates(under, hold) as hold:
                device_from = time.perf_counter()
                for pool, _ in self.routed:   # one deadline for its pools' devices (this pass's waits for them)
                    await gateway.wait_device(pool, patient=self.patient, spent=time.perf_counter() - device_from)
                async with gateway.admission.admitted(
                        self.routed, max_tokens=req.params.max_tokens, n=req.params.n,
                        request_id=objects.new_id("adm"), tenant=self.tenant, priority=req.priority,
                        background=self.background, max_tokens_param=req.max_tokens_param,
                        patient=self.patient, received=waits_from) as placed:
                    if not all(_serving(p) for p in placed.values()):
                        continue   # a replica it holds went down while it waited for another pool's credits: placed
                        # again (on the replica up, or the restarted worker), no death its own
                    local = self._local = self.answer_type(
                        self.http, req, self.routed, placed=placed, received=self.received, metrics=gateway.metrics,
                        tenant=self.tenant, think=think, write_timeout=gateway.config.gateway.write_timeout)
                    clients = {name: p.client for name, p in placed.items()}   # the workers it runs on
                    started = time.perf_counter()
                    await local.run()
                    ran = time.perf_counter() - started
                    self._report_cache_hits(placed, local)
            if local.error is None or local.error.code != "engine_dead":
                return local   # answered, or failed otherwise
            if not self.background and not local.retryable and not under:
                return local   # its client saw part of it: the death's 503 (one death makes no poison request)
            await self._record_deaths(under, placed, clients, local.error.message)
            if self.background:
                return await _judge_line(local, under)   # the batch runner retries it, counting its own deaths
            if not await _judge(local, under, hold.crowded):
                return local
            waits_from += ran
            log.warning("%s: the device worker died before the client saw anything (%s); running it again",
                        local.request_id, under.describe())

    @contextlib.asynccontextmanager
    async def _suspect_gates(self, under: DeathsUnder, last: Hold) -> AsyncIterator[Hold]:
        """An HTTP request a worker death counts (or may yet count: a loss whose window is open) against runs
        holding its devices' `SuspectGate`s: beside the others (shared), or alone among them (exclusive) once
        its last such death came with others beside it, the ones in flight then all suspects; 503 with
        Retry-After if that takes over `gateway.device_wait_seconds` (or a pool's `max_queue_seconds`). A
        fresh request, a batch line (its runner has its own gate) or a background Response (it waits however
        long: it would hold up the others) holds none."""
        suspected = sum(verdict is not False for verdict in under.verdicts())
        if self.background or self.patient or not suspected:
            yield Hold()
            return
        exclusive = last.crowded and suspected > ENGINE_DEATH_RETRIES
        limit = device_wait_limit(self.gateway.config, (pool for pool, _ in self.routed))
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(limit):
                    holds = [await stack.enter_async_context(gate.exclusive() if exclusive else gate.shared())
                             for gate in self.gateway.suspect_gates(pool for pool, _ in self.routed)]
            except TimeoutError:
                raise ApiError(503, f"the device worker died under this request, which waited {limit:g} s to run "
                                    "again beside (or after) the others that were in flight then; retry later",
                               type="server_error", code="pool_unavailable",
                               headers={"Retry-After": str(LOST_RETRY_AFTER)}) from None
            hold = Hold(exclusive)
            try:
                yield hold
            finally:   # crowded by a suspect that came while it ran too
                hold.crowded = any(h.crowded for h in holds)

    def _report_cache_hits(self, placed: dict[str, Placed], local: LocalResponse) -> None:
        """Each prompt's prefix-cache hit, as its engine request reported it, to its pool's placement: it
        corrects what the placement guessed was cached on that replica."""
        index: dict[str, int] = {}
        hits = local.engine_cache_hits
        for i, (pool, _) in enumerate(self.routed):
            k = index[pool.name] = index.get(pool.name, -1) + 1   # the prompt's index in its pool's part
            if i in hits:
                pool.admission.engine_cached(placed[pool.name].key, k, hits[i])

    async def _record_deaths(self, under: DeathsUnder, placed: dict[str, Placed], clients: dict[str, Any],
                             message: str) -> None:
        """Add to `under` the death of each worker the request ran on that is dead now, as its device's
        record has it (at least one: a death nobody recorded in time counts as a loss noticed now)."""
        seen: list[Any] = []
        for name, client in clients.items():
            if client.is_alive or any(client is c for c in seen):
                continue
            seen.append(client)
            p = placed[name]
            record = self.gateway.supervisors[p.pool.device][p.replica].deaths
            death = await record.wait_for(client, DEATH_NOTICE_SECONDS)
            under.add(record, death or record.record(client, p.replica, message, LOSS))
        if not seen:
            p = next(iter(placed.values()))
            record = self.gateway.supervisors[p.pool.device][p.replica].deaths
            under.add(record, Death(p.replica, time.monotonic(), LOSS, message))


async def _judge(local: LocalResponse, under: DeathsUnder, crowded: bool) -> bool:
    """After a death under an HTTP request: True to run it again; else `local.error` is its answer (a
    poison request's 500, the 503 of a request retried too often, or the death's own 503). Poison takes two
    deaths that count, the last of them too, with no other suspect beside it then (`crowded`:
    `_suspect_gates`)."""
    verdicts = under.verdicts()
    if verdicts.count(True) + verdicts.count(None) > ENGINE_DEATH_RETRIES and None in verdicts:
        await under.settle()   # a loss decides it: wait until its window has passed
        verdicts = under.verdicts()
    if verdicts.count(True) > ENGINE_DEATH_RETRIES and verdicts[-1] is True and not crowded:
        log.error("%s: a poison request: the device worker died under it %d times by its own doing (%s); not run "
                  "again", local.request_id, verdicts.count(True), under.describe())
        local.error = poison_error(local.request_id, verdicts.count(True), local.error)
        return False
    if not local.retryable:
        return False
    if len(under) >= MAX_DEATHS_PER_REQUEST:
        log.error("%s: the device's workers died under it %d times (%s); not run again", local.request_id,
                  len(under), under.describe())
        local.error = ApiError(503, f"request {local.request_id}: the device's workers died under it {len(under)} "
                                    f"times (the last: {local.error.message}); retry later", type="server_error",
                               code="engine_dead", headers={"Retry-After": str(LOST_RETRY_AFTER)})
        return False
    return True


async def _judge_line(local: LocalResponse, under: DeathsUnder) -> LocalResponse:
    """After a death under a batch line: its 503 `engine_dead` if the death counts (the line's own), else
    503 `replica_lost` with Retry-After (the batch runner retries it without counting it)."""
    verdicts = under.verdicts()
    if True not in verdicts and None in verdicts:
        await under.settle()
        verdicts = under.verdicts()
    if True not in verdicts:
        local.error = ApiError(503, f"request {local.request_id}: its replica was lost with others of its device "
                                    f"({under.describe()}); retry later", type="server_error", code="replica_lost",
                               headers={"Retry-After": str(LOST_RETRY_AFTER)})
    return local


def _serving(placed: Placed) -> bool:
    """The replica a pool's part was placed on is up now (loaded, alive, not draining), so its client is the
    one the placement picked."""
    return placed.pool.admission.replica_up(placed.replica)


def poison_error(request_id: str, deaths: int, last: ApiError) -> ApiError:
    """The 500 of a request `deaths` worker deaths counted against (`last`: the last death's 503)."""
    return ApiError(500, f"request {request_id}: it was in flight when the device worker died "
                         f"{'twice' if deaths == 2 else f'{deaths} times'}, each time a death of its own (a failed "
                         f"step, a hang, or a replica lost alone; the last: {last.message}); not retried again",
                    type="server_error", code="poison_request",
                    headers={"x-should-retry": "false"})   # the openai SDK retries a 500 unless told not to


async def constrained(gateway: Gateway, req: ChatRequest | CompletionRequest, pool: Pool, ids: list[int]
                      ) -> tuple[ChatRequest | CompletionRequest, Think | str | None]:
    """(`req` with the grammar on its reply in a local `pool`, where a thinking model's chat reply starts: `think_mode`,
    "harmony" for a model whose template writes harmony channels, None for a completion), once the grammar library
    has checked that grammar (a 400 naming its field if it cannot be enforced). The prompt's token `ids` say where
    the reply starts: its grammar and its reasoning split both follow it. A reply keeps special tokens where it may
    call and its format's markers are special tokens of the pool's (`ToolFormat.markers_skipped`), or its think tags
    are (Gemma 4's: `tags_skipped`): its calls and its reasoning are read from its text."""
    if isinstance(req, ChatRequest) and template_speaks_harmony(
            pool.tokenizer.chat_template_source(use_tools=req.tools is not None)):
        return _harmony(req, pool), "harmony"   # its channels split the reply (gateway.openai.harmony)
    think = think_mode(pool.tokenizer, ids, req.tools is not None, req.continued) if isinstance(req, ChatRequest) \
        else None
    # the request's own constraint first, under its own field (a tool grammar may hold it as the JSON reply)
    await gateway.check_grammar(req.params.structured, req.structured_param)
    req = with_grammar(req, pool, think)
    await gateway.check_grammar(req.params.structured, req.structured_param)
    if isinstance(req, ChatRequest) and req.params.skip_special_tokens and (
            (req.offers_calls and format_for(pool.tokenizer, req.tools).markers_skipped(pool.tokenizer))
            or (think is not None and tags_skipped(pool.tokenizer, think.tags))):   # Gemma 4's thought channel
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, skip_special_tokens=False))
    return req, think


def _harmony(req: ChatRequest, pool: Pool) -> ChatRequest:
    """A chat for a harmony model (`gateway.openai.harmony`): its reply decoded with the channel markers, which
    the splitter reads (its calls written as the hermes format's, which the tool parsing reads), stopped at
    `<|return|>` and `<|call|>` (`harmony.stop_ids`). A grammar on its
    reply is not served: a forced or allowed-tools tool choice, a strict tool, a response format: a 400 naming
    the field."""
    if req.tools and (req.tool_choice.mode in ("required", "function") or req.tool_choice.allowed is not None):
        raise ApiError(400, "tool_choice: this model answers in the harmony format, whose replies take no "
                            "grammar here; only \"auto\" and \"none\" are served", param="tool_choice")
    if req.tools and any(tool.strict for tool in req.callable_tools):
        raise ApiError(400, "tools: this model answers in the harmony format, whose replies take no grammar "
                            "here: strict tools are not served (send them with strict false)", param="tools")
    if req.params.structured is not None:
        param = req.structured_param or "response_format"
        raise ApiError(400, f"{param}: this model answers in the harmony format, whose replies take no grammar "
                            "here; send the request without it", param=param)
    stops = tuple(dict.fromkeys((*req.params.stop_token_ids, *harmony_stop_ids(pool.tokenizer))))
    return dataclasses.replace(req, params=dataclasses.replace(req.params, skip_special_tokens=False,
                                                               stop_token_ids=stops))


def with_model_defaults(req: ChatRequest | CompletionRequest, pools: list[Pool]) -> ChatRequest | CompletionRequest:
    """`req` sampling as its pools' model advises (`Pool.sampling_defaults`) where it left a field unset; prompts
    routed to pools that advise otherwise (one samples the engine's params for all) take what they agree on."""
    advice = [pool.sampling_defaults for pool in pools]
    defaults = {key: value for key, value in advice[0].items()
                if key in req.sampling_unset and all(other.get(key) == value for other in advice[1:])}
    return dataclasses.replace(req, params=dataclasses.replace(req.params, **defaults)) if defaults else req


def with_grammar(req: ChatRequest | CompletionRequest, pool: Pool,
                 think: Think | str | None = None) -> ChatRequest | CompletionRequest:
    """A chat whose tool_choice is "required" or a named function (or `allowed_tools`, "auto" too: of those
    tools), constrained to the pool's tool-call
    format by a grammar of the allowed functions' schemas (it takes the place of any response_format:
    the reply is tool calls only); under "auto" with at least one strict tool, or with a response_format,
    by a grammar of plain text that starts no call (or the response_format's JSON) or calls only, a strict
    tool's arguments under its schema, another's any JSON object: as OpenAI, the response_format binds
    the reply, not the calls (a format writing calls as bare JSON objects, which the reply could not be
    told from, keeps non-strict tools out of it: the JSON reply alone). `think`
    (`gateway.openai.reasoning.think_mode`): a thinking model's reply may think first (or, the prompt having
    opened the block, must close it first); a response_format alone becomes a grammar that lets it. Under
    "none" with tools and no response_format, plain text that starts no call (a format whose calls open with
    a marker): no call the model was shown how to write reaches the client as content."""
    if not isinstance(req, ChatRequest):
        return req
    mode = req.tool_choice.mode if req.tools else None
    if mode == "none" and req.params.structured is None:
        fmt = format_for(pool.tokenizer, req.tools)
        if fmt.syntax.is_bare:
            return req
        return dataclasses.replace(req, params=dataclasses.replace(req.params, structured=text_grammar(
            fmt.syntax, think)), structured_param="tool_choice")
    # `allowed_tools` under "auto": a grammar keeps the calls to those tools (beside a response_format, as
    # `_calls_beside_reply` says: where the pool's format writes bare JSON calls, the JSON reply alone)
    calls = mode in ("required", "function") or (mode == "auto" and (
        any(t.strict for t in req.callable_tools) or req.tool_choice.allowed is not None and
        req.params.structured is None or _calls_beside_reply(req, pool)))
    if not calls and (think is None or req.params.structured is None):
        return req
    param = "tools" if calls else req.structured_param
    try:
        grammar = _calls_grammar(req, pool, mode, think) if calls else thinking_first(req.params.structured, think)
    except SpecTooLarge as exc:   # the grammar holds every schema the reply may follow: together past the bound
        raise ApiError(400, f"{param}: the grammar of the reply, with every schema it holds, is too large: "
                       f"{str(exc).removeprefix('structured output: ')}", param=param) from None
    return dataclasses.replace(req, params=dataclasses.replace(req.params, structured=grammar),
                               structured_param=param)


def _calls_grammar(req: ChatRequest, pool: Pool, mode: str, think: Think | str | None) -> StructuredOutput:
    """Calls only ("required", a named function), or text or calls ("auto"), of the tools it may call
    (`allowed_tools`: a grammar under "auto" too, so that no other is called)."""
    fmt = format_for(pool.tokenizer, req.tools)
    if mode == "auto":
        return fmt.auto_grammar(req.callable_tools, req.parallel_tool_calls, _json_reply(req, fmt, pool), think)
    tools = req.callable_tools if mode == "required" else [t for t in req.tools if t.name == req.tool_choice.name]
    return fmt.grammar(tools, req.parallel_tool_calls and mode == "required", think)


def _within_context(req: ChatRequest | CompletionRequest, routed: Sequence[tuple[Pool, list[int]]]
                    ) -> ChatRequest | CompletionRequest:
    """A completion whose max_tokens is the default (unset: 16), at most what its prompts' contexts leave, so
    that every prompt a route admits is answered (511 tokens in a 512-token context: one token, not a 400);
    never below min_tokens (a min_tokens past the room is `check_context`'s 400 naming it)."""
    if not (isinstance(req, CompletionRequest) and req.max_tokens_unset):
        return req
    room = min(pool.max_model_len - len(ids) for pool, ids in routed)
    if room >= req.params.max_tokens:
        return req
    max_tokens = max(1, room, req.params.min_tokens)
    return dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=max_tokens))


def _calls_beside_reply(req: ChatRequest, pool: Pool) -> bool:
    """Non-strict tools under "auto" beside a response_format: a grammar of calls or the JSON reply, unless the
    pool's format writes calls as bare JSON objects (then the reply alone, as the response_format asks)."""
    return req.params.structured is not None and not format_for(pool.tokenizer, req.tools).syntax.is_bare


def _json_reply(req: ChatRequest, fmt: ToolFormat, pool: Pool) -> StructuredOutput | None:
    """Under "auto" with strict tools, what a reply that is not a call must be: the request's
    response_format (JSON), or None (plain text). 400 naming the field where the pool's format writes calls
    as bare JSON objects (a JSON reply could be read as a call); `constrained` has checked it can be enforced."""
    reply, param = req.params.structured, req.structured_param
    if reply is None:
        return None
    if fmt.syntax.is_bare:
        raise ApiError(400, f"{param}: pool {pool.name!r} writes tool calls as bare JSON objects ({fmt.name}), "
                       "which a JSON reply could not be told from; with strict tools under tool_choice auto, leave "
                       f"{param} out or make the tools non-strict", param=param)
    return reply


def _relayed_error(response: web.Response) -> ApiError:
    """An upstream's error response as an ApiError with its status (`relay.openai_error`'s rule) and its word on
    when to try again (`Retry-After`, `x-ratelimit-*`)."""
    error = openai_error(bytes(response.body), f"the upstream answered {response.status}")
    return ApiError(response.status, error["message"], param=error["param"], type=error["type"], code=error["code"],
                    headers=retry_headers(response.headers))
