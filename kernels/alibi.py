"""ALiBi attention over the paged K/V cache (BLOOM's and MPT's: `engine.models.bloom`), in torch on any device: no
rotary; each head h adds slope_h x j to the score of key position j (softmax makes that the paper's slope_h x (j -
i)), the slopes a geometric sequence over the heads (`alibi_slopes`, the paper's and transformers' `_get_alibi_slopes`;
MPT's spread over `alibi_bias_max`, `mpt_alibi_slopes`). A decode step runs its sequences at once over the longest
one's keys, a prefill piece a sequence and `chunk` queries at a time; softmax in float32.
"""

from __future__ import annotations

import math

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import context_slots, dequantize_kv

__all__ = ["alibi_attention", "alibi_slopes", "mpt_alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Each head's slope, float32 on the CPU (whatever the default device: a model is built on the meta one):
    2 ** (-8 i / n) for i = 1 .. n over the largest power of two n <= num_heads, then the odd steps of twice that n's
    sequence for the heads past it (powers taken in float32, as transformers takes them)."""
    n = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(n) - 3))), dtype=torch.float32, device="cpu")
    slopes = torch.pow(base, torch.arange(1, n + 1, dtype=torch.int32, device="cpu"))
    extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * n) - 3))), dtype=torch.float32, device="cpu")
    steps = torch.arange(1, 1 + 2 * min(n, num_heads - n), 2, dtype=torch.int32, device="cpu")
    return torch.cat([slopes, torch.pow(extra, steps)])


def mpt_alibi_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """MPT's slopes, float32 on the CPU: 1 / 2 ** (i x bias_max / m) for i = 1 .. m, m the power of two >= num_heads;
    where m > num_heads the odd-indexed ones first, then the even-indexed, cut to num_heads (transformers'
    `build_mpt_alibi_tensor`, MosaicML's own)."""
    m = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, m + 1, dtype=torch.int64, device="cpu").float() * (bias_max / m))
    return slopes if m == num_heads else torch.cat([slopes[1::2], slopes[::2]])[:num_heads]


def alibi_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, slopes: torch.Tensor, *, relative: bool = False, k_scale: float = 1.0,
                    v_scale: float = 1.0, chunk: int = 32) -> torch.Tensor:
    """query [T, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim], this step's rows stored;
    slopes [heads] float32 (this rank's heads') -> [T, heads, head_dim] in query's dtype. `relative`: the bias slope x
    (j - the last key's position), MPT's (the same softmax, its roundings). A decode step (one query a sequence) runs
    its sequences at once over the longest one's keys (the rest masked: the causal cut); any other step a sequence
    and `chunk` queries at a time."""
    bias = (slopes.float(), relative)
    if all(n == 1 for n in meta.query_lens_list):
        slots = context_slots(meta, list(range(len(meta.seq_lens_list))), max(meta.seq_lens_list))   # [n, L]
        last = (meta.seq_lens.to(torch.int64) - 1)[:, None]
        return _attend(query[:, None], _gather(key_cache, slots, k_scale), _gather(value_cache, slots, v_scale), last,
                       last[:, 0], bias, scale)[:, 0].to(query.dtype)
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        slots = context_slots(meta, [i], s_len)                                                  # [1, s_len]
        keys, values = _gather(key_cache, slots, k_scale), _gather(value_cache, slots, v_scale)   # [1, s_len, kv, d]
        last = torch.tensor([s_len - 1], device=query.device)
        for a in range(0, q_len, chunk):
            b = min(a + chunk, q_len)
            rows = slice(start + a, start + b)
            positions = torch.arange(s_len - q_len + a, s_len - q_len + b, device=query.device)[None]
            out[rows] = _attend(query[None, rows], keys, values, positions, last, bias, scale)[0].to(out.dtype)
        start += q_len
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            last: torch.Tensor, bias: tuple[torch.Tensor, bool], scale: float) -> torch.Tensor:
    """query [B, c, heads, d] at `positions` [B, c]; keys, values [B, L, kv_heads, d] float32 (a sequence's; past its
    `last` [B] key another's or none: the causal cut masks them) -> [B, c, heads, d] float32."""
    b, c, heads, d = query.shape
    kv_heads = keys.shape[2]
    slopes, relative = bias
    keys_at = torch.arange(keys.shape[1], device=query.device)
    offsets = keys_at - last[:, None] if relative else keys_at.expand(b, -1)                     # [B, L]
    alibi = slopes.view(kv_heads, heads // kv_heads)[None, :, :, None, None] * offsets[:, None, None, None, :]
    q = query.float().view(b, c, kv_heads, heads // kv_heads, d)
    logits = torch.einsum("bckgd,btkd->bkgct", q, keys) * scale + alibi                          # [B, kv, g, c, L]
    causal = keys_at <= positions[..., None]                                                      # [B, c, L]
    probs = logits.masked_fill(~causal[:, None, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("bkgct,btkd->bckgd", probs, values).reshape(b, c, heads, d)


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """[*slots.shape, heads, d] float32: the cache's rows at `slots`."""
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots.reshape(-1))
    return dequantize_kv(rows, torch.float32, scale).view(*slots.shape, *cache.shape[2:])
