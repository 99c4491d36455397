"""`GET /dashboard`: one self-contained page showing each pool live, and `GET /dashboard/data`, its JSON.

The numbers are the ones `/metrics` shows, by construction: `data` does the `/metrics` handler's
refresh (`handlers.refresh_metrics`: the stats each device worker pushed last) and takes each pool's
series from the same registry (`parse_snapshot`). The page itself is a static file,
gateway/monitoring/static/dashboard.html. What a
single scrape cannot say, a rate or a recent p99, comes from the difference between this snapshot and
an older one: `DashboardHistory` keeps the snapshots of the last `HISTORY_SECONDS`, taken as the page
polls, and serves them as the page's time series, so a page opened late, or a second viewer, sees the
same history (nothing is sampled while nobody looks).

- preemption rate: the increase of `cliffguard_num_preemptions_total` (all modes) over the window
  (`WINDOW_SECONDS`: from the newest snapshot at least that old, or the oldest one while the history is
  shorter) divided by the time between the two snapshots;
- TTFT and ITL p99: the increase of each histogram bucket over the same window, with the 99th
  percentile interpolated linearly inside the bucket that holds it, as Prometheus's
  `histogram_quantile` does (`histogram_quantile` here); `*_window_count` is how many observations the
  window held (null p99: none).

A pool on a replicated device (`replicas: N`) has each series once per replica: the pool's value is
their sum, except KV usage, their mean (each replica owns the same number of blocks); `replicas` in
its JSON keeps each replica's own (`REPLICA_VALUES`), and `replica_split` each one's share of the
prompt tokens placed on the pool.

Auth: the page (`page`) holds no data and is served to anyone (`gateway.app` lists it among the open
paths); `/dashboard/data` is an API path, so with API keys configured it needs `Authorization: Bearer`
like the rest of the API. The page asks for the key (or takes it from the URL fragment, `#key=...`,
which browsers never send to a server), keeps it in `sessionStorage` and sends it as that header on its
fetches: the key never appears in a URL the gateway, a proxy or a log sees. `PAGE_HEADERS` carry a
Content-Security-Policy that allows only the page's own inline script and style (by hash) and fetches
to its own origin.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client.metrics_core import Metric

from gateway import handlers
from gateway.runtime import GATEWAY

__all__ = ["DASHBOARD", "PAGE", "PAGE_HEADERS", "DashboardHistory", "Snapshot", "data", "histogram_quantile",
           "page", "parse_snapshot"]

WINDOW_SECONDS = 30.0        # rates and p99s: the death-spiral detector's default window
HISTORY_SECONDS = 300.0      # time series: the last five minutes
MIN_SAMPLE_SECONDS = 0.5     # a poll sooner than this after the last snapshot kept is not kept (many viewers)
POLL_SECONDS = 1.0           # how often the page polls
QUANTILE = 0.99

_P = "cliffguard_"
# JSON key -> the /metrics sample it shows, per pool (summed over any other label: mode, tenant)
VALUES = {
    "kv_cache_usage_perc": _P + "kv_cache_usage_perc",
    "num_requests_running": _P + "num_requests_running",
    "pool_max_num_seqs": _P + "pool_max_num_seqs",
    "num_requests_waiting": _P + "num_requests_waiting",
    "num_requests_swapped": _P + "num_requests_swapped",
    "num_preemptions_total": _P + "num_preemptions_total",
    "kv_credits": _P + "kv_credits",
    "kv_credits_free": _P + "kv_credits_free",
    "admission_queue_depth": _P + "admission_queue_depth",
    "death_spiral": _P + "death_spiral",
    "oldest_waiting_seconds": _P + "pool_oldest_waiting_seconds",
}
# JSON key -> the /metrics sample of the pool's device (gateway.overload), shown on each of its pools
DEVICE_VALUES = {
    "device_overloaded": _P + "device_overloaded",
    "device_offered_load": _P + "device_offered_load",
    "device_replicas_needed": _P + "device_replicas_needed",
}
# JSON keys of the pool's device's replicas by state (`cliffguard_replicas{device,state}`)
REPLICA_STATE_VALUES = ("replicas_ready", "replicas_loading", "replicas_draining", "replicas_restarting",
                        "replicas_failed", "replicas_stopped")
# ... averaged over the pool's replicas instead of summed (a fraction of each replica's blocks)
MEANS = {_P + "kv_cache_usage_perc"}
# JSON key -> the sample shown per replica of a pool (`replicas` in each pool's JSON): the engine's and the
# credit ledger's values, and what placement sent each replica (counters since start)
REPLICA_VALUES = {key: VALUES[key] for key in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                                               "kv_credits_free")} | {
    "replica_requests_total": _P + "replica_requests_total",
    "replica_prompt_tokens_total": _P + "replica_prompt_tokens_total",
}
HISTOGRAMS = {"ttft": _P + "time_to_first_token_seconds", "itl": _P + "inter_token_latency_seconds"}
SERIES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_swapped",
          "preemptions_per_second", "ttft_p99_seconds", "itl_p99_seconds", "kv_credits_free",
          "admission_queue_depth", "death_spiral", "oldest_waiting_seconds", "device_offered_load",
          "replicas_ready")   # one per tile of the page (its sparkline), and the gauge

Buckets = tuple[tuple[float, float], ...]   # (upper bound `le`, cumulative count), ascending, +Inf last


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram, as Prometheus's `histogram_quantile`: linear inside the
    bucket that holds rank q x count, from 0 below the first bucket; the largest finite bound when the
    rank falls in the +Inf bucket. None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    below_le, below_count = 0.0, 0.0
    for i, (le, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(le):
                return buckets[i - 1][0] if i > 0 else None
            if count == below_count:
                return le
            return below_le + (le - below_le) * (rank - below_count) / (count - below_count)
        below_le, below_count = le, count
    return None


@dataclass(frozen=True)
class Snapshot:
    """Each pool's series from one rendering of `/metrics`, at `time` (monotonic) / `wall` (Unix)."""

    time: float
    wall: float
    values: dict[str, dict[str, float | None]]       # pool -> VALUES key -> value (None: not exported)
    histograms: dict[str, dict[str, Buckets]]        # pool -> HISTOGRAMS key -> cumulative buckets
    stats_age: dict[str, float] = field(default_factory=dict)   # device -> cliffguard_stats_age_seconds (max)
    # pool -> replica ("0", "1", ...) -> REPLICA_VALUES key -> value (None: not exported for that replica)
    replicas: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)


