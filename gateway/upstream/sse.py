"""Server-sent events as the SSE spec reads them (the relay's upstream streams): whole events out of a byte
stream (`split_events`, line ends `\n`, `\r\n` or `\r`), an event's fields (`event_fields`), its data's JSON
object, the event with new data, and whether an event the body ended inside is whole."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["event_fields", "json_object", "split_events", "whole", "with_data"]


def _field(line: bytes) -> tuple[bytes, bytes]:
    """An SSE line's field name and value. The SSE spec: the value follows the first colon, less one space
    if one follows it (`data:x` is `data: x`); a line without a colon is a field with an empty value; a
    line that starts with a colon is a comment (the name is empty)."""
    name, _, value = line.partition(b":")
    return name, value[1:] if value.startswith(b" ") else value


def event_fields(event: bytes) -> tuple[str, bytes | None]:
    """An event's type (its `event:` field, "" without one) and data (its `data:` lines joined by a line
    break, None without one)."""
    kind, data = b"", None
    for line in event.split(b"\n"):
        name, value = _field(line)
        if name == b"event":
            kind = value
        elif name == b"data":
            data = value if data is None else data + b"\n" + value
    return kind.decode("latin-1"), data


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """`data` decoded when it is a JSON object, else None (text, `[DONE]`, JSON that is invalid or nested
    past the decoder's depth: relayed as it is)."""
    if not data or data[:1] != b"{":
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def with_data(event: bytes, data: bytes) -> bytes:
    """`event` with its `data:` lines made one, `data: <data>`, where the first was; its other lines kept."""
    lines, put = [], False
    for line in event.split(b"\n"):
        if _field(line)[0] != b"data":
            lines.append(line)
        elif not put:
            lines.append(b"data: " + data)
            put = True
    return b"\n".join(lines)


def whole(event: bytes) -> bool:
    """Whether an event the body ended inside, with no blank line after it, is whole: its data `[DONE]` or
    a JSON object. The SSE spec drops such an event; a server that ends its last one with one line break is
    still read, but a cut one (`data: {"id": "c1", "choi`) is never relayed as if whole."""
    data = event_fields(event)[1]
    return data == b"[DONE]" or json_object(data) is not None


def split_events(tail: bytearray, data: bytes) -> list[bytes]:
    """Add `data` to `tail` (a stream's bytes not yet split) and take out the events it completed; only
    the new bytes are searched, so a long event costs its length once. Line ends are `\n`, `\r\n` or `\r`
    (the SSE grammar; sse-starlette sends `\r\n`), made `\n` as they come: a `\r` last in `data` is kept
    as it is until the next bytes tell whether a `\n` follows it."""
    if tail.endswith(b"\r"):
        del tail[-1:]
        data = data if data.startswith(b"\n") else b"\n" + data
    pending = data.endswith(b"\r")
    data = (data[:-1] if pending else data).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    start = max(len(tail) - 1, 0)   # a "\n\n" may straddle the old bytes and the new
    tail += data
    events, begin = [], 0
    while (end := tail.find(b"\n\n", start)) >= 0:
        events.append(bytes(tail[begin:end]))
        begin = start = end + 2
    del tail[:begin]
    if pending:
        tail += b"\r"
    return events
