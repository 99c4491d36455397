"""Argument types of the `cliffguard` command line and its benchmarks: a value argparse cannot read as one
is refused before anything runs, as `argument --rate: must be a finite number > 0, got 'inf'` (exit code 2).
Also the checks of options that only go together (`check_simulate_options`) and of the paths a command
writes (`output_folder`, `output_file`, `writing`): `UsageError`s naming the option, one line, exit code 2."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pools.config.checks import MAX_INT, byte_count
from pools.config.device_spec import MAX_SLOTS

DEFAULT_CONFIG = "config/pools.yaml"   # the pools YAML a command reads unless given --config


class UsageError(Exception):
    """Something the user can fix before anything loads; printed as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) saying a bad option in one line, `cliffguard capacity:
    error: argument --rate: ...` (exit code 2), as every other error of the command line; a missing
    command gets the usage line too (it lists the commands); `-h` shows usage."""

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(text: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a duration, a latency target)."""
    value = _number(text, float)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of at least one finite number > 0, each given once (a sweep's values)."""
    values = [positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct numbers > 0, comma-separated, got {text!r}")
    return values


def burstiness(text: str) -> float:
    """A gamma shape of arrival gaps: a finite number >= `pools.workload.MIN_BURSTINESS` (1: Poisson)."""
    from pools.workload import MIN_BURSTINESS

    value = _number(text, float)
    if not (math.isfinite(value) and value >= MIN_BURSTINESS):
        raise argparse.ArgumentTypeError(f"must be a finite number >= {MIN_BURSTINESS:g} (1 is Poisson; below "
                                         f"{MIN_BURSTINESS:g} nearly every gap is 0), got {text!r}")
    return value


def _int_in(text: str, low: int, high: int, expected: str | None = None) -> int:
    """`text` as an integer in low..high; else an ArgumentTypeError saying `expected` (default: the range)."""
    value = _number(text, int)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {expected or f'an integer in {low}..{high}'}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count, a budget)."""
    return _int_in(text, 1, MAX_INT)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a warm-up count that may be none)."""
    return _int_in(text, 0, MAX_INT)


def slots(text: str) -> int:
    """Replicas, or threads of a rank: an integer in 1..MAX_SLOTS (a device's own cap)."""
    return _int_in(text, 1, MAX_SLOTS)


def seed(text: str) -> int:
    """A workload seed (numpy's generators take no negative one): an integer in 0..2^63-1."""
    return _int_in(text, 0, MAX_INT)


def sampling_seed(text: str) -> int:
    """A sampling seed, as the HTTP API takes one: a signed 64-bit integer (what the worker's wire carries)."""
    return _int_in(text, -MAX_INT - 1, MAX_INT, "a 64-bit integer")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a warm-up, a rate that may be off)."""
    value = _number(text, float)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability_mass(text: str) -> float:
    """A number in [0, 1] (top_p, OpenAI's range)."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a number in [0, `engine.sampling.MAX_TEMPERATURE`]."""
    from engine.sampling import MAX_TEMPERATURE

    value = _number(text, float)
    if not 0 <= value <= MAX_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be a number in [0, {MAX_TEMPERATURE:g}], got {text!r}")
    return value


def memory_size(text: str) -> int:
    """A memory size > 0 in bytes: `80GiB`, `512 MiB`, `4096` (`pools.config.checks.parse_bytes`' units)."""
    try:
        count = byte_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return count


def _cannot_write_under(path: Path) -> str | None:
    """Why files cannot be made under the folder `path` (created if missing), None if they can: its
    nearest existing ancestor must be a folder this process may write."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def output_folder(text: str) -> str:
    """A folder the command writes its files into, created if missing: refused before anything runs
    when it cannot be (a file on its path, no write permission)."""
    if (reason := _cannot_write_under(Path(text))) is not None:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {reason}")
    return text


def output_file(text: str) -> str:
    """A file the command writes, in an existing folder: refused before anything runs when it is a
    folder or its folder cannot be written."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    if not path.parent.is_dir():
        why = "is not a folder" if path.parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {path.parent} {why}")
    if (reason := _cannot_write_under(path.parent)) is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {reason}")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is not writable")
    return text


