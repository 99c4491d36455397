"""The Triton kernels against the torch reference: on the CPU through Triton's interpreter, on CUDA
at realistic sizes (`gpu` mark).

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`). Caches are poisoned with NaN outside the written slots and outputs
with NaN before the call, so a kernel that reads a slot it should not, or leaves a row unwritten, fails.
Where head_dim is not a power of two, the cases that name a `head_pad` lay query, caches and output out
as views into rows padded with NaN up to the power of two the kernels pad to: a kernel that reads a
padded lane unmasked gets NaN, one that writes one spoils the padding.

FP8 caches (float8_e4m3fn, with k_scale / v_scale): the store is byte-identical to `reference.store_kv`
(saturation, ties, subnormals, -0 included), and the attention is held to the same tolerances as a cache in
the query's dtype, against the reference in float32 over the values `reference.dequantize_kv` reads. With
bf16 queries the interpreter's cases take scales that are powers of two, whose dequantized values bf16
holds exactly: the interpreter truncates float32 -> bf16 where the GPU and torch round to nearest even,
which over a whole K/V tile biases the output (up to 1.1x the bf16 tolerance with scales 0.05 / 0.02); the
gpu cases and the fp16 ones (the interpreter rounds float32 -> fp16 as torch does) take any scales.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (the gpu test's
# child process sets it to 0)

import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import kernels  # noqa: E402
import triton  # noqa: E402
from kernels import AttentionMetadata, reference  # noqa: E402
from kernels.alibi import alibi_attention  # noqa: E402
from kernels import cpu_attention, triton_attention, triton_kv_store, triton_prefill  # noqa: E402

# Explicit tolerances per dtype (atol, rtol), against the reference computed in float32. fp16/bf16
# round P to the input dtype before the PV product, and the output once more.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1.5e-3, 1.5e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
}
FP8 = reference.FP8_KV_DTYPE


def _make_seed() -> int:
    forced = os.environ.get("CLIFFGUARD_TEST_SEED")
    return int(forced) if forced else random.SystemRandom().randrange(2**31)


def _make_tables(seq_lens, block_size, rng, spare=3):
    """Block tables over shuffled block ids, with `spare` blocks no sequence owns."""
    counts = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(counts) + spare))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in counts:
        tables.append(ids[pos:pos + n])
        pos += n
    return tables, len(ids)


def _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, num_layers=2, head_pad=0):
    """NaN-poisoned [L, 2, blocks, block_size, kv_heads, head_dim + head_pad] and the strided views of its
    last layer, [blocks, block_size, kv_heads, head_dim] each."""
    data = torch.full((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim + head_pad), float("nan"),
                      dtype=dtype, device=device)
    return data, data[-1, 0, ..., :head_dim], data[-1, 1, ..., :head_dim]


def _head_pad(head_dim: int) -> int:
    """How far the kernels pad head_dim (0 for a power of two >= 16): the NaN lanes a case lays beside each
    head to catch a padded lane read or written unmasked."""
    return triton_prefill.padded_head_dim(head_dim) - head_dim


def _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                         seed, device="cpu", head_pad=0, kv_dtype=None, k_scale=1.0, v_scale=1.0):
    """A step: every sequence's K/V stored (prefix and new tokens), queries for the new tokens. With
    `head_pad`, query and caches are views into rows of head_dim + head_pad, the rest NaN. The caches are
    `kv_dtype` (default dtype); an FP8 one holds K / k_scale and V / v_scale (`reference.store_kv`)."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tables, num_blocks = _make_tables(seq_lens, block_size, rng)
    data, k_cache, v_cache = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype or dtype, device,
                                         head_pad=head_pad)
    total = sum(seq_lens)
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    everything = AttentionMetadata.build(tables, seq_lens, seq_lens, block_size, device)
    reference.store_kv(keys, values, k_cache, v_cache, everything, k_scale=k_scale, v_scale=v_scale)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size, device)
    query = torch.full((sum(query_lens), num_heads, head_dim + head_pad), float("nan"), dtype=dtype,
                       device=device)[..., :head_dim]
    query.copy_(torch.randn(sum(query_lens), num_heads, head_dim, generator=gen))
    return query, k_cache, v_cache, meta


def _reference_attention(query, k_cache, v_cache, meta, scale, sliding_window, k_scale=1.0, v_scale=1.0, softcap=0.0,
                         sinks=None, chunk=None, alibi=None):
    """The torch reference in float32, on a fresh copy of the metadata (its plan cache is its own), over
    the cached values as the reference's attention reads them for this query (`reference.dequantize_kv`:
    an FP8 cache's times its scale, rounded to the query's dtype; any other cache's as they are). ALiBi's
    (`alibi`, slopes) is `kernels.alibi`'s, the torch attention BLOOM and MPT serve with off the Triton backend."""
    fresh = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                              meta.block_size, meta.query_lens_list, meta.seq_lens_list)
    k = reference.dequantize_kv(k_cache, query.dtype, k_scale).float().contiguous()
    v = reference.dequantize_kv(v_cache, query.dtype, v_scale).float().contiguous()
    if alibi is not None:
        assert sliding_window is None and softcap == 0.0 and sinks is None and chunk is None
        return alibi_attention(query.float(), k, v, fresh, scale, alibi)
    return reference.paged_attention(query.float(), k, v, fresh, scale, sliding_window, softcap=softcap,
                                     sinks=None if sinks is None else sinks.float(), chunk=chunk)


def _assert_attention_matches(backend, case, seed, sliding_window=None, num_splits=None, label="",
                              k_scale=1.0, v_scale=1.0, softcap=0.0, sinks=None, chunk=None, alibi=None):
    query, k_cache, v_cache, meta = case
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5
    # out: laid out as query is, in rows of query.stride(1) >= head_dim (the rest NaN, and left so)
    out_rows = torch.full((*query.shape[:2], query.stride(1)), float("nan"), dtype=query.dtype, device=query.device)
    out = out_rows[..., :head_dim]
    got = backend.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, k_scale=k_scale,
                                  v_scale=v_scale, num_splits=num_splits, out=out, softcap=softcap, sinks=sinks,
                                  chunk=chunk, **({} if alibi is None else {"alibi": alibi}))
    assert got is out
    want = _reference_attention(query, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap,
                                sinks, chunk, alibi)
    where = f"seed={seed} {label} window={sliding_window} splits={num_splits} softcap={softcap} " \
            f"sinks={sinks is not None} chunk={chunk} alibi={alibi is not None}"
    if k_cache.dtype == FP8:
        where += f" fp8 cache k_scale={k_scale} v_scale={v_scale}"
    assert not out.isnan().any(), f"{where}: output rows left unwritten (NaN) at " \
                                  f"{out.isnan().nonzero()[:4].tolist()}"
    assert out_rows[..., head_dim:].isnan().all(), f"{where}: written past head_dim {head_dim}"
    atol, rtol = TOLERANCES[query.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol, msg=lambda m: f"{where}\n{m}")


def _mixed_batch(block_size):
    """(seq_lens, query_lens) mixing decode rows (short and long contexts), a prefill chunk that starts
    mid-block over a cached prefix, a whole prompt, a length-1 prompt, a sequence with no new token,
    and partial last blocks."""
    b = block_size
    seq_lens = [3 * b + 5, 1, 2 * b + 9, 5, 2 * b, 7 * b + 3, 1, 9]
    query_lens = [1, 1, b + 2, 5, 3, 1, 1, 0]
    return seq_lens, query_lens


