"""A batch store's files in SQLite: bytes kept in pieces of CHUNK_BYTES (`file_chunks`), read back a
range at a time, and a finished batch's output and error files assembled a step at a time
(`assemble_step`, each step one transaction of the caller's) from its answered lines, as OpenAI
writes them. Ids of result lines and files are derived from the batch id, so a finalize resumed after
a crash writes the same ones. `pools.store.batch_store` owns the connection and the transactions.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from typing import Any

MAX_OUTPUT_FILE_BYTES = 512 << 20       # each of a batch's output and error files (512 MiB): `assemble_step`
CHUNK_BYTES = 1 << 20                   # the pieces a file's bytes are stored in (`file_chunks`)
FINALIZE_STEP_BYTES = 4 << 20           # output and error lines written by one `finalize_step` transaction
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")   # a runner still owes work


def marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def line_ids(batch_id: str, line_no: int) -> tuple[str, str]:
    """(`batch_req_…` id, `req_…` request id) of a line: derived, so every finalize writes the same ones."""
    digest = hashlib.sha256(f"{batch_id}/{line_no}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}", f"req_{digest[32:64]}"


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """(output file id, error file id) of a batch: derived, so a finalize resumed after a crash continues
    the same files."""
    digest = hashlib.sha256(f"{batch_id}/files".encode()).hexdigest()
    return f"file-{digest[:24]}", f"file-{digest[24:48]}"


def insert_file(db: sqlite3.Connection, file_id: str, filename: str, purpose: str, num_bytes: int, owner: str,
                 tenant: str, expires_after: int | None = None) -> None:
    """The file's row, expiring `expires_after` seconds from now (None: kept until deleted); its bytes go to
    `file_chunks` (`ChunkWriter`)."""
    now = int(time.time())
    db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, tenant, owner, expires_at) "
               "VALUES (?, ?, ?, ?, ?, x'', ?, ?, ?)", (file_id, purpose, filename, num_bytes, now, tenant, owner,
                                                        None if expires_after is None else now + expires_after))


def drop_files(db: sqlite3.Connection, file_ids: list[str], now: int) -> None:
    """Deleted or expired files: their bytes go, their rows stay marked `deleted_at` (a batch may name them)."""
    db.executemany("UPDATE files SET deleted_at=?, bytes=0, content=x'' WHERE id=?", ((now, i) for i in file_ids))
    db.executemany("DELETE FROM file_chunks WHERE file_id=?", ((i,) for i in file_ids))


class ChunkWriter:
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


def read_chunks(db: sqlite3.Connection, file_id: str, offset: int, end: int) -> bytes:
    """Bytes [offset, end) of a file kept in `file_chunks`."""
    first = db.execute("SELECT max(start) FROM file_chunks WHERE file_id=? AND start<=?", (file_id, offset)).fetchone()
    out = bytearray()
    for start, data in db.execute("SELECT start, data FROM file_chunks WHERE file_id=? AND start>=? AND start<? "
                                  "ORDER BY start", (file_id, first[0] or 0, end)):
        out += data[max(0, offset - start):end - start]
    return bytes(out)


def assemble_step(db: sqlite3.Connection, batch_id: str, status: str) -> bool:
    """Write the next answered lines after the `finalizing` cursor to the output (2xx answers) and error
    (other answers, line errors) files, at most about FINALIZE_STEP_BYTES; True once the batch is
    finished (the files added, or failed: see below). A line whose entry would take its file past
    MAX_OUTPUT_FILE_BYTES becomes an error entry without its answer (`output_too_large`, counted failed): the
    answers that fit are kept; only an error file that cannot hold even those entries fails the batch."""
    progress = db.execute("SELECT after_line_no, output_bytes, error_bytes FROM finalizing WHERE batch_id=?",
                          (batch_id,)).fetchone() or (0, 0, 0)
    after = progress[0]
    writers = [ChunkWriter(db, file_id, start) for file_id, start in zip(result_file_ids(batch_id), progress[1:])]
    rows = db.execute("SELECT line_no, custom_id, status, response_status, response_body, error FROM lines "
                      "WHERE batch_id=? AND line_no>? AND status != 'pending' ORDER BY line_no", (batch_id, after))
    step_bytes, more, overflowed = 0, False, []
    for row in rows:
        target, text = result_line(batch_id, row)
        if writers[target].size + len(text) > MAX_OUTPUT_FILE_BYTES:
            text, error = overflow_line(batch_id, row, ("output", "error")[target])
            target = 1
            overflowed.append((json.dumps(error), row[0]))
            if writers[1].size + len(text) > MAX_OUTPUT_FILE_BYTES:
                rows.close()
                fail_batch(db, batch_id, "output_too_large", f"the batch's error file would be larger than "
                           f"{MAX_OUTPUT_FILE_BYTES} bytes at line {row[0]}; split the input into smaller batches")
                return True
        writers[target].write(text)
        after, step_bytes = row[0], step_bytes + len(text)
        if step_bytes >= FINALIZE_STEP_BYTES:
            more = True
            break
    rows.close()
    db.executemany("UPDATE lines SET status='error', error=? WHERE batch_id=? AND line_no=?",   # counted failed
                   ((error, batch_id, line_no) for error, line_no in overflowed))
    for writer in writers:
        writer.close()
    if more:
        db.execute("INSERT OR REPLACE INTO finalizing (batch_id, after_line_no, output_bytes, error_bytes) "
                   "VALUES (?, ?, ?, ?)", (batch_id, after, writers[0].size, writers[1].size))
        return False
    complete_batch(db, batch_id, status, writers)
    return True


def result_line(batch_id: str, row: tuple) -> tuple[int, bytes]:
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


def overflow_line(batch_id: str, row: tuple, full: str) -> tuple[bytes, dict[str, Any]]:
    """(the error file's entry, its error) of an answered line whose entry did not fit in the `full` file: its
    status without its body, and the error `output_too_large`."""
    line_no, custom_id, _, response_status = row[:4]
    line_id, request_id = line_ids(batch_id, line_no)
    response = None if response_status is None else {"status_code": response_status, "request_id": request_id,
                                                     "body": None}
    error = {"code": "output_too_large", "line": line_no, "message": (
        f"line {line_no}: its answer is not kept: the batch's {full} file was full ({MAX_OUTPUT_FILE_BYTES} bytes "
        "at most); split the input into smaller batches")}
    entry = {"id": line_id, "custom_id": custom_id, "response": response, "error": error}
    return (json.dumps(entry) + "\n").encode(), error


def complete_batch(db: sqlite3.Connection, batch_id: str, status: str, writers: list[ChunkWriter]) -> None:
    """Add the written output and error files (a file only when it has a line) and mark the batch
    completed, cancelled if it was cancelling, or expired if its completion window ended first
    (`BatchStore.expire_next` set its `expired_at`)."""
    owner, tenant, expires_after, expired_at = db.execute(
        "SELECT owner, tenant, output_expires_seconds, expired_at FROM batches WHERE id=?", (batch_id,)).fetchone()
    file_ids = []
    for writer, name in zip(writers, ("output", "error")):
        if writer.size:
            insert_file(db, writer.file_id, f"{batch_id}_{name}.jsonl", "batch_output", writer.size, owner, tenant,
                        expires_after)
        file_ids.append(writer.file_id if writer.size else None)
    final = "cancelled" if status == "cancelling" else "completed" if expired_at is None else "expired"
    db.execute(f"UPDATE batches SET status=?, {final}_at=COALESCE({final}_at, ?), output_file_id=?, error_file_id=? "
               "WHERE id=?", (final, int(time.time()), *file_ids, batch_id))
    db.execute("DELETE FROM finalizing WHERE batch_id=?", (batch_id,))
    drop_lines(db, batch_id, request_counts(db, batch_id))


def request_counts(db: sqlite3.Connection, batch_id: str) -> dict[str, int]:
    """OpenAI's `request_counts` of a batch: kept on its row once finished, else counted from its lines."""
    kept = db.execute("SELECT request_counts FROM batches WHERE id=?", (batch_id,)).fetchone()
    if kept is not None and kept[0] is not None:
        return json.loads(kept[0])
    counts = dict(db.execute("SELECT status = 'done' AND response_status BETWEEN 200 AND 299, count(*) FROM lines "
                             "WHERE batch_id=? AND status != 'pending' GROUP BY 1", (batch_id,)).fetchall())
    total = db.execute("SELECT count(*) FROM lines WHERE batch_id=?", (batch_id,)).fetchone()[0]
    return {"total": total, "completed": counts.get(1, 0), "failed": counts.get(0, 0)}


def drop_lines(db: sqlite3.Connection, batch_id: str, counts: dict[str, int]) -> None:
    """A finished batch keeps its request counts (`counts`) on its row, not its lines: its input and output
    files hold their requests and answers, and the store kept every batch's traffic twice (deleted rows free
    whole pages, which the next batch reuses; rows only emptied of their bodies freed none)."""
    db.execute("UPDATE batches SET request_counts=? WHERE id=?", (json.dumps(counts), batch_id))
    db.execute("DELETE FROM lines WHERE batch_id=?", (batch_id,))


def fail_batch(db: sqlite3.Connection, batch_id: str, code: str, message: str) -> None:
    """Mark an unfinished batch failed with OpenAI's `errors` list, and drop what finalizing wrote. Its
    lines' answers go with it (no output or error file holds them), so it counts none: `completed` and
    `failed` are 0, `total` its number of requests; `errors` says why."""
    errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
    cursor = db.execute(f"UPDATE batches SET status='failed', failed_at=?, errors=? WHERE id=? AND status IN "
                        f"({marks(UNFINISHED)})", (int(time.time()), json.dumps(errors), batch_id, *UNFINISHED))
    if cursor.rowcount:
        db.execute("DELETE FROM file_chunks WHERE file_id IN (?, ?)", result_file_ids(batch_id))
        db.execute("DELETE FROM finalizing WHERE batch_id=?", (batch_id,))
        drop_lines(db, batch_id, {"total": request_counts(db, batch_id)["total"], "completed": 0, "failed": 0})
