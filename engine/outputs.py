"""What the engine reports per request: cumulative text/tokens and the delta since the last report."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    (all samples in `LLMEngine.generate`'s final result)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool                               # every sample of the request has finished
    error: str | None = None                     # set when the request failed instead of finishing
    num_cached_tokens: int = 0
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
    `metrics` (queue time, time to first token) travel once, with the final delta."""

    request_id: str
    outputs: list[SampleDelta]
    finished: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_output(cls, out: RequestOutput) -> "RequestDelta":
        samples = [SampleDelta(c.index, c.delta_text, c.delta_token_ids, len(c.token_ids), c.finish_reason,
                               c.stop_reason, c.delta_logprobs, c.delta_top_logprobs) for c in out.outputs]
        return cls(out.request_id, samples, out.finished, out.error, out.metrics if out.finished else {})
