"""pools.batchstore: parsing batch input, exactly-once results, output files, and reopening after a
process killed mid-transaction (SQLite in a temporary folder; no model, no event loop)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pools.batchstore import BatchInputError, BatchStore, parse_batch_input

CHAT = "/v1/chat/completions"


def _line(custom_id: str, url: str = CHAT, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}, **extra}


def _jsonl(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def _make_batch(store: BatchStore, content: bytes, endpoint: str = CHAT) -> dict:
    file = store.add_file(content, "in.jsonl", "batch")
    return store.create_batch(file["id"], endpoint, "24h", {"k": "v"})


def _read_jsonl(store: BatchStore, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.file_content(file_id).splitlines()]


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
    store = BatchStore(tmp_path / "b.sqlite3")
    file = store.add_file(_jsonl(_line("a")), "in.jsonl", "batch")
    cases = [((file["id"], "/v1/embeddings", "24h"), "endpoint"), ((file["id"], CHAT, "1h"), "completion_window"),
             (("file-none", CHAT, "24h"), "input_file_id"), ((file["id"], CHAT, "24h", {"k": 1}), "metadata.k")]
    for args, param in cases:
        with pytest.raises(BatchInputError) as info:
            store.create_batch(*args)
        assert info.value.param == param and str(info.value).startswith(param + ": ")
    empty = store.add_file(b"\n  \n", "empty.jsonl", "batch")
    with pytest.raises(BatchInputError, match="input_file_id: .* has no request lines"):
        store.create_batch(empty["id"], CHAT, "24h")
    with pytest.raises(BatchInputError, match="purpose: must be one of batch, got 'fine-tune'"):
        store.add_file(b"x", "x", "fine-tune")


def test_a_result_is_recorded_once_and_the_files_assembled_at_finalize(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
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
    assert store.batch(batch["id"])["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    store.begin_finalizing(batch["id"])
    assert store.batch(batch["id"])["status"] == "finalizing"
    done = store.finalize(batch["id"])
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    output, errors = _read_jsonl(store, done["output_file_id"]), _read_jsonl(store, done["error_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["choices"]) for o in output] == [("a", ["first"]), ("c", ["c"])]
    assert all(o["id"].startswith("batch_req_") and o["response"]["status_code"] == 200 and o["error"] is None
               and o["response"]["request_id"].startswith("req_") for o in output)
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == [(None, None),
                                                                                              ("b", 400)]
    assert errors[0]["error"]["code"] == "invalid_json_line" and errors[1]["error"] is None
    assert store.file(done["output_file_id"])["purpose"] == "batch_output"
    assert store.finalize(batch["id"]) == done                             # finalizing again: unchanged


def test_cancel_keeps_what_finished_and_list_pages_newest_first(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    ids = [_make_batch(store, _jsonl(_line("a"), _line("b")))["id"] for _ in range(5)]
    store.record(ids[0], 1, 200, {"ok": 1})
    assert store.cancel(ids[0])["status"] == "cancelling"
    cancelled = store.finalize(ids[0])
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] and cancelled["error_file_id"] is None
    assert [o["custom_id"] for o in _read_jsonl(store, cancelled["output_file_id"])] == ["a"]
    assert store.cancel(ids[0])["status"] == "cancelled"                  # not cancellable any more: unchanged
    page, more = store.list_batches(limit=2)
    assert [b["id"] for b in page] == ids[:2:-1][:2] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"])
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"])
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(BatchInputError, match="after: no batch 'batch_x'"):
        store.list_batches(after="batch_x")
    assert store.unfinished_batch_ids() == ids[1:]


_CRASHING_CHILD = """
import importlib.util, json, os, signal, sys
spec = importlib.util.spec_from_file_location("batchstore", sys.argv[1])
mod = sys.modules["batchstore"] = importlib.util.module_from_spec(spec)   # stdlib only: no torch to import
spec.loader.exec_module(mod)
store = mod.BatchStore(sys.argv[2])
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
    store = BatchStore(path)
    batch_id = _make_batch(store, _jsonl(*(_line(f"r{i}") for i in range(6))))["id"]
    store.close()
    module = Path(__file__).resolve().parents[2] / "pools" / "batchstore.py"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASHING_CHILD), str(module), str(path), batch_id],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert Path(str(path) + "-wal").exists()                               # not checkpointed: a real crash image
    store = BatchStore(path)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.unfinished_batch_ids() == [batch_id]
    assert [ln.line_no for ln in store.pending_lines(batch_id)] == [4, 5, 6]   # the uncommitted record rolled back
    assert not store.record(batch_id, 2, 200, {"n": "again"})
    for line_no in (4, 5, 6):
        assert store.record(batch_id, line_no, 200, {"n": line_no})
    output = _read_jsonl(store, store.finalize(batch_id)["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(6)]
    assert [o["response"]["body"]["n"] for o in output] == [1, 2, 3, 4, 5, 6]
