"""The Batch API in OpenAI's shape — `POST /v1/files`, `GET /v1/files/{id}[/content]`, `POST/GET
/v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel` — and `BatchRunner`, which runs
the batches' lines.

The state (files, batches, each line's status and result) is durable in `pools.batchstore.BatchStore`
under the serve command's `--data-dir`; the runner holds none that a restart needs. Each line goes
through the line executor, by default `gateway.handlers.answer` with `batch=True`: routed like any
request and waiting for KV credits behind interactive traffic.

Files and batches belong to the tenant of the API key that created them (`pools.tenants`), and a
batch's lines run as that tenant, also after a restart. Every endpoint sees only the caller's
tenant's: another tenant's id answers exactly as an unknown one (404, or 400 for an input file).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from gateway.handlers import read_json
from gateway.openai_api import ApiError
from gateway.runtime import GATEWAY, Gateway
from pools.batchstore import BatchInputError, BatchLine, BatchStore
from pools.tenants import DEFAULT_TENANT

log = logging.getLogger("cliffguard.batches")

__all__ = ["BATCHES", "BatchRunner", "LineExecutor", "setup"]

STORE_FILE = "batches.sqlite3"      # under --data-dir
MAX_FILE_BYTES = 200 << 20          # an upload, as OpenAI's limit for batch input files
MAX_IN_FLIGHT = 16                  # lines of one batch in flight; KV credits, not this, protect the engine
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0
TRANSIENT_CODES = ("engine_dead",)   # 503 while a device worker restarts (pool_unavailable is permanent)
PAGE_LINES = 256                    # pending lines read from the store at a time

# (path, body, tenant) -> (HTTP status, JSON body), as an HTTP client of that path with the tenant's key would get them
LineExecutor = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, dict[str, Any]]]]
T = TypeVar("T")


async def answer_batch_line(gateway: Gateway, path: str, body: dict[str, Any],
                            tenant: str) -> tuple[int, dict[str, Any]]:
    """The default line executor: `gateway.handlers.answer` as the batch's tenant, at batch priority."""
    from gateway.handlers import answer

    return await answer(gateway, path, body, tenant=tenant, batch=True)


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
        """Take no new line, abort those in flight (they stay pending: not in the output)."""
        self.cancelling = True
        for task in self.in_flight:
            task.cancel()


