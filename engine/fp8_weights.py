"""FP8 checkpoints, served dequantized to the model's dtype as they are read:

- with block scales (`quantization_config.quant_method: fp8`, `weight_block_size`: DeepSeek V3's and R1's, Kimi K2's,
  MiniMax-M2's, Qwen3's `-FP8` releases): each quantized projection is stored as `X.weight` in float8_e4m3fn and
  `X.weight_scale_inv` in float32, one scale per `weight_block_size` block of the weight ([128, 128]: rows,
  columns; the last blocks may be partial); without `weight_block_size` (Mistral's FP8 releases: Ministral 3,
  Devstral 2) one scale for the tensor, and a static scheme's `X.activation_scale`, not read;
- llm-compressor's (`quant_method: compressed-tensors`, `format: float-quantized`: the `-FP8` and `-FP8-dynamic`
  releases of Llama, Qwen, Mistral models): `X.weight` in float8_e4m3fn and `X.weight_scale`, one scale per output
  channel ([rows, 1], `strategy: channel`), one for the whole tensor (`strategy: tensor`) or one per block
  (`strategy: block`, `block_structure`); a static activation scheme's `X.input_scale` is not read;
- FBGEMM's (`quant_method: fbgemm_fp8`: Meta's `-FP8` releases of Llama 3.1 405B): `X.weight` and a `X.weight_scale`
  per output channel ([rows, 1]), the modules it does not convert left in float.

The weight is the FP8 values times their scale, as transformers dequantizes it where no GPU runs FP8 matmuls. The
model then holds, and the capacity plan counts, weights of its dtype (bfloat16: twice the checkpoint's bytes); the
activations are never quantized (`activation_scheme`, `input_activations` do not matter). A per-channel or per-tensor
scale is a block spanning the whole row or tensor (`WHOLE`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ConfigError

__all__ = ["SCALE_SUFFIX", "WHOLE", "dequantize_fp8_blocks", "fp8_weight_block", "fp8_weights"]

SCALE_SUFFIX = ".weight_scale_inv"    # the block-scaled format's; llm-compressor's is ".weight_scale"
WHOLE = 2 ** 31 - 1                  # a block side spanning its whole axis (a per-channel or per-tensor scale)
_STRATEGY_BLOCKS = {"tensor": (WHOLE, WHOLE), "channel": (1, WHOLE)}


def fp8_weights(quant: Any, key: str) -> tuple[tuple[int, int], str] | None:
    """(scale block, scale tensor suffix) of an FP8 checkpoint's `quantization_config` (`key`: its key in
    config.json), either format; None for another kind; a ConfigError naming what it says otherwise."""
    block = fp8_weight_block(quant, key)
    if block is not None:
        return block, SCALE_SUFFIX
    if isinstance(quant, dict) and quant.get("quant_method") == "fbgemm_fp8":
        return _STRATEGY_BLOCKS["channel"], ".weight_scale"
    block = _compressed_fp8_block(quant, key)
    return None if block is None else (block, ".weight_scale")


def _compressed_fp8_block(quant: Any, key: str) -> tuple[int, int] | None:
    """The scale block of llm-compressor's FP8 weights (`format: float-quantized`, every config group's weights 8-bit
    floats, symmetric, one strategy); None for a compressed-tensors config without weight groups (a KV cache scheme
    alone, `engine.config.quantizes_kv_cache_only`) or another method."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or not quant.get("config_groups"):
        return None
    if quant.get("format") != "float-quantized":
        raise ConfigError(f"{key}.format: compressed-tensors checkpoints are served as FP8 weights (float-quantized), "
                          f"got {quant.get('format')!r}")
    for part in ("sparsity_config", "transform_config"):
        if quant.get(part):
            raise ConfigError(f"{key}.{part}: compressed-tensors weights with a {part.split('_')[0]} are not served")
    groups, blocks = quant["config_groups"], set()
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        weights = group.get("weights") if isinstance(group, dict) else None
        where = f"{key}.config_groups.{name}.weights"
        if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8 \
                or weights.get("symmetric", True) is not True:
            raise ConfigError(f"{where}: served are 8-bit float weights, symmetric (FP8), got {weights!r:.120}")
        strategy = weights.get("strategy")
        structure = weights.get("block_structure")
        if strategy == "block" and isinstance(structure, list) and len(structure) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in structure):
            blocks.add(tuple(structure))
        elif strategy in _STRATEGY_BLOCKS:
            blocks.add(_STRATEGY_BLOCKS[strategy])
        else:
            raise ConfigError(f"{where}.strategy: tensor, channel or block (with a block_structure of two sizes), "
                              f"got {strategy!r} ({structure!r})")
    if len(blocks) != 1:
        raise ConfigError(f"{key}.config_groups: one weight scheme for every group, got {len(blocks)}")
    return blocks.pop()


def fp8_weight_block(quant: Any, key: str) -> tuple[int, int] | None:
    """The (rows, columns) block of an FP8 block-scaled checkpoint's `quantization_config` (`key`: its key in
    config.json), None for another kind; a ConfigError naming what it says otherwise."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if block is None:   # transformers' per-tensor FP8: one scale a weight
        return _STRATEGY_BLOCKS["tensor"]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                 and b > 0 for b in block)):
        raise ConfigError(f"{key}.weight_block_size: two positive integers (DeepSeek's [128, 128]) or null (a scale "
                          f"for the tensor), got {block!r}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{key}.fmt: FP8 weights are read as e4m3, got {quant['fmt']!r}")
    return block[0], block[1]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [rows, columns] float8_e4m3fn, scale_inv [ceil(rows / block rows), ceil(columns / block columns)]
    -> the float32 weight: each value times its block's scale. A per-channel scale may come as [rows], a
    per-tensor one as [] or [1]. ValueError for shapes that do not pair."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight is a float8_e4m3fn matrix, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if scale_inv.dim() < 2 and scale_inv.numel() == want[0] * want[1] and want[1] == 1:
        scale_inv = scale_inv.reshape(want)   # llm-compressor's per-channel [rows] or per-tensor [] / [1]
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight {tuple(weight.shape)} in blocks of {_blocks(block)} takes scales of shape {want}, "
                         f"got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(min(block[0], rows), dim=0)[:rows]
    scale = scale.repeat_interleave(min(block[1], cols), dim=1)[:, :cols]
    return weight.float() * scale


def _blocks(block: tuple[int, int]) -> str:
    """A scale block as errors name it: [rows, columns], a side spanning its axis as `all`."""
    return "[" + ", ".join("all" if side == WHOLE else str(side) for side in block) + "]"
