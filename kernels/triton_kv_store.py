"""Triton `store_kv`: scatter each new token's K and V into its slot of the paged cache.

Same semantics as `kernels.reference.store_kv`: slot = block_id * block_size + offset, and a negative
slot (-1) is skipped. The cache may be a strided view (`KVCache.data[layer, 0]`), so every stride is
passed to the kernel. Any head_dim: the kernel spans `HEAD_DIM_PAD` (the next power of two, which
`tl.arange` needs) and masks the lanes past the real `HEAD_DIM`; a power-of-two head_dim pads nothing.

An FP8 cache (`reference.FP8_KV_DTYPE`, float8_e4m3fn) holds `reference.quantize_kv`'s values, byte for
byte: x / scale in float32 (IEEE division), saturated to +-FP8_MAX, rounded to nearest even. The kernel
rounds onto the e4m3 grid itself (`_quantize_e4m3`) and only then converts: Triton's interpreter (3.9)
rounds float32 -> float8e4nv half away from zero, and wrongly where the mantissa carries (-124 became -64),
so the conversion is handed values it holds exactly, on the GPU as in the interpreter. Other caches store
x converted to their dtype (the scales are not used), as before.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import FP8_KV_DTYPE, FP8_MAX

__all__ = ["check_kv_dtype", "dequantize_e4m3", "store_kv"]

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantize_e4m3(x, scale):
    """float32 x -> float8e4nv x / scale as `reference.quantize_kv` gives it: IEEE division, saturated to
    +-FP8_MAX (NaN kept), rounded to nearest even. The rounding adds and subtracts 2^(e + 20), e the
    exponent of |x| (at least -6, e4m3's smallest normal): the float32 sum's last bit is then e4m3's step
    at that exponent, 2^(e - 3) (2^-9 among the subnormals), so the hardware's round-to-nearest-even
    addition rounds |x| onto the e4m3 grid, ties to an even e4m3 mantissa."""
    x = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.minimum(tl.maximum((bits >> 23) & 0xFF, 127 - 6), 127 + 8)    # biased, at most 448's (a NaN's 255 too)
    magic = ((exp + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded).to(tl.float8e4nv)        # exact: on the grid (-0 stays -0)


@triton.jit
def dequantize_e4m3(x, scale, DTYPE: tl.constexpr):
    """Cached float8e4nv values as the attention reads them (`reference.dequantize_kv`): x * scale in
    float32, rounded once to DTYPE (the query's type)."""
    return (x.to(tl.float32) * scale).to(DTYPE)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads, k_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)); one program copies BLOCK_H heads of one token.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tok = token.to(tl.int64)
        k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask)
        k_dst = (k_cache_ptr + block * stride_kcb + offset * stride_kcs
                 + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd)
        v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs
                 + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd)
        if KV_FP8:   # quantized over the scales; the scales are not used otherwise
            k = _quantize_e4m3(k.to(tl.float32), k_scale)
            v = _quantize_e4m3(v.to(tl.float32), v_scale)
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K and V into its slot; tokens whose slot is negative are skipped. An FP8 cache
    (float8_e4m3fn) stores K / k_scale and V / v_scale (`reference.quantize_kv`); other caches ignore the scales.

    key, value: [num_tokens, num_kv_heads, head_dim] float (any strides; head_dim contiguous, of any size)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (may be strided views)
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = k_cache.shape[:2]
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim), \
        f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit key {tuple(key.shape)}"
    assert block_size == meta.block_size, f"cache block_size {block_size} != metadata's {meta.block_size}"
    assert meta.slot_mapping.shape == (num_tokens,), \
        f"slot_mapping {tuple(meta.slot_mapping.shape)} for {num_tokens} tokens"
    assert meta.slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {meta.slot_mapping.dtype}"
    assert key.dtype == value.dtype and k_cache.dtype == v_cache.dtype, "key/value or cache dtypes differ"
    check_kv_dtype(k_cache.dtype, k_scale, v_scale)
    assert key.dtype.is_floating_point and key.dtype.itemsize > 1, f"key dtype {key.dtype}"
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous, strides {t.stride()}"
        assert t.device == key.device, f"{name} on {t.device}, key on {key.device}"
    assert meta.slot_mapping.device == key.device, "slot_mapping on another device"
    if num_tokens == 0:
        return
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, meta.slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, float(k_scale), float(v_scale),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def check_kv_dtype(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Assert a cache dtype the kernels read and write: a float type of 16 bits or more, or FP8 e4m3fn
    (`reference.FP8_KV_DTYPE`), whose scales must then be positive and finite (other caches ignore them)."""
    assert cache_dtype.is_floating_point and (cache_dtype.itemsize > 1 or cache_dtype == FP8_KV_DTYPE), \
        f"cache dtype {cache_dtype}: a float type, or {FP8_KV_DTYPE} for an FP8 cache"
    if cache_dtype == FP8_KV_DTYPE:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert math.isfinite(value) and value > 0, f"{name} {value}: an FP8 cache's scale is positive and finite"
