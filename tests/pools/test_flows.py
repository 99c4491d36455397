"""Fairness inside one tenant: flows by size class, fair queueing between them, a cap per flow."""

from __future__ import annotations

from pools.credits.ledger import CreditLedger
from pools.credits.flows import FLOW_CAP, FlowChannel, flow_class


def _ids(tickets) -> list[str]:
    return [t.request_id for t in tickets]


def test_flow_classes_group_requests_within_a_factor_of_two():
    assert flow_class(16, 16) == 0 and flow_class(17, 16) == flow_class(48, 16) == 1   # 1 block; 2..3
    assert flow_class(64, 16) == flow_class(112, 16) == 2          # 4..7 blocks
    assert flow_class(128, 16) == flow_class(240, 16) == 3         # 8..15 blocks
    assert flow_class(1040, 16) == 6


def test_a_chat_is_not_queued_behind_a_burst_twice_its_size():
    # 24 chats of n = 4 x 36 tokens (11 blocks each, 4 sequences) from one client, then a 16-token chat
    # (4 blocks): with classes of a factor of four both were one FIFO and the small one waited for
    # all 24; it is now its own flow, and starts beside the burst.
    ledger = CreditLedger(28_880, max_seqs=28, flow_cap=FLOW_CAP)
    for i in range(24):
        ledger.submit(f"n4-{i}", 176, num_seqs=4)
    assert len(ledger.admit()) == 6                  # 24 sequences: a seventh would pass the cap of 25
    ledger.submit("chat", 56)
    assert _ids(ledger.admit()) == ["chat"]
    ledger.check_integrity()


def test_a_small_request_behind_a_burst_is_next_but_one():
    channel = FlowChannel()
    ledger_like = []
    for i in range(16):
        ticket = CreditLedger(10_000).submit(f"big{i}", 1040)
        channel.append(ticket)
        ledger_like.append(ticket)
    channel.pop(channel.heads()[0])                    # big0 served
    small = CreditLedger(10_000).submit("small", 48)
    channel.append(small)
    assert [t.request_id for t in channel.heads()] == ["small", "big1"]
    assert len(channel) == 16 and {t.request_id for t in channel} == {f"big{i}" for i in range(1, 16)} | {"small"}


def test_a_burst_of_one_tenant_leaves_room_for_its_small_request():
    # FCFS would admit the burst until the credits run out and queue the small request behind the rest
    # of it; the flow cap keeps 1/8 free, so the small one starts at once.
    ledger = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(16):
        ledger.submit(f"big{i}", 1040)
    assert _ids(ledger.admit()) == [f"big{i}" for i in range(8)]      # 8 x 1040 <= 8750 < 9 x 1040
    ledger.submit("small", 48)
    assert _ids(ledger.admit()) == ["small"]
    ledger.check_integrity()
    ledger.release("big0")
    assert _ids(ledger.admit()) == ["big8"]                              # the burst goes on as credits come back
    ledger.check_integrity()


def test_sequences_are_credits_too():
    # n=8 requests on a replica that runs 28 sequences: three run (24), a fourth would pass the flow's
    # cap of 25; a one-sequence request runs beside them at once.
    ledger = CreditLedger(100_000, quantum=100_000, max_seqs=28, flow_cap=FLOW_CAP)
    for i in range(6):
        ledger.submit(f"n8-{i}", 2000, num_seqs=8)
    assert _ids(ledger.admit()) == ["n8-0", "n8-1", "n8-2"]
    ledger.submit("one", 250, num_seqs=1)             # a smaller flow
    assert _ids(ledger.admit()) == ["one"]
    assert ledger.accounts[0].num_seqs == 25
    ledger.check_integrity()
    ledger.release("n8-0")
    assert _ids(ledger.admit()) == ["n8-3"]
    ledger.check_integrity()


