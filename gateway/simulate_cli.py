"""`cliffguard simulate`: its options, the runs it makes (`pools.simulation`) and what it prints; `--calibrate`
measures a step model (`engine.calibration`, or a served run's step trace). `gateway.cli` dispatches here and
owns the exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pools.cli_types import (DEFAULT_CONFIG, UsageError, burstiness, check_preset, check_simulate_options, memory_size,
                             output_file, output_folder, positive_float, seed, slots, writing)


def add_simulate(sub) -> None:
    from engine.roofline import PRESETS

    p = sub.add_parser("simulate", help="run the real schedulers on a modelled GPU: predicted latency per class",
                       description="Plan the pools of a config for a GPU preset (memory from the preset), then "
                                   "drive the real schedulers, step composer and KV credits over a workload on a "
                                   "virtual clock whose steps take the preset's roofline time. See "
                                   "docs/SIMULATE.md.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"pools YAML (default: {DEFAULT_CONFIG})")
    p.add_argument("--workload", default="mixed", help="workload classes: a YAML file or a name under "
                   "bench/workloads (default: mixed)")
    p.add_argument("--request-rate", type=positive_float, default=1.0, help="requests/s over the share classes "
                   "(default 1)")
    p.add_argument("--duration", type=positive_float, default=60.0, help="seconds of arrivals (default 60)")
    p.add_argument("--burstiness", type=burstiness, default=1.0, help="gamma shape of the gaps (>= 0.01); 1 is Poisson")
    p.add_argument("--device", choices=sorted(PRESETS), default=None, help="GPU preset (default h100; a device "
                   "planned as a CPU needs --step-model, or this given)")
    p.add_argument("--vram", type=memory_size, default=None, help="memory per GPU for the plan (default: the preset's)")
    p.add_argument("--model-config", default=None, help="an HF config.json (or its folder) for every pool")
    p.add_argument("--preemption-mode", choices=("recompute", "swap", "auto"), default=None,
                   help="override every pool's preemption_mode")
    p.add_argument("--swap-space", default=None, help="override every pool's swap_space (e.g. 16GiB)")
    p.add_argument("--no-credits", action="store_true", help="admit at once, as a server without KV credits")
    p.add_argument("--replicas", type=slots, default=None, metavar="N",
                   help="simulate every device as N replicas behind one credit queue per pool (overrides the "
                        "config's replicas and drops its gpus list)")
    p.add_argument("--layout", choices=("split", "shared", "both"), default="split",
                   help="the config's pools (split), each device's pools merged into one (shared), or both")
    p.add_argument("--sweep-rate", default=None, metavar="R1,R2,...",
                   help="run at each request rate and print p99 TTFT per class (the knee)")
    p.add_argument("--out", type=output_folder, default=None, help="with --sweep-rate: write results.json and "
                   "knee.png here (created if missing)")
    p.add_argument("--recommend", action="store_true",
                   help="try kv_share splits of the device's two pools and the second pool's max_num_batched_tokens "
                        "at --request-rate; print the one that meets --slo-ttft-p99 with the lowest worst p99 TTFT")
    p.add_argument("--slo-ttft-p99", type=positive_float, default=None, help="with --recommend: p99 TTFT target (s)")
    p.add_argument("--slo-itl-p99", type=positive_float, default=None, help="with --recommend: p99 ITL target (s)")
    p.add_argument("--calibrate", type=output_file, default=None, metavar="FILE",
                   help="measure the config's first device on this machine (the real engine), fit the linear "
                        "step model, write it to FILE and exit")
    p.add_argument("--from-trace", default=None, metavar="TRACE",
                   help="with --calibrate: fit the step model to a served run's step trace (the file a server "
                        "started with CLIFFGUARD_STEP_TRACE=TRACE wrote) instead of running the engine here")
    p.add_argument("--step-model", default=None, metavar="FILE",
                   help="use a measured step model (from --calibrate) instead of --device's roofline; the plan "
                        "then uses the config's own memory")
    p.add_argument("--seed", type=seed, default=0, help="seed of arrivals, lengths and token ids (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def simulate(args: argparse.Namespace) -> int:
    from pools.config.yaml_file import load_config
    from pools.simulation.knee import sweep
    from pools.simulation.recommend import format_recommendation, recommend
    from pools.workload import check_arrivals, load_workload, parse_rates

    rates = parse_rates(args.sweep_rate, "--sweep-rate") if args.sweep_rate is not None else None
    check_simulate_options(args)
    config = load_config(args.config)
    if args.calibrate:
        return _calibrate(config, args)
    classes = load_workload(args.workload)
    if rates is not None and all(c.rate is not None for c in classes):
        raise UsageError(f"--sweep-rate: every class of workload {args.workload!r} has a rate of its own, so no "
                         "request rate moves its arrivals (give a class a share to sweep)")
    check_arrivals(classes, max(rates or [args.request_rate]), args.duration,
                   "--sweep-rate" if rates else "--request-rate")
    config, model_configs, vram, layouts, step_times = _simulation_setup(config, args)
    credits = not args.no_credits
    if args.recommend:
        result = recommend(config, model_configs, classes, args.request_rate, step_times, ttft_p99=args.slo_ttft_p99,
                           itl_p99=args.slo_itl_p99, duration=args.duration, vram_bytes=vram, credits=credits,
                           burstiness=args.burstiness, seed=args.seed)
        print(json.dumps(result, indent=2) if args.json else format_recommendation(result))
    elif rates is not None:
        rows = sweep(layouts, model_configs, classes, rates, step_times, duration=args.duration,
                     burstiness=args.burstiness, credits=credits, seed=args.seed)
        _print_sweep(rows, args)
    else:
        _print_runs(layouts, model_configs, classes, step_times, args)
    return 0


def _with_replicas(devices: dict, replicas: int) -> dict:
    """Each device with `replicas` copies (--replicas): a device on this machine's GPUs gets as many GPUs as
    they need, after the GPUs of the devices before it (nothing runs on them: the claims only stay apart)."""
    out, first = {}, 0
    for name, device in devices.items():
        if device.claimed_gpus:
            need = replicas * device.tensor_parallel_size
            out[name] = device.replace(replicas=replicas, min_replicas=None, device="cuda",
                                       gpus=tuple(range(first, first + need)))
            first += need
        else:
            out[name] = device.replace(replicas=replicas, gpus=None, min_replicas=None)
    return out


def _simulation_setup(config, args: argparse.Namespace):
    """The config with --replicas / --preemption-mode / --swap-space applied, its model configs, the memory
    the plan uses, the layouts to run ({name: (config, plan)}) and each device's step-time model."""
    from engine.roofline import PRESETS
    from pools.capacity_plan import plan_capacity
    from pools.model_configs import resolve_model_configs
    from pools.simulation.runner import device_step_times, shared_layout
    from pools.config.spec import SpecError, parse_bytes
    from pools.plan_report import DEFAULT_PRESET

    if args.replicas is not None:
        config = dataclasses.replace(config, devices=_with_replicas(config.devices, args.replicas))
    overrides = {}
    if args.preemption_mode:
        overrides["preemption_mode"] = args.preemption_mode
    if args.swap_space:
        overrides["swap_space_bytes"] = parse_bytes(args.swap_space, "--swap-space")
    for i, pool in enumerate(config.pools if overrides else ()):
        try:
            pool.replace(**overrides)
        except SpecError as exc:   # the flags made it: they are named, and the pool
            flags = " and ".join(f for f, v in (("--preemption-mode", args.preemption_mode),
                                                ("--swap-space", args.swap_space)) if v)
            raise UsageError(f"{flags}: pool {pool.name!r} (pools[{i}]) would be invalid: {exc}") from None
    if overrides:
        config = dataclasses.replace(config, pools=tuple(p.replace(**overrides) for p in config.pools))
    explicit, args.device = args.device is not None, args.device or DEFAULT_PRESET
    preset = PRESETS[args.device]
    check_preset(config, args.device)
    vram = args.vram or (None if args.step_model else preset.memory_bytes)
    try:
        model_configs = resolve_model_configs(config, args.model_config)
    except SpecError as exc:
        raise SpecError(f"{exc} (or pass --model-config config.json)") from None
    plan = plan_capacity(config, model_configs, vram_bytes=vram)
    cpu = [d.name for d in plan.devices.values() if d.device_type == "cpu"]
    if cpu and not (args.step_model or explicit):   # as `capacity --rate` refuses it
        raise UsageError(f"--device: device {cpu[0]} is planned as a CPU, which has no roofline preset (its memory "
                         "and steps would be an H100's); give --step-model FILE (measured with --calibrate) or "
                         "--device PRESET")
    layouts = {}
    if args.layout in ("split", "both"):
        layouts["split"] = (config, plan)
    if args.layout in ("shared", "both"):
        shared = shared_layout(config, plan)
        layouts["shared"] = (shared, plan_capacity(shared, model_configs, vram_bytes=vram))
    return config, model_configs, vram, layouts, device_step_times(plan, model_configs, preset=args.device,
                                                                   step_model=args.step_model)