# --- store_kv ---------------------------------------------------------------------------------

def _make_fp8_range_values(n, gen, scale):
    """[n] float32 values over an FP8 cache's whole range once divided by `scale`: magnitudes from e4m3's
    subnormals (below 2^-6) to past its saturation (448), either sign, a third of them ties between neighbouring
    e4m3 values (exact ties where the scale is a power of two) and zeros of either sign among them."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    e4m3 = e4m3[e4m3.isfinite()].unique()                               # sorted, -448 .. 448
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    spread = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())
    pick = torch.randint(0, 3, (n,), generator=gen)
    tie = ties[torch.randint(0, ties.numel(), (n,), generator=gen)]
    values = torch.where(pick == 0, tie, spread) * scale
    values[torch.randint(0, n, (max(1, n // 64),), generator=gen)] = 0.0
    values[torch.randint(0, n, (max(1, n // 64),), generator=gen)] = -0.0
    return values


def _assert_store_kv_matches(store_kv, seq_lens, query_lens, dtype, src_dtype, block_size, num_kv_heads, head_dim,
                             num_skipped, seed, device="cpu", k_scale=1.0, v_scale=1.0):
    """`store_kv` against the reference: strided key/value (a fused projection's slices) into strided,
    NaN-poisoned caches, `num_skipped` random tokens (the first among them) with slot -1. An FP8 cache
    (`dtype` FP8) gets values over its whole range (`_make_fp8_range_values`) and must hold the reference's
    bytes exactly; the reference then runs on the CPU, whatever the device (on CUDA torch divides by a
    Python scalar as a multiplication by its reciprocal, which is not x / scale)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _make_tables(seq_lens, block_size, rng)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size, device)
    num_tokens = meta.num_tokens
    skip = [0] + rng.sample(range(1, num_tokens), num_skipped - 1)
    meta.slot_mapping[skip] = -1
    meta.has_invalid_slots = True
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)
    if dtype == FP8:
        fused[:, 1] = _make_fp8_range_values(fused[:, 1].numel(), gen, k_scale).view(fused[:, 1].shape)
        fused[:, 2] = _make_fp8_range_values(fused[:, 2].numel(), gen, v_scale).view(fused[:, 2].shape)
    fused = fused.to(device, src_dtype)
    key, value = fused[:, 1], fused[:, 2]
    got_data, got_k, got_v = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    store_kv(key, value, got_k, got_v, meta, k_scale=k_scale, v_scale=v_scale)
    ref_device = "cpu" if dtype == FP8 else device
    ref_meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size, ref_device)
    ref_meta.slot_mapping[skip] = -1
    ref_meta.has_invalid_slots = True
    want_data, want_k, want_v = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, ref_device)
    reference.store_kv(key.to(ref_device), value.to(ref_device), want_k, want_v, ref_meta, k_scale=k_scale,
                       v_scale=v_scale)
    got_data, where = got_data.cpu(), f"seed={seed} cache {dtype} k_scale={k_scale} v_scale={v_scale}"
    want_data = want_data.cpu()
    # every written slot matches, and nothing else in the tensor (other layer, skipped slots) changed
    assert torch.equal(got_data.isnan(), want_data.isnan()), f"{where}: wrong set of slots written"
    if dtype == FP8:
        got_bytes, want_bytes = got_data.view(torch.uint8), want_data.view(torch.uint8)
        differ = got_bytes != want_bytes
        assert not differ.any(), f"{where}: {int(differ.sum())} stored bytes differ, e.g. " + ", ".join(
            f"{g:#04x} not {w:#04x}" for g, w in zip(got_bytes[differ][:4].tolist(), want_bytes[differ][:4].tolist()))
    else:
        assert torch.equal(got_data.nan_to_num(), want_data.nan_to_num()), f"{where}: stored values differ"
    assert int((~got_data.isnan()).sum()) == 2 * (num_tokens - num_skipped) * num_kv_heads * head_dim, \
        f"{where}: wrong number of values written"


# fp32 -> fp16 is converted in the kernel; fp32 -> bf16 is not tested on the CPU: the interpreter
# truncates where the GPU (and torch) round to nearest even. head_dim 40 and 96: not powers of two,
# padded in the kernel (the lanes past head_dim must not be written: the next head's values are there).
@pytest.mark.parametrize("dtype,src_dtype,block_size,num_kv_heads,head_dim", [
    (torch.float32, torch.float32, 8, 1, 64),
    (torch.float16, torch.float32, 16, 3, 128),
    (torch.bfloat16, torch.bfloat16, 32, 2, 64),
    (torch.float16, torch.float32, 8, 3, 40),
    (torch.bfloat16, torch.bfloat16, 16, 2, 96),
])
def test_store_kv_matches_reference(dtype, src_dtype, block_size, num_kv_heads, head_dim):
    seed = _make_seed()
    _assert_store_kv_matches(triton_kv_store.store_kv, [block_size + 3, 2, 2 * block_size], [block_size + 3, 1, 5],
                             dtype, src_dtype, block_size, num_kv_heads, head_dim, 4, seed)


# FP8 caches: byte for byte the reference's, from every source dtype, at scales 1, powers of two (exact
# ties) and others, over e4m3's whole range (subnormals, saturation at 448 * scale, -0), head_dim 40 padded.
@pytest.mark.parametrize("src_dtype,block_size,num_kv_heads,head_dim,k_scale,v_scale", [
    (torch.float32, 8, 2, 64, 1.0, 1.0),
    (torch.bfloat16, 16, 3, 128, 0.37, 2.0),
    (torch.float16, 8, 3, 40, 0.0123, 0.5),
    (torch.float32, 32, 1, 16, 5.5, 0.037),
])
def test_store_kv_fp8_cache_holds_the_reference_bytes(src_dtype, block_size, num_kv_heads, head_dim, k_scale,
                                                      v_scale):
    seed = _make_seed()
    _assert_store_kv_matches(triton_kv_store.store_kv, [block_size + 3, 2, 2 * block_size], [block_size + 3, 1, 5],
                             FP8, src_dtype, block_size, num_kv_heads, head_dim, 4, seed, k_scale=k_scale,
                             v_scale=v_scale)


