"""`cliffguard bench dsa` on a short context: what it reports, on the torch reference and on the Triton kernels (here
through the interpreter), and bad options named."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from bench import dsa  # noqa: E402


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    dsa.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_it_times_the_dense_and_the_sparse_paths_and_checks_the_sparse_one(capsys, monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "80", "--topk", "16",
                  "--repeats", "1", "--json")
    assert dsa.run(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["backend"], row["context"], row["topk"], row["heads"]) == (
        "kernels.triton_attention" if backend == "triton" else "kernels.cpu_attention", 80, 16, 16)
    assert all(row[f"{name}_ms"] > 0 for name in ("dense", "choose", "attend"))
    assert row["sparse_ms"] == pytest.approx(row["choose_ms"] + row["attend_ms"])
    assert row["sparse_speedup"] == pytest.approx(row["dense_ms"] / row["sparse_ms"])
    assert row["max_abs_diff"] < 1e-4   # the backend's sparse attention against the torch reference's


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_block_sparse_times_minimax_m3s_layer_and_checks_it(capsys, monkeypatch, backend):
    """--block-sparse: MiniMax M3's layer over 3 blocks of 128 keys, the best 2 a query (the Triton kernels through the
    interpreter, or the torch attention), against the torch attention."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "300", "--block-sparse",
                  "--topk-blocks", "2", "--heads", "4", "--repeats", "1", "--json")
    assert dsa.run(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["model"], row["context"], row["topk_blocks"], row["heads"]) == ("minimax-m3", 300, 2, 4)
    assert row["dense_ms"] > 0 and row["sparse_ms"] > 0
    assert row["sparse_speedup"] == pytest.approx(row["dense_ms"] / row["sparse_ms"])
    assert row["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("chunk", [0, 24])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_qsa_times_and_counts_qwen4_exps_layer_and_checks_its_kernels(capsys, monkeypatch, backend, chunk):
    """--qsa: Qwen4-Exp's layer over 200 cached tokens in blocks of 16, the best 2 a query, as 2 decodes or one
    chunk of 24: the dense, torch and choice paths timed and their aten operators counted; on the Triton backend
    (the interpreter here) the kernel's path too, against the torch form."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "200", "--qsa",
                  "--qsa-ratio", "16", "--topk-blocks", "2", "--qsa-chunk", str(chunk), "--heads", "4",
                  "--repeats", "1", "--json")
    assert dsa.run(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["model"], row["ratio"], row["topk_blocks"], row["heads"]) == ("qwen4-exp", 16, 2, 4)
    assert (row["batch"], row["new_tokens"]) == ((1, 24) if chunk else (2, 2))
    paths = ("dense", "torch", "choice") + (("blocks",) if backend == "triton" else ())
    assert all(row[f"{name}_ms"] > 0 and row[f"{name}_ops"] > 0 for name in paths)
    assert row["choice_ops"] < row["torch_ops"]   # the choice alone is part of what the torch form does
    if backend == "triton":
        assert row["blocks_ops"] >= row["choice_ops"] and isinstance(row["max_abs_diff"], float)
        assert row["max_abs_diff"] < 1e-4
        assert row["torch_speedup"] == pytest.approx(row["torch_ms"] / row["blocks_ms"])
    else:
        assert "blocks_ms" not in row and row["max_abs_diff"] is None


@pytest.mark.parametrize("flag", ["--batch", "--context", "--topk", "--repeats", "--topk-blocks", "--qsa-ratio"])
def test_bad_options_are_named(flag):
    with pytest.raises(ValueError, match=f"^{flag}: must be >= 1"):
        dsa.run(_parse("--device", "cpu", flag, "0"))


@pytest.mark.parametrize("argv,message", [(("--qsa-chunk", "-1"), "--qsa-chunk: must be >= 0"),
                                          (("--context", "64", "--qsa-chunk", "64"), "--qsa-chunk: must be >= 0 and "
                                                                                      "below --context \\(64\\)"),
                                          (("--qsa", "--block-sparse"), "--qsa: one layer at a time")])
def test_bad_qsa_options_are_named(argv, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        dsa.run(_parse("--device", "cpu", *argv))
