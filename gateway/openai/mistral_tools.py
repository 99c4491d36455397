"""Mistral's tool calls, in the two forms its templates write (found by `[TOOL_CALLS]` in the template, `[ARGS]`
telling them apart: `mistral_format`):

- **mistral** (vLLM's `mistral` parser for tokenizers before v11: Mistral-7B-Instruct-v0.3, Mixtral-8x22B,
  Mistral-Nemo, Mistral-Small-2409 and -2501, Mistral-Large-2407 and -2411): the marker, then a turn's calls as one
  JSON array of `{"name", "arguments"}` objects:

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "search", ...}]

  read as hermes' objects are (`scan_call`: the name, the arguments' object as the model wrote it, sent in pieces
  as it is written), the array closed with `]`; a marker not followed by an array of calls of offered functions
  (prose that names it, an array never closed) is content, and so is all of it;
- **mistral_args** (tokenizers from v11: Mistral-Small-3.1 and -3.2, Magistral, Devstral, Ministral 3): each call
  its marker, its name, `[ARGS]` and its arguments' object, a call ending with its object:

      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"query": "q"}

  read and written as DeepSeek V3.1's form (`gateway.openai.deepseek_tools.JsonTagFormat`); where the template
  writes each call's id after its name (`get_weather[CALL_ID]a1B2c3D4e[ARGS]{...}`, mistral_common's v11 way), the
  model writes one too, and the call is answered under it.

**Call ids.** Mistral's templates refuse a history whose call ids are not 9 letters and digits (v0.3's raises; later
ones keep the last 9 characters, so two ids may become one). These formats answer with such ids (`mistral_call_id`,
as Mistral's API and vLLM do), and a history's other ids reach the template as 9 characters of their own
(`history_id`: the same id always the same 9, so each result still names its call)."""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from collections.abc import Iterator
from typing import Any

from gateway.openai.call_scan import CallScan, CallScanner
from gateway.openai.deepseek_tools import JsonTagFormat, _JsonCall
from gateway.openai.reasoning import partial_tag
from gateway.openai.tagged_tools import TagForm
from gateway.openai.tool_grammar import CallSyntax, literal, regex_text
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import _SPACES, ToolCall, ToolFormat, _decode, beside_calls

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits
ARGS_FORM = TagForm("mistral_args", MARKER, ARGS, "", "", "", "", "", line="")


def writes_mistral_calls(template: str) -> bool:
    """Whether a chat template writes its calls in one of Mistral's forms."""
    return MARKER in template


def mistral_format(template: str, tools: list[Tool]) -> ToolFormat:
    """The Mistral form a template writes: `[ARGS]` after each call's name, or the array of objects."""
    return MistralArgsFormat(tools, with_ids=CALL_ID in template) if ARGS in template else MistralFormat(tools)


