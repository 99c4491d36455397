"""AI21's Jamba (`JambaForCausalLM`: Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning 3B): pre-norm layers whose
token mixer is Mamba-1 (`engine.layers.mamba1`, over the states of `StatefulForCausalLM`) or, every few layers,
attention without a rotary (NoPE) over the paged cache; each layer's MLP a SwiGLU or, on the expert layers, experts
picked by the softmax's top k, not renormalised (`SparseMoeBlock`).

The checkpoints name the MLP `feed_forward` (its router `feed_forward.router`), the second norm `pre_ff_layernorm` and
the final one `final_layernorm`; they are read as the Llama model's and Qwen3-MoE's. Under tensor parallelism the
attention and experts are cut as theirs, a Mamba layer by channels (`Mamba1Mixer`)."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RMSNorm
from engine.layers.mamba1 import Mamba1Mixer
from engine.mamba1_config import Mamba1Shape
from engine.model import MLP, Attention
from engine.model_config import ModelConfig
from engine.models.hybrid import MixerLayerForward, StatefulForCausalLM, cut_pieces
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.models.smollm3 import NoRope
from engine.parallel import Collectives, ShardShape

__all__ = ["JambaForCausalLM", "JambaLayer", "mamba1_cut"]

# the checkpoints' names -> ours (in order: the router before the rest of the MLP)
_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
          (".pre_ff_layernorm.", ".post_attention_layernorm."))


class JambaLayer(MixerLayerForward, nn.Module):
    """A pre-norm block whose token mixer is Mamba-1 (`mamba`) or NoPE attention (`self_attn`), then its MLP."""

    mixer = "mamba"

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: nn.Module,
                 ops: ModuleType, layer: int, state_index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops)
        if config.is_linear_layer(layer):
            self.mamba = Mamba1Mixer(config.state_layers.per_rank(shard.size), h, state_index, comm)
        else:
            self.self_attn = Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = MLP(config, shard, comm, ops)


class JambaForCausalLM(StatefulForCausalLM, Qwen3MoeForCausalLM):
    """Jamba (see the module docstring): Llama's loading and head, `JambaLayer`s over `StatefulForCausalLM`'s states,
    Qwen3-MoE's experts on the expert layers."""

    def make_rotary(self, ops: ModuleType) -> nn.Module:
        return NoRope()

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = JambaLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                           self.state_index.get(index, -1))
        return with_experts(self, layer, index, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name == "final_layernorm.weight":
            return (("norm.weight", tensor),)
        for theirs, ours in _NAMES:
            name = name.replace(theirs, ours, 1)
        return super().read_tensor(hf_name, name, tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1 or ".mamba." not in name:
            return super()._shard_of(hf_name, name, tensor)
        return mamba1_cut(self.config.state_layers, hf_name, name, tensor, self.shard.rank, self.shard.size)


def mamba1_cut(shape: Mamba1Shape, hf_name: str, name: str, tensor: torch.Tensor, rank: int, size: int
               ) -> torch.Tensor:
    """A Mamba-1 layer's tensor `name` (`layers.N.mamba.<part>...`) on `rank` of `size`: its channels' in_proj rows
    (x and gate), convolution, dt_proj rows, A_log and D, x_proj's and out_proj's columns (out_proj's bias on rank 0,
    added once after the ranks' sum); the norms of dt, B and C whole."""
    part = name.split(".mamba.")[1].split(".")[0]
    if part.endswith("layernorm"):
        return tensor
    if name.endswith("out_proj.bias"):
        return tensor if rank == 0 else torch.zeros_like(tensor)
    inter = shape.intermediate_size
    pieces = [(inter, 0, True), (inter, inter, True)] if part == "in_proj" else [(inter, 0, True)]
    dim = 1 if part in ("x_proj", "out_proj") and name.endswith("weight") else 0
    return cut_pieces(hf_name, tensor, dim, pieces, rank, size)
