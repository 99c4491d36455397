"""Mamba-1's selective scan in Triton (CUDA; the interpreter in tests): `kernels.selective_scan.scan`'s recurrence
for one sequence's new tokens, or several sequences' each from its own state (`scan_pieces`), which its torch form
runs as a loop of a launch a token (a 65,536-token prompt would be that many launches a layer).

`_selective_scan_kernel`, a program per (sequence, `BLOCK_C` channels), holds those channels' states [BLOCK_C,
d_state] in registers (float32) and walks the sequence's tokens in order, part after part (`kernels.pieces`): each
token's x, dt, B and C are loaded, the state decayed by exp(dt A) and fed dt B x, and y = C . h + D x stored; the
state after each part is stored once. The channels are
independent, so the programs never meet; a sequence's tokens are serial within one (mamba_ssm's kernel splits them
in chunks for the same reason the decays differ per state entry: nothing cheaper carries a state across a chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pieces import Pieces

__all__ = ["scan", "scan_pieces"]

BLOCK_C = 32   # channels a program scans


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, y_ptr, after_ptr, starts_ptr, lens_ptr, seq_first_ptr,
    part_end_ptr, channels, stride_xt, stride_dtt, stride_bt, stride_ct, stride_yt,
    D_STATE: tl.constexpr, D_STATE_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # grid: (sequences, cdiv(channels, BLOCK_C)); state [seqs, C, N] in, after [parts, C, N] out; each "chunk" of
    # `kernels.pieces.ChunkTable` a whole part (the table made with chunks of any length)
    s = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, D_STATE_PAD)
    mask_c = offs_c < channels
    mask_n = offs_n < D_STATE
    mask = mask_c[:, None] & mask_n[None, :]
    square = offs_c[:, None] * D_STATE + offs_n[None, :]                      # [BLOCK_C, D_STATE_PAD] of [C, N]
    a = tl.load(a_ptr + square, mask=mask, other=0.0)
    h = tl.load(state_ptr + s * channels * D_STATE + square, mask=mask, other=0.0)
    d = tl.load(d_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for part in range(tl.load(seq_first_ptr + s), tl.load(seq_first_ptr + s + 1)):
        start = tl.load(starts_ptr + part)
        for t in range(start, start + tl.load(lens_ptr + part)):
            x = tl.load(x_ptr + t * stride_xt + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + t * stride_dtt + offs_c, mask=mask_c, other=0.0)
            b = tl.load(b_ptr + t * stride_bt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + t * stride_ct + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * a) * h + dt[:, None] * b[None, :] * x[:, None]
            y = tl.sum(h * c[None, :], axis=1) + d * x
            tl.store(y_ptr + t * stride_yt + offs_c, y, mask=mask_c)
        tl.store(after_ptr + tl.load(part_end_ptr + part) * channels * D_STATE + square, h, mask=mask)


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
         ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.selective_scan.scan`'s contract: x [num_tokens, channels]; dt [num_tokens, channels] float32; A
    [channels, d_state] float32; D [channels]; B, C [num_tokens, d_state]; ssm [channels, d_state] float32 -> (y
    [num_tokens, channels] float32, the state after the last token)."""
    y, after = scan_pieces(x, dt, A, B, C, D, ssm.unsqueeze(0), Pieces.whole([x.shape[0]]))
    return y, after[0]


def scan_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, ssm: torch.Tensor, pieces: Pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.selective_scan.scan_pieces`' contract: several sequences' new tokens (`pieces`), ssm [num_seqs,
    channels, d_state] -> (y, the state after each part [num_parts, channels, d_state]); one launch in all."""
    num_tokens, channels = x.shape
    d_state = A.shape[1]
    if num_tokens != pieces.num_tokens or ssm.shape != (pieces.num_seqs, channels, d_state):
        raise ValueError(f"selective scan kernel: x {tuple(x.shape)}, ssm {tuple(ssm.shape)} do not agree with "
                         f"{pieces.num_tokens} tokens of {pieces.num_seqs} sequences")
    x, dt, B, C = (t.contiguous() for t in (x, dt.float(), B, C))
    table = pieces.chunk_table(max(pieces.part_lens), x.device)   # a chunk a part
    y = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    after = torch.empty(pieces.num_parts, channels, d_state, dtype=torch.float32, device=x.device)
    _selective_scan_kernel[(pieces.num_seqs, triton.cdiv(channels, BLOCK_C))](
        x, dt, A.float().contiguous(), B, C, D.contiguous(), ssm.float().contiguous(), y, after, table.starts,
        table.lens, table.seq_first, table.part_end, channels, x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        y.stride(0), D_STATE=d_state, D_STATE_PAD=triton.next_power_of_2(d_state), BLOCK_C=BLOCK_C)
    return y, after
