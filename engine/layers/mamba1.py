"""Mamba-1, the state layer of Jamba (`JambaForCausalLM`'s `mamba` layers) and of Mamba and FalconMamba (every layer's
mixer: `engine.models.mamba`), over the per-sequence states of
`engine.layers.gated_delta_net` (its rows plumbing: `StateMixer`; the shape: `engine.mamba1_config.Mamba1Shape`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import RMSNorm, rms_normed
from engine.mamba1_config import Mamba1Shape
from engine.parallel import Collectives
from engine.layers.gated_delta_net import RecurrentStates, StateMixer
from kernels import AttentionMetadata, selective_scan


class Mamba1Mixer(StateMixer):
    """One Mamba-1 layer, its checkpoint's names: in_proj (x, then the gate z), the causal convolution over x and
    SiLU, x_proj (dt's low-rank input, B, C; Jamba's and FalconMamba's norms on each), dt = softplus(dt_proj(...))
    per channel, the selective scan (`kernels.selective_scan`) from each sequence's state with D's skip, times SiLU(z),
    out_proj.

    Under tensor parallelism each rank holds its channels: in_proj's and dt_proj's rows, the convolution, A_log, D,
    x_proj's and out_proj's columns; x_proj's partial products are summed over the ranks (B, C and dt's input are
    every channel's), out_proj's after the layer (vLLM's split)."""

    def __init__(self, shape: Mamba1Shape, hidden_size: int, layer: int, comm: Collectives | None = None) -> None:
        super().__init__()
        s = self.shape = shape                   # this rank's channels under tensor parallelism
        self.layer = layer                       # its index among the model's state layers (its state's)
        self.comm = comm or Collectives()
        inter, n, r = s.intermediate_size, s.d_state, s.dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * inter, bias=s.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(inter, 1, s.conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(inter)) if s.conv_bias else None
        self.x_proj = nn.Linear(inter, r + 2 * n, bias=False)
        self.dt_proj = nn.Module()   # not a Linear: its product rounds to the model's dtype before its float32 bias
        self.dt_proj.weight = nn.Parameter(torch.empty(inter, r))
        self.dt_proj.bias = nn.Parameter(torch.empty(inter))
        self.A_log = nn.Parameter(torch.empty(inter, n))
        self.D = nn.Parameter(torch.empty(inter))
        if s.bcdt_norms == "weighted":
            self.dt_layernorm = RMSNorm(r, s.norm_eps)   # transformers' JambaRMSNorm: Llama's
            self.b_layernorm = RMSNorm(n, s.norm_eps)
            self.c_layernorm = RMSNorm(n, s.norm_eps)
        self.out_proj = nn.Linear(inter, hidden_size, bias=s.proj_bias)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size]."""
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        y = self.scan(x, (), meta, states)                                      # [num_tokens, channels] float32
        return self.comm.all_reduce(self.out_proj((y * F.silu(gate.float())).to(hidden.dtype)))

    def _selective(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolution's output [tokens, channels] -> the scan's inputs past x: dt float32 [tokens, channels]
        (x_proj, summed over the ranks, Jamba's or FalconMamba's norms, dt_proj's product in the model's dtype plus
        its bias in float32, softplus), A = -exp(A_log) float32, B, C [tokens, d_state], D."""
        s = self.shape
        low, B, C = self.comm.all_reduce(self.x_proj(x)).split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if s.bcdt_norms == "weighted":
            low, B, C = self.dt_layernorm(low), self.b_layernorm(B), self.c_layernorm(C)
        elif s.bcdt_norms == "weightless":
            low, B, C = (rms_normed(t, s.norm_eps) for t in (low, B, C))
        dt = F.softplus(F.linear(low, self.dt_proj.weight) + self.dt_proj.bias.float())
        return dt, -torch.exp(self.A_log.float()), B, C, self.D

    def step(self, x, extras, ssm):
        return selective_scan.step(x, *self._selective(x), ssm)

    def chunk(self, x, extras, ssm):
        return selective_scan.scan(x, *self._selective(x), ssm)

    scans_pieces = True

    def chunk_pieces(self, x, extras, ssm, pieces):
        return selective_scan.scan_pieces(x, *self._selective(x), ssm, pieces)
