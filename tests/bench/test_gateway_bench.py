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
