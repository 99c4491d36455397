"""Leases on a shared replica's KV credits follow the gateways' demand (engine.sessions, docs/SCALE.md):
the shares are max-min fair with an idle floor (`lease_shares`), a request larger than an equal share
runs beside another connected gateway, and one that needs more than its share while the other gateway
is busy is given it first, once the other's running requests are within its smaller lease, and the
other's queue is served after it.

Each gateway here is what `cliffguard serve` wires for a shared replica: a `CreditQueue` of the pool's
credits whose lease the replica sets (as `gateway.workers.supervisor` does), the queue's demand reported
by `AdmissionControl._report_waiting` (the admission's reconcile tick), and a `RemoteEngineClient`."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine.config import CacheConfig, EngineConfig, PoolConfig
from engine.remote_client import RemoteEngineClient
from engine.sampling import SamplingParams
from engine.messages import (AbortRequest, AddRequest, Lease, LeaseAck, Outputs, PauseRequest, Rejected, ReportWaiting,
                             Shutdown)
from engine.sessions import Session, SessionHub, held_credits, lease_shares
from gateway.admission import AdmissionControl
from pools.credits.queue import CreditQueue, reservation
from tests.conftest import make_tiny_model, started_replica
from tests.engine.test_remote import _Link, _until

BLOCK = 8
BLOCKS = 64             # 512 credits: an equal share of two gateways is 256
MAX_MODEL_LEN = 512     # the tiny model's


def test_shares_are_max_min_fair_with_an_idle_floor_and_add_up_to_the_pool():
    assert lease_shares(100, [0, 0]) == [50, 50]              # idle gateways: equal shares
    assert lease_shares(100, [100, 0]) == [75, 25]            # busy beside idle: the idle keeps half a share
    assert lease_shares(100, [30, 0]) == [50, 50]             # nobody wants more than an equal share
    assert lease_shares(16, [10, 0]) == [10, 6]               # 5/8 asked beside idle: 5/8 and 3/8
    assert lease_shares(100, [100, 100]) == [50, 50]
    assert lease_shares(100, [10, 100, 100]) == [16, 42, 42]  # the small demand floored at 100 // 6, the rest split
    assert lease_shares(100, [60, 20, 100]) == [40, 20, 40]   # 20 met, the others max-min fair
    assert lease_shares(100, [70]) == [100]                   # alone: the whole pool
    assert lease_shares(100, [100, 100], first=(1, 70)) == [30, 70]   # the longest-waiting large request first
    assert lease_shares(100, [100, 0, 100], first=(0, 90)) == [90, 5, 5]
    assert lease_shares(7, [0, 0]) == [4, 3] and lease_shares(0, [5, 5]) == [0, 0]
    # batch lines take only what the other demands leave, as within one gateway
    assert lease_shares(100, [0, 100], batch=[100, 0]) == [25, 75]
    assert lease_shares(100, [0, 0], batch=[100, 0]) == [75, 25]
    assert lease_shares(100, [0, 40], batch=[100, 0]) == [60, 40]
    for demands in ([0], [3, 9], [50, 50, 1], [1, 2, 3, 4, 5], [100, 100, 100, 100]):
        for first in (None, (0, 60)):
            shares = lease_shares(97, demands, first, batch=demands[::-1])
            assert sum(shares) == 97 and min(shares) >= 0, (demands, first, shares)


def test_the_admission_reports_demand_only_to_a_replica_that_leases_and_only_when_it_changed():
    """`AdmissionControl._report_waiting`: a local worker hears the queue's count; a shared replica (its
    client holds a lease) also the credits queued and the request first in line; an unchanged report is
    not sent again, a new client is told at once."""
    class Client:
        def __init__(self, leases):
            self.leases, self.reports = leases, []

        def report_waiting(self, pool, count, **demand):
            self.reports.append((pool, count, demand))

    async def main():
        queue = CreditQueue("chat", 1000)
        queue.lease(0, 400, lambda: None)
        waiting = asyncio.ensure_future(_hold(queue, "big", 700))
        await asyncio.sleep(0.01)
        admission, pool = SimpleNamespace(_reported={}), SimpleNamespace(name="chat", admission=queue)
        local, shared = Client({}), Client({"chat": 400})
        for client in (local, shared, shared):
            AdmissionControl._report_waiting(admission, pool, 0, client, 1)
        nothing = dict(queued=0, queued_batch=0, head=0, head_waited=0.0, head_background=False)
        assert local.reports == [("chat", 1, nothing)]
        (said,) = shared.reports
        assert said[:2] == ("chat", 1) and said[2]["head_waited"] > 0
        assert said[2] | {"head_waited": 0.0} == nothing | {"queued": 700, "head": 700}
        waiting.cancel()
        await asyncio.sleep(0.01)
        AdmissionControl._report_waiting(admission, pool, 0, shared, 0)
        assert shared.reports[-1] == ("chat", 0, nothing)   # nothing waits any more: said once

    asyncio.run(main())


async def _hold(queue: CreditQueue, request_id: str, credits: int) -> None:
    async with queue.hold(request_id, credits):
        pass


class _Channel:
    def __init__(self):
        self.sent = []
        self.incoming = []   # what the next `receive` reads
        self.eof = False
        self.num_pending_bytes = 0   # what its gateway has not read yet

    def flush(self):
        return not self.num_pending_bytes

    def send(self, msg):
        self.sent.append(msg)

    def receive(self):
        received, self.incoming = self.incoming, []
        return received

    def close(self):
        pass


def _hub() -> tuple[SessionHub, Session, Session]:
    """The replica's side alone: a `SessionHub` over a fake engine of one 64-block pool, two sessions on
    their equal leases."""
    pool = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=BLOCKS))
    waiting = {}
    engine = SimpleNamespace(kv_cache=SimpleNamespace(block_size=BLOCK), schedulers={"p": pool}, default_pool="p",
                             composer=SimpleNamespace(set_external_waiting=waiting.__setitem__, waiting=waiting),
                             requests={})
    hub = SessionHub(engine)
    first, second = Session(_Channel(), "s1/"), Session(_Channel(), "s2/")
    hub.sessions.append(first)
    hub.rebalance()
    hub.sessions.append(second)
    hub.rebalance()
    hub._inbound(first, LeaseAck("p", 256, first.epoch))
    assert (first.leases, second.leases) == ({"p": 256}, {"p": 256})
    return hub, first, second


def test_an_offer_no_longer_wanted_gives_way_to_the_lease_held_and_its_late_ack_changes_nothing():
    """The second session's large request first in line has the first offered a smaller lease; the
    request leaves before the first acknowledges, so the first is told its lease again; the request
    comes back and the same amount is offered anew: the late ack of the withdrawn offer (an older epoch)
    changes nothing, only the ack of the new one does."""
    hub, first, second = _hub()
    first.reserved["p"] = 240                                   # running requests, not within a smaller lease
    large = ReportWaiting("p", 1, queued=304, head=304, head_waited=0.5)
    hub._inbound(second, large)
    offer = (208, first.epoch)
    assert first.offered == {"p": offer} and first.channel.sent[-1] == Lease("p", *offer)
    hub._inbound(second, ReportWaiting("p", 0))                 # the large request left the queue
    assert first.offered == {} and first.channel.sent[-1] == Lease("p", 256, first.epoch)
    hub._inbound(second, large)                                 # and came back: 208 offered again
    assert first.offered == {"p": (208, first.epoch)} and first.epoch == offer[1] + 2
    hub._inbound(first, LeaseAck("p", *offer))                  # the late ack of the withdrawn offer
    assert (first.leases, second.leases) == ({"p": 256}, {"p": 256})
    first.reserved["p"] = 120
    hub._inbound(first, LeaseAck("p", 208, first.epoch))        # the ack of this one
    assert (first.leases, second.leases) == ({"p": 208}, {"p": 304})
    assert held_credits(hub.sessions, "p") <= BLOCKS * BLOCK


def test_what_a_leaving_gateway_sent_in_its_last_read_is_not_run_for_nobody():
    """A gateway's requests that arrive in the same read as its Shutdown (or as the end of its connection: a
    killed gateway's last step) are not added: they would run for nobody, on blocks its share, now the
    other's, no longer counts. Nothing after a Shutdown is read; the other session gets the whole pool."""
    params = SamplingParams(max_tokens=4)
    for ending in ("shutdown", "eof"):
        hub, first, second = _hub()
        first.channel.incoming = [AddRequest("a", [1, 2], params, pool="p", credits=64)]
        if ending == "shutdown":
            first.channel.incoming += [Shutdown(), AddRequest("b", [3], params, pool="p", credits=64)]
        else:
            first.channel.eof = True
        second.channel.incoming = [AddRequest("c", [4], params, pool="p", credits=64)]
        messages = hub.receive()
        assert [m.request_id for m in messages if isinstance(m, AddRequest)] == ["s2/c"], ending
        assert hub.sessions == [second] and first.reserved == {} and second.leases.get("p", 0) <= BLOCKS * BLOCK
        assert held_credits(hub.sessions, "p") <= BLOCKS * BLOCK


