"""Qwen4-Exp's text model (`Qwen4ExpForCausalLM`, and `Qwen4ExpForConditionalGeneration`'s language model; its
config: `engine.qwen4_exp_config`): Qwen3.5-MoE's layers (Gated DeltaNet over a per-sequence state, gated attention,
experts beside a gated shared expert) over a residual of several streams a token:
- the streams start as copies of the token's embedding; each sublayer reads their mix (`StreamMix`: the streams
  normed apart (1 + weight), a sigmoid gate a channel from a low-rank projection, the gated streams averaged) and
  adds its output into each stream times a weight in (0, 2); a last mix (`norm`, the checkpoint's
  `hyper_connection_mixer`) feeds the head. No other norm: the mixes' are the layers';
- the PLE layers (`PleLayer`) add to the streams, before their linear attention, an embedding of the token's
  n-grams: the token and the ones before it (an EOS or the sequence's start cuts the run) hashed into prime-sized
  tables, projected, gated by the streams, and a dilated depthwise convolution of it. Their state, each sequence's
  last tokens and convolution inputs, lives beside the linear layers' (`RecurrentStates.extra`), by row;
- every attention layer selects its tokens by QSA (`QsaAttention`, `kernels.qsa`): its indexer's key of each token
  is kept in the cache beside K/V (the cache's third tensor a layer, as MiniMax M3's); while no sequence of a step is
  longer than `QsaIndexer.dense_len` every token is chosen and the backend's paged attention runs, past it the torch
  selection. The step's lengths pick the path on the host, so the decode graphs hold the dense regime alone
  (`graph_max_len`).
Under tensor parallelism each rank holds its attention and linear-attention heads and its experts' rows; the mixes,
the indexers and the PLE layers are whole on every rank but their n-gram tables, whose columns the ranks split
(gathered after the lookup) where they divide a table's width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import GemmaHeadRMSNorm, RopeRows
from engine.layers.gated_delta_net import GatedDeltaNet, RecurrentStates
from engine.model import MLP, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.qwen3_5 import GatedAttention, Qwen3_5MoeForCausalLM
from engine.models.qwen3_moe import with_experts
from engine.parallel import Collectives, ShardShape
from engine.qwen4_exp_config import Qwen4ExpShape, layer_multipliers, ple_tables
from kernels import AttentionMetadata
from kernels.gated_delta import windows_pieces
from kernels.qsa import qsa_attention, turn_part

__all__ = ["PleLayer", "QsaAttention", "Qwen4ExpForCausalLM", "StreamMix"]

# the PLE tables' bookkeeping transformers saves beside them (checked against ours, not loaded)
_PLE_BUFFERS = {"layer_multipliers": "multipliers", "ngram_heads_vocab_sizes": "sizes",
                "ngram_heads_offsets": "offsets"}


class StreamNorm(nn.Module):
    """RMSNorm of each stream of [T, streams x hidden] apart, (1 + weight) over them all, in float32, one rounding
    (transformers' grouped `Qwen4ExpTextRMSNorm`)."""

    def __init__(self, streams: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.eps = hidden, eps
        self.weight = nn.Parameter(torch.zeros(streams * hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.hidden))
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class StreamMix(nn.Module):
    """A sublayer's view of the streams (the module docstring), and where `combine`, the weights its output joins
    each stream with; in the model's dtype, transformers' `Qwen4ExpTextGatedResidual` op for op."""

    def __init__(self, shape: Qwen4ExpShape, hidden: int, eps: float, combine: bool = True) -> None:
        super().__init__()
        self.streams, self.hidden = shape.streams, hidden
        wide = shape.streams * hidden
        self.hc_norm = StreamNorm(shape.streams, hidden, eps)
        self.input_mix_weight_down = nn.Linear(wide, shape.lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(shape.lowrank, wide, bias=False)
        self.block_inject_weight = nn.Linear(wide, shape.streams, bias=False) if combine else None

    def forward(self, streams: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """streams [T, streams x hidden] -> the sublayer's input [T, hidden] (and, where `combine`, the output's
        weight into each stream [T, streams])."""
        normed = self.hc_norm(streams)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.streams)))
        shape = (self.streams, self.hidden)
        mixed = (gate.unflatten(-1, shape) * normed.unflatten(-1, shape)).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.streams)

    @staticmethod
    def join(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The streams with a sublayer's output [T, hidden] added to each, times its weight [T, streams]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class PleStateShape:
    """A PLE layer's state a sequence: its convolution's last inputs [streams x hidden, (kernel - 1) x n-gram size]
    (model dtype) and its last n-gram size - 1 token ids (float32, `RecurrentStates`' recurrent tensor)."""

    conv_state_shape: tuple[int, int]
    ssm_state_shape: tuple[int]


class PleLayer(nn.Module):
    """One PLE layer (the module docstring; transformers' `Qwen4ExpTextPLELayer`): its n-gram table
    (`ple_embedding.ngram_embedding`, this rank's columns), projections, norms and convolution; `index` its place
    among the PLE layers (its tables' primes and hash multipliers), its state's too."""

    scans_pieces = True   # a step's longer pieces at once (`_pieces_at_once`); else each by itself

    def __init__(self, config: ModelConfig, index: int, shard: ShardShape, comm: Collectives) -> None:
        super().__init__()
        s = self.shape = config.qwen4_exp
        h, wide = config.hidden_size, s.streams * config.hidden_size
        self.index, self.hidden, self.comm = index, h, comm
        self.split = s.table_split(shard.size)   # the table's columns over the ranks
        self.ple_embedding = nn.Module()
        self.ple_embedding.ngram_embedding = nn.Embedding(s.table_rows(index), s.ple_head_dim // self.split,
                                                          _weight=torch.empty(s.table_rows(index),
                                                                              s.ple_head_dim // self.split))
        self.hashing = {"multipliers": layer_multipliers(s, config.vocab_size, index),
                        **dict(zip(("sizes", "offsets"), ple_tables(s, index)))}   # int64 lists
        self._hash_on: dict[torch.device, dict[str, torch.Tensor]] = {}
        self.key_proj = nn.Linear(s.ple_dim, wide, bias=False)
        self.value_proj = nn.Linear(s.ple_dim, h, bias=False)
        self.norm_key, self.norm_query, self.norm_conv = (StreamNorm(s.streams, h, config.rms_norm_eps)
                                                          for _ in range(3))
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(wide, 1, s.ple_kernel))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, meta: AttentionMetadata,
                states: RecurrentStates) -> torch.Tensor:
        """What the layer adds to the streams [T, streams x hidden] of the step's tokens `input_ids`, each
        sequence's state read from and written back to its row: the one-token pieces at once (beside longer ones
        too: `RecurrentStates.split`), the longer pieces at once (`RecurrentStates.pieces`, the linear layers'
        layout) where they are several parts."""
        if all(q == 1 for q in meta.query_lens_list):   # a decode step: one token a sequence, by row
            return self._decode(streams, input_ids, meta.rows, meta.seq_lens, states, None)
        split, lens = states.split, meta.query_lens_list
        if split is None:   # prefill pieces alone
            return self._pieces(streams, input_ids, meta, states, list(range(len(lens))))
        tokens, rest = split.tokens, split.order[len(split.seqs):]
        out = torch.cat([self._decode(streams.index_select(0, tokens), input_ids.index_select(0, tokens),
                                      meta.rows.index_select(0, split.index),
                                      meta.seq_lens.index_select(0, split.index), states, split.place),
                         self._pieces(streams.index_select(0, rest), input_ids.index_select(0, rest), meta, states,
                                      [i for i, q in enumerate(lens) if q > 1])])
        return torch.empty_like(out).index_copy_(0, split.order, out)

    def _decode(self, streams: torch.Tensor, input_ids: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                states: RecurrentStates, place: dict[int, int] | None) -> torch.Tensor:
        """One token of each sequence in `rows` (`seq_lens`: theirs); place: sequence -> its place here (None: the
        step's own order), for the snapshots a one-token piece takes."""
        tokens, conv = states.ssm[self.index], states.conv[self.index]
        keep = (seq_lens > 1).unsqueeze(-1)   # a 1-token prompt (a padded graph row too) starts afresh
        held = torch.where(keep, tokens.index_select(0, rows), float(self.shape.eos))
        history = torch.cat([held, input_ids[:, None].to(held.dtype)], dim=-1)             # [seqs, n]
        gated, normed = self._gated(streams, history.long())
        window = torch.cat([conv.index_select(0, rows) * keep.unsqueeze(-1), normed.unsqueeze(-1)], dim=-1)
        out = self._convolve(window)[..., -1]
        tokens.index_copy_(0, rows, history[:, 1:])
        conv.index_copy_(0, rows, window[..., 1:].to(conv.dtype))
        for seq, saves in states.saves.items():   # a 1-token piece ending on a snapshot's boundary
            if (i := seq if place is None else place.get(seq)) is not None:
                states.save(self.index, saves[0][1], window[i, :, 1:], history[i, 1:])
        return gated + out

    def _pieces(self, streams: torch.Tensor, input_ids: torch.Tensor, meta: AttentionMetadata,
                states: RecurrentStates, seqs: list[int]) -> torch.Tensor:
        """The pieces of sequences `seqs` (their tokens: `streams`, `input_ids`, in order), each from its row."""
        if self.scans_pieces and states.pieces is not None and states.pieces.pieces.num_parts > 1:
            return self._pieces_at_once(streams, input_ids, states)
        tokens, conv = states.ssm[self.index], states.conv[self.index]
        eos, n = float(self.shape.eos), self.shape.ngram
        pieces = [(seq, meta.rows_list[seq], meta.query_lens_list[seq], meta.seq_lens_list[seq]) for seq in seqs]
        histories, start = [], 0
        for _, row, q_len, seq_len in pieces:
            held = tokens[row].new_full((n - 1,), eos) if seq_len == q_len else tokens[row]
            histories.append(torch.cat([held, input_ids[start:start + q_len].to(held.dtype)]))
            start += q_len
        windows = torch.cat([history.unfold(0, n, 1) for history in histories])                 # [T, n]
        gated, normed = self._gated(streams, windows.long())
        outs, start = [], 0
        for (seq, row, q_len, seq_len), history in zip(pieces, histories):
            held = conv[row] if seq_len != q_len else torch.zeros_like(conv[row])
            window = torch.cat([held, normed[start:start + q_len].t().to(held.dtype)], dim=-1)   # [wide, L + q]
            outs.append(self._convolve(window[None])[0].t())
            width = conv.shape[-1]
            for offset, slot in states.saves.get(seq, ()):
                states.save(self.index, slot, window[:, offset:offset + width], history[offset:offset + n - 1])
            conv[row], tokens[row] = window[:, -width:], history[-(n - 1):]
            start += q_len
        return gated + torch.cat(outs)

    def _pieces_at_once(self, streams: torch.Tensor, input_ids: torch.Tensor, states: RecurrentStates
                        ) -> torch.Tensor:
        """The step's longer pieces at once (`RecurrentStates.pieces`: in parts ending at their snapshots): each
        token's n-gram, and the convolution, over one flat window of every piece's held state then its tokens
        (`gated_delta.windows_pieces`; a piece at position 0 from EOS and zeros); the states after every part and
        before the first written back by index."""
        at, pieces, n = states.pieces.tensors(), states.pieces.pieces, self.shape.ngram
        tokens, conv = states.ssm[self.index], states.conv[self.index]
        fresh = (at["held"] == states.zero_row).unsqueeze(-1)
        held = torch.where(fresh, float(self.shape.eos), tokens.index_select(0, at["held"]))        # [seqs, n - 1]
        windows, held_after = windows_pieces(input_ids.unsqueeze(-1).to(held.dtype), held.unsqueeze(1), pieces,
                                             lambda flat: flat.unfold(2, n, 1)[0].transpose(1, 2))   # [T, n]
        gated, normed = self._gated(streams, windows.long())
        conv_start = conv.index_select(0, at["held"])
        out, conv_after = windows_pieces(normed, conv_start, pieces, self._convolve)
        states.store_pieces(self.index, (conv_after, held_after.squeeze(1)), (conv_start, held))
        return gated + out

    def _gated(self, streams: torch.Tensor, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The n-gram embedding of each token (windows [T, n]: its n-gram, itself last) gated by the streams ->
        (the gated values [T, streams x hidden], the convolution's normed input)."""
        s, h = self.shape, self.hidden
        embedded = self._embed(_cut_runs(windows, s.eos))
        key = self.norm_key(self.key_proj(embedded)).unflatten(-1, (s.streams, h))
        query = self.norm_query(streams).unflatten(-1, (s.streams, h))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(h)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * self.value_proj(embedded).unsqueeze(-2)
        return gated.flatten(-2), self.norm_conv(gated.flatten(-2))

    def _embed(self, shifted: torch.Tensor) -> torch.Tensor:
        """shifted [T, n] (column j: the token j places back, EOS past a cut) -> [T, ple_dim]: each n-gram order's
        hash (the tokens times their multipliers, xor-ed) in its heads' tables."""
        s, h = self.shape, self.hash_tensors(shifted.device)
        ids, mixed = [], shifted[:, 0] * h["multipliers"][0]
        for order in range(2, s.ngram + 1):
            mixed = mixed ^ (shifted[:, order - 1] * h["multipliers"][order - 1])
            heads = slice((order - 2) * s.heads_per_ngram, (order - 1) * s.heads_per_ngram)
            ids.append(torch.remainder(mixed.unsqueeze(-1), h["sizes"][heads]) + h["offsets"][heads])
        rows = self.ple_embedding.ngram_embedding(torch.cat(ids, dim=-1))                     # [T, heads, cols]
        return (self.comm.all_gather_last(rows) if self.split > 1 else rows).flatten(-2)

    def hash_tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The hash's multipliers, its heads' table sizes and row offsets as int64 tensors on `device` (made at the
        first step there: a decode graph's capture finds them made by the warm-up)."""
        if device not in self._hash_on:
            self._hash_on[device] = {k: torch.tensor(v, dtype=torch.int64, device=device)
                                     for k, v in self.hashing.items()}
        return self._hash_on[device]

    def _convolve(self, window: torch.Tensor) -> torch.Tensor:
        """[B, wide, L + q] (state, then inputs) -> [B, wide, q]: the dilated depthwise convolution, then SiLU."""
        weight = self.conv1d.weight
        return F.silu(F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0], dilation=self.shape.ngram))


def _cut_runs(windows: torch.Tensor, eos: int) -> torch.Tensor:
    """windows [T, n] (a token's n-gram, itself last) -> [T, n]: column j the token j places back, or EOS where an EOS
    lies within those j places (transformers' `_shift_right_ignore_eos`: an EOS ends a run)."""
    n = windows.shape[1]
    cols, blocked = [windows[:, -1]], torch.zeros_like(windows[:, -1], dtype=torch.bool)
    for back in range(1, n):
        token = windows[:, n - 1 - back]
        blocked = blocked | (token == eos)
        cols.append(torch.where(blocked, eos, token))
    return torch.stack(cols, dim=-1)


class QsaAttention(GatedAttention):
    """Qwen3.5's gated attention whose tokens QSA selects (the module docstring): its indexer (`index_qk_proj`: the
    query heads, then the key head; `q_layernorm`, `k_layernorm`) whole on every rank."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer)
        self.qsa = qsa = config.block_indexer
        self.indexer = nn.Module()
        self.indexer.index_qk_proj = nn.Linear(config.hidden_size, (qsa.num_heads + 1) * qsa.head_dim, bias=False)
        self.indexer.q_layernorm = GemmaHeadRMSNorm(qsa.head_dim, config.rms_norm_eps)
        self.indexer.k_layernorm = GemmaHeadRMSNorm(qsa.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, backend, turn: torch.Tensor | None = None) -> torch.Tensor:
        """turn: the rotary cache's rows at the step's positions (the indexer's rotary, `kernels.qsa.turn_part`)."""
        heads, kv_heads, d, qsa = self.num_heads, self.num_kv_heads, self.config.head_dim, self.qsa
        projected = self.qkv_proj(hidden)
        qkv = projected[:, :self.q_size + 2 * self.kv_size].unflatten(-1, (heads + 2 * kv_heads, d))
        self.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        index = self.indexer.index_qk_proj(hidden).view(-1, qsa.num_heads + 1, qsa.head_dim)
        keys = index[:, qsa.num_heads:]   # as projected: a block's key is made of them when scored
        k_cache, v_cache, index_cache = kv_cache
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        backend.store_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        backend.store_kv(keys, keys, index_cache, index_cache, meta)
        if max(meta.seq_lens_list, default=0) <= qsa.dense_len:   # every token chosen
            out = backend.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale=self.k_scale,
                                          v_scale=self.v_scale)
        else:
            queries = index[:, :qsa.num_heads]
            self.indexer.q_layernorm(queries)
            norm = self.indexer.k_layernorm
            out = qsa_attention(q, k_cache, v_cache, turn_part(queries, turn, self.config.rotary_dim), index_cache,
                                meta, self.scale, ratio=qsa.block_size, topk_blocks=qsa.topk_blocks,
                                key_norm=(norm.weight, norm.eps), cos_sin_cache=self.rotary_emb.cos_sin_cache,
                                rotary_dim=self.config.rotary_dim, k_scale=self.k_scale, v_scale=self.v_scale)
        gate = torch.sigmoid(projected[:, self.q_size + 2 * self.kv_size:])
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size) * gate))