def test_store_kv_fp8_rounds_every_e4m3_boundary_as_torch_does():
    """Every e4m3 value, every tie between neighbours and the float32 values either side of each tie,
    values past saturation and ±0, at scale 1 and a scale that is not a power of two: the bytes
    `reference.quantize_kv` gives (Triton's interpreter alone rounds ties away from zero, and -124 to -64)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    e4m3 = e4m3[e4m3.isfinite()].unique()
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, -464.0, 480.0, 1e6, -1e30, 2.0**-10, -(2.0**-10),
                          2.0**-6 - 2.0**-11, 1e-40])
    values = torch.cat([e4m3, ties, ties.nextafter(torch.tensor(float("inf"))),
                        ties.nextafter(torch.tensor(float("-inf"))), edges])
    num_tokens = -(-values.numel() // 64)
    key = torch.zeros(num_tokens * 64)
    key[:values.numel()] = values
    key = key.view(num_tokens, 1, 64)
    meta = AttentionMetadata.build([list(range(-(-num_tokens // 16)))], [num_tokens], [num_tokens], 16)
    for scale in (1.0, 0.37):
        _, got_k, got_v = _make_cache(-(-num_tokens // 16), 16, 1, 64, FP8, "cpu")
        _, want_k, want_v = _make_cache(-(-num_tokens // 16), 16, 1, 64, FP8, "cpu")
        triton_kv_store.store_kv(key * scale, -key * scale, got_k, got_v, meta, k_scale=scale, v_scale=scale)
        reference.store_kv(key * scale, -key * scale, want_k, want_v, meta, k_scale=scale, v_scale=scale)
        for got, want in ((got_k, want_k), (got_v, want_v)):
            got, want = got.reshape(-1)[:values.numel()], want.reshape(-1)[:values.numel()]
            differ = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
            assert differ.numel() == 0, f"scale={scale}: {differ.numel()} values stored otherwise, e.g. " + ", ".join(
                f"{float(values[i])}: {float(got[i])} not {float(want[i])}" for i in differ[:4].tolist())


def test_store_kv_and_attention_ignore_the_scales_of_a_cache_that_is_not_fp8():
    seed = _make_seed()
    _assert_store_kv_matches(triton_kv_store.store_kv, [11, 2], [11, 1], torch.float16, torch.float32, 8, 2, 64, 2,
                             seed, k_scale=3.0, v_scale=0.25)
    case = _make_attention_case([20, 9], [1, 9], 4, 2, 64, 8, torch.float32, seed)
    _assert_attention_matches(triton_attention, case, seed, k_scale=3.0, v_scale=0.25, label="float32 cache")


def test_store_kv_with_no_tokens_is_a_no_op():
    _, k_cache, v_cache = _make_cache(2, 8, 2, 64, torch.float16, "cpu")
    meta = AttentionMetadata.build([], [], [], 8)
    empty = torch.empty(0, 2, 64, dtype=torch.float16)
    triton_kv_store.store_kv(empty, empty, k_cache, v_cache, meta)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_store_kv_rejects_mismatched_shapes():
    _, k_cache, v_cache = _make_cache(2, 8, 2, 64, torch.float32, "cpu")
    meta = AttentionMetadata.build([[0]], [1], [1], 8)
    with pytest.raises(AssertionError, match="do not fit"):
        triton_kv_store.store_kv(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), k_cache, v_cache, meta)


def test_launchers_refuse_an_fp8_they_do_not_handle():
    """float8_e4m3fn is the one FP8 cache (with positive finite scales); other FP8 formats, and FP8 K/V or
    queries, are refused by name."""
    meta = AttentionMetadata.build([[0]], [1], [1], 8)
    key = torch.zeros(1, 2, 64)
    for dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz):
        _, k_cache, v_cache = _make_cache(2, 8, 2, 64, torch.float32, "cpu")
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        with pytest.raises(AssertionError, match=f"cache dtype {dtype}"):
            triton_kv_store.store_kv(key, key, k_cache, v_cache, meta)
        with pytest.raises(AssertionError, match=f"cache dtype {dtype}"):
            triton_attention.paged_attention(torch.zeros(1, 4, 64), k_cache, v_cache, meta, 0.125)
    _, k_cache, v_cache = _make_cache(2, 8, 2, 64, FP8, "cpu")
    for k_scale, v_scale in ((0.0, 1.0), (1.0, -2.0), (float("inf"), 1.0), (1.0, float("nan"))):
        with pytest.raises(AssertionError, match="scale is positive and finite"):
            triton_kv_store.store_kv(key, key, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale)
        with pytest.raises(AssertionError, match="scale is positive and finite"):
            triton_attention.paged_attention(torch.zeros(1, 4, 64), k_cache, v_cache, meta, 0.125, k_scale=k_scale,
                                             v_scale=v_scale)
    with pytest.raises(ValueError, match="softcap: must be 0 .*or positive, got -1.0"):
        triton_attention.paged_attention(torch.zeros(1, 4, 64), k_cache, v_cache, meta, 0.125, softcap=-1.0)
    with pytest.raises(AssertionError, match="key dtype"):
        triton_kv_store.store_kv(key.to(FP8), key.to(FP8), k_cache, v_cache, meta)
    with pytest.raises(AssertionError, match="query dtype"):
        triton_attention.paged_attention(torch.zeros(1, 4, 64).to(FP8), k_cache, v_cache, meta, 0.125)
    assert k_cache.view(torch.uint8).eq(0x7F).all(), "a refused call wrote into the cache"


# --- paged_attention --------------------------------------------------------------------------

# Every GQA ratio (1, 3, 8), head dim (64, 128; 40, 96 and 8, padded in the kernels to 64, 128 and 16),
# block size (8, 16, 32) and dtype at least once, with and without a sliding window, single pass and
# forced split-K, each on a mixed prefill + decode batch; the last three with capped scores (Gemma 2's
# soft-capping) at a cap that bends them (queries x 4: scores of a few units against a cap of 0.8).
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window,num_splits,softcap", [
    (torch.float32, 2, 2, 64, 8, None, None, 0.0),
    (torch.float16, 6, 2, 128, 16, None, 3, 0.0),
    (torch.bfloat16, 8, 1, 64, 32, 7, None, 0.0),
    (torch.float32, 3, 1, 64, 32, 70, 4, 0.0),
    (torch.float16, 8, 1, 128, 8, None, None, 0.0),
    (torch.bfloat16, 2, 2, 128, 16, 20, 2, 0.0),
    (torch.float16, 6, 2, 40, 16, None, None, 0.0),
    (torch.float32, 3, 1, 96, 8, 30, 3, 0.0),
    (torch.bfloat16, 2, 1, 96, 32, None, 2, 0.0),
    (torch.float32, 2, 2, 8, 8, None, 2, 0.0),
    (torch.float32, 4, 2, 64, 16, None, None, 0.8),
    (torch.bfloat16, 6, 2, 40, 8, 20, 3, 0.8),
    (torch.float16, 2, 2, 128, 32, None, 2, 0.8),
])
def test_paged_attention_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                       sliding_window, num_splits, softcap):
    seed = _make_seed()
    seq_lens, query_lens = _mixed_batch(block_size)
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim))
    if softcap:
        case[0].mul_(4.0)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, num_splits, softcap=softcap,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    if softcap:   # the reference's answer moves with the cap
        query, k_cache, v_cache, meta = case
        capped, plain = (_reference_attention(query, k_cache, v_cache, meta, head_dim ** -0.5, sliding_window,
                                              softcap=cap) for cap in (softcap, 0.0))
        assert (capped - plain).abs().max() > 0.1, f"seed={seed}: the cap changed nothing"


def sink_logits(num_heads: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_heads] attention-sink logits of the size of the test cases' scores (a few units), some far below
    them (a sink that takes almost nothing) and some above (one that takes most of a row's weight): the first
    head's always far below, the last head's always above (random signs alone left every sink below at some seeds)."""
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(num_heads, generator=gen) * 3.0
    logits[0], logits[-1] = -4.0 - logits[0].abs(), 2.0 + logits[-1].abs()
    return logits.to(dtype)


