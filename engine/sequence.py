"""Requests and their sequences: the token state the scheduler and the engine share.

A request with `n` samples owns `n` sequences. A sequence's `token_ids` hold the prompt and then its
output; `num_computed_tokens` of them have K/V in the cache. Each step computes the next slice, and a
step that reaches the end of `token_ids` samples one more token.

With overlapped steps (`engine.overlap`) a sampled token is counted before its value is known: the
engine appends a placeholder (`pending_token`, a negative id naming the token's row in its step's
sampled ids) and the next step is scheduled and launched with it; `append_token` later writes the
value over the oldest placeholder. `num_pending` counts the placeholders at the end of `token_ids`
(0 when steps do not overlap).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
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
    background: bool = False         # a batch line's: after every other sequence of its pool (`sort_key`)
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
    state_branch: int = 0            # a state model's: where its cached K/V ended past a snapshot (engine.state_cache)
    grammar: GrammarMatcher | None = None   # where its output stands in params.structured's grammar
    # output text state, kept by the engine's output processing
    text: OutputText = field(default_factory=OutputText)
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)   # of prompt tokens 1.. (`engine.prompt_logprobs`)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_pending: int = 0             # placeholders at the end of token_ids: sampled, values not read yet
    stop_from: int = 0               # characters the first min_tokens tokens wrote (held ones too): no stop ends there

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        """Output tokens whose values are known (`num_output_tokens` less the placeholders)."""
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    def ends_when_known(self, max_model_len: int) -> bool:
        """Whether a placeholder's token ends the sequence whatever its value (max_tokens or max_model_len
        reached): the scheduler computes nothing after it."""
        return bool(self.num_pending) and (self.num_output_tokens >= self.max_tokens
                                           or self.num_tokens >= max_model_len)

    def add_pending(self, row: int) -> None:
        """Count the token sampled into row `row` of its step's ids before its value is read."""
        self.token_ids.append(pending_token(row))
        self.num_pending += 1

    def drop_pending(self) -> None:
        """The sequence ended: the tokens sampled after the one that ended it are not part of it."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether it asks for prompt logprobs it does not hold yet: its prompt is computed, never taken from the
        prefix cache (a cached block's logits were never computed: `engine.prompt_logprobs`)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                     detokenize: Callable[[int], str], eos_token_ids: frozenset[int],
                     max_model_len: int, held: Callable[[int], str] = lambda max_chars: "") -> FinishReason | None:
        """Append a sampled token (its logprobs when asked for) and the text it makes final (`detokenize`:
        its detokenizer's step); returns why the sequence ends with it, if it does: its grammar is complete;
        once `min_tokens` are out, EOS (unless `ignore_eos`) or a stop token, whose text is not the answer's
        (vLLM's rule; unless `include_stop_str_in_output`; its id and logprob are), or, past `min_tokens`, a
        stop string ending in its text (the text is cut there), or in the text its detokenizer holds back
        (`held`: an open byte run's, `IncrementalDetokenizer.held_text`; cut once flushed at the end, by the
        caller); else `max_tokens` or `max_model_len`. Its cost does not grow with the output."""
        params = self.params
        if self.num_pending:   # the oldest placeholder gets its value
            self.token_ids[len(self.token_ids) - self.num_pending] = token
            self.num_pending -= 1
        else:
            self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top or [])
        reason: FinishReason | None = None
        n_out = self.num_known_output_tokens
        if self.grammar is not None and self.grammar.advance(token, self.request_id):
            reason, self.stop_reason = FinishReason.STOP, None   # the grammar is complete (on EOS, or its text)
            by_token = token in eos_token_ids
            if self.grammar.error is not None:   # or the matcher failed (a parser limit): the output is not whole
                self.error = (f"response_format: the grammar could not follow the output past its {n_out} tokens "
                              f"(a complex schema can pass the grammar library's limits): {self.grammar.error}")
        elif n_out >= params.min_tokens and token in eos_token_ids and not params.ignore_eos:
            reason, self.stop_reason, by_token = FinishReason.STOP, None, True
        elif n_out >= params.min_tokens and token in params.stop_token_ids:
            reason, self.stop_reason, by_token = FinishReason.STOP, token, True
        else:
            by_token = False
        delta = "" if by_token and not params.include_stop_str_in_output else detokenize(token)
        self.text += delta
        if n_out == params.min_tokens and params.stop:   # the window's end: what a byte run holds counts too
            self.stop_from = len(self.text) + len(held(n_out))   # (a run of n_out tokens at most: all of it)
        if reason is None or not by_token or delta:   # text a stop string may end: a token that completes the
            reason = self._stopped_by_string(len(delta)) or reason   # grammar's, a stop token's included (vLLM's)
        if reason is None and params.stop and self.stops_in(held):   # "\n" as the byte token <0x0A>, say
            reason = FinishReason.STOP
        if reason is None and (n_out >= self.max_tokens or self.num_prompt_tokens + n_out >= max_model_len):
            reason = FinishReason.LENGTH
        return reason

    def stops_in(self, held: Callable[[int], str]) -> bool:
        """Whether the text the detokenizer holds back (an open byte run's, `IncrementalDetokenizer.held_text`)
        now ends in a stop string, once past `min_tokens`: the sequence ends on the token that completed it,
        not once the run does (each token is checked, so a stop string ends where the held text ends)."""
        stops = self.params.stop
        if not stops or self.num_known_output_tokens <= self.params.min_tokens:
            return False
        longest, end = max(map(len, stops)), len(self.text)
        # past the window's own held text (a run open since: at least that much more, whole if it is short)
        if not (text := held(max(0, self.stop_from - end) + longest)) or end + len(text) <= self.stop_from:
            return False
        text = self.text.slice(max(0, end - longest), end) + text
        return any(text.endswith(stop) for stop in stops)

    def append_flushed(self, delta: str) -> bool:
        """At its end, the text its detokenizer held back (`delta`: a byte-fallback run's, "\n" among them,
        comes only once the run ends), checked for stop strings as each token's text is; True if one cut it."""
        self.text += delta
        return self._stopped_by_string(len(delta)) is not None

    def _stopped_by_string(self, delta_len: int) -> FinishReason | None:
        """`cut_at_stop_string` once past `min_tokens` (the first min_tokens' text stops nothing)."""
        if not self.params.stop or self.num_known_output_tokens <= self.params.min_tokens:
            return None
        return self.cut_at_stop_string(delta_len)

    def cut_at_stop_string(self, delta_len: int) -> FinishReason | None:
        """Truncate the text at the earliest stop string that the last `delta_len` characters complete
        (one ending in them: text before them stopped nothing, the first `min_tokens`' included); STOP (and
        `stop_reason` the string) if one did."""
        if not delta_len:
            return None
        found: tuple[int, str] | None = None
        for stop in self.params.stop:   # ending in the delta, and past the first min_tokens' text (`stop_from`)
            first = max(0, len(self.text) - delta_len, self.stop_from) - len(stop) + 1
            index = self.text.find(stop, max(0, first))
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.text.truncate(index + (len(stop) if self.params.include_stop_str_in_output else 0))
        self.stop_reason = stop
        return FinishReason.STOP

    def sort_key(self) -> tuple[bool, int, int, int]:
        """Waiting-queue order: a batch line's after the others, then lower priority value first, then arrival,
        then sample index."""
        return (self.background, self.priority, self.arrival_order, self.index)


def pending_token(row: int) -> int:
    """The placeholder of the token sampled into row `row` of a step's ids: -1 - row (token ids are >= 0)."""
    return -1 - row
