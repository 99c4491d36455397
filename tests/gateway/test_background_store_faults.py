"""gateway.openai.stored_responses: a background response's store writes fail for storage (an injected
sqlite3.OperationalError: disk full, locked past the busy timeout). One failure is tried again and the run goes
on; failures past the tries leave the response `failed` naming the error; neither leaves it `queued` with nothing
running it, nor ends its run as a task error nobody reads."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path

from gateway.app import create_app
from gateway.openai.stored_responses import RESPONSES
from gateway.runtime import Gateway
from pools.config.yaml_file import load_config
from tests.gateway.conftest import chat_pool_yaml, pools_yaml

LOCKED = "database is locked"


async def _client(aiohttp_client, tmp_path: Path, tiny_model: Path):
    """An app with a data dir and no device worker; a background run's answer is a stand-in (`_answered`)."""
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model))
    gateway = Gateway.from_config(load_config(path))
    gateway.engines = {}      # no device worker to spawn: the stand-in answer never reaches one
    app = create_app(gateway, data_dir=tmp_path)
    kept = app[RESPONSES]
    kept.retry_first_s = kept.retry_max_s = 0.01
    kept.max_store_attempts = 3

    async def answered(stored):
        await kept.started(stored)   # as an admitted run does
        return {**stored.response, "status": "completed", "output": []}

    kept._answer = answered
    return await aiohttp_client(app), kept


def _failing(kept, times: int) -> list[dict]:
    """`kept.store.update` raising a storage error on its first `times` calls; every response it was called with."""
    calls, real = [], kept.store.update

    def update(response, **kwargs):
        calls.append(response)
        if len(calls) <= times:
            raise sqlite3.OperationalError(LOCKED)
        return real(response, **kwargs)

    kept.store.update = update
    return calls


async def _settled(client, response_id: str, timeout: float = 10.0) -> dict:
    """The response once it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout
    while (response := await (await client.get(f"/v1/responses/{response_id}")).json())["status"] in (
            "queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {response['status']} after {timeout:g} s"
        await asyncio.sleep(0.02)
    return response


async def _background(client, tiny_model: Path) -> str:
    r = await client.post("/v1/responses", json={"model": tiny_model.name, "input": "hi", "background": True})
    assert r.status == 200, await r.text()
    queued = await r.json()
    assert queued["status"] == "queued"
    return queued["id"]


def _unretrieved() -> list[dict]:
    """The loop's exception-handler calls, kept (a task error nobody read is reported there once the task goes)."""
    seen: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))
    return seen


async def test_a_failed_first_store_write_is_tried_again_and_the_run_goes_on(aiohttp_client, tmp_path, tiny_model,
                                                                            caplog):
    client, kept = await _client(aiohttp_client, tmp_path, tiny_model)
    seen = _unretrieved()
    calls = _failing(kept, 1)
    response = await _settled(client, await _background(client, tiny_model))
    assert response["status"] == "completed"
    assert [c["status"] for c in calls] == ["in_progress", "in_progress", "completed"]
    assert f"response store: {LOCKED} (update); trying again" in caplog.text
    assert not kept._runs and not seen


async def test_a_store_failing_past_its_tries_leaves_the_response_failed_saying_why(aiohttp_client, tmp_path,
                                                                                   tiny_model):
    client, kept = await _client(aiohttp_client, tmp_path, tiny_model)
    seen = _unretrieved()
    calls = _failing(kept, kept.max_store_attempts)   # every try to mark it in progress; its failure is kept
    response = await _settled(client, await _background(client, tiny_model))
    assert response["status"] == "failed", response
    assert response["error"]["code"] == "server_error" and LOCKED in response["error"]["message"]
    assert response["error"]["message"].startswith("storage_unavailable: ")
    assert [c["status"] for c in calls] == ["in_progress"] * kept.max_store_attempts + ["failed"]
    assert not kept._runs and not seen


async def test_a_store_that_cannot_even_keep_the_failure_logs_it_and_leaves_it_for_the_next_start(
        aiohttp_client, tmp_path, tiny_model, caplog):
    client, kept = await _client(aiohttp_client, tmp_path, tiny_model)
    seen = _unretrieved()
    calls = _failing(kept, 2 * kept.max_store_attempts)
    response_id = await _background(client, tiny_model)
    deadline = time.monotonic() + 10
    while len(calls) < 2 * kept.max_store_attempts or kept._runs:
        assert time.monotonic() < deadline, [c["status"] for c in calls]
        await asyncio.sleep(0.02)
    assert f"{response_id}: its end could not be kept" in caplog.text
    assert [s.id for s in kept.store.unfinished()] == [response_id]   # the next start runs it again
    assert not seen


async def _served(aiohttp_client, tmp_path: Path, tiny_model: Path):
    """An app with a data dir and the tiny model's worker on the CPU, ready; its kept responses tried 3 times."""
    path = tmp_path / "pools.yaml"
    path.write_text(chat_pool_yaml(tiny_model, max_model_len=512))
    gateway = Gateway.from_config(load_config(path))
    app = create_app(gateway, data_dir=tmp_path)
    client = await aiohttp_client(app)
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.1)
    kept = app[RESPONSES]
    kept.max_store_attempts = 3
    return client, kept, gateway.pools["chat"].admission


