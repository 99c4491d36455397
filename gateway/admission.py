"""Admission in the gateway: whose request it is, what KV it may need, and holding it while it runs.

Every request answered from local pools passes through `AdmissionControl.admitted` after it is routed
and checked against its pool's context, and before anything reaches the device worker:

1. its tenant comes from its API key (`pools.tenants`), and its body `priority` is clamped to what
   the tenant may use;
2. per pool it touches, it reserves its prompt blocks plus the blocks its longest possible output
   could take (`pools.credit_hold.reservation`; an unset max_tokens reserves the rest of the context);
3. it waits in its tenant's channel of that pool's queue until the credits are there (pools in name
   order, so two multi-prompt requests can never wait on each other), runs, and gives everything back
   the moment it ends — finished, failed or abandoned by its client.

A ticker reconciles each ledger with its worker's reported block use every `RECONCILE_INTERVAL`
seconds and admits whatever that frees; on the same tick it tells each worker how many interactive
requests of each pool wait for credits (the step composer favours a pool with a queue, wherever the
queue is). Metrics: `cliffguard_kv_credits_total` / `_free` per pool,
`cliffguard_admission_queue_depth` per pool and tenant (refreshed at each scrape),
`cliffguard_admission_wait_seconds`, `cliffguard_admission_admitted_total` and
`cliffguard_admission_expired_total` per pool and tenant.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics import REQUEST_LATENCY_BUCKETS
from gateway.openai_api import ApiError
from gateway.ticker import Ticker
from pools.credit_hold import Admission, PoolFull, QueueTimeout, reservation
from pools.pool import Pool
from pools.tenants import Tenants

log = logging.getLogger("cliffguard.admission")

RECONCILE_INTERVAL = 0.25   # seconds; the worker pushes its stats as often while busy
_PT = ["pool", "tenant"]


def bearer_key(request: web.Request) -> str | None:
    """The API key of `Authorization: Bearer <key>`, if any (the auth middleware already checked it)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class AdmissionMetrics:
    """The admission series, registered in the gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "cliffguard_"
        self.credits_total = Gauge(p + "kv_credits_total", "KV token slots of the pool (one credit each).",
                                   ["pool"], registry=registry)
        self.credits_free = Gauge(p + "kv_credits_free", "Credits not held by admitted requests.", ["pool"],
                                  registry=registry)
        self.queue_depth = Gauge(p + "admission_queue_depth", "Requests waiting for KV credits.", _PT,
                                 registry=registry)
        self.wait = Histogram(p + "admission_wait_seconds", "Time a request waited for KV credits.", _PT,
                              buckets=(0.0,) + REQUEST_LATENCY_BUCKETS, registry=registry)
        self.admitted = Counter(p + "admission_admitted", "Requests admitted by the credit ledger.", _PT,
                                registry=registry)
        self.expired = Counter(p + "admission_expired", "Requests refused for capacity: 503 after "
                               "max_queue_seconds in the queue, or 429 with max_queue_seconds 0.", _PT,
                               registry=registry)

    def refresh(self, pools: Sequence[Pool]) -> None:
        for pool in pools:
            admission = pool.admission
            self.credits_total.labels(pool=pool.name).set(admission.total)
            self.credits_free.labels(pool=pool.name).set(admission.free)
            for tenant, depth in admission.ledger.queued_by_tenant().items():
                self.queue_depth.labels(pool=pool.name, tenant=tenant).set(depth)
            self.queue_depth.labels(pool=pool.name, tenant="batch").set(admission.ledger.num_background_queued)


@dataclass
class AdmissionControl:
    """Tenants, the local pools' admissions and their metrics, for one gateway."""

    tenants: Tenants
    pools: dict[str, Pool]                 # local pools only, each with its `admission`
    metrics: AdmissionMetrics
    max_num_seqs: dict[str, int] = field(default_factory=dict)   # pool -> sequences it runs at once (the plan's)
    _ticker: Ticker | None = field(default=None, repr=False)
    _seen: dict[str, float] = field(default_factory=dict, repr=False)   # pool -> `taken_at` reconciled last
    _reported: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)   # pool -> (client id, count)

    @classmethod
    def build(cls, tenants: Tenants, pools: Sequence[Pool], registry: CollectorRegistry,
              credits: dict[str, int], max_num_seqs: dict[str, int] | None = None) -> AdmissionControl:
        """One Admission per local pool, `credits[name]` KV token slots each (the capacity plan's);
        `max_num_seqs[name]` refuses at once an `n` the pool's engine would refuse."""
        policies = tenants.policies
        local = {}
        for pool in pools:
            if pool.is_upstream:
                continue
            pool.admission = Admission(pool.name, credits[pool.name], tenants=policies,
                                       max_queue_seconds=pool.spec.max_queue_seconds)
            local[pool.name] = pool
        return cls(tenants, local, AdmissionMetrics(registry), dict(max_num_seqs or {}))

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
                       max_tokens_param: str = "max_tokens") -> AsyncIterator[None]:
        """Hold every credit the routed prompts may need for the duration of the block.

        ApiError 400 if the request can never fit a pool; 503 + Retry-After past max_queue_seconds."""
        needs = self._needs(routed, max_tokens, n, max_tokens_param)
        async with contextlib.AsyncExitStack() as stack:
            for name in sorted(needs):
                await stack.enter_async_context(self._hold(self.pools[name], needs[name], request_id, tenant,
                                                           priority, background))
            yield

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
            total = pool.admission.total
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
    async def _hold(self, pool: Pool, need: int, request_id: str, tenant: str, priority: int,
                    background: bool) -> AsyncIterator[None]:
        labels = {"pool": pool.name, "tenant": "batch" if background else tenant}
        started = time.perf_counter()
        try:
            async with pool.admission.hold(f"{request_id}@{pool.name}", need, tenant=tenant, priority=priority,
                                           background=background):
                self.metrics.wait.labels(**labels).observe(time.perf_counter() - started)
                self.metrics.admitted.labels(**labels).inc()
                yield
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
        """Reconcile each pool's ledger with the block use its worker reported last (once per report),
        and report each pool's credit queue to its worker when it changed (or the worker is new)."""
        for pool in self.pools.values():
            self._report_waiting(pool)
            stats = pool.client.latest_stats if pool.client is not None else None
            if stats is None or self._seen.get(pool.name) == stats.taken_at or pool.name not in stats.pools:
                continue
            self._seen[pool.name] = stats.taken_at
            ps = stats.pools[pool.name]
            try:
                pool.admission.reconcile((ps.num_blocks - ps.num_free_blocks) * pool.spec.block_size)
            except Exception:  # noqa: BLE001 - a bad report must not stop admission
                log.exception("pool %s: reconciling credits failed", pool.name)


    def _report_waiting(self, pool: Pool) -> None:
        client = pool.client
        if client is None:
            return
        count = pool.admission.ledger.num_queued - pool.admission.ledger.num_background_queued
        key = (id(client), count)
        if self._reported.get(pool.name) != key and (count or pool.name in self._reported):
            client.report_waiting(pool.name, count)
            self._reported[pool.name] = key


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
