"""`cliffguard bench kernels --dry-run` on the CPU: every shape checks ✓ against the reference (through Triton's
interpreter when the Triton kernels exist), a wrong kernel is caught, `--json` parses, and without a GPU the full
run refuses. `cliffguard bench engine --model bench/models/llama-3-8b --random-weights`: the folder resolves, gets
a tokenizer and config overrides, and a shrunken copy runs end to end against transformers."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse
import json

import pytest
import torch

from bench import engine as engine_bench, kernels as kernels_bench
from engine.model_config import ModelConfig
from kernels import reference

LLAMA_3_8B = "bench/models/llama-3-8b"
NUM_DRY_RUN_SHAPES = sum(len(kernels_bench.parse_shapes(kernels_bench.DEFAULTS[k][1], k))
                         for k in ("decode_shapes", "prefill_shapes", "store_shapes"))
TRITON = pytest.mark.skipif(not kernels_bench.triton_available(),
                            reason="kernels/triton_attention.py, kernels/triton_kv_store.py or triton missing")


def _run_kernels(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    kernels_bench.add_arguments(parser)
    return kernels_bench.run(parser.parse_args(list(argv)))


def _run_engine(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    return engine_bench.run(parser.parse_args(list(argv)))


def _assert_every_row_ok(result: dict) -> None:
    rows = result["decode"] + result["prefill"] + result["store_kv"]
    assert len(rows) == NUM_DRY_RUN_SHAPES
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert result["all_ok"] and result["dry_run"] and not result["goals"]["judged"]
    assert result["copy_gbps"] > 0 and result["matmul_tflops"] > 0


# --- bench kernels ---------------------------------------------------------------------------------


def test_dry_run_on_the_torch_reference_prints_a_check_per_shape(capsys):
    assert _run_kernels("--dry-run", "--backend", "torch") == 0
    out = capsys.readouterr().out
    assert "DRY RUN" in out and "the timings and rates do not" in out
    assert out.count("✓") == NUM_DRY_RUN_SHAPES + 1  # one per shape, one in the summary line
    assert "✗" not in out
    for section in ("decode paged attention", "prefill paged attention", "store_kv", "GB/s", "TFLOP/s", "copy"):
        assert section in out


def test_dry_run_json_parses(capsys):
    assert _run_kernels("--dry-run", "--backend", "torch", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    _assert_every_row_ok(result)
    assert result["backend"] == "torch"
    assert {r["sdpa_variant"] for r in result["prefill"]} <= {"enable_gqa", "expanded"}
    assert {r["kernel"] for r in result["prefill"]} == {"reference"}
    assert not any(r["goal"] for r in result["prefill"])  # only prompts of >= 2,048 tokens count for the goal


@TRITON
@pytest.mark.parametrize("extra", [   # split decoding's own kernels: tests/kernels
    (), pytest.param(("--dtype", "bfloat16", "--num-splits", "3"), marks=pytest.mark.slow)], ids=["fp32", "bf16-split"])
def test_dry_run_on_the_triton_kernels_through_the_interpreter(extra, capsys):
    assert _run_kernels("--dry-run", "--json", *extra) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "triton"
    _assert_every_row_ok(result)
    # the whole 80-token prompt runs the prefill kernel, the 17-token ones the paged kernel
    assert [(r["seq_len"], r["kernel"]) for r in result["prefill"]] == [(80, "prefill"), (17, "paged")]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON)])
def test_an_fp8_cache_is_checked_and_its_bytes_counted(backend, capsys):
    """`--kv-dtype fp8`: the kernels read and write the cache as the engine's FP8 cache, checked against the
    reference, and the bandwidth counts a byte a value (a quarter of float32's)."""
    shapes = ("--dry-run", "--json", "--backend", backend, "--decode-shapes", "2x20", "--prefill-shapes", "1x18",
              "--store-shapes", "2x3")
    results = {}
    for kv in ("auto", "fp8"):
        assert _run_kernels(*shapes, "--kv-dtype", kv) == 0
        results[kv] = json.loads(capsys.readouterr().out)
        assert results[kv]["all_ok"] and len(results[kv]["decode"] + results[kv]["store_kv"]) == 2
    assert (results["auto"]["kv_dtype"], results["fp8"]["kv_dtype"]) == ("float32", "float8_e4m3fn")
    q_and_o = 2 * 2 * 4 * 32 * 4                                    # 2 rows x 4 heads x head_dim 32, float32
    assert results["fp8"]["decode"][0]["bytes"] - q_and_o == (results["auto"]["decode"][0]["bytes"] - q_and_o) // 4


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON)])
def test_a_latent_cache_is_read_as_k_and_v_and_its_one_plane_counted(backend, capsys):
    """`--latent`: DeepSeek's one-plane cache (rows both K and V, one KV head of 40 under 4 query heads in a dry
    run), checked against the reference; decode counts the plane once, store_kv its two writes."""
    assert _run_kernels("--dry-run", "--json", "--backend", backend, "--latent", "--decode-shapes", "2x20",
                        "--prefill-shapes", "1x18", "--store-shapes", "2x3") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["all_ok"] and result["latent"] and (result["num_heads"], result["num_kv_heads"],
                                                      result["head_dim"]) == (4, 1, 40)
    assert result["decode"][0]["bytes"] == 2 * 20 * 40 * 4 + 2 * 2 * 4 * 40 * 4   # the plane once; Q and O
    assert result["store_kv"][0]["bytes"] == 2 * (6 * 40 * 4) + 6 * 2 * 40 * 4 + 6 * 8
    assert _run_kernels("--dry-run", "--backend", backend, "--latent", "--decode-shapes", "2x20",
                        "--prefill-shapes", "1x18", "--store-shapes", "2x3") == 0
    assert "latent: one plane" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--latent"):
        _run_kernels("--dry-run", "--latent", "--num-kv-heads", "2")


