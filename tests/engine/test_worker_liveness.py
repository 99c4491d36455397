"""A device worker's liveness and its failures, unit by unit (no model, no process; milliseconds each).

- the watchdog's rules (`gateway.workers.supervisor.DeviceSupervisor.check_stall` over the client's
  `silent_seconds` / `step_seconds`, on a fake clock): a silent heartbeat is a stall, busy or idle; a
  long step that keeps beating lives until `step_timeout_seconds`, then is a hang;
- the worker's side: the heartbeat thread and the channel it shares with the loop;
- one request's failure fails that request alone (`Rejected`, `RequestFailedError`, 500
  `request_failed`); the fault-injection markers.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from engine.client import AsyncEngineClient, RequestFailedError
from engine.faults import POISON_ENV, REJECT_ENV, SLOW_STEP_ENV, Faults, InjectedFault
from engine.ipc import Channel
from engine.messages import AbortRequest, AddRequest, Heartbeat, PauseRequest, Rejected
from engine.sampling import SamplingParams
from engine.wire import FrameKeys
from engine.worker import HeartbeatThread, WorkerChannel, _handle
from gateway.monitoring.metrics import GatewayMetrics
from gateway.openai.errors import engine_error
from gateway.workers.supervisor import DeviceSupervisor

STALL, STEP_TIMEOUT = 10.0, 600.0


# --- the watchdog's rules ---------------------------------------------------------------------------

def _make_client(heard_at: float) -> AsyncEngineClient:
    """A client of a loaded, live worker last heard at `heard_at`, whose `kill` is recorded."""
    client = AsyncEngineClient(config=None)
    client._process = SimpleNamespace()   # started ...
    client.info = SimpleNamespace()       # ... and loaded
    client.last_heard = heard_at
    client.killed = []
    client.kill = client.killed.append
    return client


def _beat(client: AsyncEngineClient, at: float, step_seconds: float) -> None:
    """A heartbeat read at time `at` (what `_on_readable` does: stamp, then dispatch)."""
    client.last_heard = at
    client._dispatch(Heartbeat(step_seconds))


def _make_supervisor(client: AsyncEngineClient) -> DeviceSupervisor:
    supervisor = DeviceSupervisor("cpu", None, [], GatewayMetrics(), stall_seconds=STALL,
                                  step_timeout_seconds=STEP_TIMEOUT)
    supervisor.client = client
    return supervisor


def _counter(supervisor: DeviceSupervisor, name: str) -> float:
    return supervisor.metrics.registry.get_sample_value(name, {"device": "cpu", "replica": "0"}) or 0.0


def test_an_idle_worker_whose_heartbeat_stops_is_stalled_and_killed():
    client = _make_client(heard_at=100.0)
    supervisor = _make_supervisor(client)
    assert client.num_in_flight == 0                       # idle: nothing in flight
    assert not supervisor.check_stall(now=100.0 + STALL - 0.1) and client.killed == []
    assert client.silent_seconds(100.0 + STALL) == STALL
    assert supervisor.check_stall(now=100.0 + STALL + 0.5)
    [reason] = client.killed
    assert reason.startswith("stalled: no word from the device worker for 10.5 s") and "stall_seconds 10" in reason
    assert supervisor._restart_reason == reason            # /ready: restarting: stalled: ...
    assert supervisor.num_stalls == 1 and _counter(supervisor, "cliffguard_worker_stalls_total") == 1


def test_a_long_step_that_keeps_beating_lives_until_step_timeout_then_is_hung():
    client = _make_client(heard_at=0.0)
    supervisor = _make_supervisor(client)
    t = 0.0
    while t < STEP_TIMEOUT - 1:                            # one step of ~10 minutes, a beat every half second
        t += 0.5
        _beat(client, t, step_seconds=t)
        assert not supervisor.check_stall(now=t + 0.25), t
    assert client.killed == [] and client.step_seconds(t + 0.25) == t + 0.25
    _beat(client, STEP_TIMEOUT + 0.5, step_seconds=STEP_TIMEOUT + 0.5)
    assert supervisor.check_stall(now=STEP_TIMEOUT + 0.6)
    [reason] = client.killed
    assert reason.startswith("hung: one step of the device worker has run for 600.6 s")
    assert "step_timeout_seconds 600" in reason and "heartbeat still beats" in reason
    assert supervisor.num_step_timeouts == 1 and supervisor.num_stalls == 0
    assert _counter(supervisor, "cliffguard_worker_step_timeouts_total") == 1


def test_a_step_whose_heartbeats_stop_is_a_stall_and_steps_end_at_zero():
    client = _make_client(heard_at=0.0)
    supervisor = _make_supervisor(client)
    _beat(client, 5.0, step_seconds=4.0)
    assert client.step_seconds(7.0) == 6.0                 # the step goes on between beats
    _beat(client, 5.5, step_seconds=0.0)                   # between steps
    assert client.step_seconds(100.0) == 0.0
    assert not supervisor.check_stall(now=5.5 + STALL - 0.1)
    assert supervisor.check_stall(now=5.5 + STALL) and client.killed[0].startswith("stalled:")


def test_a_heartbeat_waiting_on_the_socket_is_heard_before_the_watchdog_judges():
    """The gateway's loop stalled past `stall_seconds` and runs the watchdog before the reader's callback: the
    heartbeat the worker sent meanwhile, still on the socket, is read first, and the worker is not killed."""
    worker, gateway = _make_signed_pair()
    client = _make_client(heard_at=time.monotonic() - STALL - 5)
    client._channel = gateway
    worker.send(Heartbeat(0.0))
    worker.flush()
    time.sleep(0.05)
    supervisor = _make_supervisor(client)
    assert not supervisor.check_stall() and client.killed == [] and client.silent_seconds() < 1.0
    worker.close()
    gateway.close()


def test_a_loading_or_dead_worker_is_not_judged():
    client = _make_client(heard_at=0.0)
    client.info = None                                     # still loading: its start timeout rules
    assert client.silent_seconds(1e6) == 0.0 and client.step_seconds(1e6) == 0.0
    assert not _make_supervisor(client).check_stall(now=1e6) and client.killed == []


# --- the worker's side ------------------------------------------------------------------------------

def _make_signed_pair() -> tuple[WorkerChannel, Channel]:
    a, b = socket.socketpair()
    return WorkerChannel(a, FrameKeys(b"s" * 32, b"r" * 32)), Channel(b, FrameKeys(b"r" * 32, b"s" * 32))


def _receive_until(channel: Channel, count: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} messages"
        channel.wait(0.05)
        got += channel.receive()
    return got


def test_the_heartbeat_thread_says_how_long_the_current_turn_has_lasted():
    worker, gateway = _make_signed_pair()
    with HeartbeatThread(worker, interval=0.01) as beat:
        idle = _receive_until(gateway, 2)
        beat.turn_started = time.monotonic() - 5.0         # the loop entered a turn 5 s ago
        busy = [m for m in _receive_until(gateway, 4) if m.step_seconds > 0]
    assert all(m == Heartbeat(0.0) for m in idle)
    assert busy and all(5.0 <= m.step_seconds < 15.0 for m in busy)


def test_a_heartbeat_that_finds_the_peer_gone_waits_for_the_loop_to_leave_before_giving_up_on_it():
    """The gateway's end closed: the heartbeat thread calls `on_peer_gone` (the worker ends) only if the
    loop has not left within LAST_WORDS_SECONDS; a loop that leaves on its own (it read the end) is not kept
    waiting on the thread (it slept its grace out, and the join waited)."""
    gone = []
    worker, gateway = _make_signed_pair()
    gateway.sock.close()
    beat = HeartbeatThread(worker, interval=0.01, on_peer_gone=lambda: gone.append(1))
    with beat:
        time.sleep(0.2)                                   # a heartbeat found the socket closed
    started = time.monotonic()
    beat._thread.join(5)
    assert not beat._thread.is_alive() and time.monotonic() - started < 0.5 and gone == []


def test_the_loop_and_the_heartbeat_share_a_signed_channel_without_breaking_frames():
    # Two threads sending at once on a plain Channel interleave partial frames and MAC counters; the
    # worker's channel keeps every frame whole, in each thread's order, and authentic.
    worker, gateway = _make_signed_pair()
    num = 3000
    received: list = []
    reader = threading.Thread(target=lambda: received.extend(_receive_until(gateway, 2 * num)))
    reader.start()

    def send(tag: str) -> None:
        for i in range(num):
            worker.send(Rejected(f"{tag}{i}", "x" * (i % 50)))

    senders = [threading.Thread(target=send, args=(tag,)) for tag in "ab"]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    assert worker.drain(10.0)
    reader.join()
    for tag in "ab":
        assert [m.request_id for m in received if m.request_id[0] == tag] == [f"{tag}{i}" for i in range(num)]


def test_an_idle_worker_pushes_its_stats_every_idle_interval_and_sleeps_no_longer(monkeypatch):
    """Stepping nothing, the loop pushes fresh stats every IDLE_STATS_INTERVAL (a device's busy ratio reads 0 and
    its stats' age stays small while it idles; they froze at the last busy values) and never sleeps longer."""
    import engine.worker as worker_module
    from engine.stats import IDLE_STATS_INTERVAL

    taken = []
    monkeypatch.setattr(worker_module, "engine_stats", lambda engine: taken.append(time.monotonic()) or "stats")
    sent, waits = [], []
    channel = SimpleNamespace(flush=lambda: True, receive=lambda: [], eof=False, num_pending_bytes=0,
                              send=sent.append, wait=waits.append)
    idle = SimpleNamespace(has_work=lambda: False, has_unfinished_requests=lambda: False)
    loop = worker_module._Loop(idle, channel, None, None)
    loop.send_stats()
    assert not loop.turn() and len(sent) == 1   # just pushed: nothing new
    loop.last_stats -= IDLE_STATS_INTERVAL
    assert not loop.turn() and [m.stats for m in sent] == ["stats", "stats"] and sent[1].deltas == []
    assert not loop.turn() and len(sent) == 2 and len(taken) == 2
    channel.receive = lambda: [SimpleNamespace()]   # a command that left it idle: its state goes at once
    monkeypatch.setattr(worker_module, "_handle", lambda *args: False)
    assert not loop.turn() and len(sent) == 3
    # `_serve` sleeps at most the interval between two turns
    turns = iter([False, True])
    monkeypatch.setattr(worker_module._Loop, "turn", lambda self: next(turns))
    worker_module._serve(idle, channel)
    assert waits and all(timeout == IDLE_STATS_INTERVAL for timeout in waits), waits


# --- one request's failure --------------------------------------------------------------------------

class _FakeEngine:
    """Raises `add_error` from add_request; records pauses; holds `requests`."""

    def __init__(self, add_error: Exception | None = None) -> None:
        self.add_error, self.requests, self.paused, self.aborted = add_error, {}, [], []
        self.tokenizer = SimpleNamespace(decode=lambda ids: " ".join(f"t{i}" for i in ids))

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        self.requests[request_id] = prompt      # half added, then ...
        if self.add_error is not None:
            raise self.add_error

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def pause(self, request_id, paused) -> bool:
        self.paused.append((request_id, paused))
        return True


def _handled(engine, msg, faults: Faults | None = None) -> list:
    a, b = socket.socketpair()
    worker, gateway = WorkerChannel(a), Channel(b)
    assert not _handle(engine, worker, msg, faults)
    time.sleep(0.01)
    return gateway.receive()


def _add(request_id: str, prompt="hello") -> AddRequest:
    return AddRequest(request_id, prompt, SamplingParams(max_tokens=4))


def test_a_failing_add_fails_that_request_alone_as_a_server_error():
    engine = _FakeEngine(KeyError("block 7"))
    [rejected] = _handled(engine, _add("r1"))
    assert rejected == Rejected("r1", "KeyError: 'block 7'", server_error=True)
    assert engine.requests == {} and engine.aborted == ["r1"]   # the half-added request is dropped
    [refused] = _handled(_FakeEngine(ValueError("prompt: too long")), _add("r2"))
    assert refused == Rejected("r2", "prompt: too long", server_error=False)   # the input's fault: 400


def test_failing_aborts_and_pauses_are_reported_not_raised_and_pauses_reach_the_engine():
    engine = _FakeEngine()
    assert _handled(engine, PauseRequest("r1", True)) == [] and engine.paused == [("r1", True)]
    engine.abort = lambda request_id: 1 / 0
    [rejected] = _handled(engine, AbortRequest("r1"))
    assert rejected.server_error and rejected.reason == "ZeroDivisionError: division by zero"
    no_pause = SimpleNamespace(requests={})                # an engine without pausing: nothing happens
    assert _handled(no_pause, PauseRequest("r1", False)) == []


def test_the_client_and_the_gateway_answer_a_server_error_500_request_failed():
    async def main():
        client = _make_client(heard_at=0.0)
        client._streams["r1"] = stream = SimpleNamespace(queue=asyncio.Queue())
        client._dispatch(Rejected("r1", "KeyError: 'block 7'", server_error=True))
        return stream.queue.get_nowait()

    exc = asyncio.run(main())
    assert isinstance(exc, RequestFailedError) and exc.request_id == "r1"
    error = engine_error(exc)
    assert (error.status, error.type, error.code) == (500, "server_error", "request_failed")
    assert "r1" in error.message and "KeyError: 'block 7'" in error.message


def test_fault_markers_reject_an_add_or_poison_the_step(monkeypatch):
    monkeypatch.delenv(POISON_ENV, raising=False)
    monkeypatch.delenv(REJECT_ENV, raising=False)
    monkeypatch.delenv(SLOW_STEP_ENV, raising=False)
    assert Faults.from_env() is None                       # nothing injected, nothing decoded
    monkeypatch.setenv(POISON_ENV, "t7 t8")
    monkeypatch.setenv(REJECT_ENV, "NOPE")
    faults, engine = Faults.from_env(), _FakeEngine()
    [rejected] = _handled(engine, _add("r1", "say NOPE please"), faults)
    assert rejected.server_error and rejected.reason.startswith("InjectedFault: fault injection")
    for request_id, ids in (("r2", [6, 7, 8, 9]), ("r3", [1, 2])):
        faults.on_add(engine, request_id, ids)             # token ids: decoded, the marker looked for
        engine.add_request(request_id, ids, None)
    with pytest.raises(InjectedFault, match="'r2'"):
        faults.before_step(engine)
    del engine.requests["r2"]                              # aborted before its step: harmless
    faults.before_step(engine)
    assert faults.poisoned == set()


def test_a_slow_step_marker_lengthens_one_step_once(monkeypatch):
    monkeypatch.setenv(SLOW_STEP_ENV, "SLOW:0.2")
    faults, engine = Faults.from_env(), _FakeEngine()
    faults.on_add(engine, "s1", "be SLOW now")
    engine.add_request("s1", "be SLOW now", None)
    started = time.monotonic()
    faults.before_step(engine)
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    faults.before_step(engine)                             # only its first step
    assert time.monotonic() - started < 0.1


def test_a_step_failed_by_a_follower_rank_that_died_is_said_as_the_group_breaking(monkeypatch):
    """A follower killed (a signal) fails rank 0's collective (gloo: "Connection closed by peer") before or after
    the group's watch thread sees its link end: the step's failure is then said as the group's break (a loss,
    counted against no request in it), never as a failed step. With every rank alive, or one that ended by itself
    (its own step failed, as rank 0's: a poison request on every rank), it is a failed step."""
    import subprocess
    import sys

    from engine import worker
    from engine.messages import Fatal
    from engine.parallel import Collectives, TensorParallelGroup

    sent, lost = [], []
    channel = SimpleNamespace(send=sent.append, drain=lambda seconds: None)
    monkeypatch.setattr(worker, "_rank_lost", lambda channel, reason: lost.append(reason))   # it ends the process
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ended.wait()

    def step_fails(group) -> None:
        try:
            raise RuntimeError("[gloo] Connection closed by peer")
        except RuntimeError:
            worker._step_failed(channel, group)

    try:
        started = time.monotonic()
        step_fails(TensorParallelGroup(2, Collectives(), processes=[alive]))
        assert time.monotonic() - started >= 0.9 and not lost      # it gave a death on its way time to show
        assert len(sent) == 1 and isinstance(sent[0], Fatal) and not sent[0].group_broke
        assert "Connection closed by peer" in sent[0].traceback
        step_fails(TensorParallelGroup(3, Collectives(), processes=[alive, dead]))
        assert len(lost) == 1 and f"rank 2 of 3 (pid {dead.pid}) exited" in lost[0] and "SIGKILL" in lost[0]
        started = time.monotonic()
        step_fails(TensorParallelGroup(3, Collectives(), processes=[ended, alive]))
        assert time.monotonic() - started < 0.5 and len(lost) == 1 and not sent[-1].group_broke
        step_fails(TensorParallelGroup(3, Collectives(), processes=[ended, dead]))   # a kill's collective ended
        assert len(lost) == 2 and f"rank 2 of 3 (pid {dead.pid})" in lost[1]        # rank 1's step: the kill
        assert worker._killed_follower(TensorParallelGroup.single()) is None    # one rank: nothing to wait for
    finally:
        alive.kill()
        alive.wait()
