"""The config.json fields of the architectures past Llama's shape, as `ModelConfig` fields: Gemma 3's layer types, rope
bases and norms (`gemma3_fields`), Gemma 2's layers and soft-capping, Qwen3-MoE's, Mixtral's and Qwen2-MoE's experts,
Phi-3's window and rope, SmolLM3's NoPE layers, GPT-OSS's experts, sinks and layers, EXAONE 4's layers, dots.llm1's
and Solar Open's layers and experts, the sliding
layers of Qwen2, Qwen3 and Qwen3-MoE (`qwen_window_fields`); Granite's, Llama 4's and Ministral 3's, Qwen3.5's in
`engine.granite_config`, `llama4_config`, `gated_delta_config`; DeepSeek's, GLM-4.7-Flash's and Mistral 4's latent
attention and grouped routers in `engine.deepseek_config`. What we do not serve is refused naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import ConfigError
from engine.config_values import is_int, read_bool, read_float, read_int, read_object, rope_type
from engine.family_readers import OWN_MODULE_FIELDS
from engine.model_defaults import MELLUM_ROPE
from engine.rope_config import partial_rotary_factor, per_type_rope
from engine.bias_config import bias_fields
from engine.granite_config import GRANITE_ARCHITECTURES, granite_fields
from engine.deepseek_config import (DEEPSEEK_TOPK_METHODS, check_silu, deepseek_fields, dense_layers,
                                    exaone_moe_experts, grouped_experts, hy_v3_fields)
from engine.gemma4_config import MOE_ROUTER as GEMMA4_ROUTER

# chunked: Llama 4's (`llama4_config`); Qwen3.5's linear_attention: `gated_delta_config` (its models' alone)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# how a sparse layer picks its experts: a softmax's top k (Qwen, Mixtral, GPT-OSS), DeepSeek V2's softmax within the
# groups of the best expert scores, DeepSeek V3's sigmoid (plus a correction bias) within the groups of the best top-2
# sums; MiniMax-M2's: V3's, in the model's dtype; ERNIE 4.5's: the softmax's top k after a correction bias; Llama 4's;
# Mistral 4's: the softmax's within the groups of the best top-2 sums, in the model's dtype, no correction bias;
# LFM2-MoE's: the sigmoid's top k after a float32 expert bias, in the model's dtype, renormalised past a 1e-6;
# AFMoE's: that in float32, renormalised past 1e-20; Kolibri-1's: the float32 logits' top k after a float32 expert
# bias, weighed by their sigmoid; Flint's: the top k of the float32 logits' sigmoid, no bias; Phi-3.5-MoE's SparseMixer;
# Muse Spark's: AFMoE's on the float32 logits times `output_multiplier`, renormalised past 1e-15
MOE_ROUTERS = ("softmax", "deepseek_v2", "deepseek_v3", "minimax_m2", "ernie4_5", "llama4", GEMMA4_ROUTER, "mistral4",
               "lfm2", "afmoe", "cohere2_moe", "kolibri", "flint", "sparsemixer", "muse_spark")


def family_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields past Llama's shape that `arch`'s config.json gives (none for Llama and Mistral); a
    family of `engine.family_readers.OWN_MODULE_FIELDS` read by its own module."""
    if arch in OWN_MODULE_FIELDS:
        return OWN_MODULE_FIELDS[arch](cfg, num_layers)
    if arch == "Gemma3ForCausalLM":
        return gemma3_fields(cfg, num_layers)
    if arch == "GemmaForCausalLM":
        return gemma_fields(cfg)
    if arch in ("Gemma2ForCausalLM", "VaultGemmaForCausalLM"):
        return gemma2_fields(cfg, num_layers)
    if arch == "Olmo3ForCausalLM":
        return olmo3_fields(cfg, num_layers)
    if arch == "Exaone4ForCausalLM":
        return exaone4_fields(cfg, num_layers)
    if arch == "ExaoneMoeForCausalLM":   # K-EXAONE: EXAONE 4's attention, DeepSeek V3's experts
        return {**exaone4_fields(cfg, num_layers), **exaone_moe_experts(cfg)}
    if arch == "HYV3ForCausalLM":
        return hy_v3_fields(cfg)
    if arch in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        return olmoe_fields(cfg, arch)
    if arch == "Qwen2MoeForCausalLM":
        return qwen2_moe_fields(cfg, num_layers)
    if arch.startswith("Qwen"):
        return {**qwen_window_fields(cfg, arch, num_layers),
                **(qwen3_moe_fields(cfg) if arch == "Qwen3MoeForCausalLM" else {})}
    if arch == "MixtralForCausalLM":
        return mixtral_fields(cfg)
    if arch == "Phi3ForCausalLM":
        return phi3_fields(cfg)
    if arch in GRANITE_ARCHITECTURES:
        return granite_fields(cfg, arch, num_layers)
    if arch == "SmolLM3ForCausalLM":
        return smollm3_fields(cfg, num_layers)
    if arch == "GptOssForCausalLM":
        return gpt_oss_fields(cfg, num_layers)
    if arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):
        return cohere_fields(cfg, arch, num_layers)
    if arch in ("Glm4ForCausalLM", "GlmForCausalLM"):
        return glm4_fields(cfg)
    if arch in DEEPSEEK_TOPK_METHODS:
        return deepseek_fields(cfg, arch)
    if arch == "Glm4MoeForCausalLM":
        return glm4_moe_fields(cfg)
    if arch == "Dots1ForCausalLM":
        return dots1_fields(cfg, num_layers)
    if arch == "SolarOpenForCausalLM":
        return solar_open_fields(cfg)
    if arch == "AfmoeForCausalLM":
        return afmoe_fields(cfg, num_layers)
    if arch == "MiniMaxM2ForCausalLM":
        return minimax_m2_fields(cfg)
    if arch == "Ernie4_5_MoeForCausalLM":
        return ernie4_5_moe_fields(cfg, num_layers)
    if arch == "MellumForCausalLM":
        return mellum_fields(cfg, num_layers)
    return bias_fields(cfg, arch)


