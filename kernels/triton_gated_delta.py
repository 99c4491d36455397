"""The gated delta rule's chunked form (`kernels.gated_delta.chunked`: one sequence's new tokens from its state, and
`chunked_pieces`: several sequences' at once, each from its own) in Triton (CUDA; the interpreter in tests): two
launches a call whatever the lengths and however many sequences, where the torch form runs a loop of a handful of
launches a chunk (a 32,768-token prompt: 512 chunks, some 3,000 launches a layer, the host's time). The chunks are
`kernels.pieces`' (a part's own, none straddling two parts).

- `_wy_kernel`, a program per (chunk, value head), all chunks of all sequences at once: the chunk's keys L2-normed,
  its log decays summed from the chunk's start, the strictly lower system A = (beta k) k^T x exp(decay_i - decay_j),
  its unit lower-triangular inverse (I + A)^-1 by forward substitution a row at a time over the [chunk, chunk] tile,
  and the WY form's u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(decay)) stored with the decays;
- `_state_kernel`, a program per (sequence, value head, block of `BLOCK_V` value channels), the sequence's chunks in
  order: what the state does not predict (u - w S), the chunk's outputs (q exp(decay)) S + (q k^T x exp(decay_i -
  decay_j), causal) (u - w S), and the state carried to the next chunk, S exp(decay_last) + (k exp(decay_last -
  decay))^T (u - w S), held in registers [k_head_dim, BLOCK_V] (float32) from the first chunk to the last and stored
  where a chunk ends a part.
With a decay a key channel (Kimi Delta Attention's: g [T, heads, k_head_dim]) the same two launches run
`_wy_channel_kernel` and `_state_channel_kernel`: each pair of tokens (i, j <= i) weighs channel c by exp(decay_i[c] -
decay_j[c]), which no one product of two tiles gives without factors past 1 (exp(-decay_j) overflows on a fast decay),
so the system and the causal scores are made a row at a time over [chunk, k_head_dim] tiles (every factor at most 1)
and the scores stored for the state kernel; the state's row c decays by channel c's decay.
Everything is float32 (IEEE dots): the state's recurrence accumulates over the whole prompt. Each key head serves
num_v_heads / num_k_heads consecutive value heads, as `kernels.gated_delta._prepare` repeats them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pieces import Pieces

__all__ = ["chunked", "chunked_pieces"]

BLOCK_V = 32   # value channels a state program holds
CHUNK = 32     # tokens a chunk: at heads of 128 x 128 neither kernel spills registers on sm_90 (64 does, the state's)
NUM_WARPS = 8


@triton.jit
def _l2_normed(x, eps):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]


@triton.jit
def _unit_lower_inverse(system, CHUNK: tl.constexpr):
    # (I + A)^-1 of a strictly lower [CHUNK, CHUNK] A by forward substitution, a row at a time
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    inverse = tl.where(i == j, 1.0, 0.0)
    for r in range(1, CHUNK):   # row r of (I + A)^-1: e_r - sum_{s < r} A[r, s] (I + A)^-1[s]
        a_row = tl.sum(tl.where(i == r, system, 0.0), axis=0)                   # [CHUNK] over s
        new_row = tl.sum(a_row[:, None] * inverse, axis=0)
        inverse = tl.where(i == r, tl.where(j == r, 1.0, 0.0) - new_row[None, :], inverse)
    return inverse


@triton.jit
def _wy_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, decay_ptr, starts_ptr, lens_ptr, groups,
               stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
               DK: tl.constexpr, DV: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr, CHUNK: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    # grid: (chunks, value heads); w [T, heads, DK], u [T, heads, DV], decay [T, heads] float32, contiguous; chunk c
    # holds tokens starts[c] .. starts[c] + lens[c] - 1 (`kernels.pieces.ChunkTable`)
    c, h = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
    live = tl.arange(0, CHUNK) < tl.load(lens_ptr + c)
    dk, dv = tl.arange(0, KP), tl.arange(0, VP)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + (h // groups) * stride_kh + dk[None, :],
                mask=live[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
    k = _l2_normed(k, 1e-6)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                mask=live[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_gt + h, mask=live, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h, mask=live, other=0.0).to(tl.float32)
    decay = tl.cumsum(g, axis=0)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    k_beta = k * beta[:, None]
    pair = tl.exp(tl.where(i > j, decay[:, None] - decay[None, :], float("-inf")))
    system = tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION) * pair       # strictly lower
    inverse = _unit_lower_inverse(system, CHUNK)
    u = tl.dot(inverse, v * beta[:, None], input_precision=DOT_PRECISION)
    w = tl.dot(inverse, k_beta * tl.exp(decay)[:, None], input_precision=DOT_PRECISION)
    tl.store(u_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], u, mask=live[:, None] & (dv[None, :] < DV))
    tl.store(w_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], w, mask=live[:, None] & (dk[None, :] < DK))
    tl.store(decay_ptr + rows * heads + h, decay, mask=live)


@triton.jit
def _state_kernel(q_ptr, k_ptr, w_ptr, u_ptr, decay_ptr, state_ptr, out_ptr, after_ptr, starts_ptr, lens_ptr,
                  seq_first_ptr, part_end_ptr, groups, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh,
                  DK: tl.constexpr, DV: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr,
                  CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # grid: (sequences, value heads, cdiv(DV, BLOCK_V)); state [seqs, heads, DK, DV] in, after [parts, heads, DK, DV]
    # out (the state where a chunk ends a part), out [T, heads, DV] float32, contiguous
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1)
    dk, dv = tl.arange(0, KP), vb * BLOCK_V + tl.arange(0, BLOCK_V)
    square = dk[:, None] * DV + dv[None, :]
    in_state = (dk[:, None] < DK) & (dv[None, :] < DV)
    state = tl.load(state_ptr + (s * heads + h) * DK * DV + square, mask=in_state, other=0.0)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    head_k = h // groups
    for c in range(tl.load(seq_first_ptr + s), tl.load(seq_first_ptr + s + 1)):
        rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
        live = tl.arange(0, CHUNK) < tl.load(lens_ptr + c)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + head_k * stride_kh + dk[None, :],
                    mask=live[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head_k * stride_qh + dk[None, :],
                    mask=live[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
        k, q = _l2_normed(k, 1e-6), _l2_normed(q, 1e-6) * qk_scale
        decay = tl.load(decay_ptr + rows * heads + h, mask=live, other=float("inf"))
        last = tl.min(decay, axis=0)   # the decays only fall: the chunk's last token's
        decay = tl.where(live, decay, last)
        w = tl.load(w_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], mask=live[:, None] & (dk[None, :] < DK),
                    other=0.0)
        u = tl.load(u_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                    other=0.0)
        new = u - tl.dot(w, state, input_precision=DOT_PRECISION)                      # what the state does not predict
        pair = tl.exp(tl.where(i >= j, decay[:, None] - decay[None, :], float("-inf")))
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pair
        out = tl.dot(q * tl.exp(decay)[:, None], state, input_precision=DOT_PRECISION) + \
            tl.dot(scores, new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], out,
                 mask=live[:, None] & (dv[None, :] < DV))
        to_end = k * tl.exp(last - decay)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(to_end), new, input_precision=DOT_PRECISION)
        part = tl.load(part_end_ptr + c)
        if part >= 0:
            tl.store(after_ptr + (part * heads + h) * DK * DV + square, state, mask=in_state)


@triton.jit
def _wy_channel_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, decay_ptr, scores_ptr, starts_ptr,
                       lens_ptr, groups, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_gt, stride_bt, DK: tl.constexpr, DV: tl.constexpr, KP: tl.constexpr,
                       VP: tl.constexpr, CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # `_wy_kernel` with a decay a key channel (g [T, heads, DK] float32, contiguous): each pair of tokens (i, j <= i)
    # weighs channel c by exp(decay_i[c] - decay_j[c]), so the system and the causal scores are made a row at a time
    # (every factor at most 1); w, decay [T, heads, DK], u [T, heads, DV], scores [T, heads, CHUNK] float32
    c, h = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
    live = tl.arange(0, CHUNK) < tl.load(lens_ptr + c)
    dk, dv = tl.arange(0, KP), tl.arange(0, VP)
    in_k = live[:, None] & (dk[None, :] < DK)
    k = _l2_normed(tl.load(k_ptr + rows[:, None] * stride_kt + (h // groups) * stride_kh + dk[None, :], mask=in_k,
                           other=0.0).to(tl.float32), 1e-6)
    q = _l2_normed(tl.load(q_ptr + rows[:, None] * stride_qt + (h // groups) * stride_qh + dk[None, :], mask=in_k,
                           other=0.0).to(tl.float32), 1e-6) * qk_scale
    v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                mask=live[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
    decay = tl.cumsum(tl.load(g_ptr + rows[:, None] * stride_gt + h * DK + dk[None, :], mask=in_k, other=0.0), axis=0)
    beta = tl.load(beta_ptr + rows * stride_bt + h, mask=live, other=0.0).to(tl.float32)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    k_beta = k * beta[:, None]
    system = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    scores = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    for r in range(CHUNK):   # row r: token r against each token j <= r (the tile's rows), channel by channel
        at_r = i == r
        decay_r = tl.sum(tl.where(at_r, decay, 0.0), axis=0)
        k_to_r = k * tl.exp(tl.where(i <= r, decay_r[None, :] - decay, float("-inf")))
        system_row = tl.sum(k_to_r * tl.sum(tl.where(at_r, k_beta, 0.0), axis=0)[None, :], axis=1)
        score_row = tl.sum(k_to_r * tl.sum(tl.where(at_r, q, 0.0), axis=0)[None, :], axis=1)
        system = tl.where(at_r, tl.where(j < r, system_row[None, :], 0.0), system)           # strictly lower
        scores = tl.where(at_r, score_row[None, :], scores)                                # causal
    inverse = _unit_lower_inverse(system, CHUNK)
    u = tl.dot(inverse, v * beta[:, None], input_precision=DOT_PRECISION)
    w = tl.dot(inverse, k_beta * tl.exp(decay), input_precision=DOT_PRECISION)
    tl.store(u_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], u, mask=live[:, None] & (dv[None, :] < DV))
    tl.store(w_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], w, mask=in_k)
    tl.store(decay_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], decay, mask=in_k)
    tl.store(scores_ptr + (rows[:, None] * heads + h) * CHUNK + j, scores, mask=live[:, None])


@triton.jit
def _state_channel_kernel(q_ptr, k_ptr, w_ptr, u_ptr, decay_ptr, scores_ptr, state_ptr, out_ptr, after_ptr,
                          starts_ptr, lens_ptr, seq_first_ptr, part_end_ptr, groups, qk_scale, stride_qt, stride_qh,
                          stride_kt, stride_kh, DK: tl.constexpr, DV: tl.constexpr, KP: tl.constexpr,
                          BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # `_state_kernel` with a decay a key channel: the state's row c decays by its own channel's, the chunk's causal
    # scores as `_wy_channel_kernel` stored them
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1)
    dk, dv = tl.arange(0, KP), vb * BLOCK_V + tl.arange(0, BLOCK_V)
    square = dk[:, None] * DV + dv[None, :]
    in_state = (dk[:, None] < DK) & (dv[None, :] < DV)
    state = tl.load(state_ptr + (s * heads + h) * DK * DV + square, mask=in_state, other=0.0)
    j = tl.arange(0, CHUNK)[None, :]
    head_k = h // groups
    for c in range(tl.load(seq_first_ptr + s), tl.load(seq_first_ptr + s + 1)):
        rows = tl.load(starts_ptr + c) + tl.arange(0, CHUNK)
        n = tl.load(lens_ptr + c)
        live = tl.arange(0, CHUNK) < n
        in_k = live[:, None] & (dk[None, :] < DK)
        k = _l2_normed(tl.load(k_ptr + rows[:, None] * stride_kt + head_k * stride_kh + dk[None, :], mask=in_k,
                               other=0.0).to(tl.float32), 1e-6)
        q = _l2_normed(tl.load(q_ptr + rows[:, None] * stride_qt + head_k * stride_qh + dk[None, :], mask=in_k,
                               other=0.0).to(tl.float32), 1e-6) * qk_scale
        # the chunk's last token's decays [KP]; then q decayed from the chunk's start and k to its end (the decay
        # tile, q and k no longer held; a row past the chunk has q = k = 0 and decays 0, every factor at most 1)
        last = tl.load(decay_ptr + ((tl.load(starts_ptr + c) + n - 1) * heads + h) * DK + dk, mask=dk < DK, other=0.0)
        decay = tl.load(decay_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], mask=in_k, other=0.0)
        q = q * tl.exp(decay)
        k = k * tl.exp(last[None, :] - decay)
        w = tl.load(w_ptr + (rows[:, None] * heads + h) * DK + dk[None, :], mask=in_k, other=0.0)
        u = tl.load(u_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                    other=0.0)
        new = u - tl.dot(w, state, input_precision=DOT_PRECISION)                      # what the state does not predict
        scores = tl.load(scores_ptr + (rows[:, None] * heads + h) * CHUNK + j, mask=live[:, None], other=0.0)
        out = tl.dot(q, state, input_precision=DOT_PRECISION) + tl.dot(scores, new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + (rows[:, None] * heads + h) * DV + dv[None, :], out,
                 mask=live[:, None] & (dv[None, :] < DV))
        state = state * tl.exp(last)[:, None] + tl.dot(tl.trans(k), new, input_precision=DOT_PRECISION)
        part = tl.load(part_end_ptr + c)
        if part >= 0:
            tl.store(after_ptr + (part * heads + h) * DK * DV + square, state, mask=in_state)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.gated_delta.chunked`'s contract: q, k [num_tokens, num_k_heads, k_head_dim]; v [num_tokens,
    num_v_heads, v_head_dim]; g [num_tokens, num_v_heads] (a decay a head) or [num_tokens, num_v_heads, k_head_dim]
    (a decay a key channel, Kimi Delta Attention's), beta [num_tokens, num_v_heads]; ssm [num_v_heads, k_head_dim,
    v_head_dim] float32 -> (out [num_tokens, num_v_heads, v_head_dim] float32, the state after the last token)."""
    out, after = chunked_pieces(q, k, v, g, beta, ssm.unsqueeze(0), Pieces.whole([v.shape[0]]), chunk)
    return out, after[0]


