"""NVIDIA's Dory (`DoryForCausalLM`; its config: `engine.dory_config`), an nGPT model whose middle layers run in loops:
- every norm is an L2 norm of no weight (`UnitNorm`: x / |x|, float32, one rounding); a layer normalizes its input, and
  each sublayer's normed output pulls the hidden state towards it at a learned rate a channel (h + |lambda x scale|
  (normed(out) - h));
- attention (`DoryAttention`): q and k heads normed to unit length before the rotary (a base by layer type), q then
  scaled per channel by (sqk x scale)^2, sliding or full by layer; the output gated by sigmoid(gate x (s_gate x
  scale)^2) (its `gate_proj` read into qkv_proj's last rows) and normed over all heads before o_proj;
- the MLP (`DoryMLP`): gate and up scaled per row by `suv_gate` / `suv_up` x sqrt(hidden), SiLU(gate) x up normed over
  all rows before down_proj;
- the head's logits times a learned scale a token, in float32.
The loops are unrolled into virtual layers (`DoryShape.physical`: a checkpoint layer's module appears once a loop in
`layers`), each keeping its own K/V (transformers' per_loop cache), or with last_loop the earlier loops writing theirs
into the last loop's slots and attending to them before the last loop overwrites them (`DoryShape.kv_owner`); each loop
starts from its hidden state normed plus the input section's normed output. Under tensor parallelism each rank holds its
heads and MLP rows; the norms over all heads and rows add their sums of squares over the ranks. Checkpoints are read
under transformers' names or the release's (`backbone.`, each layer's attention block `layers.2i.mixer` and MLP block
`layers.2i+1.mixer`, the rates `attn_alpha` / `mlp_alpha`, `embeddings`, `g_proj`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RopeRows
from engine.model import Attention, LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.granite import with_layer_rope
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused

__all__ = ["DoryForCausalLM", "UnitNorm"]

_RELEASED_BLOCK = re.compile(r"^(?:backbone\.)?layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)")


def unit(x: torch.Tensor, comm: Collectives | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x over its L2 norm along the last dimension, in float32, rounded once to x's dtype (transformers'
    `DoryL2Norm`); `comm`: the rows are split over the ranks, their sums of squares added."""
    xf = x.float()
    squares = xf.pow(2).sum(-1, keepdim=True)
    if comm is not None and comm.size > 1:
        squares = comm.all_reduce(squares)
    return (xf * torch.rsqrt(squares + eps)).type_as(x)


