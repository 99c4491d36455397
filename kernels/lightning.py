"""Lightning attention, the linear attention of MiniMax-Text-01 and MiniMax-M1, in torch: the CPU path and the yardstick
for a fused kernel.

A lightning layer keeps no K/V per token. Each sequence carries one float32 matrix a head, S [head_dim, head_dim],
which forgets at a fixed rate a head (its slope s > 0: the state decays by exp(-s) a token). For each token t (q, k
and v already through SiLU, q unscaled, no softmax):

    S   = exp(-s) S + k_t^T v_t
    o_t = q_t S

`recurrent_step` runs one token of many sequences at once (decode). `chunked` runs one sequence's new tokens in
blocks (prefill): within a block the outputs are a masked product, exp(-s (i - j)) (q_i . k_j) v_j over j <= i, plus
what the state held at the block's start, decayed to each token; the state moves once a block. A prompt costs
T / block sequential steps, not T (on CUDA one Triton launch, `kernels.triton_lightning`); `chunked_pieces` runs
several sequences' at once, each from its own state (`kernels.pieces`).
"""

from __future__ import annotations

import torch

from kernels.pieces import Pieces, scan_tiles, tiles

__all__ = ["BLOCK", "chunked", "chunked_pieces", "chunked_pieces_torch", "chunked_torch", "recurrent_step"]

BLOCK = 64


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of many sequences. q, k, v: [num_seqs, num_heads, head_dim]; slopes: [num_heads] (float32);
    ssm: [num_seqs, num_heads, head_dim, head_dim] float32 -> (out [num_seqs, num_heads, head_dim] float32, the new
    states)."""
    q, k, v = q.float(), k.float(), v.float()
    d_k, d_v = ssm.shape[-2:]
    state = ssm * torch.exp(-slopes)[:, None, None]   # then k v^T added in place, q^T S as a batched matrix product
    state.view(-1, d_k, d_v).baddbmm_(k.reshape(-1, d_k, 1), v.reshape(-1, 1, d_v))
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
            block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens, from its state. q, k, v: [num_tokens, num_heads, head_dim]; slopes: [num_heads]
    (float32); ssm: [num_heads, head_dim, head_dim] float32 -> (out [num_tokens, num_heads, head_dim] float32, the
    state after the last token). On CUDA `kernels.triton_lightning`'s one launch."""
    if v.is_cuda:
        from kernels.triton_lightning import chunked as triton_chunked

        return triton_chunked(q, k, v, slopes, ssm)
    return chunked_torch(q, k, v, slopes, ssm, block)


def chunked_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
                   pieces: Pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens at once, each from its own state (`kernels.pieces`: tokens flat, sequence after
    sequence, each sequence's in parts): `chunked`'s per-token tensors over all of them, ssm [num_seqs, num_heads,
    head_dim, head_dim] -> (out [num_tokens, num_heads, head_dim] float32, the state after each part [num_parts,
    ...]). On CUDA `kernels.triton_lightning`'s one launch."""
    if v.is_cuda:
        from kernels.triton_lightning import chunked_pieces as triton_pieces

        return triton_pieces(q, k, v, slopes, ssm, pieces)
    return chunked_pieces_torch(q, k, v, slopes, ssm, pieces)


def chunked_pieces_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
                         pieces: Pieces, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_pieces` in torch: every block's products at once, then the blocks' steps through the states, the
    j-th blocks of all sequences that have one together (`kernels.pieces.TorchPlan`). A short block decays the state
    by its own tokens (a pad is not a token here: the decay runs by position)."""
    if pieces.num_parts == 1:
        out, after = chunked_torch(q, k, v, slopes, ssm[0], block)
        return out, after.unsqueeze(0)
    plan = pieces.torch_plan(block, v.device)
    q, k, v = (tiles(t.float(), plan, block) for t in (q, k, v))            # [tiles, heads, block, head_dim]
    rate, n = slopes.float()[:, None], plan.lens[:, None, None]             # [heads, 1]; [tiles, 1, 1]
    steps = torch.arange(block, device=v.device, dtype=torch.float32)
    gap = steps[:, None] - steps[None, :]                                    # i - j
    pair = torch.exp(-rate[..., None] * gap.clamp(min=0)).masked_fill(gap < 0, 0.0)   # [heads, block, block]
    inside = ((q @ k.transpose(-1, -2)) * pair) @ v
    q_decayed = q * torch.exp(-rate * (steps + 1)).unsqueeze(-1)
    to_end = k * torch.exp(-rate * (n - 1 - steps)).unsqueeze(-1)            # pads: k = 0
    block_decay = torch.exp(-rate * n)[..., None]                            # [tiles, heads, 1, 1]
    return scan_tiles(plan, ssm, pieces.num_parts, torch.empty_like(inside), lambda at, held: (
        inside[at] + q_decayed[at] @ held, held * block_decay[at] + to_end[at].transpose(-1, -2) @ v[at]))


def chunked_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, ssm: torch.Tensor,
                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` in torch on any device: the CPU's path, and the yardstick of the Triton one."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))            # [heads, tokens, head_dim]
    rate = slopes.float()[:, None]                                       # [heads, 1]
    state, outs = ssm.float(), []
    for start in range(0, q.shape[1], block):
        qb, kb, vb = (t[:, start:start + block] for t in (q, k, v))
        n = qb.shape[1]
        steps = torch.arange(n, device=q.device, dtype=torch.float32)
        gap = steps[:, None] - steps[None, :]                            # i - j
        pair = torch.exp(-rate[..., None] * gap.clamp(min=0)).masked_fill(gap < 0, 0.0)   # [heads, n, n]
        inside = ((qb @ kb.transpose(-1, -2)) * pair) @ vb
        held = (qb * torch.exp(-rate * (steps + 1)).unsqueeze(-1)) @ state
        outs.append(inside + held)
        to_end = kb * torch.exp(-rate * (n - 1 - steps)).unsqueeze(-1)
        state = state * torch.exp(-rate * n)[..., None] + to_end.transpose(-1, -2) @ vb
    return torch.cat(outs, dim=1).transpose(0, 1), state
