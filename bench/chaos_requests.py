"""The faults of `cliffguard bench chaos` that careless clients and bad requests cause: non-streamed
requests whose client never reads, a device worker stopped while it is idle, a poison request, and one
tenant's burst of large requests with a small one behind it. Each notes its own goal (`goal_met`,
with what it measured), which the report's verdict counts beside lost, duplicated and recovered."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

from bench.chaos_faults import FaultRun, Shot, shoot, sleep_until
from bench.chaos_steady import Chaos, is_running, send_signal

POISON_MARKER = "cliffguard-chaos-poison-2b7e"   # the server runs with CLIFFGUARD_FAULT_POISON set to it
NUM_SILENT_BODIES = 24
SILENT_CLOSE_GRACE_S = 5.0    # the gateway must have closed a silent reader's socket write_timeout + this after
BURST_REQUESTS, BURST_N, BURST_TOKENS = 16, 8, 128
SMALL_GOAL_S = 5.0            # the small request behind the burst is answered within this
IDLE_WAIT_S = 20.0            # how long the stopped-idle-worker fault waits for the steady load's requests to end


def server_connections(gateway_pid: int, port: int) -> int:
    """TCP connections the gateway holds open on its listening port (psutil; -1 if it cannot tell)."""
    try:
        import psutil

        return sum(1 for c in psutil.Process(gateway_pid).net_connections(kind="tcp")
                   if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)
    except (ImportError, OSError, ValueError):
        return -1


def _silent_body(ctx: Chaos, i: int) -> bytes:
    """A non-streamed chat whose answer (8 samples with 20 top logprobs per token) is megabytes of JSON."""
    body = {"model": ctx.model, "messages": [{"role": "user", "content": f"Write a long story, {i}."}], "n": 8,
            "max_tokens": 64, "logprobs": True, "top_logprobs": 20, "temperature": 1.0}
    return json.dumps(body).encode()


def _silent_socket(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


async def silent_bodies(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`NUM_SILENT_BODIES` non-streamed requests whose client never reads; notes the gateway's open
    connections before, right after, and `write_timeout` + `SILENT_CLOSE_GRACE_S` after (goal: back to
    what it was before)."""
    port = int(ctx.url.rsplit(":", 1)[1])
    before = server_connections(ctx.gateway_pid, port)
    socks = [await asyncio.to_thread(_silent_socket, ctx.url, _silent_body(ctx, i)) for i in range(NUM_SILENT_BODIES)]
    run.injected_s = ctx.now()
    try:
        await asyncio.sleep(1.0)
        during = server_connections(ctx.gateway_pid, port)
        await asyncio.sleep(ctx.write_timeout + SILENT_CLOSE_GRACE_S)
        after = server_connections(ctx.gateway_pid, port)
        run.notes.update(connections_before=before, connections_during=during, connections_after=after,
                         checked_after_s=round(ctx.now() - run.injected_s, 1))
        run.notes["goal_met"] = 0 <= after <= before + 2   # the steady load's own connections come and go
        await sleep_until(ctx, until_s)
    finally:
        for sock in socks:
            sock.close()


async def _ready_state(ctx: Chaos) -> tuple[int | None, str]:
    try:
        async with asyncio.timeout(2.0):
            async with ctx.fault_session.get(ctx.url + "/ready") as r:
                body = await r.json(content_type=None)
                return r.status, json.dumps(body.get("devices", body))
    except (TimeoutError, OSError, ValueError) as exc:
        return None, type(exc).__name__


