"""`cliffguard bench gateway`: direct, the relay, the bare aiohttp proxy and the gateway each answer every
request of both phases, and the report relates each arm to direct."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main


def test_bench_gateway_measures_every_arm(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # the gateway's state goes to the bench's own folder, never the current one
    assert main(["bench", "gateway", "--requests", "24", "--latency-requests", "4", "--concurrency", "3",
                 "--json"]) == 0   # a request answered other than 200 by any arm fails the run
    report = json.loads(capsys.readouterr().out)
    assert (report["requests"], report["latency_requests"], report["concurrency"]) == (24, 4, 3)
    for arm in ("direct", "relay", "proxy", "gateway"):
        side = report[arm]
        assert 0 < side["p50_ms"] <= side["p99_ms"] and side["rps"] > 0, arm
        assert side["added_p50_ms"] == pytest.approx(side["p50_ms"] - report["direct"]["p50_ms"])
        assert side["rps_of_direct"] == pytest.approx(side["rps"] / report["direct"]["rps"])
    assert list(tmp_path.iterdir()) == []


def test_bench_gateway_names_a_bad_option(capsys):
    assert main(["bench", "gateway", "--concurrency", "0"]) == 2
    assert "--concurrency: must be >= 1" in capsys.readouterr().err


def test_a_silent_child_cannot_hold_the_start_past_its_deadline():
    """A helper that hangs without a line (or one line short of the one awaited) times out: the read blocked
    forever, the deadline checked only between lines."""
    import subprocess
    import sys
    import time

    from bench.gateway import _wait_line

    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; print('starting', file=sys.stderr, "
                             "flush=True); time.sleep(60)"], stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="starting"):
            _wait_line(proc, r"serving on (\S+) ", timeout=1.0)
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait()