# GPT-OSS's attention sinks on mixed batches: single pass and split-K (the sink joins the reduce's sum), GQA
# groups of 1 and 3, a sliding window, a padded head_dim, each dtype.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window,num_splits,kv_fp8", [
    (torch.float32, 4, 2, 64, 16, None, None, False),
    (torch.bfloat16, 6, 2, 40, 8, 20, 3, False),
    (torch.float16, 3, 1, 64, 32, None, 2, False),
    (torch.bfloat16, 4, 1, 64, 16, 20, 2, True),   # over an FP8 cache at non-unit scales
])
def test_paged_attention_with_sinks_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                      sliding_window, num_splits, kv_fp8):
    seed = _make_seed()
    scales = dict(kv_dtype=FP8, k_scale=0.0625, v_scale=0.5) if kv_fp8 else {}
    case = _make_attention_case(*_mixed_batch(block_size), num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim), **scales)
    sinks = sink_logits(num_heads, seed, dtype)
    scales.pop("kv_dtype", None)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, num_splits, sinks=sinks, **scales,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    query, k_cache, v_cache, meta = case
    sunk, plain = (_reference_attention(query, k_cache, v_cache, meta, head_dim ** -0.5, sliding_window, **scales,
                                        sinks=s) for s in (sinks, None))
    assert (sunk - plain).abs().max() > 0.1, f"seed={seed}: the sinks changed nothing"


# Llama 4's chunked attention: decode rows at, just past and far past chunk boundaries, a short chunk of queries
# across a boundary (this module's kernel), a 100-token prefill over a prefix, boundaries inside both (the
# prefill kernel's unmasked and diagonal tiles), single pass and split-K; sinks and an FP8 cache once each.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,chunk,num_splits,extra", [
    (torch.float32, 4, 2, 64, 8, 16, None, ""),
    (torch.bfloat16, 6, 2, 40, 16, 24, 3, ""),
    (torch.float16, 8, 1, 64, 32, 40, 2, "sinks"),
    (torch.bfloat16, 4, 2, 64, 16, 7, None, "fp8"),
])
def test_paged_attention_chunked_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, chunk,
                                                   num_splits, extra):
    seed = _make_seed()
    seq_lens = [chunk, chunk + 1, 5 * chunk + 3, chunk + 9, 150, 3 * chunk + 1]
    query_lens = [1, 1, 1, 14, 100, 3 * chunk + 1]
    scales = dict(kv_dtype=FP8, k_scale=0.0625, v_scale=0.5) if extra == "fp8" else {}
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim), **scales)
    scales.pop("kv_dtype", None)
    sinks = sink_logits(num_heads, seed, dtype) if extra == "sinks" else None
    _assert_attention_matches(triton_attention, case, seed, None, num_splits, sinks=sinks, chunk=chunk, **scales,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    query, k_cache, v_cache, meta = case
    chunked, plain = (_reference_attention(query, k_cache, v_cache, meta, head_dim ** -0.5, None, **scales,
                                           chunk=c) for c in (chunk, None))
    assert (chunked - plain).abs().max() > 0.1, f"seed={seed}: the chunks changed nothing"


# BLOOM's and MPT's ALiBi: decode rows over short and long contexts, a short chunk over a prefix (this module's kernel)
# and 100-token chunks over a prefix and from scratch (the prefill kernel's unmasked and diagonal tiles), against
# `kernels.alibi`; MHA (BLOOM's, MPT's) and GQA, single pass and split-K, a padded head_dim, an FP8 cache once.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,num_splits,kv_fp8,mpt", [
    (torch.float32, 4, 4, 64, 16, None, False, False),
    (torch.bfloat16, 6, 2, 40, 8, 3, False, True),
    (torch.float16, 8, 8, 64, 32, 2, True, False),
])
def test_paged_attention_with_alibi_matches_kernels_alibi(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                          num_splits, kv_fp8, mpt):
    from kernels.alibi import alibi_slopes, mpt_alibi_slopes

    seed = _make_seed()
    seq_lens, query_lens = [1, 70, 9, 300, 130, 100], [1, 1, 9, 1, 100, 100]
    scales = dict(kv_dtype=FP8, k_scale=0.0625, v_scale=0.5) if kv_fp8 else {}
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim), **scales)
    scales.pop("kv_dtype", None)
    slopes = mpt_alibi_slopes(num_heads, 8.0) if mpt else alibi_slopes(num_heads)
    _assert_attention_matches(triton_attention, case, seed, None, num_splits, alibi=slopes, **scales,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    query, k_cache, v_cache, meta = case
    biased, plain = (_reference_attention(query, k_cache, v_cache, meta, head_dim ** -0.5, None, **scales,
                                          alibi=a) for a in (slopes, None))
    assert (biased - plain).abs().max() > 0.1, f"seed={seed}: the slopes changed nothing"


@pytest.mark.parametrize("num_splits,head_dim", [(1, 64), (3, 64), (8, 64), (1, 80), (3, 80)])
def test_paged_attention_decode_split_k_matches_reference(num_splits, head_dim):
    """Decode only (the flash-decoding path: small query tiles), long contexts split into segments,
    some of which are empty for the short sequences; head_dim 80 pads to 128 in the paged kernel and
    in the reduce of the split partials."""
    seed = _make_seed()
    rng = random.Random(seed)
    seq_lens = [rng.randint(150, 300), rng.randint(1, 20), rng.randint(60, 140)]
    case = _make_attention_case(seq_lens, [1, 1, 1], 3, 1, head_dim, 16, torch.float16, seed,
                                head_pad=_head_pad(head_dim))
    _assert_attention_matches(triton_attention, case, seed, num_splits=num_splits,
                              label=f"d={head_dim} lens={seq_lens}")


# FP8 caches: bf16, float32 and fp16 queries, scales at 1, below (some K past 448 * k_scale saturate) and
# above (powers of two with bf16: see the module's docstring), single pass and forced split-K, a sliding
# window, a padded head_dim, on the mixed batch.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window,num_splits,k_scale,v_scale", [
    (torch.bfloat16, 6, 2, 64, 16, None, None, 1.0, 1.0),
    (torch.float32, 4, 2, 64, 8, None, 3, 0.05, 0.02),
    (torch.bfloat16, 2, 1, 128, 32, 20, 2, 0.0625, 4.0),
    (torch.float32, 3, 1, 40, 16, 30, None, 0.004, 0.5),
    (torch.float16, 2, 2, 64, 8, None, None, 0.125, 0.3),
])
def test_paged_attention_fp8_cache_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                                 sliding_window, num_splits, k_scale, v_scale):
    seed = _make_seed()
    seq_lens, query_lens = _mixed_batch(block_size)
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim), kv_dtype=FP8, k_scale=k_scale, v_scale=v_scale)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, num_splits, k_scale=k_scale,
                              v_scale=v_scale,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")


@pytest.mark.parametrize("dtype,num_splits,sliding_window,k_scale,v_scale", [
    (torch.bfloat16, 1, None, 0.03125, 0.0625), (torch.bfloat16, 4, None, 0.03125, 0.0625),
    (torch.float32, 3, 90, 0.03, 0.07)])
def test_paged_attention_fp8_cache_decode_split_k_matches_reference(dtype, num_splits, sliding_window, k_scale,
                                                                    v_scale):
    """Decode only over an FP8 cache (non-unit scales), long contexts in split segments (some empty) or one pass."""
    seed = _make_seed()
    rng = random.Random(seed)
    seq_lens = [rng.randint(150, 300), rng.randint(1, 20), rng.randint(60, 140)]
    case = _make_attention_case(seq_lens, [1, 1, 1], 6, 2, 64, 16, dtype, seed, kv_dtype=FP8, k_scale=k_scale,
                                v_scale=v_scale)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, num_splits, k_scale=k_scale,
                              v_scale=v_scale, label=f"{dtype} lens={seq_lens}")


