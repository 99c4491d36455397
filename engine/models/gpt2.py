"""GPT-2 and the models built like it (their configs: `engine.gpt2_config`): sequential pre-norm layers of LayerNorms
(`ungated_layer`), every projection biased, an ungated MLP, no rotary: each token's embedding plus a learned embedding
of its position (`LearnedPositions`).

- GPT-2 (`GPT2LMHeadModel`): `transformer.wte`, `wpe`, `h.N` (`ln_1`, `attn.c_attn`, `attn.c_proj`, `ln_2`,
  `mlp.c_fc`, `mlp.c_proj`), `ln_f`; its projections are `Conv1D`s, stored [in, out] (transposed as read), c_attn's
  q, k and v rows one after the other; the older checkpoints' attention buffers (`attn.bias`, `attn.masked_bias`)
  skipped.
- GPT-BigCode (`GPTBigCodeForCausalLM`: StarCoder, SantaCoder, WizardCoder): GPT-2's names, [out, in] weights,
  multi-query attention (one KV head, held by every rank under tensor parallelism), c_attn split by
  `split_grouped_qkv` (one group: the query heads' rows, then the key's, then the value's; a group a head without
  `multi_query`).
- GPT-Neo (`GPTNeoForCausalLM`): GPT-2's names with [out, in] weights, q/k/v and out_proj apart
  (`attn.attention.`); its older checkpoints' attention buffers skipped.
- OPT (`OPTForCausalLM`): `decoder.embed_tokens`, `decoder.embed_positions` (a position looked up two rows on:
  `position_offset`), `decoder.layers.N` (`self_attn_layer_norm`, `self_attn.q/k/v/out_proj`, `final_layer_norm`,
  `fc1`, ReLU, `fc2`), `decoder.final_layer_norm`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model import WeightLoadError
from engine.models.gpt_neox import GPTNeoXForCausalLM, checkpoint_name, split_grouped_qkv

__all__ = ["GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTNeoForCausalLM", "LearnedPositions", "OPTForCausalLM"]

# GPT-2's names (past `transformer.`) -> the model's (before Jais 2's reading: the MLP's up_proj as its `up`)
_GPT2_RENAMES = ((".attn.c_proj.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.up_proj."),
                 (".mlp.c_proj.", ".mlp.down_proj."), (".ln_1.", ".input_layernorm."),
                 (".ln_2.", ".post_attention_layernorm."))
_GPT2_TOP = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}
# GPT-Neo's (past `transformer.`)
_GPT_NEO_RENAMES = ((".attn.attention.out_proj.", ".self_attn.o_proj."), (".attn.attention.", ".self_attn."),
                    *_GPT2_RENAMES[1:])
# OPT's names (past `decoder.`)
_OPT_RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.up_proj."),
                (".fc2.", ".mlp.down_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                (".final_layer_norm.", ".post_attention_layernorm."))
_OPT_TOP = {"embed_tokens.weight": "embed_tokens.weight", "embed_positions.weight": "wpe.weight",
            "final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias"}


class LearnedPositions(GPTNeoXForCausalLM):
    """A model whose embeddings add a learned embedding of each token's position (`wpe`: `learned_positions` rows,
    whole on every rank; position p at row p + `position_offset`), read as `wpe.weight`; `forward` keeps the step's
    positions for `embed`."""

    position_offset = 0

    def __init__(self, config, shard=None, comm=None, *args) -> None:
        super().__init__(config, shard, comm, *args)
        rows = config.learned_positions
        self.wpe = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.positions: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args) -> torch.Tensor:
        self.positions = positions
        return super().forward(input_ids, positions, *args)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) + self.wpe(self.positions + self.position_offset)

    def plain_read(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The reading past GPT-NeoX's own (Jais 2's: the MLP's up_proj as `up`)."""
        return super(GPTNeoXForCausalLM, self).read_tensor(hf_name, name, tensor)


class GPTBigCodeForCausalLM(LearnedPositions):
    """GPT-BigCode (see the module docstring)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = checkpoint_name(name, "transformer.", _GPT2_TOP, _GPT2_RENAMES)
        head, fused, suffix = name.partition(".attn.c_attn.")
        if not fused:
            return self.plain_read(hf_name, name, tensor)
        return split_grouped_qkv(self.config, hf_name, head, suffix, tensor)


class GPT2LMHeadModel(LearnedPositions):
    """GPT-2 (see the module docstring)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return ()
        name = checkpoint_name(name, "transformer.", _GPT2_TOP, _GPT2_RENAMES)
        if name.startswith("layers.") and name.endswith(".weight") and tensor.dim() == 2:   # Conv1D: [in, out]
            tensor = tensor.t()
        head, fused, suffix = name.partition(".attn.c_attn.")
        if not fused:
            return self.plain_read(hf_name, name, tensor)
        h = self.config.hidden_size
        if tensor.shape[0] != 3 * h:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({h} rows each of q, k and v)")
        return [(f"{head}.self_attn.{proj}.{suffix}", part)
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(h))]


class OPTForCausalLM(LearnedPositions):
    """OPT (see the module docstring)."""

    position_offset = 2

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return self.plain_read(hf_name, checkpoint_name(name, "decoder.", _OPT_TOP, _OPT_RENAMES), tensor)


class GPTNeoForCausalLM(LearnedPositions):
    """GPT-Neo (see the module docstring)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith((".attn.attention.bias", ".attn.attention.masked_bias")):
            return ()
        return self.plain_read(hf_name, checkpoint_name(name, "transformer.", _GPT2_TOP, _GPT_NEO_RENAMES), tensor)
