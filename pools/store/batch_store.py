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
moves the cursor (`finalizing` table); the last step adds the two files, marks the batch completed,
cancelled or expired, keeps its request counts on its row and deletes its lines (the files hold them). A crash between
steps leaves the batch `finalizing` with the cursor of the last step committed, and finalizing again
continues from it; the file ids are derived from the batch id, so
every finalize gives the same files. A line whose entry would take its file past MAX_OUTPUT_FILE_BYTES
goes to the error file as a short entry without its answer (`output_too_large`, counted failed); an error
file that cannot hold even those fails the batch (`status: failed`, `errors` naming `output_too_large`),
and a line answer whose JSON alone passes it is recorded as that line's error (`response_too_large`).

Expiry and deletion: a file has `expires_at` (an upload's from its policy, 30 days without one; a batch's
output and error files' from the batch's `output_expires_after`, else none). An expired or deleted file is
gone at once to every reader (`_FILE_LIVE`); its bytes are dropped by `delete_file`, or by `purge_expired`
(the batch runner's, every PURGE_EVERY_S), and its row stays, marked `deleted_at`, since a batch may name
it. A batch's lines were stored when it was created: it runs on without its input file.

A batch expires as OpenAI's: `expire_next` ends one still running WINDOW_SECONDS after its creation
(`expires_at` in its object), its pending lines errors `batch_expired`, and finalizing marks it `expired`.

Input lines are checked when the batch is created (`pools.store.batch_input.batch_input_lines`): an
unusable line is a per-line error for the error file; the batch itself never fails for it. A batch
fails as a whole only through `fail` (the runner's reason: the store could not take its results) or
an output past the limit.

Ownership: every file and batch has an `owner`, the only thing access is checked against, and a
`tenant`, whose share and priority its lines run with (`pools.tenants`: the gateway passes
`Tenants.owner` and the tenant of the request's API key). A batch's output and error files have the
batch's owner and tenant. Every method a client reaches takes `owner` and treats another owner's
file or batch exactly as one that does not exist (None, or the same BatchInputError), so an id never
tells a caller that someone else has it. The runner's methods (`batch_tenant`, `batch_status`,
`pending_lines`, `record`, `finalize_step`, `fail`...) take batch ids only.

Schema versions (`PRAGMA user_version`; the tables and the migration are `pools.store.schema`),
migrated in place in one transaction when the store opens (a crash leaves the old version, and the
next open migrates again; decided by the columns present):
1 had no owners; 2 added `tenant` (version 1's rows: the store's `default_tenant`); 3 adds `owner`,
the failed state (`failed_at`, `errors`), `file_chunks` and `finalizing`; 4 adds the Responses API's
`responses` table (`pools.store.response_store`, which opens the same file); 5 adds `request_counts` to
`batches`, where a batch finished since keeps its counts once its lines are deleted (a batch finished
before keeps its lines), `output_expires_seconds` to `batches`, `expires_at` and `deleted_at` to `files`
(files stored before never expire) and the index `files_by_expiry`; 6 adds `sent_at` to `lines`; 7 adds
`expired_at` to `batches` (`expire_next`); 8 adds `parent`, `num_items` and `removed` to `responses` (a
continuation keeps only its own items: `pools.store.response_store`); 9 adds `response_items`, the kept
responses' output items by id (those of the responses kept before are indexed at the migration). A store is
refused by older code
(its version), so a downgrade needs the store file from before the upgrade. A version-2 row keeps its
tenant as its tenant, and its owner is `legacy_owner(tenant)` (the gateway: `Tenants.legacy_owner`,
whose rule keeps a row reachable by the key or shared tenant that reached it before wherever the
configuration still tells which that is; without one, the tenant's name). That mapping is written
once, into `legacy_owners`, at the migration; old batch rows get the owner in their `owner` column,
old file rows keep `owner` NULL and are looked up there, so no file's content is rewritten. Their
content stays in `files.content` (empty for files written by version 3).

Thread rule: one connection, guarded by a lock, so any thread may call any method (the gateway calls
them from one worker thread, off its event loop). A method that cannot read or write the database now
(disk full, database locked past the busy timeout, an I/O error, a damaged file) raises one of STORAGE_ERRORS and
changes nothing. Stdlib only; no aiohttp (the pools package never imports it).
"""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pools.store import batch_files
from pools.store.batch_create import BatchCreation
from pools.store.batch_input import (DEFAULT_BATCH_FILE_SECONDS, FILE_PURPOSES, WINDOW_SECONDS, BatchInputError,
                                     BatchLine, batch_input_lines, check_expires_after, clean_filename, is_text)
from pools.store.batch_files import (CHUNK_BYTES, UNFINISHED, ChunkWriter, assemble_step, drop_files, fail_batch,
                                     insert_file, marks, read_chunks, request_counts, result_file_ids)
from pools.store.schema import StoreFile, migrate

__all__ = ["BatchStore", "STORAGE_ERRORS"]

# disk full, locked past the busy timeout, an I/O error, a damaged file (`StoreFile.on_thread` makes it one of these)
STORAGE_ERRORS = (sqlite3.OperationalError,)

CANCELLABLE = ("validating", "in_progress")
EXPIRED_LINE = ("This request could not be executed before the completion window expired.")   # OpenAI's words

_BATCH_KEYS = ("id", "input_file_id", "endpoint", "completion_window", "status", "created_at", "in_progress_at",
               "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
               "output_file_id", "error_file_id", "metadata", "errors")
_BATCH_COLUMNS = ", ".join(_BATCH_KEYS)
_FILE_OWNER = "COALESCE(files.owner, (SELECT owner FROM legacy_owners WHERE legacy_owners.tenant = files.tenant))"
_FILE_LIVE = "files.deleted_at IS NULL AND (files.expires_at IS NULL OR files.expires_at > ?)"   # ? = now
_FILE_COLUMNS = "id, purpose, filename, bytes, created_at, expires_at"
PURGE_EVERY_S = 60.0      # how often the batch runner drops expired files' bytes (`purge_expired`)
PURGE_BYTES = 64 << 20    # bytes one purge transaction drops at most (past one file; the next call drops more)
PAGE_BYTES = 8 << 20      # bodies of pending lines one page reads at most (past one line: `pending_lines`)


class BatchStore(BatchCreation, StoreFile):
    """Files, batches and request lines in `path` (SQLite, WAL), each file and batch with an owner (who
    may see it) and a tenant (whose share its lines run with). See the module docstring for the
    durability, exactly-once, bounded-memory and ownership rules. Methods return OpenAI-shaped dicts
    (file and batch objects, which show neither). `default_tenant` is the tenant of a version-1 store's
    rows, and `legacy_owner(tenant)` the owner of a version-2 (or 1) store's rows, when it is migrated
    (None: the tenant's name)."""

    def __init__(self, path: Path | str, *, default_tenant: str,
                 legacy_owner: Callable[[str], str] | None = None) -> None:
        super().__init__(path)
        try:
            with self._txn() as db:
                migrate(db, self.path, default_tenant, legacy_owner or (lambda tenant: tenant))
        except BaseException:
            self._db.close()
            raise

    # --- files -----------------------------------------------------------------------------------
    def add_file(self, content: bytes | BinaryIO, filename: str | None, purpose: str, *, owner: str, tenant: str,
                 expires_after: dict[str, Any] | None = None) -> dict[str, Any]:
        """Store an upload of `owner` (made by a key of `tenant`; its bytes, or a file read from its current
        position to its end, CHUNK_BYTES at a time) under its filename as `clean_filename` leaves it, expiring
        as `expires_after` says (OpenAI's policy; none: a batch file's 30 days); BatchInputError naming `purpose`
        unless it is one of FILE_PURPOSES, or the policy's field."""
        if purpose not in FILE_PURPOSES:
            raise BatchInputError("purpose", f"must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}")
        seconds = check_expires_after(expires_after, "expires_after") or DEFAULT_BATCH_FILE_SECONDS
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        source = io.BytesIO(content) if isinstance(content, (bytes, bytearray)) else content
        with self._txn() as db:
            insert_file(db, file_id, clean_filename(filename), purpose, 0, owner, tenant, seconds)
            writer = ChunkWriter(db, file_id)
            while piece := source.read(CHUNK_BYTES):
                writer.write(piece)
            writer.close()
            db.execute("UPDATE files SET bytes=? WHERE id=?", (writer.size, file_id))
        return self.file(file_id, owner=owner)

    def delete_file(self, file_id: str, *, owner: str) -> bool:
        """Delete `owner`'s file: its bytes go at once, its row stays as the mark that it was (a batch may
        name it) and is never shown again. False if there is no such file (or another owner's, or gone)."""
        if not is_text(file_id):
            return False
        now = int(time.time())
        with self._txn() as db:
            found = db.execute(f"SELECT 1 FROM files WHERE id=? AND {_FILE_OWNER}=? AND {_FILE_LIVE}",
                               (file_id, owner, now)).fetchone()
            if found:
                drop_files(db, [file_id], now)
        return found is not None

    def purge_expired(self, now: float | None = None) -> int:
        """Drop the bytes of files past their `expires_at` (as a deletion: their rows stay, marked), in one
        transaction of at most PURGE_BYTES (at least one file), so the store is never held long; how many
        files (0: none was due). Expired files are gone to every reader from that second, purged or not."""
        now = int(time.time() if now is None else now)
        ids, total = [], 0
        with self._txn() as db:
            for file_id, num_bytes in db.execute("SELECT id, bytes FROM files WHERE deleted_at IS NULL AND "
                                                 "expires_at <= ?", (now,)):
                if ids and total + num_bytes > PURGE_BYTES:
                    break
                ids.append(file_id)
                total += num_bytes
            drop_files(db, ids, now)
        return len(ids)

    def file(self, file_id: str, *, owner: str) -> dict[str, Any] | None:
        """The OpenAI file object, or None (no such file, or another owner's; also an id SQLite cannot
        hold, which no file has: a lone surrogate from JSON)."""
        if not is_text(file_id):
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id=? AND {_FILE_OWNER}=? AND {_FILE_LIVE}",
                                   (file_id, owner, int(time.time()))).fetchone()
        return None if row is None else _file_object(row)

    def list_files(self, limit: int, after: str | None, *, owner: str, ascending: bool = False,
                   purpose: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` of `owner`'s live files (of `purpose`, if given) in the order they were added
        (`ascending`, else newest first), past file `after` (deleted or expired since, too); and whether more
        follow. BatchInputError naming `after` when it is not one of the owner's files."""
        now = int(time.time())
        if purpose is not None and not is_text(purpose):
            return [], False   # no file has it
        with self._lock:
            since = None
            if after is not None:
                found = is_text(after) and self._db.execute(   # live or not: a page may end on one deleted since
                    f"SELECT rowid FROM files WHERE id=? AND {_FILE_OWNER}=?", (after, owner)).fetchone()
                if not found:
                    raise BatchInputError("after", f"no file {after!r}")
                since = found[0]
            past, order = (">", "ASC") if ascending else ("<", "DESC")
            rows = self._db.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE {_FILE_OWNER}=? AND {_FILE_LIVE} AND (? IS NULL OR "
                f"purpose=?) AND (? IS NULL OR rowid {past} ?) ORDER BY rowid {order} LIMIT ?",
                (owner, now, purpose, purpose, since, since, limit + 1)).fetchall()
        return [_file_object(row) for row in rows[:limit]], len(rows) > limit

    def file_content(self, file_id: str, *, owner: str, offset: int = 0, size: int | None = None) -> bytes | None:
        """The file's bytes from `offset`, at most `size` of them (None: to the end; the gateway reads a
        piece at a time), or None (no such file, or another owner's, or an id that is not `is_text`)."""
        if not is_text(file_id):
            return None
        with self._lock:
            row = self._db.execute(f"SELECT bytes, length(content) FROM files WHERE id=? AND {_FILE_OWNER}=? AND "
                                   f"{_FILE_LIVE}", (file_id, owner, int(time.time()))).fetchone()
            if row is None:
                return None
            end = row[0] if size is None else min(row[0], offset + size)
            return self._read(file_id, bool(row[1]), offset, end) if end > offset else b""

    def _read(self, file_id: str, legacy: bool, offset: int, end: int) -> bytes:
        """Bytes [offset, end) of a file (its lock held): a `legacy` (version-2) file's bytes are one blob, read
        in place (not loaded whole); the others' are in `file_chunks`."""
        if legacy:
            rowid = self._db.execute("SELECT rowid FROM files WHERE id=?", (file_id,)).fetchone()[0]
            with self._db.blobopen("files", "content", rowid, readonly=True) as blob:
                blob.seek(offset)
                return blob.read(end - offset)
        return read_chunks(self._db, file_id, offset, end)

    # --- batches ---------------------------------------------------------------------------------
    def _input_lines(self, input_file_id: str, endpoint: str, owner: str, now: int) -> Iterator[BatchLine]:
        """The lines of `owner`'s batch input file, counted and checked (`batch_input_lines`), read in pieces
        of CHUNK_BYTES (the caller holds the store's lock: `pools.store.batch_create`)."""
        row = is_text(input_file_id) and self._db.execute(
            f"SELECT purpose, bytes, length(content) FROM files WHERE id=? AND {_FILE_OWNER}=? AND {_FILE_LIVE}",
            (input_file_id, owner, now)).fetchone()
        if not row:
            raise BatchInputError("input_file_id", f"no file {input_file_id!r}")
        purpose, total, legacy = row
        if purpose != "batch":
            raise BatchInputError("input_file_id", f"file {input_file_id!r} has purpose {purpose!r}, not 'batch'")

        def pieces() -> Iterator[bytes]:
            for offset in range(0, total, CHUNK_BYTES):
                yield self._read(input_file_id, bool(legacy), offset, min(total, offset + CHUNK_BYTES))
        return batch_input_lines(pieces, endpoint, input_file_id)

    def batch(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """The OpenAI batch object (request_counts counted from the lines, or kept on a finished batch's row),
        or None (no such batch, or another owner's, or an id that is not `is_text`: a URL's byte past UTF-8)."""
        if not is_text(batch_id):
            return None
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
                found = is_text(after) and self._db.execute("SELECT seq FROM batches WHERE id=? AND owner=?",
                                                            (after, owner)).fetchone()
                if not found:
                    raise BatchInputError("after", f"no batch {after!r}")
                before = found[0]
            rows = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE owner=? AND (? IS NULL OR seq < ?) "
                                    "ORDER BY seq DESC LIMIT ?", (owner, before, before, limit + 1)).fetchall()
            return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """Mark a validating or in_progress batch `cancelling` (its runner stops taking lines and then
        finalizes it as `cancelled`); any other batch is returned unchanged. None if there is none, or
        it is another owner's (which is left alone)."""
        if not is_text(batch_id):
            return None
        with self._txn() as db:
            db.execute(f"UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=? AND owner=? AND "
                       f"status IN ({marks(CANCELLABLE)})", (int(time.time()), batch_id, owner, *CANCELLABLE))
        return self.batch(batch_id, owner=owner)

    def expire_next(self, now: float | None = None) -> str | None:
        """Expire the oldest batch whose completion window ended (`created_at` + WINDOW_SECONDS) before its lines
        did, in one transaction of its own (a store down for days holds many: one at a time, the store is never
        held long): a validating or in_progress one with lines pending is marked `finalizing` with `expired_at`
        (when its window ended), and its pending lines (a line in flight included: its answer, come later, is
        not recorded) become errors `batch_expired` for the error file; finalizing ends it `expired`, the answers
        it had kept in its output file. Its id, for the runner to stop its lines and finalize it; None when none
        is due (one cancelling or finalizing ends as it was going to; one whose lines are all answered, completed)."""
        now = int(time.time() if now is None else now)
        entry = f'{{"code": "batch_expired", "message": {json.dumps(EXPIRED_LINE)}, "line": '   # `record`'s shape
        with self._txn() as db:
            for window, seconds in WINDOW_SECONDS.items():
                due = db.execute(f"SELECT id FROM batches WHERE status IN ({marks(CANCELLABLE)}) AND completion_window=? "
                                 "AND created_at + ? <= ? AND EXISTS (SELECT 1 FROM lines WHERE batch_id = batches.id "
                                 "AND status = 'pending') ORDER BY seq LIMIT 1", (*CANCELLABLE, window, seconds, now)
                                 ).fetchone()
                if due is not None:
                    db.execute("UPDATE lines SET status='error', error=? || line_no || '}' WHERE batch_id=? AND "
                               "status='pending'", (entry, due[0]))
                    db.execute("UPDATE batches SET status='finalizing', finalizing_at=?, expired_at=MIN(?, created_at "
                               "+ ?) WHERE id=?", (now, now, seconds, due[0]))
                    return due[0]
        return None

    def unfinished_batch_ids(self) -> list[str]:
        """Batches a runner still owes work (lines to run, or finalizing), oldest first; not one `validating`:
        its creation stores its lines, then starts it (`pools.store.batch_create`)."""
        running = tuple(status for status in UNFINISHED if status != "validating")
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks(running)}) ORDER BY seq",
                                    running).fetchall()
        return [r[0] for r in rows]

    # --- lines -----------------------------------------------------------------------------------
    def pending_lines(self, batch_id: str, after_line_no: int = 0, limit: int = 256,
                      max_bytes: int | None = None) -> list[BatchLine]:
        """Up to `limit` pending lines after `after_line_no`, in file order, their bodies `max_bytes` at most
        together (one line at least, whatever its size): a page of lines of a megabyte each is not a runner's
        quarter gigabyte, parsed, before any of them starts. Empty once none is left."""
        rows, size, max_bytes = [], 0, PAGE_BYTES if max_bytes is None else max_bytes
        with self._lock, contextlib.closing(self._db.execute(   # closed at once, not once collected: a read ends
                "SELECT line_no, custom_id, method, url, body, sent_at FROM lines WHERE batch_id=? AND line_no>? "
                "AND status='pending' ORDER BY line_no LIMIT ?", (batch_id, after_line_no, limit))) as cursor:
            for row in cursor:
                size += len(row[4])
                if rows and size > max_bytes:
                    break
                rows.append(row)
        return [BatchLine(r[0], r[1], r[2], r[3], json.loads(r[4]), sent=r[5] is not None) for r in rows]

    def mark_sent(self, batch_id: str, line_no: int, sent: bool = True) -> None:
        """Note, as a pending line goes to an upstream pool, that it may run there (`sent`; False: it did
        not, the upstream refused it): a line a stop cut while the upstream ran it is never sent again at
        the next start (`gateway.batch.execution`)."""
        with self._txn() as db:
            db.execute("UPDATE lines SET sent_at=? WHERE batch_id=? AND line_no=? AND status='pending'",
                       (int(time.time()) if sent else None, batch_id, line_no))

    def record(self, batch_id: str, line_no: int, status_code: int, body: Any, *,
               error: dict[str, str] | None = None) -> bool:
        """Record a pending line's answer (HTTP status, JSON body): a result, or with `error` ({"code",
        "message"}) the line's error, its last answer beside it. An answer whose JSON is longer than
        MAX_OUTPUT_FILE_BYTES is not kept: the line's error says so. False, changing nothing, if the
        line is not pending (already recorded, or no such line)."""
        response: str | None = json.dumps(body)
        if len(response) > batch_files.MAX_OUTPUT_FILE_BYTES:
            error = {"code": "response_too_large", "message": f"the answer's JSON has {len(response)} bytes, "
                     f"more than an output file may hold ({batch_files.MAX_OUTPUT_FILE_BYTES} bytes)"}
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
        """One transaction of finalizing: write the next lines (up to FINALIZE_STEP_BYTES) to the output and error
        files; at the end, add the files and mark the batch `completed` (`cancelled` if it was cancelling, `expired`
        if its window ended: `expire_next`), or `failed` if the error file would pass MAX_OUTPUT_FILE_BYTES
        (`assemble_step`). None while lines remain, else the batch
        object (a finished batch: unchanged). Only lines with an answer or an error go into the files: a cancelled
        batch's pending lines are in neither. KeyError: no such batch."""
        with self._txn() as db:
            found = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if found is None:
                raise KeyError(batch_id)
            if found[0] in UNFINISHED and not assemble_step(db, batch_id, found[0]):
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
            fail_batch(db, batch_id, code, message)
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
                               f"({marks(UNFINISHED)})", UNFINISHED).fetchall()
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
        metadata, errors = batch.pop("metadata"), batch.pop("errors")
        window = WINDOW_SECONDS.get(batch["completion_window"])
        return {"object": "batch", **batch, "errors": None if errors is None else json.loads(errors),
                "expires_at": None if window is None else batch["created_at"] + window,
                "expired_at": batch["expired_at"] if batch["status"] == "expired" else None,   # once it is
                "metadata": None if metadata is None else json.loads(metadata),
                "request_counts": {"total": 0, "completed": 0, "failed": 0} if batch["status"] == "validating" else
                request_counts(self._db, batch["id"])}   # as OpenAI's while it validates: counted once it runs


def _file_object(row: tuple) -> dict[str, Any]:
    """OpenAI's file object of a `files` row's _FILE_COLUMNS."""
    return {"id": row[0], "object": "file", "purpose": row[1], "filename": row[2], "bytes": row[3],
            "created_at": row[4], "status": "processed", "expires_at": row[5], "status_details": None}
