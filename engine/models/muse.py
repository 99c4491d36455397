"""Meta's Muse Glimmer text model (`MuseGlimmerForConditionalGeneration`'s, served as `MuseGlimmerForCausalLM`; its
config: `engine.muse_config`), transformers' `MuseGlimmerTextModel` operator for operator where it rounds:

- Gemma 2's layer (`Gemma3DecoderLayer`): Gemma's norms (1 + weight, float32) around both sublayers, the two on the
  sublayers' outputs with their own epsilon (`post_norm_eps`, 1e-8);
- AFMoE's attention (`GatedAttention`, `gate_proj` read as its gate rows: `GateProjRows`): the output gated per
  channel by a sigmoid of its own projection of the layer's input; q and k normed per head by one RMSNorm without a
  weight (Gemma 4's: float32 statistics, rounded to the heads' dtype), q then times `qk_scale_factor` in that dtype;
  q.k scaled by head_dim ** -0.5; sliding layers beside full ones, the NoPE layers (`layer_rope_theta` 0) turning
  nothing, the others by the model's one rope;
- the embeddings normed without a weight; the final norm Gemma 4's (x times its weight); the logits times
  `output_multiplier` (`logit_scale`), then soft-capped: cap x tanh(logits / cap).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.layers import FloatRMSNorm, GemmaRMSNorm
from engine.model import LlamaForCausalLM
from engine.models.afmoe import GateProjRows
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.gemma4 import pow_rms
from engine.models.qwen3_5 import GatedAttention
from engine.models.smollm3 import layer_rotary

__all__ = ["MuseGlimmerForCausalLM", "UnitHeadNorm"]


class UnitHeadNorm(nn.Module):
    """Each head of a [num_tokens, num_heads, head_dim] view normed without a weight (`pow_rms`), then times
    `factor` in its dtype (Muse Glimmer's q: `qk_scale_factor`), written back in place."""

    def __init__(self, eps: float, factor: float = 1.0) -> None:
        super().__init__()
        self.eps, self.factor = eps, factor

    def forward(self, heads: torch.Tensor) -> None:
        normed = pow_rms(heads, self.eps)
        heads.copy_(normed * self.factor if self.factor != 1.0 else normed)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, factor={self.factor}"


class MuseGlimmerForCausalLM(GateProjRows, LlamaForCausalLM):
    """Muse Glimmer's text model (see the module docstring): the Llama model's loading, cuts and head."""

    supports_flat_forward = False
    norm_init = 0.0

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        c, rotary = self.config, layer_rotary(self, index)
        (qk_scale, post_eps), h = c.muse, c.hidden_size
        layer = Gemma3DecoderLayer(c, self.shard, self.comm, rotary, ops, index)
        layer.self_attn = attn = GatedAttention(c, self.shard, self.comm, rotary, index)
        attn.q_norm, attn.k_norm = UnitHeadNorm(c.rms_norm_eps, qk_scale), UnitHeadNorm(c.rms_norm_eps)
        layer.post_attention_layernorm = GemmaRMSNorm(h, post_eps)
        layer.post_feedforward_layernorm = GemmaRMSNorm(h, post_eps)
        return layer

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return pow_rms(super().embed(input_ids), self.config.rms_norm_eps)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """The Llama model's, Gemma's norms at 0 (1 + weight), the final norm at 1 (x times its weight)."""
        super().init_random(seed, std)
        with torch.no_grad():
            self.norm.weight.fill_(1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits times `output_multiplier`, then soft-capped (the other order of the Llama model's)."""
        logits = self.head_logits(hidden) * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
