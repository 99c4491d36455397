"""The fork server device workers are forked from, and their end when the gateway's process ends.

The server is multiprocessing's: a process that has imported `engine.worker` (torch with it) and nothing else:
no CUDA context, no thread, no model. It starts with the first worker, or earlier (`start_fork_server`:
`cliffguard serve` starts it before planning, so that its import runs beside the gateway's). A restart then
skips the interpreter's start and torch's import (1.7 s of the 2.9 s a spawned worker took on a 2-core CPU;
`cliffguard bench restart`), and one gateway's replicas share one import.

A process that runs the fork server and may have children (not a daemon: the device worker is one) forks its
tensor-parallel followers from it too (`forks_followers`, `start_follower`): an engine built in such a process (the test
suite, which builds about a hundred groups one after another) starts a group without a follower's interpreter start and
torch import, about a second of each group's start on a 2-core CPU. A follower forked so is the server's child: it dies
with the server (`PR_SET_PDEATHSIG`), which ends with the process that started it; its exit status comes back through
multiprocessing's sentinel (`ForkedProcess`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

__all__ = ["WORKER_PRELOAD", "ForkedProcess", "forget_at_exit", "forks_followers", "kill_at_exit", "launch",
           "start_fork_server", "start_follower"]

WORKER_PRELOAD = ["engine.worker"]   # what the fork server imports once (torch with it) for every worker


def launch(loop: asyncio.AbstractEventLoop, process: mp.process.BaseProcess) -> asyncio.Future:
    """`process.start()` on a daemon thread of its own, off the event loop; a future of `loop` for its end. A
    fork server that stops answering holds that thread only: never the loop's default executor (aiohttp's name
    lookups, `asyncio.to_thread`) however many starts time out on it, nor the interpreter's exit, which joins
    an executor's threads (and so never ended while one start hung)."""
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def run() -> None:
        try:
            process.start()
            error = None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            error = exc
        with contextlib.suppress(RuntimeError):   # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="cliffguard-launch", daemon=True).start()
    return done


def start_fork_server() -> None:
    """Start the fork server now rather than with the first worker: its import of `WORKER_PRELOAD` (torch
    with it, about 1.5 s on a 2-core CPU) then runs beside whatever the caller does before it starts a
    worker (`cliffguard serve`: its own imports, the capacity plan, the tokenizers). Idempotent.

    It never sees SIGTERM, as the workers ignore it (`engine.worker`): sent to the process group (systemd's
    default), it ended the fork server, and each worker's exit status, which it reports, read as a death (exit
    code 255) in the gateway's drain. The signal is blocked in this thread while the server is spawned, so
    the server starts with it blocked, and one meant for the caller stays pending meanwhile, not lost. It
    still ends with its parent (multiprocessing's own pipe)."""
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    mp.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
    resource_tracker.ensure_running()   # first: starting it unblocks SIGTERM in this thread (its own spawn's)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        multiprocessing.forkserver.ensure_running()   # the server inherits the mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    start_fork_server.started = True


def forks_followers() -> bool:
    """Whether this process forks its tensor-parallel followers from its fork server: it started one
    (`start_fork_server`) and may have children (a daemon, the device worker, spawns them instead)."""
    return getattr(start_fork_server, "started", False) and not mp.current_process().daemon


class ForkedProcess:
    """A process forked from the fork server, seen as the `subprocess.Popen` a spawned follower is: `pid`,
    `returncode` (negative: the signal that ended it), `poll`, `wait` (`subprocess.TimeoutExpired`), `kill`."""

    def __init__(self, process: mp.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"follower {self.pid}", timeout)
        forget_at_exit(self.process)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()


def start_follower(follower: Callable, args, link: socket.socket) -> ForkedProcess | subprocess.Popen:
    """A tensor-parallel follower's process running `follower` (`engine.model_runner.follower_main`) with `args`
    (its `engine.parallel.FollowerArgs`) and `link` (its end of the `PlanLink`, numbered `args.link_fd` here):
    forked from the fork server where this process forks its followers (`forks_followers`), else spawned."""
    return _fork_follower(follower, args, link) if forks_followers() else _spawn_follower(follower, args)


def _spawn_follower(follower: Callable, args) -> subprocess.Popen:
    """`follower()` in a new Python process (not a multiprocessing child: the device worker is a daemon) that
    reads `args` from its stdin and inherits `args.link_fd` under the same number."""
    root = str(Path(__file__).resolve().parent.parent)   # where the `engine` package is
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    command = [sys.executable, "-c", f"from {follower.__module__} import {follower.__name__}; {follower.__name__}()"]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, pass_fds=(args.link_fd,))
    process.stdin.write(pickle.dumps(args))
    process.stdin.close()
    return process


def _fork_follower(follower: Callable, args, link: socket.socket) -> ForkedProcess:
    """`follower(args)` forked from the fork server, `link` handed over by multiprocessing, under this process's
    environment now (the server's is the one it started with: a backend or NCCL variable set since would differ
    between the ranks, and their kernels with it)."""
    process = mp.get_context("forkserver").Process(target=_run_follower, args=(follower, args, link, dict(os.environ)),
                                                   name=f"cliffguard-tp-rank-{args.rank}", daemon=True)
    process.start()
    kill_at_exit(process)   # it ignores SIGTERM: one left running at exit is killed, not joined
    return ForkedProcess(process)


def _run_follower(follower: Callable, args, link: socket.socket, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    follower(dataclasses.replace(args, link_fd=link.detach()))


_LEFT_AT_EXIT: weakref.WeakSet = weakref.WeakSet()   # workers started: killed if alive when the process ends


def kill_at_exit(process: mp.process.BaseProcess) -> None:
    """A worker ignores the SIGTERM multiprocessing sends its daemon children at exit before joining them: one
    left running (a second Ctrl-C cuts everything) is killed first, or the exit would wait for its step. The
    hook is registered after multiprocessing's own (at the first start): the later runs first."""
    _LEFT_AT_EXIT.add(process)
    if not getattr(kill_at_exit, "registered", False):
        kill_at_exit.registered = atexit.register(lambda: [p.kill() for p in list(_LEFT_AT_EXIT) if p.is_alive()])


def forget_at_exit(process: mp.process.BaseProcess) -> None:
    """`process` was reaped: nothing to kill at exit."""
    _LEFT_AT_EXIT.discard(process)
