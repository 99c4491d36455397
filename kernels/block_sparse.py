"""Block-sparse attention over the paged K/V cache: each query attends only to the blocks of keys its indexer picks
(MiniMax M3's sparse layers; `engine.models.minimax_m3`), in torch on any device.

A sparse layer's cache holds, beside each token's K and V, one indexer key (`index_cache`). Per KV head g, the
indexer's score of key t for query s is q_index[s, g] . k_index[t] (float32), -inf past s (causal); the keys fall in
blocks of `block_size` positions (block b: positions b x block_size ..), and a block scores its best key's score.
The query's own block and the `local_blocks` - 1 before it are always picked; of the rest, the best, `topk_blocks`
in all. Each query head of KV head g then attends to the picked blocks' causal keys, softmax in float32
(transformers' `MiniMaxM3VLIndexer` and its block mask). A decode step runs its sequences at once: their indexer keys
over the longest one's positions pick each (sequence, KV head)'s blocks (`pick_blocks`), and only those blocks' K/V
are gathered (`topk_blocks` x `block_size` keys, whatever the context); a prefill piece runs a sequence and `chunk`
queries at a time over the sequence's keys, gathered once, so a long prefill never holds [queries, heads, context] at
once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots, dequantize_kv

__all__ = ["attend_kept", "block_sparse_attention", "gather_rows", "pick_blocks", "picked_keys"]


def block_sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           *, block_size: int, topk_blocks: int, local_blocks: int, k_scale: float = 1.0,
                           v_scale: float = 1.0, chunk: int = 32) -> torch.Tensor:
    """query [T, heads, head_dim]; index_q [T, kv_heads, index_head_dim] (normed, rotated); key_cache, value_cache
    [num_blocks, cache_block_size, kv_heads, head_dim] and index_cache [num_blocks, cache_block_size, 1,
    index_head_dim], this step's rows already stored -> [T, heads, head_dim] in query's dtype. A decode step (one
    query a sequence) runs its sequences at once over the blocks they pick (`_decode`); any other step a sequence and
    `chunk` queries at a time."""
    pick = (block_size, topk_blocks, local_blocks)
    if all(n == 1 for n in meta.query_lens_list):
        return _decode(query, (key_cache, value_cache, index_cache), index_q, meta, scale, pick, (k_scale, v_scale))
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        slots = context_slots(meta, [i], s_len)                                                  # [1, s_len]
        index_keys = gather_rows(index_cache, slots, 1.0)[..., 0, :]                             # [1, s_len, d_index]
        keys = gather_rows(key_cache, slots, k_scale)                                            # [1, s_len, kv, d]
        values = gather_rows(value_cache, slots, v_scale)
        for a in range(0, q_len, chunk):
            b = min(a + chunk, q_len)
            rows = slice(start + a, start + b)
            positions = torch.arange(s_len - q_len + a, s_len - q_len + b, device=query.device)[None]
            keep = picked_keys(index_q[None, rows], index_keys, positions, *pick)
            out[rows] = attend_kept(query[None, rows], keys, values, keep, scale)[0].to(out.dtype)
        start += q_len
    return out


def _decode(query: torch.Tensor, caches: tuple[torch.Tensor, ...], index_q: torch.Tensor, meta: AttentionMetadata,
            scale: float, pick: tuple[int, int, int], scales: tuple[float, float]) -> torch.Tensor:
    """One query a sequence [n, heads, d]: the indexer keys of every sequence over the longest one's positions pick
    each (sequence, KV head)'s blocks, and only those blocks' keys are gathered: [n, kv_heads, k x block_size] rows of
    K and V (float32), the picked blocks' causal positions attended."""
    key_cache, value_cache, index_cache = caches
    n, heads, d = query.shape
    kv_heads, block_size = key_cache.shape[2], pick[0]
    longest = max(meta.seq_lens_list)
    slots = context_slots(meta, list(range(n)), longest)                                          # [n, L]
    last = meta.seq_lens.to(torch.int64) - 1
    picked, ok = pick_blocks(index_q[:, None], gather_rows(index_cache, slots, 1.0)[..., 0, :], last[:, None], *pick)
    offsets = torch.arange(block_size, device=query.device)
    positions = (picked[:, :, 0, :, None] * block_size + offsets).flatten(2)                    # [n, kv, k x bs]
    valid = ok[:, :, 0].repeat_interleave(block_size, dim=-1) & (positions <= last[:, None, None])
    rows = slots.gather(1, positions.clamp(max=longest - 1).flatten(1)).view(n, kv_heads, -1)  # cache rows
    heads_at = torch.arange(kv_heads, device=query.device)[None, :, None]
    keys, values = (dequantize_kv(cache.view(-1, kv_heads, cache.shape[-1])[rows, heads_at], torch.float32, s)
                    for cache, s in ((key_cache, scales[0]), (value_cache, scales[1])))        # [n, kv, m, d]
    q = query.float().view(n, kv_heads, heads // kv_heads, d)
    logits = torch.einsum("nkgd,nkmd->nkgm", q, keys) * scale
    probs = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("nkgm,nkmd->nkgd", probs, values).reshape(n, heads, d).to(query.dtype)


def pick_blocks(index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor, block_size: int,
                topk_blocks: int, local_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index_q [B, c, kv_heads, d] of queries at `positions` [B, c]; index_keys [B, L, d] (a sequence's; past its last
    query's position, another's or none: never picked) -> ([B, kv_heads, c, k] block ids, the same shape bool: picked,
    k = min(topk_blocks, blocks of L)): each query's own block and the `local_blocks` - 1 before it, then the best
    others by their best causal key's score; a block with no causal key is never picked."""
    keys_at = torch.arange(index_keys.shape[1], device=index_keys.device)
    causal = keys_at <= positions[..., None]                                                     # [B, c, L]
    scores = torch.einsum("bchd,btd->bhct", index_q.float(), index_keys.float())
    scores = scores.masked_fill(~causal[:, None], float("-inf"))
    num_blocks = -(-index_keys.shape[1] // block_size)
    scores = F.pad(scores, (0, num_blocks * block_size - index_keys.shape[1]), value=float("-inf"))
    blocks = scores.view(*scores.shape[:3], num_blocks, block_size).amax(dim=-1)                 # [B, kv, c, blocks]
    own = positions // block_size
    for back in range(local_blocks):
        blocks.scatter_(-1, (own - back).clamp(min=0)[:, None, :, None].expand(*blocks.shape[:3], 1), float("inf"))
    best, picked = blocks.topk(min(topk_blocks, num_blocks), dim=-1)
    return picked, best > float("-inf")


def picked_keys(index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor, block_size: int,
                topk_blocks: int, local_blocks: int) -> torch.Tensor:
    """index_q [B, c, kv_heads, d] of queries at `positions` [B, c]; index_keys [B, L, d] (a sequence's; past its last
    query's position, another's or none: never picked, the causal cut) -> [B, kv_heads, c, L]: which keys each query
    attends to through each KV head (the module docstring): the keys of `pick_blocks`' blocks, up to its position."""
    length = index_keys.shape[1]
    picked, ok = pick_blocks(index_q, index_keys, positions, block_size, topk_blocks, local_blocks)
    num_blocks = -(-length // block_size)
    chosen = torch.zeros(*picked.shape[:3], num_blocks + 1, dtype=torch.bool, device=picked.device)
    chosen.scatter_(-1, picked.masked_fill(~ok, num_blocks), True)                                # not picked: none
    keep = chosen[..., :num_blocks].repeat_interleave(block_size, dim=-1)[..., :length]
    causal = torch.arange(length, device=index_keys.device) <= positions[..., None]              # [B, c, L]
    return keep & causal[:, None]


def attend_kept(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """query [B, c, heads, d]; keys, values [B, L, kv_heads, d] float32; keep [B, kv_heads, c, L] -> [B, c, heads, d]
    float32: each query head's softmax over the keys its KV head keeps."""
    b, c, heads, d = query.shape
    kv_heads = keys.shape[2]
    q = query.float().view(b, c, kv_heads, heads // kv_heads, d)
    logits = torch.einsum("bckgd,btkd->bkgct", q, keys) * scale
    probs = logits.masked_fill(~keep[:, :, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("bkgct,btkd->bckgd", probs, values).reshape(b, c, heads, d)


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """[*slots.shape, heads, d] float32: the cache's rows at `slots`."""
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots.reshape(-1))
    return dequantize_kv(rows, torch.float32, scale).view(*slots.shape, *cache.shape[2:])
