"""Greedy outputs of the engine equal Hugging Face transformers' greedy `generate`: preemption,
chunking and batching never change what a request generates.

The default run checks tiny random models of each architecture; the `slow` run (`make test-slow`) checks the
builtin model once as served, and sweeps it with more prompts and longer outputs under every block
size x preemption mode x prefix-cache state, in a pool small enough that preemption happens.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import PREEMPTION_MODES, CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.models import build_model
from engine.weights import iter_weights
from engine.sampling import SamplingParams
from kernels import BLOCK_SIZES
from kernels.cpu_linear import CPU_LINEARS, PackedLinear
from tests.conftest import assert_all_free, make_tiny_model, price_preemption

NEW_TOKENS = 20

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "Explain in two sentences how a paged KV cache avoids memory fragmentation in LLM serving, "
    "and why continuous batching benefits from it.",
    "List three prime numbers.",
    "Translate 'good morning' into German, French and Spanish. Answer with a short list, nothing else. "
    "Then say which of the three languages you find the easiest and why, in one sentence.",
    "def fib(n):",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away into "
    "the forest, where it meets an owl who asks it riddles until dawn.",
]


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """transformers' greedy continuation of one prompt (batch of one: no padding involved)."""
    model.generation_config.eos_token_id = eos_ids  # None: run the full length
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _truncate_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, tok in enumerate(ids):
        if tok in eos:
            return ids[: i + 1]
    return ids


@pytest.fixture(scope="module")
def smollm2_engine(builtin_path):
    # 364 blocks of 16 tokens: 256 MiB of SmolLM2's float32 K/V (46,080 B/token)
    engine = LLMEngine.from_args(str(builtin_path), dtype="float32", max_num_seqs=16, num_blocks=364, progress=False)
    yield engine
    assert_all_free(engine)


@pytest.mark.slow   # model-size, ~50 s (transformers' load of the GGUF is 30 s of it); the Llama forward is
# token-identical on tiny models below, and the conversion's config and tokenizer are checked in test_weights.py
def test_builtin_smollm2_matches_transformers(smollm2_engine, hf_smollm2):
    engine = smollm2_engine
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) >= 6  # different lengths, submitted together
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    eos = sorted(engine.eos_token_ids)
    for prompt, out in zip(prompts, outs):
        want = _truncate_at_eos(_hf_greedy(hf_smollm2, prompt, NEW_TOKENS, eos), set(eos))
        assert out.outputs[0].token_ids == want, tok.decode(prompt)
    assert_all_free(engine)


# YaRN from an original context of 32 positions: the prompts and outputs below run far past it
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
# Qwen3-MoE: 8 experts of 32, 2 a token (renormalised), every layer sparse unless the case says otherwise
QWEN3_MOE = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# Gemma 3: sliding layers (a window of 8 positions, which the prompts and outputs outgrow) around a full one
# with its own rope (linear scaling, as the larger Gemma 3 models'), q.k scaled by 1 / sqrt(24)
GEMMA3 = dict(num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})


MIXTRAL = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=3, num_key_value_heads=4, head_dim=16,
               sliding_window=8, tie_word_embeddings=True, rope_parameters=YARN)
GEMMA2 = dict(num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=5.0)
# GPT-OSS: 4 experts of 48, 2 a token; a window of 8 on its sliding layers; its own YaRN (truncate false); a clamp
# that bends these activations
GPT_OSS = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
               num_hidden_layers=3, swiglu_limit=1.5)
QWEN2_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 mlp_only_layers=[1], num_key_value_heads=4)
# DeepSeek: 8 experts of 32 in 2 groups (a token's from 1), 2 a token, beside shared experts; layer 0 dense; latent
# attention over a latent of 32 and a rotated key of 8 (heads of 16 + 8, values of 16)
DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_group=2, topk_group=1, num_hidden_layers=3)
# Phi-4-multimodal's image and audio embedders, tiny
PHI4_MM_TOWERS = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2),
                      audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2))
# LongCat-Flash's shape on the tiny model (`num_layers` 2: four sublayers)
LONGCAT = dict(num_layers=2, num_hidden_layers=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=8, zero_expert_num=4, moe_topk=3,
               expert_ffn_hidden_size=32, routed_scaling_factor=2.5, num_key_value_heads=4, pad_token_id=0)
# MiniCPM3's latent attention on the tiny model
MINICPM3 = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                num_key_value_heads=4, dim_model_base=16, pad_token_id=0)
# Ling 3 (Ling-3.0-Flash's kind): KDA and latent attention layers, the first MLP dense, 8 experts of 32 in 2 groups
BAILING = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
               mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=96, moe_intermediate_size=32,
               num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, head_dim=16, num_key_value_heads=4, pad_token_id=0)
# Falcon-H1: parallel hybrid layers, its muP multipliers each its own value
FALCON_H1 = dict(num_hidden_layers=3, mamba_n_heads=4, mamba_d_ssm=64, mamba_d_head=16, mamba_d_state=16,
                 mamba_n_groups=2, mamba_chunk_size=16, attention_in_multiplier=0.8, key_multiplier=1.3,
                 attention_out_multiplier=0.9, ssm_in_multiplier=1.25, ssm_out_multiplier=0.7,
                 ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], mlp_multipliers=[0.6, 1.4], embedding_multiplier=2.0,
                 lm_head_multiplier=0.5)
# Laguna: three layers, sliding and full
LAGUNA = dict(num_hidden_layers=3, head_dim=16, num_attention_heads_per_layer=[4, 8, 4], num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              moe_router_logit_softcapping=2.0, moe_routed_scaling_factor=1.5)
# Youtu-LLM: DeepSeek V3's latent attention (a KV "head" per query head, as YoutuConfig keeps them) and dense MLPs
YOUTU = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16)
# Mistral Small 4: DeepSeek V3's latent attention (as DEEPSEEK) with every query scaled by its position (floor(p / 16)
# moves it), YaRN x 4 from 16 positions with DeepSeek's mscales; the softmax router in 2 groups (a token's from 1)
MISTRAL4 = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_group=2, topk_group=1, num_hidden_layers=3, pad_token_id=0, rope_parameters={
                    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                    "llama_4_scaling_beta": 0.5})
# DeepSeek V3.2: DEEPSEEK's shape, its attention sparse: an indexer of 16 heads of 16 picks each query's best 8 earlier
# tokens (the prompts and outputs reach 56), a tie at the boundary too rare to matter
DEEPSEEK_V32 = {**DEEPSEEK, "q_lora_rank": 48, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8}
# A.X-K2: V3.2's shape (no groups: A.X-K2-Light's), its gated norms through a bottleneck of 8
AXK2 = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48, index_n_heads=16,
            index_head_dim=16, index_topk=8, gated_norm_rank=8, num_hidden_layers=3, pad_token_id=0)
# HY V4: V3.2's shape in 3 streams, each head gated and with a sink, layer 2 reusing layer 1's indexer choice, the
# routed experts' SwiGLU clamped at 1 (where the tiny model's activations reach)
HYV4 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48, index_n_heads=16, index_head_dim=16, index_topk=8,
            hc_mult=3, swiglu_limit=1.0, num_hidden_layers=3, pad_token_id=0)
# DeepSeek V4: heads of 32 (the last 8 rotated), a window of 8, an HCA layer (entries of 8 positions), two CSA layers
# (entries of 4, each query's best 3 by an indexer of 8 heads) and a sliding one; a hash layer, 2 streams
DEEPSEEK_V4 = dict(moe_intermediate_size=32, num_hidden_layers=4, head_dim=32, q_lora_rank=48, num_experts_per_tok=2,
                   n_routed_experts=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
                   sliding_window=8, compress_rates={"compressed_sparse_attention": 4,
                                                     "heavily_compressed_attention": 8},
                   layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                                "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                   hc_mult=2, hc_sinkhorn_iters=5, partial_rotary_factor=0.25, swiglu_limit=1.0, pad_token_id=0)
BEAM = dict(num_hidden_layers=6, head_dim=16, sliding_window=8, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["dense"] + ["sparse"] * 5,
            layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"],
            pad_token_id=0)
COHERE2_MOE = dict(num_hidden_layers=5, head_dim=16, sliding_window=8, first_k_dense_replace=1,
                   prefix_dense_intermediate_size=96, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   num_shared_experts=1, pad_token_id=0)
GLM4_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                n_group=2, topk_group=1, num_hidden_layers=3, pad_token_id=0)
# Llama 4: chunks of 8 positions (the prompts and outputs cross several) on the rotating layers, q/k L2-normed after
# the interleaved rotary; every 4th layer NoPE with its queries' temperature (a floor of 4 positions, so it moves);
# 4 experts of 48, the top one a token scaling its input, beside a shared expert; Scout's llama3 rope (its low and
# high frequency factors equal)
LLAMA4 = dict(intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
              num_hidden_layers=4, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 16})
# Ministral 3: its YaRN (mscale and mscale_all_dim) from 8 positions, so the queries' scaling (beta 0.5) moves every
# 8 positions of the prompts and outputs
MINISTRAL3 = dict(head_dim=16, rope_parameters={
    "type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
    "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5, "max_position_embeddings": 512})
JAMBA = dict(num_hidden_layers=4, intermediate_size=96, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
             attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, mamba_dt_rank=8,
             pad_token_id=0)
MINIMAX = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "linear_attention"], head_dim=16, num_local_experts=4,
               num_experts_per_tok=2, intermediate_size=32, block_size=32, full_attn_alpha_factor=1.3,
               full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.7, linear_attn_beta_factor=1.2,
               mlp_alpha_factor=1.1, mlp_beta_factor=0.9, pad_token_id=0)
MINIMAX_M3 = dict(num_hidden_layers=3, layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
                  mlp_layer_types=["dense", "sparse", "sparse"], head_dim=16, intermediate_size=32,
                  dense_intermediate_size=96, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                  index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
                  swiglu_limit=2.0, pad_token_id=0)
ZAMBA2 = dict(num_hidden_layers=6, layers_block_type=["linear_attention", "hybrid", "hybrid", "linear_attention",
                                                  "hybrid", "hybrid"], mamba_d_state=16, n_mamba_heads=4,
              mamba_ngroups=2, chunk_size=16, adapter_rank=8, num_key_value_heads=4, pad_token_id=0)
QWEN3_5 = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=8)
GRANITE = dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.5, logits_scaling=2.0,
               tie_word_embeddings=True)
# Granite 4's -H models: Mamba-2 layers (4 heads of 32, a state of 16, B and C in 2 groups; prompts past its chunk of
# 16 and past a step's 64 tokens) beside an attention one, Granite's scalars
GRANITE4_H = {**GRANITE, "layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3, "num_local_experts": 0,
              "shared_intermediate_size": 96, "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_n_groups": 2,
              "mamba_chunk_size": 16, "position_embedding_type": "rope"}
# Gemma 4: sliding layers (heads of 16, a window of 8) around full ones with heads of 32 and one KV head of their
# own, V their K projection (k_eq_v) and a proportional rope turning half of each head; soft-capped logits (an untied
# head: a tied one repeats the prompt's last token); then the same with 4 experts (2 a token) beside each MLP, full
# layers with their own v_proj and KV heads
GEMMA4 = dict(num_hidden_layers=4, tie_word_embeddings=False, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0, final_logit_softcapping=3.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                  "rope_theta": 1000000.0}})
GEMMA4_MOE = {**GEMMA4, "attention_k_eq_v": False, "final_logit_softcapping": None,
              "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
# Gemma 4's E2B / E4B: per-layer inputs of 16 (a table of their own), the last 2 of 6 layers reading the K/V of the
# last sliding and full layers before them, with MLPs twice as wide
GEMMA4_E = {**GEMMA4, "num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3,
            "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True}

# Gemma 3n: Gemma 4's E models' per-layer inputs and shared K/V layers under AltUp's four streams and LAuReL, the
# first two layers' MLP gates sparse
GEMMA3N = {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"] * 3, "hidden_size_per_layer_input": 16,
           "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2, "laurel_rank": 8,
           "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0]}

# Lara Mini: Gated DeltaNet layers beside sliding (rotating) and full (NoPE) attention, experts on every layer beside
# an ungated shared expert
LARA_MINI = {"num_hidden_layers": 5, "head_dim": 16, "sliding_window": 8, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48,
             "pad_token_id": 0}

# Qwen4-Exp: Gated DeltaNet layers (two with PLE: n-gram tables in 3 stored parts, a convolution over 3 streams)
# beside QSA attention (blocks of 4 tokens, 2 chosen: past 11 tokens the indexer picks), the rotary over half of
# each head and the indexer's narrower heads
QWEN4_EXP = {"num_hidden_layers": 5, "head_dim": 16, "pad_token_id": 0,
             "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "linear_attention",
                             "indexed_attention"],
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
             "shared_expert_intermediate_size": 48, "hc_count": 3, "hc_lowrank": 8, "ple_layer_ids": [1, 3],
             "ple_embed_dim": 32, "heads_per_ngram": 2, "ngram_vocab_size_base": 1000, "split_ngram_parts": 3,
             "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
             "indexer_compress_ratio": 4,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}

# Dory: nGPT layers (unit-length norms, interpolating residuals), 2 input layers, 2 recurrent ones run twice, 2 output
# ones (8 virtual layers, each its own K/V), sliding (a window of 8) and full layers of their own rope bases; saved
# in the release's layout of an attention and an mlp block a layer
DORY = {"num_hidden_layers": 6, "n_input_layers": 2, "n_output_layers": 2, "n_recurrent_loops": 2, "head_dim": 16,
        "sliding_window": 8, "pad_token_id": 0}

# ZAYA1: CCA attention (q/k through two short convolutions, half of each value the previous token's) beside a state a
# layer, one routed expert a token (or the skip class) under the router MLP whose state passes between layers, a
# float32 residual stream; an untied, biased head; then a sliding layer (a window of 8) and longer convolutions
ZAYA = {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, "router_hidden_size": 16,
        "tie_word_embeddings": False, "lm_head_bias": True, "pad_token_id": 0}
ZAYA_SLIDING = {**ZAYA, "layer_types": ["hybrid", "hybrid_sliding", "hybrid"], "sliding_window": 8, "cca_time0": 3}

# Phi-3.5-MoE's LongRoPE on the tiny model: a factor a frequency pair of each set, an mscale each, the original
# context the whole one (so the short set serves)
PHIMOE_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
               "short_factor": [1.0 + 0.2 * i for i in range(8)], "long_factor": [2.0 + 1.5 * i for i in range(8)],
               "short_mscale": 1.3, "long_mscale": 1.7}
COMPASS = dict(num_hidden_layers=4, sliding_window=8, logit_scale=0.5,
               layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [2, 3, 3]}, "full_attention": None})
