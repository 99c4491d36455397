"""Reasoning output of thinking models (`gateway/openai/reasoning.py`): the splitter alone (tags split
across deltas, no think block, a reply cut inside the block), then through the unchanged `openai` SDK
against an in-process gateway whose model's chat template thinks — chat completions and the Responses
API, whole and streamed — on a scripted engine (exact replies, the tags cut anywhere) and on the real
tiny model (a template that opens `<think>` itself, and `chat_template_kwargs` closing it)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from pathlib import Path

import openai
import pytest

from engine.client import AsyncEngineClient, RequestFailedError
from engine.outputs import RequestDelta, SampleDelta
from engine.tokenizer import Tokenizer
from gateway import local_answer
from gateway.openai.chat import parse_chat
from gateway.openai.errors import ApiError
from gateway.openai.reasoning import (THINK_TAGS, ReasoningSplitter, split_reasoning, tags_skipped, template_thinks,
                                      think_tags)
from gateway.openai.responses import parse_responses
from tests.gateway.conftest import accepts, chat_pool_yaml, start_gateway
# ChatML turns, an assistant's reasoning_content in its think block (as Qwen3's template writes it)
_TURNS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.reasoning_content is defined %}"
          "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
          "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}")
# Qwen3's shape: the model opens `<think>` itself; enable_thinking false writes an empty block.
MODEL_OPENS = (_TURNS + "{% if enable_thinking is defined and enable_thinking is false %}"
               "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
# DeepSeek-R1's (and Qwen3-Thinking-2507's) shape: the generation prompt opens the block.
TEMPLATE_OPENS = (_TURNS + "{% if enable_thinking is defined and enable_thinking is false %}"
                  "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


# --- the splitter alone ---------------------------------------------------------------------------

def _stream(text: str, cuts: list[int],
            starts_inside: bool = False) -> tuple[list[tuple[str, str]], ReasoningSplitter]:
    """`text` fed in the pieces `cuts` make (one token each), then finished: each step's parts."""
    splitter, bounds = ReasoningSplitter(starts_inside), [0, *cuts, len(text)]
    parts = [splitter.feed(text[a:b], 1) for a, b in zip(bounds, bounds[1:])]
    return parts + [splitter.finish()], splitter


def _joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("text,starts_inside,reasoning,content", [
    ("<think>\nI add.\n</think>\n\nIt is 4.", False, "I add.", "It is 4."),
    ("I add.\n</think>\n\nIt is 4.", True, "I add.", "It is 4."),        # the prompt opened the block
    ("<think>I add.</think>It is 4.", True, "I add.", "It is 4."),      # ... and the model opened it again
    ("It is 4.", False, "", "It is 4."),                                 # no think block: all content
    ("  <thinking is fun", False, "", "  <thinking is fun"),             # a tag's start that is not one
    (" Paris, of course.", False, "", " Paris, of course."),             # no tag: its whitespace its own
    ("\n<think>\nI add.</think>\n\nIt is 4.", False, "I add.", "It is 4."),   # separators around the tags
    ("It is <think>4</think>.", False, "", "It is <think>4</think>."),   # a block after text is text
    ("<think>I add 2 and 2 </thi", False, "I add 2 and 2 </thi", ""),    # cut by max_tokens: all reasoning
    ("I add 2 and", True, "I add 2 and", ""),
    ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),           # enable_thinking false's empty block
])
def test_every_cut_of_a_reply_splits_as_the_whole_does(text, starts_inside, reasoning, content) -> None:
    assert split_reasoning(text, starts_inside) == (reasoning or None, content or None)
    for cut in range(1, len(text)):                       # one cut anywhere, tags included
        parts, _ = _stream(text, [cut], starts_inside)
        assert _joined(parts) == (reasoning, content), cut
    parts, splitter = _stream(text, list(range(1, len(text))), starts_inside)   # a character a delta
    assert _joined(parts) == (reasoning, content)
    for r, c in parts:
        assert "<think>" not in r and "</" not in r.removesuffix("</thi") and (not r or not c)
    firsts = [i for i, (_, c) in enumerate(parts) if c]
    assert not firsts or not any(r for r, _ in parts[firsts[0]:])   # reasoning never after content
    assert (splitter.reasoning, splitter.content) == (reasoning, content)


def test_held_back_text_waits_only_for_a_possible_tag() -> None:
    splitter = ReasoningSplitter(starts_inside=False)
    assert splitter.feed("<th", 1) == ("", "")           # may be <think>
    assert splitter.feed("ink>Hm", 1) == ("Hm", "")
    assert splitter.feed("m </", 1) == ("m", "")         # " </" may start </think>
    assert splitter.feed("b> ok", 1) == (" </b> ok", "")  # it did not
    assert splitter.feed("</think>\n", 1) == ("", "")
    assert splitter.feed("\nFine", 1) == ("", "Fine")
    assert splitter.finish() == ("", "")
    assert splitter.num_reasoning_tokens == 5            # the deltas up to the one closing the block


