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

A template writes this form when it names `<function=` (`writes_xml_calls`). An argument's value is its raw text
(one newline after its tag and one before its closing tag are the form's), read as its type in the function's
schema says: a string as written; an integer, number or boolean as JSON; an object or array as JSON or, as the
templates write a history's dict and list values (`| string`), a Python literal; "null" as null where the type
allows it. A value that does not read as its type, or an argument the schema does not name, stays a string, as
vLLM's parser keeps it. A call's `arguments` are the JSON object of what was read (ours, not the model's text),
so a stream sends each call whole, once the reply is complete (`ToolCallStream.finish`); the text before the
first call goes out as it comes.

The grammars (`ToolFormat.grammar`, `auto_grammar`) write the same form: a strict function's arguments in its
schema's order, the required ones always, each value its type's (a string: any text without the closing tag,
one of its `enum` where it has one; the others: JSON under the property's schema); another function's arguments
any named values."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from gateway.openai.errors import nested_over
from gateway.openai.reasoning import partial_tag
from gateway.openai.tool_grammar import CallSyntax, literal, schema_text
from gateway.openai.tools import CallScan, CallScanner, ToolCall, ToolFormat, beside_calls, loads

START, END = "<tool_call>", "</tool_call>"
_SPACE = r"[ \t\r\n]*"
# a call: its function's name, then everything up to the first "</function>" (an argument holds none), then the
# closing tag or the reply's end (a model stopped by its own end-of-call token)
_CALL = re.compile(rf"<tool_call>{_SPACE}<function=([^>\n]+)>((?:(?!</function>).)*)</function>{_SPACE}"
                   rf"(?:</tool_call>|\Z)", re.S)
# an argument: up to its closing tag, or the next argument's tag, or the end (a model that left the tag out)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>((?:(?!</parameter>|<parameter=).)*)(?:</parameter>|(?=<parameter=)|\Z)",
                        re.S)
_OPEN_FUNCTION = re.compile(rf"<tool_call>{_SPACE}<function=([^>\n]+)>", re.S)
# a string value: any text without the closing tag, the tag with it (one lexeme: a lexeme of the text alone
# would take the tag's first characters as text before the tag could be told from it)
_VALUE = r'(/(?s:.)*/ & ~/(?s:.)*\n<\/parameter>(?s:.)*/) "\n</parameter>\n"'


def writes_xml_calls(template: str) -> bool:
    """Whether a chat template writes its calls in this form (its calls' `<function=` tag)."""
    return "<function=" in template


class XmlFormat(ToolFormat):
    name = "qwen3_xml"
    start = START
    markers = (START, END)
    syntax = CallSyntax(f"{START}\n", f"\n{END}", "\n", "arguments", rf"/(?s:.)*/ & ~/(?s:.)*{START}(?s:.)*/")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, last, pos = [], [], 0, 0
        while (found := text.find(START, pos)) >= 0:
            pos = found + len(START)
            match = _CALL.match(text, found)
            if match is None or (name := match.group(1).strip()) not in self.tools:
                continue
            calls.append(ToolCall(name, self._arguments(name, match.group(2)), start=found))
            kept.append(text[last:found])
            last = pos = match.end()
        if not calls:
            return text, []
        return beside_calls("".join(kept) + text[last:]), calls

    def parse_reply(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """`parse`; a reply max_tokens cut inside a call (after the last whole one) ends in a call of the arguments
        whole so far (`ToolCall.cut`), or, its function's name not yet whole or not offered, in nothing: a stream
        held that text back, and it was never content."""
        content, calls = self.parse(text)
        after = max((c.start for c in calls), default=-1)
        begin = text.find(START, _CALL.match(text, after).end() if after >= 0 else 0)
        if not cut or begin < 0:
            return content, calls
        content, calls = self.parse(text[:begin])
        opened = _OPEN_FUNCTION.match(text, begin)
        if opened is not None and (name := opened.group(1).strip()) in self.tools:
            calls = [*calls, ToolCall(name, self._arguments(name, text[opened.end():], whole=False), cut=True,
                                      start=begin)]
        return (beside_calls(content or "") if calls else content), calls

    def call_scans(self, text: str, pos: int, scanners: dict[int, CallScanner] | None = None) -> Iterator[CallScan]:
        return iter(())   # the arguments are JSON of ours, sent whole once the reply ends: nothing streams

    def hold_from(self, text: str) -> int:
        found = text.find(START)
        return found if found >= 0 else len(text) - partial_tag(text, START)

    def _arguments(self, name: str, body: str, whole: bool = True) -> str:
        """The JSON object of a call's arguments (`whole` False: a body max_tokens cut, whose last argument
        counts only once its closing tag is written)."""
        schema = self.tools[name].parameters
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        arguments = {}
        for match in _PARAMETER.finditer(body):
            if not whole and not body.startswith("</parameter>", match.end() - len("</parameter>")):
                break
            value = match.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = match.group(1).strip()
            arguments[key] = typed_value(value, properties.get(key))
        return json.dumps(arguments, ensure_ascii=False)

    def body(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            properties = schema.get("properties")
            if isinstance(properties, dict) and schema.get("additionalProperties") is False:
                required = set(schema.get("required") or ())
                items = []
                for j, (key, prop) in enumerate(properties.items()):
                    items.append(f"p{i}_{j}" + ("" if key in required else "?"))
                    rules.append(f"p{i}_{j}: {literal(f'<parameter={key}>{chr(10)}')} {_value_rule(prop, f'v{i}_{j}')}")
                    if not _is_text(prop):
                        rules.append(f"v{i}_{j}: %json {schema_text(prop if isinstance(prop, dict) else {})}")
                arguments = " ".join(items)
            else:
                arguments = "anyparam*"
            rules.append(f"fn{i}: {literal(f'<function={name}>{chr(10)}')} {arguments} \"</function>\"")
        rules += ['anyparam: "<parameter=" PNAME ">\\n" VALUE', "PNAME: /[^>\\n]+/", f"VALUE: {_VALUE}"]
        return "\n".join(rules) + "\n"


def _is_text(prop: Any) -> bool:
    """Whether an argument's value is written as text (its schema: a string, or no type at all)."""
    types = _types(prop)
    return not types or "string" in types


def _value_rule(prop: Any, rule: str) -> str:
    """What follows an argument's tag in a grammar: its value and closing tag (`rule`: a JSON value's rule)."""
    if not _is_text(prop):
        return f'{rule} "\\n</parameter>\\n"'
    enum = prop.get("enum") if isinstance(prop, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(literal(v) if v else '""' for v in enum) + ') "\\n</parameter>\\n"'
    return "VALUE"


def _types(prop: Any) -> list[str]:
    kind = prop.get("type") if isinstance(prop, dict) else None
    return [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []


def typed_value(text: str, prop: Any) -> Any:
    """An argument's raw text as its schema's type reads it (the module's notes); the text where none does."""
    types = _types(prop)
    if not types or "string" in types:
        return text
    word = text.strip()
    for kind in types:
        if kind == "null" and word.lower() in ("null", "none"):
            return None
        if kind in ("integer", "number", "boolean"):
            value = loads(word.lower() if kind == "boolean" else word)
            if isinstance(value, bool) == (kind == "boolean") and (kind == "boolean" or isinstance(value, int) or
                                                                  kind == "number" and isinstance(value, float)
                                                                  and math.isfinite(value)):
                return value
        if kind in ("object", "array") and isinstance(value := loads(word) or _literal(word),
                                                      dict if kind == "object" else list):
            return value
    return text


def _literal(text: str) -> Any:
    """A Python literal's value as JSON holds it (a template's `| string` of a history's dict or list), or None:
    not a literal, nested too deep, or holding what JSON does not (a set, a tuple key)."""
    try:
        value = json.loads(json.dumps(ast.literal_eval(text), allow_nan=False))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return None if nested_over(value) else value