TINY_MODELS = [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("mistral", dict(sliding_window=12, head_dim=32)),
    ("qwen3", dict(head_dim=32)),
    ("qwen3", dict(tie_word_embeddings=True, attention_bias=True, rope_parameters=YARN,
                   max_position_embeddings=40)),   # YaRN serves 32 x 4 positions: the outputs run past 40
    ("llama", dict(rope_parameters={**YARN, "beta_fast": 16, "beta_slow": 2, "factor": 8.0})),
    ("qwen3_moe", QWEN3_MOE),
    ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                   "num_hidden_layers": 4, "rope_parameters": YARN}),
    ("gemma3", GEMMA3),
    ("gemma3", {**GEMMA3, "tie_word_embeddings": False, "num_key_value_heads": 4, "hidden_activation": "silu",
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {**YARN, "rope_theta": 1000000.0}}}),
    ("gemma4", GEMMA4),
    ("gemma4", GEMMA4_MOE),
    ("gemma4", GEMMA4_E),
    ("gemma3n_text", GEMMA3N),
    ("lara_mini", LARA_MINI),
    ("qwen4_exp_text", QWEN4_EXP),
    ("dory", DORY),
    ("zaya", ZAYA),
    ("zaya", ZAYA_SLIDING),
    ("llama", dict(hidden_act="gelu_pytorch_tanh")),   # the CPU's flat forward runs SiLU: the modules run this
    # a linear scaling serves max_position_embeddings x factor (vLLM's reading): the outputs run past 40
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=40)),
    # dynamic NTK, served up to max_position_embeddings, where its base has not moved yet
    ("qwen2", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=128)),
    # Qwen's sliding layers (a window of 8): Qwen2's from max_window_layers on, Qwen3's as layer_types says (the
    # flat CPU forward gives each layer its own window), Qwen3-MoE's all
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3)),
    ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"])),
    ("qwen3_moe", {**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}),
    # Mixtral: 8 experts of 48 (its intermediate_size), 2 a token; then 4 of 3 a token, a window of 8
    ("mixtral", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, head_dim=32)),
    ("mixtral", MIXTRAL),
    # Phi-3: q/k/v and gate/up stored fused; then grouped KV heads, a window of 8 and a tied head
    ("phi3", dict(num_key_value_heads=4, pad_token_id=0)),
    ("phi3", dict(sliding_window=8, tie_word_embeddings=True, pad_token_id=0)),
    # Phi-4-multimodal's text model: Phi-4-mini's (a rotary over 0.75 of each head, tied embeddings; its longrope
    # as Phi-4-mini's, below), its image and audio embedders (tiny here) beside it not read
    ("phi4_multimodal", dict(pad_token_id=0, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}, **PHI4_MM_TOWERS)),
    # Gemma 2: its default layer types (sliding, full, sliding; a window of 8) and soft-capping low enough to bend
    # these scores and logits; then its own caps (50, 30), grouped KV heads and an untied head
    ("gemma2", GEMMA2),
    ("gemma2", dict(head_dim=16, sliding_window=8, tie_word_embeddings=False, num_key_value_heads=1)),
    # Granite: its four scalars away from 1 (the logits' scaling shows in logprobs only: below)
    ("granite", GRANITE),
    # OLMo 2: post-norm layers, q/k normed over the whole projection (grouped KV heads), a tied head
    ("olmo2", dict(tie_word_embeddings=True)),
    # OLMo 3: three sliding layers (a window of 8) with their own rope base, then a full one with YaRN
    ("olmo3", dict(num_hidden_layers=4, sliding_window=8, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {**YARN, "rope_theta": 500000.0}})),
    # SmolLM3: every other layer without rope; then its default NoPE rule (every 4th) and a window on those layers
    ("smollm3", dict(no_rope_layers=[1, 0], pad_token_id=0)),
    ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, tie_word_embeddings=False,
                     pad_token_id=0)),
    # GPT-OSS: sinks, biased experts with a clamped SwiGLU, sliding and full layers; then grouped KV heads of 4
    ("gpt_oss", GPT_OSS),
    ("gpt_oss", {**GPT_OSS, "num_key_value_heads": 1, "num_attention_heads": 4, "layer_types": ["full_attention"] * 3}),
    # Qwen2-MoE: 8 experts of 32, 2 a token, beside a gated shared expert of 48; q/k/v biases; layer 1 dense;
    # then its sliding rule (even layers below max_window_layers) and renormalised top k
    # Command R: parallel layers, LayerNorms, interleaved rotary, logits scaled; then q/k/v/o biases and grouped KV
    # heads; Command R7B: sliding layers (a window of 8) with rope, every 4th full and without
    ("cohere", dict(logit_scale=0.5, head_dim=16, rope_parameters=YARN)),
    ("cohere", dict(attention_bias=True, num_key_value_heads=1, tie_word_embeddings=False, use_qk_norm=True)),
    ("cohere2", dict(num_hidden_layers=4, sliding_window=8, logit_scale=0.5)),
    # North: Cohere 2's layers with a rope per layer type, rotate-half pairs (MRoPE's sections on text), a null type
    # NoPE; then its full layers turned by a base of their own
    ("cohere_compass_text", COMPASS),
    ("cohere_compass_text", {**COMPASS, "logit_scale": None, "tie_word_embeddings": False, "rope_parameters": {
        **COMPASS["rope_parameters"], "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    # ERNIE 4.5: the Llama layer, interleaved rotary; then every projection biased, an untied head
    ("ernie4_5", dict(head_dim=16, num_key_value_heads=1)),
    ("ernie4_5", dict(use_bias=True, tie_word_embeddings=False, num_key_value_heads=2)),
    # GLM-4: sandwich norms, half of each head rotated (interleaved), q/k/v biases, fused gate/up stored; then a
    # quarter rotated and one KV head
    ("glm4", dict(head_dim=32, pad_token_id=0)),
    ("glm4", dict(partial_rotary_factor=0.25, num_key_value_heads=1, pad_token_id=0)),
    # GLM-4-9B (2024): GLM-4's rotary, biases and fused gate/up under the Llama layer
    ("glm", dict(head_dim=32, pad_token_id=0)),
    ("qwen2_moe", QWEN2_MOE),
    ("qwen2_moe", {**QWEN2_MOE, "num_hidden_layers": 3, "mlp_only_layers": [], "norm_topk_prob": True,
                   "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    # DeepSeek V2: one q projection, the softmax router limited to the best group, two shared experts; V3: q through
    # its bottleneck, the sigmoid router's correction bias, biases on q_a, kv_a and o, YaRN with DeepSeek's mscales
    # (past 32 positions); then
    # rotating halves, one group and no renormalisation
    ("deepseek_v2", {**DEEPSEEK, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_shared_experts": 2}),
    ("deepseek_v3", {**DEEPSEEK, "q_lora_rank": 48, "attention_bias": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v3", {**DEEPSEEK, "q_lora_rank": 48, "rope_interleave": False, "n_group": 1, "topk_group": 1,
                     "norm_topk_prob": False, "first_k_dense_replace": 0}),
    # Youtu-LLM: V3's latent attention (q through its bottleneck, interleaved rotary) over a dense MLP on every layer,
    # the head tied; then one q projection, rotating halves, an untied head
    ("youtu", YOUTU),
    ("youtu", {**YOUTU, "q_lora_rank": None, "rope_interleave": False, "tie_word_embeddings": False}),
    # Gemma 4 Unified's text model (Gemma 4 12B's): Gemma 4's dense layers, no per-layer inputs or experts
    ("gemma4_unified_text", {k: v for k, v in GEMMA4.items() if k != "hidden_size_per_layer_input"}),
    # A.X-K2: V3.2's model, each head's q and an output gate from one projection of its bottleneck normed and raw,
    # gated norms (every input norm, the sparse layers' before their experts), layer 0 dense; then experts in 2 groups
    ("axk2", AXK2),
    ("axk2", {**AXK2, "n_group": 2, "topk_group": 1, "index_topk": 12}),
    # HY V4: V3.2's model under hyper-connections (the module docstring of engine.models.hy_v4), its sparse attention
    # (the steps' longest sequence past index_topk); then experts in 2 groups, 2 streams, q/kv/o biased, YaRN x 4 from
    # 32 positions with DeepSeek's mscales, and every step's sequences within index_topk (the paged kernels' sinks)
    ("hy_v4", HYV4),
    ("hy_v4", {**HYV4, "n_group": 2, "topk_group": 1, "hc_mult": 2, "attention_bias": True, "index_topk": 64,
               "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    # DeepSeek V4: its compressed attention (the module docstring of engine.models.deepseek_v4) beside sliding layers,
    # the streams' Sinkhorn-mixed hyper-connections, hash and learned routers over clamped experts
    # Beam: sliding layers (a window of 8) that rotate, NoPE full ones (layers 3 and 5) with each query scaled by its
    # position, per-head q/k norms, a gate a channel, four norms a layer joined by depth, 8 experts of 16 in 2 groups
    # past a dense first layer
    ("beam", BEAM),
    ("deepseek_v4", DEEPSEEK_V4),
    # then its compressed layers' rope YaRN x 4 from 16 positions (its attention factor 1, transformers' for them),
    # three streams, the scores' sigmoid in place of sqrt-softplus
    ("deepseek_v4", {**DEEPSEEK_V4, "hc_mult": 3, "scoring_func": "sigmoid", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}}),
    # LongCat-Flash: two layers, each two sublayers of V3's latent attention (q and the latent scaled) and a dense
    # MLP, 8 experts of 32 and 4 zero experts (a token routed there passes itself through), 3 a token by the softmax
    # plus a correction bias, x 2.5, beside them from the first sublayer's MLP input to the second's output
    ("longcat_flash", LONGCAT),
    # DeepSeek V3.2 (DEEPSEEK_V32); then YaRN with DeepSeek's mscales and biases on q_a, kv_a and o
    ("deepseek_v32", DEEPSEEK_V32),
    ("deepseek_v32", {**DEEPSEEK_V32, "attention_bias": True, "index_topk": 12, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
    # GLM-5: V3.2's attention with its indexer's interleaved rotary, layer 1 reusing layer 0's choice (a shared
    # layer), values wider than the heads' q.k; then every layer its own indexer
    ("glm_moe_dsa", {**DEEPSEEK_V32, "v_head_dim": 24, "indexer_types": ["full", "shared", "full"]}),
    ("glm_moe_dsa", {**DEEPSEEK_V32, "index_topk": 12, "n_group": 1, "topk_group": 1}),
    # Mistral Small 4 (MISTRAL4); then rotating halves, biases on q_a, kv_a and o, one group, no renormalisation
    ("mistral4", MISTRAL4),
    ("mistral4", {**MISTRAL4, "rope_interleave": False, "attention_bias": True, "n_group": 1, "topk_group": 1,
                  "norm_topk_prob": False, "routed_scaling_factor": 1.5, "n_shared_experts": 2}),
    # GLM-4.5: half of each head rotated (rotate-half pairs), q/k norms and q/k/v biases, DeepSeek V3's experts
    ("glm4_moe", {**GLM4_MOE, "use_qk_norm": True, "attention_bias": True}),
    # MiniMax-M2: q/k normed over the whole projection, a quarter of each head rotated, V3's picks without groups
    ("minimax_m2", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, rotary_dim=4,
                        num_hidden_layers=3)),
    # ERNIE 4.5's MoE: 8 experts of 32, 2 a token by the softmax's top k after the correction bias, one shared expert
    # of 32, layer 0 dense; its interleaved rotary
    ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                          num_hidden_layers=3)),
    # Seed-OSS: heads wider than hidden / heads, q/k/v biases, o_proj's by its own switch (off, then on)
    ("seed_oss", dict(head_dim=32, pad_token_id=0)),
    ("seed_oss", dict(head_dim=16, attention_out_bias=True, pad_token_id=0)),
    # Llama 4: Scout's layers (every one sparse); then Maverick's (dense and sparse layers alternating), two experts a
    # token, no q/k norm, no temperature, one KV head
    ("llama4", LLAMA4),
    ("llama4", {**LLAMA4, "interleave_moe_layer_step": 2, "num_experts_per_tok": 2, "use_qk_norm": False,
                "attn_temperature_tuning": False, "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Ministral 3: every query scaled by its position after the rotary; then a window of 8 and one KV head
    # Ministral (2410): Mistral's layer, sliding (a window of 8) and full layers as layer_types says
    ("ministral", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=16)),
    # EXAONE 3.5: the Llama layer under EXAONE's tensor and config names, its rope's base 500,000
    ("exaone", {}),
    # HyperCLOVA X SEED: Granite's scalars (the logits multiplied), a norm on each sublayer's output; then without
    ("hyperclovax", {**GRANITE, "attention_multiplier": None}),
    ("hyperclovax", {**GRANITE, "use_post_norm": False, "tie_word_embeddings": True}),
    # Mellum: Qwen3-MoE's layers (8 experts of 32, 2 a token) past a dense first one, sliding (a window of 8) and full
    # layers, each type its rope base
    ("mellum", dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse"])),
    # StarCoder2: LayerNorms, an ungated GELU-tanh MLP, every projection biased, a window of 8; then unbiased, no window
    ("starcoder2", {"sliding_window": 8, "norm_epsilon": 1e-5}),
    ("starcoder2", {"use_bias": False, "tie_word_embeddings": False}),
    # Laguna: each layer its query heads (4, then 8), q/k norms, a softplus gate per head, the full layers' rotary on
    # half of each head and the sliding layers' (a window of 8) on all; past a dense first layer 8 experts of 32 (2
    # a token) by a soft-capped sigmoid router beside a shared expert; then a gate per channel, no cap
    ("laguna", LAGUNA),
    ("laguna", {**LAGUNA, "gating": "per-element", "moe_router_logit_softcapping": 0.0, "attention_bias": True,
                "num_attention_heads_per_layer": [8, 4, 4]}),
    # Nemotron: LayerNorms of weight + 1, an ungated squared-ReLU MLP, half of each head rotated; then biased
    ("nemotron", {}),
    ("nemotron", {"attention_bias": True, "mlp_bias": True, "partial_rotary_factor": 0.25, "head_dim": 32}),
    # StableLM 2: LayerNorms, a quarter of each head rotated; then q/k/v biases, StableLM 2 12B's parallel layers and
    # per-head q/k LayerNorms
    ("stablelm", {}),
    ("stablelm", {"use_qkv_bias": True, "use_parallel_residual": True, "qk_layernorm": True,
                  "partial_rotary_factor": 0.5}),
    # Gemma (1): Gemma's two norms (1 + weight), scaled embeddings, GELU-tanh, a tied head; VaultGemma: Gemma 2's
    # attention (soft caps, sliding layers with a window of 8) under those two norms
    ("gemma", {"head_dim": 32}),
    ("vaultgemma", {"head_dim": 32, "sliding_window": 8, "attn_logit_softcapping": 2.0,
                    "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 24}),
    # CWM: Llama's layer, each 4th from the first full, the others sliding (a window of 8), Llama 3.1's rope
    ("cwm", dict(sliding_window=8, num_hidden_layers=4, head_dim=16)),
    ("ministral3", MINISTRAL3),
    ("ministral3", {**MINISTRAL3, "sliding_window": 8, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    # GLM-4.7-Flash: DeepSeek V3's latent attention and router under GLM's names, its first layer dense
    ("glm4_moe_lite", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=32,
                           q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=3,
                           num_key_value_heads=4)),
    # Granite 4 as a transformer: Granite 3's scalars, its shared MLP stored fused, the rotary (the old layer type
    # names); then every layer NoPE (transformers' default position_embedding_type) and grouped KV heads
    ("granitemoehybrid", {**GRANITE, "layer_types": ["attention", "attention"], "num_local_experts": 0,
                          "shared_intermediate_size": 96, "position_embedding_type": "rope"}),
    ("granitemoehybrid", {"layer_types": ["full_attention"] * 2, "num_local_experts": 0,
                          "shared_intermediate_size": 96, "attention_multiplier": 0.25, "num_key_value_heads": 1}),
    # EXAONE 4: post-norm layers, q/k normed per head; three sliding layers (a window of 8) that rotate, then a full
    # NoPE one; then no window: every layer full and rotating, a tied head
    ("exaone4", dict(num_hidden_layers=4, sliding_window=8, head_dim=16)),
    ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2, head_dim=16, tie_word_embeddings=True)),
    # Hunyuan: q/k normed per head after the rotary (weights away from 1: tests/conftest.py), its base stretched by
    # alpha; then the default rope and one KV head
    ("hunyuan_v1_dense", dict(head_dim=16, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                            "rope_theta": 10000.0})),
    ("hunyuan_v1_dense", dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True)),
    # Apertus: q/k normed per head, an MLP without a gate through xIELU (its slopes drawn away from their start),
    # its llama3 rope
    ("apertus", dict(head_dim=16)),
    # InternLM3: the Llama model under its hub name, its biases (q, k, v, o and the MLP's) by qkv_bias and bias
    ("internlm3", dict(head_dim=16, qkv_bias=True, bias=True)),
    # Apertus 1.5's text model: Apertus's, its head pruned to the first 300 of 512 ids (the prompts hold ids past them)
    ("apertus1p5_text", dict(head_dim=16, output_vocab_size=300)),
    # Hunyuan's MoE: that layer, every MLP 8 experts of 32 (2 a token) beside a shared one of 32
    ("hunyuan_v1_moe", dict(head_dim=16, intermediate_size=32, num_experts=8, moe_topk=2)),
    # OLMoE: 8 experts of 32 (its intermediate_size), 2 a token, q/k normed over the whole projection; then 3 a token
    # renormalised and q, k and v clamped at 0.5
    ("olmoe", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    ("olmoe", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.5,
                   num_key_value_heads=4)),
    # Qwen3.5: three Gated DeltaNet layers (a state per sequence; prompts past the 64-token chunk and past a step's
    # 64 tokens) and a gated full-attention one, q/k normed, a quarter of each head rotated; then linear, full,
    # linear with one value head a key head, q/k/v biases, half of each head rotated and a tied head
    ("qwen3_5", QWEN3_5),
    ("qwen3_5", {**QWEN3_5, "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention",
                 "linear_attention"], "linear_num_value_heads": 2, "attention_bias": True, "tie_word_embeddings": True,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # Qwen3.5-MoE: those layers, each MLP 8 experts of 32 (2 a token, renormalised) beside a gated shared expert of 48
    ("qwen3_5_moe", {**QWEN3_5, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 48}),
    ("granitemoehybrid", GRANITE4_H),   # Granite 4's -H models (Mamba-2 beside attention)
    # then with experts (-H-Tiny's, -H-Small's): 4 of 32, 2 a token, beside the shared MLP, NoPE attention
    ("granitemoehybrid", {"layer_types": ["mamba", "mamba", "attention"], "num_hidden_layers": 3,
                          "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                          "shared_intermediate_size": 48, "mamba_n_heads": 4, "mamba_d_state": 16,
                          "mamba_chunk_size": 16, "residual_multiplier": 0.5}),
    # Bamba: Granite 4's -H layers under its names, no scalars, half of each attention head rotated; then attention on
    # every layer
    ("bamba", {"attn_layer_indices": [1], "num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_state": 16,
               "mamba_n_groups": 2, "mamba_chunk_size": 16}),
    ("bamba", {"attn_layer_indices": [0, 1], "head_dim": 32}),
    # Falcon-H1: Mamba-2 (4 heads of 16, mamba_d_ssm 64; B and C in 2 groups) beside attention on every layer, every
    # muP multiplier away from 1; then the gated norm (gate first), biased projections and a tied head
    ("falcon_h1", FALCON_H1),
    ("falcon_h1", {**FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_proj_bias": True,
                   "projectors_bias": True, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    # Jamba: Mamba-1 layers (128 channels, a state of 8 each, dt from a rank of 8; dt's input, B and C normed) beside
    # NoPE attention, every other layer's MLP 4 experts (2 a token, not renormalised); then biased projections, no
    # convolution bias, one expert (dense MLPs), attention on the last of 3 layers
    ("jamba", JAMBA),
    ("jamba", {**JAMBA, "num_hidden_layers": 3, "attn_layer_period": 3, "attn_layer_offset": 2, "num_experts": 1,
               "mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_d_conv": 3}),
    # MiniMax: lightning attention layers (4 heads of 16, each forgetting at its own rate; prompts past our block of
    # 64 and transformers' of 32) beside a full attention layer, 4 experts (2 a token) on every layer, each sublayer
    # joined by factors away from 1; then attention first and last, the factors 1
    ("minimax", MINIMAX),
    ("minimax", {**MINIMAX, "layer_types": ["full_attention", "linear_attention", "linear_attention",
                                            "full_attention"], **dict.fromkeys(
        [f"{k}_{p}_factor" for k in ("full_attn", "linear_attn", "mlp") for p in ("alpha", "beta")], 1.0)}),
    # MiniMax M3: Gemma's norms and per-head q/k norms, a dense layer with the clamped SwiGLU, then two block-sparse
    # layers (blocks of 4 keys; each query its own block and the best other one by its KV head's indexer head) with 4
    # experts (2 a token, sigmoid router with its correction bias, x2) beside a shared expert
    ("minimax_m3_vl_text", MINIMAX_M3),
    # BLOOM: GPT-NeoX's sequential layer by ALiBi (4 heads' slopes), a LayerNorm on the embeddings, a tied head; then
    # 6 heads (two past the power of two: their slopes the odd steps of 8's)
    ("bloom", {"n_layer": 2, "n_head": 4}),
    ("bloom", {"n_layer": 2, "n_head": 6, "hidden_size": 96}),
    # MPT: no biases, weight-only LayerNorms, exact GELU, ALiBi of MPT's slopes (4 heads); then 6 heads (MPT's slopes
    # of 8 interleaved), q/k/v clamped and its own q.k scale
    ("mpt", {"n_layers": 2, "n_heads": 4, "d_model": 64}),
    # Persimmon: GPT-NeoX's sequential layer through squared ReLU, q/k LayerNorms (a weight and a bias) before half of
    # each head turns; then without the q/k norms, a quarter turned
    ("persimmon", {"num_attention_heads": 4, "intermediate_size": 128}),
    ("persimmon", {"num_attention_heads": 4, "intermediate_size": 128, "qk_layernorm": False,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.25}}),
    # Aria: the Llama layer with 4 experts (2 a token) on every layer beside 2 shared ones as one ungated MLP
    ("aria_text", {"intermediate_size": 32, "moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 2}),
    ("mpt", {"n_layers": 2, "n_heads": 6, "d_model": 96, "attn_config": {"clip_qkv": 0.8, "softmax_scale": 0.2}}),
    # then half of each head rotated (the indexer's too), two local blocks of 8 and the best three in all
    ("minimax_m3_vl_text", {**MINIMAX_M3, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.5},
                            "index_block_size": 8, "index_local_blocks": 2, "index_topk_blocks": 3}),
    # Mamba: blocks of a norm and a Mamba-1 mixer alone (160 channels: its intermediate_size; a state of 8, dt of
    # rank 8), no attention: the KV cache holds no layer; FalconMamba: dt's input, B and C normed without weights,
    # biased projections, no convolution bias, 3 taps
    ("mamba", {"num_hidden_layers": 3, "state_size": 8, "time_step_rank": 8, "pad_token_id": 0}),
    ("falcon_mamba", {"num_hidden_layers": 3, "state_size": 8, "time_step_rank": 8, "use_bias": True,
                      "use_conv_bias": False, "conv_kernel": 3, "pad_token_id": 0}),
    # Mamba2: blocks of a norm and a Mamba-2 mixer alone (4 heads of 32, a state of 16, B and C in 2 groups; prompts
    # past its chunk of 16), the gate through the grouped norm
    ("mamba2", {"num_hidden_layers": 3, "num_heads": 4, "head_dim": 32, "state_size": 16, "n_groups": 2,
                "chunk_size": 16, "pad_token_id": 0}),
    # Zamba2: Mamba-2 layers (4 heads of 32, a state of 16, B and C in 2 groups) of which four run a shared block first
    # (two blocks used in turn, each use its own adapters on q, k, v and the MLP's gate/up; NoPE attention from the
    # layer's input beside the embeddings); then one block, a rotary, GQA without attention adapters, biases
    ("zamba2", {**ZAMBA2, "num_mem_blocks": 2, "use_shared_attention_adapter": True}),
    ("zamba2", {**ZAMBA2, "num_key_value_heads": 2, "use_mem_rope": True, "add_bias_linear": True}),
    # Nemotron-H: Mamba-2 blocks (B and C in 2 groups), NoPE attention blocks and squared-ReLU MLP blocks, each its own
    # pre-norm residual step, under `backbone.` names
    ("nemotron_h", {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                          "mlp"], "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 32,
                    "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16, "pad_token_id": 0}),
    # Nemotron 3's MoE blocks: 8 squared-ReLU experts of 32 in 2 groups (a token's from 1), 2 a token by DeepSeek V3's
    # sigmoid router (its correction bias), scaled by 2.5, beside a shared expert of 48
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"], "head_dim": 16,
                    "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "pad_token_id": 0}),
    # Nemotron 3 Super's: the experts in a latent space of 16 (the hidden state projected in, their sum back out)
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"], "head_dim": 16,
                    "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_latent_size": 16,
                    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "pad_token_id": 0}),
    # LFM2: gated short convolutions (3 taps, over B x x; a state of the last 2 inputs) beside attention with per-head
    # q/k norms, its MLP two thirds of block_ff_dim rounded up to 16s; then biased convolutions of 4 taps, the layers
    # by full_attn_idxs, the MLP's width as given
    ("lfm2", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
              "block_multiple_of": 16, "norm_eps": 1e-5}),
    ("lfm2", {"num_hidden_layers": 3, "full_attn_idxs": [2], "conv_bias": True, "conv_L_cache": 4,
              "block_auto_adjust_ff_dim": False, "tie_embedding": False, "norm_eps": 1e-5}),
    # LFM2-MoE: those layers, past the first dense one 8 experts of 32, 2 a token by sigmoid scores plus an expert
    # bias, renormalised and scaled by 1.5
    ("lfm2_moe", {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "intermediate_size": 96,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1,
                  "routed_scaling_factor": 1.5, "norm_eps": 1e-5}),
    # LFM3: LFM2's convolutions (7 taps, biased) beside sliding (a window of 8, the default rope) and full attention
    # layers (the proportional rope, half the pairs turning), each head gated by a sigmoid of g_proj, sandwich norms;
    # then Lfm3Config's own layout (5 layers: a full one at 2, a sliding one at 4) without gates or sandwich norms
    # Kolibri-1: GLM-4's four norms around EXAONE 4's attention (sliding layers rotate in a window of 8, the full one
    # NoPE), every layer 8 experts of 32 picked by float32 logits plus an expert bias, weighed by their sigmoid (not
    # renormalised), beside an ungated shared expert of 48
    # Helium: the Llama model with its rotary over interleaved pairs and float32 norms; q/k/v biased, o_proj not
    ("helium", {"head_dim": 16, "attention_bias": True, "rms_norm_eps": 1e-6}),
    # Phi (phi-2's form): Cohere's parallel layer with a LayerNorm, every projection and the head biased, an MLP of
    # fc1, GELU-tanh, fc2, the first 40% of each head turned (rotate-half pairs)
    ("phi", {"num_key_value_heads": 4, "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5}),
    # GPT-NeoX (Pythia's form): multi-head attention of a fused query_key_value a head, two LayerNorms off the stream
    # of a parallel layer, exact GELU, a quarter of each head turned; then sequential layers, GELU-tanh, no attention
    # biases, its older keys for the rope
    ("gpt_neox", {"layer_norm_eps": 1e-5}),
    ("gpt_neox", {"use_parallel_residual": False, "hidden_act": "gelu_fast", "attention_bias": False,
                  "rotary_emb_base": 500.0, "rotary_pct": 0.5, "layer_norm_eps": 1e-5}),
    # Phi-3.5-MoE: Mixtral's experts (8 of 32) under LayerNorms, its attention and head biased, SparseMixer's router
    # (a jitter of 0.5: a pick's softmax over the experts near it); then the default jitter and a LongRoPE with its
    # own mscales, the context within the original (the short set)
    ("phimoe", {"num_local_experts": 8, "intermediate_size": 32, "attention_bias": True, "lm_head_bias": True,
                "router_jitter_noise": 0.5}),
    ("phimoe", {"num_local_experts": 8, "intermediate_size": 32, "rope_parameters": PHIMOE_ROPE}),
    # OLMo: the Llama layer with LayerNorms of neither weight nor bias; then q, k and v clipped at 0.5
    ("olmo", {}),
    ("olmo", {"clip_qkv": 0.5, "num_key_value_heads": 4}),
    # Falcon: Falcon-7B's form (one KV head, parallel layers off one LayerNorm, tied); Falcon-40B's (q/k/v grouped by
    # 2 KV heads, a LayerNorm a sublayer), biased; then sequential layers, a KV head a query head, GELU-tanh
    ("falcon", {"layer_norm_epsilon": 1e-5}),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True, "tie_word_embeddings": False,
                "ffn_hidden_size": 96, "layer_norm_epsilon": 1e-5}),
    ("falcon", {"multi_query": False, "parallel_attn": False, "activation": "gelu_fast", "layer_norm_epsilon": 1e-5}),
    # GPT-J: a parallel layer off one LayerNorm, unbiased attention, a biased MLP and head, the first 6 of each
    # head's 16 dimensions turned in interleaved pairs; then all 16
    ("gptj", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 6,
              "layer_norm_epsilon": 1e-5}),
    ("gptj", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 16, "n_inner": 96,
              "layer_norm_epsilon": 1e-5}),
    # GPT-BigCode (StarCoder's form): one KV head, a learned position embedding, no rotary, LayerNorms, every
    # projection biased, a tied head; then a KV head a query head
    ("gpt_bigcode", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "n_inner": 96,
                     "layer_norm_epsilon": 1e-5}),
    ("gpt_bigcode", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "multi_query": False,
                     "activation_function": "gelu_fast", "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5}),
    # GPT-2: GPT-BigCode's block with a KV head a query head, its projections Conv1Ds ([in, out]); OPT: that block with
    # a ReLU MLP, its positions two rows on in their table; then without biases
    ("gpt2", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "layer_norm_epsilon": 1e-5}),
    ("opt", {"ffn_dim": 96, "word_embed_proj_dim": 64, "pad_token_id": 0}),
    # CodeGen: GPT-J's layer, q, v and k fused in four groups (its model-parallel layout)
    ("codegen", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 8, "n_inner": 96,
                 "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}),
    # GPT-Neo: a global then a local layer (a window of 8), q.k unscaled, q/k/v unbiased, out_proj biased
    ("gpt_neo", {"num_hidden_layers": 4, "window_size": 8, "intermediate_size": 96,
                 "attention_types": [[["global", "local"], 2]], "layer_norm_epsilon": 1e-5}),
    ("opt", {"ffn_dim": 96, "word_embed_proj_dim": 64, "enable_bias": False, "pad_token_id": 0}),
    # FlexOlmo: OLMo 2's post-norm layers and whole-projection q/k norms, every MLP 7 experts of 32, 5 a token
    ("flex_olmo", {"num_experts": 7, "num_experts_per_tok": 5, "intermediate_size": 32, "pad_token_id": 0}),
    # nanochat: weightless RMSNorms (the embeddings normed too), q/k normed after its reversed rotary, squared ReLU,
    # logits capped at 15
    ("nanochat", {"pad_token_id": 0}),
    # DBRX: weight-only LayerNorms, q/k/v clipped at 0.5, every MLP 4 experts of 32 (2 a token, renormalised) stored
    # stacked as w1 / v1 / w2
    ("dbrx", {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512, "pad_token_id": 0,
              "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 500.0},
              "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}}),
    # MiniCPM3: DeepSeek V2's latent attention (its rotary over halves), dense MLPs, muP's scalars (the embeddings times
    # 12, each sublayer's output times 1.4 / sqrt(2), the logits over 64 / 16); then a LongRoPE over the rotated part
    ("minicpm3", MINICPM3),
    ("minicpm3", {**MINICPM3, "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 512,
                                                  "short_factor": [1.0, 1.3, 1.6, 1.9],
                                                  "long_factor": [2.0, 3.0, 4.0, 5.0]}}),
    # Flint: Qwen3-MoE's layers with a sink a query head, sliding layers (a window of 8) rotating beside NoPE full ones,
    # float32 norms, after 2 dense layers 8 experts of 32 by the top 2 of their logits' sigmoid beside a shared one
    ("flint", {"num_hidden_layers": 4, "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                                       "full_attention"], "head_dim": 16, "sliding_window": 8,
               "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48, "intermediate_size": 96}),
    # A.X-K1: DeepSeek V3 whose sparse layers norm their output (the dense first layer's stored norm unused)
    ("axk1", {**DEEPSEEK, "q_lora_rank": 24}),
    ("kolibri1", {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                  "head_dim": 16, "sliding_window": 8, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    ("lfm3", {"num_hidden_layers": 4, "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
              "head_dim": 16, "sliding_window": 8, "conv_bias": True, "norm_eps": 1e-5, "pad_token_id": 0}),
    ("lfm3", {"num_hidden_layers": 5, "head_dim": 16, "sliding_window": 8, "conv_L_cache": 3,
              "use_sandwich_norm": False, "use_attention_gate": False, "tie_word_embeddings": False,
              "norm_eps": 1e-5, "pad_token_id": 0}),
    # dots.llm1: Qwen3's attention (its top layer sliding, a window of 8) with DeepSeek V3's experts past the first
    # layer: 8 of 32 in 2 groups, 2 a token from 1 group, beside two shared
    ("dots1", {"num_hidden_layers": 3, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "n_shared_experts": 2, "n_group": 2, "topk_group": 1,
               "first_k_dense_replace": 1, "sliding_window": 8, "max_window_layers": 2, "norm_topk_prob": True,
               "routed_scaling_factor": 1.5}),
    # Arcee's AFM: the Llama layer, its MLP up, squared ReLU, down; then with biases
    ("arcee", {}),
    ("arcee", {"mlp_bias": True, "attention_bias": True}),
    # Jais 2: AFM's layer with LayerNorms (a weight and a bias each) and every projection biased
    ("jais2", {}),
    # Granite 3's MoE: Granite's scalars, every MLP 8 experts of 32 (2 a token) stacked as Granite 4's; then beside a
    # shared MLP of 48
    ("granitemoe", {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "embedding_multiplier": 3.0, "attention_multiplier": 0.05, "residual_multiplier": 0.5,
                    "logits_scaling": 2.0}),
    ("granitemoeshared", {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                          "shared_intermediate_size": 48, "residual_multiplier": 0.5}),
    # Granite SWA: Granite's scalars, a sink per query head on every layer, sliding layers (a window of 8) beside a
    # full first one, each layer's rope base its own (the third's 500, the second NoPE)
    ("granite_swa", {"num_hidden_layers": 4, "sliding_window": 8, "embedding_multiplier": 3.0,
                     "attention_multiplier": 0.05, "residual_multiplier": 0.5, "logits_scaling": 2.0,
                     "layer_rope_theta": [10000.0, 0, 500.0, 10000.0], "pad_token_id": 0}),
    # Granite SWA's MoE: that attention over Granite 3's experts beside a shared MLP, stored under transformers 5's
    # names (experts.gate_up_proj, router.weight)
    ("granitemoe_swa", {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                        "shared_intermediate_size": 48, "num_hidden_layers": 4, "sliding_window": 8,
                        "attention_multiplier": 0.05, "layer_rope_theta": [10000.0, 0, 500.0, 10000.0],
                        "pad_token_id": 0}),
    # Solar Open: Llama's attention with q/k/v biases, DeepSeek V3's experts on every layer (8 of 32 in 2 groups, 2 a
    # token from 1 group, renormalised) beside a shared one
    ("solar_open", {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "n_group": 2, "topk_group": 1, "attention_bias": True, "pad_token_id": 0}),
    # AFMoE (Trinity): four norms, gated attention with per-head q/k norms, sliding layers with a rotary (a window of
    # 8) beside NoPE full ones; past the first layer 8 experts of 32, 2 a token, beside a shared one; scaled embeds
    ("afmoe", {"num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
               "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "num_dense_layers": 1,
               "global_attn_every_n_layers": 2, "sliding_window": 8, "mup_enabled": True, "route_scale": 1.5,
               "pad_token_id": 0}),
    # MiMo-V2-Flash: full layers of one KV head, sliding ones (a window of 8) of two with sinks; q/k heads of 32 (a
    # third turning, each type its base) over value heads of 16, scaled; q/k/v biases; past the dense first layer 8
    # experts of 32 in 2 groups, 2 a token from 1 group, renormalised, times 1.5; stored under the hub's names
    ("mimo_v2_flash", {"num_hidden_layers": 4, "head_dim": 32, "v_head_dim": 16, "num_key_value_heads": 1,
                       "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                                        "full_attention"],
                       "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                       "topk_group": 1, "routed_scaling_factor": 1.5, "attention_bias": True, "pad_token_id": 0}),
    # K-EXAONE: EXAONE 4's attention (three sliding layers with a rotary over a window of 8, then a NoPE full one;
    # q/k normed per head) over DeepSeek V3's experts past the dense first layer: 8 of 32 in 2 groups, 2 a token from
    # 1 group, renormalised, times 2.5, beside a shared one
    ("exaone_moe", {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1,
                    "num_shared_experts": 1, "pad_token_id": 0}),
    # Command A Plus: Cohere 2's parallel layers (its interleaved rotary on the sliding layers, a window of 8, and on
    # the dense first layer; the last layer full and NoPE) with Cohere's LayerNorm, past the dense layer (96 wide)
    # 8 experts of 32, 2 a token by the softmax of the top logits, averaged with a shared one; then an RMSNorm, the
    # sigmoids of the top logits renormalised, the shared expert summed
    ("cohere2_moe", {**COHERE2_MOE, "rms_norm_eps": None}),
    ("cohere2_moe", {**COHERE2_MOE, "expert_selection_fn": "sigmoid", "shared_expert_combination_strategy": "sum"}),
    # HY V3: per-head q/k norms, a dense first layer, then 8 experts of 32 (2 a token by sigmoid scores plus a float32
    # correction bias, renormalised, times 1.5) beside a shared one; stored under its hub names (router.gate,
    # expert_bias, shared_mlp)
    ("hy_v3", {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "num_shared_experts": 1, "router_scaling_factor": 1.5,
               "pad_token_id": 0}),
    # Kimi Linear: Kimi Delta Attention layers (4 heads of 16, a decay per key channel; prompts past its chunk of 64)
    # beside NoPE latent attention, the first MLP dense, then 8 experts of 32 in 2 groups (2 a token from 1 group)
    # beside a shared one
    ("kimi_linear", {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention",
                                                             "linear_attention"],
                     "mlp_layer_types": ["dense", "sparse", "sparse"], "intermediate_size": 96,
                     "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                     "topk_group": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4, "num_key_value_heads": 4,
                     "pad_token_id": 0}),
    # Ling 3: Kimi Linear's layers with KDA's gates one projection each and the forget gate bounded (kda_safe_gate),
    # latent attention that turns its rope (interleaved pairs) and gates each head; then the unbounded gate
    ("bailing_hybrid", {**BAILING, "kda_lower_bound": -3.0}),
    ("bailing_hybrid", {**BAILING, "kda_safe_gate": False, "q_lora_rank": 24}),
    # OLMo Hybrid: pre-norm Gated DeltaNet blocks (beta up to 2) beside OLMo 3's post-norm attention, with a rope;
    # then NoPE attention
    ("olmo_hybrid", dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=8, pad_token_id=0)),
    ("olmo_hybrid", dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_allow_neg_eigval=False,
                         rope_parameters=None, pad_token_id=0)),
    # Qwen3-Next: the same, its linear layers' projections stored fused per key head (2 value heads a key head);
    # then 1 value head a key head, layer 2 dense and the top 3 not renormalised
    ("qwen3_next", {**QWEN3_5, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48}),
    ("qwen3_next", {**QWEN3_5, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48, "linear_num_value_heads": 2, "mlp_only_layers": [2],
                    "norm_topk_prob": False}),
    # scaled ropes over part of each head, past the original context (32 positions): Qwen3.5's under YaRN (its
    # long-context setting; half of each head here, a quarter in its releases), GLM-4's interleaved quarter under YaRN,
    # Phi's 0.4 under a linear scaling, GPT-NeoX's quarter under Llama 3's
    ("qwen3_5", {**QWEN3_5, "rope_parameters": {**YARN, "factor": 8.0, "partial_rotary_factor": 0.5}}),
    ("glm4", dict(partial_rotary_factor=0.25, num_key_value_heads=1, pad_token_id=0,
                  rope_parameters={**YARN, "partial_rotary_factor": 0.25})),
    ("phi", {"num_key_value_heads": 4, "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5,
             "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.4}}),
    ("gpt_neox", {"layer_norm_eps": 1e-5, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
]
# Every architecture on the default CPU linears; the other linears on one dense and one MoE model (the
# linears do not depend on the architecture around them).
TINY_CASES = [pytest.param(CPU_LINEARS[0], arch, overrides, id=f"{CPU_LINEARS[0]}-{arch}-{i}")
              for i, (arch, overrides) in enumerate(TINY_MODELS)]
TINY_CASES += [pytest.param(linear, *TINY_MODELS[i], id=f"{linear}-{TINY_MODELS[i][0]}-{i}")
               for linear in CPU_LINEARS[1:] for i in (0, 7)]


@pytest.mark.usefixtures("one_thread")   # tiny models: a second thread costs more than it gives
@pytest.mark.parametrize("cpu_linear,arch,overrides", TINY_CASES)
def test_tiny_random_models_match_transformers(tmp_path, monkeypatch, builtin_path, arch, overrides, cpu_linear):
    import transformers

    monkeypatch.setenv("CLIFFGUARD_CPU_LINEAR", cpu_linear)  # packed oneDNN linears, and torch's own
    monkeypatch.setattr("kernels.cpu_linear.PACK_MIN_ELEMENTS", 0)   # a tiny model's weights packed all the same
    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    assert (folder / "model.safetensors.index.json").exists()  # sharded checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=64,
                                 progress=False)
    buffers = sum(b.numel() for name, b in hf.named_buffers()
                  if name.endswith(("e_score_correction_bias", "layer_scalar", "expert_bias", "tid2eid",
                                    "balancing_biases")))
    # LongCat-Flash's stacked gate/up holds rows for its zero experts too, which compute nothing and are not read;
    # Phi-4-multimodal's image and audio embedders serve no text
    unused = sum(m.gate_up_proj[m.num_routed_experts:].numel() for m in hf.modules() if hasattr(m, "zero_expert_num"))
    unused += sum(p.numel() for name, p in hf.named_parameters() if ".embed_tokens_extend." in name)
    assert engine.model_config.num_params() == sum(p.numel() for p in hf.parameters()) + buffers - unused
    out = next(m for layer in engine.model.layers for name, m in layer.named_modules()   # attention's, or a mixer's
               if name.endswith(("o_proj", "out_proj", "o_b_proj")))
    packed = isinstance(out, PackedLinear)
    assert packed == (cpu_linear == "onednn" and torch.backends.mkldnn.is_available())
    gen = torch.Generator().manual_seed(1)
    state = arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "olmo_hybrid", "lfm2", "lfm2_moe",
                     "kimi_linear") or "mamba" in overrides.get("layer_types", ()) or \
        bool(engine.model.config.stateful_layers)
    lengths = (1, 5, 17, 40, 9) + ((100,) if state else ())   # past a state layer's chunk of 64
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 16, eos_ids=None)
    if state:   # cached prefixes resume from the states kept with them (`engine.state_cache`): the long prompt again,
        prompts = [prompts[-1], prompts[-1][:70] + prompts[2]]   # and its first 70 tokens before another's
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16, eos_ids=None) for p in prompts]
        assert engine.schedulers["default"].state_snapshots.num_loaded >= 1
    assert_all_free(engine)


@pytest.mark.usefixtures("one_thread")
def test_a_minimax_config_in_its_releases_spelling_serves_as_transformers_runs_it(tmp_path, builtin_path):
    """MiniMax-Text-01's and MiniMax-M1's config.json name the architecture `MiniMaxText01ForCausalLM` and its keys as
    their own code reads them (`attn_type_list`, `layernorm_*_alpha` / `_beta`, `postnorm`, a top-level `rope_theta`);
    their tensors' names are the ones transformers saves (`block_sparse_moe`, lightning modules under `self_attn`).
    The tiny model's config.json rewritten so generates what transformers generates from the original."""
    import transformers

    folder = make_tiny_model(tmp_path / "minimax", "minimax", builtin_path, **MINIMAX)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = json.loads((folder / "config.json").read_text())
    release = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_parameters") and "_factor" not in k}
    release |= {"architectures": ["MiniMaxText01ForCausalLM"], "model_type": "minimax_text_01", "postnorm": True,
                "attn_type_list": [int(kind == "full_attention") for kind in cfg["layer_types"]],
                "rope_theta": cfg["rope_parameters"]["rope_theta"],
                **{f"layernorm_{theirs}_{part}": cfg[f"{ours}_{part}_factor"]
                   for ours, theirs in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"),
                                        ("mlp", "mlp")) for part in ("alpha", "beta")}}
    (folder / "config.json").write_text(json.dumps(release))
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=64,
                                 progress=False)
    assert engine.model_config.architecture == "MiniMaxForCausalLM"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 70)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]


def test_a_pruned_head_never_samples_the_ids_past_it(tmp_path, builtin_path):
    """Apertus 1.5's head holds the vocabulary's first `output_vocab_size` ids (300 of 512): the logits keep the
    vocabulary's width, -inf past the head's rows, so sampling at temperature 2 never picks a pruned id, though the
    prompts hold them; a head of another size is refused by name, as a pruned head tied to the table is."""
    import json

    from engine.config import ConfigError
    from engine.checkpoint_reading import WeightLoadError

    folder = make_tiny_model(tmp_path / "apertus1p5", "apertus1p5_text", builtin_path, head_dim=16,
                             output_vocab_size=300)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    logits = engine.model.compute_logits(torch.randn(3, 64))
    assert logits.shape == (3, 512) and torch.isneginf(logits[:, 300:]).all() and logits[:, :300].isfinite().all()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(300, 512, (n,), generator=gen).tolist() for n in (4, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=2.0, max_tokens=64, ignore_eos=True, seed=3))
    assert all(0 <= t < 300 for out in outs for t in out.outputs[0].token_ids)
    cfg = json.loads((folder / "config.json").read_text())
    for changes, error in (({"output_vocab_size": 200}, WeightLoadError),
                           ({"tie_word_embeddings": True}, ConfigError), ({"output_vocab_size": 600}, ConfigError)):
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
        with pytest.raises(error, match="^(lm_head.weight: shape .* pruned head's|tie_word_embeddings:|"
                                        "output_vocab_size:)"):
            LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)


def test_a_model_without_attention_has_no_attention_kernel_to_compile(tmp_path, builtin_path, monkeypatch):
    """Mamba's blocks hold no attention: a CUDA worker's start compiles no attention kernel variant (it looked at the
    first attention layer's shapes, and a model with none failed there), and an FP8 cache has no scale to measure
    (the calibration failed on none) and changes no answer."""
    from types import SimpleNamespace

    from engine.kv_scales import attentions

    folder = make_tiny_model(tmp_path / "mamba", "mamba", builtin_path, num_hidden_layers=2, state_size=8,
                             time_step_rank=8, pad_token_id=0)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=16, progress=False)
    fp8 = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=16, kv_cache_dtype="fp8",
                              progress=False)   # nothing to measure, nothing stored: its answers are the same
    prompt, params = [[5, 9, 300, 41, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in fp8.generate(prompt, params)] == \
        [o.outputs[0].token_ids for o in engine.generate(prompt, params)]
    calls = []
    monkeypatch.setattr(engine.runner, "device", torch.device("cuda"))
    monkeypatch.setattr(engine.runner, "backend", SimpleNamespace(compile_kernels=lambda *a, **k: calls.append(a)))
    engine.runner.compile_kernels()
    assert calls == [] and attentions(engine.model) == {}


def test_an_apertus_1_5_checkpoint_serves_its_text_model(tmp_path, builtin_path):
    """Apertus 1.5 as its hub checkpoints lay it out (`Apertus1p5ForConditionalGeneration`: the text model under
    `model.language_model.`, the pruned head at `lm_head`, the image and audio tokenizers beside, not read), its
    config.json's text_config an `apertus1p5_text` one: served as its text model, greedy tokens those of transformers'
    text model holding the same tensors."""
    import json

    from safetensors.torch import load_file, save_file

    import transformers

    text = make_tiny_model(tmp_path / "text", "apertus1p5_text", builtin_path, head_dim=16, output_vocab_size=300)
    hf = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32).eval()
    tensors = {}
    for shard in sorted(text.glob("*.safetensors")):
        tensors |= load_file(shard)
    folder = tmp_path / "apertus1p5"
    folder.mkdir()
    save_file({("lm_head.weight" if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)):
               tensor for name, tensor in tensors.items()} | {"model.vision_tokenizer.quantize.embedding.weight":
                                                             torch.zeros(8, 4)}, folder / "model.safetensors")
    text_config = json.loads((text / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Apertus1p5ForConditionalGeneration"], "model_type": "apertus1p5",
        "text_config": {k: v for k, v in text_config.items() if k != "architectures"}, "tie_word_embeddings": False,
        "vision_config": {"codebook_size": 8}}))
    _assert_serves_its_text_model(hf, folder, builtin_path, "ApertusForCausalLM")