def test_a_delta_without_text_while_thinking_counts_as_reasoning() -> None:
    """The detokenizer withholds a partial character (and a stop string its possible start): such a
    delta carries tokens and no text, and inside the block they are the reasoning's."""
    splitter = ReasoningSplitter(starts_inside=False)
    for text in ("<think>", "a", "", "", "", "", "", "b", "</think>", "c", ""):
        splitter.feed(text, 1)
    splitter.finish()
    assert (splitter.reasoning, splitter.content, splitter.num_reasoning_tokens) == ("ab", "c", 9)


def test_deltas_without_text_just_before_the_content_are_the_contents_tokens() -> None:
    """A character split over byte tokens arrives as deltas of no text, then one with the character: where
    that starts the content, its tokens are the content's (the Responses API's logprobs start there)."""
    splitter = ReasoningSplitter(starts_inside=False)
    for text in ("<think>", "x", "", "</think>", "\n\n", "", "", "\U0001F600", " hi"):
        splitter.feed(text, 1)
    assert (splitter.reasoning, splitter.content, splitter.num_tokens_before_content) == ("x", "\U0001F600 hi", 5)
    plain = ReasoningSplitter(starts_inside=False)   # no block at all: the reply's first tokens are content's
    for text in ("", "\U0001F600", " hi"):
        plain.feed(text, 1)
    assert (plain.content, plain.num_tokens_before_content) == ("\U0001F600 hi", 0)


def test_reasoning_tokens_are_counted_by_the_end_tag_token_when_text_comes_late() -> None:
    """Under a stop string the detokenizer holds back text that may start it: `</think>`'s token (id 12) comes
    with no text and its text with a later token's; the reasoning is the tokens up to and with that one."""
    splitter = ReasoningSplitter(starts_inside=False, end_id=12)
    for text, token in (("<think>", 10), ("a", 11), ("", 12), ("", 13), ("</think>\n\nIt", 14), (" is", 15)):
        splitter.feed(text, 1, [token])
    assert (splitter.reasoning, splitter.content, splitter.reasoning_tokens) == ("a", "It is", 3)
    assert splitter.num_reasoning_tokens == 5                        # by the text alone
    content_only = ReasoningSplitter(starts_inside=False, end_id=12)   # a tag in a reply that never thought
    for text, token in (("It", 20), (" </think>", 12)):
        content_only.feed(text, 1, [token])
    assert content_only.reasoning_tokens == 0


def test_which_templates_think() -> None:
    assert template_thinks(MODEL_OPENS) and template_thinks(TEMPLATE_OPENS)
    assert template_thinks("{{ content.split('</think>')[-1] }}")   # R1's history handling
    assert not template_thinks("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_chat_template_kwargs_are_an_object_without_the_gateways_variables() -> None:
    body = {"model": "m", "messages": MESSAGES}
    assert parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}}).chat_template_kwargs == {
        "enable_thinking": False}
    assert parse_chat(body).chat_template_kwargs is None
    for bad, param in (([1], "chat_template_kwargs"), ("x", "chat_template_kwargs"),
                       ({"messages": []}, "chat_template_kwargs.messages"),
                       ({"tools": []}, "chat_template_kwargs.tools"),
                       ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking"),
                       ({"thinking": 0}, "chat_template_kwargs.thinking")):
        with pytest.raises(ApiError) as info:
            parse_chat({**body, "chat_template_kwargs": bad})
        assert info.value.status == 400 and info.value.param == param, info.value.message
        assert info.value.message.startswith(param)


def test_the_responses_api_takes_chat_template_kwargs_and_a_well_formed_reasoning() -> None:
    body = {"model": "m", "input": "What is 2 + 2?"}
    req = parse_responses({**body, "chat_template_kwargs": {"enable_thinking": False},
                           "reasoning": {"effort": "low", "summary": "auto"}})
    # the effort is chat's reasoning_effort: the template variable (gpt-oss's template reads it)
    assert req.chat.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert parse_responses({**body, "reasoning": {}}).chat.chat_template_kwargs is None
    # effort "none": the template's switch off too, unless the request's own kwargs set it
    none = {**body, "reasoning": {"effort": "none"}}
    assert parse_responses(none).chat.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    own = {"enable_thinking": True, "x": 1}
    assert parse_responses({**none, "chat_template_kwargs": own}).chat.chat_template_kwargs == {
        **own, "reasoning_effort": "none"}
    for bad, param in ((("chat_template_kwargs", [1]), "chat_template_kwargs"),
                       (("chat_template_kwargs", {"documents": []}), "chat_template_kwargs.documents"),
                       (("reasoning", "high"), "reasoning"), (("reasoning", {"effort": "maximal"}), "reasoning.effort"),
                       (("reasoning", {"budget": 9}), "reasoning.budget")):
        with pytest.raises(ApiError) as info:
            parse_responses({**body, bad[0]: bad[1]})
        assert info.value.status == 400 and info.value.param == param, info.value.message
        assert info.value.message.startswith(param)


# --- through the SDK ----------------------------------------------------------------------------

