"""`cliffguard generate` end to end: spawns the device worker and streams a completion."""

from gateway.cli import main


def test_generate_prints_a_chat_completion(builtin_path, capsys):
    rc = main(["generate", "--model", str(builtin_path), "--chat", "--kv-cache-mib", "64", "--max-tokens", "12",
               "--prompt", "What is the capital of France?"])
    out = capsys.readouterr().out
    assert rc == 0 and "Paris" in out


def test_generate_reports_a_bad_model_clearly(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert rc == 2 and "nope" in capsys.readouterr().err


def test_bench_engine_rejects_bad_batch_sizes_before_loading(capsys):
    rc = main(["bench", "engine", "--hf-batch-sizes", "16,x", "--model", "/nonexistent"])
    assert rc == 2 and "--hf-batch-sizes" in capsys.readouterr().err
