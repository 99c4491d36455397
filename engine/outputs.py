"""What the engine reports per request: cumulative text/tokens and the delta since the last report, and
the request state (`RequestState`) the reports are made from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.tokenizer import IncrementalDetokenizer


@dataclass
class CompletionOutput:
    index: int                                   # sample index (0..n-1)
    text: str                                    # all text so far (stop strings held back until safe)
    token_ids: list[int]
    delta_text: str = ""                         # new since this sequence's previous report
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None             # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it
    logprobs: list[float] | None = None          # of the chosen tokens (when asked for)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        samples = [SampleDelta(c.index, c.delta_text, c.delta_token_ids, len(c.token_ids), c.finish_reason,
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
        report, a stop string that may be forming held back; marks it reported."""
        outputs = []
        for seq in seqs:
            params = seq.params
            emit_to = len(seq.text)
            if params.stop and not seq.is_finished:
                # A stop string may be forming at the end: hold back what could be its start.
                emit_to = max(seq.num_emitted_chars, emit_to - (max(len(s) for s in params.stop) - 1))
            out_ids = seq.output_token_ids
            start_tok = seq.num_emitted_tokens
            want_lp = params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text[:emit_to], token_ids=list(out_ids),
                delta_text=seq.text[seq.num_emitted_chars:emit_to], delta_token_ids=out_ids[start_tok:],
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if want_lp else None,
                top_logprobs=[list(t) for t in seq.top_logprobs] if want_lp else None,
                delta_logprobs=seq.logprobs[start_tok:] if want_lp else None,
                delta_top_logprobs=seq.top_logprobs[start_tok:] if want_lp else None,
            ))
            seq.num_emitted_chars = emit_to
            seq.num_emitted_tokens = len(out_ids)
        finished = all(s.is_finished for s in self.seqs)
        metrics = {"arrival_time": self.arrival_time}
        if self.first_scheduled_time is not None:
            metrics["queue_time"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
        error = next((s.error for s in self.seqs if s.error), None)
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, finished, error=error,
                             num_cached_tokens=self.num_cached_tokens, metrics=metrics)
