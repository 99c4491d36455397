"""The overload verdict's pure parts: what a pool can do, the device's load, the detector's holds."""

from __future__ import annotations

import pytest

from engine.step_cost import LinearStepTime
from pools import demand
from pools.demand import (DeviceLoad, OfferedLoad, OverloadDetector, PoolLoad, PoolRates, pool_rates,
                            replicas_needed, wait_bound)

# 10 ms a step, 0.2 ms a prefill token, 1 ms a decode token, no attention or keys terms
MODEL = LinearStepTime(a=0.010, b=0.0002, c=0.001, d=0.0)


def test_pool_rates_follow_the_step_model_and_the_kv_limit():
    rates = pool_rates(MODEL, prompt_tokens=1000, output_tokens=100, max_num_seqs=8, credits=100_000, chunk=512)
    # two chunks (512 + 488): 2 x 10 ms + 1000 x 0.2 ms = 220 ms for 1000 tokens
    assert rates.prefill == pytest.approx(1000 / 0.220)
    # 8 sequences decode together: 10 ms + 8 ms a step for 8 tokens
    assert rates.batch == 8 and rates.decode == pytest.approx(8 / 0.018)
    # credits for one request at a time: one token a step, whatever max_num_seqs says
    limited = pool_rates(MODEL, prompt_tokens=1000, output_tokens=100, max_num_seqs=8, credits=1500, chunk=512)
    assert limited.batch == 1 and limited.decode == pytest.approx(1 / 0.011)


def test_offered_load_counts_only_the_window():
    offered = OfferedLoad(window=10)
    offered.add(0.0, 100, 10)
    offered.add(5.0, 300, 30)
    assert offered.totals(9.0) == (2, 400, 40)
    assert offered.totals(12.0) == (1, 300, 30)     # the first left the window at 10 s
    assert offered.totals(30.0) == (0, 0, 0)


def test_offered_load_is_divided_by_the_time_it_was_counted_over():
    counted = OfferedLoad(window=20)
    assert counted.span(3.0) == 20                                # nothing arrived: the whole window
    counted.add(50.0, 10, 1)                                      # no start given: from the first arrival
    assert (counted.since, counted.span(53.0), counted.span(62.0), counted.span(90.0)) == (50.0, 5, 12, 20)
    offered = OfferedLoad(window=20, since=100.0)
    assert offered.span(101.0) == 5                               # at least a quarter of the window
    assert offered.span(112.0) == 12                              # the time since counting began
    assert offered.span(150.0) == 20                              # then the window


def _pool(load_prefill: float = 0.0, load_decode: float = 0.0, wait: float = 0.0, bound: float = 25.0) -> PoolLoad:
    """A pool whose offered load is `load_prefill` + `load_decode` of one replica's time."""
    return PoolLoad("rag", 1000 * load_prefill, 100 * load_decode, PoolRates(1000, 100, 1), wait, bound)


def test_device_load_adds_pools_and_divides_by_replicas():
    device = DeviceLoad((_pool(0.5, 0.4), _pool(0.3)), replicas=2)
    assert device.load == pytest.approx(0.6)
    assert replicas_needed(device.pools) == 2                  # 1.2 of one replica's time, at most 90% each
    assert replicas_needed([_pool(0.1)]) == 1
    assert PoolLoad("x", 5, 5, None, 0, 1).load == 0           # no model yet: no load claimed
    assert "rag 0.90 (500 prefill tok/s offered of 1000, 40 decode tok/s of 100 at batch 1)" in device.describe()


def test_overload_turns_on_after_its_hold_with_a_backlog_and_off_after_a_calm_hold():
    detector = OverloadDetector()
    over = DeviceLoad((_pool(1.5, wait=demand.BACKLOG_SECONDS),), replicas=1)
    assert not detector.observe(0.0, over).overloaded
    assert not detector.observe(demand.ON_SECONDS - 0.1, over).overloaded
    state = detector.observe(demand.ON_SECONDS, over)
    assert state.overloaded and state.changed and "demand over capacity" in state.reason
    assert "offered load 1.50" in state.reason
    calm = DeviceLoad((_pool(0.5),), replicas=1)
    t = demand.ON_SECONDS + 1
    assert detector.observe(t, calm).overloaded                          # calm starts here
    assert detector.observe(t + demand.OFF_SECONDS - 0.1, calm).overloaded
    state = detector.observe(t + demand.OFF_SECONDS, calm)
    assert not state.overloaded and state.changed and state.reason.startswith("no longer overloaded")


def test_demand_over_capacity_without_a_backlog_is_a_burst_not_an_overload():
    detector = OverloadDetector()
    for t in range(30):
        assert not detector.observe(float(t), DeviceLoad((_pool(2.0, wait=0.5),), replicas=1)).overloaded


def test_an_old_waiting_request_turns_it_on_at_once_and_holds_it():
    detector = OverloadDetector()
    state = detector.observe(0.0, DeviceLoad((_pool(0.2, wait=26.0, bound=25.0),), replicas=1))
    assert state.overloaded and "pool rag's oldest request has waited 26.0 s (bound 25 s)" in state.reason
    # the load is low again but a request still waits more than half its bound: not calm
    for t in range(1, 30):
        assert detector.observe(float(t), DeviceLoad((_pool(0.2, wait=13.0, bound=25.0),), replicas=1)).overloaded


def test_wait_bound_is_half_the_queue_limit_within_its_range():
    assert wait_bound(50) == 25
    assert wait_bound(None) == demand.MAX_WAIT_BOUND
    assert wait_bound(0) == demand.MIN_WAIT_BOUND
    assert wait_bound(600) == demand.MAX_WAIT_BOUND


def test_a_planned_mix_is_judged_by_the_same_rates():
    from pools.demand import PlannedPool, planned_load

    pool = PlannedPool("rag", rate=3.0, prompt_tokens=1000, output_tokens=100, max_num_seqs=8, credits=100_000,
                       chunk=512)
    device = planned_load(MODEL, [pool], replicas=1)
    rates = pool_rates(MODEL, prompt_tokens=1000, output_tokens=100, max_num_seqs=8, credits=100_000, chunk=512)
    assert device.load == pytest.approx(3000 / rates.prefill + 300 / rates.decode)
    assert device.load > 1 and replicas_needed(device.pools) == 2
    assert planned_load(MODEL, [pool], replicas=2).load == pytest.approx(device.load / 2)


def test_a_pools_offered_load_counts_from_its_first_arrival_not_its_queues_making(monkeypatch):
    """The gateway makes its credit queues before its workers load; nothing arrives until a device is ready.
    A flood right after a long load is counted from its first request, not spread over the load's time."""
    import asyncio

    from pools.credits import queue as queue_module
    from pools.credits.placement import Work
    from pools.credits.queue import CreditQueue

    clock = [1000.0]
    monkeypatch.setattr(queue_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    queue = CreditQueue("chat", [10_000])
    clock[0] += 60.0                                                # the model loaded for a minute

    async def arrive() -> None:
        async with queue.hold("r1", 100, work=Work(((1,) * 90,), 10)):
            pass

    asyncio.run(arrive())
    assert queue.offered.since == 1060.0 and queue.offered.span(1066.0) == 6.0
