"""pools.batchstore: parsing batch input, exactly-once results, output files, each tenant seeing only its
own files and batches, migrating a version-1 store, and reopening after a process killed mid-transaction
(SQLite in a temporary folder; no model, no event loop)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pools.batchstore import BatchInputError, BatchStore, parse_batch_input
from pools.tenants import DEFAULT_TENANT

CHAT = "/v1/chat/completions"
OWNER = "a"                         # the tenant of the tests that use one


def _line(custom_id: str, url: str = CHAT, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}, **extra}


def _jsonl(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def _make_store(path: Path) -> BatchStore:
    return BatchStore(path, default_tenant=DEFAULT_TENANT)


def _make_batch(store: BatchStore, content: bytes, endpoint: str = CHAT, tenant: str = OWNER) -> dict:
    file = store.add_file(content, "in.jsonl", "batch", tenant=tenant)
    return store.create_batch(file["id"], endpoint, "24h", {"k": "v"}, tenant=tenant)


def _read_jsonl(store: BatchStore, file_id: str | None, tenant: str = OWNER) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.file_content(file_id, tenant=tenant).splitlines()]


def test_bad_lines_become_per_line_errors_naming_the_problem():
    content = _jsonl(_line("a"), b"{not json", [1, 2], {"custom_id": "b", "method": "POST", "url": CHAT},
                     _line("c", url="/v1/completions"), _line("d", method="GET"), _line("a"),
                     {**_line("e"), "body": "text"}, {**_line(""), "custom_id": 7}, _line("f", extra_key=1),
                     b"   ", _line("g"))
    lines = parse_batch_input(content, CHAT)
    errors = {ln.line_no: (ln.custom_id, ln.error["code"], ln.error["message"]) for ln in lines if ln.error}
    assert [ln.custom_id for ln in lines if not ln.error] == ["a", "g"]
    assert [ln.line_no for ln in lines][-1] == 12                     # blank line 11 skipped, numbers kept
    assert errors[2][:2] == (None, "invalid_json_line") and "line 2" in errors[2][2]
    assert errors[3][:2] == (None, "invalid_json_line")
    assert errors[4] == ("b", "missing_required_parameter", "body: missing")
    assert errors[5][1] == "invalid_url" and "'/v1/completions'" in errors[5][2]
    assert errors[6][1:] == ("invalid_method", "method: must be 'POST', got 'GET'")
    assert errors[7][1] == "duplicate_custom_id" and errors[7][2].startswith("custom_id: 'a'")
    assert errors[8][1] == "invalid_body" and errors[9][:2] == (None, "invalid_custom_id")
    assert errors[10][2] == "extra_key: unknown field of a request line"


def test_create_refuses_bad_arguments_naming_the_field(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    file = store.add_file(_jsonl(_line("a")), "in.jsonl", "batch", tenant=OWNER)
    cases = [((file["id"], "/v1/embeddings", "24h"), "endpoint"), ((file["id"], CHAT, "1h"), "completion_window"),
             (("file-none", CHAT, "24h"), "input_file_id"), ((file["id"], CHAT, "24h", {"k": 1}), "metadata.k")]
    for args, param in cases:
        with pytest.raises(BatchInputError) as info:
            store.create_batch(*args, tenant=OWNER)
        assert info.value.param == param and str(info.value).startswith(param + ": ")
    empty = store.add_file(b"\n  \n", "empty.jsonl", "batch", tenant=OWNER)
    with pytest.raises(BatchInputError, match="input_file_id: .* has no request lines"):
        store.create_batch(empty["id"], CHAT, "24h", tenant=OWNER)
    with pytest.raises(BatchInputError, match="purpose: must be one of batch, got 'fine-tune'"):
        store.add_file(b"x", "x", "fine-tune", tenant=OWNER)


def test_a_result_is_recorded_once_and_the_files_assembled_at_finalize(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(_line("a"), b"oops", _line("b"), _line("c")))
    assert batch["status"] == "in_progress" and batch["object"] == "batch" and batch["metadata"] == {"k": "v"}
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 1}
    pending = store.pending_lines(batch["id"])
    assert [ln.custom_id for ln in pending] == ["a", "b", "c"]
    assert [ln.line_no for ln in store.pending_lines(batch["id"], after_line_no=1, limit=1)] == [3]
    assert store.record(batch["id"], 1, 200, {"choices": ["first"]})
    assert not store.record(batch["id"], 1, 200, {"choices": ["second"]})    # a retry changes nothing
    assert not store.record(batch["id"], 99, 200, {})
    assert store.record(batch["id"], 3, 400, {"error": {"message": "temperature: bad", "code": None}})
    assert store.record(batch["id"], 4, 200, {"choices": ["c"]})
    assert store.batch(batch["id"], tenant=OWNER)["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    store.begin_finalizing(batch["id"])
    assert store.batch(batch["id"], tenant=OWNER)["status"] == "finalizing"
    done = store.finalize(batch["id"])
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    output, errors = _read_jsonl(store, done["output_file_id"]), _read_jsonl(store, done["error_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["choices"]) for o in output] == [("a", ["first"]), ("c", ["c"])]
    assert all(o["id"].startswith("batch_req_") and o["response"]["status_code"] == 200 and o["error"] is None
               and o["response"]["request_id"].startswith("req_") for o in output)
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == [(None, None),
                                                                                              ("b", 400)]
    assert errors[0]["error"]["code"] == "invalid_json_line" and errors[1]["error"] is None
    assert store.file(done["output_file_id"], tenant=OWNER)["purpose"] == "batch_output"   # the batch's tenant's
    assert store.finalize(batch["id"]) == done                             # finalizing again: unchanged


def test_cancel_keeps_what_finished_and_list_pages_newest_first(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    ids = [_make_batch(store, _jsonl(_line("a"), _line("b")))["id"] for _ in range(5)]
    store.record(ids[0], 1, 200, {"ok": 1})
    assert store.cancel(ids[0], tenant=OWNER)["status"] == "cancelling"
    cancelled = store.finalize(ids[0])
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] and cancelled["error_file_id"] is None
    assert [o["custom_id"] for o in _read_jsonl(store, cancelled["output_file_id"])] == ["a"]
    assert store.cancel(ids[0], tenant=OWNER)["status"] == "cancelled"   # not cancellable any more: unchanged
    page, more = store.list_batches(limit=2, tenant=OWNER)
    assert [b["id"] for b in page] == ids[:2:-1][:2] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"], tenant=OWNER)
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"], tenant=OWNER)
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(BatchInputError, match="after: no batch 'batch_x'"):
        store.list_batches(after="batch_x", tenant=OWNER)
    assert store.unfinished_batch_ids() == ids[1:]


def test_a_tenant_sees_only_its_own_files_and_batches(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(_line("a"), _line("b")))
    file_id = batch["input_file_id"]
    assert store.batch_tenant(batch["id"]) == OWNER and store.batch_tenant("batch_x") is None
    for tenant in ("b", DEFAULT_TENANT):                                 # another tenant: as if there were none
        assert store.file(file_id, tenant=tenant) is None and store.file_content(file_id, tenant=tenant) is None
        assert store.batch(batch["id"], tenant=tenant) is None and store.cancel(batch["id"], tenant=tenant) is None
        assert store.list_batches(tenant=tenant) == ([], False)
        with pytest.raises(BatchInputError, match=f"after: no batch '{batch['id']}'"):
            store.list_batches(after=batch["id"], tenant=tenant)
        with pytest.raises(BatchInputError, match=f"input_file_id: no file '{file_id}'"):
            store.create_batch(file_id, CHAT, "24h", tenant=tenant)
    assert store.batch(batch["id"], tenant=OWNER)["status"] == "in_progress"   # the other cancels changed nothing
    own = _make_batch(store, _jsonl(_line("x")), tenant="b")
    assert [b["id"] for b in store.list_batches(tenant="b")[0]] == [own["id"]]
    assert [b["id"] for b in store.list_batches(tenant=OWNER)[0]] == [batch["id"]]
    for line_no in (1, 2):
        store.record(batch["id"], line_no, 200, {"n": line_no})
    done = store.finalize(batch["id"])                                   # the output is the batch's tenant's
    assert store.file(done["output_file_id"], tenant="b") is None
    assert [o["custom_id"] for o in _read_jsonl(store, done["output_file_id"])] == ["a", "b"]


_CRASHING_CHILD = """
import importlib.util, json, os, signal, sys
spec = importlib.util.spec_from_file_location("batchstore", sys.argv[1])
mod = sys.modules["batchstore"] = importlib.util.module_from_spec(spec)   # stdlib only: no torch to import
spec.loader.exec_module(mod)
store = mod.BatchStore(sys.argv[2], default_tenant=sys.argv[4])
batch_id = sys.argv[3]
for line_no in (1, 2, 3):
    store.record(batch_id, line_no, 200, {"n": line_no})
