"""The parts of `cliffguard bench chaos` that keep running while faults come and go: the run's shared
state (`Chaos`), the steady chat and rag load with its per-request records, the sampler of `/ready`
(and each replica's state in it), `/metrics` credits and the gateway's RSS, and the processes the
faults aim at (the gateway's workers, or the replicas' Ray actors on a local cluster)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.load.plan import PromptMaker
from bench.load.scrape import pool_samples
from bench.load.sender import DONE, error_message, parse_sse_line
from bench.admission import poisson_arrivals

SAMPLE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 2.0          # a /ready or /metrics probe slower than this counts as not ready
CHAT_WORDS, CHAT_TOKENS = 24, 16
RAG_WORDS, RAG_TOKENS = 256, 8
REPLICA_UP_STATES = ("ready", "draining", "stopped")   # `/ready`'s replica states that are not a fault's doing
REPLICA_ACTOR_TITLE = b"ray::ReplicaActor"            # a Ray actor process's title: `ray::<class>[.<method>]`


@dataclass(frozen=True)
class Phases:
    """Seconds of the run's parts: the load alone (`warmup_s`), then per fault its window (`fault_s`) and
    a quiet window (`quiet_s`), extended by at most `max_settle_s` until the gateway has recovered."""

    warmup_s: float = 30.0
    fault_s: float = 20.0
    quiet_s: float = 25.0
    max_settle_s: float = 60.0


# --- the run's shared state ---------------------------------------------------------------------------------

@dataclass
class Chaos:
    """What one run shares between its steady load, its sampler and its fault script: handed down to
    each, never global. Times are seconds after `start` (a `perf_counter` value). Event-loop only."""

    url: str
    model: str
    gateway_pid: int
    start: float
    load_start_s: float
    phases: Phases
    timeout: float
    session: Any                      # the steady load's ClientSession
    fault_session: Any                # the faults' own ClientSession
    sampler: Sampler
    num_burst: int = 500
    num_disconnects: int = 40
    num_silent_bodies: int = 24
    num_tenant_burst: int = 16
    cluster: Any = None               # a `bench.ray_local.LocalRayCluster` the replicas run on, or None
    counters: Any = None              # its replicas' own counters (`bench.chaos.replicas.ReplicaCounters`), or None
    steady_urls: list[str] = field(default_factory=list)   # the gateways the steady load goes to (empty: `url`)
    second_gateway: Any = None        # the second gateway's `bench.live.LiveServer` (--gateways 2), or None
    write_timeout: float = 30.0       # the served gateway's timers (faults time their checks by them)
    stall_seconds: float = 10.0
    paused: bool = False              # a fault needs the worker idle: planned requests are not sent meanwhile
    num_unsent: int = 0               # ... and are counted here (the fault's note says how many)
    records: list[SteadyRecord] = field(default_factory=list)

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.perf_counter() - self.start

    def chat_ok(self) -> list[tuple[float, float]]:
        """(sent, end) of the steady chat requests that completed so far."""
        return [(r.sent_s, r.end_s) for r in self.records if r.kind == "chat" and r.outcome == "ok"]

    def worker_pids(self) -> list[int]:
        """The device workers' pids: the gateway's own (`worker_pids`), or on a local Ray cluster the
        replicas' actors on every node (`replica_pids`), in pid order."""
        if self.cluster is None:
            return worker_pids(self.gateway_pid)
        return sorted(pid for pids in replica_pids(self.cluster).values() for pid in pids)

# --- the steady load ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planned:
    """A steady-load request decided before the run: its id, when it is sent, where, and its body."""

    rid: str
    kind: str                    # chat | rag
    arrival_s: float             # seconds after the load starts
    path: str
    body: dict[str, Any]


