"""Mamba-2's SSD scan in Triton (`kernels.triton_ssd`) against the torch form (`kernels.ssd.chunked_torch`, itself
transformers' Granite 4 scan to 1e-4: tests/kernels/test_ssd.py) through Triton's interpreter on the CPU: outputs
and carried state, prompts cut anywhere into chunks, heads sharing a group's B and C, sizes padded inside the
kernel; built for sm_90 at Granite 4-H's shape."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything (transformers too) imports triton

import pytest
import torch
import torch.nn.functional as F

from kernels import ssd


def _inputs(num_tokens, num_heads, head_dim, groups, d_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    dt = F.softplus(torch.randn(num_tokens, num_heads, generator=gen))
    A = -torch.rand(num_heads, generator=gen) * 4 - 0.1
    bc = torch.randn(num_tokens, 2 * groups * d_state, generator=gen)   # split views, as served
    B, C = (t.unflatten(-1, (groups, d_state)) for t in bc.split(groups * d_state, dim=-1))
    D = torch.randn(num_heads, generator=gen)
    ssm = torch.randn(num_heads, head_dim, d_state, generator=gen)
    return x, dt, A, B, C, D, ssm


@pytest.mark.parametrize("num_tokens, chunk", [(1, 16), (15, 16), (16, 16), (37, 16), (70, 32), (130, 64)])
@pytest.mark.parametrize("heads, head_dim, groups, d_state", [(4, 16, 2, 16), (2, 40, 1, 24)])
def test_the_triton_scan_gives_the_torch_forms_outputs_and_state(num_tokens, chunk, heads, head_dim, groups,
                                                                 d_state):
    pytest.importorskip("triton")
    from kernels import triton_ssd

    inputs = _inputs(num_tokens, heads, head_dim, groups, d_state)
    y, state = triton_ssd.chunked(*inputs, chunk=chunk)
    ref, ref_state = ssd.chunked_torch(*inputs)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [16, 32])
def test_the_triton_pieces_give_each_part_alone(chunk):
    """Several sequences in parts at once (`chunked_pieces`: one launch, each sequence's state carried through its own
    chunks): outputs and the state after every part as the torch form gives them part after part."""
    pytest.importorskip("triton")
    from kernels import triton_ssd
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    x, dt, A, B, C, D, _ = _inputs(pieces.num_tokens, 4, 16, 2, 16, seed=3)
    ssm = torch.randn(pieces.num_seqs, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    y, after = triton_ssd.chunked_pieces(x, dt, A, B, C, D, ssm, pieces, chunk=chunk)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: ssd.chunked_torch(x[at], dt[at], A, B[at], C[at],
                                                                                       D, state))
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)


def _build_ssd_kernel_for_sm90() -> dict:
    """Build the kernel at Granite 4-H's shape (heads of 64, d_state 128, bfloat16 x, B, C) for sm_90."""
    from kernels import triton_ssd
    from tests.kernels.test_triton import _build_kernel_for_sm90

    _, usage = _build_kernel_for_sm90(
        triton_ssd._ssd_kernel, dict(P=64, N=128, NP=128, BLOCK_P=triton_ssd.BLOCK_P, CHUNK=triton_ssd.CHUNK,
                                     DOT_PRECISION="tf32"),
        {"x_ptr": "bf16", "dt_ptr": "fp32", "a_ptr": "fp32", "b_ptr": "bf16", "c_ptr": "bf16", "d_ptr": "fp32",
         "state_ptr": "fp32", "y_ptr": "fp32", "after_ptr": "fp32"}, num_warps=triton_ssd.NUM_WARPS)
    return usage


