"""`bench.speedprobe`: the probe process writes timed samples; the ratios over a reference span;
`bench simulate`'s per-run machine speed from a probe file and step traces."""

from __future__ import annotations

import json
import time

import pytest

from bench.speedprobe import SpeedProbe, kernel_median, read_probe, speed_ratio


def test_the_probe_process_times_its_kernel_until_stopped(tmp_path):
    path = tmp_path / "probe.txt"
    with SpeedProbe(path) as probe:
        deadline = time.monotonic() + 60
        while len(read_probe(path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert probe.proc.returncode is not None                           # stopped with the block
    samples = read_probe(path)
    assert len(samples) >= 3
    times = [t for t, _ in samples]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60
    assert all(0 < seconds < 1 for _, seconds in samples)


def test_a_cut_line_and_a_missing_file_are_no_samples(tmp_path):
    assert read_probe(tmp_path / "absent.txt") == []
    path = tmp_path / "probe.txt"
    path.write_text("100.0 0.001\n100.25 0.002\n100.5")
    assert read_probe(path) == [(100.0, 0.001), (100.25, 0.002)]


def test_ratio_is_the_median_over_the_reference_with_window_extremes():
    samples = [(float(t), 0.001) for t in range(0, 30)] + [(float(t), 0.002) for t in range(30, 60)]
    assert kernel_median(samples, 0, 29) == pytest.approx(0.001)
    assert kernel_median(samples, 100, 200) is None
    ratio = speed_ratio(samples, 0, 59, reference=0.001, window=15)
    assert ratio["min"] == pytest.approx(1.0) and ratio["max"] == pytest.approx(2.0)
    assert 1.0 <= ratio["median"] <= 2.0
    assert speed_ratio(samples, 100, 200, reference=0.001) is None


def _trace(path, start: float, end: float) -> None:
    path.write_text("".join(json.dumps({"t": t, "cycle_seconds": 0.1, "num_prefill_tokens": 0,
                                        "num_decode_tokens": 1, "num_attended": 10}) + "\n"
                            for t in (start, (start + end) / 2, end)))


def test_bench_simulate_reports_each_runs_speed_against_the_calibration_run(tmp_path):
    from bench.simulate import machine_speeds

    probe = tmp_path / "probe.txt"
    probe.write_text("".join(f"{t} {0.001 if t < 100 else 0.0013}\n" for t in range(0, 200)))
    _trace(tmp_path / "calibration.jsonl", 10, 60)
    _trace(tmp_path / "run.jsonl", 120, 180)
    _trace(tmp_path / "unprobed.jsonl", 300, 360)
    calibration, run, unprobed = machine_speeds(probe, [tmp_path / "calibration.jsonl", tmp_path / "run.jsonl",
                                                        tmp_path / "unprobed.jsonl"])
    assert calibration["median"] == pytest.approx(1.0)
    assert run["median"] == pytest.approx(1.3) and run["max"] == pytest.approx(1.3)
    assert unprobed is None
