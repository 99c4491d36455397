"""Mamba-2's SSD scan (kernels.ssd) against transformers' Granite 4 functions (an implementation nobody here wrote)
and against itself: pieces that carry the state equal one piece, and decode steps continue a prefill."""

import pytest
import torch
import torch.nn.functional as F

from kernels import ssd

granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")


def _make_inputs(num_tokens, num_heads=4, head_dim=8, groups=2, d_state=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    dt_raw = torch.randn(num_tokens, num_heads, generator=gen)
    A = -torch.rand(num_heads, generator=gen) * 4 - 0.1
    B = torch.randn(num_tokens, groups, d_state, generator=gen)
    C = torch.randn(num_tokens, groups, d_state, generator=gen)
    D = torch.randn(num_heads, generator=gen)
    ssm = torch.randn(num_heads, head_dim, d_state, generator=gen)
    return x, dt_raw, A, B, C, D, ssm


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 65, 150])
def test_chunked_matches_transformers(num_tokens):
    x, dt_raw, A, B, C, D, ssm = _make_inputs(num_tokens)
    y, state = ssd.chunked(x, F.softplus(dt_raw), A, B, C, D, ssm)
    ref, ref_state = granite.mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=32, D=D,
                                               initial_states=ssm[None], dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(y, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state[0], atol=1e-4, rtol=1e-4)


def test_step_matches_transformers():
    x, dt_raw, A, B, C, D, ssm = _make_inputs(3, seed=1)   # three sequences, one token each
    states = torch.stack([ssm, 0.5 * ssm, -ssm])
    y, new = ssd.step(x, F.softplus(dt_raw), A, B, C, D, states)
    head_dim, d_state = x.shape[-1], B.shape[-1]
    ref_state = states.clone()
    ref = granite.mamba2_selective_state_update(
        ref_state, x, dt_raw[..., None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, d_state), B,
        C, D[:, None].expand(-1, head_dim), dt_softplus=True)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cut", [1, 30, 64, 100])
def test_pieces_carrying_the_state_equal_one_piece_and_decode_continues_it(cut):
    x, dt_raw, A, B, C, D, ssm = _make_inputs(140, seed=2)
    dt = F.softplus(dt_raw)
    whole, whole_state = ssd.chunked(x, dt, A, B, C, D, ssm)
    first, state = ssd.chunked(x[:cut], dt[:cut], A, B[:cut], C[:cut], D, ssm)
    second, state = ssd.chunked(x[cut:-1], dt[cut:-1], A, B[cut:-1], C[cut:-1], D, state)
    last, state = ssd.step(x[-1:], dt[-1:], A, B[-1:], C[-1:], D, state[None])
    torch.testing.assert_close(torch.cat([first, second, last]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], whole_state, atol=1e-4, rtol=1e-4)


def test_several_sequences_in_parts_at_once_give_each_part_alone():
    """`chunked_pieces` (every chunk's products at once, the sequences' j-th chunks stepped together): outputs and the
    state after every part as `chunked` gives them part after part (test_gated_delta's layout)."""
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    x, dt_raw, A, B, C, D, _ = _make_inputs(pieces.num_tokens, seed=4)
    dt = F.softplus(dt_raw)
    ssm = torch.randn(pieces.num_seqs, 4, 8, 16, generator=torch.Generator().manual_seed(5))
    y, after = ssd.chunked_pieces(x, dt, A, B, C, D, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: ssd.chunked(x[at], dt[at], A, B[at], C[at], D,
                                                                                 state))
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)
