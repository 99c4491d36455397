"""Typed validation with msgspec: a JSON or YAML value checked against a model, its error naming the field path.

The request bodies (`gateway.openai`) and the YAML sections (`pools.config`) are `msgspec.Struct` models;
`convert` checks a decoded value against one and turns msgspec's message into a `FieldError` whose
`path` is the field as the user wrote it (`messages[0].role`, `pools[1].kv_share`) and whose `reason`
is plain words (`expected an integer, got string`, `must be one of system, user, got 'x'`). Callers wrap
it in their own error: the OpenAI error format's `param` on HTTP, a `SpecError` for the YAML.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
MISSING: Any = msgspec.UNSET   # FieldError.value when the path names nothing in the input


class FieldError(ValueError):
    """A value that does not fit its model: `path` names the field (empty for the whole value).

    Beside the message: `value`, what the input holds at `path` (MISSING if nothing), and `allowed`, the
    fields of the object holding an unrecognized one or the choices of an enum (empty otherwise)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason
        self.value: Any = MISSING
        self.allowed: tuple[str, ...] = ()


def convert(value: Any, model: type[T], *, root: str = "",
            dec_hook: Callable[[type, Any], Any] | None = None) -> T:
    """`value` (decoded JSON or YAML) as an instance of `model`; a misfit is a FieldError naming the path
    under `root` (the path of `value` itself, e.g. `pools[1]`). `dec_hook` builds the model's custom types
    (msgspec's hook: a ValueError it raises is a misfit at that field). A FieldError raised by a
    `__post_init__` (a rule across fields) keeps its own path, under the path of the object it checks."""
    try:
        return msgspec.convert(value, model, strict=True, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        raise explain(exc, model, root, value) from None


_AT = re.compile(r"^(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`(?:, got `(?P<got>[^`]+)`)?(?P<rest>.*)$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")
_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+|\.\.\.)\]")
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
          "array": "an array", "object": "an object", "null": "null"}
_GOT = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def explain(exc: msgspec.ValidationError, model: type, root: str = "", value: Any = MISSING) -> FieldError:
    """msgspec's message (`Expected `int` >= 1 - at `$.n``) as a FieldError (`n`, `must be >= 1`);
    `value`, the input converted, gives the error its `value`."""
    match = _AT.match(str(exc))
    what, path = match["what"], (match["path"] or "").lstrip(".")
    reason, allowed = what, ()
    cause = exc.__cause__
    if isinstance(cause, FieldError):   # a rule of a __post_init__: its path is under the object's
        path, reason = _join(path, cause.path) if cause.path else path, cause.reason
    elif found := _MISSING.match(what):
        path, reason = _join(path, found["name"]), "is required"
    elif found := _UNKNOWN.match(what):
        allowed = _allowed(model, path)
        path, reason = _join(path, found["name"]), "unrecognized field"
    elif found := _ENUM.match(what):
        allowed = _allowed(model, path)
        reason = f"must be one of {', '.join(allowed)}, got {found['value']}" if allowed \
            else f"invalid value {found['value']}"
    elif found := _EXPECTED.match(what):
        reason = _expected(found["want"], found["got"], found["rest"].strip())
    if match["key"]:   # the mapping's key is named, never the mapping (its values may hold API keys)
        reason = _bad_key(_value_at(value, path)) or f"a key: {reason}"
    full = f"{root}{'' if not path or path.startswith('[') or not root else '.'}{path}" if root else path
    error = FieldError(full, reason)   # a rule's reason names its values itself
    error.value = MISSING if isinstance(cause, FieldError) or match["key"] else _value_at(value, path)
    error.allowed = tuple(allowed)
    return error


def _bad_key(mapping: Any) -> str | None:
    """The reason a mapping's key that is not a string is refused, naming it (None: none found)."""
    key = next((k for k in mapping if not isinstance(k, str)), MISSING) if isinstance(mapping, dict) else MISSING
    if key is MISSING:
        return None
    hint = " (YAML 1.1 reads on, off, yes and no as booleans: quote the key)" if isinstance(key, bool) else ""
    return f"key {key!r} is not a string{hint}"


def _value_at(value: Any, path: str) -> Any:
    """What `value` holds at `path` (`pools[1].kv_share`), or MISSING."""
    for name, index in _PART.findall(path):
        if name and isinstance(value, dict) and name in value:
            value = value[name]
        elif index.isdigit() and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return MISSING
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _expected(want: str, got: str | None, bound: str) -> str:
    """`int | null`, `str` -> `expected an integer, got string`; `int`, None, `>= 1` -> `must be >= 1`."""
    if got is None:   # a constraint: `>= 1`, `of length >= 1`, `<= 2.0`
        if bound.startswith("of length >= 1"):
            return "must not be empty"
        return f"must be {bound.removeprefix('of ')}" if bound else f"expected {_kinds(want)}"
    return f"expected {_kinds(want)}, got {_GOT.get(got, got)}"


def _kinds(want: str) -> str:
    kinds = [k.strip() for k in want.split("|") if k.strip() != "null"]
    return " or ".join(_WORDS.get(k, k) for k in kinds) or "null"


def _allowed(model: type, path: str) -> list[str]:
    """The literal values the field at `path` takes (an enum error), or the fields of the object at `path`
    (an unrecognized field in it), found by walking the model."""
    info: Any = msgspec.inspect.type_info(model)
    for part, _ in _PART.findall(path):
        info = _unwrap(info)
        if part and isinstance(info, msgspec.inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
        elif not part and isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.TupleType)):
            info = info.item_type if hasattr(info, "item_type") else None
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return []
        if info is None:
            return []
    info = info.type if isinstance(info, msgspec.inspect.Metadata) else info
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    if literals := [str(v) for t in members if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]:
        return literals   # a Literal, or a union of one with other types ("auto" or {"name": ...})
    info = _unwrap(info)
    if isinstance(info, msgspec.inspect.EnumType):
        return [str(m.value) for m in info.cls]
    if isinstance(info, msgspec.inspect.StructType):
        return [f.encode_name for f in info.fields]
    return []


def _unwrap(info: Any) -> Any:
    """A union's one non-null member (a field that may be null), else the type itself."""
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        members = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        structured = [t for t in members if not isinstance(t, (msgspec.inspect.StrType, msgspec.inspect.LiteralType))]
        if len(members) == 1:
            return _unwrap(members[0])
        if len(structured) == 1:
            return _unwrap(structured[0])
    return info
