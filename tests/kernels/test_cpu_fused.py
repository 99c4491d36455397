"""Our C versions of the layer's small ops (`kernels.cpu_fused`) against the torch ones (`kernels.fused`),
on fresh random inputs (the seed is in every message; `CLIFFGUARD_TEST_SEED=<seed>` reruns one), strided
the way the model hands them over, with NaN-poisoned outputs; the K/V store against the reference's."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernels import AttentionMetadata, cpu_attention, cpu_fused, fused, reference

pytestmark = pytest.mark.skipif(cpu_fused.load_library() is None, reason="no C compiler on this machine")

# (atol, rtol): float32 differs from torch by summation order (the norm's mean) or an ulp of expf;
# bfloat16 rounds where torch rounds, so any difference is one bfloat16 ulp of a value near a rounding tie.
TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 8e-3)}
DTYPES = (torch.float32, torch.bfloat16)


def _seed() -> int:
    forced = os.environ.get("CLIFFGUARD_TEST_SEED")
    return int(forced) if forced else random.SystemRandom().randrange(2**31)


def _randn(*shape, gen, dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 2).to(dtype)


def _assert_close(got, want, dtype, where):
    assert not got.isnan().any(), f"{where}: NaN in the output"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{where}\n{m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,size", [(1, 64), (7, 576), (33, 96), (5, 1000), (3, 37)])
def test_norms_match_torch(dtype, num_tokens, size):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    wide = _randn(num_tokens, size + 8, gen=gen, dtype=dtype)       # rows strided, as a slice hands them over
    x = wide[:, :size]
    residual = _randn(num_tokens, size, gen=gen, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(size, generator=gen)).to(dtype)
    where = f"seed={seed} {dtype} {num_tokens}x{size}"
    _assert_close(cpu_fused.rms_norm(x, weight, 1e-5), fused.rms_norm(x.clone(), weight, 1e-5), dtype, where)
    got_res, want_res = residual.clone(), residual.clone()
    got, got_res = cpu_fused.add_rms_norm(x.clone(), got_res, weight, 1e-6)
    want, want_res = fused.add_rms_norm(x.clone(), want_res, weight, 1e-6)
    assert torch.equal(got_res, want_res), f"{where}: the residual stream differs"
    _assert_close(got, want, dtype, where)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_in_place(dtype):
    """The C contract (what the launcher never asks for): out may be x."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = _randn(9, 200, gen=gen, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    want = cpu_fused.rms_norm(x, weight, 1e-5)
    norm = cpu_fused._function("rms_norm", dtype)
    norm(x.data_ptr(), None, weight.data_ptr(), x.data_ptr(), 9, 200, 200, 0, 200, 1e-5)
    assert torch.equal(x, want), f"seed={seed} {dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 2, 16), (9, 3, 64), (2, 1, 128), (3, 1, 32), (2, 2, 48), (3, 1, 20)])
def test_rotary_matches_torch(dtype, num_heads, num_kv_heads, head_dim):
    """q and k rotated in place inside a fused qkv row (v and everything else left alone)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    num_tokens, max_positions = 11, 64
    qkv = _randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, gen=gen, dtype=dtype)
    freqs = torch.rand(max_positions, head_dim // 2, generator=gen) * 6
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    got, want = qkv.clone(), qkv.clone()
    heads = num_heads + num_kv_heads
    cpu_fused.rotary(got[:, :heads], cpu_fused.rotary_rows(cache, positions))
    fused.rotary(want[:, :heads], fused.rotary_rows(cache, positions))
    where = f"seed={seed} {dtype} heads={num_heads}/{num_kv_heads} d={head_dim}"
    assert torch.equal(got[:, heads:], qkv[:, heads:]), f"{where}: v was touched"
    _assert_close(got, want, dtype, where)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,size,scale", [(13, 160, 2), (1, 1536, 2), (64, 1000, 2), (5, 1531, 40)])
def test_silu_and_mul_matches_torch(dtype, num_tokens, size, scale):
    """Rows strided (a slice of a wider tensor); sizes not a multiple of the vector width; scale 40 reaches
    exp's overflow and underflow on both sides."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(num_tokens, 2 * size + 24, generator=gen) * scale).to(dtype)
    x = wide[:, :2 * size]
    where = f"seed={seed} {dtype} {num_tokens}x{size} scale={scale}"
    _assert_close(cpu_fused.silu_and_mul(x), fused.silu_and_mul(x), dtype, where)