def test_a_tied_checkpoint_that_stores_its_table_as_the_head_alone_serves_it(tmp_path, builtin_path):
    """safetensors' `save_model` keeps one name of tied tensors, the first in order: `lm_head.weight`, no
    `model.embed_tokens.weight`. transformers 5 ties the embedding to the stored head; the engine refused the
    checkpoint (missing embed_tokens.weight). Greedy output is transformers' own model's."""
    import transformers
    from safetensors.torch import save_file

    folder = make_tiny_model(tmp_path / "m", "llama", builtin_path, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    weights = dict(iter_weights(folder))
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    for path in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        path.unlink()
    save_file({n: t.contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"))
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    prompts = [[5, 9, 200, 31], list(range(40, 70))]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]


def test_a_tied_config_whose_checkpoint_stores_another_head_serves_that_head(tmp_path, builtin_path, caplog):
    """config.json says tie_word_embeddings, the checkpoint stores an lm_head.weight of its own (a fine-tune
    that kept the flag): transformers 5 unties and uses the stored head, so does the engine, saying so (it
    dropped the head and decoded with the embedding). A stored head equal to the table is no head of its own."""
    import transformers

    folder = make_tiny_model(tmp_path / "m", "llama", builtin_path, tie_word_embeddings=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)   # transformers: the stored head
    with caplog.at_level(logging.WARNING, logger="cliffguard.engine"):
        engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert "serving the stored head" in caplog.text
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 7, 30)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16, eos_ids=None) for p in prompts]
    model = build_model(engine.model_config, torch.float32, "cpu")
    embed = dict(iter_weights(folder))["model.embed_tokens.weight"]
    model.load_weights((n, embed if n == "lm_head.weight" else t) for n, t in iter_weights(folder))
    assert "lm_head" not in model._modules and model.config.tie_word_embeddings

    # the capacity plan counts the head the engine serves (it counted the table once, the head not at all)
    from safetensors.torch import save_file

    from pools.config.yaml_file import parse_config
    from pools.model_configs import resolve_model_configs

    def planned(model_folder) -> object:
        config = parse_config({"devices": {"cpu": {"device": "cpu", "memory": "256MiB", "dtype": "float32"}},
                               "pools": [{"name": "chat", "model": str(model_folder), "device": "cpu",
                                          "max_model_len": 64, "kv_share": 1}]}, env={})
        return resolve_model_configs(config)[str(model_folder)]

    assert not planned(folder).tie_word_embeddings
    assert planned(folder).num_params() == sum(p.numel() for p in engine.model.parameters())
    redundant = tmp_path / "redundant"            # a head equal to the table: one table, as config.json says
    redundant.mkdir()
    for item in folder.iterdir():
        if not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            (redundant / item.name).write_bytes(item.read_bytes())
    save_file({n: (embed if n == "lm_head.weight" else t).contiguous() for n, t in iter_weights(folder)},
              redundant / "model.safetensors")
    assert planned(redundant).tie_word_embeddings


