"""Host <-> device copies that do not wait for the device.

On CUDA a plain `torch.tensor(values, device=cuda)` or `cpu_tensor.to(cuda)` copies from pageable memory
and then synchronizes the stream: PyTorch waits for the copy, and the copy waits behind every kernel
queued before it. In a step's path that stalls the host until the forward pass just launched is done,
so the host can prepare nothing while the device computes. From pinned memory with `non_blocking=True`
the copy is queued like a kernel and the host goes on; PyTorch's pinned-memory cache keeps the staging
buffer until the copy has run. Elsewhere (a CPU device) these are the plain calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device", "to_device_tensor", "to_host"]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, queued rather than waited for on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued rather than waited for on CUDA (it is copied to pinned memory first)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor in pinned host memory, queued behind the work before it: read it only after
    an event recorded after this call has completed. Elsewhere the tensor itself."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
