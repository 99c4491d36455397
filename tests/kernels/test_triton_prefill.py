"""The Triton prefill kernel (`kernels.triton_prefill`) against the torch reference: on the CPU through
Triton's interpreter on small shapes, on CUDA at realistic sizes (`gpu` mark).

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`). Caches are poisoned with NaN outside the written slots and outputs with
NaN before the call (the helpers of `tests/kernels/test_triton.py`), so a kernel that reads a slot it
should not, or leaves a row unwritten, fails. FP8 caches (float8_e4m3fn with k_scale / v_scale) are held to the
tolerances of a cache in the query's dtype, against the reference over the values it reads from them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (the gpu test's
# child process sets it to 0)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import AttentionMetadata  # noqa: E402
from kernels import triton_attention, triton_prefill  # noqa: E402
from tests.kernels.test_triton import (  # noqa: E402
    FP8,
    TOLERANCES,
    _assert_attention_matches,
    _build_kernel_for_sm90,
    _compiled_report,
    _head_pad,
    _make_attention_case,
    _make_seed,
    _reference_attention,
    _run_compiled,
    sink_logits,
)

MIN_LEN = triton_attention.PREFILL_MIN_QUERY_LEN


def _mixed_step(block_size):
    """(seq_lens, query_lens): a whole prompt over two query tiles and a bit, a chunk over a cached prefix
    that ends mid-block, a chunk of exactly PREFILL_MIN_QUERY_LEN, a short chunk and decode rows (the paged
    kernel's), a sequence with no new token."""
    b = block_size
    seq_lens = [130, 3 * b + 5 + 70, 2 * b + 1, 7 * b + 3, MIN_LEN + 2, 9, 11]
    query_lens = [130, 70, 1, 1, MIN_LEN, 9, 0]
    return seq_lens, query_lens


def _prefill_tiles(meta):
    """The prefill kernel's tile lists this step built: {(min_query_len, block_m): (tile_seq, tile_q_start)}."""
    return meta.backend_cache.get("triton_prefill", {})


# Every dtype, GQA group 1 and 4, head_dim 64 and 128 (and 40, 80, 96, 8: padded in the kernels to 64,
# 128, 128, 16), block sizes 8/16/32, with and without a sliding window, each on a step of prefill chunks
# and decode rows.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window", [
    (torch.float32, 2, 2, 64, 8, None),
    (torch.float16, 8, 2, 128, 16, None),
    (torch.bfloat16, 4, 1, 64, 32, 50),
    (torch.float16, 2, 2, 64, 32, 70),
    (torch.bfloat16, 2, 2, 128, 8, None),
    (torch.float32, 2, 1, 128, 16, 100),
    (torch.float16, 2, 1, 40, 16, None),
    (torch.bfloat16, 2, 2, 96, 8, 60),
    (torch.float32, 1, 1, 80, 32, None),
    (torch.float16, 2, 1, 8, 16, 40),
])
def test_mixed_prefill_and_decode_step_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                         sliding_window):
    seed = _make_seed()
    seq_lens, query_lens = _mixed_step(block_size)
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim))
    _assert_attention_matches(triton_attention, case, seed, sliding_window,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    block_m = triton_prefill.prefill_config(head_dim, dtype.itemsize)[0]
    tile_seq, _ = _prefill_tiles(case[3])[(MIN_LEN, block_m)]
    chunks = [i for i, q in enumerate(query_lens) if q >= MIN_LEN]
    assert sorted(set(tile_seq.tolist())) == chunks, f"seed={seed}: prefill tiles {tile_seq.tolist()}"


@pytest.mark.parametrize("dtype,head_dim,sliding_window", [(torch.float32, 64, None), (torch.bfloat16, 80, 50)])
def test_a_step_with_capped_scores_matches_reference(dtype, head_dim, sliding_window):
    """Gemma 2's soft-capping through the prefill kernel (the long chunks) and the paged one (the rest)."""
    seed = _make_seed()
    seq_lens, query_lens = _mixed_step(16)
    case = _make_attention_case(seq_lens, query_lens, 4, 2, head_dim, 16, dtype, seed, head_pad=_head_pad(head_dim))
    case[0].mul_(4.0)   # scores of a few units against a cap of 0.8
    _assert_attention_matches(triton_attention, case, seed, sliding_window, softcap=0.8, label=f"{dtype} d={head_dim}")


@pytest.mark.parametrize("dtype,head_dim,sliding_window", [(torch.float32, 64, None), (torch.bfloat16, 80, 50)])
def test_a_step_with_attention_sinks_matches_reference(dtype, head_dim, sliding_window):
    """GPT-OSS's attention sinks through the prefill kernel (the long chunks) and the paged one (the rest)."""
    seed = _make_seed()
    case = _make_attention_case(*_mixed_step(16), 4, 2, head_dim, 16, dtype, seed, head_pad=_head_pad(head_dim))
    _assert_attention_matches(triton_attention, case, seed, sliding_window, sinks=sink_logits(4, seed, dtype),
                              label=f"{dtype} d={head_dim}")


# FP8 caches: bf16, float32 and fp16 queries, scales at 1, below (some K or V past 448 * scale saturate) and
# above (powers of two with bf16: see test_triton.py's docstring), with and without a sliding window, a padded
# head_dim, on the step of long and short chunks and decodes.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window,k_scale,v_scale", [
    (torch.bfloat16, 4, 1, 64, 16, None, 0.0625, 0.03125),
    (torch.float32, 2, 2, 64, 8, 50, 1.0, 1.0),
    (torch.bfloat16, 2, 1, 40, 32, 70, 2.0, 2.0**-8),
    (torch.float32, 2, 1, 16, 16, None, 0.37, 0.21),
    (torch.float16, 2, 2, 64, 8, 40, 0.125, 3.0),
])
def test_fp8_cache_mixed_prefill_and_decode_step_matches_reference(dtype, num_heads, num_kv_heads, head_dim,
                                                                   block_size, sliding_window, k_scale, v_scale):
    seed = _make_seed()
    seq_lens, query_lens = _mixed_step(block_size)
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim), kv_dtype=FP8, k_scale=k_scale, v_scale=v_scale)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, k_scale=k_scale, v_scale=v_scale,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")
    assert _prefill_tiles(case[3]), f"seed={seed}: no chunk went through the prefill kernel"


@pytest.mark.parametrize("dtype,sliding_window,k_scale,v_scale", [(torch.bfloat16, None, 0.0625, 0.5),
                                                                (torch.bfloat16, 40, 0.0625, 0.5),
                                                                (torch.float32, 200, 0.06, 0.4)])
def test_fp8_cache_chunk_over_a_long_prefix(dtype, sliding_window, k_scale, v_scale):
    """Chunked prefill over an FP8 cache: a 100-token chunk over a 231-token cached prefix (mid-block, several
    K/V tiles, unmasked and diagonal ones) beside a whole 70-token prompt, at non-unit scales."""
    seed = _make_seed()
    case = _make_attention_case([331, 70], [100, 70], 2, 1, 64, 16, dtype, seed, kv_dtype=FP8, k_scale=k_scale,
                                v_scale=v_scale)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, k_scale=k_scale, v_scale=v_scale,
                              label=f"{dtype} 100 of 331, 70 of 70")


def test_prefill_kernel_alone_writes_exactly_its_chunks():
    """Every chunk of two or more tokens through the prefill kernel (tiny ones too: mostly padding rows),
    a GQA group of 3; the decode rows' outputs are left as they were (NaN)."""
    seed = _make_seed()
    seq_lens, query_lens = [40, 2, 17, 25, 5, 1], [40, 2, 1, 3, 0, 1]
    query, k_cache, v_cache, meta = _make_attention_case(seq_lens, query_lens, 6, 2, 64, 8, torch.float16, seed)
    scale = 64 ** -0.5
    out = torch.full_like(query, float("nan"))
    num_tiles = triton_prefill.prefill_attention(query, k_cache, v_cache, meta, scale, None, out, min_query_len=2)
    assert num_tiles == 3
    want = _reference_attention(query, k_cache, v_cache, meta, scale, None)
    chunk_rows = torch.tensor([q >= 2 for q in query_lens for _ in range(q)])
    assert out[~chunk_rows].isnan().all(), f"seed={seed}: the prefill kernel wrote a decode row"
    assert not out[chunk_rows].isnan().any(), f"seed={seed}: chunk rows left unwritten"
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(out[chunk_rows].float(), want[chunk_rows], atol=atol, rtol=rtol,
                               msg=lambda m: f"seed={seed}\n{m}")


