"""Gemma 3n's text model (`Gemma3nForCausalLM`, and `Gemma3nForConditionalGeneration`'s language model: E2B, E4B;
config: `engine.gemma3n_config`). Its attention, per-layer inputs and shared K/V layers are Gemma 4's E models'
(`Gemma4Attention`, `Gemma4ForCausalLM.per_layer_inputs`, `Gemma4Shape.kv_producer`); what is its own:

- AltUp: the residual stream is `streams` streams ([streams, tokens, hidden]), the first made from the scaled
  embeddings, the others projections of them scaled to their magnitude. A layer predicts each stream as itself plus a
  mix of all, by coefficients from a router over the active (first) stream (`AltUp.predict`), runs its attention and
  MLP on the active prediction, then corrects each stream by the innovation (its output less the active prediction)
  times coefficients of its own (`AltUp.correct`); the corrected active stream, scaled, gates the layer's per-layer
  input, which is projected, normed and added to every other stream. The model's output is the mean of the first
  stream and the others projected back, each scaled to the first's magnitude, then normed;
- LAuReL: the normed active prediction plus a normed low-rank projection of it, added to the attention's output
  (their sum over sqrt 2) before the MLP;
- activation sparsity: on the first layers, the MLP's gate less its mean plus the normal quantile of the layer's
  share times its standard deviation, clamped at 0, before GELU-tanh.
It runs on the module path; under tensor parallelism its attention and MLP are cut as Gemma 4's, the sparse gates'
statistics summed over the ranks (`SparseGateMLP`), AltUp, LAuReL and the per-layer inputs whole on every rank.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import FloatRMSNorm, RopeRows, RotaryEmbedding
from engine.model import MLP
from engine.model_config import ModelConfig
from engine.models.gemma4 import Gemma4Attention, Gemma4ForCausalLM, proportional_rotary
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused

__all__ = ["Gemma3nForCausalLM"]


def _to_magnitude(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x scaled to the root-mean-square `target` (its own floored at sqrt 1e-5), as transformers scales the streams."""
    return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


class AltUp(nn.Module):
    """A layer's AltUp (module docstring): its router (a norm, a projection to one logit a stream, tanh), the
    coefficients that predict each stream from all (`prediction_coefs`) and that correct each by the innovation
    (`correction_coefs`), and the scale of the corrected active stream (`correct_output_scale`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, n = config.hidden_size, config.gemma3n.streams
        self.correct_output_scale = nn.Parameter(torch.empty(h))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(h, n, bias=False)
        self.router_norm = FloatRMSNorm(h, config.rms_norm_eps)
        self.streams, self.root = n, 1.0 / h

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.modality_router(self.router_norm(x) * self.root).float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: [n, tokens, hidden] -> each stream plus its mix of all by the active stream's coefficients."""
        n = self.streams
        coefs = self.prediction_coefs(self.modalities(streams[0])).view(-1, n, n)   # [tokens, out, in]
        return (torch.einsum("toi,ith->oth", coefs, streams) + streams).type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Each prediction plus the innovation (`activated` less the active prediction) times its coefficient."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0   # [tokens, n]
        innovation = activated - predictions[0]
        return (innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions).type_as(activated)


class SparseGateMLP(MLP):
    """The Llama MLP through GELU-tanh whose gate, on a sparse layer, keeps what lies above its mean plus `cutoff`
    standard deviations (transformers' `_gaussian_topk`: the normal quantile of the layer's share, in float32), both
    over the whole intermediate size: under tensor parallelism the ranks' sums of it, then of its squared deviations,
    are summed (on one rank torch's mean and standard deviation, as transformers takes them)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType,
                 sparsity: float) -> None:
        super().__init__(config, shard, comm, ops)
        self.ranks, self.width = shard.size, config.intermediate_size
        share = torch.tensor(sparsity, dtype=torch.float32, device="cpu")   # as `Normal(0, 1).icdf` in float32
        self.cutoff = None if sparsity <= 0 else float(torch.erfinv(2 * share - 1) * math.sqrt(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.cutoff is not None:
            gate = F.relu(gate - self._cut(gate))
        return self.comm.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


    def _cut(self, gate: torch.Tensor) -> torch.Tensor:
        """Each row's mean plus `cutoff` standard deviations over the whole intermediate size."""
        if self.ranks == 1:
            return gate.mean(dim=-1, keepdim=True) + gate.std(dim=-1, keepdim=True, unbiased=False) * self.cutoff
        mean = self.comm.all_reduce(gate.sum(dim=-1, keepdim=True)) / self.width
        var = self.comm.all_reduce((gate - mean).pow(2).sum(dim=-1, keepdim=True)) / self.width
        return mean + var.sqrt() * self.cutoff