def _thinking_model(folder: Path, tiny_model: Path, template: str) -> Path:
    """The tiny model's files (linked) with `template` as its chat template."""
    folder.mkdir()
    for path in tiny_model.iterdir():
        if path.name != "chat_template.jinja":
            os.symlink(path, folder / path.name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


async def _gateway(aiohttp_client, tmp_path: Path, tiny_model: Path, template: str, extra: str = ""):
    """(AsyncOpenAI on an in-process gateway serving `thinker` with `template`, the model folder); `extra`:
    more YAML lines of the pool."""
    folder = _thinking_model(tmp_path / "thinker", tiny_model, template)
    yaml = chat_pool_yaml(folder, max_model_len=256, extra="    served_model_name: thinker\n" + extra)
    client, _ = await start_gateway(aiohttp_client, tmp_path, yaml)
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0), folder


class _ScriptedEngine:
    """Every engine request answers `pieces`, one delta (one token) each (an exception: raised there), the
    last finishing with `finish_reason`; the prompts it got are kept, and each request's structured output (its grammar)."""

    def __init__(self, monkeypatch) -> None:
        self.pieces: list[str] = []
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []
        self.structured: list = []
        self.skip_special: list[bool] = []   # each request's skip_special_tokens
        script = self

        async def generate(client, prompt, params=None, *, request_id=None, priority=0, pool=None, cache_salt=None,
                           credits=0, background=False):
            script.prompts.append(list(prompt))
            script.structured.append(params.structured if params is not None else None)
            script.skip_special.append(params.skip_special_tokens if params is not None else None)
            for k, piece in enumerate(script.pieces):
                if isinstance(piece, Exception):   # the worker fails the request here
                    raise piece
                last = k == len(script.pieces) - 1
                sample = SampleDelta(0, piece, [300 + k], k + 1, script.finish_reason if last else None,
                                     delta_logprobs=[-k / 8], delta_top_logprobs=[[(300 + k, -k / 8)]])
                yield RequestDelta(request_id or "scripted", [sample], last)
                await asyncio.sleep(0)

        monkeypatch.setattr(AsyncEngineClient, "generate", generate)


# the tags cut across deltas; reasoning: the 4 deltas up to the one that closes the block
THOUGHT = ["<th", "ink>\nI should", " add.\n</", "think>\n", "\nIt is", " 4."]


async def _chat_stream(sdk, **kwargs) -> list:
    return [c async for c in await sdk.chat.completions.create(model="thinker", stream=True, **kwargs)]


