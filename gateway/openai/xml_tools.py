"""The XML tool-call format, `qwen3_xml` (vLLM's `qwen3_coder` parser): the calls of Qwen3-Coder's and Qwen3.5's
chat templates (Nemotron's and Granite 4.2's too), a function's name and each argument in tags of their own:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A template writes this form when it names both `<tool_call>` and `<function=` (`writes_xml_calls`; a template that
writes `<function=name>{json}</function>` alone is another form).

**Reading** (`_Reader`, one pass over the reply: each tag's next place is found once, however many calls and
arguments ask). A value ends where the grammars end it, at the first newline and closing tag after it: a
`</parameter>`, `</function>` or `<parameter=` inside a value (code a model writes) stays in it. A closing tag
without its newline closes a value only where the next argument's tag or the function's end follows it; one left
out is closed by the next argument's tag or the function's end, as vLLM's parser reads it. Several functions in
one `<tool_call>` are several calls; a missing `</tool_call>` after a function's end is tolerated, and so is a
function without its `<tool_call>` (Qwen3-Coder leaves it out at times). A call of a
function not offered, or not closed, is content. Each value is read as its schema says (`gateway.openai.xml_values.typed_value`): where the
property may be a string (or says nothing of its type) as written, otherwise as JSON or, as the templates write a
history's values (`| string`: `True`, `{'a': 1}`), a Python literal, and as written where neither reads. A call's
`arguments` are the JSON object of what was read (ours, not the model's text; the first value of a key kept): a
stream sends a call's name once whole, then each argument's JSON once its closing tag is written (what it sent a
prefix of the whole answer's `arguments`), reading the reply as it grows (`_Reader.grow`: a delta costs what it
adds); the text before the first call goes out as it comes.

**Writing** (`XmlFormat.body`, the grammars of forced and strict calls): a function's declared arguments in its
schema's order, the required ones always (others after them, of other names, where `additionalProperties` is not
false); a value that may be a string is any text without the closing newline and tag (one of its `enum` or its
`const` where it has one; a pattern or length is not enforced), any other JSON under the property's schema (its
root's `$defs` with it; lenient, as the JSON formats' grammars). A function whose argument names the form cannot carry back
(a `>` or a newline in one, or spaces around it) takes any named values."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.openai.call_scan import TagSearch
from gateway.openai.reasoning import partial_tag
from gateway.openai.tool_grammar import CallSyntax, literal, rebased, schema_text
from gateway.openai.tools import CallScan, ToolCall, ToolFormat, beside_calls
from gateway.openai.xml_values import is_text, resolved, typed_value

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END = "<function=", "</function>", "<parameter=", "</parameter>"
MAX_NAME = 256   # a function's or an argument's name is read this far at most, on its line
_SPACES = re.compile(r"\s*")
# a string value: any text without a newline and then a tag (`_Reader._value_end` ends it at the first), those with
# it (one lexeme: a lexeme of the text alone would take the tag's first characters as text before the tag could be
# told from it)
_VALUE = (r'(/(?s:.)*/ & ~/(?s:.)*\n(<\/parameter>|<\/function>|<parameter=)(?s:.)*/ & '
          r'~/(?s:.)*<\/parameter>\s*(<parameter=|<\/function>)(?s:.)*/) "\n</parameter>\n"')
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")   # escaped in a grammar's /regex/ (any other character stands for itself)
# (name, its arguments in order as (key, where the value starts, where it ends), its end or None: open)
Function = tuple[str, list[tuple[str, int, int]], int | None]


def _may_open(text: str, pos: int) -> bool:
    """Whether what follows a marker at `pos` may still become a function's tag as a stream's reply grows: it
    ends the reply as blanks and a beginning of `<function=`, or that tag with a name still unfinished."""
    tail = text[pos:pos + len(FUNCTION) + MAX_NAME + 64]
    if pos + len(tail) < len(text):
        return False
    rest = tail.lstrip()
    return FUNCTION.startswith(rest) or rest.startswith(FUNCTION) and not {">", "\n"} & set(rest[len(FUNCTION):])


def writes_xml_calls(template: str) -> bool:
    """Whether a chat template writes its calls in this form (`<tool_call>` around its calls' `<function=`)."""
    return FUNCTION in template and START in template


class _Reader:
    """The calls of one reply, read in one pass (the module's notes); a stream's reads its reply as it grows
    (`grow`), each tag searched for past where it was searched last, so a delta costs what it adds."""

    def __init__(self, text: str, final: bool = True) -> None:
        self.text, self.final = text, final   # final: the whole reply (else a stream's so far: it may go on)
        self._search = TagSearch()
        self.ran_out = False   # a call read ran to the reply's end open: no later one can close (`XmlFormat._read`)
        # argument tag position -> (the arguments read from there on, the function's end): reading from a place
        # depends on the text alone, so a read that reaches a place read before (a marker inside a value of a call
        # refused) joins it, and the reading of the whole reply stays linear; only whole ones (the text may grow)
        self._rest: dict[int, tuple[list[tuple[str, int, int]], int | None]] = {}
        self._inside: dict[int, int] = {}   # value start -> past the last closing tag found inside it, for good
        self._ends: dict[int, tuple[int, int]] = {}   # value start -> its end, once found (for good: `_value_end`)
        # a stream's functions still open: tag position -> (name, the arguments closed, where reading goes on)
        self._open: dict[int, tuple[str, list[tuple[str, int, int]], int]] = {}
        self._blanks: dict[int, int] = {}   # place -> past the blanks from there, as far as read (`past_blanks`)
        # functions (by their tag's place) and calls (by their marker's) that can never close, whatever a stream's
        # reply goes on with: text after a function's name or argument that is no tag nor a tag's beginning
        self.dead: set[int] = set()

    def past_blanks(self, pos: int) -> int:
        """Where the blanks from `pos` end, read on from where the last look stopped (a stream's run of newlines
        costs a delta what it adds)."""
        self._blanks[pos] = _SPACES.match(self.text, self._blanks.get(pos, pos)).end()
        return self._blanks[pos]

    def grow(self, text: str) -> None:
        """A stream's reply so far, `text` (the last one and more)."""
        self.text, self.ran_out = text, False

    def find(self, tag: str, pos: int) -> int:
        """The first place of `tag` at or after `pos` (-1: none), as `TagSearch` finds it."""
        return self._search.find(self.text, tag, pos)

    def next_call(self, pos: int) -> int:
        """Where the next call may begin from `pos`: a `<tool_call>`, or a `<function=` without it; -1: none."""
        found = [at for at in (self.find(START, pos), self.find(FUNCTION, pos)) if at >= 0]
        return min(found, default=-1)

    def call(self, pos: int) -> tuple[list[Function], int | None]:
        """`tool_call` at a `<tool_call>`; else the function at `pos` alone (a model that left the tag out, as
        Qwen3-Coder does at times: vLLM reads it too)."""
        if self.text.startswith(START, pos):
            return self.tool_call(pos)
        function = self.function(pos)
        return ([], None) if function is None else ([function], function[2])

    def tags(self, pos: int, functions: list[Function]) -> list[int]:
        """Where each of `functions`, the call at `pos`'s (`call`), has its tag: a call's place in the reply, the
        same read from its `<tool_call>` or from its function's own tag (a stream may see either first)."""
        if not self.text.startswith(START, pos):
            return [pos]
        tags, at = [], pos + len(START)
        for function in functions:
            tags.append(self.past_blanks(at))
            at = function[2] if function[2] is not None else at
        return tags

    def tool_call(self, pos: int) -> tuple[list[Function], int | None]:
        """The functions of the `<tool_call>` at `pos` and where it ends (None: no whole function, or its last
        one open); it ends after `</tool_call>`, or after its last function where that tag is left out."""
        functions: list[Function] = []
        end = pos + len(START)
        while True:
            at = self.past_blanks(end)
            function = self.function(at)
            if function is None:
                if not functions:
                    return functions, None
                return functions, at + len(END) if self.text.startswith(END, at) else end
            functions.append(function)
            if function[2] is None:
                if at in self.dead:
                    self.dead.add(pos)
                return functions, None
            end = function[2]

    def function(self, pos: int) -> Function | None:
        """The function whose tag is at `pos` (None: none is): its name, its arguments, its end (None: open)."""
        resumed = self._open.pop(pos, None)   # a stream's: its closed arguments are as they were
        named = self._name(pos, FUNCTION) if resumed is None else (resumed[0], resumed[2])
        if named is None:
            return None
        name, at = named
        arguments: list[tuple[str, int, int]] = [] if resumed is None else resumed[1]
        visited: list[tuple[int, int]] = []   # (argument tag position, how many arguments came before it)
        end: int | None = None
        while True:
            at = self.past_blanks(at)
            if (known := self._rest.get(at)) is not None:
                arguments += known[0]
                end = known[1]
                break
            if self.text.startswith(FUNCTION_END, at):
                end = at + len(FUNCTION_END)
                break
            argument = self._name(at, PARAMETER)
            ends = None if argument is None else self._value_end(argument[1] + self.text.startswith("\n", argument[1]))
            if argument is None:
                tail = self.text[at:at + len(FUNCTION_END)]   # the reply ends here, or in a tag's beginning
                begun = at + len(tail) == len(self.text) and (PARAMETER.startswith(tail) or FUNCTION_END.startswith(tail))
                self.ran_out |= begun
                if not begun and not self.text.startswith(PARAMETER, at):
                    self.dead.add(pos)
            if ends is None:
                break
            visited.append((at, len(arguments)))
            start = argument[1] + self.text.startswith("\n", argument[1])
            arguments.append((argument[0], start, ends[0]))   # its newline before the tag not in it
            at = ends[1]
        if end is not None or self.final:   # a stream's open one may still close: read on from `at` instead
            for place, before in visited:
                self._rest[place] = (arguments[before:], end)
        else:
            self._open[pos] = (name, arguments, at)
        return name, arguments, end

    def _name(self, pos: int, tag: str) -> tuple[str, int] | None:
        """The name written after `tag` at `pos` up to its `>` on its line, and where the tag ends; None if not."""
        if not self.text.startswith(tag, pos):
            return None
        start = pos + len(tag)
        end = self.text.find(">", start, start + MAX_NAME)
        if end < 0 or "\n" in self.text[start:end]:
            self.ran_out |= end < 0 and self.text.find("\n", start, start + MAX_NAME) < 0 and \
                len(self.text) < start + MAX_NAME
            return None
        return self.text[start:end], end + 1

    def _value_end(self, start: int) -> tuple[int, int] | None:
        """(where the value from `start` ends, where what ends it ends: its closing tag, or nothing where the next
        tag closes it); None while none is written. The first newline and tag ends it (the grammar's `VALUE`
        holds none): its closing tag; the next argument's tag or the function's end, that tag left out. A
        closing tag without its newline before it ends it where a tag follows it."""
        if (known := self._ends.get(start)) is not None:
            return known
        tags = [(at, at + 1 + len(tag) if tag == PARAMETER_END else at + 1)
                for tag in (PARAMETER_END, PARAMETER, FUNCTION_END) if (at := self.find("\n" + tag, start)) >= 0]
        lined = min(tags, default=None)
        plain = self.find(PARAMETER_END, self._inside.get(start, start))
        while plain >= 0 and (lined is None or plain <= lined[0]):   # a closing tag without its newline, first
            after = plain + len(PARAMETER_END)
            next_at = _SPACES.match(self.text, after).end()
            if self.final and next_at == len(self.text) or self.text.startswith((PARAMETER, FUNCTION_END), next_at):
                self._ends[start] = (plain, after)
                return plain, after
            tail = self.text[next_at:next_at + len(PARAMETER)]   # not a tag, and not the beginning of one at the end
            if not (next_at + len(tail) == len(self.text) and (PARAMETER.startswith(tail) or
                                                               FUNCTION_END.startswith(tail))):
                self._inside[start] = after   # inside the value, whatever a stream's reply goes on with
            plain = self.find(PARAMETER_END, after)
        self.ran_out |= lined is None
        if lined is not None:
            self._ends[start] = lined
        return lined


class XmlFormat(ToolFormat):
    name = "qwen3_xml"
    start = START
    markers = (START, END)
    # plain text holds neither marker: a `<function=` alone is read as a call too (`_Reader.call`)
    syntax = CallSyntax(f"{START}\n", f"\n{END}", "\n", "arguments",
                        rf"/(?s:.)*/ & ~/(?s:.)*({START}|{FUNCTION})(?s:.)*/")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self._read(text)[:2]

    def example(self) -> str:
        return f"{START}\n{FUNCTION}<function name>>\n{PARAMETER}<argument name>>\n<its value>\n{PARAMETER_END}\n" \
               f"{FUNCTION_END}\n{END}"

    def _read(self, text: str) -> tuple[str | None, list[ToolCall], int | None]:
        """`parse`, and where the call open at the reply's end begins (None: none is)."""
        reader, calls, kept, last, pos, open_at = _Reader(text), [], [], 0, 0, None
        while (found := reader.next_call(pos)) >= 0:
            functions, end = reader.call(found)
            marker = len(START) if text.startswith(START, found) else len(FUNCTION)
            rest = text[found + len(START):].lstrip() if marker == len(START) and len(text) - found <= 64 else "-"
            if end is None and (reader.ran_out or FUNCTION.startswith(rest) and len(rest) < len(FUNCTION)):
                open_at = found   # open to the reply's end: the rest is content (read from each marker: n^2)
                break
            if end is None or any(name not in self.tools for name, _, _ in functions):
                pos = found + marker if end is None else end   # a whole call refused: its markers with it
                continue
            calls += [ToolCall(name, self._json(name, text, args, True), start=tag)
                      for (name, args, _), tag in zip(functions, reader.tags(found, functions))]
            kept.append(text[last:found])
            last = pos = end
        if not calls:
            return text, [], open_at
        return beside_calls("".join(kept) + text[last:]), calls, open_at

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside a call (the one open at its end: a marker in a value of it is
        not another) ends in its functions whole so far and the one it was writing,
        of the arguments closed so far (`ToolCall.cut`); one whose name is not yet whole or not offered is
        dropped: a stream held that text back, and it was never content. The marker in prose stays content."""
        content, calls, begin = self._read(text)
        if not cut or begin is None:
            return content, calls
        content, calls, _ = self._read(text[:begin])
        reader = _Reader(text)
        functions = reader.call(begin)[0]
        for (name, args, end), tag in zip(functions, reader.tags(begin, functions)):
            if name not in self.tools:
                break
            calls.append(ToolCall(name, self._json(name, text, args, True), cut=end is None, start=tag))
        return (beside_calls(content or "") if calls else content), calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, Any] | None = None) -> Iterator[CallScan]:
        """Each call from `pos` as far as written: its name, then its arguments' JSON of those closed so far
        (`args_text`, a prefix of its final `arguments`: an argument goes out once its closing tag is written).
        A stream's `scanners` keep (at key -1) its reader, each argument's JSON and each call's JSON as last
        written (rebuilt when an argument closes), and how far each look past markers in prose went (`_next_open`):
        a delta costs what it adds."""
        reader, items, written, skips = self._state(text, scanners)
        while (found := self._next_open(reader, pos, skips)) >= 0:
            functions, end = reader.call(found)
            for (name, args, function_end), tag in zip(functions, reader.tags(found, functions)):
                if not args and function_end is None and not text.startswith(
                        PARAMETER, reader.past_blanks(tag + len(FUNCTION) + len(name) + 1)):
                    yield CallScan(name=name, start=tag)   # not begun until a tag follows its name (JSON may)
                    return
                shape = (len(args), function_end is not None)
                if written.get(tag, (None,))[0] != shape:
                    written[tag] = (shape, self._json(name, text, args, shape[1], items))
                yield CallScan(name=name, args_start=0, args_text=written[tag][1], end=function_end, start=tag)
            if end is None:
                return
            pos = end

    def hold_from(self, text: str, pos: int = 0, scanners: dict[int, Any] | None = None) -> int:
        reader, _, _, skips = self._state(text, scanners)
        if (found := self._next_open(reader, pos, skips)) >= 0:
            return found
        return len(text) - max(partial_tag(text, START), partial_tag(text, FUNCTION))

    @staticmethod
    def _state(text: str, scanners: dict[int, Any] | None) -> tuple[_Reader, dict, dict, dict[int, int]]:
        """A stream's reading of its reply so far (its `scanners`, key -1), grown to `text`; a fresh one without."""
        state = scanners.get(-1) if scanners is not None else None
        if state is None:
            state = (_Reader(text, final=False), {}, {}, {})
            if scanners is not None:
                scanners[-1] = state
        state[0].grow(text)
        return state

    def _next_open(self, reader: _Reader, pos: int, skips: dict[int, int]) -> int:
        """The first marker from `pos` that is a call or may still open one (-1: none), past markers in prose;
        `skips` keeps where a look from a place went on to, so a reply of many markers in prose costs a stream's
        delta what it adds. Prose for good, as the whole answer reads it: a marker with text after it that opens
        no function, a call that can never close in a function with no argument (`_Reader.dead`: `<function=f>`
        and then JSON), and a call closed whose first function is not offered (passed whole, as `_read` passes
        it). Neither can have a call a stream began (`ToolCallStream` begins a function once an argument's tag
        follows its name, and none after one not offered): those stay, so the stream's calls keep their order."""
        text, start, pos = reader.text, pos, skips.get(pos, pos)
        while (found := reader.next_call(pos)) >= 0:
            bare = not text.startswith(START, found)
            after = found if bare else reader.past_blanks(found + len(START))
            if after >= len(text) or _may_open(text, after):
                break
            functions, end = reader.call(found)
            dead = found in reader.dead and not functions[-1][1]
            if functions and not dead and (end is None or functions[0][0] in self.tools):
                break
            pos = end if functions and end is not None else found + (len(FUNCTION) if bare else len(START))
        skips[start] = found if found >= 0 else pos
        return found

    def _json(self, name: str, text: str, arguments: list[tuple[str, int, int]], closed: bool,
              items: dict[tuple[int, int], str] | None = None) -> str:
        """The JSON object of a call's arguments (their values' places in `text`), each read as its schema says
        (the first of a key wins: what a stream sent stays a prefix of the whole), `closed` or (a stream's) open;
        `items`: each argument's JSON by its value's place, a stream's, read once."""
        tool = self.tools.get(name)
        schema = tool.parameters if tool is not None else {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        written, seen = [], set()
        for key, start, end in arguments:
            if key in seen:
                continue
            seen.add(key)
            item = items.get((start, end)) if items is not None else None
            if item is None:
                value = typed_value(text[start:end], properties.get(key), schema)
                item = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                if items is not None:
                    items[(start, end)] = item
            written.append(item)
        return "{" + ", ".join(written) + ("}" if closed else "")

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            items = argument_rules(schema, f"{i}", rules, TAGS)
            rules.append(f"fn{i}: {literal(f'{FUNCTION}{name}>{chr(10)}')} {items} {literal(FUNCTION_END)}")
        rules += [*TAGS.any_argument("anyparam", "PNAME"), f"VALUE: {_VALUE}"]
        return "\n".join(rules) + "\n"


@dataclass(frozen=True)
class ArgumentTags:
    """How a format of tagged arguments writes one, for its grammars (`argument_rules`): the text before a key's
    name and between it and the value, the text that closes a value (the format's `VALUE` lexeme of any text
    ends in it too), the characters an undeclared key's name may not hold, and whether a key or a string value
    reads back as written (`carried`, `reads_back`); `json_key_close`: between a key's name and a value written as
    JSON where the format marks those apart (DeepSeek V3.2's `string="false"`), else `key_close` for all."""

    key_open: str
    key_close: str
    close: str
    name_excluded: str
    carried: Callable[[Any], bool]
    reads_back: Callable[[str], bool]
    json_key_close: str | None = None

    def any_argument(self, rule: str, name: str) -> list[str]:
        """The rules of an argument of any name (`name`: its lexeme's name) and any text value."""
        return [f"{rule}: {literal(self.key_open)} {name} {literal(self.key_close)} VALUE",
                f"{name}: /[^{self.name_excluded}]{{1,{MAX_NAME - 1}}}/"]


def argument_rules(schema: dict[str, Any], tag: str, rules: list[str], tags: ArgumentTags) -> str:
    """What a function's body holds between its tags (its arguments' rules appended to `rules`); an argument of
    any name is rule `anyparam`, the caller's."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not all(tags.carried(key) for key in properties):
        return "anyparam*"
    required = set(schema.get("required") or ())
    items = []
    for j, (key, prop) in enumerate(properties.items()):
        items.append(f"p{tag}_{j}" + ("" if key in required else "?"))
        key_close = tags.key_close
        if is_text(prop, schema):
            value = _text_rule(resolved(prop, schema), tags)
        else:
            rules.append(f"v{tag}_{j}: %json {schema_text(_standalone(prop, schema))}")
            value, key_close = f"v{tag}_{j} {literal(tags.close)}", tags.json_key_close or tags.key_close
        rules.append(f"p{tag}_{j}: {literal(tags.key_open + key + key_close)} {value}")
    if schema.get("additionalProperties") is not False and properties:   # others after them, under other names
        declared = "|".join("".join("\\" + c if c in _REGEX_META else c for c in key) for key in properties)
        extra, name = tags.any_argument(f"extra{tag}", f"XNAME{tag}")
        rules += [extra, f"{name} & ~/({declared})/"]
        items.append(f"extra{tag}*")
    elif schema.get("additionalProperties") is not False:
        items.append("anyparam*")
    return " ".join(items)


def _carried(key: Any) -> bool:
    """Whether an argument's name reads back as written (`_Reader._name`)."""
    return isinstance(key, str) and 0 < len(key) < MAX_NAME and key == key.strip() and not {">", "\n"} & set(key)


def _text_rule(prop: Any, tags: ArgumentTags) -> str:
    """A value written as text: one of its `enum` strings, its `const`, or any text; and its closing tag."""
    choices = prop.get("enum") if isinstance(prop, dict) else None
    if isinstance(prop, dict) and isinstance(prop.get("const"), str):
        choices = [prop["const"]]
    if isinstance(choices, list) and choices and all(isinstance(v, str) and tags.reads_back(v) for v in choices):
        return "(" + " | ".join(literal(v) if v else '""' for v in choices) + f") {literal(tags.close)}"
    return "VALUE"


def _reads_back(value: str) -> bool:
    """Whether a string value written as text reads back whole (no newline and tag in it: `_Reader._value_end`)."""
    return not any(f"\n{tag}" in value for tag in (PARAMETER_END, FUNCTION_END, PARAMETER))


TAGS = ArgumentTags(PARAMETER, ">\n", "\n</parameter>\n", ">\\n", _carried, _reads_back)


_ROOT = "#/$defs/__arguments"   # where a property's `%json` finds the whole arguments schema its refs point into


def _standalone(prop: Any, root: dict[str, Any]) -> dict[str, Any]:
    """A property's schema on its own, for its `%json` value, lenient (what the library cannot enforce is not: a
    schema not strict). Its local `$ref`s meant the arguments schema's root ("#/$defs/X", "#/properties/a", "#"):
    that root goes with it, under `$defs`, and they are rebased onto it (`rebased`, as the JSON formats' are)."""
    standalone = dict(prop) if isinstance(prop, dict) else {}
    if '"$ref"' in json.dumps(standalone):
        defs = standalone.get("$defs") if isinstance(standalone.get("$defs"), dict) else {}
        standalone = {**rebased(standalone, _ROOT), "$defs": {**defs, "__arguments": rebased(root, _ROOT)}}
    guidance = standalone.get("x-guidance") if isinstance(standalone.get("x-guidance"), dict) else {}
    return {**standalone, "x-guidance": {**guidance, "lenient": True}}
