"""DeepSeek Sparse Attention's Triton kernels (`kernels.triton_dsa`) against the torch reference (`kernels.dsa`),
through Triton's interpreter on the CPU: the indexer's choice is the same set of tokens for every query, and the
attention over a choice is the reference's, over float32, bfloat16 and FP8 caches."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import dsa, reference  # noqa: E402
from kernels import triton_dsa  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from tests.kernels.test_dsa import BLOCK, HEADS, INDEX, INDEX_HEADS, LATENT, LORA, _step  # noqa: E402

CASES = [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
         (torch.float32, reference.FP8_KV_DTYPE, 1e-5)]


def _chosen_sets(choice) -> list[list[int]]:
    chosen, keep = choice
    return [sorted(chosen[t][keep[t]].tolist()) for t in range(chosen.shape[0])]


@pytest.mark.parametrize("dtype,cache_dtype,tol", CASES)
@pytest.mark.parametrize("topk", [3, 5, 64])
def test_the_kernels_choose_and_attend_as_the_reference(dtype, cache_dtype, tol, topk):
    meta, cache, query, index_q, weights = _step(2, cache_dtype)
    query, index_q = query.to(dtype), index_q.to(dtype)
    ours = triton_dsa.choose_tokens(index_q, weights, cache, meta, topk, LATENT, index_scale=INDEX ** -0.5,
                                    k_scale=0.5)
    theirs = dsa.choose_tokens(index_q, weights, cache, meta, topk, LATENT, index_scale=INDEX ** -0.5, k_scale=0.5)
    if dtype == torch.float32:   # bfloat16 scores may order a near tie the other way
        assert _chosen_sets(ours) == _chosen_sets(theirs)
    out = triton_dsa.attend_chosen(query, theirs, cache, meta, 0.3, LORA, LATENT, k_scale=0.5)
    expected = dsa.attend_chosen(query, theirs, cache, meta, 0.3, LORA, LATENT, k_scale=0.5)
    assert out.shape == expected.shape == (query.shape[0], query.shape[1], LORA)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_the_sparse_attention_with_sinks_is_the_references():
    """HY V4's sink logits (one a head) in the kernel's denominator, as the reference puts them."""
    meta, cache, query, index_q, weights = _step(6)
    choice = dsa.choose_tokens(index_q, weights, cache, meta, 5, LATENT, index_scale=0.3, k_scale=0.5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 8.0])
    out = triton_dsa.attend_chosen(query, choice, cache, meta, 0.3, LORA, LATENT, k_scale=0.5, sinks=sinks)
    expected = dsa.attend_chosen(query, choice, cache, meta, 0.3, LORA, LATENT, k_scale=0.5, sinks=sinks)
    plain = dsa.attend_chosen(query, choice, cache, meta, 0.3, LORA, LATENT, k_scale=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_tokens_scored_a_group_at_a_time_choose_as_all_at_once():
    """A budget for the scores of one token at a time (13 positions x 4 B): the groups' choices are the one launch's."""
    meta, cache, query, index_q, weights = _step(4)
    whole = triton_dsa.choose_tokens(index_q, weights, cache, meta, 5, LATENT, index_scale=0.3)
    grouped = triton_dsa.choose_tokens(index_q, weights, cache, meta, 5, LATENT, index_scale=0.3, scores_bytes=60)
    assert _chosen_sets(grouped) == _chosen_sets(whole) and torch.equal(grouped[1], whole[1])


def test_a_short_context_attends_to_all_of_its_tokens_and_nothing_past_them():
    """The decode at 13 and the chunk over 11: with topk 12 the chunk's queries have fewer earlier tokens than the
    choice is wide; the positions past each query are not attended."""
    meta, cache, query, index_q, weights = _step(3)
    chosen, keep = triton_dsa.choose_tokens(index_q, weights, cache, meta, 12, LATENT, index_scale=0.3)
    positions = [5, 6, 7, 8, 9, 10, 12]   # the chunk's 6 queries over 11 tokens, then the decode at 13
    assert chosen.shape == keep.shape == (len(positions), 12)
    for t, pos in enumerate(positions):
        picked = sorted(chosen[t][keep[t]].tolist())
        assert len(picked) == min(pos + 1, 12) and all(p <= pos for p in picked)
        if pos < 12:
            assert picked == list(range(pos + 1))


def test_a_decode_step_told_a_graphs_length_chooses_and_attends_as_told_its_own():
    """A sparse-regime decode graph (`engine.cuda_graphs.capture_lengths`) runs the kernels with its own length (128)
    in `seq_lens_list` and the step's in the device lengths (5 and 100): every position past a token's own scores
    -inf (the short one's, 123 of them, in programs that read nothing), so each token chooses what the reference
    chooses told the step's lengths, and attends alike."""
    import dataclasses

    gen = torch.Generator().manual_seed(8)
    lens, width = [5, 100], 128 // BLOCK
    tables = [[1, 2], list(range(3, 3 + 100 // BLOCK))]
    stored = AttentionMetadata.build(tables, lens, lens, BLOCK)
    cache = torch.zeros(3 + 100 // BLOCK, BLOCK, 1, LATENT + INDEX)
    rows = torch.randn(sum(lens), 1, LATENT + INDEX, generator=gen)
    reference.store_kv(rows, rows, cache, cache, stored)
    own = AttentionMetadata.build(tables, [1, 1], lens, BLOCK)
    wide = torch.zeros(2, width, dtype=own.block_tables.dtype)
    wide[:, :own.block_tables.shape[1]] = own.block_tables
    told = dataclasses.replace(own, block_tables=wide, seq_lens_list=[128, 128], backend_cache={})
    query, index_q = torch.randn(2, HEADS, LATENT, generator=gen), torch.randn(2, INDEX_HEADS, INDEX, generator=gen)
    weights = torch.randn(2, INDEX_HEADS, generator=gen)
    ours = triton_dsa.choose_tokens(index_q, weights, cache, told, 12, LATENT, index_scale=0.3)
    theirs = dsa.choose_tokens(index_q, weights, cache, own, 12, LATENT, index_scale=0.3)
    assert ours[0].shape == (2, 12) and _chosen_sets(ours) == _chosen_sets(theirs)
    assert _chosen_sets(ours)[0] == [0, 1, 2, 3, 4]
    out = triton_dsa.attend_chosen(query, ours, cache, told, 0.3, LORA, LATENT)
    torch.testing.assert_close(out, dsa.attend_chosen(query, theirs, cache, own, 0.3, LORA, LATENT), rtol=1e-5,
                               atol=1e-5)


def _build_for_sm90(warps: int | None = None) -> dict:
    """Compile both kernels for sm_90 at DeepSeek V3.2's shape (bfloat16; the indexer's 64 heads of 128 after the
    576-value latent row, cache blocks of 64; the latent's 512 + 64 for 16 heads a program, on `warps` or its launch's
    `ATTEND_WARPS`) with Triton's own compiler and no device; report whether their dots are tensor-core ones, and
    their stack (spills)."""
    import triton.language as tl

    from tests.kernels.test_triton import _build_kernel_for_sm90

    common = dict(BLOCK_N=triton_dsa.BLOCK_N, BLOCK_SIZE=64, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=False)
    scores, scores_usage = _build_kernel_for_sm90(
        triton_dsa._index_scores_kernel, dict(common, KEY_START=576, HEAD_DIM=128, HEAD_DIM_PAD=128, HEADS_PAD=64),
        {"q_ptr": "bf16", "w_ptr": "fp32", "cache_ptr": "bf16", "scores_ptr": "fp32"}, num_warps=4)
    attend, attend_usage = _build_kernel_for_sm90(
        triton_dsa._sparse_attention_kernel, dict(common, KV_LORA=512, KV_LORA_PAD=512, ROPE=64, ROPE_PAD=64,
                                                  BLOCK_H=triton_dsa.BLOCK_H, SINKS=False),
        {"q_ptr": "bf16", "cache_ptr": "bf16", "out_ptr": "bf16", "chosen_ptr": "i64", "keep_ptr": "i8",
         "sinks_ptr": "fp32"}, num_warps=warps or triton_dsa.ATTEND_WARPS)
    return {"scores": "mma" in scores.asm["ptx"], "attend": "mma" in attend.asm["ptx"],
            "stack": [scores_usage.get("stack", 0), attend_usage.get("stack", 0)]}


def test_the_kernels_build_for_h100():
    """What the interpreter cannot show: both kernels compile for sm_90 at V3.2's shape (the scores' program past its
    token's position a branch that reads nothing; the attention on the warps it is launched with), their dots on the
    tensor cores, nothing spilled."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    assert _compiled_report(_build_for_sm90) == {"scores": True, "attend": True, "stack": [0, 0]}


@pytest.mark.gpu
def test_on_cuda_the_kernels_at_deepseek_v3_2s_shape_equal_the_reference():
    """Compiled on a GPU (TRITON_INTERPRET=0, `bench/gpu_session.sh`'s tests step): a layer of DeepSeek V3.2 on 8 ranks
    (16 query heads over a latent of 512 + 64, an indexer of 64 heads of 128 choosing 2,048), bfloat16, four decodes
    over 4,096 to 6,000 cached tokens and a chunk of 64 new ones: the choice is the reference's (near ties aside:
    at least 99 % of it), the attention over one choice the reference's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kernels import AttentionMetadata

    gen = torch.Generator().manual_seed(7)
    lengths, news, block = [4096, 5000, 6000, 4500, 3000], [1, 1, 1, 1, 64], 16
    per = [-(-n // block) for n in lengths]
    blocks = torch.randperm(sum(per), generator=gen).tolist()
    tables = [blocks[sum(per[:i]):sum(per[:i + 1])] for i in range(len(per))]
    meta = AttentionMetadata.build(tables, news, lengths, block, "cuda")
    cache = torch.randn(sum(per), block, 1, 704, generator=gen).to("cuda", torch.bfloat16)
    tokens = sum(news)
    query = (torch.randn(tokens, 16, 576, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    index_q = torch.randn(tokens, 64, 128, generator=gen).to("cuda", torch.bfloat16)
    weights = (torch.randn(tokens, 64, generator=gen) / 8).cuda()
    ours = triton_dsa.choose_tokens(index_q, weights, cache, meta, 2048, 576, index_scale=128 ** -0.5)
    theirs = dsa.choose_tokens(index_q, weights, cache, meta, 2048, 576, index_scale=128 ** -0.5)
    for mine, want in zip(_chosen_sets(ours), _chosen_sets(theirs)):
        assert len(mine) == len(want) and len(set(mine) & set(want)) >= 0.99 * len(want)
    out = triton_dsa.attend_chosen(query, theirs, cache, meta, 576 ** -0.5, 512, 576)
    expected = dsa.attend_chosen(query, theirs, cache, meta, 576 ** -0.5, 512, 576)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
