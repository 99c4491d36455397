"""The Batch API in OpenAI's shape — `POST/GET /v1/files`, `GET /v1/files/{id}[/content]`, `DELETE /v1/files/{id}`,
`POST/GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`.
`gateway.batch.execution.BatchRunner` runs the batches' lines.

Files expire as OpenAI's do: an upload after its `expires_after` (form fields `expires_after[anchor]`,
`expires_after[seconds]`, as the openai SDK sends them), 30 days without one; a batch's output and error
files after its `output_expires_after`, else never. An expired or deleted file is gone at once to every
reader; the store drops its bytes (`BatchStore.purge_expired`).

The state (files, batches, each line's status and result) is durable in `pools.store.batch_store.BatchStore`
under the serve command's `--data-dir`; the runner holds none that a restart needs. Each line goes
through the line executor, by default `gateway.handlers.answer` with `batch=True`: routed like any
request and waiting for KV credits behind interactive traffic.

Files and batches belong to the API key that created them (`Tenants.owner`: `key-<sha256>`, or `tenant:<name>`
for the keys of a tenant with `share_files: true`, or `default` without a key), and a batch's lines run as the
tenant of that key (its share and priorities), also after a restart. Every endpoint sees only the caller's
owner's: another owner's id answers exactly as an unknown one (404, or 400 for an input file). A file's
content is sent a piece at a time, never read whole (and not at all for a HEAD). An upload that stalls is a
408, as any request body (`gateway.handlers.read_within`); a malformed one (a part header aiohttp refuses, a
part with no name, a purpose in an unknown charset) a 400 naming `body`, `file` or `purpose`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.admission import bearer_key
from gateway.batch.execution import BatchRunner, LineExecutor, answer_batch_line, line_devices
from gateway.client_writes import write_within
from gateway.handlers import read_json, read_within
from gateway.openai.errors import ApiError, storage_unavailable
from gateway.openai.objects import list_object, page_ascending, page_limit
from gateway.runtime import GATEWAY
from pools.store.batch_files import CHUNK_BYTES
from pools.store.batch_store import BatchStore
from pools.store.schema import opened
from pools.tenants import DEFAULT_TENANT

log = logging.getLogger("cliffguard.batches")

__all__ = ["BATCHES", "BatchRunner", "LineExecutor", "setup"]

STORE_FILE = "batches.sqlite3"      # under --data-dir
MAX_FILE_BYTES = 200 << 20          # an upload, as OpenAI's limit for batch input files
SPOOL_BYTES = 1 << 20               # an upload's bytes held in memory; the rest goes to a temporary file
MAX_TEXT_FIELD_CHARS = 4096         # an upload's text fields (purpose, expires_after[...])
UPLOAD_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")
# the upload's fields as its errors name them: the expiration policy's as the SDK's argument is written
PARAMS = {"expires_after[anchor]": "expires_after.anchor", "expires_after[seconds]": "expires_after.seconds"}
REQUIRED_UPLOAD_FIELDS = ("file", "purpose")
# what aiohttp's multipart reader raises for a malformed body: no boundary, a part header it refuses (a NUL, a
# line over 8190 bytes: HttpProcessingError), an unknown charset or transfer encoding, a `_charset_` part too long
MULTIPART_ERRORS = (ValueError, LookupError, RuntimeError, HttpProcessingError)
T = TypeVar("T")
BATCHES = web.AppKey("batches", BatchRunner)


def setup(app: web.Application, data_dir: Path | str, executor: LineExecutor | None = None) -> None:
    """Open the store under `data_dir` (before any socket opens: a bad folder fails `serve` at once),
    add the Batch API routes and the runner's `cleanup_ctx`. Call after `app[GATEWAY]` is set and the
    gateway's own cleanup_ctx is added: the runner starts after the gateway and stops before it.
    `executor` defaults to `answer_batch_line` on the app's gateway; tests pass a fake. An older store
    is migrated with `Tenants.legacy_owner` under the gateway's configuration."""
    gateway = app[GATEWAY]
    legacy_owner = functools.partial(gateway.admission.tenants.legacy_owner, api_keys=gateway.config.gateway.api_keys)
    path = Path(data_dir) / STORE_FILE
    store = opened(functools.partial(BatchStore, path, default_tenant=DEFAULT_TENANT, legacy_owner=legacy_owner), path)
    app[BATCHES] = BatchRunner(store, executor or functools.partial(answer_batch_line, gateway),
                               max_unfinished_per_owner=gateway.config.gateway.batches.max_unfinished_per_owner,
                               gate_keys=functools.partial(line_devices, gateway),
                               count_error=lambda status: gateway.metrics.errors.labels(status=str(status)).inc())
    app.cleanup_ctx.append(_runner_ctx)
    app.on_shutdown.append(_drain)
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