def parse_snapshot(families: Iterable[Metric], pools: Iterable[str], *, now: float, wall: float,
                   devices: Mapping[str, str] | None = None) -> Snapshot:
    """The dashboard's series of `pools` among metric families: the registry's (`collect()`), or those
    prometheus_client's parser reads from a text exposition (the tests compare both). `devices`: each
    pool's device, whose overload series (`DEVICE_VALUES`) the pool shows."""
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], int] = {}
    by_replica: dict[tuple[str, str, str], float] = {}
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    stats_age: dict[str, float] = {}
    device_values: dict[tuple[str, str], float] = {}
    device_names = set(DEVICE_VALUES.values())
    bucket_names = {name + "_bucket" for name in HISTOGRAMS.values()}
    replica_names = set(REPLICA_VALUES.values())
    for family in families:
        for s in family.samples:
            pool = s.labels.get("pool")
            if s.name == _P + "stats_age_seconds":   # a replicated device: its oldest replica's
                device = s.labels.get("device", "")
                stats_age[device] = max(stats_age.get(device, 0.0), s.value)
            elif s.name in device_names:
                device_values[s.name, s.labels.get("device", "")] = s.value
            elif s.name == _P + "replicas":   # the device's replicas by state (gateway.autoscaler)
                device_values[f"replicas_{s.labels.get('state')}", s.labels.get("device", "")] = s.value
            elif pool is None:
                continue
            elif s.name in bucket_names:
                buckets.setdefault((s.name, pool), []).append((float(s.labels["le"]), s.value))
            else:
                sums[s.name, pool] = sums.get((s.name, pool), 0.0) + s.value
                counts[s.name, pool] = counts.get((s.name, pool), 0) + 1
                if s.name in replica_names and "replica" in s.labels:
                    key = (s.name, pool, s.labels["replica"])
                    by_replica[key] = by_replica.get(key, 0.0) + s.value
    values, histograms, replicas = {}, {}, {}
    for pool in pools:
        values[pool] = {key: (sums[name, pool] / counts[name, pool] if name in MEANS else sums[name, pool])
                        if (name, pool) in sums else None for key, name in VALUES.items()}
        device = (devices or {}).get(pool)
        values[pool] |= {key: device_values.get((name, device)) for key, name in DEVICE_VALUES.items()}
        values[pool] |= {key: device_values.get((key, device)) for key in REPLICA_STATE_VALUES}
        histograms[pool] = {key: tuple(sorted(buckets[name + "_bucket", pool]))
                            for key, name in HISTOGRAMS.items() if (name + "_bucket", pool) in buckets}
        names = sorted({r for (_, p, r) in by_replica if p == pool}, key=int)
        replicas[pool] = {r: {key: by_replica.get((name, pool, r)) for key, name in REPLICA_VALUES.items()}
                          for r in names}
    return Snapshot(now, wall, values, histograms, stats_age, replicas)


