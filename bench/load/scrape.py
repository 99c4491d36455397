"""`/metrics` while a load runs: Prometheus' own parser over each scrape (`parse_metrics`), one
`Scraper` polling on a fixed schedule, the per-pool series it keeps and each device's replicas by state
(`replica_states`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from bench.load.sender import error_message
from bench.load.plan import LoadConfig

log = logging.getLogger("cliffguard.bench.serve")

# Prometheus sample name -> key in ScrapeSample.pools; preemptions are summed over their `mode` label.
SCRAPED = {"cliffguard_kv_cache_usage_perc": "kv_cache_usage_perc",
           "cliffguard_num_requests_running": "num_requests_running",
           "cliffguard_num_requests_waiting": "num_requests_waiting",
           "cliffguard_num_preemptions_total": "num_preemptions_total",
           "cliffguard_computed_tokens_total": "computed_tokens_total",
           "cliffguard_pool_device_seconds_total": "device_seconds_total",
           "cliffguard_engine_busy_seconds_total": "busy_seconds_total",      # no pool label: under ""
           "cliffguard_device_overloaded": "device_overloaded",               # no pool label: under "" (summed)
           "cliffguard_admission_queue_depth": "admission_queue_depth"}       # waiting for KV credits (tenants summed)
REPLICAS = "cliffguard_replicas"     # gauge {device, state}: replicas of the device in each state
COUNTERS = ("num_preemptions_total", "computed_tokens_total", "device_seconds_total", "busy_seconds_total")
SCRAPE_TIMEOUT_S = 10.0


# --- /metrics -------------------------------------------------------------------------------------------------

def pool_samples(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {pool: {sample name: value}}, each value summed over the sample's other labels
    (mode, tenant, replica), but a fraction (`*_perc`) averaged over them; samples without a `pool` label
    under "". The one reader of `/metrics` text in the benchmarks: prometheus_client's parser, so a
    malformed exposition raises ValueError."""
    from prometheus_client.parser import text_string_to_metric_families

    pools: dict[str, dict[str, float]] = {}
    counts: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            pool = sample.labels.get("pool", "")
            values = pools.setdefault(pool, {})
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            counts[pool, sample.name] = counts.get((pool, sample.name), 0) + 1
    for (pool, name), count in counts.items():
        if name.endswith("_perc") and count > 1:
            pools[pool][name] /= count
    return pools


def replica_counters(text: str, name: str = "cliffguard_computed_tokens_total") -> dict[str, dict[str, float]]:
    """Prometheus text -> {pool: {replica: value}} of one series with `pool` and `replica` labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and "pool" in sample.labels and "replica" in sample.labels:
                out.setdefault(sample.labels["pool"], {})[sample.labels["replica"]] = sample.value
    return out


def samples_of(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Prometheus text -> every sample of one series name, with its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def replica_states(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {device: {state: replicas}} of `cliffguard_replicas` (states as the server names
    them: ready, loading, draining, ...); {} from a server without the series."""
    out: dict[str, dict[str, float]] = {}
    for labels, value in samples_of(text, REPLICAS):
        if "device" in labels and "state" in labels:
            out.setdefault(labels["device"], {})[labels["state"]] = value
    return out


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {pool: {kv_cache_usage_perc, num_requests_running, num_requests_waiting,
    num_preemptions_total, computed_tokens_total, admission_queue_depth, ...}} (the series of `SCRAPED`
    present; preemptions summed over modes, the credit queue over tenants)."""
    pools: dict[str, dict[str, float]] = {}
    for pool, samples in pool_samples(text).items():
        values = {key: samples[name] for name, key in SCRAPED.items() if name in samples}
        if values:
            pools[pool] = values
    return pools


@dataclass(frozen=True)
class ScrapeSample:
    """One GET /metrics: when it started (s from the run's start), how long it took, what it said."""

    t_s: float
    scrape_s: float
    pools: dict[str, dict[str, float]]
    error: str | None = None
    computed: dict[str, dict[str, float]] = field(default_factory=dict)   # pool -> replica -> computed tokens
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)   # device -> state -> replicas


class Scraper:
    """Polls /metrics every `interval` s until `stop` is set; a 404 ends it with one warning (`skipped`)."""

    def __init__(self, session: Any, config: LoadConfig, start: float) -> None:
        self.session, self.url, self.start = session, config.scrape_url, start
        self.interval, self.headers = config.scrape_interval, config.headers()
        self.samples: list[ScrapeSample] = []
        self.skipped: str | None = None

    async def scrape_once(self) -> bool:
        """Scrape once and record it; False once the server has said there is no /metrics (404)."""
        import aiohttp

        began = time.perf_counter()
        t_s = began - self.start
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with self.session.get(self.url, headers=self.headers) as response:
                    text = await response.text(errors="replace")
            elapsed = time.perf_counter() - began
            if response.status == 404:
                self.skipped = f"{self.url} answered 404"
                log.warning("bench serve: %s; not scraping metrics", self.skipped)
                return False
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {error_message(text)}")
            self.samples.append(ScrapeSample(t_s, elapsed, parse_metrics(text), computed=replica_counters(text),
                                             replicas=replica_states(text)))
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            self.samples.append(ScrapeSample(t_s, time.perf_counter() - began, {}, error))
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape on a fixed schedule (a slow scrape delays only the next one) until `stop`, then once more."""
        next_at = time.perf_counter()
        while not stop.is_set():
            if not await self.scrape_once():
                return
            next_at = max(next_at + self.interval, time.perf_counter())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.perf_counter())
            except TimeoutError:
                pass
        await self.scrape_once()
