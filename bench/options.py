"""Option parsing the benchmarks share."""

from __future__ import annotations


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
