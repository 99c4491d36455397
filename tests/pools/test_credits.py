"""pools.credits.ledger: the KV-credit ledger and its fair queue, in milliseconds (ints only)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from pools.credits.ledger import CreditLedger, TenantPolicy
from pools.credits.queue import CreditQueue, PoolFull, QueueTimeout


def _drain(ledger: CreditLedger, order: list[str]) -> None:
    """Admit, then finish the oldest admitted request, until nothing is queued; `order` gets the
    admission order."""
    running = []
    while True:
        admitted = ledger.admit()
        order.extend(t.request_id for t in admitted)
        running.extend(admitted)
        ledger.check_integrity()
        if not running:
            break
        ledger.release(running.pop(0).request_id)


def test_credits_are_deducted_on_admission_and_return_on_release():
    ledger = CreditLedger(1000)
    for i in range(3):
        ledger.submit(f"r{i}", 400)
    assert [t.request_id for t in ledger.admit()] == ["r0", "r1"]
    assert (ledger.free, ledger.num_queued, ledger.num_held) == (200, 1, 800)
    assert ledger.admit() == []               # r2 waits: 400 > 200 free
    assert ledger.release("r0") == 400
    assert [t.request_id for t in ledger.admit()] == ["r2"]
    for r in ("r1", "r2"):
        ledger.release(r)
    assert ledger.free == ledger.total == 1000
    ledger.check_integrity()


def test_many_more_requests_than_fit_are_all_admitted_and_the_ledger_returns_to_full():
    """Acceptance 1 in miniature: 500 requests against room for 8, none refused, none lost."""
    rng = random.Random(0)
    ledger = CreditLedger(8 * 1024)
    ids = [f"r{i}" for i in range(500)]
    for r in ids:
        ledger.submit(r, rng.randint(64, 1024), tenant=rng.choice("abc"), priority=rng.randint(0, 3))
    order: list[str] = []
    _drain(ledger, order)
    assert sorted(order) == sorted(ids) and ledger.free == ledger.total and ledger.num_queued == 0


def test_a_flooding_tenant_does_not_delay_another_behind_its_whole_queue():
    """Tenant A queues 200 requests, then tenant B queues 10: B's are admitted alternating with A's."""
    ledger = CreditLedger(8 * 100, quantum=100)
    for i in range(200):
        ledger.submit(f"a{i}", 100, tenant="A")
    for i in range(10):
        ledger.submit(f"b{i}", 100, tenant="B")
    order: list[str] = []
    _drain(ledger, order)
    b_positions = [order.index(f"b{i}") for i in range(10)]
    assert b_positions == sorted(b_positions)                     # FIFO within B
    assert max(b_positions) < 2 * 10 + 8                           # not behind A's 200
    assert all(later - earlier <= 2 for earlier, later in zip(b_positions, b_positions[1:]))


def test_weights_share_the_queue_by_tokens():
    ledger = CreditLedger(100, {"gold": TenantPolicy(weight=3)}, quantum=10)
    for i in range(60):
        ledger.submit(f"g{i}", 10, tenant="gold")
        ledger.submit(f"s{i}", 10, tenant="silver")
    order: list[str] = []
    _drain(ledger, order)
    first = order[:40]
    assert sum(r.startswith("g") for r in first) == 30 and sum(r.startswith("s") for r in first) == 10


def test_a_body_priority_above_the_tenant_allowance_does_not_jump_the_queue():
    ledger = CreditLedger(100, {"free": TenantPolicy(min_priority=5)}, quantum=100)
    ledger.submit("first", 100, tenant="free", priority=5)
    cheeky = ledger.submit("cheeky", 100, tenant="free", priority=-100)   # clamped to 5: FIFO after "first"
    other = ledger.submit("other", 100, tenant="anon", priority=-100)     # no policy: priorities >= 0
    assert (cheeky.priority, other.priority) == (5, 0)
    order: list[str] = []
    _drain(ledger, order)
    assert order.index("first") < order.index("cheeky")
    within = CreditLedger(100, quantum=100)
    within.submit("low", 100, priority=3)
    within.submit("high", 100, priority=1)                         # allowed: goes first within its tenant
    order = []
    _drain(within, order)
    assert order == ["high", "low"]


def test_a_large_request_is_not_starved_by_small_ones():
    """No bypass: once the large request is next in fair order, small ones wait until it fits."""
    ledger = CreditLedger(1000, quantum=1000)
    ledger.submit("small0", 300, tenant="s")
    ledger.submit("big", 1000, tenant="b")
    for i in range(1, 20):
        ledger.submit(f"small{i}", 300, tenant="s")
    # s spends its first allowance (3 x 300 of 1000), then big is next and waits for all 1000 credits
    assert [t.request_id for t in ledger.admit()] == ["small0", "small1", "small2"]
    for i in range(3):
        assert ledger.admit() == []                                  # free credits grow, nobody bypasses
        ledger.release(f"small{i}")
    assert [t.request_id for t in ledger.admit()] == ["big"]
    order: list[str] = []
    small_first = CreditLedger(1000, quantum=300)
    for i in range(20):
        small_first.submit(f"s{i}", 300, tenant="s")
    small_first.submit("big", 1000, tenant="b")
    _drain(small_first, order)
    assert order.index("big") <= 6


def test_cancel_leaves_the_queue_and_holds_nothing():
    ledger = CreditLedger(100, quantum=100)
    ledger.submit("running", 100)
    ledger.submit("gone", 50, tenant="t")
    assert [t.request_id for t in ledger.admit()] == ["running"]
    assert ledger.cancel("gone") and not ledger.cancel("gone") and not ledger.cancel("running")
    ledger.check_integrity()
    ledger.release("running")
    assert ledger.admit() == [] and ledger.free == 100 and ledger.num_queued == 0


@pytest.mark.parametrize("call,match", [
    (lambda l: l.submit("x", 0), "num_tokens: must be a positive integer"),
    (lambda l: l.submit("x", 101), "num_tokens: 101 credits asked, the pool has 100"),
    (lambda l: (l.submit("x", 1), l.submit("x", 1)), "already in the ledger"),
    (lambda l: l.release("nope"), "holds no credits"),
])
def test_bad_calls_are_named(call, match):
    with pytest.raises((ValueError, KeyError), match=match):
        call(CreditLedger(100))


def test_integrity_check_can_fail():
    ledger = CreditLedger(100)
    ledger.accounts[0].held = 10   # credits deducted with no ticket holding them: a leak
    with pytest.raises(AssertionError, match="held 10 \\(tickets 0\\)"):
        ledger.check_integrity()


def test_background_waits_behind_interactive_and_soaks_up_idle_credits():
    ledger = CreditLedger(100)
    ledger.submit("batch-1", 30, background=True)
    ledger.submit("chat-1", 60)
    ledger.submit("chat-2", 60)
    assert [t.request_id for t in ledger.admit()] == ["chat-1"]   # chat-2 does not fit: batch-1 may not pass
    ledger.release("chat-1")
    # chat-2 first; then nothing interactive waits and batch-1 fits what is left
    assert [t.request_id for t in ledger.admit()] == ["chat-2", "batch-1"]
    ledger.release("chat-2")
    assert ledger.cancel("batch-1") is False                      # admitted: release, not cancel
    ledger.submit("batch-2", 10, background=True)
    assert ledger.cancel("batch-2") is True
    ledger.release("batch-1")
    ledger.check_integrity()
    assert ledger.free == 100 and ledger.num_queued == 0


def test_batch_lines_of_tenants_take_turns_by_credits_over_weight():
    """Batch lines are fair across tenants: one tenant's 32 queued lines do not run ahead of another's 4
    (a FIFO served all 32 first), a tenant of weight 3 gets three lines' turns to one, and a tenant whose
    lines are all served keeps no tag."""
    ledger = CreditLedger(100, {"heavy": TenantPolicy(weight=3)})
    for i in range(32):
        ledger.submit(f"a{i}", 60, tenant="a", background=True)
    for i in range(4):
        ledger.submit(f"b{i}", 60, tenant="b", background=True)
    order: list[str] = []
    _drain(ledger, order)
    assert order[:8] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert order[8:] == [f"a{i}" for i in range(4, 32)]

    for i in range(12):
        ledger.submit(f"h{i}", 60, tenant="heavy", background=True)
        ledger.submit(f"l{i}", 60, tenant="light", background=True)
    order = []
    _drain(ledger, order)
    assert [r[0] for r in order[:16]] == list("hlhhlhhhlhhhlhhh")   # 3 : 1 by credits
    assert ledger.first_waiting() is None and ledger._background.finish == {}


@pytest.mark.parametrize("seed", range(20))
def test_batch_lines_among_interactive_requests_and_cancels_keep_the_ledger_whole(seed):
    """Random submits (batch lines of four tenants, interactive requests), admissions, releases and cancels
    on two replicas: the ledger is whole after each step, and every line is admitted or cancelled once."""
    rng = random.Random(seed)
    ledger = CreditLedger([300, 200], {"w3": TenantPolicy(weight=3)})
    running: list[str] = []
    queued: set[str] = set()
    for step in range(300):
        action = rng.random()
        if action < 0.45:
            rid = f"{step}"
            ledger.submit(rid, rng.randint(10, 200), tenant=rng.choice(["w3", "a", "b", "c"]),
                          background=rng.random() < 0.7)
            queued.add(rid)
        elif action < 0.55 and queued:
            rid = rng.choice(sorted(queued))
            assert ledger.cancel(rid) is True
            queued.discard(rid)
        elif running:
            ledger.release(running.pop(rng.randrange(len(running))))
        for ticket in ledger.admit():
            queued.remove(ticket.request_id)
            running.append(ticket.request_id)
        ledger.check_integrity()
    while queued or running:
        for ticket in ledger.admit():
            queued.remove(ticket.request_id)
            running.append(ticket.request_id)
        ledger.release(running.pop(0))
        ledger.check_integrity()
    assert ledger.free == ledger.total and ledger._background.finish == {}


def test_reconcile_holds_back_blocks_the_ledger_does_not_know_and_returns_them():
    ledger = CreditLedger(100)
    ledger.submit("a", 40)
    ledger.admit()
    assert ledger.reconcile(25) == 0            # the worker uses less than reserved: nothing changes
    assert ledger.free == 60
    assert ledger.reconcile(70) == 30           # 30 tokens the ledger does not know about (an abort in flight)
    assert ledger.free == 30
    ledger.submit("b", 40)
    assert ledger.admit() == []                 # would over-commit the engine
    ledger.release("a")
    assert ledger.reconcile(0) == 0             # the worker reports everything free again
    assert [t.request_id for t in ledger.admit()] == ["b"]
    ledger.check_integrity()
    with pytest.raises(ValueError, match="used_tokens"):
        ledger.reconcile(-1)


def test_a_lease_bounds_admission_and_is_acknowledged_once_what_is_held_is_within_it():
    """A replica shared by several gateways leases this one a share of its credits (`engine.sessions`):
    admission stays within it; a lease under what is held is acknowledged only once requests there have
    finished; a request larger than the lease but within the plan waits rather than being refused."""
    import asyncio
    import contextlib

    from pools.credits.queue import CreditQueue

    async def main():
        queue = CreditQueue("chat", [1000])
        acks: list[int] = []
        async with contextlib.AsyncExitStack() as first, contextlib.AsyncExitStack() as second:
            tickets = [await first.enter_async_context(queue.hold("r0", 300)),
                       await second.enter_async_context(queue.hold("r1", 300))]   # 600 held
            assert [t.charged for t in tickets] == [300, 300]
            queue.lease(0, 400, lambda: acks.append(400))
            assert acks == [] and queue.ledger.accounts[0].free == 0 and queue.max_request == 1000
            big = asyncio.ensure_future(_hold_once(queue, "big", 700))
            await asyncio.sleep(0.01)
            assert not big.done()       # 700 fits the plan, not the lease: it waits
            demand = queue.lease_demand(0)   # what the replica hears of it
            assert (demand.queued, demand.queued_batch, demand.head) == (700, 0, 700) and demand.head_waited > 0
            assert (demand.head_id, demand.head_background) == ("big", False)
            await first.aclose()        # r0 done: 300 held <= 400
            assert acks == [400] and not big.done()
            queue.lease(0, 1000, lambda: acks.append(1000))
            assert acks == [400, 1000]
            await second.aclose()
            assert await asyncio.wait_for(big, 1) == 700
        queue.ledger.check_integrity()

    asyncio.run(main())


def test_a_failed_acknowledgement_or_admission_leaves_nothing_held_and_the_queue_admitting():
    """A lease's acknowledgement that raises (a worker's send failing once did) is logged: the release that
    triggered it completes and the request queued behind it is admitted. Whatever else raises while a
    request is admitted leaves no ticket behind, neither queued nor holding credits nobody gives back."""
    import asyncio
    import contextlib

    from pools.credits.queue import CreditQueue

    class Fault(Exception):
        pass

    def fails() -> None:
        raise Fault

    async def main():
        queue = CreditQueue("chat", [1000])
        async with contextlib.AsyncExitStack() as first:
            await first.enter_async_context(queue.hold("r0", 300))
            queue.lease(0, 100, fails)   # under what is held: acknowledged once r0 is done
            waiting = asyncio.ensure_future(_hold_once(queue, "r1", 50))
            await asyncio.sleep(0.01)
            assert not waiting.done()
        assert await asyncio.wait_for(waiting, 1) == 50   # r0's release acknowledged (and failed), r1 admitted
        queue.ledger.check_integrity()

        def broken_place(*args, **kwargs):
            raise Fault

        queue.lease(0, 1000, lambda: None)
        queue._place = broken_place   # a fault while the ledger places the request
        with pytest.raises(Fault):
            async with queue.hold("r2", 50):
                pass
        assert queue.ledger.ticket("r2") is None and queue.ledger.accounts[0].held == 0
        queue.ledger.check_integrity()

        del queue._place   # the class's again
        queue.ledger.submit("admitted", 1000)   # admitted, then its request fails before it holds the credits
        assert [t.request_id for t in queue.ledger.admit()] == ["admitted"]
        waiting = asyncio.ensure_future(_hold_once(queue, "r3", 50))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        queue._drop("admitted")           # what hold does on such a failure: gives back, and admits the next
        assert await asyncio.wait_for(waiting, 1) == 50
        queue.ledger.check_integrity()

    asyncio.run(main())


def test_the_queue_says_what_it_asks_and_which_request_is_first_in_line():
    """What a gateway reports to a shared replica (`CreditQueue.lease_demand`): the credits the queued
    requests ask for, and of them the batch lines', kept as requests are queued, admitted and cancelled;
    the request first in line is the
    interactive head that waits for its replicas, else the oldest batch line while nothing interactive
    waits; its need counts the prompt blocks already held on that replica once."""
    ledger = CreditLedger(1000, block_size=16)
    ledger.submit("held", 600, blocks=(1, 2))
    ledger.admit()
    ledger.prefilled("held")
    assert (ledger.queued_tokens, ledger.first_waiting()) == (0, None)
    ledger.submit("batch", 500, background=True)
    ledger.admit()
    assert (ledger.queued_tokens, ledger.background_tokens) == (500, 500)
    assert ledger.first_waiting().request_id == "batch"
    ledger.submit("doc", 480, blocks=(1, 2, 3))
    ledger.submit("small", 50)
    ledger.admit()                   # "doc" waits for 448 credits (two of its blocks are held), "small" behind it
    assert (ledger.queued_tokens, ledger.background_tokens) == (1030, 500)
    assert ledger.first_waiting().request_id == "doc"
    assert ledger.need(ledger.first_waiting(), 0) == 448
    ledger.cancel("doc")
    assert [t.request_id for t in ledger.admit()] == ["small"]
    assert ledger.queued_tokens == 500 and ledger.first_waiting().request_id == "batch"
    ledger.check_integrity()
    ledger.release("small")
    ledger.release("held")
    assert [t.request_id for t in ledger.admit()] == ["batch"]
    assert (ledger.queued_tokens, ledger.background_tokens, ledger.first_waiting()) == (0, 0, None)
    ledger.check_integrity()
    ledger.queued_tokens += 1
    with pytest.raises(AssertionError, match="credits counted queued"):
        ledger.check_integrity()


async def _hold_once(queue, request_id: str, num_tokens: int) -> int:
    async with queue.hold(request_id, num_tokens) as ticket:
        return ticket.charged


def test_a_tenant_is_forgotten_with_its_last_request_and_fair_within_its_busy_spell():
    """Without a tenants: section every API key is a tenant: 2,000 keys that came once keep nothing once their
    requests end (queued or admitted, released or cancelled), while a tenant with a request still running keeps
    its fair-queueing tags: its burst admitted one by one still counts as served."""
    ledger = CreditLedger(1000)
    for i in range(2000):
        ledger.submit(f"r{i}", 100, tenant=f"key-{i:08x}")
        if i % 2:
            ledger.cancel(f"r{i}")
        else:
            for ticket in ledger.admit():
                ledger.release(ticket.request_id)
    ledger.check_integrity()
    assert ledger.queued_by_tenant() == {} and ledger.free == 1000

    ledger.submit("big", 400, tenant="a")          # a's large flow, running for the rest of the test
    assert [t.request_id for t in ledger.admit()] == ["big"]
    for i in range(3):                             # a burst of a's large ones, each served as it comes
        ledger.submit(f"a{i}", 100, tenant="a")
        assert [t.request_id for t in ledger.admit()] == [f"a{i}"]
        ledger.release(f"a{i}")
    ledger.submit("late", 100, tenant="a")         # same flow as the burst: its tag is after the burst's
    ledger.submit("small", 16, tenant="a")         # a flow that got nothing yet goes first
    assert ledger.queued_by_tenant() == {"a": 2}
    ledger.check_integrity()
    ledger.release("big")
    assert [t.request_id for t in ledger.admit()] == ["small", "late"]
    for r in ("small", "late"):
        ledger.release(r)
    ledger.check_integrity()
    assert ledger.queued_by_tenant() == {}


def test_max_queue_seconds_counts_from_the_requests_arrival_not_from_its_turn_in_this_queue():
    """A request that already spent most of max_queue_seconds (waiting for its device, for another pool's
    credits) is refused once the whole has passed, saying so, not after another full max_queue_seconds."""
    async def main() -> None:
        queue = CreditQueue("chat", 100, max_queue_seconds=0.5)
        async with queue.hold("occupier", 100):
            started = time.monotonic()
            with pytest.raises(QueueTimeout, match=r"waited 0\.5 s for KV capacity \(max_queue_seconds 0\.5\)"):
                async with queue.hold("late", 50, spent=0.4):
                    pass
            assert 0.05 <= time.monotonic() - started < 0.3
            with pytest.raises(QueueTimeout):   # spent it all already: refused at once
                async with queue.hold("later", 50, spent=0.6):
                    pass
        assert queue.free == 100 and queue.ledger.num_queued == 0

    asyncio.run(main())


def test_a_patient_request_outwaits_max_queue_seconds_where_another_would_expire():
    """A background Response waits for its credits however long (its client polls, nobody holds a
    connection): past a pool's max_queue_seconds, and when that is 0 (reject-when-full) too; its wait is not
    read as overload (`oldest_wait`, which the overload signal and the autoscaler read)."""
    async def main(limit: float) -> None:
        queue, release = CreditQueue("chat", 100, max_queue_seconds=limit), asyncio.Event()

        async def hold(request_id: str, credits: int, **kwargs) -> bool:
            async with queue.hold(request_id, credits, **kwargs) as ticket:
                await release.wait()
                return ticket.admitted

        first = asyncio.ensure_future(hold("first", 100, background=True))   # a batch line holds every credit
        await asyncio.sleep(0.01)
        with pytest.raises(QueueTimeout if limit else PoolFull):
            await hold("impatient", 50)
        patient = asyncio.ensure_future(hold("patient", 50, patient=True))
        await asyncio.sleep(0.1 + 2 * limit)
        assert not patient.done() and queue.ledger.num_queued == 1
        assert queue.oldest_wait() == 0.0   # what the overload signal reads: a patient wait is no sign of it
        release.set()
        assert await first and await patient and queue.free == 100

    for limit in (0.05, 0):
        asyncio.run(main(limit))


def test_a_waiting_request_holds_back_only_the_replicas_it_could_run_on():
    """A head of 500 credits waits for replica 1 (1000 credits); replica 0 (100) can never hold it and stays free
    for the others (it held both, and the small request waited with 100 credits free)."""
    ledger = CreditLedger([100, 1000])
    ledger.submit("big1", 900, tenant="A")
    ledger.submit("big2", 500, tenant="A")
    assert [t.request_id for t in ledger.admit()] == ["big1"]
    ledger.submit("small", 50, tenant="B")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [("small", 0)]
    ledger.check_integrity()
    ledger.release("big1")
    assert [t.request_id for t in ledger.admit()] == ["big2"]


def test_a_placement_that_raises_strands_no_admitted_request():
    """A fault in placement (here: choosing for C) sends that request where most credits are free: the requests
    the same pass admitted are woken (B held its credits unwoken), and the fault is not raised in the request
    whose release ran the pass (A's, which had ended well)."""
    class Placement:
        def prompt_blocks(self, work):
            return ()

        def choose(self, work, fitting, free, waiting):
            if work.name == "C":
                raise RuntimeError("placement bug")
            return fitting[0]

        def start(self, *args):
            pass

        def finish(self, key):
            pass

    async def main() -> None:
        queue, ends = CreditQueue("p", [100, 100]), {name: asyncio.Event() for name in "AXBC"}
        queue.placement = Placement()

        async def hold(request_id: str, credits: int, tenant: str = "default") -> int:
            work = SimpleNamespace(name=request_id, num_prompt_tokens=credits, output_tokens=0)
            async with queue.hold(request_id, credits, tenant=tenant, work=work) as ticket:
                await ends[request_id].wait()
                return ticket.replica

        a, x = asyncio.ensure_future(hold("A", 100)), asyncio.ensure_future(hold("X", 100))
        await asyncio.sleep(0.01)
        b, c = asyncio.ensure_future(hold("B", 40)), asyncio.ensure_future(hold("C", 40, tenant="T2"))
        await asyncio.sleep(0.01)
        ends["A"].set()
        assert await asyncio.wait_for(a, 2) in (0, 1)
        for name in "BCX":
            ends[name].set()
        await asyncio.wait_for(asyncio.gather(b, c, x), 2)
        assert queue.free == 200
        queue.ledger.check_integrity()

    asyncio.run(main())


def test_placement_never_has_a_request_wait_for_the_replica_where_its_flow_is_at_the_cap():
    """Replica 1 caches the start of a8's prompt (a0's), but tenant a's flow there holds 8,320 of 10,000 credits and
    a8 would take it past the cap (7/8): placement is offered only replica 0, which has room, and a8 starts there at
    once (offered replica 1 as one to wait for, placement chose to wait for it, for as long as a's flow held it)."""
    from pools.credits.flows import FLOW_CAP
    from pools.credits.placement import Placement

    async def main() -> None:
        placement = Placement(2, 16, max_cached_blocks=10_000)
        queue, end = CreditQueue("p", [10_000, 10_000], placement=placement, flow_cap=FLOW_CAP,
                                 quantum=10_000), asyncio.Event()
        held: dict[str, int] = {}

        async def hold(request_id: str, prompt: list[int], output: int, tenant: str = "a") -> None:
            work = placement.work([prompt], output, 1, 100_000)
            async with queue.hold(request_id, len(prompt) + output, tenant=tenant, work=work) as ticket:
                held[request_id] = ticket.replica
                await end.wait()

        prompts = [list(range(10_000 * i, 10_000 * i + 1000)) for i in range(8)]
        tasks = [asyncio.ensure_future(hold("e", list(range(100_000, 107_000)), 800, tenant="e"))]
        for i, prompt in enumerate(prompts):
            await asyncio.sleep(0)
            tasks.append(asyncio.ensure_future(hold(f"a{i}", prompt, 40)))
        await asyncio.sleep(0.01)
        assert held == {"e": 0, **{f"a{i}": 1 for i in range(8)}}     # a's flow: 8 x 1,040 on replica 1
        tasks.append(asyncio.ensure_future(hold("a8", prompts[0][:800] + list(range(200_000, 200_700)), 40)))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if "a8" in held:
                break
        assert held.get("a8") == 0, (held, queue.ledger.num_queued)
        end.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert queue.free == 20_000
        queue.ledger.check_integrity()

    asyncio.run(main())


def test_a_patient_request_never_has_others_refused_where_nothing_queues():
    """max_queue_seconds 0 (reject-when-full): a background Response too large for the free credits waits behind
    the others; a request that fits is admitted (it was refused, 429, while the patient one headed the queue)."""
    async def main() -> None:
        queue, release = CreditQueue("p", 100, max_queue_seconds=0), asyncio.Event()

        async def hold(request_id: str, credits: int, **kwargs) -> bool:
            async with queue.hold(request_id, credits, **kwargs) as ticket:
                await release.wait()
                return ticket.admitted

        a = asyncio.ensure_future(hold("A", 60))
        await asyncio.sleep(0.01)
        patient = asyncio.ensure_future(hold("P", 80, patient=True, tenant="T"))   # another tenant's
        await asyncio.sleep(0.01)
        async with queue.hold("S", 10) as small:
            assert small.admitted
        release.set()
        assert await a and await asyncio.wait_for(patient, 2) and queue.free == 100

    asyncio.run(main())


def test_what_the_autoscaler_reads_of_a_queue_its_refusals_and_the_waits_that_press():
    """A refusal for capacity is timed (`refused_at`); a batch line's or a patient request's wait is no
    sign the replicas are too few (`oldest_credit_wait` leaves it out), an interactive request's is."""

    async def waiting(queue: CreditQueue, request_id: str, **kwargs) -> asyncio.Task:
        async def hold() -> None:
            async with queue.hold(request_id, 60, **kwargs):
                pass
        task = asyncio.ensure_future(hold())
        await asyncio.sleep(0.05)
        return task

    async def scenario() -> None:
        rejecting = CreditQueue("p", 100, max_queue_seconds=0)
        async with rejecting.hold("a", 100):
            assert rejecting.refused_at is None
            with pytest.raises(PoolFull):
                async with rejecting.hold("b", 60):
                    pass
            assert rejecting.refused_at is not None
        queue = CreditQueue("p", 100)
        async with queue.hold("a", 100):
            tasks = [await waiting(queue, "line", background=True), await waiting(queue, "kept", patient=True)]
            assert queue.oldest_credit_wait() == 0.0
            tasks.append(await waiting(queue, "chat"))
            assert queue.oldest_credit_wait() > 0.0
        await asyncio.gather(*tasks)
        assert queue.oldest_credit_wait() == 0.0 and queue.refused_at is None

    asyncio.run(scenario())


def test_the_free_credits_gauge_reads_0_for_a_replica_down_now_before_any_admission_pass():
    """A replica whose worker died with nothing in flight: no admission pass has run since, yet the gauge
    already says it takes nothing (the supervisors' word, not the ledger's last pass)."""
    from prometheus_client import CollectorRegistry

    from gateway.admission import AdmissionMetrics

    queue = CreditQueue("chat", [100, 100])
    down: set[int] = set()
    queue.is_up = lambda replica: replica not in down
    metrics = AdmissionMetrics(CollectorRegistry())
    pool = SimpleNamespace(name="chat", admission=queue)
    down.add(1)
    metrics.refresh([pool])
    free = [metrics.credits_free.labels(pool="chat", replica=str(r))._value.get() for r in (0, 1)]
    assert free == [100, 0]


def test_the_prompts_of_a_request_are_shared_once_each_has_streamed_a_token():
    """A completion of several prompts in one pool: its first token (the short prompt's) does not make the
    long document's blocks, still being prefilled, count as computed for the requests that share them;
    the last prompt's first token does (`LocalResponse._observe` -> `CreditQueue.observe`)."""
    from gateway.local_answer import LocalResponse
    from gateway.monitoring.metrics import GatewayMetrics
    from gateway.openai.completions import parse_completion

    queue = CreditQueue("chat", 1000)
    calls: list[bool] = []

    async def main() -> None:
        async with queue.hold("a", 100) as ticket:
            placed = SimpleNamespace(replica=0, observe=lambda num_tokens, prefilled=True: calls.append(prefilled) or
                                     queue.observe("a", num_tokens, prefilled))
            pool = SimpleNamespace(name="chat")
            req = parse_completion({"model": "m", "prompt": ["short", "a long document"], "max_tokens": 4})
            local = LocalResponse(None, req, [(pool, [1]), (pool, [2, 3, 4])], placed={"chat": placed},
                                  received=0.0, metrics=GatewayMetrics())
            delta = SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[7])], finished=False, metrics={})
            local._observe(0, delta)
            local._observe(0, delta)
            assert calls == [False, False] and ticket.prefilling       # the document is still being prefilled
            local._observe(1, delta)
            assert calls[-1] is True and not ticket.prefilling

    asyncio.run(main())


