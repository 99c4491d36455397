"""The step composer: one forward pass, several latency classes.

Every pool of a device proposes work for the same merged step, so a long prefill chunk of one pool
lengthens the step, and with it the inter-token latency, of every other pool. The composer decides
across pools, not each pool alone:

1. interactive pools (a `LatencySLO`) schedule first, each within its own `max_num_batched_tokens`;
2. the step gets a time target: the tightest `itl_ms` of the interactive pools that have work, or,
   when none has, the tightest of `itl_ms` and half `ttft_ms` (an interactive request that arrives
   mid-step waits at most that long before its prefill runs); with no interactive pool on the device
   there is no target (each pool fills its own token budget, the behaviour of plain chunked prefill);
3. throughput pools then get the token budget that the step-cost model predicts still fits the
   target: their prefill chunks grow when interactive work is light or absent (work-conserving) and
   shrink when it is heavy. Whatever the interactive work, they may add `MIN_THROUGHPUT_SHARE` of
   the target to a step (so an overloaded interactive pool slows them but never stops them, at the
   price of steps up to that much over the target), and a throughput-only step may always spend as
   much on work as the step's fixed cost (so a target below the fixed cost of a step halves their
   throughput rather than starving them). If even one token does not fit, a throughput pool left
   with nothing for `STARVATION_STEPS` steps in a row gets one block's worth of tokens.

`StepCostModel` is fitted online on the engine's measured steps:
`t = a + b * prefill_tokens + c * decode_tokens + d * attended / 1024`, where `attended` counts the
query-key pairs of the step's attention (a prefill chunk of q tokens after c cached ones attends
q * c + q * (q + 1) / 2 pairs, a decode token its whole context). The fit is least squares over the
last `window` steps with coefficients kept >= 0, and predictions are scaled by a safety margin, the
90th percentile of measured / predicted over recent steps; it refits every `REFIT_EVERY` steps, and
only on a device with an interactive pool (otherwise nothing asks it). Until it has `MIN_OBSERVATIONS` steps,
and whenever it would extrapolate, a throughput chunk is capped at twice the largest prefill it has
measured (at least `COLD_START_TOKENS`), so it learns before it trusts itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.config import LatencySLO
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

COLD_START_TOKENS = 64
MIN_OBSERVATIONS = 4
STARVATION_STEPS = 8
MIN_THROUGHPUT_SHARE = 0.1
REFIT_EVERY = 8


@dataclass
class StepFeatures:
    """The work of one step, as the cost model sees it."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_attended: int = 0          # query-key pairs of the step's attention

    def add(self, num_cached: int, num_new: int, is_decode: bool) -> None:
        if is_decode:
            self.num_decode_tokens += num_new
        else:
            self.num_prefill_tokens += num_new
        self.num_attended += num_new * num_cached + num_new * (num_new + 1) // 2

    def add_scheduled(self, items: list[ScheduledSeq]) -> None:
        for item in items:
            seq = item.seq
            is_decode = item.num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            self.add(seq.num_computed_tokens, item.num_new_tokens, is_decode)

    def plus(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(self.num_prefill_tokens + other.num_prefill_tokens,
                            self.num_decode_tokens + other.num_decode_tokens,
                            self.num_attended + other.num_attended)

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.num_prefill_tokens, self.num_decode_tokens, self.num_attended / 1024])


class StepCostModel:
    """Predicts a step's seconds from its `StepFeatures`; fitted online on measured steps."""

    def __init__(self, window: int = 256, margin_window: int = 64) -> None:
        self._xs: deque[np.ndarray] = deque(maxlen=window)
        self._ts: deque[float] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=margin_window)
        self.coef: np.ndarray | None = None     # [a, b, c, d], seconds
        self.margin = 1.0
        self.max_prefill_seen = 0
        self.num_observed = 0

    @property
    def ready(self) -> bool:
        return self.coef is not None and self.num_observed >= MIN_OBSERVATIONS

    def predict(self, features: StepFeatures, *, with_margin: bool = True) -> float | None:
        """Seconds the step should take; None until the model has been fitted."""
        if self.coef is None:
            return None
        raw = float(features.vector() @ self.coef)
        return raw * self.margin if with_margin else raw

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Add a measured step; refit after each of the first `REFIT_EVERY` * 2 steps, then every
        `REFIT_EVERY` steps (a fit costs a small least-squares solve: not worth paying every step)."""
        if seconds <= 0:
            return
        predicted = self.predict(features, with_margin=False)
        if predicted is not None and predicted > 0:
            self._ratios.append(seconds / predicted)
        self._xs.append(features.vector())
        self._ts.append(seconds)
        self.num_observed += 1
        self.max_prefill_seen = max(self.max_prefill_seen, features.num_prefill_tokens)
        if self.num_observed <= 2 * REFIT_EVERY or self.num_observed % REFIT_EVERY == 0:
            self.coef = nonnegative_lstsq(np.stack(self._xs), np.array(self._ts))
            if self._ratios:
                self.margin = float(min(3.0, max(1.0, np.percentile(self._ratios, 90))))


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


@dataclass
class ComposedStep:
    """What every pool scheduled for one step, and the composer's view of its cost."""

    outputs: dict[str, SchedulerOutput] = field(default_factory=dict)
    features: StepFeatures = field(default_factory=StepFeatures)
    target_seconds: float | None = None       # None: no interactive pool on the device
    predicted_seconds: float | None = None