@pytest.mark.parametrize("sliding_window", [None, 1, 40, 200])
def test_chunk_over_a_long_prefix_starting_mid_block(sliding_window):
    """A 100-token chunk over a 231-token cached prefix (mid-block, several K/V tiles): unmasked tiles,
    the diagonal's tiles, a window that skips whole tiles (40), one that keeps only the token itself (1)
    and one wider than the chunk's tile (200)."""
    seed = _make_seed()
    case = _make_attention_case([331, 70], [100, 70], 2, 2, 64, 16, torch.bfloat16, seed)
    _assert_attention_matches(triton_attention, case, seed, sliding_window, label="100 of 331, 70 of 70")


def test_random_steps_match_reference():
    """A few random steps (shapes, dtype, batch, window all drawn from the seed), chunks long and short
    beside decode rows: each run covers other corners."""
    seed = _make_seed()
    rng = random.Random(seed)
    for _ in range(3):
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 3, 4])
        head_dim, block_size = rng.choice([16, 64, 128, 40, 80, 96]), rng.choice([8, 16, 32])
        query_lens = [rng.choice([1, rng.randint(2, MIN_LEN - 1), rng.randint(MIN_LEN, 200)])
                      for _ in range(rng.randint(1, 4))]
        seq_lens = [q + rng.choice([0, rng.randint(1, 150)]) for q in query_lens]
        window = rng.choice([None, rng.randint(1, 150)])
        case = _make_attention_case(seq_lens, query_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                                    dtype, rng.randrange(2**31))
        _assert_attention_matches(triton_attention, case, seed, window,
                                  label=f"{dtype} heads={num_kv_heads * group}/{num_kv_heads} d={head_dim} "
                                        f"bs={block_size} seq_lens={seq_lens} query_lens={query_lens}")


def test_tiles_are_heaviest_first_aligned_and_built_once_per_step():
    seed = _make_seed()
    seq_lens, query_lens = [64, 400, 300, 1, 129], [64, 300, 300, 1, 129]
    query, k_cache, v_cache, meta = _make_attention_case(seq_lens, query_lens, 1, 1, 16, 16, torch.float16, seed)
    out = torch.empty_like(query)
    assert triton_prefill.prefill_attention(query, k_cache, v_cache, meta, 0.25, None, out, min_query_len=MIN_LEN) \
        == 1 + 3 + 3 + 2
    plan = _prefill_tiles(meta)
    (key, (tile_seq, tile_q_start)), = plan.items()
    assert key == (MIN_LEN, 128)
    # the keys each tile walks: its sequence's prefix and the chunk up to the tile's last query
    work = [seq_lens[s] - query_lens[s] + min(q + 128, query_lens[s])
            for s, q in zip(tile_seq.tolist(), tile_q_start.tolist())]
    assert work == sorted(work, reverse=True) and work[0] == 400
    assert sorted(zip(tile_seq.tolist(), tile_q_start.tolist())) == \
        [(0, 0), (1, 0), (1, 128), (1, 256), (2, 0), (2, 128), (2, 256), (4, 0), (4, 128)]
    # an odd tile count: both arrays still start 16-byte aligned (Triton specializes pointers on it)
    assert tile_seq.data_ptr() % 16 == 0 and tile_q_start.data_ptr() % 16 == 0
    triton_prefill.prefill_attention(query, k_cache, v_cache, meta, 0.25, None, out, min_query_len=MIN_LEN)
    assert _prefill_tiles(meta)[key][0] is tile_seq


def test_prefill_config_per_head_dim_and_shared_memory():
    h100 = 227 * 1024
    assert triton_prefill.prefill_config(128, 2, h100) == (128, 64, 8, 3)
    assert triton_prefill.prefill_config(64, 2, h100) == (128, 64, 4, 3)
    assert triton_prefill.prefill_config(256, 2, h100) == (64, 32, 8, 3)
    assert triton_prefill.prefill_config(128, 4, h100) == (64, 32, 8, 3)
    assert triton_prefill.prefill_config(64, 4, h100) == (64, 32, 4, 3)
    # a 99 KiB part (sm_86 / sm_89): fewer stages at head_dim 128, never none
    assert triton_prefill.prefill_config(128, 2, 99 * 1024)[3] == 2
    assert triton_prefill.prefill_config(64, 2, 99 * 1024)[3] == 3
    assert triton_prefill.prefill_config(128, 2, 40 * 1024)[3] == 1
    # other head_dims are configured as the power of two their tiles are padded to
    assert [triton_prefill.padded_head_dim(d) for d in (8, 16, 40, 64, 72, 80, 96, 112, 128, 160, 192, 256)] == \
        [16, 16, 64, 64, 128, 128, 128, 128, 128, 256, 256, 256]
    for head_dim in (40, 72, 80, 96, 112, 160, 192):
        for size, shared in [(2, h100), (4, h100), (2, 99 * 1024)]:
            assert triton_prefill.prefill_config(head_dim, size, shared) == \
                triton_prefill.prefill_config(triton_prefill.padded_head_dim(head_dim), size, shared)


