"""Workloads: classes of requests (how often they arrive, their prompt and output lengths in tokens)
and their arrival times. One model of load for the two things that use it: `cliffguard bench serve`
sends it to a real server over HTTP, `cliffguard simulate` feeds it to the real schedulers with a
modelled step time.

Classes come from a YAML file (`bench/workloads/*.yaml`, schema in `parse_workload`) or the default.
The file is read, like the pool file, by frozen msgspec models (`pools.config.checks.Spec`), one per
section, and those models are the classes handed out: `WorkloadFile` (the top level: a non-empty
`classes` list, names unique, an optional text `description`), `WorkloadClass` (a class: a label `name`,
`share` or `rate` > 0 but not both, `endpoint` chat|completion, `ignore_eos` a boolean, `temperature`
>= 0), `LengthDist` (a length distribution: `dist` fixed|uniform|normal, token counts integers >= 1,
`mean` > 0, `std` >= 0, exactly the keys its `dist` takes, `min` <= `max`) and `SharedPrefix`
(`shared_prefix`: `tokens` and `count` integers >= 1). Types and bounds are in the fields, rules across
fields in `check()`; unknown keys, infinities and NaNs are refused; every error is a `SpecError` naming
the key path (`classes[1].prompt_len.mean: ...`), for a class built in Python too (`Spec` checks a new
one as its YAML would be; `WorkloadClass.replace` makes a changed copy).

Arrivals per class are a gamma renewal process (`gamma_arrivals`): burstiness 1 is Poisson, below 1
burstier, above 1 more regular. One run generates at most `MAX_ARRIVALS` of them (`check_arrivals`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pools.config.checks import (Count, NonNegative, Positive, Spec, SpecError, Text, from_yaml, is_label, load_yaml,
                                 read_text, show)

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
DISTS = ("fixed", "uniform", "normal")
_DIST_KEYS = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std", "min", "max")}
_DIST_NEEDS = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std")}
_LENGTH_KEYS = ("value", "min", "max", "mean", "std")
MIN_P99_SAMPLES = 100        # a p99 over fewer samples is a lower bound on the tail, and is reported as one
MAX_ARRIVALS = 10_000_000    # requests one run may generate (rate x duration): their times and requests fit memory
MIN_BURSTINESS = 0.01        # a gamma shape below it draws nearly every gap 0: a few bursts, or a draw that never ends
WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "bench" / "workloads"


def check_positive(key: str, value: Any, *, optional: bool = False, zero: bool = False,
                   allow_inf: bool = False) -> None:
    """A number > 0 (>= 0 with `zero`), finite unless `allow_inf` (None passes when `optional`); else a
    SpecError naming `key`. `bench.load.plan` checks its settings with it."""
    if (value is None and optional) or (allow_inf and value == math.inf):
        return
    from_yaml(value, NonNegative if zero else Positive, key)


# --- the models: the YAML's schema, section by section, and the classes handed out -----------------

class LengthDist(Spec):
    """A distribution of token counts, sampled as ints >= 1; `prompt_len` / `output_len` in YAML.

    fixed: `value`; uniform: `min..max` inclusive; normal: round(N(mean, std)) clipped to `min..max`
    (min 1 and no max unless given). In YAML: `{dist: fixed, value: 64}` or just `64`.
    """

    dist: Literal[DISTS] = "fixed"
    value: Count | None = None
    min: Count | None = None
    max: Count | None = None
    mean: Positive | None = None
    std: NonNegative | None = None

    def check(self) -> None:
        takes = _DIST_KEYS[self.dist]
        for name in _LENGTH_KEYS:
            given = getattr(self, name)
            if given is not None and name not in takes:
                raise SpecError(name, f"not used by dist {self.dist} (got {given!r}); "
                                      f"{self.dist} takes: {', '.join(takes)}")
        for name in _DIST_NEEDS[self.dist]:
            if getattr(self, name) is None:
                raise SpecError(name, f"required by dist {self.dist}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise SpecError("max", f"must be >= min {self.min}, got {self.max}")

    def sample(self, rng: random.Random) -> int:
        """One length drawn with `rng`."""
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        n = max(self.min or 1, round(rng.gauss(self.mean, self.std)))
        return n if self.max is None else min(n, self.max)


class SharedPrefix(Spec):
    """Prompts that begin with one of `count` documents of `tokens` tokens each (drawn per request), as
    questions on the same few documents do: what a prefix cache, and prefix affinity, are for.
    `shared_prefix: {tokens, count}` in YAML."""

    tokens: Count
    count: Count = 1


class WorkloadClass(Spec):
    """One kind of request in the load (an entry of `classes:`): how often it arrives, its endpoint and its
    lengths in tokens.

    Share classes split `LoadConfig.request_rate` in proportion to `share` (1 when neither `share` nor
    `rate` is given); a class with its own `rate` (req/s) arrives at that rate on top of it.
    """

    name: Text
    prompt_len: LengthDist
    output_len: LengthDist
    endpoint: Literal[tuple(ENDPOINTS)] = "chat"
    share: Positive | None = None
    rate: Positive | None = None
    ignore_eos: bool = True
    temperature: NonNegative | None = None
    shared_prefix: SharedPrefix | None = None   # prompts = one of its documents + prompt_len tokens of their own

    def check(self) -> None:
        if not is_label(self.name):
            raise SpecError("name", f"must be letters, digits, '_', '.' or '-' (a label), got {self.name!r}")
        if self.share is not None and self.rate is not None:
            raise SpecError("rate", f"give share or rate, not both (share {self.share!r}, rate {self.rate!r})")

    @property
    def weight(self) -> float:
        """This class' weight among the share classes (0 for a class with its own rate)."""
        return 0.0 if self.rate is not None else (1.0 if self.share is None else float(self.share))


