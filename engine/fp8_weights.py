"""FP8 checkpoints with block scales (`quantization_config.quant_method: fp8`, `weight_block_size`: DeepSeek V3's and
R1's, Kimi K2's, MiniMax-M2's, Qwen3's `-FP8` releases), served dequantized to the model's dtype as they are read.

Each quantized projection is stored as `X.weight` in float8_e4m3fn and `X.weight_scale_inv` in float32, one scale
per `weight_block_size` block of the weight ([128, 128]: rows, columns; the last blocks may be partial); the weight is
the FP8 values times their block's scale, as transformers dequantizes it where no GPU runs FP8 matmuls. The model
then holds, and the capacity plan counts, weights of its dtype (bfloat16: twice the checkpoint's bytes); the
activations are never quantized (`activation_scheme` does not matter).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ConfigError

__all__ = ["SCALE_SUFFIX", "dequantize_fp8_blocks", "fp8_weight_block"]

SCALE_SUFFIX = ".weight_scale_inv"


def fp8_weight_block(quant: Any, key: str) -> tuple[int, int] | None:
    """The (rows, columns) block of an FP8 block-scaled checkpoint's `quantization_config` (`key`: its key in
    config.json), None for another kind; a ConfigError naming what it says otherwise."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                 and b > 0 for b in block)):
        raise ConfigError(f"{key}.weight_block_size: FP8 checkpoints are served with block scales, two positive "
                          f"integers (DeepSeek's [128, 128]), got {block!r}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{key}.fmt: FP8 weights are read as e4m3, got {quant['fmt']!r}")
    return block[0], block[1]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [rows, columns] float8_e4m3fn, scale_inv [ceil(rows / block rows), ceil(columns / block columns)]
    -> the float32 weight: each value times its block's scale. ValueError for shapes that do not pair."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight is a float8_e4m3fn matrix, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight {tuple(weight.shape)} in blocks of {list(block)} takes scales of shape {want}, got "
                         f"{tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale
