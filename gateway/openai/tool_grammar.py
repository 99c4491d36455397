"""The grammars of tool calls: Lark grammars (llguidance's dialect) built from a format's `CallSyntax` and
the offered functions as (name, arguments schema) pairs. Plain data in, a `StructuredOutput` out: the
formats and the requests live in `gateway.openai.tools`.

- **forced** (tool_choice "required" or a named function): calls only, one or (parallel) several;
- **none** (tool_choice "none" beside tools, a format whose calls open with a marker): plain text only,
  so the model the template taught to call writes no call the gateway would pass on as text;
- **auto** (tool_choice "auto" with at least one `strict` tool): EITHER plain text that never starts a
  call (the format's `text` lexeme) or a JSON reply (the request's response_format), OR calls, as
  forced, after some plain text where the format has a marker that opens a call (hermes' "I'll look
  that up." before `<tool_call>`; a format of bare JSON calls: calls only). A strict function's arguments
  follow its schema; the caller gives any other `ANY_OBJECT`, so a call always parses. The text before
  the calls and the first call's opening marker are one lexeme (`LEAD`): a lexeme of text alone would
  have taken the marker's first characters as text before the marker could be told from it.

A thinking model (`gateway.openai.reasoning`) writes its `<think>…</think>` block (its template's tags:
`Think.tags`) before the reply, and a grammar of the reply alone would forbid it (or, with the template's
generation prompt inside the block, make the model answer there). `think` says where the reply starts: a
`Think` not `opened` (or "optional": it may open a block first), `opened` (or "opened": the prompt opened one:
the reply thinks and then closes it), None (no thinking). The block is one lexeme, any text without the closing
tag, whitespace around it included; plain text may not begin with the opening tag (so a block is always read as
one, and no second block follows the first).
`thinking_first` puts the same block before a JSON reply (response_format alone). As vLLM does with a
reasoning parser, only what follows the block is constrained."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.structured import JSON_OPTIONS, StructuredOutput
from gateway.openai.reasoning import Think, as_think

ANY_OBJECT: dict[str, Any] = {"type": "object"}   # the arguments of a function that is not strict


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls, for a grammar: the literal text before and after each call's JSON
    object ("" where a call is the bare object), the text between two calls, the key of the arguments,
    `text`, a Lark lexeme (regex, llguidance's `&` and `~` allowed) of plain text that never starts
    a call, and the text before a turn's first call and after its last (Mistral's array: `[TOOL_CALLS] [`, `]`)."""

    open: str
    close: str
    separator: str
    args_key: str
    text: str
    first: str = ""
    last: str = ""

    @property
    def is_bare(self) -> bool:
        """A call is a bare JSON object: a JSON reply could not be told from one."""
        return not (self.open or self.first)


def _call_schema(functions: Sequence[tuple[str, dict[str, Any]]], args_key: str) -> dict[str, Any]:
    """One call: {"name": <one of the functions>, args_key: <its arguments schema>}, name first. Each
    arguments schema sits inside this one, the root its local `$ref`s ("#/$defs/X", "#") resolve against:
    they are rebased onto where it sits (`rebased`), so that they mean what they meant alone."""
    def option(name: str, schema: dict[str, Any], at: str) -> dict[str, Any]:
        arguments = rebased(schema if "type" in schema else {"type": "object", **schema}, at)   # an object, always
        return {"type": "object", "properties": {"name": {"const": name}, args_key: arguments},
                "required": ["name", args_key], "additionalProperties": False}

    if len(functions) == 1:
        return option(*functions[0], f"#/properties/{args_key}")
    return {"anyOf": [option(name, schema, f"#/anyOf/{i}/properties/{args_key}")
                      for i, (name, schema) in enumerate(functions)]}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})   # their values are JSON data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rebased(schema: Any, at: str) -> Any:
    """`schema` with each local `$ref` ("#", "#/" and a JSON pointer) made relative to `at`, the pointer to
    where the schema now sits (a schema without one comes back as it was; a remote ref or an anchor's "#name"
    is left alone)."""
    if isinstance(schema, list):
        return [rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):   # a pointer
            out[key] = at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):   # names (any, "enum" too) to schemas
            out[key] = {name: rebased(sub, at) for name, sub in value.items()}
        else:
            out[key] = rebased(value, at)
    return out




def regex_text(text: str) -> str:
    """`text`, literally, inside a /regex/ of the grammar."""
    return re.escape(text).replace("/", r"\/")


def _thought(end: str) -> str:
    """The thought: any text without the closing tag `end` (llguidance's lexeme operators `&` and `~`), then it."""
    return rf'(/(?s:.)*/ & ~/(?s:.)*{regex_text(end)}(?s:.)*/) {json.dumps(end, ensure_ascii=False)} /\s*/'


