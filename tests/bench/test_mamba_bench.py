"""`cliffguard bench mamba` on short prefills: what it reports, with the Triton kernel through the interpreter, and bad
options named."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from bench import mamba  # noqa: E402


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    mamba.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_it_times_the_recurrence_and_the_kernel_and_checks_the_kernel(capsys):
    pytest.importorskip("triton")
    args = _parse("--device", "cpu", "--dtype", "float32", "--tokens", "3,17", "--channels", "40", "--d-state", "12",
                  "--repeats", "1", "--json")
    assert mamba.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tokens"], r["channels"], r["d_state"]) for r in rows] == [(3, 40, 12), (17, 40, 12)]
    for row in rows:
        assert row["recurrence_ms"] > 0 and row["triton_ms"] > 0
        assert row["triton_speedup"] == pytest.approx(row["recurrence_ms"] / row["triton_ms"])
        assert row["recurrence_tokens_per_s"] == pytest.approx(row["tokens"] / row["recurrence_ms"] * 1e3)
        assert row["max_rel_diff"] < 1e-5   # the kernel against the recurrence


@pytest.mark.parametrize("option,value", [("--tokens", "0"), ("--channels", "0"), ("--d-state", "-1"),
                                          ("--repeats", "0")])
def test_bad_sizes_are_named(option, value):
    with pytest.raises(ValueError, match=f"^{option}:"):
        mamba.run(_parse("--device", "cpu", option, value))


@pytest.mark.parametrize("mode,shape,keys", [
    ("--gated-delta", ("--k-heads", "2", "--v-heads", "4", "--head-dim", "16"), ("k_heads", "v_heads", "head_dim")),
    ("--gated-delta --per-channel", ("--k-heads", "1", "--v-heads", "1", "--head-dim", "16"),
     ("k_heads", "v_heads", "head_dim")),
    ("--ssd", ("--ssd-heads", "4", "--ssd-head-dim", "16", "--ssd-groups", "2", "--ssd-d-state", "16"),
     ("heads", "head_dim", "groups", "d_state")),
    ("--lightning", ("--lightning-heads", "2", "--head-dim", "16"), ("heads", "head_dim"))])
def test_a_linear_attention_or_ssd_layer_times_the_torch_form_and_the_kernels(capsys, mode, shape, keys):
    pytest.importorskip("triton")
    args = _parse(*mode.split(), *shape, "--device", "cpu", "--dtype", "float32", "--tokens", "5,40", "--repeats", "1",
                  "--json")
    assert mamba.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in rows] == [5, 40]
    assert all(tuple(r[key] for key in keys) == tuple(int(v) for v in shape[1::2]) for r in rows)
    assert all(r.get("per_channel", False) == ("--per-channel" in mode) for r in rows)
    for row in rows:
        assert row["torch_ms"] > 0 and row["triton_ms"] > 0
        assert row["triton_speedup"] == pytest.approx(row["torch_ms"] / row["triton_ms"])
        assert row["triton_gb_per_s"] > 0
        assert row["max_rel_diff"] < 1e-4   # the kernels against the torch form, float32


@pytest.mark.parametrize("argv,option", [(("--gated-delta", "--k-heads", "3", "--v-heads", "4"), "--v-heads"),
                                         (("--gated-delta", "--head-dim", "0"), "--head-dim"),
                                         (("--ssd", "--ssd-heads", "5", "--ssd-groups", "2"), "--ssd-heads"),
                                         (("--ssd", "--ssd-d-state", "0"), "--ssd-d-state"),
                                         (("--lightning", "--lightning-heads", "0"), "--lightning-heads"),
                                         (("--mixed-step", "--decodes", "0"), "--decodes"),
                                         (("--mixed-step", "--prefills", "0"), "--prefills"),
                                         (("--pieces", "0"), "--pieces"),
                                         (("--ple", "--pieces", "1"), "--pieces"),
                                         (("--per-channel",), "--per-channel"),
                                         (("--mixed-step", "--tokens", "1"), "--tokens"),
                                         (("--mixed-step", "--k-heads", "3", "--v-heads", "4"), "--v-heads")])
def test_bad_layer_shapes_are_named(argv, option):
    with pytest.raises(ValueError, match=f"^{option}:"):
        mamba.run(_parse("--device", "cpu", *argv))


def test_a_mixed_step_times_the_batched_decodes_against_each_sequence_alone(capsys):
    """`--mixed-step`: a Gated DeltaNet layer's step of decodes beside a prefill chunk, its scan (the decodes in one
    batched step) against each sequence's alone: both timed, their outputs equal."""
    args = _parse("--mixed-step", "--k-heads", "2", "--v-heads", "4", "--head-dim", "16", "--decodes", "5",
                  "--device", "cpu", "--dtype", "float32", "--tokens", "3,70", "--repeats", "1", "--json")
    assert mamba.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tokens"], r["prefills"], r["decodes"]) for r in rows] == [(3, 1, 5), (70, 1, 5)]
    for row in rows:
        assert row["alone_ms"] > 0 and row["step_ms"] > 0 and row["chunks_one_by_one_ms"] > 0
        assert row["speedup"] == pytest.approx(row["alone_ms"] / row["step_ms"])
        assert row["max_rel_diff"] < 1e-5


