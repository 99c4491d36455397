"""`cliffguard bench moe`: one Qwen3-MoE layer's experts, each way the engine can run them.

A `SparseMoeBlock` of Qwen3-30B-A3B's shape by default (hidden 2048, 128 experts of 768, 8 a token), or with
`--gpt-oss` GPT-OSS's block (`GptOssMoeBlock`: a biased router, biased experts, the clamped SwiGLU) of
gpt-oss-20b's shape (hidden 2880, 32 experts of 2880, 4 a token), random weights, run at each of `--tokens`
batch sizes on the same inputs and routing: the Triton kernels where the
block has them (CUDA: `kernels.triton_moe`, two grouped GEMMs over the pairs sorted by expert), the grouped
matmuls where torch has them (`torch._grouped_mm`; nothing read back from the device either), and the loop
over the experts hit (transformers' way, which reads which experts are hit). Reported: the median
milliseconds of each, tokens per second, each path's speed-up over the loop, and the largest difference of
its outputs from the loop's. `--fp8` adds the experts in FP8 (a scale an output row): the Triton kernels
dequantizing each weight tile as loaded where the block has them, else the loop, timed against the fastest
unquantized path and checked against the loop over the dequantized FP8 weights. `--mxfp4` adds them in MXFP4 as
GPT-OSS's checkpoints store them (`quantization: auto` on a GPU holds them so: random codes, half a byte a weight),
timed and checked the same way; `--int4` in INT4 as pack-quantized checkpoints store them (Kimi K2's experts),
`--int8` in INT8 (8-bit GPTQ's and W8A16's experts: a code a byte).
On a GPU each timing synchronises before and after (`bench.engine.sync`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.engine import sync
from bench.options import device_and_dtype, int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA and on a CPU that computes it natively, else float32) | float32 "
                        "| bfloat16")
    p.add_argument("--gpt-oss", action="store_true",
                   help="GPT-OSS's experts (biases, clamped SwiGLU) at gpt-oss-20b's shape unless sizes are given")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size (Qwen3-30B-A3B's 2048; gpt-oss: 2880)")
    p.add_argument("--experts", type=int, default=None, help="experts (128; gpt-oss: 32)")
    p.add_argument("--top-k", type=int, default=None, help="experts a token (8; gpt-oss: 4)")
    p.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="each expert's intermediate size (768; gpt-oss: 2880)")
    p.add_argument("--tokens", default="1,16,64,256", help="batch sizes in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per size and path (median)")
    p.add_argument("--fp8", action="store_true",
                   help="also the experts in FP8 (a scale an output row, as quantization: fp8 holds a float model's): "
                        "the Triton kernels dequantizing each tile where the block has them, else the loop")
    p.add_argument("--mxfp4", action="store_true",
                   help="also the experts in MXFP4 (GPT-OSS's checkpoints' 4-bit experts, held as stored): the Triton "
                        "kernels decoding each tile where the block has them, else the loop")
    p.add_argument("--int4", action="store_true",
                   help="also the experts in INT4 (pack-quantized checkpoints' experts, Kimi K2's: groups of 32, "
                        "held as stored): the Triton kernels decoding each tile where the block has them, else the "
                        "loop")
    p.add_argument("--int8", action="store_true",
                   help="also the experts in INT8 (8-bit GPTQ's and W8A16's: a code a byte, groups of 32, held as "
                        "stored): the Triton kernels where the block has them, else the loop")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


# (hidden, experts, top k, each expert's intermediate size) by default
SHAPES = {False: (2048, 128, 8, 768), True: (2880, 32, 4, 2880)}


def _sizes(args: argparse.Namespace) -> None:
    """The sizes left unset take the model's shape (Qwen3-30B-A3B's, or gpt-oss-20b's with --gpt-oss)."""
    for name, default in zip(("hidden_size", "experts", "top_k", "moe_intermediate_size"), SHAPES[args.gpt_oss]):
        if getattr(args, name) is None:
            setattr(args, name, default)


