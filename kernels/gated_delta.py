"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5), and the short causal
convolution before it, in torch: the CPU path and the yardstick for a fused kernel.

A linear-attention layer keeps no K/V per token; each sequence carries a fixed-size state instead:
- `conv`: the last `kernel - 1` inputs of the depthwise causal convolution, [channels, kernel - 1];
- `ssm`: the recurrent matrix S, [num_v_heads, k_head_dim, v_head_dim] (float32).

For each token t (q and k L2-normed, q scaled by k_head_dim ** -0.5; g <= 0 the log of the state's decay, beta in
(0, 1) the write strength):

    S   = exp(g_t) S
    S  += k_t (beta_t (v_t - S^T k_t))^T          (the delta rule: write what S does not yet predict)
    o_t = S^T q_t

`recurrent_step` runs one token of many sequences at once (decode). `chunked` runs one sequence's new tokens
in chunks of 64 (prefill): within a chunk the updates are condensed into triangular solves and matrix
products (the WY form of the delta rule), so a prompt costs T / 64 sequential steps, not T. On CUDA `chunked` is
`kernels.triton_gated_delta`'s two launches (a decay a head, or Kimi's a key channel).
`chunked_pieces` runs several sequences' new tokens at once, each from its own state and in parts
(`kernels.pieces`): a step's prefill chunks in as many sequential steps as the longest has chunks (on CUDA the same
two launches), and `causal_conv_pieces` their convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.pieces import Pieces, scan_tiles, tiles

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) along the last dimension (the flash-linear-attention library's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new inputs through the depthwise causal convolution (plus `bias`, Mamba-2's) and SiLU (not
    where `silu` is false: LFM2's short convolutions).

    x: [num_tokens, channels]; weight: [channels, kernel]; state: [channels, kernel - 1], the inputs before x
    (zeros for a new sequence) -> (out [num_tokens, channels] in x's dtype, the new state)."""
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)                  # [channels, kernel - 1 + num_tokens]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    return (F.silu(out) if silu else out).t(), window[:, window.shape[1] - state.shape[1]:]


def causal_conv_pieces(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, pieces: Pieces,
                       bias: torch.Tensor | None = None, silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` for several sequences' new inputs at once (`kernels.pieces`' layout), each from its own state,
    as one convolution over a flat window (each sequence's state columns, then its inputs). x: [num_tokens,
    channels]; states: [num_seqs, channels, kernel - 1] -> (out [num_tokens, channels], the state after each part
    [num_parts, channels, kernel - 1], in x's dtype)."""
    if pieces.num_parts == 1:
        out, after = causal_conv(x, weight, states[0], bias, silu)
        return out, after.unsqueeze(0)
    out, after = windows_pieces(x, states, pieces, lambda window: F.conv1d(window, weight.unsqueeze(1), bias,
                                                                           groups=weight.shape[0]))
    return F.silu(out) if silu else out, after


def windows_pieces(x: torch.Tensor, states: torch.Tensor, pieces: Pieces, convolve
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new inputs x [num_tokens, channels] (`kernels.pieces`' layout) through `convolve` (a
    window [1, channels, length] -> [1, channels, length - held], causal and unpadded: one convolution or a stack of
    them), each from its state [channels, held] (`states`: [num_seqs, ...]), as one call over a flat window (each
    sequence's state columns, then its inputs) -> (the outputs [num_tokens, channels], the state after each part
    [num_parts, channels, held], in x's dtype)."""
    held = states.shape[-1]
    table = pieces.conv_table(held + 1, x.device)
    flat = x.new_empty(x.shape[1], table.length)                            # [channels, the flat window]
    flat.index_copy_(1, table.tokens, x.t())
    flat.index_copy_(1, table.states, states.to(x.dtype).transpose(0, 1).flatten(1))
    out = convolve(flat.unsqueeze(0))[0].index_select(1, table.outputs).t()
    return out, flat.index_select(1, table.after).unflatten(1, (-1, held)).transpose(0, 1)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None,
                     silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input of each of many sequences. x: [num_seqs, channels]; state: [num_seqs, channels, kernel - 1]
    -> (out [num_seqs, channels], the new states)."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)       # [num_seqs, channels, kernel]
    out = (window * weight).sum(-1)
    out = out if bias is None else out + bias
    return F.silu(out) if silu else out, window[..., 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., num_k_heads, k_head_dim] -> float32, one per value head (each key head serves
    num_v_heads / num_k_heads consecutive value heads), L2-normed, q scaled by k_head_dim ** -0.5."""
    groups = num_v_heads // k.shape[-2]
    q, k = (t.float().repeat_interleave(groups, dim=-2) if groups > 1 else t.float() for t in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of many sequences.

    q, k: [num_seqs, num_k_heads, k_head_dim]; v: [num_seqs, num_v_heads, v_head_dim]; g, beta: [num_seqs,
    num_v_heads] (g [num_seqs, num_v_heads, k_head_dim]: a decay per key channel, Kimi Delta Attention's); ssm:
    [num_seqs, num_v_heads, k_head_dim, v_head_dim] float32 -> (out [num_seqs, num_v_heads, v_head_dim] float32, the
    new states)."""
    q, k = _prepare(q, k, v.shape[-2])
    q, k = q.float().unsqueeze(-2), k.float().unsqueeze(-2)                # [num_seqs, heads, 1, k_head_dim]
    decay = g.float().exp()
    state = ssm * (decay[..., None] if g.dim() == 3 else decay[..., None, None])
    # products with the state as batched matrix products, the rank-one update in place: the state read four times
    # and written twice, no temporary of its size (its elementwise form made five: a decode step's bulk on a CPU)
    predicted = (k @ state).squeeze(-2)                                     # S^T k: [num_seqs, heads, v_head_dim]
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    flat = state.view(-1, *state.shape[-2:])
    flat.baddbmm_(k.reshape(-1, 1, k.shape[-1]).transpose(1, 2), delta.reshape(-1, 1, delta.shape[-1]))
    return (q @ state).squeeze(-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens, from its state.

    q, k: [num_tokens, num_k_heads, k_head_dim]; v: [num_tokens, num_v_heads, v_head_dim]; g, beta: [num_tokens,
    num_v_heads]; ssm: [num_v_heads, k_head_dim, v_head_dim] float32 -> (out [num_tokens, num_v_heads, v_head_dim]
    float32, the state after the last token). g [num_tokens, num_v_heads, k_head_dim]: `chunked_per_channel`'s."""
    if v.is_cuda:   # two launches, not a handful a chunk (`kernels.triton_gated_delta`), either decay
        from kernels.triton_gated_delta import chunked as triton_chunked

        return triton_chunked(q, k, v, g, beta, ssm)
    if g.dim() == 3:
        return chunked_per_channel(q, k, v, g, beta, ssm, chunk)
    return chunked_torch(q, k, v, g, beta, ssm, chunk)


def chunked_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens at once, each from its own state (`kernels.pieces`: tokens flat, sequence after
    sequence, each sequence's in parts): `chunked`'s per-token tensors over all of them, ssm [num_seqs, num_v_heads,
    k_head_dim, v_head_dim] -> (out [num_tokens, num_v_heads, v_head_dim] float32, the state after each part
    [num_parts, ...]). What `chunked` per part gives, in as many sequential steps as the longest sequence has chunks
    (the torch form; on CUDA two launches in all, either decay). A decay per channel (g [num_tokens, heads,
    k_head_dim]): `chunked_per_channel_pieces` off CUDA."""
    if v.is_cuda:
        from kernels.triton_gated_delta import chunked_pieces as triton_pieces

        return triton_pieces(q, k, v, g, beta, ssm, pieces)
    if g.dim() == 3:
        return chunked_per_channel_pieces(q, k, v, g, beta, ssm, pieces, chunk)
    return chunked_pieces_torch(q, k, v, g, beta, ssm, pieces, chunk)


def chunked_pieces_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_pieces` in torch: every chunk's WY form at once, then the chunks' steps through the states, the j-th
    chunks of all sequences that have one together."""
    if pieces.num_parts == 1:
        out, after = chunked_torch(q, k, v, g, beta, ssm[0], chunk)
        return out, after.unsqueeze(0)
    plan = pieces.torch_plan(chunk, v.device)
    q, k = _prepare(q, k, v.shape[-2])
    v = tiles(v.float(), plan, chunk)   # padded tokens have g = 0 and beta = 0: they change nothing
    u, w, scores, q_decayed, k_to_end, chunk_decay = _wy(*(tiles(t, plan, chunk) for t in (q, k)), v,
                                                         *(tiles(t.float(), plan, chunk) for t in (g, beta)))

    def step(at: slice, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = u[at] - w[at] @ held                                           # what the states do not predict
        return q_decayed[at] @ held + scores[at] @ new, held * chunk_decay[at] + k_to_end[at].transpose(-1, -2) @ new

    return scan_tiles(plan, ssm, pieces.num_parts, torch.empty_like(v), step)


def chunked_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` in torch on any device (a decay a head): the CPU's path, and the yardstick of the Triton one."""
    num_tokens = v.shape[0]
    q, k = _prepare(q, k, v.shape[-2])
    pad = -num_tokens % chunk
    # [heads, chunks, chunk, dim]; padded tokens have g = 0 and beta = 0: they change nothing
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk)) for t in (q, k, v.float()))
    g, beta = (F.pad(t.float().t(), (0, pad)).unflatten(1, (-1, chunk)) for t in (g, beta))
    u, w, scores, q_decayed, k_to_end, chunk_decay = _wy(q, k, v, g, beta)
    out = torch.empty_like(v)
    state = ssm.float()
    for i in range(v.shape[1]):
        new = u[:, i] - w[:, i] @ state                                      # what the state does not predict
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ new
    return out.flatten(1, 2)[:, :num_tokens].transpose(0, 1), state


