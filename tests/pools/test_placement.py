"""pools.credits.placement and the ledger across replicas: where a request goes (token load, prefix affinity),
and a pool's one queue over several replicas' credits. Ints and hashes: milliseconds."""

from __future__ import annotations

import asyncio
import random

import pytest

from pools.credits.queue import CreditQueue
from pools.credits.ledger import CreditLedger, TenantPolicy
from pools.credits.placement import Placement, block_hashes

BS = 16


def _placement(replicas: int = 2, max_cached_blocks: int = 1000) -> Placement:
    return Placement(replicas, BS, max_cached_blocks=max_cached_blocks, avg_len=256)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_block_hashes_chain_whole_blocks_and_their_salt():
    ids = _ids(40, 0)
    hashes = block_hashes(ids, BS)
    assert len(hashes) == 2                                       # the 8-token tail is no block
    assert block_hashes(ids[:32] + [1, 2], BS) == hashes          # the same first 32 tokens
    assert block_hashes([7] + ids[1:], BS)[1] != hashes[1]        # a block's hash covers every token before it
    assert block_hashes(ids, BS, "tenant-a") != block_hashes(ids, BS, "tenant-b")


def test_with_nothing_cached_requests_spread_by_the_tokens_they_ask_not_their_count():
    placement = _placement()
    free = [10_000, 10_000]
    long = placement.work([_ids(600, 1)], max_tokens=64, n=1, max_model_len=4096)
    short = [placement.work([_ids(40, 10 + i)], max_tokens=32, n=1, max_model_len=4096) for i in range(10)]
    first = placement.choose(long, [0, 1], free)
    placement.start("long", first, long)
    chosen = []
    for i, work in enumerate(short):
        replica = placement.choose(work, [0, 1], free)
        placement.start(f"s{i}", replica, work)
        chosen.append(replica)
    # the long request (664 tokens of work) weighs as much as about nine short ones (72 each)
    assert chosen.count(1 - first) >= 9 and placement.load[0] == pytest.approx(placement.load[1], abs=80)
    placement.check_integrity()


