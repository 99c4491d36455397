"""The `cliffguard` command: `generate` end to end, `capacity`, `serve`'s start-up checks and the help
texts. Every user mistake exits 2 with one line naming what to fix, before anything loads."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import socket
from pathlib import Path

import pytest
import yaml

from gateway.cli import build_parser, main
from tests.gateway.conftest import chat_pool_yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "examples" / "llama3-70b-8xh100.yaml"
LLAMA70B_JSON = REPO / "config" / "examples" / "llama-3-70b" / "config.json"
FP8_EXAMPLE = REPO / "config" / "examples" / "qwen3-32b-2xh100-fp8.yaml"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _never_loads(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the gateway started loading")

    monkeypatch.setattr("gateway.app.run", fail)


# --- generate ---------------------------------------------------------------------------------------
def test_generate_prints_a_chat_completion(builtin_path, capsys, monkeypatch):
    """--system implies --chat (it was dropped without it: the prompt went raw)."""
    from engine.tokenizer import Tokenizer

    chats, encode_chat = [], Tokenizer.encode_chat
    monkeypatch.setattr(Tokenizer, "encode_chat", lambda self, messages, **kw: chats.append(messages) or
                        encode_chat(self, messages, **kw))
    rc = main(["generate", "--model", str(builtin_path), "--system", "You are a helpful assistant.",
               "--kv-cache-mib", "64", "--max-model-len", "512", "--max-tokens", "12",
               "--prompt", "What is the capital of France?"])
    out = capsys.readouterr().out
    assert rc == 0 and "Paris" in out
    assert chats == [[{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What is the capital of France?"}]]


def test_generate_reports_a_bad_model_clearly(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert rc == 2 and "nope" in _error_line(capsys)


def test_generate_plans_its_pool_with_the_capacity_formula(builtin_path, capsys):
    """64 MiB cannot hold one request of the model's 8,192-token context: the planner says so."""
    rc = main(["generate", "--model", str(builtin_path), "--kv-cache-mib", "64", "--prompt", "hi"])
    line = _error_line(capsys)   # the flags named, not the YAML keys of the one pool it plans
    assert rc == 2 and "one request of max_model_len 8192 needs 512" in line and "--kv-cache-mib" in line
    assert "pools[0]" not in line


def test_a_plan_error_names_the_file_as_a_read_error_does(tmp_path, capsys):
    """The file's own checks ended with `(in <file>)`; the plan's and the model's, run once it is read, did not."""
    for name, pool in (("len.yaml", "model: builtin:smollm2-135m-instruct, max_model_len: 99999"),
                       ("model.yaml", f"model: {tmp_path / 'nowhere'}")):
        (tmp_path / name).write_text(f"pools:\n  - {{name: chat, kv_share: 0.5, {pool}}}\n")
        assert main(["capacity", "--config", str(tmp_path / name)]) == 2
        line = _error_line(capsys)
        assert line.startswith("cliffguard capacity: error: pools[0].") and line.endswith(f"(in {tmp_path / name})")


def test_bench_engine_rejects_bad_batch_sizes_before_loading(capsys):
    rc = main(["bench", "engine", "--hf-batch-sizes", "16,x", "--model", "/nonexistent"])
    assert rc == 2 and "--hf-batch-sizes" in capsys.readouterr().err
    for bad, said in ((["--num-prompts", "0"], "argument --num-prompts: must be an integer in 1.."),
                      (["--min-output", "20", "--max-output", "10"], "--min-output 20 is above --max-output 10")):
        assert main(["bench", "engine", "--model", "/nonexistent", *bad]) == 2 and said in _error_line(capsys)
    assert main(["generate", "--prompt", "hi", "--block-size", "7"]) == 2
    assert "argument --block-size: invalid choice: 7 (choose from 8, 16, 32)" in _error_line(capsys)