def test_a_step_of_several_prefill_chunks_times_them_at_once_against_one_by_one(capsys):
    """`--mixed-step --prefills 3`: the layer's chunks as one scan against the same step's chunks one by one and each
    sequence alone, outputs equal."""
    args = _parse("--mixed-step", "--k-heads", "2", "--v-heads", "4", "--head-dim", "16", "--decodes", "0",
                  "--prefills", "3", "--device", "cpu", "--dtype", "float32", "--tokens", "70", "--repeats", "1",
                  "--json")
    assert mamba.run(args) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["prefills"], row["decodes"]) == (3, 0)
    assert 0 < row["step_ops"] < row["chunks_one_by_one_ops"] < row["alone_ops"] * 2
    assert row["chunks_speedup"] == pytest.approx(row["chunks_one_by_one_ms"] / row["step_ms"])
    assert row["max_rel_diff"] < 1e-5



def test_mamba_1_pieces_time_one_by_one_against_at_once(capsys):
    """`--pieces 3`: three sequences through a Mamba-1 layer's scan one by one and at once, outputs equal."""
    args = _parse("--pieces", "3", "--channels", "16", "--d-state", "4", "--device", "cpu", "--dtype", "float32",
                  "--tokens", "5,40", "--repeats", "1", "--json")
    assert mamba.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tokens"], r["pieces"]) for r in rows] == [(5, 3), (40, 3)]
    for row in rows:
        assert row["speedup"] == pytest.approx(row["one_by_one_ms"] / row["at_once_ms"])
        assert row["max_rel_diff"] < 1e-5


def test_a_ple_layers_chunks_at_once_cost_the_same_operators_however_many(capsys, tmp_path, builtin_path):
    """`--ple`: Qwen4-Exp's PLE layer (the tiny test model's shape) in an engine's step of 2, then 5 prompts: at once
    the same aten operators for both, one by one more for each prompt; outputs equal."""
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import QWEN4_EXP

    folder = make_tiny_model(tmp_path / "qwen4", "qwen4_exp_text", builtin_path, **QWEN4_EXP)
    rows = []
    for prompts in (2, 5):
        args = _parse("--ple", "--ple-model", str(folder), "--pieces", str(prompts), "--device", "cpu", "--dtype",
                      "float32", "--tokens", "9", "--repeats", "1", "--json")
        assert mamba.run(args) == 0
        (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert (row["prompts"], row["tokens"]) == (prompts, 9)
        assert row["speedup"] == pytest.approx(row["one_by_one_ms"] / row["at_once_ms"])
        assert row["max_rel_diff"] < 1e-5
        rows.append(row)
    assert rows[0]["at_once_ops"] == rows[1]["at_once_ops"] < rows[0]["one_by_one_ops"] < rows[1]["one_by_one_ops"]
