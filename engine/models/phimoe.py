"""Microsoft's Phi-3.5-MoE (`PhimoeForCausalLM`; its config `engine.phimoe_config`): Mixtral's model and checkpoint
names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1 / w3 / w2`) under LayerNorms (a weight and a bias:
`norm_class`), its attention and head biased where the config says, and SparseMixer's router (`PhimoeMoeBlock`)."""

from __future__ import annotations

import torch

from engine.layers import BiasLayerNorm
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3_moe import SparseMoeBlock

__all__ = ["PhimoeForCausalLM", "PhimoeMoeBlock"]


class PhimoeMoeBlock(SparseMoeBlock):
    """Mixtral's experts under SparseMixer's router as it runs at inference (transformers' `sparsemixer` in eval):
    the first expert is the best logit's, weighed by its share of a softmax over the experts whose logits lie within
    2 x `router_jitter_noise` of the best, relatively ((best - logit) / max(|logit|, best)); the second is the best of
    the rest, weighed by its share of a softmax over the rest's logits near it, alike. Not renormalised; in the
    logits' dtype."""

    def __init__(self, config, shard, comm, ops) -> None:
        super().__init__(config, shard, comm, ops)
        self.jitter_eps = config.router_jitter_noise

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)                                                    # [num_tokens, num_experts]
        weights, experts, rest = [], [], logits
        for _ in range(2):
            best, expert = rest.max(dim=-1, keepdim=True)
            far = (best - logits) / logits.abs().clamp(min=best) > 2 * self.jitter_eps
            weights.append(rest.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, expert))
            experts.append(expert)
            rest = rest.scatter(-1, expert, float("-inf"))   # the second pick among the others
        return torch.cat(weights, dim=-1), torch.cat(experts, dim=-1)


class PhimoeForCausalLM(MixtralForCausalLM):
    """Phi-3.5-MoE (see the module docstring)."""

    moe_block = PhimoeMoeBlock
    norm_class = BiasLayerNorm
