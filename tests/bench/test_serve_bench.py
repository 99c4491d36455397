"""`cliffguard bench serve`: arrivals, workload files, SSE parsing and summaries in milliseconds; whole runs
against a fake streaming OpenAI server (aiohttp test server, loopback only); one run of the command against
a live `cliffguard serve` on the builtin model."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import time

import numpy as np
import pytest
from aiohttp import web

from bench import serve
from bench.load.sender import DONE, RequestRecord, error_message, parse_sse_line
from bench.load.plan import Goodput, LoadConfig, PromptMaker, arrival_schedule, plan_requests, request_body
from bench.load.report import class_summary, format_report, write_report
from bench.load.run import run_load
from engine.stats import PoolStats
from gateway.cli import main
from gateway.monitoring.metrics import GatewayMetrics
from pools.config.spec import SpecError
from pools.workload import WORKLOAD_DIR, LengthDist, WorkloadClass, gamma_arrivals, latency_stats, load_workload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The fake server's behaviour is chosen by max_tokens (the prompts are random words).
OK_TOKENS, BAD_TOKENS, HANG_TOKENS, BROKEN_TOKENS = 4, 3, 5, 7
CHUNK_DELAY = 0.01
STATE = web.AppKey("state", dict)


def _fixed(name: str, output_len: int, *, endpoint: str = "chat", **kwargs) -> WorkloadClass:
    return WorkloadClass(name, prompt_len=LengthDist("fixed", value=8),
                         output_len=LengthDist("fixed", value=output_len), endpoint=endpoint, **kwargs)


async def _send_json(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


async def _stream_reply(response: web.StreamResponse, n: int, chat: bool) -> None:
    """`n` content chunks CHUNK_DELAY s apart, the usage chunk and [DONE] (or a hang, or an error chunk)."""
    if chat:
        await _send_json(response, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(n):
        if n == HANG_TOKENS and i == 1:
            await asyncio.sleep(3600)
        if n == BROKEN_TOKENS and i == 1:
            await _send_json(response, {"error": {"message": "engine unavailable", "type": "server_error"}})
            break
        await asyncio.sleep(CHUNK_DELAY)
        choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
        choice["finish_reason"] = "length" if i == n - 1 else None
        await _send_json(response, {"choices": [choice], "usage": None})
    else:
        await _send_json(response, {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n,
                                                             "total_tokens": 11 + n}})
    await response.write(b"data: [DONE]\n\n")


def _make_fake_app(*, metrics: bool = True, first_delay: float = 0.0) -> web.Application:
    """A streaming OpenAI-compatible stand-in, behaviour chosen by `max_tokens`: a 400 for BAD_TOKENS, a
    stream that never ends for HANG_TOKENS, an error chunk after one content chunk for BROKEN_TOKENS, else
    `max_tokens` chunks. /metrics renders the gateway's own registry (preemptions grow at each scrape)."""
    app = web.Application()
    app[STATE] = state = {"in_flight": 0, "max_in_flight": 0, "bodies": [], "scrapes": 0}
    registry = GatewayMetrics()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["bodies"].append(body)
        if body["max_tokens"] == BAD_TOKENS:
            return web.json_response({"error": {"message": "max_tokens: 3 is refused here", "type": "invalid"}},
                                     status=400)
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-cliffguard-pool": "chat"})
            await response.prepare(request)
            await asyncio.sleep(first_delay)
            await _stream_reply(response, body["max_tokens"], chat="messages" in body)
            return response
        finally:
            state["in_flight"] -= 1

    async def metrics_endpoint(request: web.Request) -> web.Response:
        state["scrapes"] += 1
        stats = PoolStats(num_running=state["in_flight"], num_waiting=1, num_swapped=0, num_blocks=64,
                          num_free_blocks=48, num_cached_free_blocks=0, kv_cache_usage=0.25, max_num_seqs=8,
                          cpu_swap_usage=0.0, num_recompute_preemptions=state["scrapes"],
                          num_swap_preemptions=2 * state["scrapes"])
        registry.update_pool("chat", 0, stats, block_bytes=1024)
        registry.device_overloaded.labels(device="cpu").set(0)   # a device's series: no pool label
        return web.Response(body=registry.render(), headers={"Content-Type": registry.content_type})

    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    if metrics:
        app.router.add_get("/metrics", metrics_endpoint)
    return app


def _url(server) -> str:
    return str(server.make_url("")).rstrip("/")