def test_a_cached_prefix_goes_to_its_replica_unless_that_replica_is_clearly_busier():
    placement = _placement()
    free = [10_000, 10_000]
    document = _ids(2000, 2)
    first = placement.work([document + _ids(20, 3)], max_tokens=64, n=1, max_model_len=4096)
    placement.start("first", 1, first)
    assert placement.matched_tokens(first, 1) == (2020 // BS) * BS and placement.matched_tokens(first, 0) == 0
    again = placement.work([document + _ids(20, 4)], max_tokens=64, n=1, max_model_len=4096)
    # the first is still reading the document on replica 1: the second needs that same work done, there or
    # (reading the document itself) on idle replica 0, so it goes where the document will be cached
    assert placement.scores(again, [0, 1]) == {0: 2020, 1: 2084 - 2000 + 20}   # the 125 document blocks shared
    assert placement.choose(again, [0, 1], free) == 1
    # once its first token came, replica 1 has 63 tokens to go and saves 2,000 of again's 2,020: still it
    placement.observe("first", 1)
    assert placement.choose(again, [0, 1], free) == 1
    # a queue of 3,000 more prefill tokens on replica 1 outweighs what its cache saves: replica 0 then
    busy = placement.work([_ids(3000, 5)], max_tokens=16, n=1, max_model_len=4096)
    placement.start("busy", 1, busy)
    assert placement.choose(again, [0, 1], free) == 0
    # ... and once that prefill is done (its first token came), replica 1 is the one again
    placement.observe("busy", 1)
    assert placement.choose(again, [0, 1], free) == 1
    placement.finish("first")
    placement.finish("busy")
    assert placement.load == [0, 0]
    placement.check_integrity()


def test_the_replica_caching_a_prompt_keeps_it_until_it_would_start_it_a_quarter_later():
    placement = _placement()
    free = [10_000, 10_000]
    document = _ids(1600, 11)
    placement.start("doc", 0, placement.work([document], max_tokens=1, n=1, max_model_len=4096))
    placement.observe("doc", 1)                               # read: replica 0 caches the document, idle again
    question = placement.work([document + _ids(16, 12)], max_tokens=16, n=1, max_model_len=4096)
    for i, size in enumerate((2250, 2250)):                   # replica 0 gets 4,500 tokens of other prefill
        placement.start(f"other{i}", 0, placement.work([_ids(size, 20 + i)], max_tokens=4, n=1, max_model_len=4096))
    placement.start("one", 1, placement.work([_ids(2400, 30)], max_tokens=4, n=1, max_model_len=4096))
    # replica 1 would start it sooner (2,404 + 1,616 against 4,508 + 16), but less than a quarter sooner:
    # the replica that has the document keeps it
    assert placement.scores(question, [0, 1]) == {0: 4524, 1: 4020} and placement.choose(question, [0, 1], free) == 0
    placement.start("more", 0, placement.work([_ids(1000, 40)], max_tokens=4, n=1, max_model_len=4096))
    # now 5,528 against 4,020: over a quarter later, replica 0 is clearly busier
    assert placement.choose(question, [0, 1], free) == 1


def test_a_prompt_waits_for_the_full_replica_that_caches_it_unless_that_one_is_clearly_busier():
    placement = _placement()
    free = [0, 10_000]                                        # replica 0 has no room now, replica 1 is idle
    document = _ids(2000, 13)
    placement.start("doc", 0, placement.work([document], max_tokens=1, n=1, max_model_len=4096))
    placement.observe("doc", 1)                               # read: replica 0 caches it
    placement.start("busy", 0, placement.work([_ids(40, 14)], max_tokens=300, n=1, max_model_len=4096))
    question = placement.work([document + _ids(20, 15)], max_tokens=16, n=1, max_model_len=4096)
    # replica 0 would start it after 296 tokens of work (the output capped at avg_len 256) and 20 of its
    # own: far sooner than reading the document again on replica 1 (2,020), so it waits for replica 0
    assert placement.scores(question, [0, 1]) == {0: 296 + 20, 1: 2020}
    assert placement.choose(question, [1], free, waiting=[0]) is None
    # a replica that is down (not in waiting either) is no reason to wait
    assert placement.choose(question, [1], free) == 1
    # 3,000 more tokens of prefill on replica 0 (3,317 against 2,020): clearly busier, the question reads
    # the document on replica 1
    placement.start("more", 0, placement.work([_ids(3000, 16)], max_tokens=1, n=1, max_model_len=4096))
    assert placement.choose(question, [1], free, waiting=[0]) == 1


async def _question_admitted(waiting, admission: CreditQueue, placement: Placement, replica: int) -> None:
    """The queued "question" is admitted on `replica`, its 40-block document found cached there; then it ends."""
    got = await waiting
    assert got.replica == replica and placement.cached_tokens("question") == 40 * BS
    admission.ledger.release("question")
    placement.finish("question")


def test_a_queued_question_waits_for_its_documents_replica_and_is_admitted_there_when_it_is_read():
    async def scenario():
        placement = _placement()
        doc = _ids(40 * BS, 17)
        admission = CreditQueue("rag", [700, 1000], placement=placement)
        up = [False, True]                                        # replica 0 is still loading
        admission.is_up = lambda r: up[r]
        first = placement.work([doc + _ids(4, 18)], max_tokens=40, n=1, max_model_len=4096)
        question = placement.work([doc + _ids(4, 19)], max_tokens=40, n=1, max_model_len=4096)
        async with admission.hold("first", 700, work=first) as ticket:
            async with admission.hold("fill", 300, work=placement.work([_ids(100, 20)], 10, 1, 4096)) as fill:
                assert ticket.replica == fill.replica == 1 and admission.ledger.accounts[1].free == 0
                up[0] = True
                # replica 1 is full and still reading the document; replica 0 has room for a whole copy,
                # but the question waits for replica 1, where the document's blocks are being computed
                waiting = asyncio.ensure_future(admission.hold("question", 700, work=question).__aenter__())
                await asyncio.sleep(0)
                assert not waiting.done() and admission.ledger.num_queued == 1
                admission.observe("first", 1)                   # read: the question needs only its own 60
                assert admission.ledger.accounts[1].free == 0   # ... still held by fill and first
                await asyncio.sleep(0)
                assert not waiting.done()
            # fill ended: 300 credits back on replica 1, and the question's 60 fit beside the shared document
            await _question_admitted(waiting, admission, placement, replica=1)
        admission.ledger.check_integrity()
        assert placement.load == [0, 0]

    asyncio.run(scenario())


def _documents_replica_full(**queue) -> tuple[CreditQueue, Placement, object]:
    """Replica 0 has read a document and is full (700 of 700 held); replica 1 is empty: a question on the
    document, `question`, would wait for replica 0."""
    placement = _placement()
    admission = CreditQueue("rag", [700, 1000], placement=placement, **queue)
    doc = _ids(40 * BS, 21)
    read = placement.work([doc + _ids(4, 22)], max_tokens=40, n=1, max_model_len=4096)
    placement.start("read", 0, read)
    placement.finish("read")
    admission.ledger.submit("full", 700)
    assert [t.request_id for t in admission.ledger.admit(lambda ticket, fitting: 0)] == ["full"]
    return admission, placement, placement.work([doc + _ids(4, 23)], max_tokens=40, n=1, max_model_len=4096)


def test_a_question_that_cannot_wait_goes_where_there_is_room_not_to_its_documents_full_replica():
    """max_queue_seconds 0: nothing waits, so the question is not refused (429) for its document's replica
    being full while another has room: it runs on that other one."""
    async def scenario():
        admission, placement, question = _documents_replica_full(max_queue_seconds=0)
        async with admission.hold("question", 700, work=question) as ticket:
            assert ticket.replica == 1
        assert admission.num_expired == 0

    asyncio.run(scenario())


def test_a_question_waits_for_its_documents_replica_half_its_queue_limit_then_goes_where_there_is_room():
    """A finite max_queue_seconds: the question waits for the replica caching its document for half of it, then
    takes a replica with room (it was refused with a 503 at the limit while replica 1 sat idle); meanwhile its
    wait is no sign the pool is short of replicas (the autoscaler reads `oldest_credit_wait`)."""
    async def scenario():
        admission, placement, question = _documents_replica_full(max_queue_seconds=0.4)
        waiting = asyncio.ensure_future(admission.hold("question", 700, work=question).__aenter__())
        await asyncio.sleep(0.1)
        assert not waiting.done() and admission.oldest_credit_wait() == 0.0   # it fits: it waits by choice
        ticket = await asyncio.wait_for(waiting, 1.0)
        assert ticket.replica == 1 and admission.num_expired == 0

    asyncio.run(scenario())


def test_a_wait_for_the_prompts_replica_presses_once_it_fits_nowhere_and_a_spent_limit_goes_anywhere():
    """A question waiting for its document's full replica while another has room waits by choice (no pressure);
    once that other replica fills too it waits for capacity, and its wait counts. A request whose time is
    spent before its wait for credits begins (its other pool's credits, a device) takes any replica with room at
    once: it had a 503."""
    async def scenario():
        admission, placement, question = _documents_replica_full(max_queue_seconds=10)
        waiting = asyncio.ensure_future(admission.hold("question", 700, work=question).__aenter__())
        await asyncio.sleep(0.05)
        assert not waiting.done() and admission.oldest_credit_wait() == 0.0
        admission.reconcile(1000, replica=1)   # replica 1's worker reports its blocks in use (another gateway's)
        assert admission.ledger.accounts[1].free < 700 and not waiting.done()
        assert admission.oldest_credit_wait() > 0.04
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        spent, _, question2 = _documents_replica_full(max_queue_seconds=0.4)
        async with spent.hold("question", 700, work=question2, spent=0.5) as ticket:
            assert ticket.replica == 1 and spent.num_expired == 0

    asyncio.run(scenario())


def test_without_a_prefix_cache_no_replica_is_thought_to_cache_a_prompt():
    """`share_blocks` False (the pool's engine has `enable_prefix_caching: false`): nothing is matched or
    recorded, so a question does not wait for the replica that read its document (it would compute it again)."""
    placement = Placement(2, BS, max_cached_blocks=1000, avg_len=256, share_blocks=False)
    doc = _ids(40 * BS, 24)
    first = placement.work([doc + _ids(4, 25)], max_tokens=40, n=1, max_model_len=4096)
    assert placement.start("first", 0, first) == 0
    question = placement.work([doc + _ids(4, 26)], max_tokens=40, n=1, max_model_len=4096)
    assert placement.matched_tokens(question, 0) == 0
    assert placement.choose(question, [1], [0, 1000], waiting=[0]) == 1


def test_only_fitting_replicas_are_chosen_and_a_tie_goes_to_more_free_credits():
    placement = _placement(3)
    work = placement.work([_ids(100, 6)], max_tokens=10, n=1, max_model_len=512)
    assert placement.choose(work, [0, 2], [500, 900, 700]) == 2
    assert placement.choose(work, [1], [500, 900, 700]) == 1


def test_a_restarted_replica_forgets_its_cache_and_the_cache_is_bounded():
    placement = _placement(2, max_cached_blocks=4)
    doc = placement.work([_ids(6 * BS, 7)], max_tokens=1, n=1, max_model_len=512)
    placement.start("a", 0, doc)
    assert placement.matched_tokens(doc, 0) == 0   # 6 blocks into an LRU of 4: the first two went first
    short = placement.work([_ids(4 * BS, 8)], max_tokens=1, n=1, max_model_len=512)
    placement.start("b", 0, short)
    assert placement.matched_tokens(short, 0) == 4 * BS
    placement.forget(0)
    assert placement.matched_tokens(short, 0) == 0


def test_unset_max_tokens_counts_at_most_avg_len_per_sample():
    placement = _placement()
    work = placement.work([_ids(100, 9), _ids(50, 9)], max_tokens=None, n=2, max_model_len=4096)
    assert work.output_tokens == 2 * 2 * 256 and work.num_prompt_tokens == 150


# --- the ledger over replicas ----------------------------------------------------------------------


def test_a_request_waits_on_the_pool_and_goes_to_whichever_replica_frees_first():
    ledger = CreditLedger([100, 100])
    for r in ("a", "b", "c"):
        ledger.submit(r, 100)
    admitted = ledger.admit()
    assert sorted(t.replica for t in admitted) == [0, 1] and ledger.num_queued == 1
    on_one = next(t.request_id for t in admitted if t.replica == 1)
    ledger.release(on_one)
    (third,) = ledger.admit()
    assert third.request_id == "c" and third.replica == 1
    ledger.check_integrity()


def test_a_replica_that_is_down_takes_nothing_new():
    ledger = CreditLedger([100, 100])
    ledger.set_up(0, False)
    ledger.submit("a", 50)
    ledger.submit("b", 50)
    ledger.submit("c", 50)
    assert [t.replica for t in ledger.admit()] == [1, 1] and ledger.num_queued == 1
    assert ledger.free == 0                      # what is up: replica 1's, all held
    ledger.set_up(0, True)
    assert [t.replica for t in ledger.admit()] == [0]
    with pytest.raises(ValueError, match="num_tokens: 101 credits asked, the pool has 100 KV token slots per replica"):
        ledger.submit("big", 101)                # fits neither replica: never, so refused at once


def test_tenant_weights_hold_across_replicas():
    ledger = CreditLedger([50, 50], {"gold": TenantPolicy(weight=3)}, quantum=10)
    for i in range(60):
        ledger.submit(f"g{i}", 10, tenant="gold")
        ledger.submit(f"s{i}", 10, tenant="silver")
    order, running = [], []
    while True:
        admitted = ledger.admit()
        order += [t.request_id for t in admitted]
        running += admitted
        ledger.check_integrity()
        if not running:
            break
        ledger.release(running.pop(0).request_id)
    assert sum(r.startswith("g") for r in order[:40]) == 30


def test_the_admission_places_each_request_and_counts_its_load_until_it_ends():
    async def scenario():
        placement = _placement()
        admission = CreditQueue("chat", [64, 64], placement=placement)
        up = [True, True]
        admission.is_up = lambda r: up[r]
        works = [placement.work([_ids(30, i)], max_tokens=20, n=1, max_model_len=512) for i in range(3)]
        async with admission.hold("a", 64, work=works[0]) as a, admission.hold("b", 64, work=works[1]) as b:
            assert {a.replica, b.replica} == {0, 1} and placement.load == [50, 50]
            admission.observe("a", 5)            # first token: the prefill is done, 15 outputs to go
            assert placement.load[a.replica] == 15
            up[b.replica] = False                # b's replica died: the third waits for a's
            third = asyncio.ensure_future(admission.hold("c", 64, work=works[2]).__aenter__())
            await asyncio.sleep(0)
            assert not third.done()
        ticket = await third
        assert ticket.replica == a.replica and placement.load[a.replica] == 50
        admission.ledger.release("c")
        placement.finish("c")
        assert placement.load == [0, 0]
        admission.ledger.check_integrity()

    asyncio.run(scenario())


def test_questions_on_one_document_hold_its_blocks_once_after_it_is_read():
    ledger = CreditLedger([1000], block_size=BS)
    doc = tuple(range(40))                        # 40 prompt blocks: 640 of each request's 700 credits
    ledger.submit("first", 700, blocks=doc)
    ledger.submit("early", 700, blocks=doc)
    assert [t.request_id for t in ledger.admit()] == ["first"] and ledger.free == 300
    ledger.prefilled("early")                     # not admitted: nothing happens
    assert ledger.admit() == []                   # the first is still reading it: a second copy would not fit
    ledger.prefilled("first")                     # ... now it is read: a question takes only its own 60
    assert [t.request_id for t in ledger.admit()] == ["early"] and ledger.free == 240
    ledger.submit("third", 700, blocks=doc)
    assert [t.request_id for t in ledger.admit()] == ["third"] and ledger.free == 180
    ledger.check_integrity()
    assert ledger.release("first") == 60          # the blocks stay held while questions on them run
    assert ledger.release("third") == 60 and ledger.release("early") == 640 + 60
    assert ledger.free == ledger.total
    ledger.check_integrity()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_blocks_a_request_names_are_those_the_engine_reuses(prefix_caching):
    """Of a prompt the engine reuses the cached full blocks before its last token (none with caching off):
    what the ledger holds once for several requests is what the engine shares, so a request charged less
    for a shared block never finds the block missing (a prompt of whole blocks: its last one is its own)."""
    from engine.block_manager import BlockManager

    for length in (63, 64, 65, 80):
        prompt = _ids(length, length)
        placement = Placement(1, BS, max_cached_blocks=100, share_blocks=prefix_caching)
        named = placement.prompt_blocks(placement.work([prompt], 16, 1, max_model_len=256))
        engine = BlockManager(100, BS, enable_prefix_caching=prefix_caching)
        first: list[int] = []
        engine.allocate(first, length)
        engine.register_computed(first, prompt, length)
        reused = engine.acquire_cached([], prompt) // BS
        assert len(named) == reused == (((length - 1) // BS) if prefix_caching else 0), length
        assert named == tuple(block_hashes(prompt, BS)[:reused])


def test_two_copies_read_at_once_are_held_until_one_per_request_is_left():
    ledger = CreditLedger([3000], block_size=BS)
    doc = tuple(range(40))
    for rid in ("a", "b"):                        # both read the document at once: two copies
        ledger.submit(rid, 700, blocks=doc)
    assert len(ledger.admit()) == 2 and ledger.free == 3000 - 1400
    ledger.prefilled("a")
    ledger.submit("c", 700, blocks=doc)
    (c,) = ledger.admit()
    assert ledger.free == 3000 - 1460 and ledger.accounts[0].copies[0] == 2
    assert ledger.release("a") == 60              # three requests named it, two copies: both still needed
    assert ledger.release("b") == 60 + 640        # one request left: one copy is enough
    ledger.check_integrity()
    assert ledger.release("c") == 700 and ledger.free == 3000
    ledger.check_integrity()


# --- a head that waits for its replica holds back that replica alone ---------------------------------------


def _affine(replicas: dict[str, int]):
    """A `place` that sends each request with an affinity in `replicas` there or has it wait (None), and
    any other to the fitting replica with the most free credits, recording where each went."""
    placed: dict[str, int] = {}

    def place(ticket, fitting: list[int]) -> int | None:
        want = replicas.get(ticket.request_id)
        if want is not None:
            replica = want if want in fitting else None
        else:
            replica = fitting[0]
        if replica is not None:
            placed[ticket.request_id] = replica
        return replica
    return place, placed


def _ids_of(tickets) -> list[str]:
    return [t.request_id for t in tickets]


def test_a_head_waiting_for_its_replica_does_not_stop_the_others_and_is_not_starved():
    ledger = CreditLedger([100, 100])
    place, placed = _affine({"fill-a": 0, "fill-b": 0, "q": 0})
    for rid in ("fill-a", "fill-b"):
        ledger.submit(rid, 50)
    assert _ids_of(ledger.admit(place)) == ["fill-a", "fill-b"] and ledger.accounts[0].free == 0
    ledger.submit("q", 60)                                # waits for replica 0, which caches its prompt
    for rid in ("x", "y", "z"):
        ledger.submit(rid, 40)
    # replica 1 sits idle: the requests behind the waiting head go there (it used to stop the whole pool)
    assert _ids_of(ledger.admit(place)) == ["x", "y"] and placed["x"] == placed["y"] == 1
    ledger.check_integrity()
    ledger.release("fill-a")                              # 50 free on replica 0: z (40) would fit there ...
    assert ledger.admit(place) == [] and ledger.accounts[0].free == 50   # ... but replica 0 is held for q
    ledger.release("fill-b")
    assert _ids_of(ledger.admit(place)) == ["q", "z"] and placed["q"] == placed["z"] == 0   # q first, where it waited
    ledger.check_integrity()


def test_the_waiting_head_goes_first_whatever_the_tenants_turns():
    # Without the first head's precedence, the tenants' round robin puts t2 first once q's tenant has had its
    # turn, and t2's r2 would take replica 0's freed credits before q: q would wait for ever.
    ledger = CreditLedger([100, 100], quantum=1000)
    place, placed = _affine({"fill": 0, "q": 0})
    ledger.submit("fill", 100, tenant="t2")
    ledger.admit(place)
    ledger.submit("q", 60, tenant="t1")
    assert ledger.admit(place) == []
    ledger.submit("r1", 100, tenant="t2")
    assert _ids_of(ledger.admit(place)) == ["r1"] and placed["r1"] == 1
    ledger.submit("r2", 50, tenant="t2")
    assert ledger.admit(place) == []
    ledger.release("fill")
    assert _ids_of(ledger.admit(place)) == ["q"] and placed["q"] == 0
    ledger.check_integrity()
    assert ledger.admit(place) == [] and ledger.num_queued == 1          # r2 (50) waits: 40 free on 0, none on 1
    ledger.release("r1")
    assert _ids_of(ledger.admit(place)) == ["r2"]
    ledger.check_integrity()


def test_a_better_priority_that_waits_holds_its_replicas_from_a_worse_one():
    ledger = CreditLedger([100, 100], quantum=1000)
    place, placed = _affine({"fill": 0, "q": 0})
    ledger.submit("fill", 100)
    ledger.submit("busy", 30)
    assert _ids_of(ledger.admit(place)) == ["fill", "busy"] and placed["busy"] == 1
    ledger.submit("q", 30)                                # fits on replica 1, but waits for replica 0
    ledger.submit("low", 40, priority=5)                  # fits on replica 1 (70 free) ...
    ledger.submit("high", 80, priority=0)                 # ... but high, before it in fair order, waits for room there
    assert ledger.admit(place) == []                      # so low does not pass it
    ledger.release("busy")
    assert _ids_of(ledger.admit(place)) == ["high"] and placed["high"] == 1
    ledger.check_integrity()
    ledger.release("fill")
    assert _ids_of(ledger.admit(place)) == ["q", "low"] and placed["q"] == placed["low"] == 0
    ledger.check_integrity()


def test_a_queued_question_holds_back_only_its_documents_replica():
    async def scenario():
        placement = _placement()
        doc = _ids(40 * BS, 21)
        admission = CreditQueue("rag", [1000, 1000], placement=placement)
        first = placement.work([doc + _ids(4, 22)], max_tokens=40, n=1, max_model_len=4096)
        async with admission.hold("first", 1000, work=first) as ticket:
            assert ticket.replica == 0                        # the document is read on replica 0, full
            question = placement.work([doc + _ids(4, 23)], max_tokens=40, n=1, max_model_len=4096)
            waiting = asyncio.ensure_future(admission.hold("question", 700, work=question).__aenter__())
            await asyncio.sleep(0)
            assert not waiting.done()                         # it waits for replica 0, where the document is
            other = placement.work([_ids(200, 24)], max_tokens=40, n=1, max_model_len=4096)
            async with admission.hold("other", 300, work=other) as beside:
                assert beside.replica == 1                    # replica 1 serves the rest of the queue meanwhile
            assert not waiting.done()
        await _question_admitted(waiting, admission, placement, replica=0)
        admission.ledger.check_integrity()

    asyncio.run(asyncio.wait_for(scenario(), 10))   # the whole pool used to wait for replica 0


# --- the engine corrects the prefix record --------------------------------------------------------------


def test_a_miss_the_engine_reports_drops_the_blocks_used_before_the_one_it_missed():
    placement = _placement(1)
    docs = {name: placement.work([_ids(4 * BS + 3, seed)], max_tokens=1, n=1, max_model_len=512)
            for name, seed in (("a", 31), ("b", 32), ("c", 33))}
    for name, work in docs.items():                        # a, then b, then c: a is the least recently used
        placement.start(name, 0, work)
        placement.finish(name)
    assert all(placement.matched_tokens(w, 0) == 4 * BS for w in docs.values())
    placement.start("b-again", 0, docs["b"])
    assert placement.cached_tokens("b-again") == 4 * BS
    placement.engine_cached("b-again", 0, 4 * BS)           # the engine found what the record promised
    assert placement.matched_tokens(docs["a"], 0) == 4 * BS
    placement.engine_cached("b-again", 0, BS)               # it found one block: b's second was evicted ...
    assert placement.matched_tokens(docs["a"], 0) == 0      # ... and a, used before it, with it (LRU)
    assert placement.matched_tokens(docs["c"], 0) == 4 * BS  # c was used after it: kept
    assert placement.matched_tokens(docs["b"], 0) == 4 * BS  # b itself is cached again: b-again computed it
    placement.engine_cached("nobody", 0, 0)                 # an unknown request, or prompt: nothing
    placement.engine_cached("b-again", 3, 0)
    placement.finish("b-again")
    placement.check_integrity()


def test_the_engine_counts_at_most_the_prompt_less_one_token_and_that_is_no_miss():
    placement = _placement(1)
    old = placement.work([_ids(2 * BS, 41)], max_tokens=1, n=1, max_model_len=512)
    placement.start("old", 0, old)
    placement.finish("old")
    whole = placement.work([_ids(4 * BS, 42)], max_tokens=1, n=1, max_model_len=512)   # exactly 4 blocks
    placement.start("w", 0, whole)
    placement.finish("w")
    placement.start("w2", 0, whole)
    placement.engine_cached("w2", 0, 3 * BS)                # a hit of 3 blocks: the engine's most for 64 tokens
    assert placement.matched_tokens(old, 0) == 2 * BS       # nothing dropped
    placement.engine_cached("w2", 0, 2 * BS)                # one block short: a miss
    assert placement.matched_tokens(old, 0) == 0


def test_the_record_survives_a_reconnection_and_is_wiped_by_a_new_process():
    placement = _placement()
    admission = CreditQueue("rag", [1000, 1000], placement=placement)
    doc = placement.work([_ids(8 * BS, 43)], max_tokens=1, n=1, max_model_len=512)
    placement.start("doc", 1, doc)
    placement.finish("doc")
    admission.replica_ready(1, restarted=False)             # the same replica process, reached again
    assert placement.matched_tokens(doc, 1) == 8 * BS
    admission.replica_ready(1)                              # a new process: its cache is empty
    assert placement.matched_tokens(doc, 1) == 0


def test_a_block_still_being_computed_when_placed_is_no_evidence_of_an_eviction():
    placement = _placement(1)
    old = placement.work([_ids(2 * BS, 44)], max_tokens=1, n=1, max_model_len=512)
    placement.start("old", 0, old)
    placement.finish("old")
    doc = placement.work([_ids(6 * BS + 1, 45)], max_tokens=1, n=1, max_model_len=512)
    placement.start("reader", 0, doc)                      # reading the document: its blocks are not cached yet
    placement.start("twin", 0, doc)                         # placed beside it, promised the blocks being read
    placement.engine_cached("twin", 0, 0)                   # the engine had none of them: no eviction
    assert placement.matched_tokens(old, 0) == 2 * BS
    placement.finish("reader")
    placement.finish("twin")
    placement.check_integrity()


def test_the_waiting_head_goes_before_its_own_tenants_later_requests_too():
    """A tenant whose large request waits (the first head) cannot stream smaller urgent ones past it into the
    credits it waits for while another tenant waits: they would starve every tenant held back behind it.
    Alone in the queue, its own order rules (they delay only its own request)."""
    ledger = CreditLedger(1000, quantum=1000)
    ledger.submit("fill", 900, tenant="t2")
    ledger.admit()
    ledger.submit("large", 600, tenant="t1", priority=1)
    assert ledger.admit() == []                                   # waits for replica 0: the first head
    ledger.submit("b", 100, tenant="t2")
    ledger.submit("a", 100, tenant="t1", priority=0)              # more urgent, later, of the first head's tenant
    assert ledger.admit() == []                                   # 100 free: neither takes what "large" waits for
    ledger.release("fill")
    got = _ids_of(ledger.admit())
    assert got[0] == "large" and sorted(got) == ["a", "b", "large"]
    ledger.check_integrity()
    alone = CreditLedger(1000, quantum=1000)
    alone.submit("fill", 900, tenant="t2")
    alone.admit()
    alone.submit("large", 600, tenant="t1", priority=1)
    assert alone.admit() == []
    alone.submit("a", 100, tenant="t1", priority=0)
    assert _ids_of(alone.admit()) == ["a"]                        # t1 alone waits: its priority order rules
    alone.check_integrity()
    ledger.check_integrity()
