"""One client must not stall, deadlock or slow down the gateway for the others (black box, live server).

Each test reproduces a fault seen from outside, asserts that `/health` kept answering within a
second throughout, that another client's request is answered, and (the `live` fixture) that every
pool's KV credits come back to full afterwards.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from tests.reliability.conftest import (MODEL, STALL_SECONDS, Probe, chat, credits, get, post,
                                        resume, silent_client, wait_ready, worker_pid)


@pytest.mark.slow   # ~22 s; sends never block (tests/engine/test_ipc.py), a stopped worker is found stalled
# (tests/reliability/test_worker_faults.py)
def test_a_flood_of_adds_to_a_stopped_worker_never_blocks_the_gateway(live):
    # 1,200 one-token requests (about 750 KB of add commands, several times a socket buffer) reach a
    # worker that does not read: a blocking send would freeze the gateway's event loop for good. The
    # stopped worker, requests in flight, is reported `stalled` by /ready within its stall_seconds.
    pid = worker_pid(live)
    os.kill(pid, signal.SIGSTOP)
    bodies = [{"model": MODEL, "prompt": [[1000 + 8 * i + j] for j in range(200)], "max_tokens": 1}
              for i in range(6)]
    try:
        with Probe(live.url) as probe, concurrent.futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(post, live.url, "/v1/completions", body, timeout=90) for body in bodies]
            started, states = time.monotonic(), []
            while time.monotonic() - started < STALL_SECONDS + 10:
                status, body = get(live.url, "/ready")
                states.append((round(time.monotonic() - started, 1), status, body["devices"]["default"]))
                if status == 503 and "stalled" in body["devices"]["default"]:
                    break
                time.sleep(0.2)
            answers = [future.result() for future in pending]
        probe.assert_healthy()
    finally:
        resume(pid)
    assert states[-1][1] == 503 and "stalled" in states[-1][2], states
    assert states[-1][0] <= STALL_SECONDS + 3, states
    # The watchdog killed the silent worker; the requests, which had produced nothing, ran again on
    # the restarted worker: each answered once, in full.
    assert [status for status, _ in answers] == [200] * 6, answers
    assert all(len(body["choices"]) == 200 for _, body in answers)
    log = "".join(live.log)
    assert "stalled: no word from the device worker" in log and "running it again" in log
    assert get(live.url, "/health")[0] == 200   # liveness of the gateway, not of the worker
    wait_ready(live.url, 60)
    assert worker_pid(live) != pid
    status, body = chat(live.url)
    assert status == 200, body


def test_a_client_that_never_reads_does_not_lock_the_pool(live):
    # A stream of n=28 with 20 top logprobs reserves nearly all of chat's credits and all its running
    # slots; its client never reads. Once the socket buffers are full (megabytes on loopback) the
    # gateway waits write_timeout, aborts it and frees its credits: a request that needs them runs.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "n": 28,
            "max_tokens": 1000, "logprobs": True, "top_logprobs": 20, "stream": True, "temperature": 1.0}
    sock = silent_client(live.url, "/v1/chat/completions", body)
    try:
        with Probe(live.url) as probe:
            time.sleep(1.0)
            free, total = credits(live.url)["chat"]
            assert free < 0.05 * total, (free, total)   # the stream holds the pool
            started = time.monotonic()
            status, answer = chat(live.url, max_tokens=1000, timeout=90)
            waited = time.monotonic() - started
        probe.assert_healthy()
    finally:
        sock.close()
    assert status == 200, answer
    assert waited < 60, waited
    assert "gateway.write_timeout" in "".join(live.log)


def test_more_samples_than_the_pool_runs_at_once_is_a_400_not_a_frozen_queue(live):
    # n above the pool's max_num_seqs could never be scheduled, and the pool's queue is in order:
    # it used to wait forever at the head of the queue, and every chat request behind it too.
    with Probe(live.url) as probe:
        status, body = post(live.url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 64,
                                                          "max_tokens": 8}, timeout=30)
        assert chat(live.url, timeout=30)[0] == 200
    probe.assert_healthy()
    assert status == 400 and body["error"]["param"] == "n", body


def test_a_prompt_list_of_3000_is_refused_at_once_naming_the_field(live):
    with Probe(live.url) as probe:
        started = time.monotonic()
        status, body = post(live.url, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 3000})
        took = time.monotonic() - started
        assert chat(live.url)[0] == 200
    probe.assert_healthy()
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "max_prompts" in body["error"]["message"]
    assert took < 2


def test_a_huge_stop_token_ids_list_is_refused_and_slows_nobody(live):
    baseline = _timed_chat(live.url)
    huge = {"model": MODEL, "prompt": "Hello", "n": 8, "min_tokens": 64, "max_tokens": 64,
            "stop_token_ids": list(range(980_000))}
    with Probe(live.url) as probe, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, live.url, "/v1/completions", huge)
        during = _timed_chat(live.url)
        status, body = pending.result()
    probe.assert_healthy()
    assert status == 400 and body["error"]["param"] == "stop_token_ids", body
    assert during < 2 * baseline + 1.0, (baseline, during)


def _timed_chat(url: str) -> float:
    started = time.monotonic()
    status, body = chat(url, max_tokens=16)
    assert status == 200, body
    return time.monotonic() - started


def test_request_limits_are_400s_naming_the_field(live):
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 200_000},
         "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 200, "n": 64, "max_tokens": 1}, "n"),
        # each of the 100 prompts may run 8,000 tokens, which no pool holds
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 100, "max_tokens": 8000}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 8},
         "max_tokens"),
    ]
    with Probe(live.url) as probe:
        for path, body, param in cases:
            started = time.monotonic()
            status, answer = post(live.url, path, body)
            assert status == 400 and answer["error"]["param"] == param, (param, answer)
            assert time.monotonic() - started < 3, param
    probe.assert_healthy()
    free, total = credits(live.url)["chat"]
    assert free == total
