"""KV credits: the gateway's ledger of a pool's KV token slots, and the fair queue in front of it.

The idea is virtual channels with KV-slot credits: the ledger starts with one credit per KV token slot of the
pool (blocks x block_size, from the capacity plan). Admitting a request deducts `prompt_tokens + max_tokens`
(the prompt part is exact: the gateway tokenized it); when the request finishes, stops early or is aborted,
everything it held comes back at once. A request that does not fit waits here, not in the engine, so the
engine's waiting lists stay short and nothing is rejected for capacity.

Queues are channels keyed by (tenant, priority). Within a tenant the smallest priority value goes
first (the engine's convention); within one priority, requests are split into flows by size and the
flows take turns by the credits they ask (`pools.credits.flows`: a burst of large requests does not hold a
small one of the same tenant behind it), FIFO within a flow; a priority better than the tenant's
`min_priority` is clamped to it, so a request body cannot buy more than its tenant may use. Across
tenants, channels are served by deficit round robin in tokens: each visit gives a tenant
`quantum x weight` tokens of allowance, so a tenant flooding with 200 requests and one sending 10
alternate by the tokens they ask for, not by arrival.

No bypass: when the next request in fair order does not fit the free credits, admission stops until
credits return, so a large request is never starved by a stream of small ones. The one exception is a
flow at its cap (`flow_cap`, an interactive pool's: `pools.credits.flows.Headroom`, one flow holds at most 7/8
of a replica's credits and sequences while it holds any): its head waits for its own flow, and the
next flow's head goes.

Sequences: a replica may also be given the most sequences its engine runs at once (`max_seqs`, the
pool's max_num_seqs); a request of n samples over p prompts takes n x p of them (at most all). So
requests wait here in fair order rather than in the engine's first-come queue.

Background requests (batch lines) wait in one FIFO of their own that is served only while no
interactive request is queued: they soak up KV that interactive traffic leaves idle and never pass
an interactive request.

Reconciliation: `reconcile(used)` takes the tokens the worker's blocks really hold. When that is more
than the ledger's admitted requests hold (an abort the worker has not processed yet, or a lost
release), the difference is held "outside" until the next report, so the ledger never promises KV
the engine does not have; it comes back when the worker reports it free.

Shared prompt blocks: a request may name the chain hashes of its prompt's full blocks (`blocks`).
On one replica a block that several admitted requests name is held once, for as long as any of them
runs, as the engine's prefix cache keeps one copy of it referenced by all of them: questions on one
document hold its blocks once. Only a block some request there has finished prefilling
(`prefilled`: its first token came) is shared: the engine caches a block once it is computed, so two
requests prefilling the same document at once may each compute it, and each then holds it. (Held by
the ledger until the last request naming them ends, shared blocks can never be needed twice: whatever
else is admitted fits beside them even if the engine's copy were evicted.)

Replicas: a pool served by several replicas of its device has one queue and one credit account per
replica (its blocks). The request at the head of the fair order is admitted on a replica where it
fits, the one `place(ticket, fitting)` picks (`pools.credits.placement`: token load and prefix affinity;
default: the most free credits); `Ticket.replica` says which. A replica that is down (`up` false:
loading, restarting) takes nothing new. So a request waits on the pool, not on a replica, and goes to
whichever frees first, unless `place` has it wait (None) for the replica that caches its prompt (which
is not clearly busier); tenant channels and weights hold across replicas because there is one queue.

Ints only, no asyncio, no locks: the gateway calls it from its event loop (ints, so it is tested in
milliseconds). `pools.credits.queue` is the async layer the gateway awaits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engine.capacity import DEFAULT_BLOCK_SIZE
from pools.credits.flows import FlowChannel, Headroom, flow_class

DEFAULT_TENANT = "default"


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
class Ticket:
    """One request in the ledger: queued until `admit` returns it, then holding `num_tokens` credits
    until `release`."""

    request_id: str
    tenant: str
    priority: int                # after clamping to the tenant's min_priority
    num_tokens: int              # prompt + max_tokens
    admitted: bool = False
    background: bool = False     # a batch line: served only while no interactive request waits
    replica: int | None = None   # where it was admitted (its credits are that replica's)
    blocks: tuple[int, ...] = ()  # chain hashes of its prompt's full blocks (distinct), held once per replica
    prefilling: bool = False      # admitted, its first token not yet come: its blocks are not shared yet
    num_seqs: int = 1             # sequences it runs at once (n x prompts)
    flow: int = 0                 # its size class within its tenant's channel (`pools.credits.flows`)
    start: int = 0                # its start tag there (fair queueing)
    arrival: int = 0              # its place in the order of arrival there

    @property
    def flow_key(self) -> tuple[str, int]:
        return (self.tenant, self.flow)


@dataclass
class Account:
    """One replica's credits: its KV token slots, what admitted requests hold (their own tokens, and the
    copies of their prompt blocks: one for all the requests naming a block once one of them has
    prefilled it), what reconciliation holds outside the ledger."""

    total: int
    max_seqs: int | None = None   # sequences the replica's engine runs at once; None: not counted
    held: int = 0
    outside: int = 0
    num_seqs: int = 0             # sequences of the admitted requests (each at most max_seqs)
    refs: dict[int, int] = field(default_factory=dict)      # prompt block hash -> admitted requests naming it
    pending: dict[int, int] = field(default_factory=dict)   # ... of them still prefilling
    copies: dict[int, int] = field(default_factory=dict)    # ... copies of it held (1 .. refs)
    flow_cap: int | None = None                             # `pools.credits.flows.FLOW_CAP`, or None: no cap
    headroom: Headroom | None = None                        # what each flow holds here (`pools.credits.flows`)

    def __post_init__(self) -> None:
        self.headroom = Headroom(self.total, self.max_seqs, self.flow_cap)

    def seqs_of(self, ticket: Ticket) -> int:
        """The sequences `ticket` takes here: all it runs, at most all the replica has."""
        return ticket.num_seqs if self.max_seqs is None else min(ticket.num_seqs, self.max_seqs)

    def has_seqs(self, ticket: Ticket) -> bool:
        return self.max_seqs is None or self.num_seqs + self.seqs_of(ticket) <= self.max_seqs

    @property
    def free(self) -> int:
        return self.total - self.held - self.outside


@dataclass
class _Tenant:
    policy: TenantPolicy
    channels: dict[int, FlowChannel] = field(default_factory=dict)   # priority -> its flows, while any is queued
    lanes: dict[int, FlowChannel] = field(default_factory=dict)      # priority -> its flows, kept while empty
    deficit: int = 0             # tokens of allowance left in this round (deficit round robin)

    def append(self, ticket: Ticket) -> None:
        """Queue `ticket` in its priority's channel (whose fair-queueing tags outlive its empty spells: a
        burst admitted one by one still counts as served when the next request comes)."""
        channel = self.channels[ticket.priority] = self.lanes.setdefault(ticket.priority, FlowChannel())
        channel.append(ticket)

    def heads(self) -> Iterator[Ticket]:
        """The candidates for the next admission, in order: the best priority's flows first."""
        for priority in sorted(self.channels):
            yield from self.channels[priority].heads()

    def pop(self, ticket: Ticket) -> None:
        channel = self.channels[ticket.priority]
        channel.pop(ticket)
        if not channel:
            del self.channels[ticket.priority]


