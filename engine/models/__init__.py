"""The model classes by architecture, and `build_model`, which makes one.

The Llama family (Llama 2/3, Qwen2, Qwen3, Mistral) is `engine.model.LlamaForCausalLM`; a variant that changes the layer
itself has a module here, built from the same shared layers (`engine.layers`) and the same weight loading and
tensor-parallel cuts: `gemma3` (Gemma 3's text model, and Gemma 2's), `gemma4` (Gemma 4's text model), `qwen3_moe`
(Qwen3-MoE, Qwen2-MoE, Aria), `mixtral` (Mixtral's experts), `phi3` (Phi-3 and Phi-4: fused q/k/v and gate/up),
`granite` (Granite 3 and 4), `olmo2` (OLMo 2 and 3: post-norm layers), `smollm3` (SmolLM3: NoPE layers), `gptj` (GPT-J,
CodeGen), `gpt_oss` (GPT-OSS), `cohere` (Command R, R7B, A Plus), `ernie` (ERNIE 4.5), `glm4` (GLM-4, GLM-4.5,
K-EXAONE), `deepseek` (DeepSeek V2 and V3, Mistral Small 4), `deepseek_v32` (DeepSeek V3.2 and GLM-5: sparse attention),
`minimax_m2` (MiniMax-M2), `llama4` (Llama 4's text model), `ministral3` (Ministral 3), `qwen3_5` (Qwen3.5, Qwen3-Next:
Gated DeltaNet layers; `lara_mini`, Lara Mini's; `qwen4_exp`, Qwen4-Exp's: residual streams, n-gram embeddings, QSA),
`nemotron_h` (Nemotron-H), `lfm2` (LFM2), `kimi_linear` (Kimi Linear), `minimax` (MiniMax-Text-01: lightning attention),
`jamba` (Jamba), `mamba` (Mamba, FalconMamba, Mamba2), `zamba2` (Zamba2), over `hybrid`'s states; `mimo`
(MiMo-V2-Flash); `apertus` (Apertus, Arcee's AFM, Jais 2: ungated MLPs), `mllama` (Llama 3.2 Vision's text model),
`minimax_m3` (MiniMax M3: block-sparse attention), `step3p7` (Step 3.7: Laguna's layers), `bloom` (BLOOM, MPT: ALiBi),
`muse` (Muse Glimmer: Gemma 2's layer, AFMoE's gated attention, weightless q/k norms; Muse Spark: gated residuals,
experts over a projection), `dory` (Dory: nGPT layers, looped), `zaya` (ZAYA1: CCA attention beside a state, routed
experts). LongCat-Flash's are in `deepseek`, Persimmon's in `gpt_neox`."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.config import ConfigError
from engine.fp8_weights import FP8_LINEARS, fp8_cuts_aligned, served_fp8_block
from engine.granite_config import GRANITE3_MOE
from engine.int4_weights import int4_quantizes
from engine.model_config import GEMMA_ARCHITECTURES, ModelConfig
from engine.layers import RotaryEmbedding
from engine.layers.fp8_linear import Fp8Experts, Fp8Linear, swap_fp8_linears
from engine.layers.int4_linear import Int4Linear, swap_int4_linears
from engine.model import LlamaForCausalLM
from engine.models.afmoe import AfmoeForCausalLM
from engine.models.apertus import (ApertusForCausalLM, ArceeForCausalLM, Jais2ForCausalLM, NemotronForCausalLM,
                                   Starcoder2ForCausalLM)
from engine.models.cohere import Cohere2MoeForCausalLM, CohereCompassForCausalLM, CohereForCausalLM, HeliumForCausalLM
from engine.models.deepseek import AXK1ForCausalLM, DeepseekForCausalLM, LongcatFlashForCausalLM
from engine.models.deepseek_v32 import AXK2ForCausalLM, DeepseekV32ForCausalLM
from engine.models.hy_v4 import HYV4ForCausalLM
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.beam import BeamForCausalLM
from engine.models.ernie import Ernie45ForCausalLM, Ernie45MoeForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM, GemmaForCausalLM
from engine.models.gemma3n import Gemma3nForCausalLM
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.glm4 import (ExaoneMoeForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, GlmForCausalLM,
                                HYV3ForCausalLM)
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.laguna import LagunaForCausalLM
from engine.models.lara_mini import LaraMiniForCausalLM
from engine.models.llama4 import Llama4ForCausalLM
from engine.models.ministral3 import Ministral3ForCausalLM
from engine.models.exaone import ExaoneForCausalLM
from engine.models.falcon_h1 import FalconH1ForCausalLM
from engine.models.jamba import JambaForCausalLM
from engine.mamba1_config import MAMBA_ARCHITECTURES
from engine.models.mamba import MambaForCausalLM
from engine.models.zamba2 import Zamba2ForCausalLM
from engine.models.granite import (BambaAttentionForCausalLM, BambaForCausalLM, GraniteForCausalLM,
                                   GraniteHybridForCausalLM, GraniteHybridMoeForCausalLM, GraniteMoeHybridForCausalLM,
                                   GraniteMoeSWAForCausalLM, GraniteSWAForCausalLM, HyperClovaxForCausalLM)
from engine.models.hunyuan import HunyuanDenseForCausalLM, HunyuanMoeForCausalLM
from engine.models.mimo import MimoV2FlashForCausalLM
from engine.models.minimax import MiniMaxForCausalLM
from engine.models.minimax_m3 import MiniMaxM3ForCausalLM
from engine.models.muse import MuseGlimmerForCausalLM, MuseSparkForCausalLM
from engine.models.step3p7 import Step3p7ForCausalLM
from engine.models.bloom import BloomForCausalLM, MptForCausalLM
from engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from engine.models.mllama import MllamaForCausalLM
from engine.models.kimi_linear import BailingHybridForCausalLM, KimiLinearForCausalLM
from engine.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from engine.models.kolibri import FlintForCausalLM, KolibriForCausalLM
from engine.models.lfm3 import Lfm3ForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import (Exaone4ForCausalLM, FlexOlmoForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM,
                                 OlmoeForCausalLM, OlmoHybridForCausalLM)
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM
from engine.models.falcon import FalconForCausalLM
from engine.models.gpt2 import GPT2LMHeadModel, GPTBigCodeForCausalLM, GPTNeoForCausalLM, OPTForCausalLM
from engine.models.gpt_neox import GPTNeoXForCausalLM, PersimmonForCausalLM
from engine.models.gptj import CodeGenForCausalLM, GPTJForCausalLM
from engine.models.phi import PhiForCausalLM
from engine.models.dbrx import DbrxForCausalLM
from engine.models.minicpm3 import MiniCPM3ForCausalLM
from engine.models.nanochat import NanoChatForCausalLM
from engine.models.olmo import OlmoForCausalLM
from engine.models.phimoe import PhimoeForCausalLM
from engine.models.stablelm import StableLmForCausalLM
from engine.models.nemotron_h import NemotronHForCausalLM
from engine.models.qwen3_5 import Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from engine.models.qwen4_exp import Qwen4ExpForCausalLM
from engine.models.dory import DoryForCausalLM
from engine.models.zaya import ZayaForCausalLM
from engine.models.qwen3_moe import AriaTextForCausalLM, MellumForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from engine.roofline import expert_params
from kernels.fused import get_fused_ops
from kernels.mxfp4 import MXFP4_GROUP

log = logging.getLogger("cliffguard.engine")

__all__ = ["build_model", "model_class"]

_VARIANTS: dict[str, type[LlamaForCausalLM]] = {"Gemma2ForCausalLM": Gemma3ForCausalLM,   # its layer, uncapped
    "Gemma3ForCausalLM": Gemma3ForCausalLM, "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma3nForCausalLM": Gemma3nForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM, "Phi3ForCausalLM": Phi3ForCausalLM, "OlmoForCausalLM": OlmoForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM, "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM, "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2MoeForCausalLM": Qwen3MoeForCausalLM,   # no q/k norms
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,   # its full layers NoPE
    "CohereCompassForCausalLM": CohereCompassForCausalLM,
    "Ernie4_5ForCausalLM": Ernie45ForCausalLM, "Ernie4_5_MoeForCausalLM": Ernie45MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM, "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM, "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM, "AXK1ForCausalLM": AXK1ForCausalLM,
    "AXK2ForCausalLM": AXK2ForCausalLM, "Llama4ForCausalLM": Llama4ForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekForCausalLM,   # GLM-4.7-Flash
    "YoutuForCausalLM": DeepseekForCausalLM,   # every MLP dense
    "Mistral4ForCausalLM": DeepseekForCausalLM,   # its queries scaled
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": DeepseekV32ForCausalLM,   # GLM-5
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM, "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunyuanDenseForCausalLM, "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM, "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM, "NemotronHForCausalLM": NemotronHForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunyuanMoeForCausalLM, "ApertusForCausalLM": ApertusForCausalLM,
    "MllamaForCausalLM": MllamaForCausalLM,   # Llama 3.2 Vision's text
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM, "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM, "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "Kolibri1ForCausalLM": KolibriForCausalLM, "FlintForCausalLM": FlintForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM, "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "Dots1ForCausalLM": Glm4MoeForCausalLM,   # dots.llm1: its layers
    "SolarOpenForCausalLM": Glm4MoeForCausalLM,   # Solar Open: alike
    "ArceeForCausalLM": ArceeForCausalLM, "AfmoeForCausalLM": AfmoeForCausalLM,
    "MiMoV2FlashForCausalLM": MimoV2FlashForCausalLM, "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM, "Jais2ForCausalLM": Jais2ForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM, "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM, "HYV4ForCausalLM": HYV4ForCausalLM, "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "ExaoneForCausalLM": ExaoneForCausalLM, "HyperCLOVAXForCausalLM": HyperClovaxForCausalLM,
    "MellumForCausalLM": MellumForCausalLM, "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM, "Glm4ForCausalLM": Glm4ForCausalLM, "LagunaForCausalLM": LagunaForCausalLM,
    "LaraMiniForCausalLM": LaraMiniForCausalLM, "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    "DoryForCausalLM": DoryForCausalLM, "ZayaForCausalLM": ZayaForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM, "PhiForCausalLM": PhiForCausalLM, "OPTForCausalLM": OPTForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM, "PhimoeForCausalLM": PhimoeForCausalLM,
    "FalconForCausalLM": FalconForCausalLM, "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel, "GPTJForCausalLM": GPTJForCausalLM, "GPTNeoForCausalLM": GPTNeoForCausalLM,
    "CodeGenForCausalLM": CodeGenForCausalLM, "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "NanoChatForCausalLM": NanoChatForCausalLM, "DbrxForCausalLM": DbrxForCausalLM, "BeamForCausalLM": BeamForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM, "GemmaForCausalLM": GemmaForCausalLM,
    "VaultGemmaForCausalLM": GemmaForCausalLM, "JambaForCausalLM": JambaForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM, "MiniMaxM3VLForCausalLM": MiniMaxM3ForCausalLM,
    "Step3p7ForCausalLM": Step3p7ForCausalLM, "BloomForCausalLM": BloomForCausalLM, "MptForCausalLM": MptForCausalLM,
    "AriaTextForCausalLM": AriaTextForCausalLM, "PersimmonForCausalLM": PersimmonForCausalLM,
    "MuseGlimmerForCausalLM": MuseGlimmerForCausalLM, "MuseSparkForCausalLM": MuseSparkForCausalLM,
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM, "Zamba2ForCausalLM": Zamba2ForCausalLM,
    **dict.fromkeys(MAMBA_ARCHITECTURES, MambaForCausalLM)}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that runs `config.architecture`: `_VARIANTS`', else the Llama model (Seed-OSS, CWM, Ministral)."""
    if config.architecture in ("GraniteMoeHybridForCausalLM", *GRANITE3_MOE) and config.num_experts:
        return GraniteHybridMoeForCausalLM   # Granite 4-H-Tiny, -Small; Granite 3's MoE models
    if config.architecture == "GraniteMoeHybridForCausalLM" and config.mamba is not None:   # Granite 4's -H models
        return GraniteHybridForCausalLM
    if config.architecture == "BambaForCausalLM":
        return BambaForCausalLM if config.mamba is not None else BambaAttentionForCausalLM
    return _VARIANTS.get(config.architecture, LlamaForCausalLM)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                shard: ShardShape | None = None, comm: Collectives | None = None,
                quantization: str = "none") -> LlamaForCausalLM:
    """An uninitialised model (or one rank's shard of it) on `device`, allocated, not filled: load or
    init it next. Its layers run the fused ops `kernels.fused.get_fused_ops(device, dtype)` picks; its
    projections are held in FP8 as `quantization` (the device's key: `engine.fp8_weights`) says."""
    check_dtype(config, dtype)
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    ops = get_fused_ops(device, dtype)
    with torch.device("meta"):
        model = model_class(config)(config, shard, comm, ops)
        _hold_quantized(model, quantization, device.type, capability, triton=ops.__name__ == "kernels.triton_fused")
    packed = [m.packed for m in model.modules() if isinstance(m, SparseMoeBlock) and m.packed]
    if packed:
        log.info("weights: the experts of %d layers held in %s as stored", len(packed), packed[0].upper())
    if int4 := sum(isinstance(m, Int4Linear) for m in model.modules()):
        log.info("weights: %d projections held in INT%d as stored", int4, model.config.int4_bits)
    if model.fp8_layers:   # what `quantization` made of the checkpoint, once a worker's log
        log.info("weights: %d projections held in FP8 (%s), the rest in %s", len(model.fp8_layers),
                 "as stored" if model.fp8_exact else "quantized as read, a scale an output row or block",
                 str(dtype).removeprefix("torch."))
    _allocate(model, dtype, device)
    for module in model.modules():   # every rotary cache (Gemma 3 has one per attention type)
        if isinstance(module, RotaryEmbedding):
            module.cos_sin_cache = module.cos_sin_cache.to(device=device, dtype=dtype)
    return model.eval()


