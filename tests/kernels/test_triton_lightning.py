"""Lightning attention in Triton (`kernels.triton_lightning`) against the torch form (`kernels.lightning.chunked_torch`,
itself transformers' MiniMax functions': tests/kernels/test_lightning.py) through Triton's interpreter on the CPU:
outputs and carried state, prompts cut anywhere into chunks, head sizes padded inside the kernel; an engine prefilling
MiniMax's tiny model through it; built for sm_90 at MiniMax-Text-01's shape."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything (transformers too) imports triton

import pytest
import torch

from kernels import lightning


def _inputs(num_tokens, heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3 * heads * head_dim, generator=gen)   # split views, as served
    q, k, v = (t.unflatten(-1, (heads, head_dim)) for t in qkv.split(heads * head_dim, dim=-1))
    slopes = torch.rand(heads, generator=gen) * 0.5 + 0.01
    ssm = torch.randn(heads, head_dim, head_dim, generator=gen)
    return q, k, v, slopes, ssm


@pytest.mark.parametrize("num_tokens, chunk", [(1, 16), (15, 16), (37, 16), (70, 32), (130, 64)])
@pytest.mark.parametrize("heads, head_dim", [(4, 16), (2, 40)])
def test_the_triton_kernel_gives_the_torch_forms_outputs_and_state(num_tokens, chunk, heads, head_dim):
    pytest.importorskip("triton")
    from kernels import triton_lightning

    inputs = _inputs(num_tokens, heads, head_dim)
    out, state = triton_lightning.chunked(*inputs, chunk=chunk)
    ref, ref_state = lightning.chunked_torch(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.slow   # ~8 s through the interpreter; the kernels' exactness is above, a GPU runs these models in
# tests/engine/test_engine_vs_hf.py's CUDA parity test
@pytest.mark.usefixtures("one_thread")
def test_an_engine_prefilling_through_the_kernel_answers_as_transformers(tmp_path, builtin_path, monkeypatch):
    """MiniMax's tiny model (lightning layers beside a full one) with every prefill piece of its lightning layers
    through the kernel (as on CUDA: the interpreter here), prompts of 5 to 100: transformers' greedy tokens."""
    pytest.importorskip("triton")
    from kernels import triton_lightning
    from tests.engine.test_engine_vs_hf import MINIMAX
    from tests.kernels.test_triton_gated_delta import assert_prefills_through

    assert_prefills_through(tmp_path, builtin_path, monkeypatch,
                            (lightning, lambda *args: triton_lightning.chunked_pieces(*args[:6]), "chunked_pieces"),
                            "minimax", MINIMAX)


@pytest.mark.parametrize("chunk", [16, 32])
def test_the_triton_pieces_give_each_part_alone(chunk):
    """Several sequences in parts at once (`chunked_pieces`: one launch, each sequence's state carried through its own
    chunks, a short chunk decaying it by its own tokens): outputs and the state after every part as the torch form
    gives them part after part."""
    pytest.importorskip("triton")
    from kernels import triton_lightning
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, slopes, _ = _inputs(pieces.num_tokens, 2, 16, seed=3)
    ssm = torch.randn(pieces.num_seqs, 2, 16, 16, generator=torch.Generator().manual_seed(4))
    out, after = triton_lightning.chunked_pieces(q, k, v, slopes, ssm, pieces, chunk=chunk)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: lightning.chunked_torch(q[at], k[at], v[at],
                                                                                             slopes, state))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)


def _build_lightning_kernel_for_sm90() -> dict:
    """Build the kernel at MiniMax-Text-01's shape (heads of 128, bfloat16 q, k, v) for sm_90."""
    from kernels import triton_lightning as tl_
    from tests.kernels.test_triton import _build_kernel_for_sm90

    _, usage = _build_kernel_for_sm90(
        tl_._lightning_kernel, dict(D=128, DP=128, BLOCK_V=tl_.BLOCK_V, CHUNK=tl_.CHUNK, DOT_PRECISION="tf32"),
        {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "slope_ptr": "fp32", "state_ptr": "fp32", "out_ptr": "fp32",
         "after_ptr": "fp32"}, num_warps=tl_.NUM_WARPS)
    return usage


def test_the_lightning_kernel_builds_for_h100_without_spilling():
    """What the interpreter cannot show: the kernel compiles for sm_90 at MiniMax-Text-01's shape as launched, and
    does not spill registers (where Triton ships cuobjdump to tell)."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    usage = _compiled_report(_build_lightning_kernel_for_sm90)
    assert usage.get("stack", 0) == 0, usage


@pytest.mark.gpu
def test_on_cuda_the_kernel_gives_the_torch_forms_outputs_at_minimax_text_01s_shape():
    """On a GPU, compiled: a 4,096-token prompt at MiniMax-Text-01's shape (64 heads of 128) in bfloat16 from a random
    state, the kernel's TF32 dots against the torch form's float32 on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_lightning

    q, k, v, slopes, ssm = (t.cuda() for t in _inputs(4096, 64, 128, seed=5))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out, state = triton_lightning.chunked(q, k, v, slopes, ssm)
    ref, ref_state = lightning.chunked_torch(q, k, v, slopes, ssm)
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (state - ref_state).abs().max() <= 1e-2 * ref_state.abs().max()


@pytest.mark.gpu
def test_on_cuda_the_pieces_give_each_part_alone_at_minimax_text_01s_shape():
    """On a GPU, compiled: eight sequences of 1 to 3 parts (test_triton_gated_delta's CUDA layout) at MiniMax-Text-01's
    shape in bfloat16, each from a random state, the kernel at once against the torch form part by part."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_lightning
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import _each_part_alone
    from tests.kernels.test_triton_gated_delta import CUDA_PARTS, CUDA_SEQ_PARTS

    pieces = Pieces(CUDA_PARTS, CUDA_SEQ_PARTS)
    q, k, v, slopes, _ = (t.cuda() for t in _inputs(pieces.num_tokens, 64, 128, seed=6))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    ssm = torch.randn(pieces.num_seqs, 64, 128, 128, device="cuda")
    out, after = triton_lightning.chunked_pieces(q, k, v, slopes, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: lightning.chunked_torch(q[at], k[at], v[at],
                                                                                             slopes, state))
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (after - ref_after).abs().max() <= 1e-2 * ref_after.abs().max()


def test_the_launcher_refuses_shapes_that_do_not_agree():
    pytest.importorskip("triton")
    from kernels import triton_lightning

    q, k, v, slopes, ssm = _inputs(20, 4, 16)
    for args, kwargs in (((q, k[:, :2], v, slopes, ssm), {}), ((q, k, v, slopes[:2], ssm), {}),
                         ((q, k, v, slopes, ssm[:, :8]), {}), ((q, k, v, slopes, ssm), {"chunk": 48})):
        with pytest.raises(ValueError, match="^lightning kernel:"):
            triton_lightning.chunked(*args, **kwargs)
