"""`/metrics` across a device worker's death and restart, at the level of the scrape's refresh
(`handlers.refresh_metrics`) with fake supervisors and clients, so each scenario runs in milliseconds:

- while a replica is not ready its stats age keeps growing and what it runs (running, waiting, swapped,
  KV usage, step target, busy ratio) reads 0, and the dashboard says the same; a replica that never
  pushed stats exports none;
- engine counters count every step's work across a restart: the dead worker's last report is counted
  once, whether or not a scrape saw it before the worker died, and the new worker's totals on top of it,
  however far it got before the next scrape; a client reconnected to the same process goes on from where
  the old one left off.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats, PoolStats, StepCounters, WorkerInfo
from gateway import handlers
from gateway.admission import AdmissionMetrics
from gateway.monitoring import dashboard, metrics as metrics_module, overload as overload_module
from gateway.monitoring.metrics import GatewayMetrics
from gateway.monitoring.overload import OverloadWatch

DEVICE, POOL = "cpu", "chat"
STATE_GAUGES = ("cliffguard_num_requests_running", "cliffguard_num_requests_waiting",
                "cliffguard_num_requests_swapped", "cliffguard_kv_cache_usage_perc")
COUNTERS = ("cliffguard_computed_tokens_total", "cliffguard_num_preemptions_total", "cliffguard_engine_steps_total")


class _Client:
    """What the scrape reads of an `AsyncEngineClient`: `info` once loaded, `latest_stats` once pushed."""

    def __init__(self, pid: int, address: tuple[str, int] | None = None) -> None:
        self.pid, self.info, self.latest_stats = pid, None, None
        self.stats_received = 0.0   # unknown: ages run from the stats' own `taken_at`
        if address is not None:
            self.address = address

    def load(self, load_seconds: float = 1.0) -> _Client:
        self.info = WorkerInfo(model_path="m", device=DEVICE, dtype="float32", num_blocks=8, block_size=16,
                               kv_bytes_per_token=64, pools={}, load_seconds=load_seconds, pid=self.pid)
        return self


class _Supervisor:
    """A `DeviceSupervisor` as the scrape sees it: its client, whether its replica is ready, and whether it
    is started at all (the autoscaler parks the rest)."""

    def __init__(self) -> None:
        self.client: _Client | None = None
        self.is_ready = False
        self.is_active = True

    @property
    def state(self) -> str:
        return "stopped" if not self.is_active else "ready" if self.is_ready else "loading"

    @property
    def info(self) -> WorkerInfo | None:
        return self.client.info if self.is_ready else None


def _make_stats(taken_at: float, computed: int = 0, running: int = 0, steps: int = 0,
                preemptions: int = 0, busy: float = 0.0, scale: float | None = None) -> EngineStats:
    pool = PoolStats(num_running=running, num_waiting=running, num_swapped=running, num_blocks=8,
                     num_free_blocks=8 - running, num_cached_free_blocks=0, kv_cache_usage=0.001 * running,
                     max_num_seqs=4, cpu_swap_usage=0.0, num_recompute_preemptions=preemptions,
                     num_computed_tokens=computed)
    step = StepCounters(num_steps=steps, last_target_seconds=0.05 if running else None, busy_seconds=busy,
                        target_scales={} if scale is None else {POOL: scale})
    return EngineStats(num_requests=running, pools={POOL: pool}, step=step, taken_at=taken_at)


def _make_gateway(replicas: int = 1) -> SimpleNamespace:
    """What `refresh_metrics` reads of a `Gateway`."""
    return SimpleNamespace(autoscaler=None, supervisors={DEVICE: [_Supervisor() for _ in range(replicas)]},
                           metrics=GatewayMetrics(),
                           admission=SimpleNamespace(metrics=SimpleNamespace(refresh=lambda pools, parked: None), pools={}))


def _scrape(gateway) -> dict[str, dict[tuple, float]]:
    """Refresh and render as `/metrics` does, parsed by prometheus_client's parser: name -> labels -> value."""
    handlers.refresh_metrics(gateway)
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(gateway.metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _pool(m: dict, name: str, replica: int = 0) -> float | None:
    return m.get(name, {}).get((("pool", POOL), ("replica", str(replica))))


def _device(m: dict, name: str, replica: int = 0) -> float | None:
    return m.get(name, {}).get((("device", DEVICE), ("replica", str(replica))))


def _total(m: dict, name: str) -> float:
    """A counter's sample summed over its labels (preemption modes)."""
    return sum(m.get(name, {}).values())


def _assert_counters_never_fell(scrapes: list[dict]) -> None:
    for name in COUNTERS:
        totals = [_total(m, name) for m in scrapes]
        assert totals == sorted(totals), (name, totals)


def test_a_replica_not_ready_ages_its_stats_and_runs_nothing(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda: clock[0]))
    gateway = _make_gateway(replicas=2)
    sup, never = gateway.supervisors[DEVICE]
    sup.client, sup.is_ready = _Client(pid=11).load(), True
    sup.client.latest_stats = _make_stats(taken_at=999.9, computed=40, running=1, steps=5, scale=0.4)
    never.client = _Client(pid=12)        # replica 1 loads for ever: never pushed stats

    m = _scrape(gateway)
    assert _pool(m, "cliffguard_num_requests_running") == 1 and _pool(m, "cliffguard_kv_cache_usage_perc") == 0.001
    assert _pool(m, "cliffguard_engine_target_scale") == 0.4
    assert math.isclose(_device(m, "cliffguard_stats_age_seconds"), 0.1)
    assert _device(m, "cliffguard_engine_step_target_seconds") == 0.05

    sup.is_ready = False                 # SIGKILL: the dead client keeps its last stats
    clock[0] = 1020.0
    dead = _scrape(gateway)
    for name in STATE_GAUGES:
        assert _pool(dead, name) == 0, name
    assert _device(dead, "cliffguard_engine_step_target_seconds") == 0
    assert _pool(dead, "cliffguard_engine_target_scale") == 1   # where a new worker starts (it kept the dead one's)
    assert math.isclose(_device(dead, "cliffguard_stats_age_seconds"), 20.1)
    assert _pool(dead, "cliffguard_pool_num_blocks") == 8          # the pool's allocation stays
    assert _device(dead, "cliffguard_stats_age_seconds", replica=1) is None   # no stats: no age
    assert _pool(dead, "cliffguard_num_requests_running", replica=1) is None

    families = text_string_to_metric_families(gateway.metrics.render().decode())
    shown = dashboard.parse_snapshot(families, (POOL,), now=0.0, wall=clock[0])
    assert shown.values[POOL]["num_requests_running"] == 0 and shown.values[POOL]["kv_cache_usage_perc"] == 0
    assert shown.stats_age == {DEVICE: _device(dead, "cliffguard_stats_age_seconds")}

    sup.client = _Client(pid=13)         # the restart: a new client, loading, no stats yet
    clock[0] = 1030.0
    loading = _scrape(gateway)
    assert math.isclose(_device(loading, "cliffguard_stats_age_seconds"), 30.1)
    assert all(_pool(loading, name) == 0 for name in STATE_GAUGES)

    sup.client.load().latest_stats = _make_stats(taken_at=1030.0, running=2, steps=1)
    sup.is_ready = True
    back = _scrape(gateway)
    assert _pool(back, "cliffguard_num_requests_running") == 2 and _device(back, "cliffguard_stats_age_seconds") == 0
    _assert_counters_never_fell([m, dead, loading, back])


