"""The gated delta rule's chunked form in Triton (`kernels.triton_gated_delta`) against the torch form
(`kernels.gated_delta.chunked_torch`, itself transformers' to 2e-5: tests/kernels/test_gated_delta.py) through
Triton's interpreter on the CPU: outputs and carried state, prompts cut anywhere into chunks, value heads sharing key
heads, head sizes padded inside the kernels."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything (transformers too) imports triton

import pytest
import torch

from kernels import gated_delta


def _inputs(num_tokens, num_k_heads, num_v_heads, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 2 * num_k_heads * dk + num_v_heads * dv, generator=gen)   # split views, as served
    q, k, v = qkv.split([num_k_heads * dk, num_k_heads * dk, num_v_heads * dv], dim=-1)
    g = -torch.rand(num_tokens, num_v_heads, generator=gen) * 2         # log decay <= 0
    beta = torch.rand(num_tokens, num_v_heads, generator=gen)
    ssm = torch.randn(num_v_heads, dk, dv, generator=gen)
    return (q.unflatten(-1, (num_k_heads, dk)), k.unflatten(-1, (num_k_heads, dk)), v.unflatten(-1, (num_v_heads, dv)),
            g, beta, ssm)


@pytest.mark.parametrize("num_tokens, chunk", [(1, 16), (15, 16), (16, 16), (37, 16), (70, 32), (130, 64)])
@pytest.mark.parametrize("heads, dk, dv", [((2, 4), 16, 16), ((1, 2), 24, 40)])
def test_the_triton_chunks_give_the_torch_forms_outputs_and_state(num_tokens, chunk, heads, dk, dv):
    pytest.importorskip("triton")
    from kernels import triton_gated_delta

    q, k, v, g, beta, ssm = _inputs(num_tokens, *heads, dk, dv)
    out, state = triton_gated_delta.chunked(q, k, v, g, beta, ssm, chunk=chunk)
    ref, ref_state = gated_delta.chunked_torch(q, k, v, g, beta, ssm)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [16, 32])
def test_the_triton_pieces_give_each_part_alone(chunk):
    """Several sequences in parts at once (`chunked_pieces`: the chunks of every part in one launch, each sequence's
    state carried through its own): outputs and the state after every part as the torch form gives them part after
    part (test_gated_delta's layout: parts shorter than a chunk, whole chunks, past one)."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, g, beta, _ = _inputs(pieces.num_tokens, 2, 4, 16, 16, seed=7)
    ssm = torch.randn(pieces.num_seqs, 4, 16, 16, generator=torch.Generator().manual_seed(8))
    out, after = triton_gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces, chunk=chunk)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked_torch(
        q[at], k[at], v[at], g[at], beta[at], state))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)


def _per_channel(g, dk, seed, scale=2.0):
    """Kimi Delta Attention's decay a key channel in place of `_inputs`' decay a head (g [tokens, heads, dk])."""
    return -torch.rand(*g.shape, dk, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("num_tokens, chunk, heads, dk, dv, decay", [
    (1, 16, (2, 2), 16, 16, 2.0), (15, 16, (2, 2), 16, 16, 2.0), (37, 16, (2, 2), 16, 16, 2.0),
    (70, 32, (2, 2), 16, 16, 2.0), (37, 16, (1, 2), 24, 40, 2.0), (70, 32, (2, 2), 16, 16, 30.0)])
def test_the_triton_chunks_with_a_decay_a_channel_give_the_torch_forms(num_tokens, chunk, heads, dk, dv, decay):
    """Kimi Delta Attention's decay a key channel (`_wy_channel_kernel`, `_state_channel_kernel`) against
    `chunked_per_channel`: outputs and carried state, head sizes padded, value heads sharing key heads, and decays fast
    enough (up to 30 a token) that any factor exp(-decay) would overflow."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta

    q, k, v, g, beta, ssm = _inputs(num_tokens, *heads, dk, dv, seed=11)
    g = _per_channel(g, dk, seed=12, scale=decay)
    out, state = triton_gated_delta.chunked(q, k, v, g, beta, ssm, chunk=chunk)
    ref, ref_state = gated_delta.chunked_per_channel(q, k, v, g, beta, ssm)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_the_triton_pieces_with_a_decay_a_channel_give_each_part_alone():
    """`chunked_pieces` with a decay a key channel: every sequence's parts at once in the same two launches, the
    outputs and the state after every part as `chunked_per_channel` gives them part after part."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import PARTS, SEQ_PARTS, _each_part_alone

    pieces = Pieces(PARTS, SEQ_PARTS)
    q, k, v, g, beta, _ = _inputs(pieces.num_tokens, 1, 2, 16, 16, seed=13)
    g = _per_channel(g, 16, seed=14)
    ssm = torch.randn(pieces.num_seqs, 2, 16, 16, generator=torch.Generator().manual_seed(15))
    out, after = triton_gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces, chunk=16)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked_per_channel(
        q[at], k[at], v[at], g[at], beta[at], state))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_after, atol=1e-4, rtol=1e-4)


