"""`cliffguard bench isolation`: its pool files are valid, its arithmetic, and a `--quick` run end to end
(four servers, chat + rag loads over HTTP) with the bars that hold on any run: no chat preemption in
the split layout, and the shared pool's chat tail far above the split one."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.isolation import add_arguments, add_ratios, format_table, pools_yaml, scenarios, verdict
from gateway.cli import main
from pools.spec import load_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_scenario_writes_a_valid_pool_file():
    args = _args()
    names = [s.name for s in scenarios(args)]
    assert names[:4] == ["chat alone", "rag alone", "split", "shared"] and names[-1] == "chunk-only"
    assert "split itl 200 ms" in names and "split itl 400 ms" in names
    assert len(scenarios(_args("--quick"))) == 4
    for scenario in scenarios(args):
        config = load_config(pools_yaml(scenario, args), env={})
        pools = {p.name: p for p in config.pools}
        if scenario.layout == "shared":
            assert list(pools) == ["shared"] and pools["shared"].slo is None
        else:
            assert pools["rag"].slo is None
            assert (pools["chat"].slo is None) == (scenario.itl_ms is None)
            if scenario.itl_ms:
                assert pools["chat"].slo.itl_ms == scenario.itl_ms


def test_ratios_table_and_verdict():
    results = [
        {"scenario": "chat alone", "ttft_p99": 0.4, "itl_p99": 0.2, "chat_preemptions": 0},
        {"scenario": "rag alone", "rag_tokens_per_s": 100.0, "chat_preemptions": 0},
        {"scenario": "split", "ttft_p99": 0.45, "itl_p99": 0.3, "chat_preemptions": 0, "rag_tokens_per_s": 30.0},
        {"scenario": "shared", "ttft_p99": 4.0, "itl_p99": 2.0, "chat_preemptions": 0, "rag_tokens_per_s": 90.0},
    ]
    add_ratios(results)
    assert results[2]["ttft_p99_ratio"] == pytest.approx(1.125) and results[2]["itl_p99_ratio"] == pytest.approx(1.5)
    assert results[2]["rag_ratio"] == pytest.approx(0.3) and results[3]["ttft_p99_ratio"] == pytest.approx(10)
    lines = verdict(results)
    assert lines[0].startswith("met") and lines[1].startswith("NOT met") and all(
        line.startswith("met") for line in lines[2:])
    table = format_table(results)
    assert "split" in table and "1.12x" in table and "0.30x" in table


def test_a_chat_request_never_answered_counts_as_its_wait_not_as_nothing():
    from bench.isolation import chat_ttfts
    from bench.serve import RequestRecord

    answered = RequestRecord(0, "chat", "chat", 1.0, 10, 8, sent_s=1.0, end_s=2.0, status="ok", error=None)
    answered.chunk_s = [0.3, 0.4]
    streaming = RequestRecord(1, "chat", "chat", 2.0, 10, 8, sent_s=2.0, status="unfinished", error="in flight")
    streaming.chunk_s = [5.0]
    waiting = RequestRecord(2, "chat", "chat", 3.0, 10, 8, sent_s=3.0, status="unfinished", error="in flight")
    never_sent = RequestRecord(3, "chat", "chat", 29.0, 10, 8)
    assert chat_ttfts([answered, streaming, waiting, never_sent], run_seconds=30.0) == [0.3, 5.0, 27.0]


def test_quick_run_end_to_end(tmp_path, capsys):
    assert main(["bench", "isolation", "--quick", "--json", "--out", str(tmp_path)]) == 0
    printed = {r["scenario"]: r for r in json.loads(capsys.readouterr().out)}
    saved = {r["scenario"]: r for r in json.loads((tmp_path / "isolation.json").read_text())}
    assert list(printed) == list(saved) == ["chat alone", "rag alone", "split", "shared"]
    assert (tmp_path / "isolation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    split, shared = printed["split"], printed["shared"]
    assert printed["chat alone"]["chat_completed"] == printed["chat alone"]["chat_count"] > 0
    assert split["chat_preemptions"] == 0
    assert split["rag_tokens_per_s"] > 0 and printed["rag alone"]["rag_tokens_per_s"] > 0
    assert shared["ttft_p99"] > 3 * split["ttft_p99"], (shared["ttft_p99"], split["ttft_p99"])
    assert max(r["max_scrape_s"] for r in printed.values()) < 0.5