def check_dtype(config: ModelConfig, dtype: torch.dtype) -> None:
    """ConfigError naming `dtype` for a model that cannot run in it: Gemma 2 or 3 in float16, whose activations
    overflow it (inf, then NaN; vLLM refuses it too). The capacity plan applies it too, naming the device."""
    if config.architecture in GEMMA_ARCHITECTURES and dtype == torch.float16:
        raise ConfigError(f"dtype: Gemma {config.architecture[5]}'s activations overflow float16 (inf, then NaN); "
                          "use bfloat16 (a GPU of compute capability 8.0 or newer) or float32")


def _allocate(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Each (meta) parameter replaced by an empty one of `dtype` on `device`, a shared one once: what
    `to_empty(device).to(dtype)` does, without its Python meta kernels, whose first use imports
    torch._dynamo and sympy (1.5 s of every worker's start on a CPU). A module with `float32_parameters` (DeepSeek's
    router) keeps its parameters in float32 whatever the model's dtype."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        kind = torch.float32 if getattr(module, "float32_parameters", False) else dtype
        kinds = getattr(module, "parameter_dtypes", {})   # an FP8 projection's weight and scales
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=kinds.get(name, kind),
                                                               device=device), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]


# The classes whose loading puts each stored tensor bound for an FP8-held layer into it unchanged but for its name
# and cuts (their reading, destinations and cuts, and their subclasses' that keep them), each with the projections its
# reading does reorder (held in the model's dtype instead): the Llama family's; Qwen3-MoE's (per-expert tensors
# into the stacked w13 / w2; a stacked checkpoint aside) and Mixtral's (renamed); DeepSeek V3's and V3.2's (they
# reorder only the latent attention's and the indexer's rotary rows, not held); GLM-4.5's and MiniMax-M2's (q/k rows
# reordered for their partial rotary: qkv_proj is not held); Llama 3.2 Vision's (its layers renumbered as read)
_FP8_READERS: dict[type, tuple[str, ...]] = {
    LlamaForCausalLM: (), Qwen3MoeForCausalLM: (), MixtralForCausalLM: (), DeepseekForCausalLM: (),
    DeepseekV32ForCausalLM: (), Glm4MoeForCausalLM: ("self_attn.qkv_proj",), MllamaForCausalLM: (),
    MiniMaxM2ForCausalLM: ("self_attn.qkv_proj",), MimoV2FlashForCausalLM: ("self_attn.qkv_proj",)}