def _build_gated_delta_kernels_for_sm90() -> dict:
    """Build both kernels at Qwen3.5's shape (heads of 128 x 128, chunks of 64, bfloat16 q/k/v) for sm_90; their
    registers and stack a thread."""
    from kernels import triton_gated_delta as tgd
    from tests.kernels.test_triton import _build_kernel_for_sm90

    shape = dict(DK=128, DV=128, KP=128, CHUNK=tgd.CHUNK, DOT_PRECISION="tf32")
    _, wy = _build_kernel_for_sm90(tgd._wy_kernel, {**shape, "VP": 128},
                                   {"k_ptr": "bf16", "v_ptr": "bf16", "g_ptr": "fp32", "beta_ptr": "fp32",
                                    "w_ptr": "fp32", "u_ptr": "fp32", "decay_ptr": "fp32"}, num_warps=tgd.NUM_WARPS)
    state_pointers = {"q_ptr": "bf16", "k_ptr": "bf16", "w_ptr": "fp32", "u_ptr": "fp32", "decay_ptr": "fp32",
                      "state_ptr": "fp32", "out_ptr": "fp32", "after_ptr": "fp32"}
    _, state = _build_kernel_for_sm90(tgd._state_kernel, {**shape, "BLOCK_V": tgd.BLOCK_V}, state_pointers,
                                      num_warps=tgd.NUM_WARPS)
    _, wy_channel = _build_kernel_for_sm90(tgd._wy_channel_kernel, {**shape, "VP": 128},
                                           {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "g_ptr": "fp32",
                                            "beta_ptr": "fp32", "w_ptr": "fp32", "u_ptr": "fp32", "decay_ptr": "fp32",
                                            "scores_ptr": "fp32"}, num_warps=tgd.NUM_WARPS)
    _, state_channel = _build_kernel_for_sm90(tgd._state_channel_kernel, {**shape, "BLOCK_V": tgd.BLOCK_V},
                                              {**state_pointers, "scores_ptr": "fp32"}, num_warps=tgd.NUM_WARPS)
    return {"wy": wy, "state": state, "wy_channel": wy_channel, "state_channel": state_channel}


def test_the_gated_delta_kernels_build_for_h100():
    """What the interpreter cannot show: the four kernels (a decay a head and a key channel) compile for sm_90 at
    Qwen3.5's and Kimi Linear's head shape (the row-by-row inverse and per-channel rows, the cumulative sums, the TF32
    dots of a bfloat16 model), as launched, and none spills registers (where Triton ships cuobjdump to tell)."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    report = _compiled_report(_build_gated_delta_kernels_for_sm90)
    assert set(report) == {"wy", "state", "wy_channel", "state_channel"}, report
    assert all(usage.get("stack", 0) == 0 for usage in report.values()), report


def test_a_bfloat16_models_chunks_run_on_tf32_dots_within_its_rounding():
    """q, k and v in bfloat16 (a served model's): the kernels' TF32 dots over float32 tiles give the torch form's
    float32 outputs and state within bfloat16's rounding, with a decay a head and a key channel."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta

    q, k, v, g, beta, ssm = _inputs(70, 2, 4, 16, 16, seed=3)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out, state = triton_gated_delta.chunked(q, k, v, g, beta, ssm)
    ref, ref_state = gated_delta.chunked_torch(q, k, v, g, beta, ssm)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=2e-2, rtol=2e-2)
    q, k, v, g, beta = (t[:40] for t in (q, k, v, _per_channel(g, 16, seed=4), beta))   # and a decay a key channel
    out, state = triton_gated_delta.chunked(q, k, v, g, beta, ssm)
    ref, ref_state = gated_delta.chunked_per_channel(q, k, v, g, beta, ssm)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_on_cuda_the_kernels_give_the_torch_forms_outputs_at_qwen3_5s_shape():
    """On a GPU, compiled: a 4,096-token prompt at Qwen3.5's shape (16 key heads, 32 value heads of 128) in bfloat16
    from a random state, the kernels' TF32 dots against the torch form's float32 on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_gated_delta

    q, k, v, g, beta, ssm = (t.cuda() for t in _inputs(4096, 16, 32, 128, 128, seed=5))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out, state = triton_gated_delta.chunked(q, k, v, g, beta, ssm)
    ref, ref_state = gated_delta.chunked_torch(q, k, v, g, beta, ssm)
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (state - ref_state).abs().max() <= 1e-2 * ref_state.abs().max()


# eight sequences of 64 to 2,048 tokens in one to three parts (a CUDA test's)
CUDA_PARTS, CUDA_SEQ_PARTS = [64, 2048, 100, 412, 7, 300, 1000, 33, 31, 1, 500], [1, 1, 2, 3, 1, 1, 1, 1]


@pytest.mark.gpu
def test_on_cuda_the_pieces_give_each_part_alone_at_qwen3_5s_shape():
    """On a GPU, compiled: eight sequences of 64 to 2,048 tokens in one to three parts at Qwen3.5's shape in bfloat16,
    each from a random state, the kernels at once against the torch form part by part on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_gated_delta
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import _each_part_alone

    pieces = Pieces(CUDA_PARTS, CUDA_SEQ_PARTS)
    q, k, v, g, beta, _ = (t.cuda() for t in _inputs(pieces.num_tokens, 16, 32, 128, 128, seed=9))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    ssm = torch.randn(pieces.num_seqs, 32, 128, 128, device="cuda")
    out, after = triton_gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked_torch(
        q[at], k[at], v[at], g[at], beta[at], state))
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (after - ref_after).abs().max() <= 1e-2 * ref_after.abs().max()