def _wy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
    """Within each chunk of tokens (q, k, v [..., chunk, dim]; g, beta [..., chunk], any leading dimensions): the WY
    form's u and w, the causal scores, q decayed from the chunk's start, k decayed to its end, and the chunk's
    whole decay [..., 1, 1]."""
    chunk = v.shape[-2]
    decay = g.cumsum(-1)                                                     # log decay from the chunk's start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    # exp(decay_i - decay_j) for j <= i, else 0
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair                           # strictly lower part: the WY system
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair                                # within the chunk, causal
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    return u, w, scores, q_decayed, k_to_end, chunk_decay


def _per_channel_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, later: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of each of any leading dimensions (q, k, v, decay [..., chunk, dim], decay summed from the chunk's
    start; beta [..., chunk]; state [..., k_head_dim, v_head_dim]; later: [chunk, chunk, 1], j > i) -> (its outputs,
    the state after it)."""
    pair = (decay.unsqueeze(-2) - decay.unsqueeze(-3)).masked_fill(later, float("-inf")).exp()   # [..., i, j, c]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * pair).sum(-1)         # strictly lower part: the WY system
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp(), upper=False, unitriangular=True)
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3) * pair).sum(-1)             # within the chunk, causal
    new = u - w @ state                                                      # what the state does not predict
    out = (q * decay.exp()) @ state + scores @ new
    last = decay[..., -1:, :]                                                # [..., 1, k_head_dim]
    return out, state * last.exp().transpose(-1, -2) + (k * (last - decay).exp()).transpose(-1, -2) @ new


def chunked_per_channel_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               ssm: torch.Tensor, pieces: Pieces, chunk: int = CHUNK
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_pieces` with a decay per key channel: the sequences' j-th chunks together (`kernels.pieces.TorchPlan`),
    each step's [sequences, heads, chunk, chunk, k_head_dim] weights made at once (a caller bounds the sequences)."""
    if pieces.num_parts == 1:
        out, after = chunked_per_channel(q, k, v, g, beta, ssm[0], chunk)
        return out, after.unsqueeze(0)
    plan = pieces.torch_plan(chunk, v.device)
    q, k = _prepare(q, k, v.shape[-2])
    # [tiles, heads, chunk, dim]; padded tokens have g = 0 and beta = 0: they change nothing
    q, k, v, g, beta = (tiles(t.float(), plan, chunk) for t in (q, k, v, g, beta))
    decays = g.cumsum(-2)                                                    # per channel, from the chunk's start
    later = ~torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril().unsqueeze(-1)
    return scan_tiles(plan, ssm, pieces.num_parts, torch.empty_like(v), lambda at, held: _per_channel_chunk(
        q[at], k[at], v[at], decays[at], beta[at], held, later))