class UnitNorm(nn.Module):
    """`unit` as a q/k head norm, in place over [T, heads, head_dim] (no weight)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()

    def forward(self, heads: torch.Tensor) -> None:
        heads.copy_(unit(heads))


class DoryAttention(Attention):
    """The module docstring's attention: qkv_proj's rows q, k, v, then the output gates (this rank's heads)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer, UnitNorm)
        s, d = config.dory, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.sqk = nn.Parameter(torch.empty(self.q_size))
        self.s_gate = nn.Parameter(torch.empty(self.q_size))
        self.sqk_scale, self.s_gate_scale = d ** 0.5 / s.init, config.hidden_size ** 0.25 / s.init

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.config.head_dim
        projected = self.qkv_proj(hidden)
        qkv = projected[:, :self.q_size + 2 * self.kv_size].unflatten(-1, (heads + 2 * kv_heads, d))
        self.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        q = q * (self.sqk * self.sqk_scale).square().view(heads, d)
        out = self.attend(q, k, v, kv_cache, meta, backend).reshape(-1, self.q_size)
        gate = projected[:, self.q_size + 2 * self.kv_size:] * (self.s_gate * self.s_gate_scale).square()
        return self.comm.all_reduce(self.o_proj(unit(out * torch.sigmoid(gate), self.comm)))


class DoryMLP(nn.Module):
    """The module docstring's MLP: column-parallel gate/up (this rank's rows) and their scales, row-parallel down."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives) -> None:
        super().__init__()
        rows, self.comm = shard.intermediate_size, comm
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * rows, bias=False)
        self.down_proj = nn.Linear(rows, config.hidden_size, bias=False)
        self.suv_gate = nn.Parameter(torch.empty(rows))
        self.suv_up = nn.Parameter(torch.empty(rows))
        self.suv_scale = config.hidden_size ** 0.5

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        gate, up = gate * (self.suv_gate * self.suv_scale), up * (self.suv_up * self.suv_scale)
        return self.comm.all_reduce(self.down_proj(unit(F.silu(gate) * up, self.comm)))


class DoryLayer(nn.Module):
    """One layer (a checkpoint layer's weights, run by every virtual layer of it): attention, then the MLP, each
    output normed and the hidden state pulled towards it at its rate (`lambda_1`, `lambda_2`)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__()
        self.self_attn = DoryAttention(config, shard, comm, rotary_emb, layer)
        self.mlp = DoryMLP(config, shard, comm)
        self.lambda_1 = nn.Parameter(torch.empty(config.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(config.hidden_size))
        self.lambda_scale = config.dory.alpha / config.dory.init

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        hidden = unit(hidden)
        out = unit(self.self_attn(hidden, rope_rows, kv_cache, meta, backend))
        hidden = hidden + (self.lambda_1 * self.lambda_scale).abs() * (out - hidden)
        hidden = unit(hidden)
        out = unit(self.mlp(hidden))
        return hidden + (self.lambda_2 * self.lambda_scale).abs() * (out - hidden)


class DoryForCausalLM(LlamaForCausalLM):
    """Dory (the module docstring): the Llama model's loading and cuts over unrolled layers."""

    supports_flat_forward = False

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        self._built: dict[int, nn.Module] = {}
        super().__init__(config, shard, comm, ops)
        self.logit_scale = nn.Parameter(torch.empty(config.vocab_size))
        kv = config.kv_layers   # each virtual layer's entry of the step's caches (its K/V's owner's)
        self.kv_slot = [kv.index(config.dory.kv_owner(v)) for v in range(config.num_layers)]

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        """Virtual layer `index`: its checkpoint layer's module, built at its first virtual layer."""
        layer = self.config.dory.physical(index)
        if layer not in self._built:
            built = DoryLayer(self.config, self.shard, self.comm, self.rotary_emb, index)
            self._built[layer] = with_layer_rope(self, built, index, ops)
        return self._built[layer]

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return nn.Identity()   # the last norm is `unit`, of no weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        s = self.config.dory
        hidden = self.embed(input_ids)
        rows: dict[int, RopeRows] = {}   # the step's cos/sin, once per rotary
        start, looped = None, range(s.inputs, s.inputs + s.loops * s.recurrent)
        for v, layer in enumerate(self.layers):
            if v in looped and (v - s.inputs) % s.recurrent == 0:   # a loop's first layer
                start = unit(hidden) if start is None else start
                hidden = unit(hidden) + start
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in rows:
                rows[id(rotary)] = rotary.rows(positions)
            hidden = layer(hidden, rows[id(rotary)], kv_caches[self.kv_slot[v]], meta, backend)
        return unit(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits (gathered over the ranks) in float32, times each token's scale."""
        return super().compute_logits(hidden).float() * (self.logit_scale.float() * (1 / self.config.dory.init))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's names as transformers' (the module docstring), then each checkpoint layer's as its first
        virtual layer's."""
        name = name.removeprefix("backbone.").replace("embeddings.", "embed_tokens.", 1)
        if (match := _RELEASED_BLOCK.match(name)) is not None:
            index, part = int(match[1]), match[2]
            ours = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(part, ("self_attn", "mlp")[index % 2])
            name = f"layers.{index // 2}.{ours}" + name[match.end():]
        name = name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")
        if name.startswith("lm_head.logit_scale"):
            return (("logit_scale", tensor),)
        head, sep, rest = name.partition(".")
        if head == "layers" and sep:
            index, _, rest = rest.partition(".")
            name = f"layers.{self.config.dory.first_virtual(int(index))}.{rest}"
        return ((name, tensor),)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The output gates into qkv_proj's last rows (this rank's heads)."""
        if ".self_attn.gate_proj." in name:
            q, kv = self.shard.num_heads * self.config.head_dim, self.shard.num_kv_heads * self.config.head_dim
            return name.replace(".gate_proj.", ".qkv_proj."), lambda data: data.narrow(0, q + 2 * kv, q)
        return super()._destination(name, hf_name)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The gates and the query scales as q_proj's rows, the MLP's row scales as gate_proj's; the rates and the
        logit scale whole; anything else as Llama's."""
        if self.shard.size == 1 or name in ("logit_scale",) or name.endswith(("lambda_1", "lambda_2")):
            return tensor
        for ours, theirs in ((".gate_proj.", ".q_proj."), (".sqk", ".q_proj.weight"), (".s_gate", ".q_proj.weight"),
                             (".suv_gate", ".gate_proj.weight"), (".suv_up", ".up_proj.weight")):
            if ours in name and (ours != ".gate_proj." or ".self_attn." in name):
                return super()._shard_of(hf_name, name.replace(ours, theirs), tensor)
        return super()._shard_of(hf_name, name, tensor)
