"""The model's shape, read from an HF config.json: `ModelConfig` and its rope scaling (`RopeScaling`).

What we serve is listed here (architectures, activations, rope types, layer types); a config asking for
anything else is refused with a `ConfigError` naming the key, before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError, quantizes_kv_cache_only

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints served as their text model: architecture -> (the text model's, its weights' prefix)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "language_model.")}
# transformers' Gemma3TextConfig defaults where they differ from the keys' defaults here: a composite checkpoint's
# text_config is saved as its difference from them (gemma-3-4b-it's names no head count, head_dim or vocabulary)
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "bos_token_id": 2, "eos_token_id": 1}
# transformers' config classes' max_position_embeddings (the context served, and YaRN's original context where its
# scaling names none) and num_key_value_heads (else one per query head), for a config.json without them
DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32_768, "MistralForCausalLM": 131_072,
                         "Qwen3ForCausalLM": 32_768, "Qwen3MoeForCausalLM": 32_768, "Gemma3ForCausalLM": 131_072}
DEFAULT_KV_HEADS = {"Qwen2ForCausalLM": 32, "MistralForCausalLM": 8, "Qwen3ForCausalLM": 32, "Qwen3MoeForCausalLM": 4}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# dynamic NTK: its base moves only past max_position_embeddings, which caps its context here: the default rope's
SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in the HF config's `rope_scaling` (or `rope_parameters`). `llama3` reads the freq
    factors; `yarn` the betas and the attention factor (None: from `factor`, `mscale`, `mscale_all_dim`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type: unsupported {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings: must be > 0, "
                              f"got {self.original_max_position_embeddings}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ConfigError(f"rope_scaling.attention_factor: must be > 0, got {self.attention_factor}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"rope_scaling.high_freq_factor: llama3 needs 0 < low_freq_factor < high_freq_factor, "
                              f"got {self.low_freq_factor} and {self.high_freq_factor}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], params_name: str = "rope_parameters",
                       ) -> tuple[float | None, "RopeScaling"]:
        """(rope_theta or None, scaling) from an HF config dict: `rope_theta` + `rope_scaling`, or the `rope_parameters`
        entry transformers >= 5 writes instead (`params_name`: its key path in errors). Both given are refused unless
        `rope_scaling` read alone says what `rope_parameters` does: transformers then reads `rope_scaling` alone (with
        the top level's `rope_theta`), rarely what a config edited by hand means. The type may be spelled `type`;
        `partial_rotary_factor` with a scaled rope is refused. A bad value is a ConfigError naming its key."""
        rope_theta = _float(cfg, "rope_theta", None)
        raw, name = cfg.get("rope_scaling"), "rope_scaling"
        params = _object(cfg, "rope_parameters", name=params_name)
        if params is None and isinstance(raw, dict):   # transformers reads rope_scaling as rope_parameters: its own
            rope_theta = _float(raw, "rope_theta", rope_theta, path="rope_scaling.")   # rope_theta first
        if params is not None and isinstance(raw, dict) and raw:   # each read alone: the same, or refused
            alone, ours = (cls.from_hf_config({k: v for k, v in cfg.items() if k != drop}, params_name)
                           for drop in ("rope_parameters", "rope_scaling"))
            if alone != ours:
                raise ConfigError(f"rope_scaling: config.json also has {params_name}, which says otherwise (transformers "
                                  f"reads rope_scaling alone, or Gemma 3's over it); keep one: the scaling's keys "
                                  f"belong in {params_name}")
            return ours
        if params is not None:
            rope_theta = _float(params, "rope_theta", rope_theta, path=f"{params_name}.")
            if _rope_type(params) != "default":
                raw, name = params, params_name
        if not raw:
            return rope_theta, cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: must be a mapping, got {raw!r}")
        try:
            return rope_theta, cls._from_mapping(cfg, raw, f"{name}.")
        except ConfigError as exc:   # RopeScaling's own checks say rope_scaling.: name the key it came from
            message = str(exc)
            if name == "rope_scaling" or not message.startswith("rope_scaling."):
                raise
            raise ConfigError(f"{name}.{message.removeprefix('rope_scaling.')}") from None

    @classmethod
    def _from_mapping(cls, cfg: dict[str, Any], raw: dict[str, Any], path: str) -> "RopeScaling":
        # transformers' order: a top-level original_max_position_embeddings (Phi-3's habit), the scaling's
        # own, else max_position_embeddings
        original = _int(cfg, "original_max_position_embeddings", None)
        if original is None:
            original = _int(raw, "original_max_position_embeddings", _int(cfg, "max_position_embeddings", 8192), path=path)
        where, part = (path, raw) if raw.get("partial_rotary_factor") is not None else ("", cfg)   # the key it has
        if _rope_type(raw) != "default" and _float(part, "partial_rotary_factor", 1.0, path=where) != 1.0:
            raise ConfigError(f"{where}partial_rotary_factor: rotating part of each head is not supported")
        kind = _rope_type(raw)   # yarn without a factor: the context's growth (transformers'); linear, llama3 need one
        growth = _REQUIRED if kind in ("dynamic", "linear", "llama3") else _int(cfg, "max_position_embeddings", original) / original
        factor = _float(raw, "factor", growth, path=path)
        return cls(
            rope_type=_rope_type(raw),
            factor=factor,
            low_freq_factor=_float(raw, "low_freq_factor", 1.0, path=path),
            high_freq_factor=_float(raw, "high_freq_factor", 4.0, path=path),
            original_max_position_embeddings=original,
            beta_fast=_float(raw, "beta_fast", 32.0, path=path),
            beta_slow=_float(raw, "beta_slow", 1.0, path=path),
            attention_factor=_float(raw, "attention_factor", None, path=path),
            mscale=_float(raw, "mscale", None, positive=False, path=path),
            mscale_all_dim=_float(raw, "mscale_all_dim", None, positive=False, path=path),
            truncate=_bool(raw, "truncate", True, path=path),
        )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model's shape (Llama 2/3, Qwen2, Qwen3, Mistral, Gemma 3's text model) from an HF
    config.json. `layer_types` (Gemma 3): each layer full or sliding; without it `sliding_window` is all's."""

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
    mlp_bias: bool = False
    sliding_window: int | None = None   # Mistral: keys older than this many positions are not attended
    qk_norm: bool = False               # Qwen3, Gemma 3: each query and key head RMS-normed before rotary
    hidden_act: str = "silu"            # the MLP's gate activation: silu | gelu_pytorch_tanh (Gemma 3)
    layer_types: tuple[str, ...] = ()   # Gemma 3: full_attention | sliding_attention per layer; () all alike
    rope_local_theta: float | None = None   # Gemma 3: the sliding layers' rope base (no scaling)
    query_pre_attn_scalar: float | None = None   # Gemma 3: attention scale is its -1/2 power (else head_dim's)
    num_experts: int = 0                # Qwen3-MoE: experts of a sparse layer's MLP (0: every MLP dense)
    num_experts_per_tok: int = 0        # the experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0      # each expert's intermediate size
    norm_topk_prob: bool = False        # the top-k weights renormalised to sum to 1
    decoder_sparse_step: int = 1        # every this many layers is sparse ...
    mlp_only_layers: tuple[int, ...] = ()   # ... except these, dense
    text_weights_prefix: str = ""       # a multimodal checkpoint's text model: its weights' prefix (the rest skipped)
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
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act: unsupported {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window: must be positive, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ConfigError(f"layer_types: one of {', '.join(LAYER_TYPES)} for each of the {self.num_layers} "
                              f"layers, got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding_window: layer_types has sliding layers and no sliding_window")
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                    raise ConfigError(f"{name}: must be a positive integer with experts, got {getattr(self, name)!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} is over num_experts {self.num_experts}")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts (Qwen3-MoE's rule), else the dense MLP."""
        return bool(self.num_experts) and layer not in self.mlp_only_layers and \
            (layer + 1) % self.decoder_sparse_step == 0

    def layer_window(self, layer: int) -> int | None:
        """The keys layer `layer` attends: its last `sliding_window` positions, or all (None)."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves (vLLM's readings): `max_position_embeddings`; with YaRN the original
        context times the factor where that is longer (Qwen3's model card adds YaRN, factor 4 over 32,768 positions,
        to a config.json whose max_position_embeddings stays 40,960: the model serves 131,072); with a linear scaling
        max_position_embeddings times the factor (Llama 2's long fine-tunes; not Gemma 3's, whose count has it)."""
        rope = self.rope_scaling
        if rope.rope_type == "yarn":
            return max(self.max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
        scaled = rope.rope_type == "linear" and self.architecture != "Gemma3ForCausalLM"
        return int(self.max_position_embeddings * rope.factor) if scaled else self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: query_pre_attn_scalar ** -0.5 (Gemma 3), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """S_KV = 2 x num_layers x num_kv_heads x head_dim x dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def rotary_cache_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the rotary cos/sin caches each rank holds: [context_length, head_dim] each (Gemma 3: two)."""
        return (2 if self.architecture == "Gemma3ForCausalLM" else 1) * self.context_length * self.head_dim * dtype.itemsize

    def num_params(self) -> int:
        """Parameters of the whole model (one rank's: engine.parallel.ShardShape.num_params)."""
        return self.count_params(self.num_heads, self.num_kv_heads, self.intermediate_size,
                                 self.moe_intermediate_size, self.vocab_size)

    def count_params(self, heads: int, kv_heads: int, i: int, moe_i: int, v: int) -> int:
        """Parameters of this model's layers built with `heads` query heads, `kv_heads` KV heads, `i` MLP
        rows, `moe_i` rows per expert and `v` vocab rows (engine.model); the norms and the router whole."""
        h, d = self.hidden_size, self.head_dim
        q, kv = heads * d, kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias:   # q/k/v; o_proj too except in Qwen2 (engine.model.Attention)
            attn += q + 2 * kv + (h if self.architecture != "Qwen2ForCausalLM" else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        experts = self.num_experts * (3 * h * moe_i + h)   # every expert, and the router
        norms = 4 if self.architecture == "Gemma3ForCausalLM" else 2   # Gemma 3: around the MLP too
        per_layer = attn + norms * h + (2 * d if self.qk_norm else 0)
        mlps = sum(experts if self.is_sparse_layer(layer) else mlp for layer in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + mlps + h + head

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of an HF config.json. A key missing, of the wrong type (a size is an integer, not
        a string or a bool) or out of range is a ConfigError naming it; an absent or null optional one, its default."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json: must be a JSON object, got {cfg!r:.80}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ConfigError("architectures: config.json has no 'architectures' list")
        arch = archs[0]
        old = cfg.get("compression_config")   # llm-compressor's older key: quantized where it has groups or a method
        key = "compression_config" if cfg.get("quantization_config") is None and isinstance(old, dict) and {
            "config_groups", "quant_method", "kv_cache_scheme"} & set(old) else "quantization_config"
        if (quant := cfg.get(key)) is not None and not quantizes_kv_cache_only(quant):
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else repr(quant)
            raise ConfigError(f"{key}: quantized checkpoints ({method}) are not supported; serve "
                              "the model's bfloat16 checkpoint (an FP8 KV cache is the device key kv_cache_dtype)")
        if isinstance(arch, str) and arch in TEXT_MODELS:
            return cls._from_text_config(cfg, arch)
        _check_architecture(arch)
        if arch == "Gemma3ForCausalLM":
            cfg = GEMMA3_TEXT_DEFAULTS | cfg
        if cfg.get("max_position_embeddings") is None:
            cfg = {**cfg, "max_position_embeddings": DEFAULT_MAX_POSITIONS[arch]}
        num_heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        num_layers = _int(cfg, "num_hidden_layers")
        gemma = _gemma3_fields(cfg, num_layers) if arch == "Gemma3ForCausalLM" else {}
        moe = _moe_fields(cfg) if arch == "Qwen3MoeForCausalLM" else {}
        rope_theta, rope_scaling = RopeScaling.from_hf_config(*gemma.pop("full_rope", (cfg,)))
        sliding_window = None
        if arch == "MistralForCausalLM":   # absent: MistralConfig's 4096; null: none
            sliding_window = _int(cfg, "sliding_window", None) if "sliding_window" in cfg else 4096
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and cfg.get("use_sliding_window"):
            raise ConfigError(f"use_sliding_window: {arch.removesuffix('ForCausalLM')} per-layer sliding window "
                              "is not supported")
        return cls(**{**dict(
            architecture=arch,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_int(cfg, "num_key_value_heads",   # null: one per head, as transformers reads None
                              num_heads if "num_key_value_heads" in cfg else DEFAULT_KV_HEADS.get(arch, num_heads)),
            head_dim=_int(cfg, "head_dim", 128 if arch == "Qwen3ForCausalLM" else hidden // num_heads),  # Qwen3's: 128
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings"),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or _bool(cfg, "attention_bias", False),
            mlp_bias=_bool(cfg, "mlp_bias", False),
            sliding_window=sliding_window,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=_int(cfg, "bos_token_id", None, minimum=0),
            eos_token_ids=_token_ids(cfg, "eos_token_id"),
        ), **gemma, **moe})

    @classmethod
    def _from_text_config(cls, cfg: dict[str, Any], arch: str) -> "ModelConfig":
        """A multimodal checkpoint (`arch` in TEXT_MODELS) as its `text_config`'s model; errors say `text_config.`."""
        text_arch, prefix = TEXT_MODELS[arch]
        text = _object(cfg, "text_config")
        if text is None:
            raise ConfigError(f"text_config: missing from config.json ({arch} is served as its text model)")
        eos = _token_ids(text, "eos_token_id", path="text_config.") if text.get("eos_token_id") is not None \
            else _token_ids(cfg, "eos_token_id")   # the text model's, else the checkpoint's
        tied = {"tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True)} if "tie_word_embeddings" in cfg \
            else {}   # transformers reads the top one (checked here: its error names the file's key)
        try:
            config = cls.from_hf_config({**text, **tied, "architectures": [text_arch], "eos_token_id": list(eos)})
        except ConfigError as exc:
            raise ConfigError(f"text_config.{exc}") from None
        return replace(config, text_weights_prefix=prefix)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config.json: not found in model folder {folder}")
        if (Path(folder) / "quantize_config.json").is_file():   # AutoGPTQ's, its config.json silent of it
            raise ConfigError("quantize_config.json: quantized checkpoints (GPTQ) are not supported; serve bfloat16")
        try:
            cfg = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
        return cls.from_hf_config(cfg)


def _gemma3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3's text model, as transformers 5 writes it or as earlier ones did: each layer's attention type
    (`layer_types`, or every `sliding_window_pattern`-th layer full), the full layers' rope (with its
    scaling: `rope_parameters.full_attention`, or `rope_theta` + `rope_scaling`) and the sliding ones'
    base (`rope_parameters.sliding_attention`, or `rope_local_base_freq`). Returns ModelConfig fields, and
    under "full_rope" the arguments of RopeScaling.from_hf_config. What we do not serve is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"{key}: logit soft-capping (Gemma 2) is not supported, got {cfg[key]!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = _int(cfg, "sliding_window_pattern", None)
        pattern = _int(cfg, "_sliding_window_pattern", 6) if pattern is None else pattern
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    elif not isinstance(layer_types, list):
        raise ConfigError(f"layer_types: must be a list, one of {', '.join(LAYER_TYPES)} for each layer, "
                          f"got {layer_types!r}")
    params, local = _object(cfg, "rope_parameters"), {}
    # the full layers' yarn takes its own original context, else max_position_embeddings (never the top level's:
    # transformers moves a legacy rope_scaling into rope_parameters.full_attention too)
    top = {key: value for key, value in cfg.items() if key != "original_max_position_embeddings"}
    full_rope: tuple[dict[str, Any], str] = (top, "rope_parameters")
    full, full_name = cfg.get("rope_scaling"), "rope_scaling"
    if params is not None and ("full_attention" in params or "sliding_attention" in params):   # per layer type
        local = _object(params, "sliding_attention", name="rope_parameters.sliding_attention") or {}
        full = _object(params, "full_attention", name=(full_name := "rope_parameters.full_attention"))
        full_rope = ({**top, "rope_parameters": full}, full_name)
    elif params:   # transformers' Gemma3TextConfig reads only the layer types' entries: the rest would be dropped
        raise ConfigError(f"rope_parameters: Gemma 3 takes one entry per layer type (full_attention, "
                          f"sliding_attention), got {sorted(params)}")
    if isinstance(full, dict) and full.get("truncate", True) is not True:   # transformers reads it beside the types
        raise ConfigError(f"{full_name}.truncate: Gemma 3's yarn is served with truncate true "
                          f"(transformers reads no layer type's own), got {full['truncate']!r}")
    if _rope_type(local) != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type: only 'default' is supported for the "
                          f"sliding layers, got {_rope_type(local)!r}")
    local_theta = _float(local, "rope_theta", None, path="rope_parameters.sliding_attention.")
    scalar = _float(cfg, "query_pre_attn_scalar", None)
    return {"layer_types": tuple(layer_types), "sliding_window": _int(cfg, "sliding_window", None), "qk_norm": True,
            "rope_local_theta": _float(cfg, "rope_local_base_freq", 10000.0) if local_theta is None else local_theta,
            "query_pre_attn_scalar": float(_int(cfg, "head_dim", 256)) if scalar is None else scalar,
            "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",   # Gemma3TextConfig reads no hidden_act
            "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", True), "full_rope": full_rope}


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert fields (transformers' `Qwen3MoeConfig` names and defaults)."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) and i >= 0 for i in only):
        raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {only!r}")
    experts = _int(cfg, "num_experts", None) or _int(cfg, "num_local_experts", 128)   # transformers 5: num_local_experts
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Qwen3-MoE's experts are served with silu only (the fused MoE kernel's), "
                          f"got {cfg['hidden_act']!r}")
    return {"num_experts": experts, "num_experts_per_tok": _int(cfg, "num_experts_per_tok", 8),
            "moe_intermediate_size": _int(cfg, "moe_intermediate_size", 768),
            "norm_topk_prob": _bool(cfg, "norm_topk_prob", False),
            "decoder_sparse_step": _int(cfg, "decoder_sparse_step", 1), "mlp_only_layers": tuple(only)}


# --- reading one config.json value: absent or null gives the default; the wrong type or range names the key --

_REQUIRED: Any = object()


def _check_architecture(arch: Any) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architectures: unsupported architecture {arch!r}; "
                          f"supported: {', '.join((*SUPPORTED_ARCHITECTURES, *TEXT_MODELS))}")


def _rope_type(rope: dict[str, Any]) -> Any:
    """A rope mapping's type, spelled `rope_type` or (older) `type`."""
    return rope.get("rope_type", rope.get("type", "default"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MAX_INT = 2**31 - 1   # no size, count or token id of a model reaches it


def _int(cfg: dict[str, Any], key: str, default: Any = _REQUIRED, *, minimum: int = 1, path: str = "") -> Any:
    """cfg[key], an integer in `minimum`..2^31-1 (not a bool, a float or a string); `default` when absent or null."""
    value = cfg.get(key)
    if key not in cfg and default is _REQUIRED:
        raise ConfigError(f"{path}{key}: missing from config.json")
    if value is None and default is not _REQUIRED:
        return default
    if not _is_int(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{path}{key}: must be {kind}, got {value!r}")
    if value > _MAX_INT:
        raise ConfigError(f"{path}{key}: must be below 2^31, got {value!r:.40}")
    return value


def _float(cfg: dict[str, Any], key: str, default: Any, *, positive: bool = True, path: str = "") -> Any:
    """cfg[key] as a finite float (> 0 if `positive`); `default` when absent or null (_REQUIRED: a ConfigError)."""
    value = cfg.get(key)
    if value is None and default is _REQUIRED:
        raise ConfigError(f"{path}{key}: missing from config.json")
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{path}{key}: expected a number, got {value!r}")
    if _is_int(value) and abs(value) > 2**1000 or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{path}{key}: must be a{' positive' if positive else ''} finite number, got {value!r:.40}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool, *, path: str = "") -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{path}{key}: must be true or false, got {value!r}")
    return value


def _object(cfg: dict[str, Any], key: str, *, name: str = "") -> dict[str, Any] | None:
    """cfg[key], a JSON object, or None when absent or null; `name`: its key path in errors (default `key`)."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{name or key}: expected an object, got {value!r}")
    return value


def _token_ids(cfg: dict[str, Any], key: str, *, path: str = "") -> tuple[int, ...]:
    """cfg[key]: a token id, a list of them, or absent / null (none)."""
    value = cfg.get(key)
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(i) and 0 <= i <= _MAX_INT for i in ids):
        raise ConfigError(f"{path}{key}: must be a token id or a list of token ids, got {value!r:.80}")
    return tuple(ids)
