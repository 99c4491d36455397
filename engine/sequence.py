"""Requests and their sequences: the token state the scheduler and the engine share.

A request with `n` samples owns `n` sequences. A sequence's `token_ids` hold the prompt and then its
output; `num_computed_tokens` of them have K/V in the cache. Each step computes the next slice, and a
step that reaches the end of `token_ids` samples one more token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.text import OutputText
from engine.sampling import SamplingParams
from engine.structured import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"              # preempted by swap: its K/V sit in CPU blocks
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # aborted by the client


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int                       # sample index within the request (0..n-1)
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int                  # resolved: never None here
    priority: int
    arrival_order: int               # global admission order of the request: FCFS tie-break
    generator: torch.Generator | None
    pool: str = "default"
    cache_salt: str | None = None    # prefix-cache partition (the gateway's tenant); None: shared
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cpu_block_table: list[int] = field(default_factory=list)   # while swapped out
    admitted_at_output: int = 0      # num_output_tokens at the last (re)admission: the stability floor
    last_scheduled_step: int = 0     # for the lru victim policy
    num_pending_forks: int = 0       # n > 1: samples that will fork from this one after its prefill
    error: str | None = None         # why the scheduler ended it (e.g. the pool cannot hold it)
    grammar: GrammarMatcher | None = None   # where its output stands in params.structured's grammar
    # output text state, kept by the engine's output processing
    text: OutputText = field(default_factory=OutputText)
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None, delta: str,
                     eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Append a sampled token (its logprobs when asked for) and the text it made final (`delta`);
        returns why the sequence ends with it, if it does: its grammar is complete; once `min_tokens` are
        out, EOS (unless `ignore_eos`), a stop token or a stop string (the text is cut there); else
        `max_tokens` or `max_model_len`. Its cost does not grow with the output."""
        params = self.params
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top or [])
        self.text += delta
        reason: FinishReason | None = None
        n_out = self.num_output_tokens
        if self.grammar is not None and self.grammar.advance(token, self.request_id):
            reason, self.stop_reason = FinishReason.STOP, None   # the grammar is complete
        elif n_out >= params.min_tokens:
            if token in eos_token_ids and not params.ignore_eos:
                reason, self.stop_reason = FinishReason.STOP, None
            elif token in params.stop_token_ids:
                reason, self.stop_reason = FinishReason.STOP, token
            elif params.stop:
                reason = self.cut_at_stop_string(len(delta))
        if reason is None and (n_out >= self.max_tokens or self.num_tokens >= max_model_len):
            reason = FinishReason.LENGTH
        return reason

    def cut_at_stop_string(self, delta_len: int) -> FinishReason | None:
        """Truncate the text at the earliest stop string that the last `delta_len` characters complete;
        STOP (and `stop_reason` the string) if one did."""
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, len(self.text) - delta_len - longest + 1)   # the text is read from here on only
        found: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.text.truncate(index + (len(stop) if self.params.include_stop_str_in_output else 0))
        self.stop_reason = stop
        return FinishReason.STOP

    def sort_key(self) -> tuple[int, int, int]:
        """Waiting-queue order: lower priority value first, then arrival, then sample index."""
        return (self.priority, self.arrival_order, self.index)
