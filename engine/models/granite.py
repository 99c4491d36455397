"""Granite (`GraniteForCausalLM`, IBM's Granite 3): the Llama layer and four scalars (`engine.granite_config.
granite_fields`): the embeddings times `embedding_multiplier`, q.k times `attention_multiplier` (the config's
`attention_scale`), each sublayer's output times `residual_multiplier` before it joins the residual stream
(`GraniteDecoderLayer`: the product first, then the add the next norm fuses, transformers' order), and the logits
over `logits_scaling` (`LlamaForCausalLM.compute_logits`). On the CPU backend the flat loop (`engine.cpu_forward`)
runs it, the residual multiplier applied there the same way.

Granite 4's transformers (`GraniteMoeHybridForCausalLM` with attention on every layer and no experts: Granite-4.0-
Micro, -1B, -350M) are Granite 3's model: the MLP is its `shared_mlp` (`input_linear` [2 x intermediate, hidden],
gate rows then up rows, read as gate_proj and up_proj; `output_linear` as down_proj), and without
`position_embedding_type: rope` every layer is NoPE (SmolLM3's `NoRope`). Its -H models without experts
(Granite-4.0-H-Micro, -H-1B, -H-350M) put Mamba-2 layers (`engine.layers.mamba2`) beside the attention ones
(`GraniteHybridForCausalLM`: the same layer, its token mixer the one or the other, over a state per sequence).
Bamba (`BambaForCausalLM`) is that model without Granite's scalars, under its own tensor names. HyperCLOVA X SEED
(`HyperClovaxForCausalLM`) is Granite 3's with a norm on each sublayer's output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType

import torch
from torch import nn

from engine.layers import RMSNorm, RopeRows, RotaryEmbedding
from engine.layers.gated_delta_net import RecurrentStates
from engine.layers.mamba2 import Mamba2Mixer
from engine.mamba_config import Mamba2Shape
from engine.model import DecoderLayer, LlamaForCausalLM, WeightLoadError
from engine.models.hybrid import StatefulForCausalLM, cut_pieces
from engine.models.phi3 import partial_rotary_rows
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.models.smollm3 import NoRope, layer_rotary
from kernels import AttentionMetadata

__all__ = ["BambaAttentionForCausalLM", "BambaForCausalLM", "GraniteForCausalLM", "GraniteHybridForCausalLM",
           "GraniteHybridMoeForCausalLM", "GraniteMoeHybridForCausalLM", "HyperClovaxForCausalLM", "mamba2_cut"]


class GraniteDecoderLayer(DecoderLayer):
    """The Llama block, each sublayer's output scaled by `residual_multiplier` before the residual add (normed first
    where a subclass norms it: `output_norm`)."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.self_attn.config.residual_multiplier
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.output_norm(1, self.self_attn(hidden, rope_rows, kv_cache, meta, backend)) * scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.output_norm(2, self.mlp(hidden)) * scale, residual

    def output_norm(self, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        """Sublayer `sublayer`'s (1: attention, 2: MLP) output as it joins the stream: itself."""
        return out


class GraniteForCausalLM(LlamaForCausalLM):
    """The Llama model with Granite's layers and scaled embeddings (see the module docstring)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return GraniteDecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier


class GraniteSWAForCausalLM(GraniteForCausalLM):
    """Granite SWA: Granite 3's model with a sink logit per query head on every layer (GPT-OSS's `Attention.sinks`),
    sliding layers, and each layer's own rope base (`ModelConfig.layer_rope_thetas`: a rotary a base, made with its
    first layer; 0, NoPE)."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_layer_rope(self, super().make_layer(index, ops), index, ops)


