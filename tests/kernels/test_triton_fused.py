"""The fused small-op kernels (`kernels.triton_fused`) against their torch versions (`kernels.fused`),
through Triton's interpreter on the CPU: add + RMSNorm, rotary of q and k in place, SiLU x mul.

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`). What a kernel allocates comes out of `torch.empty` filled with NaN, and
the qkv rows' v heads are NaN, so an output element left unwritten, or a rotary that strays into v, fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import fused, triton_fused  # noqa: E402
from tests.kernels.test_reference import _make_seed  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (atol, rtol) per dtype, Triton against torch in the same dtype: both round to the dtype, in places a
# step apart (the Triton kernels compute in float32 throughout), so up to two ulps of the dtype apart.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """torch.empty / torch.empty_like hand out NaN-filled floating tensors while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def _make_rows(num_tokens: int, width: int, dtype: torch.dtype, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """[num_tokens, width] random rows; with `pad`, a view into wider rows (row stride width + pad)."""
    data = torch.randn(num_tokens, width + pad, generator=gen) * 2
    return data.to(dtype)[:, :width]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, seed: int, what: str) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert not actual.isnan().any(), f"{what}: NaN in the output (seed {seed})"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what} (seed {seed}): {m}")


# hidden sizes 96 and 80 (a head_dim, as in a per-head q/k norm): not powers of two, padded in the kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden_size, pad", [(1, 64, 0), (5, 96, 32), (17, 256, 0), (6, 80, 8)])
def test_rms_norm_and_add_rms_norm_match_the_reference(dtype, num_tokens, hidden_size, pad, poisoned_allocations):
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _make_rows(num_tokens, hidden_size, dtype, gen, pad)
    residual = _make_rows(num_tokens, hidden_size, dtype, gen)
    weight = (1 + 0.3 * torch.randn(hidden_size, generator=gen)).to(dtype)
    eps = 1e-5

    _assert_close(triton_fused.rms_norm(x, weight, eps), fused.rms_norm(x, weight, eps), seed, "rms_norm")

    want_normed, want_residual = fused.add_rms_norm(x.clone(), residual.clone(), weight, eps)
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = triton_fused.add_rms_norm(x_in, residual_in, weight, eps)
    assert new_residual is residual_in and normed is x_in    # both in place
    _assert_close(new_residual, want_residual, seed, "add_rms_norm residual")
    _assert_close(normed, want_normed, seed, "add_rms_norm output")


# head_dim 24, 80, 40: half of it (12, 40, 20) is not a power of two, padded in the kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim",
                         [(1, 4, 2, 16), (6, 8, 1, 64), (11, 3, 3, 24), (5, 4, 2, 80), (3, 2, 1, 40)])
def test_rotary_matches_the_reference_in_place_on_q_and_k(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    max_positions = 64
    angles = torch.rand(max_positions, head_dim // 2, generator=gen) * 100
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)   # [max_positions, head_dim]
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    heads = num_heads + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    qkv[:, num_heads + num_kv_heads:] = float("nan")    # v: never touched
    want = qkv.clone()
    fused.rotary(want[:, :num_heads + num_kv_heads], fused.rotary_rows(cache, positions))
    got = qkv.clone()
    triton_fused.rotary(got[:, :num_heads + num_kv_heads], triton_fused.rotary_rows(cache, positions))
    _assert_close(got[:, :num_heads + num_kv_heads], want[:, :num_heads + num_kv_heads], seed, "rotary q/k")
    assert got[:, num_heads + num_kv_heads:].isnan().all(), f"rotary wrote into v (seed {seed})"
    if dtype != torch.bfloat16:   # the interpreter rounds float16 as a GPU does (bfloat16 it truncates)
        assert torch.equal(got[:, :num_heads + num_kv_heads], want[:, :num_heads + num_kv_heads]), \
            f"rotary q/k rounds otherwise than transformers (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, size", [(1, 40), (9, 160), (3, 1500)])
def test_silu_and_mul_matches_the_reference(dtype, num_tokens, size, poisoned_allocations):
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    gate_up = _make_rows(num_tokens, 2 * size, dtype, gen, pad=8)
    _assert_close(triton_fused.silu_and_mul(gate_up), fused.silu_and_mul(gate_up), seed, "silu_and_mul")


def test_launchers_refuse_what_the_kernels_cannot_read():
    x = torch.randn(4, 64)
    with pytest.raises(AssertionError, match="weight"):
        triton_fused.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(AssertionError, match="contiguous"):
        triton_fused.rms_norm(x.t().contiguous().t(), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="residual must be its own"):
        triton_fused.add_rms_norm(x, x, torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="rows"):
        triton_fused.rotary(torch.randn(4, 2, 16), torch.randn(4, 8))
    with pytest.raises(AssertionError, match="dtypes"):
        triton_fused.rotary(torch.randn(4, 2, 16), torch.randn(4, 16, dtype=torch.float16))
    with pytest.raises(AssertionError, match="2 \\* size"):
        triton_fused.silu_and_mul(torch.randn(4, 7))
