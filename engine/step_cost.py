"""The step-cost model, in one place: what one forward step costs for the work scheduled in it.

A step's work, as every cost model here sees it, is a `StepFeatures`: its prefill tokens, its decode
tokens, the query-key pairs its attention computes (a prefill chunk of q tokens after c cached ones
attends q * c + q * (q + 1) / 2 pairs, a decode token its whole context) and the keys its sequences
read (c + q for that chunk, c + 1 for a decode: each sequence's whole context is read once per step,
whatever the chunk). Three users, one model:
the step composer sizes chunks with it online (`StepCostModel`), the simulator advances its clock
with it (`StepTime`), and the benchmarks fit it to measured steps and compare it with real runs.

- `LinearStepTime`: `t = a + (b * prefill_tokens + c * decode_tokens) * max(0, T - knee) / T
  + d * attended / 1024 + e * keys_read / 1024` (seconds; T = prefill + decode tokens, the token term
  0 when T is), the one linear form. The knee is a GPU's: below it a step is memory-bound, its time
  that of the weights read once per step whatever the batch (as `RooflineStepTime` models it), so more
  tokens cost nothing; past it the step is compute-bound and each token beyond the knee costs its b
  or c. Knee 0, a CPU's, is the plain linear form. The keys term is what a step pays per
  sequence for its context whatever the number of its new tokens (the paged K/V gathered, the
  attention kernel's passes over it): without it a long-context decode or a 13-token chunk after
  3,000 cached tokens looks like a cheap step, and a fit over such steps charges their cost to the
  decode or prefill token (on the CPU of 2026-11-25 a fit without it gave 26 ms per decode token
  beside a rag prompt, and chat's own prompts were cut into 16-token chunks for it). `fit_linear`
  fits it to measured steps: least squares with coefficients >= 0, once per knee of a small grid (0
  and the largest powers of two below the largest step's tokens), the knee with the least squared
  error kept. A knee > 0 must halve knee 0's error (`KNEE_MIN_GAIN`) and needs `KNEE_MIN_STEPS` steps,
  so that a CPU keeps knee 0: over 256-step windows of tests/data/step_trace_cpu_isolation.jsonl,
  knees of 8 to 32 tokens cut the error by up to 40% (its smallest steps bend a little), where a GPU's
  knee cuts it by 80% and more on `RooflineStepTime`'s steps. `write_step_model` /
  `read_step_model` keep it in a small JSON file; `read_step_trace` reads the steps a serving worker
  traced (`CLIFFGUARD_STEP_TRACE`); `engine.calibration` measures a real engine's steps.
- `StepCostModel`: the same form, knee included, refitted online on the last steps an engine
  measured, with a safety margin (the 90th percentile of measured / predicted).
- `engine.roofline.RooflineStepTime`: a GPU preset's roofline (`PRESETS`: H100, H200, A100), for planning without
  the device: per GPU of a tensor-parallel group, a fixed per-step overhead plus the larger of compute
  (2 FLOPs per weight per token, attention 4 FLOPs per query-key pair per head dimension, the LM head
  for sampled tokens, at a fraction of peak) and memory traffic (all weights once per step, the K/V
  every token attends to, a sliding-window layer's window only, DeepSeek V3.2's chosen rows and indexer keys only,
  the K/V written, at a fraction of peak bandwidth; each GPU's KV heads, one replicated where TP exceeds them),
  plus two ring all-reduces
  per layer over the interconnect when TP > 1. A mixture of experts computes each token with its
  `num_experts_per_tok` experts only (less the picks that land on LongCat-Flash's zero experts,
  `engine.roofline.routed_per_token`), and a step reads the experts its tokens hit (under uniform
  routing, a fraction 1 - (1 - k/E)^tokens of them); K/V bytes are the cache's (an FP8 cache's one). The
  efficiencies and the overhead are assumptions written in the preset, not measurements.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledSeq

GiB = 1 << 30
MiB = 1 << 20
MIN_FIT_STEPS = 8         # measured steps `fit_linear` needs for its 5 coefficients
MAX_KNEE_CANDIDATES = 8   # knees a fit tries: 0 and the largest powers of two below its largest step
KNEE_MIN_STEPS = 32       # fewer measured steps are fitted with knee 0 (too few to tell a knee from noise)
KNEE_MIN_GAIN = 0.5       # a knee > 0 is kept only if it cuts the squared error of knee 0 by this share


@dataclass
class StepFeatures:
    """The work of one step, as the cost models see it."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_attended: int = 0          # query-key pairs of the step's attention
    num_keys_read: int = 0         # context positions the step's sequences read (cached + new, each)
    # each sequence's (cached, new) tokens: what a sliding-window layer reads of them (`RooflineStepTime`)
    spans: list[tuple[int, int]] = field(default_factory=list, repr=False, compare=False)

    def add(self, num_cached: int, num_new: int, is_decode: bool) -> None:
        if is_decode:
            self.num_decode_tokens += num_new
        else:
            self.num_prefill_tokens += num_new
        self.num_attended += num_new * num_cached + num_new * (num_new + 1) // 2
        self.num_keys_read += num_cached + num_new
        self.spans.append((num_cached, num_new))

    def add_scheduled(self, items: Sequence[ScheduledSeq]) -> None:
        for item in items:
            seq = item.seq
            is_decode = item.num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            self.add(seq.num_computed_tokens, item.num_new_tokens, is_decode)

    def plus(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(self.num_prefill_tokens + other.num_prefill_tokens,
                            self.num_decode_tokens + other.num_decode_tokens,
                            self.num_attended + other.num_attended, self.num_keys_read + other.num_keys_read,
                            self.spans + other.spans)

    def vector(self) -> np.ndarray:
        """The linear model's regressors, in the order of `LinearStepTime`'s coefficients."""
        return np.array([1.0, self.num_prefill_tokens, self.num_decode_tokens, self.num_attended / 1024,
                         self.num_keys_read / 1024])


class StepTime(Protocol):
    """Seconds one step takes for the work the schedulers chose (the simulator's clock)."""

    swap_bandwidth: float | None   # B/s of one direction's copies (None: swaps unpriced)
    swap_latency: float            # seconds a copy takes besides its bytes (0: not modelled)

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float: ...


# --- the linear model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearStepTime:
    """`t = a + (b * prefill + c * decode) * max(0, T - knee) / T + d * attended / 1024 + e * keys_read
    / 1024` (seconds, per token past the knee, per 1024 query-key pairs, per 1024 keys read; T = prefill
    + decode tokens of the step, the token term 0 when T is). Knee 0 is the plain linear form."""

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0
    swap_bandwidth: float | None = None
    knee: int = 0                  # tokens per step (prefill + decode) whose token terms are free; 0: no knee
    swap_latency: float = 0.0      # seconds a swap copy takes besides its bytes (measured with the bandwidth)

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d", "e", "swap_latency"):   # JSON reads NaN, Infinity and 1e400 as floats
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not isinstance(self.knee, int) or isinstance(self.knee, bool) or self.knee < 0:
            raise ValueError(f"knee: must be an integer >= 0 (tokens per step), got {self.knee!r}")
        bandwidth = self.swap_bandwidth
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                      or not 0 < bandwidth < math.inf):
            raise ValueError(f"swap_bandwidth: must be a finite number > 0 (bytes/s) or null, got {bandwidth!r}")

    def predict(self, features: StepFeatures) -> float:
        coef = np.array([self.a, self.b, self.c, self.d, self.e])
        return float(knee_scaled(features.vector(), self.knee) @ coef)

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float:
        return self.predict(features)

    def coefficients(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d, "e": self.e, "knee": self.knee}

    def describe(self) -> str:
        """The model in milliseconds, for a report line."""
        knee = f" (tokens past a knee of {self.knee} per step)" if self.knee else ""
        return (f"t = {self.a * 1e3:.2f} ms + {self.b * 1e3:.4f} ms/prefill token + {self.c * 1e3:.4f} ms/decode "
                f"token{knee} + {self.d * 1e3:.4f} ms/1024 attended + {self.e * 1e3:.4f} ms/1024 keys read")


