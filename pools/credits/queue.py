"""The async face of a pool's credit ledger: what a request awaits before it may reach the engine.

`CreditQueue` owns one `CreditLedger` (pools.credits.ledger) for one local pool. A request computes what it
may need (`reservation`: its prompt blocks plus, per sample, the blocks of its longest possible
output, in whole blocks as the engine allocates them), then holds that many credits for as long as
it runs:

    async with admission.hold(request_id, tokens, tenant="search", priority=0):
        ... stream the engine's outputs ...

`hold` queues the request in its tenant's channel and returns once the ledger admits it; leaving the
block (finished, failed, client gone, cancelled) gives every credit back at once and admits whoever
fits next. A request cancelled while queued leaves the queue holding nothing. With
`max_queue_seconds` set, a request that waited longer raises `QueueTimeout` (the gateway answers 503
with Retry-After); unset, it waits as long as its client does, so nothing is refused for capacity.
`max_queue_seconds: 0` is reject-when-full, what most servers do: a request that does not fit at
once raises `PoolFull` (429) and its client retries (`cliffguard bench admission` compares the two).

`reconcile(used_tokens, replica)` feeds a worker's real block use back in (pools.credits.ledger explains how).

A pool served by several replicas has one `CreditQueue` with one credit account per replica: a request
waits in the pool's queue and is admitted on the replica `pools.credits.placement.Placement` picks among those
where it fits (token load, prefix affinity); `Ticket.replica` says which. A request waiting for the
replica that caches its prompt holds back only that replica: the others serve the rest of the queue
(the ledger's "Holding back"). Such a wait is a choice, never a refusal: a request that cannot wait
(`max_queue_seconds: 0`) goes where it fits now, one that can waits for its prompt's replica for half its
`max_queue_seconds` at most, then takes any (`_anywhere`), and meanwhile its wait is no sign of too few
replicas (`oldest_credit_wait`). `is_up(replica)` (set by the gateway: the replica's supervisor is ready)
is read at each admission, so a dead or restarting replica takes nothing new from the moment its
worker is gone; once none is up, a queued request waits for the device instead (`on_down`, the gateway's
wait for a replica, and its 503), that time no wait for credits (`_until_admitted`);
`replica_ready(replica, restarted)` admits whoever fits on a replica that is back (and forgets its cached
prompts if a new process serves it); `engine_cached` corrects the placement's
record of a replica's cache from what the engine reported. Event-loop only, like the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import NamedTuple

from engine.capacity import DEFAULT_BLOCK_SIZE
from pools.credits.flows import DEFAULT_TENANT, TenantPolicy
from pools.credits.ledger import CreditLedger, Ticket
from pools.demand import OfferedLoad
from pools.credits.placement import Placement, Work

log = logging.getLogger("cliffguard.credits")

DOWN_RECHECK_SECONDS = 1.0   # how often a queued request looks whether any replica of its pool is still up


class LeaseDemand(NamedTuple):
    """`CreditQueue.lease_demand`: what a gateway's queue asks of one replica."""
    queued: int                   # credits the queued interactive requests ask for
    queued_batch: int = 0         # ... the queued batch lines
    head: int = 0                 # credits the request first in line needs there (0: none)
    head_waited: float = 0.0      # seconds it has waited
    head_id: str | None = None
    head_background: bool = False


class PoolFull(Exception):
    """`max_queue_seconds: 0`: the request does not fit the free credits now and the pool never queues."""

    def __init__(self, pool: str, need: int, free: int, held_back: str = "") -> None:
        super().__init__(f"pool {pool!r} is full: the request needs {need} KV token slots, {free} are free"
                         f"{held_back}; retry later")
        self.pool = pool


class QueueTimeout(Exception):
    """A request waited for credits longer than its pool's `max_queue_seconds`."""

    def __init__(self, pool: str, waited: float, limit: float) -> None:
        super().__init__(f"pool {pool!r} is saturated: the request waited {waited:.1f} s for KV capacity "
                         f"(max_queue_seconds {limit:g}); retry later")
        self.pool, self.waited, self.limit = pool, waited, limit