def _think(think: Think | str | None) -> tuple[str, str]:
    """(what `start` begins with, the lexeme it names) for a reply that starts as `think` says."""
    think = as_think(think)
    if think is None:
        return "", ""
    if think.opened:
        return "THOUGHT ", f"THOUGHT: {_thought(think.end)}\n"
    return "THINK? ", f"THINK: /\\s*/ {json.dumps(think.start, ensure_ascii=False)} {_thought(think.end)}\n"


def forced_grammar(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]],
                   parallel: bool, think: Think | str | None = None, body: str | None = None) -> StructuredOutput:
    """Calls only: one, or (parallel) one or more (after a think block, as `think` says). `body`: the Lark rules
    of what a call holds between its markers (rule `body`), for a format whose calls are not JSON objects
    (`gateway.openai.xml_tools`); None: the JSON object of a function's name and arguments."""
    head, block = _think(think)
    return StructuredOutput("grammar", f"start: {head}calls\n{block}{_calls(syntax, functions, parallel, body)}")


def auto_grammar(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool,
                 reply: StructuredOutput | None = None, think: Think | str | None = None,
                 body: str | None = None) -> StructuredOutput:
    """Plain text that never starts a call (or, given `reply`, a JSON object or schema's JSON), or calls, after
    plain text where the format opens a call with a marker (`reply` not given) (after a think block, as `think`
    says)."""
    head, block = _think(think)
    choices = "text | calls"
    if reply is None:
        lexeme = _text_lexeme(syntax, think)
        text = f"text: TEXT\nTEXT: {lexeme}"
        if not syntax.is_bare:   # some text, then the first call's marker, then as forced
            more = f" ({literal(syntax.separator)} call)*" if parallel else ""
            choices += " | led"
            text += (f"\nled: LEAD body {literal(syntax.close)}{more} {literal(syntax.last)}\n"
                     f"LEAD: (({lexeme}) & /(?s:.)+/) {literal(syntax.first + syntax.open)}")
    else:
        text = f"text: %json {schema_text(_reply_schema(reply))}"
    return StructuredOutput("grammar", f"start: {head}({choices})\n{block}{text}\n"
                                       f"{_calls(syntax, functions, parallel, body)}")


def text_grammar(syntax: CallSyntax, think: Think | str | None = None) -> StructuredOutput:
    """Plain text that never starts a call (after a think block, as `think` says): tool_choice "none", where
    the template taught the model the format's calls."""
    head, block = _think(think)
    return StructuredOutput("grammar", f"start: {head}text\n{block}text: TEXT\nTEXT: {_text_lexeme(syntax, think)}\n")


def _text_lexeme(syntax: CallSyntax, think: Think | str | None) -> str:
    """The format's plain text, which a thinking model's may not begin with its opening tag (the block is read as
    one, and no second block follows it)."""
    think = as_think(think)
    return syntax.text if think is None else rf"({syntax.text}) & ~/\s*{regex_text(think.start)}(?s:.)*/"


def thinking_first(reply: StructuredOutput, think: Think | str) -> StructuredOutput:
    """A JSON reply (response_format: a JSON object or a schema's JSON) after a think block, as `think`
    says."""
    head, block = _think(think)
    schema = schema_text(_reply_schema(reply))
    return StructuredOutput("grammar", f"start: {head}reply\n{block}reply: %json {schema}\n")


def _reply_schema(reply: StructuredOutput) -> dict[str, Any] | bool:
    if reply.kind not in ("json_object", "json_schema"):
        raise ValueError(f"a JSON reply: kind json_object or json_schema, got {reply.kind!r}")
    return ANY_OBJECT if reply.kind == "json_object" else json.loads(reply.spec)


def _calls(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool,
           body: str | None = None) -> str:
    """The Lark rules `calls` (one call, or one or more joined by the separator), `call` and `body` (given, or
    the JSON object of a call)."""
    calls = f"calls: {literal(syntax.first)} call ({literal(syntax.separator)} call)* {literal(syntax.last)}" \
        if parallel else f"calls: {literal(syntax.first)} call {literal(syntax.last)}"
    call = " ".join(filter(None, (literal(syntax.open), "body", literal(syntax.close))))
    if body is None:
        # lenient: a strict tool's schema was checked as strict (`tools_from`); what is left unenforced is another's
        schema = schema_text({**_call_schema(functions, syntax.args_key), "x-guidance": {"lenient": True}})
        body = f"body: %json {schema}\n"
    return f"{calls}\ncall: {call}\n{body}"


def literal(text: str) -> str:
    """`text` as a Lark string ("" where it is empty: nothing to write)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def schema_text(schema: dict[str, Any] | bool) -> str:
    """A JSON schema for a Lark `%json` block, written compactly as the structured outputs are (its own
    `x-guidance` kept: a schema not strict is `lenient`, `StructuredOutput.json_schema`)."""
    if isinstance(schema, bool):   # true: any JSON; false: none (the library refuses it)
        return schema_text({}) if schema else "false"
    return json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}, ensure_ascii=False)