_NO_OBSERVATION: Buckets = ((math.inf, 0.0),)


def _increase(new: Buckets, old: Buckets | None) -> Buckets | None:
    """Each bucket's increase from `old` to `new`; None if the buckets differ or a count fell."""
    if old is None:
        return new
    if [le for le, _ in new] != [le for le, _ in old]:
        return None
    out = tuple((le, count - before) for (le, count), (_, before) in zip(new, old))
    return None if any(count < 0 for _, count in out) else out


def _derive(snapshot: Snapshot, base: Snapshot | None) -> dict[str, dict[str, float | None]]:
    """Per pool: the preemption rate, p99s and window counts from `base` to `snapshot` (None: no base).
    A series `base` lacks had not been exported yet: it counted from 0."""
    out: dict[str, dict[str, float | None]] = {}
    span = snapshot.time - base.time if base is not None else 0.0
    for pool, values in snapshot.values.items():
        derived: dict[str, float | None] = {"preemptions_per_second": None}
        before = base.values.get(pool, {}) if base is not None else {}
        total = values["num_preemptions_total"]
        if span > 0 and total is not None:
            increase = total - (before.get("num_preemptions_total") or 0.0)
            derived["preemptions_per_second"] = increase / span if increase >= 0 else None
        for key in HISTOGRAMS:
            window = _NO_OBSERVATION if span > 0 else None     # a histogram not exported yet has no observation
            if span > 0 and key in snapshot.histograms[pool]:
                window = _increase(snapshot.histograms[pool][key], base.histograms.get(pool, {}).get(key))
            derived[f"{key}_p99_seconds"] = histogram_quantile(QUANTILE, window) if window else None
            derived[f"{key}_window_count"] = window[-1][1] if window else None
        out[pool] = derived
    return out


@dataclass
class _Sample:
    snapshot: Snapshot
    derived: dict[str, dict[str, float | None]]
    window: float          # seconds between the snapshot and the one its rates are measured from


