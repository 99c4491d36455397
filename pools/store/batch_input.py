"""What a client sends the Batch API, checked before anything is stored: a batch input file's JSONL
lines (`parse_batch_input`), the batch's endpoint, window and metadata.

A line that is not JSON, lacks `custom_id` / `method` / `url` / `body`, has a `custom_id` that is not
a non-empty string of valid Unicode, has another method or url than the batch's endpoint, repeats a
`custom_id`, or is longer than MAX_BATCH_LINE_BYTES becomes a per-line error for the batch's error
file; the batch itself never fails for it. A file of no request line or more than MAX_BATCH_LINES is
refused whole, counted before any line is parsed. Every string that reaches SQLite as it is (a
`custom_id`, a filename) is valid Unicode: JSON may carry a lone UTF-16 surrogate, which SQLite cannot
store. Stdlib only.
"""

from __future__ import annotations

import itertools
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")   # what a line may be sent to
WINDOW_SECONDS = {"24h": 24 * 3600}                              # a batch expires so long after it was created
COMPLETION_WINDOWS = tuple(WINDOW_SECONDS)                        # OpenAI's only window
FILE_PURPOSES = ("batch",)                                       # what an upload may be for
MAX_BATCH_LINES = 50_000                                         # request lines per batch, as OpenAI
MAX_BATCH_LINE_BYTES = 1 << 20          # one line of an input file (1 MiB); a longer one is that line's error
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_FILENAME_CHARS = 255                # an upload's filename as stored; a longer one is cut
# An expiration policy (`expires_after` of an upload, `output_expires_after` of a batch), as OpenAI's: from the
# file's creation, 1 hour to 30 days; an upload for a batch without one expires after 30 days (OpenAI's default)
EXPIRES_AFTER_SECONDS = (3600, 30 * 86400)
DEFAULT_BATCH_FILE_SECONDS = 30 * 86400
DEFAULT_FILENAME = "upload.jsonl"       # the filename of an upload that gives none
_REQUEST_LINE = re.compile(rb"[^ \t\n\r\x0b\x0c][^\n]*")   # a non-blank line from its first non-blank byte
_INK = re.compile(rb"[^ \t\n\r\x0b\x0c]")                   # a byte that is not blank


class BatchInputError(ValueError):
    """A batch or file request the store refuses; the message starts with the field (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class TooManyBatches(Exception):
    """`create_batch` refused: the owner has `unfinished` batches the runner still owes work, `limit` allowed."""

    def __init__(self, unfinished: int, limit: int) -> None:
        super().__init__(f"{unfinished} unfinished batches, at most {limit}")
        self.unfinished, self.limit = unfinished, limit


@dataclass(frozen=True)
class BatchLine:
    """One line of a batch input file. `error` ({"code", "message", "line"}) when the line is unusable;
    then `method`, `url` and `body` are None and `custom_id` is whatever string the line carried."""

    line_no: int                    # 1-based line of the input file
    custom_id: str | None
    method: str | None = None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    sent: bool = False              # a run before this one sent it to an upstream pool (`BatchStore.mark_sent`)


def parse_batch_input(content: bytes, endpoint: str, file_id: str = "input") -> list[BatchLine]:
    """Every non-blank line of the JSONL input file `content`, checked for the batch's `endpoint`
    (`batch_input_lines`, the file in one piece)."""
    return list(batch_input_lines(lambda: (content,), endpoint, file_id))


def batch_input_lines(read: Callable[[], Iterable[bytes]], endpoint: str,
                      file_id: str = "input") -> Iterator[BatchLine]:
    """Every non-blank line of a JSONL input file, checked for the batch's `endpoint`, one at a time: `read()`
    gives the file's bytes a piece at a time (any sizes), and is called twice, to count, then to parse. A
    `custom_id` belongs to the first line carrying it; later lines with it are `duplicate_custom_id` errors. A
    line longer than MAX_BATCH_LINE_BYTES is a `line_too_large` error, not parsed. BatchInputError naming
    `input_file_id` (the file `file_id`), raised by this call, when the file has no request line or more than
    MAX_BATCH_LINES: counted first, up to one past the limit, so a file of millions of short lines is
    refused after a count of MAX_BATCH_LINES + 1, before any line is parsed. What is held at once is a
    piece and a line (the first MAX_BATCH_LINE_BYTES + 1 bytes of a longer one), whatever the file's size."""
    num_lines = sum(1 for _ in itertools.islice(_file_lines(read()), MAX_BATCH_LINES + 1))
    if not num_lines:
        raise BatchInputError("input_file_id", f"file {file_id!r} has no request lines")
    if num_lines > MAX_BATCH_LINES:
        raise BatchInputError("input_file_id", f"file {file_id!r} has more than {MAX_BATCH_LINES} request lines; "
                              f"a batch takes at most {MAX_BATCH_LINES}")
    return _checked_lines(_file_lines(read()), endpoint)


