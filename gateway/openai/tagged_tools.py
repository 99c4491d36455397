"""Tool calls whose arguments are written in tags, each a key and its value as text (`TagForm`, `TaggedFormat`):

- **glm45** (vLLM's `glm45` and `glm47` parsers), GLM-4.5's, GLM-4.6's and GLM-4.7's templates, a call a
  function's name after the opening tag, then each argument's key and value in tags of their own:

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

  GLM-4.7's template writes the same without the newlines (`glm_form(compact=True)`: its template never writes a
  newline before `<arg_key>`); found by `<arg_key>` beside `<tool_call>` (`writes_glm_calls`);
- **minimax_m2** (vLLM's `minimax_m2` parser), MiniMax-M2's template, a turn's calls in one block:

      <minimax:tool_call>
      <invoke name="get_weather">
      <parameter name="city">Paris</parameter>
      </invoke>
      </minimax:tool_call>

  found by `<invoke name="` beside `<minimax:tool_call>` (`writes_minimax_calls`);
- **seed_oss** (vLLM's `seed_oss` parser), Seed-OSS's template, each call in a block of its own, Qwen3-Coder's tags
  with each value up to its closing tag (`<seed:tool_call>`, `<function=NAME>`, `<parameter=KEY>VALUE</parameter>`,
  `</function>`, `</seed:tool_call>`), found by `<function=` beside `<seed:tool_call>` (`writes_seed_calls`).

**Reading** (`_Call.read_on`, `_Turn.read_on`, one pass: a stream's call is read on from where its last look
stopped, and each tag is searched for once, `TagSearch`, so a delta costs what it adds). A name is GLM's one word on
the opening tag's line, MiniMax's the attribute's text; between the tags only blanks; a key is the text up to its
closing tag (stripped), a value the text up to its first closing tag, as written: the templates write a string as
it is and any other value as JSON. Each value is read as its schema says (`gateway.openai.xml_values.typed_value`):
as written where the property may be a string, otherwise as JSON or a Python literal; an argument the schema does
not declare as JSON where it reads as JSON, as text where it does not (what the template's `tojson` wrote comes
back), as vLLM's parsers read them. A turn (MiniMax's block, GLM's one call) with other text where a tag belongs
(prose that names the tag), a call of a function not offered, and one never closed are content, markers and all; a
reply max_tokens cut inside a turn ends in its calls as far as their arguments closed (`parse_reply`). A call's
`arguments` are the JSON object of what was read (ours; the first value of a key kept): a stream sends a call's name
once it is whole and a tag follows it, then each argument's JSON once its value's closing tag is written.

**Writing** (`TaggedFormat.body`, the grammars of forced and strict calls): the template's form, a function's
declared arguments in its schema's order (`gateway.openai.xml_tools.argument_rules`, as the XML form's), a value that
may be a string any text without its closing tag, any other the JSON of its schema; each call its own turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.call_scan import TagSearch
from gateway.openai.reasoning import partial_tag
from gateway.openai.tool_grammar import CallSyntax, literal, regex_text
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import CallScan, ToolCall, ToolFormat, beside_calls
from gateway.openai.xml_tools import MAX_NAME, ArgumentTags, argument_rules
from gateway.openai.xml_values import typed_value

_BLANKS = " \t\r\n"
# an argument the schema does not declare: JSON where its text reads as JSON other than a string, else the text
_UNDECLARED: dict[str, Any] = {"type": ["object", "array", "number", "boolean", "null"]}


@dataclass(frozen=True)
class TagForm:
    """How a family of templates writes calls in tags: what opens a function and comes before its name, what ends
    the name (None: it is one word on the opening tag's line, GLM's), what ends the function, the tags of a key and
    of its value (`value` "": the value follows the key's closing tag), the block around a turn's functions (None:
    each function is a turn of its own), and what the grammars write between the tags."""

    name: str
    function: str
    name_close: str | None
    function_end: str
    key: str
    key_close: str
    value: str
    value_end: str
    block: tuple[str, str] | None = None
    line: str = "\n"

    @property
    def opener(self) -> str:
        """What opens a turn."""
        return self.block[0] if self.block else self.function

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(t for t in (*(self.block or ()), self.function, self.name_close, self.function_end, self.key,
                                 self.key_close, self.value, self.value_end) if t)


def glm_form(compact: bool = False) -> TagForm:
    return TagForm("glm45", "<tool_call>", None, "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                   "</arg_value>", line="" if compact else "\n")


MINIMAX_FORM = TagForm("minimax_m2", '<invoke name="', '">', "</invoke>", '<parameter name="', '">', "",
                       "</parameter>", block=("<minimax:tool_call>", "</minimax:tool_call>"))
SEED_FORM = TagForm("seed_oss", "<function=", ">", "</function>", "<parameter=", ">", "", "</parameter>",
                    block=("<seed:tool_call>", "</seed:tool_call>"))


def writes_glm_calls(template: str) -> bool:
    """Whether a chat template writes its calls in GLM's form (`<tool_call>` and `<arg_key>`)."""
    return "<arg_key>" in template and "<tool_call>" in template


def writes_seed_calls(template: str) -> bool:
    """Whether a chat template writes its calls in Seed-OSS's form (`<function=` in its `<seed:tool_call>` block)."""
    return "<function=" in template and "<seed:tool_call>" in template


def writes_minimax_calls(template: str) -> bool:
    """Whether a chat template writes its calls in MiniMax-M2's form (`<invoke name="` in its block)."""
    return '<invoke name="' in template and "<minimax:tool_call>" in template


def _past_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _BLANKS:
        pos += 1
    return pos


def _may_begin(text: str, pos: int, tags: tuple[str, ...]) -> bool:
    """Whether the reply ends at `pos` in a beginning of one of `tags` (nothing yet included): it may go on."""
    rest = text[pos:pos + max(map(len, tags))]
    return pos + len(rest) == len(text) and any(tag.startswith(rest) for tag in tags)


def word_before(text: str, begin: int, close: str, excluded: str) -> tuple[bool, tuple[str, int] | None]:
    """The word from `begin` up to `close`, as far as the reply is written: (dead, (the word, where `close` ends), or
    None while it is not whole). Dead: a character of `excluded` in it (the reply may end inside the close), an empty
    word, or no close within `MAX_NAME`."""
    end = text.find(close, begin, begin + MAX_NAME + len(close))
    head = text[begin:end if end >= 0 else begin + MAX_NAME]
    if end < 0 and begin + len(head) == len(text):
        head = head[:len(head) - partial_tag(head, close)]
    dead = any(c in head for c in excluded) or end == begin or end < 0 and len(text) >= begin + MAX_NAME + len(close)
    return dead, None if dead or end < 0 else (head, end + len(close))


@dataclass
class _Call:
    """One function as far as its reply is read: its name once whole and a tag follows it, its arguments closed
    (key, where the value starts, where it ends), where reading goes on, its end (None: open), and `dead`: text
    where a tag belongs (prose, whatever the reply goes on with)."""

    form: TagForm
    start: int
    name: str | None = None
    args: list[tuple[str, int, int]] = field(default_factory=list)
    at: int = 0
    end: int | None = None
    dead: bool = False
    value: tuple[str, int] | None = None   # an argument whose value is open: its key and where the value starts

    def read_on(self, text: str, search: TagSearch) -> None:
        """Read on as far as `text`, the reply so far (it only grows) or whole, goes."""
        form = self.form
        if self.name is None and not self._name(text, search):
            return
        while self.end is None and not self.dead:
            if self.value is not None:
                key, start = self.value
                end = search.find(text, form.value_end, start)
                if end < 0:
                    return
                self.args.append((key, start, end))
                self.value, self.at = None, end + len(form.value_end)
                continue
            at = self.at = _past_blanks(text, self.at)
            if text.startswith(form.function_end, at):
                self.end = at + len(form.function_end)
            elif not text.startswith(form.key, at):
                self.dead = not _may_begin(text, at, (form.function_end, form.key))
                return
            elif not self._key(text, at):
                return

    def _name(self, text: str, search: TagSearch) -> bool:
        """Read its name (False: not whole yet, or the call is dead), then see a tag follow it."""
        named = self._word(text, search) if self.form.name_close is None else self._attribute(text)
        if named is None:
            return False
        form, (name, at) = self.form, named
        at = _past_blanks(text, at)
        if text.startswith((form.key, form.function_end), at):   # a stream begins the call once a tag follows
            self.name, self.at = name, at
            return True
        self.dead = not _may_begin(text, at, (form.function_end, form.key))
        return False

    def _word(self, text: str, search: TagSearch) -> tuple[str, int] | None:
        """GLM's name: one word on the opening tag's line, up to a newline or a tag (dead: more words, or a `<`
        that begins no tag, as prose that names the tag has)."""
        form, begin = self.form, self.start + len(self.form.function)
        stops = [at for tag in ("\n", form.key, form.function_end)
                 if 0 <= (at := search.find(text, tag, begin)) <= begin + MAX_NAME]
        head = text[begin:min(stops, default=begin + MAX_NAME)]
        if (lt := head.find("<")) >= 0:
            self.dead = bool(stops) or not _may_begin(text, begin + lt, (form.key, form.function_end))
            head = head[:lt]
        words = head.split()
        self.dead |= len(words) > 1 or bool(stops) and not words or not stops and len(text) > begin + MAX_NAME
        return None if self.dead or not stops else (words[0], min(stops))

    def _attribute(self, text: str) -> tuple[str, int] | None:
        """MiniMax's name: the attribute's text up to its close on the tag's line (dead: a blank, `<` or quote in
        it, or none within `MAX_NAME`)."""
        self.dead, found = word_before(text, self.start + len(self.form.function), self.form.name_close or "",
                                       _BLANKS + '<"')
        return found

    def _key(self, text: str, at: int) -> bool:
        """Read the key at `at` and open its value (False: not written yet, or the call is dead)."""
        form, begin = self.form, at + len(self.form.key)
        end = text.find(form.key_close, begin, begin + MAX_NAME + len(form.key_close))
        if end < 0:
            self.dead = len(text) >= begin + MAX_NAME + len(form.key_close)
            return False
        value = end + len(form.key_close)
        if form.value:
            value = _past_blanks(text, value)
            if not text.startswith(form.value, value):
                self.dead = not _may_begin(text, value, (form.value,))
                return False
        self.value = (text[begin:end].strip(), value + len(form.value))
        return True


@dataclass
class _Turn:
    """One turn's calls as far as read: MiniMax's block of functions, or GLM's one function; its end (None: open)
    and `dead` (text where a tag belongs, or a block that closes holding no function: prose)."""

    form: TagForm
    start: int
    call_type: type = _Call   # how a function is read (`gateway.openai.deepseek_tools`: JSON arguments)
    calls: list[Any] = field(default_factory=list)
    at: int = 0
    end: int | None = None
    dead: bool = False

    def read_on(self, text: str, search: TagSearch) -> None:
        form = self.form
        if form.block is None:   # the turn is its function
            if not self.calls:
                self.calls.append(self.call_type(form, self.start))
            call = self.calls[0]
            call.read_on(text, search)
            self.end, self.dead = call.end, call.dead
            return
        self.at = self.at or self.start + len(form.block[0])
        while self.end is None and not self.dead:
            if self.calls and self.calls[-1].end is None:
                call = self.calls[-1]
                call.read_on(text, search)
                if call.end is None or call.dead:
                    self.dead = call.dead
                    return
                self.at = call.end
            at = self.at = _past_blanks(text, self.at)
            if text.startswith(form.block[1], at):
                self.end, self.dead = at + len(form.block[1]), not self.calls
            elif text.startswith(form.function, at):
                self.calls.append(self.call_type(form, at))
            else:
                self.dead = not _may_begin(text, at, (form.block[1], form.function))
                return


class _Reading:
    """A reply's turns as read so far, by their places, one `TagSearch`, and how far each look past markers in
    prose went (`TaggedFormat._next_open`). A stream keeps one (`scanners`, key -1)."""

    def __init__(self, form: TagForm, call_type: type = _Call) -> None:
        self.form, self.call_type = form, call_type
        self.turns: dict[int, _Turn] = {}
        self.search = TagSearch()
        self.skips: dict[int, int] = {}
        self.written: dict[int, tuple[tuple[int, bool], str]] = {}   # call place -> (its shape, its JSON so far)
        self.items: dict[tuple[int, int], str] = {}                   # value place -> its `"key": value` JSON

    def turn(self, text: str, start: int) -> _Turn:
        turn = self.turns.get(start)
        if turn is None:
            turn = self.turns[start] = _Turn(self.form, start, self.call_type)
        turn.read_on(text, self.search)
        return turn


class TaggedFormat(ToolFormat):
    """A `TagForm`'s calls: read, streamed, and written by the grammars."""

    call_type: type = _Call

    def __init__(self, tools: list[Tool], form: TagForm) -> None:
        super().__init__(tools)
        self.form, self.name, self.start, self.markers = form, form.name, form.opener, form.tags
        block, line = form.block, form.line
        self.syntax = CallSyntax(f"{block[0]}{line}{form.function}" if block else form.function,
                                 f"{form.function_end}{line}{block[1]}" if block else form.function_end, line,
                                 "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{regex_text(form.opener)}(?s:.)*/")
        excluded = '"<\\n' + (form.key_close[:1] if form.key_close[:1] not in '"<' else "")   # a name ends at its close
        self._tags = ArgumentTags(form.key, form.key_close + (line + form.value if form.value else ""),
                                  form.value_end + line, excluded, self._carried, self._reads_back)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self._read(text)[:2]

    def _read(self, text: str) -> tuple[str | None, list[ToolCall], _Turn | None]:
        """`parse`, and the turn open at the reply's end (None: none is)."""
        reading, calls, kept, last, pos = self._reading(None), [], [], 0, 0
        open_turn = None
        while (found := reading.search.find(text, self.start, pos)) >= 0:
            turn = reading.turn(text, found)
            if turn.end is None and not turn.dead:
                open_turn = turn
                break
            if turn.dead or any(call.name not in self.tools for call in turn.calls):
                pos = found + len(self.start) if turn.dead else turn.end
                continue
            calls += [ToolCall(call.name, self._arguments(call, text, reading), start=call.start)
                      for call in turn.calls]
            kept.append(text[last:found])
            last = pos = turn.end
        return (beside_calls("".join(kept) + text[last:]) if calls else text), calls, open_turn

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside a turn ends in its calls a stream began (`_begun`) of functions
        offered, of the arguments closed so far (`ToolCall.cut`: the last); one not begun or not offered ends them
        (a stream held that text back: it was never content)."""
        content, calls, open_turn = self._read(text)
        if not cut or open_turn is None:
            return content, calls
        content, calls, _ = self._read(text[:open_turn.start])
        reading = self._reading(None)
        for call in open_turn.calls:
            if call.name not in self.tools or not self._begun(call):
                break
            calls.append(ToolCall(call.name, self._arguments(call, text, reading), cut=call.end is None,
                                  start=call.start))
        return (beside_calls(content or "") if calls else content), calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, Any] | None = None) -> Iterator[CallScan]:
        """Each call from `pos` as far as written: its name, then the JSON of its arguments closed so far
        (`args_text`, a prefix of its final `arguments`)."""
        reading = self._reading(scanners)
        while (found := self._next_open(text, pos, reading)) >= 0:
            turn = reading.turn(text, found)
            for call in turn.calls:
                if call.name is None:
                    return
                yield self._scan(call, text, reading)
                if call.end is None:
                    return
            if turn.end is None:
                return
            pos = turn.end

    def hold_from(self, text: str, pos: int = 0, scanners: dict[int, Any] | None = None) -> int:
        if (found := self._next_open(text, pos, self._reading(scanners))) >= 0:
            return found
        return len(text) - partial_tag(text, self.start)

    def _reading(self, scanners: dict[int, Any] | None) -> _Reading:
        """A stream's reading of its reply so far (its `scanners`, key -1); a fresh one without."""
        if scanners is None:
            return _Reading(self.form, self.call_type)
        if -1 not in scanners:
            scanners[-1] = _Reading(self.form, self.call_type)
        return scanners[-1]

    def _next_open(self, text: str, pos: int, reading: _Reading) -> int:
        """The first turn from `pos` that is calls or may still be (-1: none), past markers in prose (dead turns)
        and closed turns whose first function is not offered (passed whole, as `_read` passes them)."""
        first, pos = pos, reading.skips.get(pos, pos)
        while (found := reading.search.find(text, self.start, pos)) >= 0:
            turn = reading.turn(text, found)
            if not turn.dead and (turn.end is None or turn.calls[0].name in self.tools):
                break
            pos = found + len(self.start) if turn.dead else turn.end
        reading.skips[first] = found if found >= 0 else pos
        return found

    @staticmethod
    def _begun(call: Any) -> bool:
        """Whether a stream has begun the call (its name whole and a tag after it: it has, once read so far)."""
        return call.name is not None

    def _scan(self, call: Any, text: str, reading: _Reading) -> CallScan:
        """A stream's view of a call whose name is whole: the JSON of its arguments closed so far, made anew only
        when one more closes."""
        shape = (len(call.args), call.end is not None)
        if reading.written.get(call.start, (None,))[0] != shape:
            reading.written[call.start] = (shape, self._arguments(call, text, reading))
        return CallScan(name=call.name, args_start=0, args_text=reading.written[call.start][1], end=call.end,
                        start=call.start)

    def _arguments(self, call: Any, text: str, reading: _Reading) -> str:
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
                value = self._value(call, text, start, end, properties.get(key, _UNDECLARED), schema)
                item = reading.items[(start, end)] = \
                    f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            written.append(item)
        return "{" + ", ".join(written) + ("}" if call.end is not None else "")

    def _value(self, call: Any, text: str, start: int, end: int, prop: Any, schema: dict[str, Any]) -> Any:
        """The value written at text[start:end], read as its schema says (`typed_value`)."""
        return typed_value(text[start:end], prop, schema)

    def example(self) -> str:
        form = self.form
        value = f"{form.line}{form.value}" if form.value else ""
        argument = f"{form.key}<argument name>{form.key_close}{value}<its value>{form.value_end}"
        return f"{self.syntax.open}<function name>{form.name_close or ''}{form.line}{argument}{form.line}" \
               f"{self.syntax.close}"

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        form = self.form
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            items = argument_rules(schema, f"{i}", rules, self._tags)
            rules.append(f"fn{i}: {literal(name + (form.name_close or '') + form.line)} {items}")
        end = form.value_end.replace("/", "\\/")
        value = rf'(/(?s:.)*/ & ~/(?s:.)*{end}(?s:.)*/) {literal(self._tags.close)}'
        rules += [*self._tags.any_argument("anyparam", "PNAME"), f"VALUE: {value}"]
        return "\n".join(rules) + "\n"

    def _carried(self, key: Any) -> bool:
        """Whether an argument's name reads back as written (`_Call._key`: stripped, up to its closing tag)."""
        return isinstance(key, str) and 0 < len(key) < MAX_NAME and key == key.strip() and \
            not any(c in key for c in '<"\n') and self.form.key_close not in key

    def _reads_back(self, value: str) -> bool:
        """Whether a string value written as text reads back whole (no closing tag in it)."""
        return self.form.value_end not in value