def test_a_client_that_leaves_in_the_loop_step_its_credits_are_granted_does_not_run():
    """Its handler cancelled in the loop step its admission lands in: on Python 3.11 `asyncio.wait_for` returned
    as if nothing had happened, and the request ran, holding its credits for no one (a drain's cut did not cut
    it either). It leaves with its cancellation, its credits back."""
    ran = []

    async def scenario() -> None:
        queue = CreditQueue("chat", 100, max_queue_seconds=2.0)

        async def second() -> None:
            async with queue.hold("b", 100):
                ran.append("b")

        first = queue.hold("a", 100)
        await first.__aenter__()
        task = asyncio.create_task(second())
        await asyncio.sleep(1.1)                   # past its half-wait for the replica caching its prompt
        await first.__aexit__(None, None, None)    # its credits granted to b ...
        task.cancel()                              # ... as its client leaves, in the same loop step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queue.ledger.free == 100 and queue.num_admitted == 2
        queue.ledger.check_integrity()

    asyncio.run(scenario())
    assert ran == []


def test_a_refusal_with_free_credits_says_what_holds_them_back():
    """max_queue_seconds 0: a request refused while a replica has its credits free, by max_num_seqs or by its
    flow's cap, says so; its 429 read "needs 112 KV token slots, 128 are free", as if there were room."""
    import contextlib

    async def scenario() -> None:
        capped = CreditQueue("chat", 800, max_queue_seconds=0, flow_cap=8, max_seqs=8)
        async with contextlib.AsyncExitStack() as stack:
            for i in range(6):
                await stack.enter_async_context(capped.hold(f"r{i}", 112))
            with pytest.raises(PoolFull, match=r"needs 112 KV token slots, 128 are free, but requests of its size "
                                               r"hold their share of the pool already \(the rest is kept for other sizes\)"):
                async with capped.hold("r6", 112):
                    pass
            async with capped.hold("small", 16):   # another size: its own share
                pass
        seqs = CreditQueue("chat", 1000, max_queue_seconds=0, max_seqs=2)
        async with seqs.hold("a", 100), seqs.hold("b", 100):
            with pytest.raises(PoolFull, match="800 are free, but no sequence slot is"):
                async with seqs.hold("c", 100):
                    pass
        full = CreditQueue("chat", 100, max_queue_seconds=0)
        async with full.hold("a", 100):
            with pytest.raises(PoolFull, match=r"needs 60 KV token slots, 0 are free; retry later"):
                async with full.hold("b", 60):
                    pass
        split = CreditQueue("chat", [100, 100], max_queue_seconds=0)   # 120 free together, 60 on each
        async with split.hold("a", 40), split.hold("b", 40):
            with pytest.raises(PoolFull, match="needs 100 KV token slots, 120 are free, but no replica has that many"):
                async with split.hold("c", 100):
                    pass

    asyncio.run(scenario())


