"""Tool calls: how the prompt shows the offered tools, the grammar that enforces `tool_choice`, and the parser
that turns the model's text back into OpenAI `tool_calls` (the request's `tools` are read in
`gateway.openai.tool_specs`).

The pool model's chat template decides the format (`tool_format`):
- **hermes** (the template writes `<tool_call>`: Qwen2/2.5, Hermes, many fine-tunes): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several one after another;
- **longcat** (the template writes `<longcat_tool_call>`: LongCat-Flash): hermes' calls between its own tags;
- **llama3_json** (the template asks for `"parameters"`: Llama 3.1-3.3): the reply is
  `{"name": ..., "parameters": {...}}`, several joined by `; `;
- a template that knows no tools (SmolLM2's): `gateway.openai.chat_prompt` shows the tools in a system message
  of ours and asks for the hermes form; assistant tool calls and tool results in the history are written the
  same way.

`tool_choice` "required" or a named function is enforced with a grammar (`ToolFormat.grammar`, a Lark
grammar with the functions' parameter schemas inline: `gateway.openai.tool_grammar`) through the structured-output
machinery; "auto" leaves the model free and parses what it wrote, unless a tool is `strict`: then plain
text, or calls (after some text, where a marker opens a call), a strict tool's arguments under its schema
(`ToolFormat.auto_grammar`); "none"
renders the tools and parses nothing. A stream sends each call as it is written (`ToolCallStream`: id
and name, then the arguments' text in pieces)."""

from __future__ import annotations

import json
import re
import functools
import uuid
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

from engine.structured import StructuredOutput
from gateway.openai.call_scan import CallScan, CallScanner, scan_call
from gateway.openai.errors import nested_over
from gateway.openai.reasoning import Think, partial_tag
from gateway.openai.tool_grammar import ANY_OBJECT, CallSyntax, auto_grammar, forced_grammar
from gateway.openai.tool_specs import Tool

_SPACES = re.compile(r"\s*")   # what `str.lstrip` drops, matched where it starts without a copy of the rest


def openai_call_id() -> str:
    """A call id as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str            # JSON text, as OpenAI sends it (a call cut by max_tokens: as far as it got)
    id: str = field(default_factory=openai_call_id)
    cut: bool = False         # max_tokens ended the reply inside it
    start: int = field(default=-1, compare=False)   # where in the reply its JSON object begins

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# --- formats ------------------------------------------------------------------------------------------

def _decode(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `text[pos]` and where it ends; None where `loads` would give None."""
    try:
        value, end = decoder.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    return None if nested_over(value) else (value, end)


def beside_calls(text: str) -> str | None:
    """The content of a reply with calls: its text outside them, the whitespace at its end (where a call
    followed) dropped, none where that is all there is."""
    return text.rstrip() if text.strip() else None


