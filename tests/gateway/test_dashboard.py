"""`GET /dashboard`: the page is self-contained, its data equals what `/metrics` shows, its p99s and rates
are computed over the window, and the data needs the API key. The slow test loads the page in headless
Chromium against a live server under load and saves the screenshot docs/DASHBOARD.md shows."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html.parser
import itertools
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.monitoring import dashboard
from gateway.admission import AdmissionMetrics
from gateway.monitoring.metrics import TTFT_BUCKETS, GatewayMetrics
from tests.gateway.conftest import DEFAULT_CONFIG, REPO, LiveServer, pools_yaml
from tests.gateway.test_app import _client, _metrics, _model, _stream_text, _wait_idle

KEY = "dash-key"


# --- the page ----------------------------------------------------------------------------------------
def test_the_page_names_no_url_and_its_csp_admits_exactly_its_inline_script_and_style():
    page = dashboard.PAGE
    assert not re.search(r"https?:|//[a-z]", page, re.IGNORECASE), "the page names a URL"
    assert re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page) == ["data:,"]
    csp = dashboard.PAGE_HEADERS["Content-Security-Policy"]
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
        assert len(bodies) == 1
        digest = base64.b64encode(hashlib.sha256(bodies[0].encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp, f"the CSP would block the page's {tag}"
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_every_tile_of_the_page_has_its_series():
    """The page draws each tile's sparkline from the pool's `series` of the tile's metric: one missing
    (replicas ready's was) threw in the first pool's card, and no other pool was drawn."""
    tiles = dashboard.PAGE[dashboard.PAGE.index("const TILES = ["):]
    keys = re.findall(r'^  \["(\w+)", "', tiles[:tiles.index("\n];")], re.MULTILINE)
    assert len(keys) >= 12 and "replicas_ready" in keys
    assert set(keys) <= set(dashboard.SERIES), set(keys) - set(dashboard.SERIES)


# --- p99 and rates, on a registry of our own -----------------------------------------------------------------
@pytest.mark.parametrize("counts, expected", [
    ({}, None),                                  # no observation
    ({0.0005: 100}, 0.00099),                    # all in the first bucket: from 0 to 0.001
    ({0.003: 99, 0.03: 1}, 0.005),               # the 99th of 100 ends the (0.001, 0.005] bucket
    ({0.003: 98, 0.03: 2}, 0.03),                # half-way into (0.02, 0.04]
    ({0.003: 50, 5000.0: 50}, 2560.0),           # in +Inf: the largest finite bound
])
def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus(counts, expected):
    metrics = GatewayMetrics()
    for value, n in counts.items():
        for _ in range(n):
            metrics.ttft.labels(pool="chat").observe(value)
    snapshot = _make_snapshot(metrics, 0.0)
    buckets = snapshot.histograms["chat"].get("ttft", ((float("inf"), 0.0),))
    assert len(buckets) in (1, len(TTFT_BUCKETS) + 1)
    got = dashboard.histogram_quantile(0.99, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


def _make_snapshot(metrics: GatewayMetrics, now: float, pools=("chat",), extra: CollectorRegistry | None = None):
    text = metrics.render().decode() + (generate_latest(extra).decode() if extra is not None else "")
    return dashboard.parse_snapshot(text_string_to_metric_families(text), pools, now=now, wall=1000.0 + now)


def test_the_registry_and_its_text_exposition_give_the_same_snapshot():
    """`/dashboard/data` reads the registry; `/metrics` renders it: both say the same, per replica too."""
    metrics = GatewayMetrics()
    metrics.ttft.labels(pool="chat").observe(0.3)
    metrics.preemptions.labels(pool="chat", replica="0", mode="recompute").inc(3)
    _make_replicas(metrics, AdmissionMetrics(metrics.registry), "chat", _TWO_REPLICAS, placed=True)
    from_text = _make_snapshot(metrics, 1.0)
    from_registry = dashboard.parse_snapshot(metrics.registry.collect(), ("chat",), now=1.0, wall=1001.0)
    assert from_registry == from_text and from_text.histograms["chat"]["ttft"]
    assert list(from_text.replicas["chat"]) == ["0", "1"]
    assert all(v is not None for values in from_text.replicas["chat"].values() for v in values.values())


# per replica: kv_cache_usage_perc, num_requests_running, num_requests_waiting, kv_credits_free, requests and
# prompt tokens placed
_TWO_REPLICAS = ((0.2, 3, 1, 700, 3, 100), (0.6, 5, 0, 300, 5, 300))


def _make_replicas(metrics: GatewayMetrics, credits: AdmissionMetrics, pool: str, rows, placed: bool) -> None:
    """Set each replica's engine and credit series, as `update_pool` and `AdmissionMetrics.refresh` do, and
    with `placed` count its placements."""
    for replica, (kv, running, waiting, free, requests, tokens) in enumerate(rows):
        labels = {"pool": pool, "replica": str(replica)}
        metrics.kv_usage.labels(**labels).set(kv)
        metrics.running.labels(**labels).set(running)
        metrics.waiting.labels(**labels).set(waiting)
        credits.credits.labels(**labels).set(1000)
        credits.credits_free.labels(**labels).set(free)
        if placed:
            credits.placed.labels(**labels).inc(requests)
            credits.placed_tokens.labels(**labels).inc(tokens)


def test_a_replicated_pool_shows_each_replica_and_the_split_of_its_placed_prompt_tokens():
    metrics = GatewayMetrics()
    credits = AdmissionMetrics(metrics.registry)
    _make_replicas(metrics, credits, "chat", _TWO_REPLICAS, placed=False)
    _make_replicas(metrics, credits, "rag", _TWO_REPLICAS[:1], placed=True)
    history = dashboard.DashboardHistory()

    snapshot = dashboard.parse_snapshot(metrics.registry.collect(), ("chat", "rag"), now=0.0, wall=1000.0)
    chat = snapshot.values["chat"]
    assert chat["kv_cache_usage_perc"] == pytest.approx(0.4)       # the mean of the replicas' ...
    assert (chat["num_requests_running"], chat["num_requests_waiting"]) == (8, 1)   # ... the sum of their counts
    assert (chat["kv_credits_free"], chat["kv_credits"]) == (1000, 2000)
    assert snapshot.replicas["chat"] == {
        "0": {"kv_cache_usage_perc": 0.2, "num_requests_running": 3, "num_requests_waiting": 1, "kv_credits_free": 700,
              "replica_requests_total": None, "replica_prompt_tokens_total": None},   # nothing placed yet
        "1": {"kv_cache_usage_perc": 0.6, "num_requests_running": 5, "num_requests_waiting": 0, "kv_credits_free": 300,
              "replica_requests_total": None, "replica_prompt_tokens_total": None}}
    view = history.add(snapshot)["pools"]
    assert view["chat"]["replicas"] == snapshot.replicas["chat"] and view["chat"]["replica_split"] is None
    assert list(view["rag"]["replicas"]) == ["0"] and view["rag"]["replica_split"] is None   # one replica: no split

    credits.placed.labels(pool="chat", replica="1").inc(2)           # only replica 1 got traffic
    credits.placed_tokens.labels(pool="chat", replica="1").inc(50)
    view = history.add(_make_snapshot(metrics, 1.0, pools=("chat", "rag")))["pools"]
    assert view["chat"]["replica_split"] == {"0": 0.0, "1": 1.0}
    assert view["chat"]["replicas"]["0"]["replica_requests_total"] is None
    assert view["chat"]["replicas"]["1"]["replica_requests_total"] == 2

    for replica, row in enumerate(_TWO_REPLICAS):                  # 100 + 300 more prompt tokens
        credits.placed.labels(pool="chat", replica=str(replica)).inc(row[4])
        credits.placed_tokens.labels(pool="chat", replica=str(replica)).inc(row[5])
    view = history.add(_make_snapshot(metrics, 2.0, pools=("chat", "rag")))["pools"]
    replicas = view["chat"]["replicas"]
    assert [replicas[r]["replica_requests_total"] for r in ("0", "1")] == [3, 7]
    assert [replicas[r]["replica_prompt_tokens_total"] for r in ("0", "1")] == [100, 350]
    assert view["chat"]["replica_split"] == pytest.approx({"0": 100 / 450, "1": 350 / 450})
    assert view["chat"]["kv_cache_usage_perc"] == pytest.approx(0.4) and view["chat"]["num_requests_running"] == 8


def test_rates_and_p99s_are_taken_over_the_window_and_the_series_kept_for_the_history():
    metrics = GatewayMetrics()
    credits = AdmissionMetrics(metrics.registry)
    credits.credits.labels(pool="chat", replica="0").set(1024)
    history = dashboard.DashboardHistory(window_seconds=10, history_seconds=30, min_interval=0.5)
    preempt = metrics.preemptions.labels(pool="chat", replica="0", mode="recompute")
    metrics.kv_usage.labels(pool="chat", replica="0").set(0.25)

    first = history.add(_make_snapshot(metrics, 0.0, pools=("chat", "rag")))
    chat = first["pools"]["chat"]
    assert chat["kv_cache_usage_perc"] == 0.25 and chat["kv_credits"] == 1024
    assert chat["preemptions_per_second"] is None and chat["ttft_p99_seconds"] is None   # nothing to compare yet
    assert chat["death_spiral"] is None and first["pools"]["rag"]["kv_cache_usage_perc"] is None   # not exported

    for t in range(1, 21):                       # 2 preemptions and one 30 ms TTFT per second
        preempt.inc(2)
        metrics.ttft.labels(pool="chat").observe(0.03)
        view = history.add(_make_snapshot(metrics, float(t)))
    chat = view["pools"]["chat"]
    assert view["window_seconds"] == 10
    assert chat["preemptions_per_second"] == pytest.approx(2.0) and chat["num_preemptions_total"] == 40
    assert chat["ttft_window_count"] == 10 and chat["ttft_p99_seconds"] == pytest.approx(0.0398)
    assert chat["itl_p99_seconds"] is None and chat["itl_window_count"] == 0         # none observed yet

    metrics.ttft.labels(pool="chat").observe(3.0)   # a slow one enters the window ...
    view = history.add(_make_snapshot(metrics, 20.2))    # answered, but not kept: 0.2 s after the last one
    assert view["pools"]["chat"]["series"]["age_seconds"][-3:] == [1.2, 0.2, 0.0]
    assert view["pools"]["chat"]["ttft_p99_seconds"] == pytest.approx(2.5 + 2.5 * (10.89 - 10) / 1)
    for t in range(21, 41):
        view = history.add(_make_snapshot(metrics, float(t)))
    chat = view["pools"]["chat"]
    assert chat["preemptions_per_second"] == 0 and chat["ttft_p99_seconds"] is None   # the window holds none
    series = chat["series"]
    assert series["age_seconds"][0] == 30 and len(series["age_seconds"]) == 31
    assert series["preemptions_per_second"][0] == pytest.approx(2.0) and series["kv_cache_usage_perc"][-1] == 0.25

    spiral = CollectorRegistry()   # the death-spiral gauge, shown once exported
    Gauge("cliffguard_death_spiral", "", ["pool"], registry=spiral).labels(pool="chat").set(1)
    assert history.add(_make_snapshot(metrics, 41.0, extra=spiral))["pools"]["chat"]["death_spiral"] == 1


async def test_viewers_polling_together_share_one_snapshot_and_a_young_one_is_answered_again():
    """Each snapshot walks the whole registry (a second of the loop with thousands of tenants' series): viewers
    polling at once share one, and a poll within `min_interval` of the last snapshot gets its answer."""
    metrics, history, taken = GatewayMetrics(), dashboard.DashboardHistory(min_interval=0.5), []

    async def take():
        taken.append(time.monotonic())
        snapshot = _make_snapshot(metrics, time.monotonic())
        await asyncio.sleep(0.05)   # the walk, on its thread
        return snapshot

    answers = await asyncio.gather(*(history.poll(take) for _ in range(4)))
    assert len(taken) == 1 and all(a is answers[0] for a in answers)
    assert await history.poll(take) is answers[0] and len(taken) == 1   # younger than 0.5 s: answered again
    await asyncio.sleep(0.5)
    assert await history.poll(take) is not answers[0] and len(taken) == 2


# --- a live gateway in-process ---------------------------------------------------------------------------------
async def test_the_data_equals_metrics_and_needs_the_key_like_the_api(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model, api_keys=f"[{KEY}]"), tmp_path)
    auth = {"Authorization": f"Bearer {KEY}"}

    r = await client.get("/dashboard")                   # the page holds no data: served without a key
    assert r.status == 200 and r.content_type == "text/html"
    assert r.headers["Content-Security-Policy"] == dashboard.PAGE_HEADERS["Content-Security-Policy"]
    assert await r.text() == dashboard.PAGE
    for headers, message in (({}, "missing API key"), ({"Authorization": "Bearer nope"}, "invalid API key")):
        r = await client.get("/dashboard/data", headers=headers)
        body = await r.json()
        assert r.status == 401 and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert message in body["error"]["message"] and body["error"]["code"] == "invalid_api_key"

    before = _metrics(await (await client.get("/metrics")).text())
    first = await (await client.get("/dashboard/data", headers=auth)).json()
    assert list(first["pools"]) == ["chat", "rag"]

    async def chat(i: int, n: int = 1) -> None:
        r = await client.post("/v1/chat/completions", headers=auth, json={
            "model": _model(tiny_model), "messages": [{"role": "user", "content": f"Count to {i}"}],
            "max_tokens": 8, "ignore_eos": True, "stream": True, "n": n})
        assert r.status == 200
        await _stream_text(r)

    await asyncio.gather(*(chat(i) for i in range(3)), chat(3, n=2))
    await _wait_idle(gateway)
    for _ in range(100):      # each handler gives its credits back after its client read the end: soon, not at once
        if all(pool.admission.ledger.free == pool.admission.ledger.total for pool in gateway.pools.values()
               if not pool.is_upstream):
            break
        await asyncio.sleep(0.05)
    for _ in range(20):       # the worker's last push, once idle, is in place, and none landed between the reads
        start = time.time()   # a poll within MIN_SAMPLE_SECONDS of the last snapshot answers that one: not taken here
        seen = _metrics(await (await client.get("/metrics")).text())
        data = await (await client.get("/dashboard/data", headers=auth)).json()
        after = _metrics(await (await client.get("/metrics")).text())
        fresh = start <= data["time"] <= time.time()
        if fresh and _without_ages(seen) == _without_ages(after) and _ages_ordered(seen, data, after):
            break
        await asyncio.sleep(0.1)
    assert fresh, "every answer was an earlier poll's"
    assert _without_ages(seen) == _without_ages(after), "the gateway did not settle"
    assert _ages_ordered(seen, data, after), "a stats push landed between the reads every time"

    for pool, shown in data["pools"].items():
        for key, name in dashboard.VALUES.items():
            assert shown[key] == _pool_sum(after, name, pool), (pool, key)
        assert list(shown["replicas"]) == ["0"] and shown["replica_split"] is None   # one replica per pool here
        for key, name in dashboard.REPLICA_VALUES.items():
            assert shown["replicas"]["0"][key] == after.get(name, {}).get((("pool", pool), ("replica", "0"))), key
        ttft = _bucket_increase(after, before, "cliffguard_time_to_first_token_seconds", pool)
        assert shown["ttft_window_count"] == (4 if pool == "chat" else 0)
        assert shown["ttft_p99_seconds"] == (dashboard.histogram_quantile(0.99, ttft) if ttft[-1][1] else None)
        assert shown["preemptions_per_second"] == 0
        assert shown["series"]["age_seconds"][-1] == 0 and len(shown["series"]["age_seconds"]) >= 2
    # 7 gaps between 8 streamed tokens, for each sample (as vLLM counts them: n = 2 counted one per step)
    assert data["pools"]["chat"]["itl_window_count"] == 3 * 7 + 2 * 7
    assert data["pools"]["chat"]["kv_credits_free"] == data["pools"]["chat"]["kv_credits"] > 0
    assert data["stats_age_seconds"].keys() == _ages(after).keys()


def _without_ages(m: dict) -> dict:
    return {name: series for name, series in m.items() if name != "cliffguard_stats_age_seconds"}


def _ages(m: dict) -> dict[str, float]:
    return {labels[0][1]: v for labels, v in m["cliffguard_stats_age_seconds"].items()}


def _ages_ordered(seen: dict, data: dict, after: dict) -> bool:
    """The dashboard's stats ages lie between those of the scrapes before and after it: no worker pushed
    stats between the three reads (pushes are asynchronous), and the data's ages are read at its request."""
    before, later = _ages(seen), _ages(after)
    return before.keys() == later.keys() and all(
        before[d] <= data["stats_age_seconds"].get(d, -1.0) <= later[d] for d in before)


def _pool_sum(m: dict, name: str, pool: str) -> float | None:
    """A sample's value for `pool`, summed over its other labels, as parsed by test_app._metrics."""
    values = [v for labels, v in m.get(name, {}).items() if ("pool", pool) in labels]
    return sum(values) if values else None


def _bucket_increase(after: dict, before: dict, histogram: str, pool: str) -> dashboard.Buckets:
    rows = []
    for labels, count in after.get(histogram + "_bucket", {}).items():
        if ("pool", pool) in labels:
            rows.append((float(dict(labels)["le"]), count - before.get(histogram + "_bucket", {}).get(labels, 0.0)))
    return tuple(sorted(rows)) or ((float("inf"), 0.0),)


# --- headless Chromium against a live server under load --------------------------------------------------------
SCREENSHOT = REPO / "docs" / "img" / "dashboard.png"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed by `make browser` when missing; skips if that cannot be done here."""
    path = shutil.which("chromium")
    if path is None:
        done = subprocess.run(["make", "-C", str(REPO), "browser"], capture_output=True, text=True, timeout=900)
        path = shutil.which("chromium")
        if path is None:
            pytest.skip("no chromium and `make browser` could not install it (it runs apt-get, as root): "
                        + (done.stdout + done.stderr).strip()[-300:])
    return path


def _run_chromium(chromium: str, tmp_path: Path, url: str, *args: str, budget_ms: int = 6000) -> str:
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    done = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           f"--virtual-time-budget={budget_ms}", *args, url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Cells(html.parser.HTMLParser):
    """The values the page shows: {(pool, metric): data-value}, its replica rows' {(pool, replica, metric):
    data-value} and the body's data- attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple[str, str], float | None] = {}
        self.replicas: dict[tuple[str, str, str], float | None] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif "data-metric" in a and "data-pool" in a:
            value = a.get("data-value")
            value = float(value) if value else None
            if "data-replica" in a:
                self.replicas[a["data-pool"], a["data-replica"], a["data-metric"]] = value
            else:
                self.values[a["data-pool"], a["data-metric"]] = value


class _Load:
    """Three chat streams looping with pauses between requests and one long rag prompt looping beside them
    (the pauses leave the rag prefill whole steps now and then), on a thread; `close` cancels them."""

    def __init__(self, url: str) -> None:
        self.url, self.errors = url, []
        self.loop = asyncio.new_event_loop()
        self.task = self.loop.create_task(self._main())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            self.loop.run_until_complete(self.task)
        self.loop.close()

    async def _main(self) -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            await asyncio.gather(self._loop(session, "/v1/completions", lambda n: {
                "model": MODEL, "prompt": [100 + (7 * j + n) % 30000 for j in range(4200)], "max_tokens": 8,
                "stream": True}), *(self._loop(session, "/v1/chat/completions", lambda n, i=i: {
                    "model": MODEL, "messages": [{"role": "user", "content": f"Count from {n} to {n + 50}."}],
                    "max_tokens": 32, "ignore_eos": True, "stream": True}, pause=1.0 + i) for i in range(3)))

    async def _loop(self, session: aiohttp.ClientSession, path: str, body, pause: float = 0.0) -> None:
        for n in itertools.count():
            try:
                async with session.post(self.url + path, json=body(n)) as r:
                    async for _ in r.content:
                        pass
                    if r.status != 200:
                        self.errors.append(f"{path}: {r.status}")
            except aiohttp.ClientError as exc:
                self.errors.append(f"{path}: {exc!r}")
            await asyncio.sleep(pause)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)


