"""The Batch API: in-process with a fake line executor (bad lines, transient retries and their cap, poison
lines, oversized lines and outputs, storage errors, cancel, paging, resume after a stop, the async
`openai` SDK, API keys that see only their own files and batches unless their tenant shares them), then
the `openai` SDK against `cliffguard serve` over the tiny model, and a server killed with SIGKILL in the
middle of a 40-line batch."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.batch import endpoints as batches
from gateway.app import create_app
from gateway.batch.endpoints import BATCHES, STORE_FILE
from gateway.cli import main
from gateway.runtime import Gateway
from gateway.batch import execution
from pools.store import batch_files, batch_store
from pools.store.batch_input import MAX_BATCH_LINE_BYTES
from pools.config.yaml_file import load_config
from tests.gateway.conftest import LiveServer, pools_yaml

CHAT = "/v1/chat/completions"
FINAL = ("completed", "cancelled", "failed", "expired")
TENANTS = """
tenants:
  a: {api_keys: [key-a]}
  b: {api_keys: [key-b]}
"""


def _line(custom_id: str, content: str | None = None, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": content or custom_id}], **body}}


def _jsonl(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def _error(status: int, message: str, code: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "server_error" if status >= 500 else
                              "invalid_request_error", "param": None, "code": code}}


class _FakeExecutor:
    """Answers like `gateway.handlers.answer`: a chat completion of the upper-cased prompt; the
    prompt "bad" gets a 400; `transient[prompt]` first answers are 503 engine_dead; `scripted[prompt]`
    lists its first answers as (status, code); prompts in `gated` wait for `gate` (and count their
    aborts). `tenants[prompt]`: the tenant it ran as."""

    def __init__(self, transient: dict[str, int] | None = None, gated: set[str] = frozenset(),
                 scripted: dict[str, list[tuple[int, str | None]]] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.tenants: dict[str, str] = {}
        self.transient, self.gated, self.scripted = transient or {}, gated, scripted or {}
        self.gate = asyncio.Event()
        self.aborted = 0

    async def __call__(self, path: str, body: dict, tenant: str) -> tuple[int, dict]:
        prompt = body["messages"][0]["content"]
        self.calls[prompt] += 1
        self.tenants[prompt] = tenant
        if self.calls[prompt] <= self.transient.get(prompt, 0):
            return _error(503, "device 'cpu' worker died; restarting", "engine_dead")
        if self.calls[prompt] <= len(self.scripted.get(prompt, ())):
            status, code = self.scripted[prompt][self.calls[prompt] - 1]
            return _error(status, f"scripted {status} {code}", code)
        if prompt == "bad":
            return _error(400, "temperature: must be in [0, 2], got 9")
        if prompt in self.gated:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.aborted += 1
                raise
        return 200, {"id": f"chatcmpl-{prompt}", "object": "chat.completion",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": prompt.upper()},
                                  "finish_reason": "stop"}]}


async def _client(aiohttp_client, tmp_path: Path, model: Path, executor, headers=None, tenants: str = "",
                  **yaml_kw):
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(model, **yaml_kw) + tenants)
    gateway = Gateway.from_config(load_config(path))
    gateway.engines = {}      # no device worker to spawn: the fake executor never reaches one
    app = create_app(gateway, data_dir=tmp_path, batch_executor=executor)
    app[BATCHES].retry_first_s = app[BATCHES].retry_max_s = 0.01
    return await aiohttp_client(app, headers=headers)


async def _upload(client, content: bytes, purpose: str = "batch", **kw):
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    return await client.post("/v1/files", data=form, **kw)


async def _create(client, content: bytes) -> dict:
    r = await _upload(client, content)
    assert r.status == 200, await r.text()
    r = await client.post("/v1/batches", json={"input_file_id": (await r.json())["id"], "endpoint": CHAT,
                                               "completion_window": "24h"})
    assert r.status == 200, await r.text()
    return await r.json()


async def _wait(client, batch_id: str, until=lambda b: b["status"] in FINAL, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
        if until(batch):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.02)


async def _jsonl_file(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    r = await client.get(f"/v1/files/{file_id}/content")
    assert r.status == 200
    return [json.loads(x) for x in (await r.read()).splitlines()]


# --- in-process, fake executor ---------------------------------------------------------------------
async def test_bad_lines_go_to_the_error_file_and_transient_errors_are_retried(aiohttp_client, tmp_path, tiny_model,
                                                                               monkeypatch):
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 7)                   # files kept and sent in pieces of 7 bytes
    monkeypatch.setattr(batches, "CHUNK_BYTES", 7)
    fake = _FakeExecutor(scripted={"b": [(503, "engine_dead"), (502, "upstream_unreachable")]})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    content = _jsonl(_line("a"), b"{oops", _line("b"), _line("c", "bad"), _line("a"),
                     {**_line("d"), "url": "/v1/completions"}, _line("e"))
    batch = await _create(client, content)
    assert batch["object"] == "batch" and batch["endpoint"] == CHAT
    done = await _wait(client, batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 7, "completed": 3, "failed": 4}
    assert fake.calls == {"a": 1, "b": 3, "bad": 1, "e": 1}          # b: a 503 and a 502 retried, recorded once
    output = await _jsonl_file(client, done["output_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"]) for o in output] == \
        [("a", "A"), ("b", "B"), ("e", "E")]
    errors = await _jsonl_file(client, done["error_file_id"])
    assert [e["custom_id"] for e in errors] == [None, "c", "a", "d"]
    assert [e["error"]["code"] if e["error"] else e["response"]["status_code"] for e in errors] == \
        ["invalid_json_line", 400, "duplicate_custom_id", "invalid_url"]
    info = await (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert info["object"] == "file" and info["purpose"] == "batch_output" and info["bytes"] > 0
    r = await client.get(f"/v1/files/{done['output_file_id']}/content")
    assert r.content_length == info["bytes"] == len(await r.read())


async def test_a_file_deleted_while_it_is_sent_ends_its_body_short_and_the_runner_purges_expired_ones(
        aiohttp_client, tmp_path, tiny_model, monkeypatch, caplog):
    """A file deleted (or expired) between two pieces of its content: the body ends short of Content-Length
    and the connection closes, said in the log (it was an unhandled AssertionError out of aiohttp, a 500 in
    the metrics). The runner drops expired files' bytes every PURGE_EVERY_S, PURGE_BYTES a transaction."""
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 7)
    monkeypatch.setattr(batches, "CHUNK_BYTES", 7)
    monkeypatch.setattr(execution, "PURGE_EVERY_S", 0.05)
    monkeypatch.setattr(batch_store, "PURGE_BYTES", 1)                   # one file a transaction
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    runner = client.server.app[BATCHES]
    ids = [(await (await client.post("/v1/files", data={"file": _jsonl(_line(f"x{i}")), "purpose": "batch"}))
            .json())["id"] for i in range(3)]
    content = runner.store.file_content

    def deleted_after_the_first_piece(file_id, *, owner, offset=0, size=None):
        if offset:
            runner.store.delete_file(file_id, owner=owner)
        return content(file_id, owner=owner, offset=offset, size=size)

    monkeypatch.setattr(runner.store, "file_content", deleted_after_the_first_piece)
    r = await client.get(f"/v1/files/{ids[0]}/content")
    with pytest.raises(aiohttp.ClientPayloadError):
        await r.read()
    assert "was deleted or expired while it was being sent" in caplog.text and "unhandled error" not in caplog.text
    monkeypatch.setattr(runner.store, "file_content", content)
    with sqlite3.connect(tmp_path / STORE_FILE) as db:                 # the other two expired a second ago
        db.execute("UPDATE files SET expires_at = ? WHERE id IN (?, ?)", (int(time.time()) - 1, *ids[1:]))
    for _ in range(100):
        await asyncio.sleep(0.05)
        with sqlite3.connect(tmp_path / STORE_FILE) as db:
            left = db.execute("SELECT count(*) FROM file_chunks WHERE file_id IN (?, ?, ?)", ids).fetchone()[0]
        if not left:
            break
    assert left == 0 and [(await client.get(f"/v1/files/{i}")).status for i in ids] == [404] * 3
    runner.store.check_integrity()


