"""`cliffguard simulate`: the real schedulers on a modelled device, to plan pools without the device.

What runs is our own scheduling code, not a model of it: each device of a pool file gets the
schedulers and block managers that `engine.scheduler.build_scheduler` makes for the engine, the same
`StepComposer` decides every step across the device's pools, and the gateway's `CreditLedger` holds
requests until their KV credits fit (as `serve` does by default). What is modelled is only what a
step costs: tokens are made up (no tensors, no model), and each step advances a virtual clock by the
time a `StepTime` model gives for the work the schedulers chose, plus the swap copies they asked for.

Step-time models:
- `RooflineStepTime` for a GPU preset (`PRESETS`: H100, H200, A100): per GPU of a tensor-parallel
  group, a fixed per-step overhead plus the larger of compute (2 FLOPs per weight per token, attention
  4 FLOPs per query-key pair per head dimension, the LM head for sampled tokens, at a fraction of peak)
  and memory traffic (all weights once per step, the K/V every token attends to, the K/V written, at a
  fraction of peak bandwidth), plus two ring all-reduces per layer over the interconnect when TP > 1.
  The efficiencies and the overhead are assumptions written in the preset, not measurements.
- `LinearStepTime`: `t = a + b * prefill_tokens + c * decode_tokens + d * attended / 1024`, the step
  composer's own cost model, with coefficients measured on a real device.

Requests come from a workload (`pools.workload`, the classes `cliffguard bench serve` sends), are
routed by prompt length exactly as the gateway routes them (the first local pool of the config whose
route admits the count), and generate exactly their `output_len` tokens (ignore_eos). Per class the
result has TTFT, ITL and e2e percentiles and throughput; per pool preemptions, swap traffic and KV
usage over time.

Not modelled: the chat template's tokens (prompt_len is the count the engine sees), prefix sharing
between requests (prompts are random ids), tenants and batch lines (one tenant, interactive), the
gateway's own latency, and a step's variance (the model is deterministic).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.composer import StepComposer, StepFeatures, nonnegative_lstsq
from engine.config import ModelConfig, PoolConfig
from engine.scheduler import ScheduledSeq, Scheduler, build_scheduler, observe_prefill_step
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, Sequence as Seq
from pools.admission import reservation
from pools.capacity import CapacityPlan, DevicePlan
from pools.credits import CreditLedger
from pools.spec import CliffguardConfig, PoolSpec, RouteSpec, SpecError
from pools.spiral import SpiralConfig, SpiralDetector
from pools.workload import WorkloadClass, class_arrivals, latency_stats

GiB = 1 << 30
SPIRAL_SAMPLE_SECONDS = 0.25     # how often the gateway feeds the death-spiral detector (gateway.runtime)


@dataclass(frozen=True)
class DevicePreset:
    """One GPU as the roofline model sees it. Peaks are the vendor's dense bf16 figures; the
    efficiencies and the per-step overhead are assumptions about what a serving engine reaches."""

    name: str
    peak_flops: float                 # FLOP/s, dense bf16, per GPU
    memory_bandwidth: float           # B/s, HBM, per GPU
    swap_bandwidth: float             # B/s, device <-> host memory (PCIe)
    interconnect_bandwidth: float     # B/s per GPU and direction (NVLink), for tensor-parallel all-reduce
    memory_bytes: int                 # per GPU
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.003    # scheduling, sampling, launches: per step, whatever its size
    allreduce_latency_s: float = 10e-6


# Vendor datasheets: H100 SXM5 989 TFLOP/s bf16 dense, 3.35 TB/s, NVLink 900 GB/s (both directions),
# PCIe Gen5; H200 SXM the same compute, 4.8 TB/s, 141 GB; A100 SXM4 80GB 312 TFLOP/s, 2.04 TB/s,
# NVLink 600 GB/s, PCIe Gen4. Host copies at about 55 GB/s (Gen5) and 25 GB/s (Gen4) pinned.
PRESETS = {
    "h100": DevicePreset("h100", 989e12, 3.35e12, 55e9, 450e9, 80 * GiB),
    "h200": DevicePreset("h200", 989e12, 4.8e12, 55e9, 450e9, 141 * 10**9),
    "a100": DevicePreset("a100", 312e12, 2.04e12, 25e9, 300e9, 80 * GiB),
}


class StepTime(Protocol):
    """Seconds one step takes for the work the schedulers chose."""

    swap_bandwidth: float | None

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float: ...


class RooflineStepTime:
    """A GPU preset's roofline for one model on a tensor-parallel group of `tp` GPUs (module docstring)."""

    def __init__(self, preset: DevicePreset, model: ModelConfig, dtype_bytes: int, tp: int = 1) -> None:
        self.preset = preset
        self.model = model
        self.dtype_bytes = dtype_bytes
        self.tp = tp
        self.swap_bandwidth = preset.swap_bandwidth
        self.weights_bytes = model.num_params() * dtype_bytes
        self.matmul_params = model.num_params() - model.vocab_size * model.hidden_size * (
            1 if model.tie_word_embeddings else 2)          # the embedding lookup is no matmul; the head is apart
        self.kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float:
        m, p = self.model, self.preset
        tokens = features.num_prefill_tokens + features.num_decode_tokens
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * features.num_attended
        flops = 2 * self.matmul_params * tokens + attention + 2 * m.hidden_size * m.vocab_size * num_sampled
        kv_read = sum(item.seq.num_computed_tokens for item in batch) * self.kv_bytes_per_token
        traffic = self.weights_bytes + kv_read + tokens * self.kv_bytes_per_token
        compute_s = flops / self.tp / (p.peak_flops * p.flops_efficiency)
        memory_s = traffic / self.tp / (p.memory_bandwidth * p.bandwidth_efficiency)
        allreduce_s = 0.0
        if self.tp > 1:
            size = tokens * m.hidden_size * self.dtype_bytes
            per = 2 * (self.tp - 1) / self.tp * size / p.interconnect_bandwidth + p.allreduce_latency_s
            allreduce_s = 2 * m.num_layers * per
        return p.step_overhead_s + max(compute_s, memory_s) + allreduce_s


