"""`DeviceSim`: one replica of a device, its pools on a virtual clock (the package docstring says what
is real and what is modelled), and the requests it serves (`SimRequest`); `ReplicaGroup`: a device's
replicas on one clock and the gateway's side of them (credit queues, placement, arrivals).

A device with `replicas: R` runs R identical copies (`DeviceSim`: one replica's schedulers, step
composer and clock). In front of them, as in the gateway (`pools.credits.queue`), each pool has ONE
`CreditLedger` over R accounts (a replica's account: its blocks x block_size) and one `Placement`:
a request that arrives waits in its pool's fair queue and is admitted on the replica the placement
picks among those where its credits fit (token load; prefix affinity never matches: prompts are
random ids); when a request ends its credits return and the queue is admitted again across
replicas. The placement hears every token as it is generated (`observe`) and every end (`finish`).
With `credits` off (a server without KV credits) a request goes at once to the replica the
placement picks among all.

Time: every replica keeps its own clock (the end of its last step). `run` always steps the replica
furthest behind that has work, and takes the events, arrivals and the ends of requests (credits come
back as the step that ended the request ends), in time order once every replica with work has passed
them (when no replica has work, every clock moves on to the next event): an arrival during the step
that ends a request finds its credits still held, as the gateway does. A request admitted at time t on
a replica starts at that replica's first step boundary at or after t (an idle replica's clock moves on
to t), so none starts before the event that admitted it: its arrival, or the end of a request, on any
replica, that let the queue move. A pool's `max_queue_seconds` is applied at those events too (a wait
that ran out by then fails before the queue is admitted).

Single-threaded; the group owns the arrivals' token ids (one random stream for the device, which
its replicas share for the tokens they sample) and the sequence order across replicas.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.composer import StepComposer
from engine.stats import STATS_INTERVAL
from engine.config import PoolConfig
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, build_scheduler
from engine.sequence import FinishReason, Sequence as Seq
from engine.state_cache import give_snapshots
from engine.step_commit import commit_step
from engine.step_cost import StepTime
from pools.credits.flows import FLOW_CAP
from pools.credits.ledger import CreditLedger, Ticket
from pools.credits.placement import Placement, Work
from pools.credits.queue import reservation
from pools.spiral import SpiralConfig, SpiralDetector

SPIRAL_SAMPLE_SECONDS = STATS_INTERVAL   # how often the gateway feeds the death-spiral detector (gateway.runtime)


@dataclass
class SimRequest:
    """One request of the workload and what happened to it, in simulated seconds from the start."""

    request_id: str
    cls: str
    arrival: float
    prompt_len: int
    output_len: int
    pool: str | None = None
    admitted: float | None = None            # credits granted (the engine sees it)
    replica: int | None = None               # the replica of its device it was admitted on
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.error is None and len(self.token_times) == self.output_len

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.finished else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


@dataclass
class PoolTrace:
    """A pool over simulated time: one sample per step."""

    times: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)      # fraction of the pool's blocks in use
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)         # in the engine (admitted, not yet running)
    queued: list[int] = field(default_factory=list)          # at the gateway, waiting for credits


class DeviceSim:
    """One replica of a device: its pools' real schedulers and the real step composer, on its own
    virtual clock. The gateway's credit ledgers and placement are its `group`'s; built without one
    (`credits`, `seed` then apply) it is a device of one replica with a group of its own, and `run`
    drives it to the end of its requests. Single-threaded."""

    def __init__(self, pools: Sequence[PoolConfig], *, block_size: int, max_model_lens: Mapping[str, int],
                 step_time: StepTime, kv_bytes_per_token: int, credits: bool = True, seed: int = 0,
                 spirals: Mapping[str, SpiralConfig] | None = None, group: ReplicaGroup | None = None,
                 state_model: bool = False) -> None:
        self.step_time = step_time
        self.block_size = block_size
        self.schedulers: dict[str, Scheduler] = {}
        first_block = 0
        for pool in pools:
            scheduler = build_scheduler(pool, block_size=block_size, first_block=first_block,
                                        max_model_len=max_model_lens[pool.name],
                                        bytes_per_block=kv_bytes_per_token * block_size,
                                        kv_bytes_per_token=kv_bytes_per_token,
                                        swap_bytes_per_second=step_time.swap_bandwidth,
                                        swap_latency_seconds=step_time.swap_latency)
            self.schedulers[pool.name] = scheduler
            first_block += pool.num_blocks
        if state_model:   # its prefix caches resume only where they kept a state (or a ring's window), as the engine's
            give_snapshots(self.schedulers.values())
        self.composer = StepComposer(self.schedulers, {p.name: p.slo for p in pools},
                                     min_shares={p.name: p.min_share for p in pools})
        self.traces = {p.name: PoolTrace() for p in pools}
        # The gateway's death-spiral detector, fed every step as the worker's stats would feed it.
        spirals = spirals or {}
        self.spirals = {p.name: SpiralDetector(spirals.get(p.name, SpiralConfig())) for p in pools
                        if spirals.get(p.name, SpiralConfig()).enabled}
        self.spiral_trips: dict[str, list[tuple[float, str]]] = {p.name: [] for p in pools}
        self._next_spiral_sample = 0.0
        self.bytes_per_block = kv_bytes_per_token * block_size
        self.clock = 0.0
        self.num_steps = 0
        if group is None:          # built alone: one replica, with the gateway's side of its own
            group = ReplicaGroup(pools, block_size=block_size, credits=credits, seed=seed)
        self.group = group
        self.replica = group.attach(self)
        self._rng = group.rng
        self._requests: dict[str, SimRequest] = {}       # admitted here, until they end
        self._seqs: dict[str, Seq] = {}
        self._inbox: list[tuple[float, int, str]] = []   # (admitted at, seq_id, request_id): not yet started
        self.stalled = False     # its last step chose nothing: it waits for an admission or an arrival

    # --- admission -----------------------------------------------------------------------------
    def admit(self, request: SimRequest, seq: Seq, at: float) -> None:
        """The gateway admitted `request` here at `at` (simulated s): the engine takes it at this
        replica's first step boundary at or after `at`; an idle replica's clock moves on to `at`."""
        request.replica = self.replica
        self._requests[request.request_id] = request
        self._seqs[request.request_id] = seq
        if at > self.clock and self._busy and not self.stalled:
            bisect.insort(self._inbox, (at, seq.seq_id, request.request_id))
            return
        self.clock = max(self.clock, at)
        self.stalled = False
        self._start(request.request_id)

    def _start(self, request_id: str) -> None:
        request = self._requests[request_id]
        request.admitted = self.clock
        self.schedulers[request.pool].add(self._seqs[request_id])

    def _deliver(self) -> None:
        while self._inbox and self._inbox[0][0] <= self.clock:
            self._start(self._inbox.pop(0)[2])

    def _wake(self) -> bool:
        """Nothing left to step on: move the clock on to the next admission waiting here and start it.
        False when none waits."""
        if not self._inbox:
            return False
        self.clock = max(self.clock, self._inbox[0][0])
        self._deliver()
        return True

    def _end(self, seq: Seq) -> None:
        request = self._requests.pop(seq.request_id)
        self._seqs.pop(seq.request_id)
        request.num_preemptions = seq.num_preemptions
        if seq.error:
            request.error = seq.error
        self.group.ended(seq.pool, seq.request_id, self.clock)

    @property
    def _busy(self) -> bool:
        return any(s.num_unfinished for s in self.schedulers.values())

    @property
    def has_work(self) -> bool:
        return self._busy or bool(self._inbox)

    @property
    def held_requests(self) -> list[str]:
        """The requests admitted here that have not ended."""
        return list(self._requests)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step: compose, advance the clock by its modelled time, append a token to every sequence
        that finished its prefill or decoded. False when the schedulers chose nothing."""
        self._deliver()
        for name, ledger in self.group.ledgers.items():    # the gateway reports its credit queues to the worker
            self.composer.set_external_waiting(name, ledger.num_queued)
        composed = self.composer.schedule()
        batch: list[ScheduledSeq] = []
        num_swapped_blocks = num_copies = 0   # blocks swapped, and the batched copies that move them
        for name, out in composed.outputs.items():
            batch.extend(out.scheduled)
            num_swapped_blocks += len(out.swap_out) + len(out.swap_in)
            num_copies += sum(kind != "copy" for kind, _ in out.moves)
            for seq in out.finished:                       # the pool cannot hold it: ended with an error
                self._end(seq)
        if not batch:
            self.stalled = not self._wake()
            return False
        sampled = [item.seq for item in batch if item.num_new_tokens == item.seq.num_uncomputed_tokens]
        seconds = self.step_time.seconds(batch, composed.features, len(sampled))
        swap_s = 0.0
        if num_swapped_blocks and self.step_time.swap_bandwidth:
            swap_s = num_copies * self.step_time.swap_latency + \
                num_swapped_blocks * self.bytes_per_block / self.step_time.swap_bandwidth
            for name, out in composed.outputs.items():
                if out.swap_out or out.swap_in:
                    share = (len(out.swap_out) + len(out.swap_in)) / num_swapped_blocks
                    self.schedulers[name].stats.preempt_seconds += swap_s * share
        self.clock += seconds + swap_s
        self.num_steps += 1
        self.composer.observe(composed, seconds, self.clock)   # its forward pass, as the engine's (copies before it)
        commit_step(self.schedulers, batch)
        for seq in sampled:
            self.schedulers[seq.pool].stats.num_generated_tokens += 1
            seq.token_ids.append(self._rng.randrange(1000, 30000))
            request = self._requests[seq.request_id]
            if not request.token_times:
                self.composer.observe_first_token(seq.pool, self.clock - request.admitted, self.clock)
            request.token_times.append(self.clock)
            self.group.observe(seq.pool, seq.request_id, 1)
            if seq.num_output_tokens >= seq.max_tokens:
                self.schedulers[seq.pool].finish(seq, FinishReason.LENGTH)
                self._end(seq)
        self._trace()
        if not self._busy:
            self._wake()
        return True

    def _trace(self) -> None:
        if self.spirals and self.clock >= self._next_spiral_sample:
            self._next_spiral_sample = self.clock + SPIRAL_SAMPLE_SECONDS
            for name, detector in self.spirals.items():
                stats = self.schedulers[name].stats
                state = detector.observe(self.clock, stats.num_preemptions, stats.num_generated_tokens)
                if state.changed and state.tripped:
                    self.spiral_trips[name].append((self.clock, state.reason))
        for name, scheduler in self.schedulers.items():
            trace, bm = self.traces[name], scheduler.block_manager
            trace.times.append(self.clock)
            trace.kv_usage.append(1 - bm.num_free_blocks / bm.num_blocks)
            trace.running.append(len(scheduler.running))
            trace.waiting.append(len(scheduler.waiting))
            trace.queued.append(self.group.ledgers[name].num_queued if name in self.group.ledgers else 0)

    def run(self, requests: Sequence[SimRequest]) -> None:
        """Every request, in arrival order, until each has finished or failed (its group's run: with
        more replicas than this one, theirs too)."""
        self.group.run(requests)


