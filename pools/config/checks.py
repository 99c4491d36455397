"""The YAML's models and errors: `Spec`, the msgspec base of every section's model, `from_yaml`, byte sizes,
the `SpecError` naming the key path, and the YAML loader; the pool spec (`pools.config.spec`) and the
benchmark workloads (`bench.serve`, `pools.workload`) share them.

A section's model states the schema in its field types (`Annotated[int, Meta(ge=1)]`, `Literal[...]`);
`from_yaml` checks a YAML value against it (`pools.config.typed.convert`) and the model's `check()` adds
the rules across fields. Every error is a `SpecError` whose message starts with the key path of the bad
value and shows the value (`pools[1].kv_share: must be <= 1.0, got 1.5`; one that may hold API keys by its
kind and size only: `_SECRET_PATH`); `within(prefix)` prepends a parent path as the error travels up.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self, TypeVar

import msgspec
import yaml

from engine.config import ConfigError
from pools.config.typed import MISSING, FieldError, convert

S = TypeVar("S")
Text = Annotated[str, msgspec.Meta(min_length=1)]          # a non-empty string
MAX_INT = 2**63 - 1                                        # the largest count or byte size a file may give
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]     # an integer >= 1
CountOrZero = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]   # an integer >= 0
Positive = Annotated[float, msgspec.Meta(gt=0)]            # a number > 0
Seconds = Positive                                         # a number of seconds > 0
NonNegative = Annotated[float, msgspec.Meta(ge=0)]         # a number >= 0
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]      # a number in (0, 1]


class SpecError(ConfigError, FieldError):
    """An invalid configuration file; the message starts with the key path, e.g. `pools[1].kv_share`.

    `SpecError(message)`, or `SpecError(key, reason)` from a model's `check()`: `key` is then relative to
    the model, and `from_yaml` puts the model's own path in front of it."""

    def __init__(self, key_or_message: str, reason: str | None = None) -> None:
        FieldError.__init__(self, *(("", key_or_message) if reason is None else (key_or_message, reason)))


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def shown_at(value: Any, path: str) -> str:
    """`value` as an error at `path` shows it: its repr, cut; its kind and size only where it may hold API keys."""
    return _secret(value) if _SECRET_PATH.search(path) else _short(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A name that goes into metric labels, URLs and headers (a pool's, a tenant's): matched whole, since a
# pattern ending in `$` also matches before a final newline, and "chat\n" in a header breaks every response.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # an environment variable's name


def padded(text: str) -> bool:
    """Whether `text` is blank or begins or ends with whitespace (a host, a path, a URL with a typo)."""
    return not text.strip() or text != text.strip()


def is_label(name: str) -> bool:
    """`name` is letters, digits, '_', '.' and '-', starting with a letter or digit, and nothing else."""
    return _LABEL.fullmatch(name) is not None


def has_control_characters(text: str) -> bool:
    """`text` holds a control character (a newline, a tab, an escape): nothing a client can send back."""
    return any(unicodedata.category(c) == "Cc" for c in text)


# --- the models -----------------------------------------------------------------------------------

_CONVERTING: ContextVar[bool] = ContextVar("pools_config_converting", default=False)


class Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A YAML section as a frozen model: its field types and bounds are the schema, `check()` the rules
    across fields. Read from YAML by `from_yaml`; built in Python it is validated on construction the
    same way (its fields converted as YAML values would be), so a bad value is a SpecError naming the
    field either way. `NOT_IN_YAML`: fields the loader derives (a name from the mapping's key), refused
    as YAML keys."""

    NOT_IN_YAML: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if _CONVERTING.get():
            self.check()
        else:
            _revalidate(self)

    def check(self) -> None:
        """The rules a schema cannot state; raise `SpecError(key, reason)`."""

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (field names), validated like any new one."""
        return msgspec.structs.replace(self, **changes)


def from_yaml(raw: Any, model: type[S], root: str, **derived: Any) -> S:
    """The YAML value `raw` at key path `root` as a `model`, with the `derived` fields added (a name
    taken from the mapping's key); a SpecError names the key path and the bad value."""
    if isinstance(raw, dict):
        hidden = getattr(model, "NOT_IN_YAML", ())
        for key in (k for k in raw if k in hidden):
            error = FieldError(f"{root}.{key}" if root else key, "unrecognized field")
            error.value, error.allowed = raw[key], model.__struct_encode_fields__
            raise SpecError(error.path, _reason(error, hidden))
        raw = {**raw, **derived}
    return _convert(raw, model, root)


def _convert(raw: Any, model: type[S], root: str) -> S:
    _check_finite(raw, root)
    token = _CONVERTING.set(True)
    try:
        return convert(raw, model, root=root, dec_hook=_decode)
    except FieldError as exc:
        raise SpecError(exc.path or "(top level)", _reason(exc, getattr(model, "NOT_IN_YAML", ()))) from None
    finally:
        _CONVERTING.reset(token)


def _check_finite(value: Any, path: str) -> None:
    """An infinity or a NaN (YAML `.inf`, `.nan`) is no field's value: a SpecError naming its key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, f"must be a finite number, got {value}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _check_finite(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key))


def _revalidate(spec: Spec) -> None:
    """A Spec built in Python, checked as its YAML would be: a field of the wrong kind (a dict for a
    model, a list for a tuple) converts to something else, and is an error too."""
    names = tuple(zip(spec.__struct_fields__, spec.__struct_encode_fields__))
    checked = _convert({key: getattr(spec, name) for name, key in names}, type(spec), "")
    for name, key in names:
        if getattr(checked, name) != getattr(spec, name):
            raise SpecError(key, f"expected {type(getattr(checked, name)).__name__}, got {show(getattr(spec, name))}")


def _reason(error: FieldError, hidden_keys: tuple[str, ...]) -> str:
    """The reason with the bad value shown (only its kind and size where it may hold API keys: `_secret`), and
    for an unknown key the keys allowed."""
    value, reason = error.value, error.reason
    path = error.path or ""
    misspelt_section = reason == "unrecognized field" and isinstance(value, (dict, list)) and value \
        and re.fullmatch(r"(gateway\.)?[^.]+", path)   # at the top (`tenant:`) or under `gateway`
    shown = _secret(value) if misspelt_section else shown_at(value, path)
    if reason == "unrecognized field":
        return f"unknown key (value {shown}); allowed keys: " \
               f"{', '.join(k for k in error.allowed if k not in hidden_keys)}"
    if value is MISSING or value is None or ", got " in reason and not reason.startswith("expected "):
        return reason
    if reason.startswith("expected ") and "number" in reason and (number := _yaml_number(value)) is not None:
        return f"{reason} {shown} (YAML reads an exponent without a dot or without its sign as text: " \
               f"write {number})"
    return f"{reason} {shown}" if reason.startswith("expected ") else f"{reason}, got {shown}"


# a value that may hold API keys: under a key named like `api_keys` (a typo too: `keys`, `api-key`, `upstream_key`),
# a token or a secret, anything of `tenants`; and (`_reason`) a section misspelt at the top or under `gateway`
_SECRET_PATH = re.compile(r"api_?key|api_?token|(^|[._\-])keys?($|[.\[])|token$|secret|^tenants($|[.\[])",
                          re.IGNORECASE)


def _secret(value: Any) -> str:
    """What a config error says of a value that may hold API keys (errors go to logs): its kind and size."""
    kind = {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
    return f"{kind} of {len(value)}" if isinstance(value, (str, list, dict)) else f"{kind} value (not shown)"


_EXPONENT = re.compile(r"(?P<sign>[-+]?)(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?[eE](?P<exp>[-+]?[0-9]+)")


def _yaml_number(value: Any) -> str | None:
    """The text YAML 1.1 (PyYAML) reads as the number a string in exponent form means (`1e-3` -> `1.0e-3`,
    `1e300` and `1.0e300` -> `1.0e+300`: a dot in the mantissa and a sign on the exponent), or None."""
    match = _EXPONENT.fullmatch(value) if isinstance(value, str) else None
    if match is None or not (match["whole"] or match["fraction"]):
        return None
    exponent = match["exp"] if match["exp"][0] in "+-" else f"+{match['exp']}"
    number = f"{match['sign']}{match['whole'] or '0'}.{match['fraction'] or '0'}e{exponent}"
    return number if number != value else None


def _short(value: Any, width: int = 80) -> str:
    """repr(value), cut at `width` characters (a 400-digit number, a whole section given where a number goes)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 3]}..."


