"""`cliffguard bench admission`: its pool files, the retry policies of its clients (checked against a
stub server that answers 429 with Retry-After), the rate sweep's parsing, its table, and the
idealised pool of `--ideal`."""

from __future__ import annotations

import argparse
import random
import time

import pytest
from aiohttp import web

from bench.admission import (Outcome, Scrapes, _one, add_arguments, format_table, ideal_run, ideal_table,
                             parse_rates, pools_yaml, retry_after_seconds, retry_delay, summarize)
from pools.config.yaml_file import load_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_pool_files_differ_only_in_max_queue_seconds():
    args = _args("--kv-cache", "12MiB")
    queue = load_config(pools_yaml("queue", args), env={}).pools[0]
    reject = load_config(pools_yaml("reject", args), env={}).pools[0]
    assert queue.max_queue_seconds is None and reject.max_queue_seconds == 0
    assert queue.kv_cache_bytes == reject.kv_cache_bytes == 12 << 20


def test_sdk_client_honours_retry_after_and_backs_off_as_openai_python():
    rng = random.Random(0)
    assert retry_delay("sdk", 0, 1.0, 0.5, rng) == 1.0
    assert retry_delay("sdk", 3, 60.0, 0.5, rng) == 60.0
    for retry, full in [(0, 0.5), (1, 1.0), (2, 2.0), (4, 8.0), (9, 8.0)]:
        for retry_after in (None, 0.0, 61.0):           # absent, or outside (0, 60]: exponential back-off
            delay = retry_delay("sdk", retry, retry_after, 0.5, rng)
            assert 0.75 * full <= delay <= full


def test_jitter_client_ignores_retry_after():
    rng = random.Random(1)
    delays = [retry_delay("jitter", 2, 1.0, 0.5, rng) for _ in range(2000)]
    assert 0 <= min(delays) < 0.1 and 1.9 < max(delays) <= 2.0
    assert all(retry_delay("jitter", 10, None, 0.5, rng) <= 8.0 for _ in range(100))


def test_retry_after_header_parsing():
    assert retry_after_seconds("1") == 1.0 and retry_after_seconds("2.5") == 2.5
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None


def test_rates_parse_and_reject_bad_values():
    assert parse_rates("0.5, 1,2") == [0.5, 1.0, 2.0]
    assert parse_rates("4") == [4.0]
    with pytest.raises(ValueError, match="--rate: not a number: 'x'"):
        parse_rates("1,x")
    with pytest.raises(ValueError, match="--rate: must be > 0"):
        parse_rates("0")


