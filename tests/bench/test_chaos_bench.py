"""`cliffguard bench chaos`: its arithmetic on synthetic data (answers per stream, outcomes, accounting
per window, p99 TTFT per window, recovery time from a sampled timeline, the report and its table), its
config and option checks, the process helpers, and one `--quick` run end to end against a live server
(every fault; nothing lost, nothing answered twice)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.chaos import (DEFAULT_CONFIG, GOAL_RECOVERY_S, _log_summary, account, build_report, chaos_config,
                         format_report, window_ttft_p99)
from bench.chaos.fault_script import FAULTS, FaultRun, Shot, recovery_time
from bench.chaos.steady import (Sample, SteadyRecord, StreamTally, is_running, parse_credits, plan_steady, rss_bytes,
                                worker_pid)
from bench.load.sender import DONE
from gateway.cli import main
from pools.config.yaml_file import load_config


def _chunk(cid: str, content: str = "", finish: str | None = None, index: int = 0) -> dict:
    return {"id": cid, "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]}


def _tally(*events) -> StreamTally:
    tally = StreamTally()
    for t, event in enumerate(events):
        tally.add(event, 0.1 * (t + 1))
    return tally


def _record(rid: str, sent: float, outcome: str = "ok", kind: str = "chat", ttft: float | None = 0.1,
            answers: int = 1) -> SteadyRecord:
    return SteadyRecord(rid, kind, sent_s=sent, end_s=sent + 1.0, http_status=200, ttft_s=ttft, answers=answers,
                        outcome=outcome)


def _samples(until: float, not_ready: tuple[float, float], not_full: tuple[float, float]) -> list[Sample]:
    """A timeline every 0.25 s: /ready not 200 in [not_ready), credits held in [not_full)."""
    out = []
    for t in np.arange(0.0, until, 0.25):
        ready = not not_ready[0] <= t < not_ready[1]
        free = 100.0 if not not_full[0] <= t < not_full[1] else 40.0
        out.append(Sample(float(t), ready, 0.01, {"chat": (free, 100.0), "rag": (50.0, 50.0)}, 300 << 20))
    return out


def test_a_stream_holds_one_answer_unless_it_is_cut_or_answered_twice():
    normal = _tally(_chunk("a", "Hi"), _chunk("a", " there", "length"), {"id": "a", "choices": [], "usage": {"x": 1}},
                    DONE)
    assert normal.answers == 1 and normal.first_content_s == pytest.approx(0.1)
    failed = _tally(_chunk("a", "Hi"), {"error": {"message": "engine unavailable"}}, DONE)
    assert failed.answers == 1 and failed.num_errors == 1 and "engine unavailable" in failed.error
    assert _tally(_chunk("a", "Hi"), _chunk("a", "!")).answers == 0                         # cut
    two_choices = _tally(_chunk("a", "x", "stop", 0), _chunk("a", "y", "stop", 1), DONE)
    assert two_choices.answers == 1
    replayed = _tally(_chunk("a", "Hi", "stop"), DONE, _chunk("b", "Hi", "stop"), DONE)     # a second answer
    assert replayed.answers == 2
    assert _tally(_chunk("a", "Hi", "stop"), _chunk("a", "again", "stop")).answers == 2
    with pytest.raises(ValueError):
        _tally(["not", "an", "object"])


async def test_a_late_send_counts_its_lag_in_ttft_from_the_planned_arrival():
    """The load's loop, shared with the faults' clients, may send a request late: its client was due at the
    planned arrival, so TTFT counts from there and the lag is kept."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from bench.chaos.steady import Planned, send_steady

    class Response:
        status = 200
        content = SimpleNamespace(iter_any=lambda: _chunks())

    async def _chunks():
        await asyncio.sleep(0.05)
        yield b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\ndata: [DONE]\n\n'

    @contextlib.asynccontextmanager
    async def post(url, json):
        yield Response()

    start = time.perf_counter() - 1.0
    ctx = SimpleNamespace(start=start, load_start_s=0.2, url="http://127.0.0.1:1", steady_urls=[], timeout=5.0,
                          session=SimpleNamespace(post=post))
    record = SteadyRecord("r", "chat")
    await send_steady(ctx, Planned("r", "chat", 0.5, "/v1/chat/completions", {}), record)   # due 0.3 s ago
    assert record.outcome == "ok" and record.sent_s == pytest.approx(0.7)
    assert record.lag_s == pytest.approx(0.3, abs=0.05) and record.ttft_s >= record.lag_s + 0.05


