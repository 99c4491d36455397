"""`LiveServer`: `cliffguard serve` in a subprocess on an ephemeral loopback port, for benchmarks that
measure the server from outside (and for the tests that do the same)."""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wait_for_line(proc: subprocess.Popen, pattern: str, deadline: float, log: list[str] | None = None) -> str:
    """The first group of `pattern` in a child's stderr (text mode). The stderr is read on a thread, so a child that
    hangs silent cannot hold this past `deadline` (time.monotonic()); the thread drains it for the child's life
    (into `log` where given; once the line is found it queues no more), so the child never blocks on a full pipe.
    TimeoutError past the deadline, RuntimeError if the child's stderr ends first, each with what it said."""
    lines: queue.Queue[str | None] = queue.Queue()
    found, said = threading.Event(), log if log is not None else []

    def drain() -> None:
        for line in proc.stderr:
            if log is not None:
                log.append(line)
            if not found.is_set():
                lines.put(line)
        lines.put(None)
    threading.Thread(target=drain, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no line matching {pattern!r} in time:\n" + "".join(said)) from None
        if line is None:
            raise RuntimeError("the process exited:\n" + "".join(said))
        if log is None:
            said.append(line)
        if (match := re.search(pattern, line)) is not None:
            found.set()
            return match.group(1)


class LiveServer:
    """Starts `cliffguard serve --config <path>` on 127.0.0.1 and a free port, waits until `/ready`.

    `url` is the base URL; `log` collects the server's stderr (drained on a thread so the server
    never blocks on a full pipe); `stop()` terminates it (and kills it after `stop_timeout` s).
    `started`, `listening` and `ready` are when (time.perf_counter) the process was started, said it was
    serving, and first answered `/ready` 200, which is asked every `poll_seconds`.
    `args` are more `serve` options (e.g. `["--data-dir", path]`); `own_group`: the server leads a process group
    of its own (its workers in it), which a test can signal whole as systemd does. Without a `--data-dir` the server
    gets a fresh temporary one, removed by `stop()`: a server holds its data dir alone, and one test
    or benchmark must not see another's batches.
    """

    def __init__(self, config_path: Path | str, timeout: float = 180, *, env: dict[str, str] | None = None,
                 args: list[str] | None = None, poll_seconds: float = 0.2, own_group: bool = False) -> None:
        env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        args = list(args or [])
        self._data_dir: str | None = None
        if "--data-dir" not in args:
            self._data_dir = tempfile.mkdtemp(prefix="cliffguard-live-")
            args += ["--data-dir", self._data_dir]
        self.poll_seconds = poll_seconds
        self.listening = self.ready = None
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
             "--port", "0", *args], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
            process_group=0 if own_group else None)
        self.log: list[str] = []
        self.url: str | None = None
        try:
            self._wait_started(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_started(self, deadline: float) -> None:
        """Until the server says where it serves (its log read on a thread: a server that hangs before it
        prints a line cannot hold this past `deadline`), then until `/ready` answers 200."""
        try:
            self.url = wait_for_line(self.proc, r"serving on (http://\S+) ", deadline, self.log)
        except TimeoutError:
            raise TimeoutError("cliffguard serve said nothing of where it serves in time:\n" + "".join(self.log)) from None
        except RuntimeError:
            raise RuntimeError("cliffguard serve exited:\n" + "".join(self.log)) from None
        self.listening = time.perf_counter()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        self.ready = time.perf_counter()
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server never became ready:\n" + "".join(self.log))
            time.sleep(self.poll_seconds)

    def stop(self, stop_timeout: float = 20) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
