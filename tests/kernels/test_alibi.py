"""ALiBi's slopes (kernels.alibi) against transformers' BLOOM's and MPT's (implementations nobody here wrote), for
head counts that are powers of two and that are not (BLOOM's heads past the power of two take the odd steps of twice
its sequence; MPT's interleave the power above); the attention itself is checked through BLOOM's and MPT's tiny models
in tests/engine/test_engine_vs_hf.py."""

import pytest
import torch

from kernels.alibi import alibi_slopes

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


@pytest.mark.parametrize("num_heads", [1, 2, 4, 6, 8, 12, 16, 32, 112])
def test_the_slopes_are_transformers(num_heads):
    assert torch.equal(alibi_slopes(num_heads), bloom._get_alibi_slopes(num_heads, torch.device("cpu")))


@pytest.mark.parametrize("num_heads", [1, 2, 4, 6, 8, 12, 16, 32, 56])
def test_mpts_slopes_are_transformers(num_heads):
    """MPT's (its own spread over the power of two at or above the heads, odd-indexed ones first where it is above)."""
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    from kernels.alibi import mpt_alibi_slopes

    bias = mpt.build_mpt_alibi_tensor(num_heads, 4, 8)   # [heads, 1, 4]: slope x (j - 3)
    assert torch.equal(-bias[:, 0, -2], mpt_alibi_slopes(num_heads, 8.0))
