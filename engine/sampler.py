"""The sampler: one step's logits in, one token per row out (`Sampler`); a row's parameters are
`engine.sampling.SamplingParams`.

Semantics follow vLLM. Logprobs come from the raw logits (float32 log_softmax) with a structured output's grammar
applied (vLLM masks the logits with it before its sampler: a forbidden token is no alternative, a forced one
certain), before any other masking. Then, in this order: while a sequence has generated fewer than `min_tokens`
tokens, its stop_token_ids and, unless `ignore_eos`, its EOS ids are masked to -inf; `logit_bias` is added; the
repetition penalty divides the positive logits (multiplies the negative ones) of every token in the prompt or the
output, as in HF transformers; the frequency and presence penalties are subtracted from the logits of tokens already
in the output (OpenAI's formula: logit - count * frequency_penalty - (count > 0) * presence_penalty). Greedy rows
take the argmax of the result. Random rows divide by temperature, then apply min-p, top-k and top-p (vLLM v1's
order), then draw with the exponential race: token = argmax(probs / q), q ~ Exponential(1), which samples exactly
from probs (it is the Gumbel-max trick) without a cumulative sum. Rows that set none of these pay nothing for them:
an all-greedy batch without them is one argmax.

A row with a grammar (`SamplingParams.structured`, matched by the row's `GrammarMatcher`) has MASKED_LOGIT added to
every token the grammar does not allow next, before the bias and the penalties; min_tokens does not apply to it: the
grammar decides where its output ends.

min_tokens with ignore_eos: we do NOT mask EOS. With ignore_eos the engine does not stop on EOS, so EOS cannot end
the sequence early and masking it would only distort the distribution. (vLLM masks the model's primary EOS during
min_tokens even with ignore_eos.) stop_token_ids are masked either way.

Memory: the logits come in the model's dtype, a row per sampled sequence. A batch that needs more than an argmax
is sampled in chunks of rows of at most SAMPLE_CHUNK_ELEMENTS logits, each with its own float32 working set, so the
step's peak beyond the logits stays near 32 bytes x SAMPLE_CHUNK_ELEMENTS (~0.27 GB) whatever the batch. At once,
2,048 rows of a 152k vocabulary with top-p, min-p and logprobs took ~10 GB (besides 1.2 GB of float32 logits), past
the headroom `memory_utilization` leaves even an 80 GB GPU. A chunk's rows are sampled exactly as in one batch (a
seeded row from its own generator).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.penalties import PenaltyCounts, adjust_logits
from engine.sampling import MASKED_LOGIT, SamplingRow
from engine.structured import allocate_bitmask, allowed_tokens, fill_bitmask
from kernels.transfer import to_device, to_host

# Logits one chunk of rows samples at once. Its float32 working set: the copy the sampler modifies, the raw
# logprobs, min-p's probabilities, top-p's sorted values with their int64 indices, probabilities and running sum,
# and the race's draws: 32 bytes a logit at the peak (the process's peak RSS over a step of 512 x 49,152 logits with
# top-p, min-p and logprobs, on the CPU). A 152k vocabulary: 55 rows a chunk; SmolLM2's 49k: 170.
SAMPLE_CHUNK_ELEMENTS = 1 << 23
SAMPLE_BYTES_PER_LOGIT = 32


def sampling_memory_bytes(num_rows: int, vocab_size: int, dtype_bytes: int) -> int:
    """The most sampling holds at a step of `num_rows` sampled rows, on the device that samples: the step's
    logits in the model's dtype, and one chunk's float32 working set."""
    logits = num_rows * vocab_size
    return logits * dtype_bytes + SAMPLE_BYTES_PER_LOGIT * min(logits, SAMPLE_CHUNK_ELEMENTS)

@dataclass
class SamplerOutput:
    """One step's result, as Python values, row for row."""

    token_ids: list[int]
    logprobs: list[float | None]                        # chosen token's logprob; None where not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), highest first; None where not asked