@dataclass(frozen=True)
class LinearStepTime:
    """`t = a + b * prefill + c * decode + d * attended / 1024` (seconds, per token, per 1024 pairs):
    the step composer's model, with coefficients measured on a real device."""

    a: float
    b: float
    c: float
    d: float
    swap_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: must be a number >= 0, got {value!r}")

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float:
        return (self.a + self.b * features.num_prefill_tokens + self.c * features.num_decode_tokens
                + self.d * features.num_attended / 1024)

    def coefficients(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d}

    def describe(self) -> str:
        """The model in milliseconds, for a report line."""
        return (f"t = {self.a * 1e3:.2f} ms + {self.b * 1e3:.4f} ms/prefill token + {self.c * 1e3:.4f} ms/decode "
                f"token + {self.d * 1e3:.4f} ms/1024 attended")


def fit_linear(samples: Sequence[tuple[StepFeatures, float]], *, swap_bandwidth: float | None = None,
               skip: int = 0) -> LinearStepTime:
    """`LinearStepTime` fitted (least squares, coefficients >= 0, as the composer fits) to measured
    steps, leaving out the first `skip` (warm-up)."""
    used = list(samples)[skip:]
    if len(used) < 8:
        raise ValueError(f"calibration: {len(used)} measured steps are too few to fit 4 coefficients")
    x = np.stack([features.vector() for features, _ in used])
    a, b, c, d = (float(v) for v in nonnegative_lstsq(x, np.array([seconds for _, seconds in used])))
    return LinearStepTime(a, b, c, d, swap_bandwidth=swap_bandwidth)


# (prompt tokens, output tokens, how many at once): prefill chunks of growing length, then decode
# batches of growing size and context, then long prompts beside running decodes.
CALIBRATION_PHASES = (
    ((64, 1, 1), (256, 1, 1), (1024, 1, 1), (2048, 1, 1), (512, 1, 4)),
    ((32, 24, 1), (32, 24, 4), (128, 24, 16), (512, 24, 16), (64, 24, 48)),
    ((96, 48, 16), (1536, 4, 2)),
)


