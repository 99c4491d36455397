"""Admission in the gateway: whose request it is, what KV it may need, and holding it while it runs.

Every request answered from local pools passes through `AdmissionControl.admitted` after it is routed
and checked against its pool's context, and before anything reaches the device worker:

1. its tenant comes from its API key (`pools.tenants`), and its body `priority` is clamped to what
   the tenant may use;
2. per pool it touches, it reserves its prompt blocks plus the blocks its longest possible output
   could take (`pools.credits.queue.reservation`; an unset max_tokens reserves the rest of the context);
3. it waits in its tenant's channel of that pool's queue until the credits are there (the pool of the
   longest prompts first, then by name: one order, so two multi-prompt requests can never wait on each
   other, and a wait for rag's credits holds none of chat's idle) on one of the pool's replicas,
   the one that can start it soonest (`pools.credits.placement`), runs there, and gives everything back the
   moment it ends — finished, failed or abandoned by its client. `admitted` yields where each pool's
   part was placed (`Placed`: the replica, its worker client, and what to tell the placement as
   tokens stream).

A ticker reconciles each replica's credits with its worker's reported block use every
`RECONCILE_INTERVAL` seconds and admits whatever that frees; on the same tick it tells each worker how
many interactive requests of each pool wait for credits (the step composer favours a pool with a
queue, wherever the queue is). Metrics: `cliffguard_kv_credits` / `_free` per pool and replica,
`cliffguard_admission_queue_depth` per pool and tenant (refreshed at each scrape),
`cliffguard_admission_wait_seconds`, `cliffguard_admission_admitted_total` and
`cliffguard_admission_expired_total` per pool and tenant, `cliffguard_replica_requests_total` and
`cliffguard_replica_prompt_tokens_total` / `_cached_prompt_tokens_total` per pool and replica (where
placement sent requests, and how much of their prompts it expected cached there).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.stats import STATS_INTERVAL
from gateway.monitoring.metrics import REQUEST_LATENCY_BUCKETS
from gateway.openai.errors import ApiError
from gateway.ticker import Ticker
from pools.credits.queue import CreditQueue, LeaseDemand, PoolFull, QueueTimeout, reservation
from pools.credits.ledger import Ticket
from pools.credits.flows import FLOW_CAP
from pools.credits.placement import Placement, Work
from pools.pool import Pool
from pools.tenants import BATCH_LABEL, DEFAULT_TENANT, Tenants

log = logging.getLogger("cliffguard.admission")

RECONCILE_INTERVAL = STATS_INTERVAL   # seconds: as often as a busy worker pushes its stats
_PT = ["pool", "tenant"]
_PR = ["pool", "replica"]


def bearer_key(request: web.Request) -> str | None:
    """The API key of `Authorization: Bearer <key>`, if any (the auth middleware already checked it). A key
    that is not UTF-8 text is no key of ours: None (aiohttp hands header bytes over as latin-1 or surrogates)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    try:
        token.encode()
    except UnicodeEncodeError:
        return None
    return token or None if scheme.lower() == "bearer" else None


UNLISTED_TENANT = "unlisted"   # the metrics' tenant of keys no file lists, while no key is checked