async def test_arrivals_left_out_while_a_fault_pauses_the_load_are_counted():
    """A fault that needs the worker idle pauses the steady load: its planned arrivals are not sent, and were
    not counted anywhere (no record, no note): the window read as if fewer were due."""
    import asyncio
    from types import SimpleNamespace

    from bench.chaos.steady import Planned, run_steady

    ctx = SimpleNamespace(start=time.perf_counter(), load_start_s=0.0, paused=True, num_unsent=0, records=[],
                          steady_urls=[])
    plan = [Planned(f"r{i}", "chat", 0.0, "/v1/chat/completions", {}) for i in range(4)]
    await run_steady(ctx, plan, asyncio.Event())
    assert ctx.records == [] and ctx.num_unsent == 4


def test_outcomes_answered_lost_cut():
    cases = [(None, None, False, "lost", 0),                 # no response at all
             (503, None, False, "error", 1),                 # a clear error status is an answer
             (200, _tally(_chunk("a", "Hi")), False, "cut", 0),
             (200, _tally(_chunk("a", "Hi")), True, "lost", 0),      # the client's timeout
             (200, _tally(_chunk("a", "Hi", "stop"), DONE), False, "ok", 1),
             (200, _tally({"error": {"message": "x"}}, DONE), False, "error", 1)]
    for status, tally, timed_out, outcome, answers in cases:
        record = SteadyRecord("r", "chat", sent_s=0.0, http_status=status)
        record.finish(tally, timed_out)
        assert (record.outcome, record.answers) == (outcome, answers), (status, timed_out)


def test_accounting_counts_each_window_by_send_time():
    records = [_record("a", 1.0), _record("b", 2.0, "error", ttft=None), _record("c", 5.0, "lost", ttft=None,
                                                                                 answers=0),
               _record("d", 6.0, answers=2), _record("e", 7.0, "cut", answers=0), SteadyRecord("f", "chat")]
    assert account(records, 0.0, 4.0) == {"sent": 2, "answered": 2, "ok": 1, "error": 1, "cut": 0, "lost": 0,
                                          "duplicated": 0}
    assert account(records, 4.0, 10.0) == {"sent": 3, "answered": 1, "ok": 1, "error": 0, "cut": 1, "lost": 1,
                                           "duplicated": 1}
    assert account(records, 0.0, float("inf"))["sent"] == 5                              # the unsent one is not


def test_p99_ttft_per_window_counts_only_chat_with_a_first_token():
    ttfts = np.random.default_rng(0).exponential(0.2, 200)
    records = [_record(f"c{i}", 10.0 + i * 0.05, ttft=float(v)) for i, v in enumerate(ttfts)]
    records += [_record("rag", 12.0, kind="rag", ttft=99.0), _record("failed", 12.0, "error", ttft=None)]
    assert window_ttft_p99(records, 10.0, 20.0) == pytest.approx(np.percentile(ttfts, 99))
    assert window_ttft_p99(records, 10.0, 15.0) == pytest.approx(np.percentile(ttfts[:100], 99))
    assert window_ttft_p99(records, 0.0, 10.0) is None