@contextmanager
def engine_rules(yaml_keys: Mapping[str, str] | None = None) -> Iterator[None]:
    """The engine's own validation (engine.config) inside: its ConfigError, whose message starts with the
    engine's field name, becomes a SpecError(key, reason); `yaml_keys` maps a field to the YAML key."""
    try:
        yield
    except SpecError:
        raise
    except ConfigError as exc:
        name, _, reason = str(exc).partition(": ")
        raise SpecError((yaml_keys or {}).get(name, name), reason) from None


# --- byte sizes -----------------------------------------------------------------------------------

class ByteSize(int):
    """A field's type: a byte count, in YAML an integer or a string with a unit (`80GiB`); at least 1.
    An int (read from YAML, the field holds this subclass; built in Python, whatever int it was given)."""

    minimum: ClassVar[int] = 1


class ByteSizeOrZero(ByteSize):
    """A byte count that may be 0."""

    minimum = 0


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, key: str = "bytes") -> int:
    """`80GiB`, `512 MiB`, `1.5GB`, `4096`, 4096 -> bytes (an int, rounded down).

    GiB/MiB/KiB/TiB (and Gi, Mi, ...) are powers of 1024; GB/MB/KB/TB (and G, M, K, T) powers of 1000;
    units are case-insensitive. Anything else, a negative number or a bool raises SpecError naming `key`.
    """
    try:
        return byte_count(value)
    except ValueError as exc:
        raise SpecError(key, str(exc)) from None