def test_a_benchmark_stopped_by_sigterm_unwinds_as_ctrl_c_does():
    """`timeout 600 cliffguard bench gateway` or a CI job's cancel sends SIGTERM, whose default ended the process
    at once: the servers and workers a benchmark started lived on (re-parented, still listening), its temporary
    folder stayed. It unwinds as Ctrl-C does now (the benchmark's `finally` stops them), exit 130; the
    handler before it is back afterwards. (In a process of its own: the default would end pytest's.)"""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "import bench.kernels\n"
            "from gateway.cli import main\n"
            "cleaned = []\n"
            "def run(args):\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(5)\n"
            "        return 0\n"
            "    finally:\n"
            "        cleaned.append(args.bench)\n"
            "bench.kernels.run = run\n"
            "print(main(['bench', 'kernels', '--dry-run']), cleaned, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[-2:] == ["130 ['kernels'] True", ""], (result.returncode, result.stderr[-2000:])


# --- capacity ---------------------------------------------------------------------------------------
def test_capacity_command_json(capsys):
    rc = main(["capacity", "--config", str(EXAMPLE), "--json", "--model-config", str(LLAMA70B_JSON), "--vram", "80GiB"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [p["name"] for p in out["pools"]] == ["chat", "rag"]
    assert [p["max_num_seqs"] for p in out["pools"]] == [566, 141]
    assert out["devices"][0]["kv_bytes_per_token"] == 327_680 and out["devices"][0]["tensor_parallel_size"] == 8
    assert "overload" not in out                       # only with --rate


def test_capacity_command_resolves_models_and_prints_tables(capsys):
    rc = main(["capacity", "--config", str(EXAMPLE), "--vram", "80GiB"])   # the model folder beside the YAML
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("S_KV", "327,680 B/token", "max_num_seqs", "566", "141", "max-len concurrent", "fragmentation",
                 "80.00 GiB per GPU (--vram)"):
        assert text in out


def test_capacity_command_default_config(builtin_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["capacity", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["route"] for p in out["pools"]] == ["0..4096", "4097.."]


def test_capacity_of_a_cuda_device_without_cuda_needs_vram(capsys, monkeypatch):
    """The example's device says `cuda`, its memory the GPU's own (auto): on a machine without CUDA that is a
    plan for elsewhere, so it must be asked for with --vram; without it the command exits 2."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["capacity", "--config", str(EXAMPLE), "--model-config", str(LLAMA70B_JSON)]) == 2
    assert "devices.h100x8.device: 'cuda' but this machine has no CUDA device; pass --vram" in _error_line(capsys)
    assert main(["capacity", "--config", str(EXAMPLE), "--model-config", str(LLAMA70B_JSON), "--vram", "80GiB"]) == 0


def test_capacity_of_a_cuda_device_whose_memory_is_given_needs_no_cuda_here(capsys, monkeypatch, tmp_path):
    """`memory: 80GiB` (a Ray cluster's GPUs, as docs/SCALE.md's example; or a local device planned elsewhere) plans
    on a machine without CUDA, as serve runs it: the size is the file's, not this machine's."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    data = yaml.safe_load(EXAMPLE.read_text())
    for extra in ({}, {"placement": "ray", "ray_address": "127.0.0.1:6379"}):
        data["devices"]["h100x8"] |= {"memory": "80GiB", **extra}
        (path := tmp_path / "pools.yaml").write_text(yaml.safe_dump(data))
        capsys.readouterr()
        assert main(["capacity", "--config", str(path), "--model-config", str(LLAMA70B_JSON)]) == 0, capsys.readouterr()
        assert "80.00 GiB per GPU (config)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--config", "nope.yaml"], "nope.yaml: no such configuration file"),
    (["--config", str(EXAMPLE), "--vram", "lots"], "--vram: not a byte size"),
    (["--config", str(EXAMPLE), "--vram", "1GiB"], "devices.h100x8.memory"),
    (["--config", str(EXAMPLE), "--model-config", "/nonexistent/config.json", "--vram", "80GiB"], "--model-config"),
    (["--config", str(EXAMPLE), "--vram", "1" + "0" * 400 + "TiB"], "argument --vram: must be at most"),
    (["--config", str(EXAMPLE), "--vram", "0.5"], "argument --vram: must be at least 1 byte, got '0.5'"),
    (["--config", str(EXAMPLE), "--vram", "80GiB", "--rate", "inf"], "argument --rate: must be a finite number > 0"),
    (["--config", str(EXAMPLE), "--vram", "80GiB", "--rate", "nan"], "argument --rate: must be a finite number > 0"),
    (["--config", str(EXAMPLE), "--vram", "80GiB", "--rate", "1", "--step-model", "."], "--step-model: cannot read ."),
    (["--config", str(FP8_EXAMPLE), "--vram", "80GiB", "--rate", "1", "--device", "a100"], "--device a100: devices."
     "h100x2.kv_cache_dtype is fp8, which needs a GPU of compute capability 8.9 or newer"),
])
def test_capacity_command_errors(argv, message, capsys):
    assert main(["capacity", *argv]) == 2
    assert message in _error_line(capsys)


