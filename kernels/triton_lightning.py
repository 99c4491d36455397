"""Lightning attention over one sequence's new tokens (`kernels.lightning.chunked`: MiniMax-Text-01's and
MiniMax-M1's linear attention) in Triton (CUDA; the interpreter in tests): one launch a call whatever the length,
where the torch form runs a handful of launches a block.

`_lightning_kernel`, a program per (head, block of `BLOCK_V` value channels), walks the chunks in order holding its
columns of the head's state S [head_dim, BLOCK_V] (float32) in registers: per chunk the outputs (q k^T x exp(-s (i -
j)), causal) v + (q exp(-s (i + 1))) S, and the state carried on, S exp(-s n) + (k exp(-s (n - 1 - i)))^T v, n the
chunk's tokens. The dots are IEEE float32 for float32 inputs, TF32 on float32 tiles for a 16-bit model's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunked"]

BLOCK_V = 32   # value channels a program holds
CHUNK = 32
NUM_WARPS = 8


@triton.jit(do_not_specialize=["num_tokens"])
def _lightning_kernel(q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, out_ptr, state_out_ptr, num_tokens,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      D: tl.constexpr, DP: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # grid: (heads, cdiv(D, BLOCK_V)); state [heads, D, D], out [T, heads, D] float32, contiguous
    h, vb = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(0)
    dk, dv = tl.arange(0, DP), vb * BLOCK_V + tl.arange(0, BLOCK_V)
    square = dk[:, None] * D + dv[None, :]
    in_state = (dk[:, None] < D) & (dv[None, :] < D)
    state = tl.load(state_ptr + h * D * D + square, mask=in_state, other=0.0)
    rate = tl.load(slope_ptr + h).to(tl.float32)
    steps = tl.arange(0, CHUNK).to(tl.float32)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    pair = tl.exp(tl.where(i >= j, -rate * (i - j).to(tl.float32), float("-inf")))
    for c in range(0, tl.cdiv(num_tokens, CHUNK)):
        rows = c * CHUNK + tl.arange(0, CHUNK)
        live = rows < num_tokens
        n = tl.minimum(num_tokens - c * CHUNK, CHUNK).to(tl.float32)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dk[None, :],
                    mask=live[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + dk[None, :],
                    mask=live[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=live[:, None] & (dv[None, :] < D), other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pair
        out = tl.dot(scores, v, input_precision=DOT_PRECISION) + \
            tl.dot(q * tl.exp(-rate * (steps + 1.0))[:, None], state, input_precision=DOT_PRECISION)
        tl.store(out_ptr + (rows[:, None] * heads + h) * D + dv[None, :], out, mask=live[:, None] & (dv[None, :] < D))
        to_end = k * tl.exp(-rate * (n - 1.0 - steps))[:, None]
        state = state * tl.exp(-rate * n) + tl.dot(tl.trans(to_end), v, input_precision=DOT_PRECISION)
    tl.store(state_out_ptr + h * D * D + square, state, mask=in_state)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.lightning.chunked`'s contract: q, k, v [num_tokens, num_heads, head_dim]; slopes [num_heads]
    (float32); ssm [num_heads, head_dim, head_dim] float32 -> (out [num_tokens, num_heads, head_dim] float32, the
    state after the last token). `chunk`: a power of two of at least 16."""
    num_tokens, heads, d = v.shape
    if not (q.shape == k.shape == v.shape and slopes.shape == (heads,) and ssm.shape == (heads, d, d)):
        raise ValueError(f"lightning kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, slopes "
                         f"{tuple(slopes.shape)}, ssm {tuple(ssm.shape)} do not agree")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"lightning kernel: chunk must be a power of two of at least 16, got {chunk}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(num_tokens, heads, d, dtype=torch.float32, device=v.device)
    state = torch.empty(heads, d, d, dtype=torch.float32, device=v.device)
    dp = max(16, triton.next_power_of_2(d))
    block_v = min(BLOCK_V, dp)
    _lightning_kernel[(heads, triton.cdiv(d, block_v))](
        q, k, v, slopes.float().contiguous(), ssm.float().contiguous(), out, state, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), D=d, DP=dp, BLOCK_V=block_v,
        CHUNK=chunk, DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS)
    return out, state