def byte_count(value: Any) -> int:
    """`parse_bytes` without a key: ValueError with the reason."""
    if is_int(value):
        if value < 0:
            raise ValueError(f"must be >= 0 bytes, got {value}")
        return _at_most_max(value, value)
    if isinstance(value, float) and value >= 0 and value.is_integer():
        return _at_most_max(int(value), value)
    match = _BYTES.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a byte size, got {show(value)}; "
                         "write an integer or a number with a unit, e.g. 80GiB, 512 MiB, 1.5GB")
    if len(match.group(1).partition(".")[0].lstrip("0")) > 40:   # no byte count has that many digits
        return _at_most_max(MAX_INT + 1, value)
    return _at_most_max(int(Decimal(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]), value)


def _at_most_max(count: int, value: Any) -> int:
    if count > MAX_INT:
        raise ValueError(f"must be at most {MAX_INT} bytes (just under 8 EiB), got {_short(value)}")
    return count


def fmt_bytes(n: int) -> str:
    """Bytes in binary units: 1.50 GiB."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def _decode(kind: type, value: Any) -> Any:
    """msgspec's hook for the models' custom types: byte sizes."""
    if isinstance(kind, type) and issubclass(kind, ByteSize):
        count = byte_count(value)
        if count < kind.minimum:
            raise ValueError(f"must be at least {kind.minimum} byte, got {value!r}")
        return kind(count)
    raise NotImplementedError(kind)


# --- key paths of errors raised outside a model, and the YAML loader -----------------------------

@contextmanager
def within(prefix: str) -> Iterator[None]:
    """Errors raised inside get `prefix.` in front of their key path."""
    try:
        yield
    except SpecError as exc:
        message = str(exc)
        raise SpecError(f"{prefix}{'' if message.startswith('[') else '.'}{message}") from None


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last; a key
    a merge (`<<: *anchor`) brings may be given again, and the mapping's own wins)."""


