"""The integer checkpoints we read (4 bits, and 8: W8A16), each turned as it is read into one held form
(`engine.int4_weights`): codes two a byte [out, in / 2] (4 bits) or one a byte [out, in] (8 bits), a scale for each
group of inputs of a row [out, in / group], and where the format has them a zero point a group [out, in / group]
(uint8):

    weight[r, c] = (code[r, c] - zero[r, c // group]) x scale[r, c // group]   (zero 2^(bits - 1) where none is stored)

- llm-compressor's pack-quantized (`quant_method: compressed-tensors`, `format: pack-quantized`; `engine.int4_weights`
  reads its config): `X.weight_packed` int32 [out, in x bits / 32] (sequential, the first value in the lowest bits,
  each the signed value plus 2^(bits - 1)), `X.weight_scale`, `X.weight_shape`, and for an asymmetric scheme
  `X.weight_zero_point` int32 [out x bits / 32, groups] packed along the rows (the signed zero plus 2^(bits - 1)).
  Its `W4A16_ASYM`, `W8A16` and AWQ recipes write these (a scale a row: `strategy: channel`, group 0).
- llm-compressor's int-quantized (`format: int-quantized`: the `-quantized.w8a8` releases): `X.weight` int8 [out, in]
  (the signed values), `X.weight_scale` [out, groups] and, asymmetric, `X.weight_zero_point` int8 [out, groups]. Its
  activations' scheme (`input_activations`, 8-bit per token or tensor) is not applied: the activations stay in the
  model's dtype, as an FP8 checkpoint's do (`engine.fp8_weights`), and a static scheme's `X.input_scale` is not
  read.
- AutoAWQ's (`quant_method: awq`, `version: gemm`: the `-AWQ` releases of Qwen, Llama, Mistral ...): `X.qweight`
  int32 [in, out / 8] and `X.qzeros` int32 [in / group, out / 8], eight outputs a word in AWQ's order (the word's
  nibbles hold outputs 0, 2, 4, 6, 1, 3, 5, 7 of its eight, the lowest first), `X.scales` [in / group, out].
- GPTQ's (`quant_method: gptq`: AutoGPTQ's and GPTQModel's, the `-GPTQ-Int4` and `-GPTQ-Int8` releases): `X.qweight`
  int32 [in x bits / 32, out] (32 / bits inputs a word, the first in the lowest bits), `X.qzeros` int32 [in / group,
  out x bits / 32] (outputs in order), `X.scales` [in / group, out], `X.g_idx` [in] (each input's group;
  `group_size: -1`, a scale a row, is group 0). In the format
  `checkpoint_format: gptq` (v1, the default) each zero is stored less one, as GPTQ's kernels read it. Under
  `desc_act: true` (activation order) an input's group is `g_idx`'s, not its position's: a layer held as stored keeps
  its inputs sorted by group (`X.perm`, the order `Int4Linear` gathers its input in, as vLLM's kernels do), one
  dequantized as read gathers each input's scale (`dequantize_int4`).

Served: 4 bits (AWQ), 4 or 8 (GPTQ, pack-quantized), one group size, the weights alone quantized. Which layers a
checkpoint quantizes (`int4_modules`' (targets, ignore), matched by `engine.int4_weights.int4_quantizes`): for AWQ
and GPTQ every linear layer of the decoder layers, less those `modules_to_not_convert` names (a part of the name, as
AutoAWQ matches it), or those `modules_in_block_to_quantize` lists alone. Anything else the config says that is not
served is refused naming its key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ConfigError
from engine.int4_weights import INT4_SUFFIXES, WEIGHT_BITS, dequantize_int4, int4_modules, pack_quantized_weights

__all__ = ["Int4Scheme", "int4_scheme", "int4_tensors", "pack_codes", "unpack_words"]

AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)   # output j of a word's eight: its nibble's place in AWQ's order
_DECODER_LAYERS = r"re:.*\blayers\.\d+\."


@dataclass(frozen=True)
class Int4Scheme:
    """How a checkpoint stores its integer weights: `format` ("pack-quantized", "awq", "gptq" or "gptq_v2"), the
    inputs a scale covers (`group`; 0: a row), whether zero points are stored (`zero_points`), whether an input's
    group is `g_idx`'s (`act_order`), the layers quantized (`modules`: (targets, ignore)), and a code's `bits`."""

    format: str
    group: int
    zero_points: bool
    act_order: bool
    modules: tuple[tuple[str, ...], tuple[str, ...]]
    bits: int = 4

    @classmethod
    def of(cls, config: Any) -> "Int4Scheme":
        """The scheme a `ModelConfig` read (its `int4_*` fields)."""
        return cls(config.int4_format, config.int4_group, config.int4_zero_points, config.int4_act_order,
                   config.int4_modules, config.int4_bits)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The tensors each quantized layer X stores, after X."""
        zero_point = (".weight_zero_point",) if self.zero_points else ()
        if self.format == "pack-quantized":
            return INT4_SUFFIXES + zero_point
        if self.format == "int-quantized":
            return (".weight", ".weight_scale") + zero_point
        return (".qweight", ".qzeros", ".scales") + ((".g_idx",) if self.format.startswith("gptq") else ())

    def part_of(self, name: str, tensor: torch.Tensor) -> str | None:
        """The suffix of checkpoint tensor `name` where it is a quantized layer's (`suffixes`), "" where it is not
        read (an int-quantized checkpoint's static activation scales), None for any other tensor."""
        if self.format == "int-quantized":
            if name.endswith((".input_scale", ".input_zero_point")):
                return ""
            if name.endswith(".weight") and tensor.dtype != torch.int8:   # a float layer's
                return None
        return next((s for s in self.suffixes if name.endswith(s)), None)


