"""What the credit ledger (`pools.credits.ledger`) keeps per request and per replica: a `Ticket` (one
request, queued or holding credits) and an `Account` (one replica's credits: what its admitted
requests hold, the copies of the prompt blocks they share, what reconciliation holds outside, and what
each flow holds there). Plain records of ints; the ledger owns the rules that change them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pools.credits.flows import Headroom


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
    charged: int = 0              # the credits its admission took on its replica (its shared blocks not again)
    start: int = 0                # its start tag there (fair queueing)
    cost: int = 0                 # what it moved its flow's tag by there
    floor: int = 0                # the virtual time when it was queued there (its start is at least that)
    arrival: int = 0              # its place in the order of arrival there

    @property
    def flow_key(self) -> tuple[str, int, int, bool]:
        """Its flow as the cap counts it: a size class in one channel (tenant and priority), batch lines apart
        (a tenant's lines at the cap never kept its interactive requests of their size out of the room left)."""
        return (self.tenant, self.priority, self.flow, self.background)


Place = Callable[[Ticket, list[int]], int | None] | None   # (ticket, replicas it fits) -> where, or None: it waits


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
    capacity: int = 0    # the replica's credits by the plan; `total` is less while a lease says so (0: total)

    def __post_init__(self) -> None:
        self.capacity = self.capacity or self.total
        self.headroom = Headroom(self.total, self.max_seqs, self.flow_cap)

    def lease(self, tokens: int) -> None:
        """The replica leases this gateway `tokens` of its credits (a replica shared by several gateways,
        `engine.sessions`): admit within them (at most the plan's capacity) from now on."""
        self.total = self.headroom.total = max(0, min(tokens, self.capacity))

    @property
    def within_lease(self) -> bool:
        """What the admitted requests hold here is within `total` (a shrunk lease may be acknowledged)."""
        return self.held <= self.total

    def seqs_of(self, ticket: Ticket) -> int:
        """The sequences `ticket` takes here: all it runs, at most all the replica has."""
        return ticket.num_seqs if self.max_seqs is None else min(ticket.num_seqs, self.max_seqs)

    def has_seqs(self, ticket: Ticket) -> bool:
        return self.max_seqs is None or self.num_seqs + self.seqs_of(ticket) <= self.max_seqs

    @property
    def free_seqs(self) -> int | None:
        return None if self.max_seqs is None else self.max_seqs - self.num_seqs

    @property
    def free(self) -> int:
        return max(0, self.total - self.held - self.outside)   # 0 while a shrunk lease is under what is held


def drop(counts: dict[int, int], keys: Sequence[int]) -> None:
    """One less of each key; a key at zero leaves."""
    for key in keys:
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
