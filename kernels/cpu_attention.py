"""The CPU backend: decode attention by our own C kernel, reading K/V in place through the block table.

The torch reference (`kernels.reference`) does a decode token's attention as a gather of its K/V slots
into new tensors and one SDPA call per group of similar lengths: at a 64-sequence batch of short contexts
that is three large ops and ~250 us a layer on one thread, more than the layer's four matmuls. The kernel
in `cpu_attention.c` scores each GQA group's query heads against the cached keys where they lie, takes
the softmax in float32 and sums V, all decode tokens of a step in one call.

It is compiled once per machine with the system's C compiler (`cc`, or `$CC`) into
`~/.cache/cliffguard/kernels` (`$CLIFFGUARD_KERNEL_CACHE`), the file named by a hash of its source, the
flags and the machine, and loaded with ctypes (the call releases the GIL). Without a compiler, or for a
dtype it does not take (float32 and bfloat16), decode tokens take the reference's path. Prefill chunks
always do (torch's CPU flash kernel is already what they need); `store_kv` is the reference's.

`get_backend` picks this module on a CPU device (`CLIFFGUARD_ATTENTION_BACKEND=torch` picks the pure
reference). Results equal the reference up to float32 summation order (tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import decode_attention as reference_decode_attention
from kernels.reference import prefill_attention, store_kv

__all__ = ["paged_attention", "store_kv", "load_library"]

log = logging.getLogger("cliffguard.kernels")

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-shared")
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 8 + [_I64] * 6 + [ctypes.c_float, _I64]


def _cache_dir() -> Path:
    env = os.environ.get("CLIFFGUARD_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cliffguard" / "kernels"


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by two CPUs keeps both)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (compiled now if this machine has no copy yet), or None without a compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: CPU decode attention takes the torch reference's path")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _machine().encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_attention-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            try:
                result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                                        capture_output=True, text=True)
                error = result.stderr[-2000:] if result.returncode != 0 else None
            except OSError as exc:
                error = str(exc)
            if error is not None:
                log.warning("compiling %s failed (%s): CPU decode attention takes the torch reference's path\n%s",
                            SOURCE.name, compiler, error)
                return None
            os.replace(built, path)   # atomic: a concurrent compile leaves one whole file
    library = ctypes.CDLL(str(path))
    for name in _FUNCTIONS.values():
        getattr(library, name).argtypes = _ARGTYPES
        getattr(library, name).restype = ctypes.c_int
    return library


def _decode_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's decode tokens as (query rows [n] int64, their sequences [n] int32), once per step."""
    plan = meta.backend_cache.get("cpu")
    if plan is None:
        rows, seqs, start = [], [], 0
        for i, q_len in enumerate(meta.query_lens_list):
            if q_len == 1:
                rows.append(start)
                seqs.append(i)
            start += q_len
        plan = (torch.tensor(rows, dtype=torch.int64), torch.tensor(seqs, dtype=torch.int32)) if rows else ()
        meta.backend_cache["cpu"] = plan
    return plan or None


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, sliding_window: int | None, out: torch.Tensor) -> bool:
    """The step's decode tokens through the C kernel, into their rows of `out`; False (nothing done) when
    the kernel cannot take them (no compiler, a dtype it lacks, tensors not laid out as it reads them)."""
    function = _FUNCTIONS.get(query.dtype)
    library = load_library() if function is not None else None
    if library is None or k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        return False
    tensors = (query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        return False
    plan = _decode_plan(meta)
    if plan is None:
        return True
    rows, seqs = plan
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    assert kv_dim == head_dim and num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape, \
        (query.shape, k_cache.shape, v_cache.shape)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert meta.block_tables.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    status = getattr(library, function)(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), meta.block_tables.data_ptr(),
        meta.seq_lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(), len(rows), num_heads, num_kv_heads, head_dim,
        block_size, meta.block_tables.shape[1], scale, sliding_window or 0)
    if status != 0:
        raise MemoryError("cpu_attention: the kernel could not allocate its score buffer")
    return True


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """`kernels.reference.paged_attention`'s contract; decode tokens by the C kernel where it can take them.

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(query)
    if not decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, out):
        reference_decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, out)
    prefill_attention(query, k_cache, v_cache, meta, scale, sliding_window, out)
    return out
