"""Kimi K2's tool calls (vLLM's `kimi_k2` parser), Kimi-K2-Instruct-0905's and Kimi-K2-Thinking's templates: a turn's
calls in one section, each its id, then its arguments as the JSON object OpenAI sends:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(on one line: the markers and the arguments follow each other).

An id is `functions.NAME:INDEX`, the index counting the conversation's calls: the function's name is read from it, and
the call is answered under it, as the model wrote it (so the history shows the model its own ids again; one of
another shape, an OpenAI id, where the model wrote none). The templates write each history call's id where the name
goes, and each result as "## Return of ID": a history's ids of another shape (a client's, another model's) reach the
template as `functions.NAME:INDEX` of that call, its result under the same (`history_id`). Found by the section's
marker in the template (`writes_kimi_calls`); read, streamed and written as DeepSeek V3.1's form
(`gateway.openai.deepseek_tools.JsonTagFormat`), the grammars leaving the index to the model."""

from __future__ import annotations

import re
from typing import Any

from gateway.openai.deepseek_tools import JsonTagFormat, _JsonCall
from gateway.openai.tagged_tools import TagForm
from gateway.openai.tool_grammar import literal
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import openai_call_id

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGUMENT, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_FORM = TagForm("kimi_k2", CALL, ARGUMENT, CALL_END, "", "", "", "", block=(SECTION, SECTION_END), line="")
_ID = re.compile(r"functions\.(?P<name>[^:\s]+):\d+")


def writes_kimi_calls(template: str) -> bool:
    """Whether a chat template writes its calls in Kimi K2's form (its calls' section)."""
    return SECTION in template


def function_name(call_id: str) -> str:
    """The function a Kimi call id names: `functions.NAME:INDEX`'s NAME (an id of another shape is the name)."""
    found = _ID.fullmatch(call_id)
    return found["name"] if found else call_id


def history_id(call_id: Any, name: str | None = None, index: int | None = None) -> Any:
    """A history's call id as Kimi's templates show it: one of its shape as it is, another `functions.NAME:INDEX` of
    its call (given its function's name and its place among the conversation's calls; as it is without)."""
    if not isinstance(call_id, str) or _ID.fullmatch(call_id) or name is None or index is None:
        return call_id
    return f"functions.{name}:{index}"


class _KimiCall(_JsonCall):
    """A Kimi function: its id where DeepSeek's name is, the name read from it (`KimiFormat.stream_call_id`: the
    id)."""

    function_name = staticmethod(function_name)


class KimiFormat(JsonTagFormat):
    """Kimi K2's calls (the module's notes)."""

    call_type = _KimiCall
    history_id = staticmethod(history_id)
    grammar_rules = ("INDEX: /[0-9]+/",)

    def __init__(self, tools: list[Tool]) -> None:
        super().__init__(tools, KIMI_FORM)

    def stream_call_id(self, text: str, start: int) -> str:
        """The id the model wrote for the call at `start`, where it has Kimi's shape (else an OpenAI id)."""
        begin = start + len(CALL)
        end = text.find(ARGUMENT, begin)
        return text[begin:end] if end >= 0 and _ID.fullmatch(text[begin:end]) else openai_call_id()

    def _head(self, name: str) -> str:
        return f"{literal(f'functions.{name}:')} INDEX {literal(ARGUMENT)}"   # the index the model's own

    def _around(self, name: str) -> tuple[str, str]:
        return f"functions.{name}:0{ARGUMENT}", ""
