"""Mamba-1's selective scan in Triton (CUDA; the interpreter in tests): `kernels.selective_scan.scan`'s recurrence
for one sequence's new tokens, which its torch form runs as a loop of a launch a token (a 65,536-token prompt would
be that many launches a layer).

`_selective_scan_kernel`, a program per `BLOCK_C` channels, holds those channels' states [BLOCK_C, d_state] in
registers (float32) and walks the tokens in order: each token's x, dt, B and C are loaded, the state decayed by
exp(dt A) and fed dt B x, and y = C . h + D x stored; the state after the last token is stored once. The channels are
independent, so the programs never meet; a sequence's tokens are serial within one (mamba_ssm's kernel splits them
in chunks for the same reason the decays differ per state entry: nothing cheaper carries a state across a chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scan"]

BLOCK_C = 32   # channels a program scans


@triton.jit(do_not_specialize=["num_tokens"])
def _selective_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, y_ptr, state_out_ptr, num_tokens, channels,
    stride_xt, stride_dtt, stride_bt, stride_ct, stride_yt,
    D_STATE: tl.constexpr, D_STATE_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # grid: (cdiv(channels, BLOCK_C),)
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, D_STATE_PAD)
    mask_c = offs_c < channels
    mask_n = offs_n < D_STATE
    mask = mask_c[:, None] & mask_n[None, :]
    square = offs_c[:, None] * D_STATE + offs_n[None, :]                      # [BLOCK_C, D_STATE_PAD] of [C, N]
    a = tl.load(a_ptr + square, mask=mask, other=0.0)
    h = tl.load(state_ptr + square, mask=mask, other=0.0)
    d = tl.load(d_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in range(0, num_tokens):
        x = tl.load(x_ptr + t * stride_xt + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + offs_c, mask=mask_c, other=0.0)
        b = tl.load(b_ptr + t * stride_bt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_ct + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * a) * h + dt[:, None] * b[None, :] * x[:, None]
        y = tl.sum(h * c[None, :], axis=1) + d * x
        tl.store(y_ptr + t * stride_yt + offs_c, y, mask=mask_c)
    tl.store(state_out_ptr + square, h, mask=mask)


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
         ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.selective_scan.scan`'s contract: x [num_tokens, channels]; dt [num_tokens, channels] float32; A
    [channels, d_state] float32; D [channels]; B, C [num_tokens, d_state]; ssm [channels, d_state] float32 -> (y
    [num_tokens, channels] float32, the state after the last token)."""
    num_tokens, channels = x.shape
    d_state = A.shape[1]
    x, dt, B, C = (t.contiguous() for t in (x, dt.float(), B, C))
    y = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    state = torch.empty(channels, d_state, dtype=torch.float32, device=x.device)
    _selective_scan_kernel[(triton.cdiv(channels, BLOCK_C),)](
        x, dt, A.float().contiguous(), B, C, D.contiguous(), ssm.float().contiguous(), y, state, num_tokens, channels,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0), y.stride(0),
        D_STATE=d_state, D_STATE_PAD=triton.next_power_of_2(d_state), BLOCK_C=BLOCK_C)
    return y, state
