"""Gemma 4's tool calls (vLLM's `gemma4` parser): each call between special tokens, its arguments in a notation of
Gemma's own rather than JSON:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{metric:true},tags:[<|"|>a<|"|>]}<tool_call|>

Keys bare (or between the string marks), strings between `<|"|>` marks (a comma, brace or colon inside one is its
text), numbers, `true`, `false` and `null` bare, objects in braces and lists in brackets; several calls one after
another. A template writes this form when it names `<|tool_call>` (`writes_gemma4_calls`). The markers and the
string marks are special tokens: a reply that may call is decoded with them (`ToolFormat.markers_skipped`).

**Reading** (`read_call`): a call is its marker, `call:`, a name (letters, digits, `_`, `-`, `.`), one object and
the closing marker; a call of a function not offered, or one that does not read, is content. A call's `arguments`
are the JSON of what was read (a bare value neither a number nor a literal is its text, as vLLM reads it). A stream
sends a call's name once its object begins and its arguments when it closes; a reply cut by max_tokens inside a
call ends in that call, its arguments as far as they read.

**Writing** (`Gemma4Format.body`, the grammars of forced and strict calls, `_NotationRules`): `call:NAME` and its
arguments in the notation under the function's schema: its declared properties in the schema's order, the required
ones always (in any order where none is), others of any other name after them unless `additionalProperties` is
false; a string between the marks (one
of its `enum` where it has one), numbers, literals, objects and lists as their schemas say, a local `$ref` as what
it names (a recursive schema by a rule naming itself), `allOf`'s parts as one schema; what it does not read (a
pattern, a length) any value, leniently, as the JSON formats' grammars.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from gateway.openai.call_scan import CallScan
from gateway.openai.reasoning import partial_tag
from gateway.openai.tool_grammar import ANY_OBJECT, CallSyntax, literal, regex_text
from gateway.openai.tools import ToolCall, ToolFormat, beside_calls
from gateway.openai.xml_values import resolved

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"call:([\w\-.]+)\{")
_NAME_SO_FAR = re.compile(r"(c(a(l(l(:[\w\-.]*)?)?)?)?)?")   # what may still become `call:NAME{`
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class _Unread(Exception):
    """The text does not read as a value (`cut`: it ended before the value did)."""

    def __init__(self, cut: bool = False) -> None:
        super().__init__()
        self.cut = cut


def writes_gemma4_calls(template: str) -> bool:
    """Whether a chat template writes its calls in Gemma 4's form (its call marker)."""
    return START in template


def read_call(text: str, pos: int) -> tuple[str | None, dict[str, Any] | None, int | None, bool]:
    """The call whose marker is at `text[pos]`: (its name, or None until `{` follows it; its arguments, or None until
    they read; where the call ends past its closing marker, or None; whether, not closed, it may still become a call
    as the reply grows: it ran out, rather than reading as no call)."""
    found = _NAME.match(text, pos + len(START))
    if found is None:
        return None, None, None, _NAME_SO_FAR.fullmatch(text, pos + len(START)) is not None
    try:
        arguments, end = _object(text, found.end() - 1)
    except _Unread as unread:
        return found[1], None, None, unread.cut
    if text.startswith(END, end):
        return found[1], arguments, end + len(END), False
    return found[1], arguments, None, END.startswith(text[end:])   # its closing marker may be on its way


