"""Chat templates as transformers (v5) renders them: its sandboxed jinja environment, and the messages as its
`apply_chat_template` hands them over. `engine.tokenizer.Tokenizer.apply_chat_template` calls `render`.

What a message becomes, on a copy: None-valued keys dropped; an assistant's reasoning under all of
`reasoning_content`, `thinking` and `reasoning`, whichever was given (transformers' `_alias_reasoning_fields`); a
content that is a list of text parts kept as parts for a template that loops over a message's content (Gemma 3's,
Llama 4's: vLLM's "openai" content format, told apart as vLLM does, on the template's syntax tree, once per
template), else their texts joined with "\n" (vLLM's "string" format). `continue_final_message` ends the prompt
inside the last message, cut where transformers cuts it. An error the template raises (its `raise_exception`, or
a Python error on a value it was given: `'x' + 5`) is a ValueError naming the template line.
"""

from __future__ import annotations

import functools
import json
import traceback
from datetime import datetime
from typing import Any

import jinja2
import jinja2.defaults
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
           continue_final_message: bool, variables: dict[str, Any]) -> str:
    """The prompt `source` renders for `messages` (checked by `check_messages`) and the template `variables`
    (`tools`, `documents`, the special tokens, the caller's own)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be used with add_generation_prompt")
    try:
        template = compile_chat_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template: line {exc.lineno}: {exc.message}") from exc
    messages = [_template_message(m, keep_parts=_iterates_content(source)) for m in messages]
    final = _open_final_message(messages, source) if continue_final_message else None
    try:
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from exc
    except Exception as exc:   # noqa: BLE001 - the template's own error on the values of this request
        raise ValueError(f"chat template: {_template_line(exc)}{type(exc).__name__}: {exc} (raised by the template on "
                         "a value it was given: a message's, a tool's or a template variable's)") from exc
    return text if final is None else _cut_after_final_message(text, final)


def check_messages(messages: Any) -> None:
    """messages must be a non-empty list of dicts with str 'role' and a 'content' that is a str or a list of
    text parts; the error names the field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}].{field}: missing")
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{i}].role: expected a string, got {type(message['role']).__name__}")
        content = message["content"]
        if not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content: expected a string or a list of text parts, "
                             f"got {type(content).__name__}")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content[{j}]: expected a text part {{\"type\": \"text\", "
                                 f"\"text\": ...}}, got {part!r:.80}")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # transformers' names of a message's reasoning
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # transformers' mark of where a continued message ends


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message's content as one string: its text parts joined with "\\n" (vLLM's "string" content format)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def _template_message(message: dict[str, Any], keep_parts: bool) -> dict[str, Any]:
    """A message as transformers hands it to the template, on a copy: None values dropped, the reasoning under
    all its names (`_alias_reasoning_fields`); content parts kept for a template that loops over them, else
    joined (`content_text`)."""
    message = {key: value for key, value in message.items() if value is not None}
    if isinstance(message["content"], list):
        message["content"] = [dict(part) for part in message["content"]] if keep_parts else \
            content_text(message["content"])
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _open_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """transformers' `continue_final_message`: the last message's content (its last text part's) marked at
    its end, in place; returns that text, whose end the rendered prompt is cut after."""
    if "content" not in source:
        raise ValueError('continue_final_message: the chat template does not read a message\'s "content"')
    final = messages[-1]
    if isinstance(final["content"], str):
        text, final["content"] = final["content"], final["content"] + _CONTINUE_TAG
        return text
    if not final["content"]:
        raise ValueError("continue_final_message: the final message has no text to continue")
    part = final["content"][-1]
    text, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
    return text


def _cut_after_final_message(rendered: str, final: str) -> str:
    """The prompt up to the mark `_open_final_message` set (trailing space the template trimmed off the
    message trimmed from the prompt too), as transformers cuts it."""
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message: the chat template does not write the final message as it "
                         "is (it drops or rewrites part of it), so the prompt cannot end inside it")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    return rendered[:at] if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()


def _template_line(exc: BaseException) -> str:
    """ "line N: " of the template where `exc` was raised ("" if not in the template's code)."""
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == "<template>"]
    return f"line {lines[-1]}: " if lines else ""


@functools.lru_cache(maxsize=32)
def _iterates_content(source: str) -> bool:
    """Whether a template loops over a message's content (`{% for part in message['content'] %}`): vLLM's
    test of the "openai" content format, on the syntax tree. The names of `messages` (assigned from it, its
    slices or filters of it), then the loop variables over them, then a loop over one's `content`."""
    try:
        tree = compile_chat_template(source).environment.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    names, found = {"messages"}, ["messages"]
    while found:
        name = found.pop()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in names and _reads(assign.node, {name}):
                names.add(target.name)
                found.append(target.name)
    loops = list(tree.find_all(jinja2.nodes.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)
             and _reads(loop.iter, names)}
    return any(_reads(loop.iter, items, key="content") for loop in loops)


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """vLLM's `_is_var_or_elems_access`: `node` is one of `names` (with `key`: its `[key]` or `.key`), under
    filters, tests and slices."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, names, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, names, key)
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == key or isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant text for training masks);
    here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping (jinja's own filter escapes <, >, &, ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# The functions transformers adds to a chat template's globals, beside Jinja's own.
_TEMPLATE_GLOBALS = {"raise_exception": _raise_exception, "strftime_now": _strftime_now}
# Every function a chat template may call: a template variable of the same name would replace it.
TEMPLATE_FUNCTIONS = (*jinja2.defaults.DEFAULT_NAMESPACE, *_TEMPLATE_GLOBALS)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """transformers' chat template environment: sandboxed, trim_blocks + lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(_TEMPLATE_GLOBALS)
    return env.from_string(source)
