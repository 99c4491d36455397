"""Overlapped steps: the host schedules and launches step N+1 while the device still runs step N.

Without overlap every step ends by reading its sampled tokens, so the device idles while the host
detokenizes, checks stops, reports, schedules the next step and builds its inputs (about 2 ms of a
batch-64 step on the development VM: docs/PERF.md, "Host cost"). With it, `LLMEngine.step()` is

    schedule N+1 -> launch N+1 (forward, sampling) -> settle N (read its tokens, stops, outputs)

and step N's tokens are read only once step N+1 is queued behind it. What that asks of the rest:

- **Placeholders.** A token sampled in step N is counted before its value is known: each sampled
  sequence gets `pending_token(row)` appended (`Sequence.add_pending`), so the scheduler sees a
  decode to compute and allocates its slot as usual. The runner fills the placeholders of step
  N+1's inputs on the device from step N's sampled ids (`fill_pending`), which never leave the
  device on that path; `Sequence.append_token` writes the value over the placeholder when step N
  settles.
- **Stops a step late.** A sequence that stopped in step N (EOS, a stop string) was already
  scheduled in N+1: that token is computed and dropped (`Sequence.drop_pending` when it finishes).
  One whose placeholder ends it whatever its value (max_tokens, max_model_len) is not scheduled
  again (`Sequence.ends_when_known`), so no position past its limit is ever computed.
- **Grammars** need a token before they can mask the next one: a step that sampled a row with a
  grammar settles before the next is scheduled (that step does not overlap).
- **The prefix cache** registers a block only once every token in it is known (`commit_step`).
- **Penalties** count on the device (`PenaltyCounts.record`), so step N+1 sees step N's token.
- **Time.** A step's time is read when it settles: CUDA events around its work, so no synchronize
  (`StepClock`); on a CPU the host clock around the launch, which computes it. The composer's cost
  model and SLO feedback learn one step later than without overlap.

- **Tensor parallelism.** Only rank 0 samples. A plan whose inputs hold placeholders says how many
  ids the step before sampled (`StepPlan.num_pending`); every rank then takes part in one broadcast of
  those ids from rank 0 (`Collectives.broadcast`: on CUDA an NCCL copy queued behind the sampling, so
  nothing waits on the host) and fills its placeholders from them as rank 0 does.

Overlap applies on CUDA (one rank or a tensor-parallel group) unless the device says
`async_scheduling: false` (`overlap_applies`); on a CPU the launch computes the step, so there is
nothing to hide. `async_scheduling: true` turns it on anywhere, which is how the tests hold it to the
same outputs on a CPU (tests/engine/test_overlap.py; under tensor parallelism on gloo,
tests/engine/test_tensor_parallel.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.composer import ComposedStep
from engine.prompt_logprobs import PromptSpans
from engine.sampler import SampledTokens
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence
from engine.stats import StepStats

__all__ = ["LaunchedStep", "ScheduledStep", "StepClock", "fill_pending", "overlap_applies"]


def overlap_applies(setting: bool | None, device: torch.device) -> bool:
    """Whether steps overlap: `setting` (a device's `async_scheduling`) if given, else on CUDA."""
    return setting if setting is not None else device.type == "cuda"


def fill_pending(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The step's token ids with each placeholder `-1 - row` replaced by `sampled[row]`, on the device.
    input_ids: [num_tokens] int64; sampled: [num_sampled] int64 (the previous step's tokens)."""
    rows = (-1 - input_ids).clamp_(0, sampled.shape[0] - 1)     # [num_tokens]; real ids point at row 0
    return torch.where(input_ids < 0, sampled.index_select(0, rows), input_ids)


class StepClock:
    """A step's device seconds, read when the step settles: on CUDA the time between two events
    recorded around its work (reading it waits for the step's end event only, which has passed by
    then); elsewhere the host clock from `start` to `stop`, since the launch computes the step."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._started = time.perf_counter()
        self._stopped: float | None = None

    def stop(self) -> None:
        """After the step's last kernel is queued."""
        if self._events is not None:
            self._events[1].record()
        self._stopped = time.perf_counter()

    def seconds(self) -> float:
        """The step's seconds; only once stopped (CUDA cannot time an end event never recorded: so that the
        CPU's tests see the misuse the device would, no clock reads unstopped)."""
        if self._stopped is None:
            raise RuntimeError("a step clock is read before it is stopped")
        if self._events is None:
            return self._stopped - self._started
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


@dataclass
class ScheduledStep:
    """What `LLMEngine._schedule` chose for one step, across pools."""

    composed: ComposedStep
    batch: list[ScheduledSeq]        # every pool's scheduled sequences: one forward pass
    ended: list[Sequence]            # sequences a scheduler ended on its own (its pool cannot hold them)
    stats: StepStats
    started: float                   # perf_counter() when the step began

    @property
    def idle(self) -> bool:
        """Nothing scheduled, ended or preempted: the schedulers are as the step found them."""
        return not (self.batch or self.ended or self.stats.num_preempted)


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued: the sequences that produce a token, and the
    tokens, read when the step settles (`LLMEngine._postprocess`)."""

    scheduled: ScheduledStep
    sampled: list[Sequence] = field(default_factory=list)
    tokens: SampledTokens | None = None
    clock: StepClock | None = None   # overlapped steps' device time (None: the engine synchronizes)
    forward_started: float = 0.0
    prompt_spans: PromptSpans = field(default_factory=PromptSpans)   # its prompt logprobs (`engine.prompt_logprobs`)