def test_a_session_ended_for_its_gateways_silence_says_so(caplog):
    """The replica's reason for the end of a connection (a partition's silence, `ReplicaChannel.end_reason`) is
    what its log says, not a clean close by the gateway."""
    for reason, said in (("nothing from the gateway for 20.3 s", "nothing from the gateway for 20.3 s"),
                         (None, "the gateway closed the connection")):
        hub, first, _ = _hub()
        first.channel.eof, first.channel.end_reason = True, reason
        caplog.clear()
        with caplog.at_level("INFO", logger="cliffguard"):
            hub.receive()
        assert any(said in record.getMessage() for record in caplog.records), [r.getMessage() for r in caplog.records]


def test_an_abort_that_fails_for_a_leaving_gateway_ends_its_session_alone():
    """Aborting what a gateway that left had in flight may fail (an engine's bug): logged, as a gateway's own
    abort that fails, and the session still ends; it went up through the loop and ended the replica for
    every gateway."""
    hub, first, second = _hub()
    hub.engine.requests["s1/a"] = object()
    first.requests["s1/a"] = ("p", 64, False)

    def abort(request_id):
        raise KeyError(request_id)
    hub.engine.abort = abort
    first.channel.eof = True
    hub.receive()
    assert hub.sessions == [second] and first.closed and not first.requests