def test_paged_attention_random_steps_match_reference():
    """A few random steps (shapes, dtype, batch, window, splits all drawn from the seed): each run
    covers other corners."""
    seed = _make_seed()
    rng = random.Random(seed)
    for _ in range(3):
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 5, 8])
        head_dim, block_size = rng.choice([16, 64, 128, 40, 72, 96]), rng.choice([8, 16, 32])
        seq_lens = [rng.randint(1, 130) for _ in range(rng.randint(1, 5))]
        query_lens = [rng.choice([1, 1, rng.randint(0, s)]) for s in seq_lens]
        window = rng.choice([None, rng.randint(1, 80)])
        splits = rng.choice([None, rng.randint(2, 6)])
        case = _make_attention_case(seq_lens, query_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                                    dtype, rng.randrange(2**31))
        _assert_attention_matches(triton_attention, case, seed, window, splits,
                                  label=f"{dtype} heads={num_kv_heads * group}/{num_kv_heads} d={head_dim} "
                                        f"bs={block_size} seq_lens={seq_lens} query_lens={query_lens}")


def test_paged_attention_decode_split_k_with_sliding_window():
    seed = _make_seed()
    case = _make_attention_case([260, 33], [1, 1], 2, 2, 64, 16, torch.float32, seed)
    _assert_attention_matches(triton_attention, case, seed, sliding_window=90, num_splits=3)


def test_paged_attention_long_prefill_chunk_over_several_tiles():
    """A chunk longer than a query tile, starting mid-block, over a cached prefix of several KV tiles."""
    seed = _make_seed()
    case = _make_attention_case([150, 1], [77, 1], 4, 2, 64, 16, torch.bfloat16, seed)
    _assert_attention_matches(triton_attention, case, seed, label="prefill 77 of 150")
    _assert_attention_matches(triton_attention, case, seed, sliding_window=40, label="prefill 77 of 150")


def test_paged_attention_single_token_and_empty_step():
    seed = _make_seed()
    one = _make_attention_case([1], [1], 3, 1, 64, 8, torch.float32, seed)
    _assert_attention_matches(triton_attention, one, seed, label="one token")
    _assert_attention_matches(triton_attention, one, seed, num_splits=2, label="one token")
    _, k_cache, v_cache = _make_cache(2, 8, 1, 64, torch.float32, "cpu")
    meta = AttentionMetadata.build([], [], [], 8)
    out = triton_attention.paged_attention(torch.empty(0, 3, 64), k_cache, v_cache, meta, 0.125)
    assert out.shape == (0, 3, 64)


def test_paged_attention_builds_the_step_plan_once_for_all_layers():
    seed = _make_seed()
    query, k_cache, v_cache, meta = _make_attention_case([20, 9], [1, 9], 4, 2, 64, 8, torch.float32, seed)
    first = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    plan = meta.backend_cache["triton"]
    tiles = {key: value for key, value in plan.items() if isinstance(key, tuple) and key[0] == "tiles"}
    second = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert meta.backend_cache["triton"] is plan
    for key, value in tiles.items():
        assert plan[key] is value
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_choose_num_splits(monkeypatch):
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    choose = triton_attention.choose_num_splits
    assert choose(4 * 8, 100_000, torch.device("cpu")) == 1                # nothing to fill on the CPU
    assert choose(4 * 8, 32_000, cuda) == 9                                 # 4 decodes x 8 KV heads: 264 / 32
    assert choose(1 * 8, 32_000, cuda) == 33                                # one long decode
    assert choose(1 * 8, 1_000, cuda) == 3                                  # segments stay >= MIN_SPLIT_LEN
    assert choose(1 * 8, 400, cuda) == 1                                    # too short to split
    assert choose(200 * 8, 32_000, cuda) == 1                               # the grid fills the GPU already
    assert choose(1, 10**7, cuda) == triton_attention.MAX_SPLITS


def test_a_sliding_layer_splits_by_its_window_not_its_sequence(monkeypatch):
    """The split count is chosen from the positions a tile reads: a sliding layer's window (and its query's
    length), not the sequence's whole length, so its segments keep MIN_SPLIT_LEN positions; the full and the
    sliding layers of one step each keep their own count in the step's plan."""
    asked = []
    monkeypatch.setattr(triton_attention, "choose_num_splits",
                        lambda programs, span, device: asked.append(span) or 1)
    seed = _make_seed()
    case = _make_attention_case([300, 40, 200], [1, 3, 1], 4, 2, 64, 16, torch.float32, seed)
    for window in (None, 50, 50, 1000, None):
        _assert_attention_matches(triton_attention, case, seed, sliding_window=window, label="decode")
    assert asked == [300, 52, 300]   # per window once a step; a window past the sequence reads it whole
    plan = case[3].backend_cache["triton"]
    assert {key[3] for key in plan if key[0] == "num_splits"} == {None, 50, 1000}


# --- dispatch ---------------------------------------------------------------------------------

def test_a_distribution_named_kernels_is_refused_by_name(tmp_path, monkeypatch):
    """Hugging Face's `kernels` distribution has this package's import name: found installed, the import
    is refused with the fix (without it, nothing is said)."""
    kernels.refuse_namesake()
    info = tmp_path / "kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"'kernels' 0\.19\.1 .*\(pip uninstall kernels\)"):
        kernels.refuse_namesake()


def test_get_backend_choice_and_override(monkeypatch):
    monkeypatch.delenv("CLIFFGUARD_ATTENTION_BACKEND", raising=False)
    assert kernels.get_backend("cpu") is cpu_attention
    assert kernels.get_backend("meta") is reference
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    backend = kernels.get_backend("cpu")                                    # through the interpreter
    assert backend is triton_attention
    assert backend.store_kv is triton_kv_store.store_kv
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "torch")
    assert kernels.get_backend("cpu") is reference
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="unknown backend 'cuda-graphs'"):
        kernels.get_backend("cpu")


def test_get_backend_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.get_backend("cpu")


