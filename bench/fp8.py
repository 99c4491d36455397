"""`cliffguard bench fp8`: a decoder layer's four projections with FP8 weights (`--int4`, `--int8`: INT4 or INT8
ones, as an integer checkpoint stores them) against the same weights in the model's dtype.

At a model's shape (Llama 3 8B's by default: hidden 4096, 32 heads and 8 KV heads of 128, MLP 14,336; `--shape
32b`: Qwen3-32B's), random FP8 weights in 128 x 128 blocks are multiplied by `--tokens` rows each way the engine
can: the FP8 layer (`engine.layers.fp8_linear.Fp8Linear`: the Triton GEMM on CUDA, which dequantizes each weight
tile as it loads it; the reference on a CPU, which dequantizes the whole weight on each call) and `F.linear` over
the dequantized weight in the model's dtype (what `quantization: none` holds). Reported per batch size: the
median time of the four projections each way, the FP8 layer's speed-up, the weight bytes each reads, the weight
bandwidth each reaches as a fraction of this device's copy bandwidth (measured in the same run on a GPU: a read and
a write of 1 GiB), and the largest difference of the outputs over the largest output (exit 1 past one rounding). A
decode step reads every weight once: on a GPU the FP8 layer's time at a few rows is what a decode step's projections
cost, half the bytes of bfloat16's. `--int4`: random INT4 codes with a bfloat16 (the model's dtype) scale a group of
128 inputs (`engine.layers.int4_linear.Int4Linear`: the Triton GEMM decoding each tile as loaded, or the weight
dequantized on each call), about a quarter of bfloat16's bytes; `--int8`: 8-bit codes a byte alike (W8A16: GPTQ's
`-GPTQ-Int8`, about half of bfloat16's bytes); with `--zero-points` a zero point a group beside each scale too (AWQ's
kind: `Int4Linear.zeros`, one byte a group more).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from bench.engine import measure_copy_bandwidth, time_call
from bench.options import device_and_dtype, int_list

# (hidden, query heads, KV heads, head_dim, MLP) of the shapes --shape names
SHAPES = {"8b": (4096, 32, 8, 128, 14336), "32b": (5120, 64, 8, 128, 25600), "tiny": (256, 4, 2, 64, 512)}
BLOCK = (128, 128)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA and on a CPU that computes it natively, else float32) | float32 "
                        "| bfloat16")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                   help="8b: Llama 3 8B (default); 32b: Qwen3-32B; tiny: hidden 256 (a quick run)")
    p.add_argument("--tokens", default="1,16,64,256,2048", help="rows (tokens of a step), comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per size and path (median)")
    p.add_argument("--int4", action="store_true",
                   help="INT4 weights (pack-quantized, a scale a group of 128 inputs) instead of FP8")
    p.add_argument("--int8", action="store_true",
                   help="INT8 weights (GPTQ's 8-bit, W8A16: a code a byte, a scale a group of 128) instead of FP8")
    p.add_argument("--zero-points", action="store_true",
                   help="with --int4 or --int8: a zero point a group beside each scale (AWQ's and asymmetric "
                        "checkpoints')")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _layers(shape: str, device: torch.device, dtype: torch.dtype, bits: int = 0, zeros: bool = False):
    """The four projections of one layer as (name, Fp8Linear, dense weight in `dtype`), random FP8 values in
    128 x 128 blocks with scales of 1e-4 to 3e-4 (weights of about a 0.02 standard deviation), or (`bits` 4 or 8) an
    Int4Linear of random codes in groups of 128 (`_int4_layer`, with zero points where `zeros`); the Triton GEMM where
    the engine would run the Triton kernels (CUDA; `CLIFFGUARD_ATTENTION_BACKEND=triton`)."""
    from engine.layers.fp8_linear import Fp8Linear
    from kernels.fp8_gemm import dequantize_blocks
    from kernels.fused import get_fused_ops

    triton = get_fused_ops(device, dtype).__name__ == "kernels.triton_fused"

    hidden, heads, kv_heads, head_dim, inter = SHAPES[shape]
    shapes = {"qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(0)
    layers = []
    for name, (n, k) in shapes.items():
        if bits:
            layers.append((name, *_int4_layer(n, k, device, dtype, triton, gen, zeros, bits)))
            continue
        layer = Fp8Linear(k, n, False, BLOCK, triton=triton).to(device)
        values = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(layer.weight_scale.shape, generator=gen) * 2e-4 + 1e-4
        layer.fill(0, values.to(device), scale.to(device))
        layers.append((name, layer, dequantize_blocks(values, scale, BLOCK).to(device, dtype)))
    return layers


def _int4_layer(n: int, k: int, device: torch.device, dtype: torch.dtype, triton: bool, gen: torch.Generator,
                zeros: bool = False, bits: int = 4):
    """An Int4Linear [n, k] of uniformly drawn codes of `bits`, scales of about 0.02 over the codes' deviation in
    `dtype` (weights of about a 0.02 standard deviation) and, where `zeros`, zero points within 2 (32) of the
    middle, and its dequantized weight."""
    from engine.int4_weights import code_std, dequantize_int4
    from engine.layers.int4_linear import Int4Linear

    layer = Int4Linear(k, n, False, 128, triton=triton, zeros=zeros, bits=bits)
    middle, spread = 1 << (bits - 1), 2 if bits == 4 else 32
    with torch.no_grad():
        layer.blocks = torch.nn.Parameter(torch.randint(0, 256, (n, k * bits // 8), generator=gen,
                                                        dtype=torch.uint8), requires_grad=False)
        layer.scales = torch.nn.Parameter(((torch.rand(n, k // 128, generator=gen) + 0.5) * 0.02 / code_std(bits))
                                          .to(dtype), requires_grad=False)
        if zeros:
            layer.zeros = torch.nn.Parameter(torch.randint(middle - spread, middle + spread + 1, (n, k // 128),
                                                           generator=gen, dtype=torch.uint8), requires_grad=False)
    layer = layer.to(device)
    return layer, dequantize_int4(layer.blocks, layer.scales, dtype, layer.zeros, bits=bits)


def _held_bytes(layer) -> int:
    """The bytes a held layer reads: FP8 values and float32 scales, or integer codes (two a byte, or one) and their
    scales."""
    if hasattr(layer, "held_bytes"):   # Int4Linear
        return layer.held_bytes()
    return layer.weight.numel() + layer.weight_scale.numel() * 4


def _median(call, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls, after one untimed (kernels chosen and compiled)."""
    return statistics.median(time_call(call, device, warmup=1, iters=repeats))