def test_fp8_weights_on_an_older_gpus_preset_are_refused_naming_the_key(tmp_path, capsys):
    """`quantization: fp8` needs a GPU that converts e4m3, as an FP8 cache does: --device a100 names the key."""
    data = yaml.safe_load((REPO / "config" / "examples" / "qwen3-32b-fp8-h100.yaml").read_text())
    data["devices"]["h100"].update(quantization="fp8", kv_cache_dtype="auto")
    for pool in data["pools"]:
        pool["model"] = str(REPO / "config" / "examples" / "qwen3-32b-fp8")
    (path := tmp_path / "fp8.yaml").write_text(yaml.safe_dump(data))
    assert main(["simulate", "--config", str(path), "--device", "a100"]) == 2
    assert ("--device a100: devices.h100.quantization is fp8, which needs a GPU of compute capability 8.9 or newer "
            "(a100: 8.0); use another preset, or quantization: auto") in _error_line(capsys)


@pytest.mark.parametrize("argv,message", [
    (["simulate", "--duration", "inf"], "argument --duration: must be a finite number > 0, got 'inf'"),
    (["simulate", "--request-rate", "inf"], "argument --request-rate: must be a finite number > 0"),
    (["simulate", "--burstiness", "inf"], "argument --burstiness: must be a finite number >= 0.01"),
    (["simulate", "--burstiness", "1e-9"], "argument --burstiness: must be a finite number >= 0.01 (1 is Poisson"),
    (["simulate", "--config", str(FP8_EXAMPLE), "--device", "a100"], "--device a100: devices.h100x2.kv_cache_dtype "
     "is fp8, which needs a GPU of compute capability 8.9 or newer (a100: 8.0)"),
    (["simulate", "--seed", "-1"], "argument --seed: must be an integer in 0.."),
    (["simulate", "--sweep-rate", ""], "--sweep-rate: not a number: ''"),
    (["simulate", "--slo-itl-p99", "0.1"], "--slo-itl-p99: only with --recommend"),
    (["generate", "--prompt", "x", "--seed", "1" + "0" * 30], "argument --seed: must be a 64-bit integer"),
    (["generate", "--prompt", "x", "--kv-cache-mib", "0"], "argument --kv-cache-mib: must be an integer in 1.."),
    # the sampling options by their flags, as the others (they were named by the engine's fields: `max_tokens: ...`)
    (["generate", "--prompt", "x", "--max-tokens", "0"], "argument --max-tokens: must be an integer in 1.."),
    (["generate", "--prompt", "x", "--max-model-len", "0"], "argument --max-model-len: must be an integer in 1.."),
    (["generate", "--prompt", "x", "--temperature", "-1"], "argument --temperature: must be a number in [0, 10000]"),
    (["generate", "--prompt", "x", "--temperature", "2e4"], "argument --temperature: must be a number in [0, 10000]"),
    (["simulate", "--calibrate", "/tmp/m.json", "--vram", "80GiB"], "--vram: with --calibrate, only beside --from-trace"),
    (["generate", "--prompt", "x", "--top-p", "-0.5"], "argument --top-p: must be a number in [0, 1], got '-0.5'"),
    (["generate", "--prompt", "x", "--top-p", "nan"], "argument --top-p: must be a number in [0, 1]"),
    (["bench", "replicas", "--docs-rate", "0"], "argument --docs-rate: must be a finite number > 0"),
    (["bench", "replicas", "--replicas", "2000"], "argument --replicas: must be an integer in 1..1024"),
    (["simulate", "--replicas", "2000"], "argument --replicas: must be an integer in 1..1024"),
    (["generate", "--prompt", "x", "--seed", str(2**63)], "argument --seed: must be a 64-bit integer"),
    (["bench", "replicas", "--cpu-threads", "0"], "argument --cpu-threads: must be an integer in 1.."),
    (["bench", "replicas", "--warmup", "20", "--duration", "10"], "--warmup: must be below --duration 10"),
    (["bench", "serve", "--seed", "-1"], "argument --seed: must be an integer in 0.."),
])
def test_options_out_of_range_are_named_before_anything_runs(argv, message, capsys):
    """Each refused in one line, exit code 2, before a model loads or a server starts."""
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_a_missing_command_shows_the_usage_that_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cliffguard") and "{generate,serve,capacity,simulate,bench}" in err
    assert main(["generate", "--prompt", "x", "--seed", "-5", "--kv-cache-mib", "0"]) == 2   # a negative seed is
    assert "--kv-cache-mib" in _error_line(capsys)                                         # one (as over HTTP)


