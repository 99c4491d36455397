"""`DeviceSim`: one device's pools on a virtual clock (the package docstring says what is real and
what is modelled), and the requests it serves (`SimRequest`)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.composer import StepComposer
from engine.config import PoolConfig
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, build_scheduler, commit_step
from engine.sequence import FinishReason, Sequence as Seq
from engine.step_cost import StepTime
from pools.credit_hold import reservation
from pools.credits import CreditLedger
from pools.spiral import SpiralConfig, SpiralDetector

SPIRAL_SAMPLE_SECONDS = 0.25     # how often the gateway feeds the death-spiral detector (gateway.runtime)


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
    """One device: its pools' real schedulers, the real step composer and the gateway's credit
    ledgers, on a virtual clock. Single-threaded; `run` drives it to the end of its requests."""

    def __init__(self, pools: Sequence[PoolConfig], *, block_size: int, max_model_lens: Mapping[str, int],
                 step_time: StepTime, kv_bytes_per_token: int, credits: bool = True, seed: int = 0,
                 spirals: Mapping[str, SpiralConfig] | None = None) -> None:
        self.step_time = step_time
        self.block_size = block_size
        self.schedulers: dict[str, Scheduler] = {}
        first_block = 0
        for pool in pools:
            scheduler = build_scheduler(pool, block_size=block_size, first_block=first_block,
                                        max_model_len=max_model_lens[pool.name],
                                        bytes_per_block=kv_bytes_per_token * block_size,
                                        kv_bytes_per_token=kv_bytes_per_token,
                                        swap_bytes_per_second=step_time.swap_bandwidth)
            self.schedulers[pool.name] = scheduler
            first_block += pool.num_blocks
        self.composer = StepComposer(self.schedulers, {p.name: p.slo for p in pools})
        self.ledgers = {p.name: CreditLedger(p.num_blocks * block_size) for p in pools} if credits else {}
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
        self._rng = random.Random(seed)
        self._requests: dict[str, SimRequest] = {}
        self._seqs: dict[str, Seq] = {}
        self._order = 0

    # --- arrivals and admission ----------------------------------------------------------------
    def arrive(self, request: SimRequest) -> None:
        """A routed request reaches its pool: refused if it can never fit, else queued for credits."""
        scheduler = self.schedulers[request.pool]
        try:
            scheduler.check_fits(request.prompt_len, request.output_len)
        except ValueError as exc:
            request.error = str(exc)
            return
        ids = [self._rng.randrange(1000, 30000) for _ in range(request.prompt_len)]
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0)
        self._seqs[request.request_id] = Seq(
            seq_id=self._order, request_id=request.request_id, index=0, token_ids=ids,
            num_prompt_tokens=request.prompt_len, params=params, max_tokens=request.output_len, priority=0,
            arrival_order=self._order, generator=None, pool=request.pool)
        self._order += 1
        self._requests[request.request_id] = request
        ledger = self.ledgers.get(request.pool)
        if ledger is None:
            self._admit(request)
            return
        need = reservation([request.prompt_len], request.output_len, 1, block_size=self.block_size,
                           max_model_len=scheduler.max_model_len)
        ledger.submit(request.request_id, need)
        self._admit_credited(request.pool)

    def _admit_credited(self, pool: str) -> None:
        for ticket in self.ledgers[pool].admit():
            self._admit(self._requests[ticket.request_id])

    def _admit(self, request: SimRequest) -> None:
        request.admitted = self.clock
        self.schedulers[request.pool].add(self._seqs[request.request_id])

    def _end(self, seq: Seq) -> None:
        request = self._requests.pop(seq.request_id)
        self._seqs.pop(seq.request_id)
        request.num_preemptions = seq.num_preemptions
        if seq.error:
            request.error = seq.error
        if seq.pool in self.ledgers:
            self.ledgers[seq.pool].release(seq.request_id)
            self._admit_credited(seq.pool)

    @property
    def has_work(self) -> bool:
        return any(s.num_unfinished for s in self.schedulers.values())

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step: compose, advance the clock by its modelled time, append a token to every sequence
        that finished its prefill or decoded. False when the schedulers chose nothing."""
        for name, ledger in self.ledgers.items():     # the gateway reports its credit queues to the worker
            self.composer.set_external_waiting(name, ledger.num_queued)
        composed = self.composer.schedule()
        batch: list[ScheduledSeq] = []
        num_swapped_blocks = 0
        for name, out in composed.outputs.items():
            batch.extend(out.scheduled)
            num_swapped_blocks += len(out.swap_out) + len(out.swap_in)
            for seq in out.finished:                       # the pool cannot hold it: ended with an error
                self._end(seq)
        if not batch:
            return False
        sampled = [item.seq for item in batch if item.num_new_tokens == item.seq.num_uncomputed_tokens]
        seconds = self.step_time.seconds(batch, composed.features, len(sampled))
        swap_s = 0.0
        if num_swapped_blocks and self.step_time.swap_bandwidth:
            swap_s = num_swapped_blocks * self.bytes_per_block / self.step_time.swap_bandwidth
            for name, out in composed.outputs.items():
                if out.swap_out or out.swap_in:
                    share = (len(out.swap_out) + len(out.swap_in)) / num_swapped_blocks
                    self.schedulers[name].stats.preempt_seconds += swap_s * share
        self.clock += seconds + swap_s
        self.num_steps += 1
        self.composer.observe(composed, seconds + swap_s, self.clock)
        commit_step(self.schedulers, batch, composed.features.num_prefill_tokens,
                    composed.features.num_decode_tokens, seconds)
        for seq in sampled:
            self.schedulers[seq.pool].stats.num_generated_tokens += 1
            seq.token_ids.append(self._rng.randrange(1000, 30000))
            request = self._requests[seq.request_id]
            if not request.token_times:
                self.composer.observe_first_token(seq.pool, self.clock - request.admitted, self.clock)
            request.token_times.append(self.clock)
            if seq.num_output_tokens >= seq.max_tokens:
                self.schedulers[seq.pool].finish(seq, FinishReason.LENGTH)
                self._end(seq)
        self._trace()
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
            trace.queued.append(self.ledgers[name].num_queued if name in self.ledgers else 0)

    def run(self, requests: Sequence[SimRequest]) -> None:
        """Every request, in arrival order, until each has finished or failed."""
        pending = sorted(requests, key=lambda r: r.arrival)
        i = 0
        while i < len(pending) or self.has_work:
            while i < len(pending) and pending[i].arrival <= self.clock:
                self.arrive(pending[i])
                i += 1
            if self.has_work and self.step():
                continue
            if i == len(pending):
                if self.has_work:
                    raise RuntimeError(f"simulate: the schedulers hold {self._requests.keys()} but chose no "
                                       "work and no request is left to arrive")
                break
            self.clock = max(self.clock, pending[i].arrival)
        for name, scheduler in self.schedulers.items():
            scheduler.check_integrity()
            scheduler.block_manager.check_integrity()
            if name in self.ledgers:
                self.ledgers[name].check_integrity()
