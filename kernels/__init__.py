"""Attention kernels over the paged KV cache, and the dispatch that picks an implementation.

`get_backend(device)` returns the module whose `store_kv` and `paged_attention` the model calls: the
Triton kernels (`kernels.triton_attention`, which re-exports `kernels.triton_kv_store.store_kv`) on
CUDA when triton imports; on a CPU `kernels.cpu_attention` (decode tokens by our C kernel, compiled
once per machine, the rest by the reference); the torch reference (`kernels.reference`) elsewhere.
`CLIFFGUARD_ATTENTION_BACKEND=torch|cpu|triton` overrides the choice; Triton on a CPU device runs through
its interpreter, which must be switched on with `TRITON_INTERPRET=1` before triton is first imported.
Triton is imported only when chosen, so CPU users need not install it.

Hugging Face's `kernels` distribution (which transformers 5.25 and later require) has this package's
import name: installed beside it, one shadows the other, so its presence is refused here at import, by
name, rather than left to fail inside transformers' imports (`refuse_namesake`).
"""

from __future__ import annotations

import importlib.metadata
import os
from types import ModuleType

import torch


def refuse_namesake() -> None:
    """An ImportError naming the fix if a distribution named `kernels` is installed (this package is the
    `cliffguard` distribution's: no distribution of its own)."""
    try:
        namesake = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"the distribution 'kernels' {namesake.version} (Hugging Face's hub kernels) is installed beside "
        "cliffguard, whose own top-level package is named kernels: one shadows the other. Uninstall it "
        "(pip uninstall kernels); cliffguard asks for transformers<5.25, which does not need it")


refuse_namesake()

from kernels import reference  # noqa: E402
from kernels.metadata import BLOCK_SIZES, AttentionMetadata  # noqa: E402

BACKENDS = ("torch", "cpu", "triton")

__all__ = ["AttentionMetadata", "BACKENDS", "BLOCK_SIZES", "get_backend", "reference"]


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel module for `device`; `CLIFFGUARD_ATTENTION_BACKEND` overrides the choice.

    Either backend module has `store_kv(key, value, k_cache, v_cache, meta)` and
    `paged_attention(query, k_cache, v_cache, meta, scale, sliding_window=None, *, k_scale, v_scale, softcap)`;
    the Triton one's also takes ALiBi's slopes (`alibi`), which the others' leave to `kernels.alibi`.
    """
    device = torch.device(device)
    name = os.environ.get("CLIFFGUARD_ATTENTION_BACKEND") or None
    if name is not None and name not in BACKENDS:
        raise ValueError(
            f"CLIFFGUARD_ATTENTION_BACKEND: unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    if name == "torch" or (name is None and device.type not in ("cuda", "cpu")):
        return reference
    if name == "cpu" or (name is None and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"CLIFFGUARD_ATTENTION_BACKEND=cpu: the CPU kernels cannot run on a {device.type} device")
        from kernels import cpu_attention

        return cpu_attention
    try:
        from kernels import triton_attention
    except ImportError as exc:
        if name is None:
            return reference
        raise RuntimeError("CLIFFGUARD_ATTENTION_BACKEND=triton: triton is not installed "
                           "(pip install triton, or the project's test extra)") from exc
    if device.type != "cuda" and not triton_attention.INTERPRETED:
        raise RuntimeError(
            f"CLIFFGUARD_ATTENTION_BACKEND=triton on a {device.type} device needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 in the environment before triton is first imported")
    return triton_attention

