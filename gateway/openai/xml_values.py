"""An XML tool call's argument as its schema reads it (`gateway.openai.xml_tools`): the text where the property
may be a string (or says nothing of its type) as written, otherwise as JSON or, as the templates write a history's
values (`| string`: `True`, `{'a': 1}`), a Python literal, and as written where neither reads."""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from gateway.openai.errors import nested_over

def resolved(prop: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`prop`, or what its local `$ref` ("#/$defs/X", "#/definitions/X") names in `root`."""
    ref = prop.get("$ref") if isinstance(prop, dict) else None
    if not isinstance(ref, str) or depth > 8:
        return prop
    parts = ref.removeprefix("#/").split("/") if ref.startswith("#/") else None
    target: Any = root
    for part in parts or ():
        target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
    return resolved(target, root, depth + 1) if parts and isinstance(target, dict) else {}


def is_text(prop: Any, root: dict[str, Any], depth: int = 0) -> bool:
    """Whether an argument's value is written as text: its schema allows a string (a `type` with "string", an
    `anyOf` / `oneOf` branch that does, an `enum` or `const` of strings) or says nothing of its kind (`depth`:
    the branches followed: a cycle of refs through them ends as text)."""
    prop = resolved(prop, root)
    if not isinstance(prop, dict) or depth > MAX_BRANCH_DEPTH:
        return True
    kind = prop.get("type")
    if kind is not None:
        return kind == "string" or isinstance(kind, list) and "string" in kind
    for key in ("anyOf", "oneOf"):
        if isinstance(prop.get(key), list):
            return any(is_text(branch, root, depth + 1) for branch in prop[key])
    for key in ("enum", "const"):
        if key in prop:
            values = prop[key] if key == "enum" and isinstance(prop[key], list) else [prop[key]]
            return all(isinstance(v, str) for v in values)
    return not {"properties", "items", "allOf"} & set(prop)


def typed_value(raw: str, prop: Any, root: dict[str, Any] | None = None) -> Any:
    """An argument's raw text as its schema reads it (the module's notes): the text where the property may be a
    string (or is not declared), else its JSON or Python literal value, else the text."""
    root = root or {}
    word, kinds = raw.strip(), set() if prop is None else _kinds(prop, root)
    if word in ("null", "None") and "null" in kinds:   # a nullable string too, as vLLM reads it
        return None
    if prop is None or is_text(prop, root):
        return raw
    if kinds & {"integer", "number"} and _DIGITS.fullmatch(word):   # "08" (JSON and Python refuse the zero)
        return int(word)
    try:
        value = json.loads(word, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError):
        value = _literal(word)
    if value is _NOT_READ or nested_over(value) or kinds and not any(_is_kind(value, kind) for kind in kinds):
        return raw
    return value


_NOT_READ = object()
_DIGITS = re.compile(r"[+-]?[0-9]{1,4000}")   # an integer of digits (Python's limit on an int's text: 4300)
MAX_BRANCH_DEPTH = 16
_PYTHON_KINDS = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
                 "null": type(None)}


def _kinds(prop: Any, root: dict[str, Any], depth: int = 0) -> set[str]:
    """The JSON types a property declares (its `type`, or its `anyOf` / `oneOf` branches'); empty: any."""
    prop = resolved(prop, root)
    if not isinstance(prop, dict) or depth > MAX_BRANCH_DEPTH:
        return set()
    kind = prop.get("type")
    if isinstance(kind, (str, list)):
        return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)}
    branches = [_kinds(b, root, depth + 1) for key in ("anyOf", "oneOf") if isinstance(prop.get(key), list)
                for b in prop[key]]
    return set() if not branches or not all(branches) else set().union(*branches)


def _is_kind(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _PYTHON_KINDS.get(kind, ()))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number's float; ValueError past a float's range (1e999: `Infinity` in the arguments, not JSON)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


def _literal(text: str) -> Any:
    """A Python literal's value as JSON holds it (a template's `| string` of a history's value: `True`, `None`,
    `{'a': 1}`), or _NOT_READ: not a literal, or holding what JSON does not (a set, a tuple key, NaN)."""
    try:
        return json.loads(json.dumps(ast.literal_eval(text), allow_nan=False))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOT_READ
