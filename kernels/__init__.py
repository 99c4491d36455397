"""Attention kernels over the paged KV cache, and the dispatch that picks an implementation.

`get_backend(device)` returns the module whose `store_kv` and `paged_attention` the model calls.
Today that is the torch reference (`kernels.reference`) everywhere; the Triton kernels plug in here,
chosen on CUDA (or through the interpreter when `CLIFFGUARD_ATTENTION_BACKEND=triton`).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

BACKENDS = ("torch",)

__all__ = ["AttentionMetadata", "BACKENDS", "get_backend", "reference"]


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel module for `device`; `CLIFFGUARD_ATTENTION_BACKEND` overrides the choice."""
    name = os.environ.get("CLIFFGUARD_ATTENTION_BACKEND", "torch")
    if name not in BACKENDS:
        raise ValueError(
            f"CLIFFGUARD_ATTENTION_BACKEND: unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return reference