def test_launch_variants_cover_every_step_and_compile_kernels_runs_them(monkeypatch):
    """What `compile_kernels` launches before serving is every variant a step can compile: each
    `_launch_config` any query length of the paged kernel gives, unsplit and split, the reduce kernel's
    every pad, and one chunk long enough for the prefill kernel (one variant per attention shape)."""
    longest = triton_attention.PREFILL_MIN_QUERY_LEN - 1
    for num_kv_heads, group, head_dim, size in [(8, 4, 128, 2), (3, 3, 64, 2), (2, 1, 64, 4), (1, 8, 128, 4),
                                                (4, 16, 64, 2), (32, 1, 96, 2), (2, 4, 80, 4), (4, 2, 192, 2)]:
        variants = triton_attention.launch_variants(group * num_kv_heads, num_kv_heads, head_dim, size)
        paged = [(q, s) for q, s in variants if q <= longest]
        configs = {triton_attention._launch_config(group, q, head_dim, size) for q, _ in paged}
        for split in (1, 2):
            assert configs == {triton_attention._launch_config(group, q, head_dim, size)
                               for q, s in paged if s == split}
        assert all(triton_attention._launch_config(group, q, head_dim, size) in configs
                   for q in range(1, longest + 1))
        assert [v for v in variants if v not in paged] == [(longest + 1, 1)]
        pads = {triton.next_power_of_2(s) for _, s in variants if s > 1}
        assert {triton.next_power_of_2(n) for n in range(2, triton_attention.MAX_SPLITS + 1)} <= pads
    # under the interpreter, on a small shape (GQA 2 on one KV head; at most 4 splits: 256 cached positions)
    monkeypatch.setattr(triton_attention, "MAX_SPLITS", 4)
    launched = []
    real = triton_attention.paged_attention

    def paged_attention(query, *args, num_splits=None, **kwargs):
        launched.append((query.shape[0], num_splits))
        return real(query, *args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_attention", paged_attention)
    count = triton_attention.compile_kernels(2, 1, 16, 16, torch.float32, torch.device("cpu"))
    assert launched == triton_attention.launch_variants(2, 1, 16, 4) and count == len(launched) == 8
    # an FP8 cache: the same launches (the configuration goes by the query's dtype), on a cache of its dtype
    caches = []
    monkeypatch.setattr(triton_attention, "store_kv", lambda key, value, k_cache, *args, **kwargs: caches.append(
        k_cache.dtype))
    launched.clear()
    count = triton_attention.compile_kernels(2, 1, 16, 16, torch.float32, torch.device("cpu"), kv_dtype=FP8)
    assert launched == triton_attention.launch_variants(2, 1, 16, 4) and count == 8 and set(caches) == {FP8}


class _LaunchKeys:
    """Stands in for the four kernels and records each launch's compile key as Triton forms it (every
    argument's specialization, the constexprs, the launch options) without running anything; the
    attention outputs are zeroed so callers see finite rows."""

    def __init__(self, monkeypatch, specialize):
        self.specialize, self.keys, self.phase = specialize, {}, "compile"
        self.launched: dict[str, set[str]] = {"compile": set(), "step": set()}   # kernel names by phase
        for module, name in [(triton_attention, "_paged_attention_kernel"),
                             (triton_attention, "_reduce_splits_kernel"), (triton_kv_store, "_store_kv_kernel"),
                             (triton_prefill, "_prefill_attention_kernel")]:
            kernel = getattr(module, name)
            monkeypatch.setattr(module, name, _KeyRecorder(self, name, kernel.fn,
                                                           kernel.kwargs.get("do_not_specialize") or ()))


class _KeyRecorder:
    def __init__(self, keys: _LaunchKeys, name, fn, do_not_specialize):
        import inspect

        self.keys, self.name, self.dns, self.signature = keys, name, set(do_not_specialize), inspect.signature(fn)

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=None, **kwargs):
            bound = self.signature.bind(*args, **kwargs).arguments
            key = [self.name, num_warps, num_stages]
            for param in self.signature.parameters.values():
                arg = bound[param.name]
                if "constexpr" in str(param.annotation):
                    key.append((param.name, str(arg)))
                else:
                    key.append((param.name, self.keys.specialize(arg, param.name not in self.dns)))
            self.keys.keys.setdefault(tuple(key), self.keys.phase)
            self.keys.launched[self.keys.phase].add(self.name)
            if self.name != "_store_kv_kernel":
                args[3].zero_()
        return launch


@pytest.mark.parametrize("window,head_dim,kv_dtype,softcap,alibi", [
    (None, 64, None, 0.0, False), (1024, 64, None, 0.0, False), (None, 80, None, 0.0, False),
    (1024, 64, FP8, 0.0, False), (1024, 64, None, 50.0, False), (None, 64, None, 0.0, True)])
def test_every_launch_a_step_makes_is_a_variant_compile_kernels_compiled(monkeypatch, window, head_dim, kv_dtype,
                                                                         softcap, alibi):
    """Each launch of steps of any shape (decodes and chunks of any mix, short chunks in the paged kernel and long ones
    in the prefill kernel, split or not, a query and K/V sliced out of one fused projection as the model does) has the
    compile key of a launch that `compile_kernels` made, so no step compiles while serving, at head_dim 80 too (padded
    to 128 in the kernels), over an FP8 cache at any scales (runtime arguments), and with soft-capped scores (Gemma 2's
    variant) and with ALiBi's slopes (BLOOM's). On a GPU an odd tile count left the tiles' second row 4 bytes off
    16-byte alignment, and Triton compiled that pointer's variant anew."""
    jit = pytest.importorskip("triton.runtime.jit")
    compiler = pytest.importorskip("triton.backends.compiler")
    if not hasattr(jit, "native_specialize_impl"):
        pytest.skip("this Triton forms its compile keys elsewhere")
    keys = _LaunchKeys(monkeypatch, lambda arg, specialize: jit.native_specialize_impl(
        compiler.BaseBackend, arg, False, specialize, True))
    num_heads, num_kv_heads, block_size = 9, 3, 16                      # the builtin model's attention
    triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                                     torch.device("cpu"), window, kv_dtype=kv_dtype, softcap=softcap, alibi=alibi)
    keys.phase = "step"
    rng = random.Random(_make_seed())
    width = (num_heads + 2 * num_kv_heads) * head_dim
    cache = torch.zeros(2, 4096, block_size, num_kv_heads, head_dim, dtype=kv_dtype or torch.bfloat16)
    for _ in range(60):
        query_lens = [rng.choice([1, 1, 1, rng.randint(2, 70), rng.randint(70, 700)])
                      for _ in range(rng.randint(1, 40))]
        seq_lens = [q + rng.randint(0, 3000) for q in query_lens]
        tables = [rng.sample(range(4096), -(-n // block_size)) for n in seq_lens]
        meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size)
        qkv = torch.zeros(sum(query_lens), width, dtype=torch.bfloat16)
        query = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
        key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
        value = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(-1, num_kv_heads, head_dim)
        k_scale, v_scale = rng.choice([1.0, 0.5, 0.037]), rng.choice([1.0, 2.0, 0.11])
        triton_attention.store_kv(key, value, cache[0], cache[1], meta, k_scale=k_scale, v_scale=v_scale)
        triton_attention.paged_attention(query, cache[0], cache[1], meta, 0.125, window, k_scale=k_scale,
                                         v_scale=v_scale, num_splits=rng.choice([None, 1, 2, 3, 5, 8, 17, 64]),
                                         softcap=softcap, alibi=torch.rand(num_heads) if alibi else None)
    assert keys.launched["step"] == keys.launched["compile"] == {
        "_paged_attention_kernel", "_reduce_splits_kernel", "_store_kv_kernel", "_prefill_attention_kernel"}
    new = [key for key, phase in keys.keys.items() if phase == "step"]
    assert not new, f"{len(new)} launch keys no compile_kernels launch had, e.g. {new[0]}"
    assert sum(phase == "compile" for phase in keys.keys.values()) >= len(triton_attention.launch_variants(
        num_heads, num_kv_heads, head_dim, 2))


def test_the_runner_compiles_kernels_on_cuda_only():
    from types import SimpleNamespace

    from engine.model_runner import _Forward

    calls = []
    attn = SimpleNamespace(num_heads=6, num_kv_heads=2, sliding_window=None, chunk=None, softcap=50.0,
                           sinks=torch.zeros(6),
                           config=SimpleNamespace(head_dim=64, sliding_window=None))
    model = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)],
                            embed_tokens=SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16)))
    runner = SimpleNamespace(model=model, kv_cache=SimpleNamespace(block_size=16, dtype=torch.float8_e4m3fn),
                             backend=SimpleNamespace(compile_kernels=lambda *a, **k: calls.append((a, k)) or 11),
                             device=torch.device("cpu"), warm_sparse_kernels=lambda: calls.append("sparse") or 0)
    _Forward.compile_kernels(runner)
    assert calls == []                                      # the CPU runs the torch reference or the interpreter
    runner.device = torch.device("cuda", 0)
    _Forward.compile_kernels(runner)
    assert calls == [((6, 2, 64, 16, torch.bfloat16, torch.device("cuda", 0), None),
                      {"kv_dtype": torch.float8_e4m3fn, "softcap": 50.0, "sinks": True, "chunk": None, "alibi": False}),
                     "sparse"]   # and the sparse attentions' kernels (tests/kernels/test_engine_triton.py)
    calls.pop()
    # Llama 4's: chunked layers beside full ones, a variant each
    chunked = SimpleNamespace(**{**vars(attn), "chunk": 8192})
    model.layers = [SimpleNamespace(self_attn=chunked), SimpleNamespace(self_attn=attn)]
    calls.clear()
    _Forward.compile_kernels(runner)
    assert [kwargs["chunk"] for _, kwargs in calls[:-1]] == [None, 8192]
    model.layers = [SimpleNamespace(self_attn=SimpleNamespace(**{**vars(attn), "alibi": True}))]   # BLOOM's
    calls.clear()
    _Forward.compile_kernels(runner)
    assert [kwargs["alibi"] for _, kwargs in calls[:-1]] == [True]
    runner.backend = reference                              # a backend with nothing to compile
    _Forward.compile_kernels(runner)
    assert len(calls) == 2