def _print_sweep(rows, args: argparse.Namespace) -> None:
    from pools.simulation.knee import format_sweep, plot_knee

    print(json.dumps(rows, indent=2) if args.json else format_sweep(rows))
    if args.out:
        out = Path(args.out)
        with writing("--out", out):
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(rows, indent=2))
            plot_knee(rows, out / "knee.png",
                      title=f"{Path(args.config).name} on {args.device}, workload {args.workload}")
        print(f"wrote {out / 'results.json'} and {out / 'knee.png'}", file=sys.stderr)


def _print_runs(layouts, model_configs, classes, step_times, args: argparse.Namespace) -> None:
    """One run of each layout at --request-rate, same arrivals; each device's overload verdict for them."""
    from pools.simulation.runner import make_requests, simulate, step_model_label
    from pools.simulation.summary import format_summary, overload_verdicts, summarize

    summaries, label = {}, step_model_label(args.device, args.step_model)
    for name, (layout_config, layout_plan) in layouts.items():
        requests = make_requests(classes, args.request_rate, duration=args.duration, burstiness=args.burstiness,
                                 seed=args.seed)
        result = simulate(layout_config, layout_plan, model_configs, requests, step_times,
                          credits=not args.no_credits, seed=args.seed)
        summaries[name] = summarize(result) | {"overload": overload_verdicts(
            result, layout_plan, step_times, duration=args.duration, step_model=label)}
    if args.json:
        print(json.dumps(summaries if len(summaries) > 1 else summaries[next(iter(summaries))], indent=2))
    else:
        print("\n\n".join(f"== {name} ==\n{format_summary(summary)}" if len(summaries) > 1
                           else format_summary(summary) for name, summary in summaries.items()))