def gemma3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3's text model, as transformers 5 writes it or as earlier ones did: each layer's attention type
    (`layer_types`, or every `sliding_window_pattern`-th layer full), the full layers' rope (with its
    scaling: `rope_parameters.full_attention`, or `rope_theta` + `rope_scaling`) and the sliding ones'
    base (`rope_parameters.sliding_attention`, or `rope_local_base_freq`). Returns ModelConfig fields, and
    under "full_rope" the arguments of RopeScaling.from_hf_config; the soft-capping Gemma3TextConfig takes
    (none by default, applied where set, as Gemma 2's). What we do not serve is refused."""
    _check_causal(cfg)
    layer_types = _layer_types(cfg, lambda: _every_nth_full(cfg, num_layers))
    full_rope, local_theta = per_type_rope(cfg, "Gemma 3")
    scalar = read_float(cfg, "query_pre_attn_scalar", None)
    return {"layer_types": tuple(layer_types), "sliding_window": read_int(cfg, "sliding_window", None), "qk_norm": True,
            "rope_local_theta": local_theta if local_theta is not None else
            read_float(cfg, "rope_local_base_freq", 10000.0),
            "query_pre_attn_scalar": float(read_int(cfg, "head_dim", 256)) if scalar is None else scalar,
            "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",   # Gemma3TextConfig reads no hidden_act
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True), "full_rope": full_rope,
            **_softcaps(cfg)}