class ToolFormat:
    """How one family of chat templates writes tool calls."""

    name: str
    start: str            # text that opens a call: from it on, a stream holds its text back until parsed
    syntax: CallSyntax    # how calls are written (the arguments' key among it), for the grammars
    text_before_calls = True   # prose may precede the calls (hermes); llama3_json's reply is calls or text
    parallel_calls = True      # a reply may hold several calls (`parallel_tool_calls`); llama3_json's one
    markers: tuple[str, ...] = ()   # text around the calls that `parse` needs (hermes' tags)
    call_id = staticmethod(openai_call_id)   # the id of a call the model writes
    # a history's call id as the template takes it, given its function's name and its place among the history's calls
    history_id = staticmethod(lambda call_id, name=None, index=None: call_id)

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {t.name: t for t in tools}

    def markers_skipped(self, tokenizer) -> bool:
        """Whether a reply decoded skipping special tokens loses one of `markers` (Hermes 2 Pro's special
        `<tool_call>`): one that may call then keeps them, as vLLM's hermes parser, or no call would be read."""
        return any(_skipped_by_decode(tokenizer, marker) for marker in self.markers)

    @property
    def args_key(self) -> str:
        return self.syntax.args_key

    @property
    def args_keys(self) -> tuple[str, ...]:
        """The keys a call's arguments are read under: the format's own first (what its grammars write)."""
        return (self.args_key,)

    def kept_calls(self, calls: list[ToolCall], parallel: bool) -> list[ToolCall]:
        """The calls of a whole reply an answer gives: all of them, or the first only when the request's
        `parallel_tool_calls` is false or the format takes one call a turn (`parallel_calls`)."""
        return calls if parallel and self.parallel_calls else calls[:1]

    def grammar(self, tools: list[Tool], parallel: bool, think: Think | str | None = None) -> StructuredOutput:
        """Calls of `tools` only (tool_choice "required" or named), each under its schema; `think`: where a
        thinking model's reply starts (`gateway.openai.tool_grammar`)."""
        functions = [(t.name, t.parameters) for t in tools]
        return forced_grammar(self.syntax, functions, parallel and self.parallel_calls, think, self.body(functions))

    def auto_grammar(self, tools: list[Tool], parallel: bool, reply: StructuredOutput | None = None,
                     think: Think | str | None = None) -> StructuredOutput:
        """tool_choice "auto" with strict tools: plain text that never starts a call (`reply`'s JSON where
        given), or calls (after such text, where a marker opens a call: hermes), a strict tool's arguments
        under its schema, another's any JSON object."""
        functions = [(t.name, t.parameters if t.strict else ANY_OBJECT) for t in tools]
        return auto_grammar(self.syntax, functions, parallel and self.parallel_calls, reply, think,
                            self.body(functions))

    def stream_call_id(self, text: str, start: int) -> str:
        """The id a stream gives the call beginning at `start` of the reply `text` (Kimi's: the one written there)."""
        return self.call_id()

    def example(self) -> str:
        """A call in this format, placeholders for its function's name and arguments: how a system message of ours
        asks for calls where the template writes them but lists no tools (`gateway.openai.chat_prompt`)."""
        syntax = self.syntax
        return (f'{syntax.first}{syntax.open}{{"name": "<function name>", "{syntax.args_key}": {{<its arguments>}}}}'
                f'{syntax.close}{syntax.last}')

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str | None:
        """The Lark rules of what a call holds (rule `body`) where that is no JSON object; None: it is one."""
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls or None, the calls). Text that only looks like a call is content."""
        raise NotImplementedError

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse` of a whole reply; `cut`: max_tokens ended it. A call it was writing when it was cut is a call
        as far as it got (`ToolCall.cut`, its arguments perhaps not yet JSON), as a stream sent it, never text;
        one cut before its name was whole is dropped (a stream held it back: it was never content either)."""
        begin = self._open_call(text) if cut else None
        if begin is None:
            return self.parse(text)
        content, calls = self.parse(text[:begin])
        tail = next(self.call_scans(text, begin), None)
        alone = calls or self.text_before_calls or not (content or "").strip()   # llama3_json: no text before
        if tail is not None and tail.name in self.tools and alone:
            args = "" if tail.args_start is None else text[tail.args_start:tail.args_end or len(text)]
            calls = [*calls, ToolCall(tail.name, args, cut=True, start=tail.start)]
        return beside_calls(content or "") if calls else content, calls

    def _open_call(self, text: str) -> int | None:
        """Where a call the reply was still writing at its end begins, if it was."""
        scans = list(self.call_scans(text, 0))
        return scans[-1].start if scans and scans[-1].end is None else None

    def hold_from(self, text: str, pos: int = 0, scanners: dict | None = None) -> int:
        """Where in the reply so far (from `pos`) a call may be starting, past markers in prose: a stream sends
        the text before it as content and holds the rest until the reply ends (`scanners`: `call_scans`')."""
        raise NotImplementedError

    def call_scans(self, text: str, pos: int, scanners: dict[int, CallScanner] | None = None) -> Iterator[CallScan]:
        """Each call object in `text` (from `pos`) as far as written (`scan_call`, with a stream's `scanners`):
        a stream's calls."""
        raise NotImplementedError

    def _call(self, obj: Any, text: str, start: int) -> ToolCall | None:
        """A call of a known tool from the object decoded at `text[start]`: its name the first one written
        (what a stream sends once it is whole), its arguments the model's own text of them, as a stream sent
        them (the object's JSON if the scan finds no closed one)."""
        if not isinstance(obj, dict):
            return None
        key = next((k for k in self.args_keys if k in obj), None)
        scan = scan_call(text, start, self.args_keys)
        if scan.name not in self.tools or key is None or not isinstance(obj[key], dict):
            return None
        if scan.args_end is not None:
            return ToolCall(scan.name, text[scan.args_start:scan.args_end], start=start)
        return ToolCall(scan.name, json.dumps(obj[key], ensure_ascii=False), start=start)


