"""Replies in OpenAI's harmony format (GPT-OSS), split into reasoning and content as vLLM's harmony parsing does.

A harmony model's reply is a run of messages, each `<|channel|>NAME<|message|>TEXT<|end|>` (the first after the
generation prompt's `<|start|>assistant`, each next one opened by `<|start|>assistant` again), the last ended by
`<|return|>` (a stop token, so not in the text): the `analysis` channel is the model's reasoning
(`reasoning_content`, the Responses API's reasoning item), `final` the answer (`content`), and `commentary`
without a recipient a preamble the user sees (content too). The markers are special tokens: a harmony reply is
decoded with them (`skip_special_tokens` false) for this splitter to read, and they are in neither part.

A function call is a message to a recipient, `to=functions.NAME` in its header (on the commentary channel, its
text the arguments' JSON, ended by `<|call|>`, a stop token): the splitter writes it into the content as the
pool's tool format reads calls, `<tool_call>\n{"name": NAME, "arguments": ARGUMENTS}\n</tool_call>` (hermes:
`gateway.openai.tool_formats` gives a harmony template that format), so the calls are parsed, streamed and counted
as every other format's, whole and streamed alike. Recipients other than `functions.*` (the built-in browser and
python tools, which this gateway does not run) are written the same way, under their whole name.

A pool's model speaks harmony when its chat template writes channels (`template_speaks_harmony`; a chat's think
mode is then "harmony", `gateway.completion.constrained`). A grammar on its reply (a response format, a forced or
strict tool choice) is not served: refused with a 400 naming the field.

`HarmonySplitter` has `gateway.openai.reasoning.ReasoningSplitter`'s interface: `feed` each delta, `finish` at the
end; `reasoning`, `content`, `phase` ("content" once the reasoning ended), `reasoning_tokens` and
`num_tokens_before_content`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

from gateway.openai.reasoning import partial_tag

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")   # what ends a message's text
REASONING_CHANNEL = "analysis"
CALL_START, CALL_END = "<tool_call>\n", "\n</tool_call>"   # a call as the hermes format writes it
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@functools.lru_cache(maxsize=16)
def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids of `<|return|>` and `<|call|>` where the vocabulary has each as one token: a harmony reply stops at
    either (vLLM stops at both too), whatever generation_config.json lists as EOS (some copies of gpt-oss-20b's
    list `<|return|>` alone, and a reply that called a function would go on to write its result)."""
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in ENDS[1:]]
    return tuple(found[0] for found in ids if len(found) == 1)


def template_speaks_harmony(source: str) -> bool:
    """Whether a chat template writes harmony messages: channels and their message marker."""
    return CHANNEL in source and MESSAGE in source


def header_channel(header: str) -> str | None:
    """The channel a message's header names (`assistant<|channel|>analysis`, ` to=functions.f<|channel|>commentary
    <|constrain|>json`): the word after `<|channel|>`, None where there is none."""
    _, found, rest = header.partition(CHANNEL)
    words = rest.replace("<|", " <|").split()
    return words[0] if found and words else None


def header_recipient(header: str) -> str | None:
    """The recipient a message's header names (`to=functions.get_weather`: a function call), None for the user."""
    found = _RECIPIENT.search(header)
    return found[1] if found else None