class WorkloadFile(Spec):
    """The file's top level: the classes (their names unique) and a `description` for people."""

    classes: Annotated[list[WorkloadClass], msgspec.Meta(min_length=1)]
    description: str | None = None

    def check(self) -> None:
        names = [c.name for c in self.classes]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise SpecError(f"classes[{i}].name", f"{name!r} is used by an earlier class")


DEFAULT_WORKLOAD = (WorkloadClass("default", prompt_len=LengthDist("normal", mean=128, std=32, min=16, max=512),
                                  output_len=LengthDist("fixed", value=64)),)


def _written_out(data: Any) -> Any:
    """`data` with each class's shorthand length (`prompt_len: 64`) written out as `{dist: fixed,
    value: 64}`, so that `LengthDist` reads both; anything else is left as it is, for the models to judge."""
    classes = data.get("classes") if isinstance(data, dict) else None
    if not isinstance(classes, list):
        return data
    written = []
    for i, raw in enumerate(classes):
        if isinstance(raw, dict):
            raw = dict(raw)
            for key in ("prompt_len", "output_len"):
                value = raw.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    raw[key] = {"dist": "fixed", "value": value}
                elif value is not None and not isinstance(value, dict):
                    raise SpecError(f"classes[{i}].{key}", "must be a token count (an integer >= 1) or a "
                                    f"distribution ({{dist: ...}}), got {show(value)}")
        written.append(raw)
    return {**data, "classes": written}


def parse_workload(data: Any) -> tuple[WorkloadClass, ...]:
    """The dict of a workload YAML file -> its classes, or SpecError naming the key path and the bad value.

    Schema (`WorkloadFile`): `classes:` a list of {name, share | rate, endpoint: chat|completion (chat),
    prompt_len, output_len, ignore_eos (true), temperature (the server's default), shared_prefix
    ({tokens, count}: each prompt starts with one of `count` shared documents)}; lengths as `LengthDist`.
    An optional top-level `description:` (text) is ignored.
    """
    if data is None:
        raise SpecError("classes", "the workload file is empty; give a `classes:` list")
    spec = from_yaml(_written_out(data), WorkloadFile, "")
    return tuple(spec.classes)


def load_workload(path_or_name: str | Path) -> tuple[WorkloadClass, ...]:
    """Classes from a YAML file, or from `bench/workloads/<name>.yaml` for a bare name (`chat`, `mixed`).
    Errors are SpecError naming the key path, ending with `(in <path>)`."""
    path = Path(path_or_name)
    if not path.exists() and path.suffix == "" and len(path.parts) == 1:
        path = WORKLOAD_DIR / f"{path_or_name}.yaml"
    try:
        text = read_text(path, "workload file")
    except SpecError as exc:
        known = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml")))
        raise SpecError(f"{exc}; built-in names: {known}") from None
    try:
        return parse_workload(load_yaml(text, str(path)))
    except SpecError as exc:
        raise SpecError(f"{exc} (in {path})") from None


