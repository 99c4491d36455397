"""`cliffguard bench mamba`: one Mamba-1 layer's selective scan over a prefill (Jamba's), the torch recurrence against
the Triton kernel.

For each of `--tokens` (one sequence's new tokens), over `--channels` (8,192: Jamba 1.5 Mini's, `mamba_expand` 2 x
4,096) with a state of `--d-state` (16) each, from a random state: `recurrence`, the torch loop (`kernels.
selective_scan.recurrence`: a few launches a token on CUDA, the CPU's path), and `triton`, the kernel (`kernels.
triton_selective_scan`, one launch) where it runs: on CUDA, or anywhere under `TRITON_INTERPRET=1` (tests). Each
time is the median of `--repeats` calls; reported beside it tokens a second, the kernel's speed-up and its bandwidth
(the bytes it must move: x, dt, B, C read and y written once, the states read and written once) as GB/s, and the
largest difference of its output from the recurrence's (exit 1 past 1e-3, relative to the output's largest value).
Random inputs: the scan's cost does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from bench.engine import time_call
from bench.options import device_and_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="x, B and C's: auto (bfloat16 where the device computes it natively) | float32 | bfloat16")
    p.add_argument("--tokens", default="1024,4096,16384", help="comma-separated prefill lengths (one sequence's)")
    p.add_argument("--channels", type=int, default=8192, help="the layer's channels (Jamba 1.5 Mini's: 8,192)")
    p.add_argument("--d-state", type=int, default=16, help="the state a channel holds (mamba_d_state)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per path (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object a length")


def _inputs(tokens: int, channels: int, d_state: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, channels, generator=gen).to(device, dtype)
    dt = F.softplus(torch.randn(tokens, channels, generator=gen) - 2.0).to(device)
    A = (-torch.rand(channels, d_state, generator=gen) * 2 - 0.05).to(device)
    B, C = (torch.randn(tokens, d_state, generator=gen).to(device, dtype) for _ in range(2))
    D = torch.randn(channels, generator=gen).to(device)
    ssm = torch.randn(channels, d_state, generator=gen).to(device)
    return x, dt, A, B, C, D, ssm


def run(args: argparse.Namespace) -> int:
    from kernels import selective_scan

    lengths = [int(n) for n in str(args.tokens).split(",") if n.strip()]
    for name, value in (("tokens", min(lengths, default=0)), ("channels", args.channels),
                        ("d_state", args.d_state), ("repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    device, dtype = device_and_dtype(args.device, args.dtype)
    with_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    failed = False
    for tokens in lengths:
        inputs = _inputs(tokens, args.channels, args.d_state, device, dtype)
        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
               "channels": args.channels, "d_state": args.d_state}
        with torch.no_grad():
            reference, _ = selective_scan.recurrence(*inputs)
            row["recurrence_ms"] = statistics.median(time_call(lambda: selective_scan.recurrence(*inputs), device,
                                                               iters=args.repeats)) * 1e3
            row["recurrence_tokens_per_s"] = tokens / row["recurrence_ms"] * 1e3
            if with_triton:
                from kernels import triton_selective_scan

                out, _ = triton_selective_scan.scan(*inputs)
                row["triton_ms"] = statistics.median(time_call(lambda: triton_selective_scan.scan(*inputs), device,
                                                               iters=args.repeats)) * 1e3
                row["triton_tokens_per_s"] = tokens / row["triton_ms"] * 1e3
                row["triton_speedup"] = row["recurrence_ms"] / row["triton_ms"]
                moved = tokens * args.channels * (dtype.itemsize + 4 + 4) + 2 * tokens * args.d_state * dtype.itemsize \
                    + 3 * args.channels * args.d_state * 4
                row["triton_gb_per_s"] = moved / row["triton_ms"] / 1e6
                row["max_rel_diff"] = float((out - reference).abs().max() / reference.abs().max())
                failed |= row["max_rel_diff"] > 1e-3
        print(json.dumps(row) if args.json else "\n".join(f"{key:26} {value}" for key, value in row.items()) + "\n")
    return 1 if failed else 0