def test_a_bin_where_most_chat_requests_got_no_token_is_not_back():
    """Its few answered requests may be fast: the bin read as recovered while 20 of its 25 were lost."""
    from bench.chaos import ttft_bins, ttft_recovered

    fast = [_record(f"ok{i}", 0.1 * i, ttft=0.05) for i in range(5)]
    lost = [_record(f"lost{i}", 0.2 * i, "lost", ttft=None, answers=0) for i in range(20)]
    back = [_record(f"back{i}", 5.0 + 0.2 * i, ttft=0.05) for i in range(5)]
    bins = ttft_bins(fast + lost + back, 0.0, 10.0)
    assert [(b["num_chat"], b["num_unanswered"]) for b in bins] == [(5, 20), (5, 0)]
    assert ttft_recovered(bins, warmup_p99=0.1, min_chat=5) == 5.0


def test_recovery_needs_ready_full_credits_and_a_chat_request_sent_after_the_fault():
    samples = _samples(40.0, not_ready=(10.5, 14.0), not_full=(10.2, 15.0))
    chat = [(9.0, 9.5), (12.0, 16.0), (14.8, 15.6)]             # (sent, end) of completed chat requests
    # first sample >= 15.6 (the first chat sent after the injection completed) that is ready and full
    assert recovery_time(samples, chat, 10.0, 10.1, 40.0) == pytest.approx(5.75)
    assert recovery_time(samples, chat, 10.0, 13.0, 40.0) == pytest.approx(5.75)
    assert recovery_time(samples, [(9.0, 9.5)], 10.0, 10.1, 40.0) is None   # no chat after it: never
    assert recovery_time(samples, chat, 10.0, 10.1, 15.5) is None           # the window ended first
    held = _samples(40.0, not_ready=(0.0, 0.0), not_full=(10.0, 40.0))       # credits never came back
    assert recovery_time(held, chat, 10.0, 10.1, 40.0) is None
    clean = _samples(40.0, not_ready=(0.0, 0.0), not_full=(0.0, 0.0))
    assert recovery_time(clean, [(10.1, 10.4)], 10.0, 10.0, 40.0) == pytest.approx(0.5)


def _raw() -> dict:
    records = [_record(f"w{i}", 2.0 + i, ttft=0.1) for i in range(8)]            # warm-up
    records += [_record(f"k{i}", 10.0 + i, "error" if i < 3 else "ok", ttft=None if i < 3 else 0.3)
                for i in range(20)]
    records.append(_record("lost", 12.5, "lost", ttft=None, answers=0))
    kill = FaultRun("kill_worker", 10.0, injected_s=10.0, end_s=18.0, window_end_s=30.0, notes={"pid": 1})
    burst = FaultRun("burst", 30.0, injected_s=30.5, end_s=38.0, window_end_s=50.0,
                     shots=[Shot("b0", 30.0, 31.0, 200), Shot("b1", 30.0, None, None, "timeout")])
    samples = _samples(50.0, not_ready=(10.0, 15.0), not_full=(10.0, 15.0))
    return {"model": "m", "records": records, "runs": [kill, burst], "samples": samples, "load_start_s": 2.0,
            "load_end_s": 50.0, "duration_s": 51.0}


def test_report_and_table():
    meta = {"config": "config/pools.yaml", "timers": "short", "date": "2026-01-01T00:00:00+00:00", "commit": "abc",
            "load": "chat 1 req/s"}
    report = build_report(_raw(), meta)
    json.dumps(report)
    kill, burst = report["faults"]
    assert kill["steady"] == {"sent": 21, "answered": 20, "ok": 17, "error": 3, "cut": 0, "lost": 1, "duplicated": 0}
    assert kill["recovery_s"] == pytest.approx(5.0) and kill["recovered"]     # chat sent 13.0 ends 14.0; ready 15.0
    assert kill["ttft_p99_s"]["before"] == pytest.approx(0.1) and kill["ttft_p99_s"]["during"] == pytest.approx(0.3)
    assert burst["traffic"]["lost"] == 1 and burst["traffic"]["statuses"] == {"200": 1}
    assert report["overall"]["lost"] == 2 and report["overall"]["duplicated"] == 0
    assert report["verdict"] == {"lost": False, "duplicated": True, "recovery": False, "fault_goals": True,
                                 "met": False}
    assert report["rss"]["idle_bytes"] == report["rss"]["peak_bytes"] == 300 << 20
    table = format_report(report)
    assert "1 kill -9 worker" in table and "5.0 s" in table and "NOT MET" in table
    assert f"recovered within {GOAL_RECOVERY_S:g} s: 1 of 2" in table
    # a window's p99 over a few dozen chat requests is about its slowest: marked, as every other bench marks it
    assert kill["ttft_n"]["before"] < 100 and "100*/" in table and "* p99 of fewer than 100 chat requests" in table
    raw = _raw()
    raw["runs"][1].notes["goal_met"] = False            # a fault that missed its own goal (e.g. tenant_burst)
    assert build_report(raw, meta)["verdict"]["fault_goals"] is False


