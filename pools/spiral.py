"""Death-spiral detection for one pool, from two of its counters: preemptions and generated tokens.

The eviction cascade: preempted requests are queued again and recompute when readmitted, so the pool
spends its steps re-prefilling while the tokens it generates stall. "If num_preemptions is rising
while throughput is flat, you are in a death spiral" (vllm#37307 saw decode fall from ~100 to 1.5 tok/s
per GPU in such a preempt/readmit loop).

`SpiralDetector` is fed samples `(time, preemptions total, generated tokens total)` of one pool and
judges the last `window_seconds` each time a sample arrives. It **trips** when

1. preemptions are **sustained**: at least `min_preemptions_per_s` in each quarter of the window
   (`NUM_SLICES` equal slices). A burst trips it only if it reaches into all four quarters, so a
   burst shorter than half the window never does; and
2. generated tokens/s are **flat or falling**: those of the newer half of the window are at most
   `1 + tokens_tolerance` times those of the older half.

Once tripped it **holds** while the window's preemptions average at least `min_preemptions_per_s`
(a lull in one quarter is not a recovery) and tokens/s stay flat or falling, and it **clears** only
once that has been untrue for `clear_seconds` (default: one window). Entering is strict and leaving
is slow, so a pool on the edge does not flap. Until the samples span a whole window nothing is
judged, which counts as untrue. The counters are totals since the device worker started: a total
that falls (a restarted worker counts from 0 again) starts the history afresh from that sample, and
a sample no later than the previous one is ignored. Between samples the totals are interpolated
linearly, so the slices may be shorter than the sampling interval.

Pure and small: no clock of its own, no I/O, no aiohttp, no torch. The gateway feeds one detector per
local pool from the stats its device worker pushes (`gateway.runtime.SpiralWatch`); the simulator
(`pools.simulation`) can feed one from its virtual clock the same way.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from engine.stats import STATS_INTERVAL
from pools.config.checks import NonNegative, Positive, Seconds, Spec, SpecError

__all__ = ["NUM_SLICES", "SpiralConfig", "SpiralDetector", "SpiralState", "SpiralWindow"]

# Preemptions must reach the minimum rate in each quarter of the window. Quarters, not finer: a real
# spiral preempts in clumps (a step that runs out of blocks preempts, the next ones readmit), and a
# slice must be long enough to hold one clump.
NUM_SLICES = 4


class SpiralConfig(Spec):
    """One pool's death-spiral thresholds (YAML `death_spiral`, config/README.md), a model checked on
    construction (`pools.config.checks.Spec`); a SpecError names the field (`window_seconds: ...`)."""

    enabled: bool = True
    window_seconds: Seconds = 30.0        # the window judged at each sample
    min_preemptions_per_s: Positive = 0.5  # to trip: in each quarter of the window; to hold: on average
    tokens_tolerance: NonNegative = 0.1   # newer half's tokens/s up to 1.1 x the older half's count as flat
    clear_seconds: NonNegative | None = None   # absent this long to clear; None: window_seconds

    def check(self) -> None:
        if self.window_seconds < NUM_SLICES * STATS_INTERVAL:   # each quarter holds a sample of the engine's at least
            raise SpecError("window_seconds", f"must be at least {NUM_SLICES * STATS_INTERVAL:g} s (each of its "
                            f"{NUM_SLICES} slices one stats period of the engine's), got {self.window_seconds:g}")

    @property
    def clear_after_seconds(self) -> float:
        """How long the condition must be absent before a tripped detector clears."""
        return self.window_seconds if self.clear_seconds is None else self.clear_seconds


@dataclass(frozen=True)
class SpiralWindow:
    """The numbers of one judged window (`end - window_seconds` to `end`)."""

    end: float
    window_seconds: float
    preemptions_per_s: float              # over the whole window
    min_slice_preemptions_per_s: float    # in its slowest slice
    older_tokens_per_s: float             # generated tokens/s in the older half ...
    newer_tokens_per_s: float             # ... and in the newer half

    def describe(self) -> str:
        """`12.5 preemptions/s over 30 s (slowest quarter 4.0/s), generated tokens/s 95.2 -> 41.0
        (older -> newer half)`."""
        return (f"{self.preemptions_per_s:.1f} preemptions/s over {self.window_seconds:g} s (slowest "
                f"quarter {self.min_slice_preemptions_per_s:.1f}/s), generated tokens/s "
                f"{self.older_tokens_per_s:.1f} -> {self.newer_tokens_per_s:.1f} (older -> newer half)")


@dataclass(frozen=True)
class SpiralState:
    """What the detector says after a sample.

    `reason` is one line with the numbers: while tripped, why (the last window in which the condition
    held); on the sample that cleared it, why it cleared; otherwise empty."""

    tripped: bool
    changed: bool = False                 # this sample tripped or cleared the detector
    reason: str = ""
    window: SpiralWindow | None = None    # the latest judged window; None until the samples span one


class SpiralDetector:
    """One pool's death-spiral detector (module docstring). Feed it with `observe`, in time order.

    Not thread-safe; one owner feeds it (the gateway's event loop, or the simulator's loop). Memory is
    the samples of one window and a bit: older ones are dropped as new ones arrive.
    """

    def __init__(self, config: SpiralConfig = SpiralConfig()) -> None:
        self.config = config
        self._times: list[float] = []
        self._preemptions: list[int] = []
        self._tokens: list[int] = []
        self._head = 0                        # samples before it are dropped
        self._last_present: float | None = None   # when the condition last held (while tripped)
        self._state = SpiralState(tripped=False)

    @property
    def state(self) -> SpiralState:
        """What the latest sample left (`changed` as it was then)."""
        return self._state

    @property
    def tripped(self) -> bool:
        return self._state.tripped

    def observe(self, t: float, num_preemptions: int, num_generated_tokens: int) -> SpiralState:
        """Add a sample taken at time `t` (seconds, any clock that only advances) with the pool's
        totals, judge the window that ends at `t`, and return the detector's state."""
        times = self._times
        if times and t <= times[-1]:
            self._state = dataclasses.replace(self._state, changed=False)
            return self._state
        if times and (num_preemptions < self._preemptions[-1] or num_generated_tokens < self._tokens[-1]):
            self._restart_history()
        times.append(t)
        self._preemptions.append(num_preemptions)
        self._tokens.append(num_generated_tokens)
        self._drop_before(t - self.config.window_seconds)
        window = self._judge(t)
        present = window is not None and self._holds(window, self._state.tripped)
        self._state = self._next_state(t, window, present)
        return self._state

    # --- judging ---------------------------------------------------------------------------------
    def _judge(self, end: float) -> SpiralWindow | None:
        """The window ending at `end`, once the samples reach back to its start."""
        w = self.config.window_seconds
        start = end - w
        if self._times[self._head] > start:
            return None
        edges = [start + w * i / NUM_SLICES for i in range(NUM_SLICES)] + [end]
        preemptions = [self._at(self._preemptions, x) for x in edges]
        slice_seconds = w / NUM_SLICES
        slowest = min(b - a for a, b in zip(preemptions, preemptions[1:])) / slice_seconds
        middle = self._at(self._tokens, start + w / 2)
        older = (middle - self._at(self._tokens, start)) / (w / 2)
        newer = (self._at(self._tokens, end) - middle) / (w / 2)
        return SpiralWindow(end=end, window_seconds=w, preemptions_per_s=(preemptions[-1] - preemptions[0]) / w,
                            min_slice_preemptions_per_s=slowest, older_tokens_per_s=older, newer_tokens_per_s=newer)

    def _holds(self, window: SpiralWindow, tripped: bool) -> bool:
        """The condition to trip (every slice at the rate) or, once tripped, to hold (the window's mean)."""
        c = self.config
        rate = window.preemptions_per_s if tripped else window.min_slice_preemptions_per_s
        # a hair of slack: interpolated slices of an exactly steady rate must not fall just below it
        sustained = rate >= c.min_preemptions_per_s * (1 - 1e-9)
        flat = window.newer_tokens_per_s <= window.older_tokens_per_s * (1 + c.tokens_tolerance)
        return sustained and flat

    def _next_state(self, t: float, window: SpiralWindow | None, present: bool) -> SpiralState:
        c, was = self.config, self._state
        if present:
            self._last_present = t
            if window.newer_tokens_per_s < window.older_tokens_per_s:
                trend = "falling"
            else:
                trend = f"flat (within +{c.tokens_tolerance:.0%})"
            reason = (f"death spiral: {window.describe()}; preemptions at >= {c.min_preemptions_per_s:g}/s "
                      f"while generated tokens/s are {trend}")
            return SpiralState(tripped=True, changed=not was.tripped, reason=reason, window=window)
        if not was.tripped:
            return SpiralState(tripped=False, window=window)
        absent_for = t - self._last_present
        if absent_for < c.clear_after_seconds:
            return SpiralState(tripped=True, reason=was.reason, window=window)
        self._last_present = None
        last = f"; last window: {window.describe()}" if window is not None else \
            "; the samples do not span a window (the device worker restarted, or stats are missing)"
        return SpiralState(tripped=False, changed=True, window=window,
                           reason=f"death spiral cleared: the condition was absent for {absent_for:.1f} s{last}")

    # --- the samples -----------------------------------------------------------------------------
    def _at(self, values: list[int], x: float) -> float:
        """A total at time `x` (within the kept samples), interpolated linearly between samples."""
        times = self._times
        i = bisect.bisect_right(times, x, lo=self._head)
        if i == len(times):
            return float(values[-1])
        if i == self._head:
            return float(values[i])
        t0, t1 = times[i - 1], times[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (x - t0) / (t1 - t0)

    def _drop_before(self, start: float) -> None:
        """Keep the samples from the last one at or before `start` on (it anchors the interpolation)."""
        times = self._times
        keep_from = max(self._head, bisect.bisect_right(times, start, lo=self._head) - 1)
        self._head = keep_from
        if self._head > 64 and self._head * 2 > len(times):
            del times[:self._head], self._preemptions[:self._head], self._tokens[:self._head]
            self._head = 0

    def _restart_history(self) -> None:
        self._times.clear()
        self._preemptions.clear()
        self._tokens.clear()
        self._head = 0
