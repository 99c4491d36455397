"""Prometheus metrics of the gateway, one registry per app, every series labelled with its `pool`.

What a device worker reports, and the worker's own series, carry a `replica` label too ("0" for a
device that is not replicated): each replica has its own engine, blocks and counters. The request
histograms (TTFT, ITL, end-to-end) are the pool's, over all its replicas: the SLO is the pool's.

Names and meanings follow vLLM's (`vllm:num_requests_running` -> `cliffguard_num_requests_running`)
so existing dashboards translate; histogram buckets are vLLM's. Engine-side gauges and counters
(running, waiting, KV usage, preemptions) are refreshed at each scrape from the stats each device
worker last pushed with its step outputs (`cliffguard_stats_age_seconds` says how old they are), so a
scrape never waits for a model step; request-level histograms are observed by the gateway as
responses stream. Counters count every worker's work across restarts (the dead worker's last totals
once, the next worker's from 0 on top); a replica that is not ready reads 0 for what it runs while its
stats age keeps growing, and one the autoscaler parked exports no gauges (`update_replica`).
`cliffguard_death_spiral` is set by the gateway's detector (gateway.runtime.SpiralWatch) when a pool trips
or clears, not at the scrape.
"""

from __future__ import annotations

import contextlib
import time
from array import array
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

from engine.stats import EngineStats, PoolStats

if TYPE_CHECKING:
    from engine.client import AsyncEngineClient

# No `*_created` timestamp series (vLLM turns them off too): they double the exposition for nothing.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKENIZER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_P = "cliffguard_"
_POOL = ["pool"]
# request_success's finished_reason values: the engine's (stop, length, abort) and OpenAI's
FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls", "function_call", "content_filter"})
_PR = ["pool", "replica"]
_DEVICE = ["device", "replica"]


class PoolSeries(NamedTuple):
    """One pool's children of the request series that every request touches (`GatewayMetrics.pool_series`)."""

    prompt_tokens: Counter
    generation_tokens: Counter
    routed: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram


class HeldLatencies:
    """A request's latency observations and its choices' ends (`request_success`), held while it may yet run
    again (a worker died before its client saw anything: `LocalResponse.retryable`) and made once it cannot:
    the run a client waited for is observed, once, not the one lost with its worker. `observe` and `count`
    hold or make them; `release` makes what was held and what comes after at once. A non-streamed answer
    holds an inter-token gap per token of each choice until it ends: 8 bytes each, in one array a histogram
    (a tuple and a float each held 48.8 MiB for 8 choices of 32,000 tokens)."""

    def __init__(self) -> None:
        self.held: list[tuple[Callable[..., None], tuple]] | None = []   # None: released, later ones made at once
        self._values: dict[int, tuple[Histogram, array]] = {}           # id(histogram) -> (it, values held)

    def observe(self, histogram: Histogram, value: float) -> None:
        if self.held is None:
            histogram.observe(value)
            return
        entry = self._values.get(id(histogram))
        if entry is None:
            entry = self._values[id(histogram)] = (histogram, array("d"))
        entry[1].append(value)

    def count(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` (a counter's `inc`, `GatewayMetrics.finished`), now or at the release."""
        if self.held is None:
            fn(*args)
        else:
            self.held.append((fn, args))

    def release(self) -> None:
        for fn, args in self.held or ():
            fn(*args)
        for histogram, values in self._values.values():
            for value in values:
                histogram.observe(value)
        self.held, self._values = None, {}


class GatewayMetrics:
    """All series of one gateway. Not thread-safe beyond what prometheus_client guarantees."""

    # the format `render` writes (`generate_latest`); prometheus-client 0.26's CONTENT_TYPE_LATEST names 1.0.0
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_pool_state()
        self._add_pool_preemption()
        self._add_pool_work()
        self._add_request_series()
        self._add_device_series()
        self._add_overload_series()
        self._add_client_series()
        # Engine counters arrive as totals since their worker started: each series' worker and last total, to
        # add only the difference; and per (device, replica) the client whose stats the series follow.
        self._last: dict[tuple[str, tuple[str, ...]], tuple[Hashable, float]] = {}
        self._followed: dict[tuple[str, int], AsyncEngineClient] = {}
        self._parked: dict[tuple[str, int], AsyncEngineClient] = {}   # the last worker of a replica parked since

    def _gauge(self, name: str, documentation: str, labels: list[str]) -> Gauge:
        return Gauge(_P + name, documentation, labels, registry=self.registry)

    def _counter(self, name: str, documentation: str, labels: list[str]) -> Counter:
        return Counter(_P + name, documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(_P + name, documentation, labels, buckets=buckets, registry=self.registry)

    def _add_pool_state(self) -> None:
        """A pool's queues and blocks as its device worker last reported them."""
        self.running = self._gauge("num_requests_running", "Requests in the pool's running batch.", _PR)
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", _PR)
        self.swapped = self._gauge("num_requests_swapped", "Requests swapped out to CPU memory.", _PR)
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Fraction of the pool's KV blocks in use (0-1).", _PR)
        self.num_blocks = self._gauge("pool_num_blocks", "KV blocks the pool owns (as allocated).", _PR)
        self.max_num_seqs = self._gauge("pool_max_num_seqs", "The pool's max_num_seqs (capacity formula).", _PR)
        self.kv_bytes = self._gauge("pool_kv_cache_bytes", "KV cache bytes the pool owns.", _PR)
        self.replica_reserved = self._gauge("replica_reserved_credits", "KV credits that every gateway's running "
                                            "requests reserve on the replica, as the replica counts them (a replica "
                                            "served over the network; 0 for a local worker).", _PR)
        self.replica_held = self._gauge("replica_held_credits", "KV credits the gateways connected to the replica "
                                        "hold there, as it counts them: the sum over them of max(lease, reserved), "
                                        "never past the pool's blocks x block size.", _PR)

    def _add_pool_preemption(self) -> None:
        """A pool's preemptions and swap traffic."""
        self.preemptions = self._counter("num_preemptions", "Preemptions, by mode.", ["pool", "replica", "mode"])
        self.recomputed = self._counter("recomputed_tokens", "Tokens whose K/V a recompute preemption dropped.",
                                        _PR)
        self.swapped_out = self._counter("swapped_out_bytes", "K/V bytes copied to the CPU swap pool.", _PR)
        self.swapped_in = self._counter("swapped_in_bytes", "K/V bytes copied back from the CPU swap pool.", _PR)
        self.preempt_time = self._counter("preemption_seconds", "Time spent preempting and resuming (scheduling "
                                          "and swap copies).", _PR)
        self.cpu_swap_usage = self._gauge("cpu_swap_usage_perc", "Fraction of the pool's CPU swap blocks in use.",
                                          _PR)
        self.death_spiral = self._gauge("death_spiral", "1 while the pool is in a death spiral: preemptions "
                                        "sustained while its generated tokens/s stay flat or fall (pools.spiral).",
                                        _PR)

    def _add_pool_work(self) -> None:
        """A pool's aborts, prefix-cache lookups and computed tokens."""
        self.aborted = self._counter("num_aborted_requests", "Sequences aborted (client gone or cancelled).", _PR)
        self.prefix_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                            _PR)
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", _PR)
        self.state_loads = self._counter("prefix_cache_state_loads", "Admissions a model with state layers resumed "
                                         "from a cached prefix's kept state.", _PR)
        self.state_saves = self._counter("prefix_cache_state_saves", "Prefix states a model with state layers kept "
                                         "for its prefix cache.", _PR)
        self.computed_tokens = self._counter("computed_tokens", "Tokens whose K/V the pool's engine steps computed "
                                             "(prefill chunks, decodes, recomputation).", _PR)
        self.device_seconds = self._counter("pool_device_seconds", "The pool's part of its device's measured step "
                                            "time (each step divided among its pools by predicted cost).", _PR)

    def _add_request_series(self) -> None:
        """What the gateway observes itself as requests are routed and answered."""
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of routed requests.", _POOL)
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.", _POOL)
        self.routed = self._counter("routed_requests", "Requests routed to each pool.", _POOL)
        self.request_success = self._counter("request_success", "Finished requests, by finish reason (FINISH_REASONS, "
                                             "else other).", ["pool", "finished_reason"])
        self.errors = self._counter("request_errors", "Requests answered with an error, by HTTP status.", ["status"])
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", _POOL, TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between streamed tokens.", _POOL,
                                   ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency.", _POOL,
                                   REQUEST_LATENCY_BUCKETS)
        # milliseconds mostly: the request latencies' buckets, from 0.3 s, hid them
        self.queue_time = self._histogram("request_queue_time_seconds", "Time a request waited to be scheduled.",
                                          _POOL, TTFT_BUCKETS)
        self.tokenizer_time = self._histogram("tokenizer_seconds", "Time to render and count a prompt.",
                                              ["backend"], TOKENIZER_BUCKETS)
        self._pool_series: dict[str, PoolSeries] = {}
        self._tokenizer_children: dict[str, Histogram] = {}

    def pool_series(self, pool: str) -> PoolSeries:
        """The pool's request series, labelled once (a `labels()` lookup costs microseconds per request)."""
        series = self._pool_series.get(pool)
        if series is None:
            series = self._pool_series[pool] = PoolSeries(
                *(getattr(self, name).labels(pool=pool) for name in PoolSeries._fields))
        return series

    def tokenizer_seconds(self, backend: str) -> Histogram:
        """The `tokenizer_seconds` child of a counting backend, labelled once."""
        child = self._tokenizer_children.get(backend)
        if child is None:
            child = self._tokenizer_children[backend] = self.tokenizer_time.labels(backend=backend)
        return child

    def _add_device_series(self) -> None:
        """A device worker's step composer, and its restarts."""
        self.stats_age = self._gauge("stats_age_seconds", "Age of the engine stats behind this scrape.", _DEVICE)
        self.steps = self._counter("engine_steps", "Engine steps run (merged forward passes).", _DEVICE)
        self.targeted_steps = self._counter("engine_targeted_steps", "Steps with a latency target (an interactive "
                                            "pool on the device).", _DEVICE)
        self.steps_over_target = self._counter("engine_steps_over_target", "Targeted steps that took longer than "
                                               "their target.", _DEVICE)
        self.busy_seconds = self._counter("engine_busy_seconds", "Measured step time (after the device finished): "
                                          "the time the device computed.", _DEVICE)
        self.step_target = self._gauge("engine_step_target_seconds", "The step composer's latency target for the "
                                       "last step (0: none).", _DEVICE)
        self.pressed_steps = self._counter("engine_pressed_steps", "Steps composed with throughput pools at their "
                                           "floor: an interactive pool had requests waiting or a prefill due.",
                                           _DEVICE)
        self.target_scale = self._gauge("engine_target_scale", "An interactive pool's step-target scale (1: its "
                                        "itl_ms; lower while its measured p99 TTFT or ITL is over its aim).",
                                        _PR)
        self.worker_restarts = self._counter("worker_restarts", "Device worker processes started again after "
                                             "the worker died.", _DEVICE)
        self.worker_stalls = self._counter("worker_stalls", "Device workers killed by the watchdog: no word from "
                                           "the worker, not even its heartbeat, for gateway.stall_seconds.", _DEVICE)
        self.worker_step_timeouts = self._counter("worker_step_timeouts", "Device workers killed by the watchdog: "
                                                  "still beating, but one step ran over "
                                                  "gateway.step_timeout_seconds.", _DEVICE)
        self.replicas = self._gauge("replicas", "Replicas of the device by state: ready, loading, draining, "
                                    "restarting, failed, stopped (an autoscaled device's parked slots).",
                                    ["device", "state"])
        self.replica_scalings = self._counter("replica_scalings", "Replicas the autoscaler added (up) or removed "
                                              "(down).", ["device", "direction"])
        self.client_write_timeouts = self._counter("client_write_timeouts", "Responses aborted because their "
                                                   "client read nothing for gateway.write_timeout.", ["pool"])

    def _add_overload_series(self) -> None:
        """Each device's offered load against what it can serve (gateway.monitoring.overload)."""
        self.device_overloaded = self._gauge("device_overloaded", "1 while the device is offered more than it can "
                                             "serve within its pools' targets (gateway.monitoring.overload), else 0.", ["device"])
        self.device_offered_load = self._gauge("device_offered_load", "Offered load over capacity: the fraction of "
                                               "the device's ready replicas' time its pools' arrivals ask for.",
                                               ["device"])
        self.device_replicas_needed = self._gauge("device_replicas_needed", "Replicas that would serve the offered "
                                                  "load at most 90% busy.", ["device"])
        self.device_busy = self._gauge("device_busy_ratio", "The worker's measured step time over wall time.",
                                       _DEVICE)
        self.pool_offered = self._gauge("pool_offered_tokens_per_second", "Tokens per second the pool's arrivals "
                                        "ask for (prompt: prefill; output estimate: decode).", ["pool", "phase"])
        self.pool_capacity = self._gauge("pool_capacity_tokens_per_second", "Tokens per second the pool's ready "
                                         "replicas can do for it alone, from the step-cost model.", ["pool", "phase"])
        self.pool_slo = self._gauge("pool_slo_seconds", "An interactive pool's latency targets as its engine runs "
                                    "them (target: ttft, itl; isolation by default: derived from the measured "
                                    "step at start).", ["pool", "target"])
        self.pool_oldest_wait = self._gauge("pool_oldest_waiting_seconds", "Age of the pool's oldest request still "
                                            "without its first token.", _POOL)

    def _add_client_series(self) -> None:
        """What the gateway holds for clients slower than their answers (gateway.client_writes.ResponseBuffers)."""
        self.buffered_response_bytes = self._gauge("buffered_response_bytes", "Bytes of responses the gateway "
                                                   "holds unsent: queued stream chunks and JSON bodies being "
                                                   "written.", [])
        self.paused_responses = self._counter("paused_responses", "Times a stream paused its engine requests: "
                                              "its client read slower than they were generated "
                                              "(gateway.max_response_buffer_bytes, gateway.max_buffered_bytes).",
                                              _POOL)

    def _advance(self, counter: Counter, series: str, total: float, worker: Hashable, **labels: str) -> None:
        """Add what `total` grew by since the series' last total from the same worker process (`worker`,
        see `worker_identity`; None: not known, then a total that fell is taken for a restarted worker's):
        all of another worker's total is new. The series is exported from the first call on, zeros included."""
        key = (series, tuple(labels.values()))
        last_worker, last = self._last.get(key, (worker, 0.0))
        child = counter.labels(**labels)
        if worker != last_worker or total < last:    # a restarted device worker counts from 0 again
            last = 0.0
        if total > last:
            child.inc(total - last)
        self._last[key] = (worker, total)

    def update_pool(self, name: str, replica: int, stats: PoolStats, block_bytes: int,
                    worker: Hashable | None = None, held: bool = True) -> None:
        """Refresh one local pool on one replica from its worker's stats (see engine.worker.engine_stats);
        `worker`: the identity of the worker process that counted them (`_advance`); `held` False: not what
        it runs and holds (`_held_gauges`: a worker not running, whose gauges read 0, `update_replica`)."""
        labels = {"pool": name, "replica": str(replica)}
        if held:
            self.running.labels(**labels).set(stats.num_running)
            self.waiting.labels(**labels).set(stats.num_waiting)
            self.swapped.labels(**labels).set(stats.num_swapped)
            self.kv_usage.labels(**labels).set(stats.kv_cache_usage)
            self.replica_reserved.labels(**labels).set(stats.reserved_credits)
            self.replica_held.labels(**labels).set(stats.held_credits)
            self.cpu_swap_usage.labels(**labels).set(stats.cpu_swap_usage)
        self.num_blocks.labels(**labels).set(stats.num_blocks)
        self.max_num_seqs.labels(**labels).set(stats.max_num_seqs)
        self.kv_bytes.labels(**labels).set(stats.num_blocks * block_bytes)
        for mode, total in stats.num_preemptions_by_mode.items():
            self._advance(self.preemptions, "preemptions", total, worker, **labels, mode=mode)
        self._advance(self.recomputed, "recomputed_tokens", stats.num_recomputed_tokens, worker, **labels)
        self._advance(self.aborted, "aborted", stats.num_aborted, worker, **labels)
        self._advance(self.swapped_out, "swapped_out_bytes", stats.swapped_out_bytes, worker, **labels)
        self._advance(self.swapped_in, "swapped_in_bytes", stats.swapped_in_bytes, worker, **labels)
        self._advance(self.preempt_time, "preempt_seconds", stats.preempt_seconds, worker, **labels)
        self._advance(self.prefix_queries, "prefix_queries", stats.num_prefix_queries, worker, **labels)
        self._advance(self.prefix_hits, "prefix_hits", stats.num_prefix_hits, worker, **labels)
        self._advance(self.state_loads, "state_loads", stats.num_state_loads, worker, **labels)
        self._advance(self.state_saves, "state_saves", stats.num_state_saves, worker, **labels)
        self._advance(self.computed_tokens, "computed_tokens", stats.num_computed_tokens, worker, **labels)
        self._advance(self.device_seconds, "device_seconds", stats.device_seconds, worker, **labels)

    def finished(self, pool: str, reason: str) -> None:
        """One choice ended `reason` (an upstream's, which may be any string: one outside FINISH_REASONS
        counts as "other", so that no answer adds series of its own)."""
        self.request_success.labels(pool=pool, finished_reason=reason if reason in FINISH_REASONS else "other").inc()

    def update_device(self, device: str, replica: int, stats: EngineStats,
                      worker: Hashable | None = None, held: bool = True, received: float = 0.0) -> None:
        """Refresh the device-level series from the stats one replica's worker pushed last (`worker`, `held`:
        as for `update_pool`; the step target is held). Their age runs from `received`, when they reached
        this gateway by its clock (a remote replica's clock may be off by any amount), else from the worker's
        `taken_at` (a worker of this machine)."""
        labels = {"device": device, "replica": str(replica)}
        self.stats_age.labels(**labels).set(max(0.0, time.time() - (received or stats.taken_at)))
        step = stats.step
        self._advance(self.steps, "steps", step.num_steps, worker, **labels)
        self._advance(self.busy_seconds, "busy_seconds", step.busy_seconds, worker, **labels)
        self._advance(self.targeted_steps, "targeted_steps", step.num_targeted_steps, worker, **labels)
        self._advance(self.steps_over_target, "steps_over_target", step.num_over_target, worker, **labels)
        if held:
            self.step_target.labels(**labels).set(step.last_target_seconds or 0.0)
        self._advance(self.pressed_steps, "pressed_steps", step.num_pressed_steps, worker, **labels)
        for pool, scale in step.target_scales.items():   # not running: 1, where a new worker starts (`_zero_state`)
            self.target_scale.labels(pool=pool, replica=str(replica)).set(scale if held else 1.0)

    def update_replica(self, device: str, replica: int, client: AsyncEngineClient | None, ready: bool,
                       parked: bool = False) -> None:
        """Refresh one replica's series from the stats its worker pushed last (`handlers.refresh_metrics`;
        `client`: its supervisor's, `ready`: whether the supervisor says the replica is ready).

        Counters count every step's work across restarts. The series follow one client at a time (one
        worker process each: a restart is a new client, `DeviceSupervisor._new_client`) and switch to the
        supervisor's client once it has pushed stats; the client followed until then is counted once
        more first, with its final stats: what the dead worker counted between the last scrape and its
        death is kept, and the new worker's totals are all new however far they got before the scrape.
        A new client of the same process (a remote replica reached again, `worker_identity`) goes on
        from where the old one left off. What a worker counted after its last push is never known.

        Gauges: a replica not ready (its worker dead, restarting, loading again, stopped or parked by the
        autoscaler), or ready but its new worker not heard from yet, runs and holds nothing as far as this gateway
        can tell: its running, waiting, swapped, KV and CPU swap usage, credits and step target read 0. They are set
        to 0 rather than removed, as series here are exported from the start on: each stays continuous (no gap or
        staleness for Prometheus) and the replica stays listed on the dashboard and in sums over replicas, showing
        that it runs nothing. The pool's allocation (blocks, max_num_seqs, KV bytes) keeps the last worker's, which
        a restarted one allocates again. `stats_age_seconds` keeps growing from the last stats the replica pushed,
        so an alert on it fires while a worker is down; a replica that never pushed stats to this gateway (loading
        for the first time, failed to start, never started) exports none of these series: no stats are old, and
        `cliffguard_replicas{state}` says why. So does a replica `parked` by the autoscaler (stopped until the
        load asks for it again: at rest, not down): its gauges are removed, its worker's last counts kept in the
        counters, so that neither the pool's means (KV usage) nor the device's oldest stats count it."""
        followed = self._follow(device, replica, client)
        if followed is None:
            return
        live = ready and followed is client and not parked
        # a scrape rendering meanwhile (on its thread) never reads the last load of a worker not running
        self._update_from(device, replica, followed, held=live)
        if parked:   # its last counts are in; it is followed again only through a new worker's stats
            self._remove_state(device, replica, followed.latest_stats)
            self._parked[(device, replica)] = self._followed.pop((device, replica))
        elif not live:
            self._zero_state(device, replica, followed.latest_stats)

    def _follow(self, device: str, replica: int, client: AsyncEngineClient | None) -> AsyncEngineClient | None:
        """The client whose stats the replica's series follow now (`update_replica`); None before any
        pushed stats. Switching, the client followed until now is counted once more, with its final stats."""
        key = (device, replica)
        followed = self._followed.get(key)
        if client is None or client is followed or client.latest_stats is None or client.info is None \
                or client is self._parked.get(key):
            return followed
        if followed is not None:   # its final counts; its gauges are the new client's next
            self._update_from(device, replica, followed, held=False)
        self._followed[key] = client
        self._parked.pop(key, None)
        return client

    def _update_from(self, device: str, replica: int, client: AsyncEngineClient, held: bool) -> None:
        """Refresh the replica's pools and device series from the stats `client` holds (`held`: `update_pool`)."""
        stats, worker = client.latest_stats, worker_identity(client)
        for name, pool_stats in stats.pools.items():
            self.update_pool(name, replica, pool_stats, client.info.block_bytes, worker, held)
        self.update_device(device, replica, stats, worker, held, client.stats_received)

    def _held_gauges(self) -> tuple[Gauge, ...]:
        """A replica's per-pool gauges of what it runs and holds (0 while its worker is not running)."""
        return (self.running, self.waiting, self.swapped, self.kv_usage, self.cpu_swap_usage, self.replica_reserved,
                self.replica_held)

    def _remove_state(self, device: str, replica: int, stats: EngineStats) -> None:
        """A parked replica's gauges go (`update_replica`); its counters stay. Only series it has are removed (a
        throughput pool has no target scale; prometheus-client before 0.22 raises for a missing one)."""
        series = [((name, str(replica)), (*self._held_gauges(), self.num_blocks, self.max_num_seqs, self.kv_bytes,
                                          self.target_scale)) for name in stats.pools]
        for labels, gauges in [*series, ((device, str(replica)), (self.stats_age, self.step_target))]:
            for gauge in gauges:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)

    def _zero_state(self, device: str, replica: int, stats: EngineStats) -> None:
        """What a replica whose worker is not running runs and holds: nothing (`update_replica`)."""
        for name in stats.pools:
            for gauge in self._held_gauges():
                gauge.labels(pool=name, replica=str(replica)).set(0)
        self.step_target.labels(device=device, replica=str(replica)).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def worker_identity(client: AsyncEngineClient) -> Hashable:
    """The worker process a loaded client talks to: its address (a remote replica's; None for a local
    worker), pid and load time, as `DeviceSupervisor._ready` tells a new process from one reached again."""
    return getattr(client, "address", None), client.info.pid, client.info.load_seconds