def calibrate(engine: Any, *, pool: str | None = None, seed: int = 0,
              phases: Sequence[Sequence[tuple[int, int, int]]] = CALIBRATION_PHASES,
              ) -> tuple[LinearStepTime, list[tuple[StepFeatures, float]]]:
    """Measure a real engine (`engine.llm_engine.LLMEngine`) on this machine: run each phase's requests
    (random prompt ids, `ignore_eos`) to the end, record every step's features and seconds, and fit.
    Requests go to `pool` (default: the engine's largest). Returns the model and the samples."""
    from engine.sampling import SamplingParams as Params

    rng = random.Random(seed)
    names = list(engine.schedulers)
    pool = pool or max(names, key=lambda n: engine.schedulers[n].block_manager.num_blocks)
    vocab = engine.model_config.vocab_size
    samples: list[tuple[StepFeatures, float]] = []
    max_model_len = engine.schedulers[pool].max_model_len
    n = 0
    for phase in phases:
        for prompt_len, output_len, count in phase:
            prompt_len = min(prompt_len, max_model_len - output_len)
            for _ in range(count):
                ids = [rng.randrange(100, vocab) for _ in range(prompt_len)]
                engine.add_request(f"calibration-{n}", ids, Params(max_tokens=output_len, ignore_eos=True,
                                                                    temperature=0), pool=pool)
                n += 1
        while engine.has_unfinished_requests():
            engine.step()
            s = engine.last_step
            if s.seconds > 0 and s.num_prefill_tokens + s.num_decode_tokens:
                samples.append((StepFeatures(s.num_prefill_tokens, s.num_decode_tokens, s.num_attended), s.seconds))
    return fit_linear(samples, skip=2), samples