async def _until_idle(ctx: Chaos, timeout: float) -> bool:
    """Wait until no steady request is in flight (the load is paused); False if some still were at `timeout`."""
    deadline = time.monotonic() + timeout
    while any(r.sent_s is not None and r.end_s is None for r in ctx.records):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def stop_idle_worker(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """Pause the steady load, wait until the worker is idle, `kill -STOP` it; note when /ready first said
    503 naming the stall (goal: within stall_seconds + 1.5 s), SIGCONT when the window ends, resume the load."""
    ctx.paused = True
    pid = None
    try:
        run.notes["idle"] = await _until_idle(ctx, IDLE_WAIT_S)
        pids = ctx.worker_pids()
        pid = pids[0] if pids else None
        run.notes["pid"] = pid
        if pid is None:
            return
        send_signal(pid, signal.SIGSTOP)
        run.injected_s = ctx.now()
        while ctx.now() < until_s + ctx.stall_seconds and "ready_503_after_s" not in run.notes:
            status, state = await _ready_state(ctx)
            if status == 503 and "stall" in state:
                run.notes["ready_503_after_s"] = round(ctx.now() - run.injected_s, 2)
                run.notes["state"] = re.sub(r"\s+", " ", state)[:160]
            await asyncio.sleep(0.2)
        honest = run.notes.get("ready_503_after_s")
        run.notes["goal_met"] = honest is not None and honest <= ctx.stall_seconds + 1.5
        run.notes["killed"] = not is_running(pid)
    finally:
        if pid is not None:
            send_signal(pid, signal.SIGCONT)
        ctx.paused = False
    await sleep_until(ctx, until_s)


async def _restarts(ctx: Chaos) -> float:
    async with ctx.fault_session.get(ctx.url + "/metrics") as r:
        text = await r.text()
    return sum(float(m.group(1)) for m in re.finditer(r"^cliffguard_worker_restarts_total\{[^}]*\} (\S+)$", text, re.M))


async def poison(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """One request that makes the worker's step fail (the server's `CLIFFGUARD_FAULT_POISON` marker): it must
    be answered 500 `poison_request` after two worker deaths, not run a third time; the steady requests in
    flight meanwhile are retried (the report's lost / duplicated count them)."""
    before = await _restarts(ctx)
    shot = Shot("poison", ctx.now())
    run.shots.append(shot)
    data = json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": f"{POISON_MARKER} hello"}],
                       "max_tokens": 8}).encode()
    async with ctx.fault_session.post(ctx.url + "/v1/chat/completions", data=data,
                                      headers={"Content-Type": "application/json"}) as r:
        shot.status, shot.end_s = r.status, ctx.now()
        body = await r.json(content_type=None)
    run.injected_s = ctx.now()
    code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
    deadline = ctx.now() + 15.0           # the second restart is counted after its back-off
    while await _restarts(ctx) - before < 2 and ctx.now() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(2.0)              # and no third one follows
    restarts = await _restarts(ctx) - before
    run.notes.update(status=shot.status, code=code, worker_restarts=restarts)
    run.notes["goal_met"] = shot.status == 500 and code == "poison_request" and restarts == 2
    await sleep_until(ctx, until_s)


async def tenant_burst(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """One tenant (no API key: every client is the same tenant) sends `BURST_REQUESTS` chats of n=`BURST_N`
    and `BURST_TOKENS` tokens at once, then a 4-token chat one second later: goal, the small one answered
    within `SMALL_GOAL_S`."""
    def body(text: str, n: int, max_tokens: int) -> bytes:
        return json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": text}], "n": n,
                           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}).encode()

    burst = [Shot(f"burst {i}", ctx.now()) for i in range(BURST_REQUESTS)]
    run.shots += burst
    tasks = [asyncio.create_task(shoot(ctx, ctx.fault_session, s, "/v1/chat/completions",
                                       body(f"Tell me a story about the number {i}.", BURST_N, BURST_TOKENS)))
             for i, s in enumerate(burst)]
    await asyncio.sleep(1.0)
    small = Shot("small", ctx.now())
    run.shots.append(small)
    await shoot(ctx, ctx.fault_session, small, "/v1/chat/completions", body("Say yes.", 1, 4))
    run.injected_s = ctx.now()
    run.notes["small_s"] = None if small.seconds is None else round(small.seconds, 2)
    run.notes["goal_met"] = small.status == 200 and small.seconds is not None and small.seconds <= SMALL_GOAL_S
    await asyncio.gather(*tasks)
    run.notes["burst_s"] = round(max((s.seconds or 0.0) for s in burst), 1)
    await sleep_until(ctx, until_s)


REQUEST_FAULTS = {
    "silent_bodies": (silent_bodies, "silent non-streamed readers"),
    "stop_idle_worker": (stop_idle_worker, "kill -STOP idle worker"),
    "poison": (poison, "poison request"),
    "tenant_burst": (tenant_burst, "one tenant's burst"),
}
