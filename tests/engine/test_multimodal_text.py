"""Multimodal checkpoints whose text model is one of several families (`engine.multimodal_config.ANY_TEXT_MODELS`:
the HF-format InternVL, LLaVA, LLaVA-NeXT, LLaVA-OneVision, Aya Vision), served as the text model their text_config
names: greedy text token-identical to transformers' own multimodal model on text input, from the checkpoint
transformers saves (vision tower, projector and text model); a text model we do not serve refused by key. EXAONE
4.5's and HY4-VL's too (`TEXT_MODELS`)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ConfigError
from engine.model_config import ModelConfig
from tests.engine.test_engine_vs_hf import COMPASS, MINIMAX_M3, QWEN4_EXP, _assert_serves_its_text_model

STEP3P7 = {"num_hidden_layers": 4, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "sliding_window": 8, "num_sliding_attention_heads": 2, "moe_layers_enum": "1,2,3", "intermediate_size": 96,
           "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "share_expert_dim": 48,
           "moe_router_scaling_factor": 1.5, "rope_theta": [10000.0, 500000.0] * 2,
           "partial_rotary_factors": [1.0, 0.5] * 2, "swiglu_limits": [0, 0, 0, 0.5],
           "swiglu_limits_shared": [0.4, 0, 0, 0.4]}

TEXT_ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
              "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "granite": "GraniteForCausalLM",
              "cohere2": "Cohere2ForCausalLM"}
# each text family's keys past the common ones: small heads, GPT-OSS's experts and window, Granite's scalars
TEXT_KEYS = {"qwen3": {"head_dim": 16}, "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                     "intermediate_size": 48, "sliding_window": 8},
             "granite": {"embedding_multiplier": 3.0, "attention_multiplier": 0.05, "residual_multiplier": 0.5,
                         "logits_scaling": 2.0},
             "cohere2": {"sliding_window": 8}}


def _tiny_multimodal(folder, wrapper: str, kind: str):
    """A tiny random `wrapper` checkpoint (its config class's vision tower, one layer) around a `kind` text model,
    its biases and sinks drawn away from zero, saved in `folder` as transformers saves it; the model."""
    import transformers

    text = transformers.AutoConfig.for_model(kind, **{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.2,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **TEXT_KEYS.get(kind, {})})
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                 patch_size=14)
    vision = {"internvl": lambda: transformers.InternVLVisionConfig(**{**small, "image_size": [28, 28],
                                                                       "patch_size": [14, 14]}),
              "llava": lambda: transformers.CLIPVisionConfig(**small),
              "llava_next": lambda: transformers.CLIPVisionConfig(**small),
              "llava_onevision": lambda: transformers.SiglipVisionConfig(**small),
              "aya_vision": lambda: transformers.SiglipVisionConfig(**small)}[wrapper]()
    config = transformers.AutoConfig.for_model(wrapper, text_config=text.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():   # transformers starts biases (Qwen2's q/k/v, GPT-OSS's experts') and sinks at zero
        for name, param in hf.named_parameters():
            if "language_model." in name and name.endswith(("bias", "sinks")):
                param.normal_(0.0, 1.0)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("wrapper,kind", [("internvl", "qwen2"), ("internvl", "qwen3"), ("internvl", "gpt_oss"),
                                          ("llava", "llama"), ("llava", "mistral"), ("llava_next", "granite"),
                                          ("llava_onevision", "qwen2"), ("aya_vision", "cohere2")])
def test_a_multimodal_checkpoint_serves_the_text_model_its_text_config_names(tmp_path, builtin_path, wrapper, kind):
    folder = tmp_path / wrapper
    hf = _tiny_multimodal(folder, wrapper, kind)
    _assert_serves_its_text_model(hf, folder, builtin_path, TEXT_ARCHS[kind])


def test_a_text_model_we_do_not_serve_is_refused_by_key(tmp_path, builtin_path):
    """LLaVA around a text model of a family we do not serve there (T5 Gemma's encoder-decoder, say): refused naming
    text_config.model_type and what is served, before a weight is read."""
    folder = tmp_path / "llava"
    _tiny_multimodal(folder, "llava", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["model_type"] = "t5gemma"
    with pytest.raises(ConfigError, match=r"^text_config\.model_type: LlavaForConditionalGeneration's text model is "
                                          r"served as one of llama, .*got 't5gemma'"):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("text_type", ["exaone4", "exaone4_5_text"])
def test_an_exaone_4_5_checkpoint_serves_its_text_model(tmp_path, builtin_path, text_type):
    """EXAONE 4.5 (`Exaone4_5_ForConditionalGeneration`: a vision tower at `model.visual.` beside EXAONE 4's text
    model, sliding layers that rotate beside NoPE full ones) served as that text model, its text_config as transformers
    saves it (`exaone4`) or as the hub's names it (`exaone4_5_text`); greedy text token-identical to transformers'."""
    import transformers

    text = transformers.Exaone4Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_hidden_layers=4,
                                      head_dim=16, sliding_window=8, pad_token_id=0)
    vision = transformers.Exaone4_5_VisionConfig(hidden_size=32, intermediate_size=64, depth=1, num_heads=2,
                                                 out_hidden_size=64, num_key_value_heads=2, fullatt_block_indexes=[0])
    torch.manual_seed(0)
    hf = transformers.Exaone4_5_ForConditionalGeneration(transformers.Exaone4_5_Config(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    folder = tmp_path / "exaone4_5"
    hf.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["model_type"] = text_type
    (folder / "config.json").write_text(json.dumps(cfg))
    _assert_serves_its_text_model(hf, folder, builtin_path, "Exaone4ForCausalLM")


def test_an_hy4_vl_checkpoint_serves_its_text_model(tmp_path, builtin_path):
    """HY4-VL (`HYV4VLForConditionalGeneration`: a vision tower at `vit.` beside HY V4's text model at `model.`,
    `hy_v4_vl_text`, whose XD-RoPE turns text as one rope, over interleaved pairs) served as HY V4; greedy text
    token-identical to transformers'."""
    import transformers

    from tests.engine.test_engine_vs_hf import HYV4

    text = transformers.HYV4VLTextConfig(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "max_position_embeddings": 512, "initializer_range": 0.2, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, **HYV4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}})
    vision = transformers.HYV4VLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    hf = transformers.HYV4VLForConditionalGeneration(transformers.HYV4VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    with torch.no_grad():   # sinks, correction biases and the mixes' scales and bases away from their start
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("sinks", "e_score_correction_bias", "_hc.scale", "_hc.base", "hc_scale", "hc_base")):
                tensor.normal_(0.0, 1.0)
    folder = tmp_path / "hy4_vl"
    hf.save_pretrained(folder)
    mla = ModelConfig.from_folder(folder).mla   # its rotary's interleaved pairs; q's and the latent's norms at 1e-5
    assert (mla.rope_interleave, mla.index_rope_interleave, mla.latent_norm_eps) == (True, True, 1e-5)
    _assert_serves_its_text_model(hf, folder, builtin_path, "HYV4ForCausalLM")