def olmo3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """OLMo 3's fields (transformers' `Olmo3Config` names and defaults): OLMo 2's layer, sliding layers (a window of
    `sliding_window`, 4096) and full ones (`layer_types`, by default every 4th full), each type its own rope as Gemma
    3's (`rope_parameters.<type>`, or `rope_theta` with a legacy `rope_scaling` for the full layers; 500,000)."""
    layer_types = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                             for i in range(num_layers)])
    full_rope, local_theta = per_type_rope(cfg, "OLMo 3")
    top_theta = read_float(cfg, "rope_theta", 500_000.0)
    return {"layer_types": tuple(layer_types), "sliding_window": read_int(cfg, "sliding_window", 4096),
            "rope_local_theta": top_theta if local_theta is None else local_theta,
            "full_rope": ({**full_rope[0], "rope_theta": top_theta}, *full_rope[1:])}


def exaone4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """EXAONE 4's fields (transformers' `Exaone4Config` names and defaults): OLMo 2's post-norm layer with Qwen3's q/k
    norms per head; with a `sliding_window` (4096) its sliding layers (`layer_types`, by default all but every
    `sliding_window_pattern`-th, 4) rotate and its full ones are NoPE; without one every layer is full and rotates."""
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
    if window is None:
        return {"qk_norm": True}
    pattern = cfg.get("sliding_window_pattern", 4)
    if cfg.get("layer_types") is None and not is_int(pattern):
        raise ConfigError(f"sliding_window_pattern: a count of layers where layer_types is absent, got {pattern!r:.40}")
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)])
    return {"qk_norm": True, "sliding_window": window, "layer_types": tuple(kinds),
            "no_rope_layers": tuple(int(kind == "sliding_attention") for kind in kinds)}


def gemma2_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 2 (with `engine.model_defaults.GEMMA2_DEFAULTS` under the file's keys): Gemma 3's layer without the
    q/k norms, one rope for every layer, each attention score and each logit soft-capped (cap x tanh(x / cap);
    a null cap: none), and its layer types, sliding on every other layer from the first by default."""
    _check_causal(cfg)
    for key in ("rope_parameters", "rope_scaling"):   # the sliding layers' rope takes no scaling (gemma3's class)
        if (rope := read_object(cfg, key)) and rope_type(rope) != "default":
            raise ConfigError(f"{key}.rope_type: Gemma 2 is served with its default rope, got {rope_type(rope)!r}")
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)])
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", None),
            "query_pre_attn_scalar": read_float(cfg, "query_pre_attn_scalar", None),
            "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",   # Gemma2Config reads no hidden_act
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True), **_softcaps(cfg)}


def gemma_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma's (`GemmaForCausalLM`: Gemma 1, CodeGemma; transformers' `GemmaConfig`): Gemma 2's layer without the norms
    on the sublayers' outputs, the soft caps or sliding layers; GELU-tanh (a legacy `gelu`, as transformers reads it),
    the head tied by default."""
    _check_causal(cfg)
    act = cfg.get("hidden_act", "gelu_pytorch_tanh")
    return {"hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act,
            "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def _softcaps(cfg: dict[str, Any]) -> dict[str, Any]:
    return {key: read_float(cfg, key, None) for key in ("attn_logit_softcapping", "final_logit_softcapping")}


def _check_causal(cfg: dict[str, Any]) -> None:
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served")


def qwen3_moe_fields(cfg: dict[str, Any], family: str = "Qwen3-MoE") -> dict[str, Any]:
    """Qwen3-MoE's expert fields (transformers' `Qwen3MoeConfig` names and defaults); `family` names the model in
    errors."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(is_int(i) and i >= 0 for i in only):
        raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {only!r}")
    experts = read_int(cfg, "num_experts", None) or read_int(cfg, "num_local_experts", 128)   # transformers 5's name
    check_silu(cfg, family)
    return {"num_experts": experts, "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", 768),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", False),
            "decoder_sparse_step": read_int(cfg, "decoder_sparse_step", 1), "mlp_only_layers": tuple(only)}


def qwen2_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen2-MoE's fields (transformers' `Qwen2MoeConfig` names and defaults): Qwen3-MoE's experts (60 of 1,408, 4
    a token, not renormalised by default) beside a shared expert of `shared_expert_intermediate_size` (5,632) that
    every token takes, gated by a sigmoid; q/k/v biases (`qkv_bias`, on by default); a window only under
    `use_sliding_window`, on the layers `layer_types` says (by default every other one from the first, below
    `max_window_layers`)."""
    fields = {**qwen3_moe_fields({"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408} | {
        key: value for key, value in cfg.items() if value is not None}, "Qwen2-MoE"),
              "attention_bias": read_bool(cfg, "qkv_bias", True),
              "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", 5632)}
    if not read_bool(cfg, "use_sliding_window", False):
        return fields
    first = read_int(cfg, "max_window_layers", 28, minimum=0)
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
                                       for i in range(num_layers)])
    return {**fields, "sliding_window": read_int(cfg, "sliding_window", 4096), "layer_types": tuple(kinds)}


