"""DeepSeek V4 (`DeepseekV4ForCausalLM`: DeepSeek-V4-Flash, -Pro; its config: `engine.deepseek_v4_config`).

Attention (`V4Attention`). Each query head (`head_dim` 512) comes through q's normed bottleneck, normed again per head
(no weight); one key a token, which is its value too, normed; the last `rope_dim` of both rotated in pairs (2i, 2i + 1)
at base `main_theta` on a sliding layer, `compress_theta` (with its YaRN) on the others. A query attends, with a sink
logit a head in the softmax's denominator, to its layer's last `window` positions, and on a compressed layer to entries
each made of `rate` positions: an HCA layer to every entry whose window has closed, a CSA layer to the `index_topk` of
those its indexer scores best. A compressor (`V4Compressor`) makes an entry of a window as the softmax-weighted sum
(per channel, over the window's positions, of each position's gate plus a learned bias a position in the window) of the
positions' values, normed and rotated at the window's first position; a CSA compressor's windows overlap: each entry
takes the previous window's first series beside its own window's second. The indexer is a compressor of its own
(`index_head_dim`) whose entries are keys: a query's score of an entry is sum_h w_h relu(q_h . k) / sqrt(dim) over its
heads. The attention's output has its rotated part turned back by the query's position, then goes through `o_groups`
grouped projections to `o_lora_rank` each and one to the hidden size.

The cache (`engine.deepseek_v4_config`): a row a token a layer, [K=V | the compressors' values and gates | the entry
of the window the token closes (and the indexer's key)]; a step writes its tokens' rows, then the entries of the
windows they close (reading the windows' rows back: earlier steps' and this one's alike), then attends: the step's
decode rows at once (`_decode`, through their block tables), a prompt's chunk 32 queries at a time (`_prefill`), in
torch (no Triton kernel yet: decode steps not captured in CUDA graphs), O(a sequence's length) a step as V3.2's is.

The residual stream is `streams` copies of the hidden state (manifold-constrained hyper-connections): a sublayer reads
their mix (`pre`), and the streams become comb^T x streams + post x the sublayer's output, `comb` a doubly stochastic
mix of the streams (Sinkhorn-Knopp, `sinkhorn_iters` steps), all three from one float32 projection of the normed
streams (`engine.models.hyper_connections.SinkhornConnection`); the head reads a last mix (`SinkhornHead`). Experts:
the score of each expert is sqrt(softplus(logit)) (or the config's `scoring_func`); the hash layers' experts a table
of the token's id picks (`tid2eid`), the others' the best scores plus a correction bias; their scores renormalised,
times `routed_scaling_factor`; every expert's SwiGLU, the shared one's too, clamped at `swiglu_limit`.

The release's names (DeepSeek's: `attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, ...) are read as transformers'
conversion reads them (`RELEASE_NAMES`). Tensor parallelism: each rank its heads (whole groups of them: the ranks
divide `o_groups`), their o_a_proj rows and o_b_proj columns (summed over the ranks), the K=V head, the compressors,
the indexer and the streams' mixes whole on every rank (the cache is: one KV head, replicated), the experts as
Qwen3-MoE's. A model-dtype cache (an FP8 cache refused by key).
"""

from __future__ import annotations

import re
from dataclasses import replace
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.deepseek_v4_config import DeepseekV4Shape
from engine.layers.activation import ClampedSiluAndMul
from engine.layers.rotary import rope_attention_factor, rope_inv_freq
from engine.model_config import ModelConfig
from engine.models.deepseek import past_the_layers
from engine.models.hyper_connections import SinkhornConnection, SinkhornHead, mixed, unit_rms
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused
from kernels.reference import context_slots

__all__ = ["DeepseekV4ForCausalLM"]

# DeepSeek's release names -> transformers' (its conversion mapping's renames, in its order)
RELEASE_NAMES = (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."), (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."))
PREFILL_CHUNK = 32   # a prompt's queries attended at once (each chunk's scores [queries, heads, entries])
SCORES = {"sqrtsoftplus": lambda x: torch.sqrt(F.softplus(x)), "softmax": lambda x: x.softmax(dim=-1),
          "sigmoid": torch.sigmoid}


