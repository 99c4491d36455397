"""The GLM tool-call format, `glm45` (vLLM's `glm45` and `glm47` parsers): the calls of GLM-4.5's, GLM-4.6's and
GLM-4.7's chat templates, a function's name after the opening tag, then each argument as a key and a value in tags
of their own:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7's template writes the same without the newlines (`GlmFormat.compact`: its template never writes a newline
before `<arg_key>`). A template writes this form when it names both `<tool_call>` and `<arg_key>`
(`writes_glm_calls`; a template of `<tool_call>` alone writes hermes' JSON).

**Reading** (`_Call.read_on`, one pass: a stream's call is read on from where its last look stopped, and each tag
is searched for once, `TagSearch`, so a delta costs what it adds). The name is the one word on the opening tag's
line before the first tag; between the tags only blanks; a key is the text up to its `</arg_key>` (stripped),
a value the text up to its first `</arg_value>`, as written: the template writes a string as it is and any other
value as JSON. Each value is read as its schema says (`gateway.openai.xml_values.typed_value`): as written where the
property may be a string, otherwise as JSON or a Python literal; an argument the schema does not declare as JSON
where it reads as JSON, as text where it does not (what the template's `tojson` wrote comes back; vLLM's parser
reads them so). A `<tool_call>` with other text after its name or between its tags (prose that names the tag), a
call of a function not offered, and one never closed are content; a reply max_tokens cut inside a call ends in that
call as far as its arguments closed (`GlmFormat.parse_reply`). A call's `arguments` are the JSON object of what was
read (ours; the first value of a key kept): a stream sends a call's name once its line is whole and a tag follows
it, then each argument's JSON once its `</arg_value>` is written.

**Writing** (`GlmFormat.body`, the grammars of forced and strict calls): the template's form, a function's
declared arguments in its schema's order (`gateway.openai.xml_tools.argument_rules`, as the XML form's), a value
that may be a string any text without `</arg_value>`, any other the JSON of its schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.call_scan import TagSearch
from gateway.openai.reasoning import partial_tag
from gateway.openai.tool_grammar import CallSyntax, literal
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import CallScan, ToolCall, ToolFormat, beside_calls
from gateway.openai.xml_tools import MAX_NAME, ArgumentTags, argument_rules
from gateway.openai.xml_values import typed_value

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_BLANKS = " \t\r\n"
# an argument the schema does not declare: JSON where its text reads as JSON other than a string, else the text
_UNDECLARED: dict[str, Any] = {"type": ["object", "array", "number", "boolean", "null"]}


def writes_glm_calls(template: str) -> bool:
    """Whether a chat template writes its calls in this form (`<tool_call>` and `<arg_key>`)."""
    return KEY in template and START in template


def _past_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _BLANKS:
        pos += 1
    return pos


def _may_begin(text: str, pos: int, tags: tuple[str, ...]) -> bool:
    """Whether the reply ends at `pos` in a beginning of one of `tags` (nothing yet included): it may go on."""
    rest = text[pos:pos + max(map(len, tags))]
    return pos + len(rest) == len(text) and any(tag.startswith(rest) for tag in tags)


@dataclass
class _Call:
    """One `<tool_call>` as far as its reply is read: its name once its line is whole and a tag follows, its
    arguments closed (key, where the value starts, where it ends), where reading goes on, its end (None: open),
    and `dead`: text after its marker that no call holds (prose, whatever the reply goes on with)."""

    start: int
    name: str | None = None
    args: list[tuple[str, int, int]] = field(default_factory=list)
    at: int = 0
    end: int | None = None
    dead: bool = False
    value: tuple[str, int] | None = None   # an argument whose value is open: its key and where the value starts

    def read_on(self, text: str, search: TagSearch) -> None:
        """Read on as far as `text`, the reply so far (it only grows) or whole, goes."""
        if self.name is None and not self._name(text, search):
            return
        while self.end is None and not self.dead:
            if self.value is not None:
                key, start = self.value
                end = search.find(text, VALUE_END, start)
                if end < 0:
                    return
                self.args.append((key, start, end))
                self.value, self.at = None, end + len(VALUE_END)
                continue
            at = self.at = _past_blanks(text, self.at)
            if text.startswith(END, at):
                self.end = at + len(END)
            elif not text.startswith(KEY, at):
                self.dead = not _may_begin(text, at, (END, KEY))
                return
            elif not self._key(text, at, search):
                return

    def _name(self, text: str, search: TagSearch) -> bool:
        """Read its name, one word on the tag's line (False: not whole yet, or the call is dead: more words, or
        a `<` that begins no tag, as prose that names the tag has)."""
        begin = self.start + len(START)
        stops = [at for tag in ("\n", KEY, END) if 0 <= (at := search.find(text, tag, begin)) <= begin + MAX_NAME]
        head = text[begin:min(stops, default=begin + MAX_NAME)]
        if (lt := head.find("<")) >= 0:
            self.dead = bool(stops) or not _may_begin(text, begin + lt, (KEY, END))
            head = head[:lt]
        words = head.split()
        self.dead |= len(words) > 1 or bool(stops) and not words or not stops and len(text) > begin + MAX_NAME
        if self.dead or not stops:
            return False
        at = _past_blanks(text, min(stops))
        if text.startswith((KEY, END), at):   # a stream begins the call once a tag follows its name
            self.name, self.at = words[0], at
            return True
        self.dead = not _may_begin(text, at, (END, KEY))
        return False

    def _key(self, text: str, at: int, search: TagSearch) -> bool:
        """Read the key at `at` and open its value (False: not written yet, or the call is dead)."""
        begin = at + len(KEY)
        end = text.find(KEY_END, begin, begin + MAX_NAME + len(KEY_END))
        if end < 0:
            self.dead = len(text) >= begin + MAX_NAME + len(KEY_END)
            return False
        value = _past_blanks(text, end + len(KEY_END))
        if not text.startswith(VALUE, value):
            self.dead = not _may_begin(text, value, (VALUE,))
            return False
        self.value = (text[begin:end].strip(), value + len(VALUE))
        return True


class _Reading:
    """A reply's calls as read so far: each `<tool_call>`'s `_Call` by its place, one `TagSearch`, and how far
    each look past markers in prose went (`GlmFormat._next_open`). A stream keeps one (`scanners`, key -1)."""

    def __init__(self) -> None:
        self.calls: dict[int, _Call] = {}
        self.search = TagSearch()
        self.skips: dict[int, int] = {}
        self.written: dict[int, tuple[tuple[int, bool], str]] = {}   # call place -> (its shape, its JSON so far)
        self.items: dict[tuple[int, int], str] = {}                   # value place -> its `"key": value` JSON

    def call(self, text: str, start: int) -> _Call:
        call = self.calls.get(start)
        if call is None:
            call = self.calls[start] = _Call(start)
        call.read_on(text, self.search)
        return call


class GlmFormat(ToolFormat):
    name = "glm45"
    start = START
    markers = (START, END, KEY, KEY_END, VALUE, VALUE_END)

    def __init__(self, tools: list[Tool], compact: bool = False) -> None:
        super().__init__(tools)
        self.compact = compact   # GLM-4.7's form: no newline between the name and the tags
        line = "" if compact else "\n"
        self.syntax = CallSyntax(START, END, line, "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{START}(?s:.)*/")
        self._tags = ArgumentTags(KEY, f"{KEY_END}{line}{VALUE}", f"{VALUE_END}{line}", "<\\n", _carried, _reads_back)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self._read(text)[:2]

    def _read(self, text: str) -> tuple[str | None, list[ToolCall], _Call | None]:
        """`parse`, and the call open at the reply's end (None: none is)."""
        reading, calls, kept, last, pos = _Reading(), [], [], 0, 0
        while (found := reading.search.find(text, START, pos)) >= 0:
            call = reading.call(text, found)
            if call.end is None and not call.dead:
                return (beside_calls("".join(kept) + text[last:]) if calls else text), calls, call
            if call.dead or call.name not in self.tools:
                pos = found + len(START) if call.dead else call.end
                continue
            calls.append(ToolCall(call.name, self._json(call, text, reading), start=found))
            kept.append(text[last:found])
            last = pos = call.end
        return (beside_calls("".join(kept) + text[last:]) if calls else text), calls, None

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside a call whose name is whole and offered ends in that call, of the
        arguments closed so far (`ToolCall.cut`); one whose name is not whole or not offered is dropped (a stream
        held that text back: it was never content)."""
        content, calls, open_call = self._read(text)
        if not cut or open_call is None:
            return content, calls
        content, calls, _ = self._read(text[:open_call.start])
        if open_call.name in self.tools:
            reading = _Reading()
            calls.append(ToolCall(open_call.name, self._json(open_call, text, reading), cut=True,
                                  start=open_call.start))
        return (beside_calls(content or "") if calls else content), calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, Any] | None = None) -> Iterator[CallScan]:
        """Each call from `pos` as far as written: its name, then the JSON of its arguments closed so far
        (`args_text`, a prefix of its final `arguments`)."""
        reading = self._reading(scanners)
        while (found := self._next_open(text, pos, reading)) >= 0:
            call = reading.call(text, found)
            if call.name is None:
                return
            shape = (len(call.args), call.end is not None)
            if reading.written.get(found, (None,))[0] != shape:
                reading.written[found] = (shape, self._json(call, text, reading))
            yield CallScan(name=call.name, args_start=0, args_text=reading.written[found][1], end=call.end,
                           start=found)
            if call.end is None:
                return
            pos = call.end

    def hold_from(self, text: str, pos: int = 0, scanners: dict[int, Any] | None = None) -> int:
        if (found := self._next_open(text, pos, self._reading(scanners))) >= 0:
            return found
        return len(text) - partial_tag(text, START)

    @staticmethod
    def _reading(scanners: dict[int, Any] | None) -> _Reading:
        """A stream's reading of its reply so far (its `scanners`, key -1); a fresh one without."""
        if scanners is None:
            return _Reading()
        if -1 not in scanners:
            scanners[-1] = _Reading()
        return scanners[-1]

    def _next_open(self, text: str, pos: int, reading: _Reading) -> int:
        """The first `<tool_call>` from `pos` that is a call or may still be one (-1: none), past markers in
        prose (dead calls) and closed calls of functions not offered (passed whole, as `_read` passes them)."""
        first, pos = pos, reading.skips.get(pos, pos)
        while (found := reading.search.find(text, START, pos)) >= 0:
            call = reading.call(text, found)
            if not call.dead and (call.end is None or call.name in self.tools):
                break
            pos = found + len(START) if call.dead else call.end
        reading.skips[first] = found if found >= 0 else pos
        return found

    def _json(self, call: _Call, text: str, reading: _Reading) -> str:
        """The JSON object of a call's closed arguments, each read as its schema says (the first of a key wins:
        what a stream sent stays a prefix of the whole), closed where the call is."""
        tool = self.tools.get(call.name or "")
        schema = tool.parameters if tool is not None else {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        written, seen = [], set()
        for key, start, end in call.args:
            if key in seen:
                continue
            seen.add(key)
            item = reading.items.get((start, end))
            if item is None:
                value = typed_value(text[start:end], properties.get(key, _UNDECLARED), schema)
                item = reading.items[(start, end)] = \
                    f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            written.append(item)
        return "{" + ", ".join(written) + ("}" if call.end is not None else "")

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        line = "" if self.compact else "\n"
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            items = argument_rules(schema, f"{i}", rules, self._tags)
            rules.append(f"fn{i}: {literal(name + line)} {items}")
        value = rf'(/(?s:.)*/ & ~/(?s:.)*<\/arg_value>(?s:.)*/) {literal(self._tags.close)}'
        rules += [*self._tags.any_argument("anyparam", "PNAME"), f"VALUE: {value}"]
        return "\n".join(rules) + "\n"


def _carried(key: Any) -> bool:
    """Whether an argument's name reads back as written (`_Call._key`: stripped, up to its closing tag)."""
    return isinstance(key, str) and 0 < len(key) < MAX_NAME and key == key.strip() and "<" not in key


def _reads_back(value: str) -> bool:
    """Whether a string value written as text reads back whole (no `</arg_value>` in it)."""
    return VALUE_END not in value