async def _drain(app: web.Application) -> None:
    """The server's stop begins (before its wait of `gateway.drain_seconds` for the requests in flight): batch
    lines drain alike (`BatchRunner.drain`)."""
    app[BATCHES].drain(asyncio.get_running_loop().time() + app[GATEWAY].config.gateway.drain_seconds)


async def _runner_ctx(app: web.Application) -> AsyncIterator[None]:
    runner = app[BATCHES]
    await runner.start()
    yield
    await runner.stop()


def _owner(request: web.Request) -> str:
    """The owner of the request's API key (`Tenants.owner`): it owns what the request creates and sees
    nothing else."""
    return request.app[GATEWAY].admission.tenants.owner(bearer_key(request))


def _tenant(request: web.Request) -> str:
    """The tenant of the request's API key: the batch it creates runs with that tenant's share."""
    return request.app[GATEWAY].admission.tenant_of(request)


# --- files -----------------------------------------------------------------------------------------
async def upload_file(request: web.Request) -> web.Response:
    """`POST /v1/files`: multipart/form-data with `file` (JSONL) and `purpose` ("batch"); the caller's
    key owns the file. A body that stalls is a 408 (`read_within`)."""
    runner = request.app[BATCHES]
    if request.content_type != "multipart/form-data":
        raise ApiError(400, "body: expected multipart/form-data with the fields 'file' and 'purpose', got "
                       f"{request.content_type!r}", param="body")
    fields: dict[str, Any] = {}
    try:
        await read_within(request, _read_form(request, fields))
        filename, content, _ = fields["file"]
        return web.json_response(await runner.db(runner.store.add_file, content, filename, fields["purpose"],
                                                 owner=_owner(request), tenant=_tenant(request),
                                                 expires_after=_expires_after(fields)))
    finally:
        if "file" in fields:
            _, spool, writing = fields["file"]
            if writing and not writing[0].done():   # cut off mid-write (a 408): closed once its thread is done
                writing[0].add_done_callback(lambda f: (spool.close(), f.exception()))
            else:
                spool.close()


def _expires_after(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The upload's expiration policy from its form fields (None: none sent); the store checks its values.
    Its errors name `expires_after.anchor` / `.seconds`, as the store's do (the SDK's argument, whose
    keys it sends as the form fields `expires_after[anchor]` / `[seconds]`)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor is None or seconds is None:
        missing = "expires_after.anchor" if anchor is None else "expires_after.seconds"
        raise ApiError(400, f"{missing}: missing (an expiration policy has an anchor and seconds)", param=missing)
    try:
        seconds = int(seconds)
    except ValueError:
        raise ApiError(400, f"expires_after.seconds: must be an integer, got {seconds[:40]!r}",
                       param="expires_after.seconds") from None
    return {"anchor": anchor, "seconds": seconds}


async def _read_form(request: web.Request, fields: dict[str, Any]) -> None:
    """The upload's fields into `fields`: `file` as (its filename as sent or None: the store cleans it, its
    bytes in a spooled file, which the caller closes, and its last write), `purpose` as text. A 400 naming `body` for a malformed
    body or a part with no name, naming the field for a part not one of UPLOAD_FIELDS once, or missing."""
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            name = _field_name(part, fields)
            if name == "file":   # spooled beside the store: a temporary directory may be held in memory
                spool = tempfile.SpooledTemporaryFile(SPOOL_BYTES, dir=request.app[BATCHES].store.path.parent)
                fields[name] = (part.filename, spool, writing := [])
                await _read_upload(part, spool, writing)
            else:
                fields[name] = await _read_text(part, name)
    except MULTIPART_ERRORS as exc:
        reason = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
        raise ApiError(400, f"body: malformed multipart/form-data ({reason})", param="body") from None
    for name in REQUIRED_UPLOAD_FIELDS:
        if name not in fields:
            raise ApiError(400, f"{name}: missing from the upload", param=name)


