"""MiniMax-Text-01 and MiniMax-M1 (`MiniMaxForCausalLM`; the releases' `MiniMaxText01ForCausalLM` and
`MiniMaxM1ForCausalLM`; their config: `engine.minimax_config`): lightning attention layers over a state per sequence
(`LightningAttention`) between grouped-query attention layers, Mixtral's experts on every layer.

- Lightning attention: q, k and v of each head side by side in one projection, through SiLU; the unnormalised linear
  attention of `kernels.lightning`, each head's state decaying at its own fixed rate (`LightningShape.slopes`); the
  output RMS-normed over all the heads at once (Llama's order: the row rounded, then the weight), times the sigmoid of
  `output_gate`, then `out_proj`. Under tensor parallelism each rank holds its heads: their rows of `qkv_proj` and
  `output_gate`, their slice of the norm (whose sum of squares is summed over the ranks), their columns of `out_proj`
  (summed over the ranks).
- The full attention layers are Llama's, a partial rotary where the release's config says `rotary_dim`.
- Each sublayer is joined to the stream DeepNorm's way (`MiniMaxLayer`): its normed input x alpha + its output x beta
  becomes the stream, which the next norm reads (post-norm); the sums fused into the norms that follow them.

The releases' names: a lightning layer's modules sit under `self_attn` (read as `linear_attn`), the experts under
`block_sparse_moe` (Mixtral's `w1` / `w3` / `w2`); transformers' as the model's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm, RopeRows
from engine.layers.gated_delta_net import RecurrentStates, StateMixer
from engine.minimax_config import LightningShape
from engine.model import MLP, Attention
from engine.models.hybrid import StatefulForCausalLM, cut_pieces
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import RoundedWideRMSNorm
from engine.models.qwen3_moe import with_experts
from engine.parallel import Collectives
from kernels import AttentionMetadata, lightning
from kernels.pieces import Pieces

__all__ = ["LightningAttention", "MiniMaxForCausalLM", "MiniMaxLayer"]

DECAY_BUFFERS = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")
NORM_EPS = 1e-6   # the output norm's (transformers' MiniMaxRMSNorm default; the model's rms_norm_eps is not it)


class LightningAttention(StateMixer):
    """One lightning attention layer (the module docstring). `shape`: this rank's heads; `slope_values`: their decay
    rates, held as a float32 tensor on the model's device once the first forward runs there."""

    def __init__(self, shape: LightningShape, hidden_size: int, layer: int, num_layers: int, state_index: int,
                 rank: int = 0, comm: Collectives | None = None) -> None:
        super().__init__()
        self.shape, self.layer = shape, state_index
        self.comm = comm or Collectives()
        n = shape.width
        self.qkv_proj = nn.Linear(hidden_size, 3 * n, bias=False)
        self.output_gate = nn.Linear(hidden_size, n, bias=False)
        self.out_proj = nn.Linear(n, hidden_size, bias=False)
        heads = shape.total_heads or shape.num_heads
        self.norm = RoundedWideRMSNorm(shape.num_heads, shape.head_dim, NORM_EPS, self.comm, heads, 1)
        self.slope_values = shape.slopes(layer, num_layers, rank)
        self._slopes: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size];
        each sequence's state read from and written back to its row."""
        out = self.scan(F.silu(self.qkv_proj(hidden)), (), meta, states).to(hidden.dtype)   # [tokens, heads, dim]
        self.norm(out)
        gated = out.flatten(1) * torch.sigmoid(self.output_gate(hidden))
        return self.comm.all_reduce(self.out_proj(gated))

    def slopes(self, device: torch.device) -> torch.Tensor:
        if self._slopes is None or self._slopes.device != device:
            self._slopes = torch.tensor(self.slope_values, dtype=torch.float32, device=device)
        return self._slopes

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.shape.head_dim
        return x.unflatten(-1, (self.shape.num_heads, 3 * d)).split(d, dim=-1)

    def convolve(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, conv   # no convolution: its state is empty

    def convolve_step(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, conv

    def step(self, x, extras, ssm):
        return lightning.recurrent_step(*self._split(x), self.slopes(x.device), ssm)

    def chunk(self, x, extras, ssm):
        return lightning.chunked(*self._split(x), self.slopes(x.device), ssm)

    scans_pieces = True

    def convolve_pieces(self, x: torch.Tensor, conv: torch.Tensor, pieces: Pieces
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, conv.new_empty(pieces.num_parts, *conv.shape[1:])   # no convolution: its state is empty

    def chunk_pieces(self, x, extras, ssm, pieces):
        return lightning.chunked_pieces(*self._split(x), self.slopes(x.device), ssm, pieces)


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


class MiniMaxLayer(nn.Module):
    """A post-norm block: lightning attention (`linear_attn`) or attention (`self_attn`), then the experts, each
    sublayer's normed input x alpha + its output x beta the stream (the module docstring)."""

    def __init__(self, model: MiniMaxForCausalLM, index: int, ops: ModuleType) -> None:
        super().__init__()
        config, shard = model.config, model.shard
        h, eps, shape = config.hidden_size, config.rms_norm_eps, config.state_layers
        self.input_layernorm = RMSNorm(h, eps, ops)
        if config.is_linear_layer(index):
            self.linear_attn = LightningAttention(shape.per_rank(shard.size), h, index, config.num_layers,
                                                  model.state_index[index], shard.rank, model.comm)
        else:
            self.self_attn = Attention(config, shard, model.comm, model.rotary_emb, index)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = MLP(config, shard, model.comm, ops)
        self.mixer_scales = shape.scales(config.layer_types[index])
        self.mlp_scales = shape.scales("mlp")

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows | None,
                cache: tuple[torch.Tensor, torch.Tensor] | RecurrentStates, meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: the previous layer's two scaled terms (the embeddings, residual None, for the first)
        -> this layer's two, which the next norm adds."""
        normed = self.input_layernorm(hidden) if residual is None else self.input_layernorm(hidden, residual)[0]
        mixer = getattr(self, "linear_attn", None)
        out = mixer(normed, meta, cache) if mixer is not None else \
            self.self_attn(normed, rope_rows, cache, meta, backend)
        alpha, beta = self.mixer_scales
        normed = self.post_attention_layernorm(_scaled(out, beta), _scaled(normed, alpha))[0]
        alpha, beta = self.mlp_scales
        return _scaled(self.mlp(normed), beta), _scaled(normed, alpha)


class MiniMaxForCausalLM(StatefulForCausalLM, MixtralForCausalLM):
    """MiniMax (the module docstring): `MiniMaxLayer`s over `StatefulForCausalLM`'s states, Mixtral's experts and
    names."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_experts(self, MiniMaxLayer(self, index, ops), index, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A lightning layer's `self_attn.` as `linear_attn.`, its decay buffers (transformers saves the slopes and
        the decays of its blocks, functions of the config) skipped; then Mixtral's names."""
        if name.endswith(DECAY_BUFFERS):
            return ()
        parts = name.split(".")
        if parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < self.config.num_layers \
                and self.config.is_linear_layer(int(parts[1])):
            name = name.replace(".self_attn.", ".linear_attn.")
        return super().read_tensor(hf_name, name, tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A lightning layer's part on this rank (its heads: rows of qkv_proj, whose heads each hold their q, k and v
        side by side, and of output_gate, the norm's slice, out_proj's columns); the rest as Mixtral's."""
        if self.shard.size == 1 or ".linear_attn." not in name:
            return super()._shard_of(hf_name, name, tensor)
        part = name.split(".linear_attn.")[1].split(".")[0]
        width = self.config.state_layers.width
        full = 3 * width if part == "qkv_proj" else width
        return cut_pieces(hf_name, tensor, 1 if part == "out_proj" else 0, [(full, 0, True)], self.shard.rank,
                          self.shard.size)
