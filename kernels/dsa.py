"""DeepSeek Sparse Attention over the paged latent cache: each query attends only to the `topk` earlier tokens its
indexer scores best (DeepSeek V3.2's; `engine.models.deepseek_v32`).

A layer's cache row of a token is [latent (kv_lora_rank), rotated key (qk_rope_head_dim), indexer key
(index_head_dim)]: the first `latent_dim` values are what latent attention reads, the rest what the indexer scores.
The indexer's score of token t for query token s is sum_h w[s, h] x relu(scale x q[s, h] . k[t]) over its heads h,
-inf past s (causal); the query then attends, in the latent space, to the rows of its best `topk` tokens that are
causal (transformers' `DeepseekV32Indexer` and its masked attention: a query with fewer than `topk` earlier tokens
attends to all of them). Scores, softmax and sums in float32; rows read through `dequantize_kv` (an FP8 cache).

`sparse_latent_attention` is `choose_tokens`, then `attend_chosen`; a layer without an indexer of its own (GLM-5's
`shared` layers) attends to the choice of the last layer with one (`attend_chosen` alone). A choice is the step's
[T, k] chosen token positions and which of them a query may attend to (k: `topk`, or the step's longest sequence
where shorter; a query with fewer earlier tokens has the rest masked). The Triton backend has its own
(`kernels.triton_dsa`, as `dsa_choose_tokens` and `dsa_attend_chosen`); the torch reference here runs anywhere (a
loop over sequences and chunks of `chunk` queries, so a long prefill never holds [queries, heads, context] at once)
and is what the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots, dequantize_kv

__all__ = ["Choice", "attend_chosen", "choose_tokens", "sparse_latent_attention"]

# the step's chosen token positions [T, k] (int64) and which of them each query attends to [T, k] (bool)
Choice = tuple[torch.Tensor, torch.Tensor]


def sparse_latent_attention(query: torch.Tensor, index_q: torch.Tensor, index_weights: torch.Tensor,
                            cache: torch.Tensor, meta: AttentionMetadata, scale: float, topk: int, kv_lora_rank: int,
                            latent_dim: int, *, index_scale: float, k_scale: float = 1.0, chunk: int = 32
                            ) -> torch.Tensor:
    """query [T, heads, latent_dim]; index_q [T, index_heads, index_head_dim] (rotated); index_weights
    [T, index_heads] float32 (each head's weight, its 1 / sqrt(heads) in it); cache [num_blocks, block_size, 1,
    latent_dim + index_head_dim], this step's rows already stored (a row: the latent of `kv_lora_rank`, the rotated
    key, the indexer's key); `index_scale` the indexer's q.k scale. Returns [T, heads, kv_lora_rank] in query's
    dtype: each head's weighted sum of its chosen rows' latents."""
    choice = choose_tokens(index_q, index_weights, cache, meta, topk, latent_dim, index_scale=index_scale,
                           k_scale=k_scale, chunk=chunk)
    return attend_chosen(query, choice, cache, meta, scale, kv_lora_rank, latent_dim, k_scale=k_scale, chunk=chunk)


def choose_tokens(index_q: torch.Tensor, index_weights: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  topk: int, latent_dim: int, *, index_scale: float, k_scale: float = 1.0, chunk: int = 32) -> Choice:
    """The indexer's choice (`sparse_latent_attention`'s arguments): each query's best `topk` causal tokens."""
    width = min(topk, max(meta.seq_lens_list, default=0))
    chosen = torch.zeros(index_q.shape[0], width, dtype=torch.int64, device=cache.device)
    keep = torch.zeros(index_q.shape[0], width, dtype=torch.bool, device=cache.device)
    for i, start, a, b, s_len, q_len in _chunks(meta, chunk):
        keys = _gather(cache, context_slots(meta, [i], s_len)[0], slice(latent_dim, None), k_scale)   # [s_len, d]
        causal = _causal(s_len, q_len, a, b, cache.device)                                        # [c, s_len]
        scores = torch.relu(torch.einsum("chd,td->cht", index_q[start + a:start + b].float(), keys) * index_scale)
        ranked = torch.einsum("ch,cht->ct", index_weights[start + a:start + b], scores)
        best = ranked.masked_fill(~causal, float("-inf")).topk(min(topk, s_len), dim=-1).indices   # [c, k]
        chosen[start + a:start + b, :best.shape[1]] = best
        keep[start + a:start + b, :best.shape[1]] = causal.gather(1, best)
    return chosen, keep


def attend_chosen(query: torch.Tensor, choice: Choice, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  kv_lora_rank: int, latent_dim: int, *, k_scale: float = 1.0, sinks: torch.Tensor | None = None,
                  chunk: int = 32) -> torch.Tensor:
    """Each query's attention over the tokens its `choice` lets it attend to, in the latent space (q.k over the
    rows' first `latent_dim` values): [T, heads, kv_lora_rank] in query's dtype, the weighted sums of the latents.
    `sinks` [heads] (HY V4's): each head's logit in its softmax's denominator."""
    chosen, keep = choice
    out = query.new_empty(*query.shape[:2], kv_lora_rank)
    for i, start, a, b, s_len, _ in _chunks(meta, chunk):
        rows = slice(start + a, start + b)
        slots = context_slots(meta, [i], s_len)[0][chosen[rows]]                                  # [c, k]
        picked = _gather(cache, slots, slice(0, latent_dim), k_scale)                             # [c, k, latent_dim]
        logits = torch.einsum("chd,ckd->chk", query[rows].float(), picked) * scale
        logits = logits.masked_fill(~keep[rows][:, None, :], float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.float()[None, :, None].expand(*logits.shape[:2], 1)], dim=-1)
        probs = logits.softmax(dim=-1)[..., :picked.shape[1]]
        out[rows] = torch.einsum("chk,ckd->chd", probs, picked[..., :kv_lora_rank]).to(out.dtype)
    return out


def _chunks(meta: AttentionMetadata, chunk: int):
    """(sequence, its first query's row, chunk start, chunk end, its tokens, its queries) of each chunk of each
    sequence's queries, in the step's order."""
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        for a in range(0, q_len, chunk):
            yield i, start, a, min(a + chunk, q_len), s_len, q_len
        start += q_len


def _gather(cache: torch.Tensor, slots: torch.Tensor, part: slice, k_scale: float) -> torch.Tensor:
    """[*slots.shape, part's width] float32: the `part` of the cache rows at `slots` (only those values read)."""
    rows = cache.view(-1, cache.shape[-1])[:, part].index_select(0, slots.reshape(-1))
    return dequantize_kv(rows, torch.float32, k_scale).view(*slots.shape, -1)


def _causal(s_len: int, q_len: int, a: int, b: int, device: torch.device) -> torch.Tensor:
    """[b - a, s_len]: which tokens each of the queries a..b-1 (the last q_len of s_len) may attend to."""
    positions = torch.arange(s_len - q_len + a, s_len - q_len + b, device=device)
    return torch.arange(s_len, device=device)[None, :] <= positions[:, None]