def test_a_leaving_gateways_queue_no_longer_presses_the_pool():
    """The composer hears each pool's gateway queue summed over sessions: a gateway that leaves takes its
    queue with it, also when no other session ever reported one for that pool."""
    hub, first, second = _hub()
    hub._inbound(first, ReportWaiting("p", 5))
    hub._report_waiting()
    assert hub.engine.composer.waiting == {"p": 5}
    hub._inbound(first, Shutdown())
    assert hub.engine.composer.waiting == {"p": 0}


def test_a_queue_reported_in_a_leaving_gateways_last_read_presses_nothing():
    """A killed gateway's last frames (its queue's report) and the end of its connection arrive in one read;
    another session's report read before that end does not carry the leaving one's queue either."""
    for order in ("own", "other's first"):
        hub, first, second = _hub()
        first.channel.incoming, first.channel.eof = [ReportWaiting("p", 5)], True
        if order == "other's first":
            hub.sessions.reverse()                                   # the survivor is read first
            second.channel.incoming = [ReportWaiting("p", 2)]
        assert not any(isinstance(m, ReportWaiting) for m in hub.receive())
        assert hub.engine.composer.waiting["p"] == (0 if order == "own" else 2), order


def test_an_abort_frees_its_credits_before_what_its_gateway_admits_with_them_in_the_same_read():
    """The gateway frees an aborted request's credits at once and may admit another with them; both arrive in
    one read: the hub counts the pool's credits as held once, never past its capacity."""
    hub, first, second = _hub()
    params = SamplingParams(max_tokens=4)
    hub._inbound(first, AddRequest("a", [1], params, pool="p", credits=256))
    hub._inbound(second, AddRequest("c", [1], params, pool="p", credits=256))
    first.channel.incoming = [AbortRequest("a"), AddRequest("b", [2], params, pool="p", credits=256)]
    messages = hub.receive()
    assert [(type(m).__name__, m.request_id) for m in messages] == [("AbortRequest", "s1/a"), ("AddRequest", "s1/b")]
    assert held_credits(hub.sessions, "p") <= BLOCKS * BLOCK and hub.peak_held["p"] <= BLOCKS * BLOCK
    assert first.requests == {"s1/b": ("p", 256, False)}