class AdmissionMetrics:
    """The admission series, registered in the gateway's registry."""

    def __init__(self, registry: CollectorRegistry, tenant_label: Callable[[str], str] = str) -> None:
        p = "cliffguard_"
        self.tenant_label = tenant_label   # a tenant's label value (a bounded set: see AdmissionControl.build)
        self._depth_labels: dict[str, set[str]] = {}   # pool -> the tenant labels its queue depth was given
        self.credits = Gauge(p + "kv_credits", "KV token slots of the pool on the replica (one credit each).",
                             _PR, registry=registry)
        self.credits_free = Gauge(p + "kv_credits_free", "Credits not held by admitted requests (0 while the "
                                  "replica is down).", _PR, registry=registry)
        self.placed = Counter(p + "replica_requests", "Requests placed on the replica.", _PR, registry=registry)
        self.placed_tokens = Counter(p + "replica_prompt_tokens", "Prompt tokens of the requests placed on the "
                                     "replica.", _PR, registry=registry)
        self.placed_cached = Counter(p + "replica_cached_prompt_tokens", "Prompt tokens placement expected "
                                     "cached on the replica it chose (prefix affinity).", _PR, registry=registry)
        self.queue_depth = Gauge(p + "admission_queue_depth", "Requests waiting for KV credits.", _PT,
                                 registry=registry)
        self.wait = Histogram(p + "admission_wait_seconds", "Time a request waited for KV credits.", _PT,
                              buckets=(0.0,) + REQUEST_LATENCY_BUCKETS, registry=registry)
        self.admitted = Counter(p + "admission_admitted", "Requests admitted by the credit ledger.", _PT,
                                registry=registry)
        self.expired = Counter(p + "admission_expired", "Requests refused for capacity: 503 after "
                               "max_queue_seconds in the queue, or 429 with max_queue_seconds 0.", _PT,
                               registry=registry)

    def refresh(self, pools: Sequence[Pool], parked: Collection[tuple[str, int]] = ()) -> None:
        """The credit and queue gauges of `pools`. A replica `parked` by the autoscaler ((device, replica)) has
        no credit series until it serves again, as its other gauges (`GatewayMetrics.update_replica`): the
        pool's credits (the dashboard's "free of") are the started replicas'."""
        for pool in pools:
            admission = pool.admission
            ledger = admission.ledger
            for replica, account in enumerate(ledger.accounts):
                up = admission.replica_up(replica)   # the supervisors' word now (the ledger's: at its last pass)
                labels = {"pool": pool.name, "replica": str(replica)}
                if parked and (pool.device, replica) in parked:
                    for gauge in (self.credits, self.credits_free):
                        with contextlib.suppress(KeyError):   # never set, or removed already
                            gauge.remove(*labels.values())
                    continue
                self.credits.labels(**labels).set(account.total)
                self.credits_free.labels(**labels).set(account.free if up else 0)
            # a tenant whose last request ended is gone from the ledger: its series stays, at 0
            depths = dict.fromkeys(self._depth_labels.setdefault(pool.name, set()), 0)
            for tenant, depth in admission.ledger.queued_by_tenant().items():
                label = self.tenant_label(tenant)
                depths[label] = depths.get(label, 0) + depth
            self._depth_labels[pool.name].update(depths)
            for label, depth in depths.items():
                self.queue_depth.labels(pool=pool.name, tenant=label).set(depth)
            self.queue_depth.labels(pool=pool.name, tenant=BATCH_LABEL).set(admission.ledger.num_background_queued)


@dataclass
class Placed:
    """Where one pool's part of a request runs: a replica of the pool, holding its credits there."""

    pool: Pool
    replica: int
    key: str                  # the request's id in the pool's ledger and placement
    credits: int = 0          # what its admission took there (a shared replica counts them: `engine.sessions`)
    background: bool = False  # a batch line's credits

    @property
    def client(self):
        """The replica's worker client (`Pool.clients`)."""
        return self.pool.clients[self.replica]

    def observe(self, num_tokens: int, prefilled: bool = True) -> None:
        """`num_tokens` more tokens streamed: the replica's token load goes down; `prefilled`: every prompt
        of the request in this pool has streamed one (their blocks are computed)."""
        self.pool.admission.observe(self.key, num_tokens, prefilled)


def credit_shares(pools: Sequence[str], placed: dict[str, Placed]) -> list[int]:
    """Each prompt's share (prompts in order, each named by its pool) of the credits its pool's part holds
    (`Placed.credits`): even, the remainder on the pool's first. A shared replica counts each prompt's share
    until that prompt ends (`engine.sessions`): all of them said by the first, they were released with it while
    the others still ran, and the replica's count of the gateway's demand fell short."""
    members: dict[str, list[int]] = {}
    for i, name in enumerate(pools):
        members.setdefault(name, []).append(i)
    shares = [0] * len(pools)
    for name, indices in members.items():
        share, rest = divmod(placed[name].credits, len(indices))
        for i in indices:
            shares[i] = share + (rest if i == indices[0] else 0)
    return shares


