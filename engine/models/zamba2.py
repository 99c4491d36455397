"""Zyphra's Zamba2 (`Zamba2ForCausalLM`: Zamba2-1.2B, -2.7B, -7B): Mamba-2 layers (`engine.layers.mamba2`, over the
states of `StatefulForCausalLM`), some of them `hybrid`: a shared transformer block runs first on the layer's input
beside the embeddings, and its output, through the layer's own linear, is added to the Mamba layer's input (not to
the residual stream). The shared blocks are `num_mem_blocks` (`Zamba2Block`), the hybrid layers using them in turn;
each use keeps its own K/V in the paged cache (the cache's layers are the hybrid ones) and its own low-rank adapters
(`engine.zamba2_config`). Under tensor parallelism a rank holds its Mamba heads and groups (Granite 4-H's cut), its
attention heads, MLP rows and their adapters' second halves; the layers' linears and the adapters' first halves whole.

Checkpoints store a block's weights under the first hybrid layer that uses it (`layers.N.shared_transformer.`, its
adapters for every use as `..._adapter_list.{use}`); the copies a checkpoint may store under later hybrid layers are
the same tied tensors and are not read. A Mamba layer's tensors come as `layers.N.mamba.` or, in a hybrid layer,
`layers.N.mamba_decoder.`.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm
from engine.layers.mamba2 import Mamba2Mixer
from engine.model import Attention
from engine.model_config import ModelConfig
from engine.models.granite import mamba2_cut
from engine.models.hybrid import StatefulForCausalLM, cut_pieces
from engine.models.smollm3 import NoRope
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["Zamba2Block", "Zamba2ForCausalLM"]

MIXER_NORM_EPS = 1e-5   # the Mamba mixer's gated norm's, whatever rms_norm_eps says (transformers' Zamba2)


def adapter(inputs: int, rank: int, outputs: int) -> nn.Sequential:
    """A low-rank adapter: inputs -> rank -> outputs, no biases."""
    return nn.Sequential(nn.Linear(inputs, rank, bias=False), nn.Linear(rank, outputs, bias=False))


class Zamba2Block(nn.Module):
    """One shared transformer block: RMSNorm over [the layer's input, the embeddings], attention from that (q, k, v
    plus the use's adapters), RMSNorm, an MLP gated by exact GELU (gate/up plus the use's adapter); its `uses`: the
    indices among the hybrid layers that run it, each with its adapters."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: nn.Module,
                 uses: list[int]) -> None:
        super().__init__()
        h, i, b = config.hidden_size, shard.intermediate_size, config.zamba2
        self.comm = comm   # o_proj's and down_proj's partial outputs summed over the ranks
        self.input_layernorm = RMSNorm(2 * h, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, comm, rotary_emb)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=False)   # from the concatenation
        if b.attention_adapters:
            for part, width in (("q", attn.q_size), ("k", attn.kv_size), ("v", attn.kv_size)):
                setattr(attn, f"linear_{part}_adapter_list",
                        nn.ModuleDict({str(u): adapter(2 * h, b.adapter_rank, width) for u in uses}))
        self.pre_ff_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.feed_forward = nn.Module()
        self.feed_forward.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        self.feed_forward.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.feed_forward.gate_up_proj_adapter_list = nn.ModuleDict({str(u): adapter(h, b.adapter_rank, 2 * i)
                                                                     for u in uses})
        self.attention_adapters = b.attention_adapters

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor, use: int, rope_rows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend) -> torch.Tensor:
        """hidden, embeddings: [num_tokens, hidden_size]; `use`: the hybrid layer's index among them -> the block's
        output [num_tokens, hidden_size] (no residual: the layer adds it to its Mamba layer's input)."""
        x = self.input_layernorm(torch.cat([hidden, embeddings], dim=-1))
        attn = self.self_attn
        qkv = attn.qkv_proj(x)
        if self.attention_adapters:
            key = str(use)
            qkv = qkv + torch.cat([getattr(attn, f"linear_{p}_adapter_list")[key](x) for p in "qkv"], dim=-1)
        qkv = qkv.view(-1, attn.num_heads + 2 * attn.num_kv_heads, attn.config.head_dim)
        attn.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        out = self.comm.all_reduce(attn.o_proj(attn.attend(q, k, v, kv_cache, meta, backend).reshape(-1, attn.q_size)))
        x = self.pre_ff_layernorm(out)
        mlp = self.feed_forward
        gate, up = (mlp.gate_up_proj(x) + mlp.gate_up_proj_adapter_list[str(use)](x)).chunk(2, dim=-1)
        return self.comm.all_reduce(mlp.down_proj(F.gelu(gate) * up))


