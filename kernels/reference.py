"""Torch reference versions of the paged-KV kernels: the CPU path and the yardstick for Triton.

`paged_attention` reads K/V through the block tables. Decode rows (query length 1) are done in
batched calls over a gather of their slots, one call per group of similar context lengths (each row
of a call is padded to the call's longest context, so one 3,000-token rag decode in a call with chat
decodes of 150 would make every row read 3,000 keys); prefill chunks, which are few per step, one
sequence at a time. No sequence is padded in the token dimension.

A prefill chunk on the CPU runs torch's CPU flash-attention kernel, twice when the chunk has a cached
prefix: the chunk's own keys with `is_causal` (the kernel skips most of the masked half) and the
prefix keys with no mask, merged by the log-sum-exp each call returns; the work is then the same as
one causal pass over the whole prompt. SDPA given an explicit `[q_len, s_len]` mask on 3-d inputs
runs its math path instead (float32 scores materialised, mask and softmax passes over the whole
rectangle, no causal skipping): 3-4x slower at 2,048-token chunks, and 69% of a 2,500-token prefill.
A sliding window that cuts into the chunk's keys takes one flash call over the keys some query sees,
with an additive mask; so does chunked attention (Llama 4's `attention_chunk_size`: a query at position p
sees the keys from p - p % chunk to p, its own chunk of the sequence) where a chunk boundary falls among
the chunk's queries. Off the CPU (the yardstick on CUDA), or with a torch whose CPU kernel fails
the probe in `_cpu_flash_works`, chunks run SDPA with a boolean mask.

`softcap` (Gemma 2's attention logit soft-capping: each score q.k x scale replaced by
softcap x tanh(score / softcap) before the mask and the softmax) and `sinks` (GPT-OSS's attention sinks: a
learned logit per query head that joins every softmax's denominator and weighs no value, so a row may attend
to less than all of its keys) have no SDPA kernel: those rows and chunks run `_eager_attention`, the scores
materialised, as transformers' eager attention does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # float8_e4m3fn's largest finite value: what a stored value saturates to


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V as the cache holds it: in an FP8 cache x / scale in float32, saturated to +-FP8_MAX, rounded to
    e4m3 (nearest even); in any other cache x in its dtype (the scale is not used)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    # by a tensor: CUDA divides by a Python float as a multiply by its reciprocal, an ulp off now and then
    x = x.float()
    return (x / torch.full_like(x, scale)).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V for the attention in `dtype`: an FP8 value times its scale in float32, rounded once to
    `dtype`; any other cache's values converted (the scale is not used)."""
    if x.dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K and V into its slot (`quantize_kv`: an FP8 cache stores them over their scales).

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    slots = meta.slot_mapping
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if meta.has_invalid_slots:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if k_cache.dtype == FP8_KV_DTYPE:   # no index_copy for FP8 on a CPU: its bytes
        k_flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(key, FP8_KV_DTYPE, k_scale).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(value, FP8_KV_DTYPE, v_scale).view(torch.uint8))
        return
    k_flat.index_copy_(0, slots, quantize_kv(key, k_cache.dtype, k_scale))
    v_flat.index_copy_(0, slots, quantize_kv(value, v_cache.dtype, v_scale))


