"""`cliffguard bench sliding` on a tiny Gemma 3 (sliding layers with a window of 8 beside a full one): one KV budget
planned both ways, the rings run more of the same long prompts at once than every position kept, and both engines
answer alike."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import sliding
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import GEMMA3

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sliding_bench_plans_and_runs_more_sequences_in_rings_and_answers_alike(tmp_path, builtin_path, capsys):
    model = make_tiny_model(tmp_path / "gemma3", "gemma3", builtin_path, **GEMMA3)
    parser = argparse.ArgumentParser()
    sliding.add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--requests", "10", "--prompt-tokens", "60", "--max-tokens", "40",
                              "--max-num-batched-tokens", "32", "--kv-cache-mib", "1", "--json"])
    assert sliding.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    full, window = result["full"], result["window"]
    assert result["requests"] == 10 and result["answers_same"] == 10
    # 3 layers' 2 KV heads of 32, K and V, float32: 1,536 B a position, the full layer's 512 alone with rings of
    # ceil((32 + 7) / 16) + 1 = 4 blocks of 16
    assert (full["s_kv"], window["s_kv"], full["ring_tokens"], window["ring_tokens"]) == (1536, 512, 0, 64)
    assert full["max_num_seqs"] == (1 << 20) // (1536 * 100) == 6   # avg_len 100: prompt and answer
    assert window["max_num_seqs"] == (1 << 20) // (512 * 100 + 1024 * 64) == 8
    assert (full["peak_running"], window["peak_running"]) == (6, 8)   # each as many as its plan runs
