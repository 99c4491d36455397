"""Flows: fairness inside one tenant's channel of the credit queue (`pools.credits.ledger`).

A tenant (one API key, or everyone when there are no keys) may send a burst of large requests and a
small one at once. First come, first served would make the small one wait behind the whole burst;
here the requests of a channel are split into flows by size class (`flow_class`: the credits asked,
in blocks, by powers of two), and the flows share the channel by start-time fair queueing in
credits: each request is tagged on arrival with `start = max(its flow's last finish, the channel's
virtual time)` and `finish = start + credits`, and the head with the smallest start goes next. So a
small request that arrives behind sixteen large ones is next but one, and a burst of small ones
cannot pass a large one for longer than it asks for itself: each flow gets the channel's credits in
turn, by what it asks.

Order alone does not help while the burst holds every credit (credits come back only when a request ends). So
in an interactive pool (one with an SLO) a flow's request that would take it past `(FLOW_CAP - 1) / FLOW_CAP`
of a replica's credits or sequences, while it already holds some, waits (`Headroom`): the reserve left is room
where another flow's request starts at once. The cap itself idles at most twice the reserve: a request over it
that fits still goes where waiting would leave more free. So a load of one size alone runs on 7/8 of the pool
when its requests are small, and the cap never keeps more than 2/8 of a replica idle, whatever their size (two
half-pool requests run together); a pool of fewer than 8 sequences is not capped in sequences. A request
larger than the cap still runs, alone in its flow. A flow held back by its cap does not block the queue: the
next flow's head goes. A throughput pool has no cap (its requests gain nothing from starting sooner, and its
concurrency is a few sequences: a cap would cost it one in seven).

A tenant's share of the queue is its `TenantPolicy`; its channels, one per priority, and its allowance
in the ledger's deficit round robin across tenants are a `TenantQueue`. Batch lines, served behind every
interactive request, share their own queue across tenants the same way, a tenant being a flow there, its
tag moved on by its credits over its weight (`BatchLines`). Ints only, like the ledger.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_TENANT = "default"
WEIGHT_SCALE = 1 << 10   # batch lines' fair-queueing tags: credits x WEIGHT_SCALE / the tenant's weight
MAX_IDLE_LANES = 16   # a tenant's empty priority channels kept for their fair-queueing tags (`TenantQueue`)
FLOW_CAP = 8   # an interactive pool's flow past 7/8 of a replica's credits or sequences waits (`Headroom`)


def flow_class(num_tokens: int, block_size: int) -> int:
    """A request's size class: requests within a factor of two of each other in blocks share a flow (a
    class of four let 24 chats of n = 4 x 36 tokens, 11 blocks each, queue a 16-token chat of 4 blocks
    behind all of them in one FIFO)."""
    blocks = max(1, -(-num_tokens // block_size))
    return blocks.bit_length() - 1


class Queued(Protocol):
    tenant: str
    flow: int
    num_tokens: int
    start: int
    cost: int
    floor: int
    arrival: int


@dataclass
class FlowChannel:
    """One (tenant, priority) channel: a FIFO per flow, served by start-time fair queueing in credits.
    Supports what the ledger does with a FIFO: append, the order of heads, pop, remove, len, iter."""

    flows: dict[Hashable, deque] = field(default_factory=dict)   # flow -> its tickets, FIFO
    finish: dict[Hashable, int] = field(default_factory=dict)    # flow -> finish tag of its last ticket queued
    vtime: int = 0                                               # start tag of the last ticket served
    num_arrived: int = 0

    def _flow(self, ticket: Queued) -> Hashable:
        return ticket.flow

    def append(self, ticket: Queued, cost: int | None = None) -> None:
        """Queue `ticket`; its flow's tag moves on by `cost` (default: the credits it asks)."""
        flow = self._flow(ticket)
        ticket.floor = self.vtime
        ticket.start = max(self.finish.get(flow, 0), self.vtime)
        ticket.arrival, self.num_arrived = self.num_arrived, self.num_arrived + 1
        ticket.cost = ticket.num_tokens if cost is None else cost
        self.finish[flow] = ticket.start + ticket.cost
        self.flows.setdefault(flow, deque()).append(ticket)

    def heads(self) -> list:
        """Each flow's first ticket, the smallest start tag first (ties: the first to arrive)."""
        return sorted((q[0] for q in self.flows.values()), key=lambda t: (t.start, t.arrival))

    def pop(self, ticket: Queued) -> None:
        """Take `ticket`, the head of its flow, out: it is served."""
        if self.flows[self._flow(ticket)][0] is not ticket:
            raise ValueError("pop: not the head of its flow")
        self._take_out(ticket)
        self.vtime = max(self.vtime, ticket.start)

    def remove(self, ticket: Queued) -> None:
        """Take a queued ticket out (cancelled: its client left, or it waited past its limit), and its cost out
        of its flow's tags: the later tickets' starts and the flow's finish are tagged again as if it had never
        come (each still at least the virtual time it came at). A flow is charged for what it ran, not for what
        it asked and gave up (ten timed-out requests put its next one behind ten requests' credits of others')."""
        flow = self._flow(ticket)
        queue = self.flows[flow]
        # Its start is where the flow's tag stood before it, or its floor, which every later ticket's is past
        # (the virtual time only grows): the tags after it, started from there, are those it never touched.
        finish = ticket.start
        for later in list(queue)[queue.index(ticket) + 1:]:
            later.start = max(finish, later.floor)
            finish = later.start + later.cost
        self.finish[flow] = finish
        self._take_out(ticket)

    def _take_out(self, ticket: Queued) -> None:
        flow = self._flow(ticket)
        queue = self.flows[flow]
        queue.remove(ticket)
        if not queue:
            del self.flows[flow]

    def __len__(self) -> int:
        return sum(len(q) for q in self.flows.values())

    def __iter__(self) -> Iterator:
        for queue in self.flows.values():
            yield from queue