def _config(server, classes, **kwargs) -> LoadConfig:
    defaults = dict(model="fake", request_rate=50.0, timeout=5.0, drain_timeout=5.0, scrape_interval=0.1)
    return LoadConfig(url=_url(server), classes=tuple(classes), **{**defaults, **kwargs})


# --- arrivals ----------------------------------------------------------------------------------------------

def test_gamma_arrivals_have_the_asked_rate_and_repeat_for_a_seed():
    times = gamma_arrivals(5.0, 1.0, np.random.default_rng(7), count=20000)
    assert np.all(np.diff(times) > 0)
    assert np.mean(np.diff(times)) == pytest.approx(0.2, rel=0.03)
    assert np.array_equal(times, gamma_arrivals(5.0, 1.0, np.random.default_rng(7), count=20000))
    assert not np.array_equal(times, gamma_arrivals(5.0, 1.0, np.random.default_rng(8), count=20000))
    bounded = gamma_arrivals(20.0, 1.0, np.random.default_rng(1), duration=100.0)
    assert bounded.max() < 100.0 and len(bounded) == pytest.approx(2000, rel=0.06)
    both = gamma_arrivals(20.0, 1.0, np.random.default_rng(1), duration=100.0, count=50)
    assert np.array_equal(both, bounded[:50])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_variance_not_the_mean(burstiness):
    gaps = np.diff(gamma_arrivals(10.0, burstiness, np.random.default_rng(3), count=40000), prepend=0.0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.04)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)  # squared CV = 1/shape


def test_schedule_splits_the_rate_by_share_and_adds_own_rates_and_probes():
    classes = (_fixed("a", 4, share=3), _fixed("b", 4, share=1), _fixed("c", 4, rate=2.0))
    config = LoadConfig(url="http://127.0.0.1:1", classes=classes, request_rate=8.0, duration=200.0, probe_rate=1.0)
    assert config.class_rates == {"a": 6.0, "b": 2.0, "c": 2.0}
    schedule = arrival_schedule(config)
    counts = {name: sum(c.name == name for _, c in schedule) for name in ("a", "b", "c", "probe")}
    for name, rate in (("a", 6.0), ("b", 2.0), ("c", 2.0), ("probe", 1.0)):
        assert counts[name] == pytest.approx(rate * 200, rel=0.1), name
    assert [t for t, _ in schedule] == sorted(t for t, _ in schedule)
    capped = arrival_schedule(LoadConfig(url="http://127.0.0.1:1", classes=classes, num_requests=25))
    assert len(capped) == 25
    plan = plan_requests(config)
    assert [(p.arrival_s, p.prompt, p.max_tokens) for p in plan] == \
        [(p.arrival_s, p.prompt, p.max_tokens) for p in plan_requests(config)]
    assert len({p.prompt.split()[0] + p.prompt.split()[1] for p in plan}) > len(plan) // 4  # random prefixes


def test_infinite_rate_sends_everything_at_once_by_share():
    config = LoadConfig(url="http://127.0.0.1:1", classes=(_fixed("a", 4, share=1), _fixed("b", 4, share=3)),
                        request_rate=float("inf"), num_requests=400)
    schedule = arrival_schedule(config)
    assert len(schedule) == 400 and all(t == 0.0 for t, _ in schedule)
    assert sum(c.name == "b" for _, c in schedule) == pytest.approx(300, rel=0.15)


# --- lengths, prompts, workload files ------------------------------------------------------------------------

def test_length_distributions_stay_in_their_bounds():
    rng = random.Random(0)
    normal = LengthDist("normal", mean=100, std=50, min=20, max=150)
    values = [normal.sample(rng) for _ in range(5000)]
    assert min(values) == 20 and max(values) == 150 and np.mean(values) == pytest.approx(98, rel=0.05)
    uniform = [LengthDist("uniform", min=3, max=5).sample(rng) for _ in range(300)]
    assert set(uniform) == {3, 4, 5}
    assert LengthDist("fixed", value=9).sample(rng) == 9


def test_prompts_are_about_one_token_per_word_and_exact_with_the_tokenizer(builtin_path):
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(builtin_path)
    rng = random.Random(1)
    plain, exact = PromptMaker(), PromptMaker(tokenizer)
    for n in (1, 8, 100, 1000):
        assert len(tokenizer.encode(plain.make(rng, n, chat=False))) == pytest.approx(n, rel=0.1, abs=1)
        assert len(tokenizer.encode(exact.make(rng, n, chat=False))) == n
        assert len(tokenizer.encode(exact.make(rng, n, chat=True), add_special_tokens=False)) == n


