"""`cliffguard bench simulate`: the simulator's predictions against real runs on this machine.

1. Calibrate: the real engine of the pool file's device runs `engine.step_cost.measure_steps` in
   this process and the linear step model is fitted to them (or `--step-model FILE`, from
   `cliffguard simulate --calibrate FILE`). With `--calibration served` (the default) that model only
   picks the load of a calibration run: `cliffguard serve` with `CLIFFGUARD_STEP_TRACE` set, driven
   at `--calibration-load` x its predicted saturation for `--calibration-duration` s (arrivals from
   another seed than the runs compared), and the step model is refitted to the worker's traced turns
   (`engine.step_cost.read_step_trace`). The default load, 1.3, overloads the pool on purpose: the
   traced steps then reach full batches, the regime that decides the saturation the rates are picked
   from (at 1.0 the queue hardly builds in 60 s, the fit extrapolates to full batches, and in session
   8 it put the knee 15% low, so the "1.3x" run was barely past the real knee). A step measured on
   the engine alone misses what serving costs the same cores: the gateway's HTTP, tokenizing and SSE
   chunks, the load generator, the worker's pipe; a step traced while serving includes them.
2. Pick the rates: below, near and above the knee, as fractions (`--loads`, default 0.5, 0.9, 1.3)
   of the saturation throughput the simulator predicts for the workload (or `--rates` given).
3. At each rate: start `cliffguard serve` on the pool file (its worker traced too with `served`),
   drive it with `bench serve`'s open-loop load (streaming, `ignore_eos`), keep every request's send
   time and exact prompt and output token counts (from `usage`); then simulate exactly those requests
   (same send times and lengths) with the same capacity plan and a measured step model. With
   `served`, run i's step model is fitted to the traced steps of every other run (the calibration
   run and the other rates; `held_out_model`): never to the run it predicts, and always to loads
   below and above it, which also averages out the drift of a shared machine's speed between runs.
   Otherwise every rate uses the one model of step 1.
4. Per class and rate: measured vs predicted output tokens/s (from the first send to the last answer),
   p50 TTFT and p99 TTFT, with the relative error against the goals (10%, 10%, 20%); the real run's
   unanswered requests are not replayed, and a class with any has its p99 not judged (nor one of fewer
   than 100 requests: a lower bound on the tail). With `served`,
   a second table (`own_steps` in JSON) replays each run with the model fitted to its own trace:
   in-sample, so not a prediction, but it separates the simulator's scheduling from the step model.
5. Diagnostics after the fact, inputs to nothing: each run's `step_cost_ratio` (its traced steps' real
   seconds over what its step model says: the transfer error, which past saturation is amplified
   about rho / (rho - 1) times into p99 TTFT), and `machine_speed`, from a speed probe running through
   the whole benchmark (`bench.speedprobe`): its kernel time during each run over the calibration
   run's, median and 15 s window extremes, so a miss can be told apart as the machine's drift.

Why the served steps: given the step costs the run itself had (its own trace), the simulation
reproduces a real run within a few percent even past saturation, so what is left of the error is the
step model's transfer from one run to another (docs/PERF.md, "Simulator vs real runs").

The machine should be otherwise idle: the calibration and the real runs are timed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.live import LiveServer
from bench.options import out_dir
from bench.load.plan import LoadConfig, plan_requests
from bench.load.run import run_load
from bench.speedprobe import SpeedProbe
from pools.cli_types import output_folder, positive_float, positive_floats, seed as seed_arg
from pools.workload import MIN_P99_SAMPLES, latency_stats, load_workload

GOALS = {"throughput": 0.10, "ttft_p50": 0.10, "ttft_p99": 0.20}
POOLS_YAML = """\
devices:
  cpu: {device: cpu, memory: 2GiB, dtype: float32}
