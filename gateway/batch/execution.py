"""`BatchRunner`: runs the Batch API's lines, each through the line executor (by default
`gateway.handlers.answer` as the batch's tenant, at batch priority), at most `MAX_IN_FLIGHT` of a batch
at once; it resumes unfinished batches after a restart from the durable store
(`pools.store.batch_store.BatchStore`) and holds no state a restart needs.

A line answered 503 `engine_dead` / `replica_lost` / `pool_unavailable`, 502 `upstream_unreachable` (an
upstream pool no connection could be made to: nothing was sent) or 429 (an upstream's rate limit: refused, not
run) is retried with back-off, at most MAX_LINE_ATTEMPTS times. Deaths are counted by cause,
as for any request (`gateway.completion`): the gateway answers a line 503 `engine_dead` when the worker's
death under it was its own (a failed step, a hang, or its replica lost alone) and 503 `replica_lost` when it
was not (several replicas of the device lost at once: a node, a network). Only `engine_dead` counts: a line
answered it twice is a poison line, and after the first it is tried again alone (`line_devices`: alone among the
batch lines of the devices its model is served on, so a death on one device never holds up another's lines, or
an upstream pool's). Either end is recorded as the
line's error, with its last answer. Any other answer is the line's: a line an upstream may have received (502
`upstream_disconnected`) is never sent again, so it never runs twice; nor is one a stop cut while the upstream
had it (kept as sent before it goes out: answered `upstream_disconnected` at the next start). So a stop drains
(`drain`, as the server's stop begins): no line starts from then, and those an upstream pool has get until the
drain's end (`gateway.drain_seconds`) to be answered and kept; a local pool's are cut at once (run again at the
next start). Forwarded lines
carry `Idempotency-Key: <batch id>:<custom_id>` (`gateway.upstream.relay.IDEMPOTENCY_KEY`) for upstreams that
dedupe; the runner does not rely on it. A store call that fails for storage (disk full, database locked) is
retried MAX_STORE_ATTEMPTS times, then the batch pauses, its answers kept, and runs again at the next purge
(every PURGE_EVERY_S): while running, until its completion window ends; while finalizing, until it can finish. A batch still running when its completion window ends expires (`expire_due`, each
purge turn and at the start): its lines in flight are aborted, and it is finalized `expired`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.openai.errors import ApiError, storage_unavailable
from gateway.runtime import Gateway
from gateway.upstream.relay import IDEMPOTENCY_KEY, UPSTREAM_SEND, idempotency_key
from gateway.workers.deaths import SuspectGate
from pools.store.batch_create import new_batch_id
from pools.store.batch_input import BatchInputError, BatchLine, TooManyBatches
from pools.router import UnknownModelError
from pools.store.batch_store import PURGE_EVERY_S, STORAGE_ERRORS, BatchStore
from pools.store.schema import unusable
from pools.tenants import DEFAULT_TENANT

log = logging.getLogger("cliffguard.batches")

MAX_IN_FLIGHT = 16                  # lines of one batch in flight; KV credits, not this, protect the engine
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0
# Answers worth another try: the request never ran (a worker died under it before anything was sent
# to the client, the pool was down, or no connection to the upstream was made); besides these, any 429.
TRANSIENT = {(503, "engine_dead"), (503, "replica_lost"), (503, "pool_unavailable"),
             (502, "upstream_unreachable")}
MAX_LINE_ATTEMPTS = 40              # tries of a line answered transiently (0.5 s ... 30 s apart: about 17 minutes)
MAX_ENGINE_DEATHS = 2               # 503 engine_dead answers (its own deaths) that make a line a poison line
MAX_STORE_ATTEMPTS = 6              # tries of a store call failing for storage, before the batch pauses
DRAIN_POLL_S = 0.05                 # a draining stop's look at the lines an upstream pool still has
PAGE_LINES = 256                    # pending lines read from the store at a time at most (and 8 MiB of bodies)

# (path, body, tenant) -> (HTTP status, JSON body), as an HTTP client of that path with the tenant's key would get them
LineExecutor = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, dict[str, Any]]]]
# a line's body -> the keys of the suspect gates it holds while it runs (`line_devices`)
GateKeys = Callable[[dict[str, Any]], tuple[Hashable, ...]]
T = TypeVar("T")


async def answer_batch_line(gateway: Gateway, path: str, body: dict[str, Any],
                            tenant: str) -> tuple[int, dict[str, Any]]:
    """The default line executor: `gateway.handlers.answer` as the batch's tenant, at batch priority (its error
    answers are counted by the runner, once a line's: `BatchRunner.count_error`)."""
    from gateway.handlers import answer

    return await answer(gateway, path, body, tenant=tenant, batch=True)


