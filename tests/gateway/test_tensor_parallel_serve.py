"""`cliffguard serve` of a device with `tensor_parallel_size: 3` (three processes over gloo on the CPU; a
tiny random Llama of 6 heads and 3 KV heads, one KV head per rank) passes the openai SDK's chat and
stream smoke tests; the group outlives an idle spell longer than its collective timeout, and a follower
rank killed with `kill -9` takes the replica out of `/ready` at once and the restarted one answers.
`slow` tests serve the builtin SmolLM2 (9 heads, 3 KV heads) on three ranks: its tool calls, and ten
idle minutes under the default timeouts."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.conftest import make_tiny_model
from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer, pools_yaml
from tests.gateway.test_tools import MODEL, PROMPTS, SCHEMAS, TOOLS

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


COLLECTIVE_S = 3   # the served group's collective timeout: the idle test waits past it


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, builtin_path):
    """A 2-layer random Llama whose 6 heads and 3 KV heads split over three ranks, with the builtin tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tp3-model"), "llama", builtin_path, vocab_size=49152,
                           hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3,
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tp3_server(tmp_path_factory, tp3_model):
    path = tmp_path_factory.mktemp("tp3") / "pools.yaml"
    ranks = f"tensor_parallel_size: 3, collective_timeout_seconds: {COLLECTIVE_S}"
    path.write_text(pools_yaml(tp3_model, device_keys=ranks))
    server = LiveServer(path)
    yield server
    server.stop()


def _builtin_tp3_config(folder: Path) -> Path:
    """config/pools.yaml (the builtin SmolLM2) on a CPU device of three ranks."""
    text = DEFAULT_CONFIG.read_text().replace("    device: auto ", "    device: cpu ", 1)
    text = text.replace("    tensor_parallel_size: 1 ", "    tensor_parallel_size: 3 ", 1)
    assert "    tensor_parallel_size: 3 " in text and "    device: cpu " in text   # config/pools.yaml's lines moved
    path = folder / "pools.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def sdk(tp3_server):
    return openai.OpenAI(base_url=tp3_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_streamed_equals_non_streamed_on_three_ranks(sdk, tp3_model):
    model = tp3_model.name
    whole = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content and 0 < whole.usage.completion_tokens <= 12
    chunks = list(sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pools = sdk.models.retrieve(model).model_extra["pools"]
    assert {p["tensor_parallel_size"] for p in pools} == {3}


@pytest.mark.slow   # ~60 s; tool grammars are the gateway's, checked on one rank by test_tools.py, TP serving above
def test_tool_calls_whole_and_streamed_on_three_ranks_of_the_builtin_model(tmp_path):
    with LiveServer(_builtin_tp3_config(tmp_path)) as server:
        _tool_calls_whole_and_streamed(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))


def _tool_calls_whole_and_streamed(sdk) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS,
                  tool_choice="required", max_tokens=200, temperature=0, frequency_penalty=0.5)
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls: dict[int, dict] = {}
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def descendants(pid: int) -> dict[int, str]:
    """Every process under `pid` (children, their children ...), each with its command line."""
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(p) for p in f.read().split()]
            except FileNotFoundError:
                continue
            for child in children:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
                except FileNotFoundError:
                    continue
                todo.append(child)
    return found


def followers(server: LiveServer) -> list[int]:
    return sorted(pid for pid, cmd in descendants(server.proc.pid).items() if "follower_main" in cmd)


def ready_status(server: LiveServer) -> int:
    try:
        with urllib.request.urlopen(server.url + "/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def timed_answer(sdk, model: str) -> float:
    started = time.perf_counter()
    reply = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    return time.perf_counter() - started


def test_an_idle_group_outlives_its_collective_timeout(tp3_server, sdk, tp3_model):
    timed_answer(sdk, tp3_model.name)
    ranks = followers(tp3_server)
    assert len(ranks) == 2
    time.sleep(COLLECTIVE_S + 3)   # no collective runs while idle: nothing can time out
    assert followers(tp3_server) == ranks
    timed_answer(sdk, tp3_model.name)
    assert followers(tp3_server) == ranks
    log = "".join(tp3_server.log)
    assert "tensor-parallel rank" not in log and "restarting" not in log


@pytest.mark.slow   # ~17 s; a killed rank takes its group down, and a hung one fails the step, in
# tests/engine/test_tensor_parallel.py
def test_a_killed_follower_rank_restarts_the_replica_and_the_next_request_is_answered(tp3_server, sdk, tp3_model):
    timed_answer(sdk, tp3_model.name)
    ranks = followers(tp3_server)
    os.kill(ranks[-1], signal.SIGKILL)
    killed = time.monotonic()
    while ready_status(tp3_server) == 200:
        assert time.monotonic() - killed < 10, "the replica stayed in /ready 10 s after a rank's death"
        time.sleep(0.1)
    assert timed_answer(sdk, tp3_model.name) > 0   # waits for the restarted group (the gateway holds the request meanwhile)
    new = followers(tp3_server)
    assert len(new) == 2 and not set(new) & set(ranks)
    log = "".join(tp3_server.log)
    assert f"tensor-parallel rank 2 of 3 (pid {ranks[-1]}) exited (signal 9, SIGKILL)" in log


@pytest.mark.slow
def test_ten_idle_minutes_under_the_default_timeouts(tmp_path):
    """Acceptance: a TP 3 replica idle for 10 minutes answers its next request as fast as before, with
    no rank death or restart logged (the default collective timeout, 120 s, and gloo's default, 300 s,
    both pass meanwhile)."""
    with LiveServer(_builtin_tp3_config(tmp_path)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        timed_answer(client, MODEL)
        before = min(timed_answer(client, MODEL) for _ in range(3))
        ranks = followers(server)
        time.sleep(600)
        after = timed_answer(client, MODEL)
        print(f"\nbefore the idle spell {before:.2f} s, after {after:.2f} s")
        assert followers(server) == ranks and after < 2 * before + 0.5
        log = "".join(server.log)
        assert "tensor-parallel rank" not in log and "restarting" not in log