@contextmanager
def writing(option: str, path: str | Path) -> Iterator[None]:
    """Writes to the file or folder `option` names: an OSError in them (a disk full, a folder gone or
    made read-only since the check) becomes a UsageError naming the option."""
    try:
        yield
    except OSError as exc:
        raise UsageError(f"{option}: cannot write {path} ({exc.strerror or exc})") from None


def check_preset(config, device: str | None) -> None:
    """UsageError naming --device where its GPU preset cannot run a device of `config` as configured: an FP8 KV
    cache and FP8 weights (`quantization: fp8`) need compute capability 8.9 or newer (the engine refuses them on an
    A100, `engine.config`, `engine.fp8_weights`)."""
    from engine.config import FP8_MIN_CAPABILITY
    from engine.roofline import PRESETS

    capability = PRESETS[device].capability if device is not None else FP8_MIN_CAPABILITY
    for name, dev in config.devices.items():
        if capability >= FP8_MIN_CAPABILITY or not any(p.device == name for p in config.local_pools):
            continue
        for key, value, other in (("kv_cache_dtype", dev.kv_cache_dtype, "auto"),
                                  ("quantization", dev.quantization, "auto")):
            if value == "fp8":
                raise UsageError(f"--device {device}: devices.{name}.{key} is fp8, which needs a GPU of compute "
                                 f"capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer ({device}: "
                                 f"{'.'.join(map(str, capability))}); use another preset, or {key}: {other}")


def check_simulate_options(args: argparse.Namespace) -> None:
    """`cliffguard simulate`'s options that only go with another: UsageError naming the first that lacks it."""
    if args.out and args.sweep_rate is None:
        raise UsageError("--out: only with --sweep-rate")
    if args.recommend and args.slo_ttft_p99 is None:
        raise UsageError("--recommend: give --slo-ttft-p99 SECONDS (> 0)")
    if not args.recommend and (args.slo_ttft_p99 or args.slo_itl_p99):
        raise UsageError(f"--slo-{'ttft' if args.slo_ttft_p99 else 'itl'}-p99: only with --recommend")
    if args.from_trace and not args.calibrate:
        raise UsageError("--from-trace: only with --calibrate FILE")
    if args.recommend and (args.sweep_rate is not None or args.layout != "split"):   # it runs its own layouts
        raise UsageError(f"--{'sweep-rate' if args.sweep_rate is not None else 'layout'}: not with --recommend "
                         "(it tries splits of the device between its pools itself, at --request-rate)")
    changed = next((flag for flag, value in (("--replicas", args.replicas), ("--preemption-mode",
                    args.preemption_mode), ("--swap-space", args.swap_space)) if value is not None), None)
    if args.calibrate and changed:   # the calibration runs the file's own pools
        raise UsageError(f"{changed}: not with --calibrate (it measures the config as its file writes it)")
    ran = next((flag for flag, given in (
        ("--recommend", args.recommend), ("--sweep-rate", args.sweep_rate is not None),
        ("--step-model", args.step_model is not None), ("--layout", args.layout != "split"),
        ("--no-credits", args.no_credits), ("--json", args.json), ("--workload", args.workload != "mixed"),
        ("--request-rate", args.request_rate != 1.0), ("--duration", args.duration != 60.0),
        ("--burstiness", args.burstiness != 1.0), ("--device", args.device is not None)) if given), None)
    if args.calibrate and ran:   # it measures steps and writes them: nothing is simulated
        raise UsageError(f"{ran}: not with --calibrate (it measures the device's steps and writes them; nothing "
                         "is simulated)")
    if args.calibrate and not args.from_trace and (args.model_config or args.vram):   # it runs the real engine here
        raise UsageError(f"--{'model-config' if args.model_config else 'vram'}: with --calibrate, only beside "
                         "--from-trace (a calibration here runs the config's own model on this machine)")


def check_pool_file(path: str | os.PathLike, option: str = "--config") -> None:
    """A UsageError naming `option` for a pool file the gateway would refuse (a missing file, YAML that does not
    parse, a key it rejects): said before a benchmark starts a server or a cluster, not as a traceback in it."""
    from pools.config.yaml_file import load_config

    try:
        load_config(Path(path))
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None
