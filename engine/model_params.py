"""How many parameters the model a `ModelConfig` describes holds (`count_params`: one rank's, its shapes given), and
how many of them stay float32 whatever the model's dtype (`float32_params`): what the capacity plan counts as weight
bytes, checked to the parameter against transformers' models in the tests (`config`: an
`engine.model_config.ModelConfig`, which calls these). The layer shapes they read by architecture are here too
(`GEMMA_ARCHITECTURES`, `FOUR_NORMS`, `WIDE_QK_NORM`, `COHERE_ARCHITECTURES`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.gemma3n_config import gemma3n_params
from engine.gemma4_config import gemma4_params
from engine.mimo_config import mimo_params
from engine.laguna_config import laguna_params
from engine.mamba1_config import MAMBA_ARCHITECTURES, mamba_params
from engine.zamba2_config import zamba2_params
from engine.longcat_config import longcat_params
from engine.nemotron_h_config import nemotron_h_params
from engine.deepseek_v4_config import deepseek_v4_float32_params, deepseek_v4_params
from engine.muse_config import muse_spark_params

__all__ = ["COHERE_ARCHITECTURES", "FOUR_NORMS", "GEMMA_ARCHITECTURES", "WIDE_QK_NORM", "count_params",
           "float32_params"]

# one norm a layer, a parallel block
COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForCausalLM")
HEAD_QK_NORMS = (*COHERE_ARCHITECTURES, "StableLmForCausalLM")   # q/k norms with a weight of its own a head
# Gemma's norms (1 + weight), scaled embeddings
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "GemmaForCausalLM",
                       "VaultGemmaForCausalLM", "Gemma3nForCausalLM")
FOUR_NORMS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Glm4ForCausalLM",   # a norm on each
              "AfmoeForCausalLM", "Kolibri1ForCausalLM", "BeamForCausalLM",   # sublayer's output too
              "MuseGlimmerForCausalLM")
# an MLP of up, its activation and down, no gate
UNGATED_MLP = ("ApertusForCausalLM", "ArceeForCausalLM", "NanoChatForCausalLM", "Jais2ForCausalLM",
               "Starcoder2ForCausalLM", "NemotronForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
               "FalconForCausalLM", "GPTJForCausalLM", "GPTBigCodeForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM",
               "GPTNeoForCausalLM", "CodeGenForCausalLM", "BloomForCausalLM", "MptForCausalLM", "PersimmonForCausalLM")
# LayerNorms (a weight and a bias), not RMSNorms
LAYER_NORMS = ("Jais2ForCausalLM", "Starcoder2ForCausalLM", "NemotronForCausalLM", "StableLmForCausalLM",
               "PhiForCausalLM", "GPTNeoXForCausalLM", "PhimoeForCausalLM", "FalconForCausalLM", "GPTJForCausalLM",
               "GPTBigCodeForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "GPTNeoForCausalLM", "CodeGenForCausalLM",
               "BloomForCausalLM", "PersimmonForCausalLM")
WEIGHTLESS_NORMS = ("OlmoForCausalLM", "NanoChatForCausalLM")   # norms without parameters
# routers with a correction (or expert) bias of a value an expert
BIASED_ROUTERS = ("deepseek_v3", "minimax_m2", "ernie4_5", "lfm2", "afmoe", "kolibri")
# q and k normed over the whole projection
WIDE_QK_NORM = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "MiniMaxM2ForCausalLM", "OlmoeForCausalLM",
                "FlexOlmoForCausalLM", "OlmoHybridForCausalLM")


# the families counted by their own modules: (config, heads, kv_heads, i, moe_i, v, shared_i) -> parameters
OWN_COUNTS: dict[str, Callable[..., int]] = {
    "Zamba2ForCausalLM": lambda c, h, kv, i, moe_i, v, s: zamba2_params(c, h, kv, i, v),   # Mamba-2, shared blocks
    **dict.fromkeys(MAMBA_ARCHITECTURES,   # Mamba-1 blocks alone: its "heads" are its channels
                    lambda c, h, kv, i, moe_i, v, s: mamba_params(c, h, v)),
    "LongcatFlashForCausalLM":   # sublayers, experts beside every other one
        lambda c, h, kv, i, moe_i, v, s: longcat_params(c, h, i, moe_i, v),
    "NemotronHForCausalLM":   # single-mixer blocks
        lambda c, h, kv, i, moe_i, v, s: nemotron_h_params(c, h, kv, i, moe_i, s, v),
    "Gemma4ForCausalLM":   # two attention shapes, experts beside the MLP
        lambda c, h, kv, i, moe_i, v, s: gemma4_params(c, h, kv, i, moe_i, v),
    "DeepseekV4ForCausalLM": deepseek_v4_params,   # compressed attention, streams, hash routing
    "Gemma3nForCausalLM":   # Gemma 4's E layers with AltUp and LAuReL
        lambda c, h, kv, i, moe_i, v, s: gemma3n_params(c, h, kv, i, moe_i, v),
    "Qwen4ExpForCausalLM": lambda c, h, kv, i, moe_i, v, s: qwen4_exp_params(c, h, kv, i, moe_i, v, s),
    "ZayaForCausalLM": lambda c, h, kv, i, moe_i, v, s: zaya_params(c, moe_i, v),   # CCA layers, routed experts
    "MuseSparkForCausalLM":   # experts over a projection of the hidden state, residual gates
        lambda c, h, kv, i, moe_i, v, s: muse_spark_params(c, h, kv, i, moe_i, v),
    "DoryForCausalLM":   # the checkpoint's layers once, however many loops run them
        lambda c, h, kv, i, moe_i, v, s: c.dory.num_params(c.hidden_size, h * c.head_dim, kv * c.head_dim, i, v,
                                                           c.vocab_size, c.tie_word_embeddings)}


def float32_params(config: Any) -> int:
    """Parameters held in float32 whatever the model's dtype: DeepSeek's, ERNIE 4.5's and Flint's routers (weight, the
    correction bias of V3's and ERNIE's), the expert bias of LFM2-MoE's, AFMoE's and Kolibri-1's, Flint's attention
    sinks, DeepSeek V3.2's indexers' head weights, HY V4's streams' mixes, Kimi Linear's dt_bias, Muse Spark's routers
    and residual gates (the whole model's: a rank's is at most that)."""
    if config.deepseek_v4 is not None:
        return deepseek_v4_float32_params(config)
    h, layers = config.hidden_size, config.num_layers
    indexers = config.mla.num_indexer_weights(h, layers) if config.mla is not None else 0
    indexers += getattr(config.state_layers, "qkv_dim", 0) * (layers - config.num_kv_layers)   # KDA's dt_bias
    indexers += config.hyper_connections.num_params(h, layers) if config.hyper_connections else 0   # HY V4's mixes
    if config.moe_router == "muse_spark":   # Muse Spark's routers (weight and bias), its residual gates
        return config.num_experts * (h + 1) * sum(map(config.is_sparse_layer, range(layers))) + 2 * h * layers
    if config.moe_router not in ("deepseek_v2", "deepseek_v3", "ernie4_5", "lfm2", "afmoe", "kolibri", "flint"):
        return indexers
    weights = 0 if config.moe_router in ("lfm2", "afmoe", "kolibri") else config.hidden_size   # the bias alone
    per_layer = config.num_experts * (weights + (config.moe_router not in ("deepseek_v2", "flint")))
    sinks = config.num_heads * layers if config.moe_router == "flint" else 0   # Flint's sinks too
    return indexers + sinks + per_layer * sum(config.is_sparse_layer(layer) for layer in range(config.num_layers))


def count_params(config: Any, heads: int, kv_heads: int, i: int, moe_i: int, v: int,
                 shared_i: int = 0) -> int:
    """Parameters of `config`'s layers built with `heads` query heads, `kv_heads` KV heads, `i` MLP rows, `moe_i` rows
    per expert, `shared_i` rows of the shared expert and `v` vocab rows (engine.model); the norms, the router and
    the shared expert's gate whole."""
    if config.architecture in OWN_COUNTS:
        return OWN_COUNTS[config.architecture](config, heads, kv_heads, i, moe_i, v, shared_i)
    if config.mimo is not None:   # two attention shapes, value heads of their own size
        return mimo_params(config, heads, kv_heads, i, moe_i, v)
    if config.laguna is not None:   # each layer its query heads, an output gate
        return laguna_params(config, heads, kv_heads, i, moe_i, v, shared_i)
    h, d, q, kv = config.hidden_size, config.head_dim, heads * config.head_dim, kv_heads * config.head_dim
    attn = h * (q + 2 * kv) + q * h
    attn += (q + 2 * kv if config.attention_bias else 0) + (h if config.o_proj_bias else 0)
    if config.mla is not None:
        attn = config.mla.num_params(h, heads, config.attention_bias)
    mlp = 3 * h * i + (2 * i + h if config.mlp_bias else 0)
    if config.architecture in UNGATED_MLP:   # no gate
        mlp = 2 * h * i + (2 if config.architecture == "ApertusForCausalLM" else 0) + (i + h if config.mlp_bias else 0)
    experts = config.num_experts * (3 * h * moe_i + h)   # every expert, and the router
    if config.moe_bias:   # GPT-OSS: each expert's gate/up and down biases, the router's
        experts += config.num_experts * (2 * moe_i + h + 1)
    if config.shared_expert_intermediate_size:   # Qwen2-MoE: the shared expert and its gate (DeepSeek: ungated)
        experts += 3 * h * shared_i + (h if config.shared_expert_gated else 0)
    experts += config.num_experts if config.moe_router in BIASED_ROUTERS else 0
    experts += h if config.architecture == "AXK1ForCausalLM" else 0   # A.X-K1: a norm on the sparse layer's output
    norms = 4 if config.architecture in FOUR_NORMS or config.peri_norms else 2   # on the sublayers' outputs too
    parallel = config.architecture in COHERE_ARCHITECTURES or config.parallel_residual
    norms = config.parallel_norms if parallel else norms   # Cohere, StableLM 2 12B: one before both; GPT-NeoX: two
    norms *= 2 if config.architecture in LAYER_NORMS else 1   # LayerNorms: a weight and a bias
    norms *= 0 if config.architecture in WEIGHTLESS_NORMS else 1
    # q/k norms: a weight per channel of a head (Cohere: each head its own)
    qk = (q + kv if config.architecture in HEAD_QK_NORMS else 2 * d) if config.qk_norm else 0
    qk *= 2 if config.architecture == "PersimmonForCausalLM" else 1   # its q/k LayerNorms' biases
    per_layer = attn + norms * h + qk + (heads if config.attention_sinks else 0)
    if config.architecture in WIDE_QK_NORM:   # q and k normed whole: a weight per channel
        per_layer += q + kv
    if config.attn_output_gate:   # Qwen3.5: q_proj makes a gate beside each query head
        per_layer += h * q + (q if config.attention_bias else 0)
    per_layer += h * heads if config.head_gates else 0   # LFM3: g_proj, a gate a head
    per_layer += h * q + heads if config.architecture == "BeamForCausalLM" else 0   # Beam: its gate, a bias a head
    per_layer += h * heads * config.mla.v_head_dim if config.hyper_connections else 0   # HY V4: a gate a channel
    sparse = sum(config.is_sparse_layer(layer) for layer in range(config.num_layers))
    mlps = sparse * experts + (config.num_layers - sparse) * mlp
    state = None if config.state_shape is None else config.state_shape.per_rank(config.num_heads // heads)
    linear = 0 if state is None else len(config.stateful_layers) * state.num_params(h) + \
        (config.num_layers - config.num_kv_layers) * norms * h   # a state layer's norms (Falcon-H1's: its K/V layer's)
    linear += config.mla.indexers_params(h, config.num_layers, sparse) if config.mla is not None else 0   # V3.2's
    linear += config.hyper_connections.num_params(h, config.num_layers) if config.hyper_connections else 0   # HY V4
    linear += config.block_indexer.num_params(h, kv_heads) if config.block_indexer else 0   # MiniMax M3's
    final = h * (2 if config.architecture in LAYER_NORMS else 0 if config.architecture in WEIGHTLESS_NORMS else 1)
    rows = v if not config.output_vocab_size else -(-config.output_vocab_size // (config.num_heads // heads))
    head = (0 if config.tie_word_embeddings else rows * h) + (rows if config.lm_head_bias else 0)   # Phi: biased;
    # Apertus 1.5: the head pruned to the vocabulary's first ids, cut as the table is; GPT-2's positions whole
    embed_norm = 2 * h if config.architecture == "BloomForCausalLM" else 0   # BLOOM: a LayerNorm on the embeddings
    return v * h + config.num_kv_layers * per_layer + linear + mlps + final + head + config.learned_positions * h + \
        embed_norm


def qwen4_exp_params(config: Any, heads: int, kv_heads: int, i: int, moe_i: int, v: int, shared_i: int) -> int:
    """Qwen3.5-MoE's layers without their norms (the streams' mixes norm each sublayer's input, the last mix the
    head's), the mixes, the PLE layers and the QSA indexers (`engine.qwen4_exp_config`), these whole on every rank
    but the n-gram tables' columns."""
    base = replace(config, architecture="Qwen3_5MoeForCausalLM", qwen4_exp=None, block_indexer=None)
    h = config.hidden_size
    return count_params(base, heads, kv_heads, i, moe_i, v, shared_i) - (2 * config.num_layers + 1) * h + \
        config.qwen4_exp.num_params(h, config.num_layers, config.num_heads // heads) + \
        config.block_indexer.num_params(h, kv_heads)


def zaya_params(config: Any, moe_i: int, v: int) -> int:
    """ZAYA's (one rank): the table and a head (untied, biased where `lm_head_bias`), the embeddings' scale and bias,
    each layer's CCA, router and residual scalings (`CcaShape.num_params`), two norms and experts, every router's state
    scale but the first's, the final norm."""
    s, h = config.state_layers, config.hidden_size
    layer = s.num_params(h) + 2 * h + s.experts * 3 * h * moe_i
    head = (0 if config.tie_word_embeddings else v * h) + (v if config.lm_head_bias else 0)
    return v * h + head + 2 * h + config.num_layers * layer + (config.num_layers - 1) * s.router + h
