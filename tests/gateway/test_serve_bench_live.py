"""`cliffguard bench serve` against the session's live builtin server (config/pools.yaml)."""

from __future__ import annotations

import json

from gateway.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_command_against_live_builtin_server(live_builtin_server, tmp_path, capsys):
    workload = tmp_path / "tiny.yaml"
    workload.write_text("""
classes:
  - {name: chat, endpoint: chat, prompt_len: 16, output_len: {dist: uniform, min: 2, max: 4}}
  - {name: comp, endpoint: completion, prompt_len: 12, output_len: 3, temperature: 0}
""")
    out = tmp_path / "out"
    argv = ["bench", "serve", "--url", live_builtin_server.url, "--workload", str(workload), "--num-requests", "6",
            "--request-rate", "4", "--seed", "1", "--scrape-interval", "0.25", "--timeout", "60",
            "--tokenizer", "builtin:smollm2-135m-instruct", "--goodput", "e2e:60000", "--out", str(out), "--json",
            "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "smollm2-135m-instruct"  # from GET /v1/models
    assert summary["totals"]["completed"] == 6 and summary["totals"]["errors"] == 0
    records = json.loads((out / "results.json").read_text())["requests"]
    for r in records:
        assert r["status"] == "ok" and r["pool"] == "chat" and r["output_tokens"] == r["max_tokens"]
        assert r["ttft_s"] is not None and r["prompt_tokens"] > 0
        if r["class_name"] == "comp":
            assert r["prompt_tokens"] == 12  # exact with --tokenizer
    for name in ("chat", "comp"):
        s = summary["summary"][name]
        if s["count"]:
            assert s["output_tokens"] > 0 and s["goodput"]["fraction"] == 1.0
    scrape = summary["totals"]["scrape"]
    assert scrape["count"] >= 1 and "chat" in scrape["pools"] and scrape["max_s"] is not None
    for png in ("latency_cdf.png", "server_timeline.png"):
        assert (out / png).read_bytes()[:8] == PNG_SIGNATURE
