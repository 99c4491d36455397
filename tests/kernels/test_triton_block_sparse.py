"""MiniMax M3's block-sparse attention in Triton (`kernels.triton_block_sparse`) against the torch attention the CPU
serves it with (`kernels.block_sparse`), through Triton's interpreter: decode rows over short and long contexts and
prefill chunks over a prefix, GQA groups of 1 to 8, a padded head_dim, index blocks smaller and larger than the
cache's blocks, one and two local blocks, in float32, bfloat16 and float16."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import AttentionMetadata, block_sparse, reference  # noqa: E402
from kernels import triton_block_sparse  # noqa: E402

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _step(seq_lens, query_lens, heads, kv_heads, head_dim, index_dim, cache_block, dtype, seed=3):
    """(query, k_cache, v_cache, index_q, index_cache, meta): every sequence's K/V and indexer keys in scattered cache
    blocks, queries for the new tokens."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // cache_block) for n in seq_lens) + 3
    order = rng.sample(range(num_blocks), num_blocks)
    tables, used = [], 0
    for n in seq_lens:
        tables.append(order[used:used + -(-n // cache_block)])
        used += len(tables[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = [randn(num_blocks, cache_block, kv_heads, head_dim) for _ in range(2)]
    index_cache = randn(num_blocks, cache_block, 1, index_dim)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, cache_block, "cpu")
    return randn(sum(query_lens), heads, head_dim), *caches, randn(sum(query_lens), kv_heads, index_dim), \
        index_cache, meta


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             meta.block_size, meta.query_lens_list, meta.seq_lens_list)


# (sequence lengths, new tokens): decode rows, a chunk over a prefix, a whole prompt; ten blocks or so each
# (the interpreter runs a program a token and block)
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,index_dim,cache_block,index_block,topk,local,steps", [
    (torch.float32, 4, 2, 16, 16, 8, 4, 2, 1, ([40, 9, 30, 1, 17], [1, 1, 20, 1, 17])),
    # a group of 3, head_dim 40 padded to 64, two local blocks
    (torch.float32, 6, 2, 40, 32, 16, 16, 3, 2, ([150, 9, 80, 1], [1, 1, 40, 1])),
    (torch.bfloat16, 8, 1, 64, 16, 16, 32, 4, 1, ([200, 9, 100], [1, 1, 40])),
    (torch.float16, 8, 4, 32, 16, 16, 64, 2, 1, ([300, 130], [1, 60])),   # index blocks of 64 over cache blocks of 16
])
def test_the_kernels_attend_to_the_blocks_the_reference_picks(dtype, heads, kv_heads, head_dim, index_dim, cache_block,
                                                              index_block, topk, local, steps):
    seq_lens, query_lens = steps
    query, k_cache, v_cache, index_q, index_cache, meta = _step(seq_lens, query_lens, heads, kv_heads, head_dim,
                                                                index_dim, cache_block, dtype)
    pick = dict(block_size=index_block, topk_blocks=topk, local_blocks=local)
    scale = head_dim ** -0.5
    ours = triton_block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, meta, scale,
                                                      **pick)
    theirs = block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, _fresh(meta), scale,
                                                 **pick)
    assert ours.dtype == query.dtype and not ours.isnan().any()
    torch.testing.assert_close(ours.float(), theirs.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    dense = reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), _fresh(meta), scale)
    assert (dense - theirs.float()).abs().max() > 0.1   # the choice leaves keys out: it matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_is_read_as_the_torch_attention_reads_it(dtype):
    """K and V in FP8 at their scales (the indexer keys in the model's type, as
    `engine.minimax_m3_config.index_key_dtype` keeps them): the chosen blocks' K/V dequantized as the paged kernels
    read them. bfloat16 takes scales that are
    powers of two, which it holds exactly (the interpreter truncates float32 to bfloat16 where torch rounds)."""
    query, k_cache, v_cache, index_q, index_cache, meta = _step([150, 9, 80, 1], [1, 1, 40, 1], 6, 2, 40, 32, 16, dtype)
    k_scale, v_scale = (0.0625, 0.5) if dtype == torch.bfloat16 else (0.037, 0.11)
    k_fp8, v_fp8 = ((cache.float() / scale).to(reference.FP8_KV_DTYPE) for cache, scale in ((k_cache, k_scale),
                                                                                              (v_cache, v_scale)))
    pick = dict(block_size=16, topk_blocks=3, local_blocks=1, k_scale=k_scale, v_scale=v_scale)
    ours = triton_block_sparse.block_sparse_attention(query, k_fp8, v_fp8, index_q, index_cache, meta, 0.2, **pick)
    theirs = block_sparse.block_sparse_attention(query, k_fp8, v_fp8, index_q, index_cache, _fresh(meta), 0.2, **pick)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


