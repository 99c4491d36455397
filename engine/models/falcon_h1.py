"""Falcon-H1 (`FalconH1ForCausalLM`, TII's Falcon-H1 and Falcon-H1R): parallel hybrid layers. One pre-norm feeds a
Mamba-2 mixer (`engine.layers.mamba2`, over the model's states) and Llama's attention (over the layer's K/V) side by
side; their outputs are summed into the residual stream, then a SwiGLU MLP (`FalconH1Layer`). Every layer keeps both
a state per sequence and K/V in the paged cache (`ModelConfig.stateful_layers`, `kv_layers`).

The muP multipliers past the embeddings' and the head's (`engine.falcon_h1_config.FalconH1Scales`) are folded into
the weights as they are read: attention's input factor into q, k and v's weights, the key factor into k's weight and
bias, the output factor into o_proj's; the mixer's input factor into in_proj's weight and the per-row factors of the
gate, x, B, C and dt into its rows (bias included), the output factor into out_proj's; the MLP's gate factor into
gate_proj's and its down factor into down_proj's. The tensors come under Bamba's names (`BambaNames`), the Mamba
layers cut across the ranks as Granite 4's."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.falcon_h1_config import FalconH1Scales
from engine.layers import RopeRows
from engine.layers.gated_delta_net import RecurrentStates
from engine.layers.mamba2 import Mamba2Mixer
from engine.model import DecoderLayer
from engine.models.granite import BambaNames, GraniteHybridForCausalLM
from kernels import AttentionMetadata

__all__ = ["FalconH1ForCausalLM", "FalconH1Layer"]


class FalconH1Layer(DecoderLayer):
    """The Llama layer whose token mixer is attention and Mamba-2 summed (`parallel_hybrid`: the model hands it its
    K/V and the states)."""

    parallel_hybrid = True

    def __init__(self, config, shard, comm, rotary_emb, ops: ModuleType, layer: int, state_index: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops, layer)
        self.mamba = Mamba2Mixer(config.mamba.per_rank(shard.size), config.hidden_size, config.rms_norm_eps,
                                 state_index, comm)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                cache: tuple[tuple[torch.Tensor, torch.Tensor], RecurrentStates], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        kv, states = cache
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mamba(hidden, meta, states) + self.self_attn(hidden, rope_rows, kv, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def _factor(scales: FalconH1Scales, name: str) -> float | None:
    """The scalar folded into tensor `name` (None: none, or in_proj's, whose rows differ)."""
    attention = {"q_proj.weight": scales.attention_in, "v_proj.weight": scales.attention_in,
                 "k_proj.weight": scales.attention_in * scales.key, "k_proj.bias": scales.key,
                 "o_proj.weight": scales.attention_out, "o_proj.bias": scales.attention_out}
    mixer = {"out_proj.weight": scales.ssm_out, "out_proj.bias": scales.ssm_out}
    mlp = {"gate_proj.weight": scales.mlp[0], "gate_proj.bias": scales.mlp[0],
           "down_proj.weight": scales.mlp[1], "down_proj.bias": scales.mlp[1]}
    for part, factors in ((".self_attn.", attention), (".mamba.", mixer), (".mlp.", mlp)):
        if part in name:
            return factors.get(name.rsplit(part, 1)[1])
    return None


class FalconH1ForCausalLM(BambaNames, GraniteHybridForCausalLM):
    """Falcon-H1 (see the module docstring): Granite 4's -H model (its scaled embeddings, its Mamba layers' cuts) with
    `FalconH1Layer`s, the logits times `lm_head_multiplier` (`ModelConfig.logit_scale`)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return FalconH1Layer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                             self.state_index[index])

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return [(ours, self._scaled(ours, piece)) for ours, piece in super().read_tensor(hf_name, name, tensor)]

    def _scaled(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` times its muP factor (in float32, back in its dtype)."""
        scales = self.config.falcon_h1
        if name.endswith((".mamba.in_proj.weight", ".mamba.in_proj.bias")):
            rows = scales.in_proj_rows(self.config.mamba)
            factor = rows * scales.ssm_in if name.endswith("weight") else rows
            return (tensor.float() * factor.view(-1, *(1,) * (tensor.dim() - 1))).to(tensor.dtype)
        factor = _factor(scales, name)
        return tensor if factor is None or factor == 1.0 else (tensor.float() * factor).to(tensor.dtype)
