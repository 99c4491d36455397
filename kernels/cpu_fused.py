"""The decoder layer's small fused ops on the CPU, each one call of our C code (`cpu_fused.c`).

Same functions and contracts as `kernels.fused` (the torch versions, and the yardstick): `rms_norm`,
`add_rms_norm`, `rotary_rows`, `rotary`, `silu_and_mul`. In torch each is 3 to 7 operators on the CPU
(`F.rms_norm` alone is five kernels there), at ~2 us of dispatch each; here each is one ctypes call of
about the same cost, so a layer's small ops cost what one of them did. Float32 and bfloat16, rounded
where transformers' ops round (the file is compiled without -ffast-math and without contracting a
multiply and an add into an FMA). `kernels.fused.get_fused_ops` picks this module on a CPU device for
those dtypes when the library compiled (`kernels.cpu_build`); tests/kernels/test_cpu_fused.py compares
every function with `kernels.fused`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels.cpu_build import load_c_library

__all__ = ["add_rms_norm", "load_library", "rms_norm", "rotary", "rotary_rows", "silu_and_mul", "supports"]

SOURCE = Path(__file__).with_name("cpu_fused.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = {
    "rms_norm": [_P] * 4 + [_I64] * 5 + [_F],
    "rotary": [_P] * 2 + [_I64] * 4,
    "silu_and_mul": [_P] * 2 + [_I64] * 4,
}
_STORE_ARGTYPES = [_P] * 5 + [_I64] * 5


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled ops (compiled now if this machine has no copy yet), or None without a compiler."""
    functions = {f"{name}_{suffix}": types for name, types in _ARGTYPES.items() for suffix in _SUFFIX.values()}
    return load_c_library(SOURCE, FLAGS, {**functions, "store_kv": _STORE_ARGTYPES})


def supports(dtype: torch.dtype) -> bool:
    """Whether these ops run for a model in `dtype` on this machine."""
    return dtype in _SUFFIX and load_library() is not None


@functools.cache
def _function(name: str, dtype: torch.dtype):
    return getattr(load_library(), f"{name}_{_SUFFIX[dtype]}")


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x, residual: [num_tokens, hidden_size], each row contiguous (rows may be strided); weight: [hidden_size]
    num_tokens, size = x.shape
    out = torch.empty(num_tokens, size, dtype=x.dtype)
    assert x.stride(1) == 1 and weight.stride(0) == 1 and weight.shape[0] == size and weight.dtype == x.dtype, \
        (x.shape, x.stride(), weight.shape, weight.dtype)
    if residual is None:
        _function("rms_norm", x.dtype)(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), num_tokens, size,
                                       x.stride(0), 0, size, eps)
        return out
    assert residual.stride(1) == 1 and residual.shape == x.shape and residual.dtype == x.dtype, \
        (residual.shape, residual.stride(), residual.dtype)
    _function("rms_norm", x.dtype)(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), num_tokens,
                                   size, x.stride(0), residual.stride(0), size, eps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden_size], weight: [hidden_size] -> a new [num_tokens, hidden_size] (one call)."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), `residual` updated in place (one call)."""
    return _norm(x, residual, weight, eps), residual


def rotary_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """cos_sin_cache: [max_positions, head_dim], positions: [num_tokens] -> the step's rows, [num_tokens,
    head_dim] contiguous (one operator, once per forward)."""
    return cos_sin_cache.index_select(0, positions)


def rotary(query_key: torch.Tensor, rows: torch.Tensor) -> None:
    """Rotate q and k in place: query_key [num_tokens, num_heads, head_dim] (heads contiguous within a token;
    the q and k heads of the qkv projection's output), rows from `rotary_rows` (one call)."""
    num_tokens, num_heads, head_dim = query_key.shape
    assert query_key.stride(2) == 1 and query_key.stride(1) == head_dim and rows.dtype == query_key.dtype \
        and rows.shape[0] == num_tokens and rows.stride(0) == head_dim, (query_key.stride(), rows.shape, rows.stride())
    _function("rotary", query_key.dtype)(query_key.data_ptr(), rows.data_ptr(), num_tokens, num_heads, head_dim,
                                         query_key.stride(0))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * size] (gate, then up) -> silu(gate) * up, a new [num_tokens, size] (one call)."""
    num_tokens, width = x.shape
    out = torch.empty(num_tokens, width // 2, dtype=x.dtype)
    assert x.stride(1) == 1, x.stride()
    _function("silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), num_tokens, width // 2, x.stride(0), width // 2)
    return out


def store_kv_rows(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> bool:
    """Each token's K and V rows into its slot (a negative slot skipped), one call; False (nothing done)
    when the tensors are not laid out as it copies them. key, value: [num_tokens, num_kv_heads, head_dim]
    (tokens may be strided); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slots [num_tokens]."""
    library = load_library()
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    layout_ok = (library is not None and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
                 and key.stride(2) == 1 and key.stride(1) == head_dim and value.stride(2) == 1
                 and value.stride(1) == head_dim and value.shape == key.shape and k_cache.is_contiguous()
                 and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
                 and k_cache.shape[2] * k_cache.shape[3] == row
                 and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (num_tokens,))
    if not layout_ok:
        return False
    size = key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if library.store_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                        num_tokens, num_slots, row * size, key.stride(0) * size, value.stride(0) * size):
        raise IndexError(f"store_kv: a slot past the cache's {num_slots} slots")
    return True