def olmoe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """OLMoE's experts (OlmoeConfig: 64 of `intermediate_size`, 8 a token) or FlexOlmo's (FlexOlmoConfig: 7, 5 a
    token) on every layer; OLMoE's `clip_qkv`."""
    olmoe = arch == "OlmoeForCausalLM"
    fields = qwen3_moe_fields({"num_experts": 64 if olmoe else 7, "num_experts_per_tok": 8 if olmoe else 5, **cfg,
                               "mlp_only_layers": [], "moe_intermediate_size": read_int(cfg, "intermediate_size")},
                              "OLMoE" if olmoe else "FlexOlmo")
    return {**fields, "clip_qkv": read_float(cfg, "clip_qkv", None)} if olmoe else fields


def mixtral_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's experts (transformers' `MixtralConfig` names and defaults): every layer sparse, each expert's
    size `intermediate_size`, the top k always renormalised and kept in float32 (each expert's weighted output
    rounded once, after the product), and a sliding window over every layer only where `sliding_window` is set."""
    check_silu(cfg, "Mixtral")
    experts = read_int(cfg, "num_local_experts", None)
    return {"num_experts": read_int(cfg, "num_experts", 8) if experts is None else experts,   # the attribute map's
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 2),
            "moe_intermediate_size": read_int(cfg, "intermediate_size"), "norm_topk_prob": True,
            "moe_float_weights": True, "sliding_window": read_int(cfg, "sliding_window", None)}


def phi3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's (and Phi-4's) fields as transformers' `Phi3Config` reads them: a sliding window over every layer
    where `sliding_window` is set, and a rope that turns `partial_rotary_factor` of each head whatever its type
    (Phi-4-mini's 0.75 of a longrope). `Phi3Config` reads the rope types `su` and `yarn` as `longrope`: those
    spellings are refused by key, `longrope` itself served."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = read_object(cfg, key)
        if rope and rope_type(rope) in ("su", "yarn"):
            raise ConfigError(f"{key}.rope_type: Phi-3 reads {rope_type(rope)!r} as 'longrope' (its factors' "
                              "meaning): write rope_type 'longrope' to serve it")
    return {"sliding_window": read_int(cfg, "sliding_window", None),
            "partial_rotary_factor": partial_rotary_factor(cfg, 1.0)}


def smollm3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """SmolLM3's NoPE layers as transformers' `SmolLM3Config` reads them: `no_rope_layers` (1 where a layer
    rotates q and k, 0 where it does not), by default every `no_rope_layer_interval`-th layer (4) without; a
    sliding window only under `use_sliding_window` with a `sliding_window`, on the layers `layer_types` says (by
    default the NoPE ones); the head tied by default."""
    rope = cfg.get("no_rope_layers")
    if rope is None:
        interval = read_int(cfg, "no_rope_layer_interval", 4)
        rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(rope, list) or len(rope) != num_layers or any(r not in (0, 1) or r is True or r is False
                                                                    for r in rope):
        raise ConfigError(f"no_rope_layers: a 0 or 1 for each of the {num_layers} layers, got {rope!r:.80}")
    fields = {"no_rope_layers": tuple(rope), "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
    window = read_int(cfg, "sliding_window", None)
    if not read_bool(cfg, "use_sliding_window", False) or window is None:
        return fields
    kinds = _layer_types(cfg, lambda: ["full_attention" if r else "sliding_attention" for r in rope])
    return {**fields, "sliding_window": window, "layer_types": tuple(kinds)}


# transformers' GptOssConfig's rope where config.json names none: YaRN, 32 x 4,096 positions
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-OSS as transformers' `GptOssConfig` reads it: every layer a mixture of `num_local_experts` experts of
    `intermediate_size`, `num_experts_per_tok` a token (the softmax of the router's top logits), each a SwiGLU
    clamped at `swiglu_limit` with gain `swiglu_alpha`, biases on the router, the experts and q/k/v/o
    (`attention_bias`, on by default); a sink logit per head; sliding (`sliding_window`, 128) and full layers
    alternating from a sliding first unless `layer_types` says otherwise; YaRN by default (`GPT_OSS_ROPE`).
    Returns ModelConfig fields, and under "full_rope" the arguments of RopeScaling.from_hf_config."""
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)])
    rope = cfg if cfg.get("rope_scaling") or read_object(cfg, "rope_parameters") else \
        {**cfg, "rope_parameters": {**GPT_OSS_ROPE, "rope_theta": read_float(cfg, "rope_theta", 150_000.0)}}
    experts = read_int(cfg, "num_local_experts", None)
    return {"num_experts": read_int(cfg, "num_experts", 128) if experts is None else experts,
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 4),
            "moe_intermediate_size": read_int(cfg, "intermediate_size"), "moe_bias": True, "attention_sinks": True,
            "swiglu_limit": read_float(cfg, "swiglu_limit", 7.0),
            "swiglu_alpha": read_float(cfg, "swiglu_alpha", 1.702),
            "attention_bias": read_bool(cfg, "attention_bias", True), "hidden_act": "silu",   # the experts' own act
            "layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 128),
            "full_rope": (rope,)}