MAX_YAML_VALUES = 100_000   # the values a file's aliases may add by repeating what they name
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """An integer, unless YAML 1.1 reads it as something its writer hardly meant: `010` as octal 8, `1:30`
    as 90 (base 60); refused, naming the line (YAML 1.2 reads both otherwise)."""
    digits = node.value.replace("_", "").lstrip("+-")
    if ":" in digits or (len(digits) > 1 and digits[0] == "0" and digits[1].isdigit()):
        raise yaml.constructor.ConstructorError(   # the value is not repeated: it may be a key (line and caret say)
            None, None, f"this number reads as YAML 1.1's {'octal' if ':' not in digits else 'base 60'} number: "
            "write it without the leading zero (or colon), or quote it", node.start_mark)
    return _constructed(loader.construct_yaml_int, node, "an integer")


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    """A float, unless YAML 1.1 reads it in base 60 (`1:30.0` as 90.0): refused as `_construct_int` does."""
    if ":" in node.value:
        raise yaml.constructor.ConstructorError(
            None, None, "this number reads as YAML 1.1's base 60 number: write it without the colon, or quote it",
            node.start_mark)
    return _constructed(loader.construct_yaml_float, node, "a number")


def _constructed(construct: Any, node: yaml.ScalarNode, what: str) -> Any:
    """PyYAML's own reading of a number, whose odd inputs (`!!int ""`, `0x_`) raise Python's errors unmarked:
    as a YAML error at the node."""
    try:
        return construct(node)
    except (ValueError, IndexError):
        raise yaml.constructor.ConstructorError(None, None, f"not {what}", node.start_mark) from None


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


_IN_PROGRESS = -1


def _expanded_values(node: yaml.Node, memo: dict[int, int], source: str) -> int:
    """The values `node` stands for once every alias is written out (a node met again through an alias
    counts its whole size again; memoized, so a chain of aliases costs its nodes, not its expansion).
    When that is more than MAX_YAML_VALUES above the distinct nodes met so far, the aliases repeat too
    much: a SpecError before anything expands them ("billion laughs"). So is a node inside itself."""
    if (known := memo.get(id(node))) is not None:
        if known == _IN_PROGRESS:
            raise SpecError(f"{source}: a YAML alias at line {node.start_mark.line + 1} names a value that "
                            "contains it (a recursive alias)")
        return known
    memo[id(node)] = _IN_PROGRESS
    children = (node.value if isinstance(node, yaml.SequenceNode) else
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else ())
    total = 1 + sum(_expanded_values(child, memo, source) for child in children)
    if total - len(memo) > MAX_YAML_VALUES:
        raise SpecError(f"{source}: YAML aliases expand to more than {MAX_YAML_VALUES:,} values beyond what the "
                        f"file writes (line {node.start_mark.line + 1}); write the repeated part out, or alias it "
                        "fewer times")
    memo[id(node)] = total
    return total


def load_yaml(text: str, source: str) -> Any:
    """YAML text -> Python data; a syntax error is a SpecError with `source`, the line, the column and a caret
    under the line with its values masked (`masked_line`). Aliases may not expand past MAX_YAML_VALUES values,
    nor nesting go past Python's recursion limit."""
    try:
        loader = _Loader(text)   # reads every character first: a control character is refused here
    except yaml.reader.ReaderError as exc:
        raise SpecError(f"{source}: YAML error at line {text.count(chr(10), 0, exc.position) + 1}: character "
                        f"#x{exc.character:04x} is not allowed in YAML text (a control character)") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_values(node, {}, source)
        return loader.construct_document(node)
    except RecursionError:
        raise SpecError(f"{source}: YAML nested too deep (hundreds of levels); a configuration file is flat") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if mark is None:
            raise SpecError(f"{source}: YAML error: {problem}") from None
        lines = text.splitlines()
        snippet = masked_line(lines[mark.line]) if mark.line < len(lines) else ""
        raise SpecError(f"{source}: YAML error at line {mark.line + 1}, column {mark.column + 1}: {problem}\n"
                        f"    {snippet}\n    {' ' * mark.column}^") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: YAML error: {exc}") from None
    finally:
        loader.dispose()


_WORD = re.compile(r"[^\s\[\]{}:,\"'#&*!|>\-]+(?P<key>\s*:(?=[\s,\]}]|$))?")


def masked_line(line: str) -> str:
    """A YAML line as an error quotes it: its keys (a word before `: `) and YAML's punctuation as written, every
    other character as `*` (a value may be an API key), so a caret under it still points where the error is."""
    return _WORD.sub(lambda m: m.group() if m.group("key") is not None else "*" * len(m.group()), line)


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
