"""`WorkerProcess`: a device worker's process as the gateway watches it, whoever reaps it.

A worker forked from multiprocessing's fork server (`engine.fork_server`) is the server's child, not the
gateway's: its exit code comes through the server's status pipe, the process's `sentinel`. A fork server that
ends (killed, the OOM killer) closes that pipe while its workers run on, and multiprocessing reads the EOF as
exit code 255: the gateway took every replica for dead, failed its requests and started a new worker beside
one still holding the device. On Linux the process's pidfd says whether the worker itself ended, whoever
reaps it: `WorkerProcess` believes the sentinel only where the pidfd agrees, watches the pidfd once the
status pipe is gone (`status_lost`: the exit code is then unknown), and kills through it (no pid reuse).
Where there is no pidfd (another OS, or the process ended before it was opened) it is the process as it was,
and so it is for a process not forked from the fork server (`fork_served` False: `spawn`, whose sentinel is a
pipe the child itself holds, closed as it exits a moment before its pidfd says so), but for `kill`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import signal
from multiprocessing.connection import wait

__all__ = ["WorkerProcess"]


class WorkerProcess:
    """A started `multiprocessing` process, with what `AsyncEngineClient` reads of it: `fd` to watch for its
    end, `join`, `kill`, `exitcode`, `is_alive`, `close`."""

    def __init__(self, process: mp.process.BaseProcess, fork_served: bool = True) -> None:
        self.process = process
        self.pid = process.pid
        self.fork_served = fork_served
        self.status_lost = False   # the fork server ended before the worker: the pidfd alone says when it ends
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):   # ended already, or no pidfd on this OS
            self._pidfd = os.pidfd_open(process.pid)
        if self._pidfd is not None and wait([process.sentinel], 0):   # its status came: it ended (or its fork
            if fork_served and process.exitcode == 255 and not self._ended(0):   # server did: EOF reads 255)
                self.status_lost = True
            else:   # it ended before the pidfd was opened: its pid may be another process's by now
                os.close(self._pidfd)
                self._pidfd = None

    @property
    def fd(self) -> int:
        """What becomes readable when the process ends: the sentinel, or the pidfd once the sentinel lied."""
        return self._pidfd if self.status_lost else self.process.sentinel

    def fired(self) -> bool:
        """`fd` became readable: whether the process ended. False where the sentinel closed as the fork server
        ended while the worker runs on; `fd` is its pidfd from then on."""
        if self.status_lost or self._pidfd is None or not self.fork_served or self._ended(0):
            return True
        self.status_lost = True
        return False

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the process to end (blocks)."""
        if not self.status_lost:
            self.process.join(timeout)
            if self.process.exitcode is None or self.fired():
                return
        self._ended(timeout)

    @property
    def exitcode(self) -> int | None:
        """The exit code once the process ended (negative: the signal that killed it); None while it runs, and
        where its fork server ended first (`status_lost`: `is_alive` says whether it ended)."""
        return None if self.status_lost else self.process.exitcode

    def is_alive(self) -> bool:
        """multiprocessing's word (its exit code read), unless the pidfd says that was its fork server's end."""
        if not self.status_lost and (self.process.exitcode is None or self.fired()):
            return self.process.exitcode is None
        return not self._ended(0)

    def kill(self) -> None:
        """SIGKILL, through the pidfd where there is one (it names this process, whoever reaped it since)."""
        if self._pidfd is None:
            self.process.kill()
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def close(self) -> None:
        """Release the process's resources, once it ended."""
        self.process.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _ended(self, timeout: float | None) -> bool:
        """Whether the pidfd is readable (the process ended), waiting up to `timeout` seconds (poll: any fd
        number, where select stops at 1024)."""
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))
