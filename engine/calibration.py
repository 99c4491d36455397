"""Measuring a real engine's steps: the warm-up every engine runs before it serves, and the phases
that fit the linear step-cost model (`engine.step_cost.LinearStepTime`) that `cliffguard simulate`
and `bench simulate` run on."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.config import LatencySLO
from engine.sampling import SamplingParams
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence
from engine.step_commit import commit_step
from engine.step_cost import LinearStepTime, StepFeatures, fit_linear

# Warm-up steps: (prompt length, (cached tokens, tokens computed) per step) of two made-up sequences.
WARM_UP_STEPS = ((192, ((0, 64), (64, 128), (192, 1), (193, 1))), (32, ((0, 0), (0, 0), (0, 32), (32, 1))))


def warm_up(engine: Any) -> None:
    """A few forward passes of made-up tokens before `engine` (an `LLMEngine`) serves: they warm the
    kernels' caches and give the step composer's cost model its first measurements, so the first real
    steps are neither slow nor sized blind. The blocks are borrowed from the largest pool and given
    back (nothing enters the prefix cache); a pool too small for it skips it, and so does a CPU device
    with no interactive pool (its steps are never sized by the cost model). On CUDA every device runs
    it: there the first forward pass also pays the libraries' first use (0.53 s for a 67-token prefill on
    an H200, where the warm-up had been skipped)."""
    if not engine.composer.needs_cost_model and engine.device.type != "cuda":
        return
    lender = max(engine.schedulers.values(), key=lambda s: s.block_manager.num_blocks)
    bm, lengths = lender.block_manager, [length for length, _ in WARM_UP_STEPS]
    if bm.num_blocks_for(lengths[0] + 2) + bm.num_blocks_for(lengths[1] + 1) > bm.num_free_blocks or (
            getattr(engine, "ring", None) is not None and lender.config.max_num_seqs < len(lengths)):
        return   # (with sliding-layer rings a pool's rows are its own: `engine.sliding_kv`)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, engine.model_config.vocab_size, (length,), generator=gen).tolist()
        seqs.append(Sequence(seq_id=-1 - i, request_id="calibration", index=0, token_ids=ids,
                             num_prompt_tokens=length, params=SamplingParams(), max_tokens=1, priority=0,
                             arrival_order=-1, generator=None, pool=lender.name))
    try:
        for step in range(len(WARM_UP_STEPS[0][1])):
            batch, features = [], StepFeatures()
            for seq, (_, plan) in zip(seqs, WARM_UP_STEPS):
                start, num_new = plan[step]
                if not num_new:
                    continue
                if start == seq.num_tokens:                 # a decode: the prompt plus one token
                    seq.token_ids.append(1)
                bm.allocate(seq.block_table, start + num_new)
                batch.append(ScheduledSeq(seq, num_new))
                features.add(start, num_new, num_new == 1)
            started = time.perf_counter()
            engine.runner.execute(batch)
            engine.runner.synchronize()
            engine.composer.cost_model.observe(features, time.perf_counter() - started)
            commit_step({}, batch)     # no pool's: the blocks are borrowed, nothing is cached
    finally:
        for seq in seqs:
            bm.free(seq.block_table)
            engine.runner.release(seq)


# (prompt tokens, output tokens, how many at once): prefill chunks of growing length, then decode
# batches of growing size and context, then long prompts beside running decodes.
CALIBRATION_PHASES = (
    ((64, 1, 1), (256, 1, 1), (1024, 1, 1), (2048, 1, 1), (512, 1, 4)),
    ((32, 24, 1), (32, 24, 4), (128, 24, 16), (512, 24, 16), (64, 24, 48)),
    ((96, 48, 16), (1536, 4, 2)),
)


def measure_steps(engine: Any, *, pool: str | None = None, seed: int = 0,
                  phases: Seq[Seq[tuple[int, int, int]]] = CALIBRATION_PHASES,
                  ) -> tuple[LinearStepTime, list[tuple[StepFeatures, float]]]:
    """Measure a real engine (`engine.llm_engine.LLMEngine`) on this machine: run each phase's requests
    (random prompt ids, `ignore_eos`) to the end, record every step's features and seconds, and fit.
    Requests go to `pool` (default: the engine's largest). Returns the model and the samples."""
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
                params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
                engine.add_request(f"calibration-{n}", ids, params, pool=pool)
                n += 1
        while engine.has_unfinished_requests():
            engine.step()
            s = engine.last_step
            if s.seconds > 0 and s.num_prefill_tokens + s.num_decode_tokens:
                samples.append((StepFeatures(s.num_prefill_tokens, s.num_decode_tokens, s.num_attended,
                                             s.num_keys_read), s.seconds))
    # the swap copies at the bandwidth the engine measured, where a pool has swap space (a simulation's swaps)
    bandwidth, latency = getattr(engine, "_swap_copies", None) or (None, 0.0)
    return dataclasses.replace(fit_linear(samples, skip=2, swap_bandwidth=bandwidth), swap_latency=latency), samples


# --- the isolation-by-default SLO, from this device's own step ---------------------------------------
DERIVE_MAX_BATCH = 64     # sequences of the measured decode step at most
DERIVE_WARM_SECONDS = 0.5  # untimed probe steps first, this long or DERIVE_WARM_STEPS steps, whichever comes
DERIVE_WARM_STEPS = 20     # first (at least two): kernels load, a GPU's clock leaves its idle state
DERIVE_ROUNDS = 5         # rounds of timed steps; the step is the smallest round median
DERIVE_STEPS = 3          # timed steps per round
ITL_STEPS = 2.5          # itl_ms: a decode step that also prefills an arriving prompt (about two probe steps)
                         # and half a probe step more for the other pools' chunks
TTFT_ITLS = 10.0          # ttft_ms: ten times itl_ms (a prompt's prefill and a queue of a few steps)
MIN_ITL_MS = 10.0         # below this a step's noise (launches, the OS) is most of it


def measure_decode_step(engine: Any, pool: str, batch: int, context: int, *,
                        clock: Callable[[], float] = time.perf_counter) -> float | None:
    """Seconds of a decode step of `batch` sequences at `context` tokens each, in `pool`'s blocks
    (borrowed and given back: their K/V is whatever the blocks hold, only the time is wanted). None if
    the pool lacks the free blocks.

    The probe runs while the server starts, when the machine is often busy with something else (the
    gateway loading its tokenizer beside the worker, kernels loading, a GPU still at its idle clock):
    noise that only ever adds time. So untimed steps run first for `DERIVE_WARM_SECONDS` (or
    `DERIVE_WARM_STEPS` steps, where steps are quick), then
    `DERIVE_ROUNDS` rounds of `DERIVE_STEPS` timed steps, and the step is the smallest round median:
    the calmest stretch's typical step, not one lucky step."""
    bm = engine.schedulers[pool].block_manager
    if batch < 1 or batch * bm.num_blocks_for(context + 1) > bm.num_free_blocks:
        return None
    seqs = [Sequence(seq_id=-1 - i, request_id="calibration", index=0, token_ids=[1] * (context + 1),
                     num_prompt_tokens=context, params=SamplingParams(), max_tokens=1, priority=0, arrival_order=-1,
                     generator=None, pool=pool) for i in range(batch)]

    def step() -> float:
        started = clock()
        engine.runner.execute(items)
        engine.runner.synchronize()
        return clock() - started

    try:
        for seq in seqs:
            bm.allocate(seq.block_table, context + 1)
            seq.num_computed_tokens = context
        items = [ScheduledSeq(seq, 1) for seq in seqs]
        warm = [step(), step()]
        while sum(warm) < DERIVE_WARM_SECONDS and len(warm) < DERIVE_WARM_STEPS:
            warm.append(step())
        medians = [sorted(step() for _ in range(DERIVE_STEPS))[DERIVE_STEPS // 2] for _ in range(DERIVE_ROUNDS)]
    finally:
        for seq in seqs:
            bm.free(seq.block_table)
            engine.runner.release(seq)
    return min(medians)


def slo_probe(max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int) -> tuple[int, int]:
    """(sequences, context tokens each) of the decode step an interactive pool's default SLO is measured
    on: a quarter of its `max_num_seqs` (at most `DERIVE_MAX_BATCH`), at the context its blocks give each
    of its `max_num_seqs` (the capacity formula's avg_len), less one block's worth of room to decode."""
    batch = max(1, min(DERIVE_MAX_BATCH, -(-max_num_seqs // 4)))
    return batch, min(max_model_len - 1, num_blocks // max_num_seqs * block_size - 1)


def slo_from_step(step_seconds: float, min_share: float = 0.0) -> LatencySLO:
    """The isolation-by-default SLO of a pool whose probe decode step takes `step_seconds`, beside
    throughput pools owed `min_share` of the device: itl_ms `ITL_STEPS` times the step, over
    1 - min_share (a step that gives an owed pool its share is that much longer: the SLO promises what
    the device keeps with the guarantee kept), at least `MIN_ITL_MS`; ttft_ms `TTFT_ITLS` times that."""
    itl_ms = max(MIN_ITL_MS, math.ceil(ITL_STEPS * step_seconds / (1 - min_share) * 1000))
    return LatencySLO(ttft_ms=TTFT_ITLS * itl_ms, itl_ms=itl_ms)


def slo_share(throughput_min_shares: Iterable[float]) -> float:
    """The share of the device an interactive pool's derived SLO keeps room for (`slo_from_step`'s
    `min_share`): the largest `min_share` of the device's throughput pools, 0 without any. The engine
    and the simulator both ask this."""
    return max(throughput_min_shares, default=0.0)


def derive_slo(engine: Any, pool: str, min_share: float = 0.0) -> tuple[LatencySLO, float, int, int] | None:
    """The isolation-by-default SLO of `pool` from this device's own step (config/README.md, "Isolation
    by default"): `measure_decode_step` of the `slo_probe` step, through
    `slo_from_step` with `min_share` (`slo_share` of the device's throughput pools). Returns (slo, step
    seconds, batch, context), or None when the pool's blocks are too few to measure (the configured SLO
    stays)."""
    scheduler = engine.schedulers[pool]
    bm = scheduler.block_manager
    batch, context = slo_probe(scheduler.config.max_num_seqs, bm.num_blocks, bm.block_size, scheduler.max_model_len)
    step = measure_decode_step(engine, pool, batch, context) if context > 0 else None
    if step is None:
        return None
    return slo_from_step(step, min_share), step, batch, context


def derive_slos(engine: Any) -> dict[str, tuple[LatencySLO, float, int, int]]:
    """Every pool under isolation by default gets its SLO from this device's measured step (`derive_slo`,
    keeping room for the largest throughput pool's min_share, `slo_share`), set on the composer:
    pool -> (slo, step seconds, batch, context) of those measured. Sets `engine.slo_share`."""
    derived = {}
    engine.slo_share = slo_share(p.min_share for p in engine.config.pools if p.slo is None)
    for pool in engine.config.pools:
        if pool.derive_slo and (result := derive_slo(engine, pool.name, engine.slo_share)) is not None:
            engine.composer.set_slo(pool.name, result[0])
            derived[pool.name] = result
    return derived