def test_a_flow_at_its_cap_holds_back_no_other_tenant():
    """One API key's burst (n=8 requests, then large prompts) at its flow's cap waits for its own flow: the
    room the cap leaves is another tenant's at once, in sequences and in credits, however long it waits."""
    ledger = CreditLedger(100_000, quantum=100_000, max_seqs=28, flow_cap=FLOW_CAP)
    for i in range(6):
        ledger.submit(f"n8-{i}", 2000, num_seqs=8, tenant="a")
    assert _ids(ledger.admit()) == ["n8-0", "n8-1", "n8-2"]
    ledger.submit("one", 250, num_seqs=1, tenant="b")
    assert _ids(ledger.admit()) == ["one"]
    ledger.check_integrity()
    credits = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(10):
        credits.submit(f"big-{i}", 2100, tenant="a")
    assert _ids(credits.admit()) == ["big-0", "big-1", "big-2", "big-3"]   # 8,400: a fifth passes 7/8
    credits.submit("b0", 1000, tenant="b")
    assert _ids(credits.admit()) == ["b0"]
    credits.submit("b1", 500, tenant="b")
    assert _ids(credits.admit()) == ["b1"]   # still: a's head waits for its own flow, never as the first
    credits.release("big-0")
    assert _ids(credits.admit()) == ["big-4"]
    credits.check_integrity()


def test_a_request_larger_than_the_cap_runs_alone_in_its_flow():
    ledger = CreditLedger(1000, quantum=1000, flow_cap=FLOW_CAP)
    ledger.submit("whole", 1000)
    ledger.submit("next", 1000)
    assert _ids(ledger.admit()) == ["whole"]
    ledger.release("whole")
    assert _ids(ledger.admit()) == ["next"]
    too_many = CreditLedger(1000, quantum=1000, max_seqs=4, flow_cap=FLOW_CAP)
    too_many.submit("many", 100, num_seqs=10)          # more samples than the engine runs: all of them, no more
    assert _ids(too_many.admit()) == ["many"] and too_many.accounts[0].num_seqs == 4
    too_many.check_integrity()


def test_the_cap_idles_at_most_a_quarter_of_a_replica_whatever_the_requests_size():
    """The cap keeps a reserve of 1/8 free for another flow; a request it stops waits only while waiting idles at
    most twice that. Chats with no max_tokens reserve half a 16,384-credit replica each: the cap ran one at a time,
    the other half idle, and the second waited out max_queue_seconds with 8,192 credits free."""
    ledger = CreditLedger(16_384, quantum=16_384, flow_cap=FLOW_CAP)
    for i in range(3):
        ledger.submit(f"half{i}", 8192)
    assert _ids(ledger.admit()) == ["half0", "half1"]
    three_tenths = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(4):
        three_tenths.submit(f"r{i}", 3000)
    assert len(three_tenths.admit()) == 3              # 9,000 passes the cap of 8,750; waiting idled 4,000
    eighths = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(10):
        eighths.submit(f"e{i}", 1000)
    assert len(eighths.admit()) == 8                   # the ninth waits: it idles 2,000, not over 2 x 1,250
    two_seqs = CreditLedger(10_000, quantum=10_000, max_seqs=2, flow_cap=FLOW_CAP)
    two_seqs.submit("s0", 100)
    two_seqs.submit("s1", 100)
    assert _ids(two_seqs.admit()) == ["s0", "s1"]      # a pool of two sequences is not capped in sequences
    unfit = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(3):
        unfit.submit(f"a{i}", 3500, tenant="a")
    assert _ids(unfit.admit()) == ["a0", "a1"]
    unfit.submit("b", 100, tenant="b")               # a2, over the cap, fits nowhere: it waits for its own flow,
    assert _ids(unfit.admit()) == ["b"]              # never as the first in line, and b starts at once
    for checked in (ledger, three_tenths, eighths, two_seqs, unfit):
        checked.check_integrity()


def test_a_flow_at_its_cap_does_not_block_other_tenants():
    ledger = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
    for i in range(10):
        ledger.submit(f"a{i}", 1040, tenant="a")
    assert _ids(ledger.admit()) == [f"a{i}" for i in range(8)]   # a8 fits the credits, not a's cap
    ledger.submit("b0", 1040, tenant="b")                        # the same size, another tenant's flow
    assert _ids(ledger.admit()) == ["b0"]                        # not held behind a8
    ledger.release("a0")
    assert _ids(ledger.admit()) == ["a8"]
    ledger.check_integrity()