def _field_name(part: Any, fields: dict[str, Any]) -> str:
    """The part's field name, one of UPLOAD_FIELDS not seen before; else a 400."""
    name = getattr(part, "name", None)   # None: no Content-Disposition, no name in it, or a nested multipart
    if not name:
        raise ApiError(400, "body: a part of the upload has no name (expected the fields 'file' and 'purpose')",
                       param="body")
    if name not in UPLOAD_FIELDS or name in fields:
        param = PARAMS.get(name, name)
        raise ApiError(400, f"{param}: {'repeated' if name in fields else 'unknown'} field of a file upload "
                       f"(expected {', '.join(map(repr, UPLOAD_FIELDS))})", param=param)
    return name


async def _read_text(part: Any, name: str) -> str:
    """A text part (`purpose`, the expiration policy's) in its charset (`Content-Type: ...; charset=`, UTF-8 by
    default), at most a few KiB of it."""
    param = PARAMS.get(name, name)
    try:
        text = await part.text()
    except (LookupError, UnicodeError, RuntimeError) as exc:   # an unknown charset or transfer encoding
        raise ApiError(400, f"{param}: not text in the part's charset or transfer encoding ({exc})",
                       param=param) from None
    if len(text) > MAX_TEXT_FIELD_CHARS:
        raise ApiError(400, f"{param}: longer than {MAX_TEXT_FIELD_CHARS} characters", param=param)
    return text


async def _read_upload(part: Any, spool: tempfile.SpooledTemporaryFile, writing: list[asyncio.Future]) -> None:
    """The part's bytes into `spool` (past SPOOL_BYTES on disk: uploads at once hold no more memory than that
    each; a piece of at most 1 MiB at once, written on a thread: a disk behind on its writes blocks the writer;
    `writing` holds the last write, which a cancellation leaves running), left at its start; 413 naming `file`
    past MAX_FILE_BYTES, 503 `storage_unavailable` if the disk cannot take it."""
    loop, size = asyncio.get_running_loop(), 0
    while chunk := await part.read_chunk(1 << 20):
        size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise ApiError(413, f"file: larger than {MAX_FILE_BYTES >> 20} MiB", param="file",
                           code="request_too_large")
        try:
            writing[:] = [loop.run_in_executor(None, spool.write, chunk)]
            await asyncio.shield(writing[0])
        except OSError as exc:   # the disk is full
            raise storage_unavailable("upload's temporary file", exc) from None
    spool.seek(0)


async def list_files(request: web.Request) -> web.Response:
    """`GET /v1/files?limit=&after=&order=&purpose=`: the caller's owner's files (uploads, batch outputs),
    newest first unless `order=asc`; at most `limit` (1..10000, OpenAI's default 10000) a page, `after` the
    last id of the previous page."""
    runner, query = request.app[BATCHES], request.query
    limit, ascending = page_limit(query, 10_000, 10_000), page_ascending(query)
    data, has_more = await runner.db(runner.store.list_files, limit, query.get("after"), owner=_owner(request),
                                     ascending=ascending, purpose=query.get("purpose"))
    return web.json_response(list_object(data, has_more))


async def retrieve_file(request: web.Request) -> web.Response:
    runner, file_id = request.app[BATCHES], request.match_info["file_id"]
    file = await runner.db(runner.store.file, file_id, owner=_owner(request))
    return web.json_response(_found(file, "file_id", file_id))