class Zamba2Layer(nn.Module):
    """A Mamba-2 layer (its norm, its mixer); a hybrid one's `linear` takes its block's output into the mixer's
    input, `block` and `use` say which block and which of its uses."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType, state_index: int,
                 hybrid: tuple[int, int] | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mamba = Mamba2Mixer(config.mamba.per_rank(shard.size), config.hidden_size, MIXER_NORM_EPS, state_index,
                                 comm)
        self.block, self.use = hybrid if hybrid is not None else (None, None)
        if hybrid is not None:
            self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)


class Zamba2ForCausalLM(StatefulForCausalLM):
    """Zamba2 (see the module docstring): Llama's loading and head, `Zamba2Layer`s over `StatefulForCausalLM`'s states
    and the shared `blocks`."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        hybrids = [i for i, kind in enumerate(config.layer_types) if kind == "hybrid"]
        count = config.zamba2.count
        self.hybrid_of = {layer: (k % count, k) for k, layer in enumerate(hybrids)}   # layer -> (block, use)
        self.first_use = {hybrids[b]: b for b in range(min(count, len(hybrids)))}   # where a checkpoint stores each
        super().__init__(config, *args, **kwargs)
        self.blocks = nn.ModuleList(Zamba2Block(config, self.shard, self.comm, self.rotary_emb,
                                                [k for k in range(len(hybrids)) if k % count == b])
                                    for b in range(count))

    def kv_attentions(self) -> dict[int, Attention]:
        """Each shared block's attention once, by the first hybrid layer using it (`engine.kv_scales.attentions`):
        an FP8 cache's scales are a block's, measured over every use."""
        return {layer: self.blocks[block].self_attn for layer, block in self.first_use.items()}

    def make_rotary(self, ops: ModuleType) -> nn.Module:
        return super().make_rotary(ops) if self.config.zamba2.rope else NoRope()

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Zamba2Layer(self.config, self.shard, self.comm, ops, self.state_index[index], self.hybrid_of.get(index))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """kv_caches: the hybrid layers' alone, in layer order."""
        self.prepare_states(meta)
        hidden = embeddings = self.embed(input_ids)
        rope_rows, caches = self.rotary_emb.rows(positions), iter(kv_caches)
        for layer in self.layers:
            mixed = hidden
            if layer.block is not None:
                out = self.blocks[layer.block](hidden, embeddings, layer.use, rope_rows, next(caches), meta, backend)
                mixed = hidden + layer.linear(out)
            hidden = hidden + layer.mamba(layer.input_layernorm(mixed), meta, self.states)
        return self.norm(hidden)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`final_layernorm` the final norm; a hybrid layer's `mamba_decoder.` as its Mamba layer's; a block's
        tensors (`layers.N.shared_transformer.`) from the first hybrid layer using it, the tied copies under later
        ones not read."""
        if name == "final_layernorm.weight":
            return (("norm.weight", tensor),)
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
            return ((name, tensor),)
        layer = int(parts[1])
        if parts[2] == "mamba_decoder":
            return ((".".join(["layers", parts[1], *parts[3:]]), tensor),)
        if parts[2] == "shared_transformer":
            if layer not in self.first_use:
                return ()
            return ((".".join(["blocks", str(self.first_use[layer]), *parts[3:]]), tensor),)
        return ((name, tensor),)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part: a Mamba layer's heads and groups (`mamba2_cut`); a block's attention as a Llama layer's
        (its q/k/v adapters' second halves as q/k/v's rows, their first halves whole), its MLP's gate and up rows
        (gate/up_proj and its adapters' second halves, gate rows then up rows) and down's columns; the rest whole."""
        if self.shard.size == 1 or not name.startswith(("layers.", "blocks.")):
            return super()._shard_of(hf_name, name, tensor)
        if ".mamba." in name:
            return mamba2_cut(self.config.mamba, hf_name, name, tensor, self.shard.rank, self.shard.size)
        if not name.startswith("blocks.") or ".0.weight" in name:   # a layer's linear; an adapter's first half
            return tensor
        part = name.split(".", 2)[2]   # past `blocks.N.`
        for kind in "qkv":
            if part.startswith(f"self_attn.linear_{kind}_adapter_list."):
                return super()._shard_of(hf_name, f"layers.0.self_attn.{kind}_proj.weight", tensor)
        if part.startswith("feed_forward.gate_up_proj"):   # the projection, or its adapter's second half
            inter = self.config.intermediate_size
            return cut_pieces(hf_name, tensor, 0, [(inter, 0, True), (inter, inter, True)], self.shard.rank,
                              self.shard.size)
        if part.startswith("feed_forward.down_proj."):
            return super()._shard_of(hf_name, "layers.0.mlp." + part.removeprefix("feed_forward."), tensor)
        return super()._shard_of(hf_name, "layers.0." + part, tensor)
