"""kernels.cpu_linear: packed oneDNN linears equal F.linear, and the engine's choice of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import PackedLinear, pack_linears, use_packed_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (37, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    x = torch.randn(*shape, generator=gen)
    layer = PackedLinear(weight, b)
    out = layer(x)
    assert out.shape == (*shape[:-1], 80)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_a_strided_input_and_keeps_no_dense_weight():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=gen)
    x = torch.randn(9, 96, generator=gen)[:, 16:48]          # a column slice: rows are not contiguous
    layer = PackedLinear(weight, None)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert list(layer.parameters()) == [] and layer.state_dict() == {}
    assert layer.nbytes == 64 * 32 * 4


def _tiny_llama(tie: bool):
    from engine.model_config import ModelConfig
    from engine.models import build_model

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=tie)
    model = build_model(config, torch.float32, "cpu")
    model.init_random(seed=3)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_pack_linears_swaps_every_linear_and_keeps_the_logits(tie):
    model = _tiny_llama(tie)
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    before = model.compute_logits(hidden)
    layer_input = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    mlp_before = model.layers[1].mlp(layer_input)
    # per layer: qkv, o, gate_up, down; plus the LM head (its own, or a packed copy of the tied table)
    assert pack_linears(model, min_elements=0) == 4 * 2 + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert model.embed_tokens.weight.layout == torch.strided   # the lookup table stays dense
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.layers[1].mlp(layer_input), mlp_before, rtol=1e-5, atol=1e-5)


def test_small_weights_stay_on_torch_linears():
    """A packed call's fixed cost outweighs what it saves on a small weight: only large ones are packed."""
    model = _tiny_llama(tie=False)
    sizes = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert pack_linears(model, min_elements=2048) == sum(n >= 2048 for n in sizes.values()) > 0
    for name, module in model.named_modules():
        if name in sizes:
            assert isinstance(module, PackedLinear) == (sizes[name] >= 2048), name
    assert pack_linears(_tiny_llama(tie=True)) == 0   # the default threshold: every weight here is small


def test_choice_of_packed_linears(monkeypatch):
    monkeypatch.delenv("CLIFFGUARD_CPU_LINEAR", raising=False)
    assert use_packed_linears("cpu", torch.float32)
    assert not use_packed_linears("cpu", torch.float16)
    assert not use_packed_linears("cuda", torch.float32)
    assert use_packed_linears("cpu", torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setenv("CLIFFGUARD_CPU_LINEAR", "torch")
    assert not use_packed_linears("cpu", torch.float32)
    monkeypatch.setenv("CLIFFGUARD_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="CLIFFGUARD_CPU_LINEAR.*'mkl'.*onednn, torch"):
        use_packed_linears("cpu", torch.float32)


def test_a_onednn_that_cannot_run_the_packed_product_falls_back_to_torch(monkeypatch):
    from kernels import cpu_linear

    def broken(*args, **kwargs):
        raise RuntimeError("mkldnn linear: no implementation for this CPU")

    monkeypatch.delenv("CLIFFGUARD_CPU_LINEAR", raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken, raising=False)
    cpu_linear._packed_linear_works.cache_clear()
    try:
        assert not use_packed_linears("cpu", torch.float32)
    finally:
        monkeypatch.undo()
        cpu_linear._packed_linear_works.cache_clear()
    assert use_packed_linears("cpu", torch.float32)