def _checked_lines(lines: Iterator[tuple[int, bytes | None, int]], endpoint: str) -> Iterator[BatchLine]:
    seen: set[str] = set()
    for line_no, raw, length in lines:
        if raw is None:
            yield _bad(line_no, None, "line_too_large", f"line {line_no}: {length} bytes; a request line may "
                       f"have at most {MAX_BATCH_LINE_BYTES} bytes")
            continue
        line = _parse_line(line_no, raw, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen and line.error is None:
                line = _bad(line_no, line.custom_id, "duplicate_custom_id",
                            f"custom_id: {line.custom_id!r} was used by an earlier line")
            seen.add(line.custom_id)
        yield line


def _file_lines(pieces: Iterable[bytes]) -> Iterator[tuple[int, bytes | None, int]]:
    """(1-based line number, its bytes, its length) of each non-blank line of the file `pieces` make one after
    the other; the bytes are None for a line longer than MAX_BATCH_LINE_BYTES, of which only the first
    MAX_BATCH_LINE_BYTES + 1 are ever held (`_Unfinished`)."""
    line_no, line = 1, _Unfinished()      # the line whose start is read and whose end is not, numbered line_no
    for piece in pieces:
        cut = piece.rfind(b"\n") + 1
        if not cut:                        # the line goes on past this piece
            line.extend(piece)
            continue
        if line.skipped:                   # a line past the bound ends in this piece: only its length is kept
            first = piece.find(b"\n")
            if line.inked or _INK.search(line.head) or _INK.search(piece, 0, first):
                yield line_no, None, len(line.head) + line.skipped + first
            line_no, segment = line_no + 1, piece[first + 1:cut]
        else:
            segment = bytes(line.head) + piece[:cut]
        yield from _request_lines(segment, line_no)
        line_no += segment.count(b"\n")
        line = _Unfinished()
        line.extend(piece[cut:])
    if line.skipped:
        if line.inked or _INK.search(line.head):
            yield line_no, None, len(line.head) + line.skipped
    elif line.head:
        yield from _request_lines(bytes(line.head), line_no)


class _Unfinished:
    """The start of a line whose end is not read yet: its first MAX_BATCH_LINE_BYTES + 1 bytes (`head`), how many
    more there were (`skipped`) and whether any of those is not blank (`inked`)."""

    def __init__(self) -> None:
        self.head, self.skipped, self.inked = bytearray(), 0, False

    def extend(self, data: bytes) -> None:
        room = max(0, MAX_BATCH_LINE_BYTES + 1 - len(self.head))
        self.head += data[:room]
        if rest := data[room:]:
            self.skipped += len(rest)
            self.inked = self.inked or _INK.search(rest) is not None


def _request_lines(content: bytes, first_line_no: int = 1) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, its bytes or None past MAX_BATCH_LINE_BYTES, its length) of each non-blank line of `content`
    (blank: what `bytes.strip` removes), its first line numbered `first_line_no`; the regex engine, not Python,
    walks over the blank ones."""
    line_no, counted_to = first_line_no, 0
    for match in _REQUEST_LINE.finditer(content):
        line_no += content.count(b"\n", counted_to, match.start())
        counted_to = match.start()
        start, end = content.rfind(b"\n", 0, counted_to) + 1, match.end()
        yield line_no, None if end - start > MAX_BATCH_LINE_BYTES else content[start:end], end - start


def _parse_line(line_no: int, raw: bytes, endpoint: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # not UTF-8, malformed, an integer over the digit limit
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: expected a JSON object, "
                    f"got {type(obj).__name__}")
    custom_id = obj.get("custom_id") if is_text(obj.get("custom_id")) else None
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            return _bad(line_no, custom_id, "missing_required_parameter", f"{key}: missing")
    if not custom_id:
        return _bad(line_no, None, "invalid_custom_id", f"custom_id: must be a non-empty string of valid Unicode "
                    f"(no lone surrogate), got {obj['custom_id']!r}")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _bad(line_no, custom_id, "invalid_request", f"{unknown[0]}: unknown field of a request line")
    if obj["method"] != "POST":
        return _bad(line_no, custom_id, "invalid_method", f"method: must be 'POST', got {obj['method']!r}")
    if obj["url"] != endpoint:
        return _bad(line_no, custom_id, "invalid_url", f"url: must be the batch's endpoint {endpoint!r}, "
                    f"got {obj['url']!r}")
    if not isinstance(obj["body"], dict):
        return _bad(line_no, custom_id, "invalid_body", f"body: must be a JSON object, got "
                    f"{type(obj['body']).__name__}")
    return BatchLine(line_no, custom_id, "POST", endpoint, obj["body"])


def _bad(line_no: int, custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(line_no, custom_id, error={"code": code, "message": message, "line": line_no})


def check_batch_arguments(endpoint: Any, completion_window: Any, metadata: Any) -> None:
    """BatchInputError naming the field when a batch's `endpoint`, `completion_window` or `metadata` is not one
    we take."""
    if endpoint not in BATCH_ENDPOINTS:
        raise BatchInputError("endpoint", f"must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}")
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchInputError("completion_window", f"must be {' or '.join(map(repr, COMPLETION_WINDOWS))}, "
                              f"got {completion_window!r}")
    check_metadata(metadata)


def check_metadata(metadata: Any) -> None:
    """OpenAI's metadata rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise BatchInputError("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} string values")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise BatchInputError(f"metadata.{key}", f"keys are at most {MAX_METADATA_KEY} characters and values "
                                  f"strings of at most {MAX_METADATA_VALUE}")


