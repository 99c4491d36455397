"""A speed probe: how fast this machine's cores are right now, apart from what our server does.

A shared virtual machine changes speed under its guests' feet: on the 2-core development VM the same
served load cost 30% more from one run to the next, and twice as much within one run
(docs/PERF.md, "Simulator vs real runs"). A benchmark that compares a model of the machine with the
machine needs to know whether the machine held still. The probe is a child process at the highest
priority it may take that times a fixed compute kernel (a chain of small float32 matmuls: a few
hundred microseconds on one thread, in L1, no memory traffic to speak of) four times a second and
writes `<unix time> <seconds>` lines. Its cost is a fraction of a percent of one core.

What it sees: the core's own speed (clock, a busy hyperthread sibling on the host, steal), not the
contention for memory bandwidth or caches that the server itself causes. It is a monitor: the
ratio of a run's kernel time to a reference run's says whether the machine slowed down between
them; nothing is fitted to it.

    with SpeedProbe(path):
        ...                                  # the timed work
    samples = read_probe(path)
    speed_ratio(samples, start, end, reference)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

INTERVAL_S = 0.25
_SIDE, _CHAIN = 48, 60


def _kernel_seconds(a: np.ndarray) -> float:
    x = a
    start = time.perf_counter()
    for _ in range(_CHAIN):
        x = (x @ a) * 0.01
    return time.perf_counter() - start


def probe(path: str, seconds: float) -> None:
    """The child's loop: every `INTERVAL_S`, the best of two kernel timings, appended to `path`."""
    try:
        os.nice(-20)                 # preempt the server's threads, so its load is not what is timed
    except OSError:
        pass
    a = np.random.default_rng(0).random((_SIDE, _SIDE), dtype=np.float32)
    for _ in range(20):
        _kernel_seconds(a)
    end = time.time() + seconds
    with open(path, "a") as out:
        while time.time() < end:
            out.write(f"{time.time():.3f} {min(_kernel_seconds(a), _kernel_seconds(a)):.9f}\n")
            out.flush()
            time.sleep(INTERVAL_S)


class SpeedProbe:
    """Runs the probe in a child process (one BLAS thread) for the `with` block, appending to `path`.
    `max_seconds` bounds the child if the parent dies without stopping it."""

    def __init__(self, path: Path | str, *, max_seconds: float = 6 * 3600) -> None:
        self.path = Path(path)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.speedprobe", str(self.path), str(max_seconds)],
                                     env=env, cwd=Path(__file__).resolve().parent.parent)

    def __enter__(self) -> SpeedProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_probe(path: Path | str) -> list[tuple[float, float]]:
    """The probe's `(unix time, kernel seconds)` samples (an empty list if it wrote none)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    samples = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2:                              # a line cut short by the probe's end is left out
            samples.append((float(parts[0]), float(parts[1])))
    return samples


def kernel_median(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """Median kernel time of the samples taken in [start, end] (None: no sample there)."""
    inside = [seconds for t, seconds in samples if start <= t <= end]
    return float(np.median(inside)) if inside else None


def speed_ratio(samples: Sequence[tuple[float, float]], start: float, end: float, reference: float,
                *, window: float = 15.0) -> dict[str, float] | None:
    """The kernel's time in [start, end] over `reference` (a median from another span): its median and
    the lowest and highest of its `window`-second medians. Above 1: the machine was slower. None if
    the probe took no sample in the span."""
    median = kernel_median(samples, start, end)
    if median is None:
        return None
    windows = [kernel_median(samples, t, min(t + window, end)) for t in np.arange(start, end, window)]
    windows = [w for w in windows if w is not None]
    return {"median": median / reference, "min": min(windows) / reference, "max": max(windows) / reference}


if __name__ == "__main__":
    probe(sys.argv[1], float(sys.argv[2]))
