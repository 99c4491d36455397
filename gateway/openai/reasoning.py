"""Reasoning output of models that think in `<think>…</think>` (Qwen3, QwQ, DeepSeek-R1 distills, GLM-4.5, MiniMax-M2),
`<seed:think>…</seed:think>` (Seed-OSS), `<longcat_think>…</longcat_think>` (LongCat-Flash-Thinking),
`[THINK]…[/THINK]` (Magistral) or Gemma 4's thought channel (`<|channel>thought\n…<channel|>`, its label read as part
of the opening tag), split from the answer as vLLM's reasoning parsers do: the text inside the block is
`reasoning_content`, what follows the closing tag is `content`, and the tags are in neither.

A pool's model thinks when its chat template mentions one of these tags or `enable_thinking` (`think_tags`, the
first family's tags it names: `Think.tags`). Its reply may open the block itself (Qwen3 writes `<think>` first),
or start inside it when the template's generation prompt opened it (DeepSeek-R1's, Qwen3-Thinking-2507's end in
`<think>\\n`: `prompt_opens_think`). A reply that does neither is all content (Qwen3 under
`enable_thinking: false`, whose prompt holds an empty block already). A reply cut inside the block (by
`max_tokens`) is all reasoning. The whitespace around the tags is dropped (the template's separators: after
`<think>`, the reply's or the generation prompt's, and before and after `</think>`); a reply without tags keeps
its own, and so does one going on from a message (`continue_final_message`: `" Paris"` after "The capital is").
A structured reply (strict tools, a tool choice, a response_format) is constrained after the block only
(`think_mode`, `gateway.openai.tool_grammar`): the model thinks first, as without one.

`ReasoningSplitter` splits one reply as its text arrives, holding back what may be the start of a tag;
the whole reply's split is the same splitter fed at once (`split_reasoning`), so a stream's parts join
to the non-streamed answer's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

THINK_START, THINK_END = "<think>", "</think>"
THINK_TAGS = (THINK_START, THINK_END)
# each family's tags, the first a template names winning: Seed-OSS's, Magistral's (Mistral's tokens), Gemma 4's,
# LongCat-Flash's, then `<think>`
_FAMILIES_TAGS = (("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"), ("<|channel>thought", "<channel|>"),
                  ("<longcat_think>", "</longcat_think>"), THINK_TAGS)
_PROMPT_TAIL_TOKENS = 16   # the prompt's last tokens decoded to see whether it ends inside a think block


@dataclass(frozen=True)
class Think:
    """Where a thinking model's chat reply starts (`opened`: inside a block the prompt opened; else it may open one
    first) and the tags its template thinks in."""

    opened: bool
    tags: tuple[str, str] = THINK_TAGS

    @property
    def start(self) -> str:
        return self.tags[0]

    @property
    def end(self) -> str:
        return self.tags[1]


def as_think(think: Think | str | None) -> Think | None:
    """`think` as a `Think`: one, or a mode's name ("opened", "optional") under the `<think>` tags, or None."""
    if think is None or isinstance(think, Think):
        return think
    if think not in ("optional", "opened"):
        raise ValueError(f"think: one of optional, opened or None, got {think!r}")
    return Think(think == "opened")


@functools.lru_cache(maxsize=64)
def think_tags(source: str) -> tuple[str, str] | None:
    """The tags a chat template's model thinks in (None: it does not think): those it writes or strips (Seed-OSS's
    `<seed:think>`, Magistral's `[THINK]`, else `<think>`), or `<think>`'s where it takes `enable_thinking`."""
    for start, end in _FAMILIES_TAGS:
        if start in source or end in source:
            return start, end
    return THINK_TAGS if "enable_thinking" in source else None


@functools.lru_cache(maxsize=64)
def tags_skipped(tokenizer, tags: tuple[str, str]) -> bool:
    """Whether a reply decoded without its special tokens loses the think tags (Gemma 4's `<|channel>` and
    `<channel|>` are special tokens): such a model's chat replies are decoded with them, for the split to see."""
    return any(tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False), skip_special_tokens=True) != tag
               for tag in tags)