@dataclass
class AdmissionControl:
    """Tenants, the local pools' admissions and their metrics, for one gateway."""

    tenants: Tenants
    pools: dict[str, Pool]                 # local pools only, each with its `admission`
    metrics: AdmissionMetrics
    max_num_seqs: dict[str, int] = field(default_factory=dict)   # pool -> sequences it runs at once (the plan's)
    _ticker: Ticker | None = field(default=None, repr=False)
    _seen: dict[tuple[str, int], float] = field(default_factory=dict, repr=False)   # (pool, replica) -> `taken_at`
    _reported: dict[tuple[str, int], tuple] = field(default_factory=dict, repr=False)   # -> (client, what it was told)

    @classmethod
    def build(cls, tenants: Tenants, pools: Sequence[Pool], registry: CollectorRegistry,
              credits: dict[str, int], max_num_seqs: dict[str, int] | None = None, *,
              keys_checked: bool = True, state_pools: frozenset[str] = frozenset()) -> AdmissionControl:
        """One CreditQueue per local pool, `credits[name]` KV token slots on each of its replicas (the
        capacity plan's), placed by token load and prefix affinity; `max_num_seqs[name]` refuses at once
        an `n` the pool's engine would refuse. `keys_checked`: only listed API keys get in, so the per-key
        tenants are as many as the keys; otherwise the metrics put every unlisted key's tenant under
        UNLISTED_TENANT (a client could make a series per request), while credits stay each key's own.
        `state_pools`: those of a model with state layers, whose requests are credited their whole prompts (its
        engine resumes a cached prefix only where it kept a state, and computes the blocks past it again:
        `engine.state_cache`; credits counting them once would promise blocks the engine does not share)."""
        policies = tenants.policies
        local = {}
        for pool in pools:
            if pool.is_upstream:
                continue
            block_size = pool.spec.block_size
            placement = Placement(pool.num_replicas, block_size, max_cached_blocks=credits[pool.name] // block_size,
                                  avg_len=pool.spec.avg_len,
                                  share_blocks=pool.spec.enable_prefix_caching and pool.name not in state_pools)
            pool.admission = CreditQueue(pool.name, [credits[pool.name]] * pool.num_replicas, tenants=policies,
                                       max_queue_seconds=pool.spec.max_queue_seconds, placement=placement,
                                       max_seqs=(max_num_seqs or {}).get(pool.name),
                                       flow_cap=FLOW_CAP if pool.spec.slo is not None else None)
            local[pool.name] = pool
        def label(tenant: str) -> str:
            return tenant if keys_checked or tenant in tenants.specs or tenant == DEFAULT_TENANT else UNLISTED_TENANT
        return cls(tenants, local, AdmissionMetrics(registry, label), dict(max_num_seqs or {}))

    def tenant_of(self, request: web.Request) -> str:
        """The tenant of the request's API key: whose credits it spends, and who owns what it creates."""
        return self.tenants.resolve(bearer_key(request))

    def clamp_priority(self, tenant: str, priority: int) -> int:
        """`priority`, or the tenant's `min_priority` if that is worse (larger): no tenant is served
        ahead of what its configuration allows."""
        return max(priority, self.tenants.policy(tenant).min_priority)

    # --- holding credits -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admitted(self, routed: Sequence[tuple[Pool, list[int]]], *, max_tokens: int | None, n: int,
                       request_id: str, tenant: str, priority: int, background: bool = False,
                       max_tokens_param: str = "max_tokens", patient: bool = False,
                       received: float | None = None) -> AsyncIterator[dict[str, Placed]]:
        """Hold every credit the routed prompts may need for the duration of the block; yields where
        each pool's prompts were placed (pool name -> `Placed`).

        ApiError 400 if the request can never fit a pool; 503 + Retry-After past max_queue_seconds counted
        from `received` (the request's arrival, perf_counter; default now), whatever it waited for before
        (not for `background` or `patient` requests: `CreditQueue.hold`)."""
        received = time.perf_counter() if received is None else received
        needs = self._needs(routed, max_tokens, n, max_tokens_param)
        prompts: dict[str, list[list[int]]] = {}
        for pool, ids in routed:
            prompts.setdefault(pool.name, []).append(ids)
        placed, paused = {}, []   # paused: (queue, key, since, when): a pool that admitted it, not its wait
        async with contextlib.AsyncExitStack() as stack:
            # the pool of the longest prompts first (rag's, the one a flood fills), then by name: one order for
            # every request, so two never wait on each other, and a wait for rag holds no chat credits idle. A
            # batch line waits behind the others in its first pool only: holding that pool's credits, it waits
            # in the next ones among their requests, patiently (behind them, it held the first pool's credits
            # idle for as long as a later pool's queue was never empty)
            for i, name in enumerate(sorted(needs, key=lambda name: (-self.pools[name].min_prompt_tokens, name))):
                pool = self.pools[name]
                work = pool.admission.placement.work(prompts[name], max_tokens, n, pool.max_model_len,
                                                     pool.cache_salt(tenant))
                key = f"{request_id}@{name}"
                line = background and i > 0   # a batch line for its accounting and the engine, waiting as patient
                ticket = await stack.enter_async_context(self._hold(
                    pool, key, needs[name], tenant, priority, background and not i, work, n * len(prompts[name]),
                    patient or line, time.perf_counter() - received, line))
                placed[name] = Placed(pool, ticket.replica, key, ticket.charged, ticket.background or line)
                self._count_placement(pool, ticket.replica, work, key)
                if len(needs) > 1:   # its wait for the next pools' credits is theirs (`oldest_wait`, overload)
                    paused.append((pool.admission, key, pool.admission.pause_wait(key), time.monotonic()))
            now = time.monotonic()
            for queue, key, since, when in paused:
                if since is not None:
                    queue.resume_wait(key, since + now - when)
            yield placed

    def _count_placement(self, pool: Pool, replica: int, work: Work, key: str) -> None:
        labels = {"pool": pool.name, "replica": str(replica)}
        self.metrics.placed.labels(**labels).inc()
        self.metrics.placed_tokens.labels(**labels).inc(work.num_prompt_tokens)
        self.metrics.placed_cached.labels(**labels).inc(pool.admission.placement.cached_tokens(key))

    def _needs(self, routed: Sequence[tuple[Pool, list[int]]], max_tokens: int | None, n: int,
               param: str) -> dict[str, int]:
        """Credits per pool. A request that could never fit its pool is the client's error (400 at
        once, never capped: the engine is never asked for more KV than was credited); with max_tokens
        unset every sample may run to the end of the context, and the message says what would fit."""
        lens: dict[str, list[int]] = {}
        for pool, ids in routed:
            lens.setdefault(pool.name, []).append(len(ids))
        needs = {}
        for name, prompt_lens in lens.items():
            pool = self.pools[name]
            limit = self.max_num_seqs.get(name)
            if limit is not None and n > limit:   # the engine refuses it too, but only once its worker is up
                raise ApiError(400, f"n: {n} samples run together, and pool {name!r} runs at most max_num_seqs "
                               f"{limit} sequences at once", param="n")
            need = reservation(prompt_lens, max_tokens, n, block_size=pool.spec.block_size,
                               max_model_len=pool.max_model_len)
            total = pool.admission.max_request
            if need > total:
                what = f"{param}={max_tokens}" if max_tokens is not None else \
                    f"{param} unset (each sample may run to max_model_len {pool.max_model_len})"
                fit = _largest_fit(prompt_lens, n, pool, total)
                hint = f"at most {param}={fit} fits" if fit else "fewer prompts or a smaller n fit"
                raise ApiError(400, f"{param}: {len(prompt_lens)} prompt(s) of {sum(prompt_lens)} tokens with n={n} "
                               f"and {what} may need {need} KV token slots; pool {name!r} has {total}: "
                               f"{hint}", param=param, code="context_length_exceeded")
            needs[name] = need
        return needs

    @contextlib.asynccontextmanager
    async def _hold(self, pool: Pool, key: str, need: int, tenant: str, priority: int, background: bool,
                    work: Work, num_seqs: int, patient: bool = False, spent: float = 0.0,
                    batch_line: bool = False) -> AsyncIterator[Ticket]:
        batch = background or batch_line
        labels = {"pool": pool.name, "tenant": "batch" if batch else self.metrics.tenant_label(tenant)}
        started = time.perf_counter()
        try:
            async with pool.admission.hold(key, need, tenant=tenant, priority=priority, background=background,
                                           work=work, num_seqs=num_seqs, patient=patient, spent=spent,
                                           batch_line=batch_line) as ticket:
                self.metrics.wait.labels(**labels).observe(time.perf_counter() - started)
                self.metrics.admitted.labels(**labels).inc()
                yield ticket
        except PoolFull as exc:
            self.metrics.expired.labels(**labels).inc()
            raise ApiError(429, str(exc), type="server_error", code="pool_full",
                           headers={"Retry-After": "1"}) from None
        except QueueTimeout as exc:
            self.metrics.expired.labels(**labels).inc()
            retry_after = max(1, round(exc.limit))
            raise ApiError(503, str(exc), type="server_error", code="queue_timeout",
                           headers={"Retry-After": str(retry_after)}) from None

    # --- reconciliation --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reconciliation ticker (idempotent; needs a running loop)."""
        if self._ticker is None:
            self._ticker = Ticker("cliffguard-admission", RECONCILE_INTERVAL, self.reconcile, log,
                                  "reconciling credits failed")
        self._ticker.start()

    async def stop(self) -> None:
        if self._ticker is not None:
            await self._ticker.stop()

    def reconcile(self) -> None:
        """Reconcile each replica's credits with the block use its worker reported last (once per report),
        and report each pool's credit queue to its workers when it changed (or a worker is new)."""
        for pool in self.pools.values():
            count = pool.admission.ledger.num_queued - pool.admission.ledger.num_background_queued
            for replica, client in enumerate(pool.clients):
                if client is None:
                    continue
                self._report_waiting(pool, replica, client, count)
                stats = client.latest_stats
                key = (pool.name, replica)
                if stats is None or self._seen.get(key) == stats.taken_at or pool.name not in stats.pools:
                    continue
                self._seen[key] = stats.taken_at
                ps = stats.pools[pool.name]
                try:
                    used = ps.num_session_blocks   # a replica shared by gateways: this gateway's blocks
                    if used is None:
                        used = ps.num_blocks - ps.num_free_blocks
                    pool.admission.reconcile(used * pool.spec.block_size, replica)
                except Exception:  # noqa: BLE001 - a bad report must not stop admission
                    log.exception("pool %s replica %d: reconciling credits failed", pool.name, replica)

    def _report_waiting(self, pool: Pool, replica: int, client, count: int) -> None:
        """Every replica's composer hears the pool's whole queue: any of them may get its head next. A
        replica that leases this gateway its credits (one shared by several gateways, `engine.sessions`)
        also hears what the queue asks of it (`CreditQueue.lease_demand`). A report goes when any of it
        changed, or to a new worker (the client object itself is the key: an id() could be reused by the
        next client)."""
        key = (pool.name, replica)
        demand = LeaseDemand(0)
        if getattr(client, "leases", None):
            demand = pool.admission.lease_demand(replica)
        said = (count, demand.queued, demand.queued_batch, demand.head, demand.head_id)
        last = self._reported.get(key)
        if last is not None and last[0] is client and last[1] == said:
            return
        if count or demand.queued or demand.queued_batch or last is not None:
            client.report_waiting(pool.name, count, queued=demand.queued, queued_batch=demand.queued_batch,
                                  head=demand.head, head_waited=demand.head_waited,
                                  head_background=demand.head_background)
            self._reported[key] = (client, said)

def _largest_fit(prompt_lens: list[int], n: int, pool: Pool, total: int) -> int:
    """The largest max_tokens whose reservation fits `total` credits (0 if none does)."""
    low, high = 0, pool.max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        if reservation(prompt_lens, mid, n, block_size=pool.spec.block_size,
                       max_model_len=pool.max_model_len) <= total:
            low = mid
        else:
            high = mid - 1
    return low