class _Scraper:
    """`/metrics` every 0.1 s on a thread, while the browser runs: what the page may have been shown."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.scrapes = url, threading.Event(), []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
                self.scrapes.append(_metrics(r.read().decode()))
            time.sleep(0.1)

    def close(self) -> list[dict]:
        self.stop.set()
        self.thread.join(10)
        return self.scrapes


def _poll_data(url: str, seconds: float) -> None:
    """Poll the data as an open dashboard would, so the gateway's history holds the load."""
    request = urllib.request.Request(url + "/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.status == 200
        time.sleep(1.0)


@pytest.mark.slow
def test_the_page_in_headless_chromium_shows_what_metrics_shows_under_load(chromium, tmp_path):
    env = dict(os.environ, CLIFFGUARD_API_KEYS=KEY)
    with LiveServer(DEFAULT_CONFIG, env=env) as server:
        load = _Load(server.url)
        try:
            _poll_data(server.url, 40)
            scraper = _Scraper(server.url)
            dom = _run_chromium(chromium, tmp_path, f"{server.url}/dashboard#key={KEY}", "--dump-dom")
            scrapes = scraper.close()
            locked = _run_chromium(chromium, tmp_path, f"{server.url}/dashboard", "--dump-dom", budget_ms=2000)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            _run_chromium(chromium, tmp_path, f"{server.url}/dashboard#key={KEY}", f"--screenshot={SCREENSHOT}",
                          "--window-size=1280,900")
        finally:
            load.close()
    assert not load.errors, load.errors[:5]
    asking = _Cells()
    asking.feed(locked)                                  # no key: the page asks for one and shows nothing
    assert asking.body.get("data-status") == "auth" and not asking.values, asking.body
    assert re.search(r'<form id="login">', locked), "the key form is hidden"
    cells = _Cells()
    cells.feed(dom)
    assert cells.body.get("data-status") == "ok" and int(cells.body["data-polls"]) >= 2, cells.body
    assert not cells.replicas, "a pool on one replica shows no replica rows"
    assert scrapes, "no /metrics scrape during the browser run"
    _assert_shown_within_scrapes(cells.values, scrapes)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and SCREENSHOT.stat().st_size > 20_000


# Tolerances for values that move under load between the page's poll and the nearest scrape (0.1 s apart)
_SLACK = {"kv_cache_usage_perc": 0.05, "num_requests_running": 1, "num_requests_waiting": 1,
          "num_requests_swapped": 1, "admission_queue_depth": 1}


def _assert_shown_within_scrapes(shown: dict, scrapes: list[dict]) -> None:
    """Each number the page shows lies within what `/metrics` showed during the browser run."""
    for pool in ("chat", "rag"):
        for key, name in dashboard.VALUES.items():
            seen = [v for v in (_pool_sum(m, name, pool) for m in scrapes) if v is not None]
            value = shown[pool, key]
            if not seen:
                assert value is None, (pool, key, value)
                continue
            slack = _SLACK.get(key, 0)
            if key == "kv_credits_free":
                slack = 0.1 * shown[pool, "kv_credits"]
            assert value is not None and min(seen) - slack <= value <= max(seen) + slack, \
                (pool, key, value, min(seen), max(seen))
        for key in ("ttft", "itl"):
            p99, n = shown[pool, f"{key}_p99_seconds"], shown[pool, f"{key}_window_count"]
            total = _pool_sum(scrapes[-1], dashboard.HISTOGRAMS[key] + "_count", pool) or 0
            assert (p99 is None) == (not n) and (n or 0) <= total, (pool, key, p99, n, total)
    assert shown["chat", "itl_window_count"] > 0, "the page saw no chat tokens streamed in its window"


def test_each_pool_shows_its_devices_overload_and_its_oldest_wait():
    metrics = GatewayMetrics()
    metrics.device_overloaded.labels(device="gpu0").set(1)
    metrics.device_offered_load.labels(device="gpu0").set(2.5)
    metrics.device_replicas_needed.labels(device="gpu0").set(3)
    metrics.device_overloaded.labels(device="gpu1").set(0)
    metrics.pool_oldest_wait.labels(pool="rag").set(12.5)
    for state, n in (("ready", 1), ("restarting", 1), ("failed", 1), ("stopped", 0)):
        metrics.replicas.labels(device="gpu0", state=state).set(n)
    snapshot = dashboard.parse_snapshot(metrics.registry.collect(), ("chat", "rag", "other"), now=0.0, wall=1000.0,
                                        devices={"chat": "gpu0", "rag": "gpu0", "other": "gpu1"})
    view = dashboard.DashboardHistory().add(snapshot)["pools"]
    for pool in ("chat", "rag"):
        assert (view[pool]["device_overloaded"], view[pool]["device_offered_load"],
                view[pool]["device_replicas_needed"]) == (1, 2.5, 3)
    assert view["other"]["device_overloaded"] == 0 and view["other"]["device_offered_load"] is None
    assert view["rag"]["oldest_waiting_seconds"] == 12.5 and view["rag"]["series"]["device_offered_load"] == [2.5]
    chat = view["chat"]
    assert (chat["replicas_failed"], chat["replicas_restarting"], chat["series"]["replicas_ready"],
            view["other"]["replicas_failed"]) == (1, 1, [1], None)   # a dead replica shows
