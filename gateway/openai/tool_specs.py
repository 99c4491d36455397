"""A chat request's `tools` and `tool_choice`: msgspec models of OpenAI's shapes, read into `Tool`s and a `ToolChoice`.

The models check shapes and types (`tools[0].function.strict: expected a boolean, got integer`); the code
here checks what a model cannot say: OpenAI's rule for function names, each offered once, at most
`MAX_TOOLS`, a parameters schema the grammar library can enforce, a named choice among the offered tools.
Objects inside a request (a tool, a call in the history) ignore keys they do not know, as OpenAI's SDKs
may add some; the request itself refuses them (`gateway.openai.chat`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from engine.structured import StructuredOutput, check
from pools.config.typed import FieldError, convert

MAX_TOOLS = 128
MAX_CACHED_SCHEMAS = 512          # parameter schemas whose check `schema_error` remembers
MAX_CACHED_REASON_CHARS = 1024    # a longer reason is not remembered (the library's reasons may quote the schema)
_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")   # OpenAI's rule for function names (`fullmatch`: "f\n" is not one)


class ToolError(ValueError):
    """A bad `tools` or `tool_choice`; the message starts with the field's path."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]   # a JSON schema of the arguments object
    strict: bool = False         # its calls follow `parameters` under tool_choice "auto" too

    def as_template_dict(self) -> dict[str, Any]:
        """The form HF chat templates take in `tools=`: OpenAI's, keys in OpenAI's order (name, description,
        parameters), as a client's own tool dict has them: a template that writes `tool | tojson` (Qwen's)
        writes them in this order."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                 # "none", "auto", "required" or "function"
    name: str | None = None   # mode "function": the function that must be called
    allowed: tuple[str, ...] | None = None   # "auto" / "required" of `allowed_tools`: the functions it may call


class FunctionSpec(msgspec.Struct):
    """A function a request offers (chat's `tools[i].function`, the deprecated `functions[i]`); other keys
    are ignored."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments; None: an object
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, tag_field="type", tag="function"):
    """`tool_choice` {"type": "function", "function": {"name": ...}}: that function must be called."""

    function: FunctionName


class AllowedFunction(msgspec.Struct):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(msgspec.Struct):
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction]


class AllowedToolsChoice(msgspec.Struct, tag_field="type", tag="allowed_tools"):
    """`tool_choice` {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: all the tools are shown (the
    prompt, and its cached prefix, stay those of the whole list), and only these may be called, as `mode` says."""

    allowed_tools: AllowedTools


ToolMode = Literal["none", "auto", "required"]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"   # JSON text, as OpenAI sends it


class ToolCallSpec(msgspec.Struct):
    """A call in an assistant message of the history; other keys (`type`, a stream's `index`) are ignored."""

    function: FunctionCall
    id: str | None = None


def parse_tools(value: Any, param: str = "tools") -> list[Tool]:
    """OpenAI's `tools` (decoded JSON, function tools only) as `Tool`s; ToolError naming the field."""
    try:
        specs = convert(value, list[ToolSpec], root=param)
    except FieldError as exc:
        raise ToolError(str(exc)) from None
    return tools_from([spec.function for spec in specs], param)