def int4_scheme(quant: Any, key: str) -> Int4Scheme | None:
    """The integer scheme of config.json's `quantization_config` (`key`: its key there), None for another method; a
    ConfigError naming what it says that is not served."""
    layout = pack_quantized_weights(quant, key)
    if layout is not None:
        symmetric = all(g["weights"]["symmetric"] for g in quant["config_groups"].values())
        return Int4Scheme(quant["format"], layout[1], not symmetric, False, int4_modules(quant, key), layout[0])
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in ("awq", "gptq"):
        return None
    bits = quant.get("bits", quant.get("w_bit"))
    if bits not in ((4,) if method == "awq" else WEIGHT_BITS):
        raise ConfigError(f"{key}.bits: {method.upper()} checkpoints of {'4' if method == 'awq' else '4 or 8'} bits "
                          f"are served, got {bits!r}")
    size = quant.get("group_size", quant.get("q_group_size"))
    if size == -1 and method == "gptq":
        size = 0   # a scale a row
    elif not isinstance(size, int) or isinstance(size, bool) or size < 2 or size % 2:
        raise ConfigError(f"{key}.group_size: an even number of inputs a scale covers, got {size!r}"
                          + (" (a scale a whole row, -1, is served for GPTQ)" if method == "awq" else ""))
    return _awq_scheme(quant, key, size) if method == "awq" else _gptq_scheme(quant, key, size, bits)


def _awq_scheme(quant: dict[str, Any], key: str, group: int) -> Int4Scheme:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"{key}.version: AWQ's gemm layout is served, got {quant.get('version')!r}")
    if quant.get("zero_point", True) is not True:
        raise ConfigError(f"{key}.zero_point: AWQ checkpoints with zero points are served, got "
                          f"{quant.get('zero_point')!r}")
    skipped = _names(quant, key, "modules_to_not_convert")
    return Int4Scheme("awq", group, True, False, ((_DECODER_LAYERS,), tuple(f"re:.*{re.escape(n)}" for n in skipped)))