pools:
  - name: chat
    model: builtin:smollm2-135m-instruct
    device: cpu
    kv_cache_bytes: 256MiB
    avg_len: 512
    max_model_len: 2048
    max_num_batched_tokens: 512
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="pools YAML (default: one CPU chat pool of the builtin model, "
                   "256 MiB of KV, 512-token steps)")
    p.add_argument("--workload", default="chat", help="workload classes (default chat)")
    p.add_argument("--rates", type=positive_floats, default=None, help="request rates to run, comma-separated "
                   "(default: --loads x the predicted saturation throughput)")
    p.add_argument("--loads", type=positive_floats, default="0.5,0.9,1.3", help="fractions of the predicted "
                   "saturation (default 0.5,0.9,1.3: below, near and above the knee)")
    p.add_argument("--duration", type=positive_float, default=60.0, help="seconds of arrivals per rate (default 60)")
    p.add_argument("--step-model", default=None, help="a calibration file instead of calibrating here")
    p.add_argument("--calibration", choices=("served", "engine"), default="served",
                   help="fit the step model to a traced serving run (served, default) or to the engine alone")
    p.add_argument("--calibration-load", type=positive_float, default=1.3,
                   help="load of the served calibration run, as a multiple of the saturation the engine-alone "
                        "model predicts (default 1.3: past it, so the traced steps reach full batches)")
    p.add_argument("--calibration-duration", type=positive_float, default=60.0,
                   help="seconds of arrivals of the served calibration run (default 60)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the calibration, arrivals and lengths (default 0)")
    p.add_argument("--out", type=output_folder, default=None,
                   help="keep the served runs' step traces and the results (results.json) "
                   "in this folder, to study the step model offline")
    p.add_argument("--replay", default=None, help="compare again from a folder --out wrote (its traces and "
                   "requests, on the pool file it names unless --config), without running anything")
    p.add_argument("--json", action="store_true", help="print calibration, saturation and rows as JSON")


def _plan(config_path: Path):
    from pools.capacity_plan import plan_capacity
    from pools.model_configs import resolve_model_configs
    from pools.config.yaml_file import load_config

    config = load_config(config_path)
    model_configs = resolve_model_configs(config)
    return config, model_configs, plan_capacity(config, model_configs)


def saturation(config, plan, model_configs, classes, step_model, seed: int) -> float:
    """Requests/s the simulated pool completes when arrivals far outrun it."""
    from pools.simulation.runner import make_requests, simulate

    probe_rate, duration = 200.0, 1.0                # 200 requests at once: the pool never idles
    requests = make_requests(classes, probe_rate, duration=duration, seed=seed)
    result = simulate(config, plan, model_configs, requests, {d: step_model for d in plan.devices}, seed=seed,
                      max_queue=False)   # a capacity probe: nothing refused
    done = [r for r in result.requests if r.finished]
    return len(done) / result.simulated_seconds


async def _measure(config_path: Path, classes, rate: float, duration: float, seed: int, data_dir: Path,
                   trace: Path | None = None):
    """One real run: `cliffguard serve` on the pool file under `bench serve`'s open-loop load; with
    `trace`, the device worker writes its step trace there."""
    load = LoadConfig(url="http://127.0.0.1:1", classes=classes, request_rate=rate, duration=duration, seed=seed,
                      timeout=600.0, drain_timeout=600.0, scrape=False)
    plan = await asyncio.to_thread(plan_requests, load)
    env = None
    if trace is not None:
        trace.unlink(missing_ok=True)      # the worker appends: a trace left in --out by an earlier run must go
        env = dict(os.environ, CLIFFGUARD_STEP_TRACE=str(trace))
    with LiveServer(config_path, env=env, args=["--data-dir", str(data_dir)]) as server:
        load = LoadConfig(url=server.url, classes=classes, request_rate=rate, duration=duration, seed=seed,
                          timeout=600.0, drain_timeout=600.0, scrape=False)
        return await run_load(load, plan)


