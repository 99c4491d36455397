"""Sampling: a request's parameters (`SamplingParams`, validated, errors naming the field) and what the sampler
(`engine.sampler`) needs of each row (`SamplingRow`, `make_generator`)."""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.structured import GrammarMatcher, StructuredOutput

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
    prompt_logprobs: int | None = None   # the same for each prompt token after the first (the whole prompt computed)
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
        prompt_logprobs = None if self.prompt_logprobs is None else _as_int("prompt_logprobs", self.prompt_logprobs)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in 0..{MAX_LOGPROBS}, got {prompt_logprobs}")
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
            "prompt_logprobs": prompt_logprobs,
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