def cohere_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """Command R's and R7B's fields (transformers' `CohereConfig` and `Cohere2Config` names and defaults): the
    LayerNorms' `layer_norm_eps`, the logits' `logit_scale` (0.0625), a tied head, Command R's per-head q/k
    LayerNorms where `use_qk_norm` (Command R+). Cohere 2: sliding layers (`sliding_window`, 4096) and full ones as
    `layer_types` says (by default every `sliding_window_pattern`-th, 4th, full), the full ones without rope."""
    fields = {"rms_norm_eps": read_float(cfg, "layer_norm_eps", 1e-5),
              "qk_norm": arch == "CohereForCausalLM" and read_bool(cfg, "use_qk_norm", False),
              "logit_scale": read_float(cfg, "logit_scale", 0.0625),
              "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}
    if arch == "CohereForCausalLM":
        return fields
    pattern = read_int(cfg, "sliding_window_pattern", 4)
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)])
    return {**fields, "sliding_window": read_int(cfg, "sliding_window", 4096), "layer_types": tuple(kinds),
            "no_rope_layers": tuple(int(kind == "sliding_attention") for kind in kinds)}


def glm4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4's fields (transformers' `Glm4Config` names and defaults): half of each head rotated
    (`partial_rotary_factor`, at the top level or in the rope's parameters; 0.5 by default), q/k/v biases
    (`attention_bias`, on by default)."""
    return {"partial_rotary_factor": partial_rotary_factor(cfg, 0.5),
            "attention_bias": read_bool(cfg, "attention_bias", True)}


def glm4_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's fields (transformers' `Glm4MoeConfig` names and defaults): half of each head rotated
    (`partial_rotary_factor`, 0.5), Qwen3's q/k norms where `use_qk_norm`, q/k/v biases where `attention_bias`;
    DeepSeek V3's experts (`grouped_experts`: 128 of 1408, 8 a token from one group, renormalised, the first layer
    dense, one shared expert)."""
    check_silu(cfg, "GLM-4.5")
    factor = partial_rotary_factor(cfg, 0.5)
    defaults = dict(n_routed_experts=128, moe_intermediate_size=1408, num_experts_per_tok=8, n_group=1, topk_group=1,
                    norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=1.0, n_shared_experts=1)
    return {"partial_rotary_factor": factor, "qk_norm": read_bool(cfg, "use_qk_norm", False),
            "attention_bias": read_bool(cfg, "attention_bias", False),
            **grouped_experts(cfg, defaults, "deepseek_v3", grouped=True)}


def dots1_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """dots.llm1's fields (transformers' `Dots1Config` names; dots.llm1's experts where config.json names none):
    Qwen3's attention (per-head q/k norms, biases where `attention_bias`), sliding layers from `max_window_layers`
    on where `sliding_window` is set (by default none: every layer below 62), DeepSeek V3's experts (128 of 1408, 6 a
    token from `topk_group` of `n_group`, two shared, the first `first_k_dense_replace` (0) layers dense)."""
    check_silu(cfg, "dots.llm1")
    defaults = dict(n_routed_experts=128, moe_intermediate_size=1408, num_experts_per_tok=6, n_group=1, topk_group=1,
                    norm_topk_prob=False, first_k_dense_replace=0, routed_scaling_factor=1.0, n_shared_experts=2)
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
    first = read_int(cfg, "max_window_layers", 62, minimum=0)
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if window is not None and i >= first else
                                       "full_attention" for i in range(num_layers)])
    return {"qk_norm": True, "attention_bias": read_bool(cfg, "attention_bias", False), "layer_types": tuple(kinds),
            "sliding_window": window if "sliding_attention" in kinds else None,
            **grouped_experts(cfg, defaults, "deepseek_v3", grouped=True)}


