"""The capacity formula, in one place: how much KV cache a device holds and what a pool gets of it.

    KV bytes      = memory_utilization x memory - weights            (0.9 x VRAM - weights by default)
    blocks        = floor(pool KV bytes / (S_KV x block_size))
    max_num_seqs  = floor(pool KV bytes / (S_KV x avg_len + S_state))

S_state: the bytes a running sequence holds whatever its length (the state of linear-attention layers, Qwen3.5's;
0 for a transformer); a pool's blocks are then what its max_num_seqs states leave.

`pools.capacity_plan` plans every pool with these functions before anything loads (`cliffguard capacity`,
`serve`, `generate`, the benchmarks); the engine calls `kv_cache_bytes` once more after loading,
with the device's measured memory and the weights it actually loaded, to refuse a plan that does
not fit the device it runs on. Ints in, ints out: no torch.
"""

from __future__ import annotations

DEFAULT_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16   # tokens per KV block where a pool names none (kernels.metadata.BLOCK_SIZES: 8, 16, 32)


def usable_bytes(memory_bytes: int, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> int:
    """`memory_utilization x memory`: what weights and KV cache may take (the rest is for activations)."""
    return int(memory_utilization * memory_bytes)


def kv_cache_bytes(memory_bytes: int, weights_bytes: int,
                   memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> int:
    """The bytes a device has for KV blocks: `memory_utilization x memory - weights` (may be <= 0)."""
    return usable_bytes(memory_bytes, memory_utilization) - weights_bytes


def num_blocks(pool_kv_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that `pool_kv_bytes` hold."""
    return pool_kv_bytes // (kv_bytes_per_token * block_size)


def max_num_seqs(pool_kv_bytes: int, kv_bytes_per_token: int, avg_len: int, state_bytes: int = 0) -> int:
    """Requests of `avg_len` tokens (prompt + output) whose K/V (and states) fit in `pool_kv_bytes` at once."""
    return pool_kv_bytes // (kv_bytes_per_token * avg_len + state_bytes)