class CreditLedger:
    """The credits and the queue of one pool. Not thread-safe: one caller (the event loop).

    `submit` queues a request, `admit` hands out the requests that now fit (in fair order),
    `release` returns a finished request's credits, `cancel` takes a queued one out (a client that
    disconnects holds nothing). `check_integrity` verifies free + held == total on every replica.
    `total`: one replica's KV token slots, or a list of them (one per replica).
    """

    def __init__(self, total: int | Sequence[int], tenants: Mapping[str, TenantPolicy] | None = None, *,
                 quantum: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, max_seqs: int | None = None,
                 flow_cap: int | None = None) -> None:
        totals = [total] if isinstance(total, int) else list(total)
        if not totals or any(not isinstance(t, int) or isinstance(t, bool) or t <= 0 for t in totals):
            raise ValueError(f"total: must be a positive number of KV token slots (per replica), got {total!r}")
        if max_seqs is not None and (not isinstance(max_seqs, int) or isinstance(max_seqs, bool) or max_seqs < 1):
            raise ValueError(f"max_seqs: must be a positive number of sequences, got {max_seqs!r}")
        self.accounts = [Account(t, max_seqs, flow_cap=flow_cap) for t in totals]
        self.block_size = block_size                 # tokens of a shared prompt block (`Ticket.blocks`)
        self.up = [True] * len(totals)               # replicas that take new requests
        self.quantum = quantum or max(1, max(totals) // 8)   # tokens per weight per visit
        self.policies = dict(tenants or {})
        self._tenants: dict[str, _Tenant] = {}
        self._active: deque[str] = deque()           # tenants with queued requests, in visiting order
        self._topped_up = False                      # the tenant at the front got its quantum this visit
        self._tickets: dict[str, Ticket] = {}        # request_id -> queued or admitted ticket
        self._background: deque[Ticket] = deque()    # batch lines, FIFO

    # --- state -----------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self.accounts)

    @property
    def total(self) -> int:
        """KV token slots of every replica together."""
        return sum(a.total for a in self.accounts)

    @property
    def free(self) -> int:
        """Credits an admission may take now, over the replicas that are up."""
        return sum(a.free for a, up in zip(self.accounts, self.up) if up)

    @property
    def held(self) -> int:
        return sum(a.held for a in self.accounts)

    @property
    def outside(self) -> int:
        return sum(a.outside for a in self.accounts)

    @property
    def num_queued(self) -> int:
        return sum(1 for t in self._tickets.values() if not t.admitted)

    @property
    def num_held(self) -> int:
        """Credits held by admitted tickets: their own, counted afresh, and their prompt blocks' copies."""
        return sum(self._held_by_tickets(r)[0] + self.block_size * sum(a.copies.values())
                   for r, a in enumerate(self.accounts))

    def _held_by_tickets(self, replica: int) -> tuple[int, dict[int, int], dict[int, int]]:
        """(the admitted tickets' own credits on `replica`, the refcount of each prompt block they name, and
        of those still prefilling)."""
        own, refs, pending = 0, {}, {}
        for t in self._tickets.values():
            if t.admitted and t.replica == replica:
                own += self._own(t)
                for h in t.blocks:
                    refs[h] = refs.get(h, 0) + 1
                    if t.prefilling:
                        pending[h] = pending.get(h, 0) + 1
        return own, refs, pending

    def _own(self, ticket: Ticket) -> int:
        """A ticket's credits besides its prompt blocks."""
        return ticket.num_tokens - self.block_size * len(ticket.blocks)

    def _shared(self, account: Account, h: int) -> bool:
        """Block `h` is held on the replica and prefilled there: a request naming it takes no copy."""
        return account.refs.get(h, 0) > account.pending.get(h, 0)

    def need(self, ticket: Ticket, replica: int) -> int:
        """The credits `ticket` would take on `replica`: all it asks, less its prompt blocks shared there."""
        account = self.accounts[replica]
        return ticket.num_tokens - self.block_size * sum(1 for h in ticket.blocks if self._shared(account, h))

    def queued_by_tenant(self) -> dict[str, int]:
        """Queued interactive requests per tenant (tenants seen so far, zeros included)."""
        return {name: sum(len(c) for c in tenant.channels.values()) for name, tenant in self._tenants.items()}

    @property
    def num_background_queued(self) -> int:
        return len(self._background)

    def ticket(self, request_id: str) -> Ticket | None:
        return self._tickets.get(request_id)

    def set_up(self, replica: int, up: bool) -> None:
        """Whether `replica` takes new requests (what it holds stays held until released)."""
        self.up[replica] = up

    def prefilled(self, request_id: str) -> bool:
        """The admitted request's first token came: its prompt blocks are computed, and shared from now on.
        True the first time (a queued request naming its blocks may fit there now)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or not ticket.prefilling:
            return False
        ticket.prefilling = False
        _drop(self.accounts[ticket.replica].pending, ticket.blocks)
        return bool(ticket.blocks)

    # --- requests --------------------------------------------------------------------------------
    def submit(self, request_id: str, num_tokens: int, *, tenant: str = DEFAULT_TENANT,
               priority: int = 0, background: bool = False, blocks: Sequence[int] = (), num_seqs: int = 1) -> Ticket:
        """Queue a request needing `num_tokens` credits (`background`: a batch line, behind every
        interactive request; `blocks`: the chain hashes of its prompt's full blocks, part of `num_tokens`,
        held once per replica with the other requests naming them). ValueError if it can never fit the
        pool or the id is already in the ledger."""
        if request_id in self._tickets:
            raise ValueError(f"request_id: {request_id!r} is already in the ledger")
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens: must be a positive integer, got {num_tokens!r}")
        largest = max(a.total for a in self.accounts)
        if num_tokens > largest:
            raise ValueError(f"num_tokens: {num_tokens} credits asked, the pool has {largest} KV token slots"
                             + (" per replica" if self.num_replicas > 1 else ""))
        blocks = tuple(dict.fromkeys(blocks))
        if self.block_size * len(blocks) > num_tokens:
            raise ValueError(f"blocks: {len(blocks)} prompt blocks of {self.block_size} tokens are more than the "
                             f"{num_tokens} credits asked")
        if not isinstance(num_seqs, int) or isinstance(num_seqs, bool) or num_seqs < 1:
            raise ValueError(f"num_seqs: must be a positive integer, got {num_seqs!r}")
        policy = self.policies.get(tenant, TenantPolicy())
        ticket = Ticket(request_id, tenant, max(priority, policy.min_priority), num_tokens, background=background,
                        blocks=blocks, num_seqs=num_seqs, flow=flow_class(num_tokens, self.block_size))
        self._tickets[request_id] = ticket
        if background:
            self._background.append(ticket)
            return ticket
        state = self._tenants.setdefault(tenant, _Tenant(policy))
        if not state.channels:
            self._active.append(tenant)
        state.append(ticket)
        return ticket

    def admit(self, place: Callable[[Ticket, list[int]], int | None] | None = None) -> list[Ticket]:
        """The queued requests that fit now, in fair order; their credits are deducted on the replica
        `place(ticket, fitting)` picks among those (up, and with room) where it fits. `place` may return
        None: the request waits for a replica that has no room now (as if it fitted nowhere)."""
        admitted = self._admit_interactive(place)
        while not self._active and self._background:
            ticket = self._background[0]
            replica = self._choose(ticket, place)
            if replica is None:
                break
            self._background.popleft()
            self._take(ticket, replica)
            admitted.append(ticket)
        return admitted

    def fitting(self, ticket: Ticket) -> list[int]:
        """The replicas that are up and have the free credits and sequences `ticket` needs there, within its
        flow's cap."""
        return [r for r in self._roomy(ticket)
                if self.accounts[r].headroom.allows(ticket.flow_key, ticket.num_tokens, ticket.num_seqs)]

    def _roomy(self, ticket: Ticket) -> list[int]:
        """The replicas that are up and have the free credits and sequences `ticket` needs there."""
        return [r for r, (a, up) in enumerate(zip(self.accounts, self.up))
                if up and self.need(ticket, r) <= a.free and a.has_seqs(ticket)]

    def waiting(self, ticket: Ticket) -> list[int]:
        """The replicas that are up and could hold `ticket` once credits come back, but have no room now."""
        return [r for r, (a, up) in enumerate(zip(self.accounts, self.up))
                if up and a.free < self.need(ticket, r) <= a.total - a.outside]

    def _choose(self, ticket: Ticket, place: Callable[[Ticket, list[int]], int | None] | None) -> int | None:
        """Where `ticket` is admitted now, or None (it fits nowhere, or `place` has it wait)."""
        fitting = self.fitting(ticket)
        if not fitting:
            return None
        replica = place(ticket, fitting) if place is not None else max(fitting, key=lambda r: self.accounts[r].free)
        if replica is not None and replica not in fitting:
            raise ValueError(f"place: chose replica {replica}, not one of {fitting}")
        return replica

    def _take(self, ticket: Ticket, replica: int) -> None:
        account = self.accounts[replica]
        account.held += self._own(ticket)
        for h in ticket.blocks:
            if not self._shared(account, h):
                account.copies[h] = account.copies.get(h, 0) + 1
                account.held += self.block_size
            account.refs[h] = account.refs.get(h, 0) + 1
            account.pending[h] = account.pending.get(h, 0) + 1
        account.num_seqs += account.seqs_of(ticket)
        account.headroom.add(ticket.flow_key, ticket.num_tokens, ticket.num_seqs)
        ticket.admitted, ticket.replica, ticket.prefilling = True, replica, True

    def _admit_interactive(self, place: Callable[[Ticket, list[int]], int | None] | None) -> list[Ticket]:
        admitted: list[Ticket] = []
        held_back = 0   # tenants visited in a row whose every head waits for its own flow
        while self._active and held_back < len(self._active):
            name = self._active[0]
            tenant = self._tenants[name]
            head = self._next_head(tenant)
            if head is None:
                held_back += 1
                tenant.deficit, self._topped_up = 0, False
                self._active.rotate(-1)
                continue
            held_back = 0
            if not self._topped_up:
                tenant.deficit += self.quantum * tenant.policy.weight
                self._topped_up = True
            if head.num_tokens <= tenant.deficit:
                replica = self._choose(head, place)
                if replica is None:
                    break              # no bypass: wait for credits to come back
                tenant.pop(head)
                tenant.deficit -= head.num_tokens
                self._take(head, replica)
                admitted.append(head)
                if tenant.channels:
                    continue
                tenant.deficit = 0     # an emptied channel keeps no allowance (DRR)
            if tenant.channels:
                self._active.rotate(-1)    # allowance left for its next visit
            else:
                self._active.popleft()
            self._topped_up = False
        return admitted

    def _next_head(self, tenant: _Tenant) -> Ticket | None:
        """The tenant's next request in fair order, passing over heads whose flow is at its cap on every
        replica that has room for them; None if every head is held back so."""
        for head in tenant.heads():
            roomy = self._roomy(head)
            if not roomy or any(self.accounts[r].headroom.allows(head.flow_key, head.num_tokens, head.num_seqs)
                                for r in roomy):
                return head
        return None

    def release(self, request_id: str) -> int:
        """A finished (or aborted) admitted request gives back everything it held; returns the credits that
        came free (its shared prompt blocks only when no other request there names them)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or not ticket.admitted:
            raise KeyError(f"request_id: {request_id!r} holds no credits")
        del self._tickets[request_id]
        account = self.accounts[ticket.replica]
        account.num_seqs -= account.seqs_of(ticket)
        account.headroom.remove(ticket.flow_key, ticket.num_tokens, ticket.num_seqs)
        if ticket.prefilling:
            _drop(account.pending, ticket.blocks)
        freed = self._own(ticket)
        _drop(account.refs, ticket.blocks)
        for h in ticket.blocks:
            extra = account.copies[h] - account.refs.get(h, 0)   # copies beyond one per request left
            if extra > 0:
                account.copies[h] -= extra
                freed += extra * self.block_size
                if not account.copies[h]:
                    del account.copies[h]
        account.held -= freed
        return freed

    def reconcile(self, used_tokens: int, replica: int = 0) -> int:
        """`replica`'s worker reports its blocks hold `used_tokens` token slots (blocks in use x block
        size). What exceeds the admitted requests' credits there is held outside the ledger until the
        next report; returns that amount. A report of 0 while nothing is admitted restores every credit."""
        if not isinstance(used_tokens, int) or used_tokens < 0:
            raise ValueError(f"used_tokens: must be an integer >= 0, got {used_tokens!r}")
        account = self.accounts[replica]
        account.outside = min(max(0, used_tokens - account.held), account.total - account.held)
        return account.outside

    def cancel(self, request_id: str) -> bool:
        """Take a queued request out (its client left); False if it is not queued."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.admitted:
            return False
        del self._tickets[request_id]
        if ticket.background:
            self._background.remove(ticket)
            return True
        tenant = self._tenants[ticket.tenant]
        channel = tenant.channels[ticket.priority]
        channel.remove(ticket)
        if not channel:
            del tenant.channels[ticket.priority]
        if not tenant.channels:
            if self._active[0] == ticket.tenant:
                self._topped_up = False
            self._active.remove(ticket.tenant)
            tenant.deficit = 0
        return True

    def check_integrity(self) -> None:
        """held == what admitted tickets hold on each replica, 0 <= free <= total there, every queued
        ticket sits in exactly one channel; raises with the counts."""
        for r, account in enumerate(self.accounts):
            own, refs, pending = self._held_by_tickets(r)
            held = own + self.block_size * sum(account.copies.values())
            copies_ok = set(account.copies) == set(refs) and all(1 <= account.copies[h] <= refs[h] for h in refs)
            flows: dict[tuple[str, int], list[int]] = {}
            for t in self._tickets.values():
                if t.admitted and t.replica == r:
                    entry = flows.setdefault(t.flow_key, [0, 0])
                    entry[0], entry[1] = entry[0] + t.num_tokens, entry[1] + t.num_seqs
            seqs = sum(account.seqs_of(t) for t in self._tickets.values() if t.admitted and t.replica == r)
            if flows != account.headroom.held or seqs != account.num_seqs:
                raise AssertionError(f"credits of replica {r}: {account.num_seqs} sequences held (tickets {seqs}), "
                                     f"flows {account.headroom.held} (tickets {flows})")
            if (account.held != held or refs != account.refs or pending != account.pending or not copies_ok
                    or not 0 <= account.free <= account.total):
                raise AssertionError(f"credits of replica {r}: held {account.held} (tickets {held}), outside "
                                     f"{account.outside}, free {account.free}, total {account.total}, prompt blocks "
                                     f"{len(account.refs)} named (tickets {len(refs)}), copies ok {copies_ok}")
        in_channels = [t.request_id for s in self._tenants.values() for q in s.channels.values() for t in q]
        in_channels += [t.request_id for t in self._background]
        queued = sorted(r for r, t in self._tickets.items() if not t.admitted)
        if sorted(in_channels) != queued:
            raise AssertionError(f"queue: {len(in_channels)} tickets in channels, {len(queued)} queued")
        if sorted(self._active) != sorted(n for n, s in self._tenants.items() if s.channels):
            raise AssertionError(f"queue: active tenants {list(self._active)} do not match the channels")


def _drop(counts: dict[int, int], keys: Sequence[int]) -> None:
    """One less of each key; a key at zero leaves."""
    for key in keys:
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
