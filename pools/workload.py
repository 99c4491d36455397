"""Workloads: classes of requests (how often they arrive, their prompt and output lengths in tokens)
and their arrival times. One model of load for the two things that use it: `cliffguard bench serve`
sends it to a real server over HTTP, `cliffguard simulate` feeds it to the real schedulers with a
modelled step time.

Classes come from a YAML file (`bench/workloads/*.yaml`, schema in `parse_workload`) or the default.
Arrivals per class are a gamma renewal process (`gamma_arrivals`): burstiness 1 is Poisson, below 1
burstier, above 1 more regular.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pools.config.checks import SpecError, check_mapping, is_int, is_number, load_yaml, read_text, show, within

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
DISTS = ("fixed", "uniform", "normal")
_DIST_KEYS = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std", "min", "max")}
_CLASS_KEYS = ("name", "share", "rate", "endpoint", "prompt_len", "output_len", "ignore_eos", "temperature",
               "shared_prefix")
_PREFIX_KEYS = ("tokens", "count")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "bench" / "workloads"


def _required(key: str, value: Any) -> Any:
    if value is None:
        raise SpecError(f"{key}: required, got nothing")
    return value


def check_positive(key: str, value: Any, *, optional: bool = False, zero: bool = False,
                    allow_inf: bool = False) -> None:
    """A number > 0 (>= 0 with `zero`), finite unless `allow_inf`."""
    if value is None and optional:
        return
    bound = ">= 0" if zero else "> 0"
    if not is_number(value) or math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise SpecError(f"{key}: must be a number {bound}, got {show(value)}")
    if value < 0 or (value == 0 and not zero):
        raise SpecError(f"{key}: must be {bound}, got {value!r}")


def _check_len(key: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or value < 1:
        raise SpecError(f"{key}: must be an integer >= 1 (tokens), got {show(value)}")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, sampled as ints >= 1.

    fixed: `value`; uniform: `min..max` inclusive; normal: round(N(mean, std)) clipped to `min..max`
    (min 1 and no max unless given). In YAML: `{dist: fixed, value: 64}` or just `64`.
    """

    dist: str = "fixed"
    value: int | None = None
    min: int | None = None
    max: int | None = None
    mean: float | None = None
    std: float | None = None

    def __post_init__(self) -> None:
        if self.dist not in DISTS:
            raise SpecError(f"dist: must be one of {', '.join(DISTS)}; got {self.dist!r}")
        allowed = _DIST_KEYS[self.dist]
        for name in ("value", "min", "max", "mean", "std"):
            if getattr(self, name) is not None and name not in allowed:
                raise SpecError(f"{name}: not used by dist {self.dist} (got {getattr(self, name)!r}); "
                                f"{self.dist} takes: {', '.join(allowed)}")
        if self.dist == "fixed":
            _check_len("value", _required("value", self.value))
        elif self.dist == "uniform":
            _check_len("min", _required("min", self.min))
            _check_len("max", _required("max", self.max))
        else:
            check_positive("mean", _required("mean", self.mean))
            check_positive("std", _required("std", self.std), zero=True)
            _check_len("min", self.min, optional=True)
            _check_len("max", self.max, optional=True)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise SpecError(f"max: must be >= min {self.min}, got {self.max}")

    def sample(self, rng: random.Random) -> int:
        """One length drawn with `rng`."""
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        n = max(self.min or 1, round(rng.gauss(self.mean, self.std)))
        return n if self.max is None else min(n, self.max)


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts that begin with one of `count` documents of `tokens` tokens each (drawn per request), as
    questions on the same few documents do: what a prefix cache, and prefix affinity, are for."""

    tokens: int
    count: int = 1

    def __post_init__(self) -> None:
        _check_len("tokens", self.tokens)
        _check_len("count", self.count)


@dataclass(frozen=True)
class WorkloadClass:
    """One kind of request in the load: how often it arrives, its endpoint and its lengths in tokens.

    Share classes split `LoadConfig.request_rate` in proportion to `share` (1 when neither `share` nor
    `rate` is given); a class with its own `rate` (req/s) arrives at that rate on top of it.
    """

    name: str
    prompt_len: LengthDist
    output_len: LengthDist
    endpoint: str = "chat"
    share: float | None = None
    rate: float | None = None
    ignore_eos: bool = True
    temperature: float | None = None
    shared_prefix: SharedPrefix | None = None   # prompts = one of its documents + prompt_len tokens of their own

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecError(f"name: must be letters, digits, '_', '.' or '-' (a label), got {show(self.name)}")
        for key in ("prompt_len", "output_len"):
            if not isinstance(getattr(self, key), LengthDist):
                raise SpecError(f"{key}: must be a LengthDist, got {show(getattr(self, key))}")
        if self.endpoint not in ENDPOINTS:
            raise SpecError(f"endpoint: must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}")
        check_positive("share", self.share, optional=True)
        check_positive("rate", self.rate, optional=True)
        if self.share is not None and self.rate is not None:
            raise SpecError(f"rate: give share or rate, not both (share {self.share!r}, rate {self.rate!r})")
        if not isinstance(self.ignore_eos, bool):
            raise SpecError(f"ignore_eos: must be true or false, got {show(self.ignore_eos)}")
        check_positive("temperature", self.temperature, optional=True, zero=True)
        if self.shared_prefix is not None and not isinstance(self.shared_prefix, SharedPrefix):
            raise SpecError(f"shared_prefix: must be a SharedPrefix, got {show(self.shared_prefix)}")

    @property
    def weight(self) -> float:
        """This class' weight among the share classes (0 for a class with its own rate)."""
        return 0.0 if self.rate is not None else (1.0 if self.share is None else float(self.share))