async def assert_split_whole_and_streamed(sdk, reasoning: str, content: str, tokens: int,
                                          reasoning_tokens: int) -> list:
    """One chat answered whole, then streamed with usage: each splits into `reasoning` and `content`, `tokens` of
    which `reasoning_tokens` are the reasoning's, and ends by "stop". Returns the streamed deltas."""
    whole = await sdk.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=16)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert (whole.usage.completion_tokens, whole.usage.completion_tokens_details.reasoning_tokens) == (
        tokens, reasoning_tokens)
    chunks = await _chat_stream(sdk, messages=MESSAGES, max_tokens=16, stream_options={"include_usage": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    return deltas


async def test_chat_whole_and_streamed_split_reasoning_from_content(aiohttp_client, tmp_path, tiny_model,
                                                                   monkeypatch) -> None:
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = THOUGHT
    deltas = await assert_split_whole_and_streamed(sdk, "I should add.", "It is 4.", 6, 4)
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    content = [d.content or "" for d in deltas]
    assert not any("think" in piece or "<" in piece for piece in reasoning + content)
    first_content = next(i for i, piece in enumerate(content) if piece)
    assert not any(reasoning[first_content:]) and any(reasoning)

    # the prompt ends inside the last message, which opened a block: the reply goes on inside it
    engine.pieces = [" should", " add.</think>", "\n\nIt is 4."]
    continued = await sdk.chat.completions.create(model="thinker", max_tokens=16, messages=[
        *MESSAGES, {"role": "assistant", "content": "<think>\nI"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    message = continued.choices[0].message
    assert (message.reasoning_content, message.content) == (" should add.", "It is 4.")   # its space its own
    engine.pieces = [" Paris", "."]   # going on from a message without a block: the reply as the model wrote it
    continued = await sdk.chat.completions.create(model="thinker", max_tokens=16, messages=[
        *MESSAGES, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert (continued.choices[0].message.reasoning_content, continued.choices[0].message.content) == (None, " Paris.")
    # `</think>` as one token (here the third, id 302) whose text came late: the reasoning counted up to it
    monkeypatch.setattr(local_answer, "think_end_id", lambda tokenizer, end: 302)
    engine.pieces = ["<think>", "I add.", "", "", "</think>\n\nIt is 4."]
    late = await sdk.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=16, stop=["User:"])
    assert (late.choices[0].message.reasoning_content, late.choices[0].message.content) == ("I add.", "It is 4.")
    assert late.usage.completion_tokens_details.reasoning_tokens == 3
    engine.pieces = ["It", " is 4."]                                      # no think block: all content
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES)).choices[0].message
    assert (whole.reasoning_content, whole.content) == (None, "It is 4.")
    engine.pieces, engine.finish_reason = ["<think>", "I add", " 2 and </th"], "length"   # cut while thinking
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES)).choices[0]
    assert (whole.message.reasoning_content, whole.message.content, whole.finish_reason) == (
        "I add 2 and </th", None, "length")
    deltas = [c.choices[0].delta for c in await _chat_stream(sdk, messages=MESSAGES) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I add 2 and </th"
    assert not "".join(d.content or "" for d in deltas)


async def test_a_tool_call_after_the_reasoning_is_parsed_from_the_content(aiohttp_client, tmp_path, tiny_model,
                                                                          monkeypatch) -> None:
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["<think>", "I need the weather.", "</think>\n\n", "<tool_call>\n", '{"name": "get_weather", ',
                     '"arguments": {"city": "Oslo"}}', "\n</tool_call>"]
    await _reasoning_then_call(sdk)


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


async def _reasoning_then_call(sdk) -> None:
    """A reply (scripted) that thinks "I need the weather." and then calls get_weather for Oslo, answered whole and
    streamed: the thought as `reasoning_content`, the call a tool call, no content."""
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=WEATHER_TOOLS)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == "I need the weather."
    assert whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    deltas = [c.choices[0].delta for c in await _chat_stream(sdk, messages=MESSAGES, tools=WEATHER_TOOLS)
              if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather."
    assert not "".join(d.content or "" for d in deltas)
    arguments = "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or [])
    assert arguments == '{"city": "Oslo"}'


# Seed-OSS's shape: the model thinks in `<seed:think>` tags and calls in its `<seed:tool_call>` blocks
SEED_THINKS = ("{% if tools %}<|im_start|>system\nCall as <seed:tool_call>\n<function=NAME>\n<parameter=KEY>VALUE"
               "</parameter>\n</function>\n</seed:tool_call>: {% for t in tools %}{{ t.function.name }} {% endfor %}"
               "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
               "{% if m.reasoning_content is defined %}<seed:think>{{ m.reasoning_content }}</seed:think>{% endif %}"
               "{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Gemma 4's shape: turns of `<|turn>`, the history's thoughts dropped up to their channel's end, a thought channel
# the model opens (its tags special tokens: `_special_tags`)
GEMMA4_THINKS = ("{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content.split('<channel|>')[-1] }}<turn|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def _special_tags(folder: Path, tags: list[str]) -> None:
    """The tokenizer in `folder` (a linked copy's) with `tags` added as special tokens, each one token that a decode
    skipping special tokens drops."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    path.unlink()   # a link to the tiny model's: written anew
    top = max(t["id"] for t in data["added_tokens"]) + len(data["model"]["vocab"])
    for k, tag in enumerate(tags):
        data["added_tokens"].append({"id": top + k, "content": tag, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(data))


async def test_gemma4s_thought_channel_is_split_and_its_special_tags_decoded(aiohttp_client, tmp_path, tiny_model,
                                                                            monkeypatch) -> None:
    """Gemma 4 thinks in a channel whose tags are special tokens: its chat replies are decoded with special tokens
    (or the split would never see them), the thought is `reasoning_content` (its `thought` label and separators
    dropped), whole and streamed, and the answer after `<channel|>` the content."""
    folder = _thinking_model(tmp_path / "thinker", tiny_model, GEMMA4_THINKS)
    _special_tags(folder, ["<|channel>", "<channel|>"])
    yaml = chat_pool_yaml(folder, max_model_len=256, extra="    served_model_name: thinker\n")
    client, _ = await start_gateway(aiohttp_client, tmp_path, yaml)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    tokenizer = Tokenizer.from_folder(folder)
    assert tags_skipped(tokenizer, ("<|channel>thought", "<channel|>")) and not tags_skipped(tokenizer, THINK_TAGS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["<|channel>", "thought\n", "I should", " add.", "<channel|>", "It is", " 4."]
    await assert_split_whole_and_streamed(sdk, "I should add.", "It is 4.", 7, 5)
    assert engine.skip_special == [False, False]   # each reply decoded with its special tokens


def test_a_templates_own_think_tags_are_the_ones_split():
    """Seed-OSS thinks in `<seed:think>`, Magistral in `[THINK]`, LongCat-Flash-Thinking in `<longcat_think>`, Qwen3
    and most in `<think>` (or a template that only takes `enable_thinking`): each reply is split at its template's
    tags, another family's are its text."""
    assert think_tags(SEED_THINKS) == ("<seed:think>", "</seed:think>") and think_tags(MODEL_OPENS) == THINK_TAGS
    assert think_tags("{{ '[THINK]' + m.thinking + '[/THINK]' }}") == ("[THINK]", "[/THINK]")
    assert think_tags("{% if enable_thinking %}x{% endif %}") == THINK_TAGS and think_tags("{{ m.content }}") is None
    seed = ("<seed:think>", "</seed:think>")
    assert split_reasoning(" <seed:think>\nI add.\n</seed:think>\n\nIt is 4.", tags=seed) == ("I add.", "It is 4.")
    assert split_reasoning("[THINK]I add.[/THINK]It is 4.", tags=("[THINK]", "[/THINK]")) == ("I add.", "It is 4.")
    assert split_reasoning("<think>I add.</think>It is 4.", tags=seed) == (None, "<think>I add.</think>It is 4.")
    gemma4 = ("<|channel>thought", "<channel|>")   # its label read as part of the opening tag
    assert think_tags(GEMMA4_THINKS) == gemma4
    assert split_reasoning("<|channel>thought\nI add.<channel|>It is 4.", tags=gemma4) == ("I add.", "It is 4.")
    longcat = ("<longcat_think>", "</longcat_think>")   # LongCat-Flash-Thinking's
    assert think_tags("{{ '<longcat_think>' + m.reasoning_content + '</longcat_think>' }}") == longcat
    assert split_reasoning("<longcat_think>\nI add.\n</longcat_think>\n\nIt is 4.", tags=longcat) == (
        "I add.", "It is 4.")
    splitter, parts = ReasoningSplitter(True, tags=seed), []
    for piece in "I add.</seed:th", "ink>It is 4.":
        parts.append(splitter.feed(piece))
    assert parts == [("I add.", ""), ("", "It is 4.")]


async def test_a_model_thinking_in_its_own_tags_answers_its_reasoning_and_its_calls_apart(
        aiohttp_client, tmp_path, tiny_model, monkeypatch, lltokenizer) -> None:
    """Seed-OSS's shape over the openai SDK: the `<seed:think>` block is `reasoning_content` (whole and streamed), the
    call after it in its own form a tool call; a forced call's grammar lets the model think in its tags first."""
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, SEED_THINKS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["<seed:think>", "I need the ", "weather.</seed:", "think>\n", "<seed:tool_call>\n<function=",
                     "get_weather>\n<parameter=city>Oslo</parameter>\n", "</function>\n</seed:tool_call>"]
    await _reasoning_then_call(sdk)
    await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=WEATHER_TOOLS, tool_choice="required")
    grammar, call = engine.structured[-1], "".join(engine.pieces[4:])
    assert accepts(lltokenizer, grammar, "<seed:think>I need the weather.</seed:think>\n" + call)
    assert not accepts(lltokenizer, grammar, "<think>I need the weather.</think>\n" + call)


@functools.cache
def _lltokenizer(folder: Path):
    """llguidance's view of the tokenizer in `folder`, built once (a build reads the whole vocabulary)."""
    import llguidance

    return llguidance.LLTokenizer(Tokenizer.from_folder(folder).to_json())


def _allows(folder: Path, constraint, text: str) -> bool:
    """Whether the grammar the engine was given takes `text` as a whole reply (llguidance, token by token)."""
    import llguidance

    tokenizer = _lltokenizer(folder)
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar_text(), log_level=0)
    tokens = tokenizer.tokenize_str(text)
    if matcher.is_error() or matcher.validate_tokens(tokens) < len(tokens):
        return False
    matcher.consume_tokens(tokens)
    return matcher.is_accepting()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
STRICT_WEATHER = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": CITY}}]
CALL = ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n</tool_call>"]


async def test_a_grammar_on_the_reply_lets_the_model_think_first(aiohttp_client, tmp_path, tiny_model,
                                                                 monkeypatch) -> None:
    """Strict tools (the Responses API's are strict unless said otherwise), a forced tool choice and a
    response_format constrain what follows the think block only: the grammar the engine gets takes the
    thought, then the call or the JSON; where the template opened the block, the reply starts inside it
    (the thought is reasoning, not content) and must close it before the constrained part."""
    sdk, folder = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["<think>", "I need the weather.", "</think>\n\n", *CALL]
    for choice in ("auto", "required"):
        whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=STRICT_WEATHER,
                                                   tool_choice=choice)).choices[0]
        assert whole.message.reasoning_content == "I need the weather." and whole.message.content is None
        assert [c.function.arguments for c in whole.message.tool_calls] == ['{"city": "Oslo"}']
        assert _allows(folder, engine.structured[-1], "".join(engine.pieces))
        assert _allows(folder, engine.structured[-1], "".join(CALL))             # or no thought at all
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    result = await sdk.responses.create(model="thinker", input="Weather in Oslo?", tools=tools)
    assert [item.type for item in result.output] == ["reasoning", "function_call"]
    assert _allows(folder, engine.structured[-1], "".join(engine.pieces))

    # the Responses API reports the text.format asked, whatever grammar the engine got
    engine.pieces = ["<think>", "Four.", "</think>", '{"answer": 4}']
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}):
        result = await sdk.responses.create(model="thinker", input="What is 2 + 2?", text={"format": fmt})
        assert [item.type for item in result.output] == ["reasoning", "message"]
        assert result.output_text == '{"answer": 4}' and result.text.format.type == fmt["type"]
        events = [e async for e in await sdk.responses.create(model="thinker", input="What is 2 + 2?",
                                                              text={"format": fmt}, stream=True)]
        assert events[-1].type == "response.completed" and events[-1].response.text.format.type == fmt["type"]
    (tmp_path / "opens").mkdir()
    sdk, folder = await _gateway(aiohttp_client, tmp_path / "opens", tiny_model, TEMPLATE_OPENS)
    engine.pieces = ["Okay", ", four.", "\n</think>\n\n", '{"answer": ', "4}"]
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES,
                                               response_format={"type": "json_object"})).choices[0].message
    assert (whole.reasoning_content, whole.content) == ("Okay, four.", '{"answer": 4}')
    grammar = engine.structured[-1]
    assert _allows(folder, grammar, "".join(engine.pieces)) and not _allows(folder, grammar, '{"answer": 4}')
    engine.pieces = ["It is", " 4."]   # the Responses API's effort "none": the template does not open the block
    result = await sdk.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "none"})
    assert [item.type for item in result.output] == ["message"] and result.output_text == "It is 4."
    assert Tokenizer.from_folder(folder).decode(engine.prompts[-1], skip_special_tokens=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    engine.pieces = ["I need it.", "\n</think>\n\n", *CALL]
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, tools=STRICT_WEATHER)).choices[0]
    assert whole.message.reasoning_content == "I need it." and len(whole.message.tool_calls) == 1
    assert _allows(folder, engine.structured[-1], "".join(engine.pieces))