def test_shipped_workloads_load_by_path_and_by_name():
    files = sorted(WORKLOAD_DIR.glob("*.yaml"))
    assert {f.stem for f in files} >= {"chat", "rag", "mixed"}
    for path in files:
        assert load_workload(path) == load_workload(path.stem)
    mixed = {c.name: c for c in load_workload("mixed")}
    assert mixed["rag"].endpoint == "completion" and mixed["chat"].share == 0.8


@pytest.mark.parametrize("text, message", [
    ("classes: []", r"classes: must not be empty"),
    ("clases: []", r"clases: unknown key"),
    ("classes: [{name: a, prompt_len: 8}]", r"classes\[0\]\.output_len: is required"),
    ("classes: [{name: a, prompt_len: 8, output_len: 0}]", r"classes\[0\]\.output_len\.value: .*got 0"),
    ("classes: [{name: a, prompt_len: 8.5, output_len: 4}]", r"classes\[0\]\.prompt_len: must be a token count.*8\.5"),
    ("classes: [{name: a, prompt_len: {dist: gauss, mean: 3}, output_len: 4}]",
     r"classes\[0\]\.prompt_len\.dist: must be one of fixed, normal, uniform, got 'gauss'"),
    ("classes: [{name: a, prompt_len: {dist: uniform, min: 9, max: 3}, output_len: 4}]",
     r"classes\[0\]\.prompt_len\.max: must be >= min 9, got 3"),
    ("classes: [{name: a, prompt_len: {dist: fixed, value: 8, std: 2}, output_len: 4}]",
     r"classes\[0\]\.prompt_len\.std: not used by dist fixed"),
    ("classes: [{name: a, prompt_len: {dist: normal, mean: 8}, output_len: 4}]",
     r"classes\[0\]\.prompt_len\.std: required"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4, endpoint: embeddings}]",
     r"classes\[0\]\.endpoint: must be one of chat, completion, got 'embeddings'"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4, share: -1}]", r"classes\[0\]\.share: must be > 0\.0, got -1"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4, share: 1, rate: 2}]", r"classes\[0\]\.rate: give share or"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4, ignore_eos: 'yes'}]", r"classes\[0\]\.ignore_eos: .*'yes'"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4}, {name: a, prompt_len: 8, output_len: 4}]",
     r"classes\[1\]\.name: 'a' is used"),
    ("classes: [{name: 'a b', prompt_len: 8, output_len: 4}]", r"classes\[0\]\.name: .*'a b'"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4, colour: red}]", r"classes\[0\]\.colour: unknown key"),
    ("classes: [{name: a, prompt_len: 8, output_len: 4\n", r"YAML error at line"),
])
def test_workload_errors_name_the_key_path_and_value(tmp_path, text, message):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message) as info:
        load_workload(path)
    assert str(path) in str(info.value)


def test_a_missing_workload_names_the_builtin_ones():
    with pytest.raises(SpecError, match="built-in names: chat, mixed, rag"):
        load_workload("nosuch")


@pytest.mark.parametrize("kwargs, message", [
    ({"duration": None}, "duration: give a duration"), ({"request_rate": 0}, "request_rate: must be > 0"),
    ({"burstiness": -1}, "burstiness"), ({"burstiness": 0.005}, r"burstiness: must be >= 0.01 \(1 is Poisson\)"),
    ({"url": "127.0.0.1:8000"}, "url: must be an http"),
    ({"num_requests": 0}, "num_requests"), ({"request_rate": float("inf")}, "request_rate: inf needs"),
    ({"probe_rate": 1, "classes": (_fixed("probe", 4),)}, "classes: names must be unique"),
])
def test_bad_load_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(**{"url": "http://127.0.0.1:8000", "duration": 1.0, **kwargs})


def test_command_line_errors_name_the_option():
    with pytest.raises(ValueError, match="--request-rate: must be > 0"):
        serve.config_from_args(_parse(["--request-rate", "-2"]))
    assert main(["bench", "serve", "--scrape-interval", "0"]) == 2  # the CLI prints the error, no traceback
    with pytest.raises(ValueError, match="goodput: expected distinct KEY:MS"):
        serve.config_from_args(_parse(["--goodput", "ttft=5"]))
    assert serve.config_from_args(_parse([])).duration == 10.0
    assert serve.config_from_args(_parse(["--num-requests", "3"])).duration is None


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


