"""ALiBi's slopes (kernels.alibi) against transformers' BLOOM's (an implementation nobody here wrote), for head counts
that are powers of two and that are not (the heads past the power of two take the odd steps of twice its sequence);
the attention itself is checked through BLOOM's tiny models in tests/engine/test_engine_vs_hf.py."""

import pytest
import torch

from kernels.alibi import alibi_slopes

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


@pytest.mark.parametrize("num_heads", [1, 2, 4, 6, 8, 12, 16, 32, 112])
def test_the_slopes_are_transformers(num_heads):
    assert torch.equal(alibi_slopes(num_heads), bloom._get_alibi_slopes(num_heads, torch.device("cpu")))