DEFAULT_WORKLOAD = (WorkloadClass("default", prompt_len=LengthDist("normal", mean=128, std=32, min=16, max=512),
                                  output_len=LengthDist("fixed", value=64)),)
def _parse_length(key: str, raw: Any) -> LengthDist:
    if is_int(raw):
        raw = {"dist": "fixed", "value": raw}
    if not isinstance(_required(key, raw), dict):
        raise SpecError(f"{key}: must be a token count or a mapping like {{dist: uniform, min: 8, max: 64}}, "
                        f"got {show(raw)}")
    raw = check_mapping(key, raw, ("dist", *sorted({k for ks in _DIST_KEYS.values() for k in ks})))
    with within(key):
        return LengthDist(**{"dist": _required("dist", raw.get("dist")), **raw})


def parse_workload(data: Any) -> tuple[WorkloadClass, ...]:
    """The dict of a workload YAML file -> its classes, or SpecError naming the key path and the bad value.

    Schema: `classes:` a list of {name, share | rate, endpoint: chat|completion (chat), prompt_len,
    output_len, ignore_eos (true), temperature (the server's default), shared_prefix ({tokens, count}:
    each prompt starts with one of `count` shared documents)}; lengths as `LengthDist`.
    An optional top-level `description:` is ignored.
    """
    if not isinstance(data, dict):
        raise SpecError(f"(top level): must be a mapping with a `classes:` list, got {show(data)}")
    data = check_mapping("", data, ("classes", "description"))
    raw_classes = _required("classes", data.get("classes"))
    if not isinstance(raw_classes, list) or not raw_classes:
        raise SpecError(f"classes: must be a non-empty list of classes, got {show(raw_classes)}")
    classes = []
    for i, raw in enumerate(raw_classes):
        key = f"classes[{i}]"
        raw = check_mapping(key, raw, _CLASS_KEYS)
        _required(f"{key}.name", raw.get("name"))
        kwargs = dict(raw, prompt_len=_parse_length(f"{key}.prompt_len", raw.get("prompt_len")),
                      output_len=_parse_length(f"{key}.output_len", raw.get("output_len")))
        if raw.get("shared_prefix") is not None:
            prefix = check_mapping(f"{key}.shared_prefix", raw["shared_prefix"], _PREFIX_KEYS)
            with within(f"{key}.shared_prefix"):
                kwargs["shared_prefix"] = SharedPrefix(**prefix)
        with within(key):
            classes.append(WorkloadClass(**kwargs))
        if [c.name for c in classes].count(classes[-1].name) > 1:
            raise SpecError(f"{key}.name: {classes[-1].name!r} is used by an earlier class")
    return tuple(classes)


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
    scale = 1.0 / (rate * burstiness)
    if count is not None:
        times = np.cumsum(rng.gamma(burstiness, scale, size=count))
    else:
        parts, last, chunk = [], 0.0, int(rate * duration * 1.2) + 16
        while last < duration:
            part = last + np.cumsum(rng.gamma(burstiness, scale, size=chunk))
            parts.append(part)
            last = float(part[-1])
        times = np.concatenate(parts)
    return times if duration is None else times[times < duration]


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
    """mean, p50, p90, p99 and max of `values` (percentiles interpolated linearly, as numpy's and vLLM's);
    all None when there are none."""
    if len(values) == 0:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(arr.max())}


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