class Qwen4ExpLayer(nn.Module):
    """A layer: its PLE (where it has one), the token mixer (Gated DeltaNet, `linear_attn`, or `QsaAttention`,
    `self_attn`) and the MLP, each between its stream mix and the join of its output."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, ops: ModuleType,
                 layer: int, state_index: int) -> None:
        super().__init__()
        s, h, eps = config.qwen4_exp, config.hidden_size, config.rms_norm_eps
        if layer in s.ple_layers:
            self.ple = PleLayer(config, s.ple_layers.index(layer), shard, comm)
        if config.is_linear_layer(layer):
            self.linear_attn = GatedDeltaNet(config.gated_delta.per_rank(shard.size), h, eps, state_index, comm)
        else:
            self.self_attn = QsaAttention(config, shard, comm, rotary_emb, layer)
        self.mlp = MLP(config, shard, comm, ops)
        self.attn_hyper_connection = StreamMix(s, h, eps)
        self.mlp_hyper_connection = StreamMix(s, h, eps)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, rows: tuple[RopeRows, torch.Tensor],
                cache: tuple[torch.Tensor, ...] | RecurrentStates, meta: AttentionMetadata, backend,
                states: RecurrentStates) -> torch.Tensor:
        """rows: the step's rotary rows and the rotary cache's rows at its positions (the indexers')."""
        if hasattr(self, "ple"):
            streams = streams + self.ple(streams, input_ids, meta, states.extra)
        hidden, weights = self.attn_hyper_connection(streams)
        if hasattr(self, "linear_attn"):
            out = self.linear_attn(hidden, meta, cache)
        else:
            out = self.self_attn(hidden, rows[0], cache, meta, backend, rows[1])
        streams = StreamMix.join(streams, out, weights)
        hidden, weights = self.mlp_hyper_connection(streams)
        return StreamMix.join(streams, self.mlp(hidden), weights)


class Qwen4ExpForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen4-Exp (the module docstring): Qwen3.5-MoE's loading and states, its layers between stream mixes, the last
    mix as the final norm."""

    @property
    def graph_max_len(self) -> int:
        """QSA's dense regime (`QsaIndexer.dense_len`): its decode graphs hold it alone (the module docstring)."""
        return self.config.block_indexer.dense_len

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = Qwen4ExpLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                              self.state_index.get(index, -1))
        return with_experts(self, layer, index, ops)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return StreamMix(self.config.qwen4_exp, self.config.hidden_size, self.config.rms_norm_eps, combine=False)

    def reserve_states(self, num_rows: int) -> None:
        """The linear layers' states, and beside them (`RecurrentStates.extra`) the PLE layers' where it has any."""
        s, weight = self.config.qwen4_exp, self.embed_tokens.weight
        if self.states is None and s.ple_layers:
            shape = PleStateShape((s.streams * self.config.hidden_size, s.conv_state_len), (s.ngram - 1,))
            self.states = RecurrentStates(self.state_shape(), len(self.state_index), weight.dtype, weight.device,
                                          extra=RecurrentStates(shape, len(s.ple_layers), weight.dtype,
                                                                weight.device))
        super().reserve_states(num_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], meta: AttentionMetadata, backend) -> torch.Tensor:
        self.prepare_states(meta)
        rows = (self.rotary_emb.rows(positions), self.rotary_emb.cos_sin_cache.index_select(0, positions))
        streams = self.embed(input_ids).repeat(1, self.config.qwen4_exp.streams)
        caches = iter(kv_caches)
        for layer in self.layers:
            cache = self.states if hasattr(layer, "linear_attn") else next(caches)
            streams = layer(streams, input_ids, rows, cache, meta, backend, self.states)
        return self.norm(streams)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The last mix as `norm`; the PLE tables' bookkeeping checked against ours and not read (a checkpoint
        hashed otherwise is refused by name); anything else as Qwen3.5-MoE's."""
        name = name.replace("hyper_connection_mixer.", "norm.", 1) if name.startswith("hyper_connection_mix") \
            else name
        kind = name.rsplit(".", 1)[-1]
        if ".ple.ple_embedding." in name and kind in _PLE_BUFFERS:
            layer = self.layers[int(name.split(".")[1])]
            ours = layer.ple.hashing[_PLE_BUFFERS[kind]] if hasattr(layer, "ple") else None
            if ours is None or tensor.device.type != "meta" and tensor.tolist() != ours:
                raise WeightLoadError(f"{hf_name}: does not match the n-gram tables this config makes")
            return ()
        return super().read_tensor(hf_name, name, tensor)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """A PLE table's shard (`ngram_embedding.shard_N`, as transformers saves it: `split_ngram_parts` equal
        parts, the last the rest) into its rows of the table."""
        head, sep, rest = name.partition(".ngram_embedding.shard_")
        if not sep:
            return super()._destination(name, hf_name)
        part = int(rest.split(".")[0])
        return f"{head}.ngram_embedding.weight", lambda data: _shard_rows(data, part, self.config, hf_name)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A PLE table's columns of this rank where the ranks split them; the indexers, mixes and the rest of the
        PLE layers whole; anything else as Qwen3.5-MoE's."""
        if self.shard.size == 1:
            return tensor
        if ".ngram_embedding." in name:
            split = self.layers[int(name.split(".")[1])].ple.split
            cols = tensor.shape[-1] // split
            return tensor.narrow(-1, (self.shard.rank % split) * cols, cols) if split > 1 else tensor
        if any(part in name for part in (".indexer.", "hyper_connection.", ".ple.")) or name.startswith("norm."):
            return tensor
        return super()._shard_of(hf_name, name, tensor)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights; the gated norms at 1 (Qwen3.5's), every (1 + weight) norm at 0."""
        super().init_random(seed, std)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, StreamNorm):
                    module.weight.zero_()


def _shard_rows(data: torch.Tensor, part: int, config: ModelConfig, hf_name: str) -> torch.Tensor:
    """The rows of a PLE table `data` its stored part `part` fills: torch.chunk's, equal parts of ceil(rows / parts),
    the last the rest (a part past them refused by name)."""
    parts = config.qwen4_exp.shard_parts
    per = -(-data.shape[0] // parts)
    if part >= parts or part * per >= data.shape[0]:
        raise WeightLoadError(f"{hf_name}: past the table's {parts} parts (split_ngram_parts)")
    return data.narrow(0, part * per, min(per, data.shape[0] - part * per))