def test_model_config_errors_name_the_option_and_the_file(tmp_path, capsys):
    bad = tmp_path / "config.json"
    for content, reason in ((b"[1]", "config.json: must be a JSON object"), (b"\xff\xfe", "not UTF-8 text"),
                            (b'{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 0}',
                             "num_attention_heads: must be a positive integer, got 0")):
        bad.write_bytes(content)
        for given in (bad, tmp_path):   # the file, or its folder
            argv = ["capacity", "--config", str(EXAMPLE), "--vram", "80GiB", "--model-config", str(given)]
            assert main(argv) == 2
            line = _error_line(capsys)
            assert f"--model-config: {given}: " in line and (given is tmp_path or reason in line), line


def test_capacity_rate_says_overloaded_or_not_on_the_h100_roofline_by_default(capsys):
    argv = ["capacity", "--config", str(EXAMPLE), "--model-config", str(LLAMA70B_JSON), "--vram", "80GiB"]
    assert main(argv + ["--rate", "4"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs" in out and "overload at 4 requests/s of mixed:" in out
    assert "device h100x8: offered load 0." in out and "within capacity  [roofline h100]" in out
    assert main(argv + ["--rate", "40", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)["overload"]["h100x8"]
    assert verdict["overloaded"] and verdict["offered_load"] > 1 and verdict["replicas_needed"] >= 2
    assert verdict["pools"]["chat"]["rate"] == pytest.approx(40 * 0.8, rel=0.01)       # mixed: 80% chat
    assert verdict["pools"]["chat"]["max_num_seqs"] == 566 and verdict["pools"]["rag"]["max_num_batched_tokens"] == 8192
    assert main(argv + ["--rate", "40", "--device", "h200"]) == 0
    assert "overloaded; " in capsys.readouterr().out
    assert main(argv + ["--rate", "0"]) == 2 and "--rate: must be a finite number > 0, got '0'" in _error_line(capsys)
    assert main(argv + ["--device", "h200"]) == 2 and "--device: only with --rate" in _error_line(capsys)
    assert main(argv + ["--workload", "nosuch"]) == 2 and "--workload: only with --rate" in _error_line(capsys)


def test_capacity_rate_of_a_cpu_device_needs_a_measured_step_model(tmp_path, capsys):
    model = dict(json.loads(LLAMA70B_JSON.read_text()), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(model))
    config = tmp_path / "cpu.yaml"
    config.write_text("devices:\n  cpu: {device: cpu, memory: 2GiB}\npools:\n  - {name: chat, model: tiny, device: cpu, "
                      "kv_share: 1.0, avg_len: 512, max_model_len: 2048}\n")
    argv = ["capacity", "--config", str(config), "--model-config", str(tmp_path / "config.json"), "--rate", "2"]
    assert main(argv) == 2
    assert "--rate: device cpu is planned as a CPU, which has no roofline preset; give --step-model FILE" in (
        _error_line(capsys))
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"step_model": "linear", "a": 0.02, "b": 0.0005, "c": 0.002, "d": 0.0}))
    assert main(argv + ["--step-model", str(steps)]) == 0
    out = capsys.readouterr().out
    assert "device cpu: offered load 0.70 of 1 replica(s)' time (chat 0.70): within capacity" in out
    # mixed's rag prompts (4,200 to 7,800 tokens) fit no pool of max_model_len 2048: 20% of 2 req/s
    assert "warning: 0.40 requests/s of the workload have a prompt no pool takes, or a prompt and output past its " \
           "max_model_len (left out: refused)" in out
    endless = tmp_path / "endless.yaml"   # outputs no context holds: refused, no load (they counted 670 replicas)
    endless.write_text("classes:\n  - {name: a, prompt_len: 100, output_len: 100000, share: 1}\n")
    assert main(argv + ["--step-model", str(steps), "--workload", str(endless)]) == 0
    out = capsys.readouterr().out
    assert "device cpu: offered load 0.00 of 1 replica(s)' time (chat 0.00): within capacity" in out, out
    assert "warning: 2.00 requests/s of the workload have a prompt no pool takes, or a prompt and output" in out
    assert main(["simulate", "--config", str(config), "--model-config", str(tmp_path / "config.json"), "--step-model",
                 str(steps), "--workload", str(endless), "--request-rate", "2", "--duration", "2"]) == 0
    assert "offered load 0.00 of 1 replica(s)' time (chat 0.00): within capacity" in capsys.readouterr().out
    assert main(argv[:-1] + ["50", "--step-model", str(steps), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    verdict = out["overload"]["cpu"]
    assert verdict["overloaded"] and verdict["step_model"] == f"step model {steps}"
    assert out["unrouted_rate"] == pytest.approx(50 * 0.2)
    # `simulate` alike: it planned the CPU device with an H100's memory and timed it on the H100 roofline
    sim = ["simulate", "--config", str(config), "--model-config", str(tmp_path / "config.json"), "--duration", "2"]
    assert main(sim) == 2 and "--device: device cpu is planned as a CPU, which has no roofline preset" in (
        _error_line(capsys))
    assert main(sim + ["--step-model", str(steps)]) == 0 and "within capacity" in capsys.readouterr().out


def test_capacity_rate_names_the_rate_it_judges(tmp_path, capsys):
    """A workload whose classes all have a rate of their own: --rate moved nothing, yet the report said it judged
    that rate ("within capacity" at 1000 requests/s, of 2). Refused; a mixed one says what it offers."""
    own = tmp_path / "own.yaml"
    own.write_text("classes: [{name: a, rate: 2, prompt_len: 100, output_len: 10}]\n")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("classes: [{name: a, rate: 2, prompt_len: 100, output_len: 10}, "
                     "{name: b, share: 1, prompt_len: 100, output_len: 10}]\n")
    argv = ["capacity", "--config", str(EXAMPLE), "--vram", "80GiB", "--rate"]
    assert main(argv + ["1000", "--workload", str(own)]) == 2
    assert "--rate: every class of workload" in _error_line(capsys)
    assert main(argv + ["5", "--workload", str(mixed)]) == 0
    assert "overload at 7 requests/s of " in capsys.readouterr().out
    assert main(argv + ["24"]) == 0   # mixed's shares sum to 24.000000000000004: no class of its own rate
    assert "overload at 24 requests/s of mixed:" in capsys.readouterr().out


def test_a_binary_yaml_file_is_named(tmp_path, capsys):
    path = tmp_path / "pools.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    assert main(["capacity", "--config", str(path)]) == 2
    line = _error_line(capsys)
    assert str(path) in line and "not a UTF-8 text file" in line


def test_a_model_path_no_file_system_holds_is_one_line(tmp_path, capsys):
    """A 300-character model path was a traceback (OSError, ENAMETOOLONG): relative, looked up beside the
    file, or absolute, it is one line naming the key."""
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"pools": [{"name": "p", "model": "m" * 300, "kv_share": 1}]}))
    assert main(["capacity", "--config", str(path)]) == 2
    assert "pools[0].model: not a path this machine can open (File name too long)" in _error_line(capsys)
    path.write_text(yaml.safe_dump({"pools": [{"name": "p", "model": str(tmp_path / ("m" * 300)), "kv_share": 1}]}))
    assert main(["capacity", "--config", str(path)]) == 2
    line = _error_line(capsys)
    assert "pools[0].model: " in line and "File name too long" in line


