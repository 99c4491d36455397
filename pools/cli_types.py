"""Argument types of the `cliffguard` command line and its benchmarks: a value argparse cannot read as one
is refused before anything runs, as `argument --rate: must be a finite number > 0, got 'inf'` (exit code 2)."""

from __future__ import annotations

import argparse
import math
import sys

from pools.config.checks import MAX_INT, byte_count
from pools.config.device_spec import MAX_SLOTS


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


def _int_in(text: str, low: int, high: int, expected: str | None = None) -> int:
    """`text` as an integer in low..high; else an ArgumentTypeError saying `expected` (default: the range)."""
    value = _number(text, int)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {expected or f'an integer in {low}..{high}'}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count, a budget)."""
    return _int_in(text, 1, MAX_INT)


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


def memory_size(text: str) -> int:
    """A memory size > 0 in bytes: `80GiB`, `512 MiB`, `4096` (`pools.config.checks.parse_bytes`' units)."""
    try:
        count = byte_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return count
