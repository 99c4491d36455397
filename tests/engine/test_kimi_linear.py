"""Kimi Linear's config as `ModelConfig` reads it (`engine.kimi_linear_config`) against transformers' own
`KimiLinearConfig` on the keys its checkpoints use; the per-channel gated delta rule against transformers' KDA
reference, chunked and a token at a time; what is refused by key. (Greedy parity with transformers' model:
tests/engine/test_engine_vs_hf.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.model_config import ModelConfig
from kernels import gated_delta

# the keys Kimi-Linear-48B-A3B's config.json uses (`attribute_map`'s names, `linear_attn_config`), at a small size
CHECKPOINT = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 16, "num_experts_per_token": 4,
              "num_expert_group": 4, "topk_group": 2, "num_shared_experts": 2, "moe_renormalize": True,
              "routed_scaling_factor": 2.446, "first_k_dense_replace": 2, "kv_lora_rank": 32, "q_lora_rank": None,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "model_max_length": 4096,
              "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "head_dim": 16,
                                     "num_heads": 4, "short_conv_kernel_size": 3},
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_a_checkpoints_config_reads_as_transformers_reads_it():
    """Layer kinds from the 1-based `kda_layers` / `full_attn_layers`, the KDA shape, experts and groups under
    `attribute_map`'s names, the dense layers, the context: each what `KimiLinearConfig` makes of the same file; the
    state a sequence holds per KDA layer: its convolution's last 2 inputs over q, k and v and a float32 state per
    head."""
    import transformers

    ours = ModelConfig.from_hf_config(CHECKPOINT)
    theirs = transformers.KimiLinearConfig(**{k: v for k, v in CHECKPOINT.items() if k != "architectures"})
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.kv_layers == (3, 7) and ours.max_position_embeddings == theirs.max_position_embeddings == 4096
    shape = ours.state_layers
    assert (shape.num_heads, shape.head_dim, shape.conv_kernel) == (theirs.linear_num_heads, theirs.linear_head_dim,
                                                                     theirs.linear_conv_kernel_dim)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_groups) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, (theirs.n_group, theirs.topk_group))
    assert ours.shared_expert_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts
    assert [ours.is_sparse_layer(i) for i in range(8)] == [t == "sparse" for t in theirs.mlp_layer_types]
    assert ours.norm_topk_prob and ours.routed_scaling_factor == 2.446 and ours.mla.q_lora_rank == 0
    assert ours.state_bytes_per_seq(torch.bfloat16) == 6 * (3 * 64 * 2 * 2 + 4 * 16 * 16 * 4)


def test_the_per_channel_rule_is_transformers_kda_chunked_and_stepped():
    """`gated_delta.chunked` with a decay per key channel (over a chunk's edge, from a state) and `recurrent_step`
    one token at a time: transformers' `chunk_kimi_delta_attention` and `recurrent_kimi_delta_attention` (q and k
    L2-normed in the kernel), to float32's rounding."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kda

    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 150, 3, 16, 8
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, H, V, generator=gen)
    g, beta = -torch.rand(T, H, K, generator=gen) * 0.5, torch.rand(T, H, generator=gen)
    state = torch.randn(H, K, V, generator=gen) * 0.1
    out, last = gated_delta.chunked(q, k, v, g, beta, state)
    want, want_last = kda.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                     initial_state=state[None], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, want_last[0], rtol=1e-5, atol=1e-5)
    one, one_state = gated_delta.recurrent_step(q[:2], k[:2], v[:2], g[:2], beta[:2], state.expand(2, H, K, V))
    for i in range(2):
        want, want_state = kda.recurrent_kimi_delta_attention(q[None, i:i + 1], k[None, i:i + 1], v[None, i:i + 1],
                                                              g[None, i:i + 1], beta[None, i:i + 1],
                                                              initial_state=state[None], output_final_state=True,
                                                              use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(one[i], want[0, 0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one_state[i], want_state[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,named", [
    ({"linear_attn_config": {"full_attn_layers": [], "kda_layers": list(range(1, 9))}},
     r"^layer_types: Kimi Linear with no full attention layer"),
    ({"layer_types": ["linear_attention"] * 7 + ["mamba"]}, r"^layer_types: linear_attention or full_attention"),
    ({"linear_attn_config": {"short_conv_kernel_size": 1}}, r"^linear_conv_kernel_dim: must be >= 2"),
    ({"mlp_layer_types": ["sparse", "dense"] + ["sparse"] * 6}, r"^mlp_layer_types: dense layers first"),
])
def test_what_is_not_served_is_refused_naming_the_key(change, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf_config({**CHECKPOINT, **change})


def test_tensor_parallelism_splits_the_kda_heads_or_is_refused_naming_the_key():
    """Each rank holds its share of the KDA heads (their state too); a size that does not divide them is refused by
    its key before a rank starts."""
    from engine.parallel import check_tensor_parallel

    config = ModelConfig.from_hf_config({**CHECKPOINT, "num_attention_heads": 8, "num_key_value_heads": 8})
    check_tensor_parallel(config, 4)
    assert config.state_bytes_per_seq(torch.float32, 4) == 6 * (3 * 16 * 2 * 4 + 1 * 16 * 16 * 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: .*8 does not divide the model's 4 Kimi Delta"):
        check_tensor_parallel(config, 8)


def test_the_plan_counts_what_the_model_holds_in_bfloat16(tmp_path, builtin_path):
    """In bfloat16 the router (weight and correction bias) and each KDA layer's dt_bias stay float32, as transformers
    holds them: the bytes the engine reports (the capacity plan's count) are the bytes its parameters take."""
    from engine.llm_engine import LLMEngine
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import TINY_MODELS

    overrides = next(o for arch, o in TINY_MODELS if arch == "kimi_linear")
    engine = LLMEngine.from_args(str(make_tiny_model(tmp_path / "kimi", "kimi_linear", builtin_path, **overrides)),
                                 dtype="bfloat16", block_size=8, num_blocks=16, progress=False)
    kda = engine.model.layers[0].linear_attn
    assert kda.dt_bias.dtype == torch.float32 and kda.A_log.dtype == torch.bfloat16
    assert engine.weights_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