# --- simulate ---------------------------------------------------------------------------------------
def _simulate_args(*more: str) -> list[str]:
    return ["simulate", "--config", str(EXAMPLE), "--model-config", str(LLAMA70B_JSON), *more]


def test_simulate_refuses_more_arrivals_than_one_run_may_generate(tmp_path, capsys):
    """1e12 requests/s for a minute once died in numpy after planning (a MemoryError traceback), 1e6
    never finished: rate x duration over 10 million requests is refused before anything runs."""
    assert main(_simulate_args("--request-rate", "1e12", "--duration", "60")) == 2
    assert ("--request-rate 1e+12 x --duration 60: 1e+12 requests/s for 60 s is 6e+13 requests, above the "
            "10,000,000 one run may generate; lower --request-rate or --duration") in _error_line(capsys)
    assert main(_simulate_args("--sweep-rate", "1,1e6", "--duration", "60")) == 2
    assert "--sweep-rate 1e+06 x --duration 60: " in _error_line(capsys)
    flood = tmp_path / "flood.yaml"
    flood.write_text("classes:\n  - {name: flood, prompt_len: 8, output_len: 4, rate: 1.0e+9}\n")
    assert main(_simulate_args("--workload", str(flood), "--recommend", "--slo-ttft-p99", "1")) == 2
    assert "lower --request-rate, --duration or the workload's class rates" in _error_line(capsys)


