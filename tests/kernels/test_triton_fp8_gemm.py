"""The FP8-weight linear layer: the Triton GEMM (`kernels.triton_fp8_gemm`, through Triton's interpreter on the
CPU) against the reference (`kernels.fp8_gemm`), which dequantizes the weight and calls F.linear; and the
reference's quantizing and dequantizing themselves.

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels.fp8_gemm import (WHOLE, block_scales, dequantize_blocks, fp8_linear,  # noqa: E402
                                quantize_blocks, quantize_rows)
from kernels.triton_fp8_gemm import fp8_linear as triton_fp8_gemm  # noqa: E402
from kernels.triton_fp8_gemm import fp8_linear_tiles  # noqa: E402
from tests.kernels.test_reference import _make_seed  # noqa: E402

# (N, K, scale block, rows): DeepSeek's 128 x 128 blocks with partial edges, blocks narrower than a K tile (their
# scales gathered per element), one scale a row, one for the tensor, and decode's and prefill's row counts
CASES = [(96, 80, (16, 32), 3), (200, 130, (128, 128), 40), (50, 70, (1, WHOLE), 1), (64, 64, (WHOLE, WHOLE), 17),
         (72, 100, (16, 24), 5), (40, 256, (8, 128), 70)]


def assert_the_product(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    """A GEMM's output against the float32 product: in `dtype` and want's shape; float32 to the sums' rounding,
    bfloat16 to one rounding of each sum (the interpreter truncates it: up to one unit of the last place)."""
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    else:
        assert ((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all(), f"seed {seed}"


def _operands(n: int, k: int, block: tuple[int, int], rows: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-n // min(block[0], n)), -(-k // min(block[1], k)))
    scale = torch.rand(grid, generator=gen) * 0.02 + 0.001
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, weight, scale, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,block,rows", CASES)
def test_the_triton_fp8_gemm_computes_what_the_dequantized_weight_computes(n, k, block, rows, dtype):
    """Each output is x times the weight dequantized as loading would dequantize it (float32 values times their
    block's scale, rounded once to x's dtype, to nearest even), summed in float32: float32 to the sums' rounding,
    bfloat16 to one rounding of each result; with and without a bias. F.linear over the dequantized weight (the
    reference, a CPU's path) agrees to its own bfloat16 sums."""
    seed = _make_seed()
    x, weight, scale, bias = _operands(n, k, block, rows, dtype, seed)
    dequantized = dequantize_blocks(weight, scale, block).to(dtype)
    for b in (bias, None):
        want = x.float() @ dequantized.float().T + (b.float() if b is not None else 0.0)
        got = triton_fp8_gemm(x, weight, scale, block, b)
        assert_the_product(got, want, dtype, seed)
        reference = fp8_linear(x, weight, scale, block, b).float()   # F.linear's own sums, in x's dtype
        assert (reference - want).abs().max() <= want.abs().max() * (2 ** -5 if dtype == torch.bfloat16 else 1e-6), \
            f"seed {seed}: the reference"


def test_leading_dimensions_an_empty_batch_and_the_tiles():
    """x of any leading shape comes back in it; no rows launch nothing; decode takes 16-row tiles, prefill wider."""
    seed = _make_seed()
    x, weight, scale, _ = _operands(48, 64, (16, 32), 6, torch.float32, seed)
    got = triton_fp8_gemm(x.view(2, 3, 64), weight, scale, (16, 32))
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got.view(6, 48), triton_fp8_gemm(x, weight, scale, (16, 32)))
    assert triton_fp8_gemm(x[:0], weight, scale, (16, 32)).shape == (0, 48)
    assert fp8_linear_tiles(1, 4096, 4096)[0] == 16 and fp8_linear_tiles(2048, 4096, 4096)[0] == 64


def test_rows_quantize_to_their_largest_magnitude_and_dequantize_back():
    """quantize_rows: each row over its largest magnitude / 448 (that value lands on 448 exactly), a zero row's scale
    1; dequantizing gives the row back within e4m3's half-step (2^-4 relative); non-finite weights refused;
    quantize_blocks: each block (partial ones too) over its own largest magnitude."""
    gen = torch.Generator().manual_seed(_make_seed())
    w = torch.randn(6, 50, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e4, 0.0])[:, None]
    values, scale = quantize_rows(w)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert scale[5, 0] == 1.0 and torch.equal(values[5].float(), torch.zeros(50))
    assert torch.equal(values[:5].float().abs().amax(dim=1), torch.full((5,), 448.0))
    back = dequantize_blocks(values, scale, (1, WHOLE))
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-30).all()
    assert torch.equal(block_scales(scale, (1, WHOLE), (6, 50)), scale.expand(6, 50))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))
    blocks, block_scale = quantize_blocks(w[:5], (2, 16))   # blocks of 2 x 16, the last ones partial
    want = torch.tensor([[w[r:r + 2, c:c + 16].abs().max() / 448 for c in range(0, 50, 16)] for r in range(0, 5, 2)])
    assert block_scale.shape == (3, 4) and torch.equal(block_scale, want)
    assert ((dequantize_blocks(blocks, block_scale, (2, 16)) - w[:5]).abs()
            <= block_scales(block_scale, (2, 16), (5, 50)) * 448 * 2 ** -4).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_on_cuda_the_fp8_gemm_at_llama_8b_shapes_equals_the_dequantized_product(rows):
    """Compiled on a GPU (TRITON_INTERPRET=0, `bench/gpu_session.sh`'s tests step): Llama 3 8B's gate_up and down
    projections in 128 x 128 blocks, bfloat16 activations, against the float32 product of the dequantized weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(rows)
    for n, k in ((2 * 14336, 4096), (4096, 14336)):
        weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-3 + 1e-4
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = x.float() @ dequantize_blocks(weight, scale, (128, 128)).to(torch.bfloat16).float().T
        got = triton_fp8_gemm(x.cuda(), weight.cuda(), scale.cuda(), (128, 128)).float().cpu()
        assert ((got - want).abs() <= want.abs() * 2 ** -7 + want.abs().max() * 1e-5).all(), (n, k, rows)


@pytest.mark.gpu
def test_on_cuda_an_fp8_checkpoint_decodes_in_graphs_as_eager_and_as_dequantized(tmp_path, builtin_path):
    """An FP8 checkpoint held in FP8 on a GPU (`quantization: auto` keeps it there): the decode steps captured in
    CUDA graphs give the eager tokens, and those are the dequantized model's (`quantization: none`)."""
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.layers.fp8_linear import Fp8Linear
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import _fp8_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder = make_tiny_model(tmp_path / "fp8", "qwen3", builtin_path, head_dim=16, intermediate_size=128)
    _fp8_checkpoint(folder, (16, 32))
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    results = {}
    for quantization, eager in (("auto", True), ("auto", False), ("none", True)):
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", enforce_eager=eager,
                                        quantization=quantization, cache=CacheConfig(block_size=16), pools=(
                                            PoolConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)),)),
                           progress=False)
        held = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
        assert bool(held) == (quantization == "auto") and all(m.triton for m in held)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        results[quantization, eager] = [o.outputs[0].token_ids for o in outs]
    assert results["auto", True] == results["auto", False] == results["none", True]