def context_slots(meta: AttentionMetadata, rows: list[int], length: int) -> torch.Tensor:
    """[len(rows), length] int64 slots of positions 0..length-1 of the given sequences."""
    device = meta.block_tables.device
    pos = torch.arange(length, device=device)
    tables = meta.block_tables[rows].to(torch.int64)            # [n, max_blocks]
    blocks = tables.gather(1, (pos // meta.block_size).clamp(max=tables.shape[1] - 1).expand(len(rows), -1))
    return blocks * meta.block_size + pos % meta.block_size


@dataclass
class _PrefillChunk:
    """One sequence's prefill chunk in a step: query rows `start:start + q_len` are positions
    `s_len - q_len .. s_len - 1`; they read keys `key_start .. s_len - 1` (gathered through `slots`)."""
    start: int
    q_len: int
    s_len: int
    key_start: int
    slots: torch.Tensor                      # [s_len - key_start] int64
    sliding_window: int | None               # None: causal over the keys, nothing else masked
    chunk: int | None                        # Llama 4's chunked attention: keys of the query's own chunk
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def prefix_len(self) -> int:
        """Keys before the chunk (cached by earlier steps) that every query of the chunk sees."""
        return self.s_len - self.q_len - self.key_start

    def allowed(self) -> torch.Tensor:
        """[q_len, s_len - key_start] bool: which keys each query attends to (built once per step)."""
        mask = self._masks.get("bool")
        if mask is None:
            device = self.slots.device
            q_pos = torch.arange(self.s_len - self.q_len, self.s_len, device=device)[:, None]
            k_pos = torch.arange(self.key_start, self.s_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            if self.chunk is not None:
                mask &= k_pos >= q_pos - q_pos % self.chunk
            self._masks["bool"] = mask
        return mask

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`allowed()` as 0 / -inf in `dtype`, the form the CPU flash kernel takes."""
        mask = self._masks.get(dtype)
        if mask is None:
            mask = torch.zeros(self.allowed().shape, dtype=dtype, device=self.slots.device)
            mask.masked_fill_(~self.allowed(), float("-inf"))
            self._masks[dtype] = mask
        return mask


DECODE_PAD_RATIO = 2      # a decode call's longest context is at most this times its shortest (+ one PAD_SLACK)
PAD_SLACK = 64            # contexts this close share a call whatever their ratio


def _length_groups(rows: list[int], lengths: list[int]) -> list[list[int]]:
    """Decode rows in groups of similar context length (ascending), so that padding each row of a
    group to its longest costs at most about `DECODE_PAD_RATIO` times the keys the group needs."""
    groups: list[list[int]] = []
    for i in sorted(rows, key=lambda i: lengths[i]):
        if groups and lengths[i] <= DECODE_PAD_RATIO * lengths[groups[-1][0]] + PAD_SLACK:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_call(meta: AttentionMetadata, decode: list[int], starts: list[int], s_lens: list[int],
                 sliding_window: int | None, chunk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batched decode call: the rows' query positions, their slots padded to the longest context,
    and which of those each row may attend to."""
    device = meta.block_tables.device
    max_len = max(s_lens[i] for i in decode)
    lens = torch.tensor([s_lens[i] for i in decode], device=device)
    pos = torch.arange(max_len, device=device)
    allowed = pos[None, :] < lens[:, None]                      # [n_decode, max_len]
    if sliding_window is not None:
        allowed &= pos[None, :] > (lens[:, None] - 1 - sliding_window)
    if chunk is not None:   # the decode token's own chunk: from (len - 1) // chunk x chunk
        allowed &= pos[None, :] >= (lens[:, None] - 1) // chunk * chunk
    slots = context_slots(meta, decode, max_len)
    # Positions past a sequence's length read its first slot: masked out, but finite, since
    # 0 x NaN from a never-written slot would poison the weighted sum.
    slots = torch.where(pos[None, :] < lens[:, None], slots, slots[:, :1])
    return (torch.tensor([starts[i] for i in decode], device=device), slots,
            allowed[:, None, None, :])                           # [n_decode, 1, 1, max_len]


def _step_plan(meta: AttentionMetadata, sliding_window: int | None, chunk: int | None = None) -> dict:
    """Per-step gather indices and masks, computed once and shared by every layer of the same window and
    chunk (Gemma 3's sliding and full layers each have theirs, Llama 4's chunked and full ones too)."""
    key = ("torch", sliding_window, chunk)
    plan = meta.backend_cache.get(key)
    if plan is not None:
        return plan
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk: a positive number of positions, got {chunk}")
    q_lens, s_lens = meta.query_lens_list, meta.seq_lens_list
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    decode = [i for i, q in enumerate(q_lens) if q == 1]
    plan = {"decode": [_decode_call(meta, group, starts, s_lens, sliding_window, chunk)
                       for group in _length_groups(decode, s_lens)],
            "prefill": []}
    for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        if q_len <= 1:
            continue
        prefix_len = s_len - q_len
        # The window drops keys before the first query's window; a mask is needed only if it also cuts
        # into the keys of later queries (window < s_len), else the chunk is plain causal.
        windowed = sliding_window is not None and sliding_window < s_len
        key_start = max(0, prefix_len - sliding_window + 1) if windowed else 0
        # Chunked: the first query's chunk starts the keys; a mask only if a boundary falls among the queries
        chunked = chunk is not None and prefix_len // chunk != (s_len - 1) // chunk
        if chunk is not None:
            key_start = max(key_start, prefix_len // chunk * chunk)
        slots = context_slots(meta, [i], s_len)[0][key_start:]
        plan["prefill"].append(_PrefillChunk(starts[i], q_len, s_len, key_start, slots,
                                             sliding_window if windowed else None, chunk if chunked else None))
    meta.backend_cache[key] = plan
    return plan


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool = False,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash-attention kernel, which also returns the log-sum-exp of each query's scores.

    q: [1, num_heads, q_len, d]; k, v: [1, num_kv_heads, k_len, d] (GQA: head h reads kv head
    h // group); mask: additive [q_len, k_len] in q's dtype. is_causal is aligned top-left, so it is
    the causal mask only when q_len == k_len. Returns out [1, num_heads, q_len, d] in q's dtype and
    lse [1, num_heads, q_len] float32.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)


@functools.cache
def _cpu_flash_works(dtype: torch.dtype) -> bool:
    """One tiny GQA call of the private CPU flash op against plain math: a torch build that lacks the
    op, or its GQA or mask support, takes the SDPA-with-mask path instead."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=gen).to(dtype)
    k = torch.randn(1, 2, 5, 8, generator=gen).to(dtype)
    v = torch.randn(1, 2, 5, 8, generator=gen).to(dtype)
    scores = q.float() @ k.float().repeat_interleave(2, dim=1).transpose(-1, -2)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = torch.zeros(5, 5, dtype=dtype).masked_fill_(~causal, float("-inf"))
    scores = scores.masked_fill(~causal, float("-inf"))
    want = scores.softmax(-1) @ v.float().repeat_interleave(2, dim=1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    try:
        for out, lse in (_cpu_flash(q, k, v, 1.0, is_causal=True), _cpu_flash(q, k, v, 1.0, mask=mask)):
            if not (torch.allclose(out.float(), want, atol=tol, rtol=tol)
                    and torch.allclose(lse, scores.logsumexp(-1), atol=tol, rtol=tol)):
                return False
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _use_cpu_flash(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and _cpu_flash_works(query.dtype)


def _prefill_cpu_flash(chunk: _PrefillChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q: [q_len, num_heads, d]; k, v: [s_len - key_start, num_kv_heads, d] -> [q_len, num_heads, d]."""
    q = q.transpose(0, 1)[None]                                     # [1, heads, q_len, d]
    k = k.transpose(0, 1)[None]                                     # [1, kv_heads, keys, d]
    v = v.transpose(0, 1)[None]
    if chunk.sliding_window is not None or chunk.chunk is not None:
        out, _ = _cpu_flash(q, k, v, scale, mask=chunk.additive_mask(q.dtype))
        return out[0].transpose(0, 1)
    prefix = chunk.prefix_len
    out, lse = _cpu_flash(q, k[:, :, prefix:], v[:, :, prefix:], scale, is_causal=True)
    if prefix:
        # softmax over prefix + own keys = the two partial softmaxes weighted by their share of the sum
        out_prefix, lse_prefix = _cpu_flash(q, k[:, :, :prefix], v[:, :, :prefix], scale)
        weight = torch.sigmoid(lse - lse_prefix).unsqueeze(-1)       # [1, heads, q_len, 1]
        out = torch.lerp(out_prefix.float(), out.float(), weight).to(q.dtype)
    return out[0].transpose(0, 1)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None, *,
                    k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached K/V (new tokens included), the last
    `sliding_window` positions only where given, the query's own `chunk` of positions (p - p % chunk to p,
    Llama 4's chunked attention) where given; an FP8
    cache's values read as `dequantize_kv` gives them (times k_scale / v_scale, in the query's dtype);
    `softcap` > 0 caps each score at softcap x tanh(score / softcap) (Gemma 2), 0 leaves them; `sinks`
    ([num_heads], GPT-OSS) adds exp(sinks[head]) to each softmax's denominator.

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(query)
    decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, k_scale=k_scale, v_scale=v_scale,
                     softcap=softcap, sinks=sinks, chunk=chunk)
    prefill_attention(query, k_cache, v_cache, meta, scale, sliding_window, out, k_scale=k_scale, v_scale=v_scale,
                      softcap=softcap, sinks=sinks, chunk=chunk)
    return out


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """A ValueError unless `sinks` is None or one floating-point logit per query head, on the query's device."""
    if sinks is not None and (sinks.shape != (query.shape[1],) or not sinks.is_floating_point()
                              or sinks.device != query.device):
        raise ValueError(f"sinks: one logit per query head ({query.shape[1]}) on {query.device}, got "
                         f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                     softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA's contract (q [..., L, d], k and v [..., S, d], a boolean `allowed` mask) with each score capped
    at softcap x tanh(score / softcap) before the mask where `softcap` > 0, and `sinks` (broadcast to
    [..., L, 1]: each row's sink logit) joining the softmax as one more column that weighs no value; the
    softmax in float32, rounded to q's dtype before it weighs v (transformers' eager attention)."""
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return probs.to(q.dtype) @ v


def _flat_caches(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(num_heads, head_dim, num_kv_heads, group, k_flat, v_flat): the caches as [slots, kv_heads, d]."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    return (num_heads, head_dim, num_kv_heads, num_heads // num_kv_heads,
            k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, sliding_window: int | None, out: torch.Tensor, *,
                     k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """`paged_attention` of the step's decode tokens (query length 1), written into their rows of `out`."""
    check_sinks(sinks, query)
    num_heads, head_dim, num_kv_heads, group, k_flat, v_flat = _flat_caches(query, k_cache, v_cache)
    row_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    for rows, slots, allowed in _step_plan(meta, sliding_window, chunk)["decode"]:
        n, max_len = slots.shape
        # index_select, not advanced indexing: several times faster for row gathers on CPU
        q = query.index_select(0, rows).view(n, num_kv_heads, group, head_dim)  # [n, kv_heads, group, d]
        flat_slots = slots.reshape(-1)
        k = k_flat.index_select(0, flat_slots).view(n, max_len, num_kv_heads, head_dim)
        v = v_flat.index_select(0, flat_slots).view(n, max_len, num_kv_heads, head_dim)
        k = dequantize_kv(k, query.dtype, k_scale).transpose(1, 2)   # [n, kv_heads, max_len, d]
        v = dequantize_kv(v, query.dtype, v_scale).transpose(1, 2)
        o = _eager_attention(q, k, v, allowed, scale, softcap, row_sinks) if softcap or sinks is not None else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim))


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None, out: torch.Tensor, *,
                      k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """`paged_attention` of the step's prefill chunks (query length > 1), written into their rows of `out`."""
    check_sinks(sinks, query)
    num_heads, head_dim, num_kv_heads, group, k_flat, v_flat = _flat_caches(query, k_cache, v_cache)
    plan = _step_plan(meta, sliding_window, chunk)
    eager = bool(softcap) or sinks is not None
    cpu_flash = bool(plan["prefill"]) and not eager and _use_cpu_flash(query)
    for chunk in plan["prefill"]:
        start, q_len = chunk.start, chunk.q_len
        k = dequantize_kv(k_flat.index_select(0, chunk.slots), query.dtype, k_scale)   # [keys, kv_heads, d]
        v = dequantize_kv(v_flat.index_select(0, chunk.slots), query.dtype, v_scale)
        if cpu_flash:
            out[start:start + q_len] = _prefill_cpu_flash(chunk, query[start:start + q_len], k, v, scale)
            continue
        q = query[start:start + q_len].view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        mask = chunk.allowed().repeat(group, 1)                     # rows ordered (group, q_len)
        if eager:   # rows ordered (group, q_len): each query head's sink repeated over its rows
            row_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1).repeat_interleave(q_len, 1)
            o = _eager_attention(q, k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap, row_sinks)
        else:
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:start + q_len] = o.reshape(q_len, num_heads, head_dim)


def dense_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Plain attention of one contiguous sequence; the yardstick the paged versions are tested against
    (`softcap` > 0: each score capped at softcap x tanh(score / softcap); `sinks` [num_heads]: each head's
    sink logit in the softmax, weighing no value; `chunk`: a query at p sees keys p - p % chunk .. p).

    query: [q_len, num_heads, d], the last q_len positions; key, value: [s_len, num_kv_heads, d]
    """
    q_len, num_heads, _ = query.shape
    s_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.repeat_interleave(group, dim=1).transpose(0, 1).float()
    v = value.repeat_interleave(group, dim=1).transpose(0, 1).float()
    q = query.transpose(0, 1).float()
    scores = (q @ k.transpose(1, 2)) * scale                        # [heads, q_len, s_len]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(s_len - q_len, s_len)[:, None]
    k_pos = torch.arange(s_len)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    if chunk is not None:
        allowed &= k_pos >= q_pos - q_pos % chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)], dim=-1)
        return (scores.softmax(-1)[..., :-1] @ v).transpose(0, 1).to(query.dtype)
    return (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
