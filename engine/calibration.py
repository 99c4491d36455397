"""Measuring a real engine's steps: the warm-up every engine runs before it serves, and the phases
that fit the linear step-cost model (`engine.step_cost.LinearStepTime`) that `cliffguard simulate`
and `bench simulate` run on."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, commit_step
from engine.sequence import Sequence
from engine.step_cost import LinearStepTime, StepFeatures, fit_linear

# Warm-up steps: (prompt length, (cached tokens, tokens computed) per step) of two made-up sequences.
WARM_UP_STEPS = ((192, ((0, 64), (64, 128), (192, 1), (193, 1))), (32, ((0, 0), (0, 0), (0, 32), (32, 1))))


def warm_up(engine: Any) -> None:
    """A few forward passes of made-up tokens before `engine` (an `LLMEngine`) serves: they warm the
    kernels' caches and give the step composer's cost model its first measurements, so the first real
    steps are neither slow nor sized blind. The blocks are borrowed from the largest pool and given
    back (nothing enters the prefix cache); a pool too small for it, or a device with no interactive
    pool (whose steps are never sized by the cost model), skips it."""
    if not engine.composer.needs_cost_model:
        return
    bm = max(engine.schedulers.values(), key=lambda s: s.block_manager.num_blocks).block_manager
    lengths = [length for length, _ in WARM_UP_STEPS]
    if bm.num_blocks_for(lengths[0] + 2) + bm.num_blocks_for(lengths[1] + 1) > bm.num_free_blocks:
        return
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, engine.model_config.vocab_size, (length,), generator=gen).tolist()
        seqs.append(Sequence(seq_id=-1 - i, request_id="calibration", index=0, token_ids=ids,
                             num_prompt_tokens=length, params=SamplingParams(), max_tokens=1, priority=0,
                             arrival_order=-1, generator=None))
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
            commit_step({}, batch, 0, 0, 0.0)     # no pool's: the blocks are borrowed, nothing is cached
    finally:
        for seq in seqs:
            bm.free(seq.block_table)


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
    return fit_linear(samples, skip=2), samples
