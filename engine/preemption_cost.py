"""What preemption weighs: which running sequence is the victim (`victim_by_policy`, the pool's
`victim_policy`), and in the `auto` mode, per victim, swap against recompute (`PreemptionCostModel`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence
from engine.step_cost import LinearStepTime, StepCostModel, StepFeatures


def victim_by_policy(policy: str, candidates: list[Sequence], running: list[Sequence],
                     serving: set[int] | None = None) -> Sequence:
    """The victim among `candidates` by `policy` (`engine.config.VICTIM_POLICIES`); `running` in admission order
    breaks ties. `serving`: the ids of the decodes a budget short of them all serves this step (None: every one),
    which `lru` counts as scheduled now."""
    order = {id(s): i for i, s in enumerate(running)}
    if policy == "reverse_fifo":
        return max(candidates, key=lambda s: order[id(s)])
    if policy == "longest_first":   # frees the most blocks
        return max(candidates, key=lambda s: (s.num_computed_tokens, order[id(s)]))
    if policy == "least_progress":  # loses the least generated work
        return min(candidates, key=lambda s: (s.num_output_tokens, -order[id(s)]))
    if policy == "lru":             # scheduled longest ago (left out by the token budget)
        serving = serving or set()
        return min(candidates, key=lambda s: (id(s) in serving, s.last_scheduled_step, -order[id(s)]))
    if policy == "priority":        # a batch line's, then largest priority value = least urgent, then reverse FIFO
        return max(candidates, key=lambda s: (s.background, s.priority, order[id(s)]))
    raise AssertionError(f"unknown victim policy {policy!r}")


@dataclass
class PreemptionCostModel:
    """What `auto` compares per victim of L computed tokens, both from measurements: the swap round trip,
    `2 x (swap_latency_seconds + L x S_KV / swap_bytes_per_second)` (the copies out and back, measured on real
    block copies at start-up), against the re-prefill: L tokens again in chunks of `chunk_tokens` (the pool's
    `max_num_batched_tokens`), each priced as what it adds to a step by `step_model` (the step composer's
    `StepCostModel`, fitted on the device's own steps). A chunk attends to the whole context before it, so a
    re-prefill grows faster than L where the copies grow as L: short victims recompute, long ones swap, the
    break-even where the device's measured costs put it. Until both are measured, `recompute`."""

    kv_bytes_per_token: int
    chunk_tokens: int = 2048
    swap_bytes_per_second: float | None = None
    swap_latency_seconds: float = 0.0
    step_model: StepCostModel | LinearStepTime | None = None

    def swap_seconds(self, num_tokens: int) -> float | None:
        if not self.swap_bytes_per_second:
            return None
        return 2 * (self.swap_latency_seconds + num_tokens * self.kv_bytes_per_token / self.swap_bytes_per_second)

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """What re-prefilling `num_tokens` adds to the steps that carry it. A chunk's price is linear in the
        context before it (its query-key pairs and keys read), so the full chunks sum in closed form."""
        q = max(1, self.chunk_tokens)
        full, rest = divmod(num_tokens, q)
        empty = self._predict(0, 0)
        if empty is None:
            return None
        total = 0.0
        if full:
            first = self._predict(0, q) - empty
            slope = self._predict(1, q) - empty - first            # per token of context before the chunk
            total += full * first + slope * q * full * (full - 1) / 2
        if rest:
            total += self._predict(full * q, rest) - empty
        return total

    def choose(self, num_tokens: int) -> str:
        """'swap' or 'recompute' for a victim holding `num_tokens` computed tokens."""
        swap, recompute = self.swap_seconds(num_tokens), self.recompute_seconds(num_tokens)
        if swap is None or recompute is None:
            return "recompute"  # nothing measured yet: the shared-nothing choice
        return "swap" if swap < recompute else "recompute"

    def _predict(self, num_cached: int, num_new: int) -> float | None:
        """The step model's seconds for a step of one prefill chunk (none: an empty step); None while unfitted."""
        model, features = self.step_model, StepFeatures()
        if num_new:
            features.add(num_cached, num_new, is_decode=False)
        if isinstance(model, StepCostModel):
            return model.predict(features, with_margin=False) if model.ready else None
        return model.predict(features) if model is not None else None
