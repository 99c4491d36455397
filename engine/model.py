"""One model file for the Llama family: Llama 2/3 (llama3 rope scaling), Qwen2 (q/k/v bias), Mistral
(sliding window); grouped-query attention; tied or untied embeddings.

The forward pass takes the whole step's tokens flat, `[num_tokens]`, sequence after sequence, with no
padding; attention reads and writes the paged KV cache through `AttentionMetadata`. Only the rows
that will be sampled go through the LM head (`compute_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from kernels import AttentionMetadata


class WeightLoadError(ValueError):
    """A checkpoint is missing tensors the model needs, or has them in the wrong shape."""


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics in float32, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
    return inv_freq


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, head_dim] for the rotate-half layout."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                                  bias=config.attention_bias)
        # Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=o_bias)
        self.scale = config.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        c = self.config
        qkv = self.qkv_proj(hidden)                                  # [T, q_size + 2 kv_size]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta)
        out = backend.paged_attention(q, k_cache, v_cache, meta, self.scale, c.sliding_window)
        return self.o_proj(out.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, kv_cache, meta, backend):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """The Llama-family decoder. Build it on the meta device, then `load_weights` or `init_random`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, meta, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size] in float32.

        A tied model has no `lm_head` until `kernels.cpu_linear.pack_linears` gives it a packed copy
        of the embedding table; before that the table itself is the head.
        """
        if "lm_head" in self._modules:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be filled once."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        c = self.config
        fused = {  # HF suffix -> (our suffix, row offset, rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, c.q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", c.q_size, c.kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, c.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            target, rows = name, None
            for hf_part, (ours, offset, size) in fused.items():
                if f".{hf_part}." in f".{name}":
                    target = name.replace(hf_part, ours)
                    rows = (offset, size)
                    break
            if target not in params:
                raise WeightLoadError(f"{hf_name}: not a tensor of {c.architecture} with this config")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"{hf_name}: shape {tuple(tensor.shape)} does not match the config's {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + (1 if rows is None else rows[1])
        missing = []
        for name, param in params.items():
            want = param.shape[0] if (".qkv_proj." in name or ".gate_up_proj." in name) else 1
            if filled.get(name, 0) != want:
                missing.append(name)
        if missing:
            raise WeightLoadError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (normal, std) and unit norms: for benchmarks of model shapes we cannot download."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """An uninitialised model on `device` (allocated, not filled): load or init it next."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope_inv_freq(config).to(device)  # buffers are not filled by to_empty
    return model.eval()
