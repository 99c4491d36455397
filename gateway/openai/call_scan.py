"""A call object read as a stream's reply grows (`scan_call`, `CallScanner`): how far its name, its arguments and
the object itself have been written, each delta read from where the last one stopped (`gateway.openai.tools`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.openai.errors import nested_over


def loads(text: str) -> Any:
    """`text` as JSON; None for what is not (malformed, an integer over Python's digit limit) or is nested
    over `MAX_JSON_DEPTH` (a chat template's `tojson` would recurse out on it)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return None if nested_over(value) else value


@dataclass
class CallScan:
    """How far the call object starting at `start` has been written: its name once complete, where its
    arguments object starts and ends (ends: once closed), and where the call object ends. A format whose
    arguments are JSON of its own (`gateway.openai.xml_tools`) gives their text so far, `args_text`, instead."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    start: int = 0        # where the call object's `{` is
    args_text: str | None = None


def scan_call(text: str, start: int, args_keys: tuple[str, ...],
              scanners: dict[int, CallScanner] | None = None) -> CallScan:
    """Read the (maybe unfinished) call object `text[start:]` (`text[start]` is its `{`): `CallScanner`. With
    `scanners` (a stream's, by where each call starts), a call read before is read on from where it stopped."""
    if scanners is None:
        return CallScanner(start, args_keys).read(text)
    if (scanner := scanners.get(start)) is None:
        scanner = scanners[start] = CallScanner(start, args_keys)
    return scanner.read(text)


class CallScanner:
    """A call object read character by character as the reply grows (the reply only grows): strings with their
    escapes, nesting, the top level's keys and values; the arguments are the first object under one of
    `args_keys`, the name the first string under "name". Each `read` goes on from where the last one stopped,
    so a call streamed a few characters at a time is read once, not again from its start at every delta."""

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.scan, self.args_keys = CallScan(start=start), args_keys
        self.pos, self.depth, self.key, self.in_value, self.string_at, self.escaped = start, 0, None, False, -1, False

    def read(self, text: str) -> CallScan:
        scan = self.scan
        if scan.end is not None:
            return scan
        depth, key, in_value, string_at, escaped = self.depth, self.key, self.in_value, self.string_at, self.escaped
        for i in range(self.pos, len(text)):
            ch = text[i]
            if string_at >= 0:                       # inside a string
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    if depth == 1:
                        value = loads(text[string_at:i + 1])
                        if not in_value:
                            key = value
                        elif key == "name" and isinstance(value, str) and scan.name is None:
                            scan.name = value
                    string_at = -1
                continue
            if ch == '"':
                string_at = i
            elif ch == ":" and depth == 1:
                in_value = True
            elif ch == "," and depth == 1:
                in_value = False
            elif ch in "{[":
                if depth == 1 and in_value and key in self.args_keys and ch == "{" and scan.args_start is None:
                    scan.args_start = i
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 1 and scan.args_start is not None and scan.args_end is None:
                    scan.args_end = i + 1
                if depth == 0:
                    scan.end = i + 1
                    break
        self.pos = max(self.pos, len(text)) if scan.end is None else scan.end
        self.depth, self.key, self.in_value, self.string_at, self.escaped = depth, key, in_value, string_at, escaped
        return scan


class TagSearch:
    """Where a tag first occurs at or after a place of a reply that only grows (a stream's so far, or a whole
    one), each tag's last search kept: a search from a place between where the last one began and what it found
    answers at once, and one that found nothing goes on from where the text it searched ended. A reply's deltas
    cost what they add, and markers read inside a span searched before cost nothing more."""

    def __init__(self) -> None:
        self._found: dict[str, tuple[int, int, int]] = {}   # tag -> (searched from, first place or -1, text length)

    def find(self, text: str, tag: str, pos: int) -> int:
        """The first place of `tag` in `text` at or after `pos` (-1: none)."""
        known = self._found.get(tag)
        if known is not None and known[0] <= pos <= known[1]:
            return known[1]
        start = max(pos, known[2] - len(tag) + 1) if known is not None and known[1] < 0 and known[0] <= pos else pos
        found = text.find(tag, start)
        self._found[tag] = (pos, found, len(text))
        return found
