"""EleutherAI's GPT-J (`GPTJForCausalLM`; its config `engine.gptj_config`): GPT-NeoX's parallel layer off one norm
(`ungated_layer`: Phi's), q/k/v and o_proj unbiased, the MLP (`fc_in`, GELU-tanh, `fc_out`) and the head biased,
under GPT-J's names (`transformer.wte`, `transformer.h.N`, `ln_1`, `attn.out_proj`, `transformer.ln_f`); the first
`rotary_dim` of each head turned in interleaved pairs (2i, 2i + 1), served by reordering each q and k head's rows as
read (`InterleavedRotaryWeights`, Cohere's and GLM-4's way). The older checkpoints' attention buffers
(`attn.bias`, `attn.masked_bias`) are skipped. Salesforce's CodeGen (`CodeGenForCausalLM`: CodeGen 350M to 16B,
mono, multi, nl) is GPT-J's model and config keys with q, k and v fused in `attn.qkv_proj` as its model-parallel
checkpoints laid them out: four groups, each its quarter of q's rows, then of v's, then of k's, split as read (its older
checkpoints' `attn.causal_mask` skipped)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.model import WeightLoadError
from engine.models.cohere import InterleavedRotaryWeights
from engine.models.gpt_neox import GPTNeoXForCausalLM, checkpoint_name

__all__ = ["CodeGenForCausalLM", "GPTJForCausalLM"]

# the checkpoint's names (past `transformer.`) -> the model's (before Jais 2's reading: the MLP's up_proj as its `up`)
_RENAMES = ((".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."), (".mlp.fc_in.", ".mlp.up_proj."),
            (".mlp.fc_out.", ".mlp.down_proj."), (".ln_1.", ".input_layernorm."))
_TOP_NAMES = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}


class GPTJForCausalLM(InterleavedRotaryWeights, GPTNeoXForCausalLM):
    """GPT-J (see the module docstring): GPT-NeoX's model and reading under GPT-J's names, its q/k rows reordered by
    `InterleavedRotaryWeights` (Cohere's)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return ()
        return super().read_tensor(hf_name, checkpoint_name(name, "transformer.", _TOP_NAMES, _RENAMES), tensor)


class CodeGenForCausalLM(GPTJForCausalLM):
    """CodeGen (see the module docstring): GPT-J's model, its fused `qkv_proj` split into GPT-J's q, k and v."""

    groups = 4   # transformers' CodeGenAttention.mp_num

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(".attn.causal_mask"):
            return ()
        head, fused, suffix = name.partition(".attn.qkv_proj.")
        if not fused:
            return super().read_tensor(hf_name, name, tensor)
        h = self.config.hidden_size
        if tensor.shape[0] != 3 * h or h % self.groups:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not q, v and k's rows of hidden_size {h} "
                                  f"in {self.groups} groups")
        q, v, k = tensor.unflatten(0, (self.groups, 3, h // self.groups)).unbind(1)
        reads = []
        for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            reads += super().read_tensor(hf_name, f"{head}.attn.{proj}.{suffix}", part.flatten(0, 1))
        return reads