def knee_scaled(x: np.ndarray, knee: int) -> np.ndarray:
    """`StepFeatures.vector()`s (x: [5] or [num_steps, 5]) with the two token columns times
    max(0, T - knee) / T, T their sum: the regressors of `LinearStepTime` with that knee. `x` itself
    when knee is 0."""
    if knee == 0:
        return x
    tokens = x[..., 1] + x[..., 2]
    scaled = x.copy()
    scaled[..., 1:3] *= (np.maximum(tokens - knee, 0) / np.maximum(tokens, 1))[..., None]
    return scaled


def knee_candidates(max_tokens: float, num_steps: int) -> list[int]:
    """The knees a fit of `num_steps` steps tries: 0 and, from `KNEE_MIN_STEPS` steps on, the
    `MAX_KNEE_CANDIDATES` - 1 largest powers of two below `max_tokens` (the largest step's tokens:
    a knee at or past it leaves no token term)."""
    if num_steps < KNEE_MIN_STEPS:
        return [0]
    powers = [1 << k for k in range(int(max_tokens).bit_length()) if 1 << k < max_tokens]
    return [0, *powers[-(MAX_KNEE_CANDIDATES - 1):]]


def nonnegative_lstsq(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: drop negative ones, refit the rest).

    Columns are scaled to unit norm first; a column with no data (all zero) gets coefficient 0.
    """
    scale = np.linalg.norm(x, axis=0)
    active = scale > 0
    coef = np.zeros(x.shape[1])
    while active.any():
        cols = np.flatnonzero(active)
        xs = x[:, cols] / scale[cols]
        sol, *_ = np.linalg.lstsq(xs, t, rcond=None)
        sol = sol / scale[cols]
        if (sol >= 0).all():
            coef[cols] = sol
            break
        active[cols[np.argmin(sol)]] = False
    return coef


def _fit(vectors: Sequence[np.ndarray], seconds: Sequence[float],
         swap_bandwidth: float | None = None) -> LinearStepTime:
    """`LinearStepTime` fitted to steps given as their `StepFeatures.vector()`s: the nonnegative least
    squares once per knee of `knee_candidates`, the knee with the least squared error kept: 0 unless
    another cuts its error by `KNEE_MIN_GAIN`, and 0 when it fits to rounding (exact steps of a few
    sizes fit as well with small knees, which would then extrapolate differently)."""
    x, t = np.stack(vectors), np.asarray(seconds, dtype=float)
    rounding = 1e-20 * float(t @ t)      # a squared error below this: knee 0 fits exactly, no knee can beat it
    best_knee, best_coef, best_error, error_0 = 0, np.zeros(x.shape[1]), np.inf, np.inf
    for knee in knee_candidates(float((x[:, 1] + x[:, 2]).max()), len(t)):
        scaled = knee_scaled(x, knee)
        coef = nonnegative_lstsq(scaled, t)
        error = float(np.sum((scaled @ coef - t) ** 2))
        if knee == 0:
            error_0 = error
        if error < best_error and (knee == 0 or error < (1 - KNEE_MIN_GAIN) * error_0):
            best_knee, best_coef, best_error = knee, coef, error
        if error_0 <= rounding:
            break
    a, b, c, d, e = (float(v) for v in best_coef)
    return LinearStepTime(a, b, c, d, e, swap_bandwidth=swap_bandwidth, knee=best_knee)


def fit_linear(samples: Sequence[tuple[StepFeatures, float]], *, swap_bandwidth: float | None = None,
               skip: int = 0) -> LinearStepTime:
    """`LinearStepTime` fitted to measured steps, leaving out the first `skip` (warm-up)."""
    used = list(samples)[skip:]
    if len(used) < MIN_FIT_STEPS:
        raise ValueError(f"calibration: {len(used)} measured steps are too few to fit 5 coefficients")
    model = _fit([f.vector() for f, _ in used], [s for _, s in used], swap_bandwidth)
    if not any((model.a, model.b, model.c, model.d, model.e)):
        raise ValueError(f"calibration: the fit of {len(used)} steps predicts 0 s for every step; they are not "
                         "a device's measured steps")
    return model


class StepCostModel:
    """Predicts a step's seconds from its `StepFeatures`: `LinearStepTime` (knee included) refitted
    online on the last `window` measured steps, times a safety margin (the 90th percentile of measured
    / predicted over the last `margin_window` steps, in [1, 3])."""

    def __init__(self, window: int = 256, margin_window: int = 64, refit_every: int = 8,
                 min_observations: int = 4) -> None:
        self._xs: deque[np.ndarray] = deque(maxlen=window)
        self._ts: deque[float] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=margin_window)
        self.refit_every = refit_every
        self.min_observations = min_observations
        self.linear: LinearStepTime | None = None
        self.margin = 1.0
        self.max_prefill_seen = 0
        self.num_observed = 0

    @property
    def ready(self) -> bool:
        return self.linear is not None and self.num_observed >= self.min_observations

    def predict(self, features: StepFeatures, *, with_margin: bool = True) -> float | None:
        """Seconds the step should take; None until the model has been fitted."""
        if self.linear is None:
            return None
        raw = self.linear.predict(features)
        return raw * self.margin if with_margin else raw

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Add a measured step; refit after each of the first `refit_every` * 2 steps, then every
        `refit_every` steps (a fit costs a small least-squares solve: not worth paying every step)."""
        if seconds <= 0:
            return
        predicted = self.predict(features, with_margin=False)
        if predicted is not None and predicted > 0:
            self._ratios.append(seconds / predicted)
        self._xs.append(features.vector())
        self._ts.append(seconds)
        self.num_observed += 1
        self.max_prefill_seen = max(self.max_prefill_seen, features.num_prefill_tokens)
        if self.num_observed <= 2 * self.refit_every or self.num_observed % self.refit_every == 0:
            self.linear = _fit(list(self._xs), list(self._ts))
            if self._ratios:
                self.margin = misprediction_margin(self._ratios)