MLP_NAMES = {"llama": ("model.layers.0.mlp", "gate_proj", "up_proj", "down_proj"),   # a layer's MLP, its tensors
             "qwen3_moe": ("model.layers.0.mlp.experts.1", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("model.layers.0.block_sparse_moe.experts.1", "w1", "w3", "w2")}


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3_moe", QWEN3_MOE), ("mixtral", MIXTRAL)])
def test_a_checkpoint_that_stores_a_tensor_twice_or_lacks_one_is_refused_by_name(tmp_path, builtin_path, arch,
                                                                                 overrides):
    """A missing tensor is named. A tensor stored twice (two files of one folder, or an expert written as
    `experts.0` and `experts.00`) is refused, also when it fills the room of a missing one: counting filled
    elements alone would take it for the missing tensor and serve uninitialised memory. An expert past
    num_experts is named too (by the checkpoint's own name: Mixtral's `block_sparse_moe.experts.{e}.w1`), and
    float8 weights (a quantized checkpoint) are refused, not cast."""
    from engine.model import WeightLoadError
    from engine.model_config import ModelConfig

    folder = make_tiny_model(tmp_path / "m", arch, builtin_path, **overrides)
    state = dict(iter_weights(folder))
    config = ModelConfig.from_folder(folder)

    def load(tensors):
        build_model(config, torch.float32, "cpu").load_weights(tensors.items())

    load(state)
    quantized = {**state, "model.layers.0.self_attn.q_proj.weight":
                 state["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn)}
    with pytest.raises(WeightLoadError, match="q_proj.weight: torch.float8_e4m3fn weights .*not supported"):
        load(quantized)   # a float8 checkpoint without its quantization_config: no silent cast
    mlp, gate, up, down = MLP_NAMES[arch]
    lacking = {n: t for n, t in state.items() if n != f"{mlp}.{up}.weight"}
    with pytest.raises(WeightLoadError, match="missing weights: layers.0.mlp") as refused:
        load(lacking)   # the fused parameter named with the tensors that filled its other parts: not the up one
    assert f"{mlp}.{gate}.weight" in str(refused.value) and f".{up}" not in str(refused.value), refused.value
    twice = list(lacking.items()) + [(f"{mlp}.{gate}.weight", state[f"{mlp}.{gate}.weight"])]
    with pytest.raises(WeightLoadError, match=f"{mlp}.{gate}.weight: fills the part .* stored twice"):
        build_model(config, torch.float32, "cpu").load_weights(twice)
    if arch != "llama":
        experts = mlp.removesuffix(".1")
        padded = f"{experts}.01.{down}.weight"
        with pytest.raises(WeightLoadError, match=f"experts.01.{down}.weight: fills the part"):
            load({**state, padded: state[f"{mlp}.{down}.weight"]})
        past = f"{experts}.{config.num_experts}.{down}.weight"
        with pytest.raises(WeightLoadError, match=f"{past}: expert {config.num_experts} of a config with num_exp"):
            load({**state, past: state[f"{mlp}.{down}.weight"]})
        fused = "model.layers.0.mlp.experts.gate_up_proj"   # transformers' fused layout: named, not a ValueError
        with pytest.raises(WeightLoadError, match=f"experts.gate_up_proj: not a tensor of {config.architecture}"):
            load({**state, fused: state[f"{mlp}.{down}.weight"]})


@pytest.mark.parametrize("own_head", [False, True])
def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, builtin_path, own_head):
    """Gemma 3's larger checkpoints are `Gemma3ForConditionalGeneration` (a vision tower beside the text model,
    whose tensors sit under `language_model.`): served as the text model, the rest of the checkpoint skipped,
    greedy text token-identical to transformers' multimodal model on text input. `own_head`: the top-level
    config unties the head (transformers reads the flag there) and the checkpoint is in transformers 5's own
    layout, the head a top-level `lm_head.weight` (it was skipped and the embedding served as the head)."""
    import transformers

    text_config = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=512, initializer_range=0.2,
                                                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **GEMMA3)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text_config.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, initializer_range=0.2,
                                       **({"tie_word_embeddings": False} if own_head else {}))
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    assert own_head != torch.equal(hf.lm_head.weight, hf.model.language_model.embed_tokens.weight)
    folder = tmp_path / "gemma3-mm"
    hf.save_pretrained(folder, **({"save_original_format": False} if own_head else {}))
    _assert_serves_its_text_model(hf, folder, builtin_path, "Gemma3ForCausalLM")