def line_devices(gateway: Gateway, body: dict[str, Any]) -> tuple[Hashable, ...]:
    """The gate keys of a line: the local devices its model is served on, in order (an upstream pool's model:
    none, no worker of ours runs it); a model not served here, or none, the one key None (it is answered
    at once)."""
    model = body.get("model")
    try:
        pools = gateway.router.candidates(model) if isinstance(model, str) else None
    except UnknownModelError:
        pools = None
    if pools is None:
        return (None,)
    return tuple(sorted({pool.device for pool in pools if pool.device is not None}))


class StorageFailed(Exception):
    """A store call failed for storage MAX_STORE_ATTEMPTS times; the batch it served pauses (`_run_batch`)."""


@dataclass(frozen=True)
class _Outcome:
    """What is recorded for a line: its last answer, and `error` ({"code", "message"}) when the line is
    recorded as an error rather than a result."""

    status: int
    body: dict[str, Any]
    error: dict[str, str] | None = None


@dataclass
class _Run:
    """One batch being run: its tenant, the lines read ahead, the cursor into the store, the lines in flight."""

    batch_id: str
    tenant: str = DEFAULT_TENANT    # read from the store when the run starts
    task: asyncio.Task | None = None
    cancelling: bool = False
    buffer: deque[BatchLine] = field(default_factory=deque)
    after_line_no: int = 0
    exhausted: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_flight: set[asyncio.Task] = field(default_factory=set)

    def cancel(self) -> None:
        """Take no new line, abort those in flight (not recorded: a cancelled batch's stay pending, in neither
        file; an expired one's are already `batch_expired` errors)."""
        self.cancelling = True
        for task in self.in_flight:
            task.cancel()


