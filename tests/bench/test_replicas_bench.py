"""`cliffguard bench replicas`: its pool files, the split and affinity it reports, and one `--quick` run end
to end (a tiny model: one replica, then two, under the same load)."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.load.report import even_split_deviation, prefix_affinity, replica_split
from bench.load.sender import RequestRecord
from bench.replicas import pool_file
from gateway.cli import main
from tests.conftest import make_tiny_model


def _record(i: int, replica: str, tokens: int, prefix: int | None = None) -> RequestRecord:
    return RequestRecord(i, "docs", "completion", 0.0, tokens, 4, sent_s=float(i), status="ok", error=None,
                         pool="rag", replica=replica, prefix=prefix, prompt_tokens=tokens, output_tokens=4)


def test_the_split_is_by_token_load_and_affinity_counts_repeats_on_the_first_replica():
    records = [_record(0, "0", 96, prefix=1), _record(1, "1", 196, prefix=1), _record(2, "0", 96, prefix=1),
               _record(3, "0", 96, prefix=2), _record(4, "1", 96)]
    split = replica_split(records)["rag"]
    assert split["replicas"] == {"0": {"requests": 3, "tokens": 300}, "1": {"requests": 2, "tokens": 300}}
    assert split["token_shares"] == {"0": 0.5, "1": 0.5} and even_split_deviation(split, 2) == 0.0
    assert even_split_deviation(split, 3) == pytest.approx(1.0)     # a third replica that answered nothing
    # document 1: first on replica 0, then 1, then 0 again; document 2 asked once
    assert prefix_affinity(records) == {"documents": 2, "repeats": 2, "on_first_replica": 1, "fraction": 0.5}
    assert prefix_affinity([r for r in records if r.prefix is None]) is None


def test_the_pool_file_replicates_every_device_on_one_thread(tmp_path):
    source = tmp_path / "pools.yaml"
    source.write_text("devices:\n  a: {device: auto}\n  b: {device: cuda:1}\npools: []\n")
    devices = yaml.safe_load(pool_file(source, 2, 1))["devices"]
    assert devices == {"a": {"device": "cpu", "cpu_threads": 1, "replicas": 2},
                       "b": {"device": "cuda:1", "replicas": 2}}   # a CUDA device's ranks run on GPUs


def test_the_warmup_asked_for_is_the_one_left_out(tmp_path, monkeypatch):
    """`--warmup 30 --duration 90` counts tokens/s over 30-90 s, the window the report says: it became 22.5 s
    (a quarter of the duration), unsaid."""
    import argparse
    import asyncio
    import contextlib

    import bench.replicas as replicas

    windows = []
    monkeypatch.setattr(replicas, "pool_file", lambda source, n, threads: "pools: []\n")
    monkeypatch.setattr(replicas, "LiveServer", lambda path: contextlib.nullcontext(argparse.Namespace(url="u")))
    monkeypatch.setattr(replicas, "load_config", lambda url, args: None)
    monkeypatch.setattr(replicas, "plan_requests", lambda config: [])

    async def run_load(config, plan):
        return None
    monkeypatch.setattr(replicas, "run_load", run_load)
    monkeypatch.setattr(replicas, "summarize", lambda report, n, warmup, duration: windows.append((warmup, duration)))
    args = argparse.Namespace(warmup=30.0, duration=90.0, cpu_threads=1, out=None)
    asyncio.run(replicas.run_layout(tmp_path / "pools.yaml", 2, args, tmp_path))
    assert windows == [(30.0, 90.0)]


def test_quick_shortens_only_the_load_options_not_given(monkeypatch):
    """`--quick --duration 20 --request-rate 3` runs 20 s at 3 req/s: --quick replaced both, unsaid."""
    import bench.replicas as replicas

    seen = []

    async def run_layout(source, n, args, folder):
        seen.append((args.duration, args.request_rate, args.warmup, args.drain_timeout, args.docs_rate))
        return {"tokens_per_s": 0.0, "completed": 0}
    monkeypatch.setattr(replicas, "run_layout", run_layout)
    monkeypatch.setattr(replicas, "format_result", lambda results: "")
    main(["bench", "replicas", "--quick", "--duration", "20", "--request-rate", "3"])
    main(["bench", "replicas", "--warmup", "5"])
    assert seen[:2] == [(20.0, 3.0, 2.0, 30.0, 0.5)] * 2
    assert seen[2:] == [(90.0, 4.5, 5.0, 300.0, 0.15)] * 2


def test_a_p99_of_fewer_than_100_requests_is_marked_a_lower_bound():
    from bench.replicas import format_result

    def result(replicas: int, n: int) -> dict:
        return {"replicas": replicas, "completed": n, "count": n, "errors": 0, "unfinished": 0, "tokens_per_s": 10.0,
                "window_s": [10.0, 90.0], "computed_tokens_per_s": 12.0, "split": {}, "split_deviation": {},
                "answered": {}, "prefix_affinity": None,
                "ttft": {"rag": {"p50": 1.0, "p99": 2.0, "n": n}}}
    text = format_result([result(1, 3), result(2, 150)])
    assert "rag: TTFT p50 1.00 s, p99 2.00 s* (3 requests)" in text and "p99 2.00 s (150 requests)" in text
    assert "* p99 of fewer than 100 requests: a lower bound on the tail" in text
    assert "* p99" not in format_result([result(1, 120), result(2, 150)])


# two live servers under load for a minute: `make test-slow`
@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, builtin_path, capsys):
    model = make_tiny_model(tmp_path / "tiny", "llama", builtin_path, vocab_size=49152, max_position_embeddings=1024)
    config = tmp_path / "pools.yaml"
    config.write_text(f"""
devices:
  default: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - {{name: chat, model: {model}, route: {{max_prompt_tokens: 256}}, kv_share: 0.4, avg_len: 256, max_model_len: 1024}}
  - {{name: rag, model: {model}, route: {{min_prompt_tokens: 257}}, kv_share: 0.6, avg_len: 512, max_model_len: 1024}}
""")
    out = tmp_path / "out"
    assert main(["bench", "replicas", "--config", str(config), "--quick", "--long-tokens", "300", "--documents", "2",
                 "--out", str(out)]) == 0
    result = json.loads((out / "replicas.json").read_text())
    one, two = result["layouts"]
    assert (one["replicas"], two["replicas"]) == (1, 2) and one["count"] == two["count"] > 0
    assert one["completed"] == one["count"] and two["completed"] == two["count"]
    assert set(one["answered"]["chat"]["replicas"]) == {"0"} and set(two["answered"]["chat"]["replicas"]) == {"0", "1"}
    assert set(two["split"]["chat"]["computed_tokens"]) == {"0", "1"} and two["split_deviation"]["chat"] is not None
    assert result["ratio"] is not None and "tokens/s, 2 replicas over 1" in capsys.readouterr().out