class Gemma3nDecoderLayer(nn.Module):
    """One Gemma 3n block (module docstring): streams in, streams out."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, layer: int) -> None:
        super().__init__()
        h, eps, g = config.hidden_size, config.rms_norm_eps, config.gemma3n
        per_layer = config.gemma4.per_layer_input_size
        self.input_layernorm = FloatRMSNorm(h, eps)
        self.self_attn = Gemma4Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = FloatRMSNorm(h, eps)
        self.pre_feedforward_layernorm = FloatRMSNorm(h, eps)
        self.mlp = SparseGateMLP(config, shard, comm, ops, g.gate_sparsity[layer])
        self.post_feedforward_layernorm = FloatRMSNorm(h, eps)
        self.altup = AltUp(config)
        self.laurel = nn.Module()
        self.laurel.linear_left = nn.Linear(h, g.laurel_rank, bias=False)
        self.laurel.linear_right = nn.Linear(g.laurel_rank, h, bias=False)
        self.laurel.post_laurel_norm = FloatRMSNorm(h, eps)
        self.per_layer_input_gate = nn.Linear(h, per_layer, bias=False)
        self.per_layer_projection = nn.Linear(per_layer, h, bias=False)
        self.post_per_layer_input_norm = FloatRMSNorm(h, eps)
        self.correct_scale = g.correct_scale

    def forward(self, streams: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend, per_layer_input: torch.Tensor) -> torch.Tensor:
        """streams: [n, num_tokens, hidden]; `per_layer_input` [num_tokens, per-layer size] -> the corrected streams."""
        predictions = self.altup.predict(streams)
        active = predictions[0]
        normed = self.input_layernorm(active)
        laurel = self.laurel
        laurel_out = normed + laurel.post_laurel_norm(laurel.linear_right(laurel.linear_left(normed)))
        attn = self.post_attention_layernorm(self.self_attn(normed, rope_rows, kv_cache, meta, backend))
        x = (active + attn + laurel_out) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[0]
        if self.correct_scale:
            first = (first.type_as(self.altup.correct_output_scale) * self.altup.correct_output_scale).type_as(first)
        gated = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer_input
        added = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return torch.cat([corrected[:1], corrected[1:] + added], dim=0)


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text model (module docstring): Gemma 4's embeddings, per-layer inputs, shared K/V and head, its own
    layers, the streams' projections into the model (`altup_projections`) and out of it
    (`altup_unembed_projections`)."""

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        h, n = config.hidden_size, config.gemma3n.streams
        self.altup_projections = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n - 1))
        self.altup_unembed_projections = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n - 1))

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Gemma3nDecoderLayer(self.config, self.shard, self.comm, proportional_rotary(self, index, ops), ops,
                                   index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden)
        target = torch.mean(hidden ** 2, dim=-1, keepdim=True) ** 0.5
        streams = torch.stack([hidden, *(_to_magnitude(p(hidden), target) for p in self.altup_projections)])
        rows: dict[int, RopeRows] = {}   # the step's cos/sin, once per rotary
        for i, layer in enumerate(self.layers):
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in rows:
                rows[id(rotary)] = rotary.rows(positions)
            streams = layer(streams, rows[id(rotary)], kv_caches[self.kv_cache_of[i]], meta, backend, per_layer[:, i])
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        out = [streams[0], *(_to_magnitude(p(s), target) for p, s in zip(self.altup_unembed_projections, streams[1:]))]
        return self.norm(torch.stack(out).mean(dim=0))

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs, an id past the per-layer table (an image's or audio's token) reading its row 0
        (transformers' `get_per_layer_inputs`)."""
        inside = (input_ids >= 0) & (input_ids < self.config.gemma4.per_layer_vocab_size)
        return super().per_layer_inputs(torch.where(inside, input_ids, 0), embeds)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """`LlamaForCausalLM.init_random`, AltUp's output scales 1."""
        super().init_random(seed, std)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("correct_output_scale"):
                    param.fill_(1.0)
