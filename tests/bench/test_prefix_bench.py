"""`cliffguard bench prefix` on a tiny Qwen3.5 (state layers: `engine.state_cache`): conversations sharing a system
prompt, served with prefix caching and without, answer alike; the cached engine computes fewer prompt tokens, the
uncached one computes them all, and the cached one resumed from kept states (the second user on, every later
turn)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import prefix
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import QWEN3_5

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefix_bench_answers_alike_and_computes_less_with_the_cache(tmp_path, builtin_path, capsys):
    model = make_tiny_model(tmp_path / "qwen3_5", "qwen3_5", builtin_path, **QWEN3_5)
    parser = argparse.ArgumentParser()
    prefix.add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--users", "3", "--turns", "2", "--system-tokens", "40",
                              "--user-tokens", "12", "--max-tokens", "6", "--max-num-batched-tokens", "32",
                              "--kv-cache-mib", "4", "--json"])
    assert prefix.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    cached, uncached = result["cached"], result["uncached"]
    assert result["requests"] == 6 and result["answers_differing"] == 0
    # prompts: 52 tokens each first turn, 52 + 6 + 12 = 70 the second: 3 x 52 + 3 x 70 computed without the cache
    assert uncached["prompt_tokens_computed"] == 366 and uncached["prompt_tokens_cached"] == 0
    assert cached["prompt_tokens_computed"] + cached["prompt_tokens_cached"] == 366
    # the first user's first chunk (32 tokens, 2 blocks of the system prompt) kept its state: the second user on
    # resume from it, and each second turn from where its first turn's prompt ended (block 3)
    assert cached["snapshots_loaded"] == 5 and cached["prompt_tokens_cached"] == 2 * 32 + 3 * 48
