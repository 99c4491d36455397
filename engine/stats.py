"""Typed records the device worker sends the gateway: what it loaded (`WorkerInfo`) and how its pools
are doing (`EngineStats`). Plain dataclasses of numbers, sent as typed MessagePack (`engine.wire`): the gateway
reads attributes, never dict keys with defaults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import LatencySLO
from engine.step_cost import LinearStepTime

# Seconds between the stats a busy worker pushes with its step outputs; the gateway's credit
# reconciliation and death-spiral watch read them on the same cadence (and the simulator models it).
STATS_INTERVAL = 0.25
# Seconds between the stats an idle worker pushes (it steps nothing, so nothing else would): the gateway's
# gauges read from them (a device's busy ratio, the stats' age) stay current while nothing runs.
IDLE_STATS_INTERVAL = 2.0


@dataclass(frozen=True)
class PoolInfo:
    """One pool as the engine allocated it."""

    num_blocks: int
    first_block: int
    max_model_len: int
    max_num_seqs: int


@dataclass(frozen=True)
class WorkerInfo:
    """What a device worker reports once its model is loaded."""

    model_path: str
    device: str                      # e.g. cpu, cuda:0 (rank 0's, with tensor parallelism)
    dtype: str                       # float32 | bfloat16 | float16
    num_blocks: int                  # all pools together (every rank holds this many, of its KV heads)
    block_size: int
    kv_bytes_per_token: int          # S_KV of the whole group (its ranks' together; replicated KV heads count twice)
    pools: dict[str, PoolInfo]
    load_seconds: float
    tensor_parallel_size: int = 1
    pid: int = 0                     # the worker process (rank 0)
    slos: dict[str, LatencySLO] = field(default_factory=dict)   # each interactive pool's SLO, as the engine runs it
    slo_derivations: dict[str, str] = field(default_factory=dict)   # pool -> how its SLO came from the measured step
    load_phases: dict[str, float] = field(default_factory=dict)     # seconds of each phase of load_seconds

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block, all layers."""
        return self.block_size * self.kv_bytes_per_token

    def pool_kv_cache_bytes(self, pool: str) -> int:
        return self.pools[pool].num_blocks * self.block_bytes


@dataclass(frozen=True)
class PoolStats:
    """One pool's scheduler and allocator, at the time the stats were taken. Counters are totals
    since the worker started."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    kv_cache_usage: float            # fraction of the pool's blocks in use
    max_num_seqs: int
    cpu_swap_usage: float            # fraction of the pool's CPU swap blocks in use (0 without swap)
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    preempt_seconds: float = 0.0
    num_prefix_queries: int = 0      # prompt tokens looked up in the prefix cache
    num_prefix_hits: int = 0         # ... and found there
    num_state_loads: int = 0         # a state model's admissions resumed from a kept state (engine.state_cache)
    num_state_saves: int = 0         # ... and the prefixes' states it kept
    num_aborted: int = 0
    num_too_large: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0    # output tokens sampled (a recomputed token is not generated again)
    device_seconds: float = 0.0      # the pool's part of every step's measured time (by its predicted cost)
    # A replica serving gateways over a network (`engine.sessions`): the blocks this gateway's requests
    # hold (None: a local worker, all of them its gateway's), and every gateway's credits together:
    # reserved by requests running, and held (leases, or the reservations over one).
    num_session_blocks: int | None = None
    reserved_credits: int = 0
    held_credits: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_recompute_preemptions + self.num_swap_preemptions

    @property
    def num_preemptions_by_mode(self) -> dict[str, int]:
        """Preemptions by what was done to the victim: `recompute` or `swap` (mode `auto` does either)."""
        return {"recompute": self.num_recompute_preemptions, "swap": self.num_swap_preemptions}


@dataclass(frozen=True)
class StepCounters:
    """The step composer's counters (engine.composer.ComposerStats)."""

    num_steps: int = 0
    num_targeted_steps: int = 0
    num_over_target: int = 0
    num_pressed_steps: int = 0               # throughput pools held to their floor (an interactive pool pressed)
    last_step_seconds: float = 0.0
    last_target_seconds: float | None = None
    target_scales: dict[str, float] = field(default_factory=dict)   # interactive pool -> SLOTracker.scale
    busy_seconds: float = 0.0                # every step's measured time together, since the worker started
    step_model: LinearStepTime | None = None  # the composer's online step-cost fit (None until fitted)


@dataclass(frozen=True)
class EngineStats:
    """Every pool of one device worker, stamped with the wall-clock time (`time.time()`) they were taken."""

    num_requests: int
    pools: dict[str, PoolStats]
    step: StepCounters = field(default_factory=StepCounters)
    taken_at: float = 0.0


class Laps:
    """Records the seconds since the last call under each name called (`lap("weights")`): an engine's
    load phases."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.mark = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name], self.mark = round(now - self.mark, 3), now


@dataclass
class StepStats:
    """What the last step did, for benchmarks and metrics."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_attended: int = 0                   # query-key pairs of the step's attention (the composer's feature)
    num_keys_read: int = 0                  # context positions its sequences read (another of its features)
    num_preempted: int = 0
    # From the step's start, or from the end of the step before where it ran beside it (overlapped steps:
    # queued behind it): a step's share of the time, so that steps' seconds add up to the time they took.
    seconds: float = 0.0
    finished_at: float = 0.0                # perf_counter: when its outputs were read
    target_seconds: float | None = None     # the composer's latency target for the step
    predicted_seconds: float | None = None  # the cost model's prediction (with its margin)
    pressed: list[str] = field(default_factory=list)   # interactive pools that put throughput at its floor
    pool_tokens: dict[str, int] = field(default_factory=dict)   # tokens each pool scheduled
    # Nothing ran, nothing is in flight or being built: every request left is paused or waits for blocks paused
    # requests hold, or the composer held its pool back this step. The worker waits a moment (or for a command).
    stalled: bool = False
    # Host seconds of the step by phase: schedule (composer, block moves), inputs (the batch as tensors),
    # forward (running the model on a CPU; launching it on CUDA), sample (bookkeeping, forks, sampling; on
    # CUDA also the wait for the device, which runs the forward pass meanwhile), outputs (stop checks, text,
    # reports).
    phases: dict[str, float] = field(default_factory=dict)
