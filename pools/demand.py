"""Overload: whether a device can serve what its pools are offered, from what its engine measures.

The capacity formula sizes a pool's concurrency; past it the seed's rule is to scale horizontally, and
an operator can only do that if the gateway says when, and by how much. This module says it, from
numbers, with no clock of its own and no I/O (the gateway feeds it: `gateway.monitoring.overload`; `cliffguard
capacity --rate` and `simulate` ask it for a planned arrival mix).

**What a pool can do** (`pool_rates`), from the device's step-cost model (the linear model each
device worker fits online to the steps it measures, `engine.step_cost`), for the pool's typical
request (its mean prompt P and output O over the window):

- prefill tokens/s: P over the seconds of the chunks that compute a P-token prompt at the pool's
  `max_num_batched_tokens` each (the attention and keys-read terms grow with the context);
- decode tokens/s: B over the seconds of a step that decodes B sequences at context P + O/2, where
  B = min(max_num_seqs, the pool's KV credits on one replica / (P + O)) — a pool whose formula gives
  room for one long request at a time decodes one token per step, whatever the device could do.

**What a pool is offered**: the prompt tokens and the output tokens (max_tokens capped at the pool's
`avg_len`, as placement estimates them) of the requests that arrived in the last `WINDOW_SECONDS`,
per second (per second since the first arrival, while that is shorter: `OfferedLoad.span`). Batch lines are not offered load: they wait for idle capacity by design.

**The device's load** is the fraction of one replica's time the offered load needs,

    load = sum over pools (offered prefill / prefill capacity + offered decode / decode capacity)

divided by the replicas that are up. Its **backlog** is the age of the oldest request still waiting
for its first token (queued for KV credits, in the engine's queue or being prefilled).

**Overloaded** (`OverloadDetector`) when, for `ON_SECONDS` on end, the load is over 1 while some
request has waited at least `BACKLOG_SECONDS` — or at once when a pool's oldest waiting request is
older than its wait bound (half its `max_queue_seconds`, within [5, 30] s: the request is on its way
to a 503, or to its client giving up). It **clears** once the load is at most `OFF_LOAD` and every
pool's oldest wait under half its bound, for `OFF_SECONDS` on end. Entering is quick (a flood shows in
seconds), leaving is slow (a queue that drained once is not a device that keeps up).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.step_cost import StepFeatures, StepTime

WINDOW_SECONDS = 20.0     # arrivals judged: long enough for a few long requests, short enough to answer in 30 s
ON_SECONDS = 3.0          # load over 1 with a backlog this long turns overload on
OFF_SECONDS = 10.0        # load at most OFF_LOAD and no old request this long turns it off
OFF_LOAD = 0.9
BACKLOG_SECONDS = 2.0     # a request waiting this long is a backlog (not just the request being started)
MIN_WAIT_BOUND, MAX_WAIT_BOUND = 5.0, 30.0


def wait_bound(max_queue_seconds: float | None) -> float:
    """How long a pool's oldest request may wait for its first token before the device is overloaded:
    half its `max_queue_seconds` (it is on its way to a 503), within [5, 30] s; 30 s with no limit."""
    if max_queue_seconds is None:
        return MAX_WAIT_BOUND
    return min(MAX_WAIT_BOUND, max(MIN_WAIT_BOUND, max_queue_seconds / 2))


# --- what a pool is offered -------------------------------------------------------------------------

class OfferedLoad:
    """The requests one pool was offered over the last `window` seconds (any monotonic clock), counted
    from `since` if given, else from the first arrival (a gateway's pool is offered nothing before its
    device is ready: a restart into a flood counts from the flood, however long the model took to load)."""

    def __init__(self, window: float = WINDOW_SECONDS, since: float | None = None) -> None:
        self.window, self.since = window, since
        self._arrivals: deque[tuple[float, int, int]] = deque()   # (at, prompt tokens, output tokens)

    def span(self, now: float) -> float:
        """The seconds the totals at `now` were counted over, to divide them by: the window, or the time
        since counting began when that is shorter (a gateway started into steady traffic reads its rate
        from the start, not a fraction of it), at least a quarter of the window (a first long request in
        its first second is not a flood)."""
        if self.since is None:   # nothing arrived yet
            return self.window
        return min(self.window, max(now - self.since, self.window / 4))

    def add(self, at: float, prompt_tokens: int, output_tokens: int) -> None:
        if self.since is None:
            self.since = at
        self._arrivals.append((at, prompt_tokens, output_tokens))

    def _trim(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now - self.window:
            self._arrivals.popleft()

    def totals(self, now: float) -> tuple[int, int, int]:
        """(requests, prompt tokens, output tokens) that arrived in the window ending at `now`."""
        self._trim(now)
        return (len(self._arrivals), sum(a[1] for a in self._arrivals), sum(a[2] for a in self._arrivals))


# --- what a pool can do -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolRates:
    """What one replica can do for one pool alone, tokens per second."""

    prefill: float
    decode: float
    batch: int            # sequences a decode step of this pool carries at most (B above)


def _seconds(model: StepTime, features: StepFeatures, num_sampled: int) -> float:
    return max(1e-9, model.seconds((), features, num_sampled))


def pool_rates(model: StepTime, *, prompt_tokens: float, output_tokens: float, max_num_seqs: int,
               credits: int, chunk: int) -> PoolRates:
    """Prefill and decode tokens/s one replica can do for a pool whose typical request has
    `prompt_tokens` and `output_tokens`, `max_num_seqs` and `credits` KV token slots on the replica,
    prefilling `chunk` tokens a step (module docstring)."""
    prompt, output = max(1, round(prompt_tokens)), max(0, round(output_tokens))
    prefill_s, done = 0.0, 0
    while done < prompt:
        q = min(chunk, prompt - done)
        step = StepFeatures()
        step.add(done, q, is_decode=False)
        prefill_s += _seconds(model, step, 1 if done + q == prompt else 0)
        done += q
    batch = max(1, min(max_num_seqs, credits // max(1, prompt + output)))
    context = prompt + output // 2
    step = StepFeatures()
    for _ in range(batch):
        step.add(context, 1, is_decode=True)
    return PoolRates(prefill=prompt / prefill_s, decode=batch / _seconds(model, step, batch), batch=batch)


# --- one device's load ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolLoad:
    """One pool of a device, at one moment: what it is offered, what it can do, who waits."""

    pool: str
    offered_prefill: float         # prompt tokens/s offered
    offered_decode: float          # output tokens/s offered
    rates: PoolRates | None        # None until the device has a step-cost model
    oldest_wait: float             # seconds the oldest request still without its first token has waited
    wait_bound: float

    @property
    def load(self) -> float:
        """The fraction of one replica's time the offered load needs (0 without rates)."""
        if self.rates is None:
            return 0.0
        return self.offered_prefill / self.rates.prefill + self.offered_decode / self.rates.decode