def test_launcher_rejects_what_the_kernel_does_not_handle():
    seed = _make_seed()
    query, k_cache, v_cache, meta = _make_attention_case([70], [70], 2, 1, 64, 8, torch.float16, seed)
    out = torch.empty_like(query)
    with pytest.raises(AssertionError, match="head_dim must be contiguous"):
        triton_prefill.prefill_attention(query.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache,
                                         meta, 0.125, None, out)
    with pytest.raises(AssertionError, match="does not match query"):
        triton_prefill.prefill_attention(query, k_cache, v_cache, meta, 0.125, None, out.float())
    with pytest.raises(AssertionError, match="do not fit"):
        triton_prefill.prefill_attention(query[:, :, :32], k_cache, v_cache, meta, 0.125, None, out[:, :, :32])
    with pytest.raises(AssertionError, match="query rows for metadata"):
        triton_prefill.prefill_attention(query[:5], k_cache, v_cache, meta, 0.125, None, out[:5])
    with pytest.raises(AssertionError, match="sliding_window"):
        triton_prefill.prefill_attention(query, k_cache, v_cache, meta, 0.125, 0, out)
    empty = AttentionMetadata.build([[0]], [0], [3], 8)
    assert triton_prefill.prefill_attention(query[:0], k_cache, v_cache, empty, 0.125, None, out[:0]) == 0


# --- built ahead of time for an H100, no GPU needed ------------------------------------------------

def _build_for_sm90(dtype_name: str, head_dim: int, use_window: bool, kv_fp8: bool = False,
                    softcap: bool = False) -> dict:
    """Compile the prefill kernel for sm_90 with Triton's own compiler and no device (run with
    TRITON_INTERPRET=0), specialized as a launch on the engine's tensors is (16-byte aligned pointers and
    strides, the block table's row width not), over a cache in the query's dtype or an FP8 one (`kv_fp8`),
    the scores soft-capped, the heads' attention sinks in the sum and ALiBi's slopes added, or none (`softcap`);
    report what the build holds: shared memory, the count of wgmma (Hopper tensor-core) instructions, the
    K/V copies' sizes, and registers and stack from cuobjdump."""
    import re

    kernel = triton_prefill._prefill_attention_kernel
    dtype = getattr(torch, dtype_name)
    block_m, block_n, num_warps, num_stages = triton_prefill.prefill_config(head_dim, dtype.itemsize)
    constexprs = dict(GROUP=4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=16, HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=triton_prefill.padded_head_dim(head_dim), USE_WINDOW=use_window,
                      DOT_DTYPE=triton_prefill.dot_dtype(dtype), DOT_PRECISION="tf32", KV_FP8=kv_fp8,
                      SOFTCAP=softcap, SINKS=softcap, ALIBI=softcap)
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype_name]
    pointers = {"query_ptr": short, "out_ptr": short, "sinks_ptr": short, "alibi_ptr": "fp32",
                "k_cache_ptr": "fp8e4nv" if kv_fp8 else short,
                "v_cache_ptr": "fp8e4nv" if kv_fp8 else short}
    built, report = _build_kernel_for_sm90(kernel, constexprs, pointers, num_warps=num_warps, num_stages=num_stages)
    ptx = built.asm["ptx"]
    report.update(shared=built.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                  kv_copy_bytes=sorted(set(re.findall(r"cp\.async\.cg\.shared\.global .*, (0x[0-9a-f]+), ", ptx))))
    return report