def _failing_in_progress(kept) -> list[dict]:
    """`kept.store.update` raising a storage error whenever it is to mark a response `in_progress`."""
    calls, real = [], kept.store.update

    def update(response, **kwargs):
        calls.append(response)
        if response["status"] == "in_progress":
            raise sqlite3.OperationalError(LOCKED)
        return real(response, **kwargs)

    kept.store.update = update
    return calls


async def test_an_admitted_run_does_not_wait_on_a_store_write_being_tried_again(aiohttp_client, tmp_path, tiny_model):
    """Its `in_progress` is written beside the engine request: a store backing off (30 s here) holds no credits
    idle; the run answers, the mark still waiting is dropped, and its end is kept."""
    client, kept, queue = await _served(aiohttp_client, tmp_path, tiny_model)
    kept.retry_first_s = kept.retry_max_s = 30.0
    calls, free = _failing_in_progress(kept), queue.free
    r = await client.post("/v1/responses", json={"model": tiny_model.name, "input": "hi", "background": True,
                                                 "max_output_tokens": 4})
    response = await _settled(client, (await r.json())["id"])
    assert response["status"] in ("completed", "incomplete") and response["output"], response
    assert [c["status"] for c in calls] == ["in_progress", response["status"]]
    assert queue.free == free and not kept._runs


async def test_a_store_failing_for_good_as_a_run_starts_aborts_its_engine_request(aiohttp_client, tmp_path,
                                                                                 tiny_model):
    """The mark beside a long run fails past its tries: the run is cut (its engine request aborted, its credits
    back) and the response is `failed` naming the store's error, as when the store fails before it starts."""
    client, kept, queue = await _served(aiohttp_client, tmp_path, tiny_model)
    kept.retry_first_s = kept.retry_max_s = 0.01
    calls, free = _failing_in_progress(kept), queue.free
    r = await client.post("/v1/responses", json={"model": tiny_model.name, "input": "hi", "background": True,
                                                 "max_output_tokens": 480, "temperature": 0})
    response = await _settled(client, (await r.json())["id"])
    assert response["status"] == "failed" and response["error"]["message"].startswith("storage_unavailable: ")
    assert [c["status"] for c in calls] == ["in_progress"] * kept.max_store_attempts + ["failed"]
    aborted = r'^cliffguard_num_aborted_requests_total\{[^}]*pool="chat"[^}]*\} 1\.0$'
    for _ in range(50):   # the worker's stats push after the abort (every 0.5 s; later on a loaded machine)
        metrics = await (await client.get("/metrics")).text()
        if re.search(aborted, metrics, re.M):
            break
        await asyncio.sleep(0.1)
    assert re.search(aborted, metrics, re.M), metrics
    assert queue.free == free and not kept._runs


async def test_a_damaged_store_file_is_a_storage_error_not_a_500(aiohttp_client, tmp_path, tiny_model, caplog):
    """SQLite's DatabaseError (a damaged file: "database disk image is malformed") is a storage error as a locked
    or full one is: a finished answer is not kept (it came back as a 500, its tokens spent), a background one is a
    503 `storage_unavailable`."""
    client, kept = await _client(aiohttp_client, tmp_path, tiny_model)

    def damaged(*args, **kwargs):
        raise sqlite3.DatabaseError("database disk image is malformed")

    kept.store.put = damaged
    final = {"id": "resp_damaged", "object": "response", "status": "completed", "output": []}
    assert await kept.keep(final, owner="o", tenant="t", request={}, items=[]) is False
    assert "resp_damaged: answered but not kept: " in caplog.text
    r = await client.post("/v1/responses", json={"model": tiny_model.name, "input": "hi", "background": True})
    body = await r.json()
    assert r.status == 503 and body["error"]["code"] == "storage_unavailable", body


async def test_a_damaged_store_is_not_tried_again_and_stops_the_start_in_one_line(aiohttp_client, tmp_path,
                                                                                  tiny_model):
    """No retry mends a damaged file: tried once (it was tried 6 times over 15 s, a run's or a start's); found at
    the start, `serve` says so in one line naming the file (a traceback, after those 15 s)."""
    import pytest

    client, kept = await _client(aiohttp_client, tmp_path, tiny_model)
    calls = []

    def damaged(*args, **kwargs):
        calls.append(1)
        raise sqlite3.DatabaseError("file is not a database")

    with pytest.raises(sqlite3.OperationalError, match="the store file is damaged: file is not a database"):
        await kept.store.retried("response store", damaged, tries=6, first_s=5.0, max_s=5.0)
    assert calls == [1]

    path = tmp_path / "pools.yaml"
    gateway = Gateway.from_config(load_config(path))
    gateway.engines = {}
    (tmp_path / "second").mkdir()
    app = create_app(gateway, data_dir=tmp_path / "second")
    app[RESPONSES].store.unfinished = damaged
    with pytest.raises(RuntimeError, match=r"^--data-dir: the store .*batches\.sqlite3 cannot be read \(.*damaged"):
        await aiohttp_client(app)
