"""`ResponseStore`: the Responses API's stored responses, in the `responses` table of the gateway's
SQLite store (the Batch API's file under `--data-dir`; `pools.store.schema` creates the table, so
open a `BatchStore` on the file first).

A row is one response: its owner (who may see it; `Tenants.owner` of the key that made it), its
tenant (whose share a background run spends), the request body as received, the Response object as
it stands, and its part of the conversation's input items. The conversation is every earlier turn
reached through `previous_response_id` (their input and output items) and then the request's own; a
row that continues another keeps only the items past that one's conversation (`parent`, `num_items`:
the whole conversation's length) and `get` joins the chain: a conversation of n turns is n rows of
their own items, not n copies of a growing list (docs/PERF.md, "Stored conversations"). A response
removed (DELETE, retention) while a continuation of it is kept stays as `removed`, seen by nobody, its
items read only by the chain through it, and goes with the last row that continues it (`_collect`).
Rows of stores before version 8 keep their whole conversation.

A stored response is written when it is finished (completed, incomplete, failed); a background one also
when it is queued, and again at each change of status, so one that was queued or in progress when the
gateway stopped is found by `unfinished` and run again.

Ownership as in the batch store: every method a client reaches takes `owner`, and another owner's
response is exactly one that does not exist (None, False).

A response's output items are indexed by id (`response_items`, owner first), so that a later request's
`item_reference` input finds one (`output_item`); a removed response's go with it.

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
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pools.store.batch_input import is_text
from pools.store.schema import StoreFile, index_output_items
from pools.config.gateway_spec import RetentionSpec

__all__ = ["FINISHED", "ResponseStore", "StoredResponse"]

FINISHED = ("completed", "incomplete", "failed", "cancelled")   # a Response's final statuses
PURGE_EVERY_S = 60.0
_DONE = f"status IN ({', '.join('?' * len(FINISHED))})"
_ROW = "id, owner, tenant, background, request, response"   # its items come with the chain
# a row's conversation: its own items after its parents', the oldest first
_CHAIN = ("WITH RECURSIVE chain(seq, parent) AS (SELECT seq, parent FROM responses WHERE id = ? "
          "UNION ALL SELECT r.seq, r.parent FROM chain AS c JOIN responses AS r INDEXED BY responses_chain "
          "ON r.id = c.parent) "
          "SELECT items FROM responses WHERE seq IN (SELECT seq FROM chain) ORDER BY seq")   # a parent is older


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
            items: list[dict[str, Any]], background: bool = False, parent: str | None = None) -> None:
        """Store a new response (`response["id"]`) whose conversation is `items`; `parent`: the response
        (`previous_response_id`) whose conversation they continue, then only those past it are written (all
        of them if it is gone meanwhile). The owner's finished ones past `max_per_owner` go."""
        with self._txn() as db:
            known = db.execute("SELECT num_items, CASE WHEN num_items IS NULL THEN items END FROM responses "
                               "WHERE id=? AND owner=?", (parent, owner)).fetchone() if parent else None
            inherited = None if known is None else known[0] if known[0] is not None else len(json.loads(known[1]))
            if inherited is None or inherited > len(items):
                parent, inherited = None, 0
            db.execute("INSERT INTO responses (id, owner, tenant, created_at, status, background, request, items, "
                       "response, parent, num_items) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (response["id"], owner, tenant, response["created_at"], response["status"], int(background),
                        json.dumps(request), json.dumps(items[inherited:]), json.dumps(response), parent, len(items)))
            index_output_items(db, response["id"], owner, response)
            _remove(db, f"owner=? AND {_DONE} AND seq <= (SELECT seq FROM responses WHERE owner=? AND removed=0 AND "
                        f"{_DONE} ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (owner, *FINISHED, owner, *FINISHED, self.retention.max_per_owner))

    def update(self, response: dict[str, Any], *, unless: tuple[str, ...] = ()) -> bool:
        """Replace a stored response's object (and status) with `response`, unless its stored status is
        one of `unless` (a cancelled run's late result is dropped so). False if nothing changed."""
        with self._txn() as db:
            cursor = db.execute(f"UPDATE responses SET status=?, response=? WHERE id=? AND removed=0 AND status NOT "
                                f"IN ({', '.join('?' * len(unless))})",
                                (response["status"], json.dumps(response), response["id"], *unless))
            if cursor.rowcount == 1:
                (owner,) = db.execute("SELECT owner FROM responses WHERE id=?", (response["id"],)).fetchone()
                index_output_items(db, response["id"], owner, response)
        return cursor.rowcount == 1

    def get(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """The response, or None (no such response, or another owner's, or an id that is not `is_text`: a URL's
        byte past UTF-8, which SQLite cannot bind)."""
        if not is_text(response_id):
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {_ROW} FROM responses WHERE id=? AND owner=? AND removed=0",
                                   (response_id, owner)).fetchone()
            return None if row is None else self._stored(row)

    def output_item(self, item_id: str, *, owner: str) -> dict[str, Any] | None:
        """The output item `item_id` of one of the owner's kept responses (the latest that has one of that id),
        as its Response holds it; None: no such item, another owner's, or its response removed."""
        if not is_text(item_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT r.response FROM response_items AS i JOIN responses AS r ON r.id = "
                                   "i.response_id WHERE i.owner=? AND i.item_id=? AND r.removed=0",
                                   (owner, item_id)).fetchone()
        output = [] if row is None else json.loads(row[0]).get("output") or []
        return next((item for item in output if item.get("id") == item_id), None)

    def delete(self, response_id: str, *, owner: str) -> bool:
        """Remove the response; False if there is none (or it is another owner's, or the id is not `is_text`)."""
        if not is_text(response_id):
            return False
        with self._txn() as db:
            return _remove(db, "id=? AND owner=?", (response_id, owner)) == 1

    def unfinished(self) -> list[StoredResponse]:
        """Background responses still queued or in progress (a gateway stopped under them), oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_ROW} FROM responses WHERE background=1 AND removed=0 AND NOT {_DONE} "
                                    "ORDER BY seq", FINISHED).fetchall()
            return [self._stored(row) for row in rows]

    def purge(self, now: float | None = None) -> int:
        """Remove finished responses older than the retention and each owner's oldest finished ones past
        `max_per_owner`; how many were removed."""
        now = time.time() if now is None else now
        with self._txn() as db:
            old = _remove(db, f"created_at < ? AND {_DONE}", (now - self.retention.retention_days * 86400, *FINISHED))
            over = _remove(db, f"seq IN (SELECT seq FROM (SELECT seq, row_number() OVER (PARTITION BY owner ORDER BY "
                               f"seq DESC) AS newer FROM responses WHERE removed=0 AND {_DONE}) WHERE newer > ?)",
                           (*FINISHED, self.retention.max_per_owner))
        return old + over

    def _stored(self, row: tuple) -> StoredResponse:
        """A row as its StoredResponse, its whole conversation joined (the lock held)."""
        response_id, owner, tenant, background, request, response = row
        items = [item for (part,) in self._db.execute(_CHAIN, (response_id,)) for item in json.loads(part)]
        return StoredResponse(response_id, owner, tenant, bool(background), json.loads(request), items,
                              json.loads(response))


def _remove(db: sqlite3.Connection, where: str, params: tuple) -> int:
    """Remove the responses `where` selects among those not removed; how many. One that a kept row continues
    stays `removed` (its items, nothing else), for the chain through it; the rest go (`_collect`)."""
    ids = [response_id for (response_id,) in db.execute(f"SELECT id FROM responses WHERE removed=0 AND ({where})",
                                                         params)]
    db.executemany("UPDATE responses SET removed=1, request='{}', response='{}' WHERE id=?", ((i,) for i in ids))
    db.executemany("DELETE FROM response_items WHERE response_id=?", ((i,) for i in ids))
    _collect(db, ids)
    return len(ids)


def _collect(db: sqlite3.Connection, ids: list[str]) -> None:
    """Delete each of the removed rows `ids` that no row continues, then each one's parent that it alone
    continued while removed, and so on up the chain: the rows a removal may have freed, never a scan of all
    the removed rows the store keeps for their continuations."""
    while ids:
        freed = []
        for response_id in ids:
            row = db.execute("SELECT parent FROM responses WHERE id=? AND removed=1 AND NOT EXISTS (SELECT 1 FROM "
                             "responses AS c WHERE c.parent=?)", (response_id, response_id)).fetchone()
            if row is not None:
                db.execute("DELETE FROM responses WHERE id=?", (response_id,))
                freed += [row[0]] if row[0] is not None else []
        ids = freed
