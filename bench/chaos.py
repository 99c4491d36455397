"""`cliffguard bench chaos`: does the gateway lose, duplicate or stall requests while things go wrong?

Starts `cliffguard serve` (`LiveServer`) on `--config` (default: config/pools.yaml, in a temporary copy
with the gateway's fault timers shortened: `write_timeout` 3 s, `stall_seconds` 6 s, restart back-off
from 0.2 s) and drives it over HTTP with a steady open-loop load: short streamed chat requests as a
Poisson process (`--rate`, 16 output tokens) and a few longer rag-ish completion prompts (`--rag-rate`,
~256 prompt tokens). Every steady request carries a unique id (in `user` and in its prompt); each
stream is read to its end and its answers counted: `[DONE]`s, error events, finish reasons per choice,
usage chunks and distinct completion ids. Meanwhile a fault script runs the faults one after another,
each in its own window (`--fault-seconds`), then a quiet window (`--quiet-seconds`, extended by at most
`max_settle_s` until the gateway has recovered):

1. `slow_readers`: streams with large outputs (n = 28, 8, 4; 20 top logprobs) on raw sockets with a
   4 KiB receive buffer whose client never reads; closed at the end of the window.
2. `disconnects`: streamed chat requests whose client goes away: before the answer, right after the
   headers, or after 1-3 content chunks.
3. `oversized`: a 3000-entry prompt list, 980k `stop_token_ids`, 200k empty chat messages, n = 64;
   each must be a 400 within `OVERSIZED_LIMIT_S`.
4. `kill_worker`: `kill -9` of the device worker (the gateway's child running multiprocessing's
   `spawn_main`).
5. `stop_worker`: `kill -STOP` of the worker; the watchdog should kill it after `stall_seconds` and
   restart it. SIGCONT is sent at the end of the window (or on any way out).
6. `burst`: `--burst` (500) small completions at once, each on its own connection.

A sampler reads, every 0.25 s, `/ready`, each pool's KV credits (`cliffguard_kv_credits_free` /
`_total` from /metrics) and the gateway process's RSS (VmRSS). Steady requests are counted by the
window they were sent in: `answered` = an HTTP answer (200 with a complete stream, or an error status
or error event), `lost` = none (no response, or the client's `--timeout`), `cut` = a 200 whose stream
ended with no `[DONE]`, error or finish, `duplicated` = more than one answer for one id. A fault's
recovery time runs from its start to the first sample, after the fault was injected, at which
`/ready` is 200, every pool's credits are full and a steady chat request sent after the injection has
completed. Goal: 0 lost, 0 duplicated, every fault recovered within 15 s.

`--quick` shortens every window (the run takes 2-3 minutes on a 2-core CPU), for a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.admission import poisson_arrivals
from bench.live import REPO, LiveServer
from bench.serve import DONE, PromptMaker, error_message, parse_sse_line
from bench.simulate import _out_dir
from pools.workload import latency_stats

DEFAULT_CONFIG = REPO / "config" / "pools.yaml"
FAULT_TIMERS = {"write_timeout": 3.0, "stall_seconds": 6.0,
                "restart_backoff": {"initial_seconds": 0.2, "factor": 2, "max_seconds": 2, "reset_after_seconds": 60}}
GOAL_RECOVERY_S = 15.0
SAMPLE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 2.0          # a /ready or /metrics probe slower than this counts as not ready
IDLE_S = 2.0                   # the sampler alone before the load starts: the gateway's idle RSS
OVERSIZED_LIMIT_S = 5.0        # each oversized request must be refused within this
CHAT_WORDS, CHAT_TOKENS = 24, 16
RAG_WORDS, RAG_TOKENS = 256, 8
SLOW_READER_NS = (28, 8, 4)
OUTCOMES = ("ok", "error", "cut", "lost")


@dataclass(frozen=True)
class Phases:
    """Seconds of the run's parts: the load alone (`warmup_s`), then per fault its window (`fault_s`) and
    a quiet window (`quiet_s`), extended by at most `max_settle_s` until the gateway has recovered."""

    warmup_s: float = 30.0
    fault_s: float = 20.0
    quiet_s: float = 25.0
    max_settle_s: float = 60.0


QUICK = Phases(warmup_s=8.0, fault_s=8.0, quiet_s=10.0, max_settle_s=25.0)


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
    """One steady-load request. Times in seconds from the run's start (`ttft_s`: from its send).
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