def _block(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from engine.model_config import ModelConfig
    from engine.models.gpt_oss import GptOssMoeBlock
    from engine.models.qwen3_moe import SparseMoeBlock
    from engine.parallel import Collectives, ShardShape
    from kernels.fused import get_fused_ops

    shape = {"vocab_size": 1024, "hidden_size": args.hidden_size, "num_hidden_layers": 1, "num_attention_heads": 8,
             "num_key_value_heads": 8, "head_dim": args.hidden_size // 8, "num_experts_per_tok": args.top_k}
    if args.gpt_oss:
        config = ModelConfig.from_hf_config({**shape, "architectures": ["GptOssForCausalLM"],
                                             "intermediate_size": args.moe_intermediate_size,
                                             "num_local_experts": args.experts})
    else:
        config = ModelConfig.from_hf_config({**shape, "architectures": ["Qwen3MoeForCausalLM"],
                                             "intermediate_size": 4 * args.hidden_size, "num_experts": args.experts,
                                             "moe_intermediate_size": args.moe_intermediate_size,
                                             "norm_topk_prob": True})
    kind = GptOssMoeBlock if args.gpt_oss else SparseMoeBlock
    block = kind(config, ShardShape.of(config), Collectives(), get_fused_ops(device, dtype))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return block.to(device=device, dtype=dtype)


def _fp8_blocks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Two more of the block (the same weights, drawn from the same seed): its experts in FP8, one scale an output
    row (`quantization: fp8`'s), and its experts as those FP8 weights dequantized, run by the loop: what the FP8
    path's outputs are checked against."""
    from torch import nn

    from engine.fp8_weights import ROW_SCALES
    from kernels.fp8_gemm import dequantize_blocks, quantize_rows

    fp8, reference = _block(args, device, dtype), _block(args, device, dtype)
    with torch.no_grad():
        for name in ("w13", "w2"):
            weight = getattr(reference, name)
            values, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]))
            setattr(fp8, name, nn.Parameter(values.view(weight.shape), requires_grad=False))
            setattr(fp8, f"{name}_scale", nn.Parameter(scale.view(*weight.shape[:2], 1), requires_grad=False))
            getattr(reference, name).copy_(dequantize_blocks(values, scale, ROW_SCALES).view(weight.shape))
    fp8.fp8_block, fp8._grouped = ROW_SCALES, False
    reference.fused_moe, reference._grouped = None, False
    return fp8, reference


