"""KV credits: the gateway's ledger of a pool's KV token slots, and the fair queue in front of it.

One credit per KV token slot of the pool (blocks x block_size, from the capacity plan). Admitting a
request deducts `prompt_tokens + max_tokens` (the prompt part is exact: the gateway tokenized it);
when it finishes, stops early or is aborted, everything it held comes back at once. A request that
does not fit waits here, not in the engine, and nothing is rejected for capacity.

Queues are channels keyed by (tenant, priority): within a tenant the smallest priority value first
(the engine's convention), a priority better than the tenant's `min_priority` clamped to it; within
one priority, flows by size that take turns by the credits they ask (`pools.credits.flows`), FIFO
within a flow. Across tenants, deficit round robin in tokens: each visit gives a tenant `quantum x
weight` tokens of allowance: a tenant flooding with 200 requests and one sending 10 alternate by tokens.

Holding back: a request that cannot be admitted now holds back the replicas it waits for, and the
requests after it in fair order may be admitted only on the others. One that fits nowhere holds every
replica that is up (on one replica admission stops until credits return: a large request is never
starved by a stream of small ones); one that `place` has wait for the replica caching its prompt
holds only those it may not go to now, so the idle ones serve the rest of the queue. The first head that
waited goes first at each later admission until admitted (`_first`), charged to its tenant; its own tenant's
heads before it in fair order go first only while no other tenant waits (a tenant streaming urgent requests
past its waiting one took the credits every tenant held back behind it waited for). One exception: a flow
at its cap (`flow_cap`, an interactive pool's: `pools.credits.flows.Headroom`): its head waits for its own flow.

Sequences: a replica may also be given the most sequences its engine runs at once (`max_seqs`, the
pool's max_num_seqs); a request of n samples over p prompts takes n x p of them (at most all), so
requests wait here in fair order rather than in the engine's first-come queue. Background requests
(batch lines) wait in a queue of their own, served only while no interactive request is queued, the
tenants taking turns by the credits their lines ask over their weights (`pools.credits.flows.BatchLines`).

Reconciliation: `reconcile(used)` takes the tokens the worker's blocks really hold; what exceeds the
admitted requests' credits (an abort the worker has not processed yet, a lost release) is held
"outside" until the next report, so the ledger never promises KV the engine does not have.

Shared prompt blocks: a request may name the chain hashes of its prompt's full blocks (`blocks`). On
one replica a block that several admitted requests name is held once while any of them runs, as the
engine's prefix cache keeps one copy referenced by all, once some request there has prefilled it
(`prefilled`: its first token came; two requests prefilling a document at once may each compute it,
and each then holds a copy). Held until the last request naming them ends, shared blocks can never be
needed twice: whatever else is admitted fits beside them even if the engine's copy were evicted.

Replicas: a pool served by several replicas of its device has one queue and one credit account per
replica (its blocks). A request is admitted on a replica where it fits, the one `place(ticket,
fitting)` picks (`pools.credits.placement`: token load and prefix affinity; default: the most free
credits), or waits (None) for one that caches its prompt; `Ticket.replica` says which. A replica that
is down (`up` false: loading, restarting) takes nothing new. So a request waits on the pool, not on a
replica; tenant channels and weights hold across replicas because there is one queue.

Tenants seen: a tenant's queue state (its channels' tags, its allowance) lives while it has a request queued
or admitted here: a gateway taking any API key as a tenant keeps nothing for keys that came once.

Ints only, no asyncio, no locks: the gateway calls it from its event loop (tested in milliseconds).
`pools.credits.queue` is the async layer the gateway awaits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from engine.capacity import DEFAULT_BLOCK_SIZE
from pools.credits.accounts import Account, Place, Ticket, drop
from pools.credits.flows import DEFAULT_TENANT, BatchLines, TenantPolicy, TenantQueue, flow_class  # noqa: F401


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
        self._tenants: dict[str, TenantQueue] = {}
        self._live: dict[str, int] = {}              # tenant -> its interactive tickets, queued or admitted
        self._active: deque[str] = deque()           # tenants with queued requests, in visiting order
        self._topped_up = False                      # the tenant at the front got its quantum this visit
        self._first: Ticket | None = None            # the head that waits for its replicas (goes first)
        self._tickets: dict[str, Ticket] = {}        # request_id -> queued or admitted ticket
        self._background = BatchLines()              # batch lines, fair across tenants
        self.queued_tokens = 0                       # credits the queued requests ask for, all together
        self.background_tokens = 0                   # ... of them, the batch lines'

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
    def num_admitted(self) -> int:
        return len(self._tickets) - self.num_queued

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
        """Queued interactive requests per tenant (those with a request queued or admitted, zeros included)."""
        return {name: sum(len(c) for c in tenant.channels.values()) for name, tenant in self._tenants.items()}

    @property
    def num_background_queued(self) -> int:
        return len(self._background)

    def first_waiting(self) -> Ticket | None:
        """The request first in line: the interactive head that waits for its replicas (`_first`), else,
        while no interactive request is queued, the batch line first in their fair order; None when neither."""
        if self._first is not None:
            return self._first
        return self._background.first() if not self._active else None

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
        drop(self.accounts[ticket.replica].pending, ticket.blocks)
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
        largest = max(a.capacity for a in self.accounts)
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
        self.queued_tokens += num_tokens
        if background:
            self.background_tokens += num_tokens
            self._background.append_line(ticket, policy.weight)
            return ticket
        state = self._tenants.setdefault(tenant, TenantQueue(policy.weight))
        self._live[tenant] = self._live.get(tenant, 0) + 1
        if not state.channels:
            self._active.append(tenant)
        state.append(ticket)
        return ticket

    def admit(self, place: Place = None) -> list[Ticket]:
        """The queued requests that fit now, in fair order, each on the replica `place(ticket, fitting)` picks
        among those (up, with room) where it fits, or waiting (None) for one with no room now. One not admitted
        holds back the replicas it waits for (`_waited_for`) from the requests after it (module docstring)."""
        held: set[int] = set()
        admitted = self._admit_first(place, held) + self._admit_interactive(place, held)
        if not self._active:
            admitted += self._admit_background(place)
        return admitted

    def _admit_first(self, place: Place, held: set[int]) -> list[Ticket]:
        """The head that waited in an earlier pass goes before any other tenant's requests, and before its own
        tenant's heads unless that tenant is alone in the queue (then those before it in its fair order go
        first, delaying only their own: module docstring). Admitted heads are charged to the tenant, past zero
        if need be; one not admitted holds back what it waits for."""
        if self._first is not None and self._capped(self._first):   # waits for its own flow: no longer the first
            self._first = None
        if (first := self._first) is None:
            return []
        tenant, admitted = self._tenants[first.tenant], []
        for head in list(tenant.heads()) if len(self._active) == 1 else [first]:
            if head is not first and self._capped(head):
                continue
            if (replica := self._choose(head, place, held)) is None:
                held |= self._waited_for(head)
            else:
                tenant.pop(head)
                tenant.deficit -= head.num_tokens   # below zero: its next turns are shorter
                self._take(head, replica)
                admitted.append(head)
                self._first = None if head is first else self._first
            if head is first:
                break
        self._leave_if_empty(first.tenant)
        return admitted

    def _leave_if_empty(self, name: str) -> None:
        """A tenant with nothing queued leaves the round robin, keeping no allowance (DRR)."""
        tenant = self._tenants[name]
        if not tenant.channels:
            if self._active[0] == name:
                self._topped_up = False
            self._active.remove(name)
            tenant.deficit = 0

    def _admit_background(self, place: Place) -> list[Ticket]:
        """Batch lines in their fair order; one that is not admitted holds back the replicas it waits for."""
        admitted: list[Ticket] = []
        held: set[int] = set()
        for ticket in self._background.in_order():
            if self._all_held(held):
                break
            if (replica := self._choose(ticket, place, held)) is None:
                held |= self._waited_for(ticket)
                continue
            self._background.serve(ticket)
            self._take(ticket, replica)
            admitted.append(ticket)
        return admitted

    def fitting(self, ticket: Ticket) -> list[int]:
        """The replicas that are up and have the free credits and sequences `ticket` needs there, within its cap."""
        return [r for r in self._roomy(ticket) if self.under_cap(ticket, r)]

    def under_cap(self, ticket: Ticket, replica: int) -> bool:
        """`ticket` on `replica` keeps its flow within the cap (by what it would take there: not shared blocks)."""
        a = self.accounts[replica]
        return a.headroom.allows(ticket.flow_key, self.need(ticket, replica), ticket.num_seqs, a.free, a.free_seqs)

    def _roomy(self, ticket: Ticket) -> list[int]:
        """The replicas that are up and have the free credits and sequences `ticket` needs there."""
        return [r for r, (a, up) in enumerate(zip(self.accounts, self.up))
                if up and self.need(ticket, r) <= a.free and a.has_seqs(ticket)]

    def waiting(self, ticket: Ticket, fitting: Sequence[int] | None = None) -> list[int]:
        """The replicas that are up and could hold `ticket` once credits come back (or once the requests
        before it that wait for them are admitted), other than `fitting` (where it may be admitted now;
        by default `self.fitting(ticket)`)."""
        fitting = self.fitting(ticket) if fitting is None else fitting
        return [r for r, (a, up) in enumerate(zip(self.accounts, self.up))
                if up and r not in fitting and self.need(ticket, r) <= a.total - a.outside]

    def _waited_for(self, ticket: Ticket) -> set[int]:
        """The replicas a request that was not admitted waits for, never one where its flow is at the cap (it waits
        for its flow there, holding nothing): those up that could hold it once credits come back (`waiting`);
        where there is none, every one up where it may not go now (all when it fits nowhere)."""
        fitting = set(self.fitting(ticket))
        capped = {r for r in range(len(self.accounts)) if not self.under_cap(ticket, r)}
        return set(self.waiting(ticket, fitting)) - capped or {r for r, u in enumerate(self.up) if u} - fitting - capped

    def _all_held(self, held: set[int]) -> bool:
        return all(r in held for r, up in enumerate(self.up) if up)

    def _choose(self, ticket: Ticket, place: Place, held: set[int] = frozenset()) -> int | None:
        """Where `ticket` is admitted now, or None (it fits on no replica but `held`, or `place` has it wait)."""
        fitting = [r for r in self.fitting(ticket) if r not in held]
        if not fitting:
            return None
        replica = place(ticket, fitting) if place is not None else max(fitting, key=lambda r: self.accounts[r].free)
        if replica is not None and replica not in fitting:
            raise ValueError(f"place: chose replica {replica}, not one of {fitting}")
        return replica

    def _take(self, ticket: Ticket, replica: int) -> None:
        account = self.accounts[replica]
        before = account.held
        account.held += self._own(ticket)
        for h in ticket.blocks:
            if not self._shared(account, h):
                account.copies[h] = account.copies.get(h, 0) + 1
                account.held += self.block_size
            account.refs[h] = account.refs.get(h, 0) + 1
            account.pending[h] = account.pending.get(h, 0) + 1
        account.num_seqs += account.seqs_of(ticket)
        ticket.admitted, ticket.replica, ticket.prefilling = True, replica, True
        ticket.charged = account.held - before
        account.headroom.add(ticket.flow_key, ticket.charged, ticket.num_seqs)   # what its flow holds: as charged
        self.queued_tokens -= ticket.num_tokens
        self.background_tokens -= ticket.num_tokens if ticket.background else 0

    def _admit_interactive(self, place: Place, held: set[int]) -> list[Ticket]:
        admitted: list[Ticket] = []
        waiting: set[str] = set()   # heads not admitted in this pass (they hold their replicas)
        held_back = 0   # tenants visited in a row with no head to try: each waits, for its flow or its replicas
        while self._active and held_back < len(self._active) and not self._all_held(held):
            name = self._active[0]
            tenant = self._tenants[name]
            head = self._next_head(tenant, waiting)
            if head is None:
                held_back += 1
                tenant.deficit, self._topped_up = 0, False
                self._active.rotate(-1)
                continue
            held_back = 0
            if not self._topped_up:
                tenant.deficit += self.quantum * tenant.weight
                self._topped_up = True
            if head.num_tokens <= tenant.deficit:
                replica = self._choose(head, place, held)
                if replica is None:    # it waits, holding back its replicas; the next head may go elsewhere
                    waiting.add(head.request_id)
                    held |= self._waited_for(head)
                    self._first = self._first or head
                    continue
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

    def _next_head(self, tenant: TenantQueue, waiting: set[str]) -> Ticket | None:
        """The tenant's next request in fair order, passing over the first head (`_admit_first`'s), heads
        that wait in this pass, and heads whose flow is at its cap on every replica that has room for them;
        None if every head is passed over so."""
        for head in tenant.heads():
            if head is not self._first and head.request_id not in waiting and not self._capped(head):
                return head
        return None

    def _capped(self, head: Ticket) -> bool:
        """`head`'s flow is at its cap on every replica up that could hold it (room now or once credits come
        back): it waits for its own flow, holding back no other's, whether or not there is room now."""
        could = self.waiting(head, fitting=())
        return bool(could) and not any(self.under_cap(head, r) for r in could)

    def release(self, request_id: str) -> int:
        """A finished (or aborted) admitted request gives back everything it held; returns the credits that
        came free (its shared prompt blocks only when no other request there names them)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or not ticket.admitted:
            raise KeyError(f"request_id: {request_id!r} holds no credits")
        del self._tickets[request_id]
        self._ended(ticket)
        account = self.accounts[ticket.replica]
        account.num_seqs -= account.seqs_of(ticket)
        account.headroom.remove(ticket.flow_key, ticket.charged, ticket.num_seqs)
        if ticket.prefilling:
            drop(account.pending, ticket.blocks)
        freed = self._own(ticket)
        drop(account.refs, ticket.blocks)
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
        account.outside = max(0, min(used_tokens - account.held, account.total - account.held))
        return account.outside

    def cancel(self, request_id: str) -> bool:
        """Take a queued request out (its client left); False if it is not queued."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.admitted:
            return False
        del self._tickets[request_id]
        self.queued_tokens -= ticket.num_tokens
        if ticket.background:
            self.background_tokens -= ticket.num_tokens
            self._background.remove(ticket)
            return True
        if ticket is self._first:
            self._first = None
        self._tenants[ticket.tenant].remove(ticket)
        self._leave_if_empty(ticket.tenant)
        self._ended(ticket)
        return True

    def _ended(self, ticket: Ticket) -> None:
        """`ticket` left the ledger: its tenant's queue state is forgotten with its last request (module docstring)."""
        if ticket.background:
            return
        left = self._live[ticket.tenant] - 1
        if left:
            self._live[ticket.tenant] = left
        else:
            del self._live[ticket.tenant], self._tenants[ticket.tenant]

    def check_integrity(self) -> None:
        """held == what admitted tickets hold on each replica, 0 <= free <= total there, every queued
        ticket sits in exactly one channel; raises with the counts."""
        for r, account in enumerate(self.accounts):
            own, refs, pending = self._held_by_tickets(r)
            held = own + self.block_size * sum(account.copies.values())
            copies_ok = set(account.copies) == set(refs) and all(1 <= account.copies[h] <= refs[h] for h in refs)
            mine = [t for t in self._tickets.values() if t.admitted and t.replica == r]
            account.headroom.check_integrity(f"credits of replica {r}", mine)
            if sum(account.seqs_of(t) for t in mine) != account.num_seqs:
                raise AssertionError(f"credits of replica {r}: {account.num_seqs} sequences held, tickets "
                                     f"{sum(account.seqs_of(t) for t in mine)}")
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
        asked = (sum(self._tickets[r].num_tokens for r in queued), sum(t.num_tokens for t in self._background))
        if (self.queued_tokens, self.background_tokens) != asked:
            raise AssertionError(f"queue: {self.queued_tokens} credits counted queued ({self.background_tokens} "
                                 f"of batch lines), the tickets ask {asked[0]} ({asked[1]})")
        live: dict[str, int] = {}
        for t in self._tickets.values():
            if not t.background:
                live[t.tenant] = live.get(t.tenant, 0) + 1
        if live != self._live or set(self._tenants) != set(live):
            raise AssertionError(f"queue: {len(self._tenants)} tenants kept, {len(live)} with requests here")
        if sorted(self._active) != sorted(n for n, s in self._tenants.items() if s.channels):
            raise AssertionError(f"queue: active tenants {list(self._active)} do not match the channels")
        if self._first is not None and self._first.request_id not in queued:
            raise AssertionError(f"queue: the first head {self._first.request_id!r} is not queued")
