"""Block-sparse attention over the paged K/V cache: each query attends only to the blocks of keys its indexer picks
(MiniMax M3's sparse layers; `engine.models.minimax_m3`), in torch on any device.

A sparse layer's cache holds, beside each token's K and V, one indexer key (`index_cache`). Per KV head g, the
indexer's score of key t for query s is q_index[s, g] . k_index[t] (float32), -inf past s (causal); the keys fall in
blocks of `block_size` positions (block b: positions b x block_size ..), and a block scores its best key's score.
The query's own block and the `local_blocks` - 1 before it are always picked; of the rest, the best, `topk_blocks`
in all. Each query head of KV head g then attends to the picked blocks' causal keys, softmax in float32
(transformers' `MiniMaxM3VLIndexer` and its block mask). Queries run a sequence and `chunk` queries at a time, so a
long prefill never holds [queries, heads, context] at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots, dequantize_kv

__all__ = ["block_sparse_attention", "picked_keys", "store_index_keys"]


def store_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Each token's indexer key [T, 1, index_head_dim] into its slot of `index_cache` (a padded row's slot, -1,
    stores nothing)."""
    slots = meta.slot_mapping
    if meta.has_invalid_slots:
        keep = slots >= 0
        slots, keys = slots[keep], keys[keep]
    index_cache.view(-1, *index_cache.shape[2:]).index_copy_(0, slots, keys.to(index_cache.dtype))


def block_sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           *, block_size: int, topk_blocks: int, local_blocks: int, k_scale: float = 1.0,
                           v_scale: float = 1.0, chunk: int = 32) -> torch.Tensor:
    """query [T, heads, head_dim]; index_q [T, kv_heads, index_head_dim] (normed, rotated); key_cache, value_cache
    [num_blocks, cache_block_size, kv_heads, head_dim] and index_cache [num_blocks, cache_block_size, 1,
    index_head_dim], this step's rows already stored -> [T, heads, head_dim] in query's dtype."""
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        slots = context_slots(meta, [i], s_len)[0]
        index_keys = _gather(index_cache, slots, 1.0)[:, 0]                                     # [s_len, d_index]
        keys, values = _gather(key_cache, slots, k_scale), _gather(value_cache, slots, v_scale)   # [s_len, kv, d]
        for a in range(0, q_len, chunk):
            b = min(a + chunk, q_len)
            rows = slice(start + a, start + b)
            positions = torch.arange(s_len - q_len + a, s_len - q_len + b, device=query.device)
            keep = picked_keys(index_q[rows], index_keys, positions, block_size, topk_blocks, local_blocks)
            q = query[rows].float().view(b - a, kv_heads, heads // kv_heads, -1)                  # [c, kv, g, d]
            logits = torch.einsum("ckgd,tkd->kgct", q, keys) * scale
            logits = logits.masked_fill(~keep[:, None], float("-inf"))
            probs = logits.softmax(dim=-1)
            out[rows] = torch.einsum("kgct,tkd->ckgd", probs, values).reshape(b - a, heads, -1).to(out.dtype)
        start += q_len
    return out


def picked_keys(index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor, block_size: int,
                topk_blocks: int, local_blocks: int) -> torch.Tensor:
    """index_q [c, kv_heads, d] of queries at `positions` [c]; index_keys [s_len, d] float32 (the sequence's) ->
    [kv_heads, c, s_len]: which keys each query attends to through each KV head (the module docstring)."""
    s_len = index_keys.shape[0]
    causal = torch.arange(s_len, device=index_keys.device)[None, :] <= positions[:, None]         # [c, s_len]
    scores = torch.einsum("chd,td->hct", index_q.float(), index_keys).masked_fill(~causal, float("-inf"))
    num_blocks = -(-s_len // block_size)
    scores = F.pad(scores, (0, num_blocks * block_size - s_len), value=float("-inf"))
    blocks = scores.view(*scores.shape[:2], num_blocks, block_size).amax(dim=-1)                  # [kv, c, blocks]
    own = positions // block_size
    for back in range(local_blocks):
        local = (own - back).clamp(min=0)[None, :, None].expand(blocks.shape[0], -1, 1)
        blocks.scatter_(-1, local, float("inf"))
    best, picked = blocks.topk(min(topk_blocks, num_blocks), dim=-1)
    chosen = torch.zeros(*blocks.shape[:2], num_blocks + 1, dtype=torch.bool, device=blocks.device)
    chosen.scatter_(-1, picked.masked_fill(best == float("-inf"), num_blocks), True)               # -inf: none
    return chosen[..., :num_blocks].repeat_interleave(block_size, dim=-1)[..., :s_len] & causal


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """[len(slots), heads, d] float32: the cache's rows at `slots`."""
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    return dequantize_kv(rows, torch.float32, scale)