_READING = ("read_tensor", "_destination", "_shard_of", "cut_shape")


def _fp8_reader(cls: type[LlamaForCausalLM]) -> type | None:
    """The class of `_FP8_READERS` whose loading `cls` runs (each of its reading methods that one's, or one it
    inherits), None where `cls` reads otherwise."""
    reader = next((c for c in cls.__mro__ if c in _FP8_READERS), None)
    return reader if reader is not None and all(getattr(cls, m) is getattr(reader, m) for m in _READING) else None


def exact_fp8_loading(cls: type[LlamaForCausalLM], config: ModelConfig) -> bool:
    """Whether a model class's loading puts each stored tensor bound for an FP8-held layer into it unchanged but for
    its name and cuts (`_FP8_READERS`), so an FP8 checkpoint's values and scales can be held as stored."""
    return not config.stacked_experts and _fp8_reader(cls) is not None


def fp8_cuts(config: ModelConfig, shard: ShardShape) -> dict[str, tuple[list[int], list[int]]]:
    """Where the Llama family's fused parts and this rank's shares of the FP8 projections start: rows of qkv_proj
    and gate_up_proj, columns of the row-parallel o_proj and down_proj (`engine.fp8_weights.fp8_cuts_aligned`)."""
    d, inter, moe = config.head_dim, shard.intermediate_size, shard.moe_intermediate_size
    q, kv = shard.num_heads * d, shard.num_kv_heads * d
    cuts = {"qkv_proj": ([q, q + kv, shard.head_start * d, shard.kv_head_start * d], []),
            "o_proj": ([], [shard.head_start * d]), "gate_up_proj": ([inter, shard.rank * inter], []),
            "down_proj": ([], [shard.rank * inter])}
    if config.mla is not None:   # latent attention: no qkv_proj; o_proj's columns are each head's value
        cuts |= {"qkv_proj": ([], []), "o_proj": ([], [shard.head_start * config.mla.v_head_dim])}
    if config.mimo is not None:   # its qkv_proj reordered as read (never held as stored); o_proj's: value heads
        cuts |= {"qkv_proj": ([], []), "o_proj": ([], [shard.head_start * config.mimo.v_head_dim])}
    if config.num_experts:   # experts' rows one after another: w13 [E x 2 x moe, hidden], w2 [E x hidden, moe]
        cuts |= {"w13": ([moe, 2 * moe, shard.rank * moe], []), "w2": ([config.hidden_size], [shard.rank * moe])}
    return cuts