def test_a_multimodal_llama4_checkpoint_serves_its_text_model(tmp_path, builtin_path):
    """Llama 4's checkpoints are `Llama4ForConditionalGeneration` (a vision tower and projector beside the text model
    under `language_model.`, its experts stacked): served as the text model, greedy text token-identical to
    transformers' (its text model's: transformers 5.24's multimodal forward fails on text alone, building its
    output from a field the text model's output lacks)."""
    import transformers

    text_config = transformers.Llama4TextConfig(vocab_size=512, hidden_size=64, num_attention_heads=4,
                                                num_key_value_heads=2, max_position_embeddings=512,
                                                initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                                                **{**LLAMA4, "interleave_moe_layer_step": 2})
    vision = transformers.Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14,
                                             vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=text_config.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    folder = tmp_path / "llama4-mm"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf.language_model, folder, builtin_path, "Llama4ForCausalLM")


def _assert_serves_its_text_model(hf, folder, builtin_path, text_arch: str, prefix: str = "language_model.") -> None:
    """The multimodal checkpoint `hf` saved in `folder` serves as its text model `text_arch` (the tensors under
    `prefix`), and its greedy text equals transformers' multimodal model's on text input."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=64,
                                 progress=False)
    assert (engine.model_config.architecture, engine.model_config.text_weights_prefix) == (text_arch, prefix)
    # the weights it reports holding are the text model's (the checkpoint on disk holds the vision tower too)
    assert engine.weights_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 16, eos_ids=None)
    assert_all_free(engine)


@pytest.mark.parametrize("text_type", ["mistral", "ministral3", "mistral4"])
def test_a_multimodal_mistral3_checkpoint_serves_its_text_model(tmp_path, builtin_path, text_type):
    """Mistral 3's multimodal checkpoints (`Mistral3ForConditionalGeneration`: a Pixtral vision tower and a projector
    beside a text model under `language_model.`): Mistral Small 3.1's, a Mistral text model, those from December
    2025 on (Ministral 3, Devstral 2), whose text_config is `ministral3` (its queries' scaling too), and Mistral Small
    4's, `mistral4` (latent attention and experts, stacked as transformers saves them), each served as its text model,
    greedy text token-identical to transformers' multimodal model on text input; another family's text_config is
    refused."""
    import transformers

    from engine.config import ConfigError
    from engine.model_config import ModelConfig

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5)
    text = {"mistral": lambda: transformers.MistralConfig(**shape, head_dim=32, sliding_window=None, rope_theta=1e6),
            "ministral3": lambda: transformers.Ministral3Config(**shape, **MINISTRAL3),
            "mistral4": lambda: transformers.Mistral4Config(**{**shape, **MISTRAL4})}[text_type]()
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # the text model's matrices with a large std (its norms stay 1): no greedy ties
        for param in [*hf.model.language_model.parameters(), hf.lm_head.weight]:
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    folder = tmp_path / text_type
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, {"mistral": "MistralForCausalLM", "ministral3":
                                  "Ministral3ForCausalLM", "mistral4": "Mistral4ForCausalLM"}[text_type])
    saved = json.loads((folder / "config.json").read_text())
    saved["text_config"]["model_type"] = "llama"
    with pytest.raises(ConfigError, match=r"^text_config\.model_type: .* served as 'mistral' .*got 'llama'"):
        ModelConfig.from_hf_config(saved)


def _lfm_vl_configs(family: str):
    """(text config, vision config, the multimodal config's class) of a tiny LFM2-VL or LFM3-VL."""
    import transformers

    shape = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, initializer_range=0.2, intermediate_size=96)
    if family == "lfm2":
        return (transformers.Lfm2Config(**shape, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                        block_multiple_of=16),
                transformers.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_patches=16, patch_size=4),
                transformers.Lfm2VlConfig)
    return (transformers.Lfm3Config(**shape, num_hidden_layers=4, head_dim=16, sliding_window=8, pad_token_id=0,
                                    layer_types=["conv", "sliding_attention", "full_attention", "conv"]),
            transformers.Lfm3VlVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, patch_size=4),
            transformers.Lfm3VlConfig)