def tools_from(functions: list[FunctionSpec], param: str = "tools", inner: str = ".function") -> list[Tool]:
    """The offered functions (`param[i]{inner}`) as `Tool`s, checked: OpenAI's names, each once, and
    parameter schemas the grammar library can enforce; ToolError naming the field."""
    if not functions:
        raise ToolError(f"{param}: expected a non-empty array of tools")
    if len(functions) > MAX_TOOLS:
        raise ToolError(f"{param}: at most {MAX_TOOLS} tools, got {len(functions)}")
    tools: list[Tool] = []
    for i, function in enumerate(functions):
        where, name = f"{param}[{i}]{inner}", function.name
        if not _NAME.fullmatch(name):
            raise ToolError(f"{where}.name: must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if any(tool.name == name for tool in tools):
            raise ToolError(f"{where}.name: {name!r} is offered twice")
        parameters = {"type": "object", "properties": {}} if function.parameters is None else function.parameters
        if parameters.get("type", "object") != "object":   # as OpenAI: the arguments are an object
            raise ToolError(f"{where}.parameters: the arguments are a JSON object: its schema's type must be "
                            f"\"object\", got {parameters['type']!r}")
        if (reason := schema_error(json.dumps(parameters, sort_keys=True), lenient=not function.strict)) is not None:
            raise ToolError(f"{where}.parameters: not a JSON schema we can enforce: {reason}")
        tools.append(Tool(name, function.description, parameters, bool(function.strict)))
    return tools


def parse_tool_choice(value: ToolMode | NamedToolChoice | AllowedToolsChoice | None, tools: list[Tool],
                      name_at: str = "tool_choice.function.name",
                      allowed_at: str = "tool_choice.allowed_tools.tools[{i}].function.name") -> ToolChoice:
    """OpenAI's `tool_choice` as its model read it. Unset: "auto" when tools are given, as OpenAI does; a
    named function, or each allowed one, must be one of `tools` (`name_at`, `allowed_at`: their fields, for the
    error)."""
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        return ToolChoice(value)
    offered = {t.name for t in tools}
    if isinstance(value, AllowedToolsChoice):
        names = [tool.function.name for tool in value.allowed_tools.tools]
        if not names:
            raise ToolError(f"{allowed_at.split('[')[0]}: expected at least one tool, got none")
        for i, name in enumerate(names):
            if name not in offered:
                raise ToolError(f"{allowed_at.format(i=i)}: {name!r} is not one of the tools offered "
                                f"({', '.join(t.name for t in tools)})")
        return ToolChoice(value.allowed_tools.mode, allowed=tuple(dict.fromkeys(names)))
    name = value.function.name
    if name not in offered:
        raise ToolError(f"{name_at}: {name!r} is not one of the tools offered ({', '.join(t.name for t in tools)})")
    return ToolChoice("function", name)


def history_calls(calls: list[ToolCallSpec]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in the history, as the templates take them (an id where none
    was given)."""
    return [{"id": call.id or f"call_{i}", "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for i, call in enumerate(calls)]


# `schema_error`'s memory, by a 16-byte digest of the schema's text, not the text: a client may send a distinct
# schema of up to `gateway.max_body_bytes` (8 MiB) in each request, and a cache keyed by the text kept each for
# the process's life (512 of 8 MiB: 4 GiB). The digest is blake2b's, as `StructuredOutput.key` (which keys the
# gateway's grammar checks): a result comes back identical, and a collision is out of reach. The library's reasons
# may quote the schema ("Unknown format: xxx…"), so only short ones are kept: a schema refused with a long reason
# is checked again when sent again (a repeat costs what a new schema costs). At most MAX_CACHED_SCHEMAS x (digest
# + MAX_CACHED_REASON_CHARS): under 1 MiB. Any thread may call; the lock guards the dict, not the check.
_checked: OrderedDict[bytes, str | None] = OrderedDict()
_checked_lock = threading.Lock()


def schema_error(schema_text: str, lenient: bool = False) -> str | None:
    """Why the JSON schema `schema_text` cannot be enforced (the grammar library's reason), or None; `lenient`
    (a tool not strict): what the library cannot enforce is no reason. Remembered (`_checked`, by digest): an
    agent sends the same tools every turn."""
    digest = hashlib.blake2b(f"{lenient:d}{schema_text}".encode("utf-8", "surrogatepass"), digest_size=16).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return _checked[digest]
    reason = _schema_error(schema_text, lenient)
    if reason is None or len(reason) <= MAX_CACHED_REASON_CHARS:
        with _checked_lock:
            _checked[digest] = reason
            while len(_checked) > MAX_CACHED_SCHEMAS:
                _checked.popitem(last=False)
    return reason


def _schema_error(schema_text: str, lenient: bool) -> str | None:
    try:
        check(StructuredOutput.json_schema(json.loads(schema_text), lenient=lenient))
    except ValueError as exc:
        return str(exc).removeprefix("structured output: ")
    return None
