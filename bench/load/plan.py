"""The load of `cliffguard bench serve`, planned before it starts: the run's configuration
(`LoadConfig`, `Goodput`), the arrivals of every workload class, and each request's prompt and body
(`plan_requests`). Nothing here talks to a server."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pools.workload import (DEFAULT_WORKLOAD, LengthDist, WorkloadClass, MIN_BURSTINESS, check_positive, class_arrivals, class_rates,
                            gamma_arrivals)
from pools.config.checks import SpecError, is_int, show

PROBE_CLASS = "probe"
GOODPUT_KEYS = ("ttft", "itl", "e2e")
# Common English words that GPT-2, Llama 3 and SmolLM2 BPEs encode as one token each, alone or after a space.
WORDS = tuple("""
the of and to in is you that it he was for on are as with his they at be this have from or one had by word but
not what all were we when your can said there use an each which she do how their if will up other about out many
then them these so some her would make like him into time has look two more write go see number no way could
people my than first water been call who oil its now find long down day did get come made may part over new
sound take only little work know place year live me back give most very after thing our just name good man think
say great where help through much before line right too mean old any same tell boy follow came want show also
around form three small set put end does another well large must big even such because turn here why ask went
men read need land different home us move try kind hand picture again change off play air away animal house
point page letter mother answer found study still learn should world high every near add food between own below
country plant last school father keep tree never start city earth eye light thought head under story left few
while along might close something next hard open example begin life always those both paper together got group
often run important until children side feet car mile night walk white sea grow river four state once book stop
without second late miss idea enough eat face watch far real almost let above girl sometimes cut young talk soon
list song being leave family
""".split())


# --- workload classes and the run's configuration -----------------------------------------------------

PROBE = WorkloadClass(PROBE_CLASS, endpoint="completion", prompt_len=LengthDist("fixed", value=8),
                      output_len=LengthDist("fixed", value=2))


@dataclass(frozen=True)
class Goodput:
    """Service-level targets in seconds. A request is good when it completed and meets every target given:
    TTFT <= `ttft`, its mean TPOT ((e2e - TTFT) / (output tokens - 1), vLLM's rule) <= `itl`, e2e <= `e2e`."""

    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for key in GOODPUT_KEYS:
            check_positive(key, getattr(self, key), optional=True)
        if all(getattr(self, key) is None for key in GOODPUT_KEYS):
            raise SpecError(f"goodput: give at least one target of {', '.join(GOODPUT_KEYS)}")

    @classmethod
    def parse(cls, items: Iterable[str]) -> Goodput:
        """`["ttft:500", "itl:50"]` (milliseconds; `tpot` is a synonym of `itl`) -> Goodput in seconds."""
        targets: dict[str, float] = {}
        for item in items:
            key, _, ms = item.partition(":")
            key = "itl" if key.strip() == "tpot" else key.strip()
            try:
                value = float(ms)
            except ValueError:
                value = math.nan
            if key not in GOODPUT_KEYS or not value > 0 or math.isinf(value) or key in targets:
                raise SpecError(f"goodput: expected distinct KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)} "
                                f"and MS > 0, got {item!r}")
            targets[key] = value / 1e3
        return cls(**targets)

    def is_good(self, record: Any) -> bool:
        """Whether `record` (a `bench.load.sender.RequestRecord`) completed within every target."""
        if record.status != "ok" or record.ttft is None:
            return False
        tpot = record.tpot
        return ((self.ttft is None or record.ttft <= self.ttft)
                and (self.itl is None or tpot is None or tpot <= self.itl)
                and (self.e2e is None or record.e2e <= self.e2e))


@dataclass(frozen=True)
class LoadConfig:
    """One open-loop run. Times in seconds, rates in requests/s. Validated on construction (ValueError
    naming the field).

    `url`: the server's base URL (a trailing `/v1` is allowed). `model`: None asks GET /v1/models for the
    first. `request_rate`: split over the share classes (math.inf: all `num_requests` at t=0, classes drawn
    by share). Arrivals stop after `duration` and/or `num_requests` (one is required; probes do not count).
    `metrics_url`: None means `<url>/metrics`. `tokenizer`: a model spec (builtin:..., a folder) whose
    tokenizer makes completion prompts exactly `prompt_len` tokens long. `continuous_usage`: ask for
    vLLM's `continuous_usage_stats` (the usage so far in every chunk; cliffguard and vLLM serve it), so
    a chunk that carries two tokens (a detokenizer holds a token back until its character is whole)
    counts as two gaps of half its wait in ITL, not as one token's gap twice as long.
    """

    url: str
    model: str | None = None
    classes: tuple[WorkloadClass, ...] = DEFAULT_WORKLOAD
    request_rate: float = 1.0
    burstiness: float = 1.0
    duration: float | None = None
    num_requests: int | None = None
    seed: int = 0
    timeout: float = 120.0
    drain_timeout: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    probe_rate: float = 0.0
    goodput: Goodput | None = None
    scrape: bool = True
    metrics_url: str | None = None
    scrape_interval: float = 1.0
    tokenizer: str | None = None
    progress: bool = False
    continuous_usage: bool = False

    def __post_init__(self) -> None:
        for key in ("url", "metrics_url"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and re.match(r"^https?://[^/\s]+", value)):
                raise SpecError(f"{key}: must be an http:// or https:// URL, got {show(value)}")
        if not isinstance(self.classes, tuple) or not self.classes or not all(
                isinstance(c, WorkloadClass) for c in self.classes):
            raise SpecError(f"classes: must be a non-empty tuple of WorkloadClass, got {show(self.classes)}")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names) or (self.probe_rate and PROBE_CLASS in names):
            raise SpecError(f"classes: names must be unique (and not {PROBE_CLASS!r} with probes), got {names}")
        check_positive("request_rate", self.request_rate, allow_inf=True)
        for key in ("burstiness", "timeout", "drain_timeout", "scrape_interval"):
            check_positive(key, getattr(self, key))
        if not self.burstiness >= MIN_BURSTINESS:   # nearly every gap 0: a handful of bursts, or none in the run
            raise SpecError(f"burstiness: must be >= {MIN_BURSTINESS:g} (1 is Poisson), got {show(self.burstiness)}")
        check_positive("duration", self.duration, optional=True)
        check_positive("probe_rate", self.probe_rate, zero=True)
        if self.num_requests is not None and (not is_int(self.num_requests) or self.num_requests < 1):
            raise SpecError(f"num_requests: must be an integer >= 1, got {show(self.num_requests)}")
        if self.duration is None and self.num_requests is None:
            raise SpecError("duration: give a duration and/or num_requests, got neither")
        if math.isinf(self.request_rate) and (self.num_requests is None or self.duration is not None
                                              or any(c.rate is not None for c in self.classes)):
            raise SpecError("request_rate: inf needs num_requests, no duration and only share classes")
        if self.goodput is not None and not isinstance(self.goodput, Goodput):
            raise SpecError(f"goodput: must be a Goodput, got {show(self.goodput)}")

    @property
    def base_url(self) -> str:
        """`url` without a trailing `/` or `/v1`."""
        return re.sub(r"/v1$", "", self.url.rstrip("/"))

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or self.base_url + "/metrics"

    @property
    def class_rates(self) -> dict[str, float]:
        """Arrival rate of each class (req/s): its own rate, or its share of `request_rate`."""
        return class_rates(self.classes, self.request_rate)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# --- arrivals and prompts -------------------------------------------------------------------------------