@pytest.mark.parametrize("family", ["lfm2", "lfm3"])
def test_a_multimodal_lfm_checkpoint_serves_its_text_model(tmp_path, builtin_path, family):
    """LFM2-VL (`Lfm2VlForConditionalGeneration`: a SigLIP2 vision tower and a projector beside an LFM2 text model)
    and LFM3-VL (`Lfm3VlForConditionalGeneration`: its own tower beside an LFM3 text model: sliding, full and
    convolution layers, head gates, sandwich norms), the text model under `language_model.` and the head tied to its
    embedding, served as their text model, greedy text token-identical to transformers' multimodal model on text
    input."""
    import transformers

    text, vision, config_class = _lfm_vl_configs(family)
    config = config_class(text_config=text.to_dict(), vision_config=vision.to_dict(), projector_hidden_size=32)
    torch.manual_seed(0)
    model_class = getattr(transformers, f"{config_class.__name__.removesuffix('Config')}ForConditionalGeneration")
    hf = model_class(config).eval()
    with torch.no_grad():   # the text model's matrices with a large std (its norms stay 1): no greedy ties
        for param in hf.model.language_model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path / f"{family}_vl")
    _assert_serves_its_text_model(hf, tmp_path / f"{family}_vl", builtin_path, f"{family.capitalize()}ForCausalLM")


# --- slow: the builtin model under every block size x preemption mode x prefix-cache state --------

SWEEP_TOKENS = 64
SWEEP_PROMPTS = CHAT_PROMPTS + [
    "Give me a recipe for pancakes with exact quantities.",
    "What are the planets of the solar system, in order from the sun?",
]
SWEEP_POOL_TOKENS = 384     # about a third of what the 10 sequences reach together: they preempt as they grow


@pytest.fixture(scope="module")
def sweep_reference(builtin_path, hf_smollm2):
    """The sweep's chat prompts and transformers' greedy continuations of them (cut at EOS)."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(builtin_path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in SWEEP_PROMPTS]
    eos = sorted(set(tok.eos_token_ids))
    return prompts, [_truncate_at_eos(_hf_greedy(hf_smollm2, p, SWEEP_TOKENS, eos), set(eos)) for p in prompts]


def _make_sweep_engine(builtin_path, block_size: int, mode: str, prefix_caching: bool) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, preemption_mode=mode,
                            swap_space_bytes=(32 << 20) if mode != "recompute" else 0,
                            enable_prefix_caching=prefix_caching)
    pool = PoolConfig(num_blocks=SWEEP_POOL_TOKENS // block_size, scheduler=sched)
    engine = LLMEngine(EngineConfig(model=str(builtin_path), device="cpu", dtype="float32",
                                    cache=CacheConfig(block_size=block_size),
                                    pools=(pool,)), progress=False)
    if mode == "auto":  # costs that make short victims recompute and long ones swap
        price_preemption(engine.schedulers["default"].cost_model, break_even=100)
    return engine


def _assert_matches(engine: LLMEngine, prompts: list[list[int]], want: list[list[int]]) -> None:
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=SWEEP_TOKENS))
    for prompt, out, expected in zip(prompts, outs, want):
        assert out.outputs[0].token_ids == expected, engine.tokenizer.decode(prompt)
    assert_all_free(engine)


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", PREEMPTION_MODES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_builtin_sweep_matches_transformers(builtin_path, sweep_reference, block_size, mode, prefix_caching):
    prompts, want = sweep_reference
    engine = _make_sweep_engine(builtin_path, block_size, mode, prefix_caching)
    _assert_matches(engine, prompts, want)
    stats = engine.schedulers["default"].stats
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if mode == "swap":
        assert stats.num_swap_preemptions == stats.num_preemptions
    bm = engine.schedulers["default"].block_manager
    if not prefix_caching:
        assert bm.num_prefix_hits == 0
    else:   # one prompt twice: the second run finds every full block of it in the cache
        _assert_matches(engine, prompts[3:4], want[3:4])
        hits = bm.num_prefix_hits
        _assert_matches(engine, prompts[3:4], want[3:4])
        assert bm.num_prefix_hits - hits == (len(prompts[3]) - 1) // block_size * block_size


def test_the_grouped_experts_equal_the_expert_loop(monkeypatch):
    """Qwen3-MoE's two ways to run the experts: the grouped matmuls (no question to the device) and the loop
    over the experts hit (transformers' way, the fallback where the grouped matmul lacks a dtype), on the
    same routing: equal to float32 rounding; a dtype the grouped matmul lacks falls back for good."""
    from engine.model_config import ModelConfig
    from engine.models.qwen3_moe import GROUPED_MM, SparseMoeBlock
    from engine.parallel import Collectives, ShardShape
    from kernels import fused

    config = ModelConfig.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 3, "moe_intermediate_size": 16, "norm_topk_prob": True})
    block = SparseMoeBlock(config, ShardShape.of(config), Collectives(), fused)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        x = torch.randn(37, 32, generator=gen)
        grouped = block(x)
        assert block._grouped == (GROUPED_MM is not None)
        block._grouped = False
        torch.testing.assert_close(grouped, block(x), atol=1e-5, rtol=1e-5)
        def lacking(*args, **kwargs):
            raise RuntimeError("grouped_mm: this dtype is not supported here")

        monkeypatch.setattr("engine.models.qwen3_moe.GROUPED_MM", lacking)
        block._grouped = True
        reduced = []   # the rank's collective: once a step, whichever way the experts ran
        monkeypatch.setattr(block.comm, "all_reduce", lambda t: reduced.append(t) or t)
        torch.testing.assert_close(block(x), grouped, atol=1e-5, rtol=1e-5)   # the loop answered
        assert block._grouped is False and len(reduced) == 1

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr("engine.models.qwen3_moe.GROUPED_MM", out_of_memory)
        block._grouped = True
        with pytest.raises(torch.OutOfMemoryError):   # a step too large now: raised, the grouped matmul kept
            block(x)
        assert block._grouped is True


@pytest.mark.parametrize("arch,overrides,knob,off", [
    ("gemma2", GEMMA2, "final_logit_softcapping", None), ("granite", GRANITE, "logits_scaling", 1.0),
    ("cohere", dict(logit_scale=0.5), "logit_scale", 1.0)])
def test_what_the_head_does_to_the_logits_shows_in_transformers_logprobs(tmp_path, builtin_path, arch, overrides,
                                                                        knob, off):
    """Greedy tokens cannot show Gemma 2's soft-cap of the logits or Granite's and Cohere's scaling (all keep the
    order): the logprobs do. A prompt's logprobs equal transformers' log-softmax of its logits (a cap of 5 and the
    scalings bend these), and differ without the head's transform."""
    import dataclasses

    import transformers

    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, *range(40, 70)]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1], dim=-1)
    want = want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = torch.tensor(engine.generate([prompt], params)[0].prompt_logprobs)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    engine.model.config = dataclasses.replace(engine.model.config, **{knob: off})
    uncapped = torch.tensor(engine.generate([prompt], params)[0].prompt_logprobs)
    assert (uncapped - want).abs().max() > 0.1


# Phi-4-mini's rope on the tiny model: a longrope over 0.75 of each head (6 of its 8 frequency pairs), from an
# original context of 32 positions to 512, its embeddings tied
PHI4_MINI = dict(pad_token_id=0, tie_word_embeddings=True, original_max_position_embeddings=32, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0 + 0.15 * i for i in range(6)], "long_factor": [2.0 + 1.7 * i for i in range(6)]})