def test_a_remote_replicas_stats_age_on_this_gateways_clock(monkeypatch):
    """A Ray replica's machine may keep another time: stats stamped a minute behind (or ahead) by its clock
    are as old as the time since they reached this gateway, so a live replica reads fresh and a dead one's
    age grows from its last push (a clock ahead hid an outage that long; one behind fired the alert for ever)."""
    clock = [5000.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda: clock[0]))
    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    sup.client, sup.is_ready = _Client(pid=21, address=("127.0.0.1", 7000)).load(), True
    for skew in (-60.0, 60.0):
        sup.client.latest_stats = _make_stats(taken_at=clock[0] + skew, running=1, steps=1)
        sup.client.stats_received = clock[0] - 0.2
        assert math.isclose(_device(_scrape(gateway), "cliffguard_stats_age_seconds"), 0.2)
    clock[0] += 30.0    # no push since: the worker is gone
    assert math.isclose(_device(_scrape(gateway), "cliffguard_stats_age_seconds"), 30.2)


def test_a_parked_replica_exports_no_gauges_and_keeps_its_counts(monkeypatch):
    """The autoscaler parks replica 1 after it served: at rest, not down. Its gauges go, so the pool's mean
    KV usage is the serving replica's and the device's oldest stats are that replica's (a parked one read 0
    usage and ever older stats, which kept the KV bar green and an age alert firing); its counts stay in the
    counters; started again, its series come back."""
    clock = [1000.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda: clock[0]))
    gateway = _make_gateway(replicas=2)
    ledger = SimpleNamespace(accounts=[SimpleNamespace(total=1000, free=600), SimpleNamespace(total=1000, free=900)],
                             queued_by_tenant=dict, num_background_queued=0)
    credits = SimpleNamespace(name=POOL, device=DEVICE, admission=SimpleNamespace(ledger=ledger, replica_up=bool))
    gateway.admission = SimpleNamespace(metrics=AdmissionMetrics(gateway.metrics.registry), pools={POOL: credits})
    live, parked = gateway.supervisors[DEVICE]
    for sup, pid in ((live, 21), (parked, 22)):
        sup.client, sup.is_ready = _Client(pid=pid).load(), True
        sup.client.latest_stats = _make_stats(taken_at=999.9, computed=40, running=4, steps=5)
    before = _scrape(gateway)
    parked.is_ready, parked.is_active = False, False
    clock[0] = 1600.0
    live.client.latest_stats = _make_stats(taken_at=1599.9, computed=80, running=4, steps=9)
    at_rest = _scrape(gateway)
    assert _pool(before, "cliffguard_kv_credits", replica=1) == 1000
    for name in (*STATE_GAUGES, "cliffguard_pool_num_blocks", "cliffguard_kv_credits", "cliffguard_kv_credits_free"):
        assert _pool(at_rest, name, replica=1) is None and _pool(at_rest, name) is not None, name
    assert _device(at_rest, "cliffguard_stats_age_seconds", replica=1) is None
    assert _total(at_rest, "cliffguard_computed_tokens_total") == 40 + 80
    _assert_counters_never_fell([before, at_rest])
    families = text_string_to_metric_families(gateway.metrics.render().decode())
    shown = dashboard.parse_snapshot(families, (POOL,), now=0.0, wall=clock[0])
    assert shown.values[POOL]["kv_cache_usage_perc"] == 0.004 and math.isclose(shown.stats_age[DEVICE], 0.1)

    clock[0] = 5200.0
    parked.is_active = True   # the load asks for it again: it loads, its old worker's stats an hour old
    loading = _scrape(gateway)
    assert _device(loading, "cliffguard_stats_age_seconds", replica=1) is None
    assert _pool(loading, "cliffguard_kv_cache_usage_perc", replica=1) is None
    parked.client = _Client(pid=23).load()
    parked.client.latest_stats, parked.is_ready = _make_stats(taken_at=5200.0, running=1, steps=1), True
    back = _scrape(gateway)
    assert _pool(back, "cliffguard_num_requests_running", replica=1) == 1
    assert _pool(back, "cliffguard_kv_credits", replica=1) == 1000 and _pool(back, "cliffguard_kv_credits_free", 1) == 900
    _assert_counters_never_fell([before, at_rest, loading, back])


