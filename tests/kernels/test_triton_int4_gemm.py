"""The INT4- and INT8-weight linear layer (W4A16, W8A16): the Triton GEMM (`kernels.triton_int4_gemm`, through
Triton's interpreter on the CPU) against F.linear over the weight `engine.int4_weights.dequantize_int4` gives, and a
dense pack-quantized model held as stored decoding alike on the Triton GEMM and on the CPU's dequantizing layer.

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.int4_weights import dequantize_int4  # noqa: E402
from kernels.triton_int4_gemm import int4_linear  # noqa: E402
from tests.kernels.test_reference import _make_seed  # noqa: E402
from tests.kernels.test_triton_fp8_gemm import assert_the_product  # noqa: E402

# (N, K, group, rows): groups of 32 narrower than a K tile (each element's scale gathered), groups of 128 a tile spans
# (a scale a row), a group the whole row, odd N, and decode's and prefill's row counts
CASES = [(96, 64, 32, 3), (200, 256, 128, 40), (50, 96, 96, 1), (72, 160, 32, 17), (40, 128, 64, 70)]


def _operands(n: int, k: int, group: int, rows: int, dtype: torch.dtype, seed: int, bits: int = 4):
    """Every code drawn (0 .. 15, two a byte; or 0 .. 255), signed scales of about 0.01 in x's dtype (a
    checkpoint's: the model's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k * bits // 8), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(n, k // group, generator=gen) - 0.3) * 0.02).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, blocks, scales, bias


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group,rows", CASES)
def test_the_triton_int4_gemm_computes_what_the_dequantized_weight_computes(n, k, group, rows, dtype, bits):
    """Each output is x times the weight dequantized as loading would dequantize it ((code - 8) x scale in float32,
    or (code - 128) x scale for 8-bit codes, rounded once to x's dtype), summed in float32: float32 to the sums'
    rounding, bfloat16 to one rounding of each result; with and without a bias. The layer's CPU path (F.linear over
    the dequantized weight) agrees to its own bfloat16 sums."""
    seed = _make_seed()
    x, blocks, scales, bias = _operands(n, k, group, rows, dtype, seed, bits)
    dequantized = dequantize_int4(blocks, scales, dtype, bits=bits)
    for b in (bias, None):
        want = x.float() @ dequantized.float().T + (b.float() if b is not None else 0.0)
        assert_the_product(int4_linear(x, blocks, scales, b, bits=bits), want, dtype, seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group,rows", [CASES[0], CASES[1], CASES[3]])
def test_zero_points_are_subtracted_as_the_dequantized_weight_subtracts_them(n, k, group, rows, bits):
    """AWQ's kind (`Int4Linear.zeros`, a zero point a group beside its scale, one byte each: 0 .. 15, or 0 .. 255 for
    8-bit codes): each output is x times (code - zero) x scale rounded to bfloat16, summed in float32, with groups
    narrower than a K tile (each element's zero gathered) and as wide (one a row)."""
    seed = _make_seed()
    x, blocks, scales, bias = _operands(n, k, group, rows, torch.bfloat16, seed, bits)
    zeros = torch.randint(0, 1 << bits, scales.shape, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.uint8)
    dequantized = dequantize_int4(blocks, scales, torch.bfloat16, zeros, bits=bits)
    assert not torch.equal(dequantized, dequantize_int4(blocks, scales, torch.bfloat16, bits=bits)), f"seed {seed}"
    want = x.float() @ dequantized.float().T + bias.float()
    assert_the_product(int4_linear(x, blocks, scales, bias, zeros, bits), want, torch.bfloat16, seed)


def test_leading_dimensions_an_empty_batch_and_a_strided_input():
    """x of any leading shape comes back in it; no rows launch nothing; rows of a wider tensor (a stride past K)
    are read in place."""
    seed = _make_seed()
    x, blocks, scales, _ = _operands(48, 64, 32, 6, torch.float32, seed)
    got = int4_linear(x.view(2, 3, 64), blocks, scales)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got.view(6, 48), int4_linear(x, blocks, scales))
    assert int4_linear(x[:0], blocks, scales).shape == (0, 48)
    wide = torch.cat([x, x], dim=1)[:, :64]
    torch.testing.assert_close(int4_linear(wide, blocks, scales), int4_linear(x, blocks, scales))


@pytest.mark.parametrize("kind", ["pack-quantized", "awq", "gptq-act-order", "gptq-int8"])
def test_a_dense_int4_model_decodes_alike_on_the_triton_gemm_and_on_the_cpu_layer(tmp_path, builtin_path,
                                                                                  monkeypatch, kind):
    """A dense W4A16 checkpoint held as stored (`quantization: int4`, every decoder projection an `Int4Linear`;
    pack-quantized, AWQ's with a zero point a group, or GPTQ's in activation order, its input gathered in its
    order; and GPTQ's INT8, `quantization: int8`, a code a byte): the Triton GEMM decoding each tile as loaded
    gives the greedy tokens the CPU's layer (the weight dequantized on each call) gives."""
    pytest.importorskip("compressed_tensors")
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.layers.int4_linear import Int4Linear
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.conftest import make_tiny_model
    from tests.engine.test_awq_gptq_weights import act_order_checkpoint, awq_checkpoint, awq_packing
    from tests.engine.test_int4_weights import int4_checkpoint
    from tests.engine.test_int8_weights import gptq_int8_checkpoint

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 21)]
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3", builtin_path, head_dim=16, intermediate_size=128)
    if kind == "awq":
        awq_checkpoint(folder, awq_packing())
    elif kind == "gptq-act-order":
        act_order_checkpoint(folder, awq_packing())
    elif kind == "gptq-int8":
        gptq_int8_checkpoint(folder, awq_packing())
    else:
        int4_checkpoint(folder, experts_only=False)
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
        engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32",
                                        quantization="int8" if kind == "gptq-int8" else "int4",
                                        cache=CacheConfig(block_size=8),
                                        pools=(PoolConfig(num_blocks=16, scheduler=SchedulerConfig(
                                            max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)),)),
                           progress=False)
        held = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
        assert len(held) == 4 * len(engine.model.layers) and all(m.triton == (backend == "triton") for m in held)
        assert all((m.zeros is not None) == (kind not in ("pack-quantized", "gptq-int8")) for m in held)
        assert all(m.bits == (8 if kind == "gptq-int8" else 4) for m in held)
        assert all(m.act_order == (kind == "gptq-act-order") for m in held)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["triton"] == results["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_on_cuda_the_int4_gemm_at_qwen3_32b_shapes_equals_the_dequantized_product(rows, zero_points, bits):
    """Compiled on a GPU (TRITON_INTERPRET=0, `bench/gpu_session.sh`'s tests step): Qwen3-32B's gate_up and down
    projections in groups of 128, bfloat16 activations and scales (and AWQ's zero points), 4- and 8-bit codes,
    against the float32 product of the dequantized weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for n, k in ((2 * 25600, 5120), (5120, 25600)):
        x, blocks, scales, _ = _operands(n, k, 128, rows, torch.bfloat16, rows, bits)
        zeros = torch.randint(0, 1 << bits, scales.shape, dtype=torch.uint8) if zero_points else None
        want = x.float() @ dequantize_int4(blocks, scales, torch.bfloat16, zeros, bits=bits).float().T
        got = int4_linear(x.cuda(), blocks.cuda(), scales.cuda(), None,
                          zeros.cuda() if zeros is not None else None, bits).float().cpu()
        assert ((got - want).abs() <= want.abs() * 2 ** -7 + want.abs().max() * 1e-5).all(), (n, k, rows)