MAX_MARGIN = 3.0   # a misprediction margin past this is a model to refit, not a step to pad for


def misprediction_margin(ratios) -> float:
    """How much a cost model under-predicts: the 90th percentile of measured / predicted step times,
    at least 1 (a model that over-predicts is not shrunk below its fit), at most MAX_MARGIN."""
    return float(min(MAX_MARGIN, max(1.0, np.percentile(list(ratios), 90)))) if ratios else 1.0


# --- measured steps: a real engine, a served run's trace, a calibration file ------------------------

def read_step_trace(path: str | Path, *, skip: int = 2) -> list[tuple[StepFeatures, float]]:
    """The steps of a served run, from the device worker's `CLIFFGUARD_STEP_TRACE` file (engine/worker.py):
    each step's features and its `cycle_seconds` (the worker loop's whole turn: commands, the step, its
    outputs sent), which is what a step costs while the gateway, the clients and the worker share the
    machine. Lines without `cycle_seconds` (older traces) use `seconds`, lines without `num_keys_read`
    read it as 0. The first `skip` steps of the
    file (kernels warming) are left out. ValueError naming the file and line for anything malformed."""
    lines = _read_text(path, "--from-trace").splitlines()
    samples: list[tuple[StepFeatures, float]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
            values = [step["num_prefill_tokens"], step["num_decode_tokens"], step.get("num_attended", 0),
                      step.get("num_keys_read", 0),
                      step["cycle_seconds"] if "cycle_seconds" in step else step["seconds"]]
            if any(isinstance(v, bool) for v in values):
                raise TypeError("a count or a time is a boolean")
            features = StepFeatures(*(int(v) for v in values[:4]))
            seconds = float(values[4])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"--from-trace: {path} line {n} is not a step record ({type(exc).__name__}: {exc})"
                             ) from None
        if not math.isfinite(seconds):
            raise ValueError(f"--from-trace: {path} line {n}: cycle_seconds must be finite, got {seconds!r}")
        if seconds > 0 and features.num_prefill_tokens + features.num_decode_tokens:
            samples.append((features, seconds))
    return samples[skip:]


