"""Mamba-2's SSD scan over one sequence's new tokens (`kernels.ssd.chunked`), or several sequences' each from its own
state (`chunked_pieces`), in Triton (CUDA; the interpreter in tests): one launch a call whatever the lengths, where
the torch form runs a loop of a handful of launches a chunk (a 32,768-token prompt through a Granite 4-H or Nemotron-H
layer: thousands of launches, the host's time).

`_ssd_kernel`, a program per (sequence, head, block of `BLOCK_P` of the head's channels), walks the sequence's chunks
(`kernels.pieces`' chunk table: none straddles two parts) in order, storing the state where one ends a part, holding
its rows of the head's state S [BLOCK_P, d_state] (float32) in registers: per chunk the log decays dt A summed from
the chunk's start, the outputs ((C B^T) x exp(decay_i - decay_j), causal) (dt x) + (C S^T) exp(decay) + D x, and the
state carried on, S exp(decay_last) + (dt x exp(decay_last - decay))^T B. B and C are the head's group's. The dots are
IEEE float32 for float32 inputs, TF32 on float32 tiles for a 16-bit model's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pieces import Pieces

__all__ = ["chunked", "chunked_pieces"]

BLOCK_P = 32   # a head's channels a program holds
CHUNK = 32     # tokens a chunk: at d_state 128 and BLOCK_P 32 the kernel does not spill registers on sm_90
NUM_WARPS = 8


@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, y_ptr, after_ptr, starts_ptr, lens_ptr,
                seq_first_ptr, part_end_ptr, per_group, stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg,
                stride_ct, stride_cg, P: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_P: tl.constexpr,
                CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # grid: (sequences, heads, cdiv(P, BLOCK_P)); state [seqs, heads, P, N] in, after [parts, heads, P, N] out (the
    # state where a chunk ends a part), y [T, heads, P] float32, contiguous; the chunks `kernels.pieces.ChunkTable`'s
    s, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1)
    p, n = pb * BLOCK_P + tl.arange(0, BLOCK_P), tl.arange(0, NP)
    in_state = (p[:, None] < P) & (n[None, :] < N)
    square = p[:, None] * N + n[None, :]
    state = tl.load(state_ptr + (s * heads + h) * P * N + square, mask=in_state, other=0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    skip = tl.load(d_ptr + h).to(tl.float32)
    group = h // per_group
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    for c in range(tl.load(seq_first_ptr + s), tl.load(seq_first_ptr + s + 1)):
        rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
        live = tl.arange(0, CHUNK) < tl.load(lens_ptr + c)
        dt = tl.load(dt_ptr + rows * stride_dtt + h, mask=live, other=0.0).to(tl.float32)   # padded: no decay, no input
        decay = tl.cumsum(dt * a, axis=0)
        last = tl.min(decay, axis=0)   # the decays only fall: the chunk's last token's
        x = tl.load(x_ptr + rows[:, None] * stride_xt + h * stride_xh + p[None, :],
                    mask=live[:, None] & (p[None, :] < P), other=0.0).to(tl.float32)
        bc = tl.load(b_ptr + rows[:, None] * stride_bt + group * stride_bg + n[None, :],
                     mask=live[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + rows[:, None] * stride_ct + group * stride_cg + n[None, :],
                     mask=live[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
        xdt = x * dt[:, None]
        pair = tl.exp(tl.where(i >= j, decay[:, None] - decay[None, :], float("-inf")))
        scores = tl.dot(cc, tl.trans(bc), input_precision=DOT_PRECISION) * pair
        y = tl.dot(scores, xdt, input_precision=DOT_PRECISION) + \
            tl.dot(cc, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(decay)[:, None] + skip * x
        tl.store(y_ptr + (rows[:, None] * heads + h) * P + p[None, :], y, mask=live[:, None] & (p[None, :] < P))
        to_end = xdt * tl.exp(last - decay)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(to_end), bc, input_precision=DOT_PRECISION)
        part = tl.load(part_end_ptr + c)
        if part >= 0:
            tl.store(after_ptr + (part * heads + h) * P * N + square, state, mask=in_state)


def chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
            ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.ssd.chunked`'s contract: x [num_tokens, num_heads, head_dim]; dt [num_tokens, num_heads] (after
    softplus); A, D [num_heads]; B, C [num_tokens, n_groups, d_state]; ssm [num_heads, head_dim, d_state] float32 ->
    (y [num_tokens, num_heads, head_dim] float32, the state after the last token)."""
    y, after = chunked_pieces(x, dt, A, B, C, D, ssm.unsqueeze(0), Pieces.whole([x.shape[0]]), chunk)
    return y, after[0]


def chunked_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.ssd.chunked_pieces`' contract: several sequences' new tokens (`pieces`), ssm [num_seqs, num_heads,
    head_dim, d_state] -> (y, the state after each part [num_parts, ...]); one launch in all. `chunk`: a power of two
    of at least 16."""
    num_tokens, heads, head_dim = x.shape
    d_state, groups = B.shape[-1], B.shape[-2]
    if not (B.shape == C.shape and B.shape[0] == num_tokens == pieces.num_tokens and heads % groups == 0
            and dt.shape == (num_tokens, heads) and A.shape == D.shape == (heads,)
            and ssm.shape == (pieces.num_seqs, heads, head_dim, d_state)):
        raise ValueError(f"SSD kernel: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B "
                         f"{tuple(B.shape)}, C {tuple(C.shape)}, D {tuple(D.shape)}, ssm {tuple(ssm.shape)} do not "
                         f"agree with {pieces.num_tokens} tokens of {pieces.num_seqs} sequences")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"SSD kernel: chunk must be a power of two of at least 16, got {chunk}")
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    dt, table = dt.float().contiguous(), pieces.chunk_table(chunk, x.device)
    y = torch.empty(num_tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    after = torch.empty(pieces.num_parts, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    block_p = min(BLOCK_P, max(16, triton.next_power_of_2(head_dim)))
    _ssd_kernel[(pieces.num_seqs, heads, triton.cdiv(head_dim, block_p))](
        x, dt, A.float().contiguous(), B, C, D.float().contiguous(), ssm.float().contiguous(), y, after, table.starts,
        table.lens, table.seq_first, table.part_end, heads // groups, x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), P=head_dim, N=d_state,
        NP=max(16, triton.next_power_of_2(d_state)), BLOCK_P=block_p, CHUNK=chunk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS)
    return y, after
