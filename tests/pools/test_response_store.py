"""`ResponseStore`: kept responses in the batch store's SQLite file, by owner, with their retention."""

from __future__ import annotations

import json
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


def _chain(store: ResponseStore, turns: int, owner: str = "o", size: int = 1000) -> list[list[dict]]:
    """A conversation kept turn by turn, each turn continuing the last (as `previous_response_id` does); each
    turn's whole conversation."""
    items, conversations = [], []
    for turn in range(turns):
        items = items + [{"type": "message", "role": "user", "content": f"{turn}" + "x" * size},
                         {"type": "function_call_output", "call_id": f"c{turn}", "output": "y" * size}]
        store.put(_response(f"resp_{turn}"), owner=owner, tenant="t", request={}, items=items,
                  parent=f"resp_{turn - 1}" if turn else None)
        conversations.append(items)
    return conversations


def _rows(store: ResponseStore) -> int:
    return store._db.execute("SELECT count(*) FROM responses").fetchone()[0]


def test_a_continued_conversation_keeps_each_turns_items_once(tmp_path) -> None:
    """Each turn kept its whole conversation: n turns held n(n+1)/2 turns' items (a 200-turn agent adding 20 KB
    a turn, 405 MB). A continuation keeps the items past its parent's; `get` joins the chain."""
    store = _open(tmp_path)
    conversations = _chain(store, 40)
    for turn in (0, 1, 20, 39):
        assert store.get(f"resp_{turn}", owner="o").items == conversations[turn]
    stored = sum(len(part) for (part,) in store._db.execute("SELECT items FROM responses"))
    assert stored < 1.05 * len(json.dumps(conversations[-1]))   # once, not 20.5 times over
    assert store.get("resp_39", owner="other") is None


def test_a_removed_turn_stays_for_the_turns_that_continue_it_then_goes_with_them(tmp_path) -> None:
    store = _open(tmp_path)
    conversations = _chain(store, 5)
    assert store.delete("resp_2", owner="o") and store.get("resp_2", owner="o") is None
    assert not store.delete("resp_2", owner="o") and not store.update(_response("resp_2", "failed"))
    assert store.get("resp_4", owner="o").items == conversations[4] and _rows(store) == 5   # its items kept
    for turn in (4, 3):
        assert store.delete(f"resp_{turn}", owner="o")
    assert _rows(store) == 2 and store.get("resp_1", owner="o").items == conversations[1]   # 2 went with 3
    for turn in (0, 1):
        store.delete(f"resp_{turn}", owner="o")
    assert _rows(store) == 0


def test_retention_keeps_an_old_turns_items_while_a_newer_turn_continues_it(tmp_path) -> None:
    store = _open(tmp_path, RetentionSpec(retention_days=1, max_per_owner=3))
    old = time.time() - 2 * 86400
    store.put(_response("resp_old", created_at=old), owner="o", tenant="t", request={}, items=[{"n": 0}])
    store.put(_response("resp_new"), owner="o", tenant="t", request={}, items=[{"n": 0}, {"n": 1}], parent="resp_old")
    assert store.purge() == 1 and store.get("resp_old", owner="o") is None
    assert store.get("resp_new", owner="o").items == [{"n": 0}, {"n": 1}]
    conversations = _chain(store, 4)     # past max_per_owner: resp_new and resp_0 go; resp_0 stays for resp_1
    assert store.get("resp_new", owner="o") is None and store.get("resp_0", owner="o") is None
    assert store.get("resp_3", owner="o").items == conversations[3]
    assert _rows(store) == 4


def test_a_turn_continuing_a_response_gone_meanwhile_keeps_its_whole_conversation(tmp_path) -> None:
    """A parent removed (and collected) between the read of `previous_response_id` and the write; and a row of
    a store before version 8, which holds its whole conversation without a length."""
    store = _open(tmp_path)
    items = [{"n": 0}, {"n": 1}]
    store.put(_response("resp_b"), owner="o", tenant="t", request={}, items=items, parent="resp_gone")
    assert store.get("resp_b", owner="o").items == items
    with store._lock:
        store._db.execute("UPDATE responses SET num_items=NULL WHERE id='resp_b'")   # as version 7 wrote it
    store.put(_response("resp_c"), owner="o", tenant="t", request={}, items=items + [{"n": 2}], parent="resp_b")
    assert store._db.execute("SELECT items FROM responses WHERE id='resp_c'").fetchone()[0] == '[{"n": 2}]'
    assert store.get("resp_c", owner="o").items == items + [{"n": 2}]
    store.put(_response("resp_d"), owner="p", tenant="t", request={}, items=items, parent="resp_b")   # not p's
    assert store.get("resp_d", owner="p").items == items


