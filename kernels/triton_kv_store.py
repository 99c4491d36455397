"""Triton `store_kv`: scatter each new token's K and V into its slot of the paged cache.

Same semantics as `kernels.reference.store_kv`: slot = block_id * block_size + offset, and a negative
slot (-1) is skipped. The cache may be a strided view (`KVCache.data[layer, 0]`), so every stride is
passed to the kernel. Any head_dim: the kernel spans `HEAD_DIM_PAD` (the next power of two, which
`tl.arange` needs) and masks the lanes past the real `HEAD_DIM`; a power-of-two head_dim pads nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
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
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Write each token's K and V into its slot; tokens whose slot is negative are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim] (any strides; head_dim contiguous, of any size)
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
    assert key.dtype.is_floating_point and k_cache.dtype.is_floating_point
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
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
