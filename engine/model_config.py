"""The model's shape, read from an HF config.json: `ModelConfig` and its rope scaling (`RopeScaling`).

What we serve is listed here (architectures, activations, rope types, layer types); a config asking for
anything else is refused with a `ConfigError` naming the key, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints served as their text model: architecture -> (the text model's, its weights' prefix)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "language_model.")}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in the HF config's `rope_scaling` (or `rope_parameters`) entry. `llama3` reads
    the freq factors; `yarn` the betas and the attention factor (None: from `factor`, `mscale` and
    `mscale_all_dim`, as transformers infers it)."""

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

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> tuple[float | None, "RopeScaling"]:
        """(rope_theta or None, scaling) from an HF config dict: `rope_theta` + `rope_scaling`, or the
        `rope_parameters` entry transformers >= 5 writes instead."""
        rope_theta = cfg.get("rope_theta")
        raw = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                raw = params
        if not raw:
            return rope_theta, cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"rope_scaling: must be a mapping, got {raw!r}")
        original = int(raw.get("original_max_position_embeddings") or 8192)
        factor = raw.get("factor")
        if factor is None:   # yarn without a factor: the context's growth (transformers' reading)
            factor = cfg.get("max_position_embeddings", original) / original
        optional = {key: None if raw.get(key) is None else float(raw[key])
                    for key in ("attention_factor", "mscale", "mscale_all_dim")}
        return rope_theta, cls(
            rope_type=raw.get("rope_type", raw.get("type", "default")),
            factor=float(factor),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            truncate=bool(raw.get("truncate", True)),
            **optional,
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only model (Llama 2/3, Qwen2, Qwen3, Mistral, Gemma 3's text model), read from
    an HF config.json. `layer_types` (Gemma 3) gives each layer full or sliding attention; without it
    `sliding_window` (Mistral) applies to every layer."""

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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures: unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join((*SUPPORTED_ARCHITECTURES, *TEXT_MODELS))}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
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
                raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} is more than num_experts "
                                  f"{self.num_experts}")

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

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:   # q/k/v; o_proj too except in Qwen2 (engine.model.Attention)
            attn += self.q_size + 2 * self.kv_size + (h if self.architecture != "Qwen2ForCausalLM" else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        experts = self.num_experts * (3 * h * self.moe_intermediate_size + h)   # every expert, and the router
        norms = 4 if self.architecture == "Gemma3ForCausalLM" else 2   # Gemma 3: around the MLP too
        per_layer = attn + norms * h + (2 * self.head_dim if self.qk_norm else 0)
        mlps = sum(experts if self.is_sparse_layer(layer) else mlp for layer in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + mlps + h + head

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of an HF config.json. Errors name the config key."""
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ConfigError("architectures: config.json has no 'architectures' list")
        if archs[0] in TEXT_MODELS and isinstance(cfg.get("text_config"), dict):   # its text model alone
            arch, prefix = TEXT_MODELS[archs[0]]
            text = cfg["text_config"]
            config = cls.from_hf_config({**text, "architectures": [arch],
                                         "eos_token_id": text.get("eos_token_id", cfg.get("eos_token_id"))})
            return replace(config, text_weights_prefix=prefix)
        arch = archs[0]

        def need(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"{key}: missing from config.json")
            return cfg[key]

        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // num_heads
        gemma = _gemma3_fields(cfg, need("num_hidden_layers")) if arch == "Gemma3ForCausalLM" else {}
        moe = _moe_fields(cfg) if arch == "Qwen3MoeForCausalLM" else {}
        rope_theta, rope_scaling = RopeScaling.from_hf_config(gemma.pop("full_rope", cfg))
        sliding_window = None
        if arch == "MistralForCausalLM":
            sliding_window = cfg.get("sliding_window")
        elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and cfg.get("use_sliding_window"):
            raise ConfigError(f"use_sliding_window: {arch.removesuffix('ForCausalLM')} per-layer sliding window "
                              "is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(**{**dict(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding_window,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        ), **gemma, **moe})

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config.json: not found in model folder {folder}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
        return cls.from_hf_config(cfg)


def _gemma3_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3's text model, as transformers 5 writes it or as earlier ones did: each layer's attention type
    (`layer_types`, or every `sliding_window_pattern`-th layer full), the full layers' rope (with its
    scaling: `rope_parameters.full_attention`, or `rope_theta` + `rope_scaling`) and the sliding ones'
    base (`rope_parameters.sliding_attention`, or `rope_local_base_freq`). Returns ModelConfig fields, and
    under "full_rope" the config RopeScaling.from_hf_config reads. What we do not serve is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"{key}: logit soft-capping (Gemma 2) is not supported, got {cfg[key]!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: only causal attention is served")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    params, local = cfg.get("rope_parameters"), {}
    full_rope = cfg
    if isinstance(params, dict) and "full_attention" in params:
        full_rope = {**cfg, "rope_parameters": params["full_attention"], "rope_scaling": None}
        local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type: only 'default' is supported for the "
                          f"sliding layers, got {local['rope_type']!r}")
    return {"layer_types": tuple(layer_types), "sliding_window": cfg.get("sliding_window"), "qk_norm": True,
            "rope_local_theta": float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
            "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)), "full_rope": full_rope}


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert fields (transformers' `Qwen3MoeConfig` names and defaults)."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"mlp_only_layers: must be a list of layer indices, got {only!r}")
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))   # transformers 5 writes the latter
    return {"num_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 8),
            "moe_intermediate_size": cfg.get("moe_intermediate_size", 768),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": cfg.get("decoder_sparse_step", 1), "mlp_only_layers": tuple(only)}