# --- stream parsing, percentiles, goodput ---------------------------------------------------------------------

def test_sse_lines_chunks_usage_and_error_chunks():
    assert parse_sse_line(b": keep-alive") is None and parse_sse_line("") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line(b"data: [DONE]\r") == DONE
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError):
        parse_sse_line("data: {not json")

    r = RequestRecord(0, "chat", "chat", 0.0, 8, 3)
    r.add_chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.05)
    assert r.chunk_s == []  # a role-only chunk is not a token
    for t, text in ((0.1, "a"), (0.15, "b"), (0.25, "c")):
        r.add_chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}], "usage": None}, t)
    r.add_chunk({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}, 0.26)
    r.status, r.sent_s, r.end_s = "ok", 0.0, 0.3
    assert (r.ttft, r.prompt_tokens, r.output_tokens) == (0.1, 11, 3)
    assert r.itl == pytest.approx([0.05, 0.1]) and r.tpot == pytest.approx((0.3 - 0.1) / 2)
    # sent 1 s after its scheduled arrival (a busy client): latency counts from the arrival (open loop: a late
    # send made that second vanish from TTFT and e2e)
    r.sent_s, r.end_s = 1.0, 1.3
    assert (r.send_lag, r.ttft, r.e2e) == pytest.approx((1.0, 1.1, 1.3)) and r.tpot == pytest.approx(0.1)

    c = RequestRecord(1, "rag", "completion", 0.0, 8, 4)  # vLLM's continuous usage: tokens per chunk known
    c.add_chunk({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}, 0.2)
    c.add_chunk({"choices": [{"text": "yz", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 4}}, 0.5)
    assert c.chunk_tokens == [1, 3] and c.itl == pytest.approx([0.1] * 3) and c.finish_reason == "length"

    e = RequestRecord(2, "chat", "chat", 0.0, 8, 4)
    e.add_chunk({"error": {"message": "engine unavailable", "type": "server_error"}}, 0.3)
    assert e.status == "error" and "engine unavailable" in e.error
    assert error_message('{"error": {"message": "bad temperature"}}') == "bad temperature"
    assert error_message("<html>oops</html>") == "<html>oops</html>"


def test_a_chunk_of_n_tokens_counts_as_n_gaps():
    """29 one-token chunks 10 ms apart, then a 1 s stall that delivers 10 tokens in one chunk: 39 gaps, the
    last 10 of 0.1 s each, so the p99 is the stall's 0.1 s (one gap of 0.1 s among 30 would read 74 ms)."""
    r = RequestRecord(0, "chat", "chat", 0.0, 8, 40)
    times, counts = [0.1 + 0.01 * i for i in range(30)] + [0.39 + 1.0], list(range(1, 31)) + [40]
    for t, n in zip(times, counts):
        r.add_chunk({"choices": [{"text": "a"}], "usage": {"completion_tokens": n}}, t)
    assert len(r.itl) == r.num_output_tokens - 1 == 39
    assert r.itl[-10:] == pytest.approx([0.1] * 10) and latency_stats(r.itl)["p99"] == pytest.approx(0.1)


def test_continuous_usage_asks_for_the_usage_in_every_chunk():
    planned = plan_requests(LoadConfig(url="http://x", num_requests=1, scrape=False))[0]
    assert request_body(planned, "m")["stream_options"] == {"include_usage": True}
    assert request_body(planned, "m", continuous_usage=True)["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": True}
    assert serve.config_from_args(_parse(["--continuous-usage"])).continuous_usage
    assert not serve.config_from_args(_parse([])).continuous_usage


def test_latency_stats_interpolate_like_numpy():
    stats = latency_stats(list(range(1, 101)))
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01, "max": 100, "n": 100})
    assert latency_stats([0.2]) == pytest.approx({**{k: 0.2 for k in ("mean", "p50", "p90", "p99", "max")}, "n": 1})
    assert latency_stats([]) == {**dict.fromkeys(("mean", "p50", "p90", "p99", "max")), "n": 0}


def _record(ttft: float, e2e: float, tokens: int, status: str = "ok") -> RequestRecord:
    r = RequestRecord(0, "chat", "chat", 0.0, 8, tokens, sent_s=0.0, end_s=e2e, status=status,
                      output_tokens=tokens)
    r.chunk_s, r.chunk_tokens = [ttft + i * (e2e - ttft) / max(1, tokens - 1) for i in range(tokens)], [1] * tokens
    return r