def compare(report, config, plan, model_configs, step_model, seed: int) -> dict[str, Any]:
    """Simulate the requests of one real run and put both side by side, per class."""
    from pools.simulation.devicesim import SimRequest
    from pools.simulation.runner import simulate

    done = [r for r in report.records if r.status == "ok" and r.prompt_tokens and r.output_tokens]
    if not done:   # nothing to replay: the row says so, the other runs' results are still written
        return {"requests": 0, "unfinished_real": len(report.records), "classes": {}}
    first, replayed = min(r.sent_s for r in done), {id(r) for r in done}
    requests = [SimRequest(f"r{r.index}", r.class_name, r.sent_s - first, r.prompt_tokens, r.output_tokens)
                for r in done]
    result = simulate(config, plan, model_configs, requests, {d: step_model for d in plan.devices}, seed=seed,
                      max_queue=False)   # the requests the real run served, each of them
    real_end = max(r.end_s for r in done) - first
    sim_end = max(r.token_times[-1] for r in result.requests if r.finished)
    classes: dict[str, Any] = {}
    for cls in dict.fromkeys(r.class_name for r in done):
        real = [r for r in done if r.class_name == cls]
        sim = [r for r in result.requests if r.cls == cls and r.finished]
        served = [r.ttft - r.send_lag for r in real]   # from its send: the simulated request arrives then
        measured = {"throughput": sum(r.output_tokens for r in real) / real_end,
                    "ttft_p50": latency_stats(served)["p50"], "ttft_p99": latency_stats(served)["p99"]}
        predicted = {"throughput": sum(r.output_len for r in sim) / sim_end,
                     "ttft_p50": latency_stats([r.ttft for r in sim])["p50"],
                     "ttft_p99": latency_stats([r.ttft for r in sim])["p99"]}
        errors = {k: predicted[k] / measured[k] - 1 for k in measured}
        # A p99 of fewer than MIN_P99_SAMPLES is a lower bound on the tail, and so is one that leaves out the
        # class's unanswered requests (the slowest, or lost): its goal is not judged.
        unanswered = sum(1 for r in report.records if getattr(r, "class_name", None) == cls and id(r) not in replayed)
        judged = [k for k in GOALS if k != "ttft_p99" or (len(served) >= MIN_P99_SAMPLES and not unanswered)]
        classes[cls] = {"measured": measured, "predicted": predicted, "error": errors, "n": len(served),
                        "unanswered": unanswered, "p99_judged": "ttft_p99" in judged,
                        "within_goals": all(abs(errors[k]) <= GOALS[k] for k in judged)}
    return {"requests": len(done), "unfinished_real": len(report.records) - len(done), "classes": classes}


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rate':>6}  {'class':<8}{'tok/s real':>11}{'sim':>8}{'err':>7}{'TTFT p50 real':>15}{'sim':>8}"
             f"{'err':>7}{'TTFT p99 real':>15}{'sim':>8}{'err':>7}  goals"]
    for row in rows:
        for cls, c in row["classes"].items():
            m, p, e = c["measured"], c["predicted"], c["error"]
            lines.append(f"{row['rate']:>6.2f}  {cls:<8}{m['throughput']:>11.1f}{p['throughput']:>8.1f}"
                         f"{e['throughput']:>+7.0%}{m['ttft_p50'] * 1e3:>13.0f}ms{p['ttft_p50'] * 1e3:>6.0f}ms"
                         f"{e['ttft_p50']:>+7.0%}{m['ttft_p99'] * 1e3:>13.0f}ms{p['ttft_p99'] * 1e3:>6.0f}ms"
                         f"{e['ttft_p99']:>+7.0%}  {'met' if c['within_goals'] else 'MISSED'}"
                         + ("" if c["p99_judged"] else f" (p99 of {c['n']} requests: not judged)")
                         + (f" ({c['unanswered']} unanswered in the real run, not replayed)"
                            if c.get("unanswered") else ""))
    return "\n".join(lines)


def _step_model(args: argparse.Namespace, config_path: Path, setup, classes, tmp: Path, trace_dir: Path):
    """The step model that picks the rates, how it was measured (a dict for the report), and with
    `--calibration served` the calibration run's traced steps (else None; the trace is in `trace_dir`)."""
    from engine.calibration import measure_steps
    from engine.llm_engine import LLMEngine
    from engine.step_cost import fit_linear, read_step_model, read_step_trace
    from pools.capacity_plan import engine_configs

    config, plan, model_configs = setup
    if args.step_model:
        model = read_step_model(args.step_model)
        return model, {"file": args.step_model, **model.coefficients()}, None
    _, engine_config = next(iter(engine_configs(config, plan).items()))
    model, samples = measure_steps(LLMEngine(engine_config), seed=args.seed)   # the engine is freed here
    num_steps = len(samples)
    calibration: dict[str, Any] = {"engine": {"steps": num_steps, **model.coefficients()}}
    print(f"engine alone ({num_steps} steps): {model.describe()}", file=sys.stderr)
    if args.calibration == "engine":
        return model, calibration, None
    rate = args.calibration_load * saturation(config, plan, model_configs, classes, model, args.seed)
    trace = trace_dir / "calibration-steps.jsonl"
    print(f"served calibration run: {rate:.2f} req/s for {args.calibration_duration:.0f} s", file=sys.stderr)
    asyncio.run(_measure(config_path, classes, rate, args.calibration_duration, args.seed + 1000,
                         tmp / "data-calibration", trace=trace))
    samples = read_step_trace(trace)
    model = fit_linear(samples)
    calibration["served"] = {"rate": rate, "duration": args.calibration_duration, "steps": len(samples),
                             **model.coefficients()}
    print(f"served ({len(samples)} steps): {model.describe()}", file=sys.stderr)
    return model, calibration, samples


def held_out_model(traces: list[list], i: int):
    """The step model for run `i` of the compared runs: fitted to every traced run but that one (`traces[0]`
    is the calibration run, `traces[i + 1]` compared run `i`), so no prediction is fitted to the run it
    predicts, and every one is fitted to steps of loads below and above it."""
    from engine.step_cost import fit_linear

    return fit_linear([sample for j, trace in enumerate(traces) if j != i + 1 for sample in trace])