def test_an_ernie_4_5_vl_checkpoint_serves_its_text_model(tmp_path, builtin_path):
    """ERNIE 4.5 VL (`Ernie4_5_VLMoeForConditionalGeneration`: a vision tower and a resampler at `model.` beside its
    text model, whose layers hold text experts and vision experts side by side, 8 and 8 of their own sizes) served as
    ERNIE 4.5's MoE text model on its text experts (its interleaved 3-D rotary one rope on text); greedy text
    token-identical to transformers'."""
    import transformers

    text = transformers.Ernie4_5_VLMoeTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
        moe_intermediate_size=[32, 16], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [2, 2, 4]})
    vision = type(transformers.Ernie4_5_VLMoeConfig().vision_config)(depth=1, hidden_size=32, intermediate_size=64,
                                                                     num_heads=2)
    torch.manual_seed(0)
    hf = transformers.Ernie4_5_VLMoeForConditionalGeneration(transformers.Ernie4_5_VLMoeConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    with torch.no_grad():   # the correction biases and the routers away from their start at zero
        for name, tensor in hf.named_parameters():
            if name.endswith(("e_score_correction_bias", "gate.weight")) and ".mlp." in name:
                tensor.normal_(0.0, 0.5)
    folder = tmp_path / "ernie4_5_vl"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "Ernie4_5_MoeForCausalLM")


