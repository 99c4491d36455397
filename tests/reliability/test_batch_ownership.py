"""Batch API ownership from outside, against `cliffguard serve` over the tiny model: keys `sk-a` and
`sk-b` in `gateway.api_keys` with a `tenants:` section that lists neither (so both are tenant
`default`) must not reach each other's files and batches — the bug was a 200 for `sk-b` reading
`sk-a`'s batch input file — while the keys of a tenant with `share_files: true` do share theirs.
After each scenario the server still answers `/health` within a second and the pools' KV credits are
all free again."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import openai
import pytest

from tests.gateway.conftest import LiveServer, pools_yaml, tiny_model  # noqa: F401 - tiny_model: a fixture

CHAT = "/v1/chat/completions"
FINAL = ("completed", "cancelled", "failed", "expired")
UNLISTED = """
tenants:
  nightly: {api_keys: [sk-n], weight: 2}
"""
SHARING = UNLISTED + "  team: {api_keys: [sk-t1, sk-t2], share_files: true}\n"
NO_FILE, NO_BATCH = "file-" + "0" * 24, "batch_" + "0" * 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    """One server for both scenarios: `sk-a` and `sk-b` are in no tenant (so `default`), `team` shares."""
    path = tmp_path_factory.mktemp("ownership") / "pools.yaml"
    path.write_text(pools_yaml(tiny_model, api_keys='["sk-a", "sk-b"]') + SHARING)
    with LiveServer(path) as live:
        yield live


def _sdk(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _input(model: str, *names: str) -> bytes:
    return b"".join(json.dumps({"custom_id": name, "method": "POST", "url": CHAT, "body": {
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Say {name}"}]}}).encode() + b"\n"
        for name in names)


def _wait_done(sdk: openai.OpenAI, batch_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while (batch := sdk.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def _assert_hidden(call, hidden_id: str, unknown_id: str, error=openai.NotFoundError) -> None:
    """`call(hidden_id)` (another owner's id) fails exactly as `call(unknown_id)` (an id nobody has)."""
    seen = []
    for key in (hidden_id, unknown_id):
        with pytest.raises(error) as info:
            call(key)
        seen.append((info.value.status_code, json.dumps(info.value.body).replace(key, "<id>")))
    assert seen[0] == seen[1], seen


def _assert_server_well(server: LiveServer) -> None:
    """`/health` answers within a second, and every pool's KV credits are free again."""
    started = time.monotonic()
    with urllib.request.urlopen(server.url + "/health", timeout=1) as r:
        assert r.status == 200 and time.monotonic() - started < 1
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = dict(re.findall(r'^cliffguard_kv_credits\{pool="(\w+)",replica="0"\} (\S+)$', text, re.M))
        free = dict(re.findall(r'^cliffguard_kv_credits_free\{pool="(\w+)",replica="0"\} (\S+)$', text, re.M))
        if total and free == total:
            return
        assert time.monotonic() < deadline, (total, free)
        time.sleep(0.1)


def test_a_key_cannot_reach_another_keys_files_and_batches_when_both_are_the_default_tenant(server, tiny_model):
    sdk_a, sdk_b = _sdk(server, "sk-a"), _sdk(server, "sk-b")
    file = sdk_a.files.create(file=("in.jsonl", _input(tiny_model.name, "a1", "a2")), purpose="batch")
    batch = sdk_a.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    _assert_hidden(sdk_b.files.retrieve, file.id, NO_FILE)
    _assert_hidden(sdk_b.files.content, file.id, NO_FILE)
    _assert_hidden(sdk_b.batches.retrieve, batch.id, NO_BATCH)
    _assert_hidden(sdk_b.batches.cancel, batch.id, NO_BATCH)
    _assert_hidden(lambda i: sdk_b.batches.create(input_file_id=i, endpoint=CHAT, completion_window="24h"),
                   file.id, NO_FILE, openai.BadRequestError)
    assert sdk_b.batches.list().data == []
    done = _wait_done(sdk_a, batch.id)                               # B's cancel did not reach it
    assert done.status == "completed" and done.request_counts.completed == 2, done
    _assert_hidden(sdk_b.files.content, done.output_file_id, NO_FILE)
    assert [json.loads(x)["custom_id"] for x in sdk_a.files.content(done.output_file_id).text.splitlines()] == \
        ["a1", "a2"]
    assert sdk_a.files.content(file.id).content == _input(tiny_model.name, "a1", "a2")
    _assert_server_well(server)


def test_the_keys_of_a_tenant_with_share_files_reach_each_others_files_and_batches(server, tiny_model):
    sdk_t1, sdk_t2, sdk_a = _sdk(server, "sk-t1"), _sdk(server, "sk-t2"), _sdk(server, "sk-a")
    content = _input(tiny_model.name, "t1", "t2")
    file = sdk_t1.files.create(file=("in.jsonl", content), purpose="batch")
    assert sdk_t2.files.retrieve(file.id).bytes == len(content) and sdk_t2.files.content(file.id).content == content
    batch = sdk_t2.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    done = _wait_done(sdk_t1, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    assert sdk_t2.files.content(done.output_file_id).text.count("custom_id") == 2
    assert [b.id for b in sdk_t1.batches.list()] == [b.id for b in sdk_t2.batches.list()] == [batch.id]
    _assert_hidden(sdk_a.files.retrieve, file.id, NO_FILE)          # a key outside the tenant: nothing
    _assert_hidden(sdk_a.batches.retrieve, batch.id, NO_BATCH)
    assert batch.id not in [b.id for b in sdk_a.batches.list()]
    _assert_server_well(server)
