"""Torch reference versions of the paged-KV kernels: the CPU path and the yardstick for Triton.

`paged_attention` reads K/V through the block tables. Decode rows (query length 1) are done together
in one batched call over a gather of their slots; prefill chunks, which are few per step, one
sequence at a time with a causal mask offset by the sequence's cached prefix. No sequence is padded
in the token dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Write each token's K and V into its slot.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    slots = meta.slot_mapping
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if meta.has_invalid_slots:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _context_slots(meta: AttentionMetadata, rows: list[int], length: int) -> torch.Tensor:
    """[len(rows), length] int64 slots of positions 0..length-1 of the given sequences."""
    device = meta.block_tables.device
    pos = torch.arange(length, device=device)
    tables = meta.block_tables[rows].to(torch.int64)            # [n, max_blocks]
    blocks = tables.gather(1, (pos // meta.block_size).clamp(max=tables.shape[1] - 1).expand(len(rows), -1))
    return blocks * meta.block_size + pos % meta.block_size


def _step_plan(meta: AttentionMetadata, sliding_window: int | None) -> dict:
    """Per-step gather indices and masks, computed once and shared by every layer."""
    plan = meta.backend_cache.get("torch")
    if plan is not None:
        return plan
    q_lens, s_lens = meta.query_lens_list, meta.seq_lens_list
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    decode = [i for i, q in enumerate(q_lens) if q == 1]
    device = meta.block_tables.device
    plan = {"decode": None, "prefill": []}
    if decode:
        max_len = max(s_lens[i] for i in decode)
        lens = torch.tensor([s_lens[i] for i in decode], device=device)
        pos = torch.arange(max_len, device=device)
        allowed = pos[None, :] < lens[:, None]                      # [n_decode, max_len]
        if sliding_window is not None:
            allowed &= pos[None, :] > (lens[:, None] - 1 - sliding_window)
        slots = _context_slots(meta, decode, max_len)
        # Positions past a sequence's length read its first slot: masked out, but finite, since
        # 0 x NaN from a never-written slot would poison the weighted sum.
        slots = torch.where(pos[None, :] < lens[:, None], slots, slots[:, :1])
        plan["decode"] = (
            torch.tensor([starts[i] for i in decode], device=device),
            slots,
            allowed[:, None, None, :],                              # [n_decode, 1, 1, max_len]
        )
    for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        if q_len <= 1:
            continue
        q_pos = torch.arange(s_len - q_len, s_len, device=device)
        k_pos = torch.arange(s_len, device=device)
        allowed = k_pos[None, :] <= q_pos[:, None]                  # [q_len, s_len]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
        plan["prefill"].append((starts[i], q_len, _context_slots(meta, [i], s_len)[0], allowed))
    meta.backend_cache["torch"] = plan
    return plan


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached K/V (new tokens included).

    query: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    returns: [num_tokens, num_heads, head_dim]
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    plan = _step_plan(meta, sliding_window)

    if plan["decode"] is not None:
        rows, slots, allowed = plan["decode"]
        n, max_len = slots.shape
        # index_select, not advanced indexing: several times faster for row gathers on CPU
        q = query.index_select(0, rows).view(n, num_kv_heads, group, head_dim)  # [n, kv_heads, group, d]
        flat_slots = slots.reshape(-1)
        k = k_flat.index_select(0, flat_slots).view(n, max_len, num_kv_heads, head_dim)
        v = v_flat.index_select(0, flat_slots).view(n, max_len, num_kv_heads, head_dim)
        k = k.to(query.dtype).transpose(1, 2)                      # [n, kv_heads, max_len, d]
        v = v.to(query.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim))

    for start, q_len, slots, allowed in plan["prefill"]:
        q = query[start:start + q_len].view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        k = k_flat.index_select(0, slots).to(query.dtype).transpose(0, 1)  # [kv_heads, s_len, d]
        v = v_flat.index_select(0, slots).to(query.dtype).transpose(0, 1)
        mask = allowed.repeat(group, 1)                             # rows ordered (group, q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:start + q_len] = o.reshape(q_len, num_heads, head_dim)
    return out


def dense_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Plain attention of one contiguous sequence; the yardstick the paged versions are tested against.

    query: [q_len, num_heads, d], the last q_len positions; key, value: [s_len, num_kv_heads, d]
    """
    q_len, num_heads, _ = query.shape
    s_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.repeat_interleave(group, dim=1).transpose(0, 1).float()
    v = value.repeat_interleave(group, dim=1).transpose(0, 1).float()
    q = query.transpose(0, 1).float()
    scores = (q @ k.transpose(1, 2)) * scale                        # [heads, q_len, s_len]
    q_pos = torch.arange(s_len - q_len, s_len)[:, None]
    k_pos = torch.arange(s_len)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
