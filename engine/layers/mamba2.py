"""Mamba-2, the state layer of Granite 4's -H models (`GraniteMoeHybridForCausalLM` with `mamba` layers), over the
per-sequence states of `engine.layers.gated_delta_net` (its rows plumbing: `StateMixer`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.mamba_config import Mamba2Shape
from engine.parallel import Collectives
from engine.layers.gated_delta_net import RecurrentStates, StateMixer
from kernels import AttentionMetadata, ssd


class GroupGatedRMSNorm(nn.Module):
    """x times SiLU(gate), then RMS-normed over each of `groups` equal groups of channels, times weight, in
    transformers' order of roundings (`GraniteMoeHybridRMSNormGated`: the gate first, float32 throughout); where not
    `gate_first`, x normed first and the result times SiLU(gate) (Falcon-H1's `mamba_norm_before_gate`)."""

    def __init__(self, dim: int, groups: int, eps: float, comm: Collectives | None = None, ranks: int = 1,
                 gate_first: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.gate_first = groups, eps, gate_first
        self.comm, self.ranks = comm or Collectives(), ranks   # ranks: those one group spans (its sums added)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [num_tokens, dim] -> in the weight's dtype
        gated = (x.float() * F.silu(gate.float()) if self.gate_first else x.float()).unflatten(-1, (self.groups, -1))
        if self.ranks == 1:
            mean = gated.pow(2).mean(-1, keepdim=True)
        else:   # a group spread over the ranks: the mean of its squares over all of them
            mean = self.comm.all_reduce(gated.pow(2).sum(-1, keepdim=True)) / (gated.shape[-1] * self.ranks)
        normed = (gated * torch.rsqrt(mean + self.eps)).flatten(-2)
        if self.gate_first:
            return self.weight * normed.to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)   # transformers': float32 until the end


class Mamba2Mixer(StateMixer):
    """One Mamba-2 layer, its checkpoint's names: in_proj (the gate, then x, B and C, then dt per head), the causal
    convolution over x, B and C, the SSD scan (`kernels.ssd`) from each sequence's state with D's skip, the
    group-gated norm, out_proj."""

    def __init__(self, shape: Mamba2Shape, hidden_size: int, eps: float, layer: int,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        s = self.shape = shape                   # this rank's heads (and groups) under tensor parallelism
        self.layer = layer                       # its index among the model's state layers (its state's)
        self.comm = comm or Collectives()        # out_proj's partial outputs summed over the ranks
        inter = s.intermediate_size
        self.in_proj = nn.Linear(hidden_size, inter + s.conv_dim + s.num_heads, bias=s.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(s.conv_dim)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_heads))
        self.D = nn.Parameter(torch.empty(s.num_heads))
        if s.gated_norm != "none":
            self.norm = GroupGatedRMSNorm(inter, s.n_groups, eps, self.comm, s.norm_ranks, s.gated_norm == "gate_first")
        self.out_proj = nn.Linear(inter, hidden_size, bias=s.has_out_bias)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size]."""
        s = self.shape
        gate, xbc, dt = self.in_proj(hidden).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        y = self.scan(xbc, (dt,), meta, states)                                    # [num_tokens, heads, head_dim]
        if s.gated_norm == "none":   # Falcon-H1's: in float32, as transformers' scan leaves y
            y = (y.flatten(1).float() * F.silu(gate.float())).to(hidden.dtype)
        else:
            y = self.norm(y.flatten(1).to(hidden.dtype), gate)
        return self.comm.all_reduce(self.out_proj(y))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        xs, B, C = x.split([s.intermediate_size, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        return (xs.unflatten(-1, (s.num_heads, s.head_dim)), B.unflatten(-1, (s.n_groups, s.d_state)),
                C.unflatten(-1, (s.n_groups, s.d_state)))

    def _parameters_of_scan(self) -> tuple[torch.Tensor, torch.Tensor]:
        return -torch.exp(self.A_log.float()), self.D

    def step(self, x, extras, ssm):
        xs, B, C = self._split(x)
        A, D = self._parameters_of_scan()
        return ssd.step(xs, extras[0], A, B, C, D, ssm)

    def chunk(self, x, extras, ssm):
        """A prefill chunk: dt clamped to `dt_limit` (a decode step's is not: mamba_ssm's kernels and transformers
        clamp the chunked scan's alone)."""
        xs, B, C = self._split(x)
        A, D = self._parameters_of_scan()
        return ssd.chunked(xs, extras[0].clamp(*self.shape.dt_limit), A, B, C, D, ssm)

    scans_pieces = True

    def chunk_pieces(self, x, extras, ssm, pieces):
        """Several sequences' prefill chunks at once (`StateMixer.scans_pieces`), dt clamped as `chunk` clamps it."""
        xs, B, C = self._split(x)
        A, D = self._parameters_of_scan()
        return ssd.chunked_pieces(xs, extras[0].clamp(*self.shape.dt_limit), A, B, C, D, ssm, pieces)
