"""The step composer: one forward pass, several latency classes.

Every pool of a device proposes work for the same merged step, so a long prefill chunk of one pool
lengthens the step, and with it the time to first token and the inter-token latency, of every other
pool. The composer decides across pools, not each pool alone. Its control law, each step:

1. **Target.** The step gets a time target: `scale x ITL_AIM x itl_ms`, the tightest over the
   interactive pools (a `LatencySLO`) that have work (planned at the aim, not at `itl_ms` itself: a
   step planned at the SLO lands over it whenever the cost model under-predicts, and the gap a client
   sees also carries the gateway's delivery, so a p99 planned at the SLO is a p99 over it), or, when
   none has, `scale x min(itl_ms, ttft_ms / 2)` (an interactive request that arrives mid-step waits at
   most that long before its prefill starts).
   `scale` (in [`MIN_SCALE`, 1], one per interactive pool, `SLOTracker` in engine/slo_feedback.py) is
   feedback from what the engine measures: the smaller of two `Feedback` scales, one moved by the p99
   of the pool's recent times to first token against `TTFT_AIM x ttft_ms`, one by the p99 of its
   recent inter-token gaps
   against `ITL_AIM x itl_ms`. A p99 over its aim, with a new sample over it too, shrinks its scale
   in proportion (at most by `MAX_DECREASE` per update, then it holds for `HOLD_SECONDS` so the window
   can show the effect); a p99 comfortably under (below `RELAX_BELOW` of the aim) grows it back by
   `SCALE_STEP`. Only the latencies that throughput work shares in are sampled: gaps whose step
   carried throughput tokens the target let in, first tokens whose wait saw such a step (tokens a
   pool got because it was owed its share, step 5, are the guarantee's: no cut of the target
   removes them, and counted, their misses shrank the target until the throughput pools got their
   min_share and nothing more). What the pool does to
   itself (its own prefills between its decodes, its own queue in a burst) no throughput cut can
   mend; counted, such misses ratcheted the target down to `MIN_SCALE` and starved the throughput
   pools while the pool's latency stayed where it was. With no
   interactive pool on the device there is no target (each pool fills its own token budget, the
   behaviour of plain chunked prefill).
2. **Interactive pools** schedule first. One that has running decodes gets the token budget that
   the step-cost model predicts still fits `ITL_AIM` of its `itl_ms` alone (at least its decodes and
   one block of prefill), so its own long prompts are chunked and its decodes keep `itl_ms`; beside
   another interactive pool with sequences decoding, the tightest `itl_ms` of the two, with the other's
   work in the step (one pool's prompt must not stall another's decodes); with nothing decoding on
   any interactive pool, its whole `max_num_batched_tokens` (a lone prefill is best served in one
   piece). The feedback scales never shrink this budget: they exist to take throughput work out of
   the step, and chunking the pool's own prompts harder would only delay its first tokens (with chat
   at 1.25 requests/s beside a rag flood, an ITL-scaled budget split each ~60-token chat prompt into
   3-10 chunks and raised chat's median TTFT by 50-70% over chat alone).
3. **Pressure.** An interactive pool is *pressed* when it has a request waiting (not admitted: no
   running slot or no free block; or waiting at the gateway for KV credits, which the gateway
   reports with `set_external_waiting`), a swapped-out request, a request whose prefill runs in
   this step (its first token, or a recompute, is due), or when it runs `PRESSURE_OCCUPANCY` of its
   `max_num_seqs` (one burst from queueing; a paused request, whose client reads too slowly, presses
   only by the slots it holds). While any interactive pool is pressed, throughput pools
   drop to their floor: nothing, unless they are owed their share (step 5); but not for a pressed
   pool that runs nothing this step and gets no blocks back a step later (`_held_back`: it waits for
   its paused requests' clients, however long they read, or the gateway, not for the device). So an
   interactive request's prefill step costs what it costs with chat alone, and when chat's
   concurrency climbs (its steps carry throughput work, so each of its requests lasts longer) the
   composer gives back chat-alone step times until the queue drains, rather than letting requests
   wait for a slot.
4. **Throughput pools** otherwise get the token budget that the step-cost model predicts still fits
   the target: their prefill chunks grow when interactive work is light or absent (work-conserving)
   and shrink when it is heavy. Beside interactive work they may add `MIN_THROUGHPUT_SHARE` of the
   target to a step that interactive work already fills (so heavy interactive decoding slows them
   but never stops them, at the price of steps up to that much over the target), but never a
   prefill chunk under `MIN_PREFILL_CHUNK` tokens, one block (a chunk reads its sequence's whole
   cached context, so a few tokens would pay nearly what a full chunk pays), and the room they get
   there is divided by `mixed_margin`, the model's recent misprediction of such mixed steps. A
   throughput-only step may always spend as much on work as the step's fixed cost (so a target
   below the fixed cost of a step halves their throughput rather than starving them), and never
   nothing: one block where no token fits. A throughput
   pool left with nothing for `STARVATION_SECONDS` of steps gets one block's worth of tokens, as
   long as that keeps the step within the `itl_ms` of the interactive pools that are running (the
   SLO wins: on a slow device one block after a long cached context can be over it; then it waits
   for a step without them).
5. **Share.** A throughput pool with work whose part of the device's step time over the last
   `SHARE_WINDOW_SECONDS` (of steps, 2 s) is under its `min_share` (a pool key, default 0.2) is
   *owed*: whatever the target, it gets the tokens that make its part `min_share` of this step (the
   rest of the step's predicted cost x min_share / (1 - min_share) added; at least its decodes, or
   one block of prefill) as far as they keep the step within the running interactive pools'
   `itl_ms` (a smaller chunk, or nothing, where a block after a long cached context would break it;
   not where those pools are over it by themselves, nor once the owed pool has had nothing for
   `OWED_WAIT_SECONDS` of steps: then its floor), in every step but a lone pressed one: a step pressed after a calm one
   (typically one interactive prefill) costs what it costs with the interactive pools alone, and the
   share is made up in the steps around it; pressure that lasts a second step is the interactive
   pool's steady state, and the owed pool rides it. Each step's measured time is divided among its pools in
   proportion to what each added to its predicted cost (its tokens while the model is cold). So an
   interactive pool that stays pressed (a chat load the device cannot serve within its SLO) slows
   the throughput pools to `min_share`, never to nothing; its steps grow by at most
   min_share / (1 - min_share) (25%) while it does. A throughput pool's decodes stop only while its
   share is above `min_share`: from a share of 1 (it ran alone) that lasts at most
   (1 - min_share) x `SHARE_WINDOW_SECONDS` of step time (1.6 s), then at most `OWED_WAIT_SECONDS` of
   steps at a time (a few steps, unless its cheapest work would break the interactive pools' SLO).
   `min_share: 0` restores the floor of nothing.

The step's cost comes from `engine.step_cost.StepCostModel`, the linear step-cost model refitted
online on the engine's measured steps (with a safety margin), on every device (a pool's `auto`
preemption prices re-prefills with it too). Until it is ready, and whenever it would extrapolate,
a throughput chunk is capped at twice the largest prefill it has measured (at least
`COLD_START_TOKENS`), so it learns before it trusts itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import DEFAULT_MIN_SHARE, LatencySLO
from engine.scheduler import Scheduler, SchedulerOutput
from engine.slo_feedback import ITL_AIM, SLOTracker
from engine.step_cost import StepCostModel, StepFeatures, misprediction_margin

COLD_START_TOKENS = 64
STARVATION_SECONDS = 0.8   # of step time with nothing for a throughput pool: then one block (8 steps of this CPU)
MIN_THROUGHPUT_SHARE = 0.1
PRESSURE_OCCUPANCY = 0.75   # of max_num_seqs
MIN_PREFILL_CHUNK = 16      # tokens: beside interactive work a throughput pool's smaller chunks are dropped
MIXED_WINDOW = 32           # mixed steps whose misprediction sizes the next throughput chunks beside interactive work
SHARE_WINDOW_SECONDS = 2.0  # of step time: the window a throughput pool's share of the device is measured over
OWED_WAIT_SECONDS = 1.0     # of step time with nothing for an owed pool: then its floor, the SLO or not


@dataclass
class ComposedStep:
    """What every pool scheduled for one step, and the composer's view of its cost."""

    outputs: dict[str, SchedulerOutput] = field(default_factory=dict)
    features: StepFeatures = field(default_factory=StepFeatures)
    target_seconds: float | None = None       # None: no interactive pool on the device
    predicted_seconds: float | None = None
    pressed: tuple[str, ...] = ()             # interactive pools under pressure (`_held_back` ones: floor)
    mixed: bool = False                       # a throughput prefill chunk rides with interactive work
    throughput_tokens: int = 0                # tokens the throughput pools scheduled
    targeted_tokens: int = 0                  # ... of pools not owed: tokens the target let in (feedback samples)
    owed: tuple[str, ...] = ()                # throughput pools under their min_share: they ride even when pressed
    costs: dict[str, float] = field(default_factory=dict)   # each pool's predicted part of the step (its tokens
                                                            # while the cost model is cold): shares its time


