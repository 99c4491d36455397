"""DeepSeek V3.2's tool calls (`deepseek_v32`; vLLM's and SGLang's `deepseekv32` parsers): DSML tags, a turn's calls in
one block, each argument marked as a string or as JSON:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

MiniMax-M2's form (`gateway.openai.tagged_tools`) under DSML's tags, read, streamed and cut as it is; found by `｜DSML｜`
in a chat template (DeepSeek's repository ships a Python encoder, not a template: a pool names a Jinja one with its
`chat_template` key). A value marked `string="true"` is its text as written; one marked `string="false"` its JSON
(its text where it is not JSON), whatever the schema says: the model's mark decides, as DeepSeek's encoder reads it
back. The grammars of forced and strict calls mark each declared argument as its schema's type is written (text:
`true`; JSON: `false`), an undeclared one as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.openai.tagged_tools import TagForm, TaggedFormat, _Call, _may_begin
from gateway.openai.tool_specs import Tool
from gateway.openai.xml_tools import MAX_NAME

__all__ = ["DSML", "DSML_FORM", "DsmlFormat", "writes_dsml_calls"]

DSML = "｜DSML｜"
DSML_FORM = TagForm("deepseek_v32", f'<{DSML}invoke name="', '">', f"</{DSML}invoke>", f'<{DSML}parameter name="',
                    '" string="true">', "", f"</{DSML}parameter>",
                    block=(f"<{DSML}function_calls>", f"</{DSML}function_calls>"))
JSON_KEY_CLOSE = '" string="false">'   # after a key whose value is written as JSON


def writes_dsml_calls(template: str) -> bool:
    """Whether a chat template writes its calls in DSML tags (`｜DSML｜` in it, however it builds the tags)."""
    return DSML in template


@dataclass
class _DsmlCall(_Call):
    """MiniMax's reading of a function, each key closed by either mark; `json_values`: where each value marked
    `string="false"` starts."""

    json_values: set[int] = field(default_factory=set)

    def _key(self, text: str, at: int) -> bool:
        """Read the key at `at` and its mark, and open its value (False: not written yet, or the call is dead)."""
        form, begin = self.form, at + len(self.form.key)
        end = text.find('"', begin, begin + MAX_NAME + 1)
        if end < 0:
            self.dead = len(text) >= begin + MAX_NAME + 1
            return False
        for close in (form.key_close, JSON_KEY_CLOSE):
            if text.startswith(close, end):
                start = end + len(close)
                self.value = (text[begin:end].strip(), start)
                if close == JSON_KEY_CLOSE:
                    self.json_values.add(start)
                return True
        self.dead = not _may_begin(text, end, (form.key_close, JSON_KEY_CLOSE))
        return False


class DsmlFormat(TaggedFormat):
    """DeepSeek V3.2's calls (the module docstring)."""

    call_type = _DsmlCall

    def __init__(self, tools: list[Tool]) -> None:
        super().__init__(tools, DSML_FORM)
        self._tags = replace(self._tags, json_key_close=JSON_KEY_CLOSE)

    def _value(self, call: Any, text: str, start: int, end: int, prop: Any, schema: dict[str, Any]) -> Any:
        """The text as written where it is marked a string; its JSON where marked JSON (its text where not JSON)."""
        written = text[start:end]
        if start not in call.json_values:
            return written
        try:
            return json.loads(written)
        except ValueError:
            return written