def solar_open_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Solar Open's fields (transformers' `SolarOpenConfig`, GLM-4.5's keys and defaults): Llama's attention (q/k/v
    biases where `attention_bias`, never o_proj's; the whole head rotated; no q/k norms), DeepSeek V3's experts on
    every layer (128 of 1,280, 8 a token from `topk_group` of `n_group`, renormalised, one shared)."""
    check_silu(cfg, "Solar Open")
    defaults = dict(n_routed_experts=128, moe_intermediate_size=1280, num_experts_per_tok=8, n_group=1, topk_group=1,
                    norm_topk_prob=True, first_k_dense_replace=0, routed_scaling_factor=1.0, n_shared_experts=1)
    return {"attention_bias": read_bool(cfg, "attention_bias", False), "attention_out_bias": False,
            **grouped_experts({**cfg, "first_k_dense_replace": 0}, defaults, "deepseek_v3", grouped=True)}


def afmoe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """AFMoE's fields (transformers' `AfmoeConfig` names and defaults): sliding layers (a window of `sliding_window`,
    1024) but every `global_attn_every_n_layers`-th (4), which is full and NoPE; q/k normed per head; the attention
    output gated; past `num_dense_layers` (1), `num_experts` (64) of `moe_intermediate_size` (1408), 6 a token by the
    `afmoe` router times `route_scale` (1.0), beside `num_shared_experts` (2) ungated; the embeddings times
    sqrt(hidden_size) where `mup_enabled`."""
    check_silu(cfg, "AFMoE")
    every = read_int(cfg, "global_attn_every_n_layers", 4)
    kinds = _layer_types(cfg, lambda: ["sliding_attention" if (i + 1) % every else "full_attention"
                                       for i in range(num_layers)])
    moe_i = read_int(cfg, "moe_intermediate_size", 1408)
    scale = read_int(cfg, "hidden_size") ** 0.5 if read_bool(cfg, "mup_enabled", False) else 1.0
    return {"layer_types": tuple(kinds), "sliding_window": read_int(cfg, "sliding_window", 1024),
            "no_rope_layers": tuple(int(k == "sliding_attention") for k in kinds), "qk_norm": True,
            "attn_output_gate": True, "num_experts": read_int(cfg, "num_experts", 64),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 6), "moe_intermediate_size": moe_i,
            "norm_topk_prob": True, "mlp_only_layers": tuple(range(read_int(cfg, "num_dense_layers", 1, minimum=0))),
            "moe_router": "afmoe", "routed_scaling_factor": read_float(cfg, "route_scale", 1.0),
            "shared_expert_intermediate_size": moe_i * read_int(cfg, "num_shared_experts", 2, minimum=0),
            "shared_expert_gated": False, "moe_float_weights": True, "embedding_multiplier": scale}


def minimax_m2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2's fields (transformers' `MiniMaxM2Config` names and defaults): every layer `num_local_experts` (256)
    of `intermediate_size` (1536), `num_experts_per_tok` (8) a token, picked as DeepSeek V3's without groups and
    renormalised; the first `rotary_dim` (or `partial_rotary_factor` of) each head rotated; q and k normed over the
    whole projection, as transformers always norms them (a config saying otherwise is refused)."""
    check_silu(cfg, "MiniMax-M2")
    if cfg.get("use_qk_norm", True) is not True or cfg.get("qk_norm_type", "per_layer") != "per_layer":
        raise ConfigError(f"qk_norm_type: MiniMax-M2 is served with use_qk_norm true and qk_norm_type 'per_layer' "
                          f"(q and k normed over the whole projection, as transformers does), got "
                          f"{cfg.get('use_qk_norm')!r} and {cfg.get('qk_norm_type')!r}")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or read_int(cfg, "shared_intermediate_size", 0, minimum=0):
        raise ConfigError(f"scoring_func: MiniMax-M2 is served with the sigmoid router and no shared expert (as "
                          f"transformers runs it), got {cfg.get('scoring_func')!r} and shared_intermediate_size "
                          f"{cfg.get('shared_intermediate_size')!r}")
    head_dim = read_int(cfg, "head_dim", 128)
    rope = read_object(cfg, "rope_parameters") or {}
    rotary = read_int(cfg, "rotary_dim", None)
    factor = rotary / head_dim if rotary is not None else read_float(rope, "partial_rotary_factor", 1.0)
    experts = read_int(cfg, "num_local_experts", 256)
    return {"partial_rotary_factor": factor, "num_experts": experts,
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": read_int(cfg, "intermediate_size", 1536), "norm_topk_prob": True,
            "moe_router": "minimax_m2", "moe_float_weights": True}


