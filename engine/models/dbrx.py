"""Databricks' DBRX (`DbrxForCausalLM`; its config `engine.dbrx_config`): the Llama layer with LayerNorms of a weight
and no bias (Cohere's `CohereLayerNorm`), q, k and v clamped to +-`clip_qkv` after their fused projection (OLMo's
`OlmoAttention`), and on every layer Qwen3-MoE's experts under DBRX's router (`DbrxMoeBlock`: the top k of a softmax in
the model's dtype, renormalised). Names: `transformer.wte`, `transformer.blocks.N` (`norm_attn_norm.norm_1`,
`norm_attn_norm.attn.Wqkv`: q, k and v rows one after the other, `norm_attn_norm.attn.out_proj`,
`norm_attn_norm.norm_2`, `ffn.router.layer`, `ffn.experts.mlp.w1 / v1 / w2`: every expert's gate, up and down rows
stacked, [experts x inter, hidden] each, w2 transposed), `transformer.norm_f`."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.model import WeightLoadError
from engine.models.cohere import CohereLayerNorm
from engine.models.gpt_neox import checkpoint_name, split_qkv_rows
from engine.models.olmo import OlmoAttention
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock

__all__ = ["DbrxForCausalLM", "DbrxMoeBlock"]

# the checkpoint's names (past `transformer.`) -> the model's
_RENAMES = ((".norm_attn_norm.norm_1.", ".input_layernorm."),
            (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
            (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."), (".ffn.router.layer.", ".mlp.gate."))
_TOP_NAMES = {"wte.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
_EXPERTS = {"w1": "gate_proj", "v1": "up_proj", "w2": "down_proj"}   # each stored [experts x inter, hidden]


class DbrxMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts under DBRX's router: the softmax of the logits in their own dtype, its top k, divided by
    their sum where `norm_topk_prob` (DBRX's `moe_normalize_expert_weights` 1)."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        return self.renormalised(weights), experts


class DbrxForCausalLM(Qwen3MoeForCausalLM):
    """DBRX (see the module docstring)."""

    moe_block = DbrxMoeBlock
    norm_class = CohereLayerNorm

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = OlmoAttention(self.config, self.shard, self.comm, self.rotary_emb, index)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """DBRX's names as the model's; the fused Wqkv as q_proj, k_proj and v_proj; the stacked experts as each
        expert's gate_proj, up_proj and down_proj (w2 transposed)."""
        name = checkpoint_name(name, "transformer.", _TOP_NAMES, _RENAMES, blocks="blocks.")
        c = self.config
        head, fused, suffix = name.partition(".norm_attn_norm.attn.Wqkv.")
        if fused:
            return split_qkv_rows(c, hf_name, head, suffix, tensor)
        head, stacked, stored = name.partition(".ffn.experts.mlp.")
        if stacked:
            e, inter = c.num_experts, c.moe_intermediate_size
            if stored not in _EXPERTS or tuple(tensor.shape) != (e * inter, c.hidden_size):
                raise WeightLoadError(f"{hf_name}: not {e} experts' stacked w1, v1 or w2 [{e * inter}, "
                                      f"{c.hidden_size}] (shape {tuple(tensor.shape)})")
            per = tensor.view(e, inter, c.hidden_size)
            return [(f"{head}.mlp.experts.{i}.{_EXPERTS[stored]}.weight", t.t() if stored == "w2" else t)
                    for i, t in enumerate(per)]
        return super().read_tensor(hf_name, name, tensor)