class V4Norm(nn.Module):
    """RMSNorm with its weight in float32, the product in float32 (transformers' `DeepseekV4RMSNorm`)."""

    float32_parameters = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (self.weight * (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its last 2 x cos.shape[-1] channels turned in pairs (2i, 2i + 1) by cos/sin [T, pairs]
    (float32 products, rounded to x's dtype); -sin turns them back."""
    pairs = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (pairs,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -2 * pairs:].float().unflatten(-1, (pairs, 2))
    a, b = rope[..., 0], rope[..., 1]
    turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-2 * pairs], turned], dim=-1)


class V4Rotary:
    """The two ropes' cos/sin tables (sliding layers': `main`; compressed layers' and their entries': `compress`),
    [positions, rope_dim / 2] float32, built on a device at its first use, read in the model's dtype."""

    def __init__(self, config: ModelConfig) -> None:
        s = config.deepseek_v4
        base = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1, hidden_size=1, intermediate_size=1,
                           num_layers=1, num_heads=1, num_kv_heads=1, head_dim=s.rope_dim,
                           max_position_embeddings=config.max_position_embeddings)
        self.configs = {"main": replace(base, rope_theta=s.main_theta),
                        "compress": replace(base, rope_theta=s.compress_theta, rope_scaling=s.compress_rope)}
        self.positions = config.rotary_positions or config.context_length
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if kind not in self.tables or self.tables[kind][0].device != positions.device:
            config = self.configs[kind]
            freqs = torch.arange(self.positions, dtype=torch.float32)[:, None] * rope_inv_freq(config)[None, :]
            factor = rope_attention_factor(config)
            self.tables[kind] = tuple((part * factor).to(positions.device) for part in (freqs.cos(), freqs.sin()))
        cos, sin = self.tables[kind]
        return cos[positions].to(dtype), sin[positions].to(dtype)


class V4Compressor(nn.Module):
    """One compressor (the module docstring): `series` (1: HCA's, 2: CSA's overlapping windows) of `dim` a token,
    values (`kv_proj`) and gates (`gate_proj`), a bias a position in the window (`position_bias`, float32), the
    entries normed (`kv_norm`). `offset`: where its columns start in a cache row: values, gates, then the entry."""

    float32_parameters = True   # its own: the position bias (its projections and norm are modules of their own)

    def __init__(self, hidden: int, dim: int, rate: int, series: int, eps: float, offset: int) -> None:
        super().__init__()
        self.dim, self.rate, self.series, self.offset = dim, rate, series, offset
        self.kv_proj = nn.Linear(hidden, series * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, series * dim, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, series * dim))
        self.kv_norm = V4Norm(dim, eps)

    @property
    def width(self) -> int:
        return 2 * self.series * self.dim + self.dim

    def row(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, width]: each token's values and gates, its entry's place zeros."""
        return torch.cat([self.kv_proj(hidden), self.gate_proj(hidden), hidden.new_zeros(hidden.shape[0], self.dim)],
                         dim=-1)

    def spans(self, closing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first positions [n] of the windows whose last positions are `closing`, the positions [n, series x rate]
        an entry of each reads: CSA's the previous window's too, negative before the first)."""
        first = closing - self.rate + 1
        return first, first[:, None] + torch.arange(-(self.series - 1) * self.rate, self.rate, device=first.device)

    def close(self, flat: torch.Tensor, first: torch.Tensor, span: torch.Tensor, span_slots: torch.Tensor,
              targets: torch.Tensor, rotary: V4Rotary) -> None:
        """Write the entries of windows (their first positions `first` [n], the positions `span` their entries read,
        at `span_slots`) into the rows at `targets` [n] (their last positions'): from the windows' rows, this step's
        stored first."""
        d, rate, o, s = self.dim, self.rate, self.offset, self.series
        kv, gate = flat[span_slots, o:o + s * d], flat[span_slots, o + s * d:o + 2 * s * d]   # [n, s x rate, s x d]
        gate = gate + self.position_bias.repeat(s, 1)                          # each position's bias in its window
        if s == 2:   # slot j < rate: the previous window's first series; j >= rate: this window's second series
            kv = torch.cat([kv[:, :rate, :d], kv[:, rate:, d:]], dim=1)
            gate = torch.cat([gate[:, :rate, :d], gate[:, rate:, d:]], dim=1)
            gate[:, :rate] = gate[:, :rate].masked_fill((span[:, :rate] < 0)[..., None], float("-inf"))
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entry = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = rotary.at("compress", first, entry.dtype)
        flat[targets, self.entry_columns] = _rotate(entry, cos, sin).to(flat.dtype)

    @property
    def entry_columns(self) -> slice:
        """Where a row holds the entry of the window its token closes."""
        o = self.offset + 2 * self.series * self.dim
        return slice(o, o + self.dim)