def test_simulate_refuses_to_sweep_a_workload_whose_classes_all_have_their_own_rate(tmp_path, capsys):
    """Every row had the same arrivals, labelled with the rates swept: a flat knee that was no measurement."""
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text("classes:\n  - {name: a, prompt_len: 8, output_len: 4, rate: 2}\n")
    assert main(_simulate_args("--workload", str(fixed), "--sweep-rate", "4,8", "--duration", "1")) == 2
    assert "--sweep-rate: every class of workload" in _error_line(capsys)


def test_simulate_refuses_an_out_folder_or_calibrate_file_it_cannot_write_before_running(tmp_path, capsys):
    """`--out` under a file once ran the whole sweep, then died with NotADirectoryError (a traceback)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(_simulate_args("--sweep-rate", "1", "--duration", "1", "--out", str(blocker / "knee"))) == 2
    assert f"argument --out: cannot write into '{blocker / 'knee'}': {blocker} is not a folder" in _error_line(capsys)
    for path, why in ((blocker / "step.json", f"{blocker} is not a folder"),
                      (tmp_path / "gone" / "step.json", f"{tmp_path / 'gone'} does not exist"),
                      (tmp_path, "is a folder; give a file name")):
        assert main(_simulate_args("--calibrate", str(path), "--from-trace", str(tmp_path / "none.jsonl"))) == 2
        assert "argument --calibrate: " in (line := _error_line(capsys)) and why in line


@pytest.mark.parametrize("bench", ["serve", "replicas", "isolation", "chaos", "simulate"])
def test_every_benchmark_refuses_an_out_folder_it_cannot_write_before_running(tmp_path, capsys, bench):
    """`bench serve --out` under a file once ran the whole load, then printed only the write's error (the
    report lost); each benchmark writing a folder checks it as it reads its arguments."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", bench, "--out", str(blocker / "sub")]) == 2
    assert _error_line(capsys) == (f"cliffguard bench {bench}: error: argument --out: cannot write into "
                                   f"'{blocker / 'sub'}': {blocker} is not a folder")


