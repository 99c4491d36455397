"""`BatchStore`: the durable state of the Batch API — uploaded files, batches, and every request line
with its status and result — in one SQLite database.

Durability: WAL journal with `synchronous=FULL`. WAL with NORMAL already survives a killed process
(`kill -9`: every committed transaction is in the WAL file the OS holds); FULL also syncs the WAL on
each commit, so a file id or batch id we returned, and a line result we recorded, survive a power
loss too. The price is one fsync per commit — per recorded line, small next to generating it.

Exactly once: a line's result is recorded by `UPDATE lines ... WHERE batch_id=? AND line_no=? AND
status='pending'` in one transaction. A line whose answer arrived but was not yet recorded when the
process died is still pending and runs again after a restart; a line already recorded is never sent
again, and a second `record` for it changes nothing.

Bounded memory: a file's bytes are kept in pieces of at most CHUNK_BYTES (`file_chunks`), and read
back a range at a time (`file_content(offset=, size=)`), so no value comes near SQLite's 1 GB limit
on one string or blob. The output and error files are assembled when the batch finalizes, by
`finalize_step`: each step is one transaction that writes the next pieces of both files from the
lines after a cursor (at most FINALIZE_STEP_BYTES of them, one line at a time out of SQLite) and
moves the cursor (`finalizing` table); the last step adds the two files and marks the batch completed
or cancelled. A crash between steps leaves the batch `finalizing` with the cursor of the last step
committed, and finalizing again continues from it; the file ids are derived from the batch id, so
every finalize gives the same files. An output or error file that would pass MAX_OUTPUT_FILE_BYTES
fails the batch instead (`status: failed`, `errors` naming `output_too_large`), and a line answer
whose JSON alone passes it is recorded as that line's error (`response_too_large`), not stored.

Input lines are checked when the batch is created (`parse_batch_input`): a line that is not JSON,
lacks `custom_id` / `method` / `url` / `body`, has another method or url than the batch's endpoint,
repeats a `custom_id`, or is longer than MAX_BATCH_LINE_BYTES is recorded as a per-line error for the
error file; the batch itself never fails for it. A batch fails as a whole only through `fail` (the
runner's reason: the store could not take its results) or an output past the limit.

Ownership: every file and batch has an `owner`, the only thing access is checked against, and a
`tenant`, whose share and priority its lines run with (`pools.tenants`: the gateway passes
`Tenants.owner` and the tenant of the request's API key). A batch's output and error files have the
batch's owner and tenant. Every method a client reaches takes `owner` and treats another owner's
file or batch exactly as one that does not exist (None, or the same BatchInputError), so an id never
tells a caller that someone else has it. The runner's methods (`batch_tenant`, `batch_status`,
`pending_lines`, `record`, `finalize_step`, `fail`...) take batch ids only.

Schema versions (`PRAGMA user_version`), migrated in place in one transaction when the store opens
(a crash leaves the old version, and the next open migrates again; decided by the columns present):
1 had no owners; 2 added `tenant` (version 1's rows: the store's `default_tenant`); 3 adds `owner`,
the failed state (`failed_at`, `errors`), `file_chunks` and `finalizing`. A version-2 row keeps its
tenant as its tenant, and its owner is `legacy_owner(tenant)` (the gateway: `Tenants.legacy_owner`,
whose rule keeps a row reachable by the key or shared tenant that reached it before wherever the
configuration still tells which that is; without one, the tenant's name). That mapping is written
once, into `legacy_owners`, at the migration; old batch rows get the owner in their `owner` column,
old file rows keep `owner` NULL and are looked up there, so no file's content is rewritten. Their
content stays in `files.content` (empty for files written by version 3).

Thread rule: one connection, guarded by a lock, so any thread may call any method (the gateway calls
them from one worker thread, off its event loop). A method that cannot read or write the database now
(disk full, database locked past the busy timeout, an I/O error) raises one of STORAGE_ERRORS and
changes nothing. Stdlib only; no aiohttp (the pools package never imports it).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BATCH_ENDPOINTS", "BatchInputError", "BatchLine", "BatchStore", "CHUNK_BYTES", "COMPLETION_WINDOWS",
           "FILE_PURPOSES", "MAX_BATCH_LINES", "MAX_BATCH_LINE_BYTES", "MAX_OUTPUT_FILE_BYTES", "STORAGE_ERRORS",
           "parse_batch_input", "result_file_ids"]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")   # what a line may be sent to
COMPLETION_WINDOWS = ("24h",)                                    # OpenAI's only window; nothing expires
FILE_PURPOSES = ("batch",)                                       # what an upload may be for
MAX_BATCH_LINES = 50_000                                         # request lines per batch, as OpenAI
MAX_BATCH_LINE_BYTES = 1 << 20          # one line of an input file (1 MiB); a longer one is that line's error
MAX_OUTPUT_FILE_BYTES = 512 << 20       # each of a batch's output and error files (512 MiB); past it the batch fails
CHUNK_BYTES = 1 << 20                   # the pieces a file's bytes are stored in (`file_chunks`)
FINALIZE_STEP_BYTES = 4 << 20           # output and error lines written by one `finalize_step` transaction
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
STORAGE_ERRORS = (sqlite3.OperationalError,)   # disk full, locked past the busy timeout, I/O error

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")   # a runner still owes work
CANCELLABLE = ("validating", "in_progress")

_TABLES = (   # the tables as version 3 creates them (see the module docstring for what older ones lack)
    """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL,              -- a version-2 file's bytes; empty from version 3 (file_chunks)
    tenant TEXT NOT NULL,
    owner TEXT)                         -- NULL: a version-2 row, its owner in legacy_owners""",
    """CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,            -- creation order, for listing newest first
    id TEXT NOT NULL UNIQUE, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, metadata TEXT, tenant TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT '', failed_at INTEGER, errors TEXT)""",
    """CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, method TEXT, url TEXT, body TEXT,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'error')),
    response_status INTEGER, response_body TEXT, error TEXT,
    PRIMARY KEY (batch_id, line_no))""",
    """CREATE TABLE IF NOT EXISTS file_chunks (
    file_id TEXT NOT NULL, start INTEGER NOT NULL, data BLOB NOT NULL,   -- data: at most CHUNK_BYTES
    PRIMARY KEY (file_id, start))""",
    """CREATE TABLE IF NOT EXISTS finalizing (   -- a finalizing batch's files: written up to after_line_no
    batch_id TEXT PRIMARY KEY, after_line_no INTEGER NOT NULL, output_bytes INTEGER NOT NULL,
    error_bytes INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS legacy_owners (tenant TEXT PRIMARY KEY, owner TEXT NOT NULL)""")
_ADDED_COLUMNS = (   # (table, column, definition) added to an older store's tables; DDL takes no parameters
    ("files", "tenant", "TEXT NOT NULL DEFAULT {default_tenant}"),
    ("batches", "tenant", "TEXT NOT NULL DEFAULT {default_tenant}"),
    ("files", "owner", "TEXT"),
    ("batches", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("batches", "failed_at", "INTEGER"),
    ("batches", "errors", "TEXT"))
_INDEXES = ("DROP INDEX IF EXISTS batches_by_tenant",   # version 2's; batches are listed by owner
            "CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, response_status)",
            "CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq)")
_SCHEMA_VERSION = 3
_FILE_OWNER = "COALESCE(files.owner, (SELECT owner FROM legacy_owners WHERE legacy_owners.tenant = files.tenant))"


class BatchInputError(ValueError):
    """A batch or file request the store refuses; the message starts with the field (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class BatchLine:
    """One line of a batch input file. `error` ({"code", "message", "line"}) when the line is unusable;
    then `method`, `url` and `body` are None and `custom_id` is whatever string the line carried."""

    line_no: int                    # 1-based line of the input file
    custom_id: str | None
    method: str | None = None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


def parse_batch_input(content: bytes, endpoint: str) -> list[BatchLine]:
    """Every non-blank line of a JSONL input file, checked for the batch's `endpoint`. A `custom_id`
    belongs to the first line carrying it; later lines with it are `duplicate_custom_id` errors. A
    line longer than MAX_BATCH_LINE_BYTES is a `line_too_large` error, not parsed."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for line_no, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_BATCH_LINE_BYTES:
            lines.append(_bad(line_no, None, "line_too_large", f"line {line_no}: {len(raw)} bytes; a request "
                              f"line may have at most {MAX_BATCH_LINE_BYTES} bytes"))
            continue
        line = _parse_line(line_no, raw, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen and line.error is None:
                line = _bad(line_no, line.custom_id, "duplicate_custom_id",
                            f"custom_id: {line.custom_id!r} was used by an earlier line")
            seen.add(line.custom_id)
        lines.append(line)
    return lines


def _parse_line(line_no: int, raw: bytes, endpoint: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: expected a JSON object, "
                    f"got {type(obj).__name__}")
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            return _bad(line_no, custom_id, "missing_required_parameter", f"{key}: missing")
    if custom_id is None or not custom_id:
        return _bad(line_no, None, "invalid_custom_id", f"custom_id: must be a non-empty string, got "
                    f"{obj['custom_id']!r}")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _bad(line_no, custom_id, "invalid_request", f"{unknown[0]}: unknown field of a request line")
    if obj["method"] != "POST":
        return _bad(line_no, custom_id, "invalid_method", f"method: must be 'POST', got {obj['method']!r}")
    if obj["url"] != endpoint:
        return _bad(line_no, custom_id, "invalid_url", f"url: must be the batch's endpoint {endpoint!r}, "
                    f"got {obj['url']!r}")
    if not isinstance(obj["body"], dict):
        return _bad(line_no, custom_id, "invalid_body", f"body: must be a JSON object, got "
                    f"{type(obj['body']).__name__}")
    return BatchLine(line_no, custom_id, "POST", endpoint, obj["body"])


def _bad(line_no: int, custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(line_no, custom_id, error={"code": code, "message": message, "line": line_no})



def line_ids(batch_id: str, line_no: int) -> tuple[str, str]:
    """(`batch_req_…` id, `req_…` request id) of a line: derived, so every finalize writes the same ones."""
    digest = hashlib.sha256(f"{batch_id}/{line_no}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}", f"req_{digest[32:64]}"


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """(output file id, error file id) of a batch: derived, so a finalize resumed after a crash continues
    the same files."""
    digest = hashlib.sha256(f"{batch_id}/files".encode()).hexdigest()
    return f"file-{digest[:24]}", f"file-{digest[24:48]}"


class BatchStore:
    """Files, batches and request lines in `path` (SQLite, WAL), each file and batch with an owner (who
    may see it) and a tenant (whose share its lines run with). See the module docstring for the
    durability, exactly-once, bounded-memory and ownership rules. Methods return OpenAI-shaped dicts
    (file and batch objects, which show neither). `default_tenant` is the tenant of a version-1 store's
    rows, and `legacy_owner(tenant)` the owner of a version-2 (or 1) store's rows, when it is migrated
    (None: the tenant's name)."""

    def __init__(self, path: Path | str, *, default_tenant: str,
                 legacy_owner: Callable[[str], str] | None = None) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            with self._txn() as db:
                _migrate(db, self.path, default_tenant, legacy_owner or (lambda tenant: tenant))
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE … COMMIT), rolled back on any error, a failed COMMIT
        (disk full) included."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    # --- files -----------------------------------------------------------------------------------
    def add_file(self, content: bytes, filename: str, purpose: str, *, owner: str, tenant: str) -> dict[str, Any]:
        """Store an upload of `owner` (made by a key of `tenant`); BatchInputError naming `purpose`
        unless it is one of FILE_PURPOSES."""
        if purpose not in FILE_PURPOSES:
            raise BatchInputError("purpose", f"must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        with self._txn() as db:
            _insert_file(db, file_id, filename, purpose, len(content), owner, tenant)
            writer = _ChunkWriter(db, file_id)
            writer.write(content)
            writer.close()
        return self.file(file_id, owner=owner)

    def file(self, file_id: str, *, owner: str) -> dict[str, Any] | None:
        """The OpenAI file object, or None (no such file, or another owner's)."""
        with self._lock:
            row = self._db.execute(f"SELECT id, purpose, filename, bytes, created_at FROM files WHERE id=? AND "
                                   f"{_FILE_OWNER}=?", (file_id, owner)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "object": "file", "purpose": row[1], "filename": row[2], "bytes": row[3],
                "created_at": row[4], "status": "processed", "expires_at": None, "status_details": None}

    def file_content(self, file_id: str, *, owner: str, offset: int = 0, size: int | None = None) -> bytes | None:
        """The file's bytes from `offset`, at most `size` of them (None: to the end; the gateway reads a
        piece at a time), or None (no such file, or another owner's)."""
        with self._lock:
            row = self._db.execute(f"SELECT bytes, length(content) FROM files WHERE id=? AND {_FILE_OWNER}=?",
                                   (file_id, owner)).fetchone()
            if row is None:
                return None
            total, num_legacy = row
            end = total if size is None else min(total, offset + size)
            if end <= offset:
                return b""
            if num_legacy:   # a version-2 file: its bytes in one blob, read in place (not loaded whole)
                rowid = self._db.execute("SELECT rowid FROM files WHERE id=?", (file_id,)).fetchone()[0]
                with self._db.blobopen("files", "content", rowid, readonly=True) as blob:
                    blob.seek(offset)
                    return blob.read(end - offset)
            return _read_chunks(self._db, file_id, offset, end)

    # --- batches ---------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None, *, owner: str, tenant: str) -> dict[str, Any]:
        """Parse `owner`'s input file and store the batch, owned by `owner` and run as `tenant`, with all
        its lines in one transaction, `in_progress` (bad lines already recorded as errors).
        BatchInputError naming the field for a bad argument; another owner's input file is refused as
        one that does not exist."""
        lines = self._input_lines(input_file_id, endpoint, completion_window, metadata, owner)
        batch_id, now = f"batch_{uuid.uuid4().hex[:24]}", int(time.time())
        with self._txn() as db:
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, "
                       "in_progress_at, metadata, tenant, owner) VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                       (batch_id, input_file_id, endpoint, completion_window, now, now,
                        None if metadata is None else json.dumps(metadata), tenant, owner))
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, method, url, body, status, error) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                ((batch_id, ln.line_no, ln.custom_id, ln.method, ln.url,
                  None if ln.body is None else json.dumps(ln.body), "error" if ln.error else "pending",
                  None if ln.error is None else json.dumps(ln.error)) for ln in lines))
        return self.batch(batch_id, owner=owner)

    def _input_lines(self, input_file_id: str, endpoint: str, completion_window: str, metadata: Any,
                     owner: str) -> list[BatchLine]:
        """The checked arguments of `create_batch` and the lines of its input file."""
        if endpoint not in BATCH_ENDPOINTS:
            raise BatchInputError("endpoint", f"must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}")
        if completion_window not in COMPLETION_WINDOWS:
            raise BatchInputError("completion_window", f"must be {' or '.join(map(repr, COMPLETION_WINDOWS))}, "
                                  f"got {completion_window!r}")
        _check_metadata(metadata)
        info, content = self.file(input_file_id, owner=owner), self.file_content(input_file_id, owner=owner)
        if info is None or content is None:
            raise BatchInputError("input_file_id", f"no file {input_file_id!r}")
        if info["purpose"] != "batch":
            raise BatchInputError("input_file_id", f"file {input_file_id!r} has purpose {info['purpose']!r}, "
                                  "not 'batch'")
        lines = parse_batch_input(content, endpoint)
        if not lines:
            raise BatchInputError("input_file_id", f"file {input_file_id!r} has no request lines")
        if len(lines) > MAX_BATCH_LINES:
            raise BatchInputError("input_file_id", f"file {input_file_id!r} has {len(lines)} request lines; "
                                  f"a batch takes at most {MAX_BATCH_LINES}")
        return lines

    def batch(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """The OpenAI batch object (request_counts counted from the lines), or None (no such batch, or
        another owner's)."""
        with self._lock:
            row = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id=? AND owner=?",
                                   (batch_id, owner)).fetchone()
            return None if row is None else self._batch_object(row)

    def batch_tenant(self, batch_id: str) -> str | None:
        """The tenant the batch's lines run as, or None if there is no such batch."""
        with self._lock:
            row = self._db.execute("SELECT tenant FROM batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None else row[0]

    def batch_status(self, batch_id: str) -> str | None:
        """The batch's status, or None if there is no such batch."""
        with self._lock:
            row = self._db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None else row[0]

    def list_batches(self, limit: int = 20, after: str | None = None, *,
                     owner: str) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` of `owner`'s batches, newest first, created before batch `after`; and whether
        more follow. BatchInputError naming `after` when it is not one of the owner's batch ids."""
        with self._lock:
            before = None
            if after is not None:
                found = self._db.execute("SELECT seq FROM batches WHERE id=? AND owner=?", (after, owner)).fetchone()
                if found is None:
                    raise BatchInputError("after", f"no batch {after!r}")
                before = found[0]
            rows = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE owner=? AND (? IS NULL OR seq < ?) "
                                    "ORDER BY seq DESC LIMIT ?", (owner, before, before, limit + 1)).fetchall()
            return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """Mark a validating or in_progress batch `cancelling` (its runner stops taking lines and then
        finalizes it as `cancelled`); any other batch is returned unchanged. None if there is none, or
        it is another owner's (which is left alone)."""
        with self._txn() as db:
            db.execute(f"UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=? AND owner=? AND "
                       f"status IN ({_marks(CANCELLABLE)})", (int(time.time()), batch_id, owner, *CANCELLABLE))
        return self.batch(batch_id, owner=owner)

    def unfinished_batch_ids(self) -> list[str]:
        """Batches a runner still owes work (lines to run, or finalizing), oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({_marks(UNFINISHED)}) ORDER BY seq",
                                    UNFINISHED).fetchall()
        return [r[0] for r in rows]

    # --- lines -----------------------------------------------------------------------------------
    def pending_lines(self, batch_id: str, after_line_no: int = 0, limit: int = 256) -> list[BatchLine]:
        """Up to `limit` pending lines after `after_line_no`, in file order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT line_no, custom_id, method, url, body FROM lines WHERE batch_id=? AND line_no>? AND "
                "status='pending' ORDER BY line_no LIMIT ?", (batch_id, after_line_no, limit)).fetchall()
        return [BatchLine(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in rows]

    def record(self, batch_id: str, line_no: int, status_code: int, body: Any, *,
               error: dict[str, str] | None = None) -> bool:
        """Record a pending line's answer (HTTP status, JSON body): a result, or with `error` ({"code",
        "message"}) the line's error, its last answer beside it. An answer whose JSON is longer than
        MAX_OUTPUT_FILE_BYTES is not kept: the line's error says so. False, changing nothing, if the
        line is not pending (already recorded, or no such line)."""
        response: str | None = json.dumps(body)
        if len(response) > MAX_OUTPUT_FILE_BYTES:
            error = {"code": "response_too_large", "message": f"the answer's JSON has {len(response)} bytes, "
                     f"more than an output file may hold ({MAX_OUTPUT_FILE_BYTES} bytes)"}
            response = None
        with self._txn() as db:
            cursor = db.execute("UPDATE lines SET status=?, response_status=?, response_body=?, error=? "
                                "WHERE batch_id=? AND line_no=? AND status='pending'",
                                ("done" if error is None else "error", status_code, response,
                                 None if error is None else json.dumps({**error, "line": line_no}),
                                 batch_id, line_no))
        return cursor.rowcount == 1

    # --- finishing -------------------------------------------------------------------------------
    def begin_finalizing(self, batch_id: str) -> None:
        """in_progress -> finalizing, once the runner has no line left to run."""
        with self._txn() as db:
            db.execute("UPDATE batches SET status='finalizing', finalizing_at=? WHERE id=? AND status='in_progress'",
                       (int(time.time()), batch_id))

    def finalize_step(self, batch_id: str) -> dict[str, Any] | None:
        """One transaction of finalizing: write the next lines (up to FINALIZE_STEP_BYTES) to the output
        and error files; at the end, add the files and mark the batch `completed` (`cancelled` if it was
        cancelling), or `failed` if a file would pass MAX_OUTPUT_FILE_BYTES. None while lines remain,
        else the batch object (a finished batch: unchanged). Only lines with an answer or an error go
        into the files: a cancelled batch's pending lines are in neither. KeyError: no such batch."""
        with self._txn() as db:
            found = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if found is None:
                raise KeyError(batch_id)
            if found[0] in UNFINISHED and not _assemble_step(db, batch_id, found[0]):
                return None
        return self._batch_by_id(batch_id)

    def finalize(self, batch_id: str) -> dict[str, Any]:
        """`finalize_step` until the batch is finished; its batch object."""
        while (batch := self.finalize_step(batch_id)) is None:
            pass
        return batch

    def fail(self, batch_id: str, code: str, message: str) -> dict[str, Any] | None:
        """Mark an unfinished batch `failed` with `errors` naming `code` and `message` (OpenAI's batch
        error list), dropping the files it was writing; a finished batch is returned unchanged. None if
        there is no such batch."""
        with self._txn() as db:
            _fail(db, batch_id, code, message)
        return self._batch_by_id(batch_id)

    def check_integrity(self) -> None:
        """AssertionError naming the rows, unless: every file's bytes add up to its `bytes` with no gap
        between its pieces; pieces of no file belong to a batch being finalized; a `finalizing` cursor
        belongs to an unfinished batch; a batch's output and error file ids name files; a failed batch
        has its errors."""
        with self._lock:
            db = self._db
            stored = "length(f.content) + coalesce(sum(length(c.data)), 0)"
            sizes = db.execute(f"SELECT f.id, f.bytes, {stored} FROM files f LEFT JOIN file_chunks c "
                               f"ON c.file_id = f.id GROUP BY f.id HAVING f.bytes != {stored}").fetchall()
            gaps = db.execute("SELECT file_id, start, next FROM (SELECT file_id, start, start + length(data) AS end, "
                              "lead(start) OVER (PARTITION BY file_id ORDER BY start) AS next FROM file_chunks) "
                              "WHERE next IS NOT NULL AND next != end OR start < 0").fetchall()
            cursors = {row[0] for row in db.execute("SELECT batch_id FROM finalizing")}
            being_written = {file_id for batch_id in cursors for file_id in result_file_ids(batch_id)}
            orphans = {row[0] for row in db.execute("SELECT DISTINCT file_id FROM file_chunks WHERE file_id NOT IN "
                                                    "(SELECT id FROM files)")} - being_written
            stale = db.execute(f"SELECT batch_id FROM finalizing JOIN batches ON id = batch_id WHERE status NOT IN "
                               f"({_marks(UNFINISHED)})", UNFINISHED).fetchall()
            missing = db.execute("SELECT id FROM batches WHERE output_file_id NOT IN (SELECT id FROM files) OR "
                                 "error_file_id NOT IN (SELECT id FROM files) OR (status = 'failed') != "
                                 "(errors IS NOT NULL)").fetchall()
        problems = {"file bytes (id, bytes, stored)": sizes, "gaps between pieces": gaps,
                    "pieces of no file": sorted(orphans), "cursors of finished batches": stale,
                    "batches with missing files or errors": missing}
        assert not any(problems.values()), {name: rows for name, rows in problems.items() if rows}

    def _batch_by_id(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id=?", (batch_id,)).fetchone()
            return None if row is None else self._batch_object(row)

    def _batch_object(self, row: tuple) -> dict[str, Any]:
        """`row` (_BATCH_COLUMNS) as OpenAI's batch object; the caller holds the lock."""
        batch = dict(zip(_BATCH_KEYS, row))
        counts = self._db.execute(
            "SELECT status = 'done' AND response_status BETWEEN 200 AND 299, count(*) FROM lines "
            "WHERE batch_id=? AND status != 'pending' GROUP BY 1", (batch["id"],)).fetchall()
        total = self._db.execute("SELECT count(*) FROM lines WHERE batch_id=?", (batch["id"],)).fetchone()[0]
        by_ok = dict(counts)
        metadata, errors = batch.pop("metadata"), batch.pop("errors")
        return {"object": "batch", **batch, "errors": None if errors is None else json.loads(errors),
                "expires_at": None, "expired_at": None, "metadata": None if metadata is None else json.loads(metadata),
                "request_counts": {"total": total, "completed": by_ok.get(1, 0), "failed": by_ok.get(0, 0)}}


_BATCH_KEYS = ("id", "input_file_id", "endpoint", "completion_window", "status", "created_at", "in_progress_at",
               "finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at", "output_file_id",
               "error_file_id", "metadata", "errors")
_BATCH_COLUMNS = ", ".join(_BATCH_KEYS)


def _marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def _insert_file(db: sqlite3.Connection, file_id: str, filename: str, purpose: str, num_bytes: int, owner: str,
                 tenant: str) -> None:
    """The file's row; its bytes go to `file_chunks` (`_ChunkWriter`)."""
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, tenant, owner) "
               "VALUES (?, ?, ?, ?, ?, x'', ?, ?)", (file_id, purpose, filename, num_bytes, int(time.time()), tenant,
                                                     owner))


class _ChunkWriter:
    """Appends bytes to a file's pieces in `file_chunks`, from byte `start` on, CHUNK_BYTES at a time
    (`close` writes the last, shorter one); holds at most one piece. Inside the caller's transaction."""

    def __init__(self, db: sqlite3.Connection, file_id: str, start: int = 0) -> None:
        self.db, self.file_id, self.written = db, file_id, start
        self._buffer = bytearray()

    @property
    def size(self) -> int:
        """Bytes of the file so far, written or buffered."""
        return self.written + len(self._buffer)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = CHUNK_BYTES - len(self._buffer)
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == CHUNK_BYTES:
                self._flush()

    def close(self) -> None:
        if self._buffer:
            self._flush()

    def _flush(self) -> None:
        self.db.execute("INSERT INTO file_chunks (file_id, start, data) VALUES (?, ?, ?)",
                        (self.file_id, self.written, bytes(self._buffer)))
        self.written += len(self._buffer)
        self._buffer.clear()


def _read_chunks(db: sqlite3.Connection, file_id: str, offset: int, end: int) -> bytes:
    """Bytes [offset, end) of a file kept in `file_chunks`."""
    first = db.execute("SELECT max(start) FROM file_chunks WHERE file_id=? AND start<=?", (file_id, offset)).fetchone()
    out = bytearray()
    for start, data in db.execute("SELECT start, data FROM file_chunks WHERE file_id=? AND start>=? AND start<? "
                                  "ORDER BY start", (file_id, first[0] or 0, end)):
        out += data[max(0, offset - start):end - start]
    return bytes(out)


def _assemble_step(db: sqlite3.Connection, batch_id: str, status: str) -> bool:
    """Write the next answered lines after the `finalizing` cursor to the output (2xx answers) and error
    (other answers, line errors) files, at most about FINALIZE_STEP_BYTES; True once the batch is
    finished (the files added, or failed for an output past MAX_OUTPUT_FILE_BYTES)."""
    progress = db.execute("SELECT after_line_no, output_bytes, error_bytes FROM finalizing WHERE batch_id=?",
                          (batch_id,)).fetchone() or (0, 0, 0)
    after = progress[0]
    writers = [_ChunkWriter(db, file_id, start) for file_id, start in zip(result_file_ids(batch_id), progress[1:])]
    rows = db.execute("SELECT line_no, custom_id, status, response_status, response_body, error FROM lines "
                      "WHERE batch_id=? AND line_no>? AND status != 'pending' ORDER BY line_no", (batch_id, after))
    step_bytes, more = 0, False
    for row in rows:
        target, text = _result_line(batch_id, row)
        writer = writers[target]
        if writer.size + len(text) > MAX_OUTPUT_FILE_BYTES:
            rows.close()
            _fail(db, batch_id, "output_too_large", f"the batch's {('output', 'error')[target]} file would be larger "
                  f"than {MAX_OUTPUT_FILE_BYTES} bytes at line {row[0]}; split the input into smaller batches")
            return True
        writer.write(text)
        after, step_bytes = row[0], step_bytes + len(text)
        if step_bytes >= FINALIZE_STEP_BYTES:
            more = True
            break
    rows.close()
    for writer in writers:
        writer.close()
    if more:
        db.execute("INSERT OR REPLACE INTO finalizing (batch_id, after_line_no, output_bytes, error_bytes) "
                   "VALUES (?, ?, ?, ?)", (batch_id, after, writers[0].size, writers[1].size))
        return False
    _complete(db, batch_id, status, writers)
    return True


def _result_line(batch_id: str, row: tuple) -> tuple[int, bytes]:
    """(0 for the output file or 1 for the error file, the JSONL line) of an answered line, as OpenAI
    writes it: a line error has `error`, and `response` null unless the line had an answer."""
    line_no, custom_id, status, response_status, response_body, error = row
    line_id, request_id = line_ids(batch_id, line_no)
    response = None if response_status is None else {
        "status_code": response_status, "request_id": request_id,
        "body": None if response_body is None else json.loads(response_body)}
    if status == "error":
        target, error = 1, json.loads(error)
    else:
        target = 0 if 200 <= response_status < 300 else 1
    return target, (json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error})
                    + "\n").encode()


def _complete(db: sqlite3.Connection, batch_id: str, status: str, writers: list[_ChunkWriter]) -> None:
    """Add the written output and error files (a file only when it has a line) and mark the batch
    completed, or cancelled if it was cancelling."""
    owner, tenant = db.execute("SELECT owner, tenant FROM batches WHERE id=?", (batch_id,)).fetchone()
    file_ids = []
    for writer, name in zip(writers, ("output", "error")):
        if writer.size:
            _insert_file(db, writer.file_id, f"{batch_id}_{name}.jsonl", "batch_output", writer.size, owner, tenant)
        file_ids.append(writer.file_id if writer.size else None)
    final = "cancelled" if status == "cancelling" else "completed"
    db.execute(f"UPDATE batches SET status=?, {final}_at=?, output_file_id=?, error_file_id=? WHERE id=?",
               (final, int(time.time()), *file_ids, batch_id))
    db.execute("DELETE FROM finalizing WHERE batch_id=?", (batch_id,))


def _fail(db: sqlite3.Connection, batch_id: str, code: str, message: str) -> None:
    """Mark an unfinished batch failed with OpenAI's `errors` list, and drop what finalizing wrote."""
    errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
    cursor = db.execute(f"UPDATE batches SET status='failed', failed_at=?, errors=? WHERE id=? AND status IN "
                        f"({_marks(UNFINISHED)})", (int(time.time()), json.dumps(errors), batch_id, *UNFINISHED))
    if cursor.rowcount:
        db.execute("DELETE FROM file_chunks WHERE file_id IN (?, ?)", result_file_ids(batch_id))
        db.execute("DELETE FROM finalizing WHERE batch_id=?", (batch_id,))


def _migrate(db: sqlite3.Connection, path: Path, default_tenant: str, legacy_owner: Callable[[str], str]) -> None:
    """Bring the store to _SCHEMA_VERSION inside the caller's transaction: create what is missing (a new
    file), add the columns an older store's tables lack (version 1's rows get `default_tenant`), and
    give the rows of a store without owners the owner `legacy_owner(tenant)`. Decided by the columns
    present, not only the version: a version-0 file may hold version-1 tables (a process that died
    between creating them and writing the version)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version not in range(_SCHEMA_VERSION + 1):
        raise RuntimeError(f"{path}: batch store schema version {version}, this code reads {_SCHEMA_VERSION}")
    for statement in _TABLES:
        db.execute(statement)
    added = set()
    for table, column, definition in _ADDED_COLUMNS:
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            # the rows get the column's default: no row (nor a file's content) is rewritten
            literal = "'" + default_tenant.replace("'", "''") + "'"   # an SQL literal
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition.format(default_tenant=literal)}")
            added.add((table, column))
    if ("batches", "owner") in added or ("files", "owner") in added:
        tenants = [row[0] for row in db.execute("SELECT tenant FROM files UNION SELECT tenant FROM batches")]
        db.executemany("INSERT OR REPLACE INTO legacy_owners (tenant, owner) VALUES (?, ?)",
                       ((tenant, legacy_owner(tenant)) for tenant in tenants))
        db.execute("UPDATE batches SET owner = (SELECT owner FROM legacy_owners WHERE legacy_owners.tenant = "
                   "batches.tenant) WHERE owner = ''")
    for statement in _INDEXES:
        db.execute(statement)
    db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")


def _check_metadata(metadata: Any) -> None:
    """OpenAI's metadata rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise BatchInputError("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} string values")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise BatchInputError(f"metadata.{key}", f"keys are at most {MAX_METADATA_KEY} characters and values "
                                  f"strings of at most {MAX_METADATA_VALUE}")