def _packed_blocks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, kind: str):
    """Two more of the block: its experts packed as `kind` says (`SparseMoeBlock.hold_packed`: MXFP4, GPT-OSS's, or
    INT4 / INT8 in groups of 32, Kimi K2's / 8-bit GPTQ's; random codes, scales that make them about the float
    weights' size), and its experts as those weights dequantized, run by the loop."""
    from torch import nn

    from engine.int4_weights import code_std, dequantize_int4
    from kernels.mxfp4 import MXFP4_GROUP, dequantize_packed, mxfp4_scale

    if args.hidden_size % MXFP4_GROUP or args.moe_intermediate_size % MXFP4_GROUP:
        raise ValueError(f"--{kind}: the hidden and intermediate sizes must be multiples of {MXFP4_GROUP}, got "
                         f"{args.hidden_size} and {args.moe_intermediate_size}")
    held, reference = _block(args, device, dtype), _block(args, device, dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        shapes = {name: tuple(getattr(reference, name).shape) for name in ("w13", "w2")}
        held.hold_packed(kind, MXFP4_GROUP)
        for name, (experts, rows, cols) in shapes.items():
            bits = 8 if kind == "int8" else 4
            packed = torch.randint(0, 256, (experts, rows, cols * bits // 8), generator=gen, dtype=torch.int32)
            packed, scale_shape = packed.to(torch.uint8), (experts, rows, cols // MXFP4_GROUP)
            if kind == "mxfp4":
                scales = torch.full(scale_shape, mxfp4_scale(0.02), dtype=torch.uint8)
                dense = dequantize_packed(packed, scales, dtype)
            else:   # values drawn alike (-8 .. 7, or -128 .. 127), scales about 0.02 over their deviation
                scales = (torch.rand(scale_shape, generator=gen) * 0.01 + 0.02 / code_std(bits)).to(dtype)
                dense = dequantize_int4(packed, scales, dtype, bits=bits)
            setattr(held, name, nn.Parameter(packed.to(device), requires_grad=False))
            setattr(held, f"{name}_scales", nn.Parameter(scales.to(device), requires_grad=False))
            getattr(reference, name).copy_(dense)
    reference.fused_moe, reference._grouped = None, False
    return held, reference


def _time(call, device: torch.device, repeats: int) -> float:
    call()   # warm: kernels chosen and compiled
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _paths(block, x: torch.Tensor) -> dict[str, tuple]:
    """name -> (the block's Triton kernels or None, whether it tries the grouped matmul) of each way it runs
    here: the grouped matmul only where it takes `x`'s dtype on its device (tried once on `x`)."""
    from engine.models.qwen3_moe import GROUPED_MM

    paths = {}
    if block.fused_moe is not None:
        paths["triton"] = (block.fused_moe, False)
    if GROUPED_MM is not None:
        block.fused_moe, block._grouped = None, True
        block(x)
        if block._grouped:
            paths["grouped"] = (None, True)
    paths["loop"] = (None, False)
    return paths


def _row(block, paths: dict[str, tuple], x: torch.Tensor, device: torch.device, repeats: int,
         quantized: dict[str, tuple]) -> dict:
    outs, row = {}, {"tokens": x.shape[0]}
    for kind, (held, reference) in quantized.items():   # the FP8 or MXFP4 block, the loop over its dequantized weights
        row[f"{kind}_max_abs_diff"] = float((held(x).float() - reference(x).float()).abs().max())
        seconds = _time(lambda: held(x), device, repeats)
        row[f"{kind}_ms"], row[f"{kind}_tokens_per_s"] = seconds * 1e3, x.shape[0] / seconds
    for name, (fused, grouped) in paths.items():
        block.fused_moe, block._grouped = fused, grouped
        outs[name] = block(x)
        seconds = _time(lambda: block(x), device, repeats)
        row[f"{name}_ms"], row[f"{name}_tokens_per_s"] = seconds * 1e3, x.shape[0] / seconds
    for name in paths:
        if name != "loop":
            row[f"{name}_speedup"] = row["loop_ms"] / row[f"{name}_ms"]
            row[f"{name}_max_abs_diff"] = float((outs[name].float() - outs["loop"].float()).abs().max())
    for kind in quantized:
        row[f"{kind}_speedup"] = row["loop_ms"] / row[f"{kind}_ms"]
        row[f"{kind}_vs_first"] = row[f"{next(iter(paths))}_ms"] / row[f"{kind}_ms"]   # against the fastest path
    return row


def run(args: argparse.Namespace) -> int:
    sizes = int_list(args.tokens, "--tokens", 1, "batch sizes must be >= 1")
    _sizes(args)
    if not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k: must be 1..--experts ({args.experts}), got {args.top_k}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    device, dtype = device_and_dtype(args.device, args.dtype)
    block = _block(args, device, dtype)
    with torch.inference_mode():
        makers = {"fp8": _fp8_blocks, **{kind: (lambda *a, kind=kind: _packed_blocks(*a, kind))
                                         for kind in ("mxfp4", "int4", "int8")}}
        quantized = {kind: make(args, device, dtype) for kind, make in makers.items() if getattr(args, kind)}
        paths = _paths(block, torch.randn(2, args.hidden_size).to(device, dtype))
        rows = [_row(block, paths, torch.randn(n, args.hidden_size, generator=torch.Generator().manual_seed(n)
                                               ).to(device, dtype), device, args.repeats, quantized) for n in sizes]
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "block": "gpt_oss" if args.gpt_oss else "qwen3_moe", "hidden_size": args.hidden_size,
              "experts": args.experts, "top_k": args.top_k, "moe_intermediate_size": args.moe_intermediate_size,
              "paths": list(paths), "rows": rows, **{kind: None if kind not in quantized else (
                  "triton" if quantized[kind][0].fused_moe else "loop") for kind in ("fp8", "mxfp4", "int4", "int8")}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"one {result['block']} MoE layer on {device} ({result['dtype']}): hidden {args.hidden_size}, "
          f"{args.experts} experts of "
          f"{args.moe_intermediate_size}, {args.top_k} a token; {', '.join(paths)}")
    for r in rows:
        cells = [f"{name} {r[f'{name}_ms']:8.2f} ms ({r[f'{name}_tokens_per_s']:9.0f} tok/s"
                 + (f", {r[f'{name}_speedup']:.2f}x the loop, differs by <= {r[f'{name}_max_abs_diff']:.2e})"
                    if name != "loop" else ")") for name in paths]
        cells += [f"{kind} ({result[kind]}) {r[f'{kind}_ms']:8.2f} ms ({r[f'{kind}_tokens_per_s']:9.0f} tok/s, "
                  f"{r[f'{kind}_vs_first']:.2f}x {next(iter(paths))}, differs from its dequantized weights' loop by "
                  f"<= {r[f'{kind}_max_abs_diff']:.2e})" for kind in quantized]
        print(f"  {r['tokens']:>5} tokens: " + "; ".join(cells))
    return 0