@dataclass
class ComposerStats:
    num_steps: int = 0
    num_targeted_steps: int = 0
    num_over_target: int = 0                  # targeted steps that took longer than the target
    num_pressed_steps: int = 0                # steps composed with an interactive pool pressed
    num_owed_steps: int = 0                   # steps where a throughput pool under its min_share got its share
    last_target_seconds: float | None = None
    last_step_seconds: float = 0.0
    busy_seconds: float = 0.0                 # every step's measured time together (the device's busy time)
    pool_seconds: dict[str, float] = field(default_factory=dict)   # ... divided among pools by ComposedStep.costs


class StepComposer:
    """Builds each step from the pools' schedulers (see the module docstring). Single-threaded, like
    the schedulers it drives: called only from the engine's `step()`."""

    def __init__(self, schedulers: Mapping[str, Scheduler], slos: Mapping[str, LatencySLO | None],
                 cost_model: StepCostModel | None = None, min_shares: Mapping[str, float] | None = None) -> None:
        self.schedulers = dict(schedulers)
        self.slos = {name: slos.get(name) for name in self.schedulers}
        self.interactive = [n for n in self.schedulers if self.slos[n] is not None]
        self.throughput = [n for n in self.schedulers if self.slos[n] is None]
        self.min_shares = {n: (min_shares or {}).get(n, DEFAULT_MIN_SHARE) for n in self.throughput}
        self._shares: deque[tuple[float, dict[str, float]]] = deque()   # (step seconds, each throughput pool's)
        self._share_seconds = dict.fromkeys(self.throughput, 0.0)
        self._window_seconds = 0.0
        self.trackers = {n: SLOTracker(self.slos[n]) for n in self.interactive}
        self.cost_model = cost_model or StepCostModel()
        for scheduler in self.schedulers.values():   # a pool's `auto` preemption prices re-prefill with it too
            if scheduler.cost_model is not None:
                scheduler.cost_model.step_model = self.cost_model
        self.stats = ComposerStats()
        self._starved = dict.fromkeys(self.throughput, 0.0)   # seconds of steps since it last got tokens
        self._external_waiting = dict.fromkeys(self.interactive, 0)
        self._slo_limit: float | None = None     # this step: the tightest itl_ms of interactive pools running
        self._mixed_ratios: deque[float] = deque(maxlen=MIXED_WINDOW)   # measured / predicted, mixed steps
        self._throughput_ended_at: float | None = None   # end of the last step with targeted throughput work
        self._was_pressed = False                # the previous step was pressed (pressure lasting: owed rides)

    def set_external_waiting(self, pool: str, count: int) -> None:
        """Requests of `pool` waiting outside the engine (at the gateway, for KV credits): they press
        the pool like its own queue does. Ignored for pools that are not interactive."""
        if pool in self._external_waiting:
            self._external_waiting[pool] = max(0, int(count))

    def schedule(self) -> ComposedStep:
        step = ComposedStep()
        step.target_seconds = self._target_seconds()
        model = self.cost_model
        for name in self.interactive:
            budget = self._interactive_budget(name, step.features)
            out = self.schedulers[name].schedule(budget)
            step.outputs[name] = out
            step.features.add_scheduled(out.scheduled)
            step.costs[name] = out.num_batched_tokens
        step.pressed = tuple(name for name in self.interactive if self._is_pressed(name))
        self._slo_limit = min((self.slos[n].step_seconds for n in self.interactive
                               if self.schedulers[n].running), default=None)
        interactive_work = bool(step.features.num_prefill_tokens or step.features.num_decode_tokens)
        priced = model.ready and self.needs_cost_model      # costs from the model, else from tokens
        if priced:
            step.costs = {name: 0.0 for name in step.costs}
            if interactive_work:   # the interactive pools' part together (they are not told apart below)
                step.costs[self.interactive[0]] = model.predict(step.features) - model.predict(StepFeatures())
        lasting = bool(step.pressed) and self._was_pressed
        self._was_pressed = bool(step.pressed)
        floor = any(self._held_back(name, step.outputs[name]) for name in step.pressed)
        for name in self.throughput:
            budget = self._token_budget(name, step.features, step.target_seconds, floor=floor)
            if self._is_owed(name) and (lasting or not step.pressed):
                step.owed += (name,)
                owed = self._owed_budget(name, step.features)
                budget = None if budget is None else max(budget, owed)
            before_seconds = model.predict(step.features) if priced else 0.0
            out = self.schedulers[name].schedule(budget)
            step.outputs[name] = out
            step.throughput_tokens += out.num_batched_tokens
            if name not in step.owed:
                step.targeted_tokens += out.num_batched_tokens
            before = step.features.num_prefill_tokens
            step.features.add_scheduled(out.scheduled)
            step.mixed |= interactive_work and step.features.num_prefill_tokens > before
            step.costs[name] = model.predict(step.features) - before_seconds if priced else out.num_batched_tokens
        if self.needs_cost_model:
            step.predicted_seconds = self.cost_model.predict(step.features)
        return step

    def share(self, name: str) -> float | None:
        """Throughput pool `name`'s part of the device's step time over the last `SHARE_WINDOW_SECONDS` of
        steps (each step's time divided among its pools in proportion to what each added to its predicted
        cost; by tokens while the cost model is cold); None before any step."""
        if not self._window_seconds:
            return None
        return self._share_seconds[name] / self._window_seconds

    def _is_owed(self, name: str) -> bool:
        """A throughput pool with work whose share of the device's time is under its `min_share`."""
        floor = self.min_shares[name]
        if not floor or not self.schedulers[name].num_unfinished:
            return False
        share = self.share(name)
        return share is None or share < floor

    def _owed_budget(self, name: str, so_far: StepFeatures) -> int:
        """The tokens of a throughput pool under its `min_share`: what makes its part `min_share` of this
        step (the others' `so_far` cost x min_share / (1 - min_share) added), at least its decodes (or one
        block of prefill when nothing of it decodes), whatever the step's target or pressure; but no more
        than keeps the step within the `itl_ms` of the running interactive pools (its part times
        `mixed_margin`; a chunk smaller than a block, or nothing), unless they are over it by themselves; a
        pool that has had nothing for `OWED_WAIT_SECONDS` of steps gets its floor (those decodes, or that block)
        within it or not. On the 2-core CPU one block of a rag
        prompt after 2,900 cached tokens cost 90-120 ms beside chat's decodes: forced into every step, it
        put chat's inter-token gaps at 130-214 ms against a derived itl_ms of 130."""
        scheduler = self.schedulers[name]
        share = self.min_shares[name]
        decodes, prefill_context = scheduler.pending_work()
        cap = scheduler.config.max_num_batched_tokens
        floor = min(cap, len(decodes) or scheduler.block_manager.block_size)
        model = self.cost_model
        if not (so_far.num_prefill_tokens or so_far.num_decode_tokens):
            return floor                      # the step is the throughput pools' own: the target sizes it
        if not model.ready:
            return max(floor, min(cap, COLD_START_TOKENS))
        before = model.predict(so_far)
        tokens = max(floor, self._fitting_tokens(scheduler, so_far, before / (1 - share), cap))
        limit = self._slo_limit
        if limit is None or before >= limit:
            return tokens
        room = before + (limit - before) / self.mixed_margin
        fitting = min(tokens, self._fitting_tokens(scheduler, so_far, room, cap))
        return max(floor, fitting) if self._starved[name] >= OWED_WAIT_SECONDS else fitting   # waited: its floor

    @property
    def mixed_margin(self) -> float:
        """How much the cost model (its own margin included) under-predicted recent steps where a
        throughput prefill chunk rode with interactive work: the 90th percentile of measured /
        predicted, at least 1, at most 3 (`misprediction_margin`). A chunk after a long cached context reads all of it, which
        the linear model, fitted mostly on other steps, prices low; the room such a chunk gets beside
        interactive work is divided by this, so the misprediction lands on the throughput pool."""
        return misprediction_margin(self._mixed_ratios)

    def set_slo(self, pool: str, slo: LatencySLO) -> None:
        """Give interactive pool `pool` a new SLO (isolation by default: the one derived from the
        device's measured step at start); its feedback starts afresh."""
        if pool not in self.trackers:
            raise ValueError(f"set_slo: {pool!r} is not an interactive pool of this device")
        self.slos[pool] = slo
        self.trackers[pool] = SLOTracker(slo)

    @property
    def needs_cost_model(self) -> bool:
        """Whether steps are composed against a target (an interactive pool exists); else the composer
        never asks the cost model (it is still fed: `auto` preemption prices re-prefills with it)."""
        return bool(self.interactive)

    def observe(self, step: ComposedStep, seconds: float, ended_at: float | None = None) -> None:
        """Feed the measured time of a step that ran (`seconds`: its forward pass) and when it ended
        (any clock, the one `observe_first_token` is given too; the inter-token gaps of interactive
        pools are measured between ends)."""
        stats = self.stats
        stats.num_steps += 1
        stats.last_step_seconds = seconds
        stats.busy_seconds += seconds
        stats.last_target_seconds = step.target_seconds
        stats.num_pressed_steps += bool(step.pressed)
        stats.num_owed_steps += bool(step.owed)
        self._count_shares(step, seconds)
        for name in self.throughput:
            out = step.outputs.get(name)
            got = out is not None and out.num_batched_tokens > 0
            self._starved[name] = 0.0 if got or not self.schedulers[name].num_unfinished else \
                self._starved[name] + seconds
        if step.target_seconds is not None:
            stats.num_targeted_steps += 1
            stats.num_over_target += seconds > step.target_seconds
        if step.mixed and step.predicted_seconds:
            self._mixed_ratios.append(seconds / step.predicted_seconds)
        self.cost_model.observe(step.features, seconds)   # composing, and the gateway's overload verdict
        if ended_at is not None:
            shared = step.targeted_tokens > 0   # owed tokens are the guarantee's: no target cut removes them
            if shared:
                self._throughput_ended_at = ended_at
            for name, tracker in self.trackers.items():
                out = step.outputs.get(name)
                scheduled = out.scheduled if out is not None else []
                had_decode = any(item.num_new_tokens == 1 and item.seq.num_computed_tokens
                                 >= item.seq.num_prompt_tokens for item in scheduled)
                tracker.observe_step(had_decode, bool(scheduled), ended_at, shared)

    def _count_shares(self, step: ComposedStep, seconds: float) -> None:
        """The step's time into each pool's total and the share window, divided among its pools by
        `ComposedStep.costs`."""
        if seconds <= 0:
            return
        total = sum(max(0.0, c) for c in step.costs.values())
        for n, cost in step.costs.items():
            if total and cost > 0:
                self.stats.pool_seconds[n] = self.stats.pool_seconds.get(n, 0.0) + seconds * cost / total
        if not self.throughput:
            return
        parts = {n: seconds * max(0.0, step.costs.get(n, 0.0)) / total if total else 0.0 for n in self.throughput}
        self._shares.append((seconds, parts))
        self._window_seconds += seconds
        for n, part in parts.items():
            self._share_seconds[n] += part
        while len(self._shares) > 1 and self._window_seconds - self._shares[0][0] >= SHARE_WINDOW_SECONDS:
            old, old_parts = self._shares.popleft()
            self._window_seconds -= old
            for n, part in old_parts.items():
                self._share_seconds[n] -= part

    def observe_first_token(self, pool: str, seconds: float, ended_at: float | None = None) -> None:
        """A request of `pool` got its first token `seconds` after it reached the engine, in the step
        that ended at `ended_at` (observed already, on `observe`'s clock): it counts for the TTFT
        feedback if a step with throughput work ended after the request arrived (None: it counts)."""
        tracker = self.trackers.get(pool)
        if tracker is not None:
            shared = ended_at is None or (self._throughput_ended_at is not None
                                          and self._throughput_ended_at > ended_at - seconds)
            tracker.observe_first_token(seconds, shared)

    def _target_seconds(self) -> float | None:
        if not self.interactive:
            return None
        busy = [n for n in self.interactive if self.schedulers[n].num_unfinished]
        if busy:
            return min(ITL_AIM * self.slos[n].step_seconds * self.trackers[n].scale for n in busy)
        return min(self.slos[n].idle_step_seconds * self.trackers[n].scale for n in self.interactive)

    def _is_pressed(self, name: str) -> bool:
        """After the pool scheduled its step: whether it has requests waiting or due a prefill, or is
        close to its `max_num_seqs` (the module docstring's step 3). A paused request (its client reads
        too slowly) waits for its client, not for the device: it presses nothing, but its sequences
        still hold their running slots."""
        scheduler = self.schedulers[name]
        if self._external_waiting[name]:
            return True
        active = (s for queue in (scheduler.waiting, scheduler.swapped) for s in queue if not scheduler.is_paused(s))
        if next(active, None) is not None:
            return True
        if any(seq.num_uncomputed_tokens > 1 and not scheduler.is_paused(seq) for seq in scheduler.running):
            return True
        return len(scheduler.running) >= PRESSURE_OCCUPANCY * scheduler.config.max_num_seqs

    def _held_back(self, name: str, out: SchedulerOutput) -> bool:
        """Whether the pressed pool `name` waits for the device: it runs work this step, or blocks come back to
        it a step later (a sequence's last token in flight). One that runs nothing otherwise waits for what no
        step brings: its clients (paused requests hold its slots and blocks; the sequences short of them wait),
        or requests still at the gateway; throughput pools at their floor would not bring its turn sooner, only
        cut every step to one block of their work (16 tokens of rag's 256 a step)."""
        return bool(out.scheduled) or self.schedulers[name].blocks_coming

    def _interactive_budget(self, name: str, so_far: StepFeatures) -> int | None:
        """An interactive pool's tokens: what fits `ITL_AIM` of the tightest `itl_ms` among the interactive
        pools that decode (its own, and another's: a pool's prompt must not stall another's decodes), beside what they put in the step (the pools scheduled before it, and the decodes
        of those after it), at least its decodes and one block of prefill; no limit when no interactive
        pool decodes. No feedback scale applies (the module docstring's step 2)."""
        scheduler = self.schedulers[name]
        if not scheduler.config.enable_chunked_prefill or not self.cost_model.ready:
            return None
        decodes, prefill_context = scheduler.pending_work()
        others = [n for n in self.interactive if n != name and self.schedulers[n].pending_work()[0]]
        if prefill_context is None or not (decodes or others):
            return None
        target = min(self.slos[n].step_seconds for n in others + [name] * bool(decodes)) * ITL_AIM
        for later in self.interactive[self.interactive.index(name) + 1:]:   # their decodes join the step after
            contexts = self.schedulers[later].pending_work()[0]
            so_far = so_far.plus(_budget_features(contexts, None, len(contexts)))
        cap = scheduler.config.max_num_batched_tokens
        floor = min(cap, len(decodes) + scheduler.block_manager.block_size)
        return max(floor, self._fitting_tokens(scheduler, so_far, target, cap))

    def _token_budget(self, name: str, so_far: StepFeatures, target: float | None, *, floor: bool) -> int | None:
        """Tokens the throughput pool `name` may schedule so that the step stays within `target`
        (`floor`: a pressed interactive pool waits for the device, `_held_back`: nothing, unless the step would be
        empty without it)."""
        scheduler = self.schedulers[name]
        if target is None or not scheduler.config.enable_chunked_prefill or not scheduler.num_unfinished:
            return None
        model = self.cost_model
        cap = min(scheduler.config.max_num_batched_tokens, max(COLD_START_TOKENS, 2 * model.max_prefill_seen))
        if floor:
            budget = 0
        elif not model.ready:
            budget = cap
        else:
            before = model.predict(so_far)
            if so_far.num_prefill_tokens or so_far.num_decode_tokens:
                limit = max(target, before + MIN_THROUGHPUT_SHARE * target)
                limit = before + (limit - before) / self.mixed_margin
            else:
                limit = max(target, 2 * before)   # the fixed cost of the step, and as much again of work
            budget = self._fitting_tokens(scheduler, so_far, limit, cap)
            decodes = len(scheduler.pending_work()[0])
            chunk = budget - decodes
            if so_far.num_prefill_tokens + so_far.num_decode_tokens and 0 < chunk < MIN_PREFILL_CHUNK \
                    and chunk < _next_prefill_remaining(scheduler):
                budget = decodes                  # no crumbs: a chunk pays for its whole cached context
        if budget > 0:
            return budget
        block = scheduler.block_manager.block_size
        if not (so_far.num_prefill_tokens or so_far.num_decode_tokens):
            # nothing else would run: a step of nothing never ends the wait, pressed or not (a pressed pool that
            # scheduled nothing cannot start its waiting request now: its credits or sequences may be held by a
            # request that also waits on this pool, and the owed and starved clocks count step time only)
            return block
        if floor:
            return 0
        if self._starved[name] >= STARVATION_SECONDS and self._block_fits(scheduler, so_far, block):
            return block
        return 0

    def _block_fits(self, scheduler: Scheduler, so_far: StepFeatures, block: int) -> bool:
        """Whether the starvation block keeps the step within the `itl_ms` of every interactive pool
        with running requests (the SLO itself, not the scaled target). The SLO wins: a throughput
        pool whose cheapest chunk breaks it (a prefill chunk after a long cached context costs its
        whole context's attention) waits for a step without interactive work."""
        if self._slo_limit is None or not self.cost_model.ready:
            return True
        extra = _budget_features(*scheduler.pending_work(), block)
        before = self.cost_model.predict(so_far)
        return before + (self.cost_model.predict(so_far.plus(extra)) - before) * self.mixed_margin <= self._slo_limit

    def _fitting_tokens(self, scheduler: Scheduler, so_far: StepFeatures, limit: float, cap: int) -> int:
        """The largest token budget in [0, cap] whose predicted step time stays within `limit`: the
        pool's decodes first, then one chunk."""
        decodes, prefill_context = scheduler.pending_work()
        predict = self.cost_model.predict

        def fits(tokens: int) -> bool:
            return predict(so_far.plus(_budget_features(decodes, prefill_context, tokens))) <= limit

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


def _budget_features(decodes: list[int], prefill_context: int | None, tokens: int) -> StepFeatures:
    """What a budget of `tokens` adds to a step (`Scheduler.pending_work`'s decodes first, then one
    prefill chunk after `prefill_context` cached tokens)."""
    extra = StepFeatures()
    for context in decodes[:tokens]:
        extra.add(context, 1, True)
    chunk = tokens - min(tokens, len(decodes))
    if chunk and prefill_context is not None:
        extra.add(prefill_context, chunk, False)
    return extra


def _next_prefill_remaining(scheduler: Scheduler) -> int:
    """Tokens left to prefill of the sequence whose prefill a budget would continue or start
    (the one `Scheduler.pending_work` reports the context of); 0 when none is pending."""
    seq = scheduler.next_prefill()
    return seq.num_uncomputed_tokens if seq is not None else 0