def chunked_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.gated_delta.chunked_pieces`' contract: several sequences' new tokens (`pieces`), ssm [num_seqs,
    num_v_heads, k_head_dim, v_head_dim] -> (out, the state after each part [num_parts, ...]); two launches in all,
    for a decay a head or a key channel (g's shape, as `chunked`'s). `chunk`: a power of two of at least 16 (the dots'
    smallest tile). The dots are IEEE float32 for float32 inputs, the tensor cores' TF32 on float32 tiles for a 16-bit
    model's (IEEE dots of these tiles spill registers)."""
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    num_tokens, heads, dv = v.shape
    dk, groups = k.shape[-1], heads // k.shape[-2]
    _check(q.shape == k.shape and q.shape[0] == num_tokens == pieces.num_tokens and heads % k.shape[-2] == 0,
           f"q {tuple(q.shape)} and k {tuple(k.shape)}: [tokens, key heads, k_head_dim], dividing v's heads; "
           f"{pieces.num_tokens} tokens in the pieces")
    _check(g.shape[:2] == beta.shape == (num_tokens, heads) and g.shape[2:] in ((), (dk,))
           and ssm.shape == (pieces.num_seqs, heads, dk, dv),
           f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, ssm {tuple(ssm.shape)}: [tokens, value heads"
           f"(, k_head_dim)], [tokens, value heads] and [{pieces.num_seqs} sequences, value heads, k_head_dim, "
           f"v_head_dim]")
    _check(chunk >= 16 and chunk & (chunk - 1) == 0, f"chunk: a power of two of at least 16, got {chunk}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    table = pieces.chunk_table(chunk, v.device)
    shape = dict(DK=dk, DV=dv, KP=max(16, triton.next_power_of_2(dk)), CHUNK=chunk, DOT_PRECISION=precision,
                 num_warps=NUM_WARPS)
    wy = _wy_launch(q, k, v, g, beta, table, groups, shape)
    out = torch.empty(num_tokens, heads, dv, dtype=torch.float32, device=v.device)
    after = torch.empty(pieces.num_parts, heads, dk, dv, dtype=torch.float32, device=v.device)
    block_v = min(BLOCK_V, max(16, triton.next_power_of_2(dv)))
    kernel, tensors = (_state_channel_kernel, wy) if g.dim() == 3 else (_state_kernel, wy[:3])
    kernel[(pieces.num_seqs, heads, triton.cdiv(dv, block_v))](
        q, k, *tensors, ssm.float().contiguous(), out, after, table.starts, table.lens, table.seq_first,
        table.part_end, groups, dk ** -0.5, q.stride(0), q.stride(1), k.stride(0), k.stride(1), BLOCK_V=block_v,
        **shape)
    return out, after


def _wy_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, table,
               groups: int, shape: dict) -> tuple[torch.Tensor, ...]:
    """The WY kernel over every chunk of `table` -> (w, u, the decays[, the causal scores where a decay a channel])."""
    (num_tokens, heads, dv), dk, device = v.shape, k.shape[-1], v.device
    w = torch.empty(num_tokens, heads, dk, dtype=torch.float32, device=device)
    u = torch.empty(num_tokens, heads, dv, dtype=torch.float32, device=device)
    decay = torch.empty(g.shape, dtype=torch.float32, device=device)
    vp = max(16, triton.next_power_of_2(dv))
    if g.dim() == 2:
        _wy_kernel[(table.num_chunks, heads)](
            k, v, g, beta, w, u, decay, table.starts, table.lens, groups, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), g.stride(0), beta.stride(0), VP=vp, **shape)
        return w, u, decay
    scores = torch.empty(num_tokens, heads, shape["CHUNK"], dtype=torch.float32, device=device)
    _wy_channel_kernel[(table.num_chunks, heads)](
        q, k, v, g, beta, w, u, decay, scores, table.starts, table.lens, groups, dk ** -0.5, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), VP=vp, **shape)
    return w, u, decay, scores


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"gated delta kernels: {what}")
