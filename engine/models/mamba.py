"""Mamba (`MambaForCausalLM`: state-spaces' mamba-130m to -2.8b), TII's FalconMamba (`FalconMambaForCausalLM`:
Falcon-Mamba-7B, Falcon3-Mamba-7B) and Mamba2 (`Mamba2ForCausalLM`: Mamba-Codestral-7B, mamba2-130m to -2.7b): a
stack of blocks, each a pre-norm residual step around a Mamba mixer (Mamba-1's, `engine.layers.mamba1`, FalconMamba's
norming dt's input, B and C without weights; Mamba-2's, `engine.layers.mamba2`, its gate through the grouped norm),
over the states of `StatefulForCausalLM`; no attention, no MLP. The KV cache holds no layer: a sequence's state is
all it keeps, whatever its length (the capacity plan gives such a pool blocks that hold no bytes,
`pools.ring_plan.ring_only_blocks`).

Their checkpoints name the model `backbone.` (the embedding `embeddings`, the final norm `norm_f`) and each block's
mixer `mixer`, read as the model's names. transformers keeps the residual stream in float32 where
`residual_in_fp32` (their default); it is in the model's dtype here (the same in float32; within a rounding a layer
in bfloat16). Under tensor parallelism each rank holds its channels of every Mamba-1 mixer
(`engine.models.jamba.mamba1_cut`), its heads and groups of every Mamba-2 one (`engine.models.granite.mamba2_cut`).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.config import ConfigError
from engine.layers import RMSNorm, RopeRows
from engine.layers.gated_delta_net import RecurrentStates
from engine.layers.mamba1 import Mamba1Mixer
from engine.layers.mamba2 import Mamba2Mixer
from engine.models.granite import mamba2_cut
from engine.models.hybrid import StatefulForCausalLM
from engine.models.jamba import mamba1_cut
from engine.models.smollm3 import NoRope
from kernels import AttentionMetadata

__all__ = ["MambaBlock", "MambaForCausalLM"]


class MambaBlock(nn.Module):
    """One block: its norm, then its Mamba mixer (Mamba-2's where the config has that shape)."""

    def __init__(self, config, shard, comm, ops: ModuleType, state_index: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        if config.mamba is not None:
            self.mamba = Mamba2Mixer(config.mamba.per_rank(shard.size), config.hidden_size, config.rms_norm_eps,
                                     state_index, comm)
        else:
            self.mamba = Mamba1Mixer(config.state_layers.per_rank(shard.size), config.hidden_size, state_index, comm)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows | None,
                states: RecurrentStates, meta: AttentionMetadata, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the mixer's output, the residual stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mamba(hidden, meta, states), residual


class MambaForCausalLM(StatefulForCausalLM):
    """Mamba, FalconMamba and Mamba2 (see the module docstring): Llama's loading and head, `MambaBlock`s over
    `StatefulForCausalLM`'s states."""

    def make_rotary(self, ops: ModuleType) -> nn.Module:
        return NoRope()

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return MambaBlock(self.config, self.shard, self.comm, ops, self.state_index[index])

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`backbone.` names as the model's: `embeddings` the embedding, `norm_f` the final norm, a block's `mixer`
        its Mamba mixer."""
        name = name.removeprefix("backbone.")
        name = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}.get(name, name)
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 3 and parts[2] == "mixer" and parts[1].isdigit():
            if int(parts[1]) >= len(self.layers):
                raise ConfigError(f"{hf_name}: block {parts[1]} of a config with {len(self.layers)} blocks")
            parts[2] = "mamba"
        return (((".".join(parts)), tensor),)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1 or ".mamba." not in name:
            return super()._shard_of(hf_name, name, tensor)
        if self.config.mamba is not None:
            return mamba2_cut(self.config.mamba, hf_name, name, tensor, self.shard.rank, self.shard.size)
        return mamba1_cut(self.config.state_layers, hf_name, name, tensor, self.shard.rank, self.shard.size)
