"""GLM-4 (`Glm4ForCausalLM`, GLM-4-0414): the Llama layer with a norm on each sublayer's output too, half of each head
rotated, GLM's interleaved rotary, q/k/v biases, and Phi-3's fused gate/up tensor in its checkpoints. GLM-4.5
(`Glm4MoeForCausalLM`, GLM-4.5, 4.5-Air, 4.6) at the end.

- A layer is Gemma's sandwich with Llama's RMSNorm (`Glm4DecoderLayer`): input norm, attention, its output normed
  (`post_self_attn_layernorm`) before it joins the stream; the MLP's input norm (`post_attention_layernorm`), the
  MLP, its output normed (`post_mlp_layernorm`); read into Gemma's layer under the names of Gemma's norms there.
- The rotary turns the first `rotary_dim` (= head_dim x `partial_rotary_factor`) dimensions of each head, pairing
  2i with 2i + 1, and passes the rest. The engine's rotary pairs i with i + head_dim / 2 and gives the dimensions
  past `rotary_dim / 2` a frequency of 0 (`engine.layers.rotary.rope_inv_freq`: cos 1, sin 0); `read_tensor`
  reorders each q and k head's rows (and biases) so that the rotated pairs land on the pairs the engine turns with
  their frequencies and the passed dimensions on the ones it leaves (Cohere's `InterleavedRotaryWeights` on
  `rotary_dim`). The same order on q and k leaves every q.k unchanged; V and o_proj keep theirs.
- `mlp.gate_up_proj` is split as it is read (Phi-3's `read_tensor`).

GLM-4.5 (`Glm4MoeForCausalLM`) is another model: the Llama layer (two norms), Qwen3's per-head q/k norms where
`use_qk_norm`, q/k/v biases where `attention_bias`, half of each head rotated with rotate-half pairs (i with
i + rotary_dim / 2), and past the first `first_k_dense_replace` layers DeepSeek V3's experts (`DeepseekMoeBlock`:
the grouped sigmoid router with its correction bias, ungated shared experts). Its partial rotary is served as
GLM-4's: the passed dimensions moved between the rotated halves (`interleaved_to_halves(..., interleaved=False)`),
q/k rows, biases and q/k norm weights alike. K-EXAONE (`ExaoneMoeForCausalLM`) is that model with EXAONE 4's
attention (q/k normed per head, NoPE full layers beside rotating sliding ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import HeadRMSNorm, RMSNorm
from engine.models.cohere import InterleavedRotaryWeights
from engine.models.deepseek import DeepseekMoeBlock, moe_checkpoint_name, past_the_layers
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.phi3 import Phi3ForCausalLM, partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.smollm3 import layer_rotary

__all__ = ["ExaoneMoeForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "GlmForCausalLM", "HYV3ForCausalLM"]


class Glm4DecoderLayer(Gemma3DecoderLayer):
    """One GLM-4 block: Gemma 3's with Llama's RMSNorm (GLM-4's checkpoint names its norms otherwise:
    `Glm4ForCausalLM.read_tensor` renames them), and Llama's q/k norms where the config has them (Kolibri-1's)."""

    head_norm = HeadRMSNorm

    @staticmethod
    def make_norm(hidden_size: int, eps: float, ops: ModuleType) -> nn.Module:
        return RMSNorm(hidden_size, eps, ops)


# GLM-4's norms by the names of Gemma's in the same places
NORM_NAMES = {"post_self_attn_layernorm": "post_attention_layernorm",
          "post_attention_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(InterleavedRotaryWeights, Phi3ForCausalLM):
    """GLM-4 (see the module docstring): Phi-3's loading (its fused gate/up split), q/k rows reordered for the
    partial interleaved rotary (`InterleavedRotaryWeights`), GLM-4's layers."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Glm4DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors as `InterleavedRotaryWeights` and Phi-3 read them, the norms under the names of Gemma's in
        the same places (`NORM_NAMES`); a layer past the model's (GLM-OCR's multi-token-prediction layer) not read."""
        if past_the_layers(name, self.config.num_layers):
            return
        for read, piece in super().read_tensor(hf_name, name, tensor):
            yield ".".join(NORM_NAMES.get(part, part) for part in read.split(".")), piece


class GlmForCausalLM(InterleavedRotaryWeights, Phi3ForCausalLM):
    """GLM-4-9B of 2024 (`GlmForCausalLM`): GLM-4's loading and rotary under the Llama layer (no norms on the
    sublayers' outputs)."""


class Glm4MoeForCausalLM(Qwen3MoeForCausalLM):
    """GLM-4.5 (see the module docstring): Qwen3-MoE's model with DeepSeek V3's experts, its checkpoints read as
    DeepSeek's (`moe_checkpoint_name`), q/k rows reordered for its partial rotary."""

    moe_block = DeepseekMoeBlock

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = moe_checkpoint_name(self.config, name)
        return () if name is None else ((name, partial_rotary_rows(self.config, name, tensor)),)


class ExaoneMoeForCausalLM(Glm4MoeForCausalLM):
    """K-EXAONE (`ExaoneMoeForCausalLM`): GLM-4.5's model (the Llama layer, DeepSeek V3's experts beside shared ones
    past the dense first layers) with EXAONE 4's attention: per-head q/k norms before the rotary, which turns the
    sliding layers alone where the model has a window (its full layers NoPE, `layer_rotary`); its checkpoints read as
    DeepSeek's (`moe_checkpoint_name`: the router's correction bias beside it, the `mtp.` weights skipped)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn.rotary_emb = layer_rotary(self, index)
        return layer


class HYV3ForCausalLM(Glm4MoeForCausalLM):
    """Tencent's HY V3 (`HYV3ForCausalLM`, Hy3-preview): GLM-4.5's model with per-head q/k norms and a whole-head
    rotary (dots.llm1's), DeepSeek V3's router without groups; its checkpoints' `mlp.router.gate`, `mlp.expert_bias`
    and `mlp.shared_mlp` read under DeepSeek's names (the router, its correction bias, the shared experts)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = (name.replace(".mlp.router.gate.", ".mlp.gate.")
                .replace(".mlp.expert_bias", ".mlp.e_score_correction_bias")
                .replace(".mlp.shared_mlp.", ".mlp.shared_experts."))
        return super().read_tensor(hf_name, name, tensor)