def _row(layers, rows: int, device, dtype, repeats: int, bandwidth: float | None) -> dict:
    xs = {name: torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
          for name, layer, _ in layers}
    held = _median(lambda: [layer(xs[name]) for name, layer, _ in layers], device, repeats)
    dense = _median(lambda: [F.linear(xs[name], weight) for name, _, weight in layers], device, repeats)
    diff = max(float((layer(xs[name]).float() - F.linear(xs[name], weight).float()).abs().max()
                     / F.linear(xs[name], weight).float().abs().max()) for name, layer, weight in layers)
    held_bytes = sum(_held_bytes(layer) for _, layer, _ in layers)
    dense_bytes = sum(weight.numel() * weight.element_size() for _, _, weight in layers)
    row = {"tokens": rows, "held_ms": held * 1e3, "dense_ms": dense * 1e3, "speedup": dense / held,
           "held_weight_bytes": held_bytes, "dense_weight_bytes": dense_bytes, "max_rel_diff": diff}
    if bandwidth is not None:
        row["held_fraction_of_copy"] = held_bytes / held / bandwidth
        row["dense_fraction_of_copy"] = dense_bytes / dense / bandwidth
    return row


def run(args: argparse.Namespace) -> int:
    sizes = int_list(args.tokens, "--tokens", 1, "row counts must be >= 1")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.int4 and args.int8:
        raise ValueError("--int4, --int8: one width at a time")
    bits = 4 if args.int4 else 8 if args.int8 else 0
    if args.zero_points and not bits:
        raise ValueError("--zero-points: integer weights' (with --int4 or --int8)")
    device, dtype = device_and_dtype(args.device, args.dtype)
    with torch.inference_mode():
        layers = _layers(args.shape, device, dtype, bits, args.zero_points)
        bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else None
        rows = [_row(layers, n, device, dtype, args.repeats, bandwidth) for n in sizes]
    # the same products up to the order of their float32 sums (and one rounding of each output to dtype)
    bound = 2 ** -6 if dtype != torch.float32 else 1e-5
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "shape": args.shape,
              "format": f"int{bits}" if bits else "fp8", "zero_points": args.zero_points,
              "path": "triton" if layers[0][1].triton else "reference",
              "block": [1, 128] if bits else list(BLOCK),
              "copy_bytes_per_s": bandwidth, "rows": rows, "agree": all(r["max_rel_diff"] <= bound for r in rows)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["agree"] else 1
    held = f"INT{bits} (groups of 128{', zero points' if args.zero_points else ''}" if bits \
        else "FP8 (blocks of 128 x 128"
    print(f"one layer's projections at the {args.shape} shape on {device} ({result['dtype']}): {held}, "
          f"{result['path']}) vs F.linear over the dequantized weight"
          + (f"; copy bandwidth {bandwidth / 1e9:.0f} GB/s" if bandwidth else ""))
    for r in rows:
        share = (f"; weights at {r['held_fraction_of_copy']:.2f} vs {r['dense_fraction_of_copy']:.2f} of copy"
                 if bandwidth else "")
        print(f"  {r['tokens']:>5} tokens: {result['format']} {r['held_ms']:8.3f} ms, dense {r['dense_ms']:8.3f} ms "
              f"({r['speedup']:.2f}x){share}; differs by <= {r['max_rel_diff']:.2e} of the largest output")
    if not result["agree"]:
        print(f"the {result['format'].upper()} layer's outputs differ from F.linear's by more than {bound:.1e} of "
              "the largest")
    return 0 if result["agree"] else 1
