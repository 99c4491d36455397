"""Phi-3 and Phi-4 (`Phi3ForCausalLM`; Phi-4-multimodal's text model too, its image and audio embedders, under
`embed_tokens_extend`, not read): the Llama layer, its checkpoints storing q/k/v and gate/up fused.

Its checkpoints keep each layer's `self_attn.qkv_proj` ([q + 2 x kv rows, hidden]: the query heads' rows,
then the key heads', then the value heads') and `mlp.gate_up_proj` ([2 x intermediate, hidden]: gate rows,
then up rows), the layout our model fuses them into. `read_tensor` splits each into the q/k/v and gate/up
tensors a Llama checkpoint stores, so one loading serves both (each part cut to a rank's heads and rows under
tensor parallelism, a part filled twice or left out refused by name). What Phi-3 changes beside the
tensors is config (`engine.model_families.phi3_fields`: its sliding window, its partial rotary, whose q/k rows are
reordered as read as GLM-4.5's are; its longrope: `engine.rope_config`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.model import LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.cohere import interleaved_to_halves

__all__ = ["Phi3ForCausalLM", "partial_rotary_rows"]


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama model, its fused checkpoint tensors split as they are read."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`layers.N.self_attn.qkv_proj.weight` as its q_proj, k_proj and v_proj rows (a bias as well; q and k
        reordered for a partial rotary), and `layers.N.mlp.gate_up_proj.weight` as gate_proj and up_proj; Phi-4-
        multimodal's image and audio embedders (`embed_tokens_extend.`) not read; anything else as it is."""
        if name.startswith("embed_tokens_extend."):
            return ()
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        for fused, parts in ((".self_attn.qkv_proj.", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                             (".mlp.gate_up_proj.", (("gate_proj", inter), ("up_proj", inter)))):
            if fused not in name:
                continue
            rows = sum(size for _, size in parts)
            if tensor.shape[0] != rows:
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                      f"({rows} rows: {' + '.join(f'{part} {size}' for part, size in parts)})")
            head, _, suffix = name.partition(fused)
            module = fused.strip(".").split(".")[0]
            names = [f"{head}.{module}.{part}.{suffix}" for part, _ in parts]
            return [(name, partial_rotary_rows(c, name, piece))   # Phi-4-mini's q/k rows: its partial rotary's
                    for name, piece in zip(names, tensor.split([size for _, size in parts]))]
        return ((name, tensor),)


def partial_rotary_rows(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A q or k projection's rows (or bias), or its q/k norm's weight (a head's, or the whole projection's),
    reordered in each head for a partial rotate-half rotary (Phi-4-mini's, GLM-4.5's, MiniMax-M2's: the first
    `rotary_dim` of a head turned, i with i + rotary_dim / 2) where the config rotates part of each head; the tensor
    itself otherwise (and where its rows are not whole heads: the loading names its shape)."""
    d, r = config.head_dim, config.rotary_dim
    heads = any(f".self_attn.{part}." in name for part in ("q_proj", "k_proj", "q_norm", "k_norm"))
    if r < d and heads and tensor.dim() >= 1 and tensor.shape[0] % d == 0:
        return interleaved_to_halves(tensor, d, r, interleaved=False)
    return tensor