def test_without_a_cap_one_flow_may_take_every_credit():
    ledger = CreditLedger(10_000, quantum=10_000)        # a throughput pool's ledger
    for i in range(10):
        ledger.submit(f"big{i}", 1040)
    assert len(ledger.admit()) == 9                      # 9 x 1040 = 9360 of 10,000
    ledger.check_integrity()


def test_a_burst_admitted_one_by_one_still_counts_when_the_small_one_comes():
    # each request of the burst arrives alone and is admitted at once (the channel empties between them);
    # the fair-queueing tags must remember it, or the rest of the burst would tie with the small request
    ledger = CreditLedger(28_880, max_seqs=28, flow_cap=FLOW_CAP)
    admitted = []
    for i in range(16):
        ledger.submit(f"b{i}", 1184, num_seqs=8)
        admitted += _ids(ledger.admit())
    ledger.submit("small", 48)
    admitted += _ids(ledger.admit())
    assert admitted == ["b0", "b1", "b2", "small"]
    ledger.check_integrity()


def test_questions_on_one_read_document_are_capped_by_the_credits_they_hold_not_by_its_copies():
    """A flow holds at most 7/8 of a replica in an interactive pool: of the credits it is charged. Questions on
    a document already read take their own 60 credits each, not 700: the cap stopped them at 12 (12 x 700 is
    past 8,750) with 8,640 credits and 16 sequences free. The flow's sequences (25 of 28) bound them now."""
    ledger = CreditLedger(10_000, max_seqs=28, flow_cap=FLOW_CAP, quantum=10_000, block_size=16)
    doc = tuple(range(40))                                  # 40 blocks of 16: 640 of each request's 700
    ledger.submit("first", 700, blocks=doc)
    assert _ids(ledger.admit()) == ["first"]
    ledger.prefilled("first")
    for i in range(30):
        ledger.submit(f"q{i}", 700, blocks=doc)
    assert _ids(ledger.admit()) == [f"q{i}" for i in range(24)]
    assert ledger.free == 10_000 - 640 - 25 * 60
    ledger.check_integrity()
    for i in range(24):
        ledger.release(f"q{i}")
    ledger.release("first")
    assert ledger.free == ledger.total
    ledger.check_integrity()


def test_requests_a_flow_gave_up_cost_it_no_turns():
    """Ten large requests that time out (oldest first) moved their flow's tag on by their credits: its next
    request came behind ten large requests' worth of a small flow's. Cancelled, they cost it nothing."""
    channel = FlowChannel()
    large = [CreditLedger(10_000).submit(f"L{i}", 1040) for i in range(11)]
    for ticket in large:
        channel.append(ticket)
    channel.pop(large[0])                                   # served
    for ticket in large[1:]:                                # ten time out, the oldest first
        channel.remove(ticket)
    channel.append(nxt := CreditLedger(10_000).submit("L-next", 1040))
    for i in range(30):
        channel.append(CreditLedger(10_000).submit(f"s{i}", 48))
    order = []
    while len(channel):
        head = channel.heads()[0]
        channel.pop(head)
        order.append(head.request_id)
    assert order.index(nxt.request_id) == 22                # after the small flow's first 1,040 credits
    # a later request that came once the virtual time had passed its flow's tag keeps that floor: taken back to
    # before the virtual time of its arrival, it would pass requests of other flows queued before it
    channel = FlowChannel()
    first, other = CreditLedger(10_000).submit("A1", 1040), CreditLedger(10_000).submit("B1", 48)
    channel.append(first)
    channel.append(other)
    channel.vtime = 5_000                                   # other flows were served meanwhile
    channel.append(late := CreditLedger(10_000).submit("A2", 1040))
    assert late.start == 5_000
    channel.remove(first)
    assert late.start == 5_000 and channel.finish[first.flow] == 6_040



