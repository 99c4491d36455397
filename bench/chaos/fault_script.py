"""The faults of `cliffguard bench chaos` (slow readers, disconnects, oversized inputs, kill -9 and
kill -STOP of the worker, a burst of connections; on a local Ray cluster, the loss of a node and the
kill -9 of a second gateway), the script that runs them one after another with quiet windows, and the
recovery time each one is measured by."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.replicas import ReplicaCounters, lease_back_s
from bench.chaos.steady import (SAMPLE_INTERVAL_S, Chaos, Phases, Sample, Sampler, is_running, plan_steady,
                                replica_pids, run_steady, send_signal)
from bench.live import LiveServer
from bench.load.sender import error_message

LEASE_BACK_GOAL_S = 2.0        # kill_gateway: its share is the survivor's "at once" (docs/SCALE.md); a step
                               # of the replica's loop and a look at its counters (every 0.25 s) fit in this
IDLE_S = 2.0                   # the sampler alone before the load starts: the gateway's idle RSS
OVERSIZED_LIMIT_S = 5.0        # each oversized request must be refused within this
SLOW_READER_NS = (28, 8, 4)


# --- the run's shared state and the faults ---------------------------------------------------------------

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
    """`kill -9` of the device worker (of one replica, when the device has several: the others serve
    meanwhile); notes when the killed one's place was taken by a new worker (`rejoined_after_s`)."""
    before = ctx.worker_pids()
    pid = before[0] if before else None
    run.notes["pid"], run.notes["workers"] = pid, len(before)
    if pid is not None:
        send_signal(pid, signal.SIGKILL)
    run.injected_s = ctx.now()
    while ctx.now() < until_s:
        now = ctx.worker_pids()
        if "rejoined_after_s" not in run.notes and len(now) == len(before) and pid not in now:
            run.notes["rejoined_after_s"] = round(ctx.now() - run.injected_s, 2)
        await asyncio.sleep(0.1)
    run.notes["new_pid"] = _first(ctx.worker_pids())


