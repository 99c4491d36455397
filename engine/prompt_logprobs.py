"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the tokens before it,
and the top k there, from the logits of the rows a prefill chunk computes anyway.

The runner asks, row by row, for the positions of a chunk whose next token is still a prompt token and not yet
known (`plan_rows`); the forward pass turns those rows' hidden states into float32 log-softmaxes a slice of
`SLICE_ROWS` at a time (`compute`: a 2,048-token chunk of a 152k vocabulary would otherwise be a 1.2 GB
tensor) and keeps only the target's logprob and the top k; the engine extends each sequence's lists when the
step's results are read (`PromptSpans.apply`). A sequence that asks for them is never served its prompt from
the prefix cache (`Sequence.wants_prompt_logits`: a cached block's logits were never computed), as in vLLM. The same
rows computed twice (a recompute after a preemption, a step still in flight) are kept once: a sequence's
lists only ever grow by the positions they do not hold yet.

Like the sampled tokens' logprobs these are of the model's raw logits (no temperature, penalty or bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.parallel import StepPlan
from engine.sequence import Sequence
from kernels.transfer import to_device, to_host

__all__ = ["PromptSpans", "SLICE_ROWS", "compute", "plan_rows"]

SLICE_ROWS = 256   # rows turned into float32 logits at once: 256 x 152k x 4 B = 156 MB at most


@dataclass
class PromptSpans:
    """A step's prompt-logprob rows: per sequence, the first target position and how many follow, in row order;
    then the step's results (`compute`'s tensors), read to the host by `apply`."""

    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    results: tuple[torch.Tensor, ...] | None = None
    _event: torch.cuda.Event | None = None

    def hold(self, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Keep a step's results; on CUDA copied to pinned host memory behind the step's kernels, an event marking
        their end, so `apply` waits for this step only, not for the one launched after it (overlapped steps)."""
        if results[0].device.type == "cuda":
            results = tuple(to_host(t) for t in results)
            self._event = torch.cuda.Event()
            self._event.record()
        self.results = results

    def apply(self) -> None:
        """Extend each sequence's `prompt_logprobs` and `prompt_top_logprobs` by the positions it lacks."""
        if self.results is None:
            return
        if self._event is not None:
            self._event.synchronize()
        chosen, top_values, top_ids = (t.tolist() for t in self.results)
        row = 0
        for seq, first, count in self.spans:
            k = seq.params.prompt_logprobs
            skip = len(seq.prompt_logprobs) + 1 - first   # targets 1.. are held: position p is target p
            for j in range(max(0, skip), count):
                seq.prompt_logprobs.append(chosen[row + j])
                seq.prompt_top_logprobs.append(list(zip(top_ids[row + j][:k], top_values[row + j][:k])))
            row += count
        self.results = None


def plan_rows(plan: StepPlan, spans: PromptSpans, seq: Sequence, start: int, num_new: int, base: int) -> None:
    """Ask for the rows of `seq`'s chunk (`num_new` tokens from position `start`, its first at row `base`) whose
    next token is a prompt token it has no logprob for yet."""
    first = max(start, len(seq.prompt_logprobs))   # position p predicts target p + 1
    end = min(start + num_new, seq.num_prompt_tokens - 1)
    if first >= end:
        return
    plan.prompt_rows.extend(range(base + first - start, base + end - start))
    plan.prompt_targets.extend(seq.token_ids[first + 1:end + 1])
    plan.prompt_top = max(plan.prompt_top, seq.params.prompt_logprobs)
    spans.spans.append((seq, first + 1, end - first))


def compute(model, hidden: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's prompt rows as (each target's logprob [R], the top `prompt_top` logprobs [R, k] and their ids),
    float32, from `hidden` [num_tokens, hidden_size]. Every rank calls it (the logits' gather pairs up)."""
    device = hidden.device
    rows, targets = (to_device(values, torch.int64, device) for values in (plan.prompt_rows, plan.prompt_targets))
    chosen, values, ids = [], [], []
    for i in range(0, len(plan.prompt_rows), SLICE_ROWS):
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows[i:i + SLICE_ROWS]]).float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[i:i + SLICE_ROWS, None]).squeeze(1))
        top = logprobs.topk(min(plan.prompt_top, logprobs.shape[1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    return torch.cat(chosen), torch.cat(values), torch.cat(ids)