def test_the_busy_ratio_of_a_replica_not_ready_reads_0(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(overload_module, "time", SimpleNamespace(time=lambda: clock[0]))
    metrics = GatewayMetrics()
    watch = OverloadWatch({}, {}, metrics)
    watch.pools[DEVICE] = []             # a device without pools to judge: only its replicas' busy ratio
    sup = _Supervisor()
    watch.supervisors = {DEVICE: [sup]}
    ratio = metrics.device_busy.labels(device=DEVICE, replica="0")._value

    sup.client, sup.is_ready = _Client(pid=21).load(), True
    for clock[0], busy in ((100.0, 10.0), (101.0, 10.5)):
        sup.client.latest_stats = _make_stats(taken_at=clock[0], busy=busy)
        watch.device_load(DEVICE, clock[0])
    assert ratio.get() == 0.5
    sup.is_ready, clock[0] = False, 110.0
    watch.device_load(DEVICE, clock[0])
    assert ratio.get() == 0             # not the 0.5 it had when it died
    sup.client, sup.is_ready = _Client(pid=22).load(), True
    for clock[0], busy in ((130.0, 0.2), (131.0, 0.9)):   # the new worker counts from 0: measured from its first
        sup.client.latest_stats = _make_stats(taken_at=clock[0], busy=busy)
        watch.device_load(DEVICE, clock[0])
    assert math.isclose(ratio.get(), 0.7)
    for clock[0], taken_at, busy in ((132.0, 131.75, 1.65), (133.0, 132.5, 2.4)):   # a fully busy worker whose
        sup.client.latest_stats = _make_stats(taken_at=taken_at, busy=busy)      # stats lag the checks
        watch.device_load(DEVICE, clock[0])
    assert math.isclose(ratio.get(), 1.0)   # its 0.75 s of steps over the 0.75 s between its stats


def test_counters_keep_what_the_dead_worker_counted_after_the_last_scrape():
    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    old = sup.client = _Client(pid=31).load()
    sup.is_ready = True
    old.latest_stats = _make_stats(taken_at=1.0, computed=100, steps=10, preemptions=2)
    scrapes = [_scrape(gateway)]
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 100

    old.latest_stats = _make_stats(taken_at=2.0, computed=130, steps=13, preemptions=3)   # pushed, not scraped
    sup.is_ready = False                                                                  # then killed
    new = sup.client = _Client(pid=32).load()                                             # restarted ...
    new.latest_stats = _make_stats(taken_at=9.0, computed=150, steps=15, preemptions=4)   # ... past the old total
    sup.is_ready = True
    scrapes.append(_scrape(gateway))
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 130 + 150
    assert _total(scrapes[-1], "cliffguard_engine_steps_total") == 13 + 15
    assert _total(scrapes[-1], "cliffguard_num_preemptions_total") == 3 + 4

    new.latest_stats = _make_stats(taken_at=10.0, computed=160, steps=16, preemptions=4)
    scrapes.append(_scrape(gateway))
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 130 + 160
    _assert_counters_never_fell(scrapes)


def test_counters_count_a_dead_worker_once_when_a_scrape_saw_its_outage():
    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    old = sup.client = _Client(pid=41).load()
    sup.is_ready = True
    old.latest_stats = _make_stats(taken_at=1.0, computed=100, steps=10)
    scrapes = [_scrape(gateway)]
    old.latest_stats = _make_stats(taken_at=2.0, computed=130, steps=13)
    sup.is_ready = False
    scrapes.append(_scrape(gateway))    # the outage, the dead client still the supervisor's
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 130
    sup.client = _Client(pid=42)
    scrapes += [_scrape(gateway), _scrape(gateway)]   # loading: the dead worker is not counted again
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 130
    sup.client.load().latest_stats = _make_stats(taken_at=9.0, computed=20, steps=2)
    sup.is_ready = True
    scrapes.append(_scrape(gateway))
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 130 + 20
    assert _total(scrapes[-1], "cliffguard_engine_steps_total") == 13 + 2
    _assert_counters_never_fell(scrapes)


def test_a_client_reconnected_to_the_same_process_goes_on_from_its_totals():
    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    sup.client, sup.is_ready = _Client(pid=51, address=("127.0.0.1", 9000)).load(load_seconds=3.0), True
    sup.client.latest_stats = _make_stats(taken_at=1.0, computed=100, steps=10)
    scrapes = [_scrape(gateway)]
    sup.client = _Client(pid=51, address=("127.0.0.1", 9000)).load(load_seconds=3.0)   # the connection came back
    sup.client.latest_stats = _make_stats(taken_at=5.0, computed=120, steps=12)
    scrapes.append(_scrape(gateway))
    assert _total(scrapes[-1], "cliffguard_computed_tokens_total") == 120
    assert _total(scrapes[-1], "cliffguard_engine_steps_total") == 12
    _assert_counters_never_fell(scrapes)


def test_parking_a_replica_removes_only_the_series_it_has(monkeypatch):
    """A throughput pool has no target scale series: parking its replica removes the others and does not
    raise where prometheus-client (before 0.22) raises for a series it does not have (every scrape was then a
    500, and the replica never counted as parked)."""
    import prometheus_client

    def strict_remove(self, *labels):
        if tuple(str(v) for v in labels) not in self._metrics:
            raise KeyError(labels)
        del self._metrics[tuple(str(v) for v in labels)]

    monkeypatch.setattr(prometheus_client.Gauge, "remove", strict_remove)
    metrics = GatewayMetrics()
    stats = _make_stats(taken_at=1.0)
    metrics.running.labels(pool=POOL, replica="1").set(2)
    metrics._remove_state(DEVICE, 1, stats)
    assert ((POOL, "1") not in metrics.running._metrics
            and not metrics.target_scale._metrics and not metrics.stats_age._metrics)


def _watch_one_pool(offered) -> tuple[OverloadWatch, GatewayMetrics, SimpleNamespace]:
    """An `OverloadWatch` over one pool `chat` on DEVICE, offered `offered` (a `pools.demand.OfferedLoad`'s
    `totals` and `span`), its one replica ready with a fitted step-cost model: (watch, metrics, the replica)."""
    from engine.step_cost import LinearStepTime

    admission = SimpleNamespace(offered=offered, max_request=2048, oldest_wait=lambda now: 0.0)
    spec = SimpleNamespace(avg_len=64, max_num_batched_tokens=512, max_queue_seconds=30.0)
    pool = SimpleNamespace(name="chat", device=DEVICE, is_upstream=False, admission=admission, spec=spec)
    metrics = GatewayMetrics()
    watch = OverloadWatch({"chat": pool}, {"chat": 32}, metrics)
    stats = dataclasses.replace(_make_stats(taken_at=0.0), step=StepCounters(
        busy_seconds=1.0, step_model=LinearStepTime(a=0.01, b=1e-4, c=1e-3, d=0.0)))
    sup = SimpleNamespace(is_ready=True, client=SimpleNamespace(latest_stats=stats, is_alive=True))
    watch.supervisors = {DEVICE: [sup]}
    return watch, metrics, sup


def test_with_no_replica_ready_a_pools_capacity_reads_0_and_the_offered_load_stays_measured():
    """The device's step-cost model outlives its replicas: with none ready, capacity (what the ready replicas
    can do) reads 0 and the load offered is still measured (capacity kept its last value and the offered load
    read 0, the model being read from ready replicas only). The offered load over no replica's time is +Inf
    (it read as if one were up: an alert on it stayed quiet through a whole outage); nothing offered, 0."""
    offered = SimpleNamespace(totals=lambda now: (0, 0, 0), span=lambda now: 10.0)
    watch, metrics, sup = _watch_one_pool(offered)
    capacity = metrics.pool_capacity.labels(pool="chat", phase="decode")._value
    watch.check(100.0)
    assert capacity.get() > 0
    sup.is_ready = False
    offered.totals = lambda now: (50, 5000, 2500)
    watch.check(101.0)
    assert capacity.get() == 0 and metrics.device_offered_load.labels(device=DEVICE)._value.get() == math.inf
    offered.totals = lambda now: (0, 0, 0)
    watch.check(102.0)
    assert metrics.device_offered_load.labels(device=DEVICE)._value.get() == 0
    never = SimpleNamespace(totals=lambda now: (50, 5000, 2500), span=lambda now: 10.0)
    watch, metrics, sup = _watch_one_pool(never)
    sup.is_ready = False   # never ready: no step-cost model yet (a worker that fails to load, again and again)
    watch.check(100.0)
    assert metrics.device_offered_load.labels(device=DEVICE)._value.get() == math.inf


def test_a_gateway_started_into_steady_traffic_reads_its_offered_rate_from_the_start():
    """5 s after the gateway's queue began counting, 100 prompt tokens a second for 5 s read 100 tokens/s
    offered (not 5/20 of it: the window is not full yet), and so does the load they make."""
    from pools.demand import OfferedLoad

    offered = OfferedLoad(window=20.0, since=100.0)
    for t in range(5):
        offered.add(100.0 + t, 100, 10)
    watch, metrics, _ = _watch_one_pool(offered)
    watch.check(105.0)
    assert metrics.pool_offered.labels(pool="chat", phase="prefill")._value.get() == pytest.approx(100.0)
    assert metrics.pool_offered.labels(pool="chat", phase="decode")._value.get() == pytest.approx(10.0)


def test_a_scrape_rendering_beside_an_update_never_reads_a_dead_workers_last_load(monkeypatch):
    """/metrics renders on a thread while the loop updates the series: what a replica not running runs and holds
    is set to 0 straight away, never to its dead worker's last stats first (a render between the two would
    have read them)."""
    from prometheus_client import Gauge

    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    sup.client, sup.is_ready = _Client(pid=11).load(), True
    sup.client.latest_stats = _make_stats(taken_at=0.0, running=3)
    _scrape(gateway)
    metrics = gateway.metrics
    held = {id(g.labels(pool=POOL, replica="0")): name for name, g in (
        ("running", metrics.running), ("waiting", metrics.waiting), ("kv_usage", metrics.kv_usage),
        ("reserved", metrics.replica_reserved), ("held", metrics.replica_held))}
    held[id(metrics.step_target.labels(device=DEVICE, replica="0"))] = "step_target"
    sets, real_set = [], Gauge.set
    monkeypatch.setattr(Gauge, "set", lambda self, value: (sets.append((held.get(id(self)), value)),
                                                           real_set(self, value))[1])
    sup.is_ready = False                 # the worker died: it keeps its last stats
    handlers.refresh_metrics(gateway)
    assert {name for name, _ in sets if name} == set(held.values())
    assert [(name, value) for name, value in sets if name and value] == []
    sup.is_ready = True
    sets.clear()
    handlers.refresh_metrics(gateway)
    assert ("running", 3) in sets


def test_a_worker_that_lived_between_two_scrapes_is_counted(monkeypatch):
    """Worker A is scraped, B loads, works, pushes its stats and dies, C replaces it before the next scrape:
    B's counts are taken when its supervisor replaces it (the series followed one client per scrape: B's
    1,000 tokens were never counted)."""
    from gateway.workers import supervisor as supervisor_module

    gateway = _make_gateway()
    sup = gateway.supervisors[DEVICE][0]
    sup.client, sup.is_ready = _Client(pid=1).load(), True
    sup.client.latest_stats = _make_stats(taken_at=1.0, computed=100)
    _scrape(gateway)
    b, c = _Client(pid=2).load(), _Client(pid=3).load()
    b.latest_stats, c.latest_stats = _make_stats(taken_at=2.0, computed=1000), _make_stats(taken_at=3.0, computed=5)
    owner = SimpleNamespace(client=b, link=None, config=None, pools=[], device=DEVICE, replica=0,
                            metrics=gateway.metrics, _lease=lambda *a: True)
    monkeypatch.setattr(supervisor_module, "AsyncEngineClient", lambda config: c)
    assert supervisor_module.DeviceSupervisor._new_client(owner) is c   # B died: its supervisor makes C's
    sup.client = c
    assert _total(_scrape(gateway), "cliffguard_computed_tokens_total") == 100 + 1000 + 5


def test_latencies_are_of_the_requests_a_client_waits_on():
    """A batch line or a background Response (no client connection: `request` None) waits by design, behind
    the interactive load: its tokens count, its latencies do not go into the pool's histograms."""
    from gateway.local_answer import LocalResponse
    from gateway.openai.completions import parse_completion

    metrics = GatewayMetrics()
    series = metrics.pool_series(POOL)
    pool, placed = SimpleNamespace(name=POOL), {POOL: SimpleNamespace(replica=0, observe=lambda n, prefilled: None)}
    req = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 4})
    first = SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[7])], finished=False, metrics={})
    last = SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[8])], finished=True, metrics={"queue_time": 0.01})
    for request in (None, SimpleNamespace(app={})):   # a batch line, then an HTTP request
        local = LocalResponse(request, req, [(pool, [1])], placed=placed, received=0.0, metrics=metrics)
        local._observe(0, first)
        local._observe(0, last)
        local.latencies.release()   # as `run` does once no rerun can replace this run
    assert series.generation_tokens._value.get() == 4
    assert [h._sum.get() > 0 for h in (series.ttft, series.itl, series.e2e, series.queue_time)] == [True] * 4
    counts = [sum(b.get() for b in h._buckets) for h in (series.ttft, series.itl, series.e2e, series.queue_time)]
    assert counts == [1, 1, 1, 1]   # the HTTP request's only