def test_a_session_whose_outbox_a_step_takes_past_the_bound_is_throttled_at_once():
    """Throttled at the send that takes it past MAX_OUTBOX_BYTES, not at the next flush: until then the loop's
    back-pressure counted it, and every gateway's requests waited on the slow one."""
    from engine.outputs import RequestDelta
    from engine.worker import MAX_OUTBOX_BYTES

    hub, first, second = _hub()
    hub.engine.pause = lambda *args: None
    hub._inbound(first, AddRequest("a", [1], SamplingParams(max_tokens=4), pool="p", credits=8))

    def send(msg):   # a client that stopped reading: this step's outputs take its outbox over the bound
        first.channel.num_pending_bytes = MAX_OUTBOX_BYTES + 1

    first.channel.send = send
    hub.send(Outputs([RequestDelta("s1/a", [], False)], None))
    assert hub.num_pending_bytes <= MAX_OUTBOX_BYTES and first.throttled   # read before the loop steps


def test_a_request_added_in_the_read_whose_abort_takes_the_outbox_past_the_bound_is_paused():
    """[abort a, add b] in one read: the abort's last output (sent while the read is handled) takes the outbox
    over the bound before b is the engine's; b is paused all the same, before the loop steps."""
    from engine.outputs import RequestDelta
    from engine.worker import MAX_OUTBOX_BYTES

    hub, first, second = _hub()
    paused = {}
    hub.engine.pause = lambda engine_id, on: engine_id in hub.engine.requests and paused.__setitem__(engine_id, on)
    params = SamplingParams(max_tokens=4)
    hub._inbound(first, AddRequest("a", [1], params, pool="p", credits=8))
    hub.engine.requests["s1/a"] = object()
    first.channel.incoming = [AbortRequest("a"), AddRequest("b", [2], params, pool="p", credits=8)]
    for msg in hub.receive():   # as the worker handles them, in order
        if isinstance(msg, AbortRequest):
            del hub.engine.requests[msg.request_id]
            first.channel.num_pending_bytes = MAX_OUTBOX_BYTES + 1     # its last output, unread
            hub.send(Outputs([RequestDelta(msg.request_id, [], True)], None))
        else:
            hub.engine.requests[msg.request_id] = object()
    assert hub.num_pending_bytes <= MAX_OUTBOX_BYTES and paused == {"s1/b": True}


def test_a_failed_steps_last_words_reach_every_gateway_though_one_drains_slowly():
    hub, first, second = _hub()
    drained = []
    first.channel.drain = lambda timeout: drained.append("first") or False    # its outbox never empties
    second.channel.drain = lambda timeout: drained.append("second") or True
    assert not hub.drain(0.1) and drained == ["first", "second"]