def chunked_per_channel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        ssm: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` with a decay per key channel (Kimi Delta Attention's): g [num_tokens, num_v_heads, k_head_dim].

    The same WY form a chunk at a time, each pair of tokens (i, j <= i) decayed channel by channel: the system's and
    the scores' dot products weigh each channel c by exp(decay_i[c] - decay_j[c]) (at most 1: made one chunk at a
    time, [heads, chunk, chunk, k_head_dim]), the state's rows by their own channel's decay."""
    num_tokens = v.shape[0]
    q, k = _prepare(q, k, v.shape[-2])
    pad = -num_tokens % chunk
    # [heads, chunks, chunk, dim]; padded tokens have g = 0 and beta = 0: they change nothing
    q, k, v, g = (F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk)) for t in (q, k, v, g))
    beta = F.pad(beta.float().t(), (0, pad)).unflatten(1, (-1, chunk))      # [heads, chunks, chunk]
    decays = g.cumsum(-2)                                                    # per channel, from the chunk's start
    later = ~torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril().unsqueeze(-1)
    out = torch.empty_like(v)
    state = ssm.float()
    for i in range(v.shape[1]):
        out[:, i], state = _per_channel_chunk(q[:, i], k[:, i], v[:, i], decays[:, i], beta[:, i], state, later)
    return out.flatten(1, 2)[:, :num_tokens].transpose(0, 1), state