async def test_cancel_aborts_lines_in_flight_and_keeps_what_finished(aiohttp_client, tmp_path, tiny_model):
    fake = _FakeExecutor(gated={f"slow{i}" for i in range(30)})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    batch = await _create(client, _jsonl(*(_line(f"fast{i}") for i in range(3)),
                                         *(_line(f"slow{i}") for i in range(30))))
    await _wait(client, batch["id"], lambda b: b["request_counts"]["completed"] == 3)
    r = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert r.status == 200 and (await r.json())["status"] in ("cancelling", "cancelled")
    done = await _wait(client, batch["id"])
    assert done["status"] == "cancelled" and done["cancelling_at"] and done["cancelled_at"]
    assert done["request_counts"] == {"total": 33, "completed": 3, "failed": 0}
    assert [o["custom_id"] for o in await _jsonl_file(client, done["output_file_id"])] == ["fast0", "fast1", "fast2"]
    # 16 lines in flight (the 3 fast ones done, their workers may have taken 3 more); all aborted
    assert 16 <= sum(fake.calls.values()) <= 19 and fake.aborted == sum(fake.calls.values()) - 3
    again = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status == 200 and (await again.json())["status"] == "cancelled"
    finished = await _create(client, _jsonl(_line("x")))
    await _wait(client, finished["id"])
    r = await client.post(f"/v1/batches/{finished['id']}/cancel")
    assert r.status == 409 and (await r.json())["error"]["param"] == "batch_id"
    assert r.headers["x-should-retry"] == "false"   # the openai SDK retries a 409 twice, as a lock timeout


async def test_a_batch_past_its_window_expires_its_lines_in_flight_aborted_and_is_never_resumed(
        aiohttp_client, tmp_path, tiny_model):
    """24 h after its creation a running batch expires (the runner's purge turn, `BatchRunner.expire_due`): its
    lines in flight are aborted, what was answered is in its output file, the rest `batch_expired` errors, the
    batch object as the SDK's model reads it; a stopped server's batch already past its window expires at the start, no line run."""
    fake = _FakeExecutor(gated={*(f"slow{i}" for i in range(20)), "late"})   # `late` stays pending at the stop
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    runner = client.server.app[BATCHES]
    batch = await _create(client, _jsonl(*(_line(f"fast{i}") for i in range(2)), *(_line(f"slow{i}") for i in range(20))))
    await _wait(client, batch["id"], lambda b: b["request_counts"]["completed"] == 2)
    await runner.expire_due(now=batch["expires_at"] - 1)
    assert (await _wait(client, batch["id"], lambda b: True))["status"] == "in_progress"
    await runner.expire_due(now=batch["expires_at"])
    done = openai.types.Batch.model_validate(await _wait(client, batch["id"]))   # as the SDK reads it
    assert (done.status, done.expired_at, done.expires_at) == ("expired", batch["expires_at"], batch["expires_at"])
    assert done.request_counts.completed == 2 and done.request_counts.failed == 20
    assert fake.aborted == sum(fake.calls.values()) - 2 > 0
    errors = await _jsonl_file(client, done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(errors) == 20
    late = await _create(client, _jsonl(_line("late")))
    await client.close()
    with sqlite3.connect(tmp_path / STORE_FILE) as db:                  # the window of `late` ended while stopped
        db.execute("UPDATE batches SET created_at = created_at - 86400 WHERE id = ?", (late["id"],))
    second = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, second)
    assert (await _wait(client, late["id"]))["status"] == "expired" and not second.calls
    client.server.app[BATCHES].store.check_integrity()


async def test_no_line_starts_after_a_cancel_that_lands_while_the_next_page_is_read(aiohttp_client, tmp_path,
                                                                                      tiny_model, monkeypatch):
    """The store thread keeps its calls' order: the cancel is handed to it while the first answer's record
    holds it, so the next page's read, asked for after that record, returns after the cancel has aborted
    the lines in flight. The lines of that page must not start."""
    monkeypatch.setattr(execution, "PAGE_LINES", 2)
    fake = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    runner = client.app[BATCHES]
    runner.max_in_flight = 2
    store, record, on_thread = runner.store, runner.store.record, runner.store.on_thread
    entered, release, handed = threading.Event(), threading.Event(), []

    def held_record(*args, **kwargs):
        if not entered.is_set():
            entered.set()
            assert release.wait(10)
        return record(*args, **kwargs)

    async def handing(fn, *args, **kwargs):
        handed.append(getattr(fn, "__name__", ""))
        return await on_thread(fn, *args, **kwargs)

    monkeypatch.setattr(store, "record", held_record)
    monkeypatch.setattr(store, "on_thread", handing)
    batch = await _create(client, _jsonl(*(_line(x) for x in "abcd")))
    while not entered.is_set():                                         # a and b answered, a's record held
        await asyncio.sleep(0.01)
    cancel = asyncio.ensure_future(client.post(f"/v1/batches/{batch['id']}/cancel"))
    while "cancel" not in handed:
        await asyncio.sleep(0.01)
    release.set()
    assert (await cancel).status == 200
    done = await _wait(client, batch["id"])
    assert done["status"] == "cancelled" and set(fake.calls) == {"a", "b"}
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 0}
    store.check_integrity()