class BatchRunner:
    """Runs the pending lines of every unfinished batch through the line executor, records each answer
    once, and finalizes the batch (output and error files).

    `start` resumes every batch a previous process left in_progress, finalizing or cancelling (lines
    that were in flight when it died are still pending and run again). Each line runs as the batch's
    tenant, read from the store. A batch has at most `max_in_flight` lines in flight. A transient
    answer (`TRANSIENT`: 503 `engine_dead` / `replica_lost` / `pool_unavailable`, 502
    `upstream_unreachable`; any 429) is not a result: the line is tried again after a back-off (`retry_first_s`
    doubling, at most `retry_max_s`), at most `max_line_attempts` times in all; a line answered
    `engine_dead` (a death of its own) is tried again alone (`SuspectGate`), and a second `engine_dead` makes
    it a poison line; `replica_lost` (a death that was not its own) is retried like any transient
    answer, and never counts. Both end as the line's error. A store call failing for storage is tried
    `max_store_attempts` times with the same back-off, then the batch pauses (its lines in flight aborted: a local
    pool's run again, an upstream pool's that went out are answered `upstream_disconnected`, as after a stop;
    what it answered kept) and runs again at the next purge (`_purge`, every PURGE_EVERY_S): a running one until
    its window ends (it expires then), a finalizing one until storage lets it finish; a batch whose run raises anything else fails, and one whose failure cannot be written runs
    again at the next purge too: a batch never stays unfinished for long while this runner and its store live.

    Event loop only. Every store call goes through the runner's one thread: the loop never waits on
    SQLite, and the store sees one caller at a time. `stop` leaves unfinished batches as they are in
    the store, for the next start.
    """

    def __init__(self, store: BatchStore, executor: LineExecutor, *, max_in_flight: int = MAX_IN_FLIGHT,
                 retry_first_s: float = RETRY_FIRST_S, retry_max_s: float = RETRY_MAX_S,
                 max_line_attempts: int = MAX_LINE_ATTEMPTS, max_store_attempts: int = MAX_STORE_ATTEMPTS,
                 max_unfinished_per_owner: int | None = None, gate_keys: GateKeys | None = None,
                 count_error: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.count_error = count_error    # a line recorded with an error answer (its status): once, not per try
        self.max_unfinished_per_owner = max_unfinished_per_owner   # `gateway.batches`; None: no limit
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.retry_first_s, self.retry_max_s = retry_first_s, retry_max_s
        self.max_line_attempts, self.max_store_attempts = max_line_attempts, max_store_attempts
        self._runs: dict[str, _Run] = {}
        self._creating: set[str] = set()   # batches `create` is storing the lines of (`validating`)
        self.gate_keys = gate_keys        # None: every line holds one gate
        self._gates: dict[Hashable, SuspectGate] = {}
        self._purging: asyncio.Task | None = None
        self._draining_until: float | None = None   # loop time the stop's drain ends (`drain`)
        self._unrecorded: set[asyncio.Task] = set()   # lines an upstream pool has, their outcome not yet kept

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the store thread, for a client's request: a `BatchInputError` becomes
        a 400 naming its field, a storage error a 503 `storage_unavailable`."""
        try:
            return await self.store.on_thread(fn, *args, **kwargs)
        except BatchInputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except STORAGE_ERRORS as exc:
            log.error("batch store: %s", exc)
            raise storage_unavailable("batch store", exc) from None

    async def durable(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the store thread, for the runner: tried again after a storage error
        (each store call is one transaction, so a failed one changed nothing), StorageFailed after
        `max_store_attempts`."""
        try:
            return await self.store.retried("batch store", fn, *args, tries=self.max_store_attempts,
                                            first_s=self.retry_first_s, max_s=self.retry_max_s, **kwargs)
        except STORAGE_ERRORS as exc:
            raise StorageFailed(f"the batch store failed {self.max_store_attempts} times in a row: {exc}") from exc

    async def _purge(self) -> None:
        """Every PURGE_EVERY_S, drop expired files' bytes (`BatchStore.purge_expired`, a bounded transaction at
        a time, on the store's thread beside the runs' calls), expire the batches whose window ended
        (`expire_due`), and run again any unfinished batch that nothing runs (one paused by a storage failure, one
        whose failure could not be written, or created while its answer could not be read back); each on its own: one that fails (storage,
        a damaged file) waits for the next turn, and neither keeps the others from theirs."""
        async def purge_files() -> None:
            while await self.store.on_thread(self.store.purge_expired):   # more may be due
                await asyncio.sleep(0)

        async def resume() -> None:
            if failed := await self.store.on_thread(self.store.fail_interrupted, keep=set(self._creating)):
                log.warning("failed %d batches whose creation ended half-way: %s", len(failed), ", ".join(failed))
            for batch_id in await self.store.on_thread(self.store.unfinished_batch_ids):
                self.run(batch_id)
        while True:
            await asyncio.sleep(PURGE_EVERY_S)
            for what, turn in (("purging expired files", purge_files), ("expiring batches", self.expire_due),
                               ("resuming batches", resume)):
                try:
                    await turn()
                except Exception as exc:  # noqa: BLE001 - the loop must live: it is what tries again
                    log.warning("batch store: %s failed: %s; trying again in %.0f s", what, exc, PURGE_EVERY_S)

    async def start(self) -> None:
        """Resume every unfinished batch in the store (those past their window expire first: none of their
        lines runs), and purge expired files and expire batches from time to time."""
        try:
            if interrupted := await self.durable(self.store.fail_interrupted):
                log.warning("failed %d batches whose creation the last stop interrupted: %s", len(interrupted),
                            ", ".join(interrupted))
            await self.expire_due()
            ids = await self.durable(self.store.unfinished_batch_ids)
        except StorageFailed as exc:   # `serve` says so in one line, as for a store it cannot open
            raise unusable(self.store.path, exc) from None
        self._purging = asyncio.get_running_loop().create_task(self._purge(), name="batch store purge")
        if ids:
            log.info("resuming %d unfinished batches: %s", len(ids), ", ".join(ids))
        for batch_id in ids:
            self.run(batch_id)

    async def expire_due(self, now: float | None = None) -> None:
        """Expire the batches whose completion window ended before their lines did, one store transaction each
        (`BatchStore.expire_next`: their pending lines become errors `batch_expired`): abort the lines in flight
        of those that run, and finalize them (one that nothing runs is run, to be finalized)."""
        while (batch_id := await self.durable(self.store.expire_next, now)) is not None:
            log.warning("batch %s expired: its completion window ended before its lines did", batch_id)
            if batch_id in self._runs:
                self._runs[batch_id].cancel()
            else:
                self.run(batch_id)

    def drain(self, until: float) -> None:
        """The server's stop began: no line starts from now, and `stop` waits until `until` (loop time) for the
        lines an upstream pool has."""
        self._draining_until = until

    async def _held_by_drain(self) -> None:
        """Once the stop's drain began (`drain`), wait until `stop` cancels the caller; else return at once."""
        if self._draining_until is not None:
            await asyncio.get_running_loop().create_future()

    async def stop(self) -> None:
        """Stop every run (their batches stay unfinished in the store) and close the store; after `drain`,
        once the lines an upstream pool had are answered and kept, or the drain is over (those are cut)."""
        loop = asyncio.get_running_loop()
        while self._draining_until is not None and self._unrecorded and loop.time() < self._draining_until:
            await asyncio.sleep(DRAIN_POLL_S)
        tasks = [run.task for run in self._runs.values()] + ([self._purging] if self._purging is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.shutdown()   # a record already handed to the store's thread lands

    def run(self, batch_id: str) -> None:
        """Run the batch in the background, unless it already runs."""
        if batch_id not in self._runs:
            run = self._runs[batch_id] = _Run(batch_id)
            run.task = asyncio.get_running_loop().create_task(self._run_batch(run), name=f"batch {batch_id}")

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: Any = None, *, owner: str, tenant: str,
                     output_expires_after: Any = None) -> dict[str, Any]:
        """Store a new batch of `owner`, run as `tenant`, and run it: its lines stored a step at a time, each a
        store call of its own, so the store serves the others between them (`pools.store.batch_create`); a step
        that fails drops the batch. Shielded, so a client that leaves meanwhile cannot leave a stored batch that
        nothing runs. A 429 when the owner has `max_unfinished_per_owner` batches unfinished already."""
        async def create_and_run() -> dict[str, Any]:
            batch_id = new_batch_id()
            self._creating.add(batch_id)   # before it is stored: `_purge` fails a validating batch of no creation
            try:
                batch_id, lines = await self.db(self.store.begin_batch, input_file_id, endpoint, completion_window,
                                                metadata, owner=owner, tenant=tenant,
                                                output_expires_after=output_expires_after,
                                                max_unfinished=self.max_unfinished_per_owner, batch_id=batch_id)
            except BaseException as exc:
                self._creating.discard(batch_id)
                if not isinstance(exc, TooManyBatches):
                    raise
                raise ApiError(429, f"this API key has {exc.unfinished} batches in progress, finalizing or "
                               f"cancelling, the most gateway.batches.max_unfinished_per_owner ({exc.limit}) allows; "
                               "wait for one to end, or cancel one", type="requests", code="rate_limit_exceeded",
                               headers={"x-should-retry": "false"}) from None   # the SDK's retries would not help
            try:
                while await self.db(self.store.add_lines, batch_id, lines):
                    pass
                batch = await self.db(self.store.start_batch, batch_id, owner=owner)
            except BaseException:   # a batch started (its answer not read back) is resumed by `_purge`, not dropped
                with contextlib.suppress(StorageFailed):   # else left validating: `_purge` fails it
                    await self.durable(self.store.drop_batch, batch_id)
                raise
            finally:
                self._creating.discard(batch_id)
            self.run(batch_id)
            return batch
        return await asyncio.shield(create_and_run())

    async def cancel(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """Mark the batch cancelling in the store and stop its run (shielded like `create`); the batch
        object, or None (no such batch, or another owner's: left alone)."""
        async def cancel_and_stop() -> dict[str, Any] | None:
            batch = await self.db(self.store.cancel, batch_id, owner=owner)
            if batch is not None and batch["status"] == "cancelling":
                if batch_id in self._runs:
                    self._runs[batch_id].cancel()
                else:
                    self.run(batch_id)   # nothing runs it (its run just ended): finalize it as cancelled
            return batch
        return await asyncio.shield(cancel_and_stop())

    # --- one batch -------------------------------------------------------------------------------
    async def _run_batch(self, run: _Run) -> None:
        """Run the batch's lines, then finalize it a step at a time (the store thread serves clients
        between steps). On a storage error it pauses, as it stands in the store (the answers kept: failing it
        dropped them all, for a disk full for 20 s), and runs again at the next purge; any other exception
        fails it."""
        try:
            run.tenant = await self.durable(self.store.batch_tenant, run.batch_id)
            if await self.durable(self.store.batch_status, run.batch_id) == "in_progress":
                await self._run_lines(run)
            if not run.cancelling:
                await self.durable(self.store.begin_finalizing, run.batch_id)
            while (batch := await self.durable(self.store.finalize_step, run.batch_id)) is None:
                pass
            log.info("batch %s %s: %s%s", run.batch_id, batch["status"], batch["request_counts"],
                     f" ({batch['errors']['data'][0]['message']})" if batch["errors"] else "")
        except StorageFailed as exc:
            log.error("batch %s paused: %s; what it has answered is kept, and it runs again at the next purge "
                      "(in %.0f s)", run.batch_id, exc, PURGE_EVERY_S)
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the batch unfinished for ever
            log.exception("batch %s stopped", run.batch_id)
            await self._fail(run, "internal_error", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self._runs.pop(run.batch_id, None)

    async def _fail(self, run: _Run, code: str, message: str) -> None:
        log.error("batch %s failed: %s: %s", run.batch_id, code, message)
        try:
            await self.durable(self.store.fail, run.batch_id, code, message)
        except Exception:  # noqa: BLE001 - nothing more can be written now
            log.exception("batch %s could not be marked failed; it stays unfinished in the store and runs again "
                          "at the next purge (in %.0f s)", run.batch_id, PURGE_EVERY_S)

    async def _run_lines(self, run: _Run) -> None:
        workers = [asyncio.create_task(self._worker(run)) for _ in range(self.max_in_flight)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _next_line(self, run: _Run) -> BatchLine | None:
        """The next pending line to start, or None once none is left or the batch is cancelling. Waiting
        for the lock and fetching a page both yield, and a cancel may land meanwhile: `_Run.cancel` aborts
        only the lines already in flight, so `cancelling` is checked again after them, and the caller
        starts the line it gets before it yields again."""
        await self._held_by_drain()   # none starts
        async with run.lock:
            if not run.cancelling and not run.buffer and not run.exhausted:
                page = await self.durable(self.store.pending_lines, run.batch_id, run.after_line_no, PAGE_LINES)
                run.buffer.extend(page)
                run.exhausted = not page   # a page may end early (`BatchStore.pending_lines`: its bytes)
                if page:
                    run.after_line_no = page[-1].line_no
            return run.buffer.popleft() if run.buffer and not run.cancelling else None

    async def _worker(self, run: _Run) -> None:
        """Take lines until none is left or the batch is cancelled; record each outcome. A line aborted
        by a cancel is not recorded, and none starts after it (`_next_line`)."""
        while (line := await self._next_line(run)) is not None:
            task = asyncio.ensure_future(self._answer(line, run.tenant, run.batch_id))
            run.in_flight.add(task)
            try:
                try:
                    await asyncio.wait([task])
                finally:
                    run.in_flight.discard(task)
                    task.cancel()   # no-op once done; aborts the line if this worker is being cancelled
                if task.cancelled() and run.cancelling:
                    break
                outcome = (task.result() if not task.cancelled() else
                           _Outcome(500, ApiError(500, "internal error: the line's request was cancelled",
                                                  type="server_error").body()))
                await self.durable(self.store.record, run.batch_id, line.line_no, outcome.status, outcome.body,
                                   error=outcome.error)
                if outcome.status >= 400 and self.count_error is not None:
                    self.count_error(outcome.status)
            finally:
                self._unrecorded.discard(task)

    async def _answer(self, line: BatchLine, tenant: str, batch_id: str) -> _Outcome:
        """The line's outcome as `tenant` (a streaming line is the executor's 400): transient answers
        are tried again up to `max_line_attempts`, a second `engine_dead` (never `replica_lost`) makes a
        poison line. Runs in a task of its own, whose upstream requests carry the line's Idempotency-Key
        and are kept as sent as they go out (a 429's refusal unmarks it): one a stop cut there is not sent
        again at the next start, but answered 502 `upstream_disconnected` (the upstream may have run it)."""
        IDEMPOTENCY_KEY.set(idempotency_key(batch_id, line.custom_id))
        sent: list[bool] = []   # this try went out to an upstream (kept: `line.sent` at the next start)

        async def sending() -> None:
            await self._held_by_drain()   # nothing goes out (a line that waited for a slot, or a back-off): cut unsent
            await self.durable(self.store.mark_sent, batch_id, line.line_no)
            sent.append(True)
            self._unrecorded.add(asyncio.current_task())
        UPSTREAM_SEND.set(sending)
        if line.sent:
            return _Outcome(502, ApiError(502, f"line {line.line_no}: sent to its upstream pool before the gateway "
                                               "stopped, which cut it; the upstream may have run it, so it is not "
                                               "sent again", type="server_error", code="upstream_disconnected").body())
        delay, deaths = self.retry_first_s, 0
        for attempt in range(1, self.max_line_attempts + 1):
            status, body = await self._attempt(line, tenant, alone=deaths > 0)
            if not _is_transient(status, body):
                return _Outcome(status, body)
            if sent:   # a 429: the upstream refused it, it did not run there (a stop now: sent again next start)
                await self.durable(self.store.mark_sent, batch_id, line.line_no, False)
                sent.clear()
                self._unrecorded.discard(asyncio.current_task())
            message = _describe(status, body)
            if _error(body).get("code") == "engine_dead":
                deaths += 1
                if deaths >= MAX_ENGINE_DEATHS:
                    log.error("line %d (%s) of a batch is a poison line: %s", line.line_no, line.custom_id, message)
                    return _Outcome(status, body, {"code": "poison_line", "message": (
                        f"line {line.line_no}: the device worker died {deaths} times while answering it, each time "
                        f"a death of its own, the last time with no other batch line of its devices in flight "
                        f"({message}); not tried again")})
            if attempt < self.max_line_attempts:
                log.warning("line %d (%s): %s; trying again in %.1f s", line.line_no, line.custom_id, message, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
        return _Outcome(status, body, {"code": "retries_exhausted", "message": (
            f"line {line.line_no}: gave up after {self.max_line_attempts} attempts; the last answer was {message}")})

    async def _attempt(self, line: BatchLine, tenant: str, *, alone: bool) -> tuple[int, dict[str, Any]]:
        """One try of the line (`alone`: with no other batch line of its devices in flight); an executor bug
        is a 500 for this line only."""
        keys = self.gate_keys(line.body) if self.gate_keys is not None else (None,)
        async with contextlib.AsyncExitStack() as stack:
            for key in keys:   # in order: no two lines holding some wait on each other
                gate = self._gates.setdefault(key, SuspectGate())
                await stack.enter_async_context(gate.exclusive() if alone else gate.shared())
            try:
                return await self.executor(line.url, line.body, tenant)
            except StorageFailed:   # keeping it as sent, before it went out: the batch pauses, as for any store call
                raise
            except Exception as exc:  # noqa: BLE001 - a bug answering one line must not stop the batch
                log.exception("line %d (%s) of a batch failed", line.line_no, line.custom_id)
                return 500, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()


def _error(body: Any) -> dict[str, Any]:
    """The `error` object of an OpenAI error body ({} for anything else)."""
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _describe(status: int, body: Any) -> str:
    """`503 engine_dead: <message>`, for logs and line errors."""
    code, message = _error(body).get("code"), _error(body).get("message")
    return f"{status}{' ' + code if code else ''}: {message if message else repr(body)}"


def _is_transient(status: int, body: Any) -> bool:
    """`TRANSIENT`, or any 429: refused for now (an upstream's rate limit), so never run. An upstream's own 503
    is the line's answer: a proxy answers one after the request reached the server, which may have run it."""
    return status == 429 or (status, _error(body).get("code")) in TRANSIENT