def test_tokens_scored_a_group_at_a_time_choose_as_all_at_once():
    query, k_cache, v_cache, index_q, index_cache, meta = _step([60, 100], [40, 1], 4, 2, 16, 16, 8, torch.float32)
    pick = dict(block_size=8, topk_blocks=3, local_blocks=1)
    whole = triton_block_sparse.choose_blocks(index_q, index_cache, meta, **pick)
    groups = triton_block_sparse.choose_blocks(index_q, index_cache, _fresh(meta), **pick, scores_bytes=4 * 2 * 13 * 7)
    for a, b in zip(whole, groups):
        assert torch.equal(a, b)


def test_a_context_within_the_chosen_blocks_attends_to_every_earlier_key():
    """Up to `topk_blocks` blocks every block is chosen (the query's own included): the dense causal attention, which
    is why the model attends densely there (`engine.models.minimax_m3`)."""
    query, k_cache, v_cache, index_q, index_cache, meta = _step([12, 5, 9], [1, 5, 1], 4, 2, 16, 16, 4, torch.float32)
    ours = triton_block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, meta, 0.25,
                                                      block_size=4, topk_blocks=3, local_blocks=1)
    dense = reference.paged_attention(query, k_cache, v_cache, _fresh(meta), 0.25)
    torch.testing.assert_close(ours, dense, atol=1e-5, rtol=1e-5)