async def send_steady(ctx: Chaos, planned: Planned, record: SteadyRecord) -> None:
    """Send one steady request and classify its answer into `record`; never raises (but cancellation)."""
    import aiohttp

    sent = time.perf_counter()
    record.sent_s = sent - ctx.start
    tally, timed_out = None, False
    try:
        async with asyncio.timeout(ctx.timeout):
            async with ctx.session.post(ctx.url + planned.path, json=planned.body) as response:
                record.http_status = response.status
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {error_message(await response.text(errors='replace'))}"
                    return
                tally = StreamTally()
                await read_stream(response, tally, sent)
    except TimeoutError:
        timed_out, record.error = True, f"timeout: no end within {ctx.timeout:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
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
        record = SteadyRecord(planned.rid, planned.kind)
        ctx.records.append(record)
        tasks.append(asyncio.create_task(send_steady(ctx, planned, record)))
    await asyncio.gather(*tasks)


# --- the sampler ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One look at the gateway `t_s` s after the start: /ready (200 or not, and how long it took; None:
    no answer within `PROBE_TIMEOUT_S`), pool -> (free, total) KV credits, the gateway's RSS in bytes."""

    t_s: float
    ready: bool
    ready_s: float | None
    credits: dict[str, tuple[float, float]]
    rss_bytes: int | None

    @property
    def credits_full(self) -> bool:
        """Every pool's credits are free (and /metrics named at least one pool)."""
        return bool(self.credits) and all(free == total for free, total in self.credits.values())


def parse_credits(text: str) -> dict[str, tuple[float, float]]:
    """Prometheus text -> pool -> (free, total) of `cliffguard_kv_credits_free` / `_total`."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("cliffguard_kv_credits_free", "cliffguard_kv_credits_total"):
                found.setdefault(sample.labels.get("pool", ""), {})[sample.name.rsplit("_", 1)[1]] = sample.value
    return {pool: (v["free"], v["total"]) for pool, v in found.items() if {"free", "total"} <= set(v)}


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
        (ready, _, ready_s), (status, text, _) = await asyncio.gather(self._get(session, "/ready"),
                                                                      self._get(session, "/metrics"))
        try:
            credits = parse_credits(text) if status == 200 else {}
        except ValueError:
            credits = {}
        sample = Sample(t_s, ready == 200, ready_s if ready is not None else None, credits,
                        rss_bytes(self.gateway_pid))
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

def worker_pid(gateway_pid: int) -> int | None:
    """The device worker's pid: the gateway's child that runs multiprocessing's `spawn_main` (not its
    resource tracker); None when there is none (e.g. while it restarts)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state_ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes() if int(state_ppid[1]) == gateway_pid else b""
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline and state_ppid[0] != "Z":
            return int(entry.name)
    return None


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


# --- the run's shared state and the faults ---------------------------------------------------------------

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
    records: list[SteadyRecord] = field(default_factory=list)

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.perf_counter() - self.start

    def chat_ok(self) -> list[tuple[float, float]]:
        """(sent, end) of the steady chat requests that completed so far."""
        return [(r.sent_s, r.end_s) for r in self.records if r.kind == "chat" and r.outcome == "ok"]


@dataclass
class Shot:
    """One request of a fault that expects an answer: its HTTP status (None: none came) and timing."""

    label: str
    sent_s: float
    end_s: float | None = None
    status: int | None = None
    error: str | None = None

    @property
    def seconds(self) -> float | None:
        """How long the answer took (None: no answer yet)."""
        return None if self.end_s is None else self.end_s - self.sent_s


@dataclass
class FaultRun:
    """One fault as it ran: its window's times (s after the start), its own requests and notes."""

    name: str
    start_s: float
    injected_s: float | None = None   # the fault's actions are done (the effects may last)
    end_s: float | None = None        # end of the fault window
    window_end_s: float | None = None  # end of the quiet window after it: the next fault starts
    shots: list[Shot] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


async def sleep_until(ctx: Chaos, t_s: float) -> None:
    """Sleep until `t_s` s after the run's start."""
    delay = t_s - ctx.now()
    if delay > 0:
        await asyncio.sleep(delay)


