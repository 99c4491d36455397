"""Prometheus metrics of the gateway, one registry per app, every series labelled with its `pool`.

Names and meanings follow vLLM's (`vllm:num_requests_running` -> `cliffguard_num_requests_running`)
so existing dashboards translate; histogram buckets are vLLM's. Engine-side gauges and counters
(running, waiting, KV usage, preemptions) are refreshed at each scrape from the stats each device
worker last pushed with its step outputs (`cliffguard_stats_age_seconds` says how old they are), so a
scrape never waits for a model step; request-level histograms are observed by the gateway as
responses stream.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# No `*_created` timestamp series (vLLM turns them off too): they double the exposition for nothing.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKENIZER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PREEMPTION_MODES = ("recompute", "swap")


class GatewayMetrics:
    """All series of one gateway. Not thread-safe beyond what prometheus_client guarantees."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "cliffguard_"
        pool = ["pool"]
        self.running = Gauge(p + "num_requests_running", "Requests in the pool's running batch.", pool, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", pool, registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Requests swapped out to CPU memory.", pool, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of the pool's KV blocks in use (0-1).",
                              pool, registry=r)
        self.num_blocks = Gauge(p + "pool_num_blocks", "KV blocks the pool owns (as allocated).", pool, registry=r)
        self.max_num_seqs = Gauge(p + "pool_max_num_seqs", "The pool's max_num_seqs (capacity formula).",
                                  pool, registry=r)
        self.kv_bytes = Gauge(p + "pool_kv_cache_bytes", "KV cache bytes the pool owns.", pool, registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions, by mode.", ["pool", "mode"], registry=r)
        self.recomputed = Counter(p + "recomputed_tokens", "Tokens whose K/V a recompute preemption dropped.",
                                  pool, registry=r)
        self.swapped_out = Counter(p + "swapped_out_bytes", "K/V bytes copied to the CPU swap pool.", pool,
                                   registry=r)
        self.swapped_in = Counter(p + "swapped_in_bytes", "K/V bytes copied back from the CPU swap pool.", pool,
                                  registry=r)
        self.preempt_time = Counter(p + "preemption_seconds", "Time spent preempting and resuming (scheduling "
                                    "and swap copies).", pool, registry=r)
        self.cpu_swap_usage = Gauge(p + "cpu_swap_usage_perc", "Fraction of the pool's CPU swap blocks in use.",
                                    pool, registry=r)
        self.aborted = Counter(p + "num_aborted_requests", "Sequences aborted (client gone or cancelled).",
                               pool, registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      pool, registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   pool, registry=r)
        self.computed_tokens = Counter(p + "computed_tokens", "Tokens whose K/V the pool's engine steps computed "
                                       "(prefill chunks, decodes, recomputation).", pool, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of routed requests.", pool, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", pool, registry=r)
        self.routed = Counter(p + "routed_requests", "Requests routed to each pool.", pool, registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests, by finish reason.",
                                       ["pool", "finished_reason"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.", pool,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between streamed tokens.", pool,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.", pool,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time a request waited to be scheduled.",
                                    pool, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.tokenizer_time = Histogram(p + "tokenizer_seconds", "Time to render and count a prompt.",
                                        ["backend"], buckets=TOKENIZER_BUCKETS, registry=r)
        device = ["device"]
        self.stats_age = Gauge(p + "stats_age_seconds", "Age of the engine stats behind this scrape.", device,
                               registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps run (merged forward passes).", device, registry=r)
        self.targeted_steps = Counter(p + "engine_targeted_steps", "Steps with a latency target (an interactive "
                                      "pool on the device).", device, registry=r)
        self.steps_over_target = Counter(p + "engine_steps_over_target", "Targeted steps that took longer than "
                                         "their target.", device, registry=r)
        self.step_target = Gauge(p + "engine_step_target_seconds", "The step composer's latency target for the "
                                 "last step (0: none).", device, registry=r)
        # Engine counters arrive as totals; remember the last total to add only the difference.
        self._last: dict[tuple[str, str], float] = {}

    def _advance(self, counter: Counter, key: tuple[str, str], total: float, **labels: str) -> None:
        last = self._last.get(key, 0.0)
        child = counter.labels(**labels)  # exported from the first scrape on, zeros included
        if total > last:
            child.inc(total - last)
        self._last[key] = max(last, total)

    def update_pool(self, name: str, stats: dict[str, Any], block_bytes: int) -> None:
        """Refresh one local pool from the device worker's stats (see engine.worker.engine_stats)."""
        self.running.labels(pool=name).set(stats["num_running"])
        self.waiting.labels(pool=name).set(stats["num_waiting"])
        self.swapped.labels(pool=name).set(stats.get("num_swapped", 0))
        self.kv_usage.labels(pool=name).set(stats["kv_cache_usage"])
        self.num_blocks.labels(pool=name).set(stats["num_blocks"])
        self.max_num_seqs.labels(pool=name).set(stats["max_num_seqs"])
        self.kv_bytes.labels(pool=name).set(stats["num_blocks"] * block_bytes)
        by_mode = stats.get("num_preemptions_by_mode", {"recompute": stats["num_preemptions"]})
        for mode in PREEMPTION_MODES:
            self.preemptions.labels(pool=name, mode=mode)  # export zeros too
            self._advance(self.preemptions, (name, "preempt:" + mode), by_mode.get(mode, 0), pool=name, mode=mode)
        self._advance(self.recomputed, (name, "recomputed"), stats["num_recomputed_tokens"], pool=name)
        self._advance(self.aborted, (name, "aborted"), stats.get("num_aborted", 0), pool=name)
        self._advance(self.swapped_out, (name, "so"), stats.get("swapped_out_bytes", 0), pool=name)
        self._advance(self.swapped_in, (name, "si"), stats.get("swapped_in_bytes", 0), pool=name)
        self._advance(self.preempt_time, (name, "pt"), stats.get("preempt_seconds", 0.0), pool=name)
        self.cpu_swap_usage.labels(pool=name).set(stats.get("cpu_swap_usage", 0.0))
        self.prefix_queries.labels(pool=name)
        self.prefix_hits.labels(pool=name)
        self._advance(self.prefix_queries, (name, "pq"), stats.get("prefix_cache_queries", 0), pool=name)
        self._advance(self.prefix_hits, (name, "ph"), stats.get("prefix_cache_hits", 0), pool=name)
        self._advance(self.computed_tokens, (name, "computed"), stats.get("num_computed_tokens", 0), pool=name)

    def update_device(self, device: str, stats: dict[str, Any]) -> None:
        """Refresh the device-level series from the stats a device worker pushed last."""
        self.stats_age.labels(device=device).set(max(0.0, time.time() - stats["taken_at"]))
        step = stats["step"]
        self._advance(self.steps, (device, "steps"), step["num_steps"], device=device)
        self._advance(self.targeted_steps, (device, "targeted"), step["num_targeted_steps"], device=device)
        self._advance(self.steps_over_target, (device, "over"), step["num_over_target"], device=device)
        self.step_target.labels(device=device).set(step["last_target_seconds"] or 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
