"""Several gateways on one replica: each connection a `Session`, all served by one engine loop, each
holding a lease on a share of the replica's KV credits.

A replica placed on a cluster (`engine.remote`) may be reached by several gateways at once (two gateways
of one config behind a load balancer, or one restarting while the other serves). The engine loop
(`engine.worker._serve`) then serves a `SessionHub`, which looks to it like one channel: `receive`
returns every session's commands, `send` routes each output to the session whose request it is, a
heartbeat to every session, those the loop has not taken in yet too (a hung step shows to a new gateway).

**Request ids.** A session's ids are prefixed with its tag inside the engine (`s3/chatcmpl-…`), so two
gateways that pick the same id never meet; what a session is sent carries its own ids again.

**Leases: the replica is the authority on its blocks.** Each pool's capacity is its blocks x block
size in KV token slots, the unit of the gateway's credits (`pools.credits.ledger`). A gateway admits
requests only within its lease on each pool (`Lease`, the account's total); each `AddRequest` says the
credits it holds (`credits`), which the session counts as `reserved` until the request ends. The hub
keeps, for every pool,

    sum over sessions of max(lease, reserved) <= capacity

so the gateways together can never promise more KV than the replica has, whatever the order in which their
messages cross. The shares follow demand (`SessionHub.targets`, `lease_shares`): each gateway reports what its
queue asks of the replica (`ReportWaiting`: the credits its waiting requests ask for, and the request first in
line, its credits and how long it has waited); a session's demand is what its running interactive requests
reserve plus what its interactive queue asks, in steps of a sixteenth of the pool (kept until it moves more
than a step). The pool is shared max-min fair over the demands, every session keeping at least half an equal
share (an idle gateway admits its next requests at once); what is left goes max-min fair to the sessions'
batch lines, running (`AddRequest.background`) and queued (they take only what interactive demand leaves, as
within one gateway), and what nothing takes raises the smallest shares to one level: alone, a session leases
the whole pool; k idle ones capacity / k each; one busy beside an idle one, three quarters. A request first in
line that needs more than its gateway's share (a long document beside another busy gateway) is not starved:
the session whose such request has waited longest (a batch line only while no interactive request is first in
line at any gateway) is given that much, and the others share the rest, below their floor if need be, until it
is admitted; meanwhile its own gateway admits nothing before it, so its running requests drain. A lease that
shrinks takes effect when the gateway acknowledges it (`LeaseAck`: every request it admitted under the larger
lease was sent before the ack, on the same ordered connection), and what it then frees goes to the sessions
below their share as its reserved credits come back; a lease that grows is granted at once from what no
session holds. A session that ends (its gateway closed, was killed, or went silent past the link's deadline)
has its requests aborted, and its share is offered to the others at once.

**Back-pressure per session.** A gateway that reads its outputs slowly (a busy event loop) is this
session's concern alone: once its outbox holds over `engine.worker.MAX_OUTBOX_BYTES`, its requests are
paused (they keep their blocks and place) until the outbox is down to half of that, and the loop steps on
for the others; the loop's own back-pressure counts only the sessions not throttled.

`num_session_blocks` in each pool's stats is the blocks the session's own requests hold, which the
gateway reconciles its credits with (the replica's whole usage would count the other gateways' requests
against it).

Thread rules: `attach` is called from the thread that accepts connections; `send` from the loop and the
heartbeat thread (a lock keeps the session list whole; `Outputs`, which may throttle a session and so pause
its requests, only from the loop); everything else from the loop's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field

from engine.ipc import FrameError
from engine.lease_shares import counted_demand as _counted, held_credits, lease_shares, reserved_credits
from engine.messages import (AbortRequest, AddRequest, Fatal, Lease, LeaseAck, Outputs, PauseRequest, Ready,
                             Rejected, ReportWaiting, Shutdown, StatsQuery, StatsReply)

log = logging.getLogger("cliffguard.engine")

__all__ = ["Session", "SessionHub", "held_credits", "lease_shares", "reserved_credits"]

DEMAND_STEPS = 16   # demands count in steps of 1/16 of a pool: a lease moves with the queue, not with every request
LAST_WORDS_SECONDS = 0.5   # a session that ends for its link's fault hears why this long (the loop waits on it)


@dataclass
class Session:
    """One gateway's connection: its channel, tag, leases (acknowledged and offered) and reservations."""

    channel: object                     # an engine.worker.WorkerChannel
    tag: str                            # the prefix of its request ids in the engine
    name: str = ""                      # for the log: the peer's address
    leases: dict[str, int] = field(default_factory=dict)     # pool -> credits it may hold (acknowledged)
    offered: dict[str, tuple[int, int]] = field(default_factory=dict)   # pool -> (a smaller lease sent, its epoch)
    reserved: dict[str, int] = field(default_factory=dict)   # pool -> credits its live requests hold
    requests: dict[str, tuple[str, int, bool]] = field(default_factory=dict)   # engine id -> (pool, credits,
    # a batch line's)
    reserved_batch: dict[str, int] = field(default_factory=dict)   # pool -> ... of `reserved`, batch lines'
    waiting: dict[str, int] = field(default_factory=dict)    # pool -> requests waiting at its gateway
    queued: dict[str, int] = field(default_factory=dict)     # pool -> credits its waiting requests ask for
    queued_batch: dict[str, int] = field(default_factory=dict)   # pool -> ... its waiting batch lines
    counted: dict[tuple[str, bool], int] = field(default_factory=dict)   # (pool, batch lines') -> the demand
    # its share was last computed from
    heads: dict[str, tuple[bool, float, int]] = field(default_factory=dict)   # pool -> first in line:
    # (a batch line, since when it waits, the credits it needs)
    epoch: int = 0
    closed: bool = False
    stats_asked: int = 0                # StatsQuery messages not answered yet
    throttled: bool = False             # its outbox is over MAX_OUTBOX_BYTES: its requests are paused here
    paused: set[str] = field(default_factory=set)   # engine ids its gateway paused (a throttle never resumes them)

    def held(self, pool: str) -> int:
        """What the hub counts this session as holding of `pool`: its lease, or more while its
        reservations are over it (a lease just shrunk)."""
        return max(self.leases.get(pool, 0), self.reserved.get(pool, 0))