@dataclass(frozen=True)
class DeviceLoad:
    """A device's pools at one moment, and the replicas serving them."""

    pools: tuple[PoolLoad, ...]
    replicas: int

    @property
    def load(self) -> float:
        """Offered load over capacity: the fraction of its replicas' time the device is asked for."""
        return sum(p.load for p in self.pools) / max(1, self.replicas)

    @property
    def oldest_wait(self) -> float:
        return max((p.oldest_wait for p in self.pools), default=0.0)

    def over_bound(self) -> list[PoolLoad]:
        return [p for p in self.pools if p.oldest_wait > p.wait_bound]

    @property
    def short_of_replicas(self) -> bool:
        """Whether another replica is needed now: the offered load needs more than are ready
        (`replicas_needed`), or a request waits past its pool's bound. Not the detector's verdict, which
        holds `OFF_SECONDS` after a new replica took the load, long enough to start one more for nothing."""
        return replicas_needed(self.pools) > self.replicas or bool(self.over_bound())

    def describe(self) -> str:
        """One line with the numbers: load, each pool's part and rates, the oldest waits."""
        parts = []
        for p in self.pools:
            rates = (f" ({p.offered_prefill:.0f} prefill tok/s offered of {p.rates.prefill:.0f}, "
                     f"{p.offered_decode:.0f} decode tok/s of {p.rates.decode:.0f} at batch {p.rates.batch})"
                     if p.rates is not None else " (no step-cost model yet)")
            parts.append(f"{p.pool} {p.load:.2f}{rates}, oldest waiting {p.oldest_wait:.1f} s")
        return (f"offered load {self.load:.2f} of {self.replicas} replica(s)' time: " + "; ".join(parts))


