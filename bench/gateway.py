"""`cliffguard bench gateway`: what the gateway adds in front of a fast upstream, measured in one run.

Four processes: a fast local OpenAI-compatible upstream (answers every chat completion at once with
a fixed reply), `cliffguard serve` with one `upstream:` pool pointing at it (so every request is parsed,
rendered with the chat template, counted exactly, routed and forwarded), a bare pass-through proxy
(aiohttp's server and client with nothing between them: what one more hop costs on this machine with
the stock aiohttp stack), and this load generator.

- Added latency: requests one at a time, round-robin direct, through the proxy and through the gateway,
  so all see the same machine state; p50/p99 of each and what each adds to direct.
- Routed requests/s: `--concurrency` requests in flight through the gateway, beside the same load sent
  directly to the upstream and through the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pools.workload import latency_stats

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


def serve_bare_proxy(port: int, upstream_port: int) -> None:
    """The reference hop: aiohttp's server and client passing each body to the upstream and its answer
    back, nothing read or changed (the gateway's server is aiohttp's; its client is lighter)."""
    import aiohttp
    from aiohttp import web

    url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
    headers = {"Content-Type": "application/json", "Accept": "application/json"}

    async def session_ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        yield
        await app["session"].close()

    async def chat(request: web.Request) -> web.Response:
        async with request.app["session"].post(url, data=await request.read(), headers=headers) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=lambda *a: print(
        f"proxy serving on http://127.0.0.1:{port} ", file=sys.stderr, flush=True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("process exited:\n" + "".join(lines))
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    raise TimeoutError("".join(lines))


ARMS = ("direct", "proxy", "gateway")
# The goals: the gateway adds at most the direct p50 again, and routes at least 0.4 of the direct requests/s.
GOAL_ADDED_OVER_DIRECT = 1.0
GOAL_ROUTED_OF_DIRECT = 0.4


async def _measure(urls: dict[str, str], args: argparse.Namespace) -> dict:
    """Latency (round-robin, one request at a time) and requests/s (a flood per arm) of each arm."""
    import aiohttp

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    body = {"model": "upstream-model", "messages": messages, "max_tokens": 8}
    bodies = {"direct": body, "proxy": body, "gateway": dict(body, model="bench")}
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
    up_port, proxy_port = _free_port(), _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.gateway", "upstream", str(up_port)],
                              stderr=subprocess.PIPE, text=True, env=env)]
    try:
        _wait_line(procs[0], r"upstream serving on (\S+) ")
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.gateway", "proxy", str(proxy_port), str(up_port)],
                                      stderr=subprocess.PIPE, text=True, env=env))
        _wait_line(procs[1], r"proxy serving on (\S+) ")
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "bench.yaml"
            config.write_text(f"""
pools:
  - name: fast
    upstream: http://127.0.0.1:{up_port}/v1
    model: upstream-model
    served_model_name: bench
    tokenizer: {args.tokenizer}
    route: {{max_prompt_tokens: 1000000}}
""")
            procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                           "--port", "0"], stderr=subprocess.PIPE, text=True, env=env))
            gateway_url = _wait_line(procs[2], r"serving on (http://\S+) ")
            for proc in procs:
                subprocess_drain(proc)
            path = "/v1/chat/completions"
            result = asyncio.run(_measure({"direct": f"http://127.0.0.1:{up_port}{path}",
                                           "proxy": f"http://127.0.0.1:{proxy_port}{path}",
                                           "gateway": gateway_url + path}, args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
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


def subprocess_drain(proc: subprocess.Popen) -> None:
    """Keep reading a child's stderr so it never blocks on a full pipe."""
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        serve_fast_upstream(int(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "proxy":
        serve_bare_proxy(int(sys.argv[2]), int(sys.argv[3]))