def test_a_non_streamed_answer_holds_its_inter_token_gaps_in_a_few_bytes_each():
    """Held until no rerun can replace the run (a non-streamed answer: to its end), each gap was a tuple in a list
    (48.8 MiB for 8 choices of 32,000 tokens, a client's choice); all are observed once released."""
    import tracemalloc

    from gateway.monitoring.metrics import HeldLatencies

    itl = GatewayMetrics().pool_series(POOL).itl
    held = HeldLatencies()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            held.observe(itl, 0.001 * (i % 50))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2 << 20, grown                  # 8 bytes a gap (a tuple each: ~19 MB)
    assert sum(b.get() for b in itl._buckets) == 0
    held.release()
    assert sum(b.get() for b in itl._buckets) == 100_000 and math.isclose(itl._sum.get(), 0.001 * 24.5 * 100_000)
    held.observe(itl, 1.0)                         # after the release: at once
    assert sum(b.get() for b in itl._buckets) == 100_001


def test_an_upstreams_finish_reasons_outside_openais_count_as_other():
    """An upstream may write any finish_reason (an id in it, a long list of its own): each would be a series of
    its own for the process's life; outside the known ones they count as "other"."""
    metrics = GatewayMetrics()
    for reason in ("stop", "length", "tool_calls", "stop-7f3a", "stop-9c1e", "x" * 5000):
        metrics.finished("remote", reason)
    counts = {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(metrics.render().decode())
              if f.name == "cliffguard_request_success" for s in f.samples if s.name.endswith("_total")}
    assert counts == {"stop": 1, "length": 1, "tool_calls": 1, "other": 3}


