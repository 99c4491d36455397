"""`cliffguard bench kvcache` on a tiny model: its report's fields, and bad options named."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import kvcache
from tests.conftest import make_tiny_model


def _run(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    kvcache.add_arguments(parser)
    assert kvcache.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_it_reports_agreement_error_and_bytes_for_both_fp8_variants(tmp_path, builtin_path, capsys):
    model = make_tiny_model(tmp_path / "tiny", "llama", builtin_path, initializer_range=0.05, vocab_size=49152)
    result = _run(capsys, "--model", str(model), "--device", "cpu", "--prompts", "3", "--max-tokens", "4",
                  "--kv-cache-mib", "16")
    assert result["kv_bytes_per_token"]["auto"] == 4 * result["kv_bytes_per_token"]["fp8"]   # float32 -> e4m3
    for name in kvcache.VARIANTS:
        r = result[name]
        assert r["prompts"] == 3 and 0 <= r["identical"] <= 3 and 0.0 <= r["agreed_share"] <= 1.0
        assert r["max_logprob_error"] >= r["mean_logprob_error"] >= 0.0


@pytest.mark.parametrize("argv,named", [(["--prompts", "0"], "--prompts"), (["--max-tokens", "0"], "--max-tokens")])
def test_bad_options_are_named(argv, named):
    parser = argparse.ArgumentParser()
    kvcache.add_arguments(parser)
    with pytest.raises(ValueError, match=named):
        kvcache.run(parser.parse_args(argv))
