"""Option parsing the benchmarks share."""

from __future__ import annotations

import os
from pathlib import Path


def int_list(text: str, option: str, minimum: int, rule: str) -> list[int]:
    """`"16,64"` -> [16, 64]; ValueError naming `option` when an item is not an integer, the list is
    empty or an item is below `minimum` (`rule` says so in words, e.g. "batch sizes must be >= 1")."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{option}: {rule}, got {text!r}")
    return values


def out_dir(out: str) -> Path:
    """`--out`, created if missing; ValueError naming the option when it cannot be written."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create {out}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out: {out} is not writable")
    return path


def device_and_dtype(device: str, dtype: str):
    """(torch device, torch dtype) of `--device` and `--dtype` as an engine resolves them (auto: CUDA if present;
    bfloat16 where it computes natively); ValueError naming `--device` where this machine lacks it."""
    from engine.config import EngineConfig

    config = EngineConfig(device=device, dtype=dtype)
    try:
        resolved = config.rank_devices()[0]
    except ValueError as exc:   # a ConfigError: no CUDA, or no such GPU on this machine
        raise ValueError(f"--device: {device}: {exc}") from None
    return resolved, config.resolved_dtype(resolved)