def tagged_json_syntax(start: str, end: str) -> CallSyntax:
    """How hermes' calls are written between tags `start` and `end`: each JSON call on its own line between them,
    plain text never holding `start` (hermes' own tags, LongCat-Flash's)."""
    return CallSyntax(f"{start}\n", f"\n{end}", "\n", "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{start}(?s:.)*/")


class HermesFormat(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)
    syntax = tagged_json_syntax(start, end)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        # Each call's JSON is decoded where it starts, not cut at the next "</tool_call>": a string
        # argument may contain that text.
        decoder, calls, kept, last, pos = json.JSONDecoder(), [], [], 0, 0
        while (start := text.find(self.start, pos)) >= 0:
            pos = start + len(self.start)
            body = _SPACES.match(text, pos).end()   # no copy of the rest: a reply of many markers stays linear
            if not text.startswith("{", body) or (decoded := _decode(decoder, text, body)) is None:
                continue   # a marker in prose is passed over before a decode (its error counts the lines before it)
            obj, end = decoded
            after = _SPACES.match(text, end).end()
            if text.startswith(self.end, after):
                end = after + len(self.end)
            elif after < len(text):
                continue   # no closing tag after the object: not a call
            call = self._call(obj, text, body)
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:start])
            last = pos = end
        if not calls:
            return text, []
        return beside_calls("".join(kept) + text[last:]), calls

    def _open_call(self, text: str) -> int | None:
        # the marker of the last call object if open, or closed with its closing tag begun and not whole (`parse`
        # reads an object with no tag after it at the end as a call), else a marker after it (not in prose, nor in
        # a call's strings) with no object yet; a marker's first characters alone are text
        last = None
        for last in self.call_scans(text, 0):
            pass
        if last is not None:
            rest = text[last.end:].lstrip() if last.end is not None else None
            if rest is None or (rest and rest != self.end and self.end.startswith(rest)):
                return text.rfind(self.start, 0, last.start)
        found = self._next_marker(text, 0 if last is None else last.end)   # past markers in prose
        return found if found >= 0 and self._body(text, found) >= len(text) else None

    def call_scans(self, text: str, pos: int, scanners: dict[int, CallScanner] | None = None) -> Iterator[CallScan]:
        while (found := self._next_marker(text, pos, scanners)) >= 0:
            if (body := self._body(text, found, scanners)) >= len(text):
                return                     # a call may be starting
            yield (scan := scan_call(text, body, self.args_keys, scanners))
            if (pos := scan.end) is None:   # the next call starts after this one
                return

    def _body(self, text: str, marker: int, scanners: dict | None = None) -> int:   # past the marker's blanks
        blanks = scanners.setdefault(-2, {}) if scanners is not None else {}
        blanks[marker] = _SPACES.match(text, blanks.get(marker, marker + len(self.start))).end()
        return blanks[marker]

    def _next_marker(self, text: str, pos: int, scanners: dict | None = None, judged: bool = False) -> int:
        """The first marker from `pos` that may open a call (a `{` after it, or blanks alone so far), -1 if
        none, past markers in prose (for good): one with no object after it, and where `judged` (the content's
        look) one whose object, closed, `parse` reads as no call (no tool offered, text after it); a stream's
        `scanners` keep at key -1 (-4 judged) where each look from a place went on to (and at -2 each marker's
        blanks): a delta costs what it adds."""
        skips = scanners.setdefault(-4 if judged else -1, {}) if scanners is not None else {}
        start, pos = pos, skips.get(pos, pos)
        while (found := text.find(self.start, pos)) >= 0:
            if (body := self._body(text, found, scanners)) >= len(text) or \
                    text[body] == "{" and not (judged and self._no_call(text, body, scanners)):
                break
            pos = body
        skips[start] = found if found >= 0 else max(pos, len(text) - len(self.start) + 1)
        return found

    def _no_call(self, text: str, body: int, scanners: dict | None) -> bool:
        """Whether the object at `body`, closed, is no call as `parse` reads it (text after it other than the
        closing tag, or no call of a tool offered, its closing tag whole: `parse_reply` reads a reply max_tokens
        cut before that as a call cut); its verdict kept in a stream's `scanners` (key -3)."""
        scan = scan_call(text, body, self.args_keys, scanners)
        if scan.end is None:
            return False
        after = _SPACES.match(text, scan.end).end()
        if not text.startswith(self.end, after):
            return not self.end.startswith(text[after:])   # other text after it; nothing yet or the tag begun
        verdicts = scanners.setdefault(-3, {}) if scanners is not None else {}
        if body not in verdicts:
            decoded = _decode(json.JSONDecoder(), text, body)
            verdicts[body] = decoded is None or decoded[1] != scan.end or self._call(decoded[0], text, body) is None
        return verdicts[body]

    def hold_from(self, text: str, pos: int = 0, scanners: dict | None = None) -> int:
        found = self._next_marker(text, pos, scanners, judged=True)
        if found >= 0:
            return found
        return len(text) - partial_tag(text, self.start)   # the marker's first characters at the end


