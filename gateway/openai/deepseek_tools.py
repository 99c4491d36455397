"""DeepSeek's tool calls: a turn's calls in one block of its marker tokens, each a function's name and its arguments
as the JSON object OpenAI sends, in two forms:

- **deepseek_v31** (vLLM's `deepseek_v31` parser), DeepSeek-V3.1's template:

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- **deepseek_v3** (vLLM's `deepseek_v3` parser), DeepSeek-V3-0324's and R1-0528's: the call's type before the
  separator, the name on its line, the arguments in a fenced JSON block:

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Found by `<｜tool▁calls▁begin｜>` in the template, the fence telling the forms apart (`deepseek_format`). The turns
are read as `gateway.openai.tagged_tools` reads MiniMax-M2's blocks, each function by `_JsonCall`: its name (one
word), then its arguments' object, read as the reply grows (`CallScanner`: strings and nesting), which must be a
JSON object, then its closing markers, blanks allowed between them; anything else where they belong makes the turn
prose. A call's `arguments` are the model's own text of the object, sent in pieces as it is written (a stream
begins the call at its `{`), as hermes' are. The grammars of forced and strict calls write the template's form, the
arguments under each function's schema (a history's arguments, which the templates join to text with `+`, are given
as their JSON: `gateway.openai.chat_prompt.HistoryArguments`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.openai.call_scan import CallScanner, TagSearch, loads
from gateway.openai.tagged_tools import TaggedFormat, TagForm, _may_begin, _past_blanks, _Reading, word_before
from gateway.openai.tool_grammar import ANY_OBJECT, literal, schema_text
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import CallScan, ToolCall

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE, FENCE_END = "```json", "```"   # deepseek_v3's, around the arguments
_NOT_IN_NAMES = " \t\r\n<>{}\"`"


def writes_deepseek_calls(template: str) -> bool:
    """Whether a chat template writes its calls in one of DeepSeek's forms."""
    return CALLS in template


def deepseek_form(fenced: bool) -> TagForm:
    """DeepSeek-V3's form (`fenced`: the type, the name on its line, the arguments in a JSON fence) or V3.1's."""
    return TagForm("deepseek_v3" if fenced else "deepseek_v31", CALL, SEP, CALL_END, "", "", "", "",
                   block=(CALLS, CALLS_END), line="")


@dataclass
class _JsonCall:
    """One function of a DeepSeek turn as far as read (`stage`: 0 its name, 1 the fence's opening, 2 its arguments,
    3 the fence's closing, 4 its end marker), where reading goes on, where its arguments' object begins and ends,
    its end (None: open), and `dead`: text where a marker or the object belongs."""

    form: TagForm
    start: int
    name: str | None = None
    stage: int = 0
    at: int = 0
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    dead: bool = False
    scanner: CallScanner | None = None

    @staticmethod
    def function_name(written: str) -> str:
        """The function a call's written name names (Kimi's id, Mistral's name and id: theirs say)."""
        return written

    @property
    def fenced(self) -> bool:
        return self.form.name == "deepseek_v3"

    def read_on(self, text: str, search: TagSearch) -> None:
        steps = (self._name, self._fence, self._arguments, self._fence_end, self._end)
        while self.end is None and not self.dead and steps[self.stage](text):
            self.stage += 1 if self.fenced or self.stage not in (0, 2) else 2   # V3.1 has no fence

    def _name(self, text: str) -> bool:
        """The name: after the call's type and the separator, to its line's end (deepseek_v3); up to the
        separator (deepseek_v31, and a form of the same shape: `gateway.openai.mistral_tools`)."""
        begin, close = self.start + len(self.form.function), self.form.name_close or ""
        if self.fenced:
            kind = self._word(text, begin, close)
            if kind is None:
                return False
            found = self._word(text, kind[1], "\n")
        else:
            found = self._word(text, begin, close)
        if found is not None:
            self.name, self.at = self.function_name(found[0]), found[1]
        return found is not None

    def _word(self, text: str, begin: int, close: str) -> tuple[str, int] | None:
        """The word from `begin` up to `close` and where `close` ends (None: not yet written, or dead)."""
        self.dead, found = word_before(text, begin, close, _NOT_IN_NAMES)
        return found

    def _expect(self, text: str, tag: str) -> bool:
        """`tag` after blanks: read past it (False: not yet written, or something else is: dead)."""
        at = self.at = _past_blanks(text, self.at)
        if text.startswith(tag, at):
            self.at = at + len(tag)
            return True
        self.dead = not _may_begin(text, at, (tag,))
        return False

    def _fence(self, text: str) -> bool:
        return self._expect(text, FENCE)

    def _arguments(self, text: str) -> bool:
        """The arguments' object, to where it closes (dead: not an object, or not JSON)."""
        if self.scanner is None:
            if not self._expect(text, "{"):
                return False
            self.args_start = self.at - 1
            self.scanner = CallScanner(self.args_start, ())
        end = self.scanner.read(text).end
        if end is None:
            return False
        self.dead = not isinstance(loads(text[self.args_start:end]), dict)
        self.args_end = self.at = end
        return not self.dead

    def _fence_end(self, text: str) -> bool:
        return self._expect(text, FENCE_END)

    def _end(self, text: str) -> bool:
        """Its end marker after blanks; a form without one ends with the arguments' object."""
        if not self.form.function_end:
            self.end = self.args_end
        elif self._expect(text, self.form.function_end):
            self.end = self.at
        return False