async def test_list_pages_and_requests_are_checked_field_by_field(aiohttp_client, tmp_path, tiny_model):
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor(),
                           headers={"Authorization": "Bearer k1"}, api_keys='["k1"]')
    for path in ("/v1/batches", "/v1/files/file-x/content"):
        assert (await client.get(path, headers={"Authorization": "Bearer k2"})).status == 401
    ids = [(await _create(client, _jsonl(_line("a"))))["id"] for _ in range(3)]
    page = await (await client.get("/v1/batches", params={"limit": "2"})).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] and page["object"] == "list"
    rest = await (await client.get("/v1/batches", params={"limit": "2", "after": page["last_id"]})).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]
    file_id = (await (await _upload(client, _jsonl(_line("a")))).json())["id"]
    create = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    cases = [(client.get("/v1/batches", params={"limit": "0"}), 400, "limit"),
             (client.get("/v1/batches", params={"after": "batch_nope"}), 400, "after"),
             (client.get("/v1/batches/batch_nope"), 404, "batch_id"),
             (client.post("/v1/batches/batch_nope/cancel"), 404, "batch_id"),
             (client.get("/v1/files/file-nope/content"), 404, "file_id"),
             (_upload(client, b"x", purpose="fine-tune"), 400, "purpose"),
             (client.post("/v1/files", json={"purpose": "batch"}), 400, "body"),
             (client.post("/v1/files", data=b"x", headers={"Content-Type": "multipart/form-data"}), 400, "body"),
             (client.post("/v1/batches", json={**create, "endpoint": "/v1/embeddings"}), 400, "endpoint"),
             (client.post("/v1/batches", json={**create, "completion_window": "1h"}), 400, "completion_window"),
             (client.post("/v1/batches", json={**create, "input_file_id": "file-nope"}), 400, "input_file_id"),
             (client.post("/v1/batches", json={**create, "model": "m"}), 400, "model"),
             (client.post("/v1/batches", json={"endpoint": CHAT, "completion_window": "24h"}), 400, "input_file_id")]
    for request, status, param in cases:
        r = await request
        body = await r.json()
        assert (r.status, body["error"]["param"]) == (status, param), body
        assert body["error"]["message"].startswith(param + ": "), body


