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
from tests.kernels.test_dsa import INDEX, LATENT, LORA, _step  # noqa: E402

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
