"""`cliffguard bench simulate`: its comparison arithmetic, checked on a "real" run that is itself a
simulation with a known step model (so every prediction must come out exact), and its table."""

from __future__ import annotations

import dataclasses
import types

import pytest

from bench.load.sender import RequestRecord
from bench.simulate import POOLS_YAML, compare, format_rows, saturation
from engine.step_cost import LinearStepTime
from pools.capacity_plan import plan_capacity
from pools.config.yaml_file import load_config
from pools.simulation.devicesim import SimRequest
from pools.simulation.runner import make_requests, simulate
from pools.workload import MIN_P99_SAMPLES, load_workload


@pytest.fixture(scope="module")
def planned(builtin_path):
    from engine.model_config import ModelConfig

    config = load_config(POOLS_YAML, env={})
    models = {config.pools[0].model: ModelConfig.from_folder(builtin_path)}
    return config, models, plan_capacity(config, models)


def _records_of(requests: list[SimRequest]) -> list[RequestRecord]:
    """What `bench serve` would have recorded had the simulated run been real."""
    records = []
    for i, r in enumerate(requests):
        record = RequestRecord(i, r.cls, "chat", r.arrival, r.prompt_len, r.output_len, sent_s=r.arrival + 2.0,
                               end_s=r.token_times[-1] + 2.0, status="ok", error=None, prompt_tokens=r.prompt_len,
                               output_tokens=r.output_len)
        record.chunk_s = [t - r.arrival for t in r.token_times]
        record.chunk_tokens = [1] * len(r.token_times)
        records.append(record)
    return records


def test_compare_is_exact_when_the_real_run_follows_the_model(planned):
    config, models, plan = planned
    step = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001)
    requests = make_requests(load_workload("chat"), 0.5, duration=30.0, seed=3)
    simulate(config, plan, models, requests, {"cpu": step}, seed=3)
    assert all(r.finished for r in requests)
    report = types.SimpleNamespace(records=_records_of(requests))
    result = compare(report, config, plan, models, step, seed=3)
    assert result["requests"] == len(requests) and result["unfinished_real"] == 0
    chat = result["classes"]["chat"]
    for key in ("throughput", "ttft_p50", "ttft_p99"):
        assert chat["error"][key] == pytest.approx(0, abs=1e-9)
    assert chat["within_goals"] and not chat["p99_judged"] and chat["n"] < 100   # 15 requests: a p99 of 15
    table = format_rows([{"rate": 0.5, "load": 0.4, **result}])
    assert "met" in table and "MISSED" not in table and f"(p99 of {chat['n']} requests: not judged)" in table


def test_a_run_that_completed_nothing_is_a_row_of_nothing_not_a_crash(planned):
    """Its `min()` over no request raised after every run was over, before any result was written."""
    config, models, plan = planned
    step = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001)
    lost = types.SimpleNamespace(status="error", prompt_tokens=0, output_tokens=0)
    result = compare(types.SimpleNamespace(records=[lost, lost]), config, plan, models, step, seed=3)
    assert result == {"requests": 0, "unfinished_real": 2, "classes": {}}
    assert format_rows([{"rate": 0.5, "load": 0.4, **result}]).count("\n") == 0   # the header alone
    from bench.simulate import compare_runs, format_report

    calibration = trace(step, 0)   # traced runs: the empty one has no steps to read or fit
    [row] = compare_runs([types.SimpleNamespace(records=[lost])], [0.5], 1.0, (config, plan, models), None,
                         [calibration, []], seed=3)
    assert (row["requests"], row["step_cost_ratio"], row["own_steps"]) == (0, None, None)
    assert "0.50 req/s no steps" in format_report([{**row, "machine_speed": None}])


def test_a_class_with_unanswered_requests_has_its_p99_not_judged(planned):
    """The real run's unanswered requests are its slowest: a p99 of the answered ones alone is a lower bound,
    judged "met" beside a prediction of the same censored set, the unanswered unsaid."""
    config, models, plan = planned
    step = LinearStepTime(a=0.002, b=0.00004, c=0.0003, d=0.00001)   # fast enough to serve 4 req/s
    requests = make_requests(load_workload("chat"), 4.0, duration=30.0, seed=3)
    simulate(config, plan, models, requests, {"cpu": step}, seed=3)
    assert all(r.finished for r in requests)
    records = _records_of(requests)
    assert len(records) >= MIN_P99_SAMPLES + 2
    whole = compare(types.SimpleNamespace(records=records), config, plan, models, step, seed=3)
    assert whole["classes"]["chat"]["p99_judged"] and whole["classes"]["chat"]["unanswered"] == 0
    records[-1].status, records[-2].status = "timeout", "error"
    result = compare(types.SimpleNamespace(records=records), config, plan, models, step, seed=3)
    chat = result["classes"]["chat"]
    assert (chat["unanswered"], chat["p99_judged"], result["unfinished_real"]) == (2, False, 2)
    table = format_rows([{"rate": 4.0, "load": 0.4, **result}])
    assert "(2 unanswered in the real run, not replayed)" in table and "not judged" in table