def test_a_gateway_whose_frames_cannot_be_read_hears_so_and_only_its_session_ends():
    """The link's doing, not its requests': its gateway is told (`Fatal` unreadable), counting the end against
    none of them, as a local worker's own gateway is; the other session serves on."""
    from engine.ipc import FrameError
    from engine.messages import Fatal

    hub, first, second = _hub()

    def corrupt():
        raise FrameError("ipc: a frame of 18446744073709551615 bytes: the stream is corrupt")

    first.channel.receive, first.channel.drain = corrupt, lambda timeout: True
    hub.receive()
    assert hub.sessions == [second] and first.closed
    fatal = first.channel.sent[-1]
    assert isinstance(fatal, Fatal) and fatal.unreadable and "cannot be read" in fatal.traceback


def test_an_idle_replica_keeps_no_list_of_the_sessions_its_stats_went_to():
    """Stats go to every session every couple of seconds while nothing steps (the loop never reads
    `num_pending_bytes` then): the sessions to throttle-check are taken at each turn's flush, once each."""
    hub, first, second = _hub()
    hub._stats_for = lambda session, stats: stats
    for _ in range(5):
        hub.send(Outputs([], "stats"))
    assert len(hub._unchecked) == 2
    hub.flush()
    assert hub._unchecked == []


def test_a_pause_that_comes_after_its_request_ended_is_not_kept():
    hub, first, second = _hub()
    hub._inbound(first, AddRequest("a", [1], SamplingParams(max_tokens=4), pool="p", credits=8))
    hub._inbound(first, AbortRequest("a"))                      # ended (as a finished one is released)
    assert hub._inbound(first, PauseRequest("a", True)) == [] and first.paused == set()


def test_a_request_id_in_use_on_its_session_is_refused_and_the_first_stays_counted():
    hub, first, second = _hub()
    params = SamplingParams(max_tokens=4)
    assert hub._inbound(first, AddRequest("a", [1], params, pool="p", credits=64))
    assert hub._inbound(first, AddRequest("a", [2], params, pool="p", credits=96)) == []
    assert first.channel.sent[-1] == Rejected("a", "request id 'a' is in use")
    assert first.requests == {"s1/a": ("p", 64, False)} and first.reserved == {"p": 64}
    assert hub._inbound(second, AddRequest("a", [3], params, pool="p", credits=64))   # another session's own id


def test_a_gateway_that_reads_slowly_pauses_its_own_requests_not_the_replica():
    """One gateway stops reading (its outbox past MAX_OUTBOX_BYTES): its requests pause, new ones too, and the
    loop's back-pressure counts only the other session, which steps on (the whole replica stopped at the slow
    gateway's pace). Read again (down to half), they resume, but for the one its gateway paused itself."""
    from engine.worker import MAX_OUTBOX_BYTES

    hub, first, second = _hub()
    paused = {}
    hub.engine.pause = paused.__setitem__
    params = SamplingParams(max_tokens=4)
    for request_id in ("a", "b"):
        hub._inbound(first, AddRequest(request_id, [1], params, pool="p", credits=8))
    hub._inbound(second, AddRequest("c", [1], params, pool="p", credits=8))
    hub._inbound(first, PauseRequest("b", True))               # its gateway's own pause (a slow client)
    first.channel.num_pending_bytes, second.channel.num_pending_bytes = MAX_OUTBOX_BYTES + 1, 1000
    hub.flush()
    assert first.throttled and paused == {"s1/a": True} and hub.num_pending_bytes == 1000
    added = hub._inbound(first, AddRequest("d", [1], params, pool="p", credits=8))
    assert [type(m).__name__ for m in added] == ["AddRequest", "PauseRequest"] and added[1].paused
    assert hub._inbound(first, PauseRequest("b", False)) == []   # resumed by its gateway: once it reads again
    first.channel.num_pending_bytes = MAX_OUTBOX_BYTES // 2 + 1
    hub.flush()
    assert first.throttled                                      # not yet down to half
    first.channel.num_pending_bytes = MAX_OUTBOX_BYTES // 2
    hub.flush()
    assert not first.throttled and paused == {"s1/a": False, "s1/b": False, "s1/d": False}
    assert "s2/c" not in paused and hub.num_pending_bytes == MAX_OUTBOX_BYTES // 2


