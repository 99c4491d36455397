"""`cliffguard bench gateway`: what the gateway adds in front of a fast upstream, measured in one run.

Three processes: a fast local OpenAI-compatible upstream (answers every chat completion at once with
a fixed reply), `cliffguard serve` with one `upstream:` pool pointing at it (so every request is parsed,
rendered with the chat template, counted exactly, routed and forwarded), and this load generator.

- Added latency: requests one at a time, alternating direct and through the gateway, so both see the
  same machine state; p50/p99 of each and the difference.
- Routed requests/s: `--concurrency` requests in flight through the gateway, beside the same load sent
  directly to the upstream.
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


async def _measure(direct_url: str, gateway_url: str, args: argparse.Namespace) -> dict:
    import aiohttp

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    direct_body = {"model": "upstream-model", "messages": messages, "max_tokens": 8}
    gateway_body = dict(direct_body, model="bench")
    connector = aiohttp.TCPConnector(limit=max(args.concurrency, 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(url: str, body: dict) -> float:
            t = time.perf_counter()
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
            return time.perf_counter() - t

        for _ in range(50):  # warm-up: connections, caches
            await one(direct_url, direct_body)
            await one(gateway_url, gateway_body)
        direct, through = [], []
        for _ in range(args.latency_requests):
            direct.append(await one(direct_url, direct_body))
            through.append(await one(gateway_url, gateway_body))

        async def flood(url: str, body: dict) -> float:
            remaining = args.requests

            async def worker():
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await one(url, body)

            t = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return args.requests / (time.perf_counter() - t)

        direct_rps = await flood(direct_url, direct_body)
        gateway_rps = await flood(gateway_url, gateway_body)
    ms = 1e3
    d, g = latency_stats(direct), latency_stats(through)
    return {
        "direct_p50_ms": d["p50"] * ms, "direct_p99_ms": d["p99"] * ms,
        "gateway_p50_ms": g["p50"] * ms, "gateway_p99_ms": g["p99"] * ms,
        "added_p50_ms": (g["p50"] - d["p50"]) * ms,
        "added_mean_ms": (statistics.mean(through) - statistics.mean(direct)) * ms,
        "direct_rps": direct_rps, "gateway_rps": gateway_rps, "concurrency": args.concurrency,
        "requests": args.requests, "latency_requests": args.latency_requests,
    }


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "latency_requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    up_port = _free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "bench.gateway", "upstream", str(up_port)],
                                stderr=subprocess.PIPE, text=True, env=env)
    gateway = None
    try:
        _wait_line(upstream, r"upstream serving on (\S+) ")
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
            gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                        "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
            gateway_url = _wait_line(gateway, r"serving on (http://\S+) ")
            subprocess_drain(gateway)
            subprocess_drain(upstream)
            result = asyncio.run(_measure(f"http://127.0.0.1:{up_port}/v1/chat/completions",
                                          gateway_url + "/v1/chat/completions", args))
    finally:
        for proc in (gateway, upstream):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"gateway vs direct, {result['latency_requests']} sequential chat requests each, alternating:")
    print(f"  direct   p50 {result['direct_p50_ms']:.3f} ms  p99 {result['direct_p99_ms']:.3f} ms")
    print(f"  gateway  p50 {result['gateway_p50_ms']:.3f} ms  p99 {result['gateway_p99_ms']:.3f} ms")
    print(f"  added    p50 {result['added_p50_ms']:.3f} ms  (mean {result['added_mean_ms']:.3f} ms)")
    print(f"throughput, {result['requests']} requests at concurrency {result['concurrency']}:")
    print(f"  direct   {result['direct_rps']:.0f} req/s")
    print(f"  gateway  {result['gateway_rps']:.0f} routed req/s")
    return 0


def subprocess_drain(proc: subprocess.Popen) -> None:
    """Keep reading a child's stderr so it never blocks on a full pipe."""
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        serve_fast_upstream(int(sys.argv[2]))