async def test_a_stopped_server_resumes_its_batches_and_records_each_line_once(aiohttp_client, tmp_path, tiny_model):
    first = _FakeExecutor(gated={f"r{i}" for i in range(4, 20)})
    as_a = {"headers": {"Authorization": "Bearer key-a"}, "tenants": TENANTS}
    client = await _client(aiohttp_client, tmp_path, tiny_model, first, **as_a)
    batch = await _create(client, _jsonl(*(_line(f"r{i}") for i in range(20))))
    await _wait(client, batch["id"], lambda b: b["request_counts"]["completed"] == 4)
    await client.close()                                       # the runner stops; r4..r19 stay pending
    second = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, second, **as_a)
    done = await _wait(client, batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 20
    assert set(second.calls) == {f"r{i}" for i in range(4, 20)} and set(second.calls.values()) == {1}
    assert set(first.tenants.values()) == set(second.tenants.values()) == {"a"}   # resumed as its tenant
    output = await _jsonl_file(client, done["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(20)]


async def test_a_batch_is_created_in_steps_and_one_a_stop_interrupted_fails_at_the_next_start(aiohttp_client, tmp_path,
                                                                                              tiny_model, monkeypatch):
    """Its lines stored a step at a time (`pools.store.batch_create`), the other clients served between steps; a
    batch the stop caught being created is `failed` at the next start (`batch_creation_interrupted`), not run
    with the lines it had, nor left `validating` for ever."""
    from pools.store import batch_create

    monkeypatch.setattr(batch_create, "LINES_PER_STEP", 3)
    as_a = {"headers": {"Authorization": "Bearer key-a"}, "tenants": TENANTS}
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor(), **as_a)
    store = client.app[BATCHES].store
    steps, add_lines = [], store.add_lines
    monkeypatch.setattr(store, "add_lines", lambda *args, **kw: steps.append(1) or add_lines(*args, **kw))
    batch = await _create(client, _jsonl(*(_line(f"r{i}") for i in range(10))))
    assert len(steps) == 4 and batch["request_counts"]["total"] == 10
    assert (await _wait(client, batch["id"]))["request_counts"]["completed"] == 10
    file = (await (await _upload(client, _jsonl(_line("x"), _line("y")))).json())["id"]
    (owner,) = store._db.execute("SELECT owner FROM files WHERE id=?", (file,)).fetchone()
    interrupted, _ = store.begin_batch(file, CHAT, "24h", owner=owner, tenant="a")   # as a stop leaves one
    await client.close()
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor(), **as_a)
    failed = await (await client.get(f"/v1/batches/{interrupted}")).json()
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "batch_creation_interrupted"


async def test_a_page_cut_short_by_its_bytes_does_not_end_the_batch(aiohttp_client, tmp_path, tiny_model,
                                                                    monkeypatch):
    """Pages of pending lines end at `PAGE_BYTES` of bodies (here one line each): the runner read a page shorter
    than `PAGE_LINES` as the last, and the batch finalized with its later lines never run."""
    monkeypatch.setattr(batch_store, "PAGE_BYTES", 1)
    fake = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    done = await _wait(client, (await _create(client, _jsonl(*(_line(f"r{i}") for i in range(6)))))["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert set(fake.calls) == {f"r{i}" for i in range(6)}


async def test_the_async_sdk_reads_every_shape(aiohttp_client, tmp_path, tiny_model):
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    file = await sdk.files.create(file=("in.jsonl", _jsonl(_line("a"), _line("b"))), purpose="batch")
    assert (file.object, file.purpose, file.filename, file.bytes) == ("file", "batch", "in.jsonl",
                                                                      len(_jsonl(_line("a"), _line("b"))))
    batch = await sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h",
                                     metadata={"job": "nightly"})
    while batch.status not in FINAL:
        await asyncio.sleep(0.02)
        batch = await sdk.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.metadata == {"job": "nightly"}
    text = (await sdk.files.content(batch.output_file_id)).text
    assert [json.loads(x)["custom_id"] for x in text.splitlines()] == ["a", "b"]
    assert [b.id async for b in sdk.batches.list(limit=1)] == [batch.id]
    with pytest.raises(openai.NotFoundError):
        await sdk.batches.retrieve("batch_nope")
    await sdk.close()


async def test_files_expire_as_openais_and_the_sdk_deletes_them(aiohttp_client, tmp_path, tiny_model):
    """An upload's `expires_after` (the SDK's form fields), 30 days without one, a batch's
    `output_expires_after`; `files.delete` ends a file at once, and its batch still names it."""
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    content = _jsonl(_line("a"))
    kept = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    assert kept.expires_at == kept.created_at + 30 * 86400
    hour = await sdk.files.create(file=("in.jsonl", content), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    for policy, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                          ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.files.create(file=("in.jsonl", content), purpose="batch", expires_after=policy)
        assert bad.value.body["param"] == param, bad.value.body
    for fields, param in (({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
                          ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"},
                           "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000},
                           "expires_after.seconds")):   # each named as the store names the others
        form = aiohttp.FormData({"purpose": "batch", **fields})
        form.add_field("file", content, filename="in.jsonl")
        r = await client.post("/v1/files", data=form)
        assert r.status == 400 and (await r.json())["error"]["param"] == param
    batch = await sdk.batches.create(input_file_id=hour.id, endpoint=CHAT, completion_window="24h",
                                     output_expires_after={"anchor": "created_at", "seconds": 7200})
    deleted = await sdk.files.delete(hour.id)   # the batch has its lines: it runs on
    assert (deleted.id, deleted.deleted) == (hour.id, True)
    batch = await _sdk_done(sdk, batch.id)
    output = await sdk.files.retrieve(batch.output_file_id)
    assert batch.status == "completed" and output.expires_at == output.created_at + 7200
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            await call(hour.id)
    assert (await sdk.batches.retrieve(batch.id)).input_file_id == hour.id
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.batches.create(input_file_id=kept.id, endpoint=CHAT, completion_window="24h",
                                 output_expires_after={"anchor": "created_at", "seconds": 10 ** 9})
    assert bad.value.body["param"] == "output_expires_after.seconds"
    await sdk.close()


async def _assert_hidden(call, hidden_id: str, unknown_id: str, error=openai.NotFoundError) -> None:
    """`call(hidden_id)` (another tenant's id) fails exactly as `call(unknown_id)` (an id nobody has)."""
    seen = []
    for key in (hidden_id, unknown_id):
        with pytest.raises(error) as info:
            await call(key)
        seen.append((info.value.status_code, json.dumps(info.value.body).replace(key, "<id>")))
    assert seen[0] == seen[1], seen


async def _sdk_done(sdk: openai.AsyncOpenAI, batch_id: str):
    while (batch := await sdk.batches.retrieve(batch_id)).status not in FINAL:
        await asyncio.sleep(0.02)
    return batch


KEYS = '["key-a", "key-b", "key-t1", "key-t2"]'
SHARING = """
tenants:
  team: {api_keys: [key-t1, key-t2], share_files: true}
  nightly: {api_keys: [key-n], weight: 2}
"""


async def test_an_api_key_sees_only_its_own_files_and_batches_unless_its_tenant_shares_them(aiohttp_client, tmp_path,
                                                                                             tiny_model):
    fake = _FakeExecutor(gated={"a2"})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake, tenants=SHARING, api_keys=KEYS)
    sdk_a, sdk_b, sdk_t1, sdk_t2 = (openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key,
                                                       max_retries=0)
                                    for key in ("key-a", "key-b", "key-t1", "key-t2"))
    file = await sdk_a.files.create(file=("in.jsonl", _jsonl(_line("a1"), _line("a2"))), purpose="batch")
    batch = await sdk_a.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    no_file, no_batch = "file-" + "0" * 24, "batch_" + "0" * 24
    for sdk in (sdk_b, sdk_t1):     # key-b: the same tenant (default), another key; key-t1: another tenant
        await _assert_hidden(sdk.files.retrieve, file.id, no_file)
        await _assert_hidden(sdk.files.content, file.id, no_file)
        await _assert_hidden(sdk.batches.retrieve, batch.id, no_batch)
        await _assert_hidden(sdk.batches.cancel, batch.id, no_batch)
        await _assert_hidden(lambda i, sdk=sdk: sdk.batches.create(input_file_id=i, endpoint=CHAT,
                                                                   completion_window="24h"),
                             file.id, no_file, openai.BadRequestError)
        await _assert_hidden(lambda i, sdk=sdk: sdk.batches.list(after=i), batch.id, no_batch, openai.BadRequestError)
        assert [b.id async for b in sdk.batches.list()] == []
    assert (await sdk_a.batches.retrieve(batch.id)).status == "in_progress"   # B's cancel did not reach it
    fake.gate.set()
    done = await _sdk_done(sdk_a, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    assert fake.tenants == {"a1": "default", "a2": "default"}                 # A's lines ran as A's tenant
    await _assert_hidden(sdk_b.files.content, done.output_file_id, no_file)  # the output is A's too
    assert (await sdk_a.files.content(done.output_file_id)).text.count("custom_id") == 2
    own = await sdk_b.files.create(file=("in.jsonl", _jsonl(_line("b1"))), purpose="batch")
    theirs = await sdk_b.batches.create(input_file_id=own.id, endpoint=CHAT, completion_window="24h")
    assert (await _sdk_done(sdk_b, theirs.id)).status == "completed" and fake.tenants["b1"] == "default"
    assert [b.id async for b in sdk_a.batches.list()] == [batch.id]
    assert [b.id async for b in sdk_b.batches.list()] == [theirs.id]
    await _assert_hidden(sdk_a.batches.retrieve, theirs.id, no_batch)
    shared = await sdk_t1.files.create(file=("in.jsonl", _jsonl(_line("t1"))), purpose="batch")
    assert (await sdk_t2.files.retrieve(shared.id)).bytes == shared.bytes    # share_files: true
    team = await sdk_t2.batches.create(input_file_id=shared.id, endpoint=CHAT, completion_window="24h")
    team_done = await _sdk_done(sdk_t1, team.id)
    assert team_done.status == "completed" and fake.tenants["t1"] == "team"
    assert (await sdk_t1.files.content(team_done.output_file_id)).text.count("custom_id") == 1
    assert [b.id async for b in sdk_t1.batches.list()] == [b.id async for b in sdk_t2.batches.list()] == [team.id]
    await _assert_hidden(sdk_a.files.retrieve, shared.id, no_file)
    await _assert_hidden(sdk_a.batches.retrieve, team.id, no_batch)
    for sdk in (sdk_a, sdk_b, sdk_t1, sdk_t2):
        await sdk.close()


async def test_an_api_key_may_have_so_many_unfinished_batches(aiohttp_client, tmp_path, tiny_model):
    """`gateway.batches.max_unfinished_per_owner` 2: a key's third batch while two are in progress is a 429
    `rate_limit_exceeded` naming the setting (the SDK's RateLimitError), nothing stored; another key's is
    not; a batch that ended (cancelled, completed) gives its place back."""
    fake = _FakeExecutor(gated={"slow"})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake, api_keys=KEYS,
                           max_body="1MiB, batches: {max_unfinished_per_owner: 2}")
    sdk_a, sdk_b = (openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
                    for key in ("key-a", "key-b"))
    file = await sdk_a.files.create(file=("in.jsonl", _jsonl(_line("slow"))), purpose="batch")
    running = [await sdk_a.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
               for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as info:
        await sdk_a.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert info.value.body["code"] == "rate_limit_exceeded" and info.value.response.headers["x-should-retry"] == "false"
    assert "2 batches in progress" in info.value.body["message"]
    assert "max_unfinished_per_owner (2)" in info.value.body["message"]
    assert [b.id async for b in sdk_a.batches.list()] == [b.id for b in reversed(running)]
    other = await sdk_b.files.create(file=("in.jsonl", _jsonl(_line("b1"))), purpose="batch")
    assert (await _sdk_done(sdk_b, (await sdk_b.batches.create(input_file_id=other.id, endpoint=CHAT,
                                                               completion_window="24h")).id)).status == "completed"
    await sdk_a.batches.cancel(running[0].id)
    assert (await _sdk_done(sdk_a, running[0].id)).status == "cancelled"
    third = await sdk_a.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    fake.gate.set()
    assert [(await _sdk_done(sdk_a, b.id)).status for b in (running[1], third)] == ["completed", "completed"]
    for sdk in (sdk_a, sdk_b):
        await sdk.close()


async def test_the_sdk_lists_a_keys_files_newest_first_a_page_at_a_time(aiohttp_client, tmp_path, tiny_model):
    """`files.list` as OpenAI's: the caller's files (its batch's output too), newest first or `order="asc"`, by
    `purpose`, a page of `limit` at a time; another key's and a deleted one are not listed; a bad parameter
    is a 400 naming it."""
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor(), api_keys=KEYS)
    sdk_a, sdk_b = (openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
                    for key in ("key-a", "key-b"))
    files = [await sdk_a.files.create(file=(f"in{i}.jsonl", _jsonl(_line(f"l{i}"))), purpose="batch")
             for i in range(4)]
    await sdk_b.files.create(file=("other.jsonl", _jsonl(_line("b"))), purpose="batch")
    await sdk_a.files.delete(files[1].id)
    batch = await _sdk_done(sdk_a, (await sdk_a.batches.create(input_file_id=files[0].id, endpoint=CHAT,
                                                               completion_window="24h")).id)
    inputs = [files[3].id, files[2].id, files[0].id]
    assert [f.id async for f in sdk_a.files.list()] == [batch.output_file_id, *inputs]
    page = await sdk_a.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == inputs[::-1][:2] and page.has_more
    assert [f.id async for f in sdk_a.files.list(limit=2, order="asc")] == [*inputs[::-1], batch.output_file_id]
    assert [f.id async for f in sdk_a.files.list(purpose="batch")] == inputs
    assert [(f.purpose, f.filename) async for f in sdk_a.files.list(purpose="batch_output")] == [
        ("batch_output", f"{batch.id}_output.jsonl")]
    assert [f.filename async for f in sdk_b.files.list()] == ["other.jsonl"]
    # a page that ended on a file deleted since goes on from it
    assert [f.id async for f in sdk_a.files.list(after=files[1].id, order="asc")] == [
        files[2].id, files[3].id, batch.output_file_id]
    for query, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "file-nothing"}, "after")):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk_a.files.list(**query)
        assert info.value.body["param"] == param, info.value.body
    for sdk in (sdk_a, sdk_b):
        await sdk.close()


