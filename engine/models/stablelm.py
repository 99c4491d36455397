"""StableLM (`StableLmForCausalLM`: StableLM 2 1.6B and 12B, Stable Code 3B): the Llama layer with LayerNorms (a
weight and a bias: `BiasLayerNorm`), q/k/v biases where `use_qkv_bias`, the first `partial_rotary_factor` (0.25)
of each head rotated with rotate-half pairs (q/k rows reordered as read: `partial_rotary_rows`). StableLM 2 12B's
layers are parallel where `use_parallel_residual` (Cohere's layer: attention and MLP off one norm, x + attention +
MLP) and norm each q and k head with a LayerNorm of its own where `qk_layernorm` (transformers'
`StableLmLayerNormPerHead`: the checkpoint stores a tensor a head, `q_layernorm.norms.N.weight`; they are stacked
into `CohereHeadLayerNorm`'s [heads, head_dim] weight as the last of a layer's comes). The module path runs it."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import BiasLayerNorm
from engine.model import DecoderLayer, LlamaForCausalLM, WeightLoadError
from engine.models.cohere import CohereDecoderLayer, CohereHeadLayerNorm, cut_head_norm
from engine.models.phi3 import partial_rotary_rows

__all__ = ["StableLmForCausalLM"]


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM (see the module docstring)."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        c, shard = self.config, self.shard
        if c.parallel_residual:   # its q/k norms Cohere's per-head ones where the config norms them
            layer = CohereDecoderLayer(c, shard, self.comm, self.rotary_emb, ops, index)
        else:
            layer = DecoderLayer(c, shard, self.comm, self.rotary_emb, ops, index)
            layer.post_attention_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
            if c.qk_norm:
                layer.self_attn.q_norm = CohereHeadLayerNorm(shard.num_heads, c.head_dim, c.rms_norm_eps)
                layer.self_attn.k_norm = CohereHeadLayerNorm(shard.num_kv_heads, c.head_dim, c.rms_norm_eps)
        layer.input_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
        return layer

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return BiasLayerNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A head's q/k LayerNorm weight held until its layer's last has come, then the stack as `q_norm.weight` /
        `k_norm.weight`; q/k rows (and the stacked norms' channels) reordered for the partial rotary."""
        for which, count in (("q", self.config.num_heads), ("k", self.config.num_kv_heads)):
            layer, sep, rest = name.partition(f".self_attn.{which}_layernorm.norms.")
            if not sep:
                continue
            head = rest.removesuffix(".weight")
            if not head.isdigit() or int(head) >= count or not rest.endswith(".weight"):
                raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
            pending = self.__dict__.setdefault("_head_norms", {}).setdefault((layer, which), {})
            pending[int(head)] = tensor
            if len(pending) < count:
                return ()
            stacked = torch.stack([pending[i] for i in range(count)])
            del self._head_norms[layer, which]
            name = f"{layer}.self_attn.{which}_norm.weight"
            return ((name, partial_rotary_rows(self.config, name, stacked.reshape(-1)).view(stacked.shape)),)
        return ((name, partial_rotary_rows(self.config, name, tensor)),)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The stacked q/k norms cut to this rank's heads (`cut_head_norm`); the rest as the Llama model's."""
        cut = cut_head_norm(self.shard, self.config, hf_name, name, tensor)
        return super()._shard_of(hf_name, name, tensor) if cut is None else cut
