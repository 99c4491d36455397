"""`cliffguard bench hostcost` on a shrunken model: every measurement comes back with its goal judged from
its own figures, the phases add up to no more than the step, ops are counted on both sides, and bad options
are refused by name before anything loads."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import hostcost

SMALL = ("--layers", "2", "--batch", "4", "--steps", "3", "--batch-sizes", "1,3", "--lengths", "20,40",
         "--length-batch", "2", "--json")


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    hostcost.add_arguments(parser)
    return hostcost.run(parser.parse_args(list(argv)))


def test_every_measurement_is_reported_and_judged(capsys, one_thread):
    assert _run(*SMALL) == 0
    result = json.loads(capsys.readouterr().out)
    compare = result["compare"]
    assert compare["ours_ms"] > 0 and compare["transformers_ms"] > 0
    assert compare["ratio"] == pytest.approx(compare["ours_ms"] / compare["transformers_ms"])
    assert compare["met"] == (compare["ratio"] <= hostcost.HOST_GOAL)
    assert set(compare["phases_ms"]) == set(hostcost.PHASES)
    assert sum(compare["phases_ms"].values()) <= compare["ours_ms"] * 1.5   # medians of parts, near the whole
    ops = compare["ops_per_layer"]
    assert 5 < ops["ours"] < 200 and 5 < ops["transformers"] < 200
    assert [row["batch"] for row in result["batch_table"]] == [1, 3]
    lengths = result["length_table"]
    assert [row["output_len"] for row in lengths["rows"]] == [20, 40]
    assert lengths["ratio"] == pytest.approx(lengths["rows"][1]["step_ms"] / lengths["rows"][0]["step_ms"])
    assert lengths["met"] == (lengths["ratio"] <= hostcost.LENGTH_GOAL)
    for row in lengths["rows"]:   # the attention kernel was timed apart, inside the step
        assert 0 < row["phases_ms"]["attention"] < row["step_ms"]
        assert row["step_less_attention_ms"] < row["step_ms"]
    assert lengths["host_met"] == (lengths["host_ratio"] <= hostcost.LENGTH_GOAL)
    assert lengths["outside_forward_met"] == (lengths["outside_forward_ratio"] <= hostcost.LENGTH_GOAL)
    assert all(0 < row["outside_forward_ms"] < row["step_ms"] for row in lengths["rows"])


def test_the_length_table_runs_on_another_model_where_asked(capsys, one_thread, tmp_path, builtin_path):
    from tests.conftest import make_tiny_model

    path = str(make_tiny_model(tmp_path / "tiny", "llama", builtin_path))
    assert _run(*SMALL, "--batch-sizes", "1", "--length-model", path) == 0   # the batch table: not read here
    lengths = json.loads(capsys.readouterr().out)["length_table"]
    assert lengths["model"] == path and [row["output_len"] for row in lengths["rows"]] == [20, 40]
    assert all(0 < row["outside_forward_ms"] < row["step_ms"] for row in lengths["rows"])


def test_the_text_report_names_each_goal(capsys, one_thread):
    assert _run(*[a for a in SMALL if a != "--json"], "--skip-lengths", "--batch-sizes", "1") == 0
    out = capsys.readouterr().out
    assert "transformers forward + argmax" in out and "goal <= 0.5x" in out and "ops per layer" in out
    assert "output length" not in out


def test_the_tokenizer_comes_from_a_folder_where_the_builtin_is_missing(capsys, one_thread, tmp_path, builtin_path):
    """A GPU machine lacks the builtin's package: the model's tokenizer files come from a folder given."""
    import shutil

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("config.json", *hostcost.TOKENIZER_FILES):
        shutil.copy(builtin_path / name, folder / name)
    assert _run(*SMALL, "--skip-lengths", "--batch-sizes", "1", "--tokenizer", str(folder)) == 0
    assert json.loads(capsys.readouterr().out)["compare"]["ours_ms"] > 0
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="--tokenizer: .* has no tokenizer.json"):
        _run(*SMALL, "--tokenizer", str(folder))


def test_ops_are_counted_on_an_eager_forward_where_decode_steps_replay_graphs(one_thread, tmp_path):
    """On CUDA a decode step replays a graph and calls no forward: the count runs that step eager."""
    args = argparse.Namespace(prompt_len=4, vocab_size=512, device="cpu", dtype="float32")
    folder = hostcost.make_model(tmp_path / "model", 2, 64, 512)
    ours = hostcost.Ours(folder, args, batch=2, max_tokens=8)

    class Replays:   # a decode step would replay this, never the model's forward
        def can_run(self, *args):
            return True

        def run(self, *args):
            raise AssertionError("the count must run the forward eagerly")

    ours.engine.runner.graphs = graphs = Replays()
    assert 5 < ours.ops_per_layer() < 200 and ours.engine.runner.graphs is graphs


@pytest.mark.parametrize("argv, message", [
    (("--batch-sizes", "0,2"), "--batch-sizes"),
    (("--lengths", "5,100"), "--lengths"),
    (("--hidden-size", "66"), "--hidden-size"),
    (("--hidden-size", "12"), "--hidden-size"),   # 4 heads of 3: rotary needs an even head size
    (("--steps", "0"), "--steps"),
    (("--vocab-size", "10"), "--vocab-size"),
    (("--length-model", "/nonexistent/model"), "--length-model"),
    (("--length-model", "builtin:smollm2-135m-instruct", "--skip-lengths"), "--length-model"),
])
def test_bad_options_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        _run(*argv)
