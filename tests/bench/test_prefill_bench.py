"""`cliffguard bench prefill` on a tiny random model, with chunks small enough that later chunks run over
a cached prefix: the JSON has every length and repeat, the chunking is the pool's, our greedy token
equals transformers' argmax (the bench checks this itself), and bad options fail before any work."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import prefill
from gateway import cli
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, builtin_path):
    # the builtin tokenizer's full vocabulary, so that the bench's word prompts are valid ids
    return make_tiny_model(tmp_path_factory.mktemp("prefill-bench") / "llama", "llama", builtin_path,
                           vocab_size=49152, max_position_embeddings=256)


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    prefill.add_arguments(parser)
    return prefill.run(parser.parse_args(list(argv)))


def test_prefill_bench_json_chunks_and_greedy_parity(tiny_model, capsys):
    assert _run("--model", str(tiny_model), "--lengths", "40,90", "--max-num-batched-tokens", "32",
                "--repeats", "2", "--kv-cache-mib", "16", "--json") == 0
    result = json.loads(capsys.readouterr().out)

    assert result["max_num_batched_tokens"] == 32 and result["repeats"] == 2
    assert result["dtype"] == "float32" and result["threads"] == 1
    assert [r["length"] for r in result["rows"]] == [40, 90]
    assert [r["chunks"] for r in result["rows"]] == [[32, 8], [32, 32, 26]]
    for row in result["rows"]:
        for key in ("ours", "transformers"):
            runs = row[f"{key}_runs_s"]
            assert len(runs) == 2 and all(s > 0 for s in runs)
            assert row[f"{key}_best_s"] == min(runs) and min(runs) <= row[f"{key}_s"] <= max(runs)
        assert row["ratio"] == pytest.approx(row["ours_s"] / row["transformers_s"])
        assert [g["repeat"] for g in row["greedy"]] == [0, 1]
        assert all(g["match"] and g["ours"] == g["transformers"] for g in row["greedy"]), row["greedy"]
        assert row["greedy_match"]
    assert result["greedy_match"]


def test_prefill_bench_prints_a_table(tiny_model, capsys):
    assert _run("--model", str(tiny_model), "--lengths", "20", "--max-num-batched-tokens", "8",
                "--repeats", "1", "--kv-cache-mib", "16") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["length", "ours", "s"]
    fields = lines[1].split()
    assert fields[0] == "20" and fields[-2] == "same" and fields[-1] == "8+8+4"


def test_make_prompt_is_exact_and_deterministic(builtin_path):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(builtin_path)
    a = prefill.make_prompt(tok, 500, seed=3)
    assert len(a) == 500 and a == prefill.make_prompt(tok, 500, seed=3)
    assert a != prefill.make_prompt(tok, 500, seed=4)
    assert len(prefill.make_prompt(tok, 7, seed=0)) == 7


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "512,abc"], "--lengths"),
    (["--lengths", "1"], "--lengths"),
    (["--repeats", "0"], "--repeats"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--kv-cache-mib", "0"], "--kv-cache-mib"),
])
def test_bad_options_fail_before_any_work(argv, message, capsys):
    assert cli.main(["bench", "prefill", *argv]) == 2
    assert message in capsys.readouterr().err