def mistral_call_id() -> str:
    """A call id as Mistral's templates take them: 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def history_id(call_id: Any, name: str | None = None, index: int | None = None) -> Any:
    """A history's call id as Mistral's templates take it: one of 9 letters and digits as it is, any other string
    9 of its own, the same each time (a digest of it; the call's function and place aside)."""
    if not isinstance(call_id, str) or _is_mistral_id(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALPHANUMERIC[number // 62 ** k % 62] for k in range(9))


def _with_mistral_ids(calls: list[ToolCall]) -> list[ToolCall]:
    for call in calls:
        call.id = mistral_call_id()
    return calls


def _is_mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


class _ArgsCall(_JsonCall):
    """A function of the `[ARGS]` form: its name, before the id written after it (`[CALL_ID]`) where there is one
    (`MistralArgsFormat.stream_call_id`: the id)."""

    @staticmethod
    def function_name(written: str) -> str:
        return written.partition(CALL_ID)[0]


class MistralArgsFormat(JsonTagFormat):
    """Mistral's `[ARGS]` form (the module's notes); `with_ids`: its template writes each call's id after its name
    (`NAME[CALL_ID]ID[ARGS]`, as mistral_common's v11 tokenizer does), which the model then writes too: the call is
    answered under it, and the grammars write one of 9 letters and digits."""

    call_type = _ArgsCall
    call_id = staticmethod(mistral_call_id)
    history_id = staticmethod(history_id)

    def __init__(self, tools: list[Tool], with_ids: bool = False) -> None:
        super().__init__(tools, ARGS_FORM)
        self.with_ids = with_ids
        self.grammar_rules = ("CALLID: /[A-Za-z0-9]{9}/",) if with_ids else ()

    def stream_call_id(self, text: str, start: int) -> str:
        """The id written after the call's name where it is one of 9 letters and digits, else a new one."""
        begin = text.find(CALL_ID, start, text.find(ARGS, start))
        written = text[begin + len(CALL_ID):text.find(ARGS, begin)] if begin >= 0 else ""
        return written if _is_mistral_id(written) else mistral_call_id()

    def _head(self, name: str) -> str:
        if not self.with_ids:
            return super()._head(name)
        return f"{literal(name + CALL_ID)} CALLID {literal(ARGS)}"


class MistralFormat(ToolFormat):
    """Mistral's array of call objects after one marker (the module's notes). A stream's `scanners` keep each
    object's scanner by where it starts, and at key -1 each marker's reading so far (`_Turn`)."""

    name = "mistral"
    start = MARKER
    markers = (MARKER,)
    syntax = CallSyntax("", "", ", ", "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{regex_text(MARKER)}(?s:.)*/",
                        first=f"{MARKER} [", last="]")
    call_id = staticmethod(mistral_call_id)
    history_id = staticmethod(history_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, last = [], [], 0
        for found, turn in self._turns(text, 0, None):
            if turn.end is None:
                break
            made = self._calls(turn.scans, text)
            if made is None:
                continue
            calls += made
            kept.append(text[last:found])
            last = turn.end
        if not calls:
            return text, []
        return beside_calls("".join(kept) + text[last:]), calls

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside an array ends in its closed calls and the one it was writing (as
        far as its arguments got; one cut before they began is dropped), where all are of functions offered."""
        open_turn = next(((found, turn) for found, turn in self._turns(text, 0, None) if turn.end is None), None)
        if not cut or open_turn is None:
            content, calls = self.parse(text)
            return content, _with_mistral_ids(calls)
        found, turn = open_turn
        content, calls = self.parse(text[:found])
        for scan in turn.scans:
            if scan.name not in self.tools:
                break
            if scan.end is None:
                if scan.args_start is not None:
                    args = text[scan.args_start:scan.args_end or len(text)]
                    calls.append(ToolCall(scan.name, args, cut=True, start=scan.start))
                break
            made = self._calls([scan], text)
            if made is None:
                break
            calls += made
        return (beside_calls(content or "") if calls else content), _with_mistral_ids(calls)

    def _calls(self, scans: list[CallScan], text: str) -> list[ToolCall] | None:
        """The calls of closed objects (None: one is no call of a function offered)."""
        decoder, calls = json.JSONDecoder(), []
        for scan in scans:
            decoded = _decode(decoder, text, scan.start)
            call = None if decoded is None or decoded[1] != scan.end else self._call(decoded[0], text, scan.start)
            if call is None:
                return None
            calls.append(call)
        return calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, Any] | None = None) -> Iterator[CallScan]:
        for _, turn in self._turns(text, pos, scanners):
            yield from turn.scans
            if turn.end is None:
                return

    def hold_from(self, text: str, pos: int = 0, scanners: dict | None = None) -> int:
        for found, turn in self._turns(text, pos, scanners):
            if turn.end is None:
                return found
            if turn.calls is None:
                turn.calls = self._calls(turn.scans, text) is not None
            if turn.calls:
                return found
        return len(text) - partial_tag(text, MARKER)

    def _turns(self, text: str, pos: int, scanners: dict | None) -> Iterator[tuple[int, _Turn]]:
        """Each marker from `pos` that opens an array of objects (closed, or open at the reply's end), with its
        reading; markers in prose passed over."""
        turns = scanners.setdefault(-1, {}) if scanners is not None else {}
        while (found := text.find(MARKER, pos)) >= 0:
            turn = turns.get(found)
            if turn is None:
                turn = turns[found] = _Turn(found + len(MARKER))
            turn.read_on(text)
            if turn.dead:
                pos = found + len(MARKER)
                continue
            yield found, turn
            if turn.end is None:
                return
            pos = turn.end


class _Turn:
    """The array after one marker as far as written: its objects' scans, where reading goes on, what comes next
    (0: the array's `[`, 1: an object, 2: a comma or the `]`), the object being written, where the array ends
    (None: open), `dead` (anything else where these belong: prose), and `calls` (None: not judged yet; whether its
    objects are calls)."""

    def __init__(self, at: int) -> None:
        self.at, self.scans, self.end = at, [], None
        self.stage, self.dead, self.calls = 0, False, None
        self.writing: CallScanner | None = None

    def read_on(self, text: str) -> None:
        while self.end is None and not self.dead:
            if self.writing is not None:
                if self.writing.read(text).end is None:
                    return
                self.at, self.stage, self.writing = self.writing.scan.end, 2, None
            at = self.at = _SPACES.match(text, self.at).end()
            if at >= len(text):
                return
            if text[at] not in ("[", "{", ",]")[self.stage] or text[at] == "]" and not self.scans:
                self.dead = True
            elif text[at] == "{":
                self.writing = CallScanner(at, ("arguments",))
                self.scans.append(self.writing.scan)
            elif text[at] == "]":
                self.end = at + 1
            else:
                self.at, self.stage = at + 1, 1