async def test_responses_have_a_reasoning_item_before_the_message(aiohttp_client, tmp_path, tiny_model,
                                                                  monkeypatch) -> None:
    sdk, folder = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = THOUGHT
    whole = await sdk.responses.create(model="thinker", input="What is 2 + 2?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert [part.text for part in whole.output[0].content] == ["I should add."] and whole.output[0].summary == []
    assert whole.output_text == "It is 4." and whole.usage.output_tokens_details.reasoning_tokens == 4
    events = [e async for e in await sdk.responses.create(model="thinker", input="What is 2 + 2?", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I should add."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "It is 4."
    assert final.output[0].content[0].text == "I should add." and final.output[0].status == "completed"
    assert final.usage.output_tokens_details.reasoning_tokens == 4
    # the message's logprobs are its text's tokens', none of the block's nor the whitespace after it
    # (whole and streamed alike, the whitespace its own delta or not)
    kwargs = dict(model="thinker", input="What is 2 + 2?", top_logprobs=1, include=["message.output_text.logprobs"])
    # (a delta of no text just before the text, a character's first byte token, is the text's)
    for pieces, first in ((THOUGHT, 4), (["<think>", "Hmm.", "\n", "</think>", "\n\n", "It is", " 4."], 5),
                          (["<think>", "Hmm.", "</think>", "\n\n", "", "It is", " 4."], 4)):
        engine.pieces = pieces
        want = [-k / 8 for k in range(first, len(pieces))]
        result = await sdk.responses.create(**kwargs)
        assert result.output_text == "It is 4." and [lp.logprob for lp in result.output[1].content[0].logprobs] == want
        events = [e async for e in await sdk.responses.create(stream=True, **kwargs)]
        streamed = [lp.logprob for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        assert streamed == want
    engine.pieces = THOUGHT
    async with sdk.responses.stream(model="thinker", input="What is 2 + 2?") as stream:   # the SDK's accumulator
        streamed = await stream.get_final_response()
    assert streamed.output[0].content[0].text == "I should add." and streamed.output_text == "It is 4."
    # the reasoning item sent back as input goes to the template as the assistant turn's reasoning
    again = await sdk.responses.create(model="thinker", input=[
        {"role": "user", "content": "What is 2 + 2?"}, *[item.model_dump(exclude_none=True) for item in whole.output],
        {"role": "user", "content": "And 3 + 3?"}])
    assert again.output_text == "It is 4."
    prompt = Tokenizer.from_folder(folder).decode(engine.prompts[-1], skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>\nI should add.\n</think>\n\nIt is 4.<|im_end|>" in prompt


async def test_a_template_that_opens_the_block_and_enable_thinking_false_on_the_real_model(
        aiohttp_client, tmp_path, tiny_model) -> None:
    sdk, folder = await _gateway(aiohttp_client, tmp_path, tiny_model, TEMPLATE_OPENS)
    tokenizer = Tokenizer.from_folder(folder)
    greedy = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

    async def reply(**kwargs) -> str:   # what the model writes after the rendered prompt, as a completion
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
        return (await sdk.completions.create(model="thinker", prompt=prompt, **greedy)).choices[0].text

    thought = await reply()
    assert "</think>" not in thought and thought.strip()
    whole = await sdk.chat.completions.create(model="thinker", messages=MESSAGES, **greedy)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thought.lstrip(), None)   # cut inside the block
    assert whole.usage.completion_tokens_details.reasoning_tokens == 8
    deltas = [c.choices[0].delta for c in await _chat_stream(sdk, messages=MESSAGES, **greedy) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought.lstrip()
    assert not "".join(d.content or "" for d in deltas)

    answer = await reply(enable_thinking=False)
    off = dict(greedy, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    whole = await sdk.chat.completions.create(model="thinker", messages=MESSAGES, **off)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (None, answer)   # no tag: nothing to drop
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    # the Responses API (no ignore_eos): as the same chat, its reasoning an item, the message absent
    chat = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=8, temperature=0))
    result = await sdk.responses.create(model="thinker", input="What is 2 + 2?", max_output_tokens=8, temperature=0)
    assert [item.type for item in result.output] == ["reasoning"]
    assert result.output[0].content[0].text == chat.choices[0].message.reasoning_content
    assert result.status == result.output[0].status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert result.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens

    for bad, param in (({"enable_thinking": False, "messages": []}, "chat_template_kwargs.messages"),
                       ([False], "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=2,
                                              extra_body={"chat_template_kwargs": bad})
        assert info.value.body["param"] == param, json.dumps(info.value.body)


async def test_a_pools_chat_template_kwargs_are_the_default_a_request_overrides(aiohttp_client, tmp_path,
                                                                                 tiny_model, monkeypatch) -> None:
    sdk, folder = await _gateway(aiohttp_client, tmp_path, tiny_model, TEMPLATE_OPENS,
                                 extra="    chat_template_kwargs: {enable_thinking: false}")
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = ["It is", " 4."]
    tokenizer = Tokenizer.from_folder(folder)
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES)).choices[0].message
    assert (whole.reasoning_content, whole.content) == (None, "It is 4.")   # the pool's default: not thinking
    assert tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = (await sdk.chat.completions.create(model="thinker", messages=MESSAGES, extra_body=on)).choices[0]
    assert (whole.message.reasoning_content, whole.message.content) == ("It is 4.", None)   # the request's win
    assert tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("assistant\n<think>\n")
    # the Responses API: the pool's default, then the request's through the SDK's extra_body
    result = await sdk.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "low"})
    assert [item.type for item in result.output] == ["message"] and result.output_text == "It is 4."
    result = await sdk.responses.create(model="thinker", input="What is 2 + 2?", extra_body=on)
    assert [item.type for item in result.output] == ["reasoning"]
    assert result.output[0].content[0].text == "It is 4." and result.output_text == ""
    events = [e async for e in await sdk.responses.create(model="thinker", input="What is 2 + 2?", stream=True,
                                                          extra_body=on)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "It is 4."

    for bad, param in ((("chat_template_kwargs", {"add_generation_prompt": False}),
                        "chat_template_kwargs.add_generation_prompt"),
                       (("chat_template_kwargs", "x"), "chat_template_kwargs"),
                       (("reasoning", {"effort": "extreme"}), "reasoning.effort"),
                       (("reasoning", ["low"]), "reasoning")):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.responses.create(model="thinker", input="What is 2 + 2?", extra_body={bad[0]: bad[1]})
        assert info.value.body["param"] == param, json.dumps(info.value.body)


async def test_pools_of_one_tokenizer_with_their_own_template_variables_count_their_own_rendering(
        tmp_path, tiny_model) -> None:
    """Two pools of one model differ only in chat_template_kwargs: the router counts (and sends) each pool's
    own rendering. Both renderings are over `short`'s limit; only `long`'s own admits it, with thinking on."""
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config

    folder = _thinking_model(tmp_path / "thinker", tiny_model, TEMPLATE_OPENS)
    tokenizer = Tokenizer.from_folder(folder)
    own = {flag: tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                  enable_thinking=flag), add_special_tokens=False)
           for flag in (False, True)}
    limit = min(map(len, own.values())) - 1
    gateway = Gateway.from_config(load_config(f"""
devices: {{default: {{device: cpu, memory: 1GiB}}}}
pools:
  - {{name: short, model: {folder}, served_model_name: thinker, kv_share: 0.5, max_model_len: 256, slo: null,
     route: {{max_prompt_tokens: {limit}}}, chat_template_kwargs: {{enable_thinking: false}}}}
  - {{name: long, model: {folder}, served_model_name: thinker, kv_share: 0.5, max_model_len: 256, slo: null,
     route: {{min_prompt_tokens: {limit + 1}}}, chat_template_kwargs: {{enable_thinking: true}}}}
"""))
    pool, ids = await gateway.route_chat("thinker", MESSAGES)
    assert (pool.name, ids) == ("long", own[True])
    pool, ids = await gateway.route_chat("thinker", MESSAGES, template_kwargs={"enable_thinking": False})
    assert (pool.name, ids) == ("long", own[False])   # the request's variables over both pools': one rendering