class HarmonySplitter:
    """One harmony reply, split as its text arrives (see the module docstring). Phases of the parse: "header" (a
    message's header, until `<|message|>`), "body" (its text, until an end marker) and "between" (after an end,
    until the next `<|start|>`). A delta's tokens count as reasoning where it carried the analysis channel's
    header or text; the tokens of a header are decided when its channel is known."""

    def __init__(self) -> None:
        self._state = "header"      # the generation prompt opened the first message: its header comes first
        self._header = ""
        self._held = ""             # body text that may be the start of an end marker
        self.channel: str | None = None
        self._call: str | None = None   # the function the message being read calls (None: no call)
        self.reasoning = ""
        self.content = ""
        self._reasoning_ended = False
        self.num_reasoning_tokens = 0
        self.num_tokens_before_content = 0
        self._undecided_tokens = 0  # tokens of the deltas since the current header began

    @property
    def phase(self) -> str:
        """"content" once the reasoning ended (an analysis message closed, or another channel's began), else
        "thinking": a Responses reasoning item's status follows it."""
        return "content" if self._reasoning_ended else "thinking"

    @property
    def reasoning_tokens(self) -> int:
        return self.num_reasoning_tokens

    def feed(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The reply grew by `text` (`num_tokens` tokens): the (reasoning, content) that can go out now."""
        reasoning, content, touched = "", "", False
        text, self._held = self._held + text, ""
        self._undecided_tokens += num_tokens
        while text:
            if self._state == "between":
                at = text.find(START)
                if at < 0:
                    self._held, text = text[len(text) - partial_tag(text, START):], ""
                    continue
                text, self._state = text[at + len(START):], "header"
            elif self._state == "header":
                self._header += text
                at = self._header.find(MESSAGE)
                if at < 0:
                    text = ""
                    continue
                text, self._header = self._header[at + len(MESSAGE):], self._header[:at]
                content += self._open(header_channel(self._header), header_recipient(self._header))
                touched |= self.channel == REASONING_CHANNEL
            else:
                part, text = self._body(text)
                touched |= self.channel == REASONING_CHANNEL
                if self.channel == REASONING_CHANNEL:
                    reasoning += part
                else:
                    content += part + (self._close_call() if self._state == "between" else "")
        if touched:
            self.num_reasoning_tokens += self._undecided_tokens
        if self._state != "header" or touched:
            self._undecided_tokens = 0
        if not self.content and not content:
            self.num_tokens_before_content += num_tokens
        self.reasoning, self.content = self.reasoning + reasoning, self.content + content
        return reasoning, content

    def _open(self, channel: str | None, recipient: str | None) -> str:
        """A message's header ended: its text goes to the part its channel says from now on; a call's opens in the
        content (the text returned) as the hermes format writes it, its arguments to follow."""
        self._header, self.channel, self._state = "", channel, "body"
        if recipient is not None:
            self.channel = None   # a call's arguments are the content's, whatever its channel
            self._call = recipient.removeprefix("functions.")
        if self.channel != REASONING_CHANNEL:
            self._reasoning_ended = self._reasoning_ended or bool(self.reasoning)
        return "" if self._call is None else f'{CALL_START}{{"name": {json.dumps(self._call)}, "arguments": '

    def _close_call(self) -> str:
        """The end of the call being read, as the hermes format writes it ("" when none is)."""
        if self._call is None:
            return ""
        self._call = None
        return "}" + CALL_END

    def _body(self, text: str) -> tuple[str, str]:
        """(the message text that can go out now, what follows its end marker); text that may be the start of
        one is held back."""
        ends = [(at, marker) for marker in ENDS if (at := text.find(marker)) >= 0]
        if not ends:
            cut = len(text) - max(partial_tag(text, marker) for marker in ENDS)
            self._held = text[cut:]
            return text[:cut], ""
        at, marker = min(ends)
        self._state = "between"
        if self.channel == REASONING_CHANNEL:
            self._reasoning_ended = True
        return text[:at], text[at + len(marker):]

    def finish(self) -> tuple[str, str]:
        """The reply ended: held text as its message's part; a header never finished (a model that wrote no
        harmony) is content, as written."""
        held, self._held = self._held, ""
        if self._state == "header" and self._header:
            held, self._header = self._header, ""
            self.channel = None
        elif self._state != "body":
            return "", ""
        parts = (held, "") if self.channel == REASONING_CHANNEL else ("", held + self._close_call())
        self.reasoning, self.content = self.reasoning + parts[0], self.content + parts[1]
        return parts
