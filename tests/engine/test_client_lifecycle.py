"""`AsyncEngineClient`'s own bookkeeping around a worker process, without one: a stand-in process and the
worker's end of the socket pair, so each case (a start, a reap, a shutdown, a lease) runs in milliseconds."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import engine.client as client_module
from engine.client import AsyncEngineClient, EngineDeadError
from engine.config import EngineConfig
from engine.ipc import Channel
from engine.messages import AbortRequest, Fatal, Lease, Outputs
from engine.outputs import RequestDelta
from engine.worker_process import WorkerProcess


class _Process:
    """A worker process as `AsyncEngineClient` sees one (`WorkerProcess`): `join`, `kill`, `exitcode`, `close`.
    `stuck`: SIGKILL does not end it (a process in the kernel's uninterruptible sleep); `on_join` runs at each
    join."""

    status_lost = False   # its fork server outlives it

    def __init__(self, stuck: bool = False, on_join=None) -> None:
        self.exitcode, self.stuck, self.on_join = None, stuck, on_join
        self.kills, self.closed = 0, False

    def join(self, timeout: float | None = None) -> None:
        if self.on_join is not None:
            self.on_join()
        if self.exitcode is None and not self.stuck and self.kills:
            self.exitcode = -9

    def kill(self) -> None:
        self.kills += 1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def close(self) -> None:
        self.closed = True


def _connected(process: _Process) -> tuple[AsyncEngineClient, Channel]:
    """A client past its start, over `process`; the worker's end of its channel."""
    client = AsyncEngineClient(EngineConfig(model="unused"))
    ours, theirs = socket.socketpair()
    client._loop = asyncio.get_running_loop()
    client.died, client._ready = client._loop.create_future(), client._loop.create_future()
    client._process, client._channel, client.pid = process, Channel(ours), 4242
    client.info = object()   # loaded
    client._loop.add_reader(client._channel.fileno(), client._on_readable)
    return client, Channel(theirs)


async def test_a_worker_that_sigkill_cannot_end_still_fails_its_requests_and_is_declared_dead(monkeypatch):
    """A process stuck in the kernel (a GPU driver's hang) outlives SIGKILL: the reap waits KILLED_WAIT_S for
    it, not forever; its requests fail, `died` resolves, and the process, never reaped, is not closed."""
    monkeypatch.setattr(client_module, "KILLED_WAIT_S", 0.01)
    process = _Process(stuck=True)
    client, _worker = _connected(process)
    stream = client_module._Stream(asyncio.Queue())
    client._streams["r1"] = stream
    client._on_exit(grace=0.01)   # its socket closed: EOF
    reason = await asyncio.wait_for(client.died, 5)
    assert "did not end" in reason and process.kills == 1 and not process.closed and client.exitcode is None
    assert isinstance(stream.queue.get_nowait(), EngineDeadError)


async def test_shutdown_reaches_a_worker_whose_socket_is_full(monkeypatch):
    """Aborts the socket has not taken hold `Shutdown` in the outbox, which nothing writes once the client
    stops watching the socket: the worker sees EOF after what the socket holds, while the client waits for
    it to exit, not only once it was killed."""
    saw_eof: list[bool] = []

    def worker_reads() -> None:   # what the worker reads while the client waits for its exit
        worker.sock.setblocking(False)
        try:
            while worker.sock.recv(1 << 16):
                pass
            saw_eof.append(True)
        except BlockingIOError:
            saw_eof.append(False)
        process.exitcode = 0 if saw_eof[-1] else None

    process = _Process(on_join=worker_reads)
    client, worker = _connected(process)
    while not client._channel.num_pending_bytes:   # the socket takes no more: the rest waits in the outbox
        client._send(AbortRequest("x" * 4096))
    await client.shutdown(timeout=0.01)
    assert saw_eof[0] and process.kills == 0 and process.closed


async def test_a_send_that_finds_the_worker_gone_first_reads_what_it_sent_before():
    """The worker sent its last outputs and its `Fatal`, then exited; a command sent before the reader's
    callback ran found the socket broken, and the client stopped there: the finished request failed with
    EngineDeadError, and the failed step read as a lost worker. What it sent is read first, as its EOF would be."""
    process = _Process()
    client, worker = _connected(process)
    finished, cut = (client_module._Stream(asyncio.Queue()) for _ in range(2))
    client._streams.update(done=finished, cut=cut)
    delta = RequestDelta("done", [], finished=True)
    worker.send(Outputs([delta]))
    worker.send(Fatal("Traceback: the step failed"))
    worker.sock.close()
    process.exitcode = 1
    client.report_waiting("chat", 3)   # a credit queue's report, queued before the reader's callback
    reason = await asyncio.wait_for(client.died, 5)
    assert finished.queue.get_nowait() == delta and isinstance(cut.queue.get_nowait(), EngineDeadError)
    assert client.step_failed and "the step failed" in reason


async def test_a_lease_the_gateway_fails_to_apply_leaves_what_came_with_it_dispatched():
    """An exception out of `on_lease` (a pool's admission raising) is logged; the outputs read with the lease
    still reach their streams, and the lease stays unacknowledged."""
    client, worker = _connected(_Process())
    stream = client_module._Stream(asyncio.Queue())
    client._streams["r1"] = stream
    client.on_lease = lambda pool, tokens: 1 / 0
    delta = RequestDelta("r1", [], finished=True)
    worker.send(Lease("chat", 100, 1))
    worker.send(Outputs([delta]))
    await asyncio.sleep(0.05)
    client._on_readable()
    assert stream.queue.get_nowait() == delta and client._unacked == {"chat": (100, 1)}
    client._loop.remove_reader(client._channel.fileno())


async def test_the_worker_process_starts_off_the_event_loop(monkeypatch):
    """The first start waits for the fork server's import of torch (seconds): `process.start` runs on a
    thread; a start that fails closes both ends of the socket pair."""
    threads: list[str] = []
    pairs: list[tuple[socket.socket, socket.socket]] = []
    socketpair = socket.socketpair

    class _Context:
        def Process(self, **kwargs):   # noqa: N802 - multiprocessing's name
            return type("P", (), {"start": lambda self: threads.append(threading.current_thread().name)
                                  or (_ for _ in ()).throw(OSError("no fork server"))})()

    monkeypatch.setattr(client_module.mp, "get_context", lambda method: _Context())
    monkeypatch.setattr(client_module, "start_fork_server", lambda: None)
    monkeypatch.setattr(client_module.socket, "socketpair", lambda: pairs.append(socketpair()) or pairs[-1])
    with pytest.raises(OSError, match="no fork server"):
        await AsyncEngineClient(EngineConfig(model="unused")).start(timeout=1)
    await asyncio.sleep(0.01)
    assert threads and threads[0] != threading.current_thread().name
    assert all(s.fileno() == -1 for s in pairs[0])


async def test_a_start_the_fork_server_does_not_answer_ends_at_its_timeout(monkeypatch):
    """A fork server alive but not answering (stopped, swapping) held `start` past any timeout: each replica's
    start behind it, and the supervisor's round, waited for it."""
    pairs: list[tuple[socket.socket, socket.socket]] = []
    socketpair, answer = socket.socketpair, threading.Event()

    class _Context:
        def Process(self, **kwargs):   # noqa: N802 - multiprocessing's name
            return type("P", (), {"start": lambda self: answer.wait(10) and (_ for _ in ()).throw(OSError("late"))})()

    monkeypatch.setattr(client_module.mp, "get_context", lambda method: _Context())
    monkeypatch.setattr(client_module, "start_fork_server", lambda: None)
    monkeypatch.setattr(client_module.socket, "socketpair", lambda: pairs.append(socketpair()) or pairs[-1])
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))   # the stuck start holds none of it
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await AsyncEngineClient(EngineConfig(model="unused")).start(timeout=0.3)
    assert time.monotonic() - began < 3
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
    answer.set()                                   # the start returns at last: both ends of the pair are closed
    for _ in range(100):
        if all(s.fileno() == -1 for s in pairs[0]):
            break
        await asyncio.sleep(0.02)
    assert all(s.fileno() == -1 for s in pairs[0])


