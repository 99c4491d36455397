"""`cliffguard bench moe` on a small layer: what it reports, and bad options named."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import moe


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_it_times_both_paths_on_the_same_routing(capsys):
    args = _parse("--device", "cpu", "--hidden-size", "64", "--experts", "8", "--top-k", "2",
                  "--moe-intermediate-size", "32", "--tokens", "1,8", "--repeats", "2", "--json")
    assert moe.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in result["rows"]] == [1, 8] and result["dtype"] == "float32"
    for row in result["rows"]:
        assert row["grouped_ms"] > 0 and row["loop_ms"] > 0 and row["max_abs_diff"] < 1e-4
        assert row["speedup"] == pytest.approx(row["loop_ms"] / row["grouped_ms"])


@pytest.mark.parametrize("argv,named", [(["--top-k", "9", "--experts", "8"], "--top-k"),
                                        (["--tokens", "0"], "--tokens"), (["--repeats", "0"], "--repeats")])
def test_bad_options_are_named(argv, named):
    with pytest.raises(ValueError, match=named):
        moe.run(_parse("--device", "cpu", *argv))
