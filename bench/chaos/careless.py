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

from bench.chaos.fault_script import FaultRun, Shot, shoot, sleep_until
from bench.chaos.steady import Chaos, send_signal

POISON_MARKER = "cliffguard-chaos-poison-2b7e"   # the server runs with CLIFFGUARD_FAULT_POISON set to it
SILENT_CLOSE_GRACE_S = 2.0    # the gateway must close a silent reader's connection write_timeout + this after its answer
SILENT_DEADLINE_S = 90.0      # ... and all of them within this of sending (the answers must be computed first)
BURST_N, BURST_TOKENS = 8, 24   # each burst chat: 192 tokens, 8 sequences
SMALL_GOAL_S = 5.0            # the small request behind the burst is answered within this
IDLE_WAIT_S = 20.0            # how long the stopped-idle-worker fault waits for the steady load's requests to end


def held_ports(gateway_pid: int, port: int, client_ports: set[int]) -> set[int] | None:
    """Which of `client_ports` the gateway still holds an established connection from (psutil; None if it
    cannot tell)."""
    try:
        import psutil

        return {c.raddr.port for c in psutil.Process(gateway_pid).net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port in client_ports
                and c.status == psutil.CONN_ESTABLISHED}
    except (ImportError, OSError, ValueError):
        return None


def _silent_body(ctx: Chaos, i: int) -> bytes:
    """A non-streamed chat whose answer (4 samples with 20 top logprobs per token, ~260 KB of JSON) is more
    than the sockets' buffers take."""
    body = {"model": ctx.model, "messages": [{"role": "user", "content": f"Write a long story, {i}."}], "n": 4,
            "max_tokens": 36, "logprobs": True, "top_logprobs": 20, "temperature": 1.0, "ignore_eos": True}
    return json.dumps(body).encode()


def _silent_socket(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _answered(sock: socket.socket) -> bool:
    """Bytes of the answer have come (peeked at, not read: the client still reads nothing)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False
    except OSError:
        return True


async def silent_bodies(ctx: Chaos, run: FaultRun, until_s: float) -> None:
    """`num_silent_bodies` non-streamed requests whose client never reads; per socket, when the first byte
    of its answer came and when the gateway closed the connection. Goal: each closed within
    `write_timeout` + `SILENT_CLOSE_GRACE_S` of its answer's first byte (`SILENT_DEADLINE_S` at most)."""
    port = int(ctx.url.rsplit(":", 1)[1])
    socks = [await asyncio.to_thread(_silent_socket, ctx.url, _silent_body(ctx, i))
             for i in range(ctx.num_silent_bodies)]
    by_port = {s.getsockname()[1]: s for s in socks}
    run.injected_s = ctx.now()
    first: dict[int, float] = {}
    held: dict[int, float] = {}
    try:
        while len(held) < len(by_port) and ctx.now() < run.injected_s + SILENT_DEADLINE_S:
            now = ctx.now()
            first.update({p: now for p, s in by_port.items() if p not in first and _answered(s)})
            still = await asyncio.to_thread(held_ports, ctx.gateway_pid, port, set(by_port))
            if still is None:
                break
            held.update({p: now - first.get(p, now) for p in by_port if p not in still and p not in held})
            await asyncio.sleep(0.25)
        worst = max(held.values(), default=None)
        run.notes.update(answered=len(first), closed=len(held), closed_after_first_byte_max_s=worst and round(worst, 2),
                         last_closed_after_s=round(ctx.now() - run.injected_s, 1))
        run.notes["goal_met"] = (len(held) == len(by_port) and worst is not None
                                 and worst <= ctx.write_timeout + SILENT_CLOSE_GRACE_S)
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
    ctx.paused, unsent, pid = True, ctx.num_unsent, None
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
    finally:
        if pid is not None:
            send_signal(pid, signal.SIGCONT)
        ctx.paused = False
        run.notes["unsent_while_paused"] = ctx.num_unsent - unsent   # planned arrivals left out, said
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
    """One tenant (no API key: every client is the same tenant) sends `num_tenant_burst` chats of n=`BURST_N`
    and `BURST_TOKENS` tokens at once, then a 4-token chat one second later: goal, the small one answered
    within `SMALL_GOAL_S` (and before the burst's last answer: it did not wait for the burst)."""
    def body(text: str, n: int, max_tokens: int) -> bytes:
        return json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": text}], "n": n,
                           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}).encode()

    burst = [Shot(f"burst {i}", ctx.now()) for i in range(ctx.num_tenant_burst)]
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
    small_ok = small.status == 200 and small.seconds is not None and small.seconds <= SMALL_GOAL_S
    await asyncio.gather(*tasks)
    run.notes["burst_s"] = round(max((s.seconds or 0.0) for s in burst), 1)
    run.notes["goal_met"] = small_ok and small.end_s <= max(s.end_s for s in burst)
    await sleep_until(ctx, until_s)


REQUEST_FAULTS = {
    "silent_bodies": (silent_bodies, "silent non-streamed readers"),
    "stop_idle_worker": (stop_idle_worker, "kill -STOP idle worker"),
    "poison": (poison, "poison request"),
    "tenant_burst": (tenant_burst, "one tenant's burst"),
}