def test_a_write_that_fails_after_the_run_names_the_option(tmp_path, capsys, monkeypatch):
    """The folder passed the check, the disk filled while the sweep ran: one line naming --out, exit 2."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("pools.simulation.knee.plot_knee", full)
    out = tmp_path / "new" / "knee"
    assert main(_simulate_args("--sweep-rate", "1", "--duration", "1", "--out", str(out))) == 2
    assert f"cliffguard simulate: error: --out: cannot write {out} (No space left on device)" == _error_line(capsys)
    assert (out / "results.json").exists()                 # created, as a folder that did not exist is


# --- serve ------------------------------------------------------------------------------------------
def test_serve_on_a_port_in_use_exits_2_before_loading(builtin_path, capsys, monkeypatch):
    _never_loads(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", "--config", str(REPO / "config" / "pools.yaml"), "--port", str(port)])
    assert rc == 2
    assert f"--port: 127.0.0.1:{port} is already in use" in _error_line(capsys)


def test_serve_on_port_0_checks_its_host_before_loading(builtin_path, capsys, monkeypatch):
    """With --port 0 the host went unchecked: the model loaded, then an error that named no option."""
    _never_loads(monkeypatch)

    def unknown(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr("gateway.cli.socket.getaddrinfo", unknown)
    assert main(["serve", "--config", str(REPO / "config" / "pools.yaml"), "--host", "bogus.invalid",
                 "--port", "0"]) == 2
    assert "--host: cannot resolve 'bogus.invalid' (Name or service not known)" in _error_line(capsys)


def test_serve_with_a_cuda_device_on_a_machine_without_one_exits_2(tmp_path, builtin_path, capsys, monkeypatch):
    data = yaml.safe_load((REPO / "config" / "pools.yaml").read_text())
    data["devices"]["default"].update(device="cuda", memory="24GiB")
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    started = []
    monkeypatch.setattr("aiohttp.web.TCPSite.start", lambda self: started.append(self))
    assert main(["serve", "--config", str(path), "--port", "0", "--data-dir", str(tmp_path / "data")]) == 2
    assert "devices.default.device: 'cuda' needs a CUDA device" in _error_line(capsys)
    assert not started


@pytest.mark.parametrize("local", [True, False])
def test_serve_starts_the_workers_fork_server_before_it_plans_when_it_has_local_workers(tmp_path, monkeypatch, local):
    """The workers' fork server (and its imports) starts before `gateway.app.run`, which plans and starts the
    workers, so the two run side by side; a gateway whose pools are all upstream starts none."""
    import engine.client

    said = []
    monkeypatch.setattr(engine.client, "start_fork_server", lambda: said.append("fork server"))
    monkeypatch.setattr("gateway.app.run",
                        lambda config, **kwargs: said.append(f"run {[p.name for p in config.pools]}") or 0)
    path = tmp_path / "pools.yaml"
    if local:
        path.write_text((REPO / "config" / "pools.yaml").read_text())
    else:
        path.write_text("pools:\n  - {name: remote, upstream: 'http://127.0.0.1:9/v1', model: m, "
                        "tokenizer: 'builtin:smollm2-135m-instruct', max_model_len: 512}\n")
    assert main(["serve", "--config", str(path), "--port", "0", "--data-dir", str(tmp_path / "data")]) == 0
    assert said == (["fork server", "run ['chat', 'rag']"] if local else ["run ['remote']"])


def test_serve_without_keys_beyond_loopback_says_so(tmp_path, monkeypatch, caplog):
    """A gateway with no API key listening past loopback answers its whole network: a WARNING before it serves."""
    from gateway.browser_guard import loopback

    monkeypatch.setattr("gateway.app.run", lambda config, **kwargs: 0)
    path = tmp_path / "pools.yaml"
    path.write_text("pools:\n  - {name: remote, upstream: 'http://127.0.0.1:9/v1', model: m, "
                    "tokenizer: 'builtin:smollm2-135m-instruct', max_model_len: 512}\n")
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cliffguard.gateway"):
            assert main(["serve", "--config", str(path), "--host", host, "--port", "0",
                         "--data-dir", str(tmp_path / "data")]) == 0
        assert any("no API key, listening on" in r.getMessage() for r in caplog.records) == warned, host
    assert all(map(loopback, ("127.0.0.1", "::1", "[::1]", "localhost", "LocalHost.")))
    assert not any(map(loopback, ("0.0.0.0", "::", "10.0.0.1", "gpu-box")))


def test_a_store_or_a_tokenizer_that_cannot_be_read_is_one_line_before_a_socket_opens(tmp_path, tiny_model, capsys,
                                                                                      monkeypatch):
    """A damaged store file (or one another program holds) and a tokenizer.json that is a Git LFS pointer: exit 2
    with one line naming the file, never a traceback."""
    import shutil

    import engine.client

    monkeypatch.setattr(engine.client, "start_fork_server", lambda: None)
    config = tmp_path / "pools.yaml"
    config.write_text(chat_pool_yaml(tiny_model))
    data = tmp_path / "data"
    data.mkdir()
    (data / "batches.sqlite3").write_bytes(b"not a database, whatever it was" * 100)
    assert main(["serve", "--config", str(config), "--port", "0", "--data-dir", str(data)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"cliffguard serve: error: --data-dir: the store {data / 'batches.sqlite3'} cannot be "
                           "opened (file is not a database)"), line
    model = shutil.copytree(tiny_model, tmp_path / "model")
    (model / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    config.write_text(chat_pool_yaml(model))
    assert main(["serve", "--config", str(config), "--port", "0", "--data-dir", str(tmp_path / "fresh")]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"cliffguard serve: error: tokenizer.json: {model / 'tokenizer.json'} is not a tokenizer"), \
        line


def test_serve_logs_the_plans_warnings_before_it_serves(tmp_path, builtin_path, caplog, monkeypatch):
    """What `cliffguard capacity` prints under its plan (here an avg_len above max_model_len) is in the
    server's log too, at WARNING, before a socket opens."""
    data = yaml.safe_load((REPO / "config" / "pools.yaml").read_text())
    pool = data["pools"][0]
    pool["avg_len"] = pool["max_model_len"] + 1
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(data))

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr("gateway.app.create_app", stop)
    with caplog.at_level(logging.WARNING, logger="cliffguard.gateway"), pytest.raises(Stop):
        main(["serve", "--config", str(path), "--port", "0", "--data-dir", str(tmp_path / "data")])
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith(f"capacity plan: pools[0].avg_len: {pool['avg_len']} is above max_model_len")
               for m in said), said


