"""QSA, Qwen4-Exp's token selection, over the paged K/V cache in torch on any device (`engine.models.qwen4_exp`).

An attention layer's cache holds, beside each token's K and V, its indexer key as projected (`index_cache`: not
normed, not turned). The context's tokens fall in blocks of `ratio` positions; a block is complete for a query at
position p when all its tokens are at or before p. A complete block's key is its tokens' keys averaged (float32, then
rounded to their dtype), normed (1 + weight, float32) and turned by the rotary at the block's first position
(`block_keys`). A query scores a block by its indexer heads' dot products with that key, each through a ReLU, summed
and over sqrt(d) (float32); it attends to the tokens of its `topk_blocks` best complete blocks (all of them while it
has no more) and to every token after the last complete block, up to itself: one choice for every head of the layer
(transformers' `Qwen4ExpTextQSAIndexer`). A decode step runs its sequences at once, gathering the K/V rows of the
chosen blocks alone (`_decode`); a prefill piece runs a sequence and `chunk` queries at a time over the sequence's
keys, gathered once. A query with no more complete blocks than `topk_blocks` attends to its whole context, which is
why the model runs the backend's paged attention while no sequence of a step is longer than that (`dense_len`). On
CUDA every query of a step at once attends to its chosen blocks through MiniMax M3's Triton kernel
(`kernels.triton_block_sparse.attend_blocks`, the K/V read in place), the choice made here as blocks (`qsa_blocks`).
"""

from __future__ import annotations

import math

import torch

from kernels.block_sparse import attend_kept, gather_rows
from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots

__all__ = ["block_keys", "chosen_tokens", "qsa_attention", "qsa_attention_torch", "qsa_blocks", "turn_part"]


def qsa_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, index_q: torch.Tensor,
                  index_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *, ratio: int, topk_blocks: int,
                  key_norm: tuple[torch.Tensor, float], cos_sin_cache: torch.Tensor, rotary_dim: int,
                  k_scale: float = 1.0, v_scale: float = 1.0, chunk: int = 32) -> torch.Tensor:
    """query [T, heads, head_dim]; index_q [T, index_heads, index_dim] (normed, turned); key_cache, value_cache
    [num_blocks, block_size, kv_heads, head_dim] and index_cache [num_blocks, block_size, 1, index_dim], this step's
    rows stored; key_norm: the block keys' norm (weight, eps); cos_sin_cache [positions, rotary width x 2] (the
    rotary's: cos then sin, the first rotary_dim / 2 of each half the turned pairs' frequencies) -> [T, heads,
    head_dim] in query's dtype."""
    if query.is_cuda:   # every query at once over its chosen blocks' K/V, read in place (`qsa_blocks`)
        from kernels.triton_block_sparse import attend_blocks

        chosen, keep = qsa_blocks(index_q, index_cache, meta, ratio=ratio, topk_blocks=topk_blocks,
                                  key_norm=key_norm, cos_sin_cache=cos_sin_cache, rotary_dim=rotary_dim)
        return attend_blocks(query, key_cache, value_cache, chosen, keep, meta, scale, block_size=ratio,
                             k_scale=k_scale, v_scale=v_scale)
    return qsa_attention_torch(query, key_cache, value_cache, index_q, index_cache, meta, scale, ratio=ratio,
                               topk_blocks=topk_blocks, key_norm=key_norm, cos_sin_cache=cos_sin_cache,
                               rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, chunk=chunk)


def qsa_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                        ratio: int, topk_blocks: int, key_norm: tuple[torch.Tensor, float],
                        cos_sin_cache: torch.Tensor, rotary_dim: int, k_scale: float = 1.0, v_scale: float = 1.0,
                        chunk: int = 32) -> torch.Tensor:
    """`qsa_attention` in torch on any device (the CPU's path; `cliffguard bench dsa --qsa` runs it on CUDA too):
    a decode step's sequences at once (`_decode`), a prefill piece a sequence and `chunk` queries at a time."""
    selection = (ratio, topk_blocks, key_norm, cos_sin_cache, rotary_dim)
    if all(n == 1 for n in meta.query_lens_list):
        return _decode(query, (key_cache, value_cache, index_cache), index_q, meta, scale, selection,
                       (k_scale, v_scale))
    out = torch.empty_like(query)
    for slots, blocks, chunks in _sequences(index_q, index_cache, meta, selection, chunk):
        keys, values = gather_rows(key_cache, slots, k_scale), gather_rows(value_cache, slots, v_scale)
        for rows, positions in chunks:
            keep = chosen_tokens(index_q[rows], blocks, positions, ratio, topk_blocks, slots.shape[1])  # [c, s_len]
            kept = keep[None, None].expand(1, keys.shape[2], *keep.shape)
            out[rows] = attend_kept(query[None, rows], keys, values, kept, scale)[0].to(out.dtype)
    return out


