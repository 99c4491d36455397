"""The grammars of tool calls: Lark grammars (llguidance's dialect) built from a format's `CallSyntax` and
the offered functions as (name, arguments schema) pairs. Plain data in, a `StructuredOutput` out: the
formats and the requests live in `gateway.openai.tools`.

- **forced** (tool_choice "required" or a named function): calls only, one or (parallel) several;
- **auto** (tool_choice "auto" with at least one `strict` tool): EITHER plain text that never starts a
  call (the format's `text` lexeme) or a JSON reply (the request's response_format), OR calls only, as
  forced. A strict function's arguments follow its schema; the caller gives any other `ANY_OBJECT`, so a
  call always parses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.structured import JSON_OPTIONS, StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}   # the arguments of a function that is not strict


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls, for a grammar: the literal text before and after each call's JSON
    object ("" where a call is the bare object), the text between two calls, the key of the arguments,
    and `text`, a Lark lexeme (regex, llguidance's `&` and `~` allowed) of plain text that never starts
    a call."""

    open: str
    close: str
    separator: str
    args_key: str
    text: str

    @property
    def is_bare(self) -> bool:
        """A call is a bare JSON object: a JSON reply could not be told from one."""
        return not self.open


def _call_schema(functions: Sequence[tuple[str, dict[str, Any]]], args_key: str) -> dict[str, Any]:
    """One call: {"name": <one of the functions>, args_key: <its arguments schema>}, name first."""
    options = [{"type": "object", "properties": {"name": {"const": name}, args_key: schema},
                "required": ["name", args_key], "additionalProperties": False} for name, schema in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_grammar(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]],
                   parallel: bool) -> StructuredOutput:
    """Calls only: one, or (parallel) one or more."""
    return StructuredOutput("grammar", f"start: calls\n{_calls(syntax, functions, parallel)}")


def auto_grammar(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool,
                 reply: StructuredOutput | None = None) -> StructuredOutput:
    """Plain text that never starts a call (or, given `reply`, a JSON object or schema's JSON) or calls only."""
    if reply is None:
        text = f"text: TEXT\nTEXT: {syntax.text}"
    else:
        schema = ANY_OBJECT if reply.kind == "json_object" else json.loads(reply.spec)
        text = f"text: %json {_schema_text(schema)}"
    return StructuredOutput("grammar", f"start: text | calls\n{text}\n{_calls(syntax, functions, parallel)}")


def _calls(syntax: CallSyntax, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """The Lark rules `calls` (one call, or one or more joined by the separator), `call` and `body`."""
    calls = f"calls: call ({_literal(syntax.separator)} call)*" if parallel else "calls: call"
    call = " ".join(filter(None, (_literal(syntax.open), "body", _literal(syntax.close))))
    return f"{calls}\ncall: {call}\nbody: %json {_schema_text(_call_schema(functions, syntax.args_key))}\n"


def _literal(text: str) -> str:
    """`text` as a Lark string ("" where it is empty: nothing to write)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _schema_text(schema: dict[str, Any] | bool) -> str:
    """A JSON schema for a Lark `%json` block, written compactly as the structured outputs are."""
    if isinstance(schema, bool):   # true: any JSON; false: none (the library refuses it)
        return _schema_text({}) if schema else "false"
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
