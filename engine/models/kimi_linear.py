"""Moonshot's Kimi Linear (`KimiLinearForCausalLM`; its config: `engine.kimi_linear_config`): Kimi Delta Attention
layers over a state per sequence (`KimiDeltaAttention`) between DeepSeek V3's latent attention layers without a
rotary (their rope part is cached and dotted, never turned: `NoRope`), each MLP dense or DeepSeek V3's experts.

Kimi Delta Attention is the gated delta rule with a decay per key channel: q, k and v (each `linear_num_heads` heads
of `linear_head_dim`) through a causal convolution and SiLU; q and k L2-normed (q scaled by head_dim ** -0.5, in
`kernels.gated_delta`); the forget gate g = -exp(A_log) x softplus(f_b(f_a(x)) + dt_bias), a value per channel; beta =
sigmoid(b_proj(x)); then S = S x exp(g) row by row, S += k (beta (v - S^T k))^T, out = S^T q
(`kernels.gated_delta.chunked` for a prefill, Triton's on CUDA; `recurrent_step` a token at a time); the output
RMS-normed per head times sigmoid(g_b(g_a(x))), then o_proj. Under tensor parallelism each rank holds its heads: their
rows of q, k, v, the convolutions, f_b, g_b, dt_bias, A_log and b_proj, their columns of o_proj (summed over the
ranks); f_a, g_a and the norm whole.

The checkpoint's names: `block_sparse_moe` is each layer's MLP (its experts' `w1` / `w3` / `w2` gate / up / down, its
shared experts DeepSeek's), a KDA layer's modules sit under `self_attn` with separate `q_conv1d` / `k_conv1d` /
`v_conv1d` (read as one convolution's rows) and `A_log` shaped [1, 1, heads, 1].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.kimi_linear_config import KdaShape
from engine.layers.gated_delta_net import RecurrentStates, StateMixer
from engine.model import DecoderLayer, RotaryEmbedding
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.hybrid import MixerLayerForward, StatefulForCausalLM, cut_pieces
from engine.models.qwen3_moe import with_experts
from engine.models.smollm3 import NoRope
from engine.parallel import Collectives
from kernels import AttentionMetadata, gated_delta

__all__ = ["BailingHybridForCausalLM", "KimiDeltaAttention", "KimiLinearForCausalLM"]

_EXPERT_PARTS = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


class KimiDeltaAttention(StateMixer):
    """One Kimi Delta Attention layer (the module docstring), its checkpoint's names; `conv1d` the three
    convolutions' rows (q's, k's, v's); `dt_bias` in float32 whatever the model's dtype, as transformers holds it."""

    parameter_dtypes = {"dt_bias": torch.float32}   # `engine.models.build_model` allocates it so

    def __init__(self, shape: KdaShape, hidden_size: int, eps: float, layer: int,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        self.shape, self.layer, self.eps = shape, layer, eps   # shape: this rank's heads
        self.comm = comm or Collectives()   # o_proj's partial outputs summed over the ranks
        h, d, n = hidden_size, shape.head_dim, shape.qkv_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(h, n, bias=False) for _ in range(3))
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(3 * n, 1, shape.conv_kernel))
        if shape.full_rank:   # Ling 3's gates: one projection each
            self.f_proj, self.g_proj = nn.Linear(h, n, bias=False), nn.Linear(h, n, bias=False)
        else:
            self.f_a_proj, self.f_b_proj = nn.Linear(h, d, bias=False), nn.Linear(d, n, bias=False)
            self.g_a_proj, self.g_b_proj = nn.Linear(h, d, bias=False), nn.Linear(d, n, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(n))
        self.A_log = nn.Parameter(torch.empty(shape.num_heads))
        self.b_proj = nn.Linear(h, shape.num_heads, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(d))
        self.o_proj = nn.Linear(n, h, bias=False)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size];
        each sequence's state read from and written back to its row."""
        s = self.shape
        heads = (s.num_heads, s.head_dim)
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        g = self.forget_gate(hidden)                                             # [num_tokens, heads, head_dim]
        beta = self.b_proj(hidden).sigmoid()
        out = self.scan(mixed, (g, beta), meta, states).to(hidden.dtype).float()   # [num_tokens, heads, head_dim]
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        gate = self.g_proj(hidden) if s.full_rank else self.g_b_proj(self.g_a_proj(hidden))
        normed = normed * gate.unflatten(-1, heads).float().sigmoid()
        return self.comm.all_reduce(self.o_proj(normed.to(hidden.dtype).flatten(1)))

    def forget_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """g, a decay per channel of each head (float32): -exp(A_log) x softplus(f + dt_bias) (Kimi's, transformers'
        form of softplus), or Ling 3's bound x sigmoid(exp(A_log) x (f + dt_bias)), rounded to the model's dtype."""
        s = self.shape
        f = self.f_proj(hidden) if s.full_rank else self.f_b_proj(self.f_a_proj(hidden))
        gate = (f.float() + self.dt_bias.float()).unflatten(-1, (s.num_heads, s.head_dim))
        decay = self.A_log.float().exp()[:, None]
        if s.gate_bound is not None:
            g = s.gate_bound * torch.sigmoid(decay * gate)
        else:
            g = -decay * torch.where(gate > 20.0, gate, torch.log(1.0 + torch.exp(gate)))
        return g.to(hidden.dtype).float() if s.full_rank else g

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        return tuple(t.unflatten(-1, (s.num_heads, s.head_dim)) for t in x.split(s.qkv_dim, dim=-1))

    def step(self, x, extras, ssm):
        return gated_delta.recurrent_step(*self._split(x), *extras, ssm)

    def chunk(self, x, extras, ssm):
        return gated_delta.chunked(*self._split(x), *extras, ssm)

    scans_pieces = True

    @property
    def pieces_at_once(self) -> int | None:
        """Off CUDA a step's chunks four sequences a scan: torch's per-channel weights of a chunk are [heads, chunk,
        chunk, head_dim] float32 a sequence (64 MiB at Kimi Linear's 32 heads of 128), made for all of a scan's
        sequences at once. On CUDA the Triton kernels make them a row at a time: every sequence in one scan."""
        return None if self.A_log.is_cuda else 4

    def chunk_pieces(self, x, extras, ssm, pieces):
        return gated_delta.chunked_pieces(*self._split(x), *extras, ssm, pieces)


