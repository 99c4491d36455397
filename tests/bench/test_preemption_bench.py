"""`cliffguard bench preemption --quick` on a tiny random model: every cell runs, the `<` regime preempts,
greedy outputs do not depend on the regime or the mode, and a mode the engine refuses prints `unsupported`."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import preemption
from engine.config import ConfigError, SchedulerConfig
from tests.conftest import make_tiny_model

FACTORS = (4.0, 0.85, 0.5)  # the default --pool-factors


def _swap_supported() -> bool:
    try:
        SchedulerConfig(preemption_mode="swap", swap_space_bytes=1)
    except ConfigError:
        return False
    return True


MODES = ["recompute", "swap", "auto"] if _swap_supported() else ["recompute"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, builtin_path):
    return make_tiny_model(tmp_path_factory.mktemp("preemption-bench") / "llama", "llama", builtin_path)


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    preemption.add_arguments(parser)
    return preemption.run(parser.parse_args(list(argv)))


def test_quick_run_covers_every_cell(tiny_model, capsys):
    assert _run("--model", str(tiny_model), "--quick", "--modes", ",".join(MODES), "--json") == 0
    result = json.loads(capsys.readouterr().out)

    cells = {(c["mode"], c["mix"], c["pool_factor"]): c for c in result["cells"]}
    assert set(cells) == {(m, mix.name, f) for m in MODES for mix in preemption.QUICK_MIXES for f in FACTORS}
    requested = {m["name"]: m["output_tokens"] for m in result["mixes"]}
    for key, c in cells.items():
        assert "unsupported" not in c, key
        assert c["outputs_match"], (key, c["mismatches"])
        assert c["output_tokens"] == requested[c["mix"]], key
    for mode in MODES:
        assert all(cells[(mode, mix.name, 4.0)]["num_preemptions"] == 0 for mix in preemption.QUICK_MIXES)
        under = [cells[(mode, mix.name, 0.5)] for mix in preemption.QUICK_MIXES]
        assert sum(c["num_preemptions"] for c in under) > 0, mode
        assert cells[(mode, "short", 0.5)]["num_preemptions"] > 0, mode
    recompute = cells[("recompute", "short", 0.5)]
    assert recompute["num_recomputed_tokens"] > 0 and recompute["num_swapped_out_blocks"] == 0
    if "swap" in MODES:
        swap = cells[("swap", "short", 0.5)]
        assert swap["num_swap_preemptions"] > 0
        assert swap["num_swapped_out_blocks"] >= swap["num_swapped_in_blocks"] > 0   # less what the cache still held
        assert all(r["auto_vs_best"] is not None for r in result["rows"])
    assert len(result["rows"]) == len(FACTORS) * len(preemption.QUICK_MIXES)


def test_repeats_count_each_run_on_its_own(tiny_model, capsys):
    counts = []
    for repeat in (1, 2):
        assert _run("--model", str(tiny_model), "--quick", "--modes", "recompute", "--pool-factors", "0.5",
                    "--repeat", str(repeat), "--json") == 0
        cells = json.loads(capsys.readouterr().out)["cells"]
        assert all(len(c["wall_s_runs"]) == repeat and c["outputs_match"] for c in cells)
        counts.append([(c["num_preemptions"], c["num_recomputed_tokens"]) for c in cells])
    assert counts[0] == counts[1] and any(n for n, _ in counts[0])


def test_outputs_that_differ_from_the_largest_pools_fail_the_run(tiny_model, capsys, monkeypatch):
    """Preemption must not change an output: a cell whose outputs differ is printed with a cross, and the run
    exits 1 (it exited 0, so a script or CI running it missed a wrong answer)."""
    summarize = preemption._summarize

    def one_differs(*args, **kwargs):
        cell = summarize(*args, **kwargs)
        if not one_differs.done:
            one_differs.done = True
            cell.update(outputs_match=False, mismatches=[{"request": 0, "position": 3, "got": 7, "expected": 9}])
        return cell

    one_differs.done = False
    monkeypatch.setattr(preemption, "_summarize", one_differs)
    assert _run("--model", str(tiny_model), "--quick", "--modes", "recompute", "--pool-factors", "0.5") == 1
    assert "1 requests differ; request 0 first at output position 3: 7 vs 9" in capsys.readouterr().out


@pytest.mark.parametrize("scale", ["10", "1e9", "1e306"])   # 1e9: before drawing billions of ids; 1e306: x 1.25 is inf
def test_a_scale_beyond_the_model_is_refused_before_loading(tiny_model, scale):
    with pytest.raises(ValueError, match="--scale"):
        _run("--model", str(tiny_model), "--quick", "--scale", scale)


def test_table_marks_an_unsupported_mode(tiny_model, capsys, monkeypatch):
    build = preemption.build_engine

    def refuse_swap(args, mode, *rest):
        if mode == "swap":
            raise ConfigError("preemption_mode: 'swap' is not supported yet")
        return build(args, mode, *rest)

    monkeypatch.setattr(preemption, "build_engine", refuse_swap)
    assert _run("--model", str(tiny_model), "--quick", "--modes", "recompute,swap", "--pool-factors", "4,0.5") == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("pool ")]
    assert len(rows) == 2 * len(preemption.QUICK_MIXES)
    assert all("unsupported" in line and "✓" in line and "✗" not in line for line in rows)
    assert "requests, fewer than 100: a lower bound on the tail" in out   # a cell's p99 of its few requests


@pytest.mark.parametrize("flag, value, message", [
    ("--modes", "recompute,teleport", "--modes"), ("--modes", "swap,swap", "--modes"),
    ("--pool-factors", "4,0", "--pool-factors"), ("--pool-factors", "big", "--pool-factors"),
    ("--scale", "0", "--scale"), ("--swap-factor", "-1", "--swap-factor"), ("--repeat", "0", "--repeat"),
    ("--scale", "inf", "--scale"), ("--swap-factor", "nan", "--swap-factor"), ("--pool-factors", "4,inf", "--pool-factors"),
    ("--block-size", "3", "block_size"), ("--max-num-seqs", "0", "max_num_seqs")])
def test_bad_options_are_refused_before_any_work(flag, value, message):
    with pytest.raises(ValueError, match=message):
        _run("--model", "/nonexistent", flag, value)