def read_step_trace(path: str | Path, *, skip: int = 2) -> list[tuple[StepFeatures, float]]:
    """The steps of a served run, from the device worker's `CLIFFGUARD_STEP_TRACE` file (engine/worker.py):
    each step's features and its `cycle_seconds` (the worker loop's whole turn: commands, the step, its
    outputs sent), which is what a step costs while the gateway, the clients and the worker share the
    machine. Lines without `cycle_seconds` (older traces) use `seconds`. The first `skip` steps of the
    file (kernels warming) are left out. ValueError naming the file and line for anything malformed."""
    import json

    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"--from-trace: no such file {path}") from None
    samples: list[tuple[StepFeatures, float]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
            features = StepFeatures(int(step["num_prefill_tokens"]), int(step["num_decode_tokens"]),
                                    int(step.get("num_attended", 0)))
            seconds = float(step["cycle_seconds"] if "cycle_seconds" in step else step["seconds"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--from-trace: {path} line {n} is not a step record ({type(exc).__name__}: {exc})"
                             ) from None
        if seconds > 0 and features.num_prefill_tokens + features.num_decode_tokens:
            samples.append((features, seconds))
    return samples[skip:]


def write_step_model(path: str | Path, model: LinearStepTime, *, device: str, model_name: str,
                     num_steps: int) -> None:
    """A calibration file: the coefficients and where they were measured."""
    import datetime
    import json
    import platform

    import torch

    Path(path).write_text(json.dumps({
        "step_model": "linear", **model.coefficients(),
        "device": device, "model": model_name, "num_steps": num_steps, "machine": platform.node(),
        "cpu_threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}, indent=2) + "\n")


def read_step_model(path: str | Path) -> LinearStepTime:
    """A calibration file written by `write_step_model`; ValueError naming the file otherwise."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--step-model: no such file {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--step-model: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("step_model") != "linear":
        raise ValueError(f"--step-model: {path} is not a calibration file (no \"step_model\": \"linear\")")
    try:
        return LinearStepTime(*(data[k] for k in ("a", "b", "c", "d")))
    except KeyError as exc:
        raise ValueError(f"--step-model: {path} lacks {exc.args[0]!r}") from None


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
        observe_prefill_step(self.schedulers.values(), composed.features.num_prefill_tokens,
                             composed.features.num_decode_tokens, seconds)
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            scheduler = self.schedulers[seq.pool]
            scheduler.stats.num_computed_tokens += item.num_new_tokens
            scheduler.block_manager.register_computed(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        for seq in sampled:
            self.schedulers[seq.pool].stats.num_generated_tokens += 1
            seq.token_ids.append(self._rng.randrange(1000, 30000))
            request = self._requests[seq.request_id]
            if not request.token_times:
                self.composer.observe_first_token(seq.pool, self.clock - request.admitted)
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


# --- a whole configuration --------------------------------------------------------------------------

@dataclass
class SimulationResult:
    requests: list[SimRequest]
    pools: dict[str, dict[str, Any]]
    traces: dict[str, PoolTrace]
    simulated_seconds: float
    wall_seconds: float
    num_steps: int


def route(config: CliffguardConfig, plan: CapacityPlan, prompt_len: int) -> str | None:
    """The pool the gateway would route a prompt of `prompt_len` tokens to (first local pool in config
    order whose route admits it; one model per configuration here), or None."""
    for spec in config.pools:
        if spec.name in plan.pools and spec.route.admits(prompt_len, plan.pools[spec.name].max_model_len):
            return spec.name
    return None


def make_requests(classes: tuple[WorkloadClass, ...], request_rate: float, *, duration: float,
                  burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """The workload's requests with their lengths drawn as `bench serve` draws them."""
    requests = []
    rng = random.Random(seed)
    for n, (t, _, cls) in enumerate(class_arrivals(classes, request_rate, burstiness=burstiness,
                                                   duration=duration, seed=seed)):
        requests.append(SimRequest(f"r{n}", cls.name, t, cls.prompt_len.sample(rng), cls.output_len.sample(rng)))
    return requests


def simulate(config: CliffguardConfig, plan: CapacityPlan, model_configs: Mapping[str, ModelConfig],
             requests: list[SimRequest], step_times: Mapping[str, StepTime], *, credits: bool = True,
             seed: int = 0) -> SimulationResult:
    """Route `requests` and run every planned device on its step-time model (`step_times[device]`)."""
    started = time.perf_counter()
    if plan.upstream_pools:
        raise SpecError(f"pools: {', '.join(plan.upstream_pools)} are remote upstreams; simulate plans local "
                        "pools only")
    for request in requests:
        request.pool = route(config, plan, request.prompt_len)
        if request.pool is None:
            request.error = f"no pool takes a prompt of {request.prompt_len} tokens"
    sims: dict[str, DeviceSim] = {}
    for dplan in plan.devices.values():
        sims[dplan.name] = _device_sim(config, plan, dplan, model_configs, step_times[dplan.name], credits, seed)
        sims[dplan.name].run([r for r in requests if r.pool in dplan.pools])
    pools, traces = {}, {}
    for sim in sims.values():
        for name, scheduler in sim.schedulers.items():
            stats = scheduler.stats
            pools[name] = {"num_blocks": scheduler.block_manager.num_blocks,
                           "max_num_seqs": scheduler.config.max_num_seqs,
                           "preemption_mode": scheduler.config.preemption_mode,
                           "preemptions": stats.num_preemptions,
                           "recompute_preemptions": stats.num_recompute_preemptions,
                           "swap_preemptions": stats.num_swap_preemptions,
                           "recomputed_tokens": stats.num_recomputed_tokens,
                           "swapped_blocks": stats.num_swapped_out_blocks + stats.num_swapped_in_blocks,
                           "computed_tokens": stats.num_computed_tokens,
                           "generated_tokens": stats.num_generated_tokens,
                           "death_spirals": [{"at_s": t, "reason": why} for t, why in sim.spiral_trips[name]]}
            traces[name] = sim.traces[name]
    return SimulationResult(requests, pools, traces,
                            simulated_seconds=max((s.clock for s in sims.values()), default=0.0),
                            wall_seconds=time.perf_counter() - started,
                            num_steps=sum(s.num_steps for s in sims.values()))


def _device_sim(config: CliffguardConfig, plan: CapacityPlan, dplan: DevicePlan,
                model_configs: Mapping[str, ModelConfig], step_time: StepTime, credits: bool,
                seed: int) -> DeviceSim:
    pools, lens, spirals = [], {}, {}
    for name in dplan.pools:
        pplan = plan.pools[name]
        spirals[name] = pplan.spec.death_spiral
        scheduler = pplan.spec.scheduler_config(pplan.max_num_seqs, pplan.max_model_len)
        pools.append(PoolConfig(name=name, num_blocks=pplan.num_blocks, scheduler=scheduler, slo=pplan.spec.slo))
        lens[name] = pplan.max_model_len
    return DeviceSim(pools, block_size=dplan.block_size, max_model_lens=lens, step_time=step_time,
                     kv_bytes_per_token=dplan.kv_bytes_per_token_per_device, credits=credits, seed=seed,
                     spirals=spirals)


def shared_layout(config: CliffguardConfig, plan: CapacityPlan) -> CliffguardConfig:
    """The same devices with each device's local pools merged into one pool named `shared` that takes
    every prompt: the sum of their KV, the sum of their planned `max_num_seqs` (so the shared pool
    runs as many sequences as the split ones together), the largest `max_model_len` and
    `max_num_batched_tokens`, the first pool's other settings (preemption, block size, prefix cache)
    and no SLO. What one server without pools would be, planned with the same numbers."""
    pools: list[PoolSpec] = []
    for dplan in plan.devices.values():
        members = [plan.pools[name] for name in dplan.pools]
        first = members[0].spec
        share = sum(p.kv_cache_bytes_per_device for p in members) / dplan.kv_space_bytes_per_device
        pools.append(dataclasses.replace(
            first, name="shared" if len(plan.devices) == 1 else f"shared-{dplan.name}", route=RouteSpec(),
            kv_share=min(1.0, share), kv_cache_bytes=None, max_num_seqs=sum(p.max_num_seqs for p in members),
            max_model_len=max(p.max_model_len for p in members),
            max_num_batched_tokens=max(p.spec.max_num_batched_tokens for p in members), slo=None,
            slo_source=None, avg_len=first.avg_len))
    return dataclasses.replace(config, pools=tuple(pools))


# --- the report -------------------------------------------------------------------------------------

def _time_weighted(times: list[float], values: list[float]) -> float | None:
    """Mean of a step-sampled series, each sample weighted by the time to the next one."""
    if len(times) < 2:
        return values[0] if values else None
    weights = np.diff(times)
    return float(np.average(values[:-1], weights=weights)) if weights.sum() > 0 else float(np.mean(values))


def summarize(result: SimulationResult) -> dict[str, Any]:
    """Per class: counts, TTFT / ITL / e2e percentiles (seconds), output tokens/s and requests/s over
    the simulated run; per pool: preemptions, swap, KV usage (time-weighted mean and max), queues."""
    span = result.simulated_seconds or 1.0
    classes: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.cls for r in result.requests):
        reqs = [r for r in result.requests if r.cls == name]
        done = [r for r in reqs if r.finished]
        classes[name] = {
            "requests": len(reqs), "finished": len(done), "errors": sum(r.error is not None for r in reqs),
            "ttft": latency_stats([r.ttft for r in done]),
            "itl": latency_stats([gap for r in done for gap in r.itls]),
            "e2e": latency_stats([r.e2e for r in done]),
            "preempted_requests": sum(r.num_preemptions > 0 for r in reqs),
            "output_tokens_per_s": sum(r.output_len for r in done) / span,
            "requests_per_s": len(done) / span,
        }
    pools = {}
    for name, stats in result.pools.items():
        trace = result.traces[name]
        pools[name] = dict(stats, kv_usage_mean=_time_weighted(trace.times, trace.kv_usage),
                           kv_usage_max=max(trace.kv_usage, default=None),
                           max_running=max(trace.running, default=0), max_waiting=max(trace.waiting, default=0),
                           max_queued=max(trace.queued, default=0),
                           preemptions_per_s=stats["preemptions"] / span)
    errors = sorted({r.error for r in result.requests if r.error})
    return {"classes": classes, "pools": pools, "errors": errors[:5],
            "simulated_seconds": result.simulated_seconds, "steps": result.num_steps,
            "wall_seconds": result.wall_seconds}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _spiral(trips: list[dict[str, Any]]) -> str:
    return f"{trips[0]['at_s']:.0f} s" if trips else "-"


def format_summary(summary: dict[str, Any]) -> str:
    rows = [f"{'class':<10}{'done':>7}{'err':>5}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
            f"{'e2e p50':>9}{'p99':>8}{'tok/s':>9}{'preempted':>11}   (ms)"]
    for name, c in summary["classes"].items():
        rows.append(f"{name:<10}{c['finished']:>7}{c['errors']:>5}{_ms(c['ttft']['p50']):>10}"
                    f"{_ms(c['ttft']['p99']):>8}{_ms(c['itl']['p50']):>9}{_ms(c['itl']['p99']):>8}"
                    f"{_ms(c['e2e']['p50']):>9}{_ms(c['e2e']['p99']):>8}{c['output_tokens_per_s']:>9.0f}"
                    f"{c['preempted_requests']:>11}")
    rows.append("")
    rows.append(f"{'pool':<10}{'blocks':>8}{'seqs':>6}{'mode':>11}{'preempt':>9}{'/s':>7}{'KV mean':>9}"
                f"{'KV max':>8}{'run max':>9}{'wait max':>10}{'queued max':>12}{'spiral':>9}")
    for name, p in summary["pools"].items():
        mean = "-" if p["kv_usage_mean"] is None else f"{p['kv_usage_mean']:.0%}"
        peak = "-" if p["kv_usage_max"] is None else f"{p['kv_usage_max']:.0%}"
        rows.append(f"{name:<10}{p['num_blocks']:>8}{p['max_num_seqs']:>6}{p['preemption_mode']:>11}"
                    f"{p['preemptions']:>9}{p['preemptions_per_s']:>7.2f}{mean:>9}{peak:>8}{p['max_running']:>9}"
                    f"{p['max_waiting']:>10}{p['max_queued']:>12}{_spiral(p['death_spirals']):>9}")
    rows.append(f"\nsimulated {summary['simulated_seconds']:.1f} s in {summary['steps']} steps; "
                f"{summary['wall_seconds']:.1f} s of wall time")
    rows.extend(f"pool {name}: at {t['at_s']:.1f} s: {t['reason']}" for name, p in summary["pools"].items()
                for t in p["death_spirals"][:1])
    rows.extend(f"error: {e}" for e in summary["errors"])
    return "\n".join(rows)


# --- a sweep over request rates: the knee -------------------------------------------------------------

def sweep(layouts: Mapping[str, tuple[CliffguardConfig, CapacityPlan]], model_configs: Mapping[str, ModelConfig],
          classes: tuple[WorkloadClass, ...], rates: Sequence[float], step_times: Mapping[str, StepTime], *,
          duration: float, burstiness: float = 1.0, credits: bool = True, seed: int = 0) -> list[dict[str, Any]]:
    """`summarize` of every (layout, rate), same arrivals for every layout at one rate. Step-time models
    are per device name; a layout's devices are the config's."""
    rows = []
    for rate in rates:
        for name, (config, plan) in layouts.items():
            requests = make_requests(classes, rate, duration=duration, burstiness=burstiness, seed=seed)
            result = simulate(config, plan, model_configs, requests, step_times, credits=credits, seed=seed)
            rows.append({"layout": name, "rate": rate, **summarize(result)})
    return rows


def plot_knee(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """p99 TTFT (log scale) against the request rate, one line per (layout, class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = ["-", "--", ":", "-."]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    for li, layout in enumerate(layouts):
        mine = [r for r in rows if r["layout"] == layout]
        for cls in dict.fromkeys(c for r in mine for c in r["classes"]):
            points = [(r["rate"], r["classes"][cls]["ttft"]["p99"]) for r in mine
                      if cls in r["classes"] and r["classes"][cls]["ttft"]["p99"] is not None]
            if points:
                ax.plot(*zip(*points), styles[li % len(styles)], marker="o", label=f"{layout}: {cls}")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title(title or "simulated knee: p99 TTFT vs request rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_sweep(rows: Sequence[dict[str, Any]]) -> str:
    classes = list(dict.fromkeys(c for r in rows for c in r["classes"]))
    head = f"{'rate':>6}  {'layout':<8}" + "".join(f"{c + ' TTFT p50/p99 (ms)':>28}" for c in classes)
    lines = [head + f"{'preempt/s':>11}"]
    for r in rows:
        cells = []
        for c in classes:
            t = r["classes"].get(c, {}).get("ttft", {})
            cells.append(f"{_ms(t.get('p50')) + ' / ' + _ms(t.get('p99')):>28}")
        preempt = sum(p["preemptions_per_s"] for p in r["pools"].values())
        lines.append(f"{r['rate']:>6g}  {r['layout']:<8}" + "".join(cells) + f"{preempt:>11.2f}")
    return "\n".join(lines)


# --- a recommendation for a target SLO ------------------------------------------------------------------

SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
BUDGETS = (512, 1024, 2048, 4096, 8192)


def recommend(config: CliffguardConfig, model_configs: Mapping[str, ModelConfig], classes: tuple[WorkloadClass, ...],
              rate: float, step_times: Mapping[str, StepTime], *, ttft_p99: float, itl_p99: float | None = None,
              duration: float, vram_bytes: int | None = None, shares: Sequence[float] = SHARES,
              budgets: Sequence[int] = BUDGETS, credits: bool = True, seed: int = 0) -> dict[str, Any]:
    """Try each split of one device's KV between its two pools (`kv_share` of the first, the rest to
    the second) and each `max_num_batched_tokens` of the second, at `rate`; a candidate meets the SLO
    when every class's p99 TTFT (and p99 ITL, if given) is within it and nothing failed. The
    recommendation is the one that meets it with the most output tokens/s (ties: lower worst p99 TTFT).
    Returns every candidate's figures and the choice (None when none meets the SLO)."""
    from pools.capacity import plan_capacity

    local = [p for p in config.pools if not p.is_upstream]
    if len(local) != 2 or local[0].device != local[1].device:
        raise SpecError("pools: --recommend splits one device between exactly two local pools; this config has "
                        f"{len(local)} local pool(s)" + ("" if len(local) != 2 else " on different devices"))
    first, second = local
    candidates = []
    for share in shares:
        for budget in budgets:
            split = {first.name: dataclasses.replace(first, kv_share=share, kv_cache_bytes=None),
                     second.name: dataclasses.replace(second, kv_share=round(1 - share, 6), kv_cache_bytes=None,
                                                      max_num_batched_tokens=budget)}
            candidate = dataclasses.replace(config, pools=tuple(split.get(p.name, p) for p in config.pools))
            try:
                plan = plan_capacity(candidate, model_configs, vram_bytes=vram_bytes)
            except SpecError as exc:                     # e.g. too few blocks for max_model_len
                candidates.append({"kv_share": share, "max_num_batched_tokens": budget, "error": str(exc)})
                continue
            requests = make_requests(classes, rate, duration=duration, seed=seed)
            summary = summarize(simulate(candidate, plan, model_configs, requests, step_times, credits=credits,
                                         seed=seed))
            worst_ttft = max((c["ttft"]["p99"] or float("inf")) for c in summary["classes"].values())
            worst_itl = max((c["itl"]["p99"] or 0.0) for c in summary["classes"].values())
            failed = sum(c["errors"] for c in summary["classes"].values())
            meets = not failed and worst_ttft <= ttft_p99 and (itl_p99 is None or worst_itl <= itl_p99)
            candidates.append({"kv_share": share, "max_num_batched_tokens": budget, "meets": meets,
                               "worst_ttft_p99": worst_ttft, "worst_itl_p99": worst_itl, "errors": failed,
                               "output_tokens_per_s": sum(c["output_tokens_per_s"]
                                                          for c in summary["classes"].values())})
    good = [c for c in candidates if c.get("meets")]
    current = first.kv_share if first.kv_share is not None else 0.5

    def rank(c: dict[str, Any]) -> tuple[float, float, float]:
        """Most tokens/s (to 3 significant digits), then the lowest worst p99 TTFT (to 10 ms), then the
        split nearest the config's own."""
        return (float(f"{c['output_tokens_per_s']:.3g}"), -round(c["worst_ttft_p99"], 2),
                -abs(c["kv_share"] - current))

    best = max(good, key=rank, default=None)
    return {"pools": [first.name, second.name], "rate": rate, "ttft_p99": ttft_p99, "itl_p99": itl_p99,
            "candidates": candidates, "recommended": best}


def format_recommendation(result: dict[str, Any]) -> str:
    first, second = result["pools"]
    lines = [f"{first + ' kv_share':>16}{second + ' budget':>16}{'worst TTFT p99':>16}{'worst ITL p99':>15}"
             f"{'tok/s':>9}  SLO"]
    for c in result["candidates"]:
        if "error" in c:
            lines.append(f"{c['kv_share']:>16.2f}{c['max_num_batched_tokens']:>16}  {c['error'][:80]}")
            continue
        lines.append(f"{c['kv_share']:>16.2f}{c['max_num_batched_tokens']:>16}{_ms(c['worst_ttft_p99']):>13} ms"
                     f"{_ms(c['worst_itl_p99']):>12} ms{c['output_tokens_per_s']:>9.0f}  "
                     f"{'meets' if c['meets'] else '-'}")
    best = result["recommended"]
    slo = f"p99 TTFT <= {result['ttft_p99']:g} s" + (f", p99 ITL <= {result['itl_p99']:g} s"
                                                      if result["itl_p99"] is not None else "")
    if best is None:
        lines.append(f"\nno candidate meets {slo} at {result['rate']:g} requests/s: add capacity or lower the rate")
    else:
        lines.append(f"\nrecommended at {result['rate']:g} requests/s ({slo}): {first} kv_share "
                     f"{best['kv_share']:.2f}, {second} kv_share {1 - best['kv_share']:.2f} and "
                     f"max_num_batched_tokens {best['max_num_batched_tokens']}")
    return "\n".join(lines)