def test_a_sessions_blocks_are_counted_once_however_many_of_its_sequences_share_them():
    """`num_session_blocks` (what the gateway reconciles its ledger with) counts each block a session's
    requests hold once: an n = 4 request's 5 prompt blocks and 4 own blocks are 9, and a second request
    reading the same prefix adds only its own block; another session's request is not this one's."""
    from engine.stats import EngineStats, PoolStats

    hub, first, second = _hub()
    prompt = list(range(5))
    hub.engine.requests = {
        "s1/a": SimpleNamespace(seqs=[SimpleNamespace(block_table=prompt + [10 + i]) for i in range(4)]),
        "s1/b": SimpleNamespace(seqs=[SimpleNamespace(block_table=prompt + [20])]),
        "s2/c": SimpleNamespace(seqs=[SimpleNamespace(block_table=[30, 31])])}
    first.requests.update({"s1/a": ("p", 0, False), "s1/b": ("p", 0, False)})
    second.requests["s2/c"] = ("p", 0, False)
    stats = EngineStats(num_requests=3, pools={"p": PoolStats(
        num_running=6, num_waiting=0, num_swapped=0, num_blocks=BLOCKS, num_free_blocks=BLOCKS - 12,
        num_cached_free_blocks=0, kv_cache_usage=12 / BLOCKS, max_num_seqs=8, cpu_swap_usage=0.0)}, step=None,
        taken_at=0.0)
    assert hub._stats_for(first, stats).pools["p"].num_session_blocks == 10
    assert hub._stats_for(second, stats).pools["p"].num_session_blocks == 2


def test_an_interactive_request_first_in_line_goes_before_a_batch_line_that_waited_longer():
    """The first session queues batch lines (3,040 credits), the second interactive requests (304): batch
    lines, queued or running, take only what the interactive demand leaves (192 and 320). Both sessions'
    first in line need 304 credits: the first's a batch line queued an hour ago, which would need
    priority, the second's an interactive request queued a second ago, which fits its share: no batch
    line goes first while an interactive request waits anywhere; alone, the batch line does."""
    hub, first, second = _hub()
    hub._inbound(first, ReportWaiting("p", 0, queued_batch=3040))
    hub._inbound(second, ReportWaiting("p", 1, queued=304))
    assert hub.targets("p") == {0: 192, 1: 320}
    lines = [AddRequest(f"line-{i}", [1, 2], SamplingParams(), credits=128, background=True) for i in range(2)]
    for line in lines:                          # running batch lines count as batch demand too
        hub._inbound(first, line)
    hub._inbound(second, ReportWaiting("p", 1, queued=1000))
    assert hub.targets("p") == {0: 128, 1: 384} and first.reserved == {"p": 256}
    for line in lines:
        hub._release(first, "s1/" + line.request_id)
    hub._inbound(second, ReportWaiting("p", 1, queued=304))
    assert hub.targets("p") == {0: 192, 1: 320} and first.reserved_batch == {"p": 0}
    hub._inbound(first, ReportWaiting("p", 0, queued_batch=3040, head=304, head_waited=3600.0, head_background=True))
    hub._inbound(second, ReportWaiting("p", 1, queued=304, head=304, head_waited=1.0))
    assert hub.targets("p") == {0: 192, 1: 320}
    hub._inbound(second, ReportWaiting("p", 1, queued=400, head=400, head_waited=1.0))   # more than its share
    assert hub.targets("p") == {0: 112, 1: 400}
    hub._inbound(second, ReportWaiting("p", 0))
    assert hub.targets("p") == {0: 384, 1: 128}   # then the batch lines' share: busy beside idle


