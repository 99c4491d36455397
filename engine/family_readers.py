"""Which module reads each family's config.json, where it is not the Llama reading with a few fields of
`engine.model_families`: `KEY_READERS` (config.json under the Llama reading's key names, before that reading: GPT-2's
keys of GPT-J, GPT-2 and GPT-BigCode, OPT's, DBRX's and Falcon's older ones, LFM2's, Nemotron-H's, Kimi Linear's,
Kolibri-1's, LongCat-Flash's, MiniMax's and Muse's own) and `OWN_MODULE_FIELDS` (a family's `ModelConfig`
fields, read by its own module from config.json and the layer count)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.aria_config import aria_text_fields
from engine.bias_config import bloom_config, bloom_fields, mpt_config, mpt_fields
from engine.cohere_moe_config import cohere2_moe_fields, cohere_compass_fields
from engine.dbrx_config import dbrx_config, dbrx_fields
from engine.deepseek_config import minicpm3_fields, mistral4_fields, youtu_fields
from engine.deepseek_v4_config import deepseek_v4_fields
from engine.dory_config import dory_config, dory_fields
from engine.beam_config import beam_fields
from engine.falcon_config import falcon_config, falcon_fields
from engine.falcon_h1_config import falcon_h1_fields
from engine.flint_config import flint_fields
from engine.gated_delta_config import HYBRID_FIELDS
from engine.gpt2_config import (gpt2_config, gpt2_fields, gpt_bigcode_config, gpt_bigcode_fields, gpt_neo_config,
                                gpt_neo_fields, opt_config, opt_fields)
from engine.gemma3n_config import gemma3n_config, gemma3n_fields
from engine.gemma4_config import gemma4_fields
from engine.gptj_config import gptj_config, gptj_fields
from engine.granite_config import bamba_fields, hyperclovax_fields
from engine.hunyuan_config import HUNYUAN_FIELDS
from engine.hy_v4_config import hy_v4_fields
from engine.kimi_linear_config import bailing_hybrid_config, kimi_linear_config
from engine.kolibri_config import kolibri_config, kolibri_fields
from engine.laguna_config import laguna_fields
from engine.lara_mini_config import lara_mini_config, lara_mini_fields
from engine.lfm2_config import lfm2_config, lfm2_moe_config
from engine.llama4_config import MISTRAL_FIELDS, llama4_fields, mllama_config, mllama_fields
from engine.longcat_config import longcat_config, longcat_fields
from engine.mamba1_config import falcon_mamba_fields, jamba_fields, mamba_config, mamba_fields
from engine.mamba_config import mamba2_config, mamba2_fields
from engine.zamba2_config import zamba2_config, zamba2_fields
from engine.mimo_config import mimo_fields
from engine.minimax_config import minimax_config, minimax_fields
from engine.minimax_m3_config import minimax_m3_config, minimax_m3_fields
from engine.muse_config import muse_glimmer_config, muse_glimmer_fields, muse_spark_config, muse_spark_fields
from engine.step3p7_config import step3p7_config, step3p7_fields
from engine.nemotron_h_config import nemotron_h_config
from engine.phimoe_config import phimoe_fields
from engine.qwen4_exp_config import qwen4_exp_fields
from engine.zaya_config import zaya_config, zaya_fields

__all__ = ["KEY_READERS", "OWN_MODULE_FIELDS"]

# config.json -> config.json under the Llama reading's names
KEY_READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "NemotronHForCausalLM": nemotron_h_config, "Lfm2ForCausalLM": lfm2_config, "Lfm2MoeForCausalLM": lfm2_moe_config,
    "Lfm3ForCausalLM": lfm2_moe_config, "KimiLinearForCausalLM": kimi_linear_config,
    "Kolibri1ForCausalLM": kolibri_config, "BailingHybridForCausalLM": bailing_hybrid_config,
    "FalconForCausalLM": falcon_config, "GPTJForCausalLM": gptj_config,
    "GPTBigCodeForCausalLM": gpt_bigcode_config, "GPT2LMHeadModel": gpt2_config, "OPTForCausalLM": opt_config,
    "GPTNeoForCausalLM": gpt_neo_config, "CodeGenForCausalLM": gptj_config,
    "DbrxForCausalLM": dbrx_config, "MambaForCausalLM": mamba_config, "FalconMambaForCausalLM": mamba_config,
    "Mamba2ForCausalLM": mamba2_config, "Zamba2ForCausalLM": zamba2_config,
    "LongcatFlashForCausalLM": longcat_config, "MllamaForCausalLM": mllama_config,
    "Gemma3nForCausalLM": gemma3n_config, "LaraMiniForCausalLM": lara_mini_config,
    "MiniMaxForCausalLM": minimax_config, "MiniMaxM3VLForCausalLM": minimax_m3_config,
    "Step3p7ForCausalLM": step3p7_config, "BloomForCausalLM": bloom_config, "MptForCausalLM": mpt_config,
    "DoryForCausalLM": dory_config, "ZayaForCausalLM": zaya_config, "MuseGlimmerForCausalLM": muse_glimmer_config,
    "MuseSparkForCausalLM": muse_spark_config}
# (config.json, its layer count) -> the family's ModelConfig fields
OWN_MODULE_FIELDS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "Llama4ForCausalLM": llama4_fields, "Gemma4ForCausalLM": gemma4_fields, "Mistral4ForCausalLM": mistral4_fields,
    **MISTRAL_FIELDS, **HUNYUAN_FIELDS, **HYBRID_FIELDS, "MiMoV2FlashForCausalLM": mimo_fields,
    "Cohere2MoeForCausalLM": cohere2_moe_fields, "CohereCompassForCausalLM": cohere_compass_fields,
    "YoutuForCausalLM": youtu_fields,
    "Kolibri1ForCausalLM": kolibri_fields, "FlintForCausalLM": flint_fields, "BambaForCausalLM": bamba_fields,
    "FalconH1ForCausalLM": falcon_h1_fields, "HYV4ForCausalLM": hy_v4_fields,
    "DeepseekV4ForCausalLM": deepseek_v4_fields, "BeamForCausalLM": beam_fields,
    "HyperCLOVAXForCausalLM": hyperclovax_fields, "LagunaForCausalLM": laguna_fields,
    "PhimoeForCausalLM": phimoe_fields, "FalconForCausalLM": falcon_fields, "GPTJForCausalLM": gptj_fields,
    "GPTBigCodeForCausalLM": gpt_bigcode_fields, "GPT2LMHeadModel": gpt2_fields, "OPTForCausalLM": opt_fields,
    "GPTNeoForCausalLM": gpt_neo_fields, "CodeGenForCausalLM": gptj_fields,
    "DbrxForCausalLM": dbrx_fields, "MiniCPM3ForCausalLM": minicpm3_fields, "JambaForCausalLM": jamba_fields,
    "MambaForCausalLM": mamba_fields, "FalconMambaForCausalLM": falcon_mamba_fields,
    "Mamba2ForCausalLM": mamba2_fields, "Zamba2ForCausalLM": zamba2_fields,
    "LongcatFlashForCausalLM": longcat_fields, "MllamaForCausalLM": mllama_fields,
    "Gemma3nForCausalLM": gemma3n_fields, "LaraMiniForCausalLM": lara_mini_fields,
    "MiniMaxForCausalLM": minimax_fields, "MiniMaxM3VLForCausalLM": minimax_m3_fields,
    "Step3p7ForCausalLM": step3p7_fields, "BloomForCausalLM": bloom_fields, "MptForCausalLM": mpt_fields,
    "AriaTextForCausalLM": aria_text_fields, "Qwen4ExpForCausalLM": qwen4_exp_fields, "DoryForCausalLM": dory_fields,
    "ZayaForCausalLM": zaya_fields, "MuseGlimmerForCausalLM": muse_glimmer_fields,
    "MuseSparkForCausalLM": muse_spark_fields}