@pytest.mark.gpu
def test_on_cuda_the_pieces_with_a_decay_a_channel_give_each_part_alone_at_kimi_linears_shape():
    """On a GPU, compiled: `test_on_cuda_the_pieces_give_each_part_alone_at_qwen3_5s_shape`'s sequences at Kimi
    Linear's shape (32 heads of 128, a decay a key channel) in bfloat16, against `chunked_per_channel` part by part."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import triton_gated_delta
    from kernels.pieces import Pieces
    from tests.kernels.test_gated_delta import _each_part_alone

    pieces = Pieces(CUDA_PARTS, CUDA_SEQ_PARTS)
    q, k, v, g, beta, _ = _inputs(pieces.num_tokens, 32, 32, 128, 128, seed=16)
    g = _per_channel(g, 128, seed=17)
    q, k, v, g, beta = (t.cuda() for t in (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), g, beta))
    ssm = torch.randn(pieces.num_seqs, 32, 128, 128, device="cuda")
    out, after = triton_gated_delta.chunked_pieces(q, k, v, g, beta, ssm, pieces)
    ref, ref_after = _each_part_alone(pieces, ssm, lambda at, state: gated_delta.chunked_per_channel(
        q[at], k[at], v[at], g[at], beta[at], state))
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (after - ref_after).abs().max() <= 1e-2 * ref_after.abs().max()


@pytest.mark.slow   # ~8 s through the interpreter; the kernels' exactness is above, a GPU runs these models in
# tests/engine/test_engine_vs_hf.py's CUDA parity test
@pytest.mark.usefixtures("one_thread")
def test_an_engine_prefilling_through_the_kernels_answers_as_transformers(tmp_path, builtin_path, monkeypatch):
    """Qwen3.5's tiny model with every prefill step of its linear layers through the kernels (as on CUDA: the
    interpreter here), pieces of up to 64 tokens cut from prompts of 5 to 100: transformers' greedy tokens."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta
    from tests.engine.test_engine_vs_hf import QWEN3_5

    assert_prefills_through(tmp_path, builtin_path, monkeypatch, (gated_delta, triton_gated_delta.chunked_pieces,
                                                                  "chunked_pieces"), "qwen3_5", QWEN3_5)


@pytest.mark.slow   # as the test above
@pytest.mark.usefixtures("one_thread")
def test_kimi_linear_prefilling_through_the_kernels_answers_as_transformers(tmp_path, builtin_path, monkeypatch):
    """Kimi Linear's tiny model with every prefill step of its KDA layers through the kernels' decay a key channel:
    transformers' greedy tokens."""
    pytest.importorskip("triton")
    from kernels import triton_gated_delta
    from tests.engine.test_engine_vs_hf import TINY_MODELS

    shape = next(overrides for arch, overrides in TINY_MODELS if arch == "kimi_linear")
    assert_prefills_through(tmp_path, builtin_path, monkeypatch, (gated_delta, triton_gated_delta.chunked_pieces,
                                                                  "chunked_pieces"), "kimi_linear", shape)


def assert_prefills_through(tmp_path, builtin_path, monkeypatch, kernel: tuple, arch: str, shape: dict) -> None:
    """The tiny `arch` model of `shape` with its state layers' prefill function (kernel: (the module whose `chunked`
    the layers call, the Triton function put in its place[, the name called where not `chunked`]); or any function a
    model module calls with its step's tokens first) through the Triton
    form: prompts of 5, 40 and 100 tokens, pieces of up to 64, answer with transformers' greedy tokens, a call past
    one chunk of 32 among them."""
    import transformers

    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import _hf_greedy

    module, function, *name = kernel
    calls = []
    monkeypatch.setattr(module, name[0] if name else "chunked",
                        lambda *args, **kwargs: calls.append(len(args[0])) or function(*args, **kwargs))
    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **shape)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64,
                                 max_num_batched_tokens=64, progress=False)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 100)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8, eos_ids=None) for p in prompts]
    assert max(calls) > 32


def test_the_launcher_refuses_shapes_that_do_not_agree():
    pytest.importorskip("triton")
    from kernels import triton_gated_delta

    q, k, v, g, beta, ssm = _inputs(20, 2, 4, 16, 16)
    for args, kwargs in (((q, k, v, g[:, :3], beta, ssm), {}), ((q, k[:, :1], v, g, beta, ssm), {}),
                         ((q, k, v, g, beta, ssm[:, :8]), {}), ((q, k, v, g, beta, ssm), {"chunk": 24}),
                         ((q, k, v, _per_channel(g, 8, seed=1), beta, ssm), {})):   # a channel too few
        with pytest.raises(ValueError, match="^gated delta kernels:"):
            triton_gated_delta.chunked(*args, **kwargs)
