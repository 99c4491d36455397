"""`cliffguard bench stored`: a Responses API conversation kept turn after turn, as an agent's loop keeps it
(each turn `previous_response_id` the last, adding a user message and a tool output of `--item-bytes` each).

Per turn it times the store's write of the new response (`ResponseStore.put`, synced to disk) and the read of
the whole conversation the next turn continues (`get`), and it sizes the store file (WAL checkpointed) against
the ceiling measured in the same run: the conversation's own JSON bytes, which no store of it can go under
(uncompressed). The sum of the turns' conversations is what keeping each turn whole would hold.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=200, help="turns of the conversation (200)")
    p.add_argument("--item-bytes", type=int, default=10_000, help="text bytes of each of a turn's two items (10000)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _turn_items(turn: int, size: int) -> list[dict]:
    return [{"type": "message", "role": "user", "content": f"turn {turn}: " + "x" * size},
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": "y" * size}]


def _measure(store, path: Path, turns: int, size: int) -> list[dict]:
    rows, items, parent, whole = [], [], None, 0
    marks = {1, turns} | {turns * k // 4 for k in (1, 2, 3)}
    for turn in range(1, turns + 1):
        items = items + _turn_items(turn, size)
        response = {"id": f"resp_{turn}", "object": "response", "created_at": time.time(), "status": "completed",
                    "output": []}
        start = time.perf_counter()
        store.put(response, owner="bench", tenant="bench", request={}, items=items, parent=parent)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        kept = store.get(response["id"], owner="bench")
        get_s = time.perf_counter() - start
        if kept is None or kept.items != items:
            raise RuntimeError(f"turn {turn}: the store did not give back the conversation it was given")
        parent, conversation = response["id"], len(json.dumps(items))
        whole += conversation
        if turn in marks:
            with store._lock:
                store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            size_now = path.stat().st_size
            rows.append({"turn": turn, "put_ms": put_s * 1e3, "get_ms": get_s * 1e3, "store_bytes": size_now,
                         "conversation_bytes": conversation, "store_over_conversation": size_now / conversation,
                         "whole_copies_bytes": whole})
    return rows


def run(args: argparse.Namespace) -> int:
    from pools.store.batch_store import BatchStore
    from pools.store.response_store import ResponseStore

    if args.turns < 1 or args.item_bytes < 0:
        raise ValueError(f"--turns must be >= 1 and --item-bytes >= 0, got {args.turns} and {args.item_bytes}")
    with tempfile.TemporaryDirectory(prefix="cliffguard-bench-stored-") as folder:
        path = Path(folder) / "store.sqlite3"
        BatchStore(path, default_tenant="default").close()
        store = ResponseStore(path)
        try:
            rows = _measure(store, path, args.turns, args.item_bytes)
        finally:
            store.close()
    if args.json:
        print(json.dumps({"turns": args.turns, "item_bytes": args.item_bytes, "rows": rows}, indent=2))
        return 0
    print(f"a conversation of {args.turns} turns, two items of {args.item_bytes} bytes a turn, kept turn by turn")
    for r in rows:
        print(f"  turn {r['turn']:>5}: put {r['put_ms']:7.2f} ms, get {r['get_ms']:7.2f} ms; store "
              f"{r['store_bytes'] / 1e6:8.2f} MB = {r['store_over_conversation']:.2f}x the conversation's "
              f"{r['conversation_bytes'] / 1e6:.2f} MB (whole copies: {r['whole_copies_bytes'] / 1e6:.1f} MB)")
    return 0
