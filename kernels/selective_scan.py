"""Mamba-1's selective scan (the state space of Jamba's Mamba layers), in torch: the CPU path and the yardstick for a
fused kernel. The causal convolution before it is `kernels.gated_delta.causal_conv`.

Each channel c of a sequence carries a state h_c [d_state] (float32). For each token t, with dt_t,c the channel's
step (after softplus) and A_c = -exp(A_log_c) [d_state] < 0:

    h_c = exp(dt_t,c A_c) * h_c + dt_t,c B_t x_t,c          (B_t, C_t: [d_state], shared by the channels)
    y_t,c = C_t . h_c + D_c x_t,c

Unlike Mamba-2's (`kernels.ssd`), the decay differs per state entry, so the scan has no chunked matrix form short of
a [chunk, chunk, channels, d_state] tensor: `scan` runs the recurrence token by token (transformers' and mamba_ssm's
reference order of products), over blocks of tokens whose decays and inputs it makes at once (as many as
`BLOCK_BYTES` of decays hold: larger blocks leave a CPU's cache, 3.5x as slow at Jamba's shape); on CUDA the
Triton kernel runs that recurrence in one launch (`kernels.triton_selective_scan`). `step` runs one token of many
sequences (decode): a few elementwise ops, captured in decode graphs.
"""

from __future__ import annotations

import torch

from kernels.pieces import Pieces

BLOCK_BYTES = 2 << 20   # the [tokens, channels, d_state] float32 decays made at once (and as many inputs)


def _block(channels: int, d_state: int) -> int:
    """Tokens a block of the recurrence holds: as many as `BLOCK_BYTES` of their decays (at least one; 4 at Jamba
    1.5 Mini's 8,192 channels of 16, where 256 took 3.5x as long on a CPU, 2026-12-07)."""
    return max(1, BLOCK_BYTES // (channels * d_state * 4))


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
         ssm: torch.Tensor, piece: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens, from its state.

    x: [num_tokens, channels]; dt: [num_tokens, channels] float32; A: [channels, d_state]; D: [channels]; B, C:
    [num_tokens, d_state]; ssm: [channels, d_state] float32 -> (y [num_tokens, channels] float32, the state after
    the last token). On CUDA the Triton kernel (`kernels.triton_selective_scan`: one launch, not one a token)."""
    if x.is_cuda:
        from kernels.triton_selective_scan import scan as triton_scan

        return triton_scan(x, dt, A, B, C, D, ssm)
    return recurrence(x, dt, A, B, C, D, ssm, piece)


def recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
               ssm: torch.Tensor, piece: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan` in torch on any device: the recurrence token by token, a block's decays and inputs made at once (`piece`
    tokens; None: `_block`'s)."""
    piece = piece or _block(*A.shape)
    outs = []
    for start in range(0, x.shape[0], piece):
        part = slice(start, start + piece)
        decay, states = _discretized(x[part], dt[part], A, B[part])   # states: the inputs, then each token's state
        for t in range(states.shape[0]):
            ssm = torch.addcmul(states[t], decay[t], ssm, out=states[t])
        outs.append(torch.einsum("tcn,tn->tc", states, C[part].float()))
    return torch.cat(outs) + D.float() * x.float(), ssm.clone()


def scan_pieces(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                ssm: torch.Tensor, pieces: Pieces, piece: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens, each from its own state (`kernels.pieces`: tokens flat, sequence after sequence,
    each sequence's in parts): `scan`'s per-token tensors over all of them, ssm [num_seqs, channels, d_state] -> (y
    [num_tokens, channels] float32, the state after each part [num_parts, channels, d_state]). On CUDA the Triton
    kernel's one launch; in torch part after part (stepping the sequences' t-th tokens together made a CPU's blocks of
    decays wider than its cache: 0.6-0.9x the speed at Jamba's shape, 2026-12-07)."""
    if x.is_cuda:
        from kernels.triton_selective_scan import scan_pieces as triton_pieces

        return triton_pieces(x, dt, A, B, C, D, ssm, pieces)
    outs, after = [], []
    for s in range(pieces.num_seqs):
        state = ssm[s]
        for p in range(pieces.first_part[s], pieces.first_part[s + 1]):
            at = slice(pieces.part_starts[p], pieces.part_starts[p + 1])
            y, state = recurrence(x[at], dt[at], A, B[at], C[at], D, state, piece)
            outs.append(y)
            after.append(state)
    return torch.cat(outs), torch.stack(after)


def _discretized(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(dt A) [..., channels, d_state], dt B x [..., channels, d_state]), float32."""
    decay = torch.exp(dt[..., None] * A.float())
    return decay, dt[..., None] * B.float()[..., None, :] * x.float()[..., None]
