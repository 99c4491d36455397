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