def held_fp8_block(model: LlamaForCausalLM | ModelConfig, shard: ShardShape, quantization: str, device_type: str,
                   capability: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The scale block `model`'s FP8 projections are held in (`engine.fp8_weights.served_fp8_block`) on this rank
    (`shard`), None where they are held in the model's dtype. `model`: a model, or the config it is built from."""
    config = model if isinstance(model, ModelConfig) else model.config
    return served_fp8_block(config.fp8_weight_block, quantization, device_type, capability,
                            _keeps_stored_fp8(model, shard))


def _keeps_stored_fp8(model: LlamaForCausalLM | ModelConfig, shard: ShardShape) -> bool:
    """Whether `model` (or the model `model` configures) can hold its FP8 checkpoint's blocks as stored: its loading
    reads them unchanged and its cuts lie on their edges."""
    config = model if isinstance(model, ModelConfig) else model.config
    stored = config.fp8_weight_block
    return exact_fp8_loading(model_class(config) if model is config else type(model), config) and (
        stored is None or fp8_cuts_aligned(stored, fp8_cuts(config, shard)))


def held_packed(config: ModelConfig, shard: ShardShape, quantization: str, device_type: str) -> str | None:
    """How one rank (`shard`) holds a checkpoint's quantized experts as stored: "mxfp4" (GPT-OSS's, `kernels.mxfp4`:
    4.25 bits a weight), "int4" or "int8" (`engine.int4_formats`: 4 or 8 bits plus a scale a group), or None where
    they are dequantized as read (integer experts in activation order too). Held under `quantization` auto on a GPU
    (the Triton kernels decode each tile as loaded), fp8 or the format's own key on any device (a CPU dequantizes
    each expert a step hits: memory, not speed), where the rank's share of the intermediate size is whole groups (any
    share, with a scale a row); a ConfigError naming the key where that key cannot."""
    kind, group = ("mxfp4", MXFP4_GROUP) if config.mxfp4_experts else (f"int{config.int4_bits}", config.int4_group or 0)
    stored = config.mxfp4_experts or config.int4_group is not None
    if quantization in ("mxfp4", "int4", "int8") and quantization != kind or quantization == kind and not stored:
        raise ConfigError(f"quantization: {quantization} holds a checkpoint's {quantization.upper()} experts as "
                          f"stored; this checkpoint has {kind.upper() + ' ones' if stored else 'none'}: use auto, fp8 "
                          "or none")
    if quantization == "mxfp4" and not config.num_experts:
        raise ConfigError("quantization: mxfp4 holds a checkpoint's MXFP4 experts as stored; this model has no "
                          "experts: use auto or none")
    if not stored or quantization == "none" or quantization == "auto" and device_type != "cuda" \
            or not config.num_experts or config.int4_act_order:
        return None   # (integer experts in activation order: dequantized as read)
    if not group:   # a scale a row: every rank holds its rows' scales whole
        return kind
    if shard.moe_intermediate_size % group and quantization == kind:
        raise ConfigError(f"quantization: {kind} under tensor parallelism {shard.size} cuts each expert's "
                          f"{config.moe_intermediate_size} inputs into shares of {shard.moe_intermediate_size}, not "
                          f"whole groups of {group} scaled together: use auto (dequantized) or another size")
    return kind if shard.moe_intermediate_size % group == 0 else None


# A Llama-family projection's parts as a checkpoint names them
_STORED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def held_int4(model: LlamaForCausalLM, quantization: str, device_type: str) -> set[str]:
    """The projections of `model` (on the meta device, not yet swapped) held in INT4 or INT8 as an integer checkpoint
    stores them (`engine.layers.int4_linear`): under `quantization` auto on a GPU (the Triton GEMM decodes each tile
    as loaded), int4 / int8 (its width) or fp8 on any device (a CPU dequantizes a layer's weight on each call:
    memory, not speed). Held: a decoder layer's attention and MLP projections (`FP8_LINEARS`) whose every part the
    checkpoint stores so (its targets and ignore list, matched to `model.<layer's name>`), where the family's loading
    reads them unchanged (`_FP8_READERS`) and a row-parallel rank's columns start on a group (any column, with a
    scale a row: group 0); the rest dequantized as read.
    In GPTQ's activation order a row-parallel rank's layers are not held (its columns are no whole groups). A
    ConfigError naming `quantization: int4` (int8) where a rank's cut would split a group."""
    config, group = model.config, model.config.int4_group
    reader = _fp8_reader(type(model))
    if group is None or reader is None or quantization not in ("auto", "fp8", "int4", "int8") \
            or quantization == "auto" and device_type != "cuda":
        return set()
    columns = fp8_cuts(config, model.shard)
    held = set()
    for name, module in model.named_modules():
        suffix = next((s for s in FP8_LINEARS if name.endswith(f".{s}")), None)
        if suffix is None or suffix in _FP8_READERS[reader] or not isinstance(module, nn.Linear):
            continue
        stored = [f"model.{config.text_weights_prefix}{name.removesuffix(suffix)}{part}"
                  for part in _STORED_PARTS.get(suffix, (suffix,))]
        if not all(int4_quantizes(config.int4_modules, n) for n in stored):
            continue
        if config.int4_act_order and model.shard.size > 1 and suffix in ("self_attn.o_proj", "mlp.down_proj"):
            continue   # a rank's columns in activation order are no whole groups: dequantized as read
        if group and (module.in_features % group or any(c % group for c in columns[suffix.split(".")[1]][1])):
            if quantization in ("int4", "int8"):
                raise ConfigError(f"quantization: {quantization} cannot hold {name} as stored under tensor parallelism "
                                  f"{model.shard.size}: a rank's {module.in_features} inputs are not whole groups of "
                                  f"{group} scaled together: use auto (dequantized) or another size")
            continue
        held.add(name)
    return held


def _hold_quantized(model: LlamaForCausalLM, quantization: str, device_type: str,
                    capability: tuple[int, int] | None, triton: bool = False) -> None:
    """`model` (on the meta device) with the experts of each block that runs its own held packed (`held_packed`),
    its integer projections as stored (`held_int4`) and its projections in FP8 (`_hold_fp8`) where `quantization`
    says so. A ConfigError naming `quantization: int4` (int8) where nothing is held so."""
    config = model.config
    kind = held_packed(config, model.shard, quantization, device_type)
    for name, module in model.named_modules() if kind else ():
        if _runs_own_experts(module):
            module.hold_packed(kind, MXFP4_GROUP if kind == "mxfp4" else config.int4_group, config.int4_zero_points)
            model.packed_params |= {f"{name}.w13", f"{name}.w2"}
    int4 = held_int4(model, quantization, device_type)
    swap_int4_linears(model, int4, config.int4_group, triton, config.int4_zero_points, config.int4_act_order,
                      config.int4_bits)
    model.packed_params |= {f"{name}.weight" for name in int4}   # the float weight's name, as the reading asks
    if quantization in ("int4", "int8") and not kind and not int4:
        raise ConfigError(f"quantization: {quantization} holds a checkpoint's {quantization.upper()} experts and "
                          "projections as stored; this model holds none (its layers are float, or read otherwise): "
                          "use auto or none")
    _hold_fp8(model, quantization, device_type, capability, triton)


def _runs_own_experts(module: nn.Module) -> bool:
    """A block whose experts `SparseMoeBlock` runs (Qwen3-MoE's, DeepSeek's, GPT-OSS's, LongCat's; not Llama 4's)."""
    return isinstance(module, SparseMoeBlock) and type(module)._experts is SparseMoeBlock._experts \
        and (type(module).forward is SparseMoeBlock.forward or module.forward_runs_experts)


def _hold_fp8(model: LlamaForCausalLM, quantization: str, device_type: str,
              capability: tuple[int, int] | None, triton: bool = False) -> None:
    """`model` (on the meta device) with its projections swapped for FP8 ones where `quantization` says so, on the
    Triton GEMM where `triton` (the model runs the Triton kernels)."""
    stored = model.config.fp8_weight_block
    exact = _keeps_stored_fp8(model, model.shard)
    block = served_fp8_block(stored, quantization, device_type, capability, exact)
    if block is None:
        return
    reordered = _FP8_READERS.get(_fp8_reader(type(model)), ()) if stored else ()
    swap_fp8_linears(model, tuple(p for p in FP8_LINEARS if p not in reordered), block, triton)
    model.fp8_layers = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    for name, module in model.named_modules():   # experts the block runs itself, not held packed
        if _runs_own_experts(module) and not module.packed:
            module.hold_fp8(block)
            model.fp8_layers |= {f"{name}.{w}": Fp8Experts(module, w) for w in ("w13", "w2")}
    model.fp8_exact = stored is not None and exact


def held_int4_projections(config: ModelConfig, shard: ShardShape, quantization: str, device_type: str) -> int:
    """How many projections one rank (`shard`) holds in INT4 as stored (`held_int4`); a ConfigError as building the
    model gives."""
    if config.int4_group is None:
        return 0
    model = _meta_model(config, shard, torch.bfloat16, quantization, device_type)
    return sum(isinstance(m, Int4Linear) for m in model.modules())


def held_weight_bytes(config: ModelConfig, shard: ShardShape, dtype: torch.dtype, quantization: str,
                      device_type: str) -> int:
    """The bytes of one rank's weights (`shard`) as the engine holds them on a device of `device_type`: its
    parameters in `dtype` (DeepSeek's routers in float32), FP8 projections one byte a weight plus their float32
    scales, packed experts half a byte plus their scales (counted on the model built on the meta device)."""
    plain = shard.num_params(config) * dtype.itemsize + config.num_float32_params * (4 - dtype.itemsize)
    if held_fp8_block(config, shard, quantization, device_type) is None and config.int4_group is None \
            and not held_packed(config, shard, quantization, device_type):
        return plain
    model = _meta_model(config, shard, dtype, quantization, device_type)
    saved = sum(m.weight.numel() * (dtype.itemsize - 1) - m.weight_scale.numel() * 4 for m in model.fp8_layers.values())
    saved += sum(m.in_features * m.out_features * dtype.itemsize - m.held_bytes(dtype)
                 for m in model.modules() if isinstance(m, Int4Linear))
    saved += sum((1 if m.packed == "int8" else 2) * (m.w13.numel() + m.w2.numel()) * dtype.itemsize   # codes a byte
                 - _expert_bytes(m, dtype) for m in _held_blocks(model) if m.packed)
    return plain - saved


def held_expert_bytes(config: ModelConfig, dtype: torch.dtype, quantization: str, device_type: str) -> int:
    """The bytes of the whole model's routed experts as the engine holds them (`held_weight_bytes`' share of them):
    what a roofline reads as far as a step's tokens hit them."""
    plain = expert_params(config) * dtype.itemsize
    shard = ShardShape.of(config)
    if not config.num_experts or held_fp8_block(config, shard, quantization, device_type) is None \
            and not held_packed(config, shard, quantization, device_type):
        return plain
    held = _held_blocks(_meta_model(config, shard, dtype, quantization, device_type))
    return sum(_expert_bytes(m, dtype) for m in held) if held else plain


def _held_blocks(model: LlamaForCausalLM) -> list[SparseMoeBlock]:
    """The sparse layers whose experts `model` holds in FP8 or packed (MXFP4, INT4, INT8)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock) and (m.fp8_block is not None or m.packed)]


def _expert_bytes(block: SparseMoeBlock, dtype: torch.dtype) -> int:
    """The bytes of one layer's held experts: their values, and their scales (float32 FP8 ones, e8m0 MXFP4 ones) and
    zero points (INT4's and INT8's, a byte each)."""
    if block.packed:   # MXFP4's scales a byte each; INT4's and INT8's the model's dtype
        scale = 1 if block.packed == "mxfp4" else dtype.itemsize + (block.w13_zeros is not None)
        return block.w13.numel() + block.w2.numel() + scale * (block.w13_scales.numel() + block.w2_scales.numel())
    return block.w13.numel() + block.w2.numel() + 4 * (block.w13_scale.numel() + block.w2_scale.numel())


def _meta_model(config: ModelConfig, shard: ShardShape, dtype: torch.dtype, quantization: str,
                device_type: str) -> LlamaForCausalLM:
    """The model one rank (`shard`) builds, on the meta device, as `quantization` holds it (a rotary of one row)."""
    with torch.device("meta"):
        model = model_class(config)(config.serving([1]), shard, None, get_fused_ops("cpu", dtype))
        _hold_quantized(model, quantization, device_type, None)
    return model