class LongcatFormat(HermesFormat):
    """LongCat-Flash's: hermes' calls between `<longcat_tool_call>` tags (vLLM's `longcat` parser)."""

    name = "longcat"
    start = "<longcat_tool_call>"
    end = "</longcat_tool_call>"
    markers = (start, end)
    syntax = tagged_json_syntax(start, end)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start = "{"
    # plain text: anything but what `parse` reads as calls (a JSON object, or the python tag, first)
    syntax = CallSyntax("", "", "; ", "parameters", r"/(?s:.)*/ & ~/\s*(\{|<\|python_tag\|>)(?s:.)*/")
    text_before_calls = False
    # Meta's Llama 3.1-3.3 template raises on an assistant turn of more than one call ("This model only supports
    # single tool-calls at once!"): a reply of several would fail the conversation's next request. Its first call
    # only, whatever `parallel_tool_calls` says (as vLLM documents for this format).
    parallel_calls = False

    @property
    def args_keys(self) -> tuple[str, ...]:
        return ("parameters", "arguments")   # Llama 3.1's own prompt asks for "parameters"; some write the other

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pos = len(text) - len(text.lstrip())
        if text.startswith("<|python_tag|>", pos):
            pos += len("<|python_tag|>")
        if not text.startswith("{", pos):
            return text, []
        decoder, calls, end_of_text = json.JSONDecoder(), [], len(text.rstrip())
        while pos < end_of_text:
            decoded = _decode(decoder, text, pos)
            call = None if decoded is None else self._call(decoded[0], text, pos)
            if call is None:
                return text, []
            calls.append(call)
            pos = decoded[1]
            while pos < end_of_text and text[pos] in " ;\n\t":
                pos += 1
        return None, calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, CallScanner] | None = None) -> Iterator[CallScan]:
        pos = _SPACES.match(text, pos).end()
        if text.startswith("<|python_tag|>", pos):
            pos += len("<|python_tag|>")
        while pos < len(text) and text[pos] == "{":
            yield (scan := scan_call(text, pos, self.args_keys, scanners))
            if scan.end is None:
                return
            pos = scan.end
            while pos < len(text) and text[pos] in " ;\n\t":
                pos += 1

    def _open_call(self, text: str) -> int | None:
        begin = super()._open_call(text)
        tag = "<|python_tag|>"
        if begin is not None and text[:begin].strip() == tag:   # the tag opens the calls: it is theirs
            return text.index(tag)
        return begin

    def hold_from(self, text: str, pos: int = 0, scanners: dict | None = None) -> int:
        pos, tag = _SPACES.match(text).end(), "<|python_tag|>"
        if text.startswith(("{", tag), pos) or (len(text) - pos <= len(tag) and tag.startswith(text[pos:])):
            return 0          # the reply is (or may still become) a JSON call: hold all of it
        return len(text)