class _Gateway:
    """One gateway's side of the shared replica (see the module docstring)."""

    def __init__(self, server, name: str) -> None:
        self.name = name
        self.queue = CreditQueue("default", BLOCKS * BLOCK)
        self.client = RemoteEngineClient(server.config, _Link(server))
        self.client.on_lease = self._lease
        self.pool = SimpleNamespace(name="default", admission=self.queue)
        self.admission = SimpleNamespace(_reported={})
        self.admitted: list[tuple[str, float]] = []   # (request id, when) in the order admitted

    def _lease(self, pool: str, tokens: int) -> bool:
        self.queue.lease(0, tokens, lambda: self.client.ack_leases([pool]))
        return False

    async def start(self) -> None:
        await self.client.start(timeout=30)
        self._reporter = asyncio.create_task(self._report())

    async def _report(self) -> None:
        while True:   # the admission's reconcile tick, faster
            count = self.queue.ledger.num_queued
            AdmissionControl._report_waiting(self.admission, self.pool, 0, self.client, count)
            await asyncio.sleep(0.02)

    @property
    def lease(self) -> int:
        return self.client.leases.get("default", 0)

    async def run(self, request_id: str, max_tokens: int, *, paused: asyncio.Event | None = None) -> int:
        """Hold the request's credits, then stream it to the end (after `paused` is set, if given: the
        request holds its credits and blocks meanwhile); returns the tokens it generated."""
        credits = reservation([3], max_tokens, 1, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async with self.queue.hold(request_id, credits):
            self.admitted.append((request_id, time.monotonic()))
            stream = self.client.generate([5, 6, 7], params, request_id=request_id, credits=credits)
            tokens = len((await stream.__anext__()).outputs[0].delta_token_ids)
            if paused is not None:
                self.client.pause(request_id, True)
                await paused.wait()
                self.client.pause(request_id, False)
            async for delta in stream:
                tokens += len(delta.outputs[0].delta_token_ids)
        return tokens

    async def stop(self) -> None:
        self._reporter.cancel()
        await self.client.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_path):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-leases"), "llama", builtin_path)
    config = EngineConfig(model=str(folder), cache=CacheConfig(block_size=BLOCK),
                          pools=(PoolConfig(num_blocks=BLOCKS),))
    server = started_replica(config, timeout=30)
    assert server.state == "ready"
    return server