def test_a_branch_point_goes_with_its_last_continuation(tmp_path) -> None:
    store = _open(tmp_path)
    store.put(_response("resp_p"), owner="o", tenant="t", request={}, items=[{"n": 0}])
    for child in ("resp_c1", "resp_c2"):
        store.put(_response(child), owner="o", tenant="t", request={}, items=[{"n": 0}, {"c": child}], parent="resp_p")
    store.put(_response("resp_g"), owner="o", tenant="t", request={}, items=[{"n": 0}, {"c": "resp_c1"}, {"g": 1}],
              parent="resp_c1")
    for gone, left in (("resp_p", 4), ("resp_c1", 4), ("resp_c2", 3), ("resp_g", 0)):
        assert store.delete(gone, owner="o") and _rows(store) == left
    assert store.get("resp_g", owner="o") is None


def _work_of_one_delete(store: ResponseStore) -> int:
    """SQLite virtual-machine steps (in 100s) of deleting a response nothing continues."""
    store.put(_response("resp_plain"), owner="x", tenant="t", request={}, items=[])
    steps = [0]
    store._db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 100)
    assert store.delete("resp_plain", owner="x")
    store._db.set_progress_handler(None, 100)
    return steps[0]


def test_a_removal_reads_its_own_chain_not_every_removed_row_the_store_keeps(tmp_path) -> None:
    """Each removal scanned every removed row still kept for its continuations (all owners'), once per
    generation it freed: 171 ms a DELETE beside 99,000 such rows, 17.7 s to end a 200-turn conversation."""
    for name in ("quiet", "busy"):
        (tmp_path / name).mkdir()
    quiet = _work_of_one_delete(_open(tmp_path / "quiet"))
    store = _open(tmp_path / "busy")
    with store._txn() as db:   # 2,000 conversations of 3 turns, their first two removed, kept for the third
        db.executemany("INSERT INTO responses (id, owner, tenant, created_at, status, background, request, items, "
                       "response, parent, num_items, removed) VALUES (?, 'o', 't', 0, 'completed', 0, '{}', '[]', "
                       "'{}', ?, 0, ?)", ((f"r{k}_{n}", f"r{k}_{n - 1}" if n else None, int(n < 2))
                                          for k in range(2000) for n in range(3)))
    assert _work_of_one_delete(store) <= 2 * quiet + 10
    assert store.delete("r7_2", owner="o") and _rows(store) == 3 * 2000 - 3


def _with_output(response_id: str, *item_ids: str, status: str = "completed") -> dict:
    return {**_response(response_id, status), "output": [
        {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": f"from {response_id}", "annotations": []}]}
        for item_id in item_ids]}


def test_output_items_are_found_by_id_for_their_owner_until_their_response_goes(tmp_path) -> None:
    """`item_reference` reads an output item of a kept response by its id: the owner's alone, the latest response
    that has that id, an item a background run adds when it finishes, none once its response is deleted."""
    store = _open(tmp_path)
    store.put(_with_output("resp_a", "msg_1", "msg_2"), owner="o", tenant="t", request={}, items=[])
    store.put(_with_output("resp_b", "msg_3"), owner="p", tenant="t", request={}, items=[])
    assert store.output_item("msg_2", owner="o")["content"][0]["text"] == "from resp_a"
    assert store.output_item("msg_3", owner="o") is None and store.output_item("msg_9", owner="o") is None
    assert store.output_item("msg_\udcff", owner="o") is None
    store.put(_response("resp_c", "queued"), owner="o", tenant="t", request={}, items=[], background=True)
    assert store.output_item("msg_4", owner="o") is None
    assert store.update(_with_output("resp_c", "msg_4", "msg_1"))   # finished: its items, msg_1 now its own
    assert store.output_item("msg_4", owner="o")["content"][0]["text"] == "from resp_c"
    assert store.output_item("msg_1", owner="o")["content"][0]["text"] == "from resp_c"
    assert store.delete("resp_c", owner="o")
    assert store.output_item("msg_4", owner="o") is None and store.output_item("msg_1", owner="o") is None
    assert store.output_item("msg_2", owner="o") is not None   # resp_a's own stay


def test_a_version_8_store_indexes_the_output_items_it_kept(tmp_path) -> None:
    """A store from before `response_items` (version 8): its kept responses' output items are indexed when it
    migrates, so a reference to them is found after the upgrade."""
    import sqlite3

    store = _open(tmp_path)
    store.put(_with_output("resp_a", "msg_1"), owner="o", tenant="t", request={}, items=[])
    store.close()
    with sqlite3.connect(tmp_path / "store.sqlite3") as db:   # as version 8 left it
        db.execute("DROP TABLE response_items")
        db.execute("PRAGMA user_version=8")
    BatchStore(tmp_path / "store.sqlite3", default_tenant="default").close()   # migrates
    store = ResponseStore(tmp_path / "store.sqlite3")
    assert store.output_item("msg_1", owner="o")["id"] == "msg_1"
    with sqlite3.connect(tmp_path / "store.sqlite3") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 9