class SampledTokens:
    """A step's sampled tokens (and the logprobs asked for) while the device may still be computing them:
    `token_ids` [num_rows] int64 stays on the device (the next step's inputs read it there), and
    `output()` reads the values. On CUDA the copies to the host are queued behind the sampling kernels
    into pinned memory and an event marks their end, so `output()` waits for this step only, not for
    whatever was launched after it; elsewhere the values are already there."""

    def __init__(self, token_ids: torch.Tensor, num_rows: int,
                 logprobs: tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.token_ids = token_ids
        self._num_rows, self._logprob_rows = num_rows, logprobs   # (rows, num_top, chosen, top values, top ids)
        self._event = None
        self._host = [token_ids, *(logprobs[2:] if logprobs else ())]
        if token_ids.device.type == "cuda":
            self._host = [to_host(t) for t in self._host]
            self._event = torch.cuda.Event()
            self._event.record()

    def output(self) -> SamplerOutput:
        """The values, as Python lists (waits for the device to finish this step's sampling)."""
        if self._event is not None:
            self._event.synchronize()
        tokens, num_rows = self._host[0].tolist(), self._num_rows
        logprobs: list[float | None] = [None] * num_rows
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_rows
        if self._logprob_rows is not None:
            rows, num_top = self._logprob_rows[:2]
            chosen, top_values, top_ids = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(rows):   # a token a grammar forbids (MASKED_LOGIT) is no alternative: not listed
                logprobs[i] = chosen[j]
                top = zip(top_ids[j][:num_top[j]], top_values[j][:num_top[j]])
                top_logprobs[i] = [(token, value) for token, value in top if value > MASKED_LOGIT / 2]
        return SamplerOutput(tokens, logprobs, top_logprobs)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value: `x.argmax(dim=-1)`, the same index on ties (the first), NaN (the
    first NaN) and rows of -inf. On a CPU by `max`'s reduction, which torch vectorises where its argmax does not:
    2.6-3.7x faster at 16-64 rows of a 49k-152k vocabulary (torch 2.13, AVX-512, one and two threads), ~1.3 ms of
    a batch-64 SmolLM2 step; tests/engine/test_sampling.py holds the two to the same indices."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def _min_tokens_banned(row: SamplingRow) -> set[int]:
    """Token ids masked for this row now: stop_token_ids, plus EOS unless ignore_eos, until min_tokens."""
    params = row.params
    if row.num_output_tokens >= params.min_tokens or row.grammar is not None:
        return set()
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= row.eos_token_ids
    return banned


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows `idx` (ascending) of x: x itself when idx is every row, else a gathered copy."""
    if len(idx) == x.shape[0]:
        return x
    return x[to_device(idx, torch.int64, x.device)]


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Mask, in place, all but each row's top_k largest logits (ties at the k-th value are kept); 0: all kept."""
    # logits: [num_rows, vocab]
    vocab_size = logits.shape[1]
    ks = [min(k, vocab_size) if k > 0 else 0 for k in top_k]
    top_values = logits.topk(max(ks), dim=-1).values           # [num_rows, max_k], descending
    k = to_device(ks, torch.int64, logits.device)              # [num_rows]
    thresholds = top_values.gather(1, (k - 1).clamp_min(0).unsqueeze(1))  # [num_rows, 1]
    thresholds.masked_fill_((k == 0).unsqueeze(1), -math.inf)
    logits.masked_fill_(logits < thresholds, -math.inf)


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> None:
    """Keep, in place, each row's smallest set of most likely tokens whose probability sums to >= top_p
    (at least one; ties with the last kept logit are kept too, as in top-k)."""
    # logits: [num_rows, vocab]
    # Rows with top_p == 1 get an infinite bound so rounding in the cumsum never drops their tail.
    p = to_device([q if q < 1.0 else math.inf for q in top_p], torch.float32, logits.device)  # [num_rows]
    sorted_logits = logits.sort(dim=-1, descending=True).values    # [num_rows, vocab]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)  # exclusive cumsum; 0 for the top token
    # [num_rows, 1], >= 1 (a row of NaN logits, a model's overflow, keeps nothing: the clamp keeps it to a draw)
    num_kept = (mass_before < p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    thresholds = sorted_logits.gather(1, num_kept - 1)             # [num_rows, 1]: the smallest kept logit
    logits.masked_fill_(logits < thresholds, -math.inf)


def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Rows `idx` of logits, in place: MASKED_LOGIT added to every token the row's grammar does not allow.
    (An add with index_add_ is several times faster on the CPU than masked_fill over the same rows.)"""
    # logits: [num_rows, vocab] float32
    vocab_size, device = logits.shape[1], logits.device
    bitmask = allocate_bitmask(len(idx), vocab_size)                  # [num_grammar_rows, num_words], CPU
    fill_bitmask([rows[i].grammar for i in idx], bitmask)
    masked = allowed_tokens(bitmask, vocab_size, device).logical_not_().to(logits.dtype).mul_(MASKED_LOGIT)
    if len(idx) == logits.shape[0]:
        logits.add_(masked)
    else:
        logits.index_add_(0, to_device(idx, torch.int64, device), masked)


def _logprob_tensors(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow],
                     logprob_idx: list[int], max_top: int
                     ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `SampledTokens` reads the logprobs from: (rows, each row's top k, the chosen tokens' logprobs
    [num_logprob_rows], the top values and ids [num_logprob_rows, max_top]). raw_logprobs: rows
    logprob_idx of the step's [num_rows, vocab]; token_ids: [num_rows]; max_top: the step's largest top k
    (every chunk of a step lists as many, so their tensors join)."""
    chosen_ids = _take(token_ids.unsqueeze(1), logprob_idx)                 # [num_logprob_rows, 1]
    chosen = raw_logprobs.gather(1, chosen_ids).squeeze(1)
    num_top = [min(rows[i].params.logprobs, raw_logprobs.shape[1]) for i in logprob_idx]
    top_values, top_ids = raw_logprobs.topk(max_top, dim=-1)                # [num_logprob_rows, max_top]
    return logprob_idx, num_top, chosen, top_values, top_ids


def _joined_logprobs(parts: list[tuple[int, torch.Tensor, int, tuple | None]]) -> tuple | None:
    """The logprobs of a step's chunks (start row, tokens, count, `_logprob_tensors` or None) as one step's."""
    pieces = [(start, logprobs) for start, _, _, logprobs in parts if logprobs is not None]
    if not pieces:
        return None
    rows = [start + i for start, logprobs in pieces for i in logprobs[0]]
    num_top = [k for _, logprobs in pieces for k in logprobs[1]]
    return rows, num_top, *(torch.cat([logprobs[j] for _, logprobs in pieces]) for j in (2, 3, 4))


@dataclass(slots=True)
class _RowKinds:
    """Which rows of a step need what, each list ascending; `mask_rows[j]` masks token `mask_tokens[j]`."""

    logprob: list[int]
    adjust: list[int]
    grammar: list[int]
    greedy: list[int]
    random: list[int]
    mask_rows: list[int]
    mask_tokens: list[int]

    def window(self, start: int, stop: int) -> _RowKinds:
        """The kinds of rows start..stop-1, numbered from start."""
        def cut(idx: list[int]) -> list[int]:
            return [i - start for i in idx[bisect_left(idx, start):bisect_left(idx, stop)]]

        low, high = bisect_left(self.mask_rows, start), bisect_left(self.mask_rows, stop)
        return _RowKinds(cut(self.logprob), cut(self.adjust), cut(self.grammar), cut(self.greedy), cut(self.random),
                         cut(self.mask_rows), self.mask_tokens[low:high])


class Sampler:
    """Picks one token per row of logits: greedy, or random with temperature / top-k / top-p / min-p.

    Parameters are applied batched, with per-row tensors. A seeded row draws its randomness from its own
    generator, so its tokens depend only on its logits and that generator, never on the rest of the batch.
    Unseeded rows share `generator` (None: torch's default generator of the logits' device). Owned by
    one device worker; not thread-safe, since the generators advance on every call.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self.penalties: PenaltyCounts | None = None   # made at the first penalized row, for its vocab and device

    def release(self, key: int) -> None:
        """The sequence `key` ended: drop its penalty counts."""
        if self.penalties is not None:
            self.penalties.release(key)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row. logits: [num_rows, vocab_size], any float dtype; left unchanged."""
        return self.launch(logits, rows).output()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampledTokens:
        """`__call__` without reading the tokens: the sampling is queued on the logits' device."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected shape [{len(rows)}, vocab_size], got {list(logits.shape)}")
        num_rows, vocab_size = logits.shape
        kinds = _RowKinds([], [], [], [], [], [], [])
        for i, row in enumerate(rows):   # one pass: it runs for every row of every step
            params = row.params
            if params.logprobs is not None:
                kinds.logprob.append(i)
            if params.adjusts_logits:
                kinds.adjust.append(i)
            if row.grammar is not None:
                kinds.grammar.append(i)
            (kinds.greedy if params.greedy else kinds.random).append(i)
            if row.num_output_tokens < params.min_tokens:
                # Ids outside the vocabulary cannot be sampled anyway.
                banned = [t for t in _min_tokens_banned(row) if t < vocab_size]
                kinds.mask_rows += [i] * len(banned)
                kinds.mask_tokens += banned

        if not kinds.random and not kinds.logprob and not kinds.mask_rows and not kinds.adjust and not kinds.grammar:
            return SampledTokens(argmax(logits), num_rows)   # [num_rows]
        max_top = max((min(rows[i].params.logprobs, vocab_size) for i in kinds.logprob), default=0)
        step = max(1, SAMPLE_CHUNK_ELEMENTS // vocab_size)
        if num_rows <= step:
            return SampledTokens(*self._sample(logits, rows, kinds, max_top))
        parts = [(start, *self._sample(logits[start:start + step], rows[start:start + step],
                                       kinds.window(start, start + step), max_top))
                 for start in range(0, num_rows, step)]
        return SampledTokens(torch.cat([part[1] for part in parts]), num_rows, _joined_logprobs(parts))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], kinds: _RowKinds,
                max_top: int) -> tuple[torch.Tensor, int, tuple | None]:
        """Rows of one chunk (`launch`): their tokens [num_rows], count, and logprobs (`_logprob_tensors`)."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        x = logits.to(torch.float32, copy=True)  # x: [num_rows, vocab]; ours to modify
        if kinds.grammar:   # before the logprobs, as vLLM masks the logits with the grammar before its sampler
            _apply_grammars(x, rows, kinds.grammar)
        raw_logprobs = None
        if kinds.logprob:
            raw_logprobs = torch.log_softmax(_take(x, kinds.logprob), dim=-1)  # [num_logprob_rows, vocab]
        if kinds.mask_rows:
            x[to_device(kinds.mask_rows, torch.int64, device),
              to_device(kinds.mask_tokens, torch.int64, device)] = -math.inf
        penalty_idx = [i for i in kinds.adjust if rows[i].params.penalizes]
        penalty_rows, temporary = None, []
        if penalty_idx:
            if self.penalties is None or self.penalties.vocab_size != vocab_size or self.penalties.device != device:
                self.penalties = PenaltyCounts(vocab_size, device)
            penalty_rows, temporary = self.penalties.rows([rows[i] for i in penalty_idx])
        if kinds.adjust:
            adjust_logits(x, rows, kinds.adjust, self.penalties, penalty_rows)

        token_ids = self._choose(x, rows, kinds.greedy, kinds.random)   # [num_rows]
        if penalty_idx:
            self.penalties.record(penalty_rows, _take(token_ids, penalty_idx))
            self.penalties.free(temporary)
        if raw_logprobs is None:
            return token_ids, num_rows, None
        return token_ids, num_rows, _logprob_tensors(raw_logprobs, token_ids, rows, kinds.logprob, max_top)

    def _choose(self, x: torch.Tensor, rows: Sequence[SamplingRow], greedy_idx: list[int],
                random_idx: list[int]) -> torch.Tensor:
        """The token of each row of the adjusted logits x [num_rows, vocab]: argmax or a random draw."""
        if not random_idx:
            return argmax(x)
        if not greedy_idx:
            return self._draw(x, rows)
        token_ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        greedy_t = to_device(greedy_idx, torch.int64, x.device)
        random_t = to_device(random_idx, torch.int64, x.device)
        token_ids[greedy_t] = argmax(x[greedy_t])
        token_ids[random_t] = self._draw(x[random_t], [rows[i] for i in random_idx])
        return token_ids

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Random rows: temperature, min-p, top-k, top-p (vLLM v1's order: top-p takes its share of the mass
        min-p left), then the exponential race. Modifies `logits`."""
        # logits: [num_rows, vocab] float32
        device = logits.device
        params = [row.params for row in rows]
        if any(p.temperature != 1.0 for p in params):
            temperature = to_device([p.temperature for p in params], torch.float32, device)  # [num_rows]
            logits.div_(temperature.unsqueeze(1))
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, device)  # [num_rows]
            probs = logits.softmax(dim=-1)
            thresholds = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
            logits.masked_fill_(probs < thresholds, float("-inf"))
            del probs   # its float32 copy of the chunk, not held through top-k and top-p
        if any(p.top_k > 0 for p in params):
            _apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            _apply_top_p(logits, [p.top_p for p in params])
        probs = logits.softmax(dim=-1)  # [num_rows, vocab]

        q = torch.empty_like(probs)  # [num_rows, vocab]
        if any(row.generator is None for row in rows):
            q.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                q[i].exponential_(generator=row.generator)  # a contiguous row: the same draw as a fresh tensor
        # A draw of exactly 0 would give 0/0 = NaN on a masked token, and argmax picks NaN.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return argmax(probs.div_(q))  # [num_rows]
