"""The SLO feedback of one interactive pool: its recent latencies, measured in the engine, and the two
scales (TTFT, ITL) they set for the step composer's target (`engine.composer`, step 1 of its control
law). Times are seconds, not steps: updates every `UPDATE_SECONDS`, a hold of `HOLD_SECONDS` after a
decrease, inter-token gaps over the last `ITL_WINDOW_SECONDS`; they were 8, 64 and 128 steps of the
2-core CPU's ~0.1 s, where they were tuned, so a device whose steps are ten times shorter holds and
relaxes over the same time.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.config import LatencySLO

TTFT_AIM = 0.8              # of ttft_ms: room left for the gateway and the network
ITL_AIM = 0.9               # of itl_ms: the p99 sits a little under the SLO, not at it
RELAX_BELOW = 0.7           # a p99 below this fraction of its aim lets the scale grow back
MIN_SCALE = 0.25
MAX_DECREASE = 0.7          # the most one update may shrink the scale by (a factor)
SCALE_STEP = 0.05           # additive growth per update
UPDATE_SECONDS = 0.8        # between updates of a pool's scales (8 CPU steps)
HOLD_SECONDS = 6.4          # no further decrease for this long after one; a window this long without a
                            # shared sample is quiet (64 steps of the 2-core CPU's ~0.1 s, where they were tuned)
TTFT_WINDOW = 32            # requests
ITL_WINDOW_SECONDS = 12.8   # inter-token gaps of this long a time (128 steps of the 2-core CPU)


class Feedback:
    """One scale in [`MIN_SCALE`, 1] moved by a measured ratio (p99 / `aim`): multiplicative
    decrease when the p99 is over and a new sample is a miss too (then a hold of `HOLD_SECONDS` while
    the window fills with the new regime; an old miss that is still in the window does not count
    again), additive increase when comfortably under or when the samples have gone quiet (none for
    `HOLD_SECONDS`). Times are seconds, not steps, so a device whose steps are 10x shorter holds and
    relaxes over the same time (and ten times the steps)."""

    def __init__(self, aim: float) -> None:
        self.aim = aim                       # seconds
        self.scale = 1.0
        self.num_decreases = 0
        self._hold = 0
        self._quiet = 0.0                    # seconds since the last sample
        self._newest = 0.0                   # the largest sample since the last update

    def sample(self, seconds: float) -> None:
        """A sample went into the window (the caller keeps the window)."""
        self._quiet = 0
        self._newest = max(self._newest, seconds)

    def update(self, ratio: float | None, seconds: float) -> None:
        """`ratio`: the window's p99 / `aim` (None: no samples); `seconds`: since the last update."""
        self._hold = max(0.0, self._hold - seconds)
        self._quiet += seconds
        quiet, new_miss = self._quiet >= HOLD_SECONDS, self._newest > self.aim
        self._newest = 0.0
        if quiet:   # one SCALE_STEP per UPDATE_SECONDS of quiet, however long since the last update
            quiet_steps = int(min(seconds, self._quiet - HOLD_SECONDS) // UPDATE_SECONDS)
            self.scale = min(1.0, self.scale + SCALE_STEP * max(1, quiet_steps))
        elif ratio is None:
            return
        elif ratio > 1 and new_miss and not self._hold:
            self.scale = max(MIN_SCALE, self.scale * max(MAX_DECREASE, 1 / ratio))
            self.num_decreases += 1
            self._hold = HOLD_SECONDS
        elif ratio < RELAX_BELOW:
            self.scale = min(1.0, self.scale + SCALE_STEP)


class SLOTracker:
    """One interactive pool's recent latencies, measured in the engine, and the two scales they set.

    TTFT is the engine's: from `add_request` to the first sampled token (the gateway's admission
    wait is not in it; the gateway reports waiting requests through `StepComposer.set_external_waiting`
    instead). An inter-token gap is the wall time between the ends of two consecutive steps that both
    carried one of the pool's decodes. `scale`, the smaller of both, sets the step target that
    throughput pools fill; neither bounds the pool's own prefill chunks.

    Only latencies that throughput work shares in are counted (`shared`): a gap whose step carried
    throughput tokens, a first token whose wait saw a step with throughput tokens. The scales act
    on throughput work alone, so a miss the pool causes by itself (its own prefills between its
    decodes, its own queue at a burst) is none of their business: counted, it would shrink the
    target on every step without making the pool any faster, and starve the throughput pools. A
    window with no new shared sample for `HOLD_SECONDS` relaxes its scale (the
    throughput pools have not touched this latency lately, so the room they had may come back).
    """

    def __init__(self, slo: LatencySLO) -> None:
        self.slo = slo
        self.ttfts: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.itls: deque[float] = deque()          # the gaps of the last ITL_WINDOW_SECONDS ...
        self._itl_ends: deque[float] = deque()     # ... and when each ended
        self.ttft = Feedback(TTFT_AIM * slo.ttft_ms / 1000)
        self.itl = Feedback(ITL_AIM * slo.itl_ms / 1000)
        self._last_update: float | None = None   # end of the step of the last update (None: no work yet)
        self._last_decode_end: float | None = None   # end of the previous step if it carried a decode

    @property
    def scale(self) -> float:
        return min(self.ttft.scale, self.itl.scale)

    @property
    def num_decreases(self) -> int:
        return self.ttft.num_decreases + self.itl.num_decreases

    def ratios(self) -> tuple[float | None, float | None]:
        """(p99 TTFT / its aim, p99 ITL / its aim), None where there are no samples; > 1 is a miss."""
        ttft = itl = None
        if self.ttfts:
            ttft = float(np.percentile(self.ttfts, 99)) / self.ttft.aim
        if self.itls:
            itl = float(np.percentile(self.itls, 99)) / self.itl.aim
        return ttft, itl

    def observe_first_token(self, seconds: float, shared: bool = True) -> None:
        """A first token `seconds` after the request reached the engine; `shared`: a step with
        throughput work ran while it waited (else it is not counted)."""
        if shared:
            self.ttfts.append(seconds)
            self.ttft.sample(seconds)

    def observe_step(self, had_decode: bool, had_work: bool, ended_at: float, shared: bool = True) -> None:
        """After each step of the device: record an inter-token gap (`shared`: the step carried throughput
        work; else the gap is not counted), and at the first step `UPDATE_SECONDS` or more after the last
        update (the first one: after the pool's first work), move the scales (the module docstring's step
        1). Steps without the pool's work update too: a pool gone idle takes no samples, so after
        `HOLD_SECONDS` its scales grow back by `SCALE_STEP` per `UPDATE_SECONDS` (the time the device
        sat idle included), and the throughput pools it shrank get their room back while it has
        nothing to protect. (Updated only with the pool's work, a scale squeezed by a flood stayed
        squeezed for as long as the pool had nothing to send, and into the next load after an idle
        spell: on the 2-core CPU, rag draining alone after a chat load composed its steps to a 31 ms
        target instead of 132 ms, 13-token chunks instead of 32, 115 tokens per busy second instead
        of 154.)"""
        if had_decode and self._last_decode_end is not None and shared:
            gap = ended_at - self._last_decode_end
            self.itls.append(gap)
            self._itl_ends.append(ended_at)
            while self._itl_ends[0] < ended_at - ITL_WINDOW_SECONDS:
                self._itl_ends.popleft()
                self.itls.popleft()
            self.itl.sample(gap)
        self._last_decode_end = ended_at if had_decode else None
        if self._last_update is None:
            if not had_work:
                return
            self._last_update = ended_at
            return
        elapsed = ended_at - self._last_update
        if elapsed < UPDATE_SECONDS:
            return
        self._last_update = ended_at
        ttft, itl = self.ratios()
        self.ttft.update(ttft, elapsed)
        self.itl.update(itl, elapsed)
