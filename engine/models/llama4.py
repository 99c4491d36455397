"""Llama 4's text model (`Llama4ForCausalLM`; `Llama4ForConditionalGeneration`'s language model, its vision tower
skipped): Scout and Maverick on text. The config fields are `engine.llama4_config`'s.

- attention: the rotating layers attend within chunks of `attention_chunk_size` positions (the paged kernels'
  `chunk`: a query at p sees p - p % chunk .. p; `ModelConfig.layer_chunk`), their q and k heads L2-normed after
  the rotary, no weight (`Llama4Rotary`: transformers' `Llama4TextL2Norm` after `apply_rotary_emb`); the NoPE
  layers attend to the whole sequence and scale each query by log1p(floor((p + 1) / floor_scale)) x attn_scale + 1
  (`QueryTemperature`, in the rotary's place: a function of the positions, computed once a step);
- the rotary turns pairs (2i, 2i + 1) (complex multiplication in transformers), where the engine's turns i with
  i + head_dim / 2: each rotating layer's q and k rows are reordered as they are read (Cohere's
  `interleaved_to_halves`), so every q.k is the model's;
- experts (`Llama4MoeBlock`, Qwen3-MoE's block and kernels): the router's top k logits, each through a sigmoid,
  scale the token going into its expert (transformers' `Llama4TextMoe`: routed_in = x x score), the experts'
  outputs summed as they are; a shared expert every token takes, ungated; dense layers of `intermediate_size_mlp`
  between sparse ones where `moe_layers` says (Maverick's every other).

Weights: `feed_forward.*` read as the block's `mlp.*` (`router` as its `gate`); the experts stacked,
`experts.gate_up_proj` [experts, hidden, 2 x intermediate] (gate half, then up half) and `experts.down_proj`
[experts, intermediate, hidden], read as each expert's (Qwen3-MoE's `per_expert`). Under tensor parallelism every
expert's intermediate size is split across the ranks, as Qwen3-MoE's.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import RopeRows, RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.cohere import interleaved_to_halves
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from engine.models.smollm3 import NoRope
from engine.parallel import Collectives, ShardShape

__all__ = ["Llama4ForCausalLM", "Llama4MoeBlock", "Llama4Rotary", "QueryTemperature"]

_ROTATED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")


class Llama4Rotary(RotaryEmbedding):
    """The rotary of Llama 4's rotating layers, then, where `qk_l2_norm`, each q and k head L2-normed in place:
    x / sqrt(mean(x^2) + rms_norm_eps) in float32, rounded once (no weight)."""

    def __init__(self, config: ModelConfig, ops: ModuleType) -> None:
        super().__init__(config, ops)
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm else None

    def forward(self, query_key: torch.Tensor, rows: RopeRows) -> None:
        super().forward(query_key, rows)
        if self.l2_eps is not None:
            x = query_key.float()
            query_key.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.l2_eps))


class QueryTemperature(nn.Module):
    """The rotary's place on Llama 4's NoPE layers: nothing turned, each of this rank's `num_heads` query heads
    scaled by log1p(floor((p + 1) / floor_scale)) x attn_scale + 1 at its position p (in float32, rounded once to
    the query's dtype, as transformers' attention temperature tuning), the keys left."""

    def __init__(self, num_heads: int, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.num_heads, self.floor_scale, self.attn_scale = num_heads, floor_scale, attn_scale

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [num_tokens] -> each token's query scale, [num_tokens, 1, 1] float32."""
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return scale[:, None, None]

    def forward(self, query_key: torch.Tensor, rows: torch.Tensor) -> None:
        query_key[:, :self.num_heads].mul_(rows)


class Llama4MoeBlock(SparseMoeBlock):
    """Qwen3-MoE's block with Llama 4's routing: each of a token's top `num_experts_per_tok` experts takes the token
    times the sigmoid of its logit, and the experts' outputs are added unweighted, beside the shared expert. The
    kernels see one (token, expert) pair a row, its input already scaled, at weight 1."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.route_k, self.top_k = config.num_experts_per_tok, 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of the router's logits and their sigmoids (in float32, rounded to x's dtype)."""
        top, experts = torch.topk(self.gate(x), self.route_k, dim=-1)
        return torch.sigmoid(top.float()).to(x.dtype), experts

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        pairs = (x.unsqueeze(1) * weights.unsqueeze(-1)).flatten(0, 1)        # [tokens x k, hidden], scaled in
        out = super()._experts(pairs, torch.ones_like(weights).view(-1, 1), experts.reshape(-1, 1))
        return out.view(*weights.shape, -1).sum(dim=1)


class Llama4ForCausalLM(Qwen3MoeForCausalLM):
    """Llama 4's text model (see the module docstring): Qwen3-MoE's model and loading with Llama 4's attention
    layers, router and checkpoint names."""

    moe_block = Llama4MoeBlock

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        return Llama4Rotary(self.config, ops)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        if not self._rotates(index):
            if not hasattr(self, "no_rope"):   # one for every NoPE layer
                temperature = self.config.attn_temperature
                self.no_rope = NoRope() if temperature is None else QueryTemperature(self.shard.num_heads, *temperature)
            layer.self_attn.rotary_emb = self.no_rope
        return layer

    def _rotates(self, index: int) -> bool:
        return not self.config.no_rope_layers or bool(self.config.no_rope_layers[index])

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`feed_forward.*` as `mlp.*` (the router as the block's gate), a rotating layer's q and k rows in the
        engine's rotary order, then Qwen3-MoE's reading (the stacked experts as each expert's)."""
        name = name.replace(".feed_forward.", ".mlp.", 1).replace(".mlp.router.", ".mlp.gate.", 1)
        parts = name.split(".")
        if name.endswith(_ROTATED) and parts[0] == "layers" and parts[1].isdigit() \
                and int(parts[1]) < self.config.num_layers and self._rotates(int(parts[1])):
            tensor = interleaved_to_halves(tensor, self.config.head_dim)
        return super().read_tensor(hf_name, name, tensor)