async def test_a_stream_tail_written_after_the_engine_is_done_pauses_nothing():
    """A Responses stream repeats its output in its last events, past the 1 MiB bound with logprobs: the engine
    requests had ended, yet each was sent a pause and cliffguard_paused_responses_total counted one."""
    import asyncio
    from types import SimpleNamespace

    from prometheus_client import Counter, CollectorRegistry

    from gateway.local_answer import LocalResponse

    paused, counter = [], Counter("paused", "", ["pool"], registry=CollectorRegistry())
    client = SimpleNamespace(pause=lambda request_id, p: paused.append((request_id, p)))
    runner = asyncio.get_running_loop().create_future()
    response = SimpleNamespace(_runner=runner, metrics=SimpleNamespace(paused_responses=counter), request_id="r",
                               routed=[(SimpleNamespace(name="chat"), [1])], placed={"chat": SimpleNamespace(client=client)})
    LocalResponse.set_paused(response, True)   # still running: paused and counted
    runner.set_result(None)
    LocalResponse.set_paused(response, True)   # its tail, after the engine: nothing
    LocalResponse.set_paused(response, False)
    assert paused == [("r", True)] and counter.labels(pool="chat")._value.get() == 1


async def test_a_handler_cancelled_after_the_run_stops_the_streams_writer():
    """Cancelled between `run` and `finish` (a Responses stream's store write, a death's record, its client gone),
    the stream's writer stayed parked for ever ("Task was destroyed but it is pending!")."""
    import asyncio
    from types import SimpleNamespace

    from gateway.completion import Completion
    from gateway.local_answer import LocalResponse

    writer = asyncio.ensure_future(asyncio.Event().wait())
    local = SimpleNamespace(_writer=writer)
    local.abandon = lambda: LocalResponse.abandon(local)
    completion = object.__new__(Completion)

    async def answered_then_cancelled():
        completion._local = local
        raise asyncio.CancelledError
    completion._answer = answered_then_cancelled
    with pytest.raises(asyncio.CancelledError):
        await completion.answer()
    await asyncio.sleep(0)
    assert writer.cancelled()
