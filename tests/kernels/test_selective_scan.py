"""Mamba-1's selective scan (kernels.selective_scan) against transformers' Jamba functions (an implementation nobody
here wrote) and against itself: pieces that carry the state equal one piece, and decode steps continue a prefill. Its
Triton kernel (`kernels.triton_selective_scan`) against the torch reference through Triton's interpreter on the CPU:
channels past a whole program's and a state width that is not a power of two, from a state, in float32 and with
bfloat16 inputs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything (transformers too) imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import selective_scan  # noqa: E402

jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")


def make_inputs(num_tokens, channels=24, d_state=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, channels, generator=gen)
    dt = F.softplus(torch.randn(num_tokens, channels, generator=gen))
    A = -torch.rand(channels, d_state, generator=gen) * 2 - 0.05
    B = torch.randn(num_tokens, d_state, generator=gen)
    C = torch.randn(num_tokens, d_state, generator=gen)
    D = torch.randn(channels, generator=gen)
    ssm = torch.randn(channels, d_state, generator=gen)
    return x, dt, A, B, C, D, ssm


@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_scan_matches_transformers(num_tokens):
    """From zeros (transformers' scan starts there): the outputs and the state after the last token."""
    x, dt, A, B, C, D, ssm = make_inputs(num_tokens)
    y, state = selective_scan.scan(x, dt, A, B, C, D, torch.zeros_like(ssm), piece=16)
    ref, ref_state = jamba.mamba_selective_scan(x.t()[None], dt.t()[None], A, B.t()[None], C.t()[None], D=D,
                                                return_last_state=True, use_associative_scan=False)
    torch.testing.assert_close(y, ref[0].t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-5)


def test_step_matches_transformers():
    x, dt, A, B, C, D, ssm = make_inputs(3, seed=1)   # three sequences, one token each
    states = torch.stack([ssm, 0.5 * ssm, -ssm])
    y, new = selective_scan.step(x, dt, A, B, C, D, states)
    ref_state = states.clone()
    ref = jamba.mamba_selective_state_update(ref_state, x, dt, A, B, C, D)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, ref_state, atol=1e-5, rtol=1e-5)


def test_pieces_carry_the_state_and_steps_continue_a_prefill():
    """40 tokens as one piece, in pieces of 7 (the state carried between), and as 30 then 10 decode steps."""
    x, dt, A, B, C, D, ssm = make_inputs(40, seed=2)
    whole, final = selective_scan.scan(x, dt, A, B, C, D, ssm)
    pieces, state = selective_scan.scan(x, dt, A, B, C, D, ssm, piece=7)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)
    head, state = selective_scan.scan(x[:30], dt[:30], A, B[:30], C[:30], D, ssm)
    outs = [head]
    for t in range(30, 40):
        y, state = selective_scan.step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, state[None])
        state = state[0]
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,channels,d_state,dtype", [(1, 40, 12, torch.float32),
                                                                (9, 40, 12, torch.float32),
                                                                (6, 32, 16, torch.bfloat16)])
def test_the_triton_kernel_scans_as_the_reference(num_tokens, channels, d_state, dtype):
    pytest.importorskip("triton")
    from kernels import triton_selective_scan

    x, dt, A, B, C, D, ssm = make_inputs(num_tokens, channels, d_state, seed=3)
    x, B, C = x.to(dtype), B.to(dtype), C.to(dtype)
    y, state = triton_selective_scan.scan(x, dt, A, B, C, D, ssm)
    ref, ref_state = selective_scan.recurrence(x, dt, A, B, C, D, ssm)
    assert y.dtype == state.dtype == torch.float32 and y.shape == (num_tokens, channels)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_on_cuda_the_kernel_scans_a_jamba_layer_as_the_recurrence():
    """The compiled kernel on a GPU: 300 tokens of Jamba 1.5 Mini's 8,192 channels (a state of 16), bfloat16 inputs,
    from a state, against the torch recurrence on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_selective_scan

    x, dt, A, B, C, D, ssm = (t.cuda() for t in make_inputs(300, 8192, 16, seed=4))
    x, B, C = x.bfloat16(), B.bfloat16(), C.bfloat16()
    y, state = triton_selective_scan.scan(x, dt, A, B, C, D, ssm)
    ref, ref_state = selective_scan.recurrence(x, dt, A, B, C, D, ssm)
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(state, ref_state, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("with_triton", [False, True], ids=["torch", "triton"])
def test_several_sequences_in_parts_give_each_part_alone(with_triton):
    """`scan_pieces` (the Triton kernel at once, a program per sequence; torch part after part): outputs and the
    state after every part as the recurrence gives them part after part (test_gated_delta's layout)."""
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    x, dt, A, B, C, D, _ = make_inputs(pieces.num_tokens, 40, 12, seed=5)
    ssm = torch.randn(pieces.num_seqs, 40, 12, generator=torch.Generator().manual_seed(6))
    if with_triton:
        triton_selective_scan = pytest.importorskip("kernels.triton_selective_scan")
        y, after = triton_selective_scan.scan_pieces(x, dt, A, B, C, D, ssm, pieces)
    else:
        y, after = selective_scan.scan_pieces(x, dt, A, B, C, D, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: selective_scan.recurrence(
        x[at], dt[at], A, B[at], C[at], D, state, 16))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, ref_after, atol=1e-5, rtol=1e-5)