@dataclass
class BatchLines(FlowChannel):
    """The batch lines of a pool (the ledger's background tickets), a FIFO per tenant, the tenants sharing
    the lines' turns by start-time fair queueing in credits over their weights: a tenant with ten batches
    queued and one with one batch take turns by the credits their lines ask (divided by the tenant's
    weight), not by arrival. Lines are tried in that order (`in_order`); one that waits for its replicas
    may be passed by a later one (`serve` takes any ticket). A tenant's tag is forgotten once it has no
    line queued and its tag is behind the virtual time (it would start there anyway), and every tag when
    no line is queued (nobody is owed a turn): a gateway taking any key as a tenant keeps nothing for keys
    that came once."""

    def _flow(self, ticket: Queued) -> Hashable:
        return ticket.tenant

    def append_line(self, ticket: Queued, weight: int) -> None:
        # tags in credits x WEIGHT_SCALE / weight: ints, and a weight of up to WEIGHT_SCALE keeps its share
        self.append(ticket, cost=-(-ticket.num_tokens * WEIGHT_SCALE // weight))

    def in_order(self) -> Iterator:
        """Every queued line, the smallest start tag first (ties: the first to arrive); FIFO per tenant (a
        tenant's tags grow with its arrivals, so its FIFOs merge). The queue may change while it is read."""
        return heapq.merge(*(list(q) for q in self.flows.values()), key=lambda t: (t.start, t.arrival))

    def first(self) -> Queued | None:
        heads = self.heads()
        return heads[0] if heads else None

    def serve(self, ticket: Queued) -> None:
        """Take `ticket` out, admitted (not necessarily its tenant's first: its first may wait for its replicas)."""
        self._take_out(ticket)
        self.vtime = max(self.vtime, ticket.start)
        for tenant in [t for t, tag in self.finish.items() if tag <= self.vtime and t not in self.flows]:
            del self.finish[tenant]

    def _take_out(self, ticket: Queued) -> None:
        super()._take_out(ticket)
        if not self.flows:
            self.finish.clear()


@dataclass
class Headroom:
    """What each flow holds on one replica (credits and sequences), and whether one more request of it fits
    under the cap. Keys are `Ticket.flow_key`: tenant, priority, size class, batch line or not."""

    total: int
    max_seqs: int | None = None
    cap: int | None = None        # FLOW_CAP, or None: no cap (the holdings are still counted)
    held: dict[Hashable, list[int]] = field(default_factory=dict)   # key -> [credits, sequences]

    def allows(self, key: Hashable, num_tokens: int, num_seqs: int, free: int, free_seqs: int | None) -> bool:
        """Whether one more request of flow `key` (`num_tokens` credits, `num_seqs` sequences) keeps within the
        cap on the replica, which has `free` credits and `free_seqs` sequences free (None: not counted). Over
        the cap it still goes where it fits and waiting would idle more than twice the reserve (`total // cap`):
        a request as large as the reserve would otherwise keep up to its own size idle (one of two half-pool
        requests). One that does not fit is held by the cap all the same (it waits for its own flow, never as
        the first in line)."""
        tokens, seqs = self.held.get(key, (0, 0))
        if self.cap is None or tokens == 0:
            return True    # a flow's first request on the replica always may (it may be larger than the cap)
        reserve = self.total // self.cap
        if tokens + num_tokens > self.total - max(1, reserve) and not (num_tokens <= free and free > 2 * reserve):
            return False
        if self.max_seqs is None or free_seqs is None:
            return True
        reserve = self.max_seqs // self.cap
        return seqs + num_seqs <= self.max_seqs - max(1, reserve) or (num_seqs <= free_seqs and free_seqs > 2 * reserve)

    def add(self, key: Hashable, num_tokens: int, num_seqs: int) -> None:
        entry = self.held.setdefault(key, [0, 0])
        entry[0] += num_tokens
        entry[1] += num_seqs

    def remove(self, key: Hashable, num_tokens: int, num_seqs: int) -> None:
        entry = self.held[key]
        entry[0] -= num_tokens
        entry[1] -= num_seqs
        if entry[0] == 0 and entry[1] == 0:
            del self.held[key]

    def check_integrity(self, where: str, tickets: Iterable) -> None:
        """What each flow holds == the sums of `tickets` (the requests admitted on this replica, each with a
        `flow_key`, the credits it was `charged` and `num_seqs`); raises naming `where`, with both."""
        flows: dict[Hashable, list[int]] = {}
        for t in tickets:
            entry = flows.setdefault(t.flow_key, [0, 0])
            entry[0], entry[1] = entry[0] + t.charged, entry[1] + t.num_seqs
        if flows != self.held:
            raise AssertionError(f"{where}: flows {self.held}, tickets {flows}")


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's share of the queue (`weight`, relative to the others) and the best priority its
    requests may ask for (`min_priority`: smaller values are served first)."""

    weight: int = 1
    min_priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.weight, int) or isinstance(self.weight, bool) or self.weight < 1:
            raise ValueError(f"weight: must be an integer >= 1, got {self.weight!r}")
        if not isinstance(self.min_priority, int) or isinstance(self.min_priority, bool):
            raise ValueError(f"min_priority: must be an integer, got {self.min_priority!r}")


@dataclass
class TenantQueue:
    """One tenant's queued requests in the credit ledger: a `FlowChannel` per priority (the best first), and
    its allowance left in the deficit round robin across tenants (`deficit`, in credits; below zero while it
    owes for requests admitted out of turn)."""

    weight: int
    channels: dict[int, FlowChannel] = field(default_factory=dict)   # priority -> its flows, while any is queued
    lanes: dict[int, FlowChannel] = field(default_factory=dict)      # ... kept while empty, the last used last
    deficit: int = 0

    def append(self, ticket: Queued) -> None:
        """Queue `ticket` (it has a `priority`) in its priority's channel, whose fair-queueing tags outlive its
        empty spells (the last `MAX_IDLE_LANES` used): a burst admitted one by one still counts as served when
        the next request comes."""
        lane = self.lanes.pop(ticket.priority, None)
        lane = FlowChannel() if lane is None else lane   # (an empty one is falsy)
        self.lanes[ticket.priority] = self.channels[ticket.priority] = lane
        lane.append(ticket)

    def heads(self) -> Iterator:
        """The candidates for the next admission, in order: the best priority's flows first."""
        for priority in sorted(self.channels):
            yield from self.channels[priority].heads()

    def pop(self, ticket: Queued) -> None:
        """`ticket`, the head of its flow, is served."""
        self.channels[ticket.priority].pop(ticket)
        self._drop_empty(ticket.priority)

    def remove(self, ticket: Queued) -> None:
        """A queued `ticket` is cancelled."""
        self.channels[ticket.priority].remove(ticket)
        self._drop_empty(ticket.priority)

    def _drop_empty(self, priority: int) -> None:
        """An emptied channel leaves the queue; of the empty lanes only the `MAX_IDLE_LANES` used last are kept
        (`priority` is any integer a request sends: one new each time must not grow the tenant without end)."""
        if not self.channels[priority]:
            del self.channels[priority]
            idle = [p for p in self.lanes if p not in self.channels] if len(self.lanes) > MAX_IDLE_LANES else []
            for stale in idle[:len(idle) - MAX_IDLE_LANES]:
                del self.lanes[stale]