class JsonTagFormat(TaggedFormat):
    """Calls in a `TagForm`'s markers whose arguments are one JSON object (DeepSeek's, the module's notes; Mistral's
    `[ARGS]` form, `gateway.openai.mistral_tools`): `TaggedFormat`'s turns, each function read by `_JsonCall`."""

    call_type = _JsonCall

    @staticmethod
    def _begun(call: Any) -> bool:
        """Whether a stream has begun the call: once its arguments' `{` is written."""
        return call.args_start is not None

    def _scan(self, call: Any, text: str, reading: _Reading) -> CallScan:
        """A stream's view of a call: its arguments' text as written so far, from its `{` (none before)."""
        return CallScan(name=call.name, args_start=call.args_start, args_end=call.args_end, end=call.end,
                        start=call.start)

    def _arguments(self, call: Any, text: str, reading: _Reading) -> str:
        """The model's own text of a call's arguments (as far as written, where max_tokens cut it)."""
        if call.args_start is None:
            return ""
        return text[call.args_start:call.args_end if call.args_end is not None else len(text)]

    grammar_rules: tuple[str, ...] = ()   # Lark rules `_head` names (Kimi's call index)

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`TaggedFormat.parse_reply`, each call under the id a stream gives it (`stream_call_id`: Kimi's and
        Mistral's the one the model wrote)."""
        content, calls = super().parse_reply(text, cut)
        for call in calls:
            call.id = self.stream_call_id(text, call.start)
        return content, calls

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions))), *self.grammar_rules]
        for i, (name, schema) in enumerate(functions):
            strict = {**(schema if schema else ANY_OBJECT), "x-guidance": {"lenient": True}}
            rules.append(f"args{i}: %json {schema_text(strict)}")
            tail = literal(self._around(name)[1])
            rules.append(" ".join(filter(None, (f"fn{i}:", self._head(name), f"args{i}", tail))))
        return "\n".join(rules) + "\n"

    def _head(self, name: str) -> str:
        """The Lark expression of what a call of `name` writes before its arguments (after the opening marker)."""
        return literal(self._around(name)[0])

    def _around(self, name: str) -> tuple[str, str]:
        """What a call of `name` writes before its arguments' object (after the opening marker) and after it."""
        return name + (self.form.name_close or ""), ""

    def example(self) -> str:
        head, tail = self._around("<function name>")
        return f"{self.syntax.open}{head}{{<its arguments>}}{tail}{self.syntax.close}"


class DeepseekFormat(JsonTagFormat):
    """DeepSeek's calls (the module's notes)."""

    def __init__(self, tools: list[Tool], fenced: bool) -> None:
        super().__init__(tools, deepseek_form(fenced))

    def _around(self, name: str) -> tuple[str, str]:
        if self.form.name == "deepseek_v3":
            return f"function{SEP}{name}\n{FENCE}\n", f"\n{FENCE_END}"
        return super()._around(name)