def test_a_hunyuan_vl_checkpoint_serves_its_text_model(tmp_path, builtin_path):
    """HunYuan-VL (`HunYuanVLForConditionalGeneration`: a vision tower at `vit.` beside Hunyuan's dense text model at
    `model.`, `hunyuan_vl_text`, whose XD-RoPE of four axes turns text as one rope, its base stretched by `alpha`)
    served as Hunyuan's dense model; greedy text token-identical to transformers'."""
    import transformers

    text = transformers.HunYuanVLTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, head_dim=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                      "alpha": 1000.0, "factor": 1.0,
                                                                      "mrope_section": [2, 2, 2, 2]})
    vision = transformers.HunYuanVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, out_hidden_size=64, text_hidden_size=64)
    torch.manual_seed(0)
    hf = transformers.HunYuanVLForConditionalGeneration(transformers.HunYuanVLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    with torch.no_grad():   # q/k norms away from their start at 1: normed before or after the rotary would show
        for name, param in hf.named_parameters():
            if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                param.normal_(1.0, 0.5)
    folder = tmp_path / "hunyuan_vl"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "HunYuanDenseV1ForCausalLM")


# wrapper -> (its text model's model_type and keys, the architecture served, where its tensors lie)
VISION_WRAPPERS = {
    "cohere2_vision": ("cohere2", {"sliding_window": 8}, "Cohere2ForCausalLM", "language_model."),
    "minicpmv4_6": ("qwen3_5_text", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                     "linear_value_head_dim": 8}, "Qwen3_5ForCausalLM", "language_model."),
    "lighton_ocr": ("qwen3", {"head_dim": 16}, "Qwen3ForCausalLM", "language_model."),
    "hyperclovax_vision_v2": ("hyperclovax", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                              "logits_scaling": 2.0}, "HyperCLOVAXForCausalLM", "language_model."),
    "smolvlm": ("llama", {}, "LlamaForCausalLM", "text_model."),
    "vipllava": ("llama", {}, "LlamaForCausalLM", "language_model."),
    "video_llava": ("llama", {}, "LlamaForCausalLM", "language_model."),
    "llava_next_video": ("mistral", {}, "MistralForCausalLM", "language_model."),
    "got_ocr2": ("qwen2", {}, "Qwen2ForCausalLM", "language_model."),
    "ovis2": ("qwen2", {}, "Qwen2ForCausalLM", "language_model."),
    "video_llama_3": ("qwen2", {}, "Qwen2ForCausalLM", "language_model."),
    "deepseek_vl": ("llama", {}, "LlamaForCausalLM", "language_model."),
    "idefics2": ("mistral", {}, "MistralForCausalLM", "text_model."),
    "janus": ("llama", {}, "LlamaForCausalLM", "language_model."),
    "deepseek_vl_hybrid": ("llama", {}, "LlamaForCausalLM", "language_model."),
    "granite_docling": ("granite_docling_text", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                                 "logits_scaling": 2.0, "attention_multiplier": 0.2},
                        "GraniteForCausalLM", "text_model."),
    "granite4_vision": ("granite4_vision_text", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                                "logits_scaling": 2.0, "attention_multiplier": 0.2},
                        "GraniteForCausalLM", "language_model."),
    # GLM-OCR: GLM-4.1V's text model without q/k/v biases
    "glm_ocr": ("glm_ocr_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}},
                "Glm4ForCausalLM", "language_model."),
    # PaddleOCR-VL: ERNIE 4.5's layer, every projection biased (`use_bias`), MRoPE's rotate-half pairs
    "paddleocr_vl": ("paddleocr_vl_text", {"head_dim": 16, "use_bias": True, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}, "LlamaForCausalLM",
        "language_model."),
    # Llama 3.2 Vision: a cross-attention layer between self-attention ones (not served: renumbered past it)
    "mllama": ("mllama_text_model", {"num_hidden_layers": 4, "cross_attention_layers": [1]}, "MllamaForCausalLM",
               "language_model."),
    "nemotron_h_omni": ("nemotron_h", {"num_hidden_layers": 4, "layers_block_type": [
        "linear_attention", "mlp", "full_attention", "linear_attention"], "head_dim": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2}, "NemotronHForCausalLM", "language_model."),
    # MiniMax M3: saved under its release's names (`language_model.model.`, `block_sparse_moe` with each expert's
    # w1 / w3 / w2, `self_attn.index_q_proj` ...), its block-sparse layers and experts
    "minimax_m3_vl": ("minimax_m3_vl_text", {k: v for k, v in MINIMAX_M3.items() if k != "pad_token_id"},
                      "MiniMaxM3VLForCausalLM", "language_model."),
    # Qwen4-Exp: its streams, PLE layers (their n-gram tables in parts) and QSA attention under `language_model.`
    "qwen4_exp": ("qwen4_exp_text", {k: v for k, v in QWEN4_EXP.items() if k != "pad_token_id"},
                  "Qwen4ExpForCausalLM", "language_model."),
    # Step 3.7: its release's layout (the text model at `model.`, stacked `moe.` experts, `share_expert.`), sliding
    # layers of their own query heads and rope beside full ones turning half of each head, dense first layers, the
    # clamps after the SiLU on the last layer
    "step3p7": ("step3p5", STEP3P7, "Step3p7ForCausalLM", "language_model."),
    # North's vision model: Cohere 2's layers with a rope per layer type (a NoPE full type) at Qwen3-VL's layout
    "cohere_compass": ("cohere_compass_text", COMPASS, "CohereCompassForCausalLM", "language_model."),
    # Muse Glimmer: Gemma 2's four norms (the output ones of their own epsilon), AFMoE's per-channel gate, q and k
    # normed without a weight and q scaled, sliding layers beside a full NoPE one, normed embeddings, the logits
    # scaled then soft-capped; its norms' weights random (`RANDOM_NORMS`)
    "muse_glimmer": ("muse_glimmer_text", {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
                                           "qk_scale_factor": 2.5, "output_multiplier": 0.5,
                                           "final_logit_softcapping": 6.0, "post_norm_eps": 0.5},
                     "MuseGlimmerForCausalLM", "language_model."),
    # Muse Spark: Glimmer's with each head's output normed, the sublayers joined by float32 gates, and past a dense
    # layer experts over a projection (stacked), each expert's output normed before it is weighed
    "muse_spark": ("muse_spark_text", {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
                                       "qk_scale_factor": 2.5, "output_multiplier": 0.5,
                                       "final_logit_softcapping": 6.0, "post_norm_eps": 0.5, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_hidden_size": 48,
                                       "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                                       "residual_gate_temperature": 0.7},
                   "MuseSparkForCausalLM", "language_model."),
    # Aria: the Llama layer with experts on every layer beside shared ones (stacked experts, `mlp.router`)
    "aria": ("aria_text", {"intermediate_size": 32, "moe_num_experts": 4, "moe_topk": 2}, "AriaTextForCausalLM",
             "language_model."),
}