@pytest.mark.parametrize("device, message", [
    ({"tensor_parallel_size": 2}, "devices.default.tensor_parallel_size: 2 does not divide the model's 9 attention heads"),
    ({"replicas": 0}, "devices.default.replicas: must be >= 1, got 0"),
    ({"device": "cuda", "replicas": 2, "gpus": [1, 1]}, "devices.default.gpus[1]: GPU 1 is listed twice (also gpus[0])"),
])
def test_serve_refuses_a_device_it_cannot_run_before_a_socket_opens(tmp_path, builtin_path, capsys, monkeypatch, device,
                                                                   message):
    data = yaml.safe_load((REPO / "config" / "pools.yaml").read_text())
    data["devices"]["default"].update(device)
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(data))
    started = []
    monkeypatch.setattr("aiohttp.web.TCPSite.start", lambda self: started.append(self))
    assert main(["serve", "--config", str(path), "--port", "0", "--data-dir", str(tmp_path / "data")]) == 2
    assert message in _error_line(capsys)
    assert not started


# --- help -------------------------------------------------------------------------------------------
def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("cliffguard",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub, None
                yield from _walk(sub, path + (name,))
        else:
            yield path, parser, action


def test_every_command_has_a_description_and_every_option_a_help_text():
    missing = []
    for path, parser, action in _walk(build_parser()):
        if action is None and not parser.description:
            missing.append(" ".join(path) + ": no description")
        elif action is not None and action.dest != "help" and not action.help:
            missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}: no help")
    assert missing == []


def test_serve_help_describes_the_command(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Validate the YAML, plan every pool's blocks" in out and "--vram" in out


def test_generate_on_cuda_without_cuda_says_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["generate", "--device", "cuda", "--prompt", "hi"]) == 2
    line = _error_line(capsys)
    assert "--device: 'cuda' needs CUDA device 0 and this machine has none" in line
    assert "(or cpu, auto)" in line


def test_a_gpu_index_past_the_machines_gpus_is_named_not_a_traceback(capsys, monkeypatch, tmp_path):
    """A file copied from an 8-GPU node onto a 1-GPU one: `cuda:1` is an error naming the device's key
    (torch itself asserts "Invalid device id")."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    path = tmp_path / "pools.yaml"
    path.write_text("devices:\n  g: {device: 'cuda:1'}\npools:\n  - {name: chat, device: g, kv_share: 1.0, "
                    "model: 'builtin:smollm2-135m-instruct'}\n")
    assert main(["capacity", "--config", str(path)]) == 2
    assert "devices.g.device: 'cuda:1' needs CUDA device 1 and this machine has 1 GPU(s)" in _error_line(capsys)
    path.write_text("devices:\n  g: {device: cuda, gpus: [0, 3], replicas: 2}\npools:\n  - {name: chat, device: g, "
                    "kv_share: 1.0, model: 'builtin:smollm2-135m-instruct'}\n")
    assert main(["capacity", "--config", str(path)]) == 2
    assert "devices.g.gpus: [0, 3] needs CUDA device 3 and this machine has 1 GPU(s)" in _error_line(capsys)