async def delete_file(request: web.Request) -> web.Response:
    """`DELETE /v1/files/{id}`: the caller's file is gone at once (its bytes too); a batch that named it keeps
    its id. 404 for an unknown id, another owner's, or one already deleted or expired."""
    runner, file_id = request.app[BATCHES], request.match_info["file_id"]
    deleted = await runner.db(runner.store.delete_file, file_id, owner=_owner(request))
    _found(deleted or None, "file_id", file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.StreamResponse:
    """`GET /v1/files/{id}/content`: the file's bytes, read from the store and sent CHUNK_BYTES at a time (a
    storage error half-way closes the connection: the client sees the body end short). A client that takes
    nothing for `gateway.write_timeout` is cut off, as for every response. `HEAD`: the same headers
    (Content-Length the file's size), no byte of the file."""
    runner, file_id, owner = request.app[BATCHES], request.match_info["file_id"], _owner(request)
    file = _found(await runner.db(runner.store.file, file_id, owner=owner), "file_id", file_id)
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = file["bytes"]
    gateway = request.app[GATEWAY]

    def within(write):
        return write_within(request, write, gateway.config.gateway.write_timeout, gateway.metrics, "none",
                            f"file {file_id}: its content")

    await response.prepare(request)
    if request.method == "HEAD":   # the headers only: what is written would reach the connection's next answer
        await response.write_eof()
        return response
    try:
        for offset in range(0, file["bytes"], CHUNK_BYTES):
            chunk = await runner.db(runner.store.file_content, file_id, owner=owner, offset=offset, size=CHUNK_BYTES)
            if chunk is None:   # deleted or expired while it was being sent: the body ends short, as below
                raise ApiError(404, f"file_id: file {file_id!r} was deleted or expired while it was being sent")
            await within(response.write(chunk))
        await within(response.write_eof())
    except ApiError as exc:   # the store failed half-way: the body ends short of Content-Length, then the connection
        log.error("file %s: sending its content stopped: %s", file_id, exc.message)
        response.force_close()
    except ConnectionError:
        pass   # ClientGone: aborted and said; or the client went away meanwhile
    return response


def _found(value: T | None, param: str, key: str) -> T:
    """`value`, or the 404 of an unknown id (also for another owner's: it is not revealed)."""
    if value is None:
        noun = "file" if param == "file_id" else "batch"
        raise ApiError(404, f"{param}: no {noun} {key!r}", param=param)
    return value


# --- batches ---------------------------------------------------------------------------------------
_CREATE_FIELDS = {"input_file_id": True, "endpoint": True, "completion_window": True, "metadata": False,
                  "output_expires_after": False}


async def create_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches`: parse the input file (the caller's owner's) into lines (bad lines become
    per-line errors) and start it, owned by the caller's owner and run as the caller's tenant."""
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
                                                 body.get("metadata"), owner=_owner(request), tenant=_tenant(request),
                                                 output_expires_after=body.get("output_expires_after")))


async def retrieve_batch(request: web.Request) -> web.Response:
    runner, batch_id = request.app[BATCHES], request.match_info["batch_id"]
    batch = await runner.db(runner.store.batch, batch_id, owner=_owner(request))
    return web.json_response(_found(batch, "batch_id", batch_id))


async def list_batches(request: web.Request) -> web.Response:
    """`GET /v1/batches?limit=&after=`: the caller's owner's, newest first; `after` is the last id of
    the previous page."""
    runner = request.app[BATCHES]
    data, has_more = await runner.db(runner.store.list_batches, page_limit(request.query, 20, 100),
                                     request.query.get("after"), owner=_owner(request))
    return web.json_response(list_object(data, has_more))


async def cancel_batch(request: web.Request) -> web.Response:
    """`POST /v1/batches/{id}/cancel`: in_progress -> cancelling -> cancelled (the output holds the lines
    answered before); cancelling or cancelled again is a no-op; a finished batch is a 409."""
    runner, batch_id = request.app[BATCHES], request.match_info["batch_id"]
    batch = _found(await runner.cancel(batch_id, owner=_owner(request)), "batch_id", batch_id)
    if batch["status"] not in ("cancelling", "cancelled"):
        raise ApiError(409, f"batch_id: batch {batch_id!r} is {batch['status']}; only a validating or "
                       "in_progress batch can be cancelled", param="batch_id",
                       headers={"x-should-retry": "false"})   # the openai SDK retries a 409 (a lock timeout)
    return web.json_response(batch)