# --- built ahead of time for an H100, no GPU needed ------------------------------------------------

def _run_compiled(code: str, timeout: int) -> str:
    """Run `code` in a fresh Python process from the repository root with TRITON_INTERPRET=0 (compiled
    kernels; see `_check_gpu_kernels` for why not in this one); assert it succeeded and return its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout


def _compiled_report(build, *args):
    """`build(*args)` (a module-level function of a test module that returns JSON: what a build for sm_90 showed) run
    in a fresh process of compiled Triton (`_run_compiled`): what it returned."""
    call = f"{build.__name__}({', '.join(map(repr, args))})"
    code = f"import json; from {build.__module__} import {build.__name__}; print(json.dumps({call}))"
    return json.loads(_run_compiled(code, timeout=300).strip().splitlines()[-1])


def _build_kernel_for_sm90(kernel, constexprs: dict, pointers: dict, **options):
    """Compile `kernel` for sm_90 with Triton's own compiler and no device (run with TRITON_INTERPRET=0),
    specialized as a launch on the engine's tensors is: every pointer (element type from `pointers` by
    argument name, else int32) and stride 16-byte aligned but the arguments the kernel does not specialize
    on, `qk_scale` / `softcap` / `k_scale` / `v_scale` float32, other scalars int32. Returns (the build, {"registers",
    "stack"} from cuobjdump where Triton ships it)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = f"*{pointers.get(name, 'i32')}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap", "k_scale", "v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_") and name not in kernel.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    built = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=options)
    report = {}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel-{os.getpid()}.cubin"
        cubin.write_bytes(built.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        cubin.unlink()
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        if found:
            report["registers"], report["stack"] = int(found[1]), int(found[2])
    return built, report


def _build_fp8_kernels_for_sm90() -> dict:
    """Build the store and the paged kernel (one pass and split, the decode configuration; the split one with
    soft-capped scores, attention sinks and ALiBi's slopes) over an FP8 cache for sm_90, bf16 model, head_dim 128;
    report the PTX instructions that carry the FP8 contract, and the store's stack."""
    import re

    def instructions(built, pattern):
        return sorted(set(re.findall(pattern, built.asm["ptx"])))

    store, store_usage = _build_kernel_for_sm90(
        triton_kv_store._store_kv_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=8, KV_FP8=True),
        {"key_ptr": "bf16", "value_ptr": "bf16", "k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv",
         "slot_mapping_ptr": "i64"}, num_warps=4)
    report = {"store": instructions(store, r"(?:div|cvt)\.rn[.\w]*"), "store_stack": store_usage.get("stack", 0)}
    for split in (False, True):
        paged, _ = _build_kernel_for_sm90(
            triton_attention._paged_attention_kernel,
            dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=4, BLOCK_M=16, BLOCK_N=64, BLOCK_SIZE=16, HEAD_DIM=128,
                 HEAD_DIM_PAD=128, USE_WINDOW=True, SPLIT=split, DOT_DTYPE=triton_prefill.dot_dtype(torch.bfloat16),
                 DOT_PRECISION="tf32", KV_FP8=True, SOFTCAP=split, SINKS=split, ALIBI=split),
            {"query_ptr": "bf16", "out_ptr": "bf16", "sinks_ptr": "bf16", "alibi_ptr": "fp32", "k_cache_ptr": "fp8e4nv",
             "v_cache_ptr": "fp8e4nv",
             "part_m_ptr": "fp32", "part_l_ptr": "fp32", "part_acc_ptr": "fp32"}, num_warps=4)
        report[f"paged_split_{split}"] = instructions(paged, r"cvt\.rn[.\w]*e4m3[.\w]*") + \
            instructions(paged, r"mma\.sync\.aligned\.m16n8k16[.\w]*bf16[.\w]*")
    return report


def _build_decode_tiles_for_sm90() -> dict:
    """The paged kernel's decode tile at the Llama-3-8B shape (4 query heads a KV head, head_dim 128, bfloat16, blocks
    of 16) built for sm_90 on the warps its launch takes and on 8: each build's stack."""
    config = triton_attention._launch_config(4, 1, 128, 2)
    group_pad, block_m, block_q, block_n, warps = config
    report = {"warps": warps}
    for num_warps in (warps, 8):
        _, usage = _build_kernel_for_sm90(
            triton_attention._paged_attention_kernel,
            dict(GROUP=4, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=16,
                 HEAD_DIM=128, HEAD_DIM_PAD=128, USE_WINDOW=False, SPLIT=False,
                 DOT_DTYPE=triton_prefill.dot_dtype(torch.bfloat16), DOT_PRECISION="tf32", KV_FP8=False, SOFTCAP=False,
                 SINKS=False, ALIBI=False),
            {"query_ptr": "bf16", "out_ptr": "bf16", "sinks_ptr": "bf16", "alibi_ptr": "fp32", "k_cache_ptr": "bf16",
             "v_cache_ptr": "bf16", "part_m_ptr": "fp32", "part_l_ptr": "fp32", "part_acc_ptr": "fp32"},
            num_warps=num_warps)
        report[f"stack on {num_warps}"] = usage.get("stack", 0)
    return report


def test_the_decode_tile_at_head_dim_128_spills_on_the_warps_it_takes_not_on_eight(monkeypatch):
    """What `PAGED_WARPS` (CLIFFGUARD_PAGED_WARPS) is for: the decode tile at head_dim 128 takes 4 warps, on which its
    sm_90 build keeps some of its state on the stack, and none on 8 (Triton 3.9); which of the two runs faster is a
    GPU's measurement (bench/gpu_session.sh's kernels_warps beside kernels). The override reaches the launch's
    config."""
    report = _compiled_report(_build_decode_tiles_for_sm90)
    assert report["warps"] == 4 and report["stack on 4"] > 0 and report["stack on 8"] == 0, report
    monkeypatch.setattr(triton_attention, "PAGED_WARPS", 8)
    assert triton_attention._launch_config(4, 1, 128, 2)[-1] == 8