async def _two_gateways(server) -> tuple[_Gateway, _Gateway]:
    first, second = _Gateway(server, "first"), _Gateway(server, "second")
    await first.start()
    await second.start()
    await _until(lambda: first.lease == second.lease == BLOCKS * BLOCK // 2)
    return first, second


def _counters(server) -> dict:
    return server._hub.counters()["pools"]["default"]


def test_a_request_larger_than_an_equal_share_runs_beside_an_idle_gateway(server):
    """300 tokens (304 credits) against shares of 256: the busy gateway's lease grows to its demand (in
    sixteenths of the pool: 320), the idle one keeps the rest and serves a small request at once meanwhile."""
    async def main():
        first, second = await _two_gateways(server)
        large = asyncio.create_task(first.run("large", 300))
        await _until(lambda: first.admitted)
        assert first.lease == 320 and second.lease == 192
        assert await asyncio.wait_for(second.run("small", 8), 10) == 8     # beside it, within its share
        assert await asyncio.wait_for(large, 30) == 300
        await _until(lambda: first.lease == second.lease == 256)            # both idle again
        assert _counters(server)["peak_held"] <= BLOCKS * BLOCK
        await first.stop()
        await second.stop()

    asyncio.run(main())


def test_a_large_request_beside_a_busy_gateway_goes_first_once_the_other_is_within_its_smaller_lease(server):
    """The second gateway runs three requests (120 credits each, held paused) and queues two more: busy
    beside an idle gateway, it leases three quarters of the pool. The first then asks 304 credits, more
    than any share: it is given them first, the second offered 208, which it acknowledges only once
    two of its running requests have finished; then the large request is admitted, before the second's
    queue, whose requests all run after it."""
    async def main():
        first, second = await _two_gateways(server)
        go = [asyncio.Event() for _ in range(3)]
        running = [asyncio.create_task(second.run(f"busy-{i}", 112, paused=go[i])) for i in range(3)]
        await _until(lambda: len(second.admitted) == 3)
        queued = [asyncio.create_task(second.run(f"queued-{i}", 112)) for i in range(2)]
        await _until(lambda: second.queue.ledger.num_queued == 2)
        assert (first.lease, second.lease) == (128, 384)
        large = asyncio.create_task(first.run("large", 300))
        await _until(lambda: second.queue.ledger.accounts[0].total == 208)   # its lease offered smaller
        go[0].set()                                                            # 240 of its credits still held
        await asyncio.sleep(0.3)
        assert not first.admitted and first.lease == 128 and len(second.admitted) == 3
        assert _counters(server)["held_credits"] <= BLOCKS * BLOCK
        go[1].set()                                                            # 120 held: within 208
        assert await asyncio.wait_for(large, 30) == 300
        go[2].set()
        assert await asyncio.wait_for(asyncio.gather(*running, *queued), 30) == [112] * 5
        assert first.admitted[0][1] < min(t for rid, t in second.admitted if rid.startswith("queued"))
        await _until(lambda: first.lease == second.lease == 256)
        counters = _counters(server)
        assert counters["peak_held"] <= BLOCKS * BLOCK and counters["reserved_credits"] == 0
        await first.stop()
        await second.stop()

    asyncio.run(main())


def test_a_demand_that_moves_within_a_step_moves_no_lease():
    """Demands count in sixteenths of the pool (32 credits here) and are kept until they move more than
    a step: a queue hovering at a step's edge sends no lease to and fro."""
    hub, first, second = _hub()
    for queued, shares in ((300, {0: 320, 1: 192}), (330, {0: 320, 1: 192}), (290, {0: 320, 1: 192}),
                           (360, {0: 384, 1: 128}), (0, {0: 256, 1: 256})):
        hub._inbound(first, ReportWaiting("p", 1, queued=queued))
        assert hub.targets("p") == shares, queued


def test_a_batch_lines_engine_request_says_it_is_one_and_carries_its_credits():
    """What the gateway sends for a request placed by the admission (`local_answer.merged`): its credits,
    and whether they are a batch line's (`Placed.background`, from the ledger's ticket), which a shared
    replica counts as batch demand."""
    from engine.outputs import RequestDelta
    from gateway.admission import Placed
    from gateway.local_answer import merged

    sent = []

    class Client:
        async def generate(self, ids, params, **kwargs):
            sent.append(kwargs)
            yield RequestDelta(kwargs["request_id"], [], True)

    async def main(background: bool):
        pool = SimpleNamespace(name="chat", clients=[Client()], cache_salt=lambda tenant: None)
        placed = {"chat": Placed(pool, 0, "r@chat", 96, background)}
        return [i async for i, _ in merged([(pool, [1, 2, 3])], SamplingParams(), 0, "r", placed)]

    assert asyncio.run(main(True)) == [0] and asyncio.run(main(False)) == [0]
    assert [(k["credits"], k["background"]) for k in sent] == [(96, True), (96, False)]


def test_the_hub_waits_on_connections_past_descriptor_1024():
    """A replica holding many connections has sockets past descriptor 1024, which select() cannot watch
    (ValueError: the hub slept 10 ms and polled again, a busy loop): the hub sleeps until a session speaks."""
    import os
    import socket

    hub, first, second = _hub()
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)
    first.channel.sock = socket.socket(fileno=high)
    second.channel.sock = theirs
    try:
        started = time.monotonic()
        hub.wait(0.5)
        assert time.monotonic() - started >= 0.45            # nothing to read: it slept
        theirs.sendall(b"x")
        started = time.monotonic()
        hub.wait(5.0)
        assert time.monotonic() - started < 1.0               # the high socket spoke: it woke
    finally:
        for sock in (ours, theirs, first.channel.sock):
            sock.close()
