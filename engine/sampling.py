"""Sampling: per-request parameters, and the sampler that turns one step's logits into one token per row.

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
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.penalties import PenaltyCounts, adjust_logits
from engine.structured import GrammarMatcher, StructuredOutput, allocate_bitmask, allowed_tokens, fill_bitmask
from kernels.transfer import to_device, to_host

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024      # a stop string's length: an open byte run's last 4 x this many tokens are decoded for them
MAX_STOP_TOKEN_IDS = 1024   # masked every step for every row: the list's length is each step's cost
MAX_LOGIT_BIAS = 300        # OpenAI's limit on logit_bias entries
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_ABS_PENALTY = 2.0       # presence_penalty and frequency_penalty: [-2, 2], as OpenAI
# repetition_penalty's range: a seen token's logit is divided (or multiplied) by it in float32, where 1e-300 is 0
# and 40 / 1e-38 is inf; within this range any finite logit stays finite
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# What a grammar adds to a token it does not allow: far below any logit, and exp() of it is exactly 0 in
# float32, so no sampling method can pick it (-inf would do the same, but 0 * -inf is NaN in the add).
MASKED_LOGIT = -1e30
# Past it every token is about equally likely already; and a grammar's masked tokens stay out of reach (MASKED_LOGIT,
# at worst x 1e-6 by a repetition penalty, over this temperature is still -1e20: exp() of it is 0)
MAX_TEMPERATURE = 1e4
# Temperatures below this are greedy, as in vLLM (_SAMPLING_EPS): dividing logits by less overflows float32.
MIN_SAMPLING_TEMPERATURE = 1e-5


def _as_int(name: str, value: object) -> int:
    if type(value) is int:   # the common case, without the ABC check's cost (every request passes here)
        return value
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if type(value) not in (float, int) and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:   # an integer past the largest float (JSON bounds no integer)
        raise ValueError(f"{name}: must be finite, got a number past the largest float") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return number


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")
    return value


def _as_stop(value: object) -> tuple[str, ...]:
    stop = (value,) if isinstance(value, str) else value
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop: must be a string or a list of strings, got {value!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: each stop string must be a non-empty string, got {s!r}")
        if len(s) > MAX_STOP_CHARS:   # the text held back for a stop string, and the step's work on it, stay bounded
            raise ValueError(f"stop: each stop string is at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:   # a lone surrogate from JSON ("\ud800"): no text the model writes holds one
                raise ValueError(f"stop: each stop string must be valid Unicode, got {s!r}") from None
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return tuple(stop)


def _as_token_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: must be a list of token ids, got {value!r}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name}: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}")
    ids = tuple(_as_int(name, t) for t in value)
    if any(t < 0 for t in ids):
        raise ValueError(f"{name}: token ids must be >= 0, got {list(ids)}")
    return ids


def _as_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them) or (id, bias) pairs, sorted by id."""
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"logit_bias: must map token ids to biases, got {value!r}")
    pairs = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"logit_bias: must map token ids to biases, got {item!r}")
        key, bias = item
        if isinstance(key, str):
            # "-1", "1.5", "a", "²" (a digit to str.isdigit, not to int): not a token id; 10 digits hold any
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {key[:20]!r}")
            key = int(key)
        token = _as_int("logit_bias", key)
        if token < 0:
            raise ValueError(f"logit_bias: token ids must be >= 0, got {token}")
        bias = _as_float(f"logit_bias[{token}]", bias)
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token}]: must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                             f"got {bias}")
        pairs[token] = bias
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop. Validated on construction; errors name the field.

    `stop` accepts a string or a list and is stored as a tuple; `stop_token_ids` likewise. Numbers are
    stored as int / float (numpy scalars are accepted).
    """

    n: int = 1
    temperature: float = 1.0      # 0 -> greedy
    top_p: float = 1.0            # [0, 1] (OpenAI's range; 0 keeps the most likely token, as greedy)
    top_k: int = 0                # 0 or -1 -> disabled; else >= 1
    min_p: float = 0.0            # [0, 1]
    seed: int | None = None
    max_tokens: int | None = 16   # None -> as many as fit in max_model_len (the engine resolves it)
    min_tokens: int = 0           # EOS and stop_token_ids are masked until this many tokens were generated
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # None: none; k >= 0: the chosen token's logprob plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0     # [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0    # [-2, 2]: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0   # HF's, in [1e-6, 1e6]: tokens in the prompt or output, logit / p if > 0 else * p
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to the logits
    structured: StructuredOutput | None = None     # the output must match this JSON schema or grammar

    def __post_init__(self) -> None:
        n = _as_int("n", self.n)
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n: must be in 1..{MAX_N}, got {n}")
        temperature = _as_float("temperature", self.temperature)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
        top_p = _as_float("top_p", self.top_p)
        if not 0 <= top_p <= 1:
            raise ValueError(f"top_p: must be in [0, 1], got {top_p}")
        top_k = _as_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k: must be -1 or 0 (disabled) or >= 1, got {top_k}")
        min_p = _as_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {min_p}")
        seed = None if self.seed is None else _as_int("seed", self.seed)
        max_tokens = None if self.max_tokens is None else _as_int("max_tokens", self.max_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        min_tokens = _as_int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {min_tokens}")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({max_tokens}), got {min_tokens}")
        logprobs = None if self.logprobs is None else _as_int("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in 0..{MAX_LOGPROBS}, got {logprobs}")
        penalties = {name: _as_float(name, getattr(self, name)) for name in ("presence_penalty", "frequency_penalty")}
        for name, value in penalties.items():
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name}: must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}")
        repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= repetition_penalty <= high:
            raise ValueError(f"repetition_penalty: must be in [{low:g}, {high:g}] (1: none), got {repetition_penalty}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured: must be a StructuredOutput, got {type(self.structured).__name__}")
        normalised = {
            "n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "seed": seed, "max_tokens": max_tokens, "min_tokens": min_tokens, "stop": _as_stop(self.stop),
            "stop_token_ids": _as_token_ids("stop_token_ids", self.stop_token_ids),
            "ignore_eos": _as_bool("ignore_eos", self.ignore_eos), "logprobs": logprobs,
            "skip_special_tokens": _as_bool("skip_special_tokens", self.skip_special_tokens),
            "include_stop_str_in_output": _as_bool("include_stop_str_in_output", self.include_stop_str_in_output),
            **penalties, "repetition_penalty": repetition_penalty, "logit_bias": _as_logit_bias(self.logit_bias),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (below MIN_SAMPLING_TEMPERATURE) or top_k == 1."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, presence or frequency penalty reads this request's earlier tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty changes this request's logits before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The generator for sample `index` (0..n-1) of a request with `seed`, on `device`.

    (seed, index) is mixed with BLAKE2b, not added, so (1, 0) and (0, 1) get unrelated streams; the same
    pair always gives the same stream.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits (one sequence)."""

    params: SamplingParams
    generator: torch.Generator | None   # set when params.seed is not None; on the logits' device
    num_output_tokens: int               # tokens already generated by this sequence (for min_tokens)
    eos_token_ids: frozenset[int]
    # The sequence's prompt then output tokens (its last num_output_tokens are the output). The engine
    # passes its own list, not a copy; the penalties read it once per sequence (`PenaltyCounts`).
    token_ids: Sequence[int] = ()
    grammar: GrammarMatcher | None = None   # where the row stands in params.structured's grammar
    # The sequence's id: its token counts stay on the device from step to step under this key (the
    # engine releases them when the sequence ends). None: counted afresh from token_ids for this call.
    key: int | None = None


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
                     logprob_idx: list[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `SampledTokens` reads the logprobs from: (rows, each row's top k, the chosen tokens' logprobs
    [num_logprob_rows], the top values and ids [num_logprob_rows, max_top]). raw_logprobs: rows
    logprob_idx of the step's [num_rows, vocab]; token_ids: [num_rows]."""
    chosen_ids = _take(token_ids.unsqueeze(1), logprob_idx)                 # [num_logprob_rows, 1]
    chosen = raw_logprobs.gather(1, chosen_ids).squeeze(1)
    num_top = [min(rows[i].params.logprobs, raw_logprobs.shape[1]) for i in logprob_idx]
    top_values, top_ids = raw_logprobs.topk(max(num_top), dim=-1)           # [num_logprob_rows, max_top]
    return logprob_idx, num_top, chosen, top_values, top_ids


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
        device = logits.device
        logprob_idx, adjust_idx, grammar_idx, greedy_idx, random_idx = [], [], [], [], []
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        for i, row in enumerate(rows):   # one pass: it runs for every row of every step
            params = row.params
            if params.logprobs is not None:
                logprob_idx.append(i)
            if params.adjusts_logits:
                adjust_idx.append(i)
            if row.grammar is not None:
                grammar_idx.append(i)
            (greedy_idx if params.greedy else random_idx).append(i)
            if row.num_output_tokens < params.min_tokens:
                # Ids outside the vocabulary cannot be sampled anyway.
                banned = [t for t in _min_tokens_banned(row) if t < vocab_size]
                mask_rows += [i] * len(banned)
                mask_tokens += banned

        if not random_idx and not logprob_idx and not mask_rows and not adjust_idx and not grammar_idx:
            return SampledTokens(logits.argmax(dim=-1), num_rows)   # [num_rows]

        x = logits.to(torch.float32, copy=True)  # x: [num_rows, vocab]; ours to modify
        if grammar_idx:   # before the logprobs, as vLLM masks the logits with the grammar before its sampler
            _apply_grammars(x, rows, grammar_idx)
        raw_logprobs = None
        if logprob_idx:
            raw_logprobs = torch.log_softmax(_take(x, logprob_idx), dim=-1)  # [num_logprob_rows, vocab]
        if mask_rows:
            x[to_device(mask_rows, torch.int64, device), to_device(mask_tokens, torch.int64, device)] = -math.inf
        penalty_idx = [i for i in adjust_idx if rows[i].params.penalizes]
        penalty_rows, temporary = None, []
        if penalty_idx:
            if self.penalties is None or self.penalties.vocab_size != vocab_size or self.penalties.device != device:
                self.penalties = PenaltyCounts(vocab_size, device)
            penalty_rows, temporary = self.penalties.rows([rows[i] for i in penalty_idx])
        if adjust_idx:
            adjust_logits(x, rows, adjust_idx, self.penalties, penalty_rows)

        token_ids = self._choose(x, rows, greedy_idx, random_idx)   # [num_rows]
        if penalty_idx:
            self.penalties.record(penalty_rows, _take(token_ids, penalty_idx))
            self.penalties.free(temporary)
        if raw_logprobs is None:
            return SampledTokens(token_ids, num_rows)
        return SampledTokens(token_ids, num_rows, _logprob_tensors(raw_logprobs, token_ids, rows, logprob_idx))

    def _choose(self, x: torch.Tensor, rows: Sequence[SamplingRow], greedy_idx: list[int],
                random_idx: list[int]) -> torch.Tensor:
        """The token of each row of the adjusted logits x [num_rows, vocab]: argmax or a random draw."""
        if not random_idx:
            return x.argmax(dim=-1)
        if not greedy_idx:
            return self._sample(x, rows)
        token_ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        greedy_t = to_device(greedy_idx, torch.int64, x.device)
        random_t = to_device(random_idx, torch.int64, x.device)
        token_ids[greedy_t] = x[greedy_t].argmax(dim=-1)
        token_ids[random_t] = self._sample(x[random_t], [rows[i] for i in random_idx])
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
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
        return probs.div_(q).argmax(dim=-1)  # [num_rows]
