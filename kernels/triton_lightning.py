"""Lightning attention over one sequence's new tokens (`kernels.lightning.chunked`: MiniMax-Text-01's and
MiniMax-M1's linear attention), or several sequences' each from its own state (`chunked_pieces`), in Triton (CUDA;
the interpreter in tests): one launch a call whatever the lengths, where the torch form runs a handful of launches a
block.

`_lightning_kernel`, a program per (sequence, head, block of `BLOCK_V` value channels), walks the sequence's chunks
(`kernels.pieces`' chunk table: none straddles two parts; the state stored where one ends a part) in order holding its
columns of the head's state S [head_dim, BLOCK_V] (float32) in registers: per chunk the outputs (q k^T x exp(-s (i -
j)), causal) v + (q exp(-s (i + 1))) S, and the state carried on, S exp(-s n) + (k exp(-s (n - 1 - i)))^T v, n the
chunk's tokens. The dots are IEEE float32 for float32 inputs, TF32 on float32 tiles for a 16-bit model's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pieces import Pieces

__all__ = ["chunked", "chunked_pieces"]

BLOCK_V = 32   # value channels a program holds
CHUNK = 32
NUM_WARPS = 8


@triton.jit
def _lightning_kernel(q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, out_ptr, after_ptr, starts_ptr, lens_ptr,
                      seq_first_ptr, part_end_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      D: tl.constexpr, DP: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # grid: (sequences, heads, cdiv(D, BLOCK_V)); state [seqs, heads, D, D] in, after [parts, heads, D, D] out (the
    # state where a chunk ends a part), out [T, heads, D] float32, contiguous; the chunks `kernels.pieces.ChunkTable`'s
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1)
    dk, dv = tl.arange(0, DP), vb * BLOCK_V + tl.arange(0, BLOCK_V)
    square = dk[:, None] * D + dv[None, :]
    in_state = (dk[:, None] < D) & (dv[None, :] < D)
    state = tl.load(state_ptr + (s * heads + h) * D * D + square, mask=in_state, other=0.0)
    rate = tl.load(slope_ptr + h).to(tl.float32)
    steps = tl.arange(0, CHUNK).to(tl.float32)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    pair = tl.exp(tl.where(i >= j, -rate * (i - j).to(tl.float32), float("-inf")))
    for c in range(tl.load(seq_first_ptr + s), tl.load(seq_first_ptr + s + 1)):
        rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
        tokens = tl.load(lens_ptr + c)
        live = tl.arange(0, CHUNK) < tokens
        n = tokens.to(tl.float32)
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
        part = tl.load(part_end_ptr + c)
        if part >= 0:
            tl.store(after_ptr + (part * heads + h) * D * D + square, state, mask=in_state)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.lightning.chunked`'s contract: q, k, v [num_tokens, num_heads, head_dim]; slopes [num_heads]
    (float32); ssm [num_heads, head_dim, head_dim] float32 -> (out [num_tokens, num_heads, head_dim] float32, the
    state after the last token)."""
    out, after = chunked_pieces(q, k, v, slopes, ssm.unsqueeze(0), Pieces.whole([v.shape[0]]), chunk)
    return out, after[0]


def chunked_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
                   pieces: Pieces, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.lightning.chunked_pieces`' contract: several sequences' new tokens (`pieces`), ssm [num_seqs,
    num_heads, head_dim, head_dim] -> (out, the state after each part [num_parts, ...]); one launch in all. `chunk`:
    a power of two of at least 16."""
    num_tokens, heads, d = v.shape
    if not (q.shape == k.shape == v.shape and num_tokens == pieces.num_tokens and slopes.shape == (heads,)
            and ssm.shape == (pieces.num_seqs, heads, d, d)):
        raise ValueError(f"lightning kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, slopes "
                         f"{tuple(slopes.shape)}, ssm {tuple(ssm.shape)} do not agree with {pieces.num_tokens} "
                         f"tokens of {pieces.num_seqs} sequences")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"lightning kernel: chunk must be a power of two of at least 16, got {chunk}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    table = pieces.chunk_table(chunk, v.device)
    out = torch.empty(num_tokens, heads, d, dtype=torch.float32, device=v.device)
    after = torch.empty(pieces.num_parts, heads, d, d, dtype=torch.float32, device=v.device)
    dp = max(16, triton.next_power_of_2(d))
    block_v = min(BLOCK_V, dp)
    _lightning_kernel[(pieces.num_seqs, heads, triton.cdiv(d, block_v))](
        q, k, v, slopes.float().contiguous(), ssm.float().contiguous(), out, after, table.starts, table.lens,
        table.seq_first, table.part_end, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        D=d, DP=dp, BLOCK_V=block_v, CHUNK=chunk, DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS)
    return out, after