def plan_steady(model: str, chat_rate: float, rag_rate: float, duration: float, seed: int) -> list[Planned]:
    """The steady load's requests in arrival order: Poisson chat and rag-ish arrivals over `duration` s,
    each with a unique id in `user` and at the head of its prompt."""
    maker = PromptMaker()
    events = [(t, "chat") for t in poisson_arrivals(chat_rate, duration, seed)]
    if rag_rate > 0:
        events += [(t, "rag") for t in poisson_arrivals(rag_rate, duration, seed + 1)]
    plan = []
    for i, (t, kind) in enumerate(sorted(events)):
        rid = f"chaos-{seed}-{i:05d}"
        rng = random.Random(f"{seed}:{rid}")
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                                "ignore_eos": True, "temperature": 0, "user": rid}
        if kind == "chat":
            text = f"request {rid}: {maker.make(rng, CHAT_WORDS, chat=True)}"
            body.update(messages=[{"role": "user", "content": text}], max_tokens=CHAT_TOKENS)
            path = "/v1/chat/completions"
        else:
            body.update(prompt=f"request {rid}: {maker.make(rng, RAG_WORDS, chat=False)}", max_tokens=RAG_TOKENS)
            path = "/v1/completions"
        plan.append(Planned(rid, kind, t, path, body))
    return plan


@dataclass
class StreamTally:
    """What one SSE stream held. `answers` counts the complete answers in it: normally 1; 0 when it
    ended with no `[DONE]`, error event or finish reason; more than 1 when one request was answered
    twice (two `[DONE]`s, a choice finished twice, two usage chunks, two completion ids)."""

    num_done: int = 0
    num_errors: int = 0
    num_usage: int = 0
    ids: set[str] = field(default_factory=set)
    finishes: Counter = field(default_factory=Counter)    # choice index -> finish reasons seen
    first_content_s: float | None = None
    error: str | None = None

    def add(self, event: Any, t: float) -> None:
        """Count one parsed SSE line (`parse_sse_line`) that arrived `t` s after the request was sent."""
        if event is None:
            return
        if event == DONE:
            self.num_done += 1
            return
        if not isinstance(event, dict):
            raise ValueError(f"stream event is not a JSON object: {str(event)[:200]}")
        if event.get("error") is not None:
            self.num_errors += 1
            self.error = "error event: " + error_message(event)
            return
        if event.get("id"):
            self.ids.add(event["id"])
        if event.get("usage"):
            self.num_usage += 1
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if (choice.get("text") or delta.get("content")) and self.first_content_s is None:
                self.first_content_s = t
            if choice.get("finish_reason"):
                self.finishes[choice.get("index", 0)] += 1

    @property
    def answers(self) -> int:
        """How many complete answers the stream held (see the class)."""
        if not (self.num_done or self.num_errors or self.finishes):
            return 0
        return max(self.num_done, self.num_errors, self.num_usage, len(self.ids),
                   max(self.finishes.values(), default=0))


@dataclass
class SteadyRecord:
    """One steady-load request. Times in seconds from the run's start (`sent_s`: its planned arrival;
    `ttft_s`: from it, a late send's lag `lag_s` included, as a client that was due then waits it).
    `outcome`: ok | error (an error status or error event: answered) | cut | lost | unsent."""

    rid: str
    kind: str
    sent_s: float | None = None
    end_s: float | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    answers: int = 0
    outcome: str = "unsent"
    error: str | None = None
    gateway: int = 0             # the gateway (index in `Chaos.steady_urls`) of its last attempt
    retried: bool = False        # its first gateway failed before a token: sent again to the next one
    lag_s: float = 0.0           # how late it was sent (the load's loop busy with the faults' clients)

    def finish(self, tally: StreamTally | None, timed_out: bool) -> None:
        """Classify the request from its HTTP status and what its stream held (`tally`; None when the
        answer was not a stream)."""
        if tally is not None:
            self.answers, self.ttft_s = tally.answers, tally.first_content_s
            self.error = tally.error or self.error
        elif self.http_status is not None:
            self.answers = 1
        if self.http_status is None or (timed_out and self.answers == 0):
            self.outcome = "lost"
        elif self.http_status != 200:
            self.outcome = "error"
        elif self.answers == 0:
            self.outcome = "cut"
        else:
            self.outcome = "error" if tally is not None and tally.num_errors else "ok"


async def read_stream(response: Any, tally: StreamTally, sent: float) -> None:
    """Feed every line of an SSE response to `tally` until the connection's body ends (not at the first
    `[DONE]`: whatever follows it would be a second answer)."""
    buffer = b""
    async for data in response.content.iter_any():
        now = time.perf_counter() - sent
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            tally.add(parse_sse_line(line), now)