def with_layer_rope(model: LlamaForCausalLM, layer: nn.Module, index: int, ops: ModuleType) -> nn.Module:
    """`layer` (layer `index` of `model`) turned by its own rope base where `ModelConfig.layer_rope_thetas` names one:
    the model's rotary at the model's base, NoPE at 0, else a rotary of that base (one a base, made with its first
    layer)."""
    thetas = model.config.layer_rope_thetas
    if thetas and thetas[index] == 0:
        layer.self_attn.rotary_emb = NoRope()
    elif thetas and thetas[index] != model.config.rope_theta:
        rotaries = model.__dict__.setdefault("_rotaries", {})
        if thetas[index] not in rotaries:
            rotaries[thetas[index]] = RotaryEmbedding(replace(model.config, rope_theta=thetas[index]), ops)
        layer.self_attn.rotary_emb = rotaries[thetas[index]]
    return layer


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    """Granite 4 as a transformer (see the module docstring): Granite 3's model, its shared MLP's tensors read as the
    Llama MLP's, NoPE layers where the config turns no rotary."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn.rotary_emb = layer_rotary(self, index)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        head, sep, part = name.partition(".shared_mlp.")
        if sep and part == "input_linear.weight":   # gate rows, then up rows
            half = tensor.shape[0] // 2
            return ((f"{head}.mlp.gate_proj.weight", tensor[:half]), (f"{head}.mlp.up_proj.weight", tensor[half:]))
        if sep and part == "output_linear.weight":
            return ((f"{head}.mlp.down_proj.weight", tensor),)
        return ((name, tensor),)


class GraniteHybridLayer(GraniteDecoderLayer):
    """Granite 4's layer whose token mixer is attention (`self_attn`) or Mamba-2 (`mamba`, a state layer)."""

    def __init__(self, config, shard, comm, rotary_emb, ops: ModuleType, layer: int, state_index: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops, layer)
        self.residual_multiplier = config.residual_multiplier
        if config.is_linear_layer(layer):
            del self.self_attn
            self.mamba = Mamba2Mixer(config.mamba.per_rank(shard.size), config.hidden_size, config.rms_norm_eps,
                                     state_index, comm)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows | None,
                cache: tuple[torch.Tensor, torch.Tensor] | RecurrentStates, meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the layer's K/V, or the model's states for a Mamba layer."""
        scale = self.residual_multiplier
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "mamba"):
            hidden = self.mamba(hidden, meta, cache) * scale
        else:
            hidden = self.self_attn(hidden, rope_rows, cache, meta, backend) * scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * scale, residual


class GraniteHybridForCausalLM(StatefulForCausalLM, GraniteMoeHybridForCausalLM):
    """Granite 4's -H models without experts: `GraniteMoeHybridForCausalLM`'s with Mamba-2 layers (their tensors
    under the checkpoint's own names) over `StatefulForCausalLM`'s states."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = GraniteHybridLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                                   self.state_index.get(index, -1))
        if hasattr(layer, "self_attn"):
            layer.self_attn.rotary_emb = layer_rotary(self, index)
        return layer

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A Mamba layer's part on this rank: its heads' gate, x, dt rows and parameters and out_proj columns, its
        groups' B and C (each rank all of one group where there is one); the rest as Granite 4's."""
        if self.shard.size == 1 or ".mamba." not in name:
            return super()._shard_of(hf_name, name, tensor)
        return mamba2_cut(self.config.mamba, hf_name, name, tensor, self.shard.rank, self.shard.size)


def mamba2_cut(s: Mamba2Shape, hf_name: str, name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A Mamba-2 layer's tensor `name` (`layers.N.mamba.<part>...`) on `rank` of `size`: its heads' gate, x, dt rows
    and parameters and out_proj columns (out_proj's bias on rank 0, added once after the ranks' sum), its groups' B
    and C (each rank all of one group where there is one)."""
    inter = s.intermediate_size
    if name.endswith("out_proj.bias"):
        return tensor if rank == 0 else torch.zeros_like(tensor)
    groups, heads = s.n_groups * s.d_state, [(s.num_heads, 0, True)]
    split = s.n_groups % size == 0   # else one group, whole on every rank
    xbc = [(inter, 0, True), (groups, inter, split), (groups, inter + groups, split)]
    rows = [(inter, 0, True)] + [(n, inter + o, sp) for n, o, sp in xbc] + [(s.num_heads, inter + s.conv_dim, True)]
    parts = {"in_proj": (0, rows), "conv1d": (0, xbc), "dt_bias": (0, heads), "A_log": (0, heads),
             "D": (0, heads), "norm": (0, [(inter, 0, True)]), "out_proj": (1, [(inter, 0, True)])}
    dim, pieces = parts[name.split(".mamba.")[1].split(".")[0]]
    return cut_pieces(hf_name, tensor, dim, pieces, rank, size)


# transformers 5's names of Granite's stacked experts and router, as the checkpoints' own
_NATIVE_NAMES = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
                 "router.weight": "router.layer.weight"}


