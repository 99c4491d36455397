"""NVIDIA's Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 8B, 47B, 56B; Nemotron Nano 2 9B and 12B; Nemotron 3 Nano and
Super): a stack of single-mixer blocks, each a pre-norm residual step around one of Mamba-2 (`engine.layers.mamba2`,
over the states of `StatefulForCausalLM`), attention without a rotary (NoPE) over the paged cache, a squared-ReLU MLP
(`ReluSquaredMLP`, no gate), or Nemotron 3's experts (`NemotronHMoeBlock`, Nemotron 3 Super's in a latent space). The
norms keep their weight's product in float32 (OLMo 2's `FloatRMSNorm`). Its checkpoints name the model `backbone.`
(the embedding `embeddings`, the final norm `norm_f`) and every block's mixer `mixer`, read as the block's attention,
Mamba, MLP or experts by the block's kind; multi-token-prediction layers are not read (the engine decodes one token a
step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError
from engine.layers import FloatRMSNorm, RopeRows
from engine.layers.gated_delta_net import RecurrentStates
from engine.layers.mamba2 import Mamba2Mixer
from engine.model import Attention, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.deepseek import DeepseekMoeBlock
from engine.models.granite import mamba2_cut
from engine.models.hybrid import StatefulForCausalLM
from engine.models.smollm3 import NoRope
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["NemotronHForCausalLM", "NemotronHMoeBlock", "ReluSquaredMLP"]


class ReluSquaredMLP(nn.Module):
    """up_proj, relu(x)^2, down_proj: no gate. Under tensor parallelism this rank's `intermediate_size` rows of
    up_proj and columns of down_proj, the output summed over the ranks by `comm` (none: the caller sums it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Collectives | None = None) -> None:
        super().__init__()
        self.comm = comm or Collectives()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.down_proj(relu_squared(self.up_proj(x))))


