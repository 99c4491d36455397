"""The gateway store's SQLite schema (version 9) and its in-place migration from versions 1 to 8
(`pools.store.batch_store` explains what each version holds and how old rows get their owner). The Batch API's
tables and, from version 4, the Responses API's stored responses (`pools.store.response_store`) share the file;
version 9 indexes each stored response's output items by id (`response_items`, filled from the responses an older
store holds when it migrates)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ContextManager, TypeVar

T = TypeVar("T")
log = logging.getLogger("cliffguard.store")

TABLES = (   # the tables as version 3 creates them (see the module docstring for what older ones lack)
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
    """CREATE TABLE IF NOT EXISTS legacy_owners (tenant TEXT PRIMARY KEY, owner TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS responses (   -- version 4: the Responses API's stored responses
    seq INTEGER PRIMARY KEY,            -- creation order
    id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, tenant TEXT NOT NULL, created_at REAL NOT NULL,
    status TEXT NOT NULL,               -- the Response's status (queued, in_progress, completed, ...)
    background INTEGER NOT NULL,        -- 1: run by the gateway, resumed after a restart
    request TEXT NOT NULL,              -- the request body (JSON), as a background run needs it
    items TEXT NOT NULL,                -- the conversation's input items, earlier turns' included (JSON)
    response TEXT NOT NULL)             -- the Response object (JSON) as it stands""",
    """CREATE TABLE IF NOT EXISTS response_items (   -- version 9: a kept response's output items by id
    owner TEXT NOT NULL, item_id TEXT NOT NULL, response_id TEXT NOT NULL,
    PRIMARY KEY (owner, item_id))""")
ADDED_COLUMNS = (   # (table, column, definition) added to an older store's tables; DDL takes no parameters
    ("files", "tenant", "TEXT NOT NULL DEFAULT {default_tenant}"),
    ("batches", "tenant", "TEXT NOT NULL DEFAULT {default_tenant}"),
    ("files", "owner", "TEXT"),
    ("batches", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("batches", "failed_at", "INTEGER"),
    ("batches", "errors", "TEXT"),
    ("batches", "request_counts", "TEXT"),   # version 5: a finished batch's counts (JSON), its lines deleted
    ("batches", "output_expires_seconds", "INTEGER"),   # 5: its output and error files expire so long after
    ("files", "expires_at", "INTEGER"),     # 5: when its bytes go (NULL: kept until deleted)
    ("files", "deleted_at", "INTEGER"),     # 5: deleted or expired: its bytes gone, its row kept (a batch names it)
    ("lines", "sent_at", "INTEGER"),        # 6: when it went to an upstream pool, which may run it (NULL: not yet)
    ("batches", "expired_at", "INTEGER"),   # 7: its completion window ended before its lines did (`expire_next`)
    ("responses", "parent", "TEXT"),        # 8: the response it continues; NULL: its items are the whole conversation
    ("responses", "num_items", "INTEGER"),  # 8: its whole conversation's length (NULL: a row before 8, whole)
    ("responses", "removed", "INTEGER NOT NULL DEFAULT 0"))   # 8: 1: deleted, kept for the rows continuing it
# a batch a runner still owes work (`pools.store.batch_files.UNFINISHED`), as literals: a partial index's test
UNFINISHED_SQL = "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')"
INDEXES = ("DROP INDEX IF EXISTS batches_by_tenant",   # version 2's; batches are listed by owner
            "CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, response_status)",
            "CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq)",
            # an owner's unfinished batches, counted at each create (`BatchStore.create_batch`'s max_unfinished)
            f"CREATE INDEX IF NOT EXISTS unfinished_by_owner ON batches (owner) WHERE {UNFINISHED_SQL}",
            "CREATE INDEX IF NOT EXISTS responses_by_owner ON responses (owner, seq)",
            "CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at)",
            "CREATE INDEX IF NOT EXISTS responses_by_parent ON responses (parent) WHERE parent IS NOT NULL",
            # a conversation's chain walked in the index alone (`parent` is past the row's long columns)
            "CREATE INDEX IF NOT EXISTS responses_chain ON responses (id, parent)",
            "CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at) WHERE deleted_at IS NULL",
            "CREATE INDEX IF NOT EXISTS response_items_by_response ON response_items (response_id)")
SCHEMA_VERSION = 9


def opened(make: Callable[[], T], path: Path) -> T:
    """`make()`, a store on the file at `path`; a RuntimeError naming the file where SQLite cannot open it
    (locked past the busy timeout by another program, not a database, damaged): `serve` says so in one line."""
    try:
        return make()
    except sqlite3.Error as exc:
        raise unusable(path, exc, "opened") from None


def unusable(path: Path, why: object, what: str = "read") -> RuntimeError:
    """What `serve` says, in one line, of a store it cannot open or read at its start."""
    return RuntimeError(f"--data-dir: the store {path} cannot be {what} ({why}): another program holds it, or it "
                        "is damaged (move it away to start with an empty store)")


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the store file: WAL, `synchronous=FULL` (a commit is on disk when it returns),
    a 5 s busy timeout; usable from any thread under its owner's lock."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
    except BaseException:
        db.close()
        raise
    return db


@contextmanager
def transaction(db: sqlite3.Connection, lock: threading.Lock) -> Iterator[sqlite3.Connection]:
    """One write transaction (BEGIN IMMEDIATE … COMMIT) under `lock`, rolled back on any error, a failed
    COMMIT (disk full) included."""
    with lock:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise


class StoreDamaged(sqlite3.OperationalError):
    """The store file is damaged (SQLite's DatabaseError itself: SQLITE_CORRUPT, SQLITE_NOTADB): a storage failure
    as a full disk is, but one no retry mends."""


class StoreFile:
    """One connection to the store file (`connect`) and the lock every use of it holds, so any thread
    may call a subclass's methods; `_txn` is one write transaction. The event loop calls them through
    `on_thread`: one thread per store, so its calls keep their order and the loop never waits on SQLite."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = connect(self.path)
        self._thread = ThreadPoolExecutor(1, f"cliffguard-{type(self).__name__}")

    async def on_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a method of this store) on the store's thread. A damaged file (SQLite's
        DatabaseError itself: SQLITE_CORRUPT, SQLITE_NOTADB) is raised as StoreDamaged, an OperationalError: a
        storage failure as a full disk's is; its subclasses (a constraint, a closed connection) are bugs and stay
        themselves."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args,
                                                                                                    **kwargs))
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise StoreDamaged(f"the store file is damaged: {exc}") from exc

    async def retried(self, what: str, fn: Callable[..., T], *args: Any, tries: int, first_s: float, max_s: float,
                      **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a method of this store) on its thread, tried again after a storage error (disk
        full, locked past the busy timeout: each call is one transaction, so a failed one changed nothing), at
        most `tries` times in all, `first_s` apart at first and doubling to `max_s`; past that the last error.
        `what` names the store in the log's warnings."""
        delay = first_s
        for attempt in range(1, tries + 1):
            try:
                return await self.on_thread(fn, *args, **kwargs)
            except sqlite3.OperationalError as exc:
                if attempt == tries or isinstance(exc, StoreDamaged):   # damaged: no retry mends it
                    raise
                log.warning("%s: %s (%s); trying again in %.1f s", what, exc, fn.__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_s)
        raise ValueError(f"tries: must be >= 1, got {tries}")

    async def shutdown(self) -> None:
        """Let what was handed to the thread land (a record written stays written), then close."""
        await asyncio.to_thread(self._thread.shutdown)
        self.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _txn(self) -> ContextManager[sqlite3.Connection]:
        return transaction(self._db, self._lock)