def _gptq_scheme(quant: dict[str, Any], key: str, group: int, bits: int) -> Int4Scheme:
    form = quant.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{key}.checkpoint_format: gptq or gptq_v2 is served, got {form!r}")
    for flag in ("desc_act", "sym"):
        if not isinstance(quant.get(flag, flag == "sym"), bool):
            raise ConfigError(f"{key}.{flag}: true or false, got {quant.get(flag)!r}")
    if quant.get("dynamic"):
        raise ConfigError(f"{key}.dynamic: per-module GPTQ settings are not served")
    if quant.get("lm_head"):
        raise ConfigError(f"{key}.lm_head: a quantized lm_head is not served")
    blocks = quant.get("modules_in_block_to_quantize") or []
    if not isinstance(blocks, list) or not all(isinstance(b, list) for b in blocks):
        raise ConfigError(f"{key}.modules_in_block_to_quantize: lists of module names, got {blocks!r:.120}")
    part = "modules_in_block_to_quantize"
    names = _names({part: [n for b in blocks for n in b]}, key, part) if blocks else ()
    targets = tuple(rf"re:.*\blayers\.\d+\.{re.escape(n)}$" for n in names) or (_DECODER_LAYERS,)
    if group == 0 and quant.get("desc_act"):
        raise ConfigError(f"{key}.desc_act: activation order needs groups; group_size -1 has one a row")
    return Int4Scheme(form, group, not quant.get("sym", True), quant.get("desc_act", False), (targets, ()), bits)


def _names(quant: dict[str, Any], key: str, part: str) -> tuple[str, ...]:
    names = quant.get(part) or ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{key}.{part}: a list of module names, got {names!r:.120}")
    return tuple(names)