SILU_EXTREMES = [-100.0, -89.0, -88.7, -88.0, -87.5, -86.0, -20.0, -1.0, -0.0, 0.0, 1.0, 20.0, 86.0, 88.0, 88.7,
                 100.0, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 1e-38, 1e-40, -1e-40,
                 1e-45, -1e-45]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_extremes(dtype):
    """Overflow and underflow of exp, infinities, NaN, signed zeros and subnormals, as torch gives them
    (NaN where torch's is NaN: silu(-inf) is -inf / inf), each gate with several ups."""
    gate = torch.tensor(SILU_EXTREMES).to(dtype)
    ups = torch.tensor([1.0, -2.0, 0.5, 3.0]).to(dtype)
    gates, up = gate.repeat(len(ups)), ups.repeat_interleave(len(gate))
    moved = torch.arange(len(up)).roll(5)   # the second row: each pair in another vector lane
    x = torch.stack((torch.cat((gates, up)), torch.cat((gates[moved], up[moved]))))
    got, want = cpu_fused.silu_and_mul(x), fused.silu_and_mul(x)
    # relative only: silu(-88) is 5e-37, and a result flushed to zero is wrong
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=TOLERANCES[dtype][1], equal_nan=True)
    zeros = want == 0
    assert torch.equal(got[zeros].signbit(), want[zeros].signbit()), "the sign of a zero differs"
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_the_reference(dtype):
    """Strided K/V (slices of a fused projection) into NaN-poisoned caches, a skipped slot (-1) included;
    only the written slots change."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    tables = [[3, 0], [5], [1, 2, 4]]
    meta = AttentionMetadata.build(tables, [10, 3, 40], [20, 3, 40], 16)
    meta.slot_mapping[4] = -1
    meta.has_invalid_slots = True
    qkv = _randn(meta.num_tokens, 8, 32, gen=gen, dtype=dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    got = torch.full((2, 6, 16, 2, 32), float("nan"), dtype=dtype)
    want = got.clone()
    cpu_attention.store_kv(key, value, got[0], got[1], meta)
    reference.store_kv(key, value, want[0], want[1], meta)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), f"seed={seed}"


def test_store_kv_refuses_a_slot_past_the_cache():
    cache = torch.zeros(2, 4, 2, 1, 8)
    meta = AttentionMetadata.build([[1]], [2], [2], 2)
    meta.slot_mapping[1] = 99
    with pytest.raises(IndexError, match="past the cache"):
        cpu_attention.store_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), cache[0], cache[1], meta)
    assert not cache.any()   # nothing written


def test_the_c_store_takes_only_tensors_whose_sizes_agree():
    """Fewer slots than tokens, or a V cache of another shape than K's, is not the C copy's to do (it would
    read past the slots or write past the V cache): the call declines, and the reference names the fault."""
    cache = torch.zeros(2, 4, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    assert not cpu_fused.store_kv_rows(key, key, cache[0], cache[1], torch.arange(2))
    assert not cpu_fused.store_kv_rows(key, key, cache[0], torch.zeros(2, 4, 1, 8), torch.arange(3))
    assert not cache.any()
    assert cpu_fused.store_kv_rows(key, key, cache[0], cache[1], torch.arange(3)) and cache[:, 0, :3].eq(1).all()


def test_the_cpu_gets_these_ops_for_the_dtypes_they_run(monkeypatch):
    monkeypatch.delenv("CLIFFGUARD_ATTENTION_BACKEND", raising=False)
    assert fused.get_fused_ops("cpu", torch.float32) is cpu_fused
    assert fused.get_fused_ops("cpu", torch.bfloat16) is cpu_fused
    assert fused.get_fused_ops("cpu", torch.float16) is fused
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "torch")
    assert fused.get_fused_ops("cpu", torch.float32) is fused
