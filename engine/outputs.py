"""What the engine reports per request: cumulative text/tokens and the delta since the last report, and
the request state (`RequestState`) the reports are made from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.text import OutputText

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.tokenizer import IncrementalDetokenizer


class _Snapshot(NamedTuple):
    """A sample's cumulative output at one report, held by reference: the token and logprob lists only
    ever grow, and the text only grows or loses what no report has emitted yet (a stop string), so the
    first `*_end` items of what these name are the values at the report. Nothing is copied until a
    field is read. (A tuple: made for every sample of every step, at a third of a frozen dataclass's cost.)"""

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
    # `prompt_logprobs` asked: from the report whose step computed the prompt's end on, each prompt token's
    # logprob after the first (index i: token i + 1) and the top ones there; the lists the request keeps, not
    # copies. `prompt_logprobs_new` on that first report only (a `RequestDelta` carries them once).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs_new: bool = False


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
    prompt_logprobs: list[float] | None = None   # `RequestOutput`'s, once: in the delta of its first report
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @classmethod
    def from_output(cls, out: RequestOutput) -> "RequestDelta":
        samples = [SampleDelta(c.index, c.delta_text, c.delta_token_ids, c.num_tokens, c.finish_reason,
                               c.stop_reason, c.delta_logprobs, c.delta_top_logprobs) for c in out.outputs]
        delta = cls(out.request_id, samples, False, out.error) if not out.finished else \
            cls(out.request_id, samples, True, out.error, out.metrics, out.num_cached_tokens)
        if out.prompt_logprobs_new:
            delta.prompt_logprobs, delta.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
        return delta


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
    prompt_logprobs_reported: bool = False

    @property
    def all_finished(self) -> bool:
        """Whether every sample has finished (one look for the usual single sample)."""
        seqs = self.seqs
        return seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)

    def output(self, seqs: list[Sequence]) -> RequestOutput:
        """The report of `seqs` (some or all of this request's samples): what is new since their last
        report, a stop string that may be forming held back; marks it reported. Its cost grows with
        what is new, not with the output so far."""
        outputs = []
        for seq in seqs:
            params = seq.params
            emit_to = len(seq.text)
            if params.stop and not seq.is_finished and not params.include_stop_str_in_output:
                # A stop string may be forming at the end: hold back what could be its start (one kept in the
                # output cuts after itself: what was sent stays, as in vLLM).
                emit_to = max(seq.num_emitted_chars, emit_to - (max(len(s) for s in params.stop) - 1))
            # overlapped steps: the tokens of the step in flight are placeholders until their values are read
            start_tok, end_tok = seq.num_emitted_tokens, seq.num_known_output_tokens
            prompt_len = seq.num_prompt_tokens
            want_lp = params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index, delta_text=seq.text.slice(seq.num_emitted_chars, emit_to),
                delta_token_ids=seq.token_ids[prompt_len + start_tok:prompt_len + end_tok],
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
        finished = self.all_finished
        metrics = {"arrival_time": self.arrival_time}
        if self.first_scheduled_time is not None:
            metrics["queue_time"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
        error = self.seqs[0].error if len(self.seqs) == 1 else next((s.error for s in self.seqs if s.error), None)
        out = RequestOutput(self.request_id, self.prompt_token_ids, outputs, finished, error=error,
                            num_cached_tokens=self.num_cached_tokens, metrics=metrics)
        first = self.seqs[0]   # the sample that computed the prompt (the others fork from it)
        if first.params.prompt_logprobs is not None and not first.wants_prompt_logits:
            out.prompt_logprobs, out.prompt_top_logprobs = first.prompt_logprobs, first.prompt_top_logprobs
            out.prompt_logprobs_new, self.prompt_logprobs_reported = not self.prompt_logprobs_reported, True
        return out
