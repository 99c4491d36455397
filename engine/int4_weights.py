"""INT4 weights from llm-compressor's pack-quantized checkpoints (`quant_method: compressed-tensors`, `format:
pack-quantized`: Kimi K2 Thinking's and K2.5's routed experts, the `-quantized.w4a16` releases). Each quantized
linear layer X is stored as three tensors (four under an asymmetric scheme: `engine.int4_formats` reads them all, and
AWQ's and GPTQ's):

- `X.weight_packed` int32 [out, in / 8]: eight 4-bit values a word, the first in the lowest bits, each the signed
  value plus 8 (0 .. 15);
- `X.weight_scale` [out, in / group] (the model's dtype): one scale per `group_size` inputs of a row;
- `X.weight_shape` int [2]: the float weight's shape (its columns unpadded).

    weight[r, c] = (nibble[r, c] - 8) x scale[r, c // group]      (symmetric: no zero point; else its nibble's)

A little-endian word's bytes hold values (0, 1), (2, 3) ..., the low nibble first: MXFP4's byte layout
(`kernels.mxfp4`), so a held weight is half a byte plus its share of a scale. Served: 4-bit integers, one scale (and an
asymmetric scheme's zero point) a group (`strategy: group`), the weights alone quantized; anything else is refused
naming its key. Which layers are stored so is the config's `targets` and `ignore` (`int4_modules`, `int4_quantizes`).
How the model holds them is the device's `quantization` (`engine.models.held_packed`, `held_int4`): the routed experts
(`SparseMoeBlock.hold_packed`) and a decoder layer's projections (`engine.layers.int4_linear`) kept as stored under
`auto` on a GPU and `int4` (or `fp8`) anywhere; every other INT4 tensor, and all of them otherwise, dequantized to the
model's dtype as read (`dequantize_int4`: the product in float32, rounded once).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.config import ConfigError

__all__ = ["INT4_STD", "INT4_SUFFIXES", "dequantize_int4", "int4_group", "int4_modules", "int4_quantizes",
           "packed_bytes"]

INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
INT4_STD = (sum((v - 8) ** 2 for v in range(16)) / 16) ** 0.5   # of uniformly drawn values, -8 .. 7: 4.64


def int4_group(quant: Any, key: str) -> int | None:
    """The group size of a pack-quantized INT4 checkpoint's `quantization_config` (`key`: its key in config.json),
    None for another kind; a ConfigError naming what it says that is not served."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or quant.get("format") != "pack-quantized":
        return None
    groups, sizes = quant.get("config_groups"), set()
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key}.config_groups: a pack-quantized checkpoint names its weights' scheme, got {groups!r}")
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict) or weights.get("type") != "int" or weights.get("num_bits") != 4 \
                or weights.get("symmetric") is not True or weights.get("strategy") != "group":
            raise ConfigError(f"{where}.weights: served are 4-bit integers, symmetric, a scale a group (W4A16), got "
                              f"{weights!r:.160}")
        if weights.get("actorder") not in (None, False) or weights.get("dynamic") not in (None, False):
            raise ConfigError(f"{where}.weights: activation-ordered or dynamic groups are not served")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 2 or size % 2:
            raise ConfigError(f"{where}.weights.group_size: an even number of inputs, got {size!r}")
        for part in ("input_activations", "output_activations"):
            if group.get(part):
                raise ConfigError(f"{where}.{part}: the activations are not quantized (W4A16 only)")
        sizes.add(size)
    if len(sizes) != 1:
        raise ConfigError(f"{key}.config_groups: one group size for every group, got {sorted(sizes)}")
    return sizes.pop()


def int4_modules(quant: dict[str, Any], key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(targets, ignore) of a pack-quantized checkpoint's `quantization_config` (`key`: its key in config.json;
    `int4_group` read it first): the modules its groups quantize and those it leaves in float, each a module name, a
    class name ("Linear") or a regular expression after "re:", as compressed-tensors matches them (`int4_quantizes`)."""
    lists = {f"config_groups.{name}.targets": group.get("targets") or ()
             for name, group in quant["config_groups"].items()} | {"ignore": quant.get("ignore") or ()}
    for part, names in lists.items():
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{key}.{part}: a list of module names or patterns, got {names!r:.120}")
    targets = tuple(t for part, names in lists.items() if part != "ignore" for t in names)
    return targets or ("Linear",), tuple(lists["ignore"])


def int4_quantizes(modules: tuple[tuple[str, ...], tuple[str, ...]], name: str) -> bool:
    """Whether the checkpoint stores linear layer `name` (its name in the checkpoint, without a tensor's suffix) in
    INT4: some target matches it and nothing it ignores does (`int4_modules`)."""
    def match(pattern: str) -> bool:
        return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else pattern in (name, "Linear")
    targets, ignore = modules
    return any(map(match, targets)) and not any(map(match, ignore))


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., in / 8] as their bytes [..., in / 2], two values a byte, the low nibble first."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed INT4 weights are int32 words, got {packed.dtype}")
    return packed.contiguous().view(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, zeros: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Held INT4 weights as `dtype`: packed [..., rows, cols / 2] uint8 (two codes a byte, the low nibble first),
    scales [..., rows, groups] and zeros [..., rows, groups] (uint8; None: 8, a symmetric scheme's) -> [..., rows,
    cols]: each (code - its group's zero) times its group's scale in float32, rounded once to `dtype`. A column's
    group is its position's (cols / groups of them each), or `g_idx`'s [cols] (GPTQ's activation order)."""
    rows, half = packed.shape[-2:]
    groups = scales.shape[-1]
    whole = g_idx is None and groups and (2 * half) % groups == 0
    if packed.dtype != torch.uint8 or scales.shape[:-1] != packed.shape[:-1] or not (whole or g_idx is not None
            and tuple(g_idx.shape) == (2 * half,)) or zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"INT4 bytes [..., rows, inputs / 2] and scales [..., rows, groups] of whole groups: got "
                         f"{tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).float()   # [..., rows, cols]
    if g_idx is not None:
        zero = 8.0 if zeros is None else zeros.float()[..., g_idx]
        return ((codes - zero) * scales.float()[..., g_idx]).to(dtype)
    zero = 8.0 if zeros is None else zeros.float()[..., None]
    return ((codes.unflatten(-1, (groups, -1)) - zero) * scales.float()[..., None]).flatten(-2).to(dtype)
