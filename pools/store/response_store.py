"""`ResponseStore`: the Responses API's stored responses, in the `responses` table of the gateway's
SQLite store (the Batch API's file under `--data-dir`; `pools.store.schema` creates the table, so
open a `BatchStore` on the file first).

A row is one response: its owner (who may see it; `Tenants.owner` of the key that made it), its
tenant (whose share a background run spends), the request body as received, the conversation's
input items (those of every earlier turn reached through `previous_response_id` first, then the
request's own: a turn that continues it needs this row alone), and the Response object as it
stands. A stored response is written when it is finished (completed, incomplete, failed); a
background one also when it is queued, and again at each change of status, so one that was queued
or in progress when the gateway stopped is found by `unfinished` and run again.

Ownership as in the batch store: every method a client reaches takes `owner`, and another owner's
response is exactly one that does not exist (None, False).

Retention (`RetentionSpec`, YAML `gateway.stored_responses`): an owner's oldest finished responses
past `max_per_owner` are removed as a new one of theirs is written (in its transaction, by the
owner's index); `purge` removes finished responses older than `retention_days` (by the age index)
and every owner's surplus, when the store opens and every PURGE_EVERY_S after (the gateway's
`KeptResponses`, on the store's thread: never inside a response's own write, whose client waits on it). A
background response in progress is never removed.

Durability as the batch store's: WAL, `synchronous=FULL`. One connection guarded by a lock: any
thread may call any method (the gateway calls them from one worker thread, off its event loop).
Stdlib only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pools.store.batch_input import is_text
from pools.store.schema import StoreFile
from pools.config.gateway_spec import RetentionSpec

__all__ = ["FINISHED", "ResponseStore", "StoredResponse"]

FINISHED = ("completed", "incomplete", "failed", "cancelled")   # a Response's final statuses
PURGE_EVERY_S = 60.0
_DONE = f"status IN ({', '.join('?' * len(FINISHED))})"


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    tenant: str
    background: bool
    request: dict[str, Any]          # the request body as received
    items: list[dict[str, Any]]      # the conversation's input items, earlier turns' first
    response: dict[str, Any]         # the Response object as it stands

    @property
    def status(self) -> str:
        return self.response["status"]


class ResponseStore(StoreFile):
    """Stored responses in the SQLite file `path` (its schema made by `BatchStore`), kept as
    `retention` says. See the module docstring for what a row holds and who sees it."""

    def __init__(self, path: Path | str, retention: RetentionSpec = RetentionSpec()) -> None:
        super().__init__(path)
        self.retention = retention
        try:
            if self._db.execute("SELECT 1 FROM sqlite_master WHERE name='responses'").fetchone() is None:
                raise RuntimeError(f"{self.path}: no responses table; open a BatchStore on it first")
            self.purge()
        except BaseException:
            self._db.close()
            raise

    def put(self, response: dict[str, Any], *, owner: str, tenant: str, request: dict[str, Any],
            items: list[dict[str, Any]], background: bool = False) -> None:
        """Store a new response (`response["id"]`); the owner's finished ones past `max_per_owner` go."""
        with self._txn() as db:
            db.execute("INSERT INTO responses (id, owner, tenant, created_at, status, background, request, items, "
                       "response) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (response["id"], owner, tenant, response["created_at"], response["status"], int(background),
                        json.dumps(request), json.dumps(items), json.dumps(response)))
            db.execute(f"DELETE FROM responses WHERE owner=? AND {_DONE} AND seq <= (SELECT seq FROM responses "
                       f"WHERE owner=? AND {_DONE} ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                       (owner, *FINISHED, owner, *FINISHED, self.retention.max_per_owner))

    def update(self, response: dict[str, Any], *, unless: tuple[str, ...] = ()) -> bool:
        """Replace a stored response's object (and status) with `response`, unless its stored status is
        one of `unless` (a cancelled run's late result is dropped so). False if nothing changed."""
        with self._txn() as db:
            cursor = db.execute(f"UPDATE responses SET status=?, response=? WHERE id=? AND status NOT IN "
                                f"({', '.join('?' * len(unless))})",
                                (response["status"], json.dumps(response), response["id"], *unless))
        return cursor.rowcount == 1

    def get(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """The response, or None (no such response, or another owner's, or an id that is not `is_text`: a URL's
        byte past UTF-8, which SQLite cannot bind)."""
        if not is_text(response_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT id, owner, tenant, background, request, items, response FROM responses "
                                   "WHERE id=? AND owner=?", (response_id, owner)).fetchone()
        return None if row is None else _stored(row)

    def delete(self, response_id: str, *, owner: str) -> bool:
        """Remove the response; False if there is none (or it is another owner's, or the id is not `is_text`)."""
        if not is_text(response_id):
            return False
        with self._txn() as db:
            return db.execute("DELETE FROM responses WHERE id=? AND owner=?", (response_id, owner)).rowcount == 1

    def unfinished(self) -> list[StoredResponse]:
        """Background responses still queued or in progress (a gateway stopped under them), oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT id, owner, tenant, background, request, items, response FROM responses "
                                    f"WHERE background=1 AND NOT {_DONE} "
                                    "ORDER BY seq", FINISHED).fetchall()
        return [_stored(row) for row in rows]

    def purge(self, now: float | None = None) -> int:
        """Remove finished responses older than the retention and each owner's oldest finished ones past
        `max_per_owner`; how many were removed."""
        now = time.time() if now is None else now
        with self._txn() as db:
            old = db.execute(f"DELETE FROM responses WHERE created_at < ? AND {_DONE}",
                             (now - self.retention.retention_days * 86400, *FINISHED)).rowcount
            over = db.execute(
                f"DELETE FROM responses WHERE seq IN (SELECT seq FROM (SELECT seq, row_number() OVER "
                f"(PARTITION BY owner ORDER BY seq DESC) AS newer FROM responses WHERE {_DONE}) WHERE newer > ?)",
                (*FINISHED, self.retention.max_per_owner)).rowcount
        return old + over


def _stored(row: tuple) -> StoredResponse:
    response_id, owner, tenant, background, request, items, response = row
    return StoredResponse(response_id, owner, tenant, bool(background), json.loads(request), json.loads(items),
                          json.loads(response))
