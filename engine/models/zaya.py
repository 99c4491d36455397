"""Zyphra's ZAYA1 (`ZayaForCausalLM`; its config: `engine.zaya_config`):
- CCA attention (`CcaAttention`): q = q_proj x, k = k_proj x; both, side by side, through a depthwise causal
  convolution of `cca_time0` taps then one of `cca_time1` taps within each head (both biased), plus residual paths
  (each q head's mean with its KV head's k; each k head the mean of its q heads' residuals); v's first half from
  the token, its second half the previous token's delayed projection. q and k normed to length sqrt(head_dim), k
  times a temperature a KV head, half of each head turned (rotate-half within it, transformers' layout:
  `kernels.qsa.turn_part`) by its layer type's rope; the attention itself the backend's, over the paged K/V;
- the state each sequence keeps a layer beside its K/V (`CcaMixer`, a `StateMixer`: the convolutions' last inputs and
  the previous token's delayed value, by row of the persistent batch, snapshot with prefix caching);
- the MLP experts one a token, picked by a router MLP (projection, RMSNorm, two GELU layers, the logits of the
  experts and of a skip class) over the softmax plus a balancing bias (float32); the skip class adds nothing; the
  router's projected input, plus the previous layer's times a scale, passes to the next layer;
- a float32 residual stream: the embeddings scaled and biased, and around each sublayer (output + b) x s + (stream +
  b') x s' (`ResidualScaling`), the norms reading it in the model's dtype.
One rank (`CcaShape.split_error`).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm
from engine.layers.gated_delta_net import StateMixer
from engine.model import Attention, LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.granite import with_layer_rope
from engine.models.hybrid import StatefulForCausalLM
from engine.models.qwen3_moe import SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from engine.zaya_config import CcaShape
from kernels import AttentionMetadata, fused, gated_delta
from kernels.pieces import Pieces
from kernels.qsa import turn_part

__all__ = ["CcaAttention", "ZayaForCausalLM"]


class CcaMixer(StateMixer):
    """The per-sequence state of a CCA layer (the module docstring) through `StateMixer.scan`: its input the
    concatenated q and k projections, its per-token extra the delayed value projection; its output the two
    convolutions' [T, channels] beside the previous token's delayed value [T, value half]."""

    def __init__(self, shape: CcaShape, layer: int) -> None:
        super().__init__()
        self.shape, self.layer = shape, layer
        c = shape.channels
        self.conv_qk_depthwise = nn.Conv1d(c, c, shape.time0, groups=c)
        self.conv_qk_grouped = nn.Conv1d(c, c, shape.time1, groups=shape.heads + shape.kv_heads)

    def _convolve(self, window: torch.Tensor) -> torch.Tensor:
        return self.conv_qk_grouped(self.conv_qk_depthwise(window))

    def convolve(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([conv.to(x.dtype), x.t()], dim=1)                  # [channels, taps + tokens]
        return self._convolve(window[None])[0].t(), window[:, window.shape[1] - conv.shape[1]:]

    def convolve_step(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([conv.to(x.dtype), x.unsqueeze(-1)], dim=-1)       # [seqs, channels, taps + 1]
        return self._convolve(window)[..., -1], window[..., 1:]

    def step(self, x, extras, ssm):
        """One token of many sequences: the previous token's delayed value is the state; this token's the new one."""
        delayed = extras[0]
        return torch.cat([x, ssm.to(x.dtype)], dim=-1), delayed.float()

    def chunk(self, x, extras, ssm):
        delayed = extras[0]
        previous = torch.cat([ssm.to(x.dtype)[None], delayed[:-1]])
        return torch.cat([x, previous], dim=-1), delayed[-1].float()

    scans_pieces = True

    def convolve_pieces(self, x: torch.Tensor, conv: torch.Tensor, pieces: Pieces
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several sequences' inputs through both convolutions as one call over a flat window."""
        return gated_delta.windows_pieces(x, conv, pieces, self._convolve)

    def chunk_pieces(self, x, extras, ssm, pieces):
        """Each token beside the previous token's delayed value (a sequence's first beside its state); the state after
        each part its last token's."""
        delayed = extras[0]
        previous, last = pieces.previous_table(x.device)
        held = torch.cat([ssm.to(x.dtype), delayed]).index_select(0, previous)
        return torch.cat([x, held], dim=-1), delayed.index_select(0, last).float()


