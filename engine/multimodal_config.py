"""Multimodal checkpoints served as their text model: which architectures, which text model each holds (by its
`text_config`'s model_type where a family holds several), and how their configs and weights are laid out.
`engine.model_config.ModelConfig` reads the text model with these; images are not served.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError

__all__ = ["ANY_TEXT_MODELS", "BARE_TEXT_WEIGHTS", "FLAT_TEXT_CONFIGS", "MROPE_TEXT", "MULTIMODAL_ARCHITECTURES",
           "TEXT_MODELS", "TEXT_MODEL_TYPES", "TEXT_TYPE_ARCHS", "THINKER_CONFIGS", "THINKER_TOWERS", "is_multimodal",
           "text_model", "thinker_config"]

# Multimodal checkpoints served as their text model: architecture -> (the text model's, its weights' prefix, the
# text_config's model_type where it names one: another family's text model is refused by that key). Qwen's VL models
# rotate by MRoPE, whose three position ids (time, height, width) are one and the same on text: the text model's rope
# (`rope_type: mrope` read as the default, `mrope_section` ignored); Qwen2-VL's and Qwen2.5-VL's hub checkpoints keep
# the text model at `model.` and the vision tower at `visual.` (the layout before transformers 5's), and their
# config.json the text model's keys at the top
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "language_model.", "gemma3_text"),
               "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "language_model.", "mistral"),
               "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", "language_model.", "qwen2_vl_text"),
               "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", "language_model.", "qwen2_5_vl_text"),
               "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "language_model.", "qwen3_vl_text"),
               "Qwen3VLMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", "language_model.", "qwen3_vl_moe_text"),
               "Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "language_model.", "llama4_text"),
               "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "language_model.", "qwen3_5_text"),
               "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "language_model.", "qwen3_5_moe_text"),
               "Qwen4ExpForConditionalGeneration": ("Qwen4ExpForCausalLM", "language_model.", "qwen4_exp_text"),
               "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", "language_model.", "gemma4_text"),
               "Gemma3nForConditionalGeneration": ("Gemma3nForCausalLM", "language_model.", "gemma3n_text"),
               "Gemma4UnifiedForConditionalGeneration": ("Gemma4UnifiedForCausalLM", "language_model.",
                                                         "gemma4_unified_text"),
               "Lfm2VlForConditionalGeneration": ("Lfm2ForCausalLM", "language_model.", "lfm2"),
               "Lfm3VlForConditionalGeneration": ("Lfm3ForCausalLM", "language_model.", "lfm3"),
               "Glm4vMoeForConditionalGeneration": ("Glm4MoeForCausalLM", "language_model.", "glm4v_moe_text"),
               "Glm4vForConditionalGeneration": ("Glm4ForCausalLM", "language_model.", "glm4v_text"),
               "Glm46VForConditionalGeneration": ("Glm4ForCausalLM", "language_model.", "glm4v_text"),
               "GlmOcrForConditionalGeneration": ("Glm4ForCausalLM", "language_model.", "glm_ocr_text"),
               "Exaone4_5_ForConditionalGeneration": ("Exaone4ForCausalLM", "language_model.", "exaone4"),
               "HYV4VLForConditionalGeneration": ("HYV4ForCausalLM", "language_model.", "hy_v4_vl_text"),
               "HunYuanVLForConditionalGeneration": ("HunYuanDenseV1ForCausalLM", "language_model.", "hunyuan_vl_text"),
               # their text models at `model.language_model.` (SmolVLM's, Idefics2's and Idefics3's at
               # `model.text_model.`)
               "Cohere2VisionForConditionalGeneration": ("Cohere2ForCausalLM", "language_model.", "cohere2"),
               **dict.fromkeys(("MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
                                "MiniCPMOcrForConditionalGeneration"),
                               ("Qwen3_5ForCausalLM", "language_model.", "qwen3_5_text")),
               "LightOnOcrForConditionalGeneration": ("Qwen3ForCausalLM", "language_model.", "qwen3"),
               "HyperCLOVAXVisionV2ForConditionalGeneration": ("HyperCLOVAXForCausalLM", "language_model.",
                                                               "hyperclovax"),
               **dict.fromkeys(("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"),
                               ("LlamaForCausalLM", "text_model.", "llama")),
               "Idefics2ForConditionalGeneration": ("MistralForCausalLM", "text_model.", "mistral"),
               "GraniteDoclingForConditionalGeneration": ("GraniteForCausalLM", "text_model.", "granite_docling_text"),
               # Nemotron Nano Omni: Nemotron-H's text model (its hub names, `backbone.`) under `language_model.`
               "NemotronH_Omni_Reasoning_V3": ("NemotronHForCausalLM", "language_model.", "nemotron_h"),
               # ERNIE 4.5 VL: its text experts alone (the vision experts, the second half, not read)
               **dict.fromkeys(("Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VL_MoeForConditionalGeneration"),
                               ("Ernie4_5_MoeForCausalLM", "language_model.", "ernie4_5_vl_moe_text")),
               "Kimi_K25ForConditionalGeneration": ("DeepseekV3ForCausalLM", "language_model.", "deepseek_v3"),
               # MiniMax M3: its release stores the text model at `language_model.model.`, the head at
               # `language_model.lm_head` (transformers 5 at `model.language_model.`, `lm_head`)
               "MiniMaxM3SparseForConditionalGeneration": ("MiniMaxM3VLForCausalLM", "language_model.",
                                                           "minimax_m3_vl_text"),
               # Step 3.7: its release's text model at `model.` beside `vision_model.` (`BARE_TEXT_WEIGHTS`)
               "Step3p7ForConditionalGeneration": ("Step3p7ForCausalLM", "language_model.", "step3p5"),
               "AriaForConditionalGeneration": ("AriaTextForCausalLM", "language_model.", "aria_text"),
               # Emu3: the Llama model at `text_model.` beside its VQ-VAE image tokenizer (not read)
               "Emu3ForConditionalGeneration": ("LlamaForCausalLM", "text_model.", "emu3_text_model"),
               # Fuyu: Persimmon's text model beside the linear patch embedding it is fed (not read)
               "FuyuForCausalLM": ("PersimmonForCausalLM", "language_model.", "persimmon"),
               "KimiK25ForConditionalGeneration": ("DeepseekV3ForCausalLM", "language_model.", "deepseek_v3"),
               # PaddleOCR-VL: ERNIE-4.5-0.3B's layers turned as Qwen2-VL's MRoPE turns them (rotate-half pairs: the
               # Llama model's), at `model.` beside `visual.` and the projector `mlp_AR.`
               "PaddleOCRVLForConditionalGeneration": ("LlamaForCausalLM", "language_model.", "paddleocr_vl_text"),
               # Qwen's Omni models: their thinker's text model (`THINKER_CONFIGS`)
               "Qwen3OmniMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", "thinker.", "qwen3_omni_moe_text"),
               **dict.fromkeys(("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"),
                               ("Qwen2ForCausalLM", "thinker.", "qwen2_5_omni_text")),
               # Llama 3.2 Vision: its text model's self-attention layers (`engine.models.mllama`)
               "MllamaForConditionalGeneration": ("MllamaForCausalLM", "language_model.", "mllama_text_model"),
               # Apertus 1.5: its text model (`engine.model_defaults.APERTUS_1_5`); its image and audio tokenizers
               # not read
               "Apertus1p5ForConditionalGeneration": ("Apertus1p5TextForCausalLM", "language_model.",
                                                      "apertus1p5_text"),
               # Muse Glimmer: its text model (`engine.models.muse`) beside Kimi K2.5's vision tower (not read)
               "MuseGlimmerForConditionalGeneration": ("MuseGlimmerForCausalLM", "language_model.",
                                                       "muse_glimmer_text"),
               # Granite 4 Vision: Granite's text model (its deepstack injections on images alone), LLaVA-NeXT's
               # layout
               "Granite4VisionForConditionalGeneration": ("GraniteForCausalLM", "language_model.",
                                                          "granite4_vision_text"),
               # North's vision model: its text model (Qwen3-VL's layout) beside the vision tower
               "CohereCompassForConditionalGeneration": ("CohereCompassForCausalLM", "language_model.",
                                                         "cohere_compass_text"),
               # Muse Spark: Glimmer's with experts (`engine.models.muse`), beside its vision and audio towers
               "MuseSparkForConditionalGeneration": ("MuseSparkForCausalLM", "language_model.", "muse_spark_text")}
# a multimodal architecture whose text model is another by its text_config's model_type (Mistral 3's from December
# 2025 on: Ministral 3, Devstral 2, Mistral Small 4)
TEXT_MODEL_TYPES = {("Mistral3ForConditionalGeneration", "ministral3"): "Ministral3ForCausalLM",
                    ("Mistral3ForConditionalGeneration", "mistral4"): "Mistral4ForCausalLM",
                    # Kimi K2.5's and K2.6's hub config.json name their text model kimi_k2: read as DeepSeek V3's
                    ("Kimi_K25ForConditionalGeneration", "kimi_k2"): "DeepseekV3ForCausalLM",
                    ("KimiK25ForConditionalGeneration", "kimi_k2"): "DeepseekV3ForCausalLM",
                    # EXAONE 4.5's hub config.json names its text model exaone4_5_text: read as EXAONE 4's
                    ("Exaone4_5_ForConditionalGeneration", "exaone4_5_text"): "Exaone4ForCausalLM"}
# their text model's keys at the top of config.json where it has no text_config (Qwen2-VL's and Qwen2.5-VL's hub
# checkpoints, PaddleOCR-VL's first release)
FLAT_TEXT_CONFIGS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                     "PaddleOCRVLForConditionalGeneration")
# their text model's tensors at `model.` itself, the rest elsewhere (`engine.weights.VISION_PREFIXES`; HY4-VL's and
# HunYuan-VL's `vit.`)
BARE_TEXT_WEIGHTS = (*FLAT_TEXT_CONFIGS, "HYV4VLForConditionalGeneration", "Ernie4_5_VLMoeForConditionalGeneration",
                     "Ernie4_5_VL_MoeForConditionalGeneration", "HunYuanVLForConditionalGeneration",
                     "Step3p7ForConditionalGeneration")
MROPE_TEXT = ("Qwen", "Glm4v", "Glm46V", "GlmOcr", "PaddleOCRVL")
# Qwen's Omni models (Qwen2.5-Omni, whose hub config.json names `Qwen2_5OmniModel`; Qwen3-Omni): the thinker's config
# holds the text model's (`thinker_config.text_config`), the thinker's tensors lie at `thinker.` (its text model's at
# `thinker.model.`, its head at `thinker.lm_head.`, its audio and vision towers beside them: `THINKER_TOWERS`), the
# talker's and the speech decoder's elsewhere; text is served, speech is not
THINKER_CONFIGS = ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration")
THINKER_TOWERS = ("audio_tower.", "visual.")   # their text configs read through `vl_text_keys` (MRoPE, saved names)

# Multimodal checkpoints whose text model may be one of several families, named by the text_config's model_type (its
# config class's default where absent): the HF-format InternVL (InternVL3, InternVL3.5), LLaVA (LLaVA 1.5, Pixtral
# 12B as llava-hf publishes it), LLaVA-NeXT, LLaVA-OneVision, Aya Vision and those below, their text models at
# `language_model.` (under `model.`, or the older layout's `language_model.model.`)
ANY_TEXT_MODELS = {"InternVLForConditionalGeneration": "qwen2", "LlavaForConditionalGeneration": "llama",
                   "LlavaNextForConditionalGeneration": "llama", "LlavaOnevisionForConditionalGeneration": "qwen2",
                   "AyaVisionForConditionalGeneration": "cohere2",
                   # and VipLLaVA, Video-LLaVA, LLaVA-NeXT-Video, GOT-OCR 2.0, Ovis2, VideoLLaMA3, DeepSeek-VL, Janus
                   "VipLlavaForConditionalGeneration": "llama", "VideoLlavaForConditionalGeneration": "llama",
                   "LlavaNextVideoForConditionalGeneration": "llama", "GotOcr2ForConditionalGeneration": "qwen2",
                   "Ovis2ForConditionalGeneration": "qwen2", "VideoLlama3ForConditionalGeneration": "qwen2",
                   "DeepseekVLForConditionalGeneration": "llama", "JanusForConditionalGeneration": "llama",
                   # and DeepSeek-VL's hybrid (its SAM tower beside the SigLIP one, not read)
                   "DeepseekVLHybridForConditionalGeneration": "llama"}
# the text models they are served as, by model_type
TEXT_TYPE_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                   "cohere2": "Cohere2ForCausalLM", "granite": "GraniteForCausalLM"}
MULTIMODAL_ARCHITECTURES = (*TEXT_MODELS, *ANY_TEXT_MODELS)


def is_multimodal(arch: str) -> bool:
    """Whether `arch` is a multimodal checkpoint served as its text model."""
    return arch in TEXT_MODELS or arch in ANY_TEXT_MODELS


def thinker_config(arch: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the config that holds `arch`'s text_config, its key path in errors): an Omni model's thinker's
    (`THINKER_CONFIGS`), else the checkpoint's own."""
    if arch not in THINKER_CONFIGS:
        return cfg, ""
    thinker = cfg.get("thinker_config")
    if not isinstance(thinker, dict):
        raise ConfigError(f"thinker_config: {arch} is served as its thinker's text model: an object holding its "
                          f"text_config, got {thinker!r:.60}")
    return thinker, "thinker_config."


def text_model(arch: str, text: dict[str, Any] | None) -> tuple[str, str, str]:
    """(the text model's architecture, its weights' prefix, the model_type its text_config must name) of multimodal
    architecture `arch` whose text_config is `text` (None: absent); a text model we do not serve of a family that
    holds several is refused naming text_config.model_type."""
    if arch in ANY_TEXT_MODELS:
        kind = (text or {}).get("model_type", ANY_TEXT_MODELS[arch])
        if kind not in TEXT_TYPE_ARCHS:
            raise ConfigError(f"text_config.model_type: {arch}'s text model is served as one of "
                              f"{', '.join(TEXT_TYPE_ARCHS)}, got {kind!r}")
        return TEXT_TYPE_ARCHS[kind], "language_model.", kind
    text_arch, prefix, model_type = TEXT_MODELS[arch]
    if text is not None and (arch, text.get("model_type")) in TEXT_MODEL_TYPES:
        text_arch, model_type = TEXT_MODEL_TYPES[arch, text["model_type"]], text["model_type"]
    return text_arch, prefix, model_type