@dataclass
class ComposerStats:
    num_steps: int = 0
    num_targeted_steps: int = 0
    num_over_target: int = 0                  # targeted steps that took longer than the target
    last_target_seconds: float | None = None
    last_step_seconds: float = 0.0


class StepComposer:
    """Builds each step from the pools' schedulers (see the module docstring). Single-threaded, like
    the schedulers it drives: called only from the engine's `step()`."""

    def __init__(self, schedulers: Mapping[str, Scheduler], slos: Mapping[str, LatencySLO | None],
                 cost_model: StepCostModel | None = None) -> None:
        self.schedulers = dict(schedulers)
        self.slos = {name: slos.get(name) for name in self.schedulers}
        self.interactive = [n for n in self.schedulers if self.slos[n] is not None]
        self.throughput = [n for n in self.schedulers if self.slos[n] is None]
        self.cost_model = cost_model or StepCostModel()
        self.stats = ComposerStats()
        self._starved = dict.fromkeys(self.throughput, 0)

    def schedule(self) -> ComposedStep:
        step = ComposedStep()
        for name in self.interactive:
            out = self.schedulers[name].schedule()
            step.outputs[name] = out
            step.features.add_scheduled(out.scheduled)
        step.target_seconds = self._target_seconds()
        for name in self.throughput:
            budget = self._token_budget(name, step.features, step.target_seconds)
            out = self.schedulers[name].schedule(budget)
            step.outputs[name] = out
            step.features.add_scheduled(out.scheduled)
        if self.needs_cost_model:
            step.predicted_seconds = self.cost_model.predict(step.features)
        return step

    @property
    def needs_cost_model(self) -> bool:
        """Whether steps are composed against a target (an interactive pool exists); else the cost
        model is never asked and nothing feeds it."""
        return bool(self.interactive)

    def observe(self, step: ComposedStep, seconds: float) -> None:
        """Feed the measured time of a step that ran."""
        stats = self.stats
        stats.num_steps += 1
        stats.last_step_seconds = seconds
        stats.last_target_seconds = step.target_seconds
        if step.target_seconds is not None:
            stats.num_targeted_steps += 1
            stats.num_over_target += seconds > step.target_seconds
        if self.needs_cost_model:
            self.cost_model.observe(step.features, seconds)

    def _target_seconds(self) -> float | None:
        if not self.interactive:
            return None
        busy = [self.slos[n] for n in self.interactive if self.schedulers[n].num_unfinished]
        if busy:
            return min(slo.step_seconds for slo in busy)
        return min(self.slos[n].idle_step_seconds for n in self.interactive)

    def _token_budget(self, name: str, so_far: StepFeatures, target: float | None) -> int | None:
        """Tokens the throughput pool `name` may schedule so that the step stays within `target`."""
        scheduler = self.schedulers[name]
        if target is None or not scheduler.config.enable_chunked_prefill or not scheduler.num_unfinished:
            return None
        model = self.cost_model
        cap = min(scheduler.config.max_num_batched_tokens, max(COLD_START_TOKENS, 2 * model.max_prefill_seen))
        budget = cap if not model.ready else self._fitting_tokens(scheduler, so_far, target, cap)
        if budget > 0:
            self._starved[name] = 0
            return budget
        self._starved[name] += 1
        if self._starved[name] >= STARVATION_STEPS:
            self._starved[name] = 0
            return scheduler.block_manager.block_size
        return 0

    def _fitting_tokens(self, scheduler: Scheduler, so_far: StepFeatures, target: float, cap: int) -> int:
        """The largest token budget in [0, cap] whose predicted step time stays within the limit (the
        target, or the floors of the module docstring): the pool's decodes first, then one chunk."""
        decodes, prefill_context = scheduler.pending_work()
        predict = self.cost_model.predict
        before = predict(so_far)
        if so_far.num_prefill_tokens or so_far.num_decode_tokens:
            limit = max(target, before + MIN_THROUGHPUT_SHARE * target)
        else:
            limit = max(target, 2 * before)       # the fixed cost of the step, and as much again of work

        def fits(tokens: int) -> bool:
            extra = StepFeatures()
            for context in decodes[:tokens]:
                extra.add(context, 1, True)
            chunk = tokens - min(tokens, len(decodes))
            if chunk and prefill_context is not None:
                extra.add(prefill_context, chunk, False)
            return predict(so_far.plus(extra)) <= limit

        if not fits(1):
            return 0
        low, high = 1, cap          # fits(low) holds
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return low
