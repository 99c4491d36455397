"""Integer weights from llm-compressor's pack-quantized checkpoints (`quant_method: compressed-tensors`, `format:
pack-quantized`: Kimi K2 Thinking's and K2.5's routed experts, the `-quantized.w4a16` and `-quantized.w8a16`
releases). Each quantized linear layer X is stored as three tensors (four under an asymmetric scheme:
`engine.int4_formats` reads them all, and AWQ's and GPTQ's):

- `X.weight_packed` int32 [out, in x bits / 32]: 32 / bits values a word (eight of 4 bits, four of 8), the first in
  the lowest bits, each the signed value plus 2^(bits - 1) (8 or 128);
- `X.weight_scale` [out, in / group] (the model's dtype): one scale per `group_size` inputs of a row (one a row under
  `strategy: channel`);
- `X.weight_shape` int [2]: the float weight's shape (its columns unpadded).

    weight[r, c] = (code[r, c] - 2^(bits - 1)) x scale[r, c // group]      (symmetric: no zero point; else its code's)

A little-endian word's bytes hold values (0, 1), (2, 3) ... of 4 bits, the low nibble first (MXFP4's byte layout,
`kernels.mxfp4`), or one value of 8 bits each: a held weight is half a byte or a byte plus its share of a scale. The
names say INT4, the first width served; every one of them reads the 8-bit checkpoints (W8A16) too, where `bits` says
so. Served: 4- or 8-bit integers, one scale (and an asymmetric scheme's zero point) a group (`strategy: group`) or a
row (`channel`), the weights alone quantized; anything else is refused naming its key. Which layers are stored so is
the config's `targets` and `ignore` (`int4_modules`, `int4_quantizes`). How the model holds them is the device's
`quantization` (`engine.models.held_packed`, `held_int4`): the routed experts (`SparseMoeBlock.hold_packed`) and a
decoder layer's projections (`engine.layers.int4_linear`) kept as stored under `auto` on a GPU and `int4` /
`int8` (the checkpoint's width) or `fp8` anywhere; every other integer tensor, and all of them otherwise, dequantized
to the model's dtype as read (`dequantize_int4`: the product in float32, rounded once).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.config import ConfigError

__all__ = ["INT4_SUFFIXES", "WEIGHT_BITS", "code_std", "dequantize_int4", "int4_modules", "int4_quantizes",
           "pack_quantized_weights", "packed_bytes"]

INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
WEIGHT_BITS = (4, 8)   # the integer codes' widths served


def code_std(bits: int) -> float:
    """The standard deviation of uniformly drawn signed codes of `bits` (-8 .. 7: 4.61; -128 .. 127: 73.9)."""
    half = 1 << (bits - 1)
    return (sum((v - half) ** 2 for v in range(2 * half)) / (2 * half)) ** 0.5


def pack_quantized_weights(quant: Any, key: str) -> tuple[int, int] | None:
    """(bits, group) of a pack-quantized or int-quantized checkpoint's `quantization_config` (`key`: its key in
    config.json; group 0: a scale a row, `strategy: channel`), None for another kind; a ConfigError naming what it
    says that is not served. int-quantized (W8A8's: 8-bit weights stored as int8) may quantize its activations too
    (`input_activations`: 8-bit integers, per token or tensor); they are not quantized here, as an FP8 checkpoint's
    are not (`engine.fp8_weights`)."""
    form = quant.get("format") if isinstance(quant, dict) else None
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or form not in ("pack-quantized", "int-quantized"):
        return None
    groups, layouts = quant.get("config_groups"), set()
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key}.config_groups: a {form} checkpoint names its weights' scheme, got {groups!r}")
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        layouts.add(_weight_layout(group.get("weights") if isinstance(group, dict) else None, where, form))
        acts = group.get("input_activations")
        if acts and (form != "int-quantized" or not isinstance(acts, dict) or acts.get("type") != "int"
                     or acts.get("num_bits") != 8):
            raise ConfigError(f"{where}.input_activations: quantized activations are served with int-quantized 8-bit "
                              f"weights as 8-bit integers (W8A8), got {acts!r:.160}")
        if group.get("output_activations"):
            raise ConfigError(f"{where}.output_activations: quantized outputs are not served")
    if len(layouts) != 1:
        raise ConfigError(f"{key}.config_groups: one width and group size for every group, got "
                          f"{sorted(layouts)} ((bits, group size); 0: a row)")
    return layouts.pop()


def _weight_layout(weights: Any, where: str, form: str) -> tuple[int, int]:
    """(bits, group) of one config group's `weights` (`where`: its key); a ConfigError naming what is not served."""
    if not isinstance(weights, dict) or weights.get("type") != "int" \
            or weights.get("num_bits") not in (WEIGHT_BITS if form == "pack-quantized" else (8,)) \
            or not isinstance(weights.get("symmetric"), bool) or weights.get("strategy") not in ("group", "channel"):
        raise ConfigError(f"{where}.weights: served are 4- or 8-bit integers (int-quantized: 8), symmetric or not, a "
                          f"scale a group or a row (W4A16, W8A16, W8A8), got {weights!r:.160}")
    if weights.get("actorder") not in (None, False) or weights.get("dynamic") not in (None, False):
        raise ConfigError(f"{where}.weights: activation-ordered or dynamic groups are not served")
    size = weights.get("group_size") if weights["strategy"] == "group" else 0
    if not isinstance(size, int) or isinstance(size, bool) or weights["strategy"] == "group" and (size < 2 or size % 2):
        raise ConfigError(f"{where}.weights.group_size: an even number of inputs, got {size!r}")
    return weights["num_bits"], size


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
    """int32 words [..., in x bits / 32] as their bytes [..., in x bits / 8], the lowest bits first (two 4-bit
    values a byte, the low nibble first; one 8-bit value a byte)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integer weights are int32 words, got {packed.dtype}")
    return packed.contiguous().view(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, zeros: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None, bits: int = 4) -> torch.Tensor:
    """Held integer weights as `dtype`: packed [..., rows, cols x bits / 8] uint8 (4 bits: two codes a byte, the low
    nibble first; 8 bits: a code a byte), scales [..., rows, groups] and zeros [..., rows, groups] (uint8; None:
    2^(bits - 1), a symmetric scheme's) -> [..., rows, cols]: each (code - its group's zero) times its group's scale
    in float32, rounded once to `dtype`. A column's group is its position's (cols / groups of them each), or
    `g_idx`'s [cols] (GPTQ's activation order)."""
    rows, width = packed.shape[-2:]
    cols, groups = width * 8 // bits, scales.shape[-1]
    whole = g_idx is None and groups and cols % groups == 0
    if bits not in WEIGHT_BITS or packed.dtype != torch.uint8 or scales.shape[:-1] != packed.shape[:-1] or not (
            whole or g_idx is not None and tuple(g_idx.shape) == (cols,)) \
            or zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"{bits}-bit codes [..., rows, inputs x {bits} / 8] uint8 and scales [..., rows, groups] of "
                         f"whole groups: got {tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)}")
    codes = packed if bits == 8 else torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    codes, middle = codes.float(), float(1 << (bits - 1))   # [..., rows, cols]
    if g_idx is not None:
        zero = middle if zeros is None else zeros.float()[..., g_idx]
        return ((codes - zero) * scales.float()[..., g_idx]).to(dtype)
    zero = middle if zeros is None else zeros.float()[..., None]
    return ((codes.unflatten(-1, (groups, -1)) - zero) * scales.float()[..., None]).flatten(-2).to(dtype)
