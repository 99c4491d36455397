"""Rotary position embedding (rotate-half layout) from a cos/sin cache computed once, at build.

The cache holds every position the engine serves (`ModelConfig.rotary_positions`: its longest pool's
`max_model_len`, else the model's context, `ModelConfig.context_length`; the engine refuses longer sequences), with the config's rope scaling applied to the frequencies. The model gathers the step's rows once per
forward (`RotaryEmbedding.rows`) and every layer turns its q and k with them in place.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from engine.model_config import ModelConfig
from kernels import fused

# A step's rows of the cache, in the form the ops module's `rotary` takes (a tensor, or a tuple of them).
RopeRows = torch.Tensor | tuple[torch.Tensor, ...]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies (float32, on the CPU), with the config's scaling applied. A partial rotary
    (`ModelConfig.rotary_dim` < head_dim, GLM-4's) has the frequencies of its rotary dimensions first and zeros
    after: cos 1 and sin 0, so those pairs pass unchanged (the model's loading brings the rotated pairs first)."""
    dim = config.rotary_dim   # head_dim but for a partial rotary (each scaling's frequencies over its dimensions)
    # On the CPU whatever device is the default: on the meta device the division's Python kernel would
    # import torch._dynamo (over a second of a worker's start).
    # Gemma 4's proportional rope: the turning pairs' exponents over the whole head, not over the pairs that turn
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / (
        config.head_dim if config.rope_proportional else dim)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by `factor`, blend in between.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config)
    elif scaling.rope_type == "longrope":   # each frequency divided by its factor of the set the engine turns by
        factors = torch.tensor(scaling.long_factor if scaling.long else scaling.short_factor, device="cpu")
        inv_freq = 1.0 / (factors * config.rope_theta ** exponents)   # transformers' order of operations
    if dim < config.head_dim:   # the pairs past the rotary dimensions turn at frequency 0
        inv_freq = torch.cat([inv_freq, torch.zeros(config.head_dim // 2 - dim // 2, device="cpu")])
    return inv_freq


def _yarn_inv_freq(config: ModelConfig) -> torch.Tensor:
    """YaRN: the frequencies that turn more than `beta_fast` times over the original context kept, those
    that turn fewer than `beta_slow` times divided by `factor`, a linear ramp between (transformers'
    `_compute_yarn_parameters`, in its order of operations), over the dimensions the rotary turns (a partial
    rotary's: Qwen3.5's and Qwen3-Next's quarter of each head past their 262,144 positions)."""
    scaling, dim = config.rope_scaling, config.rotary_dim
    original, base = scaling.original_max_position_embeddings, config.rope_theta

    def correction_dim(rotations: float) -> float:   # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp                       # 1: the frequency kept, 0: interpolated
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """What scales cos and sin (YaRN's attention factor, given or inferred from `factor` and the mscales;
    LongRoPE's, given or sqrt(1 + ln factor / ln original context), both of its sets alike, or Phi-3.5-MoE's mscale of
    the set the engine turns by); 1.0 for every other rope type."""
    scaling = config.rope_scaling
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.long_mscale is not None:   # Phi-3.5-MoE: each set's own
        return scaling.long_mscale if scaling.long else scaling.short_mscale
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if scaling.factor <= 1 else math.sqrt(1 + math.log(scaling.factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def rope_cos_sin_cache(config: ModelConfig) -> torch.Tensor:
    """[rotary_positions or context_length, head_dim] float32 on the CPU: row p is cos(p * inv_freq), then
    sin(p * inv_freq), both times the rope type's attention factor on the rotary's pairs (transformers computes the
    same products, in float32, every forward)."""
    inv_freq = rope_inv_freq(config)
    positions = torch.arange(config.rotary_positions or config.context_length, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * inv_freq[None, :]                  # [max_positions, head_dim // 2]
    factor = rope_attention_factor(config)
    if factor == 1.0:
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    # the pairs a partial rotary leaves alone keep cos 1 and sin 0: transformers scales the turned part only
    scale = torch.ones(config.head_dim // 2, device="cpu")
    scale[:config.rotary_dim // 2] = factor
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary embedding over `cos_sin_cache` [context_length, head_dim] (a buffer, built in
    float32 on the CPU; `build_model` moves it to the model's device and dtype, which is where
    transformers rounds its cos and sin too).

    One instance serves every layer: `rows(positions)` once per forward, then `forward(query_key,
    rows)` in each layer. `ops`: as `RMSNorm`'s; the rows' layout is that module's.
    """

    def __init__(self, config: ModelConfig, ops: ModuleType = fused) -> None:
        super().__init__()
        self.ops = ops
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)

    def rows(self, positions: torch.Tensor) -> RopeRows:
        """positions: [num_tokens] -> the step's rows of the cache, for every layer's `forward`."""
        return self.ops.rotary_rows(self.cos_sin_cache, positions)

    def forward(self, query_key: torch.Tensor, rows: RopeRows) -> None:
        """Rotate in place: query_key [num_tokens, num_q_and_k_heads, head_dim], head_dim contiguous."""
        self.ops.rotary(query_key, rows)

    def extra_repr(self) -> str:
        return f"cache={tuple(self.cos_sin_cache.shape)}, ops={self.ops.__name__}"