def arrival_schedule(config: LoadConfig) -> list[tuple[float, WorkloadClass]]:
    """(arrival time, class) of every request of the run, probes included, sorted by time."""
    events = class_arrivals(config.classes, config.request_rate, burstiness=config.burstiness,
                            duration=config.duration, num_requests=config.num_requests, seed=config.seed)
    if config.probe_rate > 0:
        end = config.duration if config.duration is not None else max((e[0] for e in events), default=0.0)
        rng = np.random.default_rng([config.seed, len(config.classes)])
        probes = gamma_arrivals(config.probe_rate, 1.0, rng, duration=end) if end > 0 else []
        events += [(float(t), len(config.classes), PROBE) for t in probes]
        events.sort(key=lambda e: (e[0], e[1]))
    return [(t, cls) for t, _, cls in events]


class PromptMaker:
    """Prompt text of about N tokens: N random words of `WORDS`, one token each for typical BPEs.

    With a tokenizer (`engine.tokenizer.Tokenizer`), only the words it encodes as exactly one token are
    used, and completion prompts are corrected by encoding until they are exactly N tokens (special
    tokens included, as the server counts them). Chat prompts get N tokens of content; the chat template
    adds its own few.
    """

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.words = WORDS
        if tokenizer is not None:
            self.words = tuple(w for w in WORDS if len(tokenizer.encode(w, add_special_tokens=False)) == 1
                               and len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1)
            if len(self.words) < 16:
                raise ValueError(f"tokenizer: only {len(self.words)} of the prompt words are one token each")

    def make(self, rng: random.Random, n: int, *, chat: bool, prefix: str = "") -> str:
        """A prompt of `n` tokens (about, without a tokenizer or for chat) drawn with `rng`; with a
        `prefix` (a shared document), the prompt is that text followed by `n` tokens of its own."""
        words = [rng.choice(self.words) for _ in range(max(1, n))]
        if prefix:
            n += self.count(prefix, chat) if self.tokenizer is not None else 0
            words = prefix.split(" ") + words
        if self.tokenizer is None:
            return " ".join(words)
        count = self._counter(chat)
        for _ in range(8):
            have = count(" ".join(words))
            if have == n:
                break
            if have < n:
                words += [rng.choice(self.words) for _ in range(n - have)]
            else:
                del words[max(1, len(words) - (have - n)):]
        return " ".join(words)

    def _counter(self, chat: bool) -> Callable[[str], int]:
        return lambda text: self.count(text, chat)

    def count(self, text: str, chat: bool) -> int:
        """Tokens of `text` as the server counts a prompt (special tokens included for a completion)."""
        return len(self.tokenizer.encode(text, add_special_tokens=not chat))

    def document(self, seed: int, cls: WorkloadClass, k: int) -> str:
        """Shared document `k` of a class with a `shared_prefix`: the same text in every request that
        draws it (about `tokens` tokens: one word each)."""
        rng = random.Random(f"{seed}:{cls.name}:document:{k}")
        return " ".join(rng.choice(self.words) for _ in range(cls.shared_prefix.tokens))


