"""pools.spiral: the death-spiral detector on made-up counters (no engine, milliseconds)."""

from __future__ import annotations

import pytest

from pools.spiral import NUM_SLICES, SpiralConfig, SpiralDetector, SpiralState

DT = 0.25   # seconds between samples, as the device worker pushes its stats while busy
CONFIG = SpiralConfig(window_seconds=8.0, min_preemptions_per_s=1.0, tokens_tolerance=0.1)


class _Pool:
    """A pool's counters driven by rates (per second, functions of time), fed to a detector every DT."""

    def __init__(self, detector: SpiralDetector) -> None:
        self.detector = detector
        self.t = 0.0
        self.preemptions = 0.0
        self.tokens = 0.0
        self.states: list[tuple[float, SpiralState]] = []
        detector.observe(0.0, 0, 0)

    def run(self, seconds: float, preemptions_per_s, tokens_per_s) -> SpiralState:
        for _ in range(round(seconds / DT)):
            self.preemptions += preemptions_per_s(self.t) * DT
            self.tokens += tokens_per_s(self.t) * DT
            self.t = round(self.t + DT, 9)
            state = self.detector.observe(self.t, int(self.preemptions), int(self.tokens))
            self.states.append((self.t, state))
        return self.detector.state

    def changes(self) -> list[tuple[float, bool]]:
        return [(t, s.tripped) for t, s in self.states if s.changed]


def _const(value: float):
    return lambda t: value


def _make_pool(config: SpiralConfig = CONFIG) -> _Pool:
    return _Pool(SpiralDetector(config))


def test_trips_once_a_full_window_has_sustained_preemptions_and_flat_tokens():
    pool = _make_pool()
    assert not pool.run(7.75, _const(2.0), _const(100.0)).tripped   # not judged before a whole window
    assert pool.detector.state.window is None
    state = pool.run(0.25, _const(2.0), _const(100.0))
    assert state.tripped and state.changed
    window = state.window
    assert window.preemptions_per_s == pytest.approx(2.0, rel=0.05)
    assert window.older_tokens_per_s == pytest.approx(100.0, rel=0.02)
    assert window.newer_tokens_per_s == pytest.approx(100.0, rel=0.02)
    assert state.reason.startswith("death spiral: 2.0 preemptions/s over 8 s")
    assert "100.0 -> 100.0 (older -> newer half)" in state.reason and ">= 1/s" in state.reason
    assert not pool.run(2.0, _const(2.0), _const(100.0)).changed   # stays tripped, reported once
    assert pool.changes() == [(8.0, True)]


def test_trips_when_tokens_fall_and_says_so():
    pool = _make_pool()
    state = pool.run(8.0, _const(3.0), lambda t: 100.0 if t < 4 else 20.0)
    assert state.tripped and "falling" in state.reason
    assert state.window.older_tokens_per_s == pytest.approx(100.0, rel=0.05)
    assert state.window.newer_tokens_per_s == pytest.approx(20.0, rel=0.1)


def test_preemptions_while_tokens_rise_are_a_pool_filling_up_not_a_spiral():
    pool = _make_pool()
    pool.run(20.0, _const(5.0), lambda t: 10.0 + 10.0 * t)     # newer half always > 1.1 x older half
    assert pool.changes() == []
    assert pool.detector.state.window.newer_tokens_per_s > 1.1 * pool.detector.state.window.older_tokens_per_s


def test_tokens_rising_within_the_tolerance_still_count_as_flat():
    pool = _make_pool()
    state = pool.run(8.0, _const(2.0), lambda t: 100.0 if t < 4 else 108.0)
    assert state.tripped and "flat (within +10%)" in state.reason
    pool = _make_pool()
    assert not pool.run(8.0, _const(2.0), lambda t: 100.0 if t < 4 else 115.0).tripped


def test_a_burst_shorter_than_half_the_window_never_trips():
    # 60 preemptions/s for 3 s of an 8 s window, with tokens flat: it never reaches into all four
    # quarters of a window, so it is not sustained
    pool = _make_pool()
    pool.run(30.0, lambda t: 60.0 if 10 <= t < 13 else 0.0, _const(100.0))
    assert pool.changes() == []
    assert max(s.window.preemptions_per_s for _, s in pool.states if s.window) > 20   # the burst was seen
    # the same rate for a whole window does trip (the control)
    pool = _make_pool()
    pool.run(30.0, lambda t: 60.0 if 10 <= t < 20 else 0.0, _const(100.0))
    assert [tripped for _, tripped in pool.changes()][:1] == [True]


def test_a_rate_below_the_minimum_never_trips():
    pool = _make_pool()
    pool.run(30.0, _const(0.75), _const(100.0))
    assert pool.changes() == []


