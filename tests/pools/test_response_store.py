"""`ResponseStore`: kept responses in the batch store's SQLite file, by owner, with their retention."""

from __future__ import annotations

import time

import pytest

from pools.store.schema import SCHEMA_VERSION
from pools.store.batch_store import BatchStore
from pools.config.yaml_file import load_config
from pools.config.gateway_spec import RetentionSpec
from pools.store.response_store import ResponseStore
from pools.config.checks import SpecError


def _open(tmp_path, retention: RetentionSpec = RetentionSpec()) -> ResponseStore:
    BatchStore(tmp_path / "store.sqlite3", default_tenant="default").close()
    return ResponseStore(tmp_path / "store.sqlite3", retention)


def _response(response_id: str, status: str = "completed", created_at: float | None = None) -> dict:
    return {"id": response_id, "object": "response", "status": status,
            "created_at": time.time() if created_at is None else created_at, "output": []}


def test_a_response_is_its_owners_alone_and_survives_reopening(tmp_path) -> None:
    store = _open(tmp_path)
    items = [{"type": "message", "role": "user", "content": "hi"}]
    store.put(_response("resp_a"), owner="key-a", tenant="t", request={"input": "hi"}, items=items)
    assert store.get("resp_a", owner="key-b") is None and not store.delete("resp_a", owner="key-b")
    store.close()
    store = ResponseStore(tmp_path / "store.sqlite3")
    kept = store.get("resp_a", owner="key-a")
    assert (kept.request, kept.items, kept.status, kept.tenant) == ({"input": "hi"}, items, "completed", "t")
    assert store.delete("resp_a", owner="key-a") and store.get("resp_a", owner="key-a") is None
    # a URL's byte past UTF-8 reaches an id as a lone surrogate (aiohttp decodes with surrogateescape): an unknown
    # response, as the batch store's ids; sqlite's UnicodeEncodeError was a 500 that the openai SDK retried twice
    assert store.get("resp_\udcff", owner="key-a") is None and not store.delete("resp_\udcff", owner="key-a")


def test_update_leaves_a_cancelled_response_cancelled(tmp_path) -> None:
    store = _open(tmp_path)
    store.put(_response("resp_a", "queued"), owner="o", tenant="t", request={}, items=[], background=True)
    assert [r.id for r in store.unfinished()] == ["resp_a"]
    assert store.update(_response("resp_a", "cancelled"), unless=("completed",))
    assert not store.update(_response("resp_a", "completed"), unless=("cancelled",))
    assert store.get("resp_a", owner="o").status == "cancelled" and store.unfinished() == []


def test_retention_drops_old_and_surplus_finished_responses_never_a_running_one(tmp_path) -> None:
    store = _open(tmp_path, RetentionSpec(retention_days=1, max_per_owner=2))
    day_ago = time.time() - 2 * 86400
    store.put(_response("resp_old", created_at=day_ago), owner="o", tenant="t", request={}, items=[])
    assert store.purge() == 1 and store.get("resp_old", owner="o") is None   # older than a day
    store.put(_response("resp_run", "in_progress", created_at=day_ago), owner="o", tenant="t", request={}, items=[],
              background=True)
    for name in ("resp_1", "resp_2", "resp_3"):
        store.put(_response(name), owner="o", tenant="t", request={}, items=[])
    store.put(_response("resp_x"), owner="other", tenant="t", request={}, items=[])
    assert store.purge() == 0   # the old one in progress stays
    # each write dropped its owner's oldest finished past two (resp_1)
    kept = {name for name in ("resp_run", "resp_1", "resp_2", "resp_3") if store.get(name, owner="o")}
    assert kept == {"resp_run", "resp_2", "resp_3"} and store.get("resp_x", owner="other")


def test_the_table_comes_with_the_batch_store_schema(tmp_path) -> None:
    assert SCHEMA_VERSION >= 4   # the responses table came at 4
    with pytest.raises(RuntimeError, match="BatchStore"):
        ResponseStore(tmp_path / "empty.sqlite3")


@pytest.mark.parametrize("section, key", [("{retention_days: 0}", "retention_days"),
                                          ("{max_per_owner: many}", "max_per_owner"),
                                          ("{keep: 3}", "keep")])
def test_the_yaml_retention_is_checked(section, key) -> None:
    pools = "pools:\n  - {name: chat, model: builtin:smollm2-135m-instruct, kv_share: 0.5}\n"
    with pytest.raises(SpecError, match=f"stored_responses.*{key}"):
        load_config(f"gateway: {{stored_responses: {section}}}\n{pools}", env={})
    config = load_config(f"gateway: {{stored_responses: {{retention_days: 7, max_per_owner: 50}}}}\n{pools}", env={})
    assert config.gateway.stored_responses == RetentionSpec(7, 50)


def test_the_gateway_purges_the_store_every_minute_never_in_a_responses_own_write(tmp_path, monkeypatch) -> None:
    """A response's write (`put`, which its client's last bytes wait for) removes only its owner's surplus; the
    retention's whole-table purge runs on its own every PURGE_EVERY_S (`KeptResponses`), on the store's thread."""
    import asyncio

    from gateway.openai import stored_responses
    from pools.store import response_store

    monkeypatch.setattr(response_store, "PURGE_EVERY_S", 0.0)
    monkeypatch.setattr(stored_responses, "PURGE_EVERY_S", 0.05)
    store = _open(tmp_path, RetentionSpec(retention_days=1, max_per_owner=5))
    day_ago = time.time() - 2 * 86400
    for name in ("resp_old", "resp_new"):
        store.put(_response(name, created_at=day_ago if name == "resp_old" else None), owner="o", tenant="t",
                  request={}, items=[])
    assert store.get("resp_old", owner="o") is not None      # no purge inside a write

    async def scenario() -> None:
        kept = stored_responses.KeptResponses(store, gateway=None)
        await kept.start()
        await asyncio.sleep(0.3)
        assert store.get("resp_old", owner="o") is None and store.get("resp_new", owner="o") is not None
        await kept.stop()

    asyncio.run(scenario())
