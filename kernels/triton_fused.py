"""Triton kernels for the decoder layer's small ops, each beside its launcher: residual add + RMSNorm,
rotary embedding of q and k in place, SiLU x mul.

Same functions and contracts as the torch versions in `kernels.fused` (the yardstick), which
`kernels.fused.get_fused_ops` swaps for these on CUDA. Every kernel computes in float32 and follows
transformers' roundings where they matter: the residual sum and the normalised row are rounded to the
model's dtype before the next step (so `weight * normed` is the same product as transformers'), and so
is silu before the product with up, and rotary's two products before their sum (one rounding of the
whole was an ulp away in a quarter of the elements, enough to change a greedy path).

Any size: a row (hidden size, half a head_dim for rotary, the MLP width) that is not a power of two is
padded inside the kernel to the next one (`tl.arange` needs it) and the lanes past it are masked, loaded
as 0 (nothing added to a norm's sum of squares) and never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import INTERPRETED

__all__ = ["INTERPRETED", "add_rms_norm", "rms_norm", "rotary", "rotary_rows", "silu_and_mul"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- RMSNorm, with the residual add fused -----------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_xt, stride_rt, stride_ot,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # grid: (num_tokens,); one program normalises one row.
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask = offs_h < hidden_size
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xt + offs_h, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + offs_h, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(dtype)
        tl.store(residual_ptr + row * stride_rt + offs_h, total, mask=mask)
        x = total.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs_h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs_h, (normed * w).to(dtype), mask=mask)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), \
        f"x {tuple(x.shape)} must be [num_tokens, hidden_size], weight {tuple(weight.shape)} [hidden_size]"
    assert x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype, f"dtypes x {x.dtype}, weight {weight.dtype}"
    assert x.stride(1) == 1 and weight.stride(0) == 1, f"rows must be contiguous: x {x.stride()}"
    assert weight.device == x.device, f"weight on {weight.device}, x on {x.device}"


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    num_tokens, hidden_size = x.shape
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(hidden_size)
    has_residual = residual is not None
    residual = residual if has_residual else x   # not read without HAS_RESIDUAL
    _rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out,
        x.stride(0), residual.stride(0), out.stride(0),
        hidden_size, eps,
        HAS_RESIDUAL=has_residual, BLOCK_H=block_h,
        num_warps=min(16, max(1, block_h // 256)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden_size], weight: [hidden_size] -> a new [num_tokens, hidden_size]."""
    _check_norm_args(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_norm(x, None, weight, eps, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch; x, residual: [num_tokens, hidden_size].

    `residual` becomes `x + residual` in place, and the normalised rows are written over `x`: both
    returned."""
    _check_norm_args(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1, \
        f"residual {tuple(residual.shape)} {residual.dtype} strides {residual.stride()} does not fit x"
    assert residual.device == x.device and residual.data_ptr() != x.data_ptr(), "residual must be its own tensor"
    _launch_norm(x, residual, weight, eps, x)
    return x, residual


# --- rotary embedding --------------------------------------------------------------------------
@triton.jit
def _rotary_kernel(
    qk_ptr, rows_ptr,
    stride_qt, stride_qh, stride_rt,
    num_heads,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # grid: (num_tokens, cdiv(num_heads, BLOCK_H)); one program turns BLOCK_H heads of one token.
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(rows_ptr + token * stride_rt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(rows_ptr + token * stride_rt + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    first = qk_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qk_ptr.dtype.element_ty
    # transformers' roundings: each product to the dtype, then their sum (`x * cos + rotate_half(x) * sin`);
    # one rounding of the whole is an ulp away in a quarter of the elements, enough to change a greedy path
    a1 = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    b1 = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    a2 = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    b2 = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(first, (a1 - b1).to(dtype), mask=mask)
    tl.store(first + HALF, (a2 + b2).to(dtype), mask=mask)


def rotary_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """cos_sin_cache: [max_positions, head_dim], positions: [num_tokens] -> rows [num_tokens, head_dim]
    (each token's cache row, gathered once per forward for every layer's `rotary`)."""
    return cos_sin_cache.index_select(0, positions)


def rotary(query_key: torch.Tensor, rows: torch.Tensor) -> None:
    """Rotate q and k in place, one launch: query_key [num_tokens, num_heads, head_dim] (head_dim
    contiguous and even, of any size: the kernel pads head_dim // 2 to a power of two, masked; the q and
    k heads of the qkv projection's output), rows [num_tokens, head_dim] from `rotary_rows` (cos, then sin)."""
    num_tokens, num_heads, head_dim = query_key.shape
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert rows.shape == (num_tokens, head_dim), f"rows {tuple(rows.shape)} for query_key {tuple(query_key.shape)}"
    assert query_key.dtype in _FLOAT_DTYPES and rows.dtype == query_key.dtype, \
        f"dtypes query_key {query_key.dtype}, rows {rows.dtype}"
    assert query_key.stride(2) == 1 and rows.stride(1) == 1, \
        f"head_dim must be contiguous: query_key {query_key.stride()}, rows {rows.stride()}"
    assert rows.device == query_key.device, f"rows on {rows.device}, query_key on {query_key.device}"
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        query_key, rows,
        query_key.stride(0), query_key.stride(1), rows.stride(0),
        num_heads,
        HALF=head_dim // 2, BLOCK_D=block_d, BLOCK_H=block_h,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


# --- SiLU x mul --------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_xt, stride_ot,
    size,
    BLOCK: tl.constexpr,
):
    # grid: (num_tokens, cdiv(size, BLOCK)); one program writes BLOCK outputs of one token.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    gate = tl.load(x_ptr + token * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + size + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * size] (gate, then up) -> silu(gate) * up, a new [num_tokens, size]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x {tuple(x.shape)} must be [num_tokens, 2 * size]"
    assert x.dtype in _FLOAT_DTYPES, f"dtype {x.dtype}"
    assert x.stride(1) == 1, f"rows must be contiguous: x {x.stride()}"
    num_tokens, size = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
        x, out, x.stride(0), out.stride(0), size,
        BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out