# wrappers' own keys their config classes need (Granite 4 Vision's deepstack projectors: which vision layer feeds
# which text layer)
WRAPPER_KEYS = {"granite4_vision": {"deepstack_layer_map": [[-1, 0]], "spatial_target_layers": [0, 1, 0, 1],
                                    "downsample_rate": "1/4"}}
# wrappers whose tiny models' norm weights are drawn at random (transformers starts them where a scale reads as 1)
RANDOM_NORMS = ("muse_glimmer", "muse_spark")


@pytest.mark.parametrize("wrapper", list(VISION_WRAPPERS))
def test_a_vision_checkpoint_serves_its_text_model(tmp_path, builtin_path, wrapper):
    """Command A Vision (`cohere2_vision`), MiniCPM-V 4.6 (Qwen3.5's hybrid text model), LightOnOCR (Qwen3), HyperCLOVA
    X SEED Vision (`hyperclovax_vision_v2`), SmolVLM (Idefics3's layout: `model.text_model.`), VipLLaVA, Video-LLaVA and
    LLaVA-NeXT-Video, GOT-OCR 2.0, Ovis2, VideoLLaMA3, DeepSeek-VL (and its hybrid), Janus, Idefics2, Nemotron Nano Omni
    (Nemotron-H's hybrid), Llama 3.2 Vision (its self-attention layers alone), each its config class's vision tower
    shrunk around a tiny text model: greedy text token-identical to transformers'."""
    hf, folder = vision_checkpoint(tmp_path, wrapper)
    kind, keys, arch, prefix = VISION_WRAPPERS[wrapper]
    _assert_serves_its_text_model(hf, folder, builtin_path, arch, prefix)