def test_a_head_waiting_on_one_replica_leaves_the_replica_where_its_flow_is_capped_to_others():
    """Tenant a's head waits for credits on replica 0 (tenant c's large request holds it) while on replica 1 its
    own flow is at the cap: it waits for replica 0 only, and tenant b's request goes on replica 1 at once."""
    ledger = CreditLedger([10_000, 10_000], quantum=10_000, flow_cap=FLOW_CAP)
    ledger.submit("c", 9_000, tenant="c")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [("c", 0)]
    for i in range(9):
        ledger.submit(f"a{i}", 1040, tenant="a")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [(f"a{i}", 1) for i in range(8)]   # 8,320
    ledger.submit("b", 500, tenant="b")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [("b", 1)]
    ledger.release("c")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [("a8", 0)]
    ledger.check_integrity()


def test_a_head_held_off_the_replica_it_fits_leaves_the_one_where_its_flow_is_capped_to_others():
    """Tenant a's head fits replica 0 now, but an earlier head (e's, too large for replica 1) holds replica 0;
    on replica 1 a's flow is at the cap: a's head holds nothing, and b's request goes on replica 1 at once."""
    ledger = CreditLedger([16_000, 10_000], quantum=20_000, flow_cap=FLOW_CAP)
    prefer_1 = lambda ticket, fitting: 1 if 1 in fitting else fitting[0]   # noqa: E731
    ledger.submit("f", 5_000, tenant="f")
    assert [(t.request_id, t.replica) for t in ledger.admit()] == [("f", 0)]
    for i in range(8):
        ledger.submit(f"a{i}", 1040, tenant="a")
    assert [(t.request_id, t.replica) for t in ledger.admit(prefer_1)] == [(f"a{i}", 1) for i in range(8)]
    ledger.submit("e", 12_000, tenant="e")   # waits for replica 0's credits, the only one that can hold it
    ledger.submit("a8", 1040, tenant="a")    # fits replica 0, which e holds; at its flow's cap on replica 1
    ledger.submit("b", 500, tenant="b")
    assert [(t.request_id, t.replica) for t in ledger.admit(prefer_1)] == [("b", 1)]
    ledger.check_integrity()


def test_a_tenants_batch_lines_or_other_priority_at_the_cap_leave_its_interactive_request_the_room():
    """The cap counts a size class within one channel (tenant and priority), batch lines apart: the room it
    keeps free is for the tenant's own interactive request of that size too, not only for another flow's."""
    for other in (dict(background=True), dict(priority=5)):
        ledger = CreditLedger(10_000, quantum=10_000, flow_cap=FLOW_CAP)
        for i in range(16):
            ledger.submit(f"line{i}", 1040, **other)
        assert _ids(ledger.admit()) == [f"line{i}" for i in range(8)]   # at the cap: 8 x 1040 <= 8750
        ledger.submit("chat", 1040)                                      # same tenant, same size class
        assert _ids(ledger.admit()) == ["chat"], other                   # into the room left, at once
        ledger.check_integrity()


def test_a_tenant_sending_a_new_priority_each_time_keeps_a_bounded_number_of_empty_channels():
    """A channel's fair-queueing tags outlive its empty spells, so every priority a busy tenant had sent was kept
    (one per request for a client that sends a deadline as its priority: ~640 bytes each, never freed). Only the
    empty channels used last are kept now; the one in use keeps its tags."""
    from pools.credits.flows import MAX_IDLE_LANES

    ledger = CreditLedger(10_000, quantum=10_000)
    ledger.submit("long", 100, tenant="a")            # the tenant stays busy throughout
    ledger.admit()
    for i in range(200):
        ledger.submit(f"r{i}", 100, tenant="a", priority=1000 + i)
        assert _ids(ledger.admit()) == [f"r{i}"]
        ledger.release(f"r{i}")
    lanes = ledger._tenants["a"].lanes
    assert len(lanes) <= MAX_IDLE_LANES + 1 and 1000 + 199 in lanes and 1000 not in lanes
    kept = lanes[1000 + 199]
    ledger.submit("again", 100, tenant="a", priority=1000 + 199)
    assert ledger._tenants["a"].channels[1000 + 199] is kept   # its tags, not a fresh channel
    ledger.check_integrity()