def test_an_empty_step_trace_has_no_span(tmp_path):
    from bench.simulate import machine_speeds, trace_span

    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "probe.txt").write_text("")
    assert trace_span(tmp_path / "empty.jsonl") is None
    assert machine_speeds(tmp_path / "probe.txt", [tmp_path / "empty.jsonl"] * 2) == [None, None]


def test_a_replay_and_the_saturation_probe_refuse_none_of_their_requests(planned):
    """A pool that refuses what does not fit at once (max_queue_seconds 0): the requests its real run served
    are replayed, every one of them, and the capacity probe counts what the pool completes, not refusals."""
    config, models, plan = planned
    tight = dataclasses.replace(config, pools=tuple(p.replace(max_queue_seconds=0.0) for p in config.pools))
    tight_plan = plan_capacity(tight, models)
    step = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001)
    requests = make_requests(load_workload("chat"), 20.0, duration=5.0, seed=3)   # far past what it serves
    simulate(tight, tight_plan, models, requests, {"cpu": step}, seed=3, max_queue=False)
    result = compare(types.SimpleNamespace(records=_records_of(requests)), tight, tight_plan, models, step, seed=3)
    assert result["classes"]["chat"]["error"]["throughput"] == pytest.approx(0, abs=1e-9)
    classes = load_workload("chat")
    assert saturation(tight, tight_plan, models, classes, step, seed=0) == \
        pytest.approx(saturation(config, plan, models, classes, step, seed=0))


def test_a_slower_real_run_misses_the_goals(planned):
    config, models, plan = planned
    step = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001)
    requests = make_requests(load_workload("chat"), 0.5, duration=30.0, seed=4)
    simulate(config, plan, models, requests, {"cpu": LinearStepTime(a=0.04, b=0.0008, c=0.006, d=0.0002)}, seed=4)
    report = types.SimpleNamespace(records=_records_of(requests))
    result = compare(report, config, plan, models, step, seed=4)
    chat = result["classes"]["chat"]
    assert chat["error"]["ttft_p50"] < -0.3 and not chat["within_goals"]


def test_saturation_grows_with_a_faster_step(planned):
    config, models, plan = planned
    classes = load_workload("chat")
    slow = saturation(config, plan, models, classes, LinearStepTime(a=0.04, b=0.0008, c=0.006, d=0.0), seed=0)
    fast = saturation(config, plan, models, classes, LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0), seed=0)
    assert fast == pytest.approx(2 * slow, rel=0.05)