def gamma_arrivals(rate: float, burstiness: float, rng: np.random.Generator, *, duration: float | None = None,
                   count: int | None = None) -> np.ndarray:
    """Arrival times (s from 0) of a gamma renewal process: gaps ~ Gamma(shape=burstiness,
    scale=1/(rate x burstiness)), so mean gap 1/rate and squared coefficient of variation 1/burstiness
    (1: Poisson). The first `count` arrivals, those before `duration`, or both limits."""
    if count is None and duration is None:
        raise ValueError("gamma_arrivals: give duration and/or count")
    expected = min(math.inf if count is None else count, math.inf if duration is None else rate * duration)
    if expected > MAX_ARRIVALS:
        raise ValueError(f"gamma_arrivals: {expected:.3g} arrivals (rate {rate:g}/s, duration {duration}, count "
                         f"{count}) is above the {MAX_ARRIVALS:,} one run may generate")
    if not burstiness >= MIN_BURSTINESS:
        raise ValueError(f"burstiness: {burstiness:g} is below {MIN_BURSTINESS:g} (nearly every gap would be 0)")
    scale = 1.0 / (rate * burstiness)
    if count is not None:
        times = np.cumsum(rng.gamma(burstiness, scale, size=count))
    else:
        parts, last, chunk = [], 0.0, int(rate * duration * 1.2) + 16
        while last < duration:
            part = last + np.cumsum(rng.gamma(burstiness, scale, size=chunk))
            parts.append(part)
            last = float(part[-1])
            if len(parts) * chunk > 2 * MAX_ARRIVALS:   # a bursty draw far past its expected count: bounded all the same
                raise ValueError(f"gamma_arrivals: burstiness {burstiness:g} drew over {2 * MAX_ARRIVALS:,} arrivals "
                                 f"in {duration:g} s (rate {rate:g}/s); use a larger burstiness or a shorter run")
        times = np.concatenate(parts)
    return times if duration is None else times[times < duration]


def check_arrivals(classes: tuple[WorkloadClass, ...], request_rate: float, duration: float,
                   option: str = "--request-rate") -> None:
    """ValueError naming `option` and --duration when `classes` at `request_rate` (`class_rates`) for
    `duration` seconds would generate more than `MAX_ARRIVALS` requests, before any is drawn."""
    total = sum(class_rates(classes, request_rate).values())
    if total * duration > MAX_ARRIVALS:
        lower = (f"{option}, --duration or the workload's class rates" if any(c.rate is not None for c in classes)
                 else f"{option} or --duration")
        raise ValueError(f"{option} {request_rate:g} x --duration {duration:g}: {total:g} requests/s for "
                         f"{duration:g} s is {total * duration:.3g} requests, above the {MAX_ARRIVALS:,} one run "
                         f"may generate; lower {lower}")


def class_rates(classes: tuple[WorkloadClass, ...], request_rate: float) -> dict[str, float]:
    """Arrival rate of each class (req/s): its own rate, or its share of `request_rate`."""
    total = sum(c.weight for c in classes)
    return {c.name: c.rate if c.rate is not None else (request_rate * c.weight / total if total else 0.0)
            for c in classes}


def class_arrivals(classes: tuple[WorkloadClass, ...], request_rate: float, *, burstiness: float = 1.0,
                   duration: float | None = None, num_requests: int | None = None,
                   seed: int = 0) -> list[tuple[float, int, WorkloadClass]]:
    """(arrival time, class index, class) of every request, sorted by time: each class its own gamma
    process seeded by (seed, class index), cut at `duration` and/or the first `num_requests` overall.
    `request_rate` math.inf: all `num_requests` at t=0, classes drawn by share."""
    events: list[tuple[float, int, WorkloadClass]] = []
    if math.isinf(request_rate):
        rng = np.random.default_rng([seed, 0])
        weights = np.array([c.weight for c in classes])
        picks = rng.choice(len(classes), size=num_requests, p=weights / weights.sum())
        return [(0.0, int(i), classes[int(i)]) for i in picks]
    rates = class_rates(classes, request_rate)
    for i, cls in enumerate(classes):
        if rates[cls.name] <= 0:
            continue
        rng = np.random.default_rng([seed, i])
        times = gamma_arrivals(rates[cls.name], burstiness, rng, duration=duration, count=num_requests)
        events += [(float(t), i, cls) for t in times]
    events.sort(key=lambda e: (e[0], e[1]))
    return events[:num_requests]


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of `values` (percentiles interpolated linearly, as numpy's and vLLM's),
    all None when there are none, and `n`, how many (a p99 of fewer than `MIN_P99_SAMPLES` is a lower bound)."""
    if len(values) == 0:
        return {**dict.fromkeys(("mean", "p50", "p90", "p99", "max")), "n": 0}
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(arr.max()), "n": len(arr)}


def p99_lower_bound(stats: dict[str, float | None]) -> bool:
    """Whether a `latency_stats` p99 rests on fewer than `MIN_P99_SAMPLES` values: a lower bound on the tail,
    to be marked as one (none at all: no p99 to mark)."""
    return stats["p99"] is not None and stats["n"] < MIN_P99_SAMPLES


def parse_rates(text: str, option: str = "--rate") -> list[float]:
    """A command line's request rates: one number or a comma-separated list, each > 0; ValueError naming
    `option` otherwise."""
    rates = []
    for part in str(text).split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"{option}: not a number: {part.strip()!r}") from None
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"{option}: must be > 0, got {part.strip()}")
        rates.append(rate)
    return rates
