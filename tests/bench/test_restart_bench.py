"""`cliffguard bench restart`: both start methods time a worker to ready, with the load's phases."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main
from tests.gateway.conftest import pools_yaml, tiny_model  # noqa: F401 - tiny_model: a fixture


def test_bench_restart_times_forked_and_spawned_workers(tmp_path, tiny_model, capsys):  # noqa: F811
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model))
    assert main(["bench", "restart", "--config", str(path), "--runs", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["runs"] == 1
    for method in ("forkserver", "spawn"):
        side = report[method]
        assert 0 < side["load_s"] < side["ready_s"] == side["max_s"]
        assert list(side["load_phases_s"]) == ["weights", "kv", "kernels", "schedulers", "warm-up", "slo"]
    assert report["spawn_over_forkserver"] == pytest.approx(report["spawn"]["ready_s"] / report["forkserver"]["ready_s"])


def test_bench_restart_names_a_bad_option(tmp_path, tiny_model, capsys):  # noqa: F811
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model))
    assert main(["bench", "restart", "--config", str(path), "--runs", "0"]) == 2
    assert main(["bench", "restart", "--config", str(path), "--device", "gpu9"]) == 2
    err = capsys.readouterr().err
    assert "--runs: must be >= 1" in err and "--device: 'gpu9' is not a local device" in err
    path.write_text("pools:\n  - {name: remote, upstream: 'http://127.0.0.1:9/v1', model: m, "
                    "tokenizer: 'builtin:smollm2-135m-instruct'}\n")
    assert main(["bench", "restart", "--config", str(path)]) == 2   # a StopIteration's traceback, exit 1
    assert "no local device to restart" in capsys.readouterr().err


def test_bench_restart_gateway_times_a_cold_start_to_serving_and_ready(tmp_path, tiny_model, capsys):  # noqa: F811
    path = tmp_path / "pools.yaml"
    path.write_text(pools_yaml(tiny_model))
    assert main(["bench", "restart", "--gateway", "--config", str(path), "--runs", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runs"] == 1 and 0 < report["serving_s"] < report["ready_s"] == report["max_s"] < 120
    assert main(["bench", "restart", "--gateway", "--config", str(path), "--device", "cpu"]) == 2
    assert "--device: a gateway's cold start starts every device" in capsys.readouterr().err