def _object(text: str, pos: int, out: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """The object whose `{` is at `text[pos]` (its items put in `out`, as far as they read) and where it ends."""
    out = {} if out is None else out

    def item(pos: int) -> int:
        key, pos = _key(text, pos)
        value, pos = _value(text, _blanks(text, pos + 1))
        out.setdefault(key, value)   # the first of a key, as the other formats keep it
        return pos

    return out, _items(text, pos, "}", item)


def _array(text: str, pos: int) -> tuple[list[Any], int]:
    out: list[Any] = []

    def item(pos: int) -> int:
        value, pos = _value(text, pos)
        out.append(value)
        return pos

    return out, _items(text, pos, "]", item)


def _items(text: str, pos: int, close: str, item: Callable[[int], int]) -> int:
    """Past the bracketed items at `text[pos]` (each read by `item`, from its place to its end), comma-separated."""
    pos += 1
    while True:
        pos = _blanks(text, pos)
        if text.startswith(close, pos):
            return pos + 1
        pos = _after_item(text, item(pos), close)


def _key(text: str, pos: int) -> tuple[str, int]:
    """A key (bare, or between string marks) and where its `:` is."""
    if text.startswith(QUOTE, pos):
        key, pos = _string(text, pos)
        pos = _blanks(text, pos)
    else:
        colon = text.find(":", pos)
        if colon < 0:
            raise _Unread(cut=True)
        key, pos = text[pos:colon].strip(), colon
    if not text.startswith(":", pos) or not key:
        raise _Unread(cut=pos >= len(text))
    return key, pos


def _value(text: str, pos: int) -> tuple[Any, int]:
    if pos >= len(text):
        raise _Unread(cut=True)
    if text.startswith(QUOTE, pos):
        return _string(text, pos)
    if text[pos] == "{":
        return _object(text, pos)
    if text[pos] == "[":
        return _array(text, pos)
    end = pos
    while end < len(text) and text[end] not in ",}]":
        end += 1
    if end >= len(text):
        raise _Unread(cut=True)   # a bare value may go on
    word = text[pos:end].strip()
    if not word or QUOTE in word:
        raise _Unread()
    if word in _LITERALS:
        return _LITERALS[word], end
    return (json.loads(word) if _NUMBER.fullmatch(word) else word), end


def _string(text: str, pos: int) -> tuple[str, int]:
    end = text.find(QUOTE, pos + len(QUOTE))
    if end < 0:
        raise _Unread(cut=True)
    return text[pos + len(QUOTE):end], end + len(QUOTE)


def _after_item(text: str, pos: int, close: str) -> int:
    """Past an item's comma (the next item's place), or at the closing bracket."""
    pos = _blanks(text, pos)
    if pos >= len(text):
        raise _Unread(cut=True)
    if text[pos] == ",":
        return pos + 1
    if text[pos] != close:
        raise _Unread()
    return pos


def _blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _cut_arguments(text: str, pos: int) -> dict[str, Any]:
    """The arguments of a call cut inside its object, as far as whole items read (the object at `text[pos]`)."""
    out: dict[str, Any] = {}
    try:
        _object(text, pos, out)
    except _Unread:
        pass
    return out


class Gemma4Format(ToolFormat):
    """Gemma 4's calls (the module's notes)."""

    name = "gemma4"
    start = START
    markers = (START, END, QUOTE)
    syntax = CallSyntax(START, END, "", "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{re.escape(START)}(?s:.)*/")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self._read(text)[:2]

    def _read(self, text: str) -> tuple[str | None, list[ToolCall], int | None]:
        """`parse`, and where a call still open at the reply's end begins (None: none is; its text is content)."""
        calls, kept, last, pos = [], [], 0, 0
        while (found := text.find(START, pos)) >= 0:
            name, arguments, end, going_on = read_call(text, found)
            if end is None and going_on:
                return self._content(text, kept, last, calls), calls, found
            pos = found + len(START)
            if end is None or name not in self.tools:
                continue   # prose, or a function not offered: content
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False), start=found))
            kept.append(text[last:found])
            last = pos = end
        return self._content(text, kept, last, calls), calls, None

    @staticmethod
    def _content(text: str, kept: list[str], last: int, calls: list[ToolCall]) -> str | None:
        return beside_calls("".join(kept) + text[last:]) if calls else text

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside a call of a function offered ends in that call, its arguments as
        far as whole items read (`ToolCall.cut`); one cut before its object began is dropped (a stream held it)."""
        content, calls, begin = self._read(text)
        if not cut or begin is None:
            return content, calls
        content = self._read(text[:begin])[0]
        found = _NAME.match(text, begin + len(START))
        if found is not None and found[1] in self.tools:
            arguments = json.dumps(_cut_arguments(text, found.end() - 1), ensure_ascii=False)
            calls = [*calls, ToolCall(found[1], arguments, cut=True, start=begin)]
        return (beside_calls(content or "") if calls else content), calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, Any] | None = None) -> Iterator[CallScan]:
        """Each call from `pos`: its name once its object begins, its arguments' JSON once it closes (`_look`)."""
        while (found := text.find(START, pos)) >= 0:
            name, arguments, end, going_on = self._look(text, found, scanners)
            if end is None and not going_on:
                pos = found + len(START)   # a marker in prose
                continue
            if name is None:
                return   # a call may be starting
            yield CallScan(name=name, args_start=0, start=found, end=end,
                           args_text="" if end is None else json.dumps(arguments, ensure_ascii=False))
            if end is None:
                return
            pos = end

    def hold_from(self, text: str, pos: int = 0, scanners: dict[int, Any] | None = None) -> int:
        while (found := text.find(START, pos)) >= 0:
            _, _, end, going_on = self._look(text, found, scanners)
            if end is not None or going_on:
                return found
            pos = found + len(START)
        return len(text) - partial_tag(text, START)

    @staticmethod
    def _look(text: str, found: int, scanners: dict[int, Any] | None) -> tuple[str | None, Any, int | None, bool]:
        """`read_call` as a stream's reply grows (`scanners`: key -1 how far each call was searched for a closing
        marker, -2 each closed call): a call is read once a closing marker follows it (before, it is open: its name
        alone read), and a closed one never again, so a delta costs what it adds."""
        if scanners is None:
            return read_call(text, found)
        closed = scanners.setdefault(-2, {})
        if found in closed:
            return closed[found]
        searched = scanners.setdefault(-1, {})
        if text.find(END, max(found + len(START), searched.get(found, 0) - len(END))) < 0:
            searched[found] = len(text)
            named = _NAME.match(text, found + len(START))
            if named is None:
                return None, None, None, _NAME_SO_FAR.fullmatch(text, found + len(START)) is not None
            return named[1], None, None, True
        look = read_call(text, found)
        if look[2] is not None or not look[3]:
            closed[found] = look   # closed, or no call: the reply only grows
        else:
            searched[found] = len(text)   # it ran out: the marker that closes it is past the text so far
        return look

    def example(self) -> str:
        return f"{START}call:<function name>{{<argument>:{QUOTE}<text>{QUOTE},<argument>:<number>}}{END}"

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        """`call:NAME` and the function's arguments in the notation, under its schema (`_NotationRules`)."""
        rules, calls = _NotationRules(), []
        for name, schema in functions:
            rules.root = schema if schema else ANY_OBJECT   # what its `$ref`s point into
            calls.append(f"{literal(f'call:{name}')} {rules.value(rules.root)}")
        return f"body: {' | '.join(calls)}\n{rules.text()}"


