"""What preemption weighs: which running sequence is the victim (`victim_by_policy`, the pool's
`victim_policy`), and in the `auto` mode, per victim, swap against recompute (`PreemptionCostModel`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence


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
    """What `auto` compares per victim: swap round trip vs re-prefill, both from measurements.

    `swap_bytes_per_second` is measured by the engine at start-up (device <-> CPU copies);
    `prefill_seconds_per_token` is a running estimate from real prefill-heavy steps.
    """

    kv_bytes_per_token: int
    swap_bytes_per_second: float | None = None
    prefill_seconds_per_token: float | None = None
    smoothing: float = 0.2

    def swap_seconds(self, num_tokens: int) -> float | None:
        if not self.swap_bytes_per_second:
            return None
        return 2 * num_tokens * self.kv_bytes_per_token / self.swap_bytes_per_second

    def recompute_seconds(self, num_tokens: int) -> float | None:
        if self.prefill_seconds_per_token is None:
            return None
        return num_tokens * self.prefill_seconds_per_token

    def choose(self, num_tokens: int) -> str:
        """'swap' or 'recompute' for a victim holding `num_tokens` computed tokens."""
        swap, recompute = self.swap_seconds(num_tokens), self.recompute_seconds(num_tokens)
        if swap is None or recompute is None:
            return "recompute"  # nothing measured yet: the shared-nothing choice
        return "swap" if swap < recompute else "recompute"

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        sample, last, a = seconds / num_tokens, self.prefill_seconds_per_token, self.smoothing
        self.prefill_seconds_per_token = sample if last is None else (1 - a) * last + a * sample