def test_muse_glimmers_logits_are_scaled_then_capped_as_transformers_does(tmp_path, builtin_path):
    """Greedy tokens cannot show the order of Muse Glimmer's scale (`output_multiplier`) and soft cap of the logits:
    a prompt's logprobs equal transformers' log-softmax of its logits, and differ with the Llama model's order (the
    cap first)."""
    import shutil

    from engine.model import LlamaForCausalLM
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    hf, folder = vision_checkpoint(tmp_path, "muse_glimmer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    prompt = [1, *range(40, 70)]
    with torch.no_grad():
        want = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, :-1], dim=-1)
    want = want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = torch.tensor(engine.generate([prompt], params)[0].prompt_logprobs)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    engine.model.compute_logits = LlamaForCausalLM.compute_logits.__get__(engine.model)
    capped_first = torch.tensor(engine.generate([prompt], params)[0].prompt_logprobs)
    assert (capped_first - want).abs().max() > 0.1


def test_muse_sparks_experts_loop_as_the_grouped_matmul_runs_them(tmp_path, builtin_path):
    """Where the grouped matmul is not built for a dtype or device a Muse Spark sparse layer loops over the experts
    hit: the same rows, normed, weighed and added in the same order."""
    import shutil

    from engine.llm_engine import LLMEngine
    from engine.models.muse import MuseSparkMoeBlock

    _, folder = vision_checkpoint(tmp_path, "muse_spark")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=16, progress=False)
    blocks = [m for m in engine.model.modules() if isinstance(m, MuseSparkMoeBlock)]
    assert len(blocks) == 3 and all(block._grouped for block in blocks)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        grouped = blocks[0](x)
        blocks[0]._grouped = False
        torch.testing.assert_close(blocks[0](x), grouped, atol=1e-6, rtol=1e-6)


