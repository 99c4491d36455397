"""A batch created in steps (`BatchCreation`, a part of `BatchStore`), each its own short transaction.

`begin_batch` checks the arguments and the input file (counted: a 400 naming `input_file_id` past the limits) and
stores the batch `validating`; `add_lines` parses and stores the next LINES_PER_STEP of its lines, one transaction a
step; `start_batch` marks it `in_progress` once every line is stored. Between steps the store serves everyone else:
one transaction that parsed and stored a file of 200 MB held the database's write lock for 7 s, past SQLite's busy
timeout of another connection to the file (a kept Response was then not kept), and held the store's one thread as
long (every batch's records, every list, every upload waited). `create_batch` is the steps in one call.

A batch the gateway stopped creating (a crash between steps) stays `validating` with some of its lines: nothing
runs it (`BatchStore.unfinished_batch_ids` passes it over), and the next start fails it (`fail_interrupted`), its
client having had no answer; one whose creation failed and could not even be dropped (the store failing) is
failed so by the runner's next turn, which keeps those it is creating. A batch cancelled while it is created stores no more
lines and is not started; its runner finalizes it `cancelled`. An input file deleted meanwhile makes the
creation a 400 (`add_lines`), the batch dropped (`drop_batch`) as if never made.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Iterator
from typing import Any

from pools.store.batch_files import fail_batch
from pools.store.batch_input import (BatchInputError, BatchLine, TooManyBatches, check_batch_arguments,
                                     check_expires_after)
from pools.store.schema import UNFINISHED_SQL

LINES_PER_STEP = 1000   # lines one step parses and stores (~0.15 s of long lines: the store's other users wait no more)
STEP_BYTES = 4 << 20    # and the bodies it stores, at most past one line (50 lines of 80 KB; a line holds up to 1 MiB)
INTERRUPTED = ("batch_creation_interrupted", "the gateway stopped while it was reading the batch's input file; "
               "create the batch again")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


class BatchCreation:
    """`BatchStore`'s batch creation (the module's steps); the store gives `_txn`, `_lock`, `_db`, `batch` and
    `_input_lines`."""

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None, *, owner: str, tenant: str,
                     output_expires_after: dict[str, Any] | None = None,
                     max_unfinished: int | None = None) -> dict[str, Any]:
        """Every step in one call (`begin_batch`, then `add_lines` until it is done, then `start_batch`); a
        step that raised drops the batch (`drop_batch`) and raises."""
        batch_id, lines = self.begin_batch(input_file_id, endpoint, completion_window, metadata, owner=owner,
                                           tenant=tenant, output_expires_after=output_expires_after,
                                           max_unfinished=max_unfinished)
        try:
            while self.add_lines(batch_id, lines):
                pass
        except BaseException:
            self.drop_batch(batch_id)
            raise
        return self.start_batch(batch_id, owner=owner)

    def begin_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                    metadata: dict[str, str] | None = None, *, owner: str, tenant: str,
                    output_expires_after: dict[str, Any] | None = None, max_unfinished: int | None = None,
                    batch_id: str | None = None) -> tuple[str, Iterator[BatchLine]]:
        """Store a batch of `owner`'s input file, owned by `owner` and run as `tenant`, `validating`, with no line
        yet: its id, and its lines to store (`add_lines`). Its output and error files expire as
        `output_expires_after` says (OpenAI's policy; none: kept until deleted). BatchInputError naming the field
        for a bad argument, or a file past the limits (counted here, before anything is stored); another owner's
        input file is refused as one that does not exist. TooManyBatches when `owner` has `max_unfinished` batches
        unfinished already (counted in the transaction that stores it: batches created at once cannot pass it
        together). `batch_id`: its id, chosen by the caller (`new_batch_id`)."""
        expires_after = check_expires_after(output_expires_after, "output_expires_after")
        check_batch_arguments(endpoint, completion_window, metadata)
        batch_id, now = batch_id or new_batch_id(), int(time.time())
        with self._lock:
            lines = self._input_lines(input_file_id, endpoint, owner, now)
        with self._txn() as db:
            if max_unfinished is not None:
                (unfinished,) = db.execute(f"SELECT COUNT(*) FROM batches WHERE owner=? AND {UNFINISHED_SQL}",
                                           (owner,)).fetchone()
                if unfinished >= max_unfinished:
                    raise TooManyBatches(unfinished, max_unfinished)
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, "
                       "metadata, tenant, owner, output_expires_seconds) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, "
                       "?, ?)", (batch_id, input_file_id, endpoint, completion_window, now,
                                 None if metadata is None else json.dumps(metadata), tenant, owner, expires_after))
        return batch_id, lines

    def add_lines(self, batch_id: str, lines: Iterator[BatchLine], limit: int | None = None,
                  max_bytes: int | None = None) -> bool:
        """The batch's next lines (`begin_batch`'s `lines`) parsed and stored, `limit` of them at most and not
        past `max_bytes` of bodies (past one line), in a transaction of their own, each stored as it is parsed
        (what is held is one line): whether more are to come (False once all are stored, or once the batch is no
        longer validating: it was cancelled, and stores no more). BatchInputError naming `input_file_id` if the
        file was deleted meanwhile (what was read of it may be cut short)."""
        more = False
        limit = LINES_PER_STEP if limit is None else limit
        max_bytes = STEP_BYTES if max_bytes is None else max_bytes

        def rows() -> Iterator[tuple]:
            nonlocal more
            count = size = 0
            for ln in lines:
                body = None if ln.body is None else json.dumps(ln.body)
                yield (batch_id, ln.line_no, ln.custom_id, ln.method, ln.url, body,
                       "error" if ln.error else "pending", None if ln.error is None else json.dumps(ln.error))
                count, size = count + 1, size + len(body or "")
                if count >= limit or size >= max_bytes:   # not one more line taken from `lines`
                    more = True
                    return

        with self._txn() as db:   # the file's pieces are read through the store's connection, under its lock
            row = db.execute("SELECT batches.status, files.deleted_at FROM batches JOIN files ON files.id = "
                             "batches.input_file_id WHERE batches.id=?", (batch_id,)).fetchone()
            if row is None or row[0] != "validating":
                return False
            if row[1] is not None:
                raise BatchInputError("input_file_id", "the file was deleted while the batch was being created")
            db.executemany("INSERT INTO lines (batch_id, line_no, custom_id, method, url, body, status, error) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows())
        return more

    def start_batch(self, batch_id: str, *, owner: str) -> dict[str, Any] | None:
        """Every line of the batch stored: `in_progress` (one cancelled meanwhile stays as it is); its object."""
        with self._txn() as db:
            db.execute("UPDATE batches SET status='in_progress', in_progress_at=? WHERE id=? AND status='validating'",
                       (int(time.time()), batch_id))
        return self.batch(batch_id, owner=owner)

    def drop_batch(self, batch_id: str) -> None:
        """A batch whose creation failed: gone, its lines with it, as if never made."""
        with self._txn() as db:
            if db.execute("DELETE FROM batches WHERE id=? AND status='validating'", (batch_id,)).rowcount:
                db.execute("DELETE FROM lines WHERE batch_id=?", (batch_id,))

    def fail_interrupted(self, keep: Collection[str] = ()) -> list[str]:
        """Fail the batches left `validating` (INTERRUPTED, OpenAI's `errors`) but those of `keep` (being
        created: a gateway's start keeps none, its runner's turns those it creates); their ids."""
        with self._txn() as db:
            ids = [row[0] for row in db.execute("SELECT id FROM batches WHERE status='validating'")
                   if row[0] not in keep]
            for batch_id in ids:
                fail_batch(db, batch_id, *INTERRUPTED)
        return ids
