"""`BatchStore`: the durable state of the Batch API — uploaded files, batches, and every request line
with its status and result — in one SQLite database.

Durability: WAL journal with `synchronous=FULL`. WAL with NORMAL already survives a killed process
(`kill -9`: every committed transaction is in the WAL file the OS holds); FULL also syncs the WAL on
each commit, so a file id or batch id we returned, and a line result we recorded, survive a power
loss too. The price is one fsync per commit — per recorded line, small next to generating it.

Exactly once: a line's result is recorded by `UPDATE lines ... WHERE batch_id=? AND line_no=? AND
status='pending'` in one transaction. A line whose answer arrived but was not yet recorded when the
process died is still pending and runs again after a restart; a line already recorded is never sent
again, and a second `record` for it changes nothing. Output and error files are assembled from the
lines when the batch finalizes, in the same transaction that marks it completed or cancelled, so a
crash during finalizing leaves the batch `finalizing` and finalizing again gives the same files.

Input lines are checked when the batch is created (`parse_batch_input`): a line that is not JSON,
lacks `custom_id` / `method` / `url` / `body`, has another method or url than the batch's endpoint,
or repeats a `custom_id` is recorded as a per-line error for the error file; the batch itself never
fails for it.

Ownership: every file and batch belongs to the tenant that created it (the gateway passes the tenant
of the request's API key); a batch's output and error files belong to the batch's tenant. Every method
a client reaches takes `tenant` and treats another tenant's file or batch exactly as one that does not
exist (None, or the same BatchInputError), so an id never tells a caller that someone else has it.
The runner's methods (`batch_tenant`, `pending_lines`, `record`, `finalize`...) take batch ids only.

Schema versions (`PRAGMA user_version`): 1 had no owners; opening one adds the `tenant` columns, its
rows owned by the store's `default_tenant`, and sets version 2 in the same transaction, so a crash
leaves the old version and the next open migrates again.

Thread rule: one connection, guarded by a lock, so any thread may call any method (the gateway calls
them from one worker thread, off its event loop). Stdlib only; no aiohttp (DESIGN.md layers).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BATCH_ENDPOINTS", "BatchInputError", "BatchLine", "BatchStore", "COMPLETION_WINDOWS",
           "FILE_PURPOSES", "MAX_BATCH_LINES", "parse_batch_input"]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")   # what a line may be sent to
COMPLETION_WINDOWS = ("24h",)                                    # OpenAI's only window; nothing expires
FILE_PURPOSES = ("batch",)                                       # what an upload may be for
MAX_BATCH_LINES = 50_000                                         # request lines per batch, as OpenAI
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")   # a runner still owes work
CANCELLABLE = ("validating", "in_progress")

_TABLES = (   # the tables as version 2 creates them; `tenant` owns the row (version 1 had none)
    """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL, tenant TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,            -- creation order, for listing newest first
    id TEXT NOT NULL UNIQUE, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, metadata TEXT, tenant TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, method TEXT, url TEXT, body TEXT,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'error')),
    response_status INTEGER, response_body TEXT, error TEXT,
    PRIMARY KEY (batch_id, line_no))""")
_INDEXES = ("CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, response_status)",
            "CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq)")
_OWNED_TABLES = ("files", "batches")   # the tables with a `tenant` column
_SCHEMA_VERSION = 2


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
    belongs to the first line carrying it; later lines with it are `duplicate_custom_id` errors."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for line_no, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
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


class BatchStore:
    """Files, batches and request lines in `path` (SQLite, WAL), each file and batch owned by a tenant.
    See the module docstring for the durability, exactly-once and ownership rules. Methods return
    OpenAI-shaped dicts (file and batch objects, which do not show the tenant). `default_tenant` owns
    the rows of a version-1 store when it is migrated (the gateway's tenant of requests without a key)."""

    def __init__(self, path: Path | str, *, default_tenant: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            with self._txn() as db:
                _migrate(db, self.path, default_tenant)
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE … COMMIT), rolled back on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # --- files -----------------------------------------------------------------------------------
    def add_file(self, content: bytes, filename: str, purpose: str, *, tenant: str) -> dict[str, Any]:
        """Store an upload owned by `tenant`; BatchInputError naming `purpose` unless it is one of
        FILE_PURPOSES."""
        if purpose not in FILE_PURPOSES:
            raise BatchInputError("purpose", f"must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}")
        with self._txn() as db:
            file_id = _insert_file(db, content, filename, purpose, tenant)
        return self.file(file_id, tenant=tenant)

    def file(self, file_id: str, *, tenant: str) -> dict[str, Any] | None:
        """The OpenAI file object, or None (no such file, or another tenant's)."""
        with self._lock:
            row = self._db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id=? AND "
                                   "tenant=?", (file_id, tenant)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "object": "file", "purpose": row[1], "filename": row[2], "bytes": row[3],
                "created_at": row[4], "status": "processed", "expires_at": None, "status_details": None}

    def file_content(self, file_id: str, *, tenant: str) -> bytes | None:
        """The file's bytes, or None (no such file, or another tenant's)."""
        with self._lock:
            row = self._db.execute("SELECT content FROM files WHERE id=? AND tenant=?", (file_id, tenant)).fetchone()
        return None if row is None else bytes(row[0])

    # --- batches ---------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None, *, tenant: str) -> dict[str, Any]:
        """Parse the input file and store the batch, owned by `tenant`, with all its lines in one
        transaction, `in_progress` (bad lines already recorded as errors). BatchInputError naming the
        field for a bad argument; another tenant's input file is refused as one that does not exist."""
        if endpoint not in BATCH_ENDPOINTS:
            raise BatchInputError("endpoint", f"must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}")
        if completion_window not in COMPLETION_WINDOWS:
            raise BatchInputError("completion_window", f"must be {' or '.join(map(repr, COMPLETION_WINDOWS))}, "
                                  f"got {completion_window!r}")
        _check_metadata(metadata)
        info, content = self.file(input_file_id, tenant=tenant), self.file_content(input_file_id, tenant=tenant)
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
        batch_id, now = f"batch_{uuid.uuid4().hex[:24]}", int(time.time())
        with self._txn() as db:
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, "
                       "in_progress_at, metadata, tenant) VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?, ?)",
                       (batch_id, input_file_id, endpoint, completion_window, now, now,
                        None if metadata is None else json.dumps(metadata), tenant))
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, method, url, body, status, error) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                ((batch_id, ln.line_no, ln.custom_id, ln.method, ln.url,
                  None if ln.body is None else json.dumps(ln.body), "error" if ln.error else "pending",
                  None if ln.error is None else json.dumps(ln.error)) for ln in lines))
        return self.batch(batch_id, tenant=tenant)

    def batch(self, batch_id: str, *, tenant: str) -> dict[str, Any] | None:
        """The OpenAI batch object (request_counts counted from the lines), or None (no such batch, or
        another tenant's)."""
        with self._lock:
            row = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id=? AND tenant=?",
                                   (batch_id, tenant)).fetchone()
            return None if row is None else self._batch_object(row)

    def batch_tenant(self, batch_id: str) -> str | None:
        """The tenant that owns the batch (its lines run as that tenant), or None if there is none."""
        with self._lock:
            row = self._db.execute("SELECT tenant FROM batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None else row[0]

    def list_batches(self, limit: int = 20, after: str | None = None, *,
                     tenant: str) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` of `tenant`'s batches, newest first, created before batch `after`; and whether
        more follow. BatchInputError naming `after` when it is not one of the tenant's batch ids."""
        with self._lock:
            before = None
            if after is not None:
                found = self._db.execute("SELECT seq FROM batches WHERE id=? AND tenant=?", (after, tenant)).fetchone()
                if found is None:
                    raise BatchInputError("after", f"no batch {after!r}")
                before = found[0]
            rows = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE tenant=? AND (? IS NULL OR seq < ?) "
                                    "ORDER BY seq DESC LIMIT ?", (tenant, before, before, limit + 1)).fetchall()
            return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, batch_id: str, *, tenant: str) -> dict[str, Any] | None:
        """Mark a validating or in_progress batch `cancelling` (its runner stops taking lines and then
        finalizes it as `cancelled`); any other batch is returned unchanged. None if there is none, or
        it is another tenant's (which is left alone)."""
        with self._txn() as db:
            db.execute(f"UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=? AND tenant=? AND "
                       f"status IN ({_marks(CANCELLABLE)})", (int(time.time()), batch_id, tenant, *CANCELLABLE))
        return self.batch(batch_id, tenant=tenant)

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

    def record(self, batch_id: str, line_no: int, status_code: int, body: Any) -> bool:
        """Record a pending line's answer (HTTP status, JSON body); False, changing nothing, if the line
        is not pending (already recorded, or no such line)."""
        with self._txn() as db:
            cursor = db.execute("UPDATE lines SET status='done', response_status=?, response_body=? "
                                "WHERE batch_id=? AND line_no=? AND status='pending'",
                                (status_code, json.dumps(body), batch_id, line_no))
        return cursor.rowcount == 1

    def begin_finalizing(self, batch_id: str) -> None:
        """in_progress -> finalizing, once the runner has no line left to run."""
        with self._txn() as db:
            db.execute("UPDATE batches SET status='finalizing', finalizing_at=? WHERE id=? AND status='in_progress'",
                       (int(time.time()), batch_id))

    def finalize(self, batch_id: str) -> dict[str, Any]:
        """Write the output and error files and mark the batch `completed` (or `cancelled` if it was
        cancelling), in one transaction; a finished batch is returned unchanged. Only lines with an
        answer or an error go into the files: a cancelled batch's pending lines are in neither."""
        with self._txn() as db:
            found = db.execute("SELECT status, tenant FROM batches WHERE id=?", (batch_id,)).fetchone()
            if found is None:
                raise KeyError(batch_id)
            status, tenant = found
            if status in UNFINISHED:
                output, errors = _assemble(db, batch_id)
                output_id = (_insert_file(db, output, f"{batch_id}_output.jsonl", "batch_output", tenant)
                             if output else None)
                error_id = (_insert_file(db, errors, f"{batch_id}_error.jsonl", "batch_output", tenant)
                            if errors else None)
                final = "cancelled" if status == "cancelling" else "completed"
                db.execute(f"UPDATE batches SET status=?, {final}_at=?, output_file_id=?, error_file_id=? WHERE id=?",
                           (final, int(time.time()), output_id, error_id, batch_id))
        return self.batch(batch_id, tenant=tenant)

    def _batch_object(self, row: tuple) -> dict[str, Any]:
        """`row` (_BATCH_COLUMNS) as OpenAI's batch object; the caller holds the lock."""
        batch = dict(zip(_BATCH_KEYS, row))
        counts = self._db.execute(
            "SELECT status = 'done' AND response_status BETWEEN 200 AND 299, count(*) FROM lines "
            "WHERE batch_id=? AND status != 'pending' GROUP BY 1", (batch["id"],)).fetchall()
        total = self._db.execute("SELECT count(*) FROM lines WHERE batch_id=?", (batch["id"],)).fetchone()[0]
        by_ok = dict(counts)
        metadata = batch.pop("metadata")
        return {"object": "batch", **batch, "errors": None, "expires_at": None, "expired_at": None,
                "failed_at": None, "metadata": None if metadata is None else json.loads(metadata),
                "request_counts": {"total": total, "completed": by_ok.get(1, 0), "failed": by_ok.get(0, 0)}}


_BATCH_KEYS = ("id", "input_file_id", "endpoint", "completion_window", "status", "created_at", "in_progress_at",
               "finalizing_at", "completed_at", "cancelling_at", "cancelled_at", "output_file_id", "error_file_id",
               "metadata")
_BATCH_COLUMNS = ", ".join(_BATCH_KEYS)


def _marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def _insert_file(db: sqlite3.Connection, content: bytes, filename: str, purpose: str, tenant: str) -> str:
    file_id = f"file-{uuid.uuid4().hex[:24]}"
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, tenant) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)", (file_id, purpose, filename, len(content), int(time.time()), content,
                                                tenant))
    return file_id


def _migrate(db: sqlite3.Connection, path: Path, default_tenant: str) -> None:
    """Bring the store to _SCHEMA_VERSION inside the caller's transaction: create what is missing (a new
    file), add `tenant` to a version-1 store's tables with `default_tenant` owning their rows. Decided by
    the columns present, not only the version: a version-0 file may hold version-1 tables (a process
    that died between creating them and writing the version)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version not in range(_SCHEMA_VERSION + 1):
        raise RuntimeError(f"{path}: batch store schema version {version}, this code reads {_SCHEMA_VERSION}")
    for statement in _TABLES:
        db.execute(statement)
    for table in _OWNED_TABLES:
        if "tenant" not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            # the rows get the column's default: no row (nor a file's content) is rewritten
            owner = "'" + default_tenant.replace("'", "''") + "'"   # an SQL literal: DDL takes no parameters
            db.execute(f"ALTER TABLE {table} ADD COLUMN tenant TEXT NOT NULL DEFAULT {owner}")
    for statement in _INDEXES:
        db.execute(statement)
    db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")


def _assemble(db: sqlite3.Connection, batch_id: str) -> tuple[bytes, bytes]:
    """(output JSONL, error JSONL) of a batch's answered lines, in file order: 2xx answers go to the
    output, other answers (with their response) and line errors (response null) to the errors."""
    output: list[str] = []
    errors: list[str] = []
    rows = db.execute("SELECT line_no, custom_id, status, response_status, response_body, error FROM lines "
                      "WHERE batch_id=? AND status != 'pending' ORDER BY line_no", (batch_id,))
    for line_no, custom_id, status, response_status, response_body, error in rows:
        line_id, request_id = line_ids(batch_id, line_no)
        if status == "error":
            errors.append(json.dumps({"id": line_id, "custom_id": custom_id, "response": None,
                                      "error": json.loads(error)}))
            continue
        response = {"status_code": response_status, "request_id": request_id, "body": json.loads(response_body)}
        target = output if 200 <= response_status < 300 else errors
        target.append(json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": None}))
    return ("".join(s + "\n" for s in output).encode(), "".join(s + "\n" for s in errors).encode())


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