def step_cost_ratio(trace: list, model) -> float:
    """What a run's traced steps really cost over what `model` says they cost: 1.0 when the step model
    carried over exactly. A diagnostic after the fact (it reads the run's own trace), never an input
    to the prediction: past saturation a few percent here become tens of percent of p99 TTFT."""
    return sum(seconds for _, seconds in trace) / sum(model.seconds((), features, 0) for features, _ in trace)


def compare_runs(reports: list, rates: list[float], peak: float, setup, step_model, traces: list | None,
                 seed: int) -> list[dict[str, Any]]:
    """One row per run: its predictions with the held-out model (`traces`) or `step_model`, and with
    traces also `own_steps`: the same replay with a model fitted to the run's own trace. That one is
    in-sample, not a prediction: it shows what the simulator's scheduling adds once the step costs are
    right, apart from how well a step model carries from one run to another."""
    from engine.step_cost import MIN_FIT_STEPS, fit_linear

    config, plan, model_configs = setup
    rows = []
    for i, (rate, report) in enumerate(zip(rates, reports)):
        model = step_model if traces is None else held_out_model(traces, i)
        row = {"rate": rate, "load": rate / peak, "step_model": model.coefficients(),
               **compare(report, config, plan, model_configs, model, seed)}
        if traces is not None:   # a run that computed (next to) nothing has no step costs to read or fit
            fits = len(traces[i + 1]) >= MIN_FIT_STEPS
            row["step_cost_ratio"] = step_cost_ratio(traces[i + 1], model) if traces[i + 1] else None
            own = fit_linear(traces[i + 1]) if fits else None
            row["own_steps"] = None if own is None else {"step_model": own.coefficients(),
                                                         **compare(report, config, plan, model_configs, own, seed)}
        rows.append(row)
    return rows


def _run_rates(args: argparse.Namespace, config_path: Path, classes, rates: list[float], peak: float,
               tmp: Path, trace_dir: Path, traces: list | None) -> list:
    """The real runs, one per rate (each traced into `trace_dir` when `traces` collects the steps)."""
    from engine.step_cost import read_step_trace

    reports = []
    for i, rate in enumerate(rates):
        print(f"rate {rate:.2f} req/s ({rate / peak:.2f} x the predicted saturation {peak:.2f})", file=sys.stderr)
        trace = trace_dir / f"steps-{i}.jsonl" if traces is not None else None
        reports.append(asyncio.run(_measure(config_path, classes, rate, args.duration, args.seed, tmp / f"data-{i}",
                                            trace=trace)))
        if args.out:
            write_records(trace_dir / f"requests-{i}.jsonl", reports[-1].records)
        if trace is not None:
            traces.append(read_step_trace(trace))
    return reports


def write_records(path: Path, records: list) -> None:
    """A real run's request records, one JSON object a line (`--out`; read back by `--replay`)."""
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records))


def read_records(path: Path) -> SimpleNamespace:
    """A report (`.records`) as `write_records` kept it; ValueError naming the file if it is not one."""
    from bench.load.sender import RequestRecord

    try:
        return SimpleNamespace(records=[RequestRecord(**json.loads(line)) for line in path.read_text().splitlines()
                                        if line.strip()])
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--replay: {path}: not a run's request records ({exc})") from None