class CcaAttention(Attention):
    """The module docstring's attention: q_proj, k_proj, v_proj_current, v_proj_delayed (this layer's own, not the
    fused qkv_proj), the CCA state layer (`qkv_proj`, transformers' name for it), the key temperatures
    (`qk_norm.temp`), o_proj."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int,
                 state_index: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer)
        s, h = config.state_layers, config.hidden_size
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.shape, self.sliding_window = s, s.windows[layer]
        self.qkv_proj = CcaMixer(s, state_index)
        self.qkv_proj.q_proj = nn.Linear(h, q, bias=False)
        self.qkv_proj.k_proj = nn.Linear(h, kv, bias=False)
        self.qkv_proj.v_proj_current = nn.Linear(h, kv // 2, bias=False)
        self.qkv_proj.v_proj_delayed = nn.Linear(h, kv // 2, bias=False)
        self.qk_norm = nn.Module()
        self.qk_norm.temp = nn.Parameter(torch.empty(s.kv_heads))

    def forward(self, hidden: torch.Tensor, turn: torch.Tensor, caches: tuple, meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """turn: the rotary cache's rows at the step's positions; caches: (this layer's K/V, the model's states)."""
        s, p = self.shape, self.qkv_proj
        groups, d = s.heads // s.kv_heads, s.head_dim
        queries, keys = p.q_proj(hidden), p.k_proj(hidden)
        q_res = (queries.unflatten(-1, (s.heads, d)) + keys.unflatten(-1, (s.kv_heads, d)).repeat_interleave(
            groups, dim=1)) * 0.5
        k_res = q_res.unflatten(1, (s.kv_heads, groups)).mean(dim=2)
        mixed = p.scan(torch.cat([queries, keys], dim=-1), (p.v_proj_delayed(hidden),), meta, caches[1])
        convolved, previous = mixed.split([s.channels, mixed.shape[-1] - s.channels], dim=-1)
        q = convolved[:, :s.heads * d].unflatten(-1, (s.heads, d)) + q_res
        k = convolved[:, s.heads * d:].unflatten(-1, (s.kv_heads, d)) + k_res
        v = torch.cat([p.v_proj_current(hidden), previous], dim=-1).unflatten(-1, (s.kv_heads, d))
        q, k = _unit(q, d), _unit(k, d) * self.qk_norm.temp[None, :, None]
        q, k = turn_part(q, turn, self.config.rotary_dim), turn_part(k, turn, self.config.rotary_dim)
        out = self.attend(q, k.contiguous(), v.contiguous(), caches[0], meta, backend)
        return self.o_proj(out.reshape(-1, self.q_size))


def _unit(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x times sqrt(head_dim) over its L2 norm (at least the dtype's epsilon), in x's dtype (`ZayaQKNorm`)."""
    return x * (head_dim ** 0.5 / x.norm(p=2, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).eps))


