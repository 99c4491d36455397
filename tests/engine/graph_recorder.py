"""A CUDA graph's semantics on the CPU, for testing `engine.cuda_graphs` without a GPU.

A CUDA graph records the kernels a capture launched, each with its arguments (device pointers and
scalars) frozen, and a replay launches exactly those again: it does not run the Python that launched
them. `RecordingGraphBackend` does the same with what a CPU run launches: every aten op (by a
`TorchDispatchMode`, with its tensor arguments by identity) and every Triton kernel launch (through the
interpreter, `TRITON_INTERPRET=1`, with its grid and scalars as they were). A replay re-runs that list;
a functional op's fresh result is copied into the tensor the capture produced, which later ops hold.
A collective (`c10d.allreduce_` over gloo, tensor parallelism) is an op like the others: replayed, it
runs again with the other ranks' replays, and the replay waits for it as a graph's stream would.

So a launch decision taken from a per-step Python value (a length read from a list, a plan built from
`seq_lens_list`) is frozen at capture here as it would be on a GPU, and a test that changes the step
between replays sees the wrong answer that a GPU would give. Our own C kernels (ctypes) are invisible
to it: tests that use it run the torch or Triton ops.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.cuda_graphs import GraphBackend


class GraphUnsafeError(RuntimeError):
    """A replay met what a CUDA graph cannot replay (an op whose output shape depends on the data)."""


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, Any, tuple, dict, list[torch.Tensor]]] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.entries.append(("aten", func, args, kwargs, outputs))
        return out


class RecordingGraphBackend(GraphBackend):
    """`GraphBackend` whose graphs are recordings replayed op by op (see the module docstring)."""

    def __init__(self, tally: str | None = None) -> None:
        self.captures = 0
        self.replays = 0
        self.tally = tally   # a file each capture and replay appends "<pid> capture|replay" to (a copy
                             # pickled to another process, a follower rank, counts there)

    def capture(self, fn):
        from triton.runtime.interpreter import InterpretedFunction

        recorder = _Recorder()
        original = InterpretedFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            if not recorder.paused:
                recorder.entries.append(("triton", kernel, args, dict(kwargs, grid=grid), []))
            recorder.paused = True            # the interpreter's own tensor traffic is not the kernel's
            try:
                return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                recorder.paused = False

        InterpretedFunction.run = run
        try:
            with recorder:
                out = fn()
        finally:
            InterpretedFunction.run = original
        self.captures += 1
        self._mark("capture")
        return recorder.entries, out

    def _mark(self, what: str) -> None:
        if self.tally is not None:
            with open(self.tally, "a") as f:
                f.write(f"{os.getpid()} {what}\n")

    def replay(self, graph) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.replays += 1
        self._mark("replay")
        for kind, fn, args, kwargs, outputs in graph:
            if kind == "triton":
                kwargs = dict(kwargs)
                grid = kwargs.pop("grid")
                InterpretedFunction.run(fn, *args, grid=grid, warmup=False, **kwargs)
                continue
            result = fn(*args, **kwargs)
            leaves = tree_flatten(result)[0]
            for work in leaves:    # a collective (c10d): a graph's stream waits for it; here its Work
                if isinstance(work, torch.ScriptObject) and hasattr(work, "wait"):
                    work.wait()
            fresh = [t for t in leaves if isinstance(t, torch.Tensor)]
            for captured, new in zip(outputs, fresh):
                if captured.shape != new.shape:
                    raise GraphUnsafeError(f"{fn}: output {tuple(new.shape)} at replay, {tuple(captured.shape)} at "
                                           "capture (a shape that depends on the data cannot be replayed)")
                if captured.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    captured.copy_(new)       # a functional op: its new result into the tensor later ops read