# the default run builds a head dim not a power of two with capped scores and the FP8 cache with a window; the
# others are slow
@pytest.mark.parametrize("dtype,head_dim,use_window,kv_fp8,softcap", [
    pytest.param("bfloat16", 128, False, False, False, marks=pytest.mark.slow),
    pytest.param("float16", 64, True, False, False, marks=pytest.mark.slow), ("bfloat16", 96, False, False, True),
    pytest.param("float16", 192, True, False, False, marks=pytest.mark.slow), ("bfloat16", 128, True, True, False)])
def test_prefill_kernel_builds_for_h100_with_tensor_cores(dtype, head_dim, use_window, kv_fp8, softcap):
    """What the interpreter cannot show: the kernel compiles for sm_90, its dots are wgmma, its K/V tiles
    arrive in 16-byte asynchronous copies, and it neither spills nor outgrows an H100's shared memory;
    at head_dim 96 and 192 too, padded to 128 and 256 (the masked lanes keep the copies 16 bytes wide), over
    an FP8 cache (its tiles dequantized to bf16 in registers before the wgmma), and with soft-capped scores,
    attention sinks and ALiBi's slopes."""
    pytest.importorskip("triton.compiler")
    report = _compiled_report(_build_for_sm90, dtype, head_dim, use_window, kv_fp8, softcap)
    assert report["wgmma"] > 0, report
    assert report["kv_copy_bytes"] == ["0x10"], report
    assert report["shared"] <= triton_prefill.DEFAULT_SHARED_MEMORY, report
    assert report.get("stack", 0) == 0, report


# --- CUDA, realistic sizes ----------------------------------------------------------------------

def _check_gpu_prefill(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_fp8: bool = False) -> None:
    """The body of the gpu test, run in a process started with TRITON_INTERPRET=0 (see test_triton.py's):
    whole 4,096- and 2,048-token prompts, a 1,000-token chunk over a 3,000-token prefix beside decodes,
    with and without a sliding window, every launch variant compiled before (none compiles during); with
    `kv_fp8`, over an FP8 cache at non-unit scales."""
    assert not triton_prefill.INTERPRETED, "the compiled check ran under Triton's interpreter"
    dtype = getattr(torch, dtype_name)
    seed = _make_seed()
    kv_dtype, k_scale, v_scale = (FP8, 0.05, 0.3) if kv_fp8 else (None, 1.0, 1.0)
    for window in (None, 1024):
        triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device("cuda"),
                                         window, kv_dtype=kv_dtype)
    compiled = triton_attention.compiled_variants()
    steps = [([4096], [4096]), ([2048] * 4, [2048] * 4),
             ([4000, 500, 3000, 17] + [900] * 8, [1000, 500, 1, 17] + [1] * 8)]
    for lens, q_lens in steps:
        case = _make_attention_case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                    device="cuda", kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
        for window in (None, 1024):
            _assert_attention_matches(triton_attention, case, seed, window, k_scale=k_scale, v_scale=v_scale,
                                      label=f"{dtype} {num_heads}/{num_kv_heads} d={head_dim} bs={block_size} "
                                            f"lens={lens[:4]} q_lens={q_lens[:4]}")
        assert _prefill_tiles(case[3]), "no chunk went through the prefill kernel"
    if compiled is not None:
        new = triton_attention.compiled_variants() - compiled
        assert not new, f"{len(new)} variants compiled after compile_kernels:\n" + "\n".join(sorted(new))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", [
    ("bfloat16", 32, 8, 128, 16), ("float16", 24, 8, 64, 32), ("bfloat16", 32, 32, 96, 16)])
def test_gpu_prefill_matches_reference_at_realistic_sizes(dtype, num_heads, num_kv_heads, head_dim, block_size):
    code = (f"from tests.kernels.test_triton_prefill import _check_gpu_prefill; "
            f"_check_gpu_prefill({dtype!r}, {num_heads}, {num_kv_heads}, {head_dim}, {block_size})")
    _run_compiled(code, timeout=900)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", [
    ("bfloat16", 32, 8, 128, 16), ("float16", 32, 32, 96, 16)])
def test_gpu_prefill_over_an_fp8_cache_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    code = (f"from tests.kernels.test_triton_prefill import _check_gpu_prefill; "
            f"_check_gpu_prefill({dtype!r}, {num_heads}, {num_kv_heads}, {head_dim}, {block_size}, kv_fp8=True)")
    _run_compiled(code, timeout=900)