def ernie4_5_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ERNIE 4.5's MoE fields (transformers' `Ernie4_5_MoeConfig` names and defaults): `moe_num_experts` (64) of
    `moe_intermediate_size` (1536), `moe_k` (6) a token by the softmax's top k after each expert's correction bias
    (weighed without it, renormalised), beside `moe_num_shared_experts` (2) every token takes, ungated; layer i's
    MLP the experts where i + 1 is a multiple of `moe_layer_interval` and i lies from `moe_layer_start_index` to
    `moe_layer_end_index` (-1: the last layer). Its released checkpoints have no biases: `use_bias` is refused."""
    check_silu(cfg, "ERNIE 4.5")
    if read_bool(cfg, "use_bias", False):
        raise ConfigError("use_bias: ERNIE 4.5's MoE models are served without biases (as its checkpoints), got true")
    cfg = {**cfg, **{key: cfg[key][0] for key in ("moe_num_experts", "moe_intermediate_size")   # ERNIE 4.5 VL's:
                     if isinstance(cfg.get(key), list) and cfg[key]}}   # [text, vision]: its text experts'
    experts, moe_i = read_int(cfg, "moe_num_experts", 64), read_int(cfg, "moe_intermediate_size", 1536)
    start, interval = read_int(cfg, "moe_layer_start_index", 1, minimum=0), read_int(cfg, "moe_layer_interval", 1)
    end = read_int(cfg, "moe_layer_end_index", -1, minimum=-1)
    end = num_layers - 1 if end == -1 else end
    sparse = [i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end]
    if cfg.get("mlp_layer_types") is not None:   # ERNIE 4.5 VL's text model: dense or sparse, each layer
        sparse = [i for i in range(num_layers) if i not in dense_layers(cfg, num_layers, 0)]
    return {"num_experts": experts, "num_experts_per_tok": read_int(cfg, "moe_k", 6), "moe_intermediate_size": moe_i,
            "norm_topk_prob": True, "moe_router": "ernie4_5",
            "mlp_only_layers": tuple(i for i in range(num_layers) if i not in sparse),
            "shared_expert_intermediate_size": moe_i * read_int(cfg, "moe_num_shared_experts", 2, minimum=0),
            "shared_expert_gated": False, "tie_word_embeddings": read_bool(cfg, "tie_word_embeddings", True)}


def qwen_window_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """Qwen2's, Qwen3's and Qwen3-MoE's sliding window, read as transformers reads it: none unless
    `use_sliding_window` (then `sliding_window`, 4096 when absent; null: none). Qwen3-MoE's layers all slide;
    Qwen2's and Qwen3's are `layer_types`, by default sliding from layer `max_window_layers` (28) on."""
    if not read_bool(cfg, "use_sliding_window", False):
        return {}
    window = read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
    if window is None or arch == "Qwen3MoeForCausalLM":
        return {"sliding_window": window}
    kinds = _layer_types(cfg, lambda: _sliding_from(cfg, num_layers))
    return {"sliding_window": window, "layer_types": tuple(kinds)}


def _every_nth_full(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Gemma 3's layer types where `layer_types` is absent: every `sliding_window_pattern`-th layer full (6)."""
    pattern = read_int(cfg, "sliding_window_pattern", None)
    pattern = read_int(cfg, "_sliding_window_pattern", 6) if pattern is None else pattern
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _sliding_from(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Qwen2's and Qwen3's layer types where `layer_types` is absent: sliding from `max_window_layers` (28) on."""
    first = read_int(cfg, "max_window_layers", 28, minimum=0)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def _layer_types(cfg: dict[str, Any], default: Callable[[], list[str]]) -> list[str]:
    """config.json's `layer_types` (a list, checked against the layer count by `ModelConfig`), else `default()`
    (whose keys transformers reads only then)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return default()
    if not isinstance(kinds, list):
        raise ConfigError(f"layer_types: must be a list, one of {', '.join(LAYER_TYPES)} for each layer, got {kinds!r}")
    return kinds


def mellum_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """JetBrains' Mellum (`MellumForCausalLM`, transformers' `MellumConfig`): Qwen3-MoE's layers (q/k norms per head;
    64 experts of 896, the softmax's top 8 renormalised, by default) on every layer but the dense ones
    `mlp_layer_types` names; `layer_types` (all full by default) with a window of `sliding_window` (1,024) and a
    rope base per layer type (500,000 full, 10,000 sliding by default; no partial rotary)."""
    given = {key: value for key, value in cfg.items() if value is not None}
    experts = qwen3_moe_fields({"num_local_experts": 64, "moe_intermediate_size": 896, "norm_topk_prob": True, **given,
                                "mlp_only_layers": list(dense_layers(cfg, num_layers, 0)), "decoder_sparse_step": 1},
                               "Mellum")
    ropes = read_object(cfg, "rope_parameters") or MELLUM_ROPE
    for kind, rope in ropes.items():
        if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"rope_parameters.{kind}.partial_rotary_factor: Mellum is served turning whole heads, "
                              f"got {rope['partial_rotary_factor']!r}")
    full_rope, local_theta = per_type_rope({**cfg, "rope_parameters": ropes}, "Mellum")
    kinds = _layer_types(cfg, lambda: ["full_attention"] * num_layers)
    return {**experts, "qk_norm": True, "layer_types": tuple(kinds), "full_rope": full_rope,
            "rope_local_theta": local_theta,
            "sliding_window": read_int(cfg, "sliding_window", None) if "sliding_window" in cfg else 1024}