@dataclass(frozen=True)
class PlannedRequest:
    """A request decided before the run starts: when it is sent and what it asks for."""

    index: int
    arrival_s: float
    workload: WorkloadClass
    prompt: str
    prompt_len: int
    max_tokens: int
    prefix: int | None = None     # which shared document it starts with (a class with `shared_prefix`)


def load_tokenizer(spec: str) -> Any:
    """`engine.tokenizer.Tokenizer` of a model spec (builtin:..., a model folder, a .gguf file)."""
    from engine.tokenizer import Tokenizer
    from engine.weights import resolve_model

    return Tokenizer.from_folder(resolve_model(spec))


def plan_requests(config: LoadConfig, tokenizer: Any | None = None) -> list[PlannedRequest]:
    """Every request of the run, in arrival order; deterministic for `config.seed`. `tokenizer`: None loads
    `config.tokenizer` when one is set."""
    if tokenizer is None and config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    maker = PromptMaker(tokenizer)
    plan = []
    documents: dict[tuple[str, int], str] = {}
    for index, (t, cls) in enumerate(arrival_schedule(config)):
        rng = random.Random(f"{config.seed}:{index}:{cls.name}")
        prompt_len, max_tokens = cls.prompt_len.sample(rng), cls.output_len.sample(rng)
        prefix, document = None, ""
        if cls.shared_prefix is not None:
            prefix = rng.randrange(cls.shared_prefix.count)
            if (cls.name, prefix) not in documents:
                documents[cls.name, prefix] = maker.document(config.seed, cls, prefix)
            document = documents[cls.name, prefix]
            prompt_len += cls.shared_prefix.tokens
        prompt = maker.make(rng, prompt_len - (cls.shared_prefix.tokens if document else 0),
                            chat=cls.endpoint == "chat", prefix=document)
        plan.append(PlannedRequest(index, t, cls, prompt, prompt_len, max_tokens, prefix))
    return plan


def request_body(planned: PlannedRequest, model: str, continuous_usage: bool = False) -> dict[str, Any]:
    """The JSON body of a planned request: streaming, with usage (in every chunk with `continuous_usage`),
    `ignore_eos` as vLLM's extra field."""
    cls = planned.workload
    options = {"include_usage": True, **({"continuous_usage_stats": True} if continuous_usage else {})}
    body: dict[str, Any] = {"model": model, "max_tokens": planned.max_tokens, "stream": True,
                            "stream_options": options}
    if cls.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": planned.prompt}]
    else:
        body["prompt"] = planned.prompt
    if cls.ignore_eos:
        body["ignore_eos"] = True
    if cls.temperature is not None:
        body["temperature"] = cls.temperature
    return body