async def test_an_engine_request_that_fails_before_any_token_is_answered_its_error(aiohttp_client, tmp_path,
                                                                                   tiny_model, monkeypatch) -> None:
    """The engine ends a request with an error and no token (its grammar could not be built there): the
    client gets a 400 naming the field, whole or streamed, not a 200 with an empty answer ended 'abort'."""
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    failure = "response_format: the grammar cannot be built: too complex"

    async def generate(client, prompt, params=None, *, request_id=None, **kwargs):
        yield RequestDelta(request_id or "failed", [SampleDelta(0, "", [], 0, "abort")], True, error=failure)

    monkeypatch.setattr(AsyncEngineClient, "generate", generate)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            answer = await sdk.chat.completions.create(model="thinker", messages=MESSAGES, stream=stream)
            if stream:
                [chunk async for chunk in answer]
        assert info.value.body["param"] == "response_format" and failure in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:   # named as the Responses API names it
        await sdk.responses.create(model="thinker", input="What is 2 + 2?")
    assert info.value.body["param"] == "text.format"
    failure = "prompt: pool 'chat' cannot hold this sequence: it needs 9 blocks of 16 tokens, the pool has 8"
    for create, param in ((sdk.chat.completions.create(model="thinker", messages=MESSAGES), "messages"),
                          (sdk.completions.create(model="thinker", prompt="2 + 2 ="), "prompt"),
                          (sdk.responses.create(model="thinker", input="What is 2 + 2?"), "input")):
        with pytest.raises(openai.BadRequestError) as info:
            await create
        assert info.value.body["param"] == param and "cannot hold this sequence" in info.value.body["message"]


