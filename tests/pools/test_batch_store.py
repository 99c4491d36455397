"""pools.store.batch_store: parsing batch input, exactly-once results, output files written in pieces and steps,
the output size limit, failed batches, storage errors that change nothing, each owner seeing only its
own files and batches, migrating version-1 and version-2 stores, and reopening after a process killed
mid-transaction (SQLite in a temporary folder; no model, no event loop)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pools.store import batch_files, batch_input
from pools.store.batch_files import result_file_ids
from pools.store.batch_input import (MAX_BATCH_LINE_BYTES, MAX_BATCH_LINES, BatchInputError, TooManyBatches,
                                     parse_batch_input)
from pools.store.schema import SCHEMA_VERSION, UNFINISHED_SQL
from pools.store.batch_store import STORAGE_ERRORS, BatchStore
from pools.tenants import DEFAULT_TENANT, Tenants, parse_tenants

CHAT = "/v1/chat/completions"
OWNER, TENANT = "key-a", "a"        # the owner and tenant of the tests that use one


def _line(custom_id: str, url: str = CHAT, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}, **extra}


def _jsonl(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def _make_store(path: Path) -> BatchStore:
    return BatchStore(path, default_tenant=DEFAULT_TENANT)


def _make_batch(store: BatchStore, content: bytes, endpoint: str = CHAT, owner: str = OWNER,
                tenant: str = TENANT) -> dict:
    file = store.add_file(content, "in.jsonl", "batch", owner=owner, tenant=tenant)
    return store.create_batch(file["id"], endpoint, "24h", {"k": "v"}, owner=owner, tenant=tenant)


def _read_jsonl(store: BatchStore, file_id: str | None, owner: str = OWNER) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in store.file_content(file_id, owner=owner).splitlines()]


def test_an_owner_has_at_most_max_unfinished_batches_counted_by_the_partial_index(tmp_path):
    """`create_batch(max_unfinished=2)`: an owner's third unfinished batch is refused (nothing stored),
    another owner's batches are not counted, nor a finished or cancelled one; the count reads the partial
    index, whose statuses are `batch_files.UNFINISHED`."""
    assert UNFINISHED_SQL == f"status IN ({', '.join(repr(s) for s in batch_files.UNFINISHED)})"
    store = _make_store(tmp_path / "b.db")
    file = store.add_file(_jsonl(_line("x")), "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    other = store.add_file(_jsonl(_line("y")), "in.jsonl", "batch", owner="key-b", tenant=TENANT)
    create = functools.partial(store.create_batch, file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT,
                               max_unfinished=2)
    first, second = create(), create()
    store.create_batch(other["id"], CHAT, "24h", owner="key-b", tenant=TENANT, max_unfinished=1)
    with pytest.raises(TooManyBatches) as info:
        create()
    assert (info.value.unfinished, info.value.limit) == (2, 2)
    assert len(store.list_batches(owner=OWNER)[0]) == 2
    store.record(first["id"], 1, 200, {"ok": True})
    store.finalize(first["id"])
    store.cancel(second["id"], owner=OWNER)
    third = create()          # the cancelling one still counts until it is finalized
    with pytest.raises(TooManyBatches):
        create()
    store.finalize(second["id"])
    assert create()["status"] == "in_progress" and third["status"] == "in_progress"
    plan = store._db.execute(f"EXPLAIN QUERY PLAN SELECT COUNT(*) FROM batches WHERE owner=? AND {UNFINISHED_SQL}",
                             (OWNER,)).fetchall()
    assert "unfinished_by_owner" in str(plan)


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


def test_a_line_with_an_integer_over_pythons_digit_limit_is_a_line_error():
    lines = parse_batch_input(_jsonl(_line("a"), b'{"custom_id": "b", "n": ' + b"1" * 5000 + b"}", _line("c")), CHAT)
    assert [(ln.custom_id, ln.error and ln.error["code"]) for ln in lines] == [
        ("a", None), (None, "invalid_json_line"), ("c", None)]


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Replace `module.name` (a function, or a generator function: then its items count) by one that counts."""
    counted, original = [], getattr(module, name)

    def counting(*args, **kwargs):
        counted.append(1)
        return original(*args, **kwargs)

    def counting_items(*args, **kwargs):
        for item in original(*args, **kwargs):
            counted.append(1)
            yield item
    monkeypatch.setattr(module, name, counting_items if inspect.isgeneratorfunction(original) else counting)
    return counted