@pytest.mark.parametrize("arch, towers", [("phi3", {}), ("phi4_multimodal", PHI4_MM_TOWERS)])
def test_a_longrope_turns_by_the_set_transformers_picks_for_what_each_pool_serves(tmp_path, builtin_path, arch,
                                                                                    towers):
    """transformers turns each forward by LongRoPE's short factors while the sequence is within the original
    context, by its long ones past it; the engine turns every sequence of a pool by one set (a key cached under
    the short set would go stale as the sequence grew): the short set where every pool stays within the original
    context, which transformers uses on prompts and outputs that fit in it; the long set where a pool serves past
    it, which transformers uses on prompts that start past it. Greedy, token-identical either way (the partial
    rotary's attention factor on the turned pairs only: it scaled the pairs left alone too). Phi-4-mini's rope, on
    Phi-3's model and on Phi-4-multimodal's text model."""
    import transformers

    folder = make_tiny_model(tmp_path / "phi4", arch, builtin_path, **PHI4_MINI, **towers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    for max_model_len, lengths, long in ((32, (3, 9, 15), False), (0, (40, 33, 60), True)):
        engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64,
                                     max_num_batched_tokens=64, max_model_len=max_model_len, progress=False)
        assert engine.model_config.rope_scaling.long is long
        prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]