def migrate(db: sqlite3.Connection, path: Path, default_tenant: str, legacy_owner: Callable[[str], str]) -> None:
    """Bring the store to SCHEMA_VERSION inside the caller's transaction: create what is missing (a new
    file), add the columns an older store's tables lack (version 1's rows get `default_tenant`), and
    give the rows of a store without owners the owner `legacy_owner(tenant)`. Decided by the columns
    present, not only the version: a version-0 file may hold version-1 tables (a process that died
    between creating them and writing the version)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version not in range(SCHEMA_VERSION + 1):
        raise RuntimeError(f"{path}: batch store schema version {version}, this code reads {SCHEMA_VERSION}")
    for statement in TABLES:
        db.execute(statement)
    added = set()
    for table, column, definition in ADDED_COLUMNS:
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
    for statement in INDEXES:
        db.execute(statement)
    if version < 9:   # the output items of the responses kept before the index existed
        for response_id, owner, response in db.execute("SELECT id, owner, response FROM responses WHERE removed=0"
                                                       ).fetchall():
            index_output_items(db, response_id, owner, json.loads(response))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def index_output_items(db: sqlite3.Connection, response_id: str, owner: str, response: dict[str, Any]) -> None:
    """Index the output items of `response` (a Response object) by their ids, for `item_reference` inputs; an id
    the owner's index holds already now names this response's item (the latest)."""
    ids = [item["id"] for item in response.get("output") or () if isinstance(item, dict) and
           isinstance(item.get("id"), str)]
    db.executemany("INSERT OR REPLACE INTO response_items (owner, item_id, response_id) VALUES (?, ?, ?)",
                   ((owner, item_id, response_id) for item_id in ids))
