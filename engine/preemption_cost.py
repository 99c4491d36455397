"""`PreemptionCostModel`: what the `auto` preemption mode weighs for each victim, swap against recompute."""

from __future__ import annotations

from dataclasses import dataclass


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
