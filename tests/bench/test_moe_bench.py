"""`cliffguard bench moe` on a small layer: what it reports, and bad options named."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench import moe  # noqa: E402


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("backend,gpt_oss", [("cpu", False), ("triton", False), ("triton", True)])
def test_it_times_every_path_on_the_same_routing(capsys, monkeypatch, backend, gpt_oss):
    # With the Triton ops (CUDA's; here through the interpreter) the block has the Triton kernels too; GPT-OSS's
    # block (biases, clamped SwiGLU) runs them as well.
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--hidden-size", "64", "--experts", "8", "--top-k", "2",
                  "--moe-intermediate-size", "32", "--tokens", "1,8", "--repeats", "1", "--json",
                  *(["--gpt-oss"] if gpt_oss else []))
    assert moe.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in result["rows"]] == [1, 8] and result["dtype"] == "float32"
    assert result["block"] == ("gpt_oss" if gpt_oss else "qwen3_moe")
    fast = ["triton", "grouped"] if backend == "triton" else ["grouped"]
    assert result["paths"] == [*fast, "loop"]
    for row in result["rows"]:
        assert row["loop_ms"] > 0
        for name in fast:
            assert row[f"{name}_ms"] > 0 and row[f"{name}_max_abs_diff"] < 1e-4
            assert row[f"{name}_speedup"] == pytest.approx(row["loop_ms"] / row[f"{name}_ms"])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_quantized_experts_are_timed_and_checked_against_their_dequantized_weights(capsys, monkeypatch, backend):
    # --fp8, --mxfp4, --int4, --int8 (GPT-OSS's block): the experts in FP8, MXFP4, INT4 and INT8 beside the
    # unquantized paths, through the Triton kernels where the block has them.
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    args = _parse("--device", "cpu", "--dtype", "float32", "--hidden-size", "64", "--experts", "8", "--top-k", "2",
                  "--moe-intermediate-size", "32", "--tokens", "1,8", "--repeats", "1", "--json", "--fp8", "--mxfp4",
                  "--int4", "--int8", "--gpt-oss")
    assert moe.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    for kind in ("fp8", "mxfp4", "int4", "int8"):
        assert result[kind] == ("triton" if backend == "triton" else "loop")
        for row in result["rows"]:
            assert row[f"{kind}_ms"] > 0 and row[f"{kind}_max_abs_diff"] < 1e-4
            assert row[f"{kind}_vs_first"] == pytest.approx(row[f"{result['paths'][0]}_ms"] / row[f"{kind}_ms"])
    with pytest.raises(ValueError, match="--mxfp4: the hidden and intermediate sizes must be multiples of 32"):
        moe.run(_parse("--device", "cpu", "--hidden-size", "48", "--experts", "8", "--top-k", "2", "--mxfp4"))


@pytest.mark.parametrize("argv,named", [(["--top-k", "9", "--experts", "8"], "--top-k"),
                                        (["--tokens", "0"], "--tokens"), (["--repeats", "0"], "--repeats")])
def test_bad_options_are_named(argv, named):
    with pytest.raises(ValueError, match=named):
        moe.run(_parse("--device", "cpu", *argv))


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="a machine with a GPU 7")
def test_a_device_this_machine_lacks_is_named():
    with pytest.raises(ValueError, match="--device: cuda:7"):   # not torch's AssertionError from a capability query
        moe.run(_parse("--device", "cuda:7"))


def test_sizes_left_unset_are_the_models_layer():
    for argv, want in (((), (2048, 128, 8, 768)), (("--gpt-oss",), (2880, 32, 4, 2880)),
                       (("--gpt-oss", "--experts", "16"), (2880, 16, 4, 2880))):
        args = _parse(*argv)
        moe._sizes(args)   # Qwen3-30B-A3B's layer, gpt-oss-20b's with --gpt-oss; a size given is kept
        assert (args.hidden_size, args.experts, args.top_k, args.moe_intermediate_size) == want, argv
