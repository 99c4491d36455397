"""`bench.live.LiveServer`: its start deadline holds whatever the server prints."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import bench.live as live


def test_a_server_that_hangs_before_printing_anything_is_given_up_at_the_deadline(tmp_path, monkeypatch):
    """Its stderr was read line by line on the caller's thread: a server silent before its first line held the
    start (and the benchmark) for ever, the deadline checked only after a line came."""
    started = []
    popen = subprocess.Popen

    def silent(argv, **kwargs):
        started.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    monkeypatch.setattr(live.subprocess, "Popen", silent)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="said nothing of where it serves"):
        live.LiveServer(tmp_path / "pools.yaml", timeout=1.0)
    assert time.monotonic() - began < 10 and started[0].poll() is not None   # given up, and stopped