TOOLS = [{"type": "function", "name": name, "parameters": {"type": "object", "properties": {key: {"type": "string"}}}}
         for name, key in (("get_weather", "city"), ("get_time", "tz"))]
TWO_CALLS = ["Sure.", " <tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n</tool_call>\n",
             "<tool_call>\n", '{"name": "get_time", "arguments": {"tz": "CET"}}', "\n</tool_call>", "\n\nDone."]


def _one_item_at_a_time(events) -> list[str]:
    """The stream's items in order, each asserted done before the next one is added (as OpenAI sends them)."""
    order, open_item = [], None
    for event in events:
        if event.type == "response.output_item.added":
            assert open_item is None, f"{event.item.id} added while {open_item} is open"
            open_item = event.item.id
            order.append(event.item.type)
        elif event.type == "response.output_item.done":
            assert event.item.id == open_item
            open_item = None
    assert open_item is None
    return order


async def test_a_responses_stream_sends_each_item_whole_before_the_next(aiohttp_client, tmp_path, tiny_model,
                                                                        monkeypatch) -> None:
    """A call's item is done (its arguments whole) when the next item begins, not at the end of the reply:
    a client runs the first call while the model writes the second, and records the items in their order."""
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    engine.pieces = TWO_CALLS
    whole = await sdk.responses.create(model="thinker", input="Weather and time?", tools=TOOLS)
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call", "message"]
    events = [e async for e in await sdk.responses.create(model="thinker", input="Weather and time?", tools=TOOLS,
                                                          stream=True)]
    assert _one_item_at_a_time(events) == ["message", "function_call", "function_call", "message"]
    kinds = [e.type for e in events]
    first_done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert first_done.arguments == '{"city": "Oslo"}'
    second = [i for i, e in enumerate(events) if e.type == "response.output_item.added"][2]
    assert kinds.index("response.function_call_arguments.done") < second
    final = events[-1].response
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output]
    assert final.output_text == whole.output_text == "Sure.Done."
    async with sdk.responses.stream(model="thinker", input="?", tools=TOOLS) as stream:   # the SDK's accumulator
        assert [item.type for item in (await stream.get_final_response()).output] == [
            "message", "function_call", "function_call", "message"]