class KimiLinearLayer(MixerLayerForward, DecoderLayer):
    """A pre-norm layer whose token mixer is latent attention (`self_attn`) or Kimi Delta Attention
    (`linear_attn`, a state layer), then its MLP."""


class KimiLinearForCausalLM(StatefulForCausalLM, DeepseekForCausalLM):
    """Kimi Linear (the module docstring): DeepSeek V3's model and loading with KDA layers over
    `StatefulForCausalLM`'s states and no rotary."""

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        return NoRope()

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        config = self.config
        layer = with_experts(self, KimiLinearLayer(config, self.shard, self.comm, self.rotary_emb, ops, index),
                             index, ops)
        if config.is_linear_layer(index):
            del layer.self_attn
            layer.linear_attn = KimiDeltaAttention(self.state_shape(), config.hidden_size, config.rms_norm_eps,
                                                   self.state_index[index], self.comm)
        else:
            layer.self_attn = self.attention(config, self.shard, self.comm, self.rotary_emb, ops)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (the module docstring), then DeepSeek's reading."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." in name:
            for theirs, ours in _EXPERT_PARTS:
                name = name.replace(theirs, ours)
        parts = name.split(".")
        if parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < self.config.num_layers \
                and self.config.is_linear_layer(int(parts[1])):
            name = name.replace(".self_attn.", ".linear_attn.")
            if name.endswith(".A_log"):
                tensor = tensor.reshape(-1)   # [1, 1, heads, 1]
        return super().read_tensor(hf_name, name, tensor)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """q's, k's and v's convolutions into the rows of a KDA layer's one `conv1d`; the rest as DeepSeek's."""
        for i, conv in enumerate(_CONVS):
            if f".linear_attn.{conv}." in name:
                n = self.state_shape().qkv_dim   # this rank's
                return name.replace(conv, "conv1d"), lambda data, start=i * n: data.narrow(0, start, n)
        return super()._destination(name, hf_name)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A KDA layer's part on this rank (the module docstring: its heads' rows, o_proj's columns); the rest as
        DeepSeek's."""
        if self.shard.size == 1 or ".linear_attn." not in name:
            return super()._shard_of(hf_name, name, tensor)
        shape, part = self.config.state_layers, name.split(".linear_attn.")[1].split(".")[0]
        if part in ("f_a_proj", "g_a_proj", "o_norm"):
            return tensor
        per_head = 1 if part in ("A_log", "b_proj") else shape.head_dim
        n = shape.num_heads * per_head
        pieces = [(n, o, True) for o in (0, n, 2 * n)] if part == "conv1d" else [(n, 0, True)]   # q, k, v's together
        return cut_pieces(hf_name, tensor, 1 if part == "o_proj" else 0, pieces, self.shard.rank, self.shard.size)


# Ling 3's names (as the release stores them) -> Kimi Linear's
_BAILING_NAMES = (("word_embeddings.", "embed_tokens."), (".attention.", ".self_attn."),
                  (".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.forget_gate.", ".self_attn."),
                  (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """inclusionAI's Ling 3 (`BailingHybridForCausalLM`: Ling-3.0-Flash): Kimi Linear's model with Ling's KDA
    (`KdaShape.full_rank`, its bounded forget gate), latent attention that turns its rope (DeepSeek V3's rotary,
    interleaved pairs) and gates each head's output (`MlaAttention.g_proj`), and V3's grouped experts. Read under the
    release's names (`word_embeddings`, `attention`, `dense`, `expert_bias`) or transformers' (`forget_gate.`, one
    `conv1d` for q, k and v)."""

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        return DeepseekForCausalLM.make_rotary(self, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for theirs, ours in _BAILING_NAMES:
            name = name.replace(theirs, ours)
        return super().read_tensor(hf_name, name, tensor)
