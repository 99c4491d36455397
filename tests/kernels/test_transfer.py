"""Host <-> device copies that do not wait for the device (`kernels.transfer`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kernels.transfer import to_device, to_device_tensor, to_host

ROOT = Path(__file__).resolve().parents[2]
# The modules a step's launch runs through: a list turned into a device tensor there goes through
# kernels.transfer, never torch.tensor(..., device=...) or a blocking .to(device).
STEP_PATH = ["engine/sampler.py", "engine/sampling.py", "engine/penalties.py", "engine/model_runner.py",
             "engine/input_batch.py", "engine/forks.py", "engine/overlap.py", "engine/cuda_graphs.py",
             "kernels/triton_prefill.py", "kernels/triton_attention.py", "kernels/triton_fused.py", "kernels/fused.py", "engine/kv_cache.py"]


def test_on_a_cpu_they_are_the_plain_calls():
    assert torch.equal(to_device([1, 2, 3], torch.int64, torch.device("cpu")), torch.tensor([1, 2, 3]))
    values = to_device([0.5, 2.0], torch.float32, torch.device("cpu"))
    assert values.dtype == torch.float32 and values.tolist() == [0.5, 2.0]
    host = torch.arange(4)
    assert to_device_tensor(host, torch.device("cpu")) is host and to_host(host) is host


def _blocking_copies(source: str) -> list[int]:
    """Lines of the calls that copy host data to a device and wait: `torch.tensor` / `torch.as_tensor` with a
    `device`, `.to(...)` given a device (positionally or by keyword) without `non_blocking=True`, `.cuda()`.
    Read from the syntax tree: a call over several lines, or with parentheses inside, is seen whole."""
    def names_device(node: ast.AST) -> bool:
        return "device" in ast.unparse(node)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        attr, owner = node.func.attr, ast.unparse(node.func.value)
        if attr in ("tensor", "as_tensor") and owner == "torch" and "device" in keywords:
            lines.append(node.lineno)
        elif attr == "to" and ("device" in keywords or any(names_device(a) for a in node.args[:1])):
            waits = keywords.get("non_blocking")
            if not (isinstance(waits, ast.Constant) and waits.value is True):
                lines.append(node.lineno)
        elif attr == "cuda" and not node.args:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_step_path_makes_no_blocking_copy_to_the_device():
    found = {name: lines for name in STEP_PATH
             if (lines := _blocking_copies((ROOT / name).read_text(encoding="utf-8")))}
    assert found == {}
    caught = """
ids = torch.tensor(list(input_ids), device=self.device)
packed = packed.to(self.device, torch.int64)
table = torch.as_tensor(rows,
                        device=device)
x = y.to(device=dev)
z = w.cuda()
fine = a.to(self.device, non_blocking=True)
cast = b.to(torch.int64)
"""
    assert _blocking_copies(caught) == [2, 3, 4, 6, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_nothing_waits_for_the_stream():
    device = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = to_device([5, 6, 7], torch.int64, device)
        table = to_device_tensor(torch.arange(8, dtype=torch.int32), device)
        back = to_host(ids * 2)
        event = torch.cuda.Event()
        event.record()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    event.synchronize()
    assert back.tolist() == [10, 12, 14] and table.device.type == "cuda" and back.is_pinned()