def template_thinks(source: str) -> bool:
    """Whether a chat template is a thinking model's: it writes or strips think blocks, or takes
    `enable_thinking`."""
    return think_tags(source) is not None


def prompt_opens_think(tokenizer, prompt_ids: Sequence[int], start: str = THINK_START) -> bool:
    """Whether the rendered prompt ends in an open think block (`start`: its tag; the template opened the block, so
    the reply starts inside it)."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return tail.rstrip().endswith(start)


def think_mode(tokenizer, prompt_ids: Sequence[int], use_tools: bool, continued: str | None = None) -> Think | None:
    """Where a chat reply of this prompt starts, and its template's tags: None (the template does not think),
    opened (the prompt opened a think block: the reply starts inside it), or not (the reply may open one first). A
    grammar on the reply lets it think first, as this says (`gateway.openai.tool_grammar`). `continued`: the
    text of the message the prompt ends inside (`continue_final_message`); where it holds a think tag, its
    last says (a block it opens and leaves open, `<think>\nLet me`, is where the reply goes on)."""
    tags = think_tags(tokenizer.chat_template_source(use_tools=use_tools))
    if tags is None:
        return None
    start, end = tags
    if continued is not None and (start in continued or end in continued):
        return Think(continued.rfind(start) > continued.rfind(end), tags)
    return Think(prompt_opens_think(tokenizer, prompt_ids, start), tags)


@functools.lru_cache(maxsize=16)
def think_end_id(tokenizer, end: str = THINK_END) -> int | None:
    """The id of the closing tag `end` where the vocabulary writes it as one token (Qwen3's `</think>`, the R1
    distills'), else None."""
    ids = tokenizer.encode(end, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0 if none): what a stream
    holds back while a tag may be forming (the think tags here, a tool call's marker in `tools`)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One reply of a thinking model, split as its text arrives: `feed` each delta, `finish` at its end.

    Phases: "opening" (nothing but whitespace or a start of `<think>` seen yet: held back), "thinking"
    (text goes to reasoning; trailing whitespace and a possible start of `</think>` are held back) and
    "content". `reasoning` and `content` are what was handed out so far; `num_reasoning_tokens` counts
    the tokens of the deltas that carried reasoning or its tags (a delta's tokens are not split further);
    `num_tokens_before_content` those of every delta fed before the content's first character went out
    (the reasoning's, and the whitespace after `</think>` that the content drops): the content's tokens,
    whose logprobs the Responses API gives, are the rest, as a stream's chunks with content carry them (and
    the deltas of no text just before the content's first: a character split over byte tokens, held back by
    the detokenizer until whole). Text may come tokens after its own (a stop string's possible start is held
    back): where `</think>` is one token (`end_id`), the reasoning's tokens are counted by it, up to and with
    it. `continued`: the reply goes on from the prompt's last message, whose text its own first characters
    follow (no separator of the template's to drop). One per choice, on the event loop."""

    def __init__(self, starts_inside: bool, end_id: int | None = None, continued: bool = False,
                 tags: tuple[str, str] = THINK_TAGS) -> None:
        self.starts_inside = starts_inside
        self.start, self.end = tags
        self.end_id = end_id
        self._strip_reasoning = starts_inside and not continued   # the reasoning's first whitespace: a separator
        self._strip_content = False                                # ... the content's: after `</think>` only
        self._num_fed = 0            # tokens fed so far
        self._end_token_at = None    # tokens up to and with the first `end_id`
        self.phase = "opening"
        self.reasoning = ""
        self.content = ""
        self.num_reasoning_tokens = 0
        self.num_tokens_before_content = 0
        self._held = ""              # text received but not handed out
        self._undecided_tokens = 0   # tokens of deltas held whole while opening
        self._textless_tokens = 0    # tokens of the deltas of no text since the last with text

    def feed(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The reply grew by `text` (`num_tokens` tokens, `token_ids` where known): the (reasoning, content)
        that can go out now."""
        if self._end_token_at is None and self.end_id in token_ids:
            self._end_token_at = self._num_fed + list(token_ids).index(self.end_id) + 1
        self._num_fed += num_tokens
        text_in = bool(text)
        text, self._held = self._held + text, ""
        # a delta that arrives while thinking is reasoning's, text or not (a withheld partial character)
        reasoning, content, touched = "", "", self.phase == "thinking"
        while text:
            if self.phase == "opening":
                stripped = text.lstrip()
                if stripped.startswith(self.start):
                    text, self.phase, touched = stripped[len(self.start):], "thinking", True
                    self._strip_reasoning = True
                elif self.start.startswith(stripped):   # whitespace, or a start of the tag: wait
                    self._held, text = text, ""
                else:
                    self.phase = "thinking" if self.starts_inside else "content"
            elif self.phase == "thinking":
                touched = True
                end = text.find(self.end)
                if end >= 0:
                    reasoning += text[:end].rstrip()
                    text, self.phase, self._strip_content = text[end + len(self.end):], "content", True
                    continue
                cut = len(text) - partial_tag(text, self.end)
                cut = len(text[:cut].rstrip())   # whitespace that may be the last before `</think>`: held too
                reasoning += text[:cut]
                text, self._held = "", text[cut:]
            else:
                content, text = content + text, ""
        self._count(num_tokens, touched)
        parts = self._out(reasoning, content)
        if not self.content:   # a delta of no text waits: its tokens are the next text's
            if text_in:
                self.num_tokens_before_content += num_tokens + self._textless_tokens
            self._textless_tokens = 0 if text_in else self._textless_tokens + num_tokens
        return parts

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back, as the part it was held in (a start of `<think>` never
        completed is the reply's first part's text)."""
        held, self._held = self._held, ""
        inside = self.phase == "thinking" or (self.phase == "opening" and self.starts_inside)
        if self.phase == "opening":
            self._count(0, inside)
            self.phase = "thinking" if inside else "content"
        return self._out(held, "") if inside else self._out("", held)

    @property
    def reasoning_tokens(self) -> int:
        """The reply's tokens of reasoning: those up to and with the `</think>` token once the block closed
        (where it is one token), else those of the deltas that carried reasoning or its tags."""
        if self.num_reasoning_tokens and self.phase == "content" and self._end_token_at is not None:
            return self._end_token_at
        return self.num_reasoning_tokens

    def _count(self, num_tokens: int, touched: bool) -> None:
        if self.phase == "opening" and not touched:
            self._undecided_tokens += num_tokens
            return
        if touched:
            self.num_reasoning_tokens += num_tokens + self._undecided_tokens
        self._undecided_tokens = 0

    def _out(self, reasoning: str, content: str) -> tuple[str, str]:
        """Hand out the parts, each part's leading whitespace dropped where it is a tag's separator."""
        if not self.reasoning and self._strip_reasoning:
            reasoning = reasoning.lstrip()
        if not self.content and self._strip_content:
            content = content.lstrip()
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


Summary = Literal["auto", "concise", "detailed"]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]   # OpenAI's


class ReasoningOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The Responses API's `reasoning` request field, checked: whether and how long a model thinks is its
    chat template's (`chat_template_kwargs`) and `max_output_tokens`'; `effort` is chat's `reasoning_effort`
    (`gateway.openai.chat`: the template variable, and "none" sets `enable_thinking: false` unless the
    request's own kwargs set it); no summary is written (a reasoning item's `summary` is empty)."""

    effort: ReasoningEffort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None   # `summary`'s deprecated name


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The Responses API's reasoning output item: the text as one `reasoning_text` content part, no summary."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def split_reasoning(text: str, starts_inside: bool = False, tags: tuple[str, str] = THINK_TAGS
                    ) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), each None when empty."""
    splitter = ReasoningSplitter(starts_inside, tags=tags)
    splitter.feed(text)
    splitter.finish()
    return splitter.reasoning or None, splitter.content or None
