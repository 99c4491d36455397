"""`GET /dashboard`: one self-contained page showing each pool live, and `GET /dashboard/data`, its JSON.

The numbers are the ones `/metrics` shows, by construction: `data` runs the `/metrics` handler itself
(the same refresh from the stats each device worker pushed last), parses the Prometheus text it
renders (`prometheus_client.parser`) and takes each pool's series from it (`parse_snapshot`). What a
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

Auth: the page (`page`) holds no data and is served to anyone (`gateway.app` lists it among the open
paths); `/dashboard/data` is an API path, so with API keys configured it needs `Authorization: Bearer`
like the rest of the API. The page asks for the key (or takes it from the URL fragment, `#key=...`,
which browsers never send to a server), keeps it in `sessionStorage` and sends it as that header on its
fetches: the key never appears in a URL the gateway, a proxy or a log sees. `PAGE_HEADERS` carry a
Content-Security-Policy that allows only the page's own inline script and style (by hash) and fetches
to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

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
    "kv_credits_total": _P + "kv_credits_total",
    "kv_credits_free": _P + "kv_credits_free",
    "admission_queue_depth": _P + "admission_queue_depth",
    "death_spiral": _P + "death_spiral",
}
HISTOGRAMS = {"ttft": _P + "time_to_first_token_seconds", "itl": _P + "inter_token_latency_seconds"}
SERIES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_swapped",
          "preemptions_per_second", "ttft_p99_seconds", "itl_p99_seconds", "kv_credits_free",
          "admission_queue_depth", "death_spiral")

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
    stats_age: dict[str, float] = field(default_factory=dict)   # device -> cliffguard_stats_age_seconds


def parse_snapshot(text: str, pools: Iterable[str], *, now: float, wall: float) -> Snapshot:
    """The dashboard's series of `pools` in a Prometheus text exposition (what `/metrics` renders)."""
    sums: dict[tuple[str, str], float] = {}
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    stats_age: dict[str, float] = {}
    bucket_names = {name + "_bucket" for name in HISTOGRAMS.values()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            pool = s.labels.get("pool")
            if s.name == _P + "stats_age_seconds":
                stats_age[s.labels.get("device", "")] = s.value
            elif pool is None:
                continue
            elif s.name in bucket_names:
                buckets.setdefault((s.name, pool), []).append((float(s.labels["le"]), s.value))
            else:
                sums[s.name, pool] = sums.get((s.name, pool), 0.0) + s.value
    values, histograms = {}, {}
    for pool in pools:
        values[pool] = {key: sums.get((name, pool)) for key, name in VALUES.items()}
        histograms[pool] = {key: tuple(sorted(buckets[name + "_bucket", pool]))
                            for key, name in HISTOGRAMS.items() if (name + "_bucket", pool) in buckets}
    return Snapshot(now, wall, values, histograms, stats_age)


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

    `add` is called by each poll of `/dashboard/data`. A snapshot taken less than `min_interval` after
    the last one kept is answered (its rates and p99s measured as any other) but not kept, so many
    viewers do not crowd the history. Runs on the event loop only."""

    def __init__(self, *, window_seconds: float = WINDOW_SECONDS, history_seconds: float = HISTORY_SECONDS,
                 min_interval: float = MIN_SAMPLE_SECONDS) -> None:
        self.window_seconds = window_seconds
        self.history_seconds = history_seconds
        self.min_interval = min_interval
        self._samples: deque[_Sample] = deque()

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
        return {"time": now.wall, "window_seconds": round(last.window, 3),
                "window_target_seconds": self.window_seconds, "history_seconds": self.history_seconds,
                "poll_seconds": POLL_SECONDS, "quantile": QUANTILE, "stats_age_seconds": now.stats_age,
                "pools": pools}


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity."""
    return value if value is None or math.isfinite(value) else None


DASHBOARD = web.AppKey("dashboard", DashboardHistory)


# --- handlers --------------------------------------------------------------------------------------
async def page(request: web.Request) -> web.Response:
    """The page: HTML with its style and script inline; it fetches `dashboard/data`."""
    return web.Response(text=PAGE, content_type="text/html", headers=PAGE_HEADERS)


async def data(request: web.Request) -> web.Response:
    """Every pool's current values, rates, p99s and time series, from what `/metrics` renders now."""
    rendered = await handlers.metrics(request)   # the /metrics handler itself: same refresh, same numbers
    snapshot = parse_snapshot(rendered.body.decode(), request.app[GATEWAY].pools, now=time.monotonic(),
                              wall=time.time())
    return web.json_response(request.app[DASHBOARD].add(snapshot), headers={"Cache-Control": "no-store"})


# --- the page --------------------------------------------------------------------------------------
# No URL to anywhere in it: no fonts, scripts or images from outside, and no namespace strings (the
# sparklines are SVG written as markup inside inline <svg> elements).
_STYLE = """
:root { color-scheme: dark; --bg: #0f1419; --card: #161d26; --tile: #1d2633; --line: #2a3545; --fg: #dbe2ea;
  --muted: #8a97a8; --ok: #3fb950; --warn: #d29922; --bad: #f85149; --accent: #58a6ff; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.35 "DejaVu Sans", "Liberation Sans", system-ui, sans-serif; }
header { display: flex; align-items: baseline; gap: 14px; padding: 12px 18px; border-bottom: 1px solid var(--line); }
header h1 { margin: 0; font-size: 20px; letter-spacing: .5px; }
header .sub { color: var(--muted); }
#status { margin-left: auto; color: var(--muted); font-variant-numeric: tabular-nums; }
body[data-status="error"] #status, body[data-status="auth"] #status { color: var(--bad); }
#login { display: flex; gap: 8px; align-items: center; padding: 12px 18px; background: var(--card);
  border-bottom: 1px solid var(--line); }
#login[hidden] { display: none; }
#login input { background: var(--bg); color: var(--fg); border: 1px solid var(--line); border-radius: 4px;
  padding: 5px 8px; width: 320px; }
#login button { background: var(--accent); color: #06101c; border: 0; border-radius: 4px; padding: 6px 12px;
  font-weight: 600; }
#login-msg { color: var(--bad); }
main { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 14px; padding: 14px 18px; }
.pool { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px 12px; }
.pool.spiral { border-color: var(--bad); box-shadow: 0 0 0 1px var(--bad); }
.pool-head { display: flex; align-items: center; gap: 10px; margin-bottom: 8px; }
.pool-head h2 { margin: 0; font-size: 17px; }
.badge { font-size: 12px; padding: 2px 8px; border-radius: 10px; border: 1px solid var(--line); color: var(--muted); }
.badge.ok { color: var(--ok); border-color: var(--ok); }
.badge.bad { color: #fff; background: var(--bad); border-color: var(--bad); font-weight: 700; }
.tiles { display: grid; grid-template-columns: repeat(3, 1fr); gap: 8px; }
.tile { background: var(--tile); border-radius: 6px; padding: 7px 9px 5px; min-width: 0; }
.label { color: var(--muted); font-size: 11px; text-transform: uppercase; letter-spacing: .6px; }
.value { font-size: 22px; font-weight: 700; font-variant-numeric: tabular-nums; white-space: nowrap; }
.sub { color: var(--muted); font-size: 12px; font-variant-numeric: tabular-nums; }
.row { display: flex; justify-content: space-between; align-items: baseline; gap: 6px; }
.bar { height: 5px; background: var(--bg); border-radius: 3px; overflow: hidden; margin: 3px 0 2px; }
.fill { height: 100%; width: 0; background: var(--ok); }
.fill.warn { background: var(--warn); }
.fill.bad { background: var(--bad); }
.spark-box { margin-top: 3px; }
.axis { display: flex; justify-content: space-between; color: var(--muted); font-size: 10px; }
svg.spark { display: block; width: 100%; height: 40px; }
svg.spark polyline { fill: none; stroke: var(--accent); stroke-width: 1.5; vector-effect: non-scaling-stroke; }
svg.spark line { stroke: var(--line); stroke-width: 1; vector-effect: non-scaling-stroke; }
footer { color: var(--muted); font-size: 12px; padding: 0 18px 16px; max-width: 1100px; }
footer code { color: var(--fg); }
"""

_SCRIPT = """
"use strict";
const KEY = "cliffguard.dashboard.key";
const pct = v => (100 * v).toFixed(1) + " %";
const count = v => String(Math.round(v));
const rate = v => v.toFixed(2) + " /s";
const secs = v => v < 1 ? (1000 * v).toFixed(v < 0.01 ? 2 : 0) + " ms" : v.toFixed(2) + " s";
// [metric, label, format, fixed top of the sparkline or null, the sub-line's metrics]
const TILES = [
  ["kv_cache_usage_perc", "KV cache usage", pct, 1, []],
  ["num_requests_running", "running", count, null, [["pool_max_num_seqs", "of ", count]]],
  ["num_requests_waiting", "waiting", count, null, []],
  ["num_requests_swapped", "swapped", count, null, []],
  ["preemptions_per_second", "preemptions", rate, null, [["num_preemptions_total", "total ", count]]],
  ["admission_queue_depth", "queued for credits", count, null, []],
  ["ttft_p99_seconds", "TTFT p99", secs, null, [["ttft_window_count", "n=", count]]],
  ["itl_p99_seconds", "ITL p99", secs, null, [["itl_window_count", "n=", count]]],
  ["kv_credits_free", "KV credits free", count, null, [["kv_credits_total", "of ", count]]],
];
const cards = new Map();
let polls = 0;
let timer = null;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function cell(pool, metric, cls) {
  const e = el("span", cls);
  e.dataset.pool = pool;
  e.dataset.metric = metric;
  return e;
}

function show(e, v, fmt, prefix) {
  e.dataset.value = v === null || v === undefined ? "" : String(v);
  e.textContent = (prefix || "") + (v === null || v === undefined ? "\\u2014" : fmt(v));
}

function card(pool) {
  const root = el("section", "pool");
  root.dataset.pool = pool;
  const head = el("div", "pool-head");
  head.append(el("h2", "", pool), cell(pool, "death_spiral", "badge"));
  const tiles = el("div", "tiles");
  for (const [metric, label, fmt, top, subs] of TILES) {
    const tile = el("div", "tile");
    const row = el("div", "row");
    row.append(el("span", "label", label));
    const subline = el("span", "sub");
    for (const [m] of subs) subline.append(cell(pool, m));
    row.append(subline);
    tile.append(row, cell(pool, metric, "value"));
    if (metric === "kv_cache_usage_perc") {
      const bar = el("div", "bar");
      bar.append(el("div", "fill"));
      tile.append(bar);
    }
    const spark = el("div", "spark-box");
    spark.innerHTML = '<svg class="spark" viewBox="0 0 100 30" preserveAspectRatio="none"></svg>' +
      '<div class="axis"><span class="since"></span><span class="peak"></span></div>';
    tile.append(spark);
    tiles.append(tile);
  }
  root.append(head, tiles);
  document.getElementById("pools").append(root);
  return root;
}

function sparkline(box, ages, values, span, top, fmt) {
  const shown = values.filter(v => v !== null);
  const peak = shown.length ? Math.max(...shown) : null;
  box.querySelector(".peak").textContent = peak === null ? "" : "max " + fmt(peak);
  box.querySelector(".since").textContent = "\u2212" + span.toFixed(0) + " s";
  const hi = Math.max(top || 0, peak || 0) || 1;
  const svg = box.querySelector("svg");
  const lines = ['<line x1="0" y1="29" x2="100" y2="29"></line>'];
  let points = [];
  const flush = () => {
    if (points.length === 1) points.push([points[0][0] - 0.5, points[0][1]]);   // one poll: a dash
    if (points.length) lines.push('<polyline points="' + points.map(p => p.join(",")).join(" ") + '"></polyline>');
    points = [];
  };
  values.forEach((v, i) => {
    if (v === null) { flush(); return; }
    const x = 100 * (1 - Math.min(ages[i], span) / span);
    points.push([x.toFixed(2), (28 - 26 * v / hi).toFixed(2)]);
  });
  flush();
  svg.innerHTML = lines.join("");
}

function render(body) {
  const span = Math.max(10, Math.min(body.history_seconds, Math.max(...Object.values(body.pools)
    .map(p => p.series.age_seconds[0] || 0))));
  for (const [pool, p] of Object.entries(body.pools)) {
    const root = cards.get(pool) || cards.set(pool, card(pool)).get(pool);
    for (const e of root.querySelectorAll("[data-metric]")) {
      const metric = e.dataset.metric;
      if (metric === "death_spiral") continue;
      const tile = TILES.find(t => t[0] === metric);
      const sub = TILES.flatMap(t => t[4]).find(s => s[0] === metric);
      if (tile) show(e, p[metric], tile[2]);
      else if (sub) show(e, p[metric], sub[2], sub[1]);
    }
    const spiral = root.querySelector('[data-metric="death_spiral"]');
    const s = p.death_spiral;
    show(spiral, s, v => v >= 1 ? "DEATH SPIRAL" : "no death spiral");
    if (s === null || s === undefined) spiral.textContent = "death spiral: not watched";
    spiral.className = "badge" + (s >= 1 ? " bad" : s === 0 ? " ok" : "");
    root.classList.toggle("spiral", s >= 1);
    const kv = p.kv_cache_usage_perc;
    const fill = root.querySelector(".fill");
    fill.style.width = kv === null ? "0" : (100 * Math.min(1, kv)).toFixed(1) + "%";
    fill.className = "fill" + (kv >= 0.95 ? " bad" : kv >= 0.8 ? " warn" : "");
    const boxes = root.querySelectorAll(".spark-box");
    TILES.forEach((t, i) => sparkline(boxes[i], p.series.age_seconds, p.series[t[0]], span, t[3], t[2]));
  }
  polls += 1;
  const ages = Object.values(body.stats_age_seconds);
  const age = ages.length ? " \\u00b7 engine stats " + Math.max(...ages).toFixed(1) + " s old" : "";
  status("ok", "updated " + new Date(body.time * 1000).toLocaleTimeString() + " \\u00b7 rates and p99 over " +
    body.window_seconds.toFixed(0) + " s" + age + " \\u00b7 history " + span.toFixed(0) + " s");
  document.body.dataset.time = String(body.time);
  document.getElementById("notes").innerHTML = "";
  document.getElementById("notes").append(notes(body));
}

function notes(body) {
  const p = el("p");
  p.textContent = "Every number is read from the gateway's own metrics registry, the one /metrics renders, " +
    "polled every " + body.poll_seconds + " s. p" + Math.round(100 * body.quantile) + ": the increase of each " +
    "histogram bucket over the last " + body.window_target_seconds + " s (less while the history is shorter), " +
    "interpolated linearly inside the bucket that holds the percentile, as Prometheus's histogram_quantile " +
    "does; n is how many observations the window held. Preemptions: the increase of " +
    "cliffguard_num_preemptions_total over the same window, per second. Sparklines: the last " +
    body.history_seconds + " s of polls, kept by the gateway; each starts at 0 (KV usage: 0 to 100 %).";
  return p;
}

function status(kind, text) {
  document.body.dataset.status = kind;
  document.body.dataset.polls = String(polls);
  document.getElementById("status").textContent = text;
}

function askKey(message) {
  const form = document.getElementById("login");
  form.hidden = false;
  document.getElementById("login-msg").textContent = message;
  document.getElementById("key").focus();
}

async function poll() {
  timer = null;
  const key = sessionStorage.getItem(KEY);
  const headers = key ? {"Authorization": "Bearer " + key} : {};
  try {
    const r = await fetch("dashboard/data", {headers, cache: "no-store"});
    const body = await r.json();
    if (r.status === 401) {
      status("auth", "API key needed");
      askKey(key ? "the gateway refused this key" : "");
      return;
    }
    if (!r.ok) throw new Error(body.error ? body.error.message : "HTTP " + r.status);
    document.getElementById("login").hidden = true;
    render(body);
    timer = setTimeout(poll, 1000 * body.poll_seconds);
  } catch (err) {
    status("error", "no data: " + err.message + " (retrying)");
    timer = setTimeout(poll, 2000);
  }
}

document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("key").value.trim());
  document.getElementById("key").value = "";
  if (timer === null) poll();
});

const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.has("key")) {
  sessionStorage.setItem(KEY, fragment.get("key"));
  history.replaceState(null, "", location.pathname + location.search);
}
poll();
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<link rel="icon" href="data:,">
<title>cliffguard dashboard</title>
<style>{_STYLE}</style>
</head>
<body data-status="loading" data-polls="0">
<header><h1>cliffguard</h1><span class="sub">pools, live</span><span id="status">connecting</span></header>
<form id="login" hidden>
<label for="key">API key</label>
<input id="key" type="password" autocomplete="off" placeholder="the bearer key you use for the API">
<button type="submit">Open</button><span id="login-msg"></span>
</form>
<main id="pools"></main>
<footer id="notes"></footer>
<script>{_SCRIPT}</script>
</body>
</html>
"""


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
