"""Reading one value of an HF config.json: absent or null gives the default; the wrong type or range is a
`ConfigError` naming the key (its `path` first). What `engine.model_config` and `engine.model_families` read with."""

from __future__ import annotations

import math
from typing import Any

from engine.config import ConfigError

REQUIRED: Any = object()



def rope_type(rope: dict[str, Any]) -> Any:
    """A rope mapping's type, spelled `rope_type` or (older) `type`."""
    return rope.get("rope_type", rope.get("type", "default"))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_INT = 2**31 - 1   # no size, count or token id of a model reaches it


def read_int(cfg: dict[str, Any], key: str, default: Any = REQUIRED, *, minimum: int = 1, path: str = "") -> Any:
    """cfg[key], an integer in `minimum`..2^31-1 (not a bool, a float or a string); `default` when absent or null."""
    value = cfg.get(key)
    if key not in cfg and default is REQUIRED:
        raise ConfigError(f"{path}{key}: missing from config.json")
    if value is None and default is not REQUIRED:
        return default
    if not is_int(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{path}{key}: must be {kind}, got {value!r}")
    if value > MAX_INT:
        raise ConfigError(f"{path}{key}: must be below 2^31, got {value!r:.40}")
    return value


def read_float(cfg: dict[str, Any], key: str, default: Any, *, positive: bool = True, path: str = "") -> Any:
    """cfg[key] as a finite float (> 0 if `positive`); `default` when absent or null (REQUIRED: a ConfigError)."""
    value = cfg.get(key)
    if value is None and default is REQUIRED:
        raise ConfigError(f"{path}{key}: missing from config.json")
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{path}{key}: expected a number, got {value!r}")
    if is_int(value) and abs(value) > 2**1000 or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{path}{key}: must be a{' positive' if positive else ''} finite number, got {value!r:.40}")
    return float(value)


def read_bool(cfg: dict[str, Any], key: str, default: bool, *, path: str = "") -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{path}{key}: must be true or false, got {value!r}")
    return value


def read_object(cfg: dict[str, Any], key: str, *, name: str = "") -> dict[str, Any] | None:
    """cfg[key], a JSON object, or None when absent or null; `name`: its key path in errors (default `key`)."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{name or key}: expected an object, got {value!r}")
    return value


def read_token_ids(cfg: dict[str, Any], key: str, *, path: str = "") -> tuple[int, ...]:
    """cfg[key]: a token id, a list of them, or absent / null (none)."""
    value = cfg.get(key)
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(is_int(i) and 0 <= i <= MAX_INT for i in ids):
        raise ConfigError(f"{path}{key}: must be a token id or a list of token ids, got {value!r:.80}")
    return tuple(ids)