def test_a_wrong_kernel_is_flagged_and_fails_the_run(monkeypatch, capsys):
    def off_by_a_bit(query, k_cache, v_cache, meta, scale, **kwargs):
        out = reference.paged_attention(query, k_cache, v_cache, meta, scale)
        out[-1, 0, 0] += 0.5
        return out

    def stores_nothing(key, value, k_cache, v_cache, meta):
        pass

    wrong = kernels_bench.Backend("torch", "test", off_by_a_bit, stores_nothing)
    monkeypatch.setattr(kernels_bench, "load_backend", lambda name, device: wrong)
    assert _run_kernels("--dry-run", "--decode-shapes", "2x20", "--prefill-shapes", "1x18",
                        "--store-shapes", "2x3") == 1
    out = capsys.readouterr().out
    assert out.count("✗") == 3 + 1 and "FAILED" in out  # one per shape, one in the summary line


def test_the_prefill_goal_is_judged_on_the_long_prompts_only():
    rows = [{"seq_len": 4096, "ratio": 0.8, "goal": True}, {"seq_len": 2048, "ratio": 0.75, "goal": True},
            {"seq_len": 512, "ratio": 0.3, "goal": False}]
    goals = kernels_bench._goals({"decode": [], "prefill": rows}, judged=True)
    assert goals["prefill_met"] and goals["prefill_min_ratio"] == 0.75
    rows[1]["ratio"] = 0.6
    assert not kernels_bench._goals({"decode": [], "prefill": rows}, judged=True)["prefill_met"]
    assert kernels_bench._goals({"decode": [], "prefill": rows[2:]}, judged=True)["prefill_min_ratio"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_the_full_run_exits_2(capsys):
    assert _run_kernels() == 2
    assert "--dry-run" in capsys.readouterr().err


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="--decode-shapes"):
        _run_kernels("--dry-run", "--decode-shapes", "8by128")
    with pytest.raises(ValueError, match="--num-kv-heads"):
        _run_kernels("--dry-run", "--num-heads", "6", "--num-kv-heads", "4")
    from gateway.cli import main   # a block size the kernels do not take, a count of none: a ZeroDivisionError was
    for bad in (["--block-size", "0"], ["--block-size", "7"], ["--num-heads", "0"], ["--iters", "0"]):   # raised
        assert main(["bench", "kernels", "--dry-run", *bad]) == 2, bad


# --- bench engine on the Llama-3-8B shape ------------------------------------------------------------


def test_llama_3_8b_folder_is_the_real_shape():
    cfg = ModelConfig.from_folder(engine_bench.REPO_ROOT / LLAMA_3_8B)
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == \
        ("LlamaForCausalLM", 4096, 14336, 32)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 128256)
    assert (cfg.max_position_embeddings, cfg.rope_theta, cfg.rms_norm_eps) == (8192, 500000.0, 1e-5)
    assert round(cfg.num_params() / 1e9, 2) == 8.03


def test_model_folder_gets_a_tokenizer_and_overrides_from_any_directory(tmp_path, monkeypatch, builtin_path):
    from engine.tokenizer import Tokenizer

    monkeypatch.chdir(tmp_path)  # the relative name resolves from the repository root
    overrides = engine_bench.parse_overrides(["num_hidden_layers=2", "rope_scaling=null"])
    assert overrides == {"num_hidden_layers": 2, "rope_scaling": None}
    folder = engine_bench.prepare_model_folder(LLAMA_3_8B, tmp_path, overrides)
    cfg = ModelConfig.from_folder(folder)
    assert cfg.num_layers == 2 and cfg.hidden_size == 4096
    tokenizer = Tokenizer.from_folder(folder)
    ids = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert ids and max(ids) < cfg.vocab_size
    # untouched: the source folder, and a folder that needs nothing
    assert ModelConfig.from_folder(engine_bench.REPO_ROOT / LLAMA_3_8B).num_layers == 32
    assert engine_bench.prepare_model_folder(str(builtin_path), tmp_path) == str(builtin_path)
    with pytest.raises(ValueError, match="hidden_sise"):
        engine_bench.prepare_model_folder(LLAMA_3_8B, tmp_path, {"hidden_sise": 64})