class NemotronHBlock(nn.Module):
    """One block: its norm, then its mixer: `self_attn`, `mamba` or `ffn` by the block's kind."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType, layer: int,
                 state_index: int) -> None:
        super().__init__()
        self.norm = FloatRMSNorm(config.hidden_size, config.rms_norm_eps)
        kind = config.layer_types[layer]
        if kind == "full_attention":
            self.self_attn = Attention(config, shard, comm, NoRope(), layer)
        elif kind == "linear_attention":
            self.mamba = Mamba2Mixer(config.mamba.per_rank(shard.size), config.hidden_size, config.rms_norm_eps,
                                     state_index, comm)
        elif kind == "moe":
            self.ffn = NemotronHMoeBlock(config, shard, comm, ops)
        else:
            self.ffn = ReluSquaredMLP(config.hidden_size, shard.intermediate_size, comm)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows | None,
                cache: tuple[torch.Tensor, torch.Tensor] | RecurrentStates, meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the block's K/V, or the model's states (a Mamba block; an MLP block reads neither) -> (the
        mixer's output, the residual stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if hasattr(self, "self_attn"):
            return self.self_attn(hidden, rope_rows, cache, meta, backend), residual
        if hasattr(self, "mamba"):
            return self.mamba(hidden, meta, cache), residual
        return self.ffn(hidden), residual


class NemotronHForCausalLM(StatefulForCausalLM):
    """Nemotron-H (see the module docstring): Llama's loading and head, its blocks over `StatefulForCausalLM`'s
    states. Tensor parallelism splits attention's heads, the Mamba heads and groups (Granite 4-H's cut), the MLP's
    rows and each expert's (the router whole on every rank)."""

    def make_rotary(self, ops: ModuleType) -> nn.Module:
        return NoRope()

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return NemotronHBlock(self.config, self.shard, self.comm, ops, index, self.state_index.get(index, -1))

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`backbone.` names as the model's: `embeddings` the embedding, `norm_f` the final norm, a block's `mixer`
        its attention, Mamba or MLP; `mtp.` (multi-token prediction) skipped."""
        name = name.removeprefix("backbone.")
        if name.startswith("mtp."):
            return ()
        name = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}.get(name, name)
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 3 and parts[2] == "mixer" and parts[1].isdigit():
            if int(parts[1]) >= len(self.layers):
                raise ConfigError(f"{hf_name}: block {parts[1]} of a config with {len(self.layers)} blocks")
            kind = self.config.layer_types[int(parts[1])]
            parts[2] = {"full_attention": "self_attn", "linear_attention": "mamba", "mlp": "ffn", "moe": "ffn"}[kind]
            parts[3] = "shared_expert" if parts[3] == "shared_experts" else parts[3]
        return ((".".join(parts), tensor),)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a block's mixer: a Mamba block's as Granite 4-H's (`mamba2_cut`); the MLP's, an
        expert's or the shared expert's up rows and down columns (its share of their intermediate size); the router
        and the rest as Llama's."""
        shard, config = self.shard, self.config
        head, sep, rest = name.partition(".ffn.")
        if shard.size > 1 and ".mamba." in name:
            return mamba2_cut(config.mamba, hf_name, name, tensor, shard.rank, shard.size)
        if shard.size == 1 or not sep or not rest.endswith(("up_proj.weight", "down_proj.weight")):
            return super()._shard_of(hf_name, name, tensor)
        full, size = (config.moe_intermediate_size, shard.moe_intermediate_size) if rest.startswith("experts.") \
            else (config.shared_expert_intermediate_size, shard.shared_expert_intermediate_size) \
            if rest.startswith("shared_expert.") else (config.intermediate_size, shard.intermediate_size)
        dim = 1 if rest.endswith("down_proj.weight") else 0
        if tensor.dim() != 2 or tensor.shape[dim] != full:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({full} along dimension {dim})")
        return tensor.narrow(dim, shard.rank * size, size)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """A MoE block's expert `e`'s up_proj into w13[e], its down_proj into w2[e]."""
        prefix, sep, rest = name.partition(".ffn.experts.")
        if not sep:
            return super()._destination(name, hf_name)
        expert, _, proj = rest.partition(".")
        if not expert.isdigit() or int(expert) >= self.config.num_experts or \
                proj not in ("up_proj.weight", "down_proj.weight"):
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        e = int(expert)
        return f"{prefix}.ffn.{'w13' if proj.startswith('up') else 'w2'}", lambda data: data[e]


class NemotronHMoeBlock(DeepseekMoeBlock):
    """Nemotron 3's MoE block: DeepSeek V3's grouped sigmoid router over experts without a gate (`w13` holds each
    expert's up rows alone, relu(x)^2 between the products: the loop or the grouped matmuls, not the gated Triton
    kernel) beside a squared-ReLU shared expert. Nemotron 3 Super's experts work in a latent space: the router and
    the shared expert read the hidden state, the experts its projection (`fc1_latent_proj`, whole on every rank), and
    their sum is projected back (`fc2_latent_proj`) before the ranks' sum."""

    forward_runs_experts = True

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        h, latent = config.hidden_size, config.moe_latent_size
        self.w13 = nn.Parameter(torch.empty(config.num_experts, shard.moe_intermediate_size, latent or h))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, latent or h, shard.moe_intermediate_size))
        self.fc1_latent_proj = nn.Linear(h, latent, bias=False) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=False) if latent else None
        self.act_fn = ReluSquared()
        self.fused_moe = None
        self.shared_expert = ReluSquaredMLP(config.hidden_size, shard.shared_expert_intermediate_size) \
            if config.shared_expert_intermediate_size else None   # this rank's rows, summed with the experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.fc1_latent_proj is None:
            out = self._experts(x, weights, experts)
        else:
            out = self.fc2_latent_proj(self._experts(self.fc1_latent_proj(x), weights, experts))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.comm.all_reduce(out)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class ReluSquared(nn.Module):
    """relu(x)^2, an expert's activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_squared(x)
