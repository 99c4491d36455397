"""GLM-4 (`Glm4ForCausalLM`, GLM-4-0414): the Llama layer with a norm on each sublayer's output too, half of each head
rotated, GLM's interleaved rotary, q/k/v biases, and Phi-3's fused gate/up tensor in its checkpoints.

- A layer is Gemma's sandwich with Llama's RMSNorm (`Glm4DecoderLayer`): input norm, attention, its output normed
  (`post_self_attn_layernorm`) before it joins the stream; the MLP's input norm (`post_attention_layernorm`), the
  MLP, its output normed (`post_mlp_layernorm`); read into Gemma's layer under the names of Gemma's norms there.
- The rotary turns the first `rotary_dim` (= head_dim x `partial_rotary_factor`) dimensions of each head, pairing
  2i with 2i + 1, and passes the rest. The engine's rotary pairs i with i + head_dim / 2 and gives the dimensions
  past `rotary_dim / 2` a frequency of 0 (`engine.layers.rotary.rope_inv_freq`: cos 1, sin 0); `read_tensor`
  reorders each q and k head's rows (and biases) so that the rotated pairs land on the pairs the engine turns with
  their frequencies and the passed dimensions on the ones it leaves (`partial_to_halves`). The same order on q and
  k leaves every q.k unchanged; V and o_proj keep theirs.
- `mlp.gate_up_proj` is split as it is read (Phi-3's `read_tensor`).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RMSNorm
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.phi3 import Phi3ForCausalLM

__all__ = ["Glm4ForCausalLM", "partial_to_halves"]


def partial_to_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A q or k projection's rows (or bias) [heads x head_dim, ...] reordered in each head for the engine's rotary:
    the rotated pairs' first members (0, 2, .. rotary_dim - 2), the first half of the passed dimensions, the pairs'
    second members (1, 3, .. rotary_dim - 1), the passed dimensions' second half."""
    half, passed = rotary_dim // 2, torch.arange(rotary_dim, head_dim)
    rest = (head_dim - rotary_dim) // 2
    order = torch.cat([torch.arange(0, rotary_dim, 2), passed[:rest], torch.arange(1, rotary_dim, 2), passed[rest:]])
    assert order.numel() == head_dim and half + rest == head_dim // 2
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


class Glm4DecoderLayer(Gemma3DecoderLayer):
    """One GLM-4 block: Gemma 3's with Llama's RMSNorm (GLM-4's checkpoint names its norms otherwise:
    `Glm4ForCausalLM.read_tensor` renames them)."""

    @staticmethod
    def make_norm(hidden_size: int, eps: float, ops: ModuleType) -> nn.Module:
        return RMSNorm(hidden_size, eps, ops)


# GLM-4's norms by the names of Gemma's in the same places
_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
          "post_attention_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(Phi3ForCausalLM):
    """GLM-4 (see the module docstring): Phi-3's loading (its fused gate/up split), GLM-4's layers, and q/k rows
    reordered for the partial interleaved rotary."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Glm4DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Phi-3's split of the fused gate/up; then each q/k head's rows reordered (`partial_to_halves`), and the
        norms under the names of Gemma's in the same places (`_NORMS`)."""
        d, r = self.config.head_dim, self.config.rotary_dim
        for read, piece in super().read_tensor(hf_name, name, tensor):
            if any(f".self_attn.{part}." in read for part in ("q_proj", "k_proj")) and piece.dim() >= 1 \
                    and piece.shape[0] % d == 0:
                piece = partial_to_halves(piece, d, r)
            parts = read.split(".")
            yield ".".join(_NORMS.get(part, part) for part in parts), piece