def test_goodput_counts_requests_within_every_target():
    goodput = Goodput.parse(["ttft:100", "tpot:20"])
    assert (goodput.ttft, goodput.itl, goodput.e2e) == (0.1, 0.02, None)
    records = [_record(0.05, 0.25, 11),   # TPOT 20 ms: good
               _record(0.05, 0.35, 11),   # TPOT 30 ms
               _record(0.2, 0.3, 11),     # TTFT 200 ms
               _record(0.05, 0.05, 1),    # one token: no TPOT, good on TTFT
               _record(0.05, 0.25, 11, status="error")]
    assert [goodput.is_good(r) for r in records] == [True, False, False, True, False]
    summary = class_summary(records, duration_s=2.0, goodput=goodput)
    assert summary["goodput"] == {"num_good": 2, "requests_per_s": 1.0, "fraction": 0.4}
    assert (summary["count"], summary["completed"], summary["errors"]) == (5, 4, 1)
    assert summary["output_tokens"] == 34 and summary["output_throughput"] == 17.0
    assert Goodput.parse(["e2e:1500"]).is_good(_record(0.1, 1.6, 3)) is False
    with pytest.raises(ValueError, match="goodput"):
        Goodput.parse(["ttft:0"])


# --- whole runs against a fake server -----------------------------------------------------------------------

async def test_run_counts_completions_errors_and_unfinished(aiohttp_server):
    server = await aiohttp_server(_make_fake_app())
    classes = [_fixed("ok", OK_TOKENS, share=2), _fixed("comp", OK_TOKENS, endpoint="completion", share=1),
               _fixed("bad", BAD_TOKENS, share=1), _fixed("hang", HANG_TOKENS, share=1),
               _fixed("broken", BROKEN_TOKENS, share=1)]
    config = _config(server, classes, num_requests=30, timeout=0.5, goodput=Goodput(ttft=2.0))
    began = time.perf_counter()
    report = await run_load(config)
    assert time.perf_counter() - began < 5
    s = report.summary
    assert sum(s[c.name]["count"] for c in classes) == 30 == report.totals["count"]
    for name in ("ok", "comp"):
        assert s[name]["completed"] == s[name]["count"] > 0 and s[name]["errors"] == s[name]["unfinished"] == 0
        assert s[name]["output_tokens"] == OK_TOKENS * s[name]["count"]
        assert s[name]["prompt_tokens"] == 11 * s[name]["count"]
        assert s[name]["pools"] == {"chat": s[name]["count"]}
        assert 0 < s[name]["ttft"]["p50"] < 1.0 and s[name]["itl"]["p50"] == pytest.approx(CHUNK_DELAY, abs=0.02)
        assert s[name]["goodput"]["fraction"] == 1.0
    assert s["bad"]["errors"] == s["bad"]["count"] > 0
    assert s["bad"]["error_messages"] == {"HTTP 400: max_tokens: 3 is refused here": s["bad"]["count"]}
    assert s["hang"]["unfinished"] == s["hang"]["count"] > 0 and s["hang"]["completed"] == 0
    assert all("timeout" in r.error for r in report.records if r.class_name == "hang")
    assert s["broken"]["errors"] == s["broken"]["count"] > 0
    assert list(s["broken"]["error_messages"]) == ["error chunk: engine unavailable"]
    bodies = server.app[STATE]["bodies"]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in bodies)
    assert {("messages" in b) for b in bodies} == {True, False}
    scrape = report.totals["scrape"]
    assert scrape["count"] >= 2 and scrape["failed"] == 0 and scrape["max_s"] < 1.0
    assert scrape["pools"]["chat"]["max_kv_cache_usage_perc"] == 0.25
    assert scrape["pools"]["chat"]["num_preemptions"] == 3 * (server.app[STATE]["scrapes"] - 1)  # both modes