def test_a_file_over_the_line_limit_is_refused_after_a_count_before_any_line_is_parsed(tmp_path, monkeypatch):
    store = _make_store(tmp_path / "b.sqlite3")
    parsed = _count_calls(monkeypatch, batch_input, "_parse_line")
    over = store.add_file(b"{}\n\n" * (MAX_BATCH_LINES + 1), "over.jsonl", "batch", owner=OWNER, tenant=TENANT)
    with pytest.raises(BatchInputError) as info:
        store.create_batch(over["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert info.value.param == "input_file_id" and str(info.value) == (
        f"input_file_id: file {over['id']!r} has more than {MAX_BATCH_LINES} request lines; a batch takes at most "
        f"{MAX_BATCH_LINES}")
    assert parsed == []                                                 # refused before any line was parsed
    counted = _count_calls(monkeypatch, batch_input, "_request_lines")
    many = store.add_file(b"{}\n" * (MAX_BATCH_LINES * 40), "many.jsonl", "batch", owner=OWNER, tenant=TENANT)
    with pytest.raises(BatchInputError, match="more than"):
        store.create_batch(many["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert (len(parsed), len(counted)) == (0, MAX_BATCH_LINES + 1)    # 2 million lines: the count stopped at the limit
    monkeypatch.setattr(batch_input, "MAX_BATCH_LINES", 3)
    for num_lines, accepted in [(3, True), (4, False)]:
        parsed.clear()
        content = b" \n\r\n".join(json.dumps(_line(f"r{i}")).encode() for i in range(num_lines)) + b"\n\t\n"
        file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
        with contextlib.nullcontext() if accepted else pytest.raises(BatchInputError, match="more than 3 request"):
            batch = store.create_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
            assert batch["request_counts"]["total"] == 3
        assert len(parsed) == (3 if accepted else 0)
    lines = parse_batch_input(b"\n  \x0b\n" + json.dumps(_line("a")).encode() + b"\r\n\n\t" + b"[1]", CHAT)
    assert [(ln.line_no, ln.custom_id, ln.error and ln.error["code"]) for ln in lines] == \
        [(3, "a", None), (5, None, "invalid_json_line")]                 # blank lines skipped, numbers kept
    store.check_integrity()


def test_an_input_file_read_in_pieces_of_any_size_gives_the_lines_of_the_whole(monkeypatch):
    """The lines of a file read a piece at a time are those of its whole bytes, wherever the pieces cut it (a line
    over the bound among them, blank or not, ending in a later piece or at the end of the file)."""
    monkeypatch.setattr(batch_input, "MAX_BATCH_LINE_BYTES", 8)
    content = (b"\n  \x0b\n{}\r\n" + b" " * 20 + b"\n" + b" " * 12 + b"x" + b" " * 12 + b"\n\t[1]\n"
               + b"0123456789abcdef\n\n12345678\n123456789\n" + b" " * 9 + b"\n" + b"y" * 30)
    whole = [(i + 1, line if len(line) <= 8 else None, len(line))
             for i, line in enumerate(content.split(b"\n")) if line.strip()]
    assert [n for n, _, _ in whole] == [3, 5, 6, 7, 9, 10, 12] and whole[1] == (5, None, 25)
    for size in range(1, len(content) + 1):
        pieces = [content[i:i + size] for i in range(0, len(content), size)]
        assert list(batch_input._file_lines(pieces)) == whole, size


def test_a_batch_is_created_from_its_file_a_piece_at_a_time(tmp_path, monkeypatch):
    """`create_batch` reads the input file in pieces of CHUNK_BYTES (64 KiB here, as the pieces files are kept in)
    and stores each line as it is parsed: the memory it takes does not grow with the file (it held the whole file,
    copied, and every parsed line: four times the file, four times the memory)."""
    import tracemalloc

    from pools.store import batch_store

    monkeypatch.setattr(batch_store, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 64 << 10)
    store = _make_store(tmp_path / "b.sqlite3")
    reads = _count_calls(monkeypatch, batch_store, "read_chunks")
    peaks = []
    for num_lines in (200, 800):
        lines = [{**_line(f"r{i}", "/v1/completions"), "body": {"model": "m", "prompt": list(range(500))}}
                 for i in range(num_lines)]
        content = _jsonl(*lines)
        file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
        reads.clear()
        tracemalloc.start()
        try:
            batch = store.create_batch(file["id"], "/v1/completions", "24h", owner=OWNER, tenant=TENANT)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert len(reads) == 2 * -(-len(content) // (64 << 10))   # counted, then parsed: a piece a read
        assert batch["request_counts"]["total"] == num_lines
        assert [ln.body for ln in store.pending_lines(batch["id"], limit=2000)] == [ln["body"] for ln in lines]
    assert len(content) > 1 << 20 and peaks[1] < 1.3 * peaks[0] and peaks[1] < len(content) / 4, peaks


def test_strings_sqlite_cannot_hold_are_refused_or_cleaned_never_an_error_of_sqlite(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    content = _jsonl({**_line("x"), "custom_id": "\ud800"}, {**_line("x"), "custom_id": "y\udfff", "method": "GET"},
                     _line("ok"))
    lines = parse_batch_input(content, CHAT)
    assert [(ln.custom_id, ln.error and ln.error["code"]) for ln in lines] == \
        [(None, "invalid_custom_id"), (None, "invalid_custom_id"), ("ok", None)]
    assert lines[0].error["message"].startswith("custom_id: must be a non-empty string of valid Unicode")
    batch = _make_batch(store, content)
    assert store.record(batch["id"], 3, 200, {"text": "\ud800"})
    done = store.finalize(batch["id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in _read_jsonl(store, done["error_file_id"])] == \
        [(None, "invalid_custom_id")] * 2
    assert _read_jsonl(store, done["output_file_id"])[0]["response"]["body"] == {"text": "\ud800"}
    assert store.file("\ud800", owner=OWNER) is None and store.file_content("\ud800", owner=OWNER) is None
    with pytest.raises(BatchInputError, match="^input_file_id: no file '\\\\ud800'$"):
        store.create_batch("\ud800", CHAT, "24h", owner=OWNER, tenant=TENANT)
    # a URL's byte past UTF-8 reaches an id as a lone surrogate (aiohttp decodes with surrogateescape)
    assert store.batch("batch_\udcff", owner=OWNER) is None and store.cancel("batch_\udcff", owner=OWNER) is None
    with pytest.raises(BatchInputError, match="^after: no batch '\\\\udcff'$"):
        store.list_batches(after="\udcff", owner=OWNER)
    names = {"a\x00b\udcff\x1b[31m.jsonl": "ab\ufffd[31m.jsonl", "\u00e9" * 300: "\u00e9" * 255, "\x00": "upload.jsonl",
             None: "upload.jsonl"}
    for sent, kept in names.items():
        file = store.add_file(b"{}\n", sent, "batch", owner=OWNER, tenant=TENANT)
        assert file["filename"] == store.file(file["id"], owner=OWNER)["filename"] == kept
    store.check_integrity()


def test_create_refuses_bad_arguments_naming_the_field(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    file = store.add_file(_jsonl(_line("a")), "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    cases = [((file["id"], "/v1/embeddings", "24h"), "endpoint"), ((file["id"], CHAT, "1h"), "completion_window"),
             (("file-none", CHAT, "24h"), "input_file_id"), ((file["id"], CHAT, "24h", {"k": 1}), "metadata.k")]
    for args, param in cases:
        with pytest.raises(BatchInputError) as info:
            store.create_batch(*args, owner=OWNER, tenant=TENANT)
        assert info.value.param == param and str(info.value).startswith(param + ": ")
    empty = store.add_file(b"\n  \n", "empty.jsonl", "batch", owner=OWNER, tenant=TENANT)
    with pytest.raises(BatchInputError, match="input_file_id: .* has no request lines"):
        store.create_batch(empty["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    with pytest.raises(BatchInputError, match="purpose: must be one of batch, got 'fine-tune'"):
        store.add_file(b"x", "x", "fine-tune", owner=OWNER, tenant=TENANT)


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
    assert store.batch(batch["id"], owner=OWNER)["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    store.begin_finalizing(batch["id"])
    assert store.batch(batch["id"], owner=OWNER)["status"] == "finalizing"
    done = store.finalize(batch["id"])
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    output, errors = _read_jsonl(store, done["output_file_id"]), _read_jsonl(store, done["error_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["choices"]) for o in output] == [("a", ["first"]), ("c", ["c"])]
    assert all(o["id"].startswith("batch_req_") and o["response"]["status_code"] == 200 and o["error"] is None
               and o["response"]["request_id"].startswith("req_") for o in output)
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == [(None, None),
                                                                                              ("b", 400)]
    assert errors[0]["error"]["code"] == "invalid_json_line" and errors[1]["error"] is None
    assert store.file(done["output_file_id"], owner=OWNER)["purpose"] == "batch_output"   # the batch's owner's
    assert (done["output_file_id"], done["error_file_id"]) == result_file_ids(batch["id"])
    assert store.finalize(batch["id"]) == done                             # finalizing again: unchanged
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert _lines_kept(tmp_path / "b.sqlite3", batch["id"]) == 0   # the files hold them: not kept twice
    store.check_integrity()


def test_a_page_of_pending_lines_is_bounded_by_its_bodies_bytes(tmp_path):
    """A runner reads pending lines a page at a time, every body parsed before the first starts: 256 lines of a
    megabyte each were a quarter gigabyte of text (twice that as objects) per running batch. A page stops once
    its bodies pass `max_bytes`, one line at least; the next page goes on after it."""
    store = _make_store(tmp_path / "b.sqlite3")
    big = "x" * 3000
    lines = [_line(f"r{i}", **{"body": {"model": "m", "messages": [{"role": "user", "content": big}]}})
             for i in range(10)]
    batch = _make_batch(store, _jsonl(*lines))
    first = store.pending_lines(batch["id"], max_bytes=10_000)
    assert [ln.custom_id for ln in first] == ["r0", "r1", "r2"]                  # a fourth would pass 10,000
    assert [ln.custom_id for ln in store.pending_lines(batch["id"], first[-1].line_no, max_bytes=10)] == ["r3"]
    assert len(store.pending_lines(batch["id"])) == 10                           # the default: 8 MiB a page
    assert store.pending_lines(batch["id"], after_line_no=10) == []


def _lines_kept(path: Path, batch_id: str) -> int:
    """How many lines of the batch the store still keeps (a finished one's are in its files)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT count(*) FROM lines WHERE batch_id=?", (batch_id,)).fetchone()[0]


def test_cancel_keeps_what_finished_and_list_pages_newest_first(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    ids = [_make_batch(store, _jsonl(_line("a"), _line("b")))["id"] for _ in range(5)]
    store.record(ids[0], 1, 200, {"ok": 1})
    assert store.cancel(ids[0], owner=OWNER)["status"] == "cancelling"
    cancelled = store.finalize(ids[0])
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] and cancelled["error_file_id"] is None
    assert [o["custom_id"] for o in _read_jsonl(store, cancelled["output_file_id"])] == ["a"]
    assert store.cancel(ids[0], owner=OWNER)["status"] == "cancelled"   # not cancellable any more: unchanged
    page, more = store.list_batches(limit=2, owner=OWNER)
    assert [b["id"] for b in page] == ids[:2:-1][:2] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"], owner=OWNER)
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches(limit=2, after=page[-1]["id"], owner=OWNER)
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(BatchInputError, match="after: no batch 'batch_x'"):
        store.list_batches(after="batch_x", owner=OWNER)
    assert store.unfinished_batch_ids() == ids[1:]
    store.check_integrity()


def test_a_batch_past_its_completion_window_expires_with_what_it_answered(tmp_path):
    """`expire_next`: a batch still running 24 h after it was created ends `expired` (`expired_at`: when its window
    ended, shown once it is expired): the lines answered are in its output file, the others (one in flight
    included: its late answer is not kept) in its error file as `batch_expired`, as OpenAI's; a cancelling or
    finished batch ends as it was going to, and so does one whose lines are all answered (completed)."""
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(*(_line(x) for x in "abc")))
    cancelling, finished, answered = (_make_batch(store, _jsonl(_line("d"))) for _ in range(3))
    store.cancel(cancelling["id"], owner=OWNER)
    for done in (finished, answered):
        store.record(done["id"], 1, 200, {"ok": 1})
    store.begin_finalizing(finished["id"])          # `answered` is still in_progress: its run was cut before
    created, window = batch["created_at"], batch_input.WINDOW_SECONDS["24h"]
    assert batch["expires_at"] == created + window and batch["expired_at"] is None
    store.record(batch["id"], 1, 200, {"ok": 1})
    store.mark_sent(batch["id"], 2)                                   # b is in flight
    assert store.expire_next(now=created + window - 1) is None
    assert store.expire_next(now=created + window + 5) == batch["id"]
    assert store.batch(batch["id"], owner=OWNER)["expired_at"] is None              # finalizing: not yet
    assert store.expire_next(now=created + window + 9) is None          # once; and never `answered`
    assert not store.record(batch["id"], 2, 200, {"late": 1})
    expired = store.finalize(batch["id"])
    assert (expired["status"], expired["expired_at"], expired["completed_at"]) == ("expired", created + window, None)
    assert expired["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [o["custom_id"] for o in _read_jsonl(store, expired["output_file_id"])] == ["a"]
    errors = _read_jsonl(store, expired["error_file_id"])
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [("b", None, "batch_expired"),
                                                                                     ("c", None, "batch_expired")]
    assert [store.finalize(b["id"])["status"] for b in (cancelling, finished, answered)] == ["cancelled", "completed",
                                                                                              "completed"]
    store.check_integrity()


def test_an_owner_sees_only_its_own_files_and_batches_whatever_their_tenant(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(_line("a"), _line("b")))
    file_id = batch["input_file_id"]
    assert store.batch_tenant(batch["id"]) == TENANT and store.batch_tenant("batch_x") is None
    assert store.batch_status(batch["id"]) == "in_progress" and store.batch_status("batch_x") is None
    for owner in ("key-b", TENANT, DEFAULT_TENANT):         # another key of the same tenant too: as if there were none
        assert store.file(file_id, owner=owner) is None and store.file_content(file_id, owner=owner) is None
        assert store.batch(batch["id"], owner=owner) is None and store.cancel(batch["id"], owner=owner) is None
        assert store.list_batches(owner=owner) == ([], False)
        with pytest.raises(BatchInputError, match=f"after: no batch '{batch['id']}'"):
            store.list_batches(after=batch["id"], owner=owner)
        with pytest.raises(BatchInputError, match=f"input_file_id: no file '{file_id}'"):
            store.create_batch(file_id, CHAT, "24h", owner=owner, tenant=TENANT)
    assert store.batch(batch["id"], owner=OWNER)["status"] == "in_progress"   # the other cancels changed nothing
    own = _make_batch(store, _jsonl(_line("x")), owner="key-b")              # same tenant, another key
    assert store.batch_tenant(own["id"]) == TENANT
    assert [b["id"] for b in store.list_batches(owner="key-b")[0]] == [own["id"]]
    assert [b["id"] for b in store.list_batches(owner=OWNER)[0]] == [batch["id"]]
    for line_no in (1, 2):
        store.record(batch["id"], line_no, 200, {"n": line_no})
    done = store.finalize(batch["id"])                                   # the output is the batch's owner's
    assert store.file(done["output_file_id"], owner="key-b") is None
    assert [o["custom_id"] for o in _read_jsonl(store, done["output_file_id"])] == ["a", "b"]
    store.check_integrity()


_CRASHING_CHILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from pools.store.batch_store import BatchStore   # stdlib only: no torch to import
assert "torch" not in sys.modules
store = BatchStore(sys.argv[2], default_tenant=sys.argv[4])
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
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASHING_CHILD), str(root), str(path), batch_id,
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
    store.check_integrity()


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
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert {row[1] for row in db.execute("PRAGMA table_info(files)")} >= {"id", "content", "tenant", "owner"}
    assert store.file("file-old", owner=DEFAULT_TENANT)["bytes"] == len(_jsonl(_line("old1"), _line("old2")))
    assert store.file("file-old", owner=OWNER) is None
    batch = store.batch("batch_old", owner=DEFAULT_TENANT)
    assert batch["status"] == "in_progress" and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert store.batch_tenant("batch_old") == DEFAULT_TENANT and store.unfinished_batch_ids() == ["batch_old"]
    assert [b["id"] for b in store.list_batches(owner=DEFAULT_TENANT)[0]] == ["batch_old"]
    assert [ln.custom_id for ln in store.pending_lines("batch_old")] == ["old2"]
    new = _make_batch(store, _jsonl(_line("n")))                         # new rows carry their own owner
    assert store.list_batches(owner=OWNER)[0][0]["id"] == new["id"]
    store.close()
    store = _make_store(path)                                            # opening again changes nothing
    assert store.batch_tenant("batch_old") == DEFAULT_TENANT and store.batch_tenant(new["id"]) == TENANT
    assert store.record("batch_old", 2, 200, {"n": 2})
    output = _read_jsonl(store, store.finalize("batch_old")["output_file_id"], owner=DEFAULT_TENANT)
    assert [o["custom_id"] for o in output] == ["old1", "old2"]
    store.check_integrity()
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")          # a newer store than this code reads
    with pytest.raises(RuntimeError, match=f"schema version {SCHEMA_VERSION + 1}, this code reads {SCHEMA_VERSION}"):
        _make_store(path)


_VERSION_2_SCHEMA = (_VERSION_1_SCHEMA   # version 2 added an owning `tenant` to files and batches
                     .replace("content BLOB NOT NULL);", "content BLOB NOT NULL, tenant TEXT NOT NULL);")
                     .replace("metadata TEXT);", "metadata TEXT, tenant TEXT NOT NULL);")
                     .replace("PRAGMA user_version=1;", "CREATE INDEX batches_by_tenant ON batches (tenant, seq);\n"
                                                        "PRAGMA user_version=2;"))
_V2_TENANTS = ("a", "team", DEFAULT_TENANT, "key-" + hashlib.sha256(b"sk-x").hexdigest()[:8], "gone",
               "key-00000000")   # tenants that owned rows of a version-2 store


def _make_version_2_store(path: Path) -> dict[str, bytes]:
    """A store as the code with tenant owners wrote it: per tenant of _V2_TENANTS, an input file and a
    completed batch of one line with its output file in `files.content`. {tenant: input content}."""
    contents = {}
    body = json.dumps(_line("x")["body"])
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(_VERSION_2_SCHEMA)
        for i, tenant in enumerate(_V2_TENANTS):
            content = contents[tenant] = _jsonl(*(_line(f"{tenant}-{n}") for n in range(50)))
            db.executemany("INSERT INTO files VALUES (?, 'batch', 'in.jsonl', ?, 1700000000, ?, ?)",
                           [(f"file-in{i}", len(content), content, tenant),
                            (f"file-out{i}", 3, b"ok\n", tenant)])
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, "
                       "completed_at, output_file_id, tenant) VALUES (?, ?, ?, '24h', 'completed', 1700000000, "
                       "1700000001, ?, ?)", (f"batch_{i}", f"file-in{i}", CHAT, f"file-out{i}", tenant))
            db.execute("INSERT INTO lines VALUES (?, 1, 'c', 'POST', ?, ?, 'done', 200, '{}', NULL)",
                       (f"batch_{i}", CHAT, body))
        db.commit()
    return contents


def test_a_version_2_store_is_migrated_keeping_each_row_reachable_where_the_config_tells_by_whom(tmp_path):
    path = tmp_path / "b.sqlite3"
    contents = _make_version_2_store(path)
    tenants = Tenants(parse_tenants({"a": {"api_keys": ["sk-a"]}, "team": {"api_keys": ["sk-t1", "sk-t2"],
                                                                          "share_files": True}}))
    legacy = functools.partial(tenants.legacy_owner, api_keys=["sk-a", "sk-t1", "sk-t2", "sk-x"])
    store = BatchStore(path, default_tenant=DEFAULT_TENANT, legacy_owner=legacy)
    expected = {"a": tenants.owner("sk-a"), "team": "tenant:team", "default": DEFAULT_TENANT,
                "gone": "tenant:gone", "key-00000000": "tenant:key-00000000"}
    expected["key-" + hashlib.sha256(b"sk-x").hexdigest()[:8]] = tenants.owner("sk-x")
    assert expected["team"] == tenants.owner("sk-t2") and expected["a"].startswith("key-")
    for i, tenant in enumerate(_V2_TENANTS):
        owner = expected[tenant]
        assert store.file(f"file-in{i}", owner=owner)["bytes"] == len(contents[tenant])
        assert store.file_content(f"file-in{i}", owner=owner) == contents[tenant]
        assert store.file_content(f"file-in{i}", owner=owner, offset=5, size=40) == contents[tenant][5:45]
        assert store.file_content(f"file-out{i}", owner=owner) == b"ok\n"
        assert store.batch(f"batch_{i}", owner=owner)["output_file_id"] == f"file-out{i}"
        assert [b["id"] for b in store.list_batches(owner=owner)[0]] == [f"batch_{i}"]
        assert store.batch_tenant(f"batch_{i}") == tenant                # the tenant still runs it
        assert store.file(f"file-in{i}", owner=tenant if tenant != "default" else "key-x") is None
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("SELECT count(*) FROM files WHERE owner IS NOT NULL").fetchone()[0] == 0   # not rewritten
        legacy_rows = dict(db.execute("SELECT tenant, owner FROM legacy_owners"))
    assert legacy_rows == expected
    store = BatchStore(path, default_tenant=DEFAULT_TENANT)              # the mapping was written once
    assert store.file("file-in0", owner=expected["a"]) is not None and store.batch("batch_1", owner="tenant:team")
    batch = _make_batch(store, contents["a"], owner=expected["a"], tenant="a")   # an old input file still serves
    assert batch["request_counts"]["total"] == 50
    store.check_integrity()


def test_oversized_lines_and_answers_are_errors_of_their_line(tmp_path, monkeypatch):
    big = {**_line("big"), "body": {"messages": [{"role": "user", "content": "x" * MAX_BATCH_LINE_BYTES}]}}
    lines = parse_batch_input(_jsonl(_line("a"), big, _line("b")), CHAT)
    assert [ln.error and ln.error["code"] for ln in lines] == [None, "line_too_large", None]
    assert lines[1].error["message"].startswith("line 2: ") and lines[1].error["line"] == 2
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(_line("a"), big, _line("b")))
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    monkeypatch.setattr(batch_files, "MAX_OUTPUT_FILE_BYTES", 1000)
    assert store.record(batch["id"], 1, 200, {"text": "y" * 2000})       # not kept: the line's error says why
    assert store.record(batch["id"], 3, 503, {"error": {"message": "down"}},
                        error={"code": "retries_exhausted", "message": "gave up"})
    done = store.finalize(batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = _read_jsonl(store, done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == \
        [("a", "response_too_large", 1), (None, "line_too_large", 2), ("b", "retries_exhausted", 3)]
    assert errors[0]["response"] == {"status_code": 200, "request_id": errors[0]["response"]["request_id"],
                                     "body": None}
    assert errors[2]["response"]["status_code"] == 503 and errors[2]["response"]["body"]["error"]["message"] == "down"
    assert done["output_file_id"] is None
    store.check_integrity()


def test_files_are_kept_in_pieces_and_read_a_range_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 10)
    store = _make_store(tmp_path / "b.sqlite3")
    content = bytes(range(256)) * 3
    file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    assert file["bytes"] == len(content) and store.file_content(file["id"], owner=OWNER) == content
    for offset, size in [(0, 10), (5, 10), (9, 1), (10, 25), (700, 500), (767, 1), (768, 5), (0, 0)]:
        assert store.file_content(file["id"], owner=OWNER, offset=offset, size=size) == content[offset:offset + size]
    with contextlib.closing(sqlite3.connect(tmp_path / "b.sqlite3")) as db:
        sizes = [row[0] for row in db.execute("SELECT length(data) FROM file_chunks WHERE file_id=?", (file["id"],))]
    assert max(sizes) == 10 and sum(sizes) == len(content)
    store.check_integrity()
    with contextlib.closing(sqlite3.connect(tmp_path / "b.sqlite3")) as db, db:
        db.execute("DELETE FROM file_chunks WHERE file_id=? AND start=20", (file["id"],))
    with pytest.raises(AssertionError, match=r"'file bytes \(id, bytes, stored\)': \[\('file-\w+', 768, 758\)\], "
                                             r"'gaps between pieces': \[\('file-\w+', 10, 30\)\]"):
        store.check_integrity()


def _answered_batch(store: BatchStore, num_lines: int) -> str:
    batch = _make_batch(store, _jsonl(*(_line(f"r{i}") for i in range(num_lines))))
    for line_no in range(1, num_lines + 1):
        status = 200 if line_no % 3 else 400
        store.record(batch["id"], line_no, status, {"n": line_no, "text": "t" * (line_no % 7) * 9})
    store.begin_finalizing(batch["id"])
    return batch["id"]


def _without_ids(line: dict) -> dict:
    """An output line without the ids derived from its batch's id."""
    return {**line, "id": None, "response": {**line["response"], "request_id": None}}


def test_finalize_writes_the_files_in_steps_and_a_crash_between_or_within_steps_changes_nothing(tmp_path,
                                                                                                monkeypatch):
    reference = _make_store(tmp_path / "ref.sqlite3")
    ref_id = _answered_batch(reference, 60)
    ref = reference.finalize(ref_id)                                     # in one step: the default sizes
    want = (_read_jsonl(reference, ref["output_file_id"]), _read_jsonl(reference, ref["error_file_id"]))
    assert len(want[0]) == 40 and len(want[1]) == 20
    want = [[_without_ids(line) for line in lines] for lines in want]
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 64)
    monkeypatch.setattr(batch_files, "FINALIZE_STEP_BYTES", 500)
    path = tmp_path / "b.sqlite3"
    store = _make_store(path)
    batch_id = _answered_batch(store, 60)
    assert store.finalize_step(batch_id) is None and store.finalize_step(batch_id) is None
    assert store.batch_status(batch_id) == "finalizing"
    store.check_integrity()                                              # pieces of files not added yet: allowed
    store.close()                                                        # the process ends between two steps
    store = _make_store(path)
    assert store.unfinished_batch_ids() == [batch_id]
    writes = []

    def flush_then_fail(self):
        writes.append(1)
        if len(writes) == 3:
            raise sqlite3.OperationalError("database or disk is full")
        original(self)

    original = batch_files.ChunkWriter._flush
    monkeypatch.setattr(batch_files.ChunkWriter, "_flush", flush_then_fail)
    with pytest.raises(sqlite3.OperationalError):                       # a step that fails half-way: rolled back
        while store.finalize_step(batch_id) is None:
            pass
    done = store.finalize(batch_id)
    assert done["status"] == "completed" and (done["output_file_id"], done["error_file_id"]) == \
        result_file_ids(batch_id)
    got = [[_without_ids(line) for line in _read_jsonl(store, done[key])]
           for key in ("output_file_id", "error_file_id")]
    assert got == want
    assert store.file(done["output_file_id"], owner=OWNER)["bytes"] == len(store.file_content(done["output_file_id"],
                                                                                              owner=OWNER))
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT max(length(data)) FROM file_chunks").fetchone()[0] <= 64
        assert db.execute("SELECT count(*) FROM finalizing").fetchone()[0] == 0
    store.check_integrity()


def test_answers_past_a_full_output_file_become_errors_and_the_ones_that_fit_are_kept(tmp_path, monkeypatch):
    """Every line ran: the answers that fit the output file are kept there, in order; each later one is an
    error entry (`output_too_large`, its status without its body), counted failed, in the error file beside
    the answers that were errors; the batch completes. Over finalize steps of a few lines each."""
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 64)
    monkeypatch.setattr(batch_files, "FINALIZE_STEP_BYTES", 700)
    monkeypatch.setattr(batch_files, "MAX_OUTPUT_FILE_BYTES", 3000)
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(*(_line(f"r{i}") for i in range(12))))
    for line_no in range(1, 13):
        store.record(batch["id"], line_no, 400 if line_no == 2 else 200, {"n": line_no, "text": "t" * 300})
    store.begin_finalizing(batch["id"])
    done = store.finalize(batch["id"])
    output, errors = _read_jsonl(store, done["output_file_id"]), _read_jsonl(store, done["error_file_id"])
    kept = [line["custom_id"] for line in output]
    assert done["status"] == "completed" and 3 <= len(kept) < 11
    assert kept == [f"r{i}" for i in (0, *range(2, len(kept) + 1))]
    overflow = [e for e in errors if e["error"] is not None]
    assert [e["custom_id"] for e in errors] == ["r1"] + [f"r{i}" for i in range(len(kept) + 1, 12)]
    assert len(overflow) == 11 - len(kept) and all(e["error"]["code"] == "output_too_large" for e in overflow)
    assert all(e["response"]["status_code"] == 200 and e["response"]["body"] is None for e in overflow)
    assert overflow[0]["error"]["line"] == len(kept) + 2 and "output file was full (3000 bytes" in \
        overflow[0]["error"]["message"]
    assert done["request_counts"] == {"total": 12, "completed": len(kept), "failed": 12 - len(kept)}
    assert max(len(store.file_content(f, owner=OWNER)) for f in (done["output_file_id"], done["error_file_id"])) \
        <= 3000
    store.check_integrity()


def test_an_error_file_past_the_limit_fails_the_batch_and_keeps_nothing_of_it(tmp_path, monkeypatch):
    """Answers past a full output file go to the error file as short entries; should even that be full, the
    batch fails."""
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 64)
    monkeypatch.setattr(batch_files, "FINALIZE_STEP_BYTES", 300)
    monkeypatch.setattr(batch_files, "MAX_OUTPUT_FILE_BYTES", 2000)
    path = tmp_path / "b.sqlite3"
    store = _make_store(path)
    batch_id = _answered_batch(store, 60)
    assert store.finalize_step(batch_id) is None                         # some pieces written, then the limit
    done = store.finalize(batch_id)
    assert done["status"] == "failed" and done["failed_at"] and done["output_file_id"] is None
    assert done["completed_at"] is None and done["request_counts"]["total"] == 60
    [error] = done["errors"]["data"]
    assert done["errors"]["object"] == "list" and error["code"] == "output_too_large" and error["param"] is None
    assert "2000 bytes" in error["message"] and error["line"] is None
    assert store.finalize(batch_id) == done and store.fail(batch_id, "storage_error", "x") == done   # final
    assert store.unfinished_batch_ids() == []
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT count(*) FROM file_chunks WHERE file_id IN (?, ?)",
                          result_file_ids(batch_id)).fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM finalizing").fetchone()[0] == 0
    assert _lines_kept(path, batch_id) == 0
    store.check_integrity()


class _FailingCommits:
    """The store's connection, whose next `fail` COMMITs raise as a full disk does."""

    def __init__(self, db: sqlite3.Connection, fail: int) -> None:
        self.db, self.fail = db, fail

    def __getattr__(self, name):
        return getattr(self.db, name)

    def execute(self, sql, *args):
        if sql == "COMMIT" and self.fail:
            self.fail -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)


def test_a_storage_error_changes_nothing_and_a_batch_can_be_failed_with_a_reason(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    batch = _make_batch(store, _jsonl(_line("a"), _line("b"), b"not json"))
    store._db = _FailingCommits(store._db, fail=1)
    assert isinstance(sqlite3.OperationalError("x"), STORAGE_ERRORS)
    with pytest.raises(STORAGE_ERRORS):
        store.record(batch["id"], 1, 200, {"n": 1})
    assert not store._db.in_transaction                                  # rolled back, the connection usable
    assert [ln.line_no for ln in store.pending_lines(batch["id"])] == [1, 2]
    assert store.record(batch["id"], 1, 200, {"n": 1})                  # tried again: recorded once
    failed = store.fail(batch["id"], "storage_error", "the batch store failed 6 times in a row: disk full")
    assert failed["status"] == "failed" and failed["failed_at"] and failed["output_file_id"] is None
    assert failed["request_counts"] == {"total": 3, "completed": 0, "failed": 0}   # no file holds lines 1 and 3
    assert failed["errors"] == {"object": "list", "data": [{"code": "storage_error", "param": None, "line": None,
                                                            "message": "the batch store failed 6 times in a row: "
                                                                       "disk full"}]}
    assert store.batch(batch["id"], owner=OWNER) == failed and store.unfinished_batch_ids() == []
    assert store.fail("batch_x", "storage_error", "x") is None
    store.check_integrity()


def test_files_expire_and_deleted_files_are_gone_at_once_while_their_batch_keeps_its_lines(tmp_path, monkeypatch):
    path = tmp_path / "b.sqlite3"
    store = _make_store(path)
    content = _jsonl(_line("a"), _line("b"))
    kept = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=DEFAULT_TENANT)
    assert kept["expires_at"] == kept["created_at"] + 30 * 86400            # OpenAI's default for a batch file
    hour = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=DEFAULT_TENANT,
                          expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour["expires_at"] == hour["created_at"] + 3600
    for policy, param in (({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
                          ({"anchor": "created_at", "seconds": True}, "expires_after.seconds"),
                          ({"anchor": "now", "seconds": 3600}, "expires_after.anchor"),
                          ({"seconds": 3600}, "expires_after"), ("1h", "expires_after")):
        with pytest.raises(BatchInputError) as bad:
            store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=DEFAULT_TENANT, expires_after=policy)
        assert bad.value.param == param, policy
    batch = store.create_batch(kept["id"], CHAT, "24h", owner=OWNER, tenant=DEFAULT_TENANT,
                               output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert not store.delete_file(kept["id"], owner="key-other")              # another owner's: as unknown
    assert store.delete_file(kept["id"], owner=OWNER) and not store.delete_file(kept["id"], owner=OWNER)
    assert store.file(kept["id"], owner=OWNER) is None and store.file_content(kept["id"], owner=OWNER) is None
    for ln in store.pending_lines(batch["id"]):                              # the batch runs on without its file
        store.record(batch["id"], ln.line_no, 200, {"choices": [ln.custom_id]})
    store.begin_finalizing(batch["id"])
    done = store.finalize(batch["id"])
    output = store.file(done["output_file_id"], owner=OWNER)
    assert done["input_file_id"] == kept["id"] and output["expires_at"] == output["created_at"] + 7200
    store.check_integrity()

    later = time.time() + 3601                                               # an hour on: `hour` has expired
    monkeypatch.setattr(time, "time", lambda: later)
    assert store.file(hour["id"], owner=OWNER) is None and store.file_content(hour["id"], owner=OWNER) is None
    with pytest.raises(BatchInputError, match="input_file_id"):
        store.create_batch(hour["id"], CHAT, "24h", owner=OWNER, tenant=DEFAULT_TENANT)
    assert not store.delete_file(hour["id"], owner=OWNER)
    assert store.purge_expired() == 1 and store.purge_expired() == 0
    assert store.file(done["output_file_id"], owner=OWNER) is not None      # 2 hours: not yet
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT count(*) FROM file_chunks WHERE file_id IN (?, ?)",
                          (kept["id"], hour["id"])).fetchone()[0] == 0
    store.check_integrity()


def test_a_batch_is_created_in_steps_each_its_own_transaction_and_the_store_serves_others_between(tmp_path):
    """One transaction parsed and stored a file of 200 MB: it held the write lock 7 s, past another connection's
    busy timeout (a kept Response was not kept), and the store's one thread as long. A batch is `validating`
    while its lines are stored a step at a time; nothing runs it before it starts; between steps the lock is free."""
    from pools.store.response_store import ResponseStore

    store = _make_store(tmp_path / "b.sqlite3")
    other = ResponseStore(tmp_path / "b.sqlite3")
    content = _jsonl(*(_line(f"r{i}") for i in range(25)))
    file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    batch_id, lines = store.begin_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert store.batch(batch_id, owner=OWNER)["status"] == "validating" and store.unfinished_batch_ids() == []
    steps = 1
    while store.add_lines(batch_id, lines, limit=10):
        steps += 1
        other._db.execute("BEGIN IMMEDIATE")   # the write lock is free between steps (busy: OperationalError)
        other._db.execute("ROLLBACK")
        assert store.batch(batch_id, owner=OWNER)["request_counts"]["total"] == 0   # as OpenAI's, until it runs
    assert steps == 3
    batch = store.start_batch(batch_id, owner=OWNER)
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 25
    assert store.unfinished_batch_ids() == [batch_id]
    assert [ln.line_no for ln in store.pending_lines(batch_id, limit=100)] == list(range(1, 26))
    # bodies bound a step too: one line past max_bytes ends it
    batch_id, lines = store.begin_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert store.add_lines(batch_id, lines, max_bytes=1)
    assert store._db.execute("SELECT COUNT(*) FROM lines WHERE batch_id=?", (batch_id,)).fetchone()[0] == 1
    other.close()


def test_a_batch_cancelled_or_its_file_deleted_while_it_is_created_and_one_a_stop_interrupted(tmp_path):
    store = _make_store(tmp_path / "b.sqlite3")
    content = _jsonl(*(_line(f"r{i}") for i in range(30)))
    file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    batch_id, lines = store.begin_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert store.add_lines(batch_id, lines, limit=10)
    assert store.cancel(batch_id, owner=OWNER)["status"] == "cancelling"
    assert not store.add_lines(batch_id, lines, limit=10)          # stores no more, and is not started
    assert store.start_batch(batch_id, owner=OWNER)["status"] == "cancelling"
    assert store.batch(batch_id, owner=OWNER)["request_counts"]["total"] == 10
    # the input file deleted meanwhile: a 400 naming it, the batch gone as if never made
    calls = 0
    add_lines = store.add_lines

    def delete_after_first(batch, pending, limit=10, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            store.delete_file(file["id"], owner=OWNER)
        return add_lines(batch, pending, limit=limit, **kwargs)

    store.add_lines = delete_after_first
    before = {b["id"] for b in store.list_batches(100, owner=OWNER)[0]}
    with pytest.raises(BatchInputError, match="deleted while the batch was being created") as raised:
        store.create_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    assert raised.value.param == "input_file_id" and {b["id"] for b in store.list_batches(100, owner=OWNER)[0]} == before
    del store.add_lines
    # one a stop left validating: failed at the next start, saying so, its lines dropped
    file = store.add_file(content, "in.jsonl", "batch", owner=OWNER, tenant=TENANT)
    batch_id, lines = store.begin_batch(file["id"], CHAT, "24h", owner=OWNER, tenant=TENANT)
    store.add_lines(batch_id, lines, limit=10)
    assert store.fail_interrupted() == [batch_id]
    batch = store.batch(batch_id, owner=OWNER)
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "batch_creation_interrupted"
    assert batch_id not in store.unfinished_batch_ids() and store.fail_interrupted() == []
    store.check_integrity()
