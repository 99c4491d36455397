"""What the engine reports per request: cumulative text/tokens and the delta since the last report, and
the request state (`RequestState`) the reports are made from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.tokenizer import IncrementalDetokenizer


class OutputText:
    """A sequence's output text, kept as the pieces each step appended: appending, reading the end and
    cutting the end cost what they touch, never the whole text (joined only when all of it is read,
    and then kept joined). Text before the cut point never changes, which is what lets a report hold
    this object and an end offset instead of a copy (`CompletionOutput`)."""

    __slots__ = ("_parts", "_len")

    def __init__(self, text: str = "") -> None:
        self._parts: list[str] = [text] if text else []
        self._len = len(text)

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return self.slice(0, self._len)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OutputText):
            other = str(other)
        return str(self) == other if isinstance(other, str) else NotImplemented

    def __iadd__(self, text: str) -> "OutputText":
        if text:
            self._parts.append(text)
            self._len += len(text)
        return self

    def slice(self, start: int, end: int) -> str:
        """The text's [start:end] (0 <= start, end <= len); reads the pieces from the end back to `start`."""
        end = min(end, self._len)
        if start >= end:
            return ""
        if start == 0 and len(self._parts) > 1:   # everything: join once, keep it joined
            self._parts[:] = ["".join(self._parts)]
        pieces, pos = [], self._len
        for part in reversed(self._parts):
            if pos <= start:
                break
            part_start = pos - len(part)
            if part_start < end:
                pieces.append(part[max(start - part_start, 0):end - part_start])
            pos = part_start
        return "".join(reversed(pieces))

    def find(self, sub: str, start: int) -> int:
        """The index of `sub`'s first occurrence at or after `start`, or -1 (reads only the text from `start`)."""
        index = self.slice(start, self._len).find(sub)
        return -1 if index < 0 else start + index

    def truncate(self, length: int) -> None:
        """Cut the text to its first `length` characters (pieces past them dropped, the last one cut)."""
        while self._parts and self._len - len(self._parts[-1]) >= length:
            self._len -= len(self._parts.pop())
        if self._len > length:
            last = self._parts.pop()
            self._parts.append(last[:len(last) - (self._len - length)])
            self._len = length


@dataclass(frozen=True)
class _Snapshot:
    """A sample's cumulative output at one report, held by reference: the text, token and logprob
    lists only ever grow (a stop string cuts the text into a new object), so the first `*_end` items
    of what these name are the values at the report. Nothing is copied until a field is read."""

    text: OutputText
    text_end: int
    token_ids: list[int]              # the sequence's prompt + output
    tokens_start: int                 # where its output starts (its prompt length)
    tokens_end: int
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class CompletionOutput:
    """One sample's report after a step: what the step added (`delta_*`), made in time independent of
    the output's length, and the cumulative `text`, `token_ids`, `logprobs` and `top_logprobs`, read
    from a snapshot on access (each read copies, so a caller that streams reads only the deltas)."""

    index: int                                   # sample index (0..n-1)
    delta_text: str = ""                         # new since this sequence's previous report
    delta_token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0                          # output tokens so far
    finish_reason: str | None = None             # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it
    delta_logprobs: list[float] | None = None    # of the chosen tokens (when asked for)
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None
    snapshot: _Snapshot | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text so far (a stop string that may be forming held back until it is safe)."""
        return "" if self.snapshot is None else self.snapshot.text.slice(0, self.snapshot.text_end)

    @property
    def token_ids(self) -> list[int]:
        s = self.snapshot
        return [] if s is None else s.token_ids[s.tokens_start:s.tokens_end]

    @property
    def logprobs(self) -> list[float] | None:
        s = self.snapshot
        return None if s is None or s.logprobs is None else s.logprobs[:s.tokens_end - s.tokens_start]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        s = self.snapshot
        if s is None or s.top_logprobs is None:
            return None
        return [list(t) for t in s.top_logprobs[:s.tokens_end - s.tokens_start]]


@dataclass
class RequestOutput:
    """One request's report after a step; `outputs` holds the samples that changed in that step
    (all samples in `LLMEngine.generate`'s final result).

    `num_cached_tokens`: the prompt tokens whose K/V the prefix cache held when the request was first
    admitted (whole blocks, at most `len(prompt) - 1`; 0 with prefix caching off). The request's, not its
    samples': n > 1 samples fork from one prefill and count once; a recompute after a preemption that
    finds the cache again does not change it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool                               # every sample of the request has finished
    error: str | None = None                     # set when the request failed instead of finishing
    num_cached_tokens: int = 0                   # prompt tokens served from the prefix cache (see above)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SampleDelta:
    """What one sample produced since its previous report: its part of a `RequestDelta`."""

    index: int
    delta_text: str
    delta_token_ids: list[int]
    num_tokens: int                              # output tokens so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestDelta:
    """What the device worker sends for a request after a step: only the changes since its previous
    report, so the bytes per step do not grow with the prompt or the output.
    `metrics` (queue time, time to first token) and `num_cached_tokens` (`RequestOutput`'s) travel once,
    with the final delta (0 on the others)."""

    request_id: str
    outputs: list[SampleDelta]
    finished: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @classmethod
    def from_output(cls, out: RequestOutput) -> "RequestDelta":
        samples = [SampleDelta(c.index, c.delta_text, c.delta_token_ids, c.num_tokens, c.finish_reason,
                               c.stop_reason, c.delta_logprobs, c.delta_top_logprobs) for c in out.outputs]
        if not out.finished:
            return cls(out.request_id, samples, False, out.error)
        return cls(out.request_id, samples, True, out.error, out.metrics, out.num_cached_tokens)


@dataclass
class RequestState:
    """A request in the engine: its sequences (one per sample), times, and detokenizers.
    `num_cached_tokens` is set with `first_scheduled_time`, at its first admission (`RequestOutput`'s)."""

    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)

    def output(self, seqs: list[Sequence]) -> RequestOutput:
        """The report of `seqs` (some or all of this request's samples): what is new since their last
        report, a stop string that may be forming held back; marks it reported. Its cost grows with
        what is new, not with the output so far."""
        outputs = []
        for seq in seqs:
            params = seq.params
            emit_to = len(seq.text)
            if params.stop and not seq.is_finished:
                # A stop string may be forming at the end: hold back what could be its start.
                emit_to = max(seq.num_emitted_chars, emit_to - (max(len(s) for s in params.stop) - 1))
            start_tok, end_tok = seq.num_emitted_tokens, seq.num_output_tokens
            prompt_len = seq.num_prompt_tokens
            want_lp = params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index, delta_text=seq.text.slice(seq.num_emitted_chars, emit_to),
                delta_token_ids=seq.token_ids[prompt_len + start_tok:],
                num_tokens=end_tok,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                delta_logprobs=seq.logprobs[start_tok:] if want_lp else None,
                delta_top_logprobs=seq.top_logprobs[start_tok:] if want_lp else None,
                snapshot=_Snapshot(seq.text, emit_to, seq.token_ids, prompt_len, prompt_len + end_tok,
                                   seq.logprobs if want_lp else None, seq.top_logprobs if want_lp else None),
            ))
            seq.num_emitted_chars = emit_to
            seq.num_emitted_tokens = end_tok
        finished = all(s.is_finished for s in self.seqs)
        metrics = {"arrival_time": self.arrival_time}
        if self.first_scheduled_time is not None:
            metrics["queue_time"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
        error = next((s.error for s in self.seqs if s.error), None)
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, finished, error=error,
                             num_cached_tokens=self.num_cached_tokens, metrics=metrics)