class SessionHub:
    """The sessions of one replica's engine, as one channel for `engine.worker._serve`. `counters` is its own
    account of each pool (reserved and held credits, their high-water marks `peak_reserved` and `peak_held`
    since start), readable from any thread."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.block_size = block_size = engine.kv_cache.block_size
        self.capacity = {name: s.block_manager.num_blocks * block_size for name, s in engine.schedulers.items()}
        self.default_pool = engine.default_pool
        self.sessions: list[Session] = []
        self.eof = False                    # a replica's loop outlives its sessions
        self._pending: list[Session] = []   # attached by the accept thread, adopted by the loop
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._tags = 0
        self.num_sessions = 0
        self.peak_reserved = dict.fromkeys(self.capacity, 0)   # pool -> the most credits ever reserved at once
        self.peak_held = dict.fromkeys(self.capacity, 0)       # pool -> the most credits ever held at once
        self._unchecked: list[Session] = []   # sessions sent outputs since the loop last read `num_pending_bytes`

    # --- sessions come and go ----------------------------------------------------------------------
    def attach(self, channel, name: str = "") -> None:
        """A new authenticated connection (any thread): the loop adopts it at its next turn."""
        with self._lock:
            self._tags += 1
            self._pending.append(Session(channel, f"s{self._tags}/", name))
        os.write(self._wake_w, b"x")

    def _adopt(self) -> None:
        """Sessions the accept thread attached: each is told its lease on every pool (perhaps 0 while
        the others give theirs back), then `Ready`; so its gateway never admits before it knows."""
        from engine.worker import engine_stats, worker_info

        with self._lock:
            pending, self._pending = self._pending, []
            self.sessions.extend(pending)
        if not pending:
            return
        self.rebalance()
        for session in pending:
            self.num_sessions += 1
            log.info("replica: gateway session %s%s opened (%d sessions)", session.tag, session.name,
                     len(self.sessions))
            for pool in self.capacity:
                if not session.epoch or session.leases.get(pool, 0) == 0:
                    self._send_lease(session, pool, session.leases.get(pool, 0))
            self._safe_send(session, Ready(worker_info(self.engine)))
            self._send_outputs(session, Outputs([], engine_stats(self.engine)))   # its metrics have numbers at once

    def _end(self, session: Session, why: str) -> None:
        """A session is over: abort what it left in flight, free its share for the others."""
        if session.closed:
            return
        session.closed = True
        with self._lock:
            self.sessions.remove(session)
        session.channel.close()
        for request_id in list(session.requests):
            if request_id in self.engine.requests:
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - as a gateway's own abort that fails: the others' steps go on
                    log.exception("replica: aborting %s, its gateway gone, failed", request_id)
        session.requests.clear()
        session.reserved.clear()
        session.reserved_batch.clear()
        session.leases.clear()
        log.info("replica: gateway session %s%s ended (%s); %d left", session.tag, session.name, why,
                 len(self.sessions))
        self._report_waiting()
        self.rebalance()

    # --- leases ------------------------------------------------------------------------------------
    def targets(self, pool: str) -> dict[int, int]:
        """Each session's lease on `pool` (by index), in whole blocks: `lease_shares` of the pool's blocks over
        the sessions' demands (what their requests reserve plus what their queues ask, rounded up to a
        `DEMAND_STEPS`th of the pool; their batch lines' apart), the session whose request first in line has
        waited longest and needs more than its share given that much first (a batch line only while no
        interactive request is first in line anywhere)."""
        sessions, bs = self.sessions, self.block_size
        if not sessions:
            return {}
        blocks = self.capacity[pool] // bs
        step = bs * max(1, blocks // DEMAND_STEPS)
        demands, batch = [], []
        for s in sessions:   # running batch lines count as batch demand
            lines = s.reserved_batch.get(pool, 0)
            demands.append(_counted(s, (pool, False), s.reserved.get(pool, 0) - lines + s.queued.get(pool, 0), step))
            batch.append(_counted(s, (pool, True), lines + s.queued_batch.get(pool, 0), step))
        demands, batch = [d // bs for d in demands], [b // bs for b in batch]
        shares = lease_shares(blocks, demands, batch=batch)
        heads = sorted((*s.heads[pool][:2], i, -(-s.heads[pool][2] // bs)) for i, s in enumerate(sessions)
                       if pool in s.heads)   # interactive requests first, then the longest waiting
        if heads and not heads[0][0]:       # while one waits, no batch line goes first (as in one gateway)
            heads = [h for h in heads if not h[0]]
        first = next(((i, need) for _, _, i, need in heads if shares[i] < need), None)
        if first is not None:
            shares = lease_shares(blocks, demands, first, batch)
        return {i: n * bs for i, n in enumerate(shares)}

    def rebalance(self) -> None:
        """Offer each session its target: a smaller lease is sent and waits for its ack (one offered and
        no longer wanted gives way to the lease held); a larger one is granted from what no session holds."""
        for pool in self.capacity:
            targets = self.targets(pool)
            for i, session in enumerate(self.sessions):
                target, lease = targets[i], session.leases.get(pool, 0)
                if target < lease and session.offered.get(pool, (None,))[0] != target:
                    self._send_lease(session, pool, target)
                    session.offered[pool] = (target, session.epoch)
                elif target >= lease and pool in session.offered:
                    del session.offered[pool]
                    self._send_lease(session, pool, lease)
            for i, session in enumerate(self.sessions):
                lease = session.leases.get(pool, 0)
                if targets[i] > lease:
                    grant = min(targets[i], lease + self.unheld(pool))
                    if grant > lease:
                        session.leases[pool] = grant
                        self._send_lease(session, pool, grant)
            self._note_peaks(pool)

    def unheld(self, pool: str) -> int:
        """Credits of `pool` no session holds (neither leased nor reserved)."""
        return self.capacity[pool] - held_credits(self.sessions, pool)

    def _send_lease(self, session: Session, pool: str, tokens: int) -> None:
        session.epoch += 1
        self._safe_send(session, Lease(pool, tokens, session.epoch))

    def _acknowledged(self, session: Session, msg: LeaseAck) -> None:
        if session.offered.get(msg.pool) == (msg.tokens, msg.epoch):   # that offer, not an older one of as much
            session.leases[msg.pool] = msg.tokens
            del session.offered[msg.pool]
            self.rebalance()

    def _note_peaks(self, pool: str) -> None:
        """Raise `pool`'s high-water marks to its reserved and held credits now (called wherever either grows:
        an `AddRequest`, a lease granted)."""
        if pool in self.capacity:
            reserved = reserved_credits(self.sessions, pool)
            self.peak_reserved[pool] = max(self.peak_reserved[pool], reserved)
            self.peak_held[pool] = max(self.peak_held[pool], held_credits(self.sessions, pool))

    def counters(self) -> dict:
        """The replica's own counters, for a look from outside (any thread: it reads ints): the sessions now
        and served so far, and per pool its capacity, the credits every session's requests reserve and every
        session holds (`held_credits`), their high-water marks since start, and each session's lease."""
        with self._lock:
            sessions = list(self.sessions)
        pools = {pool: {"capacity": capacity, "reserved_credits": reserved_credits(sessions, pool),
                        "held_credits": held_credits(sessions, pool), "peak_reserved": self.peak_reserved[pool],
                        "peak_held": self.peak_held[pool], "leases": [s.leases.get(pool, 0) for s in sessions]}
                 for pool, capacity in self.capacity.items()}
        return {"num_sessions": len(sessions), "num_sessions_served": self.num_sessions, "pools": pools}

    # --- the channel the loop sees -----------------------------------------------------------------
    @property
    def num_pending_bytes(self) -> int:
        """The largest outbox of a session not throttled (a throttled one holds up none but its own requests).
        The loop reads it before stepping: a session whose outbox a send took past the bound is throttled
        first (here, not at that send: mid-turn, a request its gateway added in the same read was not yet
        the engine's, and would have run unpaused)."""
        unchecked, self._unchecked = self._unchecked, []
        for session in unchecked:
            if not session.closed:
                self._throttle(session)
        return max((s.channel.num_pending_bytes for s in self.sessions if not s.throttled), default=0)

    def fileno(self) -> int:
        return self._wake_r

    def flush(self) -> bool:
        done, self._unchecked = True, []   # every session is throttled here, or not
        for session in list(self.sessions):
            try:
                done = session.channel.flush() and done
            except OSError as exc:
                self._end(session, f"connection lost: {exc}")
                continue
            self._throttle(session)
        return done

    def _throttle(self, session: Session) -> None:
        """Pause a session's requests while its outbox is over MAX_OUTBOX_BYTES, until it is down to half
        (those its gateway paused stay paused)."""
        from engine.worker import MAX_OUTBOX_BYTES

        pending = session.channel.num_pending_bytes
        if session.throttled == (pending > (MAX_OUTBOX_BYTES // 2 if session.throttled else MAX_OUTBOX_BYTES)):
            return
        session.throttled = not session.throttled
        log.warning("replica: gateway session %s%s %s (%d bytes unread)", session.tag, session.name,
                    "reads too slowly: its requests pause" if session.throttled else "reads again", pending)
        for engine_id in session.requests.keys() - session.paused:
            self.engine.pause(engine_id, session.throttled)

    def receive(self) -> list:
        """Every session's commands, their request ids in the engine's form. A session that ends here (its
        Shutdown, or the end of its connection) has nothing after its Shutdown read, and no request of it
        added or resumed: its requests would run for nobody, on blocks its share no longer counts."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        self._adopt()
        messages = []
        for session in list(self.sessions):
            try:
                received = session.channel.receive()
            except OSError as exc:
                if isinstance(exc, FrameError):   # its gateway hears why: the link's doing, not its requests'
                    self._last_words(session, Fatal(f"replica: the gateway's commands cannot be read: {exc}",
                                                    unreadable=True))
                self._end(session, f"connection lost: {exc}")
                continue
            inbound = [out for msg in received if not session.closed for out in self._inbound(session, msg)]
            if session.channel.eof and not session.closed:   # the replica's reason (silence) where it has one
                self._end(session, getattr(session.channel, "end_reason", None) or "the gateway closed the connection")
            messages += [m for m in inbound if not (session.closed and isinstance(m, (AddRequest, PauseRequest)))]
        self._report_waiting()   # the sums once every session of this turn is read (one that left counts nothing)
        return messages

    def _inbound(self, session: Session, msg) -> list:
        match msg:
            case AddRequest():
                engine_id = session.tag + msg.request_id
                if engine_id in session.requests:   # its own running request's id: the first one stays counted
                    self._safe_send(session, Rejected(msg.request_id, f"request id {msg.request_id!r} is in use"))
                    return []
                pool = msg.pool or self.default_pool
                session.requests[engine_id] = (pool, msg.credits, msg.background)
                session.reserved[pool] = session.reserved.get(pool, 0) + msg.credits
                if msg.background:
                    session.reserved_batch[pool] = session.reserved_batch.get(pool, 0) + msg.credits
                self._note_peaks(pool)
                added = dataclasses.replace(msg, request_id=engine_id)
                return [added, PauseRequest(engine_id, True)] if session.throttled else [added]
            case AbortRequest():   # its credits free now: its gateway reuses them at once, maybe in this read
                self._release(session, session.tag + msg.request_id)
                return [dataclasses.replace(msg, request_id=session.tag + msg.request_id)]
            case PauseRequest():
                engine_id = session.tag + msg.request_id
                if msg.paused and engine_id not in session.requests:
                    return []   # it ended before its gateway's pause came: nothing to pause, nothing to keep
                (session.paused.add if msg.paused else session.paused.discard)(engine_id)
                if session.throttled and not msg.paused:
                    return []   # it steps again once its gateway reads (`_throttle`)
                return [dataclasses.replace(msg, request_id=engine_id)]
            case ReportWaiting():
                session.waiting[msg.pool] = msg.count
                if msg.pool in self.capacity:
                    self._demand(session, msg)
                return []   # the pool's sum over the sessions goes to the composer at the end of `receive`
            case LeaseAck():
                self._acknowledged(session, msg)
                return []
            case StatsQuery():
                session.stats_asked += 1
                return [msg]
            case Shutdown():   # one gateway leaving: its session ends, the replica serves on
                self._end(session, "the gateway shut down")
                return []
        return [msg]

    def _demand(self, session: Session, msg: ReportWaiting) -> None:
        """A gateway's demand on a pool changed: what its queue asks, and its request first in line."""
        session.queued[msg.pool] = max(0, msg.queued)
        session.queued_batch[msg.pool] = max(0, msg.queued_batch)
        if msg.head > 0:
            session.heads[msg.pool] = (msg.head_background, time.monotonic() - max(0.0, msg.head_waited), msg.head)
        else:
            session.heads.pop(msg.pool, None)
        self.rebalance()

    def _report_waiting(self) -> None:   # every pool: one that a session that left waited on falls to 0
        for pool in set(self.capacity) | {pool for s in self.sessions for pool in s.waiting}:
            self.engine.composer.set_external_waiting(pool, sum(s.waiting.get(pool, 0) for s in self.sessions))

    def send(self, msg) -> None:
        """Route one message of the loop (or of the heartbeat thread) to the sessions it concerns."""
        with self._lock:
            sessions, waiting = list(self.sessions), list(self._pending)
        match msg:
            case Outputs():
                for session in sessions:
                    self._send_outputs(session, msg)
            case Rejected():
                session = self._owner(sessions, msg.request_id)
                if session is not None:
                    self._release(session, msg.request_id)
                    self._safe_send(session, dataclasses.replace(msg, request_id=msg.request_id[len(session.tag):]))
            case StatsReply():
                for session in sessions:
                    if session.stats_asked:
                        session.stats_asked -= 1
                        self._safe_send(session, StatsReply(self._stats_for(session, msg.stats)))
            case _:   # Heartbeat, Fatal: every session's, and those the loop has not taken in (a hung step's
                for session in sessions + waiting:   # heartbeats tell a gateway that connected meanwhile)
                    self._safe_send(session, msg)

    def _send_outputs(self, session: Session, msg: Outputs) -> None:
        deltas = []
        for delta in msg.deltas:
            if delta.request_id.startswith(session.tag):
                if delta.finished:
                    self._release(session, delta.request_id)
                deltas.append(dataclasses.replace(delta, request_id=delta.request_id[len(session.tag):]))
        stats = self._stats_for(session, msg.stats) if msg.stats is not None else None
        if deltas or stats is not None:
            self._safe_send(session, Outputs(deltas, stats))
            if not any(s is session for s in self._unchecked):   # throttled, if over the bound, before the loop
                self._unchecked.append(session)                     # steps (`num_pending_bytes`) or at `flush`

    def _owner(self, sessions: list[Session], request_id: str) -> Session | None:
        return next((s for s in sessions if request_id.startswith(s.tag)), None)

    def _release(self, session: Session, engine_id: str) -> None:
        """A request ended: its credits are no longer reserved; the shares follow the demand that is left."""
        entry = session.requests.pop(engine_id, None)
        session.paused.discard(engine_id)
        if entry is not None:
            pool, credits, background = entry
            session.reserved[pool] = session.reserved.get(pool, 0) - credits
            if background:
                session.reserved_batch[pool] -= credits
            if credits:
                self.rebalance()   # its demand fell; what it held over its lease may go to another session

    def _stats_for(self, session: Session, stats):
        """The engine's stats with each pool's `num_session_blocks`: the blocks this session's requests hold, each
        once (a prompt's are shared by its samples and its prefix cache's readers; the gateway's ledger too)."""
        blocks: dict[str, set[int]] = {}
        for engine_id, (pool, _, _) in session.requests.items():
            state = self.engine.requests.get(engine_id)
            if state is not None:
                blocks.setdefault(pool, set()).update(b for seq in state.seqs for b in seq.block_table)
        pools = {name: dataclasses.replace(ps, num_session_blocks=len(blocks.get(name, ())),
                                           reserved_credits=reserved_credits(self.sessions, name),
                                           held_credits=held_credits(self.sessions, name))
                 for name, ps in stats.pools.items()}
        return dataclasses.replace(stats, pools=pools)

    def _last_words(self, session: Session, msg) -> None:
        """`msg` to a session about to end, given a moment (`LAST_WORDS_SECONDS`) to go out."""
        try:
            session.channel.send(msg)
            session.channel.drain(LAST_WORDS_SECONDS)
        except (OSError, ValueError):   # ValueError: its socket closed under us
            pass

    def _safe_send(self, session: Session, msg) -> None:
        try:
            session.channel.send(msg)
        except OSError:
            pass   # the loop ends the session at its next flush or receive

    def wait(self, timeout: float | None = None) -> None:
        """Sleep until a session's command (or a new session) arrives, an outbox may drain, or a
        session's silence deadline passes (`engine.remote.ReplicaChannel`)."""
        with self._lock:
            sessions = list(self.sessions)
        now = time.monotonic()
        for session in sessions:
            silence = getattr(session.channel, "silence_seconds", None)
            if silence is not None:
                left = max(0.0, session.channel.last_heard + silence - now)
                timeout = left if timeout is None else min(timeout, left)
        poller = select.poll()   # not select(): a replica of many connections has descriptors past 1024
        try:
            poller.register(self._wake_r, select.POLLIN)
            for s in sessions:
                poller.register(s.channel.sock, select.POLLIN | (select.POLLOUT if s.channel.num_pending_bytes else 0))
            poller.poll(None if timeout is None else timeout * 1000)
        except (OSError, ValueError):
            time.sleep(0.01)   # a socket closed under us: the next turn ends its session
        for s in sessions:   # listening: a silent gateway's time (not the replica's own, stepping)
            if (listened := getattr(s.channel, "listened", None)) is not None:
                listened(time.monotonic() - now)

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout   # every session's (and those not taken in yet: a Fatal went to them
        with self._lock:                        # too), though an earlier one did not drain in time
            sessions = self.sessions + self._pending
        return all([s.channel.drain(max(0.0, deadline - time.monotonic())) for s in sessions])

    def close(self) -> None:
        for session in list(self.sessions):
            session.channel.close()