store._db.execute("BEGIN IMMEDIATE")       # a record under way when the process dies
store._db.execute("UPDATE lines SET status='done', response_status=200, response_body='{}' "
                  "WHERE batch_id=? AND line_no=4", (batch_id,))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_reopen_after_a_kill_keeps_committed_results_and_resumes_the_rest(tmp_path):
    path = tmp_path / "b.sqlite3"
    store = _make_store(path)
    batch_id = _make_batch(store, _jsonl(*(_line(f"r{i}") for i in range(6))))["id"]
    store.close()
    module = Path(__file__).resolve().parents[2] / "pools" / "batchstore.py"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASHING_CHILD), str(module), str(path), batch_id,
                           DEFAULT_TENANT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert Path(str(path) + "-wal").exists()                               # not checkpointed: a real crash image
    store = _make_store(path)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.unfinished_batch_ids() == [batch_id]
    assert [ln.line_no for ln in store.pending_lines(batch_id)] == [4, 5, 6]   # the uncommitted record rolled back
    assert not store.record(batch_id, 2, 200, {"n": "again"})
    for line_no in (4, 5, 6):
        assert store.record(batch_id, line_no, 200, {"n": line_no})
    output = _read_jsonl(store, store.finalize(batch_id)["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(6)]
    assert [o["response"]["body"]["n"] for o in output] == [1, 2, 3, 4, 5, 6]


_VERSION_1_SCHEMA = """
CREATE TABLE files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE batches (
    seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, metadata TEXT);
CREATE TABLE lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, method TEXT, url TEXT, body TEXT,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'error')),
    response_status INTEGER, response_body TEXT, error TEXT,
    PRIMARY KEY (batch_id, line_no));
CREATE INDEX lines_by_status ON lines (batch_id, status, response_status);
PRAGMA user_version=1;
"""


def _make_version_1_store(path: Path) -> None:
    """A store as the code before tenants wrote it: one input file and an in_progress batch, line 1
    answered, line 2 pending."""
    content = _jsonl(_line("old1"), _line("old2"))
    body = json.dumps(_line("x")["body"])
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(_VERSION_1_SCHEMA)
        db.execute("INSERT INTO files VALUES ('file-old', 'batch', 'in.jsonl', ?, 1700000000, ?)",
                   (len(content), content))
        db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, "
                   "in_progress_at) VALUES ('batch_old', 'file-old', ?, '24h', 'in_progress', 1700000000, 1700000000)",
                   (CHAT,))
        db.executemany("INSERT INTO lines VALUES ('batch_old', ?, ?, 'POST', ?, ?, ?, ?, ?, NULL)",
                       [(1, "old1", CHAT, body, "done", 200, json.dumps({"n": 1})),
                        (2, "old2", CHAT, body, "pending", None, None)])
        db.commit()


def test_a_version_1_store_is_migrated_and_its_rows_belong_to_the_default_tenant(tmp_path):
    path = tmp_path / "b.sqlite3"
    _make_version_1_store(path)
    store = _make_store(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        assert {row[1] for row in db.execute("PRAGMA table_info(files)")} >= {"id", "content", "tenant"}
    assert store.file("file-old", tenant=DEFAULT_TENANT)["bytes"] == len(_jsonl(_line("old1"), _line("old2")))
    assert store.file("file-old", tenant=OWNER) is None
    batch = store.batch("batch_old", tenant=DEFAULT_TENANT)
    assert batch["status"] == "in_progress" and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert store.batch_tenant("batch_old") == DEFAULT_TENANT and store.unfinished_batch_ids() == ["batch_old"]
    assert [b["id"] for b in store.list_batches(tenant=DEFAULT_TENANT)[0]] == ["batch_old"]
    assert [ln.custom_id for ln in store.pending_lines("batch_old")] == ["old2"]
    new = _make_batch(store, _jsonl(_line("n")))                         # new rows carry their own tenant
    assert store.list_batches(tenant=OWNER)[0][0]["id"] == new["id"]
    store.close()
    store = _make_store(path)                                            # opening again changes nothing
    assert store.batch_tenant("batch_old") == DEFAULT_TENANT and store.batch_tenant(new["id"]) == OWNER
    assert store.record("batch_old", 2, 200, {"n": 2})
    output = _read_jsonl(store, store.finalize("batch_old")["output_file_id"], tenant=DEFAULT_TENANT)
    assert [o["custom_id"] for o in output] == ["old1", "old2"]
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA user_version=3")                              # a newer store than this code reads
    with pytest.raises(RuntimeError, match="schema version 3, this code reads 2"):
        _make_store(path)
