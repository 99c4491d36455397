"""Reliability fixtures: black-box tests against a live `cliffguard serve` on the builtin model.

Each finding of hostile or careless traffic is reproduced from outside, over HTTP, while a `Probe`
checks that the gateway keeps answering `/health` within a second; afterwards other clients'
requests must still be answered and every pool's KV credits must be back to full.

One server (config/pools.yaml's pools in float32, with short `write_timeout` and `stall_seconds` so faults
resolve in seconds) is shared by the package's tests; each test leaves it healthy. Float32 whatever the CPU
(`auto` may take bfloat16): the tests' loads are sized to its plan (the chat pool's 28 sequences).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.chaos.fault_script import silent_socket
from bench.chaos.steady import parse_credits
from bench.chaos.steady import worker_pid as chaos_worker_pid
from bench.live import LiveServer

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
WRITE_TIMEOUT = 3.0
STALL_SECONDS = 4.0
POISON_MARKER = "qqz-poison-marker-qqz"   # a prompt holding it crashes the worker's step (engine.faults)
REJECT_MARKER = "qqz-reject-marker-qqz"   # a prompt holding it fails its own add in the worker
SLOW_MARKER = "qqz-slow-marker-qqz"       # a prompt holding it makes one step last SLOW_STEP_SECONDS longer
SLOW_STEP_SECONDS = STALL_SECONDS + 2.5
MAX_RESPONSE_BUFFER_BYTES = 256 << 10     # a stream pauses its engine requests past this (1 MiB by default)


def reliability_config(tmp: Path) -> Path:
    """config/pools.yaml in float32 with the gateway's fault timers shortened for tests."""
    config = yaml.safe_load((REPO / "config" / "pools.yaml").read_text())
    config["devices"]["default"]["dtype"] = "float32"
    config["gateway"].update(write_timeout=WRITE_TIMEOUT, stall_seconds=STALL_SECONDS,
                             restart_backoff={"initial_seconds": 0.2, "factor": 2, "max_seconds": 2,
                                              "reset_after_seconds": 60})
    config["gateway"]["max_response_buffer_bytes"] = MAX_RESPONSE_BUFFER_BYTES
    path = tmp / "pools.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    """One live server on the builtin model for the package (restarted if a test left it dead), its worker
    armed with the fault-injection markers (`engine.faults`): only prompts holding them are affected."""
    env = dict(os.environ, CLIFFGUARD_FAULT_POISON=POISON_MARKER, CLIFFGUARD_FAULT_REJECT=REJECT_MARKER,
               CLIFFGUARD_FAULT_SLOW_STEP=f"{SLOW_MARKER}:{SLOW_STEP_SECONDS:g}")
    live = LiveServer(reliability_config(tmp_path_factory.mktemp("reliability")), env=env)
    yield live
    live.stop()


@pytest.fixture
def live(server):
    """The shared server, healthy and with full credits before and after each test."""
    wait_ready(server.url, 60)
    wait_credits_full(server.url, 30)
    yield server
    wait_ready(server.url, 60)
    wait_credits_full(server.url, 60)


# --- HTTP ----------------------------------------------------------------------------------------
def post(url: str, path: str, body: Any, timeout: float = 120, headers: dict[str, str] | None = None
         ) -> tuple[int, Any]:
    """(status, decoded JSON or text) of a POST; ('error', repr) if the connection failed."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _decode(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _decode(exc.read())
    except OSError as exc:
        return "error", repr(exc)


def get(url: str, path: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as response:
            return response.status, _decode(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _decode(exc.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def chat(url: str, text: str = "Say hi.", max_tokens: int = 8, timeout: float = 60) -> tuple[int, Any]:
    return post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                               "max_tokens": max_tokens, "temperature": 0}, timeout=timeout)


# --- state ---------------------------------------------------------------------------------------
def credits(url: str) -> dict[str, tuple[float, float]]:
    """pool -> (free, total) KV credits from /metrics."""
    return parse_credits(get(url, "/metrics")[1])


def wait_credits_full(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = credits(url)
        if now and all(free == total for free, total in now.values()):
            return
        assert time.monotonic() < deadline, f"credits not back to full: {now}"
        time.sleep(0.2)


def wait_ready(url: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = get(url, "/ready")
        except OSError:
            status, body = None, None
        if status == 200:
            return body
        assert time.monotonic() < deadline, f"not ready: {status} {body}"
        time.sleep(0.2)


def worker_pid(server: LiveServer) -> int:
    """The device worker's pid (a child of the server's fork server)."""
    pid = chaos_worker_pid(server.proc.pid)
    assert pid is not None, "no device worker"
    return pid


def resume(pid: int) -> None:
    """SIGCONT, if the process still exists (the watchdog may have killed it)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


class Probe:
    """GETs /health every `interval` seconds on a thread; `worst` is the slowest answer (or the timeout
    when one failed), `failures` the probes that got no 200."""

    def __init__(self, url: str, interval: float = 0.1, timeout: float = 3.0) -> None:
        self.url, self.interval, self.timeout = url, interval, timeout
        self.worst, self.failures, self.count = 0.0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status = get(self.url, "/health", timeout=self.timeout)[0]
                if status != 200:
                    self.failures.append(status)
            except OSError as exc:
                self.failures.append(repr(exc))
            self.worst = max(self.worst, time.monotonic() - started)
            self.count += 1
            self._stop.wait(self.interval)

    def assert_healthy(self, within: float = 1.0) -> None:
        assert self.count > 0
        assert not self.failures, f"/health failed: {self.failures[:5]}"
        assert self.worst < within, f"/health took {self.worst:.2f} s"


def silent_client(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST on a raw socket with a tiny receive buffer and never read the answer (the caller
    closes the socket)."""
    return silent_socket(url, path, body)


# --- worker faults (tests/reliability/test_worker_faults.py) ---------------------------------------
def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the /metrics samples named `name` with `labels` (0 when none), e.g.
    metric(url, "cliffguard_worker_restarts_total", device="default")."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(get(url, "/metrics")[1])
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def post_headers(url: str, path: str, body: Any, timeout: float = 60) -> tuple[int, Any, dict[str, str]]:
    """(status, decoded JSON or text, response headers) of a POST."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _decode(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, _decode(exc.read()), dict(exc.headers)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll `predicate()` until true; the seconds it took (AssertionError naming `what` past `timeout`)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(interval)
    return time.monotonic() - started