async def shoot(ctx: Chaos, session: Any, shot: Shot, path: str, data: bytes, leave_after: int | None = None) -> None:
    """POST `data` (JSON) and record the answer's status into `shot`; a failure is recorded, not raised.
    `leave_after`: read that many pieces of the body after the headers, then drop the connection."""
    import aiohttp

    try:
        async with asyncio.timeout(ctx.timeout):
            async with session.post(ctx.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                shot.status = r.status
                if leave_after is not None:
                    for _ in range(leave_after):
                        if not await r.content.readany():
                            break
                    r.close()                      # drops the connection mid-stream
                elif r.status != 200:
                    shot.error = error_message(await r.text(errors="replace"), limit=160)
                else:
                    await r.read()
    except TimeoutError:
        shot.error = f"timeout: no answer within {ctx.timeout:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        shot.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        shot.end_s = ctx.now()


def silent_socket(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw socket with a 4 KiB receive buffer that sent a POST and will never read the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


async def slow_readers(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """Streams with large outputs whose client never reads, held open until the window ends."""
    socks: list[socket.socket] = []
    try:
        for n in SLOW_READER_NS:
            body = {"model": ctx.model, "messages": [{"role": "user", "content": "Write a long story."}], "n": n,
                    "max_tokens": 1000, "logprobs": True, "top_logprobs": 20, "stream": True, "temperature": 1.0}
            socks.append(await asyncio.to_thread(silent_socket, ctx.url, "/v1/chat/completions", body))
        run.injected_s = ctx.now()
        run.notes["silent_streams"] = list(SLOW_READER_NS)
        await sleep_until(ctx, until_s)
    finally:
        for sock in socks:
            sock.close()


async def _disconnect_one(ctx: Chaos, i: int, shot: Shot) -> str:
    """One streamed request whose client leaves: before the answer (i % 4 == 0), right after the
    headers (1), or after 1-2 pieces of the stream (2, 3). Returns how it left."""
    data = json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": f"Tell me a long story, {i}."}],
                       "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    if i % 4 == 0:
        task = asyncio.ensure_future(shoot(ctx, ctx.fault_session, shot, "/v1/chat/completions", data, 0))
        await asyncio.sleep(0.05)
        task.cancel()                              # aiohttp closes the connection of a cancelled request
        await asyncio.gather(task, return_exceptions=True)
        return "before the answer" if shot.status is None else "right after the headers"
    await shoot(ctx, ctx.fault_session, shot, "/v1/chat/completions", data, leave_after=i % 4 - 1)
    return "right after the headers" if i % 4 == 1 else "mid-stream"


async def disconnects(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`num_disconnects` streamed requests over about 2 s whose clients go away early."""
    async def one(i: int) -> str:
        await asyncio.sleep(2.0 * i / ctx.num_disconnects)
        shot = Shot(f"disconnect {i}", ctx.now())
        if i % 4:
            run.shots.append(shot)             # those that wait for the headers expect an answer
        return await _disconnect_one(ctx, i, shot)

    how = await asyncio.gather(*(one(i) for i in range(ctx.num_disconnects)))
    run.injected_s = ctx.now()
    run.notes["left"] = dict(Counter(how))
    await sleep_until(ctx, until_s)


def oversized_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(label, path, JSON body) of the requests every gateway limit must refuse with a 400."""
    bodies = [("prompt list of 3000", "/v1/completions", {"model": model, "prompt": ["hi"] * 3000, "max_tokens": 1}),
              ("980k stop_token_ids", "/v1/completions", {"model": model, "prompt": "Hello", "n": 8, "min_tokens": 64,
                                                          "max_tokens": 64, "stop_token_ids": list(range(980_000))}),
              ("200k empty messages", "/v1/chat/completions",
               {"model": model, "messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 8}),
              ("n=64", "/v1/completions", {"model": model, "prompt": "Hi", "n": 64, "max_tokens": 8})]
    return [(label, path, json.dumps(body).encode()) for label, path, body in bodies]


async def oversized(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """The oversized requests at once; each should be a 400 within `OVERSIZED_LIMIT_S`."""
    bodies = await asyncio.to_thread(oversized_bodies, ctx.model)
    shots = [Shot(label, ctx.now()) for label, _, _ in bodies]
    run.shots += shots
    await asyncio.gather(*(shoot(ctx, ctx.fault_session, shot, path, data)
                           for shot, (_, path, data) in zip(shots, bodies)))
    run.injected_s = ctx.now()
    run.notes["refused_in_time"] = {s.label: s.status == 400 and s.seconds < OVERSIZED_LIMIT_S for s in shots}
    await sleep_until(ctx, until_s)


async def kill_worker(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`kill -9` of the device worker."""
    pid = worker_pid(ctx.gateway_pid)
    run.notes["pid"] = pid
    if pid is not None:
        send_signal(pid, signal.SIGKILL)
    run.injected_s = ctx.now()
    await sleep_until(ctx, until_s)
    run.notes["new_pid"] = worker_pid(ctx.gateway_pid)


async def stop_worker(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`kill -STOP` of the device worker; notes when the watchdog killed it; SIGCONT when the window ends."""
    pid = worker_pid(ctx.gateway_pid)
    run.notes["pid"] = pid
    if pid is None:
        run.injected_s = ctx.now()
        await sleep_until(ctx, until_s)
        return
    send_signal(pid, signal.SIGSTOP)
    run.injected_s = ctx.now()
    try:
        while ctx.now() < until_s and is_running(pid):
            await asyncio.sleep(0.1)
        if not is_running(pid):
            run.notes["killed_after_s"] = round(ctx.now() - run.injected_s, 2)
        await sleep_until(ctx, until_s)
    finally:
        run.notes["resumed"] = send_signal(pid, signal.SIGCONT) and is_running(pid)
        run.notes["new_pid"] = worker_pid(ctx.gateway_pid)


async def burst(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`num_burst` small completions at once, each on a new connection; injected once all are sent."""
    import aiohttp

    sent, all_sent = [0], asyncio.Event()

    async def on_sent(*_: Any) -> None:
        sent[0] += 1
        if sent[0] >= ctx.num_burst:
            all_sent.set()

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(on_sent)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
        shots = [Shot(f"burst {i}", ctx.now()) for i in range(ctx.num_burst)]
        run.shots += shots
        data = [json.dumps({"model": ctx.model, "prompt": f"Burst request {i}: say yes.", "max_tokens": 2,
                            "user": f"burst-{i}"}).encode() for i in range(ctx.num_burst)]
        tasks = [asyncio.create_task(shoot(ctx, session, s, "/v1/completions", d)) for s, d in zip(shots, data)]
        try:
            await asyncio.wait_for(all_sent.wait(), max(0.1, until_s - ctx.now()))
        except TimeoutError:
            run.notes["not_sent_in_window"] = ctx.num_burst - sent[0]
        run.injected_s = ctx.now()
        await asyncio.gather(*tasks)
    await sleep_until(ctx, until_s)


FaultScript = Callable[[Chaos, FaultRun, float], Awaitable[None]]
FAULTS: dict[str, tuple[FaultScript, str]] = {
    "slow_readers": (slow_readers, "slow readers"),
    "disconnects": (disconnects, "client disconnects"),
    "oversized": (oversized, "oversized inputs"),
    "kill_worker": (kill_worker, "kill -9 worker"),
    "stop_worker": (stop_worker, "kill -STOP worker"),
    "burst": (burst, "burst of connections"),
}


# --- the fault script --------------------------------------------------------------------------------------

def recovery_time(samples: Sequence[Sample], chat_ok: Sequence[tuple[float, float]], start_s: float,
                  injected_s: float, end_s: float) -> float | None:
    """Seconds from a fault's start (`start_s`) to the first sample at or after `injected_s` and before
    `end_s` at which /ready was 200, every pool's credits were full, and a steady chat request sent at or
    after `injected_s` had completed (`chat_ok`: (sent, end) of the completed ones). None: not recovered."""
    first_chat = min((end for sent, end in chat_ok if sent >= injected_s), default=None)
    if first_chat is None:
        return None
    for s in samples:
        if max(injected_s, first_chat) <= s.t_s < end_s and s.ready and s.credits_full:
            return s.t_s - start_s
    return None


async def settle(ctx: Chaos, run: FaultRun, deadline_s: float) -> None:
    """Wait (until `deadline_s` at most) for the fault to have recovered and /ready to be 200 now."""
    while ctx.now() < deadline_s:
        last = ctx.sampler.samples[-1] if ctx.sampler.samples else None
        recovered = recovery_time(ctx.sampler.samples, ctx.chat_ok(), run.start_s, run.injected_s, float("inf"))
        if recovered is not None and last is not None and last.ready:
            return
        await asyncio.sleep(SAMPLE_INTERVAL_S)


async def run_faults(ctx: Chaos, names: Sequence[str], runs: list[FaultRun]) -> None:
    """After the warm-up, each fault in its window, then its quiet window (extended until it recovered)."""
    p = ctx.phases
    await sleep_until(ctx, ctx.load_start_s + p.warmup_s)
    for name in names:
        run = FaultRun(name, ctx.now())
        runs.append(run)
        print(f"bench chaos: {FAULTS[name][1]} at {run.start_s:.1f} s", file=sys.stderr, flush=True)
        try:
            await FAULTS[name][0](ctx, run, run.start_s + p.fault_s)
        except OSError as exc:             # a fault that could not be injected is reported, not fatal
            run.notes["error"] = f"{type(exc).__name__}: {exc}"
        run.injected_s = ctx.now() if run.injected_s is None else run.injected_s
        run.end_s = ctx.now()
        await sleep_until(ctx, run.end_s + p.quiet_s)
        await settle(ctx, run, run.end_s + p.quiet_s + p.max_settle_s)
        run.window_end_s = ctx.now()


async def _first_model(session: Any, url: str) -> str:
    async with session.get(url + "/v1/models") as response:
        return (await response.json(content_type=None))["data"][0]["id"]


async def chaos_run(server: LiveServer, args: argparse.Namespace, phases: Phases) -> dict[str, Any]:
    """The whole run against a started server: idle samples, then load + faults, then the drain.
    Returns the raw measurements (`build_report` summarizes them)."""
    import aiohttp

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))

    async with session() as steady, session() as faults, session() as probes:
        model = await _first_model(steady, server.url)
        start = time.perf_counter()
        ctx = Chaos(server.url, model, server.proc.pid, start, IDLE_S, phases, args.timeout, steady, faults,
                    Sampler(server.url, server.proc.pid, start), num_burst=args.burst,
                    num_disconnects=args.disconnects)
        stop_sampling, stop_load = asyncio.Event(), asyncio.Event()
        sampling = asyncio.create_task(ctx.sampler.run(probes, stop_sampling))
        longest = phases.warmup_s + len(args.fault_names) * (phases.fault_s + phases.quiet_s + phases.max_settle_s)
        load = asyncio.create_task(run_steady(ctx, plan_steady(model, args.rate, args.rag_rate, longest + 60,
                                                               args.seed), stop_load))
        runs: list[FaultRun] = []
        try:
            await run_faults(ctx, args.fault_names, runs)
        finally:
            stop_load.set()
            load_end_s = ctx.now()
            await load
            stop_sampling.set()
            await sampling
    return {"model": model, "records": ctx.records, "runs": runs, "samples": ctx.sampler.samples,
            "load_start_s": IDLE_S, "load_end_s": load_end_s, "duration_s": ctx.now()}


# --- the report ------------------------------------------------------------------------------------------

def account(records: Sequence[SteadyRecord], start_s: float, end_s: float) -> dict[str, int]:
    """Counts of the steady requests sent in [start_s, end_s): sent, answered (ok + error), each outcome,
    and duplicated (answered more than once)."""
    sent = [r for r in records if r.sent_s is not None and start_s <= r.sent_s < end_s]
    counts = Counter(r.outcome for r in sent)
    return {"sent": len(sent), "answered": counts["ok"] + counts["error"], **{o: counts[o] for o in OUTCOMES},
            "duplicated": sum(r.answers > 1 for r in sent)}


def window_ttft_p99(records: Sequence[SteadyRecord], start_s: float, end_s: float) -> float | None:
    """p99 TTFT (s) of the steady chat requests sent in [start_s, end_s) that got a first token."""
    ttfts = [r.ttft_s for r in records if r.kind == "chat" and r.ttft_s is not None
             and r.sent_s is not None and start_s <= r.sent_s < end_s]
    return latency_stats(ttfts)["p99"]


def shot_summary(shots: Sequence[Shot]) -> dict[str, Any]:
    """Counts of a fault's own requests: sent, answered, lost, statuses, slowest answer (s)."""
    answered = [s for s in shots if s.status is not None]
    return {"sent": len(shots), "answered": len(answered), "lost": len(shots) - len(answered),
            "statuses": dict(Counter(str(s.status) for s in answered)),
            "max_s": max((s.seconds for s in answered), default=None),
            "errors": dict(Counter(s.error for s in shots if s.status is None and s.error).most_common(3))}


def fault_summary(run: FaultRun, before_s: float, raw: dict[str, Any]) -> dict[str, Any]:
    """One fault's row: steady accounting over its whole window, chat TTFT p99 before / during / after,
    recovery time, the slowest /ready answer, its own traffic and notes."""
    records, samples = raw["records"], raw["samples"]
    recovery = recovery_time(samples, [(r.sent_s, r.end_s) for r in records if r.kind == "chat" and r.outcome == "ok"],
                             run.start_s, run.injected_s, run.window_end_s)
    in_window = [s for s in samples if run.start_s <= s.t_s < run.window_end_s]
    return {"name": run.name, "title": FAULTS[run.name][1], "start_s": run.start_s, "injected_s": run.injected_s,
            "end_s": run.end_s, "window_end_s": run.window_end_s, "recovery_s": recovery,
            "recovered": recovery is not None and recovery <= GOAL_RECOVERY_S,
            "steady": account(records, run.start_s, run.window_end_s),
            "ttft_p99_s": {"before": window_ttft_p99(records, before_s, run.start_s),
                           "during": window_ttft_p99(records, run.start_s, run.end_s),
                           "after": window_ttft_p99(records, run.end_s, run.window_end_s)},
            "ready_max_s": max((s.ready_s if s.ready_s is not None else PROBE_TIMEOUT_S for s in in_window),
                               default=None),
            "not_ready_samples": sum(not s.ready for s in in_window),
            "traffic": shot_summary(run.shots) if run.shots else None, "notes": run.notes}


def build_report(raw: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The report (plain JSON data) of a run's raw measurements (`chaos_run`) and what was run (`meta`)."""
    records, runs, samples = raw["records"], raw["runs"], raw["samples"]
    load_start, first = raw["load_start_s"], runs[0].start_s if runs else raw["load_end_s"]
    faults, before = [], load_start
    for run in runs:
        faults.append(fault_summary(run, before, raw))
        before = run.end_s
    steady = account(records, 0.0, float("inf"))
    traffic = shot_summary([s for run in runs for s in run.shots])
    rss = [s.rss_bytes for s in samples if s.rss_bytes is not None]
    idle = [s.rss_bytes for s in samples if s.rss_bytes is not None and s.t_s < load_start]
    verdict = {"lost": steady["lost"] + traffic["lost"] == 0, "duplicated": steady["duplicated"] == 0,
               "recovery": all(f["recovered"] for f in faults)}
    return {**meta, "model": raw["model"], "duration_s": raw["duration_s"],
            "goal": {"lost": 0, "duplicated": 0, "recovery_s": GOAL_RECOVERY_S},
            "overall": {"steady": steady, "fault_traffic": traffic,
                        "lost": steady["lost"] + traffic["lost"], "duplicated": steady["duplicated"]},
            "warmup": {"steady": account(records, load_start, first),
                       "ttft_p99_s": window_ttft_p99(records, load_start, first)},
            "faults": faults,
            "rss": {"idle_bytes": max(idle, default=None), "peak_bytes": max(rss, default=None),
                    "end_bytes": rss[-1] if rss else None},
            "verdict": {**verdict, "met": all(verdict.values())}}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def _fault_notes(fault: dict[str, Any]) -> str:
    """One line on what a fault's own traffic and notes say."""
    t, notes = fault["traffic"], fault["notes"]
    parts = [f"{k}={v}" for k, v in notes.items()]
    if t:
        own = f"own requests {t['sent']} sent, {t['answered']} answered, {t['lost']} lost, statuses {t['statuses']}"
        parts.insert(0, own + ("" if t["max_s"] is None else f", slowest {t['max_s']:.2f} s"))
    return "; ".join(parts)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table: per window steady accounting, chat TTFT p99, recovery; then totals."""
    head = (f"{'window':<22}{'sent':>6}{'answered':>9}{'lost':>6}{'cut':>5}{'dup':>5}{'errors':>7}"
            f"{'TTFT p99 ms before/during/after':>32}{'recovery':>10}")
    w = report["warmup"]
    lines = [f"bench chaos: {report['config']} ({report['timers']}); {report['date']}, commit {report['commit']}",
             f"steady load: {report['load']}; ran {report['duration_s']:.0f} s",
             f"goal: 0 lost, 0 duplicated, every fault recovered within {GOAL_RECOVERY_S:g} s", "", head,
             _row("warm-up", w["steady"], f"{_ms(w['ttft_p99_s'])}", "")]
    for i, f in enumerate(report["faults"], 1):
        p99 = "/".join(_ms(f["ttft_p99_s"][k]) for k in ("before", "during", "after"))
        rec = "never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s"
        lines.append(_row(f"{i} {f['title']}", f["steady"], p99, rec + ("" if f["recovered"] else " !")))
    o = report["overall"]
    lines += [_row("all steady", o["steady"], "", ""), "", "per fault:"]
    lines += [f"  {i} {f['title']}: {_fault_notes(f)}; /ready slowest {f['ready_max_s']:.2f} s, "
              f"{f['not_ready_samples']} samples not ready" for i, f in enumerate(report["faults"], 1)]
    t, rss, v = o["fault_traffic"], report["rss"], report["verdict"]
    lines += [f"fault traffic: {t['sent']} sent, {t['answered']} answered, {t['lost']} lost",
              f"gateway RSS: idle {_mib(rss['idle_bytes'])}, peak {_mib(rss['peak_bytes'])}, "
              f"at the end {_mib(rss['end_bytes'])}",
              f"server log: {report.get('server_log_counts', {})}", "",
              f"goal: lost {o['lost']} ({_ok(v['lost'])}), duplicated {o['duplicated']} ({_ok(v['duplicated'])}), "
              f"recovered within {GOAL_RECOVERY_S:g} s: {sum(f['recovered'] for f in report['faults'])} of "
              f"{len(report['faults'])} ({_ok(v['recovery'])}) -> {'MET' if v['met'] else 'NOT MET'}"]
    return "\n".join(lines)


def _row(name: str, c: dict[str, int], p99: str, recovery: str) -> str:
    return (f"{name:<22}{c['sent']:>6}{c['answered']:>9}{c['lost']:>6}{c['cut']:>5}{c['duplicated']:>5}"
            f"{c['error']:>7}{p99:>32}{recovery:>10}")


def _ok(flag: bool) -> str:
    return "ok" if flag else "MISSED"


def write_timeline(report: dict[str, Any], raw: dict[str, Any], path: Path) -> None:
    """PNG: chat TTFT per request over time with the fault windows shaded and recoveries marked, and the
    gateway's RSS with the moments /ready was not 200."""
    from matplotlib.figure import Figure   # lazily: only --out pays for matplotlib

    fig = Figure(figsize=(13, 7), layout="constrained")
    ttft_ax, rss_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    chat = [r for r in raw["records"] if r.kind == "chat"]
    ok = [r for r in chat if r.ttft_s is not None]
    ttft_ax.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=8, label="chat TTFT")
    failed = [r for r in chat if r.ttft_s is None]
    top = max([r.ttft_s for r in ok] + [1.0])
    ttft_ax.scatter([r.sent_s for r in failed], [top] * len(failed), marker="x", color="red", s=18,
                    label="chat without a first token")
    for f in report["faults"]:
        for ax in (ttft_ax, rss_ax):
            ax.axvspan(f["start_s"], f["end_s"], color="orange", alpha=0.2)
            if f["recovery_s"] is not None:
                ax.axvline(f["start_s"] + f["recovery_s"], color="green", linestyle="--", linewidth=1)
        ttft_ax.text(f["start_s"], top, f["title"], fontsize=8, va="bottom")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("TTFT (s), by send time")
    ttft_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    samples = raw["samples"]
    rss_ax.plot([s.t_s for s in samples], [(s.rss_bytes or 0) / 2**20 for s in samples], label="gateway RSS (MiB)")
    down = [s.t_s for s in samples if not s.ready]
    rss_ax.scatter(down, [0] * len(down), marker="|", color="red", label="/ready not 200")
    rss_ax.set_ylabel("MiB")
    rss_ax.set_xlabel("seconds since start (shaded: fault windows; dashed: recovered)")
    rss_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.suptitle(f"bench chaos: {report['date']}, commit {report['commit']}")
    fig.savefig(path, dpi=100)


def raw_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The raw measurements as JSON data: every steady request and every sample."""
    return {"requests": [asdict(r) for r in raw["records"]],
            "samples": [{**asdict(s), "credits_full": s.credits_full} for s in raw["samples"]],
            "fault_requests": {run.name: [asdict(s) for s in run.shots] for run in raw["runs"]}}


# --- the command ----------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `cliffguard bench chaos`."""
    p.add_argument("--config", default=None, help="pools YAML to serve, used as is (default: config/pools.yaml "
                   "with the gateway's fault timers shortened: write_timeout 3 s, stall_seconds 6 s, restart "
                   "back-off from 0.2 s)")
    p.add_argument("--rate", type=float, default=1.0, help="steady chat requests per second (default 1)")
    p.add_argument("--rag-rate", type=float, default=0.05, help="steady rag-ish requests per second (default 0.05)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before the first fault (default 30)")
    p.add_argument("--fault-seconds", type=float, default=None, help="seconds of each fault's window (default 20)")
    p.add_argument("--quiet-seconds", type=float, default=None, help="seconds of quiet after each fault, "
                   "extended until it recovered (default 25)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order (default all: "
                   f"{','.join(FAULTS)})")
    p.add_argument("--burst", type=int, default=500, help="connections of the burst fault (default 500)")
    p.add_argument("--disconnects", type=int, default=40, help="requests of the disconnect fault (default 40; "
                   "20 with --quick)")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request in s: later is "
                   "lost (default 120)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (default 0)")
    p.add_argument("--quick", action="store_true", help="short windows (the run takes 2-3 minutes), for a test")
    p.add_argument("--out", default=None, help="write results.json (with every request and sample) and "
                   "timeline.png here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def check_args(args: argparse.Namespace) -> Phases:
    """Validate the options (ValueError naming the option) and return the run's phases."""
    base = QUICK if args.quick else Phases()
    phases = Phases(warmup_s=base.warmup_s if args.warmup is None else args.warmup,
                    fault_s=base.fault_s if args.fault_seconds is None else args.fault_seconds,
                    quiet_s=base.quiet_s if args.quiet_seconds is None else args.quiet_seconds,
                    max_settle_s=base.max_settle_s)
    for option, value in (("--warmup", phases.warmup_s), ("--fault-seconds", phases.fault_s),
                          ("--quiet-seconds", phases.quiet_s), ("--rate", args.rate), ("--timeout", args.timeout)):
        if not value > 0:
            raise ValueError(f"{option}: must be > 0, got {value:g}")
    if not args.rag_rate >= 0:
        raise ValueError(f"--rag-rate: must be >= 0, got {args.rag_rate:g}")
    for option, value in (("--burst", args.burst), ("--disconnects", args.disconnects)):
        if value < 1:
            raise ValueError(f"{option}: must be >= 1, got {value}")
    args.fault_names = [name.strip() for name in args.faults.split(",") if name.strip()]
    unknown = [name for name in args.fault_names if name not in FAULTS]
    if unknown or not args.fault_names:
        raise ValueError(f"--faults: unknown {unknown or 'none given'}; choose from {', '.join(FAULTS)}")
    if args.config is not None and not Path(args.config).is_file():
        raise ValueError(f"--config: no such file: {args.config}")
    if args.quick and args.disconnects == 40:
        args.disconnects = 20
    return phases


def chaos_config(source: Path, folder: Path) -> Path:
    """A copy of `source` in `folder` with the gateway's fault timers shortened (`FAULT_TIMERS`)."""
    config = yaml.safe_load(source.read_text(encoding="utf-8"))
    config.setdefault("gateway", {}).update(FAULT_TIMERS)
    path = folder / "pools.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _commit() -> str:
    """The checkout's commit, `+changes` when the working tree differs from it."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _log_summary(log: Sequence[str], max_lines: int = 400) -> tuple[dict[str, int], list[str]]:
    """Counts of the server's WARNING, ERROR and CRITICAL lines and tracebacks, and those lines with each
    traceback's body (up to the next timestamped line; `max_lines` in all)."""
    counts: Counter = Counter()
    kept: list[str] = []
    in_traceback = False
    for line in log:
        level = re.search(r" (WARNING|ERROR|CRITICAL) ", line)
        in_body = in_traceback and not re.match(r"\d{4}-\d\d-\d\d |cliffguard: |loading ", line)
        if level or line.startswith("Traceback"):
            counts[level.group(1) if level else "Traceback"] += 1
            in_traceback = line.startswith("Traceback")
        elif not in_body:
            in_traceback = False
            continue
        kept.append(line.rstrip())
    return dict(counts), kept[:max_lines]


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench chaos`: 0 when the goal was met, 1 when not (2 for bad options, from the CLI)."""
    phases = check_args(args)
    out = _out_dir(args.out) if args.out else None
    date, commit = datetime.datetime.now().astimezone().isoformat(timespec="seconds"), _commit()   # what is served
    with tempfile.TemporaryDirectory(prefix="cliffguard-chaos-") as folder:
        config = Path(args.config) if args.config else chaos_config(DEFAULT_CONFIG, Path(folder))
        with LiveServer(config) as server:
            raw = asyncio.run(chaos_run(server, args, phases))
            log = list(server.log)
    timers = "its own fault timers" if args.config else (
        f"write_timeout {FAULT_TIMERS['write_timeout']:g} s, stall_seconds {FAULT_TIMERS['stall_seconds']:g} s, "
        f"restart back-off from {FAULT_TIMERS['restart_backoff']['initial_seconds']:g} s")
    counts, bad_lines = _log_summary(log)
    meta = {"config": str(args.config or DEFAULT_CONFIG.relative_to(REPO)), "timers": timers,
            "date": date, "commit": commit,
            "load": f"chat {args.rate:g} req/s ({CHAT_WORDS}-word prompts, {CHAT_TOKENS} tokens, streamed), rag-ish "
                    f"{args.rag_rate:g} req/s ({RAG_WORDS}-word prompts, {RAG_TOKENS} tokens)",
            "phases": asdict(phases), "seed": args.seed, "server_log_counts": counts}
    report = build_report(raw, meta)
    if out is not None:
        (out / "results.json").write_text(json.dumps({**report, "server_log": bad_lines, **raw_json(raw)}, indent=1)
                                          + "\n", encoding="utf-8")
        write_timeline(report, raw, out / "timeline.png")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if out is not None and not args.json:
        print(f"wrote {out / 'results.json'} and {out / 'timeline.png'}")
    return 0 if report["verdict"]["met"] else 1
