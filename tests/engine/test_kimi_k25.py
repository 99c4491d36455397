"""Kimi K2.5 and K2.6 (`KimiK25ForConditionalGeneration`: a MoonViT vision tower and projector beside DeepSeek V3's
text model under `language_model.`), served as the text model: the hub's layout and config names, and the layout
transformers 5 saves; its INT4 routed experts, whose quantization_config sits at the top of config.json, held as
stored. Greedy text against transformers' own multimodal model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.models.qwen3_moe import SparseMoeBlock
from tests.engine.test_engine_vs_hf import DEEPSEEK, _assert_serves_its_text_model, _hf_greedy
from tests.engine.test_int4_weights import int4_checkpoint
from tests.engine.test_mxfp4_weights import PROMPTS, _config, _greedy


def _kimi_k25(folder):
    """A tiny random Kimi K2.5 (DeepSeek V3's text model as DEEPSEEK with a q LoRA of 48, its router's correction bias
    drawn away from zero; a one-layer vision tower) saved in `folder` as transformers 5 saves it; the model."""
    import transformers

    text = transformers.DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                         max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5,
                                         bos_token_id=1, eos_token_id=2, **{**DEEPSEEK, "q_lora_rank": 48})
    vision = transformers.Kimi_K25VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, pos_emb_height=4, pos_emb_width=4)
    config = transformers.Kimi_K25Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         projection_hidden_size=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, tensor in [*hf.named_buffers(), *hf.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.5)
    hf.save_pretrained(folder)
    return hf


def _as_the_hub_writes_it(folder) -> None:
    """The checkpoint in `folder` in the hub's layout: the text layers at `language_model.model.layers.N` (transformers
    5 saves them as `blocks.N`), config.json naming the remote-code class and the text model `kimi_k2`."""
    from safetensors.torch import load_file, save_file

    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights |= {name.replace("language_model.model.blocks.", "language_model.model.layers."): tensor
                    for name, tensor in load_file(path).items()}
        path.unlink()
    for path in folder.glob("*.safetensors.index.json"):
        path.unlink()
    save_file(weights, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    cfg["text_config"]["model_type"] = "kimi_k2"
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_a_kimi_k25_checkpoint_serves_its_text_model(tmp_path, builtin_path, layout):
    folder = tmp_path / "k25"
    hf = _kimi_k25(folder)
    if layout == "hub":
        _as_the_hub_writes_it(folder)
    _assert_serves_its_text_model(hf, folder, builtin_path, "DeepseekV3ForCausalLM")


def test_its_int4_experts_are_held_as_stored_from_the_top_level_quantization_config(tmp_path, builtin_path):
    """Kimi K2.5's release quantizes the routed experts alone (pack-quantized INT4, a scale a group of 32), its
    quantization_config at the top of config.json, not in text_config: `quantization: int4` holds each sparse layer's
    experts as stored and decodes greedily as transformers' multimodal model over the weights the format defines;
    `none` dequantizes them, the same tokens."""
    import transformers

    folder = tmp_path / "k25"
    _kimi_k25(folder)
    _as_the_hub_writes_it(folder)
    reference = int4_checkpoint(folder, experts_only=True)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())["text_config"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(reference, dtype=torch.float32).eval()
    held = LLMEngine(_config(folder, "int4"), progress=False)
    sparse = [m for m in held.model.modules() if isinstance(m, SparseMoeBlock)]
    assert held.model_config.int4_group == 32 and sparse and all(m.packed == "int4" for m in sparse)
    tokens = _greedy(held)
    assert tokens == [_hf_greedy(hf, prompt, 12, eos_ids=None) for prompt in PROMPTS]
    assert _greedy(LLMEngine(_config(folder, "none"), progress=False)) == tokens