async def test_transient_answers_are_tried_a_bounded_number_of_times(aiohttp_client, tmp_path, tiny_model):
    # A 502 is tried again only when nothing reached the upstream (upstream_unreachable): one that may
    # have (upstream_disconnected, or an upstream's own 502 or 503: a proxy's, after the server had it) is the
    # line's answer, never sent twice. Any 429 (an upstream refusing it for now) is tried again.
    fake = _FakeExecutor(scripted={"down": [(503, "pool_unavailable")] * 99,
                                   "gone": [(502, "upstream_unreachable")] * 99,
                                   "flaky": [(502, "upstream_unreachable"), (503, "pool_unavailable"),
                                             (503, "engine_dead")],
                                   "sent": [(502, "upstream_disconnected")] * 99, "relayed": [(502, None)] * 99,
                                   "busy": [(429, None), (429, "rate_limit_exceeded")],   # an upstream's own
                                   "unavailable": [(503, None)] * 99})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    client.app[BATCHES].max_line_attempts = 4
    lines = _jsonl(_line("down"), _line("gone"), _line("flaky"), _line("sent"), _line("relayed"), _line("busy"),
                   _line("unavailable"))
    done = await _wait(client, (await _create(client, lines))["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 7, "completed": 2, "failed": 5}
    assert fake.calls == {"down": 4, "gone": 4, "flaky": 4, "sent": 1, "relayed": 1, "busy": 3, "unavailable": 1}
    errors = await _jsonl_file(client, done["error_file_id"])
    assert [(e["custom_id"], e["error"] and e["error"]["code"], e["response"]["status_code"]) for e in errors] == \
        [("down", "retries_exhausted", 503), ("gone", "retries_exhausted", 502), ("sent", None, 502),
         ("relayed", None, 502), ("unavailable", None, 503)]
    message = errors[0]["error"]["message"]
    assert "gave up after 4 attempts; the last answer was 503 pool_unavailable: scripted" in message
    assert errors[0]["error"]["line"] == 1 and errors[1]["response"]["body"]["error"]["code"] == "upstream_unreachable"


class _DyingWorker:
    """A device worker as the line executor: a line takes 50 ms, and the prompt "poison" kills the
    worker 10 ms into each of its tries: every line in flight then (itself included) gets 503
    engine_dead. `most_in_flight[prompt]`: the most lines in flight while it ran."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.deaths = 0
        self.most_in_flight: dict[str, int] = {}
        self._in_flight: set[asyncio.Future] = set()

    async def __call__(self, path: str, body: dict, tenant: str) -> tuple[int, dict]:
        prompt = body["messages"][0]["content"]
        self.calls[prompt] += 1
        died = asyncio.get_running_loop().create_future()
        self._in_flight.add(died)
        self.most_in_flight[prompt] = max(self.most_in_flight.get(prompt, 0), len(self._in_flight))
        try:
            if prompt == "poison":
                await asyncio.sleep(0.01)
                self.deaths += 1
                for future in self._in_flight:
                    future.done() or future.set_result(None)
            else:
                await asyncio.wait([died], timeout=0.05)
            if died.done():
                return _error(503, "device 'cpu' worker died: signal 9", "engine_dead")
            return 200, {"object": "chat.completion", "choices": [{"message": {"content": prompt.upper()}}]}
        finally:
            self._in_flight.discard(died)


async def test_a_line_that_kills_the_worker_twice_is_a_poison_line_and_the_lines_beside_it_live(aiohttp_client,
                                                                                                tmp_path, tiny_model):
    worker = _DyingWorker()
    client = await _client(aiohttp_client, tmp_path, tiny_model, worker)
    lines = [_line(f"r{i}") for i in range(8)] + [_line("poison")] + [_line(f"s{i}") for i in range(12)]
    done = await _wait(client, (await _create(client, _jsonl(*lines)))["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 21, "completed": 20, "failed": 1}
    assert worker.calls["poison"] == 2 and worker.deaths == 2
    assert worker.most_in_flight["poison"] > 1 and max(c for p, c in worker.calls.items() if p != "poison") == 2
    [error] = await _jsonl_file(client, done["error_file_id"])
    assert error["custom_id"] == "poison" and error["error"]["code"] == "poison_line"
    assert "died 2 times while answering it" in error["error"]["message"] and error["response"]["status_code"] == 503
    assert len(await _jsonl_file(client, done["output_file_id"])) == 20
    client.app[BATCHES].store.check_integrity()


REMOTE_POOL = """
  - name: remote
    upstream: http://127.0.0.1:9/v1
    model: upstream-model
    served_model_name: remote
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
"""


def _remote_line(custom_id: str) -> dict:
    return dict(_line(custom_id), body={"model": "remote", "messages": [{"role": "user", "content": custom_id}]})


async def test_a_worker_death_holds_up_only_the_batch_lines_of_its_devices(aiohttp_client, tmp_path, tiny_model):
    """A line retried alone after a worker's death waits for the batch lines of the devices its model runs on,
    not for an upstream pool's line that holds on (one gate for every line: batch A waited on batch B)."""
    fake = _FakeExecutor(transient={"a": 1}, gated={"slow"})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake, extra_pools=REMOTE_POOL)
    gateway = client.app[BATCHES].gate_keys.args[0]
    assert execution.line_devices(gateway, {"model": "remote"}) == ()
    assert execution.line_devices(gateway, {"model": "m"}) == (None,)   # not served: answered 404 at once
    assert execution.line_devices(gateway, {"model": gateway.config.pools[0].model_name}) == ("cpu",)
    slow = (await _create(client, _jsonl(_remote_line("slow"))))["id"]
    while not fake.calls["slow"]:
        await asyncio.sleep(0.01)
    done = await _wait(client, (await _create(client, _jsonl(_line("a"))))["id"], timeout=10)
    assert done["status"] == "completed" and fake.calls["a"] == 2
    fake.gate.set()
    assert (await _wait(client, slow))["status"] == "completed"


async def test_a_line_over_the_limit_is_an_error_of_that_line(aiohttp_client, tmp_path, tiny_model):
    fake = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    big = _line("big", "x" * MAX_BATCH_LINE_BYTES)
    batch = await _create(client, _jsonl(_line("a"), big, _line("b")))
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    done = await _wait(client, batch["id"])
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1} and set(fake.calls) == {"a", "b"}
    [error] = await _jsonl_file(client, done["error_file_id"])
    assert error["error"]["code"] == "line_too_large" and error["error"]["message"].startswith("line 2: ")


