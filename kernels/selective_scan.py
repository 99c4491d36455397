"""Mamba-1's selective scan (the state space of Jamba's Mamba layers), in torch: the CPU path and the yardstick for a
fused kernel. The causal convolution before it is `kernels.gated_delta.causal_conv`.

Each channel c of a sequence carries a state h_c [d_state] (float32). For each token t, with dt_t,c the channel's
step (after softplus) and A_c = -exp(A_log_c) [d_state] < 0:

    h_c = exp(dt_t,c A_c) * h_c + dt_t,c B_t x_t,c          (B_t, C_t: [d_state], shared by the channels)
    y_t,c = C_t . h_c + D_c x_t,c

Unlike Mamba-2's (`kernels.ssd`), the decay differs per state entry, so the scan has no chunked matrix form short of
a [chunk, chunk, channels, d_state] tensor: `scan` runs the recurrence token by token (transformers' and mamba_ssm's
reference order of products), over pieces of `PIECE` tokens whose decays and inputs it makes at once; on CUDA the
Triton kernel runs that recurrence in one launch (`kernels.triton_selective_scan`). `step` runs one token of many
sequences (decode): a few elementwise ops, captured in decode graphs.
"""

from __future__ import annotations

import torch

from kernels.pieces import Pieces

PIECE = 256   # tokens whose [tokens, channels, d_state] decays and inputs are held at once


def step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
         ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of many sequences.

    x: [num_seqs, channels]; dt: [num_seqs, channels] float32 (after softplus); A: [channels, d_state] float32; D:
    [channels]; B, C: [num_seqs, d_state]; ssm: [num_seqs, channels, d_state] float32 -> (y [num_seqs, channels]
    float32, the new states)."""
    state = ssm * torch.exp(dt[..., None] * A.float())   # the decay is per channel and state: of the state's size
    # the input dt x B^T added in place and the read-out a batched matrix product (no more temporaries of that size)
    state.baddbmm_((dt * x.float()).unsqueeze(-1), B.float().unsqueeze(-2))
    return (state @ C.float().unsqueeze(-1)).squeeze(-1) + D.float() * x.float(), state


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
         ssm: torch.Tensor, piece: int = PIECE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens, from its state.

    x: [num_tokens, channels]; dt: [num_tokens, channels] float32; A: [channels, d_state]; D: [channels]; B, C:
    [num_tokens, d_state]; ssm: [channels, d_state] float32 -> (y [num_tokens, channels] float32, the state after
    the last token). On CUDA the Triton kernel (`kernels.triton_selective_scan`: one launch, not one a token)."""
    if x.is_cuda:
        from kernels.triton_selective_scan import scan as triton_scan

        return triton_scan(x, dt, A, B, C, D, ssm)
    return recurrence(x, dt, A, B, C, D, ssm, piece)


def recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
               ssm: torch.Tensor, piece: int = PIECE) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan` in torch on any device: the recurrence token by token, a piece's decays and inputs made at once."""
    outs = []
    for start in range(0, x.shape[0], piece):
        part = slice(start, start + piece)
        decay, states = _discretized(x[part], dt[part], A, B[part])   # states: the inputs, then each token's state
        for t in range(states.shape[0]):
            ssm = torch.addcmul(states[t], decay[t], ssm, out=states[t])
        outs.append(torch.einsum("tcn,tn->tc", states, C[part].float()))
    return torch.cat(outs) + D.float() * x.float(), ssm.clone()


def scan_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                ssm: torch.Tensor, pieces: Pieces, piece: int = PIECE) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens at once, each from its own state (`kernels.pieces`: tokens flat, sequence after
    sequence, each sequence's in parts): `scan`'s per-token tensors over all of them, ssm [num_seqs, channels,
    d_state] -> (y [num_tokens, channels] float32, the state after each part [num_parts, channels, d_state]). On CUDA
    the Triton kernel's one launch; in torch the t-th tokens of all sequences step together."""
    if x.is_cuda:
        from kernels.triton_selective_scan import scan_pieces as triton_pieces

        return triton_pieces(x, dt, A, B, C, D, ssm, pieces)
    return recurrence_pieces(x, dt, A, B, C, D, ssm, pieces, piece)


def recurrence_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, ssm: torch.Tensor, pieces: Pieces, piece: int = PIECE
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_pieces` in torch: the tokens laid out step by step (`kernels.pieces.TorchPlan` of one-token tiles: the
    t-th tokens of the sequences still scanning are a slice), their decays and inputs made for about `piece` tokens
    of steps at once, then each step's states from the last's."""
    if pieces.num_parts == 1:
        y, after = recurrence(x, dt, A, B, C, D, ssm[0], piece)
        return y, after.unsqueeze(0)
    plan = pieces.torch_plan(1, x.device)
    xs, dts, Bs, Cs = (t.new_empty(t.shape).index_copy_(0, plan.unpad, t) for t in (x, dt, B, C))   # step order
    state = ssm.float().index_select(0, plan.order)                            # sequences by their tokens
    after = state.new_empty(pieces.num_parts, *state.shape[1:])
    y, block = torch.empty(x.shape, dtype=torch.float32, device=x.device), []
    for i, step in enumerate(plan.steps):   # the steps in blocks of about `piece` tokens
        block.append(step)
        if i + 1 < len(plan.steps) and step[1] - block[0][0] < piece:
            continue
        lo, hi = block[0][0], step[1]
        decay, states = _discretized(xs[lo:hi], dts[lo:hi], A, Bs[lo:hi])
        for first, end, places, parts in block:   # states: the inputs, then each token's state
            at = slice(first - lo, end - lo)
            state[:end - first] = torch.addcmul(states[at], decay[at], state[:end - first], out=states[at])
            if places is not None:
                after.index_copy_(0, parts, state.index_select(0, places))
        y[lo:hi] = torch.einsum("tcn,tn->tc", states, Cs[lo:hi].float())
        block = []
    return y.index_select(0, plan.unpad) + D.float() * x.float(), after


def _discretized(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(dt A) [..., channels, d_state], dt B x [..., channels, d_state]), float32."""
    decay = torch.exp(dt[..., None] * A.float())
    return decay, dt[..., None] * B.float()[..., None, :] * x.float()[..., None]
