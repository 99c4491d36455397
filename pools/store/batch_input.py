"""What a client sends the Batch API, checked before anything is stored: a batch input file's JSONL
lines (`parse_batch_input`), the batch's endpoint, window and metadata.

A line that is not JSON, lacks `custom_id` / `method` / `url` / `body`, has another method or url
than the batch's endpoint, repeats a `custom_id`, or is longer than MAX_BATCH_LINE_BYTES becomes a
per-line error for the batch's error file; the batch itself never fails for it. Stdlib only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")   # what a line may be sent to
COMPLETION_WINDOWS = ("24h",)                                    # OpenAI's only window; nothing expires
FILE_PURPOSES = ("batch",)                                       # what an upload may be for
MAX_BATCH_LINES = 50_000                                         # request lines per batch, as OpenAI
MAX_BATCH_LINE_BYTES = 1 << 20          # one line of an input file (1 MiB); a longer one is that line's error
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchInputError(ValueError):
    """A batch or file request the store refuses; the message starts with the field (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


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


def parse_batch_input(content: bytes, endpoint: str) -> list[BatchLine]:
    """Every non-blank line of a JSONL input file, checked for the batch's `endpoint`. A `custom_id`
    belongs to the first line carrying it; later lines with it are `duplicate_custom_id` errors. A
    line longer than MAX_BATCH_LINE_BYTES is a `line_too_large` error, not parsed."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for line_no, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_BATCH_LINE_BYTES:
            lines.append(_bad(line_no, None, "line_too_large", f"line {line_no}: {len(raw)} bytes; a request "
                              f"line may have at most {MAX_BATCH_LINE_BYTES} bytes"))
            continue
        line = _parse_line(line_no, raw, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen and line.error is None:
                line = _bad(line_no, line.custom_id, "duplicate_custom_id",
                            f"custom_id: {line.custom_id!r} was used by an earlier line")
            seen.add(line.custom_id)
        lines.append(line)
    return lines


def _parse_line(line_no: int, raw: bytes, endpoint: str) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # not UTF-8, malformed, an integer over the digit limit
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return _bad(line_no, None, "invalid_json_line", f"line {line_no}: expected a JSON object, "
                    f"got {type(obj).__name__}")
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            return _bad(line_no, custom_id, "missing_required_parameter", f"{key}: missing")
    if custom_id is None or not custom_id:
        return _bad(line_no, None, "invalid_custom_id", f"custom_id: must be a non-empty string, got "
                    f"{obj['custom_id']!r}")
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
