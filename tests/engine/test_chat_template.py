"""engine.chat_template against transformers' `apply_chat_template`: content parts (vLLM's content formats),
the reasoning's aliases, `continue_final_message`, and a template's own errors.

Each folder is the builtin SmolLM2 tokenizer with another chat template; the reference is `AutoTokenizer` on it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference loads local files only

# Gemma 3's way with content: a string, or parts it loops over (each trimmed)
GEMMA_LIKE = (
    "{{ bos_token }}{%- set loop_messages = messages -%}"
    "{%- for message in loop_messages -%}"
    "{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# reads the reasoning under transformers' names, and a `reasoning_effort` variable
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.thinking %}<think>{{ m.thinking }}</think>{% endif %}"
    "{% if m.reasoning_content %}[rc:{{ m.reasoning_content }}]{% endif %}"
    "{% if m.reasoning %}[r:{{ m.reasoning }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}")


@pytest.fixture(scope="module")
def folders(builtin_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"smol" (the builtin's own template), "gemma" and "thinking"."""
    jinja = builtin_path / "chat_template.jinja"
    smol = jinja.read_text() if jinja.is_file() else \
        json.loads((builtin_path / "tokenizer_config.json").read_text())["chat_template"]
    return {name: _make_folder(tmp_path_factory.mktemp(name), builtin_path, template)
            for name, template in (("smol", smol), ("gemma", GEMMA_LIKE), ("thinking", THINKING))}


def _make_folder(folder: Path, builtin: Path, template: str) -> Path:
    shutil.copy(builtin / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((builtin / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _pair(folder: Path) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    return Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def pairs(folders: dict[str, Path]) -> Callable[[str], tuple[Tokenizer, Any]]:
    """name -> `_pair` of `folders`' folder, loaded once for the module (applying a template changes neither)."""
    return functools.cache(lambda name: _pair(folders[name]))


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


# --- content parts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_parts_reach_a_template_that_loops_over_them(pairs, add_generation_prompt: bool) -> None:
    ours, hf = pairs("gemma")
    messages = [{"role": "system", "content": "Be brief. "},
                {"role": "user", "content": _parts("Summarize:", "  The cat sat.  ")},
                {"role": "assistant", "content": _parts("A cat sat.")}, {"role": "user", "content": []}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    assert "Summarize:The cat sat." in expected   # each part trimmed by the template, none joined by "\n"


def test_a_string_template_gets_the_parts_joined(pairs) -> None:
    ours, hf = pairs("smol")
    parts = [{"role": "user", "content": _parts("Summarize:", "The cat sat.")}]
    joined = [{"role": "user", "content": "Summarize:\nThe cat sat."}]   # vLLM's "string" content format
    assert ours.apply_chat_template(parts) == hf.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(("template", "iterates"), [
    (GEMMA_LIKE, True),
    ("{% for m in messages[1:] %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% set ms = messages %}{% set rest = ms[1:] %}{% for m in rest %}{% for p in m['content'] %}x{% endfor %}"
     "{% endfor %}", True),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}x{% endfor %}{% endfor %}", False),  # as vLLM
    ("{% for m in other %}{% for p in m.content %}x{% endfor %}{% endfor %}", False),
    ("{% for m in messages %", False),   # does not compile: the string format
])
def test_the_content_format_is_vllms(template: str, iterates: bool) -> None:
    from engine.chat_template import _iterates_content

    assert _iterates_content(template) is iterates


# --- reasoning ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_the_reasoning_is_aliased_like_hf(pairs, field: str) -> None:
    ours, hf = pairs("thinking")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: "r1"},
                {"role": "user", "content": "q2"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert "<think>r1</think>[rc:r1]" in expected
    both = [*messages[:1], {"role": "assistant", "content": "a", "reasoning": "late", "reasoning_content": "first"}]
    assert ours.apply_chat_template(both) == hf.apply_chat_template(both, tokenize=False, add_generation_prompt=True)


# --- continue_final_message --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "final"), [
    ("smol", "The answer is"), ("smol", "Ends in a space "), ("gemma", "Trimmed away  "),
    ("gemma", _parts("First.", "Then ")), ("thinking", "Sure")])
def test_continue_final_message_is_cut_like_hf(pairs, name: str, final: Any) -> None:
    ours, hf = pairs(name)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.rstrip().endswith(("is", "space", "away", "Then", "Sure"))


def test_continue_final_message_refuses_what_hf_refuses(folders: dict[str, Path], builtin_path: Path,
                                                        tmp_path: Path) -> None:
    ours = Tokenizer.from_folder(folders["smol"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "So"}]
    with pytest.raises(ValueError, match="^continue_final_message: cannot be used with add_generation_prompt"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    rewrites = Tokenizer.from_folder(_make_folder(tmp_path, builtin_path, "{{ messages[-1].content | upper }}"))
    with pytest.raises(ValueError, match="^continue_final_message: the chat template does not write"):
        rewrites.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)


# --- a template's own errors -------------------------------------------------------------------------------------


def test_a_python_error_in_the_template_is_a_value_error_with_its_line(builtin_path: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}{{ 'x' + limit }}"
    ours = Tokenizer.from_folder(_make_folder(tmp_path, builtin_path, template))
    with pytest.raises(ValueError, match=r"^chat template: line 2: TypeError: can only concatenate str") as info:
        ours.apply_chat_template([{"role": "user", "content": "hi"}], limit=5)
    assert isinstance(info.value.__cause__, TypeError)
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], limit="5") == "hi\nx5"


@pytest.mark.parametrize(("content", "field"), [
    ([{"type": "image_url"}], r"messages\[0\]\.content\[0\]"),
    ([{"type": "text", "text": "a"}, "b"], r"messages\[0\]\.content\[1\]"),
    ({"type": "text", "text": "a"}, r"messages\[0\]\.content"),
])
def test_bad_content_parts_name_the_field(folders: dict[str, Path], content: Any, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        Tokenizer.from_folder(folders["gemma"]).apply_chat_template([{"role": "user", "content": content}])
