"""`cliffguard bench gateway`: what the gateway adds in front of a fast upstream, measured in one run.

Five processes: a fast local OpenAI-compatible upstream (answers every chat completion at once with
a fixed reply), `cliffguard serve` with one `upstream:` pool pointing at it (so every request is parsed,
rendered with the chat template, counted exactly, routed and forwarded), two references, and this load
generator. The references, each one more process on the path like the gateway:

- `relay`: a TCP relay passing bytes both ways, no HTTP read at all. The floor: what one more process
  between client and upstream costs on this machine (two more wake-ups and four more socket calls a
  request), whatever it does;
- `proxy`: a bare pass-through proxy, aiohttp's server (with the gateway's settings) and the least
  client there is, nothing between them: the floor of a gateway whose server is aiohttp's.

- Added latency: requests one at a time, round-robin over direct and every arm, so all see the same
  machine state; p50/p99 of each and what each adds to direct.
- Routed requests/s: `--concurrency` requests in flight through each arm in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.live import wait_for_line

REPLY = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "upstream-model",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                      "logprobs": None}],
         "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000, help="requests in the throughput phase (each side)")
    p.add_argument("--latency-requests", type=int, default=300, help="sequential requests (each side)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in the throughput phase")
    p.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct",
                   help="the tokenizer the gateway counts with")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def serve_fast_upstream(port: int) -> None:
    """The stand-in upstream: a constant chat completion, no model behind it."""
    from aiohttp import web

    body = json.dumps(REPLY).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=lambda *a: print(
        f"upstream serving on http://127.0.0.1:{port} ", file=sys.stderr, flush=True))


class _Relay:
    """One side of a relayed connection: what it receives goes out on its `peer`, as it arrives."""

    def __init__(self, peer: asyncio.Transport | None = None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []   # bytes the client sent before the upstream side connected

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending.append(data)
        else:
            self.peer.write(data)

    def eof_received(self) -> None:
        if self.peer is not None:
            self.peer.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


def serve_relay(port: int, upstream_port: int) -> None:
    """The floor of one more hop: every accepted connection gets its own upstream connection, and bytes
    pass both ways unread (no HTTP, no parsing, no copy kept)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def accepted() -> asyncio.Protocol:
            client = _Relay()

            async def connect() -> None:
                try:
                    upstream, _ = await loop.create_connection(lambda: _Relay(client.transport), "127.0.0.1",
                                                               upstream_port)
                except OSError:
                    client.transport.close()
                    return
                client.peer = upstream
                for data in client.pending:
                    upstream.write(data)
                client.pending.clear()

            loop.create_task(connect())   # runs once the client's side is made
            return client

        server = await loop.create_server(accepted, "127.0.0.1", port)
        print(f"relay serving on http://127.0.0.1:{port} ", file=sys.stderr, flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class _Exchange(asyncio.Protocol):
    """A kept-alive connection to the bench's upstream, one request at a time: the least a client can do
    (the upstream always frames its answer with Content-Length)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.answer is None:
            return
        head = bytes(self.buffer[:end]).split(b"\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head[1:]
                       if line.split(b":", 1)[0].strip().lower() == b"content-length"), 0)
        if len(self.buffer) >= end + 4 + length:
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            self.answer.set_result((int(head[0].split(b" ")[1]), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc or ConnectionResetError("the upstream closed the connection"))


def serve_bare_proxy(port: int, upstream_port: int) -> None:
    """The floor of an aiohttp gateway: aiohttp's server (as the gateway's) passing each body to the
    upstream and its answer back through the least client there is (`_Exchange`), nothing read or changed."""
    from aiohttp import web

    idle: list[_Exchange] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        if idle:
            conn = idle.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(_Exchange, "127.0.0.1", upstream_port)
        conn.answer = asyncio.get_running_loop().create_future()
        conn.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status, answer = await conn.answer
        idle.append(conn)
        return web.Response(body=answer, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, handler_cancellation=True,
                print=lambda *a: print(f"proxy serving on http://127.0.0.1:{port} ", file=sys.stderr, flush=True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> str:
    """The first group of `pattern` in the helper's stderr, within `timeout` s (`bench.live.wait_for_line`)."""
    return wait_for_line(proc, pattern, time.monotonic() + timeout)


ARMS = ("direct", "relay", "proxy", "gateway")
# The goals: the gateway adds at most the direct p50 again, and routes at least 0.4 of the direct requests/s.
GOAL_ADDED_OVER_DIRECT = 1.0
GOAL_ROUTED_OF_DIRECT = 0.4


