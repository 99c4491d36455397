"""Mamba-2's selective state space (the SSD scan of Granite 4's -H models' Mamba layers), in torch: the CPU path and
the yardstick for a fused kernel. The causal convolution before it is `kernels.gated_delta.causal_conv`.

Each head h of a sequence carries a state S_h [head_dim, d_state] (float32). For each token t, with dt_t =
softplus(dt_raw + dt_bias) (clamped to the config's limits) and A_h = -exp(A_log_h) < 0:

    S_h = exp(dt_t A_h) S_h + dt_t x_t B_t^T          (x_t: the head's [head_dim] input; B_t, C_t: [d_state])
    y_t = S_h C_t + D_h x_t

B and C are shared by the heads of a group (`n_groups` of them). `step` runs one token of many sequences at once
(decode); `chunked` one sequence's new tokens in chunks (prefill): within a chunk the outputs are a masked,
decayed product of C and B (like attention), and the state passes from chunk to chunk (on CUDA in one Triton
launch, `kernels.triton_ssd`); `chunked_pieces` several sequences' at once, each from its own state (`kernels.pieces`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.pieces import Pieces, scan_tiles, tiles

CHUNK = 64


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [..., n_groups, d_state] -> one per head [..., num_heads, d_state] (float32)."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
         ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of many sequences.

    x: [num_seqs, num_heads, head_dim]; dt: [num_seqs, num_heads] (after softplus); A, D: [num_heads]; B, C:
    [num_seqs, n_groups, d_state]; ssm: [num_seqs, num_heads, head_dim, d_state] float32 -> (y [num_seqs,
    num_heads, head_dim] float32, the new states)."""
    num_heads, head_dim, d_state = ssm.shape[1:]
    dt = dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]                          # [seqs, heads, 1, 1]
    xf = x.float()
    # the input's rank-one update in place and the read-out as a batched matrix product: no temporary of the
    # state's size past the decayed state itself (the elementwise form made four)
    state = ssm * decay
    state.view(-1, head_dim, d_state).baddbmm_((dt[..., None] * xf).reshape(-1, head_dim, 1),
                                               _per_head(B, num_heads).reshape(-1, 1, d_state))
    y = (state @ _per_head(C, num_heads).unsqueeze(-1)).squeeze(-1)             # [seqs, heads, head_dim]
    return y + D.float()[:, None] * xf, state


def chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
            ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens, from its state.

    x: [num_tokens, num_heads, head_dim]; dt: [num_tokens, num_heads] (after softplus); A, D: [num_heads]; B, C:
    [num_tokens, n_groups, d_state]; ssm: [num_heads, head_dim, d_state] float32 -> (y [num_tokens, num_heads,
    head_dim] float32, the state after the last token). On CUDA `kernels.triton_ssd`'s one launch."""
    if x.is_cuda:
        from kernels.triton_ssd import chunked as triton_chunked

        return triton_chunked(x, dt, A, B, C, D, ssm)
    return chunked_torch(x, dt, A, B, C, D, ssm, chunk)


def chunked_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens at once, each from its own state (`kernels.pieces`: tokens flat, sequence after
    sequence, each sequence's in parts): `chunked`'s per-token tensors over all of them, ssm [num_seqs, num_heads,
    head_dim, d_state] -> (y [num_tokens, num_heads, head_dim] float32, the state after each part [num_parts, ...]).
    On CUDA `kernels.triton_ssd`'s one launch."""
    if x.is_cuda:
        from kernels.triton_ssd import chunked_pieces as triton_pieces

        return triton_pieces(x, dt, A, B, C, D, ssm, pieces)
    return chunked_pieces_torch(x, dt, A, B, C, D, ssm, pieces, chunk)


def chunked_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor, ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` in torch on any device: the CPU's path, and the yardstick of the Triton one."""
    num_tokens, num_heads, _ = x.shape
    pad = -num_tokens % chunk
    xf = x.float()
    # [heads, chunks, chunk, ...]; padded tokens have dt = 0: no decay, no input
    xdt = F.pad((xf * dt.float()[..., None]).transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk))
    Bh, Ch = (F.pad(_per_head(t, num_heads).transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk))
              for t in (B, C))
    log_decay = F.pad((dt.float() * A.float()).t(), (0, pad)).unflatten(1, (-1, chunk)).cumsum(-1)
    within, to_end, from_start = _within(xdt, Bh, Ch, log_decay)
    out = torch.empty_like(within)
    state = ssm.float()                                                        # [heads, head_dim, d_state]
    for i in range(within.shape[1]):
        out[:, i] = within[:, i] + (Ch[:, i] @ state.transpose(-1, -2)) * from_start[:, i, :, None]
        state = state * log_decay[:, i, -1].exp()[:, None, None] + \
            (xdt[:, i] * to_end[:, i, :, None]).transpose(-1, -2) @ Bh[:, i]
    y = out.flatten(1, 2)[:, :num_tokens].transpose(0, 1)
    return y + D.float()[:, None] * xf, state


def chunked_pieces_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor, ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_pieces` in torch: every chunk's products at once, then the chunks' steps through the states, the
    j-th chunks of all sequences that have one together (`kernels.pieces.TorchPlan`)."""
    if pieces.num_parts == 1:
        y, after = chunked_torch(x, dt, A, B, C, D, ssm[0], chunk)
        return y, after.unsqueeze(0)
    plan, num_heads, xf = pieces.torch_plan(chunk, x.device), x.shape[1], x.float()
    xdt, Bh, Ch, log_decay = (tiles(t, plan, chunk) for t in (xf * dt.float()[..., None], _per_head(B, num_heads),
                                                             _per_head(C, num_heads), dt.float() * A.float()))
    log_decay = log_decay.cumsum(-1)                                           # padded tokens: dt = 0, nothing
    within, to_end, from_start = _within(xdt, Bh, Ch, log_decay)

    def step(at: slice, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = within[at] + (Ch[at] @ held.transpose(-1, -2)) * from_start[at].unsqueeze(-1)
        return out, held * log_decay[at][..., -1].exp()[..., None, None] + \
            (xdt[at] * to_end[at].unsqueeze(-1)).transpose(-1, -2) @ Bh[at]

    y, after = scan_tiles(plan, ssm, pieces.num_parts, torch.empty_like(within), step)
    return y + D.float()[:, None] * xf, after


def _within(xdt: torch.Tensor, Bh: torch.Tensor, Ch: torch.Tensor, log_decay: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within each chunk (xdt [..., chunk, head_dim]; Bh, Ch [..., chunk, d_state]; log_decay [..., chunk], summed
    from the chunk's start): the outputs from the chunk's own inputs, each token's decay to the chunk's end, and the
    chunk start's decay to each token."""
    chunk = log_decay.shape[-1]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=xdt.device).tril()
    # exp(decay_i - decay_j) for j <= i, else 0
    pair = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    within = ((Ch @ Bh.transpose(-1, -2)) * pair) @ xdt                       # [..., chunk, head_dim]
    return within, (log_decay[..., -1:] - log_decay).exp(), log_decay.exp()