def test_the_blocks_chosen_are_the_references():
    """Each (token, KV head) keeps the blocks the reference's `picked_keys` keeps keys of: its own, the one before it
    (two local blocks) and the best of the rest, never a block past its position (nor one of its keys past it: every
    score here is negative, below what a masked key would score)."""
    seq_lens, query_lens = [40, 9, 30], [1, 1, 20]
    query, k_cache, v_cache, index_q, index_cache, meta = _step(seq_lens, query_lens, 4, 2, 16, 16, 8, torch.float32)
    index_q, index_cache = -index_q.abs(), index_cache.abs()   # every score below 0
    chosen, keep = triton_block_sparse.choose_blocks(index_q, index_cache, meta, block_size=4, topk_blocks=3,
                                                     local_blocks=2)
    token = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        keys = block_sparse.gather_rows(index_cache, reference.context_slots(meta, [i], s_len), 1.0)[..., 0, :]
        for p in range(s_len - q_len, s_len):
            picked = block_sparse.picked_keys(index_q[None, token:token + 1], keys, torch.tensor([[p]]), 4, 3, 2)
            for head in range(2):
                theirs = sorted({j // 4 for j in picked[0, head, 0].nonzero().flatten().tolist()})
                ours = sorted(chosen[token, head][keep[token, head] != 0].tolist())
                assert ours == theirs, (i, p, head)
            token += 1


def _build_for_sm90() -> dict:
    """Compile both kernels for sm_90 at MiniMax M3's shape (bfloat16, heads of 128, 16 query heads a KV head, 4 KV
    heads, index blocks of 128 over cache blocks of 16) with Triton's own compiler and no device; report whether
    their dots are tensor-core ones."""
    import triton.language as tl

    from tests.kernels.test_triton import _build_kernel_for_sm90

    common = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32")
    scores, _ = _build_kernel_for_sm90(triton_block_sparse._block_scores_kernel,
                                       dict(common, INDEX_BLOCK=128, BLOCK_N=64, HEADS_PAD=16),
                                       {"q_ptr": "bf16", "index_ptr": "bf16", "scores_ptr": "fp32"}, num_warps=4)
    attend, _ = _build_kernel_for_sm90(triton_block_sparse._chosen_blocks_kernel,
                                       dict(common, GROUP=16, GROUP_PAD=16, INDEX_BLOCK=128, BLOCK_N=64, KV_FP8=False),
                                       {"q_ptr": "bf16", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16",
                                        "out_ptr": "bf16", "chosen_ptr": "i64", "keep_ptr": "i8"}, num_warps=4)
    return {name: "mma" in built.asm["ptx"] for name, built in (("scores", scores), ("attend", attend))}


def test_the_kernels_build_for_h100():
    """What the interpreter cannot show: both kernels compile for sm_90 at MiniMax M3's shape, their dots on the
    tensor cores."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    assert _compiled_report(_build_for_sm90) == {"scores": True, "attend": True}


@pytest.mark.gpu
def test_on_cuda_the_kernels_at_minimax_m3s_shape_equal_the_torch_attention():
    """Compiled on a GPU (TRITON_INTERPRET=0, `bench/gpu_session.sh`'s tests step): a sparse layer of MiniMax M3 on 4
    ranks (16 query heads over 2 KV heads of 128 here, an indexer key of 128, blocks of 128, the best 16 a query),
    float32 (no near tie between blocks' scores reorders the choice), four decodes over 4,096 to 6,000 cached tokens and
    a chunk of 64 new ones: the torch attention's output."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    query, k_cache, v_cache, index_q, index_cache, meta = _step([4096, 5000, 6000, 4500, 3000], [1, 1, 1, 1, 64], 16,
                                                                2, 128, 128, 16, torch.float32, seed=7)
    query, k_cache, v_cache, index_q, index_cache = (t.cuda() for t in (query, k_cache, v_cache, index_q, index_cache))
    cuda_meta = AttentionMetadata.build(meta.block_tables.tolist(), meta.query_lens_list, meta.seq_lens_list,
                                        meta.block_size, "cuda")
    pick = dict(block_size=128, topk_blocks=16, local_blocks=1)
    ours = triton_block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, cuda_meta,
                                                      128 ** -0.5, **pick)
    theirs = block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, _fresh(cuda_meta),
                                                 128 ** -0.5, **pick)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# (sequence lengths, new tokens): a decode step, and chunks beside decode rows (a context shorter than a block, one
# ending a block, a prompt whole)
@pytest.mark.parametrize("steps", [([40, 9, 30, 17, 3], [1, 1, 1, 1, 1]),
                                   ([40, 9, 30, 1, 17, 24], [1, 1, 20, 1, 17, 9])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qsa_attends_through_the_kernels_to_the_tokens_its_torch_form_keeps(steps, dtype):
    """Qwen4-Exp's QSA on CUDA (`kernels.qsa.qsa_blocks`: each query's best complete blocks of `ratio` positions,
    one choice for every head, and the block after its last complete one; `attend_blocks` over them) against
    `qsa_attention`'s torch form (a choice of the tokens, attended in float32)."""
    from kernels import qsa

    seq_lens, query_lens = steps
    query, k_cache, v_cache, _, index_cache, meta = _step(seq_lens, query_lens, 4, 2, 16, 16, 8, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    index_q = torch.randn(sum(query_lens), 3, 16, generator=gen).to(dtype)   # 3 indexer heads
    select = dict(ratio=4, topk_blocks=2, key_norm=(torch.randn(16, generator=gen) * 0.1, 1e-6),
                  cos_sin_cache=torch.randn(64, 8, generator=gen).to(dtype), rotary_dim=8)
    chosen, keep = qsa.qsa_blocks(index_q, index_cache, meta, **select)
    assert chosen.shape == keep.shape == (sum(query_lens), 3)   # two blocks and the one after the last complete
    ours = triton_block_sparse.attend_blocks(query, k_cache, v_cache, chosen, keep, meta, 0.25, block_size=4)
    theirs = qsa.qsa_attention(query, k_cache, v_cache, index_q, index_cache, _fresh(meta), 0.25, **select)
    assert ours.dtype == query.dtype and not ours.isnan().any()
    torch.testing.assert_close(ours.float(), theirs.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    dense = reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), _fresh(meta), 0.25)
    assert (dense - theirs.float()).abs().max() > 0.1   # the choice leaves keys out: it matters


@pytest.mark.slow   # ~40 s through the interpreter; the kernel's exactness is above
@pytest.mark.usefixtures("one_thread")
def test_qwen4_exp_attending_through_the_kernels_answers_as_transformers(tmp_path, builtin_path, monkeypatch):
    """Qwen4-Exp's tiny model (QSA blocks of 4, 2 a query) with every QSA step through `qsa_blocks` and
    `attend_blocks` (its CUDA path; the interpreter here), prompts past the blocks it may choose: transformers'
    greedy tokens."""
    from engine.models import qwen4_exp
    from kernels import qsa
    from tests.engine.test_engine_vs_hf import QWEN4_EXP
    from tests.kernels.test_triton_gated_delta import assert_prefills_through

    def through_kernels(query, key_cache, value_cache, index_q, index_cache, meta, scale, *, ratio, k_scale=1.0,
                        v_scale=1.0, **select):
        chosen, keep = qsa.qsa_blocks(index_q, index_cache, meta, ratio=ratio, **select)
        return triton_block_sparse.attend_blocks(query, key_cache, value_cache, chosen, keep, meta, scale,
                                                 block_size=ratio, k_scale=k_scale, v_scale=v_scale)

    assert_prefills_through(tmp_path, builtin_path, monkeypatch, (qwen4_exp, through_kernels, "qsa_attention"),
                            "qwen4_exp_text", QWEN4_EXP)


@pytest.mark.gpu
def test_on_cuda_qsa_equals_its_torch_form_on_the_cpu():
    """Compiled on a GPU: QSA (blocks of 64, the best 8 a query, 4 indexer heads of 64; 16 query heads over 2 KV heads
    of 128) over four decodes of 3,000 to 6,000 cached tokens and a chunk of 64 new ones, float32: `qsa_attention` on
    CUDA (`qsa_blocks`, `attend_blocks`) against its torch form on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kernels import qsa

    query, k_cache, v_cache, _, index_cache, meta = _step([4096, 5000, 6000, 3000, 4500], [1, 1, 1, 1, 64], 16, 2,
                                                          128, 64, 16, torch.float32, seed=8)
    gen = torch.Generator().manual_seed(9)
    index_q = torch.randn(len(query), 4, 64, generator=gen)
    select = dict(ratio=64, topk_blocks=8, key_norm=(torch.randn(64, generator=gen) * 0.1, 1e-6),
                  cos_sin_cache=torch.randn(8192, 64, generator=gen), rotary_dim=64)
    theirs = qsa.qsa_attention(query, k_cache, v_cache, index_q, index_cache, _fresh(meta), 128 ** -0.5, **select)
    cuda_meta = AttentionMetadata.build(meta.block_tables.tolist(), meta.query_lens_list, meta.seq_lens_list,
                                        meta.block_size, "cuda")
    select = {**select, "key_norm": (select["key_norm"][0].cuda(), 1e-6),
              "cos_sin_cache": select["cos_sin_cache"].cuda()}
    ours = qsa.qsa_attention(*(t.cuda() for t in (query, k_cache, v_cache, index_q, index_cache)), cuda_meta,
                             128 ** -0.5, **select)
    torch.testing.assert_close(ours.cpu(), theirs, atol=1e-4, rtol=1e-4)