def vision_checkpoint(tmp_path, wrapper: str):
    """(transformers' model, the folder it saved itself to) of `VISION_WRAPPERS[wrapper]`: its config class's vision
    tower shrunk around the tiny text model."""
    import transformers

    kind, keys, arch, prefix = VISION_WRAPPERS[wrapper]
    text = transformers.AutoConfig.for_model(kind, **{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.2,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **keys})
    vision = transformers.AutoConfig.for_model(wrapper).vision_config
    for key, value in dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, depth=1,
                           num_heads=2, out_hidden_size=64).items():
        if hasattr(vision, key):
            setattr(vision, key, value)
    if getattr(vision, "layer_types", None):   # Muse Glimmer's tower: a type a layer
        vision.layer_types = vision.layer_types[:vision.num_hidden_layers]
    if wrapper == "granite4_vision":   # its Q-Former's heads: a head for each 64 of the tower's width
        vision.hidden_size = 64
    towers = {"vision_config": vision.to_dict()}
    audio = getattr(transformers.AutoConfig.for_model(wrapper), "audio_config", None)
    if hasattr(audio, "out_hidden_size"):   # Muse Spark's audio tower, its output the text model's width
        audio.out_hidden_size, audio.hidden_sizes = 64, [8, 8, 8, 8]
        towers["audio_config"] = audio.to_dict()
    config = transformers.AutoConfig.for_model(wrapper, text_config=text.to_dict(), **towers,
                                               **WRAPPER_KEYS.get(wrapper, {}))
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():   # Qwen3.5's decay rates small (a state holds tens of tokens), as the tiny models' are;
        for name, param in hf.named_parameters():   # biases away from their start at 0 (one read wrong would show)
            if name.endswith("A_log"):
                param.uniform_(-6.0, -4.0)
            elif name.endswith(".bias") and keys.get("use_bias"):
                param.normal_(0.0, 0.5)
            elif wrapper in RANDOM_NORMS and name.endswith("norm.weight"):   # a norm read as another's shows
                param.add_(torch.randn_like(param) * 0.5)
        for name, buffer in hf.named_buffers():   # experts' correction biases away from 0 (Muse Spark's)
            if wrapper in RANDOM_NORMS and name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    folder = tmp_path / wrapper
    hf.save_pretrained(folder)
    if wrapper == "glm_ocr":   # its checkpoints hold a multi-token-prediction layer past the model's: not read
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        tensors["model.language_model.layers.2.self_attn.q_proj.weight"] = torch.zeros(64, 64)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return hf, folder


OMNI_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
OMNI_AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64,
                  num_mel_bins=16)
OMNI_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# transformers' thinker reads its vision start token to place positions: one no prompt here holds
OMNI_THINKER = dict(initializer_range=0.2, vision_start_token_id=0)


@pytest.mark.parametrize("omni", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_an_omni_checkpoint_serves_its_thinkers_text_model(tmp_path, builtin_path, omni):
    """Qwen2.5-Omni (as its hub config.json names it, `Qwen2_5OmniModel`) and Qwen3-Omni
    (`Qwen3OmniMoeForConditionalGeneration`) served as their thinker's text model (`thinker_config.text_config`:
    Qwen2.5-VL's text model, Qwen3-MoE's; MRoPE, interleaved in Qwen3-Omni's, one rope on text) at `thinker.model.`,
    its head at `thinker.lm_head.`, beside the thinker's audio and vision towers: greedy text token-identical to
    transformers' thinker. Without its thinker_config the checkpoint is refused by that key."""
    import transformers

    if omni == "qwen3_omni_moe":
        text = {**OMNI_TEXT, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                    "interleaved": True}}
        thinker = transformers.Qwen3OmniMoeThinkerConfig(
            text_config=text, audio_config={**OMNI_AUDIO, "downsample_hidden_size": 8},
            vision_config={**OMNI_VISION, "deepstack_visual_indexes": [0]}, **OMNI_THINKER)
        config = transformers.Qwen3OmniMoeConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
        model, arch, served = transformers.Qwen3OmniMoeForConditionalGeneration, None, "Qwen3MoeForCausalLM"
    else:
        text = {**OMNI_TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3]}}
        thinker = transformers.Qwen2_5OmniThinkerConfig(text_config=text, audio_config=OMNI_AUDIO,
                                                        vision_config=OMNI_VISION, **OMNI_THINKER)
        config = transformers.Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
        model, arch, served = transformers.Qwen2_5OmniForConditionalGeneration, "Qwen2_5OmniModel", "Qwen2ForCausalLM"
    torch.manual_seed(0)
    hf = model(config).eval()
    folder = tmp_path / omni
    hf.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    if arch is not None:
        saved["architectures"] = [arch]
        (folder / "config.json").write_text(json.dumps(saved))
    _assert_serves_its_text_model(hf.thinker, folder, builtin_path, served, "thinker.")
    with pytest.raises(ConfigError, match="^thinker_config:"):
        ModelConfig.from_hf_config({k: v for k, v in saved.items() if k != "thinker_config"})