class ResidualScaling(nn.Module):
    """(out + b) x s + (stream + b') x s': a sublayer's output joining the float32 stream."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            setattr(self, name, nn.Parameter(torch.empty(hidden)))

    def forward(self, out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        return (out + self.hidden_states_bias) * self.hidden_states_scale + \
            (stream + self.residual_bias) * self.residual_scale


class ZayaMoeBlock(SparseMoeBlock):
    """The experts (Qwen3-MoE's, one a token) under ZAYA's router (the module docstring): `gate.down_proj`,
    `gate.router_states_scale` (past the first layer), `gate.router_mlp` and `gate.balancing_biases`."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType,
                 first: bool) -> None:
        super().__init__(config, shard, comm, ops)
        s, h, r = config.state_layers, config.hidden_size, config.state_layers.router
        self.gate = nn.Module()
        self.gate.down_proj = nn.Linear(h, r)
        self.gate.router_states_scale = None if first else nn.Parameter(torch.empty(r))
        mlp = self.gate.router_mlp = nn.Module()
        mlp.norm = RMSNorm(r, config.rms_norm_eps)
        mlp.fc1, mlp.fc2, mlp.out_proj = nn.Linear(r, r), nn.Linear(r, r), nn.Linear(r, s.experts + 1, bias=False)
        self.gate.balancing_biases = nn.Parameter(torch.empty(s.experts + 1), requires_grad=False)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (the picked expert's output times its probability, the router state for the next
        layer)."""
        g = self.gate
        routed = g.down_proj(x)
        if g.router_states_scale is not None and state is not None:
            routed = routed + state * g.router_states_scale
        m = g.router_mlp
        probs = torch.softmax(m.out_proj(F.gelu(m.fc2(F.gelu(m.fc1(m.norm(routed)))))), dim=-1)
        picked = torch.topk(probs.float() + g.balancing_biases.float(), 1, dim=-1).indices
        weights = probs.gather(-1, picked)
        skip = picked == self.num_experts
        weights, picked = weights.masked_fill(skip, 0), picked.masked_fill(skip, 0)
        return self.comm.all_reduce(self._experts(x, weights, picked)), routed


class ZayaLayer(nn.Module):
    """One layer: the input norm, CCA attention, its residual scaling, the post-attention norm, the routed experts,
    theirs; the stream float32, the norms reading it in the model's dtype."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, ops: ModuleType,
                 layer: int, state_index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = CcaAttention(config, shard, comm, rotary_emb, layer, state_index)
        self.mlp = ZayaMoeBlock(config, shard, comm, ops, first=layer == 0)
        self.post_attention_residual_scale, self.post_mlp_residual_scale = ResidualScaling(h), ResidualScaling(h)

    def forward(self, stream: torch.Tensor, router: torch.Tensor | None, turn: torch.Tensor, caches: tuple,
                meta: AttentionMetadata, backend) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.input_layernorm.weight.dtype
        out = self.self_attn(self.input_layernorm(stream.to(dtype)), turn, caches, meta, backend)
        stream = self.post_attention_residual_scale(out, stream)
        out, router = self.mlp(self.post_attention_layernorm(stream.to(dtype)), router)
        return self.post_mlp_residual_scale(out, stream), router


class ZayaForCausalLM(StatefulForCausalLM):
    """ZAYA1 (the module docstring): the Llama model's loading and head over CCA layers and their states."""

    @property
    def graph_safe(self) -> bool:
        """CUDA graphs capture it when every layer's experts run the Triton kernels (the loop reads which experts are
        hit; the router and the CCA state's decode rows read nothing)."""
        return all(layer.mlp.fused_moe is not None for layer in self.layers)

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        self.input_hidden_states_scale = nn.Parameter(torch.empty(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.empty(config.hidden_size))

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = ZayaLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index, self.state_index[index])
        return with_layer_rope(self, layer, index, ops)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        self.prepare_states(meta)
        embedded = self.embed(input_ids)
        stream = ((embedded + self.input_hidden_states_bias) * self.input_hidden_states_scale).float()
        turns: dict[int, torch.Tensor] = {}   # each rotary's rows at the step's positions
        router = None
        for layer, cache in zip(self.layers, kv_caches):
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in turns:
                turns[id(rotary)] = rotary.cos_sin_cache.index_select(0, positions)
            stream, router = layer(stream, router, turns[id(rotary)], (cache, self.states), meta, backend)
        return self.norm(stream.to(self.embed_tokens.weight.dtype))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The experts stacked (transformers' `gate_up_proj` [experts, 2 x inter, hidden], `down_proj`) as our w13 /
        w2; the skip class's balancing bias -1, as transformers sets it at load whatever the checkpoint stores;
        anything else as named."""
        if name.endswith(".mlp.gate.balancing_biases") and tensor.device.type != "meta":
            tensor = tensor.clone()
            tensor[-1] = -1.0
        if name.endswith(".mlp.experts.gate_up_proj"):
            return ((name.replace(".experts.gate_up_proj", ".w13"), tensor),)
        if name.endswith(".mlp.experts.down_proj"):
            return ((name.replace(".experts.down_proj", ".w2"), tensor),)
        return LlamaForCausalLM.read_tensor(self, hf_name, name, tensor)
