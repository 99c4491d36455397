"""INT4 weights from llm-compressor's pack-quantized checkpoints (`quant_method: compressed-tensors`, `format:
pack-quantized`: Kimi K2 Thinking's and K2.5's routed experts, the `-quantized.w4a16` releases). Each quantized
linear layer X is stored as three tensors:

- `X.weight_packed` int32 [out, in / 8]: eight 4-bit values a word, the first in the lowest bits, each the signed
  value plus 8 (0 .. 15);
- `X.weight_scale` [out, in / group] (the model's dtype): one scale per `group_size` inputs of a row;
- `X.weight_shape` int [2]: the float weight's shape (its columns unpadded).

    weight[r, c] = (nibble[r, c] - 8) x scale[r, c // group]      (symmetric: no zero point)

A little-endian word's bytes hold values (0, 1), (2, 3) ..., the low nibble first: MXFP4's byte layout
(`kernels.mxfp4`), so a held weight is half a byte plus its share of a scale. Served: 4-bit integers, symmetric, one
scale a group (`strategy: group`), the weights alone quantized; anything else is refused naming its key. Which
layers are stored so is the config's `targets` and `ignore` (`int4_modules`, `int4_quantizes`). How the model holds
them is the device's `quantization` (`engine.models.held_packed`, `held_int4`): the routed experts
(`SparseMoeBlock.hold_packed`) and a decoder layer's projections (`engine.layers.int4_linear`) kept as stored under
`auto` on a GPU and `int4` (or `fp8`) anywhere; every other INT4 tensor, and all of them otherwise, dequantized to
the model's dtype as read (`dequantize_int4`: the product in float32, rounded once).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from engine.config import ConfigError

__all__ = ["INT4_STD", "INT4_SUFFIXES", "dequantize_int4", "int4_group", "int4_modules", "int4_quantizes",
           "int4_tensors", "packed_bytes"]

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


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Held INT4 weights as `dtype`: packed [..., rows, cols / 2] uint8 (two values a byte, the low nibble first,
    each the value plus 8), scales [..., rows, cols / group] -> [..., rows, cols]: each value times its group's scale
    in float32, rounded once to `dtype`."""
    rows, half = packed.shape[-2:]
    group = 2 * half // scales.shape[-1]
    if packed.dtype != torch.uint8 or scales.shape[:-1] != packed.shape[:-1] or group * scales.shape[-1] != 2 * half:
        raise ValueError(f"INT4 bytes [..., rows, inputs / 2] and scales [..., rows, groups] of whole groups: got "
                         f"{tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)}")
    values = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).to(torch.int8) - 8   # [..., rows, cols]
    return (values.float().unflatten(-1, (-1, group)) * scales.float()[..., None]).flatten(-2).to(dtype)


def int4_tensors(weights: Iterable[tuple[str, torch.Tensor]], keep: Callable[[str, torch.Tensor], bool],
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each INT4 layer's three read together: `X.blocks` (its bytes, [out, in / 2]) and
    `X.scales` where `keep(X.weight, shape)` says the model holds it as stored, else `X.weight` dequantized to
    `dtype`; the rest as they come. ValueError naming a layer whose tensors do not fit or do not all come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in INT4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        key = name[:-len(suffix)]
        parts = pending.setdefault(key, {})
        parts[suffix] = tensor
        if len(parts) < 3:
            continue
        del pending[key]
        shape = tuple(int(n) for n in parts[".weight_shape"].flatten().tolist())
        packed, scales = packed_bytes(parts[".weight_packed"]), parts[".weight_scale"]
        if len(shape) != 2 or tuple(packed.shape) != (shape[0], (shape[1] + 7) // 8 * 4):
            raise ValueError(f"{key}.weight_packed: shape {tuple(parts['.weight_packed'].shape)} does not hold a "
                             f"weight of {shape}")
        packed = packed[:, :shape[1] // 2]   # a row padded to whole words
        if keep(f"{key}.weight", torch.Size(shape)):
            yield f"{key}.blocks", packed
            yield f"{key}.scales", scales
            continue
        try:
            yield f"{key}.weight", dequantize_int4(packed, scales, dtype)
        except ValueError as exc:
            raise ValueError(f"{key}.weight_scale: {exc}") from None
    if pending:
        key, parts = next(iter(pending.items()))
        missing = [s for s in INT4_SUFFIXES if s not in parts]
        raise ValueError(f"{key}{missing[0]}: missing beside {key}{next(iter(parts))} (an INT4 layer is stored as "
                         f"{', '.join(INT4_SUFFIXES)})")