def test_steady_plan_has_unique_ids_in_user_and_prompt():
    plan = plan_steady("m", 2.0, 0.5, 60.0, seed=3)
    assert len({p.rid for p in plan}) == len(plan) and {p.kind for p in plan} == {"chat", "rag"}
    assert [p.arrival_s for p in plan] == sorted(p.arrival_s for p in plan)
    for p in plan:
        text = p.body["messages"][0]["content"] if p.kind == "chat" else p.body["prompt"]
        assert p.body["user"] == p.rid and text.startswith(f"request {p.rid}: ") and p.body["stream"]
    assert plan == plan_steady("m", 2.0, 0.5, 60.0, seed=3)


def test_config_copy_shortens_the_fault_timers_only(tmp_path):
    path = chaos_config(DEFAULT_CONFIG, tmp_path)
    short, default = load_config(path, env={}), load_config(DEFAULT_CONFIG, env={})
    assert short.gateway.write_timeout == 3 and short.gateway.stall_seconds == 6
    assert short.gateway.restart_backoff.initial_seconds == 0.2
    assert short.pools == default.pools


def test_credits_from_metrics_text():
    text = ('# TYPE cliffguard_kv_credits_free gauge\ncliffguard_kv_credits_free{pool="chat"} 10.0\n'
            'cliffguard_kv_credits_free{pool="rag"} 5.0\n# TYPE cliffguard_kv_credits gauge\n'
            'cliffguard_kv_credits{pool="chat"} 10.0\ncliffguard_kv_credits{pool="rag"} 8.0\n')
    assert parse_credits(text) == {"chat": (10.0, 10.0), "rag": (5.0, 8.0)}
    assert not Sample(0.0, True, 0.0, parse_credits(text), None).credits_full
    assert not Sample(0.0, True, 0.0, {}, None).credits_full


def test_server_log_keeps_warnings_errors_and_whole_tracebacks():
    log = ["cliffguard: serving on http://127.0.0.1:1 (pools: chat)\n", "2026-01-01 00:00:00,000 gw INFO fine\n",
           "2026-01-01 00:00:01,000 gw WARNING slow client\n", "2026-01-01 00:00:02,000 aiohttp.server ERROR oops\n",
           "Traceback (most recent call last):\n", '  File "x.py", line 1, in f\n', "ConnectionResetError: gone\n",
           "2026-01-01 00:00:03,000 gw INFO fine again\n", "loading model: 50%\n"]
    counts, kept = _log_summary(log)
    assert counts == {"WARNING": 1, "ERROR": 1, "Traceback": 1}
    assert kept == [line.rstrip() for line in log[2:7]]


def test_worker_pid_picks_the_spawned_child_not_the_resource_tracker():
    sleep = "import time; time.sleep(30)"
    tracker = subprocess.Popen([sys.executable, "-c", sleep, "spawn_main", "resource_tracker"])
    worker = subprocess.Popen([sys.executable, "-c", sleep, "spawn_main"])
    try:
        assert worker_pid(os.getpid()) == worker.pid and is_running(worker.pid)
        assert rss_bytes(os.getpid()) > 0
    finally:
        for proc in (tracker, worker):
            proc.kill()
            proc.wait()
    assert worker_pid(os.getpid()) is None and not is_running(worker.pid) and rss_bytes(worker.pid) is None