async def _attempt(ctx: Chaos, url: str, planned: Planned, record: SteadyRecord,
                   sent: float) -> tuple[StreamTally | None, bool]:
    """One try of a steady request at the gateway `url`: (its stream's tally, None when no stream; whether
    it timed out), its status and error in `record`."""
    import aiohttp

    tally, timed_out = None, False
    record.http_status = record.error = None
    try:
        async with asyncio.timeout(ctx.timeout):
            async with ctx.session.post(url + planned.path, json=planned.body) as response:
                record.http_status = response.status
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {error_message(await response.text(errors='replace'))}"
                    return None, False
                tally = StreamTally()
                await read_stream(response, tally, sent)
    except TimeoutError:
        timed_out, record.error = True, f"timeout: no end within {ctx.timeout:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return tally, timed_out


def gateway_failed(record: SteadyRecord, tally: StreamTally | None, timed_out: bool) -> bool:
    """The gateway failed the request before any token: no answer at all (the connection refused or
    dropped), or a stream that ended with neither an answer nor a first token. A load balancer sends such
    a request to another gateway; an answer (an error status included) or a timeout it does not."""
    if timed_out:
        return False
    if record.http_status is None:
        return True
    return tally is not None and tally.answers == 0 and tally.first_content_s is None


async def send_steady(ctx: Chaos, planned: Planned, record: SteadyRecord, gateway: int = 0) -> None:
    """Send one steady request to gateway `gateway` of `ctx.steady_urls` (or `ctx.url`) and classify its
    answer into `record`; one that gateway failed before any token (`gateway_failed`) is sent once more, to
    the next gateway, as a load balancer would. TTFT counts from its planned arrival (`SteadyRecord`). Never
    raises (but cancellation)."""
    urls = ctx.steady_urls or [ctx.url]
    sent = ctx.start + ctx.load_start_s + planned.arrival_s
    record.sent_s, record.lag_s = sent - ctx.start, max(0.0, time.perf_counter() - sent)
    tally, timed_out = None, False
    try:
        for attempt in range(min(2, len(urls))):
            record.gateway, record.retried = (gateway + attempt) % len(urls), attempt > 0
            tally, timed_out = await _attempt(ctx, urls[record.gateway], planned, record, sent)
            if not gateway_failed(record, tally, timed_out):
                break
    finally:
        record.end_s = time.perf_counter() - ctx.start
        record.finish(tally, timed_out)


async def run_steady(ctx: Chaos, plan: Sequence[Planned], stop: asyncio.Event) -> None:
    """Send each planned request at its arrival time (open loop) until `stop`, then wait for those in
    flight (each ends by its own timeout)."""
    tasks = []
    for planned in plan:
        delay = ctx.start + ctx.load_start_s + planned.arrival_s - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
        if stop.is_set():
            break
        if ctx.paused:
            ctx.num_unsent += 1
            continue
        record = SteadyRecord(planned.rid, planned.kind)
        ctx.records.append(record)
        gateway = (len(ctx.records) - 1) % max(1, len(ctx.steady_urls))   # spread over the gateways in turn
        tasks.append(asyncio.create_task(send_steady(ctx, planned, record, gateway)))
    await asyncio.gather(*tasks)


# --- the sampler ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One look at the gateway `t_s` s after the start: /ready (200 or not, and how long it took; None:
    no answer within `PROBE_TIMEOUT_S`), pool -> (free, total) KV credits, the gateway's RSS in bytes,
    and device -> its replicas' states as /ready listed them (empty: no answer)."""

    t_s: float
    ready: bool
    ready_s: float | None
    credits: dict[str, tuple[float, float]]
    rss_bytes: int | None
    replicas: dict[str, list[str]] = field(default_factory=dict)

    @property
    def credits_full(self) -> bool:
        """Every pool's credits are free (and /metrics named at least one pool)."""
        return bool(self.credits) and all(free == total for free, total in self.credits.values())

    @property
    def replicas_up(self) -> bool:
        """No replica is loading, restarting or failed (true when /ready listed none)."""
        return all(state in REPLICA_UP_STATES for states in self.replicas.values() for state in states)


def parse_credits(text: str) -> dict[str, tuple[float, float]]:
    """Prometheus text -> pool -> (free, total) of `cliffguard_kv_credits_free` / `cliffguard_kv_credits`."""
    names = ("cliffguard_kv_credits_free", "cliffguard_kv_credits")
    return {pool: (v[names[0]], v[names[1]]) for pool, v in pool_samples(text).items() if set(names) <= set(v)}