class DashboardHistory:
    """The snapshots of the last `history_seconds`, each with its rates and p99s, for one app.

    `add` is called by each poll of `/dashboard/data` (`poll`). A snapshot taken less than `min_interval`
    after the last one kept is answered (its rates and p99s measured as any other) but not kept, so many
    viewers do not crowd the history. Runs on the event loop only."""

    def __init__(self, *, window_seconds: float = WINDOW_SECONDS, history_seconds: float = HISTORY_SECONDS,
                 min_interval: float = MIN_SAMPLE_SECONDS) -> None:
        self.window_seconds = window_seconds
        self.history_seconds = history_seconds
        self.min_interval = min_interval
        self._samples: deque[_Sample] = deque()
        self._answer: tuple[float, dict] | None = None   # the last answer, and when its snapshot was taken
        self._taking: asyncio.Future | None = None       # the snapshot being taken, which polls meanwhile share

    async def poll(self, take: Callable[[], Awaitable[Snapshot]]) -> dict:
        """A viewer's answer: the last one while its snapshot is younger than `min_interval`, else a new
        snapshot's (`take`), one at a time however many viewers poll: each walks the whole registry, a
        second of the loop's time with thousands of tenants' series."""
        if self._answer is not None and time.monotonic() - self._answer[0] < self.min_interval:
            return self._answer[1]
        if self._taking is None or self._taking.done():
            self._taking = asyncio.ensure_future(self._take(take))
        return await asyncio.shield(self._taking)

    async def _take(self, take: Callable[[], Awaitable[Snapshot]]) -> dict:
        snapshot = await take()
        answer = self.add(snapshot)
        self._answer = (snapshot.time, answer)
        return answer

    def add(self, snapshot: Snapshot) -> dict:
        """Measure `snapshot` against the history, keep it if due, and answer the dashboard's JSON
        (docs/DASHBOARD.md)."""
        samples = self._samples
        base = self._base(snapshot.time)
        window = snapshot.time - base.time if base is not None else 0.0
        current = _Sample(snapshot, _derive(snapshot, base), window)
        if not samples or snapshot.time - samples[-1].snapshot.time >= self.min_interval:
            samples.append(current)
            while samples[0].snapshot.time < snapshot.time - self.history_seconds:
                samples.popleft()
            return self._view(list(samples))
        return self._view([*samples, current])

    def _base(self, now: float) -> Snapshot | None:
        """The newest snapshot at least a window old, or the oldest one while the history is shorter."""
        base = None
        for sample in self._samples:
            if sample.snapshot.time > now - self.window_seconds:
                break
            base = sample.snapshot
        if base is None and self._samples:
            base = self._samples[0].snapshot
        return base

    def _view(self, samples: list[_Sample]) -> dict:
        """The JSON of `samples[-1]`, with `samples` as its time series."""
        last = samples[-1]
        now = last.snapshot
        pools = {}
        for pool, values in now.values.items():
            rows = [{**s.snapshot.values.get(pool, {}), **s.derived.get(pool, {})} for s in samples]
            series = {"age_seconds": [round(now.time - s.snapshot.time, 3) for s in samples]}
            series |= {key: [_finite(row.get(key)) for row in rows] for key in SERIES}
            pools[pool] = {key: _finite(v) for key, v in rows[-1].items()} | {"series": series}
            replicas = now.replicas.get(pool, {})
            pools[pool]["replicas"] = {r: {key: _finite(v) for key, v in vals.items()} for r, vals in replicas.items()}
            pools[pool]["replica_split"] = _replica_split(replicas)
        return {"time": now.wall, "window_seconds": round(last.window, 3),
                "window_target_seconds": self.window_seconds, "history_seconds": self.history_seconds,
                "poll_seconds": POLL_SECONDS, "quantile": QUANTILE, "stats_age_seconds": now.stats_age,
                "pools": pools}


def _replica_split(replicas: dict[str, dict[str, float | None]]) -> dict[str, float] | None:
    """Each replica's share of the prompt tokens placed on its pool since start
    (`replica_prompt_tokens_total`; a replica without the series yet has had none). None for a pool
    with fewer than two replicas, or before any prompt token was placed."""
    if len(replicas) < 2:
        return None
    tokens = {r: values.get("replica_prompt_tokens_total") or 0.0 for r, values in replicas.items()}
    total = sum(tokens.values())
    return {r: n / total for r, n in tokens.items()} if total > 0 else None


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity."""
    return value if value is None or math.isfinite(value) else None


DASHBOARD = web.AppKey("dashboard", DashboardHistory)


# --- handlers --------------------------------------------------------------------------------------
async def page(request: web.Request) -> web.Response:
    """The page: HTML with its style and script inline; it fetches `dashboard/data`."""
    return web.Response(text=PAGE, content_type="text/html", headers=PAGE_HEADERS)


async def data(request: web.Request) -> web.Response:
    """Every pool's current values, rates, p99s and time series, from the metrics registry as `/metrics`
    would render it now (the same refresh from the stats each worker pushed last)."""
    gateway = request.app[GATEWAY]

    async def take() -> Snapshot:
        handlers.refresh_metrics(gateway)
        devices = {name: p.device for name, p in gateway.pools.items() if not p.is_upstream}
        return await asyncio.to_thread(   # on a thread, as /metrics is written
            lambda: parse_snapshot(gateway.metrics.registry.collect(), gateway.pools, now=time.monotonic(),
                                   wall=time.time(), devices=devices))

    return web.json_response(await request.app[DASHBOARD].poll(take), headers={"Cache-Control": "no-store"})


# --- the page --------------------------------------------------------------------------------------
# gateway/monitoring/static/dashboard.html, shipped as package data. No URL to anywhere in it: no fonts, scripts
# or images from outside, and no namespace strings (the sparklines are SVG written as markup inside
# inline <svg> elements). Its one inline <style> and one inline <script> are allowed by hash.
PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text(encoding="utf-8")
_STYLE = re.search(r"<style>(.*?)</style>", PAGE, re.S).group(1)
_SCRIPT = re.search(r"<script>(.*?)</script>", PAGE, re.S).group(1)


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_sha256(_SCRIPT)}; style-src {_sha256(_STYLE)}; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