class BatchRunner:
    """Runs the pending lines of every unfinished batch through the line executor, records each answer
    once, and finalizes the batch (output and error files).

    `start` resumes every batch a previous process left in_progress, finalizing or cancelling (lines
    that were in flight when it died are still pending and run again). Each line runs as the batch's
    tenant, read from the store. A batch has at most `max_in_flight` lines in flight. A 503
    `engine_dead` / `pool_unavailable` answer (the device worker died and is being restarted) is not a
    result: the line is retried after a back-off (0.5 s doubling, at most 10 s) until any other answer
    comes.

    Event loop only. Every store call goes through `db`, to the runner's one thread: the loop never
    waits on SQLite, and the store sees one caller at a time. `stop` leaves unfinished batches as they
    are in the store, for the next start.
    """

    def __init__(self, store: BatchStore, executor: LineExecutor, *, max_in_flight: int = MAX_IN_FLIGHT,
                 retry_first_s: float = RETRY_FIRST_S, retry_max_s: float = RETRY_MAX_S) -> None:
        self.store = store
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.retry_first_s, self.retry_max_s = retry_first_s, retry_max_s
        self._thread = ThreadPoolExecutor(1, "cliffguard-batches")
        self._runs: dict[str, _Run] = {}

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the store thread; a `BatchInputError` becomes a 400 naming its field."""
        try:
            call = functools.partial(fn, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)
        except BatchInputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    async def start(self) -> None:
        ids = await self.db(self.store.unfinished_batch_ids)
        if ids:
            log.info("resuming %d unfinished batches: %s", len(ids), ", ".join(ids))
        for batch_id in ids:
            self.run(batch_id)

    async def stop(self) -> None:
        runs = list(self._runs.values())
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs), return_exceptions=True)
        await asyncio.to_thread(self._thread.shutdown)   # a record already handed to the thread lands
        self.store.close()

    def run(self, batch_id: str) -> None:
        """Run the batch in the background, unless it already runs."""
        if batch_id not in self._runs:
            run = self._runs[batch_id] = _Run(batch_id)
            run.task = asyncio.get_running_loop().create_task(self._run_batch(run), name=f"batch {batch_id}")

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: Any = None, *, tenant: str) -> dict[str, Any]:
        """Store a new batch of `tenant` (`BatchStore.create_batch`) and run it; shielded, so a client that
        leaves meanwhile cannot leave a stored batch that nothing runs."""
        async def create_and_run() -> dict[str, Any]:
            batch = await self.db(self.store.create_batch, input_file_id, endpoint, completion_window, metadata,
                                  tenant=tenant)
            self.run(batch["id"])
            return batch
        return await asyncio.shield(create_and_run())

    async def cancel(self, batch_id: str, *, tenant: str) -> dict[str, Any] | None:
        """Mark the batch cancelling in the store and stop its run (shielded like `create`); the batch
        object, or None (no such batch, or another tenant's: left alone)."""
        async def cancel_and_stop() -> dict[str, Any] | None:
            batch = await self.db(self.store.cancel, batch_id, tenant=tenant)
            if batch is not None and batch["status"] == "cancelling":
                if batch_id in self._runs:
                    self._runs[batch_id].cancel()
                else:
                    self.run(batch_id)   # nothing runs it (its run just ended): finalize it as cancelled
            return batch
        return await asyncio.shield(cancel_and_stop())

    # --- one batch -------------------------------------------------------------------------------
    async def _run_batch(self, run: _Run) -> None:
        try:
            run.tenant = await self.db(self.store.batch_tenant, run.batch_id)
            batch = await self.db(self.store.batch, run.batch_id, tenant=run.tenant)
            if batch["status"] == "in_progress":
                await self._run_lines(run)
            if not run.cancelling:
                await self.db(self.store.begin_finalizing, run.batch_id)
            batch = await self.db(self.store.finalize, run.batch_id)
            log.info("batch %s %s: %s", run.batch_id, batch["status"], batch["request_counts"])
        except Exception:  # noqa: BLE001 - the batch stays unfinished in the store; the next start resumes it
            log.exception("batch %s stopped; it resumes when the server starts again", run.batch_id)
        finally:
            self._runs.pop(run.batch_id, None)

    async def _run_lines(self, run: _Run) -> None:
        workers = [asyncio.create_task(self._worker(run)) for _ in range(self.max_in_flight)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _next_line(self, run: _Run) -> BatchLine | None:
        async with run.lock:
            if not run.buffer and not run.exhausted:
                page = await self.db(self.store.pending_lines, run.batch_id, run.after_line_no, PAGE_LINES)
                run.buffer.extend(page)
                run.exhausted = len(page) < PAGE_LINES
                if page:
                    run.after_line_no = page[-1].line_no
            return run.buffer.popleft() if run.buffer else None

    async def _worker(self, run: _Run) -> None:
        """Take lines until none is left or the batch is cancelled; record each answer. A line aborted
        by a cancel is not recorded."""
        while not run.cancelling and (line := await self._next_line(run)) is not None:
            task = asyncio.ensure_future(self._answer(line, run.tenant))
            run.in_flight.add(task)
            try:
                await asyncio.wait([task])
            finally:
                run.in_flight.discard(task)
                task.cancel()   # no-op once done; aborts the line if this worker is being cancelled
            if task.cancelled() and run.cancelling:
                break
            status, body = (task.result() if not task.cancelled() else
                            (500, ApiError(500, "internal error: the line's request was cancelled",
                                           type="server_error").body()))
            await self.db(self.store.record, run.batch_id, line.line_no, status, body)

    async def _answer(self, line: BatchLine, tenant: str) -> tuple[int, dict[str, Any]]:
        """The line's answer as `tenant` (a streaming line is the executor's 400); transient 503s are
        retried, an executor bug is a 500 for this line only."""
        delay = self.retry_first_s
        while True:
            try:
                status, body = await self.executor(line.url, line.body, tenant)
            except Exception as exc:  # noqa: BLE001 - a bug answering one line must not stop the batch
                log.exception("line %d (%s) of a batch failed", line.line_no, line.custom_id)
                return 500, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()
            if not _is_transient(status, body):
                return status, body
            log.warning("line %d (%s): %s; retrying in %.1f s", line.line_no, line.custom_id,
                        body["error"].get("message"), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry_max_s)


def _is_transient(status: int, body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("code") in TRANSIENT_CODES


BATCHES = web.AppKey("batches", BatchRunner)


def setup(app: web.Application, data_dir: Path | str, executor: LineExecutor | None = None) -> None:
    """Open the store under `data_dir` (before any socket opens: a bad folder fails `serve` at once),
    add the Batch API routes and the runner's `cleanup_ctx`. Call after `app[GATEWAY]` is set and the
    gateway's own cleanup_ctx is added: the runner starts after the gateway and stops before it.
    `executor` defaults to `answer_batch_line` on the app's gateway; tests pass a fake."""
    store = BatchStore(Path(data_dir) / STORE_FILE, default_tenant=DEFAULT_TENANT)
    app[BATCHES] = BatchRunner(store, executor or functools.partial(answer_batch_line, app[GATEWAY]))
    app.cleanup_ctx.append(_runner_ctx)
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


async def _runner_ctx(app: web.Application) -> AsyncIterator[None]:
    runner = app[BATCHES]
    await runner.start()
    yield
    await runner.stop()


def _tenant(request: web.Request) -> str:
    """The tenant of the request's API key: it owns what the request creates and sees nothing else."""
    return request.app[GATEWAY].admission.tenant_of(request)


# --- files -----------------------------------------------------------------------------------------
async def upload_file(request: web.Request) -> web.Response:
    """`POST /v1/files`: multipart/form-data with `file` (JSONL) and `purpose` ("batch"); the caller's
    tenant owns the file."""
    runner = request.app[BATCHES]
    if request.content_type != "multipart/form-data":
        raise ApiError(400, "body: expected multipart/form-data with the fields 'file' and 'purpose', got "
                       f"{request.content_type!r}", param="body")
    fields: dict[str, Any] = {}
    try:
        async for part in await request.multipart():
            name = getattr(part, "name", None)   # None for a nested multipart
            if name not in ("file", "purpose") or name in fields:
                raise ApiError(400, f"{name}: {'repeated' if name in fields else 'unknown'} field of a file "
                               "upload (expected 'file' and 'purpose')", param=name)
            if name == "purpose":
                fields["purpose"] = await part.text()
            else:
                fields["file"] = (part.filename or "upload.jsonl", await _read_upload(part))
    except ValueError as exc:   # aiohttp's multipart parser: no boundary, a malformed part
        raise ApiError(400, f"body: malformed multipart/form-data ({exc})", param="body") from None
    for name in ("file", "purpose"):
        if name not in fields:
            raise ApiError(400, f"{name}: missing from the upload", param=name)
    filename, content = fields["file"]
    return web.json_response(await runner.db(runner.store.add_file, content, filename, fields["purpose"],
                                             tenant=_tenant(request)))


async def _read_upload(part: Any) -> bytes:
    """The part's bytes; 413 naming `file` past MAX_FILE_BYTES (read in chunks, never all at once)."""
    data = bytearray()
    while chunk := await part.read_chunk(1 << 20):
        data.extend(chunk)
        if len(data) > MAX_FILE_BYTES:
            raise ApiError(413, f"file: larger than {MAX_FILE_BYTES >> 20} MiB", param="file",
                           code="request_too_large")
    return bytes(data)


async def retrieve_file(request: web.Request) -> web.Response:
    runner, file_id = request.app[BATCHES], request.match_info["file_id"]
    file = await runner.db(runner.store.file, file_id, tenant=_tenant(request))
    return web.json_response(_found(file, "file_id", file_id))


async def file_content(request: web.Request) -> web.Response:
    runner, file_id = request.app[BATCHES], request.match_info["file_id"]
    content = _found(await runner.db(runner.store.file_content, file_id, tenant=_tenant(request)), "file_id", file_id)
    return web.Response(body=content, content_type="application/octet-stream")


def _found(value: T | None, param: str, key: str) -> T:
    """`value`, or the 404 of an unknown id (also for another tenant's: it is not revealed)."""
    if value is None:
        noun = "file" if param == "file_id" else "batch"
        raise ApiError(404, f"{param}: no {noun} {key!r}", param=param)
    return value


# --- batches ---------------------------------------------------------------------------------------
_CREATE_FIELDS = {"input_file_id": True, "endpoint": True, "completion_window": True, "metadata": False}


async def create_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches`: parse the input file (the caller's tenant's) into lines (bad lines become
    per-line errors) and start it as the caller's tenant."""
    runner = request.app[BATCHES]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}", param="body")
    for name in body:
        if name not in _CREATE_FIELDS:
            raise ApiError(400, f"{name}: unknown field (a batch takes {', '.join(_CREATE_FIELDS)})", param=name)
    for name, required in _CREATE_FIELDS.items():
        if required and not isinstance(body.get(name), str):
            raise ApiError(400, f"{name}: {'missing' if name not in body else 'must be a string'}", param=name)
    return web.json_response(await runner.create(body["input_file_id"], body["endpoint"], body["completion_window"],
                                                 body.get("metadata"), tenant=_tenant(request)))


async def retrieve_batch(request: web.Request) -> web.Response:
    runner, batch_id = request.app[BATCHES], request.match_info["batch_id"]
    batch = await runner.db(runner.store.batch, batch_id, tenant=_tenant(request))
    return web.json_response(_found(batch, "batch_id", batch_id))


async def list_batches(request: web.Request) -> web.Response:
    """`GET /v1/batches?limit=&after=`: the caller's tenant's, newest first; `after` is the last id of
    the previous page."""
    runner = request.app[BATCHES]
    raw = request.query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be an integer in 1..100, got {raw!r}", param="limit")
    data, has_more = await runner.db(runner.store.list_batches, limit, request.query.get("after"),
                                     tenant=_tenant(request))
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": has_more})


async def cancel_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches/{id}/cancel`: in_progress -> cancelling -> cancelled (the output holds the lines
    answered before); cancelling or cancelled again is a no-op; a finished batch is a 409."""
    runner, batch_id = request.app[BATCHES], request.match_info["batch_id"]
    batch = _found(await runner.cancel(batch_id, tenant=_tenant(request)), "batch_id", batch_id)
    if batch["status"] not in ("cancelling", "cancelled"):
        raise ApiError(409, f"batch_id: batch {batch_id!r} is {batch['status']}; only a validating or "
                       "in_progress batch can be cancelled", param="batch_id")
    return web.json_response(batch)