async def _measure(urls: dict[str, str], args: argparse.Namespace) -> dict:
    """Latency (round-robin, one request at a time) and requests/s (a flood per arm) of each arm."""
    import aiohttp

    from pools.workload import latency_stats   # here: the helper processes run without torch

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    body = {"model": "upstream-model", "messages": messages, "max_tokens": 8}
    bodies = {"direct": body, "relay": body, "proxy": body, "gateway": dict(body, model="bench")}
    connector = aiohttp.TCPConnector(limit=max(args.concurrency, 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(arm: str) -> float:
            t = time.perf_counter()
            async with session.post(urls[arm], json=bodies[arm]) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{urls[arm]}: HTTP {r.status}: {await r.text()}")
            return time.perf_counter() - t

        for _ in range(50):  # warm-up: connections, caches
            for arm in ARMS:
                await one(arm)
        latency: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.latency_requests):
            for arm in ARMS:
                latency[arm].append(await one(arm))

        async def flood(arm: str) -> float:
            remaining = args.requests

            async def worker():
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await one(arm)

            t = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return args.requests / (time.perf_counter() - t)

        rps = {arm: await flood(arm) for arm in ARMS}
    result: dict = {"concurrency": args.concurrency, "requests": args.requests,
                    "latency_requests": args.latency_requests}
    direct = latency_stats(latency["direct"])
    for arm in ARMS:
        stats = latency_stats(latency[arm])
        result[arm] = {"p50_ms": stats["p50"] * 1e3, "p99_ms": stats["p99"] * 1e3, "rps": rps[arm],
                       "added_p50_ms": (stats["p50"] - direct["p50"]) * 1e3,
                       "added_mean_ms": (statistics.mean(latency[arm]) - statistics.mean(latency["direct"])) * 1e3,
                       "added_over_direct_p50": (stats["p50"] - direct["p50"]) / direct["p50"],
                       "rps_of_direct": rps[arm] / rps["direct"]}
    return result


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "latency_requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    up_port, relay_port, proxy_port = _free_port(), _free_port(), _free_port()
    data_dir = tempfile.TemporaryDirectory()   # the gateway's: removed once every process has ended
    procs = [subprocess.Popen([sys.executable, "-m", "bench.gateway", "upstream", str(up_port)],
                              stderr=subprocess.PIPE, text=True, env=env)]
    try:
        _wait_line(procs[0], r"upstream serving on (\S+) ")
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.gateway", "proxy", str(proxy_port), str(up_port)],
                                      stderr=subprocess.PIPE, text=True, env=env))
        _wait_line(procs[1], r"proxy serving on (\S+) ")
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.gateway", "relay", str(relay_port), str(up_port)],
                                      stderr=subprocess.PIPE, text=True, env=env))
        _wait_line(procs[2], r"relay serving on (\S+) ")
        with contextlib.nullcontext(data_dir.name) as tmp:
            config = Path(tmp) / "bench.yaml"
            config.write_text(f"""
pools:
  - name: fast
    upstream: http://127.0.0.1:{up_port}/v1
    model: upstream-model
    served_model_name: bench
    tokenizer: {args.tokenizer}
""")
            procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                           "--port", "0", "--data-dir", tmp], stderr=subprocess.PIPE, text=True,
                                          env=env))
            gateway_url = _wait_line(procs[3], r"serving on (http://\S+) ")
            path = "/v1/chat/completions"
            result = asyncio.run(_measure({"direct": f"http://127.0.0.1:{up_port}{path}",
                                           "relay": f"http://127.0.0.1:{relay_port}{path}",
                                           "proxy": f"http://127.0.0.1:{proxy_port}{path}",
                                           "gateway": gateway_url + path}, args))
    finally:   # every process, even where one does not end in time (then killed)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        data_dir.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _report(result)
    return 0


def _report(result: dict) -> None:
    print(f"{result['latency_requests']} sequential chat requests per arm, round-robin; then {result['requests']} "
          f"per arm at concurrency {result['concurrency']}:")
    print(f"  {'':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'x direct p50':>12} {'req/s':>8} {'of direct':>9}")
    for arm in ARMS:
        r = result[arm]
        print(f"  {arm:8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['added_p50_ms']:10.3f} "
              f"{r['added_over_direct_p50']:12.2f} {r['rps']:8.0f} {r['rps_of_direct']:9.2f}")
    g = result["gateway"]
    print(f"goals: added p50 <= {GOAL_ADDED_OVER_DIRECT:g}x direct p50: "
          f"{'met' if g['added_over_direct_p50'] <= GOAL_ADDED_OVER_DIRECT else 'NOT met'} "
          f"({g['added_over_direct_p50']:.2f}x); routed >= {GOAL_ROUTED_OF_DIRECT:g} of direct: "
          f"{'met' if g['rps_of_direct'] >= GOAL_ROUTED_OF_DIRECT else 'NOT met'} ({g['rps_of_direct']:.2f})")
    floor = result["relay"]
    print(f"the floor (one more process, bytes relayed unread): added p50 {floor['added_over_direct_p50']:.2f}x "
          f"direct, {floor['rps_of_direct']:.2f} of direct req/s; the gateway adds "
          f"{g['added_p50_ms'] - floor['added_p50_ms']:.3f} ms p50 over it")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        serve_fast_upstream(int(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "relay":
        serve_relay(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "proxy":
        serve_bare_proxy(int(sys.argv[2]), int(sys.argv[3]))