class _NotationRules:
    """Lark rules of values in Gemma 4's notation under a JSON schema: a string between the marks (one of its
    `enum` or its `const` where it has one), an integer, a number, `true` / `false`, `null`; an object's declared
    properties in the schema's order, the required ones always (in any order where none is), others of any other
    name after them unless `additionalProperties` is false; a list's items under `items`; `anyOf` / `oneOf` / a list
    of types as alternatives; a local `$ref` into `root` (the function's arguments schema) as what it names, each
    one rule (a recursive schema's names itself); `allOf` as its parts joined (`_all_of`). What it does not read (a
    remote `$ref`, a pattern or a length) takes any value (lenient, as the JSON formats' grammars)."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.root: dict[str, Any] = {}
        self._refs: dict[tuple[int, str], str] = {}   # (root, `$ref`) -> its rule

    def text(self) -> str:
        return "\n".join([*self.rules, *_ANY_RULES]) + "\n"

    def value(self, schema: Any) -> str:
        """The rule (an expression) of a value under `schema`."""
        if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
            return self._ref(schema["$ref"])
        if isinstance(schema, dict) and isinstance(schema.get("allOf"), list) and schema["allOf"]:
            return self.value(_all_of(schema, self.root))
        if not isinstance(schema, dict):
            return "gany"
        for key in ("enum", "const"):
            if key in schema:
                values = schema[key] if key == "enum" and isinstance(schema[key], list) else [schema[key]]
                return "(" + " | ".join(literal(_written(v)) for v in values) + ")" if values else "gany"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value(s) for s in schema[key]) + ")"
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
        if not kinds:
            return self._object(schema) if "properties" in schema else "gany"
        return "(" + " | ".join(self._typed(kind, schema) for kind in kinds) + ")"

    def _typed(self, kind: Any, schema: dict[str, Any]) -> str:
        simple = {"string": "GSTR", "integer": r"/-?(0|[1-9][0-9]*)/", "number": "GNUM",
                  "boolean": '("true" | "false")', "null": '"null"'}
        if kind in simple:
            return simple[kind]
        if kind == "array":
            item = self.value(schema.get("items", {}))
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        return self._object(schema) if kind == "object" else "gany"

    def _object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in properties if k in (schema.get("required") or [])]
        items = [(f"{literal(_written_key(k))} \":\" {self.value(v)}", k in required)
                 for k, v in properties.items()]
        extra = 'gkey ":" gany'
        if schema.get("additionalProperties") is False:
            extra = ""
        elif properties:   # others of any name but the declared ones'
            names = "|".join(regex_text(_written_key(k)) for k in properties)
            extra = self._rule(rf'/[A-Za-z_][A-Za-z0-9_\-.]*/ & ~/({names})/', terminal=True) + ' ":" gany'
        if not required:   # any of them, in any order (and others where allowed)
            choices = [item for item, _ in items] + ([extra] if extra else [])
            if not choices:
                return self._rule('"{" "}"')
            one = self._rule(" | ".join(choices))
            return self._rule(f'"{{" ({one} ("," {one})*)? "}}"')
        first = required[0]
        parts = []
        for (item, needed), key in zip(items, properties):
            before = list(properties).index(key) < list(properties).index(first)
            parts.append(item if key == first else f'({item} ",")?' if before else
                         f'"," {item}' if needed else f'("," {item})?')
        more = f' ("," {extra})*' if extra else ""
        return self._rule(f'"{{" {" ".join(parts)}{more} "}}"')

    def _ref(self, ref: str) -> str:
        """The rule of what a local `$ref` names in `root` ("#", "#/$defs/X", a JSON pointer), made once: its place is
        taken before its body is made, so a schema that names itself is that rule; any value where it names none."""
        key = (id(self.root), ref)
        if key not in self._refs:
            target = self.root if ref == "#" else resolved({"$ref": ref}, self.root)
            if not target:
                return "gany"
            name = self._refs[key] = f"g{len(self.rules)}"
            self.rules.append("")
            self.rules[int(name[1:])] = f"{name}: {self.value(target)}"
        return self._refs[key]

    def _rule(self, body: str, terminal: bool = False) -> str:
        """A new rule (a lexeme, `terminal`) of `body`, by its name."""
        name = f"{'GK' if terminal else 'g'}{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name


# any value in the notation: strings between the marks, numbers, literals, objects of bare or marked keys, lists
# (a string is one lexeme with its marks: a lexeme of its text alone would take the closing mark's first characters
# as text before the mark could be told from them)
_ANY_RULES = ('gany: GSTR | GNUM | "true" | "false" | "null" | gobj | garr',
              f'GSTR: {literal(QUOTE)} GTEXT {literal(QUOTE)}',
              rf'GTEXT: /(?s:.)*/ & ~/(?s:.)*{regex_text(QUOTE)}(?s:.)*/',
              'gobj: "{" (gkey ":" gany ("," gkey ":" gany)*)? "}"',
              r'gkey: /[A-Za-z_][A-Za-z0-9_\-.]*/ | GSTR',
              'garr: "[" (gany ("," gany)*)? "]"',
              r"GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/")


def _all_of(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """`allOf`'s parts (each `$ref` followed) and the schema's own keys as one schema: their properties and required
    keys joined, any other key's first value kept (`additionalProperties` a part's own only where it is the one part
    with properties: each part's speaks of its own); a part's own `allOf` not followed."""
    parts = [resolved(part, root) for part in schema["allOf"]]
    parts = [part for part in parts if isinstance(part, dict)] + [{k: v for k, v in schema.items() if k != "allOf"}]
    with_properties = sum(isinstance(part.get("properties"), dict) for part in parts[:-1])
    merged: dict[str, Any] = {}
    for index, part in enumerate(parts):
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            elif key != "allOf" and (key != "additionalProperties" or index == len(parts) - 1 or with_properties < 2):
                merged.setdefault(key, value)
    return merged


def _written_key(key: str) -> str:
    """A property's name as the notation writes it: bare, or between the marks where it would not read back."""
    return key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-.]*", key) else f"{QUOTE}{key}{QUOTE}"


def _written(value: Any) -> str:
    """An `enum` / `const` value in the notation."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_written_key(k)}:{_written(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_written(v) for v in value) + "]"
    return json.dumps(value)