class ReplicaGroup:
    """One device's replicas (`attach`ed `DeviceSim`s, built on the same `pools`) and, per pool, the
    gateway's credit queue and placement over them. `arrive` queues a routed request in its pool;
    `run` drives everything. `avg_lens`: each pool's `avg_len` (the placement's cap on the output a
    request is expected to take; a pool left out gets the placement's default). `max_queue`: each pool's
    `max_queue_seconds` (left out or None: it waits however long), applied as the gateway does: a request
    still waiting for credits that long fails (503), and with 0 one that does not fit at once (429)."""

    def __init__(self, pools: Sequence[PoolConfig], *, block_size: int, num_replicas: int = 1,
                 avg_lens: Mapping[str, int] | None = None, credits: bool = True, seed: int = 0,
                 max_queue: Mapping[str, float | None] | None = None) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.pools = tuple(p.name for p in pools)
        self.ledgers = ({p.name: CreditLedger([p.num_blocks * block_size] * num_replicas, block_size=block_size,
                                              max_seqs=p.scheduler.max_num_seqs,
                                              flow_cap=FLOW_CAP if p.slo is not None else None)
                         for p in pools} if credits else {})   # the gateway's (`gateway.admission`)
        self.placements: dict[str, Placement] = {}
        for p in pools:          # the gateway's: as many cached blocks as the pool has
            avg_len = {"avg_len": avg_lens[p.name]} if avg_lens and p.name in avg_lens else {}
            self.placements[p.name] = Placement(num_replicas, block_size, max_cached_blocks=p.num_blocks, **avg_len)
        self.replicas: list[DeviceSim] = []
        self.rng = random.Random(seed)
        self._queued: dict[str, tuple[SimRequest, Seq, Work]] = {}     # waiting for credits
        self.max_queue = dict(max_queue or {})
        self._deadlines: list[tuple[float, str, str]] = []   # heap: (when its wait ends, request id, pool)
        self._releases: list[tuple[float, int, str, str]] = []   # heap: (when it ended, order, pool, request id)
        self._num_ended = 0
        self._order = 0

    def attach(self, replica: DeviceSim) -> int:
        """`replica` is the group's next replica; returns its index."""
        if len(self.replicas) == self.num_replicas:
            raise ValueError(f"replica: the group has its {self.num_replicas} replica(s) already")
        self.replicas.append(replica)
        return len(self.replicas) - 1

    # --- the gateway's side ----------------------------------------------------------------------
    def arrive(self, request: SimRequest) -> None:
        """A routed request reaches its pool: refused if it can never fit, else queued for credits (or,
        without credits, sent at once to the replica the placement picks)."""
        scheduler = self.replicas[0].schedulers[request.pool]       # every replica's pools are alike
        try:
            scheduler.check_fits(request.prompt_len, request.output_len)
        except ValueError as exc:
            request.error = str(exc)
            return
        ids = [self.rng.randrange(1000, 30000) for _ in range(request.prompt_len)]
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0)
        seq = Seq(seq_id=self._order, request_id=request.request_id, index=0, token_ids=ids,
                  num_prompt_tokens=request.prompt_len, params=params, max_tokens=request.output_len, priority=0,
                  arrival_order=self._order, generator=None, pool=request.pool)
        self._order += 1
        placement = self.placements[request.pool]
        work = placement.work([ids], request.output_len, 1, scheduler.max_model_len)
        ledger = self.ledgers.get(request.pool)
        if ledger is None:
            free = [r.schedulers[request.pool].block_manager.num_free_blocks * self.block_size for r in self.replicas]
            replica = placement.choose(work, list(range(self.num_replicas)), free)
            placement.start(request.request_id, replica, work)
            self.replicas[replica].admit(request, seq, request.arrival)
            return
        self._queued[request.request_id] = (request, seq, work)
        ledger.submit(request.request_id, reservation([request.prompt_len], request.output_len, 1,
                                                      block_size=self.block_size,
                                                      max_model_len=scheduler.max_model_len))
        self._admit(request.pool, request.arrival)
        limit = self.max_queue.get(request.pool)
        if limit == 0 and request.request_id in self._queued:
            self._refuse(request.pool, request.request_id, "429: the pool is full (max_queue_seconds 0 refuses "
                         "what does not fit at once)")
            self._admit(request.pool, request.arrival)   # the ones behind it may fit now
        elif limit is not None and request.request_id in self._queued:
            heapq.heappush(self._deadlines, (request.arrival + limit, request.request_id, request.pool))

    def _expire(self, now: float) -> set[str]:
        """The requests that waited for credits past their pool's max_queue_seconds by `now` fail, as the
        gateway answers them 503; returns the pools whose queues they left."""
        pools = set()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id, pool = heapq.heappop(self._deadlines)
            if request_id in self._queued:
                self._refuse(pool, request_id, f"503: waited max_queue_seconds ({self.max_queue[pool]:g} s) for "
                                               "KV credits")
                pools.add(pool)
        return pools

    def _refuse(self, pool: str, request_id: str, why: str) -> None:
        request, _, _ = self._queued.pop(request_id)
        self.ledgers[pool].cancel(request_id)
        request.error = why

    def _admit(self, pool: str, at: float) -> None:
        """Whoever now fits in `pool`'s queue, each on the replica placement picks, at time `at`; those whose
        wait ran out by then fail first (and the queues they leave are admitted again too)."""
        for name in self._expire(at) | {pool}:
            self._admit_now(name, at)

    def _admit_now(self, pool: str, at: float) -> None:
        for ticket in self.ledgers[pool].admit(lambda ticket, fitting: self._place(pool, ticket, fitting)):
            request, seq, _ = self._queued.pop(ticket.request_id)
            self.replicas[ticket.replica].admit(request, seq, at)

    def _place(self, pool: str, ticket: Ticket, fitting: list[int]) -> int | None:
        """The ledger's choice of replica, as the gateway's (`pools.credits.queue.CreditQueue._place`)."""
        work = self._queued[ticket.request_id][2]
        ledger = self.ledgers[pool]
        free = [a.free for a in ledger.accounts]
        replica = self.placements[pool].choose(work, fitting, free, ledger.waiting(ticket))
        if replica is not None:
            self.placements[pool].start(ticket.request_id, replica, work)
        return replica

    def observe(self, pool: str, request_id: str, num_tokens: int) -> None:
        """A replica generated `num_tokens` more tokens of the request (its load goes down)."""
        self.placements[pool].observe(request_id, num_tokens)

    def ended(self, pool: str, request_id: str, at: float) -> None:
        """A replica's request ended at `at` (finished or failed): its credits return at `at`, in time
        order with the arrivals and the other replicas' steps (`run`), so an arrival during the step
        that ended it still finds them held."""
        self._num_ended += 1
        heapq.heappush(self._releases, (at, self._num_ended, pool, request_id))

    def _release(self, at: float, pool: str, request_id: str) -> None:
        """`ended`'s request gives its credits back: the queue is admitted again across the replicas."""
        self.placements[pool].finish(request_id)
        if pool in self.ledgers:
            self.ledgers[pool].release(request_id)
            self._admit(pool, at)

    def _happen(self, pending: Sequence[SimRequest], i: int, now: float) -> tuple[int, bool]:
        """The arrivals (from `pending[i]`) and the ends of requests at or before `now`, in time order (an
        end before an arrival at the same time); the index of the next arrival, and whether any happened."""
        first, num_releases = i, len(self._releases)
        while True:
            arrives = i < len(pending) and pending[i].arrival <= now
            if self._releases and self._releases[0][0] <= now and (
                    not arrives or self._releases[0][0] <= pending[i].arrival):
                at, _, pool, request_id = heapq.heappop(self._releases)
                self._release(at, pool, request_id)
            elif arrives:
                self.arrive(pending[i])
                i += 1
            else:
                return i, i != first or len(self._releases) != num_releases

    # --- the clock -------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> None:
        """Every request, in arrival order, until each has finished or failed (the module docstring
        says in which order the replicas step)."""
        if len(self.replicas) != self.num_replicas:
            raise ValueError(f"replicas: {len(self.replicas)} attached, the group has {self.num_replicas}")
        pending = sorted(requests, key=lambda r: r.arrival)
        i = 0
        while True:
            busy = [r for r in self.replicas if r.has_work and not r.stalled]
            if busy:
                now = min(r.clock for r in busy)
            elif i < len(pending) or self._releases:
                now = min([r.arrival for r in pending[i:i + 1]] + [at for at, *_ in self._releases[:1]])
                for r in self.replicas:
                    r.clock = max(r.clock, now)
            else:
                break
            i, happened = self._happen(pending, i, now)
            if happened:
                for r in self.replicas:
                    r.stalled = False
                continue
            for pool in self._expire(now):
                self._admit_now(pool, now)   # the ones behind those that failed may fit now
            min(busy, key=lambda r: (r.clock, r.replica)).step()
        if any(r.has_work for r in self.replicas):
            held = [rid for r in self.replicas for rid in r.held_requests]
            raise RuntimeError(f"simulate: the schedulers hold {held} but chose no work and no request is left "
                               "to arrive")
        self.check_integrity()

    def check_integrity(self) -> None:
        """Every replica's schedulers and blocks, every pool's credits and placement load; raises with the counts."""
        for replica in self.replicas:
            for scheduler in replica.schedulers.values():
                scheduler.check_integrity()
                scheduler.block_manager.check_integrity()
        for ledger in self.ledgers.values():
            ledger.check_integrity()
        for placement in self.placements.values():
            placement.check_integrity()