@functools.lru_cache(maxsize=256)
def _skipped_by_decode(tokenizer, text: str) -> bool:
    """`text` is one token that decode with skip_special_tokens drops (the cache lives as long as pools' tokenizers)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class _StreamedCall:
    id: str
    name: str
    start: int           # where in the reply its JSON object begins (`CallScan.start`, `ToolCall.start`)
    num_sent: int = 0    # characters of its arguments sent


class ToolCallStream:
    """One streamed choice of a chat with tools: what of its text can go out as content now, and each call
    as the model writes it: its id, type and name once the name is whole and its arguments object has begun,
    then its arguments in pieces (the model's own text of them, so the pieces concatenate to the final
    `arguments`). A forced choice (tool_choice "required" or named) holds all text: it is calls only.

    What a stream sends adds up to the whole answer (`ToolFormat.parse_reply`): the content is the text
    before the first possible call (whitespace at its end held back, as the whole answer drops it beside a
    call), then at the end the rest of the whole answer's content; each call the whole answer has is the
    streamed one that began at the same place, completed, or sent whole. One exception: a call streamed
    whose object turns out not to be one (malformed after its arguments, or text after it where the format
    allows none, or a reply that ends inside it other than by max_tokens: EOS or a stop string) cannot be
    taken back: the stream has it, with its text also as content; the whole answer has the text only
    (vLLM's parsers do the same)."""

    def __init__(self, fmt: ToolFormat, forced: bool, parallel: bool = True) -> None:
        self.fmt, self.forced = fmt, forced
        self.parallel = parallel and fmt.parallel_calls   # False: the first call only
        self.num_sent = 0      # characters of the reply looked past as content (held whitespace included)
        self.sent = ""         # the content sent
        self.calls: list[_StreamedCall] = []
        self.cut_call: int | None = None   # once finished: the index of a call max_tokens cut, if one was
        self.rest = ""         # once finished: the content `finish` sent (after the calls, where there are any)
        self._scanners: dict[int, CallScanner] = {}   # each call object read so far, by where it starts
        self._seen = 0         # the reply's length at the last look (it only grows; a shorter one reads anew)

    def content_delta(self, text: str) -> str:
        """The reply so far is `text`: the content that can be sent now."""
        if self.forced or self.calls:   # after a call begun, the rest of the content comes at the end (`finish`)
            return ""
        if len(text) < self._seen:
            self._scanners.clear()
        self._seen = len(text)
        self.num_sent = max(self.num_sent, self.fmt.hold_from(text, self.num_sent, self._scanners))
        delta = text[len(self.sent):self.num_sent].rstrip()   # what the content so far has not sent yet
        self.sent += delta
        return delta

    def call_deltas(self, text: str, start: bool = True) -> list[dict[str, Any]]:
        """The reply so far is `text`: the calls' progress since the last look, as OpenAI's `tool_calls`
        delta entries (one per call that moved); `start` False: only the calls begun already move."""
        out: dict[int, dict[str, Any]] = {}
        if len(text) < self._seen:
            self._scanners.clear()
        self._seen = len(text)
        for k, scan in enumerate(self.fmt.call_scans(text, self.num_sent, self._scanners)):
            if k and not self.parallel:
                break
            if k == len(self.calls):
                if not start or scan.name not in self.fmt.tools or scan.args_start is None:
                    break        # its name or its arguments' start not written yet (or it names no tool offered)
                call = _StreamedCall(self.fmt.stream_call_id(text, scan.start), scan.name, scan.start)
                self.calls.append(call)
                out[k] = {"index": k, "id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": ""}}
            call = self.calls[k]
            piece = scan.args_text[call.num_sent:] if scan.args_text is not None else \
                text[scan.args_start + call.num_sent:scan.args_end if scan.args_end is not None else len(text)]
            if piece:
                call.num_sent += len(piece)
                out.setdefault(k, {"index": k, "function": {"arguments": ""}})["function"]["arguments"] += piece
            if scan.end is None:
                break
        return list(out.values())

    def finish(self, text: str, cut: bool = False) -> tuple[str, list[dict[str, Any]], int]:
        """The reply is complete (`cut`: by max_tokens): (the rest of the content, the last `tool_calls` delta
        entries, the number of calls sent). The whole answer's calls (`ToolFormat.parse_reply`) are matched to
        the streamed ones by where they begin: one the stream began is completed with the rest of its
        arguments (a cut one with what there is), one it did not see is sent whole under the next index (and
        none the whole answer lacks is begun: the end of a reply can show that what looked like a call is not)."""
        entries = {e["index"]: e for e in self.call_deltas(text, start=False)}
        content, calls = self.fmt.parse_reply(text, cut)
        content = "" if self.forced else content or ""
        rest = content[len(self.sent):] if content.startswith(self.sent) else ""
        self.num_sent, self.sent, self.rest = len(text), content, rest
        streamed = {call.start: k for k, call in enumerate(self.calls)}
        count = len(self.calls)
        for call in calls:
            k = streamed.get(call.start)
            if k is None:
                if count and not self.parallel:
                    break
                k, count = count, count + 1
                entries[k] = {"index": k, **call.as_openai()}
            elif len(call.arguments) > self.calls[k].num_sent:
                more = call.arguments[self.calls[k].num_sent:]
                entries.setdefault(k, {"index": k, "function": {"arguments": ""}})["function"]["arguments"] += more
            if call.cut:
                self.cut_call = k
        return rest, [entries[k] for k in sorted(entries)], count