@dataclass(frozen=True)
class OverloadState:
    overloaded: bool
    changed: bool
    reason: str


class OverloadDetector:
    """On/off with hysteresis over successive `DeviceLoad`s (module docstring). Pure: fed `now`."""

    def __init__(self) -> None:
        self.overloaded = False
        self.reason = ""
        self._over_since: float | None = None     # load over 1 with a backlog, since
        self._clear_since: float | None = None    # within bounds, since

    def observe(self, now: float, device: DeviceLoad) -> OverloadState:
        late = device.over_bound()
        over = device.load > 1.0 and device.oldest_wait >= BACKLOG_SECONDS
        self._over_since = (self._over_since if self._over_since is not None else now) if over else None
        calm = device.load <= OFF_LOAD and all(p.oldest_wait <= p.wait_bound / 2 for p in device.pools)
        self._clear_since = (self._clear_since if self._clear_since is not None else now) if calm else None
        was = self.overloaded
        if not was and (late or (over and now - self._over_since >= ON_SECONDS)):
            self.overloaded = True
            why = (", ".join(f"pool {p.pool}'s oldest request has waited {p.oldest_wait:.1f} s (bound "
                             f"{p.wait_bound:g} s)" for p in late) if late else "demand over capacity")
            self.reason = f"overloaded: {why}; {device.describe()}"
        elif was and calm and now - self._clear_since >= OFF_SECONDS:
            self.overloaded = False
            self.reason = f"no longer overloaded: {device.describe()}"
        return OverloadState(self.overloaded, self.overloaded != was, self.reason)


def replicas_needed(pools: Sequence[PoolLoad]) -> int:
    """The replicas that carry `pools`' offered load with each at most `OFF_LOAD` busy (at least 1)."""
    load = sum(p.load for p in pools)
    return max(1, math.ceil(load / OFF_LOAD - 1e-9))


# --- a planned arrival mix (cliffguard capacity --rate, simulate) -------------------------------------

@dataclass(frozen=True)
class PlannedPool:
    """One pool of a device under a planned arrival mix: its requests/s and their mean lengths, and
    the limits `pool_rates` needs."""

    name: str
    rate: float              # requests/s routed to the pool
    prompt_tokens: float     # mean prompt tokens of those requests
    output_tokens: float     # mean output tokens
    max_num_seqs: int
    credits: int             # KV token slots on one replica
    chunk: int               # max_num_batched_tokens


def planned_load(model: StepTime, pools: Sequence[PlannedPool], replicas: int) -> DeviceLoad:
    """The device's load under a planned mix, by the same definitions as a live gateway's (nobody has
    waited yet: a plan is overloaded when `DeviceLoad.load` > 1, and `replicas_needed` says how many
    replicas carry it)."""
    loads = []
    for p in pools:
        rates = pool_rates(model, prompt_tokens=p.prompt_tokens, output_tokens=p.output_tokens,
                           max_num_seqs=p.max_num_seqs, credits=p.credits, chunk=p.chunk)
        loads.append(PoolLoad(p.name, p.rate * p.prompt_tokens, p.rate * p.output_tokens, rates, 0.0, MAX_WAIT_BOUND))
    return DeviceLoad(tuple(loads), replicas)