def _calibrate(config, args: argparse.Namespace) -> int:
    """`simulate --calibrate FILE`: the real engine of the config's first local device on this machine, or
    (`--from-trace`) the steps a server of that config traced while serving: planned as that server was, with
    --model-config and --vram (a trace from a GPU server is fitted anywhere; no engine loads here)."""
    from engine.step_cost import fit_linear, read_step_trace, write_step_model
    from pools.capacity_plan import engine_configs, plan_capacity
    from pools.config.spec import SpecError
    from pools.model_configs import resolve_model_configs

    try:
        model_configs = resolve_model_configs(config, args.model_config if args.from_trace else None)
    except SpecError as exc:
        raise SpecError(f"{exc}{' (or pass --model-config config.json)' if args.from_trace else ''}") from None
    plan = plan_capacity(config, model_configs, vram_bytes=args.vram if args.from_trace else None)
    if not plan.devices:
        raise UsageError(f"--config: {args.config} has no local device to calibrate (its pools are all upstream)")
    device = next(iter(plan.devices))
    if args.from_trace:
        samples = read_step_trace(args.from_trace)
        model, num_steps, where = fit_linear(samples), len(samples), f"{device} (served, trace {args.from_trace})"
        model_name = plan.devices[device].model
    else:
        from engine.calibration import measure_steps
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_configs(config, plan)[device])
        model, samples = measure_steps(engine, seed=args.seed)
        num_steps, where, model_name = len(samples), f"{device} ({engine.device}, {engine.dtype})", engine.config.model
    with writing("--calibrate", args.calibrate):
        write_step_model(args.calibrate, model, device=where, model_name=model_name, num_steps=num_steps)
    print(f"{num_steps} steps measured; {model.describe()}; wrote {args.calibrate}")
    return 0