def write_step_model(path: str | Path, model: LinearStepTime, *, device: str, model_name: str,
                     num_steps: int) -> None:
    """A calibration file: the coefficients, the swap copies' bandwidth and latency where they were measured (a
    pool with swap space; else null and 0), and where they were measured."""
    import datetime
    import platform

    import torch

    text = json.dumps({
        "step_model": "linear", **model.coefficients(), "swap_bandwidth": model.swap_bandwidth,
        "swap_latency": model.swap_latency,
        "device": device, "model": model_name, "num_steps": num_steps, "machine": platform.node(),
        "cpu_threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}, indent=2) + "\n"
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")   # whole or not at all: a model it replaces stays
    try:                                                      # readable if the write fails (a full disk)
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_text(path: str | Path, option: str) -> str:
    """The UTF-8 text of the file `option` names; ValueError naming the option otherwise."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{option}: no such file {path}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{option}: {path} is not UTF-8 text") from None
    except OSError as exc:   # a folder, no permission
        raise ValueError(f"{option}: cannot read {path} ({exc.strerror or exc})") from None


def read_step_model(path: str | Path) -> LinearStepTime:
    """A calibration file written by `write_step_model`; ValueError naming the file otherwise. A file
    without `e` (written before the keys-read term) reads as e = 0, one without `knee` as knee 0, one
    without `swap_bandwidth` as not measured (None), one without `swap_latency` as 0."""
    text = _read_text(path, "--step-model")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--step-model: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("step_model") != "linear":
        raise ValueError(f"--step-model: {path} is not a calibration file (no \"step_model\": \"linear\")")
    try:
        return LinearStepTime(*(data[k] for k in ("a", "b", "c", "d")), e=data.get("e", 0.0),
                              knee=data.get("knee", 0), swap_bandwidth=data.get("swap_bandwidth"),
                              swap_latency=data.get("swap_latency", 0.0))
    except KeyError as exc:
        raise ValueError(f"--step-model: {path} lacks {exc.args[0]!r}") from None
    except ValueError as exc:
        raise ValueError(f"--step-model: {path}: {exc}") from None