def parse_replicas(text: str) -> dict[str, list[str]]:
    """/ready's body -> device -> its replicas' states (empty when the body is not /ready's JSON)."""
    try:
        replicas = json.loads(text).get("replicas")
    except (ValueError, AttributeError):
        return {}
    return {str(d): [str(s) for s in states] for d, states in replicas.items()} if isinstance(replicas, dict) else {}


def rss_bytes(pid: int) -> int | None:
    """VmRSS of process `pid` in bytes (None when it is gone)."""
    try:
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class Sampler:
    """Samples the gateway every `interval` s (`Sample`) until told to stop. Uses its own session, so a
    burst of client connections does not queue its probes. Event-loop only."""

    def __init__(self, url: str, gateway_pid: int, start: float, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.url, self.gateway_pid, self.start, self.interval = url, gateway_pid, start, interval
        self.samples: list[Sample] = []

    async def _get(self, session: Any, path: str) -> tuple[int | None, str, float]:
        import aiohttp

        began = time.perf_counter()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                async with session.get(self.url + path) as response:
                    return response.status, await response.text(errors="replace"), time.perf_counter() - began
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None, "", time.perf_counter() - began

    async def sample_once(self, session: Any) -> Sample:
        """Probe /ready and /metrics at once, read the RSS, record and return the sample."""
        t_s = time.perf_counter() - self.start
        (ready, body, ready_s), (status, text, _) = await asyncio.gather(self._get(session, "/ready"),
                                                                         self._get(session, "/metrics"))
        try:
            credits = parse_credits(text) if status == 200 else {}
        except ValueError:
            credits = {}
        sample = Sample(t_s, ready == 200, ready_s if ready is not None else None, credits,
                        rss_bytes(self.gateway_pid), parse_replicas(body))
        self.samples.append(sample)
        return sample

    async def run(self, session: Any, stop: asyncio.Event) -> None:
        """Sample on a fixed schedule until `stop` is set (a slow probe delays only the next sample)."""
        next_at = time.perf_counter()
        while not stop.is_set():
            await self.sample_once(session)
            next_at = max(next_at + self.interval, time.perf_counter())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.perf_counter())
            except TimeoutError:
                pass


# --- processes ------------------------------------------------------------------------------------------

def child_pids(parent_pid: int, wanted: Callable[[bytes], bool]) -> list[int]:
    """The pids of `parent_pid`'s live (not zombie) children whose command line `wanted` accepts, in
    pid order."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state_ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(state_ppid[1]) != parent_pid or state_ppid[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if wanted(cmdline):
            pids.append(int(entry.name))
    return sorted(pids)


def worker_pids(gateway_pid: int) -> list[int]:
    """The device workers' pids, one per replica, in pid order: the children of the gateway's fork server
    (`engine.client` forks every worker from it), or the gateway's children that run multiprocessing's
    `spawn_main` (a worker spawned: not its resource tracker)."""
    servers = child_pids(gateway_pid, lambda cmdline: b"multiprocessing.forkserver" in cmdline)
    spawned = child_pids(gateway_pid, lambda cmdline: b"spawn_main" in cmdline and b"resource_tracker" not in cmdline)
    return sorted([pid for server in servers for pid in child_pids(server, lambda _: True)] + spawned)


def replica_pids(cluster: Any) -> dict[str, list[int]]:
    """Node id -> the pids of the replicas' Ray actors on that node of a local cluster (`cluster`, a
    `bench.ray_local.LocalRayCluster`): its raylet's children titled `ray::ReplicaActor`."""
    return {node: child_pids(raylet, lambda cmdline: cmdline.startswith(REPLICA_ACTOR_TITLE))
            for node, raylet in cluster.raylet_pids().items()}


def worker_pid(gateway_pid: int) -> int | None:
    """A device worker's pid (the first of `worker_pids`); None when there is none (e.g. while it restarts)."""
    pids = worker_pids(gateway_pid)
    return pids[0] if pids else None


def is_running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def send_signal(pid: int, sig: int) -> bool:
    """`kill(pid, sig)`; False when the process is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
