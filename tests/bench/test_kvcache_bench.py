"""`cliffguard bench kvcache` on a tiny model: its report's fields, and bad options named."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from bench import kvcache
from tests.conftest import make_tiny_model


def _run(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    kvcache.add_arguments(parser)
    assert kvcache.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_it_reports_agreement_error_and_bytes_for_the_fp8_variants(tmp_path, builtin_path, capsys):
    model = make_tiny_model(tmp_path / "tiny", "llama", builtin_path, initializer_range=0.05, vocab_size=49152)
    result = _run(capsys, "--model", str(model), "--device", "cpu", "--dtype", "float32", "--prompts", "3",
                  "--max-tokens", "4", "--kv-cache-mib", "16")
    assert result["kv_bytes_per_token"]["auto"] == 4 * result["kv_bytes_per_token"]["fp8"]   # float32 -> e4m3
    assert result["dtype"] == "float32" and result["yardstick"] == "bfloat16 model"
    for name in (*kvcache.VARIANTS, kvcache.WEIGHTS, "bfloat16 model"):
        r = result[name]
        assert r["prompts"] == 3 and 0 <= r["identical"] <= 3 and 0.0 <= r["agreed_share"] <= 1.0
        assert r["identical_by_length"] == {"4": r["identical"]}   # JSON keys
        assert r["max_logprob_error"] >= r["mean_logprob_error"] >= 0.0


def test_agreement_by_length_counts_answers_the_same_over_their_first_n_tokens():
    def out(ids):
        return SimpleNamespace(token_ids=ids, top_logprobs=[[(t, -1.0)] for t in ids])
    reference = [out(list(range(20))), out(list(range(20))), out([1, 2, 3])]   # the last one ended early
    outputs = [out(list(range(20))), out(list(range(10)) + [99] * 10), out([1, 2, 3])]
    r = kvcache.compare(reference, outputs)
    assert kvcache.prefix_lengths(20) == [8, 16, 20] and kvcache.prefix_lengths(8) == [8]
    assert r["identical"] == 2 and r["identical_by_length"] == {8: 3, 16: 2, 20: 2}
    assert r["agreed_share"] == pytest.approx((1 + 0.5 + 1) / 3) and r["max_logprob_error"] == 0.0


def test_the_yardstick_is_the_other_common_dtype():
    assert kvcache.yardstick_dtype(torch.float32) == "bfloat16"
    assert kvcache.yardstick_dtype(torch.bfloat16) == kvcache.yardstick_dtype(torch.float16) == "float32"


@pytest.mark.parametrize("argv,named", [(["--prompts", "0"], "--prompts"), (["--max-tokens", "0"], "--max-tokens")])
def test_bad_options_are_named(argv, named):
    parser = argparse.ArgumentParser()
    kvcache.add_arguments(parser)
    with pytest.raises(ValueError, match=named):
        kvcache.run(parser.parse_args(argv))