def unpack_words(words: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int32 words [rows, cols] as their 32 / bits values of `bits` (uint8), the lowest bits first, spread along
    `dim` (0: [32 / bits x rows, cols]; 1: [rows, 32 / bits x cols])."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"packed {bits}-bit values are int32 words [rows, cols], got {words.dtype} "
                         f"{tuple(words.shape)}")
    mask = (1 << bits) - 1
    values = torch.stack([(words >> (bits * i)) & mask for i in range(32 // bits)], dim=dim + 1)
    return values.flatten(dim, dim + 1).to(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Codes [rows, cols] (uint8) as the held bytes: of 4 bits [rows, cols / 2], an even input's the low nibble; of
    8, the codes themselves."""
    if bits == 8:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]   # codes, scales, zeros, g_idx


def _decode(scheme: Int4Scheme, key: str, parts: dict[str, torch.Tensor]) -> Decoded:
    """One layer's stored tensors as (codes [out, in] uint8, scales [out, groups], zeros [out, groups] uint8 or None
    where every one is 2^(bits - 1), each input's group [in] or None where it is its position's); ValueError naming
    the tensor that does not fit."""
    bits, middle = scheme.bits, 1 << (scheme.bits - 1)
    if scheme.format == "int-quantized":   # int8 values [out, in], the zero points [out, groups] likewise
        zeros = parts.get(".weight_zero_point")
        return _offset(parts[".weight"]), parts[".weight_scale"], None if zeros is None else _offset(zeros), None
    if scheme.format == "pack-quantized":
        shape = tuple(int(n) for n in parts[".weight_shape"].flatten().tolist())
        packed, per_word = parts[".weight_packed"], 32 // bits
        if len(shape) != 2 or tuple(packed.shape) != (shape[0], (shape[1] + per_word - 1) // per_word):
            raise ValueError(f"{key}.weight_packed: shape {tuple(packed.shape)} does not hold a weight of {shape} in "
                             f"{bits}-bit values")
        codes, scales = unpack_words(packed, 1, bits)[:, :shape[1]], parts[".weight_scale"]
        zeros = parts.get(".weight_zero_point")
        if zeros is not None:
            zeros = _fitted(key, ".weight_zero_point", unpack_words(zeros, 0, bits), (shape[0], scales.shape[-1]))
        return codes, scales, zeros, None
    qweight, qzeros, scales = parts[".qweight"], parts[".qzeros"], parts[".scales"]
    awq = scheme.format == "awq"
    codes = unpack_words(qweight, 1 if awq else 0, bits)
    zeros = unpack_words(qzeros, 1, bits)
    if awq:   # each word's eight outputs from AWQ's order
        codes, zeros = (t.unflatten(-1, (-1, 8))[..., AWQ_COLUMNS].flatten(-2) for t in (codes, zeros))
    elif scheme.format == "gptq":
        zeros = zeros + 1   # stored less one (v1)
    inputs, outputs = codes.shape
    group = scheme.group or inputs
    groups = -(-inputs // group)
    scales = _fitted(key, ".scales", scales, (groups, outputs)).t().contiguous()
    zeros = _fitted(key, ".qzeros", zeros, (groups, outputs)).t().contiguous()
    g_idx = parts.get(".g_idx")
    if g_idx is not None:
        g_idx = _fitted(key, ".g_idx", g_idx.long(), (inputs,))
        if not scheme.act_order and not torch.equal(g_idx, torch.arange(inputs) // group):
            raise ValueError(f"{key}.g_idx: inputs out of their groups' order where desc_act is false")
        g_idx = g_idx if scheme.act_order else None
    if not scheme.zero_points:
        if not bool((zeros == middle).all()):
            raise ValueError(f"{key}.qzeros: a symmetric (sym: true) checkpoint's zero points are {middle}, got "
                             f"{sorted(set(zeros.flatten().tolist()))[:4]}")
        zeros = None
    return codes.t().contiguous(), scales, zeros, g_idx


def _offset(values: torch.Tensor) -> torch.Tensor:
    """Signed 8-bit values (int8, as an int-quantized checkpoint stores them) as codes, the value plus 128 (uint8)."""
    if values.dtype != torch.int8:
        raise ValueError(f"int-quantized values are int8, got {values.dtype}")
    return (values.to(torch.int16) + 128).to(torch.uint8)


def _fitted(key: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` cut to `shape` where it is padded to whole words, else a ValueError naming it."""
    if tensor.dim() != len(shape) or any(have < want for have, want in zip(tensor.shape, shape)) \
            or any(have >= want + 8 for have, want in zip(tensor.shape, shape)):
        raise ValueError(f"{key}{suffix}: shape {tuple(tensor.shape)} does not fit the layer's {shape}")
    return tensor[tuple(slice(0, n) for n in shape)]


def int4_tensors(weights: Iterable[tuple[str, torch.Tensor]], scheme: Int4Scheme,
                 keep: Callable[[str, torch.Tensor], bool], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each integer layer's read together (`scheme.suffixes`): `X.blocks` (its codes, two
    a byte [out, in / 2] or one [out, in]), `X.scales` and, where the scheme has them, `X.zeros` where
    `keep(X.weight, shape)` says the
    model holds it as stored, else `X.weight` dequantized to `dtype`; the rest as they come. ValueError naming a
    layer whose tensors do not fit or do not all come."""
    suffixes, pending = scheme.suffixes, {}
    for name, tensor in weights:
        suffix = scheme.part_of(name, tensor)
        if suffix is None:
            yield name, tensor
        if not suffix:
            continue
        key = name[:-len(suffix)]
        parts = pending.setdefault(key, {})
        parts[suffix] = tensor
        if len(parts) < len(suffixes):
            continue
        del pending[key]
        codes, scales, zeros, g_idx = _decode(scheme, key, parts)
        group = scheme.group or codes.shape[1]
        if codes.shape[1] % (8 // scheme.bits) or codes.shape[1] % group and g_idx is None:
            raise ValueError(f"{key}: {codes.shape[1]} inputs are not whole groups of {group}")
        if keep(f"{key}.weight", codes.shape):
            if g_idx is not None:   # held with its inputs sorted by group, and the order to gather them in
                order = g_idx.argsort(stable=True)
                if not torch.equal(g_idx[order], torch.arange(len(g_idx)) // group):
                    raise ValueError(f"{key}.g_idx: groups of other than {group} inputs cannot be held")
                codes = codes[:, order]
                yield f"{key}.perm", order.to(torch.int32)
            yield f"{key}.blocks", pack_codes(codes, scheme.bits)
            yield f"{key}.scales", scales
            if scheme.zero_points:
                yield f"{key}.zeros", zeros
            continue
        try:
            yield f"{key}.weight", dequantize_int4(pack_codes(codes, scheme.bits), scales, dtype, zeros, g_idx,
                                                   scheme.bits)
        except ValueError as exc:
            raise ValueError(f"{key}{suffixes[1] if 'quantized' in scheme.format else '.scales'}: {exc}") from None
    if pending:
        key, parts = next(iter(pending.items()))
        missing = [s for s in suffixes if s not in parts]
        raise ValueError(f"{key}{missing[0]}: missing beside {key}{next(iter(parts))} (an integer layer is stored as "
                         f"{', '.join(suffixes)})")