def test_paddleocr_vl_reads_its_text_model_from_the_top_of_its_first_releases_config():
    """PaddleOCR-VL's first release writes its text model's keys at the top of config.json (no text_config, as
    Qwen2-VL's hub checkpoints): read as the Llama model with ERNIE 4.5's one bias switch, its MRoPE one rope on text,
    its tensors at `model.` beside `visual.` and `mlp_AR.`."""
    card = {"architectures": ["PaddleOCRVLForConditionalGeneration"], "model_type": "paddleocr_vl", "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 131072,
            "num_attention_heads": 16, "num_hidden_layers": 18, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
            "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
            "rope_theta": 500000, "tie_word_embeddings": False, "use_bias": False, "vocab_size": 103424,
            "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}
    cfg = ModelConfig.from_hf_config(card)
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias, cfg.mlp_bias,
            cfg.tie_word_embeddings, cfg.bare_text_weights, cfg.rope_scaling.rope_type, cfg.rope_theta) == \
        ("LlamaForCausalLM", 18, 128, 2, False, False, False, True, "default", 500_000.0)
    assert ModelConfig.from_hf_config({**card, "use_bias": True}).mlp_bias


def test_a_fuyu_checkpoint_serves_its_persimmon_text_model(tmp_path, builtin_path):
    """Fuyu (`FuyuForCausalLM`): Persimmon's text model at `language_model.` beside the linear embedding of image
    patches (`vision_embed_tokens`, not read); greedy text token-identical to transformers' Fuyu on text input."""
    import transformers

    text = transformers.PersimmonConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
                                        bos_token_id=1, eos_token_id=2)
    config = transformers.FuyuConfig(text_config=text.to_dict(), patch_size=4, num_channels=3)
    torch.manual_seed(0)
    hf = transformers.FuyuForCausalLM(config).eval()
    with torch.no_grad():   # biases and the q/k LayerNorms away from their start (zeros, ones)
        for name, param in hf.named_parameters():
            if name.endswith(".bias") or "layernorm" in name:
                param.normal_(0.0 if name.endswith(".bias") else 1.0, 0.1)
    folder = tmp_path / "fuyu"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "PersimmonForCausalLM", "language_model.")


def test_an_emu3_checkpoint_serves_its_llama_text_model(tmp_path, builtin_path):
    """Emu3 (`Emu3ForConditionalGeneration`): the Llama model at `text_model.` beside its VQ-VAE image tokenizer (not
    read); greedy text token-identical to transformers' Emu3 on text input."""
    import transformers

    text = transformers.Emu3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vq = transformers.Emu3VQVAEConfig(codebook_size=64, base_channels=32, channel_multiplier=[1, 1],
                                      num_res_blocks=1, attn_resolutions=[], hidden_size=16)
    config = transformers.Emu3Config(text_config=text.to_dict(), vq_config=vq.to_dict(),
                                     vocabulary_map={f"<|visual token {i:06d}|>": 400 + i for i in range(64)})
    torch.manual_seed(0)
    hf = transformers.Emu3ForConditionalGeneration(config).eval()
    folder = tmp_path / "emu3"
    hf.save_pretrained(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "LlamaForCausalLM", "text_model.")
