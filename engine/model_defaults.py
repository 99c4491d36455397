"""What transformers' config classes give where a config.json names nothing: each served architecture's defaults
(`engine.model_config.ModelConfig.from_hf_config` reads a key absent or null as its class would), and those of the
multimodal checkpoints' text configs."""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.config_values import read_int, rope_type
from engine.cohere_moe_config import COHERE2_MOE_DEFAULTS
from engine.mimo_config import MIMO_DEFAULTS
from engine.hy_v4_config import HY_V4_DEFAULTS, HY_V4_VL_TEXT
from engine.deepseek_v4_config import DEEPSEEK_V4_DEFAULTS
from engine.beam_config import BEAM_DEFAULTS

# transformers' text config defaults of Qwen's VL models where they differ from the text architecture's here (a
# composite checkpoint's text_config may be saved as its difference from them, as Gemma 3's)
_QWEN2_VL_TEXT = {"vocab_size": 152_064, "hidden_size": 8192, "intermediate_size": 29_568, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32_768,
                  "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "bos_token_id": 151_643, "eos_token_id": 151_645}
# ERNIE 4.5 VL's text model (Ernie4_5_VLMoeTextConfig's: ERNIE-4.5-VL-28B-A3B's; its experts text's, then vision's)
_ERNIE_VL_TEXT = {"vocab_size": 103_424, "hidden_size": 2560, "intermediate_size": 12_288, "num_hidden_layers": 28,
                  "num_attention_heads": 20, "num_key_value_heads": 4, "max_position_embeddings": 131_072,
                  "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "moe_intermediate_size": [1536, 512]}
TEXT_DEFAULTS = {"Qwen2VLForConditionalGeneration": _QWEN2_VL_TEXT,
                 "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL_TEXT,
                 "Qwen3VLForConditionalGeneration": {
                     "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                     "max_position_embeddings": 128_000, "rms_norm_eps": 1e-6, "rope_theta": 500_000.0},
                 "HYV4VLForConditionalGeneration": HY_V4_VL_TEXT,
                 "HunYuanVLForConditionalGeneration": {   # HunYuanVLTextConfig's (HunYuan-OCR's text model)
                     "vocab_size": 290_943, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
                 **dict.fromkeys(("Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VL_MoeForConditionalGeneration"),
                                 _ERNIE_VL_TEXT),
                 "Qwen3VLMoeForConditionalGeneration": {   # its router always renormalises the top k
                     "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                     "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 128_000,
                     "rms_norm_eps": 1e-6, "rope_theta": 500_000.0, "moe_intermediate_size": 1408,
                     "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": True},
                 # PaddleOCR-VL's text model (PaddleOCRTextConfig's: ERNIE-4.5-0.3B's), served as Llama's
                 "PaddleOCRVLForConditionalGeneration": {
                     "vocab_size": 103_424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
                     "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                     "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                     "tie_word_embeddings": True, "use_bias": False}}
# transformers' Gemma3TextConfig defaults where they differ from the keys' defaults here: a composite checkpoint's
# text_config is saved as its difference from them (gemma-3-4b-it's names no head count, head_dim or vocabulary)
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "bos_token_id": 2, "eos_token_id": 1}
# transformers' Gemma2Config defaults where they differ from the keys' defaults here (as GEMMA3_TEXT_DEFAULTS)
GEMMA2_DEFAULTS = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "bos_token_id": 2,
    "eos_token_id": 1}
# the keys a family's config class gives where config.json names none (Llama 4: its expert size, which
# `engine.llama4_config` reads)
FAMILY_DEFAULTS = {"Gemma2ForCausalLM": GEMMA2_DEFAULTS, "VaultGemmaForCausalLM": GEMMA2_DEFAULTS,
                   "Gemma3ForCausalLM": GEMMA3_TEXT_DEFAULTS,
                   "MiMoV2FlashForCausalLM": MIMO_DEFAULTS, "Cohere2MoeForCausalLM": COHERE2_MOE_DEFAULTS,
                   "GraniteMoeSWAForCausalLM": {"max_position_embeddings": 2048},   # GraniteMoeSWAConfig's
                   "HYV4ForCausalLM": HY_V4_DEFAULTS,   # HYV4Config's (its attention, experts: engine.hy_v4_config)
                   "DeepseekV4ForCausalLM": DEEPSEEK_V4_DEFAULTS,   # DeepseekV4Config's (engine.deepseek_v4_config)
                   "BeamForCausalLM": BEAM_DEFAULTS,   # BeamConfig's (engine.beam_config)
                   "HYV3ForCausalLM": {   # HYV3Config's (Hy3-preview's shape)
                       "vocab_size": 120_832, "hidden_size": 4096, "intermediate_size": 13_312, "num_hidden_layers": 80,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5},
                   "GraniteSWAForCausalLM": {   # GraniteSWAConfig's
                       "vocab_size": 100_352, "hidden_size": 2560, "intermediate_size": 8192, "num_hidden_layers": 24,
                       "num_attention_heads": 20, "num_key_value_heads": 4, "max_position_embeddings": 8192,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 100_257,
                       "eos_token_id": 100_257},
                   "Jais2ForCausalLM": {   # Jais2Config's
                       "vocab_size": 150_272, "hidden_size": 3328, "intermediate_size": 26_624,
                       "num_attention_heads": 26, "max_position_embeddings": 8192, "hidden_act": "relu2",
                       "bos_token_id": 0, "eos_token_id": 150_024},
                   "Gemma4ForCausalLM": {   # Gemma4TextConfig's (its window, rope and head shapes: engine.gemma4_config)
                       "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                       "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 131_072,
                       "bos_token_id": 2, "eos_token_id": 1},
                   "Llama4ForCausalLM": {"intermediate_size": 8192},
                   "AXK2ForCausalLM": {   # AXK2Config's (A.X-K2-Light's; its attention and experts: deepseek_config)
                       "vocab_size": 163_840, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
                       "num_attention_heads": 32, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                       "bos_token_id": 163_691, "eos_token_id": 163_691},
                   "AXK1ForCausalLM": {   # AXK1Config's (its attention and experts: deepseek_config)
                       "vocab_size": 163_840, "hidden_size": 7168, "intermediate_size": 18_432, "num_hidden_layers": 61,
                       "num_attention_heads": 64, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
                       "bos_token_id": 163_691, "eos_token_id": 163_691},
                   "DeepseekV32ForCausalLM": {   # DeepseekV32Config's (its attention and experts: deepseek_config)
                       "vocab_size": 129_280, "hidden_size": 7168, "intermediate_size": 18_432, "num_hidden_layers": 61,
                       "num_attention_heads": 128, "max_position_embeddings": 163_840, "bos_token_id": 0,
                       "eos_token_id": 1},
                   "GlmMoeDsaForCausalLM": {   # GlmMoeDsaConfig's (GLM-5: its attention and experts in deepseek_config)
                       "vocab_size": 154_880, "hidden_size": 6144, "intermediate_size": 12_288, "num_hidden_layers": 78,
                       "num_attention_heads": 64, "max_position_embeddings": 202_752, "rms_norm_eps": 1e-5,
                       "bos_token_id": 0, "eos_token_id": 1},
                   "Mistral4ForCausalLM": {   # Mistral4Config's (its latent attention and experts: deepseek_config)
                       "vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 36,
                       "num_attention_heads": 32, "max_position_embeddings": 1_048_576, "bos_token_id": 1,
                       "eos_token_id": 2},
                   "GraniteMoeHybridForCausalLM": {"intermediate_size": 11008},   # its MLP's: shared_intermediate_size
                   "Qwen3_5ForCausalLM": {   # Qwen3_5TextConfig's
                       "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 32,
                       "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                       "max_position_embeddings": 32_768},
                   "Qwen3_5MoeForCausalLM": {   # Qwen3_5MoeTextConfig's; its MLPs are experts (no intermediate_size)
                       "vocab_size": 248_320, "hidden_size": 2048, "intermediate_size": 512, "num_hidden_layers": 40,
                       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                       "max_position_embeddings": 32_768},
                   "ZayaForCausalLM": {   # ZayaConfig's (ZAYA1-8B's shape)
                       "vocab_size": 262_272, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131_072,
                       "rms_norm_eps": 1e-5, "bos_token_id": 2, "eos_token_id": 106},
                   "DoryForCausalLM": {   # DoryConfig's (Nemotron Labs Dory 1.0 4B's shape)
                       "vocab_size": 131_072, "hidden_size": 2560, "intermediate_size": 7168, "num_hidden_layers": 36,
                       "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                       "max_position_embeddings": 8192},
                   "Qwen4ExpForCausalLM": {   # Qwen4ExpTextConfig's (Qwen3.5-MoE's shape)
                       "vocab_size": 248_320, "hidden_size": 2048, "intermediate_size": 512, "num_hidden_layers": 40,
                       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                       "max_position_embeddings": 32_768},
                   "ApertusForCausalLM": {"rope_parameters": {   # ApertusConfig's where config.json names none
                       "rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                       "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
                   "NemotronHForCausalLM": {   # NemotronHConfig's
                       "vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 21_504,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 4096},
                   "Qwen3NextForCausalLM": {   # Qwen3NextConfig's
                       "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
                       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                       "max_position_embeddings": 32_768},
                   "Lfm2ForCausalLM": {   # Lfm2Config's (its MLP width and norms: engine.lfm2_config)
                       "vocab_size": 65_536, "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "max_position_embeddings": 128_000},
                   "SolarOpenForCausalLM": {   # SolarOpenConfig's (GLM-4.5's); its MLPs are experts on every layer
                       "vocab_size": 196_608, "hidden_size": 4096, "intermediate_size": 10_944, "num_hidden_layers": 48,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
                       "max_position_embeddings": 131_072, "rope_theta": 1_000_000.0},
                   "HeliumForCausalLM": {   # HeliumConfig's (Helium-1 2B's)
                       "vocab_size": 48_000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24,
                       "num_attention_heads": 20, "num_key_value_heads": 20, "head_dim": 128, "rms_norm_eps": 1e-8,
                       "max_position_embeddings": 4096, "rope_theta": 100_000.0, "bos_token_id": 1, "eos_token_id": 2},
                   "FlintForCausalLM": {   # FlintConfig's (its layers and experts: engine.flint_config)
                       "vocab_size": 150_144, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 49,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
                       "max_position_embeddings": 262_144},
                   "Kolibri1ForCausalLM": {   # Kolibri1Config's (its layers and experts: engine.kolibri_config)
                       "vocab_size": 128_000, "hidden_size": 2560, "num_hidden_layers": 50, "num_attention_heads": 48,
                       "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
                       "max_position_embeddings": 262_144},
                   "AfmoeForCausalLM": {   # AfmoeConfig's
                       "vocab_size": 200_192, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 32,
                       "num_attention_heads": 16, "head_dim": 128, "rms_norm_eps": 1e-5,
                       "max_position_embeddings": 16_384},
                   "Lfm3ForCausalLM": {   # Lfm3Config's (its ropes and layout: engine.lfm3_config)
                       "vocab_size": 128_000, "hidden_size": 2048, "intermediate_size": 7680, "num_hidden_layers": 24,
                       "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 128_000},
                   "Lfm2MoeForCausalLM": {   # Lfm2MoeConfig's
                       "vocab_size": 65_536, "hidden_size": 2048, "intermediate_size": 7168, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128_000}}
# transformers' config classes' max_position_embeddings (the context served, and YaRN's original context where its
# scaling names none), for a config.json without it
DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32_768, "MistralForCausalLM": 131_072,
                         "Qwen3ForCausalLM": 32_768, "Qwen3MoeForCausalLM": 32_768, "MixtralForCausalLM": 131_072,
                         "Phi3ForCausalLM": 4096, "GraniteForCausalLM": 2048, "Olmo2ForCausalLM": 2048,
                         "Olmo3ForCausalLM": 2048, "CohereCompassForCausalLM": 8192,
                         "SmolLM3ForCausalLM": 32_768, "GptOssForCausalLM": 131_072, "Qwen2MoeForCausalLM": 32_768,
                         "CohereForCausalLM": 8192, "Cohere2ForCausalLM": 8192, "Ernie4_5ForCausalLM": 131_072,
                         "Ernie4_5_MoeForCausalLM": 131_072, "SeedOssForCausalLM": 524_288,
                         "Glm4ForCausalLM": 131_072, "GlmForCausalLM": 131_072, "DeepseekV2ForCausalLM": 2048,
                         "DeepseekV3ForCausalLM": 4096,
                         "Glm4MoeForCausalLM": 131_072, "MiniMaxM2ForCausalLM": 196_608,
                         "Gemma2ForCausalLM": 8192, "Gemma3ForCausalLM": 131_072, "Llama4ForCausalLM": 131_072,
                         "Ministral3ForCausalLM": 262_144, "Glm4MoeLiteForCausalLM": 202_752,
                         "GraniteMoeHybridForCausalLM": 2048, "Exaone4ForCausalLM": 2048,
                         "GraniteMoeForCausalLM": 2048, "GraniteMoeSharedForCausalLM": 2048,
                         "ExaoneMoeForCausalLM": 2048,
                         "HunYuanDenseV1ForCausalLM": 2048, "OlmoeForCausalLM": 4096,
                         "HunYuanMoEV1ForCausalLM": 2048, "MinistralForCausalLM": 131_072,
                         "ApertusForCausalLM": 65_536, "OlmoHybridForCausalLM": 65_536, "Dots1ForCausalLM": 2048,
                         "ArceeForCausalLM": 4096, "CwmForCausalLM": 131_072,
                         "YoutuForCausalLM": 131_072, "BambaForCausalLM": 262_144,
                         "FalconH1ForCausalLM": 8192, "ExaoneForCausalLM": 4096,
                         "HyperCLOVAXForCausalLM": 2048, "MellumForCausalLM": 131_072,
                         "Starcoder2ForCausalLM": 4096, "LagunaForCausalLM": 131_072, "NemotronForCausalLM": 4096,
                         "StableLmForCausalLM": 4096, "GemmaForCausalLM": 8192,
                         "VaultGemmaForCausalLM": 8192, "PhiForCausalLM": 2048,
                         "GPTNeoXForCausalLM": 2048, "PhimoeForCausalLM": 131_072,
                         "OlmoForCausalLM": 2048, "FalconForCausalLM": 2048,
                         "GPTJForCausalLM": 2048, "GPTBigCodeForCausalLM": 1024,
                         "GPT2LMHeadModel": 1024, "OPTForCausalLM": 2048, "FlexOlmoForCausalLM": 4096,
                         "GPTNeoForCausalLM": 2048, "CodeGenForCausalLM": 2048,
                         "NanoChatForCausalLM": 2048, "DbrxForCausalLM": 2048,
                         "MiniCPM3ForCausalLM": 32_768, "JambaForCausalLM": 262_144, "MllamaForCausalLM": 131_072,
                         "Gemma3nForCausalLM": 32_768, "LaraMiniForCausalLM": 131_072, "AriaTextForCausalLM": 2048,
                         "PersimmonForCausalLM": 16_384,
                         # models of state layers alone hold any length: the engine's default, a RAG pool's
                         "MambaForCausalLM": 131_072, "FalconMambaForCausalLM": 131_072,
                         "Mamba2ForCausalLM": 131_072, "Zamba2ForCausalLM": 4096}
# (activation, architecture): the ungated MLPs' activations past `model_config.SUPPORTED_ACTIVATIONS`, each served by
# its family's model alone
OWN_ACTIVATIONS = {("xielu", "ApertusForCausalLM"), ("relu2", "ArceeForCausalLM"), ("relu2", "Jais2ForCausalLM"),
                   ("relu2", "NemotronForCausalLM"), ("gelu", "GPTNeoXForCausalLM"), ("gelu", "FalconForCausalLM"),
                   ("relu", "OPTForCausalLM"), ("relu2", "NanoChatForCausalLM"), ("gelu", "Zamba2ForCausalLM"),
                   ("gelu", "MptForCausalLM"), ("relu2", "PersimmonForCausalLM")}
# their rms_norm_eps, where it is not 1e-6
DEFAULT_RMS_NORM_EPS = {"MixtralForCausalLM": 1e-5, "Phi3ForCausalLM": 1e-5, "Olmo2ForCausalLM": 1e-5,
                        "Olmo3ForCausalLM": 1e-5,
                        "GptOssForCausalLM": 1e-5, "Ernie4_5ForCausalLM": 1e-5, "Ernie4_5_MoeForCausalLM": 1e-5,
                        "Glm4ForCausalLM": 1.5625e-7, "GlmForCausalLM": 1.5625e-7,
                        "Glm4MoeForCausalLM": 1e-5, "Llama4ForCausalLM": 1e-5, "Ministral3ForCausalLM": 1e-5,
                        "Glm4MoeLiteForCausalLM": 1e-5, "Exaone4ForCausalLM": 1e-5, "ExaoneMoeForCausalLM": 1e-5,
                        "HunYuanDenseV1ForCausalLM": 1e-5, "OlmoeForCausalLM": 1e-5, "HunYuanMoEV1ForCausalLM": 1e-5,
                        "ApertusForCausalLM": 1e-5, "ArceeForCausalLM": 1e-5, "CwmForCausalLM": 1e-5,
                        "BambaForCausalLM": 1e-5, "FalconH1ForCausalLM": 1e-5, "ExaoneForCausalLM": 1e-5,
                        "PhimoeForCausalLM": 1e-5, "MiniCPM3ForCausalLM": 1e-5, "MllamaForCausalLM": 1e-5}
# their num_key_value_heads where config.json names none (else one per query head)
DEFAULT_KV_HEADS = {"Qwen2ForCausalLM": 32, "MistralForCausalLM": 8, "Qwen3ForCausalLM": 32, "Qwen3MoeForCausalLM": 4,
                    "MixtralForCausalLM": 8, "SmolLM3ForCausalLM": 4, "GptOssForCausalLM": 8,
                    "Qwen2MoeForCausalLM": 16, "Ernie4_5ForCausalLM": 2, "Ernie4_5_MoeForCausalLM": 4,
                    "Glm4ForCausalLM": 2, "GlmForCausalLM": 2, "Glm4MoeForCausalLM": 8, "SeedOssForCausalLM": 8,
                    "MiniMaxM2ForCausalLM": 8, "Llama4ForCausalLM": 8, "Ministral3ForCausalLM": 8,
                    "Exaone4ForCausalLM": 32, "MinistralForCausalLM": 8,
                    "ExaoneMoeForCausalLM": 32, "CwmForCausalLM": 8, "BambaForCausalLM": 8,
                    "FalconH1ForCausalLM": 8, "ExaoneForCausalLM": 8, "MellumForCausalLM": 4,
                    "Starcoder2ForCausalLM": 2, "LagunaForCausalLM": 8, "PhimoeForCausalLM": 8,
                    "JambaForCausalLM": 8, "MllamaForCausalLM": 8, "Gemma3nForCausalLM": 2,
                    "LaraMiniForCausalLM": 4}
# their head_dim where config.json names none (else hidden_size / num_attention_heads)
DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "GptOssForCausalLM": 64, "Ernie4_5ForCausalLM": 128,
                    "CwmForCausalLM": 128, "MellumForCausalLM": 128, "Llama4ForCausalLM": 128, "LagunaForCausalLM": 128,
                    "Ministral3ForCausalLM": 128, "GemmaForCausalLM": 256,
                    "Glm4ForCausalLM": 128, "GlmForCausalLM": 128, "MiniMaxM2ForCausalLM": 128,
                    "SeedOssForCausalLM": 128, "LaraMiniForCausalLM": 128}
# MellumConfig's ropes where config.json names none: a base per layer type
MELLUM_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
# their rope_theta where config.json names none (else 10,000)
DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1_000_000.0, "SmolLM3ForCausalLM": 2_000_000.0,
                      "GptOssForCausalLM": 150_000.0, "Ernie4_5ForCausalLM": 500_000.0,
                      "Ernie4_5_MoeForCausalLM": 500_000.0,
                      "MiniMaxM2ForCausalLM": 5_000_000.0, "Llama4ForCausalLM": 500_000.0,
                      "Lfm2ForCausalLM": 1_000_000.0, "Lfm2MoeForCausalLM": 1_000_000.0,
                      "HYV3ForCausalLM": 11_158_840.0, "ExaoneForCausalLM": 500_000.0, "PhimoeForCausalLM": 1_000_000.0,
                      "FlexOlmoForCausalLM": 500_000.0, "MllamaForCausalLM": 500_000.0}


def vl_text_keys(text: dict[str, Any]) -> dict[str, Any]:
    """A Qwen VL text config as its text model reads it: a rope of type `mrope` (Qwen2-VL's, Qwen2.5-VL's spelling)
    the default rope, as transformers reads it (on text, MRoPE's three positions are one: `TEXT_MODELS`); Qwen3-VL-MoE's
    `num_local_experts`, the name transformers saves its `num_experts` under, as `num_experts`. GLM-4.1V's text model
    (`glm4v_text`, GLM-4.6V's too) has heads of hidden_size / num_attention_heads whatever head_dim says, as
    transformers builds it. PaddleOCR-VL's (ERNIE 4.5's layer with MRoPE's rotate-half pairs, served as Llama's) has
    one switch for every projection's bias, `use_bias`. GLM-OCR's (`glm_ocr_text`) is GLM-4.1V's without q/k/v biases,
    its heads hidden_size / num_attention_heads wide where head_dim is not named."""
    out = dict(text)
    kind, heads, hidden = out.get("model_type"), out.get("num_attention_heads"), out.get("hidden_size")
    if kind == "glm_ocr_text":
        out["attention_bias"] = False
    if "use_bias" in out:
        out["attention_bias"] = out["mlp_bias"] = out.pop("use_bias")
    if (kind == "glm4v_text" or kind == "glm_ocr_text" and out.get("head_dim") is None) and isinstance(heads, int) \
            and isinstance(hidden, int) and heads > 0:
        out["head_dim"] = hidden // heads
    if "num_local_experts" in out and "num_experts" not in out:
        out["num_experts"] = out.pop("num_local_experts")
    for key in ("rope_scaling", "rope_parameters"):
        rope = out.get(key)
        if isinstance(rope, dict) and rope_type(rope) == "mrope":
            out[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return out


# EXAONE 3's config.json names of transformers' keys (`ExaoneConfig.attribute_map`)
EXAONE_KEYS = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"}


def exaone_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 3.0 / 3.5 / Deep's config.json (`ExaoneForCausalLM`) under transformers' key names, where it does not
    name those too; an `exaone` config that transformers 5 saved (its `architectures` LlamaForCausalLM) is EXAONE's."""
    out = {**cfg, "architectures": ["ExaoneForCausalLM"]}
    for theirs, ours in EXAONE_KEYS.items():
        if theirs in out and ours not in out:
            out[ours] = out.pop(theirs)
    return out


# Apertus 1.5's text model (`Apertus1p5TextForCausalLM`; `Apertus1p5ForConditionalGeneration`'s): Apertus's, read as
# it with Apertus1p5TextConfig's vocabulary where config.json names none, and its head pruned to the text tokens
APERTUS_1_5 = "Apertus1p5TextForCausalLM"
APERTUS_1_5_TEXT = {"vocab_size": 266_752}


def pruned_head(cfg: dict[str, Any]) -> int | None:
    """`output_vocab_size`: the rows of a head pruned to the vocabulary's first ids (Apertus 1.5's), at most
    `vocab_size`, untied; None where absent, null or the whole vocabulary (transformers' canonical unpruned head)."""
    rows, vocab = read_int(cfg, "output_vocab_size", None), read_int(cfg, "vocab_size")
    if rows is None or rows == vocab:
        return None
    if rows > vocab:
        raise ConfigError(f"output_vocab_size: the head's rows, at most vocab_size {vocab}, got {rows}")
    if cfg.get("tie_word_embeddings"):
        raise ConfigError(f"tie_word_embeddings: a head pruned to output_vocab_size {rows} rows is not the embedding "
                          f"table of {vocab}")
    return rows


def served_as(cfg: dict[str, Any], arch: Any) -> tuple[dict[str, Any], Any]:
    """(config.json, architecture) as served, where a checkpoint names another: Phi-3.5-MoE's and MiniMax's releases'
    names, Phi-4-multimodal's text model (Phi-3's), Gemma 4 Unified's text model (Gemma 4's, its config class holding no
    per-layer inputs and no experts), Apertus 1.5's text model (Apertus's, its vocabulary where config.json
    names none), InternLM3 (`internlm3_config`: the Llama model, as transformers runs it), EXAONE 3 (transformers 5
    saves it as Llama, `exaone_config`)."""
    if arch == "PhiMoEForCausalLM":
        return cfg, "PhimoeForCausalLM"
    if arch in ("MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM"):   # read under transformers' names
        return cfg, "MiniMaxForCausalLM"
    if arch == "Phi4MultimodalForCausalLM":   # its text model, Phi-3's (its image and audio embedders not read)
        return cfg, "Phi3ForCausalLM"
    if arch == "Gemma4UnifiedForCausalLM":   # Gemma 4's text model without per-layer inputs or experts (12B's);
        vision = cfg.get("use_bidirectional_attention", "vision") == "vision"   # its text causal (an image's not)
        return {**cfg, "hidden_size_per_layer_input": 0, "enable_moe_block": False,
                **({"use_bidirectional_attention": None} if vision else {})}, "Gemma4ForCausalLM"
    if arch == "InternLM3ForCausalLM" or arch == "LlamaForCausalLM" and cfg.get("model_type") == "internlm3":
        return internlm3_config(cfg), "LlamaForCausalLM"
    if arch == APERTUS_1_5:
        return {**APERTUS_1_5_TEXT, **cfg}, "ApertusForCausalLM"
    if arch == "ExaoneForCausalLM" or arch == "LlamaForCausalLM" and cfg.get("model_type") == "exaone":
        return exaone_config(cfg), "ExaoneForCausalLM"
    return cfg, arch


# InternLM3Config's where config.json names none (its shape: InternLM3-8B's)
INTERNLM3_DEFAULTS = {"vocab_size": 128_512, "hidden_size": 4096, "intermediate_size": 10_240, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5,
                      "max_position_embeddings": 32_768, "rope_theta": 10_000.0}


def internlm3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Shanghai AI Lab's InternLM3 (`InternLM3ForCausalLM`: internlm3-8b-instruct) as the Llama model transformers
    runs it with: `InternLM3Config`'s defaults, its `qkv_bias` as `attention_bias` (q, k, v and o_proj), `bias` as
    `mlp_bias`, which must agree (transformers refuses them apart: its Llama has one setting for the four)."""
    cfg = {**INTERNLM3_DEFAULTS, **cfg}
    qkv, mlp = cfg.get("qkv_bias", cfg.get("attention_bias", False)), cfg.get("bias", cfg.get("mlp_bias", False))
    if qkv != mlp:
        raise ConfigError(f"bias: InternLM3 is served with qkv_bias and bias alike (transformers' Llama has one "
                          f"setting for q, k, v and o), got qkv_bias {qkv!r}, bias {mlp!r}")
    return {**cfg, "attention_bias": qkv, "mlp_bias": mlp}
