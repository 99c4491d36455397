"""A sequence's output text as the engine builds it: appended a delta per step, read and cut at its end."""

from __future__ import annotations


class OutputText:
    """A sequence's output text, kept as the pieces each step appended: appending, reading the end and
    cutting the end cost what they touch, never the whole text (joined only when all of it is read,
    and then kept joined). Text before the cut point never changes, which is what lets a report hold
    this object and an end offset instead of a copy (`CompletionOutput`)."""

    __slots__ = ("_parts", "_len")

    def __init__(self, text: str = "") -> None:
        self._parts: list[str] = [text] if text else []
        self._len = len(text)

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return self.slice(0, self._len)

    def __iadd__(self, text: str) -> "OutputText":
        if text:
            self._parts.append(text)
            self._len += len(text)
        return self

    def slice(self, start: int, end: int) -> str:
        """The text's [start:end] (0 <= start, end <= len); reads the pieces from the end back to `start`."""
        end = min(end, self._len)
        if start >= end:
            return ""
        if start == 0 and len(self._parts) > 1:   # everything: join once, keep it joined
            self._parts[:] = ["".join(self._parts)]
        pieces, pos = [], self._len
        for part in reversed(self._parts):
            if pos <= start:
                break
            part_start = pos - len(part)
            if part_start < end:
                pieces.append(part[max(start - part_start, 0):end - part_start])
            pos = part_start
        return "".join(reversed(pieces))

    def find(self, sub: str, start: int) -> int:
        """The index of `sub`'s first occurrence at or after `start`, or -1 (reads only the text from `start`)."""
        index = self.slice(start, self._len).find(sub)
        return -1 if index < 0 else start + index

    def truncate(self, length: int) -> None:
        """Cut the text to its first `length` characters (pieces past them dropped, the last one cut)."""
        while self._parts and self._len - len(self._parts[-1]) >= length:
            self._len -= len(self._parts.pop())
        if self._len > length:
            last = self._parts.pop()
            self._parts.append(last[:len(last) - (self._len - length)])
            self._len = length