def kept_results(folder: Path) -> dict[str, Any]:
    """The results.json `--out` wrote in `folder`; ValueError naming the file if it is missing or not one."""
    path = folder / "results.json"
    try:
        kept = json.loads(path.read_text())
        if not all(isinstance(row.get("rate"), (int, float)) for row in kept["rows"]):
            raise ValueError("a row without a rate")
        float(kept["saturation_rps"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--replay: {path}: not the results of bench simulate --out ({exc})") from None
    return kept


def replay(args: argparse.Namespace, setup) -> dict[str, Any]:
    """`--replay DIR`: the comparison again from a folder `--out` wrote (results.json, the traces, the
    request records, the probe), without running anything: to try a step model or the simulator on
    a measured run in seconds."""
    from engine.step_cost import read_step_trace

    folder = Path(args.replay)
    kept = kept_results(folder)
    rates = [row["rate"] for row in kept["rows"]]
    paths = [folder / "calibration-steps.jsonl"] + [folder / f"steps-{i}.jsonl" for i in range(len(rates))]
    traces = [read_step_trace(path) for path in paths]
    reports = [read_records(folder / f"requests-{i}.jsonl") for i in range(len(rates))]
    rows = compare_runs(reports, rates, kept["saturation_rps"], setup, None, traces, args.seed)
    for row, speed in zip(rows, machine_speeds(folder / "speed-probe.txt", paths)[1:]):
        row["machine_speed"] = speed
    return {"config": kept.get("config"), "calibration": kept["calibration"], "saturation_rps": kept["saturation_rps"],
            "rows": rows}


def trace_span(path: Path) -> tuple[float, float] | None:
    """Unix times of the first and last step of a worker's step trace; None for a trace of no step."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return (json.loads(lines[0])["t"], json.loads(lines[-1])["t"]) if lines else None


def machine_speeds(probe_path: Path, trace_paths: list[Path]) -> list[dict[str, float] | None]:
    """The speed probe's kernel time during each traced run over its median during the first (the
    calibration run): the machine's own drift, apart from the step model (`bench.speedprobe`)."""
    from bench.speedprobe import kernel_median, read_probe, speed_ratio

    samples = read_probe(probe_path)
    spans = [trace_span(path) for path in trace_paths]
    reference = None if spans[0] is None else kernel_median(samples, *spans[0])
    if reference is None:
        return [None] * len(spans)
    return [None if span is None else speed_ratio(samples, *span, reference) for span in spans]


def format_report(rows: list[dict[str, Any]]) -> str:
    """The table, and for traced runs the diagnostics and the in-sample replay."""
    text = format_rows(rows)
    if rows and "own_steps" in rows[0]:
        text += "\nreal step costs over the step model's: " + ", ".join(
            f"{row['rate']:.2f} req/s " + ("no steps" if row["step_cost_ratio"] is None else
                                           f"{row['step_cost_ratio']:.3f}") for row in rows)
        text += "\nspeed probe's kernel time over the calibration run's, median (15 s windows): " + ", ".join(
            f"{row['rate']:.2f} req/s {_speed(row.get('machine_speed'))}" for row in rows)
        text += ("\n\nreplayed with each run's own traced steps (in-sample: the scheduling alone, not a prediction)\n"
                 + format_rows([{"rate": row["rate"], **row["own_steps"]} for row in rows if row["own_steps"]]))
    return text


def _speed(speed: dict[str, float] | None) -> str:
    return "no samples" if speed is None else f"{speed['median']:.3f} ({speed['min']:.3f}-{speed['max']:.3f})"


def _bench(args: argparse.Namespace, config_path: Path, setup, classes, tmp: Path, trace_dir: Path) -> dict[str, Any]:
    """Calibrate, run the rates for real under the speed probe, and compare: the result `--out` keeps."""
    config, plan, model_configs = setup
    probe_path = trace_dir / "speed-probe.txt"
    probe_path.unlink(missing_ok=True)
    with SpeedProbe(probe_path):
        step_model, calibration, samples = _step_model(args, config_path, setup, classes, tmp, trace_dir)
        peak = saturation(config, plan, model_configs, classes, step_model, args.seed)
        rates = args.rates or [f * peak for f in args.loads]
        traces = None if samples is None else [samples]
        reports = _run_rates(args, config_path, classes, rates, peak, tmp, trace_dir, traces)
    rows = compare_runs(reports, rates, peak, setup, step_model, traces, args.seed)
    if traces is not None:
        speeds = machine_speeds(probe_path, [trace_dir / "calibration-steps.jsonl"]
                                + [trace_dir / f"steps-{i}.jsonl" for i in range(len(rates))])
        calibration["served"]["machine_speed"] = speeds[0]
        for row, speed in zip(rows, speeds[1:]):
            row["machine_speed"] = speed
    return {"calibration": calibration, "saturation_rps": peak, "rows": rows}


def run(args: argparse.Namespace) -> int:   # (rates, loads and times: the options' types refuse them up front)
    if args.replay and args.out:
        raise ValueError("--out: not with --replay (a replay compares the runs a folder kept; it runs and keeps none)")
    classes = load_workload(args.workload)
    out = out_dir(args.out) if args.out else None
    pool_file = args.config
    if args.replay and not pool_file:
        pool_file = kept_results(Path(args.replay)).get("config")       # the pool file the kept runs had
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(pool_file) if pool_file else Path(tmp) / "pools.yaml"
        if not pool_file:
            config_path.write_text(POOLS_YAML)
        config, model_configs, plan = _plan(config_path)
        setup = (config, plan, model_configs)
        if args.replay:
            result = replay(args, setup)
        else:
            result = {"config": str(config_path.resolve()) if pool_file else None,
                      **_bench(args, config_path, setup, classes, Path(tmp), out or Path(tmp))}
            if out:
                (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else format_report(result["rows"]))
    return 0
