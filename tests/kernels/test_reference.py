"""The torch paged-attention reference against dense attention on contiguous K/V.

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`). Caches are poisoned with NaN outside the written slots and the output
buffer with NaN before the call, so a read of a slot that should not be read, or a row left unwritten,
fails. Prefill chunks run two ways on the CPU: torch's CPU flash kernel with a log-sum-exp merge of
the prefix (`cpu_flash`, the engine's path) and SDPA with a boolean mask (`sdpa_mask`, the path off
the CPU); both are checked.
"""

import os
import random

import pytest
import torch

from kernels import AttentionMetadata, reference

# (atol, rtol) against `dense_causal_attention` on the same inputs (float32 math, rounded to the dtype)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
PATHS = ["cpu_flash", "sdpa_mask"]


def _make_seed() -> int:
    forced = os.environ.get("CLIFFGUARD_TEST_SEED")
    return int(forced) if forced else random.SystemRandom().randrange(2**31)


def _make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, rng):
    """Random per-sequence K/V, scattered into shuffled blocks of a cache with spare blocks."""
    num_blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    total = sum(num_blocks_per_seq) + 3
    ids = list(range(total))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in num_blocks_per_seq:
        tables.append(ids[pos:pos + n])
        pos += n
    k_cache = torch.full((total, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = [torch.randn(s, num_kv_heads, head_dim).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim).to(dtype) for s in seq_lens]
    return tables, k_cache, v_cache, keys, values


def _make_step(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """One step's metadata, a cache holding every sequence's prefix and new tokens, and the queries."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tables, k_cache, v_cache, keys, values = _make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, rng)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size)
    # the cached prefix was stored by earlier steps; this step stores the new tokens itself
    for table, k, v, q_len in zip(tables, keys, values, query_lens):
        prefix = AttentionMetadata.build([table], [len(k) - q_len], [len(k) - q_len], block_size)
        reference.store_kv(k[: len(k) - q_len], v[: len(k) - q_len], k_cache, v_cache, prefix)
    new_k = torch.cat([k[len(k) - q:] for k, q in zip(keys, query_lens)])
    new_v = torch.cat([v[len(v) - q:] for v, q in zip(values, query_lens)])
    reference.store_kv(new_k, new_v, k_cache, v_cache, meta)
    query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    return meta, k_cache, v_cache, keys, values, query


@pytest.fixture
def poisoned_output(monkeypatch):
    """`paged_attention` allocates its output with `torch.empty_like`: make that NaN-filled."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "cpu_flash":
        assert reference._cpu_flash_works(torch.float32), "this torch's CPU flash kernel failed the probe"
    else:
        monkeypatch.setattr(reference, "_use_cpu_flash", lambda query: False)
    return request.param


def _run_and_check(seq_lens, query_lens, num_heads, num_kv_heads, head_dim=16, block_size=16,
                   dtype=torch.float32, sliding_window=None, label="", softcap=0.0, sinks=None, chunk=None):
    seed = _make_seed()
    meta, k_cache, v_cache, keys, values, query = _make_step(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    scale = head_dim ** -0.5
    out = reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap, sinks=sinks,
                                    chunk=chunk)
    assert out.dtype == dtype and out.shape == query.shape
    assert not out.isnan().any(), f"seed {seed} {label}: NaN in the output"
    atol, rtol = TOLERANCES[dtype]
    start = 0
    for i, (k, v, q_len) in enumerate(zip(keys, values, query_lens)):
        want = reference.dense_causal_attention(query[start:start + q_len], k, v, scale, sliding_window, softcap, sinks,
                                                chunk)
        torch.testing.assert_close(out[start:start + q_len], want, atol=atol, rtol=rtol,
                                   msg=lambda m: f"seed {seed} {label} sequence {i}: {m}")
        start += q_len


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_paged_attention_matches_dense(num_heads, num_kv_heads, block_size, sliding_window, path, poisoned_output):
    # decode rows, a prefill chunk starting mid-block, a whole prompt, a length-1 prompt
    _run_and_check([1, 37, 20, 5, block_size * 2, 1], [1, 1, 9, 5, 3, 1], num_heads, num_kv_heads,
                   block_size=block_size, sliding_window=sliding_window, label=path)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("prefix_len,q_len", [(0, 300), (700, 300), (37, 5), (1, 2), (600, 800), (16, 16)])
def test_prefill_chunk_over_a_cached_prefix(num_heads, num_kv_heads, prefix_len, q_len, path, poisoned_output):
    # lengths past the CPU kernel's 512-key and 256-query splits, prefixes block-aligned or not
    _run_and_check([prefix_len + q_len], [q_len], num_heads, num_kv_heads, head_dim=64, label=path)


def test_several_prefill_chunks_and_decodes_in_one_step(path, poisoned_output):
    seq_lens = [530, 41, 1, 300, 77, 2, 90]
    query_lens = [130, 41, 1, 1, 60, 2, 1]      # chunks with and without prefixes, decode rows between
    _run_and_check(seq_lens, query_lens, 6, 2, head_dim=32, block_size=16, label=path)


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_capped_scores_in_prefill_chunks_and_decodes(sliding_window, path, poisoned_output):
    """Gemma 2's soft-capping (a cap of 0.5 bends these scores): decodes and chunks, over a cached prefix."""
    _run_and_check([40, 23, 70, 5], [1, 23, 30, 1], 6, 2, sliding_window=sliding_window, softcap=0.5,
                   label=f"softcap window={sliding_window}")


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_attention_sinks_in_prefill_chunks_and_decodes(sliding_window, path, poisoned_output):
    """GPT-OSS's attention sinks (a logit per head in each softmax's denominator), with capped scores too."""
    sinks = torch.tensor([-3.0, 0.5, 2.0, 4.0, -0.5, 1.0])
    for softcap in (0.0, 0.5):
        _run_and_check([40, 23, 70, 5], [1, 23, 30, 1], 6, 2, sliding_window=sliding_window, softcap=softcap,
                       sinks=sinks, label=f"sinks softcap={softcap} window={sliding_window}")


def test_dense_attention_with_sinks_is_the_softmax_with_one_more_column():
    """The yardstick itself: a sink is a key whose value is zero; a sink far below the scores changes nothing."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 4, 8, generator=gen) for _ in range(3))
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    got = reference.dense_causal_attention(q, k, v, 0.3, sinks=sinks)
    # one more position before the sequence: key whose score is the sink (q.k x scale = sink), value zero
    k_sink = torch.zeros(1, 4, 8)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    weights = torch.cat([sinks.view(4, 1, 1).expand(4, 7, 1), scores], -1).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", weights, torch.cat([k_sink, v]))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(reference.dense_causal_attention(q, k, v, 0.3, sinks=torch.full((4,), -1e4)),
                               reference.dense_causal_attention(q, k, v, 0.3))
    with pytest.raises(ValueError, match=r"sinks: one logit per query head \(4\)"):
        reference.paged_attention(q, k.view(7, 1, 4, 8), v.view(7, 1, 4, 8),
                                  AttentionMetadata.build([list(range(7))], [7], [7], 1), 0.3, sinks=sinks[:3])


def test_a_long_decode_does_not_pad_the_short_ones(path, poisoned_output):
    """Decode rows are batched by similar context length: a 3,000-token rag decode beside chat decodes
    of ~150 must not make every chat row gather and attend over 3,000 keys."""
    seq_lens = [150, 3000, 140, 1, 170, 2900]
    _run_and_check(seq_lens, [1] * len(seq_lens), 6, 2, head_dim=16, block_size=16, label=path)
    assert reference._length_groups(list(range(6)), seq_lens) == [[3], [2, 0, 4], [5, 1]]
    tables = [list(range(sum(-(-n // 16) for n in seq_lens[:i]), sum(-(-n // 16) for n in seq_lens[:i + 1])))
              for i in range(len(seq_lens))]
    plan = reference._step_plan(AttentionMetadata.build(tables, [1] * 6, seq_lens, 16), None)
    gathered = sum(slots.numel() for _, slots, _ in plan["decode"])
    assert gathered == 1 + 3 * 170 + 2 * 3000 < 1.1 * sum(seq_lens)       # one call would gather 6 x 3,000


@pytest.mark.parametrize("sliding_window,seq_len,q_len", [
    (7, 40, 40),       # the window cuts inside the chunk, no prefix
    (50, 300, 40),     # the window starts inside the prefix: keys before it are never read
    (16, 300, 100),    # window shorter than the chunk, long prefix
    (300, 300, 120),   # a window as long as the sequence: plain causal
    (1000, 300, 120),  # a window longer than the sequence
    (1, 20, 10),       # each query sees only itself
])
def test_sliding_window_prefill(sliding_window, seq_len, q_len, path, poisoned_output):
    _run_and_check([seq_len, 9], [q_len, 1], 6, 2, head_dim=32, block_size=8, sliding_window=sliding_window,
                   label=path)


@pytest.mark.parametrize("chunk,seq_lens,query_lens", [
    (8, [40, 23, 70, 5, 16, 17], [40, 1, 30, 1, 1, 1]),   # chunks cut the prefills; decodes at and past a boundary
    (16, [300, 9, 64], [100, 1, 64]),      # a long prefix: the keys before the first query's chunk never read
    (5, [33, 12], [4, 12]),                # a chunk of queries inside one attention chunk, after a prefix
    (1, [20, 7], [10, 1]),                 # each query sees only itself
    (512, [300, 40], [120, 1]),            # a chunk longer than every sequence: plain causal
])
def test_chunked_attention(chunk, seq_lens, query_lens, path, poisoned_output):
    """Llama 4's chunked attention (a query at p sees p - p % chunk .. p) against the dense yardstick, with
    capped scores and sinks too (the eager path)."""
    _run_and_check(seq_lens, query_lens, 6, 2, head_dim=32, block_size=8, chunk=chunk, label=f"{path} chunk={chunk}")
    _run_and_check(seq_lens, query_lens, 6, 2, head_dim=32, block_size=8, chunk=chunk, softcap=0.7,
                   sinks=torch.randn(6), label=f"{path} chunk={chunk} eager")


def test_chunked_attention_dense_mask():
    """The yardstick's own mask, by hand: a query at 9 with chunks of 4 sees 8 and 9 only."""
    query, key = torch.zeros(1, 1, 4), torch.zeros(12, 1, 4)
    value = torch.arange(12.0).view(12, 1, 1).expand(12, 1, 4).contiguous()
    out = reference.dense_causal_attention(query, key[:10], value[:10], 1.0, chunk=4)   # query at position 9
    torch.testing.assert_close(out, torch.full((1, 1, 4), 8.5))
    with pytest.raises(ValueError, match="chunk"):
        meta, k_cache, v_cache, _, _, q = _make_step([9], [1], 2, 2, 16, 8, torch.float32, 0)
        reference.paged_attention(q, k_cache, v_cache, meta, 0.25, chunk=0)


@pytest.mark.parametrize("sliding_window", [None, 33])
def test_bfloat16_prefill_and_decode(sliding_window, path, poisoned_output):
    if path == "cpu_flash" and not reference._cpu_flash_works(torch.bfloat16):
        pytest.skip("this torch's CPU flash kernel has no bfloat16 support")
    _run_and_check([400, 64, 50], [200, 64, 1], 9, 3, head_dim=64, dtype=torch.bfloat16,
                   sliding_window=sliding_window, label=path)


def test_chunked_prefill_over_steps_equals_one_pass(path):
    """A prompt prefilled in chunks over several steps, each chunk stored then attended, as the engine does."""
    seed = _make_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_len, chunk, num_heads, num_kv_heads, head_dim, block_size = 170, 48, 6, 2, 32, 16
    tables, k_cache, v_cache, (keys,), (values,) = _make_paged(
        [seq_len], num_kv_heads, head_dim, block_size, torch.float32, rng)
    query = torch.randn(seq_len, num_heads, head_dim)
    scale = head_dim ** -0.5
    outs = []
    for start in range(0, seq_len, chunk):
        end = min(seq_len, start + chunk)
        meta = AttentionMetadata.build(tables, [end - start], [end], block_size)
        reference.store_kv(keys[start:end], values[start:end], k_cache, v_cache, meta)
        outs.append(reference.paged_attention(query[start:end], k_cache, v_cache, meta, scale))
    want = reference.dense_causal_attention(query, keys, values, scale)
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("seq_len,q_len,sliding_window,calls", [
    (300, 300, None, 1),   # no prefix: one causal call
    (300, 100, None, 2),   # a prefix: causal over the chunk + the prefix without mask, merged
    (300, 100, 50, 1),     # a window cutting into the keys: one masked call
])
def test_cpu_prefill_runs_the_flash_kernel_not_masked_sdpa(seq_len, q_len, sliding_window, calls, monkeypatch):
    """The CPU path must not fall back to SDPA with a mask (its math path), the cause of slow long prefills."""
    seed = _make_seed()
    meta, k_cache, v_cache, _, _, query = _make_step([seq_len], [q_len], 9, 3, 64, 16, torch.float32, seed)
    seen = []
    flash = reference._cpu_flash
    monkeypatch.setattr(reference, "_cpu_flash", lambda *a, **kw: seen.append(kw) or flash(*a, **kw))
    monkeypatch.setattr(reference.F, "scaled_dot_product_attention",
                        lambda *a, **kw: pytest.fail("masked SDPA called for a prefill chunk"))
    reference.paged_attention(query, k_cache, v_cache, meta, 0.125, sliding_window)
    assert len(seen) == calls
    assert all(kw.get("mask") is None for kw in seen) == (sliding_window is None)


def test_the_probe_accepts_this_torch_and_rejects_a_wrong_kernel(monkeypatch):
    assert reference._cpu_flash_works(torch.float32)
    reference._cpu_flash_works.cache_clear()
    try:
        def wrong(q, k, v, scale, is_causal=False, mask=None):
            return torch.zeros_like(q), torch.zeros(q.shape[:-1])
        monkeypatch.setattr(reference, "_cpu_flash", wrong)
        assert not reference._cpu_flash_works(torch.float32)
        reference._cpu_flash_works.cache_clear()

        def missing(*args, **kwargs):
            raise RuntimeError("no such op")
        monkeypatch.setattr(reference, "_cpu_flash", missing)
        assert not reference._cpu_flash_works(torch.float32)
    finally:
        reference._cpu_flash_works.cache_clear()


def test_store_kv_skips_invalid_slots_and_writes_the_rest():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    meta = AttentionMetadata.build([[1]], [2], [2], 4)
    meta.slot_mapping = torch.tensor([5, -1])
    meta.has_invalid_slots = True
    reference.store_kv(torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0), k_cache, v_cache, meta)
    assert k_cache.view(-1, 1, 2)[5].eq(1).all() and v_cache.view(-1, 1, 2)[5].eq(2).all()
    assert k_cache.sum() == 2 and v_cache.sum() == 4


def test_metadata_rejects_tables_too_short():
    with pytest.raises(ValueError, match="inconsistent"):
        AttentionMetadata.build([[0]], [1], [17], 16)