async def test_client_retries_429_then_succeeds(aiohttp_client):
    """The sdk client sleeps the server's Retry-After between attempts, and counts every attempt."""
    seen: list[float] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(time.perf_counter())
        if len(seen) < 3:
            return web.json_response({"error": {"code": "pool_full"}}, status=429, headers={"Retry-After": "0.2"})
        return web.json_response({"usage": {"completion_tokens": 7}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    client = await aiohttp_client(app)
    out = Outcome(arrival=0.0)
    args = _args("--client", "sdk", "--max-retries", "2", "--output-tokens", "7")
    await _one(client.session, str(client.make_url("")).rstrip("/"), "hello", out, args, random.Random(0),
               time.perf_counter())
    assert (out.status, out.attempts, out.tokens) == (200, 3, 7)
    assert all(b - a >= 0.19 for a, b in zip(seen, seen[1:]))

    give_up = Outcome(arrival=0.0)
    seen.clear()
    args.max_retries = 1                                     # two attempts, both 429: the client gives up
    await _one(client.session, str(client.make_url("")).rstrip("/"), "hello", give_up, args, random.Random(0),
               time.perf_counter())
    assert (give_up.status, give_up.attempts, give_up.error) == (429, 2, "pool_full")

    async def broken(request: web.Request) -> web.Response:   # a proxy's page, an error that is no object
        return web.Response(text="<html>bad gateway</html>", status=502) if "page" in request.path else \
            web.json_response({"error": "overloaded"}, status=503)

    app = web.Application()
    app.router.add_post("/page/v1/chat/completions", broken)
    app.router.add_post("/flat/v1/chat/completions", broken)
    other = await aiohttp_client(app)
    for prefix, want in (("page", (0, "client: JSONDecodeError")), ("flat", (503, "HTTP 503"))):
        out = Outcome(arrival=0.0)   # this request's outcome, not the run's end (it raised out of the gather)
        await _one(other.session, str(other.make_url("")).rstrip("/") + "/" + prefix, "hi", out, args,
                   random.Random(0), time.perf_counter())
        assert (out.status, out.error) == want and out.done > 0


def test_summary_and_table_per_rate():
    def outcomes(n_ok: int, n_rejected: int, span: float) -> list[Outcome]:
        ok = [Outcome(arrival=0.1 * i, done=span * (i + 1) / n_ok, status=200, attempts=1, tokens=48)
              for i in range(n_ok)]
        return ok + [Outcome(arrival=0.05, done=1.0, status=429, attempts=3, error="pool_full")
                     for _ in range(n_rejected)]

    scrapes = Scrapes([(0.5, 0.5, 0.75), (1.0, 0.7, 0.95)])
    results = [summarize("queue", 1.0, outcomes(10, 0, 10.0), scrapes),
               summarize("reject", 1.0, outcomes(6, 4, 8.0), scrapes)]
    queue, reject = results
    assert queue["goodput_rps"] == pytest.approx(1.0) and reject["goodput_rps"] == pytest.approx(0.75)
    assert reject["rejected"] == 4 and reject["wasted_attempts"] == 12
    assert queue["kv_idle_fraction"] == pytest.approx(0.4) and queue["credits_idle_fraction"] == pytest.approx(0.15)
    table = format_table(results)
    assert "rate 1: goodput queue / reject 1.33x requests/s" in table
    # reject's p99 is over the 6 it answered, not the 4 it gave up on: no ratio of the two
    assert "e2e p99 - (over answered requests only: 4 given up)" in table
    assert "* p99 of fewer than 100 answered requests: a lower bound on the tail" in table   # 10 and 6 answered
    none = summarize("queue", 1.0, [Outcome(arrival=0.1, done=0.2, status=400, attempts=1)], scrapes)
    assert none["e2e_p99_s"] is None   # no request answered (every one refused): no latency, no crash
    assert "-        -" in format_table([none, reject]) and "e2e p99 -" in format_table([none, reject])


def test_ideal_pool_queue_never_loses_and_is_never_slower():
    """The idealised pool: the queue answers every request and keeps the slots at least as busy;
    reject-when-full under an overload loses some and wastes attempts; below capacity nothing waits."""
    args = _args("--duration", "60")
    args.max_retries = 2
    over_q = ideal_run("queue", 1.0, args, 2, 4.0, seed=3)
    over_r = ideal_run("reject", 1.0, args, 2, 4.0, seed=3)
    assert over_q["answered"] == over_q["requests"] and over_q["wasted_attempts"] == 0
    assert over_r["rejected"] > 0 and over_r["wasted_attempts"] > over_r["rejected"]
    assert over_q["goodput_rps"] > over_r["goodput_rps"] and over_q["goodput_rps"] <= 2 / 4.0 + 1e-9
    assert over_q["slots_idle_fraction"] < over_r["slots_idle_fraction"]
    light = ideal_run("reject", 0.5, args, 8, 1.0, seed=0)        # far below capacity: all fit at once
    assert light["requests"] > 10 and light["rejected"] == 0 and light["wasted_attempts"] == 0
    with pytest.raises(ValueError, match="no request arrives"):
        ideal_run("queue", 1e-6, args, 2, 4.0, seed=0)


def test_a_served_run_that_draws_no_request_is_refused_before_its_server_starts(tmp_path, monkeypatch):
    """`max()` of no outcome raised after its server had run, naming nothing."""
    import asyncio

    import bench.admission as admission

    monkeypatch.setattr(admission, "LiveServer", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(ValueError, match="--rate: 1e-06 requests/s over --duration 30 s drew no request"):
        asyncio.run(admission.run_mode("queue", 1e-6, _args("--duration", "30"), tmp_path))


def test_ideal_table_and_its_errors():
    args = _args("--ideal", "2,4", "--duration", "30")
    args.max_retries = 2
    table = ideal_table(args, [0.5, 2.0], ["queue", "reject"], seeds=2)
    assert "capacity 0.50 req/s" in table and "rate 0.5: goodput queue / reject" in table
    assert "rate 2: goodput queue / reject" in table
    args.seed = 5   # --seed moves the arrival sequences (it did nothing with --ideal)
    shifted = ideal_table(args, [0.5, 2.0], ["queue", "reject"], seeds=2)
    assert "2 seeds from 5" in shifted and shifted.splitlines()[2:] != table.splitlines()[2:]
    for bad in ("2", "x,4", "0,4", "2,-1"):
        args.ideal = bad
        with pytest.raises(ValueError, match="--ideal"):
            ideal_table(args, [1.0], ["queue"], seeds=1)


@pytest.mark.parametrize("tokens", ["0", "129", "300"])
def test_output_tokens_past_the_pools_context_are_refused_before_any_server_starts(capsys, tokens):
    """300 tokens once ran the whole load, every request a 400 (past max_model_len 256), then the table
    died formatting the missing latencies."""
    from gateway.cli import main

    assert main(["bench", "admission", "--output-tokens", tokens]) == 2
    assert capsys.readouterr().err.strip() == (f"cliffguard bench: error: --output-tokens: must be 1 to 128 (the bench "
                                               f"pool's max_model_len is 256), got {tokens}")


@pytest.mark.parametrize("argv", [["--modes", ","], ["--modes", "queue,queue"], ["--modes", "queue,drop"],
                                  ["--seed", "-1"], ["--duration", "inf"], ["--backoff", "nan"],
                                  ["--max-retries", "-1"]])
def test_modes_are_one_or_both_named_once_and_a_seed_numpy_takes_or_refused_before_any_server(capsys, argv):
    """`--modes ,` printed a table's header and exited 0; a mode named twice ran twice; a negative seed reached
    numpy's generator after the server had started; a --duration of inf (or a --backoff of nan) passed '> 0'."""
    from gateway.cli import main

    assert main(["bench", "admission", *argv]) == 2
    assert f"{argv[0]}" in capsys.readouterr().err