class V4Indexer(V4Compressor):
    """CSA's indexer: a compressor of keys, queries from q's bottleneck (`q_b_proj`) rotated at their positions, and
    each head's weight from the layer's input (`scorer.weights_proj`)."""

    def __init__(self, hidden: int, s: DeepseekV4Shape, rate: int, eps: float, offset: int) -> None:
        super().__init__(hidden, s.index_head_dim, rate, 2, eps, offset)
        self.heads, self.topk = s.index_heads, s.index_topk
        self.q_b_proj = nn.Linear(s.q_lora_rank, s.index_heads * s.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hidden, s.index_heads, bias=False)


class GroupedProjection(nn.Module):
    """The output's first projection: each of `groups` groups of heads ([T, groups, size]) to `rank` values, one
    weight [groups x rank, size] (transformers' `DeepseekV4GroupedLinear`; not an `nn.Linear`: nothing multiplies a
    whole input by it) -> [T, groups x rank]."""

    def __init__(self, groups: int, size: int, rank: int) -> None:
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.empty(groups * rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tgi,goi->tgo", x, self.weight.view(self.groups, self.rank, -1)).flatten(1)


class V4Attention(nn.Module):
    """One layer's attention (the module docstring), its compressor and indexer where its kind has them."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, layer: int) -> None:
        super().__init__()
        s, h, eps = config.deepseek_v4, config.hidden_size, config.rms_norm_eps
        self.shape, self.kind, self.eps, self.heads, self.comm = s, s.kinds[layer], eps, shard.num_heads, comm
        self.rate, self.groups = s.rates[layer], s.o_groups * shard.num_heads // config.num_heads   # this rank's
        d = s.head_dim
        self.q_a_proj = nn.Linear(h, s.q_lora_rank, bias=False)
        self.q_a_norm = V4Norm(s.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(s.q_lora_rank, self.heads * d, bias=False)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = V4Norm(d, eps)
        self.o_a_proj = GroupedProjection(self.groups, self.heads * d // self.groups, s.o_lora_rank)
        self.o_b_proj = nn.Linear(self.groups * s.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.compressor = None
        if self.kind != "sliding":
            self.compressor = V4Compressor(h, d, self.rate, 2 if self.kind == "csa" else 1, eps, d)
            if self.kind == "csa":
                self.compressor.indexer = V4Indexer(h, s, self.rate, eps, d + self.compressor.width)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        d = self.shape.head_dim
        cos, sin = rotary.at("main" if self.kind == "sliding" else "compress", positions, hidden.dtype)
        bottleneck = self.q_a_norm(self.q_a_proj(hidden))
        q = _rotate(unit_rms(self.q_b_proj(bottleneck).view(-1, self.heads, d), self.eps), cos, sin)
        kv = _rotate(self.kv_norm(self.kv_proj(hidden)), cos, sin)
        row = [kv]
        if self.compressor is not None:
            row.append(self.compressor.row(hidden))
            if self.kind == "csa":
                row.append(self.compressor.indexer.row(hidden))
        flat = cache.view(-1, cache.shape[-1])
        slots, rows = meta.slot_mapping, torch.cat(row, dim=-1).to(flat.dtype)
        if meta.has_invalid_slots:
            keep = slots >= 0
            slots, rows = slots[keep], rows[keep]
        flat.index_copy_(0, slots, rows)
        out = torch.empty_like(q)
        starts = [0]
        for q_len in meta.query_lens_list:
            starts.append(starts[-1] + q_len)
        decodes = [i for i, q_len in enumerate(meta.query_lens_list) if q_len == 1]
        if decodes:   # one query a sequence: all of them at once
            rows_ = torch.tensor([starts[i] for i in decodes], device=q.device)
            out[rows_] = self._decode(q[rows_], hidden[rows_], bottleneck[rows_], flat, meta, decodes, rotary)
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if q_len == 1:
                continue
            seq_slots = context_slots(meta, [i], s_len)[0]
            pos = torch.arange(s_len - q_len, s_len, device=hidden.device)
            if self.compressor is not None:
                closing = pos[(pos + 1) % self.rate == 0]
                for comp in self._compressors():
                    first, span = comp.spans(closing)
                    comp.close(flat, first, span, seq_slots[span.clamp(min=0)], seq_slots[closing], rotary)
            rows_ = slice(starts[i], starts[i + 1])
            out[rows_] = self._prefill(q[rows_], hidden[rows_], bottleneck[rows_], flat, seq_slots, pos, rotary)
        out = _rotate(out, cos, -sin)
        return self.comm.all_reduce(self.o_b_proj(self.o_a_proj(out.reshape(out.shape[0], self.groups, -1))))

    def _compressors(self) -> list[V4Compressor]:
        """The layer's compressor, and its indexer (CSA's): the windows each closes."""
        return [self.compressor] + ([self.compressor.indexer] if self.kind == "csa" else [])

    def _prefill(self, q: torch.Tensor, hidden: torch.Tensor, bottleneck: torch.Tensor, flat: torch.Tensor,
                 slots: torch.Tensor, pos: torch.Tensor, rotary: V4Rotary) -> torch.Tensor:
        """One sequence's queries (at `pos`; its token slots `slots`) over its window and the entries closed before
        each, `PREFILL_CHUNK` queries at a time (scores [queries, entries]): [q, heads, head_dim] in q's dtype."""
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, q.shape[0])
            out[a:b] = self._prefill_chunk(q[a:b], hidden[a:b], bottleneck[a:b], flat, slots, pos[a:b], rotary)
        return out

    def _prefill_chunk(self, q: torch.Tensor, hidden: torch.Tensor, bottleneck: torch.Tensor, flat: torch.Tensor,
                       slots: torch.Tensor, pos: torch.Tensor, rotary: V4Rotary) -> torch.Tensor:
        d, window = self.shape.head_dim, self.shape.window
        lo, hi = max(0, int(pos[0]) - window + 1), int(pos[-1]) + 1
        keys = flat[slots[lo:hi], :d].float()                                    # [n, d], shared by the queries
        key_pos = torch.arange(lo, hi, device=q.device)
        seen = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
        parts = [(keys, seen)]
        count = hi // self.rate if self.compressor is not None else 0              # the entries any of them sees
        if count:
            at = slots[torch.arange(1, count + 1, device=q.device) * self.rate - 1]   # each entry's row
            ready = torch.arange(count, device=q.device)[None, :] < ((pos + 1) // self.rate)[:, None]   # [q, count]
            if self.kind == "csa":   # each query its own best: [q, k, d]
                at, ready = self._choose(hidden, bottleneck, flat, at, pos, ready, rotary)
            parts.append((flat[at, self.compressor.entry_columns].float(), ready))   # HCA's shared: [count, d]
        return self._softmax(q, parts)

    def _decode(self, q: torch.Tensor, hidden: torch.Tensor, bottleneck: torch.Tensor, flat: torch.Tensor,
                meta: AttentionMetadata, seqs: list[int], rotary: V4Rotary) -> torch.Tensor:
        """The decode rows of `seqs` (one query each, at its sequence's last position) at once: the windows their
        tokens close, then each over its window and entries: [B, heads, head_dim]."""
        s, dev, bs = self.shape, q.device, meta.block_size
        tables = meta.block_tables[torch.tensor(seqs, device=dev)].long()          # [B, blocks]
        pos = torch.tensor([meta.seq_lens_list[i] - 1 for i in seqs], device=dev)  # [B]

        def slots(p: torch.Tensor, rows: torch.Tensor = tables) -> torch.Tensor:   # [n, k] positions (>= 0) -> slots
            return rows.gather(1, (p // bs).clamp(max=rows.shape[1] - 1)) * bs + p % bs

        if self.compressor is not None:
            closing = ((pos + 1) % self.rate == 0).nonzero().flatten()
            for comp in self._compressors() if closing.numel() else ():
                first, span = comp.spans(pos[closing])
                at = slots(span.clamp(min=0), tables[closing])
                comp.close(flat, first, span, at, slots(pos[:, None])[closing, 0], rotary)
        near = pos[:, None] - s.window + 1 + torch.arange(s.window, device=dev)   # [B, window]
        parts = [(flat[slots(near.clamp(min=0)), :s.head_dim].float(), near >= 0)]
        count = (pos + 1) // self.rate if self.compressor is not None else pos.new_zeros(0)
        most = int(count.max()) if count.numel() else 0
        if most:
            at = slots((torch.arange(1, most + 1, device=dev) * self.rate - 1).expand(len(seqs), -1))   # [B, most]
            ready = torch.arange(most, device=dev)[None, :] < count[:, None]
            if self.kind == "csa":
                at, ready = self._choose(hidden, bottleneck, flat, at, pos, ready, rotary)
            parts.append((flat[at, self.compressor.entry_columns].float(), ready))
        return self._softmax(q, parts)

    def _softmax(self, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Each query's attention over `parts`: (keys, which each query sees), the keys [k, d] shared or [q, k, d] its
        own, each its value too; a sink a head in the denominator. [q, heads, d] in q's dtype."""
        qf, logits = q.float(), []
        for keys, seen in parts:
            eq = "qhd,kd->qhk" if keys.dim() == 2 else "qhd,qkd->qhk"
            logits.append(torch.einsum(eq, qf, keys).masked_fill(~seen[:, None], float("-inf")))
        scores = torch.cat(logits, dim=-1) * self.shape.head_dim ** -0.5
        sinks = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)
        out, start = 0.0, 0
        for keys, _ in parts:
            width = keys.shape[-2]
            eq = "qhk,kd->qhd" if keys.dim() == 2 else "qhk,qkd->qhd"
            out = out + torch.einsum(eq, probs[..., start:start + width], keys)
            start += width
        return out.to(q.dtype)

    def _choose(self, hidden: torch.Tensor, bottleneck: torch.Tensor, flat: torch.Tensor, at: torch.Tensor,
                pos: torch.Tensor, ready: torch.Tensor, rotary: V4Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows [q, k] of each query's `index_topk` best entries of those at `at` ([count] shared by the queries,
        or [q, count] each its own), and which of them it may attend to (`ready` [q, count]): the indexer's scores of
        their keys."""
        idx = self.compressor.indexer
        cos, sin = rotary.at("compress", pos, hidden.dtype)
        iq = _rotate(idx.q_b_proj(bottleneck).view(-1, idx.heads, idx.dim), cos, sin).float()
        keys = flat[at, idx.entry_columns].float()                               # [count, di] or [q, count, di]
        weights = idx.scorer.weights_proj(hidden).float() * idx.heads ** -0.5     # [q, heads]
        eq = "qhd,cd->qhc" if keys.dim() == 2 else "qhd,qcd->qhc"
        relu = torch.relu(torch.einsum(eq, iq, keys)) * idx.dim ** -0.5           # [q, heads, count]
        scores = torch.einsum("qh,qhc->qc", weights, relu)
        best = scores.masked_fill(~ready, float("-inf")).topk(min(idx.topk, at.shape[-1]), dim=-1).indices
        rows = at[best] if at.dim() == 1 else at.gather(1, best)
        return rows, ready.gather(1, best)


class V4Router(nn.Module):
    """The router's weight (the model's dtype) and, by layer, its float32 correction bias or a hash layer's table of
    experts by token id (int32: `tid2eid`)."""

    def __init__(self, config: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(config.vocab_size, config.num_experts_per_tok), requires_grad=False)
            self.parameter_dtypes = {"tid2eid": torch.int32}
        else:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))
            self.parameter_dtypes = {"e_score_correction_bias": torch.float32}


class V4MoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts with V4's router (the module docstring); `token_ids` the step's ids (the model's list)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType, hashed: bool,
                 token_ids: list[torch.Tensor]) -> None:
        super().__init__(config, shard, comm, ops)
        s = config.deepseek_v4
        self.gate, self.hashed, self.token_ids = V4Router(config, hashed), hashed, token_ids
        self.score, self.scaling = SCORES[s.scoring], config.routed_scaling_factor
        if s.swiglu_limit is not None:
            self.act_fn = ClampedSiluAndMul(s.swiglu_limit)
            self.shared_expert.act_fn = ClampedSiluAndMul(s.swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x, self.gate.weight).float())
        if self.hashed:
            experts = self.gate.tid2eid[self.token_ids[0]].long()
        else:
            experts = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, experts


class V4Layer(nn.Module):
    """Attention, then the experts, each between its streams' mix in and out."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType, layer: int,
                 token_ids: list[torch.Tensor]) -> None:
        super().__init__()
        s, h, eps = config.deepseek_v4, config.hidden_size, config.rms_norm_eps
        self.attn_hc, self.ffn_hc = SinkhornConnection(s, h, eps), SinkhornConnection(s, h, eps)
        self.input_layernorm, self.post_attention_layernorm = V4Norm(h, eps), V4Norm(h, eps)
        self.self_attn = V4Attention(config, shard, comm, layer)
        self.mlp = V4MoeBlock(config, shard, comm, ops, layer in s.hash_layers, token_ids)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = mixed(streams, post, comb, self.self_attn(self.input_layernorm(x), positions, rotary, cache, meta))
        post, comb, x = self.ffn_hc(streams)
        return mixed(streams, post, comb, self.mlp(self.post_attention_layernorm(x)))


class DeepseekV4ForCausalLM(Qwen3MoeForCausalLM):
    """DeepSeek V4 (the module docstring): `V4Layer`s over the streams, the final norm after the head's mix."""

    graph_safe = False

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        self.__dict__["_token_ids"] = []   # the step's ids, for the hash layers (a plain list, not a module)
        super().__init__(config, shard, comm, ops)
        s = config.deepseek_v4
        self.hc_head = SinkhornHead(s, config.hidden_size, config.rms_norm_eps)
        self.v4_rotary = V4Rotary(config)

    def make_rotary(self, ops: ModuleType) -> None:
        return None   # its own (`V4Rotary`): two bases over the heads' rotated tails

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return V4Layer(self.config, self.shard, self.comm, ops, index, self.__dict__["_token_ids"])

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return V4Norm(self.config.hidden_size, self.config.rms_norm_eps)

    def kv_attentions(self) -> dict[int, nn.Module]:
        """None of the paged kernels' attentions (nothing to compile for them, no FP8 scales to measure)."""
        return {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        self.__dict__["_token_ids"][:] = [input_ids]
        hidden = self.embed(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.config.deepseek_v4.streams, -1).contiguous()
        for layer, (cache, _) in zip(self.layers, kv_caches):
            streams = layer(streams, positions, self.v4_rotary, cache, meta)
        return self.norm(self.hc_head(streams))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """DeepSeek's release names as transformers' (`RELEASE_NAMES`); the multi-token-prediction layers (`mtp.`, or
        past the model's) skipped; the shared expert under Qwen2-MoE's name."""
        for pattern, ours in RELEASE_NAMES:
            name = re.sub(pattern, ours, name)
        if name.startswith("mtp.") or past_the_layers(name, self.config.num_layers):
            return ()
        return super().read_tensor(hf_name, name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's heads' rows of q_b_proj and their sinks, its groups' rows of o_a_proj and columns of o_b_proj;
        the K=V projection, the compressors, the indexer and the mixes whole on every rank (so is the cache); the
        experts as Qwen3-MoE's."""
        shard, s = self.shard, self.config.deepseek_v4
        if shard.size == 1 or ".self_attn." not in name or ".compressor." in name:
            return super()._shard_of(hf_name, name, tensor)
        per_rank = {"q_b_proj.weight": (0, s.head_dim * shard.num_heads), "sinks": (0, shard.num_heads),
                    "o_a_proj.weight": (0, self.layers[0].self_attn.groups * s.o_lora_rank),
                    "o_b_proj.weight": (1, self.layers[0].self_attn.groups * s.o_lora_rank)}
        kind = name.split(".self_attn.")[1]
        if kind not in per_rank:
            return tensor
        dim, size = per_rank[kind]
        return tensor.narrow(dim, shard.rank * size, size)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (`LlamaForCausalLM.init_random`), each hash layer's table of valid expert ids."""
        super().init_random(seed, std)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in self.layers:
                table = getattr(layer.mlp.gate, "tid2eid", None)
                if table is not None:
                    table.copy_(torch.randint(0, self.config.num_experts, table.shape, generator=gen))

