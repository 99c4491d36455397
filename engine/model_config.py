"""The model's shape, read from an HF config.json: `ModelConfig` (its rope scaling: `engine.rope_config`).

What we serve is listed here (architectures, activations, rope types, layer types); a config asking for
anything else is refused with a `ConfigError` naming the key, before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError, PoolConfig
from engine.fp8_weights import SCALE_SUFFIX
from engine.config_values import read_bool, read_float, read_int, read_object, read_token_ids
from engine.gated_delta_config import GatedDeltaShape, StateShape, serving_pool
from engine.gemma3n_config import Gemma3nShape
from engine.gemma4_config import Gemma4Shape
from engine.mamba_config import Mamba2Shape
from engine.falcon_h1_config import FalconH1Scales
from engine.kimi_linear_config import KdaShape
from engine.minimax_config import LightningShape
from engine.minimax_m3_config import BlockIndexer, index_key_bytes
from engine.qwen4_exp_config import Qwen4ExpShape
from engine.dory_config import DoryShape
from engine.zaya_config import CcaShape
from engine.lfm2_config import ShortConvShape
from engine.mamba1_config import Mamba1Shape
from engine.zamba2_config import Zamba2Blocks
from engine.cohere_moe_config import CohereMoeShape
from engine.mimo_config import MimoShape
from engine.laguna_config import LagunaShape
from engine.hy_v4_config import HyperConnections
from engine.deepseek_v4_config import DeepseekV4Shape
from engine.model_params import COHERE_ARCHITECTURES, GEMMA_ARCHITECTURES, count_params, float32_params
from engine.multimodal_config import (BARE_TEXT_WEIGHTS, FLAT_TEXT_CONFIGS, MROPE_TEXT, MULTIMODAL_ARCHITECTURES, is_multimodal,
                                      text_model, thinker_config)
from engine.mla_config import MlaShape
from engine.model_defaults import (DEFAULT_HEAD_DIM, DEFAULT_KV_HEADS, DEFAULT_MAX_POSITIONS, DEFAULT_RMS_NORM_EPS,
                                   DEFAULT_ROPE_THETA, FAMILY_DEFAULTS, OWN_ACTIVATIONS, TEXT_DEFAULTS,
                                   pruned_head, served_as, vl_text_keys)
from engine.family_readers import KEY_READERS
from engine.model_families import LAYER_TYPES, MOE_ROUTERS, family_fields
from engine.rope_config import RopeScaling
from engine.weight_formats import read_folder_config, weight_format_fields

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                           "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "GptOssForCausalLM", "Qwen2MoeForCausalLM", *COHERE_ARCHITECTURES,
                           "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "Glm4ForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Olmo3ForCausalLM",
                           "SeedOssForCausalLM", "Llama4ForCausalLM", "Ministral3ForCausalLM", "ArceeForCausalLM",
                           "Glm4MoeLiteForCausalLM", "GraniteMoeHybridForCausalLM", "Exaone4ForCausalLM",
                           "HunYuanDenseV1ForCausalLM", "OlmoeForCausalLM", "Qwen3_5ForCausalLM",
                           "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
                           "MinistralForCausalLM", "HunYuanMoEV1ForCausalLM", "ApertusForCausalLM",
                           "OlmoHybridForCausalLM", "Gemma4ForCausalLM", "Mistral4ForCausalLM",
                           "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Lfm2ForCausalLM", "Lfm3ForCausalLM",
                           "Lfm2MoeForCausalLM", "KimiLinearForCausalLM", "Dots1ForCausalLM", "SolarOpenForCausalLM",
                           "AfmoeForCausalLM", "Kolibri1ForCausalLM", "AXK1ForCausalLM", "BailingHybridForCausalLM",
                           "FlintForCausalLM", "HeliumForCausalLM", "LongcatFlashForCausalLM", "AXK2ForCausalLM",
                           "MiMoV2FlashForCausalLM", "ExaoneMoeForCausalLM",
                           "Jais2ForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeForCausalLM",
                           "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM", "HYV3ForCausalLM",
                           "CwmForCausalLM", "YoutuForCausalLM", "BambaForCausalLM", "FalconH1ForCausalLM",
                           "ExaoneForCausalLM", "HyperCLOVAXForCausalLM", "MellumForCausalLM", "MuseSparkForCausalLM",
                           "Starcoder2ForCausalLM", "GlmForCausalLM", "LagunaForCausalLM", "MuseGlimmerForCausalLM",
                           "NemotronForCausalLM", "StableLmForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
                           "PhimoeForCausalLM", "OlmoForCausalLM", "FalconForCausalLM", "GPTJForCausalLM",
                           "GPTBigCodeForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "FlexOlmoForCausalLM",
                           "GPTNeoForCausalLM", "CodeGenForCausalLM", "LaraMiniForCausalLM", "Qwen4ExpForCausalLM",
                           "NanoChatForCausalLM", "DbrxForCausalLM", "MiniCPM3ForCausalLM", "HYV4ForCausalLM",
                           "DeepseekV4ForCausalLM", "BeamForCausalLM", "MllamaForCausalLM", "Gemma3nForCausalLM",
                           "GemmaForCausalLM", "VaultGemmaForCausalLM", "JambaForCausalLM", "MambaForCausalLM",
                           "FalconMambaForCausalLM", "Mamba2ForCausalLM", "Zamba2ForCausalLM", "DoryForCausalLM",
                           "ZayaForCausalLM", "MiniMaxForCausalLM", "MiniMaxM3VLForCausalLM", "Step3p7ForCausalLM",
                           "BloomForCausalLM", "MptForCausalLM", "AriaTextForCausalLM", "PersimmonForCausalLM")
# their attention bias: q/k/v's, not o_proj's
QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "GlmForCausalLM",
                 "StableLmForCausalLM", "HeliumForCausalLM")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model's shape (each of `SUPPORTED_ARCHITECTURES`') from an HF config.json. `layer_types`
    (Gemma): each layer full or sliding; without it `sliding_window` is all's."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # q/k/v projections carry a bias (Qwen2: always)
    attention_out_bias: bool | None = None   # Seed-OSS: o_proj's apart from q/k/v's (None: `o_proj_bias`'s rule)
    mlp_bias: bool = False
    lm_head_bias: bool = False          # Phi: the head's logits carry a bias of their own
    output_vocab_size: int | None = None   # Apertus 1.5: the head's rows, the vocabulary's first (None: all of it)
    skipped_layers: tuple[int, ...] = ()   # Llama 3.2 Vision: the checkpoint's layers not served (its cross layers)
    sliding_window: int | None = None   # Mistral: keys older than this many positions are not attended
    qk_norm: bool = False               # Qwen3, Gemma 3, Command R+: each q and k head normed before rotary
    hidden_act: str = "silu"            # the MLP's gate activation: silu | gelu_pytorch_tanh (Gemma 3)
    layer_types: tuple[str, ...] = ()   # Gemma 3: full_attention | sliding_attention per layer; () all alike
    rope_local_theta: float | None = None   # Gemma 3: the sliding layers' rope base (no scaling)
    query_pre_attn_scalar: float | None = None   # Gemma 3: attention scale is its -1/2 power (else head_dim's)
    num_experts: int = 0                # Qwen3-MoE, Mixtral: experts of a sparse layer's MLP (0: every MLP dense)
    num_experts_per_tok: int = 0        # the experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0      # each expert's intermediate size
    norm_topk_prob: bool = False        # the top-k weights renormalised to sum to 1
    router_jitter_noise: float = 0.0    # Phi-3.5-MoE: how near (relatively) a logit weighs in SparseMixer's softmax
    decoder_sparse_step: int = 1        # every this many layers is sparse ...
    mlp_only_layers: tuple[int, ...] = ()   # ... except these, dense
    moe_float_weights: bool = False     # Mixtral: the top-k weights stay float32 (Qwen3-MoE's: the model's dtype)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: a sparse layer's shared expert, gated (0: none)
    attn_logit_softcapping: float | None = None    # Gemma 2: each attention score s becomes cap x tanh(s / cap)
    final_logit_softcapping: float | None = None   # Gemma 2: so does each logit of the head
    embedding_multiplier: float = 1.0   # Granite: the embeddings' factor
    attention_multiplier: float | None = None   # Granite: q.k's factor, in place of the attention scale below
    residual_multiplier: float = 1.0    # Granite: each sublayer's output's factor before the residual add
    logits_scaling: float = 1.0         # Granite: the logits are divided by it
    logit_scale: float = 1.0            # Cohere: the logits are multiplied by it
    peri_norms: bool = False            # HyperCLOVA X: a norm on each sublayer's output before the residual add
    head_gates: bool = False            # LFM3: each head's output x sigmoid(its row of g_proj over the layer's input)
    parallel_residual: bool = False     # StableLM 2 12B: attention and MLP side by side off one norm (Cohere's)
    parallel_norms: int = 1             # GPT-NeoX, Falcon-40B: a parallel layer's norms (2: one a sublayer)
    learned_positions: int = 0          # GPT-BigCode: rows of a learned position embedding (0: none, a rotary)
    partial_rotary_factor: float = 1.0  # GLM-4: the share of each head the rotary turns (the default rope only)
    rope_proportional: bool = False     # Gemma 4's full layers: the turning pairs' frequencies over the whole head
    gemma4: Gemma4Shape | None = None   # Gemma 4: its full layers' own attention shape, per-layer inputs, shared K/V
    gemma3n: Gemma3nShape | None = None   # Gemma 3n: its AltUp streams, LAuReL and sparse gates (and `gemma4`'s)
    mimo: MimoShape | None = None       # MiMo-V2-Flash: its sliding layers' KV heads, its value heads' size and factor
    laguna: LagunaShape | None = None   # Laguna: each layer's query heads, its output gate, ropes and router cap
    hyper_connections: HyperConnections | None = None   # HY V4: its residual streams and their mixes
    deepseek_v4: DeepseekV4Shape | None = None   # DeepSeek V4: its compressed attention, streams and hash routing
    cohere_moe: CohereMoeShape | None = None   # Command A Plus: its norm, its router's scores, its shared experts' join
    muse: tuple[float, float, float] | None = None   # Muse: (q's factor, output norms' eps, residual gates' temp.)
    no_rope_layers: tuple[int, ...] = ()   # SmolLM3: 1 where a layer rotates q and k, 0 where not (NoPE); (): all do
    layer_rope_thetas: tuple[float, ...] = ()   # Granite SWA: each layer's rope base (0: NoPE); (): the model's
    attention_chunk_size: int | None = None   # Llama 4: a chunked_attention layer's query sees its chunk alone
    qk_l2_norm: bool = False            # Llama 4: each q and k head of a rotating layer L2-normed after the rotary
    attn_temperature: tuple[float, float] | None = None   # Llama 4's NoPE layers' q scale: (floor_scale, attn_scale)
    llama4_scaling_beta: float | None = None   # Ministral 3: every query x 1 + beta log(1 + floor(p / original))
    clip_qkv: float | None = None       # OLMoE: q, k and v clamped to +-clip_qkv after the q/k norms (None: not)
    alibi_bias_max: float | None = None   # MPT: its ALiBi slopes' spread (None: BLOOM's slopes, or no ALiBi)
    attention_sinks: bool = False       # GPT-OSS: a learned logit per query head in every softmax's denominator
    moe_bias: bool = False              # GPT-OSS: the router and each expert's projections carry biases
    swiglu_limit: float | None = None   # GPT-OSS: the experts' SwiGLU clamped at it (None: plain SiLU x up)
    swiglu_alpha: float = 1.702         # ... and its sigmoid's gain
    gated_delta: GatedDeltaShape | None = None   # Qwen3.5: its linear_attention layers' shape (None: none)
    mamba: Mamba2Shape | None = None    # Granite 4's -H models: their Mamba-2 layers' (`linear_attention` too)
    falcon_h1: FalconH1Scales | None = None   # Falcon-H1: its muP multipliers (its `hybrid` layers: Mamba-2, attention)
    zamba2: Zamba2Blocks | None = None   # Zamba2: its shared blocks (its `hybrid` layers: a block, then Mamba-2)
    state_layers: ShortConvShape | KdaShape | Mamba1Shape | LightningShape | CcaShape | None = None   # LFM2, ZAYA...
    attn_output_gate: bool = False      # Qwen3.5: attention's output x sigmoid(a gate q_proj makes beside each head)
    block_indexer: BlockIndexer | None = None   # MiniMax M3: its block-sparse layers (an indexer key a token too)
    qwen4_exp: Qwen4ExpShape | None = None   # Qwen4-Exp: its residual streams and per-layer n-gram embeddings
    dory: DoryShape | None = None       # Dory: its loops (num_layers and layer_types: the virtual layers, unrolled)
    mla: MlaShape | None = None         # DeepSeek: latent attention (head_dim the cache's, one KV head; None: none)
    moe_router: str = "softmax"         # how experts are picked (MOE_ROUTERS): the softmax's top k, or DeepSeek's
    moe_groups: tuple[int, int] = (1, 1)   # DeepSeek: the experts' groups, and how many a token's experts come from
    routed_scaling_factor: float = 1.0  # DeepSeek: the routed experts' weights' factor
    zero_experts: int = 0               # LongCat-Flash: experts past num_experts that pass a token through
    moe_latent_size: int = 0            # Nemotron 3 Super: experts over a projection of the hidden state (0: none)
    shared_expert_gated: bool = True    # Qwen2-MoE's shared expert is gated; DeepSeek's are not
    text_weights_prefix: str = ""       # a multimodal checkpoint's text model: its weights' prefix (the rest skipped)
    bare_text_weights: bool = False     # ... or at `model.` itself, the vision tower at `visual.` (Qwen2.5-VL's)
    stacked_experts: bool = False       # each layer's experts stacked in two tensors (Qwen3-VL-MoE's checkpoints)
    fp8_weight_block: tuple[int, int] | None = None   # an FP8 checkpoint's scale blocks: dequantized as read
    fp8_scale_suffix: str = SCALE_SUFFIX   # ... its scales' name past the weight's (llm-compressor's: .weight_scale)
    mxfp4_experts: bool = False         # GPT-OSS's MXFP4 experts: held so or dequantized (`engine.models.held_packed`)
    int4_group: int | None = None       # integer weights' group (`engine.int4_formats`; 0: a scale a row)
    int4_bits: int = 4                  # ... a code's width: 4, or 8 (W8A16)
    int4_modules: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())   # ... the layers quantized: (targets, ignore)
    int4_format: str = ""               # ... how they are stored: `Int4Scheme.format`
    int4_zero_points: bool = False      # ... with a zero point a group (asymmetric: AWQ's)
    int4_act_order: bool = False        # ... in GPTQ's activation order: dequantized as read, never held so
    rotary_positions: int = 0           # the rotary cache's rows as served (`serving`: the longest pool's); 0: all
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim < self.head_dim and (self.rotary_dim % 2 or self.rotary_dim <= 0):
            raise ConfigError(f"partial_rotary_factor: {self.partial_rotary_factor} of head_dim {self.head_dim} is "
                              "served as an even count of dimensions")
        for key in ("short_factor", "long_factor") if self.rope_scaling.rope_type == "longrope" else ():
            pairs = (self.mla.qk_rope_head_dim if self.mla is not None else self.rotary_dim) // 2   # MiniCPM3: MLA
            if len(getattr(self.rope_scaling, key)) != pairs:
                raise ConfigError(f"rope_scaling.{key}: longrope needs one factor a rotary frequency "
                                  f"({pairs}), got {len(getattr(self.rope_scaling, key))}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS and \
                (self.hidden_act, self.architecture) not in OWN_ACTIVATIONS:   # an ungated MLP's own
            raise ConfigError(f"hidden_act: unsupported {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window: must be positive, got {self.sliding_window}")
        kinds = LAYER_TYPES + (("linear_attention",) if self.state_shape is not None else ()) + (   # Qwen3.5's ...
            ("hybrid",) if self.falcon_h1 or self.zamba2 or isinstance(self.state_layers, CcaShape) else ()) + (
            ("mlp", "moe") if self.architecture == "NemotronHForCausalLM" else ())   # ... Nemotron-H's blocks
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in kinds for t in self.layer_types)):
            raise ConfigError(f"layer_types: one of {', '.join(kinds)} for each of the {self.num_layers} "
                              f"layers, got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding_window: layer_types has sliding layers and no sliding_window")
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            raise ConfigError(f"attention_chunk_size: must be positive, got {self.attention_chunk_size}")
        if "chunked_attention" in self.layer_types and self.attention_chunk_size is None:
            raise ConfigError("attention_chunk_size: layer_types has chunked layers and no attention_chunk_size")
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                    raise ConfigError(f"{name}: must be a positive integer with experts, got {getattr(self, name)!r}")
            if self.moe_router not in MOE_ROUTERS:
                raise ConfigError(f"moe_router: one of {', '.join(MOE_ROUTERS)}, got {self.moe_router!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} is over num_experts {self.num_experts}")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts (Qwen3-MoE's rule), else the dense MLP."""
        return bool(self.num_experts) and layer not in self.mlp_only_layers and \
            (layer + 1) % self.decoder_sparse_step == 0

    def layer_window(self, layer: int) -> int | None:
        """The keys layer `layer` attends: its last `sliding_window` positions, or all (None)."""
        return None if self.layer_types and self.layer_types[layer] != "sliding_attention" else self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """Llama 4's chunked layers: a query of layer `layer` at p sees p - p % chunk .. p; None: not a chunked one."""
        return self.attention_chunk_size if self.layer_types and self.layer_types[layer] == "chunked_attention" \
            else None

    def serving(self, max_model_lens: Iterable[int | None]) -> ModelConfig:
        """This config as an engine serves it, its pools' `max_model_len`s given (0 or None: the model's context): the
        rotary cache holds the longest pool's positions, not the whole context (Llama 4 Scout's is 10,485,760: a
        2.7 GB bfloat16 table, built from a 5.4 GB float32 one); a longrope turns every sequence by its long factors
        where one pool serves past the original context, by its short ones otherwise (vLLM's rule by max_model_len:
        a sequence's cached keys never go stale as it grows)."""
        longest = max((n or self.context_length for n in max_model_lens), default=self.context_length)
        served = replace(self, rotary_positions=longest if longest < self.context_length else 0)
        rope = self.rope_scaling
        if rope.rope_type != "longrope":
            return served
        return replace(served, rope_scaling=replace(rope, long=longest > rope.original_max_position_embeddings))

    def serving_pool(self, pool: PoolConfig) -> PoolConfig:
        """`pool` as served: a model with state layers, without swap (`engine.gated_delta_config.serving_pool`)."""
        return serving_pool(pool, self.state_shape is not None)

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves (vLLM's readings): `max_position_embeddings`; with YaRN the original
        context times the factor where that is longer (Qwen3's model card adds YaRN, factor 4 over 32,768 positions,
        to a config.json whose max_position_embeddings stays 40,960: the model serves 131,072); with a linear scaling
        max_position_embeddings times the factor (Llama 2's long fine-tunes; not Gemma 3's, whose count has it)."""
        rope = self.rope_scaling
        if rope.rope_type == "yarn":
            return max(self.max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
        scaled = rope.rope_type == "linear" and self.architecture not in GEMMA_ARCHITECTURES
        return int(self.max_position_embeddings * rope.factor) if scaled else self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: Granite's attention_multiplier, query_pre_attn_scalar ** -0.5 (Gemma), else
        head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.mla is not None:   # DeepSeek: its q.k's dimensions, and YaRN's mscale_all_dim squared (transformers')
            rope, scale = self.rope_scaling, (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5
            if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
                scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
            return scale
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head the rotary turns: all but where `partial_rotary_factor` says less (transformers'
        int(head_dim x factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_planes(self) -> int:
        """What the cache holds of a token per KV head: K and V (2), or DeepSeek's latent alone (1: keys and values
        are read from it)."""
        return 1 if self.mla is not None or self.deepseek_v4 is not None else 2

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """S_KV = kv_planes x num_kv_layers x num_kv_heads x head_dim x dtype_bytes (2 planes: K and V), each layer's
        own heads and head size where they differ (Gemma 4's full layers: `layer_kv_shape`); MiniMax M3's indexer
        keys."""
        return self.kv_planes * sum(h * d for h, d in map(self.layer_kv_shape, self.kv_layers)) * dtype.itemsize + \
            index_key_bytes(self, dtype.itemsize)

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of layer `layer`'s attention: the model's, Gemma 4's full layers' own, or
        MiMo-V2-Flash's sliding layers' KV heads."""
        if self.gemma4 is not None and self.layer_window(layer) is None:
            return self.gemma4.num_kv_heads, self.gemma4.head_dim
        if self.mimo is not None and self.layer_window(layer) is not None:
            return self.mimo.sliding_kv_heads, self.head_dim
        if self.deepseek_v4 is not None:   # a row a token: K=V, its compressors' inputs, a closed window's entry
            return 1, self.deepseek_v4.row_width(layer)
        return self.num_kv_heads, self.head_dim

    def layer_config(self, layer: int) -> ModelConfig:
        """This config as layer `layer`'s attention sees it: its KV heads and head size (`layer_kv_shape`)."""
        heads, dim = self.layer_kv_shape(layer)
        return self if (heads, dim) == (self.num_kv_heads, self.head_dim) else replace(
            self, num_kv_heads=heads, head_dim=dim)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged cache: all but linear-attention ones (Qwen3.5's), which keep a
        state per sequence instead (`state_bytes_per_seq`). The cache's layer i is layer kv_layers[i]'s."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i)
                     and not (self.layer_types and self.layer_types[i] in ("mlp", "moe"))   # Nemotron-H's
                     and (self.gemma4 is None or self.gemma4.kv_producer(self, i) == i)   # Gemma 4's shared K/V
                     and (self.dory is None or self.dory.kv_owner(i) == i))   # Dory's loops but its last (last_loop)

    @property
    def state_shape(self) -> StateShape | None:
        """The shape of the layers that keep a state per sequence (`layer_types` linear_attention), or None."""
        return self.gated_delta or self.mamba or self.state_layers

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layers)

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def stateful_layers(self) -> tuple[int, ...]:
        """The layers that keep a state per sequence: the linear-attention ones, and Falcon-H1's hybrids (K/V too)."""
        kinds = self.layer_types or ("",) * self.num_layers
        return tuple(i for i, kind in enumerate(kinds) if kind in ("linear_attention", "hybrid"))

    def state_bytes_per_seq(self, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """Bytes of the state each running sequence holds for the linear-attention layers (0: none), whatever its
        length, on each of `tensor_parallel_size` ranks: the capacity plan counts it per sequence beside S_KV x its
        length."""
        ple = self.qwen4_exp.state_bytes(self.hidden_size, dtype.itemsize) if self.qwen4_exp else 0   # every rank's
        shape = self.state_shape.per_rank(tensor_parallel_size) if self.state_shape is not None else None
        return ple + (len(self.stateful_layers) * shape.state_bytes(dtype.itemsize) if shape is not None else 0)

    def rotary_cache_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the rotary cos/sin caches each rank holds: [rotary_positions or context_length, rotated dims]
        each (Gemma: two)."""
        gemma = self.architecture in GEMMA_ARCHITECTURES
        wide = self.gemma4.head_dim if self.gemma4 is not None else self.head_dim   # Gemma 4's full layers' rotary
        dims = self.mla.qk_rope_head_dim if self.mla is not None else max(self.head_dim, wide)
        return (2 if gemma else 1) * (self.rotary_positions or self.context_length) * dims * dtype.itemsize

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj carries a bias: Llama's `attention_bias` covers it, Qwen2's and GLM's q/k/v alone;
        Seed-OSS says apart (`attention_out_bias`)."""
        if self.attention_out_bias is not None:
            return self.attention_out_bias
        return self.attention_bias and self.architecture not in QKV_BIAS_ONLY

    @property
    def num_float32_params(self) -> int:
        """Parameters held in float32 whatever the model's dtype (`engine.model_params.float32_params`)."""
        return float32_params(self)

    def num_params(self) -> int:
        """Parameters of the whole model (one rank's: engine.parallel.ShardShape.num_params)."""
        return self.count_params(self.num_heads, self.num_kv_heads, self.intermediate_size,
                                 self.moe_intermediate_size, self.vocab_size, self.shared_expert_intermediate_size)

    def count_params(self, heads: int, kv_heads: int, i: int, moe_i: int, v: int, shared_i: int = 0) -> int:
        """Parameters of this model's layers built with these shapes (`engine.model_params.count_params`)."""
        return count_params(self, heads, kv_heads, i, moe_i, v, shared_i)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of an HF config.json. A key missing, of the wrong type (a size is an integer, not
        a string or a bool) or out of range is a ConfigError naming it; an absent or null optional one, its default."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json: must be a JSON object, got {cfg!r:.80}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ConfigError("architectures: config.json has no 'architectures' list")
        cfg, arch = served_as(cfg, archs[0])   # another name of an architecture served (Phi-3.5-MoE's, EXAONE 3's)
        quantized = weight_format_fields(cfg, arch)   # how a quantized checkpoint stores its weights
        if isinstance(arch, str) and is_multimodal(arch):
            return cls._from_text_config(cfg, arch)
        _check_architecture(arch)
        cfg = FAMILY_DEFAULTS.get(arch, {}) | cfg
        cfg = KEY_READERS.get(arch, dict)(cfg)   # a family's own keys under the Llama reading's names
        if cfg.get("max_position_embeddings") is None:
            if arch not in DEFAULT_MAX_POSITIONS:
                raise ConfigError(f"max_position_embeddings: missing from config.json ({arch}'s default is not known "
                                  f"here: name the model's context)")
            cfg = {**cfg, "max_position_embeddings": DEFAULT_MAX_POSITIONS[arch]}
        num_heads = read_int(cfg, "num_attention_heads")
        hidden = read_int(cfg, "hidden_size")
        num_layers = read_int(cfg, "num_hidden_layers")
        family = family_fields(cfg, arch, num_layers)   # layer types, windows, experts, scalars
        rope_theta, rope_scaling = RopeScaling.from_hf_config(*family.pop("full_rope", (cfg,)),
                                                              turns_part="partial_rotary_factor" in family)
        sliding_window = None
        if arch == "MistralForCausalLM":   # absent: MistralConfig's 4096; null: none
            sliding_window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
        return cls(**{**dict(
            architecture=arch, vocab_size=read_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=read_int(cfg, "intermediate_size"),
            num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=read_int(cfg, "num_key_value_heads",   # null: one per head, as transformers reads None
                              num_heads if "num_key_value_heads" in cfg else DEFAULT_KV_HEADS.get(arch, num_heads)),
            head_dim=read_int(cfg, "head_dim", DEFAULT_HEAD_DIM.get(arch, hidden // num_heads)),
            rms_norm_eps=read_float(cfg, "rms_norm_eps", DEFAULT_RMS_NORM_EPS.get(arch, 1e-6)),
            rope_theta=rope_theta if rope_theta is not None else DEFAULT_ROPE_THETA.get(arch, 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=read_int(cfg, "max_position_embeddings"),
            tie_word_embeddings=read_bool(cfg, "tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or read_bool(cfg, "attention_bias", False),   # Qwen2-MoE: family
            mlp_bias=read_bool(cfg, "mlp_bias", False),
            sliding_window=sliding_window,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "ApertusForCausalLM"),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=read_int(cfg, "bos_token_id", None, minimum=0),
            eos_token_ids=read_token_ids(cfg, "eos_token_id"),
            output_vocab_size=pruned_head(cfg) if arch == "ApertusForCausalLM" else None,
            **quantized,
        ), **family})

    @classmethod
    def _from_text_config(cls, cfg: dict[str, Any], arch: str) -> "ModelConfig":
        """A multimodal checkpoint (`arch` in `engine.multimodal_config`'s tables) as its `text_config`'s model; errors
        say `text_config.` (an Omni model's `thinker_config.text_config.`)."""
        top, (cfg, where) = cfg, thinker_config(arch, cfg)
        text = read_object(cfg, "text_config", name=f"{where}text_config")
        text_arch, prefix, model_type = text_model(arch, text)
        if text is None and arch in FLAT_TEXT_CONFIGS:   # the text model's keys at the top (its hub checkpoints')
            text = {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures", "model_type")}
        if text is None:
            raise ConfigError(f"{where}text_config: missing from config.json ({arch} is served as its text model)")
        text = TEXT_DEFAULTS.get(arch, {}) | (vl_text_keys(text) if arch.startswith(MROPE_TEXT) else text)
        if text.get("model_type", model_type) != model_type:
            raise ConfigError(f"{where}text_config.model_type: {arch}'s text model is served as {model_type!r} "
                              f"({text_arch}), got {text['model_type']!r}")
        eos = read_token_ids(text, "eos_token_id", path=f"{where}text_config.") \
            if text.get("eos_token_id") is not None else read_token_ids(cfg, "eos_token_id")   # else the checkpoint's
        tied = {"tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)} if "tie_word_embeddings" in cfg \
            else {}   # transformers reads the top one (checked here: its error names the file's key)
        quantized = {key: top[key] for key in ("quantization_config", "compression_config")   # the checkpoint's,
                     if top.get(key) is not None and key not in text}                    # at the top (Kimi K2.5's)
        try:
            config = cls.from_hf_config({**text, **tied, **quantized, "architectures": [text_arch],
                                         "eos_token_id": list(eos)})
        except ConfigError as exc:
            raise ConfigError(f"{where}text_config.{exc}") from None
        return replace(config, text_weights_prefix=prefix, bare_text_weights=arch in BARE_TEXT_WEIGHTS,
                       stacked_experts=config.stacked_experts or arch == "Qwen3VLMoeForConditionalGeneration")

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        """A model folder's config.json (and AutoGPTQ's quantize_config.json beside it: `read_folder_config`)."""
        return read_folder_config(Path(folder), cls.from_hf_config)


def _check_architecture(arch: Any) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architectures: unsupported architecture {arch!r}; "
                          f"supported: {', '.join((*SUPPORTED_ARCHITECTURES, *MULTIMODAL_ARCHITECTURES))}")

