"""The gated delta rule and the causal convolution (kernels.gated_delta) against transformers' Qwen3.5 functions
(an implementation nobody here wrote) and against each other: a prompt cut anywhere into pieces that carry the
state gives what one piece gives, and decode steps continue a prefill."""

import pytest
import torch

from kernels import gated_delta

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _make_inputs(num_tokens, num_k_heads=2, num_v_heads=4, dk=8, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_k_heads, dk, generator=gen)
    k = torch.randn(num_tokens, num_k_heads, dk, generator=gen)
    v = torch.randn(num_tokens, num_v_heads, dv, generator=gen)
    g = -torch.rand(num_tokens, num_v_heads, generator=gen) * 2         # log decay <= 0
    beta = torch.rand(num_tokens, num_v_heads, generator=gen)
    ssm = torch.randn(num_v_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, ssm


@pytest.mark.parametrize("num_tokens", [1, 5, 63, 64, 65, 150])
def test_chunked_matches_transformers(num_tokens):
    q, k, v, g, beta, ssm = _make_inputs(num_tokens)
    out, state = gated_delta.chunked(q, k, v, g, beta, ssm)
    ref, ref_state = qwen3_5.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=ssm[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state, ref_state[0], atol=2e-5, rtol=2e-5)


def test_recurrent_step_matches_transformers():
    q, k, v, g, beta, ssm = _make_inputs(3, seed=1)   # three sequences, one token each
    states = torch.stack([ssm, ssm * 0.5, -ssm])
    out, new = gated_delta.recurrent_step(q, k, v, g, beta, states)
    for i in range(3):
        ref, ref_state = qwen3_5.torch_recurrent_gated_delta_rule(
            q[None, i:i + 1], k[None, i:i + 1], v[None, i:i + 1], g=g[None, i:i + 1], beta=beta[None, i:i + 1],
            initial_state=states[i:i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[i], ref[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[i], ref_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cut", [1, 17, 64, 100])
def test_pieces_carrying_the_state_equal_one_piece_and_decode_continues_it(cut):
    q, k, v, g, beta, ssm = _make_inputs(140, seed=2)
    whole, whole_state = gated_delta.chunked(q, k, v, g, beta, ssm)
    first, state = gated_delta.chunked(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], ssm)
    second, state = gated_delta.chunked(q[cut:-1], k[cut:-1], v[cut:-1], g[cut:-1], beta[cut:-1], state)
    last, state = gated_delta.recurrent_step(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], state[None])
    torch.testing.assert_close(torch.cat([first, second, last]), whole, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(state[0], whole_state, atol=3e-5, rtol=3e-5)


def test_causal_conv_matches_transformers_prefill_and_update():
    gen = torch.Generator().manual_seed(3)
    channels, kernel, num_tokens = 12, 4, 9
    x = torch.randn(num_tokens, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    out, state = gated_delta.causal_conv(x[:-1], weight, torch.zeros(channels, kernel - 1))
    ref = qwen3_5.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    torch.testing.assert_close(out, ref[:-1], atol=1e-6, rtol=1e-6)
    step, state = gated_delta.causal_conv_step(x[-1:], weight, state[None])
    ref_state = x[-1 - (kernel - 1):-1].t().contiguous()[None]
    expected = qwen3_5.causal_conv1d_update(x[-1:].t()[None], ref_state, weight, activation="silu")
    torch.testing.assert_close(step, expected[0].t(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, ref_state, atol=0, rtol=0)   # the reference updated its state in place
    torch.testing.assert_close(step[0], ref[-1], atol=1e-6, rtol=1e-6)


# sequences of 1 to 3 parts: shorter than a chunk, a whole chunk, past one, a one-token part between longer ones
PARTS, SEQ_PARTS = [5, 70, 3, 1, 130, 2, 64, 17], [2, 1, 3, 1, 1]


def _each_part_alone(pieces, states, scan):
    """`scan(span, state) -> (out, state)` over each part in turn, each sequence from its own state."""
    outs, after = [], []
    for s in range(pieces.num_seqs):
        state = states[s]
        for p in range(pieces.first_part[s], pieces.first_part[s + 1]):
            out, state = scan(slice(pieces.part_starts[p], pieces.part_starts[p + 1]), state)
            outs.append(out)
            after.append(state)
    return torch.cat(outs), torch.stack(after)


def test_several_sequences_in_parts_at_once_give_each_part_alone():
    """`chunked_pieces` (every chunk's WY form at once, the sequences' j-th chunks stepped together) and
    `causal_conv_pieces` (one convolution over a flat window): outputs and the state after every part as `chunked`
    and `causal_conv` give them part after part."""
    from kernels.pieces import Pieces

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, g, beta, _ = _make_inputs(pieces.num_tokens, seed=4)
    ssm = torch.randn(pieces.num_seqs, 4, 8, 16, generator=torch.Generator().manual_seed(5))
    out, after = gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked(
        q[at], k[at], v[at], g[at], beta[at], state))
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(after, ref_after, atol=3e-5, rtol=3e-5)

    gen = torch.Generator().manual_seed(6)
    x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((pieces.num_tokens, 12), (12, 4), (12,)))
    conv = torch.randn(pieces.num_seqs, 12, 3, generator=gen)
    out, after = gated_delta.causal_conv_pieces(x, weight, conv, pieces, bias)
    ref, ref_after = _each_part_alone(pieces, conv, lambda at, state: gated_delta.causal_conv(x[at], weight, state,
                                                                                              bias))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(after, ref_after, atol=0, rtol=0)


def test_a_pieces_layout_without_a_token_in_a_part_or_a_part_in_a_sequence_is_refused():
    from kernels.pieces import Pieces

    for part_lens, seq_parts in (([3, 0], [2]), ([3, 4], [2, 0]), ([3, 4], [1]), ([], [])):
        with pytest.raises(ValueError, match="^pieces: "):
            Pieces(part_lens, seq_parts)


def test_a_decay_per_channel_in_parts_at_once_gives_each_part_alone():
    """`chunked_pieces` with Kimi Delta Attention's decay per key channel (`chunked_per_channel_pieces`: the
    sequences' j-th chunks together): outputs and the state after every part as `chunked_per_channel` part by part."""
    from kernels.pieces import Pieces

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, _, beta, _ = _make_inputs(pieces.num_tokens, num_k_heads=4, seed=7)
    g = -torch.rand(pieces.num_tokens, 4, 8, generator=torch.Generator().manual_seed(8)) * 0.5
    ssm = torch.randn(pieces.num_seqs, 4, 8, 16, generator=torch.Generator().manual_seed(9))
    out, after = gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked_per_channel(
        q[at], k[at], v[at], g[at], beta[at], state))
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(after, ref_after, atol=3e-5, rtol=3e-5)