def _tiny_qwen_vl(folder, builtin_path, kind: str):
    """A tiny Qwen VL checkpoint (`kind`: qwen2_5_vl, qwen3_vl or qwen3_vl_moe), built by transformers' own config
    classes and model, its vision tower too, saved in transformers 5's layout, with the builtin tokenizer beside
    it; MRoPE's sections over the heads' 8 frequency pairs. Returns transformers' model."""
    import shutil

    import transformers

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
    if kind == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3],
                                                     "rope_theta": 10000.0}},
            vision_config={**vision, "fullatt_block_indexes": [0]}, initializer_range=0.2)
    elif kind == "qwen3_vl_moe":   # 8 experts of 24, 2 a token; its experts stored stacked
        config = transformers.Qwen3VLMoeConfig(
            text_config={**text, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 24, "tie_word_embeddings": False, "rope_parameters": {
                             "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                             "rope_theta": 10000.0}},
            vision_config={**vision, "deepstack_visual_indexes": [0]}, initializer_range=0.2, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3VLConfig(
            text_config={**text, "head_dim": 16, "rope_parameters": {
                "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0}},
            vision_config={**vision, "deepstack_visual_indexes": [0]}, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (builtin_path / name).exists():
            shutil.copy(builtin_path / name, folder / name)
    return model


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_a_qwen_vl_checkpoint_serves_its_text_model_as_transformers_runs_it_on_text(tmp_path, builtin_path, kind):
    """Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE as their text models (Qwen2's, Qwen3's, Qwen3-MoE's, its experts read
    from the stacked tensors it stores): on text MRoPE's three positions are one, so the text model's rope is
    theirs. Greedy, token-identical to transformers' own VL model given the prompt's ids, from transformers 5's
    layout (`model.language_model.`) and from the hub checkpoints' (Qwen2.5-VL's: the text model at `model.`, the
    vision tower at `visual.`, the text keys at config.json's top; Qwen3-VL-MoE's: each stacked expert tensor
    [experts, in, out])."""
    from safetensors.torch import save_file

    folder = tmp_path / kind
    hf = _tiny_qwen_vl(folder, builtin_path, kind)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 23, 41)]
    want = [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    folders = [folder]
    if kind == "qwen2_5_vl":
        flat = tmp_path / "hub"
        shutil.copytree(folder, flat)
        weights = {n.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t.contiguous()
                   for n, t in iter_weights(folder)}
        for path in [*flat.glob("*.safetensors"), *flat.glob("*.safetensors.index.json")]:
            path.unlink()
        save_file(weights, str(flat / "model.safetensors"))
        cfg = json.loads((flat / "config.json").read_text())   # the rope as the hub's configs spell it: mrope
        text = {k: v for k, v in cfg["text_config"].items() if k != "rope_parameters"}
        (flat / "config.json").write_text(json.dumps({
            **{k: v for k, v in cfg.items() if k != "text_config"}, **text, "model_type": "qwen2_5_vl",
            "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}))
        folders.append(flat)
    if kind == "qwen3_vl_moe":   # the hub checkpoints' experts [experts, in, out]; transformers 5 saves [out, in]
        hub = tmp_path / "hub"
        shutil.copytree(folder, hub)
        weights = {n: (t.transpose(1, 2) if ".mlp.experts." in n else t).contiguous() for n, t in iter_weights(folder)}
        for path in [*hub.glob("*.safetensors"), *hub.glob("*.safetensors.index.json")]:
            path.unlink()
        save_file(weights, str(hub / "model.safetensors"))
        folders.append(hub)
    for path in folders:
        engine = LLMEngine.from_args(str(path), dtype="float32", block_size=8, num_blocks=64, progress=False)
        assert engine.model_config.architecture == {"qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM",
                                                    "qwen3_vl_moe": "Qwen3MoeForCausalLM"}[kind]
        text_params = sum(p.numel() for n, p in hf.named_parameters() if ".visual." not in f".{n}")
        assert engine.model_config.num_params() == text_params
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want, path


@pytest.mark.parametrize("kind", ["glm4v_moe", "glm4v", "glm46v"])
def test_a_glm_v_checkpoint_serves_its_text_model(tmp_path, builtin_path, kind):
    """GLM-4.5V (`Glm4vMoeForConditionalGeneration`: GLM-4.5's text model, q/k/v biased, half of each head turned with
    rotate-half pairs), GLM-4.1V and GLM-4.6V (`Glm4vForConditionalGeneration`, `Glm46VForConditionalGeneration`:
    GLM-4's sandwich-normed layer with its interleaved partial rotary, heads of hidden_size / num_attention_heads),
    each beside a vision tower at `model.visual.`: on text their MRoPE's three positions are one (its
    `mrope_section` read and ignored), so each serves as its text model, greedy text token-identical to transformers'
    multimodal model."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  rope_parameters=rope)
    text = transformers.Glm4vMoeTextConfig(**common, **GLM4_MOE) if kind == "glm4v_moe" else \
        transformers.Glm4vTextConfig(**common, num_hidden_layers=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=64)
    config_class, model_class, text_arch = {
        "glm4v_moe": (transformers.Glm4vMoeConfig, transformers.Glm4vMoeForConditionalGeneration, "Glm4MoeForCausalLM"),
        "glm4v": (transformers.Glm4vConfig, transformers.Glm4vForConditionalGeneration, "Glm4ForCausalLM"),
        "glm46v": (transformers.Glm46VConfig, transformers.Glm46VForConditionalGeneration, "Glm4ForCausalLM")}[kind]
    torch.manual_seed(0)
    hf = model_class(config_class(text_config=text.to_dict(), vision_config=vision)).eval()
    with torch.no_grad():   # transformers starts the biases (and the router's correction bias) at zero
        for name, tensor in [*hf.named_buffers(), *hf.named_parameters()]:
            if name.endswith("bias") and ".visual." not in f".{name}":
                tensor.normal_(0.0, 0.5)
    folder = tmp_path / kind
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, text_arch)


def test_a_phi3_checkpoint_is_read_through_its_fused_tensors_and_a_wrong_one_is_named(tmp_path, builtin_path):
    """Phi-3 stores each layer's q/k/v and gate/up fused: read split, so a fused tensor of the wrong rows is named
    with the rows the config expects, and a part also stored on its own (a q_proj beside the qkv_proj) is a tensor
    stored twice, not a silent overwrite."""
    from engine.model import WeightLoadError
    from engine.model_config import ModelConfig

    folder = make_tiny_model(tmp_path / "phi3", "phi3", builtin_path, pad_token_id=0)
    state = dict(iter_weights(folder))
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert qkv in state and "model.layers.1.mlp.gate_up_proj.weight" in state   # the checkpoint's own layout
    config = ModelConfig.from_folder(folder)

    def load(tensors):
        build_model(config, torch.float32, "cpu").load_weights(tensors.items())

    load(state)
    with pytest.raises(WeightLoadError, match=rf"{qkv}: shape \(112, 64\) does not match the config \(128 rows: "
                                              r"q_proj 64 \+ k_proj 32 \+ v_proj 32\)"):
        load({**state, qkv: state[qkv][:112]})
    with pytest.raises(WeightLoadError, match="fills the part .* stored twice"):
        load({**state, "model.layers.1.self_attn.q_proj.weight": state[qkv][:64]})


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_a_bfloat16_expert_layer_rounds_as_transformers_does(arch):
    """One sparse layer in bfloat16, on the loop over the experts hit, against transformers' own block with the
    same weights: equal to the bit. Qwen3-MoE rounds the router's weights to bfloat16 before the products,
    Mixtral keeps them float32 and rounds each product (`moe_float_weights`): Mixtral's block run with Qwen3-MoE's
    rounding differs from transformers'."""
    import transformers

    from engine.model_config import ModelConfig
    from engine.models.qwen3_moe import SparseMoeBlock
    from engine.parallel import Collectives, ShardShape
    from kernels import fused

    shape = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=3)
    if arch == "MixtralForCausalLM":
        hf_config = transformers.MixtralConfig(**shape, intermediate_size=16, num_local_experts=8)
        hf_block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_config)
    else:
        hf_config = transformers.Qwen3MoeConfig(**shape, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                                norm_topk_prob=True)
        hf_block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config)
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": [arch]})
    assert config.moe_float_weights == (arch == "MixtralForCausalLM")
    block = SparseMoeBlock(config, ShardShape.of(config), Collectives(), fused).to(torch.bfloat16)
    block._grouped = False   # the loop: transformers' order of the sums
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ours, theirs in ((block.gate.weight, hf_block.gate.weight), (block.w13, hf_block.experts.gate_up_proj),
                             (block.w2, hf_block.experts.down_proj)):
            ours.copy_(torch.randn(ours.shape, generator=gen) * 0.3)
            theirs.data = ours.detach().clone()
        x = torch.randn(37, 32, generator=gen).to(torch.bfloat16)
        expected = hf_block.to(torch.bfloat16)(x[None])[0]
        assert torch.equal(block(x), expected)
        if arch == "MixtralForCausalLM":
            block.float_weights = False
            assert not torch.equal(block(x), expected)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_bfloat16_gpt_oss_expert_layer_rounds_as_transformers_does(grouped):
    """GPT-OSS's sparse layer in bfloat16 against transformers' `GptOssMLP` with the same weights, read through
    the engine's loading (the router renamed, the stacked, interleaved gate/up columns taken apart): equal to
    the bit on the loop over the experts hit (the softmax of the top logits in bfloat16, each bias added after its
    product, the clamp); the grouped matmuls to bfloat16 rounding."""
    import transformers

    from engine.model_config import ModelConfig

    hf_config = transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          num_local_experts=8, num_experts_per_tok=3, swiglu_limit=1.0)
    hf_block = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(hf_config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf_block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    model = build_model(config, torch.bfloat16, "cpu")
    block = model.layers[0].mlp
    names = {f"layers.0.mlp.{name}": tensor for name, tensor in hf_block.state_dict().items()}
    reads = [read for name, tensor in names.items() for read in model.read_tensor(name, name, tensor)]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in reads:
            target, part = model._destination(name, name)
            part(params[target].data).copy_(tensor)
    block._grouped = grouped
    x = torch.randn(37, 32, generator=gen).to(torch.bfloat16)
    expected = hf_block.to(torch.bfloat16)(x[None])[0][0]
    if grouped:
        torch.testing.assert_close(block(x), expected, atol=0.05, rtol=0.02)
    else:
        assert torch.equal(block(x), expected)


def _mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., rows, groups, 16] and scales [..., rows, groups] for weights of `shape` [..., rows,
    columns]: every e2m1 code, scales from 2^-8 to 2^-3 (weights up to 0.75, as the tiny models' are)."""
    *rows, cols = shape
    blocks = torch.randint(0, 256, (*rows, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(119, 125, (*rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def mxfp4_gpt_oss(folder: Path, builtin_path: Path, **overrides) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    """A tiny GPT-OSS checkpoint whose experts are stored in MXFP4, as OpenAI's are (`*_blocks` / `*_scales`, random
    codes, an intermediate size of 64 unless overridden): (its folder, transformers' float32 model holding those
    weights as transformers' own dequantization gives them, the stored tensors)."""
    import transformers
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kernels.mxfp4 import dequantize_mxfp4

    # MXFP4 scales groups of 32 inputs: an intermediate size of 64
    folder = make_tiny_model(folder, "gpt_oss", builtin_path, **{**GPT_OSS, "intermediate_size": 64, **overrides})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = {name: tensor.clone() for name, tensor in iter_weights(folder)}
    gen = torch.Generator().manual_seed(7)
    for path in [p for p in state if p.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = state.pop(path)                                      # [experts, in, out]
        blocks, scales = _mxfp4((stacked.shape[0], stacked.shape[2], stacked.shape[1]), gen)
        state[f"{path}_blocks"], state[f"{path}_scales"] = blocks, scales
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # [experts, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), theirs)
        assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2),
                           convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
        with torch.no_grad():
            hf.get_parameter(path).copy_(theirs)
    for shard in folder.glob("model*.safetensors*"):
        shard.unlink()
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, hf, state


def test_an_mxfp4_gpt_oss_checkpoint_serves_what_transformers_dequantizes(tmp_path, builtin_path):
    """OpenAI's GPT-OSS checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`): dequantized as they are
    read, they are transformers' own dequantization (`convert_moe_packed_tensors`) to the bit, in float32 and
    bfloat16, and the engine serves the checkpoint greedy token for token with transformers' model holding those
    weights. A blocks tensor without its scales, or of the wrong shape, is refused by name."""
    from engine.model import WeightLoadError
    from engine.model_config import ModelConfig

    folder, hf, state = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    prompts = [[1, *range(40, 70)], [5, 9, 200, 3]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 12, eos_ids=None)
    model_config = ModelConfig.from_folder(folder)
    blocks = "model.layers.1.mlp.experts.down_proj_blocks"
    with pytest.raises(WeightLoadError, match=r"missing weights: model.layers.1.mlp.experts.down_proj_scales "
                                              r"\(MXFP4: its blocks came alone\)"):
        build_model(model_config, torch.float32, "cpu").load_weights(
            (k, v) for k, v in state.items() if k != blocks.replace("blocks", "scales"))
    scales = blocks.replace("blocks", "scales")
    with pytest.raises(WeightLoadError, match=rf"{scales}: MXFP4 blocks .* got \(4, 64, 2, 8\)"):
        build_model(model_config, torch.float32, "cpu").load_weights(
            {**state, blocks: state[blocks][..., :8]}.items())


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_latent_cache_holds_one_plane_and_serves_preemption_prefix_hits_and_forks(tmp_path, builtin_path, kv):
    """DeepSeek's cache holds each token's latent and rotated key once: one plane of one 'KV head' of
    kv_lora_rank + qk_rope_head_dim, and S_KV says as much. Under pressure (swap preemption, prefix hits, n = 2 forks
    copying on write) every request ends, every block comes back, and with the model's cache the greedy outputs are
    transformers'; an FP8 cache of it (its one scale for K and V) serves alike."""
    folder = make_tiny_model(tmp_path / "ds", "deepseek_v3", builtin_path, **{**DEEPSEEK, "q_lora_rank": 48})
    engine = pressure_engine(folder, kv)
    assert engine.kv_cache.data.shape == (3, 1, 14, 8, 1, 40)
    assert engine.kv_bytes_per_token == 3 * 40 * (1 if kv == "fp8" else 4)
    attn = engine.model.layers[0].self_attn
    assert attn.k_scale == attn.v_scale
    assert_serves_under_pressure(engine, folder, kv)


def pressure_engine(folder, kv: str) -> LLMEngine:
    """An engine on `folder` with a pool of 14 blocks of 8 that swaps what it preempts, its KV cache `kv`."""
    pool = PoolConfig(num_blocks=14, scheduler=SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap",
                                                               swap_space_bytes=8 << 20))
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", cache=CacheConfig(block_size=8),
                                  pools=(pool,), kv_cache_dtype=kv), progress=False)


def assert_serves_under_pressure(engine, folder, kv: str) -> None:
    """Three prompts sharing 32 tokens (prefix hits) and another, one of them sampled twice (n = 2: forks copying on
    write), in `pressure_engine`'s pool (swap preemption): every request ends and every block comes back; with the
    model's cache (`kv` auto) the greedy outputs are transformers'."""
    import transformers

    shared = list(range(40, 72))
    prompts = [shared + [90 + i] for i in range(3)] + [[5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True), greedy]
    outs = engine.generate(prompts, params)
    stats, bm = engine.schedulers["default"].stats, engine.schedulers["default"].block_manager
    assert stats.num_swap_preemptions > 0 and bm.num_prefix_hits > 0
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [24] * 5
    assert_all_free(engine)
    if kv == "auto":
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for i in (0, 1, 3):
            assert outs[i].outputs[0].token_ids == _hf_greedy(hf, prompts[i], 24, eos_ids=None)


def _taken_weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder`, its safetensors files and index removed (to be written anew)."""
    from safetensors.torch import load_file

    weights = {}
    for path in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        if path.suffix == ".safetensors":
            weights.update(load_file(path))
        path.unlink()
    return weights


def _fp8_checkpoint(folder, block: tuple[int, int] | None) -> None:
    """The tiny checkpoint in `folder` rewritten as DeepSeek's and Qwen's FP8 releases store theirs: each layer's
    projection an e4m3 `weight` and a float32 `weight_scale_inv` per block (the block's largest value over 448; the
    last blocks partial), the scales in a shard of their own (pairs that cross files), `quantization_config` saying
    so."""
    from safetensors.torch import save_file

    weights = _taken_weights(folder)
    quantized, scales = {}, {}
    for name, w in weights.items():
        if not (name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")) and ".layers." in name):
            quantized[name] = w   # (Mixtral's experts: w1, w2, w3)
            continue
        if block is None:   # one scale for the tensor (a 0-d float32, as transformers saves it), a static input's
            scale = w.abs().amax().clamp(min=1e-12) / 448.0
            quantized[name] = (w / scale).to(torch.float8_e4m3fn)
            scales[name + "_scale_inv"] = scale.reshape(())
            scales[name.removesuffix("weight") + "activation_scale"] = torch.tensor(0.5)
            continue
        rows, cols = w.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[:rows, :cols] = w
        scale = padded.reshape(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        quantized[name] = (w / expanded).to(torch.float8_e4m3fn)
        scales[name + "_scale_inv"] = scale
    files = {"model-00001-of-00002.safetensors": quantized, "model-00002-of-00002.safetensors": scales}
    for file, tensors in files.items():
        save_file(tensors, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, tensors in files.items() for n in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static",
                                  "fmt": "e4m3", "weight_block_size": list(block) if block else None}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_a_per_tensor_fp8_checkpoint_serves_what_transformers_dequantizes(tmp_path, builtin_path):
    """An FP8 checkpoint of one scale a weight and a static activation scale (`weight_block_size` null: Mistral's FP8
    releases' kind, as transformers saves it): each weight its values times its scale (the activation scales not
    read), greedy token-identical to transformers' own FP8 loading of it."""
    import transformers

    folder = make_tiny_model(tmp_path / "fp8", "llama", builtin_path, head_dim=16)
    _fp8_checkpoint(folder, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert engine.model_config.fp8_weight_block == (2 ** 31 - 1,) * 2
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_an_fp8_block_scaled_checkpoint_serves_what_transformers_dequantizes(tmp_path, builtin_path, arch):
    """An FP8 checkpoint with block scales (blocks of 16 x 32), its scales in another shard than its weights: the
    engine dequantizes each weight as its scales arrive and decodes greedily as transformers' own FP8 loading (which
    dequantizes on a machine without FP8 matmuls); Qwen3.5's too (its gated q_proj dequantized, then split, its
    linear layers' out_proj); a weight without its scales, or scales of the wrong shape, are refused by name.
    (Partial blocks, which transformers' dequantizing refuses and DeepSeek's 576-row latent projection has:
    tests/engine/test_weights.py.)"""
    import transformers
    from safetensors.torch import load_file, save_file

    from engine.model import WeightLoadError

    folder = make_tiny_model(tmp_path / "fp8", arch, builtin_path, head_dim=16,
                             **({k: v for k, v in QWEN3_5.items() if k != "head_dim"} if arch == "qwen3_5" else {}))
    _fp8_checkpoint(folder, (16, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert engine.model_config.fp8_weight_block == (16, 32)
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    shard, index = folder / "model-00002-of-00002.safetensors", folder / "model.safetensors.index.json"
    scales, weight_map = load_file(shard), json.loads(index.read_text())
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    for broken, message in (({k: v for k, v in scales.items() if k != name}, "down_proj.weight_scale_inv: missing"),
                            ({**scales, name: scales[name][:, :2].contiguous()}, "takes scales of shape")):
        save_file(broken, str(shard))
        index.write_text(json.dumps({**weight_map, "weight_map": {
            n: f for n, f in weight_map["weight_map"].items() if n in broken or f != shard.name}}))
        with pytest.raises(WeightLoadError, match=message):
            LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)


def _compressed_fp8_checkpoint(folder, strategy: str) -> dict[str, torch.Tensor]:
    """The tiny checkpoint in `folder` rewritten as llm-compressor's FP8 releases store theirs (compressed-tensors,
    float-quantized; `fbgemm`: as FBGEMM's, its per-channel scales): each layer's projection an e4m3 `weight` and its `weight_scale` (each output channel's largest
    value over 448, [rows, 1]; the tensor's, [1], beside a static activation scheme's `input_scale`; or each 16 x 32
    block's), the head left in float. Returns each projection's weight as the format defines it: values x scales."""
    from safetensors.torch import save_file

    weights = _taken_weights(folder)
    stored, dequantized = {}, {}
    for name, w in weights.items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            stored[name] = w
            continue
        if strategy in ("channel", "fbgemm"):
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            expanded = scale
        elif strategy == "tensor":
            scale = (w.abs().amax().clamp(min=1e-12) / 448.0).reshape(1)
            expanded = scale
            stored[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.5])
        else:
            scale = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 32, 32).abs().amax(dim=(1, 3)) / 448.0
            expanded = scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
        stored[name] = (w / expanded).to(torch.float8_e4m3fn)
        stored[name + "_scale"] = scale
        dequantized[name] = stored[name].float() * expanded
    save_file(stored, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    if strategy == "fbgemm":   # FBGEMM's: per-channel scales, the modules it leaves in float named
        cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                      "modules_to_not_convert": ["lm_head"]}
        (folder / "config.json").write_text(json.dumps(cfg))
        return dequantized
    weights_scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
                      **({"block_structure": [16, 32]} if strategy == "block" else {})}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": weights_scheme,
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                  "dynamic": strategy != "tensor"}}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block", "fbgemm"])
def test_an_llm_compressor_fp8_checkpoint_serves_its_dequantized_weights(tmp_path, builtin_path, strategy):
    """llm-compressor's FP8 checkpoints (compressed-tensors, float-quantized: per-channel scales, as the -FP8-dynamic
    releases; per-tensor ones with static activation scales, which are not read; 16 x 32 blocks) and FBGEMM's
    (`fbgemm_fp8`: per-channel scales): the engine serves each weight as its values times its scales, greedy
    token-identical to transformers' model holding those weights; a weight without its scale is refused by name."""
    import transformers
    from safetensors.torch import load_file, save_file

    from engine.model import WeightLoadError

    folder = make_tiny_model(tmp_path / "fp8", "llama", builtin_path, intermediate_size=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in _compressed_fp8_checkpoint(folder, strategy).items():
            hf.get_parameter(name).copy_(weight)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert engine.model_config.fp8_scale_suffix == ".weight_scale"
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="layers.1.mlp.up_proj.weight_scale: missing"):
        LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_deepseek_v4_resumes_cached_prefixes_and_preempted_sequences(tmp_path, builtin_path, mode):
    """DeepSeek V4 keeps every piece of its attention in its cache rows (`engine.deepseek_v4_config`): a prompt whose
    first 40 tokens are cached (their compressors' values and gates, their windows' entries with them), and
    sequences preempted for want of blocks, recomputed or swapped out and back, answer as transformers does."""
    import transformers

    folder = make_tiny_model(tmp_path / "v4", "deepseek_v4", builtin_path, **DEEPSEEK_V4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = preempting_engine(folder, mode)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(3, 512, (45,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [first, first[:40] + torch.randint(3, 512, (7,), generator=gen).tolist()]
    for prompt in prompts:   # one after the other: the second finds the first's 5 blocks cached
        assert engine.generate([prompt], params)[0].outputs[0].token_ids == _hf_greedy(hf, prompt, 12, eos_ids=None)
    assert engine.schedulers["default"].block_manager.num_prefix_hits >= 40
    assert_preempted_batch_answers(engine, hf, gen, mode)


def preempting_engine(folder, mode: str) -> LLMEngine:
    """An engine of `folder`'s model on 12 blocks of 8 (six sequences of 20-30 tokens preempt one another), preempting
    by `mode`: recompute, or swap (8 MiB of swap space)."""
    sched = SchedulerConfig(max_num_batched_tokens=24, preemption_mode=mode,
                            swap_space_bytes=(8 << 20) if mode == "swap" else 0)
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", cache=CacheConfig(block_size=8),
                                  pools=(PoolConfig(num_blocks=12, scheduler=sched),)), progress=False)


def assert_preempted_batch_answers(engine: LLMEngine, hf, gen: torch.Generator, mode: str) -> None:
    """Six prompts (12 blocks' worth on a `preempting_engine`) decoded together preempt one another, all by `mode`, and
    each answers as transformers' `hf` does; nothing is left held."""
    batch = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (20, 27, 22, 30, 25, 21)]
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16, eos_ids=None) for p in batch]
    stats = engine.schedulers["default"].stats
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions if mode == "swap" else
                                          stats.num_recompute_preemptions) == stats.num_preemptions
    assert_all_free(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, overrides", [("deepseek_v4", DEEPSEEK_V4), ("hy_v4", HYV4),
                                             ("gemma3n_text", GEMMA3N), ("minimax_m3_vl_text", MINIMAX_M3),
                                             ("bloom", {"n_layer": 2, "n_head": 4}), ("qwen4_exp_text", QWEN4_EXP),
                                             ("dory", DORY), ("zaya", ZAYA), ("qwen3_5", QWEN3_5), ("minimax", MINIMAX),
                                             ("granitemoehybrid", GRANITE4_H)])
def test_on_cuda_the_models_of_several_streams_answer_as_transformers_does(tmp_path, builtin_path, arch, overrides):
    """DeepSeek V4 (its attention and compressors torch on the device, its decode rows at once), HY V4 (V3.2's
    kernels with sinks, Triton's on CUDA; its short decodes in graphs), Gemma 3n (AltUp's streams; its decode steps
    captured in graphs), MiniMax M3 (its block-sparse attention and experts Triton's), BLOOM (ALiBi in the Triton
    kernels, its decode steps captured in graphs), Qwen4-Exp (its streams, PLE states and QSA; the dense regime in
    graphs), Dory (its unrolled loops in graphs), ZAYA1 (its CCA states, its experts Triton's), and the prefills of
    Qwen3.5's, MiniMax's and Granite 4-H's state layers through their Triton kernels (`kernels.triton_gated_delta`,
    `triton_lightning`, `triton_ssd`) on a GPU in float32: the greedy tokens of transformers on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import transformers

    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", cache=CacheConfig(block_size=16),
                                    pools=(PoolConfig(num_blocks=64, scheduler=SchedulerConfig(
                                        max_num_seqs=8, max_num_batched_tokens=64)),)), progress=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 16, eos_ids=None) for p in prompts]
    assert_all_free(engine)