def reservation(prompt_lens: Iterable[int], max_tokens: int | None, n: int, *, block_size: int,
                max_model_len: int) -> int:
    """KV token slots a request may occupy at most, in whole blocks.

    Per prompt of p tokens with m = max_tokens (unset: the context left, max_model_len - p): the n
    samples share the prompt's full blocks, and each sample writes its own copy of the last partial
    block plus its output but the last token (sampled, never stored: the engine's `check_fits`), so
    floor(p / bs) + n x ceil((p mod bs + m - 1) / bs) blocks.
    """
    blocks = 0
    for p in prompt_lens:
        m = max_tokens if max_tokens is not None else max(1, max_model_len - p)
        blocks += p // block_size + n * -(-(p % block_size + m - 1) // block_size)
    return blocks * block_size


class CreditQueue:
    """One local pool's credits and queue, awaited from the event loop. `total`: one replica's KV token
    slots, or each replica's; `placement`: where a request goes among several replicas (without one: the
    replica with the most free credits)."""

    def __init__(self, pool: str, total: int | Sequence[int], *, tenants: Mapping[str, TenantPolicy] | None = None,
                 max_queue_seconds: float | None = None, quantum: int | None = None,
                 placement: Placement | None = None, max_seqs: int | None = None,
                 flow_cap: int | None = None) -> None:
        self.pool = pool
        self.ledger = CreditLedger(total, tenants, quantum=quantum, max_seqs=max_seqs, flow_cap=flow_cap,
                                   block_size=placement.block_size if placement is not None else DEFAULT_BLOCK_SIZE)
        self.max_queue_seconds = max_queue_seconds
        self.placement = placement
        self.is_up: Callable[[int], bool] | None = None   # whether a replica takes new requests (the gateway's)
        # the gateway's wait for a ready replica of the pool's device (its argument: patient), which a request
        # queued here turns to once none is up (`_until_admitted`); it returns once one is, or raises its 503
        self.on_down: Callable[[bool], Awaitable[None]] | None = None
        self._work: dict[str, Work] = {}               # queued requests' work, for placement
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._queued_since: dict[str, float] = {}      # request waiting for credits -> since when
        self._pressing_since: dict[str, float] = {}    # those of them not meant to wait (`oldest_credit_wait`)
        self._anywhere: set[str] = set()               # requests that no longer wait for their prompt's replica
        self._affine: set[str] = set()                 # requests that fit now and wait for their prompt's replica
        self.refused_at: float | None = None           # monotonic time of the last refusal for capacity
        self.offered = OfferedLoad()                   # interactive requests that arrived (pools.demand)
        self._since: dict[str, float] = {}             # interactive request -> when it came (until its first token)
        self._acks: dict[int, Callable[[], None]] = {}   # replica -> a lease to acknowledge once within it
        self.num_admitted = 0           # totals since start, for metrics and tests
        self.num_expired = 0
        self.num_cancelled = 0

    @property
    def total(self) -> int:
        """KV token slots of every replica together."""
        return self.ledger.total

    @property
    def max_request(self) -> int:
        """The most credits one request can ever hold: the largest replica's (by the plan, whatever a
        replica's lease is now)."""
        return max(a.capacity for a in self.ledger.accounts)

    def lease(self, replica: int, tokens: int, acknowledge: Callable[[], None]) -> None:
        """`replica` leases this gateway `tokens` credits (a replica shared by several gateways,
        `engine.sessions`): admit within them from now on; `acknowledge()` is called once what is held
        there is within them (at once, or when enough requests there have finished)."""
        self.ledger.accounts[replica].lease(tokens)
        self._acks[replica] = acknowledge
        self._admit()

    @property
    def free(self) -> int:
        return self.ledger.free

    @asynccontextmanager
    async def hold(self, request_id: str, num_tokens: int, *, tenant: str = DEFAULT_TENANT, priority: int = 0,
                   background: bool = False, work: Work | None = None, num_seqs: int = 1,
                   patient: bool = False, spent: float = 0.0, batch_line: bool = False) -> AsyncIterator[Ticket]:
        """Wait until `num_tokens` credits are admitted on a replica, hold them for the block, then give
        them back. `work`: what the request asks of a replica, for placement (`Ticket.replica`); its prompt
        blocks are held once on a replica with the other requests there that share them.

        ValueError if the request can never fit the pool; QueueTimeout past `max_queue_seconds` counted from
        the request's arrival, `spent` seconds ago (its wait for a device, another pool's credits), PoolFull
        at once where that is 0. Background requests (batch lines, served behind the others) and `patient`
        ones (served among them: a background Response, whose client polls for it) never time out: nobody
        waits on their connection, and their runners retry nothing, they wait. `batch_line`: a patient request that
        is a batch line (served among the others here, it holds another pool's credits): no offered load."""
        # where nothing else waits (max_queue_seconds 0), a patient request waits behind the others, never
        # holding them back: else one too large for the free credits would have every other refused
        background = background or patient and self.max_queue_seconds == 0
        blocks = self.placement.prompt_blocks(work) if self.placement is not None and work is not None else ()
        ticket = self.ledger.submit(request_id, num_tokens, tenant=tenant, priority=priority, background=background,
                                    blocks=blocks, num_seqs=num_seqs)
        if work is not None:
            self._work[request_id] = work
        if not background:
            now = time.monotonic()
            if not patient:   # its wait is no sign of overload: it is meant to wait (`oldest_wait`)
                self._since[request_id] = now
            if work is not None and not batch_line:   # batch traffic never drove the overload verdict
                self.offered.add(now, work.num_prompt_tokens, work.output_tokens)
        waits = background or patient
        if self.max_queue_seconds == 0 and not waits:
            self._anywhere.add(request_id)   # it cannot wait, not even for the replica caching its prompt
        try:
            if not ticket.admitted:
                self._admit()
            if not ticket.admitted and self.max_queue_seconds == 0 and not waits:
                held_back = self._held_back(ticket)
                self.ledger.cancel(request_id)
                self._refused()
                self._admit()
                raise PoolFull(self.pool, num_tokens, self.ledger.free, held_back)
            if not ticket.admitted:
                await self._wait(ticket, None if waits else self.max_queue_seconds, pressing=not waits, spent=spent)
        except BaseException:
            self._since.pop(request_id, None)
            self._drop(request_id)
            raise
        finally:
            self._work.pop(request_id, None)
            self._anywhere.discard(request_id)
            self._affine.discard(request_id)
        try:
            yield ticket
        finally:
            self._since.pop(request_id, None)
            if self.placement is not None:
                self.placement.finish(request_id)
            self.ledger.release(request_id)
            self._admit()

    def _held_back(self, ticket: Ticket) -> str:
        """What its 429 says beside the free credits, which would otherwise read as room: why a request refused
        at once was not admitted, each replica up that has its credits free being asked what it lacks."""
        ledger = self.ledger
        roomy = [r for r, (account, up) in enumerate(zip(ledger.accounts, ledger.up))
                 if up and ledger.need(ticket, r) <= account.free]
        if not roomy:
            return ", but no replica has that many free" if ledger.num_replicas > 1 and ledger.free >= \
                ticket.num_tokens else ""
        slots = [r for r in roomy if ledger.accounts[r].has_seqs(ticket)]
        if not slots:
            return ", but no sequence slot is (max_num_seqs)"
        if not any(ledger.under_cap(ticket, r) for r in slots):
            where = "every replica with a sequence slot free" if ledger.num_replicas > 1 else "the pool"
            return f", but requests of its size hold their share of {where} already (the rest is kept for other sizes)"
        return ", but requests queued before it come first"

    def _drop(self, request_id: str) -> None:
        """A request that fails before it holds its credits leaves nothing in the ledger: queued, it is
        taken out; admitted meanwhile, what it was given comes back (on whatever raised: a waiter's end has
        done this already, an acknowledgement's or a placement's fault has not)."""
        ticket = self.ledger.ticket(request_id)
        if ticket is None or self.ledger.cancel(request_id):
            return
        if self.placement is not None:
            self.placement.finish(request_id)
        self.ledger.release(request_id)
        self._admit()   # what it gave back may admit the next in line

    async def _wait(self, ticket: Ticket, limit: float | None, pressing: bool = True, spent: float = 0.0) -> None:
        """Wait for `ticket`'s admission until `limit` seconds after its request arrived, `spent` seconds ago
        (None: however long); `pressing`: its wait is a sign the replicas are too few (not a background or
        patient request's, meant to wait)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = waiter
        started = self._queued_since[ticket.request_id] = time.monotonic()
        if pressing:
            self._pressing_since[ticket.request_id] = started
        moved = 0.0   # seconds no replica was up: no wait for credits
        try:
            deadline = None if limit is None else started + limit - spent
            if deadline is not None:   # its prompt's replica for half of what is left at most, then any replica
                moved = await self._until_admitted(waiter, started + max(0.0, limit - spent) / 2, not pressing)
                deadline += moved
                self._anywhere.add(ticket.request_id)
                self._affine.discard(ticket.request_id)
                self._admit()
            moved += await self._until_admitted(waiter, deadline, not pressing)
            if not waiter.done():
                raise TimeoutError
        except BaseException as exc:
            if self.ledger.cancel(ticket.request_id):        # still queued: leave holding nothing
                if isinstance(exc, TimeoutError):
                    self._refused()
                    raise QueueTimeout(self.pool, spent + time.monotonic() - started - moved, limit) from None
                self.num_cancelled += 1
                raise
            if not isinstance(exc, TimeoutError):            # admitted meanwhile, then cancelled
                self._drop(ticket.request_id)
                raise
        finally:
            self._waiters.pop(ticket.request_id, None)
            self._queued_since.pop(ticket.request_id, None)
            self._pressing_since.pop(ticket.request_id, None)
            self._admit()   # a request that left may have blocked the head of the queue

    async def _until_admitted(self, waiter: asyncio.Future[None], deadline: float | None, patient: bool) -> float:
        """Wait for `waiter` (admitted) until `deadline` (monotonic; None: however long); the seconds its
        deadline moved. While no replica is up (dead, restarting) the request waits as one arriving then would,
        `on_down` (the gateway's: up to `gateway.device_wait_seconds`, then its 503 `pool_unavailable` naming
        each replica's state, raised here), and that time is no wait for capacity: the deadline moves past it.
        A death is seen at the next admission pass (what the dead replica's requests give back) or within
        DOWN_RECHECK_SECONDS. Not `wait_for`: on Python 3.11 it returns as admitted when its task is cancelled in
        the loop step the admission lands in, and a request whose client left would run."""
        moved = 0.0
        while not waiter.done():
            if self.on_down is not None and self._none_up():
                down_at, back = time.monotonic(), asyncio.ensure_future(self.on_down(patient))
                try:
                    await asyncio.wait([waiter, back], return_when=asyncio.FIRST_COMPLETED)
                    if not waiter.done():
                        back.result()   # a replica is ready (its `replica_ready` admitted who fits), or the 503
                finally:
                    if not back.done():
                        back.cancel()
                    elif not back.cancelled():
                        back.exception()   # read: an admission that won leaves no "never retrieved" warning
                moved += time.monotonic() - down_at   # a wait for the device: none for credits
                deadline = None if deadline is None else deadline + time.monotonic() - down_at
                if waiter.done() or not self._none_up():
                    continue
                # ready but taking nothing (draining; `on_down` returned at once): a wait for credits, no spin
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            recheck = DOWN_RECHECK_SECONDS if self.on_down is not None else None
            await asyncio.wait([waiter], timeout=left if recheck is None else recheck if left is None else
                               min(left, recheck))
        return moved

    def _none_up(self) -> bool:
        return not any(map(self.replica_up, range(self.ledger.num_replicas)))

    def _refused(self) -> None:
        """A request refused for capacity (PoolFull, QueueTimeout): counted, and timed for the autoscaler."""
        self.num_expired += 1
        self.refused_at = time.monotonic()

    def _admit(self) -> None:
        for replica in [r for r in self._acks if self.ledger.accounts[r].within_lease]:
            try:
                self._acks.pop(replica)()
            except Exception:  # noqa: BLE001 - a replica's acknowledgement must not stop admission (or a release)
                log.exception("pool %s: acknowledging replica %d's lease failed", self.pool, replica)
        for replica in range(self.ledger.num_replicas):   # the supervisors' word now: a dead one takes nothing new
            self.ledger.set_up(replica, self.replica_up(replica))
        self._affine.clear()   # found again by this pass's `_place` (one it does not reach counts as pressing)
        for ticket in self.ledger.admit(self._place):
            self.num_admitted += 1
            waiter = self._waiters.get(ticket.request_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def replica_up(self, replica: int) -> bool:
        """Whether `replica` takes new requests now: its supervisor's word (`is_up`), else the ledger's."""
        return self.is_up(replica) if self.is_up is not None else self.ledger.up[replica]

    def _place(self, ticket: Ticket, fitting: list[int]) -> int | None:
        """The ledger's choice of replica: the placement's, which starts counting the request's load there
        (None: it waits for the replica that caches its prompt, never one where its flow is at the cap)."""
        work = self._work.get(ticket.request_id)
        if self.placement is not None and work is not None:
            free = [a.free for a in self.ledger.accounts]
            waiting = [] if ticket.request_id in self._anywhere else \
                [r for r in self.ledger.waiting(ticket, fitting) if self.ledger.under_cap(ticket, r)]
            try:
                replica = self.placement.choose(work, fitting, free, waiting)
                if replica is not None:
                    self.placement.start(ticket.request_id, replica, work)
                    self._affine.discard(ticket.request_id)
                else:   # it fits on `fitting` and waits for the replica caching its prompt: by choice
                    self._affine.add(ticket.request_id)
                return replica
            except Exception:  # noqa: BLE001 - else the tickets this pass took before it would never be woken
                log.exception("pool %s: placing %s failed; it goes where most credits are free", self.pool,
                              ticket.request_id)
        return max(fitting, key=lambda r: self.ledger.accounts[r].free)

    def observe(self, request_id: str, num_tokens: int, prefilled: bool = True) -> None:
        """The request streamed `num_tokens` more tokens: its replica's load goes down, and where
        `prefilled` (each of its prompts streamed one: a request of several is not computed at its first
        token) its prompts' blocks are shared from now on."""
        shared = prefilled and self.ledger.prefilled(request_id)
        self._since.pop(request_id, None)
        if self.placement is not None:
            self.placement.observe(request_id, num_tokens)
        if shared and self.ledger.num_queued:
            self._admit()   # a question waiting for this replica's copy of its document may fit now

    def pause_wait(self, request_id: str) -> float | None:
        """The request, admitted here, waits for another pool's credits: that wait is not this pool's
        (`oldest_wait`). When its wait here began (None: not counted), for `resume_wait`."""
        return self._since.pop(request_id, None)

    def resume_wait(self, request_id: str, since: float) -> None:
        """Count the request's wait for its first token again, as begun at `since` (its pause taken out)."""
        if self.ledger.ticket(request_id) is not None:
            self._since[request_id] = since

    def oldest_wait(self, now: float | None = None) -> float:
        """Seconds the oldest interactive request still without its first token has waited (queued for
        credits, in the engine's queue or being prefilled); 0 when none waits."""
        if not self._since:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - min(self._since.values()))

    def lease_demand(self, replica: int, now: float | None = None) -> LeaseDemand:
        """What this gateway asks of `replica`'s credits beyond what it holds there, for a replica shared by
        several gateways (`engine.sessions`): the credits the queued interactive requests ask for and those
        the batch lines ask for, and the request first in line (`CreditLedger.first_waiting`): the credits
        it needs there, how long it has waited, its id, whether it is a batch line."""
        ledger = self.ledger
        queued, batch = ledger.queued_tokens - ledger.background_tokens, ledger.background_tokens
        head = ledger.first_waiting()
        if head is None:
            return LeaseDemand(queued, batch)
        now = time.monotonic() if now is None else now
        waited = max(0.0, now - self._queued_since.get(head.request_id, now))
        return LeaseDemand(queued, batch, ledger.need(head, replica), waited, head.request_id, head.background)

    def oldest_credit_wait(self, now: float | None = None) -> float:
        """Seconds the longest-queued request has waited for KV credits (0 when none waits): demand
        past what the replicas' credits hold (`gateway.workers.autoscaler`). Batch lines and patient
        requests are left out: they wait by design, for KV the interactive load leaves; so is a request that fits
        on a replica now and waits for the one caching its prompt (a choice, not a shortage)."""
        pressing = [since for request_id, since in self._pressing_since.items() if request_id not in self._affine]
        if not pressing:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - min(pressing))

    def replica_ready(self, replica: int, restarted: bool = True) -> None:
        """A worker of `replica` is ready: a new process (`restarted`: its prefix cache is empty, and the
        placement forgets what it had), or the same one reached again (its cache intact); admit whoever
        now fits."""
        if self.placement is not None and restarted:
            self.placement.forget(replica)
        self._admit()

    def engine_cached(self, request_id: str, prompt: int, num_tokens: int) -> None:
        """The engine found `num_tokens` of the admitted request's prompt `prompt` (its index among the
        request's prompts in this pool) cached: the placement corrects its record of that replica's cache."""
        if self.placement is not None:
            self.placement.engine_cached(request_id, prompt, num_tokens)

    def reconcile(self, used_tokens: int, replica: int = 0) -> None:
        """A worker's blocks in use x block size; may admit (credits came back) or hold some back."""
        self.ledger.reconcile(used_tokens, replica)
        self._admit()