def trace(model: LinearStepTime, seed: int) -> list:
    """A traced run's steps whose seconds are exactly what `model` says."""
    from engine.step_cost import StepFeatures

    steps = [StepFeatures(p, d, p * p // 2 + d * 300) for p in (0, 64, 256, 512) for d in range(1 + seed, 12)]
    return [(f, model.seconds([], f, 0)) for f in steps if f.num_prefill_tokens + f.num_decode_tokens]


def test_each_run_is_predicted_by_a_model_fitted_to_the_other_runs():
    from bench.simulate import held_out_model

    served, odd = LinearStepTime(a=0.05, b=0.003, c=0.01, d=0.0015), LinearStepTime(a=0.5, b=0.03, c=0.1, d=0.015)
    traces = [trace(served, 0), trace(odd, 1), trace(served, 2)]    # calibration run, compared runs 0 and 1
    fitted = held_out_model(traces, 0)                               # run 0's own (odd) steps are left out
    for name in ("a", "b", "c", "d"):
        assert getattr(fitted, name) == pytest.approx(getattr(served, name), rel=1e-6)
    assert held_out_model(traces, 1).c > 2 * served.c                # run 1's model has run 0's slow steps in it


def test_a_run_is_also_replayed_with_its_own_steps_in_sample(planned):
    from bench.simulate import compare_runs

    config, models, plan = planned
    real, calibration = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001), LinearStepTime(0.03, 0.0006, 0.0045, 0)
    requests = make_requests(load_workload("chat"), 0.5, duration=30.0, seed=5)
    simulate(config, plan, models, requests, {"cpu": real}, seed=5)
    report = types.SimpleNamespace(records=_records_of(requests))
    [row] = compare_runs([report], [0.5], 1.0, (config, plan, models), None, [trace(calibration, 0), trace(real, 1)],
                         seed=5)
    assert row["step_model"]["c"] == pytest.approx(calibration.c)        # predicted from the calibration run
    assert row["step_cost_ratio"] == pytest.approx(2 / 3, rel=0.05)       # the real steps cost 2/3 of the model's
    assert row["classes"]["chat"]["error"]["ttft_p50"] > 0.2                # 50% slower steps: a late prediction
    own = row["own_steps"]["classes"]["chat"]
    assert row["own_steps"]["step_model"]["c"] == pytest.approx(real.c)
    for key in ("throughput", "ttft_p50", "ttft_p99"):
        assert own["error"][key] == pytest.approx(0, abs=1e-6)


def test_an_out_folder_that_cannot_be_written_is_named(tmp_path, capsys):
    from gateway.cli import main

    taken = tmp_path / "a-file"
    taken.write_text("")
    assert main(["bench", "simulate", "--out", str(taken / "sub")]) == 2
    assert f"argument --out: cannot write into {str(taken / 'sub')!r}: {taken} is not a folder" in capsys.readouterr().err


def test_a_kept_run_is_compared_again_by_replay(planned, tmp_path, capsys):
    """`--out` keeps what `--replay` needs: the same rows come back from the folder alone."""
    import json

    from bench.simulate import compare_runs, write_records
    from gateway.cli import main

    config, models, plan = planned
    real = LinearStepTime(a=0.02, b=0.0004, c=0.003, d=0.0001)
    requests = make_requests(load_workload("chat"), 0.5, duration=20.0, seed=6)
    simulate(config, plan, models, requests, {"cpu": real}, seed=0)
    records = _records_of(requests)
    traces = [trace(real, 0), trace(real, 1)]
    for name, steps in zip(("calibration-steps", "steps-0"), traces):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"t": 1000.0 + n, "cycle_seconds": seconds, "num_prefill_tokens": f.num_prefill_tokens,
                        "num_decode_tokens": f.num_decode_tokens, "num_attended": f.num_attended}) + "\n"
            for n, (f, seconds) in enumerate([traces[0][0]] * 2 + steps)))      # 2 warm-up steps are skipped
    write_records(tmp_path / "requests-0.jsonl", records)
    (tmp_path / "results.json").write_text(json.dumps({"calibration": {"served": {}}, "saturation_rps": 1.0,
                                                       "rows": [{"rate": 0.5}]}))
    assert main(["bench", "simulate", "--replay", str(tmp_path), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    [expected] = compare_runs([types.SimpleNamespace(records=records)], [0.5], 1.0, (config, plan, models), None,
                              traces, seed=0)
    assert row["classes"] == json.loads(json.dumps(expected["classes"]))
    assert row["classes"]["chat"]["error"]["ttft_p50"] == pytest.approx(0, abs=1e-6)
    assert row["step_cost_ratio"] == pytest.approx(1.0) and row["machine_speed"] is None   # no probe kept


def test_replay_of_a_folder_without_results_names_the_file(tmp_path, capsys):
    from gateway.cli import main

    assert main(["bench", "simulate", "--replay", str(tmp_path)]) == 2
    assert f"--replay: {tmp_path / 'results.json'}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--rates", "0"], "--rates: must be a finite number > 0"), (["--loads", "0.5,abc"], "--loads: not a number"),
    (["--loads", "0.5,0.5"], "--loads: expected distinct numbers"), (["--rates", "inf"], "--rates: must be a finite"),
    (["--calibration-load", "nan"], "--calibration-load: must be a finite number > 0"),
    (["--replay", "kept", "--out", "again"], "--out: not with --replay")])
def test_options_that_would_fail_after_the_calibration_are_refused_first(tmp_path, capsys, monkeypatch, argv, said):
    from gateway.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "simulate", *argv]) == 2   # before any engine loads: a second at most
    assert said in capsys.readouterr().err
