"""The quantized checkpoints config.json may name (`quantization_config`, or llm-compressor's older
`compression_config`), read into the `ModelConfig` fields that say how their tensors are stored:

- FP8 weights with block, per-channel or per-tensor scales (`engine.fp8_weights`): `fp8_weight_block`,
  `fp8_scale_suffix`;
- GPT-OSS's MXFP4 experts (`quant_method: mxfp4`, that architecture alone; `kernels.mxfp4`): `mxfp4_experts`;
- INT4 and INT8 weights (`engine.int4_formats`: llm-compressor's pack-quantized, AutoAWQ's, GPTQ's): `int4_group`,
  the layers quantized (`int4_modules`), `int4_format`, `int4_zero_points`, `int4_act_order`, `int4_bits`;
- a KV-cache-only scheme (the cache's scales: `engine.config.quantizes_kv_cache_only`): no field.

Any other method is refused naming the key, before anything loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from engine.config import ConfigError, quantizes_kv_cache_only
from engine.fp8_weights import SCALE_SUFFIX, fp8_weights
from engine.int4_formats import int4_scheme

__all__ = ["weight_format_fields"]


def weight_format_fields(cfg: dict[str, Any], arch: Any) -> dict[str, Any]:
    """The `ModelConfig` fields of config.json `cfg`'s quantization (architecture `arch`); a ConfigError naming the
    key for a method that is not served."""
    old = cfg.get("compression_config")   # llm-compressor's older key: quantized where it has groups or a method
    key = "compression_config" if cfg.get("quantization_config") is None and isinstance(old, dict) and {
        "config_groups", "quant_method", "kv_cache_scheme"} & set(old) else "quantization_config"
    quant = cfg.get(key)
    mxfp4 = arch == "GptOssForCausalLM" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    int4 = int4_scheme(quant, key)
    fp8 = None if int4 is not None else fp8_weights(quant, key)
    if quant is not None and not quantizes_kv_cache_only(quant) and not mxfp4 and fp8 is None and int4 is None:
        method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else repr(quant)
        raise ConfigError(f"{key}: quantized checkpoints ({method}) are not supported (served: FP8, INT4 as "
                          "compressed-tensors, AWQ or GPTQ store it, INT8 as compressed-tensors (pack- or "
                          "int-quantized) or GPTQ do, GPT-OSS's MXFP4); serve the model's bfloat16 checkpoint (an FP8 "
                          "KV cache is the device key kv_cache_dtype)")
    return {"fp8_weight_block": fp8[0] if fp8 else None, "fp8_scale_suffix": fp8[1] if fp8 else SCALE_SUFFIX,
            "mxfp4_experts": mxfp4, "int4_group": int4.group if int4 else None,
            "int4_modules": int4.modules if int4 else ((), ()), "int4_format": int4.format if int4 else "",
            "int4_zero_points": bool(int4 and int4.zero_points), "int4_act_order": bool(int4 and int4.act_order),
            "int4_bits": int4.bits if int4 else 4}


Config = TypeVar("Config")


def read_folder_config(folder: Path, read: Callable[[dict[str, Any]], Config]) -> Config:
    """`read` of a model folder's config.json; an AutoGPTQ folder's quantize_config.json, where config.json is silent
    of its quantization, read as its `quantization_config` (an error in it named by that file)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json: not found in model folder {folder}")
    try:
        cfg = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
    gptq = folder / "quantize_config.json"   # AutoGPTQ's, where its config.json is silent of it
    if not isinstance(cfg, dict) or cfg.get("quantization_config") is not None or not gptq.is_file():
        return read(cfg)
    try:
        quant = json.loads(gptq.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"quantize_config.json: not valid JSON ({exc})") from exc
    if not isinstance(quant, dict):
        raise ConfigError(f"quantize_config.json: must be a JSON object, got {quant!r:.80}")
    try:
        return read({**cfg, "quantization_config": {"quant_method": "gptq", **quant}})
    except ConfigError as exc:   # named by the file that says it
        raise ConfigError(str(exc).replace("quantization_config.", "quantize_config.json: ", 1)) from None
