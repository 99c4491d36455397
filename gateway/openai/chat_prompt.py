"""A chat's messages as the pool's chat template takes them, and the prompt it renders (`render`).

- **The developer role**: OpenAI's name for the application's instructions. A template that never names it
  (Qwen3's, Gemma 3's, Llama's: most) would drop such a message or refuse the request, so it becomes a system
  message; where it follows a system message at the start (the Responses API's `instructions`, then a developer
  item) the two are one system message, as templates that take a single leading system message need. A
  template that names the role gets it as sent.
- **Tools**: a template that writes calls in a format we parse (`gateway.openai.tool_formats.written_format`, or
  harmony's) renders the tools and the calls in the history itself (the calls' arguments as the JSON they hold,
  their ids as the template takes them: `native_messages`); where it lists no tools (DeepSeek-V3.1's, whose model
  card leaves that to the application: `lists_tools`), a system message of ours lists them and shows a call in the
  template's own form (`with_listing`). For one that knows none (SmolLM2's, Gemma 3's) or writes another (Granite
  3's `<|tool_call|>`), `fallback_messages` lists the tools in a system message of ours (before the first user
  message's text where the template refuses a system message: Gemma 2's, `takes_system`), writes the history's calls
  in the hermes form and the results as user turns (the results of one turn's calls together in one user turn, as
  Qwen's template groups them, a user message right after them joined to that turn: templates that alternate roles,
  Gemma 3's, refuse two user turns in a row), so the model answers in the form `gateway.openai.tools.HermesFormat`
  parses. Under `tool_choice: "none"` the tools are still listed (a reply may speak of them), with no way to call
  them: the gateway reads no call from such a reply, so the model is told to answer in text (and a grammar keeps it
  to text that starts no call: `gateway.completion.with_grammar`). A template whose calls are bare JSON (Llama
  3.1's: "respond with a JSON for a function call") gets no tools under "none": its own instructions would have the
  reply write a call, which no grammar can keep out (a JSON reply is text too) and the gateway would pass on as
  content (vLLM's `--exclude-tools-when-tool-choice-none`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from engine.chat_template import content_text
from gateway.openai.call_scan import loads
from gateway.openai.harmony import template_speaks_harmony
from gateway.openai.tool_formats import written_format
from gateway.openai.tool_specs import Tool
from pools.tokencount import TokenCounter

_SYSTEM_TOOLS = (
    "You can call functions to answer. These are the functions, as JSON schemas, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with its name and arguments as a JSON object between <tool_call> and </tool_call>:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<the arguments>}}}}\n</tool_call>")
_SYSTEM_TOOLS_FORM = (   # a template that writes calls in a form we read but lists no tools (DeepSeek-V3.1's)
    "You can call functions to answer. These are the functions, as JSON schemas, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with its name and arguments in this form:\n{form}")
_SYSTEM_TOOLS_NO_CALLS = (   # tool_choice "none"
    "These are the functions of this conversation, as JSON schemas, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "None of them can be called in this reply: answer in text.")


def render(tokenizer, messages: list[dict[str, Any]], tools: list[Tool] | None,
           template_kwargs: dict[str, Any] | None = None, flags: dict[str, bool] | None = None,
           calls: bool = True) -> str:
    """The prompt of a chat, rendered the way the pool's template expects (the module's notes).
    `template_kwargs`: the request's `chat_template_kwargs`; `flags`: `add_generation_prompt` and
    `continue_final_message` (default: a generation prompt); `calls` False: tool_choice "none"."""
    messages, tool_dicts = template_inputs(tokenizer, messages, tools, calls)
    return tokenizer.apply_chat_template(messages, tools=tool_dicts, **_variables(template_kwargs, flags))


def prompt_ids(tokenizer, counter: TokenCounter, messages: list[dict[str, Any]], tools: list[Tool] | None,
               template_kwargs: dict[str, Any] | None = None, flags: dict[str, bool] | None = None,
               calls: bool = True) -> list[int]:
    """The token ids of `render`'s prompt, where a control token (`counter.controls`) a client wrote in a
    message, a tool or a variable is its plain text, never the token: only the template and the tokenizer's
    own variables write turns. The model reads "<|im_end|>" in a user's text as the user's words, as
    OpenAI's models do, where HF's `apply_chat_template` + `encode` would end the turn there. A prompt
    without such strings has HF's ids."""
    messages, tool_dicts = template_inputs(tokenizer, messages, tools, calls)
    (messages, tool_dicts, variables), shielded = shield_controls(
        (messages, tool_dicts, dict(template_kwargs or {})), counter)
    text = tokenizer.apply_chat_template(messages, tools=tool_dicts, **_variables(variables, flags))
    return counter.encode_shielded(text, shielded)


