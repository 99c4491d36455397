"""Lightning attention (kernels.lightning) against its definition written out token by token, o_t = sum over j <= t
of exp(-s (t - j)) (q_t . k_j) v_j, plus the starting state decayed t + 1 times, and against itself: blocks of any
size, a prompt cut into pieces that carry the state, and decode steps that continue a prefill give the same outputs
and states. (The model around it is checked against transformers' MiniMax in tests/engine/test_engine_vs_hf.py.)"""

import pytest
import torch

from kernels import lightning


def _inputs(num_tokens, heads=4, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(num_tokens, heads, dim, generator=gen) for _ in range(3))
    slopes = torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(heads)])   # a 4-head model's, 0.25 down to 1/256
    ssm = torch.randn(heads, dim, dim, generator=gen)
    return q, k, v, slopes, ssm


def _by_definition(q, k, v, slopes, ssm):
    steps = torch.arange(q.shape[0], dtype=torch.float32)
    gap = steps[:, None] - steps[None, :]                                       # t - j
    weight = torch.exp(-slopes[:, None, None] * gap.clamp(min=0)) * (gap >= 0)  # [heads, t, j]
    scores = torch.einsum("thd,jhd->htj", q, k) * weight
    held = torch.einsum("thd,hde->hte", q, ssm) * torch.exp(-slopes[:, None, None] * (steps[:, None] + 1))
    out = torch.einsum("htj,jhe->the", scores, v) + held.transpose(0, 1)
    state = ssm * torch.exp(-slopes * q.shape[0])[:, None, None] + torch.einsum(
        "jhd,jhe,hj->hde", k, v, torch.exp(-slopes[:, None] * (q.shape[0] - 1 - steps)))
    return out, state


@pytest.mark.parametrize("num_tokens", [1, 5, 63, 64, 65, 150])
def test_chunked_is_the_definition(num_tokens):
    q, k, v, slopes, ssm = _inputs(num_tokens)
    out, state = lightning.chunked(q, k, v, slopes, ssm)
    ref, ref_state = _by_definition(q, k, v, slopes, ssm)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_blocks_pieces_and_decode_steps_agree():
    q, k, v, slopes, ssm = _inputs(100, seed=1)
    whole, state = lightning.chunked(q, k, v, slopes, ssm)
    for block in (1, 7, 32, 256):
        out, last = lightning.chunked(q, k, v, slopes, ssm, block=block)
        torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last, state, atol=1e-4, rtol=1e-4)
    first, held = lightning.chunked(q[:37], k[:37], v[:37], slopes, ssm)          # a prefill in two pieces
    second, held = lightning.chunked(q[37:90], k[37:90], v[37:90], slopes, held)
    steps = []
    for t in range(90, 100):                                                       # then decode steps, one token
        out, states = lightning.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], slopes, held[None])
        steps.append(out)
        held = states[0]
    torch.testing.assert_close(torch.cat([first, second, *steps]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(held, state, atol=1e-4, rtol=1e-4)


def test_a_decode_step_runs_many_sequences_each_from_its_state():
    q, k, v, slopes, ssm = _inputs(3, seed=2)
    states = torch.stack([ssm, 0.5 * ssm, torch.zeros_like(ssm)])
    out, new = lightning.recurrent_step(q, k, v, slopes, states)
    for i in range(3):
        ref, ref_state = _by_definition(q[i:i + 1], k[i:i + 1], v[i:i + 1], slopes, states[i])
        torch.testing.assert_close(out[i], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[i], ref_state, atol=1e-5, rtol=1e-5)


def test_several_sequences_in_parts_at_once_give_each_part_alone():
    """`chunked_pieces` (every block's products at once, short blocks decaying the state by their own tokens, the
    sequences' j-th blocks stepped together): outputs and the state after every part as `chunked` gives them part
    after part (test_gated_delta's layout)."""
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, slopes, _ = _inputs(pieces.num_tokens, seed=4)
    ssm = torch.randn(pieces.num_seqs, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    out, after = lightning.chunked_pieces(q, k, v, slopes, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: lightning.chunked(q[at], k[at], v[at], slopes,
                                                                                       state))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)