async def test_held_text_that_is_no_call_streams_as_the_whole_reply_has_it(aiohttp_client, tmp_path, tiny_model,
                                                                          monkeypatch) -> None:
    """Text held back as a possible call's start, then no call: the stream's message is the whole reply's,
    its whitespace kept, and its logprobs one per token as the whole reply's (the held tokens' too, and a
    token's whose text is none)."""
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    kwargs = dict(model="thinker", input="?", tools=TOOLS, top_logprobs=1, include=["message.output_text.logprobs"])
    for pieces in (["Use the", " <tool_call>", " tag."], ["Hello", " <tool"], ["x", "\n\n<tool_call>\n{}"],
                   ["It", "", " is \u00e9."]):   # a token of no text (part of a character)
        engine.pieces = pieces
        whole = await sdk.responses.create(**kwargs)
        assert whole.output_text == "".join(pieces)
        events = [e async for e in await sdk.responses.create(stream=True, **kwargs)]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "".join(pieces)
        streamed = [lp.logprob for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        assert streamed == [lp.logprob for lp in whole.output[0].content[0].logprobs] == [
            -k / 8 for k in range(len(pieces))]
        assert events[-1].response.output_text == "".join(pieces)


async def test_a_stream_the_worker_fails_ends_its_open_items_incomplete(aiohttp_client, tmp_path, tiny_model,
                                                                        monkeypatch) -> None:
    """The worker fails the request while a call is being written: the call's item is done, incomplete, before
    response.failed; a message cut by the failure is incomplete too."""
    sdk, _ = await _gateway(aiohttp_client, tmp_path, tiny_model, MODEL_OPENS)
    engine = _ScriptedEngine(monkeypatch)
    failure = RequestFailedError("scripted", "RuntimeError: the device fell over")
    for pieces, cut in ((TWO_CALLS[:3] + ['"arguments": {"city": "Os', failure], "function_call"), (["It is", failure], "message")):
        engine.pieces = pieces
        events = [e async for e in await sdk.responses.create(model="thinker", input="?", tools=TOOLS, stream=True)]
        assert events[-1].type == "response.failed" and _one_item_at_a_time(events)[-1] == cut
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert done[-1].type == cut and done[-1].status == "incomplete"
        assert [i.status for i in events[-1].response.output][-1] == "incomplete"