def test_the_ssd_kernel_builds_for_h100_without_spilling():
    """What the interpreter cannot show: the kernel compiles for sm_90 at Granite 4-H's shape as launched, and does
    not spill registers (where Triton ships cuobjdump to tell)."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    usage = _compiled_report(_build_ssd_kernel_for_sm90)
    assert usage.get("stack", 0) == 0, usage


@pytest.mark.gpu
def test_on_cuda_the_kernel_gives_the_torch_forms_outputs_at_granite_4_hs_shape():
    """On a GPU, compiled: a 4,096-token prompt at Granite 4-H's shape (128 heads of 64, one group, d_state 128) in
    bfloat16 from a random state, the kernel's TF32 dots against the torch form's float32 on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_ssd

    x, dt, A, B, C, D, ssm = (t.cuda() for t in _inputs(4096, 128, 64, 1, 128, seed=5))
    x, B, C = (t.to(torch.bfloat16) for t in (x, B, C))
    y, state = triton_ssd.chunked(x, dt, A, B, C, D, ssm)
    ref, ref_state = ssd.chunked_torch(x, dt, A, B, C, D, ssm)
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (state - ref_state).abs().max() <= 1e-2 * ref_state.abs().max()


@pytest.mark.gpu
def test_on_cuda_the_pieces_give_each_part_alone_at_granite_4_hs_shape():
    """On a GPU, compiled: eight sequences of 1 to 3 parts (test_triton_gated_delta's CUDA layout) at Granite 4-H's
    shape in bfloat16, each from a random state, the kernel at once against the torch form part by part."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_ssd
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import _each_part_alone
    from tests.kernels.test_triton_gated_delta import CUDA_PARTS, CUDA_SEQ_PARTS

    pieces = Pieces(CUDA_PARTS, CUDA_SEQ_PARTS)
    x, dt, A, B, C, D, _ = (t.cuda() for t in _inputs(pieces.num_tokens, 128, 64, 1, 128, seed=6))
    x, B, C = (t.to(torch.bfloat16) for t in (x, B, C))
    ssm = torch.randn(pieces.num_seqs, 128, 64, 128, device="cuda")
    y, after = triton_ssd.chunked_pieces(x, dt, A, B, C, D, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: ssd.chunked_torch(x[at], dt[at], A, B[at], C[at],
                                                                                       D, state))
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (after - ref_after).abs().max() <= 1e-2 * ref_after.abs().max()


@pytest.mark.slow   # ~8 s through the interpreter; the kernels' exactness is above, a GPU runs these models in
# tests/engine/test_engine_vs_hf.py's CUDA parity test
@pytest.mark.usefixtures("one_thread")
def test_an_engine_prefilling_through_the_kernel_answers_as_transformers(tmp_path, builtin_path, monkeypatch):
    """Granite 4-H's tiny model (Mamba-2 layers of 4 heads of 32, B and C in 2 groups) with every prefill piece of
    its Mamba layers through the kernel (as on CUDA: the interpreter here), prompts of 5 to 100: transformers'
    greedy tokens."""
    pytest.importorskip("triton")
    from kernels import triton_ssd
    from tests.engine.test_engine_vs_hf import GRANITE4_H
    from tests.kernels.test_triton_gated_delta import assert_prefills_through

    assert_prefills_through(tmp_path, builtin_path, monkeypatch, (ssd, triton_ssd.chunked_pieces, "chunked_pieces"),
                            "granitemoehybrid", GRANITE4_H)


def test_the_launcher_refuses_shapes_that_do_not_agree():
    pytest.importorskip("triton")
    from kernels import triton_ssd

    x, dt, A, B, C, D, ssm = _inputs(20, 4, 16, 2, 16)
    for args, kwargs in (((x, dt[:, :3], A, B, C, D, ssm), {}), ((x, dt, A, B, C[:, :1], D, ssm), {}),
                         ((x, dt, A, B, C, D, ssm[:, :8]), {}), ((x, dt, A, B, C, D, ssm), {"chunk": 8})):
        with pytest.raises(ValueError, match="^SSD kernel:"):
            triton_ssd.chunked(*args, **kwargs)
