"""The KV tensor of one device: every layer's K and V for every block.

Owns the memory, not the indices: which blocks a sequence holds is `engine.block_manager`'s business.
One tensor backs all pools of a device; a pool is a range of its block ids.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    """`num_blocks` blocks of `block_size` slots of K and V for each layer.

    data: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # Zeroed, so that a slot no step has written yet holds finite values.
        self.data = torch.zeros(model.num_layers, 2, num_blocks, block_size, model.num_kv_heads,
                                model.head_dim, dtype=dtype, device=device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.data[i, 0], self.data[i, 1]) for i in range(model.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // self.num_blocks
