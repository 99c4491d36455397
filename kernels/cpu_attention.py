"""The CPU backend: decode attention by our own C kernel, reading K/V in place through the block table.

The torch reference (`kernels.reference`) does a decode token's attention as a gather of its K/V slots
into new tensors and one SDPA call per group of similar lengths: at a 64-sequence batch of short contexts
that is three large ops and ~250 us a layer on one thread, more than the layer's four matmuls. The kernel
in `cpu_attention.c` scores each GQA group's query heads against the cached keys where they lie, takes
the softmax in float32 and sums V, all decode tokens of a step in one call.

A layer's decode rows run on torch's own OpenMP threads when there is more than one and the layer reads at
least `split_min_bytes` of K/V (256 KiB): contiguous runs of rows near equal in the K/V they read, one a thread,
each the same code on its rows, so the same bits as one call. That needs the library built with `-fopenmp`
where the libgomp torch loaded is the one it links (a Linux build of torch: then the team that runs torch's
matmuls, already spinning between ops, runs the runs too; a team of its own would share the cores with
those spinning threads and lose: a split over a Python thread measured 0.95x a step). Elsewhere it is built
without, and each call takes its rows on the calling thread. SmolLM2-135M in float32 on two threads, steps
alternating (docs/PERF.md): 1.22x at 4 rows of 1,000 tokens, 1.40x at 8 of 1,500, 1.17x at 64 of 100. As with
torch's own ops, a process forked after it ran a parallel region must not run one (GNU OpenMP's threads stay
the parent's: the child waits for ever); workers are forked from the fork server, which runs none.

It is compiled once per machine (`kernels.cpu_build`) and called through ctypes. Without a compiler, or
for a dtype it does not take (float32 and bfloat16), decode tokens take the reference's path. Prefill chunks
always do (torch's CPU flash kernel is already what they need). `store_kv` copies each token's K/V row
in one call of `cpu_fused.c` (the reference's two `index_copy_` otherwise).

`get_backend` picks this module on a CPU device (`CLIFFGUARD_ATTENTION_BACKEND=torch` picks the pure
reference). Results equal the reference up to float32 summation order (tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from kernels.cpu_build import load_c_library
from kernels.cpu_fused import store_kv_rows
from kernels.metadata import AttentionMetadata
from kernels.reference import decode_attention as reference_decode_attention
from kernels.reference import prefill_attention
from kernels.reference import store_kv as reference_store_kv

__all__ = ["decode_plan", "paged_attention", "store_kv", "load_library"]

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math")
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 8 + [_I64] * 7 + [ctypes.c_float, _I64]


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (compiled now if this machine has no copy yet), or None without a compiler: built
    with OpenMP where torch's libgomp is loaded (module docstring), without it where that build fails or
    does not load."""
    functions = {name: _ARGTYPES for name in _FUNCTIONS.values()}
    if torch_libgomp_loaded():
        library = load_c_library(SOURCE, (*FLAGS, "-fopenmp"), functions, link_flags=("-fopenmp",))
        if library is not None:
            return library
    return load_c_library(SOURCE, FLAGS, functions)


def torch_libgomp_loaded() -> bool:
    """Whether this process has GNU OpenMP's runtime loaded (torch's Linux builds bring it): a library linked
    with -fopenmp then joins that runtime, and its threads, instead of loading a second."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("/libgomp" in line for line in maps)
    except OSError:
        return False


def decode_threads() -> int:
    """The threads a layer's decode rows may be split over now (torch's count), 0 where the kernel is built
    without OpenMP or not at all."""
    library = load_library()
    return library.decode_threads() if library is not None else 0


@contextlib.contextmanager
def split_min_bytes(value: int) -> Iterator[None]:
    """The K/V bytes a layer must read for its decode rows to be split, set to `value` meanwhile (tests force
    the split on small shapes with 0 and keep it off with a huge one)."""
    knob = ctypes.c_int64.in_dll(load_library(), "split_min_bytes")
    before, knob.value = knob.value, value
    try:
        yield
    finally:
        knob.value = before


def decode_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
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
                     scale: float, sliding_window: int | None, out: torch.Tensor, chunk: int | None = None) -> bool:
    """The step's decode tokens through the C kernel, into their rows of `out`; False (nothing done) when
    the kernel cannot take them (no compiler, a dtype it lacks, tensors not laid out as it reads them, a window
    and a chunk both). The kernel's `window` argument: the sliding window, or -chunk (chunked attention)."""
    function = _FUNCTIONS.get(query.dtype)
    library = load_library() if function is not None else None
    if library is None or k_cache.dtype != query.dtype or v_cache.dtype != query.dtype \
            or (sliding_window is not None and chunk is not None):
        return False
    tensors = (k_cache, v_cache, out, meta.block_tables, meta.seq_lens)
    rows_ok = query.stride(2) == 1 and query.stride(1) == query.shape[2]   # tokens may be strided (a qkv slice)
    if not (rows_ok and query.device.type == "cpu" and all(t.is_contiguous() and t.device.type == "cpu"
                                                          for t in tensors)):
        return False
    plan = decode_plan(meta)
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
        meta.seq_lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(), len(rows), query.stride(0), num_heads,
        num_kv_heads, head_dim, block_size, meta.block_tables.shape[1], scale,
        -chunk if chunk is not None else sliding_window or 0)
    if status != 0:
        raise MemoryError("cpu_attention: the kernel could not allocate its score buffer")
    return True


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`kernels.reference.store_kv`'s contract in one call of our C code where the layout allows (an FP8
    cache, whose values are converted, goes through the reference).

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    if not store_kv_rows(key, value, k_cache, v_cache, meta.slot_mapping):
        reference_store_kv(key, value, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, *, k_scale: float = 1.0,
                    v_scale: float = 1.0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """`kernels.reference.paged_attention`'s contract; decode tokens by the C kernel where it can take them
    (not from an FP8 cache, nor with capped scores or attention sinks: the reference reads those).

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    eager = bool(softcap) or sinks is not None
    if eager or not decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, chunk):
        reference_decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, k_scale=k_scale,
                                   v_scale=v_scale, softcap=softcap, sinks=sinks, chunk=chunk)
    prefill_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, k_scale=k_scale, v_scale=v_scale,
                      softcap=softcap, sinks=sinks, chunk=chunk)
    return out