def check_expires_after(policy: Any, field: str) -> int | None:
    """The seconds of OpenAI's expiration policy `{"anchor": "created_at", "seconds": n}` (None: no policy);
    BatchInputError naming `field`.anchor or `field`.seconds (n in EXPIRES_AFTER_SECONDS, an integer)."""
    if policy is None:
        return None
    if not isinstance(policy, dict) or set(policy) != {"anchor", "seconds"}:
        raise BatchInputError(field, "must be an object with exactly 'anchor' and 'seconds'")
    if policy["anchor"] != "created_at":
        raise BatchInputError(f"{field}.anchor", f"must be 'created_at', got {policy['anchor']!r}")
    seconds, (low, high) = policy["seconds"], EXPIRES_AFTER_SECONDS
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not low <= seconds <= high:
        raise BatchInputError(f"{field}.seconds", f"must be an integer in {low}..{high}, got {seconds!r}")
    return seconds


def is_text(value: Any) -> bool:
    """`value` is a string SQLite can store: one with no lone UTF-16 surrogate (JSON's `"\\ud800"`)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def clean_filename(filename: str | None) -> str:
    """An upload's filename as stored: a lone surrogate (a byte of the header that was not UTF-8) as
    U+FFFD, control characters (NUL, escapes, DEL...) dropped, at most MAX_FILENAME_CHARS characters;
    DEFAULT_FILENAME when that leaves nothing."""
    kept = ("\ufffd" if unicodedata.category(c) == "Cs" else c for c in filename or ""
            if unicodedata.category(c) != "Cc")
    return "".join(itertools.islice(kept, MAX_FILENAME_CHARS)) or DEFAULT_FILENAME