def test_clears_only_after_the_condition_is_absent_for_clear_seconds():
    pool = _make_pool()
    pool.run(10.0, _const(2.0), _const(100.0))
    assert pool.detector.tripped
    # preemptions stop at t = 10. A tripped detector holds while the window's mean stays at 1/s (until
    # t = 14, half the window at 2/s), then waits clear_seconds (one window, 8 s) before it clears
    state = pool.run(11.5, _const(0.0), _const(100.0))
    assert state.tripped and state.reason.startswith("death spiral: ")
    assert state.window.preemptions_per_s == 0
    assert not pool.run(1.0, _const(0.0), _const(100.0)).tripped
    (cleared_at, cleared), = [(t, s) for t, s in pool.states if s.changed and not s.tripped]
    assert 21.75 <= cleared_at <= 22.25
    assert cleared.reason.startswith("death spiral cleared: the condition was absent for 8.")
    assert "last window: 0.0 preemptions/s over 8 s" in cleared.reason
    assert pool.changes() == [(8.0, True), (cleared_at, False)]


def test_a_pool_on_the_edge_does_not_flap():
    # After it trips, preemptions pause 2 s in every 6: a quarter of the window goes quiet, but the
    # window's mean stays above the minimum, so the detector holds (a lull is not a recovery) and is
    # reported once
    pool = _make_pool()
    pool.run(8.0, _const(3.0), _const(100.0))
    pool.run(36.0, lambda t: 3.0 if t % 6 < 4 else 0.0, _const(100.0))
    assert pool.changes() == [(8.0, True)]
    assert min(s.window.min_slice_preemptions_per_s for _, s in pool.states[40:]) == 0
    # preemptions stop: it clears once. Then they come in 2 s spells every 6 s, a window's mean at
    # about the minimum: holding would need no more, but tripping again needs every quarter at the
    # rate, and each window has a quiet quarter
    pool.run(20.0, _const(0.0), _const(100.0))
    pool.run(36.0, lambda t: 3.0 if t % 6 < 2 else 0.0, _const(100.0))
    assert [tripped for _, tripped in pool.changes()] == [True, False]
    assert max(s.window.preemptions_per_s for _, s in pool.states[-100:]) >= 1.0


def test_a_restarted_worker_starts_the_history_afresh():
    pool = _make_pool()
    pool.run(9.0, _const(2.0), _const(100.0))
    assert pool.detector.tripped
    # the worker restarts: its totals count from 0 again; nothing is judged for a window, which
    # counts as absent, so the detector clears after clear_seconds and does not mistake the reset
    # for a fall in tokens/s
    pool.preemptions = pool.tokens = 0.0
    state = pool.run(5.0, _const(0.0), _const(100.0))
    assert state.tripped and state.window is None
    assert not pool.run(3.5, _const(0.0), _const(100.0)).tripped
    (cleared_at, cleared), = [(t, s) for t, s in pool.states if s.changed and not s.tripped]
    assert cleared_at == 17.0                      # 8 s after the last window that held (t = 9)
    assert "do not span a window" in cleared.reason
    assert pool.run(10.0, _const(0.0), _const(100.0)).window is not None   # judged again, not tripped
    assert not pool.detector.tripped


def test_a_sample_out_of_order_is_ignored():
    detector = SpiralDetector(CONFIG)
    detector.observe(1.0, 0, 100)
    detector.observe(2.0, 5, 200)
    state = detector.observe(1.5, 9, 900)     # e.g. an idle re-feed raced a fresh report
    assert not state.changed and not state.tripped
    detector.observe(3.0, 6, 300)
    assert detector._times == [1.0, 2.0, 3.0]  # neither kept nor taken for a restart


def test_history_is_bounded_by_the_window():
    detector = SpiralDetector(CONFIG)
    for i in range(10_000):
        detector.observe(i * 0.01, i // 10, i)
    assert len(detector._times) - detector._head <= CONFIG.window_seconds / 0.01 + 2
    assert len(detector._times) <= 2 * (CONFIG.window_seconds / 0.01 + 2) + 64


@pytest.mark.parametrize("kwargs, message", [
    ({"window_seconds": 0}, "window_seconds: must be > 0.0, got 0"),
    ({"window_seconds": "30s"}, "window_seconds: expected a number, got string '30s'"),
    ({"window_seconds": float("inf")}, "window_seconds: must be a finite number, got inf"),
    ({"min_preemptions_per_s": 0}, "min_preemptions_per_s: must be > 0.0, got 0"),
    ({"min_preemptions_per_s": True}, "min_preemptions_per_s: expected a number, got boolean True"),
    ({"tokens_tolerance": -0.1}, "tokens_tolerance: must be >= 0.0, got -0.1"),
    ({"clear_seconds": -1}, "clear_seconds: must be >= 0.0, got -1"),
    ({"enabled": "no"}, "enabled: expected a boolean, got string 'no'"),
])
def test_config_is_checked_on_construction(kwargs, message):
    with pytest.raises(ValueError) as info:
        SpiralConfig(**kwargs)
    assert str(info.value) == message or str(info.value).startswith(message)


def test_config_defaults():
    config = SpiralConfig()
    assert (config.enabled, config.window_seconds, config.min_preemptions_per_s, config.tokens_tolerance) == \
        (True, 30.0, 0.5, 0.1)
    assert config.clear_after_seconds == 30.0 and SpiralConfig(clear_seconds=0).clear_after_seconds == 0
    assert NUM_SLICES == 4
