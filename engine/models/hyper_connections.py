"""Hyper-connections: a residual stream of several streams a token, each sublayer reading a mix of them and writing
its output into each, the mixes one float32 projection of the streams a token (HY V4's independent ones:
`HyperConnection`, `HyperHead`, `written`; DeepSeek V4's manifold-constrained ones, whose mix of the streams is made
doubly stochastic by Sinkhorn-Knopp steps: `SinkhornConnection`, `SinkhornHead`, `mixed`). Their parameters are whole
on every rank of a tensor-parallel group (so are the streams: every sublayer's output is summed over the ranks first)
and held in float32, as transformers holds them (`float32_parameters`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.deepseek_v4_config import DeepseekV4Shape
from engine.hy_v4_config import HyperConnections

__all__ = ["HyperConnection", "HyperHead", "SinkhornConnection", "SinkhornHead", "mixed", "written"]


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its RMS (a norm without weight), the scale in x's dtype."""
    return x * _inverse_rms(x.float(), eps).to(x.dtype)


def _inverse_rms(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, 1]: 1 / RMS of each row of the flattened float32 streams (transformers' `HYV4UnweightedRMSNorm`)."""
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One sublayer's mix of the streams (the module docstring): `fn` [2 x streams, streams x hidden], `base`
    [2 x streams], `scale` [2], in float32 (`engine.models.build_model` reads `float32_parameters`)."""

    float32_parameters = True

    def __init__(self, hyper: HyperConnections, hidden: int, norm_eps: float) -> None:
        super().__init__()
        n = hyper.streams
        self.streams, self.magnitude, self.eps, self.norm_eps = n, hyper.magnitude, hyper.eps, norm_eps
        self.fn = nn.Parameter(torch.empty(2 * n, n * hidden))
        self.base = nn.Parameter(torch.empty(2 * n))
        self.scale = nn.Parameter(torch.empty(2))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, streams, hidden] -> (each stream's post weight [T, streams] float32, the sublayer's input
        [T, hidden] in the streams' dtype)."""
        n, flat = self.streams, streams.flatten(1).float()
        mixes = F.linear(flat, self.fn) * _inverse_rms(flat, self.norm_eps)
        pre = torch.sigmoid(mixes[:, :n] * self.scale[0] + self.base[:n]) + self.eps
        post = self.magnitude * torch.sigmoid(mixes[:, n:] * self.scale[1] + self.base[n:]) + self.eps
        return post, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperHead(nn.Module):
    """The last mix, before the final norm: `hc_fn` [streams, streams x hidden], `hc_base` [streams], `hc_scale` [1],
    in float32."""

    float32_parameters = True

    def __init__(self, hyper: HyperConnections, hidden: int, norm_eps: float) -> None:
        super().__init__()
        n = hyper.streams
        self.eps, self.norm_eps = hyper.eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(1).float()
        mixes = F.linear(flat, self.hc_fn) * _inverse_rms(flat, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def written(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each stream plus the sublayer's output times its post weight, in float32, rounded to the streams' dtype."""
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class SinkhornConnection(nn.Module):
    """One sublayer's streams mix (the module docstring): `fn` [(2 + n) n, n x hidden], `base`, `scale` [3], float32."""

    float32_parameters = True

    def __init__(self, s: DeepseekV4Shape, hidden: int, eps: float) -> None:
        super().__init__()
        n = s.streams
        self.n, self.iters, self.hc_eps, self.eps = n, s.sinkhorn_iters, s.hc_eps, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the sublayer's input [T, hidden])."""
        n = self.n
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.eps), self.fn)
        pre = torch.sigmoid(mixes[:, :n] * self.scale[0] + self.base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[:, n:2 * n] * self.scale[1] + self.base[n:2 * n])
        comb = torch.softmax(mixes[:, 2 * n:].view(-1, n, n) * self.scale[2] + self.base[2 * n:].view(n, n), dim=-1)
        comb = comb + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SinkhornHead(nn.Module):
    """The head's mix of the streams: `hc_fn` [n, n x hidden], `hc_base` [n], `hc_scale` [1], float32."""

    float32_parameters = True

    def __init__(self, s: DeepseekV4Shape, hidden: int, eps: float) -> None:
        super().__init__()
        self.hc_eps, self.eps = s.hc_eps, eps
        self.hc_fn = nn.Parameter(torch.empty(s.streams, s.streams * hidden))
        self.hc_base = nn.Parameter(torch.empty(s.streams))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mixed(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """comb^T x streams + post x out, in the streams' dtype (transformers' order)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
