"""Checking YAML documents against a schema by hand: the error type, the value checks and the loader
that the pool spec (`pools.config.spec`) and the benchmark workloads (`bench.serve`) share.

Every error is a `SpecError` whose message starts with the key path of the bad value
(`pools[1].kv_share: ...`); `within(prefix)` prepends a parent path as the error travels up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from engine.config import ConfigError


class SpecError(ConfigError):
    """An invalid configuration file; the message starts with the key path, e.g. `pools[1].kv_share`."""


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_str(key: str, value: Any, *, optional: bool = False) -> None:
    """`value` is a non-empty string (or None when `optional`); else SpecError naming the key."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{key}: must be a non-empty string, got {show(value)}")


def check_int(key: str, value: Any, *, min_value: int | None = None, max_value: int | None = None,
               optional: bool = False) -> None:
    """`value` is an integer within the bounds given (or None when `optional`); else SpecError naming the key."""
    if value is None and optional:
        return
    if not is_int(value):
        raise SpecError(f"{key}: must be an integer, got {show(value)}")
    if min_value is not None and max_value is not None and not min_value <= value <= max_value:
        raise SpecError(f"{key}: must be in {min_value}..{max_value}, got {value}")
    if min_value is not None and value < min_value:
        raise SpecError(f"{key}: must be >= {min_value}, got {value}")


def check_fraction(key: str, value: Any, *, optional: bool = False) -> None:
    """`value` is a number in (0, 1] (or None when `optional`); else SpecError naming the key."""
    if value is None and optional:
        return
    if not is_number(value):
        raise SpecError(f"{key}: must be a number in (0, 1], got {show(value)}")
    if not 0 < value <= 1:
        raise SpecError(f"{key}: must be in (0, 1], got {value}")


@contextmanager
def within(prefix: str) -> Iterator[None]:
    """Errors raised inside get `prefix.` in front of their key path."""
    try:
        yield
    except SpecError as exc:
        message = str(exc)
        raise SpecError(f"{prefix}{'' if message.startswith('[') else '.'}{message}") from None


def check_mapping(key: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """`value` is a dict whose keys are all in `allowed`; else SpecError naming the key."""
    if not isinstance(value, dict):
        raise SpecError(f"{key}: must be a mapping, got {show(value)}")
    for name, item in value.items():
        if name not in allowed:
            path = f"{key}.{name}" if key else str(name)
            raise SpecError(f"{path}: unknown key (value {item!r}); allowed keys: {', '.join(allowed)}")
    return value


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, source: str) -> Any:
    """YAML text -> Python data; a syntax error is a SpecError with `source`, the line, the column and a caret."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if mark is None:
            raise SpecError(f"{source}: YAML error: {problem}") from None
        lines = text.splitlines()
        snippet = lines[mark.line] if mark.line < len(lines) else ""
        raise SpecError(f"{source}: YAML error at line {mark.line + 1}, column {mark.column + 1}: {problem}\n"
                        f"    {snippet}\n    {' ' * mark.column}^") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: YAML error: {exc}") from None




def read_text(path: Path, what: str = "configuration file") -> str:
    """The UTF-8 text of `path`; a missing, unreadable or binary file is a SpecError naming the path."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such {what}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a UTF-8 text file (byte 0x{exc.object[exc.start]:02x} at offset "
                        f"{exc.start}); a {what} is YAML text") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