class GraniteHybridMoeForCausalLM(GraniteHybridForCausalLM, Qwen3MoeForCausalLM):
    """Granite 4 with experts (Granite-4.0-H-Tiny, -H-Small): each layer's MLP Qwen2-MoE's sparse block, its shared
    expert ungated (the checkpoint's `shared_mlp`), its experts stored stacked (`block_sparse_moe.input_linear`
    [experts, 2 x intermediate, hidden], gate rows then up rows; `output_linear` [experts, hidden, intermediate]) and
    its router as `block_sparse_moe.router.layer`, read as each expert's (`Qwen3MoeForCausalLM`'s names); under
    transformers 5's names too (`experts.gate_up_proj`, `experts.down_proj`, `router.weight`: granite-swash's)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_experts(self, super().make_layer(index, ops), index, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        head, sep, part = name.partition(".block_sparse_moe.")
        part = _NATIVE_NAMES.get(part, part)
        if sep and part == "router.layer.weight":
            return ((f"{head}.mlp.gate.weight", tensor),)
        if sep and part in ("input_linear.weight", "output_linear.weight"):
            return self._per_expert(hf_name, f"{head}.mlp.experts", part, tensor)
        head, sep, part = name.partition(".shared_mlp.")
        if sep:   # the shared expert's, as a dense MLP's (`GraniteMoeHybridForCausalLM.read_tensor`)
            return ((read.replace(".mlp.", ".mlp.shared_expert."), t)
                    for read, t in super().read_tensor(hf_name, name, tensor))
        return super().read_tensor(hf_name, name, tensor)

    def _per_expert(self, hf_name: str, prefix: str, part: str, tensor: torch.Tensor
                    ) -> Iterable[tuple[str, torch.Tensor]]:
        inter = self.config.moe_intermediate_size
        want = (self.config.num_experts, *((2 * inter, self.config.hidden_size) if part.startswith("input")
                                           else (self.config.hidden_size, inter)))
        if tuple(tensor.shape) != want:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config's {want}")
        for e, t in enumerate(tensor):
            if part.startswith("output"):
                yield f"{prefix}.{e}.down_proj.weight", t
            else:
                yield f"{prefix}.{e}.gate_proj.weight", t[:inter]
                yield f"{prefix}.{e}.up_proj.weight", t[inter:]


class GraniteMoeSWAForCausalLM(GraniteHybridMoeForCausalLM):
    """Granite SWA with experts (granite-swash's MoE): Granite 3's MoE model (`GraniteMoeSharedForCausalLM`'s) with
    Granite SWA's sinks, sliding layers and a rope base a layer."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_layer_rope(self, super().make_layer(index, ops), index, ops)


# Bamba's checkpoint names of the Llama layer's MLP and second norm, and of the final norm
_BAMBA_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("final_layernorm.", "norm."))


class BambaNames:
    """Bamba's tensors under the Llama model's names (`_BAMBA_NAMES`), q/k rows reordered for its partial rotate-half
    rotary (`partial_rotary_rows`)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for theirs, ours in _BAMBA_NAMES:
            if name.startswith(theirs) or theirs.startswith(".") and theirs in name:
                name = name.replace(theirs, ours, 1)
        return super().read_tensor(hf_name, name, partial_rotary_rows(self.config, name, tensor))


class BambaForCausalLM(BambaNames, GraniteHybridForCausalLM):
    """Bamba (IBM's Bamba-9B): Granite 4's -H model without its scalars (every one 1) or NoPE layers; the attention
    layers turn the first half of each head (`ModelConfig.partial_rotary_factor`)."""


class BambaAttentionForCausalLM(BambaNames, LlamaForCausalLM):
    """A Bamba config whose every layer is attention: the Llama model under Bamba's names."""


class HyperClovaxLayer(GraniteDecoderLayer):
    """Granite 3's layer with a norm on each sublayer's output (`post_norm1`, `post_norm2`: Peri-LN), before the
    residual multiplier."""

    def __init__(self, config, shard, comm, rotary_emb, ops: ModuleType, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops, layer)
        self.post_norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def output_norm(self, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        return (self.post_norm1 if sublayer == 1 else self.post_norm2)(out)


class HyperClovaxForCausalLM(GraniteForCausalLM):
    """HyperCLOVA X SEED: Granite 3's model (its scaled embeddings; the logits times `logit_scale`), its layers
    `HyperClovaxLayer`s where `ModelConfig.peri_norms` (the module path then: the CPU flat loop has no such norms)."""

    def __init__(self, config, *args, **kwargs) -> None:
        self.supports_flat_forward = not config.peri_norms
        super().__init__(config, *args, **kwargs)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        if not self.config.peri_norms:
            return super().make_layer(index, ops)
        return HyperClovaxLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)
