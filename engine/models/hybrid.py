"""Models whose layers mix attention with layers that keep a state per sequence in place of K/V (`layer_types`
linear_attention: Qwen3.5's and OLMo Hybrid's Gated DeltaNet, `engine.models.qwen3_5`, `engine.models.olmo2`; Granite
4's and Nemotron-H's Mamba-2, `engine.models.granite`, `engine.models.nemotron_h`).

`StatefulForCausalLM` is the Llama model's loading and head with the states (`engine.layers.gated_delta_net.
RecurrentStates`: each state layer's, by row of the persistent batch) and a forward that hands each attention layer
its KV cache (the cache holds those layers alone: `ModelConfig.kv_layers`) and each state layer the states. Its
layers take `(hidden, residual, rope_rows, cache, meta, backend)`, `cache` the one or the other by the layer's
kind: a layer without `self_attn` is handed the states (Nemotron-H's MLP blocks leave them be), a `parallel_hybrid`
one (Falcon-H1's: attention and Mamba-2 side by side) both, as (its K/V, the states). The module path runs them (no
CPU flat loop).
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.gated_delta_config import StateShape
from engine.layers import RopeRows
from engine.layers.gated_delta_net import RecurrentStates
from engine.model import LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused

__all__ = ["MixerLayerForward", "StatefulForCausalLM", "cut_pieces"]


class MixerLayerForward:
    """The forward of a pre-norm layer whose token mixer is attention (`self_attn`) or a state layer (the module
    named `mixer`: Qwen3.5's `linear_attn`, LFM2's `conv`), then its MLP; a base beside `nn.Module`."""

    mixer = "linear_attn"

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows | None,
                cache: tuple[torch.Tensor, torch.Tensor] | RecurrentStates, meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cache: the layer's K/V, or the model's states for a state layer -> (this layer's output, the residual
        stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        state_mixer = getattr(self, self.mixer, None)
        if state_mixer is not None:
            hidden = state_mixer(hidden, meta, cache)
        else:
            hidden = self.self_attn(hidden, rope_rows, cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(self.output_norm(1, hidden), residual)
        return self.output_norm(2, self.mlp(hidden)), residual

    def output_norm(self, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        """Sublayer `sublayer`'s (1: the token mixer, 2: the MLP) output as it joins the stream: itself (LFM3's sandwich
        norms: `engine.models.lfm3`)."""
        return out


class StatefulForCausalLM(LlamaForCausalLM):
    """The Llama model whose `linear_attention` layers keep a state per sequence (see the module docstring);
    `state_index`: each such layer's index among them (its state's)."""

    supports_flat_forward = False

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        self.state_index = {layer: i for i, layer in enumerate(config.stateful_layers)}
        super().__init__(config, shard, comm, ops)
        self.states: RecurrentStates | None = None

    def state_shape(self) -> StateShape:
        """This rank's shape of a state layer (its heads under tensor parallelism)."""
        return self.config.state_shape.per_rank(self.shard.size)

    def reserve_states(self, num_rows: int) -> None:
        """States for `num_rows` rows of the persistent batch, made now on the model's device (the engine reserves
        its pools' max_num_seqs at start, on every rank; the capacity plan counted them)."""
        weight = self.embed_tokens.weight
        if not self.state_index:   # no state layer (Granite 4 with experts and attention alone)
            return
        if self.states is None:
            self.states = RecurrentStates(self.state_shape(), len(self.state_index), weight.dtype, weight.device)
        self.states.reserve(num_rows)

    def prepare_states(self, meta: AttentionMetadata) -> None:
        """The step's rows of the states (`RecurrentStates.for_step`), one row reserved first where no engine reserved
        them (a model run alone); nothing where no layer keeps a state. Every stateful model's forward starts here."""
        if self.states is None:
            self.reserve_states(1)
        if self.states is not None:
            self.states.for_step(meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """kv_caches: the attention layers' alone, in layer order (the cache's layers are `ModelConfig.kv_layers`)."""
        self.prepare_states(meta)
        hidden, residual = self.embed(input_ids), None
        rows: dict[int, RopeRows] = {}   # the step's cos/sin, once per rotary embedding
        caches = iter(kv_caches)
        for layer in self.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                hidden, residual = layer(hidden, residual, None, self.states, meta, backend)
                continue
            if id(attn.rotary_emb) not in rows:
                rows[id(attn.rotary_emb)] = attn.rotary_emb.rows(positions)
            cache = (next(caches), self.states) if getattr(layer, "parallel_hybrid", False) else next(caches)
            hidden, residual = layer(hidden, residual, rows[id(attn.rotary_emb)], cache, meta, backend)
        return self.norm(hidden, residual)[0]


def cut_pieces(hf_name: str, tensor: torch.Tensor, dim: int, pieces: list[tuple[int, int, bool]], rank: int,
               size: int) -> torch.Tensor:
    """This rank's part of a tensor whose `dim` lays pieces side by side, each (its full size, its offset, whether
    the ranks split it: else each holds it whole), the parts concatenated in the pieces' order; a tensor of another
    size along `dim` is refused by name."""
    full = sum(n for n, _, _ in pieces)
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config ({full} along "
                              f"dimension {dim})")
    return torch.cat([tensor.narrow(dim, offset + rank * (n // size), n // size) if split else
                      tensor.narrow(dim, offset, n) for n, offset, split in pieces], dim=dim)