def test_fp8_store_and_paged_kernels_build_for_h100():
    """What the interpreter cannot show: over an FP8 cache the store compiles for sm_90 with an IEEE division by the
    scale (div.rn, not the approximate division `/` is) and a saturating e4m3 conversion, and the paged kernel (one pass
    and split, the latter with capped scores, sinks and ALiBi) with the hardware's e4m3 -> f16 conversion ahead of its
    bf16 tensor-core dots. (The store does not spill; the paged kernel's decode configuration at head_dim 128 spills
    some registers over a bf16 cache as over an FP8 one on its 4 warps: the test above.)"""
    pytest.importorskip("triton.compiler")
    report = _compiled_report(_build_fp8_kernels_for_sm90)
    assert report["store"] == ["cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32"], report
    for split in (False, True):
        assert "cvt.rn.f16x2.e4m3x2" in report[f"paged_split_{split}"], report
        assert any(i.startswith("mma.sync") for i in report[f"paged_split_{split}"]), report
    assert report["store_stack"] == 0, report


# --- CUDA, realistic sizes ----------------------------------------------------------------------

def _check_gpu_kernels(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_fp8: bool = False) -> None:
    """The body of the gpu test. It runs in a process started with TRITON_INTERPRET=0: once Triton's
    interpreter has been on in a process it has patched `triton.language` there, and kernels compiled
    afterwards in that process fail to build (seen with Triton 3.6 on an H100, 2026-11-23). With `kv_fp8`,
    over an FP8 cache at non-unit scales (the store byte for byte the reference's on the CPU)."""
    assert not triton_attention.INTERPRETED, "the compiled check ran under Triton's interpreter"
    dtype = getattr(torch, dtype_name)
    seed = _make_seed()
    kv_dtype, k_scale, v_scale = (FP8, 0.05, 0.3) if kv_fp8 else (None, 1.0, 1.0)
    # store_kv: a step of 3000 tokens, some slots -1 (FP8: values over e4m3's range, a scale not a power of two)
    _assert_store_kv_matches(triton_kv_store.store_kv, [2048, 900, 52], [2048, 900, 52], kv_dtype or dtype, dtype,
                             block_size, num_kv_heads, head_dim, 400, seed, "cuda", k_scale=0.37 if kv_fp8 else 1.0,
                             v_scale=v_scale)
    torch.cuda.synchronize()

    # every variant compiled before the steps below (with and without a window): none compiles during them
    for window in (None, 1024):
        triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device("cuda"),
                                         window, kv_dtype=kv_dtype)
    compiled = triton_attention.compiled_variants()

    # decode-only (split-K chosen by the heuristic, and forced), then a mixed step with a long chunk
    decode = ([4096, 3000, 8191, 17], [1, 1, 1, 1])
    mixed = ([4096, 1500, 8191, 1, 700] + [1000] * 20, [1, 511, 1, 1, 700] + [1] * 20)
    for (lens, q_lens), window, splits in [(decode, None, None), (decode, None, 1), (decode, 1024, None),
                                           (mixed, None, None), (mixed, 4096, None), (mixed, None, 7)]:
        case = _make_attention_case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                    device="cuda", kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
        _assert_attention_matches(triton_attention, case, seed, window, splits, k_scale=k_scale, v_scale=v_scale,
                                  label=f"{dtype} {num_heads}/{num_kv_heads} d={head_dim} bs={block_size} "
                                        f"lens={lens[:5]}")
        if lens is decode[0] and splits is None:   # the heuristic chose flash-decoding for 4 long decodes
            plan = case[3].backend_cache["triton"]
            assert max(v for k, v in plan.items() if isinstance(k, tuple) and k[0] == "num_splits") > 1
    if compiled is not None:
        new = triton_attention.compiled_variants() - compiled
        assert not new, f"{len(new)} variants compiled after compile_kernels:\n" + "\n".join(sorted(new))


def _check_gpu_capped_kernels(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                              block_size: int, softcap: float = 50.0, sinks: bool = False, window: int = 4096) -> None:
    """The gpu test of soft-capped scores (Gemma 2's cap of 50, a window of 4,096 as its sliding layers') or of
    attention sinks (GPT-OSS's, a window of 128), run compiled as `_check_gpu_kernels` is: decodes (split and not)
    and a step with a long chunk, the queries scaled so the cap bends the scores; every variant compiled before
    (none during)."""
    assert not triton_attention.INTERPRETED, "the compiled check ran under Triton's interpreter"
    dtype, seed = getattr(torch, dtype_name), _make_seed()
    for each in (None, window):
        triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device("cuda"),
                                         each, softcap=softcap, sinks=sinks)
    compiled = triton_attention.compiled_variants()
    logits = sink_logits(num_heads, seed, dtype).cuda() if sinks else None
    decode = ([4096, 3000, 8191, 17], [1, 1, 1, 1])
    mixed = ([4096, 1500, 8191, 1, 700] + [1000] * 20, [1, 511, 1, 1, 700] + [1] * 20)
    for (lens, q_lens), each in [(decode, None), (decode, window), (mixed, None), (mixed, window)]:
        case = _make_attention_case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                    device="cuda")
        if softcap:
            case[0].mul_(32.0)   # scores of tens: the cap of 50 bends them
        _assert_attention_matches(triton_attention, case, seed, each, softcap=softcap, sinks=logits,
                                  label=f"{dtype} {num_heads}/{num_kv_heads} d={head_dim} lens={lens[:5]}")
    if compiled is not None:
        new = triton_attention.compiled_variants() - compiled
        assert not new, f"{len(new)} variants compiled after compile_kernels:\n" + "\n".join(sorted(new))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["16, 8, 128, 16", "64, 8, 64, 16, softcap=0.0, sinks=True, window=128"],
                         ids=["gemma2-capped", "gpt-oss-sinks"])
def test_gpu_kernels_with_capped_scores_or_sinks_match_reference(shape):
    _run_compiled("from tests.kernels.test_triton import _check_gpu_capped_kernels; "
                  f"_check_gpu_capped_kernels('bfloat16', {shape})", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(32, 8, 128, 16), (24, 8, 64, 32),
                                                                      (32, 32, 96, 16)])
def test_gpu_kernels_match_reference_at_realistic_sizes(dtype, num_heads, num_kv_heads, head_dim, block_size):
    code = (f"from tests.kernels.test_triton import _check_gpu_kernels; "
            f"_check_gpu_kernels({dtype!r}, {num_heads}, {num_kv_heads}, {head_dim}, {block_size})")
    _run_compiled(code, timeout=900)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", [("bfloat16", 32, 8, 128, 16),
                                                                            ("float16", 24, 8, 64, 32)])
def test_gpu_kernels_over_an_fp8_cache_match_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    code = (f"from tests.kernels.test_triton import _check_gpu_kernels; "
            f"_check_gpu_kernels({dtype!r}, {num_heads}, {num_kv_heads}, {head_dim}, {block_size}, kv_fp8=True)")
    _run_compiled(code, timeout=900)
