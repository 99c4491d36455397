"""DeepSeek Sparse Attention over the paged latent cache: each query attends only to the `topk` earlier tokens its
indexer scores best (DeepSeek V3.2's; `engine.models.deepseek_v32`).

A layer's cache row of a token is [latent (kv_lora_rank), rotated key (qk_rope_head_dim), indexer key
(index_head_dim)]: the first `latent_dim` values are what latent attention reads, the rest what the indexer scores.
The indexer's score of token t for query token s is sum_h w[s, h] x relu(scale x q[s, h] . k[t]) over its heads h,
-inf past s (causal); the query then attends, in the latent space, to the rows of its best `topk` tokens that are
causal (transformers' `DeepseekV32Indexer` and its masked attention: a query with fewer than `topk` earlier tokens
attends to all of them). Scores, softmax and sums in float32; rows read through `dequantize_kv` (an FP8 cache).

`sparse_latent_attention` is the reference any device runs (torch ops, a loop over sequences and chunks of
`chunk` queries, so a long prefill never holds [queries, heads, context] at once).
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots, dequantize_kv

__all__ = ["sparse_latent_attention"]


def sparse_latent_attention(query: torch.Tensor, index_q: torch.Tensor, index_weights: torch.Tensor,
                            cache: torch.Tensor, meta: AttentionMetadata, scale: float, topk: int, latent_dim: int,
                            *, index_scale: float, k_scale: float = 1.0, chunk: int = 32) -> torch.Tensor:
    """query [T, heads, latent_dim]; index_q [T, index_heads, index_head_dim] (rotated); index_weights
    [T, index_heads] float32 (each head's weight, its 1 / sqrt(heads) in it); cache [num_blocks, block_size, 1,
    latent_dim + index_head_dim], this step's rows already stored; `index_scale` the indexer's q.k scale. Returns
    [T, heads, latent_dim] in query's dtype: each head's weighted sum of its chosen rows' first `latent_dim` values."""
    flat = cache.view(-1, cache.shape[-1])
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len == 0:
            continue
        rows = dequantize_kv(flat.index_select(0, context_slots(meta, [i], s_len)[0]), torch.float32, k_scale)
        latents, keys = rows[:, :latent_dim], rows[:, latent_dim:]
        for a in range(0, q_len, chunk):
            b = min(a + chunk, q_len)
            rows_of = slice(start + a, start + b)
            positions = torch.arange(s_len - q_len + a, s_len - q_len + b, device=flat.device)
            causal = torch.arange(s_len, device=flat.device)[None, :] <= positions[:, None]      # [c, s_len]
            scores = torch.relu(torch.einsum("chd,td->cht", index_q[rows_of].float(), keys) * index_scale)
            ranked = torch.einsum("ch,cht->ct", index_weights[rows_of], scores).masked_fill(~causal, float("-inf"))
            chosen = ranked.topk(min(topk, s_len), dim=-1).indices                                # [c, k]
            keep = causal.gather(1, chosen)                                                       # chosen and causal
            picked = latents[chosen]                                                              # [c, k, latent_dim]
            logits = torch.einsum("chd,ckd->chk", query[rows_of].float(), picked) * scale
            probs = logits.masked_fill(~keep[:, None, :], float("-inf")).softmax(dim=-1)
            out[rows_of] = torch.einsum("chk,ckd->chd", probs, picked).to(out.dtype)
        start += q_len
    return out
