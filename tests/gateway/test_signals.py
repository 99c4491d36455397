"""How `cliffguard serve` stops (`gateway.signals`): SIGTERM, as systemd, `docker stop` and Kubernetes send it,
drains the requests in flight like Ctrl-C, within `gateway.drain_seconds`; a second signal cuts the drain short.
A slow first step (the fault injection's `CLIFFGUARD_FAULT_SLOW_STEP`) keeps a request in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from bench.live import LiveServer
from engine.faults import SLOW_STEP_ENV
from gateway.signals import serve_until_stopped
from tests.gateway.conftest import chat_pool_yaml


def _serve(tmp_path, tiny_model, drain_seconds: float, slow_seconds: float, own_group: bool = False) -> LiveServer:
    path = tmp_path / "pools.yaml"
    path.write_text(chat_pool_yaml(tiny_model, gateway=f"{{drain_seconds: {drain_seconds}}}"))
    return LiveServer(path, env={**os.environ, SLOW_STEP_ENV: f"slow-step:{slow_seconds}"}, own_group=own_group)


def _in_flight(server: LiveServer, model: str) -> tuple[threading.Thread, list]:
    """A streamed completion whose first step is slow, sent on a thread; its lines (or the error) land in
    the list. Returns once the gateway has it."""
    got: list = []

    def ask() -> None:
        body = {"model": model, "prompt": "slow-step", "max_tokens": 8, "stream": True, "ignore_eos": True}
        request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                got.extend(line.decode().strip() for line in response if line.strip())
        except Exception as exc:   # noqa: BLE001 - what the client saw is the test's to judge
            got.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(1.0)   # sent, and the worker is in its slow step
    return thread, got


def test_sigterm_drains_the_request_in_flight_then_exits_0(tmp_path, tiny_model):
    """Sent to the whole process group, as systemd's default `KillMode=control-group` sends it: the device
    worker ignores it (it once died at once: the stream got an engine_dead error, the worker was restarted
    inside the drain) and the gateway drains, then stops it."""
    with _serve(tmp_path, tiny_model, drain_seconds=20, slow_seconds=3, own_group=True) as server:
        thread, got = _in_flight(server, tiny_model.name)
        start = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGTERM)
        thread.join(30)
        assert got and got[-1] == "data: [DONE]", got                  # answered whole, after the signal
        assert not any("error" in str(line) for line in got), got
        assert server.proc.wait(30) == 0 and time.monotonic() - start < 20
        assert any("SIGTERM: stopping" in line for line in server.log), server.log
        assert any(line.rstrip().endswith("stopped") for line in server.log), server.log
        assert not any("worker died" in line for line in server.log), server.log


def test_requests_still_in_flight_when_the_drain_ends_are_answered_503(tmp_path, tiny_model):
    """drain_seconds 2: a stream that had begun, stalled behind another request's 5 s step, ends with an error
    event (`server_shutting_down`) then `[DONE]`; the request whose step it is, which had sent nothing, is
    answered 503 as JSON. Both were dropped without a word, and only after twice the drain (aiohttp waits
    its shutdown_timeout again before it cancels a handler)."""
    path = tmp_path / "pools.yaml"
    path.write_text(chat_pool_yaml(tiny_model, gateway="{drain_seconds: 2}", max_model_len=512))
    with LiveServer(path, env={**os.environ, SLOW_STEP_ENV: "slow-step:5"}) as server:
        lines, begun = [], threading.Event()

        def stream() -> None:
            body = {"model": tiny_model.name, "prompt": "hello", "max_tokens": 480, "stream": True, "ignore_eos": True}
            request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                for line in response:
                    if line.strip():
                        lines.append(line.decode().strip())
                        begun.set()

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert begun.wait(30)
        thread, got = _in_flight(server, tiny_model.name)   # its first step lasts 5 s: the stream stalls
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        streaming.join(30)
        thread.join(30)
        # what it streamed before it stalled (a token or more: how many the 5-s step let through), then the error
        assert len(lines) >= 3 and lines[-1] == "data: [DONE]", lines
        assert all(json.loads(line.removeprefix("data: "))["choices"] for line in lines[:-2]), lines
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down", lines
        assert len(got) == 1 and getattr(got[0], "code", None) == 503, got
        assert json.loads(got[0].read())["error"]["code"] == "server_shutting_down"
        assert time.monotonic() - start < 3.5   # cut at the drain's end
        assert server.proc.wait(30) == 0
        assert any("2 requests still in flight are cut" in line for line in server.log), server.log


def test_two_signals_in_one_turn_of_the_loop_cut_the_drain():
    """Both handled before the serving task left its wait: the second's cancel once landed there, ran the
    whole drain as if no signal of ours had come, and escaped as CancelledError (a traceback, exit 1)."""
    class Runner:
        drained = False

        async def cleanup(self) -> None:
            await asyncio.sleep(5)
            self.drained = True

    def twice() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    async def serve(runner: Runner) -> int:
        asyncio.get_running_loop().call_later(0.1, twice)
        return await serve_until_stopped(runner, 5)

    runner, start = Runner(), time.monotonic()
    assert asyncio.run(serve(runner)) == 143 and not runner.drained and time.monotonic() - start < 2


@pytest.mark.slow   # ~8 s; the second signal's cut is shown in-process above, a drain end to end beside it
def test_a_second_signal_cuts_the_drain_short(tmp_path, tiny_model):
    """Ctrl-C, then Ctrl-C again: the request in flight is cut and the gateway is gone at once (130), not after
    `drain_seconds`; its device worker follows it out."""
    with _serve(tmp_path, tiny_model, drain_seconds=60, slow_seconds=30) as server:
        thread, got = _in_flight(server, tiny_model.name)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(20) == 130 and time.monotonic() - start < 15
        thread.join(30)
        assert got and got[-1] != "data: [DONE]", got
        assert any("SIGINT again: stopping now" in line for line in server.log), server.log
