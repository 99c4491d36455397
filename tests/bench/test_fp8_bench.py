"""`cliffguard bench fp8` at the tiny shape: what it reports on either path, and bad options named."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from bench import fp8  # noqa: E402


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fp8.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("int4", [False, True, "zero-points", "int8"])
def test_it_times_both_ways_and_checks_they_agree(capsys, monkeypatch, backend, int4):
    # With the Triton ops (CUDA's; here through the interpreter) the held layer runs its Triton GEMM.
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--tokens", "1,16", "--repeats", "1",
                  "--json", *([f"--{int4}" if int4 == "int8" else "--int4"] if int4 else []),
                  *(["--zero-points"] if int4 == "zero-points" else []))
    assert fp8.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["path"] == ("triton" if backend == "triton" else "reference") and result["agree"]
    assert result["format"] == ("int8" if int4 == "int8" else "int4" if int4 else "fp8")
    assert result["zero_points"] == (int4 == "zero-points")
    assert [r["tokens"] for r in result["rows"]] == [1, 16] and result["copy_bytes_per_s"] is None
    hidden, heads, kv_heads, d, inter = fp8.SHAPES["tiny"]
    shapes = (((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter))
    weights = sum(n * k for n, k in shapes)
    # INT4: half a byte a weight, a float32 scale (the model's dtype here) a 128 (and a byte's zero point); INT8: a
    # byte a weight and the scales; FP8: a byte, a float32 scale a block
    held = (weights if int4 == "int8" else weights // 2) + weights // 128 * (5 if int4 == "zero-points" else 4) \
        if int4 else weights + sum(-(-n // 128) * -(-k // 128) * 4 for n, k in shapes)
    for row in result["rows"]:
        assert row["dense_weight_bytes"] == 4 * weights and row["held_weight_bytes"] == held
        assert row["held_ms"] > 0 and row["dense_ms"] > 0 and row["max_rel_diff"] <= 1e-5
    assert fp8.run(_parse("--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--tokens", "1",
                          "--repeats", "1")) == 0
    assert "fp8" in capsys.readouterr().out


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="--tokens"):
        fp8.run(_parse("--device", "cpu", "--tokens", "0"))
    with pytest.raises(ValueError, match="--repeats"):
        fp8.run(_parse("--device", "cpu", "--repeats", "0"))
    with pytest.raises(ValueError, match="--zero-points: integer weights' \\(with --int4 or --int8\\)"):
        fp8.run(_parse("--device", "cpu", "--zero-points"))
    with pytest.raises(ValueError, match="--int4, --int8: one width at a time"):
        fp8.run(_parse("--device", "cpu", "--int4", "--int8"))