class _DeviceDown(Exception):
    pass


def test_a_request_queued_when_its_pools_last_replica_dies_waits_for_the_device_not_for_capacity(monkeypatch):
    """Queued behind a running request when the only replica died: it waited for credits however long
    (`max_queue_seconds: null`: never answered while the device crash-looped), or got a 503 saying the pool was
    saturated. It turns to the gateway's wait for the device (`on_down`): its 503 (raised here) once that gives
    up, holding nothing, no refusal for capacity; or, the device back, its wait for credits goes on, the time
    the device was down not counted against its max_queue_seconds."""
    from pools.credits import queue as queue_module

    monkeypatch.setattr(queue_module, "DOWN_RECHECK_SECONDS", 0.02)   # a death no admission pass sees
    down: set[int] = set()
    waits: list[bool] = []

    def make(limit: float | None, back_after: float | None) -> CreditQueue:
        queue = CreditQueue("chat", 100, max_queue_seconds=limit)
        queue.is_up = lambda replica: replica not in down

        async def on_down(patient: bool) -> None:
            waits.append(patient)
            if back_after is None:
                raise _DeviceDown("pool 'chat': no replica of device 'gpu' became ready")
            await asyncio.sleep(back_after)
            down.clear()
            queue.replica_ready(0)

        queue.on_down = on_down
        return queue

    async def queued(queue: CreditQueue, hold_for: float) -> str:
        async def first() -> None:
            async with queue.hold("a", 100):
                await asyncio.sleep(hold_for)

        running = asyncio.create_task(first())
        await asyncio.sleep(0.01)
        try:
            async with queue.hold("b", 60):
                return "admitted"
        finally:
            await running

    async def scenario() -> None:
        queue = make(None, None)
        task = asyncio.create_task(queued(queue, 0.3))
        await asyncio.sleep(0.05)
        down.add(0)                           # no release, no admission pass: the recheck sees it
        with pytest.raises(_DeviceDown):
            await asyncio.wait_for(task, 5)
        assert waits == [False] and queue.ledger.ticket("b") is None and queue.refused_at is None
        assert queue.num_expired == 0
        down.clear()
        waits.clear()
        queue = make(0.2, 0.4)                # down 0.4 s, past its max_queue_seconds of 0.2: still served
        task = asyncio.create_task(queued(queue, 0.1))
        await asyncio.sleep(0.05)
        down.add(0)
        assert await asyncio.wait_for(task, 5) == "admitted" and waits == [False] and queue.refused_at is None

    asyncio.run(scenario())


def test_a_request_queued_while_its_only_replica_is_ready_but_draining_times_out_and_never_spins():
    """A replica ready but draining takes nothing new (`is_up` False) while the gateway's wait for a ready
    replica returns at once: the queued request called it again and again (122,245 times in 1.5 s, the event
    loop's whole time) and never timed out. It waits for credits as any request then."""
    queue = CreditQueue("chat", 100, max_queue_seconds=0.3)
    draining, calls = [False], []
    queue.is_up = lambda replica: not draining[0]

    async def on_down(patient: bool) -> None:
        calls.append(patient)   # `wait_for_replica`: the replica is ready, so at once

    async def scenario() -> None:
        async def first() -> None:
            async with queue.hold("a", 100):
                await asyncio.sleep(0.5)

        running = asyncio.create_task(first())
        await asyncio.sleep(0.01)
        queue.on_down = on_down
        draining[0] = True
        began = time.monotonic()

        async def second() -> None:
            async with queue.hold("b", 60):
                pass

        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(second(), 3)
        assert time.monotonic() - began < 1.0 and len(calls) <= 5
        await running

    asyncio.run(scenario())