async def test_output_and_error_files_over_the_limit_fail_the_batch_with_a_reason(aiohttp_client, tmp_path,
                                                                                   tiny_model, monkeypatch):
    # at 1,000 bytes each, the error file cannot even hold the entries of the answers the output could not
    monkeypatch.setattr(batch_files, "MAX_OUTPUT_FILE_BYTES", 1000)
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    content = _jsonl(*(_line(f"r{i}") for i in range(20)), _line("bad"))
    file = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await _sdk_done(sdk, (await sdk.batches.create(input_file_id=file.id, endpoint=CHAT,
                                                           completion_window="24h")).id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is batch.error_file_id is None
    assert batch.errors.data[0].code == "output_too_large" and "1000 bytes" in batch.errors.data[0].message
    # every line ran, but no file holds their answers: the batch counts none of them
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (21, 0, 0)
    client.app[BATCHES].store.check_integrity()
    await sdk.close()


def _failing(method, times: float, message: str = "database or disk is full"):
    """`method`, raising the store's storage error on its first `times` calls."""
    calls = Counter()

    def call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise sqlite3.OperationalError(message)
        return method(*args, **kwargs)
    return call


async def test_storage_errors_are_tried_again_then_pause_the_batch_which_resumes_with_its_answers(
        aiohttp_client, tmp_path, tiny_model, monkeypatch, caplog):
    """A store call failing for storage is tried again; past its tries the batch pauses as it stands (answers kept)
    and runs again at the next purge. It failed `storage_error` and dropped every answer."""
    monkeypatch.setattr(execution, "PURGE_EVERY_S", 0.2)
    fake = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    runner = client.app[BATCHES]
    runner.max_store_attempts = 3
    store = runner.store
    record, finalize_step = store.record, store.finalize_step
    monkeypatch.setattr(store, "record", _failing(record, 2))            # twice: tried again, no harm
    assert (await _wait(client, (await _create(client, _jsonl(_line("a"))))["id"]))["status"] == "completed"
    monkeypatch.setattr(store, "record", _failing(record, float("inf"), "database is locked"))
    paused = (await _create(client, _jsonl(_line("b"))))["id"]
    await _wait(client, paused, lambda b: "database is locked" in caplog.text and paused not in runner._runs)
    assert f"batch {paused} paused" in caplog.text and (await _wait(client, paused, lambda b: True))["status"] == \
        "in_progress"
    monkeypatch.setattr(store, "record", record)                         # the lock is gone: it resumes
    assert (await _wait(client, paused))["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    monkeypatch.setattr(store, "finalize_step", _failing(finalize_step, float("inf")))
    kept = (await _create(client, _jsonl(_line("c"), _line("bad"))))["id"]
    await _wait(client, kept, lambda b: b["status"] == "finalizing" and kept not in runner._runs)
    monkeypatch.setattr(store, "finalize_step", finalize_step)           # the disk has room again
    done = await _wait(client, kept)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert fake.calls["c"] == 1 and len(await _jsonl_file(client, done["output_file_id"])) == 1   # kept, not re-run
    store.check_integrity()
    output_id = (await _wait(client, (await _create(client, _jsonl(_line("f"))))["id"]))["output_file_id"]
    monkeypatch.setattr(store, "file_content", _failing(store.file_content, float("inf")))
    r = await client.get(f"/v1/files/{output_id}/content")             # headers sent, then the store fails
    assert r.status == 200 and r.content_length > 0
    with pytest.raises(aiohttp.ClientPayloadError):
        await r.read()
    monkeypatch.setattr(store, "file", _failing(store.file, float("inf")))
    r = await client.get("/v1/files/file-x")                             # a client's request: 503, not a 500
    body = await r.json()
    assert r.status == 503 and r.headers["Retry-After"] and body["error"]["code"] == "storage_unavailable"


async def test_a_store_that_cannot_keep_a_line_as_sent_pauses_the_batch_and_the_line_runs_later(
        aiohttp_client, tmp_path, tiny_model, monkeypatch):
    """Marking an upstream line sent (before its bytes go out) fails for storage: nothing was sent, so the
    line is not answered; the batch pauses as for any store call, and the line runs once the store is back. It
    was the line's final answer, a 500 "internal error: StorageFailed" in the error file."""
    monkeypatch.setattr(execution, "PURGE_EVERY_S", 0.2)
    from gateway.upstream.relay import UPSTREAM_SEND

    sent = []

    async def relay(path: str, body: dict, tenant: str) -> tuple[int, dict]:
        await UPSTREAM_SEND.get()()   # as the relay does, just before the request goes out
        sent.append(body)
        return 200, {"object": "chat.completion", "choices": [{"message": {"content": "OK"}}]}
    client = await _client(aiohttp_client, tmp_path, tiny_model, relay)
    runner = client.app[BATCHES]
    runner.max_store_attempts = 2
    mark_sent = runner.store.mark_sent
    monkeypatch.setattr(runner.store, "mark_sent", _failing(mark_sent, float("inf")))
    batch_id = (await _create(client, _jsonl(_line("a"))))["id"]
    await asyncio.sleep(0.5)
    assert sent == [] and (await _wait(client, batch_id, lambda b: True))["status"] == "in_progress"
    monkeypatch.setattr(runner.store, "mark_sent", mark_sent)
    done = await _wait(client, batch_id)
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0} and len(sent) == 1


async def test_a_batch_line_counts_as_an_error_once_and_not_for_a_try_run_again(aiohttp_client, tmp_path, tiny_model):
    """`request_errors` counts answers: each try of a line answered 503 engine_dead counted (a device's restart
    under 16 lines in flight: hundreds of 503s no client saw). A line answered after a retry counts nothing; a
    line recorded with an error (a 400, a poison line's last 503) counts once."""
    from gateway.runtime import GATEWAY

    fake = _FakeExecutor(transient={"a": 1, "poison": 9})
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    done = await _wait(client, (await _create(client, _jsonl(_line("a"), _line("bad"), _line("poison"))))["id"])
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert fake.calls["a"] == 2 and fake.calls["poison"] == 2
    errors = client.app[GATEWAY].metrics.errors
    assert (errors.labels(status="503")._value.get(), errors.labels(status="400")._value.get()) == (1, 1)


async def test_a_batch_whose_failure_could_not_be_written_runs_again_at_the_next_purge(aiohttp_client, tmp_path,
                                                                                       tiny_model, monkeypatch, caplog):
    """A bug fails a batch (`internal_error`); where the store cannot even write that, the batch stays as it was
    and runs again at the next purge."""
    monkeypatch.setattr(execution, "PURGE_EVERY_S", 0.2)
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    runner = client.app[BATCHES]
    runner.max_store_attempts, store = 2, runner.store
    finalize_step, fail = store.finalize_step, store.fail

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(store, "finalize_step", bug)
    monkeypatch.setattr(store, "fail", _failing(fail, float("inf")))      # the disk is full: nothing is written
    stuck = await _create(client, _jsonl(_line("a"), _line("b")))
    await _wait(client, stuck["id"], lambda b: b["status"] == "finalizing" and stuck["id"] not in runner._runs)
    assert f"batch {stuck['id']} could not be marked failed" in caplog.text
    monkeypatch.setattr(store, "finalize_step", finalize_step)          # fixed (and the disk has room again)
    monkeypatch.setattr(store, "fail", fail)
    done = await _wait(client, stuck["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_serve_creates_its_data_dir_and_refuses_a_file_there(tmp_path, capsys, monkeypatch):
    from gateway.cli import make_data_dir

    folder = make_data_dir(str(tmp_path / "a" / "state"))
    assert folder.is_dir() and (folder / ".gitignore").read_text().endswith("*\n")
    (tmp_path / "taken").write_text("")
    monkeypatch.setattr("gateway.app.run", lambda *a, **k: pytest.fail("served"))
    assert main(["serve", "--config", str(tmp_path / "none.yaml"), "--data-dir", str(tmp_path / "taken")]) == 2
    assert "none.yaml" in capsys.readouterr().err                       # the config is checked first
    config = Path(__file__).resolve().parents[2] / "config" / "pools.yaml"
    assert main(["serve", "--config", str(config), "--port", "0", "--data-dir", str(tmp_path / "taken")]) == 2
    assert "--data-dir: cannot create" in capsys.readouterr().err


def test_one_server_per_data_dir(tmp_path, capsys, monkeypatch):
    from gateway.cli import lock_data_dir, make_data_dir

    served = []
    monkeypatch.setattr("gateway.app.run", lambda *a, **k: served.append(k["data_dir"]) or 0)
    config = Path(__file__).resolve().parents[2] / "config" / "pools.yaml"
    folder = make_data_dir(str(tmp_path / "state"))
    args = ["serve", "--config", str(config), "--port", "0", "--data-dir", str(folder)]
    with lock_data_dir(folder):                                         # another server holds the folder
        assert main(args) == 2
        assert f"is in use by another cliffguard serve (pid {os.getpid()})" in capsys.readouterr().err
        assert served == []
    assert main(args) == 0 and served == [folder]                       # free again once it let go
    assert main(args) == 0 and len(served) == 2                         # and a server that stopped released it


# --- a live server over the tiny model -------------------------------------------------------------
def _live_config(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(model))
    return path


def _sdk_wait(sdk: openai.OpenAI, batch_id: str, until=lambda b: b.status in FINAL, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not until(batch := sdk.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def test_the_openai_sdk_drives_a_batch_through_serve(tmp_path, tiny_model):
    model = tiny_model.name
    lines = [_line(f"q{i}", f"Say {i}", model=model, max_tokens=4) for i in range(6)]
    content = _jsonl(*lines, b"not json", _line("s", model=model, max_tokens=4, stream=True))
    with LiveServer(_live_config(tmp_path, tiny_model), args=["--data-dir", str(tmp_path / "data")]) as server:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        file = sdk.files.create(file=("in.jsonl", content), purpose="batch")
        assert sdk.files.retrieve(file.id).bytes == len(content)
        batch = sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
        done = _sdk_wait(sdk, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
        output = [json.loads(x) for x in sdk.files.content(done.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in output] == [f"q{i}" for i in range(6)]
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["object"] == "chat.completion"
                   and 0 < o["response"]["body"]["usage"]["completion_tokens"] <= 4 for o in output)
        errors = [json.loads(x) for x in sdk.files.content(done.error_file_id).text.splitlines()]
        assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == \
            [(None, None), ("s", 400)]
        many = sdk.files.create(file=("many.jsonl", _jsonl(*(_line(f"m{i}", f"Count to {i}", model=model,
                                                                     max_tokens=64) for i in range(48)))),
                                purpose="batch")
        slow = sdk.batches.create(input_file_id=many.id, endpoint=CHAT, completion_window="24h")
        assert sdk.batches.cancel(slow.id).status in ("cancelling", "cancelled")
        cancelled = _sdk_wait(sdk, slow.id)
        assert cancelled.status == "cancelled" and cancelled.request_counts.completed < 48
        assert [b.id for b in sdk.batches.list(limit=1)] == [slow.id, batch.id]   # two pages of one


def _count_done(data_dir: Path) -> int:
    with sqlite3.connect(data_dir / STORE_FILE) as db:
        return db.execute("SELECT count(*) FROM lines WHERE status != 'pending'").fetchone()[0]


def test_a_batch_survives_kill_9_of_the_server_with_no_result_lost_or_doubled(tmp_path, tiny_model):
    model, data = tiny_model.name, tmp_path / "data"
    config = _live_config(tmp_path, tiny_model)
    content = _jsonl(*(_line(f"k{i:03d}", f"Tell story {i}", model=model, max_tokens=16) for i in range(40)))
    server = LiveServer(config, args=["--data-dir", str(data)])
    try:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        file = sdk.files.create(file=("in.jsonl", content), purpose="batch")
        batch = sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
        _sdk_wait(sdk, batch.id, lambda b: b.request_counts.completed >= 16)   # a first wave of 16 lines
        server.proc.kill()                                     # SIGKILL: no clean-up of any kind
        server.proc.wait()
    finally:
        server.stop()
    done_at_kill = _count_done(data)
    assert 16 <= done_at_kill < 40, done_at_kill
    with LiveServer(config, args=["--data-dir", str(data)]) as server:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        done = _sdk_wait(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 40, done
        output = [json.loads(x) for x in sdk.files.content(done.output_file_id).text.splitlines()]
        assert any("resuming 1 unfinished batches" in line for line in server.log), "".join(server.log)
    custom_ids = [o["custom_id"] for o in output]
    assert len(custom_ids) == 40 and sorted(custom_ids) == [f"k{i:03d}" for i in range(40)]
    assert all(o["response"]["status_code"] == 200 for o in output) and done.error_file_id is None


async def test_a_batch_whose_start_failed_is_dropped_and_one_left_half_made_fails_at_the_next_turn(
        aiohttp_client, tmp_path, tiny_model, monkeypatch):
    """The store failing as a batch is started: a 503, and nothing left (it stayed validating for the gateway's
    life, counted against its owner's unfinished batches, expired 24 hours later with an error file). One that
    could not even be dropped is failed at the runner's next turn, not one it is creating."""
    import sqlite3

    as_a = {"headers": {"Authorization": "Bearer key-a"}, "tenants": TENANTS}
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor(), **as_a)
    runner = client.app[BATCHES]
    store = runner.store

    def locked(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(store, "start_batch", locked)
    r = await _upload(client, _jsonl(_line("a"), _line("b")))
    file_id = (await r.json())["id"]
    r = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    assert r.status == 503 and (await client.get("/v1/batches")).status == 200
    assert (await (await client.get("/v1/batches")).json())["data"] == []
    monkeypatch.setattr(store, "drop_batch", locked)
    r = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    assert r.status == 503
    [left] = (await (await client.get("/v1/batches")).json())["data"]
    assert left["status"] == "validating"
    (owner,) = store._db.execute("SELECT owner FROM files WHERE id=?", (file_id,)).fetchone()
    creating, _ = store.begin_batch(file_id, CHAT, "24h", owner=owner, tenant="a")
    runner._creating.add(creating)             # one being created at the turn: kept
    assert store.fail_interrupted(keep=runner._creating) == [left["id"]]
    assert (await (await client.get(f"/v1/batches/{left['id']}")).json())["status"] == "failed"
    assert (await (await client.get(f"/v1/batches/{creating}")).json())["status"] == "validating"
