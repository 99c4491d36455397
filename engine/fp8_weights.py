"""FP8 checkpoints, and FP8 weights held as FP8 (the device key `quantization`). The formats read:

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
activations are never quantized (`activation_scheme`, `input_activations` do not matter). A per-channel or per-tensor
scale is a block spanning the whole row or tensor (`WHOLE`).

How the model holds them is the device's `quantization` (`QUANTIZATIONS`, `served_fp8_block`):

- `auto` (the default): on a GPU with FP8 conversions (compute capability 8.9 and up) the attention and MLP
  projections of an FP8 checkpoint (`FP8_LINEARS`, and the experts of a block that runs its own) stay FP8 with their
  own scales (`engine.layers.fp8_linear`: one byte a weight, half of bfloat16), wherever the model's loading reads
  them unchanged (`engine.models.exact_fp8_loading`) and its fused, expert and tensor-parallel cuts start on whole
  scale blocks (`fp8_cuts_aligned`); every other tensor, and any model elsewhere, dequantized to the model's dtype
  as it is read (bfloat16: twice the checkpoint's bytes);
- `fp8`: FP8 on every device (a CPU dequantizes a layer's weight on each call: memory, not speed), and a float
  checkpoint's projections quantized as they are read, one scale an output row (`kernels.fp8_gemm.quantize_rows`);
  an FP8 checkpoint whose loading changes its tensors, or whose cuts split a block, the same way from its
  dequantized weights (a second rounding of each value);
- `mxfp4`, `int4`, `int8`: a checkpoint's MXFP4 (GPT-OSS's) experts, or INT4 or INT8 experts and projections held
  as stored on every device (`engine.models.held_packed`, `held_int4`; `auto` holds them so on a GPU, `fp8` too,
  beside its FP8 projections), nothing held in FP8;
- `none`: everything in the model's dtype.

The capacity plan counts what the model holds (`engine.models.held_weight_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.config import FP8_MIN_CAPABILITY, QUANTIZATIONS, ConfigError
from kernels.fp8_gemm import FP8_WEIGHT_DTYPE, WHOLE, Fp8Block, quantize_blocks, scale_grid
from kernels.fp8_gemm import dequantize_blocks as dequantize_fp8_blocks

__all__ = ["FP8_LINEARS", "QUANTIZATIONS", "ROW_SCALES", "SCALE_SUFFIX", "WHOLE", "dequantize_fp8_blocks",
           "dequantized", "fp8_cuts_aligned", "fp8_part", "fp8_weight_block", "fp8_weights", "served_fp8_block"]

ROW_SCALES = (1, WHOLE)                   # a float checkpoint quantized at load: one scale an output row
# The projections held in FP8: a decoder layer's attention and MLP (not the embedding, the head or the routers).
FP8_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

SCALE_SUFFIX = ".weight_scale_inv"    # the block-scaled format's; llm-compressor's is ".weight_scale"
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


def dequantized(hf_name: str, tensor: torch.Tensor, pending: dict[str, dict[str, torch.Tensor]], block: Fp8Block,
                suffix: str = SCALE_SUFFIX, keep: Callable[[str, torch.Tensor], bool] | None = None,
                kept_scales: dict[str, torch.Tensor] | None = None) -> tuple[str, torch.Tensor | None]:
    """An FP8 checkpoint's tensor as loading reads it: an FP8 `X.weight` or its scales `X<suffix>` (`weight_scale_inv`,
    or llm-compressor's `weight_scale`) held in `pending` until the other comes (None), then the weight dequantized,
    or, where `keep(X.weight, the weight)` says the model holds it in FP8, the weight as stored, its scales into
    `kept_scales`; a static activation scale (`X.input_scale`, llm-compressor's; `X.activation_scale`, transformers' per-tensor
    FP8's) skipped (None); any other tensor itself. ValueError naming the weight whose scales do not fit it."""
    if hf_name.endswith((".input_scale", ".activation_scale")):   # a static activation scheme's: not read
        return hf_name, None
    if hf_name.endswith(suffix):
        key, part = hf_name[:-len(suffix)], suffix
    elif hf_name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
        key, part = hf_name[:-len(".weight")], ".weight"
    else:
        return hf_name, tensor
    pair = pending.setdefault(key, {})
    pair[part] = tensor
    if len(pair) < 2:
        return hf_name, None
    del pending[key]
    if keep is not None and keep(f"{key}.weight", pair[".weight"]):
        kept_scales[f"{key}.weight"] = pair[suffix]
        return f"{key}.weight", pair[".weight"]
    try:
        return f"{key}.weight", dequantize_fp8_blocks(pair[".weight"], pair[suffix], block)
    except ValueError as exc:
        raise ValueError(f"{key}.weight: {exc}") from None


def served_fp8_block(checkpoint_block: Fp8Block | None, setting: str, device_type: str,
                     capability: tuple[int, int] | None, exact: bool) -> Fp8Block | None:
    """The scale block the model's FP8 projections hold (`setting`: the device's `quantization`), None for
    weights in the model's dtype. `checkpoint_block`: an FP8 checkpoint's (`ModelConfig.fp8_weight_block`);
    `capability`: a GPU's compute capability (None: not known, taken to convert FP8, as the capacity plan takes a
    GPU it has not seen); `exact`: the checkpoint's blocks can be kept as they are (`exact_fp8_loading` and
    `fp8_cuts_aligned`), else its weights are dequantized as read and requantized a row at a time."""
    if setting not in QUANTIZATIONS:
        raise ConfigError(f"quantization: one of {', '.join(QUANTIZATIONS)}, got {setting!r}")
    gpu_converts = device_type == "cuda" and (capability is None or capability >= FP8_MIN_CAPABILITY)
    if setting in ("none", "mxfp4", "int4", "int8") or setting == "auto" and (
            checkpoint_block is None or not gpu_converts or not exact):
        return None
    if device_type == "cuda" and not gpu_converts:
        raise ConfigError(f"quantization: fp8 needs a GPU of compute capability "
                          f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (Ada, Hopper, Blackwell); this one is "
                          f"{'.'.join(map(str, capability))}: use quantization: auto")
    if checkpoint_block is None or not exact:
        return ROW_SCALES
    return 1 if checkpoint_block[0] == WHOLE else checkpoint_block[0], checkpoint_block[1]


def fp8_cuts_aligned(block: Fp8Block, cuts: dict[str, tuple[list[int], list[int]]]) -> bool:
    """Whether every cut of the FP8 projections lies on a scale block's edge: `cuts` maps each projection to the
    rows where its fused parts and its rank's share start, and the columns where a row-parallel share starts."""
    rows, cols = block   # a side spanning its axis: one scale for all its cuts
    return all(rows == WHOLE or r % rows == 0 for starts, _ in cuts.values() for r in starts) and all(
        cols == WHOLE or c % cols == 0 for _, starts in cuts.values() for c in starts)


def fp8_part(values: torch.Tensor, scale: torch.Tensor | None, checkpoint_block: Fp8Block | None,
             full_shape: tuple[int, int], cut, layer_block: Fp8Block, first_row: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpoint tensor as an FP8 projection's part holds it: (FP8 values [rows, K], their scales in the
    layer's blocks). `values` is this rank's cut of the stored tensor (`cut`: the model's cut of a tensor of the
    stored shape `full_shape`), to go at row `first_row` of the layer. An FP8 tensor keeps its values, and its
    `scale` (blocks of `checkpoint_block`) is cut to the rows and columns kept; a float one is quantized a row at
    a time, or in the layer's blocks where it holds an FP8 checkpoint's (a projection the checkpoint left in float).
    ValueError where a layer block would span two of the checkpoint's."""
    if values.dtype != FP8_WEIGHT_DTYPE:
        return quantize_blocks(values, layer_block)
    n, k = full_shape
    grid = scale_grid(full_shape, checkpoint_block)
    if scale.numel() != grid[0] * grid[1]:
        raise ValueError(f"weight {full_shape} in blocks of {checkpoint_block} takes scales of shape {grid}, got "
                         f"{tuple(scale.shape)}")
    picks = []
    for axis, (size, side, layer_side, offset) in enumerate(((n, checkpoint_block[0], layer_block[0], first_row),
                                                             (k, checkpoint_block[1], layer_block[1], 0))):
        index = torch.arange(size).view((size, 1) if axis == 0 else (1, size)).expand(n, k)
        kept = cut(index).select(1 - axis, 0)                 # the stored rows (columns) this part holds
        theirs = kept // min(side, size)                      # their block in the checkpoint's grid
        ours = (torch.arange(len(kept)) + offset) // layer_side   # and in the layer's
        first = theirs[torch.searchsorted(ours, ours, right=False)]
        if not torch.equal(first, theirs):
            raise ValueError(f"a cut at {'row' if axis == 0 else 'column'} {int(kept[0])} splits a scale block of "
                             f"{side}")
        picks.append(theirs[torch.unique_consecutive(ours, return_counts=True)[1].cumsum(0) - 1])
    return values, scale.float().reshape(grid)[picks[0]][:, picks[1]]