def test_worker_pid_finds_a_child_of_the_fork_server():
    # The gateway forks its workers from multiprocessing's fork server: they are its grandchildren.
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)",
                               "multiprocessing.forkserver"])
    try:
        deadline = time.monotonic() + 10
        while worker_pid(os.getpid()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = worker_pid(os.getpid())
        assert pid is not None and pid != server.pid and is_running(pid)
    finally:
        if pid := worker_pid(os.getpid()):
            os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()


@pytest.mark.parametrize("argv, option", [
    (["--warmup", "-1"], "--warmup"), (["--fault-seconds", "0"], "--fault-seconds"),
    (["--quiet-seconds", "-5"], "--quiet-seconds"), (["--faults", "kill,nap"], "--faults"),
    (["--burst", "0"], "--burst"), (["--config", "/nonexistent.yaml"], "--config"), (["--seed", "-1"], "--seed"),
    # not finite: a warm-up of inf waited for ever before the first fault; a rate of nan planned no arrivals
    (["--warmup", "inf"], "--warmup"), (["--rate", "nan"], "--rate"), (["--rag-rate", "inf"], "--rag-rate"),
    (["--timeout", "inf"], "--timeout"), (["--disconnects", "1.5"], "--disconnects"),
    (["--ray-nodes", "-1"], "--ray-nodes"), (["--replicas", "0"], "--replicas")])
def test_bad_options_exit_2_naming_the_option(argv, option, capsys):
    assert main(["bench", "chaos", *argv]) == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("text, named", [("pools: [\n", "line 2"), ("- a\n- b\n", "expected an object"),
                                         ("pools:\n  - {name: chat, model: m, max_num_seqs: many}\n", "max_num_seqs")])
@pytest.mark.parametrize("command", [["chaos"], ["replicas", "--replicas", "2"]])
def test_a_pool_file_the_gateway_would_refuse_exits_2_before_any_server(tmp_path, capsys, text, named, command):
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    assert main(["bench", *command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--config: " in err and named in err and "Traceback" not in err, err


def test_an_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", "chaos", "--quick", "--out", str(blocker / "sub")]) == 2
    assert "--out" in capsys.readouterr().err


# minutes of a live server under faults: `make test-slow` (the gateway's fault handling itself is
# tested black-box in tests/reliability/, fast)
@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    # --quick with a 5 s lead-in and 6 s quiet windows (each still extended until the gateway recovered;
    # the suite's time), fault windows as --quick's: 8 s, past the 6 s stall watchdog
    # the client and worker faults (the request faults have tests of their own in tests/reliability)
    argv = ["bench", "chaos", "--quick", "--warmup", "5", "--quiet-seconds", "6", "--json", "--faults", ",".join(FAULTS)]
    rc = main([*argv, "--out", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert rc == (0 if report["verdict"]["met"] else 1)
    assert [f["name"] for f in report["faults"]] == list(FAULTS)
    for fault in report["faults"]:
        assert {"recovery_s", "recovered", "steady", "ttft_p99_s", "traffic", "notes"} <= set(fault)
        assert set(fault["ttft_p99_s"]) == {"before", "during", "after"}
        assert fault["start_s"] <= fault["injected_s"] <= fault["end_s"] <= fault["window_end_s"]
    steady = report["overall"]["steady"]
    assert steady["sent"] > 50 and steady["answered"] + steady["lost"] + steady["cut"] == steady["sent"]
    assert report["overall"]["lost"] == 0, report["overall"]
    assert report["overall"]["duplicated"] == 0, report["overall"]
    faults = {f["name"]: f for f in report["faults"]}
    assert faults["oversized"]["traffic"]["statuses"] == {"400": 4}
    assert faults["burst"]["traffic"]["sent"] == 150   # --quick's burst
    assert faults["kill_worker"]["notes"]["new_pid"] not in (None, faults["kill_worker"]["notes"]["pid"])
    assert report["rss"]["peak_bytes"] >= report["rss"]["idle_bytes"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["verdict"] == report["verdict"] and len(saved["requests"]) == steady["sent"] and saved["samples"]
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