def test_config_override_needs_random_weights():
    with pytest.raises(ValueError, match="--random-weights"):
        _run_engine("--model", LLAMA_3_8B, "--config-override", "num_hidden_layers=2")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _run_engine("--model", LLAMA_3_8B, "--random-weights", "--config-override", "num_hidden_layers")


def test_llama_3_8b_shrunk_runs_end_to_end_against_transformers(capsys, builtin_path, monkeypatch):
    # the roofline's rates measured at the sizes `bench kernels --dry-run` uses on a CPU (32 MiB, n 256), not a
    # 256 MiB copy and 2048 x 2048 matmuls
    copy, matmul = engine_bench.measure_copy_bandwidth, engine_bench.measure_matmul_rate
    monkeypatch.setattr(engine_bench, "measure_copy_bandwidth", lambda device: copy(device, 32 << 20))
    monkeypatch.setattr(engine_bench, "measure_matmul_rate", lambda device, dtype: matmul(device, dtype, 256))
    tiny = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4",
            "num_key_value_heads=2"]
    argv = ["--model", LLAMA_3_8B, "--random-weights", "--num-prompts", "3", "--min-output", "2",
            "--max-output", "5", "--hf-batch-sizes", "3", "--kv-cache-mib", "16", "--also-torch-linear", "--json"]
    for item in tiny:
        argv += ["--config-override", item]
    assert _run_engine(*argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ours"]["tok_per_s"] > 0
    assert [t["batch_size"] for t in result["transformers"]] == [3]
    if torch.backends.mkldnn.is_available():  # the same engine on torch's linears, in the same run
        assert result["ours_torch_linear"]["tok_per_s"] > 0
        assert "CLIFFGUARD_CPU_LINEAR" not in os.environ
    d = result["decode"]
    assert d["kv_tokens"] > 0 and d["kv_bytes"] == d["kv_tokens"] * 2 * 2 * 2 * 16 * 4  # layers, K/V, heads, dim
    assert d["floor_ms"] > 0


def test_the_decode_roofline_of_a_mixture_of_experts_counts_the_experts_a_step_uses(monkeypatch):
    """A dense model's floors count every weight; a Qwen3-MoE's the experts a decode step of that batch reads
    (bytes) and those its tokens compute with (FLOPs), as the simulator's roofline does: 10x less compute
    for a 30B-A3B shape than all its experts."""
    from types import SimpleNamespace

    from engine.roofline import expert_params, experts_read, routed_per_token, step_flops

    monkeypatch.setattr(engine_bench, "measure_copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(engine_bench, "measure_matmul_rate", lambda device, dtype: 1e15)
    steps = [(8, 0, 0.01, 800)] * 5   # decode steps: batch 8, no prefill, 10 ms, 800 context tokens
    moe = ModelConfig.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "max_position_embeddings": 40960})
    dense = ModelConfig.from_folder(engine_bench.REPO_ROOT / LLAMA_3_8B)
    for cfg in (moe, dense):
        engine = SimpleNamespace(model_config=cfg, kv_cache=SimpleNamespace(dtype=torch.bfloat16))
        roof = engine_bench.decode_roofline(engine, steps, torch.device("cpu"), torch.bfloat16)
        assert roof["gflop_per_step"] == pytest.approx(step_flops(cfg, 8, 800, 8) / 1e9)
        head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        unread = expert_params(cfg) * (1 - experts_read(cfg, 8))
        assert roof["weight_bytes"] == pytest.approx((cfg.num_params() - head - unread) * 2, abs=2)
    assert roof["gflop_per_step"] == pytest.approx(2 * 8 * (dense.num_params() - dense.vocab_size * 4096) / 1e9
                                                   + 4 * 32 * 32 * 128 * 800 / 1e9)   # dense: every weight
    assert step_flops(moe, 8, 800, 8) < 0.2 * 2 * 8 * moe.num_params()
    # Nemotron 3's experts: up and down alone, Super's over a latent space of 1,024
    nemotron = ModelConfig.from_hf_config({"architectures": ["NemotronHForCausalLM"], "hidden_size": 4096,
                                           "hybrid_override_pattern": "ME*E", "n_routed_experts": 64,
                                           "num_experts_per_tok": 4, "moe_intermediate_size": 512,
                                           "moe_latent_size": 1024, "vocab_size": 1000, "num_attention_heads": 32,
                                           "num_key_value_heads": 2, "intermediate_size": 1024, "head_dim": 128})
    assert expert_params(nemotron) == 2 * 64 * 2 * 1024 * 512
    # LongCat-Flash: a third of a token's 12 picks fall on its 256 zero experts, which read and compute nothing
    longcat = ModelConfig.from_hf_config({"architectures": ["LongcatFlashForCausalLM"]})
    assert routed_per_token(longcat) == 8 and experts_read(longcat, 1) == pytest.approx(8 / 512)
    assert step_flops(longcat, 1, 0, 0) == pytest.approx(
        2 * (longcat.num_params() - 2 * longcat.vocab_size * 6144 - expert_params(longcat) * (1 - 8 / 512)))