async def test_arrivals_are_open_loop_whatever_the_responses_take(aiohttp_server):
    """Each request leaves at its scheduled time, not when an earlier one is answered (answers take 1.5 s; arrivals
    are 50 ms apart). The bound on a send's lag is the loop's jitter on a busy 2-core VM (a pause of 0.38 s was seen
    once in a full suite run), far below an answer's 1.5 s; the garbage of earlier tests is collected first."""
    gc.collect()
    server = await aiohttp_server(_make_fake_app(first_delay=1.5))
    config = _config(server, [_fixed("slow", OK_TOKENS)], request_rate=20.0, num_requests=10, scrape=False)
    report = await run_load(config)
    assert report.summary["slow"]["completed"] == 10
    lags = [r.sent_s - r.scheduled_s for r in report.records]
    assert max(lags) < 0.6 and min(lags) >= 0
    assert max(r.sent_s for r in report.records) < min(r.end_s for r in report.records)  # all sent before any ended
    assert server.app[STATE]["max_in_flight"] == 10


async def test_drain_timeout_cancels_in_flight_requests_and_counts_them(aiohttp_server):
    server = await aiohttp_server(_make_fake_app())
    config = _config(server, [_fixed("ok", OK_TOKENS), _fixed("hang", HANG_TOKENS)], num_requests=8, timeout=60.0,
                     drain_timeout=0.3, scrape=False)
    began = time.perf_counter()
    report = await run_load(config)
    assert time.perf_counter() - began < 3
    hang = [r for r in report.records if r.class_name == "hang"]
    assert hang and all(r.status == "unfinished" and r.error.startswith("cancelled") for r in hang)
    assert report.summary["hang"]["unfinished"] == len(hang) and report.summary["ok"]["unfinished"] == 0
    assert report.totals["unfinished"] == len(hang) and report.totals["scrape"]["skipped"] == "disabled"


async def test_out_writes_results_json_and_two_pngs(aiohttp_server, tmp_path):
    server = await aiohttp_server(_make_fake_app())
    config = _config(server, [_fixed("ok", OK_TOKENS)], request_rate=12.0, duration=0.5, probe_rate=20.0,
                     api_key="secret")
    report = await run_load(config)
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "latency_cdf.png", "server_timeline.png"]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(data) == {"config", "model", "summary", "totals", "requests", "scrapes"}
    assert data["config"]["api_key"] == "***" and "secret" not in (tmp_path / "out" / "results.json").read_text()
    assert [c["name"] for c in data["config"]["classes"]] == ["ok"]
    assert data["config"]["classes"][0]["prompt_len"] == {"dist": "fixed", "value": config.classes[0].prompt_len.value,
                                                          "min": None, "max": None, "mean": None, "std": None}
    assert data["summary"]["probe"]["completed"] >= 1 and report.totals["probes"] == data["summary"]["probe"]["count"]
    assert len(data["requests"]) == report.totals["count"] + report.totals["probes"]   # the run's figures: probes apart
    assert report.totals["count"] == data["summary"]["ok"]["count"]
    assert f"{report.totals['count']} requests ({report.totals['probes']} probes apart)" in format_report(report)
    first = data["requests"][0]
    assert first["ttft_s"] == pytest.approx(first["chunk_s"][0] + max(0.0, first["sent_s"] - first["scheduled_s"]))
    assert data["scrapes"] and data["scrapes"][0]["pools"]["chat"]["num_requests_waiting"] == 1
    for png in paths[1:]:
        assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 5000
    n = report.summary["ok"]["count"]
    assert n > 0 and f"ok: {n} requests, {n} completed" in format_report(report)
    assert "  pool chat: KV usage max" in format_report(report) and "pool :" not in format_report(report)
    ttft = next(line for line in format_report(report).splitlines() if line.startswith("  TTFT"))
    assert ttft.split()[4].endswith("*") and data["summary"]["ok"]["ttft"]["n"] == n < 100   # p99 of a few: marked
    assert "  * p99 of fewer than 100 samples: a lower bound on the tail" in format_report(report)


async def test_no_metrics_endpoint_is_skipped_with_a_warning(aiohttp_server, tmp_path, caplog):
    server = await aiohttp_server(_make_fake_app(metrics=False))
    with caplog.at_level(logging.WARNING, logger="cliffguard.bench.serve"):
        report = await run_load(_config(server, [_fixed("ok", OK_TOKENS)], num_requests=3))
    assert report.summary["ok"]["completed"] == 3
    assert "404" in report.totals["scrape"]["skipped"] and report.scrapes == ()
    assert any("404" in message for message in caplog.messages)
    timeline = write_report(report, tmp_path)[2]
    assert timeline.read_bytes()[:8] == PNG_SIGNATURE
    assert "metrics: not scraped" in format_report(report)