def test_a_start_that_never_returns_holds_up_no_interpreter_exit():
    """`process.start` ran on an executor's thread, which the interpreter joins at exit: a gateway whose fork
    server was stopped (SIGSTOP, a frozen swap) never exited after its SIGTERM."""
    script = textwrap.dedent("""
        import asyncio, threading
        from engine.fork_server import launch

        class Stuck:
            def start(self):
                threading.Event().wait()

        async def main():
            try:
                async with asyncio.timeout(0.2):
                    await asyncio.shield(launch(asyncio.get_running_loop(), Stuck()))
            except TimeoutError:
                print("timed out")

        asyncio.run(main())
    """)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.strip() == "timed out", done.stderr


class _ForkServed:
    """A process as multiprocessing's fork server reports it: its status comes through a pipe, whose EOF (the
    server ended) reads as exit code 255 (`popen_forkserver.poll`)."""

    def __init__(self, pid: int, status: int) -> None:
        self.pid, self.sentinel, self._code = pid, status, None

    def join(self, timeout: float | None = None) -> None:
        if self._code is None and select.select([self.sentinel], [], [], timeout)[0]:
            data = os.read(self.sentinel, 4)
            self._code = int.from_bytes(data, "little", signed=True) if data else 255

    @property
    def exitcode(self) -> int | None:   # read as multiprocessing's is: polled
        self.join(0)
        return self._code

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        os.close(self.sentinel)


def _fork_served(client_process: subprocess.Popen) -> tuple[WorkerProcess, int]:
    """`client_process` as a fork server's child; the write end of its status pipe (the fork server's)."""
    status, server = os.pipe()
    return WorkerProcess(_ForkServed(client_process.pid, status)), server