def _sequences(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, selection: tuple,
               chunk: int):
    """Each sequence of a step, in order: (its context's cache rows [1, s_len], its complete blocks' keys [nb, d]
    (`block_keys`), and its queries `chunk` at a time as (their rows of the step, their positions [c]))."""
    ratio, _, key_norm, cos_sin_cache, rotary_dim = selection
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        slots = context_slots(meta, [i], s_len)
        raw = index_cache.view(-1, index_cache.shape[-1]).index_select(0, slots[0])              # [s_len, d]
        blocks = block_keys(raw.to(index_q.dtype), ratio, key_norm, cos_sin_cache, rotary_dim)
        first = s_len - q_len
        yield slots, blocks, [(slice(start + a, start + min(a + chunk, q_len)),
                               torch.arange(first + a, first + min(a + chunk, q_len), device=index_q.device))
                              for a in range(0, q_len, chunk)]
        start += q_len


def _decode(query: torch.Tensor, caches: tuple[torch.Tensor, ...], index_q: torch.Tensor, meta: AttentionMetadata,
            scale: float, selection: tuple, scales: tuple[float, float]) -> torch.Tensor:
    """One query a sequence [n, heads, d], the sequences at once: the indexer keys of each over the longest one's
    positions make the blocks' keys (a shorter one's past its end never visible), each picks its blocks, and only
    those blocks' K/V rows and the last incomplete block's are gathered: [n, (k + 1) x ratio] rows, attended in
    float32."""
    ratio = selection[0]
    key_cache, value_cache, index_cache = caches
    n, heads, d = query.shape
    kv_heads, longest = key_cache.shape[2], max(meta.seq_lens_list)
    slots = context_slots(meta, list(range(n)), longest)                                          # [n, L]
    best, picked, complete, last = _decode_choice(index_q, index_cache, meta, selection, slots)
    offsets = torch.arange(ratio, device=query.device)
    tail = complete[:, None] * ratio + offsets                                                    # [n, ratio]
    positions, valid = tail, tail <= last[:, None]
    if picked is not None:
        positions = torch.cat([(picked[:, :, None] * ratio + offsets).flatten(1), tail], dim=1)
        valid = torch.cat([(best > float("-inf")).repeat_interleave(ratio, dim=1), valid], dim=1)
    rows = slots.gather(1, positions.clamp(max=longest - 1))                                      # [n, m]
    keys, values = (gather_rows(cache, rows, s) for cache, s in ((key_cache, scales[0]), (value_cache, scales[1])))
    q = query.float().view(n, kv_heads, heads // kv_heads, d)
    logits = torch.einsum("nkgd,nmkd->nkgm", q, keys) * scale
    probs = logits.masked_fill(~valid[:, None, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("nkgm,nmkd->nkgd", probs, values).reshape(n, heads, d).to(query.dtype)


def _decode_choice(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, selection: tuple,
                   slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One query a sequence, the sequences at once (slots [n, L]: their cache rows over the longest one's positions)
    -> (the best blocks' scores [n, k] and ids, or None where no sequence has a complete block; each query's count
    of complete blocks; its position)."""
    ratio, topk_blocks, key_norm, cos_sin_cache, rotary_dim = selection
    n, longest = slots.shape
    raw = index_cache.view(-1, index_cache.shape[-1]).index_select(0, slots.flatten())
    blocks = block_keys(raw.view(n, longest, -1).to(index_q.dtype), ratio, key_norm, cos_sin_cache, rotary_dim)
    last = meta.seq_lens.to(torch.int64) - 1
    complete = (last + 1) // ratio
    if not blocks.shape[1]:
        return None, None, complete, last
    scores = torch.einsum("nhd,nbd->nbh", index_q.float(), blocks.float()).relu().sum(dim=-1)
    visible = torch.arange(blocks.shape[1], device=index_q.device) < complete[:, None]
    best, picked = _top_blocks(scores / math.sqrt(index_q.shape[-1]), visible, complete,
                               min(topk_blocks, blocks.shape[1]))
    return best, picked, complete, last


def qsa_blocks(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, *, ratio: int,
               topk_blocks: int, key_norm: tuple[torch.Tensor, float], cos_sin_cache: torch.Tensor, rotary_dim: int,
               chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """What each query attends to as blocks of `ratio` positions, the Triton kernels' form
    (`kernels.triton_block_sparse.attend_blocks`): ([T, k + 1] int64 block ids, [T, k + 1] bool: attended), k the
    fewer of `topk_blocks` and the step's longest sequence's complete blocks. Its best complete blocks first (those
    it does not see not attended), then the block after its last complete one (its tokens up to the query, attended
    where it holds any): `chosen_tokens`' choice. A decode step's sequences at once, else a sequence and `chunk`
    queries at a time."""
    selection = (ratio, topk_blocks, key_norm, cos_sin_cache, rotary_dim)
    tokens, device = index_q.shape[0], index_q.device
    longest = max(meta.seq_lens_list, default=0)
    if tokens and all(n == 1 for n in meta.query_lens_list):
        best, picked, complete, last = _decode_choice(index_q, index_cache, meta, selection,
                                                      context_slots(meta, list(range(tokens)), longest))
        tail = (complete, complete * ratio <= last)
        if picked is None:
            return tail[0][:, None], tail[1][:, None]
        return torch.cat([picked, tail[0][:, None]], dim=1), torch.cat([best > float("-inf"), tail[1][:, None]], dim=1)
    k = min(topk_blocks, longest // ratio)
    chosen = torch.zeros(tokens, k + 1, dtype=torch.int64, device=device)
    keep = torch.zeros(tokens, k + 1, dtype=torch.bool, device=device)
    for _, blocks, chunks in _sequences(index_q, index_cache, meta, selection, chunk):
        for rows, positions in chunks:
            complete = (positions + 1) // ratio
            chosen[rows, k], keep[rows, k] = complete, complete * ratio <= positions
            if blocks.shape[0]:
                best, picked = _best_blocks(index_q[rows], blocks, complete, topk_blocks)
                chosen[rows, :picked.shape[1]], keep[rows, :picked.shape[1]] = picked, best > float("-inf")
    return chosen, keep


def block_keys(raw: torch.Tensor, ratio: int, key_norm: tuple[torch.Tensor, float], cos_sin_cache: torch.Tensor,
               rotary_dim: int) -> torch.Tensor:
    """raw [..., L, d]: a sequence's (or each of several's) indexer keys in the model's dtype -> [..., L // ratio,
    d]: each complete block's key (the module docstring), in that dtype."""
    *lead, length, d = raw.shape
    num_blocks = length // ratio
    pooled = raw[..., :num_blocks * ratio, :].reshape(*lead, num_blocks, ratio, d).float().mean(dim=-2)
    pooled = pooled.to(raw.dtype)
    weight, eps = key_norm
    flat = pooled.float()
    normed = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(raw.dtype)
    starts = torch.arange(num_blocks, device=raw.device) * ratio
    rows = normed.reshape(-1, 1, d)
    turned = turn_part(rows, cos_sin_cache.index_select(0, starts).repeat(rows.shape[0] // max(num_blocks, 1), 1),
                       rotary_dim)
    return turned.view(*lead, num_blocks, d)


def turn_part(x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, heads, d] turned by the rotary over its first `rotary_dim` dimensions, pairing i with i + rotary_dim / 2
    (transformers' rotate-half within the rotated part), the rest passed; cos_sin [T, width]: the rotary cache's rows
    at the tokens' positions (cos, then sin), in x's dtype. A new tensor, transformers' roundings (a product, a
    product, their sum)."""
    half, width = rotary_dim // 2, cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].to(x.dtype), cos_sin[:, None, width:width + half].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


def chosen_tokens(index_q: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, ratio: int,
                  topk_blocks: int, length: int) -> torch.Tensor:
    """index_q [c, index_heads, d] of queries at `positions` [c]; blocks [nb, d] (`block_keys`) -> [c, length] bool:
    the tokens each query attends to (the module docstring)."""
    complete = (positions + 1) // ratio                                                          # [c]
    tokens = torch.arange(length, device=index_q.device)
    tail = (tokens >= complete[:, None] * ratio) & (tokens <= positions[:, None])
    if blocks.shape[0] == 0:
        return tail
    best, picked = _best_blocks(index_q, blocks, complete, topk_blocks)
    chosen = torch.zeros(len(positions), blocks.shape[0] + 1, dtype=torch.bool, device=index_q.device)
    chosen.scatter_(-1, picked.masked_fill(best == float("-inf"), blocks.shape[0]), True)
    in_block = chosen[:, :blocks.shape[0]].repeat_interleave(ratio, dim=-1)
    return tail | torch.nn.functional.pad(in_block, (0, length - in_block.shape[1]))


def _best_blocks(index_q: torch.Tensor, blocks: torch.Tensor, complete: torch.Tensor, topk_blocks: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """index_q [c, index_heads, d] of queries that see `complete` [c] blocks of a sequence's blocks [nb, d] -> the
    best visible blocks' scores [c, k] (-inf where a query sees fewer) and ids."""
    scores = torch.einsum("chd,nd->cnh", index_q.float(), blocks.float()).relu().sum(dim=-1)
    visible = torch.arange(blocks.shape[0], device=index_q.device) < complete[:, None]         # [c, nb]
    return _top_blocks(scores / math.sqrt(index_q.shape[-1]), visible, complete, min(topk_blocks, blocks.shape[0]))


def _top_blocks(scores: torch.Tensor, visible: torch.Tensor, complete: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best visible blocks of each query ([c, k] scores, -inf where a query sees fewer, and block ids). The
    ReLU leaves many blocks at exactly 0, so the k-th best often ties with the next: such a query's blocks are
    chosen again by the one-dimensional top k over its visible blocks that transformers runs, which breaks the tie
    the same way (a read of the device's tie flags: this path runs eagerly, never in a graph)."""
    masked = scores.masked_fill(~visible, float("-inf"))
    if k >= scores.shape[1]:
        return masked.topk(k, dim=-1)
    best, picked = masked.topk(k + 1, dim=-1)
    tied = (best[:, k - 1] == best[:, k]) & (complete > k)
    for i in tied.nonzero().flatten().tolist():
        best[i, :k], picked[i, :k] = scores[i, :int(complete[i])].topk(k, dim=0)
    return best[:, :k], picked[:, :k]