async def stop_worker(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`kill -STOP` of the device worker; notes when the watchdog killed it; SIGCONT when the window ends."""
    pid = _first(ctx.worker_pids())
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
        run.notes["new_pid"] = _first(ctx.worker_pids())


def _first(pids: Sequence[int]) -> int | None:
    return pids[0] if pids else None


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


async def lose_node(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """Remove a worker node of the local Ray cluster (`ctx.cluster`): the first one that hosts a replica's
    actor. Its raylet and the actors on it die; Ray restarts each lost actor on a node left and the
    gateway reconnects by itself. Notes: the node (id prefix, index: 0 is the head), the replica pids it
    held, how long the removal took, and when as many replica actors ran again, none of them a lost one
    (`actor_back_after_s`, from the nodes' processes; the report adds when /ready listed every replica
    ready again)."""
    cluster = ctx.cluster
    hosted = replica_pids(cluster)
    node = next((n for n in cluster.workers if hosted.get(n.node_id)), cluster.workers[-1])
    lost, num_before = hosted.get(node.node_id, []), sum(len(pids) for pids in hosted.values())
    run.notes.update(node=node.node_id[:12], node_index=cluster.nodes.index(node), replica_pids=lost,
                     num_replica_actors=num_before)
    began = ctx.now()
    await asyncio.to_thread(cluster.remove_node, node)
    run.injected_s = ctx.now()
    run.notes["removed_in_s"] = round(run.injected_s - began, 2)
    while ctx.now() < until_s:
        now = ctx.worker_pids()
        if "actor_back_after_s" not in run.notes and len(now) >= num_before and not set(lost) & set(now):
            run.notes["actor_back_after_s"] = round(ctx.now() - run.injected_s, 2)
        await asyncio.sleep(0.1)
    run.notes["replica_actors_by_node"] = {n[:12]: len(pids) for n, pids in replica_pids(cluster).items()}


async def kill_gateway(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`kill -9` of the second gateway (`ctx.second_gateway`; `--gateways 2`). Its connections to the
    replicas close at once: each replica ends its session, aborts its requests and gives its share of the
    KV credits to the survivor; the steady load sends what failed there before a token to the survivor.
    Notes: its pid, the steady requests in flight there, when every replica served the survivor alone
    with the whole of each pool leased to it (`lease_back_after_s`, from the replicas' own counters) and
    whether that was within `LEASE_BACK_GOAL_S` (`goal_met`)."""
    second = ctx.second_gateway
    pid = second.proc.pid
    in_flight = [r for r in ctx.records if r.end_s is None and r.gateway == 1]
    run.notes.update(pid=pid, steady_in_flight_there=len(in_flight))
    send_signal(pid, signal.SIGKILL)
    run.injected_s = ctx.now()
    await asyncio.to_thread(second.proc.wait, 10)      # reaped: `LiveServer.stop` then has nothing to do
    while ctx.now() < until_s:
        back = lease_back_s(ctx.counters.looks, run.injected_s) if ctx.counters is not None else None
        if back is not None:
            run.notes["lease_back_after_s"] = round(back, 2)
            break
        await asyncio.sleep(0.1)
    run.notes["goal_met"] = run.notes.get("lease_back_after_s", math.inf) <= LEASE_BACK_GOAL_S
    await sleep_until(ctx, until_s)
    run.notes["retried_on_survivor"] = sum(r.retried for r in ctx.records)
    run.notes["cut_after_tokens"] = sum(r.outcome == "cut" and r.gateway == 1 for r in ctx.records)


FaultScript = Callable[[Chaos, FaultRun, float], Awaitable[None]]
FAULTS: dict[str, tuple[FaultScript, str]] = {
    "slow_readers": (slow_readers, "slow readers"),
    "disconnects": (disconnects, "client disconnects"),
    "oversized": (oversized, "oversized inputs"),
    "kill_worker": (kill_worker, "kill -9 worker"),
    "stop_worker": (stop_worker, "kill -STOP worker"),
    "burst": (burst, "burst of connections"),
}
CLUSTER_FAULTS: dict[str, tuple[FaultScript, str]] = {   # need a local Ray cluster of >= 2 nodes (--ray-nodes)
    "lose_node": (lose_node, "lose a Ray node"),
}
GATEWAY_FAULTS: dict[str, tuple[FaultScript, str]] = {   # need a second gateway (--gateways 2, on a Ray cluster)
    "kill_gateway": (kill_gateway, "kill -9 a gateway"),
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


def replica_outage(samples: Sequence[Sample], start_s: float, end_s: float) -> tuple[float | None, float | None]:
    """(down, back): seconds from `start_s` to the first sample in [start_s, end_s) at which /ready listed
    a replica not up (loading, restarting, failed), and to the first sample after that at which every
    replica was up again. (None, None): none went down; (down, None): not back before `end_s`."""
    down = next((s.t_s for s in samples if start_s <= s.t_s < end_s and not s.replicas_up), None)
    if down is None:
        return None, None
    back = next((s.t_s for s in samples if down < s.t_s < end_s and s.replicas and s.replicas_up), None)
    return down - start_s, None if back is None else back - start_s


async def settle(ctx: Chaos, run: FaultRun, deadline_s: float) -> None:
    """Wait (until `deadline_s` at most) for the fault to have recovered and /ready to be 200 now, with
    every replica up: the next fault starts from full strength."""
    while ctx.now() < deadline_s:
        last = ctx.sampler.samples[-1] if ctx.sampler.samples else None
        recovered = recovery_time(ctx.sampler.samples, ctx.chat_ok(), run.start_s, run.injected_s, float("inf"))
        if recovered is not None and last is not None and last.ready and last.replicas_up:
            return
        await asyncio.sleep(SAMPLE_INTERVAL_S)


async def run_faults(ctx: Chaos, names: Sequence[str], runs: list[FaultRun],
                     faults: dict[str, tuple[FaultScript, str]]) -> None:
    """After the warm-up, each fault (by name, from `faults`) in its window, then its quiet window (extended
    until it recovered)."""
    p = ctx.phases
    await sleep_until(ctx, ctx.load_start_s + p.warmup_s)
    for name in names:
        run = FaultRun(name, ctx.now())
        runs.append(run)
        print(f"bench chaos: {faults[name][1]} at {run.start_s:.1f} s", file=sys.stderr, flush=True)
        try:
            await faults[name][0](ctx, run, run.start_s + p.fault_s)
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


async def chaos_run(server: LiveServer, args: argparse.Namespace, phases: Phases,
                    registry: dict[str, tuple[FaultScript, str]], cluster: Any = None,
                    second: LiveServer | None = None) -> dict[str, Any]:
    """The whole run against a started server (its replicas on `cluster`, a `bench.ray_local.LocalRayCluster`,
    or its own workers; with `second`, a second gateway of the same config sharing them, the steady load
    spread over both): idle samples, then load + faults, then the drain. On a cluster the replicas' own
    counters are looked at throughout (`bench.chaos.replicas`). Returns the raw measurements
    (`build_report` summarizes them)."""
    import aiohttp

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))

    async with session() as steady, session() as faults, session() as probes:
        model = await _first_model(steady, server.url)
        start = time.perf_counter()
        ctx = Chaos(server.url, model, server.proc.pid, start, IDLE_S, phases, args.timeout, steady, faults,
                    Sampler(server.url, server.proc.pid, start), num_burst=args.burst,
                    num_disconnects=args.disconnects, num_silent_bodies=args.silent_bodies,
                    num_tenant_burst=args.tenant_burst, cluster=cluster, write_timeout=args.write_timeout,
                    stall_seconds=args.stall_seconds, second_gateway=second,
                    counters=ReplicaCounters(cluster, start) if cluster is not None else None,
                    steady_urls=[server.url, second.url] if second is not None else [])
        stop_sampling, stop_load = asyncio.Event(), asyncio.Event()
        sampling = [asyncio.create_task(ctx.sampler.run(probes, stop_sampling))]
        if ctx.counters is not None:
            sampling.append(asyncio.create_task(ctx.counters.run(stop_sampling)))
        longest = phases.warmup_s + len(args.fault_names) * (phases.fault_s + phases.quiet_s + phases.max_settle_s)
        load = asyncio.create_task(run_steady(ctx, plan_steady(model, args.rate, args.rag_rate, longest + 60,
                                                               args.seed), stop_load))
        runs: list[FaultRun] = []
        try:
            await run_faults(ctx, args.fault_names, runs, registry)
        finally:
            stop_load.set()
            load_end_s = ctx.now()
            await load
            stop_sampling.set()
            await asyncio.gather(*sampling)
    return {"model": model, "records": ctx.records, "runs": runs, "samples": ctx.sampler.samples,
            "load_start_s": IDLE_S, "load_end_s": load_end_s, "duration_s": ctx.now(),
            "counters": ctx.counters}