async def test_a_worker_outlives_the_fork_server_it_came_from():
    """A fork server that ends (killed, the OOM killer) closes its workers' status pipes, read as exit code 255:
    the worker running on was taken for dead, its requests failed. Its pidfd says it runs; it is watched by
    the pidfd from then on, and its end (an unknown exit code) or `kill` still fails what it held."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for ending in ("exits", "killed"):
        worker = subprocess.Popen(sleeper)
        process, server = _fork_served(worker)
        client, _ = _connected(process)
        client._sentinel = process.fd
        client._loop.add_reader(client._sentinel, client._on_sentinel)
        stream = client_module._Stream(asyncio.Queue())
        client._streams["r1"] = stream
        os.close(server)   # the fork server ends
        await asyncio.sleep(0.2)
        assert client.is_alive and process.status_lost and stream.queue.empty()
        if ending == "exits":
            worker.kill()
        else:
            client.kill("killed by the gateway")
        reason = await asyncio.wait_for(client.died, 5)
        assert worker.wait(5) == -signal.SIGKILL
        assert ("its fork server ended" in reason) == (ending == "exits") and client.exitcode is None, reason
        assert isinstance(stream.queue.get_nowait(), EngineDeadError)


def test_the_exit_is_multiprocessings_word_unless_the_fork_server_ended():
    """A worker that ends as the client's join times out: its pidfd says it ended before the fork server wrote
    its status; it still counts as alive until multiprocessing has its exit code (closing a process before
    that raises, which ended the reap with `died` never resolved). A spawned worker's sentinel is its own
    pipe, closed just before its pidfd says it ended: never taken for a fork server's end."""
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)   # ended, not reaped: its pidfd says so already
    status, server = os.pipe()
    process = WorkerProcess(_ForkServed(worker.pid, status))
    assert process.is_alive() and process.exitcode is None and not process.status_lost
    os.write(server, (0).to_bytes(4, "little", signed=True))   # the fork server reports it
    process.join(1)
    assert not process.is_alive() and process.exitcode == 0
    os.close(server)
    worker.wait(5)
    process.close()
    spawned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    status, own_pipe = os.pipe()
    process = WorkerProcess(_ForkServed(spawned.pid, status), fork_served=False)
    os.close(own_pipe)   # its sentinel closes while the pidfd does not say it ended yet
    assert process.fired() and not process.status_lost
    process.kill()
    assert spawned.wait(5) == -signal.SIGKILL
    process.close()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    status, server = os.pipe()
    os.close(server)   # the fork server ended between the worker's start and the watch: it runs on
    process = WorkerProcess(_ForkServed(worker.pid, status))
    assert process.status_lost and process.is_alive() and process.fd != status
    process.kill()
    process.join(5)
    assert not process.is_alive() and worker.wait(5) == -signal.SIGKILL
    process.close()


def test_a_worker_outlives_a_real_fork_server_killed(tmp_path):
    """The same against multiprocessing's own fork server, in a process of its own (the suite's fork server
    is not killed): the worker it started reads exit code 255 once the server is killed, and runs on."""
    script = tmp_path / "fork_server_killed.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, multiprocessing.forkserver as forkserver, os, resource, signal, select, time
        from engine.worker_process import WorkerProcess
        if __name__ == "__main__":
            process = mp.get_context("forkserver").Process(target=time.sleep, args=(60,), daemon=True)
            process.start()
            watched = WorkerProcess(process)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # a gateway holding a thousand sockets:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))   # its fds past select's 1024
            if min(hard, 4096) > 2000:
                watched._pidfd = os.dup2(watched._pidfd, 2000)
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
            assert select.select([watched.fd], [], [], 10)[0]          # the status pipe closed
            assert not watched.fired() and watched.status_lost and watched.is_alive()
            assert process.exitcode == 255                             # what multiprocessing reads
            watched.join(0.2)
            assert watched.is_alive() and watched.exitcode is None
            watched.kill()
            watched.join(5)
            assert not watched.is_alive()
            watched.close()
            print("ran on")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0 and done.stdout.strip() == "ran on", done.stderr


async def test_a_pause_sent_while_the_request_waits_for_room_reaches_the_worker_after_it():
    """A response paused (its client slow) while its request still waited for the outbox's room: the pause went
    first, for a request the worker did not know yet (nothing), and the request then ran unpaused for good."""
    from engine.messages import AddRequest, PauseRequest

    client, worker = _connected(_Process())
    client._room.clear()   # the worker is behind on reading
    first = asyncio.ensure_future(anext(client.generate([1, 2], request_id="b")))
    await asyncio.sleep(0)
    client.pause("b", True)
    client._room.set()
    await asyncio.sleep(0.05)
    sent = [m for m in worker.receive() if isinstance(m, (AddRequest, PauseRequest))]
    assert [type(m).__name__ for m in sent] == ["AddRequest", "PauseRequest"] and sent[1].paused
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    client._room.clear()   # cancelled while it waits for room: nothing went out, so no abort goes out either
    waiting = asyncio.ensure_future(anext(client.generate([1, 2], request_id="c")))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    client._room.set()
    await asyncio.sleep(0.05)
    assert [m for m in worker.receive() if getattr(m, "request_id", None) == "c"] == []