def _variables(template_kwargs: dict[str, Any] | None, flags: dict[str, bool] | None) -> dict[str, Any]:
    return {**(template_kwargs or {}), **(flags or {"add_generation_prompt": True})}


def template_inputs(tokenizer, messages: list[dict[str, Any]], tools: list[Tool] | None, calls: bool = True) \
        -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the tools (None: no tools) the pool's template takes (the module's notes); `calls`
    False: tool_choice "none"."""
    source = tokenizer.chat_template_source(use_tools=tools is not None)
    messages = template_roles(messages, source)
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    harmony, fmt = template_speaks_harmony(source), written_format(source, tools or [])
    if fmt is None and not harmony:
        return fallback_messages(messages, tools, calls, takes_system(tokenizer)), None
    native = native_messages(messages, fmt.history_id if fmt is not None else None)
    if not tools or not calls and fmt is not None and fmt.syntax.is_bare:   # module's notes
        return native, None
    if harmony or lists_tools(tokenizer):
        return native, [t.as_template_dict() for t in tools]
    return with_listing(native, tools, calls, takes_system(tokenizer), fmt.example()), None


_TAKES_SYSTEM: dict[str, bool] = {}   # template source -> whether it renders a system message (a few pools' templates)
_PROBE = "cliffguard-system-probe"


_LISTS_TOOLS: dict[str, bool] = {}   # template source -> whether it lists the tools it is given
_PROBE_TOOL = {"type": "function", "function": {"name": "cliffguard_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def lists_tools(tokenizer) -> bool:
    """Whether the template with tools shows the model the tools it is given (DeepSeek-V3.1's writes calls and
    results but never lists a tool: its model card asks the application to); tried once a template."""
    source = tokenizer.chat_template_source(use_tools=True)
    if (known := _LISTS_TOOLS.get(source)) is None:
        try:
            known = "cliffguard_probe_tool" in tokenizer.apply_chat_template(
                [{"role": "user", "content": "u"}], tools=[_PROBE_TOOL], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - whatever the template raised: the listing is ours then
            known = False
        _LISTS_TOOLS[source] = known
    return known


def takes_system(tokenizer) -> bool:
    """Whether the template the fallback renders (the one without tools: it gets none) writes a chat's opening
    system message: Gemma 2's raises ("System role not supported"), templates that insist the turns alternate
    from a user's too, and some drop it (Phi-3's first one); tried once a template."""
    source = tokenizer.chat_template_source(use_tools=False)
    if (known := _TAKES_SYSTEM.get(source)) is None:
        try:
            known = _PROBE in tokenizer.apply_chat_template([{"role": "system", "content": _PROBE},
                                                              {"role": "user", "content": "u"}])
        except Exception:  # noqa: BLE001 - whatever the template raised (a ValueError here, HF's TemplateError)
            known = False
        _TAKES_SYSTEM[source] = known
    return known


_PRIVATE_USE = (0xF0000, 0x10FFFD)   # the supplementary private use planes: placeholders' characters
_PRIVATE_USE_CHARS = re.compile("[\U000F0000-\U0010FFFD]")


def shield_controls(payload: Any, counter: TokenCounter) -> tuple[Any, dict[str, str]]:
    """`payload` (JSON: dicts, lists, tuples, strings, at any depth; keys too) with every control token in
    its strings swapped for a placeholder character none of them holds, and the map from placeholders back
    to the control tokens (empty, `payload` itself, when no string holds one). ValueError where the strings
    hold so many private-use characters that none is left for a control token they name."""
    pattern = counter.control_pattern
    strings = list(_strings(payload))
    if pattern is None or not (present := {m.group() for s in strings for m in pattern.finditer(s)}):
        return payload, {}
    used = {c for s in strings for c in _PRIVATE_USE_CHARS.findall(s)}
    free = list(itertools.islice((chr(code) for code in range(*_PRIVATE_USE) if chr(code) not in used), len(present)))
    if len(free) < len(present):
        raise ValueError("messages: so many private-use characters (U+F0000 and up) beside control tokens that "
                         "the control tokens cannot be read as text")
    placeholder = dict(zip(sorted(present), free))

    def shielded(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: placeholder[m.group()], value)
        if isinstance(value, dict):   # its own kind kept (`HistoryArguments`)
            return type(value)({shielded(k): shielded(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(shielded(v) for v in value)
        return value
    return shielded(payload), {p: control for control, p in placeholder.items()}


def _strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def template_roles(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """`messages` with the developer role as a template that never names it takes it (the module's notes)."""
    if "developer" in template or not any(m["role"] == "developer" for m in messages):
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "developer" and len(out) == sum(o["role"] == "system" for o in out) > 0:
            out[-1] = {**out[-1], "content": f"{content_text(out[-1]['content'])}\n\n{content_text(m['content'])}"}
        else:
            out.append({**m, "role": "system"} if m["role"] == "developer" else m)
    return out


def native_messages(messages: list[dict[str, Any]], history_id: Callable[..., Any] | None = None) \
        -> list[dict[str, Any]]:
    """The history as HF templates with tool support take it: tool call arguments as the JSON they hold (as
    vLLM parses them); text that is not JSON (a model's broken call, sent back) stays text, never replaced.
    `history_id(id, name, index)`: each call's id as the template takes it (given its function and its place among
    the history's calls: Mistral's 9 letters and digits, Kimi's `functions.NAME:INDEX`), each result's
    `tool_call_id` its call's."""
    out, ids = [], {}
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                name = c["function"]["name"]
                ids[c["id"]] = history_id(c["id"], name, len(ids)) if history_id else c["id"]
                calls.append({"id": ids[c["id"]], "type": "function", "function": {
                    "name": name, "arguments": _value_or_text(c["function"]["arguments"])}})
            m = {**m, "tool_calls": calls}
        elif history_id and m["role"] == "tool" and "tool_call_id" in m:
            m = {**m, "tool_call_id": ids.get(m["tool_call_id"]) or history_id(m["tool_call_id"])}
        out.append(m)
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: list[Tool] | None, calls: bool = True,
                      system_role: bool = True) -> list[dict[str, Any]]:
    """For a template that knows no tools (the module's notes): the tools in a system message of ours (merged
    into a leading system message; how to call them unless `calls` is False, tool_choice "none"; before the
    first user message's text where the template refuses a system message, `system_role` False), assistant
    tool calls in the hermes form (arguments as `native_messages` has them, written as JSON), tool results as
    user turns, consecutive ones and a user message right after them in one. Other messages as sent (content
    parts kept)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            written = "\n".join(f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"], ensure_ascii=False)}, '
                                f'"arguments": {_arguments_text(c["function"]["arguments"])}}}\n</tool_call>'
                                for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content_text(content)}\n{written}".strip()})
        elif role == "tool":
            result = f"<tool_response>\n{content_text(content)}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        elif role == "user" and out and out[-1].get("tool_results"):   # the user's word with the results
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{content_text(content)}", "tool_results": False}
        else:
            out.append({**{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}, "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    return with_listing(out, tools, calls, system_role) if tools else out


def with_listing(messages: list[dict[str, Any]], tools: list[Tool], calls: bool, system_role: bool,
                 form: str | None = None) -> list[dict[str, Any]]:
    """`messages` with a system message of ours listing `tools` (merged into a leading system message; before the
    first user message's text where the template refuses a system message, `system_role` False): how to call them
    in hermes' form, or in `form` (a call in the template's own form, where it writes calls but lists no tools),
    or that none can be called (`calls` False)."""
    out = list(messages)
    listing = "\n".join(json.dumps(t.as_template_dict(), ensure_ascii=False) for t in tools)
    if not calls:
        system = _SYSTEM_TOOLS_NO_CALLS.format(tools=listing)
    else:
        system = _SYSTEM_TOOLS.format(tools=listing) if form is None else \
            _SYSTEM_TOOLS_FORM.format(tools=listing, form=form)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{content_text(out[0]['content'])}\n\n{system}"}
    elif not system_role and (first := next((i for i, m in enumerate(out) if m["role"] == "user"), None)) is not None:
        out[first] = {**out[first], "content": f"{system}\n\n{content_text(out[first]['content'])}"}
    else:
        out.insert(0, {"role": "system" if system_role else "user", "content": system})
    return out


class HistoryArguments(dict):
    """A history call's arguments as a template takes them: a dict (`items()`, `| tojson`), which a template that
    joins them to text with `+` (DeepSeek V3's and R1's: `'<｜tool▁sep｜>' + tool['function']['arguments']`, written
    for the JSON text OpenAI sends) gets as that JSON, where a plain dict would fail the render."""

    def __radd__(self, other: Any) -> Any:
        return other + json.dumps(self, ensure_ascii=False) if isinstance(other, str) else NotImplemented

    def __add__(self, other: Any) -> Any:
        return json.dumps(self, ensure_ascii=False) + other if isinstance(other, str) else NotImplemented


def _value_or_text(text: str) -> Any:   # history's arguments: their JSON; {} for none ("", null: vLLM's); else text
    value = {} if text.strip() in ("", "null") else text if (value := loads(text)) is None else value
    return HistoryArguments(value) if isinstance(value, dict) else value


def _arguments_text(text: str) -> str:
    """A history call's arguments as the hermes form writes them: their JSON (`{}` for none), or the model's
    own text where it was not JSON."""
    value = _value_or_text(text)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
